"""Weight formats and the matmuls that dispatch on them.

Model code calls :func:`matmul`, :func:`grouped_matmul` and :func:`dequantize`
and never branches on precision: a weight's format lives in its type.
Importing this package registers the int4 and fp8 formats on those functions.
"""

from mlkit.quant.dispatch import dequantize, grouped_matmul, matmul
from mlkit.quant.formats import (Fp8Weight, Int4Weight, pack_int4, quantize_fp8, quantize_int4,
                                 unpack_int4)
from mlkit.quant.reference import (fp8_grouped_matmul_reference, fp8_matmul_reference,
                                   int4_grouped_matmul_reference, int4_matmul_reference)

__all__ = ["Fp8Weight", "Int4Weight", "dequantize", "fp8_grouped_matmul_reference",
           "fp8_matmul_reference", "grouped_matmul", "int4_grouped_matmul_reference",
           "int4_matmul_reference", "matmul", "pack_int4", "quantize_fp8", "quantize_int4",
           "unpack_int4"]
