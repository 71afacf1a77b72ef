"""kernels: every Pallas kernel at its target shapes, checked and timed on a GPU.

Wraps the one prepared device script, ``scripts/gpu_check.py``: on a GPU ``run``
starts it (it writes ``gpu_check.jsonl``: one record per case as soon as it is
measured) and renders its records as ``kernels.{json,md,png}``: per case the
kernel's time from CUPTI, its error against the f32 reference, achieved bytes/s
and FLOP/s against the H200 ceilings, the roofline bound, XLA's path and the
peers (JAX's own Pallas kernels, bf16 twins), and fp8 pages against bf16.

Without a GPU there is nothing to time here: ``run`` says so, returns
``{"skipped": True, ...}``, and renders the H200 runs committed under
``docs/measurements`` (``committed_runs``) instead, so a CPU report still shows
what the kernels did on the device. Either way the markdown carries the roofline
sheet (``pallas_kernels.roofline``: per target case the bytes and FLOPs, the time at
the H200's ceilings and the target; measured times beside it once a device has run
``gpu_check``; plotted by ``experiments.roofline``) and the H200 compile readings
(registers, spills, shared memory per kernel and shape, read with
``pallas_kernels.h200.kernel_readings``) that the compile tests or
``experiments.kernel_compile`` wrote, when there are any.

A JSONL fetched from a device renders the same way::

    python -m experiments.kernels --from gpu_check.jsonl --out results
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys

import jax

from experiments import common
from experiments.roofline import plot as plot_roofline
from experiments.roofline import plot_measured
from pallas_kernels import gpu_check_records as gcr
from pallas_kernels import roofline
from pallas_kernels.tables import cell

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(_REPO, "scripts", "gpu_check.py")
MEASUREMENTS = os.path.join(_REPO, "docs", "measurements")
SKIP_REASON = ("kernels needs an NVIDIA GPU (the Pallas kernels are compiled and timed on the "
               "device); this machine's JAX backend is '{backend}'. Skipped. On a CPU the kernels "
               "are checked in interpret mode by the tests and by "
               "`python scripts/gpu_check.py --smoke --out /tmp/gpu_check.jsonl`.")
FULL_BUDGET_S = 1800.0  # --full: every tier the half hour allows


# A folder of compile records to read instead of the default (the test suite points its
# smoke run at a snapshot, so that compile tests writing records beside it do not race it).
COMPILE_RECORDS_ENV = "MLKIT_H200_COMPILE_RECORDS"


def compile_section(path: str | None = None) -> str:
  """Markdown of the deviceless H200 compile readings (the compile tests' and
  experiments.kernel_compile's records; $MLKIT_H200_COMPILE_RECORDS names another folder).

  Args:
    path: folder or file of compile records; None for kernel_compile.DEFAULT_DIR.

  Returns:
    A "## H200 compile readings" section; it says so when there are no records
    or they cannot be read.
  """
  head = "## H200 compile readings (deviceless, ptxas)\n\n"
  try:
    from experiments import kernel_compile
    from pallas_kernels.h200 import kernel_readings
  except ImportError as e:
    return head + f"Compile readings unavailable: {e}.\n"
  try:
    records = kernel_readings.load_records(
        path or os.environ.get(COMPILE_RECORDS_ENV) or kernel_compile.DEFAULT_DIR)
    return head + kernel_readings.markdown(records)
  except (OSError, ValueError, KeyError) as e:
    return head + f"Compile records could not be read: {type(e).__name__}: {e}.\n"


def run_gpu_check(jsonl: str, *, smoke: bool, budget_s: float | None = None) -> int:
  """Runs scripts/gpu_check.py in a child process (its workers own the GPU), returns its code."""
  cmd = [sys.executable, SCRIPT, "--out", jsonl] + (["--smoke"] if smoke else [])
  if budget_s is not None:
    cmd += ["--budget-s", str(budget_s)]
  env = dict(os.environ)
  # This process already holds a JAX client; the workers take memory as they need it.
  env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  return subprocess.run(cmd, cwd=_REPO, env=env, check=False).returncode


def run(out_dir: str, *, quick: bool = True, smoke: bool = False) -> dict:
  """Checks and times every kernel on the GPU (or records that there is none).

  Args:
    out_dir: folder for gpu_check.jsonl (its log beside it), kernels.json,
      kernels.md and kernels.png.
    quick: the script's default 8-minute budget; False: FULL_BUDGET_S.
    smoke: the script's smoke mode (tiny shapes, interpret mode).

  Returns:
    The record; ``skipped`` is True without a GPU.
  """
  record = common.record_header("kernels", quick=quick, smoke=smoke,
                                config={"script": "scripts/gpu_check.py"})
  backend = jax.default_backend()
  if backend != "gpu":
    reason = SKIP_REASON.format(backend=backend)
    common.progress(f"kernels: {reason}")
    committed = committed_runs()
    if committed:
      common.progress(f"kernels: rendering the committed H200 run(s) {[os.path.basename(p) for p in committed]}")
      record.update(reason=reason)
      return report(committed, out_dir, record=record, skipped=True)
    sheet = roofline.rows()
    record.update(skipped=True, reason=reason, records=[], roofline=sheet)
    common.write_json(out_dir, "kernels", record)
    plot_roofline(sheet, os.path.join(out_dir, "kernels_roofline.png"))
    common.write_markdown(out_dir, "kernels", f"# kernels\n\n{reason}\n\n"
                          f"{roofline.markdown(sheet)}\n![kernels_roofline](kernels_roofline.png)\n\n"
                          f"{compile_section()}")
    return record
  jsonl = os.path.join(out_dir, "gpu_check.jsonl")
  os.makedirs(out_dir, exist_ok=True)
  record["gpu_check_returncode"] = run_gpu_check(jsonl, smoke=smoke,
                                                 budget_s=None if quick else FULL_BUDGET_S)
  return report(jsonl, out_dir, record=record)


def _us(s):
  return None if s is None else s * 1e6


def _rate(case: dict, key: str, scale: float):
  """The case's ``key`` (bytes or FLOPs) per second of its kernel time, over ``scale``."""
  return case[key] / case["time_s"] / scale if case.get("time_s") and case.get(key) else None


def case_rows(cases: list[dict]) -> list[list]:
  """One table row per case record: status, kernel time, XLA, best peer
  (``gpu_check_records.best_peer``), rates, roofline."""
  rows = []
  for r in cases:
    if r.get("group") == "ceiling":
      continue
    best = gcr.best_peer(r)
    rows.append([r["kernel"], r["name"], r["status"], r.get("tier", "-"), _us(r.get("time_s")),
                 r.get("timing_source", "-"), r.get("rel_err"), _us(r.get("xla_time_s")),
                 r.get("speedup_vs_xla"), f"{best[0]} {cell(_us(best[1]))}" if best else "-",
                 _rate(r, "bytes", 1e9), _rate(r, "flops", 1e12), _us(r.get("roofline_s")),
                 r.get("roofline_fraction")])
  return rows


def committed_runs(folder: str = MEASUREMENTS) -> list[str]:
  """The gpu_check runs committed under ``folder`` (docs/measurements), oldest first."""
  return sorted(glob.glob(os.path.join(folder, "gpu_check_*.jsonl")))


def report(jsonl: str | list[str], out_dir: str, *, record: dict | None = None,
           skipped: bool = False) -> dict:
  """Renders gpu_check JSONL as kernels.{json,md,png} under out_dir.

  Args:
    jsonl: the script's output (a partial file from a killed run is fine), or several
      runs' (a rerun after a first run, say): a case run twice keeps its later record.
    out_dir: where to write.
    record: the experiment header to extend (None: a bare one).
    skipped: nothing ran here; the records are committed ones (:func:`committed_runs`),
      and the markdown says so, with ``record["reason"]``.

  Returns:
    The record with ``cases`` (every case record, plus ``xla_time_s``), the
    header, summary and budget/aborted records of the run, and ``all_ok``.
  """
  runs = gcr.read_runs(jsonl)
  paths, cases, header, summary, stops = (runs.paths, runs.cases, runs.header, runs.summary,
                                          runs.stops)
  record = dict(record or {"experiment": "kernels"})
  for r in cases:
    r["xla_time_s"] = gcr.xla_time(r)
  real = runs.measured
  sheet = roofline.rows(measured={r["name"]: r for r in real})
  record.update(skipped=skipped, source=paths[0] if len(paths) == 1 else list(paths),
                header=header, summary=summary, stop=stops[0] if stops else None,
                workers=runs.workers, cases=cases, roofline=sheet, all_ok=runs.all_ok)
  common.write_json(out_dir, "kernels", record)
  device = next((w.get("device_kind") for w in runs.workers if w.get("device_kind")), "?")
  names = ", ".join(f"`{os.path.basename(p)}`" for p in paths)
  lines = ["# kernels\n"]
  if skipped:
    lines.append(f"{record.get('reason', 'Nothing ran here.')} The figures below are the H200 "
                 f"run{'s' if len(paths) > 1 else ''} committed under `docs/measurements` "
                 f"(measured on the device, not here).\n")
  lines += [f"Source: {names} on `{device}` (jax {header.get('jax', '?')}, "
           f"{'smoke: tiny shapes, interpret mode, timings mean nothing' if header.get('smoke') else 'target shapes'}). "
           f"{len(real)} of {header.get('plan_size', '?')} planned cases ran "
           f"({header.get('targets_total', '?')} target cases in all).",
           "Kernel time: median over rotated inputs, from CUPTI where the source says `cupti`; "
           "rates against 4.3 TB/s copy and 790 TFLOP/s bf16; roofline = max(bytes / 4.3 TB/s, "
           "FLOPs / 790 TFLOP/s), and its fraction = roofline / kernel time.\n"]
  for stop in stops:
    lines.append(f"**Run stopped ({stop['type']}):** {stop.get('reason', 'the budget would be exceeded')}; "
                 f"{len(stop.get('unstarted', []))} cases not started.\n")
  ceilings = [r for r in cases if r.get("group") == "ceiling"]
  if ceilings:
    lines.append("Measured ceilings: " + ", ".join(
        f"{r['name']} {gcr.ceiling_text(r)}" for r in ceilings) + "\n")
  lines.append(common.markdown_table(
      ["kernel", "case", "status", "tier", "time us", "source", "rel err", "XLA us",
       "x vs XLA", "best peer us", "GB/s", "TFLOP/s", "roofline us", "of roofline"],
      case_rows(cases)))
  twins = (summary or {}).get("fp8_vs_bf16") or []
  if twins:
    lines.append("\n## fp8 pages vs their bf16 twins\n")
    lines.append(common.markdown_table(
        ["fp8 case", "fp8 us", "bf16 us", "speedup"],
        [[t["fp8"], _us(t["fp8_time_s"]), _us(t["bf16_time_s"]), t["speedup_fp8_vs_bf16"]]
         for t in twins]))
  bad = [r for r in cases if r["status"] != "ok"]
  if bad:
    lines.append("\n## Not ok\n")
    for r in bad:
      why = next((p.get("error") for p in r.get("impls", []) if p.get("error")), None)
      tail = (r.get("stderr_tail") or "").strip().splitlines()[-1:] if not why else []
      lines.append(f"- `{r['name']}`: {r['status']}" + (f": {why.splitlines()[0][:200]}" if why
                                                          else (f": `{tail[0][:200]}`" if tail else "")))
  wrong = [(r["name"], p["impl"], p.get("rel_err")) for r in cases for p in gcr.wrong_impls(r)
           if p["impl"] != "pallas"]
  if wrong:
    lines.append("\n## Peers with wrong outputs (left out of \"best peer\")\n")
    lines += [f"- `{name}`: `{impl}`, rel err {cell(err)}" for name, impl, err in wrong]
  lines.append("\n![kernels](kernels.png)\n")
  lines.append(roofline.markdown(sheet))
  lines.append("\n![kernels_roofline](kernels_roofline.png)\n")
  lines.append(compile_section())
  common.write_markdown(out_dir, "kernels", "\n".join(lines))
  plot_measured(real, os.path.join(out_dir, "kernels.png"))
  plot_roofline(sheet, os.path.join(out_dir, "kernels_roofline.png"))
  return record


def main(argv=None) -> int:
  """``python -m experiments.kernels --from JSONL [--out DIR]``: renders a fetched run."""
  p = argparse.ArgumentParser(description="Render a gpu_check JSONL as kernels.{json,md,png}.")
  p.add_argument("--from", dest="src", required=True, help="gpu_check.jsonl (e.g. from a device)")
  p.add_argument("--out", default="results", help="output folder")
  args = p.parse_args(argv)
  rec = report(args.src, args.out)
  print(f"kernels: {len(rec['cases'])} cases -> {args.out}/kernels.md")
  return 0


if __name__ == "__main__":
  sys.exit(main())
