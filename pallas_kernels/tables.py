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


def cell(v: object) -> str:
  """One table cell: a float to 3 significant digits (whole from 1000 up), an int with
  thousands separators, None (not measured) as "-", anything else as ``str``."""
  if v is None:
    return "-"
  if isinstance(v, float):
    return f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"
  return f"{v:,}" if isinstance(v, int) else str(v)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
  """A markdown table whose cells are formatted by :func:`cell`."""
  lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
  lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
  return "\n".join(lines) + "\n"
