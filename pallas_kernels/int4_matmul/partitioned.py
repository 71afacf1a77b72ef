"""The dense INT4 kernels as ops XLA can partition over a mesh (tensor parallelism).

A Pallas kernel is one custom call, and XLA cannot split a custom call: given a
weight whose columns (or rows) are split over a mesh axis, it all-gathers the
weight and every device runs the whole matmul (a tensor-parallel step's
``wq_b``, ``wo`` and dense FFN projections in INT4, compiled for 8 H200s, ran at
their full, unsplit shapes). :func:`int4_matmul_partitioned` wraps the kernels
in ``jax.experimental.custom_partitioning`` so that each device runs the kernel
on its own shard (docs/int4_matmul.md, "Under tensor parallelism"):

* weight columns (N) split: each device computes its output columns, no
  communication;
* weight rows (K) split, in whole scale groups: each device multiplies its slice
  of x by its rows, and the partial products are summed over those axes (an f32
  all-reduce);
* x's rows (M) split: kept, the output's rows are split the same way.

The Shardy rule names K as (groups x group_size), so a split of K always falls on
whole groups and the scales split with it.

Only the compiled backends run through it ("pallas", and "xla" for tests of the
partitioning itself): the Mosaic GPU interpreter's callbacks are effects, which
custom partitioning cannot lower, so "interpret" runs the plain op (XLA then
replicates it, which is correct, only slower). On one device, or inside a
``shard_map``, the wrapper is inlined and the plain op runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import CompoundFactor
from jax.experimental.custom_partitioning import SdyShardingRule
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding

from pallas_kernels import device
from pallas_kernels.on_mesh import mesh_axes, partition_spec
from pallas_kernels.int4_matmul.int4_matmul import int4_matmul
from pallas_kernels.int4_matmul.nk import int4_matmul_nk

LAYOUTS = ("kn", "nk")


def _op(x, w, scales, group_size, layout, backend, block_sizes, device_kind):
  """The unpartitioned kernel (or reference) on whatever shapes it is given."""
  op = int4_matmul_nk if layout == "nk" else int4_matmul
  return op(x, w, scales, group_size=group_size, backend=backend, block_sizes=block_sizes,
            device_kind=device_kind)


_partitioned = custom_partitioning(_op, static_argnums=(3, 4, 5, 6, 7))


def _partition(group_size, layout, backend, block_sizes, device_kind, mesh, arg_shapes,
               result_shape):
  """Per-device computation and shardings from the operands' (Shardy's choice)."""
  del result_shape
  x_shape, w_shape, _ = arg_shapes
  w_spec = w_shape.sharding.spec
  # The weight's N and K axes: [N, K] for "nk", [K/2, N] for "kn".
  n_axes, k_axes = ((mesh_axes(w_spec, 0), mesh_axes(w_spec, 1)) if layout == "nk"
                    else (mesh_axes(w_spec, 1), mesh_axes(w_spec, 0)))
  m_axes = tuple(a for a in mesh_axes(x_shape.sharding.spec, 0) if a not in n_axes + k_axes)
  x_sharding = NamedSharding(mesh, partition_spec(m_axes, k_axes))
  w_sharding = NamedSharding(mesh, partition_spec(n_axes, k_axes) if layout == "nk"
                             else partition_spec(k_axes, n_axes))
  s_sharding = NamedSharding(mesh, partition_spec(k_axes, n_axes))
  out_sharding = NamedSharding(mesh, partition_spec(m_axes, n_axes))

  def per_device(x, w, scales):
    y = _op(x, w, scales, group_size, layout, backend, block_sizes, device_kind)
    if k_axes:  # partial products over this device's K rows
      y = jax.lax.psum(y.astype(jnp.float32), k_axes).astype(y.dtype)
    return y

  return mesh, per_device, out_sharding, (x_sharding, w_sharding, s_sharding)


def _rule(group_size, layout, backend, block_sizes, device_kind, mesh, operand_types,
          result_types):
  """Shardy's rule: out[m, n] = sum over K = (kg, g) of x[m, K] w[K, n]; scales [kg, n].

  kg (the scale groups) is the reduction factor; g (rows within a group) is never
  split, so a K split falls on whole groups. The "kn" layout's packed rows hold
  two K rows per byte: (kg, g/2). With one scale group (K == group_size) K is
  one factor that is never split: Shardy rejects a compound factor of size 1.
  """
  del backend, block_sizes, device_kind, mesh, result_types
  if operand_types[2].shape[0] == 1:  # scales [1, N]: K is a single group
    w_map = ("n", "k") if layout == "nk" else ("h", "n")
    return SdyShardingRule(operand_mappings=(("m", "k"), w_map, ("kg", "n")),
                           result_mappings=(("m", "n"),),
                           need_replication_factors=("k", "kg") if layout == "nk"
                           else ("k", "h", "kg"))
  k_x = CompoundFactor("kg", "g")
  if layout == "nk":
    w_map = ("n", CompoundFactor("kg", "g"))
    sizes = {"g": group_size}
  else:
    w_map = (CompoundFactor("kg", "h"), "n")
    sizes = {"g": group_size, "h": group_size // 2}
  return SdyShardingRule(operand_mappings=(("m", k_x), w_map, ("kg", "n")),
                         result_mappings=(("m", "n"),), reduction_factors=("kg",),
                         need_replication_factors=tuple(sizes), **sizes)


_partitioned.def_partition(_partition, sharding_rule=_rule)


def int4_matmul_partitioned(x: jax.Array, w: jax.Array, scales: jax.Array, *,
                            group_size: int, layout: str = "nk", backend: str = "pallas",
                            block_sizes=None) -> jax.Array:
  """A dense W4A16 matmul that XLA partitions like the weight (see the module docstring).

  Args:
    x: [M, K] activations.
    w: layout "nk": int4 [N, K] (``int4_matmul_nk``); "kn": uint8 [K/2, N]
      (``int4_matmul``).
    scales: [K/group_size, N].
    group_size: 32, 64 or 128.
    layout: "nk" or "kn".
    backend: "pallas" or "xla" ("interpret" cannot run partitioned: call the
      plain op).
    block_sizes: the kernel's BlockSizes, or None for each shard's default.

  Returns:
    [M, N] in x's dtype, split like x's rows and the weight's columns.

  Raises:
    ValueError: an unknown layout, or the "interpret" backend.
  """
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  if backend not in ("pallas", "xla"):
    raise ValueError(f"int4_matmul_partitioned runs the 'pallas' or 'xla' backend, got "
                     f"{backend!r} (the interpreter cannot run under custom partitioning)")
  # The device kind is read now, while the trace's target (an abstract H200 mesh in a
  # deviceless compile) is active: the per-device kernels are traced later, by XLA's
  # partitioner, where only jax.devices() would answer.
  return _partitioned(x, w, scales, group_size, layout, backend, block_sizes,
                      device.device_kind())
