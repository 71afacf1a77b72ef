"""The INT4 [N, K] block-size derivation (pallas_kernels.int4_matmul.tune): occupancy, the
time model, the selection, and that the committed ptxas readings still select TUNED_NK.

No compiles here: the readings are the committed file; tests/test_h200_compile_int4.py
compiles the chosen rows at every target shape.
"""

import collections
import dataclasses
import math

from absl.testing import absltest

from pallas_kernels import benchmark as bm
from pallas_kernels import targets as kt
from pallas_kernels.int4_matmul import tile_model
from pallas_kernels.int4_matmul import tune
from pallas_kernels.int4_matmul.block_sizes import BlockSizes
from pallas_kernels.int4_matmul.block_sizes import TUNED
from pallas_kernels.int4_matmul.block_sizes import NK_MODEL_REGISTERS
from pallas_kernels.int4_matmul.block_sizes import TUNED_NK

H200 = "NVIDIA H200"


def _reading(regs, **kw):
  return {"registers": regs, "spill_stores": 0, "spill_loads": 0, "stack": 0, "smem": 1024,
          "wgmma_serialized": None, "error": None} | kw


class OccupancyTest(absltest.TestCase):

  def test_limits(self):
    # 128 registers x 128 threads = a quarter of the register file.
    self.assertEqual(tile_model.occupancy(128, 1024), 4)
    # Registers are allocated in steps of 8: 129 counts as 136 -> 3 CTAs.
    self.assertEqual(tile_model.occupancy(129, 1024), 3)
    self.assertEqual(tile_model.occupancy(255, 1024), 2)
    # Shared memory: 228 KiB per SM, 1 KiB reserved per CTA.
    self.assertEqual(tile_model.occupancy(64, 57 * 1024), 3)
    self.assertEqual(tile_model.occupancy(64, 113 * 1024), 2)
    self.assertEqual(tile_model.occupancy(64, 228 * 1024), 0)
    # Threads: 2048 per SM at most.
    self.assertEqual(tile_model.occupancy(8, 0), 16)


class ModelTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.dense = kt.kernel_case("int4_matmul", "t", "t", m=1, k=7168, n=2048, group_size=128)
    self.grouped = kt.kernel_case("int4_grouped_matmul", "t", "t", m=48, k=7168, n=2048,
                            group_size=128, experts=48)

  def test_memory_bound_decode_is_near_the_copy_roofline(self):
    bs = tune.resolve(BlockSizes(64, 64, 256, 4, 4), self.dense)
    t = tune.modelled_seconds(self.dense, bs, 64)
    weights = 7168 // 2 * 2048 + 7168 // 128 * 2048 * 2
    floor = weights / bm.H200_COPY_BW
    self.assertGreater(t, floor)
    self.assertLess(t, floor + 4 * tile_model.HBM_LATENCY_S)

  def test_loads_in_flight_set_the_bandwidth(self):
    # One CTA per SM, one step in flight: Little's law caps the bandwidth, so a
    # deeper pipeline (more bytes in flight) is faster on the same tiles.
    shallow = tune.resolve(BlockSizes(128, 8, 128, 1, 2), self.dense)
    deep = dataclasses.replace(shallow, max_concurrent_steps=6)
    self.assertLess(tune.modelled_seconds(self.dense, deep, 250),
                    tune.modelled_seconds(self.dense, shallow, 250))

  def test_registers_matter_through_occupancy_only(self):
    bs = tune.resolve(BlockSizes(128, 16, 128, 1, 4), self.grouped)
    smem = bs.smem_bytes(128, scale_bytes=2, grouped=True, layout="nk")
    self.assertEqual(tile_model.occupancy(64, smem), tile_model.occupancy(96, smem))
    self.assertEqual(tune.modelled_seconds(self.grouped, bs, 64),
                     tune.modelled_seconds(self.grouped, bs, 96))
    # 592 tiles: one round at 5 CTAs per SM, three at 2.
    self.assertLess(tune.modelled_seconds(self.grouped, bs, 64),
                    tune.modelled_seconds(self.grouped, bs, 255))

  def test_a_cta_that_does_not_fit_is_infinite(self):
    bs = BlockSizes(128, 256, 512, 1, 6)  # far past 228 KiB of shared memory
    case = kt.kernel_case("int4_matmul", "t", "t", m=256, k=7168, n=2048, group_size=128)
    self.assertEqual(tune.modelled_seconds(case, bs, 128), math.inf)

  def test_padding_tokens_cost_mma_time_at_prefill(self):
    case = kt.kernel_case("int4_matmul", "t", "t", m=4096, k=7168, n=2048, group_size=128)
    bs = tune.resolve(BlockSizes(128, 64, 128, 1, 2), case)
    flops = 2 * 4096 * 7168 * 2048
    self.assertGreaterEqual(tune.modelled_seconds(case, bs, 128),
                            flops / bm.H200_BF16_FLOPS)

  def test_routed_rows_are_ragged_and_sum_to_m(self):
    rows = tune.routed_group_sizes(8 * 48, 48)
    self.assertEqual(int(rows.sum()), 8 * 48)
    self.assertGreater(rows.max(), 8)  # why the grouped decode row keeps tile_m 16


class SelectTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.readings = tune.load_readings()

  def test_clean(self):
    self.assertTrue(tune.clean(_reading(128)))
    self.assertFalse(tune.clean(_reading(255, spill_stores=4, spill_loads=4)))
    self.assertFalse(tune.clean(_reading(255, stack=40)))
    self.assertFalse(tune.clean(_reading(56, wgmma_serialized="insufficient register "
                                        "resources for the wgmma pipeline")))
    self.assertFalse(tune.clean(_reading(None, error="ValueError: shared memory")))

  def test_committed_readings_cover_every_candidate(self):
    for op, cls in tune.CLASSES:
      missing = set(tune.needed_tiles(op, cls)) - set(self.readings)
      self.assertEqual(missing, set(), f"{op} {cls}: rerun python -m experiments.int4_tune "
                       "--compile")

  def test_committed_readings_select_the_table(self):
    for op, cls in tune.CLASSES:
      choice = tune.select(self.readings, op, cls)
      self.assertEqual(choice.block_sizes, TUNED_NK[(H200, op, cls)], (op, cls))

  def test_a_spilling_or_serialised_tile_is_never_chosen(self):
    op, cls = "grouped", "decode"
    pick = TUNED_NK[(H200, op, cls)]
    readings = dict(self.readings)
    for case in tune.class_cases(op, cls):
      bs = tune.resolve(pick, case)
      key = tune.tile_key(op, bs, case.d["group_size"])
      readings[key] = dict(readings[key], wgmma_serialized="insufficient registers")
    self.assertNotEqual(tune.select(readings, op, cls).block_sizes, pick)

  def test_missing_reading_raises(self):
    with self.assertRaises(KeyError):
      tune.select({}, "dense", "prefill")

  def test_get_default_reads_the_layouts_table(self):
    m, n, k = 8, 2048, 7168
    nk = BlockSizes.get_default(m, n, k, device_kind=H200, layout="nk")
    kn = BlockSizes.get_default(m, n, k, device_kind=H200)
    # The nk row's tiles and depth; its split count is chosen per call (below).
    row = TUNED_NK[(H200, "dense", "decode")].fit(m, n, k)
    self.assertEqual(dataclasses.replace(nk, k_splits=row.k_splits), row)
    self.assertEqual(kn, TUNED[(H200, "dense", "decode")].fit(m, n, k))
    # A device kind without nk rows falls back to the packed table.
    self.assertEqual(BlockSizes.get_default(m, n, k, device_kind="cpu", layout="nk"),
                     BlockSizes.get_default(m, n, k, device_kind="cpu"))
    with self.assertRaisesRegex(ValueError, "layout"):
      BlockSizes.get_default(m, n, k, layout="t")

  def test_dense_decode_splits_per_call(self):
    """get_default's split count is the model's best for the call, at the real
    registers of the tile (not just the NK_MODEL_REGISTERS it assumes), and beats
    the row's fixed count over the class."""
    op, cls = "dense", "decode"
    row = TUNED_NK[(H200, op, cls)]
    chosen = collections.Counter()
    for case in tune.class_cases(op, cls):
      d = case.d
      bs = BlockSizes.get_default(d["m"], d["n"], d["k"], device_kind=H200, layout="nk",
                                  group_size=d["group_size"])
      self.assertEqual(dataclasses.replace(bs, k_splits=1),
                       dataclasses.replace(row, k_splits=1).fit(d["m"], d["n"], d["k"]))
      steps = d["k"] // bs.tile_k
      options = {s: tune.case_seconds(self.readings, op, dataclasses.replace(bs, k_splits=s),
                                      case)
                 for s in range(1, tile_model.MAX_SPLITS + 1) if steps % s == 0}
      self.assertEqual(bs.k_splits, min(options, key=lambda s: (options[s], s)), case.name)
      # The assumed registers give each tile the CTAs per SM its reading gives.
      reading = self.readings[tune.tile_key(op, bs, d["group_size"])]
      smem = bs.smem_bytes(d["group_size"], scale_bytes=2, layout="nk")
      self.assertEqual(tile_model.occupancy(NK_MODEL_REGISTERS, smem),
                       tile_model.occupancy(reading["registers"], smem), case.name)
      chosen[bs.k_splits] += 1
    self.assertGreater(len(chosen), 2)  # the count really varies with the shape
    scores = tune.split_scores(self.readings)
    per_call = scores.pop("per call")
    self.assertEqual(set(scores), set(tune.FIXED_SPLITS))
    self.assertLess(per_call, min(scores.values()))
    self.assertLess(per_call, 1.05)

  def test_dense_decode_is_ranked_as_it_runs(self):
    """select scores the dense decode candidates with the split count get_default
    gives each call, so the pick's score is what the table row scores at run time."""
    choice = tune.select(self.readings, "dense", "decode")
    self.assertEqual(choice.block_sizes.k_splits, 1)  # the row's count is not used
    self.assertAlmostEqual(choice.score, tune.split_scores(self.readings, choice)["per call"],
                           places=9)

  def test_grouped_grid_counts_registers(self):
    """The [N, K] grouped kernel's persistent grid: 45 KB would allow five CTAs per
    SM by shared memory, 128 registers four."""
    from pallas_kernels import device
    from pallas_kernels.int4_matmul.int4_matmul import grouped_ctas
    sms = device.num_sms()
    bs = BlockSizes(128, 8, 128, 1, 4)
    self.assertEqual(bs.smem_bytes(128, grouped=True, layout="nk") // 1024, 44)
    self.assertEqual(grouped_ctas(bs, 128, layout="nk"), 4 * sms)
    self.assertEqual(grouped_ctas(BlockSizes(128, 16, 128, 1, 4), 32, layout="nk"), 3 * sms)
    self.assertEqual(grouped_ctas(BlockSizes(128, 16, 128, 1, 4), 32), 2 * sms)  # packed

  def test_table_rows_fit_shared_memory(self):
    for (_, op, _), bs in TUNED_NK.items():
      for g in (32, 128):
        self.assertLessEqual(bs.smem_bytes(g, grouped=op == "grouped", layout="nk"),
                             tune.H200_SMEM_BYTES)

  def test_markdown(self):
    text = tune.markdown([tune.select(self.readings, "dense", "prefill")])
    self.assertIn("| dense | prefill |", text)
    self.assertIn("128 x 64 x 128", text)
    prefill = TUNED_NK[(H200, "dense", "prefill")]
    self.assertEqual(tune.versus(self.readings, "dense", "prefill", prefill, prefill),
                     (1.0, 1.0))
    pick = TUNED_NK[(H200, "dense", "decode")]
    med, worst = tune.versus(self.readings, "dense", "decode", pick,
                             TUNED[(H200, "dense", "decode")])
    self.assertGreaterEqual(worst, med)
    self.assertGreater(worst, 1.0)


if __name__ == "__main__":
  absltest.main()


class BenchImplsTest(absltest.TestCase):
  """gpu_check times the nk kernel with its derived rows, with the packed table's and
  with the dense decode row's tiles and no K splits."""

  def test_both_tilings_are_timed_and_correct(self):
    import jax.numpy as jnp
    import numpy as np
    from pallas_kernels.int4_matmul import bench
    from pallas_kernels.int4_matmul import nk
    from pallas_kernels.int4_matmul import reference
    m, k, n, g = 8, 512, 128, 32
    sets = bm.once(lambda: [bench._make_dense(3, m, k, n, g)])
    ref = bm.once(lambda: reference.int4_matmul_reference(
        sets()[0][0].astype(jnp.float32), *sets()[0][1:], group_size=g))
    derived = BlockSizes(64, 8, 256, 2, 2)
    packed = BlockSizes(128, 8, 128, 1, 2)
    one_split = BlockSizes(64, 8, 256, 1, 2)  # the same tiles, not the per-call split count
    impls = bench._nk_impls(nk.int4_matmul_nk, g, "interpret", derived, packed, sets, ref,
                            one_split)
    self.assertEqual([i.name for i in impls],
                     ["pallas_nk", "pallas_nk_kn_tiles", "pallas_nk_one_split"])
    self.assertIn("64x8x256, depth 2, 2 splits", impls[0].note)
    for impl in impls:
      out = np.asarray(impl.fn(*impl.args()[0]), np.float32)
      want = np.asarray(ref(), np.float32)
      self.assertLess(np.linalg.norm(out - want) / np.linalg.norm(want), 1e-2, impl.name)
    same = bench._nk_impls(nk.int4_matmul_nk, g, "interpret", packed, packed, sets, ref,
                           packed)
    self.assertEqual([i.name for i in same], ["pallas_nk"])
