"""Paged MLA and GQA decode attention and the page-tag check, compiled for an H200 at
every target shape: they compile, spill no registers and fit the shared memory of a
block (see h200_compile_cases and docs/h200_compile.md).

Attention compiles both kernels where the shape allows: the one the engine runs
("auto": Mosaic GPU at every target shape) and the Triton alternative.
"""

from absl.testing import absltest

import h200_compile_cases
from pallas_kernels.h200 import kernel_readings as kc

GROUPS = kc.target_groups(("paged_mla_decode", "paged_gqa_decode", "tag_check"),
                          other_impl=True)

H200CompileAttentionTest = h200_compile_cases.make_test_case(__file__, GROUPS)

if __name__ == "__main__":
  absltest.main()
