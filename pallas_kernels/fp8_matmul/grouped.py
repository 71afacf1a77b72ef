"""Grouped (MoE) FP8 weight-only matmul for Hopper in Pallas Mosaic GPU (W8A16).

The routed experts of an FP8 checkpoint (GLM 5.2, DeepSeek-V3) hold float8_e4m3fn
values [E, K, N] with one f32 scale per 128 x 128 block. Without this kernel the
model dequantises every expert of a layer to a dense bf16 copy and runs a ragged
dot over it (``mlkit.quant.reference``), which on an H200 reads and writes each
expert's weights several times per step whether or not a token picked it.

The kernel shares the INT4 grouped kernel's schedule and persistent body
(``pallas_kernels.int4_matmul.int4_matmul``: each expert's rows cut into tiles of
their own, a persistent grid walking the tiles in use, every output row written
in place by one tile) and swaps in its own K pipeline:

* operands are swapped as in the INT4 kernels, out^T[N, M] = W^T @ x^T, so the
  weight tile fills wgmma's M dimension and the few decode rows its N dimension;
* each step TMA-loads x [tile_m, 128] (bf16) and the expert's fp8 tile [128, tile_n];
  tile_k is the scale block, so the step has one scale, read as a scalar from
  global memory, and tile_n (64 or 128) never straddles two scale columns;
* the fp8 tile is converted in 64-row register chunks (WGMMA layout; e4m3 to f32
  is exact), multiplied by the scale in f32 and rounded once to bf16 into a shared
  memory scratch, which wgmma reads with x (both operands in shared memory, as
  the Mosaic GPU interpreter needs: ``pallas_kernels.mgpu_shim``).

The rounding is the reference's (``reference.fp8_grouped_matmul_reference``):
dequantise in f32, round to bf16, accumulate in f32. docs/fp8_matmul.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import device
from pallas_kernels import dispatch
from pallas_kernels import mgpu_shim
from pallas_kernels.fp8_matmul import reference
from pallas_kernels.int4_matmul.int4_matmul import (compiler_params, grouped_kernel,
                                                    grouped_meta, grouped_tile_bound,
                                                    grouped_x_rows)
from pallas_kernels.int4_matmul.block_sizes import H200_SMEM_BYTES, BlockSizes

_TILE_K = reference.SCALE_BLOCK  # one K step per scale block
_CHUNK = 64  # rows of the fp8 tile converted per register chunk (one WGMMA-layout tile)


def _pipeline(bs: BlockSizes, k_steps: int):
  """The K pipeline ``grouped_kernel`` runs per tile: x and the fp8 tile per step,
  dequantised through the bf16 scratch, one wgmma per step."""
  tile_m, tile_n = bs.tile_m, bs.tile_n

  def run(acc_ref, ins, work, *, m_block, n_block, k_offset, first_row=None):
    del m_block, k_offset  # grouped only: rows from first_row, all of K
    x, values, scales = ins  # GMEM: x [Mx, K] bf16; this expert's [K, N] fp8, [K/128, N/128]
    (w_smem,) = work  # [128, tile_n] bf16
    col = n_block * tile_n // reference.SCALE_BLOCK  # tile_n divides 128

    def step(idx, x_smem, v_smem):
      scale = scales[idx[0], col]  # f32 scalar
      for c in range(_TILE_K // _CHUNK):
        rows = pl.ds(c * _CHUNK, _CHUNK)
        v = plgpu.load(v_smem.at[rows], layout=plgpu.Layout.WGMMA).astype(jnp.float32)
        w_smem[rows, :] = (v * scale).astype(w_smem.dtype)
      plgpu.commit_smem()  # generic-proxy stores visible to wgmma
      plgpu.wgmma(acc_ref, w_smem.T, x_smem.T)  # [tn, 128] @ [128, tm]
      plgpu.wgmma_wait(0)  # the next step rewrites the scratch

    plgpu.emit_pipeline(
        step,
        grid=(k_steps,),
        in_specs=[
            # x is padded by tile_m rows (grouped_x_rows): the box never leaves it.
            plgpu.BlockSpec((pl.Element(tile_m), _TILE_K), lambda kk: (first_row, kk),
                            oob_fill_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS),
            plgpu.BlockSpec((_TILE_K, tile_n), lambda kk: (kk, n_block)),
        ],
        max_concurrent_steps=min(bs.max_concurrent_steps, k_steps),
    )(x, values)

  return run


def smem_bytes(bs: BlockSizes) -> int:
  """Shared memory of one CTA in bytes: the pipeline's x and fp8 buffers, the bf16 scratch
  and the output tile (ptxas reports these plus 8 bytes of barrier per stage).""" 
  stages = bs.max_concurrent_steps
  per_step = bs.tile_m * _TILE_K * 2 + _TILE_K * bs.tile_n
  return stages * per_step + _TILE_K * bs.tile_n * 2 + bs.tile_m * bs.tile_n * 2


def grouped_block_sizes(m: int, n: int, k: int, experts: int,
                        device_kind: str | None = None) -> BlockSizes:
  """Tiles for M rows over ``experts`` experts of [K, N] on ``device_kind`` (None: the
  device the trace targets): the INT4 grouped kernel's tile_m and pipeline depth
  (BlockSizes.get_default: twice the mean rows per expert), tile_k the scale block, and
  tile_n 128 where N allows it, else 64."""
  base = BlockSizes.get_default(m, n, k, grouped=True, experts=experts,
                                device_kind=device_kind)
  return dataclasses.replace(base, tile_k=_TILE_K, tile_n=128 if n % 128 == 0 else 64,
                             k_splits=1, overlap_dequant=False,
                             max_concurrent_steps=min(base.max_concurrent_steps,
                                                      max(1, -(-k // _TILE_K))))


def _operands(x, values, scales):
  """x as bf16 and zero padding of K to a multiple of 128 and N of 64 (a weight copy,
  for small test models only: GLM 5.2's and DeepSeek-V3's experts are aligned). The
  scale grid is unchanged: padding stays inside the last block."""
  k, n = values.shape[1:]
  k_pad, n_pad = -(-k // _TILE_K) * _TILE_K - k, -(-n // 64) * 64 - n
  x = x.astype(jnp.bfloat16)  # W8A16: activations enter the MMA as bf16
  if k_pad or n_pad:
    x = jnp.pad(x, ((0, 0), (0, k_pad)))
    values = jnp.pad(values, ((0, 0), (0, k_pad), (0, n_pad)))
  return x, values, scales


@functools.partial(jax.jit, static_argnames=("backend", "block_sizes"))
def fp8_grouped_matmul(x: jax.Array, values: jax.Array, scales: jax.Array,
                       group_sizes: jax.Array, *, backend: str | None = None,
                       block_sizes: BlockSizes | None = None) -> jax.Array:
  """Grouped W8A16 matmul, like ``jax.lax.ragged_dot`` with block-scaled fp8 experts.

  Rows of x are sorted by expert: rows [sum(gs[:e]), sum(gs[:e+1])) use expert e;
  rows past sum(group_sizes) are zero.

  Args:
    x: [M, K] activations (rounded to bf16 by the kernel), sorted by expert.
    values: [E, K, N] float8_e4m3fn.
    scales: [E, ceil(K/128), ceil(N/128)] f32, one per 128 x 128 block.
    group_sizes: [E] integer rows per expert; sum(group_sizes) <= M.
    backend: "pallas" (Mosaic GPU), "interpret" (its interpreter with race
      detection, CPU) or "xla" (the reference); None picks by platform.
    block_sizes: tiles (tile_k must be 128, tile_n 64 or 128); None:
      :func:`grouped_block_sizes`.

  Returns:
    [M, N] in x's dtype.

  Raises:
    ValueError: on shape, dtype, tile or backend mismatch.
  """
  m, k, n, e = reference.check_fp8_args(x, values, scales, group_sizes)
  backend = dispatch.resolve_backend(backend)
  if backend == "xla":
    return reference.fp8_grouped_matmul_reference(x, values, scales, group_sizes)
  out_dtype = x.dtype
  x, values, scales = _operands(x, values, scales)
  kp, np_ = values.shape[1:]
  bs = block_sizes or grouped_block_sizes(m, np_, kp, e)
  if bs.tile_k != _TILE_K or bs.tile_n not in (64, 128) or np_ % bs.tile_n:
    raise ValueError(f"fp8_grouped_matmul: tile_k must be {_TILE_K} and tile_n 64 or 128 "
                     f"dividing N={np_}, got {bs}")
  tile_m, tile_n = bs.tile_m, bs.tile_n
  num_tiles = grouped_tile_bound(m, e, tile_m)
  meta = grouped_meta(group_sizes, m, tile_m, num_tiles, interpret=backend == "interpret")
  x = jnp.pad(x, ((0, grouped_x_rows(m, tile_m) - m), (0, 0)))
  n_tiles = np_ // tile_n
  per_sm = max(1, H200_SMEM_BYTES // smem_bytes(bs))
  num_ctas = min(n_tiles * num_tiles, bs.max_ctas or device.num_sms() * per_sm)
  kernel = functools.partial(grouped_kernel, pipeline=_pipeline(bs, kp // _TILE_K),
                             x_refs=1, tile_n=tile_n, tile_m=tile_m, n_tiles=n_tiles,
                             num_ctas=num_ctas)
  out = mgpu_shim.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((m, np_), jnp.bfloat16),
      grid=(num_ctas,),
      grid_names=("c",),
      kernel_name="fp8_grouped_matmul",
      scratch_types=[plgpu.SMEM((_TILE_K, tile_n), jnp.bfloat16),
                     plgpu.SMEM((tile_m, tile_n), jnp.bfloat16)],
      compiler_params=compiler_params(),
      interpret=mgpu_shim.interpret_params(backend == "interpret"),
  )(meta, x, values, scales)
  return out[:, :n].astype(out_dtype)

