"""The residual add and the next RMSNorm in one Pallas Triton launch: ``residual_norm``.

A decoder layer ends with its residual add, x + attn_out + ffn_out, materialised once
per layer (``reference.add_residual``), and the next layer begins with the RMSNorm of
that sum. XLA runs the add as a fusion of its own and the norm as another: the
materialised sum cannot join the norm's fusion. Here one program per row adds the
deltas chunk by chunk over D (Triton's blocks are powers of two: 1024 at Kimi's
D = 7168), writes the new stream, keeps it in registers and, once the row's sum of
squares is known, writes its norm: one launch (docs/residual_norm.md).

The new stream is the reference's to the bit (the same roundings: each delta rounded
to the stream's dtype, each sum rounded); the norm is within bf16 rounding of it (the
sum of squares is added up in another order).

Under a mesh the op is partitioned by rows (``custom_partitioning``): rows may be
split over any mesh axes, D never is. The Pallas interpreter cannot run under custom
partitioning, so "interpret" runs the plain kernel (docs/int4_matmul.md, "Under tensor
parallelism", has the same constraint).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import SdyShardingRule
from jax.experimental.custom_partitioning import custom_partitioning
from jax.experimental.pallas import triton as pltriton
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from pallas_kernels import dispatch
from pallas_kernels.on_mesh import lower_on_mesh
from pallas_kernels.residual_norm.reference import (add_deltas, residual_norm_reference,
                                                    rms_norm)

MAX_CHUNK = 1024  # widest power-of-two block a program loads of a row
MIN_CHUNK = 64  # a D whose largest power-of-two factor is below this runs the reference
MAX_CHUNKS = 16  # chunks a program holds (unrolled) of one row: D up to 16384 at 1024
_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def chunk_for(d: int) -> int:
  """The block a program reads of a row: D's largest power-of-two factor, at most
  MAX_CHUNK."""
  return min(MAX_CHUNK, d & -d)


def kernel_takes(d: int) -> bool:
  """Whether the kernel takes rows of width ``d``: whole chunks of at least MIN_CHUNK, at
  most MAX_CHUNKS of them."""
  c = chunk_for(d)
  return c >= MIN_CHUNK and d // c <= MAX_CHUNKS


def _kernel(x_ref, scale_ref, *refs, n_deltas: int, chunk: int, eps: float):
  """Refs: x [D] (one row), scale [D], the deltas [D]; out: x_new [D], normed [D]."""
  f32 = jnp.float32
  d_refs, (xo_ref, no_ref) = refs[:n_deltas], refs[n_deltas:]
  dtype = xo_ref.dtype
  width = x_ref.shape[-1]
  rows, sq = [], jnp.zeros((chunk,), f32)
  for c in range(width // chunk):
    sl = pl.ds(c * chunk, chunk)
    x = x_ref[sl]
    for d_ref in d_refs:  # the reference's roundings: x + d.astype(x.dtype), in x's dtype
      x = (x.astype(f32) + d_ref[sl].astype(dtype).astype(f32)).astype(dtype)
    xo_ref[sl] = x
    x = x.astype(f32)
    rows.append(x)  # the row stays in registers for the second pass
    sq = sq + x * x
  inv = jax.lax.rsqrt(jnp.sum(sq) / width + eps)
  for c, x in enumerate(rows):
    sl = pl.ds(c * chunk, chunk)
    no_ref[sl] = (x * inv * scale_ref[sl].astype(f32)).astype(dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def _residual_norm_pallas(x, scale, deltas, *, eps: float, interpret: bool):
  """The kernel over rows: x [..., D], deltas [..., D] -> (x_new, normed) [..., D]."""
  shape, d = x.shape, x.shape[-1]
  m = x.size // d
  chunk = chunk_for(d)
  row = pl.BlockSpec((None, d), lambda i: (i, 0))
  x_new, normed = pl.pallas_call(
      functools.partial(_kernel, n_deltas=len(deltas), chunk=chunk, eps=eps),
      grid=(m,),
      in_specs=[row, pl.BlockSpec((d,), lambda i: (0,))] + [row] * len(deltas),
      out_specs=[row, row],
      out_shape=[jax.ShapeDtypeStruct((m, d), x.dtype)] * 2,
      compiler_params=pltriton.CompilerParams(num_warps=max(1, min(8, chunk // 128)),
                                              num_stages=1),
      interpret=interpret,
      name="residual_norm",
  )(x.reshape(m, d), scale, *(a.reshape(m, d) for a in deltas))
  return x_new.reshape(shape), normed.reshape(shape)


def _op(eps, backend, x, scale, *deltas):
  """The unpartitioned kernel ("pallas", "interpret") or reference ("xla") on whatever
  rows it is given."""
  if backend == "xla":
    return residual_norm_reference(x, deltas, scale, eps)
  return _residual_norm_pallas(x, scale, deltas, eps=eps, interpret=backend == "interpret")


_partitioned = custom_partitioning(_op, static_argnums=(0, 1))


def _partition(eps, backend, mesh, arg_shapes, result_shape):
  """Each device runs its own rows: x's row shardings, D whole, the scale replicated."""
  del result_shape
  ndim = len(arg_shapes[0].shape)
  spec = tuple(arg_shapes[0].sharding.spec) + (None,) * ndim
  row_sharding = NamedSharding(mesh, PartitionSpec(*spec[:ndim - 1], None))
  args = (row_sharding, NamedSharding(mesh, PartitionSpec(None)))
  args += (row_sharding,) * (len(arg_shapes) - 2)

  per_device = functools.partial(_op, eps, backend)
  if backend == "pallas":
    per_device = lower_on_mesh(per_device, mesh.abstract_mesh)
  return mesh, per_device, (row_sharding, row_sharding), args


def _rule(eps, backend, mesh, operand_types, result_types):
  """Shardy's rule: x's leading (row) dimensions may split, D never does."""
  del eps, backend, mesh, result_types
  row = tuple(f"r{i}" for i in range(len(operand_types[0].shape) - 1)) + ("d",)
  return SdyShardingRule(operand_mappings=(row, ("d",)) + (row,) * (len(operand_types) - 2),
                         result_mappings=(row, row), need_replication_factors=("d",))


_partitioned.def_partition(_partition, sharding_rule=_rule)


def _check(x, deltas, scale) -> None:
  if x.ndim < 1 or x.dtype not in _DTYPES:
    raise ValueError(f"residual_norm: x must be [..., D] in bfloat16, float16 or float32, got "
                     f"{x.dtype} {x.shape}")
  for i, d in enumerate(deltas):
    if d.shape != x.shape or not jnp.issubdtype(d.dtype, jnp.floating) or d.dtype.itemsize > 4:
      raise ValueError(f"residual_norm: delta {i} must be a float array (at most 32 bits) of "
                       f"x's shape {x.shape}, got {d.dtype} {d.shape}")
  if scale.shape != x.shape[-1:] or not jnp.issubdtype(scale.dtype, jnp.floating):
    raise ValueError(f"residual_norm: scale must be a float [D] = {x.shape[-1:]}, got "
                     f"{scale.dtype} {scale.shape}")


def residual_norm(x: jax.Array, deltas, scale: jax.Array, eps: float, *,
                  backend: str | None = None):
  """The residual stream after ``deltas`` and its RMSNorm, in one launch where the kernel
  takes D (:func:`kernel_takes`), as :func:`reference.residual_norm_reference`.

  Args:
    x: [..., D] the residual stream: bfloat16, float16 or float32.
    deltas: a tuple of [..., D] float arrays added in order, each rounded to x's dtype
      (the model's attention output, then its FFN output).
    scale: [D] the norm's scale.
    eps: the norm's epsilon.
    backend: "pallas" (the kernel, partitioned by rows under a mesh) | "interpret" (the
      kernel, interpreted, unpartitioned) | "xla" (the reference) | None.

  Returns:
    (x_new [..., D] in x's dtype: the reference's bits; normed [..., D] in x's dtype: the
    reference's within bf16 rounding). With no deltas x_new is x.

  Raises:
    ValueError: mismatched shapes, non-float dtypes or an unknown backend.
  """
  x, scale = jnp.asarray(x), jnp.asarray(scale)
  deltas = tuple(jnp.asarray(d) for d in deltas)
  _check(x, deltas, scale)
  backend = dispatch.resolve_backend(backend)
  eps = float(eps)
  if backend == "xla" or not kernel_takes(x.shape[-1]) or x.size == 0:
    return residual_norm_reference(x, deltas, scale, eps)
  return _differentiable(x, deltas, scale, eps, backend,
                         tuple(jnp.dtype(d.dtype).name for d in deltas))


def residual_norm_partitioned(x: jax.Array, deltas, scale: jax.Array, eps: float, *,
                              backend: str = "pallas"):
  """The op through its row partitioning, always ("pallas", or "xla" per shard for tests
  of the partitioning itself; "interpret" cannot run partitioned)."""
  if backend not in ("pallas", "xla"):
    raise ValueError(f"residual_norm_partitioned runs the 'pallas' or 'xla' backend, got "
                     f"{backend!r} (the interpreter cannot run under custom partitioning)")
  return _partitioned(float(eps), backend, x, scale, *deltas)


def _run(x, deltas, scale, eps, backend):
  if backend == "interpret":
    return _op(eps, backend, x, scale, *deltas)
  return residual_norm_partitioned(x, deltas, scale, eps, backend=backend)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _differentiable(x, deltas, scale, eps, backend, delta_dtypes):
  """The kernel, differentiable as the reference is (``delta_dtypes``: the deltas'
  dtype names, which the backward pass needs)."""
  del delta_dtypes
  return _run(x, deltas, scale, eps, backend)


def _fwd(x, deltas, scale, eps, backend, delta_dtypes):
  out = _differentiable(x, deltas, scale, eps, backend, delta_dtypes)
  # The new stream is all the backward pass reads (the deltas' part is linear): it is
  # the layer's materialised residual stream, so training saves nothing more.
  return out, (out[0], scale)


def _bwd(eps, backend, delta_dtypes, res, grads):
  """The reference's VJP: its norm's at the new stream, then its adds' transpose."""
  del backend
  x_new, scale = res
  g_x, g_normed = grads
  _, norm_vjp = jax.vjp(lambda a, s: rms_norm(a, s, eps), x_new, scale)
  g_new, g_scale = norm_vjp(g_normed)
  spec = lambda dtype: jax.ShapeDtypeStruct(x_new.shape, dtype)  # noqa: E731
  g_x, g_deltas = jax.linear_transpose(add_deltas, spec(x_new.dtype),
                                       tuple(map(spec, delta_dtypes)))(g_x + g_new)
  return g_x, g_deltas, g_scale


_differentiable.defvjp(_fwd, _bwd)
