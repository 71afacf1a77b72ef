"""A layer's new KV entries written into its pages (quantised to e4m3 for an fp8 pool) in
one Pallas Triton launch, and the jnp reference."""

from pallas_kernels.page_write.ops import kernel_takes, write_pages
from pallas_kernels.page_write.reference import (FP8_MAX, quantize_many, quantize_rows,
                                                 write_pages_reference)

__all__ = ["FP8_MAX", "kernel_takes", "quantize_many", "quantize_rows", "write_pages",
           "write_pages_reference"]
