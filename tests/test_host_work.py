"""The host's per-step work follows the step, not the pool, the cache or the history.

Timing is noisy, so these tests count work instead (``Engine.host_work()``):
pages the page audit visits, eviction-heap pops and tag pages written to the
device per step. The same stream of requests runs on a small pool and on a
pool sixteen times larger, each with a full prefix cache (25 times more cached
pages in the larger one); each
step's work must stay within a constant of the pages the step itself touched
(its rows' block tables plus the pages it cached, evicted or released), and
match between the two pools. And a stream of thousands of requests must leave
the engine (and the disaggregated pools) holding only what is live plus a
bounded window of recent results. experiments/host_scale.py measures the time.
"""

import dataclasses
import functools

import jax
import numpy as np
from absl.testing import absltest

from configs import TINY_MLA
from mlkit.engine import DisaggConfig, DisaggEngine, Engine, EngineConfig, PoolConfig
from mlkit.kvcache import KVCacheConfig
from mlkit.parallel import MeshConfig
from mlkit.quant import BF16
from mlkit.sampling import SamplingParams
from numpy_params import init_params_np

CFG = dataclasses.replace(TINY_MLA, n_layers=1, first_k_dense=1)
PAGE, RUNNING = 4, 8


@functools.cache
def params():
  # Drawn with numpy: init_params would compile a threefry program, and no test here is
  # about the initialiser.
  return init_params_np(CFG)


def config(pool: int, **kw) -> EngineConfig:
  base = dict(model=CFG, kv=KVCacheConfig(num_pages=pool, page_size=PAGE, dtype="float32"),
              max_running=RUNNING, batch_buckets=(RUNNING,), prefill_buckets=(8,),
              prefill_token_budget=8 * RUNNING, max_pages_per_seq=8, prefix_cache=True)
  base.update(kw)
  return EngineConfig(**base)


def fill_cache(eng: Engine, pages: int, seed: int) -> None:
  """Fills the prefix cache with distinct synthetic prefixes (host-side; never matched)."""
  rng = np.random.default_rng(seed)
  for k in range(pages // 4):
    key = ("fill", k)
    assert eng.allocator.admit(key, 4 * PAGE) is None
    tokens = rng.integers(0, CFG.vocab_size, 4 * PAGE).tolist()
    eng.prefix_cache.insert(tokens, *zip(*eng.allocator.block_table(key)))
    eng.allocator.release(key)


def stream(eng: Engine, n: int, seed: int = 1):
  """Serves ``n`` short requests (shared prefixes) with RUNNING in flight; yields after each step
  (the step's rows' pages, the cache stats before it)."""
  rng = np.random.default_rng(seed)
  systems = [rng.integers(0, CFG.vocab_size, 2 * PAGE).tolist() for _ in range(6)]
  submitted, live = 0, set()
  while submitted < n or live:
    while len(live) < 2 * RUNNING and submitted < n:
      p = systems[int(rng.integers(len(systems)))] + rng.integers(0, CFG.vocab_size, 5).tolist()
      live.add(eng.submit(p, SamplingParams(max_new_tokens=int(rng.integers(1, 6)))))
      submitted += 1
    rows = sum(len(eng.kv_pages(r)) for r in eng.running_ids())
    before = dict(eng.prefix_cache.stats.as_dict())
    for o in eng.step():
      if o.done:
        live.discard(o.request_id)
    yield rows, before


class HostWorkTest(absltest.TestCase):

  def _run(self, pool: int, cached: int):
    eng = Engine(params(), config(pool))
    fill_cache(eng, cached, seed=pool)
    eng.audit_pages()  # the fill itself: not a step's work
    eng.allocator.take_tag_changes()
    per_step = []
    last = eng.host_work()
    for rows, before in stream(eng, 300):
      now = eng.host_work()
      after = eng.prefix_cache.stats.as_dict()
      cache_pages = sum(after[k] - before[k] for k in ("inserted_pages", "evicted_pages"))
      rows_after = sum(len(eng.kv_pages(r)) for r in eng.running_ids())
      touched = rows + rows_after + cache_pages
      per_step.append({k: now[k] - last.get(k, 0) for k in now} | {"touched": touched})
      last = now
    self.assertEmpty(eng.allocator.audit())
    return eng, per_step

  def test_work_follows_the_step_not_the_pool_or_the_cache(self):
    # Both caches full: everything the running requests do not need (8 x 5 pages at most)
    # is cached, so admissions and growth evict.
    small, small_steps = self._run(pool=128, cached=128 - 48)
    large, large_steps = self._run(pool=2048, cached=2048 - 48)
    for eng in (small, large):
      self.assertGreater(eng.prefix_cache.stats.evicted_pages, 100)
    for steps in (small_steps, large_steps):
      for i, s in enumerate(steps):
        bound = 4 * s["touched"] + 16
        self.assertLessEqual(s["audit_pages"], bound, (i, s))
        self.assertLessEqual(s["evict_pops"], bound, (i, s))
        self.assertLessEqual(s["tag_pages_synced"], bound, (i, s))
        self.assertLessEqual(s["match_nodes"], bound, (i, s))
    # The same requests on a pool 16x larger with 25x more cached pages: the same work.
    for key in ("audit_pages", "evict_pops", "tag_pages_synced", "match_nodes"):
      a = sum(s[key] for s in small_steps)
      b = sum(s[key] for s in large_steps)
      self.assertLessEqual(b, 1.5 * a + 64, (key, a, b))
    for eng in (small, large):  # idle: only the cache holds pages, and the pool is whole
      m = eng.metrics()
      self.assertEqual(m["pages_used"], m["pages_cached"])
      self.assertEqual(m["pages_free"] + m["pages_used"], m["pages_total"])

  def test_requests_leave_the_engine(self):
    # The small pool of test_work_follows_the_step_not_the_pool_or_the_cache (its steps are
    # compiled once): its 8 running requests hold at most 40 of its pages.
    eng = Engine(params(), config(128, retain_finished=32))
    held = []
    ids = []
    for _ in stream(eng, 3000):
      held.append(len(eng.requests))
      ids = list(eng.requests)
    self.assertLessEqual(max(held), 2 * RUNNING + 32)
    self.assertEqual(eng.metrics()["finished"], 3000)
    self.assertEqual(eng.metrics()["requests_held"], 32)
    recent = max(ids)
    self.assertTrue(eng.get(recent).done)  # the window answers for recent results
    with self.assertRaises(KeyError):
      eng.get(0)  # long gone
    # generate() takes its results as they end, whatever the window.
    outs = eng.generate([[1, 2, 3]] * 40, SamplingParams(max_new_tokens=2))
    self.assertLen(outs, 40)
    self.assertTrue(all(len(o) == 2 for o in outs))
    self.assertLessEqual(len(eng.requests), 32)

  def test_disaggregated_pools_keep_only_what_is_live(self):
    pool = PoolConfig(config(128, retain_finished=16), BF16, MeshConfig())
    eng = DisaggEngine(params(), DisaggConfig(prefill=pool, decode=pool),
                       devices=jax.devices()[:2])
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, CFG.vocab_size, 6).tolist() for _ in range(200)]
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=3))
    self.assertEqual([len(o) for o in outs], [3] * 200)
    self.assertLessEqual(len(eng.requests), 16)
    self.assertLessEqual(len(eng.prefill.requests), 16)
    self.assertLessEqual(len(eng.decode.requests), 16)
    self.assertLessEqual(len(eng.stats.timeline), 4096)


if __name__ == "__main__":
  absltest.main()
