"""scripts/mla_producer_registers.py: what the MLA kernel's compute warpgroups need
beside a producer shows as spills once their setmaxnreg limit is too low.

ptxas reports such a kernel's launch allocation (168 registers) whatever its
compute code needs, so the zero-spill compile tests are the only guard on that
code's registers. This checks that the guard can see: the engine's fp8-QK kernel
compiles clean at its limit and spills when the limit is lowered to 216 (the
script's table: 132 B). If Mosaic GPU stopped emitting setmaxnreg, or ptxas stopped
holding the compute code to it, the second reading would be 0.
"""

import importlib.util
import os

from absl.testing import absltest

from pallas_kernels.h200 import env as h200_env
from pallas_kernels.paged_attention import mla_mgpu


def _script():
  path = os.path.join(os.path.dirname(__file__), "..", "scripts", "mla_producer_registers.py")
  spec = importlib.util.spec_from_file_location("mla_producer_registers", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


class ProducerRegisterLimitTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    problems = h200_env.check()
    if problems:  # never skip: `make test` installs the compiler packages
      raise RuntimeError("the H200 compile tests cannot run: " + "; ".join(problems))

  def test_a_lowered_limit_shows_as_spills(self):
    script = _script()
    builds = dict(script.variants())
    qk8 = builds["mgpu-heads-qk8 fp8"]
    self.assertEqual(qk8.block_sizes.loads, "producer")
    self.assertEqual(script.spills_at(qk8, mla_mgpu.COMPUTE_REGS), 0)
    self.assertGreater(script.spills_at(qk8, 216), 0)
    self.assertEqual(mla_mgpu.COMPUTE_REGS, 240)  # restored


if __name__ == "__main__":
  absltest.main()
