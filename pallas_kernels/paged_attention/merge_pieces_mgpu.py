"""Merges the Mosaic GPU decode kernels' pieces in one Mosaic GPU kernel that
overlaps the decode kernel's tail (programmatic dependent launch).

The decode kernels (mla_mgpu, mla_tokens_mgpu, gqa_mgpu) write one partial per
piece: its output, already divided by its own softmax sum, and its log-sum-exp;
a request's output is the lse-weighted mean of its pieces' partials
(``reference.combine_pieces``). ``merge_pieces.merge_pieces`` does that merge on
Pallas' Triton backend, as a separate launch that starts only once the decode
kernel has finished. This kernel does the same merge and is launched with
programmatic stream serialization:

- every decode kernel executes ``griddepcontrol.launch_dependents`` at its start,
  so once all its CTAs are running the GPU may launch this grid, and its CTAs
  take SMs as decode CTAs retire (or beside them, where registers and shared
  memory leave room), instead of after the decode kernel's last CTA, its
  memory flush and a launch;
- this kernel's first instruction is ``griddepcontrol.wait``, which returns once
  every prerequisite grid has completed and its writes are visible. Nothing is
  read before it, so the partials, and the per-request ranges (rows of the
  schedule XLA computes before the decode kernel), are complete whichever kernel
  precedes this one in the stream.

Mosaic GPU marks a kernel that waits this way (``mosaic_gpu.uses_pdl``) and its
runtime launches it with the attribute; a kernel launched without it, or one
whose predecessor never triggers, waits as an ordinary launch would.

The merge itself: one CTA (one warpgroup) per (request, row block, column
block) walks its request's pieces ``kp`` at a time (the pieces are ordered by
request, so they are a run from its first piece) with an online softmax merge
in f32 registers. Each of the CTA's ``bh`` rows is a [bd] vector (bd / 128
elements a thread, read straight from global memory: a merge reads every
partial once, so staging them in shared memory would buy nothing) with one
scalar weight per piece. Loads past the request's last piece re-read its first
piece and weigh zero. The output rows are written in their final dtype. The sum
runs in a fixed order: deterministic, with no atomics.

docs/paged_attention.md ("Merging the pieces") has the design and the readings.
"""

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import device
from pallas_kernels import mgpu_shim
from pallas_kernels.paged_attention import merge_pieces

# Columns per CTA, widest first: bd / 128 elements a thread (8-byte bf16 loads at
# 512). The widest column tile, then the most rows, that still gives every SM two
# CTAs is taken; a batch-1 merge needs narrow tiles to spread its pieces.
COL_TILES = (512, 256, 128)
ROW_TILES = (8, 4, 2, 1)
# Partial elements one step loads (kp x bh x bd): 64 f32 a thread, as the Triton
# merge's tile, so a step's loads are all in flight at once.
TILE_ELEMENTS = 8192
# Loads one step issues (kp x bh), each with its own scalar lse and weight: ptxas,
# sm_90a, one [128] row: 16 pieces a step take 79 registers, 32 take 127 and 64
# take 255 (scripts/merge_mgpu_tiles.py).
MAX_LOADS = 32
WARPGROUP = 128


def let_merge_launch(interpret) -> None:
  """Called first thing in a decode kernel whose partials this kernel merges:
  ``griddepcontrol.launch_dependents``, so the merge grid may launch once every
  decode CTA has started (module docstring). Never earlier than that, so a merge
  CTA never holds an SM that a decode CTA still waits for; where the next kernel
  is not a programmatic dependent it does nothing. The interpreter, which runs
  one kernel at a time, skips it (``mgpu_shim.launch_dependents``)."""
  mgpu_shim.launch_dependents(interpret)


def supports(d: int) -> bool:
  """Whether this kernel merges partials of D columns (a warpgroup's [bd] row
  holds at least one element a thread); ops merges others with merge_pieces."""
  return d % COL_TILES[-1] == 0


def tiles(batch: int, x: int, rows: int, d: int, pieces: int | None = None,
          kind: str | None = None, ctas: int | None = None) -> tuple[int, int, int]:
  """(row tile bh, column tile bd, pieces per step kp) of the merge for this shape.

  Args:
    batch: requests B.
    x: independent row groups (1 for MLA, the KV heads for GQA).
    rows: real rows per group (heads, or a KV head's query group).
    d: columns, a multiple of 128.
    pieces: the schedule's pieces G (None: no cap on kp): a step takes no more
      pieces than an average request has, rounded up to a power of two.
    kind: the device kind (None: the traced one), for its SM count.
    ctas: the CTAs to aim for (None: two per SM of ``kind``).

  Raises:
    ValueError: d is not a multiple of 128.
  """
  want = 2 * device.num_sms(kind) if ctas is None else ctas
  most_rows = min(ROW_TILES[0], merge_pieces.pow2_at_least(rows))
  cands = [(bh, bd) for bd in COL_TILES if d % bd == 0 for bh in ROW_TILES if bh <= most_rows]
  if not cands:
    raise ValueError(f"merge_pieces_mgpu needs columns divisible by {COL_TILES[-1]}; got {d}")
  bh, bd = next(((bh, bd) for bh, bd in cands
                 if batch * x * -(-rows // bh) * (d // bd) >= want), cands[-1])
  kp = max(1, min(TILE_ELEMENTS // (bh * bd), MAX_LOADS // bh))
  if pieces is not None:
    kp = min(kp, merge_pieces.pow2_at_least(-(-pieces // batch)))
  return bh, bd, kp


def merge_kernel(ranges_ref, o_ref, lse_ref, out_ref, *, bh, bd, kp, row_blocks, pdl,
                 interpret=False):
  """One (request, row block, column block).

  ranges_ref: [n, >= B] int32, its last two rows each request's first piece and
  piece count; o_ref: [G, X, R, D] partials; lse_ref: [G, X, RL] f32; out_ref:
  [B, X, row_blocks * bh, D]. All in global memory. pdl: launched as a
  programmatic dependent (compiled; the interpreter runs kernels in order).
  """
  if pdl:
    # Before any load: the partials and the ranges are complete past this point.
    mgpu_shim.wait_for_prerequisites(interpret)
  b, j, c = lax.axis_index("b"), lax.axis_index("j"), lax.axis_index("c")
  xg, r0 = j // row_blocks, (j % row_blocks) * bh
  n = ranges_ref.shape[0]
  first, count = ranges_ref[n - 2, b], ranges_ref[n - 1, b]
  cols = pl.ds(c * bd, bd)
  layout = plgpu.Layout.WG_STRIDED((bd,), vec_size=bd // WARPGROUP)

  def step(i, carry):
    accs, ms, ss = carry  # bh x ([bd] f32, f32, f32)
    ks = [first + i * kp + lane for lane in range(kp)]
    lives = [k < first + count for k in ks]
    ids = [jnp.where(live, k, first) for k, live in zip(ks, lives)]
    out = ([], [], [])
    for rr in range(bh):
      row = r0 + rr
      lses = [jnp.where(live, lse_ref[k, xg, row], -jnp.inf) for k, live in zip(ids, lives)]
      os = [plgpu.load(o_ref.at[k, xg, row, cols], layout=layout).astype(jnp.float32)
            for k in ids]
      # Finite: lane 0 of step 0 is live, and later steps keep the running max.
      m_new = functools.reduce(jnp.maximum, lses, ms[rr])
      alpha = jnp.exp(ms[rr] - m_new)
      ws = [jnp.exp(lse - m_new) for lse in lses]  # 0 on dead lanes
      acc = accs[rr] * alpha
      for w, o in zip(ws, os):
        acc = acc + o * w
      out[0].append(acc)
      out[1].append(m_new)
      out[2].append(functools.reduce(lambda a, w: a + w, ws, ss[rr] * alpha))
    return tuple(map(tuple, out))

  zeros = plgpu.layout_cast(jnp.zeros((bd,), jnp.float32), layout)
  init = ((zeros,) * bh, (jnp.float32(-jnp.inf),) * bh, (jnp.float32(0.0),) * bh)
  accs, _, ss = lax.fori_loop(0, (count + kp - 1) // kp, step, init)
  for rr in range(bh):
    out_ref.at[b, xg, r0 + rr, cols][...] = (accs[rr] / ss[rr]).astype(out_ref.dtype)


def merge_pieces_mgpu(o, lse, request, batch: int, *, rows: int | None = None,
                      out_dtype=jnp.float32, ranges=None, pdl: bool = True,
                      ctas: int | None = None, interpret=False) -> jax.Array:
  """Every request's output from its pieces' partials (``reference.combine_pieces``).

  Args:
    o, lse, request, batch, rows, out_dtype, ranges: as ``merge_pieces.merge_pieces``
      takes them, with D a multiple of 128. The ops pass as ``ranges``
      ``schedule.schedule_pieces``'s own array, which the decode kernel also
      reads, so nothing runs between it and this kernel.
    pdl: launch as a programmatic dependent of the preceding kernel (module
      docstring); False launches it as an ordinary kernel, for ablation.
    ctas: the CTAs the tiles aim for (``tiles``; None: two per SM). The ops
      pass 1 when interpreting (``mgpu_shim.ctas_to_fill``): the interpreter runs
      CTAs one after another, so the fewest, largest tiles run fastest there.
    interpret: False, or Mosaic GPU interpret parameters
      (``mgpu_shim.interpret_params()``); the interpreter runs one kernel at a
      time, so it ignores ``pdl``.

  Returns:
    [B, X, rows, D] in out_dtype.

  Raises:
    ValueError: inconsistent shapes or dtypes, D not a multiple of 128, or ranges
      not int32 [n >= 2, >= B].
  """
  g, x, r, d, rows = merge_pieces.check_partials(o, lse, request, rows)
  bh, bd, kp = tiles(batch, x, rows, d, g, ctas=ctas)
  row_blocks = merge_pieces.count_row_blocks(bh, rows, r, lse.shape[2])
  ranges = merge_pieces.request_ranges(request, batch, ranges)
  kernel = functools.partial(merge_kernel, bh=bh, bd=bd, kp=kp, row_blocks=row_blocks,
                             pdl=bool(pdl), interpret=interpret)
  out = mgpu_shim.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((batch, x, row_blocks * bh, d), out_dtype),
      grid=(batch, x * row_blocks, d // bd),
      grid_names=("b", "j", "c"),
      kernel_name="merge_pieces_mgpu",
      interpret=interpret,
  )(ranges, o, lse)
  return out if row_blocks * bh == rows else out[:, :, :rows]
