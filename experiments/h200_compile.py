"""h200_compile: the report's serving steps compiled for 8x H200, memory per device from XLA.

Runs ``mlkit.plan``: the engine's real decode step and a prefill chunk for Kimi K2.6
(quick; --full adds GLM 5.2 with fp8 and INT4-expert weights), bf16 and fp8 KV,
compiled for an 8x H200 topology from this CPU host at a few depths
(``mlkit.plan.step_compile``); every per-device figure fitted over depth and read at
full depth, the largest KV pool that fits beside the step's temporaries, and the
sweep's top concurrency checked against HBM (``mlkit.plan.step_memory``). Writes
them beside the analytic model and the report's figures as JSON, markdown and a PNG.
See docs/serving_step_memory.md for what the temporaries are made of.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

from configs import GLM_5_2, KIMI_K2_6
from experiments import common
from mlkit.parallel import AXES
from mlkit.plan import step_compile as sc
from mlkit.plan import step_memory as sm
from mlkit.report.figures import REPORT_GLM_PER_GPU_GIB, REPORT_KIMI_TOKENS
from pallas_kernels.h200.step_placement import kernel_rows

_UNIT = {"GB": 1e9, "MB": 1e6}


def run(out_dir: str, *, quick: bool = True, smoke: bool = False) -> dict:
  """Compiles the serving steps for 8x H200 and writes h200_compile.{json,md,png}.

  Args:
    out_dir: output folder.
    quick: Kimi K2.6 only, two depths (a few minutes on 2 cores); False adds GLM 5.2
      with fp8 and INT4-expert weights and a third depth.
    smoke: a tiny model, one decode compile, a toy device memory (for tests).

  Returns:
    The JSON record: ``compiles`` (one per step and depth), ``fits`` (per series),
    ``rows`` (one per model x weights x KV dtype), ``plan``.

  Raises:
    pallas_kernels.h200.compile.H200CompileUnavailable: without the CUDA compiler packages.
  """
  plan = sc.plan_for(quick, smoke)
  mesh = sc.h200_mesh()
  t_start = time.perf_counter()
  weights, jobs = sc.plan_jobs(plan, mesh, progress=common.progress)
  compiles = sc.compile_all(jobs, plan, mesh, progress=common.progress)
  fits, rows = sm.summarize(plan, compiles, weights)
  record = common.record_header("h200_compile", quick=quick, smoke=smoke, config={
      "plan": plan.summary(), "mesh": dict(zip(AXES, sc.MESH_SHAPE)),
      "rules": dataclasses.asdict(sc.RULES), "page_size": sc.PAGE_SIZE,
      "compile_options": sc.COMPILE_OPTIONS,
      "topology": "8x NVIDIA H200 (pallas_kernels/h200/target_config.txtpb), deviceless"})
  record["kernel_backend"] = plan.backend
  record.update(compiles=compiles, fits=fits, rows=rows, notes=sm.notes(plan),
                seconds=time.perf_counter() - t_start)
  common.write_json(out_dir, "h200_compile", record)
  _plot(os.path.join(out_dir, "h200_compile.png"), record)
  common.write_markdown(out_dir, "h200_compile", markdown(record))
  unit = sm.unit_for(plan.hbm_bytes)
  for r in rows:
    c = r.get("at_concurrency")
    temps = "/".join(_fmt(t, unit) for t in r["temp"].values())
    common.progress(
        f"h200_compile: {r['variant']} {r['kv_dtype']}: weights "
        f"{_fmt(r['weights_resident'], unit)} {unit}/GPU, temps {'/'.join(r['temp'])} {temps} "
        f"{unit}, kernels {'/'.join(r['launches'])} "
        f"{'/'.join(f'{n:,}' for n in r['launches'].values())}, "
        f"pool {_fmt(r['largest_pool'], unit)} {unit} = {r['tokens']:,} tokens, "
        f"{r['concurrency']} requests" + (
            f"; {c['requests']} requests need {_fmt(c['peak'], unit)} {unit}: "
            f"{'fits' if c['fits_hbm'] else 'DOES NOT FIT'}" if c else ""))
  return record


def _fmt(x, unit: str) -> str:
  return "-" if x is None else f"{x / _UNIT[unit]:,.2f}"


def markdown(rec: dict) -> str:
  """The experiment's markdown: deployments table, compiled points, fits, notes."""
  plan = rec["config"]["plan"]
  unit = sm.unit_for(plan["hbm_bytes"])

  def b(x):
    return _fmt(x, unit)

  md = ["# h200_compile: the serving steps compiled for 8x H200\n\n",
        f"Mode: {rec['mode']}; kernel backend `{rec['kernel_backend']}`; "
        f"{len(rec['compiles'])} compiles in {rec['seconds']:.0f} s on "
        f"{rec['machine']['cpu_count']} CPU cores. Memory per device in {unit} "
        f"({_UNIT[unit]:.0e} B), from XLA's `memory_analysis()` read at full depth; device "
        f"memory {b(plan['hbm_bytes'])} {unit}, static fraction {plan['static_fraction']:.4f}.\n\n",
        "## Deployments\n\n"]
  headers = ["model", "weights", "KV", "weights/GPU (XLA, served)", "+ not served (analytic)",
             "weights/GPU, model", "temp decode", "temp prefill", "temps within reserve",
             "pool (largest that fits)", "tokens", "model tokens", "requests", "model requests"]
  conc = plan["concurrency"]
  if any("at_concurrency" in r for r in rec["rows"]):
    headers += [f"{conc} requests: peak", f"{conc} requests fit"]
  headers += ["kernels per step, decode / prefill"]
  report = REPORT_KIMI_TOKENS
  rows = []
  for r in rec["rows"]:
    a = r["analytic"]
    c = r.get("at_concurrency")
    tok = f"{r['tokens']:,}"
    if r["model"] == KIMI_K2_6.name and r["kv_dtype"] in report:
      tok += f" (report ~{report[r['kv_dtype']] / 1e3:,.0f}K)"
    model_w = b(a["weights"])
    if r["model"] == GLM_5_2.name and r["recipe"] in REPORT_GLM_PER_GPU_GIB:
      gib = REPORT_GLM_PER_GPU_GIB[r["recipe"]]
      model_w += f" (report {gib} GiB = {gib * 2**30 / _UNIT[unit]:,.1f})"
    row = [r["model"], r["recipe"], r["kv_dtype"], b(r["weights_xla"]),
           b(r["weights_unserved"]["bytes"]) + f" ({r['weights_unserved']['what']})",
           model_w, b(r["temp"].get("decode")), b(r["temp"].get("prefill")),
           "yes" if r["temps_fit_reserve"] else
           f"NO ({b(r['reserve'])} > {b(r['reserve_allowed'])})",
           b(r["largest_pool"]), tok, f"{a['tokens']:,}", r["concurrency"], a["concurrency"]]
    if c:
      row += [b(c["peak"]), "yes" if c["fits_hbm"] else "**NO (out of memory)**"]
    n = r.get("launches", {})
    row += [" / ".join(f"{n[k]:,}" if k in n else "-" for k in ("decode", "prefill"))]
    rows.append(row)
  md.append(common.markdown_table(headers, rows))
  md.append(
      f"\n'model' columns: the analytic model (`mlkit.perfmodel`, as `python -m experiments "
      f"paper`). Pool = min(static fraction x HBM - resident weights, HBM - resident weights - "
      f"the larger step's temporaries); requests = pool pages // pages of one request of the "
      f"sweep's shape. '{conc} requests': the decode step compiled with a pool for {conc} "
      "requests of the sweep's shape; peak = arguments + temporaries + unaliased outputs (+ "
      "weights and indexer keys not instantiated). Kernels per step: the kernels and library "
      "calls of XLA's thunk sequence (its fusions and the Pallas kernels, each one launch), "
      "read at full depth like the memory.\n")
  md.append("\n## Compiled steps\n\n")
  md.append(common.markdown_table(
      ["variant", "KV", "step", "layers", "B x T, pages/row", "pool pages", "arguments",
       "= weights + KV + inputs", "temp", "output", "aliased", "all-gathered (KB)",
       "kernels", "compile s"],
      [[c["variant"], c["kv_dtype"], c["kind"], c["n_layers"],
        f"{c['rows']} x {c['tokens']}, {c['max_pages']}", f"{c['num_pages']:,}",
        b(c["argument"]), "exact" if c["argument_matches_analytic"] else
        f"NO ({b(c['weights'] + c['kv'] + c['inputs'])})", b(c["temp"]), b(c["output"]),
        b(c["alias"]), f"{c['all_gather_bytes'] / 1e3:,.1f}", f"{c['launches']:,}",
        f"{c['compile_s']:.0f}"]
       for c in rec["compiles"]]))
  md.append(_kernels_markdown(rec["compiles"]))
  md.append(f"\n## Depth fits ({unit} = intercept + slope x MoE layers; the full-depth "
            "figure extends the deepest two points)\n\n")
  frows = []
  for key, series in rec["fits"].items():
    for f in ("argument", "temp", "peak"):
      s = series[f]
      frows.append([key, f, b(s["intercept"]), b(s["slope"]), f"{s['max_residual']:,.0f}",
                    b(s["marginal_slope"]), b(s["at_full"])])
    s = series["launches"]  # a count, not bytes
    frows.append([key, "kernels", f"{s['intercept']:,.1f}", f"{s['slope']:,.1f}",
                  f"{s['max_residual']:,.1f}", f"{s['marginal_slope']:,.1f}",
                  f"{s['at_full']:,.0f}"])
  md.append(common.markdown_table(
      ["series", "field", "intercept", "slope / MoE layer", "max residual (B, or kernels)",
       "slope between the deepest two", "at full depth"], frows))
  md.append("\n## Notes\n\n")
  md += [f"- {n}\n" for n in rec["notes"]]
  md.append("\n![h200_compile](h200_compile.png)\n")
  return "".join(md)


def _kernels_markdown(compiles: list[dict]) -> str:
  """Each series' kernels per GPU at its shallowest depth, and its all-gathers."""
  md = ["\n## Kernels each GPU runs\n\n",
        "Every Pallas kernel call in the compiled step, at its per-GPU result shape, and every "
        "all-gather XLA inserted (the shallowest compiled depth of each step; deeper ones "
        "repeat the MoE layer's calls). A kernel whose operands XLA had to gather runs at its "
        "unsplit shape beside an all-gather of that operand "
        "(`pallas_kernels/h200/step_placement.py`).\n"]
  shallowest = {}
  for c in compiles:
    key = (c["variant"], c["kv_dtype"], c["kind"])
    if key not in shallowest or c["n_moe"] < shallowest[key]["n_moe"]:
      shallowest[key] = c
  for (variant, kv, kind), c in shallowest.items():
    gathers = ", ".join(f"`{g['result']}`" for g in c["all_gathers"]) or "none"
    md.append(f"\n**{variant}, {kv} KV, {kind}** ({c['n_layers']} layers): all-gathers "
              f"{gathers}, {c['all_gather_bytes'] / 1e3:,.1f} KB.\n\n")
    md.append(common.markdown_table(["kernel", "custom call", "per-GPU result", "layers",
                                     "calls"], kernel_rows(c["kernels"])))
  return "".join(md)


def _plot(path: str, rec: dict) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  plan = rec["config"]["plan"]
  unit = sm.unit_for(plan["hbm_bytes"])
  u = _UNIT[unit]
  rows = rec["rows"]
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
  ax = axes[0]
  labels, labels_seen, x = [], set(), np.arange(len(rows))
  weights = np.array([r["weights_resident"] for r in rows]) / u
  pools = np.array([max(0.0, r["largest_pool"]) for r in rows]) / u
  temps = np.array([r["reserve"] for r in rows]) / u
  ax.bar(x - 0.2, weights, 0.38, label="weights")
  ax.bar(x - 0.2, pools, 0.38, bottom=weights, label="KV pool (largest that fits)")
  ax.bar(x - 0.2, temps, 0.38, bottom=weights + pools, label="step temporaries")
  for i, r in enumerate(rows):
    labels.append(f"{r['variant']}\n{r['kv_dtype']}")
    c = r.get("at_concurrency")
    if c:
      fits = c["fits_hbm"]
      label = f"{plan['concurrency']} requests, peak ({'fits' if fits else 'out of memory'})"
      ax.bar(i + 0.2, c["peak"] / u, 0.38, color="grey" if fits else "red", alpha=0.6,
             label=label if label not in labels_seen else None)
      labels_seen.add(label)
  ax.axhline(plan["hbm_bytes"] / u, color="k", linestyle="--", label="HBM")
  ax.axhline(plan["static_fraction"] * plan["hbm_bytes"] / u, color="k", linestyle=":",
             label="static fraction")
  ax.set_xticks(x, labels, fontsize=7)
  ax.set_ylabel(f"{unit} per device")
  ax.set_title("memory per H200 (XLA, full depth)", fontsize=10)
  ax.legend(fontsize=7)
  ax = axes[1]
  for key, series in rec["fits"].items():
    pts = np.asarray(series["temp"]["points"], np.float64)
    line = ax.plot(pts[:, 0], pts[:, 1] / u, marker="o", label=key)[0]
    xs = np.asarray([pts[:, 0].min(), pts[:, 0].max()])
    ax.plot(xs, (series["temp"]["intercept"] + series["temp"]["slope"] * xs) / u,
            linestyle=":", color=line.get_color())
  ax.set_xlabel("MoE layers compiled (after the dense prefix)")
  ax.set_ylabel(f"temporaries, {unit} per device")
  ax.set_title("step temporaries vs depth (points: XLA; dotted: fit)", fontsize=10)
  ax.legend(fontsize=6)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
