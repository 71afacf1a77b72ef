"""Speculative decoding's acceptance rule: which drafted tokens a target-model step keeps.

A cheap drafter (the model's multi-token-prediction layers) proposes K tokens
x_0 .. x_{K-1} for a request; one target-model step over K+1 positions gives the
target's logits for each of them and for the position after the last. Position j's
logits are the target's prediction given the prompt and the drafts before j, so

  target_logits[:, j] -> p_j, the distribution the target would sample token j from.

The rule (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", Algorithm 1; Chen et al. 2023, "Accelerating Large Language Model Decoding
with Speculative Sampling", the same rule as "modified rejection sampling") walks the
drafts in order:

  * accept x_j with probability min(1, p_j(x_j) / q_j(x_j)), where q_j is the
    distribution the drafter drew x_j from;
  * at the first rejection, emit one token from the residual
    normalize(max(0, p_j - q_j)) and stop;
  * if every draft was accepted, emit a bonus token from p_K (the position after the
    last draft), which the same target step computed anyway.

Each emitted token is then distributed exactly as if the target had sampled it
sequentially: P(emit x at j) = q(x) min(1, p(x)/q(x)) + P(reject) r(x)
= min(q(x), p(x)) + max(0, p(x) - q(x)) = p(x). A step emits between 1 and K+1 tokens.

Here p_j is the target distribution ordinary sampling uses (mlkit.sampling:
temperature, top-k, top-p, through the same :func:`mlkit.sampling.filtered_logits`),
so speculation changes how many target steps a request takes, never what it samples
from. Greedy rows (temperature 0) accept the longest prefix on which the draft equals
the target's argmax and then emit the argmax: exactly the tokens non-speculative greedy
decoding gives.

A drafter that takes its draft's argmax (MTP drafting does) is deterministic: its q_j is
one-hot at x_j, the ratio is p_j(x_j), and the residual is p_j with x_j removed. Pass
``draft_probs=None`` for that case.

Shapes: B rows, K drafts at most per row (static), V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mlkit.sampling import filtered_logits
from pallas_kernels import device

# What ``tokens`` holds past a row's emitted tokens: never a token id.
FILL_TOKEN = -1


def accept_drafts(target_logits: jax.Array, draft_tokens: jax.Array, num_drafts: jax.Array,
                  keys: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  draft_probs: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Decides, per row, how many drafted tokens the target accepts and what it emits.

  Args:
    target_logits: [B, K+1, V] the target's logits (any float dtype; computed in f32).
      Position j is the prediction for draft j; position K (or ``num_drafts[b]``) the
      one after the last draft.
    draft_tokens: [B, K] integer drafted token ids. Entries at or past ``num_drafts[b]``
      are ignored (any value); a draft outside [0, V) is rejected (and the row's next
      token drawn from p_j, or the argmax for a greedy row).
    num_drafts: [B] integer, how many of the K drafts row b proposes (clipped to [0, K]).
      0 makes the row plain decoding: it emits one token from position 0.
    keys: [B, K+1] typed PRNG keys (``jax.random.key``, e.g. from
      :func:`mlkit.sampling.row_keys`), position j's key for row b. Each is split in two:
      one half for draft j's accept test, the other for the token drawn at j if the row
      stops there, so the two draws are independent.
    temperature: [B] f32; rows with 0 are greedy.
    top_k: [B] integer; 0 disables the filter for that row.
    top_p: [B] f32 in (0, 1]; 1 disables the filter for that row.
    draft_probs: [B, K, V] f32, q_j: the distribution the drafter drew draft j from
      (after any filtering of its own), or None for a deterministic drafter (q_j one-hot
      at the draft). Unused by greedy rows.

  Returns:
    (num_accepted [B] int32 in [0, num_drafts[b]], tokens [B, K+1] int32). Row b emits
    ``tokens[b, :num_accepted[b] + 1]``: its accepted drafts, then the correction drawn
    at the first rejected position, or the bonus token from position ``num_drafts[b]``
    if all were accepted. Entries after those are FILL_TOKEN (-1).

  Raises:
    ValueError: (at trace time) if a shape or dtype is inconsistent; the message names
      the argument.
  """
  B, K, V = _check_args(target_logits, draft_tokens, num_drafts, keys, temperature, top_k,
                        top_p, draft_probs)
  logits = jnp.asarray(target_logits).astype(jnp.float32)  # [B, K+1, V]
  drafts = jnp.asarray(draft_tokens).astype(jnp.int32)  # [B, K]
  n_drafts = jnp.clip(jnp.asarray(num_drafts).astype(jnp.int32), 0, K)  # [B]
  temperature = jnp.asarray(temperature, jnp.float32)
  top_k = jnp.asarray(top_k).astype(jnp.int32)
  top_p = jnp.asarray(top_p, jnp.float32)
  if draft_probs is not None:
    draft_probs = jnp.asarray(draft_probs).astype(jnp.float32)

  argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, K+1]
  # Draft j is on offer when j < num_drafts and it is a token id at all.
  offered = ((jnp.arange(K)[None, :] < n_drafts[:, None])
             & (drafts >= 0) & (drafts < V))  # [B, K]
  greedy_ok = offered & (drafts == argmax[:, :K])  # [B, K]

  def greedy():
    n = _leading_true(greedy_ok)
    return n, jnp.take_along_axis(argmax, n[:, None], axis=1)[:, 0]

  def sampled():
    return _accept_sampled(logits, drafts, n_drafts, offered, greedy_ok, argmax, keys,
                           temperature, top_k, top_p, draft_probs)

  if device.device_kind() != "cpu":
    # As in sample_tokens: a GPU conditional reads its predicate on the host.
    n, last = sampled()
  else:
    # The filters sort the vocabulary at K+1 positions per row; an all-greedy batch skips
    # them. Greedy rows get the same result on both branches.
    n, last = jax.lax.cond(jnp.any(temperature > 0), sampled, greedy)

  pos = jnp.arange(K + 1)[None, :]  # [1, K+1]
  drafts_ext = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1)  # [B, K+1]
  tokens = jnp.where(pos < n[:, None], drafts_ext,
                     jnp.where(pos == n[:, None], last[:, None], FILL_TOKEN))
  return n, tokens.astype(jnp.int32)


def _accept_sampled(logits, drafts, n_drafts, offered, greedy_ok, argmax, keys, temperature,
                    top_k, top_p, draft_probs):
  """The rule for a batch with sampled rows (greedy rows are handled too, as argmax).

  Returns (num_accepted [B] int32, last [B] int32: the token emitted after the accepted
  drafts).
  """
  B, K1, V = logits.shape
  K = K1 - 1
  # p_j for every position: the same filter as sample_tokens, row parameters repeated
  # over the K+1 positions.
  filtered = filtered_logits(logits.reshape(B * K1, V), jnp.repeat(temperature, K1),
                             jnp.repeat(top_k, K1), jnp.repeat(top_p, K1))
  filtered = filtered.reshape(B, K1, V)  # [B, K+1, V], -inf outside the kept set
  p = jax.nn.softmax(filtered, axis=-1)  # [B, K+1, V]

  # Independent streams for the accept test and for the draw at the stopping position.
  split = jax.vmap(jax.vmap(jax.random.split))(keys)  # [B, K+1, 2]
  accept_keys, draw_keys = split[..., 0], split[..., 1]  # [B, K+1] each

  sampled_rows = temperature > 0  # [B]
  if K > 0:
    safe = jnp.clip(drafts, 0, V - 1)[..., None]  # [B, K, 1]; out-of-range drafts are not offered
    p_x = jnp.take_along_axis(p[:, :K], safe, axis=-1)[..., 0]  # [B, K]
    q_x = (jnp.ones_like(p_x) if draft_probs is None
           else jnp.take_along_axis(draft_probs, safe, axis=-1)[..., 0])  # [B, K]
    u = jax.vmap(jax.vmap(jax.random.uniform))(accept_keys[:, :K])  # [B, K] in [0, 1)
    # u < min(1, p/q) without the division: q = 0 (a draft the drafter could not have drawn)
    # is accepted wherever p > 0, p = 0 is never accepted.
    stoch_ok = offered & (u * q_x < p_x)
    ok = jnp.where(sampled_rows[:, None], stoch_ok, greedy_ok)  # [B, K]
  else:
    ok = greedy_ok  # [B, 0]
  n = _leading_true(ok)  # [B]

  # The token after the accepted drafts, drawn at position n: from the residual if draft n
  # was rejected (n < num_drafts), else (the bonus) from p_n itself.
  at_n = lambda a: jnp.take_along_axis(a, n.reshape((B, 1) + (1,) * (a.ndim - 2)), axis=1)[:, 0]
  filtered_n = at_n(filtered)  # [B, V]
  draw_key = at_n(draw_keys)  # [B]
  rejected = n < n_drafts  # [B]
  if K > 0:
    p_n = at_n(p)  # [B, V]
    m = jnp.minimum(n, K - 1)  # position K has no draft; there the row never rejects.
    if draft_probs is None:
      q_n = jax.nn.one_hot(jnp.take_along_axis(drafts, m[:, None], axis=1)[:, 0], V,
                           dtype=jnp.float32)  # [B, V]
    else:
      q_n = jnp.take_along_axis(draft_probs, m[:, None, None], axis=1)[:, 0]  # [B, V]
    residual = jnp.maximum(p_n - q_n, 0.0)  # [B, V], unnormalised (categorical needs no sum)
    # p <= q everywhere means p == q, where rejection has probability 0; float rounding can
    # still land here, and then p itself is the right distribution.
    # A draft that is no token id was never drawn from q: the row draws from p there.
    valid = jnp.take_along_axis(offered, m[:, None], axis=1)[:, 0]
    use_residual = rejected & valid & (jnp.sum(residual, axis=-1) > 0)
    # log(0) = -inf: tokens without residual mass (incl. those the filters dropped) are never drawn.
    draw_logits = jnp.where(use_residual[:, None], jnp.log(residual), filtered_n)
  else:
    draw_logits = filtered_n
  drawn = jax.vmap(jax.random.categorical)(draw_key, draw_logits).astype(jnp.int32)  # [B]
  greedy_last = jnp.take_along_axis(argmax, n[:, None], axis=1)[:, 0]
  return n, jnp.where(sampled_rows, drawn, greedy_last)


def _leading_true(ok: jax.Array) -> jax.Array:
  """[B, K] bool -> [B] int32: how many entries of each row are True before the first False."""
  return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def _check_args(target_logits, draft_tokens, num_drafts, keys, temperature, top_k, top_p,
                draft_probs) -> tuple[int, int, int]:
  """Static shape and dtype checks of :func:`accept_drafts`'s arguments; returns (B, K, V)."""

  def fail(name, want, x):
    raise ValueError(f"accept_drafts: {name} must be {want}, got shape {jnp.shape(x)} "
                     f"dtype {jnp.result_type(x)}")

  def is_int(x):
    return jnp.issubdtype(jnp.result_type(x), jnp.integer)

  def is_float(x):
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)

  if jnp.ndim(target_logits) != 3 or not is_float(target_logits) or jnp.shape(target_logits)[1] < 1:
    fail("target_logits", "a float array [B, K+1, V]", target_logits)
  B, K1, V = jnp.shape(target_logits)
  K = K1 - 1
  if jnp.shape(draft_tokens) != (B, K) or not is_int(draft_tokens):
    fail("draft_tokens", f"an integer array [B, K] = [{B}, {K}] (target_logits is [B, K+1, V])",
         draft_tokens)
  if jnp.shape(num_drafts) != (B,) or not is_int(num_drafts):
    fail("num_drafts", f"an integer array [B] = [{B}]", num_drafts)
  if (not isinstance(keys, jax.Array) or not jnp.issubdtype(keys.dtype, jax.dtypes.prng_key)
      or keys.shape != (B, K1)):
    raise ValueError(f"accept_drafts: keys must be typed PRNG keys (jax.random.key) of shape "
                     f"[B, K+1] = [{B}, {K1}], got shape {jnp.shape(keys)} "
                     f"dtype {getattr(keys, 'dtype', type(keys).__name__)}")
  for name, x, want in (("temperature", temperature, is_float), ("top_k", top_k, is_int),
                        ("top_p", top_p, is_float)):
    if jnp.shape(x) != (B,) or not want(x):
      fail(name, f"{'an integer' if want is is_int else 'a float'} array [B] = [{B}]", x)
  if draft_probs is not None and (jnp.shape(draft_probs) != (B, K, V) or not is_float(draft_probs)):
    fail("draft_probs", f"None or a float array [B, K, V] = [{B}, {K}, {V}]", draft_probs)
  return B, K, V
