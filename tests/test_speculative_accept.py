"""Speculative decoding's acceptance rule (mlkit.speculative.accept_drafts).

Greedy rows are checked token for token against the argmax. Sampled rows are checked
statistically: thousands of rows in one call share fixed target logits (which then do
not depend on the drafted prefix), and the emitted tokens' frequencies must match the
target distribution, computed here independently in numpy (temperature, top-k, top-p),
by a chi-squared test. Negative controls show that the same test rejects two wrong rules.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from mlkit.sampling import row_keys
from mlkit.speculative import FILL_TOKEN, accept_drafts
from host_data import softmax
from host_data import put

accept_jit = jax.jit(accept_drafts)

# A chi-squared p-value below this fails. Seeds are fixed, so each check is deterministic.
P_MIN = 1e-3


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _keys(B, K1, seed=0):
  """[B, K+1] keys as the engine would make them: row b's key for token index j.

  Jitted: one program per shape, where the eager ops would compile one each."""
  seeds = jnp.arange(B, dtype=jnp.uint32) + jnp.uint32(seed)
  return jax.vmap(lambda j: row_keys(seeds, j), out_axes=1)(jnp.arange(K1))


def _rows(B, temperature, top_k=0, top_p=1.0):
  return put(np.full((B,), temperature, np.float32), np.full((B,), top_k, np.int32),
             np.full((B,), top_p, np.float32))


def _target_probs(logits, temperature, top_k, top_p):
  """numpy (f64) reference of the sampling distribution: [..., V] logits -> probabilities."""
  z = np.asarray(logits, np.float64) / temperature
  order = np.argsort(-z, axis=-1)
  z_sorted = np.take_along_axis(z, order, axis=-1)
  p_sorted = np.exp(z_sorted - z_sorted[..., :1])
  p_sorted /= p_sorted.sum(-1, keepdims=True)
  keep = (np.cumsum(p_sorted, -1) - p_sorted) < top_p
  if top_k:
    keep[..., top_k:] = False
  keep[..., 0] = True
  p = np.zeros_like(z)
  np.put_along_axis(p, order, np.where(keep, p_sorted, 0.0), axis=-1)
  return p / p.sum(-1, keepdims=True)


def _chi2_pvalue(samples, p):
  """p-value of token ids against probabilities p [V]; tokens with p = 0 must not occur."""
  V = p.shape[0]
  counts = np.bincount(samples, minlength=V)
  support = p > 0
  assert counts[~support].sum() == 0, f"tokens outside the target's support: {counts}, p={p}"
  observed = counts[support]
  expected = p[support] / p[support].sum() * observed.sum()
  # Imported here, not at the top: scipy.stats takes about a second to import, which each
  # test worker would pay while collecting this file, whichever runs it.
  try:
    from scipy import stats
  except ImportError:  # the venv has scipy; this keeps the test meaningful without it.
    stats = None
  if stats is not None:
    return float(stats.chisquare(observed, expected).pvalue)
  # Without scipy: compare the statistic to the 1e-3 critical values (df 1..4) instead.
  chi2 = float(((observed - expected) ** 2 / expected).sum())
  critical = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467}[support.sum() - 1]
  return 1.0 if chi2 < critical else 0.0


class GreedyTest(parameterized.TestCase):
  B, K, V = 8, 4, 50
  # (num_drafts, length of the drafted prefix that matches the argmax)
  CASES = [(4, 0), (4, 2), (4, 4), (3, 1), (2, 2), (0, 3), (1, 0), (1, 1)]

  def _batch(self, seed):
    B, K, V = self.B, self.K, self.V
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((B, K + 1, V)).astype(np.float32)
    argmax = logits.argmax(-1)
    drafts = rng.integers(0, V, (B, K))
    num_drafts = np.array([nd for nd, _ in self.CASES], np.int32)
    want_n = np.zeros(B, np.int32)
    want = np.full((B, K + 1), FILL_TOKEN, np.int32)
    for b, (nd, match) in enumerate(self.CASES):
      drafts[b, :match] = argmax[b, :match]
      if match < K:  # the first mismatch: any token but the argmax
        drafts[b, match] = (argmax[b, match] + 1 + rng.integers(0, V - 1)) % V
      # Drafts past num_drafts are ignored, whatever they hold (even non-token values).
      drafts[b, nd:] = rng.choice([-7, V + 3, 0], K - nd)
      n = min(nd, match)
      want_n[b] = n
      want[b, :n] = argmax[b, :n]
      want[b, n] = argmax[b, n]
    return (*put(logits, drafts.astype(np.int32), num_drafts), want_n, want)

  @parameterized.named_parameters(("one_hot_drafter", False), ("draft_probs", True))
  def test_accepts_the_argmax_prefix_then_emits_the_argmax(self, with_probs):
    B, K, V = self.B, self.K, self.V
    logits, drafts, num_drafts, want_n, want = self._batch(seed=1)
    probs = (put(softmax(np.random.default_rng(2).standard_normal((B, K, V)).astype(np.float32)))
             if with_probs else None)
    n, tokens = accept_jit(logits, drafts, num_drafts, _keys(B, K + 1), *_rows(B, 0.0, 5, 0.5),
                           probs)
    np.testing.assert_array_equal(n, want_n)
    np.testing.assert_array_equal(tokens, want)
    self.assertEqual((n.dtype, tokens.dtype), (jnp.int32, jnp.int32))
    # num_drafts = 0 is plain greedy decoding: the argmax at position 0.
    zero = np.asarray(num_drafts) == 0
    np.testing.assert_array_equal(np.asarray(tokens)[zero, 0],
                                  np.asarray(logits).argmax(-1)[zero, 0])

  def test_greedy_rows_are_unchanged_by_sampled_rows_in_the_batch(self):
    # An all-greedy batch skips the filters on CPU (a lax.cond, as in sample_tokens); a mixed
    # batch runs them, and must give greedy rows the same result.
    B, K = self.B, self.K
    logits, drafts, num_drafts, want_n, want = self._batch(seed=3)
    temperature = put(np.asarray([0.0, 1.0] * (B // 2), np.float32))
    _, top_k, top_p = _rows(B, 0.0)
    n, tokens = accept_jit(logits, drafts, num_drafts, _keys(B, K + 1), temperature, top_k,
                           top_p, None)
    greedy = np.asarray(temperature) == 0
    np.testing.assert_array_equal(np.asarray(n)[greedy], want_n[greedy])
    np.testing.assert_array_equal(np.asarray(tokens)[greedy], want[greedy])
    # Sampled rows emit n+1 real tokens, then fill.
    n, tokens, num_drafts = np.asarray(n), np.asarray(tokens), np.asarray(num_drafts)
    for b in np.flatnonzero(~greedy):
      self.assertTrue(0 <= n[b] <= num_drafts[b])
      self.assertTrue(np.all(tokens[b, :n[b] + 1] >= 0))
      np.testing.assert_array_equal(tokens[b, :n[b]], np.asarray(drafts)[b, :n[b]])
      self.assertTrue(np.all(tokens[b, n[b] + 1:] == FILL_TOKEN))

  def test_no_draft_positions(self):
    # K = 0: the target step is one ordinary decode step.
    logits = np.random.default_rng(4).standard_normal((3, 1, 20)).astype(np.float32)
    n, tokens = accept_drafts(put(logits), put(np.zeros((3, 0), np.int32)),
                              put(np.zeros((3,), np.int32)), _keys(3, 1), *_rows(3, 0.0), None)
    np.testing.assert_array_equal(n, [0, 0, 0])
    np.testing.assert_array_equal(np.asarray(tokens)[:, 0], logits[:, 0].argmax(-1))


class SampledTest(parameterized.TestCase):
  K, V = 2, 5
  N = 12000  # rows per sampling setting
  # (temperature, top_k, top_p): plain, a sharper top-k and a flatter top-p distribution.
  SETTINGS = [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.5, 0, 0.8)]

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    K, V, N = cls.K, cls.V, cls.N
    rng = np.random.default_rng(2023)
    cls.logits = (1.5 * rng.standard_normal((K + 1, V))).astype(np.float32)  # per position
    cls.q = rng.dirichlet(np.full(V, 0.7), K)  # [K, V] the drafter's distributions
    cls.p = [_target_probs(cls.logits, *s) for s in cls.SETTINGS]  # each [K+1, V]
    S = len(cls.SETTINGS)
    cls.B = B = S * N
    cls.setting = np.repeat(np.arange(S), N)  # [B]
    # Each row drafts 0, 1 or 2 tokens: the emitted tokens' law must not depend on it. Most
    # draft 2, so that enough rows reach the bonus position.
    cls.num_drafts = rng.choice(K + 1, B, p=[0.2, 0.2, 0.6]).astype(np.int32)
    cls.sampled_drafts = np.stack([rng.choice(V, B, p=cls.q[j]) for j in range(K)], 1)
    # A deterministic drafter's fixed drafts: the likeliest token first (accepted often), then
    # on even rows the least likely one (dropped by the filters of two settings, so never
    # accepted there), on odd rows the likeliest.
    order = np.argsort(cls.logits, -1)
    cls.fixed_drafts = np.stack([np.full(B, order[0, -1]),
                                 np.where(np.arange(B) % 2 == 0, order[1, 0], order[1, -1])], 1)
    t, k, p = (np.array([s[i] for s in cls.SETTINGS])[cls.setting] for i in range(3))
    cls.args = dict(target_logits=put(np.ascontiguousarray(np.broadcast_to(cls.logits,
                                                                           (B, K + 1, V)))),
                    num_drafts=put(cls.num_drafts), keys=_keys(B, K + 1, 11),
                    temperature=put(t.astype(np.float32)), top_k=put(k.astype(np.int32)),
                    top_p=put(p.astype(np.float32)))

  def _run(self, with_probs):
    drafts = self.sampled_drafts if with_probs else self.fixed_drafts
    probs = (put(np.broadcast_to(self.q, (self.B, self.K, self.V)).astype(np.float32))
             if with_probs else None)
    n, tokens = accept_jit(draft_tokens=put(drafts.astype(np.int32)), draft_probs=probs,
                           **self.args)
    return np.asarray(n), np.asarray(tokens)

  def _check_structure(self, n, tokens, drafts):
    self.assertTrue(np.all((n >= 0) & (n <= self.num_drafts)))
    pos = np.arange(self.K + 1)[None]
    accepted = pos < n[:, None]
    np.testing.assert_array_equal(tokens[:, :self.K][accepted[:, :self.K]],
                                  drafts[accepted[:, :self.K]])
    self.assertTrue(np.all(tokens[pos > n[:, None]] == FILL_TOKEN))
    self.assertTrue(np.all((tokens[pos <= n[:, None]] >= 0) & (tokens[pos <= n[:, None]] < self.V)))

  @parameterized.named_parameters(("draft_probs", True), ("one_hot_drafter", False))
  def test_emitted_tokens_follow_the_target_distribution(self, with_probs):
    n, tokens = self._run(with_probs)
    drafts = self.sampled_drafts if with_probs else self.fixed_drafts
    self._check_structure(n, tokens, drafts)
    for s, setting in enumerate(self.SETTINGS):
      rows = self.setting == s
      # Token j is emitted when the drafts before it were accepted (n >= j). The target
      # logits do not depend on the prefix here, so given that, it must follow p_j: through
      # acceptance, the residual after a rejection, or the bonus when all were accepted.
      for j in range(self.K + 1):
        emitted = rows & (n >= j)
        self.assertGreater(emitted.sum(), 300, (setting, j))
        pv = _chi2_pvalue(tokens[emitted, j], self.p[s][j])
        self.assertGreater(pv, P_MIN, f"setting {setting}, token {j}: p-value {pv}")
    if not with_probs:
      # The filtered-out draft at position 1 is never accepted under top-k / top-p.
      for s in (1, 2):
        self.assertEqual(self.p[s][1][self.fixed_drafts[0, 1]], 0.0)
        self.assertFalse(np.any((self.setting == s) & (np.arange(self.B) % 2 == 0) & (n == 2)))

  def test_one_hot_draft_probs_equal_the_one_hot_drafter(self):
    # draft_probs = None means q one-hot at the draft: passing that one-hot explicitly must
    # give the same decisions and tokens under the same keys.
    drafts = self.sampled_drafts.astype(np.int32)
    one_hot = np.eye(self.V, dtype=np.float32)[drafts]  # as jax.nn.one_hot(drafts, V)
    n0, t0 = accept_jit(draft_tokens=put(drafts), draft_probs=None, **self.args)
    n1, t1 = accept_jit(draft_tokens=put(drafts), draft_probs=put(one_hot), **self.args)
    np.testing.assert_array_equal(n0, n1)
    np.testing.assert_array_equal(t0, t1)

  def test_the_statistical_check_rejects_wrong_rules(self):
    n, tokens = self._run(with_probs=True)
    rows = (self.setting == 0) & (self.num_drafts >= 1)
    p0 = self.p[0][0]
    # Negative control 1: accepting every draft emits the drafter's token, distributed as q_0.
    self.assertLess(_chi2_pvalue(self.sampled_drafts[rows, 0], p0), P_MIN)
    # Negative control 2 (a subtler bug): after a rejection, draw from p_0 instead of the
    # residual max(0, p_0 - q_0). The law becomes min(p, q) + P(reject) p, not p.
    wrong = tokens[:, 0].copy()
    rejected = rows & (n == 0)
    wrong[rejected] = np.random.default_rng(5).choice(self.V, rejected.sum(), p=p0)
    self.assertLess(_chi2_pvalue(wrong[rows], p0), P_MIN)
    # ... while the real rule on the same rows passes.
    self.assertGreater(_chi2_pvalue(tokens[rows, 0], p0), P_MIN)


class ValidationTest(parameterized.TestCase):
  B, K, V = 2, 3, 11

  def _args(self):
    B, K, V = self.B, self.K, self.V
    return dict(target_logits=put(np.zeros((B, K + 1, V), np.float32)),
                draft_tokens=put(np.zeros((B, K), np.int32)),
                num_drafts=put(np.full((B,), K, np.int32)), keys=_keys(B, K + 1),
                temperature=put(np.ones((B,), np.float32)), top_k=put(np.zeros((B,), np.int32)),
                top_p=put(np.ones((B,), np.float32)), draft_probs=None)

  @parameterized.named_parameters(
      # Bad values made on the host and placed (an eager jnp fill compiles one program each).
      ("logits_rank", "target_logits", put(np.zeros((2, 11), np.float32))),
      ("logits_dtype", "target_logits", put(np.zeros((2, 4, 11), np.int32))),
      ("drafts_K", "draft_tokens", put(np.zeros((2, 4), np.int32))),
      ("drafts_B", "draft_tokens", put(np.zeros((3, 3), np.int32))),
      ("drafts_dtype", "draft_tokens", put(np.zeros((2, 3), np.float32))),
      ("num_drafts_shape", "num_drafts", put(np.zeros((3,), np.int32))),
      ("num_drafts_dtype", "num_drafts", put(np.zeros((2,), np.float32))),
      ("keys_raw", "keys", put(np.zeros((2, 4, 2), np.uint32))),
      ("keys_shape", "keys", jax.jit(
          lambda: jax.random.split(jax.random.key(0), 8).reshape(2, 4)[:, :3])()),
      ("temperature_shape", "temperature", put(np.ones((3,), np.float32))),
      ("top_k_dtype", "top_k", put(np.zeros((2,), np.float32))),
      ("top_p_shape", "top_p", put(np.ones((2, 1), np.float32))),
      ("draft_probs_V", "draft_probs", put(np.zeros((2, 3, 10), np.float32))),
      ("draft_probs_dtype", "draft_probs", put(np.zeros((2, 3, 11), np.int32))),
  )
  def test_bad_argument_is_named(self, name, value):
    args = self._args()
    args[name] = value
    with self.assertRaisesRegex(ValueError, f"accept_drafts: {name} must be"):
      accept_drafts(**args)

  def test_checked_at_trace_time(self):
    args = self._args()
    args["draft_tokens"] = put(np.zeros((self.B, self.K + 1), np.int32))
    with self.assertRaisesRegex(ValueError, "draft_tokens"):
      jax.jit(accept_drafts).lower(**args)


if __name__ == "__main__":
  absltest.main()
