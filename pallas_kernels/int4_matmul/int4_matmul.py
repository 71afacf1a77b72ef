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
interpreter needs (both wgmma operands in SMEM) and keeps one code path.
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
  * the grouped kernel's tokens are the minor (column) axis of out^T, and a TMA
    store needs a static box whose minor extent is at least 16 bytes, so a tile
    cannot store just its expert's dynamic column range. It writes a full
    [tile_n, tile_m] slab with the other columns zeroed, and the wrapper sums
    the slabs of each token block (segment_sum; exactly one nonzero term).

Performance notes (not yet measured on a GPU):
  * The wrapper adds XLA ops around each kernel: the even/odd split of x (fuses
    into x's producer inside a model), and the split-K sum, transpose and cast
    of the output (one small fusion for decode shapes).
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

from pallas_kernels import dispatch
from pallas_kernels.int4_matmul import reference
from pallas_kernels.int4_matmul.block_sizes import BlockSizes

# One register chunk of packed rows: the WGMMA register layout is 64 rows tall.
_CHUNK = 64

BACKENDS = dispatch.BACKENDS
resolve_backend = dispatch.resolve_backend


def _interpret_params(backend: str):
  if backend == "interpret":
    # NaN-filled fresh buffers poison any output element the kernel skips.
    return plgpu.InterpretGPUParams(detect_races=True,
                                    uninitialized_memory="nan")
  return None


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


def _mma_step(xe_smem, xo_smem, p_smem, s_smem, wlo_smem, whi_smem, acc_ref, *,
              tile_n, tile_k, group_size):
  # The previous step's wgmmas read the scratches; they completed at its
  # wgmma_wait, so overwriting them here is safe.
  _dequant_tile(p_smem, s_smem, wlo_smem, whi_smem, tile_n=tile_n,
                tile_k=tile_k, group_size=group_size)
  plgpu.commit_smem()  # make generic-proxy SMEM stores visible to wgmma
  plgpu.wgmma(acc_ref, wlo_smem.T, xe_smem.T)  # [tn, tk/2] @ [tk/2, tm]
  plgpu.wgmma(acc_ref, whi_smem.T, xo_smem.T)
  plgpu.wgmma_wait(0)


def _in_specs(tile_m, tile_n, tile_k, ng, m_block, n_block, k_offset):
  tkh = tile_k // 2
  return [
      plgpu.BlockSpec((tile_m, tkh), lambda kk: (m_block, kk + k_offset)),
      plgpu.BlockSpec((tile_m, tkh), lambda kk: (m_block, kk + k_offset)),
      plgpu.BlockSpec((tkh, tile_n), lambda kk: (kk + k_offset, n_block)),
      plgpu.BlockSpec((ng, tile_n), lambda kk: (kk + k_offset, n_block)),
  ]


def _int4_matmul_kernel(xe_gmem, xo_gmem, p_gmem, s_gmem, o_gmem,
                        wlo_smem, whi_smem, o_smem, *, group_size, tile_n,
                        tile_m, tile_k, k_steps, max_concurrent_steps):
  """Dense kernel body: one CTA computes o[split, n tile, m tile] (f32).

  xe/xo_gmem: [Mp, K/2] bf16 even/odd columns of x; p_gmem: [K/2, N] uint8;
  s_gmem: [K/g, N]; o_gmem: [k_splits, N, Mp] f32 partial sums of out^T.
  """
  ni = lax.axis_index("n")
  mi = lax.axis_index("m")
  si = lax.axis_index("k")
  ng = tile_k // group_size

  def acc_scope(acc_ref):
    step = functools.partial(_mma_step, tile_n=tile_n, tile_k=tile_k,
                             group_size=group_size)
    plgpu.emit_pipeline(
        lambda _, xe, xo, p, s: step(xe, xo, p, s, wlo_smem, whi_smem, acc_ref),
        grid=(k_steps,),
        in_specs=_in_specs(tile_m, tile_n, tile_k, ng, mi, ni, si * k_steps),
        max_concurrent_steps=max_concurrent_steps,
    )(xe_gmem, xo_gmem, p_gmem, s_gmem)
    return acc_ref[...]

  acc = pl.run_scoped(acc_scope, plgpu.ACC((tile_n, tile_m), jnp.float32))
  o_smem[...] = acc
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(
      o_smem, o_gmem.at[si, pl.ds(ni * tile_n, tile_n), pl.ds(mi * tile_m, tile_m)])
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _split_even_odd(x, m_pad):
  x = jnp.pad(x, ((0, m_pad - x.shape[0]), (0, 0)))
  return x[:, 0::2], x[:, 1::2]  # [Mp, K/2] each


def _compiler_params():
  return plgpu.CompilerParams(
      lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


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
  k_pad = -(-k // 128) * 128 - k  # a multiple of group_size, since g | 128
  n_pad = -(-n // 64) * 64 - n
  x = x.astype(jnp.bfloat16)  # W4A16: activations enter the MMA as bf16
  if k_pad or n_pad:
    lead = ((0, 0),) * (packed.ndim - 2)
    x = jnp.pad(x, ((0, 0), (0, k_pad)))
    packed = jnp.pad(packed, lead + ((0, k_pad // 2), (0, n_pad)))
    scales = jnp.pad(scales, lead + ((0, k_pad // group_size), (0, n_pad)))
  return x, packed, scales


@functools.partial(jax.jit,
                   static_argnames=("group_size", "backend", "block_sizes"))
def int4_matmul(x: jax.Array, packed: jax.Array, scales: jax.Array, *,
                group_size: int, backend: str | None = None,
                block_sizes: BlockSizes | None = None) -> jax.Array:
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
  bs = (block_sizes or BlockSizes.get_default(m, n, k)).fit(m, n, k)
  tile_n, tile_m, tile_k = bs.tile_n, bs.tile_m, bs.tile_k
  m_pad = -(-m // tile_m) * tile_m
  x_even, x_odd = _split_even_odd(x, m_pad)
  k_steps = k // tile_k // bs.k_splits
  kernel = functools.partial(
      _int4_matmul_kernel, group_size=group_size, tile_n=tile_n, tile_m=tile_m,
      tile_k=tile_k, k_steps=k_steps,
      max_concurrent_steps=min(bs.max_concurrent_steps, k_steps))
  tkh = tile_k // 2
  out_t = plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((bs.k_splits, n, m_pad), jnp.float32),
      grid=(n // tile_n, m_pad // tile_m, bs.k_splits),
      grid_names=("n", "m", "k"),
      kernel_name="int4_matmul",
      scratch_types=[
          plgpu.SMEM((tkh, tile_n), jnp.bfloat16),
          plgpu.SMEM((tkh, tile_n), jnp.bfloat16),
          plgpu.SMEM((tile_n, tile_m), jnp.float32),
      ],
      compiler_params=_compiler_params(),
      interpret=_interpret_params(backend),
  )(x_even, x_odd, packed, scales)
  # [k_splits, N, Mp] -> [M, N]; the split-K sum stays in f32.
  return out_t.sum(axis=0)[:n_out, :m].T.astype(out_dtype)


def _prefix_sum(x):
  """Inclusive prefix sum of a short [E] vector as one masked [E, E] reduction.

  E is the experts on one device (tens), so this is one small fusion; XLA's GPU
  cumsum (a reduce-window) and searchsorted (a while loop) add several kernels
  per MoE layer and seconds of compile time.
  """
  i = lax.broadcasted_iota(jnp.int32, (x.shape[0], x.shape[0]), 0)
  j = lax.broadcasted_iota(jnp.int32, (x.shape[0], x.shape[0]), 1)
  return jnp.sum(jnp.where(j <= i, x[None, :], 0), axis=1, dtype=x.dtype)


def _grouped_schedule(group_sizes, m, tile_m, num_tiles):
  """Maps each scheduled tile to (expert, token block, first row, end row).

  Tile t covers rows [block*tile_m + lo, block*tile_m + hi) of expert e; a token
  block split between experts gets one tile per expert. Tiles past the last one
  in use get block = cdiv(m, tile_m) (dropped by the wrapper's slab sum) and
  lo = hi = 0 (skipped by the kernel). Empty experts get no tile.

  Returns:
    [4, num_tiles] int32: rows expert, block, lo, hi.
  """
  m_tiles = -(-m // tile_m)
  gs = group_sizes.astype(jnp.int32)
  ends = jnp.minimum(_prefix_sum(gs), m)  # rows past M are never computed
  starts = jnp.minimum(ends - gs, m)
  first = starts // tile_m
  last = (ends - 1) // tile_m
  n_tiles = jnp.where(ends > starts, last - first + 1, 0)
  tile_ends = _prefix_sum(n_tiles)
  tile_starts = tile_ends - n_tiles
  t = jnp.arange(num_tiles, dtype=jnp.int32)
  # The tile's expert: how many experts' tiles end at or before it.
  e = jnp.minimum(jnp.sum(tile_ends[None, :] <= t[:, None], axis=1, dtype=jnp.int32),
                  gs.shape[0] - 1)
  valid = t < tile_ends[-1]
  block = first[e] + t - tile_starts[e]
  lo = jnp.clip(starts[e] - block * tile_m, 0, tile_m)
  hi = jnp.clip(ends[e] - block * tile_m, 0, tile_m)
  return jnp.stack([
      jnp.where(valid, e, 0),
      jnp.where(valid, block, m_tiles),
      jnp.where(valid, lo, 0),
      jnp.where(valid, hi, 0),
  ]).astype(jnp.int32)


def _sum_block_slabs(slabs, block, m_tiles):
  """Sums the slabs of each token block: [T, N, tile_m] -> [m_tiles, N, tile_m].

  Tiles are ordered by block (unused trailing tiles, never written, carry block
  m_tiles and are dropped); each output element has exactly one nonzero
  contributor, so the sum is exact in the slabs' dtype. The first slab of each
  block is gathered and the block's other slabs are added onto it. A
  segment_sum would scatter into a zero-initialised [m_tiles, N, tile_m]
  buffer instead, and XLA merges such identical zero buffers across a model's
  layers and hoists every layer's copy to the start of the program, so a
  prefill step would hold one per MoE layer at once.
  """
  num_tiles = slabs.shape[0]
  b = jnp.arange(m_tiles, dtype=jnp.int32)
  first = jnp.sum(block[None, :] < b[:, None], axis=1, dtype=jnp.int32)  # [m_tiles]
  f = jnp.minimum(first, num_tiles - 1)
  has = (first < num_tiles) & (block[f] == b)
  init = jnp.where(has[:, None, None], slabs[f], jnp.zeros((), slabs.dtype))
  t = jnp.arange(num_tiles, dtype=jnp.int32)
  is_first = (t == 0) | (block != jnp.roll(block, 1))
  rest = jnp.where(is_first, m_tiles, block)  # first slabs are already in init
  return init.at[rest].add(slabs, mode="drop")


def _int4_grouped_matmul_kernel(meta_gmem, xe_gmem, xo_gmem, p_gmem, s_gmem,
                                o_gmem, wlo_smem, whi_smem, o_smem, *,
                                group_size, tile_n, tile_m, tile_k, k_steps,
                                max_concurrent_steps):
  """Grouped kernel body: one CTA computes one (n tile, scheduled tile) slab.

  meta_gmem: [4, T] int32 from _grouped_schedule; xe/xo_gmem: [Mp, K/2] bf16;
  p_gmem: [E, K/2, N] uint8; s_gmem: [E, K/g, N]; o_gmem: [T, N, tile_m] with
  the token columns outside [lo, hi) of the tile zeroed.
  """
  ni = lax.axis_index("n")
  ti = lax.axis_index("t")
  expert = meta_gmem[0, ti]
  block = meta_gmem[1, ti]
  lo = meta_gmem[2, ti]
  hi = meta_gmem[3, ti]
  ng = tile_k // group_size

  @pl.when(hi > lo)
  def _():
    def acc_scope(acc_ref):
      step = functools.partial(_mma_step, tile_n=tile_n, tile_k=tile_k,
                               group_size=group_size)
      plgpu.emit_pipeline(
          lambda _, xe, xo, p, s: step(xe, xo, p, s, wlo_smem, whi_smem,
                                       acc_ref),
          grid=(k_steps,),
          in_specs=_in_specs(tile_m, tile_n, tile_k, ng, block, ni, 0),
          max_concurrent_steps=max_concurrent_steps,
      )(xe_gmem, xo_gmem, p_gmem.at[expert], s_gmem.at[expert])
      return acc_ref[...]

    acc = pl.run_scoped(acc_scope, plgpu.ACC((tile_n, tile_m), jnp.float32))
    # Token block rows owned by another expert (or past sum(group_sizes)) are
    # zeroed so the wrapper can sum the slabs of one token block.
    col = lax.broadcasted_iota(jnp.int32, (tile_n, tile_m), 1)
    acc = jnp.where((col >= lo) & (col < hi), acc, 0.0)
    o_smem[...] = acc.astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[ti, pl.ds(ni * tile_n, tile_n)])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@functools.partial(jax.jit,
                   static_argnames=("group_size", "backend", "block_sizes"))
def int4_grouped_matmul(x: jax.Array, packed: jax.Array, scales: jax.Array,
                        group_sizes: jax.Array, *, group_size: int,
                        backend: str | None = None,
                        block_sizes: BlockSizes | None = None) -> jax.Array:
  """Grouped (MoE) W4A16 matmul, like `jax.lax.ragged_dot` with int4 experts.

  Rows of x are sorted by expert: rows [sum(gs[:e]), sum(gs[:e+1])) use
  expert e. Rows past sum(group_sizes) are zero in the output.

  The kernel backends round x to bf16 (W4A16) and zero-pad K to a multiple of
  128 and N to a multiple of 64 (a weight copy; real model shapes need none).

  Args:
    x: [M, K] activations (bf16; f32 is rounded to bf16 by the kernels),
      sorted by expert.
    packed: [E, K//2, N] uint8, two int4 per byte along K.
    scales: [E, K//group_size, N] bf16 or f32.
    group_sizes: [E] int32, rows per expert; sum(group_sizes) <= M.
    group_size: 32, 64 or 128 (quantisation group along K).
    backend: "pallas", "interpret" or "xla"; None picks by platform.
    block_sizes: tiles (k_splits is ignored); None uses the tuned default.

  Returns:
    [M, N] in x's dtype.

  Raises:
    ValueError: on shape, dtype, group-size or backend mismatch.
  """
  m, k, n, e = reference.check_int4_args(x, packed, scales, group_size,
                                         experts=True)
  if group_sizes.shape != (e,):
    raise ValueError(f"group_sizes must be [{e}], got {group_sizes.shape}")
  backend = resolve_backend(backend)
  if backend == "xla":
    return reference.int4_grouped_matmul_reference(
        x, packed, scales, group_sizes, group_size=group_size)
  out_dtype, n_out = x.dtype, n
  x, packed, scales = _kernel_operands(x, packed, scales, group_size)
  k, n = x.shape[1], packed.shape[-1]
  bs = (block_sizes or BlockSizes.get_default(m, n, k, grouped=True)).fit(
      m, n, k)
  tile_n, tile_m, tile_k = bs.tile_n, bs.tile_m, bs.tile_k
  m_tiles = -(-m // tile_m)
  m_pad = m_tiles * tile_m
  # Each expert boundary inside a token block adds at most one tile.
  num_tiles = m_tiles + e - 1
  meta = _grouped_schedule(group_sizes, m, tile_m, num_tiles)
  x_even, x_odd = _split_even_odd(x, m_pad)
  k_steps = k // tile_k
  kernel = functools.partial(
      _int4_grouped_matmul_kernel, group_size=group_size, tile_n=tile_n,
      tile_m=tile_m, tile_k=tile_k, k_steps=k_steps,
      max_concurrent_steps=min(bs.max_concurrent_steps, k_steps))
  tkh = tile_k // 2
  slabs = plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((num_tiles, n, tile_m), x.dtype),
      grid=(n // tile_n, num_tiles),
      grid_names=("n", "t"),
      kernel_name="int4_grouped_matmul",
      scratch_types=[
          plgpu.SMEM((tkh, tile_n), jnp.bfloat16),
          plgpu.SMEM((tkh, tile_n), jnp.bfloat16),
          plgpu.SMEM((tile_n, tile_m), x.dtype),
      ],
      compiler_params=_compiler_params(),
      interpret=_interpret_params(backend),
  )(meta, x_even, x_odd, packed, scales)
  out_t = _sum_block_slabs(slabs, meta[1], m_tiles)
  out = out_t.transpose(0, 2, 1).reshape(m_pad, n)  # [Mp, Np]
  return out[:m, :n_out].astype(out_dtype)


int4_matmul_reference = reference.int4_matmul_reference
int4_grouped_matmul_reference = reference.int4_grouped_matmul_reference
