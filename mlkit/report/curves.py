"""The paper experiment's plot: the report's decode columns beside both models' curves."""

from __future__ import annotations


def decode_curves(path: str, columns: list[dict], compiled: list[dict]) -> None:
  """paper.png: decode tok/s against concurrency on 8x H200, Kimi K2.6 and GLM 5.2 side by side.

  Args:
    path: the PNG to write.
    columns: the analytic model's points (paper.json "columns": column, concurrency,
      predicted_tok_s, report_tok_s, predicted_oom).
    compiled: the compiled-program model's rows (paper.json "compiled.rows": column, rows,
      tok_s).
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for ax, (model, cols) in zip(axes, (("Kimi K2.6 (INT4 weights)", ("kimi bf16 KV", "kimi fp8 KV")),
                                      ("GLM 5.2 (bf16 KV)", ("glm fp8 weights", "glm int4 weights")))):
    for col in cols:
      rows = [r for r in columns if r["column"] == col]
      pts = [(r["concurrency"], r["predicted_tok_s"]) for r in rows if r["predicted_tok_s"]]
      ax.plot(*zip(*pts), marker="o", label=f"model: {col}")
      prog = [(r["rows"], r["tok_s"]) for r in compiled if r["column"] == col]
      if prog:
        ax.plot(*zip(*prog), marker="^", linestyle=":", label=f"compiled program: {col}")
      rep = [(r["concurrency"], r["report_tok_s"]) for r in rows
             if isinstance(r["report_tok_s"], (int, float))]
      if rep:
        ax.plot(*zip(*rep), linestyle="--", marker="s", color="k", label=f"report: {col}")
      oom = [r["concurrency"] for r in rows if r["predicted_oom"]]
      if oom:
        ax.scatter(oom, [0] * len(oom), marker="x", color="red", s=80, zorder=5,
                   label=f"model OOM: {col}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("decode tok/s (8x H200)")
    ax.set_title(model, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
