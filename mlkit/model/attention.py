"""MLA and GQA attention over a cache view.

The cores take a view produced by the cache (see ``mlkit.model.cache``) so that
contiguous and paged caches share them. Softmax is always accumulated in f32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mlkit.config import ModelConfig
from mlkit.model import rope
from mlkit.model.layers import rms_norm
from mlkit.model.masks import KeyMask, map_query_blocks
from mlkit.quant import dequantize, matmul
from pallas_kernels import dispatch
from pallas_kernels.mla_absorb import AbsorbQuery, absorbed_values
from pallas_kernels.page_write import MlaProjection

_NEG_INF = -1e30
# Queries attended at once, at most. A long prefill chunk attends in query blocks
# (``attend_in_query_blocks``), so its f32 scores are [B, H, block, S] at a time, never
# [B, H, T, S]; the block is also halved until one device's score buffer fits
# SCORE_BLOCK_BYTES. The budget counts the heads each device holds: the serving step
# passes how many devices the query heads are split over (``head_shards``, from
# ``mlkit.parallel.DecodeSharding``). For Kimi K2.6's 8192-token chunk over a 16K-token
# context under 8-way tensor parallelism, each GPU's 8 heads give blocks of 512 queries
# and a [8, 512, 16K] f32 score buffer, 256 MiB, where the whole chunk's would be 4 GiB
# (docs/serving_step_memory.md).
QUERY_BLOCK = 1024
# Bytes one query block's f32 scores may take (the sparse indexer's per-head scores too).
SCORE_BLOCK_BYTES = 256 * 2**20


def query_block(B: int, T: int, H: int, S: int, budget: int = SCORE_BLOCK_BYTES) -> int:
  """Queries per block: all T when their [B, T, H, S] f32 scores fit ``budget`` bytes,
  else the largest power of two that fits (at least 1)."""
  per_query = B * H * S * 4
  if T * per_query <= budget:
    return T
  block = 1
  while block * 2 * per_query <= budget:
    block *= 2
  return block


def masked_softmax(logits: jax.Array, mask: jax.Array) -> jax.Array:
  """Softmax over the last axis in f32 where mask is True; fully masked rows give zeros."""
  logits = jnp.where(mask, logits.astype(jnp.float32), _NEG_INF)
  m = jnp.max(logits, axis=-1, keepdims=True)
  e = jnp.where(mask, jnp.exp(logits - m), 0.0)
  return e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)


def attend_in_query_blocks(attend, queries: tuple, mask: KeyMask | jax.Array,
                           block: int | None = None, head_shards: int = 1) -> jax.Array:
  """Runs ``attend(*queries, mask)`` over blocks of at most ``block`` queries.

  Every query's softmax is independent of the others', so the result is exactly
  the unblocked one; only the peak size of the [.., T, S] score buffers drops to
  [.., block, S] (the blocks run one after another in a ``fori_loop``). A
  :class:`KeyMask` is made dense one block at a time, inside the loop.

  Args:
    attend: (*queries [B, t, ...], mask [B, t, S] bool) -> [B, t, ...].
    queries: arrays [B, T, ...] split along T.
    mask: [B, T, S]: a :class:`~mlkit.model.masks.KeyMask` or a bool array.
    block: queries per block (None: at most ``QUERY_BLOCK``, fewer where one device's
      scores of that many exceed ``SCORE_BLOCK_BYTES``; the heads are the queries' axis 2).
    head_shards: devices the heads are split over (each holds heads / head_shards of
      them); only the block size depends on it.

  Returns:
    ``attend``'s result for all T queries, [B, T, ...].
  """
  B, T, S = mask.shape
  if block is None:
    heads = queries[0].shape[2] if queries[0].ndim > 2 else 1
    heads = max(1, heads // max(1, head_shards))  # one device's share
    block = min(QUERY_BLOCK, query_block(B, T, heads, S, budget=SCORE_BLOCK_BYTES))
  return map_query_blocks(attend, queries, mask, block)


# ----------------------------------------------------------------------------- MLA

def mla_project(p: dict, x: jax.Array, positions: jax.Array, cfg: ModelConfig, *,
                backend: str | None = None, return_q_latent: bool = False,
                projection: bool = False):
  """Query heads and this step's cache entries for MLA.

  Args:
    p: the layer's attention params.
    x: normed hidden states [B, T, D].
    positions: [B, T] int32.
    return_q_latent: also return the normed query latent [B, T, q_lora] (the
      sparse-attention indexer's input; needs q_lora_rank > 0).
    projection: return the entries as a ``pallas_kernels.page_write.MlaProjection``
      (before their RMSNorm and rope), which a paged cache's write computes in the page
      write's own launch.

  Returns:
    (q_nope [B, T, H, nope], q_rope [B, T, H, R], new) where new = {latent [B, T, C], k_rope [B, T, R]}
    holds the RMS-normed latent and the rotated shared rope key, exactly what the cache stores
    (``MlaProjection.entries``); plus q_latent last with ``return_q_latent``.
  """
  B, T, _ = x.shape
  H, nope, R = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
  mm = functools.partial(matmul, backend=backend)
  q_latent = None
  if cfg.q_lora_rank:
    q_latent = rms_norm(mm(x, p["wq_a"]), p["q_norm"], cfg.latent_eps)
    q = mm(q_latent, p["wq_b"])
  else:
    q = mm(x, p["wq"])
  q = q.reshape(B, T, H, nope + R)
  q_nope, q_rope = q[..., :nope], q[..., nope:]
  cos, sin = rope.cos_sin(cfg, positions)
  q_rope = rope.apply_rope(q_rope, cos, sin, interleave=cfg.rope_interleave)
  new = MlaProjection(kv=mm(x, p["wkv_a"]), norm_scale=p["kv_norm"], cos=cos, sin=sin,
                      eps=cfg.latent_eps, interleave=cfg.rope_interleave)  # kv [B, T, C + R]
  if not projection:
    new = new.entries()
  if return_q_latent:
    return q_nope, q_rope, new, q_latent
  return q_nope, q_rope, new


def _wkv_b_whole(p: dict, cfg: ModelConfig, dtype, tie: jax.Array) -> tuple[jax.Array, jax.Array]:
  """wkv_b as [C, H, nope + v] in ``dtype``, and ``tie`` (see :func:`_wkv_b`)."""
  wkv_b, tie = jax.lax.optimization_barrier((p["wkv_b"], tie))
  w = dequantize(wkv_b, dtype).reshape(cfg.kv_lora_rank, cfg.n_heads,
                                       cfg.qk_nope_head_dim + cfg.v_head_dim)
  return w, tie


def _wkv_b(p: dict, cfg: ModelConfig, dtype, tie: jax.Array
           ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """wkv_b split into its key [C, H, nope] and value [C, H, v] halves, and ``tie``.

  ``tie`` is an activation of the layer (a query) that the caller goes on with: the
  weight passes through one optimization barrier with it, so the halves, which depend
  on the params alone, cannot be computed before the layer runs. Without it XLA built
  every layer's at the start of the step and kept them all live. The caller must use
  the returned ``tie``: XLA drops a barrier operand whose result is unused, and the
  barrier with it (docs/serving_step_memory.md, item 11).
  """
  w, tie = _wkv_b_whole(p, cfg, dtype, tie)
  return w[..., :cfg.qk_nope_head_dim], w[..., cfg.qk_nope_head_dim:], tie


def mla_attention_naive(p, q_nope, q_rope, view, mask, cfg: ModelConfig, *,
                        head_shards: int = 1) -> jax.Array:
  """MLA with keys/values expanded from the latent per head (the textbook form).

  Args:
    q_nope: [B, T, H, nope]; q_rope: [B, T, H, R].
    view: {latent [B, S, C], k_rope [B, S, R]}; mask: [B, T, S].
    head_shards: devices the heads are split over (``attend_in_query_blocks``).

  Returns:
    Per-head outputs [B, T, H, v].
  """
  dtype = q_nope.dtype
  w_k, w_v, q_nope = _wkv_b(p, cfg, dtype, q_nope)
  latent = view["latent"].astype(dtype)
  k_nope = jnp.einsum("bsc,chd->bshd", latent, w_k, preferred_element_type=jnp.float32)
  v = jnp.einsum("bsc,chd->bshd", latent, w_v, preferred_element_type=jnp.float32)
  k_rope = view["k_rope"].astype(jnp.float32)

  def attend(q_nope, q_rope, mask):
    logits = (jnp.einsum("bthd,bshd->bhts", q_nope.astype(jnp.float32), k_nope)
              + jnp.einsum("bthr,bsr->bhts", q_rope.astype(jnp.float32), k_rope)
              ) * cfg.softmax_scale
    probs = masked_softmax(logits, mask[:, None])  # [B, H, t, S]
    return jnp.einsum("bhts,bshd->bthd", probs, v).astype(dtype)

  return attend_in_query_blocks(attend, (q_nope, q_rope), mask, head_shards=head_shards)


def mla_absorb_query(p, q_nope: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Projects q_nope [B, T, H, nope] into latent space [B, T, H, C] (absorbing wkv_b's key half).

  The product reads wkv_b [C, H, nope + v] whole, with the query zero-padded over the
  value half, rather than a copy of the key half: each half is a strided slice of every
  row, which XLA's GPU compiler copies in a kernel of its own (a launch, and the half's
  bytes read and written) before the product (docs/step_time.md, "Launches per MoE layer").
  """
  # Padded before the barrier, so that the pad fuses with the query's producer.
  q = jnp.pad(q_nope, ((0, 0),) * 3 + ((0, cfg.v_head_dim),))  # [B, T, H, nope + v]
  w, q = _wkv_b_whole(p, cfg, q_nope.dtype, q)
  return jnp.einsum("bthd,chd->bthc", q, w,
                    preferred_element_type=jnp.float32).astype(q_nope.dtype)


def mla_absorb_output(p, out_latent: jax.Array, cfg: ModelConfig, *,
                      backend: str | None = None) -> jax.Array:
  """Projects latent-space outputs [B, T, H, C] back to per-head values [B, T, H, v].

  As in :func:`mla_absorb_query`, the product reads wkv_b whole, never a copy of its
  value half. On "xla" it keeps the value half of the product's result (a slice of the
  small result fuses into its consumer); on the kernel backends one Pallas launch reads
  the value half in place and writes the values in wo's layout, where XLA ran a split-K
  GEMM and a fusion adding its parts (docs/mla_absorb.md).
  """
  w, out_latent = _wkv_b_whole(p, cfg, out_latent.dtype, out_latent)
  return absorbed_values(out_latent, w, cfg.qk_nope_head_dim, backend=backend)


def mla_latent_attention(q_latent, q_rope, latent, k_rope, mask, scale, *,
                         head_shards: int = 1) -> jax.Array:
  """Attention in latent space, the core the paged kernels implement.

  Args:
    q_latent: [B, T, H, C]; q_rope: [B, T, H, R].
    latent: [B, S, C]; k_rope: [B, S, R]; mask: [B, T, S].
    scale: softmax scale.
    head_shards: devices the heads are split over (``attend_in_query_blocks``).

  Returns:
    out_latent [B, T, H, C] (f32 accumulation, returned in q_latent's dtype).
  """
  f32 = jnp.float32
  latent, k_rope = latent.astype(f32), k_rope.astype(f32)

  def attend(q_latent, q_rope, mask):
    logits = (jnp.einsum("bthc,bsc->bhts", q_latent.astype(f32), latent)
              + jnp.einsum("bthr,bsr->bhts", q_rope.astype(f32), k_rope)) * scale
    probs = masked_softmax(logits, mask[:, None])
    return jnp.einsum("bhts,bsc->bthc", probs, latent).astype(q_latent.dtype)

  return attend_in_query_blocks(attend, (q_latent, q_rope), mask, head_shards=head_shards)


def mla_attention_absorbed(p, q_nope, q_rope, view, mask, cfg: ModelConfig, *,
                           head_shards: int = 1) -> jax.Array:
  """MLA in the absorbed form: attention runs over the latent cache directly.

  Same arguments and result as :func:`mla_attention_naive`; cheaper when the
  query chunk is short (decode), because keys are never expanded per head.
  """
  q_latent = mla_absorb_query(p, q_nope, cfg)
  out_latent = mla_latent_attention(q_latent, q_rope, view["latent"], view["k_rope"], mask,
                                    cfg.softmax_scale, head_shards=head_shards)
  return mla_absorb_output(p, out_latent, cfg)


# ----------------------------------------------------------------------------- GQA

def gqa_project(p: dict, x: jax.Array, positions: jax.Array, cfg: ModelConfig, *,
                backend: str | None = None):
  """Query heads [B, T, H, hd] and this step's cache entries {k, v: [B, T, KV, hd]}."""
  B, T, _ = x.shape
  hd = cfg.head_dim
  mm = functools.partial(matmul, backend=backend)
  q = mm(x, p["wq"]).reshape(B, T, cfg.n_heads, hd)
  k = mm(x, p["wk"]).reshape(B, T, cfg.n_kv_heads, hd)
  v = mm(x, p["wv"]).reshape(B, T, cfg.n_kv_heads, hd)
  cos, sin = rope.cos_sin(cfg, positions)
  q = rope.apply_rope(q, cos, sin, interleave=cfg.rope_interleave)
  k = rope.apply_rope(k, cos, sin, interleave=cfg.rope_interleave)
  return q, {"k": k, "v": v}


def gqa_attention(q, k, v, mask, scale, *, head_shards: int = 1) -> jax.Array:
  """Grouped-query attention.

  Args:
    q: [B, T, H, hd]; k, v: [B, S, KV, hd] with KV dividing H; mask: [B, T, S].
    scale: softmax scale.
    head_shards: devices the heads are split over (``attend_in_query_blocks``).

  Returns:
    [B, T, H, hd] in q's dtype.
  """
  H, hd = q.shape[2:]
  KV = k.shape[2]
  f32 = jnp.float32
  k, v = k.astype(f32), v.astype(f32)

  def attend(q, mask):
    B, T = q.shape[:2]
    qg = q.reshape(B, T, KV, H // KV, hd).astype(f32)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k) * scale
    probs = masked_softmax(logits, mask[:, None, None])
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(B, T, H, hd).astype(q.dtype)

  return attend_in_query_blocks(attend, (q,), mask, head_shards=head_shards)


# ----------------------------------------------------------------------------- layer

def _head_shards(decode_sharding) -> int:
  """Devices the serving step splits the query heads over (1 without a DecodeSharding):
  a prefill's query blocks are sized by one device's heads."""
  return 1 if decode_sharding is None else decode_sharding.head_shards


def attention_block(p: dict, x: jax.Array, positions: jax.Array, cache, layer: int,
                    cfg: ModelConfig, *, batch_meta=None, mla_mode: str = "auto",
                    backend: str | None = None, segment_ids: jax.Array | None = None,
                    selection: jax.Array | None = None, decode_sharding=None,
                    out_dtype=None):
  """One attention sub-layer: project, write the cache, attend, project out.

  Decode steps (T == 1) on a cache that offers ``decode_attention`` (the paged
  cache) run attention through it, i.e. through the paged-attention kernels,
  always in MLA's absorbed form (sparse attention: through
  ``sparse_decode_attention`` over the selected positions); everything else
  attends over the cache's view.

  Args:
    p: the layer's attention params.
    x: normed hidden states [B, T, D].
    positions: [B, T] int32.
    cache: a cache (see ``mlkit.model.cache``) or None for a cache-free forward.
    layer: layer index into the cache.
    mla_mode: "naive", "absorbed" or "auto" (absorbed when T == 1).
    backend: kernel backend ("pallas" | "interpret" | "xla" | None for the platform default).
    segment_ids: [B, T] int, cache-free forwards only: tokens attend within their segment.
    selection: with sparse attention (``cfg.indexer_types``), the keys the previous
      full layer selected, which a "shared" layer attends to: [B, T, S] bool, or on a
      paged decode step the selected positions [B, K] int32.
    decode_sharding: None, or an ``mlkit.parallel.DecodeSharding``: paged decode
      attention then runs per device on its own heads.
    out_dtype: the output's dtype (default x's): f32 hands on the output projection
      as accumulated (and all-reduced), for a consumer that rounds it itself.

  Returns:
    (out [B, T, D], cache), plus this layer's selection (as above) third when
    ``cfg.indexer_types`` is set.
  """
  from mlkit.model.cache import no_cache_view
  B, T, _ = x.shape
  mla = cfg.attention == "mla"
  if cfg.sparse_attention:
    return _sparse_mla_block(p, x, positions, cache, layer, cfg, batch_meta=batch_meta,
                             mla_mode=mla_mode, backend=backend, segment_ids=segment_ids,
                             selection=selection, decode_sharding=decode_sharding,
                             out_dtype=out_dtype)
  paged_decode = T == 1 and cache is not None and hasattr(cache, "decode_attention")
  if mla:
    # A paged decode step's write norms and rotates the entries itself, in the page
    # write's launch (pallas_kernels.page_write.write_mla_pages).
    q_nope, q_rope, new = mla_project(p, x, positions, cfg, backend=backend,
                                      projection=paged_decode)
  else:
    q, new = gqa_project(p, x, positions, cfg, backend=backend)
  if paged_decode:
    with jax.named_scope("paged_decode_attention"):
      cache = cache.write(layer, new, positions, batch_meta, backend=backend)
      if mla:
        out_latent = cache.decode_attention(layer, _decode_query(p, q_nope, q_rope, cfg, backend),
                                            batch_meta, scale=cfg.softmax_scale,
                                            backend=backend, sharding=decode_sharding)
        heads = mla_absorb_output(p, out_latent[:, None], cfg, backend=backend)  # [B, 1, H, v]
      else:
        heads = cache.decode_attention(layer, (q[:, 0],), batch_meta, scale=cfg.softmax_scale,
                                       backend=backend,
                                       sharding=decode_sharding)[:, None]  # [B, 1, H, hd]
  else:
    if cache is None:
      view, mask = no_cache_view(new, positions, segment_ids)
    else:
      cache, view, mask = cache.update(layer, new, positions, batch_meta)
    if mla:
      absorbed = mla_mode == "absorbed" or (mla_mode == "auto" and T == 1)
      fn = mla_attention_absorbed if absorbed else mla_attention_naive
      heads = fn(p, q_nope, q_rope, view, mask, cfg,
                 head_shards=_head_shards(decode_sharding))  # [B, T, H, v]
    else:
      heads = gqa_attention(q, view["k"], view["v"], mask, cfg.softmax_scale,
                            head_shards=_head_shards(decode_sharding))
  out = matmul(heads.reshape(B, T, -1), p["wo"], backend=backend, out_dtype=out_dtype)
  return out, cache


def _decode_query(p: dict, q_nope: jax.Array, q_rope: jax.Array, cfg: ModelConfig,
                  backend: str | None):
  """A paged MLA decode step's query for ``cache.decode_attention``, from q_nope
  [B, 1, H, nope] and q_rope [B, 1, H, R].

  On "xla" (q_latent [B, H, C], q_rope [B, H, R]) (:func:`mla_absorb_query`). On the
  kernel backends an ``AbsorbQuery``: q_all = [q_nope | q_rope] [B, H, nope + R] (one
  XLA fusion with the rope) and wkv_b [C, H, nope + v], whose absorbed product (and,
  over an fp8 cache, the query's scaling) the decode op runs per device in one launch,
  the decode kernels reading the rope part in place from q_all (docs/mla_absorb.md,
  "The query side").
  """
  if dispatch.resolve_backend(backend) == "xla":
    return mla_absorb_query(p, q_nope, cfg)[:, 0], q_rope[:, 0]
  q_all = jnp.concatenate([q_nope, q_rope.astype(q_nope.dtype)], axis=-1)[:, 0]
  w, q_all = _wkv_b_whole(p, cfg, q_nope.dtype, q_all)
  return AbsorbQuery(q_all, w, cfg.qk_nope_head_dim)


def _sparse_mla_block(p: dict, x: jax.Array, positions: jax.Array, cache, layer: int,
                      cfg: ModelConfig, *, batch_meta, mla_mode: str, backend: str | None,
                      segment_ids: jax.Array | None, selection: jax.Array | None,
                      decode_sharding=None, out_dtype=None):
  """MLA over the keys the sparse-attention indexer selects (``attention_block``'s sparse form).

  A full layer computes its indexer keys, stores them in the cache beside the
  latent (entry ``index_k``), scores every visible key and keeps the top
  ``index_topk``; a shared layer reuses ``selection``. Attention is MLA with the
  causal mask narrowed to the selection (docs/sparse_attention.md).
  """
  from mlkit.model.cache import no_cache_view
  from mlkit.model import sparse_attention as dsa
  B, T, _ = x.shape
  # A decode step on the paged pool (a cache with ``sparse_decode_attention``)
  # writes this token and never gathers the request's pages: a full layer
  # scores the paged index keys with the indexer kernel and keeps the top
  # ``index_topk`` positions, and the sparse paged MLA kernel attends to
  # those only; ``selection`` is then those positions [B, K]. Every other
  # step (prefill, chunks, the contiguous cache) goes through
  # ``cache.update``, whose view holds the indexer keys, and ``selection`` is
  # the [B, T, S] mask (docs/sparse_attention.md).
  full = cfg.runs_indexer(layer)
  if not full and selection is None:
    raise ValueError(f"layer {layer} is a shared sparse-attention layer but no earlier full layer "
                     "passed its selection")
  q_nope, q_rope, new, q_latent = mla_project(p, x, positions, cfg, backend=backend,
                                              return_q_latent=True)
  if full:
    iq, iw, new["index_k"] = dsa.indexer_project(p, x, q_latent, positions, cfg, backend=backend)
  if T == 1 and cache is not None and hasattr(cache, "sparse_decode_attention"):
    cache = cache.write(layer, new, positions, batch_meta)
    if full:
      with jax.named_scope("paged_index_topk"):
        selection = cache.sparse_decode_select(layer, iq[:, 0], iw[:, 0], batch_meta,
                                               k=cfg.index_topk, backend=backend)
    elif selection.ndim != 2 or selection.shape[0] != B:
      raise ValueError(f"selection {selection.shape} is not the [B={B}, K] positions a paged "
                       f"decode step's layer {layer} takes")
    with jax.named_scope("paged_sparse_decode_attention"):
      q_latent = mla_absorb_query(p, q_nope, cfg)  # [B, 1, H, C]
      out_latent = cache.sparse_decode_attention(
          layer, (q_latent[:, 0], q_rope[:, 0]), selection, batch_meta,
          scale=cfg.softmax_scale, backend=backend, sharding=decode_sharding)
      heads = mla_absorb_output(p, out_latent[:, None], cfg, backend=backend)  # [B, 1, H, v]
  else:
    if cache is None:
      view, mask = no_cache_view(new, positions, segment_ids)
    else:
      cache, view, mask = cache.update(layer, new, positions, batch_meta)
    if full:
      selection = dsa.select(iq, iw, view["index_k"], mask, cfg.index_topk)
    elif selection.shape != mask.shape:
      raise ValueError(f"selection {selection.shape} does not match layer {layer}'s keys "
                       f"{mask.shape}")
    absorbed = mla_mode == "absorbed" or (mla_mode == "auto" and T == 1)
    fn = mla_attention_absorbed if absorbed else mla_attention_naive
    heads = fn(p, q_nope, q_rope, view, mask & selection, cfg,
               head_shards=_head_shards(decode_sharding))  # [B, T, H, v]
  out = matmul(heads.reshape(B, T, -1), p["wo"], backend=backend, out_dtype=out_dtype)
  return out, cache, selection
