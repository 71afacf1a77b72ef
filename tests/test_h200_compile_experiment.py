"""The h200_compile experiment: a tiny model's decode step compiled for 8x H200 (its smoke run,
through the command line), its per-device bytes against the analytic ones, the out-of-memory
marking (checked in test_experiments.SmokeRunsTest, which runs every smoke run in one process);
and the library it runs (mlkit.plan): the depth fit, the plan and the step shapes."""

import dataclasses
import json
import os

import jax
from absl.testing import absltest

from mlkit import kvcache as kvc
from mlkit.parallel import abstract_params
from mlkit.plan import step_compile as sc
from mlkit.plan import step_memory as sm
from mlkit.quant import INT4_EXPERTS, weight_bytes
from mlkit.quant.tree import flatten_params
from pallas_kernels.h200 import step_placement


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class H200CompileSmokeChecks:
  """Checks of the h200_compile smoke run. Not a TestCase: test_experiments.SmokeRunsTest
  mixes it in, which runs every experiment's smoke mode in one process."""

  @property
  def rec(self):
    return self.records["h200_compile"]

  @property
  def plan(self):
    return sc.plan_for(quick=True, smoke=True)

  def test_h200_compile_arguments_are_the_analytic_weights_kv_and_inputs(self):
    (c,) = self.rec["compiles"]
    cfg = sc.TINY
    # KV: MLA pages are replicated, so every device holds the whole pool:
    # pages x (page_size x (kv_lora + rope) x layers x 2 B) + a 4 B tag per page.
    kv = c["num_pages"] * (sc.PAGE_SIZE * kvc.bytes_per_token(cfg, "bfloat16") + 4)
    self.assertEqual(c["kv"], kv)
    # Inputs: 8 int32/uint32/f32 vectors [B] and 4 int32 arrays [B, T] or [B, M], replicated.
    B, T, M = c["rows"], c["tokens"], c["max_pages"]
    self.assertEqual(c["inputs"], 4 * (7 * B + 2 * B * T + 2 * B * M))
    # Weights: the accounting convention (every >= 2-D weight split 8 ways, mlkit.quant
    # .weight_bytes) plus what the placement keeps whole on every device instead: MLA's
    # low-rank down projections and the routers, of which the convention counts only 1/8.
    # The split axes all divide by 8, so the two agree to the byte.
    params = abstract_params(cfg, INT4_EXPERTS, sc.h200_mesh(), sc.RULES)
    replicated = sum(x.size * x.dtype.itemsize for path, leaf in flatten_params(params)[0]
                     if path.rsplit("/", 1)[-1] in ("wq_a", "wkv_a", "router")
                     for x in jax.tree_util.tree_leaves(leaf))
    self.assertGreater(replicated, 0)
    analytic = weight_bytes(params, tp=8).per_device + replicated * 7 // 8
    self.assertEqual(c["weights"], analytic)
    # XLA's own reading of the compiled program: exactly weights + KV + inputs.
    self.assertEqual(c["argument"], analytic + kv + c["inputs"])
    self.assertTrue(c["argument_matches_analytic"])
    # The donated pool comes back aliased: outputs are the pool plus the sampled tokens.
    self.assertEqual(c["alias"], kv)
    self.assertGreater(c["temp"], 0)

  def test_h200_compile_sixty_four_requests_do_not_fit_the_toy_device(self):
    (row,) = self.rec["rows"]
    (c,) = self.rec["compiles"]
    at = row["at_concurrency"]
    self.assertEqual(at["requests"], 64)
    self.assertEqual(c["num_pages"], 64 * sc.pages_per_request(sc.TINY_WORK))
    self.assertEqual(at["peak"], c["argument"] + c["temp"] + c["output"] - c["alias"])
    self.assertGreater(at["peak"], self.plan.hbm_bytes)
    self.assertFalse(at["fits_hbm"])
    # XLA's reading of the served weights (its arguments less pool and inputs) is the
    # placement's, to the byte.
    self.assertAlmostEqual(row["weights_xla"], row["weights_served"], delta=1)
    # The deployment's own pool does fit: it holds fewer requests, with the step's
    # temporaries inside the reserve the static fraction leaves.
    self.assertTrue(row["temps_fit_reserve"])
    self.assertLessEqual(row["largest_pool"], row["static_pool"])
    self.assertGreater(row["concurrency"], 0)
    self.assertLess(row["concurrency"], 64)
    self.assertEqual(row["tokens"], kvc.capacity(sc.TINY, "bfloat16",
                                                 int(row["largest_pool"]), page_size=64)["tokens"])

  def test_h200_compile_kernels_each_gpu_runs(self):
    (c,) = self.rec["compiles"]
    where = {}
    for k in c["kernels"]:
      where.setdefault(k["name"], []).append(k["layer"])
    # The tag check before the layers; in both layers the absorbed query, the page write
    # (with the entries' norm and rope), attention and the absorbed values; before the MoE
    # layer's norm the residual add with it (the dense layer's outputs); the MoE layer's
    # expert choice and its rows sorted by expert (the sort also writes the grouped calls'
    # tile schedule), then gate with up and down as two grouped INT4 calls (run per GPU
    # inside the experts' shard_map).
    both = ["layer_0", "layer_1"]
    self.assertEqual(where, {"tag_check": ["-"], "mla_absorbed_query": both,
                             "page_write_mla": both, "paged_mla_decode": both,
                             "mla_absorbed_values": both, "residual_norm": ["layer_1"],
                             "select_experts": ["layer_1"], "sort_by_expert": ["layer_1"],
                             "int4_grouped_matmul": ["layer_1"] * 2})
    # What XLA gathers is the MoE dispatch's per-token routing values ([rows, 8]), no weight.
    self.assertNotEmpty(c["all_gathers"])
    for g in c["all_gathers"]:
      for _, shape in step_placement.arrays(g["result"]):
        self.assertEqual(shape, (c["rows"], 8), g)
    self.assertEqual(c["all_gather_bytes"], sum(g["bytes"] for g in c["all_gathers"]))

  def test_h200_compile_kernels_per_step_are_counted(self):
    (c,) = self.rec["compiles"]
    (row,) = self.rec["rows"]
    # Every Pallas kernel call is one launch of XLA's thunk sequence, beside XLA's own
    # fusions (the embedding, norms, routing, sampling), so the step launches more.
    self.assertGreater(c["launches"], len(c["kernels"]))
    # One depth: the full-depth reading is that count.
    self.assertEqual(row["launches"], {"decode": c["launches"]})
    with open(os.path.join(self.out, "h200_compile.md")) as f:
      md = f.read()
    self.assertIn("kernels per step, decode / prefill", md)
    self.assertIn(f"| {c['launches']:,} / - |", md)

  def test_h200_compile_files_well_formed(self):
    with open(os.path.join(self.out, "h200_compile.json")) as f:
      rec = json.load(f)
    self.assertEqual((rec["experiment"], rec["mode"], rec["kernel_backend"]),
                     ("h200_compile", "smoke", "pallas"))
    with open(os.path.join(self.out, "h200_compile.md")) as f:
      md = f.read()
    self.assertIn("**NO (out of memory)**", md)
    self.assertIn("not instantiated", md)
    self.assertIn("## Kernels each GPU runs", md)
    self.assertIn("| int4_grouped_matmul | mosaic_gpu_v2 | `bf16[128,64]` | layer_1 | 1 |", md)
    with open(os.path.join(self.out, "h200_compile.png"), "rb") as f:
      self.assertEqual(f.read(8), PNG_MAGIC)


class FitAndPlanTest(absltest.TestCase):

  def test_fit_depth_line_and_residual(self):
    fit = sm.fit_depth([(1, 10.0), (2, 13.0), (3, 16.0)], at=60)
    self.assertAlmostEqual(fit["slope"], 3.0)
    self.assertAlmostEqual(fit["intercept"], 7.0)
    self.assertAlmostEqual(fit["at_full"], 187.0)
    self.assertAlmostEqual(fit["max_residual"], 0.0, places=9)
    self.assertAlmostEqual(fit["marginal_slope"], 3.0)
    # A first MoE layer that adds a one-off 2: least squares says 3 per layer, the
    # deepest two points 2, and the full-depth reading extends those.
    bent = sm.fit_depth([(3, 16.0), (1, 10.0), (2, 14.0)], at=5)
    self.assertAlmostEqual(bent["slope"], 3.0)
    self.assertAlmostEqual(bent["max_residual"], 2 / 3)
    self.assertAlmostEqual(bent["marginal_slope"], 2.0)
    self.assertAlmostEqual(bent["at_full"], 20.0)

  def test_fit_depth_single_point_is_constant(self):
    fit = sm.fit_depth([(2, 5.0)], at=60)
    self.assertEqual((fit["slope"], fit["at_full"]), (0.0, 5.0))
    with self.assertRaisesRegex(ValueError, "no points"):
      sm.fit_depth([], at=1)

  def test_plan_validation_names_the_field(self):
    plan = sc.plan_for(quick=True, smoke=True)
    with self.assertRaisesRegex(ValueError, "Plan.moe_depths"):
      dataclasses.replace(plan, moe_depths=())
    with self.assertRaisesRegex(ValueError, "Plan.static_fraction"):
      dataclasses.replace(plan, static_fraction=1.5)
    with self.assertRaisesRegex(ValueError, "Plan.kinds"):
      dataclasses.replace(plan, kinds=("train",))
    # A verify step drafts with an MTP layer: the smoke model has none, GLM 5.2 is sparse.
    with self.assertRaisesRegex(ValueError, "tiny int4 experts .* 0 MTP layers"):
      dataclasses.replace(plan, kinds=("verify",))
    with self.assertRaisesRegex(ValueError, "1 MTP layers and sparse attention"):
      dataclasses.replace(plan, variants=(sc.GLM_FP8,), kinds=("verify",))
    with self.assertRaisesRegex(ValueError, "Plan.speculative_tokens"):
      sc.speculative_plan(smoke=True, k=0)

  def test_step_shapes_follow_the_sweep(self):
    plan = sc.plan_for(quick=True, smoke=False)
    kimi, glm = sc.KIMI.work, sc.GLM_FP8.work
    self.assertEqual(sc.step_shape("decode", kimi, plan), (64, 1, 256))
    self.assertEqual(sc.step_shape("prefill", kimi, plan), (1, 8192, 256))
    self.assertEqual(sc.step_shape("prefill", glm, plan), (4, 2048, 48))
    # A verify row: the last token and k drafts, in pages holding 2k - 1 positions more
    # (Kimi's 16,384 tokens fill 256 pages exactly: the look-ahead needs one more).
    spec = sc.speculative_plan(smoke=False, k=3)
    self.assertEqual(sc.step_shape("verify", spec.variants[0].work, spec), (64, 4, 257))
    self.assertEqual(spec.kinds, ("decode", "verify"))
    self.assertEqual(spec.variants[0].model.n_mtp_layers, 1)

  def test_lowering_a_verify_step_needs_speculative_tokens(self):
    from mlkit.engine import EngineConfig
    from mlkit.engine.runner import abstract_batch, lower_step
    with self.assertRaisesRegex(ValueError, "speculative_tokens"):
      lower_step(None, None, abstract_batch(1, 2, 1, None, speculative=True),
                 EngineConfig(model=sc.TINY, kv=kvc.KVCacheConfig(num_pages=4)), kind="verify")
    with self.assertRaisesRegex(ValueError, "kind must be"):
      lower_step(None, None, abstract_batch(1, 1, 1, None),
                 EngineConfig(model=sc.TINY, kv=kvc.KVCacheConfig(num_pages=4)), kind="train")


if __name__ == "__main__":
  absltest.main()
