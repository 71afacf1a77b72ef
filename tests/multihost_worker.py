"""One process of the 2-process test: a sharded decode step of the engine's runner.

Run as ``python tests/multihost_worker.py --port P --process_id I --out DIR``; the
test starts two of these on 127.0.0.1. Each process has 2 CPU devices, so the
global mesh ("data", "tensor", "expert") = (1, 2, 2) spans both processes, and
the engine's jitted steps run SPMD across them with gloo collectives.

``run_scenario(mesh=None)`` is also what the test calls in its own process for
the single-process reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

if __name__ == "__main__":
  # Before jax is imported: 2 host devices per process.
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402


def run_scenario(mesh=None) -> dict:
  """One decode step of the engine's Runner over two requests with a filled paged cache.

  Args:
    mesh: a (possibly multi-process) mesh to shard params, KV state and inputs
      over, or None for the plain single-device run.

  Returns:
    {name: numpy array}: the sampled tokens, ok flags and sampled logits.
  """
  import jax
  import jax.numpy as jnp
  from configs import TINY_MLA
  from mlkit import parallel
  from mlkit.engine import EngineConfig, Runner, StepBatch
  from mlkit.kvcache import KVCacheConfig, PAD_PAGE, PageAllocator, init_paged_state, sync_tags
  from test_parallel import init_params_np

  cfg = dataclasses.replace(TINY_MLA, n_layers=1, first_k_dense=0)
  ecfg = EngineConfig(model=cfg, kv=KVCacheConfig(8, 4, "float32"), max_running=2,
                      batch_buckets=(2,), prefill_buckets=(8,), prefill_token_budget=16,
                      max_pages_per_seq=4, record_logits=True)
  params = init_params_np(cfg)
  alloc = PageAllocator(8, 4)
  lengths = [7, 5]  # after this step's token
  for rid, n in enumerate(lengths):
    alloc.admit(rid, n)
  # A cache as a prefill would leave it: random entries in every slot (the step masks
  # slots past each length), drawn with numpy so both processes hold the same values.
  rng = np.random.default_rng(7)
  state = init_paged_state(cfg, ecfg.kv)
  state = state.replace(layers=[{k: jnp.asarray(rng.standard_normal(v.shape), v.dtype)
                                 for k, v in layer.items()} for layer in state.layers])
  state = sync_tags(state, alloc.device_tags())
  bt = np.full((2, 4), PAD_PAGE, np.int32)
  et = np.zeros((2, 4), np.int32)
  for rid in range(2):
    row = alloc.block_table(rid)
    bt[rid, :len(row)] = [p for p, _ in row]
    et[rid, :len(row)] = np.asarray([t for _, t in row], np.uint32).view(np.int32)
  z = np.zeros(2, np.int32)
  batch = StepBatch(rng.integers(0, cfg.vocab_size, (2, 1)).astype(np.int32),
                    np.asarray([[n - 1] for n in lengths], np.int32), bt, et,
                    np.asarray(lengths, np.int32), z, np.zeros(2, np.uint32), z,
                    np.zeros(2, np.float32), z, np.ones(2, np.float32))
  if mesh is not None:
    params = parallel.shard_params(params, mesh)
    state = parallel.shard_kv_state(state, mesh)
    if jax.process_count() > 1:  # the weights really are split across the processes
      assert not params["layers"][0]["ffn"]["w_gate"].is_fully_addressable
    # Inputs as global (replicated) arrays: host numpy cannot address other processes' devices.
    batch = StepBatch(*[parallel.replicate(getattr(batch, f.name), mesh)
                        for f in dataclasses.fields(StepBatch)])
  tok, ok, state, logits = Runner(params, ecfg).run("decode", state, batch)
  return {"tok": _host(tok), "ok": _host(ok), "logits": _host(logits)}


def _host(x) -> np.ndarray:
  """The full value of a (possibly multi-process) array on this host."""
  import jax
  from jax.experimental import multihost_utils
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--process_id", type=int, required=True)
  parser.add_argument("--num_processes", type=int, default=2)
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  import jax
  from mlkit import parallel
  parallel.initialize_distributed(f"127.0.0.1:{args.port}", args.num_processes, args.process_id,
                                  initialization_timeout=60)
  assert jax.process_count() == args.num_processes, jax.process_count()
  assert len(jax.devices()) == 2 * args.num_processes, jax.devices()
  mesh = parallel.make_mesh(parallel.MeshConfig(tensor=2, expert=args.num_processes))
  out = run_scenario(mesh)
  np.savez(os.path.join(args.out, f"result_{args.process_id}.npz"), **out,
           num_devices=len(jax.devices()), process_count=jax.process_count())
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
