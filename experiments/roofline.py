"""The roofline plots the ``kernels`` experiment writes.

The sheet itself (bytes, FLOPs, the H200 bound, the design's time and the targets
per target case) is arithmetic on the kernels' cost models and lives beside them,
in ``pallas_kernels.roofline``; drawing it and the measured cases against it is
this experiment's part, like every file it writes (matplotlib is the ``plots``
extra, which pallas_kernels does not need):

* :func:`plot`: the sheet, roofline time per case by kernel, with the targets and
  the times ``gpu_check`` measured (``kernels_roofline.png``);
* :func:`plot_measured`: each measured target case's fraction of its roofline, the
  Pallas kernel beside XLA and the peers (``kernels.png``).
"""

from __future__ import annotations


def plot(sheet: list[dict], path: str) -> None:
  """Roofline time per case (bars, log scale) by kernel; measured times as dots."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  kernels = list(dict.fromkeys(r["kernel"] for r in sheet))
  fig, axes = plt.subplots(1, len(kernels), figsize=(4 * len(kernels), 5), squeeze=False)
  for ax, kernel in zip(axes[0], kernels):
    part = [r for r in sheet if r["kernel"] == kernel]
    xs = range(len(part))
    ax.bar(xs, [r["roofline_s"] * 1e6 for r in part], color="tab:gray", label="roofline")
    tx = [(i, r["target_s"] * 1e6) for i, r in enumerate(part) if r["target_s"]]
    if tx:
      ax.plot(*zip(*tx), "g_", markersize=8, label="target")
    mx = [(i, r["time_s"] * 1e6) for i, r in enumerate(part) if r["time_s"]]
    if mx:
      ax.plot(*zip(*mx), "r.", label="measured")
    ax.set_yscale("log")
    ax.set_title(kernel, fontsize=9)
    ax.set_xlabel("target case")
    ax.set_ylabel("us per call")
    ax.legend(fontsize=7)
  fig.suptitle("H200 roofline per target case (modelled; measured where gpu_check ran)")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def plot_measured(cases: list[dict], path: str) -> None:
  """Fraction of the roofline per case: the kernel as bars, XLA and peers as markers."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rs = [r for r in cases if r.get("group") == "target"]
  fig, ax = plt.subplots(figsize=(9, max(3.0, 0.22 * len(rs) + 1)))
  for i, r in enumerate(rs):
    ok = r["status"] == "ok"
    if r.get("roofline_fraction"):
      ax.barh(i, r["roofline_fraction"], color="tab:green" if ok else "tab:red")
    for p in r.get("impls", []):
      if p.get("impl") != "pallas" and p.get("roofline_fraction"):
        ax.plot(p["roofline_fraction"], i, "k|" if p["impl"] == "xla" else "b.", markersize=6)
  ax.set_yticks(range(len(rs)), [f"{r['name']} ({r['status']})"[:58] for r in rs], fontsize=6)
  ax.invert_yaxis()
  ax.set_xscale("log")
  ax.axvline(1.0, color="k", linestyle="--", linewidth=0.8)
  ax.set_xlabel("roofline / time (bar: Pallas kernel; |: XLA; dot: peers)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
