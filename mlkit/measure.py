"""What a measurement records beside its numbers, and how a sample of them is summarised.

A number without the machine, backend and versions that produced it cannot be
compared with another (docs/measuring.md), so every result file, and the cached
training runs of ``mlkit.evals.setups``, carries :func:`machine_info`. Timings on a
shared CPU are noisy, so samples are summarised by their median and spread
(:func:`stats`), never by one run.
"""

from __future__ import annotations

import os
import platform
import time
from typing import Sequence

import jax
import numpy as np


def machine_info() -> dict:
  """What ran the measurement: host, backend, devices and versions."""
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


def stats(xs: Sequence[float]) -> dict:
  """{median, min, max, p95, n} of a sample (None fields when empty)."""
  if len(xs) == 0:
    return {"median": None, "min": None, "max": None, "p95": None, "n": 0}
  a = np.asarray(xs, np.float64)
  return {"median": float(np.median(a)), "min": float(a.min()), "max": float(a.max()),
          "p95": float(np.percentile(a, 95)), "n": int(a.size)}


def median_range(s: dict, digits: int = 1) -> str:
  """A :func:`stats` summary as a table cell: "median [min, max]" with ``digits`` decimals
  and thousands separators; "-" for an empty sample."""
  if s["median"] is None:
    return "-"
  return f"{s['median']:,.{digits}f} [{s['min']:,.{digits}f}, {s['max']:,.{digits}f}]"
