"""The grouped kernels' schedule in one Pallas Triton launch (``schedule_kernel``).

Interpret mode against the jnp ``grouped_schedule`` (the same table, bit for bit) over
ragged routings, empty experts, sums short of and past M, E from 1 to Kimi K2.6's 384;
bad input; and compiles for an H200 at the target shapes: one launch, no spills.
"""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import h200_compile_cases
from pallas_kernels.int4_matmul.int4_matmul import _ROW_ALIGN
from pallas_kernels.int4_matmul.int4_matmul import grouped_schedule
from pallas_kernels.int4_matmul.int4_matmul import grouped_tile_bound
from pallas_kernels.int4_matmul.schedule_kernel import grouped_schedule_pallas
from pallas_kernels.int4_matmul.schedule_kernel import schedule_width


def _routings(m, e, seed, trials):
  rng = np.random.default_rng(seed)
  for trial in range(trials):
    # Ragged, with empty experts; some sums short of M, one past it.
    gs = rng.multinomial(m - trial % 3 * (m // 4), rng.dirichlet(np.ones(e) * 0.3))
    if trial == trials - 1:
      gs[-1] += 7
    yield gs.astype(np.int32)


class ScheduleKernelTest(parameterized.TestCase):

  @parameterized.parameters(
      (37, 6, 8), (64, 48, 8), (64, 8, 16), (5, 16, 8), (300, 5, 128), (1, 1, 8),
      (512, 48, 8), (4096, 384, 64), (10240, 48, 128))
  def test_equals_the_jnp_schedule(self, m, e, tile_m):
    bound = grouped_tile_bound(m, e, tile_m)
    run = jax.jit(lambda gs: grouped_schedule_pallas(
        gs, m=m, tile_m=tile_m, num_tiles=bound, row_align=_ROW_ALIGN, interpret=True))
    for gs in _routings(m, e, seed=m + e, trials=4):
      want = np.asarray(grouped_schedule(jnp.asarray(gs), m, tile_m, bound))
      got = np.asarray(run(jnp.asarray(gs)))
      self.assertEqual(got.shape, (5, schedule_width(bound)))
      np.testing.assert_array_equal(got[:, :bound], want)
      # Past the bound: unused tiles (expert -1, no rows), the count of those in use.
      np.testing.assert_array_equal(got[0, bound:], -1)
      np.testing.assert_array_equal(got[1:4, bound:], 0)
      np.testing.assert_array_equal(got[4], want[4, 0])

  def test_bad_group_sizes_raise(self):
    for gs in (jnp.zeros((4,), jnp.float32), jnp.zeros((2, 2), jnp.int32),
               jnp.zeros((0,), jnp.int32)):
      with self.assertRaisesRegex(ValueError, "group_sizes must be int32"):
        grouped_schedule_pallas(gs, m=8, tile_m=8, num_tiles=4, row_align=_ROW_ALIGN,
                                interpret=True)


class ScheduleKernelH200Test(h200_compile_cases.H200CompilerTest):
  """Compiles for sm_90a at the grouped kernels' decode and prefill shapes."""

  @parameterized.named_parameters(
      ("kimi_decode", 512, 48, 8), ("glm_decode", 512, 32, 16), ("kimi_prefill", 10240, 48, 128),
      ("one_device_kimi", 4096, 384, 64))
  def test_one_launch_without_spills(self, m, e, tile_m):
    from pallas_kernels.h200 import compile as hc
    bound = grouped_tile_bound(m, e, tile_m)
    self.assert_one_launch_without_spills(
        lambda gs: grouped_schedule_pallas(gs, m=m, tile_m=tile_m, num_tiles=bound,
                                           row_align=_ROW_ALIGN),
        hc.spec((e,), jnp.int32), kernel="grouped_schedule")

if __name__ == "__main__":
  absltest.main()
