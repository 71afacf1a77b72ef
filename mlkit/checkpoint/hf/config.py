"""config.json <-> ModelConfig for the DeepSeek-V3 / Kimi-K2 / GLM-5 / DeepSeek-V3.2 layouts.

The bottom of the package: it reads and writes only the config dict, knows no
tensor or file beyond ``config.json``'s name, and imports nothing else of the
package, so that every other module can lean on it (the tensor names depend on
the config, the loader checks tensors against it).

Both config layouts are read: the classic one (top-level ``rope_theta``,
``rope_scaling``, ``torch_dtype``) and the one transformers 5 writes
(``rope_parameters``, ``mlp_layer_types``, ``dtype``); see
:func:`config_from_hf`. The architecture constants say which
``architectures`` / ``model_type`` values are accepted and which one
:func:`config_to_hf` writes.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from mlkit.config import ModelConfig, RopeScaling

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


def declared_dtype(hf_config: dict):
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
    declared = declared_dtype(hf_config)
    if declared is None:
      raise ValueError("config_from_hf: config.json declares no 'torch_dtype' (or 'dtype'); pass dtype=")
    dt = _dtype_name(declared, "torch_dtype")
  # How many layers after the last are multi-token-prediction layers (params["mtp"] on load).
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
