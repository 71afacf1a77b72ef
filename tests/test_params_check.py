"""check_params: a params tree against its config's layout (names, shapes, dtypes, weight formats)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from configs.models import TINY_GQA, TINY_MLA
from mlkit import parallel
from mlkit.model import check_params, init_params, param_specs
from mlkit.quant import (RECIPES, Fp8Weight, Int4Weight, calibration_paths, fp8_all, quantize_fp8,
                         quantize_int4, quantize_params)
from mlkit.quant.tree import flatten_params

TINY_MLA_BF16 = dataclasses.replace(TINY_MLA, dtype="bfloat16", param_dtype="bfloat16")
CONFIGS = {"mla": TINY_MLA, "gqa": TINY_GQA, "mla_bf16": TINY_MLA_BF16}
_CACHE: dict = {}


def _params(cfg):
  """Random params in the ``param_specs`` layout, drawn with numpy (init_params compiles for ~10 s)."""
  if cfg not in _CACHE:
    rng = np.random.default_rng(0)
    is_spec = lambda x: isinstance(x, tuple) and len(x) in (2, 3) and isinstance(x[0], tuple)

    def leaf(spec):  # cast in numpy: an eager astype would compile once per shape
      dt = jnp.dtype(spec[2] if len(spec) == 3 else cfg.param_dtype)
      return jnp.asarray((rng.standard_normal(spec[0]) * 0.1).astype(dt))
    _CACHE[cfg] = jax.tree_util.tree_map(leaf, param_specs(cfg), is_leaf=is_spec)
  return _CACHE[cfg]


def _copy(tree):
  return jax.tree_util.tree_map(lambda x: x, tree)


def _abstract(fn):
  """``fn`` applied to a weight for shapes and dtypes only (traced, not compiled)."""
  return lambda w: jax.eval_shape(fn, w)


def _bf16(w):
  return jax.ShapeDtypeStruct(w.shape, jnp.bfloat16)


def _t(w):
  return jax.ShapeDtypeStruct(w.shape[::-1], w.dtype)


def _quantised_abstract(cfg, recipe):
  """``quantize_params(init_params(cfg), recipe)`` evaluated for shapes and dtypes only.

  The same code runs as in a real quantisation, traced instead of compiled; GPTQ
  rules get random calibration activations of the right width.
  """
  key = jax.random.key(0)
  abstract = jax.eval_shape(lambda k: init_params(cfg, k), key)
  rng = np.random.default_rng(1)
  shapes = dict(flatten_params(abstract)[0])
  calibration = {p: jnp.asarray(rng.standard_normal((16, shapes[p].shape[-2])), jnp.float32)
                 for p in calibration_paths(abstract, recipe)} or None
  return jax.eval_shape(lambda k: quantize_params(init_params(cfg, k), recipe, calibration), key)


class AcceptsTest(parameterized.TestCase):

  @parameterized.named_parameters(*[(f"{c}_{r}", c, r) for c in ("mla", "gqa")
                                    for r in list(RECIPES) + ["fp8-all-per-channel"]])
  def test_every_recipe(self, cfg_name, recipe_name):
    cfg = CONFIGS[cfg_name]
    recipe = RECIPES.get(recipe_name) or fp8_all(None)
    tree = _quantised_abstract(cfg, recipe)
    kinds = {type(leaf).__name__ for _, leaf in flatten_params(tree)[0]}
    if recipe_name != "bf16":
      self.assertTrue(kinds & {"Int4Weight", "Fp8Weight"}, kinds)
    check_params(tree, cfg, where="test")

  def test_concrete_quantised_and_sharded(self):
    cfg = TINY_MLA
    params = _copy(_params(cfg))
    ffn, attn = params["layers"][1]["ffn"], params["layers"][1]["attn"]
    ffn["w_gate"] = quantize_int4(ffn["w_gate"], 32)
    attn["wkv_b"] = quantize_fp8(attn["wkv_b"])
    check_params(params, cfg, where="test")
    mesh = parallel.make_mesh(parallel.MeshConfig.for_devices(len(jax.devices()), expert=2))
    # Placed from host copies: resharding device arrays would compile a copy per shape.
    sharded = parallel.shard_params(jax.tree_util.tree_map(np.asarray, params), mesh)
    self.assertGreater(len(sharded["layers"][1]["ffn"]["w_gate"].packed.sharding.device_set), 1)
    self.assertGreater(len(sharded["layers"][1]["attn"]["wkv_b"].values.sharding.device_set), 1)
    # Shapes and dtypes only: no transfer between host and devices.
    with jax.transfer_guard("disallow"):
      check_params(sharded, cfg, where="test")

  def test_bf16_and_abstract(self):
    check_params(_params(TINY_MLA_BF16), TINY_MLA_BF16, where="test")
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _params(TINY_GQA))
    check_params(abstract, TINY_GQA, where="test")


def _set(path, value_fn):
  """A mutation: the leaf at ``path`` (keys) replaced by ``value_fn(old_leaf)``."""
  def mutate(params):
    node = params
    for k in path[:-1]:
      node = node[k]
    node[path[-1]] = value_fn(node[path[-1]])
  return mutate


class RejectsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("wrong_shape", _set(("layers", 1, "attn", "wkv_a"), _t),
       r"layers/1/attn/wkv_a: expected float32\[64, 40\], found float32\[40, 64\]"),
      ("wrong_dtype", _set(("layers", 2, "ffn", "w_up"), _bf16),
       r"layers/2/ffn/w_up: expected float32\[8, 64, 32\], found bfloat16\[8, 64, 32\]"),
      ("router_not_f32", _set(("layers", 1, "ffn", "router"), _bf16),
       r"layers/1/ffn/router: expected float32\[64, 8\], found bfloat16\[64, 8\]"),
      ("missing", lambda p: p["layers"][0]["attn"].pop("kv_norm"),
       r"layers/0/attn/kv_norm is missing \(expected float32\[32\]\) \[1 missing leaves in all\]"),
      ("extra", lambda p: p["layers"][0]["attn"].update(wk=p["layers"][0]["attn"]["wkv_a"]),
       r"layers/0/attn/wk is not a parameter of this config \[1 extra leaves in all"),
      ("missing_layer", lambda p: p["layers"].pop(),
       r"layers/2/attn/kv_norm is missing"),
      ("none_leaf", _set(("final_norm",), lambda w: None),
       r"final_norm is a NoneType, not an array or a quantised weight \(expected float32\[64\]\)"),
      ("int4_wrong_dense_shape", _set(("layers", 1, "ffn", "w_down"),
                                      _abstract(lambda w: quantize_int4(jnp.swapaxes(w, 1, 2), 32))),
       r"layers/1/ffn/w_down: expected int4 \(group 32\) for \[8, 32, 64\]: packed uint8\[8, 16, 64\], "
       r"scales bfloat16\|float32\[8, 1, 64\], found int4 \(group 32\): packed uint8\[8, 32, 32\]"),
      ("int4_scales_of_another_group", _set(
          ("layers", 1, "ffn", "w_gate"),
          _abstract(lambda w: Int4Weight(quantize_int4(w, 32).packed, quantize_int4(w, 64).scales, 32))),
       r"layers/1/ffn/w_gate: expected int4 \(group 32\) for \[8, 64, 32\]: .*scales "
       r"bfloat16\|float32\[8, 2, 32\], found .*scales bfloat16\[8, 1, 32\]"),
      ("int4_packed_int8", _set(
          ("layers", 1, "ffn", "w_gate"),
          _abstract(lambda w: Int4Weight(quantize_int4(w, 32).packed.astype(jnp.int8),
                                         quantize_int4(w, 32).scales, 32))),
       r"layers/1/ffn/w_gate: .*found int4 \(group 32\): packed int8\[8, 32, 32\]"),
      ("int4_group_does_not_divide", _set(("layers", 1, "ffn", "w_down"),
                                          lambda w: Int4Weight(jax.ShapeDtypeStruct((8, 16, 64), jnp.uint8),
                                                               jax.ShapeDtypeStruct((8, 0, 64), jnp.bfloat16),
                                                               64)),
       r"layers/1/ffn/w_down: expected a dense \[8, 32, 64\] weight; int4 needs an even K=32 divisible"),
      ("fp8_channel_scales_as_blocks", _set(
          ("layers", 0, "attn", "wq_b"),
          _abstract(lambda w: Fp8Weight(quantize_fp8(w, None).values, quantize_fp8(w, None).scales, 128))),
       r"layers/0/attn/wq_b: expected fp8 \(block 128\) for \[32, 96\]: values float8_e4m3fn\[32, 96\], "
       r"scales float32\[1, 1\], found fp8 \(block 128\): values float8_e4m3fn\[32, 96\], "
       r"scales float32\[96\]"),
      ("fp8_values_bf16", _set(
          ("layers", 0, "attn", "wo"),
          _abstract(lambda w: Fp8Weight(w.astype(jnp.bfloat16), quantize_fp8(w).scales, 128))),
       r"layers/0/attn/wo: .*found fp8 \(block 128\): values bfloat16\[64, 64\]"),
      ("quantised_embed", _set(("embed",), _abstract(quantize_fp8)),
       r"embed is a quantised Fp8Weight but must stay dense \(expected float32\[256, 64\]"),
      ("quantised_router", _set(("layers", 1, "ffn", "router"), _abstract(lambda w: quantize_int4(w, 32))),
       r"layers/1/ffn/router is a quantised Int4Weight but must stay dense"),
  )
  def test_names_the_leaf(self, mutate, pattern):
    params = _copy(_params(TINY_MLA))
    mutate(params)
    with self.assertRaisesRegex(ValueError, r"^Engine: params do not match config 'tiny-mla': " + pattern):
      check_params(params, TINY_MLA, where="Engine")

  def test_first_mismatch_in_layout_order(self):
    params = _copy(_params(TINY_MLA))
    params["layers"][2]["attn"]["wo"] = _bf16(params["layers"][2]["attn"]["wo"])
    params["layers"][0]["ffn"]["w_up"] = _t(params["layers"][0]["ffn"]["w_up"])
    params["layers"][1]["attn"]["extra"] = params["final_norm"]
    with self.assertRaisesRegex(ValueError, r"'tiny-mla': layers/0/ffn/w_up: expected float32\[64, 128\]"):
      check_params(params, TINY_MLA, where="x")

  def test_other_config(self):
    # GQA params for an MLA config, f32 params for a bf16 config, fewer layers.
    with self.assertRaisesRegex(ValueError, r"layers/0/attn/kv_norm is missing .* extra leaves in all "
                                            r"\(e\.g\. layers/0/attn/wk\)"):
      check_params(_params(TINY_GQA), TINY_MLA, where="x")
    with self.assertRaisesRegex(ValueError, r"'tiny-mla': embed: expected bfloat16\[256, 64\], "
                                            r"found float32\[256, 64\]"):
      check_params(_params(TINY_MLA), TINY_MLA_BF16, where="x")
    with self.assertRaisesRegex(ValueError, r"layers/2 .*not a parameter|layers/2/\w+/\w+ is not a param"):
      check_params(_params(TINY_MLA), dataclasses.replace(TINY_MLA, n_layers=2), where="x")

  def test_bad_arguments(self):
    with self.assertRaisesRegex(ValueError, "^x: cfg must be a ModelConfig, got str"):
      check_params(_params(TINY_MLA), "tiny", where="x")
    with self.assertRaisesRegex(ValueError, r"^x: params must be a dict .*got list"):
      check_params([_params(TINY_MLA)], TINY_MLA, where="x")


if __name__ == "__main__":
  absltest.main()
