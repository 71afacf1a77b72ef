"""Compiling for an NVIDIA H200 (sm_90a) on a machine without a GPU.

XLA's GPU compiler runs on a CPU-only machine when it is given a GPU target
config instead of a device: Triton, Mosaic GPU's pipeline and ptxas all run, so
registers, spills and shared memory per kernel, and the per-device memory of a
whole sharded program, are real readings. See docs/h200_compile.md.

* ``env``: the process environment this needs (set before jax is imported).
* ``compile``: topologies, meshes, and ``compile_for_h200`` with its ptxas report.
* ``kernel_readings``: every kernel at its target shapes (``pallas_kernels.targets``)
  compiled, deduplicated by kernel key, read and checked (spills, shared memory).
* ``step_placement``: the Pallas kernel calls and all-gathers of a compiled step.

This package's ``__init__`` imports nothing, so ``env`` can run before jax loads.
"""
