"""Public paged decode-attention ops: dispatch between kernel and reference."""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import device
from pallas_kernels import dispatch
from pallas_kernels import mgpu_shim
from pallas_kernels import schedule
from pallas_kernels.paged_attention import gqa_mgpu
from pallas_kernels.paged_attention import merge_pieces
from pallas_kernels.paged_attention import merge_pieces_mgpu
from pallas_kernels.paged_attention import mla_mgpu
from pallas_kernels.paged_attention import mla_tokens_mgpu
from pallas_kernels.paged_attention import query
from pallas_kernels.paged_attention import reference
from pallas_kernels.paged_attention import triton_kernels
from pallas_kernels.paged_attention.block_sizes import BlockSizes
from pallas_kernels.paged_attention.block_sizes import SparseBlockSizes

FP8 = jnp.float8_e4m3fn


def _check_cache(name, pages, scales, scale_shape):
  if pages.dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(FP8), jnp.dtype(jnp.float32)):
    raise ValueError(f"{name} must be bf16, f32 or float8_e4m3fn, got {pages.dtype}")
  if (pages.dtype == FP8) != (scales is not None):
    raise ValueError(f"{name}: scales must be given exactly when the cache is fp8")
  if scales is not None and scales.shape != scale_shape:
    raise ValueError(f"{name} scales: expected shape {scale_shape}, got {scales.shape}")


def _check_mla_inputs(q_latent, q_rope, latent, k_rope, latent_scale,
                      k_rope_scale, block_tables, lengths, rope_offset=None):
  """ValueError unless the MLA decode inputs agree in shape and dtype (q_rope [B, H, R],
  or [B, H, W] with its rope part at ``rope_offset``)."""
  b, h, c = q_latent.shape
  n, ps, r = k_rope.shape
  width_ok = (q_rope.shape[-1] == r if rope_offset is None
              else 0 <= rope_offset <= q_rope.shape[-1] - r)
  if latent.shape != (n, ps, c) or q_rope.shape[:2] != (b, h) or not width_ok:
    raise ValueError(f"shape mismatch: q_latent {q_latent.shape}, q_rope "
                     f"{q_rope.shape}{'' if rope_offset is None else f' at {rope_offset}'}, "
                     f"latent {latent.shape}, k_rope {k_rope.shape}")
  if latent.dtype != k_rope.dtype:
    raise ValueError(f"latent and k_rope dtypes differ: {latent.dtype}, {k_rope.dtype}")
  _check_cache("latent", latent, latent_scale, (n, ps))
  _check_cache("k_rope", k_rope, k_rope_scale, (n, ps))
  if block_tables.ndim != 2 or block_tables.shape[0] != b or lengths.shape != (b,):
    raise ValueError(f"block_tables {block_tables.shape} / lengths {lengths.shape} "
                     f"do not match batch {b}")


def _pad_tables(block_tables, multiple):
  p = block_tables.shape[1]
  pad = -p % multiple
  # Padded entries lie past every length, so the kernels never read them.
  return jnp.pad(block_tables, ((0, 0), (0, pad))) if pad else block_tables


def _mla_mgpu_supported(q_latent, latent, k_rope):
  """Whether mla_mgpu handles this shape/dtype (else the Triton kernel runs)."""
  _, ps, r = k_rope.shape
  c = latent.shape[-1]
  dt = jnp.dtype(latent.dtype)
  # Each warpgroup dequantises whole 128-column fp8 tiles: C % 256 for fp8.
  # 64-token pages only: a 128-token page's staging does not fit shared memory
  # (ptxas: 372,800 B for bf16, 334,896 B for fp8, against 232,448).
  c_mult = 256 if dt == jnp.dtype(FP8) else 128
  return (c % c_mult == 0 and ps == 64 and r % 64 == 0 and c // 2 <= 256
          and (dt == jnp.dtype(FP8) or dt == jnp.dtype(q_latent.dtype))
          and dt in (jnp.dtype(FP8), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)))


def _gqa_mgpu_supported(q, k):
  """Whether gqa_mgpu handles this shape/dtype (else the Triton kernel runs)."""
  _, ps, kv, hd = k.shape
  g = q.shape[1] // kv
  dt = jnp.dtype(k.dtype)
  fp8 = dt == jnp.dtype(FP8)
  return (hd % 64 == 0 and hd <= 256 and gqa_mgpu.BLOCK_K % ps == 0 and ps % 8 == 0
          and g <= gqa_mgpu.BLOCK_H and (not fp8 or kv % 8 == 0)
          and (fp8 or dt == jnp.dtype(q.dtype))
          and dt in (jnp.dtype(FP8), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)))


def mla_kernel_choice(q_latent, latent, k_rope, block_tables, block_sizes=None, *,
                      device_kind=None):
  """The block sizes and kernel paged_mla_decode runs for these inputs.

  Args:
    q_latent: [B, H, C] query (an array or a ShapeDtypeStruct; only shapes and
      dtypes are read).
    latent: [N, page_size, C] latent pages.
    k_rope: [N, page_size, R] rope-key pages.
    block_tables: [B, P] page ids.
    block_sizes: explicit BlockSizes, or None for BlockSizes.get_default.
    device_kind: target device for the default (None: the active abstract
      mesh's GPU, else jax.devices()).

  Returns:
    (BlockSizes, "mgpu" | "triton").

  Raises:
    ValueError: if block_sizes.impl == "mgpu" and mla_mgpu cannot take the shape.
  """
  b, h, c = q_latent.shape
  _, ps, r = k_rope.shape
  bs = block_sizes or BlockSizes.get_default(
      "mla", num_heads=h, page_size=ps, max_pages=block_tables.shape[1], batch=b,
      device_kind=device_kind)
  return bs, _pick_impl(
      bs, _mla_mgpu_supported(q_latent, latent, k_rope),
      f"mla_mgpu needs C % 128 == 0 (C <= 512), page_size == 64, R % 64 == 0 "
      f"and a bf16/f16/fp8 cache matching q; got C={c}, page_size={ps}, R={r}, "
      f"cache {latent.dtype}, q {q_latent.dtype}")


def gqa_kernel_choice(q, k, block_tables, block_sizes=None, *, device_kind=None):
  """The block sizes and kernel paged_gqa_decode runs for these inputs.

  Args:
    q: [B, H, hd] queries (an array or a ShapeDtypeStruct).
    k: [N, page_size, KV, hd] key pages.
    block_tables: [B, P] page ids.
    block_sizes: explicit BlockSizes, or None for BlockSizes.get_default.
    device_kind: target device for the default (None: the active abstract
      mesh's GPU, else jax.devices()).

  Returns:
    (BlockSizes, "mgpu" | "triton").

  Raises:
    ValueError: if block_sizes.impl == "mgpu" and gqa_mgpu cannot take the shape.
  """
  b, h, _ = q.shape
  _, ps, kv, _ = k.shape
  bs = block_sizes or BlockSizes.get_default(
      "gqa", num_heads=h // kv, page_size=ps, max_pages=block_tables.shape[1],
      batch=b * kv, device_kind=device_kind)
  return bs, _pick_impl(
      bs, _gqa_mgpu_supported(q, k),
      f"gqa_mgpu needs head_dim % 64 == 0, 64 % page_size == 0, group <= 64, "
      f"KV % 8 == 0 for fp8 and a bf16/f16/fp8 cache matching q; got k "
      f"{k.shape} {k.dtype}, q {q.shape} {q.dtype}")


def _pick_impl(bs, supported: bool, unsupported: str) -> str:
  """"mgpu" when forced or when "auto" and the Mosaic GPU kernel takes the shape."""
  if bs.impl == "mgpu" and not supported:
    raise ValueError(unsupported)
  return "mgpu" if bs.impl == "mgpu" or (bs.impl == "auto" and supported) else "triton"


def _full_spec(x):
  if x is None:
    return None
  return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


@functools.partial(jax.jit, static_argnames=("scale", "backend", "block_sizes", "rope_offset"))
def paged_mla_decode(q_latent, q_rope, latent, k_rope, latent_scale,
                     k_rope_scale, block_tables, lengths, *, scale,
                     backend=None, block_sizes=None, rope_offset=None):
  """MLA decode attention (absorbed form) over a paged latent cache.

  out[b, h] = sum_t softmax_t(scale * (q_latent[b,h].latent_t + q_rope[b,h].k_rope_t))
  * latent_t over the first lengths[b] tokens of request b, with token t at
  page block_tables[b, t // page_size], slot t % page_size. Softmax in f32.
  On Mosaic GPU (mla_mgpu.py) where the shape allows, else on Triton
  (triton_kernels.py). The Triton kernel splits each request's pages into
  ``block_sizes.num_splits`` partitions (split-K); the Mosaic GPU kernel cuts
  them into pieces of one size balanced over about the SMs (mla_mgpu.py, which
  ignores num_splits). Both merge their partial (max, sum, acc) afterwards.

  Args:
    q_latent: [B, H, C] absorbed query (bf16 or f32); or a
      ``pallas_kernels.mla_absorb.AbsorbQuery`` (q_all [B, H, nope + R], wkv_b
      [C, H, nope + v], nope), q_rope then None: the absorbed product runs here, in
      one Pallas launch with the fp8 cache's query scaling where the kernel takes the
      shapes (``mla_absorb.absorbed_query``), and the kernels read the rope part
      from q_all's columns nope on (docs/mla_absorb.md, "The query side").
    q_rope: [B, H, R] rope part of the query; or, with ``rope_offset``, [B, H, W]
      holding it at columns [rope_offset, rope_offset + R).
    latent: [N, page_size, C] latent pages, bf16 or float8_e4m3fn.
    k_rope: [N, page_size, R] rope-key pages, same dtype as latent.
    latent_scale: [N, page_size] f32 per-token scales when fp8, else None.
    k_rope_scale: [N, page_size] f32 per-token scales when fp8, else None.
    block_tables: [B, P] int32 page ids; entries past the used pages are
      ignored and may be out of the pool (PAD_PAGE = -1).
    lengths: [B] int32 valid tokens per request, 0 <= lengths[b] <= P * page_size
      (a length-0 row gives zeros).
    scale: softmax scale.
    backend: "pallas" | "interpret" | "xla" | None (pallas on GPU, else xla).
    block_sizes: BlockSizes, or None for BlockSizes.get_default.
    rope_offset: None, or where q_rope's rope part starts. The kernels read it in place
      (the Triton kernel and the scaled query at block rope_offset / R, the bf16 Mosaic
      GPU kernels through a TMA box at that column; a copy of the columns where neither
      can), so a caller may hand over the array it computes the rope part in beside
      other columns (docs/paged_attention.md, "The query's rope part in place").

  Returns:
    [B, H, C] in q_latent's dtype.

  Raises:
    ValueError: on inconsistent shapes or dtypes, or an unknown backend.
  """
  from pallas_kernels.mla_absorb import AbsorbQuery  # it imports this package's query
  backend = dispatch.resolve_backend(backend)
  absorb = q_latent if isinstance(q_latent, AbsorbQuery) else None
  if absorb is not None:
    if q_rope is not None or rope_offset is not None:
      raise ValueError("an AbsorbQuery holds the rope part: q_rope and rope_offset must "
                       "be None")
    q_latent, q_rope, rope_offset = absorb.latent_shape, absorb.q_all, absorb.nope
  _check_mla_inputs(q_latent, q_rope, latent, k_rope, latent_scale, k_rope_scale,
                    block_tables, lengths, rope_offset)
  rope_cols = None if rope_offset is None else (rope_offset, k_rope.shape[-1])
  interpret = backend == "interpret"
  if backend == "xla":
    if absorb is not None:
      from pallas_kernels.mla_absorb import absorbed_query_reference
      q_latent = absorbed_query_reference(absorb.q_all, absorb.wkv_b, absorb.nope)
    return reference.paged_mla_decode_reference(
        q_latent, query.rope_part(q_rope, rope_cols), latent, k_rope, latent_scale,
        k_rope_scale, block_tables, lengths, scale=scale)

  bs, impl = mla_kernel_choice(q_latent, latent, k_rope, block_tables, block_sizes)
  if impl == "mgpu":
    tokens_in_m = mla_tokens_in_m(bs, q_latent, latent, k_rope)
    return _mla_mgpu(q_latent, q_rope, latent, k_rope, latent_scale,
                     k_rope_scale, block_tables, lengths, scale=scale,
                     tokens_in_m=tokens_in_m,
                     qk_fp8=mla_qk_fp8(bs, tokens_in_m, latent), merge=bs.merge,
                     producer=bs.loads == "producer", rope_cols=rope_cols,
                     absorb=absorb, interpret=interpret)
  if absorb is not None:
    q_latent = absorb.product(interpret=interpret)
  ppb = bs.pages_per_block
  splits = bs.num_splits
  block_tables = _pad_tables(block_tables.astype(jnp.int32), splits * ppb)
  pages_per_split = block_tables.shape[1] // splits
  kernel = functools.partial(
      triton_kernels.mla_kernel, scale=float(scale),
      pages_per_split=pages_per_split, pages_per_block=ppb)
  return _mla_split_k_call(
      kernel, "paged_mla_decode", q_latent, q_rope,
      [(latent, _full_spec(latent)), (k_rope, _full_spec(k_rope)),
       (latent_scale, _full_spec(latent_scale)),
       (k_rope_scale, _full_spec(k_rope_scale)),
       (block_tables, _full_spec(block_tables)),
       (lengths.astype(jnp.int32), _full_spec(lengths))],
      block_h=bs.block_h, splits=splits, num_warps=bs.num_warps,
      num_stages=bs.num_stages, rope_cols=rope_cols, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("scale", "backend", "block_sizes"))
def paged_mla_sparse_decode(q_latent, q_rope, latent, k_rope, latent_scale,
                            k_rope_scale, block_tables, lengths, indices, *,
                            scale, backend=None, block_sizes=None):
  """Sparse MLA decode attention (absorbed form) over a paged latent cache.

  Request b attends only to the token positions indices[b] selects
  (DeepSeek Sparse Attention's top-k; docs/sparse_attention.md): position p
  at page block_tables[b, p // page_size], slot p % page_size. Softmax in
  f32, fp8 pages dequantised with their per-token scales. The Pallas kernel
  (triton_kernels.sparse_mla_kernel, Triton backend) gathers block_k selected
  rows per step, so it reads K rows per request whatever the context; it
  splits the K indices into ``num_splits`` partitions (split-K) and merges
  their partials as paged_mla_decode does.

  Args:
    q_latent: [B, H, C] absorbed query (bf16 or f32).
    q_rope: [B, H, R] rope part of the query.
    latent: [N, page_size, C] latent pages, bf16, f32 or float8_e4m3fn.
    k_rope: [N, page_size, R] rope-key pages, same dtype as latent.
    latent_scale, k_rope_scale: [N, page_size] f32 per-token scales when fp8,
      else None.
    block_tables: [B, M] int32 page ids; entries past the used pages may be
      out of the pool (PAD_PAGE = -1).
    lengths: [B] int32 valid tokens per request.
    indices: [B, K] int32 selected positions, K <= M * page_size; -1 selects
      nothing (as does any position outside [0, lengths[b])). Positions
      should be distinct: a repeated one counts twice.
    scale: softmax scale.
    backend: "pallas" | "interpret" | "xla" | None (pallas on GPU, else xla).
    block_sizes: SparseBlockSizes, or None for SparseBlockSizes.get_default.

  Returns:
    [B, H, C] in q_latent's dtype; a row with no valid index gives zeros.

  Raises:
    ValueError: on inconsistent shapes or dtypes, or an unknown backend.
  """
  backend = dispatch.resolve_backend(backend)
  _check_mla_inputs(q_latent, q_rope, latent, k_rope, latent_scale, k_rope_scale,
                    block_tables, lengths)
  b, h, _ = q_latent.shape
  n, ps, _ = k_rope.shape
  if indices.dtype != jnp.int32:
    raise ValueError(f"indices must be int32 token positions, got {indices.dtype}")
  if indices.ndim != 2 or indices.shape[0] != b or indices.shape[1] < 1:
    raise ValueError(f"indices must be [B={b}, K >= 1], got {indices.shape}")
  k = indices.shape[1]
  m = block_tables.shape[1]
  if k > m * ps:
    raise ValueError(f"indices select K={k} positions but block_tables [{b}, {m}] "
                     f"of {ps}-token pages hold at most {m * ps}")
  if backend == "xla":
    return reference.paged_mla_sparse_decode_reference(
        q_latent, q_rope, latent, k_rope, latent_scale, k_rope_scale,
        block_tables, lengths, indices, scale=scale)

  bs = block_sizes or SparseBlockSizes.get_default(num_heads=h, num_indices=k, batch=b)
  bk, splits = bs.block_k, bs.num_splits
  # Pad K with -1 to whole steps in every split; padded steps select nothing. At least
  # two steps: ptxas spills the fully unrolled one-step loop in bf16 (12 B at 32 heads,
  # 4 B at 16, 128 registers), while two steps read 180, no spills.
  per_split = max(-(-k // (splits * bk)), 2) * bk
  indices = jnp.pad(indices, ((0, 0), (0, splits * per_split - k)), constant_values=-1)
  kernel = functools.partial(
      triton_kernels.sparse_mla_kernel, scale=float(scale), page_size=ps,
      table_width=m, indices_per_split=per_split, block_k=bk)

  def rows(x):
    """[N, ps, ...] -> [N * ps, ...]: one row per token slot (a free reshape
    of the contiguous pool), so a step gathers rows page * ps + slot."""
    if x is None:
      return None, None
    x = x.reshape(n * ps, *x.shape[2:])
    return x, _full_spec(x)

  flat_tables = block_tables.astype(jnp.int32).reshape(b * m)
  return _mla_split_k_call(
      kernel, "paged_mla_sparse_decode", q_latent, q_rope,
      [rows(latent), rows(k_rope), rows(latent_scale), rows(k_rope_scale),
       (flat_tables, _full_spec(flat_tables)),
       (lengths.astype(jnp.int32), _full_spec(lengths)),
       (indices, _full_spec(indices))],
      block_h=bs.block_h, splits=splits, num_warps=bs.num_warps,
      num_stages=bs.num_stages, interpret=backend == "interpret")


def _mla_split_k_call(kernel, name, q_latent, q_rope, operands, *, block_h,
                      splits, num_warps, num_stages, interpret, rope_cols=None):
  """Runs a split-K MLA decode kernel on the Triton backend and merges its splits.

  Args:
    kernel: the kernel, taking (q_lat_ref [bh, C], q_rope_ref [bh, R],
      *operand refs, acc_ref [bh, C], m_ref [bh], l_ref [bh]) per
      (request, head block, split) program.
    name: the kernel's name.
    q_latent: [B, H, C], q_rope: [B, H, R]; heads are padded to block_h.
    operands: (array or None, BlockSpec or None) pairs after the query.
    block_h, splits, num_warps, num_stages: the launch's tiling.
    interpret: run in interpret mode.
    rope_cols: None, or (offset, R): q_rope is [B, H, W] with the rope part at columns
      [offset, offset + R), read in place at block offset / R (copied where R does not
      divide the offset).

  Returns:
    [B, H, C] in q_latent's dtype.
  """
  b, h, c = q_latent.shape
  if rope_cols is not None and rope_cols[0] % rope_cols[1]:
    q_rope, rope_cols = query.rope_part(q_rope, rope_cols), None
  offset, r = rope_cols or (0, q_rope.shape[-1])
  bh = block_h
  h_pad = -h % bh
  if h_pad:
    q_latent = jnp.pad(q_latent, ((0, 0), (0, h_pad), (0, 0)))
    q_rope = jnp.pad(q_rope, ((0, 0), (0, h_pad), (0, 0)))
  hp = h + h_pad
  acc, m, l = pl.pallas_call(
      kernel,
      grid=(b, hp // bh, splits),
      in_specs=[
          pl.BlockSpec((None, bh, c), lambda i, j, k: (i, j, 0)),
          pl.BlockSpec((None, bh, r), lambda i, j, k: (i, j, offset // r)),
          *(spec for _, spec in operands),
      ],
      out_specs=[
          pl.BlockSpec((None, None, bh, c), lambda i, j, k: (i, k, j, 0)),
          pl.BlockSpec((None, None, bh), lambda i, j, k: (i, k, j)),
          pl.BlockSpec((None, None, bh), lambda i, j, k: (i, k, j)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((b, splits, hp, c), jnp.float32),
          jax.ShapeDtypeStruct((b, splits, hp), jnp.float32),
          jax.ShapeDtypeStruct((b, splits, hp), jnp.float32),
      ],
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name=name,
  )(q_latent, q_rope, *(x for x, _ in operands))
  out = reference.combine_splits(acc, m, l)[:, :h]
  return out.astype(q_latent.dtype)


def f16_query(*parts):
  """The f16 query of an fp8 cache's Mosaic GPU kernels: rows divided by a power of two.

  The factor puts each row's largest |value| (over all parts, whose logits add:
  MLA's latent and rope) in [2^13, 2^14): far from f16's overflow at 65504 and
  from its subnormals, so the cast keeps 11 significant bits and nothing
  overflows. A power of two divides exactly. An all-zero row keeps factor 1.
  The kernels multiply the factor back into the logits. (``query.f16_row_scale``;
  the MLA kernels' query runs through ``query.scaled_query``, one launch.)

  Args:
    *parts: [..., D_i] float arrays with the same leading shape.

  Returns:
    (each part as f16, ..., q_scale [...] f32) with part = part16 * q_scale[..., None].
  """
  parts = [x.astype(jnp.float32) for x in parts]
  q_scale = query.f16_row_scale(_row_amax(parts))
  return (*query.scale_rows(parts, q_scale, "f16"), q_scale.astype(jnp.float32))


def _row_amax(parts) -> jax.Array:
  """Each row's largest |value| over all parts, as one reduction over their concatenation:
  XLA fuses the concatenation into the reduction's input, so the query's prologue runs one
  reduce kernel where a reduction per part and a maximum ran one per part (docs/step_time.md, "Launches per MoE layer")."""
  return jnp.max(jnp.abs(jnp.concatenate(parts, axis=-1)), axis=-1)


def fp8_query(*parts):
  """The e4m3 query of the heads-in-M MLA kernel's fp8 QK: rows scaled to e4m3's range.

  Each row (over all parts, whose logits add: MLA's latent and rope) is divided
  by its largest |value| / 448, so that value maps to e4m3's largest and the
  others keep 4 significant bits down to 2^-6 of it (subnormals below). An
  all-zero row keeps factor 1. The kernel multiplies the factor back into the
  logits. (``query.fp8_row_scale``.)

  Args:
    *parts: [..., D_i] float arrays with the same leading shape.

  Returns:
    (each part as float8_e4m3fn, ..., q_scale [...] f32), part ~= part8 * q_scale[..., None].
  """
  parts = [x.astype(jnp.float32) for x in parts]
  q_scale = query.fp8_row_scale(_row_amax(parts))
  return (*query.scale_rows(parts, q_scale, "fp8"), q_scale.astype(jnp.float32))


def mla_mgpu_pieces(batch: int, heads: int, max_pages: int, kind: str | None = None) -> int:
  """Pieces (CTAs) per 64-head block of the Mosaic GPU MLA kernel: one CTA per SM
  (its shared memory), the SMs shared by the head blocks."""
  blocks = -(-heads // mla_mgpu.BLOCK_H)
  return schedule.num_pieces(batch, max_pages, max(1, device.num_sms(kind) // blocks))


def gqa_mgpu_pieces(batch: int, kv_heads: int, blocks: int, kind: str | None = None,
                    ctas_per_sm: int = 2) -> int:
  """Pieces (CTAs) per KV head of the Mosaic GPU GQA kernel over ``blocks`` 64-token
  blocks: 93-103 KB of shared memory, so two CTAs per SM (one with a producer
  warpgroup), shared by the KV heads."""
  return schedule.num_pieces(batch, blocks,
                             max(1, ctas_per_sm * device.num_sms(kind) // kv_heads))


def mla_tokens_in_m(bs, q_latent, latent, k_rope) -> bool:
  """Whether the Mosaic GPU MLA path runs ``mla_tokens_mgpu`` (tokens in wgmma's
  M, heads in N) rather than ``mla_mgpu`` (heads padded to 64 in M).

  Raises:
    ValueError: ``bs.mla_m == "tokens"`` and that kernel cannot take the shape.
  """
  h, c = q_latent.shape[1], q_latent.shape[2]
  _, ps, r = k_rope.shape
  fits = h <= mla_tokens_mgpu.MAX_HEADS and ps == 64 and c % 64 == 0 and r % 64 == 0
  if bs.mla_m == "tokens" and not fits:
    raise ValueError(f"mla_tokens_mgpu needs at most {mla_tokens_mgpu.MAX_HEADS} heads, "
                     f"64-token pages, C % 64 == 0 and R % 64 == 0; got {h} heads, "
                     f"page_size={ps}, C={c}, R={r}")
  return bs.mla_m == "tokens" or (bs.mla_m == "auto" and fits)


def mla_qk_fp8(bs, tokens_in_m: bool, latent) -> bool:
  """Whether the Mosaic GPU MLA path runs QK as fp8 wgmmas with an e4m3 query
  (``bs.mla_qk``): the heads-in-M kernel on an fp8 cache, "fp8" or "auto".

  Raises:
    ValueError: ``bs.mla_qk == "fp8"`` where that cannot run: a bf16/f16 cache,
      or the tokens-in-M kernel.
  """
  fp8 = jnp.dtype(latent.dtype) == jnp.dtype(FP8)
  if bs.mla_qk == "fp8" and (not fp8 or tokens_in_m):
    raise ValueError(f"mla_qk='fp8' needs an fp8 cache and the heads-in-M kernel "
                     f"(mla_m='heads', or more than {mla_tokens_mgpu.MAX_HEADS} heads); "
                     f"got a {latent.dtype} cache, "
                     f"{'tokens' if tokens_in_m else 'heads'} in M")
  return fp8 and not tokens_in_m and bs.mla_qk in ("auto", "fp8")


def _mla_mgpu(q_latent, q_rope, latent, k_rope, latent_scale, k_rope_scale,
              block_tables, lengths, *, scale, tokens_in_m, qk_fp8, merge, interpret,
              producer=False, rope_cols=None, absorb=None):
  """Runs mla_mgpu (heads padded to 64) or mla_tokens_mgpu (heads padded to 8):
  pads the heads, casts q, schedules the pieces, merges them. ``rope_cols``: None, or
  (offset, R) where q_rope [B, H, W] holds the rope part (read in place). ``absorb``:
  None, or the ``AbsorbQuery`` whose product runs here (q_latent is then its
  latent_shape and q_rope its q_all)."""
  b, h, _ = q_latent.shape
  out_dtype = q_latent.dtype
  h_pad = -h % (8 if tokens_in_m else mla_mgpu.BLOCK_H)
  scaled = qk_fp8 or latent.dtype == FP8
  if absorb is not None and not (scaled and absorb.kernel_takes()):
    q_latent, absorb = absorb.product(interpret=interpret), None
  if scaled:
    # QK as fp8 wgmmas on the staged fp8 pages (mla_mgpu): an e4m3 query. Else fp8 pages
    # become f16 in the kernel (see mla_mgpu), and wgmma wants equal operand types: an
    # f16 query, rows divided by a power of two. Padded and scaled in one launch: with
    # the absorbed product where it is still to run (mla_absorb.absorbed_query).
    kind = "fp8" if qk_fp8 else "f16"
    if absorb is not None:
      ql, qr, q_scale = absorb.product(kind=kind, heads=h + h_pad, interpret=interpret)
    else:
      ql, qr, q_scale = query.scaled_query(q_latent, q_rope, heads=h + h_pad, kind=kind,
                                           rope_cols=rope_cols, interpret=interpret)
    rope_offset = None
  else:
    # The kernels read the rope columns in place with a TMA box where it can.
    if rope_cols is not None and not mla_mgpu.tma_reads_rope_at(q_rope, *rope_cols):
      q_rope, rope_cols = query.rope_part(q_rope, rope_cols), None
    rope_offset = None if rope_cols is None else rope_cols[0]
    pad = ((0, 0), (0, h_pad), (0, 0))
    ql, qr, q_scale = (jnp.pad(q_latent, pad).astype(latent.dtype),
                       jnp.pad(q_rope, pad).astype(latent.dtype), None)
  bt = block_tables.astype(jnp.int32)
  lengths = lengths.astype(jnp.int32)
  pieces = schedule.schedule_pieces(
      lengths, page_size=latent.shape[1], max_pages=bt.shape[1],
      pieces=mla_mgpu_pieces(b, h, bt.shape[1]))
  mgpu_interpret = mgpu_shim.interpret_params(interpret)
  if interpret and producer and not tokens_in_m:
    mgpu_shim.check_interpret_threads(3)
  if tokens_in_m:
    o, lse = mla_tokens_mgpu.mla_decode_tokens_mgpu(
        ql, qr, q_scale, latent, k_rope, latent_scale, k_rope_scale, bt, lengths,
        pieces, scale=float(scale), producer=producer, rope_offset=rope_offset,
        interpret=mgpu_interpret)
  else:
    o, lse = mla_mgpu.mla_decode_mgpu(
        ql, qr, q_scale, latent, k_rope, latent_scale, k_rope_scale, bt, lengths,
        pieces, scale=float(scale), heads=h, producer=producer, rope_offset=rope_offset,
        interpret=mgpu_interpret)
  # o [G, H8, C], lse [G, Hp]: one row group of the H real heads.
  return _merge(o[:, None], lse[:, None], pieces, b, rows=h, out_dtype=out_dtype,
                merge=merge, interpret=interpret)[:, 0]


def _merge(o, lse, pieces, batch, *, rows, out_dtype, merge, interpret):
  """[B, X, rows, D] from the pieces' partials o [G, X, R, D], lse [G, X, RL] on the
  schedule ``pieces`` [5, G]: a merge kernel, or XLA's one-hot product
  (BlockSizes.merge)."""
  request = pieces[0]
  if merge in ("mgpu", "mgpu_serial") and merge_pieces_mgpu.supports(o.shape[-1]):
    return merge_pieces_mgpu.merge_pieces_mgpu(
        o, lse, request, batch, rows=rows, out_dtype=out_dtype, ranges=pieces,
        pdl=merge == "mgpu", ctas=mgpu_shim.ctas_to_fill(interpret),
        interpret=mgpu_shim.interpret_params(interpret))
  if merge != "xla":  # "triton", or columns the Mosaic GPU merge does not take (GQA's 64, 192)
    return merge_pieces.merge_pieces(o, lse, request, batch, rows=rows, out_dtype=out_dtype,
                                     ranges=pieces, interpret=interpret)
  g, x, _, d = o.shape
  out = reference.combine_pieces(o[:, :, :rows].reshape(g, x * rows, d),
                                 lse[:, :, :rows].reshape(g, x * rows), request, batch)
  return out.reshape(batch, x, rows, d).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("scale", "backend", "block_sizes"))
def paged_gqa_decode(q, k, v, k_scale, v_scale, block_tables, lengths, *,
                     scale, backend=None, block_sizes=None):
  """GQA decode attention over paged K/V.

  Query head h attends with KV head h // (H // KV), over the first lengths[b]
  tokens of request b. Softmax in f32. On Mosaic GPU (gqa_mgpu.py) where the
  shape allows, else on Triton (triton_kernels.py). Split-K over pages as in
  paged_mla_decode; one program per (request, KV head, split) handles the
  whole query group of that KV head, so K/V are read once per group.

  Args:
    q: [B, H, hd] queries (bf16 or f32).
    k: [N, page_size, KV, hd] key pages, bf16 or float8_e4m3fn.
    v: [N, page_size, KV, hd] value pages, same dtype as k.
    k_scale: [N, page_size, KV] f32 per-token-per-head scales when fp8, else None.
    v_scale: [N, page_size, KV] f32 scales when fp8, else None.
    block_tables: [B, P] int32 page ids; entries past the used pages are
    ignored and may be out of the pool (PAD_PAGE = -1).
    lengths: [B] int32, 0 <= lengths[b] <= P * page_size (length 0: zeros).
    scale: softmax scale.
    backend: "pallas" | "interpret" | "xla" | None (pallas on GPU, else xla).
    block_sizes: BlockSizes, or None for BlockSizes.get_default.

  Returns:
    [B, H, hd] in q's dtype.

  Raises:
    ValueError: on inconsistent shapes or dtypes, or an unknown backend.
  """
  backend = dispatch.resolve_backend(backend)
  b, h, hd = q.shape
  n, ps, kv, hd2 = k.shape
  if hd2 != hd or v.shape != k.shape or h % kv:
    raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}, v {v.shape}")
  if k.dtype != v.dtype:
    raise ValueError(f"k and v dtypes differ: {k.dtype}, {v.dtype}")
  _check_cache("k", k, k_scale, (n, ps, kv))
  _check_cache("v", v, v_scale, (n, ps, kv))
  if block_tables.shape[0] != b or lengths.shape != (b,):
    raise ValueError(f"block_tables {block_tables.shape} / lengths {lengths.shape} "
                     f"do not match batch {b}")
  if backend == "xla":
    return reference.paged_gqa_decode_reference(
        q, k, v, k_scale, v_scale, block_tables, lengths, scale=scale)

  g = h // kv
  bs, impl = gqa_kernel_choice(q, k, block_tables, block_sizes)
  if impl == "mgpu":
    return _gqa_mgpu(q, k, v, k_scale, v_scale, block_tables, lengths,
                     scale=scale, merge=bs.merge, producer=bs.gqa_loads == "producer",
                     interpret=backend == "interpret")
  # One program covers a whole group: pad the group up to block_h (>= 16,
  # the minimum dot M); the padded rows are computed and dropped.
  bh = max(bs.block_h, 1 << (g - 1).bit_length())
  qg = q.reshape(b, kv, g, hd)
  if bh != g:
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, bh - g), (0, 0)))
  ppb = bs.pages_per_block
  splits = bs.num_splits
  block_tables = _pad_tables(block_tables.astype(jnp.int32), splits * ppb)
  pages_per_split = block_tables.shape[1] // splits
  kernel = functools.partial(
      triton_kernels.gqa_kernel, scale=float(scale),
      pages_per_split=pages_per_split, pages_per_block=ppb)
  kv_spec = pl.BlockSpec((n, ps, None, hd), lambda i, j, s: (0, 0, j, 0))
  scale_spec = (pl.BlockSpec((n, ps, None), lambda i, j, s: (0, 0, j))
                if k_scale is not None else None)
  acc, m, l = pl.pallas_call(
      kernel,
      grid=(b, kv, splits),
      in_specs=[
          pl.BlockSpec((None, None, bh, hd), lambda i, j, s: (i, j, 0, 0)),
          kv_spec, kv_spec, scale_spec, scale_spec,
          _full_spec(block_tables), _full_spec(lengths),
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, bh, hd), lambda i, j, s: (i, s, j, 0, 0)),
          pl.BlockSpec((None, None, None, bh), lambda i, j, s: (i, s, j, 0)),
          pl.BlockSpec((None, None, None, bh), lambda i, j, s: (i, s, j, 0)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((b, splits, kv, bh, hd), jnp.float32),
          jax.ShapeDtypeStruct((b, splits, kv, bh), jnp.float32),
          jax.ShapeDtypeStruct((b, splits, kv, bh), jnp.float32),
      ],
      compiler_params=pltriton.CompilerParams(
          num_warps=bs.num_warps, num_stages=bs.num_stages),
      interpret=backend == "interpret",
      name="paged_gqa_decode",
  )(qg, k, v, k_scale, v_scale, block_tables, lengths.astype(jnp.int32))
  acc = acc.reshape(b, splits, kv * bh, hd)
  out = reference.combine_splits(acc, m.reshape(b, splits, kv * bh),
                                 l.reshape(b, splits, kv * bh))
  out = out.reshape(b, kv, bh, hd)[:, :, :g].reshape(b, h, hd)
  return out.astype(q.dtype)


def _gqa_mgpu(q, k, v, k_scale, v_scale, block_tables, lengths, *, scale, merge,
              interpret, producer=False):
  """Runs gqa_mgpu: pads each group to 64 rows, casts q, schedules the pieces
  (in blocks of 64 tokens, the kernel's step), merges them."""
  b, h, hd = q.shape
  ps, kv = k.shape[1], k.shape[2]
  g = h // kv
  qg = jnp.pad(q.reshape(b, kv, g, hd), ((0, 0), (0, 0), (0, gqa_mgpu.BLOCK_H - g), (0, 0)))
  if k.dtype == FP8:
    # fp8 pages become f16 in the kernel (see gqa_mgpu): an f16 query, rows
    # divided by a power of two so that none overflows f16.
    qg, q_scale = f16_query(qg)
  else:
    qg, q_scale = qg.astype(k.dtype), None
  ppb = gqa_mgpu.BLOCK_K // ps
  bt = _pad_tables(block_tables.astype(jnp.int32), ppb)
  lengths = lengths.astype(jnp.int32)
  blocks = bt.shape[1] // ppb
  pieces = schedule.schedule_pieces(lengths, page_size=gqa_mgpu.BLOCK_K, max_pages=blocks,
                                    pieces=gqa_mgpu_pieces(b, kv, blocks,
                                                           ctas_per_sm=1 if producer else 2))
  o, lse = gqa_mgpu.gqa_decode_mgpu(
      qg, q_scale, k, v, k_scale, v_scale, bt, lengths, pieces, scale=float(scale),
      producer=producer, interpret=mgpu_shim.interpret_params(interpret))
  # o [G, KV, 64, hd], lse [G, KV, 64]: the first g rows of each KV head are real.
  out = _merge(o, lse, pieces, b, rows=g, out_dtype=q.dtype, merge=merge,
               interpret=interpret)
  return out.reshape(b, h, hd)
