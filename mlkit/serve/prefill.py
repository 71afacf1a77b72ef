"""The prefill server: runs prompts for decode servers and offers their KV to be pulled.

One thread owns the Engine (role "prefill"); a daemon thread per decode
connection reads messages into one inbox. For each ``prefill`` message the
request is submitted to the Engine; when its prompt is done (it waits in
``Engine.prefilled()`` with its pages) its KV is gathered with
``mlkit.engine.transfer.extract_payload``, checksummed, and offered to the
transfer server under the decode server's uuid (``await_pull``); the reply
``offered`` carries the first token, the checksum and the array specs. The
pages are freed (``hand_over``) when the decode server says ``release`` (it
pulled, or gave up), when the offer times out, or when that decode server's
connection drops. docs/serving_processes.md has the whole sequence.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
from absl import logging

from mlkit.engine import lockstep
from mlkit.engine.transfer import flip_low_bit
from mlkit.serve import protocol as proto


@dataclasses.dataclass
class _Job:
  """One decode server's request while this server holds it."""

  conn: object
  uuid: int
  request_id: int
  offered_at: float | None = None
  payload: list | None = None  # the flat leaves on offer (kept alive until released)
  checksum: np.ndarray | None = None
  specs: list | None = None
  treedef: object = None


@dataclasses.dataclass
class PrefillStats:
  prefills: int = 0
  offers: int = 0
  offer_bytes: int = 0
  released: int = 0
  expired: int = 0
  peer_drops: int = 0
  corrupted: int = 0


class PrefillServer:
  """Serves prefills to any number of decode servers.

  Args:
    engine: an ``Engine`` with role "prefill" on this process's devices.
    listener: the control-channel Listener (``protocol.listen``).
    transfer_server: a started ``jax.experimental.transfer`` server.
    model_name: reported at hello (a decode server checks it serves the same model).
    offer_timeout_s: free a request's pages when its offer was not released within this.
    enable_fault_injection: accept ``fault`` messages (tests only).
  """

  def __init__(self, engine, listener, transfer_server, *, model_name: str,
               offer_timeout_s: float = 30.0, enable_fault_injection: bool = False):
    if engine.role != "prefill":
      raise ValueError(f"PrefillServer needs an Engine with role 'prefill', got {engine.role!r}")
    self.engine = engine
    self.listener = listener
    self.transfer = transfer_server
    self.model_name = model_name
    self.offer_timeout_s = offer_timeout_s
    self.enable_fault_injection = enable_fault_injection
    self.inbox = proto.Inbox()
    self.stats = PrefillStats()
    self._jobs: dict[int, _Job] = {}  # by request id
    self._by_uuid: dict[int, _Job] = {}
    self._corrupt_next = 0  # test fault: flip a bit of this many offers after their checksum
    self._delay_s = 0.0  # test fault: answer this much later (a slow peer)
    self._stop = False

  # ------------------------------------------------------------------ loop
  def serve_forever(self) -> None:
    self.inbox.accept_from(self.listener, proto.prefill_kinds(
        self.engine.config.model.vocab_size, self.engine.config.model.max_seq_len))
    while not self._stop:
      self.poll(0.0 if self.engine.has_unfinished() else 0.02)

  def poll(self, wait_s: float) -> None:
    """One turn: handle messages, step the engine once, offer finished prompts, expire offers."""
    item = self.inbox.get(wait_s)
    while item is not None:
      self._handle(*item)
      item = self.inbox.get(0.0)
    if self.engine.has_unfinished():
      outs = self.engine.step()
      for o in outs:
        if o.done:
          self._ended(o.request_id)
    for req in self.engine.prefilled():
      job = self._jobs.get(req.request_id)
      if job is not None and job.offered_at is None:
        try:
          self._offer(job, req)
        except lockstep.PoolBroken:
          raise  # the pool itself is gone (mlkit.serve exits)
        except Exception as e:  # one request's gather or offer must not stop the server
          logging.exception("prefill: offering request %d failed", req.request_id)
          self.inbox.send(job.conn, proto.message("failed", uuid=job.uuid, abort_reason="error",
                                                  error=f"{type(e).__name__}: {e}"))
          self._drop(job)
    now = time.monotonic()
    for job in list(self._jobs.values()):
      if job.offered_at is not None and now - job.offered_at > self.offer_timeout_s:
        logging.warning("prefill: offer %x not released within %.1f s; freeing its pages",
                        job.uuid, self.offer_timeout_s)
        self.stats.expired += 1
        self._drop(job)

  # ------------------------------------------------------------------ messages
  def _handle(self, conn, msg: dict) -> None:
    kind = msg["kind"]
    if kind == proto.CLOSED:  # the peer went away, or was refused
      mine = [j for j in self._jobs.values() if j.conn is conn]
      if mine:
        logging.warning("prefill: a decode server went away; freeing %d request(s)", len(mine))
        self.stats.peer_drops += 1
      for job in mine:
        self._drop(job)
      return
    if kind == "hello":
      layout = self.engine.pool_layout()
      self.inbox.send(conn, proto.message(
          "welcome", version=proto.PROTOCOL_VERSION, role="prefill", model=self.model_name,
          transfer_address=self.transfer.address(), kv_dtype=layout["kv_dtype"],
          attention=layout["attention"], n_layers=layout["n_layers"]))
    elif kind == "prefill":
      self._start(conn, msg)
    elif kind == "resend":
      job = self._by_uuid.get(msg["uuid"])
      if job is None or job.offered_at is None:
        self.inbox.send(conn, proto.message("failed", uuid=msg["uuid"], error="nothing on offer"))
        return
      del self._by_uuid[job.uuid]
      job.uuid = msg["new_uuid"]
      self._by_uuid[job.uuid] = job
      job.offered_at = None  # offered again by the next poll
    elif kind == "release":
      job = self._by_uuid.get(msg["uuid"])
      if job is not None:
        self.stats.released += 1
        self._drop(job)
    elif kind == "fault":
      if not self.enable_fault_injection:
        self.inbox.send(conn, proto.message("error", error="fault injection is disabled "
                                            "(start the server with --enable-fault-injection)"))
        return
      self._corrupt_next += msg.get("corrupt", 0)
      self._delay_s = float(msg.get("delay_s", self._delay_s))
      self.inbox.send(conn, proto.message("ok"))
    elif kind == "metrics":
      self.inbox.send(conn, proto.message("ok", metrics={**self.engine.metrics(),
                                                         "serve": dataclasses.asdict(self.stats)}))
    elif kind == "shutdown":
      self._stop = True
      self.inbox.send(conn, proto.message("ok"))
    else:
      self.inbox.send(conn, proto.message("error", error=f"a prefill server does not take {kind!r}"))

  def _start(self, conn, msg: dict) -> None:
    uuid = msg["uuid"]
    try:
      rid = self.engine.submit(msg["tokens"], proto.sampling_from_dict(msg["sampling"]))
    except (ValueError, TypeError, KeyError) as e:
      self.inbox.send(conn, proto.message("failed", uuid=uuid, error=f"rejected: {e}"))
      return
    job = _Job(conn, uuid, rid)
    self._jobs[rid] = job
    self._by_uuid[uuid] = job
    self.stats.prefills += 1

  def _ended(self, rid: int) -> None:
    """A request ended inside the prefill engine: its only token, or an abort."""
    job = self._jobs.pop(rid, None)
    if job is None:
      return
    self._by_uuid.pop(job.uuid, None)
    req = self.engine.get(rid)
    if req.finish_reason is not None:
      extra = {"logprobs": req.logprobs} if req.logprobs else {}
      self.inbox.send(job.conn, proto.message("finished", uuid=job.uuid, tokens=list(req.output),
                                              finish_reason=req.finish_reason, **extra))
    else:
      self.inbox.send(job.conn, proto.message("failed", uuid=job.uuid, error=req.error,
                                              abort_reason=req.abort_reason))

  def _offer(self, job: _Job, req) -> None:
    """Gathers the request's KV, checksums it and offers it under ``job.uuid``."""
    if self._delay_s:
      time.sleep(self._delay_s)  # test fault: a slow peer
    length = len(req.prefill_tokens)
    pages = self.engine.kv_pages(req.request_id)
    # On a pool spread over processes every process runs the extraction; the leader offers
    # the host copy.
    payload, checksum, base = self.engine.extract(pages, length)
    leaves, treedef = jax.tree_util.tree_flatten(payload)
    # One device holds the offer: the puller asks for plain single-device arrays.
    dev = self.engine.home_device()
    leaves = [jax.device_put(x, dev) for x in leaves]
    if self._corrupt_next:  # test fault: corrupt after the checksum was taken
      self._corrupt_next -= 1
      self.stats.corrupted += 1
      leaves[0] = flip_low_bit(leaves[0])
    job.payload, job.checksum, job.treedef = leaves, checksum, treedef
    job.specs = proto.specs_of(leaves)
    self.transfer.await_pull(job.uuid, leaves)
    job.offered_at = time.monotonic()
    self.stats.offers += 1
    self.stats.offer_bytes += sum(x.nbytes for x in leaves)
    extra = {"logprobs": req.logprobs} if req.logprobs else {}
    self.inbox.send(job.conn, proto.message(
        "offered", uuid=job.uuid, first_token=int(req.output[-1]), **extra,
        checksum=np.asarray(checksum, np.uint32),
        specs=job.specs, layer_keys=[sorted(layer) for layer in payload], base=base,
        length=length))

  def _drop(self, job: _Job) -> None:
    """Forgets a job and frees its pages here, wherever it is in the engine."""
    self._jobs.pop(job.request_id, None)
    self._by_uuid.pop(job.uuid, None)
    job.payload = None
    rid = job.request_id
    if any(r.request_id == rid for r in self.engine.prefilled()):
      self.engine.hand_over(rid)
    elif self.engine.holds(rid):
      self.engine.cancel(rid)
