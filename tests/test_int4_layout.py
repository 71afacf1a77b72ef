"""Int4Weight's two layouts: "kn" (packed uint8 [K/2, N], checkpoints) and "nk" (int4
[N, K], what the GPU kernels dequantise in registers): quantising into either, the
platform's choice (mlkit.quant.kernel_int4_layout) and converting a tree.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from configs import TINY_MLA
from mlkit import parallel
from mlkit.model import check_params, forward
from mlkit.quant import (INT4_EXPERTS, RECIPES, Int4Weight, dequantize, grouped_matmul,
                         kernel_int4_layout, kernel_layout, matmul, quantize_int4,
                         quantize_params, relaid_int4, weight_bytes)
from numpy_params import init_params_np
from host_data import put

MLA = dataclasses.replace(TINY_MLA, n_layers=2)  # one dense and one MoE layer


def _host_slice(w, i):
  """w[i] of every leaf, sliced on the host and placed again: an eager device slice compiles
  a program per shape."""
  return jax.tree.map(lambda a: put(np.asarray(a)[i]), w)


def _rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


class Int4LayoutTest(absltest.TestCase):

  @staticmethod
  @functools.cache
  def weights():
    """Int4 experts [4, 256, 64], layout "kn" (quantised once: Int4Weight is immutable)."""
    w = np.random.default_rng(0).standard_normal((4, 256, 64)).astype(np.float32)
    return quantize_int4(put(w), 32)

  def setUp(self):
    super().setUp()
    self.kn = self.weights()
    self.nk = self.kn.to_layout("nk")

  def test_same_weight_both_ways(self):
    self.assertEqual((self.nk.packed.shape, self.nk.packed.dtype), ((4, 64, 256), jnp.int4))
    self.assertEqual((self.nk.shape, self.nk.ndim), (self.kn.shape, self.kn.ndim))
    self.assertEqual(self.nk.nbytes, self.kn.nbytes)  # two codes per byte either way
    np.testing.assert_array_equal(dequantize(self.nk), dequantize(self.kn))
    back = self.nk.to_layout("kn")
    np.testing.assert_array_equal(back.packed, self.kn.packed)
    self.assertIs(self.kn.to_layout("kn"), self.kn)

  def test_bad_layout_raises(self):
    with self.assertRaisesRegex(ValueError, "layout"):
      Int4Weight(self.kn.packed, self.kn.scales, 32, layout="km")
    with self.assertRaisesRegex(ValueError, "layout"):
      self.kn.to_layout("t")

  def test_kernels_read_the_nk_layout(self):
    x, gs = put(np.random.default_rng(1).standard_normal((5, 256)).astype(np.float32),
                np.asarray([2, 0, 3, 0], np.int32))
    ref = grouped_matmul(x, self.kn, gs, backend="xla")
    np.testing.assert_array_equal(grouped_matmul(x, self.nk, gs, backend="xla"), ref)
    self.assertLess(_rel_err(grouped_matmul(x, self.nk, gs, backend="interpret"), ref), 1e-2)
    dense_kn, dense_nk = (_host_slice(w, 1) for w in (self.kn, self.nk))
    self.assertLess(_rel_err(matmul(x, dense_nk, backend="interpret"),
                             matmul(x, dense_kn, backend="xla")), 1e-2)

  def test_device_bytes_count_half_a_byte_per_code(self):
    mesh = jax.make_mesh((1, 2, 4), parallel.AXES)
    codes = jax.ShapeDtypeStruct((8, 64, 256), jnp.int4,
                                 sharding=jax.sharding.NamedSharding(mesh, P("expert")))
    self.assertEqual(parallel.per_device_bytes([codes]), 2 * 64 * 256 // 2)

  def test_platform_layout(self):
    # The kernels read the packed layout: the [N, K] kernels fail on an H200.
    self.assertEqual((kernel_int4_layout("xla"), kernel_int4_layout("interpret"),
                      kernel_int4_layout("pallas"), kernel_int4_layout()), ("kn",) * 4)
    with self.assertRaisesRegex(ValueError, "backend"):
      kernel_int4_layout("cuda")

  def test_kernel_layout_converts_for_kernel_backends_only(self):
    tree = {"w": self.kn, "norm": put(np.ones(4, np.float32))}
    self.assertIs(kernel_layout(tree, "xla"), tree)
    nk_tree = {"w": self.nk, "norm": tree["norm"]}
    self.assertIs(kernel_layout(nk_tree, "xla"), nk_tree)
    out = kernel_layout(nk_tree, "interpret")  # an "nk" tree goes back to the kernels' layout
    self.assertEqual(out["w"].layout, "kn")
    np.testing.assert_array_equal(np.asarray(out["w"].packed), np.asarray(self.kn.packed))
    self.assertIs(out["norm"], tree["norm"])
    self.assertIs(kernel_layout(tree, "interpret")["w"], self.kn)  # already there: no copy


class Int4LayoutModelTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.kn = quantize_params(init_params_np(MLA), INT4_EXPERTS)
    cls.nk = quantize_params(init_params_np(MLA), INT4_EXPERTS, int4_layout="nk")

  def test_quantising_into_nk_is_converting(self):
    converted = relaid_int4(self.kn, "nk")
    for a, b in zip(jax.tree.leaves(converted), jax.tree.leaves(self.nk)):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    self.assertEqual(jax.tree.structure(converted), jax.tree.structure(self.nk))
    with self.assertRaisesRegex(ValueError, "int4_layout"):
      quantize_params(init_params_np(MLA), INT4_EXPERTS, int4_layout="t")

  def test_kept_int4_weights_are_relaid_only_when_a_layout_is_named(self):
    # An already-quantised tree through a recipe that keeps its weights (a server
    # given a quantised checkpoint and the default "bf16" recipe).
    keep = RECIPES["bf16"]
    same = lambda a, b: self.assertEqual(jax.tree.structure(a), jax.tree.structure(b))  # noqa: E731
    same(quantize_params(self.kn, keep, int4_layout="nk"), self.nk)
    same(quantize_params(self.nk, keep, int4_layout="kn"), self.kn)
    same(quantize_params(self.nk, keep), self.nk)  # None: kept as they are
    kept = quantize_params(self.nk, keep, int4_layout="nk")
    self.assertIs(kept["layers"][1]["ffn"]["w_gate"], self.nk["layers"][1]["ffn"]["w_gate"])
    with self.assertRaisesRegex(ValueError, "already quantised"):
      quantize_params(self.nk, INT4_EXPERTS, int4_layout="nk")
    back = quantize_params(self.nk, keep, int4_layout="kn")
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(self.kn)):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

  def test_relaying_a_sharded_weight_keeps_its_split(self):
    mesh = jax.make_mesh((1, 2, 4), parallel.AXES)
    w = Int4LayoutTest.weights()  # experts [E, K, N]
    spec = parallel.leaf_partition_spec(w, ("experts", None, None), parallel.DEFAULT_RULES,
                                        mesh)
    # Placed from host copies: resharding a device array compiles a slicing program.
    placed = Int4Weight(packed=jax.device_put(np.asarray(w.packed), NamedSharding(mesh, spec.packed)),
                        scales=jax.device_put(np.asarray(w.scales), NamedSharding(mesh, spec.scales)),
                        group_size=w.group_size)
    nk = placed.to_layout("nk")
    want = parallel.leaf_partition_spec(nk, ("experts", None, None), parallel.DEFAULT_RULES,
                                        mesh)
    self.assertEqual(nk.packed.sharding, NamedSharding(mesh, want.packed))
    np.testing.assert_array_equal(np.asarray(nk.packed, np.int8),
                                  np.asarray(w.to_layout("nk").packed, np.int8))
    self.assertEqual(nk.to_layout("kn").packed.sharding, placed.packed.sharding)

  def test_params_check_and_bytes_accept_both(self):
    self.assertEqual(self.nk["layers"][1]["ffn"]["w_gate"].layout, "nk")
    check_params(self.nk, MLA, where="test")
    self.assertEqual(weight_bytes(self.nk).total, weight_bytes(self.kn).total)

  def test_sharding_swaps_k_and_n(self):
    mesh = jax.make_mesh((1, 2, 4), parallel.AXES)
    # A dense-FFN down projection [mlp, embed] (K split over "tensor") and routed
    # experts [experts, .., ..] (split over "expert").
    w = Int4LayoutTest.weights()
    for leaf, logical in ((_host_slice(w, 0), ("mlp", None)),
                          (w, ("experts", None, None))):
      kn = parallel.leaf_partition_spec(leaf, logical, parallel.DEFAULT_RULES, mesh)
      nk = parallel.leaf_partition_spec(leaf.to_layout("nk"), logical, parallel.DEFAULT_RULES,
                                        mesh)
      self.assertNotEqual(kn.packed, P(*[None] * leaf.ndim))  # a split, so the swap shows
      self.assertEqual((nk.layout, nk.scales), ("nk", kn.scales))
      self.assertEqual(nk.packed, P(*kn.packed[:-2], kn.packed[-1], kn.packed[-2]))

  def test_model_runs_the_nk_kernels(self):
    toks = put(np.random.default_rng(2).integers(0, MLA.vocab_size, (1, 4)).astype(np.int32))
    ref = forward(self.kn, toks, cfg=MLA, backend="xla")
    out = forward(self.nk, toks, cfg=MLA, backend="interpret")
    self.assertTrue(np.all(np.isfinite(np.asarray(out))))
    self.assertLess(_rel_err(out, ref), 1e-2)  # bf16 activations into the tensor cores


if __name__ == "__main__":
  absltest.main()
