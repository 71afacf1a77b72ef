"""MLA's absorbed value product in one Pallas Triton launch: ``absorbed_values``.

After MLA's latent attention, each head's output in latent space [C] goes back to the
head's values [v] through the value half of wkv_b [C, H, nope + v]:
out[b, t, h, :] = out_latent[b, t, h, :] @ wkv_b[:, h, nope:]. At a decode step's few
rows XLA's GPU compiler emits this as a split-K batched GEMM over the heads and a
second fusion that adds the K parts, keeps the value half and casts: two launches
(docs/mla_absorb.md). This kernel computes it in one, with f32 accumulation, and
writes the activation dtype as [M, H, v] (M = B * T): the [M, H * v] rows the output
projection wo reads, no copy.

Grid: heads x row blocks x value column blocks. A program multiplies its head's
[bm, C] rows of out_latent (a strided block of [M, H, C]) by its [C, bv] columns of
the head's value half, read in place from wkv_b through the BlockSpec's index map
(block nope / bv + j of the head's nope + v columns), in K chunks of bk. bm = 16
(Triton's smallest dot), bv = 32 and bk = 128: Kimi K2.6's per-device shape (64
rows, 8 heads, C = 512, v = 128) runs 8 x 4 x 4 = 128 programs, about one an SM of
an H200. Every load is a whole power-of-two block, none masked; a shape whose blocks
do not tile it (:func:`kernel_takes`) runs the reference.

Under tensor parallelism H is split (out_latent's heads and wkv_b's head columns
alike); a Pallas call is one custom call, which XLA cannot split, so the op runs
through ``jax.experimental.custom_partitioning``: heads split together, rows may be
split, C and the head width never. The per-device kernel lowers under the mesh's
abstract mesh (``pallas_kernels.on_mesh``). The interpreter cannot run under custom
partitioning, so "interpret" runs the plain kernel.
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
from pallas_kernels.mla_absorb.reference import absorbed_values_reference
from pallas_kernels.on_mesh import lower_on_mesh

BLOCK_M = 16  # rows a program computes: Triton's smallest dot operand
BLOCK_V = 32  # value columns a program computes (at most)
BLOCK_K = 128  # latent channels a dot step reads (at most)
_MIN_BLOCK = 16  # Triton's dot takes no operand side below 16
_NUM_WARPS = 4
_NUM_STAGES = 3  # two K chunk buffers in shared memory: the next chunk loads while one multiplies
_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def block_shape(m: int, c: int, v: int, nope: int) -> tuple[int, int, int]:
  """(bm, bk, bv): rows, latent channels and value columns of a program's dot steps.

  bk and bv are the largest powers of two that divide C (at most BLOCK_K) and both v
  and nope (at most BLOCK_V): the value half's blocks then start at a block of the
  head's nope + v columns.
  """
  del m
  bv = min(v & -v, BLOCK_V)
  if nope:
    bv = min(bv, nope & -nope)
  return BLOCK_M, min(c & -c, BLOCK_K), bv


def kernel_takes(m: int, c: int, v: int, nope: int) -> bool:
  """Whether the kernel tiles [M, H, C] x [C, H, nope + v]: whole row blocks, and dot
  operands of at least 16 a side."""
  bm, bk, bv = block_shape(m, c, v, nope)
  return m % bm == 0 and m > 0 and bk >= _MIN_BLOCK and bv >= _MIN_BLOCK


def _takes(out_latent, wkv_b, nope: int) -> bool:
  """:func:`kernel_takes` for out_latent [B, T, H, C] and wkv_b [C, H, nope + v]."""
  b, t, _, c = out_latent.shape
  return kernel_takes(b * t, c, wkv_b.shape[-1] - nope, nope)


def _kernel(x_ref, w_ref, out_ref, *, bk: int):
  """Refs: x [bm, C] (one head's rows), w [C, bv] (its value columns), out [bm, bv]."""
  c = x_ref.shape[-1]

  def step(k, acc):
    sl = pl.ds(pl.multiple_of(k * bk, bk), bk)
    return acc + jnp.dot(x_ref[:, sl], w_ref[sl, :], preferred_element_type=jnp.float32)

  acc = lax.fori_loop(0, c // bk, step, jnp.zeros(out_ref.shape, jnp.float32))
  out_ref[...] = acc.astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("nope", "interpret"))
def _absorbed_values_pallas(out_latent, wkv_b, *, nope: int, interpret: bool):
  """The kernel: out_latent [B, T, H, C], wkv_b [C, H, nope + v] -> [B, T, H, v]."""
  b, t, h, c = out_latent.shape
  v = wkv_b.shape[-1] - nope
  m = b * t
  bm, bk, bv = block_shape(m, c, v, nope)
  first = nope // bv  # the value half's first block of a head's nope + v columns
  out = pl.pallas_call(
      functools.partial(_kernel, bk=bk),
      grid=(h, m // bm, v // bv),
      in_specs=[pl.BlockSpec((bm, None, c), lambda hh, i, j: (i, hh, 0)),
                pl.BlockSpec((c, None, bv), lambda hh, i, j: (0, hh, first + j))],
      out_specs=pl.BlockSpec((bm, None, bv), lambda hh, i, j: (i, hh, j)),
      out_shape=jax.ShapeDtypeStruct((m, h, v), out_latent.dtype),
      compiler_params=pltriton.CompilerParams(num_warps=_NUM_WARPS, num_stages=_NUM_STAGES),
      interpret=interpret,
      name="mla_absorbed_values",
  )(out_latent.reshape(m, h, c), wkv_b)
  return out.reshape(b, t, h, v)


def _op(nope, backend, out_latent, wkv_b):
  """The kernel ("pallas", "interpret") where it tiles these shapes, else the reference:
  what one device runs on its own heads and rows."""
  if backend == "xla" or not _takes(out_latent, wkv_b, nope):
    return absorbed_values_reference(out_latent, wkv_b, nope)
  return _absorbed_values_pallas(out_latent, wkv_b, nope=nope, interpret=backend == "interpret")


_partitioned = custom_partitioning(_op, static_argnums=(0, 1))


def _partition(nope, backend, mesh, arg_shapes, result_shape):
  """Each device runs its own heads (and rows, where they are split): out_latent's head
  and row shardings, C and the head width whole."""
  del result_shape
  spec = arg_shapes[0].sharding.spec
  b_axes, t_axes, h_axes = mesh_axes(spec, 0), mesh_axes(spec, 1), mesh_axes(spec, 2)
  rows = NamedSharding(mesh, partition_spec(b_axes, t_axes, h_axes, ()))
  weight = NamedSharding(mesh, partition_spec((), h_axes, ()))

  def per_device(out_latent, wkv_b):
    if backend != "pallas":
      return _op(nope, backend, out_latent, wkv_b)
    return lower_on_mesh(lambda x, w: (_op(nope, backend, x, w),),
                         mesh.abstract_mesh)(out_latent, wkv_b)[0]
  return mesh, per_device, rows, (rows, weight)


def _rule(nope, backend, mesh, operand_types, result_types):
  """Shardy's rule: out[b, t, h, v] = sum over c of x[b, t, h, c] w[c, h, nope + v]: the
  heads split together, rows may split, c and the head widths never."""
  del nope, backend, mesh, operand_types, result_types
  return SdyShardingRule(operand_mappings=(("b", "t", "h", "c"), ("c", "h", "d")),
                         result_mappings=(("b", "t", "h", "v"),),
                         need_replication_factors=("c", "d", "v"))


_partitioned.def_partition(_partition, sharding_rule=_rule)


def _check(out_latent, wkv_b, nope) -> None:
  if out_latent.ndim != 4 or out_latent.dtype not in _DTYPES:
    raise ValueError(f"absorbed_values: out_latent must be [B, T, H, C] in bfloat16, float16 "
                     f"or float32, got {out_latent.dtype} {out_latent.shape}")
  _, _, h, c = out_latent.shape
  if wkv_b.ndim != 3 or wkv_b.shape[:2] != (c, h) or wkv_b.dtype != out_latent.dtype:
    raise ValueError(f"absorbed_values: wkv_b must be [C, H, nope + v] = [{c}, {h}, ...] in "
                     f"out_latent's dtype {out_latent.dtype} (plain, dequantised), got "
                     f"{wkv_b.dtype} {wkv_b.shape}")
  if not 0 <= nope < wkv_b.shape[-1]:
    raise ValueError(f"absorbed_values: nope must be in [0, {wkv_b.shape[-1]}) (wkv_b's head "
                     f"width, less at least one value column), got {nope}")


def absorbed_values(out_latent: jax.Array, wkv_b: jax.Array, nope: int, *,
                    backend: str | None = None) -> jax.Array:
  """Per-head values from MLA's latent attention outputs, in one launch on the kernel
  backends where the kernel tiles the shapes (:func:`kernel_takes`).

  Args:
    out_latent: [B, T, H, C] the attention's outputs in latent space: bfloat16,
      float16 or float32.
    wkv_b: [C, H, nope + v] the key and value up-projection, plain (dequantised) in
      out_latent's dtype; only each head's last v columns are read.
    nope: the key half's width per head (wkv_b's first ``nope`` columns of a head).
    backend: "pallas" (the kernel, partitioned over a mesh like the heads) |
      "interpret" (the kernel, interpreted, unpartitioned) | "xla" (the reference,
      :func:`reference.absorbed_values_reference`) | None.

  Returns:
    [B, T, H, v] in out_latent's dtype (laid out as the [B, T, H * v] rows the output
    projection reads), differentiable in both operands (the reference's gradient). The
    kernel accumulates in f32 in another order than XLA's dot: within one rounding of
    the dtype of the reference.

  Raises:
    ValueError: shapes or dtypes that do not match, a nope out of range or an unknown
      backend.
  """
  nope = int(nope)
  _check(out_latent, wkv_b, nope)
  backend = dispatch.resolve_backend(backend)
  if backend == "xla" or not _takes(out_latent, wkv_b, nope):
    return absorbed_values_reference(out_latent, wkv_b, nope)
  return _differentiable(out_latent, wkv_b, nope, backend)


def absorbed_values_partitioned(out_latent: jax.Array, wkv_b: jax.Array, nope: int, *,
                                backend: str = "pallas") -> jax.Array:
  """The op through its head partitioning, always ("pallas", or "xla" per shard for tests
  of the partitioning itself; "interpret" cannot run partitioned)."""
  if backend not in ("pallas", "xla"):
    raise ValueError(f"absorbed_values_partitioned runs the 'pallas' or 'xla' backend, got "
                     f"{backend!r} (the interpreter cannot run under custom partitioning)")
  nope = int(nope)
  _check(out_latent, wkv_b, nope)
  return _partitioned(nope, backend, out_latent, wkv_b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _differentiable(out_latent, wkv_b, nope, backend):
  """The kernel, differentiable as the reference is."""
  if backend == "interpret":
    return _op(nope, backend, out_latent, wkv_b)
  return _partitioned(nope, backend, out_latent, wkv_b)


def _fwd(out_latent, wkv_b, nope, backend):
  return _differentiable(out_latent, wkv_b, nope, backend), (out_latent, wkv_b)


def _bwd(nope, backend, res, grad):
  del backend
  _, vjp = jax.vjp(lambda x, w: absorbed_values_reference(x, w, nope), *res)
  return vjp(grad)


_differentiable.defvjp(_fwd, _bwd)
