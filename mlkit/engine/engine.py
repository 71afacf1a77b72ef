"""The serving loop: submit / step / cancel / stream over the scheduler and the jitted runner.

One ``step``:

1. audit page conservation (anything changed since the last step: cancels,
   injected faults), then schedule (admission, decode growth, preemption,
   prefill chunks); pages the audit or the allocator found violating are
   quarantined and every request holding them is aborted with reason
   ``integrity``; if any allocation changed, copy the allocator's tags to the
   device ``page_tags``;
2. build the numpy step inputs and dispatch the prefill step and the decode
   step (each one jitted call with the tag check inside; the state is donated
   and chained from one call to the next without waiting);
3. read every sampled token and ok flag in one transfer (the only sync);
4. bookkeeping: rows whose check failed are aborted with reason ``integrity``
   and their tokens dropped; the others emit their token, stop, or continue;
   then the audit runs again.

An error that belongs to one request (building its row, emitting its token)
aborts that request with reason ``error``; the others are served on.

Host overhead is the time in 1, 2 (building inputs) and 4; the device time is
from the first dispatch until the results are on the host. Why the audit and the
tag check both exist: docs/integrity.md.
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
from mlkit.engine.request import (ABORT_CANCELLED, ABORT_ERROR, ABORT_INTEGRITY, ABORT_TOO_LONG,
                                  Request, RequestOutput, RequestRejected, RequestStatus)
from mlkit.engine.runner import Runner, StepBatch
from mlkit.engine.scheduler import PrefillItem, Scheduler
from mlkit.kvcache import PageAllocator, PageViolation, init_paged_state, sync_tags
from mlkit.model import check_params
from mlkit.sampling import SamplingParams


class EngineStalled(RuntimeError):
  """Raised by ``run_until_done`` when a step makes no progress (a scheduling deadlock)."""


class Engine:
  """A continuous-batching engine over one paged KV pool.

  Args:
    params: model params for ``config.model`` (any weight formats the model supports).
    config: an :class:`EngineConfig`.

  Raises:
    ValueError: a config of the wrong type, or params that do not match
      ``param_specs(config.model)`` (names the first leaf that differs).
  """

  def __init__(self, params, config: EngineConfig):
    if not isinstance(config, EngineConfig):
      raise ValueError(f"Engine needs an EngineConfig, got {type(config).__name__}")
    # Shapes and dtypes only (no transfer): a mismatch names its leaf here, not deep in jax.
    check_params(params, config.model, where="Engine")
    self.config = config
    self.runner = Runner(params, config)
    self.state = init_paged_state(config.model, config.kv)
    self.allocator = PageAllocator(config.kv.num_pages, config.page_size)
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
        invalid sampling parameters (wrong types, top_k above the vocabulary, stop
        tokens outside it, ...), a prompt longer than the model's maximum length.
        Nothing is queued.
      RequestRejected: (a ValueError, reason ``too_long``) prompt + max_new_tokens
        can never fit: longer than the model's maximum length, the block-table
        width or the whole page pool.
    """
    return self._enqueue(*self.check_request(prompt_ids, sampling))

  def check_request(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams()
                    ) -> tuple[tuple[int, ...], SamplingParams]:
    """Validates a request without queueing it (what ``submit`` checks).

    Returns:
      (prompt as a tuple of ints, validated SamplingParams).

    Raises:
      ValueError / RequestRejected: as :meth:`submit`.
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
    if total > self.max_seq_tokens:
      self.stats.rejected[ABORT_TOO_LONG] += 1
      q = len(self.allocator.quarantined)
      raise RequestRejected(
          f"submit: prompt ({prompt.size} tokens) + max_new_tokens ({sampling.max_new_tokens}) "
          f"= {total} tokens can never fit: the engine holds at most {self.max_seq_tokens} "
          f"tokens per sequence (model max {mcfg.max_seq_len}, {self.config.max_pages_per_seq} "
          f"pages/seq and {self.config.kv.num_pages} pool pages of {self.config.page_size}"
          + (f", {q} of them quarantined" if q else "") + ")")
    return tuple(int(t) for t in prompt), sampling

  @property
  def max_seq_tokens(self) -> int:
    """The longest sequence one request may reach now (quarantined pages no longer count)."""
    usable = self.allocator.num_pages - len(self.allocator.quarantined)
    return min(self.config.max_seq_tokens, usable * self.config.page_size)

  def _enqueue(self, prompt: tuple[int, ...], sampling: SamplingParams) -> int:
    rid = self._next_id
    self._next_id += 1
    req = Request(request_id=rid, prompt=prompt, sampling=sampling,
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
    touched: dict[int, tuple[Request, int]] = {}  # id -> (request, tokens before this step)

    def touch(reqs):
      for r in reqs:
        touched.setdefault(r.request_id, (r, len(r.output)))

    touch(self.audit_pages())
    plan = self.scheduler.schedule()
    self.stats.preemptions += len(plan.preempted)
    dropped = self.enforce_conservation(self.allocator.drain_violations())
    touch(dropped)
    plan = plan.without(set(dropped))
    if plan.allocation_changed or self._tags_dirty:
      self.state = sync_tags(self.state, self.allocator.device_tags())
      self._tags_dirty = False
    pre, pre_rows = self._build(build_prefill_batch, plan.prefill, touch)
    dec, dec_rows = self._build(build_decode_batch, plan.decode, touch)
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
    generated = 0
    now = t2
    k = 0
    if pre is not None:
      tok, ok, lg = host[k]
      k += 1
      touch(it.req for it in pre_rows)
      for i, item in enumerate(pre_rows):
        generated += self._finish_row(item.req, bool(ok[i]), tok[i], lg, i, now, prefill_n=item.n)
    if dec is not None:
      tok, ok, lg = host[k]
      touch(dec_rows)
      for i, req in enumerate(dec_rows):
        generated += self._finish_row(req, bool(ok[i]), tok[i], lg, i, now)
    touch(self.audit_pages())
    results = [RequestOutput(r.request_id, tuple(r.output[n:]), r.status, r.finish_reason,
                             r.abort_reason) for r, n in touched.values()]
    t3 = time.perf_counter()
    self.stats.record_step(host_s=(t1 - t0) + (t3 - t2), device_s=t2 - t1,
                           prefill=pre is not None, decode=dec is not None, generated=generated,
                           prefilled=sum(it.n for it in pre_rows), start=t0)
    if cfg.log_every and self.stats.steps % cfg.log_every == 0:
      self.log_metrics()
    return results

  def _build(self, builder, items, touch):
    """Builds one step's batch; a request whose row cannot be built is aborted (reason ``error``)."""
    if not items:
      return None, []
    batch, rows, failed = builder(self.config, self.scheduler, items)
    for req, err in failed:
      touch([req])
      self._error_abort(req, err)
    return batch, rows

  def _finish_row(self, req: Request, ok: bool, token, logits, i: int, now: float,
                  prefill_n: int | None = None) -> int:
    """Host bookkeeping of one row's result; returns the tokens it emitted (0 or 1)."""
    if not ok:
      self._integrity_abort(req, "its page-tag check failed")
      return 0
    try:
      if prefill_n is not None:
        req.num_computed += prefill_n
        if req.num_computed < len(req.prefill_tokens):
          return 0
        req.status = RequestStatus.DECODING
      return self._emit(req, token, logits[i] if logits is not None else None, now)
    except Exception as e:  # one request's bad state must not stop the others
      self._error_abort(req, f"{type(e).__name__}: {e}")
      return 0

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

    Atomic: every request is checked before any is queued.

    Raises:
      ValueError: as :meth:`submit` for any prompt (nothing is queued), or a SamplingParams
        list whose length differs from the prompts'.
    """
    checked = check_batch(self.check_request, prompts, sampling)
    ids = [self._enqueue(p, s) for p, s in checked]
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
             pages_quarantined=len(self.allocator.quarantined),
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

  # --------------------------------------------------------------- page conservation
  def audit_pages(self) -> list[Request]:
    """Audits page conservation and enforces it (see :meth:`enforce_conservation`).

    Returns:
      The requests aborted because they held a violating page.
    """
    if not self.config.page_audit:
      return []
    t0 = time.perf_counter()
    violations = self.allocator.audit()
    self.stats.audit_seconds += time.perf_counter() - t0
    return self.enforce_conservation(violations)

  def enforce_conservation(self, violations: Sequence[PageViolation]) -> list[Request]:
    """Quarantines the pages of ``violations`` and aborts every request holding one.

    Their contents and their owners' tables are not trusted any more, so the
    pages never return to the free list, and each holder ends with reason
    ``integrity`` before it can read from or write to them again. The
    allocator is then rebuilt from the remaining tables.

    Returns:
      The requests aborted.
    """
    if not violations:
      return []
    self.stats.page_violations += len(violations)
    for v in violations:
      logging.error("engine: page conservation violated: %s", v)
    aborted = []
    for rid in self.allocator.recover(violations):
      req = self.requests.get(rid)
      if req is None or req.done:
        continue
      self.scheduler.forget(req)
      self.stats.integrity_failures += 1
      why = "it holds page(s) that failed the page-conservation audit"
      logging.error("engine: request %d aborted: %s", req.request_id, why)
      self._abort(req, ABORT_INTEGRITY, why)
      aborted.append(req)
    self.scheduler.invalidate_rows()
    self._tags_dirty = True
    # The pool shrank: a request that can no longer fit would wait forever.
    limit = self.max_seq_tokens
    for req in [*self.scheduler.waiting, *self.scheduler.running]:
      if len(req.prompt) + req.sampling.max_new_tokens > limit:
        self.scheduler.remove(req)
        self._abort(req, ABORT_TOO_LONG, f"the pool now holds at most {limit} tokens per "
                    f"sequence ({len(self.allocator.quarantined)} pages quarantined)")
        aborted.append(req)
    return aborted

  def _integrity_abort(self, req: Request, why: str) -> None:
    logging.error("engine: request %d aborted: %s", req.request_id, why)
    self.scheduler.drop_failed(req)
    self.stats.integrity_failures += 1
    self._abort(req, ABORT_INTEGRITY, why)

  def _error_abort(self, req: Request, why: str) -> None:
    logging.error("engine: request %d aborted after an error: %s", req.request_id, why)
    self.scheduler.remove(req)
    self._tags_dirty = True
    self._abort(req, ABORT_ERROR, why)

  def _abort(self, req: Request, reason: str, error: str | None = None) -> None:
    req.status = RequestStatus.ABORTED
    req.abort_reason = reason
    req.error = error
    req.finish_time = time.perf_counter()
    self.stats.aborted[reason] += 1


def _sampling_row(r: Request) -> tuple:
  """One request's sampling values as the step's dtypes (raises if one does not fit)."""
  s = r.sampling
  return (np.uint32(s.seed), np.float32(s.temperature), np.int32(s.top_k), np.float32(s.top_p),
          np.int32(len(r.output)))  # the index of the token this row samples


def _rows(items, row_fn):
  """(item, row values) for the items whose row builds, and (request, error) for the others."""
  rows, failed = [], []
  for it in items:
    req = it.req if isinstance(it, PrefillItem) else it
    try:
      rows.append((it, row_fn(it)))
    except Exception as e:  # one request's row must not stop the batch
      failed.append((req, f"building its step inputs raised {type(e).__name__}: {e}"))
  return rows, failed


def _sampling_arrays(values, B: int):
  """Per-row sampling arrays [B] for a step; padded rows are greedy with seed 0."""
  seeds = np.zeros(B, np.uint32)
  temp = np.zeros(B, np.float32)
  top_k = np.zeros(B, np.int32)
  top_p = np.ones(B, np.float32)
  steps = np.zeros(B, np.int32)
  for i, v in enumerate(values):
    seeds[i], temp[i], top_k[i], top_p[i], steps[i] = v
  return seeds, temp, top_k, top_p, steps


def build_prefill_batch(config: EngineConfig, scheduler, items):
  """The StepBatch of one prefill step over scheduler PrefillItems.

  Args:
    config: the pool's EngineConfig (buckets).
    scheduler: the pool's Scheduler (block tables).
    items: PrefillItems from ``Scheduler.schedule``.

  Returns:
    (batch, rows, failed): a StepBatch with B = the batch bucket of len(rows) rows
    and T = the prefill bucket of the longest chunk (padded rows have length 0), or
    None if no row could be built; the PrefillItems in batch order; and
    (request, error) for each item whose row raised (the caller aborts those).
  """
  def row(it):
    toks = np.asarray(it.req.prefill_tokens[it.start:it.start + it.n], np.int32)
    if toks.shape != (it.n,):
      raise ValueError(f"chunk [{it.start}, {it.start + it.n}) is outside its "
                       f"{len(it.req.prefill_tokens)} prefill tokens")
    return toks, _sampling_row(it.req), scheduler.row(it.req)

  built, failed = _rows(items, row)
  if not built:
    return None, [], failed
  rows = [it for it, _ in built]
  B = config.batch_bucket(len(rows))
  T = config.prefill_bucket(max(it.n for it in rows))
  tokens = np.zeros((B, T), np.int32)
  positions = np.zeros((B, T), np.int32)
  lengths = np.zeros(B, np.int32)
  last = np.zeros(B, np.int32)
  for i, (it, (toks, _, _)) in enumerate(built):
    tokens[i, :it.n] = toks
    positions[i] = np.arange(it.start, it.start + T)
    lengths[i] = it.start + it.n
    last[i] = it.n - 1
  bt, et = scheduler.fill_tables([it.req for it in rows], B)
  seeds, temp, top_k, top_p, steps = _sampling_arrays([v[1] for _, v in built], B)
  return StepBatch(tokens, positions, bt, et, lengths, last, seeds, steps, temp, top_k,
                   top_p), rows, failed


def build_decode_batch(config: EngineConfig, scheduler, reqs):
  """The StepBatch of one decode step: each request's last token at position context_len - 1.

  Returns:
    (batch or None, requests in batch order, [(request, error)]) as build_prefill_batch.
  """
  def row(r):
    return np.int32(r.output[-1]), _sampling_row(r), scheduler.row(r)

  built, failed = _rows(reqs, row)
  if not built:
    return None, [], failed
  rows = [r for r, _ in built]
  B = config.batch_bucket(len(rows))
  tokens = np.zeros((B, 1), np.int32)
  positions = np.zeros((B, 1), np.int32)
  lengths = np.zeros(B, np.int32)
  for i, (r, (tok, _, _)) in enumerate(built):
    tokens[i, 0] = tok
    positions[i, 0] = r.context_len - 1
    lengths[i] = r.context_len
  bt, et = scheduler.fill_tables(rows, B)
  seeds, temp, top_k, top_p, steps = _sampling_arrays([v[1] for _, v in built], B)
  return StepBatch(tokens, positions, bt, et, lengths, np.zeros(B, np.int32), seeds, steps, temp,
                   top_k, top_p), rows, failed


def check_batch(check, prompts, sampling) -> list[tuple[tuple[int, ...], SamplingParams]]:
  """Checks a batch of requests with ``check(prompt, sampling)`` before any is queued.

  Args:
    check: an engine's ``check_request``.
    prompts: the prompts.
    sampling: one SamplingParams for all, or one per prompt.

  Returns:
    The checked (prompt, sampling) pairs, in order.

  Raises:
    ValueError: the first failing request's error, naming its index; a SamplingParams
      list whose length differs from the prompts'.
  """
  if isinstance(sampling, SamplingParams):
    samplings = [sampling] * len(prompts)
  else:
    try:
      samplings = list(sampling)
    except TypeError:
      raise ValueError(f"generate: sampling must be a SamplingParams or a sequence of them, "
                       f"got {type(sampling).__name__}") from None
  if len(samplings) != len(prompts):
    raise ValueError(f"generate: {len(samplings)} SamplingParams for {len(prompts)} prompts")
  out = []
  for i, (p, s) in enumerate(zip(prompts, samplings)):
    try:
      out.append(check(p, s))
    except ValueError as e:
      e.args = (f"request {i} of the batch: {e}",) + e.args[1:]
      raise
  return out


def _validate_sampling(sampling, vocab_size: int) -> SamplingParams:
  """Re-validates sampling parameters (also ones built around ``__post_init__``)."""
  if not isinstance(sampling, SamplingParams):
    raise ValueError(f"submit: sampling must be a SamplingParams, got {type(sampling).__name__}")
  try:
    sampling = dataclasses.replace(sampling)  # reruns SamplingParams.__post_init__
  except (TypeError, ValueError) as e:
    raise ValueError(f"submit: invalid sampling parameters: {e}") from None
  if sampling.top_k > vocab_size:
    raise ValueError(f"submit: SamplingParams.top_k must be at most the vocabulary size "
                     f"{vocab_size}, got {sampling.top_k}")
  bad = [t for t in sampling.stop_tokens if not 0 <= t < vocab_size]
  if bad:
    raise ValueError(f"submit: stop tokens outside [0, {vocab_size}): {bad}")
  return sampling
