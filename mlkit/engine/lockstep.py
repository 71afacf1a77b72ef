"""One pool on several JAX processes (multi-host): the leader decides, every process launches.

A pool whose mesh spans several processes (``jax.distributed``) runs SPMD: every
process must issue the same jitted calls, in the same order, with the same host
inputs, or the collectives inside them wait forever. So one process, the
leader, runs everything that decides (the engine's scheduler, allocator, prefix
cache, the serving front end); the others, the followers, only execute. Each
device operation of the engine goes through a :class:`DeviceSide`, whose
methods take host values only; on the leader a :class:`Followers` channel sends
the method's name and arguments to every follower before the leader runs it,
and each follower runs the same method on its own :class:`DeviceSide`
(:func:`follow`). docs/serving_processes.md has the picture.

The channel is ``multiprocessing.connection`` (HMAC authkey, pickled tuples of
numpy arrays and ints): a step's host inputs are a few KB. The one bulk item is a
transfer's payload, which a decode leader forwards with the landing call.

Host inputs are placed on the mesh replicated (``mlkit.parallel.put``: each
process builds its own shards from the identical host value), and results are
read with ``multihost_utils.process_allgather`` where an array is not wholly on
this process's devices: a collective, which is why reading is itself one of the
mirrored operations.
"""

from __future__ import annotations

import collections
import dataclasses
from multiprocessing import connection
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mlkit.kvcache import copy_pages, sync_tags
from mlkit.parallel import replicate


@jax.jit
def chain_tokens(host_tokens, prev_tokens, prev_row):
  """[B, 1] decode inputs: row i takes prev_tokens[prev_row[i]] where prev_row[i] >= 0.

  Args:
    host_tokens: [B, 1] int32 tokens the host knows.
    prev_tokens: [B'] int32 tokens sampled by the step in flight (on device).
    prev_row: [B] int32 row of prev_tokens, or -1 to keep the host token.
  """
  taken = prev_tokens[jnp.maximum(prev_row, 0)][:, None]
  return jnp.where(prev_row[:, None] >= 0, taken, host_tokens)


def spans_processes(mesh) -> bool:
  """Whether ``mesh`` holds devices of other processes (a multi-host pool)."""
  return mesh is not None and any(d.process_index != jax.process_index()
                                  for d in mesh.devices.flat)


def first_local_device(state):
  """The lowest-id device of this process that holds ``state``'s pages (where a transfer's
  payload is offered or pulled)."""
  here = jax.process_index()
  return min((d for d in state.page_tags.sharding.device_set if d.process_index == here),
             key=lambda d: d.id)


def to_host(tree) -> Any:
  """The full host value of every array of ``tree``, also of arrays spread over processes.

  An array wholly on this process's devices (or replicated) is read locally; one
  split across processes is gathered with ``process_allgather``, a collective
  every process of the mesh must call in the same order.
  """
  from jax.experimental import multihost_utils

  def one(x):
    if not isinstance(x, jax.Array):
      return x
    if x.is_fully_addressable:
      return np.asarray(x)
    if x.is_fully_replicated:
      return np.asarray(x.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return jax.tree_util.tree_map(one, tree)


class DeviceSide:
  """The part of a pool that lives on its devices: the KV state, the runner, unread outputs.

  Every method takes host values only (so a follower can be given the same
  call) and places them as the pool's arrays are placed.

  Args:
    runner: the pool's ``mlkit.engine.runner.Runner`` (params placed).
    state: the pool's ``PagedKVState``.
    mesh: the pool's mesh, or None (one device).
  """

  def __init__(self, runner, state, mesh=None):
    self.runner = runner
    self.state = state
    self.mesh = mesh
    self.multiprocess = spans_processes(mesh)
    self._pending: collections.deque = collections.deque()
    self._last_decode = None  # [B] tokens of the latest decode step (overlapped chaining)

  def place(self, x):
    """A host array as this pool's step inputs are placed (replicated across processes)."""
    return replicate(x, self.mesh) if self.multiprocess else x

  def sync_tags(self, tags: np.ndarray) -> None:
    """Writes the allocator's [num_pages] int32 tags into the pool."""
    self.state = sync_tags(self.state, self.place(tags))

  def copy_pages(self, copies) -> None:
    """Copies page contents src -> dst (copy-on-write)."""
    self.state = copy_pages(self.state, copies, place=self.place)

  def run(self, kind: str, batch, chain: bool = False):
    """Dispatches one step; its outputs wait for :meth:`read`.

    Args:
      kind: "prefill" or "decode".
      batch: the step's host ``StepBatch``.
      chain: decode rows with ``batch.prev_row >= 0`` take their input token from
        the latest decode step's device output (the engine's overlapped mode).

    Returns:
      (tokens [B], ok [B], logits [B, V] or None) on device.
    """
    if self.multiprocess:  # one pool's step inputs: identical host values on every process
      batch = dataclasses.replace(batch, **{
          f.name: self.place(getattr(batch, f.name)) for f in dataclasses.fields(batch)
          if getattr(batch, f.name) is not None})
    if chain:
      batch = dataclasses.replace(
          batch, tokens=chain_tokens(batch.tokens, self._last_decode, batch.prev_row))
    tok, ok, self.state, lg = self.runner.run(kind, self.state, batch)
    if kind == "decode":
      self._last_decode = tok
    self._pending.append((tok, ok, lg))
    return tok, ok, lg

  def read(self, n: int) -> list:
    """The host values of the ``n`` oldest unread steps' outputs (waits for them)."""
    outs = [self._pending.popleft() for _ in range(n)]
    return to_host(outs) if self.multiprocess else jax.device_get(outs)

  def call(self, fn, *args):
    """``self.state, result = fn(self.state, *args)``; returns the result's host value.

    For device work of a pool that is neither a step nor a page operation (a
    transfer's landing, a payload's extraction): ``fn`` is a module-level
    function (followers are sent it by reference), ``args`` host values.
    """
    self.state, result = fn(self.state, *args)
    return to_host(result) if self.multiprocess else jax.device_get(result)


@dataclasses.dataclass(frozen=True)
class Fill:
  """How :meth:`mlkit.engine.Engine.adopt` writes an adopted request's KV, as data.

  ``fn(state, pages, start, *args) -> (state, (ok, why))`` must be a module-level
  function and ``args`` host values, so that every process of a pool spread over
  processes can be sent the same call.
  """

  fn: Any
  args: tuple = ()


class PoolBroken(RuntimeError):
  """A follower of this pool is gone: its mesh can run no further SPMD program (the
  collectives would wait for the missing process), so the pool must stop."""


class Followers:
  """The leader's channel to the other processes of its pool.

  Args:
    address: (host, port) to listen on for the followers.
    count: how many followers join.
    authkey: the shared HMAC key.
    timeout_s: how long to wait for all of them (seconds).

  Raises:
    TimeoutError: not every follower joined in time.
  """

  def __init__(self, address, count: int, authkey: bytes, timeout_s: float = 120.0):
    import socket
    self._conns: list[connection.Connection] = []
    listener = connection.Listener(tuple(address), authkey=authkey)
    listener._listener._socket.settimeout(timeout_s)  # accept() gives up instead of hanging
    try:
      for _ in range(count):
        try:
          self._conns.append(listener.accept())
        except (socket.timeout, TimeoutError) as e:
          raise TimeoutError(f"{len(self._conns)} of {count} pool followers joined within "
                             f"{timeout_s:.0f} s") from e
    finally:
      listener.close()

  def send(self, op: str, args: tuple) -> None:
    """Sends one operation to every follower (before the leader runs it).

    Raises:
      PoolBroken: a follower's connection is closed (the process died); the leader
        does not run the operation.
    """
    for i, c in enumerate(self._conns):
      try:
        c.send((op, args))
      except (OSError, EOFError) as e:
        raise PoolBroken(f"pool follower {i + 1} is gone ({type(e).__name__}: {e})") from e

  def close(self) -> None:
    """Tells every follower to stop and closes the channel."""
    for c in self._conns:
      try:
        c.send(("stop", ()))
        c.close()
      except OSError:
        pass
    self._conns = []


class Leader:
  """A :class:`DeviceSide` whose every call is sent to the followers first."""

  def __init__(self, side: DeviceSide, followers: Followers):
    self.side = side
    self.followers = followers

  @property
  def state(self):
    return self.side.state

  @state.setter
  def state(self, value):  # host-side bookkeeping only (tests, fault injection)
    self.side.state = value

  def __getattr__(self, name):
    attr = getattr(self.side, name)
    if name not in MIRRORED:
      return attr

    def mirrored(*args):
      self.followers.send(name, args)
      return attr(*args)
    return mirrored


# The DeviceSide methods a follower repeats.
MIRRORED = ("sync_tags", "copy_pages", "run", "read", "call")


def follow(address, side: DeviceSide, authkey: bytes, *,
           connect_timeout_s: float = 120.0) -> tuple[int, bool]:
  """Runs a follower: repeats the leader's device operations until it stops or goes away.

  Args:
    address: (host, port) where the leader's :class:`Followers` listens.
    side: this process's DeviceSide of the pool (built as the leader built its own).
    authkey: the shared HMAC key.
    connect_timeout_s: how long to retry connecting (the leader may start later).

  Returns:
    (operations run, whether the leader said stop: False when it went away).

  Raises:
    ConnectionError: the leader never answered.
  """
  import time
  deadline = time.monotonic() + connect_timeout_s
  while True:
    try:
      conn = connection.Client(tuple(address), authkey=authkey)
      break
    except (ConnectionRefusedError, FileNotFoundError) as e:
      if time.monotonic() > deadline:
        raise ConnectionError(f"no pool leader at {address[0]}:{address[1]} within "
                              f"{connect_timeout_s:.0f} s") from e
      time.sleep(0.2)
  n = 0
  with conn:
    while True:
      try:
        op, args = conn.recv()
      except (EOFError, OSError):
        return n, False  # the leader is gone: nothing more will be launched
      if op == "stop":
        return n, True
      if op not in MIRRORED:
        raise ValueError(f"unknown pool operation {op!r}")
      getattr(side, op)(*args)
      n += 1
