"""The device check's records read back (``scripts/gpu_check.py``, docs/gpu_check.md).

The script writes one JSON object per line as soon as it has it: a ``header``, a
``worker`` per worker process, a ``case`` per kernel case (its impls' checks and
timings), a ``budget`` or ``aborted`` record where the run stopped early, and a
``summary`` last. A run killed mid-write leaves a cut-off last line. A rerun on the
same machine (after a first run stopped at its budget, say) writes a second file
whose cases replace the first's. :func:`read_jsonl` and :func:`read_runs` read both
kinds; the kernels experiment renders what they return, and the step-time model
(``mlkit.plan.step_time``) reads its efficiencies from the cases.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence


def read_jsonl(path: str) -> list[dict]:
  """The records of one gpu_check JSONL file, in file order; a line that does not parse
  (the cut-off last line of a killed run) is skipped."""
  records = []
  with open(path) as f:
    for line in f:
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return records


def read_cases(paths: Sequence[str]) -> list[dict]:
  """The ``case`` records of gpu_check JSONL files, in file order (every run's)."""
  return [r for path in paths for r in read_jsonl(path) if r.get("type") == "case"]


@dataclasses.dataclass(frozen=True)
class Runs:
  """One or more gpu_check runs, merged.

  Attributes:
    paths: the files read, in order.
    cases: one record per case name, the last run's where a case ran twice, ordered
      by when its kept record was written.
    header: the first run's header ({} where none was written).
    summary: the first run's summary, with every run's fp8-vs-bf16 pairs; None
      where no run got as far.
    stops: every ``budget`` and ``aborted`` record.
    workers: every ``worker`` record.
  """

  paths: tuple[str, ...]
  cases: list[dict]
  header: dict
  summary: dict | None
  stops: list[dict]
  workers: list[dict]

  @property
  def measured(self) -> list[dict]:
    """The cases that measure a kernel or a ceiling (not the script's own fault cases)."""
    return [r for r in self.cases if r.get("group") != "fault"]

  @property
  def all_ok(self) -> bool:
    """Something was measured and every measured case is ok."""
    measured = self.measured
    return bool(measured) and all(r["status"] == "ok" for r in measured)


def read_runs(paths: str | Sequence[str]) -> Runs:
  """Reads and merges gpu_check runs (see :class:`Runs`); a partial file is fine."""
  paths = (paths,) if isinstance(paths, str) else tuple(paths)
  by_type: dict[str, list[dict]] = {}
  latest: dict[str, dict] = {}
  for path in paths:
    for r in read_jsonl(path):
      if r.get("type") == "case":
        latest.pop(r.get("name"), None)  # re-inserted: a rerun's case sorts after the first run's
        latest[r.get("name")] = r
      else:
        by_type.setdefault(r.get("type", "?"), []).append(r)
  summaries = by_type.get("summary") or []
  summary = None
  if summaries:
    summary = dict(summaries[0], fp8_vs_bf16=[t for s in summaries
                                               for t in s.get("fp8_vs_bf16") or []])
  return Runs(paths=paths, cases=list(latest.values()),
              header=(by_type.get("header") or [{}])[0], summary=summary,
              stops=by_type.get("budget", []) + by_type.get("aborted", []),
              workers=by_type.get("worker", []))


def wrong_impls(case: dict) -> list[dict]:
  """The impls of a case record whose output failed the reference check."""
  return [p for p in case.get("impls", []) if p.get("correct") is False]


def xla_time(case: dict) -> float | None:
  """The median time of a case's XLA impl, where it was timed."""
  for p in case.get("impls", []):
    if p.get("impl") == "xla" and "timing" in p:
      return p["timing"]["median_s"]
  return None


def best_peer(case: dict) -> tuple[str, float] | None:
  """(name, seconds) of a case's fastest peer whose output was right, None where it has none:
  a peer that returned NaN (the [N, K] INT4 kernels on an H200, say) bounds nothing."""
  wrong = {p["impl"] for p in wrong_impls(case)}
  peers = [(k, v) for k, v in (case.get("peer_time_s") or {}).items() if k not in wrong]
  return min(peers, key=lambda kv: kv[1]) if peers else None


def ceiling_text(case: dict) -> str:
  """What a ``ceiling`` case measured, as text ("4.31 TB/s", "812 TFLOP/s"), or its status
  where it measured nothing."""
  m = case.get("measured") or {}
  if "copy_bytes_per_s" in m:
    return f"{m['copy_bytes_per_s'] / 1e12:.2f} TB/s"
  for k in ("matmul_flops_per_s", "matmul_fp8_flops_per_s"):
    if k in m:
      return f"{m[k] / 1e12:.0f} TFLOP/s"
  return case["status"]
