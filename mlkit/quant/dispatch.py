"""Type-dispatched matmuls.

Plain arrays are the default case. Quantised formats register their own
implementations with ``matmul.register(Int4Weight)`` etc., so the model never
needs to know which formats exist. Dispatch keys on the *weight's* Python type
(the second argument of ``matmul``/``grouped_matmul``; plain
``functools.singledispatch`` would key on the activations), which survives
``jit`` because the formats are pytrees.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _dispatch_on_weight(fn):
  """Like ``functools.singledispatch`` but keyed on argument 1 (the weight), not 0."""
  registry = functools.singledispatch(fn)

  @functools.wraps(fn)
  def wrapper(x, w, *args, **kwargs):
    return registry.dispatch(type(w))(x, w, *args, **kwargs)

  wrapper.register = registry.register
  wrapper.dispatch = registry.dispatch
  wrapper.registry = registry.registry
  return wrapper


@_dispatch_on_weight
def matmul(x: jax.Array, w, *, out_dtype=None, backend: str | None = None) -> jax.Array:
  """``x @ w`` with fp32 accumulation.

  Args:
    x: activations [..., K].
    w: weight [K, N]: a plain array or any registered quantised format.
    out_dtype: result dtype (default: ``x.dtype``).
    backend: kernel backend for formats that have a Pallas kernel ("pallas" |
      "interpret" | "xla" | None for the platform default); plain arrays ignore it.

  Returns:
    [..., N] in ``out_dtype``.
  """
  del backend  # XLA's dot is the kernel for dense weights
  out_dtype = out_dtype or x.dtype
  y = jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)
  return y.astype(out_dtype)


@_dispatch_on_weight
def grouped_matmul(x: jax.Array, w, group_sizes: jax.Array, *, out_dtype=None,
                   backend: str | None = None) -> jax.Array:
  """Ragged grouped matmul for experts, like ``jax.lax.ragged_dot``.

  Args:
    x: rows sorted by group [M, K].
    w: per-group weights [G, K, N] (plain array or registered format).
    group_sizes: rows per group [G] int32, summing to at most M.
    out_dtype: result dtype (default: ``x.dtype``).
    backend: kernel backend, as for :func:`matmul`.

  Returns:
    [M, N]; rows past ``sum(group_sizes)`` are zero.
  """
  del backend
  out_dtype = out_dtype or x.dtype
  y = jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes.astype(jnp.int32),
                         preferred_element_type=jnp.float32)
  return y.astype(out_dtype)


@functools.singledispatch
def dequantize(w, dtype=None) -> jax.Array:
  """Returns the dense array a weight stands for (identity for plain arrays)."""
  return w if dtype is None else w.astype(dtype)
