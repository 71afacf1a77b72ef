"""Reliability of the engine: the fault matrix and per-request error isolation.

The fault matrix injects each bookkeeping fault (use after free, double
allocation, wrong block-table entry, stale tag) while its victim is
prefilling, decoding, about to finish, or right before it is cancelled, with
the page audit on and off (the tag check is always on). Whatever happens, no
request may finish with a wrong output: every finished request's tokens equal
its solo run (f32, exact), every aborted request's tokens are a prefix of it,
only the requests that hold the corrupted pages may be aborted, and the pool
ends conserved.

Every engine here shares one model and one set of shapes, so the jitted steps
compile once for the whole file.
"""

import dataclasses
import functools

import jax
import numpy as np
from absl.testing import absltest, parameterized

from configs import TINY_MLA
from mlkit.engine import (ABORT_CANCELLED, ABORT_ERROR, ABORT_INTEGRITY, Engine, EngineConfig,
                          Fault, FaultKind, RequestStatus)
from mlkit.kvcache import KVCacheConfig
from mlkit.model import init_params
from mlkit.sampling import SamplingParams

CFG = dataclasses.replace(TINY_MLA, n_layers=2, first_k_dense=1)
NUM_PAGES, PAGE = 16, 4


def engine_config(**kw) -> EngineConfig:
  base = dict(model=CFG, kv=KVCacheConfig(num_pages=NUM_PAGES, page_size=PAGE, dtype="float32"),
              max_running=4, batch_buckets=(4,), prefill_buckets=(8,), prefill_token_budget=16,
              max_pages_per_seq=16, enable_fault_injection=True)
  base.update(kw)
  return EngineConfig(**base)


@functools.cache
def params():
  return init_params(CFG, jax.random.key(0))


def prompt(n: int, seed: int) -> tuple[int, ...]:
  return tuple(np.random.default_rng(seed).integers(0, CFG.vocab_size, n).tolist())


@functools.cache
def _solo_engine() -> Engine:
  return Engine(params(), engine_config(max_running=1))


@functools.cache
def solo(p: tuple[int, ...], sampling: SamplingParams) -> tuple[int, ...]:
  """The request's tokens when it runs alone."""
  return tuple(_solo_engine().generate([list(p)], sampling)[0])


def assert_no_wrong_output(test, eng, may_abort=()):
  """Finished requests equal their solo runs; aborted ones are prefixes and are in ``may_abort``."""
  for rid, r in eng.requests.items():
    want = solo(r.prompt, r.sampling)
    test.assertTrue(r.done, f"request {rid} is {r.status}")
    if r.status is RequestStatus.FINISHED:
      test.assertEqual(tuple(r.output), want, f"request {rid} finished with a wrong output")
    else:
      test.assertEqual(tuple(r.output), want[:len(r.output)], f"request {rid}")
      if r.abort_reason != ABORT_CANCELLED:
        test.assertIn(rid, may_abort, f"request {rid} aborted ({r.abort_reason}: {r.error})")
  alloc = eng.allocator
  test.assertEmpty(alloc.audit())
  test.assertEqual(alloc.num_free + len(alloc.quarantined), NUM_PAGES)


# The victim's workload per state at the moment of the fault.
VICTIM = {
    "prefilling": (prompt(20, 3), SamplingParams(max_new_tokens=4, seed=3)),  # 3 chunks of 8
    "decoding": (prompt(9, 3), SamplingParams(max_new_tokens=8, seed=3, temperature=0.7)),
    "finishing": (prompt(9, 3), SamplingParams(max_new_tokens=3, seed=3)),
    "cancelled": (prompt(9, 3), SamplingParams(max_new_tokens=8, seed=3)),
}
OTHERS = [(prompt(10, 1), SamplingParams(max_new_tokens=8, seed=1)),
          (prompt(7, 2), SamplingParams(max_new_tokens=8, seed=2, temperature=0.9, top_k=20))]
LATE = (prompt(12, 4), SamplingParams(max_new_tokens=6, seed=4))


def _reached(state, v) -> bool:
  if state == "prefilling":
    return v.num_computed > 0
  if v.status is not RequestStatus.DECODING:
    return False
  if state == "finishing":  # one token left: the next step would end it
    return len(v.output) == v.sampling.max_new_tokens - 1
  return len(v.output) >= 2


class FaultMatrixTest(parameterized.TestCase):

  @parameterized.product(kind=list(FaultKind), state=list(VICTIM), page_audit=[True, False])
  def test_no_wrong_output(self, kind, state, page_audit):
    eng = Engine(params(), engine_config(page_audit=page_audit))
    others = [eng.submit(p, s) for p, s in OTHERS]
    vid = eng.submit(*VICTIM[state])
    victim = eng.get(vid)
    for _ in range(20):
      if _reached(state, victim):
        break
      eng.step()
    self.assertTrue(_reached(state, victim), (state, victim.status, victim.output))
    # Page 0 has been written in every state (the last page may not be yet while prefilling).
    record = eng.inject_fault(Fault(kind, vid, page_index=0))
    if state == "cancelled":
      self.assertTrue(eng.cancel(vid))
    late = eng.submit(*LATE)  # its admission reuses whatever page the fault freed or listed
    eng.run_until_done(max_steps=100)
    assert_no_wrong_output(self, eng, may_abort={vid, record.other_owner})
    if state == "cancelled":
      self.assertEqual(victim.abort_reason, ABORT_CANCELLED)
    elif page_audit:
      # With both defences on, the victim never outlives the fault by a token.
      self.assertEqual(victim.abort_reason, ABORT_INTEGRITY, victim.error)
    for rid in others + [late]:
      if rid != record.other_owner:
        self.assertEqual(eng.get(rid).status, RequestStatus.FINISHED, f"innocent request {rid}")


class ConservationTest(absltest.TestCase):

  def test_double_allocation_victim_finishing_never_shares_its_page(self):
    # A page listed free while its owner still decodes, the owner finishing before anything
    # checks: the next request must get the page once, with a fresh tag.
    want = solo(prompt(50, 9), SamplingParams(max_new_tokens=2))
    for audit in (True, False):
      eng = Engine(params(), engine_config(page_audit=audit))
      v = eng.submit(list(range(1, 11)), SamplingParams(max_new_tokens=3))
      while eng.get(v).status is not RequestStatus.DECODING:
        eng.step()
      eng.inject_fault(Fault(FaultKind.DOUBLE_ALLOCATION, v, 0))
      eng.run_until_done()
      m = eng.metrics()
      self.assertEqual(m["pages_free"] + m["pages_quarantined"], NUM_PAGES, audit)
      self.assertLen(set(eng.allocator._free), eng.allocator.num_free)  # noqa: SLF001
      r = eng.submit(prompt(50, 9), SamplingParams(max_new_tokens=2))
      eng.run_until_done()
      self.assertEqual(tuple(eng.get(r).output), want, audit)
      assert_no_wrong_output(self, eng, may_abort={v})

  def test_quarantine_shrinks_what_fits(self):
    # Without healing, a quarantined page is gone for good: the pool holds less.
    eng = Engine(params(), engine_config(quarantine_grace_steps=None))
    v = eng.submit(list(range(1, 11)), SamplingParams(max_new_tokens=3))
    waiting_big = eng.submit(prompt(60, 5), SamplingParams(max_new_tokens=4))  # the whole pool
    eng.step()
    eng.inject_fault(Fault(FaultKind.USE_AFTER_FREE, v, 0))
    eng.step()  # the audit quarantines the page: 64 tokens no longer fit in 15 pages
    self.assertEqual(eng.get(v).abort_reason, ABORT_INTEGRITY)
    self.assertEqual(eng.get(waiting_big).abort_reason, "too_long")
    self.assertIn("quarantined", eng.get(waiting_big).error)
    self.assertEqual(eng.max_seq_tokens, (NUM_PAGES - 1) * PAGE)
    with self.assertRaisesRegex(ValueError, "1 of them quarantined"):
      eng.submit(prompt(60, 6), SamplingParams(max_new_tokens=4))
    eng.run_until_done()
    self.assertEqual(eng.metrics()["pages_quarantined"], 1)
    self.assertGreaterEqual(eng.metrics()["page_violations"], 1)


class QuarantineHealsTest(absltest.TestCase):

  def test_pages_heal_after_a_grace_period(self):
    eng = Engine(params(), engine_config(quarantine_grace_steps=3))
    v = eng.submit(list(range(1, 11)), SamplingParams(max_new_tokens=3))
    other = eng.submit(*OTHERS[0])  # keeps running while the page is out
    eng.step()
    eng.inject_fault(Fault(FaultKind.USE_AFTER_FREE, v, 0))
    eng.step()  # the audit quarantines the page and aborts its holder
    self.assertEqual(eng.get(v).abort_reason, ABORT_INTEGRITY)
    m = eng.metrics()
    self.assertEqual((m["pages_quarantined"], m["pages_quarantined_total"]), (1, 1))
    (page,) = eng.allocator.quarantined
    stale_tag = int(eng.allocator.tags[page])
    eng.step()
    eng.step()  # two more steps: still out while a request runs
    self.assertEqual(eng.metrics()["pages_quarantined"], 1)
    self.assertFalse(eng.get(other).done)
    eng.step()  # three steps after the one that quarantined it: healed, fresh tag on device
    m = eng.metrics()
    self.assertEqual((m["pages_quarantined"], m["pages_healed_total"]), (0, 1), m)
    self.assertNotEqual(int(eng.allocator.tags[page]), stale_tag)
    self.assertEqual(np.asarray(eng.state.page_tags)[page],
                     np.array(eng.allocator.tags[page], np.uint32).view(np.int32))
    eng.run_until_done()
    self.assertEqual(tuple(eng.get(other).output), solo(*OTHERS[0]))
    self.assertEqual(eng.metrics()["pages_free"], NUM_PAGES)
    big = (prompt(60, 9), SamplingParams(max_new_tokens=4))  # the whole pool, healed page too
    r = eng.submit(*big)
    eng.run_until_done()
    self.assertEqual(tuple(eng.get(r).output), solo(*big))

  def test_an_idle_engine_heals_at_once(self):
    # Nothing runs and nothing is in flight: no step can still touch the page, so a request
    # that needs the whole pool waits no grace period.
    eng = Engine(params(), engine_config(quarantine_grace_steps=1000))
    v = eng.submit(list(range(1, 11)), SamplingParams(max_new_tokens=3))
    eng.step()
    eng.inject_fault(Fault(FaultKind.USE_AFTER_FREE, v, 0))
    eng.step()  # the audit quarantines the page, aborts its only holder: nothing runs now
    m = eng.metrics()
    self.assertEqual((m["pages_quarantined_total"], m["pages_healed_total"]), (1, 1), m)
    self.assertEqual(m["pages_free"], NUM_PAGES)
    big = (prompt(60, 5), SamplingParams(max_new_tokens=4))
    r = eng.submit(*big)
    eng.run_until_done()
    self.assertEqual(tuple(eng.get(r).output), solo(*big))

  def test_randomised_faults_leave_the_pool_whole(self):
    # 40 short schedules on one engine, a random fault in each at a random step: with
    # healing every quarantined page comes back, no finished request is wrong, and
    # the pool is whole once idle.
    rng = np.random.default_rng(0)
    eng = Engine(params(), engine_config(quarantine_grace_steps=2))
    kinds = list(FaultKind)
    for round_ in range(40):
      ids = [eng.submit(prompt(int(rng.integers(3, 14)), 100 * round_ + i),
                        SamplingParams(max_new_tokens=int(rng.integers(2, 6)), seed=i))
             for i in range(3)]
      for _ in range(int(rng.integers(1, 4))):
        eng.step()
      live = eng.running_ids()
      if live:
        try:
          eng.inject_fault(Fault(kinds[int(rng.integers(len(kinds)))],
                                 live[int(rng.integers(len(live)))]))
        except ValueError:
          pass  # e.g. use-after-free of a shared page: no fault this round
      eng.run_until_done(max_steps=200)
      for rid in ids:
        r = eng.get(rid)
        if r.status is RequestStatus.FINISHED:
          self.assertEqual(tuple(r.output), solo(r.prompt, r.sampling), rid)
    quarantined_ever = eng.allocator.quarantined_total
    self.assertGreater(quarantined_ever, 10)
    for _ in range(3):  # idle steps do no device work; they still count the grace
      eng.submit(prompt(4, 7), SamplingParams(max_new_tokens=1))
      eng.run_until_done()
    m = eng.metrics()
    self.assertEqual(m["pages_quarantined"], 0, m)
    self.assertEqual(m["pages_healed_total"], quarantined_ever)
    self.assertEqual(m["pages_free"], NUM_PAGES)
    self.assertEmpty(eng.allocator.audit())


class _Raises:
  """A stop-token container whose membership test raises (a request in a bad state)."""

  def __contains__(self, token):
    raise RuntimeError("corrupted stop tokens")

  def __iter__(self):
    return iter(())


class ErrorIsolationTest(parameterized.TestCase):

  @parameterized.parameters("prefill", "decode")
  def test_a_request_whose_row_cannot_be_built_is_aborted_alone(self, where):
    eng = Engine(params(), engine_config())
    good = [eng.submit(p, s) for p, s in OTHERS]
    bad = eng.submit(*VICTIM["decoding"])
    if where == "decode":
      while eng.get(bad).status is not RequestStatus.DECODING:
        eng.step()
    # Sampling values past the step's int32 (validated at submit, changed behind its back).
    object.__setattr__(eng.get(bad).sampling, "top_k", 2**40)
    outs = eng.step()
    self.assertEqual(eng.get(bad).abort_reason, ABORT_ERROR)
    self.assertIn("OverflowError", eng.get(bad).error)
    self.assertIn(bad, [o.request_id for o in outs if o.done])
    eng.run_until_done()
    for rid in good:
      self.assertEqual(tuple(eng.get(rid).output), solo(*OTHERS[good.index(rid)]))
    self.assertEqual(eng.metrics()["aborted"], {ABORT_ERROR: 1})
    self.assertEqual(eng.allocator.num_free, NUM_PAGES)

  def test_a_request_whose_token_cannot_be_emitted_is_aborted_alone(self):
    eng = Engine(params(), engine_config())
    good = eng.submit(*OTHERS[0])
    bad = eng.submit(*VICTIM["decoding"])
    object.__setattr__(eng.get(bad).sampling, "stop_tokens", _Raises())
    eng.run_until_done()
    self.assertEqual(eng.get(bad).abort_reason, ABORT_ERROR)
    self.assertIn("corrupted stop tokens", eng.get(bad).error)
    self.assertEqual(tuple(eng.get(good).output), solo(*OTHERS[0]))
    self.assertEqual(eng.allocator.num_free, NUM_PAGES)


if __name__ == "__main__":
  absltest.main()
