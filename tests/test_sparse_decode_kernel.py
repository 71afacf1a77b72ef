"""Sparse paged MLA decode (ops.paged_mla_sparse_decode) against its jnp reference.

The kernel runs in interpret mode on the CPU at small shapes (docs/testing.md).
Every page slot that is not selected, inside or past a request's length, is
NaN, as are its scales: a kernel that reads a token it was not given, or
leaves an output element unwritten, fails. The reference itself is checked
against the dense reference with every position selected.
"""

import functools
import os
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from mlkit import kvcache as kvc
from mlkit import model
from mlkit.checkpoint import load_hf_checkpoint
from mlkit.model import sparse_attention as dsa
from pallas_kernels.paged_attention import SparseBlockSizes
from pallas_kernels.paged_attention import paged_mla_decode_reference
from pallas_kernels.paged_attention import paged_mla_sparse_decode
from pallas_kernels.paged_attention import paged_mla_sparse_decode_reference

FP8 = jnp.float8_e4m3fn
# Relative-norm tolerances (docs/testing.md): fp8 against an f32 reference
# 5e-2; bf16 pages still round probabilities to bf16 for the PV dot: 1e-2.
TOL = {"bf16": 1e-2, "fp8": 5e-2}


def _rel_err(out, ref):
  out = np.asarray(out, np.float32)
  ref = np.asarray(ref, np.float32)
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _quantise(x, rng, kv_dtype):
  """x f32 [N, ps, D] -> (stored pages, per-token scales [N, ps] or None)."""
  if kv_dtype == "bf16":
    return x, None
  # amax / 448 so e4m3 never overflows, times a random factor so scales vary
  # token to token and a kernel that misplaces them fails.
  s = (np.abs(x).max(-1) / 448.0 * rng.uniform(1.0, 2.0, x.shape[:2])).astype(np.float32)
  return x / s[..., None], s


def _select(rng, lengths, k):
  """[B, K] int32: per request up to K distinct positions < length in random
  order, the rest -1 at random places."""
  out = np.full((len(lengths), k), -1, np.int32)
  for b, length in enumerate(lengths):
    n = min(k, length)
    row = np.full(k, -1, np.int32)
    row[:n] = rng.choice(length, size=n, replace=False)
    out[b] = rng.permutation(row)
  return out


def make_sparse(seed, *, batch, heads, c, r, page_size, max_pages, lengths, k,
                kv_dtype, q_dtype=jnp.bfloat16, poison=True):
  """Random inputs of paged_mla_sparse_decode; unselected slots NaN if poison."""
  rng = np.random.default_rng(seed)
  num_pages = batch * max_pages + 3
  q_lat = jnp.asarray(rng.standard_normal((batch, heads, c)), q_dtype)
  q_rope = jnp.asarray(rng.standard_normal((batch, heads, r)), q_dtype)
  lat, lat_s = _quantise(rng.standard_normal((num_pages, page_size, c)).astype(np.float32),
                         rng, kv_dtype)
  rope, rope_s = _quantise(rng.standard_normal((num_pages, page_size, r)).astype(np.float32),
                           rng, kv_dtype)
  bt = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages)
  bt = bt.astype(np.int32)
  idx = _select(rng, lengths, k)
  if poison:
    used = np.zeros((num_pages, page_size), bool)
    for b in range(batch):
      for t in idx[b][idx[b] >= 0]:
        used[bt[b, t // page_size], t % page_size] = True
    for x in (lat, rope, lat_s, rope_s):
      if x is not None:
        x[~used] = np.nan
  for b, length in enumerate(lengths):  # PAD_PAGE past the used pages, as the cache
    bt[b, -(-length // page_size):] = -1
  dt = jnp.bfloat16 if kv_dtype == "bf16" else FP8
  sc = lambda s: None if s is None else jnp.asarray(s)
  return (q_lat, q_rope, jnp.asarray(lat, dt), jnp.asarray(rope, dt), sc(lat_s),
          sc(rope_s), jnp.asarray(bt), jnp.asarray(lengths, jnp.int32), jnp.asarray(idx))


# Ragged lengths: a full table, a short request, an empty one (all -1).
SHAPE = dict(batch=4, heads=20, c=32, r=16, page_size=4, max_pages=6,
             lengths=[24, 7, 0, 19], k=19)


class SparseKernelInterpretTest(parameterized.TestCase):
  """The Triton-backend kernel in interpret mode against the reference."""

  @parameterized.product(kv_dtype=("bf16", "fp8"), num_splits=(1, 2))
  def test_matches_reference(self, kv_dtype, num_splits):
    args = make_sparse(11 + num_splits, kv_dtype=kv_dtype, **SHAPE)
    # K = 19 is not a multiple of block_k = 16; 20 heads pad to 32.
    bs = SparseBlockSizes(block_h=16, block_k=16, num_splits=num_splits)
    out = paged_mla_sparse_decode(*args, scale=0.3, backend="interpret", block_sizes=bs)
    ref = paged_mla_sparse_decode_reference(*args, scale=0.3)
    out32 = np.asarray(out, np.float32)
    self.assertFalse(np.isnan(out32).any(), "NaN in the kernel's output")
    self.assertEqual(out.shape, args[0].shape)
    self.assertEqual(out.dtype, args[0].dtype)
    np.testing.assert_array_equal(out32[2], 0.0)  # the request with no index
    self.assertLessEqual(_rel_err(out, ref), TOL[kv_dtype])

  def test_default_block_sizes(self):
    args = make_sparse(5, kv_dtype="bf16", batch=2, heads=4, c=32, r=16, page_size=8,
                       max_pages=4, lengths=[30, 9], k=20)
    out = paged_mla_sparse_decode(*args, scale=0.2, backend="interpret")
    ref = paged_mla_sparse_decode_reference(*args, scale=0.2)
    self.assertLessEqual(_rel_err(out, ref), TOL["bf16"])

  def test_default_split_heuristic(self):
    # GLM 5 decode on one H200: 64 heads in two blocks of 32, K = 2048 in
    # 32-row steps (64 per request): batches 1 and 8 split 32 ways (2 steps
    # each; 64 and 512 programs), batch 64 splits 4 ways (512 programs).
    kind = "NVIDIA H200"
    one = SparseBlockSizes.get_default(num_heads=64, num_indices=2048, batch=1,
                                       device_kind=kind)
    self.assertEqual((one.block_h, one.block_k, one.num_splits), (32, 32, 32))
    eight = SparseBlockSizes.get_default(num_heads=64, num_indices=2048, batch=8,
                                         device_kind=kind)
    self.assertEqual(eight.num_splits, 32)
    many = SparseBlockSizes.get_default(num_heads=64, num_indices=2048, batch=64,
                                        device_kind=kind)
    self.assertEqual(many.num_splits, 4)


class SparseReferenceTest(parameterized.TestCase):
  """The reference: the dense reference when every position is selected."""

  @parameterized.parameters("bf16", "fp8")
  def test_all_selected_equals_dense(self, kv_dtype):
    shape = dict(SHAPE, k=SHAPE["max_pages"] * SHAPE["page_size"])
    args = list(make_sparse(7, kv_dtype=kv_dtype, q_dtype=jnp.float32, poison=False,
                            **shape))
    lengths = np.asarray(args[7])
    k = shape["k"]
    rng = np.random.default_rng(0)
    idx = np.full((len(lengths), k), -1, np.int32)
    for b, length in enumerate(lengths):  # all positions < length, shuffled
      idx[b] = rng.permutation(np.where(np.arange(k) < length, np.arange(k), -1))
    args[8] = jnp.asarray(idx)
    sparse = paged_mla_sparse_decode_reference(*args, scale=0.3)
    dense = paged_mla_decode_reference(*args[:8], scale=0.3)
    np.testing.assert_allclose(np.asarray(sparse), np.asarray(dense), rtol=1e-5, atol=1e-6)
    # The xla backend is the reference.
    xla = paged_mla_sparse_decode(*args, scale=0.3, backend="xla")
    np.testing.assert_array_equal(np.asarray(xla), np.asarray(sparse))

  def test_selection_matters(self):
    # A selection of part of the context differs from dense attention, so the
    # test above checks the gather and not just that both attend somewhere.
    args = make_sparse(8, kv_dtype="bf16", q_dtype=jnp.float32, poison=False, **SHAPE)
    sparse = paged_mla_sparse_decode_reference(*args, scale=0.3)
    dense = paged_mla_decode_reference(*args[:8], scale=0.3)
    self.assertGreater(_rel_err(sparse[:2], dense[:2]), 1e-2)


class SparseBadInputTest(parameterized.TestCase):
  """Clear errors for inputs the op cannot take."""

  def setUp(self):
    super().setUp()
    self.args = list(make_sparse(3, kv_dtype="fp8", batch=2, heads=4, c=16, r=8,
                                 page_size=4, max_pages=2, lengths=[5, 8], k=4))

  def _call(self, **changes):
    args = list(self.args)
    for i, v in changes.items():
      args[int(i[1:])] = v
    return paged_mla_sparse_decode(*args, scale=1.0, backend="interpret")

  def test_indices_dtype(self):
    with self.assertRaisesRegex(ValueError, "int32"):
      self._call(a8=self.args[8].astype(jnp.float32))

  def test_indices_shape(self):
    with self.assertRaisesRegex(ValueError, r"indices must be \[B=2"):
      self._call(a8=self.args[8][:1])
    with self.assertRaisesRegex(ValueError, r"indices must be \[B=2"):
      self._call(a8=self.args[8][0])

  def test_more_indices_than_the_table_holds(self):
    with self.assertRaisesRegex(ValueError, "hold at most 8"):
      self._call(a8=jnp.full((2, 9), -1, jnp.int32))

  def test_fp8_without_scales(self):
    with self.assertRaisesRegex(ValueError, "scales"):
      self._call(a4=None)

  def test_shape_mismatch(self):
    with self.assertRaisesRegex(ValueError, "shape mismatch"):
      self._call(a1=self.args[1][:, :, :4])

  def test_unknown_backend(self):
    with self.assertRaisesRegex(ValueError, "backend"):
      paged_mla_sparse_decode(*self.args, scale=1.0, backend="cuda")


FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "glm_moe_dsa")


@functools.partial(jax.jit, static_argnames=("cfg", "backend"))
def _apply(params, tokens, positions, cache, meta, *, cfg, backend=None):
  return model.apply(params, tokens, positions, cache, cfg=cfg, batch_meta=meta,
                     backend=backend)


class SparseDecodeModelTest(absltest.TestCase):
  """The model's paged decode step on a sparse-attention layer runs the kernel."""

  def test_paged_decode_matches_the_contiguous_cache(self):
    # GLM fixture (docs/sparse_attention.md; index_topk 6 below the prompt), f32: prefill
    # the prompt, then decode the next token through a paged pool with the kernel in
    # interpret mode and through the contiguous cache (XLA over the view, mask narrowed
    # to the selection). Every layer's decode goes through sparse_decode_attention, every
    # full layer's selection through the paged indexer kernel, and no page is gathered.
    params, cfg = load_hf_checkpoint(FIXTURE)
    ref = np.load(os.path.join(FIXTURE, "reference.npz"))
    n = int(ref["prompt_len"])
    tokens = jnp.asarray(ref["tokens"][:, : n + 1], jnp.int32)
    B = tokens.shape[0]
    self.assertGreater(n + 1, cfg.index_topk)  # the selection is narrower than dense
    pos = jnp.broadcast_to(jnp.arange(n + 1, dtype=jnp.int32), (B, n + 1))
    page = 4
    pages = -(-(n + 1) // page)
    alloc = kvc.PageAllocator(B * pages + 3, page)
    alloc.allocate(3)  # so the requests do not start at page 0
    for rid in range(B):
      self.assertIsNone(alloc.admit(rid, n + 1))
    meta = alloc.batch_meta(list(range(B)), max_pages=pages)
    pool = kvc.sync_tags(
        kvc.init_paged_state(cfg, kvc.KVCacheConfig(B * pages + 3, page, "float32")),
        alloc.device_tags())
    contig = model.init_cache(cfg, B, 32)
    _, contig = _apply(params, tokens[:, :n], pos[:, :n], contig, None, cfg=cfg)
    want, _ = _apply(params, tokens[:, n:], pos[:, n:], contig, None, cfg=cfg)
    _, pool = _apply(params, tokens[:, :n], pos[:, :n], pool, meta, cfg=cfg)
    real = kvc.PagedKVState.sparse_decode_attention
    real_select = kvc.PagedKVState.sparse_decode_select
    with mock.patch.object(kvc.PagedKVState, "sparse_decode_attention", autospec=True,
                           side_effect=real) as spy, \
         mock.patch.object(kvc.PagedKVState, "sparse_decode_select", autospec=True,
                           side_effect=real_select) as select_spy, \
         mock.patch.object(kvc.PagedKVState, "update", autospec=True,
                           side_effect=AssertionError("a paged decode step gathered pages")):
      got, _ = _apply(params, tokens[:, n:], pos[:, n:], pool, meta, cfg=cfg,
                      backend="interpret")
    self.assertEqual(spy.call_count, cfg.n_layers)
    # The indexer kernel scores the paged keys on the full layers only.
    self.assertEqual(select_spy.call_count, sum(map(cfg.runs_indexer, range(cfg.n_layers))))
    self.assertLessEqual(_rel_err(got, want), 1e-4)


if __name__ == "__main__":
  absltest.main()
