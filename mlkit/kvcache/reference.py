"""Pure-jnp references for paged attention and the batched tag check.

These define the numerics the Pallas kernels must match: pages are gathered
through the block tables, fp8 is dequantised with the per-token scales, keys at
positions >= length are masked, and softmax accumulates in f32 (the attention
cores from ``mlkit.model.attention``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mlkit.kvcache.fp8 import FP8_DTYPE
from mlkit.kvcache.state import gather_pages, paged_mask
from mlkit.model.attention import gqa_attention, mla_latent_attention
# Decode attention and the tag check have one reference each, beside their kernels;
# re-exported here so the cache's users find every paged reference in one place.
from pallas_kernels.paged_attention.reference import (  # noqa: F401
    paged_gqa_decode_reference, paged_mla_decode_reference)
from pallas_kernels.tag_check.reference import tag_check_reference  # noqa: F401


def _check_scales(what: str, pages: jax.Array, scale) -> None:
  if pages.dtype == FP8_DTYPE and scale is None:
    raise ValueError(f"dtype mismatch: {what} pages are float8_e4m3fn but no scales were given")
  if pages.dtype != FP8_DTYPE and scale is not None:
    raise ValueError(f"dtype mismatch: {what} pages are {pages.dtype} but scales were given "
                     "(scales belong to float8_e4m3fn pages)")
  if scale is not None and scale.shape != pages.shape[:-1]:
    raise ValueError(f"{what} scales have shape {scale.shape}, pages need {pages.shape[:-1]}")


def _check_meta(pages: jax.Array, block_tables: jax.Array, lengths: jax.Array) -> None:
  if block_tables.ndim != 2 or lengths.shape != block_tables.shape[:1]:
    raise ValueError(f"block_tables {block_tables.shape} must be [B, M] and lengths {lengths.shape} [B]")


def paged_mla_prefill_reference(q_latent, q_rope, latent_pages, k_rope_pages, latent_scale,
                                k_rope_scale, block_tables, q_positions, lengths, *, scale):
  """Chunked-prefill MLA (absorbed) over paged latents: a chunk attends to earlier pages and itself.

  The chunk's own entries must already be written to the pages.

  Args:
    q_latent: [B, T, H, C] absorbed queries; q_rope: [B, T, H, R].
    latent_pages: [N, P, C]; k_rope_pages: [N, P, R] (bf16/f32, or fp8 with scales).
    latent_scale, k_rope_scale: [N, P] f32 for fp8 pages, else None.
    block_tables: [B, M] int32; q_positions: [B, T] int32; lengths: [B] int32.
    scale: softmax scale.

  Returns:
    [B, T, H, C] in q_latent's dtype. Key s is visible to the query at position p
    iff s <= p and s < length.

  Raises:
    ValueError: on missing/unexpected scales or malformed metadata.
  """
  _check_scales("latent", latent_pages, latent_scale)
  _check_scales("k_rope", k_rope_pages, k_rope_scale)
  _check_meta(latent_pages, block_tables, lengths)
  with jax.named_scope("paged_mla_reference"):
    latent = gather_pages(latent_pages, latent_scale, block_tables, lengths)  # [B, S, C]
    k_rope = gather_pages(k_rope_pages, k_rope_scale, block_tables, lengths)  # [B, S, R]
    mask = paged_mask(q_positions, lengths, latent.shape[1])  # [B, T, S]
    return mla_latent_attention(q_latent, q_rope, latent, k_rope, mask, scale)


def paged_gqa_prefill_reference(q, k_pages, v_pages, k_scale, v_scale, block_tables, q_positions,
                                lengths, *, scale):
  """Chunked-prefill GQA over paged K/V: a chunk attends to earlier pages and itself.

  Args:
    q: [B, T, H, hd].
    k_pages, v_pages: [N, P, KV, hd] (bf16/f32, or fp8 with scales).
    k_scale, v_scale: [N, P, KV] f32 for fp8 pages, else None.
    block_tables: [B, M] int32; q_positions: [B, T] int32; lengths: [B] int32.
    scale: softmax scale.

  Returns:
    [B, T, H, hd] in q's dtype.

  Raises:
    ValueError: on missing/unexpected scales or malformed metadata.
  """
  _check_scales("k", k_pages, k_scale)
  _check_scales("v", v_pages, v_scale)
  _check_meta(k_pages, block_tables, lengths)
  with jax.named_scope("paged_gqa_reference"):
    k = gather_pages(k_pages, k_scale, block_tables, lengths)  # [B, S, KV, hd]
    v = gather_pages(v_pages, v_scale, block_tables, lengths)
    mask = paged_mask(q_positions, lengths, k.shape[1])
    return gqa_attention(q, k, v, mask, scale)
