"""Disaggregated prefill/decode pools: transfer format, re-paging, checksums, equivalence, engine on a mesh."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from configs import TINY_GQA, TINY_MLA
from mlkit import kvcache as kvc
from mlkit import parallel
from mlkit.engine import Engine, EngineConfig, Fault, FaultKind, RequestRejected, RequestStatus
from mlkit.engine import faults as faults_lib
from mlkit.engine import transfer as tr
from mlkit.engine.disagg import (ABORT_TRANSFER, DisaggConfig, DisaggEngine, PoolConfig,
                                 TransferFault, build_serving_engine, default_disagg_config)
from mlkit.quant import BF16, FP8_ALL, INT4_EXPERTS
from mlkit.sampling import SamplingParams
from host_data import put
from empty_kv import empty_pool
from test_parallel import init_params_np

# One MoE layer: the pools' logic does not depend on depth, and compiles scale with it.
CFG = dataclasses.replace(TINY_MLA, n_layers=1, first_k_dense=0)
# One bucket per step kind, so each pool compiles one prefill and one decode step.
ENGINE_KW = dict(max_running=4, batch_buckets=(4,), prefill_buckets=(8,), prefill_token_budget=16,
                 max_pages_per_seq=8, record_logits=True)
SAMPLING = SamplingParams(max_new_tokens=6)
_rng = np.random.default_rng(0)
# Two prompts start at once; two more arrive while those decode (the 13-token one needs two chunks).
EARLY = [list(map(int, _rng.integers(0, 256, n))) for n in (5, 9)]
LATE = [list(map(int, _rng.integers(0, 256, n))) for n in (13, 7)]


def _pool(page_size, kv_dtype, recipe, mesh, num_pages=32):
  eng = EngineConfig(model=CFG, kv=kvc.KVCacheConfig(num_pages, page_size, kv_dtype), **ENGINE_KW)
  return PoolConfig(eng, recipe, mesh)


def _drive(engine, early=EARLY, late=LATE, steps_between=2):
  """Submits ``early``, steps, submits ``late`` (arriving mid-decode), runs to completion."""
  ids = [engine.submit(p, SAMPLING) for p in early]
  for _ in range(steps_between):
    engine.step()
  ids += [engine.submit(p, SAMPLING) for p in late]
  engine.run_until_done(max_steps=200)
  reqs = [engine.get(i) for i in ids]
  return [list(r.output) for r in reqs], [np.stack(engine.logits[i]) for i in ids], reqs


def _rel(a, b):
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


class DisaggEngineTest(parameterized.TestCase):
  """One checkpoint served four ways; the engines are built once (compiles dominate)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.ckpt = init_params_np(CFG)
    # Same recipe and (f32) KV format in both pools, different page sizes: exact re-paging.
    cls.same_cfg = DisaggConfig(
        prefill=_pool(4, "float32", BF16, parallel.MeshConfig(tensor=4)),
        decode=_pool(8, "float32", BF16, parallel.MeshConfig(tensor=2, expert=2)),
        enable_fault_injection=True)
    cls.disagg = DisaggEngine(cls.ckpt, cls.same_cfg)
    cls.d_out, cls.d_logits, cls.d_reqs = _drive(cls.disagg)
    cls.timeline = list(cls.disagg.stats.timeline)
    cls.d_metrics = cls.disagg.metrics()["disagg"]  # other tests add requests to this engine
    # On the decode pool's devices (4 to 7, after the prefill pool's four) and mesh: the
    # decode pool's decode step is then this engine's.
    cls.coloc = build_serving_engine(cls.ckpt, dataclasses.replace(
        cls.same_cfg, mode="colocated", enable_fault_injection=False), devices=jax.devices()[4:])
    cls.c_out, cls.c_logits, _ = _drive(cls.coloc)

  def test_disaggregated_equals_colocated_same_recipe(self):
    self.assertEqual(self.d_out, self.c_out)
    self.assertTrue(all(len(o) == SAMPLING.max_new_tokens for o in self.d_out))
    for a, b in zip(self.d_logits, self.c_logits):
      self.assertTrue(np.isfinite(a).all())
      np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    m = self.d_metrics
    self.assertEqual(m["transfers"], len(EARLY) + len(LATE))
    self.assertEqual(m["transfer_failures"], 0)
    self.assertGreater(m["transfer_bytes"], 0)

  def test_new_lengths_in_known_buckets_serve_without_compiling(self):
    # Prompts one token longer than setUpClass's (6, 10, 14, 8 against 5, 9, 13, 7) fill
    # the same prefill chunks and the same page counts in both pools, so serving them
    # compiles nothing: the steps are bucketed, and the transfers depend on page
    # counts, not lengths. A per-length or per-request program would trace here.
    rng = np.random.default_rng(11)
    early, late = ([list(map(int, rng.integers(0, 256, len(p) + 1))) for p in ps]
                   for ps in (EARLY, LATE))
    events = []

    def listen(event, duration, **kw):
      if event in ("/jax/core/compile/backend_compile_duration",
                   "/jax/core/compile/jaxpr_trace_duration"):
        events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
      out, _, reqs = _drive(self.disagg, early, late)
    finally:
      jax.monitoring.unregister_event_duration_listener(listen)
    self.assertEqual([len(o) for o in out], [SAMPLING.max_new_tokens] * 4)
    self.assertTrue(all(r.status is RequestStatus.FINISHED for r in reqs))
    self.assertEqual(events, [])

  def test_pools_are_disjoint_submeshes_with_their_formats(self):
    d = self.disagg
    p_dev = set(d.prefill_mesh.devices.flat)
    d_dev = set(d.decode_mesh.devices.flat)
    self.assertEmpty(p_dev & d_dev)
    self.assertEqual(set(d.prefill.state.layers[0]["latent"].sharding.device_set), p_dev)
    self.assertEqual(set(d.decode.state.layers[0]["latent"].sharding.device_set), d_dev)
    self.assertEqual(d.prefill.state.page_size, 4)
    self.assertEqual(d.decode.state.page_size, 8)

  def test_decode_keeps_stepping_while_prefills_run(self):
    # Iterations that dispatched a prefill step while the decode pool emitted tokens:
    # the late prompts (one of them two chunks long) are prefilled while the early ones decode.
    overlapped = [t for t in self.timeline if t[0] > 0 and t[1] > 0]
    self.assertGreaterEqual(len(overlapped), 2, self.timeline)
    self.assertEqual(self.d_metrics["overlapped_iterations"], len(overlapped))

  def test_engine_runs_unchanged_on_a_mesh(self):
    # The colocated engine above is a plain Engine whose params and KV live on a
    # 4-device mesh; a 1-device Engine gives the same tokens and logits.
    self.assertIsInstance(self.coloc, Engine)
    plain = Engine(self.ckpt, self.same_cfg.decode.engine)
    out, logits, _ = _drive(plain)
    self.assertEqual(out, self.c_out)
    for a, b in zip(logits, self.c_logits):
      np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5)
    # The pages stayed on the mesh through the donated steps.
    self.assertLen(self.coloc.state.layers[0]["latent"].sharding.device_set, 4)

  def test_disaggregated_across_recipes_within_quant_tolerance(self):
    # The report's split: prefill FP8_ALL weights + bf16 KV, decode INT4_EXPERTS + fp8 KV.
    cfg = DisaggConfig(prefill=_pool(4, "bfloat16", FP8_ALL, parallel.MeshConfig(tensor=4)),
                       decode=_pool(8, "float8_e4m3fn", INT4_EXPERTS,
                                    parallel.MeshConfig(tensor=2, expert=2)))
    eng = DisaggEngine(self.ckpt, cfg)
    out, logits, _ = _drive(eng)
    self.assertEqual(str(eng.decode.state.dtype), "float8_e4m3fn")
    self.assertEqual(str(eng.prefill.state.dtype), "bfloat16")
    agree_first = 0
    for o, ref_o, lg, ref_lg in zip(out, self.c_out, logits, self.c_logits):
      self.assertTrue(np.isfinite(lg).all())
      # The first token comes from the fp8-weight prefill pool. Per matmul fp8 stays within
      # 5e-2, but through two layers, a bf16 cache and top-k routing (one 128x128 scale
      # block per tiny matrix) the logits move by up to ~8%; a transfer or format bug moves
      # them by O(1).
      self.assertLessEqual(_rel(lg[0], ref_lg[0]), 0.1)
      agree_first += o[0] == ref_o[0]
      # Decode steps run int4 experts on an fp8 cache. Int4 RTN of tiny random experts
      # moves logits by up to ~20% through routing flips (see test_quant_recipe), so the
      # bound is 0.25, checked while the two continuations still see the same tokens.
      n = next((i for i in range(len(o)) if o[i] != ref_o[i]), len(o))
      for i in range(1, min(n + 1, len(o))):
        self.assertLessEqual(_rel(lg[i], ref_lg[i]), 0.25, (i, o, ref_o))
    self.assertGreaterEqual(agree_first, len(out) - 1)

  def test_transit_corruption_is_retried(self):
    eng = self.disagg
    before = eng.stats.transfer_retries
    eng.inject_transfer_fault(TransferFault("transit", times=1, layer=0))
    out, _, reqs = _drive(eng, early=[EARLY[0]], late=[], steps_between=0)
    self.assertEqual(reqs[0].status, RequestStatus.FINISHED)
    self.assertEqual(out[0], self.c_out[0])  # the retry delivered the right KV
    self.assertEqual(eng.stats.transfer_retries, before + 1)

  @parameterized.parameters("transit", "landing")
  def test_persistent_corruption_aborts_with_reason(self, where):
    eng = self.disagg
    eng.inject_transfer_fault(TransferFault(where, times=self.same_cfg.transfer_attempts))
    failures = eng.stats.transfer_failures
    rid = eng.submit(EARLY[1], SAMPLING)
    outs = []
    while eng.has_unfinished():
      outs += [o for o in eng.step() if o.request_id == rid]
    req = eng.get(rid)
    # The last iteration's one output merges the prefill pool's first token and the abort.
    self.assertEqual(outs[-1].new_tokens, tuple(req.output))
    self.assertEqual(outs[-1].abort_reason, ABORT_TRANSFER)
    self.assertEqual(sum(len(o.new_tokens) for o in outs), 1)
    self.assertEqual(req.status, RequestStatus.ABORTED)
    self.assertEqual(req.abort_reason, ABORT_TRANSFER)
    error = eng.transfer_errors[req.request_id]
    self.assertIn("checksum mismatch", error)
    self.assertIn("in transit" if where == "transit" else "after the write", error)
    self.assertIn(f"after {self.same_cfg.transfer_attempts} attempts", error)
    self.assertLen(req.output, 1)  # only the prefill pool's first token, nothing decoded
    self.assertEqual(eng.stats.transfer_failures, failures + 1)
    # Both pools got every page back.
    self.assertEqual(eng.prefill.allocator.num_free, eng.prefill.allocator.num_pages)
    self.assertEqual(eng.decode.allocator.num_free, eng.decode.allocator.num_pages)

  def test_full_decode_pool_holds_requests_in_transfer_queue(self):
    # Six requests against a decode pool of max_running 4: two finish prefill while the
    # decode pool is full and wait (holding prefill pages) until it has room.
    eng = self.disagg
    prompts = EARLY + LATE + [EARLY[0][:3], LATE[1][:4]]
    ids = [eng.submit(p, SAMPLING) for p in prompts]
    waited = 0
    while eng.has_unfinished():
      eng.step()
      waited = max(waited, len(eng.prefill.prefilled()))
    self.assertGreater(waited, 0)
    out = [eng.get(i).output for i in ids]
    self.assertEqual(out[:4], self.c_out)
    ref = self.coloc.generate(prompts[4:], SAMPLING)
    self.assertEqual(out[4:], ref)

  def test_decode_preemption_recomputes_in_prefill_pool(self):
    # Another tenant holds all but 4 decode pages: the second request outgrows what is
    # left, the decode pool preempts it, and it is re-prefilled (prompt + its output so
    # far) in the prefill pool, transferred again and finished with the same tokens.
    eng = self.disagg
    alloc = eng.decode.allocator
    self.assertIsNone(alloc.admit("hog", (alloc.num_free - 4) * alloc.page_size))
    requeued, preempted = eng.stats.requeued, eng.decode.stats.preemptions
    sampling = SamplingParams(max_new_tokens=12)
    try:
      ids = [eng.submit(p, sampling) for p in EARLY]
      eng.run_until_done(max_steps=200)
    finally:
      alloc.release("hog")
    self.assertGreater(eng.stats.requeued, requeued)
    self.assertGreater(eng.decode.stats.preemptions, preempted)
    self.assertEqual([eng.get(i).output for i in ids], self.coloc.generate(EARLY, sampling))
    self.assertEqual(eng.decode.allocator.num_free, eng.decode.allocator.num_pages)

  def test_cancel_in_each_place(self):
    eng = self.disagg
    waiting = eng.submit(EARLY[0], SAMPLING)
    self.assertTrue(eng.cancel(waiting))  # still queued in the prefill pool
    decoding = eng.submit(EARLY[1], SAMPLING)
    for _ in range(10):
      eng.step()
      if eng.get(decoding) in eng.decode.scheduler.running:
        break
    self.assertIn(eng.get(decoding), eng.decode.scheduler.running)
    self.assertTrue(eng.cancel(decoding))  # decoding in the decode pool
    for rid in (waiting, decoding):
      self.assertEqual(eng.get(rid).status, RequestStatus.ABORTED)
      self.assertEqual(eng.get(rid).abort_reason, "cancelled")
    self.assertFalse(eng.cancel(decoding))  # already ended
    self.assertFalse(eng.has_unfinished())
    self.assertEqual(eng.decode.allocator.num_free, eng.decode.allocator.num_pages)
    self.assertEqual(eng.prefill.allocator.num_free, eng.prefill.allocator.num_pages)
    with self.assertRaises(KeyError):
      eng.get(10_000)
    with self.assertRaisesRegex(ValueError, "prompt is empty"):
      eng.submit([], SAMPLING)

  def test_generate_is_atomic_and_checks_its_sampling_count(self):
    eng = self.disagg
    n = len(eng.requests)
    with self.assertRaisesRegex(ValueError, "request 1 of the batch"):
      eng.generate([EARLY[0], [999]], SAMPLING)
    with self.assertRaisesRegex(ValueError, "1 SamplingParams for 2 prompts"):
      eng.generate([EARLY[0], EARLY[1]], [SAMPLING])
    with self.assertRaisesRegex(ValueError, "request 0 of the batch: .*can never fit"):
      eng.generate([[1] * 60], SamplingParams(max_new_tokens=10))
    self.assertLen(eng.requests, n)
    self.assertFalse(eng.has_unfinished())

  def test_one_bad_request_never_stalls_the_pools(self):
    eng = self.disagg
    good = eng.submit(EARLY[0], SAMPLING)
    bad = eng.submit(EARLY[1], SAMPLING)
    object.__setattr__(eng.get(bad).sampling, "top_k", 2**40)  # its prefill row cannot be built
    eng.run_until_done(max_steps=100)
    self.assertEqual(eng.get(bad).abort_reason, "error")
    self.assertIn("OverflowError", eng.get(bad).error)
    self.assertEqual(eng.get(good).output, self.c_out[0])
    self.assertEqual(eng.prefill.allocator.num_free, eng.prefill.allocator.num_pages)
    self.assertEqual(eng.decode.allocator.num_free, eng.decode.allocator.num_pages)

  def test_prefill_pool_page_violation_aborts_its_holder(self):
    eng = self.disagg
    other = eng.submit(EARLY[0], SAMPLING)
    victim = eng.submit(LATE[0], SAMPLING)  # 13 tokens: two prefill chunks
    eng.step()
    self.assertTrue(eng.prefill.allocator.has_request(victim))
    faults_lib.inject(eng.prefill.allocator, Fault(FaultKind.USE_AFTER_FREE, victim, 0))
    eng.run_until_done(max_steps=100)
    self.assertEqual(eng.get(victim).abort_reason, "integrity")
    self.assertEqual(eng.get(victim).output, [])
    self.assertEqual(eng.get(other).output, self.c_out[0])
    self.assertEmpty(eng.prefill.allocator.audit())
    self.assertEmpty(eng.decode.allocator.audit())
    self.assertEqual(eng.decode.allocator.num_free, eng.decode.allocator.num_pages)

  def test_submit_too_long_for_decode_pool_rejected(self):
    with self.assertRaises(RequestRejected):
      self.disagg.submit([1] * 60, SamplingParams(max_new_tokens=10))

  def test_fault_layer_out_of_range_raises(self):
    with self.assertRaisesRegex(ValueError, "TransferFault.layer 1 is outside the model's 1 layers"):
      self.disagg.inject_transfer_fault(TransferFault(layer=1))

  def test_fault_injection_disabled_raises(self):
    # Building the pools compiles nothing (steps compile when they first run).
    eng = DisaggEngine(self.ckpt, dataclasses.replace(self.same_cfg, enable_fault_injection=False))
    with self.assertRaisesRegex(RuntimeError, "fault injection is disabled"):
      eng.inject_transfer_fault(TransferFault())

  def test_colocated_config_is_a_plain_engine(self):
    cfg = dataclasses.replace(self.same_cfg, mode="colocated")
    with self.assertRaisesRegex(ValueError, "colocated pool is a plain Engine"):
      DisaggEngine(self.ckpt, cfg)


class DisaggConfigTest(parameterized.TestCase):

  def test_default_is_the_reports_split(self):
    c = default_disagg_config(CFG, prefill_page_size=4, decode_page_size=8)
    self.assertEqual((c.prefill.recipe, c.prefill.engine.kv.dtype), (FP8_ALL, "bfloat16"))
    self.assertEqual((c.decode.recipe, c.decode.engine.kv.dtype), (INT4_EXPERTS, "float8_e4m3fn"))
    self.assertEqual((c.prefill.num_devices, c.decode.num_devices), (4, 4))
    self.assertEqual((c.prefill.engine.page_size, c.decode.engine.page_size), (4, 8))

  def test_validation_names_fields(self):
    c = default_disagg_config(CFG)
    with self.assertRaisesRegex(ValueError, "DisaggConfig.mode"):
      dataclasses.replace(c, mode="split")
    with self.assertRaisesRegex(ValueError, "DisaggConfig.transfer_attempts"):
      dataclasses.replace(c, transfer_attempts=0)
    other = dataclasses.replace(c.decode, engine=dataclasses.replace(c.decode.engine, model=TINY_MLA))
    with self.assertRaisesRegex(ValueError, "same model"):
      dataclasses.replace(c, decode=other)
    small = dataclasses.replace(c.decode, engine=dataclasses.replace(
        c.decode.engine, kv=kvc.KVCacheConfig(1, 8, "float8_e4m3fn")))
    with self.assertRaisesRegex(ValueError, "DisaggConfig.decode holds at most 8"):
      dataclasses.replace(c, decode=small)
    with self.assertRaisesRegex(ValueError, "PoolConfig.recipe"):
      PoolConfig(c.decode.engine, "int4")
    with self.assertRaisesRegex(ValueError, "TransferFault.where"):
      TransferFault("disk")

  def test_too_many_devices_raises(self):
    c = default_disagg_config(CFG, prefill_devices=4, decode_devices=8)
    with self.assertRaisesRegex(ValueError, "need 12 devices"):
      DisaggEngine(init_params_np(CFG), c)


def _filled_state(cfg, dtype, page_size, pages, length, seed=0, num_pages=12):
  """A pool whose ``pages`` hold ``length`` tokens of random entries; returns (state, entries)."""
  state = empty_pool(cfg, kvc.KVCacheConfig(num_pages, page_size, dtype))
  rng = np.random.default_rng(seed)
  shapes = kvc.state.entry_shapes(cfg)
  # Drawn and cast in numpy, placed with device_put: jnp.asarray, zeros and arange each
  # compile a program per shape.
  entries = [{k: put((rng.standard_normal((1, length) + s) * (1 + 3 * (k == "k_rope"))
                      ).astype(np.float32)) for k, s in shapes.items()}
             for _ in range(cfg.n_layers)]
  positions = put(np.arange(length, dtype=np.int32)[None])
  return kvc.write_prefill(state, entries, positions, _meta(pages, length, page_size)), entries


def _meta(pages, length, page_size):
  """BatchMeta of one request holding ``length`` tokens in ``pages``, placed from numpy."""
  bt = np.full((1, 8), kvc.PAD_PAGE, np.int32)
  bt[0, :len(pages)] = pages
  return kvc.BatchMeta(*put(bt, np.asarray([length], np.int32), np.zeros((1, 8), np.int32)),
                       page_size)


# Every layer read back through the library's read_layer in one program per pool shape (run
# eagerly, each gather, reshape and mask compiles a program of its own).
_read_layers = jax.jit(lambda state, meta: [kvc.read_layer(state, i, meta)
                                            for i in range(len(state.layers))])


def _read(state, pages, length):
  meta = _meta(pages, length, state.page_size)
  # Sliced on the host: slicing the device array would compile one program per length.
  return [{k: np.asarray(v)[0, :length] for k, v in layer.items()}
          for layer in _read_layers(state, meta)]


# The fp8 round trip the transfer's conversion must give, as one program per shape (run
# eagerly, each of its operations compiles on its own). Bit-equal to the eager ops.
_fp8_round_trip = jax.jit(lambda x: kvc.dequantize_fp8(*kvc.quantize_fp8(x)))
_checksum = jax.jit(tr.checksum)


class TransferTest(parameterized.TestCase):
  LENGTH = 11  # crosses page boundaries in both pools, ends mid-page

  def test_page_bucket(self):
    self.assertEqual([tr.page_bucket(m) for m in range(1, 9)], list(range(1, 9)))
    self.assertEqual([tr.page_bucket(m) for m in (9, 10, 11, 13, 16, 17, 33, 129, 256)],
                     [10, 10, 12, 14, 16, 20, 40, 160, 256])
    buckets = [tr.page_bucket(m) for m in range(1, 257)]
    self.assertEqual(len(set(buckets)), 28)
    self.assertEqual(buckets, sorted(buckets))
    for m, b in zip(range(1, 257), buckets):
      self.assertGreaterEqual(b, m)
      self.assertLess(b - m, max(1, m / 4), m)

  def test_page_counts_share_compiled_transfers(self):
    # Requests of 9 to 16 source pages: four padded shapes, so the extract program compiles
    # four times, not eight (the checksum eight, not sixteen: once on each side), and
    # every transfer still lands exactly.
    src = empty_pool(TINY_MLA, kvc.KVCacheConfig(40, 2, "float32"))
    rng = np.random.default_rng(5)
    src = src.replace(layers=[{k: put(rng.standard_normal(v.shape).astype(v.dtype))
                               for k, v in layer.items()} for layer in src.layers])
    before = tr.extract_kv._cache_size(), tr.payload_checksum._cache_size()
    for m in range(9, 17):
      length = 2 * m - 1  # ends mid-page
      src_pages = list(rng.permutation(40)[:m])
      dst_pages = list(range(-(-length // 4)))
      dst = empty_pool(TINY_MLA, kvc.KVCacheConfig(12, 4, "float32"))
      dst, res = tr.transfer_kv(src, src_pages, dst, dst_pages, length)
      self.assertTrue(res.ok, res.reason)
      got = _read(dst, dst_pages, length)
      for i, layer in enumerate(src.layers):
        for k, x in layer.items():
          want = np.asarray(x)[np.asarray(src_pages)].reshape((-1,) + x.shape[2:])[:length]
          np.testing.assert_array_equal(got[i][k], want, err_msg=f"{m} pages, layer {i} {k}")
    self.assertEqual((tr.extract_kv._cache_size() - before[0],
                      tr.payload_checksum._cache_size() - before[1]), (4, 8))

  @parameterized.named_parameters(("mla", TINY_MLA), ("gqa", TINY_GQA))
  def test_bf16_to_fp8_with_per_token_scales(self, cfg):
    src, entries = _filled_state(cfg, "bfloat16", 4, [5, 2, 9], self.LENGTH)
    dst = empty_pool(cfg, kvc.KVCacheConfig(12, 8, "float8_e4m3fn"))
    dst, res = tr.transfer_kv(src, [5, 2, 9], dst, [7, 3], self.LENGTH)
    self.assertTrue(res.ok, res.reason)
    got = _read(dst, [7, 3], self.LENGTH)
    for i, layer in enumerate(entries):
      for k, x in layer.items():
        # Rounded to bf16 on the host (ml_dtypes rounds to nearest even, as XLA does).
        x_bf16 = np.asarray(x)[0].astype(jnp.bfloat16).astype(np.float32)
        # Exactly what per-token fp8 quantisation of the bf16 source gives ...
        np.testing.assert_array_equal(got[i][k], np.asarray(_fp8_round_trip(x_bf16)))
        # ... one scale per token (and KV head): absmax / 448.
        scales = np.asarray(dst.layers[i][k + "_scale"])[[7] * 8 + [3] * 3, list(range(8)) + [0, 1, 2]]
        np.testing.assert_allclose(scales, np.abs(x_bf16).max(-1) / kvc.FP8_MAX, rtol=1e-6)
        # ... and within the fp8 tolerance of the source.
        self.assertLessEqual(_rel(got[i][k], x_bf16), 5e-2)

  @parameterized.parameters((4, 6), (8, 3), (4, 4))
  def test_repaging_is_exact(self, src_page, dst_page):
    src_pages = list(range(3, 3 + -(-self.LENGTH // src_page)))[::-1]
    dst_pages = list(range(10, 10 - -(-self.LENGTH // dst_page), -1))
    src, entries = _filled_state(TINY_MLA, "float32", src_page, src_pages, self.LENGTH)
    dst = empty_pool(TINY_MLA, kvc.KVCacheConfig(12, dst_page, "float32"))
    dst, res = tr.transfer_kv(src, src_pages, dst, dst_pages, self.LENGTH)
    self.assertTrue(res.ok, res.reason)
    got = _read(dst, dst_pages, self.LENGTH)
    for i, layer in enumerate(entries):
      for k, x in layer.items():
        np.testing.assert_array_equal(got[i][k], np.asarray(x)[0])
    # Pages the request does not own are untouched (read on the host: no program per shape).
    other = [p for p in range(12) if p not in dst_pages]
    self.assertEqual(float(np.abs(np.asarray(dst.layers[0]["latent"])[other]).max()), 0.0)

  @parameterized.parameters((4, 3, 3), (8, 3, 6), (4, 8, 8), (3, 4, 4))
  def test_transfer_from_a_start_moves_and_writes_only_the_rest(self, src_page, dst_page, start):
    # The destination already holds tokens [0, start) in a shared page (sentinel values
    # here): the transfer must leave that page alone and deliver the rest exactly.
    # The repaging tests' length (ragged in every page size here): their pools and page counts,
    # so the whole transfers and the source writes reuse their compiled programs.
    length = self.LENGTH
    src_pages = list(range(2, 2 + -(-length // src_page)))
    dst_pages = list(range(9, 9 - -(-length // dst_page), -1))
    src, entries = _filled_state(TINY_MLA, "float32", src_page, src_pages, length)
    dst = empty_pool(TINY_MLA, kvc.KVCacheConfig(12, dst_page, "float32"))
    shared = dst_pages[:start // dst_page]

    def sentinel(v):  # set on the host: a device scatter compiles a program per shape
      v = np.array(v)
      v[shared] = 7.0
      return put(v)

    dst = dst.replace(layers=[{k: sentinel(v) for k, v in layer.items()} for layer in dst.layers])
    # The transfer donates its destination: a second one, copied through the host.
    copy = jax.tree_util.tree_map(lambda v: put(np.asarray(v)), dst)
    _, whole = tr.transfer_kv(src, src_pages, copy, dst_pages, length)
    dst, res = tr.transfer_kv(src, src_pages, dst, dst_pages, length, start=start)
    self.assertTrue(res.ok, res.reason)
    # Only the source pages from the one holding token `start` on travel.
    first = start // src_page
    self.assertEqual(res.nbytes * len(src_pages), whole.nbytes * (len(src_pages) - first))
    got = _read(dst, dst_pages, length)
    for i, layer in enumerate(entries):
      for k, x in layer.items():
        np.testing.assert_array_equal(got[i][k][start:], np.asarray(x)[0][start:])
        np.testing.assert_array_equal(got[i][k][:start], 7.0)  # the shared page is untouched
    with self.assertRaisesRegex(ValueError, "transfer start"):
      tr.transfer_kv(src, src_pages, dst, dst_pages, length, start=start + 1)

  def test_checksum_catches_corrupted_page_in_transit(self):
    src, _ = _filled_state(TINY_MLA, "bfloat16", 4, [0, 1, 2], self.LENGTH)
    dst = empty_pool(TINY_MLA, kvc.KVCacheConfig(12, 8, "float8_e4m3fn"))

    def corrupt(payload):  # one token of layer 2's rope keys, slightly changed
      payload[2]["k_rope"] = payload[2]["k_rope"].at[9, 0].add(1.0)
      return payload

    dst, res = tr.transfer_kv(src, [0, 1, 2], dst, [4, 5], self.LENGTH, corrupt_payload=corrupt)
    self.assertFalse(res.ok)
    self.assertEqual(res.reason, "transfer checksum mismatch in transit at layer 2 entry 'k_rope'")

  def test_checksum_catches_bad_landing(self):
    src, _ = _filled_state(TINY_GQA, "bfloat16", 4, [0, 1, 2], self.LENGTH)
    dst = empty_pool(TINY_GQA, kvc.KVCacheConfig(12, 8, "float8_e4m3fn"))

    def corrupt(state):  # a token's scale lands wrong
      layers = list(state.layers)
      layers[1] = dict(layers[1], v_scale=layers[1]["v_scale"].at[5, 2, 1].multiply(2.0))
      return state.replace(layers=layers)

    dst, res = tr.transfer_kv(src, [0, 1, 2], dst, [4, 5], self.LENGTH, corrupt_landing=corrupt)
    self.assertFalse(res.ok)
    self.assertEqual(res.reason, "transfer checksum mismatch after the write at layer 1 entry 'v_scale'")

  def test_checksum_sensitivity(self):
    # The variants are made on the host (bf16 through ml_dtypes, bits through a uint16
    # view): done on the device, each operation would compile a program of its own.
    x = np.random.default_rng(3).standard_normal((16, 8)).astype(jnp.bfloat16)

    def checksum(a):  # jitted: run eagerly, each of its operations compiles a program
      return int(_checksum(put(a)))

    base = checksum(x)
    signed = x.copy()
    signed[7, 3] = -signed[7, 3]
    self.assertNotEqual(checksum(signed), base)  # sign bit
    swapped = x.copy()
    swapped[[2, 5]] = x[[5, 2]]
    self.assertNotEqual(checksum(swapped), base)  # two tokens swapped
    self.assertEqual(checksum(x.copy()), base)  # deterministic
    # Every single-bit flip of every word is caught (odd weights), including word 0.
    words = x.view(np.uint16).reshape(-1)
    for i in (0, 1, 77, words.shape[0] - 1):
      for bit in (0, 7, 15):
        flipped = words.copy()
        flipped[i] ^= np.uint16(1 << bit)
        y = flipped.reshape(x.shape).view(jnp.bfloat16)
        self.assertNotEqual(checksum(y), base, (i, bit))

  def test_transfer_rejects_short_page_lists(self):
    src, _ = _filled_state(TINY_MLA, "float32", 4, [0, 1, 2], self.LENGTH)
    dst = empty_pool(TINY_MLA, kvc.KVCacheConfig(12, 4, "float32"))
    with self.assertRaisesRegex(ValueError, "2 destination pages of 4 hold fewer than 11"):
      tr.transfer_kv(src, [0, 1, 2], dst, [4, 5], self.LENGTH)
    with self.assertRaisesRegex(ValueError, "incompatible pools"):
      tr.transfer_kv(src, [0, 1, 2], empty_pool(TINY_GQA, kvc.KVCacheConfig(12, 4)),
                     [4, 5, 6], self.LENGTH)


if __name__ == "__main__":
  absltest.main()
