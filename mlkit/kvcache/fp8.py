"""Per-token float8 (e4m3) quantisation of KV entries.

Each token (and, for GQA, each KV head) gets its own f32 scale = absmax / 448,
computed at write time, so one outlier token cannot flatten its neighbours'
precision. Dequantised value = stored * scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_DTYPE = jnp.float8_e4m3fn
# Largest finite e4m3fn value.
FP8_MAX = 448.0


def quantize_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Quantises over the last axis with one scale per leading index.

  Args:
    x: [..., D] any float dtype.

  Returns:
    (values [..., D] float8_e4m3fn, scale [...] f32). An all-zero row gets scale
    1, so it stores zeros and dequantises to zeros without a division by zero.
  """
  xf = x.astype(jnp.float32)
  absmax = jnp.max(jnp.abs(xf), axis=-1)  # [...]
  scale = jnp.where(absmax > 0, absmax / FP8_MAX, 1.0)
  # Division (not multiplication by 448/absmax) keeps power-of-two scales exact.
  q = jnp.clip(xf / scale[..., None], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
  return q, scale


def dequantize_fp8(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
  """Inverse of :func:`quantize_fp8`: q [..., D] * scale [...] -> [..., D] in ``dtype``."""
  return (q.astype(jnp.float32) * scale[..., None].astype(jnp.float32)).astype(dtype)
