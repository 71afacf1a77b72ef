"""Benchmark case for the FP8 grouped matmul: the kernel against XLA's path.

``bench_case(dims, ...)`` builds a :class:`pallas_kernels.benchmark.Bench` for one
shape (m, k, n, experts; ``pallas_kernels.targets``): rows spread over the experts as
evenly as the INT4 grouped bench spreads them, fp8 values over e4m3's range and a scale
per 128 x 128 block, checked against the f32 reference at the bf16 tolerance.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import benchmark as bm
from pallas_kernels.fp8_matmul.grouped import fp8_grouped_matmul, grouped_block_sizes
from pallas_kernels.fp8_matmul.reference import SCALE_BLOCK
from pallas_kernels.int4_matmul.bench import balanced_group_sizes


def job_cost(dims: dict, *, weights: str = "fp8") -> tuple[int, int]:
  """(bytes, FLOPs) one call must at least move and do: the weights of the experts that
  receive rows (min(M, E) of them, as ``balanced_group_sizes`` spreads the rows; "fp8": the
  values and f32 block scales, "bf16": the dequantised bf16 twin), activations in and
  outputs out in bf16; 2 M K N FLOPs.

  Raises:
    ValueError: an unknown weight format.
  """
  m, k, n, e = dims["m"], dims["k"], dims["n"], dims["experts"]
  if weights == "fp8":
    per_expert = k * n + -(-k // SCALE_BLOCK) * -(-n // SCALE_BLOCK) * 4
  elif weights == "bf16":
    per_expert = k * n * 2
  else:
    raise ValueError(f"weights must be 'fp8' or 'bf16', got {weights!r}")
  return min(m, e) * per_expert + m * k * 2 + m * n * 2, 2 * m * k * n


def _make(seed: int, m: int, k: int, n: int, e: int):
  kx, kv, ks = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  values = (jax.random.normal(kv, (e, k, n), jnp.float32) * 60).astype(jnp.float8_e4m3fn)
  scales = jax.random.uniform(ks, (e, -(-k // SCALE_BLOCK), -(-n // SCALE_BLOCK)),
                              jnp.float32, 0.25e-2, 4e-2)
  return x, values, scales, balanced_group_sizes(m, e)


def bench_case(dims: dict, *, backend: str = "pallas", seed: int = 0) -> bm.Bench:
  """The Bench of one FP8 grouped case.

  Args:
    dims: m, k, n, experts (pallas_kernels.targets).
    backend: "pallas" on a GPU, "interpret" on a CPU.
    seed: base seed of the random inputs.

  Returns:
    A Bench with impls "pallas" (the kernel) and "xla" (the jnp reference), each checked
    against the reference on f32 activations.
  """
  m, k, n, e = dims["m"], dims["k"], dims["n"], dims["experts"]
  nbytes, _ = job_cost(dims)
  sets = bm.once(lambda: [_make(seed * 1000 + i, m, k, n, e)
                          for i in range(bm.rotation_sets(nbytes))])
  ref = bm.once(lambda: fp8_grouped_matmul(sets()[0][0].astype(jnp.float32), *sets()[0][1:],
                                           backend="xla"))
  bs = grouped_block_sizes(m, n, k, e)
  impls = [bm.Impl("pallas", functools.partial(fp8_grouped_matmul, backend=backend), sets, ref,
                   note=f"Mosaic GPU kernel, tiles {bs.tile_n}x{bs.tile_m}x{bs.tile_k}, "
                   f"depth {bs.max_concurrent_steps}"),
           bm.Impl("xla", functools.partial(fp8_grouped_matmul, backend="xla"), sets, ref,
                   note="jnp reference: dequantise, ragged dot")]
  return bm.Bench(*job_cost(dims), bm.TOL["bf16"], impls,
                  {"input_sets": bm.rotation_sets(nbytes), "rows_per_expert": m / e,
                   "group_sizes": np.asarray(balanced_group_sizes(m, e)).tolist()[:4]})
