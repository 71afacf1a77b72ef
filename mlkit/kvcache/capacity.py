"""KV capacity accounting: bytes per token for a config and storage dtype, tokens per budget.

Counted per GPU. Under tensor parallelism MLA's latent and rope key are
replicated on every rank, so ``tp`` does not change MLA figures; GQA's KV heads
split across ranks (ceil(n_kv_heads / tp) per rank).

Per token per layer:

* MLA: (kv_lora_rank + qk_rope_head_dim) values; fp8 adds two f32 scales (latent, rope).
* GQA: 2 * kv_heads * head_dim values; fp8 adds 2 * kv_heads f32 scales.
* Sparse-attention indexer (GLM 5.x; configs with ``index_head_dim > 0``): one key of
  ``index_head_dim`` values per token per layer, stored in bf16 unless
  ``index_dtype="float8_e4m3fn"`` is requested (then 1 B per value plus one f32 scale).
  The KV dtype does not change the indexer's dtype.

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


def bytes_per_token_breakdown(cfg: ModelConfig, dtype: str, *, index_dtype: str = "bfloat16",
                              tp: int = 1) -> dict[str, int]:
  """Per-GPU cache bytes per token, split into values, scales and indexer (all layers).

  Args:
    cfg: the model config.
    dtype: KV storage dtype ("bfloat16", "float8_e4m3fn" or "float32").
    index_dtype: storage dtype of the indexer key cache (only for configs with one).
    tp: tensor-parallel degree (affects GQA only).

  Returns:
    {"values", "scales", "indexer", "total"} in bytes per token.

  Raises:
    ValueError: on an unknown dtype or tp < 1.
  """
  _check_dtype(dtype, "dtype")
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
  indexer = 0
  if cfg.index_head_dim:
    per_layer = cfg.index_head_dim * _ITEMSIZE[index_dtype]
    if index_dtype == "float8_e4m3fn":
      per_layer += SCALE_BYTES
    indexer = cfg.n_layers * per_layer
  return {"values": values, "scales": scales, "indexer": indexer,
          "total": values + scales + indexer}


def bytes_per_token(cfg: ModelConfig, dtype: str, *, index_dtype: str = "bfloat16",
                    tp: int = 1) -> int:
  """Per-GPU cache bytes per token (values + fp8 scales + indexer keys), all layers.

  Kimi K2.6: 70,272 in bf16; 35,136 + 488 scale bytes = 35,624 in fp8.

  Raises:
    ValueError: on an unknown dtype or tp < 1.
  """
  return bytes_per_token_breakdown(cfg, dtype, index_dtype=index_dtype, tp=tp)["total"]


def capacity(cfg: ModelConfig, dtype: str, budget_bytes: int, *, page_size: int | None = None,
             index_dtype: str = "bfloat16", tp: int = 1) -> dict:
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
