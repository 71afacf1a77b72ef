"""Checkpoint I/O: orbax save/restore of params + config, and Hugging Face import/export.

Orbax (:mod:`mlkit.checkpoint.orbax_io`): ``save_checkpoint`` / ``load_checkpoint``.
Hugging Face DeepSeek-V3 / Kimi-K2 layout (:mod:`mlkit.checkpoint.hf`):
``config_from_hf``, ``config_to_hf``, ``load_hf_checkpoint`` (``open_hf_checkpoint`` to read
it leaf by leaf), ``save_hf_checkpoint``.
Unreadable, corrupt or inconsistent files raise ``CheckpointError`` (a ValueError
naming the file).
"""

from mlkit.checkpoint.errors import CheckpointError
from mlkit.checkpoint.hf import (HFCheckpoint, config_from_hf, config_to_hf, dequantize_fp8_blocks,
                                 hf_layout, load_hf_checkpoint, open_hf_checkpoint,
                                 save_hf_checkpoint)
from mlkit.checkpoint.orbax_io import checkpoint_steps, load_checkpoint, save_checkpoint

__all__ = ["CheckpointError", "HFCheckpoint", "checkpoint_steps", "config_from_hf", "config_to_hf",
           "dequantize_fp8_blocks", "hf_layout", "load_checkpoint", "load_hf_checkpoint",
           "open_hf_checkpoint", "save_checkpoint", "save_hf_checkpoint"]
