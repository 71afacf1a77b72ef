"""Per-token float8 (e4m3) quantisation of KV entries.

Each token (and, for GQA, each KV head) gets its own f32 scale = absmax / 448,
computed at write time, so one outlier token cannot flatten its neighbours'
precision. Dequantised value = stored * scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The rounding itself is the page-write kernel's reference, so the kernel and the
# scatters store the same bytes.
from pallas_kernels.page_write.reference import FP8_MAX, quantize_many, quantize_rows

__all__ = ["FP8_DTYPE", "FP8_MAX", "dequantize_fp8", "quantize_fp8", "quantize_fp8_many"]

FP8_DTYPE = jnp.float8_e4m3fn


def quantize_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Quantises over the last axis with one scale per leading index.

  Args:
    x: [..., D] any float dtype.

  Returns:
    (values [..., D] float8_e4m3fn, scale [...] f32). An all-zero row gets scale
    1, so it stores zeros and dequantises to zeros without a division by zero.
  """
  xf = x.astype(jnp.float32)
  return quantize_rows(xf, jnp.max(jnp.abs(xf), axis=-1))


def quantize_fp8_many(xs: list[jax.Array]) -> list[tuple[jax.Array, jax.Array]]:
  """:func:`quantize_fp8` of each array, their row maxima read by one reduction
  (``pallas_kernels.page_write.quantize_many``, which says why).

  Args:
    xs: arrays [..., D_i] of any float dtype.

  Returns:
    [(values [..., D_i] float8_e4m3fn, scale [...] f32)], one per array.
  """
  return quantize_many(xs)


def dequantize_fp8(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
  """Inverse of :func:`quantize_fp8`: q [..., D] * scale [...] -> [..., D] in ``dtype``."""
  return (q.astype(jnp.float32) * scale[..., None].astype(jnp.float32)).astype(dtype)
