"""Helpers shared by experiments: result writers, progress, and the engine runs' set-up.

What a result records beside its numbers (``mlkit.measure.machine_info``) and how a
sample is summarised (``mlkit.measure.stats``) are the library's: its cached training
runs record them too, and tests check them without running an experiment.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from typing import Callable, Mapping, Sequence

import jax
import numpy as np

from mlkit.measure import machine_info
from pallas_kernels.tables import markdown_table  # noqa: F401  (experiments call common.markdown_table)


def median_time(fn: Callable[[], object], *, warmup: int = 1, iters: int = 5) -> float:
  """Median wall time in seconds of ``fn`` after warm-up, blocking on its result each run."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def write_json(out_dir: str, name: str, record: dict) -> str:
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, f"{name}.json")
  with open(path, "w") as f:
    json.dump(record, f, indent=2, sort_keys=True, default=str)
  return path


def write_markdown(out_dir: str, name: str, text: str) -> str:
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, f"{name}.md")
  with open(path, "w") as f:
    f.write(text)
  return path


def progress(msg: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- engine runs
# Shared by the engine experiments (kv_dtype, weight_quant, integrity, disagg): the model
# each mode runs, step-level interleaving of variants, and summary statistics.


def local_backend() -> str:
  """The fastest kernel backend here: "pallas" on a GPU, the XLA reference elsewhere."""
  return "pallas" if jax.default_backend() == "gpu" else "xla"


def local_model(quick: bool, smoke: bool = False):
  """The model an engine experiment runs on this machine.

  smoke: TINY_MLA cut to one MoE layer (MLA attention, routed and shared experts: every
  kind of weight the recipes quantise) so tests compile little; quick on CPU: TINY_MLA;
  full on CPU: SMALL_MLA; on a GPU: H200_MLA (Kimi-shaped attention, sized to run the
  curves on one H200 in minutes).
  """
  from configs import H200_MLA, SMALL_MLA, TINY_MLA
  if smoke:
    return dataclasses.replace(TINY_MLA, n_layers=1, first_k_dense=0)
  if jax.default_backend() == "gpu":
    return H200_MLA
  return TINY_MLA if quick else SMALL_MLA


@dataclasses.dataclass
class StepLog:
  """What one engine did in each step of an interleaved run (wall seconds per step)."""

  seconds: list = dataclasses.field(default_factory=list)
  # Tokens emitted by the step.
  tokens: list = dataclasses.field(default_factory=list)
  # Whether the step ran a prefill chunk (else it was decode-only).
  prefill: list = dataclasses.field(default_factory=list)
  # Requests decoding or prefilling after the step.
  running: list = dataclasses.field(default_factory=list)

  def decode_only(self, min_running: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(seconds, tokens) of the decode-only steps that ran at least ``min_running`` rows."""
    s, t = np.asarray(self.seconds), np.asarray(self.tokens)
    keep = ~np.asarray(self.prefill, bool) & (t >= max(min_running, 1))
    return s[keep], t[keep]


def step_interleaved(engines: Mapping[str, object], *, max_steps: int = 100_000,
                     on_step: Callable[[int], None] | None = None) -> dict[str, StepLog]:
  """Steps every engine in turn, one step each per round, until all are done.

  Alternating step by step makes the variants share the machine's load, so their
  ratio is trustworthy even when absolute CPU times drift.

  Args:
    engines: name -> an ``Engine`` with requests submitted.
    max_steps: rounds before giving up (raises RuntimeError).
    on_step: called with the round number after every round (progress).

  Returns:
    name -> StepLog.
  """
  logs = {n: StepLog() for n in engines}
  for i in range(max_steps):
    live = [(n, e) for n, e in engines.items() if e.has_unfinished()]
    if not live:
      return logs
    for name, eng in live:
      before_prefill, before_tok = eng.stats.prefill_steps, eng.stats.generated_tokens
      t0 = time.perf_counter()
      eng.step()
      dt = time.perf_counter() - t0
      log = logs[name]
      log.seconds.append(dt)
      log.tokens.append(eng.stats.generated_tokens - before_tok)
      log.prefill.append(eng.stats.prefill_steps > before_prefill)
      log.running.append(len(eng.running_ids()))
    if on_step is not None:
      on_step(i)
  raise RuntimeError(f"step_interleaved: engines still busy after {max_steps} rounds")


def plot_lines(path: str, series: Mapping[str, tuple[Sequence, Sequence]], *, xlabel: str,
               ylabel: str, title: str, marks: Mapping[str, Sequence] | None = None,
               logx: bool = False, reference: Mapping[str, tuple[Sequence, Sequence]] | None = None
               ) -> str:
  """One PNG line plot (matplotlib Agg).

  Args:
    path: output file.
    series: label -> (xs, ys); None ys are skipped.
    marks: label -> xs to mark with a red "x" at the bottom (e.g. out-of-memory points).
    reference: label -> (xs, ys) drawn dashed (e.g. the report's figures).

  Returns:
    The path written.
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  for label, (xs, ys) in series.items():
    pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
    if pts:
      ax.plot(*zip(*pts), marker="o", label=label)
  for label, (xs, ys) in (reference or {}).items():
    pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
    if pts:
      ax.plot(*zip(*pts), linestyle="--", marker=".", label=label)
  first_mark = True
  for label, xs in (marks or {}).items():
    if len(xs):
      ax.scatter(list(xs), [0] * len(xs), marker="x", color="red", s=80, zorder=5,
                 label="out of memory" if first_mark else None)
      ax.annotate(f"{label}: OOM", (list(xs)[0], 0), textcoords="offset points", xytext=(4, 8),
                  fontsize=8, color="red")
      first_mark = False
  if logx:
    ax.set_xscale("log", base=2)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=10)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def record_header(name: str, *, quick: bool, smoke: bool, config: dict) -> dict:
  """The fields every experiment's JSON starts with: name, mode, machine, backend, config."""
  return {"experiment": name, "mode": "smoke" if smoke else ("quick" if quick else "full"),
          "machine": machine_info(), "kernel_backend": local_backend(), "config": config}
