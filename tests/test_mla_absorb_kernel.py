"""MLA's absorbed value product in one launch (``pallas_kernels.mla_absorb``).

Bounds. The operands are exact in f32, and so are their products (two 8-bit, or 11-bit,
significands); the kernel adds them in f32 in K chunks, the reference (XLA's dot) in
its own order. Each f32 sum is within gamma = C x 2^-24 of sum |x w| of the exact sum,
so the two sums differ by at most 2 gamma sum |x w|, far below a bf16 ulp: rounded to
bf16 they are equal or neighbours, |kernel - reference| <= one ulp of the reference's
(at most 2^-7 of it) plus that f32 difference. Against a float64 product: the f32
error plus one rounding to the dtype (half an ulp, 2^-8 relative in bf16).

Also: shapes the kernel does not tile run the reference; "xla" is today's expression
(the same ops); bad input; the gradient is the reference's; the partitioning splits
heads and rows on 8 CPU devices (the reference per shard); and compiled for H200s,
one launch without spills at Kimi K2.6's per-device shape, and on 8 H200s under tensor
parallelism each device's kernel on its own 8 heads, in wo's layout, no all-gather.
"""

import functools
import re
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import h200_compile_cases
from pallas_kernels.mla_absorb import absorbed_values
from pallas_kernels.mla_absorb import absorbed_values_partitioned
from pallas_kernels.mla_absorb import absorbed_values_reference
from pallas_kernels.mla_absorb import block_shape
from pallas_kernels.mla_absorb import kernel as kernel_lib
from pallas_kernels.mla_absorb import kernel_takes

BF16 = jnp.bfloat16
KIMI = (64, 1, 8, 512, 128, 128)  # B, T, H, C, nope, v on one of 8 H200s
_UNIT_ROUNDOFF = {BF16: 2.0**-8, jnp.float16: 2.0**-11, jnp.float32: 2.0**-24}


def _operands(seed, b, t, h, c, nope, v, dtype=BF16):
  """out_latent [B, T, H, C] and wkv_b [C, H, nope + v] (numpy, in dtype), outputs of
  order one."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(b, t, h, c))
  w = rng.normal(size=(c, h, nope + v)) / np.sqrt(c)
  return np.asarray(jnp.asarray(x, dtype)), np.asarray(jnp.asarray(w, dtype))


@functools.cache
def _run(nope, backend):
  return jax.jit(lambda x, w: absorbed_values(x, w, nope, backend=backend))


@functools.cache
def _reference(nope):
  return jax.jit(lambda x, w: absorbed_values_reference(x, w, nope))


def _takes_kernel(x, w, nope, backend="interpret"):
  return "mla_absorbed_values" in str(jax.make_jaxpr(
      lambda x, w: absorbed_values(x, w, nope, backend=backend))(x, w))


class AbsorbedValuesTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("kimi_per_device", *KIMI, BF16), ("t4_c48_three_k_chunks", 4, 4, 2, 48, 16, 16, BF16),
      ("f16_c256", 2, 8, 3, 256, 64, 64, jnp.float16),
      ("f32", 16, 1, 2, 64, 64, 32, jnp.float32))
  def test_interpret_within_one_rounding_of_reference_and_float64(self, b, t, h, c, nope, v,
                                                                   dtype):
    x, w = _operands(b * t + c, b, t, h, c, nope, v, dtype)
    self.assertTrue(_takes_kernel(x, w, nope))
    got = np.asarray(_run(nope, "interpret")(x, w), np.float64)
    want = np.asarray(_reference(nope)(x, w), np.float64)
    self.assertEqual(got.shape, (b, t, h, v))
    x64, w64 = x.astype(np.float64), w.astype(np.float64)[..., nope:]
    exact = np.einsum("bthc,chd->bthd", x64, w64)
    f32_err = c * 2.0**-24 * np.einsum("bthc,chd->bthd", np.abs(x64), np.abs(w64))
    u = _UNIT_ROUNDOFF[dtype]
    np.testing.assert_array_less(np.abs(got - want), 2 * u * np.abs(want) + 2 * f32_err + 1e-30)
    np.testing.assert_array_less(np.abs(got - exact),
                                 u * np.abs(exact) + (1 + u) * f32_err + 1e-30)
    if dtype != jnp.float32:  # a rounding moves only near a tie of the dtype's
      self.assertLess(np.mean(got != want), 0.01)

  def test_block_shape_and_what_the_kernel_takes(self):
    self.assertEqual(block_shape(64, 512, 128, 128), (16, 128, 32))
    self.assertEqual(block_shape(16, 48, 16, 16), (16, 16, 16))
    self.assertEqual(block_shape(32, 512, 64, 16), (16, 128, 16))  # blocks start at nope
    self.assertEqual(block_shape(32, 512, 128, 0), (16, 128, 32))
    self.assertTrue(kernel_takes(64, 512, 128, 128))
    for m, c, v, nope in ((3, 512, 128, 128), (24, 512, 128, 128), (0, 512, 128, 128),
                          (64, 8, 128, 128), (64, 512, 8, 128), (64, 512, 128, 8),
                          (64, 40, 128, 128)):
      self.assertFalse(kernel_takes(m, c, v, nope), (m, c, v, nope))

  def test_shapes_the_kernel_does_not_tile_run_the_reference(self):
    x, w = _operands(1, 3, 1, 2, 64, 16, 16)  # 3 rows: no whole block of 16
    self.assertFalse(_takes_kernel(x, w, 16))
    np.testing.assert_array_equal(np.asarray(_run(16, "interpret")(x, w), np.float32),
                                  np.asarray(_reference(16)(x, w), np.float32))
    x, w = _operands(2, 16, 1, 2, 64, 16, 8)  # v = 8: below a dot operand's 16
    self.assertFalse(_takes_kernel(x, w, 16))
    self.assertFalse(_takes_kernel(x, w, 8))  # nope = 8: value blocks of 8 columns
    self.assertTrue(_takes_kernel(x, w[..., :16], 0))  # nope = 0, v = 16
    self.assertFalse(_takes_kernel(*_operands(3, 16, 1, 2, 64, 128, 128), 128, backend="xla"))

  def test_xla_is_todays_expression(self):
    b, t, h, c, nope, v = KIMI
    x, w = jax.ShapeDtypeStruct((b, t, h, c), BF16), jax.ShapeDtypeStruct((c, h, nope + v), BF16)

    def today(x, w):  # mlkit.model.attention.mla_absorb_output's product
      out = jnp.einsum("bthc,chd->bthd", x, w, preferred_element_type=jnp.float32)
      return out[..., nope:].astype(x.dtype)

    ours = jax.make_jaxpr(lambda x, w: absorbed_values(x, w, nope, backend="xla"))(x, w)
    self.assertEqual(str(ours), str(jax.make_jaxpr(today)(x, w)))

  def test_bad_input(self):
    x, w = jnp.ones((16, 1, 2, 64), BF16), jnp.ones((64, 2, 48), BF16)
    cases = ((x[0], w, 16, "out_latent must be \\[B, T, H, C\\]"),
             (x.astype(jnp.int32), w, 16, "out_latent must be"),
             (x, w[0], 16, "wkv_b must be \\[C, H, nope \\+ v\\] = \\[64, 2, ...\\]"),
             (x, w[:32], 16, "wkv_b must be"), (x, w[:, :1], 16, "wkv_b must be"),
             (x, w.astype(jnp.float32), 16, "in out_latent's dtype"),
             (x, w, 48, "nope must be in \\[0, 48\\)"), (x, w, -1, "nope must be"))
    for a, b, nope, msg in cases:
      with self.assertRaisesRegex(ValueError, msg):
        absorbed_values(a, b, nope, backend="interpret")
    with self.assertRaisesRegex(ValueError, "backend must be"):
      absorbed_values(x, w, 16, backend="triton")
    with self.assertRaisesRegex(ValueError, "cannot run under custom partitioning"):
      absorbed_values_partitioned(x, w, 16, backend="interpret")

  def test_gradient_is_the_references(self):
    b, t, h, c, nope, v = 4, 4, 2, 48, 16, 16
    x, w = _operands(5, b, t, h, c, nope, v)
    ct = np.random.default_rng(6).normal(size=(b, t, h, v)).astype(np.float32)

    def grad(fn):
      loss = lambda x, w: jnp.sum(fn(x, w).astype(jnp.float32) * ct)  # noqa: E731
      return jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)

    got = grad(lambda x, w: absorbed_values(x, w, nope, backend="interpret"))
    want = grad(lambda x, w: absorbed_values_reference(x, w, nope))
    for a, b_, shape in zip(got, want, (x.shape, w.shape)):
      self.assertEqual(a.shape, shape)
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b_, np.float32))
    self.assertGreater(float(jnp.abs(got[1][..., nope:]).max()), 0.0)
    self.assertEqual(float(jnp.abs(got[1][..., :nope]).max()), 0.0)  # the key half is unread


class PartitionedTest(absltest.TestCase):
  """The partition rule, with the reference per shard on 8 CPU devices."""

  def test_each_device_runs_its_own_heads_and_rows(self):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "tensor"))
    b, t, h, c, nope, v = 4, 2, 8, 32, 16, 16
    x, w = _operands(7, b, t, h, c, nope, v)
    shapes = []
    op = kernel_lib._op

    def recording(nope, backend, x, w):
      shapes.append((x.shape, w.shape))
      return op(nope, backend, x, w)

    x_sharding = NamedSharding(mesh, P("data", None, "tensor", None))
    with mock.patch.object(kernel_lib, "_op", recording):
      got = jax.jit(lambda x, w: absorbed_values_partitioned(x, w, nope, backend="xla"))(
          jax.device_put(x, x_sharding),
          jax.device_put(w, NamedSharding(mesh, P(None, "tensor", None))))
    self.assertIn(((b // 2, t, h // 4, c), (c, h // 4, nope + v)), shapes)
    self.assertTrue(got.sharding.is_equivalent_to(x_sharding, 4), got.sharding)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(_reference(nope)(x, w), np.float32))


class AbsorbedValuesH200Test(h200_compile_cases.H200CompilerTest):

  def test_one_launch_without_spills(self):
    from pallas_kernels.h200 import compile as hc
    b, t, h, c, nope, v = KIMI
    self.assert_one_launch_without_spills(
        jax.jit(lambda x, w: absorbed_values(x, w, nope, backend="pallas")),
        hc.spec((b, t, h, c), BF16), hc.spec((c, h, nope + v), BF16),
        kernel="mla_absorbed_values")

  def test_tensor_parallel_on_8_h200s(self):
    """Kimi K2.6's 64 heads over 8 H200s: each device's kernel on its own 8 heads, its
    output the [B, 1, 8 x v] rows wo reads (a bitcast), no all-gather."""
    from mlkit.parallel import AXES
    from pallas_kernels.h200 import compile as hc
    mesh = hc.mesh((1, 8, 1), AXES)
    b, t, h, c, nope, v = KIMI
    x = hc.spec((b, t, 8 * h, c), BF16, NamedSharding(mesh, P(None, None, "tensor", None)))
    w = hc.spec((c, 8 * h, nope + v), BF16, NamedSharding(mesh, P(None, "tensor", None)))
    fn = lambda x, w: absorbed_values(x, w, nope, backend="pallas").reshape(b, t, -1)  # noqa: E731
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      lowered = jax.jit(fn).trace(x, w).lower()
    text = lowered.compile({"xla_gpu_autotune_level": 0}).as_text()
    self.assertNotIn("all-gather", text)
    calls = re.findall(r"= (\S+) custom-call\([^\n]*name = \"mla_absorbed_values\"", text)
    self.assertEqual(calls, ["bf16[64,8,128]{2,1,0}"])
    self.assertRegex(text, r"ROOT \S+ = bf16\[64,1,1024\]\S* bitcast\(")


if __name__ == "__main__":
  absltest.main()
