"""MLA's absorbed value product in jnp: the reference of ``absorbed_values``."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def absorbed_values_reference(out_latent: jax.Array, wkv_b: jax.Array, nope: int) -> jax.Array:
  """Per-head values [B, T, H, v] from MLA's latent attention outputs.

  The product runs over wkv_b whole ([C, H, nope + v]: its value half is a strided
  slice of every row, which XLA would copy before a product over it alone) and keeps
  the value half of the f32 result, cast to the activations' dtype: the expression of
  ``mlkit.model.attention.mla_absorb_output`` on the "xla" backend, op for op.

  Args:
    out_latent: [B, T, H, C] the attention's outputs in latent space.
    wkv_b: [C, H, nope + v] the key (first ``nope`` columns of each head) and value
      up-projection, plain (dequantised) in out_latent's dtype.
    nope: the key half's width per head.

  Returns:
    [B, T, H, v] in out_latent's dtype.
  """
  out = jnp.einsum("bthc,chd->bthd", out_latent, wkv_b, preferred_element_type=jnp.float32)
  return out[..., nope:].astype(out_latent.dtype)
