"""FP8 (e4m3, 128x128 block scales) weight-only grouped matmul for the routed experts.

``fp8_grouped_matmul`` is the Mosaic GPU kernel (W8A16: weights dequantised to bf16
in shared memory, bf16 wgmma, f32 accumulation); ``fp8_grouped_matmul_reference``
is its jnp reference. docs/fp8_matmul.md describes both.
"""

from pallas_kernels.fp8_matmul.grouped import fp8_grouped_matmul, grouped_block_sizes
from pallas_kernels.fp8_matmul.reference import check_fp8_args, fp8_grouped_matmul_reference

__all__ = ["check_fp8_args", "fp8_grouped_matmul", "fp8_grouped_matmul_reference",
           "grouped_block_sizes"]
