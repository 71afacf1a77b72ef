"""INT4 weight-only (W4A16) matmuls for Hopper in Pallas Mosaic GPU.

Both kernels swap operands: they compute out^T[N, M] = W^T[N, K] @ x^T[K, M],
so the weight tile fills wgmma's M dimension (a multiple of 64) and the few
decode tokens sit in wgmma's N dimension (multiple of 8). Both SMEM operands are
read transposed (MN-major), which wgmma supports for 16-bit types.

Unpacking. A packed byte row i holds K rows 2i (low nibble) and 2i+1 (high
nibble). Rather than interleave the two nibble planes in registers (Mosaic GPU
has no such relayout), the wrapper splits x into its even and odd columns
(x[:, 0::2], x[:, 1::2]) and each pipeline step issues two wgmmas: the low
nibbles against the even columns and the high nibbles against the odd ones.

Dequantisation. Each step TMA-loads the uint8 tile [tile_k/2, tile_n] and its
scales [tile_k/group_size, tile_n] into SMEM, loads 64-row chunks into registers
in the WGMMA layout, sign-extends the nibbles in int32 (Mosaic GPU refuses
arithmetic on 8-bit types), multiplies by the scale row broadcast along rows
(a WGMMA_COL vector, selected per group with a row iota when a chunk holds
several groups), and stores bf16 into an SMEM scratch that wgmma reads. Going
through SMEM rather than feeding wgmma from registers is what the Mosaic GPU
interpreter needs (both wgmma operands in SMEM, ``pallas_kernels.mgpu_shim``) and
keeps one code path.
Accumulation is f32 in the wgmma accumulator.

Not expressible in Mosaic GPU with jax 0.11.2 (checked by lowering for an
abstract H200), so worked around as above:
  * arithmetic on uint8/int8 registers: "NotImplementedError: Pointwise
    operations on 8-bit types are unsupported (except bitwise operations)",
    hence the int32 upcast;
  * a scale row broadcast along rows with inferred layouts ("Failed to infer a
    possible set of layouts"), or in an explicit WG_STRIDED layout stored into
    the SMEM scratch that wgmma also reads ("Layout inference failed to find a
    solution"), hence explicit WGMMA layouts and 64-row register chunks, which
    is why tile_k must be a multiple of 128;
  * a TMA box has a static shape, so the grouped kernel writes a dynamic
    number of output rows as one box per set bit of the count (as jax's
    ragged_dot_mgpu does), which needs token-major rows: the accumulator
    (out^T, tokens in columns) is stored transposed into the SMEM tile;
  * an x box whose first row Mosaic GPU cannot prove to be a multiple of 8
    fails layout inference, so grouped tiles are windows that start on such
    rows and store only their expert's rows.

Grouped schedule (docs/int4_matmul.md). Each expert's rows are cut into tiles
of their own (windows of tile_m rows starting on a multiple of 8 at or below
the expert's first row), so a tile streams one expert's weights and writes its
expert's rows of the [M, N] output in place; rows past sum(group_sizes) get
tiles that write zeros. A persistent grid (SMs x CTAs per SM) walks the tiles
in use, read from a schedule computed on the device. tile_m follows the mean
rows per expert (BlockSizes.get_default).

Performance notes (not yet measured on a GPU):
  * The wrapper adds XLA ops around each kernel: the even/odd split of x (fuses
    into x's producer inside a model), and for the dense kernel the split-K
    sum, transpose and cast of the output (one small fusion for decode shapes).
  * One warpgroup per CTA both dequantises and issues wgmma, waiting for each
    step's wgmma before reusing the scratch. Dequantisation costs about 8 ALU
    ops per weight, so a single warpgroup per SM would cap decode well below
    the copy bandwidth; the H200 decode block sizes keep SMEM under half an SM
    so two CTAs share each SM. Warp specialisation (a producer warpgroup and
    two dequant/MMA warpgroups, as in hopper_mixed_type_matmul_mgpu) is the
    next step once the GPU numbers are in.
"""

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import device
from pallas_kernels import dispatch
from pallas_kernels import mgpu_shim
from pallas_kernels import schedule
from pallas_kernels.int4_matmul import reference
from pallas_kernels.int4_matmul import schedule_kernel
from pallas_kernels.int4_matmul import tile_model
from pallas_kernels.int4_matmul.block_sizes import BlockSizes
from pallas_kernels.int4_matmul.block_sizes import H200_SMEM_BYTES
from pallas_kernels.int4_matmul.block_sizes import NK_MODEL_REGISTERS

# One register chunk of packed rows: the WGMMA register layout is 64 rows tall.
_CHUNK = 64

BACKENDS = dispatch.BACKENDS
resolve_backend = dispatch.resolve_backend


def _dequant_tile(p_smem, s_smem, wlo_smem, whi_smem, *, tile_n, tile_k,
                  group_size):
  """Dequantises one packed SMEM tile into the two bf16 wgmma operand scratches.

  p_smem: [tile_k/2, tile_n] uint8; s_smem: [tile_k/g, tile_n];
  wlo_smem / whi_smem: [tile_k/2, tile_n] bf16 (even / odd K rows).
  """
  wgmma_layout = plgpu.Layout.WGMMA
  half_group = group_size // 2  # packed rows per scale group
  groups_per_chunk = max(1, _CHUNK // half_group)
  for c in range(tile_k // 2 // _CHUNK):
    rows = pl.ds(c * _CHUNK, _CHUNK)
    v = plgpu.load(p_smem.at[rows], layout=wgmma_layout).astype(jnp.int32)
    first_group = c * _CHUNK // half_group
    scale = None
    if groups_per_chunk > 1:
      row_group = lax.broadcasted_iota(jnp.int32, (_CHUNK, tile_n), 0) // half_group
    for j in range(groups_per_chunk):
      s_row = plgpu.load(s_smem.at[first_group + j],
                         layout=wgmma_layout.reduce(0)).astype(jnp.float32)
      s_j = jnp.broadcast_to(s_row[None, :], (_CHUNK, tile_n))
      scale = s_j if scale is None else jnp.where(row_group == j, s_j, scale)
    # (v ^ 8) - 8 sign-extends a nibble: 0..15 -> two's-complement -8..7.
    lo = ((v & 0xF) ^ 8) - 8
    hi = (((v >> 4) & 0xF) ^ 8) - 8
    wlo_smem[rows, :] = (lo.astype(jnp.float32) * scale).astype(wlo_smem.dtype)
    whi_smem[rows, :] = (hi.astype(jnp.float32) * scale).astype(whi_smem.dtype)


def _mma_step(step, xe_smem, xo_smem, p_smem, s_smem, wlo_smem, whi_smem, acc_ref, *,
              tile_n, tile_k, group_size, overlap):
  """One K step: dequantise the packed tile into the scratch, then its two wgmmas.

  Without overlap the step waits for its wgmmas, so the next step may reuse
  the scratch. With overlap the scratch has two slots, used in turn, and the
  step leaves its wgmmas running while the next one dequantises into the
  other slot: wgmma_wait(1) at the end of step i retires step i-1's, the last
  reader of the slot step i+1 writes (the x buffers are released a step late,
  BlockSpec.delay_release, for the same reason).
  """
  if overlap:
    slot = lax.rem(step, 2)
    wlo_smem, whi_smem = wlo_smem.at[slot], whi_smem.at[slot]
  _dequant_tile(p_smem, s_smem, wlo_smem, whi_smem, tile_n=tile_n,
                tile_k=tile_k, group_size=group_size)
  plgpu.commit_smem()  # make generic-proxy SMEM stores visible to wgmma
  plgpu.wgmma(acc_ref, wlo_smem.T, xe_smem.T)  # [tn, tk/2] @ [tk/2, tm]
  plgpu.wgmma(acc_ref, whi_smem.T, xo_smem.T)
  plgpu.wgmma_wait(1 if overlap else 0)


def _k_pipeline(acc_ref, xe, xo, packed, scales, wlo_smem, whi_smem, *, in_specs,
                k_steps, max_concurrent_steps, tile_n, tile_k, group_size, overlap):
  """Accumulates one output tile over k_steps K steps into acc_ref (both kernels)."""
  step = functools.partial(_mma_step, tile_n=tile_n, tile_k=tile_k,
                           group_size=group_size, overlap=overlap)
  plgpu.emit_pipeline(
      lambda idx, xe_s, xo_s, p_s, s_s: step(idx[0], xe_s, xo_s, p_s, s_s, wlo_smem,
                                             whi_smem, acc_ref),
      grid=(k_steps,),
      in_specs=in_specs,
      max_concurrent_steps=max_concurrent_steps,
  )(xe, xo, packed, scales)
  if overlap:
    plgpu.wgmma_wait(0)


def _overlap(bs: BlockSizes, k_steps: int) -> bool:
  """Whether the kernel overlaps dequantisation with the wgmmas: asked for, and
  at least two K steps in a pipeline at least two deep."""
  return bs.overlap_dequant and min(bs.max_concurrent_steps, k_steps) >= 2


def _scratch(bs: BlockSizes, o_tile, overlap: bool):
  """SMEM scratch of both kernels: the dequantised even/odd K rows (two slots
  each with overlap), then the output tile ``o_tile`` (a plgpu.SMEM)."""
  tkh = bs.tile_k // 2
  slots = (2,) if overlap else ()
  return [plgpu.SMEM((*slots, tkh, bs.tile_n), jnp.bfloat16),
          plgpu.SMEM((*slots, tkh, bs.tile_n), jnp.bfloat16),
          o_tile]


def _in_specs(tile_m, tile_n, tile_k, ng, m_block, n_block, k_offset, *,
              first_row=None, overlap=False):
  """x even/odd, packed and scales specs; x rows from block m_block, or from
  row first_row when given (a multiple of _ROW_ALIGN: the grouped kernel's
  windows start near their expert's rows). With overlap the x buffers are
  released a step late (a step's wgmmas still read them during the next)."""
  tkh = tile_k // 2
  delay = 1 if overlap else 0
  if first_row is not None:
    # x is padded by tile_m rows, so the box never leaves it (no zero fill).
    x_spec = plgpu.BlockSpec((pl.Element(tile_m), tkh), lambda kk: (first_row, kk),
                             oob_fill_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS,
                             delay_release=delay)
  else:
    x_spec = plgpu.BlockSpec((tile_m, tkh), lambda kk: (m_block, kk + k_offset),
                             delay_release=delay)
  return [
      x_spec,
      x_spec,
      plgpu.BlockSpec((tkh, tile_n), lambda kk: (kk + k_offset, n_block)),
      plgpu.BlockSpec((ng, tile_n), lambda kk: (kk + k_offset, n_block)),
  ]


def dense_out(bs: BlockSizes, n: int, m_pad: int, out_dtype):
  """(out_type, output tile scratch) of dense_kernel. One K split writes the
  result itself, [Mp, N] in ``out_dtype``, through a tile transposed in shared
  memory; several write f32 partials of out^T [k_splits, N, Mp] that
  :func:`dense_result` sums. (The f32 round trip would be 117 MB each way for
  Kimi K2.6's ffn_down at 4,096 tokens: about 55 us at 4.3 TB/s beside 171 us of
  MMA at 790 TFLOP/s; arithmetic, not timed.)"""
  if bs.k_splits == 1:
    return (jax.ShapeDtypeStruct((m_pad, n), out_dtype),
            plgpu.SMEM((bs.tile_m, bs.tile_n), out_dtype))
  return (jax.ShapeDtypeStruct((bs.k_splits, n, m_pad), jnp.float32),
          plgpu.SMEM((bs.tile_n, bs.tile_m), jnp.float32))


def dense_result(out, m: int, n: int, out_dtype):
  """[M, N] in ``out_dtype`` from dense_kernel's output (see :func:`dense_out`)."""
  if out.ndim == 2:
    return out[:m, :n]
  return out.sum(axis=0)[:n, :m].T.astype(out_dtype)  # the split-K sum stays in f32


def dense_kernel(*refs, pipeline, x_refs, tile_n, tile_m, k_steps):
  """Dense kernel body (both weight layouts): one CTA computes one (n, m) tile of
  one K split.

  refs: the x_refs x operands, the weights and scales (GMEM), o_gmem (see
  :func:`dense_out`: [Mp, N] written whole, or [k_splits, N, Mp] f32 partial sums
  of out^T), then the pipeline's scratch and the output tile o_smem ([tile_m,
  tile_n] or [tile_n, tile_m] f32 to match). pipeline(acc_ref, ins, work,
  m_block=, n_block=, k_offset=) accumulates the tile's K steps.
  """
  ins, o_gmem = refs[:x_refs + 2], refs[x_refs + 2]
  work, o_smem = refs[x_refs + 3:-1], refs[-1]
  ni = lax.axis_index("n")
  mi = lax.axis_index("m")
  si = lax.axis_index("k")

  def acc_scope(acc_ref):
    pipeline(acc_ref, ins, work, m_block=mi, n_block=ni, k_offset=si * k_steps)
    return acc_ref[...]

  acc = pl.run_scoped(acc_scope, plgpu.ACC((tile_n, tile_m), jnp.float32))
  if len(o_gmem.shape) == 2:  # one split: the result, rows of tokens
    o_smem.T[...] = acc.astype(o_smem.dtype)
    dst = o_gmem.at[pl.ds(mi * tile_m, tile_m), pl.ds(ni * tile_n, tile_n)]
  else:
    o_smem[...] = acc
    dst = o_gmem.at[si, pl.ds(ni * tile_n, tile_n), pl.ds(mi * tile_m, tile_m)]
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem, dst)
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _kn_pipeline(bs: BlockSizes, group_size: int, k_steps: int):
  """The [K/2, N] uint8 layout's K pipeline for dense_kernel / grouped_kernel:
  x as even and odd columns, dequantised through the bf16 scratch."""
  overlap = _overlap(bs, k_steps)
  ng = bs.tile_k // group_size

  def run(acc_ref, ins, work, *, m_block, n_block, k_offset, first_row=None):
    xe, xo, packed, scales = ins
    wlo_smem, whi_smem = work
    _k_pipeline(acc_ref, xe, xo, packed, scales, wlo_smem, whi_smem,
                in_specs=_in_specs(bs.tile_m, bs.tile_n, bs.tile_k, ng, m_block,
                                   n_block, k_offset, first_row=first_row,
                                   overlap=overlap),
                k_steps=k_steps, max_concurrent_steps=min(bs.max_concurrent_steps, k_steps),
                tile_n=bs.tile_n, tile_k=bs.tile_k, group_size=group_size, overlap=overlap)
  return run


def _split_even_odd(x, m_pad):
  x = jnp.pad(x, ((0, m_pad - x.shape[0]), (0, 0)))
  return x[:, 0::2], x[:, 1::2]  # [Mp, K/2] each


def compiler_params():
  return plgpu.CompilerParams(
      lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


def kernel_dims(n: int, k: int) -> tuple[int, int]:
  """(N, K) as the kernels run them: N padded to a multiple of 64, K of 128."""
  return -(-n // 64) * 64, -(-k // 128) * 128


def _kernel_operands(x, packed, scales, group_size):
  """Casts x to bf16 and zero-pads K to a multiple of 128 and N of 64.

  Padding copies the weights, so it is meant for small test models only; every
  Kimi K2.6 / GLM 5.2 matrix is aligned and passes through untouched. Zero
  packed bytes are int4 zeros, so padded K rows add nothing; padded N columns
  are sliced off by the caller.

  Returns:
    (x bf16 [M, Kp], packed [..., Kp/2, Np], scales [..., Kp/g, Np]).
  """
  k, n = x.shape[1], packed.shape[-1]
  n_pad, k_pad = (a - b for a, b in zip(kernel_dims(n, k), (n, k)))  # k_pad: a multiple of g | 128
  x = x.astype(jnp.bfloat16)  # W4A16: activations enter the MMA as bf16
  if k_pad or n_pad:
    lead = ((0, 0),) * (packed.ndim - 2)
    x = jnp.pad(x, ((0, 0), (0, k_pad)))
    packed = jnp.pad(packed, lead + ((0, k_pad // 2), (0, n_pad)))
    scales = jnp.pad(scales, lead + ((0, k_pad // group_size), (0, n_pad)))
  return x, packed, scales


@functools.partial(jax.jit,
                   static_argnames=("group_size", "backend", "block_sizes", "device_kind"))
def int4_matmul(x: jax.Array, packed: jax.Array, scales: jax.Array, *,
                group_size: int, backend: str | None = None,
                block_sizes: BlockSizes | None = None,
                device_kind: str | None = None) -> jax.Array:
  """W4A16 matmul: x @ dequantize(packed, scales), f32 accumulation.

  The kernel backends round x to bf16 (W4A16) and zero-pad K to a multiple of
  128 and N to a multiple of 64 (a weight copy; real model shapes need none).

  Args:
    x: [M, K] activations (bf16; f32 is rounded to bf16 by the kernels).
    packed: [K//2, N] uint8, two int4 per byte along K (see module docstring).
    scales: [K//group_size, N] bf16 or f32.
    group_size: 32, 64 or 128.
    backend: "pallas" (Mosaic GPU), "interpret" (Mosaic GPU interpreter with
      race detection, CPU) or "xla" (the reference); None picks by platform.
    block_sizes: tiles; None uses BlockSizes.get_default for this shape.
    device_kind: whose tuned table get_default reads; None: the device the trace
      targets (``pallas_kernels.device.device_kind``).

  Returns:
    [M, N] in x's dtype.

  Raises:
    ValueError: on shape, dtype, group-size or backend mismatch.
  """
  m, k, n = reference.check_int4_args(x, packed, scales, group_size,
                                      experts=False)
  backend = resolve_backend(backend)
  if backend == "xla":
    return reference.int4_matmul_reference(x, packed, scales,
                                           group_size=group_size)
  out_dtype, n_out = x.dtype, n
  x, packed, scales = _kernel_operands(x, packed, scales, group_size)
  k, n = x.shape[1], packed.shape[-1]
  bs = (block_sizes or BlockSizes.get_default(m, n, k, device_kind=device_kind)).fit(m, n, k)
  tile_n, tile_m, tile_k = bs.tile_n, bs.tile_m, bs.tile_k
  m_pad = -(-m // tile_m) * tile_m
  x_even, x_odd = _split_even_odd(x, m_pad)
  k_steps = k // tile_k // bs.k_splits
  kernel = functools.partial(dense_kernel, pipeline=_kn_pipeline(bs, group_size, k_steps),
                             x_refs=2, tile_n=tile_n, tile_m=tile_m, k_steps=k_steps)
  out_type, o_tile = dense_out(bs, n, m_pad, out_dtype)
  out = mgpu_shim.kernel(
      kernel,
      out_type=out_type,
      grid=(n // tile_n, m_pad // tile_m, bs.k_splits),
      grid_names=("n", "m", "k"),
      kernel_name="int4_matmul",
      scratch_types=_scratch(bs, o_tile, _overlap(bs, k_steps)),
      compiler_params=compiler_params(),
      interpret=mgpu_shim.interpret_params(backend == "interpret"),
  )(x_even, x_odd, packed, scales)
  return dense_result(out, m, n_out, out_dtype)


# Token rows per SMEM tile of x: a tile's first row must be a provable multiple of
# this for Mosaic GPU to lower its TMA (layout inference fails otherwise).
_ROW_ALIGN = 8


# Jitted so that an eager call (tests, tools) compiles one program per shape instead of
# one per operation; inside a caller's jit it is inlined as before.
@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def grouped_schedule(group_sizes, m, tile_m, num_tiles):
  """Cuts each expert's rows into tiles of its own, then the rows past them.

  The segments are the E experts' rows [start_e, end_e) and a last one of the
  rows [sum(group_sizes), m), whose tiles write zeros (expert -1). A segment's
  tiles are windows of tile_m rows, the first starting at start_e rounded down
  to _ROW_ALIGN, the next ones tile_m further on; each window computes all its
  rows but stores only its segment's. So a tile streams one expert's weights,
  each row is written by exactly one tile, and every window starts on an
  aligned row. Tiles past those in use have 0 rows. num_tiles must be at least
  ``grouped_tile_bound(m, e, tile_m)``.

  Returns:
    [5, num_tiles] int32 rows: expert (-1: zeros), window start (a multiple of
    _ROW_ALIGN), offset of the segment's first row in the window, row count,
    and the number of tiles in use (repeated, read with one scalar load).
  """
  gs = group_sizes.astype(jnp.int32)
  e = gs.shape[0]
  cum = schedule.prefix_sum(gs)
  ends = jnp.minimum(cum, m)  # rows past M are never computed
  starts = jnp.minimum(cum - gs, m)
  total = ends[-1]
  starts = jnp.concatenate([starts, total[None]])  # [E + 1]: the zero rows last
  ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
  windows = starts // _ROW_ALIGN * _ROW_ALIGN
  n_tiles = segment_tiles(starts, ends, tile_m)  # [E + 1]
  tile_ends = schedule.prefix_sum(n_tiles)
  used = tile_ends[-1]
  t = jnp.arange(num_tiles, dtype=jnp.int32)
  # The tile's segment: how many segments' tiles end at or before it.
  seg = jnp.minimum(jnp.sum(tile_ends[None, :] <= t[:, None], axis=1, dtype=jnp.int32), e)
  window = windows[seg] + (t - (tile_ends[seg] - n_tiles[seg])) * tile_m
  first = jnp.maximum(starts[seg], window)
  rows = jnp.clip(jnp.minimum(ends[seg], window + tile_m) - first, 0, tile_m)
  in_use = t < used
  return jnp.stack([
      jnp.where(in_use & (seg < e), seg, -1),
      jnp.where(in_use, window, 0),
      jnp.where(in_use, first - window, 0),
      jnp.where(in_use, rows, 0),
      jnp.broadcast_to(used, (num_tiles,)),
  ]).astype(jnp.int32)


def grouped_meta(group_sizes, m: int, tile_m: int, num_tiles: int, *, interpret: bool):
  """The table the grouped kernels read: :func:`grouped_schedule`'s, in one launch.

  ``schedule_kernel.grouped_schedule_pallas`` computes it in one Pallas Triton
  program, where XLA runs grouped_schedule's three reductions and stack as four
  kernels before every grouped matmul; under the Mosaic GPU interpreter
  (``interpret``) the same kernel runs in Pallas' interpreter.

  Returns:
    [5, T >= num_tiles] int32; the tiles past num_tiles are unused ones.
  """
  return schedule_kernel.grouped_schedule_pallas(
      group_sizes.astype(jnp.int32), m=m, tile_m=tile_m, num_tiles=num_tiles,
      row_align=_ROW_ALIGN, interpret=interpret)


def grouped_x_rows(m: int, tile_m: int) -> int:
  """Rows the grouped kernels pad x to: a tile's window may start up to tile_m rows before
  M's end, so M rounded up to _ROW_ALIGN plus tile_m. The rounding keeps the TMA source's
  rows a multiple of its 8-row tiling, which M + tile_m is not when M is not a multiple of
  8 (1 or 5 rows of a batch times top-2 routing failed to lower)."""
  return -(-m // _ROW_ALIGN) * _ROW_ALIGN + tile_m


def segment_tiles(starts, ends, tile_m: int):
  """Tiles of each row segment [starts, ends) in ``grouped_schedule``: windows of
  tile_m rows from its start rounded down to _ROW_ALIGN (0 for an empty one).
  Operators only, so numpy arrays work too (the roofline sheet's design model)."""
  windows = starts // _ROW_ALIGN * _ROW_ALIGN
  return (ends > starts) * (-(-(ends - windows) // tile_m))


def grouped_tile_bound(m: int, e: int, tile_m: int) -> int:
  """Most tiles ``grouped_schedule`` can use for M rows over E experts.

  A non-empty segment (at most min(E, M) experts and the zero rows) of r rows
  takes ceil((r + a) / t) <= (r + a + t - 1) / t tiles, a < _ROW_ALIGN being
  its start's distance from the window's, so all of them together at most
  (M + (min(E, M) + 1)(t + _ROW_ALIGN - 2)) / t.
  """
  return (m + (min(e, m) + 1) * (tile_m + _ROW_ALIGN - 2)) // tile_m


def grouped_block_sizes(m: int, e: int, n: int, k: int, *, layout: str = "kn",
                        block_sizes: BlockSizes | None = None,
                        device_kind: str | None = None) -> BlockSizes:
  """The tiles a grouped call over x [M, K] and E experts' [K, N] weights (layout
  ``layout``) runs: ``block_sizes`` or the tuned default for one weight (on
  ``device_kind``, None: the one the trace targets), fitted to N and K as the kernels pad
  them (:func:`kernel_dims`)."""
  n, k = kernel_dims(n, k)
  return (block_sizes or BlockSizes.get_default(m, n, k, grouped=True, experts=e,
                                                layout=layout, device_kind=device_kind)
          ).fit(m, n, k)


def schedule_for(m: int, e: int, tile_m: int) -> schedule_kernel.GroupedSchedule:
  """The schedule a grouped call over M rows, E experts and tiles of tile_m rows reads."""
  return schedule_kernel.GroupedSchedule(m=m, experts=e, tile_m=tile_m,
                                         num_tiles=grouped_tile_bound(m, e, tile_m),
                                         row_align=_ROW_ALIGN)


def grouped_schedule_spec(m: int, e: int, n: int, k: int, *, layout: str = "kn",
                          block_sizes: BlockSizes | None = None,
                          device_kind: str | None = None) -> schedule_kernel.GroupedSchedule:
  """The schedule ``int4_grouped_matmul`` (layout "kn") or ``int4_grouped_matmul_nk``
  ("nk") reads for x [M, K] over E experts' [K, N] weights: its tile_m (the
  :func:`grouped_block_sizes` it runs) and :func:`grouped_tile_bound`'s tiles.

  A caller that computes the table ahead (``moe_router.sort_by_expert_local``'s
  ``schedule``) asks for this one and hands the table to every grouped call it matches:
  gate/up (N = F, K = D) and down (N = D, K = F) share it when their tile_m agree.
  """
  return schedule_for(m, e, grouped_block_sizes(m, e, n, k, layout=layout,
                                                block_sizes=block_sizes,
                                                device_kind=device_kind).tile_m)


def grouped_table(group_sizes, spec: schedule_kernel.GroupedSchedule, schedule, *,
                  interpret: bool):
  """The table a grouped call made for ``spec`` reads: ``schedule``'s, computed ahead
  (a :class:`schedule_kernel.ScheduleTable`), or else :func:`grouped_meta`'s (a launch).

  Raises:
    ValueError: ``schedule`` is not a ScheduleTable, was made for another M, E, tile_m,
      tile count or alignment, or holds a table of another shape or dtype: its tiles
      would be wrong for this call.
  """
  if schedule is None:
    return grouped_meta(group_sizes, spec.m, spec.tile_m, spec.num_tiles, interpret=interpret)
  if not isinstance(schedule, schedule_kernel.ScheduleTable):
    raise ValueError(f"schedule must be a ScheduleTable or None, got {type(schedule).__name__}")
  if schedule.spec != spec:
    raise ValueError(f"schedule was made for {schedule.spec}, but this call needs {spec}")
  table = schedule.table
  if table.shape != (5, spec.width) or table.dtype != jnp.int32:
    raise ValueError(f"schedule table must be int32 [5, {spec.width}], got {table.dtype} "
                     f"{table.shape}")
  return table


def _store_rows(o_smem, o_gmem, src_first, dst_first, cols, rows, *, max_rows):
  """Copies o_smem[src_first:src_first + rows] to o_gmem[dst_first:dst_first + rows, cols].

  A TMA box has a static shape, so the dynamic count is written as its binary
  digits: one copy of 2^i rows for each bit i set (as jax's ragged_dot_mgpu
  does). rows <= max_rows; every copy is in one bulk group.
  """
  offset = 0  # a Python int: a constant jnp scalar as a slice start fails to lower
  for bit in reversed(range(max_rows.bit_length())):
    size = 1 << bit
    take = (rows & size) != 0
    src = o_smem.at[pl.ds(src_first + offset, size)]
    dst = o_gmem.at[pl.ds(dst_first + offset, size), cols]

    @pl.when(take)
    def _():
      plgpu.copy_smem_to_gmem(src, dst, commit_group=False)
    offset = offset + jnp.where(take, size, 0)
  plgpu.commit_smem_to_gmem_group()


def grouped_kernel(meta_gmem, *refs, pipeline, x_refs, tile_n, tile_m, n_tiles,
                   num_ctas, weights=1):
  """Grouped kernel body (both weight layouts): a persistent CTA walks (tile, n
  tile) work items.

  meta_gmem: [5, T] int32 from grouped_meta (grouped_schedule's table); refs: the
  x_refs x operands ([grouped_x_rows(M, tile_m), ..] bf16, padded so a tile's box
  never leaves them), then ``weights`` pairs of experts' weights and scales ([E, ..],
  one shape: several projections of the same rows, e.g. gate and up), o_gmem
  [M, weights * N] (weight i's columns [i * N, (i + 1) * N); every row written by
  exactly one tile, in place), then the pipeline's scratch and the output tile
  o_smem [tile_m, tile_n]. pipeline(acc_ref, ins, work, m_block=None, n_block=,
  k_offset=0, first_row=) accumulates a tile's K steps.

  Item w is tile w // (weights * n_tiles) and output n tile w % (weights *
  n_tiles), so weight n tile // n_tiles's n tile n tile % n_tiles: neighbouring
  CTAs share a tile's token rows (read once from HBM, then from L2), over every
  weight's columns in turn. Each weight runs its own K pipeline under a
  ``pl.when``, as a TMA reads one fixed operand (docs/int4_matmul.md, "Gate and up
  in one launch").
  """
  xs, w_refs = refs[:x_refs], refs[x_refs:x_refs + 2 * weights]
  o_gmem = refs[x_refs + 2 * weights]
  work, o_smem = refs[x_refs + 2 * weights + 1:-1], refs[-1]
  cta = lax.axis_index("c")
  out_tiles = weights * n_tiles  # n tiles of the [M, weights * N] output
  work_items = meta_gmem[4, 0] * out_tiles
  trips = lax.div(jnp.maximum(work_items - cta, 0) + (num_ctas - 1), num_ctas)

  def item(i, carry):
    w = cta + i * num_ctas
    t = lax.div(w, out_tiles)
    oi = lax.rem(w, out_tiles)  # the output's n tile
    ni = lax.rem(oi, n_tiles) if weights > 1 else oi  # the weight's n tile
    expert = meta_gmem[0, t]
    # div * mul: the window start is a multiple of _ROW_ALIGN, and Mosaic GPU
    # must see it to lower the x TMAs.
    window = lax.div(meta_gmem[1, t], _ROW_ALIGN) * _ROW_ALIGN
    offset = meta_gmem[2, t]
    rows = meta_gmem[3, t]

    for wi in range(weights):
      w_gmem, s_gmem = w_refs[2 * wi], w_refs[2 * wi + 1]
      run = expert >= 0
      if weights > 1:
        run = run & (lax.div(oi, n_tiles) == wi)

      @pl.when(run)
      def _():
        def acc_scope(acc_ref):
          pipeline(acc_ref, (*xs, w_gmem.at[expert], s_gmem.at[expert]), work,
                   m_block=None, n_block=ni, k_offset=0, first_row=window)
          return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((tile_n, tile_m), jnp.float32))
        # out^T [tile_n, tile_m] in registers -> token-major rows in SMEM.
        o_smem.T[...] = acc.astype(o_smem.dtype)

    @pl.when(expert < 0)  # rows past sum(group_sizes)
    def _():
      o_smem[...] = jnp.zeros(o_smem.shape, o_smem.dtype)

    plgpu.commit_smem()
    _store_rows(o_smem, o_gmem, offset, window + offset, pl.ds(oi * tile_n, tile_n), rows,
                max_rows=tile_m)
    # The next item rewrites o_smem: its copies must have read it.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    return carry

  lax.fori_loop(0, trips, item, None)


def grouped_weights(x, packed, scales, group_sizes, group_size, check):
  """Validates a grouped call's arguments: one weight, or several of one shape.

  ``packed`` and ``scales`` are arrays (one weight) or equally long tuples of arrays
  of one shape and dtype each (several projections of the same rows, run in one
  launch: the result holds their columns side by side).

  Args:
    check: the layout's argument check (``reference.check_int4_args`` or
      ``check_int4_nk_args``), applied to the first weight.

  Returns:
    (M, K, N, E, pairs): N per weight, pairs a tuple of (packed, scales).

  Raises:
    ValueError: on any shape, dtype or count mismatch.
  """
  several = isinstance(packed, (tuple, list))
  if several != isinstance(scales, (tuple, list)):
    kinds = ["a tuple" if isinstance(a, (tuple, list)) else "an array" for a in (packed, scales)]
    raise ValueError("packed and scales must both be arrays or both tuples of arrays, got "
                     f"{kinds[0]} and {kinds[1]}")
  pairs = tuple(zip(packed, scales)) if several else ((packed, scales),)
  if several and (not pairs or len(packed) != len(scales)):
    raise ValueError(f"need as many weights as scales, at least one: got {len(packed)} "
                     f"and {len(scales)}")
  m, k, n, e = check(x, *pairs[0], group_size, experts=True)
  for p, s in pairs[1:]:
    if (p.shape, p.dtype, s.shape, s.dtype) != (pairs[0][0].shape, pairs[0][0].dtype,
                                                pairs[0][1].shape, pairs[0][1].dtype):
      raise ValueError("the weights of one grouped call must share shapes and dtypes: got "
                       f"{[(p.shape, str(p.dtype), s.shape, str(s.dtype)) for p, s in pairs]}")
  if group_sizes.shape != (e,):
    raise ValueError(f"group_sizes must be [{e}], got {group_sizes.shape}")
  return m, k, n, e, pairs


def grouped_reference(reference_fn, x, pairs, group_sizes, group_size):
  """The "xla" backend of a grouped call: each weight's reference, columns side by side."""
  outs = [reference_fn(x, p, s, group_sizes, group_size=group_size) for p, s in pairs]
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


def grouped_result(out, weights: int, n: int, out_dtype):
  """[M, weights * n] in ``out_dtype`` from the kernel's [M, weights * Np] (N padded to
  Np >= n; each weight's padded columns dropped)."""
  m, n_pad = out.shape[0], out.shape[1] // weights
  if weights > 1 and n_pad != n:
    out = out.reshape(m, weights, n_pad)[:, :, :n].reshape(m, weights * n)
  return out[:, :weights * n].astype(out_dtype)


@functools.partial(jax.jit,
                   static_argnames=("group_size", "backend", "block_sizes"))
def int4_grouped_matmul(x: jax.Array, packed, scales, group_sizes: jax.Array, *,
                        group_size: int, backend: str | None = None,
                        block_sizes: BlockSizes | None = None,
                        schedule: schedule_kernel.ScheduleTable | None = None) -> jax.Array:
  """Grouped (MoE) W4A16 matmul, like `jax.lax.ragged_dot` with int4 experts.

  Rows of x are sorted by expert: rows [sum(gs[:e]), sum(gs[:e+1])) use
  expert e. Rows past sum(group_sizes) are zero in the output.

  The kernel backends round x to bf16 (W4A16) and zero-pad K to a multiple of
  128 and N to a multiple of 64 (a weight copy; real model shapes need none).
  They run a persistent grid over the tiles in use only: each expert's rows
  are cut into tiles of their own, and each tile writes its rows of the output
  in place (docs/int4_matmul.md).

  Several weights of one shape (tuples ``packed`` and ``scales``, e.g. an expert
  FFN's gate and up) run in one launch over the same rows, schedule and block
  sizes as one of them: the work items cover every weight's n tiles, and the
  result holds their columns side by side (docs/int4_matmul.md, "Gate and up in
  one launch").

  Args:
    x: [M, K] activations (bf16; f32 is rounded to bf16 by the kernels),
      sorted by expert.
    packed: [E, K//2, N] uint8, two int4 per byte along K; or a tuple of W such
      arrays.
    scales: [E, K//group_size, N] bf16 or f32; or a tuple of W such arrays (the
      same dtype), one per weight.
    group_sizes: [E] int32, rows per expert; sum(group_sizes) <= M.
    group_size: 32, 64 or 128 (quantisation group along K).
    backend: "pallas", "interpret" or "xla"; None picks by platform.
    block_sizes: tiles (k_splits is ignored; tile_n divides N); None uses the
      tuned default for one weight, whose tile_m follows the mean rows per expert.
    schedule: the tile schedule computed ahead for these group sizes (made for
      ``grouped_schedule_spec(M, E, N, K, block_sizes=block_sizes)``, e.g. by the MoE
      sort kernel); None computes it (``grouped_meta``, a launch of its own). The
      "xla" backend ignores it.

  Returns:
    [M, N] in x's dtype; [M, W * N] for W weights (weight i in columns
    [i * N, (i + 1) * N)).

  Raises:
    ValueError: on shape, dtype, group-size, weight-count or backend mismatch, or a
      schedule made for another call.
  """
  m, k, n, e, pairs = grouped_weights(x, packed, scales, group_sizes, group_size,
                                      reference.check_int4_args)
  backend = resolve_backend(backend)
  if backend == "xla":
    return grouped_reference(reference.int4_grouped_matmul_reference, x, pairs, group_sizes,
                             group_size)
  out_dtype, n_out = x.dtype, n
  operands = [_kernel_operands(x, p, s, group_size) for p, s in pairs]
  x = operands[0][0]
  k, n = x.shape[1], operands[0][1].shape[-1]
  bs = grouped_block_sizes(m, e, n, k, block_sizes=block_sizes)
  tile_n, tile_m, tile_k = bs.tile_n, bs.tile_m, bs.tile_k
  spec = schedule_for(m, e, tile_m)
  num_tiles = spec.num_tiles
  meta = grouped_table(group_sizes, spec, schedule, interpret=backend == "interpret")
  x_even, x_odd = _split_even_odd(x, grouped_x_rows(m, tile_m))
  k_steps = k // tile_k
  n_tiles = n // tile_n
  num_ctas = min(len(pairs) * n_tiles * num_tiles,
                 bs.max_ctas or grouped_ctas(bs, group_size))
  kernel = functools.partial(grouped_kernel, pipeline=_kn_pipeline(bs, group_size, k_steps),
                             x_refs=2, tile_n=tile_n, tile_m=tile_m, n_tiles=n_tiles,
                             num_ctas=num_ctas, weights=len(pairs))
  out = mgpu_shim.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((m, len(pairs) * n), x.dtype),
      grid=(num_ctas,),
      grid_names=("c",),
      kernel_name="int4_grouped_matmul",
      scratch_types=_scratch(bs, plgpu.SMEM((tile_m, tile_n), x.dtype), _overlap(bs, k_steps)),
      compiler_params=compiler_params(),
      interpret=mgpu_shim.interpret_params(backend == "interpret"),
  )(meta, x_even, x_odd, *(a for _, p, s in operands for a in (p, s)))
  return grouped_result(out, len(pairs), n_out, out_dtype)


def grouped_ctas(bs: BlockSizes, group_size: int, layout: str = "kn") -> int:
  """The persistent grid that fills the device: SMs x the CTAs one SM holds at once.

  Layout "nk" (the [N, K] int4 kernel): ``tile_model.occupancy`` at
  NK_MODEL_REGISTERS, since registers can bind before shared memory (a
  128 x 8 x 128 tile at group 128 takes 45 KB, five by shared memory, but 128
  registers allow four; a grid of five per SM would run a fifth of its CTAs in
  a second wave). Layout "kn" (the [K/2, N] uint8 kernel): by shared memory,
  which at its 77-108 KB gives the count its 159-197 registers give.
  """
  smem = bs.smem_bytes(group_size=group_size, grouped=True, layout=layout)
  if layout == "nk":
    per_sm = tile_model.occupancy(NK_MODEL_REGISTERS, smem)
  else:
    per_sm = H200_SMEM_BYTES // smem
  return device.num_sms() * max(1, per_sm)


int4_matmul_reference = reference.int4_matmul_reference
int4_grouped_matmul_reference = reference.int4_grouped_matmul_reference
