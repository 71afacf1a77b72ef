"""The residual add and the next RMSNorm in one launch (``pallas_kernels.residual_norm``).

Interpret mode returns the reference's new stream bit for bit and its norm within one
bf16 rounding (one and two deltas, bf16 and f32 deltas, odd row counts, one chunk and
several), both against a float64 computation; widths the kernel does not take run the
reference; bad input; the gradient is the reference's; the partitioning splits rows and
never D; the model on "interpret" runs the kernel between its layers and matches "xla",
and on "xla" it is today's layer-by-layer model bit for bit; and an H200 compile at
Kimi K2.6's decode shape: one launch, no spills, also partitioned over a mesh.
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
import ml_dtypes
import numpy as np

import h200_compile_cases
from host_data import put
from pallas_kernels.residual_norm import ops
from pallas_kernels.residual_norm import (kernel_takes, residual_norm,
                                          residual_norm_partitioned, residual_norm_reference)

BF16, F32 = jnp.bfloat16, jnp.float32
EPS = 1e-6


def _inputs(seed, shape, dtypes, x_dtype=BF16):
  """x [..., D], deltas [..., D] of ``dtypes``, scale [D]: fresh normals of mixed size.

  Cast on the host and placed with device_put: ``jnp.asarray(a, dtype)`` compiles a
  conversion per shape."""
  rng = np.random.default_rng(seed)
  x = np.asarray(rng.normal(size=shape) * 4, x_dtype)
  deltas = tuple(np.asarray(rng.normal(size=shape) * rng.choice([0.01, 1.0, 30.0]), t)
                 for t in dtypes)
  scale = np.asarray(rng.uniform(0.5, 1.5, shape[-1:]), BF16)
  return put(x), tuple(put(d) for d in deltas), put(scale)


@functools.cache
def _jitted(backend):
  return jax.jit(lambda x, d, s: residual_norm(x, d, s, EPS, backend=backend))


_reference = jax.jit(lambda x, d, s: residual_norm_reference(x, d, s, EPS))


def _f32(a):
  """a as a float32 numpy array, converted on the host (bf16 -> f32 is exact)."""
  return np.asarray(a).astype(np.float32)


def _float64(x, deltas, scale, dtype):
  """The model's sums in float64, each rounded to x's dtype, and their RMSNorm in float64."""
  rounded = np.float32 if dtype == F32 else ml_dtypes.bfloat16
  s = _f32(x).astype(np.float64)
  for d in deltas:
    d = np.asarray(d).astype(rounded).astype(np.float64)
    s = (s + d).astype(rounded).astype(np.float64)
  normed = s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + EPS) * _f32(scale)
  return s, normed


class ResidualNormTest(parameterized.TestCase):

  @parameterized.parameters(
      ((7, 192), (BF16,)),  # three chunks of 64, odd rows, the attention residual alone
      ((7, 192), (BF16, BF16)),
      ((3, 1, 3072), (F32, F32)),  # three chunks of 1024: the model's f32 all-reduced sums
      ((5, 64), (F32, BF16)))
  def test_interpret_is_the_reference(self, shape, dtypes):
    x, deltas, scale = _inputs(0, shape, dtypes)
    self.assertTrue(kernel_takes(shape[-1]))
    x_new, normed = _jitted("interpret")(x, deltas, scale)
    ref_x, ref_normed = _reference(x, deltas, scale)
    self.assertEqual((x_new.dtype, normed.dtype, x_new.shape), (BF16, BF16, shape))
    np.testing.assert_array_equal(_f32(x_new), _f32(ref_x))
    # The sum of squares is added up in another order: within one bf16 rounding.
    bf16_ulp = 2.0 ** -7
    np.testing.assert_allclose(_f32(normed), _f32(ref_normed), rtol=bf16_ulp, atol=1e-6)
    want_x, want_normed = _float64(x, deltas, scale, BF16)
    np.testing.assert_array_equal(_f32(x_new), want_x)
    np.testing.assert_allclose(_f32(normed), want_normed, rtol=2.0 ** -8, atol=1e-6)

  def test_f32_stream(self):
    x, deltas, scale = _inputs(1, (5, 128), (F32, BF16), x_dtype=F32)
    x_new, normed = _jitted("interpret")(x, deltas, scale)
    np.testing.assert_array_equal(_f32(x_new), _f32(_reference(x, deltas, scale)[0]))
    want_x, want_normed = _float64(x, deltas, scale, F32)
    np.testing.assert_array_equal(_f32(x_new), want_x)
    np.testing.assert_allclose(_f32(normed), want_normed, rtol=1e-6, atol=1e-6)

  def test_no_deltas_leave_x(self):
    x, _, scale = _inputs(2, (3, 128), ())
    x_new, normed = _jitted("interpret")(x, (), scale)
    np.testing.assert_array_equal(_f32(x_new), _f32(x))
    np.testing.assert_allclose(_f32(normed), _float64(x, (), scale, BF16)[1], rtol=2.0 ** -8)

  @parameterized.parameters(96, 17 * 64)  # a chunk below 64; more than 16 chunks
  def test_widths_the_kernel_does_not_take_run_the_reference(self, d):
    self.assertFalse(kernel_takes(d))
    x, deltas, scale = _inputs(3, (3, d), (BF16, F32))
    fn = lambda x, d_, s: residual_norm(x, d_, s, EPS, backend="interpret")  # noqa: E731
    self.assertNotIn("pallas_call", str(jax.make_jaxpr(fn)(x, deltas, scale)))
    for got, want in zip(fn(x, deltas, scale), _reference(x, deltas, scale)):
      np.testing.assert_array_equal(_f32(got), _f32(want))

  def test_xla_is_the_reference(self):
    x, deltas, scale = _inputs(4, (3, 64), (BF16, BF16))
    jaxpr = str(jax.make_jaxpr(lambda *a: residual_norm(*a, EPS, backend="xla"))(
        x, deltas, scale))
    self.assertNotIn("pallas_call", jaxpr)
    self.assertIn("optimization_barrier", jaxpr)

  def test_bad_input(self):
    x, (d,), scale = _inputs(5, (4, 64), (BF16,))
    # Bad inputs sliced and cast on the host: eager slices and casts compile a program each.
    h_x, h_d, h_scale = np.asarray(x), np.asarray(d), np.asarray(scale)
    with self.assertRaisesRegex(ValueError, "delta 0 must be"):
      residual_norm(x, (put(h_d[:3]),), scale, EPS)
    with self.assertRaisesRegex(ValueError, "delta 1 must be"):
      residual_norm(x, (d, put(h_d.astype(np.int32))), scale, EPS)
    with self.assertRaisesRegex(ValueError, "scale must be"):
      residual_norm(x, (d,), put(h_scale[:32]), EPS)
    with self.assertRaisesRegex(ValueError, "x must be"):
      residual_norm(put(h_x.astype(np.int32)), (d,), scale, EPS)
    with self.assertRaisesRegex(ValueError, "backend must be"):
      residual_norm(x, (d,), scale, EPS, backend="triton")
    with self.assertRaisesRegex(ValueError, "interpret"):
      residual_norm_partitioned(x, (d,), scale, EPS, backend="interpret")

  def test_gradient_is_the_references(self):
    x, deltas, scale = _inputs(6, (3, 192), (BF16, F32))
    w_x, w_normed = (put(np.random.default_rng(s).normal(size=x.shape).astype(np.float32))
                     for s in (10, 11))

    def loss(fn):
      # Linear in the outputs: the cotangents do not depend on the norm's last bit.
      def value(x, deltas, scale):
        x_new, normed = fn(x, deltas, scale)
        return jnp.sum(x_new.astype(F32) * w_x) + jnp.sum(normed.astype(F32) * w_normed)
      return jax.jit(jax.grad(value, argnums=(0, 1, 2)))

    got = loss(lambda *a: residual_norm(*a, EPS, backend="interpret"))(x, deltas, scale)
    want = loss(lambda *a: residual_norm_reference(*a, EPS))(x, deltas, scale)
    # The same ops, but XLA may keep a bf16 sum of cotangents in f32 where it fuses it
    # into an f32 consumer (excess precision), in either program: within one bf16 rounding.
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      self.assertEqual(g.dtype, w.dtype)
      np.testing.assert_allclose(_f32(g), _f32(w), rtol=2.0 ** -7, atol=1e-6)


class PartitionTest(absltest.TestCase):
  """The partition rule with the reference per shard (8 CPU devices)."""

  def test_rows_split_and_d_whole(self):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "tensor"))
    x, deltas, scale = _inputs(7, (4, 2, 128), (BF16, F32))
    shapes, op = [], ops._op

    def recording(eps, backend, x, scale, *deltas):
      shapes.append((x.shape, scale.shape) + tuple(d.shape for d in deltas))
      return op(eps, backend, x, scale, *deltas)

    # From host copies: resharding a device array compiles a slicing program.
    place = lambda a, spec: jax.device_put(np.asarray(a), NamedSharding(mesh, spec))  # noqa: E731
    # Rows split over "data"; one delta arrives split over D, which the rule gathers.
    args = (place(x, P("data")),
            (place(deltas[0], P("data")), place(deltas[1], P(None, None, "tensor"))),
            place(scale, P("tensor")))
    with mock.patch.object(ops, "_op", recording):
      got = jax.jit(lambda x, d, s: residual_norm_partitioned(x, d, s, EPS, backend="xla"))(
          *args)
    self.assertEqual(shapes, [((2, 2, 128), (128,), (2, 2, 128), (2, 2, 128))])
    for g, w in zip(got, _reference(x, deltas, scale)):
      np.testing.assert_array_equal(_f32(g), _f32(w))


class ModelTest(absltest.TestCase):

  def test_model_on_interpret_runs_the_kernel_and_matches_xla(self):
    from configs import TINY_MLA
    from mlkit.model import forward
    from numpy_params import init_params_np
    cfg = dataclasses.replace(TINY_MLA, n_layers=3, dtype="bfloat16")
    params = init_params_np(cfg)
    toks = put(np.random.default_rng(8).integers(0, cfg.vocab_size, (1, 3)).astype(np.int32))
    fwd = lambda p, t, backend: forward(p, t, cfg=cfg, backend=backend)  # noqa: E731
    # Between every two layers: one kernel.
    spy = mock.Mock(wraps=ops._run)
    with mock.patch.object(ops, "_run", spy):
      jax.make_jaxpr(functools.partial(fwd, backend="interpret"))(params, toks)
    self.assertEqual(spy.call_count, cfg.n_layers - 1)
    ref = np.asarray(fwd(params, toks, "xla"))
    out = np.asarray(fwd(params, toks, "interpret"))
    self.assertTrue(np.isfinite(out).all())
    self.assertLess(np.linalg.norm(out - ref) / np.linalg.norm(ref), 2e-2)

  def test_model_on_xla_is_the_layer_by_layer_model(self):
    """``apply`` hands each layer's deltas to the next layer's norm; on "xla" that is the
    model of layers that add their own outputs (``decoder_layer``), bit for bit."""
    from configs import TINY_MLA
    from mlkit.model import apply, decoder_layer
    from mlkit.model.layers import rms_norm
    from mlkit.model.transformer import embed_tokens
    from numpy_params import init_params_np
    cfg = dataclasses.replace(TINY_MLA, n_layers=2, dtype="bfloat16")  # dense, then MoE
    params = init_params_np(cfg)
    toks = put(np.random.default_rng(9).integers(0, cfg.vocab_size, (2, 3)).astype(np.int32))
    pos = put(np.broadcast_to(np.arange(3, dtype=np.int32), toks.shape).copy())

    def layer_by_layer(params, toks, pos):
      x = embed_tokens(params["embed"], toks).astype(BF16)
      for i, lp in enumerate(params["layers"]):
        x, *_ = decoder_layer(lp, x, pos, None, i, cfg, moe=cfg.is_moe_layer(i),
                              backend="xla")
      return rms_norm(x, params["final_norm"], cfg.rms_norm_eps)

    got = jax.jit(lambda p, t, q: apply(p, t, q, cfg=cfg, backend="xla",
                                        return_hidden=True)[0])(params, toks, pos)
    want = jax.jit(layer_by_layer)(params, toks, pos)
    np.testing.assert_array_equal(_f32(got), _f32(want))


class ResidualNormH200Test(h200_compile_cases.H200CompilerTest):

  def test_one_launch_without_spills(self):
    from pallas_kernels.h200 import compile as hc
    # Kimi K2.6's decode step on one H200: 64 rows of 7168, the bf16 stream and the f32
    # all-reduced attention and FFN outputs.
    rows = (64, 1, 7168)
    self.assert_one_launch_without_spills(
        jax.jit(lambda x, s, a, f: residual_norm(x, (a, f), s, EPS, backend="pallas")),
        hc.spec(rows, BF16), hc.spec(rows[-1:], BF16), hc.spec(rows, F32), hc.spec(rows, F32),
        kernel="residual_norm")

  def test_partitioned_over_a_mesh_runs_each_devices_rows(self):
    from pallas_kernels.h200 import compile as hc
    mesh = hc.mesh((2, 4), ("data", "tensor"))
    sds = lambda shape, dtype, spec: jax.ShapeDtypeStruct(  # noqa: E731
        shape, dtype, sharding=NamedSharding(mesh, spec))
    args = (sds((64, 1, 7168), BF16, P("data")), sds((7168,), BF16, P()),
            sds((64, 1, 7168), F32, P("data")), sds((64, 1, 7168), F32, P("data")))
    fn = lambda x, s, a, f: residual_norm(x, (a, f), s, EPS, backend="pallas")  # noqa: E731
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      lowered = jax.jit(fn).trace(*args).lower()
    hlo = lowered.compile({"xla_backend_optimization_level": 0,
                           "xla_gpu_disable_gpuasm_optimizations": True}).as_text()
    # Each GPU's kernel runs its 32 rows: no gather, no other launch.
    calls = re.findall(r"= (\(.*?\)) custom-call\(.*name = \"(\w+)\"", hlo)
    self.assertEqual(calls, [("(bf16[32,7168]{1,0}, bf16[32,7168]{1,0})", "residual_norm")])
    self.assertIsNone(re.search(r"all-gather|all-reduce|collective-permute", hlo))


if __name__ == "__main__":
  absltest.main()
