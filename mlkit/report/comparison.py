"""REPORT.md's opening table: every figure of the reproduced report beside this project's value.

Each experiment compares itself with the report in its own files; without this table a
reader opens a dozen of them to learn which figures are reproduced, which were only
fitted and which never ran. ``comparison`` reads whatever ``<name>.json`` records a
folder holds and returns one row per figure of docs/report.md; a missing record gives a
"not run" row, never a missing row. Sources stay apart because they mean different
things, and a CPU tok/s is never set beside an H200 tok/s (only ratios and shapes are).
It reads JSON only (no jax), so ``python -m experiments`` can call :func:`section` after
any run, failed ones included.
"""

from __future__ import annotations

import dataclasses
import json
import os

from mlkit.report.figures import (REPORT_GLM_FP8, REPORT_GLM_PER_GPU_GIB, REPORT_KIMI_BF16,
                                  REPORT_KIMI_TOKENS)

MODELLED, COMPILED, FITTED, MEASURED = ("modelled (analytic)", "compiled for 8x H200", "fitted",
                                       "measured")
# The compiled-program step-time model (mlkit.plan.step_time): its one launch gap is fitted
# on Kimi's bf16-KV column (PROGRAM_FIT), every other column is predicted (PROGRAM).
PROGRAM = "compiled for 8x H200, step-time model"
PROGRAM_FIT = PROGRAM + ", its one constant fitted on this column"
FITTED_VERDICT = "fitted: not a prediction"
KIMI, GLM, BF16, FP8, FP8_W, INT4_W = ("kimi-k2.6", "glm-5.2", "bfloat16", "float8_e4m3fn",
                                      "fp8-all", "int4-experts-g32")
PLOT = "report_vs_ours.png"


@dataclasses.dataclass(frozen=True)
class Row:
  """One figure of the report beside ours."""

  lever: int | str  # 1-4, or "model" for the model shapes
  figure: str  # what the report states, in words
  report: str  # the report's value, as text
  ours: str  # this project's value, as text ("not run" without the record)
  source: str  # measured (...), compiled for 8x H200, modelled (analytic) or fitted
  ratio: float | None  # ours / report where both are numbers
  verdict: str
  from_: str  # the experiment's JSON and field


class _Absent(Exception):
  """args = (ours, verdict): the record lacks this figure (a smoke compile of a tiny model)."""


def _find(items, **kv):
  return next(x for x in items if all(x.get(k) == v for k, v in kv.items()))


def _tok(v):
  return f"{v / 1e6:.2f}M tokens" if v >= 1e6 else f"{v / 1e3:.0f}K tokens"


def _yes(ok: bool, why: str = "") -> str:
  return "reproduced" if ok else "not reproduced" + (f": {why}" if why else "")


def _measured(rec: dict) -> str:
  m, c = rec.get("machine", {}), rec.get("config", {})
  where = (f"{m.get('cpu_count', '?')}-core CPU" if m.get("backend", "cpu") == "cpu"
           else m.get("device_kind", "?"))
  model = next((v.get("name") if isinstance(v, dict) else v
                for v in (c.get("measured_model"), c.get("model"), c) if v), "?")
  return f"measured ({where}, {model})"


def numeric_verdict(ratio: float) -> str:
  """'matches (within 10%)', 'within 25%' or 'off by +x%' for ours / report."""
  err = abs(ratio - 1)
  return ("matches (within 10%)" if err <= 0.10 else "within 25%" if err <= 0.25
          else f"off by {100 * (ratio - 1):+.0f}%")


# Getters: record -> (ours as text, ours as a number or None, verdict or None = from the ratio).
def _num(fn, fmt):
  return lambda r: (fmt(v := fn(r)), v, None)


def _h200(r, model, **kv):
  rows = [x for x in r["rows"] if x["model"] == model and all(x[k] == v for k, v in kv.items())]
  if not rows:
    got = ", ".join(sorted({x["model"] for x in r["rows"]})) or "nothing"
    raise _Absent("not compiled", f"not run: this {r.get('mode', '?')} run compiled {got}")
  return rows[0]


def _program(r, column, rows=None):
  """The paper's compiled-program prediction of one step (``compiled.rows``)."""
  got = r["compiled"]["rows"]
  found = [x for x in got if x["column"] == column and (rows is None or x["rows"] == rows)]
  if not found:
    have = ", ".join(sorted({x["column"] for x in got})) or "nothing"
    raise _Absent("not compiled", f"not run: this {r.get('mode', '?')} run compiled {have}")
  return found[0]


def _program_ratio(r, int4, fp8, rows=None):
  return _program(r, int4, rows)["tok_s"] / _program(r, fp8, rows)["tok_s"]


def _h200_oom(r):
  b, f = (_h200(r, KIMI, kv_dtype=d)["at_concurrency"] for d in (BF16, FP8))
  say = lambda x: f"{x['peak'] / 1e9:.0f} GB, {'fits' if x['fits_hbm'] else 'does not fit'}"
  return (f"{b['requests']} requests on {r['config']['plan']['hbm_bytes'] / 1e9:.0f} GB: bf16 "
          f"{say(b)}; fp8 {say(f)}", None, _yes(not b["fits_hbm"] and f["fits_hbm"]))


def _oom_modelled(r, name, what):
  """The paper model at concurrency 64: bf16 out of memory (after running 32), fp8 running."""
  x = _find(r["columns"], column=name, concurrency=64)
  fits = str(_find(r["predictions"], what=what)["predicted"]).split(" / ")[0]
  ours = "out of memory" if x["predicted_oom"] else f"runs, {x['predicted_tok_s']:,.0f} tok/s"
  ok = (x["predicted_oom"] and not _find(r["columns"], column=name, concurrency=32)["predicted_oom"]
        if "bf16" in name else not x["predicted_oom"])
  return f"{ours} at 64 ({fits} requests fit)", None, _yes(ok)


def _oom_measured(r):
  oom, top = r["oom_concurrency"], max(r["config"]["shape"]["concurrency"])
  say = lambda d: ", ".join(map(str, oom[d])) or "none"
  return (f"sweep to c={top}: bf16 OOM at {say(BF16)}; fp8 OOM at {say(FP8)}", None,
          _yes(bool(r["report_shape_reproduced"])))


def _side(label, fn, faster: bool):
  """A qualitative claim: INT4 / fp8 above 1 (faster) or below 1 (slower)."""
  def get(r):
    v, where = fn(r)
    return f"{label} {v:.2f}x{where}", None, _yes(v > 1 if faster else v < 1)
  return get


def _claims(prefix):
  def get(r):
    cs = [c for c in r["claims"] if c["claim"].startswith(prefix)]
    if not cs:
      raise _Absent("no paired comparison", "not run: the recipes were skipped")
    holds = [c["holds"] for c in cs]
    worst = max(abs(c["delta_points"]) for c in cs)
    ci = max(abs(x) for c in cs for x in c["ci95_points"])
    return (f"max abs delta {worst:.1f} pts over {len(cs)} paired tasks (95% CI to ±{ci:.1f})",
            None, "not reproduced" if "no" in holds else "reproduced" if set(holds) == {"yes"}
            else f"not resolved: {holds.count('not resolved')} of {len(cs)} 95% CIs wider than "
                 f"the ±{cs[0]['band_points']:g}-point band")
  return get


def _cost(key, what, sign):
  """Worst cost over concurrencies; sign 1: ``key`` is on/off throughput, -1: on/off time."""
  def get(r):
    ratios = ({t["concurrency"]: t[key]["median"] for t in r["timing"]} if "timing" in r
              else {r["running_requests"]: r[key]})
    cost = {c: sign * (1 - v) for c, v in ratios.items() if v is not None}
    c = max(cost, key=cost.get)
    return (f"{100 * cost[c]:+.1f}% {what} at c={c}" + (
        f" (worst of c={'/'.join(map(str, cost))})" if len(cost) > 1 else ""), None,
        _yes(cost[c] <= 0.01, f"{100 * cost[c]:.1f}% on CPU"))
  return get


def _disagg(r):
  c, t = r["config"]["disaggregated"], r["transfer_metrics"]
  aborted = sum(p["disaggregated"]["aborted"] for p in r["pairs"])
  return (f"prefill {c['prefill']}; decode {c['decode']}; {t['transfers']} KV transfers, "
          f"{t['transfer_failures']} failed, {aborted} aborted", None,
          _yes(t["transfers"] > 0 and t["transfer_failures"] == 0 and aborted == 0))


def _specs():
  """(lever, figure, report text, report number, json, field, source, getter) per figure."""
  pred = lambda what: lambda r: _find(r["predictions"], what=what)["predicted"]
  col = lambda name, c: lambda r: _find(r["columns"], column=name, concurrency=c)["predicted_tok_s"]
  acct = lambda rc, f: lambda r: _find(r["paper_weight_memory"], model=GLM, recipe=rc)[f]
  gib, tps = (lambda v: f"{v:.1f} GiB"), (lambda v: f"{v:,.0f} tok/s")
  kv = (("bf16", BF16, "~686K tokens", REPORT_KIMI_TOKENS[BF16]),
        ("fp8", FP8, "~1.37M tokens", REPORT_KIMI_TOKENS[FP8]))
  w = (("fp8", FP8_W, 705, REPORT_GLM_PER_GPU_GIB[FP8_W]),
       ("INT4 experts", INT4_W, 421, REPORT_GLM_PER_GPU_GIB[INT4_W]))
  rows = []
  for n, d, rt, rv in kv:
    rows += [(1, f"Kimi K2.6 KV tokens per H200, {n} cache", rt, rv, "paper",
              f"predictions[Kimi tokens, {n} KV]", MODELLED,
              _num(pred(f"Kimi tokens, {n} KV"), _tok))]
  for n, d, rt, rv in kv:
    rows += [(1, f"Kimi K2.6 KV tokens per H200, {n} cache (largest pool)", rt, rv,
              "h200_compile", f"rows[kimi-k2.6, {d}].tokens", COMPILED,
              _num(lambda r, d=d: _h200(r, KIMI, kv_dtype=d)["tokens"], _tok))]
  rows += [(1, "fp8 / bf16 KV tokens in one budget (pools allocated)", "~2.0x (1.37M / 686K)",
            1_370_000 / 686_000, "capacity", "ratio", MEASURED,
            _num(lambda r: r["ratio"], lambda v: f"{v:.3f}x"))]
  rows += [(1, f"Kimi decode tok/s, bf16 KV, concurrency {c}", f"{v} tok/s", v, "paper",
            f"columns[kimi bf16 KV, {c}].predicted_tok_s", FITTED,
            _num(col("kimi bf16 KV", c), tps)) for c, v in REPORT_KIMI_BF16.items()]
  rows += [(1, f"Kimi decode tok/s, bf16 KV, concurrency {c} (compiled step)", f"{v} tok/s", v,
            "paper", f"compiled.rows[kimi bf16 KV, {c}].tok_s", PROGRAM_FIT,
            _num(lambda r, c=c: _program(r, "kimi bf16 KV", c)["tok_s"], tps))
           for c, v in REPORT_KIMI_BF16.items()]
  rows += [
      (1, "Kimi bf16 KV out of memory at concurrency 64", "out of memory", None, "paper",
       "columns[kimi bf16 KV, 32/64].predicted_oom", MODELLED,
       lambda r: _oom_modelled(r, "kimi bf16 KV", "Kimi bf16-KV: most requests that fit / first "
                               "swept concurrency out of memory")),
      (1, "Kimi fp8 KV still runs at concurrency 64", "runs", None, "paper",
       "columns[kimi fp8 KV, 64].predicted_oom", MODELLED,
       lambda r: _oom_modelled(r, "kimi fp8 KV", "Kimi fp8-KV: most requests that fit")),
      (1, "64 requests: bf16 KV out of memory, fp8 fits", "bf16 OOM, fp8 runs", None,
       "h200_compile", "rows[kimi-k2.6, *].at_concurrency.fits_hbm", COMPILED, _h200_oom),
      (1, "bf16 KV out of memory at the top concurrency, fp8 not", "bf16 OOM, fp8 runs", None,
       "kv_dtype", "oom_concurrency, report_shape_reproduced", MEASURED, _oom_measured),
      (1, "accuracy unchanged with the fp8 KV cache", "unchanged", None, "accuracy",
       "claims[fp8 KV within ~1 point].delta_points", MEASURED, _claims("fp8 KV"))]
  rows += [(2, f"GLM 5.2 weights in total, {n}", f"{v} GB", v, "weight_quant",
            f"paper_weight_memory[glm-5.2, {rc}].total_gib", MODELLED,
            _num(acct(rc, "total_gib"), gib)) for n, rc, v, _ in w]
  for n, rc, _, v in w:
    rows += [(2, f"GLM 5.2 weights per GPU at TP 8, {n}", f"{v} GB", v, "weight_quant",
              f"paper_weight_memory[glm-5.2, {rc}].per_gpu_gib", MODELLED,
              _num(acct(rc, "per_gpu_gib"), gib)),
             (2, f"GLM 5.2 weights per GPU at TP 8, {n} (compiled)", f"{v} GB", v, "h200_compile",
              f"rows[glm-5.2, {rc}].weights_resident", COMPILED,
              _num(lambda r, rc=rc: _h200(r, GLM, recipe=rc)["weights_resident"] / 2**30, gib))]
  rows += [(2, f"GLM decode tok/s, fp8 weights, concurrency {c}", f"{v} tok/s", v, "paper",
            f"columns[glm fp8 weights, {c}].predicted_tok_s", FITTED,
            _num(col("glm fp8 weights", c), tps)) for c, v in REPORT_GLM_FP8.items()]
  rows += [(2, f"GLM decode tok/s, fp8 weights, concurrency {c} (compiled step)", f"{v} tok/s",
            v, "paper", f"compiled.rows[glm fp8 weights, {c}].tok_s", PROGRAM,
            _num(lambda r, c=c: _program(r, "glm fp8 weights", c)["tok_s"], tps))
           for c, v in REPORT_GLM_FP8.items()]
  dec, pre = "GLM INT4 / fp8 decode tok/s at concurrency 1", "GLM prefill INT4 / fp8"
  fast, slow = "INT4 decode faster than fp8 at low concurrency", "INT4 prefill slower than fp8"
  rows += [
      (2, fast, "faster (no figure)", None, "paper", f"predictions[{dec}]", MODELLED,
       _side("INT4/fp8 decode", lambda r: (pred(dec)(r), " at c=1"), True)),
      (2, slow, "slower (no figure)", None, "paper", f"predictions[{pre}]", MODELLED,
       _side("INT4/fp8 prefill", lambda r: (pred(pre)(r), ""), False)),
      (2, fast + " (compiled steps)", "faster (no figure)", None, "paper",
       "compiled.rows[glm int4 / fp8 weights, 1].tok_s", PROGRAM,
       _side("INT4/fp8 decode", lambda r: (_program_ratio(r, "glm int4 weights",
                                                          "glm fp8 weights", 1), " at c=1"), True)),
      (2, slow + " (compiled steps)", "slower (no figure)", None, "paper",
       "compiled.rows[glm int4 / fp8 prefill].tok_s", PROGRAM,
       _side("INT4/fp8 prefill", lambda r: (_program_ratio(r, "glm int4 prefill",
                                                           "glm fp8 prefill"), ""), False)),
      (2, fast, "faster (no figure)", None, "weight_quant", "decode[lowest c].int4_over_fp8",
       MEASURED, _side("INT4/FP8 decode", lambda r: next(
           (x["int4_over_fp8"], f" at c={x['concurrency']}") for x in
           sorted(r["decode"], key=lambda x: x["concurrency"]) if x["int4_over_fp8"]), True)),
      (2, slow, "slower (no figure)", None, "weight_quant", "prefill_int4_over_fp8", MEASURED,
       _side("INT4/FP8 prefill", lambda r: (r["prefill_int4_over_fp8"], ""), False)),
      (2, "accuracy within 0.8 points with INT4 weights", "within 0.8 points", None, "accuracy",
       "claims[int4 weights within 0.8 points of fp8].delta_points", MEASURED,
       _claims("int4 weights")),
      (3, "prefill pool bf16 KV + fp8 weights, decode pool fp8 KV + INT4; KV moves between",
       "the recipe (no figure)", None, "disagg",
       "config.disaggregated, transfer_metrics, pairs[].disaggregated.aborted", MEASURED, _disagg),
      (4, "page-tag check: throughput cost", "< 1%", None, "integrity",
       "timing[].throughput_ratio.median", MEASURED, _cost("throughput_ratio", "throughput", 1)),
      (4, "page-tag check: p95 latency cost", "< 1%", None, "integrity",
       "timing[].p95_latency_ratio.median", MEASURED,
       _cost("p95_latency_ratio", "p95 latency", -1)),
      (4, "tag check + page audit: step time cost, 64 running requests", "< 1%", None,
       "engine_overhead", "integrity_check_step_time_ratio", MEASURED,
       _cost("integrity_check_step_time_ratio", "step time", -1)),
      ("model", "Kimi K2.6 KV bytes per token, bf16 (61 layers x (512 + 64) x 2 B)", "70,272 B",
       70_272, "capacity", "paper[kimi-k2.6, bfloat16].bytes_per_token", MODELLED,
       _num(lambda r: _find(r["paper"], model=KIMI, dtype=BF16)["bytes_per_token"],
            lambda v: f"{v:,} B"))]
  return rows


def _load(out_dir: str, name: str) -> dict | None:
  try:
    with open(os.path.join(out_dir, f"{name}.json")) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def comparison(out_dir: str) -> list[Row]:
  """One Row per figure of docs/report.md, from the ``<name>.json`` records in ``out_dir``."""
  records, rows = {}, []
  for lever, figure, rep_text, rep, name, field, kind, get in _specs():
    rec = records[name] if name in records else records.setdefault(name, _load(out_dir, name))
    source, from_ = (_measured(rec) if rec and kind == MEASURED else kind), f"{name}.json: {field}"
    if rec is None:
      rows.append(Row(lever, figure, rep_text, "not run", source, None, "not run", from_))
      continue
    try:
      ours, value, verdict = get(rec)
    except _Absent as e:
      (ours, verdict), value = e.args, None
    except (KeyError, StopIteration, TypeError, ValueError, IndexError, AttributeError) as e:
      ours, value, verdict = "not in the record", None, f"not run: {type(e).__name__} {e}"
    ratio = value / rep if isinstance(value, (int, float)) and rep else None
    if kind == FITTED:
      verdict = FITTED_VERDICT
    elif kind == PROGRAM_FIT and ratio is not None:
      verdict = numeric_verdict(ratio) + " (one constant fitted on this column)"
    elif verdict is None:
      verdict = numeric_verdict(ratio) if ratio is not None else "not comparable"
    rows.append(Row(lever, figure, rep_text, ours, source, ratio, verdict, from_))
  return rows


HEADER = (
    "Every figure of the reproduced report (docs/report.md) beside this project's value. "
    "**measured**: run here by this project's engine, on the machine and model named (on a CPU: "
    "small models); **compiled for 8x H200**: per-device memory of the real Kimi K2.6 / GLM 5.2 "
    "steps from XLA's GPU compiler, compiled without a GPU (**step-time model**: every launch "
    "of those steps timed at published kernel efficiencies, one launch gap fitted on Kimi's "
    "bf16-KV column, docs/step_time.md); **modelled (analytic)**: arithmetic "
    "from the model shapes and `mlkit.perfmodel`; **fitted**: a column the analytic model was "
    "calibrated on, so its agreement holds by construction. CPU throughput is never compared "
    "with the report's H200 tok/s as an absolute: measured rows compare ratios (fp8/bf16, "
    "INT4/fp8, check on/off) and shapes (who runs out of memory) only. The report's GLM weight "
    "figures are binary GiB (`mlkit.quant.accounting`).")


def markdown(rows: list[Row]) -> str:
  """The header paragraph and the table, one line per row."""
  lines = [HEADER, "", "| lever | the report's figure | report | ours | source | ours/report "
           "| verdict | from |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    cells = (r.lever, r.figure, r.report, r.ours, r.source,
             "-" if r.ratio is None else f"{r.ratio:.3f}", r.verdict, f"`{r.from_}`")
    lines.append("| " + " | ".join(str(v).replace("|", "\\|") for v in cells) + " |")
  return "\n".join(lines) + "\n"


def plot(out_dir: str) -> str | None:
  """The report's decode points (markers) over paper.json's model curves (lines); or None."""
  rec = _load(out_dir, "paper")
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  if not rec or "columns" not in rec:
    return None
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  panels = (("Kimi K2.6, INT4 weights", ("kimi bf16 KV", "kimi fp8 KV")),
            ("GLM 5.2, bf16 KV", ("glm fp8 weights", "glm int4 weights")))
  for ax, (title, cols) in zip(axes, panels):
    for name in cols:
      xs = [x for x in rec["columns"] if x["column"] == name]
      fitted = xs[0]["role"] == "calibration"
      ax.plot(*zip(*[(x["concurrency"], x["predicted_tok_s"]) for x in xs if x["predicted_tok_s"]]),
              linestyle="-" if fitted else "--",
              label=f"model, {'fitted' if fitted else 'predicted'}: {name}")
      rep = [(x["concurrency"], x["report_tok_s"]) for x in xs
             if isinstance(x["report_tok_s"], (int, float))]
      if rep:
        ax.scatter(*zip(*rep), marker="s", color="k", zorder=4, label=f"report: {name}")
      oom = [x["concurrency"] for x in xs if fitted and x["report_tok_s"] is None]
      if oom:  # the report's out-of-memory points (the model's curve ends there too)
        ax.scatter(oom, [0] * len(oom), marker="x", s=70, color="r", zorder=4,
                   label=f"report: {name} out of memory")
    ax.set_xscale("log", base=2)
    cs = sorted({x["concurrency"] for x in rec["columns"]})
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.set(xlabel="concurrency", ylabel="decode tok/s (8x H200)", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  path = os.path.join(out_dir, PLOT)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def section(out_dir: str) -> str:
  """REPORT.md's opening: the comparison table and, if written, the plot."""
  text = markdown(comparison(out_dir))
  return text + (f"\n![report vs ours]({PLOT})\n" if plot(out_dir) else "")
