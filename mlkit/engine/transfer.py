"""Moving one request's KV pages from the prefill pool to the decode pool.

The two pools may differ in storage dtype (bf16 -> fp8 with per-token scales),
page size, page count and devices. A transfer is four jitted pieces:

1. :func:`extract_kv` on the source devices gathers the request's tokens out
   of its pages into a dense *payload*, in the source storage format
   ({name: [T, *E]}, plus {name_scale: [T, *E[:-1]]} for fp8 sources), zero
   past the request's length, and :func:`payload_checksum` sums it.
2. The payload is copied to the destination devices; the checksum is recomputed
   there. A mismatch means the bytes changed in transit.
3. :func:`write_kv` on the destination dequantises the payload to f32 and
   writes it through the destination block table with the destination's own
   write path (``mlkit.kvcache.write_layer``), so an fp8 pool quantises per
   token exactly as a decode step would, and re-paging to a different page size
   is only a different block table.
4. :func:`landing_checksums` converts the received payload to the destination
   format independently, reads the stored bytes back out of the destination
   pages, and sums both: a mismatch means the write went wrong.

Every entry a layer pages moves the same way: the latent and rope key (MLA) or
K and V (GQA), and on a sparse-attention layer that runs the indexer (GLM 5)
its keys ``index_k`` too, so a layer's payload has the entries its pool layer
has (``PagedKVState.layer_names``) and layers may differ in their entry count.

Checksums are position-weighted sums of the raw bits (uint32, wrapping): every
word is multiplied by an odd weight that depends on its index, so any single
changed word always changes the sum, and swapped tokens almost always do.

A transfer may start at token ``start`` > 0 when the destination already holds
the first ``start`` tokens (its prefix cache shares them): only the source
pages from the one holding ``start`` on are gathered and moved, and the write
and the landing check cover positions [start, length) only, so the shared
pages are never written.

Both page lists are padded with ``PAD_PAGE`` to :func:`page_bucket` of their
length before the jitted pieces see them. The pieces compile once per shape, so
without buckets every new page count (every new prompt length class) would
compile four programs on each side in the middle of serving; with them a pool
of 256 pages per request compiles at most 28 shapes, and a payload carries at
most a quarter more (zero) rows than the request fills (docs/engine.md).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mlkit.engine.lockstep import pool_call, spans_processes, to_host
from mlkit.kvcache import PAD_PAGE, BatchMeta, PagedKVState
from mlkit.kvcache.fp8 import dequantize_fp8, quantize_fp8
from mlkit.kvcache.state import scale_name, write_layer
from mlkit.wire.schema import Tuple

# A payload: per layer, {entry name (and scale name for fp8): [T, ...] array}.
Payload = list


@dataclasses.dataclass(frozen=True)
class TransferResult:
  """What one transfer attempt found.

  Attributes:
    ok: both checksums matched.
    reason: None when ok, else which check failed and where (layer, entry).
    nbytes: payload bytes moved between the pools.
  """

  ok: bool
  reason: str | None
  nbytes: int


def page_bucket(m: int) -> int:
  """The page count a transfer's page list is padded to: m itself up to 8, then m rounded
  up to a quarter of its power-of-two octave (10, 12, 14, 16, 20, 24, ..., 256), so that
  at most 4 shapes per octave compile and padding adds at most a quarter of m."""
  if m <= 8:
    return m
  step = 1 << ((m - 1).bit_length() - 3)
  return -(-m // step) * step


def _bucketed(pages) -> np.ndarray:
  """int32 pages padded with PAD_PAGE to page_bucket(len(pages))."""
  pages = np.asarray(pages, np.int32)
  pad = page_bucket(len(pages)) - len(pages)
  return np.concatenate([pages, np.full((pad,), PAD_PAGE, np.int32)]) if pad else pages


def _entry_keys(state: PagedKVState, layer: int) -> list[str]:
  """Layer ``layer``'s page arrays and (fp8) their scales: what a payload layer carries."""
  keys = []
  for name in state.layer_names(layer):
    keys.append(name)
    if state.is_fp8:
      keys.append(scale_name(name))
  return keys


def _mask_past(x: jax.Array, length) -> jax.Array:
  live = jnp.arange(x.shape[0]) < length
  return jnp.where(live.reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))


def _gather_raw(arr: jax.Array, pages: jax.Array, length) -> jax.Array:
  """A request's slots [M * P, ...] in storage format, zero past length (pages [M], PAD < 0)."""
  N, P = arr.shape[:2]
  x = arr[jnp.clip(pages, 0, N - 1)]  # [M, P, ...]
  x = x.reshape((pages.shape[0] * P,) + arr.shape[2:])
  return _mask_past(x, length)


@jax.jit
def extract_kv(state: PagedKVState, pages: jax.Array, length: jax.Array) -> Payload:
  """Gathers one request's tokens out of its pages, in the pool's storage format.

  Args:
    state: the source pool.
    pages: [M] int32 the request's pages in position order (PAD_PAGE past them).
    length: int32 scalar, tokens to move.

  Returns:
    Per layer {name: [M * P, *E] storage dtype, (fp8) name_scale: [M * P, *E[:-1]] f32},
    zero past ``length``.
  """
  return [{k: _gather_raw(layer[k], pages, length) for k in _entry_keys(state, i)}
          for i, layer in enumerate(state.layers)]


def _words(x: jax.Array) -> jax.Array:
  """The raw bits of x as a flat uint32 vector (one word per element)."""
  bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
  return jax.lax.bitcast_convert_type(x, bits).reshape(-1).astype(jnp.uint32)


def checksum(x: jax.Array) -> jax.Array:
  """Position-weighted uint32 checksum of an array's raw bits (wrapping arithmetic).

  Args:
    x: any 1-, 2- or 4-byte dtype array.

  Returns:
    uint32 scalar sum_i word_i * weight_i. Every weight is odd (Knuth's
    multiplicative hash of the index, low bit set), so changing any single word
    always changes the sum (an odd multiple of a non-zero difference is non-zero
    mod 2**32); two swapped words change it unless (a - b) * (w_i - w_j) happens
    to be a multiple of 2**32.
  """
  w = _words(x)
  idx = jnp.arange(w.shape[0], dtype=jnp.uint32)
  weights = (idx * jnp.uint32(2654435761)) | jnp.uint32(1)
  return jnp.sum(w * weights, dtype=jnp.uint32)


def _stack_rows(rows: list) -> jax.Array:
  """Per-layer checksum rows stacked into [n_layers, n_entries], short rows zero-padded.

  Layers may carry different entry counts (only sparse-attention layers that run
  the indexer have ``index_k``); a rectangular array keeps the checksum one plain
  array for the host and the wire (mlkit.serve sends it as a nested list).
  """
  width = max(len(r) for r in rows)
  return jnp.stack([jnp.concatenate([jnp.stack(r), jnp.zeros((width - len(r),), jnp.uint32)])
                    for r in rows])


@jax.jit
def payload_checksum(payload: Payload) -> jax.Array:
  """[n_layers, n_entries] uint32 checksums of a payload (each layer's entries in sorted key
  order, rows zero-padded to the longest layer)."""
  return _stack_rows([[checksum(layer[k]) for k in sorted(layer)] for layer in payload])


def _to_f32(payload_layer: dict, names) -> dict:
  """Dequantised f32 entries of one payload layer."""
  out = {}
  for name in names:
    x = payload_layer[name]
    sn = scale_name(name)
    out[name] = (dequantize_fp8(x, payload_layer[sn]) if sn in payload_layer
                 else x.astype(jnp.float32))
  return out


def _meta(pages: jax.Array, length, page_size: int) -> BatchMeta:
  return BatchMeta(block_tables=pages[None], lengths=jnp.reshape(length, (1,)).astype(jnp.int32),
                   expected_tags=jnp.zeros_like(pages)[None], page_size=page_size)


@functools.partial(jax.jit, donate_argnames=("state",))
def write_kv(state: PagedKVState, payload: Payload, pages: jax.Array, length: jax.Array,
             base: jax.Array | int = 0, start: jax.Array | int = 0) -> PagedKVState:
  """Writes a payload into the destination pool through its block table (donates ``state``).

  Args:
    state: the destination pool (any storage dtype and page size).
    payload: from :func:`extract_kv` (any source format), T tokens per entry, the
      first at position ``base``.
    pages: [M'] int32 destination pages (the whole block table) with
      M' * page_size >= length.
    length: int32 scalar; tokens at positions >= length are not written.
    base: int32 scalar, the position of the payload's first token.
    start: int32 scalar; tokens at positions < start are not written (the
      destination shares them already).

  Returns:
    The updated pool: fp8 pools get per-token scales computed here.
  """
  for i, layer in enumerate(payload):
    new = _to_f32(layer, state.layer_names(i))
    T = new[state.names[0]].shape[0]
    positions = base + jnp.arange(T, dtype=jnp.int32)
    positions = jnp.where(positions >= start, positions, -1)[None]  # negative: dropped
    state = write_layer(state, i, {k: v[None] for k, v in new.items()}, positions,
                        _meta(pages, length, state.page_size))
  return state


@jax.jit
def landing_checksums(state: PagedKVState, payload: Payload, pages: jax.Array,
                      length: jax.Array, base: jax.Array | int = 0,
                      start: jax.Array | int = 0) -> tuple[jax.Array, jax.Array]:
  """Checksums of what should be in the destination pages and of what is there.

  Args:
    state: the destination pool after :func:`write_kv`.
    payload: the payload that was written (its first token at position ``base``).
    pages: [M'] destination pages; length: int32 scalar.
    base / start: as :func:`write_kv`; only positions [start, length) are compared.

  Returns:
    (expected, stored), each [n_layers, n_entries] uint32: the payload converted
    to the destination format, and the destination pages read back, both over
    positions [start, length); each layer's entries in sorted key order, rows
    zero-padded to the longest layer.
  """
  expected, stored = [], []
  for i, layer in enumerate(payload):
    names = state.layer_names(i)
    new = _to_f32(layer, names)
    T = new[state.names[0]].shape[0]
    conv = {}
    for name in names:
      if state.is_fp8:
        conv[name], conv[scale_name(name)] = quantize_fp8(new[name])
      else:
        conv[name] = new[name].astype(state.dtype)
    exp_row, got_row = [], []
    for k in sorted(_entry_keys(state, i)):
      got = _gather_raw(state.layers[i][k], pages, length)  # positions [0, M' * P)
      got = _fit(got, got.shape[0] + T)  # room to read T tokens from any base
      got = jax.lax.dynamic_slice_in_dim(got, base, T)  # positions [base, base + T)
      exp_row.append(checksum(_window(conv[k], base, start, length)))
      got_row.append(checksum(_window(got, base, start, length)))
    expected.append(exp_row)
    stored.append(got_row)
  return _stack_rows(expected), _stack_rows(stored)


def _window(x: jax.Array, base, start, length) -> jax.Array:
  """x [T, ...] (token t at position base + t) zeroed outside positions [start, length)."""
  pos = base + jnp.arange(x.shape[0])
  live = (pos >= start) & (pos < length)
  return jnp.where(live.reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))


def _fit(x: jax.Array, n: int) -> jax.Array:
  """x [T, ...] cut or zero-padded to [n, ...] along the token axis."""
  T = x.shape[0]
  if T >= n:
    return x[:n]
  return jnp.concatenate([x, jnp.zeros((n - T,) + x.shape[1:], x.dtype)])


def _where(sums_a: np.ndarray, sums_b: np.ndarray, keys: list[list[str]]) -> str:
  """Where two checksum arrays first differ; keys[layer] names that layer's entries (sorted)."""
  layer, entry = map(int, np.argwhere(sums_a != sums_b)[0])
  name = keys[layer][entry] if entry < len(keys[layer]) else f"#{entry}"
  return f"layer {layer} entry {name!r}"


@dataclasses.dataclass(frozen=True)
class Extracted:
  """The sending half of a transfer: a request's KV gathered out of the source pool.

  Attributes:
    payload: per layer {name: [T, *E]} in the source storage format (see
      :func:`extract_kv`), the first token at position ``base``.
    checksum: [n_layers, n_entries] uint32 :func:`payload_checksum` of the payload
      as it left the source (host numpy).
    base: the position of the payload's first token (a multiple of the source page size).
    length: tokens the request holds.
  """

  payload: Payload
  checksum: np.ndarray
  base: int
  length: int


def check_pools(src_attention: str, src_layers: int, dst: PagedKVState) -> None:
  """Raises ValueError when a source pool's KV cannot land in ``dst`` (attention kind, depth)."""
  if src_attention != dst.attention or src_layers != dst.n_layers:
    raise ValueError(f"transfer between incompatible pools: {src_attention}/{src_layers} layers "
                     f"-> {dst.attention}/{dst.n_layers} layers")


def _check_payload_layout(payload: Payload, dst: PagedKVState) -> None:
  """Raises ValueError unless every payload layer carries the entries its ``dst`` layer pages.

  Scales may differ (a bf16 payload lands in an fp8 pool); the entries may not: a
  payload without index keys cannot land in a sparse-attention layer that needs them.
  """
  if len(payload) != dst.n_layers:
    raise ValueError(f"a payload of {len(payload)} layers cannot land in a pool of {dst.n_layers}")
  for i, layer in enumerate(payload):
    got = sorted(k for k in layer if not any(k == scale_name(n) for n in layer))
    want = sorted(dst.layer_names(i))
    if got != want:
      raise ValueError(f"payload layer {i} carries {got}, the destination pool layer pages {want}")


def _check_landing(dst: PagedKVState, dst_pages, length: int, start: int) -> None:
  if not 0 <= start < length or start % dst.page_size:
    raise ValueError(f"transfer start {start} must be a multiple of the destination page size "
                     f"{dst.page_size} in [0, {length})")
  if len(dst_pages) * dst.page_size < length:
    raise ValueError(f"{len(dst_pages)} destination pages of {dst.page_size} hold fewer than "
                     f"{length} tokens")


def pool_placer(state: PagedKVState):
  """How host inputs of a transfer half must be placed for ``state``: replicated on its mesh
  when that spans processes (docs/serving_processes.md), else None (as they are)."""
  sharding = getattr(state.page_tags, "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if not spans_processes(mesh):
    return None
  from mlkit.parallel import replicate
  return lambda tree: replicate(tree, mesh)


def extract_payload(src: PagedKVState, src_pages, length: int, *, start: int = 0) -> Extracted:
  """The sending half of :func:`transfer_kv`: gathers and checksums ``length`` tokens.

  Args:
    src: the source pool (not modified).
    src_pages: the request's source pages in position order (ints).
    length: tokens the request holds (> start).
    start: the first token the destination lacks; gathering starts at the source
      page holding it.

  Returns:
    The :class:`Extracted` payload and its checksum, on the source devices.

  Raises:
    ValueError: a non-positive length, or too few source pages for it.
  """
  if length <= 0:
    raise ValueError(f"transfer length must be > 0, got {length}")
  if len(src_pages) * src.page_size < length:
    raise ValueError(f"{len(src_pages)} source pages of {src.page_size} hold fewer than {length} tokens")
  first = start // src.page_size  # the source page holding token `start`
  base = first * src.page_size
  pages, n = _bucketed(src_pages[first:]), np.int32(length - base)
  place = pool_placer(src)
  if place is not None:
    pages, n = place(pages), place(n)
  payload = extract_kv(src, pages, n)
  return Extracted(payload, to_host(payload_checksum(payload)), base, length)


def verify_payload(payload: Payload, sent: np.ndarray) -> str | None:
  """None when an arrived payload's checksum equals ``sent`` (the source's), else where it differs.

  :func:`land_payload` runs it before writing; a receiver that wants to retry a
  transfer before committing any pages to it may run it first, too.
  """
  received = to_host(payload_checksum(payload))
  sent = np.asarray(sent)
  if sent.shape == received.shape and np.array_equal(sent, received):
    return None
  where = (_where(sent, received, [sorted(layer) for layer in payload])
           if sent.shape == received.shape
           else f"checksum shape {sent.shape} != {received.shape}")
  return f"transfer checksum mismatch in transit at {where}"


@jax.jit
def flip_low_bit(x: jax.Array) -> jax.Array:
  """x with the low bit of its first element flipped (a one-bit corruption, for fault tests);
  one program per shape, where its four operations run eagerly would compile four."""
  words = jax.lax.bitcast_convert_type(x, {1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])
  flat = words.reshape(-1)
  flat = flat.at[0].set(flat[0] ^ flat.dtype.type(1))
  return jax.lax.bitcast_convert_type(flat.reshape(x.shape), x.dtype)


def land_payload(dst: PagedKVState, dst_pages, payload: Payload, sent: np.ndarray, length: int, *,
                 base: int = 0, start: int = 0,
                 corrupt_landing: Callable[[PagedKVState], PagedKVState] | None = None
                 ) -> tuple[PagedKVState, TransferResult]:
  """The receiving half of :func:`transfer_kv`: checks, writes and re-checks an arrived payload.

  Args:
    dst: the destination pool (donated: use the returned state).
    dst_pages: destination pages in position order, enough for ``length`` tokens.
    payload: the payload as it arrived, on the destination devices.
    sent: its checksum as computed at the source (:attr:`Extracted.checksum`).
    length / base: as :class:`Extracted`.
    start: tokens the destination already holds (a multiple of its page size);
      only positions [start, length) are written and checked.
    corrupt_landing: test hook applied to the destination state after the write.

  Returns:
    (dst state, TransferResult). A transit mismatch returns before anything is
    written; after a landing mismatch the pages may hold garbage.

  Raises:
    ValueError: a start that is not a page multiple in [0, length), too few
      destination pages, or a payload whose layer count differs from the pool's.
  """
  _check_landing(dst, dst_pages, length, start)
  _check_payload_layout(payload, dst)
  nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(payload))
  dst_pages = _bucketed(dst_pages)
  n, base, start = np.int32(length), np.int32(base), np.int32(start)
  place = pool_placer(dst)
  if place is not None:  # a pool spread over processes: every input on its mesh
    payload, dst_pages, n, base, start = place((payload, dst_pages, n, base, start))
  why = verify_payload(payload, sent)
  if why is not None:
    return dst, TransferResult(False, why, nbytes)
  dst = write_kv(dst, payload, dst_pages, n, base, start)
  if corrupt_landing is not None:
    dst = corrupt_landing(dst)
  expected, stored = to_host(landing_checksums(dst, payload, dst_pages, n, base, start))
  if not np.array_equal(expected, stored):
    keys = [sorted(_entry_keys(dst, i)) for i in range(dst.n_layers)]
    return dst, TransferResult(False, f"transfer checksum mismatch after the write at "
                                      f"{_where(expected, stored, keys)}", nbytes)
  return dst, TransferResult(True, None, nbytes)


@pool_call(lambda lim: Tuple((lim.pages(), lim.tokens(), lim.payload(), lim.checksum(),
                              lim.tokens(), lim.tokens())))
def land_fill(state: PagedKVState, pages, start: int, payload: Payload, sent: np.ndarray,
              length: int, base: int):
  """:func:`land_payload` as an adopt fill (``lockstep.Fill(land_fill, (payload, sent,
  length, base))``): returns (state, (ok, why)); ``payload`` host arrays when the pool
  spans processes (each process places them), device arrays otherwise."""
  state, result = land_payload(state, pages, payload, sent, length, base=base, start=start)
  return state, (result.ok, result.reason or "")


@pool_call(lambda lim: Tuple((lim.pages(), lim.tokens())))
def extract_to_host(state: PagedKVState, pages, length: int):
  """:func:`extract_payload` for ``DeviceSide.call``: (state, (payload, checksum, base)),
  read to the host by the caller (every process of a pool spread over processes runs it)."""
  ex = extract_payload(state, pages, length)
  return state, (ex.payload, ex.checksum, ex.base)


def transfer_kv(src: PagedKVState, src_pages, dst: PagedKVState, dst_pages, length: int, *,
                start: int = 0, dst_mesh: Mesh | None = None,
                corrupt_payload: Callable[[Payload], Payload] | None = None,
                corrupt_landing: Callable[[PagedKVState], PagedKVState] | None = None
                ) -> tuple[PagedKVState, TransferResult]:
  """Moves ``length`` tokens from ``src_pages`` of one pool to ``dst_pages`` of another, checked.

  :func:`extract_payload` on the source, a device copy, :func:`land_payload` on
  the destination (mlkit.serve runs the same two halves in two processes, with
  the copy done by JAX's transfer server: docs/serving_processes.md).

  Args:
    src: the source pool (not modified).
    src_pages: the request's source pages in position order (ints).
    dst: the destination pool (donated: use the returned state).
    dst_pages: destination pages in position order, enough for ``length`` tokens
      at the destination page size.
    length: tokens the request holds (> start).
    start: tokens the destination already holds in its first pages (shared from
      its prefix cache, a multiple of its page size): only source pages from the
      one holding token ``start`` on are moved, and only positions [start,
      length) are written and checked.
    dst_mesh: the destination pool's mesh; the payload is replicated on it
      (None: the destination state's devices, replicated).
    corrupt_payload: test hook applied to the payload after it arrived
      (simulates corruption in transit).
    corrupt_landing: test hook applied to the destination state after the write
      (simulates a bad write).

  Returns:
    (dst state, TransferResult). On a mismatch the destination pages may hold
    garbage: the caller must not hand them to the request without a retry.

  Raises:
    ValueError: too few pages on either side for ``length``, or pools whose
      attention kinds or layer counts differ.
  """
  check_pools(src.attention, src.n_layers, dst)
  if length > 0:  # a bad destination fails before anything is gathered
    _check_landing(dst, dst_pages, length, start)
  ex = extract_payload(src, src_pages, length, start=start)
  if dst_mesh is None:
    dev = sorted(dst.page_tags.sharding.device_set, key=lambda d: d.id)
    dst_mesh = Mesh(np.asarray(dev, dtype=object), ("all",))
  payload = jax.device_put(ex.payload, NamedSharding(dst_mesh, PartitionSpec()))
  if corrupt_payload is not None:
    payload = corrupt_payload(payload)
  return land_payload(dst, dst_pages, payload, ex.checksum, length, base=ex.base, start=start,
                      corrupt_landing=corrupt_landing)
