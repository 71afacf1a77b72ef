"""Paged MLA decode on Pallas Mosaic GPU (Hopper): TMA page gathers + wgmma.

One CTA per (64-head block, piece) with two compute warpgroups and, by default
(BlockSizes.loads), a third, memory warpgroup that only issues the gathers. A piece is a
run of one request's pages from a balanced schedule (``schedule.schedule_pieces``,
computed on the device from the lengths): every request's pages are cut into
pieces of the same size, sized so that all of them fit one grid of about the
SMs, so a single long request fills the machine and a ragged batch spreads
its work evenly instead of by a static per-request split.

Each warpgroup computes the logits of half the page's tokens
([64, page/2], QK over the full 576-wide key), so no MMA work is duplicated,
and runs the online softmax on its half only: the two warpgroups swap their
row maxima (and for fp8 the page's largest scale) through a few hundred bytes
of shared memory, so both keep the same running max, then each stores its
half of P ([64, page/2], one whole swizzled tile each) and loads both halves
back as the [64, page] A operand of PV. Each owns half of the 512 output
columns for PV: a [64, 512] f32 accumulator would need 256 registers per
thread in one warpgroup, above Hopper's 255. The softmax sums stay per
warpgroup (its tokens) and are added once at the end. The schedule and the
register budget are described in docs/paged_attention.md.

Page gather: one warpgroup reads each page id with a scalar GMEM load from
the block table and issues one TMA per tensor (latent, rope, and per-token
scales for fp8), so the gather costs no extra pass over memory. With a
producer (producer=True) that is warpgroup 2, which does nothing else: it
issues each page as soon as the barrier of its slot says the compute
warpgroups let go of it, and setmaxnreg hands its registers to them
(COMPUTE_REGS each, PRODUCER_REGS for it). Otherwise compute warpgroup 0
issues them between its MMAs, waiting on the same barriers. bf16 pages
are read in place, so their latent has two slots used in turn: page i+1's
latent is issued at the top of step i, into the slot that step i-1's PV (in
both warpgroups) has finished reading, and lands during step i's compute;
the rope, read by QK only, has one buffer, refilled as soon as both
warpgroups' QK has read it. fp8 pages have two staging slots with an fp8
QK, or land in one staging buffer that the conversion frees early with an
f16 QK (below).

fp8 pages, QK in fp8 (an e4m3 query from ``ops.fp8_query``; the default,
BlockSizes.mla_qk): at 64 heads per CTA the bf16-rate MMAs take longer than
the page's bytes take to arrive, so QK runs as fp8 wgmmas (twice the rate)
straight on the staged fp8 page: both operands K-major, as fp8 wgmma needs
(PV's V is N-major, so PV stays f16). While they run, each warpgroup converts
its half of the latent's columns to the f16 V of PV, so the conversion
overlaps the MMA. Whole pages (latent, rope, scales) have two staging slots:
page i+2 is issued as soon as both warpgroups' QK and conversion have read
page i's slot, so two pages are in flight while one is computed. The f16
query of the other mode would not leave room for the second slot; the e4m3
one (32 KiB + 4 KiB) and the dropped f16 rope copy do.

fp8 pages, QK in f16 (an f16 query): pages are converted to f16 pages in
shared memory (wgmma reads its B operand only from SMEM) with one instruction
per pair of values (cvt.rn.f16x2.e4m3x2, exact), and nothing else: the
per-token scales stay out of the conversion, which is the kernel's ALU
bottleneck (docs/paged_attention.md).
Either way the scales are folded in where they cost a [64, page] tile instead
of a [page, 576] one:
  * QK runs two wgmmas into two f32 tiles, latent and rope, and the
    logits are s_lat[:, t] * latent_scale[t] + s_rope[:, t] * k_rope_scale[t];
  * PV multiplies P by latent_scale[t] / g before its f16 cast, g being the
    page's largest scale over its valid tokens (so P stays in [0, 1], where
    f16 is precise), and folds g into the accumulator's rescale: the loop
    keeps acc / g of the latest page, and the output multiplies it back.
The query enters as e4m3 divided by its row's largest |value| / 448, or as
f16 divided by a per-row power of two (the wrapper picks it so the row's
largest value is below 2^14: no f16 overflow, full precision); the kernel
multiplies the factor back into the logits (q_scale).
Slots past a request's length are zeroed in the same pass (on a bf16 cache,
in place on the partial last page only), and their probabilities and scales
are selected to 0, so garbage (even NaN) never leaks into the output.

Registers: the [64, 256] f32 PV accumulator takes 128 of a thread's 255 (of its
240 beside a producer warpgroup, which keeps 24: setmaxnreg moves registers
within the CTA's launch allocation, 3 x 168 per lane).
Every wgmma takes a 64-bit shared-memory descriptor (36 for QK alone), and
LLVM hoists loop-invariant descriptors out of the loop, where they would
stay live beside the accumulator and spill. The loop body therefore
addresses every buffer through an index that is 0 but opaque to LLVM (an
optimization barrier), so descriptors are computed next to their wgmma.

Outputs per piece: o [G, H8, C] bf16 (PARTIAL_DTYPE) already divided by the
piece's softmax sum, only the rows of the H real heads rounded up to 8 (the
padding rows would be most of the partials' HBM traffic at 8 heads per
device), and lse [G, Hp] f32 (a very negative number for an empty piece);
merge_pieces.py merges each request's pieces.
"""

import math

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.paged_attention import merge_pieces_mgpu
from pallas_kernels.paged_attention import producer as producer_loop

FP8 = jnp.float8_e4m3fn
BLOCK_H = 64  # wgmma M per warpgroup
NEG = -1e30  # finite "minus infinity" for empty splits and masked logits
LOG2E = math.log2(math.e)
# The pieces' partial outputs are bf16, the attention output's dtype: a
# request merged from several pieces takes at most one more bf16 rounding of
# their normalised outputs (one piece: none), and the partials' HBM traffic,
# written here and read back by the merge, halves.
PARTIAL_DTYPE = jnp.bfloat16
_STAGE_CHUNK = 64  # columns per register pass when masking/dequantising a page
MIN_SCALE = 1e-30  # floor of a page's largest scale (an all-zero page has 0)
# Registers per thread after setmaxnreg when a producer warpgroup issues the
# page gathers (producer=True). setmaxnreg only moves registers within the
# CTA's pool, which holds what the CTA was launched with: 384 threads at
# 65,536 / 384 rounded down to 8, 168 each, so 3 x 168 = 504 per lane of a
# warpgroup. A setmaxnreg.inc that the pool cannot cover waits forever, so
# 2 x COMPUTE_REGS + PRODUCER_REGS must not exceed 504 (check_register_split);
# the compute warpgroups take 240 and the producer the smallest allowed, 24.
LAUNCH_REGS = 65536 // (3 * 128) // 8 * 8
COMPUTE_REGS = 240
PRODUCER_REGS = 24


def check_register_split(compute: int, producer: int) -> None:
  """Raises unless setmaxnreg can give two compute warpgroups ``compute`` registers
  and the producer ``producer`` out of the CTA's pool (3 x LAUNCH_REGS per lane).

  Raises:
    ValueError: a count not a multiple of 8 in [24, 256], or more than the pool.
  """
  for name, n in (("compute", compute), ("producer", producer)):
    if n % 8 or not 24 <= n <= 256:
      raise ValueError(f"{name} registers {n}: setmaxnreg takes a multiple of 8 in [24, 256]")
  if 2 * compute + producer > 3 * LAUNCH_REGS:
    raise ValueError(
        f"2 x {compute} compute + {producer} producer registers exceed the CTA's pool of "
        f"3 x {LAUNCH_REGS} per lane: the second compute warpgroup's setmaxnreg.inc would "
        f"wait forever on a GPU")


def transforms(cols, dtype):
  """Tiling and swizzle of a [rows, cols] shared-memory tile that wgmma and TMA read."""
  bits = jnp.dtype(dtype).itemsize * 8
  swizzle = plgpu.find_swizzle(cols * bits, "rhs")
  return (plgpu.TilingTransform((8, swizzle * 8 // bits)),
          plgpu.SwizzleTransform(swizzle))


def _smem(shape, dtype):
  """One SMEM buffer with a leading dim of 1, indexed in the loop by the opaque 0."""
  return plgpu.SMEM((1, *shape), dtype, transforms=transforms(shape[-1], dtype))


def stage_rows(src, dst, valid_tokens):
  """dst = src (as dst's dtype) with rows >= valid_tokens zeroed; [ps, w] refs.

  In column chunks, so only [ps, 64] values are in registers at a time
  beside the accumulator; src is read a whole swizzle tile at a time.
  """
  w = src.shape[1]
  load_w = math.gcd(w, 128 // jnp.dtype(src.dtype).itemsize)
  for j in range(w // load_w):
    xs = src[:, pl.ds(j * load_w, load_w)]
    for h in range(load_w // _STAGE_CHUNK):
      x = xs[:, h * _STAGE_CHUNK:(h + 1) * _STAGE_CHUNK]
      rows = plgpu.broadcasted_iota(jnp.int32, x.shape, 0, layout=plgpu.Layout.WGMMA)
      # e4m3 -> f16 is one exact cvt per pair (8-bit registers allow no
      # arithmetic, so the select comes after it).
      x = x.astype(dst.dtype)
      # A select, not a multiply: unused slots may be NaN.
      x = jnp.where(rows < valid_tokens, x, jnp.zeros_like(x))
      dst[:, pl.ds(j * load_w + h * _STAGE_CHUNK, _STAGE_CHUNK)] = x.astype(dst.dtype)


def partial_rows(heads: int) -> int:
  """Rows of the partial outputs for ``heads`` real heads: rounded up to 8, since
  the bf16 staging tile is in 8-row tiles and a partial head block writes whole ones."""
  return -(-heads // 8) * 8


def mla_decode_mgpu(q_latent, q_rope, q_scale, latent, k_rope, latent_scale,
                    k_rope_scale, block_tables, lengths, pieces, *, scale,
                    heads=None, producer=False, interpret=False):
  """Paged MLA decode partials over a balanced schedule of pieces, on Mosaic GPU.

  Args:
    q_latent: [B, Hp, C] query: for an fp8 cache float8_e4m3fn (QK in fp8) or
      f16 (QK in f16), divided by q_scale; else the cache dtype. Hp a
      multiple of 64.
    q_rope: [B, Hp, R] same dtype and row scale.
    q_scale: [B, Hp] f32 per-row factors of an fp8 cache's query (see
      ``ops.fp8_query``, ``ops.f16_query``), or None for a bf16/f16 cache.
    latent, k_rope: [N, ps, C], [N, ps, R] pages (bf16/f16 or fp8 e4m3).
    latent_scale, k_rope_scale: [N, ps] f32 or None.
    block_tables: [B, P] int32.
    lengths: [B] int32.
    pieces: [5, G] int32 from ``schedule.schedule_pieces`` (rows 0-2 read; G CTAs
      per head block).
    scale: softmax scale.
    heads: H, the real heads (rows of q past them are padding); None: Hp.
    producer: issue the query and page gathers from a third, memory
      warpgroup (setmaxnreg: COMPUTE_REGS for the two compute warpgroups,
      PRODUCER_REGS for it) instead of from compute warpgroup 0 between its
      MMAs. The slots and what frees them are the same either way.
    interpret: False, or a plgpu.InterpretGPUParams.

  Returns:
    (o [G, H8, C] bf16 normalised per piece, H8 = H rounded up to 8 (rows
    past H are padding), lse [G, Hp] f32).

  Raises:
    ValueError: on an unsupported shape or dtype combination.
  """
  b, hp, c = q_latent.shape
  n, ps, r = k_rope.shape
  num_g = pieces.shape[1]
  fp8 = latent.dtype == FP8
  qdt = q_latent.dtype
  # An fp8 query runs QK as fp8 wgmmas straight on the staged fp8 page.
  qk8 = qdt == FP8
  # P and PV's V: f16 for an fp8 cache (its pages converted), else the cache's.
  cdt = jnp.float16 if fp8 else latent.dtype
  half = c // 2
  heads = hp if heads is None else heads
  if not 0 < heads <= hp or hp - heads >= BLOCK_H:
    raise ValueError(f"heads {heads} must be in ({hp - BLOCK_H}, {hp}] for {hp} query rows")
  full_blocks = heads // BLOCK_H
  out_rows = partial_rows(heads)
  tail_rows = out_rows - full_blocks * BLOCK_H
  if hp % BLOCK_H or c % 128 or ps != 64 or r % 64:
    raise ValueError(f"unsupported shape: heads {hp} (x64), C {c} (x128), "
                     f"page {ps} (64), R {r} (x64)")
  if fp8 and c % 256:
    raise ValueError(f"an fp8 cache needs C % 256 == 0 (whole 128-column fp8 tiles "
                     f"per warpgroup), got C {c}")
  if q_rope.dtype != qdt:
    raise ValueError(f"q_latent {qdt} and q_rope {q_rope.dtype} dtypes differ")
  if fp8 and (qdt not in (jnp.float16, FP8) or q_scale is None
              or q_scale.shape != (b, hp)):
    raise ValueError(f"an fp8 cache needs an f16 or fp8 e4m3 query and its [B, Hp] "
                     f"q_scale (ops.f16_query / ops.fp8_query), got {qdt} and "
                     f"{None if q_scale is None else q_scale.shape}")
  if not fp8 and qdt != latent.dtype:
    raise ValueError(f"query {qdt} and cache {latent.dtype} dtypes differ")
  if producer:
    check_register_split(COMPUTE_REGS, PRODUCER_REGS)
  # Register operands for P are fine on hardware; the interpreter needs SMEM.
  p_in_smem = bool(interpret)
  half_ps = ps // 2  # tokens per warpgroup in QK
  # bf16 pages are read in place, so their latent gets two slots used in turn
  # (the next page's gather overlaps this page's compute); fp8 pages with an
  # f16 query land in one staging buffer that the conversion frees early; with
  # an fp8 query, whole pages (latent and rope) in two slots, so two pages are
  # in flight while one is computed (module docstring).
  slots = 1 if fp8 and not qk8 else 2
  # fp8 per-token scale rows are read until PV, after the next TMA (two
  # slots) or the one after it (fp8 query: three).
  scale_slots = 3 if qk8 else 2

  def kernel(ql_ref, qr_ref, qs_ref, lat_ref, rope_ref, ls_ref, rs_ref, bt_ref,
             len_ref, pc_ref, o_ref, lse_ref, scratch):
    (ql_smem, qr_smem, qs_smem, lat_st, rope_st, ls_st, rs_st, lat16, rope16,
     p_smem, px_smem, o_st, x_smem, lse_smem, q_bar, tma_bar, rope_bar, conv_bar,
     free_bar, x_bar, p_bar, rope_free) = scratch
    merge_pieces_mgpu.let_merge_launch(interpret)
    hb = lax.axis_index("h")
    piece = lax.axis_index("s")
    wg = lax.axis_index("wg")
    # An unused piece (request -1) runs no step and writes an empty partial.
    bi = jnp.maximum(pc_ref[0, piece], 0)
    start = pc_ref[1, piece]
    steps = pc_ref[2, piece]
    length = len_ref[bi]
    rows_h = pl.ds(hb * BLOCK_H, BLOCK_H)
    cols = pl.ds(wg * half, half)
    tok = pl.ds(pl.multiple_of(wg * half_ps, half_ps), half_ps)

    def page_id(step):
      # Only used pages are read (steps stops at them); clamp so a corrupt
      # id never sends the TMA out of bounds.
      return jnp.clip(bt_ref[bi, start + step], 0, n - 1)

    def issue_latent(step):
      """bf16: the page's latent, into slot step % 2."""
      slot = lax.rem(step, 2)
      plgpu.copy_gmem_to_smem(lat_ref.at[page_id(step)], lat_st.at[slot], tma_bar.at[slot])

    def issue_rope(step):
      """bf16: the page's rope, into its one buffer (read by QK only)."""
      plgpu.copy_gmem_to_smem(rope_ref.at[page_id(step)], rope_st.at[0], rope_bar)

    def issue_fp8(step):
      """fp8: the page (latent, rope, scales) into staging slot step % slots."""
      page = page_id(step)
      slot = lax.rem(step, slots)
      bar = tma_bar.at[slot]
      plgpu.copy_gmem_to_smem(lat_ref.at[page], lat_st.at[slot], bar)
      plgpu.copy_gmem_to_smem(rope_ref.at[page], rope_st.at[slot], bar)
      sc = lax.rem(step, scale_slots)
      plgpu.copy_gmem_to_smem(ls_ref.at[page], ls_st.at[sc], bar)
      plgpu.copy_gmem_to_smem(rs_ref.at[page], rs_st.at[sc], bar)

    def load_query():
      plgpu.copy_gmem_to_smem(ql_ref.at[bi, rows_h], ql_smem.at[0], q_bar)
      plgpu.copy_gmem_to_smem(qr_ref.at[bi, rows_h], qr_smem.at[0], q_bar)
      if fp8:
        plgpu.copy_gmem_to_smem(qs_ref.at[bi, rows_h], qs_smem, q_bar)

    def freed(step):
      """The barrier the compute warpgroups arrive on once step's slot is read.

      With a producer, one per slot: the compute warpgroups can finish two
      steps before the producer waits for the first of them (it issues page i
      once step i-2 let go of the slot, and pages i-2 and i-1 were issued
      before), and a barrier that completes two phases before its waiter
      looks is never seen to complete (mbarrier waits test the phase's
      parity)."""
      return free_bar.at[lax.rem(step, 2)] if producer else free_bar

    def produce():
      """The memory warpgroup: the query, then every page of the piece in
      order, each as soon as what last read its slot has let go of it (the
      barriers the compute warpgroups arrive on). It then waits out the phases
      nobody else waits on, so every barrier ends the kernel consumed."""
      plgpu.set_max_registers(PRODUCER_REGS, action="decrease")
      load_query()
      if fp8 and qk8:
        # Page i goes to slot i % 2, read by step i-2's QK and conversion
        # (and its scale rows, slot i % 3, by step i-3's PV: done before).
        producer_loop.issue_ring(steps, 2, free_bar, issue_fp8)
      elif fp8:
        # One staging buffer, free once both warpgroups converted step i-1.
        @pl.loop(0, steps)
        def _(i):
          pl.when(i >= 1)(lambda: plgpu.barrier_wait(conv_bar))
          issue_fp8(i)
        pl.when(steps > 0)(lambda: plgpu.barrier_wait(conv_bar))
      else:
        # Latent slot i % 2 was read by step i-2's PV (the ring waits for
        # that); the one rope buffer by step i-1's QK.
        def issue_page(i):
          issue_latent(i)
          pl.when(i >= 1)(lambda: plgpu.barrier_wait(rope_free))
          issue_rope(i)
        producer_loop.issue_ring(steps, 2, free_bar, issue_page)
        pl.when(steps > 0)(lambda: plgpu.barrier_wait(rope_free))

    if producer:
      pl.when(wg == 2)(produce)
    else:
      @pl.when(wg == 0)
      def _():
        load_query()
        @pl.when(steps > 0)
        def _():
          if fp8:
            issue_fp8(0)
            if qk8:
              @pl.when(steps > 1)
              def _():
                issue_fp8(1)  # the second slot is free from the start
          else:
            issue_latent(0)
            issue_rope(0)
            @pl.when(steps > 1)
            def _():
              issue_latent(1)  # the second slot is free from the start

    def compute():
      """The two compute warpgroups (wg 0 and 1)."""
      if producer:
        plgpu.set_max_registers(COMPUTE_REGS, action="increase")
      plgpu.barrier_wait(q_bar)
      row = plgpu.Layout.WGMMA.reduce(1)  # a [64] vector over the heads (rows)
      col = plgpu.Layout.WGMMA.reduce(0)  # a vector over the tokens (columns)
      # The softmax scale, times the f16 query's row factors for an fp8 cache.
      row_scale = (plgpu.load(qs_smem, layout=row) * scale if fp8
                   else plgpu.layout_cast(jnp.full((BLOCK_H,), scale, jnp.float32), row))
      other = 1 - wg

      def exchange(vals):
        """Swaps [64] row vectors with the other warpgroup (one rendezvous)."""
        for j, v in enumerate(vals):
          x_smem.at[wg, j][...] = v
        plgpu.commit_smem()
        plgpu.barrier_arrive(x_bar)
        plgpu.barrier_wait(x_bar)
        return [plgpu.load(x_smem.at[other, j], layout=row) for j in range(len(vals))]

      def body(i, carry):
        acc, m_i, l_i, g_i = carry
        # 0, but LLVM cannot prove it: buffers indexed by it have loop-variant
        # addresses, so their wgmma descriptors are not hoisted (module doc).
        z = lax.optimization_barrier(jnp.int32(0))
        q_lat, q_rp = ql_smem.at[z], qr_smem.at[z]
        slot = z if slots == 1 else lax.rem(i, 2) + z
        lat_in, rope_in = lat_st.at[slot], rope_st.at[slot if qk8 else z]
        pos0 = (start + i) * ps
        valid_tokens = length - pos0
        if qk8:
          plgpu.barrier_wait(tma_bar.at[lax.rem(i, 2)])
          # lat16 is read by PV only, each warpgroup its own columns.
          k_lat = lat16.at[z]
        elif fp8:
          plgpu.barrier_wait(tma_bar.at[0])
          k_lat, k_rope = lat16.at[z], rope16.at[z]
          # lat16 / rope16 were last read by step i-1's QK (both warpgroups
          # passed its exchange since) and by this warpgroup's own PV (retired).
          stage_rows(lat_in.at[:, cols], k_lat.at[:, cols], valid_tokens)
          @pl.when(wg == 0)
          def _():
            stage_rows(rope_in, k_rope, valid_tokens)
          plgpu.commit_smem()
          plgpu.barrier_arrive(conv_bar)
          plgpu.barrier_wait(conv_bar)
          # Both warpgroups converted the staging buffer: prefetch the next
          # page during this one's compute (the producer waits on conv_bar).
          if not producer:
            @pl.when((wg == 0) & (i + 1 < steps))
            def _():
              issue_fp8(i + 1)
        else:
          # The other slot was last read by step i-1's PV in both warpgroups
          # (each arrives on free_bar once its PV has retired): refill it with
          # page i+1, so the gather overlaps this whole step (the producer
          # waits on free_bar).
          if not producer:
            @pl.when((wg == 0) & (i > 0))
            def _():
              plgpu.barrier_wait(free_bar)
              @pl.when(i + 1 < steps)
              def _():
                issue_latent(i + 1)
          plgpu.barrier_wait(tma_bar.at[lax.rem(i, 2)])
          plgpu.barrier_wait(rope_bar)
          k_lat, k_rope = lat_in, rope_in
          # No conversion pass on a bf16 cache, but the tail of a request's
          # last page may hold garbage (NaN included) and p == 0 does not
          # cancel NaN in PV: zero those rows, only on that partial page.
          @pl.when(valid_tokens < ps)
          def _():
            stage_rows(lat_in.at[:, cols], lat_in.at[:, cols], valid_tokens)
            plgpu.commit_smem()
            plgpu.barrier_arrive(conv_bar)
            plgpu.barrier_wait(conv_bar)

        # QK for this warpgroup's half of the page's tokens only, so no MMA
        # work is duplicated.
        half_acc = plgpu.ACC((BLOCK_H, half_ps), jnp.float32)
        if fp8:
          # Latent and rope have their own per-token scales: one tile each,
          # scaled per column (token) here rather than per element in stage_rows().
          def qk(lat_acc, rope_acc):
            if qk8:
              # fp8 x fp8 straight from the staged page (both operands K-major,
              # as fp8 wgmma needs); the tail's garbage only reaches its own
              # logits' columns, which are masked below.
              plgpu.wgmma(lat_acc, q_lat, lat_in.at[tok].transpose((1, 0)))
              plgpu.wgmma(rope_acc, q_rp, rope_in.at[tok].transpose((1, 0)))
              # While they run: this warpgroup's half of the latent's columns
              # to f16, PV's V (the tail's rows zeroed: p = 0 does not cancel
              # NaN).
              stage_rows(lat_in.at[:, cols], k_lat.at[:, cols], valid_tokens)
              plgpu.commit_smem()
            else:
              plgpu.wgmma(lat_acc, q_lat, k_lat.at[tok].transpose((1, 0)))
              plgpu.wgmma(rope_acc, q_rp, k_rope.at[tok].transpose((1, 0)))
            return lat_acc[...], rope_acc[...]
          s_lat, s_rope = pl.run_scoped(qk, half_acc, half_acc)
          if qk8:
            # Both warpgroups' QK and conversion have read the slot: refill it
            # with page i+2 (page i+1 is landing in the other one).
            plgpu.barrier_arrive(freed(i))
            if not producer:
              @pl.when(wg == 0)
              def _():
                plgpu.barrier_wait(free_bar)
                @pl.when(i + 2 < steps)
                def _():
                  issue_fp8(i + 2)
          sc = lax.rem(i, scale_slots)
          ls_half = plgpu.load(ls_st.at[sc, tok], layout=col)
          rs_half = plgpu.load(rs_st.at[sc, tok], layout=col)
          logits = (s_lat * lax.broadcast_in_dim(ls_half, s_lat.shape, [1])
                    + s_rope * lax.broadcast_in_dim(rs_half, s_rope.shape, [1]))
        else:
          def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_lat, k_lat.at[tok].transpose((1, 0)))
            plgpu.wgmma(acc_ref, q_rp, k_rope.at[tok].transpose((1, 0)))
            return acc_ref[...]
          logits = pl.run_scoped(qk, half_acc)
          if producer:
            # This warpgroup's QK has read the rope buffer (its wgmmas retired).
            plgpu.barrier_arrive(rope_free)
        # The online softmax over this half: the row maxima (and for fp8 the
        # page's largest scale) are swapped with the other warpgroup, so both
        # keep the same running max; each exponentiates only its own tokens.
        logits = logits * lax.broadcast_in_dim(row_scale, logits.shape, [0])
        kpos = wg * half_ps + plgpu.broadcasted_iota(
            jnp.int32, (BLOCK_H, half_ps), 1, layout=plgpu.Layout.WGMMA)
        valid = kpos < valid_tokens
        logits = jnp.where(valid, logits, NEG)
        mine = [logits.max(axis=1)]
        if fp8:
          # V = latent_scale[t] * f16 page: P takes the scale, divided by the
          # page's largest (g) so it stays in [0, 1]; acc holds acc / g.
          ls_tile = lax.broadcast_in_dim(ls_half, logits.shape, [1])
          ls_tile = jnp.where(valid, ls_tile, 0.0)  # unused slots' scales may be NaN
          mine.append(ls_tile.max(axis=1))
        theirs = exchange(mine)
        if not fp8 and not producer:
          # Both warpgroups' QK has read the rope buffer: refill it.
          @pl.when((wg == 0) & (i + 1 < steps))
          def _():
            issue_rope(i + 1)
        m_new = jnp.maximum(m_i, jnp.maximum(mine[0], theirs[0]))
        alpha = jnp.exp2((m_i - m_new) * LOG2E)
        p = jnp.exp2((logits - lax.broadcast_in_dim(m_new, logits.shape, [0])) * LOG2E)
        l_new = l_i * alpha + p.sum(axis=1)  # this warpgroup's tokens only
        g_new = g_i
        if fp8:
          g_new = jnp.maximum(jnp.maximum(mine[1], theirs[1]), MIN_SCALE)
          inv_g = 1.0 / g_new
          p = p * ls_tile * lax.broadcast_in_dim(inv_g, p.shape, [0])
          alpha = alpha * g_i * inv_g
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        # P's halves meet in shared memory: each warpgroup stores its own and
        # loads the other's, and PV runs over the whole page.
        p_half = p.astype(cdt)
        px_smem.at[wg][...] = p_half
        plgpu.commit_smem()
        plgpu.barrier_arrive(p_bar)
        plgpu.barrier_wait(p_bar)
        # Both halves are loaded (the own one too), so their order is static.
        p16 = jnp.concatenate([px_smem.at[0][...], px_smem.at[1][...]], axis=1)
        if p_in_smem:
          p_smem.at[wg][...] = p16
          plgpu.commit_smem()
          p_op = p_smem.at[wg]
        else:
          p_op = p16

        if interpret:
          # The GPU interpreter supports neither run_state over an
          # accumulator ("Cannot lower jaxpr with effects: _WGMMAPipelineEffect")
          # nor storing into one; accumulate a fresh product instead (same
          # math, but two live accumulators: hardware uses run_state below).
          def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_op, k_lat.at[:, cols])
            return acc_ref[...]
          acc = acc + pl.run_scoped(pv, plgpu.ACC((BLOCK_H, half), jnp.float32))
        else:
          def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_op, k_lat.at[:, cols])
          acc = pl.run_state(pv)(plgpu.ACC.init(acc))  # waits for the wgmma
        if not fp8:
          plgpu.barrier_arrive(freed(i))  # this warpgroup's PV has read the slot
        return acc, m_new, l_new, g_new

      acc0 = plgpu.layout_cast(jnp.zeros((BLOCK_H, half), jnp.float32), plgpu.Layout.WGMMA)
      m0 = plgpu.layout_cast(jnp.full((BLOCK_H,), NEG, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
      l0 = plgpu.layout_cast(jnp.zeros((BLOCK_H,), jnp.float32), row)
      g0 = plgpu.layout_cast(jnp.ones((BLOCK_H,), jnp.float32), row)
      acc, m_i, l_i, g_i = lax.fori_loop(0, steps, body, (acc0, m0, l0, g0))
      if not fp8 and not producer:
        # Consume the last step's phase (its waiter waits on every phase).
        @pl.when((wg == 0) & (steps > 0))
        def _():
          plgpu.barrier_wait(free_bar)
      # The softmax sums of the two halves of the tokens.
      l_i = l_i + exchange([l_i])[0]
      nonempty = l_i > 0
      inv = g_i / jnp.where(nonempty, l_i, 1.0)  # g_i: acc / g (fp8), else 1
      acc = acc * lax.broadcast_in_dim(inv, acc.shape, [0])

      def write_out(rows):
        """This warpgroup's columns of the block's first `rows` rows (a static count).

        Staged through this warpgroup's P tile when P has the partials' dtype
        (bf16 cache; it is free after the last step), else through its own tile."""
        o_smem = (o_st if o_st is not None else px_smem).at[wg]
        for j in range(half // half_ps):
          o_smem[...] = acc[:, j * half_ps:(j + 1) * half_ps].astype(PARTIAL_DTYPE)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(
              o_smem.at[pl.ds(0, rows)],
              o_ref.at[piece, pl.ds(hb * BLOCK_H, rows),
                       pl.ds(wg * half + j * half_ps, half_ps)])
          plgpu.wait_smem_to_gmem(0)
      if full_blocks:
        pl.when(hb < full_blocks)(lambda: write_out(BLOCK_H))
      if tail_rows:
        pl.when(hb == full_blocks)(lambda: write_out(tail_rows))
      @pl.when(wg == 0)
      def _():
        lse_smem[...] = jnp.where(nonempty, m_i + jnp.log(jnp.where(nonempty, l_i, 1.0)), NEG)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[piece, rows_h])
        plgpu.wait_smem_to_gmem(0)

    if producer:
      pl.when(wg < 2)(compute)
    else:
      compute()

  def entry(*refs):
    st_dtype = latent.dtype
    scratch = [
        _smem((BLOCK_H, c), qdt),
        _smem((BLOCK_H, r), qdt),
        plgpu.SMEM((BLOCK_H,), jnp.float32) if fp8 else None,
        plgpu.SMEM((slots, ps, c), st_dtype, transforms=transforms(c, st_dtype)),
        (plgpu.SMEM((slots, ps, r), st_dtype, transforms=transforms(r, st_dtype))
         if qk8 else _smem((ps, r), st_dtype)),
        plgpu.SMEM((scale_slots, ps), jnp.float32) if fp8 else None,
        plgpu.SMEM((scale_slots, ps), jnp.float32) if fp8 else None,
        _smem((ps, c), cdt) if fp8 else None,
        _smem((ps, r), cdt) if fp8 and not qk8 else None,
        (plgpu.SMEM((2, BLOCK_H, ps), cdt, transforms=transforms(ps, cdt))
         if p_in_smem else None),
        # Each warpgroup's half of P, then its output staging: [64, 32] tiles.
        plgpu.SMEM((2, BLOCK_H, half_ps), cdt, transforms=transforms(half_ps, cdt)),
        (None if cdt == PARTIAL_DTYPE else
         plgpu.SMEM((2, BLOCK_H, half_ps), PARTIAL_DTYPE,
                    transforms=transforms(half_ps, PARTIAL_DTYPE))),
        plgpu.SMEM((2, 2, BLOCK_H), jnp.float32),  # row vectors swapped by exchange()
        plgpu.SMEM((BLOCK_H,), jnp.float32),
    ]
    barriers = [
        # Every TMA issued with a barrier is one arrival on it.
        plgpu.Barrier(num_arrivals=3 if fp8 else 2),  # q_latent, q_rope (, q_scale) loaded
        # A page's copies landed, per slot: fp8 latent, rope and two scale
        # rows; bf16 the latent.
        plgpu.Barrier(num_arrivals=4 if fp8 else 1, num_barriers=slots),
        None if fp8 else plgpu.Barrier(num_arrivals=1),  # bf16: the rope landed
        None if qk8 else plgpu.Barrier(num_arrivals=2),  # page converted/masked by both WGs
        # The slot is free: bf16 both WGs' PV retired; fp8 query both WGs'
        # QK and conversion done.
        (None if fp8 and not qk8 else
         plgpu.Barrier(num_arrivals=2, num_barriers=2 if producer else 1)),
        plgpu.Barrier(num_arrivals=2),  # row vectors swapped
        plgpu.Barrier(num_arrivals=2),  # both halves of P written
        # bf16 with a producer: both WGs' QK has read the rope buffer.
        plgpu.Barrier(num_arrivals=2) if producer and not fp8 else None,
    ]
    pl.run_scoped(lambda *s: kernel(*refs, s), *scratch, *barriers,
                  collective_axes="wg")

  out_type = (jax.ShapeDtypeStruct((num_g, out_rows, c), PARTIAL_DTYPE),
              jax.ShapeDtypeStruct((num_g, hp), jnp.float32))
  kwargs = dict(interpret=interpret) if interpret else {}
  return plgpu.kernel(
      entry,
      out_type=out_type,
      grid=(hp // BLOCK_H, num_g),
      grid_names=("h", "s"),
      num_threads=3 if producer else 2,
      thread_name="wg",
      kernel_name="paged_mla_decode_mgpu",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      **kwargs,
  )(q_latent, q_rope, q_scale, latent, k_rope, latent_scale, k_rope_scale,
    block_tables, lengths, pieces)
