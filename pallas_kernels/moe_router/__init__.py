"""The MoE router's expert choice (sigmoid or softmax scores, group-limited top-k,
weights) from its logits, and the rows sorted by expert: Pallas Triton kernels, ops and
jnp references."""

from pallas_kernels.moe_router.ops import select_experts
from pallas_kernels.moe_router.reference import select_experts_reference
from pallas_kernels.moe_router.reference import (sort_by_expert_local_reference,
                                                 sort_by_expert_reference)
from pallas_kernels.moe_router.sort import sort_by_expert, sort_by_expert_local

__all__ = ["select_experts", "select_experts_reference", "sort_by_expert",
           "sort_by_expert_local", "sort_by_expert_local_reference", "sort_by_expert_reference"]
