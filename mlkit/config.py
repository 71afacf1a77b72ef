"""Configuration dataclasses for models and hardware.

Every config is a frozen dataclass with a one-line comment above each field.
Invariants are checked in ``__post_init__``; a violation raises ``ValueError``
naming the offending field. Presets live in ``configs/`` and tests shrink them
with ``dataclasses.replace``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

AttentionKind = Literal["mla", "gqa"]
RouterKind = Literal["sigmoid", "softmax"]


def _positive(obj: Any, *names: str) -> None:
  for name in names:
    value = getattr(obj, name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
      raise ValueError(f"{type(obj).__name__}.{name} must be a positive int, got {value!r}")


def _non_negative(obj: Any, *names: str) -> None:
  for name in names:
    value = getattr(obj, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
      raise ValueError(f"{type(obj).__name__}.{name} must be a non-negative int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """YaRN context extension parameters (DeepSeek-V3 / Kimi K2 semantics)."""

  # Context extension factor; 1.0 disables YaRN.
  factor: float = 1.0
  # Context length the model was pre-trained at, before extension.
  original_max_position_embeddings: int = 4096
  # Rotations per wavelength above which dimensions are left unscaled.
  beta_fast: float = 32.0
  # Rotations per wavelength below which dimensions are fully interpolated.
  beta_slow: float = 1.0
  # Attention-temperature coefficient applied to cos/sin.
  mscale: float = 1.0
  # Attention-temperature coefficient applied to the softmax scale.
  mscale_all_dim: float = 1.0

  def __post_init__(self):
    if not self.factor >= 1.0:
      raise ValueError(f"RopeScaling.factor must be >= 1, got {self.factor}")
    _positive(self, "original_max_position_embeddings")
    if not self.beta_fast >= self.beta_slow > 0:
      raise ValueError(
          f"RopeScaling.beta_fast must be >= beta_slow > 0, got {self.beta_fast}, {self.beta_slow}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only MoE transformer with MLA or GQA attention (DeepSeek-V3 semantics)."""

  # Human-readable preset name.
  name: str
  # Vocabulary size.
  vocab_size: int
  # Residual stream width (hidden_size).
  d_model: int
  # Number of transformer blocks.
  n_layers: int
  # Number of query heads.
  n_heads: int
  # Attention family: "mla" (multi-head latent) or "gqa" (grouped-query).
  attention: AttentionKind = "mla"

  # --- MLA ---
  # Rank of the low-rank query path; 0 means a full-rank query projection.
  q_lora_rank: int = 0
  # Rank of the compressed KV latent that the cache stores.
  kv_lora_rank: int = 512
  # Per-head query/key dims that carry no position information.
  qk_nope_head_dim: int = 128
  # Per-head query/key dims rotated by RoPE (the decoupled rope key is shared by heads).
  qk_rope_head_dim: int = 64
  # Per-head value dim.
  v_head_dim: int = 128

  # --- GQA ---
  # Number of KV heads (GQA only).
  n_kv_heads: int = 0
  # Per-head dim for q, k and v (GQA only).
  head_dim: int = 0

  # --- FFN / MoE ---
  # Width of the dense SwiGLU FFN in the first_k_dense layers.
  dense_ffn_dim: int = 0
  # Width of one routed or shared expert.
  moe_ffn_dim: int = 0
  # Number of routed experts per MoE layer.
  n_routed_experts: int = 0
  # Number of always-on shared experts per MoE layer.
  n_shared_experts: int = 0
  # Routed experts chosen per token.
  top_k: int = 0
  # Number of leading layers that use a dense FFN instead of MoE.
  first_k_dense: int = 0
  # Router scoring: "sigmoid" with bias-corrected top-k (DeepSeek-V3) or "softmax".
  router: RouterKind = "sigmoid"
  # Multiplier on the routed experts' combined output.
  routed_scaling_factor: float = 1.0
  # Whether the chosen top-k weights are renormalised to sum to one.
  norm_topk_prob: bool = True
  # Expert groups for group-limited routing (1 disables grouping).
  n_group: int = 1
  # Groups kept per token under group-limited routing.
  topk_group: int = 1

  # --- Sparse-attention indexer (GLM 5.x, DeepSeek Sparse Attention); 0 heads means none. ---
  # Indexer heads.
  index_n_heads: int = 0
  # Indexer head dim; its per-token key cache holds this many values per layer.
  index_head_dim: int = 0
  # Tokens the indexer selects per query.
  index_topk: int = 0
  # Per layer, "full" (runs the indexer and keeps its keys) or "shared" (reuses the
  # previous full layer's selection). Empty: the indexer is declared for capacity and
  # weight accounting only and the model runs dense MLA (docs/sparse_attention.md).
  indexer_types: tuple[str, ...] = ()
  # Rotate the indexer's rope dims as interleaved pairs (GLM) instead of halves (DeepSeek-V3.2).
  index_rope_interleave: bool = True

  # --- Positions and norms ---
  # RoPE base frequency.
  rope_theta: float = 10000.0
  # YaRN scaling; None means plain RoPE.
  rope_scaling: RopeScaling | None = None
  # Rotate interleaved pairs (2i, 2i+1) as DeepSeek checkpoints do, instead of halves.
  rope_interleave: bool = True
  # RMSNorm epsilon.
  rms_norm_eps: float = 1e-6
  # Epsilon of MLA's query and KV latent RMSNorms (None: rms_norm_eps). transformers builds
  # them with its default 1e-6 whatever rms_norm_eps says (GLM 5 uses 1e-5 elsewhere).
  latent_norm_eps: float | None = None
  # Share the embedding matrix with the output projection.
  tie_embeddings: bool = False
  # Longest sequence the model is run at (cache length for generation).
  max_seq_len: int = 4096

  # --- Numerics ---
  # Activation / compute dtype name ("bfloat16" or "float32").
  dtype: str = "bfloat16"
  # Parameter storage dtype name.
  param_dtype: str = "bfloat16"
  # Multi-token-prediction layers a checkpoint ships (counted for checkpoint bytes; loaded into
  # params["mtp"] when a checkpoint holds them; run by mlkit.model.mtp, not by the serving forward).
  n_mtp_layers: int = 0

  def __post_init__(self):
    _positive(self, "vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len")
    if self.attention not in ("mla", "gqa"):
      raise ValueError(f"ModelConfig.attention must be 'mla' or 'gqa', got {self.attention!r}")
    if self.attention == "mla":
      _non_negative(self, "q_lora_rank")
      _positive(self, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
      if self.qk_rope_head_dim % 2:
        raise ValueError(f"ModelConfig.qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")
    else:
      _positive(self, "n_kv_heads", "head_dim")
      if self.n_heads % self.n_kv_heads:
        raise ValueError(
            f"ModelConfig.n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")
      if self.head_dim % 2:
        raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
    _non_negative(self, "first_k_dense", "n_shared_experts", "n_routed_experts",
                  "index_n_heads", "index_head_dim", "index_topk", "n_mtp_layers")
    if self.first_k_dense > self.n_layers:
      raise ValueError(
          f"ModelConfig.first_k_dense ({self.first_k_dense}) exceeds n_layers ({self.n_layers})")
    if self.first_k_dense > 0:
      _positive(self, "dense_ffn_dim")
    if self.first_k_dense < self.n_layers:  # at least one MoE layer
      _positive(self, "n_routed_experts", "top_k", "moe_ffn_dim", "n_group", "topk_group")
      if self.top_k > self.n_routed_experts:
        raise ValueError(
            f"ModelConfig.top_k ({self.top_k}) exceeds n_routed_experts ({self.n_routed_experts})")
      if self.n_routed_experts % self.n_group:
        raise ValueError(
            f"ModelConfig.n_group ({self.n_group}) must divide n_routed_experts ({self.n_routed_experts})")
      if self.topk_group > self.n_group:
        raise ValueError(f"ModelConfig.topk_group ({self.topk_group}) exceeds n_group ({self.n_group})")
      if self.top_k > self.topk_group * (self.n_routed_experts // self.n_group):
        raise ValueError("ModelConfig.top_k exceeds the experts in the kept groups (topk_group)")
    if self.router not in ("sigmoid", "softmax"):
      raise ValueError(f"ModelConfig.router must be 'sigmoid' or 'softmax', got {self.router!r}")
    if not self.routed_scaling_factor > 0:
      raise ValueError(f"ModelConfig.routed_scaling_factor must be > 0, got {self.routed_scaling_factor}")
    if (self.index_n_heads > 0) != (self.index_head_dim > 0):
      raise ValueError("ModelConfig.index_head_dim and index_n_heads must both be set or both be 0")
    object.__setattr__(self, "indexer_types", tuple(self.indexer_types))  # hashable (jit static)
    if self.indexer_types:
      if self.attention != "mla" or not self.q_lora_rank:
        raise ValueError("ModelConfig.indexer_types needs MLA attention with q_lora_rank > 0 (the "
                         "indexer's queries come from the query latent)")
      if not (self.index_n_heads and self.index_topk):
        raise ValueError("ModelConfig.indexer_types needs index_n_heads, index_head_dim and "
                         "index_topk > 0")
      if len(self.indexer_types) != self.n_layers:
        raise ValueError(f"ModelConfig.indexer_types has {len(self.indexer_types)} entries for "
                         f"{self.n_layers} layers")
      bad = sorted(set(self.indexer_types) - {"full", "shared"})
      if bad:
        raise ValueError(f"ModelConfig.indexer_types entries must be 'full' or 'shared', got {bad}")
      if self.indexer_types[0] != "full":
        raise ValueError("ModelConfig.indexer_types[0] must be 'full' (a shared layer reuses the "
                         "previous full layer's selection)")
      if self.index_head_dim < self.qk_rope_head_dim:
        raise ValueError(f"ModelConfig.index_head_dim ({self.index_head_dim}) must hold the "
                         f"{self.qk_rope_head_dim} rope dims")
    if self.latent_norm_eps is not None and not self.latent_norm_eps > 0:
      raise ValueError(f"ModelConfig.latent_norm_eps must be > 0 or None, got {self.latent_norm_eps}")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in ("bfloat16", "float32"):
        raise ValueError(f"ModelConfig.{name} must be 'bfloat16' or 'float32', got {getattr(self, name)!r}")
    if not self.rms_norm_eps > 0:
      raise ValueError(f"ModelConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps}")
    if not self.rope_theta > 0:
      raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta}")

  # --- Derived quantities ---
  @property
  def qk_head_dim(self) -> int:
    """Per-head query/key dim (MLA: nope + rope; GQA: head_dim)."""
    return self.qk_nope_head_dim + self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

  @property
  def rope_dim(self) -> int:
    """Dims rotated by RoPE per head."""
    return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

  @property
  def n_moe_layers(self) -> int:
    return self.n_layers - self.first_k_dense

  def is_moe_layer(self, layer: int) -> bool:
    return layer >= self.first_k_dense

  def first_layers(self, n: int) -> "ModelConfig":
    """This config cut to its first ``n`` layers (depth sweeps, fast demos): the
    dense prefix capped at n and the per-layer indexer schedule truncated."""
    if n < 1:
      raise ValueError(f"a model needs at least one layer, got n={n}")
    return dataclasses.replace(self, n_layers=n, first_k_dense=min(self.first_k_dense, n),
                               indexer_types=self.indexer_types[:n])

  @property
  def sparse_attention(self) -> bool:
    """Whether the model runs the sparse-attention indexer (``indexer_types`` set)."""
    return bool(self.indexer_types)

  def runs_indexer(self, layer: int) -> bool:
    """Whether ``layer`` runs its own indexer (and caches its keys)."""
    return bool(self.indexer_types) and self.indexer_types[layer] == "full"

  @property
  def latent_eps(self) -> float:
    """Epsilon of MLA's query/KV latent norms."""
    return self.rms_norm_eps if self.latent_norm_eps is None else self.latent_norm_eps

  @property
  def cache_values_per_token(self) -> int:
    """Cached values per token per layer (MLA: kv_lora + rope; GQA: 2 * n_kv_heads * head_dim)."""
    if self.attention == "mla":
      return self.kv_lora_rank + self.qk_rope_head_dim
    return 2 * self.n_kv_heads * self.head_dim

  @property
  def softmax_scale(self) -> float:
    """Attention logit scale, including YaRN's mscale correction."""
    scale = self.qk_head_dim ** -0.5
    rs = self.rope_scaling
    if rs is not None and rs.factor > 1.0:
      m = yarn_mscale(rs.factor, rs.mscale_all_dim)
      scale = scale * m * m
    return scale

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), sort_keys=True)

  @classmethod
  def from_dict(cls, d: dict) -> "ModelConfig":
    d = dict(d)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - known
    if unknown:
      raise ValueError(f"ModelConfig: unknown fields {sorted(unknown)}")
    if d.get("rope_scaling") is not None:
      d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    if d.get("indexer_types") is not None:
      d["indexer_types"] = tuple(d["indexer_types"])
    return cls(**d)


def yarn_mscale(scale: float, mscale: float) -> float:
  """YaRN attention temperature: 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
  import math
  if scale <= 1.0:
    return 1.0
  return 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class HardwareConfig:
  """An accelerator's memory and peak throughput, for capacity and roofline math."""

  # Device name as reported (for tables).
  name: str
  # Device memory in bytes.
  hbm_bytes: int
  # Spec memory bandwidth in bytes/s.
  hbm_bandwidth: float
  # Peak dense bf16 FLOP/s.
  bf16_flops: float
  # Peak dense fp8 FLOP/s (0 if unsupported).
  fp8_flops: float = 0.0
  # Measured copy bandwidth in bytes/s (what a memory-bound kernel can reach).
  measured_bandwidth: float = 0.0
  # Measured bf16 matmul FLOP/s.
  measured_bf16_flops: float = 0.0

  def __post_init__(self):
    _positive(self, "hbm_bytes")
    for name in ("hbm_bandwidth", "bf16_flops"):
      if not getattr(self, name) > 0:
        raise ValueError(f"HardwareConfig.{name} must be > 0, got {getattr(self, name)}")
    for name in ("fp8_flops", "measured_bandwidth", "measured_bf16_flops"):
      if getattr(self, name) < 0:
        raise ValueError(f"HardwareConfig.{name} must be >= 0, got {getattr(self, name)}")
