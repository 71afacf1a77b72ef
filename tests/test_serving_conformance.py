"""One conformance suite for every engine that implements the serving interface.

``Engine`` (synchronous and overlapped) and ``DisaggEngine``
(a prefill pool and a decode pool on disjoint sub-meshes, the decode pool
synchronous or overlapped) must behave the same
to a caller: the same tokens as ``mlkit.generate`` (f32 end to end, so exact),
the same streaming, cancellation, validation, stall and metrics contracts, and
every page back when the work is done. Engines are built once per kind and
shared by the tests (compiles dominate on the 2-core CPU).
"""

import dataclasses
import functools
from unittest import mock

import jax
import numpy as np
from absl.testing import absltest, parameterized

from configs import TINY_MLA
from mlkit import kvcache as kvc
from mlkit.engine import (ABORT_CANCELLED, DisaggConfig, DisaggEngine, Engine, EngineConfig,
                          EngineStalled, PoolConfig, RequestRejected, RequestStatus,
                          ServingEngine)
from mlkit.engine import engine as engine_lib
from mlkit.engine.request import Request
from mlkit.engine.scheduler import Scheduler
from mlkit.generate import generate
from mlkit.parallel import abstract as abstract_lib
from mlkit.parallel import MeshConfig, make_mesh
from mlkit.quant import BF16
from mlkit.sampling import SamplingParams
from numpy_params import init_params_np

# One MoE layer: nothing here depends on depth, and compiles scale with it.
CFG = dataclasses.replace(TINY_MLA, n_layers=1, first_k_dense=0)
# An Engine on a mesh is held to the same tokens in test_disagg; its pool's placement below.
KINDS = ("engine", "engine_overlap", "disagg", "disagg_overlap")
ENGINE_KW = dict(max_running=4, batch_buckets=(4,), prefill_buckets=(8,), prefill_token_budget=16,
                 max_pages_per_seq=8)
_rng = np.random.default_rng(7)
PROMPTS = [list(map(int, _rng.integers(0, CFG.vocab_size, n))) for n in (5, 13, 1, 9, 7)]
SAMPLINGS = [SamplingParams(max_new_tokens=6, seed=1),
             SamplingParams(max_new_tokens=4, seed=2, temperature=0.8, top_k=20),
             SamplingParams(max_new_tokens=7, seed=3),
             SamplingParams(max_new_tokens=5, seed=4, temperature=1.1, top_p=0.7),
             SamplingParams(max_new_tokens=6, seed=5)]

_CKPT = None
_ENGINES: dict = {}
_REF = None


def ckpt():
  """The shared checkpoint, with its MTP layer (the main weights are drawn first, unchanged)."""
  global _CKPT
  if _CKPT is None:
    _CKPT = init_params_np(CFG, mtp=())
  return _CKPT


def engine_config(page_size=8, **kw) -> EngineConfig:
  return EngineConfig(model=CFG, kv=kvc.KVCacheConfig(32, page_size, "float32"),
                      **{**ENGINE_KW, **kw})


def make(kind: str, **kw):
  """A fresh engine of ``kind`` over the shared f32 checkpoint (``kw``: EngineConfig fields of
  every pool)."""
  devices = jax.devices()
  if kind == "engine":
    return Engine(ckpt(), engine_config(**kw))
  if kind == "engine_overlap":
    return Engine(ckpt(), engine_config(overlap=True, **kw))
  if kind in ("disagg", "disagg_overlap"):
    # The prefill pool always runs its two phases apart; the decode pool may overlap.
    decode = engine_config(overlap=kind == "disagg_overlap", **kw)
    cfg = DisaggConfig(prefill=PoolConfig(engine_config(page_size=4, **kw), BF16,
                                          MeshConfig(tensor=2)),
                       decode=PoolConfig(decode, BF16, MeshConfig(tensor=2)))
    return DisaggEngine(ckpt(), cfg, devices=devices[4:8])
  raise ValueError(kind)


def engine(kind: str):
  if kind not in _ENGINES:
    _ENGINES[kind] = make(kind)
  return _ENGINES[kind]


def reference():
  """mlkit.generate's tokens for PROMPTS (the engines must reproduce them exactly)."""
  global _REF
  if _REF is None:
    _REF = generate(ckpt(), CFG, PROMPTS, SAMPLINGS).tokens
  return _REF


GREEDY = [dataclasses.replace(s, temperature=0.0, top_k=0, top_p=1.0) for s in SAMPLINGS]


@functools.cache
def greedy_reference():
  """mlkit.generate's tokens for PROMPTS under GREEDY (one run shared by every kind)."""
  return generate(ckpt(), CFG, PROMPTS, GREEDY).tokens


class ServingConformanceTest(parameterized.TestCase):

  def assert_pool_empty(self, eng):
    m = eng.metrics()
    self.assertEqual((m["running"], m["waiting"], m["pages_used"]), (0, 0, 0), m)
    self.assertFalse(eng.has_unfinished())

  @parameterized.parameters(*KINDS)
  def test_implements_the_protocol(self, kind):
    self.assertIsInstance(engine(kind), ServingEngine)

  @parameterized.parameters(*KINDS)
  def test_generate_matches_the_reference(self, kind):
    eng = engine(kind)
    self.assertEqual(eng.generate(PROMPTS, SAMPLINGS), reference())
    self.assert_pool_empty(eng)

  @parameterized.parameters(*KINDS)
  def test_late_arrivals_and_step_outputs_account_for_every_token(self, kind):
    eng = engine(kind)
    ids = [eng.submit(p, s) for p, s in zip(PROMPTS[:2], SAMPLINGS[:2])]
    streamed: dict[int, list[int]] = {}
    ended = set()

    def step():
      for o in eng.step():
        self.assertNotIn(o.request_id, ended, "a request reported output after it ended")
        streamed.setdefault(o.request_id, []).extend(o.new_tokens)
        if o.done:
          ended.add(o.request_id)

    step()
    step()
    ids += [eng.submit(p, s) for p, s in zip(PROMPTS[2:], SAMPLINGS[2:])]
    while eng.has_unfinished():
      step()
    self.assertEqual([eng.get(i).output for i in ids], reference())
    self.assertEqual([streamed.get(i, []) for i in ids], reference())
    self.assertEqual(ended, set(ids))
    for i in ids:
      self.assertEqual(eng.get(i).status, RequestStatus.FINISHED)
    self.assert_pool_empty(eng)

  @parameterized.parameters(*KINDS)
  def test_serve_arriving_queues_one_prompt_per_step(self, kind):
    eng = engine(kind)
    admitted, stepped = [], [0]
    submit, step = eng.submit, eng.step

    def counted_submit(*args, **kwargs):  # the steps taken so far, at each submission
      admitted.append(stepped[0])
      return submit(*args, **kwargs)

    def counted_step():
      stepped[0] += 1
      return step()

    with mock.patch.object(eng, "submit", counted_submit), \
        mock.patch.object(eng, "step", counted_step):
      reqs, steps = eng.serve_arriving(PROMPTS, SAMPLINGS, at_once=2)
    self.assertEqual([r.output for r in reqs], reference())
    self.assertEqual(admitted, [0, 0, 0, 1, 2])  # 2 at once, then one before each step
    self.assertEqual(steps, stepped[0])
    self.assert_pool_empty(eng)
    with self.assertRaisesRegex(ValueError, "at_once must be >= 1"):
      eng.serve_arriving(PROMPTS, SAMPLINGS, at_once=0)
    with self.assertRaisesRegex(ValueError, "request 1 of the batch"):  # nothing queued
      eng.serve_arriving([PROMPTS[0], []], SAMPLINGS[0], at_once=1)
    self.assertFalse(eng.has_unfinished())
    with self.assertRaisesRegex(EngineStalled, "unfinished after 2 steps"):
      eng.serve_arriving(PROMPTS[:3], SAMPLINGS[:3], at_once=1, max_steps=2)
    eng.run_until_done()
    # Out of steps with a prompt still to come, also where the submitted requests have
    # ended (the synchronous engine: a one-token prompt and one new token end in one step).
    held = len(eng.requests)
    with self.assertRaisesRegex(EngineStalled, "unfinished after 1 steps"):
      eng.serve_arriving([PROMPTS[2]] * 3, SamplingParams(max_new_tokens=1), at_once=1,
                         max_steps=1)
    self.assertLen(eng.requests, held + 2)  # one at once, one before the step; one not queued
    eng.run_until_done()
    self.assert_pool_empty(eng)

  @parameterized.parameters(*KINDS)
  def test_stream_and_stop_tokens(self, kind):
    eng = engine(kind)
    ref = reference()[0]
    stop = ref[3]
    rid = eng.submit(PROMPTS[0], dataclasses.replace(SAMPLINGS[0], stop_tokens=(stop,)))
    self.assertEqual(list(eng.stream(rid)), ref[:ref.index(stop) + 1])
    self.assertEqual(eng.get(rid).finish_reason, "stop")
    eng.run_until_done()
    self.assert_pool_empty(eng)

  @parameterized.parameters(*KINDS)
  def test_cancel_waiting_running_and_finished(self, kind):
    eng = engine(kind)
    ids = [eng.submit(p, s) for p, s in zip(PROMPTS, SAMPLINGS)]
    for _ in range(3):
      eng.step()
    running = next(i for i in ids if eng.get(i).output and not eng.get(i).done)
    waiting = eng.submit(PROMPTS[0], SAMPLINGS[0])
    self.assertTrue(eng.cancel(waiting))
    self.assertTrue(eng.cancel(running))
    self.assertFalse(eng.cancel(running))  # already ended
    eng.run_until_done(max_steps=200)
    for i in (waiting, running):
      self.assertEqual(eng.get(i).status, RequestStatus.ABORTED)
      self.assertEqual(eng.get(i).abort_reason, ABORT_CANCELLED)
    ref = reference()
    for j, i in enumerate(ids):
      if i != running:
        self.assertEqual(eng.get(i).output, ref[j])
        self.assertFalse(eng.cancel(i))  # finished
    # What the cancelled request had emitted is a prefix of its uncancelled tokens.
    j = ids.index(running)
    self.assertEqual(eng.get(running).output, ref[j][:len(eng.get(running).output)])
    with self.assertRaises(KeyError):
      eng.cancel(10**6)
    with self.assertRaises(KeyError):
      eng.get(10**6)
    self.assert_pool_empty(eng)

  @parameterized.parameters(*KINDS)
  def test_bad_input_queues_nothing(self, kind):
    eng = engine(kind)
    n = len(eng.requests)
    with self.assertRaisesRegex(ValueError, "prompt is empty"):
      eng.submit([], SamplingParams())
    with self.assertRaisesRegex(ValueError, "outside"):
      eng.submit([CFG.vocab_size], SamplingParams())
    with self.assertRaisesRegex(ValueError, "sampling must be a SamplingParams"):
      eng.submit([1, 2], {"max_new_tokens": 3})
    with self.assertRaises(RequestRejected):
      eng.submit([1] * 60, SamplingParams(max_new_tokens=10))
    with self.assertRaisesRegex(ValueError, "request 1 of the batch"):
      eng.generate([PROMPTS[0], [-1]], SamplingParams())
    with self.assertRaisesRegex(ValueError, "1 SamplingParams for 2 prompts"):
      eng.generate(PROMPTS[:2], [SAMPLINGS[0]])
    self.assertLen(eng.requests, n)
    self.assertFalse(eng.has_unfinished())

  @parameterized.parameters(*KINDS)
  def test_run_until_done_reports_unfinished_work(self, kind):
    eng = engine(kind)
    rid = eng.submit(PROMPTS[1], SAMPLINGS[1])
    with self.assertRaisesRegex(EngineStalled, "unfinished after 1 steps"):
      eng.run_until_done(max_steps=1)
    eng.run_until_done()
    self.assertEqual(eng.get(rid).output, reference()[1])
    self.assert_pool_empty(eng)

  @parameterized.parameters(*KINDS)
  def test_speculative_greedy_tokens_equal_the_reference(self, kind):
    # Two MTP drafts per step (random weights: the drafts are mostly rejected; acceptance
    # itself is tested in test_speculative_engine): the greedy tokens stay generate's.
    eng = make(kind, speculative_tokens=2)
    self.assertEqual(eng.generate(PROMPTS, GREEDY), greedy_reference())
    self.assertGreater(eng.metrics()["speculative"]["verify_rows"], 0)
    self.assert_pool_empty(eng)

  @parameterized.parameters(*KINDS)
  def test_metrics_contract(self, kind):
    eng = make(kind)  # fresh: counters start at zero
    out = eng.generate(PROMPTS[:3], SAMPLINGS[:3])
    m = eng.metrics(include_requests=True)
    for key in ("steps", "generated_tokens", "prefill_tokens", "finished", "preemptions",
                "integrity_failures", "throughput_tok_s", "mean_ttft_s", "mean_tpot_s",
                "host_overhead_fraction", "running", "waiting", "pages_used", "pages_free",
                "pages_total", "aborted", "rejected"):
      self.assertIn(key, m)
    self.assertEqual(m["generated_tokens"], sum(map(len, out)))
    self.assertEqual(m["prefill_tokens"], sum(map(len, PROMPTS[:3])))
    self.assertEqual(m["finished"], 3)
    self.assertGreater(m["throughput_tok_s"], 0)
    self.assertGreater(m["mean_ttft_s"], 0)
    self.assertLen(m["requests"], 3)
    self.assertEqual(eng.request_metrics(0)["output_tokens"], len(out[0]))


def _request(rid, n):
  return Request(request_id=rid, prompt=tuple(range(n)), sampling=SamplingParams(max_new_tokens=4),
                 arrival_time=0.0)


class SchedulerApiTest(absltest.TestCase):
  """The pool API DisaggEngine composes the engines through (pure host logic)."""

  def setUp(self):
    super().setUp()
    self.cfg = engine_config(admission_reserve=1)  # 32 pages of 8 tokens, 4 running at most
    self.alloc = kvc.PageAllocator(32, 8)
    self.sched = Scheduler(self.cfg, self.alloc)

  def test_can_admit_is_the_admission_rule(self):
    s = self.sched
    self.assertTrue(s.can_admit(32 * 8))  # alone: the reserve is waived
    self.assertFalse(s.can_admit(32 * 8 + 1))
    self.assertEqual(s.adopt(_request(0, 8), 8), 0)  # adopted, nothing shared (no cache)
    self.assertFalse(s.can_admit(31 * 8))  # 31 pages + 1 reserve > 31 free
    self.assertTrue(s.can_admit(30 * 8))
    self.assertFalse(s.can_admit(30 * 8, extra_pages=1))  # pages promised to growth count
    for rid in (1, 2, 3):
      self.assertEqual(s.adopt(_request(rid, 1), 1), 0)
    self.assertFalse(s.can_admit(1))  # max_running reached

  def test_adopt_detach_and_hand_back(self):
    s, alloc = self.sched, self.alloc
    req = _request(0, 20)
    self.assertEqual(s.adopt(req, 20), 0)
    self.assertEqual(req.status, RequestStatus.DECODING)
    self.assertEqual(len(s.row(req)[0]), 3)
    s.detach(req)
    self.assertNotIn(req, s.running)
    self.assertEqual(s.detached, [req])
    self.assertTrue(s.holds(req))
    self.assertEqual(alloc.num_used, 3)  # detached requests keep their pages
    self.assertTrue(s.remove(req))
    self.assertFalse(s.holds(req))
    self.assertEqual(alloc.num_free, 32)
    self.assertIsNone(s.adopt(_request(1, 33 * 8), 33 * 8))  # refused: nothing changed
    self.assertEqual(alloc.num_free, 32)

  def test_reservations_hold_slots_and_pages_until_adopted(self):
    s, alloc = self.sched, self.alloc
    self.assertTrue(s.reserve("a", 20))  # 3 pages, a running slot
    self.assertEqual((alloc.num_used, s.slots_taken), (3, 1))
    with self.assertRaisesRegex(ValueError, "already holds"):
      s.reserve("a", 1)
    self.assertFalse(s.can_admit(29 * 8))  # 29 pages + 1 reserve > 29 free: the reserve applies
    s.add(_request(5, 8))
    for key in ("b", "c", "d"):
      self.assertTrue(s.reserve(key, 1))
    self.assertFalse(s.reserve("e", 1))  # every running slot is reserved
    s.schedule()  # the queued request is not admitted into a reserved slot
    self.assertLen(s.waiting, 1)
    req = _request(0, 20)
    self.assertEqual(s.adopt(req, 20, reservation="a"), 0)  # takes a's slot and pages
    self.assertEqual((alloc.num_used, s.slots_taken), (6, 4))
    s.release_reservation("b")
    s.release_reservation("b")  # unknown key: no-op
    self.assertEqual((alloc.num_used, s.slots_taken), (5, 3))
    self.assertFalse(s.reserve("big", 33 * 8))  # refused: nothing changed
    self.assertEqual(alloc.num_used, 5)
    for key in ("c", "d"):
      s.release_reservation(key)
    s.remove(req)
    self.assertEqual((alloc.num_free, s.slots_taken), (32, 0))
    self.assertEqual(alloc.audit(), [])

  def test_drain_preempted_and_requeue_keep_queue_order(self):
    s = self.sched
    fresh = _request(9, 4)
    s.add(fresh)
    a, b = _request(0, 4), _request(1, 4)
    for r in (a, b):
      s.adopt(r, 4)
      r.output = [5]
    s._preempt(a)  # noqa: SLF001 - what schedule() does when the pool runs dry
    s._preempt(b)  # noqa: SLF001
    self.assertEqual(s.drain_preempted(), [b, a])  # the queue's order: newest preemption first
    self.assertEqual(list(s.waiting), [fresh])  # fresh submissions stay
    self.assertEqual(s.drain_preempted(), [])
    other = Scheduler(self.cfg, kvc.PageAllocator(32, 8))
    other.add(_request(7, 3))
    other.requeue([b, a])
    self.assertEqual([r.request_id for r in other.waiting], [1, 0, 7])
    self.assertEqual(b.prefill_tokens, tuple(b.prompt) + (5,))
    self.assertEqual((b.status, b.num_computed), (RequestStatus.WAITING, 0))


class ShardedPoolTest(absltest.TestCase):

  def test_pool_is_allocated_sharded_never_whole_on_the_default_device(self):
    big = EngineConfig(model=CFG, kv=kvc.KVCacheConfig(4096, 8, "float32"), **ENGINE_KW)
    devices = jax.devices()[4:6]
    concrete = []  # pools built as real arrays (outside a trace), wherever they came from

    def spy(*args, **kw):
      state = real(*args, **kw)
      concrete.extend(x for x in jax.tree_util.tree_leaves(state)
                      if not isinstance(x, jax.core.Tracer))
      return state

    real = kvc.init_paged_state
    with mock.patch.object(engine_lib, "init_paged_state", spy), \
         mock.patch.object(abstract_lib, "init_paged_state", spy):
      eng = Engine(ckpt(), big, mesh=make_mesh(MeshConfig(tensor=2), devices))
      self.assertEmpty(concrete)  # only traced: each device built its own shard
      plain = Engine(ckpt(), big)
      self.assertNotEmpty(concrete)  # the spy sees an unsharded pool being built
    whole = plain.state.layers[0]["latent"]
    latent = eng.state.layers[0]["latent"]
    self.assertEqual(latent.shape, whole.shape)
    self.assertEqual(latent.sharding.device_set, set(devices))
    self.assertEqual(eng.state.page_tags.sharding.device_set, set(devices))


if __name__ == "__main__":
  absltest.main()
