"""The H200 compile sweep's plan and record API, and the target shapes it compiles (no
compiles here; see test_h200_compile_*)."""

import collections
import dataclasses
import os
import tempfile

from absl.testing import absltest

import configs
from pallas_kernels import targets as kt
from pallas_kernels.h200 import compile as hc
from pallas_kernels.h200 import kernel_readings as kc


def _clean(regs):
  return {"kernel_name": "k", "registers": regs, "spill_stores": 0, "spill_loads": 0,
          "stack": 0, "smem": 1024, "seconds": 1.0, "error": None}


class TargetsTest(absltest.TestCase):

  def test_target_models_are_the_presets(self):
    """pallas_kernels cannot import configs (it sits below mlkit), so the targets keep
    the preset fields they read themselves: a preset change must fail here, not leave
    the kernels' shapes behind."""
    for target, preset in ((kt.KIMI_K2_6, configs.KIMI_K2_6), (kt.GLM_5_2, configs.GLM_5_2)):
      for field in dataclasses.fields(kt.TargetModel):
        self.assertEqual(getattr(target, field.name), getattr(preset, field.name),
                         f"{target.name}.{field.name}")


class PlanTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.groups = kc.target_groups(other_impl=True)
    cls.builds = [b for g in cls.groups for b in g.builds]

  def test_every_target_case_has_one_engine_build_in_one_group(self):
    engine = collections.Counter(b.case.name for b in self.builds if b.engine)
    self.assertEqual(set(engine), {c.name for c in kt.target_cases()})
    self.assertEqual(set(engine.values()), {1})
    self.assertEqual(len(self.builds), len({(b.case.name, b.variant) for b in self.builds}))

  def test_mla_m_follows_the_heads(self):
    """8 heads per device (TP 8) run the tokens-in-M MLA kernel, 64 the heads-in-M one;
    --other-impl adds the other one where it takes the shape, with its own key."""
    by = {(b.case.name, b.variant): b for b in self.builds}
    tp8, dp = "mla/tp8/fp8/b8/ctx32768", "mla/dp/fp8/b8/ctx32768"
    self.assertTrue(by[(tp8, "mgpu-tokens")].engine)
    # The heads-in-M alternative at TP 8 computes QK as it would run there: fp8.
    self.assertFalse(by[(tp8, "mgpu-heads-qk8")].engine)
    # 64 heads on an fp8 cache: the heads-in-M kernel with fp8 QK; its f16 QK twin
    # is the alternative, with its own key.
    self.assertTrue(by[(dp, "mgpu-heads-qk8")].engine)
    self.assertFalse(by[(dp, "mgpu-heads")].engine)
    self.assertNotEqual(by[(dp, "mgpu-heads-qk8")].key, by[(dp, "mgpu-heads")].key)
    self.assertTrue(by[("mla/dp/bf16/b8/ctx32768", "mgpu-heads")].engine)
    self.assertNotIn(("mla/dp/bf16/b8/ctx32768", "mgpu-heads-qk8"), by)
    self.assertNotIn((dp, "mgpu-tokens"), by)  # 64 heads: over the tokens kernel's 32
    self.assertEqual(dict(by[(tp8, "mgpu-tokens")].key)["heads_n"], 8)
    self.assertNotEqual(by[(tp8, "mgpu-tokens")].key, by[(tp8, "mgpu-heads-qk8")].key)
    # The heads-in-M kernel stores 8 partial rows at TP 8 and 64 at DP: two kernels,
    # told apart by their rows, not by the Triton tiles (which no Mosaic kernel reads).
    heads_tp8 = dict(by[(tp8, "mgpu-heads-qk8")].key)
    heads_dp = dict(by[(dp, "mgpu-heads-qk8")].key)
    self.assertEqual((heads_tp8["partial_rows"], heads_dp["partial_rows"]), (8, 64))
    self.assertNotIn("bs.block_h", heads_tp8)

  def test_mla_kernels_compile_with_and_without_their_producer(self):
    """The engine's Mosaic GPU MLA kernels have a producer warpgroup; --other-impl adds
    the same kernel with a compute warpgroup issuing the gathers, under its own key.
    No other attention kernel reads BlockSizes.loads, so it is not in their keys."""
    by = {(b.case.name, b.variant): b for b in self.builds}
    for case, v in (("mla/dp/fp8/b8/ctx32768", "mgpu-heads-qk8"),
                    ("mla/dp/bf16/b8/ctx32768", "mgpu-heads"),
                    ("mla/tp8/fp8/b8/ctx32768", "mgpu-tokens"),
                    ("mla/tp8/bf16/b8/ctx32768", "mgpu-tokens")):
      engine, alt = by[(case, v)], by[(case, v + "-compute-loads")]
      self.assertTrue(engine.engine)
      self.assertEqual(engine.block_sizes.loads, "producer")
      self.assertFalse(alt.engine)
      self.assertEqual(dict(alt.key)["bs.loads"], "compute")
      self.assertNotEqual(engine.key, alt.key)
    # The GQA kernel (no producer by default) has its producer twin, keyed apart.
    gqa = "gqa/g4/bf16/b64/ctx4096"
    engine, alt = by[(gqa, "mgpu")], by[(gqa, "mgpu-producer")]
    self.assertTrue(engine.engine)
    self.assertFalse(alt.engine)
    self.assertEqual((dict(engine.key)["bs.gqa_loads"], dict(alt.key)["bs.gqa_loads"]),
                     ("compute", "producer"))
    # The alternative kernel at TP 8 is compiled as the engine would run it: no twin.
    self.assertNotIn(("mla/tp8/fp8/b8/ctx32768", "mgpu-heads-qk8-compute-loads"), by)
    others = [b for b in self.builds if b.case.kernel in ("paged_mla_decode", "paged_gqa_decode")
              and b.impl != "mgpu" or b.case.kernel == "paged_gqa_decode"]
    self.assertTrue(others)
    for b in others:
      self.assertNotIn("bs.loads", dict(b.key), b.variant)
    for b in self.builds:
      if b.case.kernel == "paged_mla_decode" or b.impl != "mgpu":
        self.assertNotIn("bs.gqa_loads", dict(b.key), b.variant)

  def test_engine_runs_mosaic_gpu_attention_and_h200_rows(self):
    by = {(b.case.name, b.impl): b for b in self.builds
          if not b.variant.startswith("mgpu-tokens") and not b.variant.endswith("-compute-loads")}
    mla = by[("mla/dp/bf16/b8/ctx32768", "mgpu")]
    self.assertTrue(mla.engine)
    self.assertFalse(by[("mla/dp/bf16/b8/ctx32768", "triton")].engine)
    self.assertEqual(by[("mla/dp/bf16/b8/ctx32768", "triton")].block_sizes.num_warps, 8)
    prefill = by[("int4/kimi-k2.6/wq_a/m4096/g128", "mgpu")].block_sizes
    self.assertEqual((prefill.tile_n, prefill.tile_m), (64, 128))

  def test_key_separates_what_ptxas_told_apart(self):
    key = {(b.case.name, b.impl): dict(b.key) for b in self.builds}
    # 64-bit Triton addressing: a bf16 pool of 64 x 128K tokens is > 4 GiB.
    self.assertNotEqual(key[("mla/dp/bf16/b64/ctx131072", "triton")],
                        key[("mla/dp/bf16/b64/ctx32768", "triton")])
    self.assertTrue(key[("mla/dp/bf16/b64/ctx131072", "triton")]["wide_offsets"])
    # One request or one split: a grid axis of extent 1 (Triton's static splits).
    self.assertNotEqual(key[("gqa/g4/bf16/b1/ctx32768", "triton")],
                        key[("gqa/g4/bf16/b64/ctx4096", "triton")])
    # The Mosaic GPU kernels' balanced grid (head blocks, pieces) has no batch axis.
    self.assertEqual(key[("gqa/g4/bf16/b1/ctx32768", "mgpu")],
                     key[("gqa/g4/bf16/b64/ctx4096", "mgpu")])
    # The INT4 pipeline's static step count (K / tile_k / splits).
    self.assertNotEqual(key[("int4/kimi-k2.6/wq_a/m8/g32", "mgpu")]["k_steps"],
                        key[("int4/kimi-k2.6/wo/m8/g32", "mgpu")]["k_steps"])
    # GQA groups are padded to 64 rows in the Mosaic kernel: one kernel for all of them.
    self.assertEqual(key[("gqa/g1/fp8/b64/ctx4096", "mgpu")],
                     key[("gqa/g16/fp8/b64/ctx4096", "mgpu")])

  def test_sparse_attention_builds_and_keys(self):
    by = {(b.case.name, b.impl): b for b in self.builds}
    key = {name: dict(b.key) for (name, _), b in by.items()}
    # One Triton kernel each, the op's H200 defaults: TP-8 heads fit one 16-head program,
    # data-parallel heads two of 32; splits until the SMs are covered twice.
    for name, (block_h, splits) in (("sparse_mla/tp8/bf16/b1/ctx32768", (16, 32)),
                                    ("sparse_mla/dp/bf16/b8/ctx32768", (32, 32)),
                                    ("sparse_mla/dp/bf16/b64/ctx32768", (32, 4))):
      b = by[(name, "triton")]
      self.assertTrue(b.engine)
      self.assertEqual((b.block_sizes.block_h, b.block_sizes.block_k, b.block_sizes.num_splits,
                        b.block_sizes.num_warps), (block_h, 32, splits, 8))
    self.assertEqual(by[("indexer/fp8/b8/ctx32768", "triton")].block_sizes.block_k, 128)
    # The split count sets the loop's constant trip count: 2 steps of 32 rows at 32 splits,
    # 16 at 4 (176 against 182 registers for fp8); both contexts of a batch share a kernel.
    self.assertEqual(key["sparse_mla/dp/fp8/b8/ctx32768"]["k_steps"], 2)
    self.assertEqual(key["sparse_mla/dp/fp8/b64/ctx32768"]["k_steps"], ">=4")
    self.assertEqual(key["sparse_mla/dp/fp8/b8/ctx32768"], key["sparse_mla/dp/fp8/b8/ctx131072"])
    self.assertNotEqual(key["sparse_mla/dp/fp8/b8/ctx32768"],
                        key["sparse_mla/tp8/fp8/b8/ctx32768"])  # 16 against 32 heads
    # A > 4 GiB pool (64 x 128K tokens of 512 fp8 entries, plus one page) goes 64-bit.
    self.assertTrue(key["sparse_mla/tp8/fp8/b64/ctx131072"]["wide_offsets"])
    self.assertFalse(key["sparse_mla/tp8/fp8/b64/ctx32768"]["wide_offsets"])
    self.assertEqual(key["sparse_mla/tp8/bf16/b1/ctx32768"]["unit_axes"], "batch+heads")
    # The indexer: one request is a unit grid axis; other batches and contexts share.
    self.assertEqual(key["indexer/bf16/b1/ctx32768"]["unit_axes"], "batch")
    self.assertEqual(key["indexer/bf16/b8/ctx32768"], key["indexer/bf16/b64/ctx131072"])
    self.assertNotEqual(key["indexer/bf16/b8/ctx32768"], key["indexer/fp8/b8/ctx32768"])
    self.assertEqual(kc._fmt_bs(dataclasses.asdict(by[("sparse_mla/dp/fp8/b8/ctx32768",
                                                       "triton")].block_sizes),
                                "paged_mla_sparse_decode", "triton"), "h32 k32 w8 st2")

  def test_groups_compile_their_largest_build(self):
    for g in self.groups:
      self.assertEqual(len({b.key for b in g.builds}), 1)
      self.assertEqual(g.compiled.arg_bytes, max(b.arg_bytes for b in g.builds))
    self.assertLess(len(self.groups), len(self.builds) // 2)


class RecordsTest(absltest.TestCase):

  def _group(self, n=3):
    return next(g for g in kc.target_groups(("paged_gqa_decode",)) if len(g.builds) >= n)

  def test_shared_compile_covers_the_group(self):
    g = self._group()
    readings = kc.compile_group(g, lambda b: _clean(200))
    recs = kc.records_for(g, readings)
    self.assertEqual([r["case"] for r in recs], [b.case.name for b in g.builds])
    self.assertEqual({r["compiled_as"] for r in recs}, {g.name})
    self.assertEqual([r["compiled"] for r in recs], [True] + [False] * (len(recs) - 1))
    self.assertTrue(all(r["ok"] and r["registers"] == 200 for r in recs))

  def test_near_the_register_limit_every_case_compiles(self):
    g = self._group()
    seen = []
    readings = kc.compile_group(g, lambda b: seen.append(b) or _clean(kc.MAX_REGISTERS))
    self.assertEqual(seen, list(g.builds))
    recs = kc.records_for(g, readings)
    self.assertEqual([r["compiled_as"] for r in recs],
                     [f"{b.case.name}@{b.impl}" for b in g.builds])

  def test_problems(self):
    self.assertEqual(kc.problems(_clean(255)), [])
    spill = dict(_clean(255), spill_stores=48, spill_loads=44)
    self.assertRegex(kc.problems(spill)[0], "48 B stored, 44 B loaded")
    big = dict(_clean(100), smem=kc.SMEM_LIMIT_BYTES + 1)
    self.assertRegex(kc.problems(big)[0], "shared memory 232449 B")
    self.assertEqual(kc.problems(dict(_clean(1), error="boom")), ["boom"])
    self.assertTrue(kc.agree(_clean(191), _clean(193)))
    self.assertFalse(kc.agree(_clean(146), _clean(157)))
    self.assertFalse(kc.agree(_clean(200), dict(_clean(200), stack=8)))
    serial = dict(_clean(56), wgmma_serialized="insufficient register resources")
    self.assertRegex(kc.problems(serial)[0], "serialised the wgmmas: insufficient")
    self.assertFalse(kc.agree(_clean(56), serial))
    # A companion kernel (the pieces' merge) that spills is the record's problem too.
    merge = {k: v for k, v in _clean(80).items() if k in kc.READINGS}
    ok = dict(_clean(200), companions={"merge_pieces": merge})
    self.assertEqual(kc.problems(ok), [])
    bad = dict(_clean(200), companions={"merge_pieces": dict(merge, spill_loads=8)})
    self.assertEqual(len(kc.problems(bad)), 1)
    self.assertRegex(kc.problems(bad)[0], "^merge_pieces: register spills: 0 B stored, 8 B")

  def test_ptxas_log(self):
    # The shape of XLA's ptxas -v log for one Mosaic GPU kernel and one XLA fusion.
    log = (
        "ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions "
        "are serialized due to insufficient register resources for the wgmma pipeline in "
        "the function 'int4_grouped_matmul_nk_mosaic_gpu_kernel'\n"
        "ptxas info    : Function properties for int4_grouped_matmul_nk_mosaic_gpu_kernel\n"
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        "ptxas info    : Used 56 registers, used 2 barriers, 1 bytes smem\n"
        "ptxas info    : Function properties for loop_add_fusion\n"
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        "ptxas info    : Used 16 registers\n"
        "ptxas info    : Function properties for paged_mla_decode_mgpu_mosaic_gpu_kernel\n"
        "    8 bytes stack frame, 12 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 255 registers\n")
    stats = hc.parse_ptxas_log(log)
    self.assertEqual(set(stats), {"int4_grouped_matmul_nk_mosaic_gpu_kernel",
                                  "paged_mla_decode_mgpu_mosaic_gpu_kernel"})
    int4 = stats["int4_grouped_matmul_nk_mosaic_gpu_kernel"]
    self.assertEqual(int4["registers"], 56)
    self.assertEqual(int4["wgmma_serialized"],
                     "insufficient register resources for the wgmma pipeline")
    mla = stats["paged_mla_decode_mgpu_mosaic_gpu_kernel"]
    self.assertEqual((mla["registers"], mla["spill_stores"], mla["spill_loads"], mla["stack"]),
                     (255, 12, 4, 8))
    self.assertNotIn("wgmma_serialized", mla)

  def test_write_load_markdown(self):
    g = self._group()
    bad = dict(_clean(255), spill_stores=8, spill_loads=8)
    recs = kc.records_for(g, kc.compile_group(g, lambda b: bad))
    stale = [dict(r, registers=1, time_utc="2000-01-01T00:00:00Z") for r in recs]
    with tempfile.TemporaryDirectory() as d:
      kc.write_records(recs[:1], os.path.join(d, "a.json"))
      kc.write_records(recs[1:], os.path.join(d, "b.json"))
      kc.write_records(stale, os.path.join(d, "cli.json"))  # an older run of the same cases
      loaded = kc.load_records(d)
      self.assertEqual(kc.load_records(os.path.join(d, "nothing")), [])
    self.assertCountEqual([r["case"] for r in loaded], [b.case.name for b in g.builds])
    self.assertEqual({r["registers"] for r in loaded}, {255})
    md = kc.markdown(loaded)
    self.assertIn(f"{len(g.builds)} kernel builds of {len(g.builds)} target cases, "
                  "1 distinct compiles", md)
    self.assertIn("1 failing", md)
    self.assertIn("8 B stored", md)
    self.assertEqual(md.count("\n| paged_gqa_decode"), 1)

  def test_both_mla_kernels_of_a_case_keep_their_records(self):
    """The tokens-in-M and heads-in-M MLA kernels (and the tokens kernel without its
    producer) share case and impl ("mgpu"): records are told apart by variant, so
    none replaces another."""
    tp8 = "mla/tp8/bf16/b8/ctx32768"
    builds = [b for g in kc.target_groups(("paged_mla_decode",), other_impl=True, only=[tp8])
              for b in g.builds if b.impl == "mgpu"]
    variants = ["mgpu-heads", "mgpu-tokens", "mgpu-tokens-compute-loads"]
    self.assertEqual({b.variant for b in builds}, set(variants))
    recs = [r for b in builds
            for r in kc.records_for(kc.Group(b.key, (b,)), {b: _clean(100)})]
    with tempfile.TemporaryDirectory() as d:
      kc.write_records(recs, os.path.join(d, "a.json"))
      loaded = kc.load_records(d)
    self.assertEqual(sorted(r["variant"] for r in loaded), variants)
    md = kc.markdown(loaded)
    self.assertIn("3 kernel builds of 1 target cases", md)
    # The heads-in-M kernel's producer reads its launch allocation: the table says so,
    # and only where such a kernel is in it.
    self.assertIn("reads its launch allocation", md)
    self.assertNotIn("launch allocation",
                     kc.markdown([r for r in loaded if r["variant"] != "mgpu-heads"]))


if __name__ == "__main__":
  absltest.main()
