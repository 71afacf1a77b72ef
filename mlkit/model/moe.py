"""Mixture-of-experts FFN: DeepSeek-V3 routing and grouped-matmul dispatch.

Tokens are sorted by expert and run through one ragged grouped matmul per
projection, so no [tokens, experts, hidden] tensor is ever built.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mlkit.config import ModelConfig
from mlkit.model.layers import swiglu
from mlkit.quant import grouped_matmul


def route(p: dict, x: jax.Array, cfg: ModelConfig):
  """Chooses top-k experts per token.

  Sigmoid routers (DeepSeek-V3) pick experts by score + ``router_bias`` (the
  auxiliary-loss-free balancing bias) but weight them by the unbiased score;
  with ``n_group > 1`` only the ``topk_group`` best groups (scored by the sum of
  their two best experts) are eligible. Softmax routers pick by probability.

  Args:
    p: MoE params (``router`` [D, E], optional ``router_bias`` [E]).
    x: tokens [N, D].

  Returns:
    (expert_ids [N, k] int32, weights [N, k] f32 including routed_scaling_factor,
     scores [N, E] f32: the router's sigmoid scores or softmax probabilities).
  """
  logits = jnp.dot(x.astype(jnp.float32), p["router"].astype(jnp.float32))  # [N, E]
  N, E = logits.shape
  if cfg.router == "sigmoid":
    scores = jax.nn.sigmoid(logits)
    choice = scores + p["router_bias"].astype(jnp.float32)
  else:
    scores = jax.nn.softmax(logits, axis=-1)
    choice = scores
  if cfg.n_group > 1:
    grouped = choice.reshape(N, cfg.n_group, E // cfg.n_group)
    group_score = jnp.sum(jax.lax.top_k(grouped, min(2, E // cfg.n_group))[0], axis=-1)  # [N, G]
    _, keep = jax.lax.top_k(group_score, cfg.topk_group)
    group_mask = jnp.zeros((N, cfg.n_group), bool).at[jnp.arange(N)[:, None], keep].set(True)
    choice = jnp.where(jnp.repeat(group_mask, E // cfg.n_group, axis=1), choice, -jnp.inf)
  _, expert_ids = jax.lax.top_k(choice, cfg.top_k)  # [N, k]
  weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
  if cfg.norm_topk_prob:
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
  return expert_ids.astype(jnp.int32), weights * cfg.routed_scaling_factor, scores


def dispatch_experts(p: dict, x: jax.Array, expert_ids: jax.Array, weights: jax.Array,
                     n_experts: int, *, backend: str | None = None) -> jax.Array:
  """Runs each token through its chosen experts and combines the results.

  Args:
    p: expert weights ``w_gate``/``w_up`` [E, D, F] and ``w_down`` [E, F, D] (any format).
    x: tokens [N, D].
    expert_ids: [N, k] int32.
    weights: [N, k] combine weights.
    n_experts: E.
    backend: kernel backend for quantised expert weights.

  Returns:
    [N, D] in x's dtype: sum_k weights[n, k] * expert_{ids[n, k]}(x[n]).
  """
  N, k = expert_ids.shape
  flat = expert_ids.reshape(-1)  # [N*k]
  order = jnp.argsort(flat, stable=True)  # assignments sorted by expert
  token_of = order // k  # [N*k]
  xs = x[token_of]  # [N*k, D]
  group_sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)  # [E]
  gmm = functools.partial(grouped_matmul, group_sizes=group_sizes, backend=backend)
  h = jax.nn.silu(gmm(xs, p["w_gate"])) * gmm(xs, p["w_up"])  # [N*k, F]
  ys = gmm(h, p["w_down"], out_dtype=jnp.float32)  # [N*k, D]
  ys = ys * weights.reshape(-1)[order][:, None].astype(jnp.float32)
  out = jnp.zeros((N, x.shape[-1]), jnp.float32).at[token_of].add(ys)
  return out.astype(x.dtype)


def moe_ffn(p: dict, x: jax.Array, cfg: ModelConfig, *, backend: str | None = None):
  """MoE FFN over tokens x [..., D]: routed experts plus shared expert(s).

  Returns:
    (out [..., D], aux) where aux holds ``expert_load`` [E] (fraction of routed
    assignments per expert) and ``router_prob`` [E] (mean router score), the
    statistics load-balancing losses and bias updates need.
  """
  shape = x.shape
  xf = x.reshape(-1, shape[-1])  # [N, D]
  expert_ids, weights, scores = route(p, xf, cfg)
  out = dispatch_experts(p, xf, expert_ids, weights, cfg.n_routed_experts, backend=backend)
  if "shared" in p:
    out = out + swiglu(p["shared"], xf, backend=backend)
  load = jnp.bincount(expert_ids.reshape(-1), length=cfg.n_routed_experts) / expert_ids.size
  aux = {"expert_load": load.astype(jnp.float32), "router_prob": jnp.mean(scores, axis=0)}
  return out.reshape(shape), aux
