"""The residual add at the end of a decoder layer and the next layer's RMSNorm in one
Pallas Triton launch (``residual_norm``), and the jnp reference."""

from pallas_kernels.residual_norm.ops import (chunk_for, kernel_takes, residual_norm,
                                              residual_norm_partitioned)
from pallas_kernels.residual_norm.reference import (add_deltas, add_residual,
                                                    residual_norm_reference, rms_norm)

__all__ = ["add_deltas", "add_residual", "chunk_for", "kernel_takes", "residual_norm",
           "residual_norm_partitioned", "residual_norm_reference", "rms_norm"]
