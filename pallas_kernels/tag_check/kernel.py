"""Batched page-tag check kernel (Pallas Triton backend).

Why Triton and not Mosaic GPU: the check is a data-dependent gather
(page_tags[block_tables]). Mosaic GPU in jax 0.11.2 has no vector gather
from GMEM; expressed there it becomes one scalar GMEM load per (request,
page) in a loop, with per-request results written back through SMEM and a
TMA store. Triton lowers the gather to one vectorised masked load per tile,
which is exactly what this bandwidth-trivial check wants (B * P * 12 bytes).
"""

import jax.numpy as jnp
from jax.experimental import pallas as pl


def tag_check_kernel(page_tags_ref, block_tables_ref, expected_ref,
                     lengths_ref, ok_ref, *, page_size):
  """One program checks a tile of block_b requests.

  Refs:
    page_tags_ref [N] int32: all page tags.
    block_tables_ref, expected_ref [block_b, P_pad] int32: this tile's rows.
    lengths_ref [block_b] int32.
    ok_ref [block_b] int32: 1 where every used page matches, else 0.
  """
  bb, p = block_tables_ref.shape
  ids = block_tables_ref[...]
  used = (lengths_ref[...] + page_size - 1) // page_size  # [bb]
  col = jnp.arange(p, dtype=jnp.int32)[None, :]
  live = col < used[:, None]
  # Unused slots may hold anything (PAD_PAGE = -1); a used id outside the
  # pool is itself a failure. Either way gather page 0 instead, so the load
  # is never out of bounds.
  in_pool = (ids >= 0) & (ids < page_tags_ref.shape[0])
  safe_ids = jnp.where(live & in_pool, ids, 0)
  tags = page_tags_ref[safe_ids.reshape(bb * p)].reshape(bb, p)
  bad = live & ((tags != expected_ref[...]) | ~in_pool)
  ok_ref[...] = jnp.where(jnp.max(bad.astype(jnp.int32), axis=1) > 0, 0, 1)
