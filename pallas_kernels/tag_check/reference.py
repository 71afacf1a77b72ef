"""Pure-jnp reference for the page-tag check (the ``xla`` backend)."""

import jax.numpy as jnp


def tag_check_reference(page_tags, block_tables, expected_tags, lengths, *,
                        page_size):
  """Per-request page-integrity check: do the used pages still carry our tags?

  Request b is ok iff page_tags[block_tables[b, i]] == expected_tags[b, i]
  for every i < ceil(lengths[b] / page_size); a used id outside the pool
  fails. Entries past that are ignored (stale ids or tags, or PAD_PAGE = -1).

  Args:
    page_tags: [N] int32 current tag of each physical page.
    block_tables: [B, P] int32 page ids.
    expected_tags: [B, P] int32 tags recorded when the pages were allocated.
    lengths: [B] int32 tokens in use per request (0 <= lengths[b] <= P * page_size).
    page_size: tokens per page.

  Returns:
    [B] bool, True where every used page's tag matches.
  """
  n = page_tags.shape[0]
  used = (lengths + page_size - 1) // page_size  # [B]
  i = jnp.arange(block_tables.shape[1])
  in_pool = (block_tables >= 0) & (block_tables < n)
  match = in_pool & (page_tags[jnp.clip(block_tables, 0, n - 1)] == expected_tags)
  return jnp.all(match | (i[None, :] >= used[:, None]), axis=1)
