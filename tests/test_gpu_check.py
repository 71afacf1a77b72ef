"""scripts/gpu_check.py, the one prepared device check, and the kernels experiment around it.

The script runs for real, as subprocesses in smoke mode (CPU, interpret mode, tiny
shapes), on its cheapest cases: the two ceilings and the tag check, with an injected
crash and an injected hang between them, and one case each of GLM 5's sparse MLA
decode (with the dense kernel as its peer) and indexer scoring. The plan (which of the
252 target cases run first) is checked as data. The kernels experiment runs through its
command lines, as subprocesses too: rendering a run's JSONL, and its smoke run.
"""

import importlib.util
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
from absl.testing import absltest

from pallas_kernels import benchmark as bm
from pallas_kernels import targets as kt
from pallas_kernels.indexer import bench as indexer_bench
from pallas_kernels.indexer import topk_bench
from pallas_kernels.paged_attention import bench as attn_bench

from tempdirs import temp_dir

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(_REPO, "scripts", "gpu_check.py")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CASE_TIMEOUT_S = 8.0  # well above a smoke tag-check case (~2 s), the injected hang's length


def _script():
  spec = importlib.util.spec_from_file_location("gpu_check_script", SCRIPT)
  mod = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = mod  # dataclasses look their module up by name
  spec.loader.exec_module(mod)
  return mod


def _env():
  env = dict(os.environ)
  env.setdefault("JAX_PLATFORMS", "cpu")
  return env


def _read(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def _cases(records):
  return [r for r in records if r["type"] == "case"]


class PlanTest(absltest.TestCase):
  """Which cases run first: every kernel x variant at its most important point."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.gc = _script()
    cls.plan = cls.gc.build_plan(smoke=False)

  def test_ceilings_then_every_target_case_once(self):
    self.assertEqual([p.name for p in self.plan[:3]],
                     ["ceiling/copy", "ceiling/matmul_bf16", "ceiling/matmul_fp8"])
    targets = [p.name for p in self.plan if p.group == "target"]
    self.assertLen(targets, 252)
    self.assertCountEqual(targets, [c.name for c in kt.target_cases()])
    self.assertEqual([p.order for p in self.plan], list(range(len(self.plan))))
    tiers = [p.tier for p in self.plan if p.group == "target"]
    self.assertEqual(tiers, sorted(tiers))

  def test_tier_one_covers_every_kernel_and_variant_at_its_main_point(self):
    tier1 = [p.name for p in self.plan if p.tier == 1]
    self.assertEqual(tier1, [
        "mla/tp8/bf16/b64/ctx32768", "mla/tp8/fp8/b64/ctx32768",
        "mla/dp/bf16/b64/ctx32768", "mla/dp/fp8/b64/ctx32768",
        "sparse_mla/tp8/bf16/b64/ctx32768", "sparse_mla/tp8/fp8/b64/ctx32768",
        "sparse_mla/dp/bf16/b64/ctx32768", "sparse_mla/dp/fp8/b64/ctx32768",
        "indexer/bf16/b64/ctx32768", "indexer/fp8/b64/ctx32768", "topk/b64/ctx32768",
        "int4g/kimi-k2.6/up/r8/g32", "int4g/kimi-k2.6/up/r8/g128",
        "int4g/glm-5.2/up/r8/g32", "int4g/glm-5.2/up/r8/g128",
        "fp8g/glm-5.2/up/r8",
        "tag/b64/pool21437",
        "int4/kimi-k2.6/ffn_up/m8/g32", "int4/kimi-k2.6/ffn_up/m8/g128",
        "gqa/g8/bf16/b64/ctx4096", "gqa/g8/fp8/b64/ctx4096"])
    tier2 = [p.name for p in self.plan if p.tier == 2]
    self.assertEqual(tier2[:2], ["mla/tp8/bf16/b64/ctx131072", "mla/tp8/fp8/b64/ctx131072"])
    self.assertIn("tag/b1/pool21437", tier2)

  def test_fp8_cases_follow_their_bf16_twins(self):
    names = [p.name for p in self.plan]
    fp8 = [i for i, n in enumerate(names) if "/fp8/" in n]
    self.assertLen(fp8, 46)  # 18 MLA + 10 GQA + 12 sparse MLA + 6 indexer
    for i in fp8:
      self.assertEqual(names[i - 1], names[i].replace("/fp8/", "/bf16/"))

  def test_peers_only_in_the_first_tiers(self):
    self.assertEqual({p.tier for p in self.plan if p.peers}, {1})
    two = self.gc.build_plan(smoke=False, peer_tiers=2)
    self.assertEqual({p.tier for p in two if p.peers}, {1, 2})

  def test_filters_smoke_dims_and_faults(self):
    plan = self.gc.build_plan(smoke=True, kernels={"tag_check"}, max_tier=1,
                              faults=("crash", "hang"))
    self.assertEqual([p.name for p in plan], ["tag/b64/pool21437", "fault/crash", "fault/hang"])
    self.assertEqual(plan[0].dims, dict(batch=7, max_pages=5, num_pages=40, page_size=4))

  def test_case_filter_keeps_tiers(self):
    plan = self.gc.build_plan(smoke=False, kernels={"paged_index_scores"},
                              cases=("indexer/fp8/b1/",))
    self.assertEqual([(p.name, p.tier) for p in plan],
                     [("indexer/fp8/b1/ctx32768", 5), ("indexer/fp8/b1/ctx131072", 6)])

  def test_smoke_dims_keep_each_kernel_valid(self):
    # Sparse: a real selection (topk < context) that the tables can hold; the dense peer's
    # Mosaic GPU kernel stays in play (page 64, C % 128). Indexer: heads padded, Di a power
    # of two. Pools hold every request's pages.
    plan = self.gc.build_plan(smoke=True, kernels={"paged_mla_sparse_decode",
                                                   "paged_index_scores"}, max_tier=3)
    self.assertLen(plan, 18)
    for p in plan:
      d = p.dims
      self.assertEqual(d["max_pages"] * d["page_size"], d["context"], p.name)
      self.assertEqual(d["num_pages"], d["batch"] * d["max_pages"] + 1, p.name)
      if p.kernel == "paged_mla_sparse_decode":
        self.assertLess(d["topk"], d["context"])
        self.assertEqual((d["page_size"], d["c"] % 128), (64, 0))
        self.assertEqual(d["heads"], 8 if "/tp8/" in p.name else 16)
      else:
        self.assertEqual((d["index_heads"], d["index_dim"]), (8, 64))
      self.assertEqual(d["batch"], 1 if "/b1/" in p.name else 2)

  def test_a_kernel_without_priority_is_refused(self):
    case = kt.KernelCase("new_kernel", "new/a", "both", (("batch", 1),))
    with self.assertRaisesRegex(ValueError, "no PRIORITY entry.*new_kernel"):
      self.gc.prioritise(kt.target_cases() + [case])


class ScriptRunsTest(absltest.TestCase):
  """Two real runs side by side (both mostly wait on an injected hang).

  The fault run: ceilings, an injected crash and hang, then two tag-check cases.
  The budget run: the ceilings with a hang that would outlast a 20 s budget (it ends
  before the fault run does). The sparse run: one sparse MLA decode case and one
  indexer case (it uses the CPU while the other two wait on their hangs).
  """

  BUDGET_S = 20.0

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.dir = temp_dir(cls, "gpu_check_")
    cls.out = os.path.join(cls.dir, "run.jsonl")
    cls.budget_out = os.path.join(cls.dir, "budget.jsonl")
    cls.sparse_out = os.path.join(cls.dir, "sparse.jsonl")
    runs = {
        "faults": ["--kernels", "ceiling,tag_check", "--max-tier", "2", "--inject-fault",
                   "crash,hang", "--case-timeout-s", str(CASE_TIMEOUT_S), "--out", cls.out],
        "budget": ["--kernels", "ceiling", "--inject-fault", "hang", "--case-timeout-s", "60",
                   "--budget-s", str(cls.BUDGET_S), "--out", cls.budget_out],
        "sparse": ["--kernels", "paged_mla_sparse_decode,paged_index_scores,topk_positions",
                   "--cases", "sparse_mla/dp/bf16/,indexer/fp8/,topk/b64/", "--out",
                   cls.sparse_out]}
    procs, logs, started, ended = {}, {}, {}, {}
    for name, args in runs.items():
      logs[name] = open(os.path.join(cls.dir, f"{name}.stdout"), "w+")
      started[name] = time.monotonic()
      procs[name] = subprocess.Popen([sys.executable, SCRIPT, "--smoke"] + args, cwd=_REPO,
                                     env=_env(), stdout=logs[name], stderr=subprocess.STDOUT)
    # The fault run's first case record must be on disk while that run is still going (the
    # hang after it keeps the run alive for CASE_TIMEOUT_S at least).
    cls.seen_while_running = None
    deadline = time.monotonic() + 240
    while len(ended) < len(procs) and time.monotonic() < deadline:
      for name, proc in procs.items():
        if name not in ended and proc.poll() is not None:
          ended[name] = time.monotonic()
      if cls.seen_while_running is None and os.path.exists(cls.out) and _cases(_read(cls.out)):
        cls.seen_while_running = procs["faults"].poll() is None
      time.sleep(0.05)
    for name, proc in procs.items():
      if proc.poll() is None:
        proc.kill()
      proc.wait()
      logs[name].seek(0)
    cls.stdout = {name: f.read() for name, f in logs.items()}
    cls.rc = {name: proc.returncode for name, proc in procs.items()}
    cls.wall = {name: ended.get(name, float("inf")) - started[name] for name in procs}
    cls.records = _read(cls.out)
    cls.by_name = {r["name"]: r for r in _cases(cls.records)}

  def test_records_are_written_while_the_run_goes_on(self):
    self.assertTrue(self.seen_while_running, self.stdout["faults"])

  def test_plan_order_with_ceilings_and_target_tiers_first(self):
    header = self.records[0]
    self.assertEqual(header["type"], "header")
    self.assertEqual(header["plan"], ["ceiling/copy", "fault/crash", "fault/hang",
                                      "ceiling/matmul_bf16", "ceiling/matmul_fp8",
                                      "tag/b64/pool21437", "tag/b1/pool21437"])
    self.assertEqual([r["name"] for r in _cases(self.records)], header["plan"])
    self.assertEqual([r["tier"] for r in _cases(self.records)], [0, -1, -1, 0, 0, 1, 2])

  def test_crash_is_recorded_with_stderr_and_the_run_continues(self):
    crash = self.by_name["fault/crash"]
    self.assertEqual(crash["status"], "crashed")
    self.assertNotEqual(crash["returncode"], 0)
    self.assertIn("injected crash", crash["stderr_tail"])
    self.assertNotEqual(crash["worker_pid"], self.by_name["fault/hang"]["worker_pid"])

  def test_hang_is_stopped_at_the_case_timeout_and_the_run_continues(self):
    hang = self.by_name["fault/hang"]
    self.assertEqual(hang["status"], "timeout")
    self.assertIn("injected hang", hang["stderr_tail"])
    self.assertGreaterEqual(hang["wall_s"], CASE_TIMEOUT_S)
    self.assertLess(hang["wall_s"], CASE_TIMEOUT_S + 5)
    after = self.by_name["ceiling/matmul_bf16"]
    self.assertEqual(after["status"], "ok")
    self.assertNotEqual(after["worker_pid"], hang["worker_pid"])
    workers = [r for r in self.records if r["type"] == "worker"]
    self.assertEqual([w["status"] for w in workers], ["ready"] * 3)
    self.assertTrue(all(w["startup_s"] > 0 and w["backend"] == "cpu" for w in workers))

  def test_tag_check_cases_correct_with_both_impls_timed(self):
    for name in ("tag/b64/pool21437", "tag/b1/pool21437"):
      rec = self.by_name[name]
      self.assertEqual(rec["status"], "ok", rec)
      self.assertEqual([p["impl"] for p in rec["impls"]], ["pallas", "xla"])
      for p in rec["impls"]:
        self.assertTrue(p["correct"])
        self.assertEqual(p["mismatches"], 0)
        self.assertEqual(p["timing"]["source"], "perf_counter")  # no CUPTI on a CPU
        self.assertGreater(p["timing"]["median_s"], 0)
      self.assertEqual(rec["flops"], 0)
    # b64 smoke: 6 full rows of 5 pages and one of 3 (half its 20 tokens), 12 B per page.
    self.assertEqual(self.by_name["tag/b64/pool21437"]["bytes"], (6 * 5 + 3) * 12 + 7 * 5)

  def test_sparse_attention_cases_correct_with_their_peers(self):
    records = _read(self.sparse_out)
    self.assertEqual(self.rc["sparse"], 0, self.stdout["sparse"])
    by = {r["name"]: r for r in _cases(records)}
    self.assertEqual(list(by), ["sparse_mla/dp/bf16/b64/ctx32768", "indexer/fp8/b64/ctx32768",
                                "topk/b64/ctx32768"])
    sparse, index, topk = by.values()
    for rec, impls in ((sparse, ["pallas", "xla", "pallas_dense"]), (index, ["pallas", "xla"]),
                       (topk, ["pallas", "xla"])):
      self.assertEqual(rec["status"], "ok", rec)
      self.assertEqual([p["impl"] for p in rec["impls"]], impls)
      for p in rec["impls"]:
        self.assertTrue(p["correct"], p)
        if rec is not topk:  # the top-k is checked for exact equality, not a norm
          self.assertLess(p["rel_err"], p["tol"])
        self.assertGreater(p["timing"]["median_s"], 0)
    self.assertEqual((topk["bytes"], topk["flops"]), topk_bench.job_cost(topk["dims"]))
    # The smoke dims' job, as the roofline sheet counts it; the dense peer is rated
    # against the dense job over the whole context.
    d = sparse["dims"]
    self.assertEqual((sparse["bytes"], sparse["flops"]),
                     attn_bench.job_cost("paged_mla_sparse_decode", d))
    dense = sparse["impls"][2]
    self.assertEqual((dense["bytes"], dense["flops"]), attn_bench.job_cost("paged_mla_decode", d))
    self.assertGreater(dense["bytes"], 2 * sparse["bytes"])
    self.assertIn("whole context", dense["note"])
    self.assertEqual(sparse["info"]["kernel_impl"], "triton")
    self.assertEqual((index["bytes"], index["flops"]), indexer_bench.job_cost(index["dims"]))
    self.assertEqual(index["dims"]["kv"], "fp8")

  def test_ceilings_measured(self):
    copy = self.by_name["ceiling/copy"]
    self.assertEqual(copy["bytes"], 8 * (1 << 16))
    self.assertAlmostEqual(copy["measured"]["copy_bytes_per_s"],
                           copy["bytes"] / copy["time_s"])
    mm = self.by_name["ceiling/matmul_bf16"]
    self.assertEqual(mm["flops"], 2 * 128**3)
    self.assertAlmostEqual(mm["measured"]["matmul_flops_per_s"], mm["flops"] / mm["time_s"])
    f8 = self.by_name["ceiling/matmul_fp8"]
    self.assertEqual((f8["status"], f8["flops"], f8["bytes"]),
                     ("ok", 2 * 128**3, 2 * 128 * 128 + 2 * 128 * 128))
    self.assertAlmostEqual(f8["measured"]["matmul_fp8_flops_per_s"], f8["flops"] / f8["time_s"])
    self.assertEqual(self.records[0]["ceilings_nominal"]["fp8_flops_per_s_modelled"],
                     2 * self.records[0]["ceilings_nominal"]["bf16_flops_per_s"])

  def test_summary_last_faults_not_failures(self):
    summary = self.records[-1]
    self.assertEqual(summary["type"], "summary")
    self.assertEqual(summary["counts"], {"ok": 5, "crashed": 1, "timeout": 1})
    self.assertEqual(summary["failed"], [])
    self.assertIsNone(summary["stopped"])
    self.assertEqual(self.rc["faults"], 0, self.stdout["faults"])

  def test_budget_stops_new_cases_and_bounds_the_run(self):
    # The hang alone would take 60 s; the run must end at its budget.
    self.assertLess(self.wall["budget"], self.BUDGET_S + 8, self.stdout["budget"])
    records = _read(self.budget_out)
    stop = [r for r in records if r["type"] == "budget"]
    self.assertLen(stop, 1)
    self.assertEqual(stop[0]["unstarted"][-2:], ["ceiling/matmul_bf16", "ceiling/matmul_fp8"])
    ran = [r["name"] for r in _cases(records)]
    self.assertEqual(ran, ["ceiling/copy", "fault/hang"])
    self.assertEqual(ran + stop[0]["unstarted"], records[0]["plan"])
    hang = _cases(records)[1]
    self.assertEqual(hang["status"], "timeout")
    self.assertTrue(hang["cut_by_budget"])
    self.assertLess(hang["timeout_s"], 60)
    self.assertEqual(records[-1]["stopped"], "budget")
    self.assertIn("budget", self.stdout["budget"])
    self.assertEqual(self.rc["budget"], 0)

  def test_kernels_experiment_renders_the_jsonl(self):
    # The experiment's own command line, as a fetched run is rendered (docs/gpu_check.md).
    out = os.path.join(self.dir, "report")
    r = subprocess.run([sys.executable, "-m", "experiments.kernels", "--from", self.out,
                        "--out", out], cwd=_REPO, env=_env(), capture_output=True, text=True,
                       timeout=300)
    self.assertEqual(r.returncode, 0, r.stderr[-3000:])
    with open(os.path.join(out, "kernels.json")) as f:
      rec = json.load(f)
    self.assertEqual(len(rec["cases"]), 7)
    self.assertTrue(rec["all_ok"])  # the faults are not kernel failures
    with open(os.path.join(out, "kernels.md")) as f:
      md = f.read()
    self.assertRegex(md, r"ceiling/matmul_bf16 \d+ TFLOP/s, ceiling/matmul_fp8 \d+ TFLOP/s")
    self.assertIn("| tag_check | tag/b64/pool21437 | ok | 1 |", md)
    self.assertIn("- `fault/hang`: timeout", md)
    self.assertIn("## H200 compile readings", md)
    with open(os.path.join(out, "kernels.png"), "rb") as f:
      self.assertEqual(f.read(8), PNG_MAGIC)


class BenchmarkTest(absltest.TestCase):
  """pallas_kernels.benchmark: each impl checked and timed; one failure never hides the rest."""

  def test_run_bench_checks_times_and_keeps_going(self):
    x = jnp.arange(1, 9, dtype=jnp.float32)  # [8], never zeros
    sets = lambda: [(x,)]  # noqa: E731
    ref = bm.once(lambda: x * 2)

    def no_reference():
      raise MemoryError("reference out of memory")

    double = jax.jit(lambda a: a * 2)
    bench = bm.Bench(nbytes=64, flops=8, tol=1e-2, impls=[
        bm.Impl("good", double, sets, ref),
        bm.Impl("wrong", jax.jit(lambda a: a * 2.1), sets, ref),  # 5% off
        bm.Impl("nan", jax.jit(lambda a: a * jnp.nan), sets, ref),
        bm.Impl("raises", lambda a: a[100, 100], sets, ref),
        bm.Impl("unchecked", double, sets, no_reference, nbytes=32)])
    parts = []
    bm.run_bench(bench, parts.append, smoke=True)
    good, wrong, nan, raises, unchecked = parts
    self.assertEqual([p["impl"] for p in parts], ["good", "wrong", "nan", "raises", "unchecked"])
    self.assertTrue(good["correct"])
    self.assertEqual(good["rel_err"], 0.0)
    self.assertEqual(good["timing"]["source"], "perf_counter")
    self.assertEqual(good["timing"]["iters"], 2)
    self.assertEqual(good["roofline_s"], max(64 / bm.H200_COPY_BW, 8 / bm.H200_BF16_FLOPS))
    self.assertAlmostEqual(good["roofline_fraction"],
                           good["roofline_s"] / good["timing"]["median_s"])
    self.assertAlmostEqual(wrong["rel_err"], 0.05, places=6)
    self.assertFalse(wrong["correct"])
    self.assertFalse(nan["finite"])
    self.assertFalse(nan["correct"])
    self.assertIn("IndexError", raises["error"])
    self.assertNotIn("timing", raises)
    self.assertIn("MemoryError", unchecked["check_error"])
    self.assertNotIn("correct", unchecked)
    self.assertEqual(unchecked["bytes"], 32)
    self.assertGreater(unchecked["timing"]["median_s"], 0)

  def test_rotation_only_on_a_gpu(self):
    self.assertEqual(bm.rotation_sets(1), 1)  # this machine's backend is the CPU
    self.assertEqual(bm.TOL, {"bf16": 1e-2, "f32": 1e-6, "fp8": 5e-2})


if __name__ == "__main__":
  absltest.main()
