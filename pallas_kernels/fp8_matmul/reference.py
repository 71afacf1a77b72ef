"""jnp reference of the FP8 grouped matmul, and the argument checks both paths share."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Weights carry one f32 scale per 128 x 128 block of [K, N] (DeepSeek-V3's and GLM 5's
# published FP8 checkpoints).
SCALE_BLOCK = 128


def check_fp8_args(x, values, scales, group_sizes) -> tuple[int, int, int, int]:
  """Validates the grouped operands and returns (M, K, N, E).

  Raises:
    ValueError: a wrong rank, dtype or shape, naming the operand.
  """
  if x.ndim != 2:
    raise ValueError(f"fp8_grouped_matmul: x must be [M, K], got {x.shape}")
  if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == jnp.float8_e4m3fn:
    raise ValueError(f"fp8_grouped_matmul: x must be bf16/f16/f32, got {x.dtype}")
  if values.ndim != 3 or values.dtype != jnp.float8_e4m3fn:
    raise ValueError("fp8_grouped_matmul: values must be float8_e4m3fn [E, K, N], got "
                     f"{values.dtype} {values.shape}")
  e, k, n = values.shape
  if x.shape[1] != k:
    raise ValueError(f"fp8_grouped_matmul: x has K={x.shape[1]} but the experts have K={k}")
  want = (e, -(-k // SCALE_BLOCK), -(-n // SCALE_BLOCK))
  if scales.shape != want or scales.dtype != jnp.float32:
    raise ValueError(f"fp8_grouped_matmul: scales must be float32 {want} (one per "
                     f"{SCALE_BLOCK}x{SCALE_BLOCK} block), got {scales.dtype} {scales.shape}")
  if group_sizes.shape != (e,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"fp8_grouped_matmul: group_sizes must be integer [{e}], got "
                     f"{group_sizes.dtype} {group_sizes.shape}")
  return x.shape[0], k, n, e


def dequantize_blocks(values: jax.Array, scales: jax.Array) -> jax.Array:
  """[E, K, N] f32: each value times its block's scale (exact in f32)."""
  k, n = values.shape[-2:]
  s = jnp.repeat(jnp.repeat(scales, SCALE_BLOCK, axis=-2), SCALE_BLOCK, axis=-1)
  return values.astype(jnp.float32) * s[..., :k, :n]


@jax.jit
def fp8_grouped_matmul_reference(x: jax.Array, values: jax.Array, scales: jax.Array,
                                 group_sizes: jax.Array) -> jax.Array:
  """What the kernel computes, in jnp: x rounded to bf16, each weight dequantised in f32
  and rounded once to bf16, a ragged dot accumulated in f32.

  Args:
    x: [M, K] rows sorted by expert.
    values: [E, K, N] float8_e4m3fn.
    scales: [E, ceil(K/128), ceil(N/128)] f32.
    group_sizes: [E] rows per expert; rows past their sum are zero.

  Returns:
    [M, N] in x's dtype.
  """
  check_fp8_args(x, values, scales, group_sizes)
  w = dequantize_blocks(values, scales).astype(jnp.bfloat16)
  y = jax.lax.ragged_dot(x.astype(jnp.bfloat16), w, group_sizes.astype(jnp.int32),
                         preferred_element_type=jnp.float32)
  return y.astype(x.dtype)
