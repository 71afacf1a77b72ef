"""h200_compile: the report's serving steps compiled for 8x H200, memory per device from XLA.

What runs: the engine's real jitted decode step and a prefill chunk
(``mlkit.engine.runner.lower_step``, Pallas kernels: ``backend="pallas"``), for
Kimi K2.6 and GLM 5.2 at full width with the report's weight recipes, bf16 and
fp8 KV, compiled by XLA's GPU compiler for an 8x H200 topology from this CPU
host (``pallas_kernels.h200.compile``). Nothing is allocated: params, KV pool
and batch are sharded ``jax.ShapeDtypeStruct``s (``mlkit.parallel.abstract``).
The parallelism is the report's: attention 8-way tensor parallel (heads), the
routed experts 8-way expert parallel on the same 8 GPUs (``ShardingRules
(experts="tensor")``: 48 of Kimi's 384 experts per GPU), dense and shared FFNs
and the vocabulary tensor parallel, MLA's latent cache replicated.

Depth: a full 61/78-layer step takes too long to compile on 2 cores, so each
step is compiled at a few depths (the dense prefix plus 1, 2[, 3] MoE layers),
every per-device figure XLA reports is fitted as a line in the MoE-layer count
(the residual is recorded) and read at the full depth.

Sizing, as a deployment sizes its pool: a static fraction of HBM (SGLang's
mem_fraction_static; here the analytic model's, which gives Kimi the report's
48 GB of KV) holds weights + KV; the rest is for the step's temporaries. The
table compares the compiled figures with the analytic model
(``mlkit.perfmodel``) and the report, and checks each configuration against
141 GB: the decode step is compiled with a pool holding the sweep's top
concurrency (64 requests of the sweep's shape), so a deployment that cannot
serve it shows up as not fitting.

See docs/serving_step_memory.md for what the temporaries are made of.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from concurrent import futures

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from configs import GLM_5_2, H200, KIMI_K2_6, TINY_MLA
from experiments import common, paper
from mlkit import kvcache as kvc
from mlkit import perfmodel as pm
from mlkit.config import ModelConfig
from mlkit.engine import EngineConfig
from mlkit.engine.runner import abstract_batch, lower_step
from mlkit.parallel import AXES, abstract_kv_state, abstract_params, per_device_bytes
from mlkit.quant import FP8_ALL, INT4_EXPERTS, Recipe, kernel_int4_layout
from pallas_kernels.h200.step_placement import kernel_rows, step_placement

# data x tensor x expert: the 8 GPUs on the tensor axis; experts are split over it too (RULES,
# the analytic model's placement).
MESH_SHAPE = (1, 8, 1)
RULES = pm.DEPLOYMENT_RULES
KV_DTYPES = ("bfloat16", "float8_e4m3fn")
PAGE_SIZE = 64
KINDS = ("decode", "prefill")
# XLA's codegen stages only (LLVM, ptxas) run without optimisation: buffer assignment, and so
# every memory figure, is decided before them, and they are most of the compile time.
# Autotuning off: with no device there is nothing to time, yet the smoke run (one compile)
# took 23.0 s with it and 14.3 s without; the memory figures are the same with it off
# (docs/serving_step_memory.md).
COMPILE_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                   "xla_gpu_disable_gpuasm_optimizations": True, "xla_gpu_autotune_level": 0}
FIELDS = ("argument", "output", "temp", "alias")


@dataclasses.dataclass(frozen=True)
class Variant:
  """One model with one weight recipe, and the request shape of its sweep."""

  # Row label.
  key: str
  # Full-size model config.
  model: ModelConfig
  # Weight formats.
  recipe: Recipe
  # The sweep's request shape (prompt + output tokens).
  work: pm.Workload


@dataclasses.dataclass(frozen=True)
class Plan:
  """What one run compiles and against what memory it checks.

  Raises:
    ValueError: naming the field on an empty or non-positive setting.
  """

  # Weight variants (rows: each x every KV dtype).
  variants: tuple[Variant, ...]
  # KV storage dtypes.
  kv_dtypes: tuple[str, ...]
  # Step kinds compiled: "decode" and/or "prefill".
  kinds: tuple[str, ...]
  # MoE layer counts compiled after the dense prefix (the depth fit needs two or more).
  moe_depths: tuple[int, ...]
  # Device memory the configurations must fit (bytes).
  hbm_bytes: int
  # Fraction of hbm_bytes for weights + KV (the rest: temporaries).
  static_fraction: float
  # Decode rows, and the requests of the sweep's shape the decode step's pool must hold.
  concurrency: int
  # Prompt tokens one prefill step processes (rows of one prompt each, up to this many).
  prefill_tokens: int
  # Kernel backend of the compiled steps.
  backend: str = "pallas"
  # Compiles run at once (XLA releases the GIL while compiling).
  workers: int = 2

  def __post_init__(self):
    for name in ("variants", "kv_dtypes", "kinds", "moe_depths"):
      if not getattr(self, name):
        raise ValueError(f"Plan.{name} must not be empty")
    if any(k not in KINDS for k in self.kinds):
      raise ValueError(f"Plan.kinds must be drawn from {KINDS}, got {self.kinds!r}")
    if min(self.moe_depths) < 1:
      raise ValueError(f"Plan.moe_depths must be >= 1, got {self.moe_depths!r}")
    for name in ("hbm_bytes", "concurrency", "prefill_tokens", "workers"):
      if getattr(self, name) <= 0:
        raise ValueError(f"Plan.{name} must be positive, got {getattr(self, name)!r}")
    if not 0 < self.static_fraction < 1:
      raise ValueError(f"Plan.static_fraction must be in (0, 1), got {self.static_fraction!r}")


KIMI = Variant("kimi-k2.6 int4 experts", KIMI_K2_6, INT4_EXPERTS, paper.KIMI_WORK)
GLM_FP8 = Variant("glm-5.2 fp8", GLM_5_2, FP8_ALL, paper.GLM_WORK)
GLM_INT4 = Variant("glm-5.2 int4 experts", GLM_5_2, INT4_EXPERTS, paper.GLM_WORK)
# Smoke: TINY_MLA (one dense + one MoE layer: compiled at full depth) with 8 heads and 8
# experts, so that both split 8 ways, in bf16.
TINY = dataclasses.replace(TINY_MLA, name="tiny-mla-8way", n_layers=2, n_heads=8, dtype="bfloat16",
                           param_dtype="bfloat16")
TINY_WORK = pm.Workload(96, 32)


def plan_for(quick: bool, smoke: bool) -> Plan:
  """The run's plan: smoke (tiny model, one compile), quick (Kimi) or full (Kimi and GLM)."""
  frac = pm.static_memory_fraction(paper.KIMI)
  common_kw = dict(static_fraction=frac, hbm_bytes=H200.hbm_bytes,
                   concurrency=paper.CONCURRENCY[-1], prefill_tokens=pm.Assumptions().prefill_chunk)
  if smoke:
    # A toy device: weights + a pool for 64 bf16 requests overflow it; the static pool fits.
    return Plan(variants=(Variant("tiny int4 experts", TINY, INT4_EXPERTS, TINY_WORK),),
                kv_dtypes=("bfloat16",), kinds=("decode",), moe_depths=(1,),
                hbm_bytes=1_500_000, static_fraction=0.6, concurrency=64, prefill_tokens=96,
                workers=1)
  if quick:
    # 2 and 3 MoE layers, not 1 and 2: XLA schedules a step's only MoE layer differently
    # from one that others follow (Kimi's fp8 prefill: 1.21 / 1.50 / 1.53 GB of
    # temporaries at 1 / 2 / 3 MoE layers), so a line through 1 and 2 overstates the slope.
    return Plan(variants=(KIMI,), kv_dtypes=KV_DTYPES, kinds=KINDS, moe_depths=(2, 3),
                **common_kw)
  return Plan(variants=(KIMI, GLM_FP8, GLM_INT4), kv_dtypes=KV_DTYPES, kinds=KINDS,
              moe_depths=(1, 2, 3), **common_kw)


# ----------------------------------------------------------------------------- shapes


def pages_per_request(work: pm.Workload) -> int:
  """Pages one request of the sweep's shape holds at its end (the block-table width)."""
  return -(-work.footprint // PAGE_SIZE)


def step_shape(kind: str, work: pm.Workload, plan: Plan) -> tuple[int, int, int]:
  """(rows B, tokens T, block-table width M) of the compiled step.

  Decode: one token for each of ``plan.concurrency`` requests. Prefill: whole
  prompts, as many rows as fit ``plan.prefill_tokens`` (Kimi: one 8192-token
  prompt; GLM: four 2048-token prompts).
  """
  M = pages_per_request(work)
  if kind == "decode":
    return plan.concurrency, 1, M
  T = min(plan.prefill_tokens, work.prompt_tokens)
  return max(1, plan.prefill_tokens // T), T, M


def _depth_config(cfg: ModelConfig, n_moe: int) -> ModelConfig:
  return cfg.first_layers(cfg.first_k_dense + n_moe)


# ----------------------------------------------------------------------------- weights


def served_params(cfg: ModelConfig, v: Variant, mesh, backend: str):
  """The served params of ``cfg`` in ``v``'s recipe, abstract and placed by RULES, int4
  weights in the layout the engine quantises into for ``backend`` (docs/int4_matmul.md)."""
  return abstract_params(cfg, v.recipe, mesh, RULES, int4_layout=kernel_int4_layout(backend))


def served_weight_bytes(v: Variant, mesh, backend: str) -> int:
  """Per-device bytes of the served params at full depth, placed by RULES (exact, no compile)."""
  return per_device_bytes(served_params(v.model, v, mesh, backend))


def unserved_weight_bytes(v: Variant, served: int) -> dict:
  """Per-device bytes a checkpoint holds beyond the served model, placed like the rest.

  GLM 5.2 ships a multi-token-prediction layer that this model does not
  instantiate (``mlkit.quant.checkpoint_specs`` counts it; its sparse-attention
  indexer is served); a deployment loads it, so it counts against its memory. It
  is the analytic model's resident weights per GPU (the same placement) minus the
  served ones.

  Args:
    v: the variant.
    served: ``served_weight_bytes(v, mesh, backend)``.

  Returns:
    {"bytes": per-device bytes, "what": a short description}.
  """
  dep = pm.Deployment(v.key, v.model, v.recipe, KV_DTYPES[0], H200, tp=MESH_SHAPE[1])
  extra = pm.weight_split(dep)["per_gpu"] - served
  parts = []
  if v.model.n_mtp_layers:
    parts.append(f"{v.model.n_mtp_layers} MTP layer")
  if v.model.index_n_heads and not v.model.sparse_attention:
    parts.append("indexer weights")
  return {"bytes": int(extra), "what": " + ".join(parts) or "-"}


# ----------------------------------------------------------------------------- compiling


def _lower(v: Variant, kv_dtype: str, kind: str, n_moe: int, num_pages: int, plan: Plan, mesh):
  """Lowers one step at one depth; returns (lowered, the record's analytic part)."""
  cfg = _depth_config(v.model, n_moe)
  B, T, M = step_shape(kind, v.work, plan)
  kv_cfg = kvc.KVCacheConfig(num_pages=num_pages, page_size=PAGE_SIZE, dtype=kv_dtype)
  params = served_params(cfg, v, mesh, plan.backend)
  state = abstract_kv_state(cfg, kv_cfg, mesh, RULES)
  batch = abstract_batch(B, T, M, NamedSharding(mesh, PartitionSpec()))
  config = EngineConfig(model=cfg, kv=kv_cfg, max_running=B, batch_buckets=(B,),
                        prefill_buckets=(T,), prefill_token_budget=B * T, max_pages_per_seq=M,
                        backend=plan.backend)
  t0 = time.perf_counter()
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    lowered = lower_step(params, state, batch, config, kind=kind)
  rec = {"variant": v.key, "kv_dtype": kv_dtype, "kind": kind, "n_moe": n_moe,
         "n_layers": cfg.n_layers, "rows": B, "tokens": T, "max_pages": M, "num_pages": num_pages,
         "weights": per_device_bytes(params), "kv": per_device_bytes(state),
         "inputs": per_device_bytes(list(vars(batch).values())), "lower_s": time.perf_counter() - t0}
  return lowered, rec


def _compile(lowered, rec: dict) -> dict:
  from pallas_kernels.h200 import compile as hc
  t0 = time.perf_counter()
  # XLA's thunk dump names every kernel the step launches (XLA's fusions and the Pallas
  # kernels): how many a step runs, one launch overhead each.
  with tempfile.TemporaryDirectory(prefix="h200_step_") as dump:
    compiled = lowered.compile(dict(COMPILE_OPTIONS, xla_dump_to=dump))
    launches = hc.launches_in_dump(dump)
  ma = compiled.memory_analysis()
  out = dict(rec, compile_s=time.perf_counter() - t0, launches=len(launches))
  # What each GPU runs: every kernel at its per-GPU shape, and what XLA had to gather.
  out.update(step_placement(compiled.as_text()))
  for f in FIELDS:
    out[f] = int(getattr(ma, f"{f}_size_in_bytes"))
  out["peak"] = out["argument"] + out["temp"] + out["output"] - out["alias"]
  out["argument_matches_analytic"] = out["argument"] == out["weights"] + out["kv"] + out["inputs"]
  return out


def compile_all(jobs: list, plan: Plan, mesh) -> list[dict]:
  """Lowers every job in turn, compiles them ``plan.workers`` at a time; one record per job."""
  lowered = []
  for job in jobs:
    lowered.append(_lower(*job, plan=plan, mesh=mesh))
    common.progress(f"h200_compile: lowered {job[0].key} {job[1]} {job[2]} "
                    f"(dense prefix + {job[3]} MoE)")
  done = []
  with futures.ThreadPoolExecutor(max_workers=plan.workers) as pool:
    for r in pool.map(lambda lr: _compile(*lr), lowered):  # in order, each as it is ready
      common.progress(f"h200_compile: compiled {r['variant']} {r['kv_dtype']} {r['kind']} "
                      f"{r['n_layers']} layers in {r['compile_s']:.0f} s: args "
                      f"{r['argument'] / 1e9:.2f} GB, temp {r['temp'] / 1e9:.2f} GB, "
                      f"{r['launches']:,} kernels")
      done.append(r)
  return done


# ----------------------------------------------------------------------------- the depth fit


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


# ----------------------------------------------------------------------------- rows


def _static_pool(plan: Plan, resident: float) -> float:
  return plan.static_fraction * plan.hbm_bytes - resident


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
  static_pool = _static_pool(plan, resident)
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


# ----------------------------------------------------------------------------- run


def summarize(plan: Plan, compiles: list[dict], weights: dict) -> tuple[dict, list[dict]]:
  """Depth fits per series and one row per deployment, from the compile records.

  Args:
    plan: the run's plan.
    compiles: records of ``compile_all``.
    weights: {variant key: (served bytes, ``unserved_weight_bytes``)}.

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



def run(out_dir: str, *, quick: bool = True, smoke: bool = False) -> dict:
  """Compiles the serving steps for 8x H200 and writes h200_compile.{json,md,png}.

  Args:
    out_dir: output folder.
    quick: Kimi K2.6 only, two depths (a few minutes on 2 cores); False adds GLM 5.2
      with fp8 and INT4-expert weights and a third depth.
    smoke: a tiny model, one decode compile, a toy device memory (for tests).

  Returns:
    The JSON record: ``compiles`` (one per step and depth), ``fits`` (per series),
    ``rows`` (one per model x weights x KV dtype), ``plan``.

  Raises:
    pallas_kernels.h200.compile.H200CompileUnavailable: without the CUDA compiler packages.
  """
  from pallas_kernels.h200 import compile as hc
  plan = plan_for(quick, smoke)
  mesh = hc.mesh(MESH_SHAPE, AXES)
  t_start = time.perf_counter()
  weights, jobs = {}, []
  for v in plan.variants:
    served = served_weight_bytes(v, mesh, plan.backend)
    unserved = unserved_weight_bytes(v, served)
    weights[v.key] = (served, unserved)
    for dt in plan.kv_dtypes:
      bpt = kvc.bytes_per_token(v.model, dt, tp=MESH_SHAPE[1])
      static_pages = kvc.capacity(v.model, dt, max(0, int(_static_pool(
          plan, served + unserved["bytes"]))), page_size=PAGE_SIZE, tp=MESH_SHAPE[1])["pages"]
      pages = {"decode": plan.concurrency * pages_per_request(v.work),
               "prefill": max(1, static_pages)}
      common.progress(f"h200_compile: {v.key} {dt}: {bpt:,} B/token; decode pool "
                      f"{pages['decode']:,} pages ({plan.concurrency} requests), prefill pool "
                      f"{pages['prefill']:,} pages (static fraction {plan.static_fraction:.4f})")
      for kind in plan.kinds:
        for n_moe in plan.moe_depths:
          jobs.append((v, dt, kind, n_moe, pages[kind]))
  compiles = compile_all(jobs, plan, mesh)
  fits, rows = summarize(plan, compiles, weights)
  record = common.record_header("h200_compile", quick=quick, smoke=smoke, config={
      "plan": {**{k: getattr(plan, k) for k in ("kv_dtypes", "kinds", "moe_depths", "hbm_bytes",
                                                 "static_fraction", "concurrency",
                                                 "prefill_tokens", "backend")},
               "variants": [{"key": v.key, "model": v.model.name, "recipe": v.recipe.name,
                             "work": dataclasses.asdict(v.work)} for v in plan.variants]},
      "mesh": dict(zip(AXES, MESH_SHAPE)), "rules": dataclasses.asdict(RULES),
      "page_size": PAGE_SIZE, "compile_options": COMPILE_OPTIONS,
      "topology": "8x NVIDIA H200 (pallas_kernels/h200/target_config.txtpb), deviceless"})
  record["kernel_backend"] = plan.backend
  record.update(compiles=compiles, fits=fits, rows=rows, notes=notes(plan),
                seconds=time.perf_counter() - t_start)
  common.write_json(out_dir, "h200_compile", record)
  _plot(os.path.join(out_dir, "h200_compile.png"), record)
  common.write_markdown(out_dir, "h200_compile", markdown(record))
  unit = unit_for(plan.hbm_bytes)
  for r in rows:
    c = r.get("at_concurrency")
    temps = "/".join(_fmt(t, unit) for t in r["temp"].values())
    common.progress(
        f"h200_compile: {r['variant']} {r['kv_dtype']}: weights "
        f"{_fmt(r['weights_resident'], unit)} {unit}/GPU, temps {'/'.join(r['temp'])} {temps} "
        f"{unit}, kernels {'/'.join(r['launches'])} "
        f"{'/'.join(f'{n:,}' for n in r['launches'].values())}, "
        f"pool {_fmt(r['largest_pool'], unit)} {unit} = {r['tokens']:,} tokens, "
        f"{r['concurrency']} requests" + (
            f"; {c['requests']} requests need {_fmt(c['peak'], unit)} {unit}: "
            f"{'fits' if c['fits_hbm'] else 'DOES NOT FIT'}" if c else ""))
  return record


def notes(plan: Plan) -> list[str]:
  """The assumptions behind the table, written beside it."""
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


# ----------------------------------------------------------------------------- outputs


_UNIT = {"GB": 1e9, "MB": 1e6}


def unit_for(hbm_bytes: int) -> str:
  """The unit tables print bytes in: GB for real devices, MB for the smoke run's toy one."""
  return "GB" if hbm_bytes >= 1e9 else "MB"


def _fmt(x, unit: str) -> str:
  return "-" if x is None else f"{x / _UNIT[unit]:,.2f}"


def markdown(rec: dict) -> str:
  """The experiment's markdown: deployments table, compiled points, fits, notes."""
  plan = rec["config"]["plan"]
  unit = unit_for(plan["hbm_bytes"])

  def b(x):
    return _fmt(x, unit)

  md = ["# h200_compile: the serving steps compiled for 8x H200\n\n",
        f"Mode: {rec['mode']}; kernel backend `{rec['kernel_backend']}`; "
        f"{len(rec['compiles'])} compiles in {rec['seconds']:.0f} s on "
        f"{rec['machine']['cpu_count']} CPU cores. Memory per device in {unit} "
        f"({_UNIT[unit]:.0e} B), from XLA's `memory_analysis()` read at full depth; device "
        f"memory {b(plan['hbm_bytes'])} {unit}, static fraction {plan['static_fraction']:.4f}.\n\n",
        "## Deployments\n\n"]
  headers = ["model", "weights", "KV", "weights/GPU (XLA, served)", "+ not served (analytic)",
             "weights/GPU, model", "temp decode", "temp prefill", "temps within reserve",
             "pool (largest that fits)", "tokens", "model tokens", "requests", "model requests"]
  conc = plan["concurrency"]
  if any("at_concurrency" in r for r in rec["rows"]):
    headers += [f"{conc} requests: peak", f"{conc} requests fit"]
  headers += ["kernels per step, decode / prefill"]
  report = paper.REPORT_KIMI_TOKENS
  rows = []
  for r in rec["rows"]:
    a = r["analytic"]
    c = r.get("at_concurrency")
    tok = f"{r['tokens']:,}"
    if r["model"] == KIMI_K2_6.name and r["kv_dtype"] in report:
      tok += f" (report ~{report[r['kv_dtype']] / 1e3:,.0f}K)"
    model_w = b(a["weights"])
    if r["model"] == GLM_5_2.name and r["recipe"] in paper.REPORT_GLM_PER_GPU_GIB:
      gib = paper.REPORT_GLM_PER_GPU_GIB[r["recipe"]]
      model_w += f" (report {gib} GiB = {gib * 2**30 / _UNIT[unit]:,.1f})"
    row = [r["model"], r["recipe"], r["kv_dtype"], b(r["weights_xla"]),
           b(r["weights_unserved"]["bytes"]) + f" ({r['weights_unserved']['what']})",
           model_w, b(r["temp"].get("decode")), b(r["temp"].get("prefill")),
           "yes" if r["temps_fit_reserve"] else
           f"NO ({b(r['reserve'])} > {b(r['reserve_allowed'])})",
           b(r["largest_pool"]), tok, f"{a['tokens']:,}", r["concurrency"], a["concurrency"]]
    if c:
      row += [b(c["peak"]), "yes" if c["fits_hbm"] else "**NO (out of memory)**"]
    n = r.get("launches", {})
    row += [" / ".join(f"{n[k]:,}" if k in n else "-" for k in ("decode", "prefill"))]
    rows.append(row)
  md.append(common.markdown_table(headers, rows))
  md.append(
      f"\n'model' columns: the analytic model (`mlkit.perfmodel`, as `python -m experiments "
      f"paper`). Pool = min(static fraction x HBM - resident weights, HBM - resident weights - "
      f"the larger step's temporaries); requests = pool pages // pages of one request of the "
      f"sweep's shape. '{conc} requests': the decode step compiled with a pool for {conc} "
      "requests of the sweep's shape; peak = arguments + temporaries + unaliased outputs (+ "
      "weights and indexer keys not instantiated). Kernels per step: the kernels and library "
      "calls of XLA's thunk sequence (its fusions and the Pallas kernels, each one launch), "
      "read at full depth like the memory.\n")
  md.append("\n## Compiled steps\n\n")
  md.append(common.markdown_table(
      ["variant", "KV", "step", "layers", "B x T, pages/row", "pool pages", "arguments",
       "= weights + KV + inputs", "temp", "output", "aliased", "all-gathered (KB)",
       "kernels", "compile s"],
      [[c["variant"], c["kv_dtype"], c["kind"], c["n_layers"],
        f"{c['rows']} x {c['tokens']}, {c['max_pages']}", f"{c['num_pages']:,}",
        b(c["argument"]), "exact" if c["argument_matches_analytic"] else
        f"NO ({b(c['weights'] + c['kv'] + c['inputs'])})", b(c["temp"]), b(c["output"]),
        b(c["alias"]), f"{c['all_gather_bytes'] / 1e3:,.1f}", f"{c['launches']:,}",
        f"{c['compile_s']:.0f}"]
       for c in rec["compiles"]]))
  md.append(_kernels_markdown(rec["compiles"]))
  md.append(f"\n## Depth fits ({unit} = intercept + slope x MoE layers; the full-depth "
            "figure extends the deepest two points)\n\n")
  frows = []
  for key, series in rec["fits"].items():
    for f in ("argument", "temp", "peak"):
      s = series[f]
      frows.append([key, f, b(s["intercept"]), b(s["slope"]), f"{s['max_residual']:,.0f}",
                    b(s["marginal_slope"]), b(s["at_full"])])
    s = series["launches"]  # a count, not bytes
    frows.append([key, "kernels", f"{s['intercept']:,.1f}", f"{s['slope']:,.1f}",
                  f"{s['max_residual']:,.1f}", f"{s['marginal_slope']:,.1f}",
                  f"{s['at_full']:,.0f}"])
  md.append(common.markdown_table(
      ["series", "field", "intercept", "slope / MoE layer", "max residual (B, or kernels)",
       "slope between the deepest two", "at full depth"], frows))
  md.append("\n## Notes\n\n")
  md += [f"- {n}\n" for n in rec["notes"]]
  md.append("\n![h200_compile](h200_compile.png)\n")
  return "".join(md)


def _kernels_markdown(compiles: list[dict]) -> str:
  """Each series' kernels per GPU at its shallowest depth, and its all-gathers."""
  md = ["\n## Kernels each GPU runs\n\n",
        "Every Pallas kernel call in the compiled step, at its per-GPU result shape, and every "
        "all-gather XLA inserted (the shallowest compiled depth of each step; deeper ones "
        "repeat the MoE layer's calls). A kernel whose operands XLA had to gather runs at its "
        "unsplit shape beside an all-gather of that operand "
        "(`pallas_kernels/h200/step_placement.py`).\n"]
  shallowest = {}
  for c in compiles:
    key = (c["variant"], c["kv_dtype"], c["kind"])
    if key not in shallowest or c["n_moe"] < shallowest[key]["n_moe"]:
      shallowest[key] = c
  for (variant, kv, kind), c in shallowest.items():
    gathers = ", ".join(f"`{g['result']}`" for g in c["all_gathers"]) or "none"
    md.append(f"\n**{variant}, {kv} KV, {kind}** ({c['n_layers']} layers): all-gathers "
              f"{gathers}, {c['all_gather_bytes'] / 1e3:,.1f} KB.\n\n")
    md.append(common.markdown_table(["kernel", "custom call", "per-GPU result", "layers",
                                     "calls"], kernel_rows(c["kernels"])))
  return "".join(md)


def _plot(path: str, rec: dict) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  plan = rec["config"]["plan"]
  unit = unit_for(plan["hbm_bytes"])
  u = _UNIT[unit]
  rows = rec["rows"]
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
  ax = axes[0]
  labels, labels_seen, x = [], set(), np.arange(len(rows))
  weights = np.array([r["weights_resident"] for r in rows]) / u
  pools = np.array([max(0.0, r["largest_pool"]) for r in rows]) / u
  temps = np.array([r["reserve"] for r in rows]) / u
  ax.bar(x - 0.2, weights, 0.38, label="weights")
  ax.bar(x - 0.2, pools, 0.38, bottom=weights, label="KV pool (largest that fits)")
  ax.bar(x - 0.2, temps, 0.38, bottom=weights + pools, label="step temporaries")
  for i, r in enumerate(rows):
    labels.append(f"{r['variant']}\n{r['kv_dtype']}")
    c = r.get("at_concurrency")
    if c:
      fits = c["fits_hbm"]
      label = f"{plan['concurrency']} requests, peak ({'fits' if fits else 'out of memory'})"
      ax.bar(i + 0.2, c["peak"] / u, 0.38, color="grey" if fits else "red", alpha=0.6,
             label=label if label not in labels_seen else None)
      labels_seen.add(label)
  ax.axhline(plan["hbm_bytes"] / u, color="k", linestyle="--", label="HBM")
  ax.axhline(plan["static_fraction"] * plan["hbm_bytes"] / u, color="k", linestyle=":",
             label="static fraction")
  ax.set_xticks(x, labels, fontsize=7)
  ax.set_ylabel(f"{unit} per device")
  ax.set_title("memory per H200 (XLA, full depth)", fontsize=10)
  ax.legend(fontsize=7)
  ax = axes[1]
  for key, series in rec["fits"].items():
    pts = np.asarray(series["temp"]["points"], np.float64)
    line = ax.plot(pts[:, 0], pts[:, 1] / u, marker="o", label=key)[0]
    xs = np.asarray([pts[:, 0].min(), pts[:, 0].max()])
    ax.plot(xs, (series["temp"]["intercept"] + series["temp"]["slope"] * xs) / u,
            linestyle=":", color=line.get_color())
  ax.set_xlabel("MoE layers compiled (after the dense prefix)")
  ax.set_ylabel(f"temporaries, {unit} per device")
  ax.set_title("step temporaries vs depth (points: XLA; dotted: fit)", fontsize=10)
  ax.legend(fontsize=6)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
