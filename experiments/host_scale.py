"""host_scale: the engine's host work per step against pool size, batch, prefix cache and history.

At the report's scale a pool holds 21,437 pages of 64 tokens (Kimi K2.6 on one
H200), a prefix cache fills whatever the running requests leave free, and a
server runs for weeks. The host's share of each step must follow the step, not
the pool, the cache or the requests already served. This experiment measures
host ms per engine step (``Engine.stats``: scheduling, step inputs, bookkeeping,
the page audit; not the device step) on TINY_MLA with one layer and f32, with
warm compiles, while varying:

* pool pages: 1,024, 21,437 and 200,000 (pages of 16 tokens; host work does
  not depend on the page size);
* running requests: 16, 64 and 256, all decoding;
* the prefix cache: empty, or full (every page the running requests do not
  hold is a cached page, filled host-side with distinct synthetic prefixes the
  workload never matches, so each page a request grows into is an eviction);
* requests already served: a stream of short requests with shared prefixes
  (64 running, 21,437 pages, cache full), up to 100,000, reporting host ms per
  step, the process's RSS and how many requests the engine still holds.

Where the engine counts its work (``host_work`` in ``Engine.metrics()``: pages
the audit visited, eviction steps), those counts per step are reported too.
Writes host_scale.{json,md,png}.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from configs import TINY_MLA
from experiments import common
from mlkit.engine import Engine, EngineConfig
from mlkit.kvcache import KVCacheConfig
from mlkit.model import init_params
from mlkit.sampling import SamplingParams

PAGE = 16
PROMPT = 16
MAX_PAGES_PER_SEQ = 4  # prompt + 48 new tokens
POOLS = (1_024, 21_437, 200_000)
RUNNING = (16, 64, 256)
TARGET_MS = 2.0  # at 21,437 pages, a full cache and 64 running


def rss_mb() -> float:
  """This process's resident memory (MB)."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  return float("nan")


def _config(pool: int, running: int) -> EngineConfig:
  cfg = dataclasses.replace(TINY_MLA, n_layers=1, first_k_dense=1)
  return EngineConfig(model=cfg, kv=KVCacheConfig(num_pages=pool, page_size=PAGE),
                      max_running=running, batch_buckets=(running,), prefill_buckets=(PROMPT,),
                      prefill_token_budget=PROMPT * running, max_pages_per_seq=MAX_PAGES_PER_SEQ,
                      prefix_cache=True)


def fill_cache(eng: Engine, pages: int, rng: np.random.Generator, chain: int = 8) -> int:
  """Fills the prefix cache with ``pages`` pages of distinct synthetic prefixes (host-side only:
  their KV is never read, as no request of the workload matches them). Returns pages cached."""
  cache, alloc = eng.prefix_cache, eng.allocator
  added, k = 0, 0
  while added < pages:
    n = min(chain, pages - added)
    key = ("fill", k)
    if alloc.admit(key, n * PAGE) is not None:
      break
    tokens = rng.integers(0, eng.config.model.vocab_size, n * PAGE).tolist()
    got = cache.insert(tokens, *zip(*alloc.block_table(key)))
    alloc.release(key)
    added += got
    k += 1
  return added


def _work(eng: Engine) -> dict:
  return dict(eng.metrics().get("host_work", {}))


def decode_host_ms(params, pool: int, running: int, cache_full: bool, *, warm: int, steps: int,
                   seed: int = 0) -> dict:
  """Host ms per decode step with ``running`` requests decoding (median of per-step readings)."""
  eng = Engine(params, _config(pool, running))
  rng = np.random.default_rng(seed)
  cached = 0
  if cache_full:
    cached = fill_cache(eng, pool - running * MAX_PAGES_PER_SEQ - 8, rng)
  for i in range(running):
    eng.submit(rng.integers(0, eng.config.model.vocab_size, PROMPT).tolist(),
               SamplingParams(max_new_tokens=PAGE * MAX_PAGES_PER_SEQ - PROMPT, seed=i))
  for _ in range(1 + warm):  # one prefill step, then warm decode steps
    eng.step()
  per_step, work0 = [], _work(eng)
  for _ in range(steps):
    h0 = eng.stats.host_seconds
    eng.step()
    per_step.append(1e3 * (eng.stats.host_seconds - h0))
  work = {k: (v - work0.get(k, 0)) / steps for k, v in _work(eng).items()}
  m = eng.metrics()
  return {"pool_pages": pool, "running": running, "cache": "full" if cache_full else "empty",
          "cached_pages": cached, "cached_pages_after": m["pages_cached"],
          "host_ms_median": float(np.median(per_step)), "host_ms_mean": float(np.mean(per_step)),
          "steps": steps, "work_per_step": work}


def served_sweep(params, *, total: int, checkpoints, pool: int = 21_437, running: int = 64,
                 seed: int = 1) -> list[dict]:
  """Streams ``total`` short requests (shared prefixes, 4 new tokens each) through one engine with
  ``running`` in flight and a full cache; one reading per checkpoint of requests served."""
  eng = Engine(params, _config(pool, running))
  rng = np.random.default_rng(seed)
  fill_cache(eng, pool - running * MAX_PAGES_PER_SEQ - 8, rng)
  vocab = eng.config.model.vocab_size
  systems = [rng.integers(0, vocab, 2 * PAGE).tolist() for _ in range(32)]
  sampling = SamplingParams(max_new_tokens=4)
  live: set[int] = set()
  served, out, marks = 0, [], list(checkpoints)
  steps0, host0, t0 = eng.stats.steps, eng.stats.host_seconds, time.perf_counter()
  while served < total:
    while len(live) < 2 * running and served + len(live) < total:
      prompt = systems[int(rng.integers(len(systems)))] + rng.integers(0, vocab, 8).tolist()
      live.add(eng.submit(prompt, sampling))
    for o in eng.step():
      if o.done and o.request_id in live:
        live.discard(o.request_id)
        served += 1
    if marks and served >= marks[0]:
      steps = eng.stats.steps - steps0
      out.append({"served": served, "host_ms_per_step": 1e3 * (eng.stats.host_seconds - host0)
                  / max(steps, 1), "steps": steps, "rss_mb": rss_mb(),
                  "requests_held": len(eng.requests), "wall_s": time.perf_counter() - t0,
                  "cached_pages": eng.metrics()["pages_cached"]})
      common.progress(f"host_scale: {served} requests served: {out[-1]['host_ms_per_step']:.2f} "
                      f"host ms/step, RSS {out[-1]['rss_mb']:.0f} MB, engine holds "
                      f"{out[-1]['requests_held']} requests")
      steps0, host0 = eng.stats.steps, eng.stats.host_seconds
      marks.pop(0)
  return out


def _plot(path: str, grid: list[dict], sweep: list[dict]) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  ax = axes[0]
  for running in RUNNING:
    for cache, style in (("empty", "--"), ("full", "-")):
      pts = [(r["pool_pages"], r["host_ms_median"]) for r in grid
             if r["running"] == running and r["cache"] == cache]
      if pts:
        ax.plot(*zip(*pts), style, marker="o", label=f"{running} running, cache {cache}")
  ax.axhline(TARGET_MS, color="gray", lw=0.8, ls=":")
  ax.set(xscale="log", yscale="log", xlabel="pool pages", ylabel="host ms / step (median)",
         title="host work vs pool size")
  ax.legend(fontsize=7)
  ax = axes[1]
  for pool in POOLS:
    pts = [(r["running"], r["host_ms_median"]) for r in grid
           if r["pool_pages"] == pool and r["cache"] == "full"]
    if pts:
      ax.plot(*zip(*pts), marker="o", label=f"{pool:,} pages, cache full")
  ax.set(xscale="log", yscale="log", xlabel="running requests", ylabel="host ms / step (median)",
         title="host work vs batch")
  ax.legend(fontsize=7)
  ax = axes[2]
  xs = [r["served"] for r in sweep]
  ax.plot(xs, [r["host_ms_per_step"] for r in sweep], marker="o", color="C0")
  ax.set(xscale="log", xlabel="requests served", ylabel="host ms / step", ylim=(0, None),
         title="host work and RSS vs requests served")
  twin = ax.twinx()
  twin.plot(xs, [r["rss_mb"] for r in sweep], marker="s", color="C1")
  twin.set_ylabel("RSS (MB)", color="C1")
  twin.set_ylim(0, None)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def run(out_dir: str, *, quick: bool = True, smoke: bool = False) -> dict:
  """Measures host ms/step over the grid and the served sweep; writes host_scale.{json,md,png}."""
  pools, runnings = ((1_024,), (16,)) if smoke else (POOLS, RUNNING)
  warm, steps = (1, 3) if smoke else (3, 20)
  total = 200 if smoke else 20_000 if quick else 100_000
  checkpoints = ([50, 200] if smoke else [1_000, 5_000, 10_000, 20_000] if quick
                 else [1_000, 3_000, 10_000, 30_000, 60_000, 100_000])
  params = init_params(_config(1_024, 16).model, jax.random.key(0))
  grid = []
  for pool in pools:
    for running in runnings:
      if running * MAX_PAGES_PER_SEQ + 8 > pool:
        continue  # the requests alone would fill the pool
      for cache_full in (False, True):
        r = decode_host_ms(params, pool, running, cache_full, warm=warm, steps=steps)
        grid.append(r)
        common.progress(f"host_scale: {pool:>7,} pages, {running:>3} running, cache "
                        f"{r['cache']:<5} ({r['cached_pages']:>7,} cached): "
                        f"{r['host_ms_median']:.2f} host ms/step")
  sweep = served_sweep(params, total=total, checkpoints=checkpoints,
                       pool=pools[-1] if smoke else 21_437, running=runnings[-1] if smoke else 64)
  record = common.record_header("host_scale", quick=quick, smoke=smoke, config={
      "model": "tiny-mla, 1 layer, f32", "page_size": PAGE, "prompt": PROMPT,
      "max_pages_per_seq": MAX_PAGES_PER_SEQ, "warm_steps": warm, "timed_steps": steps,
      "served_total": total})
  target = next((r for r in grid if r["pool_pages"] == 21_437 and r["running"] == 64
                 and r["cache"] == "full"), None)
  record.update(grid=grid, served=sweep, target_ms=TARGET_MS,
                target_case_ms=target["host_ms_median"] if target else None,
                target_met=bool(target and target["host_ms_median"] <= TARGET_MS))
  common.write_json(out_dir, "host_scale", record)
  rows = [[f"{r['pool_pages']:,}", r["running"], r["cache"], f"{r['cached_pages']:,}",
           f"{r['host_ms_median']:.2f}",
           ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["work_per_step"].items())) or "-"]
          for r in grid]
  srows = [[f"{r['served']:,}", f"{r['host_ms_per_step']:.2f}", f"{r['rss_mb']:.0f}",
            f"{r['requests_held']:,}", f"{r['cached_pages']:,}"] for r in sweep]
  md = ["# host_scale: host work per engine step", "",
        f"TINY_MLA (1 layer, f32), pages of {PAGE} tokens, prompts of {PROMPT}, warm compiles, "
        f"median of {steps} decode steps. `python -m experiments host_scale"
        f"{'' if quick else ' --full'}`.", "",
        common.markdown_table(["pool pages", "running", "cache", "cached pages", "host ms/step",
                               "work per step"], rows), "",
        f"Target: at most {TARGET_MS} ms at 21,437 pages, 64 running, cache full: "
        + (f"{record['target_case_ms']:.2f} ms ({'met' if record['target_met'] else 'missed'})."
           if target else "not measured."), "",
        "## Requests served (21,437 pages, 64 running, cache full)", "",
        common.markdown_table(["requests served", "host ms/step (window)", "RSS MB",
                               "requests the engine holds", "cached pages"], srows), "",
        "![host_scale](host_scale.png)"]
  common.write_markdown(out_dir, "host_scale", "\n".join(md) + "\n")
  try:
    _plot(f"{out_dir}/host_scale.png", grid, sweep)
  except ImportError:
    pass
  return record
