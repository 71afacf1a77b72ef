"""Batched generation with the contiguous cache: the simplest end-to-end path.

This is the reference the serving engine is compared with: prompts are right
padded, prefilled in one jitted call, then decoded one token per step.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mlkit.config import ModelConfig
from mlkit.model import apply, init_cache
from mlkit.sampling import SamplingParams, row_keys, sample_tokens


@dataclasses.dataclass
class GenerationResult:
  """Generated token ids per prompt (stop token included) and timing."""

  tokens: list[list[int]]
  prefill_seconds: float
  decode_seconds: float
  decode_steps: int

  @property
  def new_tokens(self) -> int:
    return sum(len(t) for t in self.tokens)

  @property
  def decode_tokens_per_second(self) -> float:
    decoded = self.new_tokens - len(self.tokens)  # the first token comes from prefill
    return decoded / self.decode_seconds if self.decode_seconds > 0 else float("nan")


def _bucket(n: int, minimum: int = 8) -> int:
  """Rounds up to a power of two so varying prompt lengths reuse compilations."""
  return max(minimum, 1 << (max(n, 1) - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _prefill(params, tokens, lengths, cache, seeds, temp, top_k, top_p, *, cfg):
  B, T = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  logits, cache = apply(params, tokens, positions, cache, cfg=cfg)
  last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, V]
  return sample_tokens(last, row_keys(seeds, 0), temp, top_k, top_p), cache


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _decode(params, tokens, positions, cache, seeds, step, temp, top_k, top_p, *, cfg):
  logits, cache = apply(params, tokens[:, None], positions[:, None], cache, cfg=cfg)
  return sample_tokens(logits[:, 0], row_keys(seeds, step), temp, top_k, top_p), cache


def generate(params, cfg: ModelConfig, prompts: Sequence[Sequence[int]],
             sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams()
             ) -> GenerationResult:
  """Generates continuations for a batch of prompts.

  Args:
    params: model params.
    cfg: the model config.
    prompts: B lists of token ids (non-empty, ids < vocab_size).
    sampling: one SamplingParams for all prompts, or one per prompt.

  Returns:
    A GenerationResult; each row stops at its max_new_tokens or after a stop token.

  Raises:
    ValueError: empty prompt list or prompt, out-of-range token ids, or a prompt
      plus max_new_tokens longer than cfg.max_seq_len.
  """
  if not prompts:
    raise ValueError("generate: prompts is empty")
  B = len(prompts)
  samplings = list(sampling) if not isinstance(sampling, SamplingParams) else [sampling] * B
  if len(samplings) != B:
    raise ValueError(f"generate: {len(samplings)} SamplingParams for {B} prompts")
  for i, p in enumerate(prompts):
    if len(p) == 0:
      raise ValueError(f"generate: prompt {i} is empty")
    bad = [t for t in p if not 0 <= int(t) < cfg.vocab_size]
    if bad:
      raise ValueError(f"generate: prompt {i} has token ids outside [0, {cfg.vocab_size}): {bad[:5]}")
    if len(p) + samplings[i].max_new_tokens > cfg.max_seq_len:
      raise ValueError(f"generate: prompt {i} ({len(p)} tokens) + max_new_tokens "
                       f"({samplings[i].max_new_tokens}) exceeds max_seq_len {cfg.max_seq_len}")
  lengths = np.array([len(p) for p in prompts], np.int32)
  max_new = max(s.max_new_tokens for s in samplings)
  T = min(_bucket(int(lengths.max())), cfg.max_seq_len)
  cache_len = min(_bucket(T + max_new), cfg.max_seq_len)
  tokens = np.zeros((B, T), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  # Host arrays placed with device_put (jnp.asarray of a host array compiles a copy program
  # per shape); the per-step inputs go into the jitted steps as numpy.
  seeds, temp, top_k, top_p = jax.device_put((
      np.array([s.seed for s in samplings], np.uint32),
      np.array([s.temperature for s in samplings], np.float32),
      np.array([s.top_k for s in samplings], np.int32),
      np.array([s.top_p for s in samplings], np.float32)))

  cache = init_cache(cfg, B, cache_len)
  t0 = time.perf_counter()
  nxt, cache = _prefill(params, tokens, lengths, cache, seeds, temp, top_k, top_p, cfg=cfg)
  nxt = np.asarray(nxt)
  t1 = time.perf_counter()
  out: list[list[int]] = [[int(nxt[i])] for i in range(B)]
  done = np.array([int(nxt[i]) in s.stop_tokens or s.max_new_tokens == 1
                   for i, s in enumerate(samplings)])
  positions = lengths.copy()
  steps = 0
  while not done.all():
    steps += 1
    nxt, cache = _decode(params, nxt, positions, cache, seeds, np.int32(steps), temp, top_k,
                         top_p, cfg=cfg)
    nxt = np.asarray(nxt)
    positions = positions + 1
    for i, s in enumerate(samplings):
      if done[i]:
        continue
      out[i].append(int(nxt[i]))
      done[i] = int(nxt[i]) in s.stop_tokens or len(out[i]) >= s.max_new_tokens
  t2 = time.perf_counter()
  return GenerationResult(tokens=out, prefill_seconds=t1 - t0, decode_seconds=t2 - t1,
                          decode_steps=steps)
