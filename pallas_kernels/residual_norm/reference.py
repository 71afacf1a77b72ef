"""The residual add and RMSNorm in jnp: the decoder's ops, bit for bit.

A decoder layer adds its attention output and its FFN output to the residual stream,
each rounded to the stream's dtype (bf16 + bf16 -> bf16), and the next layer's first
RMSNorm reads the sum. These are the model's own ops (``mlkit.model.transformer``
runs them on the "xla" backend); the kernel (``ops.py``) computes the same roundings.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """RMSNorm over the last axis, computed in f32, returned in x's dtype: the model's
  (``mlkit.model.layers`` imports it from here)."""
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def add_deltas(x: jax.Array, deltas) -> jax.Array:
  """``x`` [..., D] plus each delta [..., D] in order, each rounded to x's dtype first
  and every sum rounded to x's dtype (the model's ``x + attn_out`` then ``+ ffn_out``)."""
  for d in deltas:
    x = x + d.astype(x.dtype)
  return x


def add_residual(x: jax.Array, deltas) -> jax.Array:
  """:func:`add_deltas`, materialised: the residual stream a decoder layer hands on.

  Without the barrier XLA fuses the chain of residual adds into every consumer,
  recomputing the stream from all earlier layers' outputs, which then all stay live to
  the end of the step (two [T, D] f32 buffers per layer: 0.47 GB per layer for an
  8192-token Kimi prefill chunk).
  """
  if not deltas:
    return x
  return jax.lax.optimization_barrier(add_deltas(x, deltas))


def residual_norm_reference(x: jax.Array, deltas, scale: jax.Array, eps: float):
  """The residual stream after ``deltas`` and its RMSNorm.

  Args:
    x: [..., D] the residual stream (bf16 in the model).
    deltas: a tuple of [..., D] arrays of any float dtype, added in order.
    scale: [D] the norm's scale.
    eps: the norm's epsilon.

  Returns:
    (x_new [..., D], normed [..., D]), both in x's dtype.
  """
  x = add_residual(x, tuple(deltas))
  return x, rms_norm(x, scale, eps)
