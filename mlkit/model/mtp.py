"""DeepSeek-V3's multi-token-prediction (MTP) layers: ``mtp_forward`` and ``mtp_forward_all``.

Depth k (1..``cfg.n_mtp_layers``, params ``params["mtp"][k - 1]``) reads the previous
depth's hidden states h_{k-1} [B, T, D] (depth 0: the main model's last hidden states
before ``final_norm``, ``apply(..., return_pre_norm=True)``) and the embeddings of the
tokens k places ahead, e_i = embed(t_{i+k}), and computes::

  h'  = eh_proj(concat([enorm(e), hnorm(h_{k-1})], -1))   # [B, T, 2D] @ [2D, D]
  h_k = decoder_layer(h')                                  # the main model's block, own weights
  logits_k = lm_head(head_norm(h_k))                       # [B, T, V] f32

At position i, depth k predicts t_{i+k+1}. The concat order (embedding first) is
DeepSeek-V3's and vLLM's (``deepseek_mtp.py``). A layer uses its own ``embed`` and
``lm_head`` where its checkpoint ships them, else the main model's (shared, as in
DeepSeek-V3's training). Positions beyond a row's tokens are padded (see
:func:`mtp_forward_all`); causal attention keeps every earlier position exact.

Serving drafts speculative tokens with depth 1 through the paged pool
(:func:`mtp_paged`): its KV lives in an extra layer of the pool
(``init_paged_state(..., draft_layers=1)``), written and read under the requests'
block tables like every model layer's (docs/speculative.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mlkit.config import ModelConfig
from mlkit.model.layers import rms_norm
from mlkit.model.transformer import decoder_layer
from mlkit.quant import matmul


def _layer_config(cfg: ModelConfig, lp: dict) -> ModelConfig:
  """The config an MTP layer's block runs under, as layer 0 of a one-layer model.

  On a sparse-attention model the layer runs its own indexer ("full") when it holds
  the indexer weights; without them it cannot select tokens, so it is refused.
  """
  if not cfg.sparse_attention:
    return cfg
  if not any(str(k).startswith("indexer_") for k in lp["attn"]):
    raise ValueError("mtp_forward: this sparse-attention model's MTP layer holds no indexer "
                     "weights (its checkpoint did not ship them), so it cannot select tokens")
  return dataclasses.replace(cfg, n_layers=1, first_k_dense=0, indexer_types=("full",))


def mtp_forward(params: dict, hidden: jax.Array, tokens: jax.Array, *, cfg: ModelConfig,
                depth: int, positions: jax.Array | None = None,
                segment_ids: jax.Array | None = None, backend: str | None = None,
                return_aux: bool = False):
  """Runs multi-token-prediction depth ``depth`` over a chunk, cache-free.

  Args:
    params: the params tree, with ``params["mtp"]`` (``cfg.n_mtp_layers`` layers).
    hidden: [B, T, D] the previous depth's hidden states (depth 1: the main model's
      pre-norm final hidden states).
    tokens: [B, T] int the tokens ``depth`` places ahead of each position (t_{i+depth}),
      already shifted by the caller (:func:`mtp_forward_all` shifts them).
    cfg: the model config.
    depth: 1-based depth k; uses ``params["mtp"][k - 1]``.
    positions: [B, T] int positions (default 0..T-1), as the main model's.
    segment_ids: [B, T] int packed-sequence segments, as :func:`mlkit.model.apply`'s.
    backend: kernel backend for quantised matmuls.
    return_aux: also return the MoE router statistics {expert_load, router_prob: [E]}.

  Returns:
    (logits [B, T, V] f32 (position i predicts t_{i+depth+1}), hidden [B, T, D] h_k
    before the head's norm, the next depth's input), plus aux when ``return_aux``.

  Raises:
    ValueError: no ``mtp`` layers, a depth out of range, or mismatched shapes.
  """
  layers = params.get("mtp")
  if not layers:
    raise ValueError("mtp_forward: params hold no multi-token-prediction layers (params['mtp'])")
  if not 1 <= depth <= len(layers):
    raise ValueError(f"mtp_forward: depth must be in 1..{len(layers)}, got {depth}")
  if tokens.ndim != 2 or hidden.shape != (*tokens.shape, cfg.d_model):
    raise ValueError(f"mtp_forward: hidden {hidden.shape} must be [B, T, D] for tokens "
                     f"{tokens.shape} [B, T] and D={cfg.d_model}")
  lp = layers[depth - 1]
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  positions = positions.astype(jnp.int32)
  with jax.named_scope(f"mtp_{depth}"):
    x = _eh_proj(params, lp, hidden, tokens, cfg, backend)  # [B, T, D]
    lcfg = _layer_config(cfg, lp)
    # An MTP layer's FFN is MoE whenever the model has routed experts (mtp_specs).
    x, _, _, aux = decoder_layer(lp, x, positions, None, 0, lcfg, moe="router" in lp["ffn"],
                                 backend=backend, segment_ids=segment_ids)
    logits = _head(params, lp, x, cfg, backend)  # [B, T, V]
  if return_aux:
    return logits, x, aux
  return logits, x


def mtp_paged(params: dict, hidden: jax.Array, tokens: jax.Array, positions: jax.Array,
              cache, *, cfg: ModelConfig, batch_meta, backend: str | None = None,
              logits_index: jax.Array | None = None, expert_sharding=None,
              decode_sharding=None, mla_mode: str = "auto"):
  """Runs MTP depth 1 over a chunk through the paged pool: the drafter of speculative decoding.

  Writes the layer's KV for the chunk into pool layer ``cfg.n_layers`` (the pool's
  first drafter layer) and attends over the row's earlier positions there, as a model
  layer does (T = 1 takes the paged decode path).

  Args:
    params: the params tree with at least one ``mtp`` layer.
    hidden: [B, T, D] the input hidden states: the model's pre-norm final hidden state at
      the same positions, or (drafting further ahead) the MTP layer's own output at the
      position before.
    tokens: [B, T] int the token after each position (t_{i+1}).
    positions: [B, T] int the positions.
    cache: the paged KV state with a drafter layer (``init_paged_state(draft_layers=1)``).
    cfg: the model config.
    batch_meta: the step's block tables and lengths (the cache's ``BatchMeta``).
    backend, expert_sharding, decode_sharding, mla_mode: as :func:`mlkit.model.apply`.
    logits_index: [B] int or None: logits only at this index of each row ([B, 1, V]).

  Returns:
    (logits [B, T, V] f32 (or [B, 1, V]): position i's prediction of t_{i+2}, hidden
    [B, T, D] the layer's output before the head's norm, cache).

  Raises:
    ValueError: no ``mtp`` layers, a pool without a drafter layer, a sparse-attention
      model, or mismatched shapes.
  """
  layers = params.get("mtp")
  if not layers:
    raise ValueError("mtp_paged: params hold no multi-token-prediction layers (params['mtp'])")
  if cfg.sparse_attention:
    raise ValueError("mtp_paged: drafting through the pool is not built for sparse-attention "
                     "models")
  if cache.n_layers <= cfg.n_layers:
    raise ValueError(f"mtp_paged: the pool has {cache.n_layers} layers, none after the model's "
                     f"{cfg.n_layers} for the drafter (init_paged_state(..., draft_layers=1))")
  if tokens.ndim != 2 or hidden.shape != (*tokens.shape, cfg.d_model):
    raise ValueError(f"mtp_paged: hidden {hidden.shape} must be [B, T, D] for tokens "
                     f"{tokens.shape} [B, T] and D={cfg.d_model}")
  lp = layers[0]
  with jax.named_scope("mtp_draft"):
    x = _eh_proj(params, lp, hidden, tokens, cfg, backend)  # [B, T, D]
    x, cache, _, _ = decoder_layer(lp, x, positions.astype(jnp.int32), cache, cfg.n_layers, cfg,
                                   moe="router" in lp["ffn"], batch_meta=batch_meta,
                                   backend=backend, expert_sharding=expert_sharding,
                                   decode_sharding=decode_sharding, mla_mode=mla_mode)
    h = x
    if logits_index is not None:
      h = jnp.take_along_axis(x, logits_index.astype(jnp.int32)[:, None, None], axis=1)
    logits = _head(params, lp, h, cfg, backend)
  return logits, x, cache


def _eh_proj(params: dict, lp: dict, hidden, tokens, cfg: ModelConfig, backend):
  """h' = eh_proj([enorm(embed(tokens)); hnorm(hidden)]) [B, T, D]."""
  dtype = jnp.dtype(cfg.dtype)
  embed = lp.get("embed", params["embed"])
  e = jnp.take(embed, tokens, axis=0).astype(dtype)  # [B, T, D]
  eh = jnp.concatenate([rms_norm(e, lp["enorm"], cfg.rms_norm_eps),
                        rms_norm(hidden.astype(dtype), lp["hnorm"], cfg.rms_norm_eps)],
                       axis=-1)  # [B, T, 2D]
  return matmul(eh, lp["eh_proj"], backend=backend)


def _head(params: dict, lp: dict, x, cfg: ModelConfig, backend):
  """The shared head with the layer's own norm: logits [B, T, V] f32."""
  h = rms_norm(x, lp["head_norm"], cfg.rms_norm_eps)
  if "lm_head" in lp:
    head = lp["lm_head"]
  else:
    head = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
  return matmul(h, head, out_dtype=jnp.float32, backend=backend)


def shift_tokens(tokens: jax.Array, k: int, pad: int = 0) -> jax.Array:
  """tokens [B, T] moved k places left (position i holds t_{i+k}), the last k set to ``pad``."""
  if k == 0:
    return tokens
  tail = jnp.full((tokens.shape[0], min(k, tokens.shape[1])), pad, tokens.dtype)
  return jnp.concatenate([tokens[:, k:], tail], axis=1)


def mtp_forward_all(params: dict, hidden: jax.Array, tokens: jax.Array, *, cfg: ModelConfig,
                    positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                    backend: str | None = None, return_aux: bool = False):
  """Runs every MTP depth in turn over a chunk (training, teacher forcing).

  Args:
    params: the params tree with its ``mtp`` layers.
    hidden: [B, T, D] the main model's pre-norm final hidden states for ``tokens``.
    tokens: [B, T] int the main model's inputs; depth k reads them shifted k places
      left, padded with token 0 at the end: those last k positions (and any whose
      targets leave their segment) have no target and must be masked by the caller.
    cfg, positions, segment_ids, backend: as :func:`mtp_forward`.
    return_aux: also return {expert_load, router_prob: [n_depths, E]} (empty when
      the layers have dense FFNs).

  Returns:
    logits [n_depths, B, T, V] f32 (depth k = index k-1; at position i it predicts
    t_{i+k+1}), plus aux when ``return_aux``.
  """
  h, out, loads, probs = hidden, [], [], []
  for k in range(1, len(params.get("mtp") or ()) + 1):
    logits, h, aux = mtp_forward(params, h, shift_tokens(tokens, k), cfg=cfg, depth=k,
                                 positions=positions, segment_ids=segment_ids, backend=backend,
                                 return_aux=True)
    out.append(logits)
    if aux is not None:
      loads.append(aux["expert_load"])
      probs.append(aux["router_prob"])
  if not out:
    raise ValueError("mtp_forward_all: params hold no multi-token-prediction layers")
  logits = jnp.stack(out)
  if return_aux:
    return logits, {"expert_load": jnp.stack(loads) if loads else jnp.zeros((0,)),
                    "router_prob": jnp.stack(probs) if probs else jnp.zeros((0,))}
  return logits
