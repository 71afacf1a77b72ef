"""Merges the pieces of the Mosaic GPU decode kernels in one Pallas Triton kernel.

mla_mgpu, mla_tokens_mgpu and gqa_mgpu cut every request's pages into pieces
(``schedule.schedule_pieces``, ordered by request) and write one partial per
piece: its output, already divided by its own softmax sum, and its log-sum-exp.
A request's output is the lse-weighted mean of its pieces' partials.

``reference.combine_pieces`` states that merge as a product with a one-hot
[B, G] request map, which XLA builds as an f32 GEMM of B x G x H x D
multiply-adds (554 MFLOP for 64 requests over 132 pieces of 64 heads x 512)
plus four more kernels and an f32 [B, H, D] temporary; the work grows with the
batch times the pieces, though each partial belongs to one request. This kernel
reads every partial once: one program per (request, row block, column block)
walks that request's pieces, ``kp`` at a time, with an online softmax merge in
f32, and writes the output in its final dtype. Per request it needs the first
piece and the count, which two [B, G] reductions give (pieces are ordered by
request). The sum runs in a fixed order, so results are deterministic (no
atomics). docs/paged_attention.md ("Merging the pieces") has the design.
"""

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import device
from pallas_kernels.schedule import pow2_at_least

# Elements of one program's [kp, rows, cols] partial tile: 64 f32 registers a
# thread at 4 warps, so a tile and its weighted copy stay in registers.
TILE_ELEMENTS = 8192
NUM_WARPS = 4
# Loads in flight per program: the loop is a chain of small independent loads.
NUM_STAGES = 3
# Column tiles tried, widest first; the widest that still gives every SM two
# programs is taken (a batch-1 merge needs narrow columns to spread its pieces).
_COL_TILES = (128, 64, 32, 16)
_MAX_ROW_TILE = 8


def tiles(batch: int, x: int, rows: int, d: int, pieces: int | None = None,
          kind: str | None = None) -> tuple[int, int, int]:
  """(row tile, column tile, pieces per step) of the merge for this shape.

  Pieces per step fill a tile of TILE_ELEMENTS, but no more than the pieces an
  average request has (``pieces`` over the batch, rounded up to a power of two):
  at 64 requests over 132 pieces a step takes 4, not 8 lanes of which most would
  be past the request's pieces.

  Args:
    batch: requests B.
    x: independent row groups (1 for MLA, the KV heads for GQA).
    rows: real rows per group (heads, or a KV head's query group).
    d: columns (MLA's latent width C, GQA's head_dim), a multiple of 16.
    pieces: the schedule's pieces G (None: no cap).
    kind: the device kind (None: the traced one), for its SM count.
  """
  bh = min(_MAX_ROW_TILE, pow2_at_least(rows))
  row_blocks = -(-rows // bh)
  want = 2 * device.num_sms(kind)
  fits = [bd for bd in _COL_TILES if d % bd == 0]
  if not fits:
    raise ValueError(f"merge_pieces needs columns divisible by {_COL_TILES[-1]}; got {d}")
  bd = next((c for c in fits if batch * x * row_blocks * (d // c) >= want), fits[-1])
  kp = max(1, TILE_ELEMENTS // (bh * bd))
  if pieces is not None:
    kp = min(kp, pow2_at_least(-(-pieces // batch)))
  return bh, bd, kp


def request_ranges(request: jax.Array, batch: int, ranges: jax.Array | None = None
                   ) -> jax.Array:
  """[n >= 2, >= B] int32 whose last two rows are every request's first piece and
  piece count.

  Args:
    request: the schedule's request row ([G] int32, ordered by request, -1 for
      unused pieces).
    batch: B.
    ranges: None, or such an array already (``schedule.schedule_pieces``'s own,
      rows 3-4), which is checked and returned: the ops pass the schedule the
      decode kernel reads, so XLA computes the ranges before the decode kernel
      and nothing runs between it and the merge.

  Returns:
    ``ranges``, or [2, B] computed from ``request`` in one reduction.

  Raises:
    ValueError: ``ranges`` is not int32 [n >= 2, >= B].
  """
  if ranges is not None:
    if not (ranges.ndim == 2 and ranges.shape[0] >= 2 and ranges.shape[1] >= batch
            and ranges.dtype == jnp.int32):
      raise ValueError(f"ranges must be int32 [n >= 2, >= {batch}]; got {ranges.dtype} "
                       f"{ranges.shape}")
    return ranges
  b = jnp.arange(batch, dtype=jnp.int32)[:, None]
  req = request.astype(jnp.int32)[None, :]
  before_or_mine = jnp.stack([(req >= 0) & (req < b), req == b])  # [2, B, G]
  return jnp.sum(before_or_mine, axis=2, dtype=jnp.int32)


def _merge_kernel(ranges_ref, o_ref, lse_ref, out_ref, *, kp):
  """One (request, row block, column block): its pieces' tiles, kp per step.

  ranges_ref: [n, >= B] int32 (``request_ranges``); o_ref: [G, bh, bd] partial
  tiles; lse_ref: [G, bh] f32; out_ref: [bh, bd].
  """
  b = pl.program_id(0)
  n = ranges_ref.shape[0]
  first, count = ranges_ref[n - 2, b], ranges_ref[n - 1, b]
  bh, bd = out_ref.shape
  lanes = lax.broadcasted_iota(jnp.int32, (kp,), 0)

  def step(i, carry):
    acc, m, s = carry  # [bh, bd], [bh], [bh] f32
    k = first + i * kp + lanes  # [kp]
    live = k < first + count
    # Lanes past the request's pieces re-read its first piece (in bounds, and the
    # lines lane 0 loads anyway) and weigh 0.
    ids = jnp.where(live, k, first)
    lse = jnp.where(live[:, None], lse_ref[ids].astype(jnp.float32), -jnp.inf)  # [kp, bh]
    o = o_ref[ids].astype(jnp.float32)  # [kp, bh, bd]
    m_new = jnp.maximum(m, jnp.max(lse, axis=0))  # finite: lane 0 of step 0 is live
    alpha = jnp.exp(m - m_new)
    w = jnp.exp(lse - m_new[None, :])  # [kp, bh]; 0 on dead lanes
    acc = acc * alpha[:, None] + jnp.sum(w[:, :, None] * o, axis=0)
    return acc, m_new, s * alpha + jnp.sum(w, axis=0)

  init = (jnp.zeros((bh, bd), jnp.float32), jnp.full((bh,), -jnp.inf, jnp.float32),
          jnp.zeros((bh,), jnp.float32))
  acc, _, s = lax.fori_loop(0, (count + kp - 1) // kp, step, init)
  out_ref[...] = (acc / s[:, None]).astype(out_ref.dtype)


def check_partials(o, lse, request, rows: int | None):
  """(G, X, R, D, rows) of a merge's partials, checked as ``merge_pieces`` documents.

  Raises:
    ValueError: inconsistent shapes or dtypes.
  """
  if o.ndim != 4 or lse.ndim != 3:
    raise ValueError(f"o must be [G, X, R, D] and lse [G, X, RL]; got {o.shape}, {lse.shape}")
  g, x, r, d = o.shape
  rows = r if rows is None else int(rows)
  if lse.shape[:2] != (g, x) or request.shape != (g,):
    raise ValueError(f"o {o.shape}, lse {lse.shape} and request {request.shape} "
                     "disagree on the pieces or row groups")
  if not 0 < rows <= r:
    raise ValueError(f"rows must be in [1, {r}]; got {rows}")
  if not (jnp.issubdtype(o.dtype, jnp.floating) and lse.dtype == jnp.float32
          and jnp.issubdtype(request.dtype, jnp.integer)):
    raise ValueError(f"o must be floating, lse f32 and request integer; got "
                     f"{o.dtype}, {lse.dtype}, {request.dtype}")
  return g, x, r, d, rows


def count_row_blocks(bh: int, rows: int, r: int, rl: int) -> int:
  """Row blocks of bh covering the merged rows; the last may run past them, but
  not past the partials' R rows (o) or RL (lse).

  Raises:
    ValueError: the rounded-up rows do not fit.
  """
  blocks = -(-rows // bh)
  if blocks * bh > min(r, rl):
    raise ValueError(f"the rows rounded up to {bh} ({blocks * bh}) must fit o's {r} "
                     f"and lse's {rl} rows")
  return blocks


def merge_pieces(o, lse, request, batch: int, *, rows: int | None = None,
                 out_dtype=jnp.float32, ranges=None, interpret: bool = False) -> jax.Array:
  """Every request's output from its pieces' partials (``reference.combine_pieces``).

  Args:
    o: [G, X, R, D] per-piece outputs (bf16 or f32), each divided by its own
      softmax sum (0 for an empty piece); X row groups of R rows.
    lse: [G, X, RL] f32 per-piece log-sum-exps, RL >= the rows merged (a very
      negative finite number for an empty piece).
    request: [G] int32, the piece's request, ordered by request (as
      ``schedule.schedule_pieces`` writes it), -1 for an unused piece; every
      request 0..B-1 has at least one piece.
    batch: B.
    rows: the rows of each group to merge (the real heads), default R.
    out_dtype: the output's dtype.
    ranges: None, or the requests' first pieces and counts in the last two rows
      of an int32 [n >= 2, >= B] array (``request_ranges``).
    interpret: run in the Pallas interpreter.

  Returns:
    [B, X, rows, D] in out_dtype.

  Raises:
    ValueError: inconsistent shapes or dtypes, D not a multiple of 16, or ranges
      not int32 [n >= 2, >= B].
  """
  g, x, r, d, rows = check_partials(o, lse, request, rows)
  bh, bd, kp = tiles(batch, x, rows, d, g)
  row_blocks = count_row_blocks(bh, rows, r, lse.shape[2])
  ranges = request_ranges(request, batch, ranges)
  kernel = functools.partial(_merge_kernel, kp=kp)
  full = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
  out = pl.pallas_call(
      kernel,
      grid=(batch, x * row_blocks, d // bd),
      in_specs=[
          full(ranges),
          pl.BlockSpec((g, None, bh, bd),
                       lambda i, j, c: (0, j // row_blocks, j % row_blocks, c)),
          pl.BlockSpec((g, None, bh), lambda i, j, c: (0, j // row_blocks, j % row_blocks)),
      ],
      out_specs=pl.BlockSpec((None, None, bh, bd),
                             lambda i, j, c: (i, j // row_blocks, j % row_blocks, c)),
      out_shape=jax.ShapeDtypeStruct((batch, x, row_blocks * bh, d), out_dtype),
      compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
      interpret=interpret,
      name="merge_pieces",
  )(ranges, o, lse)
  return out if row_blocks * bh == rows else out[:, :, :rows]
