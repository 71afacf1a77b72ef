"""Device-side work schedules of the kernels, computed by XLA before a launch.

``prefix_sum`` serves the INT4 grouped kernel's tiles and the attention
kernels' pieces; ``schedule_pieces`` balances paged decode attention over the
SMs (mla_mgpu, gqa_mgpu; docs/paged_attention.md).
"""

import functools

import jax
from jax import lax
import jax.numpy as jnp


def pow2_at_least(n: int) -> int:
  """The least power of two >= n (1 for n <= 1): Triton tensors' sizes are powers of two."""
  return 1 << max(0, int(n) - 1).bit_length()


def prefix_sum(x: jax.Array) -> jax.Array:
  """Inclusive prefix sum of a short [E] int vector as one masked [E, E] reduction.

  E is tens to a few hundred (experts on one device, requests in a batch), so
  this is one small fusion; XLA's GPU cumsum (a reduce-window) and searchsorted
  (a while loop) add several kernels per call and seconds of compile time.

  Returns:
    [E] int32.
  """
  i = lax.broadcasted_iota(jnp.int32, (x.shape[0], x.shape[0]), 0)
  j = lax.broadcasted_iota(jnp.int32, (x.shape[0], x.shape[0]), 1)
  return jnp.sum(jnp.where(j <= i, x[None, :], 0), axis=1, dtype=jnp.int32)


# Fewest pages a piece gets when there is work to spare: each piece also loads
# the query and writes a partial output, and with one page nothing is
# prefetched while a page is computed.
MIN_PAGES_PER_PIECE = 2


def num_pieces(batch: int, max_pages: int, slots: int) -> int:
  """The grid's pieces per head block: ``slots`` CTAs (one wave: the SMs times
  the CTAs per SM, over the head blocks), more than the requests, and never
  more than batch * ceil(max_pages / MIN_PAGES_PER_PIECE) + 1, the most a
  schedule can use (one piece per MIN_PAGES_PER_PIECE pages, or one per
  request): every piece, used or not, writes a partial that the merge reads
  back (64 KiB of bf16 for a 64-head MLA block, more than an fp8 page), so
  pieces no schedule can use would only add traffic.

  Args:
    batch: requests.
    max_pages: the block table's width, in the schedule's units.
    slots: CTAs of one wave that this head block may take.
  """
  usable = batch * -(-max_pages // MIN_PAGES_PER_PIECE) + 1
  return max(batch + 1, min(slots, usable))


# Jitted so that an eager call (tests, tools) compiles one program per shape instead of
# one per operation; inside a caller's jit it is inlined as before.
@functools.partial(jax.jit, static_argnames=("page_size", "max_pages", "pieces"))
def schedule_pieces(lengths, *, page_size, max_pages, pieces):
  """Cuts every request's pages into pieces of one size that fill ``pieces`` CTAs.

  The piece size q is the smallest (at least MIN_PAGES_PER_PIECE) for which the
  pieces fit: request b takes max(1, ceil(pages_b / q)) pieces (a request with
  no tokens gets one empty piece, whose output is zero), and their sum must be
  at most ``pieces``. q = max_pages always fits (one piece per request, and
  pieces > B); every candidate q in [1, max_pages] is counted at once, a
  [max_pages, B] reduction in one fusion. The longest piece then bounds the
  step's critical path (64 requests of 2,048 pages over 132 pieces: two pieces
  of 1,024 pages each). Pieces are ordered by request. A few small XLA fusions:
  no sort, search or scatter.

  Args:
    lengths: [B] int32 tokens per request.
    page_size, max_pages: the page size and the block table's width.
    pieces: the grid's pieces (``num_pieces``), > B.

  Returns:
    [5, pieces] int32 rows, per piece: request (-1: unused), first page (an index
    into the request's block-table row), pages; then per request, in columns
    0..B-1 (0 past them): its first piece and its piece count, which the merge of
    the pieces reads (``merge_pieces_mgpu``; computed here, with the schedule, so
    that they are ready before the decode kernel that reads the same array).
  """
  b = lengths.shape[0]
  pages = jnp.clip(-(-lengths.astype(jnp.int32) // page_size), 0, max_pages)  # [B]

  # Every candidate size at once ([max_pages, B], one fusion): the piece count
  # only falls as q grows, so q is the first candidate whose count fits.
  cand = jnp.arange(1, max(1, max_pages) + 1, dtype=jnp.int32)  # [Q]
  counts = jnp.sum(jnp.maximum(1, -(-pages[None, :] // cand[:, None])), axis=1)  # [Q]
  fits = (counts <= pieces) & (cand >= MIN_PAGES_PER_PIECE)
  # cand = max_pages always fits (one piece per request, and pieces > B).
  q = jnp.maximum(jnp.min(jnp.where(fits, cand, max(1, max_pages))), MIN_PAGES_PER_PIECE)
  n = jnp.maximum(1, -(-pages // q))  # [B] pieces per request
  ends = prefix_sum(n)
  p = jnp.arange(pieces, dtype=jnp.int32)
  req = jnp.minimum(jnp.sum(ends[None, :] <= p[:, None], axis=1, dtype=jnp.int32), b - 1)
  first = (p - (ends[req] - n[req])) * q
  steps = jnp.clip(pages[req] - first, 0, q)
  used = p < ends[-1]
  per_request = lambda v: jnp.pad(v, (0, pieces - b))  # noqa: E731  [pieces], B < pieces
  return jnp.stack([jnp.where(used, req, -1), jnp.where(used, first, 0),
                    jnp.where(used, steps, 0), per_request(ends - n),
                    per_request(n)]).astype(jnp.int32)
