"""The FP8 grouped (MoE) kernel: interpret mode against its jnp reference and a float64
ground truth, its errors, its use by ``mlkit.quant.grouped_matmul``, and its compiles for
an H200 at GLM 5.2's expert shapes (pallas_kernels.targets: no spills, the shared memory
the block sizes say)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from mlkit.quant import grouped_matmul, quantize_fp8
from pallas_kernels.fp8_matmul import (fp8_grouped_matmul, fp8_grouped_matmul_reference,
                                       grouped_block_sizes)
from pallas_kernels.fp8_matmul.grouped import smem_bytes
from pallas_kernels.h200 import kernel_readings as kc

import h200_compile_cases
from host_data import put


def _operands_np(e, k, n, group_sizes, m, seed, x_dtype=jnp.bfloat16):
  """Random x, fp8 values spanning e4m3's range and a distinct scale per 128 x 128 block
  (so a wrong block index shows), in numpy."""
  rng = np.random.default_rng(seed)
  x = np.asarray(rng.standard_normal((m, k)), x_dtype)
  values = np.asarray(rng.standard_normal((e, k, n)) * 60, np.float32).astype(jnp.float8_e4m3fn)
  scales = np.asarray(rng.uniform(0.25, 4.0, (e, -(-k // 128), -(-n // 128))) * 1e-2,
                      np.float32)
  return x, values, scales, np.asarray(group_sizes, np.int32)


def _operands(*args, **kwargs):
  """``_operands_np``'s arrays on the device (placed, no XLA program)."""
  return put(*_operands_np(*args, **kwargs))


def _ground_truth(x, values, scales, group_sizes):
  """float64, one expert at a time: x and each dequantised weight rounded to bf16 first,
  as the kernel feeds its MMA (numpy on the host)."""
  k, n = values.shape[1:]
  xb = np.asarray(np.asarray(x).astype(jnp.bfloat16), np.float64)
  s = np.repeat(np.repeat(np.asarray(scales, np.float64), 128, 1), 128, 2)[:, :k, :n]
  w = np.asarray((np.asarray(values, np.float64) * s).astype(np.float32).astype(jnp.bfloat16),
                 np.float64)
  out = np.zeros((x.shape[0], n))
  start = 0
  for e, g in enumerate(np.asarray(group_sizes)):
    out[start:start + g] = xb[start:start + g] @ w[e]
    start += g
  return out


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


class Fp8GroupedInterpretTest(parameterized.TestCase):

  @parameterized.named_parameters(
      # An empty expert and rows past sum(group_sizes) (zeros).
      ("ragged", 4, 256, 128, [5, 0, 11, 4], 24),
      # N = 192: tile_n 64, the second and third tiles read scale columns 0 and 1.
      ("n_tiles_of_64", 3, 256, 192, [7, 9, 2], 18),
      # K = 200, N = 100: padded to 256 and 128 inside the last scale block.
      ("unaligned", 2, 200, 100, [3, 6], 9),
      ("one_row", 4, 128, 128, [0, 0, 1, 0], 1),
      ("many_rows_per_expert", 2, 384, 128, [40, 30], 72),
  )
  def test_matches_reference_and_ground_truth(self, e, k, n, group_sizes, m):
    x, values, scales, gs = _operands(e, k, n, group_sizes, m, seed=k + n + m)
    out = fp8_grouped_matmul(x, values, scales, gs, backend="interpret")
    ref = fp8_grouped_matmul_reference(x, values, scales, gs)
    truth = _ground_truth(x, values, scales, gs)
    self.assertEqual((out.shape, out.dtype), ((m, n), jnp.bfloat16))
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    total = int(np.asarray(gs).sum())
    self.assertTrue(np.all(np.asarray(out[total:], np.float32) == 0))
    self.assertLessEqual(_rel(out[:total], truth[:total]), 1e-2)
    self.assertLessEqual(_rel(ref[:total], truth[:total]), 1e-2)
    np.testing.assert_allclose(out, ref, rtol=1e-2, atol=1e-2 * np.abs(truth).max())

  def test_f32_activations_come_back_f32(self):
    x, values, scales, gs = _operands(2, 128, 128, [3, 5], 8, seed=3, x_dtype=jnp.float32)
    out = fp8_grouped_matmul(x, values, scales, gs, backend="interpret")
    self.assertEqual(out.dtype, jnp.float32)
    self.assertLessEqual(_rel(out, _ground_truth(x, values, scales, gs)), 1e-2)

  def test_a_wrong_scale_is_seen(self):
    """The test can fail: one block's scale doubled moves that block's columns only."""
    x, values, scales, gs = _operands_np(2, 256, 256, [4, 4], 8, seed=5)
    wrong = scales.copy()
    wrong[1, 1, 0] *= 2.0
    out = fp8_grouped_matmul(*put(x, values, wrong, gs), backend="interpret")
    out = np.asarray(out, np.float32)
    truth = _ground_truth(x, values, scales, gs)
    self.assertGreater(_rel(out[4:, :128], truth[4:, :128]), 0.1)
    self.assertLessEqual(_rel(out[:4], truth[:4]), 1e-2)
    self.assertLessEqual(_rel(out[4:, 128:], truth[4:, 128:]), 1e-2)


class Fp8GroupedErrorsTest(parameterized.TestCase):

  def test_bad_operands_raise_naming_them(self):
    x, values, scales, gs = _operands_np(2, 128, 128, [2, 2], 4, seed=0)
    for args, pattern in [
        ((x[0], values, scales, gs), "x must be"),
        ((x.astype(jnp.float8_e4m3fn), values, scales, gs), "x must be"),
        ((x, values.astype(jnp.bfloat16), scales, gs), "values must be float8_e4m3fn"),
        ((x[:, :64], values, scales, gs), "K=64"),
        ((x, values, scales[:, :, :0], gs), "scales must be"),
        ((x, values, scales.astype(jnp.bfloat16), gs), "scales must be"),
        ((x, values, scales, gs[:1]), "group_sizes must be"),
        ((x, values, scales, gs.astype(np.float32)), "group_sizes must be"),
    ]:
      args = put(*args)
      for backend in ("interpret", "xla"):
        with self.assertRaisesRegex(ValueError, pattern):
          fp8_grouped_matmul(*args, backend=backend)

  def test_bad_tiles_and_backend_raise(self):
    x, values, scales, gs = _operands(2, 128, 128, [2, 2], 4, seed=0)
    bs = grouped_block_sizes(4, 128, 128, 2)
    for bad in (dataclasses.replace(bs, tile_k=256), dataclasses.replace(bs, tile_n=192)):
      with self.assertRaisesRegex(ValueError, "tile_k must be 128"):
        fp8_grouped_matmul(x, values, scales, gs, backend="interpret", block_sizes=bad)
    with self.assertRaises(ValueError):
      fp8_grouped_matmul(x, values, scales, gs, backend="cuda")


class QuantGroupedMatmulTest(absltest.TestCase):
  """``mlkit.quant.grouped_matmul`` runs the kernel for block-scaled FP8 experts on the
  kernel backends, and the reference for "xla" and for per-channel scales."""

  def test_kernel_backend_matches_xla(self):
    rng = np.random.default_rng(7)
    w = put(np.asarray(rng.standard_normal((3, 256, 128)) * 0.05, np.float32))
    x = put(np.asarray(rng.standard_normal((10, 256)), jnp.bfloat16))
    gs = put(np.array([4, 0, 5], np.int32))
    # The reference in one program per weight format (eager, one per jnp operation).
    xla = jax.jit(lambda x, fw, gs: grouped_matmul(x, fw, gs, backend="xla"))
    for block in (128, None):
      fw = quantize_fp8(w, block_size=block)
      ref = xla(x, fw, gs)
      out = grouped_matmul(x, fw, gs, backend="interpret")
      self.assertLessEqual(_rel(np.asarray(out, np.float32)[:9], np.asarray(ref, np.float32)[:9]),
                           1e-2)
    text = jax.jit(lambda x, fw: grouped_matmul(x, fw, gs, backend="interpret")).lower(
        x, quantize_fp8(w)).as_text()
    self.assertIn("fp8_grouped_matmul", text)


# GLM 5.2's routed experts on one of 8 GPUs (pallas_kernels.targets.fp8_grouped_cases): every
# distinct compile, no spills, shared memory within a block (tests/h200_compile_cases.py).
GROUPS = kc.target_groups(("fp8_grouped_matmul",))
Fp8GroupedH200CompileTest = h200_compile_cases.make_test_case(__file__, GROUPS)


class Fp8GroupedSmemTest(parameterized.TestCase):
  """What the persistent grid is sized by: ptxas' shared memory is ``smem_bytes`` of the
  block sizes the H200 trace picks, plus 8 bytes of barrier per pipeline stage (read
  from the compile tests' own compiles)."""

  @parameterized.named_parameters((g.name, g) for g in GROUPS)
  def test_smem_bytes_is_what_ptxas_reports(self, group):
    build = group.compiled
    readings = h200_compile_cases.build_readings(build)
    bs = build.block_sizes
    stages = min(bs.max_concurrent_steps, build.case.d["k"] // bs.tile_k)
    self.assertEqual(readings["smem"], smem_bytes(bs) + 8 * stages)
    self.assertEqual(bs, grouped_block_sizes(*(build.case.d[x] for x in ("m", "n", "k", "experts")),
                                             device_kind="NVIDIA H200"))


class ModelTest(absltest.TestCase):
  """TINY_MLA with FP8_ALL's weights: the forward pass on the kernel backend (routed experts
  through the FP8 grouped kernel) gives the XLA reference's logits."""

  def test_forward_matches_the_reference_backend(self):
    from configs import TINY_MLA
    from mlkit.model import forward, init_params
    from mlkit.quant import FP8_ALL, quantize_params
    cfg = dataclasses.replace(TINY_MLA, n_layers=2, dtype="bfloat16")
    params = quantize_params(init_params(cfg, jax.random.key(1)), FP8_ALL)
    tokens = put(np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 6)).astype(np.int32))
    run = jax.jit(lambda p, t, backend: forward(p, t, cfg=cfg, backend=backend),
                  static_argnums=2)
    lowered = run.lower(params, tokens, "interpret")
    self.assertIn("fp8_grouped_matmul", lowered.as_text())
    got = np.asarray(lowered.compile()(params, tokens), np.float32)
    want = np.asarray(run(params, tokens, "xla"), np.float32)
    # The same bf16 weights and f32 accumulation; only summation order differs (bf16 bound).
    self.assertLessEqual(_rel(got, want), 1e-2)
