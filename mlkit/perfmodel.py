"""Analytic performance model of a tensor-parallel MoE+MLA deployment (the report's, on H200).

From shapes alone (no weights are instantiated) it computes, per GPU:

* weight bytes, split into routed experts and the rest: the checkpoint's tensors
  (``mlkit.quant.checkpoint_specs``) in the recipe's formats, placed on the ``tp``
  GPUs by :data:`DEPLOYMENT_RULES` (the placement the compiled serving steps use,
  so XLA's per-device argument bytes agree with it exactly), and the KV budget
  left beside them;
* KV bytes per token and token capacity (``mlkit.kvcache``);
* one decode step's time at concurrency ``c``: the bytes it must move (the dense
  weights once, every routed expert at least one of the batch's tokens picked,
  and each request's KV context) over the bandwidth, against its FLOPs over the
  compute rate, plus a fixed per-layer latency (collectives and kernel launches);
* prefill throughput from FLOPs at the format's matmul rate, plus the time INT4
  weights spend being unpacked.

Every number the model does not derive from shapes is a field of
:class:`Assumptions`, with a comment saying where it comes from. One factor per
deployment is fitted by :func:`calibrate` (by default the fixed per-layer
latency, as a multiple of the assumed one: at low concurrency the real systems
are latency bound, not bandwidth bound); everything else is predicted.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax.sharding import AbstractMesh

from mlkit import kvcache as kvc
from mlkit.config import HardwareConfig, ModelConfig
from mlkit.model import active_params_per_token
from mlkit.parallel import (AXES, ShardingRules, param_shardings, per_device_bytes,
                            with_shardings)
from mlkit.quant import Recipe, checkpoint_specs, quantize_params
from mlkit.quant.tree import flatten_params

# How the report's deployments place weights on their tp GPUs: attention heads, dense and
# shared FFN width and the vocabulary split tp ways, the routed experts split over the
# same GPUs (expert parallel); MLA's low-rank down projections (wq_a, wkv_a), routers and
# norms, and GLM's indexer weights and MTP eh_proj, replicated on every GPU. Splitting
# every 2-D weight tp ways instead (the report's "705 GB / 8 = 88 GB per GPU") undercounts
# a GPU by 2.2 GB for Kimi K2.6 and 3.0 (fp8) to 4.1 GB (INT4 experts) for GLM 5.2.
DEPLOYMENT_RULES = ShardingRules(experts="tensor")


@dataclasses.dataclass(frozen=True)
class Assumptions:
  """Every input of the model that is not a model shape. All sizes in bytes, times in s."""

  # KV bytes per H200 that the report's 686K-token Kimi figure implies (docs/report.md).
  kimi_kv_budget_bytes: float = 48e9
  # Fraction of HBM holding weights + KV (the rest: activations, graphs, buffers). Derived,
  # not chosen: the fraction at which Kimi's INT4 weights per GPU plus 48 GB of KV fill it
  # (see static_memory_fraction); applied unchanged to every other deployment.
  static_memory_fraction: float | None = None
  # All-reduces per layer under tensor parallelism (after attention, after the FFN).
  allreduces_per_layer: int = 2
  # Latency of one small all-reduce over 8 NVLink GPUs (one-shot custom all-reduce, ~10 us).
  allreduce_latency_s: float = 10e-6
  # Other fixed time per layer and step: ~10 kernels (norms, rope, router, top-k, MoE
  # align/scatter, attention, GEMMs) at ~2 us launch/tail each under CUDA graphs.
  kernel_overhead_per_layer_s: float = 20e-6
  # Experts are picked independently and uniformly (the load balancer's goal), so a batch
  # of B tokens touches E * (1 - (1 - k/E)^B) distinct experts per layer.
  uniform_routing: bool = True
  # fp8 GEMM rate relative to the measured bf16 rate (H200 spec: 1979 vs 989 TFLOP/s).
  fp8_matmul_speedup: float = 2.0
  # Non-tensor-core rate (H200 spec FP32, FLOP/s) for unpacking int4 and dequantising fp8 KV.
  cuda_core_flops: float = 67e12
  # Operations per int4 weight to unpack, subtract the zero point and scale, per M tile.
  int4_dequant_ops: float = 4.0
  # Rows of one prefill GEMM tile: an INT4 weight tile is unpacked once per M tile.
  prefill_m_tile: int = 128
  # Operations per fp8 KV value to convert and scale (in registers; no extra bytes).
  fp8_kv_dequant_ops: float = 2.0
  # Prefill chunk (tokens per forward pass) for prefill throughput.
  prefill_chunk: int = 8192


def describe(a: Assumptions) -> list[dict]:
  """Every assumption as {name, value, note} (the notes are the field comments above)."""
  return [{"name": f.name, "value": getattr(a, f.name), "note": ASSUMPTION_NOTES[f.name]}
          for f in dataclasses.fields(a)]


ASSUMPTION_NOTES = {
    "kimi_kv_budget_bytes": "KV bytes per H200 implied by the report's 686K-token Kimi figure "
                            "(docs/report.md)",
    "static_memory_fraction": "HBM fraction for weights + KV; None = derived so that Kimi's "
                              "INT4 weights per GPU + 48 GB of KV fill it, then applied to "
                              "every deployment",
    "allreduces_per_layer": "tensor-parallel all-reduces per layer (after attention, after FFN)",
    "allreduce_latency_s": "one small all-reduce over 8 NVLink GPUs (one-shot custom all-reduce)",
    "kernel_overhead_per_layer_s": "other fixed time per layer: ~10 kernels at ~2 us each under "
                                   "CUDA graphs",
    "uniform_routing": "experts picked independently and uniformly: a batch of B tokens touches "
                       "E(1-(1-k/E)^B) experts per layer",
    "fp8_matmul_speedup": "fp8 GEMM rate / measured bf16 rate (H200 spec 1979 / 989 TFLOP/s)",
    "cuda_core_flops": "non-tensor-core rate for int4 unpacking and fp8 KV dequantisation "
                       "(H200 FP32 spec)",
    "int4_dequant_ops": "operations per int4 weight to unpack and scale, once per M tile",
    "prefill_m_tile": "rows of a prefill GEMM tile (an int4 tile is unpacked once per M tile)",
    "fp8_kv_dequant_ops": "operations per fp8 KV value to convert and scale (in registers)",
    "prefill_chunk": "tokens per prefill forward pass",
}


@dataclasses.dataclass(frozen=True)
class Workload:
  """The request shape of a concurrency sweep.

  Attributes:
    prompt_tokens / output_tokens: per request.
  """

  prompt_tokens: int
  output_tokens: int

  @property
  def footprint(self) -> int:
    """Tokens one request holds at the end: what admission must find room for."""
    return self.prompt_tokens + self.output_tokens

  @property
  def mean_context(self) -> float:
    """Context a decode step reads, averaged over the request's generation."""
    return self.prompt_tokens + self.output_tokens / 2


@dataclasses.dataclass(frozen=True)
class Deployment:
  """One model served on ``tp`` GPUs with tensor parallelism.

  Attributes:
    name: a label.
    model: the model config (full shapes).
    recipe: the weight recipe.
    kv_dtype: the KV cache's storage dtype.
    hardware: the GPU.
    tp: tensor-parallel degree (GPUs).
  """

  name: str
  model: ModelConfig
  recipe: Recipe
  kv_dtype: str
  hardware: HardwareConfig
  tp: int = 8

  def replace(self, **kw) -> "Deployment":
    return dataclasses.replace(self, **kw)


def _no_mtp(cfg: ModelConfig) -> ModelConfig:
  return dataclasses.replace(cfg, n_mtp_layers=0)


def weight_split(dep: Deployment, *, resident: bool = True) -> dict:
  """Per-GPU weight bytes, split into routed experts and everything else.

  Args:
    dep: the deployment.
    resident: count what sits in memory (checkpoint incl. MTP layers) rather than what
      a decode step reads (serving layers only).

  Returns:
    {"per_gpu", "experts_per_gpu", "dense_per_gpu", "embed_per_gpu",
     "expert_bytes_per_gpu" (one expert of one layer), "moe_layers"}.
  """
  return dict(_weight_split(dep.model, dep.recipe, dep.tp, resident))


@functools.lru_cache(maxsize=None)
def _weight_split(model: ModelConfig, recipe: Recipe, tp: int, resident: bool) -> tuple:
  cfg = model if resident else _no_mtp(model)
  shapes = jax.eval_shape(lambda t: quantize_params(t, recipe), checkpoint_specs(cfg))
  mesh = AbstractMesh((1, tp, 1), AXES)
  placed = with_shardings(shapes, param_shardings(shapes, mesh, DEPLOYMENT_RULES, cfg))
  per_gpu = per_device_bytes(placed)
  # Routed experts are the only 3-D weights.
  experts = sum(per_device_bytes(leaf) for _, leaf in flatten_params(placed)[0]
                if len(leaf.shape) == 3)
  moe_layers = cfg.n_moe_layers + cfg.n_mtp_layers
  embed = cfg.vocab_size * cfg.d_model * 2 // tp  # bf16 in every recipe, vocab-parallel
  return tuple({"per_gpu": per_gpu, "experts_per_gpu": experts,
                "dense_per_gpu": per_gpu - experts, "embed_per_gpu": embed,
                "expert_bytes_per_gpu": experts / (moe_layers * cfg.n_routed_experts),
                "moe_layers": moe_layers}.items())


def static_memory_fraction(kimi: Deployment, a: Assumptions = Assumptions()) -> float:
  """HBM fraction for weights + KV that gives ``kimi`` its 48 GB of KV per GPU."""
  if a.static_memory_fraction is not None:
    return a.static_memory_fraction
  return (weight_split(kimi)["per_gpu"] + a.kimi_kv_budget_bytes) / kimi.hardware.hbm_bytes


def kv_budget(dep: Deployment, fraction: float) -> float:
  """KV bytes per GPU: the static fraction of HBM minus the resident weights."""
  return fraction * dep.hardware.hbm_bytes - weight_split(dep)["per_gpu"]


def capacity(dep: Deployment, budget: float) -> dict:
  """Tokens the deployment's KV cache holds (per GPU = per deployment: MLA is replicated)."""
  return kvc.capacity(dep.model, dep.kv_dtype, int(budget), tp=dep.tp)


def distinct_experts(n_experts: int, top_k: int, tokens: int) -> float:
  """Expected distinct experts a batch of ``tokens`` picks per layer (uniform routing)."""
  return n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)


def _attended(cfg: ModelConfig, context: float) -> float:
  """Context tokens whose latent one query reads (GLM's indexer keeps the top index_topk)."""
  return min(context, cfg.index_topk) if cfg.index_topk else context


def decode_step(dep: Deployment, c: int, work: Workload, a: Assumptions = Assumptions()) -> dict:
  """The modelled time of one decode step of ``c`` requests (each emits one token).

  Returns:
    {bytes: {dense, experts, kv}, flops, t_memory, t_compute, t_fixed, t_step} per GPU.
  """
  cfg, hw = dep.model, dep.hardware
  if not a.uniform_routing:
    raise ValueError("decode_step: only uniform routing is modelled (Assumptions.uniform_routing)")
  w = weight_split(dep, resident=False)
  touched = distinct_experts(cfg.n_routed_experts, cfg.top_k, c)
  experts = touched * w["expert_bytes_per_gpu"] * cfg.n_moe_layers
  dense = w["dense_per_gpu"] - w["embed_per_gpu"]  # embedding rows are gathered, not streamed
  ctx = work.mean_context
  latent = kvc.bytes_per_token_breakdown(cfg, dep.kv_dtype, tp=dep.tp)
  # Every rank reads the whole replicated latent of the tokens it attends, and the
  # indexer keys of the whole context.
  kv = c * (_attended(cfg, ctx) * (latent["values"] + latent["scales"]) + ctx * latent["indexer"])
  # FLOPs per GPU: weights (2 per active parameter per token) and absorbed MLA attention
  # (scores over kv_lora + rope, values over kv_lora) for this rank's heads.
  heads = cfg.n_heads / dep.tp
  attn = 2 * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim) * heads * cfg.n_layers
  idx = 2 * cfg.index_n_heads * cfg.index_head_dim * cfg.n_layers / dep.tp if cfg.index_topk else 0
  flops = c * (2 * active_params_per_token(cfg) / dep.tp + attn * _attended(cfg, ctx) + idx * ctx)
  t_dequant = 0.0
  if dep.kv_dtype == "float8_e4m3fn":
    values = c * _attended(cfg, ctx) * cfg.cache_values_per_token * cfg.n_layers
    t_dequant = values * a.fp8_kv_dequant_ops / a.cuda_core_flops
  t_memory = (dense + experts + kv) / hw.measured_bandwidth
  t_compute = flops / hw.measured_bf16_flops + t_dequant
  t_fixed = cfg.n_layers * (a.allreduces_per_layer * a.allreduce_latency_s
                            + a.kernel_overhead_per_layer_s)
  return {"bytes": {"dense": dense, "experts": experts, "kv": kv}, "flops": flops,
          "touched_experts_per_layer": touched, "t_memory": t_memory, "t_compute": t_compute,
          "t_fixed": t_fixed, "t_step": t_fixed + max(t_memory, t_compute)}


def speculative_decode_step(dep: Deployment, c: int, work: Workload, k: int,
                            acceptance_length: float, a: Assumptions = Assumptions()) -> dict:
  """The modelled time of one speculative decode step of ``c`` requests, k drafts each.

  The verify pass runs the target over c (k + 1) tokens: its dense weights are read
  once, its routed experts as many as c (k + 1) tokens touch, each request's KV once
  (one attention kernel serves a row's k + 1 queries), and FLOPs grow k + 1 times.
  The drafter (the first MTP layer, with the shared head) runs k passes, each reading
  that layer's weights, the experts its c rows touch, the head and the layer's KV.
  A step emits ``acceptance_length`` tokens per request on average (measured on a
  trained model; 1 + accepted drafts).

  Returns:
    {verify, draft: decode_step-like dicts, t_step, tokens (per step), tok_s,
    plain_tok_s (decode_step at the same concurrency), speedup} per GPU.

  Raises:
    ValueError: k < 1, an acceptance length outside [1, k + 1], or a model without MTP layers.
  """
  cfg, hw = dep.model, dep.hardware
  if k < 1 or not 1.0 <= acceptance_length <= k + 1:
    raise ValueError(f"speculative_decode_step: need k >= 1 and an acceptance length in "
                     f"[1, k + 1], got k={k}, {acceptance_length}")
  if cfg.n_mtp_layers < 1:
    raise ValueError(f"speculative_decode_step: {cfg.name} has no MTP layer to draft with")
  plain = decode_step(dep, c, work, a)
  # Verify: decode_step's weights and KV at c (k + 1) tokens' expert touches, FLOPs x (k + 1).
  w = weight_split(dep, resident=False)
  touched = distinct_experts(cfg.n_routed_experts, cfg.top_k, c * (k + 1))
  experts = touched * w["expert_bytes_per_gpu"] * cfg.n_moe_layers
  verify_bytes = plain["bytes"]["dense"] + experts + plain["bytes"]["kv"]
  verify = {"bytes": verify_bytes, "flops": plain["flops"] * (k + 1),
            "t_memory": verify_bytes / hw.measured_bandwidth}
  verify["t_compute"] = verify["flops"] / hw.measured_bf16_flops
  # Draft: one MTP layer (its dense weights are what the resident split adds) and the head.
  mtp_dense = weight_split(dep)["dense_per_gpu"] - w["dense_per_gpu"]
  head = cfg.vocab_size * cfg.d_model * 2 / dep.tp  # the shared lm_head, bf16, vocab-parallel
  latent = kvc.bytes_per_token_breakdown(cfg, dep.kv_dtype, tp=dep.tp)
  per_layer_kv = c * _attended(cfg, work.mean_context) * (latent["values"] + latent["scales"]) \
      / cfg.n_layers
  draft_pass = (mtp_dense + distinct_experts(cfg.n_routed_experts, cfg.top_k, c)
                * w["expert_bytes_per_gpu"] + head + per_layer_kv)
  draft = {"bytes": k * draft_pass, "t_memory": k * draft_pass / hw.measured_bandwidth}
  t_fixed = (cfg.n_layers + k) * (a.allreduces_per_layer * a.allreduce_latency_s
                                  + a.kernel_overhead_per_layer_s)
  t_step = t_fixed + max(verify["t_memory"], verify["t_compute"]) + draft["t_memory"]
  tokens = c * acceptance_length
  plain_tok_s = c / plain["t_step"]
  return {"verify": verify, "draft": draft, "t_fixed": t_fixed, "t_step": t_step,
          "tokens": tokens, "tok_s": tokens / t_step, "plain_tok_s": plain_tok_s,
          "speedup": tokens / t_step / plain_tok_s}


def decode_throughput(dep: Deployment, c: int, work: Workload, *, overhead: float = 1.0,
                      efficiency: float = 1.0, a: Assumptions = Assumptions()) -> float:
  """Output tokens/s at concurrency ``c``.

  tok/s = efficiency * c / (overhead * t_fixed + max(t_memory, t_compute)); the
  calibration fits one of ``overhead`` (default) or ``efficiency`` and leaves the other 1.
  """
  s = decode_step(dep, c, work, a)
  return efficiency * c / (overhead * s["t_fixed"] + max(s["t_memory"], s["t_compute"]))


FACTORS = ("overhead", "efficiency")


def calibrate(dep: Deployment, reported: dict[int, float], work: Workload, *,
              factor: str = "overhead", a: Assumptions = Assumptions()) -> float:
  """Fits the deployment's one factor to reported decode figures (least squares on log tok/s).

  Args:
    dep: the deployment.
    reported: concurrency -> reported tok/s (None entries, e.g. OOM, are left out).
    work: the sweep's request shape.
    factor: "overhead" scales the fixed per-layer latency (bandwidth and compute stay at
      the measured ceilings); "efficiency" scales the whole modelled rate.

  Returns:
    The fitted factor.

  Raises:
    ValueError: no reported points, or an unknown factor.
  """
  pts = [(c, v) for c, v in reported.items() if v]
  if not pts:
    raise ValueError("calibrate: no reported points")
  if factor == "efficiency":  # closed form: the geometric mean of reported / modelled
    logs = [math.log(v / decode_throughput(dep, c, work, a=a)) for c, v in pts]
    return math.exp(sum(logs) / len(logs))
  if factor != "overhead":
    raise ValueError(f"calibrate: factor must be one of {FACTORS}, got {factor!r}")
  steps = {c: decode_step(dep, c, work, a) for c, _ in pts}

  def loss(log_phi):
    phi = math.exp(log_phi)
    return sum((math.log(v) - math.log(c / (phi * steps[c]["t_fixed"]
                                            + max(steps[c]["t_memory"], steps[c]["t_compute"]))))
               ** 2 for c, v in pts)
  lo, hi = math.log(1e-3), math.log(1e4)  # the loss is unimodal in log(phi): ternary search
  for _ in range(200):
    m1, m2 = lo + (hi - lo) / 3, hi - (hi - lo) / 3
    if loss(m1) < loss(m2):
      hi = m2
    else:
      lo = m1
  return math.exp((lo + hi) / 2)


def max_concurrency(dep: Deployment, budget: float, work: Workload) -> int:
  """Requests of ``work``'s shape that fit the KV budget at full length at once."""
  return capacity(dep, budget)["tokens"] // work.footprint


def prefill_throughput(dep: Deployment, a: Assumptions = Assumptions()) -> dict:
  """Prompt tokens/s of the deployment for chunks of ``a.prefill_chunk`` tokens (compute bound).

  Matmuls run at the measured bf16 rate, or ``fp8_matmul_speedup`` times it when the
  recipe stores them in fp8 (W8A8 GEMMs); INT4 weights run bf16 GEMMs and are also
  unpacked once per M tile on the CUDA cores. Attention (causal, mean context half the
  chunk; GLM's indexer caps it) runs at the bf16 rate.

  Returns:
    {"tok_s", "t_per_token", "t_matmul", "t_attention", "t_dequant"} per token, per GPU.
  """
  cfg, hw = dep.model, dep.hardware
  active = active_params_per_token(cfg) / dep.tp
  name = dep.recipe.name
  rate = hw.measured_bf16_flops * (a.fp8_matmul_speedup if name.startswith("fp8") else 1.0)
  t_matmul = 2 * active / rate
  heads = cfg.n_heads / dep.tp
  ctx = _attended(cfg, a.prefill_chunk / 2)
  attn_flops = 2 * heads * (cfg.qk_head_dim + cfg.v_head_dim) * ctx * cfg.n_layers
  if cfg.index_topk:  # the indexer scores every earlier token to pick the top index_topk
    attn_flops += (2 * cfg.index_n_heads * cfg.index_head_dim * a.prefill_chunk / 2
                   * cfg.n_layers / dep.tp)
  t_attention = attn_flops / hw.measured_bf16_flops
  t_dequant = 0.0
  if "int4" in name:
    # Routed experts are the int4 weights. In a chunk each expert sees chunk * k / E tokens,
    # and a kernel unpacks its weight tile once per M tile of those tokens.
    expert_params = cfg.n_moe_layers * cfg.n_routed_experts * 3 * cfg.d_model * cfg.moe_ffn_dim
    tiles = math.ceil(a.prefill_chunk * cfg.top_k / cfg.n_routed_experts / a.prefill_m_tile)
    ops = expert_params / dep.tp * tiles * a.int4_dequant_ops
    t_dequant = ops / a.prefill_chunk / a.cuda_core_flops
  t = t_matmul + t_attention + t_dequant
  return {"tok_s": 1.0 / t, "t_per_token": t, "t_matmul": t_matmul, "t_attention": t_attention,
          "t_dequant": t_dequant}
