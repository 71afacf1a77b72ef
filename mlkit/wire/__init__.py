"""Data on the wire, never code: the frames, schemas and keys of every socket between processes.

- :mod:`mlkit.wire.frames`: the key handshake, length-prefixed msgpack frames,
  arrays as dtype + shape + bytes (:class:`Listener`, :func:`connect`,
  :class:`Connection`).
- :mod:`mlkit.wire.schema`: per-message-kind schemas checked before a frame is used.
- :mod:`mlkit.wire.keys`: where the shared key comes from (environment, a 0600
  key file, generated on loopback).

Used by the serving processes (``mlkit.serve``) and by a pool's leader and
followers (``mlkit.engine.lockstep``). docs/wire.md describes the protocol.
Imports no JAX.
"""

from mlkit.wire.frames import (AuthenticationError, Connection, FrameError, Listener, connect,
                               decode, encode)
from mlkit.wire.keys import AuthKeyError, Key, client_key, is_loopback, server_key
from mlkit.wire.schema import SchemaError

__all__ = ["AuthenticationError", "AuthKeyError", "Connection", "FrameError", "Key", "Listener",
           "SchemaError", "client_key", "connect", "decode", "encode", "is_loopback",
           "server_key"]
