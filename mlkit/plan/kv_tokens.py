"""KV tokens per H200 at the report's scale: by KV dtype, and by weight recipe x KV dtype.

Pure arithmetic from the model shapes (``mlkit.kvcache``, ``mlkit.perfmodel``), at
tensor parallelism 8, where MLA's latent is replicated on every rank, so the tokens
per GPU are the deployment's. By dtype: a fixed 48 GB of KV per H200, the budget the
report's 686K-token figure implies. By recipe: what the static HBM fraction leaves
beside the recipe's weights, the fraction being the one that gives Kimi (INT4
experts) its 48 GB, so that lever 1 (fp8 KV) and lever 2 (INT4 weights) compose.
"""

from __future__ import annotations

from configs import GLM_5_2, H200, KIMI_K2_6
from mlkit import kvcache as kvc
from mlkit import perfmodel as pm
from mlkit.config import ModelConfig
from mlkit.quant import FP8_ALL, INT4_EXPERTS
from mlkit.report.figures import REPORT_KIMI_TOKENS, REPORT_KV_BUDGET

DTYPES = ("bfloat16", "float8_e4m3fn")
PAGE_SIZE = 64
TP = 8


def tokens_by_dtype(cfg: ModelConfig, budget: int = REPORT_KV_BUDGET) -> list[dict]:
  """Per KV dtype: bytes per token (values, scales, indexer keys) and tokens in ``budget``.

  Returns:
    One row per dtype: {model, dtype, bytes_per_token, value_bytes, scale_bytes,
    indexer_bytes, tokens_per_gpu, report_tokens (Kimi K2.6's figure, else None)}.
  """
  rows = []
  for dtype in DTYPES:
    bd = kvc.bytes_per_token_breakdown(cfg, dtype, tp=TP)
    cap = kvc.capacity(cfg, dtype, budget, page_size=PAGE_SIZE, tp=TP)
    rows.append({"model": cfg.name, "dtype": dtype, "bytes_per_token": bd["total"],
                 "value_bytes": bd["values"], "scale_bytes": bd["scales"],
                 "indexer_bytes": bd["indexer"], "tokens_per_gpu": cap["tokens"],
                 "report_tokens": REPORT_KIMI_TOKENS[dtype] if cfg is KIMI_K2_6 else None})
  return rows


def tokens_by_recipe() -> list[dict]:
  """Tokens per H200 for Kimi K2.6 and GLM 5.2, each weight recipe x KV dtype (lever 1 x 2).

  Returns:
    One row per model x recipe x dtype: {model, recipe, kv_dtype, weights_per_gpu_gib,
    kv_budget_gb, tokens_per_gpu (0 where the weights alone overflow the static fraction),
    static_memory_fraction}.
  """
  kimi = pm.Deployment("kimi", KIMI_K2_6, INT4_EXPERTS, "bfloat16", H200)
  frac = pm.static_memory_fraction(kimi)
  rows = []
  for cfg in (KIMI_K2_6, GLM_5_2):
    for recipe in (FP8_ALL, INT4_EXPERTS):
      for dtype in DTYPES:
        dep = pm.Deployment(f"{cfg.name} {recipe.name} {dtype}", cfg, recipe, dtype, H200)
        budget = pm.kv_budget(dep, frac)
        tokens = pm.capacity(dep, budget)["tokens"] if budget > 0 else 0
        rows.append({"model": cfg.name, "recipe": recipe.name, "kv_dtype": dtype,
                     "weights_per_gpu_gib": pm.weight_split(dep)["per_gpu"] / 2**30,
                     "kv_budget_gb": budget / 1e9, "tokens_per_gpu": tokens,
                     "static_memory_fraction": frac})
  return rows
