"""Lowers a function for an abstract NVIDIA H200 on a machine without a GPU.

DESIGN.md §3: under an abstract mesh whose device is an H200, ``jax.jit(f)
.trace(...).lower(lowering_platforms=("cuda",))`` runs the Pallas GPU lowering
(Mosaic GPU or Triton) on CPU. It catches unsupported ops, layouts and dtypes
before any GPU is seen. It does not run ptxas, so it produces no PTX/SASS, and
it cannot catch register pressure, shared-memory overflow or a too-old ptxas.
"""

from collections.abc import Callable
from typing import Any

import jax
from jax._src import mesh as mesh_lib

# Hopper H200: 132 SMs.
H200_DEVICE_KIND = "NVIDIA H200"
H200_NUM_CORES = 132


def abstract_h200_mesh() -> mesh_lib.AbstractMesh:
  """A one-device abstract mesh whose device is a cuda H200."""
  device = mesh_lib.AbstractDevice(H200_DEVICE_KIND, H200_NUM_CORES, "cuda")
  return mesh_lib.AbstractMesh((1,), ("x",), abstract_device=device)


def lower_for_h200(fn: Callable[..., Any], *args: Any, **kwargs: Any):
  """Traces and lowers ``fn(*args, **kwargs)`` for cuda as if on an H200.

  Args:
    fn: the function to lower (jitted or not); keyword arguments are closed
      over, so they may be static (block sizes, backend strings).
    *args: arrays or jax.ShapeDtypeStruct describing the positional inputs.
    **kwargs: static keyword arguments for ``fn``.

  Returns:
    The ``jax.stages.Lowered``; ``.as_text()`` gives the StableHLO with the
    kernel embedded as a custom call.

  Raises:
    Whatever the Pallas lowering raises for an unsupported construct.
  """
  wrapped = jax.jit(lambda *a: fn(*a, **kwargs))
  with jax.sharding.use_abstract_mesh(abstract_h200_mesh()):
    return wrapped.trace(*args).lower(lowering_platforms=("cuda",))
