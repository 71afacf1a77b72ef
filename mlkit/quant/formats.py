"""Quantised weight formats and their round-to-nearest quantisers.

Two formats, both pytrees (``flax.struct.dataclass``) so they pass through
``jit`` and keep their Python type, which is what :mod:`mlkit.quant.dispatch`
keys on:

* :class:`Int4Weight` (W4A16): symmetric group-wise int4 along the input dim K.
  Two values per byte. **Nibble order**: byte row ``i`` of ``packed`` holds input
  rows ``2i`` in the low nibble (bits 0-3) and ``2i+1`` in the high nibble
  (bits 4-7), each a two's-complement int4 in [-8, 7]. Dequantised value
  ``w[k, n] = int4[k, n] * scales[k // group_size, n]``. That is layout "kn",
  the one quantisers and checkpoints use; layout "nk" stores the same codes as an
  int4 array [..., N, K] (the same bytes transposed), the layout the GPU kernels
  dequantise in registers (docs/int4_matmul.md).
  ``quantize_params(..., int4_layout=)`` quantises into either layout;
  ``mlkit.quant.kernels.kernel_layout`` converts a quantised tree.
* :class:`Fp8Weight`: float8_e4m3fn values with f32 scales, either per output
  channel ``[N]`` or per 128x128 block ``[ceil(K/128), ceil(N/128)]`` (the
  DeepSeek-V3 / GLM fp8 checkpoint layout). ``w = values * scale``.

Every layout carries an optional leading experts axis ``E``. These layouts are
fixed: the Pallas kernels read them directly.

The quantisers are offline, host-side tools: their input checks (non-finite
values) run whenever the weight is concrete and are skipped under tracing.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import struct

from mlkit.quant.dispatch import dequantize
from pallas_kernels.int4_matmul import nk as int4_nk
# The packing is the kernels' (one definition for the weights and the references).
from pallas_kernels.int4_matmul.reference import pack_int4, unpack_int4  # noqa: F401


# The relayouts between "kn" and "nk" (the kernels' own, jitted: each copies the codes).
def _relaid(fn, packed):
  """fn(packed) (a transpose between [.., K/2, N] and [.., N, K]), jitted; a
  NamedSharding keeps its split with the last two entries swapped, so each device
  relays its own shard (the sharding rules' spec for the other layout)."""
  sh = None if isinstance(packed, jax.core.Tracer) else getattr(packed, "sharding", None)
  if isinstance(sh, jax.sharding.NamedSharding):
    spec = tuple(sh.spec) + (None,) * (packed.ndim - len(sh.spec))
    out = jax.sharding.NamedSharding(
        sh.mesh, jax.sharding.PartitionSpec(*spec[:-2], spec[-1], spec[-2]))
    return jax.jit(fn, out_shardings=out)(packed)
  return jax.jit(fn)(packed)

INT4_GROUP_SIZES = (32, 64, 128)
INT4_LAYOUTS = ("kn", "nk")
FP8_BLOCK = 128
# Largest finite float8_e4m3fn magnitude.
FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448
# Symmetric RTN uses [-7, 7] so that zero is exact and the range is symmetric.
INT4_QMAX = 7


def stored_nbytes(shape, dtype) -> int:
  """Bytes an array of ``shape`` and ``dtype`` takes on a device: int4 arrays (Int4Weight
  layout "nk") hold two values per byte, where numpy's itemsize (and ``.nbytes``) says one."""
  if jnp.dtype(dtype) == jnp.dtype(jnp.int4):
    return -(-math.prod(shape) // 2)
  return math.prod(shape) * jnp.dtype(dtype).itemsize


_all_finite = jax.jit(lambda w: jnp.all(jnp.isfinite(w)))


def check_finite(w: jax.Array, name: str) -> None:
  """Raises ValueError naming ``name`` if a concrete ``w`` holds NaN or inf."""
  if isinstance(w, jax.core.Tracer):
    return  # abstract (eval_shape / jit): nothing to check
  if not bool(_all_finite(w)):
    raise ValueError(f"{name}: weight has non-finite values (NaN or inf); cannot quantise")


def check_rank(w, name: str) -> None:
  """Raises ValueError unless ``w`` is a 2-D [K, N] or 3-D [E, K, N] weight (what the
  quantisers take); ``name`` names it in the message."""
  if w.ndim not in (2, 3):
    raise ValueError(f"{name}: only 2-D [K, N] or 3-D [E, K, N] weights are quantised, "
                     f"got shape {tuple(w.shape)}")


# ----------------------------------------------------------------------------- int4

@struct.dataclass
class Int4Weight:
  """Symmetric group-wise int4 weight, two values per byte (see module docstring).

  Attributes:
    packed: layout "kn": uint8 [K//2, N] (experts [E, K//2, N]); layout "nk":
      int4 [N, K] (experts [E, N, K]).
    scales: bf16 or f32 [K//group_size, N] (experts [E, K//group_size, N]), in
      both layouts.
    group_size: input rows sharing one scale: 32, 64 or 128 (static).
    layout: "kn" or "nk" (static).
  """

  packed: jax.Array
  scales: jax.Array
  group_size: int = struct.field(pytree_node=False, default=128)
  layout: str = struct.field(pytree_node=False, default="kn")

  def __post_init__(self):
    if self.group_size not in INT4_GROUP_SIZES:
      raise ValueError(f"Int4Weight.group_size must be one of {INT4_GROUP_SIZES}, "
                       f"got {self.group_size!r}")
    if self.layout not in INT4_LAYOUTS:
      raise ValueError(f"Int4Weight.layout must be one of {INT4_LAYOUTS}, got {self.layout!r}")

  @property
  def shape(self) -> tuple[int, ...]:
    """The dense weight's shape ([K, N] or [E, K, N])."""
    if self.layout == "nk":
      *lead, n, k = self.packed.shape
      return (*lead, k, n)
    *lead, k2, n = self.packed.shape
    return (*lead, 2 * k2, n)

  @property
  def ndim(self) -> int:
    return self.packed.ndim

  @property
  def nbytes(self) -> int:
    """Bytes stored (packed values plus scales; two int4 values per byte in both layouts)."""
    return math.prod(self.shape) // 2 + stored_nbytes(self.scales.shape, self.scales.dtype)

  def to_layout(self, layout: str) -> "Int4Weight":
    """The same codes and scales in ``layout`` ("kn" or "nk"); a copy of the codes."""
    if layout not in INT4_LAYOUTS:
      raise ValueError(f"Int4Weight layout must be one of {INT4_LAYOUTS}, got {layout!r}")
    if layout == self.layout:
      return self
    packed = _relaid(int4_nk.to_nk if layout == "nk" else int4_nk.from_nk, self.packed)
    return Int4Weight(packed=packed, scales=self.scales, group_size=self.group_size,
                      layout=layout)


def relaid_int4(tree, layout: str, *, free_source: bool = False):
  """``tree`` with every Int4Weight leaf in ``layout`` ("kn" or "nk"), relaid one
  leaf at a time (other leaves, and int4 weights already in it, as they are).

  Args:
    tree: a params tree (any pytree with Int4Weight leaves).
    layout: the target layout.
    free_source: delete each old leaf's codes once its relaid copy exists (a
      tree nobody else holds, e.g. one just restored), so the peak grows by one
      leaf; otherwise the caller's tree is left intact and each relaid weight is
      a second copy.

  Raises:
    ValueError: an unknown layout.
  """
  if layout not in INT4_LAYOUTS:
    raise ValueError(f"Int4Weight layout must be one of {INT4_LAYOUTS}, got {layout!r}")

  def relay(w):
    if not isinstance(w, Int4Weight) or w.layout == layout:
      return w
    out = w.to_layout(layout)
    if free_source and isinstance(w.packed, jax.Array):
      out.packed.block_until_ready()
      w.packed.delete()
    return out
  return jax.tree.map(relay, tree, is_leaf=lambda x: isinstance(x, Int4Weight))


def int4_codes(w: Int4Weight) -> jax.Array:
  """The int4 codes of ``w`` as int8 [..., K, N], whatever its layout."""
  if w.layout == "nk":
    return jnp.swapaxes(w.packed.astype(jnp.int8), -1, -2)
  return unpack_int4(w.packed)


def check_int4_shape(shape, group_size: int, name: str) -> None:
  """Raises ValueError naming ``name`` unless K (``shape[-2]``) is even and a multiple of ``group_size``."""
  k = shape[-2]
  if k % 2:
    raise ValueError(f"{name}: input dim K={k} is odd; int4 packing needs an even K")
  if group_size not in INT4_GROUP_SIZES:
    raise ValueError(f"{name}: group_size must be one of {INT4_GROUP_SIZES}, got {group_size!r}")
  if k % group_size:
    raise ValueError(f"{name}: group_size {group_size} does not divide input dim K={k}")


def int4_group_scales(w: jax.Array, group_size: int, scale_dtype=jnp.bfloat16) -> jax.Array:
  """Symmetric RTN scales ``max|w| / 7`` per (group, column): [..., K, N] -> [..., K//g, N]."""
  *lead, k, n = w.shape
  g = jnp.abs(w.astype(jnp.float32)).reshape(*lead, k // group_size, group_size, n)
  return (jnp.max(g, axis=-2) / INT4_QMAX).astype(scale_dtype)


def int4_quantize_with_scales(w: jax.Array, scales: jax.Array, group_size: int) -> jax.Array:
  """Rounds w [..., K, N] to int8 codes in [-7, 7] given stored scales [..., K//g, N]."""
  s = jnp.repeat(scales.astype(jnp.float32), group_size, axis=-2)  # [..., K, N]
  # Zero groups have scale 0; divide by 1 there so codes are 0, not NaN.
  q = jnp.round(w.astype(jnp.float32) / jnp.where(s == 0, 1.0, s))
  return jnp.clip(q, -INT4_QMAX, INT4_QMAX).astype(jnp.int8)


def quantize_int4(w: jax.Array, group_size: int = 128, *, scale_dtype=jnp.bfloat16,
                  name: str = "weight") -> Int4Weight:
  """Symmetric group-wise round-to-nearest int4 quantisation.

  Scales are rounded to ``scale_dtype`` *before* the codes are computed, so the
  stored (codes, scales) pair is what the codes were rounded against; the
  per-element error is then at most half a stored scale.

  Args:
    w: weight [K, N] or experts [E, K, N] (any float dtype).
    group_size: input rows per scale: 32, 64 or 128.
    scale_dtype: bf16 or f32 scales.
    name: the parameter's name, used in error messages.

  Returns:
    An :class:`Int4Weight` with packed [..., K//2, N] and scales [..., K//g, N].

  Raises:
    ValueError: naming ``name`` for a rank other than 2/3, an odd K, a group size
      that does not divide K (or is not 32/64/128), or non-finite weights.
  """
  check_rank(w, name)
  check_int4_shape(w.shape, group_size, name)
  check_finite(w, name)
  packed, scales = _rtn_int4(w, group_size, jnp.dtype(scale_dtype))
  return Int4Weight(packed=packed, scales=scales, group_size=group_size)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _rtn_int4(w, group_size, scale_dtype):
  scales = int4_group_scales(w, group_size, scale_dtype)
  return pack_int4(int4_quantize_with_scales(w, scales, group_size)), scales


@dequantize.register(Int4Weight)
def _dequantize_int4(w: Int4Weight, dtype=None) -> jax.Array:
  """Dense [..., K, N]: unpack, multiply by scales in f32, cast to ``dtype`` (default scales')."""
  dtype = dtype or w.scales.dtype
  q = int4_codes(w).astype(jnp.float32)
  s = jnp.repeat(w.scales.astype(jnp.float32), w.group_size, axis=-2)
  return (q * s).astype(dtype)


# ----------------------------------------------------------------------------- fp8

@struct.dataclass
class Fp8Weight:
  """float8_e4m3fn weight with f32 scales (see module docstring).

  Attributes:
    values: float8_e4m3fn [K, N] (experts [E, K, N]).
    scales: f32 per output channel [N] (experts [E, N]) when ``block_size`` is None,
      else per block [ceil(K/128), ceil(N/128)] (experts [E, ...]).
    block_size: None (per-channel) or 128 (static).
  """

  values: jax.Array
  scales: jax.Array
  block_size: int | None = struct.field(pytree_node=False, default=FP8_BLOCK)

  def __post_init__(self):
    if self.block_size not in (None, FP8_BLOCK):
      raise ValueError(f"Fp8Weight.block_size must be None or {FP8_BLOCK}, got {self.block_size!r}")

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.values.shape)

  @property
  def ndim(self) -> int:
    return self.values.ndim

  @property
  def nbytes(self) -> int:
    return self.values.nbytes + self.scales.nbytes


def fp8_expand_scales(scales: jax.Array, shape: tuple[int, ...], block_size: int | None) -> jax.Array:
  """Broadcasts stored fp8 scales to the dense weight shape [..., K, N] (f32)."""
  *_, k, n = shape
  s = scales.astype(jnp.float32)
  if block_size is None:
    return jnp.broadcast_to(s[..., None, :], shape)
  s = jnp.repeat(jnp.repeat(s, block_size, axis=-2), block_size, axis=-1)
  return s[..., :k, :n]


def _fp8_scales(w: jax.Array, block_size: int | None) -> jax.Array:
  a = jnp.abs(w.astype(jnp.float32))
  if block_size is None:
    return jnp.max(a, axis=-2) / FP8_MAX  # [..., N]
  *lead, k, n = a.shape
  bk, bn = math.ceil(k / block_size), math.ceil(n / block_size)
  pad = [(0, 0)] * len(lead) + [(0, bk * block_size - k), (0, bn * block_size - n)]
  a = jnp.pad(a, pad).reshape(*lead, bk, block_size, bn, block_size)
  return jnp.max(a, axis=(-3, -1)) / FP8_MAX  # [..., bk, bn]


def quantize_fp8(w: jax.Array, block_size: int | None = FP8_BLOCK, *,
                 name: str = "weight") -> Fp8Weight:
  """Round-to-nearest float8_e4m3fn quantisation with absmax scales.

  Each scale maps its block's (or column's) largest magnitude to 448, so no value
  saturates; the relative error of normal values is at most 2^-4 (3 mantissa bits).

  Args:
    w: weight [K, N] or experts [E, K, N].
    block_size: 128 for 128x128 block scales (partial edge blocks allowed), or
      None for one scale per output channel.
    name: the parameter's name, used in error messages.

  Returns:
    An :class:`Fp8Weight`.

  Raises:
    ValueError: naming ``name`` for a rank other than 2/3, a block size other than
      None/128, or non-finite weights.
  """
  check_rank(w, name)
  if block_size not in (None, FP8_BLOCK):
    raise ValueError(f"{name}: fp8 block_size must be None or {FP8_BLOCK}, got {block_size!r}")
  check_finite(w, name)
  values, scales = _rtn_fp8(w, block_size)
  return Fp8Weight(values=values, scales=scales, block_size=block_size)


@functools.partial(jax.jit, static_argnums=(1,))
def _rtn_fp8(w, block_size):
  scales = _fp8_scales(w, block_size)
  s = fp8_expand_scales(scales, w.shape, block_size)
  return (w.astype(jnp.float32) / jnp.where(s == 0, 1.0, s)).astype(jnp.float8_e4m3fn), scales


@dequantize.register(Fp8Weight)
def _dequantize_fp8(w: Fp8Weight, dtype=None) -> jax.Array:
  """Dense [..., K, N] = values * scales in f32, cast to ``dtype`` (default f32)."""
  dtype = dtype or jnp.float32
  s = fp8_expand_scales(w.scales, w.values.shape, w.block_size)
  return (w.values.astype(jnp.float32) * s).astype(dtype)
