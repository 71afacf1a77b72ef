"""Pure-jnp reference for paged indexer scoring (the ``xla`` backend) and the top-k step."""

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels.paged_attention.reference import dequant_pages

_HI = lax.Precision.HIGHEST


# Jitted so that an eager call (the tests, tools) compiles one program per shape instead of
# one per operation; inside a caller's jit it is inlined.
@jax.jit
def paged_index_scores_reference(q, weights, index_k, index_k_scale, block_tables, lengths):
  """Index scores of one decode query per request over its paged index keys.

  I[b, t] = sum_h weights[b, h] * relu(q[b, h] . k_t * Di^-1/2) for the first
  lengths[b] tokens of request b (token t at page block_tables[b, t // page_size],
  slot t % page_size), -inf past the length. All math in f32.

  Args:
    q: [B, Hi, Di] indexer queries (rope applied), bf16 or f32.
    weights: [B, Hi] per-head weights (f32; the Hi^-1/2 factor already folded in).
    index_k: [N, page_size, Di] index-key pages, bf16, f32 or float8_e4m3fn.
    index_k_scale: [N, page_size] f32 per-token scales when fp8, else None.
    block_tables: [B, M] int32 page ids; entries past the used pages may be
      out of the pool (PAD_PAGE = -1).
    lengths: [B] int32 cached tokens per request (the current one included).

  Returns:
    [B, M * page_size] f32.
  """
  di = q.shape[-1]
  keys = dequant_pages(index_k, index_k_scale, block_tables)  # [B, S, Di] f32
  s = jnp.einsum("bhd,bsd->bhs", q.astype(jnp.float32), keys, precision=_HI) * di ** -0.5
  scores = jnp.einsum("bh,bhs->bs", weights.astype(jnp.float32), jnp.maximum(s, 0.0),
                      precision=_HI)
  t = jnp.arange(keys.shape[1])
  return jnp.where(t[None, :] < lengths[:, None], scores, -jnp.inf)


def topk_positions(scores, k):
  """The positions of each row's k largest finite scores, in increasing order.

  Ties break toward the earlier position (``lax.top_k`` is stable), as the
  model's contiguous path (mlkit.model.sparse_attention.select_topk) does; a
  row with at most k finite scores keeps them all.

  Args:
    scores: [B, S] f32, -inf where a key is hidden.
    k: how many to keep.

  Returns:
    [B, min(k, S)] int32 positions ascending, then -1.
  """
  s = scores.shape[-1]
  vals, idx = lax.top_k(scores, min(k, s))
  # Hidden picks (fewer than k visible keys) sort last as S, then become -1.
  idx = jnp.sort(jnp.where(vals > -jnp.inf, idx, s), axis=-1)
  return jnp.where(idx < s, idx, -1).astype(jnp.int32)
