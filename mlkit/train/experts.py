"""Capacity-slab expert matmuls: GShard/Switch-style training dispatch (opt-in).

Training is dropless by default (``TrainConfig.capacity_factor=None``): the model's
own exact ragged grouped matmul, which on CPU runs a block-sparse form
(``mlkit.quant.dispatch.ragged_dot_f32``) as fast as these slabs. Slabs remain for
capacity-factor training runs and ablations.

With a capacity factor, training wraps each routed expert weight in
:class:`CapacityExperts`; ``mlkit.quant.grouped_matmul`` dispatches on the
weight's type, so the model runs unchanged and instead packs each expert's rows
into a fixed [E, C, K] slab and does one batched einsum.

Rows beyond an expert's capacity C are dropped (their output is zero), as in
capacity-factor MoE training (GShard, Switch). With ``capacity_factor`` >= 2 and
the load-balancing bias this is rare; :func:`dropped_fraction` measures it. At
serving time the model uses the exact ragged path, which drops nothing.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from mlkit.quant import grouped_matmul


@struct.dataclass
class CapacityExperts:
  """A routed-expert weight [E, K, N] that trains through capacity slabs.

  Attributes:
    w: the dense weight [E, K, N] (gradients flow to it).
    capacity_factor: slab rows per expert as a multiple of the mean rows per expert.
  """

  w: jax.Array
  capacity_factor: float = struct.field(pytree_node=False, default=2.0)

  @property
  def shape(self):
    return self.w.shape

  @property
  def ndim(self):
    return self.w.ndim

  @property
  def dtype(self):
    return self.w.dtype


def expert_capacity(rows: int, n_experts: int, capacity_factor: float) -> int:
  """Slab rows per expert: ceil(rows / E * factor), at least 1 and at most ``rows``."""
  return max(1, min(rows, math.ceil(rows / n_experts * capacity_factor)))


def _slots(group_sizes: jax.Array, rows: int):
  """Expert id [M] (E past the last group) and slot within its expert [M] for sorted rows."""
  ends = jnp.cumsum(group_sizes)  # [E]
  r = jnp.arange(rows)
  gid = jnp.searchsorted(ends, r, side="right").astype(jnp.int32)  # [M]
  starts = ends - group_sizes
  slot = r - jnp.take(starts, jnp.minimum(gid, group_sizes.shape[0] - 1))
  return gid, slot


@grouped_matmul.register(CapacityExperts)
def _capacity_grouped_matmul(x: jax.Array, w: CapacityExperts, group_sizes: jax.Array, *,
                             out_dtype=None, backend: str | None = None) -> jax.Array:
  """grouped_matmul on capacity slabs: x [M, K] sorted by expert -> [M, N]; overflow rows are 0.

  ``backend`` is accepted for signature compatibility and ignored: the slab einsum is plain XLA.
  """
  del backend
  out_dtype = out_dtype or x.dtype
  M, K = x.shape
  E = w.w.shape[0]
  C = expert_capacity(M, E, w.capacity_factor)
  gid, slot = _slots(group_sizes.astype(jnp.int32), M)
  keep = (gid < E) & (slot < C)  # [M]
  # Dropped rows are written out of bounds, which mode="drop" ignores.
  g_w = jnp.where(keep, gid, E)
  s_w = jnp.where(keep, slot, C)
  slab = jnp.zeros((E, C, K), x.dtype).at[g_w, s_w].set(x, mode="drop")  # [E, C, K]
  y = jnp.einsum("ECK,EKN->ECN", slab, w.w.astype(x.dtype),
                 preferred_element_type=jnp.float32)  # [E, C, N]
  out = y[jnp.minimum(gid, E - 1), jnp.minimum(slot, C - 1)]  # [M, N]
  return jnp.where(keep[:, None], out, 0.0).astype(out_dtype)


def dropped_fraction(expert_load: jax.Array, top_k: int, tokens: int,
                     capacity_factor: float) -> jax.Array:
  """Fraction of routed assignments a capacity slab drops, from ``expert_load`` [L, E].

  Args:
    expert_load: per-layer fraction of assignments per expert [L, E] (from apply's aux).
    top_k: experts per token.
    tokens: tokens in the batch.
    capacity_factor: as in :class:`CapacityExperts`.

  Returns:
    Scalar f32: dropped assignments / all assignments, averaged over layers.
  """
  E = expert_load.shape[-1]
  rows = tokens * top_k
  C = expert_capacity(rows, E, capacity_factor)
  over = jnp.maximum(expert_load * rows - C, 0.0)  # [L, E]
  return jnp.mean(jnp.sum(over, axis=-1) / rows)


def wrap_experts(params: dict, capacity_factor: float = 2.0) -> dict:
  """Params with every routed-expert weight [E, K, N] wrapped in :class:`CapacityExperts`
  (the main layers' and the multi-token-prediction layers')."""
  def wrap(layers):
    out = []
    for lp in layers:
      ffn = lp["ffn"]
      if "router" in ffn:
        ffn = dict(ffn)
        for name in ("w_gate", "w_up", "w_down"):
          ffn[name] = CapacityExperts(ffn[name], capacity_factor)
        lp = dict(lp, ffn=ffn)
      out.append(lp)
    return out
  wrapped = dict(params, layers=wrap(params["layers"]))
  if params.get("mtp"):
    wrapped["mtp"] = wrap(params["mtp"])
  return wrapped
