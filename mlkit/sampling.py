"""Sampling parameters and a batched, per-row token sampler.

The sampler takes per-row arrays so that one jitted call serves a batch whose
requests each carry their own temperature, top-k and top-p (as the engine needs).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import device


# The most alternatives a request may ask log-probabilities for (OpenAI's API allows 20).
MAX_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to pick tokens for one request."""

  # Tokens to generate at most.
  max_new_tokens: int = 16
  # Softmax temperature; 0 means greedy (argmax).
  temperature: float = 0.0
  # Keep only the k most likely tokens; 0 disables.
  top_k: int = 0
  # Keep the smallest set of tokens whose probability reaches top_p; 1.0 disables.
  top_p: float = 1.0
  # Seed for this request's random stream.
  seed: int = 0
  # Token ids that end the request (the stop token is emitted).
  stop_tokens: tuple[int, ...] = ()
  # Log-probabilities to return per generated token: None for none; 0 for the sampled
  # token's; k for it and the k most likely tokens' (at most the engine's
  # EngineConfig.logprobs).
  logprobs: int | None = None

  def __post_init__(self):
    # Exact types: a float stop token or a string temperature is a caller's bug, never rounded
    # or parsed silently. numpy scalars are accepted and stored as Python numbers.
    n = _int_field("max_new_tokens", self.max_new_tokens)
    if n < 1:
      raise ValueError(f"SamplingParams.max_new_tokens must be a positive int, got {n!r}")
    t = _real_field("temperature", self.temperature)
    if not math.isfinite(t) or t < 0.0:
      raise ValueError(f"SamplingParams.temperature must be finite and >= 0, got {t}")
    k = _int_field("top_k", self.top_k)
    if k < 0:
      raise ValueError(f"SamplingParams.top_k must be a non-negative int, got {k!r}")
    p = _real_field("top_p", self.top_p)
    if not 0.0 < p <= 1.0:
      raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {p}")
    seed = _int_field("seed", self.seed)
    if not 0 <= seed < 2**32:
      raise ValueError(f"SamplingParams.seed must be an int in [0, 2**32), got {seed!r}")
    if isinstance(self.stop_tokens, (str, bytes)) or not hasattr(self.stop_tokens, "__iter__"):
      raise ValueError(f"SamplingParams.stop_tokens must be a sequence of token ids, "
                       f"got {self.stop_tokens!r}")
    stops = tuple(_int_field("stop_tokens", x) for x in self.stop_tokens)
    if any(x < 0 for x in stops):
      raise ValueError(f"SamplingParams.stop_tokens must be non-negative token ids, got {stops}")
    lps = None if self.logprobs is None else _int_field("logprobs", self.logprobs)
    if lps is not None and not 0 <= lps <= MAX_LOGPROBS:
      raise ValueError(f"SamplingParams.logprobs must be None or an int in [0, {MAX_LOGPROBS}], "
                       f"got {lps!r}")
    for name, value in (("max_new_tokens", n), ("temperature", t), ("top_k", k), ("top_p", p),
                        ("seed", seed), ("stop_tokens", stops), ("logprobs", lps)):
      object.__setattr__(self, name, value)


def _int_field(name: str, v) -> int:
  if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
    raise ValueError(f"SamplingParams.{name} must be an int, got {v!r} ({type(v).__name__})")
  return int(v)


def _real_field(name: str, v) -> float:
  if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
    raise ValueError(f"SamplingParams.{name} must be a real number, got {v!r} ({type(v).__name__})")
  return float(v)


def sample_tokens(logits: jax.Array, keys: jax.Array, temperature: jax.Array,
                  top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Samples one token per row.

  Args:
    logits: [B, V] (any float dtype; computed in f32).
    keys: [B] PRNG keys, one per row.
    temperature: [B] f32; rows with 0 are greedy.
    top_k: [B] int32; 0 disables the filter for that row.
    top_p: [B] f32 in (0, 1]; 1 disables the filter for that row.

  Returns:
    [B] int32 token ids.
  """
  logits = logits.astype(jnp.float32)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B]
  if device.device_kind() != "cpu":
    # A GPU conditional reads its predicate on the host: a sync per step costs more there
    # than the filters do.
    return _sample_filtered(logits, keys, temperature, top_k, top_p, greedy)
  # The filters sort the whole vocabulary per row (on 2 CPU cores ~8 ms of a decode step
  # at batch 8 and a vocabulary of 8192, docs/cpu_speed.md): an all-greedy batch skips them.
  # Rows with temperature 0 take the argmax on both branches, so the tokens are the same.
  return jax.lax.cond(jnp.any(temperature > 0),
                      lambda: _sample_filtered(logits, keys, temperature, top_k, top_p, greedy),
                      lambda: greedy)


def filtered_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                    top_p: jax.Array) -> jax.Array:
  """Temperature-scaled logits with everything outside the top-k/top-p set at -inf.

  ``softmax`` of the result is the distribution a sampled row draws from: the one
  :func:`sample_tokens` samples and speculative decoding's acceptance rule
  (:mod:`mlkit.speculative`) compares drafts against, so both share this one filter.

  Args:
    logits: [B, V] f32.
    temperature: [B] f32. Rows with 0 are scaled by 1/1e-6 instead (their values are
      unused by the callers, which take the argmax there, but stay finite or -inf).
    top_k: [B] int32; 0 disables the filter for that row.
    top_p: [B] f32 in (0, 1]; 1 disables the filter for that row.

  Returns:
    [B, V] f32: the scaled logit where the token is kept, -inf elsewhere (at least the
    largest logit of each row is kept).
  """
  V = logits.shape[-1]
  scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
  sorted_desc = -jnp.sort(-scaled, axis=-1)  # [B, V]
  # top-k: drop everything below the k-th largest value.
  k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
  kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)  # [B, 1]
  # top-p: keep sorted tokens whose preceding cumulative mass is below top_p.
  probs_sorted = jax.nn.softmax(sorted_desc, axis=-1)
  mass_before = row_cumsum(probs_sorted) - probs_sorted
  keep_sorted = mass_before < top_p[:, None]
  n_keep = jnp.maximum(jnp.sum(keep_sorted, axis=-1), 1)
  pth = jnp.take_along_axis(sorted_desc, (n_keep - 1)[:, None], axis=-1)
  threshold = jnp.maximum(kth, pth)
  return jnp.where(scaled >= threshold, scaled, -jnp.inf)


# Columns per block of row_cumsum: one MMA-friendly tile; the block totals' prefix sum is a
# [V / 128, V / 128] triangle (Kimi K2.6's 163,840-token vocabulary: 1,280 blocks, 6.5 MB).
CUMSUM_BLOCK = 128


def row_cumsum(x: jax.Array) -> jax.Array:
  """Inclusive prefix sums along the last axis of x [B, V] f32, as two triangular matmuls.

  ``jnp.cumsum`` over a vocabulary-sized axis is a sequential loop on an H200: XLA's GPU
  compiler turned the top-p filter's cumsum over Kimi K2.6's vocabulary shard into two
  while loops of 20,479 and 20,480 iterations, a few kernel launches each, in every
  decode step (docs/step_time.md). Here each block of CUMSUM_BLOCK columns is summed by
  a matmul with an upper-triangular ones matrix, and the block totals' exclusive prefix
  by a second one: two GEMMs, no loop, at f32 precision (HIGHEST: no TF32 or bf16 passes).
  """
  B, V = x.shape
  pad = (-V) % CUMSUM_BLOCK
  blocks = jnp.pad(x, ((0, 0), (0, pad))).reshape(B, -1, CUMSUM_BLOCK)  # [B, nb, blk]
  nb = blocks.shape[1]
  hi = jax.lax.Precision.HIGHEST
  upper = jnp.triu(jnp.ones((CUMSUM_BLOCK, CUMSUM_BLOCK), jnp.float32))  # [k, j]: k <= j
  within = jnp.einsum("bnk,kj->bnj", blocks, upper, precision=hi)  # [B, nb, blk]
  before = jnp.triu(jnp.ones((nb, nb), jnp.float32), k=1)  # [m, n]: m < n
  offsets = jnp.einsum("bm,mn->bn", within[..., -1], before, precision=hi)  # [B, nb]
  return (within + offsets[..., None]).reshape(B, -1)[:, :V]


def _sample_filtered(logits, keys, temperature, top_k, top_p, greedy):
  """:func:`sample_tokens` for a batch with sampled rows (logits [B, V] f32, greedy [B])."""
  filtered = filtered_logits(logits, temperature, top_k, top_p)  # [B, V]
  sampled = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
  return jnp.where(temperature > 0, sampled, greedy)


def token_logprobs(logits: jax.Array, tokens: jax.Array, k: int):
  """The sampled tokens' log-probabilities and the ``k`` most likely tokens', per row.

  Log-probabilities are of the model's distribution (log-softmax of the raw
  logits, before temperature and the top-k/top-p filters), as OpenAI's API and
  vLLM report them by default.

  Args:
    logits: [B, V] (any float dtype; computed in f32).
    tokens: [B] int32 the sampled tokens.
    k: how many alternatives (static, >= 1).

  Returns:
    (token_logprob [B] f32, top_ids [B, k] int32, top_logprobs [B, k] f32), most likely first.
  """
  lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, V]
  chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]  # [B]
  top_lp, top_ids = jax.lax.top_k(lp, k)  # [B, k]
  return chosen, top_ids.astype(jnp.int32), top_lp


def row_keys(seeds: jax.Array, step: jax.Array | int) -> jax.Array:
  """Per-row keys: key(seed_b) folded with the step index (one step, or one per row).

  Args:
    seeds: [B] per-request seeds.
    step: scalar or [B]: index of the token being generated (0 = the one after prefill).

  Returns:
    [B] PRNG keys.
  """
  steps = jnp.broadcast_to(jnp.asarray(step, jnp.uint32), seeds.shape)
  return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(seeds, steps)
