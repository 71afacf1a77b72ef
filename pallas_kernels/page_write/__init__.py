"""A layer's new KV entries written into their pages (quantised to e4m3 for an fp8 pool) in
one Pallas Triton launch, MLA's entries with their RMSNorm and rope in the same launch,
and the jnp references."""

from pallas_kernels.page_write.mla import MlaProjection, mla_kernel_takes, write_mla_pages
from pallas_kernels.page_write.ops import kernel_takes, write_pages
from pallas_kernels.page_write.reference import (FP8_MAX, mla_entries_reference, quantize_many,
                                                 quantize_rows, write_pages_reference)

__all__ = ["FP8_MAX", "MlaProjection", "kernel_takes", "mla_entries_reference",
           "mla_kernel_takes", "quantize_many", "quantize_rows", "write_mla_pages",
           "write_pages", "write_pages_reference"]
