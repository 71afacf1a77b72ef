"""A Pallas Triton kernel as one device of a mesh runs it: :func:`lower_on_mesh`, and the
shardings a custom partitioning rule reads and writes (:func:`mesh_axes`, :func:`partition_spec`).

A kernel under ``jax.experimental.custom_partitioning`` is traced and lowered by XLA's
partitioner, while XLA compiles the program, with no abstract mesh active. Pallas'
Triton lowering reads the GPU it targets from the abstract mesh, or else from the
default device: compiled ahead of time for an H200 from a CPU host
(docs/h200_compile.md), it would find the CPU and fail. :func:`lower_on_mesh` wraps the
per-device function in a primitive whose lowering runs under the mesh's abstract mesh,
whose devices are the target's. On a GPU host it lowers as the plain function does.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec
from jax.extend.core import Primitive
from jax.interpreters import mlir

_lower_on_mesh_p = Primitive("lower_on_mesh")
_lower_on_mesh_p.multiple_results = True


@_lower_on_mesh_p.def_abstract_eval
def _abstract_eval(*args, fn, abstract_mesh, out_avals):
  del args, fn, abstract_mesh
  return out_avals


def _lowering(ctx, *args, fn, abstract_mesh, out_avals):
  del out_avals
  with jax.sharding.use_abstract_mesh(abstract_mesh):
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


mlir.register_lowering(_lower_on_mesh_p, _lowering)


def lower_on_mesh(fn, abstract_mesh):
  """``fn`` (arrays -> a tuple of arrays, no transformations applied to it afterwards),
  lowered under ``abstract_mesh``: the per-device function a custom partitioning rule
  returns for a Pallas Triton kernel."""

  def call(*args):
    out = jax.eval_shape(fn, *args)
    avals = tuple(jax.core.ShapedArray(o.shape, o.dtype) for o in out)
    return tuple(_lower_on_mesh_p.bind(*args, fn=fn, abstract_mesh=abstract_mesh,
                                       out_avals=avals))

  return call


# The custom partitioning rules' shardings, from and to PartitionSpecs.


def mesh_axes(spec: PartitionSpec, dim: int) -> tuple:
  """The mesh axes that split dimension ``dim`` of a PartitionSpec (() if none)."""
  entry = spec[dim] if dim < len(spec) else None
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def partition_spec(*dims) -> PartitionSpec:
  """A PartitionSpec from per-dimension axis tuples (an empty tuple: not split)."""
  return PartitionSpec(*(d if d else None for d in dims))
