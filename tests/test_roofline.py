"""The roofline sheet: per target case bytes, FLOPs, the H200 bound, targets, measured join.

Its plot is the kernels experiment's (tests/test_experiments.py checks the file).
"""

import dataclasses

from absl.testing import absltest, parameterized

from pallas_kernels import benchmark as bm
from pallas_kernels import roofline as rf
from pallas_kernels import targets as kt
from pallas_kernels.indexer import bench as indexer_bench
from pallas_kernels.indexer import topk_bench
from pallas_kernels.int4_matmul import bench as int4_bench
from pallas_kernels.paged_attention import bench as attn_bench
from pallas_kernels.tag_check import bench as tag_bench

# Small dims of every kernel (the reference backend builds their Benches quickly).
_SMALL = {
    "paged_mla_decode": dict(batch=2, heads=4, c=128, r=64, page_size=8, context=32, kv="fp8",
                             max_pages=4, num_pages=9, qk_head_dim=192),
    "paged_gqa_decode": dict(batch=2, kv_heads=2, group=4, head_dim=64, page_size=8, context=32,
                             kv="bf16", max_pages=4, num_pages=9),
    "int4_matmul": dict(m=8, k=256, n=128, group_size=32),
    "int4_grouped_matmul": dict(m=3, k=256, n=128, group_size=64, experts=4),
    "tag_check": dict(batch=3, max_pages=5, num_pages=40, page_size=4),
    "paged_mla_sparse_decode": dict(batch=2, heads=4, c=128, r=64, page_size=8, context=32,
                                    kv="fp8", max_pages=4, num_pages=9, topk=8, qk_head_dim=192),
    "paged_index_scores": dict(batch=2, index_heads=4, index_dim=32, page_size=8, context=32,
                               kv="fp8", max_pages=4, num_pages=9),
    "topk_positions": dict(batch=2, context=48, topk=20),
}


class JobCostTest(parameterized.TestCase):

  @parameterized.parameters(*_SMALL)
  def test_equals_what_gpu_check_rates_against(self, kernel):
    # gpu_check's Bench and the sheet must count one job the same way.
    dims = _SMALL[kernel]
    if kernel == "tag_check":
      bench, cost = tag_bench.bench_case(dims, backend="xla"), tag_bench.job_cost(dims)
    elif kernel == "paged_index_scores":
      bench, cost = indexer_bench.bench_case(dims, backend="xla"), indexer_bench.job_cost(dims)
    elif kernel == "topk_positions":
      bench, cost = topk_bench.bench_case(dims, backend="xla"), topk_bench.job_cost(dims)
    elif kernel in attn_bench.KERNELS:
      bench = attn_bench.bench_case(kernel, dims, backend="xla")
      cost = attn_bench.job_cost(kernel, dims)
    else:
      bench = int4_bench.bench_case(kernel, dims, backend="xla")
      cost = int4_bench.job_cost(kernel, dims)
    self.assertEqual((bench.nbytes, bench.flops), cost)

  def test_by_hand(self):
    d = _SMALL["paged_mla_decode"]
    tokens = 2 * 32
    q = 2 * 4 * (128 + 64) * 2 + 2 * 4 * 128 * 2 + 2 * 4 * 4  # q in, out, block tables
    self.assertEqual(attn_bench.job_cost("paged_mla_decode", d),
                     (tokens * ((128 + 64) + 8) + q, tokens * 4 * 2 * (2 * 128 + 64)))
    # Grouped INT4: 3 rows over 4 experts touch 3 experts' weights.
    d = _SMALL["int4_grouped_matmul"]
    per_expert = 256 // 2 * 128 + 256 // 64 * 128 * 2
    self.assertEqual(int4_bench.job_cost("int4_grouped_matmul", d),
                     (3 * per_expert + 3 * 256 * 2 + 3 * 128 * 2, 2 * 3 * 256 * 128))

  def test_sparse_attention_by_hand(self):
    # Sparse MLA decode, fp8: 2 requests x 8 selected rows of 128 + 64 entries and two
    # 4-byte scales; q in (bf16, 192 wide), out (bf16, 128 wide), 8 int32 indices each,
    # and min(8 rows, 4 pages) table entries each. QK over 192, PV over 128, 4 heads.
    d = _SMALL["paged_mla_sparse_decode"]
    self.assertEqual(attn_bench.job_cost("paged_mla_sparse_decode", d),
                     (16 * 200 + 3072 + 2048 + 64 + 32, 16 * 4 * 2 * (192 + 128)))
    # A selection longer than the context reads the context once (it cannot select more).
    self.assertEqual(attn_bench.job_cost("paged_mla_sparse_decode", d | {"topk": 64})[1],
                     attn_bench.job_cost("paged_mla_decode", d)[1])
    # Its bf16 twin: 2-byte entries, no scales.
    self.assertEqual(attn_bench.job_cost("paged_mla_sparse_decode", d | {"kv": "bf16"})[0],
                     16 * 384 + 3072 + 2048 + 64 + 32)
    # Indexer scoring, fp8: 64 cached keys of 32 entries + a 4-byte scale, the tables
    # (8 entries), q (4 x 32 bf16) and weights (4 f32) per request, one f32 score per key.
    d = _SMALL["paged_index_scores"]
    self.assertEqual(indexer_bench.job_cost(d),
                     (64 * 36 + 8 * 4 + 2 * 4 * 32 * 2 + 2 * 4 * 4 + 64 * 4, 2 * 64 * 4 * 32))
    self.assertEqual(indexer_bench.job_cost(d | {"kv": "bf16"})[0],
                     64 * 64 + 8 * 4 + 2 * 4 * 32 * 2 + 2 * 4 * 4 + 64 * 4)

  def test_unknown_kernel(self):
    with self.assertRaisesRegex(ValueError, "unknown kernel"):
      attn_bench.job_cost("int4_matmul", _SMALL["int4_matmul"])
    with self.assertRaisesRegex(ValueError, "unknown kernel"):
      int4_bench.job_cost("tag_check", _SMALL["tag_check"])
    with self.assertRaisesRegex(ValueError, "weights must be"):
      int4_bench.job_cost("int4_matmul", _SMALL["int4_matmul"], weights="fp8")

  def test_bf16_twin_bytes_are_gpu_checks_bf16_peer(self):
    for kernel in int4_bench.KERNELS:
      bench = int4_bench.bench_case(kernel, _SMALL[kernel], backend="xla")
      twin = next(i for i in bench.impls if i.name.startswith("xla_bf16"))
      self.assertEqual(twin.nbytes, int4_bench.job_cost(kernel, _SMALL[kernel], weights="bf16")[0])
      m, k, n = (_SMALL[kernel][x] for x in ("m", "k", "n"))
      experts = min(m, _SMALL[kernel].get("experts", 1))
      self.assertEqual(twin.nbytes, experts * k * n * 2 + m * k * 2 + m * n * 2)


class SheetTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.cases = kt.target_cases()
    cls.sheet = rf.rows(cls.cases)

  def test_one_row_per_target_case_at_the_h200_roofline(self):
    self.assertEqual([r["case"] for r in self.sheet], [c.name for c in self.cases])
    for r in self.sheet:
      mem, comp = r["bytes"] / 4.3e12, r["flops"] / 790e12
      self.assertAlmostEqual(r["roofline_s"], max(mem, comp), delta=1e-15)
      self.assertEqual(r["bound"], "memory" if mem >= comp else "compute")
      self.assertIsNone(r["time_s"])
      self.assertIsNone(r["roofline_fraction"])

  def test_design_counts_the_kernels_padding(self):
    by = {c.name: (c, r) for c, r in zip(self.cases, self.sheet)}
    for r in self.sheet:
      self.assertGreaterEqual(r["design_flops"], r["flops"])
      self.assertGreaterEqual(r["design_bytes"], r["bytes"])
      if not r["design_fp8_flops"]:  # fp8 MMAs can beat the bf16-rate roofline
        self.assertGreaterEqual(r["design_s"], r["roofline_s"])
    # MLA partials: batch 1, 64 pages of 64 tokens, 64 heads: 1 * 64 / 2 + 1 = 33
    # pieces, each writing [64, 512] bf16 + 64 f32 that the merge reads back.
    c, r = by["mla/dp/fp8/b1/ctx4096"]
    self.assertEqual(r["design_bytes"] - r["bytes"], 2 * 33 * (64 * 512 * 2 + 64 * 4))
    self.assertEqual(r["design_bound"], "memory")
    # MLA: 8 heads per device are wgmma's N in the tokens-in-M kernel (no padding,
    # memory-bound like the job); 64 heads fill the heads-in-M kernel's 64 rows.
    c, r = by["mla/tp8/fp8/b64/ctx131072"]
    self.assertEqual(r["design_flops"], r["flops"])
    self.assertEqual(r["design_bound"], "memory")
    self.assertLessEqual(r["design_s"], r["target_s"])
    c, r = by["mla/dp/fp8/b64/ctx131072"]
    self.assertEqual(r["design_flops"], r["flops"])
    # There QK (576 of the 1,088 MMA columns per token) runs as fp8 MMA at twice the
    # bf16 rate: no longer MMA-bound, and within the target the bf16 rate misses.
    self.assertEqual(r["design_fp8_flops"] * (2 * 512 + 64), r["flops"] * (512 + 64))
    self.assertEqual(r["design_bound"], "memory")
    self.assertGreater(r["flops"] / 790e12, r["target_s"])
    self.assertLessEqual(r["design_s"], r["target_s"])
    self.assertAlmostEqual(rf.design_mma_s(c), (r["flops"] - r["design_fp8_flops"]) / 790e12
                           + r["design_fp8_flops"] / 1580e12, delta=1e-15)
    self.assertEqual(by["mla/dp/bf16/b64/ctx131072"][1]["design_fp8_flops"], 0)
    self.assertEqual(by["mla/tp8/fp8/b64/ctx131072"][1]["design_fp8_flops"], 0)
    # 3 heads: padded to 8 (the tokens kernel's N), not to 64.
    base = by["mla/tp8/fp8/b8/ctx32768"][0]
    case = dataclasses.replace(base, dims=tuple(dict(base.d, heads=3).items()))
    self.assertEqual(rf.design_flops(case) * 3, rf.job_cost(case)[1] * 8)
    # INT4 dense at one token computes a whole tile_m of token columns.
    c, r = by["int4/kimi-k2.6/wq_a/m1/g32"]
    self.assertEqual(r["design_flops"], 8 * r["flops"])  # tile_m: 1 row rounds up to 8
    # ... and writes f32 partials [4 splits, N, 8] that the sum reads back.
    self.assertEqual(r["design_bytes"] - r["bytes"], 2 * 4 * c.d["n"] * 8 * 4)
    # INT4 grouped at one row per expert: one tile of 8 token columns per expert.
    c, r = by["int4g/kimi-k2.6/up/r1/g32"]
    self.assertEqual(r["design_flops"], 2 * 48 * 8 * c.d["k"] * c.d["n"])
    # The sheet says whether the fp8 MLA design reaches its bandwidth target.
    text = "\n".join(rf.summary_lines(self.sheet))
    self.assertIn("design meets it at all 8", text)
    self.assertIn("at 4 of them only through QK as fp8 MMA", text)
    # INT4 dense: the small projections at 1 and 8 tokens stay below 3x by the
    # design's time (their f32 split partials, 8 token rows each).
    self.assertIn("below the target at 16 of 56 (wkv_b, wq_b)", text)
    # A design that takes longer than its targets allow (as with f16 QK, bf16 rate).
    slow = [dict(r, design_s=2 * r["target_s"], design_bound="MMA")
            if r["kernel"] == "paged_mla_decode" and r["target_s"] else r for r in self.sheet]
    text = "\n".join(rf.summary_lines(slow))
    self.assertIn("design misses it at 8 of them, reaching at most 40%-40%", text)
    self.assertIn("the job itself is MMA-bound in bf16", text)

  def test_targets(self):
    for c, r in zip(self.cases, self.sheet):
      d = c.d
      if c.kernel == "paged_mla_decode" and d["kv"] == "fp8" and d["context"] >= 8192 \
          and d["batch"] >= 8:
        self.assertAlmostEqual(r["target_s"], r["bytes"] / (0.8 * 4.3e12), delta=1e-15)
      else:
        self.assertIsNone(r["target_s"], c.name)
      if c.kernel == "int4_matmul":
        self.assertEqual(r["target"] != "-", d["m"] <= 16)

  def test_twin_gain(self):
    by_name = {r["case"]: r for r in self.sheet}
    for c, r in zip(self.cases, self.sheet):
      if c.kernel in ("paged_mla_decode", "paged_mla_sparse_decode", "paged_index_scores") \
          and c.d["kv"] == "fp8":
        # The bf16 twin is itself a target case: its roofline over this one's.
        twin = by_name[c.name.replace("/fp8/", "/bf16/")]
        self.assertAlmostEqual(r["twin_gain"], twin["roofline_s"] / r["roofline_s"], places=9)
        self.assertGreater(r["twin_gain"], 1.5)
      elif c.kernel.startswith("int4") and r["bound"] == "memory":
        # int4 + bf16 group scales: between 2x and 4x fewer bytes than bf16.
        self.assertGreater(r["twin_gain"], 2.0)
        self.assertLess(r["twin_gain"], 4.0)
      elif c.kernel in ("tag_check",) or (c.kernel.startswith("paged") and c.d["kv"] == "bf16"):
        self.assertIsNone(r["twin_gain"])

  def test_measured_join(self):
    c = self.cases[0]
    floor = self.sheet[0]["roofline_s"]
    measured = {c.name: {"status": "ok", "time_s": 4 * floor},
                self.cases[1].name: {"status": "error", "time_s": None}}
    rows = rf.rows(self.cases[:2], measured)
    self.assertAlmostEqual(rows[0]["roofline_fraction"], 0.25)
    self.assertEqual(rows[0]["time_s"], 4 * floor)
    self.assertIsNone(rows[1]["time_s"])

  def test_markdown(self):
    md = rf.markdown(self.sheet)
    self.assertIn("252 target cases; 0 measured on a GPU", md)
    for kernel in kt.KERNELS:
      self.assertIn(f"### {kernel}", md)
    self.assertIn("| mla/tp8/fp8/b64/ctx131072 |", md)
    self.assertIn("### What the model says about the targets", md)
    # 32K / 2048 and 128K / 2048 selected rows: the dense job reads 16x and 64x the bytes.
    self.assertIn("the dense kernel's roofline at the same shape is 15-64x this one's", md)


if __name__ == "__main__":
  absltest.main()
