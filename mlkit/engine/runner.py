"""Jitted device steps: one prefill step and one decode step over static-shape batches.

Each step is a single jitted call that (1) checks page tags for every row,
(2) zeroes the lengths of failed rows so the model neither writes into nor reads
from pages the row may no longer own, (3) runs the model through the paged
cache, and (4) samples. The KV state is donated. The host reads the sampled
tokens and the ok flags together; that is the only synchronisation per step.

Shapes: rows come from ``EngineConfig.batch_buckets``, prefill chunk lengths
from ``prefill_buckets``, and the block-table width is ``max_pages_per_seq``,
so the number of compilations is bounded by the bucket combinations used.
``TRACE_COUNTS`` counts traces (= compilations) per step kind.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mlkit.kvcache import BatchMeta, PagedKVState
from mlkit.model import apply
from mlkit.sampling import row_keys, sample_tokens
from pallas_kernels.tag_check import tag_check

# Traces of each jitted step, across all engines (incremented at trace time only).
TRACE_COUNTS: collections.Counter = collections.Counter()


@dataclasses.dataclass
class StepBatch:
  """Host-built inputs of one device step (numpy; B rows, padded rows have length 0).

  Attributes:
    tokens: [B, T] int32 (T = 1 for decode).
    positions: [B, T] int32 absolute positions.
    block_tables: [B, M] int32 physical pages (PAD_PAGE past a row's pages).
    expected_tags: [B, M] int32 tags the row expects on its pages.
    lengths: [B] int32 tokens in the row's cache after this step's write.
    last_index: [B] int32 index in T of the token whose logits are sampled.
    seeds: [B] uint32 per-request seeds.
    sample_steps: [B] int32 index of the generated token being sampled (key = fold_in(seed, step)).
    temperature / top_k / top_p: [B] sampling parameters.
  """

  tokens: np.ndarray
  positions: np.ndarray
  block_tables: np.ndarray
  expected_tags: np.ndarray
  lengths: np.ndarray
  last_index: np.ndarray
  seeds: np.ndarray
  sample_steps: np.ndarray
  temperature: np.ndarray
  top_k: np.ndarray
  top_p: np.ndarray


def _step(params, state: PagedKVState, tokens, positions, block_tables, expected_tags, lengths,
          last_index, seeds, sample_steps, temperature, top_k, top_p, *, cfg, page_size,
          integrity_check, backend, record_logits, kind):
  TRACE_COUNTS[kind] += 1  # Python side effect: runs once per trace, never per call.
  B = tokens.shape[0]
  with jax.named_scope("tag_check"):
    if integrity_check:
      ok = tag_check(state.page_tags, block_tables, expected_tags, lengths, page_size=page_size,
                     backend=backend)  # [B] bool
    else:
      ok = jnp.ones((B,), bool)
  # A failed row gets length 0: the cache drops its writes and masks all its reads,
  # so it can neither corrupt a page that now belongs to someone else nor see one.
  lengths = jnp.where(ok, lengths, 0)
  meta = BatchMeta(block_tables=block_tables, lengths=lengths, expected_tags=expected_tags,
                   page_size=page_size)
  logits, state = apply(params, tokens, positions, state, cfg=cfg, batch_meta=meta,
                        backend=backend)  # [B, T, V]
  last = jnp.take_along_axis(logits, last_index[:, None, None], axis=1)[:, 0]  # [B, V]
  # Same key derivation as mlkit.generate: fold_in(key(seed), index of the generated token).
  keys = row_keys(seeds, sample_steps)
  tok = sample_tokens(last, keys, temperature, top_k, top_p)  # [B]
  if record_logits:
    return tok, ok, state, last
  return tok, ok, state


_STATIC = ("cfg", "page_size", "integrity_check", "backend", "record_logits", "kind")
_step_jit = jax.jit(_step, static_argnames=_STATIC, donate_argnames=("state",))


class Runner:
  """Dispatches the engine's jitted steps for one engine configuration.

  Args:
    params: model params (any weight formats the model supports).
    config: an ``EngineConfig``.
  """

  def __init__(self, params, config):
    self.params = params
    self.config = config
    self._static = dict(cfg=config.model, page_size=config.page_size,
                        integrity_check=config.integrity_check, backend=config.backend,
                        record_logits=config.record_logits)

  def run(self, kind: str, state: PagedKVState, batch: StepBatch):
    """Dispatches one step without waiting for it.

    Args:
      kind: "prefill" or "decode" (only a label for the compile counter and profiles).
      state: the KV state (donated: do not use it afterwards).
      batch: the step's inputs.

    Returns:
      (tokens [B] int32, ok [B] bool, state, logits [B, V] f32 or None), all on device.
    """
    b = batch
    # numpy inputs go straight to the jitted call: its C++ path transfers them, cheaper
    # than one jnp.asarray dispatch per array.
    out = _step_jit(self.params, state, b.tokens, b.positions, b.block_tables, b.expected_tags,
                    b.lengths, b.last_index, b.seeds, b.sample_steps, b.temperature, b.top_k,
                    b.top_p, kind=kind, **self._static)
    if self.config.record_logits:
      return out
    return out + (None,)
