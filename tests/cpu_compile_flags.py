"""XLA flags for the tests' CPU programs: the same programs, compiled faster.

The suite compiles thousands of small CPU programs, most run once, so XLA's CPU compile is
the largest share of its time (docs/testing.md, "Where the suite's time goes"). Three
flags cut it; none changes a program the project builds, only how XLA turns it into code:

- ``--xla_backend_optimization_level=0``: no LLVM optimisation of the generated code (there
  is no fast-math at any level);
- ``--xla_backend_extra_options=xla_cpu_disable_new_fusion_emitters=true``: XLA's CPU
  backend emits fused loops with its elemental IR emitter, as it did before its MLIR fusion
  emitters, instead of building, lowering and canonicalising an MLIR module per fusion
  (which took more of a compile than LLVM did);
- ``--xla_cpu_parallel_codegen_split_count=1``: the generated LLVM module goes to machine
  code whole, not split into parts compiled on several threads. The suite's two workers
  keep both cores busy already, so splitting only added work.

Results may differ in the last bits (another code generator may fuse and order operations
differently); the tests' tolerances are for that, and the suite passes with and without.

The H200 compiles are GPU compiles and read the same registers, spills and shared memory
with these flags as without (their level is pinned by pallas_kernels.h200.compile).
``make run`` and the library use XLA's defaults. Put any of these options in ``XLA_FLAGS``
to run the tests another way: a setting already there is kept.

tests/conftest.py applies this to the suite's processes; the multi-process workers, which set
their own ``XLA_FLAGS`` before importing jax, call it too. It must not import jax.
"""

from __future__ import annotations

LLVM_LEVEL = "--xla_backend_optimization_level=0"
FUSION_EMITTER = "--xla_backend_extra_options=xla_cpu_disable_new_fusion_emitters=true"
CODEGEN_SPLIT = "--xla_cpu_parallel_codegen_split_count=1"


def with_test_flags(flags: str) -> str:
  """``flags`` (an ``XLA_FLAGS`` value) with the flags above, each unless ``flags``
  already sets that option."""
  for flag in (LLVM_LEVEL, FUSION_EMITTER, CODEGEN_SPLIT):
    if flag.split("=")[0] + "=" not in flags:
      flags += " " + flag
  return flags.strip()
