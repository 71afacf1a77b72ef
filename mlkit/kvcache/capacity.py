"""KV capacity accounting: bytes per token for a config and storage dtype, tokens per budget.

Also the budget of lever 1's comparison (:func:`separating_budget`: fp8 holds the
sequences, bf16 does not) and a pool really allocated within a budget
(:func:`allocate_within`), the check that this accounting matches the arrays.

Counted per GPU. Under tensor parallelism MLA's latent and rope key are
replicated on every rank, so ``tp`` does not change MLA figures; GQA's KV heads
split across ranks (ceil(n_kv_heads / tp) per rank).

Per token per layer:

* MLA: (kv_lora_rank + qk_rope_head_dim) values; fp8 adds two f32 scales (latent, rope).
* GQA: 2 * kv_heads * head_dim values; fp8 adds 2 * kv_heads f32 scales.
* Sparse-attention indexer (GLM 5.x; configs with ``index_head_dim > 0``): one key of
  ``index_head_dim`` values per token.

  - A config that runs it (``indexer_types``) counts the paged pool's real layout
    (``mlkit.kvcache.state``): keys only on the "full" layers, in the pool's dtype,
    plus one f32 scale per token when the pool is fp8. ``index_dtype`` must then be
    None or the pool's dtype.
  - A config that only declares it (``index_n_heads`` without ``indexer_types``,
    e.g. the paper-scale ``GLM_5_2`` preset) counts the analytic size: a key on
    every layer, stored in ``index_dtype`` (default bf16, whatever the KV dtype;
    "float8_e4m3fn" adds one f32 scale).

Per page, the pool also holds one int32 tag (4 bytes).
"""

from __future__ import annotations

import math

from mlkit.config import ModelConfig
from mlkit.kvcache.config import DEFAULT_PAGE_SIZE, KV_DTYPES

_ITEMSIZE = {"bfloat16": 2, "float8_e4m3fn": 1, "float32": 4}
# Bytes of one per-token scale (f32).
SCALE_BYTES = 4
# Bytes of one page tag (int32).
TAG_BYTES = 4


def _check_dtype(dtype: str, what: str) -> None:
  if dtype not in KV_DTYPES:
    raise ValueError(f"{what} must be one of {KV_DTYPES}, got {dtype!r}")


def _indexer_bytes(cfg: ModelConfig, dtype: str, index_dtype: str | None) -> int:
  """Indexer-key bytes per token over all layers (see the module docstring)."""
  if not cfg.index_head_dim:
    return 0
  if cfg.sparse_attention:  # the pool's layout: full layers, the pool's dtype and scales
    if index_dtype not in (None, dtype):
      raise ValueError(f"{cfg.name} runs its indexer: the paged pool keeps index keys in the pool's "
                       f"dtype {dtype!r}, not index_dtype={index_dtype!r}")
    index_dtype = dtype
    n_layers = sum(cfg.runs_indexer(i) for i in range(cfg.n_layers))
  else:
    index_dtype = "bfloat16" if index_dtype is None else index_dtype
    n_layers = cfg.n_layers
  per_layer = cfg.index_head_dim * _ITEMSIZE[index_dtype]
  if index_dtype == "float8_e4m3fn":
    per_layer += SCALE_BYTES
  return n_layers * per_layer


def bytes_per_token_breakdown(cfg: ModelConfig, dtype: str, *, index_dtype: str | None = None,
                              tp: int = 1) -> dict[str, int]:
  """Per-GPU cache bytes per token, split into values, scales and indexer (all layers).

  Args:
    cfg: the model config.
    dtype: KV storage dtype ("bfloat16", "float8_e4m3fn" or "float32").
    index_dtype: storage dtype of a declared-only indexer's key cache (None: bf16); for a
      config that runs its indexer, None or ``dtype`` (the pool stores index keys in its dtype).
    tp: tensor-parallel degree (affects GQA only).

  Returns:
    {"values", "scales", "indexer", "total"} in bytes per token.

  Raises:
    ValueError: on an unknown dtype, tp < 1, or an index_dtype other than the pool's for a
      config that runs its indexer.
  """
  _check_dtype(dtype, "dtype")
  if index_dtype is not None:
    _check_dtype(index_dtype, "index_dtype")
  if tp < 1:
    raise ValueError(f"tp must be >= 1, got {tp}")
  fp8 = dtype == "float8_e4m3fn"
  if cfg.attention == "mla":
    n_values = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    n_scales = 2 if fp8 else 0
  else:
    kv_local = math.ceil(cfg.n_kv_heads / tp)
    n_values = 2 * kv_local * cfg.head_dim
    n_scales = 2 * kv_local if fp8 else 0
  values = cfg.n_layers * n_values * _ITEMSIZE[dtype]
  scales = cfg.n_layers * n_scales * SCALE_BYTES
  indexer = _indexer_bytes(cfg, dtype, index_dtype)
  return {"values": values, "scales": scales, "indexer": indexer,
          "total": values + scales + indexer}


def bytes_per_token(cfg: ModelConfig, dtype: str, *, index_dtype: str | None = None,
                    tp: int = 1) -> int:
  """Per-GPU cache bytes per token (values + fp8 scales + indexer keys), all layers.

  Kimi K2.6: 70,272 in bf16; 35,136 + 488 scale bytes = 35,624 in fp8.

  Raises:
    ValueError: on an unknown dtype or tp < 1.
  """
  return bytes_per_token_breakdown(cfg, dtype, index_dtype=index_dtype, tp=tp)["total"]


def capacity(cfg: ModelConfig, dtype: str, budget_bytes: int, *, page_size: int | None = None,
             index_dtype: str | None = None, tp: int = 1) -> dict:
  """How many pages and tokens of ``cfg``'s cache fit in ``budget_bytes`` (per GPU).

  Args:
    cfg: the model config.
    dtype: KV storage dtype.
    budget_bytes: bytes available for the pool.
    page_size: tokens per page (default: 64 for MLA, 16 for GQA).
    index_dtype, tp: see :func:`bytes_per_token`.

  Returns:
    {"bytes_per_token", "bytes_per_page", "pages", "tokens"}; a page costs
    page_size * bytes_per_token plus its 4-byte tag.

  Raises:
    ValueError: on a negative budget, non-positive page size or unknown dtype.
  """
  if budget_bytes < 0:
    raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
  page_size = DEFAULT_PAGE_SIZE[cfg.attention] if page_size is None else page_size
  if page_size <= 0:
    raise ValueError(f"page_size must be positive, got {page_size}")
  bpt = bytes_per_token(cfg, dtype, index_dtype=index_dtype, tp=tp)
  bpp = page_size * bpt + TAG_BYTES
  pages = int(budget_bytes) // bpp
  return {"bytes_per_token": bpt, "bytes_per_page": bpp, "pages": pages,
          "tokens": pages * page_size}


def separating_budget(cfg: ModelConfig, *, concurrency: int, prompt_tokens: int, new_tokens: int,
                      page_size: int, admission_reserve: int = 1, warmup_steps: int = 0) -> dict:
  """The KV budget of lever 1's comparison: fp8 pages hold ``concurrency`` full sequences, bf16
  pages of the same bytes fewer (the report's shape: bf16 out of memory, fp8 running).

  Sized for an engine that admits one prompt per step and keeps ``admission_reserve``
  pages back (``mlkit.engine.EngineConfig.admission_reserve``): a sequence is
  ``prompt_tokens + new_tokens`` tokens at its end.

  Args:
    cfg: the model config.
    concurrency: the sequences the fp8 pool must hold at full length at once.
    prompt_tokens, new_tokens: one sequence's prompt and generated tokens.
    page_size: tokens per page.
    admission_reserve: pages the engine keeps free beside the running sequences.
    warmup_steps: decode steps a measurement drops before all sequences decode together.

  Returns:
    {budget_bytes, pages_per_seq, pages: {dtype: pool pages}, fits: {dtype: sequences
    that fit at full length}, admission_reserve}.

  Raises:
    ValueError: if the bf16 pool would also hold them all (then the shape cannot appear), or
      the outputs are too short for all sequences to decode together (one prefill per step).
  """
  if new_tokens <= concurrency + warmup_steps:
    raise ValueError(f"separating_budget: {new_tokens} new tokens end before {concurrency} "
                     "prompts (one per step) are all prefilled")
  pps = -(-(prompt_tokens + new_tokens) // page_size)
  dtypes = ("bfloat16", "float8_e4m3fn")
  fp8 = capacity(cfg, "float8_e4m3fn", 0, page_size=page_size)
  budget = (concurrency * pps + admission_reserve) * fp8["bytes_per_page"]
  pages = {d: capacity(cfg, d, budget, page_size=page_size)["pages"] for d in dtypes}
  fits = {d: (pages[d] - admission_reserve) // pps for d in dtypes}
  if fits["bfloat16"] >= concurrency or fits["float8_e4m3fn"] < concurrency:
    raise ValueError(f"separating_budget: {budget} B does not separate the dtypes: {fits}")
  return {"budget_bytes": budget, "pages_per_seq": pps, "pages": pages, "fits": fits,
          "admission_reserve": admission_reserve}


def allocate_within(cfg: ModelConfig, dtype: str, budget_bytes: int, *,
                    page_size: int | None = None) -> dict:
  """Allocates the largest pool :func:`capacity` plans within ``budget_bytes`` and counts it.

  The accounting checked against a real allocation on the default device: the
  pool's arrays (pages, scales, index keys, tags) must sum to at most the budget.

  Returns:
    {model, dtype, budget_bytes, pages, tokens, allocated_bytes, bytes_per_token,
    unused_bytes}.

  Raises:
    RuntimeError: the allocated pool exceeds the budget (the accounting undercounts).
  """
  import jax

  from mlkit.kvcache.config import KVCacheConfig
  from mlkit.kvcache.state import init_paged_state
  page_size = DEFAULT_PAGE_SIZE[cfg.attention] if page_size is None else page_size
  plan = capacity(cfg, dtype, budget_bytes, page_size=page_size)
  state = init_paged_state(cfg, KVCacheConfig(plan["pages"], page_size, dtype))
  jax.block_until_ready(state)
  allocated = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
  del state
  if allocated > budget_bytes:
    raise RuntimeError(f"{cfg.name} {dtype}: pool of {allocated} B exceeds the {budget_bytes} B "
                       "budget")
  return {"model": cfg.name, "dtype": dtype, "budget_bytes": budget_bytes, "pages": plan["pages"],
          "tokens": plan["pages"] * page_size, "allocated_bytes": int(allocated),
          "bytes_per_token": plan["bytes_per_token"], "unused_bytes": budget_bytes - int(allocated)}
