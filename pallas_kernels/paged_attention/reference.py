"""Pure-jnp references for paged decode attention (the ``xla`` backend)."""

import jax
from jax import lax
import jax.numpy as jnp

_HI = lax.Precision.HIGHEST


def _gather_tokens(pages, block_tables):
  """pages [N, ps, ...] gathered by block_tables [B, P] -> [B, P * ps, ...].

  Out-of-pool ids (PAD_PAGE = -1 past a request's pages) are clamped; their
  tokens lie past the length and are masked by the callers.
  """
  b, p = block_tables.shape
  g = pages[jnp.clip(block_tables, 0, pages.shape[0] - 1)]  # [B, P, ps, ...]
  return g.reshape(b, p * pages.shape[1], *pages.shape[2:])


def dequant_pages(pages, scales, block_tables):
  """Each request's tokens gathered through its block table, f32, times their scales when given."""
  x = _gather_tokens(pages, block_tables).astype(jnp.float32)
  if scales is not None:
    s = _gather_tokens(scales, block_tables).astype(jnp.float32)
    x = x * s[..., None]
  return x


# The references are jitted so that an eager call (the tests, tools) compiles one program
# per shape instead of one per operation; inside a caller's jit they are inlined.
@jax.jit
def paged_mla_decode_reference(q_latent, q_rope, latent, k_rope, latent_scale,
                               k_rope_scale, block_tables, lengths, *, scale):
  """MLA decode attention (absorbed form) over a paged latent cache.

  out[b, h] = sum_t softmax_t(scale * (q_latent[b,h].latent_t + q_rope[b,h].k_rope_t))
  * latent_t over the first lengths[b] tokens of request b, with token t at
  page block_tables[b, t // page_size], slot t % page_size. Softmax in f32.

  Args:
    q_latent: [B, H, C] absorbed query (bf16 or f32).
    q_rope: [B, H, R] rope part of the query.
    latent: [N, page_size, C] latent pages, bf16 or float8_e4m3fn.
    k_rope: [N, page_size, R] rope-key pages, same dtype as latent.
    latent_scale: [N, page_size] f32 per-token scales when fp8, else None.
    k_rope_scale: [N, page_size] f32 per-token scales when fp8, else None.
    block_tables: [B, P] int32 page ids; entries past the used pages are
      ignored and may be out of the pool (PAD_PAGE = -1).
    lengths: [B] int32 valid tokens per request, 0 <= lengths[b] <= P * page_size
      (a length-0 row gives zeros).
    scale: softmax scale.

  Returns:
    [B, H, C] in q_latent's dtype.
  """
  lat = dequant_pages(latent, latent_scale, block_tables)  # [B, T, C]
  rope = dequant_pages(k_rope, k_rope_scale, block_tables)  # [B, T, R]
  logits = jnp.einsum("BHC,BTC->BHT", q_latent.astype(jnp.float32), lat, precision=_HI)
  logits += jnp.einsum("BHR,BTR->BHT", q_rope.astype(jnp.float32), rope, precision=_HI)
  logits *= scale
  t = jnp.arange(lat.shape[1])
  valid = t[None, None, :] < lengths[:, None, None]
  logits = jnp.where(valid, logits, -jnp.inf)
  p = jax.nn.softmax(logits, axis=-1)
  # Unused slots may hold anything, NaN included; 0 * NaN is NaN, so zero them.
  lat = jnp.where(valid[:, 0, :, None], lat, 0.0)
  out = jnp.einsum("BHT,BTC->BHC", p, lat, precision=_HI)
  out = jnp.where(lengths[:, None, None] > 0, out, 0.0)  # empty rows: zeros
  return out.astype(q_latent.dtype)


@jax.jit
def paged_mla_sparse_decode_reference(q_latent, q_rope, latent, k_rope,
                                      latent_scale, k_rope_scale, block_tables,
                                      lengths, indices, *, scale):
  """Sparse MLA decode attention (absorbed form) over a paged latent cache.

  As paged_mla_decode_reference, but request b attends only to the token
  positions indices[b] selects (DeepSeek Sparse Attention's top-k,
  docs/sparse_attention.md): the K selected rows are gathered, then plain
  attention runs over them. Softmax in f32.

  Args:
    q_latent: [B, H, C] absorbed query (bf16 or f32).
    q_rope: [B, H, R] rope part of the query.
    latent: [N, page_size, C] latent pages, bf16 or float8_e4m3fn.
    k_rope: [N, page_size, R] rope-key pages, same dtype as latent.
    latent_scale, k_rope_scale: [N, page_size] f32 per-token scales when fp8,
      else None.
    block_tables: [B, M] int32 page ids (PAD_PAGE = -1 past the used pages).
    lengths: [B] int32 valid tokens per request.
    indices: [B, K] int32 selected positions; -1 (and, defensively, any
      position outside [0, lengths[b])) selects nothing. A position listed
      twice counts twice, as it would in any gather-then-attend kernel.
    scale: softmax scale.

  Returns:
    [B, H, C] in q_latent's dtype; a row with no valid index gives zeros.
  """
  n, ps = latent.shape[:2]
  valid = (indices >= 0) & (indices < lengths[:, None])  # [B, K]
  pos = jnp.where(valid, indices, 0)
  page = jnp.take_along_axis(block_tables, pos // ps, axis=1)  # [B, K]
  page = jnp.clip(page, 0, n - 1)
  slot = pos % ps

  def gather(pages, scales):
    x = pages[page, slot].astype(jnp.float32)  # [B, K, ...]
    if scales is not None:
      x = x * scales[page, slot].astype(jnp.float32)[..., None]
    return jnp.where(valid[..., None], x, 0.0)  # unselected rows may be NaN

  lat = gather(latent, latent_scale)  # [B, K, C]
  rope = gather(k_rope, k_rope_scale)  # [B, K, R]
  logits = jnp.einsum("BHC,BKC->BHK", q_latent.astype(jnp.float32), lat, precision=_HI)
  logits += jnp.einsum("BHR,BKR->BHK", q_rope.astype(jnp.float32), rope, precision=_HI)
  logits = jnp.where(valid[:, None, :], logits * scale, -jnp.inf)
  p = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("BHK,BKC->BHC", p, lat, precision=_HI)
  out = jnp.where(valid.any(axis=1)[:, None, None], out, 0.0)  # empty rows: zeros
  return out.astype(q_latent.dtype)


@jax.jit
def paged_gqa_decode_reference(q, k, v, k_scale, v_scale, block_tables, lengths,
                               *, scale):
  """GQA decode attention over paged K/V.

  Query head h attends with KV head h // (H // KV), over the first lengths[b]
  tokens of request b. Softmax in f32.

  Args:
    q: [B, H, hd] queries (bf16 or f32).
    k: [N, page_size, KV, hd] key pages, bf16 or float8_e4m3fn.
    v: [N, page_size, KV, hd] value pages, same dtype as k.
    k_scale: [N, page_size, KV] f32 per-token-per-head scales when fp8, else None.
    v_scale: [N, page_size, KV] f32 scales when fp8, else None.
    block_tables: [B, P] int32 page ids; entries past the used pages are
    ignored and may be out of the pool (PAD_PAGE = -1).
    lengths: [B] int32, 0 <= lengths[b] <= P * page_size (length 0: zeros).
    scale: softmax scale.

  Returns:
    [B, H, hd] in q's dtype.
  """
  b, h, hd = q.shape
  kv = k.shape[2]
  kk = dequant_pages(k, k_scale, block_tables)  # [B, T, KV, hd]
  vv = dequant_pages(v, v_scale, block_tables)
  qg = q.astype(jnp.float32).reshape(b, kv, h // kv, hd)
  logits = jnp.einsum("BKGD,BTKD->BKGT", qg, kk, precision=_HI) * scale
  t = jnp.arange(kk.shape[1])
  valid = t[None, None, None, :] < lengths[:, None, None, None]
  logits = jnp.where(valid, logits, -jnp.inf)
  p = jax.nn.softmax(logits, axis=-1)
  vv = jnp.where(valid[:, 0, 0, :, None, None], vv, 0.0)  # see the MLA reference
  out = jnp.einsum("BKGT,BTKD->BKGD", p, vv, precision=_HI)
  out = jnp.where(lengths[:, None, None, None] > 0, out, 0.0)  # empty rows: zeros
  return out.reshape(b, h, hd).astype(q.dtype)


def combine_splits(acc, m, l):
  """Merges split-K partials into the normalised output.

  Args:
    acc: [B, S, H, D] f32 unnormalised partial outputs sum_t exp(x_t - m) v_t.
    m: [B, S, H] f32 running max of each partition (a very negative finite
      number for an empty partition).
    l: [B, S, H] f32 partial softmax denominators (0 when empty).

  Returns:
    [B, H, D] f32.
  """
  m_all = jnp.max(m, axis=1, keepdims=True)  # [B, 1, H]
  w = jnp.exp(m - m_all)  # [B, S, H]; 0 for empty partitions
  num = jnp.einsum("BSH,BSHD->BHD", w, acc, precision=_HI)
  den = jnp.sum(w * l, axis=1)  # [B, H]; 0 only for a length-0 request
  return num / jnp.where(den > 0, den, 1.0)[..., None]


def combine_pieces(o, lse, request, batch):
  """Merges per-piece partials into each request's output (mla_mgpu's schedule).

  The reference of ``merge_pieces`` (the kernel the ops run), and the op's
  ``BlockSizes(merge="xla")``: a masked product over a one-hot [B, G] map,
  B x G x H x D multiply-adds, where the kernel reads each partial once.

  Args:
    o: [G, H, D] f32 or bf16 per-piece outputs, each already divided by its own softmax
      sum (0 for an empty piece).
    lse: [G, H] f32 per-piece log-sum-exp (a very negative finite number for an
      empty piece).
    request: [G] int32 the piece's request, -1 for an unused piece; every
      request has at least one piece.
    batch: B.

  Returns:
    [B, H, D] f32.
  """
  mine = request[None, :] == jnp.arange(batch, dtype=request.dtype)[:, None]  # [B, G]
  lse_b = jnp.where(mine[..., None], lse[None], -jnp.inf)  # [B, G, H]
  w = jnp.where(mine[..., None], jnp.exp(lse_b - jnp.max(lse_b, axis=1, keepdims=True)), 0.0)
  num = jnp.einsum("BGH,GHD->BHD", w, o, precision=_HI)
  return num / jnp.sum(w, axis=1)[..., None]
