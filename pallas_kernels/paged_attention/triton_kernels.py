"""Split-K paged decode attention kernels on the Pallas Triton backend.

These are the fallback for shapes the Mosaic GPU kernels (mla_mgpu.py,
gqa_mgpu.py; the preferred Hopper backend, docs/architecture.md) do not take:
MLA with C % 128 != 0, page_size != 64 or R % 64 != 0; GQA with
head_dim % 64 != 0, 64 % page_size != 0 or an fp8 cache with KV % 8 != 0
(gqa_mgpu reads the [64 tokens, KV] scale tile in the wgmma layout, which
needs KV % 8 == 0); f32 caches; and queries whose dtype differs from a bf16
cache. They also serve as a second implementation to compare against on the
GPU (BlockSizes(impl="triton")). Here block-table gathers are plain
vectorised loads (`ref[ids]`), which Triton lowers to pointer arithmetic.

Numerics (both kernels):
* fp8 pages are converted to the query dtype (bf16) inside the kernel: q is
  bf16 and a tensor-core dot wants equal operand types. Triton converts
  e4m3 -> bf16 natively on sm_90, so the Mosaic ptxas (ISA >= 9.2) caveat
  does not apply here.
* Per-token scales are folded, never applied per element: the key scale
  multiplies the [heads, tokens] logits column-wise, the value scale
  multiplies the probabilities before the PV dot.
* Softmax statistics (max, sum) and the accumulator are f32; probabilities
  are rounded to the value dtype only as the PV dot's operand.
"""

import math

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# Finite, so masked logits never make exp(-inf - -inf) = NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_LOG2E = math.log2(math.e)


def _dot_nt(a, b):
  """a [m, k] @ b[n, k].T -> [m, n] accumulated in f32."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                         preferred_element_type=jnp.float32)


def _dot_nn(a, b):
  """a [m, k] @ b[k, n] -> [m, n] accumulated in f32."""
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32)


def _online_softmax_step(logits, carry):
  """One flash-decoding update; returns (p [bh, bk] f32, alpha, m_new, l_new)."""
  acc, m_prev, l_prev = carry
  m_new = jnp.maximum(m_prev, logits.max(axis=-1))
  alpha = jnp.exp2((m_prev - m_new) * _LOG2E)
  p = jnp.exp2((logits - m_new[:, None]) * _LOG2E)
  l_new = alpha * l_prev + p.sum(axis=-1)
  return p, alpha, m_new, l_new


def _mla_logits(q_lat, q_rope, lat, rope, lat_scale_ref, rope_scale_ref, ids,
                col_ok):
  """Unscaled MLA logits of one step and the latent's value scales.

  Args:
    q_lat [bh, C], q_rope [bh, R]: the query; lat [bk, C], rope [bk, R]: the
      step's tokens in the compute dtype (fp8 not yet scaled).
    lat_scale_ref, rope_scale_ref: per-token scale refs or None (not fp8).
    ids: what indexes the scale refs to give this step's [bk] scales.
    col_ok [1, bk]: the columns that hold a real token.

  Returns:
    (logits [bh, bk] f32 = q_lat . lat + q_rope . rope, dequantised;
     lat_scale [1, bk] f32, 0 where not col_ok, or None).
  """
  s_lat = _dot_nt(q_lat, lat)  # [bh, bk] f32
  s_rope = _dot_nt(q_rope, rope)
  if lat_scale_ref is None:
    return s_lat + s_rope, None
  bk = col_ok.shape[1]
  # Scales of unused slots may be garbage too; zero them so p * scale stays
  # finite (a [1, bk] select, cheap).
  lat_scale = jnp.where(col_ok, lat_scale_ref[ids].reshape(1, bk), 0.0)
  rope_scale = jnp.where(col_ok, rope_scale_ref[ids].reshape(1, bk), 0.0)
  return s_lat * lat_scale + s_rope * rope_scale, lat_scale


def _split_range(b, pages_per_split, page_size, lengths_ref):
  """Page range [start, end) of this program's split for request b."""
  split = pl.program_id(2)
  length = lengths_ref[b]
  num_pages = (length + page_size - 1) // page_size
  start = split * pages_per_split
  end = jnp.minimum(start + pages_per_split, num_pages)
  return start, end, length


def _page_ids(block_tables_ref, b, first, pages_per_block, num_pages_total,
              length, page_size):
  """Page ids of one step; entries past the used pages (e.g. the cache's
  PAD_PAGE = -1) become page 0 and used ids are clamped, so no load is ever
  out of bounds. Their tokens are masked anyway."""
  ids = block_tables_ref[b, pl.ds(first, pages_per_block)]
  used = (length + page_size - 1) // page_size
  idx = first + lax.broadcasted_iota(jnp.int32, (pages_per_block,), 0)
  ids = jnp.clip(ids, 0, num_pages_total - 1)
  return jnp.where(idx < used, ids, 0)


def mla_kernel(q_lat_ref, q_rope_ref, lat_ref, rope_ref, lat_scale_ref,
               rope_scale_ref, block_tables_ref, lengths_ref,
               acc_ref, m_ref, l_ref, *, scale, pages_per_split,
               pages_per_block):
  """One (request, head block, split) program of paged MLA decode.

  Refs:
    q_lat_ref [bh, C], q_rope_ref [bh, R]: this head block's query.
    lat_ref [N, ps, C], rope_ref [N, ps, R]: all pages (gathered here).
    lat_scale_ref, rope_scale_ref [N, ps] or None.
    block_tables_ref [B, P_pad], lengths_ref [B]: whole tables.
    acc_ref [bh, C] f32, m_ref, l_ref [bh] f32: this split's partials.
  """
  b = pl.program_id(0)
  bh, c = q_lat_ref.shape
  ps = lat_ref.shape[1]
  bk = pages_per_block * ps
  start, end, length = _split_range(b, pages_per_split, ps, lengths_ref)
  q_lat = q_lat_ref[...]
  q_rope = q_rope_ref[...]
  compute_dtype = q_lat.dtype

  def body(i, carry):
    acc, _, _ = carry
    first = start + i * pages_per_block
    ids = _page_ids(block_tables_ref, b, first, pages_per_block,
                    lat_ref.shape[0], length, ps)  # [ppb]
    lat = lat_ref[ids].reshape(bk, c).astype(compute_dtype)
    rope = rope_ref[ids].reshape(bk, rope_ref.shape[2]).astype(compute_dtype)
    col_ok = (first * ps + lax.broadcasted_iota(jnp.int32, (1, bk), 1)) < length
    logits, lat_scale = _mla_logits(q_lat, q_rope, lat, rope, lat_scale_ref,
                                    rope_scale_ref, ids, col_ok)
    logits = logits * scale
    pos = first * ps + lax.broadcasted_iota(jnp.int32, (bh, bk), 1)
    logits = jnp.where(pos < length, logits, MASK_VALUE)
    p, alpha, m_new, l_new = _online_softmax_step(logits, carry)
    pv = p if lat_scale is None else p * lat_scale
    # Slots past the length may hold anything, NaN included (fp8 garbage
    # bytes 0x7f/0xff are NaN), and p == 0 does not cancel NaN: zero them.
    row = first * ps + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
    lat = jnp.where(row < length, lat, jnp.zeros_like(lat))
    acc = acc * alpha[:, None] + _dot_nn(pv.astype(compute_dtype), lat)
    return acc, m_new, l_new

  init = (jnp.zeros((bh, c), jnp.float32),
          jnp.full((bh,), MASK_VALUE, jnp.float32),
          jnp.zeros((bh,), jnp.float32))
  steps = pl.cdiv(jnp.maximum(end - start, 0), pages_per_block)
  acc, m, l = lax.fori_loop(0, steps, body, init)
  acc_ref[...] = acc
  m_ref[...] = m
  l_ref[...] = l


def gqa_kernel(q_ref, k_ref, v_ref, k_scale_ref, v_scale_ref,
               block_tables_ref, lengths_ref, acc_ref, m_ref, l_ref, *,
               scale, pages_per_split, pages_per_block):
  """One (request, KV head, split) program of paged GQA decode.

  Refs:
    q_ref [bh, hd]: the query heads of this KV head's group (padded to bh).
    k_ref, v_ref [N, ps, hd]: this KV head's slice of all pages.
    k_scale_ref, v_scale_ref [N, ps] or None.
    block_tables_ref [B, P_pad], lengths_ref [B].
    acc_ref [bh, hd] f32, m_ref, l_ref [bh] f32.
  """
  b = pl.program_id(0)
  bh, hd = q_ref.shape
  ps = k_ref.shape[1]
  bk = pages_per_block * ps
  start, end, length = _split_range(b, pages_per_split, ps, lengths_ref)
  q = q_ref[...]
  compute_dtype = q.dtype

  def body(i, carry):
    acc, _, _ = carry
    first = start + i * pages_per_block
    ids = _page_ids(block_tables_ref, b, first, pages_per_block,
                    k_ref.shape[0], length, ps)
    k = k_ref[ids].reshape(bk, hd).astype(compute_dtype)
    v = v_ref[ids].reshape(bk, hd).astype(compute_dtype)
    logits = _dot_nt(q, k)
    v_scale = None
    if k_scale_ref is not None:
      # Zero garbage scales of unused slots (see mla_kernel).
      col_ok = (first * ps + lax.broadcasted_iota(jnp.int32, (1, bk), 1)) < length
      logits = logits * jnp.where(col_ok, k_scale_ref[ids].reshape(1, bk), 0.0)
      v_scale = jnp.where(col_ok, v_scale_ref[ids].reshape(1, bk), 0.0)
    logits = logits * scale
    pos = first * ps + lax.broadcasted_iota(jnp.int32, (bh, bk), 1)
    logits = jnp.where(pos < length, logits, MASK_VALUE)
    p, alpha, m_new, l_new = _online_softmax_step(logits, carry)
    pv = p if v_scale is None else p * v_scale
    # Unused slots may hold NaN; p == 0 does not cancel it (see mla_kernel).
    row = first * ps + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
    v = jnp.where(row < length, v, jnp.zeros_like(v))
    acc = acc * alpha[:, None] + _dot_nn(pv.astype(compute_dtype), v)
    return acc, m_new, l_new

  init = (jnp.zeros((bh, hd), jnp.float32),
          jnp.full((bh,), MASK_VALUE, jnp.float32),
          jnp.zeros((bh,), jnp.float32))
  steps = pl.cdiv(jnp.maximum(end - start, 0), pages_per_block)
  acc, m, l = lax.fori_loop(0, steps, body, init)
  acc_ref[...] = acc
  m_ref[...] = m
  l_ref[...] = l


def sparse_mla_kernel(q_lat_ref, q_rope_ref, lat_ref, rope_ref, lat_scale_ref,
                      rope_scale_ref, block_tables_ref, lengths_ref, indices_ref,
                      acc_ref, m_ref, l_ref, *, scale, page_size, table_width,
                      indices_per_split, block_k):
  """One (request, head block, split) program of sparse paged MLA decode.

  Like mla_kernel, but a step gathers ``block_k`` selected token rows instead
  of whole pages: token position p lives at row
  block_tables[b, p // page_size] * page_size + p % page_size of the
  flattened pages, so the latent read per query is bounded by the selection
  (K rows), not the context (docs/sparse_attention.md).

  Refs:
    q_lat_ref [bh, C], q_rope_ref [bh, R]: this head block's query.
    lat_ref [N * ps, C], rope_ref [N * ps, R]: all pages, one row per token slot.
    lat_scale_ref, rope_scale_ref [N * ps] or None.
    block_tables_ref [B * M]: the flattened tables (a 1-D gather per step).
    lengths_ref [B].
    indices_ref [B, K_pad]: selected positions, -1 = none.
    acc_ref [bh, C] f32, m_ref, l_ref [bh] f32: this split's partials.
  """
  b = pl.program_id(0)
  split = pl.program_id(2)
  bh, c = q_lat_ref.shape
  rows_total = lat_ref.shape[0]
  num_pages = rows_total // page_size
  length = lengths_ref[b]
  q_lat = q_lat_ref[...]
  q_rope = q_rope_ref[...]
  compute_dtype = q_lat.dtype

  def body(i, carry):
    acc, _, _ = carry
    first = split * indices_per_split + i * block_k
    pos = indices_ref[b, pl.ds(first, block_k)]  # [bk] token positions
    # -1 padding and (defensively) positions past the length select nothing;
    # they read row 0 so no load is out of bounds, and are masked below.
    valid = (pos >= 0) & (pos < length)
    pos = jnp.where(valid, pos, 0)
    page = block_tables_ref[b * table_width + pos // page_size]  # [bk]
    page = jnp.clip(page, 0, num_pages - 1)
    rows = jnp.where(valid, page * page_size + pos % page_size, 0)
    lat = lat_ref[rows].astype(compute_dtype)  # [bk, C]
    rope = rope_ref[rows].astype(compute_dtype)  # [bk, R]
    col_ok = valid.reshape(1, block_k)
    # Invalid columns read row 0, whose scales may be garbage: _mla_logits
    # zeroes them.
    logits, lat_scale = _mla_logits(q_lat, q_rope, lat, rope, lat_scale_ref,
                                    rope_scale_ref, rows, col_ok)
    logits = jnp.where(col_ok, logits * scale, MASK_VALUE)
    p, alpha, m_new, _ = _online_softmax_step(logits, carry)
    # A block with no valid column would give p = exp(0) = 1 while m is still
    # MASK_VALUE; zero p so an empty row keeps l == 0 (and gives zeros).
    p = jnp.where(col_ok, p, 0.0)
    l_new = alpha * carry[2] + p.sum(axis=-1)
    pv = p if lat_scale is None else p * lat_scale
    # Invalid rows read row 0, which may hold NaN (fp8 0x7f); p == 0 does not
    # cancel NaN, so zero them.
    lat = jnp.where(valid.reshape(block_k, 1), lat, jnp.zeros_like(lat))
    acc = acc * alpha[:, None] + _dot_nn(pv.astype(compute_dtype), lat)
    return acc, m_new, l_new

  init = (jnp.zeros((bh, c), jnp.float32),
          jnp.full((bh,), MASK_VALUE, jnp.float32),
          jnp.zeros((bh,), jnp.float32))
  acc, m, l = lax.fori_loop(0, indices_per_split // block_k, body, init)
  acc_ref[...] = acc
  m_ref[...] = m
  l_ref[...] = l
