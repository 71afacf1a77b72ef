"""Pure-jnp reference for the page-tag check (the ``xla`` backend)."""

import jax.numpy as jnp


def tag_check_reference(page_tags, block_tables, expected_tags, lengths, *,
                        page_size):
  """Per-request page-integrity check: do the used pages still carry our tags?

  Request b is ok iff page_tags[block_tables[b, i]] == expected_tags[b, i]
  for every i < ceil(lengths[b] / page_size). Entries past that are ignored
  (they may hold stale ids or tags, but must be valid page ids).

  Args:
    page_tags: [N] int32 current tag of each physical page.
    block_tables: [B, P] int32 page ids.
    expected_tags: [B, P] int32 tags recorded when the pages were allocated.
    lengths: [B] int32 tokens in use per request (0 <= lengths[b] <= P * page_size).
    page_size: tokens per page.

  Returns:
    [B] bool, True where every used page's tag matches.
  """
  used = (lengths + page_size - 1) // page_size  # [B]
  i = jnp.arange(block_tables.shape[1])
  match = page_tags[block_tables] == expected_tags  # [B, P]
  return jnp.all(match | (i[None, :] >= used[:, None]), axis=1)
