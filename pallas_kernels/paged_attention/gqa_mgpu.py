"""Paged GQA decode on Pallas Mosaic GPU (Hopper): TMA page gathers + wgmma.

One CTA (one warpgroup) per (KV head, piece), a piece being a run of one
request's 64-token blocks from the same balanced schedule as mla_mgpu
(``schedule.schedule_pieces``, in blocks). The query group of
that KV head (1..16 heads) is padded to wgmma's M = 64 rows: decode GQA is
bandwidth-bound (~64 flop/byte even padded, under the H200's ~180), so the
idle MMA rows cost no time, and K/V are read once per group.

Each step gathers `64 // page_size` pages (64 tokens) with one TMA per page
and tensor (K, V, and for fp8 the [page, KV] scale rows), driven by scalar
block-table reads from GMEM. The pages land in two staging slots used in
turn: block i+1's TMAs are issued at the top of step i, into the slot block
i-1 finished reading (its PV for a bf16 cache, read in place; its conversion
for fp8), so the gather overlaps this block's conversion, QK, softmax and PV.
With producer=True (BlockSizes.gqa_loads, opt-in) a second, memory warpgroup
issues the gathers instead, into PRODUCER_SLOTS slots, each once the compute
warpgroup arrives on its barrier; the CTA then runs alone on its SM
(docs/paged_attention.md weighs the two).

fp8: e4m3 -> f16 (exact; works with any ptxas, while fp8 -> bf16 needs ISA
>= 9.2, docs/paged_attention.md) in a conversion pass through SMEM, because wgmma reads
B only from SMEM. The per-(token, head) scale is applied inside that pass:
the values are in registers anyway, and a K scale folded into the logits
would need a per-column vector that the [page, KV] scale layout (head
minor) cannot be TMA'd into. Rows past the length are zeroed in the same
pass (bf16: in place, on the partial block only), so garbage, even NaN,
never reaches the output. The f16 query comes with per-row power-of-two
factors (ops.f16_query), multiplied into the logits with the softmax scale,
so no query value overflows f16.

Outputs per piece: o [G, KV, 64, hd] f32 normalised by the piece's softmax
sum, lse [G, KV, 64] f32; merge_pieces.py merges each request's.
"""

import math

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mgpu_shim
from pallas_kernels.paged_attention import merge_pieces_mgpu
from pallas_kernels.paged_attention import producer as producer_loop

FP8 = jnp.float8_e4m3fn
# Staging slots with a producer warpgroup (producer=True): its CTA of two
# warpgroups runs alone on its SM (a producer costs the second CTA per SM,
# docs/paged_attention.md), so shared memory has room for more blocks in flight.
PRODUCER_SLOTS = 4
BLOCK_H = 64  # wgmma M
BLOCK_K = 64  # tokens per step
NEG = -1e30
_LOG2E = math.log2(math.e)
_OUT_CHUNK = 32


def _transforms(cols, dtype):
  bits = jnp.dtype(dtype).itemsize * 8
  swizzle = plgpu.find_swizzle(cols * bits, "rhs")
  return (plgpu.TilingTransform((8, swizzle * 8 // bits)),
          plgpu.SwizzleTransform(swizzle))


def gqa_decode_mgpu(q, q_scale, k, v, k_scale, v_scale, block_tables, lengths,
                    pieces, *, scale, producer=False, interpret=False):
  """Paged GQA decode partials over a balanced schedule of pieces, on Mosaic GPU.

  Args:
    q: [B, KV, 64, hd] query groups padded to 64 rows, in the compute dtype
      (f16 for an fp8 cache, divided by q_scale; else the cache dtype).
    q_scale: [B, KV, 64] f32 per-row factors of an fp8 cache's f16 query
      (``ops.f16_query``: no f16 overflow), or None for a bf16/f16 cache.
    k, v: [N, ps, KV, hd] pages (bf16/f16 or fp8 e4m3); 64 % ps == 0.
    k_scale, v_scale: [N, ps, KV] f32 or None; KV % 8 == 0 when given.
    block_tables: [B, P] int32, P a multiple of 64 // ps.
    lengths: [B] int32.
    pieces: [5, G] int32 from ``schedule.schedule_pieces`` in units of 64-token
      blocks (rows 0-2 read: request, first block, blocks).
    scale: softmax scale.
    producer: issue the query and block gathers from a second, memory
      warpgroup into PRODUCER_SLOTS slots (one CTA per SM; size the pieces
      for that) instead of from the compute warpgroup into two.
    interpret: False, or a plgpu.InterpretGPUParams.

  Returns:
    (o [G, KV, 64, hd] f32 normalised per piece, lse [G, KV, 64] f32).
  """
  b, nkv, bh, hd = q.shape
  n, ps, _, _ = k.shape
  fp8 = k.dtype == FP8
  cdt = q.dtype
  ppb = BLOCK_K // ps
  num_g = pieces.shape[1]
  if bh != BLOCK_H or hd % 64 or BLOCK_K % ps or block_tables.shape[1] % ppb:
    raise ValueError(f"unsupported shape: q {q.shape}, page_size {ps}, "
                     f"block table width {block_tables.shape[1]}")
  if fp8 and (cdt != jnp.float16 or nkv % 8 or q_scale is None
              or q_scale.shape != q.shape[:3]):
    raise ValueError("an fp8 cache needs an f16 query, its [B, KV, 64] q_scale "
                     "(ops.f16_query) and KV % 8 == 0")
  # Staging slots, used in turn (module docstring): two at two CTAs per SM; with
  # a producer, one CTA per SM and PRODUCER_SLOTS.
  slots = PRODUCER_SLOTS if producer else 2

  def kernel(q_ref, qs_ref, k_ref, v_ref, ks_ref, vs_ref, bt_ref, len_ref, pc_ref,
             o_ref, lse_ref, scratch):
    (q_smem, qs_smem, k_st, v_st, ks_st, vs_st, k16, v16, p_smem, o_smem,
     lse_smem, q_bar, tma_bar, free_bar) = scratch
    merge_pieces_mgpu.let_merge_launch(interpret)
    kvh = lax.axis_index("kv")
    piece = lax.axis_index("s")
    # An unused piece (request -1) runs no step and writes an empty partial.
    bi = jnp.maximum(pc_ref[0, piece], 0)
    start = pc_ref[1, piece] * ppb  # in pages
    steps = pc_ref[2, piece]  # in blocks of ppb pages
    length = len_ref[bi]
    num_pages = lax.div(length + (ps - 1), ps)
    def issue(step):
      slot = lax.rem(step, slots)
      k_dst, v_dst = k_st.at[slot], v_st.at[slot]
      bar = tma_bar.at[slot]
      for j in range(ppb):
        idx = start + step * ppb + j
        # Entries past the used pages may be PAD_PAGE (-1): read page 0
        # instead (masked), and clamp used ids, so a TMA never goes OOB.
        page = jnp.where(idx < num_pages,
                         jnp.clip(bt_ref[bi, idx], 0, n - 1), 0)
        rows = pl.ds(j * ps, ps)
        plgpu.copy_gmem_to_smem(k_ref.at[page, :, kvh], k_dst.at[rows], bar)
        plgpu.copy_gmem_to_smem(v_ref.at[page, :, kvh], v_dst.at[rows], bar)
        if fp8:
          plgpu.copy_gmem_to_smem(ks_ref.at[page], ks_st.at[slot, rows], bar)
          plgpu.copy_gmem_to_smem(vs_ref.at[page], vs_st.at[slot, rows], bar)

    def load_query():
      plgpu.copy_gmem_to_smem(q_ref.at[bi, kvh], q_smem, q_bar)
      if fp8:
        plgpu.copy_gmem_to_smem(qs_ref.at[bi, kvh], qs_smem, q_bar)

    producer_loop.start_loads(producer, steps, slots, free_bar, load_query, issue,
                              prologue=1)

    def compute():
      plgpu.barrier_wait(q_bar)
      # The softmax scale, times the f16 query's row factors for an fp8 cache.
      row = plgpu.Layout.WGMMA.reduce(1)
      row_scale = (plgpu.load(qs_smem, layout=row) * scale if fp8
                   else plgpu.layout_cast(jnp.full((BLOCK_H,), scale, jnp.float32), row))

      def head_scale(ref):
        """[64 tokens] scales of this KV head, as a per-row vector."""
        x = plgpu.load(ref, layout=plgpu.Layout.WGMMA, optimized=False)  # [64, KV]
        col = plgpu.broadcasted_iota(jnp.int32, x.shape, 1, layout=plgpu.Layout.WGMMA)
        return jnp.sum(jnp.where(col == kvh, x, 0.0), axis=1)

      def body(i, carry):
        acc, m_i, l_i = carry
        pos0 = (start + i * ppb) * ps
        slot = lax.rem(i, slots)
        k_in, v_in = k_st.at[slot], v_st.at[slot]
        # The other slot's last reader was block i-1: its conversion (fp8, followed
        # by a commit_smem fence) or its PV (bf16, retired by wgmma_wait(0) at the
        # end of its step). Refill it now, so this block's work overlaps the gather
        # (a producer does that once this warpgroup arrives on free_bar).
        if not producer:
          @pl.when(i + 1 < steps)
          def _():
            issue(i + 1)
        plgpu.barrier_wait(tma_bar.at[slot])
        rows = plgpu.broadcasted_iota(jnp.int32, (BLOCK_K, hd), 0, layout=plgpu.Layout.WGMMA)
        row_ok = rows + pos0 < length
        if fp8:
          # One tensor at a time: K's f32 tile and scales are dead before V's
          # are loaded (ptxas 13.0, sm_90a: 220 registers with one staging slot,
          # 240 with two, against 255 when both tiles were converted together).
          for src, scales, dst in ((k_in, ks_st.at[slot], k16), (v_in, vs_st.at[slot], v16)):
            s = lax.broadcast_in_dim(head_scale(scales), (BLOCK_K, hd), [0])
            x = src[...].astype(jnp.float32) * s
            dst[...] = jnp.where(row_ok, x, 0.0).astype(cdt)
          plgpu.commit_smem()
          if producer:
            plgpu.barrier_arrive(free_bar.at[slot])  # converted: the slot is free
          kk, vv = k16, v16
        else:
          @pl.when(pos0 + BLOCK_K > length)
          def _():
            x = v_in[...]
            v_in[...] = jnp.where(row_ok, x, jnp.zeros_like(x))
            plgpu.commit_smem()
          kk, vv = k_in, v_in

        def qk(acc_ref):
          plgpu.wgmma(acc_ref, q_smem, kk.transpose((1, 0)))
          return acc_ref[...]
        logits = pl.run_scoped(qk, plgpu.ACC((BLOCK_H, BLOCK_K), jnp.float32))
        logits = logits * lax.broadcast_in_dim(row_scale, logits.shape, [0])
        kpos = plgpu.broadcasted_iota(jnp.int32, (BLOCK_H, BLOCK_K), 1, layout=plgpu.Layout.WGMMA)
        valid = kpos + pos0 < length
        logits = jnp.where(valid, logits, NEG)
        m_new = jnp.maximum(m_i, logits.max(axis=1))
        alpha = jnp.exp2((m_i - m_new) * _LOG2E)
        p = jnp.exp2((logits - lax.broadcast_in_dim(m_new, logits.shape, [0])) * _LOG2E)
        p = jnp.where(valid, p, 0.0)
        l_new = l_i * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        p_op = mgpu_shim.register_operand(p.astype(cdt), p_smem)
        acc = mgpu_shim.accumulate(acc, lambda acc_ref: plgpu.wgmma(acc_ref, p_op, vv),
                                   interpret)
        if not fp8:
          plgpu.wgmma_wait(0)  # PV has read this slot: step i+1 may refill it
          if producer:
            plgpu.barrier_arrive(free_bar.at[slot])
        return acc, m_new, l_new

      acc0 = plgpu.layout_cast(jnp.zeros((BLOCK_H, hd), jnp.float32), plgpu.Layout.WGMMA)
      m0 = plgpu.layout_cast(jnp.full((BLOCK_H,), NEG, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
      l0 = plgpu.layout_cast(jnp.zeros((BLOCK_H,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
      acc, m_i, l_i = lax.fori_loop(0, steps, body, (acc0, m0, l0))
      nonempty = l_i > 0
      inv = 1.0 / jnp.where(nonempty, l_i, 1.0)
      acc = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
      for j in range(hd // _OUT_CHUNK):
        o_smem[...] = acc[:, j * _OUT_CHUNK:(j + 1) * _OUT_CHUNK]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            o_smem, o_ref.at[piece, kvh, :, pl.ds(j * _OUT_CHUNK, _OUT_CHUNK)])
        plgpu.wait_smem_to_gmem(0)
      lse_smem[...] = jnp.where(nonempty, m_i + jnp.log(jnp.where(nonempty, l_i, 1.0)), NEG)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[piece, kvh])
      plgpu.wait_smem_to_gmem(0)

    producer_loop.run_compute(producer, compute)

  def entry(*refs):
    st = k.dtype
    scratch = [
        plgpu.SMEM((BLOCK_H, hd), cdt, transforms=_transforms(hd, cdt)),
        plgpu.SMEM((BLOCK_H,), jnp.float32) if fp8 else None,
        plgpu.SMEM((slots, BLOCK_K, hd), st, transforms=_transforms(hd, st)),
        plgpu.SMEM((slots, BLOCK_K, hd), st, transforms=_transforms(hd, st)),
        plgpu.SMEM((slots, BLOCK_K, nkv), jnp.float32) if fp8 else None,
        plgpu.SMEM((slots, BLOCK_K, nkv), jnp.float32) if fp8 else None,
        plgpu.SMEM((BLOCK_K, hd), cdt, transforms=_transforms(hd, cdt)) if fp8 else None,
        plgpu.SMEM((BLOCK_K, hd), cdt, transforms=_transforms(hd, cdt)) if fp8 else None,
        mgpu_shim.operand_scratch(interpret, (BLOCK_H, BLOCK_K), cdt,
                                  _transforms(BLOCK_K, cdt)),
        plgpu.SMEM((BLOCK_H, _OUT_CHUNK), jnp.float32),
        plgpu.SMEM((BLOCK_H,), jnp.float32),
    ]
    barriers = [
        plgpu.Barrier(num_arrivals=2 if fp8 else 1),  # q (and q_scale) loaded
        # Every TMA issued with a barrier is one arrival on it; one per slot.
        plgpu.Barrier(num_arrivals=ppb * (4 if fp8 else 2), num_barriers=slots),
        # With a producer: the compute warpgroup is done with the slot.
        plgpu.Barrier(num_arrivals=1, num_barriers=slots) if producer else None,
    ]
    pl.run_scoped(lambda *s: kernel(*refs, s), *scratch, *barriers,
                  **(dict(collective_axes="wg") if producer else {}))

  out_type = (jax.ShapeDtypeStruct((num_g, nkv, BLOCK_H, hd), jnp.float32),
              jax.ShapeDtypeStruct((num_g, nkv, BLOCK_H), jnp.float32))
  return mgpu_shim.kernel(
      entry,
      out_type=out_type,
      grid=(nkv, num_g),
      grid_names=("kv", "s"),
      kernel_name="paged_gqa_decode_mgpu",
      **(dict(num_threads=2, thread_name="wg") if producer else {}),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret,
  )(q, q_scale, k, v, k_scale, v_scale, block_tables, lengths, pieces)
