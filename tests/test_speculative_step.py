"""Speculative decoding's device step (mlkit.engine.speculative_step), driven by a small host loop.

Each row holds its own pages; the loop prefills the prompts in one chunk, then runs
verify steps of the last emitted token and k drafts, keeps what the step accepted
and rewinds the rest, as the engine's host side will. Checked, in f32:

* greedy tokens equal ``mlkit.generate``'s for k = 1, 2, 3, with the MTP layer's own
  drafts (which a random model mostly rejects) and with drafts from the reference
  continuation (all accepted; one spoiled draft stops the acceptance there);
* the drafter's KV in the pool stays right through rejections: after every step its
  draft is what the cache-free MTP layer (``mtp_forward``) predicts over the whole
  accepted sequence;
* a row whose page tag fails emits nothing usable and leaves the other rows' tokens
  unchanged.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from configs import TINY_MLA
from mlkit.engine.speculative_step import speculative_step_jit
from mlkit.generate import generate
from mlkit.kvcache import KVCacheConfig, init_paged_state
from mlkit.model import apply, mtp_forward
from mlkit.sampling import SamplingParams
from numpy_params import init_params_np

# One dense layer, one MoE layer, one MTP layer (MoE); f32.
CFG = dataclasses.replace(TINY_MLA, n_layers=2)
PAGE, PAGES_PER_ROW = 4, 12
PROMPT_T = 16  # the prefill chunk bucket
N_NEW = 14
PROMPTS = [np.random.default_rng(7).integers(0, CFG.vocab_size, n).tolist() for n in (11, 6, 9)]
B = len(PROMPTS)
TAG = 5
# test_drafter_kv_stays_right_through_rejections's (k, spoil) cases.
DRAFTER_CASES = ((2, None), (3, None), (3, 1), (3, "all"))
K_CASES = tuple(k for k, _ in DRAFTER_CASES)


class _Rows:
  """Per-row pages [1 + b * PAGES_PER_ROW, ...) and a host loop over the speculative step."""

  def __init__(self, params, k: int):
    self.params, self.k = params, k
    self.state = init_paged_state(CFG, KVCacheConfig(1 + B * PAGES_PER_ROW, PAGE, "float32"),
                                  draft_layers=1)
    tags = self.state.page_tags  # filled on the host: an eager fill compiles a program
    self.state = self.state.replace(page_tags=jnp.asarray(np.full(tags.shape, TAG, tags.dtype)))
    self.tables = 1 + np.arange(B * PAGES_PER_ROW, dtype=np.int32).reshape(B, PAGES_PER_ROW)
    self.tags = np.full((B, PAGES_PER_ROW), TAG, np.int32)

  def run(self, tokens, positions, lengths, last_index, num_drafts, sample_steps):
    zeros = np.zeros(B, np.float32)
    out = speculative_step_jit(
        self.params, self.state, tokens, positions, self.tables, self.tags, lengths,
        lengths + self.k, last_index, num_drafts, np.full(B, -1, np.int32), np.ones(B, bool),
        np.arange(B, dtype=np.uint32), sample_steps, zeros, np.zeros(B, np.int32),
        np.ones(B, np.float32), cfg=CFG, page_size=PAGE, k=self.k, integrity_check=True,
        backend="xla")
    n_acc, emitted, drafts, ok, self.state, _, _ = out
    return np.asarray(n_acc), np.asarray(emitted), np.asarray(drafts), np.asarray(ok)


def spec_generate(params, k: int, draft_source=None, spoil=None, on_step=None, bad_row=None):
  """Greedy speculative generation of N_NEW tokens per prompt.

  Args:
    draft_source: None (the MTP layer's drafts), or per row a continuation whose next
      k tokens replace them (drafts from the reference: all acceptable).
    spoil: with ``draft_source``, the draft index set to a wrong token each step.
    on_step: called with (outputs, n_acc, drafts) after each step.
    bad_row: this row's page tags are wrong from the first verify step on.

  Returns:
    (outputs per row, accepted counts per verify step [steps, B], ok per step).
  """
  rows = _Rows(params, k)
  lens = np.array([len(p) for p in PROMPTS], np.int32)
  toks = np.zeros((B, PROMPT_T), np.int32)
  for b, p in enumerate(PROMPTS):
    toks[b, :len(p)] = p
  pos = np.broadcast_to(np.arange(PROMPT_T, dtype=np.int32), (B, PROMPT_T)).copy()
  n_acc, emitted, drafts, ok = rows.run(toks, pos, lens, lens - 1, np.zeros(B, np.int32),
                                        np.zeros(B, np.int32))
  outs = [[int(emitted[b, 0])] for b in range(B)]
  if on_step:
    on_step(outs, n_acc, drafts)
  accepted, oks = [], [ok]
  if bad_row is not None:
    rows.tags[bad_row, 0] = TAG + 1
  while min(len(o) for o in outs) < N_NEW:
    if draft_source is not None:
      drafts = np.array([draft_source[b][len(outs[b]):len(outs[b]) + k]
                         + [0] * (k - len(draft_source[b][len(outs[b]):len(outs[b]) + k]))
                         for b in range(B)], np.int32)
      if spoil is not None:
        drafts[:, spoil] = (drafts[:, spoil] + 1) % CFG.vocab_size
    L = np.array([len(PROMPTS[b]) + len(outs[b]) for b in range(B)], np.int32)
    vt = np.concatenate([np.array([[o[-1]] for o in outs], np.int32), drafts], axis=1)
    vp = (L - 1)[:, None] + np.arange(k + 1, dtype=np.int32)[None, :]
    steps = np.array([len(o) for o in outs], np.int32)
    n_acc, emitted, drafts, ok = rows.run(vt, vp, L + k, np.full(B, k, np.int32),
                                          np.full(B, k, np.int32), steps)
    for b in range(B):
      outs[b] += emitted[b, :n_acc[b] + 1].tolist()
    accepted.append(n_acc)
    oks.append(ok)
    if on_step:
      on_step(outs, n_acc, drafts)
  return [o[:N_NEW] for o in outs], np.array(accepted), np.array(oks)


class SpeculativeStepTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.params = jax.tree.map(jnp.asarray, init_params_np(CFG, seed=3, mtp=()))
    ref = generate(cls.params, CFG, PROMPTS, SamplingParams(max_new_tokens=N_NEW + 4))
    cls.ref = [t[:N_NEW + 4] for t in ref.tokens]

  def _ref(self):
    return [r[:N_NEW] for r in self.ref]

  @parameterized.parameters(1, 2, 3)
  def test_greedy_equals_plain_decoding_with_mtp_drafts(self, k):
    outs, accepted, oks = spec_generate(self.params, k)
    self.assertEqual(outs, self._ref())
    self.assertTrue(oks.all())
    self.assertTrue(((accepted >= 0) & (accepted <= k)).all())

  @parameterized.parameters(1, 3)
  def test_reference_drafts_are_all_accepted(self, k):
    outs, accepted, _ = spec_generate(self.params, k, draft_source=self.ref)
    self.assertEqual(outs, self._ref())
    self.assertTrue((accepted == k).all(), accepted)

  def test_a_spoiled_draft_stops_the_acceptance_there(self):
    outs, accepted, _ = spec_generate(self.params, 3, draft_source=self.ref, spoil=1)
    self.assertEqual(outs, self._ref())
    self.assertTrue((accepted == 1).all(), accepted)

  @parameterized.parameters(*DRAFTER_CASES)
  def test_drafter_kv_stays_right_through_rejections(self, k, spoil):
    """After every step, the draft is the cache-free MTP layer's argmax over the whole
    accepted sequence (a draft within 1e-4 of the best logit counts: ties). The steps
    verify the MTP layer's drafts (all rejected: random weights), or the reference's with
    draft ``spoil`` spoiled (some accepted), or all of them ("all")."""
    checked = []
    fwd = jax.jit(apply, static_argnames=("cfg", "return_pre_norm"))
    mtp = jax.jit(mtp_forward, static_argnames=("cfg", "depth"))

    # Every sequence, right-padded (causal: exact before) to one width for every k (room for
    # the largest k's overshoot), so that each case runs the same two compiled programs.
    W = PROMPT_T + N_NEW + 2 * max(K_CASES)

    def on_step(outs, n_acc, drafts):
      seqs = [PROMPTS[b] + outs[b] for b in range(B)]  # the last token: the step's last
      toks, after = np.zeros((B, W), np.int32), np.zeros((B, W), np.int32)
      for b, seq in enumerate(seqs):
        toks[b, :len(seq) - 1], after[b, :len(seq) - 1] = seq[:-1], seq[1:]
      pos = np.broadcast_to(np.arange(W, dtype=np.int32), (B, W))  # host: no program
      _, _, hidden = fwd(self.params, jnp.asarray(toks), pos, None, cfg=CFG,
                         return_pre_norm=True)
      logits, _ = mtp(self.params, hidden, jnp.asarray(after), cfg=CFG, depth=1, positions=pos)
      logits = np.asarray(logits)  # rows read on the host: a device index compiles a program
      for b, seq in enumerate(seqs):
        row = logits[b, len(seq) - 2]
        self.assertGreater(row[drafts[b, 0]], row.max() - 1e-4, (b, len(seq)))
        checked.append(b)

    kw = {}
    if spoil is not None:
      kw = dict(draft_source=self.ref, spoil=None if spoil == "all" else spoil)
    outs, accepted, _ = spec_generate(self.params, k, on_step=on_step, **kw)
    self.assertEqual(outs, self._ref())
    self.assertTrue((accepted == (0 if spoil is None else k if spoil == "all" else spoil)).all())
    self.assertGreater(len(checked), 3 * B)

  def test_a_failed_tag_check_touches_only_its_row(self):
    outs, _, oks = spec_generate(self.params, 2, draft_source=self.ref, bad_row=1)
    self.assertTrue(oks[0].all())
    self.assertFalse(oks[1:, 1].any())
    self.assertTrue(oks[1:, [0, 2]].all())
    ref = self._ref()
    self.assertEqual(outs[0], ref[0])
    self.assertEqual(outs[2], ref[2])


if __name__ == "__main__":
  absltest.main()
