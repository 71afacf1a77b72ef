"""Paged indexer scoring on the Pallas Triton backend.

One program scores ``block_k`` consecutive token positions of one request:
it gathers their index-key rows through the block table (row
page * page_size + slot of the flattened pages, as the sparse MLA kernel
does), takes one [Hi, Di] x [Di, block_k] dot against the request's indexer
queries, and reduces over heads in registers:

    score[t] = sum_h w[h] * relu(q[h] . k_t * Di^-1/2)

Numerics: fp8 keys are converted to the query dtype for the dot and their
per-token scale multiplies the [Hi, block_k] dot column-wise (before the
ReLU, which commutes with a positive scale); the dot accumulates in f32 and
the head reduction is f32. Positions at or past the request's length get
-inf, so the top-k after it never picks them.
"""

from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def index_scores_kernel(q_ref, w_ref, k_ref, k_scale_ref, block_tables_ref, lengths_ref,
                        out_ref, *, page_size, table_width, block_k):
  """One (request, token block) program of paged index scoring.

  Refs:
    q_ref [Hi, Di]: this request's indexer queries (heads padded with zeros).
    w_ref [Hi] f32: its head weights (padded heads 0).
    k_ref [N * ps, Di]: all index-key pages, one row per token slot.
    k_scale_ref [N * ps] f32 or None (not fp8).
    block_tables_ref [B * M]: the flattened tables.
    lengths_ref [B].
    out_ref [block_k] f32: this block's scores.
  """
  b = pl.program_id(0)
  first = pl.program_id(1) * block_k
  length = lengths_ref[b]

  @pl.when(first >= length)
  def _():  # a block wholly past the length reads nothing
    out_ref[...] = jnp.full((block_k,), -jnp.inf, jnp.float32)

  @pl.when(first < length)
  def _():
    q = q_ref[...]
    num_pages = k_ref.shape[0] // page_size
    pos = first + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    valid = pos < length
    # Positions past the length read row 0 (no load out of bounds); their
    # columns are independent of the others and masked below.
    slot = jnp.minimum(pos // page_size, table_width - 1)
    page = jnp.clip(block_tables_ref[b * table_width + slot], 0, num_pages - 1)
    rows = jnp.where(valid, page * page_size + pos % page_size, 0)
    keys = k_ref[rows].astype(q.dtype)  # [bk, Di]
    s = lax.dot_general(q, keys, (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32)  # [Hi, bk]
    if k_scale_ref is not None:
      s = s * k_scale_ref[rows].reshape(1, block_k)
    s = jnp.maximum(s * (q.shape[1] ** -0.5), 0.0)
    score = jnp.sum(w_ref[...].reshape(-1, 1) * s, axis=0)  # [bk]
    out_ref[...] = jnp.where(valid, score, -jnp.inf)
