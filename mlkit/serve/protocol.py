"""The control channel between serving processes: a tiny message schema over ``multiprocessing.connection``.

Every message is a plain dict with a ``"kind"`` (one of :data:`KINDS`) and a
few small fields (token ids, sampling values, a transfer uuid, checksums and
array specs). KV bytes never travel here: they move with JAX's transfer server
(``jax.experimental.transfer``). docs/serving_processes.md has the sequence.

Connections are ``multiprocessing.connection`` Listener/Client pairs with an
authkey (HMAC challenge at connect), so only processes that share the key can
talk. A :class:`Inbox` gives a server one queue of (connection, message) from
all of its peers, read by one daemon thread per connection, so the server's
single engine thread never blocks on a socket.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import queue
import socket
import threading
import time
from multiprocessing import connection as mpc
from typing import Any

import numpy as np

# Bumped when a message's fields change; peers with another version refuse each other at hello.
PROTOCOL_VERSION = 1
DEFAULT_AUTHKEY = b"mlkit-serve"

# client -> decode/colocated: generate, metrics, shutdown
# decode -> prefill: hello, prefill, resend, release;  prefill -> decode: welcome, offered, finished, failed
# tests -> prefill: fault (only when the server allows fault injection)
KINDS = ("hello", "welcome", "generate", "result", "metrics", "shutdown", "prefill", "offered",
         "finished", "failed", "resend", "release", "fault", "ok", "error")

# Marks the end of one connection in an Inbox (the peer closed it or died).
CLOSED = "closed"


def message(kind: str, **fields) -> dict:
  """A control message (raises ValueError on an unknown kind)."""
  if kind not in KINDS:
    raise ValueError(f"unknown message kind {kind!r}; expected one of {KINDS}")
  return {"kind": kind, **fields}


def sampling_to_dict(s) -> dict:
  """A SamplingParams as message fields."""
  return dataclasses.asdict(s)


def sampling_from_dict(d: dict):
  """SamplingParams from a message (its own checks raise ValueError on bad values)."""
  from mlkit.sampling import SamplingParams  # here, so that a client never imports jax
  d = dict(d)
  if "stop_tokens" in d:
    d["stop_tokens"] = tuple(d["stop_tokens"])
  return SamplingParams(**d)


def specs_of(leaves) -> list[tuple[tuple[int, ...], str]]:
  """[(shape, dtype name)] of arrays: what a puller needs to ask for them."""
  return [(tuple(int(n) for n in x.shape), np.dtype(x.dtype).name) for x in leaves]


def parse_address(addr: str) -> tuple[str, int]:
  """"host:port" -> (host, port), with a clear error for anything else."""
  host, sep, port = str(addr).rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
    raise ValueError(f"address must be HOST:PORT (e.g. 127.0.0.1:7100), got {addr!r}")
  return host, int(port)


def listen(addr: str, authkey: bytes) -> mpc.Listener:
  """A Listener on HOST:PORT.

  Raises:
    OSError: naming the address when it is in use or cannot be bound.
  """
  host, port = parse_address(addr)
  try:
    return mpc.Listener((host, port), family="AF_INET", authkey=authkey)
  except OSError as e:
    raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror or e} "
                  "(is another server using this port?)") from None


def no_delay(conn: mpc.Connection) -> mpc.Connection:
  """Turns off Nagle's algorithm on a connection's socket.

  Two small messages in a row (a ``release`` then the next ``prefill``) would
  otherwise wait for the peer's delayed ACK: ~40 ms on every request.
  """
  with socket.socket(fileno=os.dup(conn.fileno())) as s:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  return conn


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


def connect(addr: str, authkey: bytes, timeout_s: float) -> mpc.Connection:
  """Connects to a Listener, retrying until ``timeout_s`` (the peer may still be starting).

  The handshake itself waits for the server to accept (a server still loading
  its model accepts once it serves).

  Raises:
    ConnectionError: no peer accepted within the timeout, or the authkey was refused.
  """
  probe(addr, timeout_s)  # mpc.Client has no connect timeout of its own
  host, port = parse_address(addr)
  try:
    return no_delay(mpc.Client((host, port), family="AF_INET", authkey=authkey))
  except mpc.AuthenticationError as e:
    raise ConnectionError(f"{host}:{port} refused our authkey ({e})") from None
  except OSError as e:
    raise ConnectionError(f"{host}:{port} dropped the connection ({e})") from None


class Inbox:
  """One queue of (connection, message) from every connection a server reads.

  ``add`` starts a daemon reader thread per connection; when the peer closes or
  dies the queue gets (connection, {"kind": CLOSED}). ``accept_from`` accepts
  connections from a Listener in a thread of its own. Sending stays on the
  caller's thread (``send``), guarded by one lock per connection.
  """

  def __init__(self):
    self.queue: queue.Queue = queue.Queue()
    self._locks: dict[int, threading.Lock] = {}

  def add(self, conn: mpc.Connection) -> None:
    no_delay(conn)
    self._locks[id(conn)] = threading.Lock()
    threading.Thread(target=self._read, args=(conn,), daemon=True).start()

  def _read(self, conn: mpc.Connection) -> None:
    while True:
      try:
        msg = conn.recv()
      except (EOFError, OSError, ConnectionError):
        break
      except Exception as e:  # an unpicklable or malformed message: drop the peer
        self.queue.put((conn, {"kind": "error", "error": f"unreadable message: {e}"}))
        break
      if not isinstance(msg, dict) or msg.get("kind") not in KINDS:
        self.queue.put((conn, {"kind": "error", "error": f"malformed message {msg!r:.100}"}))
        continue
      self.queue.put((conn, msg))
    self.queue.put((conn, {"kind": CLOSED}))

  def accept_from(self, listener: mpc.Listener) -> None:
    def loop():
      while True:
        try:
          conn = listener.accept()
        except (mpc.AuthenticationError, EOFError):
          continue  # a peer without the key, or a bare connect (a probe): keep listening
        except OSError as e:
          if e.errno in (errno.EBADF, errno.EINVAL):
            return  # the listener was closed
          continue  # one peer's reset
        self.add(conn)
    threading.Thread(target=loop, daemon=True).start()

  def get(self, timeout_s: float) -> tuple[Any, dict] | None:
    try:
      return self.queue.get(timeout=timeout_s)
    except queue.Empty:
      return None

  def send(self, conn: mpc.Connection, msg: dict) -> bool:
    """Sends a message; False when the peer is gone (the reader thread reports it)."""
    lock = self._locks.setdefault(id(conn), threading.Lock())
    try:
      with lock:
        conn.send(msg)
      return True
    except (OSError, EOFError, ValueError, ConnectionError):
      return False
