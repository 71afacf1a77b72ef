"""Frames between processes: data only, length-prefixed, after a mutual key handshake.

Every socket between the project's processes (client and server, decode and
prefill server, a pool's leader and followers) speaks this, and nothing else:

* **Handshake.** The listening side sends a magic, a version and a random
  32-byte challenge; the connecting side answers HMAC-SHA256(key, challenge)
  and a challenge of its own; the listener checks it in constant time
  (``hmac.compare_digest``) and proves the key back the same way. A peer
  without the key learns nothing and gets its connection closed; the handshake
  has a deadline, so a silent peer cannot hold a listener.
* **Frames.** An 8-byte big-endian length, then that many bytes of msgpack.
  The length is checked against the receiver's limit before a byte of the
  body is read. msgpack carries maps, lists, numbers, strings and bytes, so a
  frame is data: decoding it never imports a module or calls a function (no
  ``pickle`` anywhere on a socket).
* **Arrays** cross as dtype + shape + raw bytes (a msgpack extension), the
  dtype from an allow-list and the byte count checked against the shape.

What a frame means is checked separately, per message kind
(:mod:`mlkit.wire.schema`). docs/wire.md has the byte layout.

The channel authenticates its peer at connect; it does not encrypt. Across
untrusted networks, run it inside a tunnel (docs/wire.md).

Imports no JAX.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import select
import socket
import struct
import threading
from typing import Any, Mapping

import msgpack
import numpy as np

from mlkit.wire import schema as schema_lib

MAGIC = b"MLKW"
VERSION = 1
NONCE_BYTES = 32
_DIGEST = hashlib.sha256
_DIGEST_BYTES = 32
_HEADER = struct.Struct("!Q")  # frame length
_ARRAY_EXT = 1  # msgpack extension code of an array
_MAX_ARRAY_RANK = 8
MIN_KEY_BYTES = 16
# The default limit on one frame's body: control messages are small; a generate of many
# long prompts is the largest (64 prompts of 128K tokens is about 40 MB of msgpack).
DEFAULT_MAX_FRAME = 64 << 20
DEFAULT_HANDSHAKE_TIMEOUT_S = 10.0
# A frame whose body has begun must keep arriving: a peer that stalls mid-frame for this
# long is dropped (a silent peer between frames is fine).
DEFAULT_IO_TIMEOUT_S = 60.0


def _array_dtypes() -> dict[str, np.dtype]:
  import ml_dtypes  # bfloat16 and float8 as numpy dtypes (a JAX dependency, not JAX)
  names = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
           "float16", "float32", "float64")
  out = {n: np.dtype(n) for n in names}
  for n in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
    out[n] = np.dtype(getattr(ml_dtypes, n))
  return out


# The dtypes an array on the wire may have.
ARRAY_DTYPES: dict[str, np.dtype] = _array_dtypes()


class AuthenticationError(ConnectionError):
  """The handshake failed: the peer does not hold the key, or is not a peer of this protocol."""


class FrameError(ValueError):
  """A frame that cannot be taken: over the size limit, not msgpack, a bad array, or a message
  that fails its schema (:class:`mlkit.wire.schema.SchemaError` is one)."""


# ------------------------------------------------------------------ encoding
def _default(obj):
  if isinstance(obj, np.ndarray):
    return _encode_array(obj)
  if isinstance(obj, np.generic):
    return obj.item()
  raise TypeError(f"{type(obj).__name__} cannot cross the wire (only plain data and arrays)")


def _encode_array(x: np.ndarray) -> msgpack.ExtType:
  name = x.dtype.name
  if name not in ARRAY_DTYPES:
    raise TypeError(f"arrays of dtype {name} cannot cross the wire")
  header = msgpack.packb([name, [int(n) for n in x.shape]])
  return msgpack.ExtType(_ARRAY_EXT, struct.pack("!H", len(header)) + header
                         + np.ascontiguousarray(x).tobytes())


def _decode_array(data: bytes) -> np.ndarray:
  if len(data) < 2:
    raise FrameError("array extension too short")
  (n,) = struct.unpack_from("!H", data)
  try:
    header = msgpack.unpackb(data[2:2 + n], raw=False)
  except Exception as e:
    raise FrameError(f"array header is not msgpack ({e})") from None
  if (not isinstance(header, list) or len(header) != 2 or not isinstance(header[0], str)
      or not isinstance(header[1], list)):
    raise FrameError("array header must be [dtype, shape]")
  name, shape = header
  if name not in ARRAY_DTYPES:
    raise FrameError(f"array dtype {name[:40]!r} is not one of {sorted(ARRAY_DTYPES)}")
  if len(shape) > _MAX_ARRAY_RANK or not all(
      isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
    raise FrameError(f"array shape {shape!r:.80} must be at most {_MAX_ARRAY_RANK} "
                     "non-negative ints")
  dtype = ARRAY_DTYPES[name]
  raw = memoryview(data)[2 + n:]
  count = int(np.prod(shape, dtype=object)) if shape else 1
  if count * dtype.itemsize != len(raw):
    raise FrameError(f"array of shape {shape} and dtype {name} needs "
                     f"{count * dtype.itemsize} bytes, the frame holds {len(raw)}")
  return np.frombuffer(raw, dtype).reshape(shape).copy()


def _ext_hook(code: int, data: bytes):
  if code != _ARRAY_EXT:
    raise FrameError(f"unknown msgpack extension {code}")
  return _decode_array(data)


def encode(value: Any) -> bytes:
  """One frame body: ``value`` (plain data and numpy arrays) as msgpack.

  Raises:
    TypeError: a value that is not plain data or an array of an allowed dtype.
  """
  return msgpack.packb(value, default=_default, use_bin_type=True)


def decode(body: bytes) -> Any:
  """The data of one frame body (maps with string keys, lists, numbers, strings, bytes, arrays).

  Raises:
    FrameError: not a single msgpack value, or an array that does not add up.
  """
  try:
    # unpackb bounds every string, list and map by the body's length.
    return msgpack.unpackb(body, raw=False, strict_map_key=True, ext_hook=_ext_hook)
  except FrameError:
    raise
  except Exception as e:  # msgpack's own errors (ExtraData, FormatError, StackError, ...)
    raise FrameError(f"not a msgpack frame ({type(e).__name__}: {str(e)[:120]})") from None


# ------------------------------------------------------------------ handshake
def _mac(key: bytes, *parts: bytes) -> bytes:
  return hmac.new(key, b"".join(parts), _DIGEST).digest()


def check_key(key: bytes) -> bytes:
  """The key itself, after checking it is bytes of at least MIN_KEY_BYTES.

  Raises:
    ValueError: not bytes, or too short.
  """
  if not isinstance(key, (bytes, bytearray)) or len(key) < MIN_KEY_BYTES:
    raise ValueError(f"a wire key must be at least {MIN_KEY_BYTES} bytes "
                     f"(got {type(key).__name__}"
                     + (f" of {len(key)} bytes)" if isinstance(key, (bytes, bytearray)) else ")"))
  return bytes(key)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
  buf = bytearray(n)
  view = memoryview(buf)
  got = 0
  while got < n:
    k = sock.recv_into(view[got:])
    if k == 0:
      raise EOFError("the peer closed the connection")
    got += k
  return bytes(buf)


def _listener_handshake(sock: socket.socket, key: bytes) -> None:
  nonce = os.urandom(NONCE_BYTES)
  sock.sendall(MAGIC + bytes([VERSION]) + nonce)
  answer = _recv_exact(sock, _DIGEST_BYTES + NONCE_BYTES)
  if not hmac.compare_digest(answer[:_DIGEST_BYTES], _mac(key, b"client", nonce)):
    try:
      sock.sendall(b"\x00")
    except OSError:
      pass
    raise AuthenticationError("the peer does not hold the key")
  theirs = answer[_DIGEST_BYTES:]
  sock.sendall(b"\x01" + _mac(key, b"server", theirs, nonce))


def _connector_handshake(sock: socket.socket, key: bytes) -> None:
  hello = _recv_exact(sock, len(MAGIC) + 1 + NONCE_BYTES)
  if hello[:len(MAGIC)] != MAGIC:
    raise AuthenticationError("the peer does not speak this protocol")
  if hello[len(MAGIC)] != VERSION:
    raise AuthenticationError(f"the peer speaks wire version {hello[len(MAGIC)]}, "
                              f"this process {VERSION}")
  nonce = hello[len(MAGIC) + 1:]
  mine = os.urandom(NONCE_BYTES)
  sock.sendall(_mac(key, b"client", nonce) + mine)
  verdict = _recv_exact(sock, 1)
  if verdict != b"\x01":
    raise AuthenticationError("the peer refused our key")
  proof = _recv_exact(sock, _DIGEST_BYTES)
  if not hmac.compare_digest(proof, _mac(key, b"server", mine, nonce)):
    raise AuthenticationError("the peer could not prove it holds the key")


# ------------------------------------------------------------------ connections
class Connection:
  """One authenticated socket carrying frames both ways.

  Sending is thread-safe (one lock); receiving belongs to one thread.

  Args:
    sock: a connected socket whose handshake is done.
    peer: the peer's address, for messages.
    max_frame: the largest frame body this end accepts (bytes).
    io_timeout_s: a frame that has begun must keep arriving; a send must finish.
  """

  def __init__(self, sock: socket.socket, peer: str, *, max_frame: int = DEFAULT_MAX_FRAME,
               io_timeout_s: float = DEFAULT_IO_TIMEOUT_S):
    self._sock = sock
    self.peer = peer
    self.max_frame = int(max_frame)
    self._lock = threading.Lock()
    self._closed = False
    sock.settimeout(io_timeout_s)
    try:  # two small frames in a row must not wait for the peer's delayed ACK (~40 ms)
      sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
      pass

  def fileno(self) -> int:
    return self._sock.fileno()

  @property
  def closed(self) -> bool:
    return self._closed

  def send(self, message: Any) -> None:
    """Sends one frame holding ``message`` (plain data and arrays).

    Raises:
      TypeError: the message holds something that is not data.
      ConnectionError: the peer is gone, or did not take the frame within the I/O timeout.
    """
    self.send_frame(encode(message))

  def send_frame(self, body: bytes) -> None:
    """Sends one frame whose body is ``body`` as it is (tests send malformed ones)."""
    with self._lock:
      try:
        self._sock.sendall(_HEADER.pack(len(body)) + body)
      except (OSError, ValueError) as e:
        raise ConnectionError(f"sending to {self.peer} failed ({e})") from None

  def recv_frame(self) -> bytes:
    """The next frame's body; blocks until one arrives.

    Raises:
      EOFError: the peer closed the connection.
      ConnectionError: the socket failed, or a frame stalled past the I/O timeout.
      FrameError: the frame's announced length exceeds ``max_frame`` (nothing of it is read).
    """
    while True:  # between frames, silence is fine
      try:
        first = self._sock.recv(1)
      except socket.timeout:
        continue
      except OSError as e:
        raise ConnectionError(f"reading from {self.peer} failed ({e})") from None
      if not first:
        raise EOFError(f"{self.peer} closed the connection")
      break
    try:
      header = first + _recv_exact(self._sock, _HEADER.size - 1)
      (n,) = _HEADER.unpack(header)
      if n > self.max_frame:
        raise FrameError(f"a frame of {n} bytes exceeds this end's limit of {self.max_frame}")
      return _recv_exact(self._sock, n)
    except socket.timeout:
      raise ConnectionError(f"{self.peer} stalled in the middle of a frame") from None
    except OSError as e:
      raise ConnectionError(f"reading from {self.peer} failed ({e})") from None

  def recv(self, kinds: Mapping[str, schema_lib.Fields]) -> dict:
    """The next message, decoded and checked against the schema of its kind.

    Raises:
      FrameError: a frame too large, not msgpack, or failing its kind's schema.
      EOFError / ConnectionError: as :meth:`recv_frame`.
    """
    value = decode(self.recv_frame())
    try:
      return schema_lib.message_schema(kinds, value)
    except schema_lib.SchemaError as e:
      raise FrameError(str(e)) from None

  def poll(self, timeout_s: float | None) -> bool:
    """Whether a frame (or the peer's close) is ready to read within ``timeout_s``."""
    ready, _, _ = select.select([self._sock], [], [], timeout_s)
    return bool(ready)

  def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    try:
      self._sock.shutdown(socket.SHUT_RDWR)
    except OSError:
      pass
    self._sock.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


class Listener:
  """A listening TCP socket whose connections must pass the key handshake.

  Args:
    address: (host, port).
    key: the shared key (bytes, at least MIN_KEY_BYTES).
    max_frame: each accepted connection's frame limit.
    handshake_timeout_s: a peer that has not finished the handshake by then is dropped.

  Raises:
    OSError: the address cannot be bound (in use, not local).
    ValueError: a key too short.
  """

  def __init__(self, address: tuple[str, int], key: bytes, *, max_frame: int = DEFAULT_MAX_FRAME,
               handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S, backlog: int = 128):
    self.key = check_key(key)
    self.max_frame = max_frame
    self.handshake_timeout_s = handshake_timeout_s
    self._sock = socket.create_server(tuple(address), backlog=backlog)
    self.address = self._sock.getsockname()[:2]

  def accept_socket(self, timeout_s: float | None = None) -> tuple[socket.socket, str]:
    """The next raw connection (handshake not done), with its address as text.

    Raises:
      TimeoutError: none within ``timeout_s``.
      OSError: the listener was closed.
    """
    self._sock.settimeout(timeout_s)
    try:
      sock, addr = self._sock.accept()
    except socket.timeout:
      raise TimeoutError(f"no connection within {timeout_s} s") from None
    return sock, f"{addr[0]}:{addr[1]}"

  def handshake(self, sock: socket.socket, peer: str) -> Connection:
    """Runs the key handshake on an accepted socket (closing it on failure).

    Raises:
      AuthenticationError: the peer does not hold the key (or does not speak the protocol).
      ConnectionError: the peer went away or stalled past the handshake deadline.
    """
    sock.settimeout(self.handshake_timeout_s)
    try:
      _listener_handshake(sock, self.key)
    except AuthenticationError:
      sock.close()
      raise
    except (OSError, EOFError) as e:
      sock.close()
      raise ConnectionError(f"{peer} did not complete the handshake ({e})") from None
    return Connection(sock, peer, max_frame=self.max_frame)

  def accept(self, timeout_s: float | None = None) -> Connection:
    """The next connection that passes the handshake (peers that fail it are dropped).

    Raises:
      TimeoutError: no authenticated connection within ``timeout_s``.
      OSError: the listener was closed.
    """
    import time
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
      left = None if deadline is None else max(0.0, deadline - time.monotonic())
      sock, peer = self.accept_socket(left)
      try:
        return self.handshake(sock, peer)
      except ConnectionError:
        continue

  def close(self) -> None:
    """Stops listening. A thread blocked in :meth:`accept_socket` wakes with an OSError
    (:func:`is_closed_listener_error`): closing the socket alone leaves it blocked in
    accept(2), still taking connections on the old socket."""
    try:
      self._sock.shutdown(socket.SHUT_RDWR)
    except OSError:
      pass  # never connected or already shut: close still releases it
    try:
      self._sock.close()
    except OSError:
      pass


def is_closed_listener_error(e: OSError) -> bool:
  """Whether an accept error means the listener itself was closed (not one peer's reset)."""
  return e.errno in (errno.EBADF, errno.EINVAL)


def connect(address: tuple[str, int], key: bytes, *, timeout_s: float = 30.0,
            max_frame: int = DEFAULT_MAX_FRAME) -> Connection:
  """Connects to a :class:`Listener` and runs the handshake.

  Raises:
    AuthenticationError: the listener refused the key, or is not a peer of this protocol.
    ConnectionError: nothing accepted the connection, or it dropped during the handshake.
  """
  key = check_key(key)
  host, port = address
  try:
    sock = socket.create_connection((host, port), timeout=timeout_s)
  except OSError as e:
    raise ConnectionError(f"cannot connect to {host}:{port} ({e})") from None
  try:
    _connector_handshake(sock, key)
  except AuthenticationError:
    sock.close()
    raise
  except (OSError, EOFError) as e:
    sock.close()
    raise ConnectionError(f"{host}:{port} dropped the connection during the handshake "
                          f"({e})") from None
  return Connection(sock, f"{host}:{port}", max_frame=max_frame)
