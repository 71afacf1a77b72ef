"""`python -m experiments [name ...] [--out DIR] [--full]`.

With no name, runs the default quick suite on the local device and writes
``<out>/REPORT.md`` linking every table and plot.
"""

from __future__ import annotations

import importlib
import os
import sys
import time

from absl import app, flags, logging

# name -> (module, one-line description). Modules expose run(out_dir, *, quick) -> dict.
EXPERIMENTS = {
    "generate": ("experiments.generate", "greedy generation from a tiny model; prints tokens/s"),
    "capacity": ("experiments.capacity", "tokens that fit a KV budget, bf16 vs fp8 (lever 1)"),
    "engine_overhead": ("experiments.engine_overhead",
                        "host overhead per engine step, 64 running requests on SMALL_MLA, "
                        "integrity check on/off"),
}
DEFAULT_SUITE = ("generate", "capacity", "engine_overhead")

_OUT = flags.DEFINE_string("out", "results", "Output folder for JSON, markdown and PNG.")
_FULL = flags.DEFINE_bool("full", False, "Run the full-size variant instead of the quick one.")


def _available(name: str) -> bool:
  try:
    importlib.import_module(EXPERIMENTS[name][0])
    return True
  except ModuleNotFoundError:
    return False


def _usage() -> str:
  lines = ["usage: python -m experiments [name ...] [--out DIR] [--full]", "", "experiments:"]
  for name, (_, desc) in EXPERIMENTS.items():
    lines.append(f"  {name:<12} {desc}")
  lines.append(f"\nWith no name, runs: {', '.join(DEFAULT_SUITE)}")
  return "\n".join(lines)


def main(argv):
  logging.set_verbosity(logging.WARNING)  # keep backend-probe chatter out of the progress output
  names = argv[1:] or [n for n in DEFAULT_SUITE if _available(n)]
  unknown = [n for n in names if n not in EXPERIMENTS]
  if unknown:
    print(f"unknown experiment(s): {', '.join(unknown)}\n\n{_usage()}", file=sys.stderr)
    return 2
  out = _OUT.value
  os.makedirs(out, exist_ok=True)
  done = []
  for i, name in enumerate(names, 1):
    print(f"=== [{i}/{len(names)}] {name} ===", flush=True)
    t0 = time.perf_counter()
    module = importlib.import_module(EXPERIMENTS[name][0])
    module.run(out, quick=not _FULL.value)
    done.append((name, time.perf_counter() - t0))
  lines = ["# Experiment report", ""]
  for name, secs in done:
    lines.append(f"## {name} ({secs:.0f} s)\n")
    lines.append(f"- data: [{name}.json]({name}.json)")
    if os.path.exists(os.path.join(out, f"{name}.md")):
      lines.append(f"- table: [{name}.md]({name}.md)")
    for f in sorted(os.listdir(out)):
      if f.startswith(name) and f.endswith(".png"):
        lines.append(f"- plot: ![{f}]({f})")
    lines.append("")
  with open(os.path.join(out, "REPORT.md"), "w") as f:
    f.write("\n".join(lines))
  print(f"wrote {os.path.join(out, 'REPORT.md')}")
  return 0


if __name__ == "__main__":
  if any(a in ("-h", "--help", "help") for a in sys.argv[1:]):
    print(_usage())
    sys.exit(0)
  app.run(main)
