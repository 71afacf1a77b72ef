"""Where the Mosaic GPU interpreter and an H200 differ, for every Mosaic GPU kernel here.

The Mosaic GPU kernels (the paged attention decode kernels and their merge, the
INT4 matmuls) run two ways: compiled for Hopper (Mosaic GPU's pipeline, then
ptxas), and in Pallas' Mosaic GPU interpreter on a CPU, which is how the tests
check them without a GPU (docs/testing.md). The interpreter runs the Pallas
program, not the PTX, and does not run everything the hardware does. A kernel
takes ``interpret`` (False, or the interpreter's parameters from
:func:`interpret_params`) and its code is the same both ways except through the
functions of this module, one per difference, each saying what the interpreter
needs and why:

* **A wgmma operand in registers** (:func:`operand_scratch`,
  :func:`register_operand`). Hopper's wgmma reads its A operand from registers
  or shared memory, and the kernels pass values they have just computed (the
  attention kernels' P, the INT4 kernel's dequantised weight tile) from
  registers: no shared-memory store, no fence. The interpreter runs wgmma only
  with both operands in shared memory, so there the value goes through a
  shared-memory tile, which only an interpreted kernel allocates.
* **Accumulating into the loop's accumulator** (:func:`accumulate`). On
  hardware PV adds into the running accumulator in place (``run_state`` over
  ``ACC.init(acc)``), one accumulator live. The interpreter can neither lower
  ``run_state`` over an accumulator ("Cannot lower jaxpr with effects:
  _WGMMAPipelineEffect") nor store into one, so there the product goes into a
  fresh accumulator that is then added: the same sum, two accumulators live.
* **Register-count hints** (:func:`set_max_registers`). ``setmaxnreg`` moves
  registers between a CTA's warpgroups within its launch allocation, and an
  increase the pool cannot cover waits forever. The interpreter ignores it, so
  no interpret test can see a bad split; the call is the same both ways, and a
  kernel that uses it checks its split when it is built
  (``paged_attention.mla_mgpu.check_register_split``).
* **Programmatic dependent launch** (:func:`launch_dependents`,
  :func:`wait_for_prerequisites`). On hardware a decode kernel lets the merge of
  its pieces launch while it still runs, and the merge waits for it before its
  first read (``griddepcontrol``). The interpreter runs one kernel at a time, in
  order, so it needs neither, and both are left out there.
* **Warpgroups are threads** (:func:`check_interpret_threads`). The interpreter
  runs each warpgroup as a thread that blocks in its barrier waits, on XLA's CPU
  client; a kernel of three warpgroups hangs there at its first barrier when the
  client has too few threads, so the ops refuse to interpret it instead.
* **CTAs run in turn** (:func:`ctas_to_fill`). The interpreter runs a grid's
  CTAs one after another, so a kernel that cuts its work into more CTAs to fill
  the SMs only adds per-CTA work there: interpreted, it aims for one.
* **How the interpreter runs** (:func:`interpret_params`, :func:`kernel`): with
  race detection (the tests assert no race), and fresh buffers, outputs
  included, filled with NaN, so an output element a kernel never writes fails
  its test.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# The interpreter's warpgroups are threads of XLA's CPU client, which has about
# max(cores, CPU devices) of them, and each warpgroup blocked in a barrier wait
# holds one. On the 2-core development machine a kernel of three warpgroups (a
# producer beside two compute warpgroups) hangs at its first barrier with 1-3
# CPU devices and runs with 4 or more; two warpgroups run with 1.
INTERPRET_PRODUCER_THREADS = 4


def interpret_params(interpret: bool = True):
  """The interpreter's parameters, or False (compile for the GPU) where
  ``interpret`` is False: what every kernel here takes as ``interpret``.

  Races are detected, and fresh buffers (outputs included) are filled with NaN,
  so an element a kernel leaves unwritten shows in its output.
  """
  if not interpret:
    return False
  return plgpu.InterpretGPUParams(detect_races=True, uninitialized_memory="nan")


def kernel(body: Callable[..., None], *, interpret: Any, **kwargs) -> Any:
  """``plgpu.kernel(body, **kwargs)``: interpreted with ``interpret``'s parameters,
  compiled where it is False."""
  return plgpu.kernel(body, interpret=interpret or None, **kwargs)


def operand_scratch(interpret: Any, shape: tuple[int, ...], dtype, transforms=()):
  """The shared-memory tile through which an interpreted kernel passes a wgmma
  operand that the compiled one passes in registers (:func:`register_operand`);
  None when compiled (no shared memory spent)."""
  if not interpret:
    return None
  return plgpu.SMEM(shape, dtype, transforms=transforms)


def register_operand(value: jax.Array, scratch, *index):
  """``value`` as a wgmma A operand: the value itself (registers) when compiled;
  interpreted, ``value`` stored into ``scratch.at[index]`` (from
  :func:`operand_scratch`) and fenced for wgmma, and that ref in its place."""
  if scratch is None:
    return value
  ref = scratch.at[index] if index else scratch
  ref[...] = value
  plgpu.commit_smem()
  return ref


def accumulate(acc: jax.Array, issue: Callable[[Any], None], interpret: Any) -> jax.Array:
  """``acc`` plus the product that ``issue(acc_ref)`` issues as wgmmas into an f32
  accumulator ref, once they have retired.

  Compiled, the wgmmas add into ``acc`` in place (``run_state``: one accumulator
  live). Interpreted, into a fresh accumulator, then added (module docstring).
  """
  if interpret:
    def fresh(acc_ref):
      issue(acc_ref)
      return acc_ref[...]
    return acc + pl.run_scoped(fresh, plgpu.ACC(acc.shape, jnp.float32))
  return pl.run_state(issue)(plgpu.ACC.init(acc))


def set_max_registers(n: int, *, action: str) -> None:
  """``setmaxnreg``: this warpgroup's registers per thread become ``n``, taken from
  or given back to the CTA's launch allocation. The interpreter ignores it, so the
  caller must check that its split fits the pool (module docstring)."""
  plgpu.set_max_registers(n, action=action)


def launch_dependents(interpret: Any) -> None:
  """``griddepcontrol.launch_dependents`` when compiled: the next kernel, if it is a
  programmatic dependent, may launch once every CTA of this one has executed it.
  Nothing when interpreted (one kernel at a time)."""
  if not interpret:
    plgpu.griddepcontrol_launch_dependents()


def wait_for_prerequisites(interpret: Any) -> None:
  """``griddepcontrol.wait`` when compiled: returns once every prerequisite grid has
  completed and its writes are visible. Nothing when interpreted (the kernels
  before this one have finished)."""
  if not interpret:
    plgpu.griddepcontrol_wait()


def check_interpret_threads(warpgroups: int) -> None:
  """Raises, instead of hanging, where the interpreter lacks threads for a kernel
  of three warpgroups (see INTERPRET_PRODUCER_THREADS).

  Raises:
    RuntimeError: fewer than INTERPRET_PRODUCER_THREADS cores and CPU devices.
  """
  if warpgroups < 3:
    return
  cores = os.cpu_count() or 1
  cpus = len(jax.devices("cpu"))
  if max(cores, cpus) < INTERPRET_PRODUCER_THREADS:
    raise RuntimeError(
        f"interpreting a kernel of {warpgroups} warpgroups needs XLA's CPU client to have "
        f"at least {INTERPRET_PRODUCER_THREADS} threads, and here it has {cores} cores and "
        f"{cpus} CPU devices, so the kernel would hang at its first barrier: set "
        f"XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts (make "
        f"does), or run BlockSizes(loads='compute') (two warpgroups)")


def ctas_to_fill(interpret: Any) -> int | None:
  """The CTAs a kernel that sizes its grid to fill the GPU should aim for: None (its
  own rule) when compiled; one when interpreted, where CTAs run one after another
  (the Mosaic GPU merge of 3 requests of 12 heads x 512 in 6 CTAs took 0.9-1.0 s a
  call on the development machine)."""
  return 1 if interpret else None
