"""The INT4 (W4A16) matmuls compiled for an H200 at every target shape: dense at each
attention and dense-FFN projection (TP 8), grouped at each routed-expert projection
(EP 8), decode and prefill rows, groups 32 and 128. They compile, spill no registers
and fit the shared memory of a block (see h200_compile_cases and docs/h200_compile.md).
"""

from absl.testing import absltest

import h200_compile_cases
from pallas_kernels.h200 import kernel_readings as kc

GROUPS = kc.target_groups(("int4_matmul", "int4_grouped_matmul"))

H200CompileInt4Test = h200_compile_cases.make_test_case(__file__, GROUPS)

if __name__ == "__main__":
  absltest.main()
