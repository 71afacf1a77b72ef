"""engine_overhead: host time per engine step with 64 running requests on SMALL_MLA.

The engine times each step in two parts: host work (scheduling, building the
step inputs, bookkeeping after the results arrive) and the device step (from
dispatch until the sampled tokens and integrity flags are on the host). This
benchmark fills the running batch with 64 decoding requests and reports the
host share of the decode-step time, with the integrity defences on (the default:
the device tag check and the host page audit) and off, both measured in the same
run, plus their cost as a ratio. A third variant keeps the defences on and
overlaps the steps (``EngineConfig.overlap``: step N+1 is dispatched before step
N is collected, docs/engine.md); its wall time per step against the
synchronous engine's is the overlap's effect. The page audit's own time is read from the
engine's counters, and the audit is also timed alone at paper scale: a Kimi
K2.6 pool of one H200 (the report's ~1.37M fp8 tokens in 64-token pages) held
by 64 requests.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np

from configs import SMALL_MLA, TINY_MLA
from experiments import common
from mlkit.engine import Engine, EngineConfig
from mlkit.kvcache import KVCacheConfig, PageAllocator
from mlkit.measure import machine_info
from mlkit.model import count_params, init_params
from mlkit.sampling import SamplingParams

_RUNNING = 64
_PROMPT = 16
_PAGE = 16


# (integrity defences, overlapped steps) per variant, in the order they are reported.
VARIANTS = ((True, False), (False, False), (True, True))


def _label(r: dict) -> str:
  return ("check on" if r["integrity_check"] else "check off") + (", overlap" if r["overlap"] else "")


def _engine(params, cfg, *, integrity_check: bool, overlap: bool, new_tokens: int,
            seed: int) -> Engine:
  # integrity_check switches both defences: the device tag check and the host page audit.
  """An engine with 64 requests submitted (prompt _PROMPT, ``new_tokens`` to generate)."""
  pages_per_seq = -(-(_PROMPT + new_tokens) // _PAGE)
  ecfg = EngineConfig(
      model=cfg, kv=KVCacheConfig(num_pages=_RUNNING * pages_per_seq + 8, page_size=_PAGE),
      max_running=_RUNNING, batch_buckets=(_RUNNING,), prefill_buckets=(_PROMPT,),
      prefill_token_budget=_RUNNING * _PROMPT, max_pages_per_seq=pages_per_seq,
      integrity_check=integrity_check, page_audit=integrity_check, overlap=overlap)
  eng = Engine(params, ecfg)
  rng = np.random.default_rng(seed)
  for i in range(_RUNNING):
    eng.submit(rng.integers(0, cfg.vocab_size, _PROMPT).tolist(),
               SamplingParams(max_new_tokens=new_tokens, seed=i))
  return eng


def _new_times() -> dict:
  return {"wall": [], "host": [], "exposed": [], "device": []}


def _timed_steps(eng: Engine, n: int, t: dict) -> None:
  """Runs ``n`` steps (then drains a step still in flight) and appends their mean per-step times."""
  s0 = eng.stats
  before = (s0.host_seconds, s0.exposed_host_seconds, s0.device_seconds)
  t0 = time.perf_counter()
  for _ in range(n):
    eng.step()
  if eng.config.overlap:
    eng.collect()
  t["wall"].append((time.perf_counter() - t0) / n)
  after = (s0.host_seconds, s0.exposed_host_seconds, s0.device_seconds)
  for k, b, a in zip(("host", "exposed", "device"), before, after):
    t[k].append((a - b) / n)


def _summary(eng: Engine, steps: dict) -> dict:
  """Medians over the timed steps: wall time of each ``step()`` call and the engine's counters."""
  wall, host, exposed, device = (np.asarray(steps[k]) for k in ("wall", "host", "exposed", "device"))
  m = eng.metrics()
  return {
      "audit_ms_per_step": 1e3 * m["audit_s_per_step"],
      "audit_fraction_of_host": (m["audit_s_per_step"] * m["steps"] / m["host_seconds"]
                                 if m["host_seconds"] else 0.0),
      "integrity_check": eng.config.integrity_check, "overlap": eng.config.overlap,
      "steps": len(wall),
      "wall_ms_median": 1e3 * float(np.median(wall)),
      "host_ms_median": 1e3 * float(np.median(host)),
      "exposed_host_ms_median": 1e3 * float(np.median(exposed)),
      "device_ms_median": 1e3 * float(np.median(device)),
      "step_ms_median": 1e3 * float(np.median(wall)),
      # The share of the step in which the device waited for the host.
      "host_fraction": float(exposed.sum() / wall.sum()),
      "engine_metrics": m,
  }


def _plot(path: str, runs: list[dict]) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6.5, 3.8))
  labels = [_label(r) for r in runs]
  exposed = [r["exposed_host_ms_median"] for r in runs]
  rest = [r["wall_ms_median"] - e for r, e in zip(runs, exposed)]
  ax.bar(labels, rest, label="device step (and host work hidden under it)")
  ax.bar(labels, exposed, bottom=rest, label="host work the device waited for")
  for i, r in enumerate(runs):
    ax.annotate(f"{r['wall_ms_median']:.1f} ms, host {100 * r['host_fraction']:.2f}%",
                (i, r["wall_ms_median"]), ha="center", va="bottom", fontsize=8)
  ax.set_ylabel("ms per decode step (median wall)")
  ax.set_title(f"Engine step time, {_RUNNING} running requests")
  ax.legend(fontsize=8, loc="lower right")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def paper_scale_audit(num_pages: int = 1_372_000 // 64, requests: int = 64,
                      repeats: int = 20) -> dict:
  """Median time of one page audit over a pool the size of an H200's Kimi K2.6 KV budget.

  Every page is held: ``requests`` requests share the pool evenly, as at full load.
  """
  alloc = PageAllocator(num_pages, 64)
  per = num_pages // requests
  for r in range(requests):
    alloc.admit(r, per * 64)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    violations = alloc.audit()
    times.append(time.perf_counter() - t0)
  assert not violations, violations
  return {"num_pages": num_pages, "requests": requests, "pages_held": per * requests,
          "audit_ms_median": 1e3 * float(np.median(times)), "repeats": repeats}


def run(out_dir: str, *, quick: bool = True, smoke: bool = False) -> dict:
  """Measures host overhead with 64 running requests; writes engine_overhead.{json,md}.

  Args:
    out_dir: folder for the results.
    quick: fewer timed steps (the model is SMALL_MLA either way).
    smoke: TINY_MLA and two timed steps, to test the experiment itself in seconds.

  Returns:
    The JSON record.
  """
  cfg = TINY_MLA if smoke else SMALL_MLA
  warmup, steps = (1, 2) if smoke else (2, 8) if quick else (4, 48)
  common.progress(f"engine_overhead: {cfg.name} ({count_params(cfg) / 1e6:.1f}M params), "
                  f"{_RUNNING} running requests, {steps} timed decode steps")
  params = init_params(cfg, jax.random.key(0))
  blocks, block_steps = (1, 2) if smoke else (3, 4) if quick else (6, 8)
  new_tokens = warmup + steps + blocks * block_steps + 6
  engines = [_engine(params, cfg, integrity_check=c, overlap=o, new_tokens=new_tokens, seed=0)
             for c, o in VARIANTS]
  common.progress("engine_overhead: prefill and warm-up (compiles every variant)")
  for eng in engines:
    # One prefill step for all 64, then decode steps. Overlapped, the prefill is collected
    # by the second call and the first decode step dispatched by the third; the fourth is
    # the first to chain its input tokens on device (one more compile).
    for _ in range(3 + warmup):
      eng.step()
    assert len(eng.running_ids()) == _RUNNING, len(eng.running_ids())
  on_eng, off_eng, overlap_eng = engines
  # Defences on vs off: alternate the two synchronous engines step by step so both see
  # the same machine load.
  times = [_new_times() for _ in range(2)]
  for _ in range(steps):
    for eng, t in zip((on_eng, off_eng), times):
      _timed_steps(eng, 1, t)
  # Overlapped vs synchronous: an overlapped step's device work runs on past its step()
  # call, into whatever runs next, so the two alternate in blocks of steps, each block
  # drained (collect()) before the other engine runs.
  block_times = {id(on_eng): _new_times(), id(overlap_eng): _new_times()}
  for b in range(blocks):
    for eng in ((on_eng, overlap_eng) if b % 2 == 0 else (overlap_eng, on_eng)):
      _timed_steps(eng, block_steps, block_times[id(eng)])
  runs = [_summary(on_eng, times[0]), _summary(off_eng, times[1]),
          _summary(overlap_eng, block_times[id(overlap_eng)])]
  sync_blocks = _summary(on_eng, block_times[id(on_eng)])
  for r in runs:
    common.progress(f"engine_overhead: {_label(r)}: {r['wall_ms_median']:.2f} ms per step, host "
                    f"{r['host_ms_median']:.2f} ms of which the device waited for "
                    f"{r['exposed_host_ms_median']:.2f} ms ({100 * r['host_fraction']:.2f}%), "
                    f"page audit {r['audit_ms_per_step']:.3f} ms per step")
  common.progress(f"engine_overhead: in the same blocks, synchronous {sync_blocks['wall_ms_median']:.2f}"
                  f" ms per step")
  on, off, overlapped = runs
  paper = paper_scale_audit(repeats=3 if smoke else 20)
  common.progress(f"engine_overhead: one page audit over {paper['num_pages']} pages held by "
                  f"{paper['requests']} requests: {paper['audit_ms_median']:.3f} ms")
  record = {
      "experiment": "engine_overhead",
      "machine": machine_info(),
      "config": cfg.to_dict(),
      "running_requests": _RUNNING, "prompt_len": _PROMPT, "page_size": _PAGE,
      "quick": quick, "runs": runs,
      "host_fraction_check_on": on["host_fraction"],
      "host_overhead_under_5_percent": on["host_fraction"] < 0.05,
      "integrity_check_step_time_ratio": on["step_ms_median"] / off["step_ms_median"],
      "overlap_blocks": {"blocks": blocks, "steps_per_block": block_steps,
                         "synchronous": sync_blocks},
      "overlap_step_time_ratio": overlapped["wall_ms_median"] / sync_blocks["wall_ms_median"],
      "audit_fraction_of_step": on["audit_ms_per_step"] / on["step_ms_median"],
      "paper_scale_audit": paper,
  }
  common.write_json(out_dir, "engine_overhead", record)
  _plot(os.path.join(out_dir, "engine_overhead.png"), runs)
  rows = [["on" if r["integrity_check"] else "off", "on" if r["overlap"] else "off", r["steps"],
           r["wall_ms_median"], r["host_ms_median"], r["exposed_host_ms_median"],
           100 * r["host_fraction"], r["audit_ms_per_step"]] for r in runs]
  md = (f"# engine_overhead\n\nHost overhead per decode step with {_RUNNING} running requests on "
        f"`{cfg.name}` on `{record['machine']['device_kind']}` "
        f"({record['machine']['backend']}); medians over the timed steps.\n\n"
        + common.markdown_table(["tag check + page audit", "overlap", "steps", "step ms",
                                 "host ms", "host ms waited for", "host %", "audit ms"], rows)
        + "\n'host ms' is all host work per step; 'waited for' is the part done while no step "
        "was in flight (the device idled); 'host %' is that part over the step's wall time.\n"
        + f"\nStep time with the defences / without: "
        f"{record['integrity_check_step_time_ratio']:.3f}; the page audit (run before and after "
        f"every step) is {100 * record['audit_fraction_of_step']:.3f}% of the step.\n"
        f"\nThe overlapped engine's device work runs on past its `step()` call, so it is "
        f"timed against the synchronous one (defences on) in alternating blocks of "
        f"{block_steps} steps, each drained before the other runs ({blocks} blocks each; "
        f"medians of the blocks' mean step): overlapped {overlapped['wall_ms_median']:.2f} ms vs "
        f"synchronous {sync_blocks['wall_ms_median']:.2f} ms per step, ratio "
        f"{record['overlap_step_time_ratio']:.3f}. The first two rows alternate step by step.\n"
        + f"\nAt paper scale, one audit of a Kimi K2.6 pool of one H200 ({paper['num_pages']:,} "
        f"pages of 64 tokens, all held by {paper['requests']} requests) takes "
        f"{paper['audit_ms_median']:.3f} ms on this machine (median of {paper['repeats']})."
        + "\nOn a CPU the 'device' is the same cores, so only the ratios carry over.\n"
        + "\n![engine_overhead](engine_overhead.png)\n")
  common.write_markdown(out_dir, "engine_overhead", md)
  print(f"host overhead {100 * on['host_fraction']:.2f}% of step time "
        f"({on['host_ms_median']:.2f} of {on['step_ms_median']:.2f} ms), "
        f"check on/off step time ratio {record['integrity_check_step_time_ratio']:.3f}, "
        f"overlapped/synchronous {record['overlap_step_time_ratio']:.3f}")
  return record
