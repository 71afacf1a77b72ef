"""MLA's absorbed products in jnp: the references of ``absorbed_values`` and
``absorbed_query``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention.query import scaled_query_reference


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


def absorbed_query_reference(q_all: jax.Array, wkv_b: jax.Array, nope: int, *,
                             kind: str | None = None, heads: int | None = None):
  """MLA's absorbed query from q_all [B, H, nope + R] = [q_nope | rope(q_pe)].

  q_latent = q_nope @ (wkv_b's key half)^T per head, over wkv_b whole with q_nope
  zero-padded over the value half, the f32 result cast to q_all's dtype: the
  expression of ``mlkit.model.attention.mla_absorb_query``, op for op. With ``kind``,
  the decode kernels' scaled query of (q_latent, q_all's rope columns), as
  ``pallas_kernels.paged_attention.query.scaled_query_reference`` computes it.

  Args:
    q_all: [B, H, nope + R] the query's nope part and its rotated rope part.
    wkv_b: [C, H, nope + v] the key and value up-projection, plain, in q_all's dtype.
    nope: the key half's width per head.
    kind: None (q_latent), "f16" or "fp8" (the scaled query).
    heads: the scaled query's padded head count (>= H); with ``kind`` only.

  Returns:
    q_latent [B, H, C] in q_all's dtype (kind None); else (latent [B, heads, C],
    rope [B, heads, R] in f16 or e4m3, q_scale [B, heads] f32).
  """
  q = jnp.pad(q_all[..., :nope], ((0, 0), (0, 0), (0, wkv_b.shape[-1] - nope)))
  q_latent = jnp.einsum("bhd,chd->bhc", q, wkv_b,
                        preferred_element_type=jnp.float32).astype(q_all.dtype)
  if kind is None:
    return q_latent
  return scaled_query_reference(q_latent, q_all, heads=heads, kind=kind,
                                rope_cols=(nope, q_all.shape[-1] - nope))
