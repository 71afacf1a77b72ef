"""The serving interface every engine implements, and the loop logic they share.

:class:`ServingEngine` is the protocol: ``submit / check_request / step /
stream / cancel / generate / serve_arriving / run_until_done / metrics / get /
has_unfinished``. ``Engine`` (one pool) and ``DisaggEngine`` (a prefill pool
and a decode pool) both implement it, and one conformance suite
(tests/test_serving_conformance.py) holds both to it. :class:`ServingLoop`
holds the parts that are the same for every engine, so they exist once.
docs/engine.md describes the step and the pools.
"""

from __future__ import annotations

import collections
from typing import Iterator, Protocol, Sequence, runtime_checkable

import numpy as np

from mlkit.engine.metrics import request_metrics
from mlkit.engine.request import Request, RequestOutput
from mlkit.sampling import SamplingParams


class EngineStalled(RuntimeError):
  """Raised by ``run_until_done`` when a step makes no progress (a scheduling deadlock)."""


@runtime_checkable
class ServingEngine(Protocol):
  """What a serving engine offers its callers (a server, an experiment, a test)."""

  requests: dict[int, Request]

  def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams = ...) -> int: ...

  def check_request(self, prompt_ids: Sequence[int], sampling: SamplingParams = ...
                    ) -> tuple[tuple[int, ...], SamplingParams]: ...

  def step(self) -> list[RequestOutput]: ...

  def stream(self, request_id: int) -> Iterator[int]: ...

  def cancel(self, request_id: int) -> bool: ...

  def generate(self, prompts: Sequence[Sequence[int]], sampling=...) -> list[list[int]]: ...

  def serve_arriving(self, prompts: Sequence[Sequence[int]], sampling=..., *, at_once: int,
                     max_steps: int | None = None) -> tuple[list[Request], int]: ...

  def run_until_done(self, max_steps: int | None = None) -> dict[int, Request]: ...

  def metrics(self, include_requests: bool = False) -> dict: ...

  def get(self, request_id: int) -> Request: ...

  def has_unfinished(self) -> bool: ...


class ServingLoop:
  """The engine-independent half of :class:`ServingEngine`.

  Subclasses provide ``requests``, ``submit``, ``check_request``, ``step``,
  ``has_unfinished``, ``_progress_marker()`` (changes whenever a step did
  anything) and ``_queue_summary()`` (for stall messages).
  """

  requests: dict[int, Request]

  def get(self, request_id: int) -> Request:
    """The Request object (its status, output and reasons).

    Raises:
      KeyError: unknown request id.
    """
    if request_id not in self.requests:
      raise KeyError(f"unknown request id {request_id!r}")
    return self.requests[request_id]

  def request_metrics(self, request_id: int) -> dict:
    """Per-request metrics (see mlkit.engine.metrics.request_metrics)."""
    return request_metrics(self.get(request_id))

  def run_until_done(self, max_steps: int | None = None) -> dict[int, Request]:
    """Steps until every request has ended.

    Returns:
      All requests by id.

    Raises:
      EngineStalled: a step changed nothing (no token, no prefill progress, no
        state change) while requests remain, or max_steps ran out.
    """
    steps = 0
    while self.has_unfinished():
      steps += 1
      self._checked_step(steps, max_steps)
    return self.requests

  def _checked_step(self, steps: int, max_steps: int | None, *, more_to_come: bool = False):
    """Runs step number ``steps``; raises EngineStalled when it changed nothing while
    requests remain, or when ``max_steps`` ran out with requests unfinished (or, with
    ``more_to_come``, still to be submitted)."""
    before = self._progress_marker()
    self.step()
    if self._progress_marker() == before and self.has_unfinished():
      raise EngineStalled(f"{type(self).__name__} made no progress in step {steps}: "
                          f"{self._queue_summary()}")
    if (max_steps is not None and steps >= max_steps
        and (more_to_come or self.has_unfinished())):
      raise EngineStalled(f"requests still unfinished after {max_steps} steps: "
                          f"{self._queue_summary()}")

  def stream(self, request_id: int) -> Iterator[int]:
    """Yields a request's tokens as they are generated, stepping the engine as needed.

    Other requests advance too (they share the steps); their tokens stay in
    their Request objects.

    Raises:
      KeyError: unknown request id (before the first token).
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

    Atomic: every request is checked (``check_request``) before any is queued.

    Raises:
      ValueError: as ``submit`` for any prompt (nothing is queued), or a SamplingParams
        list whose length differs from the prompts'.
    """
    checked = check_batch(self.check_request, prompts, sampling)
    # The Request objects themselves: a long batch's first results may leave the engine's
    # window of ended requests before the last one ends.
    reqs = [self.get(self.submit(p, s)) for p, s in checked]
    self.run_until_done()
    return [list(r.output) for r in reqs]

  def serve_arriving(self, prompts: Sequence[Sequence[int]],
                     sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(), *,
                     at_once: int, max_steps: int | None = None) -> tuple[list[Request], int]:
    """Serves prompts that arrive while others run: the first ``at_once`` together, then one
    more before each step, stepping until every request has ended. The experiments replay
    their workloads' arrivals with it.

    Atomic as :meth:`generate`: every request is checked before any is queued.

    Returns:
      (the Request objects, in prompt order; the steps taken).

    Raises:
      ValueError: ``at_once`` below 1, or as :meth:`generate`.
      EngineStalled: as :meth:`run_until_done`: a step changed nothing while requests
        remain, or ``max_steps`` ran out first.
    """
    if at_once < 1:
      raise ValueError(f"serve_arriving: at_once must be >= 1, got {at_once}")
    checked = check_batch(self.check_request, prompts, sampling)
    reqs = [self.get(self.submit(p, s)) for p, s in checked[:at_once]]
    pending = checked[at_once:]
    steps = 0
    while pending or self.has_unfinished():
      if pending:
        reqs.append(self.get(self.submit(*pending.pop(0))))
      steps += 1
      self._checked_step(steps, max_steps, more_to_come=bool(pending))
    return reqs, steps

  def _mean_latencies(self, requests) -> dict:
    """{"mean_ttft_s", "mean_tpot_s"} over ``requests`` that emitted a token (None if none)."""
    done = [request_metrics(r) for r in requests if r.first_token_time is not None]
    ttfts = [m["ttft_s"] for m in done]
    tpots = [m["tpot_s"] for m in done if m["tpot_s"] is not None]
    return {"mean_ttft_s": float(np.mean(ttfts)) if ttfts else None,
            "mean_tpot_s": float(np.mean(tpots)) if tpots else None}


class EndedWindow:
  """Keeps the most recent ``size`` ended requests in a registry and lets older ones go.

  An engine's ``requests`` holds what is live plus this window, so that
  ``get()`` still answers for a request whose result was just handed out, while
  memory follows what is live rather than everything ever served.

  Args:
    registry: the id -> Request map the window trims.
    size: ended requests kept (>= 0).
  """

  def __init__(self, registry: dict, size: int):
    self.registry = registry
    self.size = size
    self.count = 0  # requests ever ended
    self._ids: collections.deque = collections.deque()

  def add(self, req: Request) -> list[int]:
    """Records that ``req`` ended; returns the ids of older ended requests that left."""
    self.count += 1
    self._ids.append(req.request_id)
    gone = []
    while len(self._ids) > self.size:
      rid = self._ids.popleft()
      old = self.registry.get(rid)
      if old is not None and old.done:
        del self.registry[rid]
        gone.append(rid)
    return gone


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
