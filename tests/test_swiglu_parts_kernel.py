"""SwiGLU from the gate and up projections' split-K partial sums in one launch
(``pallas_kernels.swiglu``).

Interpret mode returns the reference's bytes: the interpreter runs the kernel's jnp ops,
which are the reference's (the parts added in order, every rounding explicit in
``silu_times``), so nothing differs. On a GPU, Triton's exp may differ from XLA's in the
last f32 bit, which can move a bf16 rounding by one ulp; the test of ``silu_times``
against today's ``jax.nn.silu(g) * u`` bounds it the same way (one bf16 ulp). Against a
float64 SwiGLU of the float64 sums: within the bound of bf16 (and f32) rounding. Also:
Kimi K2.6's per-device shape, odd M and an F that is no power of two; bad input; the
gradient (the reference's); the partitioning on 8 CPU devices (the reference per shard)
and compiled for 8 H200s (each device runs the kernel on its own columns: no all-gather,
and one GEMM for both projections); ``mlkit.model.layers.swiglu`` (the shared expert) on
"interpret" against "xla" for a tiny MoE config, and which calls take the parts; and
one H200 launch without spills at Kimi's per-device shape.
"""

import dataclasses
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
from configs import TINY_MLA
from mlkit.model import layers
from pallas_kernels.swiglu import parts as parts_lib
from pallas_kernels.swiglu import silu_times
from pallas_kernels.swiglu import swiglu_parts
from pallas_kernels.swiglu import swiglu_parts_reference

BF16 = jnp.bfloat16
KIMI = (16, 64, 256)  # S, M, F on one of 8 H200s: 16 parts of D = 7,168, 64 requests


def _parts(seed, s, m, f):
  """Gate and up parts [S, M, F] f32 (numpy) whose sums reach silu's tails (|g| past 5)."""
  rng = np.random.default_rng(seed)
  scale = 3.0 / np.sqrt(s)  # sums of standard deviation 3
  return (rng.normal(size=(s, m, f)).astype(np.float32) * scale,
          rng.normal(size=(s, m, f)).astype(np.float32) * scale)


@functools.cache
def _interpret(dtype):
  return jax.jit(lambda g, u: swiglu_parts(g, u, dtype=dtype, backend="interpret"))


@functools.cache
def _reference(dtype):
  return jax.jit(lambda g, u: swiglu_parts_reference(g, u, dtype=dtype))


def _f64_swiglu(g_parts, u_parts):
  g, u = g_parts.astype(np.float64).sum(0), u_parts.astype(np.float64).sum(0)
  return g, u, g / (1.0 + np.exp(-g)) * u


def _bf16_ulp(x):
  """bf16's spacing at |x| (8 significant bits), for normal x."""
  return np.exp2(np.floor(np.log2(np.maximum(np.abs(x), 2.0**-126))) - 7)


class SwigluPartsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("kimi_per_device", *KIMI, BF16), ("odd_m_f_not_pow2", 3, 7, 48, BF16),
      ("one_part", 1, 5, 32, BF16), ("f32", 4, 6, 64, jnp.float32))
  def test_interpret_returns_the_references_bytes_within_f64_rounding(self, s, m, f, dtype):
    g_parts, u_parts = _parts(s * m + f, s, m, f)
    got = np.asarray(_interpret(dtype)(g_parts, u_parts), np.float64)
    want = np.asarray(_reference(dtype)(g_parts, u_parts), np.float64)
    self.assertEqual(got.shape, (m, f))
    np.testing.assert_array_equal(got, want)
    # Against float64: each sum carries f32 addition error (at most S x 2^-24 x the sum of
    # its parts' magnitudes) and rounds to dtype (eps, relative), an error dg in g moves
    # silu(g) * u by at most |silu'| |u| dg <= 1.1 |u| dg (du moves it by |silu(g)| du),
    # and five more roundings (exp, 1 + exp, its reciprocal, g times it, times u) add
    # about one eps of |silu(g) u| each.
    g, u, exact = _f64_swiglu(g_parts, u_parts)
    eps = 2.0**-8 if dtype == BF16 else 2.0**-23

    def err(x, x_parts):
      return eps * np.abs(x) + s * 2.0**-24 * np.abs(x_parts).sum(0)

    silu = g / (1.0 + np.exp(-g))
    bound = (1.1 * np.abs(u) * err(g, g_parts) + np.abs(silu) * err(u, u_parts)
             + 6 * eps * np.abs(exact) + 1e-30)
    np.testing.assert_array_less(np.abs(got - exact), bound)
    self.assertGreater(np.abs(g).max(), 5.0)  # the parts reach silu's tails

  def test_silu_times_is_todays_expression_within_one_bf16_ulp(self):
    g_parts, u_parts = _parts(1, *KIMI)
    g, u = g_parts.sum(0), u_parts.sum(0)
    ours = np.asarray(jax.jit(lambda a, b: silu_times(a, b, BF16))(g, u), np.float64)
    today = np.asarray(jax.jit(lambda a, b: jax.nn.silu(a.astype(BF16)) * b.astype(BF16))(g, u),
                       np.float64)
    np.testing.assert_array_less(np.abs(ours - today), _bf16_ulp(today) + 1e-30)

  def test_gradient_is_the_references(self):
    s, m, f = 3, 7, 48
    g_parts, u_parts = _parts(2, s, m, f)
    ct = np.random.default_rng(3).normal(size=(m, f)).astype(np.float32)

    def loss(fn, g, u):
      return jnp.sum(fn(g, u).astype(jnp.float32) * ct)

    got = jax.jit(jax.grad(functools.partial(loss, lambda g, u: swiglu_parts(
        g, u, dtype=BF16, backend="interpret")), argnums=(0, 1)))(g_parts, u_parts)
    want = jax.jit(jax.grad(functools.partial(loss, lambda g, u: swiglu_parts_reference(
        g, u, dtype=BF16)), argnums=(0, 1)))(g_parts, u_parts)
    for a, b in zip(got, want):
      self.assertEqual(a.shape, (s, m, f))
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    self.assertGreater(float(jnp.abs(got[0]).max()), 0.0)

  def test_bad_input(self):
    g = jnp.zeros((2, 4, 8), jnp.float32)
    for bad, msg in ((g[0], "gate_parts must be float32"), (g.astype(BF16), "gate_parts must be"),
                     (g[:, :0], "gate_parts must be")):
      with self.assertRaisesRegex(ValueError, msg):
        swiglu_parts(bad, bad, dtype=BF16, backend="interpret")
    with self.assertRaisesRegex(ValueError, "up_parts must be float32"):
      swiglu_parts(g, g.astype(jnp.float16), dtype=BF16)
    with self.assertRaisesRegex(ValueError, "must have gate_parts' shape"):
      swiglu_parts(g, g[:1], dtype=BF16)
    with self.assertRaisesRegex(ValueError, "dtype must be a float"):
      swiglu_parts(g, g, dtype=jnp.int32)
    with self.assertRaisesRegex(ValueError, "backend must be"):
      swiglu_parts(g, g, dtype=BF16, backend="triton")

  def test_block_shape(self):
    self.assertEqual(parts_lib.block_shape(64, 256), (1, 256))
    self.assertEqual(parts_lib.block_shape(64, 32), (8, 32))
    self.assertEqual(parts_lib.block_shape(7, 48), (1, 16))
    self.assertEqual(parts_lib.block_shape(6, 2048), (1, 256))


class PartitionedTest(absltest.TestCase):
  """The partition rule, with the reference per shard on 8 CPU devices."""

  def test_each_device_sums_its_own_columns(self):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "tensor"))
    s, m, f = 4, 6, 64
    g_parts, u_parts = _parts(4, s, m, f)
    shapes = []
    op = parts_lib._op

    def recording(g, u, *args):
      shapes.append(g.shape)
      return op(g, u, *args)

    spec = NamedSharding(mesh, P(None, "data", "tensor"))
    put = functools.partial(jax.device_put, device=spec)
    with mock.patch.object(parts_lib, "_op", recording):
      got = jax.jit(lambda g, u: swiglu_parts(g, u, dtype=BF16, backend="xla"))(
          put(g_parts), put(u_parts))
    self.assertIn((s, m // 2, f // 4), shapes)  # rows over "data", columns over "tensor"
    self.assertEqual(got.sharding.spec, P("data", "tensor"))
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(_reference(BF16)(g_parts, u_parts), np.float32))


class SharedExpertTest(absltest.TestCase):
  """``layers.swiglu`` (the shared expert, as ``moe_ffn`` calls it) on the kernel backend."""

  cfg = dataclasses.replace(TINY_MLA, d_model=2048, dtype="bfloat16")

  def _shared(self, seed=5):
    d, f = self.cfg.d_model, self.cfg.moe_ffn_dim * self.cfg.n_shared_experts
    rng = np.random.default_rng(seed)
    return {"w_gate": jnp.asarray(rng.normal(size=(d, f)) / np.sqrt(d), BF16),
            "w_up": jnp.asarray(rng.normal(size=(d, f)) * 2 / np.sqrt(d), BF16),
            "w_down": jnp.asarray(rng.normal(size=(f, d)) / np.sqrt(f), BF16)}

  def test_interpret_runs_as_xla_within_bf16(self):
    p = self._shared()
    x = jnp.asarray(np.random.default_rng(6).normal(size=(5, self.cfg.d_model)) * 2, BF16)

    def fn(backend):
      return jax.jit(lambda p, x: layers.swiglu(p, x, backend=backend, out_dtype=jnp.float32))

    got, want = np.asarray(fn("interpret")(p, x)), np.asarray(fn("xla")(p, x))
    # The parts are added in another order than XLA's dot adds the products: an f32
    # rounding of the gate and up sums, which can move their bf16 roundings, and so h's,
    # by one ulp (2^-7 relative at most), and h's error through the gate by |silu'| <= 1.1
    # times the gate's; w_down carries each h's error to the row's outputs.
    w = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x64 = np.asarray(x, np.float64)
    g, u = x64 @ w["w_gate"], x64 @ w["w_up"]
    h = g / (1.0 + np.exp(-g)) * u
    bound = 2.0**-7 * (1.1 * np.abs(g * u) + 2 * np.abs(h)) @ np.abs(w["w_down"])
    np.testing.assert_array_less(np.abs(got - want), bound + 1e-6 * np.abs(want).max())
    np.testing.assert_allclose(got, h @ w["w_down"], rtol=0.05, atol=0.05 * np.abs(want).max())

  def test_which_calls_take_the_parts(self):
    p, d = self._shared(), self.cfg.d_model
    spec = jax.ShapeDtypeStruct

    def takes(p, n, d=d, backend="interpret"):
      x = spec((n, d), BF16)
      return "swiglu_parts" in str(jax.make_jaxpr(
          lambda p, x: layers.swiglu(p, x, backend=backend))(p, x))

    self.assertTrue(takes(p, 1))
    self.assertTrue(takes(p, 1024))
    self.assertFalse(takes(p, 1025))  # a prefill's rows
    self.assertFalse(takes(p, 64, backend="xla"))
    narrow = {"w_gate": spec((64, 32), BF16), "w_up": spec((64, 32), BF16),
              "w_down": spec((32, 64), BF16)}
    self.assertFalse(takes(narrow, 8, d=64))  # TINY_MLA's D
    wide = {"w_gate": spec((d, 8192), BF16), "w_up": spec((d, 8192), BF16),
            "w_down": spec((8192, d), BF16)}
    self.assertFalse(takes(wide, 8))  # a dense FFN's F
    from mlkit.quant.formats import Fp8Weight
    fp8 = Fp8Weight(spec((d, 32), jnp.float8_e4m3fn), spec((d // 128, 1), jnp.float32))
    self.assertFalse(takes({**p, "w_gate": fp8, "w_up": fp8}, 8))  # quantised weights


class SwigluPartsH200Test(h200_compile_cases.H200CompilerTest):

  def test_one_launch_without_spills(self):
    from pallas_kernels.h200 import compile as hc
    s, m, f = KIMI
    # The merged GEMM's output [S, M, 2F] (gate columns, then up), as the shared expert's
    # matmuls hand it over: its halves concatenate back into it, no copy.
    self.assert_one_launch_without_spills(
        jax.jit(lambda parts: swiglu_parts(parts[..., :f], parts[..., f:], dtype=BF16,
                                           backend="pallas")),
        hc.spec((s, m, 2 * f), jnp.float32), kernel="swiglu_parts")

  def test_tensor_parallel_shared_expert_on_8_h200s(self):
    """Kimi K2.6's shared expert at decode under 8-way tensor parallelism: one GEMM for
    the gate and up parts, the kernel on each device's 256 columns, the down GEMM; no
    all-gather."""
    from mlkit.parallel import AXES
    from pallas_kernels.h200 import compile as hc
    mesh = hc.mesh((1, 8, 1), AXES)
    sh = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    d, f = 7168, 2048
    p = {"w_gate": hc.spec((d, f), BF16, sh(None, "tensor")),
         "w_up": hc.spec((d, f), BF16, sh(None, "tensor")),
         "w_down": hc.spec((f, d), BF16, sh("tensor", None))}
    x = hc.spec((64, d), BF16, sh())
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      lowered = jax.jit(lambda p, x: layers.swiglu(p, x, backend="pallas",
                                                   out_dtype=jnp.float32)).trace(p, x).lower()
    text = lowered.compile({"xla_gpu_autotune_level": 0}).as_text()
    self.assertNotIn("all-gather", text)
    calls = re.findall(r"= (\S+) custom-call\([^\n]*name = \"swiglu_parts\"", text)
    self.assertEqual(calls, ["bf16[16384]{0}"])  # one kernel, 64 rows x 256 columns a device
    # One GEMM for both projections' parts, [S, M, 2F] a device.
    self.assertLen(re.findall(r"= f32\[16,64,512\]\S* fusion\(", text), 1)

if __name__ == "__main__":
  absltest.main()
