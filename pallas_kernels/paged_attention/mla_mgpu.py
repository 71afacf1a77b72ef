"""Paged MLA decode on Pallas Mosaic GPU (Hopper): TMA page gathers + wgmma.

One CTA per (64-head block, split, request) with two compute warpgroups.
Both warpgroups compute the same [64, page] logits (QK over the full
576-wide key), and each owns half of the 512 output columns for PV: a
[64, 512] f32 accumulator would need 256 registers per thread in one
warpgroup, above Hopper's 255.

Page gather: each loop step reads the page id with a scalar GMEM load from
the block table and issues one TMA per page (latent, rope, and per-token
scales for fp8), so the gather costs no extra pass over memory.

fp8 -> f16, not bf16: the e4m3 pages are converted in shared memory to f16
because every e4m3 value is exactly representable in f16, and Mosaic GPU's
fp8 -> f16 conversion works with any ptxas while fp8 -> bf16 needs ISA >= 9.2
(refused when lowering without a GPU, DESIGN.md §3). wgmma needs equal
operand types, so the query is cast to f16 by the wrapper (exact for
|q| in [6e-5, 65504]; f16 has more mantissa than bf16). The converted page
goes to SMEM because wgmma reads its B operand only from SMEM (and the
interpreter also its A operand). Slots past a request's length are zeroed
during the conversion (on a bf16 cache, in place on the partial last page)
and their probabilities are selected to 0, so garbage (even NaN) never
leaks into the output.

Scales are folded, not applied per element: the latent/rope scales multiply
the logits' columns, and the latent scale multiplies the probabilities
before PV. Softmax statistics and accumulators are f32.

Outputs per split: o [B, S, Hp, C] f32 already divided by the split's
softmax sum, and lse [B, S, Hp] f32 (a very negative number for an empty
split); combine_lse merges them.
"""

import functools
import math

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

FP8 = jnp.float8_e4m3fn
BLOCK_H = 64  # wgmma M per warpgroup
NEG = -1e30  # finite "minus infinity" for empty splits and masked logits
_LOG2E = math.log2(math.e)
_OUT_CHUNK = 32  # columns per f32 output TMA tile (keeps the smem scratch small)


def _transforms(cols, dtype):
  bits = jnp.dtype(dtype).itemsize * 8
  swizzle = plgpu.find_swizzle(cols * bits, "rhs")
  return (plgpu.TilingTransform((8, swizzle * 8 // bits)),
          plgpu.SwizzleTransform(swizzle))


def mla_decode_mgpu(q_latent, q_rope, latent, k_rope, latent_scale,
                    k_rope_scale, block_tables, lengths, *, scale,
                    pages_per_split, num_splits, interpret=False):
  """Split-K paged MLA decode partials on Mosaic GPU.

  Args:
    q_latent: [B, Hp, C] query in the compute dtype (f16 for an fp8 cache,
      else the cache dtype); Hp a multiple of 64.
    q_rope: [B, Hp, R] same dtype.
    latent, k_rope: [N, ps, C], [N, ps, R] pages (bf16/f16 or fp8 e4m3).
    latent_scale, k_rope_scale: [N, ps] f32 or None.
    block_tables: [B, num_splits * pages_per_split] int32.
    lengths: [B] int32.
    scale: softmax scale.
    pages_per_split, num_splits: split-K partition.
    interpret: False, or a plgpu.InterpretGPUParams.

  Returns:
    (o [B, S, Hp, C] f32 normalised per split, lse [B, S, Hp] f32).
  """
  b, hp, c = q_latent.shape
  n, ps, r = k_rope.shape
  fp8 = latent.dtype == FP8
  cdt = q_latent.dtype
  half = c // 2
  if hp % BLOCK_H or c % 128 or ps % 64 or r % 64:
    raise ValueError(f"unsupported shape: heads {hp} (x64), C {c} (x128), "
                     f"page {ps} (x64), R {r} (x64)")
  if fp8 and cdt != jnp.float16:
    raise ValueError("an fp8 cache needs an f16 query (fp8 -> f16 conversion)")
  if not fp8 and latent.dtype != cdt:
    raise ValueError(f"query {cdt} and cache {latent.dtype} dtypes differ")
  s_split = num_splits
  # Register operands for P are fine on hardware; the interpreter needs SMEM.
  p_in_smem = bool(interpret)

  def kernel(ql_ref, qr_ref, lat_ref, rope_ref, ls_ref, rs_ref, bt_ref, len_ref,
             o_ref, lse_ref, scratch):
    (ql_smem, qr_smem, lat_st, rope_st, ls_st, rs_st, lat16, rope16, p_smem,
     o_smem, lse_smem, q_bar, tma_bar, conv_bar, free_bar, done_bar) = scratch
    hb = lax.axis_index("h")
    split = lax.axis_index("s")
    bi = lax.axis_index("b")
    wg = lax.axis_index("wg")
    length = len_ref[bi]
    num_pages = lax.div(length + (ps - 1), ps)
    start = split * pages_per_split
    steps = jnp.maximum(jnp.minimum(start + pages_per_split, num_pages) - start, 0)
    heads = pl.ds(hb * BLOCK_H, BLOCK_H)

    def issue(step):
      # Only used pages are read (steps stops at them); clamp so a corrupt
      # id never sends the TMA out of bounds.
      page = jnp.clip(bt_ref[bi, start + step], 0, n - 1)
      plgpu.copy_gmem_to_smem(lat_ref.at[page], lat_st, tma_bar)
      plgpu.copy_gmem_to_smem(rope_ref.at[page], rope_st, tma_bar)
      if fp8:
        plgpu.copy_gmem_to_smem(ls_ref.at[page], ls_st, tma_bar)
        plgpu.copy_gmem_to_smem(rs_ref.at[page], rs_st, tma_bar)

    @pl.when(wg == 0)
    def _():
      plgpu.copy_gmem_to_smem(ql_ref.at[bi, heads], ql_smem, q_bar)
      plgpu.copy_gmem_to_smem(qr_ref.at[bi, heads], qr_smem, q_bar)
      @pl.when(steps > 0)
      def _():
        issue(0)

    plgpu.barrier_wait(q_bar)
    cols = pl.ds(wg * half, half)

    def body(i, carry):
      acc, m_i, l_i = carry
      pos0 = (start + i) * ps
      plgpu.barrier_wait(tma_bar)
      if fp8:
        # Wait until both warpgroups finished reading lat16 (previous QK).
        @pl.when(i > 0)
        def _():
          plgpu.barrier_wait(done_bar)
        rows = plgpu.broadcasted_iota(jnp.int32, (ps, half), 0, layout=plgpu.Layout.WGMMA)
        x = lat_st[:, cols].astype(jnp.float16)
        x = jnp.where(rows + pos0 < length, x, jnp.zeros_like(x))
        lat16[:, cols] = x
        @pl.when(wg == 0)
        def _():
          rrows = plgpu.broadcasted_iota(jnp.int32, (ps, r), 0, layout=plgpu.Layout.WGMMA)
          y = rope_st[...].astype(jnp.float16)
          rope16[...] = jnp.where(rrows + pos0 < length, y, jnp.zeros_like(y))
        ls = plgpu.load(ls_st, layout=plgpu.Layout.WGMMA.reduce(0))
        rs = plgpu.load(rs_st, layout=plgpu.Layout.WGMMA.reduce(0))
        plgpu.commit_smem()
        plgpu.barrier_arrive(conv_bar)
        plgpu.barrier_arrive(free_bar)
        plgpu.barrier_wait(conv_bar)
        # The staging buffers are free: prefetch the next page during compute.
        @pl.when((wg == 0) & (i + 1 < steps))
        def _():
          plgpu.barrier_wait(free_bar)
          issue(i + 1)
        @pl.when((wg == 0) & (i + 1 >= steps))
        def _():
          plgpu.barrier_wait(free_bar)
        k_lat, k_rope = lat16, rope16
      else:
        # No conversion pass on a bf16 cache, but the tail of a request's
        # last page may hold garbage (NaN included) and p == 0 does not
        # cancel NaN in PV: zero those rows, only on that partial page.
        @pl.when(pos0 + ps > length)
        def _():
          rows = plgpu.broadcasted_iota(jnp.int32, (ps, half), 0, layout=plgpu.Layout.WGMMA)
          x = lat_st[:, cols]
          lat_st[:, cols] = jnp.where(rows + pos0 < length, x, jnp.zeros_like(x))
          plgpu.commit_smem()
          plgpu.barrier_arrive(conv_bar)
          plgpu.barrier_wait(conv_bar)
        k_lat, k_rope = lat_st, rope_st

      if fp8:
        # Separate accumulators: latent and rope carry different scales.
        def qk_lat(acc_ref):
          plgpu.wgmma(acc_ref, ql_smem, k_lat.transpose((1, 0)))
          return acc_ref[...]
        def qk_rope(acc_ref):
          plgpu.wgmma(acc_ref, qr_smem, k_rope.transpose((1, 0)))
          return acc_ref[...]
        s1 = pl.run_scoped(qk_lat, plgpu.ACC((BLOCK_H, ps), jnp.float32))
        s2 = pl.run_scoped(qk_rope, plgpu.ACC((BLOCK_H, ps), jnp.float32))
        plgpu.barrier_arrive(done_bar)
        logits = (s1 * lax.broadcast_in_dim(ls, (BLOCK_H, ps), [1])
                  + s2 * lax.broadcast_in_dim(rs, (BLOCK_H, ps), [1]))
      else:
        def qk(acc_ref):
          plgpu.wgmma(acc_ref, ql_smem, k_lat.transpose((1, 0)))
          plgpu.wgmma(acc_ref, qr_smem, k_rope.transpose((1, 0)))
          return acc_ref[...]
        logits = pl.run_scoped(qk, plgpu.ACC((BLOCK_H, ps), jnp.float32))
      logits = logits * scale
      kpos = plgpu.broadcasted_iota(jnp.int32, (BLOCK_H, ps), 1, layout=plgpu.Layout.WGMMA)
      valid = kpos + pos0 < length
      logits = jnp.where(valid, logits, NEG)
      m_new = jnp.maximum(m_i, logits.max(axis=1))
      alpha = jnp.exp2((m_i - m_new) * _LOG2E)
      p = jnp.exp2((logits - lax.broadcast_in_dim(m_new, logits.shape, [0])) * _LOG2E)
      l_new = l_i * alpha + p.sum(axis=1)
      if fp8:
        # Scales of unused slots may be garbage (NaN): select, not multiply.
        p = jnp.where(valid, p * lax.broadcast_in_dim(ls, p.shape, [1]), 0.0)
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      p16 = p.astype(cdt)
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
        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
      if not fp8:
        plgpu.barrier_arrive(free_bar)
        @pl.when(wg == 0)
        def _():
          plgpu.barrier_wait(free_bar)
          @pl.when(i + 1 < steps)
          def _():
            issue(i + 1)
      return acc, m_new, l_new

    acc0 = plgpu.layout_cast(jnp.zeros((BLOCK_H, half), jnp.float32), plgpu.Layout.WGMMA)
    m0 = plgpu.layout_cast(jnp.full((BLOCK_H,), NEG, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l0 = plgpu.layout_cast(jnp.zeros((BLOCK_H,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    acc, m_i, l_i = lax.fori_loop(0, steps, body, (acc0, m0, l0))
    if fp8:
      # Consume the last step's phase: every waiter waits on every phase.
      @pl.when(steps > 0)
      def _():
        plgpu.barrier_wait(done_bar)
    nonempty = l_i > 0
    inv = 1.0 / jnp.where(nonempty, l_i, 1.0)
    acc = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
    for j in range(half // _OUT_CHUNK):
      o_smem.at[wg][...] = acc[:, j * _OUT_CHUNK:(j + 1) * _OUT_CHUNK]
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(
          o_smem.at[wg],
          o_ref.at[bi, split, heads, pl.ds(wg * half + j * _OUT_CHUNK, _OUT_CHUNK)])
      plgpu.wait_smem_to_gmem(0)
    @pl.when(wg == 0)
    def _():
      lse_smem[...] = jnp.where(nonempty, m_i + jnp.log(jnp.where(nonempty, l_i, 1.0)), NEG)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[bi, split, heads])
      plgpu.wait_smem_to_gmem(0)

  def entry(*refs):
    in_out = refs
    st_dtype = latent.dtype
    scratch = [
        plgpu.SMEM((BLOCK_H, c), cdt, transforms=_transforms(c, cdt)),
        plgpu.SMEM((BLOCK_H, r), cdt, transforms=_transforms(r, cdt)),
        plgpu.SMEM((ps, c), st_dtype, transforms=_transforms(c, st_dtype)),
        plgpu.SMEM((ps, r), st_dtype, transforms=_transforms(r, st_dtype)),
        plgpu.SMEM((ps,), jnp.float32) if fp8 else None,
        plgpu.SMEM((ps,), jnp.float32) if fp8 else None,
        plgpu.SMEM((ps, c), cdt, transforms=_transforms(c, cdt)) if fp8 else None,
        plgpu.SMEM((ps, r), cdt, transforms=_transforms(r, cdt)) if fp8 else None,
        (plgpu.SMEM((2, BLOCK_H, ps), cdt, transforms=_transforms(ps, cdt))
         if p_in_smem else None),
        plgpu.SMEM((2, BLOCK_H, _OUT_CHUNK), jnp.float32),
        plgpu.SMEM((BLOCK_H,), jnp.float32),
    ]
    barriers = [
        # Every TMA issued with a barrier is one arrival on it.
        plgpu.Barrier(num_arrivals=2),  # q_latent and q_rope loaded
        plgpu.Barrier(num_arrivals=4 if fp8 else 2),  # one page's copies landed
        plgpu.Barrier(num_arrivals=2),  # fp8 page converted by both WGs
        plgpu.Barrier(num_arrivals=2),  # staging buffer free
        plgpu.Barrier(num_arrivals=2),  # both WGs done reading lat16
    ]
    pl.run_scoped(lambda *s: kernel(*in_out, s), *scratch, *barriers,
                  collective_axes="wg")

  out_type = (jax.ShapeDtypeStruct((b, s_split, hp, c), jnp.float32),
              jax.ShapeDtypeStruct((b, s_split, hp), jnp.float32))
  kwargs = dict(interpret=interpret) if interpret else {}
  return plgpu.kernel(
      entry,
      out_type=out_type,
      grid=(hp // BLOCK_H, s_split, b),
      grid_names=("h", "s", "b"),
      num_threads=2,
      thread_name="wg",
      kernel_name="paged_mla_decode_mgpu",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      **kwargs,
  )(q_latent, q_rope, latent, k_rope, latent_scale, k_rope_scale,
    block_tables, lengths)
