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

The channel is :mod:`mlkit.wire`: a key handshake, then one msgpack frame per
operation holding host values only (ints, lists, numpy arrays as dtype + shape
+ bytes). A follower checks every frame against the schema of its operation
(the pool's page count, batch buckets and vocabulary bound every field) before
it runs anything; no code ever crosses, and a function the leader wants run
(:meth:`DeviceSide.call`) crosses as the name of a registered pool call
(:func:`pool_call`). A step's host inputs are a few KB; the one bulk item is a
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
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from mlkit import wire
from mlkit.kvcache import copy_pages, sync_tags, update_tags
from mlkit.parallel import replicate
from mlkit.wire.schema import Array, Bool, Fields, Int, List, MapOf, Str, Tuple


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

  def update_tags(self, pages: np.ndarray, tags: np.ndarray) -> None:
    """Writes the [k] int32 tags of ``pages`` into the pool (the pages that changed)."""
    self.state = update_tags(self.state, pages, tags, place=self.place)

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
      (tokens [B], ok [B], logits [B, V] or None, logprobs or None) on device
      (``Runner.run``).
    """
    if self.multiprocess:  # one pool's step inputs: identical host values on every process
      batch = dataclasses.replace(batch, **{
          f.name: self.place(getattr(batch, f.name)) for f in dataclasses.fields(batch)
          if getattr(batch, f.name) is not None})
    if chain:
      batch = dataclasses.replace(
          batch, tokens=chain_tokens(batch.tokens, self._last_decode, batch.prev_row))
    tok, ok, self.state, lg, lp = self.runner.run(kind, self.state, batch)
    if kind == "decode":
      self._last_decode = tok
    self._pending.append((tok, ok, lg, lp))
    return tok, ok, lg, lp

  def read(self, n: int) -> list:
    """The host values of the ``n`` oldest unread steps' outputs (waits for them)."""
    outs = [self._pending.popleft() for _ in range(n)]
    return to_host(outs) if self.multiprocess else jax.device_get(outs)

  def call(self, fn, *args):
    """``self.state, result = fn(self.state, *args)``; returns the result's host value.

    For device work of a pool that is neither a step nor a page operation (a
    transfer's landing, a payload's extraction): ``fn`` is a function
    registered with :func:`pool_call` (followers are sent its name), ``args``
    host values.
    """
    self.state, result = fn(self.state, *args)
    return to_host(result) if self.multiprocess else jax.device_get(result)


@dataclasses.dataclass(frozen=True)
class Fill:
  """How :meth:`mlkit.engine.Engine.adopt` writes an adopted request's KV, as data.

  ``fn(state, pages, start, *args) -> (state, (ok, why))`` must be a registered
  pool call (:func:`pool_call`) and ``args`` host values, so that every process
  of a pool spread over processes can be sent the same call.
  """

  fn: Any
  args: tuple = ()


class PoolBroken(RuntimeError):
  """A follower of this pool is gone: its mesh can run no further SPMD program (the
  collectives would wait for the missing process), so the pool must stop."""


# ------------------------------------------------------------------ what crosses the pool channel
@dataclasses.dataclass(frozen=True)
class Limits:
  """What bounds a pool operation's fields, read from the follower's own pool.

  Attributes:
    num_pages: pages in the pool (page ids are in [0, num_pages)).
    max_pages_per_seq: block-table width.
    max_tokens: the longest sequence a request may reach.
    vocab: vocabulary size.
    max_rows: the largest batch bucket.
    max_chunk: the largest prefill bucket.
    n_layers: layers in the pool.
    payload_bytes: the most bytes one request's KV payload may take (any pool format).
  """

  num_pages: int
  max_pages_per_seq: int
  max_tokens: int
  vocab: int
  max_rows: int
  max_chunk: int
  n_layers: int
  payload_bytes: int

  @classmethod
  def of(cls, side: "DeviceSide") -> "Limits":
    cfg, state = side.runner.config, side.state
    # Elements per token over every page array of every layer (scales included); a payload
    # in any pool format stores each in at most 4 bytes, plus its own scales.
    per_token = sum(int(np.prod(x.shape[2:])) for layer in state.layers for x in layer.values())
    return cls(num_pages=state.num_pages, max_pages_per_seq=cfg.max_pages_per_seq,
               max_tokens=cfg.max_seq_tokens, vocab=cfg.model.vocab_size,
               max_rows=cfg.batch_buckets[-1], max_chunk=cfg.prefill_buckets[-1],
               n_layers=state.n_layers,
               payload_bytes=2 * 4 * per_token * (cfg.max_seq_tokens + 4 * state.page_size))

  @property
  def max_frame(self) -> int:
    """The largest frame a follower accepts: a payload plus a step's inputs."""
    return self.payload_bytes + (1 << 20)

  def pages(self, max_len: int | None = None) -> List:
    return List(Int(0, self.num_pages), self.max_pages_per_seq if max_len is None else max_len)

  def tokens(self) -> Int:
    return Int(0, self.max_tokens + 1)

  def payload(self) -> List:
    """A KV payload: per layer, {entry name: [T, ...] array in some pool format}."""
    kv = Array(("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"),
               max_size=self.payload_bytes)
    return List(MapOf(Str(64), kv, 16), self.n_layers, 1)

  def checksum(self) -> Array:
    return Array(("uint32",), max_size=64 * (self.n_layers + 1))


# Functions a leader may ask its followers to run (DeviceSide.call), by name, with the schema
# of their arguments after ``state``: name -> (function, Limits -> Tuple schema).
POOL_CALLS: dict[str, tuple[Callable, Callable[[Limits], Tuple]]] = {}


def call_name(fn) -> str:
  """The name a pool call crosses the wire as."""
  return f"{fn.__module__}.{fn.__qualname__}"


def pool_call(args: Callable[[Limits], Tuple]):
  """Registers ``fn(state, *args)`` as device work a pool's leader may send its followers.

  Args:
    args: the schema of ``fn``'s arguments after ``state``, from the pool's Limits.
  """
  def register(fn):
    POOL_CALLS[call_name(fn)] = (fn, args)
    return fn
  return register


def _step_batch(lim: Limits) -> Fields:
  rows, chunk, width = lim.max_rows, lim.max_chunk, lim.max_pages_per_seq
  pos = Int(0, 1 << 30)

  def vec(dtype, lo=None, hi=None):
    return Array((dtype,), ndim=1, max_size=rows, lo=lo, hi=hi)

  return Fields({
      "tokens": Array(("int32",), ndim=2, max_size=rows * chunk, lo=0, hi=lim.vocab),
      "positions": Array(("int32",), ndim=2, max_size=rows * chunk, lo=0, hi=pos.hi),
      "block_tables": Array(("int32",), shape=(None, width), max_size=rows * width, lo=-1,
                            hi=lim.num_pages),
      "expected_tags": Array(("int32",), shape=(None, width), max_size=rows * width),
      "lengths": vec("int32", 0, lim.max_tokens + 1), "last_index": vec("int32", 0, chunk),
      "seeds": vec("uint32"), "sample_steps": vec("int32", 0, pos.hi),
      "temperature": vec("float32"), "top_k": vec("int32", 0, lim.vocab + 1),
      "top_p": vec("float32")},
      {"prev_row": vec("int32", -1, rows)})


def op_kinds(lim: Limits) -> dict[str, Fields]:
  """The schema of every operation a follower takes, bounded by its pool."""
  pair = Tuple((Int(0, lim.num_pages), Int(0, lim.num_pages)))
  return {
      "sync_tags": Fields({"tags": Array(("int32",), shape=(lim.num_pages,),
                                         max_size=lim.num_pages)}),
      "update_tags": Fields({"pages": Array(("int32",), ndim=1, max_size=lim.num_pages, lo=0,
                                            hi=lim.num_pages),
                             "tags": Array(("int32",), ndim=1, max_size=lim.num_pages)}),
      "copy_pages": Fields({"copies": List(pair, lim.num_pages, 1)}),
      "run": Fields({"step": Str(8, ("prefill", "decode")), "batch": _step_batch(lim),
                     "chain": Bool()}),
      "read": Fields({"n": Int(1, 3)}),
      "call": Fields({"name": Str(256, tuple(POOL_CALLS)), "args": List(_Any(), 16)}),
      "stop": Fields(),
  }


class _Any:
  """Any decoded value (a pool call's arguments are checked by that call's own schema)."""

  def check(self, value, path=""):
    return value


def _encode_op(op: str, args: tuple) -> dict:
  """A DeviceSide method call as a frame (host values only)."""
  if op == "sync_tags":
    return {"kind": op, "tags": np.asarray(args[0])}
  if op == "update_tags":
    return {"kind": op, "pages": np.asarray(args[0]), "tags": np.asarray(args[1])}
  if op == "copy_pages":
    return {"kind": op, "copies": [[int(s), int(d)] for s, d in args[0]]}
  if op == "run":
    kind, batch = args[0], args[1]
    chain = bool(args[2]) if len(args) > 2 else False
    fields = {f.name: np.asarray(getattr(batch, f.name)) for f in dataclasses.fields(batch)
              if getattr(batch, f.name) is not None}
    return {"kind": op, "step": kind, "batch": fields, "chain": chain}
  if op == "read":
    return {"kind": op, "n": int(args[0])}
  if op == "call":
    fn, rest = args[0], list(args[1:])
    name = call_name(fn)
    if POOL_CALLS.get(name, (None,))[0] is not fn:
      raise ValueError(f"{name} is not a registered pool call (lockstep.pool_call): a pool "
                       "spread over processes runs only those")
    return {"kind": op, "name": name, "args": rest}
  raise ValueError(f"unknown pool operation {op!r}")


def _decode_op(msg: dict, lim: Limits) -> tuple[str, tuple]:
  """A checked frame as (DeviceSide method, arguments).

  Raises:
    wire.FrameError: a step batch whose rows disagree, or a call's arguments that
      fail that call's schema.
  """
  from mlkit.engine.runner import StepBatch
  op = msg["kind"]
  if op == "sync_tags":
    return op, (msg["tags"],)
  if op == "update_tags":
    if msg["pages"].shape != msg["tags"].shape:
      raise wire.FrameError(f"update_tags: {msg['pages'].shape} pages, {msg['tags'].shape} tags")
    return op, (msg["pages"], msg["tags"])
  if op == "copy_pages":
    return op, ([tuple(c) for c in msg["copies"]],)
  if op == "run":
    b = msg["batch"]
    rows = {k: v.shape[0] for k, v in b.items()}
    if len(set(rows.values())) != 1 or b["tokens"].shape[1] > lim.max_chunk:
      raise wire.FrameError(f"run: a step batch's arrays disagree on their rows or chunk: "
                            f"{ {k: v.shape for k, v in b.items()} }")
    return op, (msg["step"], StepBatch(**b), msg["chain"])
  if op == "read":
    return op, (msg["n"],)
  if op == "call":
    fn, schema = POOL_CALLS[msg["name"]]
    try:
      args = schema(lim).check(msg["args"], f"call {msg['name']}")
    except wire.SchemaError as e:
      raise wire.FrameError(str(e)) from None
    return op, (fn, *args)
  raise wire.FrameError(f"unknown pool operation {op!r}")  # the schema lists every kind


class Followers:
  """The leader's channel to the other processes of its pool.

  Connections that fail the key handshake (a stranger, a stale process) are
  dropped while the leader waits for its followers.

  Args:
    address: (host, port) to listen on for the followers.
    count: how many followers join.
    key: the shared key (``mlkit.wire.keys``).
    timeout_s: how long to wait for all of them (seconds).

  Raises:
    TimeoutError: not every follower joined in time.
  """

  def __init__(self, address, count: int, key: bytes, timeout_s: float = 120.0):
    self._conns: list[wire.Connection] = []
    # Followers send nothing after the handshake: any frame from one is refused.
    listener = wire.Listener(tuple(address), key, max_frame=1 << 10)
    deadline = time.monotonic() + timeout_s
    try:
      while len(self._conns) < count:
        try:
          self._conns.append(listener.accept(max(0.0, deadline - time.monotonic())))
        except TimeoutError as e:
          raise TimeoutError(f"{len(self._conns)} of {count} pool followers joined within "
                             f"{timeout_s:.0f} s") from e
    finally:
      listener.close()

  def send(self, op: str, args: tuple) -> None:
    """Sends one operation to every follower (before the leader runs it).

    Raises:
      PoolBroken: a follower's connection is closed (the process died); the leader
        does not run the operation.
      ValueError / TypeError: the operation cannot cross the wire (an unregistered
        call, a value that is not data); nothing was sent.
    """
    frame = wire.encode(_encode_op(op, args))
    for i, c in enumerate(self._conns):
      try:
        c.send_frame(frame)
      except ConnectionError as e:
        raise PoolBroken(f"pool follower {i + 1} is gone ({e})") from e

  def close(self) -> None:
    """Tells every follower to stop and closes the channel."""
    for c in self._conns:
      try:
        c.send({"kind": "stop"})
      except ConnectionError:
        pass
      c.close()
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
MIRRORED = ("sync_tags", "update_tags", "copy_pages", "run", "read", "call")


def follow(address, side: DeviceSide, key: bytes, *,
           connect_timeout_s: float = 120.0) -> tuple[int, bool]:
  """Runs a follower: repeats the leader's device operations until it stops or goes away.

  Every frame is checked against its operation's schema, bounded by this
  process's own pool (:class:`Limits`), before anything runs.

  Args:
    address: (host, port) where the leader's :class:`Followers` listens.
    side: this process's DeviceSide of the pool (built as the leader built its own).
    key: the shared key.
    connect_timeout_s: how long to retry connecting (the leader may start later).

  Returns:
    (operations run, whether the leader said stop: False when it went away).

  Raises:
    ConnectionError: the leader never answered, or refused our key
      (``mlkit.wire.AuthenticationError``).
    mlkit.wire.FrameError: the leader sent a frame that fails its check; nothing of
      it ran, and the pool cannot go on.
  """
  lim = Limits.of(side)
  kinds = op_kinds(lim)
  deadline = time.monotonic() + connect_timeout_s
  while True:
    try:
      conn = wire.connect(tuple(address), key, timeout_s=max(1.0, connect_timeout_s),
                          max_frame=lim.max_frame)
      break
    except wire.AuthenticationError:
      raise
    except ConnectionError as e:
      if time.monotonic() > deadline:
        raise ConnectionError(f"no pool leader at {address[0]}:{address[1]} within "
                              f"{connect_timeout_s:.0f} s") from e
      time.sleep(0.2)
  n = 0
  with conn:
    while True:
      try:
        msg = conn.recv(kinds)
      except (EOFError, ConnectionError):
        return n, False  # the leader is gone: nothing more will be launched
      except wire.FrameError as e:
        logging.error("lockstep: refused a frame from the pool leader: %s", e)
        raise
      if msg["kind"] == "stop":
        return n, True
      op, args = _decode_op(msg, lim)
      getattr(side, op)(*args)
      n += 1
