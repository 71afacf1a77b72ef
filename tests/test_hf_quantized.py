"""Checkpoints as their publishers ship them: compressed-tensors INT4, FP8 with block scales, MTP.

Two committed fixtures (``scripts/make_quantized_fixtures.py``, made with torch,
transformers and compressed-tensors in a throwaway environment; this test never
imports torch):

- ``kimi_k2_int4``: Kimi K2's layout, routed experts compressed-tensors
  pack-quantized INT4 group 32 (packed by compressed-tensors' ``pack_to_int32``),
  the rest dense as its ``ignore`` list says, and one multi-token-prediction layer;
- ``deepseek_v3_fp8``: DeepSeek-V3's FP8 release format (e4m3 weights, f32
  ``weight_scale_inv`` per 128x128 block).

Covered: the loaded integers, fp8 values and scales equal the files' bits (read
here with a separate numpy parser); logits within 1e-4 (relative L2, f32) of
transformers' forward on the dequantised weights; the MTP layer loaded and kept
apart; recipes (FP8 -> INT4 converts, INT4 -> FP8 refused); bad inputs refused
naming the tensor (or scheme) and the file; export then import bit-exact in both
formats, including a checkpoint quantised here; ``python -m mlkit.convert`` writing
both formats (and orbax) from these sources; and each fixture served by
``python -m mlkit.serve`` returning transformers' greedy tokens.
"""

import contextlib
import io
import json
import logging
import os
import re
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl.testing import absltest
from safetensors.numpy import save_file

from mlkit import convert as convert_cli
from mlkit.checkpoint import (CheckpointError, hf_layout, load_checkpoint, load_hf_checkpoint,
                              open_hf_checkpoint, save_hf_checkpoint)
from mlkit.model import check_params, forward
from mlkit.parallel import MeshConfig, ShardingRules, make_mesh, shard_params
from mlkit.quant import (FP8_ALL, INT4_EXPERTS, Fp8Weight, Int4Weight, apply_recipe, dequantize,
                         gptq_quantize_int4, int4_experts, quantize_int4, quantize_params)
from mlkit.quant.formats import int4_codes
from mlkit.serve import launch
from mlkit.serve.client import Client

from tempdirs import temp_dir

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
KIMI = os.path.join(FIXTURES, "kimi_k2_int4")
FP8 = os.path.join(FIXTURES, "deepseek_v3_fp8")
RTOL_L2 = 1e-4
_DTYPES = {"I32": np.int32, "I64": np.int64, "F32": np.float32, "BF16": ml_dtypes.bfloat16,
           "F8_E4M3": ml_dtypes.float8_e4m3fn, "U8": np.uint8}


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """Every tensor of a safetensors file, parsed here (u64 header size, JSON header, data)."""
  with open(path, "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(n))
    data = f.read()
  # safetensors stores little-endian, as this machine (x86 / arm64) holds numbers.
  return {name: np.frombuffer(data[h["data_offsets"][0]:h["data_offsets"][1]],
                              _DTYPES[h["dtype"]]).reshape(h["shape"])
          for name, h in header.items() if name != "__metadata__"}


def bits(a) -> np.ndarray:
  """An array's bytes as unsigned integers of its width (for bit-for-bit comparisons)."""
  a = np.ascontiguousarray(np.asarray(a))
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def rel_l2(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def leaf_at(params, path):
  for k in path:
    params = params[k]
  return params


def assert_identical(test, got, want):
  """Same tree (formats and static fields included) and the same bits in every array."""
  test.assertEqual(jax.tree_util.tree_structure(got), jax.tree_util.tree_structure(want))
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    test.assertEqual(a.dtype, b.dtype)
    np.testing.assert_array_equal(bits(a), bits(b))


def copy_fixture(src: str, dst: str, config=None, tensors=None) -> str:
  """A copy of a fixture with config.json and/or the tensors replaced (the rest linked)."""
  os.makedirs(dst)
  with open(os.path.join(src, "config.json")) as f:
    cfg = json.load(f)
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(cfg if config is None else config(cfg) or cfg, f)
  if tensors is None:
    os.symlink(os.path.join(src, "model.safetensors"), os.path.join(dst, "model.safetensors"))
  else:
    save_file(tensors, os.path.join(dst, "model.safetensors"))
  return dst


class KimiInt4Test(absltest.TestCase):
  """Kimi K2's layout: compressed-tensors INT4 (group 32) routed experts and an MTP layer."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.ref = dict(np.load(os.path.join(KIMI, "reference.npz")))
    cls.files = read_safetensors(os.path.join(KIMI, "model.safetensors"))
    cls.params, cls.cfg = load_hf_checkpoint(KIMI)

  def _experts(self):
    """(our Int4Weight, expert index, HF module name) for every packed module in the file."""
    for i in range(self.cfg.n_layers + self.cfg.n_mtp_layers):
      layer = (self.params["layers"][i] if i < self.cfg.n_layers
               else self.params["mtp"][i - self.cfg.n_layers])
      for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
        w = layer["ffn"][ours]
        if not isinstance(w, Int4Weight):
          continue
        for e in range(w.shape[0]):
          yield w, e, f"model.layers.{i}.mlp.experts.{e}.{theirs}"

  def test_integers_and_scales_are_the_files_bit_for_bit(self):
    seen = 0
    for w, e, module in self._experts():
      self.assertEqual((w.group_size, w.packed.dtype), (32, jnp.uint8))
      words = self.files[module + ".weight_packed"]  # int32 [N, K/8], value i at bits 4i.., plus 8
      n, k = (int(v) for v in self.files[module + ".weight_shape"])
      codes = ((words[:, :, None].astype(np.int64) >> (4 * np.arange(8))) & 15).reshape(n, k) - 8
      np.testing.assert_array_equal(np.asarray(int4_codes(w))[e], codes.T, err_msg=module)
      np.testing.assert_array_equal(bits(w.scales[e]), bits(self.files[module + ".weight_scale"]).T,
                                    err_msg=module)
      seen += 1
    self.assertEqual(seen, 3 * 8 * 3)  # two MoE layers and the MTP layer, three projections each
    self.assertIn(-8, np.asarray(int4_codes(self.params["layers"][1]["ffn"]["w_gate"])))

  def test_the_ignored_modules_stay_dense(self):
    layer = self.params["layers"][1]
    for w, name in ((layer["attn"]["wq_b"], "model.layers.1.self_attn.q_b_proj.weight"),
                    (layer["ffn"]["shared"]["w_up"], "model.layers.1.mlp.shared_experts.up_proj.weight"),
                    (self.params["layers"][0]["ffn"]["w_down"], "model.layers.0.mlp.down_proj.weight"),
                    (self.params["lm_head"], "lm_head.weight"),
                    (self.params["mtp"][0]["eh_proj"], "model.layers.3.eh_proj.weight")):
      self.assertEqual(w.dtype, jnp.float32, name)
      np.testing.assert_array_equal(np.asarray(w), self.files[name].T, err_msg=name)

  def test_the_mtp_layer_is_loaded_and_kept_apart(self):
    (mtp,) = self.params["mtp"]
    D, V = self.cfg.d_model, self.cfg.vocab_size
    self.assertEqual(self.cfg.n_mtp_layers, 1)
    self.assertEqual(mtp["eh_proj"].shape, (2 * D, D))
    self.assertEqual((mtp["embed"].shape, mtp["lm_head"].shape), ((V, D), (D, V)))
    for n, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"), ("head_norm", "shared_head.norm")):
      np.testing.assert_array_equal(np.asarray(mtp[n]), self.files[f"model.layers.3.{theirs}.weight"])
    np.testing.assert_array_equal(np.asarray(mtp["embed"]), self.files["model.layers.3.embed_tokens.weight"])
    self.assertIsInstance(mtp["ffn"]["w_gate"], Int4Weight)  # the same published format as the layers
    self.assertLen(self.params["layers"], self.cfg.n_layers)

  def test_logits_match_transformers(self):
    logits = forward(self.params, jnp.asarray(self.ref["tokens"]), cfg=self.cfg)
    self.assertLess(rel_l2(logits, self.ref["logits"]), RTOL_L2)

  def test_params_are_checked_with_or_without_their_mtp_layers(self):
    check_params(self.params, self.cfg, where="t")
    check_params({k: v for k, v in self.params.items() if k != "mtp"}, self.cfg, where="t")
    with self.assertRaisesRegex(ValueError, r"mtp holds 2 multi-token-prediction layer\(s\), the "
                                            r"config declares n_mtp_layers=1"):
      check_params(dict(self.params, mtp=self.params["mtp"] * 2), self.cfg, where="t")
    bad = dict(self.params["mtp"][0], eh_proj=self.params["mtp"][0]["eh_proj"].T)
    with self.assertRaisesRegex(ValueError, r"mtp/0/eh_proj: expected float32\[128, 64\], found "
                                            r"float32\[64, 128\]"):
      check_params(dict(self.params, mtp=[bad]), self.cfg, where="t")

  def test_recipes_that_keep_or_refuse(self):
    # A recipe that asks for the published format (int4 g32 experts) keeps it as it is.
    kept = apply_recipe(self.params, INT4_EXPERTS)
    assert_identical(self, kept, self.params)
    # INT4 -> FP8 would invent precision: refused before any read, naming tensor and file.
    with self.assertRaisesRegex(CheckpointError, rf"^load_hf_checkpoint: {re.escape(KIMI)}/model\.safetensors: "
                                                 r"tensor model\.layers\.1\.mlp\.experts\.0\.down_proj\."
                                                 r"weight_packed: recipe 'fp8-all': .*invent precision"):
      load_hf_checkpoint(KIMI, recipe=FP8_ALL)
    with self.assertRaisesRegex(ValueError, r"layers/1/ffn/w_down: .*invent precision"):
      apply_recipe(self.params, FP8_ALL)
    with self.assertRaisesRegex(CheckpointError, r"experts\.0\.down_proj\.weight_packed: recipe "
                                                 r"'int4-experts-g64': .*another group size"):
      load_hf_checkpoint(KIMI, recipe=int4_experts(group_size=64))


class ShardedReadsTest(absltest.TestCase):
  """Published weights stream and shard as dense ones do: placed by shard, and a part of a
  parameter (what one process of a multi-process load holds) read as only its bytes."""

  def test_sharded_load_equals_load_then_shard(self):
    # The experts' FFN width split too, so INT4 w_down is split along K in whole groups.
    mesh = make_mesh(MeshConfig(tensor=2, expert=2), jax.devices()[:4])
    rules = ShardingRules(expert_mlp="tensor")
    for path in (KIMI, FP8):
      with self.subTest(os.path.basename(path)):
        got, cfg = load_hf_checkpoint(path, mesh=mesh, rules=rules)
        want = shard_params(load_hf_checkpoint(path)[0], mesh, rules, cfg)
        assert_identical(self, got, want)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
          self.assertEqual(a.sharding, b.sharding)

  def test_reading_part_of_a_published_parameter(self):
    for path, leaf, boxes in (
        (KIMI, "layers.1.ffn.w_down", [((2, 5), (32, 64), (8, 40)), ((0, 8), (0, 32), (0, 64))]),
        (FP8, "layers.0.ffn.w_down", [((128, 256), (0, 128)), ((0, 128), (0, 128))])):
      ck = open_hf_checkpoint(path)
      i = ck.names.index(leaf)
      t, src = ck._targets[i], ck._sources[i]
      whole = ck._read_published(t, src, tuple((0, d) for d in ck._convert.abstract[i].shape))
      for box in boxes:
        with self.subTest(leaf=leaf, box=box):
          before = ck._reader.bytes_read
          part = ck._read_published(t, src, box)
          *lead, (k0, k1), (n0, n1) = box
          lead = tuple(slice(a, b) for a, b in lead)
          if isinstance(whole, Int4Weight):
            g = whole.group_size
            want = (whole.packed[lead + (slice(k0 // 2, k1 // 2), slice(n0, n1))],
                    whole.scales[lead + (slice(k0 // g, k1 // g), slice(n0, n1))])
            got = (part.packed, part.scales)
          else:
            want = (whole.values[k0:k1, n0:n1], whole.scales[k0 // 128:-(-k1 // 128), n0 // 128:-(-n1 // 128)])
            got = (part.values, part.scales)
          for a, b in zip(got, want):
            np.testing.assert_array_equal(bits(a), bits(b))
          # Exactly the box's packed words (or fp8 bytes) and scales.
          self.assertEqual(ck._reader.bytes_read - before, sum(np.asarray(a).nbytes for a in got))


class Fp8BlockTest(absltest.TestCase):
  """DeepSeek-V3's FP8 release format: e4m3 weights with f32 128x128 block scales."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.ref = dict(np.load(os.path.join(FP8, "reference.npz")))
    cls.files = read_safetensors(os.path.join(FP8, "model.safetensors"))
    cls.params, cls.cfg = load_hf_checkpoint(FP8)

  def test_values_and_block_scales_are_the_files_bit_for_bit(self):
    targets, _ = hf_layout(self.cfg)
    seen = 0
    for t in targets:
      w = leaf_at(self.params, t.path)
      fp8 = [n for n in t.names if n + "_scale_inv" in self.files]
      self.assertEqual(isinstance(w, Fp8Weight), bool(fp8), t.path)
      for e, n in enumerate(fp8):
        values, scales = (w.values, w.scales) if len(t.names) == 1 else (w.values[e], w.scales[e])
        self.assertEqual((values.dtype, scales.dtype, w.block_size), (jnp.float8_e4m3fn, jnp.float32, 128))
        np.testing.assert_array_equal(bits(values), bits(self.files[n]).T, err_msg=n)
        np.testing.assert_array_equal(bits(scales), bits(self.files[n + "_scale_inv"]).T, err_msg=n)
        seen += 1
    self.assertEqual(seen, sum(n.endswith("_scale_inv") for n in self.files))
    # The dense MLP spans two blocks along its 256 columns.
    self.assertEqual(self.params["layers"][0]["ffn"]["w_down"].scales.shape, (2, 1))

  def test_logits_match_transformers(self):
    logits = forward(self.params, jnp.asarray(self.ref["tokens"]), cfg=self.cfg)
    self.assertLess(rel_l2(logits, self.ref["logits"]), RTOL_L2)

  def test_int4_experts_from_fp8_dequantise_then_quantise(self):
    with self.assertLogs("mlkit.checkpoint.hf", logging.INFO) as logs:
      converted, _ = load_hf_checkpoint(FP8, recipe=INT4_EXPERTS)
    self.assertTrue(any(re.search(r"recipe 'int4-experts-g32' converts 6 published weight\(s\).*"
                                  r"fp8 e4m3 block 128 -> int4 g32", line) for line in logs.output))
    published = self.params["layers"][1]["ffn"]["w_up"]
    got = converted["layers"][1]["ffn"]["w_up"]
    want = quantize_int4(dequantize(published, jnp.float32), 32)
    assert_identical(self, got, want)
    # What the recipe keeps stays as published; a server's apply_recipe does the same.
    assert_identical(self, converted["layers"][1]["attn"], self.params["layers"][1]["attn"])
    assert_identical(self, apply_recipe(self.params, INT4_EXPERTS), converted)


class RefusalTest(absltest.TestCase):
  """What the loader does not read is refused before any read, naming the scheme or the tensor
  and the file."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = temp_dir(cls, "hf-quantized-bad-")
    cls.tensors = read_safetensors(os.path.join(KIMI, "model.safetensors"))
    cls.n = 0

  def variant(self, config=None, tensors=None) -> str:
    RefusalTest.n += 1
    changed = None
    if tensors is not None:
      changed = dict(self.tensors)
      tensors(changed)
    return copy_fixture(KIMI, os.path.join(self.tmp, str(self.n)), config, changed)

  def group(self, **weights):
    def change(cfg):
      cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update(weights)
    return change

  def test_schemes_are_refused_naming_the_scheme_and_config(self):
    qc = lambda **kw: (lambda cfg: cfg["quantization_config"].update(kw))  # noqa: E731
    act = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    for name, change, pattern in [
        ("group 16", self.group(group_size=16), r"group_size=16\): group_size must be one of"),
        ("asymmetric", self.group(symmetric=False), r"symmetric=False.*asymmetric"),
        ("8 bits", self.group(num_bits=8), r"num_bits=8.*only 4-bit integers"),
        ("channel", self.group(strategy="channel"), r"only strategy 'group'"),
        ("activations", lambda cfg: cfg["quantization_config"]["config_groups"]["group_0"].update(
            input_activations=act), r"quantises input_activations .*activation quantisation"),
        ("format", qc(format="float-quantized"), r"format 'float-quantized'.* is not supported"),
        ("kv cache", qc(kv_cache_scheme={"num_bits": 8}), r"kv_cache_scheme .* is not supported"),
        ("method", qc(quant_method="awq"), r"quant_method 'awq' is not supported"),
    ]:
      with self.subTest(name):
        path = self.variant(config=change)
        with self.assertRaisesRegex(CheckpointError, rf"^load_hf_checkpoint: {re.escape(path)}/config\.json: "
                                                     f".*{pattern}"):
          load_hf_checkpoint(path)

  def test_config_and_tensors_must_agree(self):
    m = "model.layers.1.mlp.experts.3.down_proj"
    first = "model.layers.1.mlp.experts.0.down_proj"  # the first packed module read
    shared = "model.layers.1.mlp.shared_experts.down_proj.weight"
    ignore = lambda f: (lambda cfg: cfg["quantization_config"].update(  # noqa: E731
        ignore=f(cfg["quantization_config"]["ignore"])))
    for name, config, tensors, where, pattern in [
        ("group size", self.group(group_size=64), None, "model.safetensors",
         rf"tensor {first}\.weight_scale has shape \(64, 2\), expected \(64, 1\) for group_size 64 "
         r"\(quantization_config\); its shape fits group_size 32"),
        ("zero point", None, lambda t: t.update({m + ".weight_zero_point": np.zeros((1, 64), np.int32)}),
         "model.safetensors", rf"tensor {m}\.weight_zero_point is a zero point \(an asymmetric scheme\)"),
        ("no scale", None, lambda t: t.pop(m + ".weight_scale"), "model.safetensors",
         rf"missing tensor {m}\.weight_scale \(packed INT4 {m}\.weight_packed needs"),
        ("no shape", None, lambda t: t.pop(m + ".weight_shape"), "model.safetensors",
         rf"missing tensor {m}\.weight_shape"),
        ("packed shape", None, lambda t: t.update({m + ".weight_packed": t[m + ".weight_packed"][:, :4]}),
         "model.safetensors", rf"tensor {m}\.weight_packed has shape \(64, 4\), expected \(64, 8\)"),
        ("declared shape", None,
         lambda t: t.update({m + ".weight_shape": np.asarray([64, 32], np.int32)}),
         "model.safetensors", rf"tensor {m}\.weight_shape says \[64, 32\], expected \[64, 64\]"),
        ("stale ignore", ignore(lambda ig: ig + ["re:.*vision_tower.*"]), None, "config.json",
         r"ignore entry 're:\.\*vision_tower\.\*' matches no module this config declares"),
        ("quantised but dense", ignore(lambda ig: [i for i in ig if "shared_experts" not in i]), None,
         "model.safetensors", rf"tensor {re.escape(shared)} is stored dense \(F32\), but "
                              r"quantization_config quantises .*expected .*\.weight_packed"),
        ("dense but packed", ignore(lambda ig: ig + ["re:.*experts\\.7\\."]), None,
         "model.safetensors", r"tensor model\.layers\.1\.mlp\.experts\.7\.down_proj\.weight_packed is "
                              r"packed INT4, but quantization_config leaves .* dense"),
    ]:
      with self.subTest(name):
        path = self.variant(config=config, tensors=tensors)
        with self.assertRaisesRegex(CheckpointError,
                                    rf"^load_hf_checkpoint: {re.escape(path)}/{where}: .*{pattern}"):
          load_hf_checkpoint(path)


class ExportTest(absltest.TestCase):
  """save_hf_checkpoint(format=...) writes the formats back; import gives the same bits."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = temp_dir(cls, "hf-quantized-export-")

  def _round_trip(self, params, cfg, fmt, name):
    path = os.path.join(self.tmp, name)
    save_hf_checkpoint(path, params, cfg, format=fmt, shards=2)
    loaded, loaded_cfg = load_hf_checkpoint(path)
    self.assertEqual(loaded_cfg, cfg)
    assert_identical(self, loaded, params)
    with open(os.path.join(path, "config.json")) as f:
      return path, json.load(f)["quantization_config"]

  def test_compressed_tensors_export_is_the_published_file(self):
    params, cfg = load_hf_checkpoint(KIMI)
    path, qc = self._round_trip(params, cfg, "compressed-tensors", "kimi")
    self.assertEqual((qc["quant_method"], qc["format"]), ("compressed-tensors", "pack-quantized"))
    group = qc["config_groups"]["group_0"]
    self.assertEqual((group["targets"], group["weights"]["group_size"], group["weights"]["symmetric"]),
                     (["Linear"], 32, True))
    self.assertIn("model.layers.1.self_attn.q_b_proj", qc["ignore"])
    self.assertIn("model.layers.3.eh_proj", qc["ignore"])
    # The INT4 tensors written are the fixture's own, word for word.
    published = read_safetensors(os.path.join(KIMI, "model.safetensors"))
    written = {}
    for f in sorted(os.listdir(path)):
      if f.endswith(".safetensors"):
        written.update(read_safetensors(os.path.join(path, f)))
    self.assertEqual(set(written), set(published))
    for n in published:
      if n.endswith(("weight_packed", "weight_scale")):
        np.testing.assert_array_equal(bits(written[n]), bits(published[n]), err_msg=n)

  def test_fp8_block_export_is_the_published_file(self):
    params, cfg = load_hf_checkpoint(FP8)
    path, qc = self._round_trip(params, cfg, "fp8-block", "fp8")
    self.assertEqual((qc["quant_method"], qc["weight_block_size"]), ("fp8", [128, 128]))
    self.assertIn("lm_head", qc["modules_to_not_convert"])
    published = read_safetensors(os.path.join(FP8, "model.safetensors"))
    written = {}
    for f in sorted(os.listdir(path)):
      if f.endswith(".safetensors"):
        written.update(read_safetensors(os.path.join(path, f)))
    for n in published:
      if n.endswith("_scale_inv"):
        base = n.removesuffix("_scale_inv")
        np.testing.assert_array_equal(bits(written[n]), bits(published[n]), err_msg=n)
        np.testing.assert_array_equal(bits(written[base]), bits(published[base]), err_msg=base)

  def test_a_checkpoint_quantised_here_round_trips(self):
    # RTN INT4 at group 128 (K = 128 for the experts' gate and up projections; their down
    # projection, K = 64, at group 32) and one GPTQ weight, written as compressed-tensors
    # with two config groups.
    # Each step jitted (op by op they compiled ~60 small programs); activations from numpy.
    params, cfg = load_hf_checkpoint(FP8)
    dense = jax.jit(lambda p: jax.tree_util.tree_map(
        lambda w: dequantize(w, jnp.float32), p,
        is_leaf=lambda x: isinstance(x, (Int4Weight, Fp8Weight))))(params)
    q = jax.jit(lambda d: quantize_params(d, int4_experts(group_size=32)))(dense)
    quantize_128 = jax.jit(lambda w: quantize_int4(w, 128))
    for i in (1, 2):
      for w in ("w_gate", "w_up"):
        q["layers"][i]["ffn"][w] = quantize_128(dense["layers"][i]["ffn"][w])
    wo = dense["layers"][1]["attn"]["wo"]  # [64, 128]
    acts = jnp.asarray(np.random.default_rng(0).standard_normal((256, wo.shape[0])), jnp.float32)
    q["layers"][1]["attn"]["wo"] = jax.jit(lambda w, a: gptq_quantize_int4(w, a, 32))(wo, acts)
    _, qc = self._round_trip(q, cfg, "compressed-tensors", "rtn")
    groups = sorted((g["weights"]["group_size"], len(g["targets"])) for g in qc["config_groups"].values())
    self.assertEqual(groups, [(32, 17), (128, 32)])

  def test_formats_refuse_what_they_cannot_hold(self):
    params, cfg = load_hf_checkpoint(FP8)
    with self.assertRaisesRegex(ValueError, r"layers\.0\.attn\.wkv_a is Fp8Weight; format "
                                            r"'compressed-tensors' writes INT4"):
      save_hf_checkpoint(os.path.join(self.tmp, "bad"), params, cfg, format="compressed-tensors")
    kimi, kcfg = load_hf_checkpoint(KIMI)
    with self.assertRaisesRegex(ValueError, r"layers\.1\.ffn\.w_down is Int4Weight; format 'fp8-block'"):
      save_hf_checkpoint(os.path.join(self.tmp, "bad2"), kimi, kcfg, format="fp8-block")
    self.assertFalse(os.path.exists(os.path.join(self.tmp, "bad")))


def _convert(*argv) -> tuple[int, str]:
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    try:
      rc = convert_cli.main([str(a) for a in argv])
    except SystemExit as e:
      rc = e.code
  return rc, err.getvalue()


class ConvertCommandTest(absltest.TestCase):
  """``python -m mlkit.convert`` reads the published formats and writes them (or orbax)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = temp_dir(cls, "hf-quantized-convert-")

  def test_writes_both_formats_and_orbax(self):
    for src, recipe, fmt in ((KIMI, "int4-experts-g32", "compressed-tensors"),
                             (FP8, "fp8-all", "fp8-block"), (KIMI, "bf16", "orbax")):
      with self.subTest(fmt):
        dst = os.path.join(self.tmp, fmt)
        rc, err = _convert(src, dst, "--recipe", recipe, "--format", fmt)
        self.assertEqual(rc, 0, err)
        want, cfg = load_hf_checkpoint(src)
        got, got_cfg = load_checkpoint(dst) if fmt == "orbax" else load_hf_checkpoint(dst)
        self.assertEqual(got_cfg, cfg)
        assert_identical(self, got, want)

  def test_refusals(self):
    dst = os.path.join(self.tmp, "refused")
    rc, err = _convert(KIMI, dst, "--recipe", "fp8-all", "--format", "compressed-tensors")
    self.assertEqual(rc, 1)
    self.assertRegex(err, r"mlkit\.convert: error: load_hf_checkpoint: .*/model\.safetensors: tensor "
                          r"model\.layers\.1\.mlp\.experts\.0\.down_proj\.weight_packed: .*invent precision")
    rc, err = _convert(FP8, dst, "--recipe", "fp8-all", "--format", "compressed-tensors")
    self.assertEqual(rc, 1)
    self.assertRegex(err, r"is Fp8Weight; format 'compressed-tensors' writes INT4")
    rc, err = _convert(FP8, dst, "--recipe", "fp8-all", "--format", "fp8-block", "--mesh", "tensor=2")
    self.assertEqual(rc, 2)
    self.assertFalse(os.path.exists(dst))


class ServeTest(absltest.TestCase):
  """Each fixture served by ``python -m mlkit.serve`` gives transformers' greedy tokens."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    tmp = temp_dir(cls, "hf-quantized-serve-")
    args = ["--kv-dtype", "float32", "--num-pages", "16", "--max-running", "2", "--prefill-chunk",
            "16", "--max-pages-per-seq", "8", "--page-size", "4"]
    cls.servers = {}
    for path in (KIMI, FP8):  # both start (and compile) at once
      addr = f"127.0.0.1:{launch.free_port()}"
      log = os.path.join(tmp, os.path.basename(path) + ".log")
      proc = launch.start("colocated", addr, ["--checkpoint", path, *args], log=log)
      cls.addClassCleanup(_stop, proc, addr)
      cls.servers[path] = (proc, addr, log)

  def _serves_greedy_tokens(self, path):
    proc, addr, log = self.servers[path]
    launch.wait_ready(proc, log)
    ref = np.load(os.path.join(path, "reference.npz"))
    n, greedy = int(ref["prompt_len"]), ref["greedy"]
    with Client(addr, timeout_s=120) as c:
      outs = c.generate(ref["tokens"][:, :n].tolist(), max_new_tokens=greedy.shape[1])
    self.assertEqual([o["tokens"] for o in outs], greedy.tolist())
    with open(log) as f:
      return f.read()

  def test_kimi_int4(self):
    text = self._serves_greedy_tokens(KIMI)
    self.assertIn("routed experts int4 g32", text)  # the published format, not a dense copy

  def test_deepseek_fp8(self):
    text = self._serves_greedy_tokens(FP8)
    self.assertIn("routed experts fp8 e4m3 block 128", text)


def _stop(proc, addr) -> None:
  try:
    with Client(addr, timeout_s=5) as c:
      c.shutdown()
    proc.wait(timeout=10)
  except Exception:  # noqa: BLE001
    proc.kill()
    proc.wait()


if __name__ == "__main__":
  absltest.main()
