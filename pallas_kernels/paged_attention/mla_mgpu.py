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

Code layout. The three variants (bf16 cache; fp8 cache with f16 QK; fp8 cache
with fp8 QK) stage, issue and read their pages differently, and each has two
ways of issuing them (a producer warpgroup or compute warpgroup 0), so the
kernel is one class per variant over a base, ``_Cta``, that holds what they
share: the per-CTA scalars, the query load, the loop and its carry, the
row-vector swap, the online softmax, PV over the swapped halves of P and the
partial outputs. A variant's ``step`` is its whole loop body, read top to
bottom in the order the kernel runs it; ``first_pages`` / ``produce_pages`` are
its two ways of issuing pages (the producer's ring is ``producer.issue_ring``).
What interpret mode needs that the hardware does not (P in shared memory for
PV, PV into a fresh accumulator, setmaxnreg, the merge's early launch) goes
through ``pallas_kernels.mgpu_shim``. The traced program is the same as the
single function's it replaced (jaxprs and lowered Mosaic GPU modules compared
for every variant), so are the H200 readings.
"""

import dataclasses
import math
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mgpu_shim
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

  Only a request's last, partial page has rows to zero, so a full page
  (valid_tokens >= ps) takes a branch without the select. On an fp8 cache the
  select was most of the conversion pass: Mosaic GPU lowers it per 16-bit
  element (unpack, select, repack), 658 of the 1,125 instructions the pass
  adds per warp per page in the compiled H200 kernel, and the pass is what made
  the fp8 kernel slower than the bf16 one (docs/paged_attention.md).
  """
  ps = src.shape[0]

  @pl.when(valid_tokens >= ps)
  def _():
    copy_rows(src, dst)

  @pl.when(valid_tokens < ps)
  def _():
    copy_rows(src, dst, valid_tokens)


def copy_rows(src, dst, valid_tokens=None):
  """dst = src (as dst's dtype), rows >= valid_tokens zeroed unless it is None: the
  body of :func:`stage_rows`, for callers that already know the page is partial."""
  w = src.shape[1]
  load_w = math.gcd(w, 128 // jnp.dtype(src.dtype).itemsize)
  for j in range(w // load_w):
    xs = src[:, pl.ds(j * load_w, load_w)]
    for h in range(load_w // _STAGE_CHUNK):
      x = xs[:, h * _STAGE_CHUNK:(h + 1) * _STAGE_CHUNK]
      # e4m3 -> f16 is one exact cvt per pair (8-bit registers allow no
      # arithmetic, so the select comes after it).
      x = x.astype(dst.dtype)
      if valid_tokens is not None:
        rows = plgpu.broadcasted_iota(jnp.int32, x.shape, 0, layout=plgpu.Layout.WGMMA)
        # A select, not a multiply: unused slots may be NaN.
        x = jnp.where(rows < valid_tokens, x, jnp.zeros_like(x))
      dst[:, pl.ds(j * load_w + h * _STAGE_CHUNK, _STAGE_CHUNK)] = x.astype(dst.dtype)


def tma_reads_rope_at(q_rope, r: int, rope_offset: int) -> bool:
  """Whether a TMA box can read q_rope [B, N, W]'s R columns from ``rope_offset`` on: they
  lie within W, and their start and the rows' stride are multiples of 16 bytes (the
  decode step's query array: bf16 [B, N, 320] read from column 256;
  docs/paged_attention.md, "The query's rope part in place")."""
  w = q_rope.shape[-1]
  item = jnp.dtype(q_rope.dtype).itemsize
  return 0 <= rope_offset <= w - r and not (rope_offset * item) % 16 and not (w * item) % 16


def rope_start(q_rope, r: int, rope_offset: int | None) -> int:
  """The first of the R columns of q_rope [B, N, W] that hold the query's rope part, where
  its TMA box starts: 0 (``rope_offset`` None: W == R) or ``rope_offset``.

  Raises:
    ValueError: W != R without an offset, or columns :func:`tma_reads_rope_at` refuses.
  """
  w = q_rope.shape[-1]
  if rope_offset is None:
    if w != r:
      raise ValueError(f"q_rope has {w} columns but the rope keys {r}: pass rope_offset "
                       "for a query whose rope part lies in a wider array")
    return 0
  if not tma_reads_rope_at(q_rope, r, rope_offset):
    raise ValueError(f"rope columns [{rope_offset}, {rope_offset + r}) of a {w}-column "
                     f"{jnp.dtype(q_rope.dtype).name} query: they must lie within it, "
                     "and their start and the rows' stride be multiples of 16 bytes (TMA)")
  return rope_offset


def partial_rows(heads: int) -> int:
  """Rows of the partial outputs for ``heads`` real heads: rounded up to 8, since
  the bf16 staging tile is in 8-row tiles and a partial head block writes whole ones."""
  return -(-heads // 8) * 8

def mla_decode_mgpu(q_latent, q_rope, q_scale, latent, k_rope, latent_scale,
                    k_rope_scale, block_tables, lengths, pieces, *, scale,
                    heads=None, producer=False, rope_offset=None, interpret=False):
  """Paged MLA decode partials over a balanced schedule of pieces, on Mosaic GPU.

  Args:
    q_latent: [B, Hp, C] query: for an fp8 cache float8_e4m3fn (QK in fp8) or
      f16 (QK in f16), divided by q_scale; else the cache dtype. Hp a
      multiple of 64.
    q_rope: [B, Hp, R] same dtype and row scale; or [B, Hp, W] holding it at
      columns [rope_offset, rope_offset + R) (:func:`rope_start`).
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
    rope_offset: None, or the first of q_rope's columns that hold the rope part.
    interpret: False, or a plgpu.InterpretGPUParams.

  Returns:
    (o [G, H8, C] bf16 normalised per piece, H8 = H rounded up to 8 (rows
    past H are padding), lse [G, Hp] f32).

  Raises:
    ValueError: on an unsupported shape or dtype combination.
  """
  _, hp, c = q_latent.shape
  n, ps, r = k_rope.shape
  num_g = pieces.shape[1]
  heads = hp if heads is None else heads
  _check_args(q_latent, q_rope, q_scale, latent, k_rope, heads)
  rope_col = rope_start(q_rope, r, rope_offset)
  if producer:
    check_register_split(COMPUTE_REGS, PRODUCER_REGS)
  full_blocks = heads // BLOCK_H
  out_rows = partial_rows(heads)
  build = _Build(pages=n, ps=ps, c=c, r=r, rope_col=rope_col, qdt=q_latent.dtype,
                 cache_dt=latent.dtype, scale=scale, producer=producer, interpret=interpret,
                 full_blocks=full_blocks, tail_rows=out_rows - full_blocks * BLOCK_H)
  variant = _variant(latent.dtype, q_latent.dtype)

  def entry(*refs):
    pl.run_scoped(lambda *s: variant(build, refs, _Scratch(*s)).run(),
                  *variant.scratch_types(build), collective_axes="wg")

  out_type = (jax.ShapeDtypeStruct((num_g, out_rows, c), PARTIAL_DTYPE),
              jax.ShapeDtypeStruct((num_g, hp), jnp.float32))
  return mgpu_shim.kernel(
      entry,
      out_type=out_type,
      grid=(hp // BLOCK_H, num_g),
      grid_names=("h", "s"),
      num_threads=3 if producer else 2,
      thread_name="wg",
      kernel_name="paged_mla_decode_mgpu",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret,
  )(q_latent, q_rope, q_scale, latent, k_rope, latent_scale, k_rope_scale,
    block_tables, lengths, pieces)


def _check_args(q_latent, q_rope, q_scale, latent, k_rope, heads) -> None:
  """Raises ValueError unless mla_decode_mgpu takes these shapes and dtypes."""
  b, hp, c = q_latent.shape
  _, ps, r = k_rope.shape
  fp8 = latent.dtype == FP8
  qdt = q_latent.dtype
  if q_rope.ndim != 3 or q_rope.shape[:2] != (b, hp):
    raise ValueError(f"q_rope {q_rope.shape} does not match q_latent {q_latent.shape}")
  if not 0 < heads <= hp or hp - heads >= BLOCK_H:
    raise ValueError(f"heads {heads} must be in ({hp - BLOCK_H}, {hp}] for {hp} query rows")
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


def _variant(cache_dtype, query_dtype) -> type["_Cta"]:
  """The kernel's variant for a cache and query dtype (the module docstring's three)."""
  if cache_dtype != FP8:
    return _Bf16Cache
  # An fp8 query runs QK as fp8 wgmmas straight on the staged fp8 page.
  return _Fp8CacheFp8Qk if query_dtype == FP8 else _Fp8CacheF16Qk


@dataclasses.dataclass(frozen=True)
class _Build:
  """What one build of the kernel is (static): shapes, dtypes and how it runs."""

  pages: int  # N, the pool's pages (page ids are clamped to it)
  ps: int  # tokens per page
  c: int  # latent columns
  r: int  # rope columns
  rope_col: int  # the first of q_rope's columns that hold them
  qdt: Any  # the query's dtype
  cache_dt: Any  # the pages' dtype
  scale: float  # the softmax scale
  producer: bool  # a producer warpgroup (wg 2) issues the loads
  interpret: Any  # False, or the interpreter's parameters
  full_blocks: int  # 64-head blocks whose rows are all real
  tail_rows: int  # the last block's real rows rounded up to 8 (0: it has none)

  @property
  def half(self) -> int:
    """Output columns of each compute warpgroup's PV."""
    return self.c // 2

  @property
  def half_ps(self) -> int:
    """Tokens of each compute warpgroup's QK."""
    return self.ps // 2

  @property
  def cdt(self):
    """P's and PV's V dtype: f16 for an fp8 cache (its pages converted), else the cache's."""
    return jnp.float16 if self.cache_dt == FP8 else self.cache_dt


class _Scratch(NamedTuple):
  """The kernel's shared memory and barriers, in allocation order (None: one this
  build does without; _Cta.scratch_types)."""

  ql_smem: Any  # [1, 64, C] query latent
  qr_smem: Any  # [1, 64, R] query rope
  qs_smem: Any  # [64] the query's row factors (fp8 cache)
  lat_st: Any  # [slots, ps, C] staged latent pages
  rope_st: Any  # staged rope pages
  ls_st: Any  # [scale slots, ps] latent scales (fp8)
  rs_st: Any  # [scale slots, ps] rope scales (fp8)
  lat16: Any  # [1, ps, C] the page's latent in f16 (fp8)
  rope16: Any  # [1, ps, R] the page's rope in f16 (fp8, f16 QK)
  p_smem: Any  # [2, 64, ps] P as wgmma's A operand (interpreter only)
  px_smem: Any  # [2, 64, ps/2] each warpgroup's half of P, then its output staging
  o_st: Any  # [2, 64, ps/2] output staging where P is not bf16
  x_smem: Any  # [2, 2, 64] row vectors swapped by exchange()
  lse_smem: Any  # [64]
  q_bar: Any  # the query landed
  tma_bar: Any  # a page landed, per slot
  rope_bar: Any  # bf16: the rope landed
  conv_bar: Any  # the page converted / masked by both warpgroups
  free_bar: Any  # a slot's readers are done with it
  x_bar: Any  # row vectors swapped
  p_bar: Any  # both halves of P written
  rope_free: Any  # bf16 with a producer: both warpgroups' QK has read the rope


# The _Scratch fields every variant uses (p_smem and o_st where the build needs them).
_SHARED = ("ql_smem", "qr_smem", "lat_st", "rope_st", "p_smem", "px_smem", "o_st",
           "x_smem", "lse_smem", "q_bar", "tma_bar", "x_bar", "p_bar")
_ROW = plgpu.Layout.WGMMA.reduce(1)  # a [64] vector over the heads (rows)
_COL = plgpu.Layout.WGMMA.reduce(0)  # a vector over the tokens (columns)


class _Cta:
  """One CTA: what every variant does the same way.

  ``run`` is the kernel: the per-CTA scalars, then the loads (the producer's, or
  compute warpgroup 0's first pages) and the compute warpgroups' loop over the
  piece's pages, whose body is the variant's ``step``, then their partial
  outputs. A variant (subclass) says which buffers it uses (``OWN``; the
  slot counts), how its pages are issued (``first_pages``, ``produce_pages``)
  and what a step does (``step``); the pieces of a step that do not depend on
  the cache (views, softmax, PV) are here.
  """

  SLOTS = 2  # latent staging slots
  ROPE_SLOTS = 1  # rope staging slots
  SCALE_SLOTS = 0  # slots of the per-token scale rows (fp8)
  FP8 = False
  OWN: tuple[str, ...] = ()  # the variant's _Scratch fields beside _SHARED

  def __init__(self, build: _Build, refs, scratch: _Scratch):
    self.b = build
    (self.ql_ref, self.qr_ref, self.qs_ref, self.lat_ref, self.rope_ref, self.ls_ref,
     self.rs_ref, self.bt_ref, self.len_ref, self.pc_ref, self.o_ref, self.lse_ref) = refs
    self.s = scratch

  @classmethod
  def scratch_types(cls, b: _Build) -> list:
    """The types of the _Scratch fields, in allocation order: those of _SHARED and
    of the variant's OWN, None for the rest."""
    cdt, st = b.cdt, b.cache_dt
    types = _Scratch(
        ql_smem=_smem((BLOCK_H, b.c), b.qdt),
        qr_smem=_smem((BLOCK_H, b.r), b.qdt),
        qs_smem=plgpu.SMEM((BLOCK_H,), jnp.float32),
        lat_st=plgpu.SMEM((cls.SLOTS, b.ps, b.c), st, transforms=transforms(b.c, st)),
        rope_st=plgpu.SMEM((cls.ROPE_SLOTS, b.ps, b.r), st, transforms=transforms(b.r, st)),
        ls_st=plgpu.SMEM((cls.SCALE_SLOTS, b.ps), jnp.float32),
        rs_st=plgpu.SMEM((cls.SCALE_SLOTS, b.ps), jnp.float32),
        lat16=_smem((b.ps, b.c), cdt),
        rope16=_smem((b.ps, b.r), cdt),
        p_smem=mgpu_shim.operand_scratch(b.interpret, (2, BLOCK_H, b.ps), cdt,
                                         transforms(b.ps, cdt)),
        px_smem=plgpu.SMEM((2, BLOCK_H, b.half_ps), cdt, transforms=transforms(b.half_ps, cdt)),
        o_st=(None if cdt == PARTIAL_DTYPE else
              plgpu.SMEM((2, BLOCK_H, b.half_ps), PARTIAL_DTYPE,
                         transforms=transforms(b.half_ps, PARTIAL_DTYPE))),
        x_smem=plgpu.SMEM((2, 2, BLOCK_H), jnp.float32),
        lse_smem=plgpu.SMEM((BLOCK_H,), jnp.float32),
        # Every TMA issued with a barrier is one arrival on it: the query's two
        # (three with its row factors); a page's latent (bf16), or its latent,
        # rope and two scale rows (fp8).
        q_bar=plgpu.Barrier(num_arrivals=3 if cls.FP8 else 2),
        tma_bar=plgpu.Barrier(num_arrivals=4 if cls.FP8 else 1, num_barriers=cls.SLOTS),
        rope_bar=plgpu.Barrier(num_arrivals=1),
        # The rest wait for both compute warpgroups; free_bar has one barrier per
        # slot with a producer (see freed()).
        conv_bar=plgpu.Barrier(num_arrivals=2),
        free_bar=plgpu.Barrier(num_arrivals=2, num_barriers=2 if b.producer else 1),
        x_bar=plgpu.Barrier(num_arrivals=2),
        p_bar=plgpu.Barrier(num_arrivals=2),
        rope_free=plgpu.Barrier(num_arrivals=2) if b.producer else None,
    )
    used = _SHARED + cls.OWN
    return [t if name in used else None for name, t in zip(_Scratch._fields, types)]

  def first_pages(self) -> None:
    """Compute warpgroup 0 (no producer): the first pages, into slots free from the start."""
    raise NotImplementedError

  def produce_pages(self) -> None:
    """The producer warpgroup: every page of the piece, each once its slot is free."""
    raise NotImplementedError

  def step(self, i, carry):
    """The loop body over the piece's pages: page i's QK, online softmax and PV."""
    raise NotImplementedError

  def after_loop(self) -> None:
    """What the compute warpgroups do once the loop is over, before the output."""

  def run(self) -> None:
    """The kernel, in every warpgroup."""
    b = self.b
    merge_pieces_mgpu.let_merge_launch(b.interpret)
    self.hb = lax.axis_index("h")
    self.piece = lax.axis_index("s")
    self.wg = lax.axis_index("wg")
    # An unused piece (request -1) runs no step and writes an empty partial.
    self.bi = jnp.maximum(self.pc_ref[0, self.piece], 0)
    self.start = self.pc_ref[1, self.piece]
    self.steps = self.pc_ref[2, self.piece]
    self.length = self.len_ref[self.bi]
    self.rows_h = pl.ds(self.hb * BLOCK_H, BLOCK_H)
    self.cols = pl.ds(self.wg * b.half, b.half)
    self.tok = pl.ds(pl.multiple_of(self.wg * b.half_ps, b.half_ps), b.half_ps)
    if b.producer:
      pl.when(self.wg == 2)(self.produce)
      pl.when(self.wg < 2)(self.compute)
    else:
      @pl.when(self.wg == 0)
      def _():
        self.load_query()
        pl.when(self.steps > 0)(self.first_pages)
      self.compute()

  def page_id(self, step):
    """The block table's id of the piece's page ``step``."""
    # Only used pages are read (steps stops at them); clamp so a corrupt
    # id never sends the TMA out of bounds.
    return jnp.clip(self.bt_ref[self.bi, self.start + step], 0, self.b.pages - 1)

  def load_query(self) -> None:
    s = self.s
    plgpu.copy_gmem_to_smem(self.ql_ref.at[self.bi, self.rows_h], s.ql_smem.at[0], s.q_bar)
    rope = pl.ds(self.b.rope_col, self.b.r)  # the query's rope columns
    plgpu.copy_gmem_to_smem(self.qr_ref.at[self.bi, self.rows_h, rope], s.qr_smem.at[0],
                            s.q_bar)
    if self.FP8:
      plgpu.copy_gmem_to_smem(self.qs_ref.at[self.bi, self.rows_h], s.qs_smem, s.q_bar)

  def freed(self, step):
    """The barrier the compute warpgroups arrive on once step's slot is read.

    With a producer, one per slot: the compute warpgroups can finish two
    steps before the producer waits for the first of them (it issues page i
    once step i-2 let go of the slot, and pages i-2 and i-1 were issued
    before), and a barrier that completes two phases before its waiter
    looks is never seen to complete (mbarrier waits test the phase's
    parity)."""
    return self.s.free_bar.at[lax.rem(step, 2)] if self.b.producer else self.s.free_bar

  def produce(self) -> None:
    """The memory warpgroup: the query, then every page of the piece in
    order, each as soon as what last read its slot has let go of it (the
    barriers the compute warpgroups arrive on). It then waits out the phases
    nobody else waits on, so every barrier ends the kernel consumed."""
    mgpu_shim.set_max_registers(PRODUCER_REGS, action="decrease")
    self.load_query()
    self.produce_pages()

  def compute(self) -> None:
    """The two compute warpgroups (wg 0 and 1): the loop over the piece's pages,
    then the partial output."""
    b = self.b
    if b.producer:
      mgpu_shim.set_max_registers(COMPUTE_REGS, action="increase")
    plgpu.barrier_wait(self.s.q_bar)
    # The softmax scale, times the query's row factors for an fp8 cache.
    self.row_scale = (plgpu.load(self.s.qs_smem, layout=_ROW) * b.scale if self.FP8
                      else plgpu.layout_cast(jnp.full((BLOCK_H,), b.scale, jnp.float32), _ROW))
    self.other = 1 - self.wg
    acc0 = plgpu.layout_cast(jnp.zeros((BLOCK_H, b.half), jnp.float32), plgpu.Layout.WGMMA)
    m0 = plgpu.layout_cast(jnp.full((BLOCK_H,), NEG, jnp.float32), _ROW)
    l0 = plgpu.layout_cast(jnp.zeros((BLOCK_H,), jnp.float32), _ROW)
    g0 = plgpu.layout_cast(jnp.ones((BLOCK_H,), jnp.float32), _ROW)
    acc, m_i, l_i, g_i = lax.fori_loop(0, self.steps, self.step, (acc0, m0, l0, g0))
    self.after_loop()
    self.write_partials(acc, m_i, l_i, g_i)

  def meet(self, bar) -> None:
    """Fences this warpgroup's shared-memory stores and waits for the other
    compute warpgroup to reach the same point (``bar``: two arrivals)."""
    plgpu.commit_smem()
    plgpu.barrier_arrive(bar)
    plgpu.barrier_wait(bar)

  def exchange(self, vals):
    """Swaps [64] row vectors with the other warpgroup (one rendezvous)."""
    for j, v in enumerate(vals):
      self.s.x_smem.at[self.wg, j][...] = v
    self.meet(self.s.x_bar)
    return [plgpu.load(self.s.x_smem.at[self.other, j], layout=_ROW) for j in range(len(vals))]

  def views(self, i):
    """Step i's query and staged page, and the page's valid tokens.

    The buffers are indexed by z, 0 but opaque to LLVM (an optimization
    barrier): their wgmma descriptors are then loop-variant and computed next
    to their wgmma, instead of being hoisted out of the loop (module docstring).

    Returns:
      (z, query latent, query rope, staged latent, staged rope, valid tokens).
    """
    z = lax.optimization_barrier(jnp.int32(0))
    q_lat, q_rp = self.s.ql_smem.at[z], self.s.qr_smem.at[z]
    slot = z if self.SLOTS == 1 else lax.rem(i, 2) + z
    lat_in = self.s.lat_st.at[slot]
    rope_in = self.s.rope_st.at[slot if self.ROPE_SLOTS > 1 else z]
    valid_tokens = self.length - (self.start + i) * self.b.ps
    return z, q_lat, q_rp, lat_in, rope_in, valid_tokens

  def keys(self, page):
    """This warpgroup's tokens of a staged [ps, w] page, read transposed as QK's B."""
    return page.at[self.tok].transpose((1, 0))

  def qk_acc(self):
    """An f32 accumulator for this warpgroup's [64, ps / 2] logits."""
    return plgpu.ACC((BLOCK_H, self.b.half_ps), jnp.float32)

  def masked_logits(self, logits, valid_tokens):
    """The logits times the row scale, NEG past the page's valid tokens; and that mask."""
    logits = logits * lax.broadcast_in_dim(self.row_scale, logits.shape, [0])
    kpos = self.wg * self.b.half_ps + plgpu.broadcasted_iota(
        jnp.int32, (BLOCK_H, self.b.half_ps), 1, layout=plgpu.Layout.WGMMA)
    valid = kpos < valid_tokens
    return jnp.where(valid, logits, NEG), valid

  def softmax(self, m_i, l_i, logits, my_max, their_max):
    """The online softmax over this warpgroup's tokens, with the running max both
    warpgroups share.

    Returns:
      (m_new, alpha: the accumulator's rescale, p, l_new: this warpgroup's sum).
    """
    m_new = jnp.maximum(m_i, jnp.maximum(my_max, their_max))
    alpha = jnp.exp2((m_i - m_new) * LOG2E)
    p = jnp.exp2((logits - lax.broadcast_in_dim(m_new, logits.shape, [0])) * LOG2E)
    l_new = l_i * alpha + p.sum(axis=1)  # this warpgroup's tokens only
    return m_new, alpha, p, l_new

  def pv(self, acc, alpha, p, v):
    """acc * alpha + P V over the whole page, for this warpgroup's columns of V
    (``v``: the page's [ps, C] latent as PV reads it).

    P's halves meet in shared memory: each warpgroup stores its own and loads
    both, so their order is static, and PV runs over the whole page."""
    s = self.s
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    s.px_smem.at[self.wg][...] = p.astype(self.b.cdt)
    self.meet(s.p_bar)
    p16 = jnp.concatenate([s.px_smem.at[0][...], s.px_smem.at[1][...]], axis=1)
    p_op = mgpu_shim.register_operand(p16, s.p_smem, self.wg)
    return mgpu_shim.accumulate(
        acc, lambda acc_ref: plgpu.wgmma(acc_ref, p_op, v.at[:, self.cols]), self.b.interpret)

  def write_partials(self, acc, m_i, l_i, g_i) -> None:
    """This piece's normalised output rows (this warpgroup's columns) and its lse."""
    b, s = self.b, self.s
    # The softmax sums of the two halves of the tokens.
    l_i = l_i + self.exchange([l_i])[0]
    nonempty = l_i > 0
    inv = g_i / jnp.where(nonempty, l_i, 1.0)  # g_i: acc / g (fp8), else 1
    acc = acc * lax.broadcast_in_dim(inv, acc.shape, [0])

    def write_out(rows):
      """This warpgroup's columns of the block's first `rows` rows (a static count).

      Staged through this warpgroup's P tile when P has the partials' dtype
      (bf16 cache; it is free after the last step), else through its own tile."""
      o_smem = (s.o_st if s.o_st is not None else s.px_smem).at[self.wg]
      for j in range(b.half // b.half_ps):
        o_smem[...] = acc[:, j * b.half_ps:(j + 1) * b.half_ps].astype(PARTIAL_DTYPE)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            o_smem.at[pl.ds(0, rows)],
            self.o_ref.at[self.piece, pl.ds(self.hb * BLOCK_H, rows),
                          pl.ds(self.wg * b.half + j * b.half_ps, b.half_ps)])
        plgpu.wait_smem_to_gmem(0)
    if b.full_blocks:
      pl.when(self.hb < b.full_blocks)(lambda: write_out(BLOCK_H))
    if b.tail_rows:
      pl.when(self.hb == b.full_blocks)(lambda: write_out(b.tail_rows))
    @pl.when(self.wg == 0)
    def _():
      s.lse_smem[...] = jnp.where(nonempty, m_i + jnp.log(jnp.where(nonempty, l_i, 1.0)), NEG)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(s.lse_smem, self.lse_ref.at[self.piece, self.rows_h])
      plgpu.wait_smem_to_gmem(0)


class _Bf16Cache(_Cta):
  """A bf16 (or f16) cache, read in place.

  The latent has two slots used in turn: page i+1's latent is issued at the top
  of step i, into the slot step i-1's PV (in both warpgroups) has finished
  reading. The rope, read by QK only, has one buffer, refilled as soon as both
  warpgroups' QK has read it. Only a request's partial last page is touched:
  its rows past the length are zeroed in place.
  """

  # The rope landed; the partial page masked by both warpgroups; both
  # warpgroups' PV retired; with a producer, both warpgroups' QK read the rope.
  OWN = ("rope_bar", "conv_bar", "free_bar", "rope_free")

  def issue_latent(self, step):
    """The page's latent, into slot step % 2."""
    slot = lax.rem(step, 2)
    plgpu.copy_gmem_to_smem(self.lat_ref.at[self.page_id(step)], self.s.lat_st.at[slot],
                            self.s.tma_bar.at[slot])

  def issue_rope(self, step):
    """The page's rope, into its one buffer (read by QK only)."""
    plgpu.copy_gmem_to_smem(self.rope_ref.at[self.page_id(step)], self.s.rope_st.at[0],
                            self.s.rope_bar)

  def first_pages(self):
    self.issue_latent(0)
    self.issue_rope(0)
    pl.when(self.steps > 1)(lambda: self.issue_latent(1))  # the second slot is free from the start

  def produce_pages(self):
    # Latent slot i % 2 was read by step i-2's PV (the ring waits for that);
    # the one rope buffer by step i-1's QK.
    def issue_page(i):
      self.issue_latent(i)
      pl.when(i >= 1)(lambda: plgpu.barrier_wait(self.s.rope_free))
      self.issue_rope(i)
    producer_loop.issue_ring(self.steps, 2, self.s.free_bar, issue_page)
    pl.when(self.steps > 0)(lambda: plgpu.barrier_wait(self.s.rope_free))

  def step(self, i, carry):
    acc, m_i, l_i, g_i = carry
    s, producer = self.s, self.b.producer
    _, q_lat, q_rp, lat_in, rope_in, valid_tokens = self.views(i)
    # The other slot was last read by step i-1's PV in both warpgroups
    # (each arrives on free_bar once its PV has retired): refill it with
    # page i+1, so the gather overlaps this whole step (the producer
    # waits on free_bar).
    if not producer:
      @pl.when((self.wg == 0) & (i > 0))
      def _():
        plgpu.barrier_wait(s.free_bar)
        pl.when(i + 1 < self.steps)(lambda: self.issue_latent(i + 1))
    plgpu.barrier_wait(s.tma_bar.at[lax.rem(i, 2)])
    plgpu.barrier_wait(s.rope_bar)
    # No conversion pass on a bf16 cache, but the tail of a request's
    # last page may hold garbage (NaN included) and p == 0 does not
    # cancel NaN in PV: zero those rows, only on that partial page.
    @pl.when(valid_tokens < self.b.ps)
    def _():
      copy_rows(lat_in.at[:, self.cols], lat_in.at[:, self.cols], valid_tokens)
      self.meet(s.conv_bar)

    # QK for this warpgroup's half of the page's tokens only, so no MMA
    # work is duplicated.
    def qk(acc_ref):
      plgpu.wgmma(acc_ref, q_lat, self.keys(lat_in))
      plgpu.wgmma(acc_ref, q_rp, self.keys(rope_in))
      return acc_ref[...]
    logits = pl.run_scoped(qk, self.qk_acc())
    if producer:
      # This warpgroup's QK has read the rope buffer (its wgmmas retired).
      plgpu.barrier_arrive(s.rope_free)
    logits, _ = self.masked_logits(logits, valid_tokens)
    my_max = logits.max(axis=1)
    (their_max,) = self.exchange([my_max])
    if not producer:
      # Both warpgroups' QK has read the rope buffer: refill it.
      pl.when((self.wg == 0) & (i + 1 < self.steps))(lambda: self.issue_rope(i + 1))
    m_new, alpha, p, l_new = self.softmax(m_i, l_i, logits, my_max, their_max)
    acc = self.pv(acc, alpha, p, lat_in)
    plgpu.barrier_arrive(self.freed(i))  # this warpgroup's PV has read the slot
    return acc, m_new, l_new, g_i

  def after_loop(self):
    if not self.b.producer:
      # Consume the last step's phase (its waiter waits on every phase).
      @pl.when((self.wg == 0) & (self.steps > 0))
      def _():
        plgpu.barrier_wait(self.s.free_bar)


class _Fp8Cache(_Cta):
  """An fp8 (e4m3) cache: what its two variants share.

  A page lands with its per-token scale rows, which stay out of the per-element
  work: QK yields latent and rope logits as two f32 tiles, scaled per token
  (column) here; P takes the latent scale divided by the page's largest (g),
  and the accumulator holds acc / g (module docstring).
  """

  FP8 = True

  # The query's row factors, the scale rows, the page's f16 latent (PV's V).
  OWN = ("qs_smem", "ls_st", "rs_st", "lat16")

  def issue_page(self, step):
    """The page (latent, rope, scales) into staging slot step % slots."""
    page = self.page_id(step)
    slot = lax.rem(step, self.SLOTS)
    bar = self.s.tma_bar.at[slot]
    plgpu.copy_gmem_to_smem(self.lat_ref.at[page], self.s.lat_st.at[slot], bar)
    plgpu.copy_gmem_to_smem(self.rope_ref.at[page], self.s.rope_st.at[slot], bar)
    sc = lax.rem(step, self.SCALE_SLOTS)
    plgpu.copy_gmem_to_smem(self.ls_ref.at[page], self.s.ls_st.at[sc], bar)
    plgpu.copy_gmem_to_smem(self.rs_ref.at[page], self.s.rs_st.at[sc], bar)

  def convert_latent(self, lat_in, k_lat, valid_tokens):
    """This warpgroup's columns of the staged latent to f16 (PV's V), the rows
    past the length zeroed (p = 0 does not cancel NaN)."""
    stage_rows(lat_in.at[:, self.cols], k_lat.at[:, self.cols], valid_tokens)

  def qk(self, q_lat, q_rp, k_lat, k_rope, during=lambda: None):
    """Latent and rope logits of this warpgroup's tokens, one f32 tile each (their
    scales differ); ``during()`` runs while the wgmmas do."""
    def qk(lat_acc, rope_acc):
      plgpu.wgmma(lat_acc, q_lat, self.keys(k_lat))
      plgpu.wgmma(rope_acc, q_rp, self.keys(k_rope))
      during()
      return lat_acc[...], rope_acc[...]
    return pl.run_scoped(qk, self.qk_acc(), self.qk_acc())

  def attend(self, i, carry, s_lat, s_rope, valid_tokens, v):
    """From page i's latent and rope logits: the scaled logits, the online softmax
    (P scaled by latent_scale / g) and PV over ``v``; the new carry."""
    acc, m_i, l_i, g_i = carry
    sc = lax.rem(i, self.SCALE_SLOTS)
    ls_half = plgpu.load(self.s.ls_st.at[sc, self.tok], layout=_COL)
    rs_half = plgpu.load(self.s.rs_st.at[sc, self.tok], layout=_COL)
    logits = (s_lat * lax.broadcast_in_dim(ls_half, s_lat.shape, [1])
              + s_rope * lax.broadcast_in_dim(rs_half, s_rope.shape, [1]))
    logits, valid = self.masked_logits(logits, valid_tokens)
    my_max = logits.max(axis=1)
    # V = latent_scale[t] * f16 page: P takes the scale, divided by the
    # page's largest (g) so it stays in [0, 1]; acc holds acc / g.
    ls_tile = lax.broadcast_in_dim(ls_half, logits.shape, [1])
    ls_tile = jnp.where(valid, ls_tile, 0.0)  # unused slots' scales may be NaN
    my_g = ls_tile.max(axis=1)
    their_max, their_g = self.exchange([my_max, my_g])
    m_new, alpha, p, l_new = self.softmax(m_i, l_i, logits, my_max, their_max)
    g_new = jnp.maximum(jnp.maximum(my_g, their_g), MIN_SCALE)
    inv_g = 1.0 / g_new
    p = p * ls_tile * lax.broadcast_in_dim(inv_g, p.shape, [0])
    alpha = alpha * g_i * inv_g
    return self.pv(acc, alpha, p, v), m_new, l_new, g_new


class _Fp8CacheF16Qk(_Fp8Cache):
  """An fp8 cache with an f16 query: each page is converted to an f16 page in
  shared memory before QK (wgmma reads its B operand only from there), each
  warpgroup its latent columns, warpgroup 0 the rope. The page lands in one
  staging buffer, free once both warpgroups converted it, so the next page's TMA
  overlaps this page's QK, softmax and PV; the scale rows, read until PV, have
  two slots."""

  SLOTS = 1
  SCALE_SLOTS = 2

  # The page's f16 rope; the page converted by both warpgroups.
  OWN = _Fp8Cache.OWN + ("rope16", "conv_bar")

  def first_pages(self):
    self.issue_page(0)

  def produce_pages(self):
    # One staging buffer, free once both warpgroups converted step i-1.
    @pl.loop(0, self.steps)
    def _(i):
      pl.when(i >= 1)(lambda: plgpu.barrier_wait(self.s.conv_bar))
      self.issue_page(i)
    pl.when(self.steps > 0)(lambda: plgpu.barrier_wait(self.s.conv_bar))

  def step(self, i, carry):
    s = self.s
    z, q_lat, q_rp, lat_in, rope_in, valid_tokens = self.views(i)
    plgpu.barrier_wait(s.tma_bar.at[0])
    k_lat, k_rope = s.lat16.at[z], s.rope16.at[z]
    # lat16 / rope16 were last read by step i-1's QK (both warpgroups
    # passed its exchange since) and by this warpgroup's own PV (retired).
    self.convert_latent(lat_in, k_lat, valid_tokens)
    pl.when(self.wg == 0)(lambda: stage_rows(rope_in, k_rope, valid_tokens))
    self.meet(s.conv_bar)
    # Both warpgroups converted the staging buffer: prefetch the next
    # page during this one's compute (the producer waits on conv_bar).
    if not self.b.producer:
      pl.when((self.wg == 0) & (i + 1 < self.steps))(lambda: self.issue_page(i + 1))
    s_lat, s_rope = self.qk(q_lat, q_rp, k_lat, k_rope)
    return self.attend(i, carry, s_lat, s_rope, valid_tokens, k_lat)


class _Fp8CacheFp8Qk(_Fp8Cache):
  """An fp8 cache with an e4m3 query (the default): QK runs as fp8 wgmmas straight
  on the staged page (both operands K-major, as fp8 wgmma needs), and while they
  run each warpgroup converts its latent columns to the f16 V of PV. Whole pages
  have two slots: page i+2 is issued as soon as both warpgroups' QK and
  conversion have read page i's slot; the scale rows, read until PV, have
  three."""

  ROPE_SLOTS = 2
  SCALE_SLOTS = 3

  # Both warpgroups' QK and conversion have read a slot.
  OWN = _Fp8Cache.OWN + ("free_bar",)

  def first_pages(self):
    self.issue_page(0)
    pl.when(self.steps > 1)(lambda: self.issue_page(1))  # the second slot is free from the start

  def produce_pages(self):
    # Page i goes to slot i % 2, read by step i-2's QK and conversion
    # (and its scale rows, slot i % 3, by step i-3's PV: done before).
    producer_loop.issue_ring(self.steps, 2, self.s.free_bar, self.issue_page)

  def step(self, i, carry):
    s = self.s
    z, q_lat, q_rp, lat_in, rope_in, valid_tokens = self.views(i)
    plgpu.barrier_wait(s.tma_bar.at[lax.rem(i, 2)])
    # lat16 is read by PV only, each warpgroup its own columns.
    k_lat = s.lat16.at[z]

    def convert():
      self.convert_latent(lat_in, k_lat, valid_tokens)
      plgpu.commit_smem()
    # fp8 x fp8 from the staged page; the tail's garbage only reaches its own
    # logits' columns, which are masked.
    s_lat, s_rope = self.qk(q_lat, q_rp, lat_in, rope_in, during=convert)
    # Both warpgroups' QK and conversion have read the slot: refill it
    # with page i+2 (page i+1 is landing in the other one).
    plgpu.barrier_arrive(self.freed(i))
    if not self.b.producer:
      @pl.when(self.wg == 0)
      def _():
        plgpu.barrier_wait(s.free_bar)
        pl.when(i + 2 < self.steps)(lambda: self.issue_page(i + 2))
    return self.attend(i, carry, s_lat, s_rope, valid_tokens, k_lat)
