"""The front door: the decode server (with a remote prefill server) and the colocated server.

Clients send ``generate`` (prompts and sampling values) and get one ``result``
when every request of the batch has ended. Both servers keep one thread on
their Engine; a daemon thread per connection reads messages into one inbox.

The decode server (docs/serving_processes.md has the sequence and the failure table):

1. admits a request by *reserving* its pages in its own pool before anything
   else happens, so a request whose prefill succeeds can always land;
2. sends ``prefill`` (tokens, sampling, a fresh transfer uuid) to the prefill server;
3. on ``offered`` pulls the payload with the transfer server in a thread of its
   own (a dead or stuck peer costs a timeout, not the serving thread), checks
   the checksum against the one computed before the payload left (a mismatch
   asks for a ``resend`` under a new uuid until the attempts run out, then the
   request is aborted with reason ``transfer``), releases the reservation and
   ``adopt``s the request into its Engine with a fill that runs
   ``mlkit.engine.transfer.land_payload`` (write, then the landing checksum;
   fresh page tags come from ``adopt``), and tells the prefill server to
   ``release`` its pages;
4. decodes it with every other running request, and preempted requests go back
   through steps 1-3 (recomputed remotely).

A dropped prefill connection aborts every request it held with reason
``peer_lost`` and frees their reservations; the server reconnects to the same
address and serves on. A prefill or pull that takes longer than its timeout
aborts the request with reason ``timeout``.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import threading
import time

import jax
import numpy as np
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from mlkit.engine.request import (ABORT_CANCELLED, ABORT_ERROR, ABORT_PEER_LOST, ABORT_TIMEOUT, ABORT_TRANSFER,
                                  FINISH_LENGTH, Request, RequestStatus)
from mlkit.engine import lockstep
from mlkit.engine.transfer import land_fill, verify_payload
from mlkit.serve import protocol as proto
from mlkit.serve.arrival import ArrivalWindow
from mlkit.serve.http.calls import HTTP, Accepted, Refusal, Streams


# An inbox event from a pull thread (not a wire message): a payload arrived or failed.
PULLED = "pulled"


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
  """Timeouts and retries of a decode server (seconds).

  Raises:
    ValueError: naming a non-positive field.
  """

  # Wait this long for a prefill's answer (offered / finished / failed) before aborting (timeout).
  prefill_timeout_s: float = 60.0
  # Wait this long for one pull of a payload.
  pull_timeout_s: float = 30.0
  # Transfer attempts per request; a checksum mismatch asks for a resend until they run out.
  transfer_attempts: int = 2
  # Between reconnection tries after the prefill server went away.
  reconnect_interval_s: float = 0.5

  def __post_init__(self):
    for name in ("prefill_timeout_s", "pull_timeout_s", "reconnect_interval_s"):
      if not getattr(self, name) > 0:
        raise ValueError(f"DecodeOptions.{name} must be > 0, got {getattr(self, name)!r}")
    if not isinstance(self.transfer_attempts, int) or self.transfer_attempts < 1:
      raise ValueError(f"DecodeOptions.transfer_attempts must be an int >= 1, "
                       f"got {self.transfer_attempts!r}")


@dataclasses.dataclass
class _Batch:
  """One client's generate call: its requests, answered together.

  ``key`` is the client's id for it (``generate``'s ``batch``), by which any
  client may ``cancel`` it; None when the client gave none.
  """

  conn: object
  ids: list
  key: int | None = None


@dataclasses.dataclass
class _Flight:
  """A request between admission and landing (its pages reserved here)."""

  req: Request
  uuid: int
  sent_at: float
  attempts: int = 0
  offer: dict | None = None
  pull: "_Pull | None" = None
  offered_at: float | None = None
  emitted: bool = False  # its first token (from the first offer) was emitted


class _Pull(threading.Thread):
  """Pulls one offered payload (blocking in JAX) off the serving thread."""

  def __init__(self, conn, uuid: int, specs, wake, delay_s: float = 0.0):
    super().__init__(daemon=True)
    self.conn, self.uuid, self.specs, self.wake = conn, uuid, specs, wake
    self.delay_s = delay_s  # test fault: the pull starts this much later (a slow transfer)
    self.result = self.error = None
    self.started_at = time.monotonic()
    self.seconds = None

  def run(self):
    try:
      if self.delay_s:
        time.sleep(self.delay_s)
      out = self.conn.pull(self.uuid, self.specs)
      jax.block_until_ready(out)
      self.result = out
    except Exception as e:  # a dead peer: reported to the serving thread, which decides
      self.error = e
    self.seconds = time.monotonic() - self.started_at
    self.wake()  # the serving thread may be blocked on its inbox: it lands the payload now


@dataclasses.dataclass
class DecodeStats:
  submitted: int = 0
  transfers: int = 0
  transfer_retries: int = 0
  transfer_failures: int = 0
  transfer_bytes: int = 0
  transfer_seconds: float = 0.0
  timeouts: int = 0
  peer_lost: int = 0
  reconnects: int = 0
  requeued: int = 0
  aborted: collections.Counter = dataclasses.field(default_factory=collections.Counter)


class FrontDoor:
  """What the decode and colocated servers share: clients, batches, request ends."""

  def __init__(self, engine, listener, model_name: str, *, max_waiting: int = 1024,
               arrival_window: ArrivalWindow = ArrivalWindow()):
    self.engine = engine
    self.listener = listener
    self.model_name = model_name
    self.inbox = proto.Inbox()
    # The requests of batches not yet answered: a request leaves once its result is sent.
    self.requests: dict[int, Request] = {}
    self._batches: list[_Batch] = []
    self._stop = False
    # HTTP requests in flight (mlkit.serve.http), and how many may wait before new ones
    # are refused (HTTP 503).
    self.http_streams = Streams()
    self.max_waiting = max_waiting
    self.arrival_window = arrival_window
    self._arrivals = 0  # requests queued so far (opens the arrival window)
    # Prometheus metrics (mlkit.serve.http.metrics.ServeMetrics) when serving HTTP, and when
    # they last got a snapshot of the engine.
    self.serve_metrics = None
    self._snapshot_at = 0.0
    # What clients may send, bounded by this server's model (token ids, prompt lengths).
    self.client_kinds = proto.front_door_kinds(engine.config.model.vocab_size,
                                               engine.config.model.max_seq_len)

  def serve_forever(self) -> None:
    """Runs the engine thread's loop until a shutdown (or :meth:`stop`). Without a listener
    (``None``: an in-process front door) only HTTP-side messages reach the inbox."""
    if self.listener is not None:
      self.inbox.accept_from(self.listener, self.client_kinds)
    while not self._stop:
      self.poll(0.0 if self._busy() else 0.02)

  def stop(self) -> None:
    """Ends :meth:`serve_forever` within one turn (from any thread)."""
    self._stop = True

  def _busy(self) -> bool:
    # Only engine work spins the loop. Anything else waits on a message or a pull, both of which
    # wake the inbox (a spinning serving thread would starve the threads that read the sockets
    # and pull the KV); timeouts are checked at least every 20 ms.
    return self.engine.has_unfinished()

  def poll(self, wait_s: float) -> None:
    raise NotImplementedError

  def _handle(self, conn, msg: dict) -> None:
    raise NotImplementedError

  def _take_messages(self, wait_s: float) -> None:
    """Handles the inbox's messages, waiting up to ``wait_s`` for the first; after one that
    queued new requests, keeps taking them as :class:`ArrivalWindow` says."""
    window, until = self.arrival_window, None
    item = self.inbox.get(wait_s)
    while item is not None:
      arrivals = self._arrivals
      self._handle(*item)
      if until is None and self._arrivals != arrivals and window.gap_s > 0:
        until = time.monotonic() + window.max_s
      item = self.inbox.get(0.0)
      if item is None and until is not None and self._has_room():
        left = until - time.monotonic()
        if left > 0:
          item = self.inbox.get(min(window.gap_s, left))

  def _has_room(self) -> bool:
    """Whether the engine could take another request now (running plus waiting below
    ``max_running``)."""
    return (len(self.engine.running_ids()) + self.waiting()
            < self.engine.config.max_running)

  def _handle_client(self, conn, msg: dict) -> bool:
    """Handles a client's message; False when it is not a client message."""
    kind = msg["kind"]
    if kind == "generate":
      try:
        prompts = msg["prompts"]
        samplings = [proto.sampling_from_dict(s) for s in msg["sampling"]]
        if len(samplings) != len(prompts):
          raise ValueError(f"{len(samplings)} sampling entries for {len(prompts)} prompts")
        checked = [self.engine.check_request(p, s) for p, s in zip(prompts, samplings)]
      except (ValueError, TypeError, KeyError) as e:
        self.inbox.send(conn, proto.message("error", error=f"generate: {e}"))
        return True
      ids = [self._new_request(p, s) for p, s in checked]
      self._arrivals += len(ids)
      self._batches.append(_Batch(conn, ids, msg.get("batch")))
      self._answer_batches()
    elif kind == "cancel":  # from any connection: the batch's unfinished requests end now
      n = 0
      for b in self._batches:
        if b.key is not None and b.key == msg["batch"]:
          for rid in b.ids:
            if not self.requests[rid].done:
              self._cancel(rid, "cancelled by its client")
              n += 1
      self.inbox.send(conn, proto.message("ok", cancelled=n))
      self._answer_batches()
    elif kind == "fault":
      self._fault(conn, msg)
    elif conn == HTTP and kind == "http_submit":
      self._http_submit(msg["call"])
    elif conn == HTTP and kind == "http_cancel":
      for rid in msg["call"].request_ids:
        if rid in self.requests and not self.requests[rid].done:
          self._cancel(rid, "its HTTP client disconnected")
    elif conn == HTTP and kind == "http_stop":  # a stop string ended this choice
      rid = msg["call"].request_ids[msg["index"]]
      if rid in self.requests and not self.requests[rid].done:
        self._stop_request(rid)
    elif kind == "metrics":
      self.inbox.send(conn, proto.message("ok", metrics=self.metrics()))
    elif kind == "hello":
      self.inbox.send(conn, proto.message("welcome", version=proto.PROTOCOL_VERSION,
                                          role=self.role, model=self.model_name))
    elif kind == "shutdown":
      self._stop = True
      self.inbox.send(conn, proto.message("ok"))
    elif kind == proto.CLOSED:  # the client went away (or was refused): its requests end
      for b in [b for b in self._batches if b.conn is conn]:
        for rid in b.ids:
          if not self.requests[rid].done:
            self._cancel(rid, "its client disconnected")
          self.requests.pop(rid, None)
      self._batches = [b for b in self._batches if b.conn is not conn]
    else:
      return False
    return True

  def _fault(self, conn, msg: dict) -> None:
    """A test-only fault (``--enable-fault-injection``): a bookkeeping fault on a running
    request's pages (``page_fault``), and the server's own kinds (:meth:`_more_faults`)."""
    if not self.engine.config.enable_fault_injection:
      self.inbox.send(conn, proto.message("error", error="fault injection is disabled (start "
                                          "the server with --enable-fault-injection)"))
      return
    if "page_fault" in msg:
      from mlkit.engine.faults import Fault, FaultKind
      victims = self.engine.running_ids()
      if not victims:
        self.inbox.send(conn, proto.message("error", error="page_fault: no running request"))
        return
      try:
        self.engine.inject_fault(Fault(FaultKind(msg["page_fault"]), victims[-1]))
      except ValueError as e:
        self.inbox.send(conn, proto.message("error", error=f"page_fault: {e}"))
        return
    self._more_faults(msg)
    self.inbox.send(conn, proto.message("ok"))

  def _more_faults(self, msg: dict) -> None:
    pass

  def _answer_batches(self) -> None:
    keep = []
    for b in self._batches:
      reqs = [self.requests[i] for i in b.ids]
      if all(r.done for r in reqs):
        self.inbox.send(b.conn, proto.message("result", outputs=[_describe(r) for r in reqs]))
        for r in reqs:  # handed out: nothing here holds it any more
          del self.requests[r.request_id]
          self._ended(r)
      else:
        keep.append(b)
    self._batches = keep

  # ------------------------------------------------------------------ HTTP (mlkit.serve.http)
  def waiting(self) -> int:
    """Requests queued and not yet running (the engine's queue; a decode server adds its own)."""
    return self.engine.num_waiting()

  def _http_submit(self, call) -> None:
    """Queues an HTTP call's choices, or refuses it: 503 when the queue is full, 400 when a
    request can never be served as asked (nothing is queued then)."""
    if self.waiting() + len(call.prompts) > self.max_waiting:
      call.deliver(Refusal(503, f"the server's waiting queue is full ({self.max_waiting} "
                           "requests); retry later"))
      return
    try:
      checked = [self.engine.check_request(p, s) for p, s in zip(call.prompts, call.samplings)]
    except ValueError as e:  # RequestRejected among them
      call.deliver(Refusal(400, str(e).removeprefix("submit: ")))
      return
    call.request_ids = [self._new_request(p, s) for p, s in checked]
    self._arrivals += len(checked)
    call.deliver(Accepted())
    for i, rid in enumerate(call.request_ids):
      self.http_streams.add(rid, call, i)

  def _stop_request(self, rid: int) -> None:
    """Ends a live request as finished with reason stop (a stop string matched its text)."""
    if self.engine.holds(rid):
      self.engine.finish(rid, "stop")
    else:  # not in the engine yet (a decode server's request in flight): cancel it
      self._cancel(rid, "a stop string ended it")

  def _after_turn(self) -> None:
    """Hands HTTP requests their new tokens; refreshes the metrics snapshot now and then."""
    if self.http_streams:
      for req in self.http_streams.push(self.requests):
        del self.requests[req.request_id]
        self._ended(req)
    if self.serve_metrics is not None:
      now = time.monotonic()
      if now - self._snapshot_at > 0.5:
        self._snapshot_at = now
        self.serve_metrics.update(self.snapshot())

  def _ended(self, req: Request) -> None:
    if self.serve_metrics is not None:
      self.serve_metrics.observe_end(req)

  def snapshot(self) -> dict:
    """Gauges and counters of the server for /metrics (engine thread)."""
    m = self.engine.metrics()
    pc, spec = m.get("prefix_cache", {}), m.get("speculative", {})
    return {"running": m["running"], "waiting": self.waiting(), "pages_used": m["pages_used"],
            "pages_free": m["pages_free"], "pages_cached": m["pages_cached"],
            "pages_quarantined": m["pages_quarantined"],
            "prefix_cache_hit_rate": pc.get("token_hit_rate", 0.0),
            "prefix_cache_queries": pc.get("tokens_looked_up", 0),
            "prefix_cache_hits": pc.get("tokens_saved", 0),
            "generated_tokens": m["generated_tokens"], "prompt_tokens": m["prefill_tokens"],
            "spec_verify_rows": spec.get("verify_rows", 0),
            "spec_draft_tokens": spec.get("drafts_proposed", 0),
            "spec_accepted_tokens": spec.get("drafts_accepted", 0)}

  def metrics(self) -> dict:
    return self.engine.metrics()

  def _cancel(self, rid: int, why: str) -> None:
    if self.engine.holds(rid):
      self.engine.cancel(rid)


def _describe(r: Request) -> dict:
  ttft = r.first_token_time - r.arrival_time if r.first_token_time is not None else None
  return {"request_id": r.request_id, "tokens": list(r.output), "status": r.status.value,
          "finish_reason": r.finish_reason, "abort_reason": r.abort_reason,
          "error": r.error[:proto.MAX_MESSAGE_TEXT] if r.error else r.error,
          "ttft_s": ttft,
          "latency_s": r.finish_time - r.arrival_time if r.finish_time is not None else None}


class ColocatedServer(FrontDoor):
  """One plain Engine that prefills and decodes (no peer): the comparison point."""

  role = "colocated"

  def _new_request(self, prompt, sampling) -> int:
    rid = self.engine.submit(prompt, sampling)
    self.requests[rid] = self.engine.get(rid)
    return rid

  def _handle(self, conn, msg: dict) -> None:
    if not self._handle_client(conn, msg):
      self.inbox.send(conn, proto.message("error", error=f"a colocated server does not take "
                                          f"{msg['kind']!r}"))

  def poll(self, wait_s: float) -> None:
    self._take_messages(wait_s)
    if self.engine.has_unfinished():
      self.engine.step()
      self._answer_batches()
    self._after_turn()


class DecodeServer(FrontDoor):
  """The decode half: admits, asks a prefill server, pulls and lands KV, decodes.

  Args:
    engine: an ``Engine`` (role "serve") on this process's devices.
    listener: the client-facing Listener.
    transfer_server: a started ``jax.experimental.transfer`` server.
    prefill_address: the prefill server's control address HOST:PORT.
    key: the shared key of the serving channels (``mlkit.wire.keys``).
    model_name: must match the prefill server's.
    options: :class:`DecodeOptions`.
  """

  role = "decode"

  def __init__(self, engine, listener, transfer_server, prefill_address: str, *, key: bytes,
               model_name: str, options: DecodeOptions = DecodeOptions(),
               max_waiting: int = 1024, arrival_window: ArrivalWindow = ArrivalWindow()):
    super().__init__(engine, listener, model_name, max_waiting=max_waiting,
                     arrival_window=arrival_window)
    if engine.role != "serve":
      raise ValueError(f"DecodeServer needs an Engine with role 'serve', got {engine.role!r}")
    self.transfer = transfer_server
    self.prefill_address = prefill_address
    self.key = key
    self.options = options
    # What the prefill server may send this one (bounded by this server's model).
    self.peer_kinds = proto.peer_kinds(engine.config.model.vocab_size,
                                       engine.config.model.max_seq_len)
    self.stats = DecodeStats()
    self._ids = itertools.count()
    # uuids: random high bits per process, so two decode servers never collide on one prefill server.
    self._uuids = itertools.count(int.from_bytes(os.urandom(4), "little") << 24)
    self._queue: collections.deque[Request] = collections.deque()  # admitted to nothing yet
    self._flights: dict[int, _Flight] = {}  # by uuid
    self._peer = None  # control connection to the prefill server
    self._peer_ready = False
    self._pull_conn = None  # transfer connection to the prefill server's transfer server
    self._next_connect = 0.0
    self._pull_delay_s = 0.0  # test fault (EngineConfig.enable_fault_injection)
    self._pull_sharding = SingleDeviceSharding(engine.home_device())
    # A pool on local devices gets the pulled payload replicated on its mesh; a pool spread
    # over processes lands it through a lockstep.Fill instead (every process places it).
    self._replicated = (NamedSharding(engine.mesh, PartitionSpec())
                        if engine.mesh is not None and not engine.spans_processes else None)

  # ------------------------------------------------------------------ peer
  def connect_peer(self, timeout_s: float) -> None:
    """Connects to the prefill server and sends hello (the welcome arrives through the inbox).

    Raises:
      ConnectionError: no prefill server reachable within ``timeout_s``.
    """
    conn = proto.connect(self.prefill_address, self.key, timeout_s)
    self._peer, self._peer_ready = conn, False
    self.inbox.add(conn, self.peer_kinds)
    self.inbox.send(conn, proto.message("hello", version=proto.PROTOCOL_VERSION, role="decode",
                                        model=self.model_name))

  def wait_peer(self, timeout_s: float) -> None:
    """Serves the inbox until the prefill server's welcome arrived (start-up).

    Raises:
      ConnectionError: no welcome within ``timeout_s``, or a mismatched peer.
    """
    deadline = time.monotonic() + timeout_s
    while not self._peer_ready:
      if self._peer is None or time.monotonic() > deadline:
        raise ConnectionError(f"the prefill server at {self.prefill_address} did not answer "
                              f"hello within {timeout_s:g} s")
      self.poll(0.05)

  def _welcome(self, msg: dict) -> None:
    problems = []
    if msg.get("version") != proto.PROTOCOL_VERSION:
      problems.append(f"protocol version {msg.get('version')} != {proto.PROTOCOL_VERSION}")
    if msg.get("model") != self.model_name:
      problems.append(f"it serves {msg.get('model')!r}, this decode server {self.model_name!r}")
    try:
      self.engine.check_peer_layout(msg.get("attention"), msg.get("n_layers"))
    except ValueError as e:
      problems.append(str(e))
    if problems:
      logging.error("decode: refusing prefill server %s: %s", self.prefill_address,
                    "; ".join(problems))
      self._drop_peer("refused")
      self._next_connect = time.monotonic() + 5.0
      return
    self._pull_conn = self.transfer.connect(msg["transfer_address"])
    self._peer_ready = True
    logging.info("decode: prefill server %s ready (transfer %s)", self.prefill_address,
                 msg["transfer_address"])

  def _drop_peer(self, why: str) -> None:
    """Forgets the prefill server: every request it held ends with ``peer_lost``."""
    if self._peer is not None:
      try:
        self._peer.close()
      except OSError:
        pass
    self._peer, self._peer_ready, self._pull_conn = None, False, None
    self._next_connect = time.monotonic() + self.options.reconnect_interval_s
    lost = list(self._flights.values())
    if lost:
      logging.error("decode: prefill server lost (%s): aborting %d request(s)", why, len(lost))
    for f in lost:
      self.stats.peer_lost += 1
      self._fail(f, ABORT_PEER_LOST, f"the prefill server went away ({why})", release=False)

  def _maybe_reconnect(self) -> None:
    if self._peer is not None or time.monotonic() < self._next_connect:
      return
    try:
      self.connect_peer(timeout_s=0.2)
      self.stats.reconnects += 1
    except ConnectionError:
      self._next_connect = time.monotonic() + self.options.reconnect_interval_s

  # ------------------------------------------------------------------ requests
  def _new_request(self, prompt, sampling) -> int:
    rid = next(self._ids)
    req = Request(request_id=rid, prompt=tuple(prompt), sampling=sampling,
                  arrival_time=time.perf_counter(), prefill_tokens=tuple(prompt))
    self.requests[rid] = req
    self._queue.append(req)
    self.stats.submitted += 1
    return rid

  def _reserve(self, req: Request) -> bool:
    """Holds a running slot and pages for the request's prefill tokens (the protocol's step 1).

    The engine's admission rule decides (``Engine.reserve``); ``adopt(...,
    reservation=)`` hands the reserved capacity to the request when its KV lands.
    """
    return self.engine.reserve(req.request_id, len(req.prefill_tokens))

  def _unreserve(self, req: Request) -> None:
    self.engine.release_reservation(req.request_id)

  def _cancel(self, rid: int, why: str) -> None:
    """Cancels a request wherever it is: queued, in flight (both sides' pages freed) or decoding."""
    req = self.requests[rid]
    flight = next((f for f in self._flights.values() if f.req is req), None)
    if flight is not None:
      self._fail(flight, ABORT_CANCELLED, why)
    elif req in self._queue:
      self._queue.remove(req)
      self.stats.aborted[ABORT_CANCELLED] += 1
      _abort(req, ABORT_CANCELLED, why)
    elif self.engine.holds(rid):
      self.engine.cancel(rid)

  def _expire_queue(self) -> None:
    """Ends queued requests that waited a whole prefill timeout without a prefill server."""
    if self._peer_ready or not self._queue:
      return
    now = time.perf_counter()
    limit = self.options.prefill_timeout_s
    for req in [r for r in self._queue if now - r.arrival_time > limit]:
      self._queue.remove(req)
      self.stats.peer_lost += 1
      self.stats.aborted[ABORT_PEER_LOST] += 1
      _abort(req, ABORT_PEER_LOST, f"no prefill server at {self.prefill_address} for {limit:g} s")

  def _admit(self) -> None:
    while self._queue and self._peer_ready:
      req = self._queue[0]
      if not self._reserve(req):
        return
      self._queue.popleft()
      f = _Flight(req, next(self._uuids), time.monotonic())
      self._flights[f.uuid] = f
      s = req.sampling
      # A recompute (after a preemption) prefills prompt + output and samples what is left.
      remaining = dataclasses.replace(s, max_new_tokens=s.max_new_tokens - len(req.output))
      self.inbox.send(self._peer, proto.message(
          "prefill", uuid=f.uuid, tokens=list(req.prefill_tokens),
          sampling=proto.sampling_to_dict(remaining)))

  def _fail(self, f: _Flight, reason: str, why: str, *, release: bool = True) -> None:
    """Ends a request in flight: its reservation is freed, the prefill server told to free its pages."""
    self._flights.pop(f.uuid, None)
    self._unreserve(f.req)
    if release and self._peer is not None:
      self.inbox.send(self._peer, proto.message("release", uuid=f.uuid))
    _abort(f.req, reason, why)
    self.stats.aborted[reason] += 1
    logging.error("decode: request %d aborted (%s): %s", f.req.request_id, reason, why)

  # ------------------------------------------------------------------ the loop
  def poll(self, wait_s: float) -> None:
    """One turn: messages, reconnection, admission, pulls and landings, timeouts, a decode step."""
    self._take_messages(wait_s)
    self._maybe_reconnect()
    self._expire_queue()
    self._admit()
    self._progress_flights()
    if self.engine.has_unfinished():
      self.engine.step()
    preempted = self.engine.drain_preempted()
    for req in reversed(preempted):  # recomputed remotely, first in line
      self.stats.requeued += 1
      self._queue.appendleft(req)
    self._answer_batches()
    self._after_turn()

  def waiting(self) -> int:
    return len(self._queue) + self.engine.num_waiting()

  def _has_room(self) -> bool:
    # Requests whose prefill or pull is in flight will run here too.
    return (len(self.engine.running_ids()) + self.waiting() + len(self._flights)
            < self.engine.config.max_running)

  def snapshot(self) -> dict:
    snap = super().snapshot()
    snap.update(kv_transfers=self.stats.transfers, kv_transfer_retries=self.stats.transfer_retries,
                kv_transfer_failures=self.stats.transfer_failures)
    return snap

  def _handle(self, conn, msg: dict) -> None:
    kind = msg["kind"]
    if kind == PULLED:
      return  # a wake-up: _progress_flights lands it
    if conn is self._peer:
      if kind in (proto.CLOSED, "error"):
        self._drop_peer(msg.get("error") or "connection closed")
      elif kind == "welcome":
        self._welcome(msg)
      elif kind in ("offered", "finished", "failed"):
        self._from_prefill(msg)
      return
    if not self._handle_client(conn, msg):
      self.inbox.send(conn, proto.message("error", error=f"a decode server does not take {kind!r}"))

  def _more_faults(self, msg: dict) -> None:
    self._pull_delay_s = float(msg.get("pull_delay_s", self._pull_delay_s))

  def _from_prefill(self, msg: dict) -> None:
    f = self._flights.get(msg["uuid"])
    if f is None:  # it timed out or ended here already: let the prefill server free its pages
      if msg["kind"] == "offered":
        self.inbox.send(self._peer, proto.message("release", uuid=msg["uuid"]))
      return
    req = f.req
    now = time.perf_counter()
    if msg["kind"] == "finished":  # the first token ended it (a stop token, or one token wanted)
      self._flights.pop(f.uuid)
      self._unreserve(req)
      lps = msg.get("logprobs") or [None] * len(msg["tokens"])
      for t, lp in zip(msg["tokens"], lps):
        req.emit(t, now, lp)
      req.status = RequestStatus.FINISHED
      req.finish_reason = msg["finish_reason"] or FINISH_LENGTH
      req.finish_time = now
    elif msg["kind"] == "failed":
      self._fail(f, msg.get("abort_reason") or ABORT_ERROR,
                 f"the prefill server failed it: {msg.get('error')}", release=False)
    else:
      if not f.emitted:  # the first token is known now (a resend repeats it)
        req.emit(msg["first_token"], now, (msg.get("logprobs") or [None])[0])
        f.emitted = True
      f.offer, f.offered_at = msg, time.monotonic()
      specs = [jax.ShapeDtypeStruct(tuple(shape), np.dtype(dt), sharding=self._pull_sharding)
               for shape, dt in msg["specs"]]
      f.pull = _Pull(self._pull_conn, f.uuid, specs,
                     lambda: self.inbox.queue.put((None, {"kind": PULLED})),
                     delay_s=self._pull_delay_s)
      f.pull.start()

  def _progress_flights(self) -> None:
    now = time.monotonic()
    for f in list(self._flights.values()):
      if f.pull is None:
        if f.offer is None and now - f.sent_at > self.options.prefill_timeout_s:
          self.stats.timeouts += 1
          self._fail(f, ABORT_TIMEOUT, f"no answer from the prefill server within "
                     f"{self.options.prefill_timeout_s:g} s")
        continue
      if f.pull.is_alive():
        if now - f.pull.started_at > self.options.pull_timeout_s:
          self.stats.timeouts += 1
          # The thread is abandoned: it writes only into arrays of its own, never into pages.
          self._fail(f, ABORT_TIMEOUT, f"pulling its KV took over {self.options.pull_timeout_s:g} s")
        continue
      try:
        self._land(f)
      except lockstep.PoolBroken:
        raise  # the pool itself is gone (mlkit.serve exits)
      except Exception as e:  # one request's landing must not stop the server
        logging.exception("decode: landing request %d failed", f.req.request_id)
        if f.uuid in self._flights:
          self._fail(f, ABORT_ERROR, f"landing its KV raised {type(e).__name__}: {e}")

  def _land(self, f: _Flight) -> None:
    pull, offer, req = f.pull, f.offer, f.req
    f.pull = None
    if pull.error is not None:
      # A dead peer shows here first, or as the closed connection: both end the same way.
      self._fail(f, ABORT_PEER_LOST, f"pulling its KV failed: {pull.error}")
      return
    leaves = pull.result
    if self._replicated is not None:
      leaves = jax.device_put(leaves, self._replicated)
    payload = [dict(zip(keys, leaves[i:i + len(keys)]))
               for keys, i in zip(offer["layer_keys"], _offsets(offer["layer_keys"]))]
    sent = np.asarray(offer["checksum"], np.uint32)
    nbytes = sum(x.nbytes for x in pull.result)
    self.stats.transfer_bytes += nbytes
    self.stats.transfer_seconds += pull.seconds
    f.attempts += 1
    why = verify_payload(payload, sent)
    if why is not None:  # corrupted in transit: nothing was written; ask again or give up
      logging.warning("decode: request %d attempt %d: %s", req.request_id, f.attempts, why)
      if f.attempts < self.options.transfer_attempts:
        self.stats.transfer_retries += 1
        new = next(self._uuids)
        self._flights[new] = self._flights.pop(f.uuid)
        self.inbox.send(self._peer, proto.message("resend", uuid=f.uuid, new_uuid=new))
        f.uuid, f.sent_at, f.offer, f.offered_at = new, time.monotonic(), None, None
        return
      self.stats.transfer_failures += 1
      self._fail(f, ABORT_TRANSFER, f"{why} (after {f.attempts} attempts)")
      return
    length, base = int(offer["length"]), int(offer["base"])
    if self.engine.spans_processes:
      # Every process of this pool lands the payload: it is sent to them as host arrays
      # with the landing call (docs/serving_processes.md).
      payload = jax.device_get(payload)
    fill = lockstep.Fill(land_fill, (payload, sent, length, base))
    self._flights.pop(f.uuid)
    self.inbox.send(self._peer, proto.message("release", uuid=f.uuid))
    adopted = self.engine.adopt(req, length, fill, reservation=req.request_id)
    if adopted is None:  # the reservation is what it lands in, so only a bug lands here
      self.stats.transfer_failures += 1
      self.stats.aborted[ABORT_TRANSFER] += 1
      _abort(req, ABORT_TRANSFER, "no pages to land in after the reservation was released")
    elif not adopted:  # the landing check failed: the Engine aborted it (reason transfer)
      self.stats.transfer_failures += 1
    else:
      self.stats.transfers += 1

  def metrics(self) -> dict:
    m = self.engine.metrics()
    s = dataclasses.asdict(self.stats)
    s["aborted"] = dict(self.stats.aborted)
    m["serve"] = {**s, "in_flight": len(self._flights), "queued": len(self._queue),
                  "requests_held": len(self.requests),
                  "pulling": sum(f.pull is not None for f in self._flights.values()),
                  "peer_ready": self._peer_ready}
    return m


def _offsets(layer_keys) -> list[int]:
  out, i = [], 0
  for keys in layer_keys:
    out.append(i)
    i += len(keys)
  return out


def _abort(req: Request, reason: str, why: str) -> None:
  req.status = RequestStatus.ABORTED
  req.abort_reason = reason
  req.error = why
  req.finish_time = time.perf_counter()
