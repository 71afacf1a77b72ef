"""The control channel between serving processes: message kinds, their schemas, and one inbox.

Every message is a map with a ``"kind"`` and a few small fields (token ids,
sampling values, a transfer uuid, a checksum array and array specs), sent as
one frame of :mod:`mlkit.wire` (msgpack after a key handshake; never pickle).
KV bytes never travel here: they move with JAX's transfer server
(``jax.experimental.transfer``). docs/serving_processes.md has the sequence,
docs/wire.md the frames.

Each end checks every message against the schema of its kind before using it:
a server checks what clients and peers send (token ids within the vocabulary,
bounded lists, known kinds only), a client checks the answers. A message that
fails gets an ``error`` answer and its connection is closed; the server keeps
serving everyone else.

An :class:`Inbox` gives a server one queue of (connection, message) from all of
its peers, read by one daemon thread per connection (which also runs that
connection's handshake), so the server's single engine thread never blocks on
a socket.
"""

from __future__ import annotations

import dataclasses
import queue
import socket
import threading
import time
from typing import Any, Mapping

import numpy as np
from absl import logging

from mlkit import wire
from mlkit.wire import frames
from mlkit.wire.schema import Array, Fields, Float, Int, List, Nullable, Plain, Str, Tuple

# Bumped when a message's fields change; peers with another version refuse each other at hello.
PROTOCOL_VERSION = 2

# Marks the end of one connection in an Inbox (the peer closed it, died, or was refused).
CLOSED = "closed"

# Bounds of what a message may hold (beyond them a message is refused, its connection closed).
MAX_PROMPTS = 256  # prompts in one generate
MAX_STOP_TOKENS = 256
MAX_MESSAGE_TEXT = 4096  # an error's text
MAX_UUID = 1 << 63
MAX_LOGPROBS = 20  # mlkit.sampling.MAX_LOGPROBS (kept here: a client imports no JAX)
MAX_ARRAYS = 1 << 14  # arrays of one KV payload (entries x layers)
ABORT_REASONS = ("integrity", "too_long", "cancelled", "transfer", "error", "peer_lost", "timeout")
FAULT_KINDS = ("use_after_free", "double_allocation", "wrong_page", "stale_tag")


def message(kind: str, **fields) -> dict:
  """A control message (its schema is checked by the receiver; an error's text is cut to
  the length every receiver takes)."""
  if isinstance(fields.get("error"), str):
    fields["error"] = fields["error"][:MAX_MESSAGE_TEXT]
  return {"kind": kind, **fields}


def sampling_to_dict(s) -> dict:
  """A SamplingParams as message fields."""
  d = dataclasses.asdict(s)
  d["stop_tokens"] = list(d["stop_tokens"])
  return d


def sampling_from_dict(d: dict):
  """SamplingParams from checked message fields (its own checks raise ValueError)."""
  from mlkit.sampling import SamplingParams  # here, so that a client never imports jax
  d = dict(d)
  d["stop_tokens"] = tuple(d.get("stop_tokens", ()))
  return SamplingParams(**d)


# ------------------------------------------------------------------ schemas
def _tokens(vocab: int, max_len: int, min_len: int = 1) -> List:
  return List(Int(0, vocab), max_len=max_len, min_len=min_len)


def sampling_schema(vocab: int) -> Fields:
  """The fields of a SamplingParams on the wire (types and ranges; SamplingParams checks the rest)."""
  return Fields({"max_new_tokens": Int(1, 1 << 31), "temperature": Float(0.0, 1e6),
                 "top_k": Int(0, vocab + 1), "top_p": Float(0.0, 1.0), "seed": Int(0, 1 << 32),
                 "stop_tokens": _tokens(vocab, MAX_STOP_TOKENS, 0)},
                {"logprobs": Nullable(Int(0, MAX_LOGPROBS + 1))})


def logprobs_schema(vocab: int) -> List:
  """Per emitted token: [logprob, top ids, top logprobs] (Request.logprobs)."""
  entry = Tuple((Float(), List(Int(0, vocab), MAX_LOGPROBS), List(Float(), MAX_LOGPROBS)))
  return List(entry, MAX_LOGPROBS + 1)


def _hello() -> Fields:
  return Fields({"version": Int(0, 1 << 16), "role": Str(16), "model": Str(256)})


def front_door_kinds(vocab: int, max_tokens: int) -> dict[str, Fields]:
  """What a decode or colocated server takes from its clients.

  Args:
    vocab: the model's vocabulary (token ids in [0, vocab)).
    max_tokens: the model's longest sequence (a prompt that exceeds only what this
      server's pool holds is the engine's to refuse, with an answer, not the wire's).
  """
  return {
      "generate": Fields(
          {"prompts": List(_tokens(vocab, max_tokens), MAX_PROMPTS, 1),
           "sampling": List(sampling_schema(vocab), MAX_PROMPTS, 1)},
          {"batch": Int(0, MAX_UUID)}),
      "cancel": Fields({"batch": Int(0, MAX_UUID)}),
      "metrics": Fields(),
      "shutdown": Fields(),
      "hello": _hello(),
      "fault": Fields({}, {"pull_delay_s": Float(0.0, 3600.0),
                           "page_fault": Str(32, FAULT_KINDS)}),
  }


def prefill_kinds(vocab: int, max_tokens: int) -> dict[str, Fields]:
  """What a prefill server takes from decode servers (and tests' fault messages)."""
  uuid = Int(0, MAX_UUID)
  return {
      "hello": _hello(),
      "prefill": Fields({"uuid": uuid, "tokens": _tokens(vocab, max_tokens),
                         "sampling": sampling_schema(vocab)}),
      "resend": Fields({"uuid": uuid, "new_uuid": uuid}),
      "release": Fields({"uuid": uuid}),
      "metrics": Fields(),
      "shutdown": Fields(),
      "fault": Fields({}, {"corrupt": Int(0, 1 << 20), "delay_s": Float(0.0, 3600.0)}),
  }


def _spec() -> Tuple:
  return Tuple((List(Int(0, 1 << 40), 8), Str(32, tuple(frames.ARRAY_DTYPES))))


def peer_kinds(vocab: int, max_tokens: int) -> dict[str, Fields]:
  """What a decode server takes from its prefill server."""
  uuid = Int(0, MAX_UUID)
  return {
      "welcome": Fields({"version": Int(0, 1 << 16), "role": Str(16), "model": Str(256),
                         "transfer_address": Str(256), "kv_dtype": Str(32),
                         "attention": Str(32), "n_layers": Int(1, 1 << 16)}),
      "offered": Fields({"uuid": uuid, "first_token": Int(0, vocab),
                         "checksum": Array(("uint32",), max_size=MAX_ARRAYS * 8),
                         "specs": List(_spec(), MAX_ARRAYS, 1),
                         "layer_keys": List(List(Str(64), 64, 1), MAX_ARRAYS, 1),
                         "base": Int(0, max_tokens + 1), "length": Int(1, max_tokens + 1)},
                        {"logprobs": logprobs_schema(vocab)}),
      "finished": Fields({"uuid": uuid, "tokens": _tokens(vocab, max_tokens),
                          "finish_reason": Str(16)}, {"logprobs": logprobs_schema(vocab)}),
      "failed": Fields({"uuid": uuid}, {"error": Nullable(Str(MAX_MESSAGE_TEXT)),
                                        "abort_reason": Nullable(Str(16, ABORT_REASONS))}),
      "ok": Fields({}, {"metrics": Plain(), "cancelled": Int(0, 1 << 31)}),
      "error": Fields({"error": Str(MAX_MESSAGE_TEXT)}),
  }


def _output() -> Fields:
  maybe_str = Nullable(Str(MAX_MESSAGE_TEXT))
  return Fields({"request_id": Int(-(1 << 63), 1 << 63), "tokens": List(Int(0, 1 << 31), 1 << 24),
                 "status": Str(16), "finish_reason": maybe_str, "abort_reason": maybe_str,
                 "error": maybe_str, "ttft_s": Nullable(Float()), "latency_s": Nullable(Float())})


def reply_kinds() -> dict[str, Fields]:
  """What a client takes from any server (a test client may also talk to a prefill server)."""
  kinds = peer_kinds(1 << 31, 1 << 31)
  kinds["result"] = Fields({"outputs": List(_output(), MAX_PROMPTS)})
  return kinds


# ------------------------------------------------------------------ addresses and connections
def parse_address(addr: str) -> tuple[str, int]:
  """"host:port" -> (host, port), with a clear error for anything else."""
  host, sep, port = str(addr).rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
    raise ValueError(f"address must be HOST:PORT (e.g. 127.0.0.1:7100), got {addr!r}")
  return host, int(port)


def listen(addr: str, key: bytes) -> wire.Listener:
  """A Listener on HOST:PORT whose connections must hold ``key``.

  Raises:
    OSError: naming the address when it is in use or cannot be bound.
  """
  host, port = parse_address(addr)
  try:
    return wire.Listener((host, port), key)
  except OSError as e:
    raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror or e} "
                  "(is another server using this port?)") from None


def probe(addr: str, timeout_s: float) -> None:
  """Waits until something listens at HOST:PORT (a plain TCP connect, retried; no handshake).

  Raises:
    ConnectionError: nothing accepted a connection within ``timeout_s``.
  """
  host, port = parse_address(addr)
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic())):
        return
    except OSError as e:
      if time.monotonic() >= deadline:
        raise ConnectionError(f"no server reachable at {host}:{port} within {timeout_s:g} s "
                              f"({e})") from None
    time.sleep(0.1)


def connect(addr: str, key: bytes, timeout_s: float) -> wire.Connection:
  """Connects to a server, waiting until ``timeout_s`` for it to listen (it may be starting).

  Raises:
    ConnectionError: no server accepted within the timeout, or it refused the key
      (:class:`mlkit.wire.AuthenticationError`).
  """
  probe(addr, timeout_s)
  host, port = parse_address(addr)
  try:
    return wire.connect((host, port), key, timeout_s=timeout_s)
  except wire.AuthenticationError as e:
    raise wire.AuthenticationError(f"{host}:{port}: {e} (both ends need the same key: "
                                   "MLKIT_SERVE_AUTHKEY or --authkey-file)") from None


class Inbox:
  """One queue of (connection, message) from every connection a server reads.

  ``accept_from`` accepts connections in a thread of its own and gives each a
  thread that runs its key handshake and then reads it; ``add`` reads an
  already connected one (a decode server's line to its prefill server). Every
  message is checked against the schema of its kind for that connection; one
  that fails gets an ``error`` answer and the connection is closed. When a peer
  closes, dies or is refused, the queue gets (connection, {"kind": CLOSED}).
  Sending stays on the caller's thread (``send``).

  Args:
    max_connections: connections beyond this many at once are closed at accept.
  """

  def __init__(self, max_connections: int = 512):
    self.queue: queue.Queue = queue.Queue()
    self.max_connections = max_connections
    self._open = 0
    self._lock = threading.Lock()
    self.refused = 0  # frames that failed their check (their connections were closed)

  def add(self, conn: wire.Connection, kinds: Mapping[str, Fields]) -> None:
    """Reads ``conn`` in a daemon thread, checking each message against ``kinds``."""
    with self._lock:
      self._open += 1
    self._start(conn, kinds)

  def _start(self, conn: wire.Connection, kinds) -> None:  # already counted in _open
    threading.Thread(target=self._read, args=(conn, kinds), daemon=True).start()

  def _read(self, conn: wire.Connection, kinds) -> None:
    try:
      while True:
        try:
          msg = conn.recv(kinds)
        except (EOFError, ConnectionError):
          break
        except wire.FrameError as e:
          self.refuse(conn, f"refused a frame: {e}")
          break
        self.queue.put((conn, msg))
    finally:
      conn.close()
      with self._lock:
        self._open -= 1
      self.queue.put((conn, {"kind": CLOSED}))

  def refuse(self, conn: wire.Connection, why: str) -> None:
    """Answers ``error`` and closes the connection (its reader reports CLOSED)."""
    self.refused += 1
    logging.warning("serve: %s from %s; closing that connection", why, conn.peer)
    self.send(conn, message("error", error=why[:MAX_MESSAGE_TEXT]))
    conn.close()

  def accept_from(self, listener: wire.Listener, kinds: Mapping[str, Fields]) -> None:
    """Accepts connections from ``listener`` (until it is closed), each read with ``kinds``."""
    def one(sock, peer):  # counted in _open at accept
      try:
        conn = listener.handshake(sock, peer)
      except ConnectionError as e:  # AuthenticationError among them
        if isinstance(e, wire.AuthenticationError):
          logging.warning("serve: refused a connection from %s: %s", peer, e)
        # else a probe, or a peer that went away
        with self._lock:
          self._open -= 1
        return
      self._start(conn, kinds)

    def loop():
      while True:
        try:
          sock, peer = listener.accept_socket()
        except OSError as e:
          if frames.is_closed_listener_error(e):
            return
          continue  # one peer's reset
        with self._lock:
          full = self._open >= self.max_connections
          if not full:
            self._open += 1
        if full:
          logging.warning("serve: %d connections open; refusing %s", self.max_connections, peer)
          sock.close()
          continue
        threading.Thread(target=one, args=(sock, peer), daemon=True).start()
    threading.Thread(target=loop, daemon=True).start()

  def get(self, timeout_s: float) -> tuple[Any, dict] | None:
    try:
      return self.queue.get(timeout=timeout_s)
    except queue.Empty:
      return None

  def send(self, conn: wire.Connection, msg: dict) -> bool:
    """Sends a message; False when the peer is gone (its reader thread reports it)."""
    try:
      conn.send(msg)
      return True
    except ConnectionError:
      return False


def specs_of(leaves) -> list[list]:
  """[[shape, dtype name]] of arrays: what a puller needs to ask for them."""
  return [[[int(n) for n in x.shape], np.dtype(x.dtype).name] for x in leaves]
