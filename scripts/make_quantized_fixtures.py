"""Writes the published-quantisation fixtures under tests/fixtures/ (torch, transformers, compressed-tensors).

Run in a throwaway virtual environment, never the project's (the tests must not
import torch):

    python3.12 -m venv /tmp/ctvenv
    /tmp/ctvenv/bin/pip install torch "transformers>=5" compressed-tensors
    /tmp/ctvenv/bin/python scripts/make_quantized_fixtures.py

Two tiny checkpoints in the formats publishers ship, each built from a random
transformers model (``scripts/make_hf_fixtures.py``'s initialisation):

- ``kimi_k2_int4``: the DeepSeek-V3 architecture as Kimi K2 uses it (one dense
  layer, then MoE layers; group-free routing, YaRN), its routed experts
  compressed-tensors ``pack-quantized`` INT4, symmetric, group 32, bf16 scales:
  the codes are rounded here and packed by compressed-tensors' own
  ``pack_to_int32``. ``ignore`` lists attention, shared experts, the dense MLP,
  ``lm_head`` and the MTP layer's own projections, mostly as ``re:`` patterns, as
  Kimi's config does. One multi-token-prediction layer (layer 3: a MoE layer plus
  ``eh_proj``, norms, its own embedding and head) is written with random weights,
  its experts INT4 too (transformers has no MTP module and ignores it).
- ``deepseek_v3_fp8``: DeepSeek-V3's FP8 release format: every decoder Linear as
  float8_e4m3fn with one f32 ``weight_scale_inv`` per 128x128 block (a dense MLP
  of 256 spans two blocks; most weights have fewer than 128 rows, one partial
  block); embeddings, norms, routers and ``lm_head`` dense. Dimensions past 128
  are multiples of it: transformers' fp8 loader derives the block from the scale
  grid (``dim // blocks``), which is DeepSeek's fixed 128 with a partial last
  block only when no dimension has several blocks and a partial one.

Dense tensors are f32. ``reference.npz`` holds what ``make_hf_fixtures.py``
records, from transformers' forward on the same weights dequantised (f32):
``w = code * scale`` and ``w = fp8 * scale_inv``. As a check of the files
themselves, transformers (with compressed-tensors, and its own fp8 loader) loads
each fixture, and its dequantised weights must equal the ones the reference used
(fp8 in f32; INT4 in the bf16 that compressed-tensors dequantises into).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_hf_fixtures import randomise, reference, run  # noqa: E402

GROUP = 32
# Kimi K2's ignore list, plus this fixture's MTP projections (eh_proj, shared_head.head).
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*\\.eh_proj$",
               "re:.*shared_head\\.head$"]


def _int4_group(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
  """compressed-tensors' symmetric int4 rounding of an [out, in] weight: scale = absmax / 7.5
  per group of ``group`` input columns (stored bf16), code = round(w / scale) in [-8, 7]."""
  out, k = w.shape
  g = w.float().reshape(out, k // group, group)
  scale = (g.abs().amax(-1) / 7.5).to(torch.bfloat16)  # [out, in/group]
  s = scale.float().clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1)
  codes = torch.clamp(torch.round(g / s), -8, 7).to(torch.int8).reshape(out, k)
  return codes, scale


def _fp8_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
  """DeepSeek-V3's fp8 rounding: scale_inv = absmax / 448 per 128x128 block (f32), fp8 = w / scale_inv."""
  out, k = w.shape
  bo, bi = math.ceil(out / block), math.ceil(k / block)
  padded = torch.zeros(bo * block, bi * block)
  padded[:out, :k] = w.float()
  blocks = padded.reshape(bo, block, bi, block)
  scale_inv = blocks.abs().amax(dim=(1, 3)) / 448.0  # [bo, bi]
  s = scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)[:out, :k]
  q = (w.float() / torch.where(s == 0, torch.ones_like(s), s)).to(torch.float8_e4m3fn)
  return q, scale_inv


def _config(**over) -> transformers.DeepseekV3Config:
  base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=64,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
              n_routed_experts=8, routed_scaling_factor=2.827, kv_lora_rank=32, q_lora_rank=48,
              qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=1, topk_group=1,
              num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=256,
              rms_norm_eps=1e-6, tie_word_embeddings=False,
              rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                               "original_max_position_embeddings": 64, "beta_fast": 32,
                               "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
  base.update(over)
  cfg = transformers.DeepseekV3Config(**base)
  cfg._attn_implementation = "eager"
  return cfg


def _dense_model(cfg, seed: int, tmp: str) -> dict[str, torch.Tensor]:
  """A randomised model's tensors as save_pretrained writes them (per-expert names), f32."""
  torch.manual_seed(0)
  model = transformers.DeepseekV3ForCausalLM(cfg).eval()
  randomise(model, seed=seed)
  model.save_pretrained(tmp)
  return load_file(os.path.join(tmp, "model.safetensors"))


def _save(out_dir: str, tmp: str, tensors: dict, dequantised: dict, qconfig: dict, **config_over):
  """Writes the fixture (config.json with ``qconfig``, the quantised tensors) and its reference,
  computed by transformers on the ``dequantised`` weights."""
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(tmp, "config.json")) as f:
    config = json.load(f)
  config.update(config_over)
  save_file(dequantised, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(tmp, "config.json"), "w") as f:
    json.dump(config, f, indent=2, sort_keys=True)
  model = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
  model.config._attn_implementation = "eager"
  tokens = np.random.default_rng(2).integers(2, config["vocab_size"], (2, 24))
  ref = reference(model, tokens, 16, 8)
  config["quantization_config"] = qconfig
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config, f, indent=2, sort_keys=True)
  shutil.copy(os.path.join(tmp, "generation_config.json"), out_dir)
  save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
  os.chmod(os.path.join(out_dir, "model.safetensors"), 0o644)
  np.savez(os.path.join(out_dir, "reference.npz"), **ref)


def _check_with_transformers(out_dir: str, dequantised: dict, qconfig_cls) -> None:
  """transformers' own loader on the fixture must give the dequantised weights the reference used."""
  model = transformers.DeepseekV3ForCausalLM.from_pretrained(
      out_dir, dtype=torch.float32, quantization_config=qconfig_cls(dequantize=True)).eval()
  sd = model.state_dict()
  # transformers fuses each layer's experts: [E, 2F, D] gate_up and [E, D, F] down.
  checked = 0
  for name, want in dequantised.items():
    m = name.split(".mlp.experts.")
    if len(m) == 2:
      e, proj = m[1].split(".")[:2]
      fused = sd[f"{m[0]}.mlp.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"]
      got = fused[int(e)]
      if proj != "down_proj":
        half = got.shape[0] // 2
        got = got[:half] if proj == "gate_proj" else got[half:]
    elif name in sd:
      got = sd[name]
    else:
      continue
    # compressed-tensors dequantises into the scales' dtype (bf16): compare at that precision.
    if not torch.equal(got, want.to(got.dtype)):
      raise RuntimeError(f"{out_dir}: transformers loads {name} differently from the reference weights")
    checked += 1
  print(f"{os.path.basename(out_dir)}: transformers' loader agrees on {checked} tensors")


def kimi_k2_int4(out_dir: str) -> None:
  """Kimi K2's layout with compressed-tensors INT4 (group 32) routed experts and one MTP layer."""
  from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
  cfg = _config(num_nextn_predict_layers=1)
  with tempfile.TemporaryDirectory() as tmp:
    dense = _dense_model(cfg, seed=3, tmp=tmp)
    # The MTP layer: a MoE layer like the last one, plus DeepSeek-V3's MTP parts, random.
    g = torch.Generator().manual_seed(4)
    L, D, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    mtp = {}
    for name, t in dense.items():
      if name.startswith(f"model.layers.{L - 1}."):
        new = name.replace(f"model.layers.{L - 1}.", f"model.layers.{L}.")
        mtp[new] = (1.0 + 0.1 * torch.randn(t.shape, generator=g) if name.endswith("norm.weight")
                    else torch.randn(t.shape, generator=g) * (0.7 / t.shape[-1] ** 0.5 if t.ndim > 1
                                                              else 0.1))
    for name, shape in ((f"model.layers.{L}.eh_proj.weight", (D, 2 * D)),
                        (f"model.layers.{L}.embed_tokens.weight", (V, D)),
                        (f"model.layers.{L}.shared_head.head.weight", (V, D))):
      mtp[name] = torch.randn(shape, generator=g) * 0.7 / shape[-1] ** 0.5
    for name in ("enorm", "hnorm", "shared_head.norm"):
      mtp[f"model.layers.{L}.{name}.weight"] = 1.0 + 0.1 * torch.randn((D,), generator=g)
    tensors, dequantised = {}, dict(dense)
    for name, t in {**dense, **mtp}.items():
      if ".mlp.experts." in name:
        codes, scale = _int4_group(t, GROUP)
        module = name.removesuffix(".weight")
        tensors[module + ".weight_packed"] = pack_to_int32(codes, 4)
        tensors[module + ".weight_scale"] = scale
        tensors[module + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int32)
        if name in dense:
          dequantised[name] = (codes.float().reshape(t.shape[0], -1, GROUP)
                               * scale.float().unsqueeze(-1)).reshape(t.shape)
      else:
        tensors[name] = t.contiguous()
    qconfig = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "kv_cache_scheme": None,
        "config_groups": {"group_0": {
            "targets": ["Linear"], "input_activations": None, "output_activations": None,
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": GROUP, "dynamic": False, "actorder": None,
                        "observer": "minmax", "observer_kwargs": {}}}},
        "ignore": KIMI_IGNORE}
    _save(out_dir, tmp, tensors, dequantised, qconfig)
  from transformers import CompressedTensorsConfig
  _check_with_transformers(out_dir, {k: v for k, v in dequantised.items() if ".experts." in k},
                           CompressedTensorsConfig)


def deepseek_v3_fp8(out_dir: str) -> None:
  """DeepSeek-V3's FP8 release format: decoder Linear weights e4m3 with 128x128 block scales."""
  cfg = _config(hidden_size=128, intermediate_size=256, n_group=2, topk_group=1,
                routed_scaling_factor=2.5, num_nextn_predict_layers=0)
  not_fp8 = ("embed_tokens", "lm_head", "mlp.gate.", "norm")
  with tempfile.TemporaryDirectory() as tmp:
    dense = _dense_model(cfg, seed=5, tmp=tmp)
    tensors, dequantised = {}, dict(dense)
    for name, t in dense.items():
      if t.ndim == 2 and not any(s in name for s in not_fp8):
        q, scale_inv = _fp8_blocks(t)
        tensors[name], tensors[name + "_scale_inv"] = q, scale_inv
        s = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:t.shape[0], :t.shape[1]]
        dequantised[name] = q.float() * s
      else:
        tensors[name] = t.contiguous()
    qconfig = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
               "weight_block_size": [128, 128]}
    _save(out_dir, tmp, tensors, dequantised, qconfig)
  from transformers import FineGrainedFP8Config
  _check_with_transformers(out_dir, {k: v for k, v in dequantised.items()
                                     if k + "_scale_inv" in tensors}, FineGrainedFP8Config)


FIXTURE_BUILDERS = {"kimi_k2_int4": kimi_k2_int4, "deepseek_v3_fp8": deepseek_v3_fp8}


def main(argv=None) -> int:
  import compressed_tensors
  return run(FIXTURE_BUILDERS, "scripts/make_quantized_fixtures.py", argv,
             **{"compressed-tensors": compressed_tensors.__version__})


if __name__ == "__main__":
  raise SystemExit(main())
