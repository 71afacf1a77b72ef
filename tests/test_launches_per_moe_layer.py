"""Kimi K2.6's decode step (fp8 KV, 8x H200): the kernel launches one MoE layer adds.

Compiled for an H200 topology from the CPU at 1 and 2 MoE layers
(``mlkit.plan.launch_count``); docs/step_time.md, "Launches per MoE layer", lists what
the count is made of. The bound is the count as built, so that it cannot creep back.
"""

from __future__ import annotations

import unittest

from mlkit.plan import launch_count as lc

# Launches one MoE layer adds to the decode step with an fp8 KV pool.
MAX_LAUNCHES_PER_MOE_LAYER = 24
# The Pallas kernels a layer runs once each (by their launch names).
LAYER_KERNELS = ("residual_norm", "page_write_mla", "mla_absorbed_query", "select_experts",
                 "sort_by_expert", "swiglu_parts", "mla_absorbed_values")


class LaunchesPerMoeLayerTest(unittest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.found = lc.per_moe_layer("float8_e4m3fn")

  def test_the_count_holds(self):
    self.assertLessEqual(self.found.per_layer, MAX_LAUNCHES_PER_MOE_LAYER,
                         sorted(self.found.by_op().items()))
    self.assertEqual(self.found.per_layer, sum(self.found.by_kind().values()))

  def test_each_layer_kernel_runs_once(self):
    kinds = self.found.by_kind()
    for name in LAYER_KERNELS:
      self.assertEqual(kinds[name], 1, name)

  def test_no_xla_sort_or_scatter_in_the_layer(self):
    # The routing's sort and the page write's scatters are Pallas kernels: XLA's fallback
    # sort is many small kernels, a scatter one launch per array.
    for kind in self.found.by_kind():
      self.assertNotEqual(kind, "sort")
      self.assertNotIn("scatter", kind)

  def test_unknown_kv_dtype_is_refused(self):
    with self.assertRaisesRegex(ValueError, "kv_dtype"):
      lc.decode_launches(1, "float16")


if __name__ == "__main__":
  unittest.main()
