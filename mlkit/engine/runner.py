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

Routed experts whose params are split over mesh axes run expert-parallel
(``mlkit.model.moe.dispatch_experts``): the runner reads their placement from
the params once (``mlkit.parallel.expert_sharding``) and passes it to the step
as a static argument; likewise paged decode attention runs per device on its own
heads where the params and the KV pool are placed for it
(``mlkit.parallel.decode_sharding``). :func:`lower_step` lowers the same step from sharded
ShapeDtypeStructs, so a deployment's step can be compiled for a topology that
is not attached (see ``mlkit/plan/step_compile.py``).
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mlkit.kvcache import BatchMeta, PagedKVState
from mlkit.model import apply
from mlkit.parallel import decode_sharding, expert_sharding
from mlkit.engine.speculative_step import speculative_step_jit
from mlkit.sampling import row_keys, sample_tokens, token_logprobs
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
    prev_row: [B] int32 or None: for a decode row whose input token is still on
      device (the engine's overlapped mode), its row in the step in flight, else -1.
      The engine resolves it into ``tokens`` before the step; the step ignores it.
    check_lengths / num_drafts / next_token / draft_rows: [B] a speculative engine's
      step inputs (``mlkit.engine.speculative_step``), else None.
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
  prev_row: np.ndarray | None = None
  check_lengths: np.ndarray | None = None
  num_drafts: np.ndarray | None = None
  next_token: np.ndarray | None = None
  draft_rows: np.ndarray | None = None


def _step(params, state: PagedKVState, tokens, positions, block_tables, expected_tags, lengths,
          last_index, seeds, sample_steps, temperature, top_k, top_p, *, cfg, page_size,
          integrity_check, backend, record_logits, kind, expert_sharding=None,
          decode_sharding=None, logprobs=0):
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
  # Only the sampled position's logits: lm_head over a whole prefill chunk is wasted work.
  logits, state = apply(params, tokens, positions, state, cfg=cfg, batch_meta=meta,
                        backend=backend, expert_sharding=expert_sharding,
                        decode_sharding=decode_sharding,
                        logits_index=last_index)  # [B, 1, V]
  last = logits[:, 0]  # [B, V]
  # Same key derivation as mlkit.generate: fold_in(key(seed), index of the generated token).
  keys = row_keys(seeds, sample_steps)
  tok = sample_tokens(last, keys, temperature, top_k, top_p)  # [B]
  lp = token_logprobs(last, tok, logprobs) if logprobs else None
  return tok, ok, state, last if record_logits else None, lp


_STATIC = ("cfg", "page_size", "integrity_check", "backend", "record_logits", "kind",
           "expert_sharding", "decode_sharding", "logprobs")
_step_jit = jax.jit(_step, static_argnames=_STATIC, donate_argnames=("state",))


def _static_args(params, config, state=None) -> dict:
  """The step's static arguments for an engine configuration, its (placed) params and
  KV state (None: paged decode attention runs as one call on whole arrays)."""
  return dict(cfg=config.model, page_size=config.page_size,
              integrity_check=config.integrity_check, backend=config.backend,
              record_logits=config.record_logits, expert_sharding=expert_sharding(params),
              decode_sharding=decode_sharding(params, state), logprobs=config.logprobs)


def _step_args(params, state, b: StepBatch) -> tuple:
  return (params, state, b.tokens, b.positions, b.block_tables, b.expected_tags, b.lengths,
          b.last_index, b.seeds, b.sample_steps, b.temperature, b.top_k, b.top_p)


def _speculative_args(params, state, b: StepBatch) -> tuple:
  return (params, state, b.tokens, b.positions, b.block_tables, b.expected_tags, b.lengths,
          b.check_lengths, b.last_index, b.num_drafts, b.next_token, b.draft_rows, b.seeds,
          b.sample_steps, b.temperature, b.top_k, b.top_p)


def abstract_batch(rows: int, tokens: int, max_pages: int, sharding, *,
                   speculative: bool = False) -> StepBatch:
  """A StepBatch of ShapeDtypeStructs (every input placed by ``sharding``) for :func:`lower_step`.

  Args:
    rows: B, the batch bucket.
    tokens: T, 1 for decode, the prefill chunk length, or k + 1 for a verify step.
    max_pages: M, the block-table width (``EngineConfig.max_pages_per_seq``).
    sharding: the sharding of every batch input (replicated on the mesh, as the
      engine's host arrays are).
    speculative: also the speculative step's inputs (``check_lengths``, ``num_drafts``,
      ``next_token``, ``draft_rows``).
  """
  def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  B, T, M = rows, tokens, max_pages
  extra = {}
  if speculative:
    extra = dict(check_lengths=sds((B,), jnp.int32), num_drafts=sds((B,), jnp.int32),
                 next_token=sds((B,), jnp.int32), draft_rows=sds((B,), jnp.bool_))
  return StepBatch(tokens=sds((B, T), jnp.int32), positions=sds((B, T), jnp.int32),
                   block_tables=sds((B, M), jnp.int32), expected_tags=sds((B, M), jnp.int32),
                   lengths=sds((B,), jnp.int32), last_index=sds((B,), jnp.int32),
                   seeds=sds((B,), jnp.uint32), sample_steps=sds((B,), jnp.int32),
                   temperature=sds((B,), jnp.float32), top_k=sds((B,), jnp.int32),
                   top_p=sds((B,), jnp.float32), **extra)


def lower_step(params, state: PagedKVState, batch: StepBatch, config, *, kind: str):
  """Lowers the engine's jitted step (state donated, as the engine runs it) without running it.

  With sharded ``jax.ShapeDtypeStruct`` arguments (``mlkit.parallel.abstract_params``,
  ``abstract_kv_state``, :func:`abstract_batch`) nothing is allocated; call it under
  ``jax.sharding.use_abstract_mesh`` of the arguments' mesh when the kernels must see
  the target device (a compile-only topology), then ``.compile()`` the result.

  Args:
    params: the params (arrays or sharded ShapeDtypeStructs).
    state: the KV state (arrays or sharded ShapeDtypeStructs).
    batch: the step's inputs.
    config: an ``EngineConfig`` (model, page size, backend, integrity check; for
      "verify", ``speculative_tokens``).
    kind: "prefill" or "decode" (the plain step), or "verify": a speculative engine's
      step (``mlkit.engine.speculative_step``: verify k drafts, draft k more), whose
      batch has the speculative inputs (``abstract_batch(..., speculative=True)``) and
      whose state has the drafter's layer.

  Returns:
    The ``jax.stages.Lowered`` step.

  Raises:
    ValueError: "verify" without ``config.speculative_tokens``, or an unknown kind.
  """
  if kind not in ("prefill", "decode", "verify"):
    raise ValueError(f"lower_step: kind must be 'prefill', 'decode' or 'verify', got {kind!r}")
  if kind == "verify" and not config.speculative_tokens:
    raise ValueError("lower_step(kind='verify') needs EngineConfig.speculative_tokens >= 1")
  static = _static_args(params, config, state)
  if kind == "verify":
    return speculative_step_jit.trace(*_speculative_args(params, state, batch),
                                      k=config.speculative_tokens, **static).lower()
  return _step_jit.trace(*_step_args(params, state, batch), kind=kind, **static).lower()


class Runner:
  """Dispatches the engine's jitted steps for one engine configuration.

  Args:
    params: model params (any weight formats the model supports).
    config: an ``EngineConfig``.
    state: the KV state as placed (its placement, with the params', decides how
      paged decode attention runs on a mesh: ``mlkit.parallel.decode_sharding``);
      None runs it as one call on whole arrays.
  """

  def __init__(self, params, config, state=None):
    self.params = params
    self.config = config
    self._static = _static_args(params, config, state)

  def run(self, kind: str, state: PagedKVState, batch: StepBatch):
    """Dispatches one step without waiting for it.

    Args:
      kind: "prefill" or "decode" (only a label for the compile counter and profiles).
      state: the KV state (donated: do not use it afterwards).
      batch: the step's inputs.

    Returns:
      (tokens [B] int32, ok [B] bool, state, logits [B, V] f32 or None, logprobs or None),
      all on device; logprobs (with ``config.logprobs`` = K > 0) is the sampled token's
      log-probability [B] f32, and the K most likely tokens [B, K] int32 with theirs
      [B, K] f32 (:func:`mlkit.sampling.token_logprobs`).
    """
    if self.config.speculative_tokens:
      return self._run_speculative(kind, state, batch)
    # numpy inputs go straight to the jitted call: its C++ path transfers them, cheaper
    # than one jnp.asarray dispatch per array.
    return _step_jit(*_step_args(self.params, state, batch), kind=kind, **self._static)

  def _run_speculative(self, kind: str, state: PagedKVState, b: StepBatch):
    """A speculative engine's step (``speculative_step``): the same outputs as :meth:`run`,
    its tokens ``(num_accepted [B], emitted [B, K+1], drafts [B, K])``, its logits and
    log-probabilities the window's ([B, K+1, ...])."""
    n_acc, emitted, drafts, ok, state, lg, lp = speculative_step_jit(
        *_speculative_args(self.params, state, b), k=self.config.speculative_tokens,
        **self._static)
    return (n_acc, emitted, drafts), ok, state, lg, lp
