"""capacity: tokens that fit a fixed KV byte budget, bf16 vs fp8 pages (lever 1).

Measured part: on the local device, size a paged pool to the budget with
``mlkit.kvcache.capacity``, actually allocate it, and count its bytes
(``mlkit.kvcache.allocate_within``). The
measured model is H200_MLA, whose cache entry is Kimi's (512 latent + 64 rope per
layer): the fp8 pool's per-token f32 scales (8 bytes per layer) are then 1.4% of
its size, as they are for Kimi. The tiny presets' entries are so small (40 and
144 values) that the same 8 bytes cap their ratio at 1.67 and 1.89; the quick
run records SMALL_MLA beside it to show that. H200_GLM is the same widths with
GLM 5's sparse-attention indexer on every layer: its pool pages 128 index-key
values per token and layer beside the latent (fp8: plus one more f32 scale).

Paper-scale part (``mlkit.plan.kv_tokens``): bytes per token and tokens per GPU for
KIMI_K2_6 and GLM_5_2 with 48 GB of KV space per H200 (docs/report.md), next to the
report's figures, and per weight recipe.
"""

from __future__ import annotations

import os

import jax

from configs import GLM_5_2, H200_GLM, H200_MLA, KIMI_K2_6, SMALL_MLA
from experiments import common
from mlkit import kvcache as kvc
from mlkit.measure import machine_info
from mlkit.plan import kv_tokens
from mlkit.report.figures import REPORT_KIMI_TOKENS, REPORT_KV_BUDGET

DTYPES = kv_tokens.DTYPES
PAGE_SIZE = kv_tokens.PAGE_SIZE
MIN_RATIO = 1.95


def _plot(path: str, measured: list[dict], paper: list[dict]) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  ax = axes[0]
  labels = sorted({r["model"] for r in measured})
  width = 0.38
  for i, dtype in enumerate(DTYPES):
    vals = [next(r["tokens"] for r in measured if r["model"] == m and r["dtype"] == dtype)
            for m in labels]
    ax.bar([j + (i - 0.5) * width for j in range(len(labels))], vals, width, label=dtype)
  ax.set_xticks(range(len(labels)), labels)
  ax.set_ylabel("tokens in budget")
  ax.set_title(f"measured on {jax.default_backend()} ({measured[0]['budget_bytes'] / 2**20:.0f} MiB)")
  ax.legend()
  ax = axes[1]
  models = [KIMI_K2_6.name, GLM_5_2.name]
  for i, dtype in enumerate(DTYPES):
    vals = [next(r["tokens_per_gpu"] for r in paper if r["model"] == m and r["dtype"] == dtype) / 1e6
            for m in models]
    ax.bar([j + (i - 0.5) * width for j in range(len(models))], vals, width, label=f"ours {dtype}")
  ax.scatter([-0.5 * width, 0.5 * width], [REPORT_KIMI_TOKENS[d] / 1e6 for d in DTYPES], color="k",
             marker="x", zorder=3, label="report (Kimi)")
  ax.set_xticks(range(len(models)), models)
  ax.set_ylabel("million tokens per H200 (48 GB KV)")
  ax.set_title("paper scale, per GPU")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run(out_dir: str, *, quick: bool = True) -> dict:
  """Measures tokens per budget (bf16 vs fp8) and computes paper-scale capacity.

  Args:
    out_dir: folder for capacity.json, capacity.md and capacity.png.
    quick: a 64 MiB budget (CPU friendly) instead of 1 GiB.

  Returns:
    The record written to capacity.json; ``ratio`` is the measured fp8/bf16 token ratio
    for H200_MLA and ``ratio_ok`` whether it reaches 1.95.
  """
  budget = (64 if quick else 1024) * 2**20
  common.progress(f"capacity: allocating pools inside {budget / 2**20:.0f} MiB on "
                  f"{jax.default_backend()}")
  measured = [kvc.allocate_within(cfg, dtype, budget, page_size=PAGE_SIZE)
              for cfg in (H200_MLA, H200_GLM, SMALL_MLA) for dtype in DTYPES]
  tok = {(r["model"], r["dtype"]): r["tokens"] for r in measured}
  ratio = tok[(H200_MLA.name, "float8_e4m3fn")] / tok[(H200_MLA.name, "bfloat16")]
  glm_ratio = tok[(H200_GLM.name, "float8_e4m3fn")] / tok[(H200_GLM.name, "bfloat16")]
  small_ratio = tok[(SMALL_MLA.name, "float8_e4m3fn")] / tok[(SMALL_MLA.name, "bfloat16")]
  paper = kv_tokens.tokens_by_dtype(KIMI_K2_6) + kv_tokens.tokens_by_dtype(GLM_5_2)
  by_recipe = kv_tokens.tokens_by_recipe()
  kimi = {r["dtype"]: r["tokens_per_gpu"] for r in paper if r["model"] == KIMI_K2_6.name}
  record = {
      "experiment": "capacity",
      "machine": machine_info(),
      "config": {"measured_model": H200_MLA.to_dict(),
                 "also_measured": [H200_GLM.name, SMALL_MLA.name],
                 "page_size": PAGE_SIZE, "budget_bytes": budget, "paper_budget_bytes": REPORT_KV_BUDGET,
                 "paper_tp": kv_tokens.TP,
                 "glm_indexer": "paged: every layer, the pool's dtype (fp8: + f32 scale)"},
      "measured": measured,
      "ratio": ratio,
      "ratio_ok": ratio >= MIN_RATIO,
      "glm_layout_ratio": glm_ratio,
      "small_mla_ratio": small_ratio,
      "paper": paper,
      "paper_by_recipe": by_recipe,
      "kimi_ratio": kimi["float8_e4m3fn"] / kimi["bfloat16"],
  }
  os.makedirs(out_dir, exist_ok=True)
  common.write_json(out_dir, "capacity", record)
  _plot(os.path.join(out_dir, "capacity.png"), measured, paper)
  md = [
      "# capacity\n",
      f"Tokens that fit a {budget / 2**20:.0f} MiB KV budget on `{record['machine']['device_kind']}` "
      f"(pools really allocated; page size {PAGE_SIZE}).\n\n",
      common.markdown_table(
          ["model", "dtype", "B/token", "pages", "tokens", "allocated B"],
          [[r["model"], r["dtype"], r["bytes_per_token"], r["pages"], r["tokens"],
            r["allocated_bytes"]] for r in measured]),
      f"\nfp8/bf16 ratio: **{ratio:.3f}** for {H200_MLA.name} (Kimi's 512+64 entry; target >= "
      f"{MIN_RATIO}); {glm_ratio:.3f} for {H200_GLM.name} (the same entry plus GLM 5's 128 "
      f"index-key values, paged in the pool's dtype); {small_ratio:.3f} for {SMALL_MLA.name}, "
      "whose 144-value entry makes the 8 B/layer of f32 scales a larger share.\n",
      "\n## Paper scale (per H200, 48 GB of KV, TP 8: the MLA latent is replicated per rank)\n\n",
      common.markdown_table(
          ["model", "dtype", "B/token", "values", "scales", "indexer", "tokens/GPU", "report"],
          [[r["model"], r["dtype"], r["bytes_per_token"], r["value_bytes"], r["scale_bytes"],
            r["indexer_bytes"], r["tokens_per_gpu"],
            "-" if r["report_tokens"] is None else f"~{r['report_tokens']:,}"] for r in paper]),
      "\nThe report's 1.37M fp8 figure divides the budget by 35,136 B/token (no scales); our "
      "per-token scales add 488 B/token for Kimi, hence 1.35M. GLM's indexer keys are counted "
      "from the paged pool's layout: 128 values per token on each of its 78 layers (all run "
      "the indexer), in the pool's dtype, plus one f32 scale per token in fp8.\n",
      "\n## Paper scale by weight recipe (per H200, TP 8)\n\n"
      f"KV budget = {by_recipe[0]['static_memory_fraction']:.4f} of HBM (the fraction that gives "
      "Kimi with INT4 experts its 48 GB of KV) minus the recipe's weights per GPU.\n\n",
      common.markdown_table(
          ["model", "weights", "KV dtype", "weights GiB/GPU", "KV budget GB", "tokens/GPU"],
          [[r["model"], r["recipe"], r["kv_dtype"], r["weights_per_gpu_gib"], r["kv_budget_gb"],
            r["tokens_per_gpu"]] for r in by_recipe]),
      "\n![capacity](capacity.png)\n",
  ]
  common.write_markdown(out_dir, "capacity", "".join(md))
  print(f"capacity: fp8/bf16 token ratio {ratio:.3f} ({H200_MLA.name}, {budget / 2**20:.0f} MiB); "
        f"Kimi per GPU: {kimi['bfloat16']:,} bf16 vs {kimi['float8_e4m3fn']:,} fp8 tokens "
        f"(report ~686K vs ~1.37M)")
  return record
