"""The time of a serving step on 8x H200, predicted from its compiled program.

``mlkit.perfmodel`` predicts from shapes and fits one constant per deployment;
this model reads the program XLA actually compiled for one H200 of the eight
(``pallas_kernels.h200.program``: every fusion, library GEMM, Pallas kernel and
collective, with its bytes and FLOPs) and times each launch (docs/step_time.md):

* a kernel takes ``max(bytes / (share x HBM bandwidth), FLOPs / (share x peak
  FLOP/s))`` plus one launch gap; the shares by kernel kind come from published
  kernel anchors (:class:`Efficiency`);
* a Pallas kernel's bytes and FLOPs depend on the data, so they come from the
  kernel's job (``job_cost`` of its bench module) at the sweep's context length
  and, for the grouped expert matmul, the experts a batch of that size picks;
* a collective takes ``alpha + bus bytes / NVLink bandwidth`` (ring factors);
* the launches run one after another (one stream, under CUDA graphs), so the
  step time is their sum.

Only the launch gap is calibrated, once, on one column of the report (Kimi
K2.6's bf16-KV decode sweep); every other column is predicted with it.

The steps are compiled at the dense prefix plus one MoE layer (seconds each);
the full depth adds the MoE layer's launches once per further MoE layer.
"""

from __future__ import annotations

import dataclasses
import math

from configs import H200
from mlkit.config import HardwareConfig, ModelConfig
from mlkit.perfmodel import distinct_experts
from pallas_kernels.h200.program import Launch, arrays
from pallas_kernels.h200.step_placement import type_bytes


# Bytes per parameter of INT4 weights with a bf16 scale per 32 (mlkit.quant's int4 g32),
# against bf16's 2.
INT4_G32_BYTES = 0.5 + 2 / 32


@dataclasses.dataclass(frozen=True)
class Efficiency:
  """Achieved fractions of the H200's peak, by kernel kind, from published anchors
  (docs/step_time.md cites each) or from gpu_check's measurements of this project's own
  kernels (:meth:`from_gpu_check`), and the NVLink and launch constants."""

  # Memory-bound dense MLA attention: FlashMLA reaches 3,000 GB/s of the H800's 3.35 TB/s.
  attention_bw: float = 3000 / 3350
  # The same with an fp8 cache (FlashMLA's anchor: no separate published fp8 figure).
  attention_fp8_bw: float = 3000 / 3350
  # Sparse MLA attention and the indexer's scoring (the same anchor).
  sparse_bw: float = 3000 / 3350
  index_bw: float = 3000 / 3350
  # Compute-bound attention: FlashMLA's 580 TFLOP/s of the H800's 989 (bf16).
  attention_flops: float = 580 / 989
  # Small-M GEMMs (decode): DeepGEMM's dense FP8 GEMM at M=64, N=2112, K=7168 moves
  # 1,688 GB/s of the H800's 3.35 TB/s.
  gemm_bw: float = 1688 / 3350
  # INT4 weight GEMMs at M <= 16: Marlin runs about 3-4x faster than fp16 (3.5 here) on
  # weights 3.56x smaller (4 bits plus a bf16 scale per 32), so about the fp16 GEMM's
  # bandwidth share.
  int4_bw: float = 1688 / 3350 * 3.5 / (2 / INT4_G32_BYTES)
  # Grouped FP8 expert GEMMs at decode rows: DeepGEMM's masked grouped GEMM (4 groups x 256
  # rows) moves 2,064 GB/s of the H800's 3.35 TB/s.
  fp8_grouped_bw: float = 2064 / 3350
  # Large bf16 GEMMs: cuBLAS at 790 of the H200's 989 TFLOP/s (docs/measuring.md).
  bf16_gemm_flops: float = 790 / 989
  # Large FP8 GEMMs: DeepGEMM's 1,550 of the H800's 1,979 TFLOP/s.
  fp8_gemm_flops: float = 1550 / 1979
  # Every other XLA kernel (norms, casts, routing, sampling): a device copy's 4.3 of the
  # H200's 4.8 TB/s (docs/measuring.md).
  fusion_bw: float = 4.3 / 4.8
  # A collective's fixed latency over 8 NVLink GPUs (one-shot all-reduce, ~10 us).
  collective_alpha_s: float = 10e-6
  # NVLink bus bandwidth one GPU reaches: 80% of the H200's 450 GB/s each way.
  nvlink_bytes_s: float = 0.8 * 450e9
  # Gap per launch under CUDA graphs (calibrated; see calibrate_gap).
  launch_gap_s: float = 2e-6
  # The fields read from gpu_check measurements instead of anchors (from_gpu_check).
  measured: tuple[str, ...] = ()

  def with_gap(self, gap_s: float) -> "Efficiency":
    return dataclasses.replace(self, launch_gap_s=gap_s)

  @classmethod
  def from_gpu_check(cls, cases: list[dict], hw: HardwareConfig = H200) -> "Efficiency":
    """The anchors, with every share gpu_check measured on an H200 put in their place.

    Args:
      cases: gpu_check's "case" records (``pallas_kernels.gpu_check_records.read_cases``):
        each with its kernel, dims, status, the job's bytes and FLOPs, and the kernel's
        median time.
      hw: the GPU whose peaks the shares are of.

    Returns:
      An Efficiency whose ``measured`` names the fields taken from the cases: the device
      copy (XLA's kernels), the bf16 and fp8 matmul ceilings, this project's MLA decode
      kernel with a bf16 and an fp8 cache, the sparse MLA and indexer kernels, and the
      grouped INT4 and FP8 kernels at decode rows; the median over a field's cases.
    """
    import statistics
    ok = [c for c in cases if c.get("status") == "ok" and c.get("time_s")]
    bw = lambda c: c["bytes"] / c["time_s"] / hw.hbm_bandwidth  # noqa: E731
    picks = {
        "fusion_bw": ([c for c in ok if c["name"] == "ceiling/copy"], bw),
        "bf16_gemm_flops": ([c for c in ok if c["name"] == "ceiling/matmul_bf16"],
                            lambda c: c["flops"] / c["time_s"] / hw.bf16_flops),
        "fp8_gemm_flops": ([c for c in ok if c["name"] == "ceiling/matmul_fp8"],
                           lambda c: c["flops"] / c["time_s"] / hw.fp8_flops),
        "attention_bw": ([c for c in ok if c["kernel"] == "paged_mla_decode"
                          and c["dims"].get("kv") == "bf16"], bw),
        "attention_fp8_bw": ([c for c in ok if c["kernel"] == "paged_mla_decode"
                              and c["dims"].get("kv") == "fp8"], bw),
        "sparse_bw": ([c for c in ok if c["kernel"] == "paged_mla_sparse_decode"], bw),
        "index_bw": ([c for c in ok if c["kernel"] == "paged_index_scores"], bw),
        "int4_bw": ([c for c in ok if c["kernel"] == "int4_grouped_matmul"
                     and "prefill" not in c["name"]], bw),
        "fp8_grouped_bw": ([c for c in ok if c["kernel"] == "fp8_grouped_matmul"
                            and "prefill" not in c["name"]], bw)}
    values = {k: statistics.median(f(c) for c in found) for k, (found, f) in picks.items() if found}
    return dataclasses.replace(cls(), measured=tuple(sorted(values)), **values)


@dataclasses.dataclass(frozen=True)
class StepData:
  """What the program does not say: the data one step runs on.

  Attributes:
    model: the full model config (experts, top-k, the indexer's top-k).
    rows: requests in the step (decode rows, or prompts in a prefill chunk).
    tokens: tokens the step computes (decode: rows; prefill: rows x chunk).
    context: tokens of KV each request reads (the sweep's mean context at decode).
    tp: GPUs the experts are spread over (expert parallel on the tensor axis).
  """

  model: ModelConfig
  rows: int
  tokens: int
  context: float
  tp: int = 8

  def experts_touched_fraction(self, tokens: int) -> float:
    """Share of the experts a batch of ``tokens`` picks at least once (uniform routing)."""
    e = self.model.n_routed_experts
    return distinct_experts(e, self.model.top_k, tokens) / e


def _shape(type_text: str) -> tuple[str, tuple[int, ...]]:
  found = arrays(type_text)
  return found[0] if found else ("", ())


def _io(launch: Launch) -> float:
  return sum(type_bytes(t) for t in launch.operands) + sum(type_bytes(t) for t in launch.results)


def _grouped_cost(launch: Launch, data: StepData, k_dim: int, n_dim: int) -> tuple[float, float]:
  """(bytes, FLOPs) of a grouped matmul launch: this GPU's expert operands [E/tp, ...] read
  for the share of experts the batch picks, the other operands and results whole, and the
  rows routed to this GPU's experts (the step's tokens x top-k over tp GPUs) times K x N."""
  local = data.model.n_routed_experts // data.tp
  weights = sum(type_bytes(t) for t in launch.operands
                if len(_shape(t)[1]) >= 3 and _shape(t)[1][0] == local)
  rows = data.tokens * data.model.top_k / data.tp
  return (weights * data.experts_touched_fraction(data.tokens) + _io(launch) - weights,
          2.0 * rows * k_dim * n_dim)


def pallas_cost(launch: Launch, data: StepData) -> tuple[float, float, str]:
  """(bytes, FLOPs, kind) of one Pallas kernel launch on ``data``.

  Attention reads each row's context (MLA decode) or its top index_topk tokens
  (sparse decode), not the pool its operands span; the indexer scores every
  context token; the grouped INT4 matmul reads the experts the batch picks; the page
  write reads its rows and writes them (e4m3 values and f32 scales) into the pools it
  aliases, not the pools whole. Others (the tag check, merges of attention pieces, the grouped matmuls' schedule, the
  router's expert choice) move their operands and results.
  """
  from pallas_kernels.indexer import bench as indexer_bench
  from pallas_kernels.paged_attention import bench as attn_bench
  name, ops = launch.op, launch.operands
  fp8 = any(t.startswith("f8") for t in ops)
  kv = "fp8" if fp8 else "bf16"
  ctx = int(round(data.context))
  if "mla" in name and "decode" in name:
    _, q = _shape(ops[0])
    _, q_rope = _shape(ops[1])
    tables = [s for t in ops for d, s in [_shape(t)] if d == "s32" and len(s) == 2
              and s[0] == q[0]]
    dims = {"batch": q[0], "heads": q[1], "c": q[2], "r": q_rope[-1], "kv": kv, "context": ctx,
            "max_pages": tables[0][1] if tables else 1, "topk": data.model.index_topk or ctx}
    sparse = "sparse" in name
    nbytes, flops = attn_bench.job_cost("paged_mla_sparse_decode" if sparse else
                                        "paged_mla_decode", dims)
    return float(nbytes), float(flops), "sparse" if sparse else "attention"
  if "index" in name and "score" in name:
    _, q = _shape(ops[0])
    dims = {"batch": q[0], "index_heads": q[1], "index_dim": q[-1], "context": ctx,
            "max_pages": 1, "kv": kv}
    nbytes, flops = indexer_bench.job_cost(dims)
    return float(nbytes), float(flops), "index"
  if "page_write" in name:
    # Operands: page [R], slot [R], the entries [R, D_i], then the pool arrays.
    _, (rows,) = _shape(ops[0])
    small = [t for t in ops if _shape(t)[1][:1] == (rows,)]
    widths = [s[1] for t in small for _, s in [_shape(t)] if len(s) == 2]
    return float(sum(type_bytes(t) for t in small) + sum(rows * (d + 4) for d in widths)), \
        0.0, "fusion"
  if "topk" in name:
    return float(data.rows * ctx * 4 + data.rows * (data.model.index_topk or ctx) * 4), 0.0, "fusion"
  if "matmul" in name and ("int4" in name or "fp8_grouped" in name):
    _, out = _shape(launch.results[0])
    # K from the packed INT4 weights (two 4-bit values per byte along K), else from the first
    # bf16 operand (the activations); N from the result.
    packed = [s for t in ops for d, s in [_shape(t)] if d in ("u8", "s8") and len(s) >= 2]
    acts = [s for t in ops for d, s in [_shape(t)] if d == "bf16" and len(s) == 2]
    k_dim = packed[0][-2] * 2 if packed else (acts[0][-1] if acts else 0)
    n_dim = out[-1]
    kind = "fp8_grouped" if "fp8" in name else "int4"
    if "grouped" in name:
      return (*_grouped_cost(launch, data, k_dim, n_dim), kind)
    return _io(launch), 2.0 * out[0] * k_dim * n_dim, kind
  return _io(launch), 0.0, "fusion"


def launch_time(launch: Launch, data: StepData, eff: Efficiency,
                hw: HardwareConfig = H200) -> tuple[float, str, float, float]:
  """(seconds per run, kind, bytes, FLOPs) of one launch; the launch gap included."""
  if launch.kind == "collective":
    n = data.tp
    factor = {"all-reduce": 2 * (n - 1) / n}.get(launch.op, (n - 1) / n)
    return (eff.collective_alpha_s + launch.bytes * factor / eff.nvlink_bytes_s,
            "collective", float(launch.bytes), 0.0)
  if launch.kind == "pallas":
    nbytes, flops, kind = pallas_cost(launch, data)
  else:
    nbytes, flops = float(launch.bytes), float(launch.flops)
    kind = "gemm" if flops else "fusion"
  fp8 = any(t.startswith("f8") for t in launch.operands)
  if kind in ("attention", "sparse", "index"):
    share = {"attention": eff.attention_fp8_bw if fp8 else eff.attention_bw,
             "sparse": eff.sparse_bw, "index": eff.index_bw}[kind]
    bw, rate = share * hw.hbm_bandwidth, eff.attention_flops * hw.bf16_flops
  elif kind in ("int4", "fp8_grouped"):
    bw = (eff.int4_bw if kind == "int4" else eff.fp8_grouped_bw) * hw.hbm_bandwidth
    # Both weight-only kernels dequantise to bf16 and run bf16 MMAs.
    rate = eff.bf16_gemm_flops * hw.bf16_flops
  elif kind == "gemm":
    bw = eff.gemm_bw * hw.hbm_bandwidth
    rate = (eff.fp8_gemm_flops * hw.fp8_flops if fp8 and hw.fp8_flops
            else eff.bf16_gemm_flops * hw.bf16_flops)
  else:
    bw, rate = eff.fusion_bw * hw.hbm_bandwidth, eff.bf16_gemm_flops * hw.bf16_flops
  return max(nbytes / bw, flops / rate) + eff.launch_gap_s, kind, nbytes, flops


def step_time(program: list[Launch], data: StepData, eff: Efficiency, *,
              moe_layer: str | None = None, moe_layers: int = 1,
              hw: HardwareConfig = H200) -> dict:
  """The step's predicted time, and where it goes.

  Args:
    program: the compiled program's launches (``pallas_kernels.h200.program.launches``).
    data: the step's data.
    eff: efficiencies and constants.
    moe_layer: the program's one MoE layer ("layer_1"); its launches run
      ``moe_layers`` times (the full model's MoE layers), the rest once.
    moe_layers: MoE layers of the full model.
    hw: the GPU.

  Returns:
    {"seconds", "launches" (per step, loop trip counts and MoE repeats included),
     "kernel_launches" (those that pay the launch gap: all but collectives),
     "loop_launches" (those inside loops, their trip counts included),
     "by_kind": {kind: {"seconds", "launches", "bytes", "flops"}},
     "moe_layer": the same split for one MoE layer, "layer_launches": launches per MoE layer}.
  """
  total, count, kernels, looped = 0.0, 0, 0, 0
  by_kind: dict[str, dict] = {}
  layer: dict[str, dict] = {}
  layer_launches = 0
  for ln in program:
    t, kind, nbytes, flops = launch_time(ln, data, eff, hw)
    in_layer = moe_layer is not None and ln.layer == moe_layer
    runs = ln.count * (moe_layers if in_layer else 1)
    total += t * runs
    count += runs
    kernels += runs if ln.kind != "collective" else 0
    looped += runs if ln.count > 1 else 0
    for table, n in ((by_kind, runs), (layer, ln.count)) if in_layer else ((by_kind, runs),):
      row = table.setdefault(kind, {"seconds": 0.0, "launches": 0, "bytes": 0.0, "flops": 0.0})
      row["seconds"] += t * n
      row["launches"] += n
      row["bytes"] += nbytes * n
      row["flops"] += flops * n
    if in_layer:
      layer_launches += ln.count
  return {"seconds": total, "launches": count, "kernel_launches": kernels,
          "loop_launches": looped, "by_kind": by_kind,
          "moe_layer": layer,
          "layer_launches": layer_launches}


def calibrate_gap(points: list[tuple[list[Launch], StepData, dict]], reported: dict[int, float],
                  eff: Efficiency) -> float:
  """The launch gap (s) that best fits reported decode tok/s (least squares on log tok/s).

  Args:
    points: per concurrency c of ``reported``: (its program, its data, step_time's keyword
      arguments).
    reported: concurrency -> tok/s.
    eff: the other constants.

  Returns:
    The gap in seconds, within [0, 100 us].

  Raises:
    ValueError: no point to fit.
  """
  if not points:
    raise ValueError("calibrate_gap: no reported point")

  # A step's time is linear in the gap: its time without one plus the gap per kernel launch.
  fixed = []
  for program, data, kw in points:
    r = step_time(program, data, eff.with_gap(0.0), **kw)
    fixed.append((data.rows, r["seconds"], r["kernel_launches"]))

  def loss(gap: float) -> float:
    return sum((math.log(reported[c]) - math.log(c / (t + gap * n))) ** 2 for c, t, n in fixed)
  lo, hi = 0.0, 100e-6
  for _ in range(60):  # the loss is unimodal in the gap: ternary search
    m1, m2 = lo + (hi - lo) / 3, hi - (hi - lo) / 3
    if loss(m1) < loss(m2):
      hi = m2
    else:
      lo = m1
  return (lo + hi) / 2


def job_data(model: ModelConfig, kind: str, rows: int, tokens_per_row: int,
             mean_context: float) -> tuple[StepData, dict]:
  """A compiled job's StepData and step_time keyword arguments (its one MoE layer run
  once per MoE layer of the full model). A prefill row attends half its chunk on average."""
  if kind == "decode":
    data = StepData(model, rows, rows, mean_context)
  else:
    data = StepData(model, rows, rows * tokens_per_row, tokens_per_row / 2)
  return data, {"moe_layer": f"layer_{model.first_k_dense}", "moe_layers": model.n_moe_layers}


def predict(entries: list[dict], calibrate_on: dict[int, float] | None,
            eff: Efficiency = Efficiency()) -> dict:
  """Calibrates the launch gap on one reported column, then times every entry.

  Args:
    entries: per compiled job {"key", "program" (launches), "data", "kw", "column"
      (a label, e.g. "kimi bf16 KV decode"), "calibrate" (bool: in the fitted column),
      "report" (the report's tok/s, or None)}.
    calibrate_on: the fitted column's reported tok/s by concurrency, or None to keep
      ``eff.launch_gap_s``.
    eff: efficiencies.

  Returns:
    {"launch_gap_s", "fitted" (whether the gap was fitted), "rows": per entry {"key", "column", "rows", "tokens", "step_ms",
     "tok_s", "report", "ratio", "within_25", "launches", "layer_launches", "loop_launches",
     "by_kind",
     "moe_layer"}}.
  """
  if calibrate_on:
    points = [(e["program"], e["data"], e["kw"]) for e in entries if e["calibrate"]]
    eff = eff.with_gap(calibrate_gap(points, calibrate_on, eff))
  rows = []
  for e in entries:
    r = step_time(e["program"], e["data"], eff, **e["kw"])
    tok_s = e["data"].tokens / r["seconds"]
    ratio = tok_s / e["report"] if e["report"] else None
    rows.append({"key": e["key"], "column": e["column"], "rows": e["data"].rows,
                 "tokens": e["data"].tokens, "step_ms": 1e3 * r["seconds"], "tok_s": tok_s,
                 "report": e["report"], "ratio": ratio,
                 "within_25": None if ratio is None else abs(ratio - 1) <= 0.25,
                 "launches": r["launches"], "layer_launches": r["layer_launches"],
                 "loop_launches": r["loop_launches"],
                 "by_kind": r["by_kind"], "moe_layer": r["moe_layer"]})
  return {"launch_gap_s": eff.launch_gap_s, "fitted": bool(calibrate_on), "rows": rows}
