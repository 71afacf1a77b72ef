"""Shared body of the H200 compile tests (tests/test_h200_compile_*.py).

Each test module picks kernels from pallas_kernels.targets and gets one test per
distinct compile (pallas_kernels.h200.kernel_readings.plan): it compiles that build
for an H200 (sm_90a) with XLA's GPU compiler and ptxas, writes the readings of every
target case it covers to results/h200_kernel_compile/<module>.json, and asserts: it
compiles, zero register spills, shared memory within the per-block limit. A witness
test per kernel family compiles a second, most different member of a shared
compile on its own and asserts the same readings (registers within
kernel_readings.REGISTER_NOISE): the evidence, in every run, that the cases a compile
covers really build the same kernel. A compile within 2 * REGISTER_NOISE registers of
the limit covers nothing but itself (kernel_readings.compile_group). Several modules
(attention, INT4, sparse attention), so that pytest-xdist's two workers compile at once.
"""

from __future__ import annotations

import functools
import json
import os
import re

from absl.testing import parameterized

from pallas_kernels.h200 import env as h200_env
from pallas_kernels.h200 import kernel_readings as kc

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where the kernels experiment reads compile records (experiments.kernel_compile.DEFAULT_DIR;
# tests/test_experiments.py checks that its report shows what is here).
RECORDS_DIR = os.path.join(_REPO, "results", "h200_kernel_compile")


def _test_name(group: kc.Group) -> str:
  return re.sub(r"\W+", "_", group.name).strip("_")


@functools.cache
def build_readings(build: kc.Build) -> dict:
  """One compile per build per process, shared by the group and witness tests."""
  return kc.compile_build(build)


def _merge_into(path: str, records: list[dict]) -> None:
  """Replaces this module's earlier records of the same case and kernel in ``path``."""
  old = []
  if os.path.exists(path):
    try:
      with open(path) as f:
        old = json.load(f)
    except (OSError, ValueError):
      old = []
  new_ids = {kc.record_id(r) for r in records}
  kc.write_records([r for r in old if kc.record_id(r) not in new_ids] + records, path)


def witnesses(groups: list[kc.Group]) -> list[tuple[str, kc.Group]]:
  """Per (kernel, impl), the group covering the most cases: its smallest build is compiled
  on its own and must agree (kernel_readings.agree) with the group's compile (its largest)."""
  best: dict[tuple[str, str], kc.Group] = {}
  for g in groups:
    fam = (g.compiled.case.kernel, g.compiled.impl)
    if len(g.builds) > 1 and (fam not in best or len(g.builds) > len(best[fam].builds)):
      best[fam] = g
  return [(_test_name(g), g) for g in best.values()]


def require_h200_compiler() -> None:
  """Raises unless XLA's GPU compiler and ptxas can run here: the H200 compile tests are
  never skipped, since `make test` installs the compiler packages."""
  problems = h200_env.check()
  if problems:
    raise RuntimeError(
        "the H200 compile tests cannot run: " + "; ".join(problems) + ". They need "
        "the CUDA compiler packages of the test extra (`make test` installs them; by "
        "hand: .venv/bin/pip install -e '.[tests]') and tests/conftest.py's "
        "environment (pallas_kernels.h200.env.prepare() before jax is imported)")


class H200CompilerTest(parameterized.TestCase):
  """A TestCase that compiles for an H200: fails at once where the compiler is missing."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    require_h200_compiler()

  def assert_one_launch_without_spills(self, fn, *specs, kernel: str):
    """Compiles ``fn(*specs)`` for an H200: ``kernel`` spills nothing, stays within the
    register limit, and is the program's only launch."""
    from pallas_kernels.h200 import compile as hc
    rep = hc.compile_for_h200(fn, *specs)
    st = rep.kernels[kernel]
    self.assertEqual(st.spills, 0, st)
    self.assertLessEqual(st.registers, hc.MAX_REGISTERS)
    self.assertEqual(len(rep.launches), 1, rep.launches)


def make_test_case(module_file: str, groups: list[kc.Group]) -> type:
  """A parameterized TestCase class over ``groups``.

  Args:
    module_file: the test module's __file__ (names the JSON file of its records).
    groups: the compile plan of the module's kernels.
  """
  out_path = os.path.join(RECORDS_DIR, os.path.basename(module_file).removesuffix(".py")
                          + ".json")

  class H200CompileTest(H200CompilerTest):
    """Every distinct kernel of the module compiles for an H200 with zero spills."""

    @parameterized.named_parameters((_test_name(g), g) for g in groups)
    def test_compiles_without_spills(self, group):
      readings = kc.compile_group(group, build_readings)
      records = kc.records_for(group, readings)
      _merge_into(out_path, records)
      bad = {r["case"]: r["problems"] for r in records if not r["ok"]}
      self.assertEqual(bad, {}, f"{group.name} covers {len(group.builds)} target cases "
                       f"({', '.join(b.case.name for b in group.builds)})")
      for r in records:
        self.assertLessEqual(r["registers"], kc.MAX_REGISTERS)
        self.assertLessEqual(r["smem"], kc.SMEM_LIMIT_BYTES)

    @parameterized.named_parameters(witnesses(groups))
    def test_shared_compile_witness(self, group):
      smallest = group.builds[-1]
      self.assertIsNot(smallest, group.compiled)
      ours, theirs = build_readings(group.compiled), build_readings(smallest)
      keys = kc.READINGS + ("error",)
      self.assertTrue(
          kc.agree(ours, theirs),
          f"{smallest.case.name} and {group.compiled.case.name} share the key "
          f"{group.compiled.key_str} but read {[theirs[k] for k in keys]} against "
          f"{[ours[k] for k in keys]} ({', '.join(keys)}): the key misses something the "
          "kernel depends on")

  return H200CompileTest
