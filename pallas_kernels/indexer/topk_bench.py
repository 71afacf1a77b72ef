"""Benchmark case for the top-k selection: the Pallas kernel against XLA's top-k.

``bench_case(dims, ...)`` builds a :class:`pallas_kernels.benchmark.Bench` for one
shape of ``topk_positions`` (dims as in the target cases: batch, context, topk).
Scores are random with exact ties (rounded to 1/64, as ReLU'd index scores tie),
every position visible; both implementations must return exactly the same
positions (ties toward the earlier position).

The job reads each row's scores once and writes its k positions: memory-bound with
no FLOPs to speak of. The kernel itself reads a row ten times (a count, eight radix
rounds and the output pass), mostly from L2.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import benchmark as bm
from pallas_kernels.indexer.ops import TopkBlockSizes
from pallas_kernels.indexer.ops import topk_positions


def job_cost(dims: dict) -> tuple[int, int]:
  """(bytes, FLOPs): B x S f32 scores read once, B x min(k, S) int32 positions written; the
  compares are not counted (no FLOPs). Pure arithmetic on ``dims``."""
  b, s, k = dims["batch"], dims["context"], dims["topk"]
  return b * s * 4 + b * min(k, s) * 4, 0


@jax.jit(static_argnames=("shape",))
def _scores(key, *, shape):
  return jnp.round(jax.random.normal(key, shape, jnp.float32) * 64.0) / 64.0


def bench_case(dims: dict, *, backend: str = "pallas", seed: int = 0) -> bm.Bench:
  """The Bench of one top-k case.

  Args:
    dims: batch, context, topk (pallas_kernels.targets).
    backend: "pallas" on a GPU, "interpret" on a CPU.
    seed: base seed of the random inputs.

  Returns:
    A Bench with impls "pallas" and "xla", each checked exactly against XLA's positions.
  """
  b, s, k = dims["batch"], dims["context"], dims["topk"]
  set_bytes = b * s * 4
  sets = bm.once(lambda: [(_scores(jax.random.key(seed * 1000 + i), shape=(b, s)),)
                          for i in range(bm.rotation_sets(set_bytes))])
  ref = bm.once(lambda: np.asarray(topk_positions(*sets()[0], k=k, backend="xla")))

  def check(out):
    out = np.asarray(out)
    return {"correct": bool(np.array_equal(out, ref())), "mismatches": int(np.sum(out != ref()))}

  impls = [bm.Impl("pallas", functools.partial(topk_positions, k=k, backend=backend), sets,
                   check=check, note="Triton kernel: radix select, one program per row"),
           bm.Impl("xla", functools.partial(topk_positions, k=k, backend="xla"), sets,
                   check=check, note="lax.top_k, then the positions sorted")]
  return bm.Bench(*job_cost(dims), 0.0, impls,
                  {"kernel_impl": "triton", "block_sizes": dataclasses.asdict(TopkBlockSizes()),
                   "input_sets": bm.rotation_sets(set_bytes)})
