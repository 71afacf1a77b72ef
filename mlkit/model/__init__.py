"""The functional MLA/GQA MoE decoder.

``apply(params, tokens, positions, cache, cfg=...) -> (logits, cache)``; params are a
plain pytree built by :func:`init_params`; the cache is an explicit argument.
:func:`mtp_forward` runs a checkpoint's multi-token-prediction layers.
"""

from mlkit.model.cache import ContiguousKVCache, init_cache
from mlkit.model.params import (active_params_per_token, check_params, count_params, init_params,
                                param_specs)
from mlkit.model.mtp import mtp_forward, mtp_forward_all
from mlkit.model.transformer import apply, apply_jit, decoder_layer, forward, segment_positions

__all__ = ["ContiguousKVCache", "active_params_per_token", "apply", "apply_jit", "check_params",
           "count_params", "decoder_layer", "forward", "init_cache", "init_params", "mtp_forward",
           "mtp_forward_all", "param_specs", "segment_positions"]
