"""The grouped INT4 matmuls' tile schedule written by the MoE sort kernel.

``sort_by_expert_local(..., schedule=spec)`` writes the grouped kernels' schedule table for
the local experts' row counts in its own launch (docs/moe_router.md, "The sort writes the
schedule"). Interpreted, the table equals ``grouped_meta``'s (the schedule kernel's) and the
jnp ``grouped_schedule``'s bit for bit, over ragged routings, empty experts, every row on
one expert, no local rows and rows past the local ones; the grouped INT4 matmul given it
equals the one that computes its own; a schedule made for another call raises; the
expert-parallel MoE dispatch with INT4 experts on "interpret" takes it (one sort, no
schedule kernel) and computes what it did without it; and the sort with the schedule
compiles for an H200 to one launch without spills.
"""

import functools
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax.extend import core as jax_core
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import h200_compile_cases
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as gpu_interpret
from mlkit.model import moe
from mlkit.quant import quantize_int4
from mlkit.quant.dispatch import schedule_spec
from pallas_kernels.int4_matmul import BlockSizes
from pallas_kernels.int4_matmul import GroupedSchedule
from pallas_kernels.int4_matmul import ScheduleTable
from pallas_kernels.int4_matmul import grouped_schedule_spec
from pallas_kernels.int4_matmul import int4_grouped_matmul
from pallas_kernels.int4_matmul import pack_int4
from pallas_kernels.int4_matmul.int4_matmul import grouped_meta
from pallas_kernels.int4_matmul.int4_matmul import grouped_schedule
from pallas_kernels.int4_matmul.int4_matmul import schedule_for
from pallas_kernels.moe_router import sort_by_expert_local
from router_sort_refs import pairs as _pairs
from host_data import put
from interpret_races import keep_race_records
from router_sort_refs import sort_local_ref

# (N, k, E, devices): 48 local experts as Kimi K2.6's on 8 devices (not a power of two;
# at tile_m 16 the table's 128 columns take two blocks of 64 tiles), and 8 local experts
# (a power of two: the counts' vector grows to 16 for the rows past them).
SHAPES = {"48_local": (32, 4, 96, 2), "pow2": (16, 4, 32, 4)}


@functools.cache
def _sort(shape, spec):
  """The jitted sort with ``spec``'s schedule, on "interpret": one compile per case."""
  _, _, e, devices = SHAPES[shape]
  return jax.jit(lambda ids, w, d: sort_by_expert_local(ids, w, e, d, devices,
                                                        backend="interpret", schedule=spec))


@functools.cache
def _meta(spec):
  return jax.jit(lambda gs: grouped_meta(gs, spec.m, spec.tile_m, spec.num_tiles,
                                         interpret=True))


def _routings(shape, seed, count):
  """The first ``count`` of these (name, expert_ids [N, k], device) routings: ragged with
  empty experts, one local expert taking every row, every pair on other devices'
  experts, all pairs local."""
  n, k, e, devices = SHAPES[shape]
  local = e // devices
  rng = np.random.default_rng(seed)
  probs = rng.dirichlet(np.ones(e) * 0.3)
  routings = (("ragged", lambda: rng.choice(e, (n, k), p=probs), 1),
              ("one_expert", lambda: np.full((n, k), local + 3), 1),  # device 1's fourth
              ("none_local", lambda: rng.integers(local, e, (n, k)), 0),
              ("all_local", lambda: rng.integers(0, local, (n, k)), 0))
  for name, ids, device in routings[:count]:
    yield name, ids(), device


class SortScheduleTest(parameterized.TestCase):

  @parameterized.named_parameters(("48_local", "48_local", 16, 2), ("pow2", "pow2", 8, 4))
  def test_table_equals_the_schedule_kernels(self, shape, tile_m, routings):
    n, k, e, devices = SHAPES[shape]
    spec = schedule_for(n * k, e // devices, tile_m)
    w = put(np.random.default_rng(1).uniform(0.1, 1.0, (n, k)).astype(np.float32))
    for name, ids, device in _routings(shape, n + tile_m, routings):
      ids, d = put(np.asarray(ids, np.int32), np.int32(device))
      *got, table = _sort(shape, spec)(ids, w, d)
      self.assertIsInstance(table, ScheduleTable)
      self.assertEqual(table.table.shape, (5, spec.width))
      self.assertEqual(table.spec, spec)
      # The sort itself is unchanged, bit for bit.
      for g, r in zip(got, sort_local_ref(ids, w, e, d, devices)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r), err_msg=name)
      sizes = got[3]
      if name == "one_expert":
        self.assertEqual(int(np.asarray(sizes)[3]), n * k, name)
      if name == "none_local":
        self.assertFalse(np.asarray(sizes).any(), name)
      want = np.asarray(_meta(spec)(sizes))
      np.testing.assert_array_equal(np.asarray(table.table), want, err_msg=name)
      np.testing.assert_array_equal(
          want[:, :spec.num_tiles],
          np.asarray(grouped_schedule(sizes, spec.m, tile_m, spec.num_tiles)), err_msg=name)

  def test_the_reference_path_returns_no_table(self):
    ids, w = _pairs(2, 4, 2, 8)
    spec = schedule_for(8, 2, 8)
    one = put(np.int32(1))
    # In one program, where eagerly each of the reference's operations is one.
    out = jax.jit(lambda i, w, d: sort_by_expert_local(i, w, 8, d, 4, backend="xla",
                                                       schedule=spec))(ids, w, one)
    self.assertLen(out, 5)
    self.assertIsNone(out[4])
    for g, r in zip(out[:4], sort_local_ref(ids, w, 8, one, 4)):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(r))

  def test_a_schedule_for_other_rows_or_experts_raises(self):
    ids, w = _pairs(3, 4, 2, 8)
    zero = put(np.int32(0))
    for spec in (schedule_for(16, 2, 8), schedule_for(8, 4, 8), (8, 2, 8, 7, 8)):
      with self.assertRaisesRegex(ValueError, "schedule must be a GroupedSchedule for m=8"):
        sort_by_expert_local(ids, w, 8, zero, 4, backend="interpret", schedule=spec)
    with self.assertRaisesRegex(ValueError, "GroupedSchedule.tile_m must be an int >= 1"):
      GroupedSchedule(m=8, experts=2, tile_m=0, num_tiles=4, row_align=8)


# The grouped INT4 matmul's case: M rows over E experts of [K, N] (group 32), three
# persistent CTAs; group sizes with an empty expert and rows past their sum.
M, K, N, E, G = 19, 128, 64, 4, 32
BS = BlockSizes(64, 8, 128, max_ctas=3)
GS = np.array([5, 0, 7, 4], np.int32)


@functools.cache
def _int4_case():
  rng = np.random.default_rng(0)
  x = put(rng.standard_normal((M, K)).astype(jnp.bfloat16))
  # Packed in one program, where eagerly each of its operations is one.
  packed = jax.jit(pack_int4)(put(rng.integers(-8, 8, (E, K, N)).astype(np.int8)))
  scales = put((rng.uniform(0.25, 2.0, (E, K // G, N)) / 16).astype(jnp.bfloat16))
  return x, packed, scales


@functools.cache
def _int4_matmul():
  return jax.jit(lambda x, p, s, gs, sched: int4_grouped_matmul(
      x, p, s, gs, group_size=G, backend="interpret", block_sizes=BS, schedule=sched))


class GroupedMatmulScheduleTest(absltest.TestCase):

  def test_given_schedule_equals_its_own(self):
    gpu_interpret.reset_gpu_interpret_mode_state()
    x, packed, scales = _int4_case()
    gs = put(GS)
    spec = grouped_schedule_spec(M, E, N, K, block_sizes=BS)
    self.assertEqual(spec, schedule_for(M, E, 8))
    table = ScheduleTable(_meta(spec)(gs), spec)
    got = _int4_matmul()(x, packed, scales, gs, table)
    want = _int4_matmul()(x, packed, scales, gs, None)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_array_equal(got, want)
    self.assertTrue(want[:16].any())
    np.testing.assert_array_equal(want[16:], 0)  # past sum(gs)

  def test_mismatched_schedule_raises(self):
    x, packed, scales = _int4_case()
    gs = put(GS)
    spec = grouped_schedule_spec(M, E, N, K, block_sizes=BS)
    other = schedule_for(M, E, 16)  # another tile_m: other tiles
    run = functools.partial(int4_grouped_matmul, x, packed, scales, gs, group_size=G,
                            backend="interpret", block_sizes=BS)
    zeros = lambda width: put(np.zeros((5, width), np.int32))  # noqa: E731
    with self.assertRaisesRegex(ValueError, "schedule was made for .*tile_m=16"):
      run(schedule=ScheduleTable(zeros(other.width), other))
    with self.assertRaisesRegex(ValueError, "schedule was made for .*m=20"):
      run(schedule=ScheduleTable(zeros(spec.width), schedule_for(20, E, 8)))
    with self.assertRaisesRegex(ValueError, r"schedule table must be int32 \[5, "):
      run(schedule=ScheduleTable(zeros(spec.width // 2), spec))
    with self.assertRaisesRegex(ValueError, "schedule must be a ScheduleTable or None"):
      run(schedule=zeros(spec.width))


def _kernels(jaxpr) -> list[str]:
  """Names of the pallas_calls in ``jaxpr``, nested ones too."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      out.append(eqn.params.get("name"))
      continue
    for sub in jax_core.jaxprs_in_params(eqn.params):
      out += _kernels(sub)
  return out


@functools.cache
def _local_experts(backend):
  return jax.jit(functools.partial(moe._local_experts, n_experts=16, shards=8, backend=backend))


class ExpertParallelDispatchTest(absltest.TestCase):
  """16 int4 experts over 8 devices (2 each), a decode step's few rows: each device's sort
  writes the schedule its three grouped matmuls read.

  The Mosaic GPU interpreter does not run kernels of several devices at once (in a
  multi-device shard_map on the CPU it reports races and leftover barriers, with or
  without the schedule), so the numbers come from devices' parts (``moe._local_experts``,
  the shard_map's body) one device at a time; the dispatch itself is traced."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    n, k, e, d, f = 6, 2, 16, 128, 64
    rng = np.random.default_rng(5)
    cls.p = {name: quantize_int4(put((rng.standard_normal(shape) * 0.1).astype(np.float32)), 32)
             for name, shape in (("w_gate", (e, d, f)), ("w_up", (e, d, f)),
                                 ("w_down", (e, f, d)))}
    cls.x = put(rng.normal(size=(n, d)).astype(jnp.bfloat16))
    cls.ids, cls.w = _pairs(6, n, k, e)
    mesh = Mesh(np.array(jax.devices()[:8]), ("ep",))
    cls.sharding = NamedSharding(mesh, PartitionSpec("ep"))

  def _dispatch(self, backend):
    return jax.jit(lambda p, x, i, w: moe.dispatch_experts(
        p, x, i, w, 16, backend=backend, expert_sharding=self.sharding, out_dtype=jnp.float32))

  def _device(self, shard):
    # Sliced on the host and placed: no program per slice.
    return jax.tree_util.tree_map(lambda a: put(np.asarray(a)[2 * shard:2 * shard + 2]),
                                  self.p)

  def test_the_sort_writes_the_only_schedule(self):
    # Placed from host copies: no program splits them over the devices.
    p = jax.device_put(jax.tree_util.tree_map(np.asarray, self.p), self.sharding)
    args = (p, self.x, self.ids, self.w)
    self.assertIsNotNone(schedule_spec(12, tuple(self._device(0).values()),
                                       backend="interpret"))
    self.assertIsNone(schedule_spec(12, tuple(self._device(0).values()), backend="xla"))
    kernels = _kernels(jax.make_jaxpr(self._dispatch("interpret"))(*args).jaxpr)
    self.assertEqual(kernels, ["sort_by_expert"])  # no grouped_schedule launch
    with mock.patch.object(moe, "schedule_spec", lambda *a, **kw: None):
      kernels = _kernels(jax.make_jaxpr(self._dispatch("interpret"))(*args).jaxpr)
    self.assertEqual(kernels, ["sort_by_expert"] + ["grouped_schedule"] * 2)  # as before

  def test_equals_before(self):
    # The device with the most pairs (2 experts each).
    shard = int(np.argmax(np.bincount(np.asarray(self.ids).reshape(-1) // 2, minlength=8)))
    gpu_interpret.reset_gpu_interpret_mode_state()
    races = keep_race_records(self)
    args = (self._device(shard), self.x, self.ids, self.w, put(np.int32(shard)))
    got = np.asarray(_local_experts("interpret")(*args))
    self.assertFalse(races.races_found())
    with mock.patch.object(moe, "schedule_spec", lambda *a, **kw: None):
      before = _local_experts.__wrapped__("interpret")(*args)  # traced afresh
    # The grouped calls' own schedules: the same bits.
    np.testing.assert_array_equal(got, np.asarray(before))
    self.assertGreater(float(np.abs(got).max()), 0.1)


class SortScheduleH200Test(h200_compile_cases.H200CompilerTest):

  def test_one_launch_without_spills(self):
    from pallas_kernels.h200 import compile as hc
    # Kimi K2.6's decode step on one of 8 H200s: 64 tokens x top-8 = 512 rows over 48 of
    # 384 experts, the schedule of its grouped matmuls (7168 -> 2048 gate/up, 2048 -> 7168
    # down: tile_m 24 on an H200).
    spec = grouped_schedule_spec(512, 48, 2048, 7168, device_kind="NVIDIA H200")
    self.assertEqual(spec, grouped_schedule_spec(512, 48, 7168, 2048,
                                                 device_kind="NVIDIA H200"))
    self.assert_one_launch_without_spills(
        jax.jit(lambda i, w, d: sort_by_expert_local(i, w, 384, d, 8, backend="pallas",
                                                     schedule=spec)),
        hc.spec((64, 8), jnp.int32), hc.spec((64, 8), jnp.float32), hc.spec((), jnp.int32),
        kernel="sort_by_expert")


if __name__ == "__main__":
  absltest.main()
