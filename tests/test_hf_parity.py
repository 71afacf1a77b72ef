"""The model against Hugging Face transformers, in float32, on committed fixtures.

``tests/fixtures/<name>/`` holds a tiny random checkpoint saved by transformers
(``save_pretrained``, so config.json is in the layout current transformers
writes) and the logits transformers computed from it (``reference.npz``); see
``scripts/make_hf_fixtures.py``, which made them in a throwaway environment. This
test never imports torch.

Covered for each fixture: a cache-free forward, a prefill then token-by-token
decode through a KV cache (teacher forced), and greedy generation through the
serving engine (paged float32 cache): logits within a relative L2 error of 1e-4
and identical greedy tokens.
"""

import dataclasses
import json
import os
import tempfile
import unittest

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from mlkit.checkpoint import config_from_hf, config_to_hf, load_hf_checkpoint, save_hf_checkpoint
from mlkit.engine import Engine, EngineConfig
from mlkit.kvcache import KVCacheConfig
from mlkit.model import apply_jit, forward
from mlkit.generate import generate
from mlkit.model.cache import init_cache
from mlkit.sampling import SamplingParams

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
RTOL_L2 = 1e-4


def rel_l2(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def cached_decode(params, cfg, ref: dict, mla_mode: str):
  """Prefill of ref's prompt, then its remaining tokens one at a time through a cache.

  Returns:
    (logits of each decode step [B, T - prompt_len, V], the final cache).
  """
  tokens, n = ref["tokens"], int(ref["prompt_len"])
  B, T = tokens.shape
  cache = init_cache(cfg, B, T)
  pos = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
  _, cache = apply_jit(params, jnp.asarray(tokens[:, :n]), jnp.asarray(pos[:, :n]), cache,
                       cfg=cfg, mla_mode=mla_mode)
  steps = []
  for t in range(n, T):
    logits, cache = apply_jit(params, jnp.asarray(tokens[:, t:t + 1]), jnp.asarray(pos[:, t:t + 1]),
                              cache, cfg=cfg, mla_mode=mla_mode)
    steps.append(np.asarray(logits[:, 0]))
  return np.stack(steps, 1), cache


class DeepseekV3Transformers5Test(parameterized.TestCase):
  """A DeepSeek-V3 checkpoint as transformers 5 saves it (rope_parameters, dtype, YaRN)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.path = os.path.join(FIXTURES, "deepseek_v3_tf5")
    cls.ref = dict(np.load(os.path.join(cls.path, "reference.npz")))
    cls.params, cls.cfg = load_hf_checkpoint(cls.path)

  def test_config_is_the_transformers5_layout(self):
    with open(os.path.join(self.path, "config.json")) as f:
      hf = json.load(f)
    self.assertNotIn("rope_theta", hf)  # only inside rope_parameters
    self.assertIn("rope_parameters", hf)
    cfg = self.cfg
    self.assertEqual(cfg.dtype, "float32")
    self.assertEqual(cfg.rope_theta, hf["rope_parameters"]["rope_theta"])
    self.assertEqual(cfg.rope_scaling.factor, hf["rope_parameters"]["factor"])
    self.assertEqual(cfg.rope_scaling.mscale_all_dim, hf["rope_parameters"]["mscale_all_dim"])
    self.assertEqual(cfg.first_k_dense, 1)

  def test_cache_free_forward(self):
    logits = forward(self.params, jnp.asarray(self.ref["tokens"]), cfg=self.cfg)
    self.assertLess(rel_l2(logits, self.ref["logits"]), RTOL_L2)

  @parameterized.parameters("naive", "absorbed")
  def test_prefill_then_decode_through_a_cache(self, mla_mode):
    steps, _ = cached_decode(self.params, self.cfg, self.ref, mla_mode)
    self.assertLess(rel_l2(steps, self.ref["decode_logits"]), RTOL_L2)

  def test_engine_greedy_matches(self):
    n, greedy = int(self.ref["prompt_len"]), self.ref["greedy"]
    B, N = greedy.shape
    kv = KVCacheConfig(num_pages=1, dtype="float32").resolve(self.cfg)
    pages = -(-(n + N) // kv.page_size)
    ecfg = EngineConfig(model=self.cfg, kv=dataclasses.replace(kv, num_pages=B * pages + 1),
                        max_running=B, batch_buckets=(B,), prefill_buckets=(n,),
                        prefill_token_budget=B * n, max_pages_per_seq=pages, record_logits=True)
    eng = Engine(self.params, ecfg)
    ids = [eng.submit(self.ref["tokens"][i, :n].tolist(), SamplingParams(max_new_tokens=N))
           for i in range(B)]
    eng.run_until_done()
    for i, rid in enumerate(ids):
      self.assertEqual(eng.get(rid).output, greedy[i].tolist())
      self.assertLess(rel_l2(np.stack(eng.logits[rid]), self.ref["greedy_logits"][i]), RTOL_L2)


class _SparseAttentionParity(parameterized.TestCase):
  """DeepSeek Sparse Attention against transformers; subclasses name the fixture."""

  FIXTURE = ""
  # The indexer layer schedule the fixture was saved with.
  INDEXER_TYPES: tuple = ()

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    if not cls.FIXTURE:
      raise unittest.SkipTest("the shared body; its subclasses name a fixture")
    cls.path = os.path.join(FIXTURES, cls.FIXTURE)
    cls.ref = dict(np.load(os.path.join(cls.path, "reference.npz")))
    cls.params, cls.cfg = load_hf_checkpoint(cls.path)

  def _forward(self, cfg):
    return forward(self.params, jnp.asarray(self.ref["tokens"]), cfg=cfg)

  def test_config(self):
    cfg = self.cfg
    self.assertEqual(cfg.indexer_types, self.INDEXER_TYPES)
    self.assertEqual((cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk), (8, 16, 6))
    self.assertEqual(cfg.latent_eps, 1e-6)  # transformers' latent norms, whatever rms_norm_eps says
    self.assertEqual(config_from_hf(config_to_hf(cfg)), cfg)
    for i, kind in enumerate(cfg.indexer_types):  # indexer weights on full layers only
      self.assertEqual("indexer_wq_b" in self.params["layers"][i]["attn"], kind == "full")

  def test_cache_free_forward(self):
    self.assertLess(rel_l2(self._forward(self.cfg), self.ref["logits"]), RTOL_L2)

  def test_the_selection_matters(self):
    # The same weights attending densely are far off: the comparison above checks the
    # indexer's choice, not just MLA.
    dense = dataclasses.replace(self.cfg, index_topk=10_000)
    self.assertGreater(rel_l2(self._forward(dense), self.ref["logits"]), 1e-2)

  @parameterized.parameters("naive", "absorbed")
  def test_prefill_then_decode_through_a_cache(self, mla_mode):
    steps, cache = cached_decode(self.params, self.cfg, self.ref, mla_mode)
    for i, kind in enumerate(self.cfg.indexer_types):  # full layers cache their indexer keys
      self.assertEqual("index_k" in cache.layers[i], kind == "full")
    self.assertLess(rel_l2(steps, self.ref["decode_logits"]), RTOL_L2)

  def test_greedy_generation(self):
    n, greedy = int(self.ref["prompt_len"]), self.ref["greedy"]
    out = generate(self.params, self.cfg, self.ref["tokens"][:, :n].tolist(),
                   SamplingParams(max_new_tokens=greedy.shape[1]))
    self.assertEqual(out.tokens, greedy.tolist())

  def test_hf_round_trip(self):
    with tempfile.TemporaryDirectory() as d:
      save_hf_checkpoint(d, self.params, self.cfg)
      params, cfg = load_hf_checkpoint(d)
    self.assertEqual(cfg, self.cfg)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(self.params)):
      np.testing.assert_array_equal(a, b)


class GlmMoeDsaTest(_SparseAttentionParity):
  """GLM 5: full and shared indexer layers, indexer rope in interleaved pairs."""

  FIXTURE = "glm_moe_dsa"
  INDEXER_TYPES = ("full", "shared", "full", "shared")

  def test_glm_specifics(self):
    self.assertTrue(self.cfg.index_rope_interleave)
    self.assertEqual(self.cfg.rms_norm_eps, 1e-5)

  # Paged serving (Engine, DisaggEngine) of this fixture: tests/test_glm_serving.py.


class DeepseekV32Test(_SparseAttentionParity):
  """DeepSeek-V3.2: the indexer on every layer, its rope in halves; YaRN."""

  FIXTURE = "deepseek_v32"
  INDEXER_TYPES = ("full", "full", "full")

  def test_v32_specifics(self):
    self.assertFalse(self.cfg.index_rope_interleave)
    self.assertIsNotNone(self.cfg.rope_scaling)
    # The other layout is far off: the indexer rope layout matters here.
    glm_rope = dataclasses.replace(self.cfg, index_rope_interleave=True)
    self.assertGreater(rel_l2(self._forward(glm_rope), self.ref["logits"]), 1e-3)


class TransformersConfigLayoutTest(absltest.TestCase):
  """config_from_hf reads the transformers-5 fields and refuses what it cannot run."""

  def _hf(self, **over):
    with open(os.path.join(FIXTURES, "deepseek_v3_tf5", "config.json")) as f:
      hf = json.load(f)
    hf.update(over)
    return {k: v for k, v in hf.items() if v is not ...}

  def test_classic_and_new_layout_agree(self):
    rp = self._hf()["rope_parameters"]
    classic = self._hf(rope_parameters=..., rope_theta=rp["rope_theta"],
                       rope_scaling={k: v for k, v in rp.items() if k != "rope_theta"})
    self.assertEqual(config_from_hf(classic), config_from_hf(self._hf()))

  def test_default_rope_type_has_no_scaling(self):
    cfg = config_from_hf(self._hf(rope_parameters={"rope_type": "default", "rope_theta": 5e4}))
    self.assertIsNone(cfg.rope_scaling)
    self.assertEqual(cfg.rope_theta, 5e4)

  def test_mlp_layer_types(self):
    n = self._hf()["num_hidden_layers"]
    cfg = config_from_hf(self._hf(first_k_dense_replace=..., mlp_layer_types=["dense"] * 2 + ["sparse"] * (n - 2)))
    self.assertEqual(cfg.first_k_dense, 2)
    for bad, msg in [(["sparse", "dense"] + ["sparse"] * (n - 2), "dense layers first"),
                     (["dense"] * 2 + ["sparse"] * (n - 2), "first_k_dense_replace says 1"),
                     (["dense"], "entries"), (["moe"] * n, "'dense'/'sparse'")]:
      with self.subTest(bad=bad), self.assertRaisesRegex(ValueError, msg):
        config_from_hf(self._hf(mlp_layer_types=bad))

  def test_rope_errors(self):
    with self.assertRaisesRegex(ValueError, "missing required field 'rope_theta'"):
      config_from_hf(self._hf(rope_parameters={"rope_type": "default"}))
    with self.assertRaisesRegex(ValueError, "disagree"):
      config_from_hf(self._hf(rope_theta=1.0))
    with self.assertRaisesRegex(ValueError, "rope_parameters type 'llama3' is not supported"):
      config_from_hf(self._hf(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4}))
    with self.assertRaisesRegex(ValueError, "rope_parameters must be a dict"):
      config_from_hf(self._hf(rope_parameters=[1]))


if __name__ == "__main__":
  absltest.main()
