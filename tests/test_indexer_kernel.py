"""Paged indexer scoring and top-k (pallas_kernels.indexer) against the jnp references.

The kernel runs in interpret mode on the CPU at small shapes (docs/testing.md).
Every page slot a request does not own, and every slot past its length, is NaN
(scales too): a kernel that reads a token it should not, or leaves a score
unwritten, fails. The reference is checked against the model's contiguous
indexer (mlkit.model.sparse_attention), and the top-k against its selection.
"""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from mlkit.model import sparse_attention as dsa
from pallas_kernels.indexer import IndexerBlockSizes
from pallas_kernels.indexer import paged_index_scores
from pallas_kernels.indexer import paged_index_scores_reference
from pallas_kernels.indexer import paged_index_topk
from pallas_kernels.indexer import TopkBlockSizes
from pallas_kernels.indexer import topk_positions as topk_kernel_op
from pallas_kernels.indexer import topk_positions_reference
from host_data import put

# The reference top-k in one program per (shape, k), where eagerly each of its operations
# is one.
topk_positions = jax.jit(topk_positions_reference, static_argnums=1)

FP8 = jnp.float8_e4m3fn
# Relative-norm tolerances over the visible scores (docs/testing.md): bf16 keys
# and queries against an f32 reference 1e-2, fp8 keys 5e-2, f32 1e-5.
TOL = {"f32": 1e-5, "bf16": 1e-2, "fp8": 5e-2}


def make_inputs(seed, *, batch, heads, di, page_size, max_pages, lengths, kv, poison=True):
  """Random inputs of paged_index_scores; slots no request may read are NaN if poison."""
  rng = np.random.default_rng(seed)
  n = batch * max_pages + 3
  q_dt = np.float32 if kv == "f32" else jnp.bfloat16
  q = rng.standard_normal((batch, heads, di)).astype(q_dt)
  # Mixed-sign weights, as weights_proj gives: scores are not all positive.
  w = rng.standard_normal((batch, heads)).astype(np.float32)
  k = rng.standard_normal((n, page_size, di)).astype(np.float32)
  scale = None
  if kv == "fp8":
    scale = (np.abs(k).max(-1) / 448.0 * rng.uniform(1.0, 2.0, (n, page_size))).astype(np.float32)
    k = k / scale[..., None]
  bt = rng.permutation(n)[: batch * max_pages].reshape(batch, max_pages).astype(np.int32)
  if poison:
    used = np.zeros((n, page_size), bool)
    for b, length in enumerate(lengths):
      for t in range(length):
        used[bt[b, t // page_size], t % page_size] = True
    k[~used] = np.nan
    if scale is not None:
      scale[~used] = np.nan
  for b, length in enumerate(lengths):  # PAD_PAGE past the used pages, as the cache
    bt[b, -(-length // page_size):] = -1
  dt = {"f32": np.float32, "bf16": jnp.bfloat16, "fp8": FP8}[kv]
  # Cast on the host (numpy's bf16 and fp8 round to nearest even, as XLA's) and placed:
  # no program converts them.
  return (*put(q, w, k.astype(dt)), None if scale is None else put(scale),
          *put(bt, np.asarray(lengths, np.int32)))


def _rel_err(out, ref):
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  finite = np.isfinite(ref)
  return float(np.linalg.norm(out[finite] - ref[finite]) / np.linalg.norm(ref[finite]))


# A full table, a short request, an empty one, one ending mid-page; 12 heads pad to 16.
SHAPE = dict(batch=4, heads=12, di=16, page_size=4, max_pages=9, lengths=[36, 7, 0, 29])


class IndexerKernelInterpretTest(parameterized.TestCase):

  @parameterized.product(kv=("f32", "bf16", "fp8"), block_k=(16, 32))
  def test_scores_match_reference(self, kv, block_k):
    args = make_inputs(3 + block_k, kv=kv, **SHAPE)
    out = paged_index_scores(*args, backend="interpret",
                             block_sizes=IndexerBlockSizes(block_k=block_k, num_warps=4))
    ref = paged_index_scores_reference(*args)
    out, ref = np.asarray(out), np.asarray(ref)
    self.assertEqual(out.shape, (4, 36))
    # -inf exactly past each length, finite (no NaN read) before it.
    np.testing.assert_array_equal(np.isneginf(out), np.isneginf(ref))
    for b, length in enumerate(SHAPE["lengths"]):
      self.assertTrue(np.isfinite(out[b, :length]).all(), f"request {b}")
      self.assertTrue(np.isneginf(out[b, length:]).all(), f"request {b}")
    self.assertLessEqual(_rel_err(out, ref), TOL[kv])

  def test_default_block_sizes(self):
    args = make_inputs(5, kv="bf16", batch=2, heads=32, di=32, page_size=8, max_pages=20,
                       lengths=[150, 9])
    out = paged_index_scores(*args, backend="interpret")
    self.assertLessEqual(_rel_err(out, paged_index_scores_reference(*args)), TOL["bf16"])

  @parameterized.parameters("f32", "fp8")
  def test_topk_kernel_equals_reference_selection(self, kv):
    # Well separated scores (f32 keys): the kernel's and the reference's top-k agree.
    args = make_inputs(9, kv=kv, **SHAPE)
    got = paged_index_topk(*args, k=10, backend="interpret",
                           block_sizes=IndexerBlockSizes(block_k=16, num_warps=4))
    want = topk_positions(paged_index_scores_reference(*args), 10)
    if kv == "f32":
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    else:  # fp8 with bf16 queries: near-ties may flip; most of each full selection agrees
      for b in (0, 3):
        self.assertGreaterEqual(len(set(np.asarray(got)[b]) & set(np.asarray(want)[b])), 8)
    got = np.asarray(got)
    np.testing.assert_array_equal(got[2], -1)  # the empty request selects nothing
    np.testing.assert_array_equal(got[1], [0, 1, 2, 3, 4, 5, 6, -1, -1, -1])  # 7 <= k: all


class IndexerReferenceTest(parameterized.TestCase):
  """The reference and top-k against the model's contiguous indexer."""

  def test_reference_equals_model_index_scores(self):
    args = make_inputs(1, kv="f32", poison=False, **SHAPE)
    q, w, k, _, bt, lengths = args
    ref = paged_index_scores_reference(*args)
    # The requests' keys gathered and masked on the host.
    k_np, bt_np = np.asarray(k), np.asarray(bt)
    keys = k_np[np.clip(bt_np, 0, k_np.shape[0] - 1)].reshape(4, -1, SHAPE["di"])  # [B, S, Di]
    mask = (np.arange(keys.shape[1])[None, :] < np.asarray(lengths)[:, None])[:, None, :]

    @jax.jit
    def model_scores_and_choice(q, w, keys, mask):  # one program
      model = dsa.index_scores(q[:, None], w[:, None], keys, mask)[:, 0]
      return model, dsa.select_topk(model[:, None], mask, 10)[:, 0]
    model, sel = model_scores_and_choice(q, w, *put(keys, mask))
    np.testing.assert_allclose(np.asarray(ref), np.asarray(model), rtol=1e-5, atol=1e-5)
    # ... and its top-k selects the positions select_topk does, ascending, -1 after them.
    sel = np.asarray(sel)
    want = np.full((4, 10), -1, np.int32)
    for b in range(4):
      pos = np.flatnonzero(sel[b])
      want[b, :len(pos)] = pos
    np.testing.assert_array_equal(np.asarray(topk_positions(ref, 10)), want)

  def test_topk_ties_break_toward_the_earlier_position(self):
    # ReLU gives exact ties at 0; the earlier positions win, as in the model.
    scores = put(np.asarray([[0.0, 2.0, 0.0, 0.0, 1.0, -np.inf],
                             [-np.inf] * 6], np.float32))
    np.testing.assert_array_equal(np.asarray(topk_positions(scores, 4)),
                                  [[0, 1, 2, 4], [-1, -1, -1, -1]])
    self.assertEqual(topk_positions(scores, 9).shape, (2, 6))  # k capped at S

  def test_xla_backend_is_the_reference(self):
    args = make_inputs(2, kv="fp8", poison=False, **SHAPE)
    np.testing.assert_array_equal(np.asarray(paged_index_scores(*args, backend="xla")),
                                  np.asarray(paged_index_scores_reference(*args)))


def _topk_cases(seed):
  """[B, S] f32 scores that exercise the top-k's edges, row by row."""
  rng = np.random.default_rng(seed)
  S = 150
  x = rng.standard_normal((8, S)).astype(np.float32)
  x[1, :] = -np.inf
  x[1, :5] = rng.standard_normal(5)  # fewer visible than k: all of them
  x[2, ::3] = 0.0  # exact ties (ReLU zeros) across the k-th place
  x[3, 60:] = -np.inf  # a short request
  x[4, :] = -np.inf  # an empty one
  x[5] = np.round(x[5] * 2) / 2  # many ties everywhere
  x[6] = -np.abs(x[6]) - 1.0  # all negative (mixed-sign head weights)
  x[7, :] = 3.0  # all equal: the earliest k
  return put(x)


class TopkKernelInterpretTest(parameterized.TestCase):
  """The Pallas top-k (radix select) in interpret mode: the reference's positions exactly."""

  @parameterized.product(k=(1, 9, 40, 149, 150, 400), block=(16, 64))
  def test_matches_reference(self, k, block):
    scores = _topk_cases(k + block)
    got = topk_kernel_op(scores, k=k, backend="interpret",
                         block_sizes=TopkBlockSizes(block=block, num_warps=4))
    want = topk_positions(scores, k)
    self.assertEqual(got.shape, want.shape)
    self.assertEqual(got.dtype, jnp.int32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

  def test_xla_backend_and_bad_input(self):
    scores = _topk_cases(0)
    np.testing.assert_array_equal(np.asarray(topk_kernel_op(scores, k=7, backend="xla")),
                                  np.asarray(topk_positions(scores, 7)))
    with self.assertRaisesRegex(ValueError, r"\[B, S\] float32"):
      topk_kernel_op(put(np.asarray(scores).astype(jnp.bfloat16)), k=3, backend="interpret")
    with self.assertRaisesRegex(ValueError, "k must be >= 1"):
      topk_kernel_op(scores, k=0, backend="interpret")
    with self.assertRaisesRegex(ValueError, "power of two"):
      TopkBlockSizes(block=100)


# The model's selection, blocked and unblocked, each in one program (shared by the cases),
# where eagerly each operation (and loop step) is one.
_select_blocked = jax.jit(dsa.select, static_argnums=4, static_argnames="block")
_select_unblocked = jax.jit(lambda q, w, keys, mask, k: dsa.select_topk(
    dsa.index_scores(q, w, keys, mask), mask, k), static_argnums=4)


class BlockedSelectionTest(parameterized.TestCase):
  """The model's query-blocked selection (prefill) equals the unblocked one."""

  @parameterized.parameters(1, 3, 8, 64)
  def test_blocked_equals_unblocked(self, block):
    rng = np.random.default_rng(block)
    B, T, S, Hi, Di = 2, 11, 19, 3, 8
    q, w, keys = put(rng.standard_normal((B, T, Hi, Di)).astype(np.float32),
                     rng.standard_normal((B, T, Hi)).astype(np.float32),
                     rng.standard_normal((B, S, Di)).astype(np.float32))
    # Causal with the queries at positions 8..18, a shorter second request.
    pos = np.arange(S - T, S)
    lengths = np.asarray([S, 15])
    mask = put((np.arange(S)[None, None, :] <= pos[None, :, None])
               & (np.arange(S)[None, None, :] < lengths[:, None, None]))
    want = _select_unblocked(q, w, keys, mask, 5)
    got = _select_blocked(q, w, keys, mask, 5, block=block)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    self.assertTrue((np.asarray(got).sum(-1) <= 5).all())

  def test_query_block(self):
    # GLM 5 prefill, batch 4, 2048 queries over 2048 keys, 32 heads: 2 GB of scores
    # unblocked; 256 MiB allows 256 queries a block.
    self.assertEqual(dsa.query_block(4, 2048, 32, 2048), 256)
    self.assertEqual(dsa.query_block(1, 100, 8, 64), 100)  # fits: no blocking
    self.assertEqual(dsa.query_block(1, 100, 8, 64, budget=8 * 64 * 4 * 7), 4)
    self.assertEqual(dsa.query_block(1, 100, 8, 64, budget=1), 1)


class IndexerBadInputTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.args = list(make_inputs(4, kv="fp8", batch=2, heads=4, di=16, page_size=4,
                                 max_pages=2, lengths=[5, 8]))

  def _call(self, **changes):
    args = list(self.args)
    for i, v in changes.items():
      args[int(i[1:])] = v
    return paged_index_scores(*args, backend="interpret")

  def test_weights_shape(self):
    with self.assertRaisesRegex(ValueError, r"weights must be \[B=2, Hi=4\]"):
      self._call(a1=put(np.asarray(self.args[1])[:, :3]))

  def test_key_width(self):
    with self.assertRaisesRegex(ValueError, r"index_k must be \[N, page_size, Di=16\]"):
      self._call(a2=put(np.asarray(self.args[2])[..., :8]))

  def test_fp8_without_scales(self):
    with self.assertRaisesRegex(ValueError, "index_k_scale"):
      self._call(a3=None)

  def test_int_keys(self):
    with self.assertRaisesRegex(ValueError, "bf16, f32 or float8"):
      self._call(a2=put(np.asarray(self.args[2]).astype(np.int8)), a3=None)

  def test_tables_do_not_match_batch(self):
    with self.assertRaisesRegex(ValueError, "do not match batch 2"):
      self._call(a4=put(np.asarray(self.args[4])[:1]))

  def test_head_dim_not_a_power_of_two(self):
    args = make_inputs(4, kv="bf16", batch=1, heads=4, di=24, page_size=4, max_pages=2,
                       lengths=[5])
    with self.assertRaisesRegex(ValueError, "power of two"):
      paged_index_scores(*args, backend="interpret")
    paged_index_scores(*args, backend="xla")  # the reference takes any width

  def test_bad_k_and_backend(self):
    with self.assertRaisesRegex(ValueError, "k must be >= 1"):
      paged_index_topk(*self.args, k=0, backend="xla")
    with self.assertRaisesRegex(ValueError, "backend"):
      paged_index_scores(*self.args, backend="cuda")

  def test_block_sizes(self):
    with self.assertRaisesRegex(ValueError, "power of two >= 16"):
      IndexerBlockSizes(block_k=24)


if __name__ == "__main__":
  absltest.main()
