"""Training: an optax loop for the small presets (AdamW, warm-up + cosine, clipping,
bf16 compute over f32 master weights, MoE balancing by bias update or aux loss,
orbax checkpoints with resume, progress lines and a loss-curve PNG), with DeepSeek-V3's
multi-token-prediction loss when ``TrainConfig.mtp_loss_weight`` > 0.

Never imports ``mlkit.engine``.
"""

from mlkit.train.config import BALANCE_MODES, TrainConfig
from mlkit.train.experts import CapacityExperts, dropped_fraction, expert_capacity, wrap_experts
from mlkit.train.loop import (TrainResult, checkpoint_manager, compute_config, init_train_state,
                              loss_fn, lr_schedule, make_optimizer, plot_loss,
                              restore_train_state, save_train_state, train, train_step,
                              trains_mtp, update_router_bias)

__all__ = ["BALANCE_MODES", "CapacityExperts", "TrainConfig", "TrainResult", "checkpoint_manager",
           "compute_config", "dropped_fraction", "expert_capacity", "init_train_state", "loss_fn",
           "lr_schedule", "make_optimizer", "plot_loss", "restore_train_state",
           "save_train_state", "train", "train_step", "trains_mtp", "update_router_bias",
           "wrap_experts"]
