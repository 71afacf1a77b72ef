"""Our parameter paths <-> Hugging Face tensor names: the layout both loading and saving follow.

Kept apart from the file format (safetensors.py) and from config.json
(config.py) because it is neither: one table, :func:`hf_layout`, says which HF
tensor(s) fill every leaf of ``param_specs(cfg)``, with what shape and
transform, and the loader and the writer both walk it, so they cannot disagree.

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

Multi-token-prediction layers (DeepSeek-V3 naming; layer L = num_hidden_layers + j)
go to ``mtp[j]``: a MoE layer named as above, plus::

  model.layers.L.eh_proj.weight [D, 2D]     -> mtp[j].eh_proj [2D, D]
  model.layers.L.{enorm, hnorm}.weight      -> mtp[j].{enorm, hnorm}
  model.layers.L.shared_head.norm.weight    -> mtp[j].head_norm
  model.layers.L.embed_tokens.weight [V, D] -> mtp[j].embed [V, D]    (where shipped)
  model.layers.L.shared_head.head.weight    -> mtp[j].lm_head [D, V]  (where shipped)

Our head-major layouts (wq_b [q_lora, H*(nope+rope)], wkv_b [kv_lora, H*(nope+v)],
wo [H*v, D]) are exactly the HF weights transposed, and DeepSeek checkpoints use
interleaved RoPE (``rope_interleave=True``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from mlkit.config import ModelConfig
from mlkit.model.params import param_specs

_ATTN = {"wq": "q_proj.weight", "wq_a": "q_a_proj.weight", "q_norm": "q_a_layernorm.weight",
         "wq_b": "q_b_proj.weight", "wkv_a": "kv_a_proj_with_mqa.weight",
         "kv_norm": "kv_a_layernorm.weight", "wkv_b": "kv_b_proj.weight", "wo": "o_proj.weight",
         "indexer_wq_b": "indexer.wq_b.weight", "indexer_wk": "indexer.wk.weight",
         "indexer_k_norm": "indexer.k_norm.weight", "indexer_k_bias": "indexer.k_norm.bias",
         "indexer_weights_proj": "indexer.weights_proj.weight"}
_FFN = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}


@dataclasses.dataclass(frozen=True)
class Target:
  """One leaf of our params and the HF tensor(s) it comes from."""

  path: tuple  # keys into our params tree, e.g. ("layers", 1, "ffn", "w_gate")
  names: tuple[str, ...]  # one HF tensor, or one per expert (stacked along axis 0)
  hf_shape: tuple[int, ...]  # shape of each HF tensor
  kind: str  # "copy", "T" (transpose) or "stack" (transpose each expert, then stack)
  dtype: str | None  # fixed storage dtype (router in f32), or None for the model's param dtype


def _is_spec(x) -> bool:
  return isinstance(x, tuple) and len(x) in (2, 3) and isinstance(x[0], tuple)


def keypath_entry(k):
  """A jax key-path entry as the plain dict key or list index it stands for."""
  return k.key if isinstance(k, jax.tree_util.DictKey) else k.idx


_MTP = {"eh_proj": "eh_proj.weight", "enorm": "enorm.weight", "hnorm": "hnorm.weight",
        "head_norm": "shared_head.norm.weight", "embed": "embed_tokens.weight",
        "lm_head": "shared_head.head.weight"}


def _hf_names(path: tuple, cfg: ModelConfig, shape: tuple[int, ...]) -> tuple[str, ...]:
  if path[0] == "embed":
    return ("model.embed_tokens.weight",)
  if path[0] == "final_norm":
    return ("model.norm.weight",)
  if path[0] == "lm_head":
    return ("lm_head.weight",)
  # A multi-token-prediction layer is named as the layer after the last one (and the next).
  i = path[1] if path[0] == "layers" else cfg.n_layers + path[1]
  group = path[2]
  pre = f"model.layers.{i}."
  if path[0] == "mtp" and group in _MTP:
    return (pre + _MTP[group],)
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


def hf_layout(cfg: ModelConfig, *, mtp=None) -> tuple[list[Target], Any]:
  """The HF tensors behind every leaf of ``param_specs(cfg, mtp=mtp)``, in flatten order, plus
  the treedef (``mtp``: None for no multi-token-prediction layers, else their optional parts)."""
  if cfg.attention != "mla":
    raise ValueError(f"hf_layout: attention={cfg.attention!r}; the DeepSeek-V3 layout needs 'mla'")
  leaves, treedef = jax.tree_util.tree_flatten_with_path(param_specs(cfg, mtp=mtp), is_leaf=_is_spec)
  targets = []
  for kpath, spec in leaves:
    path = tuple(keypath_entry(k) for k in kpath)
    shape = spec[0]
    if len(shape) == 1 or path[-1] == "embed":
      kind, hf_shape = "copy", shape
    elif len(shape) == 2:
      kind, hf_shape = "T", shape[::-1]
    else:
      kind, hf_shape = "stack", shape[1:][::-1]
    targets.append(Target(path, _hf_names(path, cfg, shape), tuple(hf_shape), kind,
                           spec[2] if len(spec) == 3 else None))
  return targets, treedef


def dotted_path(path: tuple) -> str:
  return ".".join(str(p) for p in path)


def mtp_layer_index(name: str, cfg: ModelConfig) -> int | None:
  """j if tensor ``name`` belongs to the j-th multi-token-prediction layer config.json declares."""
  parts = name.split(".")
  if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
    j = int(parts[2]) - cfg.n_layers
    return j if 0 <= j < cfg.n_mtp_layers else None
  return None


def module_name(tensor: str) -> str:
  """The module a weight tensor belongs to: ``model.layers.3.mlp.experts.7.up_proj``."""
  return tensor.removesuffix(".weight")


# Modules of our layout that are not nn.Linear in transformers' modelling code (the
# router is DeepseekV3TopkRouter): a quantisation config's "Linear" target skips them.
_NOT_LINEAR_LAST = ("embed_tokens", "gate", "norm", "enorm", "hnorm", "input_layernorm",
                    "post_attention_layernorm", "q_a_layernorm", "kv_a_layernorm", "k_norm")


def is_linear(module: str) -> bool:
  """Whether ``module`` (an HF module name of this layout) is an ``nn.Linear``."""
  return module.rsplit(".", 1)[-1] not in _NOT_LINEAR_LAST
