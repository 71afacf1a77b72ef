"""Paged decode attention (MLA absorbed form and GQA; sparse MLA), bf16 or fp8 KV pages.

Three layers, as in JAX's Pallas ops: the kernels (Mosaic GPU: mla_mgpu.py,
gqa_mgpu.py; Triton fallback for other shapes: triton_kernels.py), the public
jitted wrappers with ``backend=`` (ops.py) and the pure-jnp references
(reference.py); block sizes in block_sizes.py.
"""

from pallas_kernels.paged_attention.block_sizes import BlockSizes
from pallas_kernels.paged_attention.block_sizes import SparseBlockSizes
from pallas_kernels.paged_attention.ops import paged_gqa_decode
from pallas_kernels.paged_attention.ops import paged_mla_decode
from pallas_kernels.paged_attention.ops import paged_mla_sparse_decode
from pallas_kernels.paged_attention.reference import combine_splits
from pallas_kernels.paged_attention.reference import paged_gqa_decode_reference
from pallas_kernels.paged_attention.reference import paged_mla_decode_reference
from pallas_kernels.paged_attention.reference import paged_mla_sparse_decode_reference

__all__ = [
    "BlockSizes",
    "SparseBlockSizes",
    "combine_splits",
    "paged_gqa_decode",
    "paged_gqa_decode_reference",
    "paged_mla_decode",
    "paged_mla_decode_reference",
    "paged_mla_sparse_decode",
    "paged_mla_sparse_decode_reference",
]
