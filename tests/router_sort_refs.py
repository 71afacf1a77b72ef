"""The MoE router's jnp references, jitted, and the routed pairs the sort tests draw.

Called eagerly, each reference compiles one small XLA program per jnp operation (and per
shape); jitted, it is one program per case.
"""

import jax
import numpy as np

from pallas_kernels.moe_router import select_experts_reference
from pallas_kernels.moe_router import sort_by_expert_local_reference
from pallas_kernels.moe_router import sort_by_expert_reference

from host_data import put

# select_experts_reference(logits, bias, **routing), one compile per shape and routing.
select_ref = jax.jit(select_experts_reference,
                     static_argnames=("top_k", "router", "n_group", "topk_group",
                                      "norm_topk_prob", "scaling"))
# sort_by_expert_reference(expert_ids, weights, n_experts).
sort_ref = jax.jit(sort_by_expert_reference, static_argnums=2)
# sort_by_expert_local_reference(expert_ids, weights, n_experts, shard, n_shards).
sort_local_ref = jax.jit(sort_by_expert_local_reference, static_argnums=(2, 4))


def pairs(seed, n, k, e):
  """(expert_ids [N, k] int32 in [0, e), weights [N, k] f32 in [0.1, 1)), on the device."""
  rng = np.random.default_rng(seed)
  return put(rng.integers(0, e, (n, k)).astype(np.int32),
             rng.uniform(0.1, 1.0, (n, k)).astype(np.float32))

