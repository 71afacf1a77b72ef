"""The dense INT4 matmul partitioned like its weight (pallas_kernels.int4_matmul.partitioned).

On 8 CPU devices the partitioning runs the XLA reference per shard (the interpreter
cannot run under custom partitioning), against the unsharded product; compiled for
8 H200s, the Mosaic GPU kernel then runs on each device's shard, with no gathered
weight.
"""

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

from pallas_kernels.int4_matmul import partitioned
from pallas_kernels.int4_matmul import reference
from pallas_kernels.int4_matmul import to_nk

M, K, N, G = 16, 1024, 512, 32


def _operands(layout, seed=0, k=K):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((M, k)), jnp.float32)
  packed = reference.pack_int4(jnp.asarray(rng.integers(-8, 8, (k, N)), jnp.int8))
  scales = jnp.asarray(rng.uniform(0.5, 1.5, (k // G, N)), jnp.float32)
  return x, (to_nk(packed) if layout == "nk" else packed), scales


class PartitionedReferenceTest(parameterized.TestCase):
  """The partition rule with the reference per shard: the same product, local shapes."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "tensor"))

  def _run(self, layout, n_axes, k_axes, m_axes=None, k=K):
    x, w, scales = _operands(layout, k=k)
    ref = (reference.int4_matmul_nk_reference if layout == "nk"
           else reference.int4_matmul_reference)
    want = np.asarray(ref(x, w, scales, group_size=G))
    w_spec = P(n_axes, k_axes) if layout == "nk" else P(k_axes, n_axes)
    put = lambda a, spec: jax.device_put(a, NamedSharding(self.mesh, spec))  # noqa: E731
    shapes = []
    op = partitioned._op

    def recording(x, w, s, *args):
      shapes.append((x.shape, w.shape, s.shape))
      return op(x, w, s, *args)

    with mock.patch.object(partitioned, "_op", recording):
      y = jax.jit(lambda a, b, c: partitioned.int4_matmul_partitioned(
          a, b, c, group_size=G, layout=layout, backend="xla"))(
              put(x, P(m_axes, k_axes)), put(w, w_spec), put(scales, P(k_axes, n_axes)))
    np.testing.assert_allclose(np.asarray(y), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    return y, shapes

  @parameterized.parameters("nk", "kn")
  def test_columns_split_run_locally(self, layout):
    y, shapes = self._run(layout, "tensor", None)
    w_local = (N // 4, K) if layout == "nk" else (K // 2, N // 4)
    self.assertIn(((M, K), w_local, (K // G, N // 4)), shapes)
    self.assertEqual(y.sharding.spec, P(None, "tensor"))

  @parameterized.parameters("nk", "kn")
  def test_rows_split_are_summed(self, layout):
    _, shapes = self._run(layout, None, "tensor")
    w_local = (N, K // 4) if layout == "nk" else (K // 8, N)
    self.assertIn(((M, K // 4), w_local, (K // G // 4, N)), shapes)

  def test_token_rows_and_columns_split_together(self):
    y, shapes = self._run("nk", "tensor", None, m_axes="data")
    self.assertIn(((M // 2, K), (N // 4, K), (K // G, N // 4)), shapes)
    self.assertEqual(y.sharding.spec, P("data", "tensor"))

  @parameterized.parameters("nk", "kn")
  def test_one_scale_group(self, layout):
    # K == group_size: one scale group, which cannot be split; Shardy rejects a
    # compound (groups x group size) factor with a group count of 1, so the rule
    # names K whole. The columns still split.
    y, shapes = self._run(layout, "tensor", None, k=G)
    w_local = (N // 4, G) if layout == "nk" else (G // 2, N // 4)
    self.assertIn(((M, G), w_local, (1, N // 4)), shapes)
    self.assertEqual(y.sharding.spec, P(None, "tensor"))

  def test_replicated_runs_whole(self):
    y, _ = self._run("nk", None, None)
    self.assertTrue(y.sharding.is_fully_replicated)

  def test_bad_arguments(self):
    x, w, scales = _operands("nk")
    with self.assertRaisesRegex(ValueError, "interpret"):
      partitioned.int4_matmul_partitioned(x, w, scales, group_size=G, backend="interpret")
    with self.assertRaisesRegex(ValueError, "layout"):
      partitioned.int4_matmul_partitioned(x, w, scales, group_size=G, layout="t")


class H200PartitionTest(absltest.TestCase):
  """Compiled for 8 H200s (no device): the kernel runs on each GPU's shard."""

  def _compile(self, fn, n_spec, k_spec, m=64, k=8192, n=7168):
    from pallas_kernels.h200 import compile as hc
    mesh = hc.mesh((1, 8), ("data", "tensor"))
    sds = lambda shape, dtype, spec: jax.ShapeDtypeStruct(  # noqa: E731
        shape, dtype, sharding=NamedSharding(mesh, spec))
    args = (sds((m, k), jnp.bfloat16, P(None, k_spec)),
            sds((n, k), jnp.int4, P(n_spec, k_spec)),
            sds((k // G, n), jnp.bfloat16, P(k_spec, n_spec)))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      lowered = jax.jit(fn).trace(*args).lower()
    hlo = lowered.compile({"xla_backend_optimization_level": 0,
                           "xla_gpu_disable_gpuasm_optimizations": True}).as_text()
    kernels = [re.search(r"= (\S+) custom-call", line).group(1) for line in hlo.splitlines()
               if "custom-call(" in line and "mosaic" in line.lower()]
    collectives = re.findall(r"= \S+ (all-gather|all-reduce)\(", hlo)
    return kernels, collectives

  def _kernel(self, a, w, s):
    return partitioned.int4_matmul_partitioned(a, w, s, group_size=G)

  @staticmethod
  def _result(m, n, k):
    """The kernel's result type at [m, k] x [k, n] with the H200's tuned block sizes:
    the output itself, or its f32 K-split partials [splits, n, m]."""
    from pallas_kernels.int4_matmul import BlockSizes
    splits = BlockSizes.get_default(m, n, k, layout="nk", group_size=G,
                                    device_kind="NVIDIA H200").k_splits
    return f"f32[{splits},{n},{m}]{{2,1,0}}" if splits > 1 else f"bf16[{m},{n}]{{1,0}}"

  def test_columns_split(self):
    kernels, collectives = self._compile(self._kernel, "tensor", None)
    # 7168 / 8 columns, with the H200's block sizes for that shape (read while the
    # abstract H200 mesh was active, not from this machine's CPU).
    self.assertEqual(kernels, [self._result(64, 896, 8192)])
    self.assertNotEqual(self._result(64, 896, 8192), "bf16[64,896]{1,0}")  # splits K
    self.assertEqual(collectives, [])

  def test_rows_split(self):
    kernels, collectives = self._compile(self._kernel, None, "tensor")
    self.assertEqual(kernels, [self._result(64, 7168, 1024)])  # K 1024 per GPU, summed
    self.assertEqual(collectives, ["all-reduce"])

  def test_model_matmul_takes_it(self):
    """mlkit's matmul on an INT4 weight runs the partitioned kernel on a GPU backend;
    the plain op here gathers (the failure this module exists for)."""
    from mlkit.quant import Int4Weight, matmul
    from pallas_kernels.int4_matmul import int4_matmul_nk

    def model(a, w, s):
      return matmul(a, Int4Weight(w, s, G, "nk"), backend="pallas")

    self.assertEqual(self._compile(model, "tensor", None), ([self._result(64, 896, 8192)], []))
    kernels, collectives = self._compile(
        lambda a, w, s: int4_matmul_nk(a, w, s, group_size=G, backend="pallas"), "tensor", None)
    self.assertEqual(kernels, [self._result(64, 7168, 8192)])
    self.assertIn("all-gather", collectives)


if __name__ == "__main__":
  absltest.main()
