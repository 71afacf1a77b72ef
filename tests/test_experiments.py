"""Experiments: smoke runs write well-formed JSON, markdown and PNG; paper-scale arithmetic; CLI.

The engine experiments, paper, accuracy, h200_compile, retrieval_learning, cpu_peer and
kernels run their smoke modes (2-layer TINY_MLA, a few tokens) through the command line,
all in one ``python -m experiments ... --smoke`` process, as a user runs them; their smoke
shapes are chosen so that several share compiled steps. The tests read the files it
writes. The logic the experiments run is the library's, tested where it lives (here: the
analytic model, mlkit.measure and the fp8-vs-bf16 budget).
"""

import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
from unittest import mock

from absl.testing import absltest, parameterized

from configs import GLM_5_2, H200, KIMI_K2_6, TINY_MLA
from mlkit import kvcache as kvc
from mlkit import perfmodel as pm
from mlkit.measure import median_range, stats
from mlkit.peer import compare as peer_compare
from mlkit.quant import FP8_ALL, INT4_EXPERTS
from mlkit.report import comparison
from pallas_kernels import targets
from pallas_kernels.h200 import kernel_readings
from pallas_kernels.tables import cell, markdown_table

from experiment_runs import run_experiment
import h200_compile_cases
from tempdirs import temp_dir
from test_accuracy_experiment import AccuracySmokeChecks
from test_cpu_peer import CpuPeerSmokeChecks, fake_python
from test_h200_compile_experiment import H200CompileSmokeChecks
from test_retrieval_learning import RetrievalLearningSmokeChecks

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Run by SmokeRunsTest, in this order, in one process: accuracy trains the smoke model that
# speculative then loads, and experiments of the same shapes share compiled steps.
SMOKE = ("kv_dtype", "integrity", "paper", "weight_quant", "disagg", "prefix_cache", "accuracy",
         "speculative", "h200_compile", "retrieval_learning", "cpu_peer", "kernels")
# Those that plot: all but the peer comparison's table and the kernels' skip on a CPU.
PLOTTED = tuple(n for n in SMOKE if n not in ("cpu_peer", "kernels"))
# Those whose files test_files_well_formed checks (the mixed-in checks cover the others').
ENGINE_SMOKE = ("kv_dtype", "integrity", "paper", "weight_quant", "disagg", "prefix_cache",
                "speculative")


class SmokeRunsTest(AccuracySmokeChecks, H200CompileSmokeChecks, RetrievalLearningSmokeChecks,
                    CpuPeerSmokeChecks, parameterized.TestCase):
  """Runs every experiment's smoke mode in one command into one folder, then checks the
  files; the checks of the accuracy, h200_compile, retrieval_learning and cpu_peer runs
  live beside those experiments' other tests and are mixed in here. One process runs them
  all because each process pays for its imports and compiles its own steps."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.out = temp_dir(cls, "experiments_smoke_")
    # The kernels experiment shows the H200 compile readings on disk. The compile tests may
    # add records while it runs (pytest -n 2), so it reads a snapshot of them taken now.
    snapshot = temp_dir(cls, "compile_records_")
    if os.path.isdir(h200_compile_cases.RECORDS_DIR):
      shutil.copytree(h200_compile_cases.RECORDS_DIR, snapshot, dirs_exist_ok=True)
    cls.readings_before = kernel_readings.markdown(kernel_readings.load_records(snapshot))
    # accuracy trains the smoke model into a cache of this run's own, which this process
    # reads too (AccuracySmokeChecks loads the trained model); cpu_peer's peer cannot start.
    run_env = {"MLKIT_CACHE": temp_dir(cls, "experiments_cache_"),
               "MLKIT_H200_COMPILE_RECORDS": snapshot,
               peer_compare.PEER_PYTHON_ENV: fake_python(temp_dir(cls, "cpu_peer_python_"))}
    cls.env = mock.patch.dict(os.environ, run_env)
    cls.env.start()
    cls.addClassCleanup(cls.env.stop)
    cls.records = run_experiment(*SMOKE, out=cls.out, timeout=900, env=dict(os.environ))

  @parameterized.parameters(*ENGINE_SMOKE)
  def test_files_well_formed(self, name):
    rec = self.records[name]
    self.assertEqual(rec["experiment"], name)
    self.assertEqual(rec["mode"], "smoke")
    for key in ("backend", "jax", "device_kind", "time_utc"):
      self.assertIn(key, rec["machine"])
    self.assertIn(rec["kernel_backend"], ("xla", "pallas"))
    self.assertTrue(rec["config"])
    with open(os.path.join(self.out, f"{name}.md")) as f:
      md = f.read()
    self.assertTrue(md.startswith(f"# {name}"), md[:80])
    self.assertIn("|---|", md)
    self.assertIn(f"]({name}.png)", md)
    with open(os.path.join(self.out, f"{name}.png"), "rb") as f:
      png = f.read()
    self.assertEqual(png[:8], PNG_MAGIC)
    self.assertGreater(len(png), 5000)

  def test_report_links_tables_and_plots(self):
    with open(os.path.join(self.out, "REPORT.md")) as f:
      report = f.read()
    # The comparison table opens it (mlkit.report.comparison; paper.json is among the records).
    self.assertIn(comparison.HEADER, report)
    self.assertNotIn("Comparison table failed", report)
    self.assertIn(f"![report vs ours]({comparison.PLOT})", report)
    for name in SMOKE:
      self.assertIn(f"## {name} (", report)
      for link in (f"[{name}.json]({name}.json)", f"[{name}.md]({name}.md)"):
        self.assertIn(link, report)
    for name in PLOTTED:
      self.assertIn(f"![{name}.png]({name}.png)", report)
    self.assertIn("![kernels_roofline.png](kernels_roofline.png)", report)
    self.assertNotIn("**Failed:**", report)

  def test_speculative_keeps_the_greedy_tokens(self):
    rec = self.records["speculative"]
    for task, ks in rec["acceptance"].items():
      for k, r in ks.items():
        self.assertTrue(r["identical"], (task, k))
        spec = r["speculation"]
        self.assertEqual(sum(spec["accepted_histogram"]), spec["verify_rows"])
        self.assertGreaterEqual(spec["acceptance_length"], 1.0)
    for row in rec["speed"]:
      self.assertTrue(row["identical"], row)
      self.assertGreater(row["tok_s_on"], 0)

  def test_speculative_compiles_the_verify_step_for_h200(self):
    rec = self.records["speculative"]["h200_compile"]
    k = rec["plan"]["speculative_tokens"]
    self.assertEqual(k, self.records["speculative"]["config"]["best_k"])
    decode, verify = rec["rows"]
    self.assertEqual((decode["kind"], verify["kind"]), ("decode", "verify"))
    self.assertEqual((decode["tokens"], verify["tokens"]), (1, k + 1))
    # The verify step holds the MTP layer's weights and KV beside the model's, runs the
    # model over k + 1 tokens per row and the drafter k times: more of everything.
    for f in ("argument", "temp", "launches"):
      self.assertGreater(verify[f], decode[f], f)
    with open(os.path.join(self.out, "speculative.md")) as f:
      md = f.read()
    self.assertIn(f"## The verify step compiled for 8x H200 (k = {k})", md)
    self.assertIn(f"| verify | {k + 1} |", md)

  def test_prefix_cache_saves_prefill_with_identical_outputs(self):
    runs = self.records["prefix_cache"]["runs"]
    for L, r in runs.items():
      self.assertTrue(r["outputs_identical"], L)
    shared = runs[str(max(map(int, runs)))]
    on, off = shared["cache on"], shared["cache off"]
    self.assertGreater(on["prefix_cache"]["tokens_saved"], 0)
    self.assertEqual(on["prefill_tokens_computed"] + on["prefix_cache"]["tokens_saved"],
                     off["prefill_tokens_computed"])
    self.assertEqual(runs["0"]["cache on"]["prefix_cache"]["tokens_saved"], 0)

  def test_kv_dtype_bf16_runs_out_fp8_does_not(self):
    rec = self.records["kv_dtype"]
    # The budget: fp8 holds the top concurrency's full sequences, bf16 fewer.
    budget, top = rec["config"]["budget"], max(rec["config"]["shape"]["concurrency"])
    self.assertEqual(budget["fits"]["float8_e4m3fn"], top)
    self.assertLess(budget["fits"]["bfloat16"], top)
    self.assertEqual(rec["oom_concurrency"], {"bfloat16": [2], "float8_e4m3fn": []})
    self.assertTrue(rec["report_shape_reproduced"])
    for r in rec["runs"]:
      self.assertEqual(r["oom"], r["predicted_oom"], r)  # observed agrees with the page count
      if not r["oom"]:
        s = r["decode_tok_s_stats"]
        self.assertGreater(s["n"], 0)
        self.assertLessEqual(s["min"], s["median"])
        self.assertLessEqual(s["median"], s["max"])
    oom = next(r for r in rec["runs"] if r["oom"])
    self.assertTrue(oom["preemptions"] > 0 or oom["peak_decoding"] < oom["concurrency"])
    self.assertIsNone(oom["decode_tok_s"])

  def test_integrity_faults_detected_and_never_contaminate(self):
    f = self.records["integrity"]["faults"]
    # The four arms (the JSON sorts their keys; the experiment runs them in this order).
    self.assertCountEqual(f, ["both on", "tag check only", "audit only", "both off"])
    for arm in ("both on", "tag check only", "audit only"):  # each defence alone suffices
      on = f[arm]
      self.assertEqual(len(on["faults"]), 2)
      self.assertEqual(on["contaminated"], 0, arm)
      self.assertGreaterEqual(on["detected"], 1, arm)
      self.assertEqual(on["aborted"], on["detected"], arm)
    # The control: the same faults without either defence corrupt someone's answer.
    off = f["both off"]
    self.assertEqual(off["detected"], 0)
    self.assertGreaterEqual(off["contaminated"], 1)
    for t in self.records["integrity"]["timing"]:
      self.assertGreater(t["throughput_ratio"]["median"], 0)

  def test_weight_quant_memory(self):
    rec = self.records["weight_quant"]
    local = rec["local_weight_bytes_per_device"]
    for recipe in (FP8_ALL, INT4_EXPERTS):  # both shrink the (f32 here) checkpoint
      self.assertLess(local[recipe.name], 0.8 * rec["local_checkpoint_bytes"])
    glm = {p["recipe"]: p["per_gpu_gib"] for p in rec["paper_weight_memory"]
           if p["model"] == GLM_5_2.name}
    self.assertAlmostEqual(glm[FP8_ALL.name] / 88, 1, delta=0.02)
    self.assertAlmostEqual(glm[INT4_EXPERTS.name] / 52, 1, delta=0.02)
    self.assertGreater(rec["prefill_int4_over_fp8"], 0)

  def test_disagg_serves_everything(self):
    rec = self.records["disagg"]
    for pair in rec["pairs"]:
      for v in ("disaggregated", "colocated_bf16"):
        self.assertEqual(pair[v]["aborted"], 0)
        self.assertEqual(pair[v]["finished"], rec["config"]["shape"]["requests"])
    self.assertGreater(rec["transfer_metrics"]["transfers"], 0)
    self.assertEqual(rec["transfer_metrics"]["transfer_failures"], 0)

  def test_kernels_skips_cleanly_without_gpu(self):
    rec = self.records["kernels"]
    if rec["machine"]["backend"] == "gpu":
      self.assertFalse(rec["skipped"])
      self.assertTrue(rec["records"])
    else:
      self.assertTrue(rec["skipped"])
      self.assertIn("needs an NVIDIA GPU", rec["reason"])
      with open(os.path.join(self.out, "kernels.md")) as f:
        md = f.read()
      self.assertIn("needs an NVIDIA GPU", md)
      self.assertIn("## H200 compile readings", md)
      self.assertIn(self.readings_before, md)
      # Without a device it shows the committed H200 runs: each of their cases once (a
      # rerun's record replacing the first run's), and their times in the roofline sheet.
      committed = sorted(glob.glob(os.path.join(_REPO, "docs", "measurements",
                                                "gpu_check_*.jsonl")))
      self.assertTrue(committed)
      self.assertIn("committed under `docs/measurements`", md)
      want = {}
      for path in committed:
        with open(path) as f:
          want.update({r["name"]: r for r in map(json.loads, f) if r.get("type") == "case"})
      self.assertEqual(sorted(c["name"] for c in rec["cases"]), sorted(want))
      rows = set(re.findall(r"^\| \w+ \| (\S+) \| (\w+) \|", md, re.M))
      self.assertEqual({(n, r["status"]) for n, r in want.items() if r.get("group") != "ceiling"},
                       rows & {(n, r["status"]) for n, r in want.items()})
      self.assertIn("Measured ceilings: ceiling/copy", md)
      self.assertIn("## Roofline sheet (H200, per call)", md)
      self.assertLen(rec["roofline"], len(targets.target_cases()))
      timed = {r["case"] for r in rec["roofline"] if r["time_s"] is not None}
      self.assertEqual(timed, {n for n, r in want.items()
                               if r.get("group") == "target" and r["status"] == "ok"})
      with open(os.path.join(self.out, "kernels_roofline.png"), "rb") as f:
        self.assertEqual(f.read(8), PNG_MAGIC)

  def test_paper_predictions(self):
    rec = self.records["paper"]
    for key in ("kimi", "glm"):
      self.assertLess(rec["calibration"][key]["fits"]["overhead"]["max_abs_error"], 0.10)
    rows = {(r["column"], r["concurrency"]): r for r in rec["columns"]}
    self.assertTrue(rows[("kimi bf16 KV", 64)]["predicted_oom"])
    self.assertFalse(rows[("kimi bf16 KV", 32)]["predicted_oom"])
    self.assertFalse(rows[("kimi fp8 KV", 64)]["predicted_oom"])
    # fp8 KV reads half the cache bytes: never slower at high concurrency.
    self.assertGreater(rows[("kimi fp8 KV", 32)]["predicted_tok_s"],
                       rows[("kimi bf16 KV", 32)]["predicted_tok_s"])
    names = [a["name"] for a in rec["assumptions"]]
    self.assertIn("allreduce_latency_s", names)
    self.assertTrue(all(a["note"] for a in rec["assumptions"]))

  def test_paper_compiled_program_model(self):
    comp = self.records["paper"]["compiled"]
    # The smoke plan: the tiny 8-way model's decode step, no report column to fit the gap on.
    self.assertFalse(comp["fitted"])
    self.assertEqual([(r["column"], r["rows"]) for r in comp["rows"]], [("tiny", 1), ("tiny", 64)])
    for r in comp["rows"]:
      self.assertTrue(0 < r["tok_s"] < float("inf"))
      self.assertEqual(r["tokens"], r["rows"])
      # No loop in a decode step: the top-p filter's cumsum over the vocabulary shard once
      # compiled into two sequential loops (158 launches here; 41K for Kimi K2.6).
      self.assertEqual(r["loop_launches"], 0)
      # The tiny model's launches per MoE layer, held so they do not creep (Kimi K2.6's
      # are held by tests/test_launches_per_moe_layer.py; docs/step_time.md lists them).
      self.assertLessEqual(r["layer_launches"], 36)
      self.assertGreater(r["moe_layer"]["int4"]["launches"], 0)
      self.assertAlmostEqual(sum(v["seconds"] for v in r["by_kind"].values()),
                             r["step_ms"] / 1e3, delta=1e-9)
    with open(os.path.join(self.out, "paper.md")) as f:
      md = f.read()
    self.assertIn("## Compiled-program model", md)
    self.assertIn("not fitted (no report column)", md)
    # With the kernels' efficiencies gpu_check measured (docs/measurements) as well.
    measured = self.records["paper"]["compiled_measured"]
    self.assertIn("attention_bw", measured["measured"])
    self.assertEqual(len(measured["rows"]), len(comp["rows"]))
    self.assertIn("as measured on an H200", md)


class PaperScaleTest(parameterized.TestCase):
  """The report's capacity figures are arithmetic, so they are asserted."""

  @parameterized.parameters(("bfloat16", 686_000), ("float8_e4m3fn", 1_370_000))
  def test_kimi_capacity_within_5_percent(self, dtype, report):
    cap = kvc.capacity(KIMI_K2_6, dtype, 48 * 10**9, tp=8)
    self.assertAlmostEqual(cap["tokens"] / report, 1.0, delta=0.05)
    kimi = pm.Deployment("kimi", KIMI_K2_6, INT4_EXPERTS, dtype, H200)
    budget = pm.kv_budget(kimi, pm.static_memory_fraction(kimi))
    self.assertAlmostEqual(budget / 48e9, 1.0, places=6)
    self.assertEqual(pm.capacity(kimi, budget)["tokens"], cap["tokens"])

  def test_kimi_bytes_per_token(self):
    self.assertEqual(kvc.bytes_per_token(KIMI_K2_6, "bfloat16"), 70_272)
    self.assertEqual(kvc.bytes_per_token_breakdown(KIMI_K2_6, "float8_e4m3fn")["values"], 35_136)

  def test_glm_int4_frees_kv_budget(self):
    frac = pm.static_memory_fraction(pm.Deployment("k", KIMI_K2_6, INT4_EXPERTS, "bfloat16", H200))
    fp8 = pm.Deployment("g", GLM_5_2, FP8_ALL, "float8_e4m3fn", H200)
    int4 = fp8.replace(recipe=INT4_EXPERTS)
    freed = pm.kv_budget(int4, frac) - pm.kv_budget(fp8, frac)
    w = pm.weight_split(fp8)["per_gpu"] - pm.weight_split(int4)["per_gpu"]
    self.assertAlmostEqual(freed, w, delta=1.0)
    self.assertGreater(pm.capacity(int4, pm.kv_budget(int4, frac))["tokens"],
                       2 * pm.capacity(fp8, pm.kv_budget(fp8, frac))["tokens"])


class PerfModelTest(parameterized.TestCase):

  def test_distinct_experts(self):
    self.assertAlmostEqual(pm.distinct_experts(384, 8, 1), 8.0)
    self.assertAlmostEqual(pm.distinct_experts(384, 8, 10_000), 384.0, places=3)
    self.assertLess(pm.distinct_experts(384, 8, 64), 64 * 8)

  def test_speculative_step_reads_more_and_emits_more(self):
    dep = pm.Deployment("glm", GLM_5_2, FP8_ALL, "bfloat16", H200)
    work = pm.Workload(2048, 1024)
    plain = pm.decode_step(dep, 8, work)
    none = pm.speculative_decode_step(dep, 8, work, 2, 1.0)  # every draft rejected
    self.assertLess(none["speedup"], 1.0)
    self.assertGreater(none["verify"]["bytes"], sum(plain["bytes"].values()))
    self.assertAlmostEqual(none["verify"]["flops"], 3 * plain["flops"])
    speedups = [pm.speculative_decode_step(dep, 1, work, 2, al)["speedup"]
                for al in (1.0, 1.5, 2.0, 3.0)]
    self.assertEqual(speedups, sorted(speedups))
    self.assertGreater(speedups[-1], 1.0)
    # More drafts read the drafter and the experts more: at the same acceptance, slower.
    self.assertLess(pm.speculative_decode_step(dep, 8, work, 3, 1.6)["speedup"],
                    pm.speculative_decode_step(dep, 8, work, 1, 1.6)["speedup"])
    with self.assertRaisesRegex(ValueError, "acceptance length"):
      pm.speculative_decode_step(dep, 1, work, 2, 3.5)
    with self.assertRaisesRegex(ValueError, "no MTP layer"):
      pm.speculative_decode_step(dep.replace(model=KIMI_K2_6), 1, work, 2, 1.5)

  @parameterized.parameters("overhead", "efficiency")
  def test_calibrate_recovers_a_known_factor(self, factor):
    dep = pm.Deployment("glm", GLM_5_2, FP8_ALL, "bfloat16", H200)
    work = pm.Workload(2048, 1024)
    truth = 3.7 if factor == "overhead" else 0.42
    data = {c: pm.decode_throughput(dep, c, work, **{factor: truth}) for c in (1, 8, 64)}
    self.assertAlmostEqual(pm.calibrate(dep, data, work, factor=factor), truth, places=4)

  def test_calibrate_errors(self):
    dep = pm.Deployment("glm", GLM_5_2, FP8_ALL, "bfloat16", H200)
    with self.assertRaisesRegex(ValueError, "no reported points"):
      pm.calibrate(dep, {64: None}, pm.Workload(1, 1))
    with self.assertRaisesRegex(ValueError, "factor must be one of"):
      pm.calibrate(dep, {1: 60}, pm.Workload(1, 1), factor="magic")

  def test_weight_split_adds_up(self):
    dep = pm.Deployment("glm", GLM_5_2, INT4_EXPERTS, "bfloat16", H200)
    w = pm.weight_split(dep)
    self.assertEqual(w["experts_per_gpu"] + w["dense_per_gpu"], w["per_gpu"])
    # INT4 experts still dominate, although MLA's down projections, the routers and GLM's
    # indexer are replicated on every GPU (8.96 GB of the 60.6 GB per GPU are not experts).
    self.assertGreater(w["experts_per_gpu"], 5 * w["dense_per_gpu"])

  def test_int4_prefill_slower_than_fp8(self):
    glm = pm.Deployment("glm", GLM_5_2, FP8_ALL, "bfloat16", H200)
    fp8 = pm.prefill_throughput(glm)["tok_s"]
    int4 = pm.prefill_throughput(glm.replace(recipe=INT4_EXPERTS))
    self.assertLess(int4["tok_s"], fp8)
    self.assertGreater(int4["t_dequant"], 0)


class MeasureTest(absltest.TestCase):

  def test_stats(self):
    s = stats([3.0, 1.0, 2.0])
    self.assertEqual((s["median"], s["min"], s["max"], s["n"]), (2.0, 1.0, 3.0, 3))
    self.assertIsNone(stats([])["median"])
    self.assertEqual(median_range(stats([1234.5, 1000.0, 2000.25]), 1),
                     "1,234.5 [1,000.0, 2,000.2]")
    self.assertEqual(median_range(stats([0.5, 0.25]), 0), "0 [0, 0]")
    self.assertEqual(median_range(stats([])), "-")

  def test_table_cells(self):
    self.assertEqual([cell(v) for v in (None, 0.012345, 1234.5, 12345, "x")],
                     ["-", "0.0123", "1,234", "12,345", "x"])
    self.assertEqual(markdown_table(["a", "b"], [[None, 2.0]]), "| a | b |\n|---|---|\n| - | 2 |\n")

  def test_separating_budget(self):
    cfg = dataclasses.replace(TINY_MLA, n_layers=1, first_k_dense=0)  # the smoke model
    plan = kvc.separating_budget(cfg, concurrency=8, prompt_tokens=8, new_tokens=24,
                                 page_size=8, warmup_steps=2)
    self.assertEqual(plan["pages_per_seq"], 4)
    self.assertEqual(plan["fits"]["float8_e4m3fn"], 8)
    self.assertLess(plan["fits"]["bfloat16"], 8)
    with self.assertRaisesRegex(ValueError, "end before"):
      kvc.separating_budget(cfg, concurrency=8, prompt_tokens=8, new_tokens=8, page_size=8,
                            warmup_steps=2)


def _names_and_suite(usage: str) -> tuple[list[str], list[str]]:
  """(every experiment, the default suite) from the command line's usage text."""
  names = re.findall(r"^  (\w+) ", usage.split("experiments:", 1)[1], re.M)
  suite = re.search(r"With no name, runs: (.*); then writes", usage)
  return names, suite.group(1).split(", ") if suite else []


class CliTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.help = cls._run("--help")

  @staticmethod
  def _run(*args):
    return subprocess.run([sys.executable, "-m", "experiments", *args], cwd=_REPO,
                          capture_output=True, text=True, timeout=120)

  def test_help_lists_every_experiment(self):
    self.assertEqual(self.help.returncode, 0, self.help.stderr)
    names, suite = _names_and_suite(self.help.stdout)
    self.assertContainsSubset({"capacity", "kv_dtype", "paper", "h200_compile", "accuracy",
                               "cpu_peer", "retrieval_learning"}, names)
    self.assertNotEmpty(suite)
    self.assertContainsSubset(suite, names)

  def test_every_experiment_module_is_registered(self):
    # A module with the experiment entry point run(out_dir, ...) that the CLI does not list
    # could never be run as documented; read the sources (importing them all is slow).
    names, _ = _names_and_suite(self.help.stdout)
    folder = os.path.join(_REPO, "experiments")
    for f in sorted(os.listdir(folder)):
      if f.endswith(".py") and not f.startswith("_"):
        with open(os.path.join(folder, f)) as src:
          if "\ndef run(out_dir" in src.read():
            self.assertIn(f[:-3], names)

  def test_unknown_name_is_an_error(self):
    r = self._run("no_such_experiment", "--out", temp_dir(self, "experiments_unknown_"))
    self.assertEqual(r.returncode, 2)
    self.assertIn("unknown experiment(s): no_such_experiment", r.stderr)
    self.assertIn("kv_dtype", r.stderr)  # the usage follows


if __name__ == "__main__":
  absltest.main()
