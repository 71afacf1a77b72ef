"""How an HTTP request reaches the engine thread and its tokens come back, without locks.

The HTTP server runs on an asyncio loop in a thread of its own; the engine has
one thread (``FrontDoor.serve_forever``). They meet in two places only:

* **In:** the asyncio side puts ``(HTTP, message)`` on the server's inbox
  queue, the same queue the sockets' reader threads fill, which wakes the
  engine thread at once. ``message`` is ``{"kind": "http_submit", "call":
  call}``, ``{"kind": "http_cancel", "call": call}`` or ``{"kind": "http_stop",
  "call": call, "index": i}``.
* **Out:** after each turn the engine thread hands every HTTP request's new
  tokens to its call with ``loop.call_soon_threadsafe``: an :class:`Update`
  per choice that changed, an :class:`Refusal` if the call was never queued.
  An :class:`Accepted` (or a :class:`Refusal`) comes first. No HTTP handler
  polls, and none holds a lock around an engine step.

Only plain data crosses (token ids, floats, strings); the engine's Request
objects never leave its thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

# The inbox's "connection" for messages from the HTTP side.
HTTP = "http"


@dataclasses.dataclass(frozen=True)
class Update:
  """What one choice of a call produced since its last update (engine thread -> asyncio).

  Attributes:
    index: the choice.
    tokens: new token ids.
    logprobs: per new token (logprob, top ids, top logprobs), when the call asked.
    done: the request ended.
    finish_reason: "stop" / "length" when it finished.
    abort_reason / error: why it was aborted (engine reasons: cancelled, integrity, ...).
    prompt_tokens: the prompt's length.
    ttft_s / latency_s: server-side, once known.
  """

  index: int
  tokens: tuple[int, ...]
  logprobs: tuple | None
  done: bool
  finish_reason: str | None = None
  abort_reason: str | None = None
  error: str | None = None
  prompt_tokens: int = 0
  ttft_s: float | None = None
  latency_s: float | None = None


@dataclasses.dataclass(frozen=True)
class Accepted:
  """The call's requests are queued (engine thread -> asyncio, before any Update)."""


@dataclasses.dataclass(frozen=True)
class Refusal:
  """The call was not queued (engine thread -> asyncio): an HTTP status and a message.

  Attributes:
    status: 400 (the request can never be served as asked) or 503 (the queue is full).
    message: what to fix, for the client.
    param: the request field at fault, when one is.
  """

  status: int
  message: str
  param: str | None = None


class Call:
  """One HTTP request's engine requests (its choices) and the queue their updates arrive on.

  Created on the asyncio loop; the engine thread fills ``request_ids`` and puts
  updates through :meth:`deliver`.

  Args:
    prompts: token ids, one list per choice.
    samplings: a ``SamplingParams`` per choice.
    loop: the asyncio loop the HTTP handler runs on.
  """

  def __init__(self, prompts: list[list[int]], samplings: list, loop: asyncio.AbstractEventLoop):
    if len(prompts) != len(samplings):
      raise ValueError(f"{len(prompts)} prompts for {len(samplings)} sampling entries")
    self.prompts = prompts
    self.samplings = samplings
    self.loop = loop
    self.queue: asyncio.Queue = asyncio.Queue()
    self.created = time.time()
    self.request_ids: list[int] = []  # engine thread only

  def deliver(self, item: Update | Refusal) -> None:
    """Hands an item to the asyncio side (from the engine thread; never blocks)."""
    try:
      self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
    except RuntimeError:
      pass  # the loop is closed: the HTTP server is gone, nobody waits for it


@dataclasses.dataclass
class _Stream:
  call: Call
  index: int
  sent: int = 0  # tokens already delivered


class Streams:
  """The engine thread's record of HTTP requests in flight: request id -> where its tokens go.

  ``FrontDoor`` registers a call's requests when it queues them, and after every
  turn calls :meth:`push` with its request registry; each stream whose request
  emitted tokens or ended gets an :class:`Update`, and an ended one is dropped.
  """

  def __init__(self):
    self._streams: dict[int, _Stream] = {}

  def __len__(self) -> int:
    return len(self._streams)

  def add(self, rid: int, call: Call, index: int) -> None:
    self._streams[rid] = _Stream(call, index)

  def calls(self) -> dict[int, Call]:
    return {rid: s.call for rid, s in self._streams.items()}

  def push(self, requests: dict) -> list[Any]:
    """Delivers what changed; returns the Request objects of streams that ended.

    One turn's updates go to the asyncio loop in one ``call_soon_threadsafe``: a wake-up
    per turn, not one per request.
    """
    ended, batch = [], []
    for rid, s in list(self._streams.items()):
      req = requests.get(rid)
      if req is None:  # left without a result (cannot happen while registered)
        batch.append((s.call, Update(s.index, (), None, True, abort_reason="error",
                                     error="the request was lost")))
        del self._streams[rid]
        continue
      n = len(req.output)
      if n == s.sent and not req.done:
        continue
      new = tuple(req.output[s.sent:n])
      lps = tuple(req.logprobs[s.sent:n]) if req.logprobs is not None else None
      s.sent = n
      ttft = (req.first_token_time - req.arrival_time
              if req.first_token_time is not None else None)
      latency = req.finish_time - req.arrival_time if req.finish_time is not None else None
      batch.append((s.call, Update(s.index, new, lps, req.done, req.finish_reason,
                                   req.abort_reason, req.error, len(req.prompt), ttft, latency)))
      if req.done:
        del self._streams[rid]
        ended.append(req)
    by_loop: dict = {}
    for call, item in batch:
      by_loop.setdefault(call.loop, []).append((call.queue, item))
    for loop, items in by_loop.items():
      try:
        loop.call_soon_threadsafe(_put_all, items)
      except RuntimeError:
        pass  # the loop is closed: the HTTP server is gone
    return ended


def _put_all(items) -> None:
  for queue, item in items:
    queue.put_nowait(item)
