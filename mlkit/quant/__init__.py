"""Weight formats, quantisers, recipes and the matmuls that dispatch on formats.

Model code calls :func:`matmul`, :func:`grouped_matmul`, :func:`grouped_matmuls` and
:func:`dequantize`
and never branches on precision: a weight's format lives in its type.
Importing this package registers the int4 and fp8 formats on those functions.
"""

from mlkit.quant.accounting import GB, GIB, WeightBytes, checkpoint_specs, weight_bytes
from mlkit.quant.dispatch import dequantize, grouped_matmul, grouped_matmuls, matmul
from mlkit.quant.formats import (Fp8Weight, Int4Weight, pack_int4, quantize_fp8, quantize_int4,
                                 relaid_int4, unpack_int4)
from mlkit.quant.gptq import (CalibrationStats, calibration_stats, collect_calibration,
                              gptq_quantize_int4, merge_calibration)
from mlkit.quant.recipe import (BF16, FP8_ALL, INT4_EXPERTS, INT4_EXPERTS_FP8_REST,
                                INT4_EXPERTS_GPTQ, KEEP, RECIPES, Fp8Spec, Int4Spec, Keep, Recipe,
                                Rule, apply_recipe, assign_formats, calibration_paths,
                                dequantize_params, fp8_all, int4_all, int4_experts,
                                published_conversion, quantize_params)
from mlkit.quant import kernels as _kernels  # noqa: F401  (registers the formats' matmuls)
from mlkit.quant.kernels import kernel_int4_layout, kernel_layout
from mlkit.quant.reference import (fp8_grouped_matmul_reference, fp8_matmul_reference,
                                   int4_grouped_matmul_reference, int4_matmul_reference)

__all__ = [
    "BF16", "FP8_ALL", "GB", "GIB", "INT4_EXPERTS", "INT4_EXPERTS_FP8_REST", "INT4_EXPERTS_GPTQ",
    "KEEP", "RECIPES", "CalibrationStats", "Fp8Spec", "Fp8Weight", "Int4Spec", "Int4Weight", "Keep",
    "Recipe", "Rule", "WeightBytes", "apply_recipe", "assign_formats", "calibration_paths", "calibration_stats",
    "checkpoint_specs", "collect_calibration", "dequantize", "dequantize_params", "fp8_all",
    "fp8_grouped_matmul_reference", "fp8_matmul_reference", "gptq_quantize_int4", "grouped_matmul", "grouped_matmuls",
    "int4_all", "int4_experts", "int4_grouped_matmul_reference", "int4_matmul_reference",
    "kernel_int4_layout", "kernel_layout", "matmul",
    "merge_calibration", "pack_int4", "published_conversion", "quantize_fp8", "quantize_int4", "quantize_params",
    "relaid_int4", "unpack_int4", "weight_bytes",
]
