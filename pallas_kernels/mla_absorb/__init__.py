"""MLA's absorbed products in one Pallas Triton launch each, and their jnp references:
the value product (latent outputs times wkv_b's value half, ``absorbed_values``) and the
query product (q_nope times wkv_b's key half, scaled for an fp8 cache's decode kernels,
``absorbed_query``). docs/mla_absorb.md has the design."""

from pallas_kernels.mla_absorb.kernel import (absorbed_values, absorbed_values_partitioned,
                                              block_shape, kernel_takes)
from pallas_kernels.mla_absorb.query import AbsorbQuery, absorbed_query
from pallas_kernels.mla_absorb.reference import (absorbed_query_reference,
                                                 absorbed_values_reference)

__all__ = ["AbsorbQuery", "absorbed_query", "absorbed_query_reference", "absorbed_values",
           "absorbed_values_partitioned", "absorbed_values_reference", "block_shape",
           "kernel_takes"]
