"""Paged KV state: page arrays per layer, per-token fp8 scales, page tags, write and read paths.

Layout (fixed; the Pallas kernels are written against it):

* MLA layer: ``latent`` [N, P, C] and ``k_rope`` [N, P, R]; fp8 adds
  ``latent_scale`` and ``k_rope_scale`` [N, P] f32.
* MLA layer that runs the sparse-attention indexer (``cfg.runs_indexer(layer)``,
  GLM 5): also ``index_k`` [N, P, Di]; fp8 adds ``index_k_scale`` [N, P] f32.
  It lives in the same pages as the latent, so one page id covers all of a
  token's entries and the allocator, prefix cache, tags and transfers handle
  it with no extra bookkeeping (docs/sparse_attention.md).
* GQA layer: ``k`` and ``v`` [N, P, KV, hd]; fp8 adds ``k_scale`` and
  ``v_scale`` [N, P, KV] f32.
* ``page_tags`` [N] int32: the allocator's uint32 generation counters, bit-cast.

N = num_pages and P = page_size. The token at position p of request b lives at
page ``block_tables[b, p // P]``, slot ``p % P``. Block-table entries past a
request's pages are padded with ``PAD_PAGE`` (-1); readers only use the first
ceil(length / P) entries of each row.

Validation: value checks (block tables inside the pool, lengths within the
request's pages) need concrete arrays, so they run on the host in
:func:`validate_batch`, which the public write functions call before their
jitted (donating) core, and which ``PagedKVState.update`` calls when it runs
eagerly. Under an outer ``jax.jit`` only static checks (dtypes, shapes, page
size) run; call :func:`validate_batch` on the host before such a step.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mlkit.config import ModelConfig
from mlkit.kvcache.config import KVCacheConfig
from mlkit.kvcache.fp8 import FP8_DTYPE, dequantize_fp8
from pallas_kernels.page_write import MlaProjection, write_mla_pages, write_pages
from mlkit.model.masks import causal_mask

# Block-table entry for "no page here" (past the request's pages, or a padded batch row).
PAD_PAGE = -1


def entry_names(attention: str) -> tuple[str, str]:
  """The two page arrays every layer has: MLA ("latent", "k_rope"); GQA ("k", "v").

  A sparse-attention layer has more (``index_k``); use :meth:`PagedKVState.layer_names`
  when iterating a layer's entries.
  """
  return ("latent", "k_rope") if attention == "mla" else ("k", "v")


def scale_name(name: str) -> str:
  """Name of the per-token f32 scale array beside page array ``name`` (fp8 only)."""
  return name + "_scale"


def entry_shapes(cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[int, ...]]:
  """Per-token entry shapes for one layer (MLA: [C], [R], plus [Di] ``index_k`` on a layer
  that runs the sparse-attention indexer; GQA: [KV, hd] twice): the contiguous cache's."""
  from mlkit.model.cache import cache_entry_shapes
  return cache_entry_shapes(cfg, layer)


def _is_tracer(*xs) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(xs))


@struct.dataclass
class BatchMeta:
  """Per-step batch metadata for a paged pool.

  Attributes:
    block_tables: [B, max_pages_per_seq] int32 physical page ids (PAD_PAGE past a request's pages).
    lengths: [B] int32 tokens in the cache after this step's write.
    expected_tags: [B, max_pages_per_seq] int32 tags the request expects on its pages.
    page_size: tokens per page the tables were built for (static; checked against the state).
  """

  block_tables: jax.Array
  lengths: jax.Array
  expected_tags: jax.Array
  page_size: int = struct.field(pytree_node=False)


@struct.dataclass
class PagedKVState:
  """The device side of a paged KV pool; also a cache for ``mlkit.model.apply``.

  Attributes:
    layers: one dict per layer (see the module docstring for keys and shapes).
    page_tags: [num_pages] int32 generation tags (uint32 on the host, bit-cast).
  """

  layers: list
  page_tags: jax.Array

  @property
  def attention(self) -> str:
    return "mla" if "latent" in self.layers[0] else "gqa"

  @property
  def names(self) -> tuple[str, str]:
    """The entries every layer has (see :meth:`layer_names` for one layer's full list)."""
    return entry_names(self.attention)

  def layer_names(self, layer: int) -> tuple[str, ...]:
    """Layer ``layer``'s page arrays (scales excluded): :attr:`names`, plus ``index_k`` on a
    sparse-attention layer that runs the indexer."""
    extra = tuple(k for k in self.layers[layer] if k == "index_k")
    return self.names + extra

  @property
  def num_pages(self) -> int:
    return self.layers[0][self.names[0]].shape[0]

  @property
  def page_size(self) -> int:
    return self.layers[0][self.names[0]].shape[1]

  @property
  def dtype(self) -> jnp.dtype:
    """Storage dtype of the pages."""
    return self.layers[0][self.names[0]].dtype

  @property
  def is_fp8(self) -> bool:
    return self.dtype == FP8_DTYPE

  @property
  def n_layers(self) -> int:
    return len(self.layers)

  def nbytes(self) -> int:
    """Bytes held by every array of the state (pages, index keys, scales and tags)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self))

  def update(self, layer: int, new: dict, positions: jax.Array, batch_meta: BatchMeta):
    """Cache interface for ``mlkit.model.apply``: write this step, return the request's pages.

    Tokens whose position is >= their request's length (padded rows or padded
    chunk positions) are not written.

    Args:
      layer: layer index.
      new: this step's entries, each [B, T, *entry_shape].
      positions: [B, T] int32 absolute positions.
      batch_meta: a :class:`BatchMeta`.

    Returns:
      (state, view, mask): the updated state; the request's pages gathered and
      dequantised to ``new``'s dtype, each [B, max_pages * page_size, ...], zero
      past each length; mask, a :class:`~mlkit.model.masks.KeyMask` [B, T, S] (key
      position <= query position and < length).

    Raises:
      ValueError: on a page-size / shape mismatch, or (when run eagerly) a bad block table or length.
    """
    state = self.write(layer, new, positions, batch_meta)
    dtype = new[self.names[0]].dtype  # index_k too: the indexer scores in the model's dtype
    view = gather_layer(state, layer, batch_meta.block_tables, batch_meta.lengths, dtype=dtype)
    S = view[self.names[0]].shape[1]
    return state, view, causal_mask(positions, S, lengths=batch_meta.lengths)

  def write(self, layer: int, new, positions: jax.Array, batch_meta: BatchMeta, *,
            backend: str | None = "xla"):
    """Writes this step's entries [B, T, ...] through the block tables; returns the new state.

    ``new``: {name: entries [B, T, ...]}, or for an MLA layer a
    ``pallas_kernels.page_write.MlaProjection`` (see :func:`write_layer`).
    Tokens whose position is >= their request's length are not written. Values
    (block tables, lengths) are validated on the host when run eagerly. ``backend``:
    "pallas" / "interpret" write through the page-write kernel (one launch for the
    layer's arrays; ``pallas_kernels.page_write``), "xla" (the default) with one
    scatter per array, None the platform default.

    Raises:
      ValueError: on a page-size / shape mismatch, or (eagerly) a bad block table or length.
    """
    if not isinstance(batch_meta, BatchMeta):
      raise ValueError(f"a paged cache needs batch_meta=BatchMeta(...), got {type(batch_meta).__name__}")
    if layer == 0 and not _is_tracer(batch_meta, positions):
      validate_batch(self, batch_meta, positions)
    else:
      _check_static(self, batch_meta, positions)
    return write_layer(self, layer, new, positions, batch_meta, backend=backend)

  def _pages_of(self, layer: int) -> tuple:
    """(name, array or None) of the page and scale arrays a decode kernel reads, in order."""
    lp = self.layers[layer]
    a, b = self.names
    sa, sb = (scale_name(a), scale_name(b))
    return ((a, lp[a]), (b, lp[b]), (sa, lp[sa] if self.is_fp8 else None),
            (sb, lp[sb] if self.is_fp8 else None))

  def decode_attention(self, layer: int, queries: tuple, batch_meta: BatchMeta, *,
                       scale: float, backend: str | None = None, sharding=None) -> jax.Array:
    """One decode query per request attending to its pages, via the paged-attention kernels.

    Args:
      layer: layer index.
      queries: MLA (q_latent [B, H, C], q_rope [B, H, R]), or a
        ``pallas_kernels.mla_absorb.AbsorbQuery`` (q_all [B, H, nope + R], wkv_b
        [C, H, nope + v], nope), whose absorbed product the decode op runs per device
        on its heads (``paged_mla_decode``); GQA (q [B, H, hd],).
      batch_meta: block tables and lengths (tokens in the cache, the current one included).
      scale: softmax scale.
      backend: "pallas" | "interpret" | "xla" | None (platform default).
      sharding: None, or an ``mlkit.parallel.DecodeSharding``: the kernel then runs
        per device on its own heads (a kernel called on whole arrays would have
        XLA gather the query and run every head on every device).

    Returns:
      MLA out_latent [B, H, C]; GQA [B, H, hd]; rows of length 0 give zeros.
    """
    from pallas_kernels import mla_absorb
    from pallas_kernels import paged_attention as kernels
    op = kernels.paged_mla_decode if self.attention == "mla" else kernels.paged_gqa_decode
    fn = functools.partial(op, scale=float(scale), backend=backend)
    if isinstance(queries, mla_absorb.AbsorbQuery):
      # Its arrays split over the heads on axis 1 alike (wkv_b's H), rebuilt per device.
      nope, absorbed = queries.nope, fn
      fn = lambda q_all, w, *rest: absorbed(  # noqa: E731
          mla_absorb.AbsorbQuery(q_all, w, nope), None, *rest)
      queries = (queries.q_all, queries.wkv_b)
    pages = self._pages_of(layer)
    others = (batch_meta.block_tables, batch_meta.lengths)
    if sharding is not None:
      return sharding.run(fn, tuple(queries), pages, others)
    return fn(*queries, *(x for _, x in pages), *others)

  def sparse_decode_attention(self, layer: int, queries: tuple, indices: jax.Array,
                              batch_meta: BatchMeta, *, scale: float,
                              backend: str | None = None, sharding=None) -> jax.Array:
    """One MLA decode query per request attending to the positions it selected.

    The sparse form of :meth:`decode_attention` (DeepSeek Sparse Attention,
    docs/sparse_attention.md): the paged kernel reads only the selected tokens.

    Args:
      layer: layer index (an MLA pool's).
      queries: (q_latent [B, H, C], q_rope [B, H, R]).
      indices: [B, K] int32 selected token positions, -1 = none.
      batch_meta: block tables and lengths (the current token included).
      scale: softmax scale.
      backend: "pallas" | "interpret" | "xla" | None (platform default).
      sharding: None, or an ``mlkit.parallel.DecodeSharding`` (see
        :meth:`decode_attention`).

    Returns:
      out_latent [B, H, C]; a row with no selected position gives zeros.
    """
    from pallas_kernels import paged_attention as kernels
    if self.attention != "mla":
      raise ValueError("sparse decode attention needs an MLA pool")
    fn = functools.partial(kernels.paged_mla_sparse_decode, scale=float(scale), backend=backend)
    pages = self._pages_of(layer)
    others = (batch_meta.block_tables, batch_meta.lengths, indices)
    if sharding is not None:
      return sharding.run(fn, tuple(queries), pages, others)
    return fn(*queries, *(x for _, x in pages), *others)


  def sparse_decode_select(self, layer: int, q: jax.Array, weights: jax.Array,
                           batch_meta: BatchMeta, *, k: int,
                           backend: str | None = None) -> jax.Array:
    """The positions each decode query selects: its ``k`` best-scoring cached tokens.

    The sparse-attention indexer over this layer's paged index keys (the
    paged index-scoring kernel, then top-k; docs/sparse_attention.md): no
    gather of the request's pages.

    Args:
      layer: a layer that stores index keys (``index_k``).
      q: [B, Hi, Di] indexer queries; weights: [B, Hi] f32 head weights.
      batch_meta: block tables and lengths (the current token included).
      k: index_topk.
      backend: "pallas" | "interpret" | "xla" | None (platform default).

    Returns:
      [B, min(k, max_pages * page_size)] int32 positions ascending, then -1:
      the ``indices`` of :meth:`sparse_decode_attention`.
    """
    from pallas_kernels import indexer
    lp = self.layers[layer]
    if "index_k" not in lp:
      raise ValueError(f"layer {layer} stores no index keys (not a full sparse-attention layer)")
    return indexer.paged_index_topk(q, weights, lp["index_k"], lp.get(scale_name("index_k")),
                                    batch_meta.block_tables, batch_meta.lengths, k=int(k),
                                    backend=backend)


def init_paged_state(cfg: ModelConfig, kv_cfg: KVCacheConfig, draft_layers: int = 0
                     ) -> PagedKVState:
  """An empty pool: zero pages, unit scales (fp8), all tags 0 (never allocated).

  Args:
    cfg: the model config (attention kind, entry shapes, layer count).
    kv_cfg: pool shape and dtype; page_size None takes the default for cfg.attention.
    draft_layers: extra layers after the model's for the multi-token-prediction layer
      that drafts speculative tokens (``mlkit.model.mtp.mtp_paged``): layer
      ``cfg.n_layers + i`` holds drafter layer i's KV in the same pages, under the same
      block tables and tags as the model's (docs/speculative.md).

  Returns:
    A :class:`PagedKVState`.
  """
  kv_cfg = kv_cfg.resolve(cfg)
  if draft_layers < 0:
    raise ValueError(f"init_paged_state: draft_layers must be >= 0, got {draft_layers}")
  if draft_layers and cfg.sparse_attention:
    raise ValueError("init_paged_state: drafter layers on a sparse-attention model are not "
                     "supported (its MTP layer runs an indexer of its own)")
  return _empty_pool(cfg, kv_cfg, draft_layers)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _empty_pool(cfg: ModelConfig, kv_cfg: KVCacheConfig, draft_layers: int) -> PagedKVState:
  """The empty pool of a resolved ``kv_cfg``, in one program per configuration (op by op,
  every entry's zeros and every fp8 scale's ones would compile a program of its own)."""
  N, P = kv_cfg.num_pages, kv_cfg.page_size
  dtype = jnp.dtype(kv_cfg.dtype)
  layers = []
  for i in range(cfg.n_layers + draft_layers):
    layer = {}
    # A drafter layer caches what a model layer caches (dense attention: every layer alike).
    for name, shp in entry_shapes(cfg, min(i, cfg.n_layers - 1)).items():
      layer[name] = jnp.zeros((N, P) + shp, dtype)
      if kv_cfg.is_fp8:
        layer[scale_name(name)] = jnp.ones((N, P) + shp[:-1], jnp.float32)
    layers.append(layer)
  return PagedKVState(layers=layers, page_tags=jnp.zeros((N,), jnp.int32))


# ----------------------------------------------------------------------------- validation

def validate_state(state: PagedKVState, kv_cfg: KVCacheConfig, cfg: ModelConfig | None = None) -> None:
  """Checks that ``state`` has the dtype, page size and page count ``kv_cfg`` says.

  Raises:
    ValueError: naming the mismatch.
  """
  if str(state.dtype) != kv_cfg.dtype:
    raise ValueError(f"KV dtype mismatch: state pages are {state.dtype}, the call expects {kv_cfg.dtype}")
  page_size = kv_cfg.page_size if cfg is None else kv_cfg.page_size_for(cfg)
  if page_size is not None and state.page_size != page_size:
    raise ValueError(f"page size mismatch: state pages hold {state.page_size} tokens, "
                     f"the call expects {page_size}")
  if state.num_pages != kv_cfg.num_pages:
    raise ValueError(f"page count mismatch: state has {state.num_pages} pages, "
                     f"the call expects {kv_cfg.num_pages}")
  if cfg is not None:
    if state.n_layers != cfg.n_layers:
      raise ValueError(f"state has {state.n_layers} layers, model config says {cfg.n_layers}")
    for i in range(cfg.n_layers):
      shapes = entry_shapes(cfg, i)
      if set(state.layer_names(i)) != set(shapes):
        raise ValueError(f"state layer {i} (entries {sorted(state.layer_names(i))}) does not match "
                         f"the model config {cfg.name!r}, which caches {sorted(shapes)}")
      for name, shp in shapes.items():
        if state.layers[i][name].shape[2:] != shp:
          raise ValueError(f"state layer {i} entry {name!r} does not match the model config "
                           f"{cfg.name!r}")


def _check_static(state: PagedKVState, meta: BatchMeta, positions=None) -> None:
  """Shape and page-size checks that hold under jit (no array values needed)."""
  if meta.page_size != state.page_size:
    raise ValueError(f"page size mismatch: state pages hold {state.page_size} tokens, "
                     f"batch metadata was built for {meta.page_size}")
  bt, lengths, tags = meta.block_tables, meta.lengths, meta.expected_tags
  if bt.ndim != 2 or lengths.shape != bt.shape[:1] or tags.shape != bt.shape:
    raise ValueError(f"batch metadata shapes disagree: block_tables {bt.shape}, lengths "
                     f"{lengths.shape}, expected_tags {tags.shape}")
  for what, x in (("block_tables", bt), ("lengths", lengths), ("expected_tags", tags)):
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"{what} must be integers, got {x.dtype}")
  if positions is not None and (positions.ndim != 2 or positions.shape[0] != bt.shape[0]):
    raise ValueError(f"positions {positions.shape} must be [B, T] with B = {bt.shape[0]}")


def validate_batch(state: PagedKVState, meta: BatchMeta, positions=None) -> None:
  """Host-side checks of a step's metadata against the pool, before anything is written.

  Args:
    state: the pool.
    meta: the step's metadata (concrete arrays).
    positions: optional [B, T] positions of the tokens to be written.

  Raises:
    ValueError: page-size mismatch; block-table entry outside the pool (not in
      [0, num_pages) and not PAD_PAGE); a length longer than the request's pages
      (more than max_pages * page_size, or a needed entry that is PAD_PAGE);
      a negative length or position.
  """
  _check_static(state, meta, positions)
  bt = np.asarray(meta.block_tables)
  lengths = np.asarray(meta.lengths)
  N, P = state.num_pages, state.page_size
  bad = (bt != PAD_PAGE) & ((bt < 0) | (bt >= N))
  if bad.any():
    b, j = map(int, np.argwhere(bad)[0])
    raise ValueError(f"block table entry [{b}, {j}] = {int(bt[b, j])} points outside the pool "
                     f"of {N} pages")
  if (lengths < 0).any():
    raise ValueError(f"lengths must be >= 0, got {lengths.tolist()}")
  needed = -(-lengths // P)  # ceil
  for b in range(bt.shape[0]):
    if needed[b] > bt.shape[1] or (bt[b, :needed[b]] == PAD_PAGE).any():
      have = int(np.sum(bt[b] != PAD_PAGE))
      raise ValueError(f"request {b}: length {int(lengths[b])} is longer than its pages "
                       f"({have} pages of {P} tokens)")
  if positions is not None and (np.asarray(positions) < 0).any():
    raise ValueError("positions must be >= 0")


def _check_entries(state: PagedKVState, layer: int, new, B: int, T: int) -> None:
  if not 0 <= layer < state.n_layers:
    raise ValueError(f"layer {layer} out of range for a state of {state.n_layers} layers")
  cur = state.layers[layer]
  if isinstance(new, MlaProjection):
    if state.layer_names(layer) != ("latent", "k_rope"):
      raise ValueError(f"an MlaProjection writes MLA's latent and k_rope; layer {layer} "
                       f"holds {state.layer_names(layer)}")
    widths = (cur["latent"].shape[-1], cur["k_rope"].shape[-1])
    if new.widths != widths or new.kv.shape[:2] != (B, T) or new.kv.ndim != 3:
      raise ValueError(f"the MlaProjection's kv {new.kv.shape} (latent and rope widths "
                       f"{new.widths}) does not match [{B}, {T}, C + Rr] with (C, Rr) = "
                       f"{widths}, the pool's")
    for name in ("cos", "sin"):
      if getattr(new, name).shape != (B, T, widths[1] // 2):
        raise ValueError(f"the MlaProjection's {name} has shape {getattr(new, name).shape}, "
                         f"not [{B}, {T}, {widths[1] // 2}]")
    return
  for name in state.layer_names(layer):
    if name not in new:
      raise ValueError(f"new entries lack {name!r} (layer {layer} of a {state.attention} pool)")
    want = (B, T) + cur[name].shape[2:]
    if new[name].shape != want:
      raise ValueError(f"new {name!r} has shape {new[name].shape}, the pool expects {want}")


# ----------------------------------------------------------------------------- write / read

def token_slots(block_tables: jax.Array, positions: jax.Array, lengths: jax.Array,
                page_size: int, num_pages: int) -> tuple[jax.Array, jax.Array]:
  """Physical (page, slot) of each token; tokens at positions >= length get page num_pages.

  Args:
    block_tables: [B, M] int32; positions: [B, T] int32; lengths: [B] int32.

  Returns:
    (page [B, T], slot [B, T]) int32. An out-of-pool page id makes a scatter with
    mode="drop" skip the token, which is how padding is never written.
  """
  M = block_tables.shape[1]
  idx = jnp.clip(positions // page_size, 0, M - 1)
  page = jnp.take_along_axis(block_tables, idx, axis=1)  # [B, T]
  valid = (positions >= 0) & (positions < lengths[:, None]) & (page >= 0) & (page < num_pages)
  page = jnp.where(valid, page, num_pages).astype(jnp.int32)
  return page, (positions % page_size).astype(jnp.int32)


def write_layer(state: PagedKVState, layer: int, new, positions: jax.Array,
                meta: BatchMeta, *, backend: str | None = "xla") -> PagedKVState:
  """Writes one layer's entries through the block tables (quantising for fp8). Pure and jittable.

  Args:
    state: the pool.
    layer: layer index (static).
    new: entries, each [B, T, *entry_shape]; or, for an MLA layer, a
      ``pallas_kernels.page_write.MlaProjection`` [B, T, ...], whose RMSNorm and rope the
      write computes (in the page write's own launch on the kernel backends).
    positions: [B, T] int32; tokens at positions >= lengths[b] are dropped.
    meta: batch metadata.
    backend: the page write's kernel backend (see :meth:`PagedKVState.write`).

  Returns:
    The updated state (only layer ``layer`` changes).
  """
  B, T = positions.shape
  _check_entries(state, layer, new, B, T)
  with jax.named_scope("paged_kv_write"):
    page, slot = token_slots(meta.block_tables, positions.astype(jnp.int32),
                             meta.lengths.astype(jnp.int32), state.page_size, state.num_pages)
    cur = state.layers[layer]
    upd = dict(cur)
    names = state.layer_names(layer)
    # Every array of the layer, with its fp8 scales: one scatter each on "xla", one kernel
    # launch for them all on the kernel backends (pallas_kernels.page_write), same bytes.
    scales = [cur[scale_name(n)] for n in names] if state.is_fp8 else None
    if isinstance(new, MlaProjection):
      rows = lambda a: a.reshape(B * T, a.shape[-1])  # noqa: E731
      pages, scales = write_mla_pages(rows(new.kv), new.norm_scale, rows(new.cos),
                                      rows(new.sin), [cur[n] for n in names], scales,
                                      page.reshape(-1), slot.reshape(-1), eps=new.eps,
                                      interleave=new.interleave, backend=backend)
    else:
      entries = [new[n].reshape(B * T, *new[n].shape[2:]) for n in names]
      pages, scales = write_pages(entries, [cur[n] for n in names], scales, page.reshape(-1),
                                  slot.reshape(-1), backend=backend)
    upd.update(zip(names, pages))
    if scales is not None:
      upd.update(zip(map(scale_name, names), scales))
  layers = list(state.layers)
  layers[layer] = upd
  return state.replace(layers=layers)


def gather_pages(pages: jax.Array, scale: jax.Array | None, block_tables: jax.Array,
                 lengths: jax.Array, dtype=jnp.float32) -> jax.Array:
  """Gathers each request's pages into a dense sequence, dequantising fp8.

  Args:
    pages: [N, P, *E] page array (bf16 / f32, or fp8 with ``scale``).
    scale: [N, P, *E[:-1]] f32 per-token scales, or None for non-fp8 pages.
    block_tables: [B, M] int32 (PAD_PAGE entries read as page 0 and are masked).
    lengths: [B] int32.
    dtype: output dtype.

  Returns:
    [B, M * P, *E] in ``dtype``; slots at positions >= length are zero, so stale
    or non-finite data in unused slots can never reach attention.
  """
  N, P = pages.shape[:2]
  B, M = block_tables.shape
  bt = jnp.clip(block_tables, 0, N - 1)
  x = pages[bt]  # [B, M, P, *E]
  if scale is not None:
    x = dequantize_fp8(x, scale[bt], jnp.float32)
  x = x.reshape((B, M * P) + pages.shape[2:])
  live = jnp.arange(M * P)[None, :] < lengths[:, None]  # [B, S]
  live = live.reshape(live.shape + (1,) * (x.ndim - 2))
  return jnp.where(live, x, 0).astype(dtype)


def gather_layer(state: PagedKVState, layer: int, block_tables: jax.Array, lengths: jax.Array,
                 dtype=jnp.float32) -> dict:
  """One layer's pages for each request: {name: [B, M * P, *E]} in ``dtype`` (see gather_pages)."""
  cur = state.layers[layer]
  with jax.named_scope("paged_kv_gather"):
    return {name: gather_pages(cur[name], cur.get(scale_name(name)), block_tables, lengths, dtype)
            for name in state.layer_names(layer)}


def paged_mask(positions: jax.Array, lengths: jax.Array, S: int) -> jax.Array:
  """[B, T, S] bool: key slot s visible to the query at positions[b, t] iff s <= it and s < length."""
  return causal_mask(positions, S, lengths=lengths).dense()


@functools.partial(jax.jit, donate_argnums=(0,))
def _write_all_jit(state: PagedKVState, new_layers: list, positions: jax.Array,
                   meta: BatchMeta) -> PagedKVState:
  for i, new in enumerate(new_layers):
    state = write_layer(state, i, new, positions, meta)
  return state


def _check_call(state: PagedKVState, new_layers: Sequence[dict], positions, meta: BatchMeta,
                kv_cfg: KVCacheConfig | None) -> None:
  if kv_cfg is not None:
    validate_state(state, kv_cfg)
  if len(new_layers) != state.n_layers:
    raise ValueError(f"got entries for {len(new_layers)} layers, the state has {state.n_layers}")
  validate_batch(state, meta, positions)
  for i, new in enumerate(new_layers):
    _check_entries(state, i, new, *positions.shape)


def write_prefill(state: PagedKVState, new_layers: Sequence[dict], positions: jax.Array,
                  meta: BatchMeta, *, kv_cfg: KVCacheConfig | None = None) -> PagedKVState:
  """Writes a chunk of T tokens per request into every layer (jitted, donates ``state``).

  Validation runs on the host first, so a bad call raises with ``state`` untouched
  (not donated).

  Args:
    state: the pool (donated on success).
    new_layers: per layer, entries each [B, T, *entry_shape] (any float dtype).
    positions: [B, T] int32 absolute positions; entries at positions >= lengths are skipped.
    meta: batch metadata; lengths count the tokens after this write.
    kv_cfg: if given, the state's dtype, page size and page count must match it.

  Returns:
    The updated state.

  Raises:
    ValueError: see :func:`validate_state` and :func:`validate_batch`, or entry shapes that
      do not match the pool.
  """
  positions = jnp.asarray(positions, jnp.int32)
  _check_call(state, new_layers, positions, meta, kv_cfg)
  return _write_all_jit(state, list(new_layers), positions, meta)


def write_decode(state: PagedKVState, new_layers: Sequence[dict], meta: BatchMeta, *,
                 kv_cfg: KVCacheConfig | None = None) -> PagedKVState:
  """Appends one token per request at position lengths[b] - 1 (jitted, donates ``state``).

  Args:
    state: the pool (donated on success).
    new_layers: per layer, entries each [B, *entry_shape].
    meta: batch metadata; lengths include the new token (rows with length 0 write nothing).
    kv_cfg: optional expected pool config (see :func:`write_prefill`).

  Returns:
    The updated state.

  Raises:
    ValueError: as :func:`write_prefill`.
  """
  positions = jnp.maximum(jnp.asarray(meta.lengths, jnp.int32) - 1, 0)[:, None]  # [B, 1]
  new_layers = [{k: v[:, None] for k, v in new.items()} for new in new_layers]
  return write_prefill(state, new_layers, positions, meta, kv_cfg=kv_cfg)


def read_layer(state: PagedKVState, layer: int, meta: BatchMeta, dtype=jnp.float32) -> dict:
  """Reads one layer back for each request: {name: [B, M * P, *E]} dequantised, zero past length."""
  return gather_layer(state, layer, meta.block_tables, meta.lengths, dtype)


# ----------------------------------------------------------------------------- tags and pages

def sync_tags(state: PagedKVState, tags: np.ndarray) -> PagedKVState:
  """Replaces the device ``page_tags`` with the allocator's tags.

  Args:
    state: the pool.
    tags: [num_pages] int32, the allocator's uint32 tags bit-cast for the device
      (``PageAllocator.device_tags()``). One type only, so a caller cannot hand over a
      tag array of another width or sign that would be silently re-interpreted.

  Returns:
    The state with the new tags.

  Raises:
    TypeError: if ``tags`` is not an int32 array.
    ValueError: if the tag count differs from the pool's page count.
  """
  if not isinstance(tags, (np.ndarray, jax.Array)) or tags.dtype != np.int32:
    raise TypeError(f"sync_tags takes the [num_pages] int32 array of PageAllocator.device_tags(), "
                    f"got {type(tags).__name__}" + (f" of {tags.dtype}" if hasattr(tags, "dtype") else ""))
  if tags.shape != (state.num_pages,):
    raise ValueError(f"tags shape {tags.shape} does not match the pool's {state.num_pages} pages")
  # A pool placed on a mesh keeps its tags there, so that its jitted steps see the same input
  # placement on every call (and compile once); a single-device pool keeps jnp's default.
  where = getattr(state.page_tags, "sharding", None)
  if isinstance(where, jax.sharding.NamedSharding):
    return state.replace(page_tags=jax.device_put(tags, where))
  return state.replace(page_tags=jnp.asarray(tags))


def _bucket(n: int) -> int:
  """The padded length of a host-built update of ``n`` pages: a power of two, at least 8, so
  that the programs compiled for page updates are few whatever each step touches."""
  return max(8, 1 << (int(n) - 1).bit_length())


@functools.partial(jax.jit, donate_argnums=(0,))
def _update_tags_jit(page_tags: jax.Array, pages: jax.Array, tags: jax.Array) -> jax.Array:
  return page_tags.at[pages].set(tags, mode="drop")  # padded entries name no page: dropped


def update_tags(state: PagedKVState, pages: np.ndarray, tags: np.ndarray, *,
                place=None) -> PagedKVState:
  """Writes the tags of ``pages`` into the device ``page_tags`` (the pages a step (re)allocated).

  Where :func:`sync_tags` copies the whole pool's tags, this moves only what
  changed (``PageAllocator.take_tag_changes``), so a step's tag update follows
  the pages it allocated, not the pool. The update is padded to a power of two
  (at least 8) with a page id past the pool, which the scatter drops: one
  compile per bucket. Donates the state's ``page_tags``.

  Args:
    state: the pool.
    pages: [k] int32 page ids in [0, num_pages).
    tags: [k] int32 their tags (uint32 bit-cast, as ``device_tags``).
    place: places the padded [K] arrays (a pool spread over processes needs them on
      its mesh); None: the default device.

  Raises:
    TypeError: ``pages`` or ``tags`` not int32.
    ValueError: shapes that differ, or a page outside the pool.
  """
  pages, tags = np.asarray(pages), np.asarray(tags)
  if pages.dtype != np.int32 or tags.dtype != np.int32:
    raise TypeError(f"update_tags takes int32 pages and tags, got {pages.dtype} and {tags.dtype}")
  if pages.ndim != 1 or pages.shape != tags.shape:
    raise ValueError(f"update_tags: pages {pages.shape} and tags {tags.shape} must be equal [k]")
  if pages.size == 0:
    return state
  if pages.min() < 0 or pages.max() >= state.num_pages:
    raise ValueError(f"update_tags: page ids outside the pool of {state.num_pages}")
  k = _bucket(pages.size)
  padded_pages = np.full(k, state.num_pages, np.int32)
  padded_pages[:pages.size] = pages
  padded_tags = np.zeros(k, np.int32)
  padded_tags[:tags.size] = tags
  place = place or jnp.asarray
  return state.replace(page_tags=_update_tags_jit(state.page_tags, place(padded_pages),
                                                  place(padded_tags)))


@functools.partial(jax.jit, donate_argnums=(0,))
def _copy_pages_jit(state: PagedKVState, src: jax.Array, dst: jax.Array) -> PagedKVState:
  # Every array of a layer (pages, scales, index keys) is indexed by page id first. Padded
  # pairs name a destination past the pool, which the scatter drops.
  layers = [{k: v.at[dst].set(v[src], mode="drop") for k, v in layer.items()}
            for layer in state.layers]
  return state.replace(layers=layers)


def copy_pages(state: PagedKVState, copies: Sequence[tuple[int, int]], *,
               place=None) -> PagedKVState:
  """Copies page contents src -> dst in every layer and entry (copy-on-write after a fork).

  Donates ``state``. Every page array moves: latent, rope key, sparse-attention
  index keys and fp8 scales. The copies are padded to a power of two (at least 8) with
  pairs the scatter drops, as :func:`update_tags` pads, so that a server copying a
  different number of pages each step compiles one program per bucket, not per count.

  Args:
    copies: (src, dst) physical page pairs, e.g. from ``PageAllocator.fork``.
    place: places the [n] int32 page-id arrays (a pool spread over processes needs
      them on its mesh); None: the default device.

  Raises:
    ValueError: if a page id is outside the pool.
  """
  if not copies:
    return state
  arr = np.asarray(copies, np.int64).reshape(-1, 2)
  if (arr < 0).any() or (arr >= state.num_pages).any():
    raise ValueError(f"copy_pages: page ids {arr.tolist()} outside the pool of {state.num_pages}")
  k = _bucket(len(arr))
  src = np.zeros(k, np.int32)
  dst = np.full(k, state.num_pages, np.int32)  # past the pool: dropped
  src[:len(arr)], dst[:len(arr)] = arr[:, 0], arr[:, 1]
  place = place or jnp.asarray
  return _copy_pages_jit(state, place(src), place(dst))
