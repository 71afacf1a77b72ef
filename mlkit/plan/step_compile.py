"""The report's serving steps compiled for 8x H200 without a GPU: what is compiled, and how.

What runs: the engine's real jitted decode step and a prefill chunk
(``mlkit.engine.runner.lower_step``, Pallas kernels: ``backend="pallas"``), for
Kimi K2.6 and GLM 5.2 at full width with the report's weight recipes, bf16 and
fp8 KV, compiled by XLA's GPU compiler for an 8x H200 topology from a CPU host
(``pallas_kernels.h200.compile``). Nothing is allocated: params, KV pool and
batch are sharded ``jax.ShapeDtypeStruct``s (``mlkit.parallel.abstract``). The
parallelism is the report's: attention 8-way tensor parallel (heads), the routed
experts 8-way expert parallel on the same 8 GPUs (``ShardingRules(experts="tensor")``:
48 of Kimi's 384 experts per GPU), dense and shared FFNs and the vocabulary tensor
parallel, MLA's latent cache replicated.

Depth: a full 61/78-layer step takes too long to compile on 2 cores, so each step
is compiled at a few depths (the dense prefix plus 1, 2[, 3] MoE layers);
``mlkit.plan.step_memory`` fits every per-device figure XLA reports as a line in
the MoE-layer count and reads it at the full depth, then sizes the KV pool.

A :class:`Plan` says what one run compiles and against what memory it checks;
:func:`plan_jobs` turns it into one compile job per step kind and depth, and
:func:`compile_all` compiles them into records of XLA's per-device bytes and the
kernels each GPU runs. ``python -m experiments h200_compile`` writes the tables;
docs/serving_step_memory.md says what the temporaries are made of.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import tempfile
import time
from concurrent import futures
from typing import Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec

from configs import GLM_5_2, H200, KIMI_K2_6, TINY_MLA
from mlkit import kvcache as kvc
from mlkit import perfmodel as pm
from mlkit.config import ModelConfig
from mlkit.engine import EngineConfig
from mlkit.engine.runner import abstract_batch, lower_step
from mlkit.parallel import AXES, abstract_kv_state, abstract_params, per_device_bytes
from mlkit.quant import FP8_ALL, INT4_EXPERTS, Recipe, kernel_int4_layout
from mlkit.report import deployments, figures
from pallas_kernels.h200.step_placement import step_placement

# data x tensor x expert: the 8 GPUs on the tensor axis; experts are split over it too (RULES,
# the analytic model's placement).
MESH_SHAPE = (1, 8, 1)
RULES = pm.DEPLOYMENT_RULES
KV_DTYPES = ("bfloat16", "float8_e4m3fn")
PAGE_SIZE = 64
KINDS = ("decode", "prefill", "verify")
# XLA's codegen stages only (LLVM, ptxas) run without optimisation: buffer assignment, and so
# every memory figure, is decided before them, and they are most of the compile time.
# Autotuning off: with no device there is nothing to time, yet the smoke run (one compile)
# took 23.0 s with it and 14.3 s without; the memory figures are the same with it off
# (docs/serving_step_memory.md).
COMPILE_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                   "xla_gpu_disable_gpuasm_optimizations": True, "xla_gpu_autotune_level": 0}
# The fields of XLA's memory analysis each compile record carries (bytes per device).
FIELDS = ("argument", "output", "temp", "alias")

Progress = Callable[[str], None]


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
  # Step kinds compiled: "decode", "prefill" and/or "verify" (a speculative engine's step:
  # verify ``speculative_tokens`` drafts per decode row, draft as many; models with MTP only).
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
  # Drafts per row of a "verify" step (EngineConfig.speculative_tokens).
  speculative_tokens: int = 3

  def __post_init__(self):
    for name in ("variants", "kv_dtypes", "kinds", "moe_depths"):
      if not getattr(self, name):
        raise ValueError(f"Plan.{name} must not be empty")
    if any(k not in KINDS for k in self.kinds):
      raise ValueError(f"Plan.kinds must be drawn from {KINDS}, got {self.kinds!r}")
    if min(self.moe_depths) < 1:
      raise ValueError(f"Plan.moe_depths must be >= 1, got {self.moe_depths!r}")
    if "verify" in self.kinds:
      for v in self.variants:
        if v.model.n_mtp_layers < 1 or v.model.sparse_attention:
          raise ValueError(f"Plan: a verify step needs a dense-attention model with an MTP "
                           f"layer; {v.key} ({v.model.name}) has "
                           f"{v.model.n_mtp_layers} MTP layers"
                           f"{' and sparse attention' if v.model.sparse_attention else ''}")
    for name in ("hbm_bytes", "concurrency", "prefill_tokens", "workers", "speculative_tokens"):
      if getattr(self, name) <= 0:
        raise ValueError(f"Plan.{name} must be positive, got {getattr(self, name)!r}")
    if not 0 < self.static_fraction < 1:
      raise ValueError(f"Plan.static_fraction must be in (0, 1), got {self.static_fraction!r}")

  def static_pool(self, resident: float) -> float:
    """Bytes the static fraction leaves for KV beside ``resident`` weight bytes (may be < 0)."""
    return self.static_fraction * self.hbm_bytes - resident

  def summary(self) -> dict:
    """The plan as JSON-ready fields (variants by key, model, recipe and request shape)."""
    return {**{k: getattr(self, k) for k in ("kv_dtypes", "kinds", "moe_depths", "hbm_bytes",
                                              "static_fraction", "concurrency", "prefill_tokens",
                                              "backend", "speculative_tokens")},
            "variants": [{"key": v.key, "model": v.model.name, "recipe": v.recipe.name,
                          "work": dataclasses.asdict(v.work)} for v in self.variants]}


KIMI = Variant("kimi-k2.6 int4 experts", KIMI_K2_6, INT4_EXPERTS, deployments.KIMI_WORK)
GLM_FP8 = Variant("glm-5.2 fp8", GLM_5_2, FP8_ALL, deployments.GLM_WORK)
GLM_INT4 = Variant("glm-5.2 int4 experts", GLM_5_2, INT4_EXPERTS, deployments.GLM_WORK)
# Smoke: TINY_MLA (one dense + one MoE layer: compiled at full depth) with 8 heads and 8
# experts, so that both split 8 ways, in bf16; without TINY_MLA's MTP layer, whose weights
# the serving step would not read.
TINY = dataclasses.replace(TINY_MLA, name="tiny-mla-8way", n_layers=2, n_heads=8, dtype="bfloat16",
                           param_dtype="bfloat16", n_mtp_layers=0)
TINY_WORK = pm.Workload(96, 32)


# The verify step of speculative decoding at Kimi K2.6's shapes. The preset has no MTP
# layer (its config sets none), so this one carries one of DeepSeek-V3's form (an MoE
# decoder layer, eh_proj and norms, the shared embedding and head): what a Kimi-shaped
# model drafting with its own MTP layer would serve. GLM 5.2 ships one, but its sparse
# attention is not speculated here (docs/speculative.md).
KIMI_MTP = Variant("kimi-k2.6 int4 experts + 1 MTP layer",
                   dataclasses.replace(KIMI_K2_6, n_mtp_layers=1), INT4_EXPERTS,
                   deployments.KIMI_WORK)


def speculative_plan(smoke: bool, k: int) -> Plan:
  """The decode step and the verify step (k drafts per row) of one deployment, side by side.

  Smoke: TINY with an MTP layer, at one depth, 64 rows (fewer leave the verify
  step's small f32 matmuls to a Triton GEMM that, with autotuning off as
  :data:`COMPILE_OPTIONS` has it, finds no config). Otherwise :data:`KIMI_MTP`
  with fp8 KV at 2 and 3 MoE layers and the sweep's top concurrency, as
  :func:`plan_for`'s quick plan compiles its decode step.
  """
  if smoke:
    # TINY's name kept: its decode step then lowers as h200_compile's and paper's do (the
    # name reaches the Pallas kernels' serialised modules), and compiles once for all three.
    tiny = dataclasses.replace(TINY, n_mtp_layers=1)
    return Plan(variants=(Variant("tiny int4 experts + MTP", tiny, INT4_EXPERTS, TINY_WORK),),
                kv_dtypes=("bfloat16",), kinds=("decode", "verify"), moe_depths=(1,),
                hbm_bytes=1_500_000, static_fraction=0.6, concurrency=64, prefill_tokens=96,
                workers=1, speculative_tokens=k)
  return dataclasses.replace(plan_for(quick=True, smoke=False), variants=(KIMI_MTP,),
                             kv_dtypes=("float8_e4m3fn",), kinds=("decode", "verify"),
                             speculative_tokens=k)


def plan_for(quick: bool, smoke: bool) -> Plan:
  """The run's plan: smoke (tiny model, one compile), quick (Kimi) or full (Kimi and GLM)."""
  frac = pm.static_memory_fraction(deployments.KIMI)
  common_kw = dict(static_fraction=frac, hbm_bytes=H200.hbm_bytes,
                   concurrency=figures.CONCURRENCY[-1],
                   prefill_tokens=pm.Assumptions().prefill_chunk)
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
    return Plan(variants=(KIMI,), kv_dtypes=KV_DTYPES, kinds=("decode", "prefill"), moe_depths=(2, 3),
                **common_kw)
  return Plan(variants=(KIMI, GLM_FP8, GLM_INT4), kv_dtypes=KV_DTYPES, kinds=("decode", "prefill"),
              moe_depths=(1, 2, 3), **common_kw)


# ----------------------------------------------------------------------------- shapes


def pages_per_request(work: pm.Workload, lookahead: int = 0) -> int:
  """Pages one request of the sweep's shape holds at its end (the block-table width); a
  speculative engine's requests hold ``lookahead`` positions more (``EngineConfig.lookahead``)."""
  return -(-(work.footprint + lookahead) // PAGE_SIZE)


def lookahead(plan: Plan) -> int:
  """Positions a speculative request reserves past its tokens: 2k - 1 (``EngineConfig``)."""
  return 2 * plan.speculative_tokens - 1


def step_shape(kind: str, work: pm.Workload, plan: Plan) -> tuple[int, int, int]:
  """(rows B, tokens T, block-table width M) of the compiled step.

  Decode: one token for each of ``plan.concurrency`` requests. Verify: the last
  token and k drafts for each of them, in pages that hold the look-ahead. Prefill:
  whole prompts, as many rows as fit ``plan.prefill_tokens`` (Kimi: one 8192-token
  prompt; GLM: four 2048-token prompts).
  """
  M = pages_per_request(work)
  if kind == "decode":
    return plan.concurrency, 1, M
  if kind == "verify":
    return plan.concurrency, plan.speculative_tokens + 1, pages_per_request(work, lookahead(plan))
  T = min(plan.prefill_tokens, work.prompt_tokens)
  return max(1, plan.prefill_tokens // T), T, M


# ----------------------------------------------------------------------------- weights


def served_params(cfg: ModelConfig, v: Variant, mesh, backend: str):
  """The served params of ``cfg`` in ``v``'s recipe, abstract and placed by RULES, int4
  weights in the layout the engine quantises into for ``backend`` (docs/int4_matmul.md);
  with ``cfg.n_mtp_layers`` its MTP layers too, sharing the embedding and head."""
  return abstract_params(cfg, v.recipe, mesh, RULES, int4_layout=kernel_int4_layout(backend),
                         mtp=() if cfg.n_mtp_layers else None)


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


def h200_mesh():
  """The abstract 8x H200 mesh the steps are compiled for (MESH_SHAPE over ``AXES``).

  Raises:
    pallas_kernels.h200.compile.H200CompileUnavailable: without the CUDA compiler packages.
  """
  from pallas_kernels.h200 import compile as hc
  return hc.mesh(MESH_SHAPE, AXES)


def plan_jobs(plan: Plan, mesh, progress: Progress | None = None) -> tuple[dict, list[tuple]]:
  """The weights of every variant and one compile job per variant, KV dtype, kind and depth.

  The decode step's pool holds ``plan.concurrency`` requests of the sweep's shape
  (so a deployment that cannot serve them shows up as not fitting); the prefill
  step's pool is the one the static fraction leaves beside the resident weights.

  Args:
    plan: the run's plan.
    mesh: the 8x H200 mesh (:func:`h200_mesh`).
    progress: called with a line per variant and KV dtype (pool sizes), or None.

  Returns:
    ({variant key: (served bytes, ``unserved_weight_bytes``)}, [(variant, kv dtype, kind,
    MoE layers, pool pages)] for :func:`compile_all`).
  """
  weights, jobs = {}, []
  for v in plan.variants:
    served = served_weight_bytes(v, mesh, plan.backend)
    unserved = unserved_weight_bytes(v, served)
    weights[v.key] = (served, unserved)
    for dt in plan.kv_dtypes:
      bpt = kvc.bytes_per_token(v.model, dt, tp=MESH_SHAPE[1])
      static_pages = kvc.capacity(v.model, dt, max(0, int(plan.static_pool(
          served + unserved["bytes"]))), page_size=PAGE_SIZE, tp=MESH_SHAPE[1])["pages"]
      pages = {"decode": plan.concurrency * pages_per_request(v.work),
               "verify": plan.concurrency * pages_per_request(v.work, lookahead(plan)),
               "prefill": max(1, static_pages)}
      if progress:
        progress(f"h200_compile: {v.key} {dt}: {bpt:,} B/token; decode pool "
                 f"{pages['decode']:,} pages ({plan.concurrency} requests), prefill pool "
                 f"{pages['prefill']:,} pages (static fraction {plan.static_fraction:.4f})")
      for kind in plan.kinds:
        for n_moe in plan.moe_depths:
          jobs.append((v, dt, kind, n_moe, pages[kind]))
  return weights, jobs


def lower(v: Variant, kv_dtype: str, kind: str, n_moe: int, num_pages: int, plan: Plan, mesh):
  """Lowers one step at the dense prefix plus ``n_moe`` MoE layers.

  Returns:
    (the lowered step, its record's analytic part: shape, pool pages and the exact
    per-device bytes of weights, KV pool and batch inputs).
  """
  verify = kind == "verify"
  cfg = v.model.first_layers(v.model.first_k_dense + n_moe)
  if not verify:
    # A plain step never reads the MTP layers, and jit drops unread arguments, so they
    # would be missing from XLA's argument bytes: compile the plain steps without them.
    cfg = dataclasses.replace(cfg, n_mtp_layers=0)
  B, T, M = step_shape(kind, v.work, plan)
  kv_cfg = kvc.KVCacheConfig(num_pages=num_pages, page_size=PAGE_SIZE, dtype=kv_dtype)
  params = served_params(cfg, v, mesh, plan.backend)
  # A verify step's pool has the drafter's layer (same pages, one layer more).
  state = abstract_kv_state(cfg, kv_cfg, mesh, RULES, draft_layers=int(verify))
  batch = abstract_batch(B, T, M, NamedSharding(mesh, PartitionSpec()), speculative=verify)
  config = EngineConfig(model=cfg, kv=kv_cfg, max_running=B, batch_buckets=(B,),
                        prefill_buckets=(T,), prefill_token_budget=B * T, max_pages_per_seq=M,
                        backend=plan.backend,
                        speculative_tokens=plan.speculative_tokens if verify else 0)
  t0 = time.perf_counter()
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    lowered = lower_step(params, state, batch, config, kind=kind)
  rec = {"variant": v.key, "kv_dtype": kv_dtype, "kind": kind, "n_moe": n_moe,
         "n_layers": cfg.n_layers, "rows": B, "tokens": T, "max_pages": M, "num_pages": num_pages,
         "weights": per_device_bytes(params), "kv": per_device_bytes(state),
         "inputs": per_device_bytes(list(vars(batch).values())), "lower_s": time.perf_counter() - t0}
  return lowered, rec


# The last few compiled steps by their lowered program: experiments run in one process compile
# a step they share once (the smoke runs of paper, speculative and h200_compile all lower TINY's
# decode step at 64 rows).
_COMPILED: collections.OrderedDict = collections.OrderedDict()
_COMPILED_KEPT = 4


def compile_cached(lowered):
  """(compiled, kernel launches) of ``lowered``; a program compiled lately is not recompiled."""
  from pallas_kernels.h200 import compile as hc
  key = hashlib.sha256(lowered.as_text().encode()).hexdigest()
  hit = _COMPILED.get(key)
  if hit is None:
    with tempfile.TemporaryDirectory(prefix="h200_step_") as dump:
      compiled = lowered.compile(dict(COMPILE_OPTIONS, xla_dump_to=dump))
      hit = _COMPILED[key] = (compiled, hc.launches_in_dump(dump))
    while len(_COMPILED) > _COMPILED_KEPT:
      _COMPILED.popitem(last=False)
  return hit


def compile_lowered(lowered, rec: dict) -> dict:
  """Compiles one lowered step; ``rec`` plus XLA's memory analysis, kernel launches and the
  kernels each GPU runs (``pallas_kernels.h200.step_placement``)."""
  t0 = time.perf_counter()
  # XLA's thunk dump names every kernel the step launches (XLA's fusions and the Pallas
  # kernels): how many a step runs, one launch overhead each.
  compiled, launches = compile_cached(lowered)
  ma = compiled.memory_analysis()
  out = dict(rec, compile_s=time.perf_counter() - t0, launches=len(launches))
  # What each GPU runs: every kernel at its per-GPU shape, and what XLA had to gather.
  out.update(step_placement(compiled.as_text()))
  for f in FIELDS:
    out[f] = int(getattr(ma, f"{f}_size_in_bytes"))
  out["peak"] = out["argument"] + out["temp"] + out["output"] - out["alias"]
  out["argument_matches_analytic"] = out["argument"] == out["weights"] + out["kv"] + out["inputs"]
  return out


def compile_all(jobs: list, plan: Plan, mesh, progress: Progress | None = None) -> list[dict]:
  """Lowers every job in turn, compiles them ``plan.workers`` at a time; one record per job."""
  say = progress or (lambda msg: None)
  lowered = []
  for job in jobs:
    lowered.append(lower(*job, plan=plan, mesh=mesh))
    say(f"h200_compile: lowered {job[0].key} {job[1]} {job[2]} (dense prefix + {job[3]} MoE)")
  done = []
  with futures.ThreadPoolExecutor(max_workers=plan.workers) as pool:
    for r in pool.map(lambda lr: compile_lowered(*lr), lowered):  # in order, each as it is ready
      say(f"h200_compile: compiled {r['variant']} {r['kv_dtype']} {r['kind']} "
          f"{r['n_layers']} layers in {r['compile_s']:.0f} s: args "
          f"{r['argument'] / 1e9:.2f} GB, temp {r['temp'] / 1e9:.2f} GB, "
          f"{r['launches']:,} kernels")
      done.append(r)
  return done
