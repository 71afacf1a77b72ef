"""One process of the 2-process test: an Engine whose pool spans two JAX processes.

Run as ``python tests/multihost_worker.py --port P --process_id I --out DIR
--pool_port Q``; the test starts two of these on 127.0.0.1. Each process has 2
CPU devices, so the global mesh ("data", "tensor", "expert") = (1, 2, 2) spans
both processes and the engine's jitted steps run SPMD across them with gloo
collectives. Process 0 leads (it schedules and serves the requests; every
device operation is sent to the follower first), process 1 follows
(``mlkit.engine.lockstep``).

``run_scenario(mesh=None)`` is also what the test calls in its own process for
the single-process reference.
"""

from __future__ import annotations

import argparse
import dataclasses
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

# Two prompts sharing a 9-token prefix, the second arriving once the first is prefilled (the
# prefix cache shares two pages and copies a third), with a third prompt; greedy and sampled
# requests; the overlapped engine (decode inputs chained on the device).
PROMPTS = [[5, 9, 2, 7, 7, 1, 3, 8, 4, 6, 11], [5, 9, 2, 7, 7, 1, 3, 8, 4, 12], [3, 1, 4, 1, 5]]


def _engine(mesh):
  from configs import TINY_MLA
  from mlkit.engine import Engine, EngineConfig
  from mlkit.kvcache import KVCacheConfig
  from test_parallel import init_params_np
  cfg = dataclasses.replace(TINY_MLA, n_layers=1, first_k_dense=0)  # one MoE layer
  ecfg = EngineConfig(model=cfg, kv=KVCacheConfig(24, 4, "float32"), max_running=4,
                      batch_buckets=(4,), prefill_buckets=(12,), prefill_token_budget=24,
                      max_pages_per_seq=6, record_logits=True, overlap=True, prefix_cache=True)
  return Engine(init_params_np(cfg), ecfg, mesh=mesh)


def serve(engine) -> dict:
  """Serves PROMPTS (the second and third after two steps); tokens and logits per request."""
  from mlkit.sampling import SamplingParams
  sampling = [SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=5),
              SamplingParams(max_new_tokens=6, temperature=0.8, top_k=20, seed=3)]
  ids = [engine.submit(PROMPTS[0], sampling[0])]
  engine.step()
  engine.step()
  ids += [engine.submit(PROMPTS[i], sampling[i]) for i in (1, 2)]
  engine.run_until_done(max_steps=100)
  out = {}
  for i, rid in enumerate(ids):
    out[f"tok{i}"] = np.asarray(engine.get(rid).output)
    out[f"logits{i}"] = np.stack(engine.logits[rid])
  out["prefill_tokens_saved"] = engine.prefix_cache.stats.tokens_saved
  return out


def run_scenario(mesh=None) -> dict:
  """The single-process reference: the same engine on ``mesh`` (None: one device)."""
  return serve(_engine(mesh))


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--process_id", type=int, required=True)
  parser.add_argument("--num_processes", type=int, default=2)
  parser.add_argument("--pool_port", type=int, required=True)
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  import jax
  from mlkit import parallel
  from mlkit.engine import lockstep
  parallel.initialize_distributed(f"127.0.0.1:{args.port}", args.num_processes, args.process_id,
                                  initialization_timeout=60)
  assert jax.process_count() == args.num_processes, jax.process_count()
  mesh = parallel.make_mesh(parallel.MeshConfig(tensor=2, expert=args.num_processes))
  engine = _engine(mesh)
  # The weights really are split across the processes.
  assert not engine.runner.params["layers"][0]["ffn"]["w_gate"].is_fully_addressable
  address = ("127.0.0.1", args.pool_port)
  from mlkit import wire
  key = wire.server_key(["127.0.0.1"]).value  # the run's key file (tests/conftest.py)
  if args.process_id == 0:
    followers = lockstep.Followers(address, args.num_processes - 1, key, timeout_s=60)
    engine.lead(followers)
    try:
      out = serve(engine)
    finally:  # the follower stops (and the processes can shut down) whatever happened
      followers.close()
    np.savez(os.path.join(args.out, "leader.npz"), **out, num_devices=len(jax.devices()))
  else:
    ops, stopped = engine.follow(address, key, connect_timeout_s=60)
    np.savez(os.path.join(args.out, f"follower_{args.process_id}.npz"), ops=ops, stopped=stopped)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
