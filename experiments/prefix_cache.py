"""prefix_cache: a shared-system-prompt workload with the radix prefix cache on and off.

Every request is one common system prompt of L tokens plus its own question;
two arrive at once, the rest one per engine step (a steady stream). For each L the same
requests run through two engines that differ only in
``EngineConfig.prefix_cache``, alternating which goes first, and the
experiment reports time to first token, output throughput, the prefill tokens
computed and saved, the hit rates, and whether the greedy outputs are
identical. With the cache, a request prefills only what follows the longest
cached prefix (whole pages shared under their integrity tags, a partly
matching page copied), so TTFT should fall as L grows while the cache-off
engine's rises (docs/prefix_cache.md).
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np

from experiments import common
from mlkit import kvcache as kvc
from mlkit.engine import Engine, EngineConfig, request_metrics
from mlkit.measure import stats
from mlkit.model import count_params, init_params
from mlkit.sampling import SamplingParams

SHAPES = {
    "smoke": dict(requests=4, question=5, new_tokens=3, shared=(0, 19), page_size=8, max_running=4,
                  chunk=16, repeats=1),
    "quick": dict(requests=16, question=16, new_tokens=16, shared=(0, 64, 192), page_size=16,
                  max_running=8, chunk=64, repeats=3),
    "full": dict(requests=32, question=32, new_tokens=32, shared=(0, 128, 256, 512), page_size=16,
                 max_running=8, chunk=128, repeats=3),
}
VARIANTS = ("cache off", "cache on")


def _config(cfg, shape: dict, *, prefix_cache: bool) -> EngineConfig:
  longest = max(shape["shared"]) + shape["question"] + shape["new_tokens"]
  pps = -(-longest // shape["page_size"])
  # Room for every running request plus a cached copy of the system prompt.
  pages = shape["max_running"] * pps + pps + 4
  r = shape["max_running"]
  return EngineConfig(model=cfg, kv=kvc.KVCacheConfig(pages, shape["page_size"]), max_running=r,
                      batch_buckets=(r,), prefill_buckets=(shape["chunk"],),
                      prefill_token_budget=2 * shape["chunk"], max_pages_per_seq=pps,
                      backend=common.local_backend(), prefix_cache=prefix_cache)


def _serve(eng: Engine, prompts, new_tokens: int) -> dict:
  """Two prompts at once, then one per step; runs to the end. Per-request numbers."""
  sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
  before = eng.metrics()
  t0 = time.perf_counter()
  reqs, _ = eng.serve_arriving(prompts, sp, at_once=min(2, len(prompts)))
  wall = time.perf_counter() - t0
  after = eng.metrics()
  ms = [request_metrics(r) for r in reqs]
  out = {"wall_s": wall, "outputs": [list(r.output) for r in reqs],
         "output_tokens": sum(m["output_tokens"] for m in ms),
         "ttft_ms": stats([1e3 * m["ttft_s"] for m in ms]),
         "prefill_tokens_computed": after["prefill_tokens"] - before["prefill_tokens"]}
  out["throughput_tok_s"] = out["output_tokens"] / wall
  pc_a, pc_b = after.get("prefix_cache"), before.get("prefix_cache")
  if pc_a is not None:
    d = {k: pc_a[k] - pc_b[k] for k in ("lookups", "hits", "tokens_looked_up", "tokens_saved",
                                        "copied_pages", "evicted_pages")}
    d["hit_rate"] = d["hits"] / d["lookups"] if d["lookups"] else 0.0
    d["token_hit_rate"] = d["tokens_saved"] / d["tokens_looked_up"] if d["tokens_looked_up"] else 0.0
    out["prefix_cache"] = d
  return out


def _median_run(reps: list[dict]) -> dict:
  """One variant's repeats in one: medians of TTFT (per field) and throughput, summed counts."""
  out = {"repeats": len(reps),
         "ttft_ms": {k: float(np.median([r["ttft_ms"][k] for r in reps]))
                     for k in ("median", "p95", "min", "max")},
         "throughput_tok_s": float(np.median([r["throughput_tok_s"] for r in reps])),
         "throughput_tok_s_all": [r["throughput_tok_s"] for r in reps],
         "output_tokens": sum(r["output_tokens"] for r in reps),
         "prefill_tokens_computed": sum(r["prefill_tokens_computed"] for r in reps)}
  if "prefix_cache" in reps[0]:
    pc = {k: sum(r["prefix_cache"][k] for r in reps)
          for k in ("lookups", "hits", "tokens_looked_up", "tokens_saved", "copied_pages",
                    "evicted_pages")}
    pc["hit_rate"] = pc["hits"] / pc["lookups"] if pc["lookups"] else 0.0
    pc["token_hit_rate"] = pc["tokens_saved"] / pc["tokens_looked_up"] if pc["tokens_looked_up"] else 0.0
    out["prefix_cache"] = pc
  return out


def _plot(path: str, lengths, runs: dict) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (a, b) = plt.subplots(1, 2, figsize=(9.5, 3.8))
  for v in VARIANTS:
    a.plot(lengths, [runs[L][v]["ttft_ms"]["median"] for L in lengths], marker="o", label=v)
    b.plot(lengths, [runs[L][v]["throughput_tok_s"] for L in lengths], marker="o", label=v)
  a.set_xlabel("shared system prompt (tokens)")
  a.set_ylabel("TTFT median (ms)")
  b.set_xlabel("shared system prompt (tokens)")
  b.set_ylabel("output tokens / s")
  for ax in (a, b):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle("Radix prefix cache on a shared-system-prompt workload", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def run(out_dir: str, *, quick: bool = True, smoke: bool = False) -> dict:
  """Serves the shared-prompt workload with the cache on and off; writes prefix_cache.*.

  Args:
    out_dir: folder for prefix_cache.json, .md and .png.
    quick: TINY_MLA (CPU), 16 requests, system prompts of 0 / 64 / 192 tokens.
    smoke: one-layer TINY_MLA, 4 short requests (tests).

  Returns:
    The JSON record.
  """
  mode = "smoke" if smoke else ("quick" if quick else "full")
  shape = SHAPES[mode]
  cfg = common.local_model(quick, smoke)
  common.progress(f"prefix_cache: {cfg.name} ({count_params(cfg) / 1e6:.1f}M params), "
                  f"{shape['requests']} requests of L + {shape['question']} tokens + "
                  f"{shape['new_tokens']} new, L in {list(shape['shared'])}")
  params = init_params(cfg, jax.random.key(0))
  engines = {v: Engine(params, _config(cfg, shape, prefix_cache=v == "cache on")) for v in VARIANTS}
  rng = np.random.default_rng(0)
  # The warm-up serves the longest measured shape twice over, so that every program the runs
  # use is compiled before any is timed: the steps, and the page-tag updates and page copies,
  # which are bucketed by how many pages a step touches (a shorter warm-up left a tag-update
  # compile inside the first long run's TTFT).
  common.progress("prefix_cache: warm-up (compiles both engines at the longest shape)")
  system = rng.integers(0, cfg.vocab_size, max(shape["shared"])).tolist()
  warm = [system + rng.integers(0, cfg.vocab_size, shape["question"]).tolist()
          for _ in range(shape["requests"])]
  for eng in engines.values():
    _serve(eng, warm, shape["new_tokens"])
    _serve(eng, warm, shape["new_tokens"])  # now hitting the cache (where it is on)
  runs = {}
  for i, L in enumerate(shape["shared"]):
    reps = []
    for rep in range(shape["repeats"]):  # a fresh system prompt each time: nothing cached yet
      system = rng.integers(0, cfg.vocab_size, L).tolist()
      prompts = [system + rng.integers(0, cfg.vocab_size, shape["question"]).tolist()
                 for _ in range(shape["requests"])]
      order = VARIANTS if (i + rep) % 2 == 0 else VARIANTS[::-1]
      reps.append({v: _serve(engines[v], prompts, shape["new_tokens"]) for v in order})
    runs[L] = {v: _median_run([r[v] for r in reps]) for v in VARIANTS}
    runs[L]["outputs_identical"] = all(r["cache off"]["outputs"] == r["cache on"]["outputs"]
                                       for r in reps)
    off, on = runs[L]["cache off"], runs[L]["cache on"]
    common.progress(
        f"prefix_cache: L={L}: TTFT median {off['ttft_ms']['median']:.1f} -> "
        f"{on['ttft_ms']['median']:.1f} ms, {off['throughput_tok_s']:.0f} -> "
        f"{on['throughput_tok_s']:.0f} tok/s, prefill tokens {off['prefill_tokens_computed']} -> "
        f"{on['prefill_tokens_computed']}, hit rate {on['prefix_cache']['hit_rate']:.2f}, "
        f"outputs identical: {runs[L]['outputs_identical']}")
  lengths = list(shape["shared"])
  record = common.record_header("prefix_cache", quick=quick, smoke=smoke, config={
      "model": cfg.to_dict(), "shape": shape})
  record["runs"] = {str(L): runs[L] for L in lengths}
  common.write_json(out_dir, "prefix_cache", record)
  _plot(os.path.join(out_dir, "prefix_cache.png"), lengths, runs)
  rows = []
  for L in lengths:
    for v in VARIANTS:
      r = runs[L][v]
      pc = r.get("prefix_cache")
      rows.append([L, v, f"{r['ttft_ms']['median']:.1f}", f"{r['ttft_ms']['p95']:.1f}",
                   f"{r['throughput_tok_s']:.0f}", r["prefill_tokens_computed"],
                   "-" if pc is None else pc["tokens_saved"],
                   "-" if pc is None else f"{pc['hit_rate']:.2f}",
                   "yes" if runs[L]["outputs_identical"] else "NO"])
  md = (f"# prefix_cache\n\n{shape['requests']} requests of a shared system prompt (L tokens) plus "
        f"{shape['question']} own tokens, {shape['new_tokens']} greedy tokens each, two at once "
        f"and one per step after, on `{cfg.name}` on `{record['machine']['device_kind']}` "
        f"({record['kernel_backend']} kernels); {shape['page_size']}-token pages, prefill chunks "
        f"of {shape['chunk']}. The two engines differ only in `prefix_cache`. Each row is "
        f"{shape['repeats']} run(s) with a fresh system prompt, the engines' order alternated: "
        "TTFT and throughput are medians over the runs, token counts their sums.\n\n"
        + common.markdown_table(["L", "engine", "TTFT ms (median)", "TTFT ms (p95)",
                                 "output tok/s", "prefill tokens computed",
                                 "prefill tokens saved", "hit rate", "outputs identical"], rows)
        + "\nA hit is an admission that reused at least one cached token. Requests admitted "
        "before any prefill chunk of the system prompt was collected cannot hit (nothing is "
        "cached yet): the first two here.\n\n![prefix_cache](prefix_cache.png)\n")
  common.write_markdown(out_dir, "prefix_cache", md)
  return record
