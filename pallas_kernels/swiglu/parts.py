"""SwiGLU from the gate and up projections' split-K partial sums in one Pallas Triton
launch: ``swiglu_parts``.

At a decode step's few rows XLA's GPU compiler splits the shared expert's gate and up
matmul (one GEMM over both weights) over K itself, and adds the partial products in
two fusions of their own, one per projection (it cannot put both reductions in one
fusion), before the SwiGLU. Given the partial sums, this kernel adds each projection's
over S in f32, rounds the sums to the projections' dtype and computes
``silu(gate) * up`` with XLA's roundings (``reference.silu_times``): one launch
(docs/swiglu.md).

The kernel reads the parts as one [S, M, 2F] array, each part's rows the gate's F
columns and then the up's: the layout of the one GEMM XLA makes of two matmuls that
share x (its dot merger), so the concatenation of the two [S, M, F] operands costs
nothing where they are such matmuls. Each program computes a [bm, bf] block of the
output (bm x bf <= 256 elements, both dividing M and F, so that no load or store is
masked), reading its 2 x S blocks of the parts in order.

Under tensor parallelism F is split: ``swiglu_parts`` runs the kernel through
``jax.experimental.custom_partitioning`` (elementwise over M and F, S never split), so
each device runs it on its own columns rather than XLA gathering the parts; the
concatenation happens per device, where XLA folds it into the GEMM. The interpreter
cannot run under custom partitioning (its callbacks are effects;
``pallas_kernels.int4_matmul.partitioned``), so "interpret" runs the plain kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import SdyShardingRule
from jax.experimental.custom_partitioning import custom_partitioning
from jax.experimental.pallas import triton as pltriton
from jax.sharding import NamedSharding

from pallas_kernels import dispatch
from pallas_kernels.on_mesh import mesh_axes, partition_spec
from pallas_kernels.on_mesh import lower_on_mesh
from pallas_kernels.swiglu.reference import silu_times, swiglu_parts_reference

_BLOCK = 256  # output elements a program computes
_NUM_WARPS = 2  # 4 f32 a thread per load: one 16-byte access


def block_shape(m: int, f: int) -> tuple[int, int]:
  """(bm, bf): the largest powers of two that divide M and F with bm x bf <= 256, F's
  first."""
  bf = min(f & -f, _BLOCK)
  return min(m & -m, _BLOCK // bf), bf


def _kernel(parts_ref, out_ref, *, s: int, m: int, f: int, bm: int, bf: int):
  """Refs: parts [S * M * 2F] f32, flat ([S, M, 2F]: gate columns, then up); out
  [M * F], flat."""
  rows = pl.program_id(0) * bm + lax.broadcasted_iota(jnp.int32, (bm,), 0)
  cols = pl.program_id(1) * bf + lax.broadcasted_iota(jnp.int32, (bf,), 0)
  gate_at = rows[:, None] * (2 * f) + cols[None, :]  # [bm, bf] in part 0

  def load(i, half):  # part i's gate (half 0) or up (half 1) block
    return pltriton.load(parts_ref.at[gate_at + (i * m * 2 * f + half * f)])

  gate, up = load(0, 0), load(0, 1)
  for i in range(1, s):  # in order, as the reference adds them
    gate, up = gate + load(i, 0), up + load(i, 1)
  pltriton.store(out_ref.at[rows[:, None] * f + cols[None, :]],
                 silu_times(gate, up, out_ref.dtype))


@functools.partial(jax.jit, static_argnames=("dtype", "interpret"))
def _swiglu_parts_pallas(gate_parts, up_parts, *, dtype, interpret):
  s, m, f = gate_parts.shape
  bm, bf = block_shape(m, f)
  out = pl.pallas_call(
      functools.partial(_kernel, s=s, m=m, f=f, bm=bm, bf=bf),
      out_shape=jax.ShapeDtypeStruct((m * f,), dtype),
      grid=(m // bm, f // bf),
      compiler_params=pltriton.CompilerParams(num_warps=_NUM_WARPS, num_stages=1),
      interpret=interpret,
      name="swiglu_parts",
  )(jnp.concatenate([gate_parts, up_parts], axis=-1).reshape(-1))
  return out.reshape(m, f)


def _op(gate_parts, up_parts, dtype, backend):
  """The reference on "xla", else the kernel, on the shapes it is given (over a mesh, one
  device's: ``_partition``)."""
  if backend == "xla":
    return swiglu_parts_reference(gate_parts, up_parts, dtype=dtype)
  return _swiglu_parts_pallas(gate_parts, up_parts, dtype=dtype, interpret=False)


_partitioned = custom_partitioning(_op, static_argnums=(2, 3))


def _partition(dtype, backend, mesh, arg_shapes, result_shape):
  """Each device runs the op on its own rows and columns of the parts."""
  del result_shape
  spec = arg_shapes[0].sharding.spec
  m_axes, f_axes = mesh_axes(spec, 1), mesh_axes(spec, 2)
  parts_sharding = NamedSharding(mesh, partition_spec((), m_axes, f_axes))

  def per_device(gate_parts, up_parts):
    return (_op(gate_parts, up_parts, dtype, backend),)

  if backend == "pallas":  # lowered for the mesh's devices (pallas_kernels.on_mesh)
    per_device = lower_on_mesh(per_device, mesh.abstract_mesh)
  return (mesh, lambda gate_parts, up_parts: per_device(gate_parts, up_parts)[0],
          NamedSharding(mesh, partition_spec(m_axes, f_axes)), (parts_sharding, parts_sharding))


def _rule(dtype, backend, mesh, operand_types, result_types):
  """out[m, f] from gate and up parts [s, m, f]: elementwise over (m, f), the sum over s
  on each device."""
  del dtype, backend, mesh, operand_types, result_types
  return SdyShardingRule(operand_mappings=(("s", "m", "f"), ("s", "m", "f")),
                         result_mappings=(("m", "f"),), need_replication_factors=("s",))


_partitioned.def_partition(_partition, sharding_rule=_rule)


def _check(gate_parts: jax.Array, up_parts: jax.Array, dtype) -> None:
  for name, a in (("gate_parts", gate_parts), ("up_parts", up_parts)):
    if a.ndim != 3 or a.dtype != jnp.float32 or not a.size:
      raise ValueError(f"swiglu_parts: {name} must be float32 [S, M, F] (S, M, F >= 1), got "
                       f"{a.dtype} {a.shape}")
  if up_parts.shape != gate_parts.shape:
    raise ValueError(f"swiglu_parts: up_parts {up_parts.shape} must have gate_parts' shape "
                     f"{gate_parts.shape}")
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"swiglu_parts: dtype must be a float dtype, got {dtype}")


def swiglu_parts(gate_parts: jax.Array, up_parts: jax.Array, *, dtype,
                 backend: str | None = None, partitioned: bool = True) -> jax.Array:
  """``silu(gate) * up`` from the gate and up projections' split-K partial sums.

  Args:
    gate_parts, up_parts: [S, M, F] f32: part s is the projection of x's s-th slice of
      D (x[:, slice] @ w[slice, :]).
    dtype: the projections' dtype (x's, what ``mlkit.quant.matmul`` returns) and the
      result's.
    backend: "pallas" (this kernel, partitioned like the parts over a mesh) |
      "interpret" (this kernel in the interpreter, unpartitioned) | "xla" (the reference,
      :func:`reference.swiglu_parts_reference`) | None.
    partitioned: run "pallas" (and "xla", for tests of the partitioning) through custom
      partitioning; False: the plain op.

  Returns:
    [M, F] in ``dtype``, differentiable in the parts (the reference's gradient).

  Raises:
    ValueError: parts that are not f32 [S, M, F] of one shape, or a dtype that is no
      float.
  """
  dtype = jnp.dtype(dtype)
  _check(gate_parts, up_parts, dtype)
  backend = dispatch.resolve_backend(backend)
  if backend == "xla" and not partitioned:
    return swiglu_parts_reference(gate_parts, up_parts, dtype=dtype)
  return _differentiable(gate_parts, up_parts, dtype, backend, partitioned)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _differentiable(gate_parts, up_parts, dtype, backend, partitioned):
  if backend == "interpret":
    return _swiglu_parts_pallas(gate_parts, up_parts, dtype=dtype, interpret=True)
  if partitioned:
    return _partitioned(gate_parts, up_parts, dtype, backend)
  return _op(gate_parts, up_parts, dtype, backend)


def _fwd(gate_parts, up_parts, dtype, backend, partitioned):
  return (_differentiable(gate_parts, up_parts, dtype, backend, partitioned),
          (gate_parts, up_parts))


def _bwd(dtype, backend, partitioned, parts, grad):
  _, vjp = jax.vjp(functools.partial(swiglu_parts_reference, dtype=dtype), *parts)
  return vjp(grad)


_differentiable.defvjp(_fwd, _bwd)
