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
