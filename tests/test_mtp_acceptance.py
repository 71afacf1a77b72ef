"""Depth-1 MTP draft acceptance measured over greedy continuations (mlkit.evals.mtp_acceptance):
the k = 1 walk, the draft indexing against mtp_forward_all's own shift, skipped rows, errors."""

import dataclasses
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from configs import TINY_MLA
from mlkit.evals import mtp_acceptance as ma
from mlkit.generate import generate
from mlkit.model import apply, mtp_forward_all
from mlkit.sampling import SamplingParams
from numpy_params import init_params_np

# One dense layer, one MoE layer, one MTP layer, f32.
CFG = dataclasses.replace(TINY_MLA, n_layers=2)


@functools.cache
def _depth_one_argmax():
  """(params, toks [B, T] int32) -> depth 1's argmax [B, T]: apply then mtp_forward_all in one
  jitted program (op by op, each of their ops would be an XLA compile of its own)."""

  @jax.jit
  def f(params, toks):
    pos = jnp.broadcast_to(jnp.arange(toks.shape[1], dtype=jnp.int32), toks.shape)
    _, _, hidden = apply(params, toks, pos, cfg=CFG, return_pre_norm=True)
    logits = mtp_forward_all(params, hidden, toks, cfg=CFG, positions=pos)
    return jnp.argmax(logits[0], -1)

  return f


class WalkTest(parameterized.TestCase):

  @parameterized.named_parameters(
      # name, agree at positions P.., P, T, (steps, tokens, accepted)
      ("none", [0, 0, 0, 0], 2, 6, (3, 3, 0)),
      ("all_even_end", [1, 1, 1, 1, 1], 2, 7, (2, 4, 2)),
      # The last step can only emit the final token: its draft has no bonus after it.
      ("all_odd_end", [1, 1, 1, 1], 2, 6, (2, 3, 1)),
      ("mixed", [1, 0, 0, 1, 0, 0], 3, 9, (3, 5, 2)),
      ("one_token", [], 4, 5, (0, 0, 0)))
  def test_walk(self, agree_tail, prompt_len, total, want):
    agree = [False] * prompt_len + [bool(a) for a in agree_tail]
    agree += [False] * (total - len(agree))
    self.assertEqual(ma.walk(agree, prompt_len, total), want)

  def test_tokens_are_the_continuation_after_prefill(self):
    rng = np.random.default_rng(0)
    for _ in range(50):
      P, T = int(rng.integers(1, 5)), int(rng.integers(6, 20))
      agree = rng.random(T) < 0.6
      steps, tokens, accepted = ma.walk(agree, P, T)
      self.assertEqual(tokens, T - 1 - P)  # every token after the first, exactly once
      self.assertEqual(tokens, steps + accepted)


class DraftIndexingTest(absltest.TestCase):
  """measure's agreement indexing on drafts that agree where the test says: the forward
  and the drafter are replaced by arrays laid out as ``_forward_and_drafts`` returns them."""

  def test_the_draft_for_token_j_plus_1_comes_from_position_j_minus_1(self):
    s = list(range(10, 20))  # [T = 10]: distinct tokens, so a shifted comparison never agrees
    P, T = 3, len(s)
    greedy = np.array(s[1:] + [0], np.int32)  # argmax at j is s[j + 1]: every row is used
    drafts = np.full(T - 1, 99, np.int32)  # depth 1 at i drafts s[i + 2]; 99 never does
    drafts[2], drafts[5] = s[4], s[7]  # the steps whose newest tokens are s[3] and s[6] agree
    with mock.patch.object(ma, "_forward_and_drafts", lambda *_: (greedy, drafts)):
      r = ma.measure({"mtp": [{}]}, CFG, [s], [P])
    # Walk: s[3] emits s[4], s[5]; s[5] emits s[6]; s[6] emits s[7], s[8]; s[8] emits s[9].
    self.assertEqual((r.drafts, r.drafts_agreeing), (T - 1 - P, 2))
    self.assertEqual((r.steps, r.tokens, r.accepted_hist), (4, 6, (2, 2)))
    self.assertEqual((r.rows_used, r.rows_skipped), (1, 0))


class MeasureTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.params = init_params_np(CFG, seed=3, mtp=())
    rng = np.random.default_rng(5)
    # One prompt length: every row is as long, so each jitted function compiles once.
    cls.prompts = [rng.integers(3, CFG.vocab_size, 6).tolist() for _ in range(3)]
    out = generate(cls.params, CFG, cls.prompts, SamplingParams(max_new_tokens=6)).tokens
    cls.seqs = [p + list(o) for p, o in zip(cls.prompts, out)]

  def test_drafts_are_depth_one_at_the_previous_position(self):
    r = ma.measure(self.params, CFG, self.seqs, [len(p) for p in self.prompts])
    self.assertEqual((r.rows_used, r.rows_skipped), (3, 0))
    # Independently: mtp_forward_all shifts the tokens itself; depth 1 at position i
    # predicts t_{i+2}, so the draft for s[j+1] is its argmax at j-1.
    toks = np.asarray(self.seqs, np.int32)  # [3, T]
    argmax = np.asarray(_depth_one_argmax()(self.params, toks))  # [3, T]
    agreeing = drafts = 0
    for b, (seq, P) in enumerate(zip(self.seqs, map(len, self.prompts))):
      d = argmax[b]
      # The drafts measure reads are depth 1's argmax at the same positions, value by value
      # (the random model's drafts rarely agree with its tokens, so the counts below alone
      # would pass with most indexings; DraftIndexingTest pins the indexing of agreement).
      _, measured = ma._forward_and_drafts(self.params, jnp.asarray([seq], jnp.int32), CFG)
      np.testing.assert_array_equal(np.asarray(measured), d[:len(seq) - 1])
      for j in range(P, len(seq) - 1):
        drafts += 1
        agreeing += int(d[j - 1] == seq[j + 1])
    self.assertEqual((r.drafts, r.drafts_agreeing), (drafts, agreeing))
    self.assertEqual(r.tokens, sum(len(s) - 1 - len(p) for s, p in zip(self.seqs, self.prompts)))
    self.assertEqual(sum(r.accepted_hist), r.steps)
    self.assertEqual(r.tokens, r.steps + r.accepted_hist[1])

  def test_a_continuation_the_model_would_not_decode_is_skipped(self):
    bad = list(self.seqs[0])
    bad[-1] = (bad[-1] + 1) % CFG.vocab_size
    r = ma.measure(self.params, CFG, [bad, self.seqs[1]], [len(self.prompts[0]),
                                                           len(self.prompts[1])])
    self.assertEqual((r.rows_used, r.rows_skipped), (1, 1))

  def test_errors(self):
    no_mtp = {k: v for k, v in self.params.items() if k != "mtp"}
    with self.assertRaisesRegex(ValueError, "no MTP layer"):
      ma.measure(no_mtp, CFG, self.seqs, [6, 6, 6])
    with self.assertRaisesRegex(ValueError, "leaves no continuation"):
      ma.measure(self.params, CFG, [self.seqs[0]], [len(self.seqs[0])])
    with self.assertRaisesRegex(ValueError, "3 sequences, 2 prompt lengths"):
      ma.measure(self.params, CFG, self.seqs, [6, 6])


if __name__ == "__main__":
  absltest.main()
