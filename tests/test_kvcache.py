"""Paged KV storage: fp8 quantisation, write/read paths, reference attention, tag check, bad input."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl.testing import absltest, parameterized

from configs import TINY_GQA, TINY_MLA
from mlkit import kvcache as kvc
from mlkit.model.attention import gqa_attention, mla_latent_attention

# One layer keeps every test fast; layer indexing is covered by the model tests.
MLA1 = dataclasses.replace(TINY_MLA, n_layers=1, first_k_dense=1)
GQA1 = dataclasses.replace(TINY_GQA, n_layers=1, first_k_dense=1)
CFGS = {"mla": MLA1, "gqa": GQA1}
# Jitted references: one compile each instead of op-by-op dispatch.
MLA_PREFILL = jax.jit(kvc.paged_mla_prefill_reference, static_argnames="scale")
MLA_DECODE = jax.jit(kvc.paged_mla_decode_reference, static_argnames="scale")
GQA_PREFILL = jax.jit(kvc.paged_gqa_prefill_reference, static_argnames="scale")
GQA_DECODE = jax.jit(kvc.paged_gqa_decode_reference, static_argnames="scale")
READ = jax.jit(kvc.read_layer, static_argnums=1, static_argnames="dtype")
# What an fp8 page stores for each token, dequantised (per-token scales: tokens are independent).
FP8_ROUND_TRIP = jax.jit(lambda x: kvc.dequantize_fp8(*kvc.quantize_fp8(x)))
TOL = {"float32": 1e-6, "bfloat16": 1e-2}
FP8_TOL = 5e-2


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def device(a, dtype=None):
  """A host array placed on the device as ``dtype``: cast by numpy and placed by device_put, no
  XLA program (jnp.asarray compiles a `stage` program per shape and dtype; an eager cast, fill
  or scatter one per op and shape)."""
  return jax.device_put(np.asarray(a, dtype))


def positions(B, T, start=0):
  """[B, T] int32 positions start..start+T-1 for every row, on the device."""
  return device(np.broadcast_to(np.arange(start, start + T, dtype=np.int32), (B, T)))


def make_batch(lengths, page_size, num_pages, max_pages, seed=0):
  """BatchMeta with each request on distinct, scrambled pages (PAD_PAGE past its pages)."""
  rng = np.random.default_rng(seed)
  perm = rng.permutation(num_pages)
  bt = np.full((len(lengths), max_pages), kvc.PAD_PAGE, np.int32)
  k = 0
  for b, n in enumerate(lengths):
    need = -(-n // page_size)
    bt[b, :need] = perm[k:k + need]
    k += need
  return kvc.BatchMeta(block_tables=device(bt), lengths=device(lengths, np.int32),
                       expected_tags=device(np.zeros(bt.shape, np.int32)), page_size=page_size)


def randn_np(seed, shape, scale=1.0) -> np.ndarray:
  """Fresh normal f32 data from numpy, on host."""
  return np.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, np.float32)


def randn(seed, shape, scale=1.0, dtype=np.float32):
  """Fresh normal data from numpy, cast on host and placed on the device (no per-shape XLA
  compiles for the generator or the cast)."""
  return device(randn_np(seed, shape, scale), dtype)


def random_entries(cfg, B, T, seed, dtype=np.float32):
  return {name: randn(seed + i, (B, T) + shp, dtype=dtype)
          for i, (name, shp) in enumerate(kvc.state.entry_shapes(cfg).items())}


class Fp8Test(parameterized.TestCase):

  @parameterized.parameters("float32", "bfloat16")
  def test_random_error_within_tolerance(self, src_dtype):
    x = randn(0, (64, 4, 128), 3.0, dtype=jnp.dtype(src_dtype))
    q, s = kvc.quantize_fp8(x)
    self.assertEqual(q.dtype, jnp.float8_e4m3fn)
    self.assertEqual(s.shape, (64, 4))
    y = kvc.dequantize_fp8(q, s)
    err = rel_err(y, np.asarray(x, np.float32))
    self.assertTrue(np.all(np.isfinite(np.asarray(y))))
    self.assertLessEqual(err, FP8_TOL)
    self.assertGreater(err, 1e-3)  # it really is 3-bit-mantissa storage

  def test_per_token_scale_is_absmax_over_448(self):
    x = randn_np(1, (8, 32)) * np.logspace(-3, 3, 8, dtype=np.float32)[:, None]  # f32
    _, s = kvc.quantize_fp8(device(x))
    np.testing.assert_allclose(s, np.abs(x).max(-1) / 448.0, rtol=1e-6)

  def test_exact_for_e4m3_values(self):
    rng = np.random.default_rng(0)
    # Random finite e4m3 values, each row holding +-448 so its scale is a power of two.
    bits = rng.integers(0, 256, size=(16, 32)).astype(np.uint8)
    vals = bits.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    vals = np.where(np.isfinite(vals), vals, 1.0)
    vals[:, 0] = 448.0 * rng.choice([-1, 1], size=16)
    x = vals * (2.0 ** rng.integers(-8, 8, size=(16, 1)))
    q, s = kvc.quantize_fp8(device(x, np.float32))
    np.testing.assert_array_equal(np.asarray(kvc.dequantize_fp8(q, s)), x)

  def test_zero_token_guard(self):
    q, s = kvc.quantize_fp8(device(np.zeros((3, 16), np.float32)))
    np.testing.assert_array_equal(np.asarray(s), 1.0)
    np.testing.assert_array_equal(np.asarray(kvc.dequantize_fp8(q, s)), 0.0)

  def test_many_equals_one_by_one(self):
    # One reduction for several arrays (a layer's write) gives quantize_fp8's bits: MLA's
    # latent and rope key (different widths, one all-zero token), GQA's K and V (one
    # width, bf16), and arrays whose leading shapes differ (quantised one by one).
    from mlkit.kvcache.fp8 import quantize_fp8_many
    rng = np.random.default_rng(5)
    latent = rng.standard_normal((2, 3, 32)).astype(np.float32) * 7
    rope = rng.standard_normal((2, 3, 8)).astype(np.float32) * 1e-3
    latent[1, 2] = 0.0
    k, v = (device(rng.standard_normal((2, 3, 2, 16)), jnp.bfloat16) for _ in range(2))
    # Both jitted: op by op, each quantisation compiled a program per op and shape.
    one = jax.jit(kvc.quantize_fp8)
    outs = []
    for xs in ([latent, rope], [k, v], [latent, rng.standard_normal((4, 8)).astype(np.float32)]):
      many = jax.jit(quantize_fp8_many)([device(x) for x in xs])
      outs.append(many)
      self.assertLen(many, len(xs))
      for x, (q, s) in zip(xs, many):
        q1, s1 = one(device(x))
        self.assertEqual(q.dtype, q1.dtype)
        np.testing.assert_array_equal(np.asarray(s), np.asarray(s1))
        np.testing.assert_array_equal(np.asarray(q).view(np.uint8), np.asarray(q1).view(np.uint8))
    _, s = outs[0][0]  # the latent's
    self.assertEqual(float(np.asarray(s)[1, 2]), 1.0)  # the all-zero token keeps scale 1


class WriteReadTest(parameterized.TestCase):

  @parameterized.product(attn=["mla", "gqa"], dtype=["float32", "bfloat16", "float8_e4m3fn"])
  def test_prefill_then_decode_round_trip(self, attn, dtype):
    cfg = CFGS[attn]
    P, N, M, T = 4, 12, 3, 6
    kv_cfg = kvc.KVCacheConfig(num_pages=N, page_size=P, dtype=dtype)
    state = kvc.init_paged_state(cfg, kv_cfg)
    # Sentinel contents, so a stray write to any slot is visible (filled on the host: an eager
    # fill compiles a program per shape).
    state = state.replace(layers=[{k: device(np.full(v.shape, 7, v.dtype)) for k, v in l.items()}
                                  for l in state.layers])
    lengths = [6, 1, 4]  # a chunk of T=6 with ragged valid prefixes; 4 = a page boundary
    meta = make_batch([7, 2, 5], P, N, M)  # room for one decode token each
    meta_pf = meta.replace(lengths=device(lengths, np.int32))
    new = random_entries(cfg, 3, T, seed=1)
    pos = positions(3, T)
    old_leaf = state.layers[0][state.names[0]]
    state = kvc.write_prefill(state, [new], pos, meta_pf, kv_cfg=kv_cfg)
    self.assertTrue(old_leaf.is_deleted())  # the jitted write donated the state
    dec = {k: np.asarray(v) for k, v in random_entries(cfg, 3, 1, seed=2).items()}
    state = kvc.write_decode(state, [{k: device(v[:, 0]) for k, v in dec.items()}], meta,
                             kv_cfg=kv_cfg)
    view = READ(state, 0, meta)
    for name in state.names:
      got = np.asarray(view[name])
      both = np.concatenate([np.asarray(new[name]), dec[name]], axis=1)  # [B, T + 1, ...]
      if dtype == "float8_e4m3fn":
        stored = np.asarray(FP8_ROUND_TRIP(device(both)))  # exactly what was stored
      else:
        stored = both.astype(jnp.dtype(dtype)).astype(np.float32)  # round to nearest even
      for b, L in enumerate(lengths):
        rows = np.r_[0:L, T]  # the prefix written by prefill, then the decode token
        if dtype == "float8_e4m3fn":
          self.assertLessEqual(rel_err(got[b, :L + 1], both[b, rows]), FP8_TOL)
        np.testing.assert_array_equal(got[b, :L + 1], stored[b, rows])
        np.testing.assert_array_equal(got[b, L + 1:], 0.0)  # masked past the length
      # Slots no valid token maps to still hold the sentinel.
      pages = np.asarray(state.layers[0][name]).astype(np.float32)
      touched = np.zeros(pages.shape[:2], bool)
      bt = np.asarray(meta.block_tables)
      for b, L in enumerate(lengths):
        for p in range(L + 1):
          touched[bt[b, p // P], p % P] = True
      np.testing.assert_array_equal(pages[~touched], 7.0)

  def test_bf16_entries_into_fp8_pool(self):
    # The decode pool's case: a bf16 model writing to fp8 pages and reading bf16 back.
    kv_cfg = kvc.KVCacheConfig(num_pages=4, page_size=4, dtype="float8_e4m3fn")
    state = kvc.init_paged_state(MLA1, kv_cfg)
    meta = make_batch([7, 3], 4, 4, 2)
    # f32 draws rounded to bf16 on host.
    new = random_entries(MLA1, 2, 7, seed=4, dtype=jnp.bfloat16)
    pos = positions(2, 7)
    state = kvc.write_prefill(state, [new], pos, meta, kv_cfg=kv_cfg)
    view = READ(state, 0, meta, dtype=jnp.bfloat16)
    for name in state.names:
      self.assertEqual(view[name].dtype, jnp.bfloat16)
      view_np, new_np = np.asarray(view[name], np.float32), np.asarray(new[name], np.float32)
      got = np.concatenate([view_np[0, :7], view_np[1, :3]])
      want = np.concatenate([new_np[0], new_np[1, :3]])
      self.assertLessEqual(rel_err(got, want), FP8_TOL)

  def test_copy_pages(self):
    kv_cfg = kvc.KVCacheConfig(num_pages=4, page_size=2, dtype="float8_e4m3fn")
    state = kvc.init_paged_state(MLA1, kv_cfg)
    meta = make_batch([2], 2, 4, 1)
    state = kvc.write_prefill(state, [random_entries(MLA1, 1, 2, 3)],
                              positions(1, 2), meta)
    src = int(np.asarray(meta.block_tables)[0, 0])
    dst = (src + 1) % 4
    state = kvc.copy_pages(state, [(src, dst)])
    for k, v in state.layers[0].items():
      v = np.asarray(v).astype(np.float32)
      np.testing.assert_array_equal(v[dst], v[src])
    with self.assertRaisesRegex(ValueError, "outside the pool"):
      kvc.copy_pages(state, [(0, 4)])

  def test_copy_pages_moves_only_the_named_pages_one_program_per_bucket(self):
    # Every page of an fp8 pool (values and scales) holds its own random contents; each batch
    # of copies lands its sources on its destinations, and nothing else changes, padding
    # included. 1 to 5 copies share one padded program; 9 take the next bucket.
    from mlkit.kvcache import state as state_lib
    kv_cfg = kvc.KVCacheConfig(num_pages=12, page_size=2, dtype="float8_e4m3fn")
    empty = kvc.init_paged_state(MLA1, kv_cfg)
    rng = np.random.default_rng(3)
    layers = [{k: device(rng.normal(size=v.shape).astype(np.float32), v.dtype)
               for k, v in layer.items()} for layer in empty.layers]
    state = empty.replace(layers=layers)
    compiled = state_lib._copy_pages_jit._cache_size()
    for copies in ([(0, 5)], [(3, 7), (9, 2)], [(1, 4), (6, 11), (10, 8), (11, 0), (2, 1)],
                   [(s, (s + 3) % 12) for s in range(9)]):
      before = [{k: np.asarray(v).astype(np.float32) for k, v in layer.items()}
                for layer in state.layers]
      state = kvc.copy_pages(state, copies)
      want = [{k: v.copy() for k, v in layer.items()} for layer in before]
      for w, b in zip(want, before):
        for k in w:
          for src, dst in copies:
            w[k][dst] = b[k][src]
      for w, layer in zip(want, state.layers):
        for k, v in layer.items():
          np.testing.assert_array_equal(np.asarray(v).astype(np.float32), w[k], err_msg=k)
    self.assertEqual(state_lib._copy_pages_jit._cache_size() - compiled, 2)


@functools.partial(jax.jit, static_argnames=("lengths", "scale"))
def dense_mla(q_lat, q_rope, latent, k_rope, q_pos, *, lengths, scale):
  """Per-request dense attention over exactly the first L keys (causal on q_pos [B, T])."""
  outs = []
  for b, L in enumerate(lengths):
    mask = jnp.arange(L)[None, None, :] <= q_pos[b][None, :, None]
    outs.append(mla_latent_attention(q_lat[b:b + 1], q_rope[b:b + 1], latent[b:b + 1, :L],
                                     k_rope[b:b + 1, :L], mask, scale))
  return jnp.concatenate(outs)


@functools.partial(jax.jit, static_argnames=("lengths", "scale"))
def dense_gqa(q, k, v, q_pos, *, lengths, scale):
  outs = []
  for b, L in enumerate(lengths):
    mask = jnp.arange(L)[None, None, :] <= q_pos[b][None, :, None]
    outs.append(gqa_attention(q[b:b + 1], k[b:b + 1, :L], v[b:b + 1, :L], mask, scale))
  return jnp.concatenate(outs)


class PagedAttentionTest(parameterized.TestCase):
  # Ragged lengths: 1 token, exactly one page, a page plus one, all pages full.
  P, M, N = 4, 3, 16
  LENGTHS = [1, 4, 5, 12]

  def _pool(self, cfg, dtype, lengths, seed):
    kv_cfg = kvc.KVCacheConfig(num_pages=self.N, page_size=self.P, dtype=dtype)
    state = kvc.init_paged_state(cfg, kv_cfg)
    meta = make_batch(lengths, self.P, self.N, self.M, seed=seed)
    S = self.P * self.M
    dense = random_entries(cfg, len(lengths), S, seed=seed + 10)
    pos = positions(len(lengths), S)
    state = kvc.write_prefill(state, [dense], pos, meta, kv_cfg=kv_cfg)
    return state, meta, dense

  def _check(self, out, ref, dtype):
    out = np.asarray(out, np.float32)
    self.assertTrue(np.all(np.isfinite(out)))
    if dtype == "float8_e4m3fn":
      self.assertLessEqual(rel_err(out, ref), FP8_TOL)
    else:
      np.testing.assert_allclose(out, np.asarray(ref), rtol=TOL[dtype], atol=TOL[dtype])

  @parameterized.parameters("float32", "bfloat16", "float8_e4m3fn")
  def test_mla_decode(self, dtype):
    state, meta, dense = self._pool(MLA1, dtype, self.LENGTHS, seed=0)
    B, H, C, R = len(self.LENGTHS), 4, MLA1.kv_lora_rank, MLA1.qk_rope_head_dim
    q_lat = randn(5, (B, H, C), 0.3)
    q_rope = randn(6, (B, H, R), 0.3)
    lay = state.layers[0]
    out = MLA_DECODE(q_lat, q_rope, lay["latent"], lay["k_rope"],
                                         lay.get("latent_scale"), lay.get("k_rope_scale"),
                                         meta.block_tables, meta.lengths, scale=0.2)
    self.assertEqual(out.shape, (B, H, C))
    q_pos = np.asarray([[L - 1] for L in self.LENGTHS], np.int32)
    q_lat, q_rope = np.asarray(q_lat), np.asarray(q_rope)
    ref = np.asarray(dense_mla(q_lat[:, None], q_rope[:, None], dense["latent"], dense["k_rope"],
                               q_pos, lengths=tuple(self.LENGTHS), scale=0.2))[:, 0]
    self._check(out, ref, dtype)

  @parameterized.parameters("float32", "bfloat16", "float8_e4m3fn")
  def test_gqa_decode(self, dtype):
    state, meta, dense = self._pool(GQA1, dtype, self.LENGTHS, seed=1)
    B, H, hd = len(self.LENGTHS), GQA1.n_heads, GQA1.head_dim
    q = randn(6, (B, H, hd), 0.5)
    lay = state.layers[0]
    out = GQA_DECODE(q, lay["k"], lay["v"], lay.get("k_scale"),
                                         lay.get("v_scale"), meta.block_tables, meta.lengths,
                                         scale=0.25)
    self.assertEqual(out.shape, (B, H, hd))
    q_pos = np.asarray([[L - 1] for L in self.LENGTHS], np.int32)
    ref = np.asarray(dense_gqa(np.asarray(q)[:, None], dense["k"], dense["v"], q_pos,
                               lengths=tuple(self.LENGTHS), scale=0.25))[:, 0]
    self._check(out, ref, dtype)

  @parameterized.parameters("float32", "float8_e4m3fn")
  def test_chunked_prefill(self, dtype):
    # Chunk of T=3 queries per request at positions [L-3, L): reads earlier pages and itself.
    lengths, T = [3, 5, 8, 12], 3
    q_pos = device([[L - T + t for t in range(T)] for L in lengths], np.int32)
    for cfg in (MLA1, GQA1):
      state, meta, dense = self._pool(cfg, dtype, lengths, seed=2)
      lay = state.layers[0]
      if cfg.attention == "mla":
        q_lat = randn(7, (4, T, 4, cfg.kv_lora_rank), 0.3)
        q_rope = randn(8, (4, T, 4, cfg.qk_rope_head_dim), 0.3)
        out = MLA_PREFILL(q_lat, q_rope, lay["latent"], lay["k_rope"],
                                              lay.get("latent_scale"), lay.get("k_rope_scale"),
                                              meta.block_tables, q_pos, meta.lengths, scale=0.2)
        ref = dense_mla(q_lat, q_rope, dense["latent"], dense["k_rope"], q_pos,
                        lengths=tuple(lengths), scale=0.2)
      else:
        q = randn(7, (4, T, cfg.n_heads, cfg.head_dim), 0.5)
        out = GQA_PREFILL(q, lay["k"], lay["v"], lay.get("k_scale"),
                                              lay.get("v_scale"), meta.block_tables, q_pos,
                                              meta.lengths, scale=0.25)
        ref = dense_gqa(q, dense["k"], dense["v"], q_pos, lengths=tuple(lengths), scale=0.25)
      self._check(out, ref, dtype)

  def test_stale_nan_in_unused_slots_never_leaks(self):
    state, meta, dense = self._pool(GQA1, "float32", [5], seed=3)
    page = int(np.asarray(meta.block_tables)[0, 1])
    k = np.array(state.layers[0]["k"])
    k[page, 1:] = np.nan  # slots past length 5
    k = device(k)
    q = randn(8, (1, GQA1.n_heads, GQA1.head_dim))
    out = GQA_DECODE(q, k, state.layers[0]["v"], None, None,
                                         meta.block_tables, meta.lengths, scale=0.25)
    self.assertTrue(np.all(np.isfinite(np.asarray(out))))

  def test_scale_dtype_mismatch(self):
    # Validation lives in the public op (the kernels' dispatcher), not the bare reference.
    from pallas_kernels.paged_attention import paged_mla_decode
    state, meta, _ = self._pool(MLA1, "float8_e4m3fn", [3], seed=4)
    lay = state.layers[0]
    q = device(np.ones((1, 4, MLA1.kv_lora_rank), np.float32))
    qr = device(np.ones((1, 4, MLA1.qk_rope_head_dim), np.float32))
    with self.assertRaisesRegex(ValueError, "scales must be given exactly when the cache is fp8"):
      paged_mla_decode(q, qr, lay["latent"], lay["k_rope"], None, None,
                       meta.block_tables, meta.lengths, scale=1.0, backend="xla")
    bf, bf_rope = (device(np.asarray(lay[n]), jnp.bfloat16) for n in ("latent", "k_rope"))
    with self.assertRaisesRegex(ValueError, "scales must be given exactly when the cache is fp8"):
      paged_mla_decode(q, qr, bf, bf_rope,
                       lay["latent_scale"], lay["k_rope_scale"],
                       meta.block_tables, meta.lengths, scale=1.0, backend="xla")


class TagCheckTest(absltest.TestCase):

  def test_flags_exactly_reallocated_requests(self):
    P = 4
    alloc = kvc.PageAllocator(num_pages=6, page_size=P)  # all pages in use
    for rid, n in (("a", 5), ("b", 4), ("c", 8), ("d", 1)):
      self.assertIsNone(alloc.admit(rid, n))
    meta = alloc.batch_meta(["a", "b", "c", "d"], max_pages=3)
    state = kvc.sync_tags(kvc.init_paged_state(MLA1, kvc.KVCacheConfig(6, P)), alloc.device_tags())
    ok = kvc.tag_check_reference(state.page_tags, meta.block_tables, meta.expected_tags,
                                 meta.lengths, page_size=P)
    np.testing.assert_array_equal(np.asarray(ok), [True] * 4)
    # Free b's page and c's pages behind the scheduler's back; reallocate them to someone else.
    b_pages = [p for p, _ in alloc.block_table("b")]
    c_pages = [p for p, _ in alloc.block_table("c")]
    alloc.free(b_pages)
    alloc.free(c_pages[1:])  # only c's second page is reused below
    self.assertEqual(sorted(alloc.allocate(2)), sorted(b_pages + c_pages[1:]))
    state = kvc.sync_tags(state, alloc.device_tags())
    ok = kvc.tag_check_reference(state.page_tags, meta.block_tables, meta.expected_tags,
                                 meta.lengths, page_size=P)
    np.testing.assert_array_equal(np.asarray(ok), [True, False, False, True])
    # c with a length that only reaches its first page uses no reallocated page.
    ok = kvc.tag_check_reference(state.page_tags, meta.block_tables, meta.expected_tags,
                                 device([5, 4, 4, 1], np.int32), page_size=P)
    np.testing.assert_array_equal(np.asarray(ok), [True, False, True, True])

  def test_tags_past_wrap_and_pad_entries(self):
    alloc = kvc.PageAllocator(num_pages=3, page_size=2)
    alloc.generation = 0xFFFFFFFE  # the second allocation wraps (skipping the reserved 0)
    self.assertIsNone(alloc.admit("a", 3))
    meta = alloc.batch_meta(["a", None], max_pages=3)
    self.assertEqual(alloc.block_table("a"), [(0, 0xFFFFFFFF), (1, 1)])
    state = kvc.sync_tags(kvc.init_paged_state(MLA1, kvc.KVCacheConfig(3, 2)), alloc.device_tags())
    self.assertEqual(int(np.asarray(state.page_tags)[0]), -1)  # 0xFFFFFFFF bit-cast
    self.assertEqual(int(np.asarray(meta.expected_tags)[0, 0]), -1)
    ok = kvc.tag_check_reference(state.page_tags, meta.block_tables, meta.expected_tags,
                                 meta.lengths, page_size=2)
    np.testing.assert_array_equal(np.asarray(ok), [True, True])
    # A used entry that is PAD_PAGE (a corrupt table) fails.
    bad = np.array(meta.block_tables)
    bad[0, 1] = kvc.PAD_PAGE
    bad = device(bad)
    ok = kvc.tag_check_reference(state.page_tags, bad, meta.expected_tags, meta.lengths,
                                 page_size=2)
    np.testing.assert_array_equal(np.asarray(ok), [False, True])


class BadInputTest(parameterized.TestCase):
  """Every bad call raises a clear ValueError and leaves the (donatable) state as it was."""

  def setUp(self):
    super().setUp()
    self.kv_cfg = kvc.KVCacheConfig(num_pages=6, page_size=4, dtype="float8_e4m3fn")
    self.state = kvc.init_paged_state(GQA1, self.kv_cfg)
    self.meta = make_batch([5, 3], 4, 6, 2)
    self.new = [random_entries(GQA1, 2, 5, seed=9)]
    self.pos = positions(2, 5)
    self.before = jax.tree_util.tree_map(np.asarray, self.state)

  def _first_token(self):
    """self.new's position-0 entries {name: [B, ...]}, sliced on host."""
    return {k: device(np.asarray(v)[:, 0]) for k, v in self.new[0].items()}

  def _assert_untouched(self):
    for leaf in jax.tree_util.tree_leaves(self.state):
      self.assertFalse(leaf.is_deleted())
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b),
                           self.state, self.before)

  def test_block_table_outside_pool(self):
    for bad_page in (6, -2):
      bt = np.array(self.meta.block_tables)
      bt[1, 0] = bad_page
      meta = self.meta.replace(block_tables=device(bt))
      with self.assertRaisesRegex(ValueError, rf"= {bad_page} points outside the pool of 6"):
        kvc.write_prefill(self.state, self.new, self.pos, meta, kv_cfg=self.kv_cfg)
    self._assert_untouched()

  def test_length_longer_than_pages(self):
    meta = self.meta.replace(lengths=device([5, 6], np.int32))  # request 1 holds 1 page
    with self.assertRaisesRegex(ValueError, "request 1: length 6 is longer than its pages"):
      kvc.write_prefill(self.state, self.new, self.pos, meta)
    meta = self.meta.replace(lengths=device([9, 3], np.int32))  # beyond the table width
    with self.assertRaisesRegex(ValueError, "request 0: length 9 is longer than its pages"):
      kvc.write_decode(self.state, [self._first_token()], meta)
    meta = self.meta.replace(lengths=device([-1, 3], np.int32))
    with self.assertRaisesRegex(ValueError, "lengths must be >= 0"):
      kvc.write_prefill(self.state, self.new, self.pos, meta)
    self._assert_untouched()

  def test_dtype_mismatch(self):
    with self.assertRaisesRegex(ValueError, "KV dtype mismatch: state pages are float8_e4m3fn"):
      kvc.write_prefill(self.state, self.new, self.pos, self.meta,
                        kv_cfg=dataclasses.replace(self.kv_cfg, dtype="bfloat16"))
    self._assert_untouched()

  def test_page_size_mismatch(self):
    with self.assertRaisesRegex(ValueError, "page size mismatch: state pages hold 4 tokens, the call"):
      kvc.write_prefill(self.state, self.new, self.pos, self.meta,
                        kv_cfg=dataclasses.replace(self.kv_cfg, page_size=8))
    with self.assertRaisesRegex(ValueError, "batch metadata was built for 8"):
      kvc.write_prefill(self.state, self.new, self.pos, self.meta.replace(page_size=8))
    with self.assertRaisesRegex(ValueError, "page count mismatch"):
      kvc.write_prefill(self.state, self.new, self.pos, self.meta,
                        kv_cfg=dataclasses.replace(self.kv_cfg, num_pages=7))
    self._assert_untouched()

  def test_shape_mismatches(self):
    bad = [{"k": device(np.asarray(self.new[0]["k"])[..., :8]), "v": self.new[0]["v"]}]
    with self.assertRaisesRegex(ValueError, "new 'k' has shape"):
      kvc.write_prefill(self.state, bad, self.pos, self.meta)
    with self.assertRaisesRegex(ValueError, "lack 'v'"):
      kvc.write_prefill(self.state, [{"k": self.new[0]["k"]}], self.pos, self.meta)
    with self.assertRaisesRegex(ValueError, "entries for 2 layers"):
      kvc.write_prefill(self.state, self.new * 2, self.pos, self.meta)
    with self.assertRaisesRegex(ValueError, "batch metadata shapes disagree"):
      kvc.write_prefill(self.state, self.new, self.pos,
                        self.meta.replace(lengths=device([5], np.int32)))
    with self.assertRaisesRegex(ValueError, "positions must be >= 0"):
      kvc.write_prefill(self.state, self.new, positions(2, 5, start=-1), self.meta)
    with self.assertRaisesRegex(ValueError, "does not match the model config"):
      kvc.validate_state(self.state, self.kv_cfg, MLA1)
    self._assert_untouched()

  def test_metadata_and_layer_errors(self):
    with self.assertRaisesRegex(ValueError, "block_tables must be integers"):
      kvc.write_prefill(self.state, self.new, self.pos,
                        self.meta.replace(block_tables=device(self.meta.block_tables, np.float32)))
    with self.assertRaisesRegex(ValueError, r"positions \(5,\) must be \[B, T\] with B = 2"):
      kvc.validate_batch(self.state, self.meta, device(np.asarray(self.pos)[0]))
    with self.assertRaisesRegex(ValueError, "layer 1 out of range for a state of 1 layers"):
      kvc.write_layer(self.state, 1, self.new[0], self.pos, self.meta)
    with self.assertRaisesRegex(ValueError, "state has 1 layers, model config says 2"):
      kvc.validate_state(self.state, self.kv_cfg, dataclasses.replace(GQA1, n_layers=2,
                                                                       first_k_dense=2))
    lay = self.state.layers[0]
    q = device(np.ones((2, GQA1.n_heads, GQA1.head_dim), np.float32))
    # Decode attention validates in its public op (the kernels' dispatcher).
    from pallas_kernels.paged_attention import paged_gqa_decode
    with self.assertRaisesRegex(ValueError, r"k scales: expected shape \(6, 4, 2\), got \(6, 4\)"):
      paged_gqa_decode(q, lay["k"], lay["v"], device(np.asarray(lay["k_scale"])[..., 0]),
                       lay["v_scale"],
                       self.meta.block_tables, self.meta.lengths, scale=1.0, backend="xla")
    with self.assertRaisesRegex(ValueError, "do not match batch 2"):
      paged_gqa_decode(q, lay["k"], lay["v"], lay["k_scale"], lay["v_scale"],
                       device(np.asarray(self.meta.block_tables)[:1]), self.meta.lengths,
                       scale=1.0, backend="xla")
    self._assert_untouched()

  def test_padded_row_writes_nothing(self):
    bt = np.array(self.meta.block_tables)
    bt[1] = kvc.PAD_PAGE
    meta = self.meta.replace(block_tables=device(bt), lengths=device([5, 0], np.int32))
    state = kvc.write_decode(self.state, [self._first_token()], meta)
    pages = np.asarray(state.layers[0]["k"]).astype(np.float32)
    written = np.argwhere(np.any(pages != 0, axis=(-1, -2)))
    bt = np.asarray(self.meta.block_tables)
    self.assertEqual(written.tolist(), [[int(bt[0, 1]), 0]])  # only row 0's position 4

  def test_sync_tags_shape(self):
    with self.assertRaisesRegex(ValueError, "does not match the pool's 6 pages"):
      kvc.sync_tags(self.state, np.zeros(5, np.int32))

  def test_sync_tags_takes_only_the_device_tag_array(self):
    alloc = kvc.PageAllocator(6, 4)
    for wrong in (alloc, alloc.tags, alloc.device_tags().tolist(), np.zeros(6, np.int64)):
      with self.assertRaisesRegex(TypeError, "int32 array of PageAllocator.device_tags"):
        kvc.sync_tags(self.state, wrong)
    alloc.admit("r", 9)
    state = kvc.sync_tags(self.state, alloc.device_tags())
    np.testing.assert_array_equal(np.asarray(state.page_tags).view(np.uint32), alloc.tags)

  def test_config_errors(self):
    with self.assertRaisesRegex(ValueError, "num_pages must be a positive int"):
      kvc.KVCacheConfig(num_pages=0)
    with self.assertRaisesRegex(ValueError, "page_size must be a positive int or None"):
      kvc.KVCacheConfig(num_pages=4, page_size=0)
    with self.assertRaisesRegex(ValueError, "dtype must be one of"):
      kvc.KVCacheConfig(num_pages=4, dtype="float16")
    self.assertEqual(kvc.KVCacheConfig(4).page_size_for(TINY_MLA), 64)
    self.assertEqual(kvc.KVCacheConfig(4).page_size_for(TINY_GQA), 16)


if __name__ == "__main__":
  absltest.main()
