"""Randomised model-based tests (hypothesis stateful) of the allocator and the engine.

``AllocatorMachine`` drives a PageAllocator with admissions, growth, forks
(shared pages), releases and every bookkeeping fault followed by the audit's
recovery, against a plain model of who holds what. ``EngineMachine`` drives a
real Engine (f32, tiny model, a pool small enough to preempt, speculative decoding
on or off) with submits, steps, cancels and every fault kind. After every operation:

* page conservation holds (free + held + quarantined = all pages, refcounts
  equal block-table entries), whenever no injected fault is still pending;
* a page is in two block tables only if it is shared by refcount;
* every live request's expected tags match the pool's (host and device);
* and at the end every finished request's output equals its solo run, every
  aborted one's is a prefix of it: no fault ever produces a wrong token.

CI runs a fixed budget (the "ci" hypothesis profile, derandomised, about a
minute); ``make soak`` runs the "soak" profile for a long randomised search.
"""

import collections
import functools

import hypothesis.strategies as st
import jax
import numpy as np
from absl.testing import absltest
from hypothesis import settings
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize, invariant,
                                 precondition, rule)

from mlkit.engine import Engine, Fault, FaultKind, RequestStatus
from mlkit.engine import faults as faults_lib
from mlkit.kvcache import PageAllocator
from mlkit.model import init_params
from mlkit.sampling import SamplingParams
from test_reliability import CFG, NUM_PAGES, engine_config, params, solo

# ----------------------------------------------------------------------------- allocator

N_PAGES, PAGE_SIZE = 12, 4


class AllocatorMachine(RuleBasedStateMachine):
  """A PageAllocator against a model: request -> (pages, tags) it was given."""

  requests = Bundle("requests")

  @initialize()
  def setup(self):
    self.alloc = PageAllocator(N_PAGES, PAGE_SIZE)
    self.model: dict[int, list[tuple[int, int]]] = {}  # rid -> [(page, tag)], untouched by faults
    self.tainted: set[int] = set()  # requests a fault corrupted (their tables are not trusted)
    self.shared: collections.Counter = collections.Counter()  # page -> extra references by forks
    self.next_id = 0
    self.issued_tags: set[int] = set()
    self.pending = False  # an injected fault that recover() has not dealt with yet

  def _new_id(self) -> int:
    self.next_id += 1
    return self.next_id

  def _record(self, rid):
    table = self.alloc.block_table(rid)
    self.model[rid] = table

  def _live(self) -> set[int]:
    return set(np.flatnonzero(self.alloc.refcounts > 0).tolist())

  def _check_fresh(self, pages, live_before):
    """Newly handed-out pages: never live before, each once, each with a never-issued tag."""
    assert not live_before.intersection(pages), f"live page(s) {live_before & set(pages)} handed out"
    assert len(set(pages)) == len(pages)
    for p in pages:
      t = int(self.alloc.tags[p])
      assert t not in self.issued_tags, "a tag was issued twice"
      self.issued_tags.add(t)

  @rule(target=requests, tokens=st.integers(0, 24))
  def admit(self, tokens):
    rid = self._new_id()
    free_before, live_before = self.alloc.num_free, self._live()
    refused = self.alloc.admit(rid, tokens)
    if refused is not None:
      assert not self.alloc.has_request(rid)
      # Refused only when short of pages (a corrupt free list may hold fewer usable ones).
      assert self.alloc.pages_for(tokens) > free_before or self.pending
      return rid
    self._check_fresh([p for p, _ in self.alloc.block_table(rid)], live_before)
    self._record(rid)
    return rid

  @rule(rid=requests, more=st.integers(0, 9))
  def extend(self, rid, more):
    if not self.alloc.has_request(rid) or rid in self.tainted or rid not in self.model:
      return
    before, live_before = self.alloc.block_table(rid), self._live()
    if self.alloc.extend(rid, self.alloc.length(rid) + more) is None:
      after = self.alloc.block_table(rid)
      assert after[:len(before)] == before
      self._check_fresh([p for p, _ in after[len(before):]], live_before)
      self._record(rid)
    else:
      assert self.alloc.block_table(rid) == before

  @rule(target=requests, parent=requests, frac=st.floats(0, 1))
  def fork(self, parent, frac):
    if not self.alloc.has_request(parent) or parent in self.tainted or parent not in self.model:
      return self._new_id()
    child = self._new_id()
    n = int(self.alloc.length(parent) * frac)
    live_before = self._live()
    res = self.alloc.fork(parent, child, n)
    if isinstance(res, list):
      full = n // PAGE_SIZE
      table = self.alloc.block_table(child)
      assert table[:full] == self.alloc.block_table(parent)[:full]
      self._check_fresh([p for p, _ in table[full:]], live_before)
      self._record(child)
    return child

  @rule(rid=consumes(requests))
  def release(self, rid):
    if not self.alloc.has_request(rid):
      return
    if rid in self.tainted or self.pending:
      self.alloc.release_checked(rid)
    else:
      self.alloc.release(rid)
    self.model.pop(rid, None)
    self.tainted.discard(rid)

  @rule(rid=requests, kind=st.sampled_from(list(FaultKind)), index=st.integers(0, 5))
  def inject_fault(self, rid, kind, index):
    # A tainted victim's table is stale: its pages may be someone else's by now, so a
    # second fault through it would corrupt a request the model still trusts.
    if not self.alloc.has_request(rid) or not self.alloc.block_table(rid) or rid in self.tainted:
      return
    pages = self.alloc.block_table(rid)
    if kind is FaultKind.USE_AFTER_FREE and self.alloc.refcounts[pages[index % len(pages)][0]] != 1:
      return
    # A double allocation reaches every holder of the page (a forked sharer too): the
    # page gets quarantined under all of them, and the allocator refuses to share it
    # further. The other kinds corrupt the victim's own table or page only.
    sharers = (self.alloc.holders([pages[index % len(pages)][0]])
               if kind is FaultKind.DOUBLE_ALLOCATION else [])
    record = faults_lib.inject(self.alloc, Fault(kind, rid, index % len(pages)))
    self.tainted.add(rid)
    self.tainted.update(sharers)
    if record.other_owner is not None:
      self.tainted.add(record.other_owner)
    self.pending = True  # corrupt until the next recover(); allocations may meet it meanwhile

  @rule(n=st.integers(1, 4))
  def allocate_raw(self, n):
    # A raw allocation never returns a live page, even when the free list is corrupt.
    live_before = self._live()
    try:
      pages = self.alloc.allocate(n)
    except ValueError:
      return
    self._check_fresh(pages, live_before)
    self.alloc.free(pages)

  @rule(grace=st.integers(0, 3))
  def heal(self, grace):
    # Quarantined pages come back once no table names them, each with a tag never issued.
    self.alloc.tick()
    quarantined = set(self.alloc.quarantined)
    for p in self.alloc.heal(grace):
      assert p in quarantined and self.alloc.refcounts[p] == 0, p
      t = int(self.alloc.tags[p])
      assert t not in self.issued_tags, "a healed page got an old tag"
      self.issued_tags.add(t)

  @rule()
  def recover(self):
    """What the engine does around every step: audit, quarantine, drop the holders.

    The engine's audit looks only at the pages changed since the last one; it must find
    exactly what a full audit of the pool finds.
    """
    changed = self.alloc.audit_changes()
    full = self.alloc.audit()
    assert ({(v.kind, v.pages) for v in changed} == {(v.kind, v.pages) for v in full}), (
        changed, full)
    violations = changed + self.alloc.drain_violations()
    if violations:
      for rid in self.alloc.recover(violations):
        self.model.pop(rid, None)
        self.tainted.discard(rid)
    # STALE_TAG is invisible to the audit (the tag check catches it): drop such requests too.
    for rid in list(self.tainted):
      if self.alloc.has_request(rid):
        self.alloc.drop_and_reconcile(rid)
      self.model.pop(rid, None)
      self.tainted.discard(rid)
    self.pending = False

  @invariant()
  def conserved(self):
    if not hasattr(self, "alloc") or self.pending:
      return
    assert self.alloc.audit_changes() == []
    assert self.alloc.audit() == []
    assert self.alloc.num_free + self.alloc.num_used + len(self.alloc.quarantined) == N_PAGES
    # Every untouched request still holds exactly the pages and tags it was given.
    for rid, table in self.model.items():
      assert self.alloc.block_table(rid) == table, rid
      for p, t in table:
        assert int(self.alloc.tags[p]) == t, (rid, p)
    # A page in two tables is shared by refcount.
    counts = collections.Counter(p for rid in self.alloc.request_ids
                                 for p, _ in self.alloc.block_table(rid))
    for p, c in counts.items():
      assert self.alloc.refcounts[p] == c


# ----------------------------------------------------------------------------- engine

@functools.cache
def params_with_mtp():
  """params() plus the MTP layer (init_params draws the main weights the same either way)."""
  return init_params(CFG, jax.random.key(0), mtp=())


_PROMPT_LEN = st.integers(1, 20)
_SHARED = np.random.default_rng(99).integers(0, 256, 13).tolist()


class EngineMachine(RuleBasedStateMachine):
  """A real Engine (f32, 16 pages of 4 tokens: preemption happens) under random operations."""

  @initialize(audit=st.booleans(), overlap=st.booleans(), prefix_cache=st.booleans(),
              speculative=st.sampled_from((0, 2)))
  def setup(self, audit, overlap, prefix_cache, speculative):
    # Speculative engines draft with the MTP layer (the main weights are params()'s).
    weights = params_with_mtp() if speculative else params()
    self.eng = Engine(weights, engine_config(page_audit=audit, overlap=overlap,
                                             prefix_cache=prefix_cache,
                                             speculative_tokens=speculative))
    self.rng = np.random.default_rng(0)
    # Steps until an injected fault has been dealt with: one synchronously. Overlapped, up
    # to three: a step may only collect the victim's last prefill chunk, the next only
    # launch its first decode row, and the one after collects (and checks) that row.
    self.fault_pending = 0
    # Requests whose tables a fault corrupted. A stale entry for a page past what the
    # request has used is only checked (and the request aborted) once a step reaches it.
    self.victims: set = set()

  @rule(n=_PROMPT_LEN, new=st.integers(1, 6), seed=st.integers(0, 3), greedy=st.booleans(),
        shared=st.integers(0, 13))
  def submit(self, n, new, seed, greedy, shared):
    # The first ``shared`` tokens come from one common prefix (prefix-cache hits, partial pages).
    p = (_SHARED[:shared] + self.rng.integers(0, 256, n).tolist())[:20]
    sp = SamplingParams(max_new_tokens=new, seed=seed, temperature=0.0 if greedy else 0.8)
    self.eng.submit(p, sp)

  @rule()
  def step(self):
    if self.eng.has_unfinished():
      self.eng.step()
      self.fault_pending = max(self.fault_pending - 1, 0)

  @rule(data=st.data())
  def cancel(self, data):
    live = [r for r in self.eng.requests.values() if not r.done]
    if live:
      self.eng.cancel(data.draw(st.sampled_from(live)).request_id)

  @precondition(lambda self: not self.fault_pending)
  @rule(data=st.data(), kind=st.sampled_from(list(FaultKind)))
  def inject_fault(self, data, kind):
    held = [rid for rid in self.eng.allocator.request_ids if self.eng.allocator.block_table(rid)]
    if not held:
      return
    rid = data.draw(st.sampled_from(held))
    pages = self.eng.allocator.block_table(rid)
    index = data.draw(st.integers(0, len(pages) - 1))
    if kind is FaultKind.USE_AFTER_FREE and self.eng.allocator.refcounts[pages[index][0]] != 1:
      return
    self.eng.inject_fault(Fault(kind, rid, index))
    self.victims.add(rid)
    # Bookkeeping is corrupt until the step that checks the victim's next row.
    self.fault_pending = 3 if self.eng.config.overlap else 1

  @invariant()
  def pool_is_consistent(self):
    # Without the audit, a fault's corruption may outlive a step (until the tag check or a
    # release deals with it); what must hold then is only that no output is wrong (teardown).
    if not hasattr(self, "eng") or self.fault_pending or not self.eng.config.page_audit:
      return
    eng, alloc = self.eng, self.eng.allocator
    assert alloc.audit() == [], alloc.audit()
    assert alloc.num_free + alloc.num_used + len(alloc.quarantined) == NUM_PAGES
    device_tags = np.asarray(eng.state.page_tags)
    seen = collections.Counter()
    for r in eng.scheduler.running:
      table = alloc.block_table(r.request_id)
      for p, t in table:
        seen[p] += 1
        assert int(alloc.tags[p]) == t or r.request_id in self.victims, (r.request_id, p)
        if not eng._tags_dirty:  # noqa: SLF001 - synced at the next step otherwise
          assert np.uint32(device_tags[p].view(np.uint32)) == t
    cached = set(eng.prefix_cache.pages()) if eng.prefix_cache is not None else set()
    for p, c in seen.items():
      # The prefix cache holds one reference too. (Requests that shared a page through it
      # keep sharing it after its node is dropped; the tag check above covers them.)
      assert alloc.refcounts[p] == c + (p in cached), (p, c, alloc.refcounts[p])
      assert c == 1 or eng.prefix_cache is not None, p  # without a cache nothing is shared
    for p in cached:
      assert p not in alloc.quarantined and alloc.refcounts[p] >= 1, p
    for r in eng.scheduler.waiting:
      assert not alloc.has_request(r.request_id)

  def teardown(self):
    if not hasattr(self, "eng"):
      return
    self.eng.run_until_done(max_steps=500)
    for rid, r in self.eng.requests.items():
      if self.eng.config.speculative_tokens and r.sampling.temperature > 0:
        # Rejection sampling draws other (equally distributed) tokens than plain sampling:
        # test_speculative_accept checks the distribution; here only the length and ids.
        assert len(r.output) <= r.sampling.max_new_tokens
        assert all(0 <= t < self.eng.config.model.vocab_size for t in r.output), r.output
        assert r.status in (RequestStatus.FINISHED, RequestStatus.ABORTED), r.status
        continue
      want = solo(r.prompt, r.sampling)
      if r.status is RequestStatus.FINISHED:
        assert tuple(r.output) == want, (rid, r.output, want)
      else:
        assert r.status is RequestStatus.ABORTED, r.status
        assert tuple(r.output) == want[:len(r.output)], (rid, r.output, want)
    alloc = self.eng.allocator
    self.eng.audit_pages()  # a fault after the last step is dealt with here
    if self.eng.prefix_cache is not None:
      if self.eng.config.page_audit:  # the cache holds live pages only
        assert alloc.num_free + len(alloc.quarantined) + self.eng.prefix_cache.num_pages == NUM_PAGES
      # Without the audit a fault on the cache's own hold can outlive the run; releasing
      # the cache must give back every page all the same.
      self.eng.prefix_cache.clear()
    assert alloc.num_free + len(alloc.quarantined) == NUM_PAGES


# The allocator machine is pure Python: many more examples than the engine's for the same time.
class AllocatorStateMachineTest(AllocatorMachine.TestCase):
  settings = settings(max_examples=settings().max_examples * 10, stateful_step_count=50)


class EngineStateMachineTest(EngineMachine.TestCase):
  settings = settings(stateful_step_count=30)


if __name__ == "__main__":
  absltest.main()
