"""Memory per H200 of the compiled serving steps: depth fits, the largest KV pool, one row each.

Reads the compile records of ``mlkit.plan.step_compile`` as a deployment sizes its
pool. Every per-device figure XLA reports is fitted as a line in the MoE-layer
count (the residual is kept: memory must be linear in depth) and read at the full
depth (:func:`fit_depth`). A static fraction of HBM (SGLang's mem_fraction_static;
here the analytic model's, which gives Kimi the report's 48 GB of KV) holds weights
+ KV; the rest is for the step's temporaries. The largest pool is the smaller of
what the static fraction leaves and what HBM leaves beside the temporaries
(:func:`deployment_row`), set beside the analytic model (``mlkit.perfmodel``); the
decode step compiled with a pool for the sweep's top concurrency says whether a
deployment can serve it at all.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from configs import H200
from mlkit import kvcache as kvc
from mlkit import perfmodel as pm
from mlkit.parallel import AXES
from mlkit.plan.step_compile import (FIELDS, MESH_SHAPE, PAGE_SIZE, Plan, Variant,
                                     pages_per_request)


def fit_depth(points: list[tuple[int, float]], at: int) -> dict:
  """A line through (MoE layers, bytes) points, and its reading at ``at`` MoE layers.

  The least-squares line and its largest residual test linearity. The full-depth
  reading extends the deepest two points (their slope, from the deepest point):
  the first MoE layer can add one-off buffers that a least-squares line would
  multiply by the depth, while the increment between the deepest layers is what
  every further layer adds. On a straight line the two agree.

  Args:
    points: (n_moe, value) pairs, at least one; a single point is taken as constant.
    at: the MoE-layer count to read at (the full depth).

  Returns:
    {"intercept", "slope" (least squares, per MoE layer), "max_residual" (largest
     |value - line| over the points; 0 with two points, which any line fits),
     "marginal_slope" (between the deepest two points), "at_full", "points"}.

  Raises:
    ValueError: on no points.
  """
  if not points:
    raise ValueError("fit_depth: no points")
  pts = sorted((int(a), float(b)) for a, b in points)
  x = np.asarray([p[0] for p in pts], np.float64)
  y = np.asarray([p[1] for p in pts], np.float64)
  if len(set(x.tolist())) < 2:
    slope, intercept, marginal = 0.0, float(np.mean(y)), 0.0
    at_full = intercept
  else:
    slope, intercept = (float(c) for c in np.polyfit(x, y, 1))
    marginal = float((y[-1] - y[-2]) / (x[-1] - x[-2]))
    at_full = float(y[-1] + marginal * (at - x[-1]))
  resid = float(np.max(np.abs(y - (intercept + slope * x))))
  return {"intercept": intercept, "slope": slope, "max_residual": resid,
          "marginal_slope": marginal, "at_full": at_full, "points": [list(p) for p in pts]}


def fit_series(records: list[dict], n_moe_full: int) -> dict:
  """Fits every memory field and the kernel count of one (variant, KV dtype, kind) series
  over its depths."""
  fits = {}
  for f in FIELDS + ("peak", "weights", "kv", "launches"):
    fits[f] = fit_depth([(r["n_moe"], r[f]) for r in records], n_moe_full)
  return fits


def analytic_row(v: Variant, kv_dtype: str, plan: Plan) -> dict:
  """The analytic model's figures for one deployment (``mlkit.perfmodel``), per GPU."""
  hardware = dataclasses.replace(H200, hbm_bytes=plan.hbm_bytes)
  dep = pm.Deployment(v.key, v.model, v.recipe, kv_dtype, hardware)
  budget = pm.kv_budget(dep, plan.static_fraction)
  tokens = pm.capacity(dep, budget)["tokens"] if budget > 0 else 0
  return {"weights": pm.weight_split(dep)["per_gpu"], "pool": budget, "tokens": tokens,
          "concurrency": tokens // v.work.footprint}


def deployment_row(v: Variant, kv_dtype: str, plan: Plan, fits: dict, served: int,
                   unserved: dict) -> dict:
  """One table row: compiled (extrapolated) memory, pool sizing and fit, next to the model.

  Args:
    v, kv_dtype, plan: the deployment.
    fits: {kind: fit_series(...)} of its compiled series.
    served: per-device bytes of the served weights at full depth (exact).
    unserved: ``unserved_weight_bytes`` (loaded, never instantiated here).
  """
  cfg = v.model
  resident = served + unserved["bytes"]
  # XLA's own figure for the served weights at full depth: its fitted argument bytes less
  # the (exact) pool and batch inputs; equal to ``served`` when every compile matched.
  first = fits[next(iter(fits))]
  inputs = first["argument"]["points"][0][1] - first["weights"]["points"][0][1] - \
      first["kv"]["points"][0][1]
  weights_xla = first["argument"]["at_full"] - first["kv"]["at_full"] - inputs
  bpt = kvc.bytes_per_token(cfg, kv_dtype, tp=MESH_SHAPE[1])
  temps = {k: fits[k]["temp"]["at_full"] for k in fits}
  launches = {k: round(fits[k]["launches"]["at_full"]) for k in fits}
  # Output buffers the step does not alias onto its inputs (sampled tokens, ok flags).
  extra_out = {k: fits[k]["output"]["at_full"] - fits[k]["alias"]["at_full"] for k in fits}
  reserve = max(temps[k] + extra_out[k] for k in fits)
  static_pool = plan.static_pool(resident)
  largest_pool = min(static_pool, plan.hbm_bytes - resident - reserve)
  cap = kvc.capacity(cfg, kv_dtype, max(0, int(largest_pool)), page_size=PAGE_SIZE,
                     tp=MESH_SHAPE[1])
  per_req = pages_per_request(v.work)
  row = {"variant": v.key, "model": cfg.name, "recipe": v.recipe.name, "kv_dtype": kv_dtype,
         "weights_xla": weights_xla, "weights_served": served, "weights_unserved": unserved,
         "weights_resident": resident,
         "bytes_per_token": bpt, "temp": temps, "launches": launches, "reserve": reserve,
         "reserve_allowed": (1 - plan.static_fraction) * plan.hbm_bytes,
         "static_pool": static_pool, "largest_pool": largest_pool,
         "temps_fit_reserve": reserve <= (1 - plan.static_fraction) * plan.hbm_bytes,
         "tokens": cap["tokens"], "concurrency": cap["pages"] // per_req,
         "analytic": analytic_row(v, kv_dtype, plan)}
  if cfg.index_head_dim:
    # The indexer's key cache is in bytes_per_token but not in the compiled pool.
    row["indexer_bytes_per_token"] = kvc.bytes_per_token_breakdown(
        cfg, kv_dtype, tp=MESH_SHAPE[1])["indexer"]
  if "decode" in fits:
    d = fits["decode"]
    pool_c = plan.concurrency * per_req * PAGE_SIZE * bpt  # indexer included
    indexer_c = pool_c - d["kv"]["at_full"]
    need = d["peak"]["at_full"] + unserved["bytes"] + max(0.0, indexer_c)
    row["at_concurrency"] = {"requests": plan.concurrency, "kv": pool_c,
                             "argument_xla": d["argument"]["at_full"], "peak": need,
                             "fits_hbm": need <= plan.hbm_bytes,
                             "fits_static": resident + pool_c <= plan.static_fraction
                             * plan.hbm_bytes}
  return row


def summarize(plan: Plan, compiles: list[dict], weights: dict) -> tuple[dict, list[dict]]:
  """Depth fits per series and one row per deployment, from the compile records.

  Args:
    plan: the run's plan.
    compiles: records of ``step_compile.compile_all``.
    weights: {variant key: (served bytes, ``unserved_weight_bytes``)} (``plan_jobs``).

  Returns:
    ({"variant | kv dtype | kind": fit_series}, [deployment_row per variant x KV dtype]).
  """
  fits, rows = {}, []
  for v in plan.variants:
    for dt in plan.kv_dtypes:
      series = {}
      for kind in plan.kinds:
        recs = [r for r in compiles
                if (r["variant"], r["kv_dtype"], r["kind"]) == (v.key, dt, kind)]
        series[kind] = fit_series(recs, v.model.n_moe_layers)
        fits[f"{v.key} | {dt} | {kind}"] = series[kind]
      rows.append(deployment_row(v, dt, plan, series, *weights[v.key]))
  return fits, rows


def kind_rows(plan: Plan, compiles: list[dict]) -> list[dict]:
  """One row per (variant, KV dtype, step kind): what XLA reports for the step at the full
  depth (bytes per device, kernels launched) and what each further MoE layer adds.

  Sets the kinds of one deployment side by side (the speculative experiment's decode and
  verify steps), where :func:`summarize` sizes its pool.
  """
  rows = []
  for v in plan.variants:
    for dt in plan.kv_dtypes:
      for kind in plan.kinds:
        recs = [r for r in compiles
                if (r["variant"], r["kv_dtype"], r["kind"]) == (v.key, dt, kind)]
        fit = fit_series(recs, v.model.n_moe_layers)
        deepest = max(recs, key=lambda r: r["n_moe"])
        rows.append({"variant": v.key, "kv_dtype": dt, "kind": kind, "rows": deepest["rows"],
                     "tokens": deepest["tokens"], "n_layers": v.model.n_layers,
                     **{f: fit[f]["at_full"] for f in ("argument", "temp", "peak")},
                     "launches": round(fit["launches"]["at_full"]),
                     "launches_per_moe_layer": fit["launches"]["marginal_slope"],
                     "temp_per_moe_layer": fit["temp"]["marginal_slope"],
                     "compiled_depths": sorted(r["n_moe"] for r in recs)})
  return rows


def unit_for(hbm_bytes: int) -> str:
  """The unit tables print bytes in: GB for real devices, MB for the smoke run's toy one."""
  return "GB" if hbm_bytes >= 1e9 else "MB"


def notes(plan: Plan) -> list[str]:
  """The assumptions behind the rows, to be written beside them."""
  return [
      f"Mesh {dict(zip(AXES, MESH_SHAPE))}: attention heads, dense/shared FFN width and the "
      "vocabulary split 8 ways over 'tensor'; the routed experts split 8 ways over the same axis "
      "(expert parallel, run per device in a shard_map with one all-reduce per MoE layer); MLA's "
      "latent cache and the low-rank projections (wq_a, wkv_a), norms and routers replicated.",
      (f"Static memory fraction {plan.static_fraction:.4f} of {plan.hbm_bytes / 1e9:.0f} GB for "
       "weights + KV (the analytic model's, derived from Kimi's 48 GB of KV); the rest is the "
       "reserve the step's temporaries must fit. The target config's H200 has 151.4 GB (141 GiB); "
       "the analytic model's 141e9 is used here, as in `python -m experiments paper`."
       if unit_for(plan.hbm_bytes) == "GB" else
       f"Smoke run: a toy device of {plan.hbm_bytes / 1e6:.2f} MB with a static fraction of "
       f"{plan.static_fraction}, sized to the tiny model so that some configurations do not fit."),
      f"Decode: {plan.concurrency} rows, its pool holding {plan.concurrency} requests of the "
      "sweep's shape; prefill: whole prompts up to "
      f"{plan.prefill_tokens} tokens a step, its pool the static-fraction pool.",
      "Figures at full depth extend the deepest two compiled depths (dense prefix + the listed "
      "MoE-layer counts) by their increment per MoE layer; the fits table has the least-squares "
      "line and its residual over all compiled depths, the test that memory is linear in depth.",
      "GLM 5.2 runs its sparse-attention indexer on every layer (DeepSeek Sparse Attention, "
      "docs/sparse_attention.md): its weights are served, its index keys are paged beside the "
      "latent in the pool's dtype (fp8 with a per-token scale), the decode step scores them with "
      "the paged indexer kernel and attends to the top 2048 positions with the sparse MLA kernel, "
      "and the prefill step selects through the query-blocked indexer over the gathered view.",
      "FP8 weights have no Pallas kernel: their matmuls dequantise through XLA, which the "
      "temporaries include.",
      "Weights per GPU: the report's GLM figures (88 and 52 GiB) are its totals (705 and 421 "
      "GiB) / 8; the placement compiled here, which the analytic model now uses too "
      "(`mlkit.perfmodel.DEPLOYMENT_RULES`), keeps MLA's down projections, the routers and "
      "GLM's indexer and MTP projection whole on every GPU, as tensor-parallel MLA serving does.",
      "Compiled with XLA's codegen optimisation off (LLVM -O0, ptxas -O0): buffer assignment, "
      "and so every figure here, is decided before codegen.",
  ]
