"""weight_quant (lever 2): decode and prefill throughput, and weight memory, per weight recipe.

Three engines serve the same requests from one checkpoint, quantised by each
recipe: the dense checkpoint as it is (``bf16`` recipe: the model's param dtype,
bf16 on a GPU, f32 for the CPU presets), ``FP8_ALL`` (how GLM 5.2 ships) and
``INT4_EXPERTS`` (routed experts int4 group 32, how Kimi K2.6 ships). The KV
cache is the same bf16 pool in all three, large enough that no concurrency runs
out of memory, so only the weights differ.

* Decode: for each concurrency the three engines are stepped alternately (one
  step each per round); steady decode steps (every request decoding, no
  prefill; the first two dropped as warm-up) give tokens/s, quoted as median
  [min, max], and INT4 / FP8 ratios come from the same interleaved run.
* Prefill: requests with one output token, so every step is one prefill chunk of
  the whole prompt; prompt tokens / step time, interleaved likewise.
* Weight memory per device: ``mlkit.quant.weight_bytes`` of the local params, and
  of the GLM 5.2 and Kimi K2.6 checkpoints at 8-way tensor parallelism (the
  report: GLM 88 -> 52 GB per GPU).
"""

from __future__ import annotations

import os

import jax
import numpy as np

from configs import GLM_5_2, KIMI_K2_6
from experiments import common
from mlkit import kvcache as kvc
from mlkit.engine import Engine, EngineConfig
from mlkit.measure import median_range, stats
from mlkit.model import init_params
from mlkit.quant import BF16, FP8_ALL, GIB, INT4_EXPERTS, checkpoint_specs, quantize_params
from mlkit.quant import weight_bytes
from mlkit.sampling import SamplingParams

RECIPES = (BF16, FP8_ALL, INT4_EXPERTS)
# Smoke mode compares only the two the lever is about (each recipe's tree compiles its own steps).
SMOKE_RECIPES = (FP8_ALL, INT4_EXPERTS)
# The report's GLM 5.2 decode tok/s with fp8 weights at concurrency 1/8/16/32/64 (docs/report.md).
REPORT_FP8 = {1: 60, 8: 425, 16: 683, 32: 994, 64: 1672}
# The report's GLM 5.2 weight memory per GPU at TP 8 (GiB, see mlkit.quant.accounting).
REPORT_GLM_PER_GPU_GIB = {FP8_ALL.name: 88, INT4_EXPERTS.name: 52}
WARMUP_STEPS = 2
SHAPES = {
    "smoke": dict(concurrency=(2,), prompt=16, new_tokens=5, page_size=8, prefill_requests=2,
                  batch_buckets=(2,)),
    # Outputs longer than the top concurrency: one prompt is prefilled per step, and all
    # requests must be decoding together for the steady steps.
    "quick": dict(concurrency=(1, 8, 32), prompt=64, new_tokens=48, page_size=16,
                  prefill_requests=4),
    "full": dict(concurrency=(1, 8, 16, 32, 64), prompt=256, new_tokens=96, page_size=16,
                 prefill_requests=8),
}


def _engine(params, cfg, shape: dict) -> Engine:
  conc = shape.get("batch_buckets") or tuple(sorted(set((1,) + tuple(shape["concurrency"]))))
  pps = -(-(shape["prompt"] + shape["new_tokens"]) // shape["page_size"])
  ecfg = EngineConfig(
      model=cfg, kv=kvc.KVCacheConfig(num_pages=max(conc) * pps + 4,
                                      page_size=shape["page_size"], dtype="bfloat16"),
      max_running=max(conc), batch_buckets=conc, prefill_buckets=(shape["prompt"],),
      prefill_token_budget=shape["prompt"], max_pages_per_seq=pps,
      backend=common.local_backend())
  return Engine(params, ecfg)


def paper_weight_memory() -> list[dict]:
  """Weight bytes per GPU at TP 8 for GLM 5.2 and Kimi K2.6 under each recipe."""
  rows = []
  for cfg in (GLM_5_2, KIMI_K2_6):
    specs = checkpoint_specs(cfg)
    for recipe in RECIPES:
      wb = weight_bytes(specs, recipe, tp=8)
      rows.append({"model": cfg.name, "recipe": recipe.name, "total_gib": wb.total / GIB,
                   "per_gpu_gib": wb.per_device / GIB,
                   "report_per_gpu_gib": (REPORT_GLM_PER_GPU_GIB.get(recipe.name)
                                          if cfg is GLM_5_2 else None)})
  return rows


def run(out_dir: str, *, quick: bool = True, smoke: bool = False) -> dict:
  """Decode/prefill throughput and weight memory for dense, FP8 and INT4 weights.

  Args:
    out_dir: folder for weight_quant.json, .md and .png.
    quick: TINY_MLA, concurrency 1/8/32, 64-token prompts (CPU, about a minute).
    smoke: one-layer TINY_MLA, concurrency 2 (tests).

  Returns:
    The JSON record.
  """
  mode = "smoke" if smoke else ("quick" if quick else "full")
  shape = SHAPES[mode]
  cfg = common.local_model(quick, smoke)
  recipes = SMOKE_RECIPES if smoke else RECIPES
  common.progress(f"weight_quant: {cfg.name}, recipes {[r.name for r in recipes]}, concurrency "
                  f"{shape['concurrency']}, prompt {shape['prompt']} + {shape['new_tokens']}")
  ckpt = init_params(cfg, jax.random.key(0))
  trees = {r.name: quantize_params(ckpt, r) for r in recipes}
  local_mem = {n: weight_bytes(t).per_device for n, t in trees.items()}
  local_dense = weight_bytes(ckpt).per_device
  engines = {n: _engine(t, cfg, shape) for n, t in trees.items()}
  rng = np.random.default_rng(0)
  decode = []
  for c in shape["concurrency"]:
    prompts = [rng.integers(0, cfg.vocab_size, shape["prompt"]).tolist() for _ in range(c)]
    for eng in engines.values():
      for i, p in enumerate(prompts):
        eng.submit(p, SamplingParams(max_new_tokens=shape["new_tokens"], seed=i))
    logs = common.step_interleaved(engines)
    row = {"concurrency": c}
    for name, log in logs.items():
      s, t = log.decode_only(min_running=c)
      s, t = s[WARMUP_STEPS:], t[WARMUP_STEPS:]
      row[name] = stats(list(t / s))
    f, q = row[FP8_ALL.name]["median"], row[INT4_EXPERTS.name]["median"]
    b = row[BF16.name]["median"] if BF16.name in row else None
    row["int4_over_fp8"] = q / f if q and f else None
    row["int4_over_dense"] = q / b if q and b else None
    decode.append(row)
    common.progress(f"weight_quant: decode c={c}: " + ", ".join(
        f"{r.name} {row[r.name]['median'] or float('nan'):,.0f}" for r in recipes) + " tok/s")
  # Prefill: one-token requests, every step is one full-prompt chunk.
  prompts = [rng.integers(0, cfg.vocab_size, shape["prompt"]).tolist()
             for _ in range(shape["prefill_requests"] + 1)]
  for eng in engines.values():
    for p in prompts:
      eng.submit(p, SamplingParams(max_new_tokens=1))
  logs = common.step_interleaved(engines)
  prefill = {}
  for name, log in logs.items():
    secs = [s for s, p in zip(log.seconds, log.prefill) if p][1:]  # first one: warm-up
    prefill[name] = stats([shape["prompt"] / s for s in secs])
  pf = {r.name: prefill[r.name]["median"] for r in recipes}
  prefill_ratio = pf[INT4_EXPERTS.name] / pf[FP8_ALL.name]
  common.progress("weight_quant: prefill " + ", ".join(
      f"{n} {v:,.0f}" for n, v in pf.items()) + f" tok/s; INT4/FP8 {prefill_ratio:.3f}")
  paper = paper_weight_memory()
  record = common.record_header("weight_quant", quick=quick, smoke=smoke, config={
      "model": cfg.to_dict(), "shape": shape, "recipes": [r.name for r in recipes],
      "kv_dtype": "bfloat16", "warmup_steps": WARMUP_STEPS})
  record.update(decode=decode, prefill=prefill, prefill_int4_over_fp8=prefill_ratio,
                local_weight_bytes_per_device=local_mem, local_checkpoint_bytes=local_dense,
                paper_weight_memory=paper,
                report_fp8_decode_tok_s=REPORT_FP8)
  common.write_json(out_dir, "weight_quant", record)
  conc = [d["concurrency"] for d in decode]
  common.plot_lines(os.path.join(out_dir, "weight_quant.png"),
                    {r.name: (conc, [d[r.name]["median"] for d in decode]) for r in recipes},
                    xlabel="concurrency", ylabel="decode tok/s", logx=len(conc) > 1,
                    title=f"{cfg.name} on {record['machine']['device_kind']}: decode tok/s by "
                          "weight recipe")

  rows = [[d["concurrency"]] + [median_range(d[r.name], 0) for r in recipes]
          + ["-" if d["int4_over_fp8"] is None else f"{d['int4_over_fp8']:.2f}",
             REPORT_FP8.get(d["concurrency"], "-")] for d in decode]
  md = [
      "# weight_quant (lever 2: INT4 weights)\n\n",
      f"`{cfg.name}` on `{record['machine']['device_kind']}` ({record['kernel_backend']} kernels), "
      f"bf16 KV, prompts of {shape['prompt']} + {shape['new_tokens']} new tokens; the recipes "
      "are stepped alternately. Decode tok/s: median [min, max] of steady decode steps.\n\n",
      common.markdown_table(["concurrency"] + [r.name for r in recipes]
                            + ["INT4/FP8", "report fp8 (GLM, 8xH200)"], rows),
      f"\n## Prefill (one {shape['prompt']}-token chunk per step)\n\n",
      common.markdown_table(["recipe", "prefill tok/s", "weights on this device (B)"],
                            [[r.name, median_range(prefill[r.name], 0), local_mem[r.name]]
                             for r in recipes]),
      f"\nINT4/FP8 prefill ratio: **{prefill_ratio:.3f}** (the report: INT4 prefill is slower, "
      "it pays for unpacking).\n",
      "\n## Weight memory per GPU at paper scale (TP 8, GiB)\n\n",
      common.markdown_table(["model", "recipe", "total GiB", "per GPU GiB", "report per GPU"],
                            [[p["model"], p["recipe"], p["total_gib"], p["per_gpu_gib"],
                              p["report_per_gpu_gib"] or "-"] for p in paper]),
      "\n![weight_quant](weight_quant.png)\n",
  ]
  common.write_markdown(out_dir, "weight_quant", "".join(md))
  return record
