"""XLA flags for the tests' CPU programs: the same programs, compiled faster.

The suite compiles thousands of small CPU programs, most run once, so XLA's CPU compile is
the largest share of its time (docs/testing.md, "Where the suite's time goes"). Two flags
cut it; neither changes a program the project builds, only how XLA turns it into code:

- ``--xla_backend_optimization_level=0``: no LLVM optimisation of the generated code (there
  is no fast-math at any level);
- ``--xla_backend_extra_options=xla_cpu_disable_new_fusion_emitters=true``: XLA's CPU
  backend emits fused loops with its elemental IR emitter, as it did before its MLIR fusion
  emitters, instead of building, lowering and canonicalising an MLIR module per fusion
  (which took more of a compile than LLVM did).

Results may differ in the last bits (another code generator may fuse and order operations
differently); the tests' tolerances are for that, and the suite passes with and without.

The H200 compiles are GPU compiles and read the same registers, spills and shared memory
with these flags as without (their level is pinned by pallas_kernels.h200.compile).
``make run`` and the library use XLA's defaults. Put either flag in ``XLA_FLAGS`` to run the
tests another way: a flag already there is kept.

tests/conftest.py applies this to the suite's processes; the multi-process workers, which set
their own ``XLA_FLAGS`` before importing jax, call it too. It must not import jax.
"""

from __future__ import annotations

LLVM_LEVEL = "--xla_backend_optimization_level=0"
FUSION_EMITTER = "--xla_backend_extra_options=xla_cpu_disable_new_fusion_emitters=true"


def with_test_flags(flags: str) -> str:
  """``flags`` (an ``XLA_FLAGS`` value) with the two flags above, each unless ``flags``
  already sets that option."""
  if "xla_backend_optimization_level" not in flags:
    flags += " " + LLVM_LEVEL
  if "xla_backend_extra_options" not in flags:
    flags += " " + FUSION_EMITTER
  return flags.strip()
