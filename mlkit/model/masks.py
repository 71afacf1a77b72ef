"""Attention masks kept factored: which keys each query may see, without a [B, T, S] array.

Every mask a cache or the cache-free forward produces has the same form: query t
of row b sees key s iff the key's position is at most the query's, both lie in
the same segment (packed rows only), and, where one is given, an extra dense
mask allows it (the sparse-attention selection). Kept as the [B, T] query-side
and [B, S] key-side vectors, a long prefill never builds the whole [B, T, S]
mask: ``map_query_blocks`` builds it one query block at a time, inside the loop
that attends that block. Built whole and shared by every layer, XLA's GPU
compiler also materialised the two int32 operands of its compare, broadcast to
[B, T, S]: about 1.1 GB per GPU beside the 134 MB mask in an 8192-token prefill
over 16K keys (docs/serving_step_memory.md).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

# A key position no query reaches: the cache slots past a request's length.
HIDDEN = jnp.iinfo(jnp.int32).max


@struct.dataclass
class KeyMask:
  """Query t of row b sees key s iff ``key_pos[b, s] <= query_pos[b, t]``, the
  segments match (when given) and ``also[b, t, s]`` (when given).

  Attributes:
    query_pos: [B, T] int32, each query's position.
    key_pos: [B, S] int32, each key's position; ``HIDDEN`` for a key no query may see.
    query_seg, key_seg: [B, T] and [B, S] segment ids of packed rows, or both None.
    also: [B, T, S] bool, a further mask ANDed in, or None.
  """

  query_pos: jax.Array
  key_pos: jax.Array
  query_seg: jax.Array | None = None
  key_seg: jax.Array | None = None
  also: jax.Array | None = None

  @property
  def shape(self) -> tuple[int, int, int]:
    """(B, T, S), the shape of :meth:`dense`."""
    B, T = self.query_pos.shape
    return (B, T, self.key_pos.shape[1])

  def dense(self) -> jax.Array:
    """The mask as [B, T, S] bool."""
    mask = self.key_pos[:, None, :] <= self.query_pos[:, :, None]
    if self.query_seg is not None:
      mask &= self.key_seg[:, None, :] == self.query_seg[:, :, None]
    if self.also is not None:
      mask &= self.also
    return mask

  def __and__(self, other: jax.Array) -> "KeyMask":
    """This mask narrowed by a dense [B, T, S] bool mask."""
    if tuple(other.shape) != self.shape:
      raise ValueError(f"cannot narrow a {self.shape} mask by one of shape {tuple(other.shape)}")
    return self.replace(also=other if self.also is None else self.also & other)


def causal_mask(query_pos: jax.Array, S: int, lengths: jax.Array | None = None,
                key_pos: jax.Array | None = None, query_seg: jax.Array | None = None,
                key_seg: jax.Array | None = None) -> KeyMask:
  """The causal mask over S keys, key slot s at position s unless ``key_pos`` says otherwise.

  Args:
    query_pos: [B, T] int32.
    S: keys.
    lengths: [B] int32: slots at or past a row's length are hidden (a paged
      request's pages past its tokens), or None.
    key_pos: [B, S] int32 key positions (default: the slot index).
    query_seg, key_seg: segment ids of packed rows, or None.
  """
  B = query_pos.shape[0]
  if key_pos is None:
    key_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[None], (B, S))
  key_pos = key_pos.astype(jnp.int32)
  if lengths is not None:
    slots = jnp.arange(S, dtype=jnp.int32)[None]
    key_pos = jnp.where(slots < lengths[:, None], key_pos, HIDDEN)
  return KeyMask(query_pos=query_pos.astype(jnp.int32), key_pos=key_pos,
                 query_seg=query_seg, key_seg=key_seg)


def dense(mask: KeyMask | jax.Array) -> jax.Array:
  """[B, T, S] bool from a :class:`KeyMask` or an array that already is one."""
  return mask.dense() if isinstance(mask, KeyMask) else mask


def map_query_blocks(fn: Callable, queries: tuple, mask: KeyMask | jax.Array,
                     block: int) -> jax.Array:
  """``fn(*queries, mask)`` over blocks of at most ``block`` queries, one after another.

  Each block's mask is built inside the loop from the query-side vectors, so
  no [B, T, S] array exists when ``mask`` is a :class:`KeyMask`. The blocks are
  independent, so the result equals ``fn`` over all T queries at once.

  Args:
    fn: (*queries [B, t, ...], mask [B, t, S] bool) -> [B, t, ...].
    queries: arrays [B, T, ...] split along T.
    mask: [B, T, S]: a :class:`KeyMask` or a bool array.
    block: queries per block.

  Returns:
    ``fn``'s result for all T queries, [B, T, ...].
  """
  B, T, S = mask.shape
  if T <= block:
    return fn(*queries, dense(mask))
  n = -(-T // block)

  def blocks(x, fill=0):  # [B, T, ...] -> [n, B, block, ...]; padded queries see no key
    x = jnp.pad(x, [(0, 0), (0, n * block - T)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return jnp.moveaxis(x.reshape(B, n, block, *x.shape[2:]), 1, 0)

  if isinstance(mask, KeyMask):
    # The key-side vectors are the same for every block; only the query side is split.
    side = {"query_pos": blocks(mask.query_pos, fill=-1)}
    if mask.query_seg is not None:
      side["query_seg"] = blocks(mask.query_seg)
    if mask.also is not None:
      side["also"] = blocks(mask.also, fill=False)
    block_mask = lambda s: mask.replace(**s).dense()
  else:
    side = blocks(mask, fill=False)
    block_mask = lambda s: s
  q_blocks = tuple(blocks(q) for q in queries)  # each [n, B, block, ...]

  def one(i):
    take = lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False)
    return fn(*map(take, q_blocks), block_mask(jax.tree.map(take, side)))

  out_aval = jax.eval_shape(one, 0)  # [B, block, ...]
  # The loop's output buffer starts as one of the queries' values broadcast, not as
  # zeros: a constant buffer has no inputs, and XLA fuses every layer's into one
  # computation at the start of the step, so all of them would stay live through the
  # whole step (16 MiB a layer in Kimi K2.6's prefill; docs/serving_step_memory.md).
  # Tied to this layer's queries, it exists only while the layer runs. Not zeros behind
  # an optimization_barrier with the queries: XLA shares one zero broadcast among every
  # layer's barrier, which then lives through the step (quant.dispatch's block loop had
  # that). Not zeros times the value: for a bool output (the sparse-attention indexer's
  # selection) XLA folds false AND x to the constant false, and the tie is lost (24 MiB
  # a layer in GLM 5.2's prefill). Every block is written, so the buffer's values never
  # matter. The value is indexed, not read from a flattened query: under tensor
  # parallelism flattening a head-split query made XLA all-gather every head of it to
  # read one element (134 MB a layer in Kimi K2.6's prefill).
  tie = q_blocks[0][(0,) * q_blocks[0].ndim].astype(out_aval.dtype)
  out = jnp.broadcast_to(tie, (n,) + out_aval.shape)
  out = jax.lax.fori_loop(
      0, n, lambda i, out: jax.lax.dynamic_update_index_in_dim(out, one(i), i, 0), out)
  out = jnp.moveaxis(out, 0, 1)  # [B, n, block, ...]
  return out.reshape(B, n * block, *out.shape[3:])[:, :T]
