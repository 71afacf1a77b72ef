"""The grouped kernels' tile schedule in one Pallas Triton launch.

``int4_matmul.grouped_schedule`` states the schedule in jnp: each expert's rows
(and the rows past them) are cut into tiles of their own, and a tile's row
[expert, window start, offset, rows, tiles in use] tells a persistent CTA what
to compute. XLA builds it as three reductions (the row offsets, the tile
offsets, each tile's segment) and a stack: four launches before every grouped
matmul, one schedule per MoE layer. This kernel computes the same table in one
program: the group sizes are read once, the prefix sums are Triton scans, and
each tile's segment and its row values come from [tiles, segments] comparisons
and one-hot sums over blocks of tiles. docs/int4_matmul.md ("The schedule in
one launch") has the design; ``grouped_schedule`` is its reference.

The body (``write_schedule``) also runs on group sizes already in registers: the MoE
sort kernel (``moe_router.sort_by_expert_local``) counts them and writes the table in
its own launch, a ``ScheduleTable`` the grouped calls take instead of computing one.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.schedule import pow2_at_least

# Elements of one [tiles, segments] comparison block: 32 int32 registers a thread at 4 warps.
_BLOCK_ELEMENTS = 4096
_NUM_WARPS = 4


def schedule_width(num_tiles: int) -> int:
  """Columns of the table :func:`grouped_schedule_pallas` returns for ``num_tiles`` tiles:
  a power of two >= num_tiles (the columns past num_tiles are unused tiles)."""
  return pow2_at_least(num_tiles)


def schedule_segments(experts: int) -> int:
  """Length of the group-size vector :func:`write_schedule` reads for E experts: the E
  experts and the rows past them (segment E), padded to a power of two."""
  return pow2_at_least(experts + 1)


@dataclasses.dataclass(frozen=True)
class GroupedSchedule:
  """What a grouped kernel's tile schedule is made for (static).

  Attributes:
    m: rows M of the grouped matmul's x.
    experts: E, the group sizes' length.
    tile_m: rows per tile.
    num_tiles: at least ``grouped_tile_bound(m, experts, tile_m)``.
    row_align: the windows' alignment (the grouped kernels' _ROW_ALIGN).
  """

  m: int
  experts: int
  tile_m: int
  num_tiles: int
  row_align: int

  def __post_init__(self):
    for name, least in (("m", 0), ("experts", 1), ("tile_m", 1), ("num_tiles", 1),
                        ("row_align", 1)):
      value = getattr(self, name)
      if not isinstance(value, int) or value < least:
        raise ValueError(f"GroupedSchedule.{name} must be an int >= {least}, got {value!r}")

  @property
  def width(self) -> int:
    """Columns of its table: ``schedule_width(num_tiles)``."""
    return schedule_width(self.num_tiles)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["table"],
                   meta_fields=["spec"])
@dataclasses.dataclass(frozen=True)
class ScheduleTable:
  """A grouped kernels' schedule table computed ahead of their call (a pytree).

  Attributes:
    table: [5, spec.width] int32, :func:`grouped_schedule_pallas`'s table.
    spec: the GroupedSchedule it was made for (static), which the grouped calls check
      against their own.
  """

  table: jax.Array
  spec: GroupedSchedule


def write_schedule(gs: jax.Array, meta_ref, spec: GroupedSchedule) -> None:
  """Writes ``spec``'s schedule table for the group sizes ``gs`` into ``meta_ref``.

  The body of :func:`grouped_schedule_pallas`, on a vector already in registers, so that a
  kernel which has just counted the group sizes (``moe_router``'s sort) writes the table
  in its own launch.

  Args:
    gs: [schedule_segments(spec.experts)] int32 group sizes, zero past spec.experts.
    meta_ref: [5, spec.width] int32 output ref.
    spec: the schedule's shape.
  """
  e, m, tile_m, row_align = spec.experts, spec.m, spec.tile_m, spec.row_align
  ep, tp = gs.shape[0], spec.width
  block_t = max(1, min(tp, _BLOCK_ELEMENTS // ep))
  seg_ids = lax.broadcasted_iota(jnp.int32, (ep,), 0)
  cum = jnp.cumsum(gs)  # inclusive
  ends = jnp.minimum(cum, m)  # rows past M are never computed
  starts = jnp.minimum(cum - gs, m)
  total = jnp.sum(jnp.where(seg_ids == e - 1, ends, 0))
  # Segment E: the rows [total, M), written as zeros; segments past it are empty.
  starts = jnp.where(seg_ids == e, total, jnp.where(seg_ids > e, m, starts))
  ends = jnp.where(seg_ids >= e, m, ends)
  windows = starts // row_align * row_align
  n_tiles = jnp.where(ends > starts, (ends - windows + tile_m - 1) // tile_m, 0)
  tile_ends = jnp.cumsum(n_tiles)
  used = jnp.sum(jnp.where(seg_ids == e, tile_ends, 0))
  tile_starts = tile_ends - n_tiles

  def block(i, carry):
    t = i * block_t + lax.broadcasted_iota(jnp.int32, (block_t,), 0)  # [block_t]
    # The tile's segment: how many segments' tiles end at or before it.
    seg = jnp.minimum(jnp.sum((tile_ends[None, :] <= t[:, None]).astype(jnp.int32), axis=1), e)
    one_hot = seg[:, None] == seg_ids[None, :]  # [block_t, ep]

    def pick(v):  # v[seg] for each tile
      return jnp.sum(jnp.where(one_hot, v[None, :], 0), axis=1)

    window = pick(windows) + (t - pick(tile_starts)) * tile_m
    first = jnp.maximum(pick(starts), window)
    rows = jnp.clip(jnp.minimum(pick(ends), window + tile_m) - first, 0, tile_m)
    in_use = t < used
    cols = pl.ds(i * block_t, block_t)
    meta_ref[0, cols] = jnp.where(in_use & (seg < e), seg, -1)
    meta_ref[1, cols] = jnp.where(in_use, window, 0)
    meta_ref[2, cols] = jnp.where(in_use, first - window, 0)
    meta_ref[3, cols] = jnp.where(in_use, rows, 0)
    meta_ref[4, cols] = jnp.zeros((block_t,), jnp.int32) + used
    return carry

  lax.fori_loop(0, tp // block_t, block, 0)


def _kernel(gs_ref, meta_ref, *, spec: GroupedSchedule):
  e = spec.experts
  seg_ids = lax.broadcasted_iota(jnp.int32, (schedule_segments(e),), 0)
  # The E group sizes as an [ep] vector (segment E, the rows past them, and the padding
  # past it read 0): one masked gather-load, whatever E.
  gs = pltriton.load(gs_ref.at[jnp.minimum(seg_ids, e - 1)], mask=seg_ids < e, other=0)
  write_schedule(gs, meta_ref, spec)


@functools.partial(jax.jit, static_argnames=("m", "tile_m", "num_tiles", "row_align",
                                             "interpret"))
def grouped_schedule_pallas(group_sizes: jax.Array, *, m: int, tile_m: int, num_tiles: int,
                            row_align: int, interpret: bool = False) -> jax.Array:
  """``grouped_schedule(group_sizes, m, tile_m, num_tiles)`` in one Pallas Triton launch.

  Args:
    group_sizes: [E] int32 rows per expert (sum <= M is not required: rows past M are
      never computed).
    m: rows M of the grouped matmul's x.
    tile_m: rows per tile.
    num_tiles: at least ``grouped_tile_bound(m, E, tile_m)``.
    row_align: the windows' alignment (the grouped kernels' _ROW_ALIGN).
    interpret: run the kernel in Pallas' interpreter (any backend).

  Returns:
    [5, schedule_width(num_tiles)] int32, ``grouped_schedule``'s table in its first
    num_tiles columns and unused tiles (expert -1, 0 rows) past them; row 4 holds the
    tiles in use in every column.

  Raises:
    ValueError: group_sizes is not a 1-D int32 array.
  """
  if group_sizes.ndim != 1 or group_sizes.dtype != jnp.int32 or not group_sizes.shape[0]:
    raise ValueError(f"group_sizes must be int32 [E >= 1], got {group_sizes.dtype} "
                     f"{group_sizes.shape}")
  spec = GroupedSchedule(m=m, experts=group_sizes.shape[0], tile_m=tile_m,
                         num_tiles=num_tiles, row_align=row_align)
  return pl.pallas_call(
      functools.partial(_kernel, spec=spec),
      out_shape=jax.ShapeDtypeStruct((5, spec.width), jnp.int32),
      compiler_params=pltriton.CompilerParams(num_warps=_NUM_WARPS, num_stages=1),
      interpret=interpret,
      name="grouped_schedule",
  )(group_sizes)
