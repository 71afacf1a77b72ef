"""Weight formats, quantisers, reference matmuls and GPTQ (mlkit.quant).

References are independent: int4 nibbles are unpacked with numpy integer
arithmetic and products are computed in float64, so a wrong nibble order, sign
extension, scale layout or accumulation would show.
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from mlkit.quant import (Fp8Weight, Int4Weight, dequantize, fp8_grouped_matmul_reference,
                         fp8_matmul_reference, grouped_matmul, int4_grouped_matmul_reference,
                         int4_matmul_reference, matmul, pack_int4, quantize_fp8, quantize_int4,
                         unpack_int4)
from mlkit.quant.gptq import (CalibrationStats, calibration_stats, gptq_quantize_int4,
                              merge_calibration)

F32_TOL = 1e-6
# K-long f32 reductions against a float64 reference: rounding grows ~sqrt(K) eps.
F32_REDUCTION_TOL = 1e-5
BF16_TOL = 1e-2


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert np.all(np.isfinite(a)), "NaN/inf never passes"
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _np_unpack(packed) -> np.ndarray:
  """Independent unpack: low nibble -> even rows, high nibble -> odd rows, two's complement."""
  p = np.asarray(packed).astype(np.int32)
  lo, hi = p & 15, p >> 4
  lo, hi = np.where(lo >= 8, lo - 16, lo), np.where(hi >= 8, hi - 16, hi)
  out = np.empty(p.shape[:-2] + (2 * p.shape[-2], p.shape[-1]), np.int32)
  out[..., 0::2, :], out[..., 1::2, :] = lo, hi
  return out


def _np_dequant_int4(w: Int4Weight) -> np.ndarray:
  s = np.repeat(np.asarray(w.scales, np.float64), w.group_size, axis=-2)
  return _np_unpack(w.packed) * s


def _np_dequant_fp8(w: Fp8Weight) -> np.ndarray:
  v = np.asarray(w.values).astype(np.float64)  # e4m3 -> f64 on host: exact
  s = np.asarray(w.scales, np.float64)
  if w.block_size is None:
    return v * s[..., None, :]
  k, n = v.shape[-2:]
  s = np.repeat(np.repeat(s, 128, axis=-2), 128, axis=-1)[..., :k, :n]
  return v * s


def _np_normal(seed, shape, scale=1.0) -> np.ndarray:
  """Standard normal f32 draws times ``scale``, on host."""
  draws = np.random.default_rng(seed).standard_normal(shape)
  return np.asarray(draws, np.float32) * np.float32(scale)


def _normal(seed, shape, dtype=jnp.float32, scale=1.0):
  # numpy draws, cast on host and placed on the device: jax.random would compile a threefry
  # program per shape on CPU, and each eager cast or multiply a program of its own.
  return _device(_np_normal(seed, shape, scale), dtype)


def _device(a, dtype=None):
  """A host array placed on the device as ``dtype``, cast by numpy and placed by device_put:
  no XLA program (jnp.asarray compiles a `stage` program per shape and dtype)."""
  return jax.device_put(np.asarray(a, dtype))


class PackTest(parameterized.TestCase):

  def test_round_trip_every_value_pair(self):
    # Every (low, high) pair of int4 values: 16 x 16 columns, K = 2.
    lo, hi = np.meshgrid(np.arange(-8, 8), np.arange(-8, 8), indexing="ij")
    q = np.stack([lo.ravel(), hi.ravel()]).astype(np.int8)  # [2, 256]
    packed = pack_int4(_device(q))
    self.assertEqual(packed.dtype, jnp.uint8)
    self.assertEqual(packed.shape, (1, 256))
    # Nibble order: row 0 in bits 0-3, row 1 in bits 4-7.
    expected = (q[0].astype(np.int32) & 15) | ((q[1].astype(np.int32) & 15) << 4)
    np.testing.assert_array_equal(np.asarray(packed)[0], expected)
    np.testing.assert_array_equal(np.asarray(unpack_int4(packed)), q)
    np.testing.assert_array_equal(_np_unpack(packed), q)

  def test_round_trip_experts(self):
    q = _device(np.random.default_rng(0).integers(-8, 8, (3, 8, 5)), np.int8)
    packed = pack_int4(q)
    self.assertEqual(packed.shape, (3, 4, 5))
    np.testing.assert_array_equal(np.asarray(unpack_int4(packed)), np.asarray(q))
    np.testing.assert_array_equal(np.asarray(unpack_int4(jax.jit(pack_int4)(q))), np.asarray(q))

  def test_same_layout_as_the_int4_kernels(self):
    # pallas_kernels.int4_matmul reads Int4Weight's buffers directly.
    from pallas_kernels.int4_matmul import reference as kernel_ref
    w = _normal(11, (2, 64, 8))
    qw = quantize_int4(w, 32)
    codes = unpack_int4(qw.packed)
    np.testing.assert_array_equal(np.asarray(kernel_ref.pack_int4(codes)), np.asarray(qw.packed))
    np.testing.assert_array_equal(np.asarray(kernel_ref.dequantize_int4(qw.packed, qw.scales, 32)),
                                  np.asarray(dequantize(qw, jnp.float32)))

  def test_pack_odd_k_raises(self):
    with self.assertRaisesRegex(ValueError, "K=3 must be even"):
      pack_int4(_device(np.zeros((3, 4), np.int8)))


class Int4QuantTest(parameterized.TestCase):

  @parameterized.parameters((32, "bfloat16", False), (64, "float32", True),
                            (128, "bfloat16", True), (128, "float32", False))
  def test_error_bound(self, group_size, scale_dtype, experts):
    shape = (2, 256, 24) if experts else (256, 24)
    w = _normal(group_size, shape, scale=0.05)
    qw = quantize_int4(w, group_size, scale_dtype=jnp.dtype(scale_dtype))
    self.assertEqual(qw.packed.shape, shape[:-2] + (128, 24))
    self.assertEqual(qw.scales.shape, shape[:-2] + (256 // group_size, 24))
    self.assertEqual(qw.scales.dtype, jnp.dtype(scale_dtype))
    self.assertEqual(qw.shape, shape)
    codes = _np_unpack(qw.packed)
    self.assertLessEqual(np.abs(codes).max(), 7)  # symmetric RTN range
    self.assertEqual(np.abs(codes).max(), 7)  # each group's absmax maps to +-7
    s = np.repeat(np.asarray(qw.scales, np.float64), group_size, axis=-2)
    err = np.abs(_np_dequant_int4(qw) - np.asarray(w, np.float64))
    # Half a stored step, plus slack for a bf16 scale rounded below absmax / 7.
    bound = s * (0.5 + (2.0 ** -8 * 7 if scale_dtype == "bfloat16" else 1e-6))
    self.assertTrue(np.all(err <= bound + 1e-12), float((err - bound).max()))
    # dequantize() agrees with the independent numpy one.
    np.testing.assert_allclose(np.asarray(dequantize(qw, jnp.float32)), _np_dequant_int4(qw),
                               rtol=F32_TOL, atol=0)

  def test_zero_group_gives_zero_codes(self):
    w = _np_normal(1, (64, 8))
    w[:32, 3] = 0.0
    qw = quantize_int4(_device(w), 32)
    self.assertEqual(float(np.asarray(qw.scales)[0, 3]), 0.0)
    deq = np.asarray(dequantize(qw, jnp.float32))
    self.assertTrue(np.all(np.isfinite(deq)))
    np.testing.assert_array_equal(deq[:32, 3], 0.0)

  def test_default_group_size_is_128(self):
    qw = quantize_int4(_normal(2, (256, 8)))
    self.assertEqual(qw.group_size, 128)
    self.assertEqual(qw.scales.dtype, jnp.bfloat16)

  def test_group_size_not_dividing_k_names_param(self):
    with self.assertRaisesRegex(ValueError, r"wq_b: group_size 128 does not divide input dim K=192"):
      quantize_int4(_normal(0, (192, 8)), 128, name="wq_b")

  def test_odd_k_names_param(self):
    with self.assertRaisesRegex(ValueError, r"w_down: input dim K=33 is odd"):
      quantize_int4(_normal(0, (33, 8)), 32, name="w_down")

  @parameterized.parameters(float("nan"), float("inf"), -float("inf"))
  def test_non_finite_names_param(self, bad):
    w = _np_normal(0, (64, 8))
    w[5, 2] = bad
    w = _device(w)
    with self.assertRaisesRegex(ValueError, r"layers/1/ffn/w_up: weight has non-finite"):
      quantize_int4(w, 32, name="layers/1/ffn/w_up")
    with self.assertRaisesRegex(ValueError, r"layers/1/ffn/w_up: weight has non-finite"):
      quantize_fp8(w, name="layers/1/ffn/w_up")

  def test_bad_group_size_and_rank(self):
    with self.assertRaisesRegex(ValueError, r"wo: group_size must be one of"):
      quantize_int4(_normal(0, (96, 8)), 48, name="wo")
    with self.assertRaisesRegex(ValueError, r"norm: only 2-D"):
      quantize_int4(_normal(0, (64,)), 32, name="norm")
    with self.assertRaisesRegex(ValueError, r"Int4Weight.group_size"):
      Int4Weight(packed=_device(np.zeros((8, 2), np.uint8)), scales=_device(np.zeros((1, 2), np.float32)),
                 group_size=16)


class Fp8QuantTest(parameterized.TestCase):

  @parameterized.parameters((None, (200, 130)), (128, (200, 130)), (128, (2, 64, 40)),
                            (None, (2, 64, 40)))
  def test_error_bound(self, block_size, shape):
    w = _normal(3, shape, scale=0.02)
    qw = quantize_fp8(w, block_size)
    self.assertEqual(qw.values.dtype, jnp.float8_e4m3fn)
    self.assertEqual(qw.scales.dtype, jnp.float32)
    *lead, k, n = shape
    expected = tuple(lead) + ((n,) if block_size is None else (-(-k // 128), -(-n // 128)))
    self.assertEqual(qw.scales.shape, expected)
    deq = _np_dequant_fp8(qw)
    w64 = np.asarray(w, np.float64)
    s = np.asarray(dequantize(Fp8Weight(_device(np.ones(shape), jnp.float8_e4m3fn), qw.scales,
                                        block_size)), np.float64)
    # e4m3: half-ulp relative error 2^-4 for normals, absolute 2^-10 * scale for subnormals.
    bound = 2.0 ** -4 * np.abs(w64) + 2.0 ** -10 * s
    self.assertTrue(np.all(np.abs(deq - w64) <= bound * (1 + 1e-6)))
    self.assertLessEqual(_rel(deq, w64), 5e-2)
    np.testing.assert_allclose(np.asarray(dequantize(qw)), deq, rtol=F32_TOL, atol=0)
    # No value saturates: every block/column's absmax maps to at most 448.
    self.assertLessEqual(float(np.max(np.abs(np.asarray(qw.values).astype(np.float32)))), 448.0)

  def test_bad_block_size(self):
    with self.assertRaisesRegex(ValueError, r"wq: fp8 block_size must be None or 128"):
      quantize_fp8(_normal(0, (64, 8)), 64, name="wq")
    with self.assertRaisesRegex(ValueError, r"Fp8Weight.block_size"):
      Fp8Weight(values=_device(np.zeros((4, 4)), jnp.float8_e4m3fn),
                scales=_device(np.ones((4,), np.float32)), block_size=64)


class ReferenceMatmulTest(parameterized.TestCase):

  def _weight(self, fmt, shape, group_size=32):
    w = _normal(7, shape, scale=0.1)
    if fmt == "int4":
      qw = quantize_int4(w, group_size)
      return qw, _np_dequant_int4(qw)
    qw = quantize_fp8(w, 128 if fmt == "fp8_block" else None)
    return qw, _np_dequant_fp8(qw)

  @parameterized.product(fmt=["int4", "fp8_block", "fp8_channel"], dtype=["float32", "bfloat16"])
  def test_matmul_equals_dequantised_dense(self, fmt, dtype):
    qw, dense = self._weight(fmt, (192, 48))
    x = _normal(8, (2, 5, 192), jnp.dtype(dtype))
    ref_fn = int4_matmul_reference if fmt == "int4" else fp8_matmul_reference
    out = ref_fn(x, qw)
    self.assertEqual(out.shape, (2, 5, 48))
    self.assertEqual(out.dtype, jnp.dtype(dtype))
    if dtype == "float32":
      expected = np.asarray(x, np.float64) @ dense
      self.assertLessEqual(_rel(out, expected), F32_REDUCTION_TOL)
    else:
      # The weight is rounded to bf16 once, then accumulated in f32.
      w_bf16 = dense.astype(np.float32).astype(jnp.bfloat16).astype(np.float64)
      expected = np.asarray(x, np.float64) @ w_bf16
      self.assertLessEqual(_rel(out, expected), BF16_TOL)
    # The model's entry point dispatches on the weight's type to this reference.
    np.testing.assert_array_equal(np.asarray(matmul(x, qw)), np.asarray(out))
    out32 = matmul(x, qw, out_dtype=jnp.float32)
    self.assertEqual(out32.dtype, jnp.float32)
    jitted = jax.jit(lambda x, w: matmul(x, w))(x, qw)
    np.testing.assert_allclose(np.asarray(jitted, np.float32), np.asarray(out, np.float32),
                               rtol=F32_REDUCTION_TOL if dtype == "float32" else BF16_TOL, atol=1e-5)

  def test_plain_array_dispatch_unchanged(self):
    x, w = _normal(0, (3, 16)), _normal(1, (16, 4))
    self.assertLessEqual(_rel(matmul(x, w), np.asarray(x, np.float64) @ np.asarray(w)),
                         F32_REDUCTION_TOL)

  @parameterized.parameters(("int4", (3, 0, 5, 0)), ("fp8_block", (0, 0, 8, 2)),
                            ("fp8_channel", (3, 0, 5, 0)), ("int4", (0, 0, 0, 0)))
  def test_grouped_equals_per_expert_loop(self, fmt, sizes):
    E, K, N, M = 4, 64, 24, 12  # M > sum(sizes): trailing rows must come back zero
    qw, dense = self._weight(fmt, (E, K, N))
    x = _normal(9, (M, K))
    gs = _device(sizes, np.int32)
    ref_fn = int4_grouped_matmul_reference if fmt == "int4" else fp8_grouped_matmul_reference
    out = np.asarray(ref_fn(x, qw, gs), np.float64)
    expected = np.zeros((M, N))
    x64, off = np.asarray(x, np.float64), 0
    for e, n in enumerate(sizes):
      expected[off:off + n] = x64[off:off + n] @ dense[e]
      off += n
    np.testing.assert_allclose(out, expected, rtol=F32_REDUCTION_TOL, atol=F32_REDUCTION_TOL)
    np.testing.assert_array_equal(out[sum(sizes):], 0.0)
    jitted = jax.jit(lambda x, w, g: grouped_matmul(x, w, g))(x, qw, gs)
    np.testing.assert_allclose(np.asarray(jitted, np.float64), expected,
                               rtol=F32_REDUCTION_TOL, atol=F32_REDUCTION_TOL)

  def test_k_mismatch_raises(self):
    qw, _ = self._weight("int4", (64, 8))
    with self.assertRaisesRegex(ValueError, "x has K=32 but the weight has K=64"):
      matmul(_normal(0, (2, 32)), qw)

  def test_formats_are_pytrees_with_static_fields(self):
    qw, _ = self._weight("int4", (64, 8))
    leaves, treedef = jax.tree_util.tree_flatten(qw)
    self.assertLen(leaves, 2)
    self.assertEqual(jax.tree_util.tree_unflatten(treedef, leaves).group_size, 32)
    fw, _ = self._weight("fp8_channel", (64, 8))
    self.assertIsNone(jax.tree_util.tree_map(lambda a: a, fw).block_size)


def _outlier_acts(seed, m, k):
  """Correlated activations where ~6% of channels are 20x larger (LLM-style outliers)."""
  rng = np.random.default_rng(0)  # the same channel mix and outliers for every draw
  mix = rng.standard_normal((k, k)) / k ** 0.5 + np.eye(k)
  gain = np.where(rng.uniform(size=k) < 0.06, 20.0, 1.0)
  x = np.random.default_rng(seed).standard_normal((m, k))
  return _device((x @ mix) * gain, np.float32)


class GptqTest(parameterized.TestCase):

  def test_reduces_output_error_vs_rtn_on_outliers(self):
    K, N = 128, 32
    w = _normal(4, (K, N), scale=1 / K ** 0.5)
    calib, held_out = _outlier_acts(1, 512, K), _outlier_acts(2, 256, K)
    rtn = quantize_int4(w, 32)
    gptq = gptq_quantize_int4(w, calibration_stats(calib), 32)
    self.assertIsInstance(gptq, Int4Weight)
    self.assertEqual(gptq.packed.shape, rtn.packed.shape)
    self.assertLessEqual(np.abs(_np_unpack(gptq.packed)).max(), 7)
    y = np.asarray(held_out, np.float64) @ np.asarray(w, np.float64)
    err = lambda q: _rel(np.asarray(held_out, np.float64) @ _np_dequant_int4(q), y)
    e_rtn, e_gptq = err(rtn), err(gptq)
    self.assertLess(e_gptq, 0.85 * e_rtn, (e_gptq, e_rtn))
    # Raw activations work as calibration too (same stats).
    again = gptq_quantize_int4(w, calib, 32)
    np.testing.assert_array_equal(np.asarray(again.packed), np.asarray(gptq.packed))

  def test_experts_and_empty_expert_falls_back_to_rtn(self):
    E, K, N = 3, 64, 16
    w = _np_normal(5, (E, K, N), scale=1 / K ** 0.5)
    x = np.asarray(_outlier_acts(3, 64, K))
    xtx = np.stack([x.T @ x, np.zeros((K, K), np.float32), x.T @ x])  # f32 [E, K, K]
    stats = CalibrationStats(xtx=_device(xtx), count=_device([64.0, 0.0, 64.0], np.float32))
    w0, w = _device(w[0]), _device(w)
    q = gptq_quantize_int4(w, stats, 32, scale_dtype=jnp.float32)
    rtn = quantize_int4(w, 32, scale_dtype=jnp.float32)
    self.assertEqual(q.scales.dtype, jnp.float32)
    # Expert 1 saw no tokens: identity Hessian, under which GPTQ is exactly RTN.
    q_packed, rtn_packed = np.asarray(q.packed), np.asarray(rtn.packed)
    np.testing.assert_array_equal(q_packed[1], rtn_packed[1])
    self.assertFalse(np.array_equal(q_packed[0], rtn_packed[0]))
    # Expert 0 equals a 2-D GPTQ on its own stats.
    q0 = gptq_quantize_int4(w0, CalibrationStats(_device(xtx[0]), jnp.float32(64)), 32,
                            scale_dtype=jnp.float32)
    np.testing.assert_array_equal(q_packed[0], np.asarray(q0.packed))

  def test_merge_calibration_sums(self):
    a, b = calibration_stats(_normal(1, (5, 8))), calibration_stats(_normal(2, (7, 8)))
    both = calibration_stats(_device(np.concatenate([_np_normal(1, (5, 8)), _np_normal(2, (7, 8))])))
    m = merge_calibration({"w": a}, {"w": b}, {"v": a})
    np.testing.assert_allclose(np.asarray(m["w"].xtx), np.asarray(both.xtx), rtol=1e-5, atol=1e-5)
    self.assertEqual(float(m["w"].count), 12.0)
    self.assertEqual(float(m["v"].count), 5.0)

  def test_stats_shape_mismatch_names_param(self):
    with self.assertRaisesRegex(ValueError, r"w_gate: calibration xtx has shape \(32, 32\)"):
      gptq_quantize_int4(_normal(0, (64, 8)), CalibrationStats(_device(np.eye(32), np.float32), jnp.float32(1)), 32,
                         name="w_gate")

  def test_errors_match_rtn(self):
    with self.assertRaisesRegex(ValueError, r"wo: group_size 64 does not divide input dim K=96"):
      gptq_quantize_int4(_normal(0, (96, 8)), _normal(1, (10, 96)), 64, name="wo")
    w = _np_normal(0, (64, 8))
    w[0, 0] = np.nan
    w = _device(w)
    with self.assertRaisesRegex(ValueError, r"wo: weight has non-finite"):
      gptq_quantize_int4(w, _normal(1, (10, 64)), 32, name="wo")
    with self.assertRaisesRegex(ValueError, r"norm: only 2-D \[K, N\] or 3-D \[E, K, N\]"):
      gptq_quantize_int4(_normal(0, (64,)), _normal(1, (10, 64)), 32, name="norm")


if __name__ == "__main__":
  absltest.main()
