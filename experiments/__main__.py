"""`python -m experiments [name ...] [--out DIR] [--full] [--smoke]`.

With no name, runs the default quick suite on the local device (at most 10
minutes on an idle 2-core CPU) and writes ``<out>/REPORT.md`` linking every
table and plot. ``--help`` lists the experiments.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import tempfile
import time
import traceback

# The disagg experiment needs two devices (one per pool). On a CPU, JAX makes one host
# device unless told otherwise, and only before it starts, so this comes first.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=2").strip()

# CPU machines carry the CUDA compiler plugin (for deviceless H200 compiles): without a GPU, jax
# must be told to use the CPU before it loads, or it prints a driver traceback first.
from pallas_kernels.h200 import env as _h200_env  # noqa: E402

_h200_env.prepare(ptxas_report=False)

from absl import app, flags, logging  # noqa: E402

# name -> (module, one-line description with the quick run's budget on a 2-core CPU).
# Modules expose run(out_dir, *, quick) -> dict (most also take smoke=True: tiny, for tests).
EXPERIMENTS = {
    "generate": ("experiments.generate",
                 "greedy generation from a tiny model; tokens/s (quick: ~10 s)"),
    "capacity": ("experiments.capacity",
                 "lever 1: tokens that fit a KV budget, bf16 vs fp8, local and paper scale "
                 "(quick: ~5 s)"),
    "engine_overhead": ("experiments.engine_overhead",
                        "host overhead per engine step, 64 running requests on SMALL_MLA, "
                        "integrity check on/off (quick: ~25 s)"),
    "kv_dtype": ("experiments.kv_dtype",
                 "lever 1: decode tok/s at concurrency 1-64, bf16 vs fp8 KV at one KV budget, "
                 "OOM points marked (quick: ~40 s)"),
    "weight_quant": ("experiments.weight_quant",
                     "lever 2: decode tok/s vs concurrency and prefill tok/s for dense/FP8/INT4 "
                     "weights; weight memory per device (quick: ~30 s)"),
    "disagg": ("experiments.disagg",
               "lever 3: disaggregated prefill/decode pools vs colocated bf16: throughput, TTFT, "
               "TPOT (quick: ~20 s)"),
    "integrity": ("experiments.integrity",
                  "lever 4: page-tag check on vs off at concurrency 1-8 (paired, interleaved) and "
                  "a fault-injection run (quick: ~40 s)"),
    "prefix_cache": ("experiments.prefix_cache",
                     "radix prefix cache on a shared-system-prompt workload, on vs off: TTFT, "
                     "throughput, prefill tokens saved, hit rate, identical outputs (quick: ~15 s)"),
    "paper": ("experiments.paper",
              "analytic model of the report's Kimi K2.6 and GLM 5.2 deployments on 8x H200: "
              "calibrated, then predicted; and predicted from the steps compiled for 8x H200 with "
              "one fitted launch gap (~5 min)"),
    "h200_compile": ("experiments.h200_compile",
                     "the report's decode and prefill steps compiled for 8x H200 without a GPU: "
                     "per-device weights, KV pool and temporaries from XLA, the largest pool that "
                     "fits, beside the analytic model (quick: Kimi K2.6, ~1.5 min; --full adds "
                     "GLM 5.2, ~20 min)"),
    "kernels": ("experiments.kernels",
                "roofline sheet of every kernel at its target shapes (modelled; ~5 s); on a "
                "GPU also per-kernel time and bandwidth vs references and peers"),
    "accuracy": ("experiments.accuracy",
                 "train MINI_MLA on generated tasks (cached), evaluate every KV x weight recipe "
                 "through the engine and the disaggregated recipe through both pools (not in the "
                 "default suite: training takes ~90 min on a 2-core CPU, once; the --full "
                 "evaluation ~10 min)"),
    "retrieval_learning": ("experiments.retrieval_learning",
                           "why retrieval is not learned: MINI_MLA vs the same width with GQA "
                           "attention, trained from scratch on key->value lookup alone; accuracy "
                           "vs step (not in the default suite: quick ~5 min, --full ~20 min)"),
    "cpu_peer": ("experiments.cpu_peer",
                 "the Engine beside Hugging Face transformers on one 32.6M-param checkpoint, 8 and "
                 "32 requests x 128-token prompts x 64 greedy tokens: tok/s, ratio, identical "
                 "tokens (transformers from $MLKIT_PEER_PYTHON; skipped without it; not in the "
                 "default suite: quick ~1.5 min)"),
    "host_scale": ("experiments.host_scale",
                   "host ms per engine step vs pool pages (1K-200K), running requests (16-256), "
                   "an empty or full prefix cache and requests served; RSS (not in the default "
                   "suite: quick ~1 min with 20K requests served, --full ~2 min with 100K)"),
    "speculative": ("experiments.speculative",
                    "MTP speculative decoding on the MTP-trained MINI_MLA: acceptance length by "
                    "task for k = 1-3, decode tok/s with and without at concurrency 1-32, "
                    "identical greedy outputs; the verify step beside the decode step compiled "
                    "for 8x H200 at Kimi K2.6's shapes (not in the default suite: trains the "
                    "accuracy model first if not cached, ~2 h on 2 cores; then quick ~3 min, "
                    "1 of it compiling)"),
    "serve_http": ("experiments.serve_http",
                   "the same workload through the engine loop, in process through the server's "
                   "engine thread, and through the OpenAI-compatible HTTP API (mlkit.serve.bench) "
                   "on SMALL_MLA and TINY_MLA: output tok/s and TTFT at concurrency 1-32, where "
                   "the added TTFT goes, and TTFT under the same Poisson arrivals both ways (not "
                   "in the default suite: quick ~5 min)"),
    "serve_processes": ("experiments.serve_processes",
                        "prefill and decode as two server processes (mlkit.serve, KV over "
                        "jax.experimental.transfer) vs the in-process DisaggEngine: transfer MB/s, "
                        "added latency and TTFT per prompt length (not in the default suite: "
                        "quick ~30 s)"),
}
DEFAULT_SUITE = ("generate", "capacity", "engine_overhead", "kv_dtype", "weight_quant", "disagg",
                 "integrity", "prefix_cache", "paper", "h200_compile", "kernels")

_OUT = flags.DEFINE_string("out", "results", "Output folder for JSON, markdown and PNG.")
_FULL = flags.DEFINE_bool("full", False, "Run the full-size variant instead of the quick one.")
_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny smoke variant (seconds each; what the tests run).")


def _available(name: str) -> bool:
  try:
    importlib.import_module(EXPERIMENTS[name][0])
    return True
  except ModuleNotFoundError:
    return False


def _usage() -> str:
  lines = ["usage: python -m experiments [name ...] [--out DIR] [--full] [--smoke]", "",
           "experiments:"]
  for name, (_, desc) in EXPERIMENTS.items():
    lines.append(f"  {name:<16} {desc}")
  lines.append(f"\nWith no name, runs: {', '.join(DEFAULT_SUITE)}; then writes <out>/REPORT.md.")
  return "\n".join(lines)


def check_out_dir(out: str) -> str | None:
  """Creates the output directory and proves it writable, before any experiment starts.

  ``os.access`` is no proof (it says yes to root on read-only places), so a probe
  file is created in ``out`` and removed again.

  Args:
    out: the ``--out`` value.

  Returns:
    None if ``out`` is a writable directory (created if missing), else a one-line
    error naming the directory and the cause.
  """
  if not out:
    return "--out is an empty string; give the output directory"
  if os.path.exists(out) and not os.path.isdir(out):
    return f"--out {out}: exists and is not a directory"
  try:
    os.makedirs(out, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=out)
    os.close(fd)
    os.remove(probe)
  except OSError as e:
    cause = e.strerror or str(e)
    if e.filename not in (None, out):
      cause += f": {e.filename}"
    return f"--out {out}: cannot create or write the output directory ({cause})"
  return None


def _run_one(name: str, out: str) -> dict:
  module = importlib.import_module(EXPERIMENTS[name][0])
  kwargs = {"quick": not _FULL.value}
  if _SMOKE.value and "smoke" in inspect.signature(module.run).parameters:
    kwargs["smoke"] = True
  return module.run(out, **kwargs)


def write_report(out: str, done: list[tuple[str, float, str | None]]) -> str:
  """Writes <out>/REPORT.md: the report's figures beside ours, then per experiment its files.

  The comparison table (``mlkit.report.comparison``) comes first; a failure there is
  written into the report instead of losing the per-experiment sections.
  """
  try:
    from mlkit.report import comparison
    opening = comparison.section(out)
  except Exception as e:  # the links below must be written whatever the table does
    traceback.print_exc()
    opening = f"**Comparison table failed:** `{type(e).__name__}: {e}`\n"
  lines = ["# Experiment report", "", "## The report's figures beside ours", "", opening,
           f"Mode: {'smoke' if _SMOKE.value else ('full' if _FULL.value else 'quick')}. "
           "Each section links the experiment's JSON record (machine, backend, jax version and "
           "config beside the numbers), its markdown table and its plots.", ""]
  for name, secs, error in done:
    lines.append(f"## {name} ({secs:.0f} s)\n")
    lines.append(f"{EXPERIMENTS[name][1]}\n")
    if error:
      lines.append(f"**Failed:** `{error}`\n")
    if os.path.exists(os.path.join(out, f"{name}.json")):
      lines.append(f"- data: [{name}.json]({name}.json)")
    if os.path.exists(os.path.join(out, f"{name}.md")):
      lines.append(f"- table: [{name}.md]({name}.md)")
    for f in sorted(os.listdir(out)):
      if f.startswith(name) and f.endswith(".png"):
        lines.append(f"- plot: ![{f}]({f})")
    lines.append("")
  path = os.path.join(out, "REPORT.md")
  with open(path, "w") as f:
    f.write("\n".join(lines))
  return path


def main(argv):
  logging.set_verbosity(logging.WARNING)  # keep backend-probe chatter out of the progress output
  unknown = [n for n in argv[1:] if n not in EXPERIMENTS]
  if unknown:
    print(f"unknown experiment(s): {', '.join(unknown)}\n\n{_usage()}", file=sys.stderr)
    return 2
  out = _OUT.value
  # Before any work (even importing the experiments): a run must not end in a PermissionError.
  error = check_out_dir(out)
  if error:
    print(f"error: {error}", file=sys.stderr)
    return 2
  names = argv[1:] or [n for n in DEFAULT_SUITE if _available(n)]
  done = []
  t_all = time.perf_counter()
  for i, name in enumerate(names, 1):
    print(f"=== [{i}/{len(names)}] {name} ({time.perf_counter() - t_all:.0f} s so far) ===",
          flush=True)
    t0 = time.perf_counter()
    error = None
    try:
      _run_one(name, out)
    except Exception as e:  # one broken experiment must not lose the others' results
      traceback.print_exc()
      error = f"{type(e).__name__}: {e}"
    done.append((name, time.perf_counter() - t0, error))
  path = write_report(out, done)
  print(f"wrote {path} ({time.perf_counter() - t_all:.0f} s in total)")
  failed = [n for n, _, e in done if e]
  if failed:
    print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  if any(a in ("-h", "--help", "help") for a in sys.argv[1:]):
    print(_usage())
    sys.exit(0)
  app.run(main)
