"""The report's serving steps compiled at each concurrency of its sweeps, read into launches.

``mlkit.plan.step_time`` times a compiled step; this module compiles the steps it
needs (``mlkit.plan.step_compile``'s set-up: 8x H200, the report's weight recipes
and parallelism) at the dense prefix plus one MoE layer, a few seconds each:

* Kimi K2.6 (INT4 experts) decode at every concurrency, bf16 and fp8 KV, and with fp8 KV
  at its peak (the most requests its pool holds);
* GLM 5.2 decode at every concurrency with FP8 weights and with INT4 experts (bf16 KV);
* GLM 5.2 prefill of one 8192-token chunk (four 2048-token prompts), both recipes.

The smoke plan compiles the tiny 8-way model's decode step at 1 and 64 rows.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import time
from typing import Callable

from mlkit.plan import step_compile as sc
from mlkit.report import figures

Progress = Callable[[str], None]
# gpu_check's JSONL runs on an H200, committed with the repository (docs/gpu_check.md).
MEASUREMENTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "docs", "measurements")


def measured_efficiency(folder: str = MEASUREMENTS):
  """``step_time.Efficiency`` with the shares gpu_check measured (every JSONL in
  ``folder``), or None when there is none."""
  from mlkit.plan import step_time as st
  from pallas_kernels.gpu_check_records import read_cases
  paths = sorted(glob.glob(os.path.join(folder, "gpu_check_*.jsonl")))
  return st.Efficiency.from_gpu_check(read_cases(paths)) if paths else None


@dataclasses.dataclass(frozen=True)
class Job:
  """One compiled step: a variant, its KV dtype, the step kind and its rows."""

  variant: sc.Variant
  kv_dtype: str
  kind: str
  rows: int

  @property
  def key(self) -> str:
    return f"{self.variant.key} | {self.kv_dtype} | {self.kind} | {self.rows}"


def jobs_for(smoke: bool, kimi_fp8_peak: int | None = None) -> list[Job]:
  """The steps the paper's compiled-program model reads; ``kimi_fp8_peak`` adds Kimi's
  fp8-KV decode step at that concurrency (the most requests its pool holds)."""
  if smoke:
    tiny = sc.Variant("tiny int4 experts", sc.TINY, sc.INT4_EXPERTS, sc.TINY_WORK)
    return [Job(tiny, "bfloat16", "decode", c) for c in (1, 64)]
  jobs = [Job(sc.KIMI, kv, "decode", c) for kv in sc.KV_DTYPES for c in figures.CONCURRENCY]
  if kimi_fp8_peak and kimi_fp8_peak not in figures.CONCURRENCY:
    jobs.append(Job(sc.KIMI, "float8_e4m3fn", "decode", kimi_fp8_peak))
  for v in (sc.GLM_FP8, sc.GLM_INT4):
    jobs += [Job(v, "bfloat16", "decode", c) for c in figures.CONCURRENCY]
    jobs.append(Job(v, "bfloat16", "prefill", 0))
  return jobs


def prefill_rows(job: Job) -> tuple[int, int]:
  """(rows, tokens per row) of a prefill job's chunk (``step_compile.step_shape``)."""
  plan = sc.plan_for(quick=False, smoke=False)
  rows, tokens, _ = sc.step_shape("prefill", job.variant.work, plan)
  return rows, tokens


def compile_job(job: Job, mesh) -> str:
  """The compiled per-device program (HLO text) of one job, at one MoE layer."""
  plan = sc.plan_for(quick=False, smoke=job.variant.model is sc.TINY)
  if job.kind == "decode":
    plan = dataclasses.replace(plan, concurrency=job.rows)
    pages = job.rows * sc.pages_per_request(job.variant.work)
  else:
    pages = 4096  # the prefill step's program does not depend on the pool's size
  lowered, _ = sc.lower(job.variant, job.kv_dtype, job.kind, 1, pages, plan, mesh)
  return sc.compile_cached(lowered)[0].as_text()


def compile_all(jobs: list[Job], progress: Progress | None = None) -> dict[str, str]:
  """{job key: compiled HLO text} for every job, in turn, with a line per compile."""
  say = progress or (lambda msg: None)
  mesh = sc.h200_mesh()
  out = {}
  for n, job in enumerate(jobs, 1):
    t0 = time.perf_counter()
    out[job.key] = compile_job(job, mesh)
    say(f"paper: compiled {n}/{len(jobs)} {job.key} in {time.perf_counter() - t0:.0f} s")
  return out


# Which report column each job's prediction sits in, and the report's figures where it has them.
_COLUMNS = {("kimi-k2.6 int4 experts", "bfloat16", "decode"): "kimi bf16 KV",
            ("kimi-k2.6 int4 experts", "float8_e4m3fn", "decode"): "kimi fp8 KV",
            ("glm-5.2 fp8", "bfloat16", "decode"): "glm fp8 weights",
            ("glm-5.2 int4 experts", "bfloat16", "decode"): "glm int4 weights",
            ("glm-5.2 fp8", "bfloat16", "prefill"): "glm fp8 prefill",
            ("glm-5.2 int4 experts", "bfloat16", "prefill"): "glm int4 prefill"}
_REPORTED = {"kimi bf16 KV": figures.REPORT_KIMI_BF16, "glm fp8 weights": figures.REPORT_GLM_FP8}
# The one column the launch gap is fitted on.
CALIBRATION_COLUMN = "kimi bf16 KV"


def predict_jobs(jobs: list[Job], texts: dict[str, str], eff=None) -> dict:
  """The compiled-program model's prediction for every job (``mlkit.plan.step_time``).

  Args:
    jobs: the compiled jobs (:func:`jobs_for`).
    texts: {job key: compiled HLO text} (:func:`compile_all`).
    eff: the ``step_time.Efficiency`` (default: the published anchors).

  Returns:
    ``step_time.predict``'s record (JSON-ready), each row with its "kind" and its
    report column ("tiny" in the smoke plan, which fits nothing).
  """
  from mlkit.plan import step_time as st
  from pallas_kernels.h200.program import launches
  entries = []
  for job in jobs:
    v = job.variant
    column = _COLUMNS.get((v.key, job.kv_dtype, job.kind), "tiny")
    if job.kind == "decode":
      data, kw = st.job_data(v.model, "decode", job.rows, 1, v.work.mean_context)
    else:
      rows, tokens = prefill_rows(job)
      data, kw = st.job_data(v.model, "prefill", rows, tokens, 0.0)
    report = _REPORTED.get(column, {}).get(job.rows) if job.kind == "decode" else None
    entries.append({"key": job.key, "program": launches(texts[job.key]), "data": data, "kw": kw,
                    "column": column, "report": report,
                    "calibrate": column == CALIBRATION_COLUMN and report is not None})
  calibrate_on = _REPORTED[CALIBRATION_COLUMN] if any(e["calibrate"] for e in entries) else None
  eff = eff or st.Efficiency()
  out = st.predict(entries, calibrate_on, eff)
  out["measured"] = list(eff.measured)
  for row, job in zip(out["rows"], jobs):
    row["kind"] = job.kind
  return out


def _ms(s: float) -> str:
  return f"{1e3 * s:.3f}"


def markdown(pred: dict, title: str = "Compiled-program model (`mlkit.plan.step_time`)") -> str:
  """The compiled-program section of paper.md: predictions beside the report, where each
  step's time goes (GLM's INT4 effects among them), and the launches per MoE layer."""
  rows = pred["rows"]
  shares = ("published kernel efficiencies" if not pred["measured"] else
            "the efficiencies gpu_check measured on an H200 for " + ", ".join(pred["measured"])
            + " (docs/measurements), published anchors for the rest")
  md = [f"\n## {title}\n\n",
        "Each step compiled for one H200 of eight (dense prefix + one MoE layer, repeated to "
        f"full depth); every launch timed at {shares} "
        "(docs/step_time.md); one constant, the launch gap: "
        + (f"fitted on the `{CALIBRATION_COLUMN}` column, {1e6 * pred['launch_gap_s']:.2f} us"
           if pred["fitted"] else f"not fitted (no report column), {1e6 * pred['launch_gap_s']:.2f} us")
        + ".\n\n",
        "| column | kind | rows | tokens | step ms | tok/s | report | ratio | within 25% | "
        "launches / step | launches / MoE layer |\n|---|---|---|---|---|---|---|---|---|---|---|\n"]
  for r in rows:
    ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
    within = "-" if r["within_25"] is None else ("yes" if r["within_25"] else "**no**")
    md.append(f"| {r['column']} | {r['kind']} | {r['rows']} | {r['tokens']:,} | "
              f"{r['step_ms']:.2f} | {r['tok_s']:,.0f} | {r['report'] or '-'} | {ratio} | "
              f"{within} | {r['launches']:,} | {r['layer_launches']} |\n")
  md.append("\n### Where a step's time goes (ms per step, by kernel kind)\n\n")
  md.append("| step | kind | ms | launches | GB | TFLOP |\n|---|---|---|---|---|---|\n")
  for r in rows:
    if r["rows"] not in (1, 64) and r["kind"] == "decode":
      continue
    for kind, v in sorted(r["by_kind"].items(), key=lambda kv: -kv[1]["seconds"]):
      md.append(f"| {r['column']} {r['kind']} x{r['rows']} | {kind} | {_ms(v['seconds'])} | "
                f"{v['launches']:,} | {v['bytes'] / 1e9:.3f} | {v['flops'] / 1e12:.3f} |\n")
  return "".join(md)
