"""The radix prefix cache: the tree on its own, then inside the engine (equality, integrity).

Engine tests share test_engine's shapes (TINY_MLA f32, 12 pages of 8 tokens,
batch bucket 4, prefill bucket 16), so the jitted steps compile once. Token
comparisons are exact: f32 end to end, cache on and off.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from mlkit.engine import ABORT_INTEGRITY, Engine, Fault, FaultKind, RequestStatus
from mlkit.engine.prefix_cache import Match, PrefixCache, holder_id, is_holder_id
from mlkit.kvcache import PageAllocator
from mlkit.sampling import SamplingParams
from test_engine import NUM_PAGES, PAGE, engine_config, params, prompt

P = 4  # page size of the tree-only tests


def _held(alloc: PageAllocator, rid, n_tokens: int, prefix=()) -> list[int]:
  assert alloc.admit(rid, n_tokens, prefix_pages=prefix) is None
  return [p for p, _ in alloc.block_table(rid)]


def _tags(alloc: PageAllocator, pages) -> list[int]:
  """The pages' current tags (what a writer whose check just passed expects)."""
  return [int(alloc.tags[p]) for p in pages]


class PrefixTreeTest(absltest.TestCase):
  """PrefixCache over a bare PageAllocator (no model)."""

  def setUp(self):
    super().setUp()
    self.alloc = PageAllocator(16, P)
    self.cache = PrefixCache(self.alloc)
    self.toks = list(range(100, 114))  # 14 tokens: 3 whole pages + 2

  def test_insert_then_match_whole_pages_and_leave_the_last_token(self):
    pages = _held(self.alloc, "a", 14)
    self.assertEqual(self.cache.insert(self.toks, pages, _tags(self.alloc, pages)), 3)  # whole pages only
    self.assertEqual(self.alloc.refcounts[pages[:3]].tolist(), [2, 2, 2])
    tags = tuple(_tags(self.alloc, pages))
    self.assertEqual(self.cache.match(self.toks), Match(tuple(pages[:3]), tags[:3]))
    # 12 tokens: the third page would cover the last token, so it is reused by copy.
    self.assertEqual(self.cache.match(self.toks[:12]),
                     Match(tuple(pages[:2]), tags[:2], copy_from=pages[2], copy_tokens=3))
    self.assertEqual(self.cache.match(self.toks[:1]), Match())
    self.assertEqual(self.cache.match([7] + self.toks[1:]), Match())  # differs in token 0
    self.assertEmpty(self.alloc.audit())

  def test_partial_page_match_names_the_page_to_copy(self):
    pages = _held(self.alloc, "a", 14)
    self.cache.insert(self.toks, pages, _tags(self.alloc, pages))
    diverge = self.toks[:6] + [999, 998, 997]  # diverges inside the second page
    self.assertEqual(self.cache.match(diverge), Match((pages[0],), (int(self.alloc.tags[pages[0]]),),
                                                      copy_from=pages[1], copy_tokens=2))

  def test_copy_needs_a_minimum_of_shared_tokens(self):
    pages = _held(self.alloc, "a", 14)
    self.cache.insert(self.toks, pages, _tags(self.alloc, pages))
    strict = PrefixCache(self.alloc, min_copy_tokens=3)
    diverge = self.toks[:6] + [999, 998, 997]  # shares 2 tokens of the second page
    self.assertEqual(strict.match(diverge), Match())  # nothing cached in `strict`
    strict.root = self.cache.root  # same tree, stricter rule
    self.assertEqual(strict.match(diverge).pages, (pages[0],))
    self.assertIsNone(strict.match(diverge).copy_from)
    with self.assertRaisesRegex(ValueError, "min_copy_tokens"):
      PrefixCache(self.alloc, min_copy_tokens=0)

  def test_a_shared_page_keeps_its_tag_and_eviction_gives_a_new_one(self):
    pages = _held(self.alloc, "a", 8)
    tags = [t for _, t in self.alloc.block_table("a")]
    self.cache.insert(self.toks[:8], pages, _tags(self.alloc, pages))
    b = _held(self.alloc, "b", 10, prefix=pages[:1])
    self.assertEqual(b[0], pages[0])
    self.assertEqual(self.alloc.block_table("b")[0][1], tags[0])  # same page, same tag
    self.alloc.release("a")
    self.alloc.release("b")
    self.assertEqual(self.cache.num_pages, 2)  # the cache keeps them alive
    self.assertEqual(self.cache.evict(16), 2)
    self.assertEqual(self.alloc.num_free, 16)
    self.assertEqual(self.cache.match(self.toks), Match())
    # Allocation order puts freed pages at the back; take everything to reach them.
    all_pages = _held(self.alloc, "c", 16 * P)
    new_tags = dict(self.alloc.block_table("c"))
    for p, t in zip(pages, tags):
      self.assertIn(p, all_pages)
      self.assertNotEqual(new_tags[p], t)
    self.assertEmpty(self.alloc.audit())

  def test_eviction_is_lru_over_leaves_only_the_cache_holds(self):
    a = _held(self.alloc, "a", 8)
    self.cache.insert(list(range(8)), a, _tags(self.alloc, a))
    b = _held(self.alloc, "b", 8)
    self.cache.insert(list(range(50, 58)), b, _tags(self.alloc, b))
    self.alloc.release("a")  # b's pages are still held by request "b"
    self.cache.match(list(range(9)))  # a's path is the most recent use, but b is held
    self.assertEqual(self.cache.evict(1), 1)
    self.assertEqual(self.cache.match(list(range(9))).pages, (a[0],))  # leaf a[1] went first
    self.assertEqual(self.cache.evict(5), 1)  # then a[0]; b's pages are not evictable
    self.assertEqual(sorted(self.cache.pages()), sorted(b))
    self.alloc.release("b")
    c = _held(self.alloc, "c", 8)
    self.cache.insert(list(range(70, 78)), c, _tags(self.alloc, c))
    self.alloc.release("c")
    self.cache.match(list(range(50, 59)))  # b now more recent than c
    self.cache.evict(2)
    self.assertEqual(sorted(self.cache.pages()), sorted(b))
    self.assertEmpty(self.alloc.audit())

  def test_a_block_cached_twice_keeps_the_first_page(self):
    a = _held(self.alloc, "a", 8)
    b = _held(self.alloc, "b", 8)
    self.assertEqual(self.cache.insert(self.toks[:8], a, _tags(self.alloc, a)), 2)
    self.assertEqual(self.cache.insert(self.toks[:8], b, _tags(self.alloc, b)), 0)
    self.assertEqual(self.cache.match(self.toks[:9]).pages, tuple(a))
    self.alloc.release("b")  # b's own pages simply go back
    self.assertEqual(self.alloc.num_free, 16 - 2)

  def test_invalidate_drops_the_subtree_and_reconcile_follows_recover(self):
    a = _held(self.alloc, "a", 12)
    self.cache.insert(self.toks[:12], a, _tags(self.alloc, a))
    self.alloc.release("a")
    self.assertEqual(self.cache.invalidate([a[1]]), 2)  # a[1] and its child a[2]
    self.assertEqual(self.cache.match(self.toks).pages, (a[0],))
    self.assertEqual(self.alloc.num_free, 15)
    # A recovery (the audit found a[0] violating) forgets the cache's hold on it.
    held = self.alloc.recover([type("V", (), {"pages": (a[0],), "requests": ()})()])
    self.assertIn(holder_id(a[0]), held)
    self.assertTrue(all(is_holder_id(h) for h in held))
    self.assertEqual(self.cache.reconcile(), 1)
    self.assertEqual(self.cache.num_pages, 0)
    self.assertEmpty(self.alloc.audit())

  def test_a_page_retagged_behind_the_cache_is_never_matched(self):
    a = _held(self.alloc, "a", 8)
    self.cache.insert(self.toks[:8], a, _tags(self.alloc, a))
    self.alloc.release("a")
    # A bookkeeping bug frees the cached page; another request gets it with a new tag.
    self.alloc.free([a[1]])
    with self.alloc.tampering() as t:  # the bug: the page is reused next
      t.list_first(a[1])
    other = _held(self.alloc, "x", 4)
    self.assertEqual(other, [a[1]])
    self.assertEqual(self.cache.match(self.toks).pages, (a[0],))  # stops before it, drops it
    self.assertEqual(self.cache.num_pages, 1)
    self.assertEqual(self.alloc.refcounts[a[1]], 1)  # x's reference survives the drop
    self.assertEmpty(self.alloc.audit())
    # A sharer expects the cached tag, so a retagged page fails its device check.
    b = _held(self.alloc, "b", 8, prefix=[a[0]])
    self.assertEqual(self.alloc.block_table("b")[0], (a[0], int(self.alloc.tags[a[0]])))
    self.alloc.admit("c", 4, prefix_pages=[a[0]], prefix_tags=[123])
    self.assertEqual(self.alloc.block_table("c")[0], (a[0], 123))
    with self.assertRaisesRegex(ValueError, "1 prefix tags for 0 prefix pages"):
      self.alloc.admit("d", 4, prefix_tags=[1])
    del b

  def test_insert_refuses_pages_it_cannot_trust(self):
    a = _held(self.alloc, "a", 8)
    self.alloc.quarantine([a[1]])
    # Stops at the quarantined page.
    self.assertEqual(self.cache.insert(self.toks[:8], a, _tags(self.alloc, a)), 1)
    self.assertEqual(self.cache.insert(self.toks[8:12] + self.toks[:4], [a[0], a[0]],
                                       _tags(self.alloc, [a[0], a[0]])), 0)

  def test_stats(self):
    a = _held(self.alloc, "a", 8)
    self.cache.insert(self.toks[:8], a, _tags(self.alloc, a))
    m = self.cache.match(self.toks[:10])
    self.cache.record_lookup(10, m)
    self.cache.record_lookup(5, Match())
    s = self.cache.stats.as_dict()
    self.assertEqual((s["lookups"], s["hits"], s["tokens_saved"]), (2, 1, 8))
    self.assertAlmostEqual(s["token_hit_rate"], 8 / 15)


# A shared 21-token system prompt (two whole pages of 8 and 5 tokens of a third) + suffixes.
_rng = np.random.default_rng(11)
SYSTEM = _rng.integers(0, 256, 21).tolist()
PROMPTS = [SYSTEM + _rng.integers(0, 256, int(n)).tolist() for n in (3, 5, 1, 8, 2, 6)]
SAMPLINGS = [SamplingParams(max_new_tokens=6, seed=i, temperature=0.7 * (i % 2)) for i in range(6)]


class EnginePrefixCacheTest(parameterized.TestCase):

  def _serve(self, **kw):
    """Each prompt alone (later ones hit the cache), then all together; outputs and the engine."""
    eng = Engine(params(), engine_config(**kw))
    out = [eng.generate([p], s)[0] for p, s in zip(PROMPTS, SAMPLINGS)]
    out += eng.generate(PROMPTS, SAMPLINGS)
    return out, eng

  @parameterized.named_parameters(("sync", False), ("overlap", True))
  def test_outputs_identical_with_the_cache_on_and_off(self, overlap):
    want, _ = self._serve(overlap=overlap)
    got, eng = self._serve(overlap=overlap, prefix_cache=True)
    self.assertEqual(got, want)
    m = eng.metrics()["prefix_cache"]
    self.assertGreater(m["hits"], 6)
    self.assertGreater(m["copied_pages"], 0)  # the system prompt ends inside a page
    self.assertGreater(m["evicted_pages"], 0)  # 12 pages: the cache must make room
    self.assertEqual(eng.metrics()["prefill_tokens"] + m["tokens_saved"],
                     sum(len(p) for p in PROMPTS) * 2)
    self.assertEmpty(eng.allocator.audit())
    self.assertEqual(eng.allocator.num_free + eng.prefix_cache.num_pages, NUM_PAGES)

  def test_preemption_under_the_cache_recomputes_identically(self):
    prompts = [SYSTEM[:16] + prompt(6, 100 + i) for i in range(4)]
    samplings = [SamplingParams(max_new_tokens=18, seed=i) for i in range(4)]
    want = Engine(params(), engine_config()).generate(prompts, samplings)
    eng = Engine(params(), engine_config(prefix_cache=True))
    self.assertEqual(eng.generate(prompts, samplings), want)
    self.assertGreater(eng.stats.preemptions, 0)
    self.assertEmpty(eng.allocator.audit())

  def test_concurrent_holders_share_one_page_with_one_tag(self):
    eng = Engine(params(), engine_config(prefix_cache=True))
    eng.generate([PROMPTS[0]], SAMPLINGS[0])  # caches the system prompt's whole pages
    ids = [eng.submit(p, SamplingParams(max_new_tokens=4)) for p in PROMPTS[1:4]]
    eng.step()
    tables = [eng.allocator.block_table(i) for i in ids]
    first = {t[0] for t in tables}
    self.assertLen(first, 1)  # the same (page, tag) in every table
    (page, _), = first
    self.assertEqual(eng.allocator.refcounts[page], 4)  # three requests + the cache
    eng.run_until_done()

  def _shared_page_fault(self, corrupt):
    """Three requests share the system prompt's first page; ``corrupt(eng, page)`` breaks it."""
    eng = Engine(params(), engine_config(prefix_cache=True))
    eng.generate([PROMPTS[0]], SAMPLINGS[0])
    sharers = [eng.submit(p, SamplingParams(max_new_tokens=5)) for p in PROMPTS[1:3]]
    bystander = eng.submit(prompt(9, 5), SamplingParams(max_new_tokens=5))
    eng.step()
    page = eng.allocator.block_table(sharers[0])[0][0]
    self.assertEqual(eng.allocator.block_table(sharers[1])[0][0], page)
    self.assertNotIn(page, [p for p, _ in eng.allocator.block_table(bystander)])
    corrupt(eng, page)
    eng.run_until_done()
    for rid in sharers:
      self.assertEqual(eng.get(rid).abort_reason, ABORT_INTEGRITY)
    self.assertEqual(eng.get(bystander).status, RequestStatus.FINISHED)
    want = Engine(params(), engine_config()).generate([prompt(9, 5)],
                                                      SamplingParams(max_new_tokens=5))[0]
    self.assertEqual(eng.get(bystander).output, want)
    self.assertNotIn(page, eng.prefix_cache.pages())  # never matched again
    self.assertNotEqual(eng.prefix_cache.match(PROMPTS[1]).pages[:1], (page,))
    self.assertEmpty(eng.allocator.audit())
    # Later requests with the same prefix are served correctly.
    again = eng.generate([PROMPTS[1]], SamplingParams(max_new_tokens=5))[0]
    self.assertEqual(again, Engine(params(), engine_config()).generate(
        [PROMPTS[1]], SamplingParams(max_new_tokens=5))[0])
    return eng

  def test_a_double_allocated_shared_page_aborts_every_holder_and_no_one_else(self):
    # The first running request is a sharer; its page 0 is the shared one.
    eng = self._shared_page_fault(lambda eng, page: eng.inject_fault(
        Fault(FaultKind.DOUBLE_ALLOCATION, eng.scheduler.running[0].request_id, 0)))
    self.assertGreaterEqual(eng.stats.page_violations, 1)

  def test_a_bad_device_tag_on_a_shared_page_aborts_every_holder_and_no_one_else(self):
    def flip(eng, page):
      tags = eng.state.page_tags
      eng.state = dataclasses.replace(eng.state, page_tags=tags.at[page].set(tags[page] ^ 1))

    eng = self._shared_page_fault(flip)
    self.assertEqual(eng.stats.integrity_failures, 2)
    self.assertGreater(eng.prefix_cache.stats.invalidated_pages, 0)


class DisaggPrefixCacheTest(absltest.TestCase):

  def test_both_pools_reuse_prefixes_with_identical_outputs(self):
    # The prefill pool prefills only what follows its cached prefix; the decode pool
    # shares what its own cache holds, and only the rest of the KV is transferred.
    import jax

    from mlkit.engine import DisaggConfig, DisaggEngine, PoolConfig
    from mlkit.parallel import MeshConfig
    from mlkit.quant import BF16

    def disagg(prefix_cache):
      pool = lambda: PoolConfig(engine_config(prefix_cache=prefix_cache), BF16, MeshConfig())
      return DisaggEngine(params(), DisaggConfig(prefill=pool(), decode=pool()),
                          devices=jax.devices()[:2])

    def serve(eng):
      out = [eng.generate([p], s)[0] for p, s in zip(PROMPTS[:3], SAMPLINGS[:3])]
      return out + eng.generate(PROMPTS, SAMPLINGS)

    want = serve(disagg(False))
    eng = disagg(True)
    self.assertEqual(serve(eng), want)
    m = eng.metrics()["pools"]["prefill"]["prefix_cache"]
    self.assertGreater(m["hits"], 2)
    self.assertGreater(m["tokens_saved"], 0)
    d = eng.metrics()["disagg"]
    self.assertEqual(d["transfers"], 9 + d["requeued"])  # a request preempted in decode moves twice
    self.assertGreater(d["transfer_tokens_skipped"], 0)
    self.assertGreater(eng.metrics()["pools"]["decode"]["prefix_cache"]["hits"], 2)
    self.assertEmpty(eng.decode.allocator.audit())
    self.assertEmpty(eng.prefill.allocator.audit())


if __name__ == "__main__":
  absltest.main()
