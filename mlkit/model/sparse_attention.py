"""DeepSeek Sparse Attention: the lightning indexer and its top-k token selection (GLM 5.x).

A layer that runs the indexer ("full" in ``cfg.indexer_types``) scores every
earlier token for every query with a few small heads and lets MLA attend only to
the ``index_topk`` best; a "shared" layer reuses the previous full layer's
selection. docs/sparse_attention.md has the picture; the semantics follow
transformers' ``GlmMoeDsaIndexer``:

    q   = rope(wq_b(q_latent))                     [B, T, Hi, Di]   (q_latent: MLA's normed query latent)
    k   = rope(LayerNorm(wk(x)))                    [B, S, Di]       (cached per token, like the latent)
    w   = weights_proj(x) * Hi^-1/2                 [B, T, Hi]       (f32)
    I   = sum_h w[h] * relu(q[h] . k * Di^-1/2)     [B, T, S]
    sel = the index_topk largest I[b, t, :] among the keys the query may see

Only the first ``qk_rope_head_dim`` dims of an indexer head are rotated (GLM:
interleaved pairs; DeepSeek-V3.2: halves). A query that may see no more than
``index_topk`` keys keeps them all, so short contexts attend densely.

Ties: ReLU makes exact ties at 0 common when every head of a pair is negative.
:func:`select_topk` breaks them toward the earlier position (``lax.top_k`` is
stable); transformers leaves the order to ``torch.topk``, so the two agree
whenever the k-th and (k+1)-th scores differ.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mlkit.config import ModelConfig
from mlkit.model import rope
# The indexer's per-head scores [B, Tq, Hi, S] f32 are bounded like attention's: a 2K-token
# prefill of GLM 5 over 2K keys would otherwise hold 2 GB per layer at batch 4.
from mlkit.model.attention import query_block
from mlkit.model.masks import KeyMask, map_query_blocks
from mlkit.quant import matmul

_LAYER_NORM_EPS = 1e-6  # the indexer key norm's epsilon in GLM 5 and DeepSeek-V3.2


def _layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
  """LayerNorm over the last axis in f32 (mean and variance), returned in x's dtype."""
  xf = x.astype(jnp.float32)
  mu = jnp.mean(xf, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
  y = (xf - mu) * jax.lax.rsqrt(var + eps)
  return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def _rope_first(x: jax.Array, cos: jax.Array, sin: jax.Array, R: int, interleave: bool) -> jax.Array:
  """Rotates the first R dims of x's last axis, leaving the rest as they are."""
  return jnp.concatenate([rope.apply_rope(x[..., :R], cos, sin, interleave=interleave), x[..., R:]],
                         axis=-1)


def indexer_project(p: dict, x: jax.Array, q_latent: jax.Array, positions: jax.Array,
                    cfg: ModelConfig, *, backend: str | None = None):
  """The indexer's queries, head weights and this step's keys.

  Args:
    p: the layer's attention params (``indexer_*`` leaves).
    x: normed hidden states [B, T, D].
    q_latent: MLA's normed query latent [B, T, q_lora].
    positions: [B, T] int32.

  Returns:
    (q [B, T, Hi, Di], weights [B, T, Hi] f32, k [B, T, Di]): k is what the cache stores.
  """
  B, T, _ = x.shape
  Hi, Di, R = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
  cos, sin = rope.cos_sin(cfg, positions)
  q = matmul(q_latent, p["indexer_wq_b"], backend=backend).reshape(B, T, Hi, Di)
  q = _rope_first(q, cos, sin, R, cfg.index_rope_interleave)
  k = _layer_norm(matmul(x, p["indexer_wk"], backend=backend), p["indexer_k_norm"],
                  p["indexer_k_bias"], _LAYER_NORM_EPS)
  k = _rope_first(k, cos, sin, R, cfg.index_rope_interleave)
  # transformers keeps weights_proj in f32 and feeds it f32 activations.
  w = jnp.einsum("btd,dh->bth", x.astype(jnp.float32), p["indexer_weights_proj"].astype(jnp.float32))
  return q, w * Hi ** -0.5, k


def index_scores(q: jax.Array, weights: jax.Array, keys: jax.Array, mask: jax.Array) -> jax.Array:
  """Index scores I [B, T, S] f32, -inf where ``mask`` [B, T, S] hides a key.

  Args:
    q: [B, T, Hi, Di]; weights: [B, T, Hi]; keys: [B, S, Di].
  """
  Di = q.shape[-1]
  s = jnp.einsum("bthd,bsd->bths", q.astype(jnp.float32), keys.astype(jnp.float32)) * Di ** -0.5
  scores = jnp.einsum("bth,bths->bts", weights.astype(jnp.float32), jax.nn.relu(s))
  return jnp.where(mask, scores, -jnp.inf)


def select_topk(scores: jax.Array, mask: jax.Array, k: int) -> jax.Array:
  """The keys each query attends to: its k best visible keys, [B, T, S] bool.

  Args:
    scores: [B, T, S] f32 index scores (-inf where hidden).
    mask: [B, T, S] bool, the keys each query may see.
    k: index_topk; a query that sees at most k keys keeps them all.
  """
  S = scores.shape[-1]
  k = min(k, S)
  _, idx = jax.lax.top_k(scores, k)  # [B, T, k]; ties toward the earlier position
  chosen = jnp.zeros(scores.shape, bool)
  b = jnp.arange(scores.shape[0])[:, None, None]
  t = jnp.arange(scores.shape[1])[None, :, None]
  chosen = chosen.at[b, t, idx].set(True)
  return chosen & mask  # a hidden key picked to fill k (fewer visible than k) stays hidden


def select(q: jax.Array, weights: jax.Array, keys: jax.Array, mask: KeyMask | jax.Array, k: int, *,
           block: int | None = None) -> jax.Array:
  """:func:`index_scores` then :func:`select_topk`, a block of queries at a time.

  The per-head scores [B, T, Hi, S] of a long prefill do not fit memory, so the
  queries are scored and selected ``block`` at a time (in a loop); the result
  is identical to the unblocked form.

  Args:
    q: [B, T, Hi, Di]; weights: [B, T, Hi]; keys: [B, S, Di].
    mask: [B, T, S], a :class:`KeyMask` (made dense a block at a time) or a bool array.
    k: index_topk.
    block: queries per block (None: :func:`query_block`).

  Returns:
    [B, T, S] bool, the keys each query attends to.
  """
  B, T, Hi, _ = q.shape
  S = keys.shape[1]
  block = query_block(B, T, Hi, S) if block is None else max(1, min(block, T))

  def one(qb, wb, mb):
    return select_topk(index_scores(qb, wb, keys, mb), mb, k)

  return map_query_blocks(one, (q, weights), mask, block)
