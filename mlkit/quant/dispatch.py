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
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import device


def _dispatch_on_weight(fn, key=type, optional=()):
  """Like ``functools.singledispatch`` but keyed on argument 1 (the weight), not 0:
  on ``key(w)``, the weight's type unless told otherwise. The keywords named in
  ``optional`` reach an implementation only when they are not None, so that the
  implementations registered before a keyword existed need not accept it."""
  registry = functools.singledispatch(fn)

  @functools.wraps(fn)
  def wrapper(x, w, *args, **kwargs):
    kwargs = {name: v for name, v in kwargs.items() if v is not None or name not in optional}
    return registry.dispatch(key(w))(x, w, *args, **kwargs)

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
# On a CPU, XLA's ragged_dot does M * G * K * N multiply-adds (every group over every row), after
# copying the whole [G, K, N] weight into a [K, G, N] layout. From this much of that work on
# (a 16-expert 512 x 256 projection over 8 rows), the CPU block forms are faster even for the few
# rows of a decode step (docs/cpu_speed.md).
_CPU_RAGGED_MAX_MACS = 1 << 24
# The weight copy costs about as much as this many rows of that work, whatever M is: with a
# 32-expert 256 x 256 weight, ragged_dot took ~1.2-1.6 ms at 1, 4, 8 and 32 rows alike, and the
# block forms 0.15-0.4 ms, so a batch-1 decode step of SMALL_MLA ran 3.5x slower than a
# batch-8 one (docs/cpu_speed.md).
_CPU_RAGGED_COPY_ROWS = 32


def ragged_dot_f32(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                   blocked: bool | None = None, per_block: bool | None = None) -> jax.Array:
  """``jax.lax.ragged_dot`` with f32 accumulation, in a block-sparse form for many groups.

  XLA's ragged_dot computes every group's matmul over all M rows and masks: on CPU
  that is G times the useful work (and a copy of every expert's weight per call),
  and XLA's GPU compiler expands it into a dense masked product whose [G, M, K]
  operand alone is 26 GB for one MoE projection of a GLM 5.2 prefill chunk. Instead,
  rows are placed into blocks that each belong to one group (each group padded to
  whole blocks) and each block is multiplied by its group's weights: about
  (M + G * block) rows of work, exact up to f32 summation order. Two ways to run them:

  * one block at a time in a loop (``per_block``), one weight [K, N] in flight, so
    memory stays that of x and the output. GPU targets run every block (large blocks;
    a data-dependent trip count would cost a host round trip per block). CPU targets
    skip the blocks past the last group's (a third of them in a decode step of 32 rows
    over 16 experts), and with few rows (a decode step) and no more groups than rows
    give each group a few row slots in one batched matmul instead, which reads every
    weight where it lies (``_expert_slots``). Their gradients come from the batched
    form, whose backward pass is 4x faster than the loop's (``_cpu_grouped``);
  * batched: one matmul over all blocks with their weights gathered, a copy of an
    expert's weight per block (the CPU forms' backward pass, and callers that ask).

  The choice follows the device the trace targets (``pallas_kernels.device.device_kind``),
  not the host: a step compiled for a GPU topology from a CPU host traces on the CPU.

  Args:
    x: rows sorted by group [M, K].
    w: dense per-group weights [G, K, N].
    group_sizes: [G] int, summing to at most M.
    blocked: force (True) or forbid (False, plain ragged_dot) the block-sparse form;
      None picks it when M * G is large enough to matter, or on a CPU target when
      ragged_dot's dense M * G * K * N work and its copy of the weight are.
    per_block: run the blocks one at a time (True) or batched (False); None: one at a time.

  Returns:
    [M, N] f32; rows past sum(group_sizes) are zero.
  """
  group_sizes = group_sizes.astype(jnp.int32)
  M, K = x.shape
  G, _, N = w.shape
  on_cpu = device.device_kind() == "cpu"
  if blocked is None:
    blocked = M * G >= _BLOCKED_MIN_WORK or (
        on_cpu and (M + _CPU_RAGGED_COPY_ROWS) * G * K * N >= _CPU_RAGGED_MAX_MACS)
  if not blocked:
    return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)
  per_block = True if per_block is None else per_block
  fit = _typical_group(M, G)
  if not per_block:
    return _block_batched(x, w, group_sizes, _batched_block(M, G))
  if on_cpu:
    # Half a typical group per block: less padding, and a CPU's matmuls are as fast at
    # 128-256 rows as at 1024; another block only costs one more copy of a weight [K, N].
    return _cpu_grouped(x, w, group_sizes, int(min(256, max(8, fit // 2))))
  # One at a time, a block re-reads its group's whole weight: larger blocks read less.
  return _block_loop(x, w, group_sizes, int(min(1024, max(8, fit))), skip_unused=False)


def _typical_group(M: int, G: int) -> int:
  """The power of two at or above the mean group size ceil(M / G)."""
  return 1 << (max(1, -(-M // G)) - 1).bit_length()


def _batched_block(M: int, G: int) -> int:
  """Block rows of the batched form: a typical group, 8 to 64 (each block copies a weight)."""
  return int(min(64, max(8, _typical_group(M, G))))


class _BlockLayout(NamedTuple):
  """Where each sorted row goes when every group is padded to whole blocks.

  Attributes:
    dest: [M] slot of each row in the blocked rows [n_blocks * block]; rows past the
      groups get the out-of-range slot n_blocks * block.
    valid: [M] whether the row belongs to a group.
    block_group: [n_blocks] the group of each block (trailing padding blocks: the last group).
    used: scalar int32, the blocks that hold rows (they come first).
    n_blocks: static bound on the blocks, ceil(M / block) + G.
  """

  dest: jax.Array
  valid: jax.Array
  block_group: jax.Array
  used: jax.Array
  n_blocks: int


def _block_layout(group_sizes: jax.Array, M: int, block: int) -> _BlockLayout:
  """The blocked placement of M rows sorted by group (group_sizes [G] int32)."""
  G = group_sizes.shape[0]
  n_blocks = -(-M // block) + G  # sum over groups of ceil(size / block) never exceeds this
  ends = jnp.cumsum(group_sizes)
  starts = ends - group_sizes
  padded = (group_sizes + block - 1) // block * block
  pad_ends = jnp.cumsum(padded)
  pad_starts = pad_ends - padded
  rows = jnp.arange(M, dtype=jnp.int32)
  row_group = jnp.searchsorted(ends, rows, side="right")  # [M]; G for rows past the groups
  valid = row_group < G
  g = jnp.minimum(row_group, G - 1)
  dest = jnp.where(valid, pad_starts[g] + rows - starts[g], n_blocks * block)
  block_group = jnp.minimum(
      jnp.searchsorted(pad_ends, jnp.arange(n_blocks, dtype=jnp.int32) * block, side="right"),
      G - 1)
  return _BlockLayout(dest, valid, block_group, pad_ends[-1] // block, n_blocks)


def _unblock(yp: jax.Array, layout: _BlockLayout) -> jax.Array:
  """Rows [M, N] back from the blocked rows yp [n_blocks * block, N]; rows past the groups zero."""
  y = jnp.take(yp, jnp.minimum(layout.dest, yp.shape[0] - 1), axis=0)
  return jnp.where(layout.valid[:, None], y, 0.0)


def _block_batched(x: jax.Array, w: jax.Array, group_sizes: jax.Array, block: int) -> jax.Array:
  """The block-sparse product as one batched matmul over gathered weights: [M, N] f32."""
  M, K = x.shape
  lay = _block_layout(group_sizes, M, block)
  xp = jnp.zeros((lay.n_blocks * block, K), x.dtype).at[lay.dest].set(x, mode="drop")
  yp = jnp.einsum("bmk,bkn->bmn", xp.reshape(lay.n_blocks, block, K), w[lay.block_group],
                  preferred_element_type=jnp.float32)
  return _unblock(yp.reshape(lay.n_blocks * block, -1), lay)


def _block_loop(x: jax.Array, w: jax.Array, group_sizes: jax.Array, block: int, *,
                skip_unused: bool) -> jax.Array:
  """The block-sparse product one block at a time: [M, N] f32.

  ``skip_unused``: blocks past the used ones run an empty ``lax.cond`` branch instead of
  a matmul (on a CPU; a GPU would sync with the host for every block's predicate).
  """
  M, K = x.shape
  N = w.shape[2]
  lay = _block_layout(group_sizes, M, block)
  Mp = lay.n_blocks * block
  # Padding slots read row 0: their outputs are never gathered back.
  src = jnp.zeros((Mp,), jnp.int32).at[lay.dest].set(jnp.arange(M, dtype=jnp.int32), mode="drop")
  xb = x[src].reshape(lay.n_blocks, block, K)
  # The output buffer starts as one of this call's values broadcast, so it exists only
  # while this call runs. A constant zero buffer would be built by XLA at the start of the
  # step and kept live through it; behind an optimization_barrier with the rows it still
  # was: XLA shared one zero broadcast among every layer's barrier (the same shape), so it
  # lived from the first layer to the last, with a copy per layer (624 + 208 MiB in GLM
  # 5.2's FP8 prefill; docs/serving_step_memory.md). Its values never matter: every block
  # whose rows are gathered back is written, and _unblock selects zeros for the others.
  yp = jnp.broadcast_to(xb[0, 0, 0].astype(jnp.float32), (lay.n_blocks, block, N))

  def one_block(i, yp):
    y = jnp.dot(xb[i], w[lay.block_group[i]], preferred_element_type=jnp.float32)  # [block, N]
    return jax.lax.dynamic_update_index_in_dim(yp, y, i, 0)

  def one_block_if_used(i, yp):
    return jax.lax.cond(i < lay.used, one_block, lambda i, yp: yp, i, yp)

  yp = jax.lax.fori_loop(0, lay.n_blocks, one_block_if_used if skip_unused else one_block, yp)
  return _unblock(yp.reshape(Mp, N), lay)


def _expert_slots(x: jax.Array, w: jax.Array, group_sizes: jax.Array, slots: int,
                  overflow) -> jax.Array:
  """The product with each group's rows in ``slots`` rows of its own: [M, N] f32.

  One batched matmul [G, slots, K] x [G, K, N] reads every weight where it lies; the
  block loop copies a group's weight before each block's matmul (XLA's CPU dot does not
  read a dynamic slice in place), which in a decode step costs as much as the matmuls.
  Empty slots multiply zeros. A call where some group has more rows than slots returns
  ``overflow()`` (the block loop) instead, so any routing is exact.
  """
  M, K = x.shape
  G = w.shape[0]
  ends = jnp.cumsum(group_sizes)
  starts = ends - group_sizes
  slot = jnp.arange(slots, dtype=jnp.int32)
  live = slot[None, :] < group_sizes[:, None]  # [G, slots]
  xs = jnp.where(live[..., None], x[jnp.minimum(starts[:, None] + slot[None, :], M - 1)], 0)
  ys = jnp.einsum("gsk,gkn->gsn", xs, w, preferred_element_type=jnp.float32)  # [G, slots, N]
  rows = jnp.arange(M, dtype=jnp.int32)
  g = jnp.minimum(jnp.searchsorted(ends, rows, side="right"), G - 1)  # [M]
  offset = rows - starts[g]
  y = jnp.where((rows < ends[-1])[:, None], ys[g, jnp.minimum(offset, slots - 1)], 0.0)
  return jax.lax.cond(jnp.any(group_sizes > slots), overflow, lambda: y)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _cpu_grouped(x: jax.Array, w: jax.Array, group_sizes: jax.Array, block: int) -> jax.Array:
  """The CPU block-sparse product, with the batched form's gradients.

  Few rows (M * G below ``_BLOCKED_MIN_WORK``) over no more groups than rows: expert
  slots (twice the mean group, at least 8); otherwise, or when a group overflows its
  slots, the block loop with the unused blocks skipped.

  Differentiating the loop itself would add a whole [G, K, N] weight cotangent per block
  (the transpose of a scan over a closed-over weight); the batched form gives the same
  gradients of the same product in one scatter-add. Its forward is dead code in the
  backward pass, so XLA drops it.
  """
  M, G = x.shape[0], w.shape[0]

  def loop():
    return _block_loop(x, w, group_sizes, block, skip_unused=True)

  if G <= M and M * G < _BLOCKED_MIN_WORK:
    return _expert_slots(x, w, group_sizes, min(M, max(8, 2 * -(-M // G))), loop)
  return loop()


def _cpu_grouped_fwd(x, w, group_sizes, block):
  return _cpu_grouped(x, w, group_sizes, block), (x, w, group_sizes)


def _cpu_grouped_bwd(_, res, ct):
  x, w, group_sizes = res
  block = _batched_block(x.shape[0], w.shape[0])
  _, vjp = jax.vjp(lambda x, w: _block_batched(x, w, group_sizes, block), x, w)
  return (*vjp(ct), None)


_cpu_grouped.defvjp(_cpu_grouped_fwd, _cpu_grouped_bwd)


@functools.partial(_dispatch_on_weight, optional=("schedule",))
def grouped_matmul(x: jax.Array, w, group_sizes: jax.Array, *, out_dtype=None,
                   backend: str | None = None, schedule=None) -> jax.Array:
  """Ragged grouped matmul for experts, like ``jax.lax.ragged_dot``.

  Args:
    x: rows sorted by group [M, K].
    w: per-group weights [G, K, N] (plain array or registered format).
    group_sizes: rows per group [G] int32, summing to at most M.
    out_dtype: result dtype (default: ``x.dtype``).
    backend: kernel backend, as for :func:`matmul`.
    schedule: None, or the tile schedule table computed ahead for these group sizes
      (for the :func:`schedule_spec` of this call's weights); formats whose kernels
      read no schedule ignore it.

  Returns:
    [M, N]; rows past ``sum(group_sizes)`` are zero.
  """
  del backend, schedule
  out_dtype = out_dtype or x.dtype
  return ragged_dot_f32(x, w.astype(x.dtype), group_sizes).astype(out_dtype)


def _shared_type(ws) -> type:
  """The type every weight of ``ws`` has, or ``object`` (the default case) when they differ."""
  types = {type(w) for w in ws}
  return types.pop() if len(types) == 1 else object


@functools.partial(_dispatch_on_weight, key=_shared_type, optional=("schedule",))
def grouped_matmuls(x: jax.Array, ws, group_sizes: jax.Array, *, out_dtype=None,
                    backend: str | None = None, schedule=None) -> tuple[jax.Array, ...]:
  """Several grouped matmuls over the same rows: ``grouped_matmul(x, w, group_sizes)``
  for each weight of ``ws`` (an expert FFN's gate and up).

  Dispatch keys on the weights' type when they all share one (else this default). The
  default runs them one by one, so plain arrays, FP8 and mixed formats compute exactly
  what separate calls do; a format registered here may run them together, e.g. the
  int4 kernels' one launch for both projections (docs/int4_matmul.md, "Gate and up in
  one launch").

  Args:
    x: rows sorted by group [M, K].
    ws: a sequence of per-group weights [G, K, N_i] (plain arrays or registered formats).
    group_sizes: rows per group [G] int32, summing to at most M.
    out_dtype: the results' dtype (default: ``x.dtype``).
    backend: kernel backend, as for :func:`matmul`.
    schedule: as for :func:`grouped_matmul`, handed to each.

  Returns:
    A tuple of [M, N_i], one per weight; rows past ``sum(group_sizes)`` are zero.
  """
  return tuple(grouped_matmul(x, w, group_sizes, out_dtype=out_dtype, backend=backend,
                              schedule=schedule) for w in ws)


@functools.partial(_dispatch_on_weight, key=_shared_type)
def schedule_spec(m: int, ws, *, backend: str | None = None):
  """The tile schedule that the grouped matmuls of every weight of ``ws`` over ``m`` rows
  would each compute from the group sizes, when they share one; else None.

  A caller that knows the group sizes first (the MoE layer's sort kernel) can write the
  table once for this spec and hand it to each call (``schedule=``), saving the calls'
  own schedule launch. Dispatch keys on the weights' shared type; the default (plain
  arrays, FP8, mixed formats) has no schedule: None.

  Args:
    m: rows of the grouped matmuls' x.
    ws: the per-group weights [G, K_i, N_i] of the calls (e.g. an expert FFN's gate, up
      and down).
    backend: kernel backend, as for :func:`matmul`.

  Returns:
    A static spec (for int4 weights ``pallas_kernels.int4_matmul.GroupedSchedule``) or
    None.
  """
  del m, ws, backend
  return None


@functools.singledispatch
def dequantize(w, dtype=None) -> jax.Array:
  """Returns the dense array a weight stands for (identity for plain arrays)."""
  return w if dtype is None else w.astype(dtype)
