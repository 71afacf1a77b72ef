"""INT4 weight-only matmul kernels (dense and grouped MoE) against references.

Interpret-mode classes run the Mosaic GPU kernels in the GPU interpreter on CPU
with tiny shapes and race detection; the base classes run the compiled kernels
at realistic shapes and are skipped without a GPU. The interpreter fills fresh
buffers with NaN, so an output element the kernel never writes fails the
finiteness check, and so does a grouped slab the wrapper should have dropped.
"""

import itertools
import random

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as gpu_interpret
import int4_test_data
from host_data import put
from interpret_races import keep_race_records
from pallas_kernels.int4_matmul import BlockSizes
from pallas_kernels.int4_matmul import dequantize_int4
from pallas_kernels.int4_matmul import int4_grouped_matmul
from pallas_kernels.int4_matmul import int4_grouped_matmul_reference
from pallas_kernels.int4_matmul import int4_matmul
from pallas_kernels.int4_matmul import int4_matmul_reference
from pallas_kernels.int4_matmul import pack_int4
from pallas_kernels.int4_matmul import unpack_int4
from pallas_kernels.int4_matmul.int4_matmul import grouped_schedule
from pallas_kernels.int4_matmul.int4_matmul import grouped_tile_bound
from pallas_kernels.int4_matmul.block_sizes import H200_SMEM_BYTES
from pallas_kernels.int4_matmul.block_sizes import TUNED

ON_GPU = jax.default_backend() == "gpu"
# docs/testing.md: bf16 1e-2 (long K reductions by relative norm), f32 1e-6.
TOL = {"bf16": 1e-2, "f32": 1e-6}
SCALE_DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}


def _rel_err(out, ref):
  out = np.asarray(out, np.float32)
  ref = np.asarray(ref, np.float32)
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _make(seed, m, k, n, group_size, *, experts=None, scale_dtype="bf16",
          x_dtype=jnp.bfloat16):
  """Fresh random x [M, K] (bf16 values in ``x_dtype``), packed [(E,) K//2, N], scales
  [(E,) K//g, N], on the device (made in numpy: no XLA program)."""
  x, q, s = int4_test_data.draw(seed, m, k, n, group_size, experts=experts,
                                scale_dtype=SCALE_DTYPES[scale_dtype], x_dtype=x_dtype)
  return put(x, int4_test_data.pack(q), s)


def _sampled(cases, count, seed):
  """A fixed, reproducible sample of a product of cases."""
  cases = list(cases)
  return random.Random(seed).sample(cases, min(count, len(cases)))


class _KernelTestBase(parameterized.TestCase):

  INTERPRET = False

  def setUp(self):
    super().setUp()
    if not self.INTERPRET and not ON_GPU:
      self.skipTest("compiled Pallas kernels need a GPU")
    if self.INTERPRET:
      # A failed interpreted kernel leaves state behind; start clean.
      gpu_interpret.reset_gpu_interpret_mode_state()
      self.races = keep_race_records(self)

  @property
  def backend(self):
    return "interpret" if self.INTERPRET else "pallas"

  def assert_close(self, out, ref, tol=TOL["bf16"]):
    self.assertEqual(out.shape, ref.shape)
    self.assertEqual(out.dtype, ref.dtype)
    self.assertTrue(np.isfinite(np.asarray(out, np.float32)).all(),
                    "non-finite or unwritten output")
    self.assertLessEqual(_rel_err(out, ref), tol)
    if self.INTERPRET:
      self.assertFalse(self.races.races_found(), "interpreter detected a shared-memory race")


# M (tokens), K, N, group size, scales dtype, block sizes (tile_n, tile_m,
# tile_k, k_splits). M values cover 1, non-multiples of tile_m and a full tile.
_DENSE_INTERPRET_CASES = _sampled(
    itertools.product((1, 5, 8, 13, 24), (128, 256), (64, 128), (32, 64, 128),
                      ("bf16", "f32"),
                      ((64, 8, 128, 1), (128, 8, 128, 2), (64, 16, 256, 1))),
    count=4, seed=6)
# Dequantisation overlapped with the wgmmas (BlockSizes.overlap_dequant): K 512
# in 128-row steps (both scratch slots used twice), and K 256 with a pipeline
# deeper than its two steps.
_DENSE_INTERPRET_CASES += [(13, 512, 64, 64, "bf16", (64, 8, 128, 1, 2, 0, True)),
                           (5, 256, 128, 32, "f32", (64, 8, 128, 1, 3, 0, True))]
_DENSE_GPU_CASES = list(itertools.product(
    (1, 16, 100, 256), (2048, 7168), (2048, 7168), (32, 64, 128), ("bf16",),
    (None,)))


class Int4MatmulTest(_KernelTestBase):
  """Compiled dense kernel at Kimi-like shapes (GPU only).

  The gpu marks sit on the methods, not the class: pytest collects class marks
  along the MRO, so a class mark would also skip the interpret subclass, which
  re-declares the tests without the mark.
  """

  CASES = _DENSE_GPU_CASES

  @pytest.mark.gpu
  def test_matches_reference(self):
    self._matches_reference()

  @pytest.mark.gpu
  def test_default_block_sizes(self):
    self._default_block_sizes()

  def _matches_reference(self):
    # Block sizes that do not divide a shape are shrunk by BlockSizes.fit
    # (e.g. tile_k=256 on K=128), which is itself under test here.
    for i, (m, k, n, g, sdt, bs) in enumerate(self.CASES):
      with self.subTest(m=m, k=k, n=n, g=g, sdt=sdt, bs=bs):
        x, p, s = _make(100 + i, m, k, n, g, scale_dtype=sdt)
        block_sizes = None if bs is None else BlockSizes(*bs)
        out = int4_matmul(x, p, s, group_size=g, backend=self.backend,
                          block_sizes=block_sizes)
        ref = int4_matmul_reference(x, p, s, group_size=g)
        self.assert_close(out, ref)

  def _default_block_sizes(self):
    x, p, s = _make(7, 3, 256, 128, 64)
    out = int4_matmul(x, p, s, group_size=64, backend=self.backend)
    self.assert_close(out, int4_matmul_reference(x, p, s, group_size=64))


class Int4MatmulInterpretTest(Int4MatmulTest):
  INTERPRET = True
  CASES = _DENSE_INTERPRET_CASES

  # test_default_block_sizes stays GPU-only (inherited with its mark): the
  # interpret runs of the default path are the Int4TinyModelShapes tests.

  def test_matches_reference(self):
    self._matches_reference()


def _group_cases(m, e):
  """Named expert group sizes for M tokens over E experts."""
  rng = np.random.default_rng(m * 31 + e)
  cuts = np.sort(rng.integers(0, m + 1, e - 1))
  ragged = np.diff(np.concatenate([[0], cuts, [m]]))
  return {
      # Empty experts between and at both ends.
      "empty_experts": [0] + [m // 2, 0, m - m // 2 - 3] + [0] * (e - 4),
      "one_expert_all": [0] * (e - 1) + [m],
      "ragged": list(ragged),
      # sum(group_sizes) < M: trailing rows must come back zero.
      "short": [m // 3] + [0] * (e - 2) + [m // 3],
  }


class Int4GroupedMatmulTest(_KernelTestBase):
  """Compiled grouped kernel at Kimi-expert-like shapes (GPU only)."""

  # M, K, N, E, group size, block sizes (tile_n, tile_m, tile_k)
  SHAPES = [(64, 7168, 2048, 8, 128, None), (256, 2048, 7168, 16, 64, None)]
  # Groupings per shape (same index as SHAPES).
  GROUPINGS = (("empty_experts", "one_expert_all", "ragged", "short"),) * 2

  @pytest.mark.gpu
  def test_matches_reference(self):
    self._matches_reference()

  def _matches_reference(self):
    for i, (m, k, n, e, g, bs) in enumerate(self.SHAPES):
      for name in self.GROUPINGS[i]:
        with self.subTest(m=m, k=k, n=n, e=e, g=g, grouping=name):
          gs = jax.device_put(np.asarray(_group_cases(m, e)[name], np.int32))
          self.assertEqual(gs.shape, (e,))
          x, p, s = _make(200 + i, m, k, n, g, experts=e)
          block_sizes = None if bs is None else BlockSizes(*bs)
          out = int4_grouped_matmul(x, p, s, gs, group_size=g,
                                    backend=self.backend,
                                    block_sizes=block_sizes)
          ref = int4_grouped_matmul_reference(x, p, s, gs, group_size=g)
          self.assert_close(out, ref)
          total = int(np.asarray(gs).sum())
          np.testing.assert_array_equal(np.asarray(out, np.float32)[total:], 0)


class Int4GroupedMatmulInterpretTest(Int4GroupedMatmulTest):
  INTERPRET = True
  # M=13 and 19 are not multiples of tile_m=8, so experts start inside a
  # tile_m stretch of rows and one expert of 19 rows takes three tiles (8, 8,
  # 3 rows: the row-count TMAs of every size). The third shape runs two n
  # tiles on three persistent CTAs, so each CTA walks several work items.
  SHAPES = [(13, 128, 64, 4, 32, (64, 8, 128)),
            (19, 256, 64, 5, 128, (64, 8, 128)),
            (21, 128, 128, 6, 64, (64, 16, 128, 1, 2, 3)),
            (21, 384, 64, 6, 64, (64, 8, 128, 1, 2, 2, True))]  # overlapped dequant
  GROUPINGS = (("empty_experts", "short"), ("one_expert_all",), ("ragged",), ("ragged",))

  def test_matches_reference(self):
    self._matches_reference()


class Int4TinyModelShapesInterpretTest(_KernelTestBase):
  """Shapes of the tiny test models (d_model 64, moe_ffn 32, f32 activations).

  They are not multiples of the kernels' tiles, so the wrappers zero-pad K to
  128 and N to 64 and round x to bf16; the result must still match the f32
  reference and come back [M, N] in x's dtype.
  """

  INTERPRET = True

  def test_dense_unaligned_f32(self):
    x, p, s = _make(11, 3, 64, 32, 32, x_dtype=jnp.float32)
    out = int4_matmul(x, p, s, group_size=32, backend=self.backend)
    self.assert_close(out, int4_matmul_reference(x, p, s, group_size=32))

  def test_grouped_unaligned_f32(self):
    # 5 tokens x top-2 over 8 experts (two empty), down projection 32 -> 64.
    x, p, s = _make(12, 10, 32, 64, 32, experts=8, x_dtype=jnp.float32)
    gs = put(np.array([2, 0, 3, 1, 0, 2, 1, 1], np.int32))
    out = int4_grouped_matmul(x, p, s, gs, group_size=32, backend=self.backend)
    self.assert_close(
        out, int4_grouped_matmul_reference(x, p, s, gs, group_size=32))


class GroupedScheduleTest(parameterized.TestCase):
  """The grouped kernel's tiles: one expert each, every row written once."""

  @parameterized.parameters(
      (37, 6, 8, 0), (64, 48, 8, 1), (64, 8, 16, 2), (5, 16, 8, 3), (300, 5, 128, 4))
  def test_tiles_cover_rows_once_without_mixing_experts(self, m, e, tile_m, seed):
    rng = np.random.default_rng(seed)
    bound = grouped_tile_bound(m, e, tile_m)
    for trial in range(20):
      # Ragged, with empty experts; some sums short of M, one past it.
      gs = rng.multinomial(m - trial % 3 * (m // 4), rng.dirichlet(np.ones(e) * 0.3))
      if trial == 19:
        gs[-1] += 7
      meta = np.asarray(grouped_schedule(put(gs.astype(np.int32)), m, tile_m, bound))
      expert, window, offset, rows, used = meta
      self.assertTrue((used == used[0]).all())
      self.assertLessEqual(used[0], bound)
      np.testing.assert_array_equal(rows[used[0]:], 0)
      self.assertTrue((rows[:used[0]] > 0).all())
      np.testing.assert_array_equal(window % 8, 0)  # x boxes start on aligned rows
      self.assertTrue((offset + rows <= tile_m).all())  # stored rows lie in the window
      self.assertTrue((window + tile_m <= m + tile_m).all())  # inside the padded x
      owner = np.full(m, -2)
      bounds = np.concatenate([[0], np.cumsum(gs)])
      for t in range(used[0]):
        span = np.arange(window[t] + offset[t], window[t] + offset[t] + rows[t])
        self.assertTrue((owner[span] == -2).all(), "a row written twice")
        owner[span] = expert[t]
      want = np.searchsorted(bounds, np.arange(m), side="right") - 1
      want[np.arange(m) >= bounds[-1]] = -1  # rows past sum(group_sizes): zero tiles
      np.testing.assert_array_equal(owner, want)


# The helpers under test, jitted: one program per shape where eagerly each of their jnp
# operations compiled one.
_pack = jax.jit(pack_int4)
_unpack = jax.jit(unpack_int4)
_dequantize = jax.jit(dequantize_int4, static_argnums=(2, 3))


class ReferenceTest(parameterized.TestCase):
  """The plain-jnp references and helpers the kernels are checked against."""

  def test_pack_roundtrip_and_nibble_order(self):
    q = put(np.random.default_rng(1).integers(-8, 8, (2, 64, 24), dtype=np.int8))
    packed = _pack(q)
    self.assertEqual(packed.shape, (2, 32, 24))
    self.assertEqual(packed.dtype, jnp.uint8)
    np.testing.assert_array_equal(_unpack(packed), q)
    # Byte row i: row 2i in bits 0-3, row 2i+1 in bits 4-7, two's complement.
    p = np.asarray(packed, np.int32)
    qn = np.asarray(q, np.int32) & 0xF
    np.testing.assert_array_equal(p & 0xF, qn[:, 0::2])
    np.testing.assert_array_equal(p >> 4, qn[:, 1::2])
    np.testing.assert_array_equal(
        _pack(put(np.array([[-8], [7]], np.int8))), [[0x78]])

  @parameterized.parameters(32, 64, 128)
  def test_dequantize_f32(self, g):
    _, q, s = int4_test_data.draw(3, 4, 256, 16, g, scale_dtype=jnp.float32)
    want = q * np.repeat(np.asarray(s, np.float64), g, axis=0)
    p, s = put(int4_test_data.pack(q), s)
    got = _dequantize(p, s, g, jnp.float32)
    np.testing.assert_allclose(np.asarray(got), want, rtol=TOL["f32"], atol=0)

  def test_matmul_reference_matches_numpy(self):
    x, q, s = int4_test_data.draw(4, 6, 256, 32, 64, scale_dtype=jnp.float32)
    w = q * np.repeat(np.asarray(s, np.float64), 64, axis=0)
    want = np.asarray(x, np.float64) @ w
    x, p, s = put(x, int4_test_data.pack(q), s)
    got = int4_matmul_reference(x, p, s, group_size=64)
    self.assertEqual(got.dtype, jnp.bfloat16)
    self.assertLessEqual(_rel_err(got, want), TOL["bf16"])

  def test_grouped_reference_per_expert(self):
    gs = [3, 0, 5, 2]
    x, p, s = _make(5, 12, 128, 32, 32, experts=4)
    out = np.asarray(int4_grouped_matmul_reference(
        x, p, s, put(np.asarray(gs, np.int32)), group_size=32), np.float32)
    xn, pn, sn = np.asarray(x), np.asarray(p), np.asarray(s)
    start = 0
    for e, size in enumerate(gs):
      ref = int4_matmul_reference(*put(xn[start:start + size], pn[e], sn[e]),
                                  group_size=32)
      np.testing.assert_array_equal(out[start:start + size],
                                    np.asarray(ref, np.float32))
      start += size
    np.testing.assert_array_equal(out[start:], 0)

  def test_xla_backend_is_reference_and_cpu_default(self):
    x, p, s = _make(6, 5, 128, 64, 32)
    ref = int4_matmul_reference(x, p, s, group_size=32)
    np.testing.assert_array_equal(
        int4_matmul(x, p, s, group_size=32, backend="xla"), ref)
    if not ON_GPU:
      np.testing.assert_array_equal(int4_matmul(x, p, s, group_size=32), ref)

  def test_bad_inputs_raise(self):
    x, p, s = _make(8, 4, 128, 64, 32)
    xn, pn, sn = np.asarray(x), np.asarray(p), np.asarray(s)
    with self.assertRaisesRegex(ValueError, "group_size"):
      int4_matmul(x, p, s, group_size=16)
    with self.assertRaisesRegex(ValueError, "backend"):
      int4_matmul(x, p, s, group_size=32, backend="triton")
    with self.assertRaisesRegex(ValueError, "K//2"):
      int4_matmul(put(xn[:, :64]), p, s, group_size=32)
    with self.assertRaisesRegex(ValueError, "floating point"):
      int4_matmul(put(xn.astype(np.int32)), p, s, group_size=32,
                  backend="interpret")
    with self.assertRaisesRegex(ValueError, "group_sizes"):
      int4_grouped_matmul(x, *put(pn[None], sn[None], np.array([1, 2], np.int32)),
                          group_size=32, backend="xla")
    with self.assertRaisesRegex(ValueError, "multiple of 64"):
      BlockSizes(tile_n=96)


class BlockSizesTest(parameterized.TestCase):

  @parameterized.parameters(
      (1, 2048, 7168, False), (16, 7168, 2048, False), (256, 2048, 7168, False),
      (64, 2048, 7168, True), (200, 7168, 2048, True))
  def test_h200_defaults_fit(self, m, n, k, grouped):
    bs = BlockSizes.get_default(m, n, k, grouped=grouped,
                                device_kind="NVIDIA H200")
    self.assertEqual(n % bs.tile_n, 0)
    self.assertEqual(k % bs.tile_k, 0)
    self.assertEqual((k // bs.tile_k) % bs.k_splits, 0)
    self.assertLessEqual(bs.tile_m, max(8, -(-m // 8) * 8))

  def test_decode_and_prefill_differ(self):
    dec = BlockSizes.get_default(8, 2048, 7168, device_kind="NVIDIA H200")
    pre = BlockSizes.get_default(256, 2048, 7168, device_kind="NVIDIA H200")
    self.assertGreater(dec.k_splits, 1)  # decode fills SMs by splitting K
    self.assertGreater(pre.tile_m, dec.tile_m)

  @parameterized.parameters(
      # (rows, experts): mean rows per expert 1, 8, 64 and Kimi's 4096-token chunk.
      (48, 48, 8, 128), (384, 48, 16, 128), (3072, 48, 128, 64), (4096, 48, 128, 64),
      (40, 48, 8, 128))
  def test_grouped_tile_m_follows_rows_per_expert(self, m, e, tile_m, tile_n):
    bs = BlockSizes.get_default(m, 7168, 2048, grouped=True, experts=e,
                                device_kind="NVIDIA H200")
    self.assertEqual((bs.tile_m, bs.tile_n), (tile_m, tile_n))

  def test_tuned_table_fits_hopper_smem(self):
    # Worst case: group 32 (most scale rows per step) with f32 scales.
    for (kind, op, shape_class), bs in TUNED.items():
      with self.subTest(kind=kind, op=op, shape_class=shape_class):
        self.assertLessEqual(
            bs.smem_bytes(group_size=32, scale_bytes=4, grouped=op == "grouped"),
            H200_SMEM_BYTES)
        if kind == "NVIDIA H200" and shape_class == "decode":
          # Decode rows are sized for two CTAs per SM (see block_sizes.TUNED).
          self.assertLessEqual(
              bs.smem_bytes(group_size=32, scale_bytes=4,
                            grouped=op == "grouped"), H200_SMEM_BYTES // 2)

  def test_unknown_device_uses_default_row(self):
    bs = BlockSizes.get_default(4, 128, 256, device_kind="Some GPU")
    self.assertEqual(bs, BlockSizes(128, 8, 128, 1, 2))


if __name__ == "__main__":
  absltest.main()
