"""integrity (lever 4): what the KV page-integrity defences cost, and what they catch.

The engine has two (docs/integrity.md): the batched page-tag check on the device
before every read (``EngineConfig.integrity_check``) and the host's page audit
around every step (``EngineConfig.page_audit``).

**Cost.** Two engines that differ only in both switches (on: both defences, off:
neither) serve
the same requests: long prompts and short outputs (the report's 8192 in / 1000
out, scaled down to the local model), at concurrency 1, 2, 4 and 8. They are
stepped alternately, one step each per round (a *paired, interleaved* run), and
each pair is repeated with the order swapped. Per run:

* throughput = output tokens / the engine's total step time (prefill + decode);
* per-token latency = the time of each decode-only step (every running request
  receives one token per step), of which the p95 is quoted.

The on/off ratios are taken per pair and quoted as median [min, max].

**Catch.** A fault-injection run (``Engine.inject_fault``) corrupts the
allocator's bookkeeping of some decoding requests (one fault of each kind:
use-after-free, double allocation, wrong page, stale tag) and runs to the end,
with both defences, each one alone, and neither (the control). It counts
*detected* (requests failing a tag check or holding a page the audit
quarantined), *aborted* (requests ended with reason ``integrity``) and
*contaminated* requests: ones that finished normally but whose tokens differ
from a clean run of the same requests (greedy sampling, one batch bucket so
every step has the same shapes and a clean row's tokens are bit-identical).
"""

from __future__ import annotations

import os

import jax
import numpy as np

from experiments import common
from mlkit import kvcache as kvc
from mlkit.engine import ABORT_INTEGRITY, Engine, EngineConfig, Fault, FaultKind, RequestStatus
from mlkit.measure import median_range, stats
from mlkit.model import init_params
from mlkit.sampling import SamplingParams

KV_DTYPE = "float8_e4m3fn"  # the decode pool's cache in the report's recipe
# Steady decode steps dropped per run as warm-up (the first may compile its batch bucket).
WARMUP_STEPS = 2
SHAPES = {
    # Smoke: one batch bucket, so the check-on and check-off engines compile once each; the
    # shapes equal kv_dtype's smoke fp8 engine, so a test session compiles those steps once.
    "smoke": dict(concurrency=(1, 2), prompt=8, new_tokens=4, page_size=8, repeats=1,
                  batch_buckets=(2,), fault_concurrency=2, fault_new_tokens=8),
    "quick": dict(concurrency=(1, 2, 4, 8), prompt=216, new_tokens=36, page_size=16, repeats=6,
                  fault_concurrency=8, fault_new_tokens=36),
    "full": dict(concurrency=(1, 2, 4, 8), prompt=1024, new_tokens=128, page_size=16, repeats=3,
                 fault_concurrency=8, fault_new_tokens=64),
}
FAULT_ORDER = (FaultKind.WRONG_PAGE, FaultKind.STALE_TAG, FaultKind.USE_AFTER_FREE,
               FaultKind.DOUBLE_ALLOCATION)


# Fault-injection arms: name -> (integrity_check, page_audit).
ARMS = {"both on": (True, True), "tag check only": (True, False), "audit only": (False, True),
        "both off": (False, False)}


def _config(cfg, shape: dict, *, check: bool, buckets, faults: bool = False,
            audit: bool | None = None):
  """Every engine of the experiment: room for max(buckets) full sequences plus one reserve page."""
  longest = shape["prompt"] + max(shape["new_tokens"], shape["fault_new_tokens"])
  pps = -(-longest // shape["page_size"])
  c = max(buckets)
  return EngineConfig(
      model=cfg, kv=kvc.KVCacheConfig(num_pages=c * pps + 1, page_size=shape["page_size"],
                                      dtype=KV_DTYPE),
      max_running=c, batch_buckets=tuple(buckets), prefill_buckets=(shape["prompt"],),
      prefill_token_budget=shape["prompt"], max_pages_per_seq=pps, integrity_check=check,
      page_audit=check if audit is None else audit, backend=common.local_backend(),
      enable_fault_injection=faults)


def _run_summary(log: common.StepLog, eng: Engine, gen_before: int) -> dict:
  dec_s, _ = log.decode_only()
  dec_s = dec_s[WARMUP_STEPS:]
  total = float(np.sum(log.seconds))
  tokens = eng.stats.generated_tokens - gen_before
  return {"throughput_tok_s": tokens / total, "output_tokens": int(tokens),
          "steps": len(log.seconds), "total_s": total,
          "token_latency_ms": stats(list(1e3 * dec_s))}


def _timing(params, cfg, shape, rng) -> list[dict]:
  buckets = shape.get("batch_buckets") or shape["concurrency"]
  engines = {on: Engine(params, _config(cfg, shape, check=on, buckets=buckets))
             for on in (True, False)}
  # Warm-up: every concurrency once with a few tokens, so each batch bucket and the prefill
  # step are compiled before anything is timed.
  for c in shape["concurrency"]:
    for on, eng in engines.items():
      for i in range(c):
        eng.submit(rng.integers(0, cfg.vocab_size, shape["prompt"]).tolist(),
                   SamplingParams(max_new_tokens=3, seed=i))
    common.step_interleaved(engines)
  out = []
  for c in shape["concurrency"]:
    pairs = []
    for rep in range(shape["repeats"]):
      prompts = [rng.integers(0, cfg.vocab_size, shape["prompt"]).tolist() for _ in range(c)]
      order = (True, False) if rep % 2 == 0 else (False, True)  # swap who steps first
      before = {on: engines[on].stats.generated_tokens for on in order}
      for on in order:
        for i, p in enumerate(prompts):
          engines[on].submit(p, SamplingParams(max_new_tokens=shape["new_tokens"], seed=i))
      logs = common.step_interleaved({on: engines[on] for on in order})
      res = {on: _run_summary(logs[on], engines[on], before[on]) for on in order}
      pairs.append({
          "on": res[True], "off": res[False], "first": "on" if order[0] else "off",
          "throughput_ratio": res[True]["throughput_tok_s"] / res[False]["throughput_tok_s"],
          "p95_latency_ratio": (res[True]["token_latency_ms"]["p95"]
                                / res[False]["token_latency_ms"]["p95"]
                                if res[False]["token_latency_ms"]["p95"] else None),
      })
    tr = stats([p["throughput_ratio"] for p in pairs])
    lr = stats([p["p95_latency_ratio"] for p in pairs if p["p95_latency_ratio"]])
    out.append({"concurrency": c, "pairs": pairs, "throughput_ratio": tr, "p95_latency_ratio": lr,
                "throughput_on": stats([p["on"]["throughput_tok_s"] for p in pairs]),
                "throughput_off": stats([p["off"]["throughput_tok_s"] for p in pairs]),
                "p95_ms_on": stats([p["on"]["token_latency_ms"]["p95"] for p in pairs]),
                "p95_ms_off": stats([p["off"]["token_latency_ms"]["p95"] for p in pairs])})
    common.progress(f"integrity: c={c}: throughput on/off {tr['median']:.3f} "
                    f"[{tr['min']:.3f}, {tr['max']:.3f}], p95 token latency on/off "
                    f"{lr['median'] if lr['median'] is not None else float('nan'):.3f}")
  return out


def _serve(params, cfg, shape, prompts, *, check: bool, faults: bool,
           audit: bool | None = None) -> tuple[Engine, list]:
  """Serves ``prompts`` (greedy), injecting one fault of each kind once all decode."""
  c = len(prompts)
  eng = Engine(params, _config(cfg, shape, check=check, buckets=(c,), faults=True, audit=audit))
  ids = [eng.submit(p, SamplingParams(max_new_tokens=shape["fault_new_tokens"], temperature=0.0))
         for p in prompts]
  injected = []
  if faults:
    while not all(eng.get(i).status is RequestStatus.DECODING for i in ids):
      eng.step()
    eng.step()  # one clean decode step for everyone first
    for kind, victim in zip(FAULT_ORDER, ids):
      rec = eng.inject_fault(Fault(kind, victim))
      injected.append({"kind": kind.value, "victim": victim, "page": rec.page,
                       "other_page": rec.other_page, "other_owner": rec.other_owner})
  eng.run_until_done(max_steps=50 * shape["fault_new_tokens"])
  return eng, injected


def _faults(params, cfg, shape, rng) -> dict:
  c = shape["fault_concurrency"]
  prompts = [rng.integers(0, cfg.vocab_size, shape["prompt"]).tolist() for _ in range(c)]
  clean, _ = _serve(params, cfg, shape, prompts, check=True, faults=False)
  ref = {rid: list(r.output) for rid, r in clean.requests.items()}
  out = {}
  for arm, (check, audit) in ARMS.items():
    eng, injected = _serve(params, cfg, shape, prompts, check=check, faults=True, audit=audit)
    victims = {f["victim"] for f in injected}
    reqs = eng.requests
    finished = [r for r in reqs.values() if r.status is RequestStatus.FINISHED]
    contaminated = [r.request_id for r in finished if list(r.output) != ref[r.request_id]]
    aborted = [r.request_id for r in reqs.values() if r.abort_reason == ABORT_INTEGRITY]
    for f in injected:  # what became of each victim
      r = reqs[f["victim"]]
      f["outcome"] = ("aborted" if r.abort_reason == ABORT_INTEGRITY else
                      "contaminated" if r.request_id in contaminated else "finished clean")
    out[arm] = {
        "requests": c, "faults": injected,
        "detected": int(eng.stats.integrity_failures),
        "aborted": len(aborted), "aborted_ids": aborted,
        "aborted_non_victims": sorted(set(aborted) - victims),
        "contaminated": len(contaminated), "contaminated_ids": contaminated,
        "finished_clean": len(finished) - len(contaminated),
    }
    o = out[arm]
    common.progress(f"integrity: faults, {arm}: {len(injected)} injected, {o['detected']} "
                    f"detected, {o['aborted']} aborted, {o['contaminated']} contaminated")
  return out


def run(out_dir: str, *, quick: bool = True, smoke: bool = False) -> dict:
  """Measures the tag check's cost (paired, interleaved) and runs fault injection.

  Args:
    out_dir: folder for integrity.json, integrity.md and integrity.png.
    quick: TINY_MLA, 216-token prompts, 36 new tokens, 6 pairs per concurrency.
    smoke: one-layer TINY_MLA, concurrency 1 and 2, a few tokens (tests).

  Returns:
    The JSON record (``timing`` per concurrency; ``faults`` for check on and off).
  """
  mode = "smoke" if smoke else ("quick" if quick else "full")
  shape = SHAPES[mode]
  cfg = common.local_model(quick, smoke)
  common.progress(f"integrity: {cfg.name}, {KV_DTYPE} KV, prompt {shape['prompt']} + "
                  f"{shape['new_tokens']} new tokens, concurrency {shape['concurrency']}, "
                  f"{shape['repeats']} pair(s) each")
  params = init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  timing = _timing(params, cfg, shape, rng)
  faults = _faults(params, cfg, shape, rng)
  record = common.record_header("integrity", quick=quick, smoke=smoke, config={
      "model": cfg.to_dict(), "shape": shape, "kv_dtype": KV_DTYPE,
      "warmup_steps": WARMUP_STEPS})
  on = faults["both on"]
  record.update(timing=timing, faults=faults,
                report_claim="cost under 1% of throughput and of p95 latency",
                no_contamination_with_check=all(faults[a]["contaminated"] == 0
                                                for a in ("both on", "tag check only",
                                                          "audit only")),
                every_victim_detected_or_clean=on["contaminated"] == 0 and on["detected"] >= 1)
  common.write_json(out_dir, "integrity", record)
  conc = [t["concurrency"] for t in timing]
  common.plot_lines(
      os.path.join(out_dir, "integrity.png"),
      {"throughput on/off": (conc, [t["throughput_ratio"]["median"] for t in timing]),
       "p95 token latency on/off": (conc, [t["p95_latency_ratio"]["median"] for t in timing])},
      reference={"report bound (1%)": (conc, [1.01] * len(conc))},
      xlabel="concurrency", ylabel="ratio, check on / off", logx=True,
      title=f"{cfg.name} on {record['machine']['device_kind']}: page-tag check cost")

  rows = [[t["concurrency"], median_range(t["throughput_on"]), median_range(t["throughput_off"]),
           median_range(t["throughput_ratio"], 3), median_range(t["p95_ms_on"], 2),
           median_range(t["p95_ms_off"], 2), median_range(t["p95_latency_ratio"], 3)]
          for t in timing]
  frows = [[k, v["requests"], len(v["faults"]), v["detected"], v["aborted"],
            len(v["aborted_non_victims"]), v["contaminated"], v["finished_clean"]]
           for k, v in faults.items()]
  md = [
      "# integrity (lever 4: KV page-tag check and page audit)\n\n",
      f"`{cfg.name}` on `{record['machine']['device_kind']}` ({record['kernel_backend']} kernels), "
      f"{KV_DTYPE} KV, prompts of {shape['prompt']} tokens and {shape['new_tokens']} new tokens; "
      "both defences (tag check + page audit) on vs off, stepped alternately, "
      f"{shape['repeats']} pair(s) per concurrency with the "
      "order swapped. Values: median [min, max] over pairs; ratios are per pair.\n\n",
      common.markdown_table(["concurrency", "tok/s on", "tok/s off", "throughput on/off",
                             "p95 ms/token on", "p95 ms/token off", "p95 on/off"], rows),
      "\nThe report: cost under 1% of throughput and of p95 latency (ratios within 0.99-1.01). "
      "CPU ratios are noisy; the spread across pairs says how much.\n",
      "\n## Fault injection\n\n",
      f"{shape['fault_concurrency']} greedy requests; once all decode, one fault of each kind "
      f"({', '.join(k.value for k in FAULT_ORDER[:shape['fault_concurrency']])}) hits a different "
      "request. Contaminated = finished normally with tokens that differ from a clean run.\n\n",
      common.markdown_table(["run", "requests", "faults", "detected", "aborted",
                             "aborted non-victims", "contaminated", "finished clean"], frows),
      f"\nPer victim ({' | '.join(ARMS)}): "
      + "; ".join(f"{fs[0]['kind']}: " + " | ".join(f["outcome"] for f in fs)
                  for fs in zip(*(faults[a]["faults"] for a in ARMS)))
      + ". Aborted non-victims held a page the audit quarantined (the owner of the page a "
      "wrong entry points at). A victim can finish clean when its corrupted page is never "
      "handed to anyone else before it ends.\n",
      "\n![integrity](integrity.png)\n",
  ]
  common.write_markdown(out_dir, "integrity", "".join(md))
  return record
