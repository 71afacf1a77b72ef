"""The MoE router's expert choice (sigmoid or softmax scores, group-limited top-k,
weights) from its logits: Pallas Triton kernel, op and jnp reference."""

from pallas_kernels.moe_router.ops import select_experts
from pallas_kernels.moe_router.reference import select_experts_reference

__all__ = ["select_experts", "select_experts_reference"]
