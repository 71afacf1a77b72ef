"""Weight formats and the matmuls that dispatch on them.

Model code calls :func:`matmul`, :func:`grouped_matmul` and :func:`dequantize`
and never branches on precision: a weight's format lives in its type.
"""

from mlkit.quant.dispatch import dequantize, grouped_matmul, matmul

__all__ = ["dequantize", "grouped_matmul", "matmul"]
