"""Paged KV cache: fp8/bf16 page pools with per-token scales, page tags and a host allocator.

Modules: ``config`` (KVCacheConfig), ``fp8`` (per-token quantisation), ``state``
(device pytree, write/read paths, the model cache interface), ``allocator``
(host free list, tags, refcounts, block tables, conservation audit), ``reference`` (pure-jnp paged
attention and tag check), ``capacity`` (bytes per token, tokens per budget, the budget of the
fp8-vs-bf16 comparison, and a pool allocated within a budget to check the accounting).

One step, end to end::

  alloc = PageAllocator(kv_cfg.num_pages, kv_cfg.page_size_for(cfg))
  state = init_paged_state(cfg, kv_cfg)
  if (refused := alloc.admit(rid, prompt_len)) is not None: ...  # CannotAdmit: queue it
  meta = alloc.batch_meta(batch_ids, max_pages=M)               # host -> device arrays
  state = sync_tags(state, alloc.device_tags())                 # device page_tags mirror
  validate_batch(state, meta, positions)                        # host-side value checks
  ok = tag_check_reference(state.page_tags, meta.block_tables, meta.expected_tags,
                           meta.lengths, page_size=meta.page_size)  # before attention reads
  logits, state = jitted_apply(params, tokens, positions, state, batch_meta=meta)  # donates state

The paged state is itself the cache ``mlkit.model.apply`` expects (it has
``update(layer, new, positions, batch_meta)``), so the model runs unchanged.
"""

from mlkit.kvcache.allocator import (CannotAdmit, OutOfPages, PageAllocator, PageViolation, next_tag,
                                    tag_to_int32)
from mlkit.kvcache.capacity import (allocate_within, bytes_per_token, bytes_per_token_breakdown,
                                   capacity, separating_budget)
from mlkit.kvcache.config import DEFAULT_PAGE_SIZE, KV_DTYPES, KVCacheConfig
from mlkit.kvcache.fp8 import FP8_MAX, dequantize_fp8, quantize_fp8
from mlkit.kvcache.reference import (paged_gqa_decode_reference, paged_gqa_prefill_reference,
                                     paged_mla_decode_reference, paged_mla_prefill_reference,
                                     tag_check_reference)
from mlkit.kvcache.state import (PAD_PAGE, BatchMeta, PagedKVState, copy_pages, gather_layer,
                                 gather_pages, init_paged_state, paged_mask, read_layer, sync_tags,
                                 update_tags,
                                 validate_batch, validate_state, write_decode, write_layer,
                                 write_prefill)

__all__ = [
    "BatchMeta", "CannotAdmit", "DEFAULT_PAGE_SIZE", "FP8_MAX", "KVCacheConfig", "KV_DTYPES",
    "OutOfPages", "PAD_PAGE", "PageAllocator", "PageViolation", "PagedKVState", "allocate_within",
    "bytes_per_token",
    "bytes_per_token_breakdown", "capacity", "copy_pages", "dequantize_fp8", "gather_layer",
    "gather_pages", "init_paged_state", "next_tag", "paged_gqa_decode_reference",
    "paged_gqa_prefill_reference", "paged_mla_decode_reference", "paged_mla_prefill_reference",
    "paged_mask", "quantize_fp8", "read_layer", "separating_budget", "sync_tags",
    "tag_check_reference",
    "update_tags",
    "tag_to_int32", "validate_batch", "validate_state", "write_decode", "write_layer",
    "write_prefill",
]
