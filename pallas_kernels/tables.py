"""Markdown tables for the kernels' readings and sheets.

The compile readings (``pallas_kernels.h200.kernel_readings``) and the roofline
sheet (``pallas_kernels.roofline``) render themselves as markdown, which the tests
read and the ``kernels`` experiment writes into its report beside tables of its own.
pallas_kernels sits below ``experiments``, so it cannot use the experiments'
``common.markdown_table``; this one formats cells the same way, so the report's
tables read alike whichever side drew them.
"""

from __future__ import annotations

from typing import Sequence


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
  """A markdown table: floats to 3 significant digits (whole above 1000), ints with
  thousands separators, anything else as ``str``."""
  def fmt(v):
    if isinstance(v, float):
      return f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return f"{v:,}" if isinstance(v, int) else str(v)
  lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
  lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
  return "\n".join(lines) + "\n"
