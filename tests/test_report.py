"""REPORT.md's opening table (mlkit.report.comparison) from hand-written, trimmed experiment records.

The records copy the structure the experiments write (smoke runs of paper, capacity,
kv_dtype, weight_quant, integrity, h200_compile, accuracy, disagg and engine_overhead),
cut to the fields the table reads, so these tests run in well under a second: no
experiment runs and nothing is compiled.
"""

import json
import os
import re

from absl.testing import absltest

from mlkit.report import comparison as report
from mlkit.report import figures

from tempdirs import temp_dir

_CPU = {"backend": "cpu", "cpu_count": 2, "device_kind": "cpu"}
_TINY = {"model": {"name": "tiny-mla"}}


def _stats(v):
  return {"median": v, "min": v, "max": v, "n": 1, "p95": v}


def _paper(kimi_bf16_tokens=683_008, int4_decode_gain=0.97):
  cols = []
  for col, role, rep, oom_at in (("kimi bf16 KV", "calibration", figures.REPORT_KIMI_BF16, 64),
                                 ("kimi fp8 KV", "prediction", {}, None),
                                 ("glm fp8 weights", "calibration", figures.REPORT_GLM_FP8, None),
                                 ("glm int4 weights", "prediction", {}, None)):
    for c in (1, 8, 16, 32, 64):
      oom = c == oom_at
      cols.append({"column": col, "role": role, "concurrency": c, "predicted_oom": oom,
                   "predicted_tok_s": None if oom else 100.0 * c,
                   "report_tok_s": rep.get(c) if rep else "n/a"})
  preds = [("Kimi tokens, bf16 KV", kimi_bf16_tokens), ("Kimi tokens, fp8 KV", 1_347_392),
           ("Kimi bf16-KV: most requests that fit / first swept concurrency out of memory",
            "41 / 64"), ("Kimi fp8-KV: most requests that fit", 82),
           ("GLM INT4 / fp8 decode tok/s at concurrency 1", int4_decode_gain),
           ("GLM prefill INT4 / fp8", 0.52)]
  # The compiled-program model's rows (mlkit.plan.step_time.predict): Kimi's bf16 column at
  # 1.2x the report, GLM fp8 at 0.1x, INT4 decode 0.9x fp8 at c=1, INT4 prefill 2x fp8.
  prog = [{"column": "kimi bf16 KV", "rows": c, "tok_s": 1.2 * v}
          for c, v in figures.REPORT_KIMI_BF16.items()]
  prog += [{"column": "glm fp8 weights", "rows": c, "tok_s": 0.1 * v}
           for c, v in figures.REPORT_GLM_FP8.items()]
  prog += [{"column": "glm int4 weights", "rows": 1, "tok_s": 0.9 * 0.1 * 60},
           {"column": "glm fp8 prefill", "rows": 4, "tok_s": 9000.0},
           {"column": "glm int4 prefill", "rows": 4, "tok_s": 18000.0}]
  return {"experiment": "paper", "columns": cols,
          "predictions": [{"what": w, "predicted": v} for w, v in preds],
          "compiled": {"launch_gap_s": 8e-7, "fitted": True, "rows": prog}}


def _records():
  glm = [{"model": "glm-5.2", "recipe": "fp8-all", "total_gib": 705.16, "per_gpu_gib": 88.15},
         {"model": "glm-5.2", "recipe": "int4-experts-g32", "total_gib": 421.18,
          "per_gpu_gib": 52.65}]
  h200_rows = [{"model": "kimi-k2.6", "recipe": "int4-experts-g32", "kv_dtype": d, "tokens": t,
                "largest_pool": 48e9, "weights_resident": 76.5e9,
                "at_concurrency": {"requests": 64, "peak": p, "fits_hbm": p <= 141e9}}
               for d, t, p in (("bfloat16", 683_008, 150.2e9),
                               ("float8_e4m3fn", 1_347_392, 113.9e9))]
  claim = lambda c, d, holds: {"claim": c, "task": "arithmetic", "delta_points": d,
                               "ci95_points": [d - 0.5, d + 0.5], "band_points": 1.0,
                               "holds": holds}
  return {
      "paper": _paper(),
      "capacity": {"machine": _CPU, "config": {"measured_model": {"name": "h200-mla"}},
                   "ratio": 1.987, "paper": [{"model": "kimi-k2.6", "dtype": "bfloat16",
                                              "bytes_per_token": 70_272}]},
      "kv_dtype": {"machine": _CPU, "config": {**_TINY, "shape": {"concurrency": [1, 2]}},
                   "oom_concurrency": {"bfloat16": [2], "float8_e4m3fn": []},
                   "report_shape_reproduced": True},
      "weight_quant": {"machine": _CPU, "config": _TINY, "paper_weight_memory": glm,
                       "decode": [{"concurrency": 2, "int4_over_fp8": 1.24}],
                       "prefill_int4_over_fp8": 1.04},
      "integrity": {"machine": _CPU, "config": _TINY, "timing": [
          {"concurrency": c, "throughput_ratio": _stats(t), "p95_latency_ratio": _stats(p)}
          for c, t, p in ((1, 0.999, 1.002), (2, 0.995, 1.008))]},
      "h200_compile": {"mode": "quick", "config": {"plan": {"hbm_bytes": 141e9}},
                       "rows": h200_rows},
      "accuracy": {"machine": _CPU, "config": {"model": "mini-mla"}, "claims": [
          claim("fp8 KV within ~1 point", 0.1, "yes"),
          claim("int4 weights within 0.8 points of fp8", 2.0, "no")]},
      "disagg": {"machine": _CPU, "config": {**_TINY, "disaggregated": {
          "prefill": "fp8-all weights, bf16 KV", "decode": "int4-experts-g32 weights, fp8 KV"}},
                 "transfer_metrics": {"transfers": 6, "transfer_failures": 0},
                 "pairs": [{"disaggregated": {"aborted": 0}}]},
      "engine_overhead": {"machine": _CPU, "config": {"name": "small-mla"},
                          "running_requests": 64, "integrity_check_step_time_ratio": 1.004},
  }


def _out_dir(owner, records) -> str:
  out = temp_dir(owner, "report_")
  for name, rec in records.items():
    with open(os.path.join(out, f"{name}.json"), "w") as f:
      json.dump(rec, f)
  return out


def _row(rows, figure, json_name=None):
  found = [r for r in rows if r.figure == figure
           and (json_name is None or r.from_.startswith(json_name + ".json"))]
  assert len(found) == 1, (figure, json_name, found)
  return found[0]


class ReportTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.rows = report.comparison(_out_dir(self, _records()))

  def test_every_figure_of_the_report_has_a_row(self):
    reports = {(r.report, r.figure) for r in self.rows}
    texts = " ".join(f"{r.figure} {r.report}" for r in self.rows)
    for figure in ("~686K tokens", "~1.37M tokens", "705 GB", "421 GB", "88 GB", "52 GB",
                   "70,272 B", "out of memory", "runs", "unchanged", "within 0.8 points",
                   "faster (no figure)", "slower (no figure)"):
      self.assertIn(figure, {r.report for r in self.rows})
    for c, v in figures.REPORT_KIMI_BF16.items():
      self.assertIn((f"{v} tok/s", f"Kimi decode tok/s, bf16 KV, concurrency {c}"), reports)
    for c, v in figures.REPORT_GLM_FP8.items():
      self.assertIn((f"{v} tok/s", f"GLM decode tok/s, fp8 weights, concurrency {c}"), reports)
    for words in ("throughput cost", "p95 latency cost", "decode pool fp8 KV", "fp8 / bf16"):
      self.assertIn(words, texts)
    # Kimi's token capacity: analytic and compiled; the INT4 claims: modelled and measured.
    self.assertEqual(sum(r.report == "~686K tokens" for r in self.rows), 2)
    self.assertEqual({r.source.split(" (")[0].split(",")[0] for r in self.rows
                      if r.figure.startswith("INT4 prefill")},
                     {"modelled", "measured", "compiled for 8x H200"})
    self.assertEqual({r.lever for r in self.rows}, {1, 2, 3, 4, "model"})
    for r in self.rows:
      self.assertRegex(r.from_, r"^\w+\.json: \S")

  def test_ratios_and_verdicts(self):
    r = _row(self.rows, "Kimi K2.6 KV tokens per H200, bf16 cache")
    self.assertEqual((r.ours, r.source, r.verdict),
                     ("683K tokens", "modelled (analytic)", "matches (within 10%)"))
    self.assertAlmostEqual(r.ratio, 683_008 / 686_000)
    records = _records()
    for tokens, verdict in ((690_000, "matches (within 10%)"), (800_000, "within 25%"),
                            (343_000, "off by -50%")):
      records["paper"] = _paper(kimi_bf16_tokens=tokens)
      row = _row(report.comparison(_out_dir(self, records)),
                 "Kimi K2.6 KV tokens per H200, bf16 cache")
      self.assertEqual(row.verdict, verdict)
      self.assertAlmostEqual(row.ratio, tokens / 686_000)
    self.assertEqual(_row(self.rows, "Kimi bf16 KV out of memory at concurrency 64").verdict,
                     "reproduced")
    self.assertEqual(_row(self.rows, "64 requests: bf16 KV out of memory, fp8 fits").verdict,
                     "reproduced")
    fast = "INT4 decode faster than fp8 at low concurrency"
    self.assertEqual(_row(self.rows, fast, "paper").verdict, "not reproduced")
    self.assertEqual(_row(self.rows, fast, "weight_quant").verdict, "reproduced")
    self.assertEqual(_row(self.rows, fast, "weight_quant").source,
                     "measured (2-core CPU, tiny-mla)")
    self.assertEqual(_row(self.rows, "INT4 prefill slower than fp8", "weight_quant").verdict,
                     "not reproduced")
    self.assertEqual(_row(self.rows, "accuracy unchanged with the fp8 KV cache").verdict,
                     "reproduced")
    self.assertEqual(_row(self.rows, "accuracy within 0.8 points with INT4 weights").verdict,
                     "not reproduced")
    self.assertEqual(_row(self.rows, "page-tag check: throughput cost").verdict, "reproduced")
    self.assertEqual(_row(self.rows, "page-tag check: throughput cost").ours,
                     "+0.5% throughput at c=2 (worst of c=1/2)")
    self.assertEqual(_row(self.rows, "page-tag check: p95 latency cost").verdict, "reproduced")
    # The compiled-program model: Kimi's column carries its fitted gap, GLM's is predicted.
    r = _row(self.rows, "Kimi decode tok/s, bf16 KV, concurrency 8 (compiled step)")
    self.assertEqual((r.ours, r.verdict), ("877 tok/s",
                                            "within 25% (one constant fitted on this column)"))
    self.assertTrue(r.source.startswith("compiled for 8x H200, step-time model"))
    r = _row(self.rows, "GLM decode tok/s, fp8 weights, concurrency 64 (compiled step)")
    self.assertEqual((r.verdict, r.source), ("off by -90%", "compiled for 8x H200, step-time model"))
    self.assertAlmostEqual(r.ratio, 0.1)
    self.assertEqual(_row(self.rows, fast + " (compiled steps)").verdict, "not reproduced")
    self.assertEqual(_row(self.rows, fast + " (compiled steps)").ours, "INT4/fp8 decode 0.90x at c=1")
    self.assertEqual(_row(self.rows, "INT4 prefill slower than fp8 (compiled steps)").verdict,
                     "not reproduced")
    # A smoke record compiled the tiny model only.
    records = _records()
    records["paper"]["compiled"]["rows"] = [{"column": "tiny", "rows": 16, "tok_s": 1.0}]
    r = _row(report.comparison(_out_dir(self, records)),
             "GLM decode tok/s, fp8 weights, concurrency 1 (compiled step)")
    self.assertEqual(r.ours, "not compiled")
    self.assertTrue(r.verdict.startswith("not run"), r.verdict)
    # GLM is compiled only in --full runs: a quick record lacks it.
    r = _row(self.rows, "GLM 5.2 weights per GPU at TP 8, fp8 (compiled)")
    self.assertEqual((r.ours, r.ratio), ("not compiled", None))
    self.assertTrue(r.verdict.startswith("not run: this quick run compiled kimi-k2.6"))

  def test_missing_record_is_not_run(self):
    records = _records()
    del records["integrity"], records["h200_compile"]
    rows = report.comparison(_out_dir(self, records))
    self.assertEqual(len(rows), len(self.rows))
    gone = [r for r in rows if r.from_.split(".json")[0] in ("integrity", "h200_compile")]
    self.assertLen(gone, 7)  # five compiled figures, two integrity costs
    for r in gone:
      self.assertEqual((r.ours, r.verdict, r.ratio), ("not run", "not run", None))
    empty = report.comparison(temp_dir(self, "report_empty_"))
    self.assertEqual(len(empty), len(self.rows))
    self.assertTrue(all(r.ours == "not run" and r.verdict == "not run" for r in empty))
    self.assertIsNone(report.plot(temp_dir(self, "report_empty_")))

  def test_markdown_has_the_header_and_one_line_per_row(self):
    md = report.markdown(self.rows)
    self.assertIn("**measured**", md)
    self.assertIn("**compiled for 8x H200**", md)
    self.assertIn("**modelled (analytic)**", md)
    self.assertIn("never compared", md)
    lines = [ln for ln in md.splitlines() if ln.startswith("|")]
    self.assertEqual(lines[0], "| lever | the report's figure | report | ours | source | "
                               "ours/report | verdict | from |")
    self.assertLen(lines, 2 + len(self.rows))
    for ln in lines[2:]:  # eight cells each: no stray '|' from a cell's text
      self.assertLen(re.split(r"(?<!\\)\|", ln), 10)

  def test_section_opens_with_the_table_and_the_plot(self):
    out = _out_dir(self, {"paper": _paper()})
    text = report.section(out)
    self.assertTrue(text.startswith(report.HEADER))
    self.assertIn(f"![report vs ours]({report.PLOT})", text)
    self.assertTrue(os.path.getsize(os.path.join(out, report.PLOT)) > 0)

  def test_fitted_columns_are_never_predictions(self):
    fitted = [r for r in self.rows if r.source == "fitted"]
    self.assertLen(fitted, len(figures.REPORT_KIMI_BF16) + len(figures.REPORT_GLM_FP8))
    for r in fitted:
      self.assertEqual(r.verdict, report.FITTED_VERDICT)
      self.assertIn("tok/s", r.figure)
      self.assertNotIn("predict", r.figure.lower())
    # Every calibration column the record names is reported as fitted, nothing else is.
    for r in self.rows:
      calibration = re.search(r"columns\[(kimi bf16 KV|glm fp8 weights), \d+\]\.predicted_tok_s",
                              r.from_)
      self.assertEqual(r.source == "fitted", bool(calibration), r)
      if r.source != "fitted":
        self.assertNotEqual(r.verdict, report.FITTED_VERDICT)


if __name__ == "__main__":
  absltest.main()
