"""Paged decode attention kernels (MLA and GQA) against their jnp references.

Each op test class derives from ``OpTest`` and runs one implementation of the
op (its ``backend``): the compiled ("pallas") classes run the kernels at
realistic shapes and are skipped without a GPU; interpret-mode classes run them
on CPU with tiny shapes. Unused page slots are filled with NaN, so a
kernel that reads past a request's length, or leaves an output element
unwritten (interpret mode fills fresh outputs with NaN), fails.
"""

import contextlib
import functools
import itertools
import math
import time
from unittest import mock
import zlib

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from jax._src.pallas.mosaic_gpu.interpret import shared_memory
from pallas_kernels.paged_attention import BlockSizes
from pallas_kernels.paged_attention import paged_gqa_decode
from pallas_kernels.paged_attention import paged_gqa_decode_reference
from pallas_kernels.paged_attention import paged_mla_decode
from pallas_kernels.paged_attention import paged_mla_decode_reference
from pallas_kernels import mgpu_shim
from pallas_kernels import schedule
from pallas_kernels.paged_attention import ops as attn_ops
from pallas_kernels.paged_attention import reference
from interpret_races import keep_race_records

FP8 = jnp.float8_e4m3fn
# Relative-norm tolerances (docs/testing.md): fp8 vs an f32 reference 5e-2; a
# bf16 cache still rounds probabilities to bf16 for the PV dot, so 1e-2.
TOL = {"bf16": 1e-2, "fp8": 5e-2}

ON_GPU = jax.default_backend() == "gpu"


def _rel_err(out, ref):
  out = np.asarray(out, np.float32)
  ref = np.asarray(ref, np.float32)
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _quantise(x, rng, kv_dtype, scale_shape):
  """x f32 [N, ps, ...] -> (stored pages, per-token scales or None)."""
  if kv_dtype == "bf16":
    return x.astype(np.float32), None
  # Per-token scales as a quantiser sets them (amax / 448, so e4m3 never
  # overflows to NaN), times a random factor in [1, 2) so they vary token to
  # token and a kernel that ignores or misplaces them fails.
  assert x.shape[:-1] == scale_shape
  s = np.abs(x).max(-1) / 448.0 * rng.uniform(1.0, 2.0, scale_shape)
  s = s.astype(np.float32)
  stored = x / s[..., None]
  return stored, s


def _poison(pages, scales, block_tables, lengths, page_size):
  """NaN in every slot no request uses (tails of last pages, unused pages)."""
  used = np.zeros(pages.shape[:2], bool)
  for b, length in enumerate(lengths):
    for t in range(length):
      used[block_tables[b, t // page_size], t % page_size] = True
  pages = pages.copy()
  pages[~used] = np.nan
  if scales is not None:
    scales = scales.copy()
    scales[~used] = np.nan
  return pages, scales


def _tables(rng, batch, max_pages, num_pages):
  perm = rng.permutation(num_pages)[: batch * max_pages]
  return perm.reshape(batch, max_pages).astype(np.int32)


def _pad_unused(block_tables, lengths, page_size):
  """Entries past each request's pages become PAD_PAGE (-1), as the cache does."""
  bt = block_tables.copy()
  for b, length in enumerate(lengths):
    bt[b, -(-length // page_size):] = -1
  return bt


def _dev(x, dtype=None):
  """x on the device as ``dtype``: cast by numpy (f64 through f32, as jnp.asarray
  rounds it) and placed with device_put, which compiles nothing, where jnp.asarray
  compiles a staging program and a conversion per shape and dtype."""
  x = np.asarray(x)
  if x.dtype == np.float64:
    x = x.astype(np.float32)
  return jax.device_put(x if dtype is None else x.astype(dtype))


def _cast(x, kv_dtype):
  return _dev(x, jnp.bfloat16 if kv_dtype == "bf16" else FP8)


def make_mla(seed, *, batch, heads, c, r, page_size, max_pages, lengths, kv_dtype):
  rng = np.random.default_rng(seed)
  num_pages = batch * max_pages + 3
  q_lat = _dev(rng.standard_normal((batch, heads, c)), jnp.bfloat16)
  q_rope = _dev(rng.standard_normal((batch, heads, r)), jnp.bfloat16)
  lat = rng.standard_normal((num_pages, page_size, c)).astype(np.float32)
  rope = rng.standard_normal((num_pages, page_size, r)).astype(np.float32)
  lat, lat_s = _quantise(lat, rng, kv_dtype, (num_pages, page_size))
  rope, rope_s = _quantise(rope, rng, kv_dtype, (num_pages, page_size))
  bt = _tables(rng, batch, max_pages, num_pages)
  lat, lat_s = _poison(lat, lat_s, bt, lengths, page_size)
  rope, rope_s = _poison(rope, rope_s, bt, lengths, page_size)
  bt = _pad_unused(bt, lengths, page_size)
  sc = lambda s: None if s is None else _dev(s)
  return (q_lat, q_rope, _cast(lat, kv_dtype), _cast(rope, kv_dtype),
          sc(lat_s), sc(rope_s), _dev(bt), _dev(lengths, np.int32))


def make_gqa(seed, *, batch, heads, kv_heads, hd, page_size, max_pages, lengths,
             kv_dtype):
  rng = np.random.default_rng(seed)
  num_pages = batch * max_pages + 3
  q = _dev(rng.standard_normal((batch, heads, hd)), jnp.bfloat16)
  shape = (num_pages, page_size, kv_heads, hd)
  k, k_s = _quantise(rng.standard_normal(shape).astype(np.float32), rng,
                     kv_dtype, shape[:3])
  v, v_s = _quantise(rng.standard_normal(shape).astype(np.float32), rng,
                     kv_dtype, shape[:3])
  bt = _tables(rng, batch, max_pages, num_pages)
  k, k_s = _poison(k, k_s, bt, lengths, page_size)
  v, v_s = _poison(v, v_s, bt, lengths, page_size)
  bt = _pad_unused(bt, lengths, page_size)
  sc = lambda s: None if s is None else _dev(s)
  return (q, _cast(k, kv_dtype), _cast(v, kv_dtype), sc(k_s), sc(v_s),
          _dev(bt), _dev(lengths, np.int32))


def _seed(*case):
  """A seed per case, stable across processes (unlike hash())."""
  return zlib.crc32(repr(case).encode())


def _sample(cases, n, seed=0):
  """A fixed sample of n cases from a product, so every run is the same."""
  cases = list(cases)
  idx = np.random.default_rng(seed).choice(len(cases), size=min(n, len(cases)),
                                           replace=False)
  return [cases[i] for i in sorted(idx)]


# (kv_dtype, lengths-kind, num_splits, pages_per_block[, group]); seeds chosen
# so each sample covers both dtypes, all length kinds and split counts. Length kinds: one
# token, exact page boundaries, ragged with a long request.
_LENGTH_KINDS = ("one", "boundary", "ragged")
_MLA_CASES = _sample(itertools.product(("bf16", "fp8"), _LENGTH_KINDS, (1, 3), (1, 2)), 4, seed=0)
_GQA_CASES = _sample(
    itertools.product(("bf16", "fp8"), _LENGTH_KINDS, (1, 2), (1, 4), (1, 3, 4)), 5, seed=21)


def _lengths(kind, batch, page_size, max_pages):
  full = page_size * max_pages
  if kind == "one":
    return [1] * batch
  if kind == "boundary":
    return [page_size * (1 + b % max_pages) for b in range(batch)]
  # Full, ragged, and (with 3+ requests) an empty padded row: zeros out.
  lengths = [1 + (b * 37 + 5) % full if b else full for b in range(batch)]
  if batch >= 3:
    lengths[-1] = 0
  return lengths


@functools.partial(jax.jit, static_argnames="scale")
def _reference_e4m3_query(q_latent, q_rope, *rest, scale):
  """The reference given the heads-in-M kernel's e4m3 query (ops.fp8_query),
  dequantised; jitted, one compile where the eager ops took one each."""
  ql8, qr8, q_scale = attn_ops.fp8_query(q_latent, q_rope)
  deq = lambda x: x.astype(jnp.float32) * q_scale[..., None]  # noqa: E731
  return paged_mla_decode_reference(deq(ql8), deq(qr8), *rest, scale=scale)


@contextlib.contextmanager
def _late_producer(producer_wg, block_id=None, hold_s=0.3):
  """Holds a producer warpgroup back before each of its barrier waits, so that the
  compute warpgroups run as far ahead of it as the kernel lets them.

  Inside the context, before each wait of warpgroup ``producer_wg`` (of CTA
  ``block_id``; of every CTA where None), the interpreter waits until every
  lower-numbered warpgroup of that CTA has either finished the kernel or is blocked
  on a barrier phase that has not completed (they can go no further without the
  producer), or until ``hold_s`` seconds have passed (a compute warpgroup held up by
  something other than a barrier). Yields a list that gets one entry per held wait.
  """
  wait = shared_memory.Barrier.wait
  finished = shared_memory.GPUSharedMemory.kernel_thread_finished
  waiting = {}  # (id of the kernel's shared memory, (CTA, warpgroup)) -> (barrier, thread)
  # (the kernel's shared memory, (CTA, warpgroup)) of the threads that finished the kernel:
  # the memory itself, not its id, which a later kernel's may reuse once it is freed.
  done = []
  held = []

  def place(thread):
    return getattr(thread, "block_id", None), getattr(thread, "warpgroup_id", None)

  def cannot_go_on(memory, where):
    if any(m is memory and w == where for m, w in done):
      return True
    entry = waiting.get((id(memory), where))
    if entry is None:
      return False
    barrier, thread = entry
    # The interpreter's own test of a wait that has to block (shared_memory.Barrier._wait):
    # the thread last observed the barrier's current phase.
    return barrier.last_observed_phase_by_thread.get(thread, 0) == barrier.phase

  def held_wait(barrier, thread, *args, **kwargs):
    block, wg = where = place(thread)
    if wg is None or (block_id is not None and block != block_id):
      return wait(barrier, thread, *args, **kwargs)
    memory = barrier.shared_memory
    if wg == producer_wg:
      held.append(thread)
      deadline = time.monotonic() + hold_s
      while (time.monotonic() < deadline
             and not all(cannot_go_on(memory, (block, i)) for i in range(producer_wg))):
        time.sleep(0.001)
      return wait(barrier, thread, *args, **kwargs)
    waiting[id(memory), where] = (barrier, thread)
    try:
      return wait(barrier, thread, *args, **kwargs)
    finally:
      waiting.pop((id(memory), where), None)

  def thread_finished(memory, thread):
    done.append((memory, place(thread)))
    return finished(memory, thread)

  with mock.patch.object(shared_memory.Barrier, "wait", held_wait), \
       mock.patch.object(shared_memory.GPUSharedMemory, "kernel_thread_finished", thread_finished):
    yield held


def _mla_scale(c, r):
  return 1.0 / math.sqrt(c + r)


@functools.cache
def _mla_case(seed, kv_dtype, lengths, **dims):
  """make_mla's inputs for a case and the reference's output on them, made once: the
  heads- and tokens-in-M classes run their kernels on the same cases, and a
  staging-slot test's producer and compute warpgroups on the same inputs."""
  args = make_mla(seed, lengths=list(lengths), kv_dtype=kv_dtype, **dims)
  return args, paged_mla_decode_reference(*args, scale=_mla_scale(dims["c"], dims["r"]))


@functools.cache
def _mla_ref8(seed, kv_dtype, lengths, **dims):
  """The reference given the heads-in-M kernel's e4m3 query on ``_mla_case``'s inputs."""
  args, _ = _mla_case(seed, kv_dtype, lengths, **dims)
  return _reference_e4m3_query(*args, scale=_mla_scale(dims["c"], dims["r"]))


class OpTest(parameterized.TestCase):
  """One implementation of an op against the op's jnp reference, as tokamax's
  ``test_base`` runs each implementation of an op: a subclass per implementation
  (``IMPL``, the op's backend: "pallas" compiled, GPU only; "interpret" the same
  kernels in Pallas' interpreter; "xla" the op's XLA path) runs the same cases.

  The paged-attention ops have no "xla" subclasses: their XLA path is the
  reference itself, so it would be compared with itself."""

  IMPL = "pallas"
  # The op runs a Mosaic GPU kernel, whose interpreter detects races
  # (mgpu_shim.interpret_params): interpreted, a test also asserts none was found.
  MOSAIC_GPU = False

  def setUp(self):
    super().setUp()
    if self.IMPL == "pallas" and not ON_GPU:
      self.skipTest("compiled Pallas kernels need a GPU")
    # Every kernel's race record (tests/interpret_races.py): an MLA decode runs two.
    if self.IMPL == "interpret" and self.MOSAIC_GPU:
      self._races = keep_race_records(self)

  @property
  def backend(self):
    return self.IMPL

  def races_found(self):
    """Whether the interpreter found a data race in any interpreted Mosaic GPU kernel
    run since the last call (every kernel of the op); None where nothing is
    interpreted (no race to look for)."""
    if self.IMPL == "interpret" and self.MOSAIC_GPU:
      return self._races.races_found()
    return None

  def assert_matches(self, out, ref, tol, races=None):
    """out against ref: shape, every element written and finite, the relative-norm
    tolerance, and (an interpreted Mosaic GPU kernel) no data race: ``races`` as
    races_found() read right after the run that gave ``out`` (a run shared by
    several tests), or by default read now."""
    self.assertEqual(out.shape, ref.shape)
    self.assertTrue(np.isfinite(np.asarray(out, np.float32)).all(),
                    "non-finite or unwritten output")
    self.assertLessEqual(_rel_err(out, ref), tol)
    if self.IMPL == "interpret" and self.MOSAIC_GPU:
      if races is None:
        races = self.races_found()
      self.assertFalse(races, "data race")


class PagedMlaDecodeTest(OpTest):
  """Compiled kernel at realistic shapes (GPU only)."""

  # heads, latent, rope, page size, pages per request, batch
  SHAPE = dict(heads=128, c=512, r=64, page_size=64, max_pages=40, batch=4)

  @parameterized.parameters(*_MLA_CASES)
  def test_matches_reference(self, kv_dtype, length_kind, num_splits, ppb):
    s = self.SHAPE
    lengths = _lengths(length_kind, s["batch"], s["page_size"], s["max_pages"])
    args = make_mla(_seed(kv_dtype, length_kind, num_splits, ppb),
                    batch=s["batch"], heads=s["heads"], c=s["c"], r=s["r"],
                    page_size=s["page_size"], max_pages=s["max_pages"],
                    lengths=lengths, kv_dtype=kv_dtype)
    scale = 1.0 / math.sqrt(s["c"] + s["r"])
    bs = BlockSizes(block_h=64 if s["heads"] >= 64 else 16, pages_per_block=ppb,
                    num_splits=num_splits, impl="triton")
    out = paged_mla_decode(*args, scale=scale, backend=self.backend, block_sizes=bs)
    ref = paged_mla_decode_reference(*args, scale=scale)
    self.assertEqual(out.dtype, jnp.bfloat16)
    self.assert_matches(out, ref, TOL[kv_dtype])

  def test_default_block_sizes(self):
    s = self.SHAPE
    lengths = _lengths("ragged", s["batch"], s["page_size"], s["max_pages"])
    args = make_mla(7, batch=s["batch"], heads=s["heads"], c=s["c"], r=s["r"],
                    page_size=s["page_size"], max_pages=s["max_pages"],
                    lengths=lengths, kv_dtype="fp8")
    out = paged_mla_decode(*args, scale=0.05, backend=self.backend)
    ref = paged_mla_decode_reference(*args, scale=0.05)
    self.assert_matches(out, ref, TOL["fp8"])


  def test_rope_columns_read_in_place(self):
    """The query's rope part at block 2 of a wider array (NaN elsewhere): the kernel's
    BlockSpec reads it there, to the plain form's bits."""
    s = self.SHAPE
    lengths = _lengths("ragged", s["batch"], s["page_size"], s["max_pages"])
    args = make_mla(8, batch=s["batch"], heads=s["heads"], c=s["c"], r=s["r"],
                    page_size=s["page_size"], max_pages=s["max_pages"],
                    lengths=lengths, kv_dtype="bf16")
    bs = BlockSizes(block_h=64 if s["heads"] >= 64 else 16, impl="triton")
    q_rope = np.asarray(args[1], np.float32)
    wide = np.full(q_rope.shape[:2] + (3 * s["r"],), np.nan, np.float32)
    wide[..., 2 * s["r"]:] = q_rope
    out = paged_mla_decode(*args, scale=0.05, backend=self.backend, block_sizes=bs)
    out_wide = paged_mla_decode(args[0], _dev(wide, jnp.bfloat16), *args[2:], scale=0.05,
                                backend=self.backend, block_sizes=bs, rope_offset=2 * s["r"])
    np.testing.assert_array_equal(np.asarray(out_wide, np.float32), np.asarray(out, np.float32))
    with self.assertRaisesRegex(ValueError, "shape mismatch"):
      paged_mla_decode(args[0], args[1], *args[2:], scale=0.05, backend=self.backend,
                       rope_offset=1)


class PagedMlaDecodeInterpretTest(PagedMlaDecodeTest):
  IMPL = "interpret"
  # 20 heads: not a multiple of block_h, so head padding is exercised.
  SHAPE = dict(heads=20, c=64, r=16, page_size=8, max_pages=5, batch=3)


class PagedMlaDecodeMgpuTest(OpTest):
  """The Mosaic GPU MLA kernel with heads in wgmma's M (mla_mgpu: C % 128, 64-token
  pages, R % 64); GPU only."""

  MOSAIC_GPU = True
  MLA_M = "heads"
  SHAPE = dict(heads=128, c=512, r=64, page_size=64, max_pages=40, batch=4)

  def _check(self, seed, kv_dtype, **kwargs):
    """Runs the kernel (``_run``) and checks it (``_assert_run``)."""
    self._assert_run(self._run(seed, kv_dtype, **kwargs))

  def _run(self, seed, kv_dtype, *, mla_m=None, mla_qk="auto", loads="producer",
           lengths=None, length_kind="ragged", rope_offset=None, **shape):
    """Runs the kernel (mla_m, default the class's; mla_qk; loads) on make_mla inputs of
    SHAPE updated by ``shape``; returns what ``_assert_run`` checks: the output, the
    reference's (and where QK runs in fp8, the reference's given the kernel's e4m3
    query), whether the interpreter found a race, and with ``rope_offset`` the output
    with the query's rope part read from that column on of a wider array, NaN
    elsewhere (a decode step's query array), and that run's race flag."""
    s = dict(self.SHAPE, **shape)
    if lengths is None:
      lengths = _lengths(length_kind, s["batch"], s["page_size"], s["max_pages"])
    dims = {k: s[k] for k in ("batch", "heads", "c", "r", "page_size", "max_pages")}
    args, ref = _mla_case(seed, kv_dtype, tuple(lengths), **dims)
    scale = _mla_scale(s["c"], s["r"])
    bs = BlockSizes(impl="mgpu", mla_m=mla_m or self.MLA_M, mla_qk=mla_qk, loads=loads)
    run = dict(kv_dtype=kv_dtype, ref=ref, ref8=None, out_wide=None)
    run["out"] = paged_mla_decode(*args, scale=scale, backend=self.backend, block_sizes=bs)
    run["races"] = self.races_found()
    tokens = attn_ops.mla_tokens_in_m(bs, args[0], args[2], args[3])
    if attn_ops.mla_qk_fp8(bs, tokens, args[2]):
      run["ref8"] = _mla_ref8(seed, kv_dtype, tuple(lengths), **dims)
    if rope_offset is not None:
      q_rope = np.asarray(args[1], np.float32)
      wide = np.full(q_rope.shape[:2] + (rope_offset + q_rope.shape[2],), np.nan, np.float32)
      wide[..., rope_offset:] = q_rope
      run["out_wide"] = paged_mla_decode(args[0], _dev(wide, jnp.bfloat16), *args[2:],
                                         scale=scale, backend=self.backend, block_sizes=bs,
                                         rope_offset=rope_offset)
      run["races_wide"] = self.races_found()
    return run

  def _assert_run(self, run):
    """A ``_run``'s output against the reference: shape, every element written and
    finite, the tolerance, and (interpreted) no race. Where QK runs in fp8, also
    against the reference given the kernel's e4m3 query: then only the f32
    accumulation and bf16 roundings differ, so the bf16 tolerance, which the query's
    rounding alone would exceed. With a rope offset, the wide query's output has the
    same bits, and its run no race either."""
    out = run["out"]
    self.assert_matches(out, run["ref"], TOL[run["kv_dtype"]], races=run["races"])
    if run["ref8"] is not None:
      self.assertLessEqual(_rel_err(out, run["ref8"]), TOL["bf16"])
    if run["out_wide"] is not None:
      np.testing.assert_array_equal(np.asarray(run["out_wide"], np.float32),
                                    np.asarray(out, np.float32))
      if run["races_wide"] is not None:
        self.assertFalse(run["races_wide"], "data race")

  # The kernel runs a balanced schedule of pieces (schedule.schedule_pieces)
  # and ignores num_splits; "ragged" gives the long request several pieces.
  @parameterized.parameters(
      ("bf16", "ragged", "auto"), ("fp8", "boundary", "auto"), ("fp8", "one", "f16"))
  def test_matches_reference(self, kv_dtype, length_kind, mla_qk):
    # A bf16 cache's kernel reads the rope part in place at a column offset (a TMA box):
    # checked compiled for both kernels, interpreted for the tokens-in-M one (Kimi K2.6's).
    in_place = kv_dtype == "bf16" and (self.IMPL != "interpret" or self.MLA_M == "tokens")
    self._check(_seed("mgpu", kv_dtype, length_kind), kv_dtype, length_kind=length_kind,
                mla_qk=mla_qk, rope_offset=256 if in_place else None)

  def test_full_and_partial_head_blocks(self):
    # 72 heads: a full 64-row block and an 8-row one, each writing only its
    # real rows of the partials. Interpreted (CTAs run in turn), one request of
    # 150 tokens: 3 pages in two pieces, the second a partial page, beside an
    # unused piece, so both blocks run full, partial and empty pieces in 6 CTAs
    # where two "ragged" requests took 10; compiled, two "ragged" requests.
    if self.IMPL == "interpret":
      self._check(_seed("mgpu-72", "fp8"), "fp8", mla_m="heads", heads=72, batch=1,
                  lengths=[150])
    else:
      self._check(_seed("mgpu-72", "fp8"), "fp8", mla_m="heads", heads=72, batch=2)

  @parameterized.parameters(
      ("bf16", "auto", "producer"), ("fp8", "auto", "producer"), ("fp8", "f16", "producer"),
      ("bf16", "auto", "compute"), ("fp8", "auto", "compute"), ("fp8", "f16", "compute"))
  def test_long_pieces_cycle_the_staging_slots(self, kv_dtype, mla_qk, loads):
    """One piece per request, so a piece walks up to 5 pages, each staging slot
    refilled while another is computed on: heads in M, a bf16 cache's two latent
    slots and its rope buffer (refilled after every QK), an fp8 cache's two page
    slots and three scale slots (fp8 QK) or one staging buffer and two scale
    slots (f16 QK); tokens in M, two slots (bf16) or three (fp8). The gathers
    are issued by a producer warpgroup or by a compute warpgroup (loads). The
    last page is partial (its tail zeroed / masked). The producer cases run on time;
    test_a_late_producer_misses_no_phase runs the default QK's on the same inputs
    with its producer held back (_late_ring)."""
    if self.MLA_M == "tokens" and mla_qk == "f16":
      self.skipTest("the tokens-in-M kernel's QK is f16 either way: the 'auto' case runs it")
    one_piece_each = lambda batch, heads, max_pages, kind=None: batch  # noqa: E731
    with mock.patch.object(attn_ops, "mla_mgpu_pieces", one_piece_each):
      self._assert_run(self._run(_seed("ring", kv_dtype, mla_qk), kv_dtype, mla_qk=mla_qk,
                                 loads=loads, **self.RING))

  # The staging-slot tests' shape: one piece per request (mla_mgpu_pieces mocked), the
  # first walking 5 pages, its last partial. test_a_late_producer_misses_no_phase runs
  # the same kernels as the producer cases above, on the same inputs.
  RING = dict(lengths=[5 * 64 - 7, 2 * 64 + 1], batch=2, heads=20, c=256, r=64,
              page_size=64, max_pages=6)

  def _late_ring(self, kv_dtype):
    """The staging-slot test's producer case (default QK) on its inputs, with only the
    first CTA's producer warpgroup held back before each of its barrier waits
    (``_late_producer``; the second request's CTA runs on time): (``_run``'s result,
    how many waits were held)."""
    late = 2 if self.MLA_M == "heads" else 1  # the producer's warpgroup
    one_piece_each = lambda batch, heads, max_pages, kind=None: batch  # noqa: E731
    with mock.patch.object(attn_ops, "mla_mgpu_pieces", one_piece_each), \
         _late_producer(late, block_id=0) as held:
      run = self._run(_seed("ring", kv_dtype, "auto"), kv_dtype, **self.RING)
    return run, len(held)

  @parameterized.parameters("bf16", "fp8")
  def test_a_late_producer_misses_no_phase(self, kv_dtype):
    """The compute warpgroups may run two steps ahead of the producer (pages i and
    i+1 are in flight before it waits for step i-2's slot): a barrier that
    completes twice before its waiter looks is never seen to complete on an
    H200 (mbarrier waits test the phase's parity), so each slot has its own.
    Here the producer is held back before each wait until the compute warpgroups
    are blocked (``_late_ring``), so they run as far ahead as the slots let them;
    one free barrier for both slots fails (the interpreter raises on a missed
    phase). The tokens-in-M kernel's producer (warpgroup 1 of 2) is held to the same."""
    run, held = self._late_ring(kv_dtype)
    self._assert_run(run)
    self.assertGreaterEqual(held, 5, "the producer was not held back at every page")

  def test_too_few_interpreter_threads_raise_instead_of_hanging(self):
    """Three warpgroups hang the interpreter on a client with too few threads
    (1-3 CPU devices on 2 cores): the op refuses, and names the fixes."""
    if self.MLA_M == "tokens":
      self.skipTest("the tokens-in-M kernel's two warpgroups need no more threads")
    args = make_mla(4, batch=1, heads=20, c=256, r=64, page_size=64, max_pages=2,
                    lengths=[70], kv_dtype="bf16")
    one_cpu = [jax.devices("cpu")[0]]
    with mock.patch.object(mgpu_shim.os, "cpu_count", return_value=2), \
         mock.patch.object(mgpu_shim.jax, "devices", return_value=one_cpu):
      with self.assertRaisesRegex(RuntimeError, "xla_force_host_platform_device_count"):
        paged_mla_decode(*args, scale=0.1, backend="interpret",
                         block_sizes=BlockSizes(impl="mgpu", mla_m="heads"))
      # Two warpgroups need no more threads than that.
      mgpu_shim.check_interpret_threads(2)
    mgpu_shim.check_interpret_threads(3)  # this test process: 8 CPU devices

  def test_unsupported_shape_raises(self):
    args = make_mla(9, batch=1, heads=4, c=32, r=16, page_size=8, max_pages=2,
                    lengths=[3], kv_dtype="bf16")
    with self.assertRaisesRegex(ValueError, "mla_mgpu"):
      paged_mla_decode(*args, scale=1.0, backend="interpret",
                       block_sizes=BlockSizes(impl="mgpu"))


class PagedMlaDecodeMgpuInterpretTest(PagedMlaDecodeMgpuTest):
  IMPL = "interpret"
  # 20 heads pad to one 64-head block; 3 pages of 64 tokens. C = 256: each
  # warpgroup's 128 columns take two 64-column passes when a page is masked or
  # dequantised (bf16: two 64-wide tiles; fp8: two halves of one 128-wide tile).
  # Three requests: "ragged" is 3 pages (two pieces), 42 tokens and an empty
  # one (an empty piece), on a grid of 12 pieces of which 9 are unused.
  SHAPE = dict(heads=20, c=256, r=64, page_size=64, max_pages=3, batch=3)

class PagedMlaDecodeTokensMgpuTest(PagedMlaDecodeMgpuTest):
  """The Mosaic GPU MLA kernel with tokens in wgmma's M (mla_tokens_mgpu: at most
  32 heads, 64-token pages); GPU only. 8 heads: Kimi K2.6 under 8-way tensor
  parallelism."""

  MLA_M = "tokens"
  SHAPE = dict(heads=8, c=512, r=64, page_size=64, max_pages=40, batch=4)
  test_full_and_partial_head_blocks = None  # a heads-in-M case (64-row blocks)

  @parameterized.parameters((8, "fp8"), (32, "bf16"), (3, "fp8"))
  def test_head_counts(self, heads, kv_dtype):
    """N = 8 and the cap 32, and 3 heads padded to 8 (padding heads sliced off)."""
    self._check(_seed("tokens", kv_dtype, heads), kv_dtype, heads=heads, batch=2)

  def test_too_many_heads_raises(self):
    args = make_mla(10, batch=1, heads=40, c=256, r=64, page_size=64, max_pages=2,
                    lengths=[70], kv_dtype="bf16")
    with self.assertRaisesRegex(ValueError, "mla_tokens_mgpu needs at most 32 heads"):
      paged_mla_decode(*args, scale=1.0, backend="interpret",
                       block_sizes=BlockSizes(impl="mgpu", mla_m="tokens"))
    # 128-token pages: the kernel's M is one 64-token page.
    args = make_mla(11, batch=1, heads=8, c=256, r=64, page_size=128, max_pages=2,
                    lengths=[70], kv_dtype="bf16")
    with self.assertRaisesRegex(ValueError, "page_size=128"):
      paged_mla_decode(*args, scale=1.0, backend="interpret",
                       block_sizes=BlockSizes(impl="mgpu", mla_m="tokens"))

  def test_128_token_pages_take_triton(self):
    """No Mosaic GPU MLA kernel fits a 128-token page's staging in shared memory,
    so "auto" runs the Triton kernel there and "mgpu" refuses."""
    q = jax.ShapeDtypeStruct((2, 8, 512), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((4, 128, 512), jnp.bfloat16)
    rope = jax.ShapeDtypeStruct((4, 128, 64), jnp.bfloat16)
    tables = jax.ShapeDtypeStruct((2, 2), jnp.int32)
    _, impl = attn_ops.mla_kernel_choice(q, pages, rope, tables, BlockSizes())
    self.assertEqual(impl, "triton")
    with self.assertRaisesRegex(ValueError, "page_size == 64"):
      attn_ops.mla_kernel_choice(q, pages, rope, tables, BlockSizes(impl="mgpu"))

  def test_auto_picks_by_heads(self):
    pages = jax.ShapeDtypeStruct((4, 64, 512), jnp.bfloat16)
    rope = jax.ShapeDtypeStruct((4, 64, 64), jnp.bfloat16)
    auto = BlockSizes(impl="mgpu")
    for heads, tokens in ((8, True), (32, True), (33, False), (64, False)):
      q = jax.ShapeDtypeStruct((2, heads, 512), jnp.bfloat16)
      self.assertEqual(attn_ops.mla_tokens_in_m(auto, q, pages, rope), tokens, heads)
    q = jax.ShapeDtypeStruct((2, 8, 512), jnp.bfloat16)
    self.assertFalse(attn_ops.mla_tokens_in_m(BlockSizes(mla_m="heads"), q, pages, rope))
    with self.assertRaisesRegex(ValueError, "loads must be"):
      BlockSizes(loads="wg0")
    with self.assertRaisesRegex(ValueError, "gqa_loads must be"):
      BlockSizes(gqa_loads="wg0")
    with self.assertRaisesRegex(ValueError, "mla_m must be"):
      BlockSizes(mla_m="rows")

  def test_qk_dtype_choice(self):
    """fp8 QK: "auto" on an fp8 cache with heads in M only; "fp8" refused elsewhere."""
    fp8 = jax.ShapeDtypeStruct((4, 64, 512), FP8)
    bf16 = jax.ShapeDtypeStruct((4, 64, 512), jnp.bfloat16)
    for qk, tokens, pages, want in (("auto", False, fp8, True), ("auto", True, fp8, False),
                                    ("auto", False, bf16, False), ("f16", False, fp8, False),
                                    ("fp8", False, fp8, True)):
      self.assertEqual(attn_ops.mla_qk_fp8(BlockSizes(mla_qk=qk), tokens, pages), want,
                       (qk, tokens, pages.dtype))
    for tokens, pages in ((True, fp8), (False, bf16)):
      with self.assertRaisesRegex(ValueError, "mla_qk='fp8' needs an fp8 cache"):
        attn_ops.mla_qk_fp8(BlockSizes(mla_qk="fp8"), tokens, pages)
    with self.assertRaisesRegex(ValueError, "mla_qk must be"):
      BlockSizes(mla_qk="bf16")


class PagedMlaDecodeTokensMgpuInterpretTest(PagedMlaDecodeTokensMgpuTest):
  IMPL = "interpret"
  # 20 heads pad to N = 24; the rest as the heads-in-M interpret class.
  SHAPE = dict(heads=20, c=256, r=64, page_size=64, max_pages=3, batch=3)


class F16QueryTest(absltest.TestCase):
  """ops.f16_query: the fp8 cache's f16 query, rows divided by a power of two."""

  def test_rows_of_any_magnitude_round_trip(self):
    rng = np.random.default_rng(7)
    mags = np.array([1e-7, 1e-2, 1.0, 3e3, 1e6, 0.0], np.float32)  # 1e6 overflows f16
    ql = rng.standard_normal((2, 6, 64)).astype(np.float32) * mags[:, None]
    qr = rng.standard_normal((2, 6, 16)).astype(np.float32) * mags[:, None]
    ql[1, 2, 5] = 7e4  # the row's largest value sits in the rope-free part
    # Jitted, as the ops call it: one compile where the eager ops took one each.
    q16l, q16r, qs = jax.jit(attn_ops.f16_query)(_dev(ql), _dev(qr))
    self.assertEqual((q16l.dtype, q16r.dtype, qs.shape), (jnp.float16, jnp.float16, (2, 6)))
    q16 = np.concatenate([np.asarray(q16l, np.float32), np.asarray(q16r, np.float32)], -1)
    q = np.concatenate([ql, qr], -1)
    qs = np.asarray(qs)
    self.assertTrue(np.all(np.isfinite(q16)))
    self.assertTrue(np.all(np.log2(qs) == np.round(np.log2(qs))), "not powers of two")
    amax = np.abs(q16).max(-1)
    nonzero = np.abs(q).max(-1) > 0
    self.assertTrue(np.all((amax[nonzero] >= 2.0**13) & (amax[nonzero] < 2.0**14)))
    np.testing.assert_array_equal(qs[~nonzero], 1.0)
    # f16 keeps 11 significant bits of each element, relative to the row's largest.
    err = np.abs(q16 * qs[..., None] - q).max(-1)
    np.testing.assert_array_less(err, np.abs(q).max(-1) * 2.0**-11 + 1e-30)


class Fp8QueryTest(absltest.TestCase):
  """ops.fp8_query: the e4m3 query of the heads-in-M kernel's fp8 QK."""

  def test_rows_of_any_magnitude_round_trip(self):
    rng = np.random.default_rng(8)
    mags = np.array([1e-7, 1e-2, 1.0, 3e3, 1e6, 0.0], np.float32)
    ql = rng.standard_normal((2, 6, 64)).astype(np.float32) * mags[:, None]
    qr = rng.standard_normal((2, 6, 16)).astype(np.float32) * mags[:, None]
    qr[1, 2, 5] = 7e4  # the row's largest value sits in the rope part
    q8l, q8r, qs = jax.jit(attn_ops.fp8_query)(_dev(ql), _dev(qr))
    self.assertEqual((q8l.dtype, q8r.dtype, qs.shape), (FP8, FP8, (2, 6)))
    q8 = np.concatenate([np.asarray(q8l, np.float32), np.asarray(q8r, np.float32)], -1)
    q = np.concatenate([ql, qr], -1)
    qs = np.asarray(qs)
    self.assertTrue(np.all(np.isfinite(q8)), "e4m3 overflowed to NaN")
    nonzero = np.abs(q).max(-1) > 0
    # Each row's largest |value| maps to e4m3's largest, 448.
    np.testing.assert_array_equal(np.abs(q8).max(-1)[nonzero], 448.0)
    np.testing.assert_array_equal(qs[~nonzero], 1.0)
    # 4 significant bits (half an ulp: 2^-4 relative) down to e4m3's smallest
    # normal, 2^-6 in the scaled row; below it, half a subnormal step, 2^-10.
    err = np.abs(q8 * qs[..., None] - q)
    bound = np.abs(q) * 2.0**-4 + qs[..., None] * 2.0**-10
    np.testing.assert_array_less(err, bound * (1 + 1e-6) + 1e-30)


class MlaBenchPeersTest(absltest.TestCase):
  """gpu_check's MLA case at 64 heads on an fp8 cache (interpreted, small): the engine's
  kernel with fp8 QK, and its f16-QK twin as a peer, both checked (smoke mode's
  shrunken shapes run neither)."""

  def test_fp8_qk_and_its_f16_twin(self):
    from pallas_kernels import targets as kt
    from pallas_kernels.paged_attention import bench as attn_bench
    case = [c for c in kt.target_cases(("paged_mla_decode",))
            if c.name == "mla/dp/fp8/b8/ctx32768"][0]
    dims = dict(case.d, batch=1, c=256, context=128, max_pages=2, num_pages=4)
    b = attn_bench.bench_case("paged_mla_decode", dims, backend="interpret", peers=True)
    self.assertEqual((b.info["mla_m"], b.info["mla_qk"]), ("heads", "fp8"))
    impls = {i.name: i for i in b.impls}
    # The same kernel merged by XLA (tests/test_merge_pieces_kernel.py runs that merge).
    self.assertEqual(impls["pallas_mgpu_xla_merge"].fn.keywords["block_sizes"].merge, "xla")
    # The same kernel without its producer warpgroup (the interpret tests run both).
    self.assertEqual(impls["pallas_mgpu_compute_loads"].fn.keywords["block_sizes"].loads,
                     "compute")
    self.assertEqual(impls["pallas"].fn.keywords["block_sizes"], None)  # the default: producer
    err = {}
    for name in ("pallas", "pallas_mgpu_f16qk", "pallas_mgpu_compute_loads"):
      out = np.asarray(impls[name].fn(*impls[name].args()[0]), np.float32)
      err[name] = _rel_err(out, impls[name].expected())
    self.assertLessEqual(err["pallas"], TOL["fp8"])
    # Who issues the gathers changes no arithmetic.
    self.assertEqual(err["pallas_mgpu_compute_loads"], err["pallas"])
    # The e4m3 query's rounding shows beside the f16 query's.
    self.assertLess(err["pallas_mgpu_f16qk"], err["pallas"] / 4)


class GqaBenchPeersTest(absltest.TestCase):
  """gpu_check's GQA case (interpreted, small): the two-CTA default kernel and its
  producer twin (one CTA per SM, four slots), both checked against the reference."""

  def test_producer_twin(self):
    from pallas_kernels import targets as kt
    from pallas_kernels.paged_attention import bench as attn_bench
    case = [c for c in kt.target_cases(("paged_gqa_decode",))
            if c.name == "gqa/g4/bf16/b64/ctx4096"][0]
    dims = dict(case.d, batch=1, kv_heads=1, head_dim=64, context=300, max_pages=20,
                num_pages=24)
    b = attn_bench.bench_case("paged_gqa_decode", dims, backend="interpret", peers=True)
    impls = {i.name: i for i in b.impls}
    self.assertEqual(impls["pallas_mgpu_producer"].fn.keywords["block_sizes"].gqa_loads,
                     "producer")
    self.assertIsNone(impls["pallas"].fn.keywords["block_sizes"])  # the default: compute
    for name in ("pallas", "pallas_mgpu_producer"):
      out = np.asarray(impls[name].fn(*impls[name].args()[0]), np.float32)
      self.assertLessEqual(_rel_err(out, impls[name].expected()), TOL["bf16"], name)


class QkErrorScriptTest(absltest.TestCase):
  """scripts/mla_qk_error.py: the e4m3 query's cost, measured with the references."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "mla_qk_error.py")
    spec = importlib.util.spec_from_file_location("mla_qk_error", path)
    cls.script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cls.script)

  def test_rows_order_the_roundings(self):
    rows = self.script.measure(batch=2, heads=8, context=128)
    self.assertLen(rows, 2 * len(self.script.QUERY_SCALES))
    for r in rows:
      # bf16 rounding is far below e4m3's; the e4m3 query changes the output.
      self.assertLess(r["bf16_cache"], r["fp8_cache"] / 2, r)
      self.assertGreater(r["e4m3_query_vs_fp8_cache"], r["bf16_cache"], r)
    normal = [r for r in rows if r["data"] == "normal"]
    self.assertTrue(all(r["fp8_cache_e4m3_query"] > r["fp8_cache"] for r in normal), normal)

  def test_bad_context_is_refused(self):
    with self.assertRaises(SystemExit):
      self.script.main(["--context", "100"])


class PieceScheduleTest(parameterized.TestCase):
  """The attention kernels' balanced schedule and the merge of its pieces (plain jnp)."""

  @parameterized.parameters((1, 128, 132), (1, 2048, 132), (64, 2048, 132), (3, 5, 132),
                            (200, 64, 132), (8, 40, 16), (4, 1, 132))
  def test_pieces_cover_each_request_once_and_balance(self, batch, max_pages, sms):
    rng = np.random.default_rng(batch * 7 + max_pages)
    g = schedule.num_pieces(batch, max_pages, sms)
    for trial in range(10):
      pages = rng.integers(0, max_pages + 1, batch)
      if trial == 0:
        pages[:] = 0
      if trial == 1:
        pages[:] = max_pages
      if trial == 2:
        pages[:] = 0
        pages[0] = max_pages  # one long request among empty ones
      lengths = np.maximum(pages * 64 - rng.integers(0, 64, batch), 0)
      pages = -(-lengths // 64)
      req, first, steps, req_first, req_count = np.asarray(schedule.schedule_pieces(
          _dev(lengths, np.int32), page_size=64, max_pages=max_pages, pieces=g))
      used = req >= 0
      # Per request: its run of pieces (the merge reads these), zeros past the batch.
      for b in range(batch):
        np.testing.assert_array_equal(np.flatnonzero(req == b),
                                      req_first[b] + np.arange(req_count[b]))
      self.assertTrue((req_first[batch:] == 0).all() and (req_count[batch:] == 0).all())
      self.assertTrue((np.diff(req[used]) >= 0).all())  # ordered by request
      self.assertTrue((req[~used] == -1).all() and (steps[~used] == 0).all())
      q = steps.max()
      for b in range(batch):
        mine = req == b
        self.assertGreaterEqual(mine.sum(), 1, "every request has a piece")
        covered = np.concatenate([np.arange(f, f + s) for f, s in
                                  zip(first[mine], steps[mine])] or [[]])
        np.testing.assert_array_equal(covered, np.arange(pages[b]))
      self.assertLessEqual(used.sum(), g)
      if pages.sum() and q > schedule.MIN_PAGES_PER_PIECE:
        # Pieces of one size q (a request's last one shorter), q the smallest that fits.
        self.assertTrue(all(steps[req == b].max() == q for b in range(batch)
                            if pages[b] >= q))
        self.assertGreater(sum(max(1, -(-p // (q - 1))) for p in pages), g)
      if trial == 2 and max_pages >= 2 * sms:
        self.assertGreaterEqual(used.sum(), sms // 2, "one long request fills the grid")
      if trial == 1 and g < sms:
        # Fewer pieces than the SMs only when all full requests use all but one.
        self.assertGreaterEqual(used.sum(), g - 1, "pieces no schedule can use")

  def test_combine_pieces_matches_one_softmax(self):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(7, 4)) * 3  # [T, H]: 7 tokens, 4 heads
    v = rng.normal(size=(7, 4, 5))  # [T, H, D]
    want = np.einsum("TH,THD->HD", np.exp(logits) / np.exp(logits).sum(0), v)
    cuts = [(0, 3), (3, 5), (5, 7)]  # request 0 in three pieces, request 1 empty
    o, lse = [], []
    for a, z in cuts:
      p = np.exp(logits[a:z])
      o.append(np.einsum("TH,THD->HD", p / p.sum(0), v[a:z]))
      lse.append(np.log(p.sum(0)))
    o.append(np.zeros((4, 5)))  # the empty request's empty piece
    lse.append(np.full(4, -1e30))
    o.append(np.full((4, 5), 7.0))  # an unused piece: ignored
    lse.append(np.zeros(4))
    # Jitted, as the ops call it: one compile where the eager ops took one each.
    combine = jax.jit(reference.combine_pieces, static_argnums=3)
    out = np.asarray(combine(_dev(np.stack(o), np.float32), _dev(np.stack(lse), np.float32),
                             _dev([0, 0, 0, 1, -1], np.int32), 2))
    np.testing.assert_allclose(out[0], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out[1], 0)


class PagedGqaDecodeTest(OpTest):
  """Compiled kernel at realistic shapes (GPU only)."""

  SHAPE = dict(kv_heads=8, hd=128, page_size=16, max_pages=64, batch=4)

  @parameterized.parameters(*_GQA_CASES)
  def test_matches_reference(self, kv_dtype, length_kind, num_splits, ppb, group):
    s = self.SHAPE
    lengths = _lengths(length_kind, s["batch"], s["page_size"], s["max_pages"])
    args = make_gqa(_seed(kv_dtype, length_kind, num_splits, ppb, group),
                    batch=s["batch"], heads=s["kv_heads"] * group,
                    kv_heads=s["kv_heads"], hd=s["hd"], page_size=s["page_size"],
                    max_pages=s["max_pages"], lengths=lengths, kv_dtype=kv_dtype)
    scale = 1.0 / math.sqrt(s["hd"])
    bs = BlockSizes(block_h=16, pages_per_block=ppb, num_splits=num_splits,
                    impl="triton")
    out = paged_gqa_decode(*args, scale=scale, backend=self.backend, block_sizes=bs)
    ref = paged_gqa_decode_reference(*args, scale=scale)
    self.assert_matches(out, ref, TOL[kv_dtype])


class PagedGqaDecodeInterpretTest(PagedGqaDecodeTest):
  IMPL = "interpret"
  SHAPE = dict(kv_heads=2, hd=32, page_size=4, max_pages=6, batch=3)


class PagedGqaDecodeMgpuTest(OpTest):
  """The Mosaic GPU GQA kernel (head_dim % 64, 64 % page, fp8: KV % 8); GPU only."""

  MOSAIC_GPU = True
  SHAPE = dict(kv_heads=8, hd=128, page_size=16, max_pages=64, batch=4)

  # The kernel runs the balanced schedule of pieces and ignores num_splits.
  # The last case's query is 1e5 times larger (its scale as much smaller): past
  # f16's range, which the kernel's f16 query keeps to through its row factors.
  @parameterized.parameters(("bf16", "one", 1, 1.0), ("fp8", "ragged", 16, 1.0),
                            ("fp8", "boundary", 4, 1e5))
  def test_matches_reference(self, kv_dtype, length_kind, group, q_mul):
    s = self.shape(kv_dtype)
    lengths = _lengths(length_kind, s["batch"], s["page_size"], s["max_pages"])
    args = make_gqa(_seed("mgpu", kv_dtype, length_kind, group),
                    batch=s["batch"], heads=s["kv_heads"] * group,
                    kv_heads=s["kv_heads"], hd=s["hd"], page_size=s["page_size"],
                    max_pages=s["max_pages"], lengths=lengths, kv_dtype=kv_dtype)
    args = (_dev(np.asarray(args[0], np.float32) * q_mul, args[0].dtype), *args[1:])
    scale = 1.0 / math.sqrt(s["hd"]) / q_mul
    out = paged_gqa_decode(*args, scale=scale, backend=self.backend,
                           block_sizes=BlockSizes(impl="mgpu"))
    ref = paged_gqa_decode_reference(*args, scale=scale)
    self.assert_matches(out, ref, TOL[kv_dtype])

  def shape(self, kv_dtype):
    """SHAPE, for a case on a ``kv_dtype`` cache."""
    del kv_dtype
    return self.SHAPE


# KV heads of the interpreted bf16 cases: the kernel runs one CTA per (KV head, piece),
# which the interpreter runs in turn, so 2 (each CTA still picks its head out of every
# page) instead of the fp8 cases' 8 (an fp8 cache's [page, KV] scale rows need KV % 8).
INTERPRET_BF16_KV_HEADS = 2


_GQA_RING_SCALE = 1.0 / math.sqrt(64)


@functools.cache
def _gqa_ring_case(kv_dtype, blocks, kv_heads, lengths):
  """The GQA staging-slot inputs (head_dim 64, 16-token pages, ``blocks`` 64-token
  blocks per request, twice as many query heads as KV heads) and the reference's
  output on them, made once: the compute and producer warpgroups' cases run on the
  same inputs."""
  args = make_gqa(_seed("ring", kv_dtype, blocks, kv_heads, lengths), batch=len(lengths),
                  heads=2 * kv_heads, kv_heads=kv_heads, hd=64, page_size=16,
                  max_pages=4 * blocks, lengths=list(lengths), kv_dtype=kv_dtype)
  return args, paged_gqa_decode_reference(*args, scale=_GQA_RING_SCALE)


class PagedGqaDecodeMgpuInterpretTest(PagedGqaDecodeMgpuTest):
  IMPL = "interpret"
  # 12 pages of 16 tokens = 3 of the kernel's 64-token blocks: "ragged" gives
  # the first request two pieces (2 blocks, then 1). 8 KV heads on an fp8 cache,
  # INTERPRET_BF16_KV_HEADS on a bf16 one.
  SHAPE = dict(kv_heads=8, hd=64, page_size=16, max_pages=12, batch=2)

  def shape(self, kv_dtype):
    if kv_dtype == "fp8":
      return self.SHAPE
    return dict(self.SHAPE, kv_heads=INTERPRET_BF16_KV_HEADS)

  def _ring(self, kv_dtype, gqa_loads, blocks, kv_heads=None, lengths=None):
    """One piece per request, the first walking ``blocks`` 64-token blocks (its last
    partial, its tail zeroed), against the reference, with race detection; by default
    on the class's KV heads for ``kv_dtype`` (``shape``)."""
    kv_heads = kv_heads or self.shape(kv_dtype)["kv_heads"]
    lengths = tuple(lengths or [blocks * 64 - 7, 2 * 64 + 1])
    args, ref = _gqa_ring_case(kv_dtype, blocks, kv_heads, lengths)
    one_piece_each = lambda batch, kv_heads, blocks, kind=None, ctas_per_sm=2: batch  # noqa: E731
    with mock.patch.object(attn_ops, "gqa_mgpu_pieces", one_piece_each):
      out = paged_gqa_decode(*args, scale=_GQA_RING_SCALE, backend=self.backend,
                             block_sizes=BlockSizes(impl="mgpu", gqa_loads=gqa_loads))
    self.assert_matches(out, ref, TOL[kv_dtype])

  @parameterized.parameters(("bf16", "compute"), ("fp8", "compute"),
                            ("bf16", "producer"), ("fp8", "producer"))
  def test_long_pieces_cycle_the_staging_slots(self, kv_dtype, gqa_loads):
    """A piece of 5 blocks: the two slots of a compute warpgroup issuing are each
    refilled while the other is computed on, twice over; a producer's four slots
    have one refilled."""
    self._ring(kv_dtype, gqa_loads, blocks=5)

  def test_a_late_producer_misses_no_phase(self):
    """The GQA producer (gqa_loads="producer") is held back before each of its waits
    (``_late_producer``), so the compute warpgroup runs as far ahead as the four slots
    let it: one free barrier for all slots fails (see the MLA kernel's test of the
    same name)."""
    with _late_producer(1) as held:
      # One CTA (one request, one KV head).
      self._ring("bf16", "producer", blocks=7, kv_heads=1, lengths=[7 * 64 - 7])
    self.assertGreaterEqual(len(held), 5, "the producer was not held back at every block")


class ReferenceTest(parameterized.TestCase):
  """The references themselves, against a dense per-request softmax."""

  def test_mla_reference_matches_dense(self):
    args = make_mla(3, batch=2, heads=4, c=16, r=8, page_size=4, max_pages=3,
                    lengths=[5, 12], kv_dtype="fp8")
    ref = np.asarray(paged_mla_decode_reference(*args, scale=0.3), np.float32)
    q_lat, q_rope, lat, rope, lat_s, rope_s, bt, lengths = [
        np.asarray(a, np.float32) if a.dtype != jnp.int32 else np.asarray(a) for a in args]
    for b in range(2):
      n = int(lengths[b])
      toks = [(int(bt[b, t // 4]), t % 4) for t in range(n)]
      l = np.stack([lat[p, s] * lat_s[p, s] for p, s in toks])
      kr = np.stack([rope[p, s] * rope_s[p, s] for p, s in toks])
      logits = 0.3 * (q_lat[b] @ l.T + q_rope[b] @ kr.T)
      p = np.exp(logits - logits.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      np.testing.assert_allclose(ref[b], p @ l, rtol=1e-2, atol=1e-2)

  def test_unknown_backend_raises(self):
    args = make_gqa(4, batch=1, heads=2, kv_heads=1, hd=16, page_size=4,
                    max_pages=2, lengths=[3], kv_dtype="bf16")
    with self.assertRaisesRegex(ValueError, "backend"):
      paged_gqa_decode(*args, scale=1.0, backend="cuda")

  def test_scales_required_for_fp8(self):
    args = list(make_mla(5, batch=1, heads=2, c=16, r=8, page_size=4,
                         max_pages=2, lengths=[3], kv_dtype="fp8"))
    args[4] = None
    with self.assertRaisesRegex(ValueError, "scales"):
      paged_mla_decode(*args, scale=1.0, backend="xla")


if __name__ == "__main__":
  absltest.main()
