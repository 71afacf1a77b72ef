"""The MLA decode kernels' scaled query in one Pallas Triton launch: ``scaled_query``.

Over an fp8 cache the Mosaic GPU MLA kernels read an f16 query (or an e4m3 one for fp8
QK) whose rows are divided by a per-row factor, with the factor beside it
(``ops.f16_query``, ``ops.fp8_query``). XLA computed that in four launches per layer:
a reduction for the rows' largest |value| over the latent and rope parts, the factors,
and a cast of each part (their shapes differ, so they do not share a fusion). Here one
program per (request, block of 8 heads) reads both parts of its rows, finds their
factors and writes the scaled parts and the factors, padding heads included (zeros,
factor 1): one launch (docs/step_time.md, "Launches per MoE layer").

The factors are the references' to the bit: ``f16_row_scale`` and ``fp8_row_scale``
are used by both.

The rope part may also be read from a wider array at a static column offset
(``rope_cols``), such as a decode step's query array holding the zero-padded q_nope and
the rotated q_rope side by side, with no copy of its rope columns
(docs/paged_attention.md, "The query's rope part in place").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

FP8 = jnp.float8_e4m3fn
# f16_row_scale puts each row's largest |value| in [2^13, 2^14).
F16_ROW_MAX_LOG2 = 14
# e4m3's largest finite value: fp8_row_scale maps each row's largest |value| to it.
E4M3_MAX = 448.0
# Heads per program.
_BLOCK_H = 8


def f16_row_scale(amax: jax.Array) -> jax.Array:
  """The power of two 2^(e - 14) with amax in [2^(e-1), 2^e) (``frexp``'s e), from amax's
  bits (f32 [...]); 1 for amax == 0.

  Integer operations on the exponent field: the same in XLA and in a Triton kernel, and
  cheap enough that XLA recomputes them in each consumer instead of storing them. The
  factor is 2^(E - 140) for amax's biased exponent E: a normal f32 from E = 14 on, a
  subnormal power of two below. A subnormal amax (E = 0, below 2^-126; XLA's CPU and GPU
  code flush it to zero, factor 1) takes E = 1's factor: its row still scales to below
  2^13, without overflow.
  """
  e = jnp.maximum((jax.lax.bitcast_convert_type(amax, jnp.int32) >> 23) & 0xFF, 1)
  bits = jnp.where(e >= 14, (e - 13) << 23, jnp.left_shift(jnp.int32(1), e + 9))
  return jnp.where(amax > 0, jax.lax.bitcast_convert_type(bits, jnp.float32), 1.0)


def fp8_row_scale(amax: jax.Array) -> jax.Array:
  """amax / 448, so that the row's largest |value| maps to e4m3's largest; 1 for 0."""
  return jnp.where(amax > 0, amax / E4M3_MAX, 1.0)


def scale_rows(parts, scale: jax.Array, kind: str):
  """Each part [..., D_i] (f32) divided by its rows' factors [...] and cast: f16, or e4m3
  clipped to its range (``amax * (448 / amax)`` may round a hair above 448, and e4m3fn
  has no infinity: an overflow is NaN)."""
  inv = (1.0 / scale)[..., None]  # a power of two for f16: exact
  if kind == "f16":
    return [(x * inv).astype(jnp.float16) for x in parts]
  return [jnp.clip(x * inv, -E4M3_MAX, E4M3_MAX).astype(FP8) for x in parts]


def rope_part(q_rope: jax.Array, rope_cols: tuple[int, int] | None) -> jax.Array:
  """The rope part [B, H, R] of ``q_rope``: the array itself (``rope_cols`` None) or its
  columns [offset, offset + R) for ``rope_cols`` = (offset, R)."""
  if rope_cols is None:
    return q_rope
  offset, width = rope_cols
  return q_rope[..., offset:offset + width]


def check_rope_cols(name: str, width: int, rope_cols: tuple[int, int] | None) -> None:
  """ValueError unless ``rope_cols`` (offset, R) lies within ``width`` columns (None:
  the whole array is the rope part)."""
  if rope_cols is None:
    return
  offset, r = rope_cols
  if offset < 0 or r < 1 or offset + r > width:
    raise ValueError(f"{name}: rope columns [{offset}, {offset + r}) do not lie within "
                     f"the query's {width} columns")


def scaled_query_reference(q_latent: jax.Array, q_rope: jax.Array, *, heads: int,
                           kind: str, rope_cols: tuple[int, int] | None = None):
  """The query padded to ``heads`` heads (zeros) and scaled per row.

  Args:
    q_latent: [B, H, C]; q_rope: [B, H, R] (any float dtype), or [B, H, W] holding the
      rope part at ``rope_cols``.
    heads: the padded head count, >= H.
    kind: "f16" (factors powers of two, ``f16_row_scale``) or "fp8" (``fp8_row_scale``).
    rope_cols: None, or (offset, R): the rope part is q_rope's columns
      [offset, offset + R).

  Returns:
    (latent [B, heads, C], rope [B, heads, R] in f16 or e4m3, q_scale [B, heads] f32), with
    part ~= scaled part * q_scale[..., None].
  """
  pad = ((0, 0), (0, heads - q_latent.shape[1]), (0, 0))
  parts = [jnp.pad(x, pad).astype(jnp.float32)
           for x in (q_latent, rope_part(q_rope, rope_cols))]
  # One reduction over both parts: XLA fuses the concatenation into its input.
  amax = jnp.max(jnp.abs(jnp.concatenate(parts, axis=-1)), axis=-1)
  scale = (f16_row_scale if kind == "f16" else fp8_row_scale)(amax)
  return (*scale_rows(parts, scale, kind), scale.astype(jnp.float32))


def kernel_takes(q_latent: jax.Array, q_rope: jax.Array,
                 rope_cols: tuple[int, int] | None = None) -> bool:
  """Whether the kernel takes these parts: heads a multiple of 8, widths powers of two
  (Triton's blocks) and the rope part at a multiple of its width (a block index)."""
  _, h, c = q_latent.shape
  offset, r = rope_cols or (0, q_rope.shape[-1])
  return (h % _BLOCK_H == 0 and not c & (c - 1) and not r & (r - 1) and offset % r == 0
          and q_rope.shape[:2] == q_latent.shape[:2])


def _kernel(ql_ref, qr_ref, ql_out, qr_out, scale_out, *, real_blocks: int, kind: str):
  f32 = jnp.float32

  @pl.when(pl.program_id(1) < real_blocks)
  def _():
    ql, qr = ql_ref[...].astype(f32), qr_ref[...].astype(f32)  # [8, C], [8, R]
    amax = jnp.maximum(jnp.max(jnp.abs(ql), axis=1), jnp.max(jnp.abs(qr), axis=1))
    scale = (f16_row_scale if kind == "f16" else fp8_row_scale)(amax)  # [8]
    ql_out[...], qr_out[...] = scale_rows([ql, qr], scale, kind)
    scale_out[...] = scale

  @pl.when(pl.program_id(1) >= real_blocks)
  def _():  # padding heads: zeros, factor 1
    ql_out[...] = jnp.zeros(ql_out.shape, ql_out.dtype)
    qr_out[...] = jnp.zeros(qr_out.shape, qr_out.dtype)
    scale_out[...] = jnp.ones(scale_out.shape, f32)


@functools.partial(jax.jit, static_argnames=("heads", "kind", "rope_cols", "interpret"))
def scaled_query(q_latent: jax.Array, q_rope: jax.Array, *, heads: int, kind: str,
                 rope_cols: tuple[int, int] | None = None, interpret: bool = False):
  """:func:`scaled_query_reference` in one Pallas Triton launch where
  :func:`kernel_takes` the parts (else the reference).

  With ``rope_cols`` = (offset, R), each program reads its rows' rope part from q_rope
  [B, H, W] at block offset // R of width R: no copy of those columns is made.

  Raises:
    ValueError: on mismatched parts, rope columns outside q_rope, heads below H or not a
      multiple of 8, or a kind that is neither "f16" nor "fp8".
  """
  b, h, c = q_latent.shape
  if q_rope.ndim != 3 or q_rope.shape[:2] != (b, h):
    raise ValueError(f"scaled_query: q_rope {q_rope.shape} does not match q_latent "
                     f"{q_latent.shape}")
  check_rope_cols("scaled_query", q_rope.shape[-1], rope_cols)
  offset, r = rope_cols or (0, q_rope.shape[-1])
  if heads < h or heads % _BLOCK_H:
    raise ValueError(f"scaled_query: heads={heads} must be a multiple of {_BLOCK_H} and "
                     f">= H={h}")
  if kind not in ("f16", "fp8"):
    raise ValueError(f"scaled_query: kind must be 'f16' or 'fp8', got {kind!r}")
  if not kernel_takes(q_latent, q_rope, rope_cols):
    return scaled_query_reference(q_latent, q_rope, heads=heads, kind=kind,
                                  rope_cols=rope_cols)
  real = h // _BLOCK_H
  dtype = jnp.float16 if kind == "f16" else FP8

  def block(width, col=0):  # this program's heads; padding programs read the last real block
    return pl.BlockSpec((None, _BLOCK_H, width),
                        lambda i, j: (i, jnp.minimum(j, real - 1), col))

  def out(width):
    return pl.BlockSpec((None, _BLOCK_H, width), lambda i, j: (i, j, 0))

  return pl.pallas_call(
      functools.partial(_kernel, real_blocks=real, kind=kind),
      grid=(b, heads // _BLOCK_H),
      in_specs=[block(c), block(r, offset // r)],
      out_specs=[out(c), out(r), pl.BlockSpec((None, _BLOCK_H), lambda i, j: (i, j))],
      out_shape=[jax.ShapeDtypeStruct((b, heads, c), dtype),
                 jax.ShapeDtypeStruct((b, heads, r), dtype),
                 jax.ShapeDtypeStruct((b, heads), jnp.float32)],
      interpret=interpret,
      name="scaled_query",
  )(q_latent, q_rope)
