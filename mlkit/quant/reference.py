"""XLA reference matmuls for the quantised formats: unpack, dequantise, dot in f32.

These are the numerical references the Pallas kernels must match, and what
:func:`mlkit.quant.matmul` / :func:`grouped_matmul` run for the "xla" backend
(see ``mlkit.quant.kernels``).

Dequantisation is exact in f32 (int4 * scale, fp8 * scale); the dense weight is
then cast to the activation dtype, so a bf16 run rounds each weight once, as a
kernel feeding bf16 tensor cores does, and accumulates in f32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mlkit.quant.dispatch import dequantize, ragged_dot_f32
from mlkit.quant.formats import Fp8Weight, Int4Weight


def _when_needed(x: jax.Array, w):
  """(x, w) with w's dequantisation unable to start before x exists.

  A weight's dequantisation depends on the params alone, so XLA is free to schedule
  it at the start of a step; it does, for every layer at once, and a model then holds
  all its layers' dense weights together (5.8 GB per MoE layer for GLM 5.2's fp8
  experts on one of 8 GPUs). Tying the weight to the activations keeps one layer's
  dense weights alive at a time. Values are unchanged.
  """
  return jax.lax.optimization_barrier((x, w))


def _dense_matmul(x: jax.Array, w_dense: jax.Array, out_dtype) -> jax.Array:
  if x.shape[-1] != w_dense.shape[-2]:
    raise ValueError(f"matmul: x has K={x.shape[-1]} but the weight has K={w_dense.shape[-2]}")
  y = jnp.dot(x, w_dense.astype(x.dtype), preferred_element_type=jnp.float32)
  return y.astype(out_dtype or x.dtype)


def _dense_grouped(x: jax.Array, w_dense: jax.Array, group_sizes: jax.Array, out_dtype):
  if w_dense.ndim != 3:
    raise ValueError(f"grouped_matmul: expert weight must be [G, K, N], got {w_dense.shape}")
  if x.shape[-1] != w_dense.shape[-2]:
    raise ValueError(f"grouped_matmul: x has K={x.shape[-1]} but the weight has K={w_dense.shape[-2]}")
  y = ragged_dot_f32(x, w_dense.astype(x.dtype), group_sizes)
  return y.astype(out_dtype or x.dtype)


def int4_matmul_reference(x: jax.Array, w: Int4Weight, *, out_dtype=None) -> jax.Array:
  """``x @ dequantize(w)`` for an int4 weight, f32 accumulation.

  Args:
    x: activations [..., K] (bf16 or f32).
    w: :class:`Int4Weight` standing for [K, N].
    out_dtype: result dtype (default ``x.dtype``).

  Returns:
    [..., N] in ``out_dtype``.
  """
  with jax.named_scope("int4_matmul_reference"):
    x, w = _when_needed(x, w)
    return _dense_matmul(x, dequantize(w, jnp.float32), out_dtype)


def int4_grouped_matmul_reference(x: jax.Array, w: Int4Weight, group_sizes: jax.Array, *,
                                  out_dtype=None) -> jax.Array:
  """Ragged grouped matmul over int4 experts, f32 accumulation.

  Args:
    x: rows sorted by group [M, K].
    w: :class:`Int4Weight` standing for [G, K, N].
    group_sizes: rows per group [G] int32, summing to at most M (groups may be empty).
    out_dtype: result dtype (default ``x.dtype``).

  Returns:
    [M, N]; row m uses the expert whose row range contains m; rows past
    ``sum(group_sizes)`` are zero.
  """
  with jax.named_scope("int4_grouped_matmul_reference"):
    x, w = _when_needed(x, w)
    return _dense_grouped(x, dequantize(w, jnp.float32), group_sizes, out_dtype)


def fp8_matmul_reference(x: jax.Array, w: Fp8Weight, *, out_dtype=None) -> jax.Array:
  """``x @ dequantize(w)`` for an fp8 weight, f32 accumulation.

  Args:
    x: activations [..., K].
    w: :class:`Fp8Weight` standing for [K, N].
    out_dtype: result dtype (default ``x.dtype``).

  Returns:
    [..., N] in ``out_dtype``.
  """
  with jax.named_scope("fp8_matmul_reference"):
    x, w = _when_needed(x, w)
    return _dense_matmul(x, dequantize(w, jnp.float32), out_dtype)


def fp8_grouped_matmul_reference(x: jax.Array, w: Fp8Weight, group_sizes: jax.Array, *,
                                 out_dtype=None) -> jax.Array:
  """Ragged grouped matmul over fp8 experts, f32 accumulation.

  Args:
    x: rows sorted by group [M, K].
    w: :class:`Fp8Weight` standing for [G, K, N].
    group_sizes: rows per group [G] int32, summing to at most M (groups may be empty).
    out_dtype: result dtype (default ``x.dtype``).

  Returns:
    [M, N]; rows past ``sum(group_sizes)`` are zero.
  """
  with jax.named_scope("fp8_grouped_matmul_reference"):
    x, w = _when_needed(x, w)
    return _dense_grouped(x, dequantize(w, jnp.float32), group_sizes, out_dtype)
