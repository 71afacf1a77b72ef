"""The attention kernels' producer warpgroups (MLA, both kernels; GQA's opt-in
one), compiled for an H200: what the interpreter cannot check.

* Registers (scripts/mla_producer_registers.py): ptxas reports the heads-in-M
  kernel's launch allocation (168 registers) whatever its compute code needs, so the
  zero-spill compile tests are the only guard on that code's registers. The
  engine's fp8-QK kernel must compile clean at its limit and spill when the limit is
  lowered to 216 (the script's table: 132 B). If Mosaic GPU stopped emitting
  setmaxnreg, or ptxas stopped holding the compute code to it, the second reading
  would be 0.
* Barriers in the PTX: once the warpgroups branch, a CTA-wide barrier (bar.sync 0)
  in the compute path would wait for the producer, which never reaches it: a hang
  on a GPU that the interpreter, which runs the Pallas program and not the PTX,
  would not show. Every CTA-wide barrier must come before the first TMA (the
  prologue's, after the mbarriers are initialised), and every other one must be a
  warpgroup's (128 threads).
"""

import functools
import importlib.util
import os
import re
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized

import h200_compile_cases
from pallas_kernels.h200 import compile as hc
from pallas_kernels.h200 import kernel_readings as kc
from pallas_kernels.paged_attention import mla_mgpu


def _script():
  path = os.path.join(os.path.dirname(__file__), "..", "scripts", "mla_producer_registers.py")
  spec = importlib.util.spec_from_file_location("mla_producer_registers", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


class RegisterSplitTest(absltest.TestCase):
  """setmaxnreg moves registers within the CTA's launch allocation; asking for more
  hangs a GPU (the interpreter ignores setmaxnreg), so the kernel refuses it."""

  def test_the_split_fits_the_pool(self):
    self.assertEqual(mla_mgpu.LAUNCH_REGS, 168)  # 65,536 registers over 384 threads
    self.assertLessEqual(2 * mla_mgpu.COMPUTE_REGS + mla_mgpu.PRODUCER_REGS,
                         3 * mla_mgpu.LAUNCH_REGS)
    mla_mgpu.check_register_split(mla_mgpu.COMPUTE_REGS, mla_mgpu.PRODUCER_REGS)

  def test_a_split_over_the_pool_or_off_the_grid_raises(self):
    # 2 x 240 + 32 = 512 of a pool of 504: the second compute warpgroup would wait.
    with self.assertRaisesRegex(ValueError, "wait forever"):
      mla_mgpu.check_register_split(240, 32)
    with self.assertRaisesRegex(ValueError, "multiple of 8"):
      mla_mgpu.check_register_split(236, 24)
    with self.assertRaisesRegex(ValueError, r"\[24, 256\]"):
      mla_mgpu.check_register_split(240, 16)

  def test_the_kernel_checks_its_split(self):
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    from host_data import put  # pylint: disable=g-import-not-at-top
    b, h, c, r, n, ps = 1, 64, 256, 64, 2, 64
    # Made on the host and placed as they are (the kernel refuses before it reads them).
    q, qr, kc_, kr, tables, lengths, pieces = put(
        np.zeros((b, h, c), jnp.bfloat16), np.zeros((b, h, r), jnp.bfloat16),
        np.zeros((n, ps, c), jnp.bfloat16), np.zeros((n, ps, r), jnp.bfloat16),
        np.zeros((b, 2), np.int32), np.ones((b,), np.int32), np.zeros((3, 4), np.int32))
    args = (q, qr, None, kc_, kr, None, None, tables, lengths, pieces)
    with mock.patch.object(mla_mgpu, "COMPUTE_REGS", 248):
      with self.assertRaisesRegex(ValueError, "wait forever"):
        mla_mgpu.mla_decode_mgpu(*args, scale=1.0, producer=True)


class H200Test(h200_compile_cases.H200CompilerTest):
  """Compiles for an H200; never skipped (`make test` installs the compiler packages)."""


class ProducerRegisterLimitTest(H200Test):

  def test_a_lowered_limit_shows_as_spills(self):
    script = _script()
    builds = dict(script.variants())
    qk8 = builds["mgpu-heads-qk8 fp8"]
    self.assertEqual(qk8.block_sizes.loads, "producer")
    # At the kernel's own limits the script's compile is the barrier test's (the same
    # build, and the split spills_at would set is the module's): read from that one.
    build, readings, _ = _compiled_with_ptx(*_QK8)
    self.assertEqual(build, qk8)
    self.assertEqual(mla_mgpu.PRODUCER_REGS,
                     min(256, 3 * mla_mgpu.LAUNCH_REGS - 2 * mla_mgpu.COMPUTE_REGS))
    self.assertIsNone(readings["error"])
    self.assertEqual(readings["spill_stores"] + readings["spill_loads"], 0)
    self.assertGreater(script.spills_at(qk8, 216), 0)
    self.assertEqual(mla_mgpu.COMPUTE_REGS, 240)  # restored


def _producer_build(case: str, variant: str) -> kc.Build:
  for g in kc.target_groups(("paged_mla_decode", "paged_gqa_decode"), other_impl=True,
                            only=[case]):
    for b in g.builds:
      if b.case.name == case and b.variant == variant:
        return b
  raise LookupError(f"no {variant} build of {case}")


# The engine's fp8-QK MLA build: read by both the register-limit and the barrier tests.
_QK8 = ("mla/dp/fp8/b8/ctx32768", "mgpu-heads-qk8")


@functools.cache
def _compiled_with_ptx(case: str, variant: str) -> tuple[kc.Build, dict, list[str]]:
  """One H200 compile of a producer build with Mosaic GPU's PTX read (read_mosaic_ptx):
  (the build, its readings, the PTX of its decode kernel(s); the op also builds the
  merge of its pieces, left out)."""
  build = _producer_build(case, variant)
  modules, readings = hc.read_mosaic_ptx(lambda: kc.compile_build(build))
  ptx = [text for name, text in modules if not name.startswith("merge_pieces")]
  return build, readings, ptx


_BARRIER = re.compile(r"^\s*(?:@%p\d+\s+)?(bar\.sync|barrier\.sync(?:\.aligned)?)\s+([^;]*);",
                      re.MULTILINE)


def barrier_problems(ptx: str) -> list[str]:
  """What is wrong with a producer kernel's named barriers (module docstring); [] if
  every CTA-wide one comes before the first TMA and every other is a warpgroup's."""
  first_tma = ptx.find("cp.async.bulk.tensor")
  if first_tma < 0:
    return ["no TMA in the PTX"]
  barriers = [(m.start(), [a.strip() for a in m.group(2).split(",")])
              for m in _BARRIER.finditer(ptx)]
  out = []
  cta_wide = [pos for pos, args in barriers if len(args) == 1]
  if not cta_wide:
    out.append("no CTA-wide barrier found: the prologue has one, so the parser is blind")
  late = [pos for pos in cta_wide if pos > first_tma]
  if late:
    line = ptx.count("\n", 0, late[0]) + 1
    out.append(f"{len(late)} CTA-wide barrier(s) after the first TMA, first on line {line}")
  counts = {args[1] for _, args in barriers if len(args) == 2}
  if counts != {"128"}:
    out.append(f"named barriers over {sorted(counts)} threads, not one warpgroup's 128")
  return out


class ProducerPtxTest(H200Test):

  @parameterized.parameters(_QK8, ("mla/tp8/fp8/b8/ctx32768", "mgpu-tokens"),
                            ("gqa/g4/fp8/b64/ctx4096", "mgpu-producer"))
  def test_no_cta_wide_barrier_after_the_warpgroups_branch(self, case, variant):
    build, readings, ptx = _compiled_with_ptx(case, variant)
    self.assertIn("producer", (build.block_sizes.loads, build.block_sizes.gqa_loads))
    self.assertIsNone(readings["error"])
    self.assertLen(ptx, 1)  # the decode kernel's
    self.assertEqual(barrier_problems(ptx[0]), [])

  def test_the_barrier_check_sees_a_late_cta_wide_barrier(self):
    """barrier_problems on PTX written for it: clean, then with a CTA-wide barrier in
    the warpgroups' code, then with a barrier over two warpgroups."""
    ok = ("\tmbarrier.init.shared::cta.b64 [%r1], %r2;\n\tbar.sync \t0;\n"
          "\tcp.async.bulk.tensor.2d.shared::cluster.global [%r3], [%rd1, {%r4, %r5}], [%r6];\n"
          "\tbar.sync %r7, 128;\n")
    self.assertEqual(barrier_problems(ok), [])
    self.assertRegex(" ".join(barrier_problems(ok + "\t@%p3 bar.sync \t0;\n")),
                     "after the first TMA, first on line 5")
    self.assertRegex(" ".join(barrier_problems(ok + "\tbar.sync %r7, 256;\n")), "256")
    self.assertRegex(" ".join(barrier_problems(ok.replace("\tbar.sync \t0;\n", ""))),
                     "blind")


if __name__ == "__main__":
  absltest.main()
