"""The device step of speculative decoding: verify drafted tokens, then draft the next ones.

One jitted call serves every row of a speculative engine's step, prefill chunks and
decode rows alike (docs/speculative.md):

1. **Check** the page tags of every page the step touches (``check_lengths``: the
   chunk, plus the positions the drafter writes ahead of it); a failed row gets
   length 0 and neither writes nor reads.
2. **Verify.** The model runs over the row's chunk. A decode row's chunk is its last
   emitted token followed by its ``num_drafts`` drafts; a prefill row's chunk is a
   piece of its prompt with no drafts. The target's logits at the window
   ``[w, w + K]`` (``w = last_index - num_drafts``: the last emitted token's
   position) go to :func:`mlkit.speculative.accept_drafts`, which keeps the longest
   acceptable prefix of drafts and emits one more token: 1 to K+1 tokens per row.
   Greedy rows emit exactly what non-speculative greedy decoding emits.
3. **Draft.** The first multi-token-prediction layer (``mlkit.model.mtp.mtp_paged``)
   runs over the same chunk, reading the model's pre-norm hidden state and the token
   after each position: the chunk's own next token, the prompt's next token given by
   the host (``next_token``) at the end of a prompt piece that is not the last, or
   the token this step emitted. It writes its KV into the pool's drafter layer.
   Its prediction at the last accepted position is draft 1; drafts 2..k come from
   the same layer run one position at a time on its own output (as vLLM drafts past
   the checkpoint's MTP layers). Drafts are the drafter's argmax.

KV written past a row's accepted tokens (rejected drafts; the drafter's look-ahead)
is never read: the next step writes those positions again before it attends to them.
The host advances the row's length by what it emitted only; the row's pages already
hold the look-ahead (``EngineConfig.lookahead``), so no page is returned or rewound.

Shapes: B rows, T chunk tokens, K = ``k`` drafts at most, V vocabulary, D width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mlkit.kvcache import BatchMeta, PagedKVState
from mlkit.model import apply
from mlkit.model.mtp import mtp_paged
from mlkit.quant import matmul
from mlkit.sampling import row_keys, token_logprobs
from mlkit.speculative import accept_drafts
from pallas_kernels.tag_check import tag_check


def speculative_step(params, state: PagedKVState, tokens, positions, block_tables, expected_tags,
                     lengths, check_lengths, last_index, num_drafts, next_token, draft_rows,
                     seeds, sample_steps, temperature, top_k, top_p, *, cfg, page_size: int,
                     k: int, integrity_check: bool, backend, record_logits: bool = False,
                     expert_sharding=None, decode_sharding=None, logprobs: int = 0):
  """One speculative step over B rows (see the module docstring).

  Args:
    params: model params with at least one ``mtp`` layer.
    state: the paged pool, with a drafter layer (``init_paged_state(draft_layers=1)``);
      donated by the jitted form.
    tokens: [B, T] int32 the chunk (a decode row: last emitted token, then its drafts).
    positions: [B, T] int32 absolute positions.
    block_tables / expected_tags: [B, M] int32 the rows' pages and their tags.
    lengths: [B] int32 tokens in the row's cache after the chunk's write (0: padding).
    check_lengths: [B] int32 tokens the row's pages must hold for this step: ``lengths``
      plus the drafter's look-ahead (k - 1 positions past the last accepted one).
    last_index: [B] int32 index in T of the chunk's last token.
    num_drafts: [B] int32 drafts at the end of the chunk (0 for a prefill row).
    next_token: [B] int32 the token after the chunk's last one when the host knows it (a
      prompt piece that is not the prompt's last), else -1 (the step emits it).
    draft_rows: [B] bool rows that draft (rows that emit; not a prompt's inner pieces).
    seeds / sample_steps / temperature / top_k / top_p: [B] sampling, as the plain step's;
      the token emitted at window position j is drawn with key
      ``fold_in(key(seed), sample_steps + j)``.
    cfg, page_size, integrity_check, backend, expert_sharding, decode_sharding: as
      ``mlkit.engine.runner``'s step.
    k: drafts per row (static, >= 1).
    record_logits: also return the target's logits at the window.
    logprobs: L > 0: also return each emitted token's log-probability and the L most
      likely tokens' at its window position (``mlkit.sampling.token_logprobs``).

  Returns:
    (num_accepted [B] int32, emitted [B, K+1] int32 (row b emits
    ``emitted[b, :num_accepted[b] + 1]``; FILL_TOKEN after), drafts [B, k] int32 (the next
    step's drafts), ok [B] bool, state, window logits [B, K+1, V] f32 or None, and
    (token logprob [B, K+1], top ids [B, K+1, L], top logprobs [B, K+1, L]) or None).
  """
  B, T = tokens.shape
  K = k
  if integrity_check:
    ok = tag_check(state.page_tags, block_tables, expected_tags, check_lengths,
                   page_size=page_size, backend=backend)  # [B]
  else:
    ok = jnp.ones((B,), bool)
  lengths = jnp.where(ok, lengths, 0)
  meta = BatchMeta(block_tables=block_tables, lengths=lengths, expected_tags=expected_tags,
                   page_size=page_size)
  # A step of verify rows only (T = K + 1) attends with MLA's absorbed form, as a decode
  # step does: the textbook form expands every cached position's keys and values per head,
  # a temporary that grows with rows x context x heads (docs/speculative.md, "The verify
  # step compiled for an H200"). A step with prompt chunks keeps the form prefill uses.
  mla_mode = "absorbed" if T <= K + 1 else "auto"
  normed, state, pre_norm = apply(params, tokens, positions, state, cfg=cfg, batch_meta=meta,
                                  backend=backend, expert_sharding=expert_sharding,
                                  decode_sharding=decode_sharding, return_hidden=True,
                                  return_pre_norm=True, mla_mode=mla_mode)  # [B, T, D] twice
  # The window: the last emitted token's position w, then its K successors (clipped).
  w = jnp.clip(last_index - num_drafts, 0, T - 1)  # [B]
  win = jnp.minimum(w[:, None] + jnp.arange(K + 1)[None, :], T - 1)  # [B, K+1]
  head = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
  with jax.named_scope("lm_head"):
    logits = matmul(jnp.take_along_axis(normed, win[:, :, None], axis=1), head,
                    out_dtype=jnp.float32, backend=backend)  # [B, K+1, V]
  drafts_in = jnp.take_along_axis(tokens, win[:, 1:], axis=1)  # [B, K]
  keys = jax.vmap(lambda j: row_keys(seeds, sample_steps + j), out_axes=1)(jnp.arange(K + 1))
  n_acc, emitted = accept_drafts(logits, drafts_in, num_drafts, keys, temperature, top_k, top_p)

  # The token after each chunk position, for the drafter: the chunk's next token before
  # the window, the host's (a prompt piece's) or this step's emitted tokens from it on.
  idx = jnp.arange(T)[None, :]  # [1, T]
  shifted = jnp.concatenate([tokens[:, 1:], jnp.zeros((B, 1), tokens.dtype)], axis=1)
  rel = jnp.clip(idx - w[:, None], 0, K)  # [B, T]
  from_step = jnp.take_along_axis(emitted, rel, axis=1)  # [B, T]
  host_next = jnp.where(next_token >= 0, next_token, emitted[:, 0])  # [B]
  after = jnp.where(idx < w[:, None], shifted,
                    jnp.where(idx == w[:, None], host_next[:, None],
                              jnp.where(idx - w[:, None] <= n_acc[:, None], from_step, 0)))
  after = jnp.maximum(after, 0).astype(jnp.int32)  # FILL_TOKEN past the emitted: any id
  last = w + n_acc  # [B] the last accepted position's index in T
  d_logits, d_hidden, state = mtp_paged(params, pre_norm, after, positions, state, cfg=cfg,
                                        batch_meta=meta, backend=backend, logits_index=last,
                                        expert_sharding=expert_sharding,
                                        decode_sharding=decode_sharding, mla_mode=mla_mode)
  draft = jnp.argmax(d_logits[:, 0], axis=-1).astype(jnp.int32)  # [B]
  h = jnp.take_along_axis(d_hidden, last[:, None, None], axis=1)  # [B, 1, D]
  pos = jnp.take_along_axis(positions, last[:, None], axis=1)[:, 0]  # [B]
  drafts = [draft]
  drafting = ok & draft_rows
  # A row that does not draft attends to nothing below (length 0): keep its input finite.
  h = jnp.where(drafting[:, None, None], h, 0)
  for j in range(1, K):
    p = pos + j
    dmeta = BatchMeta(block_tables=block_tables, lengths=jnp.where(drafting, p + 1, 0),
                      expected_tags=expected_tags, page_size=page_size)
    d_logits, h, state = mtp_paged(params, h, draft[:, None], p[:, None], state, cfg=cfg,
                                   batch_meta=dmeta, backend=backend,
                                   expert_sharding=expert_sharding,
                                   decode_sharding=decode_sharding)
    draft = jnp.argmax(d_logits[:, 0], axis=-1).astype(jnp.int32)
    drafts.append(draft)
  lp = None
  if logprobs:
    flat = logits.reshape(B * (K + 1), -1)  # [B (K+1), V]
    lp = token_logprobs(flat, jnp.maximum(emitted, 0).reshape(-1), logprobs)
    lp = tuple(x.reshape(B, K + 1, *x.shape[1:]) for x in lp)
  return (n_acc, emitted, jnp.stack(drafts, axis=1), ok, state,
          logits if record_logits else None, lp)


_STATIC = ("cfg", "page_size", "k", "integrity_check", "backend", "record_logits",
           "expert_sharding", "decode_sharding", "logprobs")
speculative_step_jit = jax.jit(speculative_step, static_argnames=_STATIC,
                               donate_argnames=("state",))
