"""Checkpoints: orbax round trips and the Hugging Face DeepSeek-V3 / Kimi-K2 import/export."""

import dataclasses
import gc
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl.testing import absltest, parameterized
from safetensors import safe_open
from safetensors.numpy import save_file

from configs.models import KIMI_K2_6, TINY_GQA, TINY_MLA
from mlkit.checkpoint import (CheckpointError, checkpoint_steps, config_from_hf, config_to_hf,
                              dequantize_fp8_blocks, load_checkpoint, load_hf_checkpoint,
                              open_hf_checkpoint, save_checkpoint, save_hf_checkpoint)
from mlkit.model import forward, param_specs
from mlkit.quant import Int4Weight, quantize_fp8

TINY_BF16 = dataclasses.replace(TINY_MLA, dtype="bfloat16", param_dtype="bfloat16")
TINY_NO_QLORA = dataclasses.replace(TINY_MLA, q_lora_rank=0)
_PARAMS: dict = {}


def _params(cfg, seed=0):
  """Random params in the ``param_specs`` layout, built in numpy (eager init_params compiles per shape).

  Norms and the router bias are perturbed too, so that no leaf is a constant.
  """
  key = (cfg, seed)
  if key not in _PARAMS:
    rng = np.random.default_rng(seed)
    def leaf(spec):
      shape, kind = spec[0], spec[1]
      dtype = jnp.dtype(spec[2] if len(spec) == 3 else cfg.param_dtype)
      x = rng.standard_normal(shape).astype(np.float32)
      if kind == "ones":
        x = 1 + 0.1 * x
      elif kind == "zeros":
        x = 0.1 * x
      elif kind == "normal":
        x = x * shape[-2] ** -0.5
      return jax.device_put(x.astype(dtype))  # no XLA program (jnp.asarray compiles one per shape)
    is_spec = lambda x: isinstance(x, tuple) and isinstance(x[0], tuple)
    _PARAMS[key] = jax.tree_util.tree_map(leaf, param_specs(cfg), is_leaf=is_spec)
  return _PARAMS[key]


_forward = jax.jit(forward, static_argnames="cfg")


def _f32(x) -> np.ndarray:
  """x as f32 on host (exact for every dtype the tests store); numpy's cast, not an XLA program
  per shape and dtype."""
  return np.asarray(x).astype(np.float32)


def _flat_items(tree) -> list:
  """[("layers.1.attn.wq_a", leaf)] in tree order (orbax's names for the leaves)."""
  return [(".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p), leaf)
          for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _flat(tree) -> dict:
  return dict(_flat_items(tree))


class TreeAssertions(parameterized.TestCase):

  def tmpdir(self) -> str:
    # tempfile rather than create_tempdir(): absl flags are unparsed under pytest.
    path = tempfile.mkdtemp(prefix="mlkit_ckpt_")
    self.addCleanup(shutil.rmtree, path, ignore_errors=True)
    return path

  def assertTreesIdentical(self, a, b):
    self.assertEqual(jax.tree_util.tree_structure(a), jax.tree_util.tree_structure(b))
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_leaves(b)):
      name = jax.tree_util.keystr(path)
      self.assertEqual(x.dtype, y.dtype, name)
      self.assertEqual(x.shape, y.shape, name)
      np.testing.assert_array_equal(_f32(x), _f32(y), err_msg=name)


# ----------------------------------------------------------------------------- orbax


def _corrupt_largest_data_file(path: str, how: str, at: float = 0.5) -> str:
  """Truncates to half, or flips one bit (at that fraction of its length) of, the
  largest OCDBT data file of a checkpoint."""
  data_dir = os.path.join(path, "params", "ocdbt.process_0", "d")
  name = max(os.listdir(data_dir), key=lambda f: os.path.getsize(os.path.join(data_dir, f)))
  fname = os.path.join(data_dir, name)
  with open(fname, "rb") as f:
    data = bytearray(f.read())
  if how == "flip":
    data[int(len(data) * at)] ^= 0x10
  else:
    data = data[:len(data) // 2]
  with open(fname, "wb") as f:
    f.write(bytes(data))
  return fname


class OrbaxTest(TreeAssertions):

  @parameterized.named_parameters(("bf16", TINY_BF16), ("f32", TINY_MLA))
  def test_round_trip_exact(self, cfg):
    params = _params(cfg)
    path = os.path.join(self.tmpdir(), "ckpt")
    self.assertEqual(save_checkpoint(path, params, cfg), path)
    restored, restored_cfg = load_checkpoint(path)
    self.assertEqual(restored_cfg, cfg)
    self.assertTreesIdentical(params, restored)
    self.assertEqual(restored["layers"][0]["attn"]["wq_a"].dtype, jnp.dtype(cfg.param_dtype))
    self.assertEqual(restored["layers"][1]["ffn"]["router"].dtype, jnp.float32)
    # Passing the matching config returns that config and the same params.
    again, cfg2 = load_checkpoint(path, cfg)
    self.assertIs(cfg2, cfg)
    self.assertTreesIdentical(params, again)

  def test_steps_and_latest(self):
    root = self.tmpdir()
    p1 = _params(TINY_MLA, 0)
    p5 = _params(TINY_MLA, 1)
    save_checkpoint(root, p1, TINY_MLA, step=1)
    save_checkpoint(root, p5, TINY_MLA, step=5)
    self.assertEqual(checkpoint_steps(root), [1, 5])
    self.assertTreesIdentical(p5, load_checkpoint(root)[0])
    self.assertTreesIdentical(p1, load_checkpoint(root, step=1)[0])
    with self.assertRaisesRegex(FileNotFoundError, "step 3"):
      load_checkpoint(root, step=3)
    with self.assertRaisesRegex(FileExistsError, "already exists"):
      save_checkpoint(root, p1, TINY_MLA, step=5)
    with self.assertRaisesRegex(ValueError, "step must be a non-negative int"):
      save_checkpoint(root, p1, TINY_MLA, step=-1)
    # overwrite=True replaces step 5 with p1.
    save_checkpoint(root, p1, TINY_MLA, step=5, overwrite=True)
    self.assertTreesIdentical(p1, load_checkpoint(root, step=5)[0])

  def test_quantised_dataclass_leaves_restore_by_target_or_recorded_format(self):
    params = jax.tree_util.tree_map(lambda x: x, _params(TINY_BF16))
    rng = np.random.default_rng(0)
    w = params["layers"][1]["ffn"]["w_gate"]  # [E, K, N]
    params["layers"][1]["ffn"]["w_gate"] = Int4Weight(
        packed=jax.device_put(rng.integers(0, 256, (w.shape[0], w.shape[1] // 2, w.shape[2]), np.uint8)),
        scales=jax.device_put(rng.standard_normal((w.shape[0], w.shape[1] // 32, w.shape[2]), np.float32)),
        group_size=32)
    path = os.path.join(self.tmpdir(), "q")
    save_checkpoint(path, params, TINY_BF16)
    restored, _ = load_checkpoint(path, target=params)
    self.assertTreesIdentical(params, restored)
    q = restored["layers"][1]["ffn"]["w_gate"]
    self.assertIsInstance(q, Int4Weight)
    self.assertEqual(q.group_size, 32)  # static field comes from the target (orbax stores arrays only)
    # An abstract target (ShapeDtypeStructs) works too.
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    self.assertTreesIdentical(params, load_checkpoint(path, target=abstract)[0])
    # The save records each quantised leaf's format, so no target= is needed either ...
    restored, _ = load_checkpoint(path)
    self.assertTreesIdentical(params, restored)
    self.assertEqual(restored["layers"][1]["ffn"]["w_gate"].group_size, 32)
    # ... except for a checkpoint saved before formats were recorded.
    from unittest import mock

    from mlkit.checkpoint import orbax_io
    with mock.patch.object(orbax_io, "_formats", lambda params: None):
      save_checkpoint(path, params, TINY_BF16, overwrite=True)
    with self.assertRaisesRegex(ValueError, r"layers\.1\.ffn\.w_gate.*target="):
      load_checkpoint(path)
    bad = jax.tree_util.tree_map(lambda x: x, params)
    bad["layers"][1]["ffn"]["w_gate"] = w
    with self.assertRaisesRegex(ValueError, r"layers\.1\.ffn\.w_gate"):
      load_checkpoint(path, target=bad)

  def test_recorded_recipe_restores_without_target_on_a_mesh(self):
    from mlkit.parallel import MeshConfig, make_mesh, shard_params
    from mlkit.quant import INT4_EXPERTS, quantize_params
    params = quantize_params(_params(TINY_BF16), INT4_EXPERTS)
    path = os.path.join(self.tmpdir(), "q")
    with self.assertRaisesRegex(ValueError, "recipe 'int3' is not one of mlkit.quant.RECIPES"):
      save_checkpoint(path, params, TINY_BF16, recipe="int3")
    save_checkpoint(path, params, TINY_BF16, recipe=INT4_EXPERTS)
    self.assertTreesIdentical(params, load_checkpoint(path)[0])
    mesh = make_mesh(MeshConfig(tensor=2, expert=2), jax.devices()[:4])
    got, _ = load_checkpoint(path, mesh=mesh)
    want = shard_params(params, mesh, cfg=TINY_BF16)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
      self.assertEqual(a.sharding, b.sharding)
    self.assertTreesIdentical(want, got)
    with self.assertRaisesRegex(ValueError, "mesh= or a target="):
      load_checkpoint(path, mesh=mesh, target=params)
    with self.assertRaisesRegex(ValueError, "rules= needs a mesh="):
      from mlkit.parallel import DEFAULT_RULES
      load_checkpoint(path, rules=DEFAULT_RULES)

  def test_int4_layouts_on_save_and_load(self):
    from unittest import mock

    import mlkit.quant
    from mlkit.parallel import MeshConfig, make_mesh, shard_params
    from mlkit.quant import INT4_EXPERTS, quantize_params
    from mlkit.serve.model import ServeConfig, load_model
    dense = _params(TINY_BF16)
    kn = quantize_params(dense, INT4_EXPERTS)
    nk = quantize_params(dense, INT4_EXPERTS, int4_layout="nk")
    path = os.path.join(self.tmpdir(), "q")
    # A tree quantised for the GPU kernels saves as "kn", what checkpoints hold,
    # and the caller's "nk" leaves are left intact.
    save_checkpoint(path, nk, TINY_BF16, recipe=INT4_EXPERTS)
    self.assertTreesIdentical(kn, load_checkpoint(path)[0])
    self.assertTreesIdentical(nk, quantize_params(dense, INT4_EXPERTS, int4_layout="nk"))
    got, _ = load_checkpoint(path, int4_layout="nk")
    self.assertTreesIdentical(nk, got)
    layouts = {w.layout for w in jax.tree.leaves(got, is_leaf=lambda x: isinstance(x, Int4Weight))
               if isinstance(w, Int4Weight)}
    self.assertEqual(layouts, {"nk"})
    # On a mesh each leaf keeps its split, K and N swapped (the sharding rules' "nk" spec).
    mesh = make_mesh(MeshConfig(tensor=2, expert=2), jax.devices()[:4])
    got, _ = load_checkpoint(path, mesh=mesh, int4_layout="nk")
    want = shard_params(nk, mesh, cfg=TINY_BF16)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
      self.assertEqual(a.sharding, b.sharding)
    self.assertTreesIdentical(want, got)
    with self.assertRaisesRegex(ValueError, "int4_layout must be one of"):
      load_checkpoint(path, int4_layout="t")
    # A server restores a quantised checkpoint into its kernels' layout.
    with mock.patch.object(mlkit.quant, "kernel_int4_layout", lambda backend=None: "nk"):
      served, _ = load_model(ServeConfig(role="decode", checkpoint=path))
    self.assertTreesIdentical(nk, served)

  def test_errors(self):
    tmp = self.tmpdir()
    with self.assertRaisesRegex(FileNotFoundError, "does not exist"):
      load_checkpoint(os.path.join(tmp, "nowhere"))
    junk = os.path.join(tmp, "junk")
    os.makedirs(junk)
    with open(os.path.join(junk, "weights.bin"), "w") as f:
      f.write("not a checkpoint")
    with self.assertRaisesRegex(ValueError, "not an mlkit checkpoint"):
      load_checkpoint(junk)
    with self.assertRaisesRegex(ValueError, "cfg must be a ModelConfig"):
      save_checkpoint(os.path.join(tmp, "x"), {}, {"name": "tiny"})
    # Params of another config are refused before anything is written.
    gqa = os.path.join(tmp, "gqa_as_mla")
    with self.assertRaisesRegex(ValueError, r"^save_checkpoint: params do not match config 'tiny-mla': "
                                            r"layers/0/attn/kv_norm is missing"):
      save_checkpoint(gqa, _params(TINY_GQA), TINY_MLA)
    self.assertFalse(os.path.exists(gqa))
    with self.assertRaisesRegex(ValueError, r"save_checkpoint: .*layers/1/ffn/router: expected "
                                            r"float32\[64, 8\], found bfloat16\[64, 8\]"):
      bad = jax.tree_util.tree_map(lambda x: x, _params(TINY_MLA))
      bad["layers"][1]["ffn"]["router"] = jax.device_put(
          np.asarray(_params(TINY_BF16)["layers"][1]["ffn"]["w_gate"])[0, :, :8])
      save_checkpoint(gqa, bad, TINY_MLA)
    self.assertFalse(os.path.exists(gqa))

    path = os.path.join(tmp, "ckpt")
    save_checkpoint(path, _params(TINY_MLA), TINY_MLA)
    with self.assertRaisesRegex(FileExistsError, "already exists"):
      save_checkpoint(path, _params(TINY_MLA), TINY_MLA)
    with self.assertRaisesRegex(ValueError, r"layers\.0\.attn\.kv_norm has shape \(32,\).*expects \(16,\)"):
      load_checkpoint(path, dataclasses.replace(TINY_MLA, kv_lora_rank=16))
    with self.assertRaisesRegex(ValueError, r"layers\.3\."):
      load_checkpoint(path, dataclasses.replace(TINY_MLA, n_layers=4))
    with self.assertRaisesRegex(ValueError, r"\['layers\.0\.attn\.wq',.*not in the checkpoint"):
      load_checkpoint(path, TINY_NO_QLORA)
    with self.assertRaisesRegex(ValueError, r"checkpoint parameter\(s\) \['layers\.2\..*not in the config"):
      load_checkpoint(path, dataclasses.replace(TINY_MLA, n_layers=2))
    # Same shapes, other dtype: refused from the stored metadata, before any data is read.
    with self.assertRaisesRegex(ValueError, f"^load_checkpoint: {path}: params do not match config "
                                            r"'tiny-mla': embed: expected bfloat16\[256, 64\], found float32"):
      load_checkpoint(path, TINY_BF16)
    with self.assertRaisesRegex(ValueError, r"cfg must be a ModelConfig or None .*got str 'tiny'"):
      load_checkpoint(path, "tiny")

    # What an interrupted save leaves behind (orbax's tmp dir, never renamed) is rejected,
    # even when all its files are present.
    partial = path + ".orbax-checkpoint-tmp-1234"
    shutil.copytree(path, partial)
    with self.assertRaisesRegex(ValueError, "unfinished"):
      load_checkpoint(partial)
    # A checkpoint with its metadata item missing is not accepted either.
    shutil.rmtree(os.path.join(path, "mlkit"))
    with self.assertRaisesRegex(ValueError, "not an mlkit checkpoint"):
      load_checkpoint(path)

  def test_corrupt_data_files(self):
    """Truncated and bit-flipped data files: one clear error each, and no teardown noise."""
    src = os.path.join(self.tmpdir(), "ckpt")
    save_checkpoint(src, _params(TINY_MLA), TINY_MLA)
    noise = []
    previous = sys.unraisablehook
    sys.unraisablehook = lambda u: noise.append(repr(u.exc_value))
    self.addCleanup(setattr, sys, "unraisablehook", previous)
    for how in ("truncate", "flip"):
      path = os.path.join(self.tmpdir(), how)
      shutil.copytree(src, path)
      _corrupt_largest_data_file(path, how)
      if how == "flip":
        # The files carry no checksum of their own: without ours a flip in stored bytes
        # loads as other values. OCDBT's write order varies from run to run, so the
        # middle byte may fall in a zstd-compressed chunk instead (decompression then
        # fails, itself a clear error); move the flip until it lands in stored bytes.
        for at in (0.5, 0.3, 0.7, 0.2, 0.8, 0.4, 0.6):
          shutil.rmtree(path)
          shutil.copytree(src, path)
          _corrupt_largest_data_file(path, how, at)
          try:
            params, _ = load_checkpoint(path, verify=False)
            break
          except CheckpointError as e:
            self.assertIn("cannot be read (truncated or corrupt files?)", str(e))
        else:
          self.fail("every flip landed in compressed data")
        ref = _flat(_params(TINY_MLA))
        differ = [k for k, a in _flat_items(params) if not np.array_equal(_f32(a), _f32(ref[k]))]
        self.assertLen(differ, 1)
        pattern = (f"^load_checkpoint: {re.escape(path)}: item 'params', parameter {re.escape(differ[0])}: "
                   "restored bytes do not match the checksum recorded at save")
      else:
        pattern = (f"^load_checkpoint: {re.escape(path)}: item 'params', parameter [\\w.]+ cannot be read "
                   "\\(truncated or corrupt files\\?\\): ValueError: OUT_OF_RANGE: Error reading")
      with self.assertRaisesRegex(CheckpointError, pattern) as ctx:
        load_checkpoint(path)
      self.assertEqual(ctx.exception.path, path)
      self.assertNotIn("\n", str(ctx.exception))
      self.assertIsNone(ctx.exception.__cause__)
    gc.collect()
    time.sleep(0.2)  # reads abandoned by the failed restores finish on TensorStore threads
    gc.collect()
    self.assertEqual(noise, [])
    # Whether those reads report at all is a race, so the filters are also checked directly:
    # the noise they report is dropped, anything else still reaches the previous hook / log.
    def unraisable(exc):
      return types.SimpleNamespace(exc_type=type(exc), exc_value=exc, exc_traceback=None,
                                   err_msg=None, object=None)
    read_failed = Exception("Encountered error while reading array index: (slice(0, 8, 1),)")
    sys.unraisablehook(unraisable(RuntimeError("Event loop is closed")))
    sys.unraisablehook(unraisable(read_failed))
    self.assertEqual(noise, [])
    sys.unraisablehook(unraisable(RuntimeError("something else")))
    self.assertEqual(noise, ["RuntimeError('something else')"])
    with self.assertLogs("asyncio", logging.ERROR) as logs:
      logging.getLogger("asyncio").error("Task exception was never retrieved",
                                         exc_info=(Exception, read_failed, None))
      logging.getLogger("asyncio").error("Task exception was never retrieved",
                                         exc_info=(ValueError, ValueError("other"), None))
    self.assertLen(logs.records, 1)
    self.assertEqual(str(logs.records[0].exc_info[1]), "other")

  def test_version_1_without_checksums_loads(self):
    # A checkpoint as written before checksums existed: same items, version 1, no "checksums".
    path = os.path.join(self.tmpdir(), "v1")
    save_checkpoint(path, _params(TINY_MLA), TINY_MLA)
    meta_file = os.path.join(path, "mlkit", "metadata")
    with open(meta_file) as f:
      meta = json.load(f)
    self.assertEqual(meta["version"], 2)
    self.assertLen(meta["checksums"], len(jax.tree_util.tree_leaves(_params(TINY_MLA))))
    meta["version"] = 1
    del meta["checksums"]
    with open(meta_file, "w") as f:
      json.dump(meta, f)
    self.assertTreesIdentical(_params(TINY_MLA), load_checkpoint(path)[0])
    meta["version"] = 2
    with open(meta_file, "w") as f:
      json.dump(meta, f)
    with self.assertRaisesRegex(CheckpointError, "item 'mlkit' has no 'checksums' object"):
      load_checkpoint(path)


# ----------------------------------------------------------------------------- Hugging Face


def _hand_config(q_lora: int | None) -> dict:
  """A DeepSeek-V3 config.json written by hand: 2 layers (dense, then MoE), 8 experts."""
  return {
      "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
      "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
      "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
      "q_lora_rank": q_lora, "kv_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
      "v_head_dim": 12, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
      "first_k_dense_replace": 1, "moe_layer_freq": 1, "routed_scaling_factor": 2.5,
      "norm_topk_prob": True, "n_group": 2, "topk_group": 1, "scoring_func": "sigmoid",
      "topk_method": "noaux_tc", "hidden_act": "silu", "rope_theta": 10000.0,
      "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                       "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
      "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 128,
      "num_nextn_predict_layers": 1, "torch_dtype": "float32",
  }


def _hand_tensors(q_lora: int | None, seed: int = 0) -> dict[str, np.ndarray]:
  """HF-layout tensors ([out, in] Linear weights) for ``_hand_config``, built without our writer."""
  rng = np.random.default_rng(seed)
  V, D, I, F, H, C, nope, rope, v, E = 96, 32, 48, 16, 2, 24, 8, 4, 12, 8
  t = lambda *shape: rng.standard_normal(shape).astype(np.float32) * 0.2
  out = {"model.embed_tokens.weight": t(V, D), "model.norm.weight": 1 + t(D), "lm_head.weight": t(V, D)}
  for i in range(3):  # layer 2 is the multi-token-prediction layer (a MoE layer plus its parts)
    p = f"model.layers.{i}."
    out[p + "input_layernorm.weight"] = 1 + t(D)
    out[p + "post_attention_layernorm.weight"] = 1 + t(D)
    if q_lora:
      out[p + "self_attn.q_a_proj.weight"] = t(q_lora, D)
      out[p + "self_attn.q_a_layernorm.weight"] = 1 + t(q_lora)
      out[p + "self_attn.q_b_proj.weight"] = t(H * (nope + rope), q_lora)
    else:
      out[p + "self_attn.q_proj.weight"] = t(H * (nope + rope), D)
    out[p + "self_attn.kv_a_proj_with_mqa.weight"] = t(C + rope, D)
    out[p + "self_attn.kv_a_layernorm.weight"] = 1 + t(C)
    out[p + "self_attn.kv_b_proj.weight"] = t(H * (nope + v), C)
    out[p + "self_attn.o_proj.weight"] = t(D, H * v)
    out[p + "self_attn.rotary_emb.inv_freq"] = t(rope // 2)  # a buffer some exporters write
    if i == 0:
      out[p + "mlp.gate_proj.weight"] = t(I, D)
      out[p + "mlp.up_proj.weight"] = t(I, D)
      out[p + "mlp.down_proj.weight"] = t(D, I)
    else:
      out[p + "mlp.gate.weight"] = t(E, D)
      out[p + "mlp.gate.e_score_correction_bias"] = t(E)
      for e in range(E):
        out[f"{p}mlp.experts.{e}.gate_proj.weight"] = t(F, D)
        out[f"{p}mlp.experts.{e}.up_proj.weight"] = t(F, D)
        out[f"{p}mlp.experts.{e}.down_proj.weight"] = t(D, F)
      out[p + "mlp.shared_experts.gate_proj.weight"] = t(F, D)
      out[p + "mlp.shared_experts.up_proj.weight"] = t(F, D)
      out[p + "mlp.shared_experts.down_proj.weight"] = t(D, F)
  # The multi-token-prediction layer's own parts (index == num_hidden_layers): loaded into
  # params["mtp"][0]; this one ships no embedding or head of its own.
  out["model.layers.2.eh_proj.weight"] = t(D, 2 * D)
  for n in ("enorm", "hnorm", "shared_head.norm"):
    out[f"model.layers.2.{n}.weight"] = 1 + t(D)
  return out


def _write_hf(path: str, config: dict, tensors: dict, files: int = 1, index: bool = False) -> str:
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  names = sorted(tensors)
  weight_map = {}
  for k in range(files):
    fname = "model.safetensors" if files == 1 else f"part-{k}.safetensors"
    group = names[k::files]
    save_file({n: tensors[n] for n in group}, os.path.join(path, fname))
    weight_map.update({n: fname for n in group})
  if index:
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {}, "weight_map": weight_map}, f)
  return path


def _fp8_block_quantise(w: np.ndarray, block=(128, 128)) -> tuple[np.ndarray, np.ndarray]:
  """DeepSeek-style: one f32 scale_inv per block, so that w ~= fp8 * scale_inv."""
  bo, bi = block
  nb = (-(-w.shape[0] // bo), -(-w.shape[1] // bi))
  scale_inv = np.zeros(nb, np.float32)
  q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
  for r in range(nb[0]):
    for c in range(nb[1]):
      blk = w[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi]
      scale_inv[r, c] = np.abs(blk).max() / 448.0
      q[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi] = (blk / scale_inv[r, c]).astype(ml_dtypes.float8_e4m3fn)
  return q, scale_inv


class HFImportTest(TreeAssertions):

  @parameterized.named_parameters(
      ("tiny_single_file", TINY_MLA, 1),
      ("no_q_lora", TINY_NO_QLORA, 1),
      ("bf16_sharded", TINY_BF16, 4))
  def test_write_load_round_trip(self, cfg, shards):
    params = _params(cfg)
    path = self.tmpdir()
    save_hf_checkpoint(path, params, cfg, shards=shards)
    files = sorted(os.listdir(path))
    if shards == 1:
      self.assertEqual(files, ["config.json", "model.safetensors"])
    else:
      self.assertLen([f for f in files if f.endswith(".safetensors")], shards)
      self.assertIn("model.safetensors.index.json", files)
    loaded, loaded_cfg = load_hf_checkpoint(path)
    self.assertEqual(loaded_cfg, cfg)
    self.assertTreesIdentical(params, loaded)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 6), dtype=np.int32)
    want = _forward(params, tokens, cfg=cfg)
    got = _forward(loaded, tokens, cfg=loaded_cfg)
    self.assertTrue(np.all(np.isfinite(np.asarray(want))))
    np.testing.assert_array_equal(np.asarray(want), np.asarray(got))

  @parameterized.named_parameters(("q_lora", 16), ("no_q_lora", None))
  def test_hand_built_checkpoint_layout(self, q_lora):
    """Tensors written with safetensors directly land at the documented [in, out] places."""
    tensors = _hand_tensors(q_lora)
    path = _write_hf(self.tmpdir(), _hand_config(q_lora), tensors)
    params, cfg = load_hf_checkpoint(path)
    self.assertEqual((cfg.d_model, cfg.n_layers, cfg.q_lora_rank, cfg.n_mtp_layers), (32, 2, q_lora or 0, 1))
    hf = lambda n: tensors["model." + n] if not n.startswith("lm_head") else tensors[n]
    eq = lambda ours, theirs, name: np.testing.assert_array_equal(_f32(ours), theirs, err_msg=name)
    eq(params["embed"], hf("embed_tokens.weight"), "embed")
    eq(params["final_norm"], hf("norm.weight"), "final_norm")
    eq(params["lm_head"], hf("lm_head.weight").T, "lm_head")
    for i, lp in enumerate(params["layers"]):
      p, a = f"layers.{i}.", lp["attn"]
      eq(lp["attn_norm"], hf(p + "input_layernorm.weight"), "attn_norm")
      eq(lp["ffn_norm"], hf(p + "post_attention_layernorm.weight"), "ffn_norm")
      if q_lora:
        eq(a["wq_a"], hf(p + "self_attn.q_a_proj.weight").T, "wq_a")
        eq(a["q_norm"], hf(p + "self_attn.q_a_layernorm.weight"), "q_norm")
        eq(a["wq_b"], hf(p + "self_attn.q_b_proj.weight").T, "wq_b")
        self.assertNotIn("wq", a)
      else:
        eq(a["wq"], hf(p + "self_attn.q_proj.weight").T, "wq")
        self.assertNotIn("wq_a", a)
      eq(a["wkv_a"], hf(p + "self_attn.kv_a_proj_with_mqa.weight").T, "wkv_a")
      eq(a["kv_norm"], hf(p + "self_attn.kv_a_layernorm.weight"), "kv_norm")
      eq(a["wkv_b"], hf(p + "self_attn.kv_b_proj.weight").T, "wkv_b")
      eq(a["wo"], hf(p + "self_attn.o_proj.weight").T, "wo")
      f = lp["ffn"]
      if i == 0:
        for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
          eq(f[ours], hf(f"{p}mlp.{theirs}.weight").T, ours)
        continue
      self.assertEqual(f["router"].dtype, jnp.float32)
      self.assertEqual(f["router_bias"].dtype, jnp.float32)
      eq(f["router"], hf(p + "mlp.gate.weight").T, "router")
      eq(f["router_bias"], hf(p + "mlp.gate.e_score_correction_bias"), "router_bias")
      for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
        for e in range(8):
          eq(_f32(f[ours])[e], hf(f"{p}mlp.experts.{e}.{theirs}.weight").T, f"{ours}[{e}]")
        eq(f["shared"][ours], hf(f"{p}mlp.shared_experts.{theirs}.weight").T, "shared." + ours)
    # Head-major: wkv_b's columns for head h are HF rows h*(nope+v) ... (h+1)*(nope+v).
    kv_b = hf("layers.1.self_attn.kv_b_proj.weight")
    eq(_f32(params["layers"][1]["attn"]["wkv_b"])[:, 20:40], kv_b[20:40].T, "wkv_b head 1")
    # The MTP layer: a MoE layer named as layer 2, plus its own parts.
    (mtp,) = params["mtp"]
    self.assertNotIn("embed", mtp)  # not shipped: the model's own are shared
    eq(mtp["eh_proj"], hf("layers.2.eh_proj.weight").T, "mtp eh_proj")
    eq(mtp["head_norm"], hf("layers.2.shared_head.norm.weight"), "mtp head_norm")
    eq(_f32(mtp["ffn"]["w_down"])[5], hf("layers.2.mlp.experts.5.down_proj.weight").T, "mtp w_down[5]")
    eq(mtp["attn"]["wkv_a"], hf("layers.2.self_attn.kv_a_proj_with_mqa.weight").T, "mtp wkv_a")

  def test_sharded_by_index_and_dtype_override(self):
    tensors = _hand_tensors(16)
    path = _write_hf(self.tmpdir(), _hand_config(16), tensors, files=3, index=True)
    ref, _ = load_hf_checkpoint(_write_hf(self.tmpdir(), _hand_config(16), tensors))
    with self.assertLogs("mlkit.checkpoint.hf", logging.WARNING) as logs:  # asked for, and logged
      params, cfg = load_hf_checkpoint(path, dtype="bfloat16")
    self.assertRegex(logs.output[0], r"converting \d+ tensor\(s\) to the narrower dtype bfloat16 as "
                                     r"dtype= asks \(e\.g\. model\.embed_tokens\.weight is F32\)")
    self.assertEqual((cfg.param_dtype, cfg.dtype), ("bfloat16", "bfloat16"))
    self.assertEqual(params["layers"][1]["ffn"]["w_up"].dtype, jnp.bfloat16)
    self.assertEqual(params["layers"][1]["ffn"]["router"].dtype, jnp.float32)
    # Same values as the single-file f32 load, rounded to bf16 (router stays f32).
    self.assertTreesIdentical(params, jax.tree_util.tree_map(lambda r, p: np.asarray(r).astype(p.dtype),
                                                             ref, params))

  def test_layers_beyond_the_config(self):
    """Only the multi-token-prediction layers config.json declares may be present, and whole."""
    tensors = _hand_tensors(16)  # layers 0 and 1, and MTP layer 2
    config = _hand_config(16)
    config["num_nextn_predict_layers"] = 0  # a config with fewer layers than the checkpoint
    path = _write_hf(self.tmpdir(), config, tensors)
    with self.assertRaisesRegex(CheckpointError, f"^load_hf_checkpoint: {path}/model.safetensors: tensor "
                                                 r"model\.layers\.2\.eh_proj\.weight belongs to layer 2, but "
                                                 r"config\.json declares num_hidden_layers=2 and "
                                                 r"num_nextn_predict_layers=0$"):
      load_hf_checkpoint(path)
    tensors["model.layers.3.eh_proj.weight"] = tensors["model.layers.2.eh_proj.weight"]
    with self.assertRaisesRegex(CheckpointError, r"tensor model\.layers\.3\.eh_proj\.weight belongs to layer "
                                                 r"3, but config\.json declares num_hidden_layers=2 and "
                                                 r"num_nextn_predict_layers=1"):
      load_hf_checkpoint(_write_hf(self.tmpdir(), _hand_config(16), tensors))
    del tensors["model.layers.3.eh_proj.weight"], tensors["model.layers.2.hnorm.weight"]
    with self.assertRaisesRegex(CheckpointError, r"missing tensor model\.layers\.2\.hnorm\.weight "
                                                 r"\(for mtp\.0\.hnorm\)"):
      load_hf_checkpoint(_write_hf(self.tmpdir(), _hand_config(16), tensors))

  def test_dtype_from_the_tensors(self):
    config = _hand_config(16)
    del config["torch_dtype"]
    tensors = _hand_tensors(16)
    params, cfg = load_hf_checkpoint(_write_hf(self.tmpdir(), config, tensors))
    self.assertEqual((cfg.param_dtype, cfg.dtype), ("float32", "float32"))
    self.assertEqual(params["layers"][1]["ffn"]["w_up"].dtype, jnp.float32)
    np.testing.assert_array_equal(_f32(params["lm_head"]), tensors["lm_head.weight"].T)
    bf16 = {n: t.astype(ml_dtypes.bfloat16) for n, t in tensors.items()}
    params, cfg = load_hf_checkpoint(_write_hf(self.tmpdir(), config, bf16))
    self.assertEqual(cfg.param_dtype, "bfloat16")
    self.assertEqual(params["layers"][1]["ffn"]["w_up"].dtype, jnp.bfloat16)
    self.assertEqual(params["layers"][1]["ffn"]["router"].dtype, jnp.float32)  # widened, exact
    np.testing.assert_array_equal(_f32(params["layers"][1]["ffn"]["router"]),
                                  bf16["model.layers.1.mlp.gate.weight"].astype(np.float32).T)
    # Tensors that disagree, with no dtype declared: an error naming one of each, unless dtype= says.
    mixed = dict(tensors, **{"model.norm.weight": bf16["model.norm.weight"]})
    path = _write_hf(self.tmpdir(), config, mixed)
    with self.assertRaisesRegex(CheckpointError,
                                f"^load_hf_checkpoint: {path}/config.json: declares no 'torch_dtype' and "
                                r"the tensors disagree \(model\.norm\.weight is BF16, "
                                r"model\.embed_tokens\.weight is F32\); pass dtype="):
      load_hf_checkpoint(path)
    params, cfg = load_hf_checkpoint(path, dtype="float32")
    np.testing.assert_array_equal(_f32(params["final_norm"]), bf16["model.norm.weight"].astype(np.float32))
    f16 = {n: t.astype(np.float16) for n, t in tensors.items()}
    with self.assertRaisesRegex(CheckpointError, r"declares no 'torch_dtype' and the tensors are F16"):
      load_hf_checkpoint(_write_hf(self.tmpdir(), config, f16))

  def test_narrowing_must_be_asked_for(self):
    config = _hand_config(16)
    config["torch_dtype"] = "bfloat16"  # but the tensors are f32
    path = _write_hf(self.tmpdir(), config, _hand_tensors(16))
    with self.assertRaisesRegex(CheckpointError,
                                f"{path}/model.safetensors: tensor model\\.embed_tokens\\.weight is F32 "
                                r"but config\.json declares torch_dtype bfloat16; converting \d+ "
                                r"tensor\(s\) to it loses precision: pass dtype='bfloat16'"):
      load_hf_checkpoint(path)
    # Widening (declared f32 over bf16 tensors) is exact and needs nothing.
    config["torch_dtype"] = "float32"
    bf16 = {n: t.astype(ml_dtypes.bfloat16) for n, t in _hand_tensors(16).items()}
    params, cfg = load_hf_checkpoint(_write_hf(self.tmpdir(), config, bf16))
    self.assertEqual(cfg.param_dtype, "float32")
    np.testing.assert_array_equal(_f32(params["embed"]), bf16["model.embed_tokens.weight"].astype(np.float32))

  def test_quantised_export_is_in_the_declared_dtype(self):
    params = jax.tree_util.tree_map(lambda x: x, _params(TINY_BF16))
    fp8 = quantize_fp8(params["layers"][1]["attn"]["wq_b"])
    params["layers"][1]["attn"]["wq_b"] = fp8
    path = self.tmpdir()
    save_hf_checkpoint(path, params, TINY_BF16)
    with safe_open(os.path.join(path, "model.safetensors"), framework="numpy") as f:
      dtypes = {f.get_slice(n).get_dtype() for n in f.keys() if ".mlp.gate." not in n}
    self.assertEqual(dtypes, {"BF16"})
    loaded, cfg = load_hf_checkpoint(path)  # nothing to narrow, so no dtype= needed
    self.assertEqual(cfg, TINY_BF16)
    want = _f32(fp8.values) * np.repeat(np.repeat(_f32(fp8.scales), 128, 0), 128, 1)[:32, :96]
    np.testing.assert_array_equal(_f32(loaded["layers"][1]["attn"]["wq_b"]),
                                  _f32(want.astype(ml_dtypes.bfloat16)))

  @parameterized.named_parameters(
      ("config_truncated", "config.json", lambda b: b[:len(b) // 2], r"invalid JSON \(.*line 1 column"),
      ("config_list", "config.json", lambda b: b"[1, 2]", r"expected a JSON object, got list"),
      ("config_field", "config.json", lambda b: b.replace(b'"hidden_size": 32', b'"hidden_size": "32"'),
       r"config_from_hf: field 'hidden_size' must be an int"),
      ("quantization_config", "config.json", lambda b: b[:-1] + b', "quantization_config": [128]}',
       r"quantization_config must be an object whose weight_block_size is two positive ints"),
      ("index_list", "model.safetensors.index.json", lambda b: b"[]", r"expected a JSON object, got list"),
      ("index_truncated", "model.safetensors.index.json", lambda b: b[:12], r"invalid JSON"),
      ("index_no_map", "model.safetensors.index.json", lambda b: b'{"metadata": {}}',
       r"has no 'weight_map' object \(got NoneType\)"),
      ("index_value", "model.safetensors.index.json",
       lambda b: b.replace(b'"part-1.safetensors"', b"3", 1),
       r"weight_map\['[\w.]+'\] must be a file name in .*, got 3"),
      ("index_path", "model.safetensors.index.json",
       lambda b: b.replace(b'"part-1.safetensors"', b'"../part-1.safetensors"', 1),
       r"weight_map\['[\w.]+'\] must be a file name in .*, got '\.\./part-1\.safetensors'"),
      ("shard_truncated", "part-1.safetensors", lambda b: b[:-100],
       r"not a readable safetensors file \(.*incomplete metadata"),
      ("shard_header", "part-0.safetensors", lambda b: b[:4], r"not a readable safetensors file \(.*header"),
  )
  def test_unreadable_files_are_named(self, fname, mutate, pattern):
    path = _write_hf(self.tmpdir(), _hand_config(16), _hand_tensors(16), files=2, index=True)
    target = os.path.join(path, fname)
    with open(target, "rb") as f:
      data = f.read()
    with open(target, "wb") as f:
      f.write(mutate(data))
    pattern = f"^load_hf_checkpoint: {re.escape(target)}: {pattern}"
    with self.assertRaisesRegex(CheckpointError, pattern) as ctx:
      load_hf_checkpoint(path)
    self.assertEqual(ctx.exception.path, target)

  def test_tied_embeddings_round_trip(self):
    cfg = dataclasses.replace(TINY_MLA, tie_embeddings=True, n_layers=2)
    params = _params(cfg)
    self.assertNotIn("lm_head", params)
    path = self.tmpdir()
    save_hf_checkpoint(path, params, cfg)
    with open(os.path.join(path, "config.json")) as f:
      self.assertTrue(json.load(f)["tie_word_embeddings"])
    loaded, loaded_cfg = load_hf_checkpoint(path)
    self.assertEqual(loaded_cfg, cfg)
    self.assertTreesIdentical(params, loaded)

  def test_fp8_block_dequantisation(self):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((300, 200)).astype(np.float32)
    q, s = _fp8_block_quantise(w)
    self.assertEqual(s.shape, (3, 2))
    got = dequantize_fp8_blocks(q, s)
    want = np.empty_like(w)
    for r in range(300):
      for c in range(200):
        want[r, c] = float(q[r, c]) * s[r // 128, c // 128]
    np.testing.assert_array_equal(got, want)
    self.assertLess(np.linalg.norm(got - w) / np.linalg.norm(w), 5e-2)
    with self.assertRaisesRegex(ValueError, r"w_scale_inv: expected shape \(3, 2\)"):
      dequantize_fp8_blocks(q, s[:, :1], name="w")

  def test_fp8_weights_in_checkpoint(self):
    tensors = _hand_tensors(16)
    config = _hand_config(16)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 8]}
    names = ["lm_head.weight", "model.layers.1.mlp.experts.3.down_proj.weight",
             "model.layers.0.self_attn.q_b_proj.weight"]
    want = {}
    for n in names:
      q, s = _fp8_block_quantise(tensors[n], (16, 8))
      self.assertGreater(s.size, 1)
      tensors[n], tensors[n + "_scale_inv"] = q, s
      want[n] = q.astype(np.float32) * np.repeat(np.repeat(s, 16, 0), 8, 1)[:q.shape[0], :q.shape[1]]
    path = _write_hf(self.tmpdir(), config, tensors)
    params, _ = load_hf_checkpoint(path)
    np.testing.assert_array_equal(_f32(params["lm_head"]), want[names[0]].T)
    np.testing.assert_array_equal(_f32(params["layers"][1]["ffn"]["w_down"])[3], want[names[1]].T)
    np.testing.assert_array_equal(_f32(params["layers"][0]["attn"]["wq_b"]), want[names[2]].T)
    ref = _hand_tensors(16)["lm_head.weight"]
    self.assertLess(np.linalg.norm(want[names[0]] - ref) / np.linalg.norm(ref), 5e-2)

    # fp8 without its scale, and a scale of the wrong shape.
    del tensors[names[0] + "_scale_inv"]
    with self.assertRaisesRegex(ValueError, r"fp8 tensor lm_head\.weight has no lm_head\.weight_scale_inv"):
      load_hf_checkpoint(_write_hf(self.tmpdir(), config, tensors))
    tensors[names[0] + "_scale_inv"] = np.ones((1, 1), np.float32)
    with self.assertRaisesRegex(ValueError, r"lm_head\.weight_scale_inv: expected shape \(6, 4\)"):
      load_hf_checkpoint(_write_hf(self.tmpdir(), config, tensors))

  def test_reading_part_of_a_tensor(self):
    # What a process of a multi-process load reads: a box of a tensor, in contiguous runs;
    # an fp8 tensor's box is grown to whole scale blocks and cut back after dequantising.
    tensors = _hand_tensors(16)
    config = _hand_config(16)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 8]}
    fp8 = "model.layers.1.mlp.experts.3.down_proj.weight"
    tensors[fp8], tensors[fp8 + "_scale_inv"] = _fp8_block_quantise(tensors[fp8], (16, 8))
    ck = open_hf_checkpoint(_write_hf(self.tmpdir(), config, tensors))
    for name in (fp8, "lm_head.weight", "model.norm.weight"):
      full = ck._read(name, tuple((0, d) for d in tensors[name].shape))
      boxes = [((3, 21), (5, 6))[:full.ndim], ((0, full.shape[0]),) + ((9, 13),)[:full.ndim - 1],
               ((2, 3),) + ((0, full.shape[-1]),)[:full.ndim - 1]]
      for box in boxes:
        before = ck._reader.bytes_read
        got = ck._read(name, box)
        np.testing.assert_array_equal(got, full[tuple(slice(a, b) for a, b in box)], err_msg=str(box))
        if name != fp8:  # exactly the box's bytes
          self.assertEqual(ck._reader.bytes_read - before, got.nbytes)

  @parameterized.named_parameters(
      ("missing", lambda t: t.pop("model.layers.1.self_attn.kv_a_proj_with_mqa.weight"),
       r"missing tensor model\.layers\.1\.self_attn\.kv_a_proj_with_mqa\.weight"),
      ("missing_expert", lambda t: t.pop("model.layers.1.mlp.experts.5.down_proj.weight"),
       r"missing tensor model\.layers\.1\.mlp\.experts\.5\.down_proj\.weight"),
      ("missing_bias", lambda t: t.pop("model.layers.1.mlp.gate.e_score_correction_bias"),
       r"missing tensor model\.layers\.1\.mlp\.gate\.e_score_correction_bias"),
      ("wrong_shape", lambda t: t.update({"model.layers.0.self_attn.kv_b_proj.weight": np.ones((40, 20), np.float32)}),
       r"tensor model\.layers\.0\.self_attn\.kv_b_proj\.weight has shape \(40, 20\), expected \(40, 24\)"),
      ("transposed", lambda t: t.update({"lm_head.weight": np.ones((32, 96), np.float32)}),
       r"tensor lm_head\.weight has shape \(32, 96\), expected \(96, 32\)"),
      ("unexpected", lambda t: t.update({"model.layers.0.self_attn.k_norm.weight": np.ones(4, np.float32)}),
       r"unexpected tensor.*model\.layers\.0\.self_attn\.k_norm\.weight"),
      ("scale_on_bf16", lambda t: t.update({"model.norm.weight_scale_inv": np.ones((1, 1), np.float32)}),
       r"model\.norm\.weight_scale_inv given but model\.norm\.weight is F32"),
  )
  def test_tensor_errors(self, mutate, pattern):
    tensors = _hand_tensors(16)
    mutate(tensors)
    path = _write_hf(self.tmpdir(), _hand_config(16), tensors)
    with self.assertRaisesRegex(ValueError, pattern):
      load_hf_checkpoint(path)

  def test_file_errors(self):
    tmp = self.tmpdir()
    with self.assertRaisesRegex(FileNotFoundError, "is not a directory"):
      load_hf_checkpoint(os.path.join(tmp, "nowhere"))
    empty = os.path.join(tmp, "empty")
    os.makedirs(empty)
    with self.assertRaisesRegex(FileNotFoundError, "config.json is missing"):
      load_hf_checkpoint(empty)
    with open(os.path.join(empty, "config.json"), "w") as f:
      json.dump(_hand_config(16), f)
    with self.assertRaisesRegex(FileNotFoundError, r"no \*\.safetensors"):
      load_hf_checkpoint(empty)
    tensors = _hand_tensors(16)
    sharded = _write_hf(os.path.join(tmp, "sharded"), _hand_config(16), tensors, files=2, index=True)
    os.remove(os.path.join(sharded, "part-1.safetensors"))
    with self.assertRaisesRegex(FileNotFoundError, "shard part-1.safetensors"):
      load_hf_checkpoint(sharded)
    bad_index = _write_hf(os.path.join(tmp, "bad_index"), _hand_config(16), tensors, files=2, index=True)
    with open(os.path.join(bad_index, "model.safetensors.index.json")) as f:
      index = json.load(f)
    index["weight_map"]["model.norm.weight"] = "part-0.safetensors" if index["weight_map"][
        "model.norm.weight"] == "part-1.safetensors" else "part-1.safetensors"
    with open(os.path.join(bad_index, "model.safetensors.index.json"), "w") as f:
      json.dump(index, f)
    with self.assertRaisesRegex(ValueError, r"model\.norm\.weight is listed in .* but missing from"):
      load_hf_checkpoint(bad_index)
    dup = _write_hf(os.path.join(tmp, "dup"), _hand_config(16), tensors)
    save_file({"model.norm.weight": tensors["model.norm.weight"]}, os.path.join(dup, "extra.safetensors"))
    with self.assertRaisesRegex(ValueError, r"model\.norm\.weight appears in both"):
      load_hf_checkpoint(dup)


class HFConfigTest(TreeAssertions):

  def test_kimi_round_trip(self):
    hf = config_to_hf(KIMI_K2_6)
    self.assertEqual(hf["architectures"], ["DeepseekV3ForCausalLM"])
    self.assertEqual(config_from_hf(json.loads(json.dumps(hf))), KIMI_K2_6)
    hf["model_type"] = "kimi_k2"
    self.assertEqual(config_from_hf(hf).n_routed_experts, 384)

  def test_field_mapping(self):
    cfg = config_from_hf(_hand_config(None))
    self.assertEqual(cfg.q_lora_rank, 0)
    self.assertEqual((cfg.dense_ffn_dim, cfg.moe_ffn_dim, cfg.top_k, cfg.first_k_dense), (48, 16, 2, 1))
    self.assertEqual((cfg.router, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor), ("sigmoid", 2, 1, 2.5))
    self.assertEqual((cfg.max_seq_len, cfg.vocab_size, cfg.param_dtype, cfg.n_mtp_layers), (128, 96, "float32", 1))
    self.assertTrue(cfg.rope_interleave)
    self.assertEqual(cfg.rope_scaling.factor, 4.0)
    self.assertEqual(cfg.rope_scaling.original_max_position_embeddings, 32)
    hf = _hand_config(8)
    hf["rope_scaling"] = {"rope_type": "yarn", "factor": 8.0}
    hf["scoring_func"] = "softmax"
    hf.pop("torch_dtype")
    # No dtype declared and none given: no guess (load_hf_checkpoint passes the tensors' dtype).
    with self.assertRaisesRegex(ValueError, r"declares no 'torch_dtype' \(or 'dtype'\); pass dtype="):
      config_from_hf(hf)
    cfg = config_from_hf(hf, dtype="bfloat16")
    # DeepSeek-V3 reference defaults for absent YaRN fields.
    self.assertEqual(cfg.rope_scaling.beta_fast, 32.0)
    self.assertEqual(cfg.rope_scaling.mscale_all_dim, 0.0)
    self.assertEqual((cfg.router, cfg.param_dtype, cfg.q_lora_rank), ("softmax", "bfloat16", 8))
    hf["dtype"] = "float32"  # the key newer exports write instead of torch_dtype
    self.assertEqual(config_from_hf(hf).param_dtype, "float32")
    hf["rope_scaling"] = None
    self.assertIsNone(config_from_hf(hf).rope_scaling)

  @parameterized.named_parameters(
      ("llama", {"architectures": ["LlamaForCausalLM"]}, r"architectures \['LlamaForCausalLM'\]"),
      ("no_arch", {"architectures": None}, r"architectures None"),
      ("model_type", {"model_type": "glm_moe"}, r"model_type 'glm_moe'"),
      ("moe_layer_freq", {"moe_layer_freq": 2}, r"moe_layer_freq=2"),
      ("hidden_act", {"hidden_act": "gelu"}, r"hidden_act='gelu'"),
      ("scoring", {"scoring_func": "relu"}, r"scoring_func='relu'"),
      ("rope_type", {"rope_scaling": {"type": "linear", "factor": 2.0}}, r"rope_scaling type 'linear'"),
      ("rope_factor", {"rope_scaling": {"type": "yarn"}}, r"'rope_scaling\.factor'"),
      ("dtype", {"torch_dtype": "float16"}, r"torch_dtype: unsupported dtype 'float16'"),
      ("int_field", {"hidden_size": "32"}, r"field 'hidden_size' must be an int"),
      ("q_lora_type", {"q_lora_rank": 1.5}, r"'q_lora_rank' must be an int or null"),
      ("inconsistent", {"num_experts_per_tok": 9}, r"inconsistent config\.json.*top_k"),
      ("mtp_layers", {"num_nextn_predict_layers": -1},
       r"field 'num_nextn_predict_layers' must be a non-negative int, got -1"),
  )
  def test_config_errors(self, change, pattern):
    hf = _hand_config(16)
    hf.update(change)
    with self.assertRaisesRegex(ValueError, pattern):
      config_from_hf(hf)

  @parameterized.parameters("hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
                            "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                            "intermediate_size", "moe_intermediate_size", "n_routed_experts",
                            "n_shared_experts", "num_experts_per_tok", "first_k_dense_replace",
                            "routed_scaling_factor", "norm_topk_prob", "n_group", "topk_group",
                            "rope_theta", "rms_norm_eps", "max_position_embeddings", "vocab_size")
  def test_missing_field(self, field):
    hf = _hand_config(16)
    del hf[field]
    with self.assertRaisesRegex(ValueError, f"missing required field '{field}'"):
      config_from_hf(hf)

  def test_load_dtype_override_error(self):
    with self.assertRaisesRegex(ValueError, "load dtype: unsupported dtype"):
      config_from_hf(_hand_config(16), dtype="int8")

  def test_writer_errors(self):
    tmp = self.tmpdir()
    with self.assertRaisesRegex(ValueError, "attention='gqa'"):
      save_hf_checkpoint(tmp, {}, TINY_GQA)
    params = _params(TINY_MLA)
    with self.assertRaisesRegex(ValueError, "shards must be an int"):
      save_hf_checkpoint(tmp, params, TINY_MLA, shards=0)
    bad = jax.tree_util.tree_map(lambda x: x, params)
    bad["layers"][1]["attn"]["wkv_a"] = jax.device_put(np.asarray(bad["layers"][1]["attn"]["wkv_a"]).T)
    with self.assertRaisesRegex(ValueError, r"^save_hf_checkpoint: params do not match config 'tiny-mla': "
                                            r"layers/1/attn/wkv_a: expected float32\[64, 40\], "
                                            r"found float32\[40, 64\]"):
      save_hf_checkpoint(tmp, bad, TINY_MLA)
    with self.assertRaisesRegex(ValueError, r"embed: expected bfloat16\[256, 64\], found float32"):
      save_hf_checkpoint(tmp, params, TINY_BF16)
    self.assertEqual(os.listdir(tmp), [])


if __name__ == "__main__":
  absltest.main()
