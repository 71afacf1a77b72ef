"""Config validation and preset facts."""

import dataclasses

from absl.testing import absltest, parameterized

import configs
from configs import GLM_5_2, H200, KIMI_K2_6, MINI_MLA, SMALL_MLA, TINY_GLM, TINY_GQA, TINY_MLA
from mlkit.config import HardwareConfig, ModelConfig, RopeScaling
from mlkit.model import count_params


class ConfigValidationTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("top_k_exceeds_experts", TINY_MLA, {"top_k": 9}, "top_k"),
      ("negative_rank", TINY_MLA, {"kv_lora_rank": 0}, "kv_lora_rank"),
      ("negative_q_lora", TINY_MLA, {"q_lora_rank": -1}, "q_lora_rank"),
      ("odd_rope_dim", TINY_MLA, {"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
      ("heads_not_divisible", TINY_GQA, {"n_kv_heads": 3}, "n_kv_heads"),
      ("odd_head_dim", TINY_GQA, {"head_dim": 15}, "head_dim"),
      ("zero_layers", TINY_MLA, {"n_layers": 0}, "n_layers"),
      ("dense_exceeds_layers", TINY_MLA, {"first_k_dense": 4}, "first_k_dense"),
      ("bad_attention", TINY_MLA, {"attention": "mha"}, "attention"),
      ("bad_router", TINY_MLA, {"router": "relu"}, "router"),
      ("group_not_dividing", TINY_MLA, {"n_group": 3}, "n_group"),
      ("topk_group_too_big", TINY_MLA, {"topk_group": 3}, "topk_group"),
      ("bad_dtype", TINY_MLA, {"dtype": "float16"}, "dtype"),
      ("indexer_half_set", TINY_MLA, {"index_n_heads": 4}, "index_"),
      ("no_dense_width", TINY_MLA, {"dense_ffn_dim": 0}, "dense_ffn_dim"),
      ("bad_scaling", TINY_MLA, {"routed_scaling_factor": 0.0}, "routed_scaling_factor"),
  )
  def test_invalid_field_is_named(self, base, change, field):
    with self.assertRaisesRegex(ValueError, field):
      dataclasses.replace(base, **change)

  def test_rope_scaling_validation(self):
    with self.assertRaisesRegex(ValueError, "factor"):
      RopeScaling(factor=0.5)
    with self.assertRaisesRegex(ValueError, "beta_fast"):
      RopeScaling(beta_fast=0.5, beta_slow=1.0)

  def test_hardware_validation(self):
    with self.assertRaisesRegex(ValueError, "hbm_bytes"):
      HardwareConfig(name="x", hbm_bytes=0, hbm_bandwidth=1.0, bf16_flops=1.0)
    self.assertEqual(H200.hbm_bytes, 141 * 10**9)
    self.assertEqual(H200.bf16_flops, 989e12)
    self.assertEqual(H200.fp8_flops, 1979e12)

  def test_frozen(self):
    with self.assertRaises(dataclasses.FrozenInstanceError):
      TINY_MLA.n_layers = 5

  def test_json_round_trip(self):
    for cfg in configs.MODEL_PRESETS.values():
      self.assertEqual(ModelConfig.from_dict(__import__("json").loads(cfg.to_json())), cfg)
    with self.assertRaisesRegex(ValueError, "unknown fields"):
      ModelConfig.from_dict({**TINY_MLA.to_dict(), "bogus": 1})

  def test_presets_match_design(self):
    self.assertEqual((KIMI_K2_6.n_layers, KIMI_K2_6.d_model, KIMI_K2_6.n_heads), (61, 7168, 64))
    self.assertEqual((KIMI_K2_6.n_routed_experts, KIMI_K2_6.top_k, KIMI_K2_6.first_k_dense), (384, 8, 1))
    self.assertEqual(KIMI_K2_6.cache_values_per_token, 576)
    self.assertEqual((GLM_5_2.n_layers, GLM_5_2.first_k_dense, GLM_5_2.v_head_dim), (78, 3, 256))
    self.assertEqual((GLM_5_2.index_n_heads, GLM_5_2.index_head_dim, GLM_5_2.index_topk), (32, 128, 2048))
    # GLM 5.2 runs DeepSeek Sparse Attention: every layer its own indexer (transformers'
    # default schedule), the GLM latent-norm epsilon.
    self.assertTrue(GLM_5_2.sparse_attention)
    self.assertEqual(set(GLM_5_2.indexer_types), {"full"})
    self.assertEqual(GLM_5_2.latent_eps, 1e-6)
    self.assertTrue(TINY_GLM.sparse_attention)
    self.assertIn("shared", TINY_GLM.indexer_types)

  def test_first_layers(self):
    cut = GLM_5_2.first_layers(5)
    self.assertEqual((cut.n_layers, cut.first_k_dense, len(cut.indexer_types)), (5, 3, 5))
    self.assertEqual(TINY_GLM.first_layers(2).indexer_types, ("full", "shared"))
    self.assertEqual(KIMI_K2_6.first_layers(1).first_k_dense, 1)
    self.assertEqual(TINY_MLA.first_layers(2).indexer_types, ())
    with self.assertRaisesRegex(ValueError, "at least one layer"):
      TINY_MLA.first_layers(0)
    for cfg in (TINY_MLA, TINY_GQA):
      self.assertBetween(cfg.n_layers, 2, 4)
      self.assertBetween(cfg.n_routed_experts, 8, 16)
      self.assertEqual((cfg.top_k, cfg.n_shared_experts, cfg.first_k_dense), (2, 1, 1))


class ParamCountTest(absltest.TestCase):

  def test_published_totals(self):
    # Kimi K2: about 1.03T parameters; GLM 5: about 744B (within 1%).
    self.assertLess(abs(count_params(KIMI_K2_6) / 1.03e12 - 1), 0.01)
    self.assertLess(abs(count_params(GLM_5_2) / 744e9 - 1), 0.01)

  def test_small_preset_size(self):
    self.assertBetween(count_params(SMALL_MLA), 20e6, 50e6)
    self.assertBetween(count_params(MINI_MLA), 5e6, 10e6)


if __name__ == "__main__":
  absltest.main()
