"""Small shared layers: RMSNorm and the SwiGLU FFN."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mlkit.quant import matmul


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """RMSNorm over the last axis, computed in f32, returned in x's dtype."""
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def swiglu(p: dict, x: jax.Array, *, backend: str | None = None, out_dtype=None) -> jax.Array:
  """Dense SwiGLU FFN: w_down(silu(w_gate x) * w_up x). x [..., D] -> [..., D] in
  ``out_dtype`` (default x's)."""
  h = (jax.nn.silu(matmul(x, p["w_gate"], backend=backend))
       * matmul(x, p["w_up"], backend=backend))
  return matmul(h, p["w_down"], backend=backend, out_dtype=out_dtype)
