"""INT4 matmuls on transposed, K-packed weights, dequantised in registers.

The weights are an int4 array ``w_nk [N, K]`` (experts ``[E, N, K]``): the
transpose of the dense [K, N] weight, two values per byte along K, K row 2i in
the low nibble (the same bytes as ``packed.T``, see ``to_nk``). The scales keep
their [K/g, N] layout. This is the layout in which a pipeline step's weight
tile ``[tile_n, tile_k]`` is wgmma's A operand as it stands, so:

  * the tile loads from shared memory straight into the WGMMA register layout
    and converts int4 -> bf16 with Mosaic GPU's fragmented-array conversion
    (CUTLASS's prmt / lop3 / sub.bf16x2 sequence: three instructions per pair
    of weights, where the [K/2, N] uint8 kernels spend about eight per weight
    on int32 nibble arithmetic);
  * each group's scale row (a WGMMA row vector) multiplies its columns in
    registers, one bf16x2 multiply per pair (f32 scales: in f32, then one
    rounding to bf16, as the references do);
  * wgmma reads A from those registers: no bf16 scratch, no shared-memory
    store and fence, and x enters in its own K order (the [K/2, N] kernels
    split x into even and odd columns);
  * each step's wgmma is retired before the next step converts
    (``wgmma_wait(0)``): the conversion reuses the registers a running wgmma
    reads (``_mma_step``). The x buffers are still released a step late, as
    when the wgmma was left running; the block-size tables count that buffer.

The Mosaic GPU interpreter only runs wgmma with both operands in shared
memory, so under ``backend="interpret"`` the converted tile goes through a bf16
scratch first (``pallas_kernels.mgpu_shim``); the conversion, the scales and
everything else are the same code.

Both kernels share the grids and schedules of ``int4_matmul.py`` (the dense
split-K grid, the grouped persistent grid over the tiles in use, rows written in
place); only the pipeline step differs (docs/int4_matmul.md).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mgpu_shim
from pallas_kernels.int4_matmul.int4_matmul import compiler_params
from pallas_kernels.int4_matmul.int4_matmul import dense_kernel
from pallas_kernels.int4_matmul.int4_matmul import dense_out
from pallas_kernels.int4_matmul.int4_matmul import dense_result
from pallas_kernels.int4_matmul.int4_matmul import grouped_ctas
from pallas_kernels.int4_matmul.int4_matmul import grouped_kernel
from pallas_kernels.int4_matmul.int4_matmul import grouped_block_sizes
from pallas_kernels.int4_matmul.int4_matmul import grouped_reference
from pallas_kernels.int4_matmul.int4_matmul import grouped_result
from pallas_kernels.int4_matmul.int4_matmul import grouped_table
from pallas_kernels.int4_matmul.int4_matmul import grouped_weights
from pallas_kernels.int4_matmul.int4_matmul import grouped_x_rows
from pallas_kernels.int4_matmul.int4_matmul import kernel_dims
from pallas_kernels.int4_matmul.int4_matmul import resolve_backend
from pallas_kernels.int4_matmul.int4_matmul import schedule_for
from pallas_kernels.int4_matmul import reference
from pallas_kernels.int4_matmul.block_sizes import BlockSizes
from pallas_kernels.int4_matmul.schedule_kernel import ScheduleTable


def to_nk(packed: jax.Array) -> jax.Array:
  """The [N, K] int4 layout of packed [K/2, N] uint8 weights (experts: [E, ...]).

  A one-time relayout, done when a model is prepared for the kernels (it copies
  the weights).
  """
  return jnp.swapaxes(reference.unpack_int4(packed), -1, -2).astype(jnp.int4)


def from_nk(w_nk: jax.Array) -> jax.Array:
  """Inverse of :func:`to_nk`: int4 [.., N, K] -> packed uint8 [.., K/2, N]."""
  return reference.pack_int4(jnp.swapaxes(w_nk.astype(jnp.int8), -1, -2))


def _dequant(w_s, s_s, *, group_size):
  """One step's weights, converted and scaled in registers.

  w_s: [tile_n, tile_k] int4 (SMEM); s_s: [tile_k/g, tile_n] (SMEM).
  Returns bf16 [tile_n, tile_k] in the WGMMA register layout.
  """
  tile_k = w_s.shape[1]
  w = w_s[...].astype(jnp.bfloat16)  # exact: int4 values are bf16 integers
  row = plgpu.Layout.WGMMA.reduce(1)  # one value per weight column (A row)
  parts = []
  for j in range(tile_k // group_size):
    cols = slice(j * group_size, (j + 1) * group_size)
    s = plgpu.load(s_s.at[j], layout=row)
    if s_s.dtype == jnp.bfloat16:
      # q * s needs at most 12 significant bits: the bf16 product rounds once,
      # like the f32 product rounded to bf16.
      parts.append(w[:, cols] * s[:, None])
    else:
      parts.append((w[:, cols].astype(jnp.float32) * s[:, None]).astype(jnp.bfloat16))
  return jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]


def _mma_step(x_s, w_s, s_s, acc_ref, a_smem, *, group_size):
  """Converts the step's weight tile, issues its wgmma and retires it.

  The wgmma reads its A operand (the converted tile) from registers while it runs,
  and the next step's conversion writes the same registers: PTX leaves touching them
  before a covering ``wgmma.wait_group`` undefined, and ptxas reuses them. Waiting
  for one group in flight (``wgmma_wait(1)``) let the conversion overwrite a running
  wgmma's operand: NaN on an H200, unseen by the interpreter, which runs the wgmma
  synchronously from shared memory (docs/int4_matmul.md, "On hardware"). The TMA
  loads of later steps still overlap the conversion and the MMA.
  """
  # Interpreted, through a_smem (mgpu_shim.register_operand).
  a = mgpu_shim.register_operand(_dequant(w_s, s_s, group_size=group_size), a_smem)
  plgpu.wgmma(acc_ref, a, x_s.T)  # [tn, tk] @ [tk, tm]
  plgpu.wgmma_wait(0)


def _k_pipeline(acc_ref, x, w, scales, a_smem, *, in_specs, k_steps,
                max_concurrent_steps, group_size):
  """Accumulates one output tile over k_steps K steps into acc_ref."""
  plgpu.emit_pipeline(
      lambda _, x_s, w_s, s_s: _mma_step(x_s, w_s, s_s, acc_ref, a_smem,
                                         group_size=group_size),
      grid=(k_steps,),
      in_specs=in_specs,
      max_concurrent_steps=max_concurrent_steps,
  )(x, w, scales)
  plgpu.wgmma_wait(0)


def _in_specs(tile_m, tile_n, tile_k, ng, m_block, n_block, k_offset, *,
              first_row=None):
  """x, weight and scale specs; x rows from block m_block, or from row first_row
  (a multiple of 8, see int4_matmul._in_specs). x is released a step late (see the
  module docstring)."""
  if first_row is not None:
    x_spec = plgpu.BlockSpec((pl.Element(tile_m), tile_k), lambda kk: (first_row, kk),
                             oob_fill_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS,
                             delay_release=1)
  else:
    x_spec = plgpu.BlockSpec((tile_m, tile_k), lambda kk: (m_block, kk + k_offset),
                             delay_release=1)
  return [
      x_spec,
      plgpu.BlockSpec((tile_n, tile_k), lambda kk: (n_block, kk + k_offset)),
      plgpu.BlockSpec((ng, tile_n), lambda kk: (kk + k_offset, n_block)),
  ]


def _scratch(bs: BlockSizes, o_tile, interpret):
  """The interpreter's bf16 A tile (None on a GPU: mgpu_shim.operand_scratch), then
  the output tile ``o_tile``."""
  return [mgpu_shim.operand_scratch(interpret, (bs.tile_n, bs.tile_k), jnp.bfloat16), o_tile]


def _pipeline(bs, group_size, k_steps):
  """The K pipeline of dense_kernel / grouped_kernel for this layout."""
  # delay_release needs a buffer beyond the one in use.
  mcs = max(2, min(bs.max_concurrent_steps, k_steps)) if k_steps > 1 else 1

  def run(acc_ref, ins, work, *, m_block, n_block, k_offset, first_row=None):
    x, w, scales = ins
    (a_smem,) = work
    _k_pipeline(acc_ref, x, w, scales, a_smem,
                in_specs=_in_specs(bs.tile_m, bs.tile_n, bs.tile_k,
                                   bs.tile_k // group_size, m_block, n_block, k_offset,
                                   first_row=first_row),
                k_steps=k_steps, max_concurrent_steps=mcs, group_size=group_size)
  return run


def _kernel_operands(x, w_nk, scales, group_size):
  """Casts x to bf16 and zero-pads K to a multiple of 128 and N of 64 (a weight
  copy, for small test models only; Kimi K2.6 / GLM 5.2 shapes need none)."""
  k, n = x.shape[1], w_nk.shape[-2]
  n_pad, k_pad = (a - b for a, b in zip(kernel_dims(n, k), (n, k)))
  x = x.astype(jnp.bfloat16)
  if k_pad or n_pad:
    lead = ((0, 0),) * (w_nk.ndim - 2)
    x = jnp.pad(x, ((0, 0), (0, k_pad)))
    w_nk = jnp.pad(w_nk, lead + ((0, n_pad), (0, k_pad)))
    scales = jnp.pad(scales, lead + ((0, k_pad // group_size), (0, n_pad)))
  return x, w_nk, scales


@functools.partial(jax.jit, static_argnames=("group_size", "backend", "block_sizes",
                                             "device_kind"))
def int4_matmul_nk(x: jax.Array, w_nk: jax.Array, scales: jax.Array, *,
                   group_size: int, backend: str | None = None,
                   block_sizes: BlockSizes | None = None,
                   device_kind: str | None = None) -> jax.Array:
  """W4A16 matmul on [N, K] int4 weights: x @ (w_nk.T * scales), f32 accumulation.

  Args:
    x: [M, K] activations (bf16; f32 is rounded to bf16 by the kernels).
    w_nk: [N, K] int4 (see the module docstring; ``to_nk`` converts packed weights).
    scales: [K//group_size, N] bf16 or f32.
    group_size: 32, 64 or 128.
    backend: "pallas", "interpret" or "xla" (the reference); None picks by platform.
    block_sizes: tiles (overlap_dequant is ignored: this kernel always overlaps);
      None uses BlockSizes.get_default(layout="nk") for this shape.
    device_kind: whose tuned table get_default reads; None: the device the trace
      targets (``pallas_kernels.device.device_kind``).

  Returns:
    [M, N] in x's dtype.

  Raises:
    ValueError: on shape, dtype, group-size or backend mismatch.
  """
  m, k, n = reference.check_int4_nk_args(x, w_nk, scales, group_size, experts=False)
  backend = resolve_backend(backend)
  if backend == "xla":
    return reference.int4_matmul_nk_reference(x, w_nk, scales, group_size=group_size)
  out_dtype, n_out = x.dtype, n
  x, w_nk, scales = _kernel_operands(x, w_nk, scales, group_size)
  k, n = x.shape[1], w_nk.shape[-2]
  bs = (block_sizes or BlockSizes.get_default(m, n, k, layout="nk", group_size=group_size,
                                              device_kind=device_kind)).fit(m, n, k)
  m_pad = -(-m // bs.tile_m) * bs.tile_m
  x = jnp.pad(x, ((0, m_pad - m), (0, 0)))
  k_steps = k // bs.tile_k // bs.k_splits
  interpret = mgpu_shim.interpret_params(backend == "interpret")
  run = _pipeline(bs, group_size, k_steps)
  out_type, o_tile = dense_out(bs, n, m_pad, out_dtype)
  out = mgpu_shim.kernel(
      functools.partial(dense_kernel, pipeline=run, x_refs=1, tile_n=bs.tile_n,
                        tile_m=bs.tile_m, k_steps=k_steps),
      out_type=out_type,
      grid=(n // bs.tile_n, m_pad // bs.tile_m, bs.k_splits),
      grid_names=("n", "m", "k"),
      kernel_name="int4_matmul_nk",
      scratch_types=_scratch(bs, o_tile, interpret),
      compiler_params=compiler_params(),
      interpret=interpret,
  )(x, w_nk, scales)
  return dense_result(out, m, n_out, out_dtype)


@functools.partial(jax.jit, static_argnames=("group_size", "backend", "block_sizes"))
def int4_grouped_matmul_nk(x: jax.Array, w_nk, scales, group_sizes: jax.Array, *,
                           group_size: int, backend: str | None = None,
                           block_sizes: BlockSizes | None = None,
                           schedule: ScheduleTable | None = None) -> jax.Array:
  """Grouped (MoE) W4A16 matmul on [E, N, K] int4 weights, like `lax.ragged_dot`.

  Rows of x are sorted by expert (``group_sizes`` rows each); rows past
  sum(group_sizes) are zero. The schedule is ``int4_grouped_matmul``'s: a
  persistent grid over the tiles in use, each writing its rows in place; so is
  running several weights of one shape (tuples ``w_nk`` and ``scales``) in one
  launch, their columns side by side.

  Args:
    x: [M, K] activations (bf16; f32 is rounded to bf16), sorted by expert.
    w_nk: [E, N, K] int4; or a tuple of W such arrays.
    scales: [E, K//group_size, N] bf16 or f32; or a tuple of W such arrays.
    group_sizes: [E] int32; sum(group_sizes) <= M.
    group_size: 32, 64 or 128.
    backend: "pallas", "interpret" or "xla"; None picks by platform.
    block_sizes: tiles (k_splits and overlap_dequant are ignored); None uses the
      tuned default (BlockSizes.get_default(layout="nk")) for one weight.
    schedule: the tile schedule computed ahead, made for ``grouped_schedule_spec(M, E,
      N, K, layout="nk", block_sizes=block_sizes)``; None computes it. Ignored on "xla".

  Returns:
    [M, N] in x's dtype; [M, W * N] for W weights (weight i in columns
    [i * N, (i + 1) * N)).

  Raises:
    ValueError: on shape, dtype, group-size, weight-count or backend mismatch, or a
      schedule made for another call.
  """
  m, k, n, e, pairs = grouped_weights(x, w_nk, scales, group_sizes, group_size,
                                      reference.check_int4_nk_args)
  backend = resolve_backend(backend)
  if backend == "xla":
    return grouped_reference(reference.int4_grouped_matmul_nk_reference, x, pairs,
                             group_sizes, group_size)
  out_dtype, n_out = x.dtype, n
  operands = [_kernel_operands(x, w, s, group_size) for w, s in pairs]
  x = operands[0][0]
  k, n = x.shape[1], operands[0][1].shape[-2]
  bs = grouped_block_sizes(m, e, n, k, layout="nk", block_sizes=block_sizes)
  spec = schedule_for(m, e, bs.tile_m)
  num_tiles = spec.num_tiles
  meta = grouped_table(group_sizes, spec, schedule, interpret=backend == "interpret")
  x = jnp.pad(x, ((0, grouped_x_rows(m, bs.tile_m) - m), (0, 0)))  # a tile's box stays in x
  k_steps = k // bs.tile_k
  n_tiles = n // bs.tile_n
  num_ctas = min(len(pairs) * n_tiles * num_tiles,
                 bs.max_ctas or grouped_ctas(bs, group_size, layout="nk"))
  interpret = mgpu_shim.interpret_params(backend == "interpret")
  run = _pipeline(bs, group_size, k_steps)
  out = mgpu_shim.kernel(
      functools.partial(grouped_kernel, pipeline=run, x_refs=1, tile_n=bs.tile_n,
                        tile_m=bs.tile_m, n_tiles=n_tiles, num_ctas=num_ctas,
                        weights=len(pairs)),
      out_type=jax.ShapeDtypeStruct((m, len(pairs) * n), x.dtype),
      grid=(num_ctas,),
      grid_names=("c",),
      kernel_name="int4_grouped_matmul_nk",
      scratch_types=_scratch(bs, plgpu.SMEM((bs.tile_m, bs.tile_n), x.dtype), interpret),
      compiler_params=compiler_params(),
      interpret=interpret,
  )(meta, x, *(a for _, w, s in operands for a in (w, s)))
  return grouped_result(out, len(pairs), n_out, out_dtype)
