"""A request's lifecycle: waiting -> prefilling -> decoding -> finished, or aborted with a reason."""

from __future__ import annotations

import dataclasses
import enum

from mlkit.sampling import SamplingParams


class RequestStatus(enum.Enum):
  """Where a request is. WAITING holds no pages; PREFILLING and DECODING hold pages."""

  WAITING = "waiting"
  PREFILLING = "prefilling"
  DECODING = "decoding"
  FINISHED = "finished"
  ABORTED = "aborted"


# Why a request was aborted (Request.abort_reason).
ABORT_INTEGRITY = "integrity"  # its page-tag check failed: it may have read another request's page
ABORT_TOO_LONG = "too_long"  # prompt + max_new_tokens can never fit (rejected at submit)
ABORT_CANCELLED = "cancelled"  # the user cancelled it
ABORT_TRANSFER = "transfer"  # its KV failed the checksum on every prefill->decode transfer try
ABORT_ERROR = "error"  # preparing or finishing its part of a step raised; the others went on
# Serving processes (mlkit.serve, docs/serving_processes.md): the peer process holding its
# prefill died or its connection dropped, or did not answer within the configured timeout.
ABORT_PEER_LOST = "peer_lost"
ABORT_TIMEOUT = "timeout"
ABORT_REASONS = (ABORT_INTEGRITY, ABORT_TOO_LONG, ABORT_CANCELLED, ABORT_TRANSFER, ABORT_ERROR,
                 ABORT_PEER_LOST, ABORT_TIMEOUT)

# Why a request finished (Request.finish_reason).
FINISH_STOP = "stop"  # it sampled one of its stop tokens (which is emitted)
FINISH_LENGTH = "length"  # it reached max_new_tokens


class RequestRejected(ValueError):
  """Raised by ``Engine.submit`` for a request the engine can never serve.

  Attributes:
    reason: an abort reason (``too_long``).
  """

  def __init__(self, message: str, reason: str = ABORT_TOO_LONG):
    super().__init__(message)
    self.reason = reason


@dataclasses.dataclass(eq=False)  # identity semantics: queues test membership with `in`
class Request:
  """One generation request and its progress (host-side bookkeeping only).

  Attributes:
    request_id: engine-unique int.
    prompt: the prompt token ids.
    sampling: its SamplingParams.
    status: a RequestStatus.
    output: tokens generated so far (emitted, in order).
    abort_reason / finish_reason: set when the request ends.
    error: for an abort, what went wrong (the check or exception), else None.
    num_computed: tokens of ``prefill_tokens`` already written to the cache.
    prefill_tokens: what prefill must write: the prompt, plus the output so far
      after a preemption (recompute).
    num_preemptions: times its pages were taken back and it was requeued.
    pending: tokens a dispatched, not yet collected step is sampling for it (0 or 1; the
      engine's overlapped mode schedules the next step before it knows them).
    arrival_time / first_token_time / finish_time: perf_counter seconds.
    drafts: speculative decoding: the tokens the drafter proposed after the newest output
      token, verified by the request's next step (empty: none yet, e.g. after a preemption).
  """

  request_id: int
  prompt: tuple[int, ...]
  sampling: SamplingParams
  arrival_time: float
  status: RequestStatus = RequestStatus.WAITING
  output: list = dataclasses.field(default_factory=list)
  abort_reason: str | None = None
  finish_reason: str | None = None
  error: str | None = None
  num_computed: int = 0
  prefill_tokens: tuple[int, ...] = ()
  num_preemptions: int = 0
  pending: int = 0
  admit_seq: int = -1
  first_token_time: float | None = None
  finish_time: float | None = None
  # Per emitted token, when sampling.logprobs is not None: (logprob, top ids, top logprobs),
  # the top lists sampling.logprobs long.
  logprobs: list | None = None
  drafts: tuple[int, ...] = ()

  @property
  def done(self) -> bool:
    return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

  @property
  def context_len(self) -> int:
    """Tokens the sequence holds: prompt plus generated (the last generated one is not yet cached)."""
    return len(self.prompt) + len(self.output)

  def emit(self, token: int, now: float, logprob=None) -> None:
    """Appends a generated token, and its log-probabilities when the request asked for them.

    Args:
      logprob: (token logprob, top ids [K], top logprobs [K]) of this token (K >= the
        request's ``sampling.logprobs``), or None.
    """
    if self.first_token_time is None:
      self.first_token_time = now
    self.output.append(int(token))
    k = self.sampling.logprobs
    if k is not None and logprob is not None:
      chosen, ids, lps = logprob
      if self.logprobs is None:
        self.logprobs = []
      self.logprobs.append((float(chosen), [int(i) for i in ids[:k]],
                            [float(x) for x in lps[:k]]))

  def should_stop(self) -> str | None:
    """The finish reason if the last token ends the request, else None."""
    if self.output and self.output[-1] in self.sampling.stop_tokens:
      return FINISH_STOP
    if len(self.output) >= self.sampling.max_new_tokens:
      return FINISH_LENGTH
    return None


@dataclasses.dataclass(frozen=True)
class RequestOutput:
  """What one engine step produced for one request.

  Attributes:
    request_id: the request.
    new_tokens: tokens emitted this step (possibly empty when it only ended).
    status: its status after the step.
    finish_reason / abort_reason: set once it ended.
  """

  request_id: int
  new_tokens: tuple[int, ...]
  status: RequestStatus
  finish_reason: str | None = None
  abort_reason: str | None = None

  @property
  def done(self) -> bool:
    return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)
