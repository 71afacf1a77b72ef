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
  return _quantize_rows(xf, jnp.max(jnp.abs(xf), axis=-1))


def _quantize_rows(xf: jax.Array, absmax: jax.Array) -> tuple[jax.Array, jax.Array]:
  scale = jnp.where(absmax > 0, absmax / FP8_MAX, 1.0)
  # Division (not multiplication by 448/absmax) keeps power-of-two scales exact.
  q = jnp.clip(xf / scale[..., None], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
  return q, scale


def quantize_fp8_many(xs: list[jax.Array]) -> list[tuple[jax.Array, jax.Array]]:
  """:func:`quantize_fp8` of each array, their row maxima read by one reduction.

  A step writes several entries per layer (MLA's latent and rope key, GQA's K and V).
  Quantised one by one, each runs a reduction kernel of its own on a GPU; here the
  arrays' absolute values, zero-padded to one last-axis length, go through one variadic
  reduction (a maximum per array), so a layer's write runs one reduction kernel
  (docs/step_time.md, "Launches per MoE layer"; stacked instead, the stack was built
  in a kernel of its own). Zeros never raise a maximum of absolute values, so every
  scale and value equals quantize_fp8's.
  Arrays whose leading shapes differ are quantised one by one.

  Args:
    xs: arrays [..., D_i] of any float dtype.

  Returns:
    [(values [..., D_i] float8_e4m3fn, scale [...] f32)], one per array.
  """
  if len(xs) < 2 or len({x.shape[:-1] for x in xs}) > 1:
    return [quantize_fp8(x) for x in xs]
  xfs = [x.astype(jnp.float32) for x in xs]
  width = max(x.shape[-1] for x in xfs)
  padded = [jnp.pad(jnp.abs(x), [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])
            for x in xfs]
  # One variadic reduction: a maximum per array, over arrays of one shape.
  absmax = jax.lax.reduce(padded, [jnp.float32(0)] * len(padded),
                          lambda a, b: [jnp.maximum(u, v) for u, v in zip(a, b)],
                          (padded[0].ndim - 1,))
  return [_quantize_rows(x, m) for x, m in zip(xfs, absmax)]


def dequantize_fp8(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
  """Inverse of :func:`quantize_fp8`: q [..., D] * scale [...] -> [..., D] in ``dtype``."""
  return (q.astype(jnp.float32) * scale[..., None].astype(jnp.float32)).astype(dtype)
