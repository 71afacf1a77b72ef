"""SwiGLU from the gate and up projections' split-K partial sums, in jnp: the reference
of ``swiglu_parts``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def silu_times(gate: jax.Array, up: jax.Array, dtype) -> jax.Array:
  """``silu(gate) * up`` as XLA computes ``jax.nn.silu(g) * u`` over ``dtype`` operands,
  from the projections' f32 sums gate, up [...].

  Each sum rounds to ``dtype`` (what the matmul returns), then every step of
  ``silu(g) = g / (1 + exp(-g))`` and the product round to ``dtype`` as XLA's GPU code
  rounds the ``dtype`` ops of that expression: exp(-g), 1 + that, its reciprocal (taken
  in f32), g times it, times u. Written as f32 ops with explicit roundings, the same
  steps lower alike in a Triton kernel and in XLA (for f32 operands the roundings are
  exact).

  Returns:
    [...] in ``dtype``.
  """
  f32 = jnp.float32

  def rnd(v):
    return v.astype(dtype).astype(f32)

  g, u = rnd(gate), rnd(up)
  sig = rnd(1.0 / rnd(1.0 + rnd(jnp.exp(-g))))
  return (rnd(g * sig) * u).astype(dtype)


def swiglu_parts_reference(gate_parts: jax.Array, up_parts: jax.Array, *, dtype) -> jax.Array:
  """``silu(gate) * up`` from the gate and up projections' split-K partial sums.

  Args:
    gate_parts, up_parts: [S, M, F] f32: part s is the projection of x's s-th slice of D
      (x[:, slice] @ w[slice, :]).
    dtype: the projections' dtype (x's, what ``matmul`` returns) and the result's.

  Returns:
    [M, F] in ``dtype``: each projection's sum over S, added in order (as the kernel adds
    them), then :func:`silu_times`.
  """
  return silu_times(functools.reduce(jnp.add, list(gate_parts)),
                    functools.reduce(jnp.add, list(up_parts)), dtype)
