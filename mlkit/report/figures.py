"""The report's figures, written down once (docs/report.md).

The analytic model (``python -m experiments paper``), the serving steps compiled for
8x H200 (``mlkit.plan``) and REPORT.md's comparison table (``mlkit.report.comparison``)
all compare against these numbers; a copy per user drifted. Plain numbers, no imports,
so the comparison table stays free of jax.
"""

# The concurrencies of the report's decode sweeps.
CONCURRENCY = (1, 8, 16, 32, 64)
# Kimi K2.6 decode tok/s with a bf16 KV cache, by concurrency; at REPORT_KIMI_BF16_OOM it
# ran out of memory (no figure).
REPORT_KIMI_BF16 = {1: 137, 8: 731, 16: 1106, 32: 1558}
REPORT_KIMI_BF16_OOM = 64
# GLM 5.2 decode tok/s with fp8 weights (bf16 KV), by concurrency.
REPORT_GLM_FP8 = {1: 60, 8: 425, 16: 683, 32: 994, 64: 1672}
# Kimi K2.6 KV tokens per H200, by KV dtype.
REPORT_KIMI_TOKENS = {"bfloat16": 686_000, "float8_e4m3fn": 1_370_000}
# GLM 5.2 weights per GPU at TP 8, by weight recipe (``mlkit.quant`` recipe names): binary
# GiB, its totals (705 and 421 GiB) / 8.
REPORT_GLM_PER_GPU_GIB = {"fp8-all": 88, "int4-experts-g32": 52}
# The KV bytes per H200 that the 686K-token figure implies.
REPORT_KV_BUDGET = 48 * 10**9
