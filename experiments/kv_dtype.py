"""kv_dtype (lever 1): decode throughput vs concurrency with a bf16 vs an fp8 KV cache.

Both variants get the same KV byte budget. It is sized from the request shape so
that the fp8 pool holds ``max(concurrency)`` sequences at full length (prompt +
output) and the bf16 pool, with half the bytes per value, does not: the report's
shape (bf16 runs out of memory at 64, fp8 still runs).

**Out of memory, precisely.** A concurrency ``c`` is *out of memory* (OOM) for a
KV dtype when the engine, given ``c`` requests of the shape at once, cannot run
them together to completion: at least one request was preempted (its pages taken
back and recomputed later) or fewer than ``c`` requests were ever decoding in the
same step. The engine never fails a request for lack of memory: requests that
cannot be admitted wait, and running ones that cannot grow are preempted. The
record also carries the static prediction (pool pages minus the admission
reserve >= c x pages per sequence) beside the observed outcome.

**Timing.** For each concurrency the bf16 and fp8 engines are stepped
alternately (one step each per round), so both see the same machine load. The
decode throughput of a run counts only *steady* decode steps: no prefill in the
step and all ``c`` requests emitting a token; the first two steady steps are
warm-up and dropped. Per-step tokens/s are quoted as median with min/max; the
fp8/bf16 ratio is the ratio of the two medians from the same interleaved run.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from experiments import common
from mlkit import kvcache as kvc
from mlkit.engine import Engine, EngineConfig
from mlkit.measure import stats
from mlkit.model import init_params
from mlkit.sampling import SamplingParams

DTYPES = ("bfloat16", "float8_e4m3fn")
# The report's Kimi K2.6 decode tok/s with a bf16 KV cache (docs/report.md); None = OOM.
REPORT_BF16 = {1: 137, 8: 731, 16: 1106, 32: 1558, 64: None}
# Steady decode steps dropped per run as warm-up (the first may compile its batch bucket).
WARMUP_STEPS = 2

# Request shapes and concurrencies per mode.
SHAPES = {
    # One batch bucket in smoke mode, so each dtype compiles one prefill and one decode step.
    "smoke": dict(concurrency=(1, 2), prompt=8, new_tokens=6, page_size=8, batch_buckets=(2,)),
    # Outputs longer than the top concurrency: prefill admits one prompt per step, so the
    # first request must still be decoding when the last one starts.
    "quick": dict(concurrency=(1, 8, 16, 32, 64), prompt=64, new_tokens=96, page_size=16),
    "full": dict(concurrency=(1, 8, 16, 32, 64), prompt=384, new_tokens=128, page_size=16),
}


def kv_budget(cfg, shape: dict) -> dict:
  """The fixed KV budget of a mode's shape: the fp8 pool holds max(concurrency) full
  sequences, bf16 fewer (``mlkit.kvcache.separating_budget``)."""
  return kvc.separating_budget(cfg, concurrency=max(shape["concurrency"]),
                               prompt_tokens=shape["prompt"], new_tokens=shape["new_tokens"],
                               page_size=shape["page_size"], warmup_steps=WARMUP_STEPS)


def _engine(params, cfg, dtype: str, pages: int, shape: dict, pps: int) -> Engine:
  conc = shape.get("batch_buckets") or tuple(sorted(set((1,) + tuple(shape["concurrency"]))))
  ecfg = EngineConfig(
      model=cfg, kv=kvc.KVCacheConfig(num_pages=pages, page_size=shape["page_size"], dtype=dtype),
      max_running=max(conc), batch_buckets=conc, prefill_buckets=(shape["prompt"],),
      # One prompt chunk per step: prefill always runs one row, so it compiles once.
      prefill_token_budget=shape["prompt"], max_pages_per_seq=pps,
      backend=common.local_backend())
  return Engine(params, ecfg)


def _summarise(eng: Engine, log: common.StepLog, c: int, preempt_before: int, fits: int) -> dict:
  steady_s, steady_t = log.decode_only(min_running=c)
  steady_s, steady_t = steady_s[WARMUP_STEPS:], steady_t[WARMUP_STEPS:]
  dec_s, dec_t = log.decode_only()
  dec_s, dec_t = dec_s[WARMUP_STEPS:], dec_t[WARMUP_STEPS:]
  preempted = eng.stats.preemptions - preempt_before
  peak = int(max((t for t, p in zip(log.tokens, log.prefill) if not p), default=0))
  oom = preempted > 0 or peak < c or steady_s.size == 0
  per_step = stats(list(steady_t / steady_s)) if steady_s.size else stats([])
  return {
      "concurrency": c, "oom": bool(oom), "predicted_oom": fits < c,
      "preemptions": int(preempted), "peak_decoding": peak,
      "steady_steps": int(steady_s.size),
      "decode_tok_s": per_step["median"] if not oom else None,
      "decode_tok_s_stats": per_step,
      "step_ms": stats(list(1e3 * steady_s)),
      # Everything decode-only, full batch or not: what an overloaded pool still delivers.
      "achieved_decode_tok_s": float(dec_t.sum() / dec_s.sum()) if dec_s.size else None,
      "steps": len(log.seconds),
  }


def run(out_dir: str, *, quick: bool = True, smoke: bool = False) -> dict:
  """Sweeps concurrency with bf16 and fp8 KV pools of one byte budget; writes kv_dtype.*.

  Args:
    out_dir: folder for kv_dtype.json, kv_dtype.md and kv_dtype.png.
    quick: TINY_MLA with short requests (CPU, about a minute) instead of the full shape.
    smoke: one-layer TINY_MLA, concurrency 1 and 2, a few tokens (tests).

  Returns:
    The JSON record: ``runs`` has one entry per (concurrency, dtype).
  """
  mode = "smoke" if smoke else ("quick" if quick else "full")
  shape = SHAPES[mode]
  cfg = common.local_model(quick, smoke)
  plan = kv_budget(cfg, shape)
  common.progress(f"kv_dtype: {cfg.name}, KV budget {plan['budget_bytes'] / 2**20:.2f} MiB -> "
                  f"pages {plan['pages']}, full sequences that fit {plan['fits']}; prompt "
                  f"{shape['prompt']} + {shape['new_tokens']} new tokens")
  params = init_params(cfg, jax.random.key(0))
  engines = {d: _engine(params, cfg, d, plan["pages"][d], shape, plan["pages_per_seq"])
             for d in DTYPES}
  rng = np.random.default_rng(0)
  runs = []
  for c in shape["concurrency"]:
    prompts = [rng.integers(0, cfg.vocab_size, shape["prompt"]).tolist() for _ in range(c)]
    before = {d: e.stats.preemptions for d, e in engines.items()}
    for d, e in engines.items():
      for i, p in enumerate(prompts):
        e.submit(p, SamplingParams(max_new_tokens=shape["new_tokens"], temperature=0.0, seed=i))
    logs = common.step_interleaved(engines)
    for d in DTYPES:
      r = _summarise(engines[d], logs[d], c, before[d], plan["fits"][d])
      r["dtype"] = d
      runs.append(r)
      tps = "OOM" if r["oom"] else f"{r['decode_tok_s']:,.0f} tok/s"
      common.progress(f"kv_dtype: c={c:>3} {d:<14} {tps} (peak {r['peak_decoding']} decoding, "
                      f"{r['preemptions']} preemptions)")
  ratios = {}
  for c in shape["concurrency"]:
    b, f = (next(r for r in runs if r["concurrency"] == c and r["dtype"] == d) for d in DTYPES)
    ratios[c] = (f["decode_tok_s"] / b["decode_tok_s"]
                 if b["decode_tok_s"] and f["decode_tok_s"] else None)
  record = common.record_header("kv_dtype", quick=quick, smoke=smoke, config={
      "model": cfg.to_dict(), "shape": shape, "budget": plan, "warmup_steps": WARMUP_STEPS,
      "oom_definition": "preempted > 0 or peak decoding < c (see module docstring)"})
  record.update(runs=runs, fp8_over_bf16=ratios, report_bf16_tok_s=REPORT_BF16)
  oom = {d: [r["concurrency"] for r in runs if r["dtype"] == d and r["oom"]] for d in DTYPES}
  record["oom_concurrency"] = oom
  record["report_shape_reproduced"] = (max(shape["concurrency"]) in oom["bfloat16"]
                                       and not oom["float8_e4m3fn"])
  common.write_json(out_dir, "kv_dtype", record)
  conc = list(shape["concurrency"])
  series = {f"{d} KV (measured)": (conc, [next(r["decode_tok_s"] for r in runs
                                                if r["concurrency"] == c and r["dtype"] == d)
                                           for c in conc]) for d in DTYPES}
  common.plot_lines(os.path.join(out_dir, "kv_dtype.png"), series, xlabel="concurrency",
                    ylabel="decode tok/s", logx=True, marks=oom,
                    title=f"{cfg.name} on {record['machine']['device_kind']}: decode tok/s at a "
                          f"{plan['budget_bytes'] / 2**20:.1f} MiB KV budget")
  rows = []
  for c in conc:
    row = [c]
    for d in DTYPES:
      r = next(r for r in runs if r["concurrency"] == c and r["dtype"] == d)
      s = r["decode_tok_s_stats"]
      row.append("OOM" if r["oom"] else f"{s['median']:,.0f} [{s['min']:,.0f}, {s['max']:,.0f}]")
      row.append(f"{r['peak_decoding']}/{r['preemptions']}")
    row.append("-" if ratios[c] is None else f"{ratios[c]:.2f}")
    rep = REPORT_BF16.get(c, "-")
    row.append("OOM" if rep is None else rep)
    rows.append(row)
  md = [
      "# kv_dtype (lever 1: fp8 KV cache)\n\n",
      f"`{cfg.name}` on `{record['machine']['device_kind']}` ({record['kernel_backend']} kernels), "
      f"requests of {shape['prompt']} prompt + {shape['new_tokens']} new tokens, KV budget "
      f"{plan['budget_bytes']:,} B: {plan['pages']['bfloat16']} bf16 pages vs "
      f"{plan['pages']['float8_e4m3fn']} fp8 pages of {shape['page_size']} tokens "
      f"({plan['fits']['bfloat16']} vs {plan['fits']['float8_e4m3fn']} full sequences).\n\n",
      "Decode tok/s: median [min, max] of steady decode steps (all requests decoding, no "
      "prefill), bf16 and fp8 stepped alternately. peak/preempt = most requests decoding in one "
      "step / preemptions. OOM = the concurrency could not be run together (a preemption, or "
      "fewer than c ever decoding together).\n\n",
      common.markdown_table(["concurrency", "bf16 KV tok/s", "bf16 peak/preempt", "fp8 KV tok/s",
                             "fp8 peak/preempt", "fp8/bf16", "report bf16 (Kimi, 8xH200)"], rows),
      f"\nReport's shape (bf16 OOM at {max(conc)}, fp8 runs everywhere) reproduced: "
      f"**{record['report_shape_reproduced']}**. Absolute CPU numbers are not comparable with the "
      "report's; the ratios and the OOM points are what carry over.\n",
      "\n![kv_dtype](kv_dtype.png)\n",
  ]
  common.write_markdown(out_dir, "kv_dtype", "".join(md))
  return record
