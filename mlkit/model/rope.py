"""Rotary position embeddings with YaRN context extension (DeepSeek-V3 semantics)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mlkit.config import ModelConfig, yarn_mscale
from pallas_kernels.page_write.reference import rotate


def _correction_dim(n_rot: float, dim: int, base: float, max_pos: int) -> float:
  return dim * math.log(max_pos / (n_rot * 2 * math.pi)) / (2 * math.log(base))


def inv_frequencies(cfg: ModelConfig) -> jax.Array:
  """Per-pair inverse frequencies [rope_dim // 2] in f32, YaRN-corrected if configured."""
  dim, base = cfg.rope_dim, cfg.rope_theta
  freqs = 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  rs = cfg.rope_scaling
  if rs is None or rs.factor <= 1.0:
    return freqs
  low = math.floor(_correction_dim(rs.beta_fast, dim, base, rs.original_max_position_embeddings))
  high = math.ceil(_correction_dim(rs.beta_slow, dim, base, rs.original_max_position_embeddings))
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:  # equal betas: avoid a zero-width ramp
    high += 0.001
  ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
  # High-frequency dims (index < low) keep their frequency; low-frequency dims
  # (index > high) are interpolated by the factor; a linear ramp in between.
  smooth = 1.0 - ramp
  return freqs / rs.factor * (1.0 - smooth) + freqs * smooth


def cos_sin(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
  """cos and sin tables [B, T, rope_dim // 2] (f32) for integer positions [B, T]."""
  angles = positions.astype(jnp.float32)[..., None] * inv_frequencies(cfg)  # [B, T, R/2]
  mscale = 1.0
  rs = cfg.rope_scaling
  if rs is not None and rs.factor > 1.0:
    mscale = yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim)
  return jnp.cos(angles) * mscale, jnp.sin(angles) * mscale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, *, interleave: bool) -> jax.Array:
  """Rotates the last axis of x [B, T, (N,) R] by cos/sin [B, T, R/2].

  interleave=True rotates pairs (2i, 2i+1), as DeepSeek/Kimi checkpoints expect;
  False rotates (i, i + R/2), as Llama-style GQA checkpoints expect.
  """
  if x.ndim == cos.ndim + 1:  # has a head axis
    cos, sin = cos[..., None, :], sin[..., None, :]
  # The cache's rope keys rotate with the same function (pallas_kernels.page_write).
  return rotate(x.astype(jnp.float32), cos, sin, interleave=interleave).astype(x.dtype)
