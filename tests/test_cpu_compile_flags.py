"""tests/cpu_compile_flags.py: the XLA flags the suite compiles its CPU programs with."""

import os
import subprocess
import sys

from absl.testing import absltest

import cpu_compile_flags

_TESTS = os.path.dirname(os.path.abspath(__file__))
_OURS = [cpu_compile_flags.LLVM_LEVEL, cpu_compile_flags.FUSION_EMITTER,
         cpu_compile_flags.CODEGEN_SPLIT]


class CpuCompileFlagsTest(absltest.TestCase):

  def test_adds_its_flags_to_other_flags(self):
    flags = cpu_compile_flags.with_test_flags("--xla_force_host_platform_device_count=2")
    self.assertEqual(flags.split(), ["--xla_force_host_platform_device_count=2", *_OURS])

  def test_keeps_a_setting_already_there(self):
    mine = ("--xla_backend_optimization_level=3 --xla_backend_extra_options=xla_cpu_fold_all=true"
            " --xla_cpu_parallel_codegen_split_count=4")
    self.assertEqual(cpu_compile_flags.with_test_flags(mine), mine)
    self.assertEqual(cpu_compile_flags.with_test_flags("--xla_backend_optimization_level=2"),
                     " ".join(["--xla_backend_optimization_level=2", *_OURS[1:]]))

  def test_this_process_and_its_children_use_them(self):
    # conftest set XLA_FLAGS before jax started (these flags, or the same options set by
    # whoever ran the tests); processes the tests start inherit it.
    options = {f.split("=")[0] for f in os.environ["XLA_FLAGS"].split()}
    self.assertLessEqual({f.split("=")[0] for f in _OURS}, options)
    # XLA stops a process whose XLA_FLAGS it cannot parse, an unknown backend option too
    # ("xla: Unknown command line argument"): a jaxlib without the option fails here.
    code = "import jax, jax.numpy as jnp; print(float(jax.jit(lambda x: jnp.tanh(x).sum())(jnp.ones(4))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, XLA_FLAGS=cpu_compile_flags.with_test_flags(""),
                                  JAX_PLATFORMS="cpu"), cwd=_TESTS)
    self.assertEqual(out.returncode, 0, out.stderr[-2000:])
    self.assertAlmostEqual(float(out.stdout.split()[-1]), 4 * 0.7615941559557649, places=5)


if __name__ == "__main__":
  absltest.main()
