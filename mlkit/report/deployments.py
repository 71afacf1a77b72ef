"""The report's two deployments on 8x H200, the request shapes of their sweeps, their capacity.

The analytic model (``python -m experiments paper``) and the serving steps compiled for
8x H200 (``mlkit.plan.step_compile``) model the same deployments serving the same
requests, so they are defined here once, with the arithmetic on them that needs no
sweep: the KV capacity each lever leaves (:func:`capacity`) and the analytic model's
factors fitted to a reported decode column (:func:`fit_factors`).
"""

from __future__ import annotations

from configs import GLM_5_2, H200, KIMI_K2_6
from mlkit import perfmodel as pm
from mlkit.quant import FP8_ALL, GIB, INT4_EXPERTS
from mlkit.report.figures import CONCURRENCY

# As they ship: Kimi with INT4 experts, GLM with fp8 weights; both with a bf16 KV cache.
KIMI = pm.Deployment("kimi-k2.6 int4 weights, bf16 KV", KIMI_K2_6, INT4_EXPERTS, "bfloat16", H200)
GLM = pm.Deployment("glm-5.2 fp8 weights, bf16 KV", GLM_5_2, FP8_ALL, "bfloat16", H200)
# Request shapes of the two sweeps. The report does not state them; its own outcomes bound
# them. Kimi: bf16 ran 32 requests but not 64, so a request holds between 686K/64 = 10.7K
# and 686K/32 = 21.4K tokens; we take 8192 in + 8192 out (16K). GLM: 64 requests ran with
# fp8 weights, so (bf16 KV, ~252K tokens) a request holds at most ~3.9K; we take 2048 + 1024.
KIMI_WORK = pm.Workload(8192, 8192)
GLM_WORK = pm.Workload(2048, 1024)
# Each deployment as it ships and with the levers applied (fp8 KV; INT4 weights and fp8 KV).
LEVERS = {
    "kimi bf16 KV": KIMI,
    "kimi fp8 KV": KIMI.replace(name="kimi-k2.6 int4 weights, fp8 KV", kv_dtype="float8_e4m3fn"),
    "glm fp8 weights, bf16 KV": GLM,
    "glm fp8 weights, fp8 KV": GLM.replace(name="glm-5.2 fp8 weights, fp8 KV",
                                           kv_dtype="float8_e4m3fn"),
    "glm int4 weights, fp8 KV": GLM.replace(name="glm-5.2 int4 weights, fp8 KV",
                                            recipe=INT4_EXPERTS, kv_dtype="float8_e4m3fn"),
}


def work_for(dep: pm.Deployment) -> pm.Workload:
  """The request shape of ``dep``'s model's sweep."""
  return KIMI_WORK if dep.model is KIMI_K2_6 else GLM_WORK


def capacity(deps: dict[str, pm.Deployment], fraction: float) -> dict[str, dict]:
  """Per deployment: weights per GPU (GiB), the KV budget the static ``fraction`` of HBM
  leaves beside them (GB), bytes per token, tokens, and requests of its sweep's shape."""
  out = {}
  for key, dep in deps.items():
    budget = pm.kv_budget(dep, fraction)
    cap = pm.capacity(dep, budget)
    out[key] = {"weights_per_gpu_gib": pm.weight_split(dep)["per_gpu"] / GIB,
                "kv_budget_gb": budget / 1e9, "bytes_per_token": cap["bytes_per_token"],
                "tokens": cap["tokens"],
                "max_concurrency": pm.max_concurrency(dep, budget, work_for(dep))}
  return out


def fit_factors(dep: pm.Deployment, reported: dict, work: pm.Workload,
                a: pm.Assumptions = pm.Assumptions()) -> dict[str, dict]:
  """Each of the analytic model's factors (``mlkit.perfmodel.FACTORS``) fitted alone to a
  reported decode column {concurrency: tok/s, or None where it ran out of memory}.

  Returns:
    {factor: {"value", "max_abs_error" (relative, over the reported points), "curve"
    ({concurrency: modelled tok/s} over the report's sweep)}}.
  """
  fits = {}
  for factor in pm.FACTORS:
    value = pm.calibrate(dep, reported, work, factor=factor, a=a)
    curve = {c: pm.decode_throughput(dep, c, work, **{factor: value}) for c in CONCURRENCY}
    errs = [abs(curve[c] / v - 1) for c, v in reported.items() if v]
    fits[factor] = {"value": value, "max_abs_error": max(errs), "curve": curve}
  return fits
