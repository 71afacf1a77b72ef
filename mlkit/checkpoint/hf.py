"""Hugging Face checkpoints in the DeepSeek-V3 / Kimi-K2 layout: import and export.

A checkpoint directory holds ``config.json`` plus ``model.safetensors``, or shards
``model-0000i-of-0000N.safetensors`` listed in ``model.safetensors.index.json``.

Name and layout mapping (HF ``nn.Linear`` weights are [out, in]; ours are [in, out])::

  model.embed_tokens.weight [V, D]          -> embed [V, D]            (no transpose)
  model.norm.weight [D]                     -> final_norm
  lm_head.weight [V, D]                     -> lm_head [D, V]
  model.layers.N.input_layernorm.weight     -> layers[N].attn_norm
  model.layers.N.post_attention_layernorm.weight -> layers[N].ffn_norm
  model.layers.N.self_attn.{q_a_proj, q_a_layernorm, q_b_proj | q_proj,
      kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}.weight
                                            -> attn.{wq_a, q_norm, wq_b | wq, wkv_a, kv_norm, wkv_b, wo}
  model.layers.N.mlp.{gate,up,down}_proj.weight   -> ffn.w_{gate,up,down}     (dense layers)
  model.layers.N.mlp.gate.weight [E, D]           -> ffn.router [D, E] (f32)
  model.layers.N.mlp.gate.e_score_correction_bias -> ffn.router_bias (f32)
  model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight -> ffn.w_{gate,up,down}[E] (stacked)
  model.layers.N.mlp.shared_experts.{gate,up,down}_proj.weight -> ffn.shared.w_{gate,up,down}

Our head-major layouts (wq_b [q_lora, H*(nope+rope)], wkv_b [kv_lora, H*(nope+v)],
wo [H*v, D]) are exactly the HF weights transposed, and DeepSeek checkpoints use
interleaved RoPE (``rope_interleave=True``). The multi-token-prediction layers that
config.json declares (``num_nextn_predict_layers`` of them, after the last layer) and
rotary ``inv_freq`` buffers are skipped; any other tensor the config does not explain
is an error. Weights stored as float8_e4m3fn with a DeepSeek block scale
``<name>_scale_inv`` (one f32 per 128x128 block) are dequantised on import.

The loader refuses to guess: the parameter dtype is the one asked for or declared,
else the tensors' own (when they agree); narrowing conversions must be asked for; and
every unreadable or inconsistent file is a :class:`CheckpointError` naming it.
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import json
import logging
import math
import os
import re
import struct
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from mlkit.checkpoint.errors import CheckpointError, read_json
from mlkit.config import ModelConfig, RopeScaling
from mlkit.model.params import check_params, param_specs
from mlkit.quant import dequantize

log = logging.getLogger(__name__)

ARCHITECTURE = "DeepseekV3ForCausalLM"
MODEL_TYPES = ("deepseek_v3", "kimi_k2")
# GLM 5.x: DeepSeek-V3's layout plus DeepSeek Sparse Attention (an indexer per layer).
GLM_ARCHITECTURE = "GlmMoeDsaForCausalLM"
GLM_MODEL_TYPE = "glm_moe_dsa"
# DeepSeek-V3.2: the same sparse attention on every layer, its indexer rope in halves.
V32_ARCHITECTURE = "DeepseekV32ForCausalLM"
V32_MODEL_TYPE = "deepseek_v32"
# Sparse-attention layouts: architecture -> (model_type, indexer rope interleaved,
# whether config.json may give a per-layer indexer schedule).
_SPARSE_LAYOUTS = {GLM_ARCHITECTURE: (GLM_MODEL_TYPE, True, True),
                   V32_ARCHITECTURE: (V32_MODEL_TYPE, False, False)}
CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_FP8_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
              "BOOL": np.bool_}

_ATTN = {"wq": "q_proj.weight", "wq_a": "q_a_proj.weight", "q_norm": "q_a_layernorm.weight",
         "wq_b": "q_b_proj.weight", "wkv_a": "kv_a_proj_with_mqa.weight",
         "kv_norm": "kv_a_layernorm.weight", "wkv_b": "kv_b_proj.weight", "wo": "o_proj.weight",
         "indexer_wq_b": "indexer.wq_b.weight", "indexer_wk": "indexer.wk.weight",
         "indexer_k_norm": "indexer.k_norm.weight", "indexer_k_bias": "indexer.k_norm.bias",
         "indexer_weights_proj": "indexer.weights_proj.weight"}
_FFN = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_LOAD = "load_hf_checkpoint"


# ----------------------------------------------------------------------------- config


def _dtype_name(value, field: str) -> str:
  """'bfloat16' / 'float32' from an HF dtype string or a numpy/jax dtype."""
  aliases = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}
  if isinstance(value, str):
    name = value.removeprefix("torch.")
  else:
    try:
      name = jnp.dtype(value).name
    except TypeError:
      name = repr(value)
  if name not in aliases:
    raise ValueError(f"{field}: unsupported dtype {value!r} (supported: bfloat16, float32)")
  return aliases[name]


def _declared_dtype(hf_config: dict):
  """The parameter dtype config.json declares (``torch_dtype``, or ``dtype`` in newer exports), or None."""
  declared = hf_config.get("torch_dtype")
  return hf_config.get("dtype") if declared is None else declared


def _sparse_attention_fields(hf_config: dict, req_int, arch: str) -> dict:
  """The indexer fields of GLM 5 or DeepSeek-V3.2: heads, head dim, top-k, per-layer schedule.

  GLM: ``indexer_types`` is read when given; otherwise it is derived as
  transformers does, from ``index_topk_pattern`` ("F"/"S" per layer) or from
  ``index_topk_freq`` and ``index_skip_topk_offset`` (defaults 1 and 2: every
  layer full). DeepSeek-V3.2 runs the indexer on every layer.
  """
  n = req_int("num_hidden_layers")
  _, interleave, scheduled = _SPARSE_LAYOUTS[arch]
  types = hf_config.get("indexer_types") if scheduled else ["full"] * n
  if types is None:
    pattern = hf_config.get("index_topk_pattern")
    if pattern is not None:
      if isinstance(pattern, str):
        if set(pattern) - set("FS"):
          raise ValueError(f"config_from_hf: index_topk_pattern {pattern!r} must use only 'F' and 'S'")
        types = [{"F": "full", "S": "shared"}[c] for c in pattern]
      else:
        types = list(pattern)
    else:
      freq = max(int(hf_config.get("index_topk_freq", 1) or 1), 1)
      offset = int(hf_config.get("index_skip_topk_offset", 2))
      types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
  if not isinstance(types, (list, tuple)) or any(t not in ("full", "shared") for t in types):
    raise ValueError(f"config_from_hf: indexer_types must be a list of 'full'/'shared', got {types!r}")
  if len(types) != n:
    raise ValueError(f"config_from_hf: indexer_types has {len(types)} entries, num_hidden_layers "
                     f"is {n}")
  return dict(index_n_heads=req_int("index_n_heads"), index_head_dim=req_int("index_head_dim"),
              index_topk=req_int("index_topk"), indexer_types=tuple(types),
              index_rope_interleave=interleave)


def config_from_hf(hf_config: dict, *, dtype=None) -> ModelConfig:
  """Builds a ModelConfig from a DeepSeek-V3 / Kimi-K2 / GLM-5 / DeepSeek-V3.2 ``config.json`` dict.

  Both layouts are read: the classic one (top-level ``rope_theta``, ``rope_scaling``)
  and the one transformers 5 writes (``rope_parameters``, ``mlp_layer_types``,
  ``dtype``).

  Args:
    hf_config: the parsed ``config.json``.
    dtype: parameter/compute dtype override ("bfloat16", "float32" or a dtype);
      default: the config's ``torch_dtype`` (or ``dtype``). There is no default
      beyond that: :func:`load_hf_checkpoint` passes the stored tensors' dtype.

  Returns:
    The ModelConfig (MLA attention, one MoE layer per layer after the dense prefix).

  Raises:
    ValueError: an unsupported ``architectures``/``model_type``/``moe_layer_freq``/
      ``hidden_act``/``scoring_func``/``rope_scaling``/``rope_parameters``/
      ``mlp_layer_types``, a missing required field, no
      dtype at all (neither ``dtype`` nor ``torch_dtype``/``dtype`` in the config), or
      inconsistent values; the message names the HF field.
  """
  if not isinstance(hf_config, dict):
    raise ValueError(f"config_from_hf: expected a dict, got {type(hf_config).__name__}")
  arch = hf_config.get("architectures")
  known = (ARCHITECTURE, *_SPARSE_LAYOUTS)
  if not isinstance(arch, (list, tuple)) or not set(known) & set(arch):
    raise ValueError(f"config_from_hf: unsupported architectures {arch!r}; expected a list containing "
                     f"one of {known}")
  sparse_arch = next((a for a in arch if a in _SPARSE_LAYOUTS), None)
  model_type = hf_config.get("model_type")
  types = (_SPARSE_LAYOUTS[sparse_arch][0],) if sparse_arch else MODEL_TYPES
  if model_type is not None and model_type not in types:
    raise ValueError(f"config_from_hf: unsupported model_type {model_type!r} for {arch!r}; expected "
                     f"one of {types}")

  def req(name: str):
    if name not in hf_config or hf_config[name] is None:
      raise ValueError(f"config_from_hf: missing required field {name!r}")
    return hf_config[name]

  def req_int(name: str) -> int:
    v = req(name)
    if not isinstance(v, int) or isinstance(v, bool):
      raise ValueError(f"config_from_hf: field {name!r} must be an int, got {v!r}")
    return v

  def num(name: str, v) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
      raise ValueError(f"config_from_hf: field {name!r} must be a number, got {v!r}")
    return float(v)

  if "q_lora_rank" not in hf_config:  # present-but-null means a full-rank query projection
    raise ValueError("config_from_hf: missing required field 'q_lora_rank' (null means none)")
  q_lora = hf_config["q_lora_rank"]
  if q_lora is not None and (not isinstance(q_lora, int) or isinstance(q_lora, bool)):
    raise ValueError(f"config_from_hf: field 'q_lora_rank' must be an int or null, got {q_lora!r}")

  freq = hf_config.get("moe_layer_freq", 1)
  if freq != 1:
    raise ValueError(f"config_from_hf: moe_layer_freq={freq!r} is not supported (only 1: every layer "
                     "after first_k_dense_replace is MoE)")
  act = hf_config.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"config_from_hf: hidden_act={act!r} is not supported (only 'silu')")
  scoring = hf_config.get("scoring_func", "sigmoid")
  if scoring not in ("sigmoid", "softmax"):
    raise ValueError(f"config_from_hf: scoring_func={scoring!r} is not supported ('sigmoid' or 'softmax')")

  # Rope: the classic layout has a top-level rope_theta and an optional rope_scaling
  # dict; transformers 5 writes one rope_parameters dict holding both (rope_type,
  # rope_theta and the YaRN fields). Either is read; when both are given they must agree.
  rp = hf_config.get("rope_parameters")
  if rp is not None and not isinstance(rp, dict):
    raise ValueError(f"config_from_hf: rope_parameters must be a dict or null, got {rp!r}")
  rope_theta = hf_config.get("rope_theta")
  if rp is not None and rp.get("rope_theta") is not None:
    if rope_theta is not None and num("rope_theta", rope_theta) != num("rope_parameters.rope_theta",
                                                                        rp["rope_theta"]):
      raise ValueError(f"config_from_hf: rope_theta {rope_theta!r} and rope_parameters.rope_theta "
                       f"{rp['rope_theta']!r} disagree")
    rope_theta = rp["rope_theta"]
  if rope_theta is None:
    raise ValueError("config_from_hf: missing required field 'rope_theta' (top level or in "
                     "'rope_parameters')")
  rs, rs_field = hf_config.get("rope_scaling"), "rope_scaling"
  if rs is None and rp is not None:
    rs, rs_field = rp, "rope_parameters"
  rope_scaling = None
  if rs is not None:
    if not isinstance(rs, dict):
      raise ValueError(f"config_from_hf: rope_scaling must be a dict or null, got {rs!r}")
    kind = rs.get("type", rs.get("rope_type", "default"))
    if kind == "yarn":
      if "factor" not in rs:
        raise ValueError(f"config_from_hf: missing required field '{rs_field}.factor'")
      # Defaults are those of DeepSeek-V3's reference modelling code.
      rope_scaling = RopeScaling(
          factor=num(f"{rs_field}.factor", rs["factor"]),
          original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 4096)),
          beta_fast=num(f"{rs_field}.beta_fast", rs.get("beta_fast", 32)),
          beta_slow=num(f"{rs_field}.beta_slow", rs.get("beta_slow", 1)),
          mscale=num(f"{rs_field}.mscale", rs.get("mscale", 1)),
          mscale_all_dim=num(f"{rs_field}.mscale_all_dim", rs.get("mscale_all_dim", 0)))
    elif kind != "default":
      raise ValueError(f"config_from_hf: {rs_field} type {kind!r} is not supported (only 'yarn')")

  # transformers 5 also writes mlp_layer_types ("dense" / "sparse" per layer); this model
  # runs dense layers first, then MoE layers, as first_k_dense_replace says.
  mlp_types = hf_config.get("mlp_layer_types")
  if mlp_types is not None:
    if (not isinstance(mlp_types, (list, tuple))
        or any(t not in ("dense", "sparse") for t in mlp_types)):
      raise ValueError(f"config_from_hf: mlp_layer_types must be a list of 'dense'/'sparse', "
                       f"got {mlp_types!r}")
    n_dense = mlp_types.count("dense")
    if list(mlp_types) != ["dense"] * n_dense + ["sparse"] * (len(mlp_types) - n_dense):
      raise ValueError(f"config_from_hf: mlp_layer_types {mlp_types!r} is not supported (only dense "
                       "layers first, then MoE layers)")
    if hf_config.get("first_k_dense_replace") is None:
      hf_config = {**hf_config, "first_k_dense_replace": n_dense}
    elif hf_config["first_k_dense_replace"] != n_dense:
      raise ValueError(f"config_from_hf: mlp_layer_types has {n_dense} dense layers, "
                       f"first_k_dense_replace says {hf_config['first_k_dense_replace']!r}")
    if len(mlp_types) != hf_config.get("num_hidden_layers"):
      raise ValueError(f"config_from_hf: mlp_layer_types has {len(mlp_types)} entries, "
                       f"num_hidden_layers is {hf_config.get('num_hidden_layers')!r}")

  first_k = req_int("first_k_dense_replace")
  dense_ffn = req_int("intermediate_size") if first_k > 0 else int(hf_config.get("intermediate_size") or 0)
  if dtype is not None:
    dt = _dtype_name(dtype, "load dtype")
  else:
    declared = _declared_dtype(hf_config)
    if declared is None:
      raise ValueError("config_from_hf: config.json declares no 'torch_dtype' (or 'dtype'); pass dtype=")
    dt = _dtype_name(declared, "torch_dtype")
  # How many layers after the last are multi-token-prediction layers (skipped on load).
  mtp = hf_config.get("num_nextn_predict_layers") or 0
  if not isinstance(mtp, int) or isinstance(mtp, bool) or mtp < 0:
    raise ValueError(f"config_from_hf: field 'num_nextn_predict_layers' must be a non-negative int, "
                     f"got {mtp!r}")
  sparse = _sparse_attention_fields(hf_config, req_int, sparse_arch) if sparse_arch else {}
  fields = dict(
      name=str(hf_config.get("_name_or_path") or model_type or "deepseek_v3"),
      vocab_size=req_int("vocab_size"),
      d_model=req_int("hidden_size"),
      n_layers=req_int("num_hidden_layers"),
      n_heads=req_int("num_attention_heads"),
      attention="mla",
      q_lora_rank=q_lora or 0,
      kv_lora_rank=req_int("kv_lora_rank"),
      qk_nope_head_dim=req_int("qk_nope_head_dim"),
      qk_rope_head_dim=req_int("qk_rope_head_dim"),
      v_head_dim=req_int("v_head_dim"),
      dense_ffn_dim=dense_ffn,
      moe_ffn_dim=req_int("moe_intermediate_size"),
      n_routed_experts=req_int("n_routed_experts"),
      n_shared_experts=req_int("n_shared_experts"),
      top_k=req_int("num_experts_per_tok"),
      first_k_dense=first_k,
      router=scoring,
      routed_scaling_factor=num("routed_scaling_factor", req("routed_scaling_factor")),
      norm_topk_prob=bool(req("norm_topk_prob")),
      n_group=req_int("n_group"),
      topk_group=req_int("topk_group"),
      rope_theta=num("rope_theta", rope_theta),
      rope_scaling=rope_scaling,
      # GLM's and V3.2's modelling code always rotates MLA's rope dims as interleaved pairs.
      rope_interleave=True if sparse_arch else bool(hf_config.get("rope_interleave", True)),
      rms_norm_eps=num("rms_norm_eps", req("rms_norm_eps")),
      tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
      max_seq_len=req_int("max_position_embeddings"),
      dtype=dt,
      param_dtype=dt,
      n_mtp_layers=mtp,
      # transformers builds the query/KV latent norms with its default eps, 1e-6.
      latent_norm_eps=None if num("rms_norm_eps", req("rms_norm_eps")) == 1e-6 else 1e-6,
      **sparse,
  )
  try:
    return ModelConfig(**fields)
  except ValueError as e:
    raise ValueError(f"config_from_hf: inconsistent config.json: {e}") from e


def config_to_hf(cfg: ModelConfig) -> dict:
  """The ``config.json`` dict for an MLA ModelConfig.

  DeepseekV3ForCausalLM, or GlmMoeDsaForCausalLM (transformers-5 layout) for a
  config that runs sparse attention (``indexer_types``).

  Raises:
    ValueError: ``cfg`` is GQA, declares an indexer it does not run (no HF layout
      holds that), or has latent-norm / rope settings the layout cannot express.
  """
  if cfg.attention != "mla":
    raise ValueError(f"config_to_hf: attention={cfg.attention!r}; the DeepSeek-V3 layout needs 'mla'")
  if cfg.index_n_heads and not cfg.sparse_attention:
    raise ValueError("config_to_hf: index_n_heads > 0 without indexer_types (an indexer counted, "
                     "not run) has no Hugging Face layout")
  if cfg.latent_eps != 1e-6:
    raise ValueError(f"config_to_hf: transformers builds the query/KV latent norms with eps 1e-6, "
                     f"this config uses {cfg.latent_eps} (set latent_norm_eps=1e-6)")
  common = {
      "_name_or_path": cfg.name,
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model,
      "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_heads,
      "q_lora_rank": cfg.q_lora_rank or None,
      "kv_lora_rank": cfg.kv_lora_rank,
      "qk_nope_head_dim": cfg.qk_nope_head_dim,
      "qk_rope_head_dim": cfg.qk_rope_head_dim,
      "v_head_dim": cfg.v_head_dim,
      "intermediate_size": cfg.dense_ffn_dim,
      "moe_intermediate_size": cfg.moe_ffn_dim,
      "n_routed_experts": cfg.n_routed_experts,
      "n_shared_experts": cfg.n_shared_experts,
      "num_experts_per_tok": cfg.top_k,
      "first_k_dense_replace": cfg.first_k_dense,
      "routed_scaling_factor": cfg.routed_scaling_factor,
      "norm_topk_prob": cfg.norm_topk_prob,
      "n_group": cfg.n_group,
      "topk_group": cfg.topk_group,
      "hidden_act": "silu",
      "rms_norm_eps": cfg.rms_norm_eps,
      "tie_word_embeddings": cfg.tie_embeddings,
      "max_position_embeddings": cfg.max_seq_len,
      "num_nextn_predict_layers": cfg.n_mtp_layers,
  }
  rs = cfg.rope_scaling
  if cfg.sparse_attention:
    arch = GLM_ARCHITECTURE if cfg.index_rope_interleave else V32_ARCHITECTURE
    return {"architectures": [arch], "model_type": _SPARSE_LAYOUTS[arch][0], **common,
            **_sparse_fields(cfg, arch), "dtype": cfg.param_dtype}
  return {
      "architectures": [ARCHITECTURE],
      "model_type": "deepseek_v3",
      **common,
      "moe_layer_freq": 1,
      "scoring_func": cfg.router,
      "topk_method": "noaux_tc" if cfg.router == "sigmoid" else "greedy",
      "rope_theta": cfg.rope_theta,
      "rope_scaling": None if rs is None else {"type": "yarn", **dataclasses.asdict(rs)},
      "rope_interleave": cfg.rope_interleave,
      "torch_dtype": cfg.param_dtype,
  }


def _sparse_fields(cfg: ModelConfig, arch: str) -> dict:
  """GLM 5's or DeepSeek-V3.2's own config fields (transformers 5: rope_parameters, layer lists).

  The indexer's rope layout picks the architecture: interleaved pairs are GLM's,
  halves DeepSeek-V3.2's (which runs the indexer on every layer).
  """
  if not cfg.rope_interleave:
    raise ValueError(f"config_to_hf: {arch} rotates MLA's rope dims as interleaved pairs "
                     "(rope_interleave must be True)")
  if arch == V32_ARCHITECTURE and "shared" in cfg.indexer_types:
    raise ValueError("config_to_hf: an indexer rope in halves is DeepSeek-V3.2's layout, which runs "
                     "the indexer on every layer; this config has shared layers")
  if cfg.router != "sigmoid":
    raise ValueError(f"config_to_hf: {arch}'s router is sigmoid, got {cfg.router!r}")
  rs = cfg.rope_scaling
  rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  if rs is not None:
    rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, **dataclasses.asdict(rs)}
  return {
      "mlp_layer_types": ["dense" if i < cfg.first_k_dense else "sparse" for i in range(cfg.n_layers)],
      "rope_parameters": rope,
      "index_n_heads": cfg.index_n_heads,
      "index_head_dim": cfg.index_head_dim,
      "index_topk": cfg.index_topk,
      **({"indexer_types": list(cfg.indexer_types)} if arch == GLM_ARCHITECTURE else {}),
  }


# ----------------------------------------------------------------------------- layout


@dataclasses.dataclass(frozen=True)
class _Target:
  """One leaf of our params and the HF tensor(s) it comes from."""

  path: tuple  # keys into our params tree, e.g. ("layers", 1, "ffn", "w_gate")
  names: tuple[str, ...]  # one HF tensor, or one per expert (stacked along axis 0)
  hf_shape: tuple[int, ...]  # shape of each HF tensor
  kind: str  # "copy", "T" (transpose) or "stack" (transpose each expert, then stack)
  dtype: str | None  # fixed storage dtype (router in f32), or None for the model's param dtype


def _is_spec(x) -> bool:
  return isinstance(x, tuple) and len(x) in (2, 3) and isinstance(x[0], tuple)


def _key(k):
  return k.key if isinstance(k, jax.tree_util.DictKey) else k.idx


def _hf_names(path: tuple, cfg: ModelConfig, shape: tuple[int, ...]) -> tuple[str, ...]:
  if path[0] == "embed":
    return ("model.embed_tokens.weight",)
  if path[0] == "final_norm":
    return ("model.norm.weight",)
  if path[0] == "lm_head":
    return ("lm_head.weight",)
  i, group = path[1], path[2]
  pre = f"model.layers.{i}."
  if group == "attn_norm":
    return (pre + "input_layernorm.weight",)
  if group == "ffn_norm":
    return (pre + "post_attention_layernorm.weight",)
  if group == "attn":
    return (f"{pre}self_attn.{_ATTN[path[3]]}",)
  name = path[3]
  if not cfg.is_moe_layer(i):
    return (f"{pre}mlp.{_FFN[name]}.weight",)
  if name == "router":
    return (pre + "mlp.gate.weight",)
  if name == "router_bias":
    return (pre + "mlp.gate.e_score_correction_bias",)
  if name == "shared":
    return (f"{pre}mlp.shared_experts.{_FFN[path[4]]}.weight",)
  return tuple(f"{pre}mlp.experts.{e}.{_FFN[name]}.weight" for e in range(shape[0]))


def hf_layout(cfg: ModelConfig) -> tuple[list[_Target], Any]:
  """The HF tensors behind every leaf of ``param_specs(cfg)``, in flatten order, plus the treedef."""
  if cfg.attention != "mla":
    raise ValueError(f"hf_layout: attention={cfg.attention!r}; the DeepSeek-V3 layout needs 'mla'")
  leaves, treedef = jax.tree_util.tree_flatten_with_path(param_specs(cfg), is_leaf=_is_spec)
  targets = []
  for kpath, spec in leaves:
    path = tuple(_key(k) for k in kpath)
    shape = spec[0]
    if len(shape) == 1 or path[0] == "embed":
      kind, hf_shape = "copy", shape
    elif len(shape) == 2:
      kind, hf_shape = "T", shape[::-1]
    else:
      kind, hf_shape = "stack", shape[1:][::-1]
    targets.append(_Target(path, _hf_names(path, cfg, shape), tuple(hf_shape), kind,
                           spec[2] if len(spec) == 3 else None))
  return targets, treedef


def _path_str(path: tuple) -> str:
  return ".".join(str(p) for p in path)


# ----------------------------------------------------------------------------- reading


class _Reader:
  """Lazy access to the tensors of a (possibly sharded) safetensors checkpoint.

  Every file it opens is validated up front (safetensors checks that the header is
  complete and that the data covers every tensor), and every failure is a
  :class:`CheckpointError` naming the file.
  """

  def __init__(self, path: str):
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
      # The index is authoritative: tensors in the shards that it does not list are ignored.
      weight_map = read_json(_LOAD, index).get("weight_map")
      if not isinstance(weight_map, dict):
        raise CheckpointError(_LOAD, index, f"has no 'weight_map' object (got {type(weight_map).__name__})")
      for k, v in weight_map.items():
        if not isinstance(v, str) or not v or os.path.basename(v) != v:
          raise CheckpointError(_LOAD, index, f"weight_map[{k!r}] must be a file name in {path}, got {v!r}")
      for fname in sorted(set(weight_map.values())):
        if not os.path.exists(os.path.join(path, fname)):
          raise FileNotFoundError(f"{_LOAD}: shard {fname} listed in {index} is missing")
      self._where = {k: os.path.join(path, v) for k, v in weight_map.items()}
      files = sorted(set(self._where.values()))
    else:
      self._where = {}
      files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
      if not files:
        raise FileNotFoundError(f"{_LOAD}: no *.safetensors files in {path}")
    self._handles = {}
    for f in files:
      try:
        self._handles[f] = safe_open(f, framework="numpy")
      except Exception as e:  # SafetensorError (truncated, bad header) or OSError
        raise CheckpointError(_LOAD, f, f"not a readable safetensors file ({e})") from e
    self._headers: dict[str, dict] = {}
    self.bytes_read = 0  # tensor bytes read from the files so far
    keys = {f: set(h.keys()) for f, h in self._handles.items()}
    if os.path.exists(index):
      for k, fname in self._where.items():
        if k not in keys[fname]:
          raise CheckpointError(_LOAD, fname, f"tensor {k} is listed in {INDEX_FILE} but missing from "
                                              "this file")
    else:
      for fname in files:
        for k in keys[fname]:
          if k in self._where:
            raise CheckpointError(_LOAD, fname, f"tensor {k} appears in both "
                                                f"{os.path.basename(self._where[k])} and this file")
          self._where[k] = fname

  def names(self) -> set[str]:
    return set(self._where)

  def has(self, name: str) -> bool:
    return name in self._where

  def file(self, name: str) -> str:
    """The file holding tensor ``name``."""
    return self._where[name]

  def _slice(self, name):
    return self._handles[self._where[name]].get_slice(name)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._slice(name).get_shape())

  def st_dtype(self, name: str) -> str:
    return self._slice(name).get_dtype()

  def nbytes(self, name: str) -> int:
    """Stored bytes of tensor ``name`` (from the header)."""
    size = {"F64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2}.get(self.st_dtype(name), 1)
    return size * math.prod(self.shape(name))

  def get(self, name: str, box: tuple[tuple[int, int], ...] | None = None) -> np.ndarray:
    """Tensor ``name``, or only its ``box`` (a ``(start, stop)`` per axis) read from the file."""
    st = self.st_dtype(name)
    dtype = _FP8_DTYPES.get(st) or _ST_DTYPES.get(st)
    if dtype is None:
      raise CheckpointError(_LOAD, self._where[name], f"tensor {name} has dtype {st}, which "
                                                     "this loader does not read")
    return self._read_raw(name, np.dtype(dtype), box)

  def _header(self, fname: str) -> dict:
    if fname not in self._headers:
      with open(fname, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        self._headers[fname] = {"_base": 8 + n, **json.loads(f.read(n))}
    return self._headers[fname]

  def _read_raw(self, name: str, dtype: np.dtype, box) -> np.ndarray:
    # Plain reads, not safetensors' memory map: mapped file pages count in the process's
    # resident memory until unmapped, so reading a whole checkpoint through the map
    # would hold all of it (docs/checkpoints.md). Also, safetensors' numpy backend cannot
    # build float8 arrays. Format: u64 header length, JSON header with data_offsets, data.
    # A box is read as its contiguous runs only (docs/checkpoints.md, "Multi-process loading").
    fname = self._where[name]
    try:
      hdr = self._header(fname)
      shape = tuple(hdr[name]["shape"])
      start, end = hdr[name]["data_offsets"]
      if end - start != dtype.itemsize * math.prod(shape):
        raise ValueError(f"data_offsets span {end - start} bytes, the shape needs "
                         f"{dtype.itemsize * math.prod(shape)}")
      box = tuple((0, d) for d in shape) if box is None else tuple(box)
      out_shape = tuple(b - a for a, b in box)
      out = bytearray(dtype.itemsize * math.prod(out_shape))
      if out:
        strides = [dtype.itemsize * math.prod(shape[a + 1:]) for a in range(len(shape))]
        # The last axis the box cuts: each run spans it (and every whole axis after it).
        k = max([a for a in range(len(shape)) if box[a] != (0, shape[a])], default=0)
        run = (box[k][1] - box[k][0]) * strides[k] if shape else dtype.itemsize
        view, pos = memoryview(out), 0
        with open(fname, "rb", buffering=0) as f:
          fd = f.fileno()
          for prefix in itertools.product(*(range(a, b) for a, b in box[:k])):
            off = hdr["_base"] + start + sum(i * st for i, st in zip(prefix, strides))
            off += box[k][0] * strides[k] if shape else 0
            _pread_into(fd, view[pos:pos + run], off)
            pos += run
        self.bytes_read += len(out)
      return np.frombuffer(out, dtype=np.uint8).view(dtype).reshape(out_shape)
    except (OSError, ValueError, KeyError, struct.error) as e:
      raise CheckpointError(_LOAD, fname, f"cannot read tensor {name} ({e})") from e


def _pread_into(fd: int, view: memoryview, off: int) -> None:
  """Fills ``view`` from ``fd`` at offset ``off`` (a read may return less than asked)."""
  while len(view):
    n = os.preadv(fd, [view], off)
    if n <= 0:
      raise ValueError(f"file ends at byte {off} (truncated)")
    view, off = view[n:], off + n


def _check_fp8_scales(shape, scale_shape, block: tuple[int, int], name: str) -> None:
  if len(shape) != 2:
    raise ValueError(f"{name}: fp8 block scales need a 2-D weight, got shape {tuple(shape)}")
  bo, bi = block
  expected = (math.ceil(shape[0] / bo), math.ceil(shape[1] / bi))
  if tuple(scale_shape) != expected:
    raise ValueError(f"{name}_scale_inv: expected shape {expected} for weight {tuple(shape)} with "
                     f"{bo}x{bi} blocks, got {tuple(scale_shape)}")


def dequantize_fp8_blocks(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = (128, 128),
                          *, name: str = "weight") -> np.ndarray:
  """DeepSeek fp8 block dequantisation: ``w * scale_inv`` broadcast over [bo, bi] blocks.

  Args:
    w: fp8 weight [out, in].
    scale_inv: one f32 multiplier per block [ceil(out/bo), ceil(in/bi)].
    block: block shape (bo, bi).
    name: tensor name for error messages.

  Returns:
    The f32 weight [out, in].
  """
  _check_fp8_scales(w.shape, scale_inv.shape, block, name)
  bo, bi = block
  s = np.repeat(np.repeat(scale_inv.astype(np.float32), bo, axis=0), bi, axis=1)
  return w.astype(np.float32) * s[:w.shape[0], :w.shape[1]]


# Stored dtypes whose conversion to a parameter dtype loses nothing (fp8 weights are
# dequantised through f32, so they are never a silent narrowing either).
_LOSSLESS = {("BF16", "bfloat16"), ("BF16", "float32"), ("F16", "float32"), ("F32", "float32")}
_ST_NAMES = {"BF16": "bfloat16", "F32": "float32"}


def _resolve_dtype(path: str, cfg_file: str, chosen: str | None, explicit: bool, reader: _Reader,
                   targets: list[_Target]) -> str:
  """The parameter dtype to load into (see :func:`load_hf_checkpoint`, "Dtype").

  Args:
    path / cfg_file: the checkpoint directory and its config.json, for messages.
    chosen: the dtype ``dtype=`` or config.json names, or None if neither does.
    explicit: ``chosen`` comes from ``dtype=`` (narrowing is then allowed, and logged).
    reader / targets: the tensors and the leaves they fill.
  """
  stored = {}  # safetensors dtype -> first tensor stored in it (tensors of the param dtype)
  for t in targets:
    for n in t.names:
      st = reader.st_dtype(n)
      if st not in _FP8_DTYPES and t.dtype is None:
        stored.setdefault(st, n)
  if chosen is None:
    if len(stored) != 1:
      found = ", ".join(f"{n} is {st}" for st, n in sorted(stored.items()))
      raise CheckpointError(_LOAD, cfg_file, f"declares no 'torch_dtype' and the tensors disagree "
                                             f"({found}); pass dtype= to choose one")
    (st, n), = stored.items()
    if st not in _ST_NAMES:
      raise CheckpointError(_LOAD, reader.file(n), f"config.json declares no 'torch_dtype' and the "
                                                   f"tensors are {st} (e.g. {n}); pass dtype='bfloat16' "
                                                   "or 'float32'")
    log.info("%s: %s declares no torch_dtype; using the tensors' own dtype %s", _LOAD, cfg_file,
             _ST_NAMES[st])
    return _ST_NAMES[st]
  narrowed = []
  for t in targets:
    want = t.dtype or chosen
    narrowed += [(n, reader.st_dtype(n), want) for n in t.names
                 if reader.st_dtype(n) not in _FP8_DTYPES and (reader.st_dtype(n), want) not in _LOSSLESS]
  if narrowed and not explicit:
    n, st, want = narrowed[0]
    raise CheckpointError(_LOAD, reader.file(n), f"tensor {n} is {st} but config.json declares "
                                                 f"torch_dtype {want}; converting {len(narrowed)} "
                                                 f"tensor(s) to it loses precision: pass dtype='{want}' "
                                                 "to convert explicitly (or dtype='float32')")
  if narrowed:
    n, st, want = narrowed[0]
    log.warning("%s: %s: converting %d tensor(s) to the narrower dtype %s as dtype= asks (e.g. %s "
                "is %s)", _LOAD, path, len(narrowed), want, n, st)
  return chosen


def load_hf_checkpoint(path: str | os.PathLike, *, dtype=None, recipe=None, mesh=None,
                       rules=None, int4_layout: str = "kn"):
  """Loads a DeepSeek-V3 / Kimi-K2 Hugging Face checkpoint into our params tree.

  Streaming: the checkpoint is read one parameter at a time (an expert stack is
  one parameter). Each is quantised as it is read (``recipe``), and with a
  ``mesh`` its shards go straight onto their devices, so host memory holds the
  parameter being read and converted, never the whole tree. Progress (bytes
  read, rate) is logged every few seconds. In a multi-process run each process
  reads only the parts of each parameter that its own devices hold (the whole
  of a replicated one; docs/checkpoints.md, "Multi-process loading").

  Dtype: the parameters are stored in ``dtype`` if given, else in config.json's
  ``torch_dtype`` (or ``dtype``), else in the stored tensors' own dtype when they all
  agree (router weights and bias are always f32; fp8 weights are dequantised). A
  conversion that loses precision (an f32 tensor into bf16) is never silent: it must
  be asked for with ``dtype=``, and is logged.

  Layers: the checkpoint's layers must be those of ``num_hidden_layers``; only the
  multi-token-prediction layers config.json declares (indices ``num_hidden_layers``
  to ``num_hidden_layers + num_nextn_predict_layers - 1``) are skipped.

  Args:
    path: directory with ``config.json`` and ``*.safetensors`` (single or sharded with
      ``model.safetensors.index.json``).
    dtype: parameter dtype ("bfloat16"/"float32"); see "Dtype" above.
    recipe: a ``mlkit.quant.Recipe`` applied leaf by leaf as it is read (round to
      nearest; GPTQ needs calibration activations and is refused here), or None
      to keep the weights dense.
    mesh: place every parameter's shards on this mesh as it is read (by
      ``mlkit.parallel.param_shardings`` with ``rules``), or None for the
      default device.
    rules: logical-axis rules with ``mesh`` (default ``mlkit.parallel.DEFAULT_RULES``).
    int4_layout: the recipe's int4 weights' layout: "kn" (packed, as checkpoints
      hold them) or "nk" (what the GPU kernels read, ``mlkit.quant.
      kernel_int4_layout()``), relaid after loading one leaf at a time, each
      packed copy freed before the next.

  Returns:
    (params, cfg): params laid out as ``init_params(cfg)`` (router weights/bias in f32),
    quantised by ``recipe`` and placed on ``mesh`` when given.

  Raises:
    FileNotFoundError: the directory, ``config.json``, a shard or all safetensors are missing.
    CheckpointError: (a ValueError) naming the file: invalid JSON in config.json or the
      index, a bad config field, a truncated or corrupt safetensors file, a missing
      tensor, a wrong shape (with expected and actual shapes), unexpected tensor names,
      a layer beyond the config's layers and declared MTP layers, tensors whose dtypes
      disagree when no dtype is declared, or a narrowing conversion not asked for.
    ValueError: a recipe that does not fit the model or asks for GPTQ; rules without a
      mesh; an unknown int4_layout (before anything is read).
  """
  from mlkit.quant.formats import INT4_LAYOUTS, relaid_int4
  if int4_layout not in INT4_LAYOUTS:
    raise ValueError(f"{_LOAD}: int4_layout must be one of {INT4_LAYOUTS}, got {int4_layout!r}")
  params, cfg = open_hf_checkpoint(path, dtype=dtype, recipe=recipe, mesh=mesh,
                                   rules=rules).load()
  return relaid_int4(params, int4_layout, free_source=True), cfg


def open_hf_checkpoint(path: str | os.PathLike, *, dtype=None, recipe=None, mesh=None,
                       rules=None) -> "HFCheckpoint":
  """Opens and checks a checkpoint for :func:`load_hf_checkpoint`, reading no tensor yet.

  Everything that can be checked from config.json and the safetensors headers is
  checked here (names, shapes, dtypes, the recipe's formats, the shardings), so
  that a conversion fails before its first read. Arguments, returns and errors
  are those of :func:`load_hf_checkpoint`; the parameters are then read one at
  a time with :meth:`HFCheckpoint.leaf` (what ``mlkit.convert`` does, skipping
  those already converted) or all together with :meth:`HFCheckpoint.load`.
  """
  if rules is not None and mesh is None:
    raise ValueError(f"{_LOAD}: rules= needs a mesh=")
  path = os.fspath(path)
  if not os.path.isdir(path):
    raise FileNotFoundError(f"{_LOAD}: {path} is not a directory")
  cfg_file = os.path.join(path, CONFIG_FILE)
  if not os.path.exists(cfg_file):
    raise FileNotFoundError(f"{_LOAD}: {cfg_file} is missing")
  hf_config = read_json(_LOAD, cfg_file)
  declared = dtype is not None or _declared_dtype(hf_config) is not None
  try:
    # The layout does not depend on the dtype; without a declared one it comes from the tensors.
    cfg = config_from_hf(hf_config, dtype=dtype if declared else "float32")
  except ValueError as e:
    raise CheckpointError(_LOAD, cfg_file, str(e)) from e
  qcfg = hf_config.get("quantization_config") or {}
  block = qcfg.get("weight_block_size", (128, 128)) if isinstance(qcfg, dict) else None
  if (not isinstance(block, (list, tuple)) or len(block) != 2
      or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
    raise CheckpointError(_LOAD, cfg_file, "quantization_config must be an object whose "
                                           f"weight_block_size is two positive ints, got {qcfg!r}")
  block = tuple(block)

  reader = _Reader(path)
  targets, treedef = hf_layout(cfg)
  expected = {n for t in targets for n in t.names}
  present = reader.names()
  mtp = range(cfg.n_layers, cfg.n_layers + cfg.n_mtp_layers)
  skipped_mtp, unexpected = [], []
  for n in sorted(present - expected):
    base = n.removesuffix("_scale_inv")
    m = _LAYER_RE.match(n)
    if m and int(m.group(1)) in mtp:
      skipped_mtp.append(n)  # multi-token-prediction layers are not part of the serving model
    elif m and int(m.group(1)) >= cfg.n_layers:
      raise CheckpointError(_LOAD, reader.file(n), f"tensor {n} belongs to layer {m.group(1)}, but "
                                                   f"config.json declares num_hidden_layers={cfg.n_layers} "
                                                   f"and num_nextn_predict_layers={cfg.n_mtp_layers}")
    elif n.endswith("rotary_emb.inv_freq"):
      continue  # a recomputable buffer some exporters include
    elif n.endswith("_scale_inv") and base in expected:
      continue  # consumed with its weight below
    else:
      unexpected.append(n)
  if unexpected:
    raise CheckpointError(_LOAD, reader.file(unexpected[0]),
                          f"unexpected tensor(s) {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} "
                          f"({len(unexpected)} in all) for this config")
  if skipped_mtp:
    log.info("%s: skipped %d multi-token-prediction tensors (layers %d..%d)", _LOAD,
             len(skipped_mtp), mtp.start, mtp.stop - 1)
  for t in targets:
    for n in t.names:
      if n not in present:
        raise CheckpointError(_LOAD, path, f"missing tensor {n} (for {_path_str(t.path)})")
      shape = reader.shape(n)
      if shape != t.hf_shape:
        raise CheckpointError(_LOAD, reader.file(n), f"tensor {n} has shape {shape}, expected {t.hf_shape}")
  dt = _resolve_dtype(path, cfg_file, cfg.param_dtype if declared else None, dtype is not None,
                      reader, targets)
  cfg = dataclasses.replace(cfg, dtype=dt, param_dtype=dt)
  return HFCheckpoint(path, cfg, reader, targets, treedef, block,
                      _LeafConverter(targets, treedef, cfg, recipe, mesh, rules))


class HFCheckpoint:
  """A checked Hugging Face checkpoint whose parameters are read one at a time.

  Made by :func:`open_hf_checkpoint`. Leaf ``i`` is the ``i``-th leaf of the params
  tree in flatten order (``names[i]``, e.g. ``"layers.1.ffn.w_gate"``).

  Attributes:
    path: the checkpoint directory.
    cfg: the ModelConfig (with the dtype the parameters are loaded in).
    names: every leaf's dotted path, in flatten order.
    abstract: the params tree (quantised by the recipe) as ShapeDtypeStructs, with
      their shardings when a mesh was given.
    bytes_read: {leaf name: tensor bytes this process read for it} for the leaves
      read so far (in a multi-process run, only what its devices hold).
  """

  def __init__(self, path: str, cfg: ModelConfig, reader: _Reader, targets: list[_Target], treedef,
               block: tuple[int, int], convert: "_LeafConverter"):
    self.path, self.cfg = path, cfg
    self._reader, self._targets, self._treedef, self._block = reader, targets, treedef, block
    self._convert = convert
    self.names = [_path_str(t.path) for t in targets]
    self.abstract = jax.tree_util.tree_unflatten(treedef, convert.abstract)
    self.bytes_read: dict[str, int] = {}

  def __len__(self) -> int:
    return len(self._targets)

  def nbytes(self, i: int) -> int:
    """Stored bytes of the tensors behind leaf ``i`` (all of them, wherever its shards go)."""
    return sum(self._reader.nbytes(n) for n in self._targets[i].names)

  def leaf(self, i: int):
    """Reads, converts, quantises and places leaf ``i`` (only this process's part of it)."""
    t = self._targets[i]
    box = self._convert.box(i)
    out_dtype = jnp.dtype(t.dtype or self.cfg.param_dtype)
    before = self._reader.bytes_read
    if t.kind == "stack":
      (e0, e1), hf_box = box[0], box[1:][::-1]
      arr = np.stack([self._read(n, hf_box).astype(out_dtype).T for n in t.names[e0:e1]])
    else:
      arr = self._read(t.names[0], box if t.kind == "copy" else box[::-1]).astype(out_dtype)
      if t.kind == "T":
        arr = arr.T
    out = self._convert(i, arr, box)
    self.bytes_read[self.names[i]] = self._reader.bytes_read - before
    return out

  def load(self):
    """Every leaf, in order, with progress logged: ``(params, cfg)``."""
    meter = _Progress(sum(self.nbytes(i) for i in range(len(self))))
    leaves = []
    for i in range(len(self)):
      before = self._reader.bytes_read
      leaves.append(self.leaf(i))  # the host copy goes before the next parameter is read
      meter.add(self._reader.bytes_read - before)
    meter.done()
    return jax.tree_util.tree_unflatten(self._treedef, leaves), self.cfg

  def _read(self, n: str, box) -> np.ndarray:
    """Tensor ``n`` (its ``box`` of HF coordinates), fp8 dequantised."""
    reader = self._reader
    if reader.st_dtype(n) in _FP8_DTYPES:
      if not reader.has(n + "_scale_inv"):
        raise CheckpointError(_LOAD, reader.file(n), f"fp8 tensor {n} has no {n}_scale_inv block scale")
      shape = reader.shape(n)
      try:  # the whole tensor's scales, whatever part of it is read
        _check_fp8_scales(shape, reader.shape(n + "_scale_inv"), self._block, n)
      except ValueError as e:
        raise CheckpointError(_LOAD, reader.file(n + "_scale_inv"), str(e)) from e
      # Whole scale blocks: the box grows to block edges, and is cut back after.
      grown = tuple((a // b * b, min(-(-c // b) * b, d))
                    for (a, c), b, d in zip(box, self._block, shape))
      scale_box = tuple((a // b, -(-c // b)) for (a, c), b in zip(grown, self._block))
      try:
        w = dequantize_fp8_blocks(reader.get(n, grown), reader.get(n + "_scale_inv", scale_box),
                                  self._block, name=n)
      except CheckpointError:
        raise
      except ValueError as e:
        raise CheckpointError(_LOAD, reader.file(n + "_scale_inv"), str(e)) from e
      return w[tuple(slice(a - g, c - g) for (a, c), (g, _) in zip(box, grown))]
    if reader.has(n + "_scale_inv"):
      raise CheckpointError(_LOAD, reader.file(n), f"{n}_scale_inv given but {n} is "
                                                   f"{reader.st_dtype(n)}, not fp8")
    return reader.get(n, box)


def _our_shape(t: _Target) -> tuple[int, ...]:
  if t.kind == "copy":
    return t.hf_shape
  if t.kind == "T":
    return t.hf_shape[::-1]
  return (len(t.names),) + t.hf_shape[::-1]


class _LeafConverter:
  """Quantises one parameter as it is read and places its shards on the mesh.

  The formats and shardings of every leaf are worked out once, from shapes only
  (``assign_formats`` and ``param_shardings`` over ShapeDtypeStructs), so a
  recipe or rules that do not fit the model fail before anything is read.
  Quantisation runs on the host's CPU device (a device-side copy of a whole
  parameter would defeat the point of sharding it).

  With a mesh, :meth:`box` is the part of the dense parameter that this process's
  devices hold (all of it in a single-process run), grown to whole quantisation
  groups; only that part is read and quantised, and each device copies its shard
  out of it.
  """

  def __init__(self, targets, treedef, cfg: ModelConfig, recipe, mesh, rules):
    from mlkit.checkpoint.orbax_io import recipe_abstract, with_param_shardings
    from mlkit.quant.recipe import Int4Spec, quantize_leaf
    from mlkit.quant.tree import is_quantised
    self._quantize_leaf = quantize_leaf
    tree = jax.tree_util.tree_unflatten(treedef, [
        jax.ShapeDtypeStruct(_our_shape(t), jnp.dtype(t.dtype or cfg.param_dtype)) for t in targets])
    self.names = [_path_str(t.path) for t in targets]
    self.specs = [None] * len(targets)
    if recipe is not None:
      tree, specs = recipe_abstract(tree, recipe)
      self.specs = list(specs.values())  # tree order, the targets' order
      gptq = [p for p, sp in specs.items() if isinstance(sp, Int4Spec) and sp.method == "gptq"]
      if gptq:
        raise ValueError(f"{_LOAD}: recipe {recipe.name!r} uses GPTQ for {gptq[0]!r}, which needs "
                         "calibration activations; quantise after loading (mlkit.quant.gptq)")
    self.sharded = mesh is not None
    if self.sharded:
      tree = with_param_shardings(tree, mesh, rules, cfg)
    # Every leaf as the recipe leaves it (an Int4Weight / Fp8Weight of ShapeDtypeStructs).
    self.abstract = jax.tree_util.tree_leaves(tree, is_leaf=is_quantised)
    self._cpu = jax.local_devices(backend="cpu")[0]  # this process's, in a multi-process run

  def box(self, i: int) -> tuple[tuple[int, int], ...]:
    """The ``(start, stop)`` per axis of dense leaf ``i`` that this process needs."""
    a = self.abstract[i]
    shape = tuple(a.shape)  # the dense shape for quantised leaves too
    full = tuple((0, d) for d in shape)
    if not self.sharded:
      return full
    lo, hi = [d for d in shape], [0] * len(shape)
    for field, geo in zip(jax.tree_util.tree_leaves(a), _field_geometry(a)):
      for idx in field.sharding.addressable_devices_indices_map(tuple(field.shape)).values():
        for ax, (s, e) in enumerate(_dense_range(idx, field.shape, shape, geo)):
          lo[ax], hi[ax] = min(lo[ax], s), max(hi[ax], e)
    if any(l >= h for l, h in zip(lo, hi)):
      return full  # no device of this process holds any of it (or a 0-size leaf)
    units = _quant_units(a)
    return tuple((l // u * u, min(-(-h // u) * u, d)) for l, h, u, d in zip(lo, hi, units, shape))

  def __call__(self, i: int, arr: np.ndarray, box: tuple[tuple[int, int], ...]):
    """Leaf ``i`` from ``arr``, the dense values in ``box`` (see :meth:`box`)."""
    spec = self.specs[i]
    if spec is None and not self.sharded:
      return jnp.asarray(arr)
    if spec is not None:
      with jax.default_device(self._cpu):
        leaf = self._quantize_leaf(jnp.asarray(arr), spec, name=self.names[i])
      if not self.sharded:
        return jax.device_put(leaf, jax.local_devices()[0])  # the default device
      host = jax.tree_util.tree_map(np.asarray, leaf)
    else:
      host = arr
    a = self.abstract[i]
    fields = []
    # Every device copies out only its own shard of the part read; a field's index is
    # global, so it is shifted by where the part starts in that field.
    for x, field, geo in zip(jax.tree_util.tree_leaves(host), jax.tree_util.tree_leaves(a),
                             _field_geometry(a)):
      off = _field_offset(box, geo, len(field.shape))
      fields.append(jax.make_array_from_callback(
          tuple(field.shape), field.sharding, lambda idx, x=x, off=off, shape=tuple(field.shape): x[tuple(
              slice(s.indices(d)[0] - o, s.indices(d)[1] - o) for s, d, o in zip(idx, shape, off))]))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(host), fields)


def _field_geometry(leaf) -> list[tuple[tuple[int, ...], bool]]:
  """For each array of a (quantised) leaf, in flatten order: dense elements per element
  along each dense axis, and whether the array lacks the K axis (per-channel fp8 scales)."""
  from mlkit.quant import Fp8Weight, Int4Weight
  nd = len(leaf.shape)
  ones = (1,) * nd
  def at_k(f, n=1):  # factor f on K (axis -2), and on N too when n == 2
    return ones[:-2] + (f, f if n == 2 else 1)
  if isinstance(leaf, Int4Weight):
    return [(at_k(2), False), (at_k(leaf.group_size), False)]  # packed, scales
  if isinstance(leaf, Fp8Weight):
    if leaf.block_size is None:
      return [(ones, False), (ones, True)]  # values, per-channel scales [..., N]
    return [(ones, False), (at_k(leaf.block_size, 2), False)]
  return [(ones, False)]


def _quant_units(leaf) -> tuple[int, ...]:
  """Per dense axis, the run of elements quantised together (what a part read must keep whole)."""
  from mlkit.quant import Fp8Weight, Int4Weight
  shape = tuple(leaf.shape)
  units = [1] * len(shape)
  if isinstance(leaf, Int4Weight):
    units[-2] = leaf.group_size
  elif isinstance(leaf, Fp8Weight) and leaf.block_size is not None:
    units[-2] = units[-1] = leaf.block_size
  elif isinstance(leaf, Fp8Weight):
    units[-2] = shape[-2]  # one scale per output channel over all of K
  return tuple(units)


def _dense_range(idx, field_shape, dense_shape, geo) -> list[tuple[int, int]]:
  """The dense ``(start, stop)`` per axis that a field's index (slices) stands for."""
  factors, no_k = geo
  nd = len(dense_shape)
  ranges = [s.indices(d)[:2] for s, d in zip(idx, field_shape)]
  if no_k:
    ranges.insert(nd - 2, (0, dense_shape[nd - 2]))
  return [(s * f, min(e * f, d)) for (s, e), f, d in zip(ranges, factors, dense_shape)]


def _field_offset(box, geo, field_ndim: int) -> tuple[int, ...]:
  """Where ``box`` (dense, aligned to the quantisation units) starts in a field's elements."""
  factors, no_k = geo
  off = [s // f for (s, _), f in zip(box, factors)]
  if no_k:
    del off[len(box) - 2]
  assert len(off) == field_ndim
  return tuple(off)


class _Progress:
  """Logs bytes read and the rate every few seconds, and once at the end."""

  EVERY_S = 5.0

  def __init__(self, total: int):
    self.total, self.done_bytes = total, 0
    self.t0 = self.last = time.perf_counter()

  def add(self, n: int) -> None:
    self.done_bytes += n
    now = time.perf_counter()
    if now - self.last >= self.EVERY_S:
      self.last = now
      log.info("%s: %.2f of %.2f GB read (%.0f MB/s)", _LOAD, self.done_bytes / 1e9,
               self.total / 1e9, self.done_bytes / 1e6 / max(now - self.t0, 1e-9))

  def done(self) -> None:
    dt = time.perf_counter() - self.t0
    log.info("%s: %.2f GB read in %.1f s (%.0f MB/s)", _LOAD, self.done_bytes / 1e9, dt,
             self.done_bytes / 1e6 / max(dt, 1e-9))


# ----------------------------------------------------------------------------- writing


def save_hf_checkpoint(path: str | os.PathLike, params, cfg: ModelConfig, *, shards: int = 1) -> None:
  """Writes params in the DeepSeek-V3 HF layout (``config.json`` + safetensors).

  Args:
    path: output directory (created if missing; existing files of the same names are replaced).
    params: our params tree for ``cfg``; quantised leaves are written dequantised.
    cfg: an MLA ModelConfig.
    shards: number of safetensors files; more than one also writes ``model.safetensors.index.json``.

  Raises:
    ValueError: ``shards`` out of range, a GQA/indexer config, or params that do not
      match ``cfg`` (:func:`mlkit.model.check_params`: names the first leaf that differs).
  """
  hf_config = config_to_hf(cfg)
  check_params(params, cfg, where="save_hf_checkpoint")
  targets, _ = hf_layout(cfg)
  flat = {tuple(_key(k) for k in p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(
      params, is_leaf=lambda x: not isinstance(x, (dict, list, tuple)))[0]}
  tensors: dict[str, np.ndarray] = {}
  for t in targets:
    # Every tensor in the dtype config.json declares (quantised leaves dequantised into it),
    # so that loading the export back converts nothing.
    arr = np.asarray(dequantize(flat[t.path], jnp.dtype(t.dtype or cfg.param_dtype)))
    if t.kind == "copy":
      tensors[t.names[0]] = np.ascontiguousarray(arr)
    elif t.kind == "T":
      tensors[t.names[0]] = np.ascontiguousarray(arr.T)
    else:
      for e, n in enumerate(t.names):
        tensors[n] = np.ascontiguousarray(arr[e].T)
  if not isinstance(shards, int) or not 1 <= shards <= len(tensors):
    raise ValueError(f"save_hf_checkpoint: shards must be an int in [1, {len(tensors)}], got {shards!r}")

  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  names = list(tensors)
  if shards == 1:
    groups = [(SINGLE_FILE, names)]
  else:
    # Contiguous groups of roughly equal bytes, each non-empty.
    total = sum(tensors[n].nbytes for n in names)
    groups, cur, acc = [], [], 0
    for i, n in enumerate(names):
      cur.append(n)
      acc += tensors[n].nbytes
      left_names, left_groups = len(names) - i - 1, shards - len(groups) - 1
      if left_groups and (acc >= total * (len(groups) + 1) / shards or left_names == left_groups):
        groups.append(cur)
        cur = []
    groups.append(cur)
    groups = [(f"model-{i + 1:05d}-of-{shards:05d}.safetensors", g) for i, g in enumerate(groups)]
  for fname, group in groups:
    save_file({n: tensors[n] for n in group}, os.path.join(path, fname), metadata={"format": "pt"})
  if shards > 1:
    index = {"metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))},
             "weight_map": {n: fname for fname, group in groups for n in group}}
    with open(os.path.join(path, INDEX_FILE), "w") as f:
      json.dump(index, f, indent=2, sort_keys=True)
  with open(os.path.join(path, CONFIG_FILE), "w") as f:
    json.dump(hf_config, f, indent=2)
