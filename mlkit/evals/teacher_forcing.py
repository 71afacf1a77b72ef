"""Teacher-forced log-probabilities through the paged KV cache: perplexity and KL.

Sequences are written into a real paged pool (pages from a ``PageAllocator``, a
``BatchMeta`` per batch) in the recipe's KV dtype, and attention reads them back
from the pages, so fp8 KV quantisation is in the path exactly as when serving.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mlkit.config import ModelConfig
from mlkit.kvcache import KVCacheConfig, PageAllocator, init_paged_state, sync_tags
from mlkit.model import apply


@functools.partial(jax.jit, static_argnames=("cfg",))
def _paged_logprobs(params, state, tokens, positions, meta, *, cfg):
  logits, _ = apply(params, tokens, positions, state, cfg=cfg, batch_meta=meta)  # [B, T, V]
  return jax.nn.log_softmax(logits, axis=-1)


def paged_logprobs(params, cfg: ModelConfig, sequences: Sequence[Sequence[int]], *,
                   kv_dtype: str = "bfloat16", page_size: int | None = None,
                   batch_size: int = 8) -> list[np.ndarray]:
  """Next-token log-probabilities of each sequence, prefilled through a paged pool.

  Every batch has the same static shape [batch_size, T] (T = the longest
  sequence rounded up to a page), so one compilation serves the whole call.

  Args:
    params: model params (any weight formats).
    cfg: the model config (its dtype is the compute dtype).
    sequences: token-id lists (each at least 1 token).
    kv_dtype: the pool's storage dtype ("bfloat16", "float8_e4m3fn", "float32").
    page_size: tokens per page (default: the model kind's default).
    batch_size: rows per device call.

  Returns:
    One array [len(seq), V] f32 per sequence: row t is log p(. | seq[:t+1]).

  Raises:
    ValueError: an empty sequence or one longer than cfg.max_seq_len.
  """
  if any(len(s) == 0 for s in sequences):
    raise ValueError("paged_logprobs: empty sequence")
  kv = KVCacheConfig(num_pages=1, page_size=page_size, dtype=kv_dtype).resolve(cfg)
  P = kv.page_size
  T = -(-max(len(s) for s in sequences) // P) * P
  if T > cfg.max_seq_len:
    raise ValueError(f"paged_logprobs: sequences of {T} tokens exceed max_seq_len {cfg.max_seq_len}")
  pages_per_seq = T // P
  kv = KVCacheConfig(num_pages=batch_size * pages_per_seq, page_size=P, dtype=kv_dtype)
  out: list[np.ndarray] = []
  for start in range(0, len(sequences), batch_size):
    chunk = sequences[start:start + batch_size]
    alloc = PageAllocator(kv.num_pages, P)
    tokens = np.zeros((batch_size, T), np.int32)
    ids = []
    for b, s in enumerate(chunk):
      tokens[b, :len(s)] = s
      if alloc.admit(b, len(s)) is not None:  # cannot happen: the pool holds a full batch
        raise RuntimeError("paged_logprobs: pool too small")
      ids.append(b)
    ids += [None] * (batch_size - len(chunk))  # padding rows: length 0, nothing written or read
    meta = alloc.batch_meta(ids, max_pages=pages_per_seq)
    state = sync_tags(init_paged_state(cfg, kv), alloc.device_tags())
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (batch_size, T))
    lp = np.asarray(_paged_logprobs(params, state, jnp.asarray(tokens), jnp.asarray(positions),
                                    meta, cfg=cfg))
    out += [lp[b, :len(s)] for b, s in enumerate(chunk)]
  return out


def token_nll(logprobs: Sequence[np.ndarray], sequences: Sequence[Sequence[int]],
              masks: Sequence[Sequence[int]] | None = None) -> np.ndarray:
  """Negative log-likelihoods of each sequence's next tokens, concatenated.

  Args:
    logprobs: from :func:`paged_logprobs`.
    sequences: the same sequences.
    masks: optional per-token 0/1 lists; token t (t >= 1) counts when masks[t] is 1.

  Returns:
    [N] f64 nats, one per counted target token.
  """
  vals = []
  for lp, s, m in zip(logprobs, sequences, masks or [None] * len(sequences)):
    s = np.asarray(s)
    nll = -lp[np.arange(len(s) - 1), s[1:]]
    if m is not None:
      nll = nll[np.asarray(m[1:], bool)]
    vals.append(nll.astype(np.float64))
  return np.concatenate(vals) if vals else np.zeros(0)


def perplexity(nll: np.ndarray) -> float:
  """exp(mean NLL)."""
  return float(np.exp(np.mean(nll))) if nll.size else float("nan")


def token_kl(ref_logprobs: Sequence[np.ndarray], logprobs: Sequence[np.ndarray],
             masks: Sequence[Sequence[int]] | None = None) -> np.ndarray:
  """Per-token KL(p_ref || p) in nats at every predicting position, concatenated.

  Args:
    ref_logprobs, logprobs: per-sequence [T, V] log-probabilities (same sequences).
    masks: optional per-token 0/1 lists; position t-1 (predicting token t) counts when masks[t] is 1.

  Returns:
    [N] f64 KL values (>= 0 up to rounding).
  """
  vals = []
  for r, q, m in zip(ref_logprobs, logprobs, masks or [None] * len(ref_logprobs)):
    r, q = r[:-1].astype(np.float64), q[:-1].astype(np.float64)
    kl = np.sum(np.exp(r) * (r - q), axis=-1)
    if m is not None:
      kl = kl[np.asarray(m[1:], bool)]
    vals.append(kl)
  return np.concatenate(vals) if vals else np.zeros(0)


def token_top1_correct(logprobs: Sequence[np.ndarray], sequences: Sequence[Sequence[int]],
                       masks: Sequence[Sequence[int]] | None = None) -> np.ndarray:
  """Whether each next token is the model's argmax (teacher-forced top-1), concatenated.

  A finer-grained signal than exact match: an under-trained model that gets whole
  answers wrong still gets most answer tokens right, and precision recipes move it.

  Args:
    logprobs, sequences, masks: as for :func:`token_nll`.

  Returns:
    [N] bool, one per counted target token.
  """
  vals = []
  for lp, s, m in zip(logprobs, sequences, masks or [None] * len(sequences)):
    s = np.asarray(s)
    hit = np.argmax(lp[:-1], axis=-1) == s[1:]
    if m is not None:
      hit = hit[np.asarray(m[1:], bool)]
    vals.append(hit)
  return np.concatenate(vals) if vals else np.zeros(0, bool)
