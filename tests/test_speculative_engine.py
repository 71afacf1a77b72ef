"""Speculative decoding in the Engine (EngineConfig.speculative_tokens), f32 end to end.

Two checkpoints: random weights, whose MTP layer drafts tokens the model never
emits (every draft rejected), and an "echo" checkpoint whose blocks add little to
the residual stream and whose MTP layer passes the token's embedding straight to
the shared head, so it drafts what the model will emit most of the time: verify
rows accept 0 to k drafts. On both, greedy tokens with k = 1, 2, 3 equal the
engine's without speculation (run as a plain server runs: without the MTP layer, on a
one-device mesh): alone, on a mesh, in disaggregated pools, with the prefix cache,
through preemption, with stop tokens and max_new_tokens ending a row inside its
accepted drafts. Page tags, cancellation and the allocator's conservation hold as
without it.

Most of the time here is XLA compiling the engines' steps, so the tests share them:
engines of one k keep one pool shape, the one-device engines are placed as the served
test's servers (whose steps are then those already compiled), and the mesh engine's
mesh is the disaggregated decode pool's.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from configs import TINY_MLA
from mlkit.engine import (ABORT_INTEGRITY, DisaggConfig, DisaggEngine, Engine, EngineConfig,
                          PoolConfig, RequestStatus)
from mlkit.engine.faults import Fault, FaultKind
from mlkit.kvcache import KVCacheConfig
from mlkit.parallel import MeshConfig, make_mesh
from mlkit.quant import BF16
from mlkit.sampling import SamplingParams
from numpy_params import init_params_np

# One dense layer, one MoE layer, one MTP layer (MoE).
CFG = dataclasses.replace(TINY_MLA, n_layers=2)
PAGE, NUM_PAGES = 4, 64
_rng = np.random.default_rng(11)
SYSTEM = _rng.integers(0, CFG.vocab_size, 8).tolist()  # a shared prefix of two pages
PROMPTS = [_rng.integers(0, CFG.vocab_size, n).tolist() for n in (11, 6, 19, 3)]
PROMPTS += [SYSTEM + _rng.integers(0, CFG.vocab_size, 5).tolist() for _ in range(2)]
N_NEW = 12


def engine_config(k: int, **kw) -> EngineConfig:
  # Every engine computes log-probabilities (a request returns them only when it asks): one
  # compiled step per k and shape serves the logprobs test and the rest alike.
  base = dict(model=CFG, kv=KVCacheConfig(NUM_PAGES, PAGE, "float32"), max_running=4,
              batch_buckets=(4,), prefill_buckets=(8,), prefill_token_budget=16,
              max_pages_per_seq=16, speculative_tokens=k, enable_fault_injection=True,
              logprobs=3)
  base.update(kw)
  return EngineConfig(**base)


def echo_params(params, eps: float = 0.1):
  """Blocks scaled by ``eps`` (the residual stream stays near the token's embedding); the MTP
  layer's block silenced and its eh_proj passing the next token's normalised embedding, so
  its head predicts what the model predicts after that token, nearly. On host (numpy)
  params: eager jnp arithmetic would compile a program per operation and shape."""
  params = jax.tree.map(lambda x: x, params)

  def scale(lp, f):
    lp["attn"]["wo"] = lp["attn"]["wo"] * f
    lp["ffn"]["w_down"] = lp["ffn"]["w_down"] * f
    if "shared" in lp["ffn"]:
      lp["ffn"]["shared"]["w_down"] = lp["ffn"]["shared"]["w_down"] * f

  for lp in params["layers"]:
    scale(lp, eps)
  mtp = params["mtp"][0]
  scale(mtp, 0.0)
  D = CFG.d_model
  mtp["eh_proj"] = np.concatenate([np.eye(D), np.zeros((D, D))]).astype(mtp["eh_proj"].dtype)
  return params


_PARAMS: dict = {}


def params(kind: str):
  if kind not in _PARAMS:
    p = jax.tree.map(np.asarray, init_params_np(CFG, seed=3, mtp=()))
    _PARAMS[kind] = jax.tree.map(jnp.asarray, p if kind == "random" else echo_params(p))
  return _PARAMS[kind]


def one_device_mesh():
  """The mesh ``mlkit.serve``'s ``build_engine`` places a one-device server on. Every
  one-device engine here is placed on it, so that test_served_with_the_serve_config's
  servers (plain and k = 2) run the steps compiled here (an engine without a mesh compiles
  its own: the speculative step without a mesh is served in test_serving_conformance)."""
  return make_mesh(MeshConfig(tensor=1), jax.devices()[:1])


def engine(kind: str, k: int, **kw) -> Engine:
  """A one-device engine as a server builds it; k = 0 as a plain server, whose params have
  no MTP layer."""
  p = params(kind) if k else {name: v for name, v in params(kind).items() if name != "mtp"}
  return Engine(p, engine_config(k, **kw), mesh=one_device_mesh())


def serve(kind: str, k: int, prompts=PROMPTS, sampling=None, **kw):
  """(engine, outputs) after serving ``prompts`` to completion; k = 0 as a plain server."""
  eng = engine(kind, k, **kw)
  sampling = sampling or [SamplingParams(max_new_tokens=N_NEW)] * len(prompts)
  ids = [eng.submit(p, s) for p, s in zip(prompts, sampling)]
  eng.run_until_done(max_steps=500)
  return eng, [list(eng.get(i).output) for i in ids]


class SpeculativeEngineTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # The plain engine's tokens and decode steps, once per checkpoint (compared with below).
    plain = {kind: serve(kind, 0) for kind in ("random", "echo")}
    cls.base = {kind: outs for kind, (_, outs) in plain.items()}
    cls.base_decode_steps = {kind: eng.stats.decode_steps for kind, (eng, _) in plain.items()}

  @parameterized.product(kind=("random", "echo"), k=(1, 2, 3))
  def test_greedy_tokens_equal_plain_decoding(self, kind, k):
    eng, outs = serve(kind, k)
    self.assertEqual(outs, self.base[kind])
    m = eng.metrics()["speculative"]
    self.assertEqual(eng.allocator.num_free, NUM_PAGES)
    self.assertEqual(sum(m["accepted_histogram"]), m["verify_rows"])
    self.assertLessEqual(m["drafts_accepted"], m["drafts_proposed"])
    if kind == "random":
      self.assertEqual(m["drafts_accepted"], 0)  # random drafts: all rejected
    else:
      self.assertGreater(m["acceptance_length"], 1.3)
      if k > 1:  # rows that accepted none, some and all of their drafts
        self.assertGreater(m["accepted_histogram"][0], 0)
        self.assertGreater(m["accepted_histogram"][k], 0)
      self.assertLess(eng.stats.decode_steps, self.base_decode_steps["echo"])

  def test_prefix_cache_and_preemption(self):
    # A pool so small that the six requests preempt each other, with the prefix cache on:
    # SMALL free pages. The pool keeps the other engines' NUM_PAGES (its shape, so the k = 3
    # steps compiled for them serve here: a 14-page pool compiled both again) and a holder
    # the scheduler does not know keeps the rest; the scheduler admits, grows, evicts and
    # preempts against the free pages alone, as in a pool of SMALL pages (the same 3
    # preemptions and 16 prefix tokens saved).
    SMALL = 14
    eng = engine("echo", 3, prefix_cache=True)
    self.assertIsNone(eng.allocator.admit("held", (NUM_PAGES - SMALL) * PAGE))
    self.assertEqual(eng.allocator.num_free, SMALL)
    ids = [eng.submit(p, SamplingParams(max_new_tokens=N_NEW)) for p in PROMPTS]
    eng.run_until_done(max_steps=500)
    self.assertEqual([list(eng.get(i).output) for i in ids], self.base["echo"])
    self.assertGreater(eng.stats.preemptions, 0)
    self.assertGreater(eng.prefix_cache.stats.tokens_saved, 0)
    eng.prefix_cache.evict(eng.prefix_cache.num_pages)
    self.assertEqual(eng.allocator.num_free, SMALL)
    eng.allocator.release("held")
    self.assertEqual(eng.allocator.num_free, NUM_PAGES)

  def test_overlap_runs_in_step(self):
    _, outs = serve("echo", 2, overlap=True)
    self.assertEqual(outs, self.base["echo"])

  def test_stop_token_and_max_new_tokens_inside_accepted_drafts(self):
    # Each row stops at a token the plain engine emits mid-way, and rows end on
    # max_new_tokens counts that fall inside a verify step's emitted tokens.
    stops = [SamplingParams(max_new_tokens=N_NEW, stop_tokens=(b[5],)) for b in self.base["echo"]]
    _, outs = serve("echo", 3, sampling=stops)
    for out, b in zip(outs, self.base["echo"]):
      self.assertEqual(out, b[:b.index(b[5]) + 1])
    lengths = [SamplingParams(max_new_tokens=n) for n in (1, 2, 4, 5, 7, 10)]
    _, outs = serve("echo", 3, sampling=lengths)
    self.assertEqual(outs, [b[:s.max_new_tokens] for b, s in zip(self.base["echo"], lengths)])

  def test_cancel_mid_decode_returns_every_page(self):
    eng = engine("echo", 2)
    ids = [eng.submit(p, SamplingParams(max_new_tokens=N_NEW)) for p in PROMPTS[:4]]
    for _ in range(4):
      eng.step()
    self.assertTrue(eng.cancel(ids[1]))
    eng.run_until_done(max_steps=300)
    self.assertEqual(eng.get(ids[1]).status, RequestStatus.ABORTED)
    for i in (0, 2, 3):
      self.assertEqual(list(eng.get(ids[i]).output), self.base["echo"][i])
    self.assertEqual(eng.allocator.num_free, NUM_PAGES)

  def test_integrity_fault_in_a_verify_step_aborts_only_its_request(self):
    eng = engine("echo", 3)
    ids = [eng.submit(p, SamplingParams(max_new_tokens=N_NEW)) for p in PROMPTS[:4]]
    victim = ids[2]
    while eng.get(victim).status is not RequestStatus.DECODING:
      eng.step()
    eng.step()  # one verify step done
    eng.inject_fault(Fault(FaultKind.STALE_TAG, victim, page_index=0))
    eng.run_until_done(max_steps=300)
    self.assertEqual(eng.get(victim).abort_reason, ABORT_INTEGRITY)
    for i in (0, 1, 3):
      self.assertEqual(list(eng.get(ids[i]).output), self.base["echo"][i])
    self.assertEqual(eng.stats.integrity_failures, 1)

  def test_sampled_rows_are_reproducible_and_in_vocabulary(self):
    sampling = [SamplingParams(max_new_tokens=N_NEW, seed=s, temperature=0.9, top_k=40)
                for s in range(len(PROMPTS))]
    _, a = serve("echo", 2, sampling=sampling)
    _, b = serve("echo", 2, sampling=sampling)
    self.assertEqual(a, b)
    for out in a:
      self.assertLen(out, N_NEW)
      self.assertTrue(all(0 <= t < CFG.vocab_size for t in out))

  def test_bad_configs_raise(self):
    with self.assertRaisesRegex(ValueError, "non-negative int"):
      engine_config(-1)
    with self.assertRaisesRegex(ValueError, "no.*multi-token-prediction|has none"):
      EngineConfig(model=dataclasses.replace(CFG, n_mtp_layers=0),
                   kv=KVCacheConfig(NUM_PAGES, PAGE, "float32"), speculative_tokens=2)
    no_mtp = {k: v for k, v in params("random").items() if k != "mtp"}
    with self.assertRaisesRegex(ValueError, "params have none"):
      Engine(no_mtp, engine_config(2))
    pool = PoolConfig(engine_config(2), BF16)
    with self.assertRaisesRegex(ValueError, "the same in both pools"):
      DisaggConfig(prefill=PoolConfig(engine_config(0), BF16), decode=pool)

  def test_logprobs_equal_plain_decoding(self):
    sampling = [SamplingParams(max_new_tokens=N_NEW, logprobs=3)] * len(PROMPTS)
    plain, _ = serve("echo", 0, sampling=sampling)
    spec, outs = serve("echo", 3, sampling=sampling)
    self.assertEqual(outs, self.base["echo"])
    for a, b in zip(plain.requests.values(), spec.requests.values()):
      self.assertLen(b.logprobs, len(b.output))
      for (lp_a, ids_a, top_a), (lp_b, ids_b, top_b) in zip(a.logprobs, b.logprobs):
        np.testing.assert_allclose(lp_b, lp_a, atol=1e-5)
        np.testing.assert_array_equal(ids_b, ids_a)
        np.testing.assert_allclose(top_b, top_a, atol=1e-5)

  def test_on_a_mesh(self):
    # The devices and mesh of test_disaggregated_pools's decode pool, whose verify step is
    # then this engine's (compiled once).
    mesh = make_mesh(MeshConfig(tensor=2, expert=2), jax.devices()[4:8])
    eng = Engine(params("echo"), engine_config(2), mesh=mesh)
    ids = [eng.submit(p, SamplingParams(max_new_tokens=N_NEW)) for p in PROMPTS]
    eng.run_until_done(max_steps=500)
    self.assertEqual([list(eng.get(i).output) for i in ids], self.base["echo"])
    self.assertGreater(eng.metrics()["speculative"]["drafts_accepted"], 0)

  def test_disaggregated_pools(self):
    # The prefill pool writes the prompt's drafter KV and the first drafts; the transfer
    # carries the drafter layer with the model's; the (overlapped) decode pool verifies, on
    # test_on_a_mesh's mesh (tensor and expert parallel, devices 4 to 7): the same steps.
    cfg = DisaggConfig(prefill=PoolConfig(engine_config(2), BF16, MeshConfig(tensor=2)),
                       decode=PoolConfig(engine_config(2, overlap=True), BF16,
                                         MeshConfig(tensor=2, expert=2)))
    eng = DisaggEngine(params("echo"), cfg, devices=jax.devices()[2:8])
    ids = [eng.submit(p, SamplingParams(max_new_tokens=N_NEW)) for p in PROMPTS]
    eng.run_until_done(max_steps=500)
    self.assertEqual([list(eng.get(i).output) for i in ids], self.base["echo"])
    spec = eng.metrics()["speculative"]
    colocated = serve("echo", 2)[0].metrics()["speculative"]
    self.assertEqual(spec["accepted_histogram"], colocated["accepted_histogram"])

  def test_served_with_the_serve_config(self):
    # What `python -m mlkit.serve --speculative-tokens 2` builds: the preset's MTP layer
    # is drawn, the engine speculates, and greedy tokens are those of the plain server.
    # The pool's sizes are this file's engines' (prefill chunk, log-probabilities included):
    # the plain server runs the steps setUpClass compiled (serve(..., 0): the same params
    # and placement).
    from mlkit.serve.model import ServeConfig, build_engine, load_model
    outs = {}
    for k in (0, 2):
      cfg = ServeConfig(role="colocated", model="tiny-mla", n_layers=2, kv_dtype="float32",
                        page_size=PAGE, num_pages=NUM_PAGES, max_pages_per_seq=16,
                        prefill_chunk=8, max_logprobs=3, speculative_tokens=k)
      params_k, mcfg = load_model(cfg)
      self.assertEqual("mtp" in params_k, k > 0)
      eng = build_engine(cfg, params_k, mcfg)
      self.assertEqual(eng.config.speculative_tokens, k)
      outs[k] = eng.generate(PROMPTS[:2], SamplingParams(max_new_tokens=6))
    self.assertEqual(outs[2], outs[0])

  def test_sequences_keep_look_ahead_room(self):
    eng = engine("random", 3)
    room = 16 * PAGE - 5  # max_pages_per_seq pages less 2k - 1 look-ahead positions
    self.assertEqual(eng.max_seq_tokens, room)
    with self.assertRaisesRegex(ValueError, "can never fit"):
      eng.submit([1] * 4, SamplingParams(max_new_tokens=room - 3))
    eng.submit([1] * 4, SamplingParams(max_new_tokens=room - 4))


if __name__ == "__main__":
  absltest.main()
