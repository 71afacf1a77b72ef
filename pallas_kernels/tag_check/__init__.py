"""Batched KV page-integrity (tag) check: kernel, jitted op, jnp reference."""

from pallas_kernels.tag_check.ops import BlockSizes
from pallas_kernels.tag_check.ops import tag_check
from pallas_kernels.tag_check.reference import tag_check_reference

__all__ = ["BlockSizes", "tag_check", "tag_check_reference"]
