"""MLA's absorbed value product (latent outputs times wkv_b's value half) in one Pallas
Triton launch (``absorbed_values``), and its jnp reference. docs/mla_absorb.md has the
design."""

from pallas_kernels.mla_absorb.kernel import (absorbed_values, absorbed_values_partitioned,
                                              block_shape, kernel_takes)
from pallas_kernels.mla_absorb.reference import absorbed_values_reference

__all__ = ["absorbed_values", "absorbed_values_partitioned", "absorbed_values_reference",
           "block_shape", "kernel_takes"]
