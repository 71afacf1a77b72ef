"""Lightning-indexer scoring and top-k selection over paged index keys (DeepSeek Sparse Attention).

A sparse-attention decode step scores every cached token of a request with the
indexer's small heads and keeps the ``index_topk`` best; the sparse paged MLA
kernel (pallas_kernels.paged_attention.paged_mla_sparse_decode) then attends
to those positions only. docs/sparse_attention.md has the picture.

Layers as in the other kernel packages: the Triton-backend kernels (kernel.py:
scoring; topk.py: the top-k selection), the public jitted ops with ``backend=``
(ops.py) and the pure-jnp references (reference.py).
"""

from pallas_kernels.indexer.ops import IndexerBlockSizes
from pallas_kernels.indexer.ops import TopkBlockSizes
from pallas_kernels.indexer.ops import paged_index_scores
from pallas_kernels.indexer.ops import paged_index_topk
from pallas_kernels.indexer.reference import paged_index_scores_reference
from pallas_kernels.indexer.ops import topk_positions
from pallas_kernels.indexer.reference import topk_positions as topk_positions_reference

__all__ = [
    "IndexerBlockSizes",
    "TopkBlockSizes",
    "paged_index_scores",
    "paged_index_scores_reference",
    "paged_index_topk",
    "topk_positions",
    "topk_positions_reference",
]
