"""The router's expert choice in one Pallas Triton launch: ``select_experts``.

After the router's matmul, XLA ran the choice as four launches per MoE layer: the
sigmoid and the bias add, the top-k's sort and its slice, and the gather of the
chosen scores (with their normalisation). This kernel does all of it in one
program per block of tokens, with the token's E scores in registers:

* scores: sigmoid (or softmax) of the logits; choice = scores + bias;
* group-limited routing (``n_group > 1``): each group's two best choices summed,
  the ``topk_group`` best groups kept, the others' experts set to -inf;
* top-k: k rounds of a row max, then the lowest expert holding it (ties to the lower
  expert, as ``lax.top_k``), which is then set to -inf; each round also picks the
  expert's unbiased score, its weight;
* the weights normalised and scaled.

E and k are padded to powers of two (the padding never chosen, and sliced off where
it exists); a block holds at most 2,048 scores, 16 f32 registers a thread at 4 warps
(4,096 took 254 registers at Kimi K2.6's 384 experts). ``select_experts_reference``
is its reference; docs/moe_router.md has the design.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import dispatch
from pallas_kernels.moe_router.reference import select_experts_reference
from pallas_kernels.schedule import pow2_at_least

_BLOCK_ELEMENTS = 2048
_NUM_WARPS = 4
ROUTERS = ("sigmoid", "softmax")


def _kernel(*refs, has_bias: bool, splits: int, n: int, e: int, ep: int, k: int, kp: int,
            bn: int, router: str, n_group: int, topk_group: int, norm_topk_prob: bool,
            scaling: float):
  """One block of ``bn`` tokens.

  Refs: logits [splits * N * E] f32 (split-K partial sums, added here), bias [E] f32
  (when has_bias), then the outputs ids [N * kp] int32, weights [N * kp] f32 and
  scores [N * ep] f32, all flat (2-D offsets index them; k and E padded to powers of
  two kp and ep).
  """
  if has_bias:
    logits_ref, bias_ref, ids_ref, w_ref, scores_ref = refs
  else:
    (logits_ref, ids_ref, w_ref, scores_ref), bias_ref = refs, None
  rows = pl.program_id(0) * bn + lax.broadcasted_iota(jnp.int32, (bn,), 0)  # [bn]
  cols = lax.broadcasted_iota(jnp.int32, (ep,), 0)  # [ep]
  col_ok = cols < e
  # [bn, ep] offsets into the flat [N * E] logits (clamped: the padding lanes read a
  # real address, masked).
  off = rows[:, None] * e + jnp.minimum(cols, e - 1)[None, :]
  mask = jnp.broadcast_to(col_ok[None, :], off.shape)
  logits = pltriton.load(logits_ref.at[off], mask=mask, other=0.0)
  for s in range(1, splits):  # in order, as the reference's sum over the first axis
    logits = logits + pltriton.load(logits_ref.at[off + s * n * e], mask=mask, other=0.0)
  neg_inf = jnp.float32(-jnp.inf)
  if router == "sigmoid":
    scores = jax.nn.sigmoid(logits)
    choice = scores
    if bias_ref is not None:
      bias = pltriton.load(bias_ref.at[jnp.minimum(cols, e - 1)], mask=col_ok, other=0.0)
      choice = scores + bias[None, :]
  else:
    masked = jnp.where(col_ok[None, :], logits, neg_inf)
    ex = jnp.exp(masked - jnp.max(masked, axis=1)[:, None])
    scores = ex / jnp.sum(ex, axis=1)[:, None]
    choice = scores
  choice = jnp.where(col_ok[None, :], choice, neg_inf)

  if n_group > 1:
    per = e // n_group
    group_of = cols // per  # the padding columns' groups are >= n_group: never kept
    group_scores = []
    for g in range(n_group):
      in_g = (group_of == g)[None, :]
      c = jnp.where(in_g, choice, neg_inf)
      m1 = jnp.max(c, axis=1)
      if per > 1:  # the sum of the group's two best (the best may repeat)
        i1 = jnp.min(jnp.where(c == m1[:, None], cols[None, :], ep), axis=1)
        m2 = jnp.max(jnp.where(cols[None, :] == i1[:, None], neg_inf, c), axis=1)
        m1 = m1 + m2
      group_scores.append(m1)
    keep = [jnp.zeros((bn,), jnp.bool_) for _ in range(n_group)]
    for _ in range(topk_group):  # the best group left, ties to the lower group
      best = group_scores[0]
      for gs in group_scores[1:]:
        best = jnp.maximum(best, gs)
      taken = jnp.zeros((bn,), jnp.bool_)
      for g in range(n_group):
        pick = (group_scores[g] == best) & ~taken
        keep[g] = keep[g] | pick
        taken = taken | pick
        group_scores[g] = jnp.where(pick, neg_inf, group_scores[g])
    kept = jnp.zeros((bn, ep), jnp.bool_)
    for g in range(n_group):
      kept = kept | ((group_of == g)[None, :] & keep[g][:, None])
    choice = jnp.where(kept, choice, neg_inf)

  kcols = lax.broadcasted_iota(jnp.int32, (kp,), 0)
  ids = jnp.zeros((bn, kp), jnp.int32)
  weights = jnp.zeros((bn, kp), jnp.float32)
  for j in range(k):
    best = jnp.max(choice, axis=1)
    idx = jnp.min(jnp.where(choice == best[:, None], cols[None, :], ep), axis=1)  # [bn]
    hit = cols[None, :] == idx[:, None]
    w = jnp.sum(jnp.where(hit, scores, 0.0), axis=1)
    ids = jnp.where(kcols[None, :] == j, idx[:, None], ids)
    weights = jnp.where(kcols[None, :] == j, w[:, None], weights)
    choice = jnp.where(hit, neg_inf, choice)
  if norm_topk_prob:
    weights = weights / (jnp.sum(weights, axis=1)[:, None] + 1e-20)
  weights = weights * scaling

  # Whole blocks, unmasked: the outputs are [N, kp] and [N, ep] (bn divides N), so no
  # lane needs an address of its own to skip (the interpreter stores a masked lane's
  # old value, which would race a valid lane's new one at a shared address).
  out_rows = rows[:, None]
  pltriton.store(ids_ref.at[out_rows * kp + kcols[None, :]], ids)
  pltriton.store(w_ref.at[out_rows * kp + kcols[None, :]], weights)
  pltriton.store(scores_ref.at[out_rows * ep + cols[None, :]], scores)


def block_rows(n: int, e: int) -> int:
  """Tokens per program: the largest power of two that divides N and keeps a block at
  <= 2,048 scores."""
  return min(n & -n, _BLOCK_ELEMENTS // pow2_at_least(e))


@functools.partial(jax.jit, static_argnames=("top_k", "router", "n_group", "topk_group",
                                             "norm_topk_prob", "scaling", "interpret"))
def _select_experts_pallas(logits, bias, *, top_k, router, n_group, topk_group, norm_topk_prob,
                           scaling, interpret):
  splits, n, e = logits.shape
  bn, ep, kp = block_rows(n, e), pow2_at_least(e), pow2_at_least(top_k)
  kernel = functools.partial(_kernel, has_bias=bias is not None, splits=splits, n=n, e=e, ep=ep,
                             k=top_k, kp=kp, bn=bn, router=router,
                             n_group=n_group, topk_group=topk_group,
                             norm_topk_prob=norm_topk_prob, scaling=scaling)
  operands = (logits.reshape(splits * n * e),) + (() if bias is None else (bias,))
  ids, weights, scores = pl.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((n * kp,), jnp.int32),
                 jax.ShapeDtypeStruct((n * kp,), jnp.float32),
                 jax.ShapeDtypeStruct((n * ep,), jnp.float32)),
      grid=(n // bn,),
      compiler_params=pltriton.CompilerParams(num_warps=_NUM_WARPS, num_stages=1),
      interpret=interpret,
      name="select_experts",
  )(*operands)
  # Slices only where k or E is not a power of two (Kimi K2.6 and GLM 5.2: k = 8, and
  # the serving step reads no scores).
  return (ids.reshape(n, kp)[:, :top_k], weights.reshape(n, kp)[:, :top_k],
          scores.reshape(n, ep)[:, :e])


def select_experts(logits: jax.Array, bias: jax.Array | None = None, *, top_k: int,
                   router: str = "sigmoid", n_group: int = 1, topk_group: int = 1,
                   norm_topk_prob: bool = True, scaling: float = 1.0,
                   backend: str | None = None):
  """Each token's ``top_k`` experts and their combine weights, from the router's logits.

  Args:
    logits: [N, E] f32 router logits (N >= 1; on the kernel backends E <= 2,048), or
      [S, N, E] split-K partial sums of them (the router's matmul over S slices of
      its D), which are added first, in order.
    bias: [E] f32 selection bias of a sigmoid router, or None.
    top_k: experts per token (<= the experts in the kept groups).
    router: "sigmoid" or "softmax".
    n_group, topk_group: group-limited routing (n_group divides E).
    norm_topk_prob: normalise the chosen weights to sum to 1.
    scaling: the weights' factor (``routed_scaling_factor``).
    backend: "pallas" | "interpret" (this kernel) | "xla" (the reference) | None.

  Returns:
    (expert_ids [N, top_k] int32, weights [N, top_k] f32, scores [N, E] f32), as
    :func:`select_experts_reference`.

  Raises:
    ValueError: bad shapes, dtypes or routing settings, naming the argument.
  """
  if logits.ndim not in (2, 3) or logits.dtype != jnp.float32 or not all(logits.shape):
    raise ValueError(f"logits must be float32 [N >= 1, E] or [S, N, E], got {logits.dtype} "
                     f"{logits.shape}")
  n, e = logits.shape[-2:]
  if bias is not None and (bias.shape != (e,) or bias.dtype != jnp.float32):
    raise ValueError(f"bias must be float32 [{e}], got {bias.dtype} {bias.shape}")
  if router not in ROUTERS:
    raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
  if n_group < 1 or e % n_group or not 1 <= topk_group <= n_group:
    raise ValueError(f"n_group ({n_group}) must divide E ({e}) and topk_group ({topk_group}) "
                     f"be in [1, n_group]")
  if not 1 <= top_k <= topk_group * (e // n_group):
    raise ValueError(f"top_k must be in [1, {topk_group * (e // n_group)}] (the experts of "
                     f"the kept groups), got {top_k}")
  kw = dict(top_k=top_k, router=router, n_group=n_group, topk_group=topk_group,
            norm_topk_prob=norm_topk_prob, scaling=float(scaling))
  backend = dispatch.resolve_backend(backend)
  if backend == "xla":
    return select_experts_reference(logits, bias, **kw)
  if pow2_at_least(e) > _BLOCK_ELEMENTS:
    raise ValueError(f"E must be at most {_BLOCK_ELEMENTS} on the kernel backends (one "
                     f"token's scores a block), got {e}")
  return _differentiable(functools.partial(_select_experts_pallas,
                                           interpret=backend == "interpret", **kw),
                         functools.partial(select_experts_reference, **kw))(logits, bias)


def _differentiable(kernel, reference):
  """``kernel(logits, bias)`` with the reference's gradients (the expert ids are integers;
  the weights and scores are differentiable in the logits and, through the choice, not in
  the bias), so that training runs the same routing on the kernel backends."""

  @jax.custom_vjp
  def f(logits, bias):
    return kernel(logits[None] if logits.ndim == 2 else logits, bias)

  def fwd(logits, bias):
    return f(logits, bias), (logits, bias)

  def bwd(res, grads):
    _, vjp = jax.vjp(reference, *res)
    ids_grad = jnp.zeros(grads[0].shape, jax.dtypes.float0)
    return vjp((ids_grad, grads[1], grads[2]))

  f.defvjp(fwd, bwd)
  return f
