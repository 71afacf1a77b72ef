"""One process of the 2-process checkpoint test: each process reads only what its devices hold.

Run as ``python tests/checkpoint_multihost_worker.py --port P --process_id I --src DIR
--out DIR``; the test (tests/test_checkpoint_streaming.py) starts two of these on
127.0.0.1. Each process has 2 CPU devices. The Hugging Face checkpoint at ``--src``
is loaded with ``load_hf_checkpoint``'s reader (``open_hf_checkpoint(...).load()``)
onto two global meshes over the 4 devices (:func:`scenarios`), and each process
writes, per mesh, the tensor bytes it read for every leaf, which leaves it holds
only part of, and (process 0) every leaf's assembled value.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __name__ == "__main__":
  # Before jax is imported: 2 host devices per process, and CPU programs compiled as in the
  # suite's own processes (tests/cpu_compile_flags.py; this file's folder is on sys.path).
  import cpu_compile_flags
  os.environ["XLA_FLAGS"] = cpu_compile_flags.with_test_flags(
      "--xla_force_host_platform_device_count=2")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

def scenarios() -> dict:
  """{name: (mesh, recipe name, rules)} over the global devices (process 0's first).

  "tensor4": tensor=4, each process holding two tensor shards, experts split along
  their FFN width too (``expert_mlp="tensor"``): vocabulary, attention heads, expert
  columns, and w_down's rows in whole int4 groups are split between the processes.
  "expert2": tensor=2 x expert=2 with the devices ordered so that the expert axis
  spans the processes: each reads half of every expert stack; fp8 attention (too
  small for whole 128x128 blocks per shard) is replicated and read whole.
  """
  import jax
  from mlkit import parallel
  devs = jax.devices()
  interleaved = [devs[0], devs[2], devs[1], devs[3]]  # [tensor][expert]: expert 0 -> process 0
  return {
      "tensor4": (parallel.make_mesh(parallel.MeshConfig(tensor=4), devs), "int4-experts-g32",
                  parallel.ShardingRules(expert_mlp="tensor")),
      "expert2": (parallel.make_mesh(parallel.MeshConfig(tensor=2, expert=2), interleaved),
                  "int4-experts-g32-fp8-rest", None),
  }


def _held_in_part(x) -> bool:
  """Whether this process's devices hold only part of the global array ``x``."""
  held = {tuple(s.indices(d)[:2] for s, d in zip(idx, x.shape))
          for idx in x.sharding.addressable_devices_indices_map(x.shape).values()}
  return sum(int(np.prod([b - a for a, b in box])) for box in held) < x.size


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--process_id", type=int, required=True)
  parser.add_argument("--src", required=True)
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  import jax
  from jax.experimental import multihost_utils
  from mlkit import parallel
  from mlkit.checkpoint import open_hf_checkpoint
  from mlkit.quant import RECIPES
  from mlkit.quant.tree import is_quantised
  parallel.initialize_distributed(f"127.0.0.1:{args.port}", 2, args.process_id,
                                  initialization_timeout=60)
  assert jax.process_count() == 2 and len(jax.devices()) == 4, jax.devices()
  report, values = {}, {}
  for kind, (mesh, recipe, rules) in scenarios().items():
    ck = open_hf_checkpoint(args.src, recipe=RECIPES[recipe], mesh=mesh, rules=rules)
    params, _ = ck.load()
    partial = [name for name, leaf in zip(ck.names, jax.tree_util.tree_leaves(params, is_leaf=is_quantised))
               if any(_held_in_part(x) for x in jax.tree_util.tree_leaves(leaf))]
    report[kind] = {"recipe": recipe, "bytes_read": ck.bytes_read, "partial": partial,
                    "nbytes": {n: ck.nbytes(i) for i, n in enumerate(ck.names)}}
    for j, x in enumerate(jax.tree_util.tree_leaves(params)):  # every process joins each gather
      values[f"{kind}_{j}"] = np.asarray(multihost_utils.process_allgather(x, tiled=True)).view(np.uint8)
  with open(os.path.join(args.out, f"report_{args.process_id}.json"), "w") as f:
    json.dump(report, f)
  if args.process_id == 0:
    np.savez(os.path.join(args.out, "values.npz"), **values)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
