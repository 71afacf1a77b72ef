"""The router's expert choice from its logits, in jnp: the reference of ``select_experts``.

DeepSeek-V3 routing after the router's matmul. Sigmoid routers pick experts by
score + ``bias`` (the auxiliary-loss-free balancing bias) but weight them by the
unbiased score; with ``n_group > 1`` only the ``topk_group`` best groups (scored by
the sum of their two best experts) are eligible. Softmax routers pick by
probability. ``mlkit.model.moe.route`` runs this on the "xla" backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def select_experts_reference(logits: jax.Array, bias: jax.Array | None, *, top_k: int,
                             router: str = "sigmoid", n_group: int = 1, topk_group: int = 1,
                             norm_topk_prob: bool = True, scaling: float = 1.0):
  """Each token's ``top_k`` experts and their combine weights.

  Args:
    logits: [N, E] f32 router logits, or [S, N, E] split-K partial sums of them.
    bias: [E] f32 selection bias (sigmoid routers), or None.
    top_k, router, n_group, topk_group, norm_topk_prob, scaling: the model's routing
      (``mlkit.config.ModelConfig``'s fields of those names; scaling is
      ``routed_scaling_factor``).

  Returns:
    (expert_ids [N, top_k] int32, best first, ties to the lower expert as
    ``lax.top_k``; weights [N, top_k] f32 including ``scaling``; scores [N, E] f32:
    the sigmoid scores or softmax probabilities).
  """
  if logits.ndim == 3:
    logits = functools.reduce(jnp.add, list(logits))  # in order, as the kernel adds them
  n, e = logits.shape
  if router == "sigmoid":
    scores = jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias
  else:
    scores = jax.nn.softmax(logits, axis=-1)
    choice = scores
  if n_group > 1:
    grouped = choice.reshape(n, n_group, e // n_group)
    group_score = jnp.sum(jax.lax.top_k(grouped, min(2, e // n_group))[0], axis=-1)  # [N, G]
    _, keep = jax.lax.top_k(group_score, topk_group)
    group_mask = jnp.zeros((n, n_group), bool).at[jnp.arange(n)[:, None], keep].set(True)
    choice = jnp.where(jnp.repeat(group_mask, e // n_group, axis=1), choice, -jnp.inf)
  _, expert_ids = jax.lax.top_k(choice, top_k)  # [N, k]
  weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
  if norm_topk_prob:
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
  return expert_ids.astype(jnp.int32), weights * scaling, scores


def sort_by_expert_reference(expert_ids: jax.Array, weights: jax.Array, n_experts: int):
  """The (token, choice) pairs sorted by expert, stably: the rows of the grouped matmuls.

  Args:
    expert_ids: [N, k] int32 in [0, n_experts).
    weights: [N, k] f32 combine weights.
    n_experts: E.

  Returns:
    (token_of [N*k] int32: each row's token; row_weights [N*k] f32: each row's
    weight; slot [N, k] int32: the row of each (token, choice), the inverse
    permutation; cum [E + 1] int32: the row offsets, cum[e] rows before expert e).
  """
  k = expert_ids.shape[1]
  flat = expert_ids.reshape(-1)  # [N*k]
  order = jnp.argsort(flat, stable=True)  # assignments sorted by expert
  token_of = order // k  # [N*k]
  slot = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
  # Rows of the experts before each one: one reduction (one GPU kernel) for every offset,
  # where a bincount's scatter-add and a cumsum took two.
  cum = jnp.sum(flat[None, :] < jnp.arange(n_experts + 1, dtype=flat.dtype)[:, None], axis=1,
                dtype=jnp.int32)  # [E + 1]
  return (token_of.astype(jnp.int32), weights.reshape(-1)[order], slot.reshape(expert_ids.shape),
          cum)


def sort_by_expert_local_reference(expert_ids: jax.Array, weights: jax.Array, n_experts: int,
                                   shard: jax.Array, n_shards: int):
  """:func:`sort_by_expert_reference` renumbered for device ``shard`` of ``n_shards``,
  which holds experts [first, first + n_local) (n_local = E / n_shards, first = shard x
  n_local): its pairs' rows first, [0, count), then the rows before them, then those
  after (every row once); slots of the other pairs -1; and the local experts' row counts.

  Args:
    expert_ids, weights, n_experts: as :func:`sort_by_expert_reference`.
    shard: int32 scalar, the device's index along the expert axes.
    n_shards: the devices the experts split over (divides E).

  Returns:
    (token_of [N*k] int32, row_weights [N*k] f32, slot [N, k] int32, sizes [n_local] int32).
  """
  n_local = n_experts // n_shards
  first = shard * n_local
  token_of, row_weights, slot, cum = sort_by_expert_reference(expert_ids, weights, n_experts)
  start, end = cum[first], cum[first + n_local]
  rows = jnp.arange(token_of.shape[0], dtype=jnp.int32)
  here = (rows >= start) & (rows < end)
  new = jnp.where(here, rows - start, jnp.where(rows < start, rows + (end - start), rows))
  token_of = jnp.zeros_like(token_of).at[new].set(token_of)
  row_weights = jnp.zeros_like(row_weights).at[new].set(row_weights)
  slot = jnp.where((slot >= start) & (slot < end), slot - start, -1)
  sizes = jax.lax.dynamic_slice_in_dim(cum[1:] - cum[:-1], first, n_local)
  return token_of, row_weights, slot, sizes
