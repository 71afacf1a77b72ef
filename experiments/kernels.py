"""kernels (GPU only): per-kernel time and achieved bandwidth against the references.

Wraps the one prepared device script, ``scripts/gpu_check.py``: its CHECKS time
paged MLA and GQA decode attention with bf16 and fp8 pages, the page-tag check,
and the dense and grouped INT4 matmuls at Kimi K2.6 shapes. Each record carries correctness against the
pure-jnp reference, the median kernel time, the achieved bandwidth and its
fraction of the H200's measured 4.3 TB/s copy bandwidth, and the speedup over
the XLA reference path.

Without a GPU there is nothing to measure: ``run`` writes a record and a note
that say so, and returns ``{"skipped": True, ...}``; the CLI carries on.
"""

from __future__ import annotations

import importlib.util
import os
import time
import traceback

import jax

from experiments import common

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP_REASON = ("kernels needs an NVIDIA GPU (the Pallas Mosaic GPU kernels are compiled and timed "
               "on the device); this machine's JAX backend is '{backend}'. Skipped. On CPU the "
               "kernels are checked in interpret mode by the tests and by "
               "`python scripts/gpu_check.py --smoke --out /tmp/smoke.json`.")


def _gpu_check_module():
  """scripts/gpu_check.py as a module (scripts/ is not a package)."""
  spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(_REPO, "scripts",
                                                                           "gpu_check.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _normalise(r: dict) -> dict:
  """One row from a gpu_check record (attention/tag records in s, INT4 records in us)."""
  if "time_s" in r:
    t, ref = 1e6 * r["time_s"], 1e6 * r["xla_time_s"] if "xla_time_s" in r else None
    bw = r["achieved_bw"] / 1e9 if "achieved_bw" in r else None
    frac, speedup = r.get("fraction_of_copy_bw"), r.get("speedup_vs_xla")
  else:
    t, ref, bw = r.get("time_us"), r.get("xla_int4_us"), r.get("achieved_bw_gbs")
    frac, speedup = r.get("copy_bw_fraction"), r.get("speedup_vs_xla_int4")
  return {"kernel": r.get("check"), "case": r.get("case"), "ok": bool(r.get("ok")),
          "time_us": t, "reference_time_us": ref, "achieved_bw_gbs": bw,
          "copy_bw_fraction": frac, "speedup_vs_reference": speedup, "raw": r}


def _records() -> list[dict]:
  """Runs every check of scripts/gpu_check.py (attention, tag check, INT4 matmuls) on the GPU."""
  gc = _gpu_check_module()
  records = []
  for check in gc.CHECKS:
    t0 = time.perf_counter()
    common.progress(f"kernels: {check.name}")
    try:
      recs = check.run(False)
    except Exception as e:  # one failing kernel must not hide the others' numbers
      recs = [{"check": check.name, "ok": False, "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()}]
    for r in recs:
      r["check_wall_s"] = time.perf_counter() - t0
    records.extend(recs)
  gc._tag_vs_step(records)  # noqa: SLF001 - the script's own derived figure
  return [_normalise(r) for r in records]


def run(out_dir: str, *, quick: bool = True, smoke: bool = False) -> dict:
  """Times every Pallas kernel on the GPU (or records that there is none).

  Args:
    out_dir: folder for kernels.json, kernels.md and kernels.png.
    quick, smoke: accepted for a uniform interface; the prepared device checks are one
      fixed set (decode-sized INT4 rows, group 32).

  Returns:
    The record; ``skipped`` is True without a GPU.
  """
  record = common.record_header("kernels", quick=quick, smoke=smoke, config={})
  if jax.default_backend() != "gpu":
    reason = SKIP_REASON.format(backend=jax.default_backend())
    common.progress(f"kernels: {reason}")
    record.update(skipped=True, reason=reason, records=[])
    common.write_json(out_dir, "kernels", record)
    common.write_markdown(out_dir, "kernels", f"# kernels\n\n{reason}\n")
    return record
  record.update(skipped=False, records=_records())
  return write_outputs(out_dir, record)


def write_outputs(out_dir: str, record: dict) -> dict:
  """Writes kernels.{json,md,png} for a GPU record whose ``records`` are normalised rows."""
  records = record["records"]
  record.update(all_ok=all(r["ok"] for r in records), copy_bw_reference_gbs=4300.0)
  common.write_json(out_dir, "kernels", record)
  _plot(os.path.join(out_dir, "kernels.png"), records)
  rows = [[r["kernel"], _case(r["case"]), "yes" if r["ok"] else "NO", _f(r["time_us"]),
           _f(r["reference_time_us"]), _f(r["achieved_bw_gbs"]), _f(r["copy_bw_fraction"]),
           _f(r["speedup_vs_reference"])] for r in records]
  md = ("# kernels\n\nPallas kernels on `" + record["machine"]["device_kind"] + "`: median time "
        "after warm-up on random inputs (rotated past L2), achieved bandwidth = bytes the op must "
        "move / time, as a fraction of the measured 4.3 TB/s copy bandwidth, and the speedup over "
        "the pure-jnp reference compiled by XLA.\n\n"
        + common.markdown_table(["kernel", "case", "correct", "time us", "reference us", "GB/s",
                                 "of copy BW", "speedup vs reference"], rows)
        + "\n![kernels](kernels.png)\n")
  common.write_markdown(out_dir, "kernels", md)
  return record


def _case(case) -> str:
  if not case:
    return "-"
  if isinstance(case, str):
    return case
  return ", ".join(f"{k}={v}" for k, v in case.items() if v is not None)


def _f(v):
  return "-" if v is None else (f"{v:,.3f}" if abs(v) < 10 else f"{v:,.0f}")


def _plot(path: str, records: list[dict]) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rs = [r for r in records if r["copy_bw_fraction"] is not None]
  fig, ax = plt.subplots(figsize=(8, max(3, 0.25 * len(rs))))
  ax.barh(range(len(rs)), [r["copy_bw_fraction"] for r in rs],
          color=["tab:green" if r["ok"] else "tab:red" for r in rs])
  ax.set_yticks(range(len(rs)), [f"{r['kernel']} {_case(r['case'])}"[:60] for r in rs], fontsize=6)
  ax.axvline(1.0, color="k", linestyle="--", linewidth=0.8)
  ax.set_xlabel("fraction of 4.3 TB/s copy bandwidth")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
