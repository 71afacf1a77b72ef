"""Top-k selection on the Pallas Triton backend: each row's k best positions, ascending.

One program per row (as vLLM's per-row top-k kernel for the DeepSeek-V3.2
indexer: one thread block a row). It finds the row's k-th largest score by a
radix select over order-preserving 32-bit keys, then writes the selected
positions in increasing order:

1. Keys: an f32 score's bits, sign-folded so that unsigned order is float order
   (-inf, the hidden positions, sorts below every finite score).
2. Radix select, 4 bits a round from the top (8 rounds, one pass over the row
   each): count the candidates (keys that match the digits chosen so far) per
   value of the next digit, and keep the highest digit whose candidates at or
   above it reach the rank still wanted. After 8 rounds the prefix is the k-th
   largest key T, and ``need`` is how many keys equal to T to keep.
3. Output pass: a position is selected when its key is above T, or equal to T
   and among the first ``need`` such positions (ties toward the earlier
   position, as ``lax.top_k``); its slot is the running count of selected
   positions (a block-wide cumsum), written with a masked scatter store.

A row with at most k visible (finite) scores keeps them all. 10 passes over
the row's S f32 scores in all (the counts are 16-way compares, no atomics: the
Triton backend has no shared-memory histogram).
"""

from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

_ROUNDS = 8  # 4-bit digits of a 32-bit key
_DIGITS = 16


def _keys(x):
  """Order-preserving uint32 keys of f32 scores: unsigned order == float order."""
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  neg = (bits >> 31) == 1
  return jnp.where(neg, ~bits, bits | jnp.uint32(0x80000000))


def topk_kernel(scores_ref, out_ref, *, k, block):
  """One row's k best positions (ascending, -1 after them).

  Refs:
    scores_ref [S_pad] f32: the row's scores, -inf where hidden (and padding).
    out_ref [K_pad + block] int32: the positions in the first K_pad slots (the
      last block is never written: the masked lanes' addresses).
  """
  s_pad = scores_ref.shape[0]
  k_pad = out_ref.shape[0] - block  # the last block is spare (see emit)
  n_blocks = s_pad // block
  neg_inf_key = jnp.uint32(0x007FFFFF)  # _keys(-inf): hidden positions
  digits = lax.broadcasted_iota(jnp.uint32, (_DIGITS, 1), 0)  # [16, 1]

  def load_keys(i):
    return _keys(scores_ref[pl.ds(i * block, block)])  # [block] uint32

  # Visible positions: how many, so that a row with at most k keeps them all.
  def count_visible(i, n):
    return n + jnp.sum((load_keys(i) > neg_inf_key).astype(jnp.int32))
  visible = lax.fori_loop(0, n_blocks, count_visible, jnp.int32(0))
  want = jnp.minimum(jnp.int32(k), visible)  # rank of the threshold among visible keys

  def one_round(r, carry):
    prefix, need = carry  # digits chosen so far (high bits of the threshold), rank left
    shift = (jnp.uint32(_ROUNDS - 1) - r.astype(jnp.uint32)) * 4  # this digit's position
    # Candidates: keys whose bits above this digit are the prefix (every key in round 0;
    # a shift by 32 is undefined, so round 0's compare is ignored).
    hi_shift = jnp.minimum(shift + 4, jnp.uint32(31))

    def count(i, counts):
      key = load_keys(i)
      match = ((r == 0) | ((key >> hi_shift) == prefix)) & (key > neg_inf_key)
      digit = (key >> shift) & jnp.uint32(_DIGITS - 1)
      hit = (digit[None, :] == digits) & match[None, :]  # [16, block]
      return counts + jnp.sum(hit.astype(jnp.int32), axis=1, keepdims=True)
    counts = lax.fori_loop(0, n_blocks, count, jnp.zeros((_DIGITS, 1), jnp.int32))
    # at_or_above[d] = candidates whose digit >= d.
    above = (lax.broadcasted_iota(jnp.int32, (_DIGITS, _DIGITS), 1)
             >= lax.broadcasted_iota(jnp.int32, (_DIGITS, _DIGITS), 0))
    at_or_above = jnp.sum(jnp.where(above, counts.reshape(1, _DIGITS), 0), axis=1,
                          keepdims=True)  # [16, 1]
    ok = at_or_above >= need
    d = jnp.max(jnp.where(ok, digits.astype(jnp.int32), -1))  # the highest digit that reaches
    d = jnp.maximum(d, 0)  # need == 0 (no visible key): any digit, nothing is selected
    strictly_above = jnp.sum(jnp.where(digits.astype(jnp.int32) > d, counts, 0))
    return (prefix << 4) | d.astype(jnp.uint32), need - strictly_above

  threshold, need = lax.fori_loop(0, _ROUNDS, one_round, (jnp.uint32(0), want))

  # -1 everywhere first; the selected positions then overwrite the first slots.
  def clear(i, c):
    out_ref[pl.ds(i * block, block)] = jnp.full((block,), -1, jnp.int32)
    return c
  lax.fori_loop(0, k_pad // block, clear, 0)

  def emit(i, carry):
    written, ties = carry
    key = load_keys(i)
    pos = i * block + lax.broadcasted_iota(jnp.int32, (block,), 0)
    visible_here = key > neg_inf_key
    eq = (key == threshold) & visible_here
    tie_rank = ties + jnp.cumsum(eq.astype(jnp.int32)) - 1
    sel = visible_here & ((key > threshold) | (eq & (tie_rank < need))) & (want > 0)
    slot = written + jnp.cumsum(sel.astype(jnp.int32)) - 1
    # Unselected lanes aim at distinct slots of the spare block past k_pad, so no two
    # lanes of one store share an address (masked or not).
    lane = lax.broadcasted_iota(jnp.int32, (block,), 0)
    slot = jnp.where(sel, slot, k_pad + lane)
    pltriton.store(out_ref.at[slot], pos, mask=sel)
    return (written + jnp.sum(sel.astype(jnp.int32)), ties + jnp.sum(eq.astype(jnp.int32)))
  lax.fori_loop(0, n_blocks, emit, (jnp.int32(0), jnp.int32(0)))
