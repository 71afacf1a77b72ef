"""The (token, choice) pairs sorted by expert in one Pallas Triton launch: ``sort_by_expert``.

The grouped matmuls read their rows sorted by expert. XLA built that order as a sort
(``argsort``), a scatter for the inverse permutation, a reduction for the row offsets
and gathers of each row's token and weight. At a decode step's few rows (N x k =
512 for 64 tokens and k = 8) this kernel does it by counting: pair i's row is the
number of pairs with a smaller expert, plus those with its expert and a smaller
index (a stable sort), found in [block, chunk] comparisons against every pair. Each
program places a block of pairs and scatters their token and weight to their rows
(every row once: no two lanes share an address); program 0 also counts the row
offsets of every expert. The comparisons grow with the square of the rows, so the
op runs it up to ``MAX_ROWS`` pairs and the jnp reference
(``sort_by_expert_reference``) above. One device's sort (``sort_by_expert_local``) can
also write the grouped matmuls' tile schedule from the counts of program 0 (its
``schedule``). docs/moe_router.md has the design.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import dispatch
from pallas_kernels.int4_matmul.schedule_kernel import (GroupedSchedule, ScheduleTable,
                                                        schedule_segments, write_schedule)
from pallas_kernels.moe_router.reference import (sort_by_expert_local_reference,
                                                 sort_by_expert_reference)
from pallas_kernels.schedule import pow2_at_least

MAX_ROWS = 4096  # N x k up to which the kernel runs (the comparisons are (N x k)^2)
_BLOCK = 32  # pairs a program places
_CHUNK_ELEMENTS = 4096  # comparisons a [block, chunk] step holds
MAX_EXPERTS = _CHUNK_ELEMENTS - 1  # the row offsets' [E + 1, chunk] step fits one
_NUM_WARPS = 4


def _kernel(ids_ref, w_ref, shard_ref, token_ref, roww_ref, slot_ref, cum_ref, *table_ref, p: int,
            k: int, e: int, local: int, bi: int, bj: int, be: int, bje: int,
            schedule: GroupedSchedule | None):
  """Refs: the flat [P] experts and weights, and [1] the device's shard index (read when
  ``local``); out: token_of [P], row_weights [P], slot [P] and cum [be], and with a
  ``schedule`` its table [5, schedule.width]. With ``local`` experts [first, first +
  local), first = shard x local, rows are numbered from the first local expert's (rows of
  other experts after them), slot is -1 for other experts' pairs, and cum holds the
  local experts' row counts instead of every expert's offsets."""
  i = pl.program_id(0) * bi + lax.broadcasted_iota(jnp.int32, (bi,), 0)  # [bi] pairs
  e_i = pltriton.load(ids_ref.at[i])
  # The multiply is the kernel's: done by XLA, it is a launch of its own.
  first = shard_ref[0] * local if local else 0
  last = first + local

  def chunk(c, size):  # experts of pairs [c * size, c * size + size); past P: E (before none)
    j = c * size + lax.broadcasted_iota(jnp.int32, (size,), 0)
    return j, pltriton.load(ids_ref.at[jnp.minimum(j, p - 1)], mask=j < p, other=e)

  def before(c, counts):  # pairs placed before each of ours: smaller expert, or same and earlier
    count, start, end = counts
    j, e_j = chunk(c, bj)
    first_ = ((e_j[None, :] < e_i[:, None])
              | ((e_j[None, :] == e_i[:, None]) & (j[None, :] < i[:, None])))
    count = count + jnp.sum(first_.astype(jnp.int32), axis=1)
    if local:  # pairs before the local experts, and before the experts after them
      start = start + jnp.sum((e_j < first).astype(jnp.int32))
      end = end + jnp.sum((e_j < last).astype(jnp.int32))
    return count, start, end

  zero = jnp.int32(0)
  row, start, end = lax.fori_loop(0, pl.cdiv(p, bj), before,
                                  (jnp.zeros((bi,), jnp.int32), zero, zero))
  if local:
    # Local rows [0, end - start), then the rows before them, then those after: every row
    # once. Only local pairs have a slot.
    here = (e_i >= first) & (e_i < last)
    pltriton.store(slot_ref.at[i], jnp.where(here, row - start, -1))
    row = jnp.where(here, row - start, jnp.where(row < start, row + (end - start), row))
  else:
    pltriton.store(slot_ref.at[i], row)
  pltriton.store(token_ref.at[row], i // k)
  pltriton.store(roww_ref.at[row], pltriton.load(w_ref.at[i]))

  @pl.when(pl.program_id(0) == 0)
  def _():
    ee = first + lax.broadcasted_iota(jnp.int32, (be,), 0)

    def below(c, cum):  # pairs with an expert below each e (local: equal to each e)
      _, e_j = chunk(c, bje)
      hit = (e_j[None, :] == ee[:, None]) if local else (e_j[None, :] < ee[:, None])
      return cum + jnp.sum(hit.astype(jnp.int32), axis=1)

    cum = lax.fori_loop(0, pl.cdiv(p, bje), below, jnp.zeros((be,), jnp.int32))
    pltriton.store(cum_ref.at[ee - first], cum)
    if schedule is not None:
      # The grouped matmuls' tile schedule from the local experts' counts, still in
      # registers (be = schedule_segments(local): the counts past them read 0), where
      # grouped_schedule_pallas would load them in a launch of its own.
      write_schedule(jnp.where(ee - first < local, cum, 0), table_ref[0], schedule)


@functools.partial(jax.jit, static_argnames=("n_experts", "local", "interpret", "schedule"))
def _sort_pallas(expert_ids, weights, shard, *, n_experts, local, interpret, schedule=None):
  n, k = expert_ids.shape
  p = n * k
  bi = min(p & -p, _BLOCK)  # divides P: every store is whole, unmasked
  be = pow2_at_least(local or n_experts + 1)
  if schedule is not None:  # the counts are the schedule's [E + 1] segments (a power of two)
    be = schedule_segments(local)
  bj = min(pow2_at_least(p), _CHUNK_ELEMENTS // bi)
  bje = max(1, min(pow2_at_least(p), _CHUNK_ELEMENTS // be))
  kernel = functools.partial(_kernel, p=p, k=k, e=n_experts, local=local, bi=bi, bj=bj,
                             be=be, bje=bje, schedule=schedule)
  out_shape = (jax.ShapeDtypeStruct((p,), jnp.int32), jax.ShapeDtypeStruct((p,), jnp.float32),
               jax.ShapeDtypeStruct((p,), jnp.int32), jax.ShapeDtypeStruct((be,), jnp.int32))
  if schedule is not None:
    out_shape += (jax.ShapeDtypeStruct((5, schedule.width), jnp.int32),)
  token_of, row_weights, slot, cum, *table = pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=(p // bi,),
      compiler_params=pltriton.CompilerParams(num_warps=_NUM_WARPS, num_stages=1),
      interpret=interpret,
      name="sort_by_expert",
  )(expert_ids.reshape(p), weights.reshape(p), shard.reshape(1))
  out = token_of, row_weights, slot.reshape(n, k), cum[:local or n_experts + 1]
  return out if schedule is None else (*out, ScheduleTable(table[0], schedule))


def _check_pairs(expert_ids: jax.Array, weights: jax.Array) -> None:
  if expert_ids.ndim != 2 or expert_ids.dtype != jnp.int32 or not expert_ids.size:
    raise ValueError(f"expert_ids must be int32 [N >= 1, k >= 1], got {expert_ids.dtype} "
                     f"{expert_ids.shape}")
  if weights.shape != expert_ids.shape or weights.dtype != jnp.float32:
    raise ValueError(f"weights must be float32 {expert_ids.shape}, got {weights.dtype} "
                     f"{weights.shape}")


def sort_by_expert(expert_ids: jax.Array, weights: jax.Array, n_experts: int, *,
                   backend: str | None = None):
  """The (token, choice) pairs sorted by expert (stably), as the grouped matmuls read them.

  Args:
    expert_ids: [N, k] int32 experts in [0, n_experts).
    weights: [N, k] f32 combine weights.
    n_experts: E.
    backend: "pallas" | "interpret" (this kernel, up to MAX_ROWS pairs and
      MAX_EXPERTS experts; the reference past them, such as a prefill's rows) | "xla"
      (the reference) | None.

  Returns:
    (token_of [N*k] int32, row_weights [N*k] f32, slot [N, k] int32, cum [E + 1]
    int32), as :func:`sort_by_expert_reference`.

  Raises:
    ValueError: bad shapes or dtypes.
  """
  _check_pairs(expert_ids, weights)
  if n_experts < 1:
    raise ValueError(f"n_experts must be positive, got {n_experts}")
  backend = dispatch.resolve_backend(backend)
  if backend == "xla" or expert_ids.size > MAX_ROWS or n_experts > MAX_EXPERTS:
    return sort_by_expert_reference(expert_ids, weights, n_experts)
  return _sort_differentiable(expert_ids, weights, n_experts, backend == "interpret")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _sort_differentiable(expert_ids, weights, n_experts, interpret):
  """The kernel, differentiable in the weights: row slot[i] holds pair i's weight, so
  its gradient is the rows' gradient read at the slots."""
  return _sort_pallas(expert_ids, weights, jnp.zeros((), jnp.int32), n_experts=n_experts,
                      local=0, interpret=interpret)


def _sort_fwd(expert_ids, weights, n_experts, interpret):
  out = _sort_differentiable(expert_ids, weights, n_experts, interpret)
  return out, (expert_ids, out[2])


def _sort_bwd(n_experts, interpret, res, grads):
  expert_ids, slot = res
  return (jnp.zeros(expert_ids.shape, jax.dtypes.float0),
          grads[1][slot.reshape(-1)].reshape(slot.shape))


_sort_differentiable.defvjp(_sort_fwd, _sort_bwd)


def sort_by_expert_local(expert_ids: jax.Array, weights: jax.Array, n_experts: int,
                         shard: jax.Array, n_shards: int, *, backend: str | None = None,
                         schedule: GroupedSchedule | None = None):
  """:func:`sort_by_expert` as one device of expert parallelism reads it: its own
  experts' rows first.

  The experts split into ``n_shards`` runs of E / n_shards; device ``shard`` holds
  experts [first, first + n_local) with n_local = E / n_shards and first = shard x
  n_local, and runs the rows of those experts only. Sorted globally, it would slice them
  out of the sorted rows, shift the slots of its pairs and mark the others', and
  difference the offsets into its experts' row counts: launches of their own on a GPU,
  per layer. Here the sort numbers the rows that way itself (docs/moe_router.md).

  Args:
    expert_ids: [N, k] int32 experts in [0, n_experts).
    weights: [N, k] f32 combine weights.
    n_experts: E.
    shard: int32 scalar, the device's index along the expert axes (a traced value:
      ``lax.axis_index``).
    n_shards: the devices the experts split over; it divides E.
    backend: as :func:`sort_by_expert`.
    schedule: None, or the grouped matmuls' tile schedule to write for the sizes
      (``int4_matmul.grouped_schedule_spec(N*k, n_local, ...)``): the kernel's program 0
      writes its table beside the sizes it counts, in the same launch, where the
      grouped calls would compute it in one of their own (docs/moe_router.md, "The
      sort writes the schedule").

  Returns:
    (token_of [N*k] int32: rows [0, count) are the local experts' pairs sorted by
    expert (stably), the other rows hold the other pairs; row_weights [N*k] f32, each
    row's weight; slot [N, k] int32: the row of each local pair, -1 for the others';
    sizes [n_local] int32: each local expert's rows), as
    :func:`sort_by_expert_local_reference`. With a ``schedule``, a fifth element: its
    :class:`ScheduleTable` (``grouped_schedule_pallas``'s table for the sizes, bit for
    bit), or None where the jnp reference sorts (the grouped calls then compute it).

  Raises:
    ValueError: bad shapes or dtypes, n_shards that does not divide E, or a schedule
      not made for N*k rows over n_local experts.
  """
  _check_pairs(expert_ids, weights)
  if n_shards < 1 or n_experts % n_shards:
    raise ValueError(f"n_shards must divide n_experts={n_experts}, got {n_shards}")
  shard = jnp.asarray(shard)
  if shard.shape != () or shard.dtype != jnp.int32:
    raise ValueError(f"shard must be an int32 scalar, got {shard.dtype} {shard.shape}")
  backend = dispatch.resolve_backend(backend)
  n_local = n_experts // n_shards
  if schedule is not None and (not isinstance(schedule, GroupedSchedule)
                               or (schedule.m, schedule.experts) != (expert_ids.size, n_local)):
    raise ValueError(f"schedule must be a GroupedSchedule for m={expert_ids.size} rows over "
                     f"experts={n_local}, got {schedule}")
  if backend == "xla" or expert_ids.size > MAX_ROWS or n_local > MAX_EXPERTS:
    out = sort_by_expert_local_reference(expert_ids, weights, n_experts, shard, n_shards)
    return out if schedule is None else (*out, None)
  return _local_differentiable(expert_ids, weights, shard, n_experts, n_shards,
                               backend == "interpret", schedule)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _local_differentiable(expert_ids, weights, shard, n_experts, n_shards, interpret, schedule):
  """The kernel, differentiable in the weights as the reference is."""
  return _sort_pallas(expert_ids, weights, shard, n_experts=n_experts,
                      local=n_experts // n_shards, interpret=interpret, schedule=schedule)


def _local_fwd(expert_ids, weights, shard, n_experts, n_shards, interpret, schedule):
  out = _local_differentiable(expert_ids, weights, shard, n_experts, n_shards, interpret,
                              schedule)
  return out, (expert_ids, weights, shard)


def _local_bwd(n_experts, n_shards, interpret, schedule, res, grads):
  # The reference's rows are the kernel's, so its VJP in the weights is the kernel's (the
  # schedule is integers, as the sizes are).
  expert_ids, weights, shard = res
  _, vjp = jax.vjp(lambda w: sort_by_expert_local_reference(expert_ids, w, n_experts, shard,
                                                            n_shards), weights)
  (g,) = vjp(tuple(grads[:4]))
  zeros = lambda a: jnp.zeros(a.shape, jax.dtypes.float0)  # noqa: E731
  return zeros(expert_ids), g, zeros(shard)


_local_differentiable.defvjp(_local_fwd, _local_bwd)
