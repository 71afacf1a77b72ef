"""paper: the analytic model (``mlkit.perfmodel``) of the report's two deployments on 8x H200.

* **Kimi K2.6**, INT4_EXPERTS weights (how it ships), TP 8. Its one factor is
  fitted on the report's bf16-KV decode column (137/731/1106/1558 tok/s at
  concurrency 1/8/16/32); then predicted: the fp8-KV column and its peak, and
  the concurrency at which bf16 runs out of memory.
* **GLM 5.2**, FP8_ALL weights (how it ships), bf16 KV, TP 8. Its one factor is
  fitted on the report's fp8-weights decode column (60/425/683/994/1672 at
  1/8/16/32/64); then predicted: the INT4 decode gain at concurrency 1, prefill
  throughput fp8 vs INT4, and the token capacity with an fp8 KV cache and INT4
  weights.

Beside it, the compiled-program model (``mlkit.plan.step_time``): the same columns
predicted from the steps compiled for 8x H200 (``mlkit.plan.step_programs``: 23
compiles, a few minutes), with only a launch gap fitted, on Kimi's bf16 column.

Capacity is arithmetic (``mlkit.report.deployments``): weights per GPU, the KV
budget from one memory-fraction assumption (derived from Kimi's 48 GB), bytes per
token from ``mlkit.kvcache``. Every assumption is written into the JSON and the
markdown; every prediction sits next to the report's figure where there is one.
"""

from __future__ import annotations

import dataclasses
import os

from configs import H200
from experiments import common
from mlkit import perfmodel as pm
from mlkit.plan import step_programs
from mlkit.quant import INT4_EXPERTS
from mlkit.report import deployments, figures
from mlkit.report.curves import decode_curves
from mlkit.report.deployments import GLM, GLM_WORK, KIMI, KIMI_WORK
from mlkit.report.figures import (CONCURRENCY, REPORT_GLM_FP8, REPORT_GLM_PER_GPU_GIB,
                                  REPORT_KIMI_TOKENS)

# The report's bf16-KV column, None where it ran out of memory.
REPORT_KIMI_BF16 = {**figures.REPORT_KIMI_BF16, figures.REPORT_KIMI_BF16_OOM: None}
FACTOR = "overhead"
SHAPE_NOTES = [
    f"Kimi sweep request shape: {KIMI_WORK.prompt_tokens} in + {KIMI_WORK.output_tokens} out "
    "(not in the report; bf16 running 32 but not 64 requests bounds it to 10.7K-21.4K tokens).",
    f"GLM sweep request shape: {GLM_WORK.prompt_tokens} in + {GLM_WORK.output_tokens} out (not in "
    "the report; 64 requests fitting a bf16 cache beside fp8 weights bounds it to ~3.9K tokens).",
    "GLM's lever-2 sweep used a bf16 KV cache (the levers are measured one at a time).",
    "Decode reads each request's mean context over its generation (prompt + output / 2); GLM's "
    "sparse attention reads the latent of its top 2048 tokens plus every indexer key.",
    "Both deployments: 8x H200 (141 GB, measured 4.3 TB/s copy and 790 TFLOP/s bf16, docs/measuring.md), "
    "tensor parallel 8; MLA's latent cache is replicated on every GPU, so per-GPU capacity is "
    "the deployment's capacity.",
    f"One calibrated factor per deployment: '{FACTOR}' (the fixed per-layer latency as a multiple "
    "of the assumed one); the alternative, one efficiency multiplying the whole modelled rate, is "
    "fitted too and shown for comparison.",
]


def _ratio(pred, rep):
  return None if (pred is None or not rep) else pred / rep


def run(out_dir: str, *, quick: bool = True, smoke: bool = False) -> dict:
  """Calibrates, predicts and writes paper.{json,md,png}: arithmetic, then the compiles.

  Args:
    out_dir: output folder.
    quick: accepted for a uniform interface.
    smoke: the compiled-program model reads the tiny 8-way model's decode step only.

  Returns:
    The JSON record (``capacity``, ``calibration``, ``columns``, ``predictions``, and the
    compiled-program model's ``compiled`` and, with gpu_check runs committed,
    ``compiled_measured``).
  """
  del quick
  a = pm.Assumptions()
  frac = pm.static_memory_fraction(KIMI, a)
  common.progress(f"paper: static memory fraction {frac:.4f} (from Kimi's 48 GB of KV)")
  # --- capacity
  deps = deployments.LEVERS
  capacity = deployments.capacity(deps, frac)
  capacity["kimi bf16 KV"]["report_tokens"] = REPORT_KIMI_TOKENS["bfloat16"]
  capacity["kimi fp8 KV"]["report_tokens"] = REPORT_KIMI_TOKENS["float8_e4m3fn"]
  gib = {"fp8": REPORT_GLM_PER_GPU_GIB[GLM.recipe.name],
         "int4": REPORT_GLM_PER_GPU_GIB[INT4_EXPERTS.name]}
  capacity["glm fp8 weights, bf16 KV"]["report_weights_per_gpu_gib"] = gib["fp8"]
  capacity["glm int4 weights, fp8 KV"]["report_weights_per_gpu_gib"] = gib["int4"]
  # --- calibration: one factor per deployment
  calib = {}
  for key, dep, rep, work in (("kimi", KIMI, REPORT_KIMI_BF16, KIMI_WORK),
                              ("glm", GLM, REPORT_GLM_FP8, GLM_WORK)):
    fits = deployments.fit_factors(dep, rep, work, a)
    calib[key] = {"factor": FACTOR, "value": fits[FACTOR]["value"], "fits": fits,
                  "assumed_fixed_s": pm.decode_step(dep, 1, work, a)["t_fixed"]}
    common.progress(f"paper: {key}: {FACTOR} factor {fits[FACTOR]['value']:.3f} (max error "
                    f"{100 * fits[FACTOR]['max_abs_error']:.1f}%); an efficiency-only fit errs "
                    f"up to {100 * fits['efficiency']['max_abs_error']:.1f}%")
  kf, gf = calib["kimi"]["value"], calib["glm"]["value"]
  # --- decode columns
  kimi_fp8 = deps["kimi fp8 KV"]
  glm_int4 = GLM.replace(name="glm-5.2 int4 weights, bf16 KV", recipe=INT4_EXPERTS)
  cmax = {k: capacity[k]["max_concurrency"] for k in ("kimi bf16 KV", "kimi fp8 KV")}
  columns = []
  for label, dep, work, f, rep, role, limit in (
      ("kimi bf16 KV", KIMI, KIMI_WORK, kf, REPORT_KIMI_BF16, "calibration", cmax["kimi bf16 KV"]),
      ("kimi fp8 KV", kimi_fp8, KIMI_WORK, kf, {}, "prediction", cmax["kimi fp8 KV"]),
      ("glm fp8 weights", GLM, GLM_WORK, gf, REPORT_GLM_FP8, "calibration",
       capacity["glm fp8 weights, bf16 KV"]["max_concurrency"]),
      ("glm int4 weights", glm_int4, GLM_WORK, gf, {}, "prediction", None)):
    for c in CONCURRENCY:
      oom = limit is not None and c > limit
      pred = None if oom else pm.decode_throughput(dep, c, work, **{FACTOR: f}, a=a)
      r = rep.get(c, "n/a") if rep else "n/a"
      columns.append({"column": label, "role": role, "concurrency": c, "predicted_oom": oom,
                      "predicted_tok_s": pred, "report_tok_s": r,
                      "ratio": _ratio(pred, r if isinstance(r, (int, float)) else None)})
  # --- predictions
  peak_c = cmax["kimi fp8 KV"]
  kimi_fp8_peak = pm.decode_throughput(kimi_fp8, peak_c, KIMI_WORK, **{FACTOR: kf}, a=a)
  bf16_oom_at = min((c for c in CONCURRENCY if c > cmax["kimi bf16 KV"]), default=None)
  int4_gain = (pm.decode_throughput(glm_int4, 1, GLM_WORK, **{FACTOR: gf}, a=a)
               / pm.decode_throughput(GLM, 1, GLM_WORK, **{FACTOR: gf}, a=a))
  pf_fp8 = pm.prefill_throughput(GLM, a)
  pf_int4 = pm.prefill_throughput(glm_int4, a)
  glm_cap = capacity["glm int4 weights, fp8 KV"]["tokens"]
  predictions = [
      {"what": "Kimi fp8-KV decode tok/s at concurrency 64", "predicted": next(
          r["predicted_tok_s"] for r in columns if r["column"] == "kimi fp8 KV"
          and r["concurrency"] == 64), "report": "runs (no figure)", "ratio": None},
      {"what": f"Kimi fp8-KV peak: tok/s at its largest concurrency ({peak_c})",
       "predicted": kimi_fp8_peak, "report": None, "ratio": None},
      {"what": "Kimi bf16-KV: most requests that fit / first swept concurrency out of memory",
       "predicted": f"{cmax['kimi bf16 KV']} / {bf16_oom_at}", "report": "32 ran / 64 OOM",
       "ratio": (bf16_oom_at / 64) if bf16_oom_at else None},
      {"what": "Kimi fp8-KV: most requests that fit", "predicted": cmax["kimi fp8 KV"],
       "report": ">= 64", "ratio": None},
      {"what": "GLM INT4 / fp8 decode tok/s at concurrency 1", "predicted": int4_gain,
       "report": "> 1 (faster; no figure)", "ratio": None},
      {"what": "GLM prefill tok/s, fp8 weights", "predicted": pf_fp8["tok_s"], "report": None,
       "ratio": None},
      {"what": "GLM prefill tok/s, INT4 weights", "predicted": pf_int4["tok_s"], "report": None,
       "ratio": None},
      {"what": "GLM prefill INT4 / fp8", "predicted": pf_int4["tok_s"] / pf_fp8["tok_s"],
       "report": "< 1 (slower; no figure)", "ratio": None},
      {"what": "GLM tokens, fp8 KV + INT4 weights", "predicted": glm_cap, "report": None,
       "ratio": None},
      {"what": "GLM weights per GPU, fp8 (GiB)",
       "predicted": capacity["glm fp8 weights, bf16 KV"]["weights_per_gpu_gib"],
       "report": gib["fp8"],
       "ratio": capacity["glm fp8 weights, bf16 KV"]["weights_per_gpu_gib"] / gib["fp8"]},
      {"what": "GLM weights per GPU, INT4 experts (GiB)",
       "predicted": capacity["glm int4 weights, fp8 KV"]["weights_per_gpu_gib"],
       "report": gib["int4"],
       "ratio": capacity["glm int4 weights, fp8 KV"]["weights_per_gpu_gib"] / gib["int4"]},
      {"what": "Kimi tokens, bf16 KV", "predicted": capacity["kimi bf16 KV"]["tokens"],
       "report": REPORT_KIMI_TOKENS["bfloat16"],
       "ratio": capacity["kimi bf16 KV"]["tokens"] / REPORT_KIMI_TOKENS["bfloat16"]},
      {"what": "Kimi tokens, fp8 KV", "predicted": capacity["kimi fp8 KV"]["tokens"],
       "report": REPORT_KIMI_TOKENS["float8_e4m3fn"],
       "ratio": capacity["kimi fp8 KV"]["tokens"] / REPORT_KIMI_TOKENS["float8_e4m3fn"]},
  ]
  record = common.record_header("paper", quick=True, smoke=smoke, config={
      "hardware": dataclasses.asdict(H200), "tp": 8,
      "deployments": {k: {"model": d.model.name, "recipe": d.recipe.name, "kv_dtype": d.kv_dtype}
                      for k, d in deps.items()},
      "workloads": {"kimi": dataclasses.asdict(KIMI_WORK), "glm": dataclasses.asdict(GLM_WORK)}})
  record.update(assumptions=pm.describe(a), derived={"static_memory_fraction": frac},
                shape_assumptions=SHAPE_NOTES, capacity=capacity, calibration=calib,
                columns=columns, predictions=predictions,
                prefill={"glm fp8": pf_fp8, "glm int4": pf_int4})
  jobs = step_programs.jobs_for(smoke, kimi_fp8_peak=peak_c)
  texts = step_programs.compile_all(jobs, common.progress)
  record["compiled"] = step_programs.predict_jobs(jobs, texts)
  measured = step_programs.measured_efficiency()
  record["compiled_measured"] = measured and step_programs.predict_jobs(jobs, texts, measured)
  common.write_json(out_dir, "paper", record)
  decode_curves(os.path.join(out_dir, "paper.png"), columns, record["compiled"]["rows"])
  common.write_markdown(out_dir, "paper", _markdown(record) + "".join(
      step_programs.markdown(record[k], t) for k, t in (
          ("compiled", "Compiled-program model (`mlkit.plan.step_time`), published anchors"),
          ("compiled_measured", "The same with this project's kernels as measured on an H200"))
      if record[k]))
  for p in predictions:
    v = p["predicted"]
    common.progress(f"paper: {p['what']}: {v:,.3g}" if isinstance(v, float) else
                    f"paper: {p['what']}: {v}")
  return record


def _fmt(v):
  if v is None:
    return "-"
  if isinstance(v, float):
    return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.0f}"
  return f"{v:,}" if isinstance(v, int) else str(v)


def _markdown(rec: dict) -> str:
  cal = rec["calibration"]
  md = ["# paper: the report's deployments on 8x H200, modelled\n\n",
        "Analytic model (`mlkit.perfmodel`): decode step = fixed per-layer latency + max(bytes "
        "moved / 4.3 TB/s, FLOPs / 790 TFLOP/s); bytes = dense weights + the routed experts the "
        "batch touches + each request's KV context. One factor per deployment is fitted on the "
        "report's column; everything else is predicted.\n\n",
        "## Calibration\n\n",
        common.markdown_table(
            ["deployment", "fitted factor", "value", "max error on its column",
             "efficiency-only fit: value", "its max error"],
            [[k, v["factor"], f"{v['value']:.3f}", f"{100 * v['fits'][v['factor']]['max_abs_error']:.1f}%",
              f"{v['fits']['efficiency']['value']:.3f}",
              f"{100 * v['fits']['efficiency']['max_abs_error']:.1f}%"] for k, v in cal.items()]),
        f"\nAssumed fixed latency per step: Kimi {1e3 * cal['kimi']['assumed_fixed_s']:.2f} ms, "
        f"GLM {1e3 * cal['glm']['assumed_fixed_s']:.2f} ms (x the fitted factor).\n",
        "\n## Decode tok/s (8 GPUs), predicted vs reported\n\n",
        common.markdown_table(
            ["column", "role", "concurrency", "predicted", "report", "predicted / report"],
            [[r["column"], r["role"], r["concurrency"],
              "OOM" if r["predicted_oom"] else _fmt(r["predicted_tok_s"]),
              "OOM" if r["report_tok_s"] is None else _fmt(r["report_tok_s"]),
              _fmt(r["ratio"])] for r in rec["columns"]]),
        "\n## Predictions\n\n",
        common.markdown_table(["prediction", "model", "report", "model / report"],
                              [[p["what"], _fmt(p["predicted"]), _fmt(p["report"]),
                                _fmt(p["ratio"])] for p in rec["predictions"]]),
        "\n## Capacity (per GPU = per deployment)\n\n",
        common.markdown_table(
            ["deployment", "weights GiB/GPU", "report GiB/GPU", "KV budget GB", "B/token",
             "tokens", "report tokens", "requests of the sweep's shape that fit"],
            [[k, _fmt(v["weights_per_gpu_gib"]), _fmt(v.get("report_weights_per_gpu_gib")),
              _fmt(v["kv_budget_gb"]), v["bytes_per_token"], v["tokens"],
              _fmt(v.get("report_tokens")), v["max_concurrency"]]
             for k, v in rec["capacity"].items()]),
        "\n## Assumptions\n\n",
        f"- static memory fraction (derived): {rec['derived']['static_memory_fraction']:.4f} of "
        "141 GB holds weights + KV on every deployment.\n"]
  md += [f"- {s}\n" for s in rec["shape_assumptions"]]
  md += [f"- `{x['name']}` = {x['value']}: {x['note']}\n" for x in rec["assumptions"]]
  md.append("\n![paper](paper.png)\n")
  return "".join(md)
