"""Recipes, quantize_params and the tiny models running on quantised params."""

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import mlkit.model as M
from configs.models import TINY_GQA, TINY_MLA
from mlkit.quant import Fp8Weight, Int4Weight
from mlkit.quant.gptq import collect_calibration
from mlkit.quant.recipe import (FP8_ALL, INT4_EXPERTS, INT4_EXPERTS_FP8_REST,
                                INT4_EXPERTS_GPTQ, KEEP, RECIPES, Fp8Spec, Int4Spec, Keep, Recipe,
                                Rule, assign_formats, calibration_paths, dequantize_params,
                                int4_experts, quantize_params)
from mlkit.quant.tree import flatten_params, is_quantised
from numpy_params import init_params_np
from host_data import put

# TINY_MLA cut to one dense and one MoE layer (every kind of weight a recipe treats, at two
# thirds of the compile time); TINY_GQA has those two layers already.
CONFIGS = {c.name: c for c in (dataclasses.replace(TINY_MLA, n_layers=2), TINY_GQA)}
# Same weights on both sides (quantised vs its own dequantised copy): the f32
# reference matmul dequantises exactly, so only op-order rounding remains.
F32_TOL = 1e-6


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert np.all(np.isfinite(a)), "NaN/inf never passes"
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@functools.cache
def _params(cfg_name):
  """Params laid out by ``param_specs`` and scaled like ``init_params``, drawn with numpy
  (the layout, not the generator, is what these tests need)."""
  return init_params_np(CONFIGS[cfg_name])


def _tokens(cfg):
  """The [2, 12] token batch the model tests share (numpy: no threefry program to compile)."""
  return put(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12)).astype(np.int32))


# One compiled program per tree structure, instead of one per eager op and leaf shape.
dequantize_tree = jax.jit(dequantize_params)


def _shapes(cfg_name):
  """Shape-only params: recipe matching needs no weights."""
  return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _params(cfg_name))


def _toy_tree_np():
  """The toy params as numpy f32 arrays (edited on the host by tests that break one)."""
  rng = np.random.default_rng(0)
  n = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
  return {"embed": n(16, 64), "final_norm": np.ones((64,), np.float32),
          "layers": [{"attn": {"wq": n(64, 32)},
                      "ffn": {"router": n(64, 4), "w_up": n(4, 64, 32)}}]}


def _toy_tree(tree=None):
  """The toy params (or ``tree``, numpy) on the device, placed without compiling."""
  return jax.tree_util.tree_map(put, _toy_tree_np() if tree is None else tree)


@functools.cache
def _gqa_calibration():
  """Calibration of TINY_GQA's GPTQ weights plus two dense ones, through the jitted forward."""
  cfg = TINY_GQA
  tokens = _tokens(cfg)
  paths = calibration_paths(_params(cfg.name), INT4_EXPERTS_GPTQ) + [
      "layers/0/attn/wq", "layers/1/ffn/shared/w_down"]
  calib = collect_calibration(lambda p: M.forward(p, tokens, cfg=cfg), _params(cfg.name), paths)
  return cfg, tokens, calib


def _toy_stats(params, path):
  w = dict(flatten_params(params)[0])[path]
  return put(np.random.default_rng(7).standard_normal((64, w.shape[-2])).astype(np.float32))  # raw activations are accepted as calibration


class RuleTest(parameterized.TestCase):

  @parameterized.parameters(
      ("layers/*/ffn/w_gate", "layers/3/ffn/w_gate", True),
      ("layers/*/ffn/w_gate", "layers/3/ffn/shared/w_gate", False),  # * stays in one segment
      ("layers/*/ffn/**/w_*", "layers/3/ffn/w_gate", True),  # ** matches zero segments
      ("layers/*/ffn/**/w_*", "layers/3/ffn/shared/w_down", True),
      ("**/*norm", "final_norm", True),
      ("**/*norm", "layers/0/attn/kv_norm", True),
      ("**/*norm", "layers/0/attn/kv_norm_x", False),
      ("{embed,lm_head}", "lm_head", True),
      ("{embed,lm_head}", "embed2", False),
      ("layers/?/attn/wq", "layers/10/attn/wq", False),
      ("re:layers/(1|2)/attn/w.*", "layers/2/attn/wkv_a", True),
      ("re:layers/(1|2)/attn/w.*", "layers/12/attn/wkv_a", False),
  )
  def test_glob(self, pattern, path, expected):
    self.assertEqual(Rule(pattern, KEEP).matches(path, 2), expected)

  def test_ndim_filter(self):
    self.assertTrue(Rule("**", KEEP, ndim=3).matches("a", 3))
    self.assertFalse(Rule("**", KEEP, ndim=3).matches("a", 2))
    self.assertTrue(Rule("**", KEEP, ndim=(2, 3)).matches("a", 2))

  def test_invalid_specs_and_rules(self):
    with self.assertRaisesRegex(ValueError, "Int4Spec.group_size"):
      Int4Spec(group_size=16)
    with self.assertRaisesRegex(ValueError, "Int4Spec.method"):
      Int4Spec(method="awq")
    with self.assertRaisesRegex(ValueError, "Int4Spec.scale_dtype"):
      Int4Spec(scale_dtype="float16")
    with self.assertRaisesRegex(ValueError, "Int4Spec.damp"):
      Int4Spec(damp=0.0)
    with self.assertRaisesRegex(ValueError, "Fp8Spec.block_size"):
      Fp8Spec(64)
    with self.assertRaisesRegex(ValueError, "Keep.dtype"):
      Keep("int8")
    with self.assertRaisesRegex(ValueError, "Rule.pattern must be a non-empty"):
      Rule("", KEEP)
    with self.assertRaisesRegex(ValueError, "Rule.spec"):
      Rule("x", "int4")
    with self.assertRaisesRegex(ValueError, r"Rule.pattern '\{a,b' is not a valid pattern"):
      Rule("{a,b", KEEP)
    with self.assertRaisesRegex(ValueError, "rules must not be empty"):
      Recipe("empty", ())


class RecipeMatchTest(parameterized.TestCase):

  def test_pattern_matching_nothing_names_pattern(self):
    r = Recipe("r", (Rule("**", KEEP), Rule("layers/*/attn/wkv_b", Fp8Spec())))
    with self.assertRaisesRegex(ValueError, r"Recipe 'r': pattern 'layers/\*/attn/wkv_b' matches no"):
      assign_formats(_toy_tree(), r)
    # The same rule marked optional is fine.
    r = Recipe("r", (Rule("**", KEEP), Rule("layers/*/attn/wkv_b", Fp8Spec(), optional=True)))
    self.assertLen(assign_formats(_toy_tree(), r), 5)

  def test_parameter_matched_by_two_rules_names_both(self):
    r = Recipe("r", (Rule("**", KEEP), Rule("layers/*/attn/wq", Fp8Spec())))
    with self.assertRaisesRegex(
        ValueError, r"parameter 'layers/0/attn/wq' is matched by two rules: '\*\*' and "
        r"'layers/\*/attn/wq'"):
      assign_formats(_toy_tree(), r)

  def test_parameter_matched_by_no_rule(self):
    r = Recipe("r", (Rule("embed", KEEP),))
    with self.assertRaisesRegex(ValueError, r"parameter 'final_norm' is matched by no rule"):
      assign_formats(_toy_tree(), r)

  @parameterized.parameters(
      ("final_norm", "is 1-D"),
      ("embed", "must stay dense"),
      ("layers/0/ffn/router", "must stay dense"),
  )
  def test_never_quantised(self, path, msg):
    r = Recipe("r", (Rule(path, Fp8Spec()), Rule(f"re:(?!{path}$).*", KEEP)))
    with self.assertRaisesRegex(ValueError, f"parameter '{path}' {msg}"):
      assign_formats(_toy_tree(), r)

  @parameterized.product(cfg_name=list(CONFIGS), recipe_name=list(RECIPES))
  def test_presets_cover_every_parameter_once(self, cfg_name, recipe_name):
    recipe = RECIPES[recipe_name]
    params = _shapes(cfg_name)
    flat, _ = flatten_params(params)
    specs = assign_formats(params, recipe)
    self.assertEqual(list(specs), [p for p, _ in flat])
    ndims = {p: leaf.ndim for p, leaf in flat}
    quantised = {p for p, s in specs.items() if not isinstance(s, Keep)}
    for p in quantised:  # never: 1-D, routers, embed
      self.assertIn(ndims[p], (2, 3))
      self.assertNotIn("router", p)
      self.assertNotEqual(p, "embed")
    experts = {p for p in ndims if ndims[p] == 3}
    int4 = {p for p, s in specs.items() if isinstance(s, Int4Spec)}
    fp8 = {p for p, s in specs.items() if isinstance(s, Fp8Spec)}
    projections = {p for p in ndims if ndims[p] >= 2 and "router" not in p
                   and p not in ("embed", "lm_head")}
    if recipe_name == "bf16":
      self.assertEmpty(quantised)
    elif recipe_name.startswith("int4-experts"):
      self.assertEqual(int4, experts)
      self.assertEqual(fp8, projections - experts if recipe_name.endswith("fp8-rest") else set())
    else:
      self.assertEqual(fp8, projections)


class QuantizeParamsErrorTest(parameterized.TestCase):

  def test_group_size_not_dividing_names_param(self):
    params = _params(TINY_MLA.name)
    with self.assertRaisesRegex(ValueError,
                                r"layers/1/ffn/w_down: group_size 128 does not divide input dim K=32"):
      quantize_params(params, int4_experts(128))

  def test_odd_k_names_param(self):
    tree = {"layers": [{"w_odd": put(np.ones((33, 8), np.float32))}]}
    with self.assertRaisesRegex(ValueError, r"layers/0/w_odd: input dim K=33 is odd"):
      quantize_params(tree, Recipe("r", (Rule("**", Int4Spec(32)),)))

  def test_non_finite_names_param(self):
    tree = _toy_tree_np()
    tree["layers"][0]["ffn"]["w_up"][1, 2, 3] = np.inf  # on the host: no scatter to compile
    tree = _toy_tree(tree)
    with self.assertRaisesRegex(ValueError, r"layers/0/ffn/w_up: weight has non-finite"):
      quantize_params(tree, Recipe("r", (Rule("layers/*/ffn/w_up", Fp8Spec()),
                                         Rule("re:(?!layers/0/ffn/w_up$).*", KEEP))))

  def test_already_quantised_names_param(self):
    r = Recipe("r", (Rule("layers/*/attn/wq", Fp8Spec()), Rule("re:(?!layers/0/attn/wq$).*", KEEP)))
    once = quantize_params(_toy_tree(), r)
    self.assertIsInstance(once["layers"][0]["attn"]["wq"], Fp8Weight)
    with self.assertRaisesRegex(ValueError, r"layers/0/attn/wq: parameter is already quantised"):
      quantize_params(once, r)
    # Keeping (even with a cast) leaves a quantised weight as it is.
    kept = quantize_params(once, Recipe("r", (Rule("**", Keep("bfloat16")),)))
    self.assertIs(kept["layers"][0]["attn"]["wq"], once["layers"][0]["attn"]["wq"])
    self.assertEqual(kept["embed"].dtype, jnp.bfloat16)

  def test_gptq_needs_calibration(self):
    params = _params(TINY_GQA.name)
    with self.assertRaisesRegex(ValueError, r"uses GPTQ for 'layers/1/ffn/w_down'.*no calibration"):
      quantize_params(params, INT4_EXPERTS_GPTQ)

  def test_gptq_missing_path_warns_and_uses_rtn(self):
    tree = {"wkv_b": put(np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32))}
    r = Recipe("r", (Rule("wkv_b", Int4Spec(32, method="gptq")),))
    with self.assertWarnsRegex(UserWarning, r"no calibration for \['wkv_b'\]"):
      out = quantize_params(tree, r, calibration={})
    rtn = quantize_params(tree, Recipe("r", (Rule("wkv_b", Int4Spec(32)),)))
    np.testing.assert_array_equal(np.asarray(out["wkv_b"].packed), np.asarray(rtn["wkv_b"].packed))

  def test_keep_dtype_casts(self):
    out = quantize_params(_toy_tree(), Recipe("r", (Rule("**", Keep("bfloat16")),)))
    self.assertTrue(all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(out)))

  def test_collect_calibration_errors(self):
    params = _params(TINY_GQA.name)
    tok = put(np.full((1, 4), 3, np.int32))
    with self.assertRaisesRegex(ValueError, r"no parameter named 'layers/9/ffn/w_up'"):
      collect_calibration(lambda p: M.forward(p, tok, cfg=TINY_GQA), params, ["layers/9/ffn/w_up"])

  def test_collect_calibration_under_jit(self):
    cfg, tok, calib = _gqa_calibration()
    params = _params(cfg.name)
    self.assertEqual(calib["layers/1/ffn/shared/w_down"].xtx.shape, (32, 32))
    self.assertEqual(float(calib["layers/1/ffn/shared/w_down"].count), tok.size)
    # Independent: layer 0's query input is the RMS-normed embedding (unit norm scale).
    x = np.asarray(params["embed"], np.float64)[np.asarray(tok).reshape(-1)]
    x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    np.testing.assert_allclose(np.asarray(calib["layers/0/attn/wq"].xtx), x.T @ x,
                               rtol=1e-4, atol=1e-4)
    self.assertEqual(float(calib["layers/0/attn/wq"].count), tok.size)


class QuantisedModelTest(parameterized.TestCase):
  """The model runs unchanged, under jit, on every recipe's params."""

  _cache = {}

  def _setup(self, cfg_name):
    if cfg_name not in self._cache:
      cfg = CONFIGS[cfg_name]
      params = _params(cfg_name)
      tokens = _tokens(cfg)
      fwd = jax.jit(lambda p, t: M.forward(p, t, cfg=cfg))
      self._cache[cfg_name] = (cfg, params, tokens, fwd, fwd(params, tokens))
    return self._cache[cfg_name]

  def _noise_equivalent(self, params, qparams, seed):
    """params with each quantised weight perturbed by Gaussian noise of its quantisation RMS."""
    flat, treedef = flatten_params(qparams)
    dense, _ = flatten_params(params)
    deq, _ = flatten_params(dequantize_tree(qparams))
    rng = np.random.default_rng(seed)
    out = []
    for (_, q), (_, w), (_, dq) in zip(flat, dense, deq):
      if is_quantised(q):
        w = np.asarray(w)
        rms = np.sqrt(np.mean((np.asarray(dq) - w) ** 2))
        w = put(w + rms * rng.standard_normal(w.shape).astype(w.dtype))
      out.append(w)
    return jax.tree_util.tree_unflatten(treedef, out)

  # One jit compile per (config, param structure), so the runs are chosen to cover
  # int4 experts with dense rest, int4 experts with fp8 rest (int4 grouped + fp8
  # dense on MLA, incl. the dequantised wkv_b), and fp8 grouped experts; every
  # preset's quantize_params runs in test_every_preset_quantises.
  @parameterized.parameters((TINY_MLA.name, INT4_EXPERTS_FP8_REST.name),
                            (TINY_GQA.name, INT4_EXPERTS.name), (TINY_GQA.name, FP8_ALL.name))
  def test_logits(self, cfg_name, recipe_name):
    cfg, params, tokens, fwd, ref = self._setup(cfg_name)
    recipe = RECIPES[recipe_name]
    qparams = quantize_params(params, recipe)
    specs = assign_formats(params, recipe)
    flat, _ = flatten_params(qparams)
    for path, leaf in flat:
      want = {Int4Spec: Int4Weight, Fp8Spec: Fp8Weight}.get(type(specs[path]))
      if want is None:
        self.assertFalse(is_quantised(leaf), path)
      else:
        self.assertIsInstance(leaf, want, path)
    out = fwd(qparams, tokens)
    self.assertEqual(out.shape, ref.shape)
    # 1. The model uses exactly the quantised weights: same logits as on their dense copy.
    self.assertLessEqual(_rel(out, fwd(dequantize_tree(qparams), tokens)), F32_TOL)
    # 2. Against the f32 model. These random tiny MoE models are chaotic (1% weight
    #    noise moves tiny-mla's logits by ~20%, via routing flips), so a fixed
    #    tolerance would be arbitrary. Instead: quantisation must hurt no more than
    #    2x unbiased Gaussian noise of the same per-tensor RMS (mean of 3 draws;
    #    measured ratios 0.9-1.3). Swapping the int4 nibbles, for example, gives
    #    3.1x on tiny-mla and 8x on tiny-gqa, and fails.
    err = _rel(out, ref)
    noise_err = np.mean([_rel(fwd(self._noise_equivalent(params, qparams, seed), tokens), ref)
                         for seed in range(3)])
    self.assertGreater(err, 0.0)
    self.assertLessEqual(err, 2.0 * noise_err, (err, noise_err))

  @parameterized.product(cfg_name=list(CONFIGS), recipe_name=list(RECIPES))
  def test_every_preset_quantises(self, cfg_name, recipe_name):
    params, recipe = _params(cfg_name), RECIPES[recipe_name]
    calib = None
    if recipe_name.endswith("gptq"):  # random activations stand in for model calibration here
      calib = {p: _toy_stats(params, p) for p in calibration_paths(params, recipe)}
    out = quantize_params(params, recipe, calibration=calib)
    dense = dequantize_tree(out)
    self.assertEqual(jax.tree_util.tree_structure(dense), jax.tree_util.tree_structure(params))
    specs = assign_formats(params, recipe)
    for (path, q), (_, w), (_, dq) in zip(flatten_params(out)[0], flatten_params(params)[0],
                                          flatten_params(dense)[0]):
      if isinstance(specs[path], Keep):
        self.assertIs(q, w)  # untouched, not copied or cast
      else:
        self.assertEqual(q.shape, w.shape)
        self.assertLessEqual(_rel(dq, w), 0.2, path)

  def test_gptq_end_to_end_beats_rtn(self):
    cfg, params, tokens, fwd, ref = self._setup(TINY_GQA.name)
    paths = calibration_paths(params, INT4_EXPERTS_GPTQ)
    self.assertEqual(paths, ["layers/1/ffn/w_down", "layers/1/ffn/w_gate", "layers/1/ffn/w_up"])
    _, calib_tokens, calib = _gqa_calibration()
    np.testing.assert_array_equal(np.asarray(calib_tokens), np.asarray(tokens))
    self.assertEqual(sorted(calib), sorted(paths + ["layers/0/attn/wq", "layers/1/ffn/shared/w_down"]))
    E, D, F = cfg.n_routed_experts, cfg.d_model, cfg.moe_ffn_dim
    self.assertEqual(calib["layers/1/ffn/w_gate"].xtx.shape, (E, D, D))
    self.assertEqual(calib["layers/1/ffn/w_down"].xtx.shape, (E, F, F))
    # Every routed assignment is one calibration row of its expert.
    self.assertEqual(float(np.sum(np.asarray(calib["layers/1/ffn/w_up"].count))),
                     tokens.size * cfg.top_k)
    with warnings.catch_warnings():
      warnings.simplefilter("error")  # every GPTQ weight was calibrated
      q_gptq = quantize_params(params, INT4_EXPERTS_GPTQ, calibration=calib)
    q_rtn = quantize_params(params, INT4_EXPERTS)
    # On the calibration tokens GPTQ's objective (layer output error) is what it minimises.
    e_gptq, e_rtn = _rel(fwd(q_gptq, tokens), ref), _rel(fwd(q_rtn, tokens), ref)
    self.assertLess(e_gptq, e_rtn, (e_gptq, e_rtn))


if __name__ == "__main__":
  absltest.main()
