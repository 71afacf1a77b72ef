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

from pallas_kernels import device


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


# Below this many (rows x groups), XLA's ragged_dot is as fast and compiles faster.
_BLOCKED_MIN_WORK = 4096


def ragged_dot_f32(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                   blocked: bool | None = None, per_block: bool | None = None) -> jax.Array:
  """``jax.lax.ragged_dot`` with f32 accumulation, in a block-sparse form for many groups.

  XLA's ragged_dot computes every group's matmul over all M rows and masks: on CPU
  that is G times the useful work, and XLA's GPU compiler expands it into a dense
  masked product whose [G, M, K] operand alone is 26 GB for one MoE projection of a
  GLM 5.2 prefill chunk. Instead, rows are placed into blocks that each belong to one
  group (each group padded to whole blocks) and each block is multiplied by its
  group's weights: about (M + G * block) rows of work, exact up to f32 summation
  order. On CPU the blocks run as one batched matmul over gathered weights (fast,
  small blocks); elsewhere one block at a time in a loop (large blocks, one
  weight [K, N] in flight), so memory stays that of x and the output. The choice
  follows the device the trace targets (``pallas_kernels.device.device_kind``), not
  the host: a step compiled for a GPU topology from a CPU host traces on the CPU.

  Args:
    x: rows sorted by group [M, K].
    w: dense per-group weights [G, K, N].
    group_sizes: [G] int, summing to at most M.
    blocked: force (True) or forbid (False, plain ragged_dot) the block-sparse form;
      None picks it when M * G is large enough to matter.
    per_block: run the blocks one at a time (True) or batched (False); None: batched
      on a CPU target, one at a time elsewhere.

  Returns:
    [M, N] f32; rows past sum(group_sizes) are zero.
  """
  group_sizes = group_sizes.astype(jnp.int32)
  M, K = x.shape
  G, _, N = w.shape
  on_cpu = device.device_kind() == "cpu"
  if blocked is None:
    blocked = M * G >= _BLOCKED_MIN_WORK
  if not blocked:
    return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)
  per_block = not on_cpu if per_block is None else per_block
  per_group = max(1, -(-M // G))
  # One at a time, a block re-reads its group's whole weight: larger blocks read less.
  block = int(min(1024 if per_block else 64, max(8, 1 << (per_group - 1).bit_length())))
  n_blocks = -(-M // block) + G  # sum over groups of ceil(size / block) never exceeds this
  Mp = n_blocks * block
  ends = jnp.cumsum(group_sizes)
  starts = ends - group_sizes
  padded = (group_sizes + block - 1) // block * block
  pad_ends = jnp.cumsum(padded)
  pad_starts = pad_ends - padded
  rows = jnp.arange(M, dtype=jnp.int32)
  row_group = jnp.searchsorted(ends, rows, side="right")  # [M]; G for rows past the groups
  valid = row_group < G
  g = jnp.minimum(row_group, G - 1)
  dest = jnp.where(valid, pad_starts[g] + rows - starts[g], Mp)  # [M] slot in the blocked rows
  block_group = jnp.minimum(
      jnp.searchsorted(pad_ends, jnp.arange(n_blocks, dtype=jnp.int32) * block, side="right"),
      G - 1)  # [n_blocks]; trailing padding blocks reuse the last group's weights
  if per_block:
    # Padding slots read row 0: their outputs are never gathered back.
    src = jnp.zeros((Mp,), jnp.int32).at[dest].set(rows, mode="drop")
    xb = x[src].reshape(n_blocks, block, K)
    # The output buffer is tied to this call's rows: a constant zero buffer would be
    # hoisted by XLA to the start of the step, once per layer, all live at once.
    yp, xb = jax.lax.optimization_barrier((jnp.zeros((n_blocks, block, N), jnp.float32), xb))

    def one_block(i, yp):
      y = jnp.dot(xb[i], w[block_group[i]], preferred_element_type=jnp.float32)  # [block, N]
      return jax.lax.dynamic_update_index_in_dim(yp, y, i, 0)

    yp = jax.lax.fori_loop(0, n_blocks, one_block, yp).reshape(Mp, N)
  else:
    xp = jnp.zeros((Mp, K), x.dtype).at[dest].set(x, mode="drop")  # [Mp, K]
    yp = jnp.einsum("bmk,bkn->bmn", xp.reshape(n_blocks, block, K), w[block_group],
                    preferred_element_type=jnp.float32).reshape(Mp, N)
  y = jnp.take(yp, jnp.minimum(dest, Mp - 1), axis=0)
  return jnp.where(valid[:, None], y, 0.0)


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
  return ragged_dot_f32(x, w.astype(x.dtype), group_sizes).astype(out_dtype)


@functools.singledispatch
def dequantize(w, dtype=None) -> jax.Array:
  """Returns the dense array a weight stands for (identity for plain arrays)."""
  return w if dtype is None else w.astype(dtype)
