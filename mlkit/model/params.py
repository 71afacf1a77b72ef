"""Parameter layout, initialisation and counting.

Params are a plain nested dict (a pytree). Every projection is stored 2-D as
[in, out] (experts 3-D as [E, in, out]) so that one ``matmul(x, w)`` serves all
weight formats. Layout::

  embed [V, D], final_norm [D], lm_head [D, V] (absent when tied)
  layers[i]:
    attn_norm [D], ffn_norm [D]
    attn (MLA): wq [D, H*(nope+rope)] or wq_a [D, q_lora], q_norm [q_lora], wq_b [q_lora, H*(nope+rope)];
                wkv_a [D, kv_lora+rope], kv_norm [kv_lora], wkv_b [kv_lora, H*(nope+v)], wo [H*v, D]
    attn (GQA): wq [D, H*hd], wk [D, KV*hd], wv [D, KV*hd], wo [H*hd, D]
    ffn (dense): w_gate [D, F], w_up [D, F], w_down [F, D]
    ffn (MoE):   router [D, E] (f32), router_bias [E] (f32, sigmoid routers only),
                 w_gate [E, D, F], w_up [E, D, F], w_down [E, F, D],
                 shared: {w_gate [D, S*F], w_up [D, S*F], w_down [S*F, D]} (when S > 0)
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from mlkit.config import ModelConfig

# (shape, kind) leaves; kind is "ones", "zeros" or "normal" (fan-in scaled), plus an optional dtype.
Spec = tuple[tuple[int, ...], str]


def _attn_specs(cfg: ModelConfig) -> dict[str, Spec]:
  D, H = cfg.d_model, cfg.n_heads
  if cfg.attention == "gqa":
    return {
        "wq": ((D, H * cfg.head_dim), "normal"),
        "wk": ((D, cfg.n_kv_heads * cfg.head_dim), "normal"),
        "wv": ((D, cfg.n_kv_heads * cfg.head_dim), "normal"),
        "wo": ((H * cfg.head_dim, D), "normal"),
    }
  qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
  specs: dict[str, Spec] = {}
  if cfg.q_lora_rank:
    specs["wq_a"] = ((D, cfg.q_lora_rank), "normal")
    specs["q_norm"] = ((cfg.q_lora_rank,), "ones")
    specs["wq_b"] = ((cfg.q_lora_rank, H * qk), "normal")
  else:
    specs["wq"] = ((D, H * qk), "normal")
  specs["wkv_a"] = ((D, cfg.kv_lora_rank + cfg.qk_rope_head_dim), "normal")
  specs["kv_norm"] = ((cfg.kv_lora_rank,), "ones")
  specs["wkv_b"] = ((cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim)), "normal")
  specs["wo"] = ((H * cfg.v_head_dim, D), "normal")
  return specs


def _ffn_specs(cfg: ModelConfig, layer: int) -> dict[str, Any]:
  D = cfg.d_model
  if not cfg.is_moe_layer(layer):
    F = cfg.dense_ffn_dim
    return {"w_gate": ((D, F), "normal"), "w_up": ((D, F), "normal"), "w_down": ((F, D), "normal")}
  E, F = cfg.n_routed_experts, cfg.moe_ffn_dim
  specs: dict[str, Any] = {
      "router": ((D, E), "normal", "float32"),
      "w_gate": ((E, D, F), "normal"),
      "w_up": ((E, D, F), "normal"),
      "w_down": ((E, F, D), "normal"),
  }
  if cfg.router == "sigmoid":
    specs["router_bias"] = ((E,), "zeros", "float32")
  if cfg.n_shared_experts:
    S = cfg.n_shared_experts * F
    specs["shared"] = {"w_gate": ((D, S), "normal"), "w_up": ((D, S), "normal"),
                       "w_down": ((S, D), "normal")}
  return specs


def param_specs(cfg: ModelConfig) -> dict[str, Any]:
  """The nested dict of (shape, init kind[, dtype]) leaves that ``init_params`` fills."""
  D, V = cfg.d_model, cfg.vocab_size
  specs: dict[str, Any] = {"embed": ((V, D), "embed"), "final_norm": ((D,), "ones")}
  if not cfg.tie_embeddings:
    specs["lm_head"] = ((D, V), "normal")
  specs["layers"] = [
      {"attn_norm": ((D,), "ones"), "ffn_norm": ((D,), "ones"),
       "attn": _attn_specs(cfg), "ffn": _ffn_specs(cfg, i)}
      for i in range(cfg.n_layers)
  ]
  return specs


def _is_spec(x) -> bool:
  return isinstance(x, tuple) and len(x) in (2, 3) and isinstance(x[0], tuple)


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
  """Random params for ``cfg`` (see :func:`_init_params`); compiled once per config."""
  return _init_params_jit(cfg, key)


def _init_params(cfg: ModelConfig, key: jax.Array) -> dict:
  """Random params for ``cfg``: N(0, 1/fan_in) matrices, unit norms, zero router bias.

  Args:
    cfg: the model config.
    key: a PRNG key.

  Returns:
    The params pytree described in this module's docstring, in ``cfg.param_dtype``
    (router weights and bias in f32, because routing decisions are precision sensitive).
  """
  specs = param_specs(cfg)
  leaves, treedef = jax.tree_util.tree_flatten(specs, is_leaf=_is_spec)
  keys = jax.random.split(key, len(leaves))
  dtype = jnp.dtype(cfg.param_dtype)
  out = []
  for k, spec in zip(keys, leaves):
    shape, kind = spec[0], spec[1]
    dt = jnp.dtype(spec[2]) if len(spec) == 3 else dtype
    if kind == "ones":
      out.append(jnp.ones(shape, dt))
    elif kind == "zeros":
      out.append(jnp.zeros(shape, dt))
    elif kind == "embed":
      # Tied embeddings double as the output projection, so keep logits O(1).
      std = cfg.d_model ** -0.5 if cfg.tie_embeddings else 1.0
      out.append((jax.random.normal(k, shape, jnp.float32) * std).astype(dt))
    else:
      fan_in = shape[-2]
      out.append((jax.random.normal(k, shape, jnp.float32) * fan_in ** -0.5).astype(dt))
  return jax.tree_util.tree_unflatten(treedef, out)


_init_params_jit = jax.jit(_init_params, static_argnums=0)


def indexer_param_count(cfg: ModelConfig) -> int:
  """Parameters of a sparse-attention indexer (GLM 5.x) per model; counted, never instantiated."""
  if not cfg.index_n_heads:
    return 0
  q_in = cfg.q_lora_rank or cfg.d_model
  per_layer = (q_in * cfg.index_n_heads * cfg.index_head_dim  # wq_b
               + cfg.d_model * cfg.index_head_dim + 2 * cfg.index_head_dim  # wk, k_norm
               + cfg.d_model * cfg.index_n_heads)  # per-head weights
  return per_layer * cfg.n_layers


def count_params(cfg: ModelConfig, *, include_indexer: bool = True) -> int:
  """Total parameter count from shapes alone (works for 1T-parameter presets).

  Includes the sparse-attention indexer when the config declares one; excludes
  multi-token-prediction heads, which are not part of the serving model.
  """
  leaves = jax.tree_util.tree_leaves(param_specs(cfg), is_leaf=_is_spec)
  total = sum(math.prod(spec[0]) for spec in leaves)
  return total + (indexer_param_count(cfg) if include_indexer else 0)


def active_params_per_token(cfg: ModelConfig) -> int:
  """Parameters touched per token (top_k routed experts instead of all), embeddings excluded."""
  total = count_params(cfg) - cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)
  inactive_experts = cfg.n_routed_experts - cfg.top_k
  return total - cfg.n_moe_layers * inactive_experts * 3 * cfg.d_model * cfg.moe_ffn_dim
