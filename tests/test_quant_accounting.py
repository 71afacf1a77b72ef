"""Weight-byte accounting (mlkit.quant.accounting), up to the report's paper-scale figures."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from configs.models import GLM_5_2, KIMI_K2_6, TINY_MLA
from mlkit.model.params import count_params, indexer_param_count
from mlkit.quant.accounting import GB, GIB, checkpoint_specs, weight_bytes
from mlkit.quant.recipe import (BF16, FP8_ALL, INT4_EXPERTS, Fp8Spec, Int4Spec, Recipe, Rule,
                                quantize_params)

# GLM 5.2's checkpoint ships one multi-token-prediction layer (the presets leave
# n_mtp_layers at 0 because the serving model never runs it).
GLM_CKPT = GLM_5_2  # ships one MTP layer (n_mtp_layers=1 in the preset)


def _n_params(tree) -> int:
  return sum(x.size for x in jax.tree_util.tree_leaves(tree))


class PaperScaleTest(parameterized.TestCase):

  @parameterized.named_parameters(
      # (name, config, recipe, tp, unit, report figure total, report figure per device)
      ("glm_fp8", GLM_CKPT, FP8_ALL, 8, GIB, 705.0, 88.0),
      ("glm_int4_experts", GLM_CKPT, INT4_EXPERTS, 8, GIB, 421.0, 52.0),
      ("kimi_int4_experts_g32", KIMI_K2_6, INT4_EXPERTS, 1, GB, 594.0, 594.0),
  )
  def test_within_5_percent_of_report(self, cfg, recipe, tp, unit, total, per_device):
    wb = weight_bytes(checkpoint_specs(cfg), recipe, tp=tp)
    self.assertEqual(wb.n_devices, tp)
    self.assertLessEqual(abs(wb.total_in(unit) / total - 1), 0.05, wb.total_in(unit))
    self.assertLessEqual(abs(wb.per_device_in(unit) / per_device - 1), 0.05, wb.per_device_in(unit))

  def test_int4_halves_glm_vs_fp8_ratio(self):
    # The report's ratio 421 / 705 = 0.597 is unit-free.
    fp8 = weight_bytes(checkpoint_specs(GLM_CKPT), FP8_ALL).total
    int4 = weight_bytes(checkpoint_specs(GLM_CKPT), INT4_EXPERTS).total
    self.assertAlmostEqual(int4 / fp8, 421 / 705, delta=0.01)

  def test_checkpoint_specs_counts(self):
    # Without MTP: exactly count_params (which adds the indexer analytically).
    glm_no_mtp = dataclasses.replace(GLM_5_2, n_mtp_layers=0)
    self.assertEqual(_n_params(checkpoint_specs(glm_no_mtp)), count_params(GLM_5_2))
    self.assertEqual(_n_params(checkpoint_specs(KIMI_K2_6)), count_params(KIMI_K2_6))
    self.assertEqual(indexer_param_count(KIMI_K2_6), 0)
    # One MTP layer = one MoE block (+ its indexer) + eh_proj [2D, D] + 3 norms [D].
    D = GLM_5_2.d_model
    moe_layer = _n_params(checkpoint_specs(glm_no_mtp)["layers"][-1])
    self.assertEqual(_n_params(checkpoint_specs(GLM_CKPT)) - count_params(GLM_5_2),
                     moe_layer + 2 * D * D + 3 * D)
    self.assertEqual(checkpoint_specs(GLM_CKPT)["layers"][-1]["eh_proj"].shape, (2 * D, D))

  def test_int4_byte_formula(self):
    # One [K, N] weight: K*N/2 packed bytes + (K/g)*N bf16 scales.
    tree = {"w": jax.ShapeDtypeStruct((256, 96), jnp.bfloat16)}
    for g in (32, 64, 128):
      wb = weight_bytes(tree, Recipe("r", (Rule("w", Int4Spec(g)),)))
      self.assertEqual(wb.by_kind, {"int4": 256 * 96 // 2, "int4_scales": 256 // g * 96 * 2})
    wb = weight_bytes(tree, Recipe("r", (Rule("w", Fp8Spec()),)))
    self.assertEqual(wb.by_kind, {"fp8": 256 * 96, "fp8_scales": 2 * 1 * 4})
    self.assertEqual(weight_bytes(tree).by_kind, {"bfloat16": 256 * 96 * 2})


class LayoutTest(parameterized.TestCase):

  def test_per_device_split(self):
    tree = {"norm": jax.ShapeDtypeStruct((64,), jnp.float32),  # replicated
            "w": jax.ShapeDtypeStruct((64, 32), jnp.bfloat16),  # split tp
            "experts": jax.ShapeDtypeStruct((8, 64, 32), jnp.bfloat16)}  # split tp * ep
    wb = weight_bytes(tree, tp=2, ep=4)
    self.assertEqual(wb.n_devices, 8)
    self.assertEqual(wb.total, 64 * 4 + 64 * 32 * 2 + 8 * 64 * 32 * 2)
    self.assertEqual(wb.per_device, 64 * 4 + 64 * 32 * 2 // 2 + 8 * 64 * 32 * 2 // 8)
    self.assertEqual(weight_bytes(tree).per_device, weight_bytes(tree).total)

  @parameterized.parameters(("tp", 0), ("ep", -1), ("tp", 1.5))
  def test_bad_layout(self, name, value):
    with self.assertRaisesRegex(ValueError, f"{name} must be a positive int"):
      weight_bytes({"w": jnp.ones((4, 4))}, **{name: value})

  def test_recipe_mismatch_propagates(self):
    with self.assertRaisesRegex(ValueError, "pattern 'nope' matches no parameter"):
      weight_bytes({"w": jnp.ones((4, 4))}, Recipe("r", (Rule("w", Fp8Spec()), Rule("nope", Fp8Spec()))))

  def test_shape_only_equals_real_quantised(self):
    # Counting from shapes (eval_shape of the quantiser) matches the quantised tree's bytes.
    # Without TINY_MLA's MTP layer (checkpoint_specs counts it, count_params does not).
    cfg = dataclasses.replace(TINY_MLA, n_layers=2, n_mtp_layers=0)
    specs = checkpoint_specs(cfg)
    rng = np.random.default_rng(0)  # numpy: no per-shape threefry compiles
    params = jax.tree_util.tree_map(lambda s: jnp.asarray(rng.standard_normal(s.shape), s.dtype),
                                    specs)
    for recipe in (BF16, FP8_ALL, INT4_EXPERTS):
      counted = weight_bytes(specs, recipe, tp=2)
      real = weight_bytes(quantize_params(params, recipe), tp=2)
      self.assertEqual(counted, real)
    self.assertEqual(weight_bytes(specs, BF16).total,
                     sum(x.nbytes for x in jax.tree_util.tree_leaves(params)))
    # No MTP layers or indexer in this config: the checkpoint is the serving model.
    self.assertEqual(_n_params(specs), count_params(cfg))


if __name__ == "__main__":
  absltest.main()
