"""Hugging Face checkpoints in the DeepSeek-V3 / Kimi-K2 layout: import and export.

A checkpoint directory holds ``config.json`` plus ``model.safetensors``, or shards
``model-0000i-of-0000N.safetensors`` listed in ``model.safetensors.index.json``.

The package is split by job, so that each can be read (and changed) on its own.
Each module imports only those above it in this list (save and load are siblings),
never the other way:

- :mod:`~mlkit.checkpoint.hf.config`: ``config.json`` <-> ModelConfig
  (:func:`config_from_hf`, :func:`config_to_hf`) and the architecture constants;
- :mod:`~mlkit.checkpoint.hf.names`: our param paths <-> Hugging Face tensor names
  (:func:`hf_layout`; the name and layout table is in its docstring);
- :mod:`~mlkit.checkpoint.hf.safetensors`: reading safetensors files (the lazy
  ``pread`` reader, stored dtypes, fp8 block-scale checks and
  :func:`dequantize_fp8_blocks`);
- :mod:`~mlkit.checkpoint.hf.quantized`: the quantised formats publishers ship
  (``quantization_config``: compressed-tensors INT4, FP8 block scales) and the
  bit-exact conversion of their tensors to and from ours;
- :mod:`~mlkit.checkpoint.hf.load`: :func:`load_hf_checkpoint`,
  :func:`open_hf_checkpoint` and :class:`HFCheckpoint` (streaming, quantising and
  sharded placement, progress logging);
- :mod:`~mlkit.checkpoint.hf.save`: :func:`save_hf_checkpoint`.

The names below are those the single module ``hf.py`` exported, so callers import
them from here (or from :mod:`mlkit.checkpoint`) as before. Log records keep the
name ``mlkit.checkpoint.hf``.
"""

from mlkit.checkpoint.hf.config import (ARCHITECTURE, CONFIG_FILE, GLM_ARCHITECTURE,
                                        GLM_MODEL_TYPE, MODEL_TYPES, V32_ARCHITECTURE,
                                        V32_MODEL_TYPE, config_from_hf, config_to_hf)
from mlkit.checkpoint.hf.load import HFCheckpoint, load_hf_checkpoint, open_hf_checkpoint
from mlkit.checkpoint.hf.names import hf_layout
from mlkit.checkpoint.hf.safetensors import INDEX_FILE, SINGLE_FILE, dequantize_fp8_blocks
from mlkit.checkpoint.hf.save import save_hf_checkpoint

__all__ = ["ARCHITECTURE", "CONFIG_FILE", "GLM_ARCHITECTURE", "GLM_MODEL_TYPE", "HFCheckpoint",
           "INDEX_FILE", "MODEL_TYPES", "SINGLE_FILE", "V32_ARCHITECTURE", "V32_MODEL_TYPE",
           "config_from_hf", "config_to_hf", "dequantize_fp8_blocks", "hf_layout",
           "load_hf_checkpoint", "open_hf_checkpoint", "save_hf_checkpoint"]
