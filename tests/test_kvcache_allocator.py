"""Host page allocator (tags, refcounts, admission, block tables) and capacity accounting."""

import dataclasses

import numpy as np
from absl.testing import absltest, parameterized

from configs import GLM_5_2, KIMI_K2_6, TINY_GQA, TINY_MLA
from mlkit import kvcache as kvc


class AllocatorPropertyTest(parameterized.TestCase):

  @parameterized.parameters(0, 1, 2, 3)
  def test_random_alloc_free_sequences(self, seed):
    """Random alloc/free/share sequences: fresh tags on reallocation, no double ownership, no leaks."""
    rng = np.random.default_rng(seed)
    N = 13
    alloc = kvc.PageAllocator(num_pages=N, page_size=4)
    owned = {}  # owner id -> list of pages
    refs = np.zeros(N, int)  # model refcounts
    last_tag = {}  # page -> tag at its previous allocation
    issued = set()  # every tag handed out so far
    next_owner = 0
    for _ in range(400):
      op = rng.integers(0, 3)
      if op == 0:
        n = int(rng.integers(0, 5))
        if n > alloc.num_free:
          with self.assertRaisesRegex(kvc.OutOfPages, f"{n} pages requested, {alloc.num_free} free"):
            alloc.allocate(n)
          continue
        pages = alloc.allocate(n)
        self.assertLen(set(pages), n)
        for p in pages:
          self.assertEqual(refs[p], 0, f"page {p} handed out while owned")
          tag = int(alloc.tags[p])
          self.assertNotEqual(tag, 0)
          self.assertNotIn(tag, issued, "a tag was issued twice")
          issued.add(tag)
          if p in last_tag:
            self.assertNotEqual(tag, last_tag[p], f"page {p} reallocated with its old tag")
          last_tag[p] = tag
          refs[p] = 1
        owned[next_owner] = pages
        next_owner += 1
      elif op == 1 and owned:
        key = list(owned)[rng.integers(0, len(owned))]
        alloc.free(owned.pop(key))
      elif op == 2 and owned:  # share an owner's pages with a new owner (prefix sharing)
        key = list(owned)[rng.integers(0, len(owned))]
        alloc.share(owned[key])
        owned[next_owner] = list(owned[key])
        next_owner += 1
      # Recompute the model refcounts from the owners and compare with the allocator's.
      refs = np.zeros(N, int)
      for pages in owned.values():
        for p in pages:
          refs[p] += 1
      np.testing.assert_array_equal(alloc.refcounts, refs)
      self.assertEqual(alloc.num_free, int(np.sum(refs == 0)))
    for pages in owned.values():
      alloc.free(pages)
    self.assertEqual(alloc.num_free, N)  # all pages come back
    np.testing.assert_array_equal(alloc.refcounts, 0)
    self.assertEqual(sorted(alloc.allocate(N)), list(range(N)))

  def test_tag_wraps_and_skips_zero(self):
    self.assertEqual(kvc.next_tag(0xFFFFFFFF), 1)
    self.assertEqual(kvc.next_tag(0xFFFFFFFE), 0xFFFFFFFF)
    self.assertEqual(kvc.next_tag(7), 8)
    self.assertEqual(kvc.tag_to_int32(0xFFFFFFFF), -1)
    self.assertEqual(kvc.tag_to_int32(0x80000000), -2**31)
    alloc = kvc.PageAllocator(3, 4)
    alloc.generation = 0x7FFFFFFF
    self.assertEqual(alloc.allocate(1), [0])  # tag 0x80000000
    alloc.generation = 0xFFFFFFFE
    self.assertEqual(alloc.allocate(2), [1, 2])  # tags 0xFFFFFFFF, then wrap past 0 to 1
    np.testing.assert_array_equal(alloc.tags, np.array([0x80000000, 0xFFFFFFFF, 1], np.uint32))
    np.testing.assert_array_equal(alloc.device_tags(), np.array([-2**31, -1, 1], np.int32))

  def test_tags_unique_across_pages(self):
    # One pool-wide counter: a table entry pointing at the wrong page cannot match by accident.
    alloc = kvc.PageAllocator(4, 4)
    first = alloc.allocate(4)
    alloc.free(first[:2])
    alloc.allocate(2)
    self.assertLen(set(alloc.tags.tolist()), 4)
    self.assertEqual(sorted(alloc.tags.tolist()), [3, 4, 5, 6])

  def test_free_errors_leave_state_unchanged(self):
    alloc = kvc.PageAllocator(4, 4)
    pages = alloc.allocate(2)
    with self.assertRaisesRegex(ValueError, "page 9 is outside the pool of 4"):
      alloc.free([9])
    with self.assertRaisesRegex(ValueError, f"page {pages[0]} freed 2 times but holds 1"):
      alloc.free([pages[0], pages[0]])
    free_page = [p for p in range(4) if p not in pages][0]
    with self.assertRaisesRegex(ValueError, f"free: page {free_page} is not allocated"):
      alloc.free([pages[1], free_page])  # the valid part must not be applied either
    with self.assertRaisesRegex(ValueError, "share: page .* is not allocated"):
      alloc.share([free_page])
    with self.assertRaisesRegex(ValueError, "n must be an int >= 0"):
      alloc.allocate(-1)
    np.testing.assert_array_equal(alloc.refcounts[pages], [1, 1])
    self.assertEqual(alloc.num_free, 2)
    with self.assertRaisesRegex(ValueError, "positive int num_pages and page_size"):
      kvc.PageAllocator(0, 4)


class RequestTest(absltest.TestCase):

  def test_admission_when_pages_run_out(self):
    alloc = kvc.PageAllocator(num_pages=5, page_size=4)
    self.assertIsNone(alloc.admit("a", 9))  # 3 pages
    refused = alloc.admit("b", 9)  # needs 3, 2 free
    self.assertIsInstance(refused, kvc.CannotAdmit)
    self.assertEqual((refused.pages_needed, refused.pages_free), (3, 2))
    self.assertIn("cannot admit request 'b': needs 3 pages, 2 free", str(refused))
    self.assertFalse(alloc.has_request("b"))
    self.assertEqual(alloc.num_free, 2)  # nothing was taken
    self.assertIsNone(alloc.admit("c", 8))  # exactly the 2 remaining pages
    self.assertEqual(alloc.num_free, 0)
    self.assertIsInstance(alloc.extend("a", 13), kvc.CannotAdmit)  # decode growth needs a page
    self.assertEqual(alloc.length("a"), 9)
    self.assertIsNone(alloc.extend("a", 12))  # fits in a's last page
    alloc.release("c")
    self.assertIsNone(alloc.admit("b", 4))  # 1 page, leaving 1
    self.assertIsNone(alloc.extend("a", 13))
    self.assertEqual(alloc.num_free, 0)
    with self.assertRaisesRegex(ValueError, "already admitted"):
      alloc.admit("a", 1)
    with self.assertRaisesRegex(ValueError, "cannot shrink"):
      alloc.extend("a", 3)
    with self.assertRaisesRegex(ValueError, "unknown request 'zz'"):
      alloc.release("zz")
    with self.assertRaisesRegex(ValueError, "num_tokens must be >= 0"):
      alloc.admit("d", -1)

  def test_block_tables_and_batch_meta(self):
    alloc = kvc.PageAllocator(num_pages=8, page_size=4)
    alloc.admit("a", 6)
    alloc.admit("b", 1)
    table = alloc.block_table("a")
    self.assertLen(table, 2)
    for p, t in table:
      self.assertEqual(t, int(alloc.tags[p]))
    meta = alloc.batch_meta(["b", None, "a"], max_pages=3)
    self.assertEqual(meta.page_size, 4)
    np.testing.assert_array_equal(np.asarray(meta.lengths), [1, 0, 6])
    bt = np.asarray(meta.block_tables)
    np.testing.assert_array_equal(bt[2, :2], [p for p, _ in table])
    np.testing.assert_array_equal(bt[2, 2:], kvc.PAD_PAGE)
    np.testing.assert_array_equal(bt[1], kvc.PAD_PAGE)
    np.testing.assert_array_equal(np.asarray(meta.expected_tags)[2, :2], [t for _, t in table])
    with self.assertRaisesRegex(ValueError, "holds 2 pages, max_pages is 1"):
      alloc.batch_meta(["a"], max_pages=1)

  def test_fork_shares_full_pages_and_copies_the_tail(self):
    alloc = kvc.PageAllocator(num_pages=6, page_size=4)
    alloc.admit("parent", 10)  # pages: full, full, partial
    parent = alloc.block_table("parent")
    copies = alloc.fork("parent", "child")
    child = alloc.block_table("child")
    self.assertEqual(child[:2], parent[:2])  # shared prefix, same tags
    self.assertNotEqual(child[2][0], parent[2][0])
    self.assertEqual(copies, [(parent[2][0], child[2][0])])
    np.testing.assert_array_equal(alloc.refcounts[[p for p, _ in parent]], [2, 2, 1])
    self.assertEqual(alloc.fork("parent", "c2", 8), [])  # page-aligned prefix: nothing to copy
    alloc.release("parent")
    alloc.release("child")
    alloc.release("c2")
    self.assertEqual(alloc.num_free, 6)
    alloc.admit("p", 3)
    alloc.admit("filler", 20)
    self.assertIsInstance(alloc.fork("p", "q"), kvc.CannotAdmit)
    self.assertFalse(alloc.has_request("q"))
    with self.assertRaisesRegex(ValueError, "parent holds 3"):
      alloc.fork("p", "r", 4)
    with self.assertRaisesRegex(ValueError, "fork: request 'filler' is already admitted"):
      alloc.fork("p", "filler")
    with self.assertRaisesRegex(ValueError, "unknown request 'nobody'"):
      alloc.fork("nobody", "r")
    with self.assertRaisesRegex(ValueError, "unknown request 'nobody'"):
      alloc.batch_meta(["p", "nobody"])


class ConservationTest(parameterized.TestCase):
  """Conservation by construction, the audit, quarantine and recovery."""

  def _pool(self):
    alloc = kvc.PageAllocator(num_pages=8, page_size=4)
    alloc.admit("a", 8)  # pages 0, 1
    alloc.admit("b", 4)  # page 2
    return alloc

  def test_freed_page_is_listed_once(self):
    alloc = self._pool()
    p = alloc.block_table("b")[0][0]
    with alloc.tampering() as t:
      t.list_first(p)  # listed free while held (a bug elsewhere)
    alloc.release("b")  # its last reference: the page is free now, and listed once
    self.assertLen(list(alloc._free), alloc.num_free)
    self.assertEqual(alloc.num_free, 6)
    self.assertEmpty(alloc.audit())

  def test_allocate_never_returns_a_live_page(self):
    alloc = self._pool()
    live = alloc.block_table("a")[0][0]
    with alloc.tampering() as t:
      t.list_first(live)
    got = alloc.allocate(2)
    self.assertNotIn(live, got)
    self.assertIn(live, alloc.quarantined)
    (v,) = alloc.drain_violations()
    self.assertEqual((v.kind, v.pages, v.requests), ("live_on_free_list", (live,), ("a",)))
    self.assertEmpty(alloc.drain_violations())
    self.assertEqual(int(alloc.refcounts[live]), 1)  # its owner's reference is untouched
    # When the pool is short because of it, nothing is taken and the shortfall is said.
    alloc2 = self._pool()
    with alloc2.tampering() as t:
      t.list_first(alloc2.block_table("a")[0][0])
    with self.assertRaisesRegex(kvc.OutOfPages, "6 pages requested, 5 free"):
      alloc2.allocate(6)
    self.assertEqual(alloc2.num_free, 5)
    self.assertIsInstance(alloc2.admit("c", 24), kvc.CannotAdmit)

  def test_audit_names_each_violation(self):
    cases = {
        # A use after free: the page is free but still in a's table.
        "refcount_mismatch": lambda a: a.free([a.block_table("a")[1][0]]),
        "live_on_free_list": lambda a: a._free.update({a.block_table("b")[0][0]: None}),
        "leaked": lambda a: a._free.pop(7),
        "out_of_pool": lambda a: setattr(a._requests["b"], "pages",
                                         np.append(a._requests["b"].pages, 99).astype(np.int32)),
    }
    for kind, corrupt in cases.items():
      alloc = self._pool()
      self.assertEmpty(alloc.audit())
      corrupt(alloc)
      violations = alloc.audit()
      self.assertIn(kind, [v.kind for v in violations], kind)
      v = next(v for v in violations if v.kind == kind)
      self.assertIn(kind, str(v))
      holders = alloc.recover(violations)
      self.assertEmpty(alloc.audit(), kind)
      for rid in holders:
        self.assertFalse(alloc.has_request(rid))
      self.assertEqual(alloc.num_free + alloc.num_used + len(alloc.quarantined), 8)
      self.assertEqual(sorted(alloc.quarantined), sorted({p for v in violations for p in v.pages}))

  def test_wrong_entry_quarantines_both_pages_and_drops_both_holders(self):
    alloc = self._pool()
    (pa0, _), (pa1, _) = alloc.block_table("a")
    pb = alloc.block_table("b")[0][0]
    alloc._requests["a"].pages[1] = pb  # a's entry now names b's page; pa1 is orphaned
    violations = alloc.audit()
    self.assertEqual({p for v in violations for p in v.pages}, {pa1, pb})
    self.assertEqual(alloc.recover(violations), ["a", "b"])
    self.assertEqual(set(alloc.quarantined), {pa1, pb})
    self.assertEqual(alloc.num_free, 6)  # pa0 came back; the two suspects stay out
    alloc.admit("c", 24)
    self.assertTrue({pa1, pb}.isdisjoint(p for p, _ in alloc.block_table("c")))
    alloc.release("c")
    self.assertNotIn(pb, alloc._free)

  def test_quarantined_page_stays_out_until_it_heals(self):
    alloc = self._pool()
    p = alloc.block_table("a")[0][0]
    alloc.quarantine([p])
    with self.assertRaisesRegex(ValueError, "quarantined"):
      alloc.share([p])
    alloc.release("a")  # its holder lets go: the page stays out of circulation
    self.assertNotIn(p, alloc._free)
    self.assertEqual(alloc.num_used + alloc.num_free + len(alloc.quarantined), 8)
    self.assertEmpty(alloc.audit())
    self.assertEqual(alloc.heal(grace=0), [p])  # nobody holds it: it may heal at once
    self.assertNotIn(p, alloc.quarantined)
    self.assertEqual(list(alloc._free)[-1], p)  # at the end of the free list
    self.assertEmpty(alloc.audit())
    with self.assertRaisesRegex(ValueError, "outside the pool"):
      alloc.quarantine([8])

  def test_heal_waits_for_holders_and_grace_and_retags(self):
    alloc = self._pool()
    (pa0, ta0), _ = alloc.block_table("a")
    alloc.quarantine([pa0])
    self.assertEqual((alloc.quarantined_total, alloc.healed_total), (1, 0))
    for _ in range(5):
      alloc.tick()
    self.assertEqual(alloc.heal(grace=3), [])  # "a" still holds it
    alloc.release("a")
    self.assertEqual(alloc.heal(grace=6), [])  # five ticks out of six
    alloc.tick()
    self.assertEqual(alloc.heal(grace=6), [pa0])
    self.assertEqual((alloc.quarantined_total, alloc.healed_total), (1, 1))
    # A fresh tag: a stale table entry that still names the page no longer matches it, and
    # no earlier allocation ever carried this tag.
    self.assertNotEqual(int(alloc.tags[pa0]), ta0)
    self.assertEqual(int(alloc.tags[pa0]), alloc.generation)
    self.assertEqual(alloc.num_free, 7)
    self.assertEmpty(alloc.audit())
    # A page some table still names does not heal, whatever its refcount says.
    alloc2 = self._pool()
    pb = alloc2.block_table("b")[0][0]
    alloc2.quarantine([pb])
    alloc2.refcounts[pb] = 0  # a bookkeeping bug: b's table still lists it
    self.assertEqual(alloc2.heal(grace=0), [])
    self.assertIn(pb, alloc2.quarantined)

  def test_drop_and_reconcile_keeps_pages_others_list(self):
    a = kvc.PageAllocator(6, 8)
    a.admit("v", 16)
    a.admit("b", 8)
    (p_v0, _), (p_v1, _) = a.block_table("v")
    p_b = a.block_table("b")[0][0]
    a._requests["v"].pages[1] = p_b  # v's second entry points at b's page; p_v1 is orphaned
    reclaimed = a.drop_and_reconcile("v")
    self.assertCountEqual(reclaimed, [p_v0, p_v1])
    self.assertEqual(a.num_free, 5)
    self.assertEqual(int(a.refcounts[p_b]), 1)
    a.release("b")
    self.assertEqual(a.num_free, 6)

  def test_release_checked_falls_back_to_reconcile(self):
    alloc = self._pool()
    (p0, _), (p1, _) = alloc.block_table("a")
    alloc.free([p0])  # freed behind a's back: a plain release would double-free it
    self.assertEqual(alloc.release_checked("a"), [p1])  # p1 reclaimed; p0 was already free
    self.assertFalse(alloc.has_request("a"))
    self.assertEmpty(alloc.audit())
    self.assertEqual(alloc.num_free, 7)

  def test_release_checked_spares_a_page_reused_by_another_request(self):
    # a's page p0 is freed behind its back and handed to c (a use after free): a's
    # table still names p0, with the old tag. Releasing a by its table would drop
    # c's only reference and put c's live page on the free list.
    alloc = self._pool()
    (p0, t0), (p1, _) = alloc.block_table("a")
    alloc.free([p0])
    with alloc.tampering() as t:
      t.list_first(p0)  # reused next
    self.assertIsNone(alloc.admit("c", 1))
    self.assertEqual(alloc.block_table("c")[0][0], p0)
    self.assertNotEqual(alloc.block_table("c")[0][1], t0)
    self.assertEqual(alloc.release_checked("a"), [p1])
    self.assertEqual(alloc.block_table("c")[0][0], p0)
    self.assertEqual(int(alloc.refcounts[p0]), 1)
    rest = alloc.allocate(alloc.num_free)
    self.assertNotIn(p0, rest)
    alloc.free(rest)
    self.assertEmpty(alloc.audit())


# TINY_MLA with sparse attention: full, shared, full indexer layers.
TINY_DSA = dataclasses.replace(TINY_MLA, name="tiny-dsa", index_n_heads=2, index_head_dim=16,
                               index_topk=4, indexer_types=("full", "shared", "full"))


class CapacityTest(parameterized.TestCase):

  def test_kimi_per_gpu(self):
    self.assertEqual(kvc.bytes_per_token(KIMI_K2_6, "bfloat16"), 70_272)
    bd = kvc.bytes_per_token_breakdown(KIMI_K2_6, "float8_e4m3fn", tp=8)
    self.assertEqual(bd["values"], 35_136)
    self.assertEqual(bd["scales"], 61 * 2 * 4)
    self.assertEqual(bd["total"], 35_136 + 488)
    bf = kvc.capacity(KIMI_K2_6, "bfloat16", 48 * 10**9)
    f8 = kvc.capacity(KIMI_K2_6, "float8_e4m3fn", 48 * 10**9)
    self.assertEqual(bf["tokens"], 683_008)  # the report: ~686K
    self.assertEqual(f8["tokens"], 1_347_392)  # the report: ~1.37M (it omits scales)
    self.assertGreaterEqual(f8["tokens"] / bf["tokens"], 1.95)

  def test_glm_indexer(self):
    # GLM 5.2 runs its indexer on every layer: index keys in the pool's layout.
    bf = kvc.bytes_per_token_breakdown(GLM_5_2, "bfloat16")
    self.assertEqual(bf["values"], 78 * 576 * 2)
    self.assertEqual(bf["indexer"], 78 * 128 * 2)
    f8 = kvc.bytes_per_token_breakdown(GLM_5_2, "float8_e4m3fn")
    self.assertEqual(f8["indexer"], 78 * (128 + 4))  # fp8 keys + one f32 scale per token
    with self.assertRaisesRegex(ValueError, "pool's dtype"):
      kvc.bytes_per_token(GLM_5_2, "float8_e4m3fn", index_dtype="bfloat16")
    # Declared only (no indexer_types): the analytic size, bf16 keys unless told.
    declared = dataclasses.replace(GLM_5_2, indexer_types=())
    d8 = kvc.bytes_per_token_breakdown(declared, "float8_e4m3fn")
    self.assertEqual(d8["indexer"], bf["indexer"])  # the KV dtype does not change it
    d8i = kvc.bytes_per_token_breakdown(declared, "float8_e4m3fn", index_dtype="float8_e4m3fn")
    self.assertEqual(d8i["indexer"], 78 * (128 + 4))
    self.assertEqual(kvc.bytes_per_token_breakdown(KIMI_K2_6, "bfloat16")["indexer"], 0)

  def test_gqa_tensor_parallel(self):
    cfg = dataclasses.replace(TINY_GQA, n_kv_heads=4, n_heads=8)
    self.assertEqual(kvc.bytes_per_token(cfg, "bfloat16"), 2 * 2 * 4 * 16 * 2)
    self.assertEqual(kvc.bytes_per_token(cfg, "bfloat16", tp=2), 2 * 2 * 2 * 16 * 2)
    self.assertEqual(kvc.bytes_per_token(cfg, "float8_e4m3fn", tp=4), 2 * (2 * 16 + 2 * 4))

  def test_sparse_attention_counts_the_pool_layout(self):
    # A config that runs its indexer pages index keys on its full layers only, in the
    # pool's dtype (fp8: one f32 scale per token), not the declared-only analytic size.
    Di = TINY_DSA.index_head_dim
    bf = kvc.bytes_per_token_breakdown(TINY_DSA, "bfloat16")
    self.assertEqual(bf["indexer"], 2 * Di * 2)  # layers 0 and 2 are full, layer 1 shared
    f8 = kvc.bytes_per_token_breakdown(TINY_DSA, "float8_e4m3fn")
    self.assertEqual(f8["indexer"], 2 * (Di + 4))
    self.assertEqual(kvc.bytes_per_token_breakdown(TINY_DSA, "float32")["indexer"], 2 * Di * 4)
    with self.assertRaisesRegex(ValueError, "pool's dtype"):
      kvc.bytes_per_token(TINY_DSA, "bfloat16", index_dtype="float8_e4m3fn")

  @parameterized.product(cfg=[TINY_MLA, TINY_GQA, TINY_DSA],
                         dtype=["bfloat16", "float8_e4m3fn", "float32"])
  def test_accounting_matches_allocated_pool(self, cfg, dtype):
    cap = kvc.capacity(cfg, dtype, 100_000, page_size=4)
    state = kvc.init_paged_state(cfg, kvc.KVCacheConfig(cap["pages"], 4, dtype))
    self.assertEqual(state.nbytes(), cap["pages"] * cap["bytes_per_page"])
    self.assertLessEqual(state.nbytes(), 100_000)
    self.assertGreater(state.nbytes() + cap["bytes_per_page"], 100_000)

  def test_errors(self):
    with self.assertRaisesRegex(ValueError, "dtype must be one of"):
      kvc.bytes_per_token(KIMI_K2_6, "int8")
    with self.assertRaisesRegex(ValueError, "index_dtype must be one of"):
      kvc.bytes_per_token(GLM_5_2, "bfloat16", index_dtype="fp8")
    with self.assertRaisesRegex(ValueError, "tp must be >= 1"):
      kvc.bytes_per_token(KIMI_K2_6, "bfloat16", tp=0)
    with self.assertRaisesRegex(ValueError, "budget_bytes must be >= 0"):
      kvc.capacity(KIMI_K2_6, "bfloat16", -1)
    with self.assertRaisesRegex(ValueError, "page_size must be positive"):
      kvc.capacity(KIMI_K2_6, "bfloat16", 10, page_size=0)


if __name__ == "__main__":
  absltest.main()
