"""Training hyper-parameters."""

from __future__ import annotations

import dataclasses

BALANCE_MODES = ("bias", "aux", "none")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """An AdamW + warmup/cosine run with MoE load balancing.

  Raises:
    ValueError: naming the offending field.
  """

  # Optimizer steps in the whole run (the cosine schedule ends here).
  steps: int = 300
  # Rows per batch.
  batch_size: int = 8
  # Tokens per row (the model sees seq_len - 1 inputs per row).
  seq_len: int = 128
  # Peak learning rate.
  learning_rate: float = 3e-3
  # Linear warm-up steps from 0 to the peak.
  warmup_steps: int = 30
  # Final learning rate as a fraction of the peak (cosine decay target).
  min_lr_ratio: float = 0.1
  # AdamW decoupled weight decay (matrices only; norms, router bias and embeddings excluded).
  weight_decay: float = 0.01
  # AdamW betas.
  b1: float = 0.9
  b2: float = 0.95
  # Global gradient-norm clip.
  clip_norm: float = 1.0
  # MoE balancing: "bias" (DeepSeek-V3 auxiliary-loss-free), "aux" (auxiliary loss) or "none".
  balance: str = "bias"
  # Bias step per update for "bias": b_i += rate * sign(mean load - load_i).
  bias_update_rate: float = 1e-3
  # Weight of the auxiliary balance loss alpha * E * sum_i f_i P_i for "aux".
  aux_loss_weight: float = 1e-2
  # Weight lambda of the multi-token-prediction loss (DeepSeek-V3: 0.3 early, 0.1 later), added
  # when the model declares MTP layers (ModelConfig.n_mtp_layers). 0 (the default, so that a
  # preset gaining MTP layers trains as before unless asked) disables it and leaves the MTP
  # layers out of the train state.
  mtp_loss_weight: float = 0.0
  # None: dropless training through the same exact ragged grouped matmul serving uses (on CPU
  # its block-sparse form, ``mlkit.quant.dispatch.ragged_dot_f32``). A float: capacity-slab
  # dispatch (``mlkit.train.experts.CapacityExperts``) with this many slab rows per expert as a
  # multiple of the mean, dropping overflow rows as GShard/Switch training does.
  capacity_factor: float | None = None
  # Compute dtype of activations and matmuls ("bfloat16" or "float32"); master weights stay f32.
  compute_dtype: str = "bfloat16"
  # Seed of parameter init and of the data stream (batch s uses seed (seed, s)).
  seed: int = 0
  # Print progress every this many steps (0: never).
  log_every: int = 10
  # Save a checkpoint every this many steps (0: only at the end); needs a checkpoint dir.
  checkpoint_every: int = 100

  def __post_init__(self):
    for name in ("steps", "batch_size", "seq_len"):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"TrainConfig.{name} must be a positive int, got {v!r}")
    if self.seq_len < 2:
      raise ValueError(f"TrainConfig.seq_len must be >= 2, got {self.seq_len}")
    for name in ("warmup_steps", "log_every", "checkpoint_every", "seed"):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"TrainConfig.{name} must be a non-negative int, got {v!r}")
    if not self.learning_rate > 0:
      raise ValueError(f"TrainConfig.learning_rate must be > 0, got {self.learning_rate}")
    if not 0 <= self.min_lr_ratio <= 1:
      raise ValueError(f"TrainConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
    if not self.weight_decay >= 0:
      raise ValueError(f"TrainConfig.weight_decay must be >= 0, got {self.weight_decay}")
    for name in ("b1", "b2"):
      if not 0 <= getattr(self, name) < 1:
        raise ValueError(f"TrainConfig.{name} must be in [0, 1), got {getattr(self, name)}")
    if not self.clip_norm > 0:
      raise ValueError(f"TrainConfig.clip_norm must be > 0, got {self.clip_norm}")
    if self.balance not in BALANCE_MODES:
      raise ValueError(f"TrainConfig.balance must be one of {BALANCE_MODES}, got {self.balance!r}")
    if not self.bias_update_rate >= 0:
      raise ValueError(f"TrainConfig.bias_update_rate must be >= 0, got {self.bias_update_rate}")
    if not self.aux_loss_weight >= 0:
      raise ValueError(f"TrainConfig.aux_loss_weight must be >= 0, got {self.aux_loss_weight}")
    if not (isinstance(self.mtp_loss_weight, (int, float)) and self.mtp_loss_weight >= 0):
      raise ValueError(f"TrainConfig.mtp_loss_weight must be >= 0, got {self.mtp_loss_weight!r}")
    if self.capacity_factor is not None and not (
        isinstance(self.capacity_factor, (int, float)) and self.capacity_factor >= 1):
      raise ValueError(f"TrainConfig.capacity_factor must be None (dropless) or >= 1, "
                       f"got {self.capacity_factor!r}")
    if self.compute_dtype not in ("bfloat16", "float32"):
      raise ValueError(f"TrainConfig.compute_dtype must be 'bfloat16' or 'float32', "
                       f"got {self.compute_dtype!r}")
