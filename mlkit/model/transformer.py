"""The decoder: ``apply(params, tokens, positions, cache) -> (logits, cache)``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mlkit.config import ModelConfig
from mlkit.model.attention import attention_block
from mlkit.model.layers import rms_norm, swiglu
from mlkit.model.moe import moe_ffn
from mlkit.quant import matmul
from pallas_kernels import dispatch as kernel_dispatch
from pallas_kernels.residual_norm import add_deltas, add_residual, residual_norm


def _check_inputs(params: dict, tokens, positions, cfg: ModelConfig) -> None:
  if tokens.ndim != 2:
    raise ValueError(f"tokens must be [B, T], got shape {tokens.shape}")
  if positions.shape != tokens.shape:
    raise ValueError(f"positions {positions.shape} must match tokens {tokens.shape}")
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"tokens must be integers, got {tokens.dtype}")
  if len(params["layers"]) != cfg.n_layers:
    raise ValueError(f"params have {len(params['layers'])} layers, config says {cfg.n_layers}")


def decoder_layer(lp: dict, x: jax.Array, positions: jax.Array, cache, layer: int,
                  cfg: ModelConfig, *, moe: bool, selection=None, batch_meta=None,
                  mla_mode: str = "auto", backend: str | None = None,
                  segment_ids: jax.Array | None = None, expert_sharding=None,
                  decode_sharding=None):
  """One decoder block: pre-norm attention and pre-norm FFN, each added to the residual.

  The multi-token-prediction layers (``mlkit.model.mtp``) run through here; the main
  model's layers run :func:`_decoder_layer`, which leaves its residual add to the next
  layer's norm.

  Args:
    lp: the layer's params {attn_norm, ffn_norm, attn, ffn}.
    x: [B, T, D] residual stream.
    positions: [B, T] int32 positions.
    cache: the KV cache or None (cache-free).
    layer: the layer's index into the cache (and into ``cfg.indexer_types``).
    cfg: the model config.
    moe: whether the FFN is the MoE FFN (else the dense SwiGLU).
    selection: sparse attention: the last full layer's selection (see ``attention_block``).
    batch_meta, mla_mode, backend, segment_ids, expert_sharding, decode_sharding: as
      :func:`apply`.

  Returns:
    (x [B, T, D], cache, selection, aux): aux is the MoE router statistics
    {expert_load, router_prob: [E]} or None for a dense FFN.
  """
  x, deltas, cache, selection, aux = _decoder_layer(
      lp, x, (), positions, cache, layer, cfg, moe=moe, selection=selection,
      batch_meta=batch_meta, mla_mode=mla_mode, backend=backend, segment_ids=segment_ids,
      expert_sharding=expert_sharding, decode_sharding=decode_sharding)
  return add_residual(x, deltas), cache, selection, aux


def _decoder_layer(lp: dict, x: jax.Array, deltas: tuple, positions: jax.Array, cache,
                   layer: int, cfg: ModelConfig, *, moe: bool, selection=None,
                   batch_meta=None, mla_mode: str = "auto", backend: str | None = None,
                   segment_ids: jax.Array | None = None, expert_sharding=None,
                   decode_sharding=None):
  """:func:`decoder_layer` on the residual stream ``x`` plus the previous layer's
  un-added ``deltas``, returning its own deltas un-added.

  The residual add at a layer's end is materialised once per layer (see
  ``add_residual``); XLA runs it as a launch of its own, and the next layer's RMSNorm
  as another. Handed on un-added, the add and that norm run as one kernel on the kernel
  backends (``residual_norm``, docs/residual_norm.md), whose new stream is the
  materialised one; on "xla" they are today's ops.

  Returns:
    (x [B, T, D] the stream after ``deltas``, (attn_out, ffn_out) [B, T, D] this layer's
    deltas, cache, selection, aux).
  """
  eps = cfg.rms_norm_eps
  # The kernel rounds each delta to x's dtype itself: handed the output projections' f32
  # sums (all-reduced under tensor parallelism), it reads them as they come, where a
  # rounded copy would be a launch of its own. On "xla" the outputs are rounded where
  # they are made, as always.
  out_dtype = None if kernel_dispatch.resolve_backend(backend) == "xla" else jnp.float32
  if deltas:
    x, h = residual_norm(x, deltas, lp["attn_norm"], eps, backend=backend)
  else:
    h = rms_norm(x, lp["attn_norm"], eps)
  if cfg.sparse_attention:
    attn_out, cache, selection = attention_block(
        lp["attn"], h, positions, cache, layer, cfg, batch_meta=batch_meta, mla_mode=mla_mode,
        backend=backend, segment_ids=segment_ids, selection=selection,
        decode_sharding=decode_sharding, out_dtype=out_dtype)
  else:
    attn_out, cache = attention_block(lp["attn"], h, positions, cache, layer, cfg,
                                      batch_meta=batch_meta, mla_mode=mla_mode,
                                      backend=backend, segment_ids=segment_ids,
                                      decode_sharding=decode_sharding, out_dtype=out_dtype)
  h = rms_norm(add_deltas(x, (attn_out,)), lp["ffn_norm"], eps)
  aux = None
  if moe:
    ffn_out, aux = moe_ffn(lp["ffn"], h, cfg, backend=backend, expert_sharding=expert_sharding,
                           out_dtype=out_dtype)
  else:
    ffn_out = swiglu(lp["ffn"], h, backend=backend, out_dtype=out_dtype)
  return x, (attn_out, ffn_out), cache, selection, aux


def apply(params: dict, tokens: jax.Array, positions: jax.Array, cache=None, *,
          cfg: ModelConfig, batch_meta=None, mla_mode: str = "auto",
          backend: str | None = None, return_aux: bool = False, return_hidden: bool = False,
          segment_ids: jax.Array | None = None, expert_sharding=None,
          decode_sharding=None, logits_index: jax.Array | None = None,
          return_pre_norm: bool = False):
  """Runs the model over a chunk of tokens, reading and writing the cache.

  Args:
    params: the params pytree (any mix of plain and quantised weights).
    tokens: [B, T] int token ids.
    positions: [B, T] int absolute positions of the tokens.
    cache: a KV cache (``ContiguousKVCache``, or the paged state), or None for a
      cache-free causal forward over the chunk (training).
    cfg: the model config.
    batch_meta: passed to the cache's ``update`` (block tables and lengths for paged caches).
    mla_mode: "naive", "absorbed" or "auto" (absorbed when T == 1).
    backend: kernel backend for quantised matmuls and paged decode attention:
      "pallas" | "interpret" | "xla", or None for the platform default.
    return_aux: also return router statistics per MoE layer.
    return_hidden: return final hidden states [B, T, D] instead of logits.
    segment_ids: [B, T] int segment of each token, for packed rows of independent
      sequences in a cache-free forward (training): attention stays inside a segment.
      Give each segment positions from 0 (see ``segment_positions``) to match serving.
    expert_sharding: None, or the NamedSharding of the routed experts' leading axis
      (``mlkit.parallel.expert_sharding(params)``): routed experts then run
      expert-parallel, each device on its own experts (see ``moe.dispatch_experts``).
    decode_sharding: None, or an ``mlkit.parallel.DecodeSharding``
      (``mlkit.parallel.decode_sharding(params, cache)``): paged decode attention
      then runs per device on its own heads.
    logits_index: [B] int, or None: compute logits (or return hidden states) only
      at this index of each row's T tokens, [B, 1, V]. Serving samples one token
      per row, and a prefill chunk's ``lm_head`` over all T tokens would be most of
      its vocabulary-sized work (T x D x V per row).
    return_pre_norm: also return the final hidden states before ``final_norm``
      [B, T, D] at every position (also with ``logits_index``), last: the input of the
      first multi-token-prediction layer (``mlkit.model.mtp``), which a drafter runs over
      a whole prefill chunk.

  Returns:
    (logits [B, T, V] f32 ([B, 1, V] with ``logits_index``), cache), plus an aux dict
    {expert_load, router_prob: [n_moe_layers, E]} when ``return_aux``, plus the
    pre-norm hidden states when ``return_pre_norm``.

  Raises:
    ValueError: on malformed shapes or a params/config mismatch.
  """
  _check_inputs(params, tokens, positions, cfg)
  if segment_ids is not None:
    if cache is not None:
      raise ValueError("segment_ids apply only to a cache-free forward (cache=None)")
    if segment_ids.shape != tokens.shape:
      raise ValueError(f"segment_ids {segment_ids.shape} must match tokens {tokens.shape}")
  dtype = jnp.dtype(cfg.dtype)
  positions = positions.astype(jnp.int32)
  with jax.named_scope("embed"):
    x = embed_tokens(params["embed"], tokens).astype(dtype)  # [B, T, D]
  loads, probs = [], []
  selection = None  # sparse attention: the last full layer's selection (attention_block)
  deltas = ()  # the last layer's outputs, added by the next layer's first norm
  for i, lp in enumerate(params["layers"]):
    with jax.named_scope(f"layer_{i}"):
      x, deltas, cache, selection, aux = _decoder_layer(
          lp, x, deltas, positions, cache, i, cfg, moe=cfg.is_moe_layer(i),
          selection=selection, batch_meta=batch_meta, mla_mode=mla_mode, backend=backend,
          segment_ids=segment_ids, expert_sharding=expert_sharding,
          decode_sharding=decode_sharding)
      if aux is not None:
        loads.append(aux["expert_load"])
        probs.append(aux["router_prob"])
  x = add_residual(x, deltas)
  pre_norm = x  # [B, T, D]: what the first multi-token-prediction layer reads, every position
  if logits_index is not None:
    x = jnp.take_along_axis(x, logits_index.astype(jnp.int32)[:, None, None], axis=1)  # [B, 1, D]
  x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
  if return_hidden:
    out = x
  else:
    with jax.named_scope("lm_head"):
      head = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
      out = matmul(x, head, out_dtype=jnp.float32, backend=backend)  # [B, T, V]
  if return_aux:
    aux = {"expert_load": jnp.stack(loads) if loads else jnp.zeros((0,)),
           "router_prob": jnp.stack(probs) if probs else jnp.zeros((0,))}
    return (out, cache, aux, pre_norm) if return_pre_norm else (out, cache, aux)
  return (out, cache, pre_norm) if return_pre_norm else (out, cache)


def embed_tokens(table: jax.Array, tokens: jax.Array) -> jax.Array:
  """Rows of ``table`` [V, D] for ``tokens`` [B, T]: [B, T, D].

  A lookup of one token is done as a lookup of two (the token twice, one row kept):
  XLA rewrites a one-index gather into a dynamic slice, and the SPMD partitioner runs a
  dynamic slice of a vocabulary-parallel table on the whole table, all-gathered (2.35
  GB over NVLink per Kimi K2.6 decode step at concurrency 1, docs/step_time.md); a
  gather of two it partitions as a masked local lookup and an all-reduce.
  """
  if tokens.size != 1:
    return jnp.take(table, tokens, axis=0)
  twice = jnp.concatenate([tokens.reshape(1), tokens.reshape(1)])
  return jnp.take(table, twice, axis=0)[:1].reshape(*tokens.shape, table.shape[-1])


def segment_positions(segment_ids: jax.Array) -> jax.Array:
  """Positions [B, T] int32 that restart at 0 wherever ``segment_ids`` [B, T] changes."""
  T = segment_ids.shape[1]
  idx = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), segment_ids.shape)
  new = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                         segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  start = jax.lax.cummax(jnp.where(new, idx, 0), axis=1)  # [B, T] index where each segment began
  return idx - start


@functools.partial(jax.jit, static_argnames=("cfg", "backend"))
def forward(params: dict, tokens: jax.Array, *, cfg: ModelConfig,
            backend: str | None = None) -> jax.Array:
  """Jitted cache-free causal forward: tokens [B, T] -> logits [B, T, V] f32."""
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  logits, _ = apply(params, tokens, positions, None, cfg=cfg, backend=backend)
  return logits


@functools.partial(jax.jit, static_argnames=("cfg", "mla_mode", "backend"),
                   donate_argnames=("cache",))
def apply_jit(params, tokens, positions, cache, *, cfg: ModelConfig, mla_mode: str = "auto",
              backend: str | None = None):
  """Jitted :func:`apply` for a contiguous cache, donating the cache."""
  return apply(params, tokens, positions, cache, cfg=cfg, mla_mode=mla_mode, backend=backend)
