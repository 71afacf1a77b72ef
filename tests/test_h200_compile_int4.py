"""The INT4 (W4A16) matmuls compiled for an H200 at every target shape: dense at each
attention and dense-FFN projection (TP 8), grouped at each routed-expert projection
(EP 8), decode and prefill rows, groups 32 and 128. They compile, spill no registers
and fit the shared memory of a block (see h200_compile_cases and docs/h200_compile.md).
"""

import importlib

from absl.testing import absltest, parameterized
import jax.numpy as jnp

import h200_compile_cases
from pallas_kernels.h200 import compile as hc
from pallas_kernels.h200 import kernel_readings as kc

GROUPS = kc.target_groups(("int4_matmul", "int4_grouped_matmul"))

H200CompileInt4Test = h200_compile_cases.make_test_case(__file__, GROUPS)



class GroupedRowsTest(parameterized.TestCase):
  """The grouped kernels lower at row counts that are not multiples of 8: a batch of 1 or 5
  rows with top-2 routing (the tiny test models). x used to be padded to M + tile_m rows,
  which a TMA of 8-row tiles cannot read (10 or 18 rows failed to lower)."""

  @parameterized.parameters(("kn", 2), ("nk", 10))
  def test_lowers(self, layout, m):
    e, k, n, g = 4, 256, 128, 32
    if layout == "kn":
      op = importlib.import_module("pallas_kernels.int4_matmul.int4_matmul").int4_grouped_matmul
      packed = hc.spec((e, k // 2, n), jnp.uint8)
    else:
      op = importlib.import_module("pallas_kernels.int4_matmul.nk").int4_grouped_matmul_nk
      packed = hc.spec((e, n, k), jnp.int4)
    args = (hc.spec((m, k), jnp.bfloat16), packed, hc.spec((e, k // g, n), jnp.bfloat16),
            hc.spec((e,), jnp.int32))
    report = hc.compile_for_h200(
        lambda x, p, s, gs: op(x, p, s, gs, group_size=g, backend="pallas"), *args,
        ptxas_report=False)
    self.assertNotEmpty(report.launches)


if __name__ == "__main__":
  absltest.main()
