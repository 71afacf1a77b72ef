"""disagg (lever 3): the report's disaggregated pools vs one colocated bf16 engine.

* **disaggregated** (``mlkit.engine.disagg``, the report's recipe): a prefill pool
  with FP8_ALL weights and a bf16 KV cache on one half of the devices, a decode
  pool with INT4_EXPERTS weights and an fp8 KV cache on the other half; each
  finished prompt's KV moves bf16 -> fp8 into the decode pool, checked by
  checksums.
* **colocated bf16**: one engine, dense weights (the checkpoint's dtype) and a bf16
  KV cache, on all the same devices (tensor parallel), doing prefill and decode.

Both serve the same stream of requests: half arrive at once, the rest one per
engine step. Per run: output tokens / wall time, time to first token (TTFT) and
time per output token (TPOT, (last token - first token) / (tokens - 1)) per
request, quoted as median and p95 over requests. Whole runs alternate between
the two (A B, B A, ...; TTFT is wall-clock, so the two cannot share steps), after
one warm-up run each; ratios are per pair.

Needs at least two devices: a GPU machine with two or more GPUs, or CPU "devices"
(``python -m experiments`` sets ``--xla_force_host_platform_device_count=2``
before JAX starts; the tests use 8). On CPU both pools share the same cores, so
what carries over is the plumbing and the ratios, not the overlap.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np

from experiments import common
from mlkit import kvcache as kvc
from mlkit.engine import EngineConfig, request_metrics
from mlkit.engine.disagg import DisaggConfig, PoolConfig, build_serving_engine
from mlkit.measure import median_range, stats
from mlkit.parallel import MeshConfig
from mlkit.quant import BF16, FP8_ALL, INT4_EXPERTS
from mlkit.sampling import SamplingParams

SHAPES = {
    "smoke": dict(requests=3, prompt=16, new_tokens=6, page_size=8, max_running=2, repeats=1),
    "quick": dict(requests=12, prompt=96, new_tokens=24, page_size=16, max_running=8, repeats=2),
    "full": dict(requests=32, prompt=448, new_tokens=64, page_size=16, max_running=16, repeats=3),
}
VARIANTS = ("disaggregated", "colocated_bf16")


def configs(cfg, shape: dict, n_devices: int) -> dict[str, DisaggConfig]:
  """The two serving setups on ``n_devices`` (even, >= 2) devices.

  Raises:
    ValueError: fewer than two devices.
  """
  if n_devices < 2:
    raise ValueError("disagg needs at least 2 devices (one per pool); this machine has "
                     f"{n_devices}. On CPU set XLA_FLAGS=--xla_force_host_platform_device_count=2 "
                     "before JAX starts (python -m experiments does).")
  half = n_devices // 2
  pps = -(-(shape["prompt"] + shape["new_tokens"]) // shape["page_size"])
  r = shape["max_running"]

  def pool(dtype, recipe, devices):
    eng = EngineConfig(
        model=cfg, kv=kvc.KVCacheConfig(r * pps + 4, shape["page_size"], dtype),
        max_running=r, batch_buckets=(r,), prefill_buckets=(shape["prompt"],),
        prefill_token_budget=shape["prompt"], max_pages_per_seq=pps,
        backend=common.local_backend())
    return PoolConfig(eng, recipe, MeshConfig(tensor=devices))

  return {
      "disaggregated": DisaggConfig(prefill=pool("bfloat16", FP8_ALL, half),
                                    decode=pool("float8_e4m3fn", INT4_EXPERTS, half)),
      # The colocated pool serves alone on all the devices both pools use.
      "colocated_bf16": DisaggConfig(prefill=pool("bfloat16", BF16, 2 * half),
                                     decode=pool("bfloat16", BF16, 2 * half), mode="colocated"),
  }


def _serve(eng, prompts, new_tokens: int) -> dict:
  """Half the prompts arrive at once, the rest one per step; runs to the end."""
  sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
  t0 = time.perf_counter()
  reqs, steps = eng.serve_arriving(prompts, sp, at_once=len(prompts) // 2 or 1,
                                   max_steps=100 * len(prompts) * new_tokens)
  wall = time.perf_counter() - t0
  ms = [request_metrics(r) for r in reqs]
  done = [m for m in ms if m["status"] == "finished"]
  tokens = sum(m["output_tokens"] for m in ms)
  return {"wall_s": wall, "steps": steps, "output_tokens": tokens, "throughput_tok_s": tokens / wall,
          "finished": len(done), "aborted": len(ms) - len(done),
          "ttft_ms": stats([1e3 * m["ttft_s"] for m in done]),
          "tpot_ms": stats([1e3 * m["tpot_s"] for m in done if m["tpot_s"] is not None])}


def run(out_dir: str, *, quick: bool = True, smoke: bool = False) -> dict:
  """Compares the disaggregated pools with colocated bf16 serving; writes disagg.*.

  Args:
    out_dir: folder for disagg.json, disagg.md and disagg.png.
    quick: TINY_MLA, 12 requests of 96 + 24 tokens, 2 pairs of runs.
    smoke: one-layer TINY_MLA, 3 short requests (tests).

  Returns:
    The JSON record.

  Raises:
    ValueError: fewer than 2 devices.
  """
  mode = "smoke" if smoke else ("quick" if quick else "full")
  shape = SHAPES[mode]
  cfg = common.local_model(quick, smoke)
  devices = jax.devices()
  n = min(len(devices) - len(devices) % 2, 8)
  setups = configs(cfg, shape, n)
  common.progress(f"disagg: {cfg.name} on {n} {devices[0].device_kind} devices, "
                  f"{shape['requests']} requests of {shape['prompt']} + {shape['new_tokens']}")
  from mlkit.model import init_params
  ckpt = init_params(cfg, jax.random.key(0))
  engines = {v: build_serving_engine(ckpt, setups[v], devices=devices[:n]) for v in VARIANTS}
  rng = np.random.default_rng(0)

  def prompts():
    return [rng.integers(0, cfg.vocab_size, shape["prompt"]).tolist()
            for _ in range(shape["requests"])]
  warm = prompts()
  for v in VARIANTS:  # warm-up: one whole run each compiles every step and transfer shape
    common.progress(f"disagg: warm-up {v}")
    _serve(engines[v], warm, shape["new_tokens"])
  pairs = []
  for rep in range(shape["repeats"]):
    ps = prompts()
    order = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]
    res = {v: _serve(engines[v], ps, shape["new_tokens"]) for v in order}
    d, c = res["disaggregated"], res["colocated_bf16"]
    pairs.append({**res, "first": order[0],
                  "throughput_ratio": d["throughput_tok_s"] / c["throughput_tok_s"],
                  "ttft_ratio": d["ttft_ms"]["median"] / c["ttft_ms"]["median"],
                  "tpot_ratio": (d["tpot_ms"]["median"] / c["tpot_ms"]["median"]
                                 if c["tpot_ms"]["median"] else None)})
    common.progress(f"disagg: pair {rep + 1}: throughput {d['throughput_tok_s']:,.0f} vs "
                    f"{c['throughput_tok_s']:,.0f} tok/s, TTFT {d['ttft_ms']['median']:.1f} vs "
                    f"{c['ttft_ms']['median']:.1f} ms, TPOT {d['tpot_ms']['median']:.2f} vs "
                    f"{c['tpot_ms']['median']:.2f} ms (disaggregated vs colocated)")
  summary = {}
  for v in VARIANTS:
    summary[v] = {k: stats([p[v][k] for p in pairs]) for k in ("throughput_tok_s",)}
    summary[v]["ttft_ms_median"] = stats([p[v]["ttft_ms"]["median"] for p in pairs])
    summary[v]["ttft_ms_p95"] = stats([p[v]["ttft_ms"]["p95"] for p in pairs])
    summary[v]["tpot_ms_median"] = stats([p[v]["tpot_ms"]["median"] for p in pairs])
    summary[v]["tpot_ms_p95"] = stats([p[v]["tpot_ms"]["p95"] for p in pairs])
  ratios = {k: stats([p[k] for p in pairs if p[k] is not None])
            for k in ("throughput_ratio", "ttft_ratio", "tpot_ratio")}
  dm = engines["disaggregated"].metrics()["disagg"]
  record = common.record_header("disagg", quick=quick, smoke=smoke, config={
      "model": cfg.to_dict(), "shape": shape, "devices": n,
      "disaggregated": {"prefill": f"{FP8_ALL.name} weights, bf16 KV, {n // 2} device(s)",
                        "decode": f"{INT4_EXPERTS.name} weights, fp8 KV, {n // 2} device(s)"},
      "colocated_bf16": f"{BF16.name} weights (checkpoint dtype {cfg.param_dtype}), bf16 KV, "
                        f"{n} device(s)"})
  record.update(pairs=pairs, summary=summary, ratios=ratios, transfer_metrics=dm)
  common.write_json(out_dir, "disagg", record)
  _plot(os.path.join(out_dir, "disagg.png"), summary, record)

  rows = [[v, median_range(summary[v]["throughput_tok_s"], 0),
           median_range(summary[v]["ttft_ms_median"]), median_range(summary[v]["ttft_ms_p95"]),
           median_range(summary[v]["tpot_ms_median"], 2),
           median_range(summary[v]["tpot_ms_p95"], 2)] for v in VARIANTS]
  md = [
      "# disagg (lever 3: disaggregated prefill/decode)\n\n",
      f"`{cfg.name}` on {n} `{record['machine']['device_kind']}` devices "
      f"({record['kernel_backend']} kernels); {shape['requests']} requests of {shape['prompt']} "
      f"prompt + {shape['new_tokens']} new tokens, half at once and one per step after; "
      f"{shape['repeats']} pair(s) of whole runs, order alternated. Values: median [min, max] "
      "over runs of each run's per-request median or p95.\n\n",
      "- disaggregated: " + record["config"]["disaggregated"]["prefill"] + " (prefill pool); "
      + record["config"]["disaggregated"]["decode"] + " (decode pool)\n",
      "- colocated_bf16: " + record["config"]["colocated_bf16"] + "\n\n",
      common.markdown_table(["setup", "output tok/s", "TTFT ms (median)", "TTFT ms (p95)",
                             "TPOT ms (median)", "TPOT ms (p95)"], rows),
      "\nDisaggregated / colocated (per pair): throughput "
      f"{median_range(ratios['throughput_ratio'], 3)}, "
      f"TTFT {median_range(ratios['ttft_ratio'], 3)}, "
      f"TPOT {median_range(ratios['tpot_ratio'], 3)}.\n\n"
      f"KV transfers: {dm['transfers']} ({dm['transfer_bytes']:,} B, "
      f"{dm['transfer_seconds']:.3f} s), {dm['transfer_retries']} retries, "
      f"{dm['transfer_failures']} failures; {dm['overlapped_iterations']} of {dm['iterations']} "
      "iterations ran a prefill and a decode step at the same time.\n\n"
      "The report gives no figures for this lever. On CPU the two pools share the same cores, "
      "so the overlap that makes disaggregation pay on GPUs cannot show here.\n",
      "\n![disagg](disagg.png)\n",
  ]
  common.write_markdown(out_dir, "disagg", "".join(md))
  return record


def _plot(path: str, summary: dict, record: dict) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(10, 3.4))
  for ax, (key, label) in zip(axes, (("throughput_tok_s", "output tok/s"),
                                     ("ttft_ms_median", "TTFT ms (median)"),
                                     ("tpot_ms_median", "TPOT ms (median)"))):
    vals = [summary[v][key]["median"] or 0.0 for v in VARIANTS]
    lo = [v - (summary[k][key]["min"] or 0.0) for v, k in zip(vals, VARIANTS)]
    hi = [(summary[k][key]["max"] or 0.0) - v for v, k in zip(vals, VARIANTS)]
    ax.bar(range(len(VARIANTS)), vals, yerr=[lo, hi], color=["tab:green", "tab:gray"])
    ax.set_xticks(range(len(VARIANTS)), ["disagg", "coloc bf16"])
    ax.set_title(label, fontsize=9)
  fig.suptitle(f"{record['config']['model']['name']} on {record['machine']['device_kind']}",
               fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
