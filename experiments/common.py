"""Helpers shared by experiments: run metadata, timing, and result writers."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Callable, Sequence

import jax


def machine_info() -> dict:
  """What ran the experiment: host, backend, devices and versions."""
  devs = jax.devices()
  return {
      "host": platform.node(),
      "platform": platform.platform(),
      "python": platform.python_version(),
      "cpu_count": os.cpu_count(),
      "backend": jax.default_backend(),
      "device_kind": devs[0].device_kind,
      "device_count": len(devs),
      "jax": jax.__version__,
      "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else jax.__version__,
      "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
  }


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


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
  def fmt(v):
    if isinstance(v, float):
      return f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return f"{v:,}" if isinstance(v, int) else str(v)
  lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
  lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
  return "\n".join(lines) + "\n"


def write_markdown(out_dir: str, name: str, text: str) -> str:
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, f"{name}.md")
  with open(path, "w") as f:
    f.write(text)
  return path


def progress(msg: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)
