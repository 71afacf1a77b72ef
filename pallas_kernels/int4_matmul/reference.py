"""Pure-jnp references for the INT4 weight-only matmuls, plus pack/unpack helpers.

The packed layout (mlkit's ``Int4Weight`` stores exactly this):
  * ``packed`` uint8 [K//2, N] (experts: [E, K//2, N]); byte row i holds input
    rows 2i (low nibble, bits 0-3) and 2i+1 (high nibble, bits 4-7), each a
    two's-complement int4 in [-8, 7].
  * ``scales`` [K//group_size, N] (experts: [E, K//group_size, N]), bf16 or f32.
  * w[k, n] = int4[k, n] * scales[k // group_size, n].

The [N, K] int4 layout of ``nk.py`` (``w_nk[n, k] = int4[k, n]``, the same
scales) has its references at the end.
"""

import functools

import jax
import jax.numpy as jnp

# Group sizes the kernels are written for; a group spans whole packed rows
# and a whole number of 16-row MMA K-steps.
SUPPORTED_GROUP_SIZES = (32, 64, 128)


def pack_int4(q: jax.Array) -> jax.Array:
  """Packs int4 values two per byte along K (axis -2).

  Args:
    q: [K, N] (or [..., K, N]) integer array with entries in [-8, 7]; K even.

  Returns:
    [K//2, N] (or [..., K//2, N]) uint8; byte row i holds rows 2i (low
    nibble) and 2i+1 (high nibble).

  Raises:
    ValueError: if K is odd.
  """
  if q.shape[-2] % 2:
    raise ValueError(f"pack_int4: input dim K={q.shape[-2]} must be even to pack two per byte")
  # int8 throughout (no int32 intermediate): a full-size expert stack packs on the
  # host at one byte per value.
  q = q.astype(jnp.int8)
  *lead, k, n = q.shape
  pairs = q.reshape(*lead, k // 2, 2, n)
  lo = jax.lax.bitcast_convert_type(pairs[..., 0, :], jnp.uint8) & 0x0F
  hi = jax.lax.bitcast_convert_type(pairs[..., 1, :], jnp.uint8) & 0x0F
  return lo | (hi << 4)


def unpack_int4(packed: jax.Array) -> jax.Array:
  """Inverse of `pack_int4`: uint8 [..., K//2, N] -> int8 [..., K, N] in [-8, 7]."""
  s = jax.lax.bitcast_convert_type(packed, jnp.int8)
  # Arithmetic right shifts sign-extend each nibble.
  lo = jax.lax.shift_right_arithmetic(jax.lax.shift_left(s, jnp.int8(4)), jnp.int8(4))
  hi = jax.lax.shift_right_arithmetic(s, jnp.int8(4))
  *lead, k2, n = packed.shape
  return jnp.stack([lo, hi], axis=-2).reshape(*lead, 2 * k2, n)


def dequantize_int4(packed: jax.Array, scales: jax.Array, group_size: int,
                    dtype=jnp.float32) -> jax.Array:
  """Dequantises packed int4 weights: w[k, n] = int4[k, n] * scales[k // g, n].

  Args:
    packed: [K//2, N] (or [E, K//2, N]) uint8.
    scales: [K//group_size, N] (or [E, K//group_size, N]) bf16 or f32.
    group_size: rows of K sharing one scale.
    dtype: result dtype.

  Returns:
    [K, N] (or [E, K, N]) array of `dtype`.
  """
  return _scaled(unpack_int4(packed), scales, group_size, dtype)


def _scaled(q, scales, group_size, dtype):
  """int4 codes [.., K, N] times their group's scale, in f32, cast to dtype."""
  s = jnp.repeat(scales.astype(jnp.float32), group_size, axis=-2)
  return (q.astype(jnp.float32) * s).astype(dtype)


def check_int4_args(x, packed, scales, group_size, experts: bool):
  """Validates shapes and dtypes shared by the kernels and the references.

  Returns:
    (M, K, N) and, for experts, E as a 4th element.

  Raises:
    ValueError: on any shape, dtype or group-size mismatch.
  """
  if group_size not in SUPPORTED_GROUP_SIZES:
    raise ValueError(
        f"group_size={group_size} not in {SUPPORTED_GROUP_SIZES}")
  if x.ndim != 2:
    raise ValueError(f"x must be [M, K], got shape {x.shape}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"x must be floating point, got {x.dtype}")
  want_ndim = 3 if experts else 2
  if packed.ndim != want_ndim or scales.ndim != want_ndim:
    raise ValueError(
        f"packed/scales must be {want_ndim}-D, got {packed.shape} and "
        f"{scales.shape}")
  if packed.dtype != jnp.uint8:
    raise ValueError(f"packed must be uint8, got {packed.dtype}")
  if scales.dtype not in (jnp.bfloat16, jnp.float32):
    raise ValueError(f"scales must be bf16 or f32, got {scales.dtype}")
  m, k = x.shape
  k_half, n = packed.shape[-2:]
  if 2 * k_half != k:
    raise ValueError(f"x has K={k} but packed has K//2={k_half}")
  if k % group_size:
    raise ValueError(f"K={k} must be a multiple of group_size={group_size}")
  if scales.shape[-2:] != (k // group_size, n):
    raise ValueError(
        f"scales must be [..., {k // group_size}, {n}], got {scales.shape}")
  if experts:
    e = packed.shape[0]
    if scales.shape[0] != e:
      raise ValueError(
          f"packed has E={e} experts but scales has {scales.shape[0]}")
    return m, k, n, e
  return m, k, n


# The references are jitted so that an eager call (the tests, tools) compiles one program
# per shape instead of one per operation; inside a caller's jit they are inlined.
_jit = functools.partial(jax.jit, static_argnames=("group_size",))


@_jit
def int4_matmul_reference(x: jax.Array, packed: jax.Array, scales: jax.Array,
                          *, group_size: int) -> jax.Array:
  """W4A16 matmul: x @ dequantize(packed, scales), f32 accumulation.

  Args:
    x: [M, K] activations (bf16).
    packed: [K//2, N] uint8, two int4 per byte along K (see module docstring).
    scales: [K//group_size, N] bf16 or f32.
    group_size: 32, 64 or 128.

  Returns:
    [M, N] in x's dtype.

  Raises:
    ValueError: on shape, dtype or group-size mismatch.
  """
  check_int4_args(x, packed, scales, group_size, experts=False)
  return _dot(x, dequantize_int4(packed, scales, group_size, jnp.float32))


def _dot(x, w):
  """x @ w in f32 (HIGHEST precision), in x's dtype."""
  out = jnp.dot(x.astype(jnp.float32), w, preferred_element_type=jnp.float32,
                precision=jax.lax.Precision.HIGHEST)
  return out.astype(x.dtype)


def _ragged_dot(x, w, group_sizes):
  """lax.ragged_dot of x [M, K] and experts w [E, K, N] in f32, in x's dtype."""
  out = jax.lax.ragged_dot(x.astype(jnp.float32), w, group_sizes.astype(jnp.int32),
                           precision=jax.lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)
  return out.astype(x.dtype)


@_jit
def int4_grouped_matmul_reference(x: jax.Array, packed: jax.Array,
                                  scales: jax.Array, group_sizes: jax.Array,
                                  *, group_size: int) -> jax.Array:
  """Grouped (MoE) W4A16 matmul, like `jax.lax.ragged_dot` with int4 experts.

  Rows of x are sorted by expert: rows [sum(gs[:e]), sum(gs[:e+1])) use
  expert e. Rows past sum(group_sizes) are zero in the output.

  Args:
    x: [M, K] activations (bf16), sorted by expert.
    packed: [E, K//2, N] uint8, two int4 per byte along K.
    scales: [E, K//group_size, N] bf16 or f32.
    group_sizes: [E] int32, rows per expert; sum(group_sizes) <= M.
    group_size: 32, 64 or 128 (quantisation group along K).

  Returns:
    [M, N] in x's dtype.

  Raises:
    ValueError: on shape, dtype or group-size mismatch.
  """
  _, _, _, e = check_int4_args(x, packed, scales, group_size, experts=True)
  if group_sizes.shape != (e,):
    raise ValueError(f"group_sizes must be [{e}], got {group_sizes.shape}")
  return _ragged_dot(x, dequantize_int4(packed, scales, group_size, jnp.float32), group_sizes)


# ------------------------------------------------ the [N, K] int4 layout (nk.py)

def check_int4_nk_args(x, w_nk, scales, group_size, experts: bool):
  """Validates the [N, K] int4 kernels' arguments (``check_int4_args``'s rules).

  Returns:
    (M, K, N) and, for experts, E as a 4th element.

  Raises:
    ValueError: on any shape, dtype or group-size mismatch.
  """
  want_ndim = 3 if experts else 2
  if w_nk.ndim != want_ndim:
    raise ValueError(f"w_nk must be {want_ndim}-D [{'E, ' if experts else ''}N, K], "
                     f"got {w_nk.shape}")
  if w_nk.dtype != jnp.int4:
    raise ValueError(f"w_nk must be int4, got {w_nk.dtype}")
  if x.ndim == 2 and x.shape[1] != w_nk.shape[-1]:
    raise ValueError(f"x has K={x.shape[1]} but w_nk has K={w_nk.shape[-1]}")
  # The same checks as the packed layout, on the packed layout's shape.
  shape = (*w_nk.shape[:-2], w_nk.shape[-1] // 2, w_nk.shape[-2])
  if w_nk.shape[-1] % 2:
    raise ValueError(f"w_nk has an odd K={w_nk.shape[-1]}")
  return check_int4_args(x, jax.ShapeDtypeStruct(shape, jnp.uint8), scales, group_size,
                         experts)


def dequantize_int4_nk(w_nk: jax.Array, scales: jax.Array, group_size: int,
                       dtype=jnp.float32) -> jax.Array:
  """[N, K] int4 (experts [E, N, K]) and [.., K/g, N] scales -> dense [.., K, N]."""
  return _scaled(jnp.swapaxes(w_nk, -1, -2), scales, group_size, dtype)


@_jit
def int4_matmul_nk_reference(x, w_nk, scales, *, group_size: int):
  """``int4_matmul_reference`` for [N, K] int4 weights."""
  check_int4_nk_args(x, w_nk, scales, group_size, experts=False)
  return _dot(x, dequantize_int4_nk(w_nk, scales, group_size))


@_jit
def int4_grouped_matmul_nk_reference(x, w_nk, scales, group_sizes, *, group_size: int):
  """``int4_grouped_matmul_reference`` for [E, N, K] int4 weights."""
  _, _, _, e = check_int4_nk_args(x, w_nk, scales, group_size, experts=True)
  if group_sizes.shape != (e,):
    raise ValueError(f"group_sizes must be [{e}], got {group_sizes.shape}")
  return _ragged_dot(x, dequantize_int4_nk(w_nk, scales, group_size), group_sizes)
