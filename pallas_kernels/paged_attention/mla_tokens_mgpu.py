"""Paged MLA decode for few heads on Pallas Mosaic GPU (Hopper): tokens in wgmma's M.

The heads-in-M kernel (``mla_mgpu``) pads a device's heads to wgmma's 64-row M,
so with 8 heads per device (Kimi K2.6 under 8-way tensor parallelism) 7/8 of
its MMA work is padding, and that padding alone makes it MMA-bound. This kernel
puts the page's 64 tokens in M and the heads in N (a multiple of 8, at most
MAX_HEADS), so the MMA work follows the real heads:

  * QK computes S^T = K Q^T: A is the page [64 tokens, 576] as TMA lands it
    (K-major), B the query [N, 576] read transposed (K-major too);
  * the online softmax runs down the columns of S^T [64, N] (a reduction over
    the token axis, across the warpgroup's four warps);
  * PV computes O^T += V^T P^T: A is the page's latent read transposed
    ([512, 64], M-major, which 16-bit wgmma allows), B is P stored as [N, 64]
    in shared memory, and the [512, N] f32 accumulator takes 4N registers.

Per page that is N x 139 kFLOP of MMA (8.9 MFLOP for the 64 padded rows of
``mla_mgpu``): at 8 heads, 1.1 MFLOP, about 0.19 us of an H200 SM's tensor
cores against 2.3 us (bf16) or 1.1 us (fp8) for the page's bytes at the SM's
share of 4.3 TB/s. So the kernel is a gather: one compute warpgroup,
pages in staging slots used in turn (two for bf16, three for fp8), page
i + slots - 1 issued into the slot step i-1 finished (its PV retired; for fp8
its conversion), so a step waiting for its page has slots - 1 pages in
flight. By default (BlockSizes.loads) a second, memory warpgroup issues the
gathers as soon as the compute warpgroup arrives on the slot's barrier;
otherwise the compute warpgroup issues them at the top of step i. Shared
memory allows one CTA per SM either way, so the two warpgroups share the
register file without setmaxnreg.

fp8 pages are converted to f16 in shared memory as in ``mla_mgpu`` (one
``cvt.rn.f16x2.e4m3x2`` per pair, rows past the length zeroed), with the
per-token scales folded into the logits and P: S^T = S_lat^T * latent_scale[t]
+ S_rope^T * k_rope_scale[t] (a row scale now), and P^T * latent_scale[t] / g
with g the page's largest valid scale, the accumulator holding acc / g. The
query is f16 divided by per-head powers of two (``ops.f16_query``), multiplied
back into the logits. bf16 pages are read in place; only a request's partial
last page has its tail rows zeroed (a zero probability does not cancel NaN).

Outputs per piece, like ``mla_mgpu``: o [G, N, C] bf16 normalised, lse [G, N]
f32 (a very negative number for an empty piece); ``merge_pieces``
merges each request's pieces. docs/paged_attention.md has the numbers.
"""

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.paged_attention.mla_mgpu import FP8
from pallas_kernels.paged_attention.mla_mgpu import LOG2E
from pallas_kernels.paged_attention.mla_mgpu import MIN_SCALE
from pallas_kernels.paged_attention.mla_mgpu import NEG
from pallas_kernels.paged_attention.mla_mgpu import PARTIAL_DTYPE
from pallas_kernels.paged_attention.mla_mgpu import copy_rows
from pallas_kernels.paged_attention.mla_mgpu import rope_start
from pallas_kernels.paged_attention.mla_mgpu import stage_rows
from pallas_kernels.paged_attention.mla_mgpu import transforms
from pallas_kernels import mgpu_shim
from pallas_kernels.paged_attention import merge_pieces_mgpu
from pallas_kernels.paged_attention import producer as producer_loop

MAX_HEADS = 32  # N of the wgmmas; the [512, N] accumulator takes 4N registers
_OUT_COLS = 64  # output columns per TMA store


def _smem(shape, dtype):
  return plgpu.SMEM(shape, dtype, transforms=transforms(shape[-1], dtype))


def mla_decode_tokens_mgpu(q_latent, q_rope, q_scale, latent, k_rope, latent_scale,
                           k_rope_scale, block_tables, lengths, pieces, *, scale,
                           producer=False, rope_offset=None, interpret=False):
  """Paged MLA decode partials for at most MAX_HEADS heads, tokens in wgmma's M.

  Args:
    q_latent: [B, N, C] query in the compute dtype (f16 for an fp8 cache,
      divided by q_scale; else the cache dtype); N a multiple of 8 (padding
      heads are computed and sliced off by the caller).
    q_rope: [B, N, R] same dtype and row scale; or [B, N, W] holding it at columns
      [rope_offset, rope_offset + R) (``mla_mgpu.rope_start``).
    q_scale: [B, N] f32 per-head factors of an fp8 cache's f16 query
      (``ops.f16_query``), or None for a bf16/f16 cache.
    latent, k_rope: [P, ps, C], [P, ps, R] pages (bf16/f16 or fp8 e4m3).
    latent_scale, k_rope_scale: [P, ps] f32 or None.
    block_tables: [B, W] int32.
    lengths: [B] int32.
    pieces: [5, G] int32 from ``schedule.schedule_pieces`` (rows 0-2 read).
    scale: softmax scale.
    producer: issue the query and page gathers from a second, memory
      warpgroup instead of from the compute warpgroup at the top of each
      step; the slots and when they are refilled are the same.
    interpret: False, or a plgpu.InterpretGPUParams.

  Returns:
    (o [G, N, C] bf16 normalised per piece, lse [G, N] f32).

  Raises:
    ValueError: on an unsupported shape or dtype combination.
  """
  b, nh, c = q_latent.shape
  n_pages, ps, r = k_rope.shape
  num_g = pieces.shape[1]
  fp8 = latent.dtype == FP8
  cdt = q_latent.dtype
  if nh % 8 or not 0 < nh <= MAX_HEADS or c % 64 or ps != 64 or r % 64:
    raise ValueError(f"unsupported shape: heads {nh} (x8, <= {MAX_HEADS}), C {c} (x64), "
                     f"page {ps} (64), R {r} (x64)")
  if fp8 and (cdt != jnp.float16 or q_scale is None or q_scale.shape != (b, nh)):
    raise ValueError(f"an fp8 cache needs an f16 query and its [B, N] q_scale "
                     f"(ops.f16_query), got {cdt} and "
                     f"{None if q_scale is None else q_scale.shape}")
  if not fp8 and latent.dtype != cdt:
    raise ValueError(f"query {cdt} and cache {latent.dtype} dtypes differ")
  if q_rope.ndim != 3 or q_rope.shape[:2] != (b, nh) or q_rope.dtype != cdt:
    raise ValueError(f"q_rope {q_rope.shape} {q_rope.dtype} does not match q_latent "
                     f"{q_latent.shape} {cdt}")
  rope_col = rope_start(q_rope, r, rope_offset)
  # Staging slots, used in turn: while a step waits for its page, slots - 1
  # pages are in flight. An SM's share of 4.3 TB/s over ~1-2 us of latency is
  # 33-65 KB: one 72 KiB bf16 page covers it (and three do not fit); an fp8
  # page is 36 KiB, so fp8 keeps two in flight (three slots beside the f16 page).
  slots = 3 if fp8 else 2

  def kernel(ql_ref, qr_ref, qs_ref, lat_ref, rope_ref, ls_ref, rs_ref, bt_ref,
             len_ref, pc_ref, o_ref, lse_ref, scratch):
    (ql_smem, qr_smem, qs_smem, lat_st, rope_st, ls_st, rs_st, lat16, rope16,
     p_smem, o_smem, lse_smem, q_bar, tma_bar, free_bar) = scratch
    merge_pieces_mgpu.let_merge_launch(interpret)
    piece = lax.axis_index("s")
    # An unused piece (request -1) runs no step and writes an empty partial.
    bi = jnp.maximum(pc_ref[0, piece], 0)
    start = pc_ref[1, piece]
    steps = pc_ref[2, piece]
    length = len_ref[bi]

    def issue(step):
      # Only used pages are read (steps stops at them); clamp so a corrupt
      # id never sends the TMA out of bounds.
      page = jnp.clip(bt_ref[bi, start + step], 0, n_pages - 1)
      slot = lax.rem(step, slots)
      bar = tma_bar.at[slot]
      plgpu.copy_gmem_to_smem(lat_ref.at[page], lat_st.at[slot], bar)
      plgpu.copy_gmem_to_smem(rope_ref.at[page], rope_st.at[slot], bar)
      if fp8:
        plgpu.copy_gmem_to_smem(ls_ref.at[page], ls_st.at[slot], bar)
        plgpu.copy_gmem_to_smem(rs_ref.at[page], rs_st.at[slot], bar)

    def load_query():
      plgpu.copy_gmem_to_smem(ql_ref.at[bi], ql_smem.at[0], q_bar)
      plgpu.copy_gmem_to_smem(qr_ref.at[bi, :, pl.ds(rope_col, r)], qr_smem.at[0], q_bar)
      if fp8:
        plgpu.copy_gmem_to_smem(qs_ref.at[bi], qs_smem, q_bar)

    producer_loop.start_loads(producer, steps, slots, free_bar, load_query, issue,
                              prologue=slots - 1)

    def compute():
      plgpu.barrier_wait(q_bar)
      tok_vec = plgpu.Layout.WGMMA.reduce(1)  # a [64] vector over the tokens (rows)
      head_vec = plgpu.Layout.WGMMA.reduce(0)  # an [N] vector over the heads (columns)
      # The softmax scale, times the f16 query's per-head factors for an fp8 cache.
      head_scale = (plgpu.load(qs_smem, layout=head_vec) * scale if fp8
                    else plgpu.layout_cast(jnp.full((nh,), scale, jnp.float32), head_vec))

      def body(i, carry):
        acc, m_i, l_i, g_i = carry
        # 0, but LLVM cannot prove it: buffers indexed by it have loop-variant
        # addresses, so their descriptors and swizzled offsets are computed
        # where they are used instead of being hoisted out of the loop and kept
        # live across it (mla_mgpu's module docstring).
        z = lax.optimization_barrier(jnp.int32(0))
        q_lat, q_rp = ql_smem.at[z], qr_smem.at[z]
        pos0 = (start + i) * ps
        valid_tokens = length - pos0
        slot = lax.rem(i, slots)
        lat_in, rope_in = lat_st.at[slot], rope_st.at[slot]
        # Page i + slots - 1 goes into step i-1's slot, whose last reader was
        # that step's PV (retired when its run_state returned) or, for fp8, its
        # conversion (fenced by commit_smem): the gather runs ahead of compute.
        # With a producer, it issues that page once this warpgroup's step i-1
        # arrived on free_bar.
        if not producer:
          @pl.when(i + slots - 1 < steps)
          def _():
            issue(i + slots - 1)
        plgpu.barrier_wait(tma_bar.at[slot])
        if fp8:
          k_lat, k_rope = lat16.at[z], rope16.at[z]
          stage_rows(lat_in, k_lat, valid_tokens)
          stage_rows(rope_in, k_rope, valid_tokens)
          plgpu.commit_smem()
        else:
          k_lat, k_rope = lat_in, rope_in
          @pl.when(valid_tokens < ps)
          def _():
            copy_rows(lat_in, lat_in, valid_tokens)
            plgpu.commit_smem()

        s_acc = plgpu.ACC((ps, nh), jnp.float32)
        if fp8:
          def qk(lat_acc, rope_acc):
            plgpu.wgmma(lat_acc, k_lat, q_lat.transpose((1, 0)))
            plgpu.wgmma(rope_acc, k_rope, q_rp.transpose((1, 0)))
            return lat_acc[...], rope_acc[...]
          s_lat, s_rope = pl.run_scoped(qk, s_acc, s_acc)
          ls = plgpu.load(ls_st.at[slot], layout=tok_vec)
          rs = plgpu.load(rs_st.at[slot], layout=tok_vec)
          s = (s_lat * lax.broadcast_in_dim(ls, s_lat.shape, [0])
               + s_rope * lax.broadcast_in_dim(rs, s_rope.shape, [0]))
        else:
          def qk(acc_ref):
            plgpu.wgmma(acc_ref, k_lat, q_lat.transpose((1, 0)))
            plgpu.wgmma(acc_ref, k_rope, q_rp.transpose((1, 0)))
            return acc_ref[...]
          s = pl.run_scoped(qk, s_acc)
        # s is S^T: [tokens, heads]; the softmax runs down its columns.
        s = s * lax.broadcast_in_dim(head_scale, s.shape, [1])
        tpos = plgpu.broadcasted_iota(jnp.int32, (ps, nh), 0, layout=plgpu.Layout.WGMMA)
        valid = tpos < valid_tokens
        s = jnp.where(valid, s, NEG)
        m_new = jnp.maximum(m_i, s.max(axis=0))
        alpha = jnp.exp2((m_i - m_new) * LOG2E)
        p = jnp.exp2((s - lax.broadcast_in_dim(m_new, s.shape, [1])) * LOG2E)
        l_new = l_i * alpha + p.sum(axis=0)
        g_new = g_i
        if fp8:
          # V = latent_scale[t] * f16 page: P takes the scale, divided by the
          # page's largest (g) so it stays in [0, 1]; acc holds acc / g.
          ls_tile = jnp.where(valid, lax.broadcast_in_dim(ls, s.shape, [0]), 0.0)
          g_new = jnp.maximum(ls_tile.max(axis=0), MIN_SCALE)
          inv_g = 1.0 / g_new
          p = p * ls_tile * lax.broadcast_in_dim(inv_g, p.shape, [1])
          alpha = alpha * g_i * inv_g
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
        # P^T's transpose, [N, tokens]: PV's B operand, K-major.
        p_smem.transpose((1, 0))[...] = p.astype(cdt)
        plgpu.commit_smem()
        v_t = k_lat.transpose((1, 0))  # [C, tokens]: V^T, M-major
        acc = mgpu_shim.accumulate(  # waits for the wgmma
            acc, lambda acc_ref: plgpu.wgmma(acc_ref, v_t, p_smem.transpose((1, 0))),
            interpret)
        if producer:
          plgpu.barrier_arrive(free_bar.at[slot])  # the step is done with its slot
        return acc, m_new, l_new, g_new

      acc0 = plgpu.layout_cast(jnp.zeros((c, nh), jnp.float32), plgpu.Layout.WGMMA)
      m0 = plgpu.layout_cast(jnp.full((nh,), NEG, jnp.float32), head_vec)
      l0 = plgpu.layout_cast(jnp.zeros((nh,), jnp.float32), head_vec)
      g0 = plgpu.layout_cast(jnp.ones((nh,), jnp.float32), head_vec)
      acc, m_i, l_i, g_i = lax.fori_loop(0, steps, body, (acc0, m0, l0, g0))
      nonempty = l_i > 0
      inv = g_i / jnp.where(nonempty, l_i, 1.0)  # g_i: acc / g (fp8), else 1
      acc = acc * lax.broadcast_in_dim(inv, acc.shape, [1])
      for j in range(c // _OUT_COLS):
        o_smem.transpose((1, 0))[...] = acc[j * _OUT_COLS:(j + 1) * _OUT_COLS].astype(
            PARTIAL_DTYPE)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[piece, :, pl.ds(j * _OUT_COLS, _OUT_COLS)])
        plgpu.wait_smem_to_gmem(0)
      lse_smem[...] = jnp.where(nonempty, m_i + jnp.log(jnp.where(nonempty, l_i, 1.0)), NEG)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[piece])
      plgpu.wait_smem_to_gmem(0)

    producer_loop.run_compute(producer, compute)

  def entry(*refs):
    st = latent.dtype
    scratch = [
        _smem((1, nh, c), cdt),
        _smem((1, nh, r), cdt),
        plgpu.SMEM((nh,), jnp.float32) if fp8 else None,
        _smem((slots, ps, c), st),
        _smem((slots, ps, r), st),
        plgpu.SMEM((slots, ps), jnp.float32) if fp8 else None,
        plgpu.SMEM((slots, ps), jnp.float32) if fp8 else None,
        _smem((1, ps, c), cdt) if fp8 else None,
        _smem((1, ps, r), cdt) if fp8 else None,
        _smem((nh, ps), cdt),  # P, [heads, tokens]
        _smem((nh, _OUT_COLS), PARTIAL_DTYPE),
        plgpu.SMEM((nh,), jnp.float32),
    ]
    barriers = [
        plgpu.Barrier(num_arrivals=3 if fp8 else 2),  # q_latent, q_rope (, q_scale)
        # Every TMA issued with a barrier is one arrival on it; one per slot.
        plgpu.Barrier(num_arrivals=4 if fp8 else 2, num_barriers=slots),
        # With a producer: the compute warpgroup is done with the slot.
        plgpu.Barrier(num_arrivals=1, num_barriers=slots) if producer else None,
    ]
    pl.run_scoped(lambda *s: kernel(*refs, s), *scratch, *barriers,
                  **(dict(collective_axes="wg") if producer else {}))

  out_type = (jax.ShapeDtypeStruct((num_g, nh, c), PARTIAL_DTYPE),
              jax.ShapeDtypeStruct((num_g, nh), jnp.float32))
  return mgpu_shim.kernel(
      entry,
      out_type=out_type,
      grid=(num_g,),
      grid_names=("s",),
      kernel_name="paged_mla_decode_tokens_mgpu",
      **(dict(num_threads=2, thread_name="wg") if producer else {}),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret,
  )(q_latent, q_rope, q_scale, latent, k_rope, latent_scale, k_rope_scale,
    block_tables, lengths, pieces)
