"""MLA's absorbed query (and, over an fp8 cache, its scaling) in one Pallas Triton launch:
``absorbed_query``.

A paged MLA decode step attends in latent space: each head's q_nope [nope] goes to the
latent [C] through the key half of wkv_b [C, H, nope + v]:
q_latent[b, h, :] = q_nope[b, h, :] @ wkv_b[:, h, :nope]^T. XLA ran that as a GEMM over
the query zero-padded over the value half (a pad fusion, then the product), and over
an fp8 cache the decode kernels' scaled query (``paged_attention.query.scaled_query``)
was one more launch (docs/mla_absorb.md). This kernel reads the decode step's query
array q_all [B, H, nope + R] = [q_nope | rope(q_pe)] (one XLA fusion computes it) and
wkv_b's key half in place and writes what the decode kernel reads:

* kind None (a bf16 cache): q_latent [B, H, C] in q_all's dtype; the decode kernel
  reads the rope part from q_all's columns [nope, nope + R) in place
  (``paged_mla_decode``'s rope_offset);
* kind "f16" / "fp8" (an fp8 cache): ``scaled_query``'s outputs, padding heads
  included: (latent [B, heads, C], rope [B, heads, R], q_scale [B, heads]).

Grid: padded heads x row blocks of 16. A program holds whole rows of its head (all C
latent columns and the R rope columns), as the row's largest |value| needs. It reads
its rows' q_nope [16, nope] (block 0 of the head's nope + R columns) and the head's
key half [C, nope] (block 0 of its nope + v columns of wkv_b), and computes q_latent in
C chunks of 128: [16, nope] x [nope, 128] dots with f32 results, rounded to q_all's
dtype where XLA's product was cast, then scaled from those values exactly as
``scaled_query_reference`` does. Kimi K2.6's per-device shape (64 requests, 8 heads,
C = 512, nope = 128, R = 64) runs 8 x 4 = 32 programs.

The kernel runs on one device's heads: ``paged_mla_decode`` calls it inside the decode
step's ``shard_map`` (``mlkit.parallel.DecodeSharding``), where the head padding is
decided. No gradient: it serves the decode step only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.mla_absorb.reference import absorbed_query_reference
from pallas_kernels.paged_attention.query import FP8
from pallas_kernels.paged_attention.query import f16_row_scale
from pallas_kernels.paged_attention.query import fp8_row_scale
from pallas_kernels.paged_attention.query import scale_rows

BLOCK_M = 16  # rows a program computes: Triton's smallest dot operand
BLOCK_C = 128  # latent columns a dot step computes (at most)
_MIN_BLOCK = 16  # Triton's dot takes no operand side below 16
_NUM_WARPS = 4
_DTYPES = (jnp.bfloat16, jnp.float16)  # the kernel's; f32 runs the reference
KINDS = (None, "f16", "fp8")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q_all", "wkv_b"],
                   meta_fields=["nope"])
@dataclasses.dataclass(frozen=True)
class AbsorbQuery:
  """A paged MLA decode step's query before the absorbed product: what
  ``paged_mla_decode`` takes in place of (q_latent, q_rope) to run the product (and the
  scaling) in one launch with :func:`absorbed_query`.

  Attributes:
    q_all: [B, H, nope + R] the query's nope part and its rotated rope part.
    wkv_b: [C, H, nope + v] the key and value up-projection, plain, in q_all's dtype.
    nope: the key half's width per head (static).
  """

  q_all: jax.Array
  wkv_b: jax.Array
  nope: int

  @property
  def latent_shape(self) -> jax.ShapeDtypeStruct:
    """The absorbed query q_latent's shape and dtype: [B, H, C] in q_all's dtype."""
    b, h, _ = self.q_all.shape
    return jax.ShapeDtypeStruct((b, h, self.wkv_b.shape[0]), self.q_all.dtype)

  @property
  def rope_cols(self) -> tuple[int, int]:
    """(offset, R): the rope part's columns in q_all."""
    return self.nope, self.q_all.shape[-1] - self.nope

  def kernel_takes(self) -> bool:
    """Whether :func:`absorbed_query` runs its kernel on this query (:func:`kernel_takes`)."""
    return kernel_takes(self.q_all.shape[0], self.wkv_b.shape[0], *self.rope_cols,
                        self.q_all.dtype)

  def product(self, *, interpret: bool = False, **kwargs):
    """:func:`absorbed_query` of this query (keyword arguments: kind, heads)."""
    return absorbed_query(self.q_all, self.wkv_b, self.nope, interpret=interpret, **kwargs)


def kernel_takes(b: int, c: int, nope: int, r: int, dtype) -> bool:
  """Whether the kernel tiles q_all [B, H, nope + R] and wkv_b [C, H, nope + v] in
  ``dtype``: whole row blocks of 16, C, nope and R powers of two (Triton's blocks;
  C and nope at least 16, dot operands), the rope part at a block index (nope a
  multiple of R), and a 16-bit float dtype."""
  def pow2(x, least=1):
    return x >= least and not x & (x - 1)
  return (b % BLOCK_M == 0 and b > 0 and pow2(c, _MIN_BLOCK) and pow2(nope, _MIN_BLOCK)
          and pow2(r) and nope % r == 0 and jnp.dtype(dtype) in map(jnp.dtype, _DTYPES))


def _kernel(qn_ref, qr_ref, w_ref, *out_refs, real_heads: int, kind: str | None, bc: int):
  """Refs: qn [16, nope] and qr [16, R] (this head's rows of q_all), w [C, nope] (its key
  half); out: q_latent [16, C] (kind None) or latent [16, C], rope [16, R], scale [16]."""
  f32 = jnp.float32
  c = w_ref.shape[0]
  dtype = qn_ref.dtype

  @pl.when(pl.program_id(0) < real_heads)
  def _():
    qn = qn_ref[...]
    chunks = []
    for c0 in range(0, c, bc):  # unrolled: the chunks stay in registers for the row max
      acc = jax.lax.dot_general(qn, w_ref[pl.ds(c0, bc), :], (((1,), (1,)), ((), ())),
                                preferred_element_type=f32)  # [16, bc]
      chunks.append(acc.astype(dtype))  # XLA's product's rounding
    if kind is None:
      (ql_out,) = out_refs
      for i, chunk in enumerate(chunks):
        ql_out[:, pl.ds(i * bc, bc)] = chunk
      return
    ql_out, qr_out, scale_out = out_refs
    chunks = [x.astype(f32) for x in chunks]
    qr = qr_ref[...].astype(f32)
    amax = jnp.max(jnp.abs(qr), axis=1)
    for chunk in chunks:
      amax = jnp.maximum(amax, jnp.max(jnp.abs(chunk), axis=1))
    scale = (f16_row_scale if kind == "f16" else fp8_row_scale)(amax)  # [16]
    *scaled, scaled_rope = scale_rows([*chunks, qr], scale, kind)
    for i, chunk in enumerate(scaled):
      ql_out[:, pl.ds(i * bc, bc)] = chunk
    qr_out[...] = scaled_rope
    scale_out[...] = scale

  if kind is not None:
    @pl.when(pl.program_id(0) >= real_heads)
    def _():  # padding heads: zeros, factor 1
      for ref in out_refs[:2]:
        ref[...] = jnp.zeros(ref.shape, ref.dtype)
      out_refs[2][...] = jnp.ones(out_refs[2].shape, f32)


@functools.partial(jax.jit, static_argnames=("nope", "kind", "heads", "interpret"))
def _absorbed_query_pallas(q_all, wkv_b, *, nope: int, kind: str | None, heads: int,
                           interpret: bool):
  b, h, w = q_all.shape
  c = wkv_b.shape[0]
  r = w - nope
  bc = min(c, BLOCK_C)

  def rows(width, col=0):  # a real head's rows; padding programs read the last real head
    return pl.BlockSpec((BLOCK_M, None, width),
                        lambda hh, i: (i, jnp.minimum(hh, h - 1), col))

  def out(width):
    return pl.BlockSpec((BLOCK_M, None, width), lambda hh, i: (i, hh, 0))

  if kind is None:
    out_specs, out_shape = out(c), jax.ShapeDtypeStruct((b, h, c), q_all.dtype)
  else:
    dtype = jnp.float16 if kind == "f16" else FP8
    out_specs = [out(c), out(r), pl.BlockSpec((BLOCK_M, None), lambda hh, i: (i, hh))]
    out_shape = [jax.ShapeDtypeStruct((b, heads, c), dtype),
                 jax.ShapeDtypeStruct((b, heads, r), dtype),
                 jax.ShapeDtypeStruct((b, heads), jnp.float32)]
  return pl.pallas_call(
      functools.partial(_kernel, real_heads=h, kind=kind, bc=bc),
      grid=(h if kind is None else heads, b // BLOCK_M),
      in_specs=[rows(nope), rows(r, nope // r),
                pl.BlockSpec((c, None, nope),
                             lambda hh, i: (0, jnp.minimum(hh, h - 1), 0))],
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=pltriton.CompilerParams(num_warps=_NUM_WARPS, num_stages=1),
      interpret=interpret,
      name="mla_absorbed_query",
  )(q_all, q_all, wkv_b)


def _check(q_all, wkv_b, nope, kind, heads) -> None:
  if q_all.ndim != 3 or q_all.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
    raise ValueError(f"absorbed_query: q_all must be [B, H, nope + R] in bfloat16, float16 "
                     f"or float32, got {q_all.dtype} {q_all.shape}")
  _, h, w = q_all.shape
  if wkv_b.ndim != 3 or wkv_b.shape[1] != h or wkv_b.dtype != q_all.dtype:
    raise ValueError(f"absorbed_query: wkv_b must be [C, H={h}, nope + v] in q_all's dtype "
                     f"{q_all.dtype} (plain, dequantised), got {wkv_b.dtype} {wkv_b.shape}")
  if not 0 < nope < min(w, wkv_b.shape[-1]):
    raise ValueError(f"absorbed_query: nope must leave at least one rope column of q_all "
                     f"({w} wide) and one value column of wkv_b ({wkv_b.shape[-1]} wide), "
                     f"got {nope}")
  if kind not in KINDS:
    raise ValueError(f"absorbed_query: kind must be one of {KINDS}, got {kind!r}")
  if kind is not None and (heads is None or heads < h):
    raise ValueError(f"absorbed_query: a scaled query needs heads >= H={h}, got {heads}")


def absorbed_query(q_all: jax.Array, wkv_b: jax.Array, nope: int, *, kind: str | None = None,
                   heads: int | None = None, interpret: bool = False):
  """:func:`reference.absorbed_query_reference` in one Pallas Triton launch where
  :func:`kernel_takes` the shapes (else the reference).

  Args:
    q_all: [B, H, nope + R] the query's nope part and its rotated rope part, bf16 or f16
      (f32 runs the reference).
    wkv_b: [C, H, nope + v] the key and value up-projection, plain, in q_all's dtype;
      only each head's first nope columns are read, in place.
    nope: the key half's width per head.
    kind: None: q_latent [B, H, C] in q_all's dtype; "f16" or "fp8": the decode kernels'
      scaled query (latent [B, heads, C], rope [B, heads, R] in f16 or e4m3, q_scale
      [B, heads] f32), padding heads zeros under factor 1.
    heads: the scaled query's padded head count (>= H), with ``kind``.
    interpret: run the kernel in the Pallas interpreter.

  Returns:
    As the reference; the kernel adds the product's f32 terms in another order than
    XLA's dot, so q_latent may differ by one rounding of q_all's dtype where a sum lies
    near a rounding tie (and the scaled query by the same, scaled).

  Raises:
    ValueError: on shapes or dtypes that do not match, a nope out of range, an unknown
      kind or too few heads.
  """
  nope = int(nope)
  _check(q_all, wkv_b, nope, kind, heads)
  b, _, w = q_all.shape
  if not kernel_takes(b, wkv_b.shape[0], nope, w - nope, q_all.dtype):
    return absorbed_query_reference(q_all, wkv_b, nope, kind=kind, heads=heads)
  return _absorbed_query_pallas(q_all, wkv_b, nope=nope, kind=kind,
                                heads=q_all.shape[1] if heads is None else int(heads),
                                interpret=interpret)
