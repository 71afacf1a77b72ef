"""One process of the 2-process test: a sharded prefill + decode step of the engine's runner.

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
  """Prefills two requests and decodes one token each with the engine's Runner.

  Args:
    mesh: a (possibly multi-process) mesh to shard params, KV state and inputs
      over, or None for the plain single-device run.

  Returns:
    {name: numpy array}: tokens, ok flags and sampled logits of both steps.
  """
  import jax
  from configs import TINY_MLA
  from mlkit import parallel
  from mlkit.engine import EngineConfig, Runner, StepBatch, UniqueTagAllocator
  from mlkit.kvcache import KVCacheConfig, PAD_PAGE, init_paged_state, sync_tags
  from test_parallel import init_params_np

  cfg = dataclasses.replace(TINY_MLA, n_layers=2)
  ecfg = EngineConfig(model=cfg, kv=KVCacheConfig(8, 4, "float32"), max_running=2,
                      batch_buckets=(2,), prefill_buckets=(8,), prefill_token_budget=16,
                      max_pages_per_seq=4, record_logits=True)
  params = init_params_np(cfg)
  state = init_paged_state(cfg, ecfg.kv)
  alloc = UniqueTagAllocator(8, 4)
  lengths = [6, 4]
  for rid, n in enumerate(lengths):
    alloc.admit(rid, n)

  def place(x):
    return x if mesh is None else parallel.replicate(x, mesh)

  def tables():
    bt = np.full((2, 4), PAD_PAGE, np.int32)
    et = np.zeros((2, 4), np.int32)
    for rid in range(2):
      row = alloc.block_table(rid)
      bt[rid, :len(row)] = [p for p, _ in row]
      et[rid, :len(row)] = np.asarray([t for _, t in row], np.uint32).view(np.int32)
    return bt, et

  def batch(tokens, positions, lens, last):
    bt, et = tables()
    z = np.zeros(2, np.int32)
    fields = StepBatch(tokens.astype(np.int32), positions.astype(np.int32), bt, et,
                       np.asarray(lens, np.int32), np.asarray(last, np.int32),
                       np.zeros(2, np.uint32), z, np.zeros(2, np.float32), z, np.ones(2, np.float32))
    return StepBatch(*[place(getattr(fields, f.name)) for f in dataclasses.fields(StepBatch)])

  def synced(state):
    state = sync_tags(state, alloc)
    return state if mesh is None else state.replace(page_tags=place(state.page_tags))

  if mesh is not None:
    params = parallel.shard_params(params, mesh)
    state = parallel.shard_kv_state(state, mesh)
    if jax.process_count() > 1:  # the weights really are split across the processes
      assert not params["layers"][1]["ffn"]["w_gate"].is_fully_addressable
  runner = Runner(params, ecfg)
  rng = np.random.default_rng(7)
  prompt = rng.integers(0, cfg.vocab_size, (2, 8))
  positions = np.broadcast_to(np.arange(8), (2, 8))
  tok1, ok1, state, lg1 = runner.run("prefill", synced(state),
                                     batch(prompt, positions, lengths, [n - 1 for n in lengths]))
  tok1_host = _host(tok1)
  for rid, n in enumerate(lengths):
    alloc.extend(rid, n + 1)
  tok2, ok2, state, lg2 = runner.run("decode", synced(state),
                                     batch(tok1_host[:, None], np.asarray([[6], [4]]),
                                           [n + 1 for n in lengths], [0, 0]))
  return {"tok1": tok1_host, "ok1": _host(ok1), "lg1": _host(lg1), "tok2": _host(tok2),
          "ok2": _host(ok2), "lg2": _host(lg2)}


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
