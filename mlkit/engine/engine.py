"""The serving loop: submit / step / cancel / stream over the scheduler and the jitted runner.

One ``step``:

1. schedule (admission, decode growth, preemption, prefill chunks) and, if any
   allocation changed, copy the allocator's tags to the device ``page_tags``;
2. build the numpy step inputs and dispatch the prefill step and the decode
   step (each one jitted call with the tag check inside; the state is donated
   and chained from one call to the next without waiting);
3. read every sampled token and ok flag in one transfer (the only sync);
4. bookkeeping: rows whose check failed are aborted with reason ``integrity``
   and their tokens dropped; the others emit their token, stop, or continue.

Host overhead is the time in 1, 2 (building inputs) and 4; the device time is
from the first dispatch until the results are on the host.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator, Sequence

import jax
import numpy as np
from absl import logging

from mlkit.engine import faults as faults_lib
from mlkit.engine.config import EngineConfig
from mlkit.engine.metrics import EngineMetrics, request_metrics
from mlkit.engine.request import (ABORT_CANCELLED, ABORT_INTEGRITY, ABORT_TOO_LONG, Request,
                                  RequestOutput, RequestRejected, RequestStatus)
from mlkit.engine.runner import Runner, StepBatch
from mlkit.engine.scheduler import Scheduler, UniqueTagAllocator
from mlkit.kvcache import init_paged_state, sync_tags
from mlkit.sampling import SamplingParams


class EngineStalled(RuntimeError):
  """Raised by ``run_until_done`` when a step makes no progress (a scheduling deadlock)."""


class Engine:
  """A continuous-batching engine over one paged KV pool.

  Args:
    params: model params for ``config.model``.
    config: an :class:`EngineConfig`.
  """

  def __init__(self, params, config: EngineConfig):
    if not isinstance(config, EngineConfig):
      raise ValueError(f"Engine needs an EngineConfig, got {type(config).__name__}")
    self.config = config
    self.runner = Runner(params, config)
    self.state = init_paged_state(config.model, config.kv)
    self.allocator = UniqueTagAllocator(config.kv.num_pages, config.page_size)
    self.scheduler = Scheduler(config, self.allocator)
    self.requests: dict[int, Request] = {}
    self.stats = EngineMetrics()
    self.logits: dict[int, list[np.ndarray]] = {}  # per request, when config.record_logits
    self._next_id = 0
    self._tags_dirty = False

  # --------------------------------------------------------------- requests
  def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams()) -> int:
    """Queues a request and returns its id.

    Args:
      prompt_ids: the prompt, token ids in [0, vocab_size).
      sampling: its SamplingParams.

    Returns:
      The request id (an int).

    Raises:
      ValueError: empty prompt, non-integer or out-of-vocabulary token ids,
        invalid sampling parameters (including max_new_tokens <= 0 and stop
        tokens outside the vocabulary), a prompt longer than the model's maximum
        length. Nothing is queued.
      RequestRejected: (a ValueError, reason ``too_long``) prompt + max_new_tokens
        can never fit: longer than the model's maximum length, the block-table
        width or the whole page pool.
    """
    mcfg = self.config.model
    sampling = _validate_sampling(sampling, mcfg.vocab_size)
    try:
      prompt = np.asarray(prompt_ids)
    except Exception as e:  # ragged or non-numeric input
      raise ValueError(f"submit: prompt must be a sequence of token ids ({e})") from None
    if prompt.ndim != 1:
      raise ValueError(f"submit: prompt must be a flat sequence of token ids, got shape {prompt.shape}")
    if prompt.size == 0:
      raise ValueError("submit: prompt is empty")
    if not np.issubdtype(prompt.dtype, np.integer):
      raise ValueError(f"submit: prompt token ids must be integers, got dtype {prompt.dtype}")
    bad = prompt[(prompt < 0) | (prompt >= mcfg.vocab_size)]
    if bad.size:
      raise ValueError(f"submit: prompt has token ids outside [0, {mcfg.vocab_size}): "
                       f"{bad[:5].tolist()}")
    if prompt.size > mcfg.max_seq_len:
      raise ValueError(f"submit: prompt of {prompt.size} tokens is longer than the model's "
                       f"maximum length {mcfg.max_seq_len}")
    total = int(prompt.size) + sampling.max_new_tokens
    if total > self.config.max_seq_tokens:
      self.stats.rejected[ABORT_TOO_LONG] += 1
      raise RequestRejected(
          f"submit: prompt ({prompt.size} tokens) + max_new_tokens ({sampling.max_new_tokens}) "
          f"= {total} tokens can never fit: the engine holds at most {self.config.max_seq_tokens} "
          f"tokens per sequence (model max {mcfg.max_seq_len}, {self.config.max_pages_per_seq} "
          f"pages/seq and {self.config.kv.num_pages} pool pages of {self.config.page_size})")
    rid = self._next_id
    self._next_id += 1
    req = Request(request_id=rid, prompt=tuple(int(t) for t in prompt), sampling=sampling,
                  arrival_time=time.perf_counter())
    self.requests[rid] = req
    self.scheduler.add(req)
    return rid

  def cancel(self, request_id: int) -> bool:
    """Cancels a live request (aborted with reason ``cancelled``), returning its pages.

    Returns:
      True if the request was live, False if it had already ended.

    Raises:
      KeyError: unknown request id.
    """
    req = self.get(request_id)
    if req.done:
      return False
    self.scheduler.remove(req)  # frees pages; tags only change on allocation, so no sync
    self._abort(req, ABORT_CANCELLED)
    return True

  def get(self, request_id: int) -> Request:
    """The Request object (its status, output and reasons). Raises KeyError if unknown."""
    if request_id not in self.requests:
      raise KeyError(f"unknown request id {request_id!r}")
    return self.requests[request_id]

  def has_unfinished(self) -> bool:
    return bool(self.scheduler.waiting or self.scheduler.running)

  # --------------------------------------------------------------- the loop
  def step(self) -> list[RequestOutput]:
    """Runs one engine step (see the module docstring).

    Returns:
      One RequestOutput per request that emitted tokens or ended this step.
    """
    cfg = self.config
    t0 = time.perf_counter()
    plan = self.scheduler.schedule()
    self.stats.preemptions += len(plan.preempted)
    if plan.allocation_changed or self._tags_dirty:
      self.state = sync_tags(self.state, self.allocator.device_tags())
      self._tags_dirty = False
    pre = self._prefill_batch(plan.prefill) if plan.prefill else None
    dec = self._decode_batch(plan.decode) if plan.decode else None
    t1 = time.perf_counter()
    outs = []
    if pre is not None:
      tok, ok, self.state, lg = self.runner.run("prefill", self.state, pre)
      outs.append((tok, ok, lg))
    if dec is not None:
      tok, ok, self.state, lg = self.runner.run("decode", self.state, dec)
      outs.append((tok, ok, lg))
    host = jax.device_get(outs)  # the step's only synchronisation
    t2 = time.perf_counter()
    touched: dict[int, tuple[Request, int]] = {}  # id -> (request, tokens before this step)
    generated = 0
    now = t2
    k = 0
    if pre is not None:
      tok, ok, lg = host[k]
      k += 1
      for i, item in enumerate(plan.prefill):
        req = item.req
        touched[req.request_id] = (req, len(req.output))
        if not ok[i]:
          self._integrity_abort(req)
          continue
        req.num_computed += item.n
        if req.num_computed == len(req.prefill_tokens):
          req.status = RequestStatus.DECODING
          generated += self._emit(req, tok[i], lg[i] if lg is not None else None, now)
    if dec is not None:
      tok, ok, lg = host[k]
      for i, req in enumerate(plan.decode):
        touched[req.request_id] = (req, len(req.output))
        if not ok[i]:
          self._integrity_abort(req)
          continue
        generated += self._emit(req, tok[i], lg[i] if lg is not None else None, now)
    results = [RequestOutput(r.request_id, tuple(r.output[n:]), r.status, r.finish_reason,
                             r.abort_reason) for r, n in touched.values()]
    t3 = time.perf_counter()
    self.stats.record_step(host_s=(t1 - t0) + (t3 - t2), device_s=t2 - t1,
                           prefill=pre is not None, decode=dec is not None, generated=generated,
                           prefilled=sum(it.n for it in plan.prefill), start=t0)
    if cfg.log_every and self.stats.steps % cfg.log_every == 0:
      self.log_metrics()
    return results

  def run_until_done(self, max_steps: int | None = None) -> dict[int, Request]:
    """Steps until no request is waiting or running.

    Returns:
      All requests by id.

    Raises:
      EngineStalled: a step changed nothing (no token, no prefill progress, no
        state change) while requests remain, or max_steps ran out.
    """
    steps = 0
    while self.has_unfinished():
      before = self._progress_marker()
      self.step()
      steps += 1
      if self._progress_marker() == before:
        raise EngineStalled(f"engine made no progress in step {self.stats.steps}: "
                            f"{len(self.scheduler.waiting)} waiting, "
                            f"{len(self.scheduler.running)} running")
      if max_steps is not None and steps >= max_steps and self.has_unfinished():
        raise EngineStalled(f"requests still unfinished after {max_steps} steps")
    return self.requests

  def stream(self, request_id: int) -> Iterator[int]:
    """Yields a request's tokens as they are generated, stepping the engine as needed.

    Other requests advance too (they share the steps); their tokens stay in
    their Request objects.
    """
    req = self.get(request_id)
    n = 0
    while True:
      while n < len(req.output):
        n += 1
        yield req.output[n - 1]
      if req.done:
        return
      self.step()

  def generate(self, prompts: Sequence[Sequence[int]],
               sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams()
               ) -> list[list[int]]:
    """Submits every prompt, runs to completion and returns each request's tokens (in order).

    Raises:
      ValueError: as :meth:`submit` (nothing is queued), or a SamplingParams list whose
        length differs from the prompts'.
    """
    samplings = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
    if len(samplings) != len(prompts):
      raise ValueError(f"generate: {len(samplings)} SamplingParams for {len(prompts)} prompts")
    ids = [self.submit(p, s) for p, s in zip(prompts, samplings)]
    self.run_until_done()
    return [list(self.requests[i].output) for i in ids]

  # --------------------------------------------------------------- faults
  def inject_fault(self, fault: faults_lib.Fault) -> faults_lib.FaultRecord:
    """Corrupts the allocator's bookkeeping for ``fault.victim`` (tests only).

    Raises:
      RuntimeError: fault injection is disabled in the config.
      ValueError: see :func:`mlkit.engine.faults.inject`.
    """
    if not self.config.enable_fault_injection:
      raise RuntimeError("fault injection is disabled (EngineConfig.enable_fault_injection=False)")
    record = faults_lib.inject(self.allocator, fault)
    self.scheduler.invalidate_rows()
    self._tags_dirty = True
    logging.warning("engine: injected fault %s", record)
    return record

  # --------------------------------------------------------------- metrics
  def metrics(self, include_requests: bool = False) -> dict:
    """Engine metrics as a dict (see EngineMetrics.as_dict) plus queue and pool state.

    Args:
      include_requests: also add {"requests": {id: request_metrics}}.
    """
    m = self.stats.as_dict()
    m.update(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
             pages_used=self.allocator.num_used, pages_free=self.allocator.num_free,
             pages_total=self.allocator.num_pages)
    done = [r for r in self.requests.values() if r.first_token_time is not None]
    ttfts = [request_metrics(r)["ttft_s"] for r in done]
    tpots = [t for t in (request_metrics(r)["tpot_s"] for r in done) if t is not None]
    m["mean_ttft_s"] = float(np.mean(ttfts)) if ttfts else None
    m["mean_tpot_s"] = float(np.mean(tpots)) if tpots else None
    if include_requests:
      m["requests"] = {rid: request_metrics(r) for rid, r in self.requests.items()}
    return m

  def request_metrics(self, request_id: int) -> dict:
    """Per-request metrics (see mlkit.engine.metrics.request_metrics)."""
    return request_metrics(self.get(request_id))

  def log_metrics(self) -> None:
    m = self.metrics()
    logging.info("engine: step %d, %d running, %d waiting, pages %d used / %d free, "
                 "%.1f tok/s, host overhead %.2f ms/step (%.1f%%), %d preemptions, "
                 "%d integrity failures", m["steps"], m["running"], m["waiting"], m["pages_used"],
                 m["pages_free"], m["throughput_tok_s"], 1e3 * m["host_overhead_s_per_step"],
                 100 * m["host_overhead_fraction"], m["preemptions"], m["integrity_failures"])

  # --------------------------------------------------------------- internals
  def _progress_marker(self):
    return (self.stats.generated_tokens, self.stats.prefill_tokens,
            sum(r.done for r in self.requests.values()), self.stats.preemptions)

  def _emit(self, req: Request, token, logits, now: float) -> int:
    req.emit(int(token), now)
    if logits is not None:
      self.logits.setdefault(req.request_id, []).append(np.asarray(logits))
    reason = req.should_stop()
    if reason is not None:
      self.scheduler.remove(req)
      req.status = RequestStatus.FINISHED
      req.finish_reason = reason
      req.finish_time = now
      self.stats.finished += 1
    return 1

  def _integrity_abort(self, req: Request) -> None:
    logging.error("engine: request %d failed its page-tag check; aborting it", req.request_id)
    self.scheduler.drop_failed(req)
    self.stats.integrity_failures += 1
    self._abort(req, ABORT_INTEGRITY)

  def _abort(self, req: Request, reason: str) -> None:
    req.status = RequestStatus.ABORTED
    req.abort_reason = reason
    req.finish_time = time.perf_counter()
    self.stats.aborted[reason] += 1

  def _prefill_batch(self, items) -> StepBatch:
    return build_prefill_batch(self.config, self.scheduler, items)

  def _decode_batch(self, reqs) -> StepBatch:
    return build_decode_batch(self.config, self.scheduler, reqs)


def _sampling_rows(reqs, B: int):
  """Per-row sampling arrays [B] for a step; padded rows are greedy with seed 0."""
  seeds = np.zeros(B, np.uint32)
  temp = np.zeros(B, np.float32)
  top_k = np.zeros(B, np.int32)
  top_p = np.ones(B, np.float32)
  steps = np.zeros(B, np.int32)
  for i, r in enumerate(reqs):
    s = r.sampling
    seeds[i], temp[i], top_k[i], top_p[i] = s.seed, s.temperature, s.top_k, s.top_p
    steps[i] = len(r.output)  # index of the token this row samples
  return seeds, temp, top_k, top_p, steps


def build_prefill_batch(config: EngineConfig, scheduler, items) -> StepBatch:
  """The StepBatch of one prefill step over scheduler PrefillItems.

  Args:
    config: the pool's EngineConfig (buckets).
    scheduler: the pool's Scheduler (block tables).
    items: PrefillItems from ``Scheduler.schedule``.

  Returns:
    A StepBatch with B = the batch bucket of len(items) rows and T = the prefill bucket
    of the longest chunk; padded rows have length 0.
  """
  reqs = [it.req for it in items]
  B = config.batch_bucket(len(items))
  T = config.prefill_bucket(max(it.n for it in items))
  tokens = np.zeros((B, T), np.int32)
  positions = np.zeros((B, T), np.int32)
  lengths = np.zeros(B, np.int32)
  last = np.zeros(B, np.int32)
  for i, it in enumerate(items):
    tokens[i, :it.n] = it.req.prefill_tokens[it.start:it.start + it.n]
    positions[i] = np.arange(it.start, it.start + T)
    lengths[i] = it.start + it.n
    last[i] = it.n - 1
  bt, et = scheduler.fill_tables(reqs, B)
  seeds, temp, top_k, top_p, steps = _sampling_rows(reqs, B)
  return StepBatch(tokens, positions, bt, et, lengths, last, seeds, steps, temp, top_k, top_p)


def build_decode_batch(config: EngineConfig, scheduler, reqs) -> StepBatch:
  """The StepBatch of one decode step: each request's last token at position context_len - 1."""
  B = config.batch_bucket(len(reqs))
  tokens = np.zeros((B, 1), np.int32)
  positions = np.zeros((B, 1), np.int32)
  lengths = np.zeros(B, np.int32)
  for i, r in enumerate(reqs):
    tokens[i, 0] = r.output[-1]
    positions[i, 0] = r.context_len - 1
    lengths[i] = r.context_len
  bt, et = scheduler.fill_tables(reqs, B)
  seeds, temp, top_k, top_p, steps = _sampling_rows(reqs, B)
  return StepBatch(tokens, positions, bt, et, lengths, np.zeros(B, np.int32), seeds, steps, temp,
                   top_k, top_p)


def _validate_sampling(sampling, vocab_size: int) -> SamplingParams:
  """Re-validates sampling parameters (also ones built around ``__post_init__``)."""
  if not isinstance(sampling, SamplingParams):
    raise ValueError(f"submit: sampling must be a SamplingParams, got {type(sampling).__name__}")
  try:
    sampling = dataclasses.replace(sampling)  # reruns SamplingParams.__post_init__
  except (TypeError, ValueError) as e:
    raise ValueError(f"submit: invalid sampling parameters: {e}") from None
  if not np.isfinite(sampling.temperature):
    raise ValueError(f"submit: SamplingParams.temperature must be finite, got {sampling.temperature}")
  if not isinstance(sampling.seed, (int, np.integer)) or not 0 <= int(sampling.seed) < 2**32:
    raise ValueError(f"submit: SamplingParams.seed must be an int in [0, 2**32), got {sampling.seed!r}")
  bad = [t for t in sampling.stop_tokens if not 0 <= t < vocab_size]
  if bad:
    raise ValueError(f"submit: stop tokens outside [0, {vocab_size}): {bad}")
  return sampling
