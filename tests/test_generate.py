"""Sampling and contiguous-cache generation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from configs import TINY_MLA
from mlkit.generate import generate
from mlkit.model import forward
from mlkit.sampling import SamplingParams, row_keys, sample_tokens
from numpy_params import init_params_np
from host_data import softmax
from host_data import put


def _normal(seed, shape):
  """f32 normals [shape] as a numpy array: jax.random would compile a threefry program per
  shape. Placed with ``put``, they compile nothing."""
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# row_keys of a batch, jitted: one program, not one per eager op.
_row_keys = jax.jit(row_keys)


class SamplerTest(parameterized.TestCase):

  def _sample(self, logits, temp, top_k, top_p, seed=0, n=400):
    B = logits.shape[0]

    logits = put(np.asarray(logits, np.float32))

    def draw(step):
      keys = row_keys(jnp.full((B,), seed, jnp.uint32), step)
      return sample_tokens(logits, keys, jnp.full((B,), temp), jnp.full((B,), top_k, jnp.int32),
                           jnp.full((B,), top_p))

    # The n draws and their stacking in one program.
    return np.asarray(jax.jit(jax.vmap(draw, out_axes=1))(np.arange(n, dtype=np.int32)))

  def test_greedy_is_argmax(self):
    logits = _normal(0, (4, 50))
    out = self._sample(logits, 0.0, 0, 1.0, n=3)
    np.testing.assert_array_equal(out, np.tile(np.argmax(logits, -1)[:, None], (1, 3)))

  def test_greedy_batches_skip_the_filters_with_the_same_tokens(self):
    # sample_tokens only runs the sorting filters when some row samples; either branch must
    # give what the filtered path gives, row by row (greedy rows: the argmax).
    from mlkit.sampling import _sample_filtered
    h_logits = _normal(2, (4, 300))
    logits = put(h_logits)
    keys = _row_keys(np.arange(4, dtype=np.uint32), 3)
    top_k, top_p = put(np.asarray([0, 5, 0, 7], np.int32),
                       np.asarray([1.0, 0.9, 0.8, 1.0], np.float32))
    h_greedy = np.argmax(h_logits, -1).astype(np.int32)
    greedy = put(h_greedy)
    sample = jax.jit(sample_tokens)
    filtered = jax.jit(lambda *a: _sample_filtered(*a, greedy))
    for temp in ([0.0, 0.0, 0.0, 0.0], [0.0, 0.7, 0.0, 1.3]):
      h_t = np.asarray(temp, np.float32)
      t = put(h_t)
      out = sample(logits, keys, t, top_k, top_p)
      np.testing.assert_array_equal(out, filtered(logits, keys, t, top_k, top_p))
      np.testing.assert_array_equal(np.asarray(out)[h_t == 0], h_greedy[h_t == 0])

  def test_top_k_restricts_support(self):
    logits = _normal(1, (2, 30))
    out = self._sample(logits, 1.0, 3, 1.0)
    for b in range(2):
      allowed = set(np.argsort(-np.asarray(logits[b]))[:3].tolist())
      self.assertTrue(set(out[b].tolist()) <= allowed)
      self.assertGreater(len(set(out[b].tolist())), 1)

  def test_top_p_restricts_support(self):
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps exactly the first two.
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    out = self._sample(logits, 1.0, 0, 0.7)
    self.assertEqual(set(out[0].tolist()), {0, 1})

  @parameterized.parameters((3, 256), (2, 1000), (4, 129), (1, 1), (2, 128))
  def test_row_cumsum_matches_a_float64_cumsum(self, rows, vocab):
    # The top-p filter's prefix sums are two triangular matmuls (no sequential loop on a
    # GPU): within f32's 1e-6 of a float64 cumsum, on softmax rows as the filter sums.
    from mlkit.sampling import row_cumsum
    x = softmax(_normal(vocab, (rows, vocab)) * np.float32(3.0))
    got = np.asarray(jax.jit(row_cumsum)(put(x)))
    want = np.cumsum(np.asarray(x, np.float64), axis=-1)
    self.assertEqual(got.shape, (rows, vocab))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)

  def test_top_p_keeps_what_a_float64_cumsum_keeps(self):
    # filtered_logits against the same filter written with numpy in float64, on rows whose
    # top-p cut falls far from any tie: the same tokens survive.
    from mlkit.sampling import filtered_logits
    logits = _normal(7, (3, 500)) * np.float32(2.0)
    top_p = np.asarray([0.5, 0.9, 0.97], np.float32)
    got = np.isfinite(np.asarray(jax.jit(filtered_logits)(
        *put(logits, np.ones((3,), np.float32), np.zeros((3,), np.int32), top_p))))
    x = np.asarray(logits, np.float64)
    for b in range(3):
      order = np.argsort(-x[b])
      p = np.exp(x[b][order] - x[b][order][0])
      p /= p.sum()
      n_keep = max(int(np.sum(np.cumsum(p) - p < top_p[b])), 1)
      np.testing.assert_array_equal(np.flatnonzero(got[b]), np.sort(order[:n_keep]))

  def test_temperature_one_matches_distribution(self):
    probs = np.array([0.6, 0.3, 0.1])
    out = self._sample(np.log(np.asarray([probs], np.float32)), 1.0, 0, 1.0, n=1500)
    freq = np.bincount(out[0], minlength=3) / out.shape[1]
    np.testing.assert_allclose(freq, probs, atol=0.05)

  def test_params_validation(self):
    for kwargs, field in [({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": -1.0}, "temperature"),
                          ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p")]:
      with self.assertRaisesRegex(ValueError, field):
        SamplingParams(**kwargs)


class GenerateTest(parameterized.TestCase):
  """Every generate call here has two prompts of at most 8 tokens and at most 8 new tokens,
  so the prefill and decode steps compile once for the class."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.cfg = dataclasses.replace(TINY_MLA, n_layers=2)  # one dense layer, one MoE layer
    cls.params = init_params_np(cls.cfg)

  def test_greedy_matches_full_forward(self):
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10, 11]]
    res = generate(self.params, self.cfg, prompts, SamplingParams(max_new_tokens=5))
    for prompt, new in zip(prompts, res.tokens):
      seq = list(prompt)
      for _ in range(5):  # greedy continuation by repeated full forwards (fixed padded length)
        padded = put(np.array([seq + [0] * (16 - len(seq))], np.int32))
        logits = np.asarray(forward(self.params, padded, cfg=self.cfg))
        seq.append(int(np.argmax(logits[0, len(seq) - 1])))
      self.assertEqual(new, seq[len(prompt):])

  def test_deterministic_for_seed(self):
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=50, top_p=0.9, seed=11)
    prompts = [[1, 2, 3], [4, 5]]
    a = generate(self.params, self.cfg, prompts, sp).tokens
    b = generate(self.params, self.cfg, prompts, sp).tokens
    c = generate(self.params, self.cfg, prompts, SamplingParams(
        max_new_tokens=6, temperature=1.0, top_k=50, top_p=0.9, seed=12)).tokens
    self.assertEqual(a, b)
    self.assertNotEqual(a, c)

  def test_stop_tokens_and_per_request_params(self):
    greedy = generate(self.params, self.cfg, [[1, 2, 3], [4, 5]],
                      SamplingParams(max_new_tokens=6)).tokens[0]
    stop = greedy[2]
    res = generate(self.params, self.cfg, [[1, 2, 3], [1, 2, 3]],
                   [SamplingParams(max_new_tokens=6, stop_tokens=(stop,)),
                    SamplingParams(max_new_tokens=4)])
    self.assertEqual(res.tokens[0], greedy[:greedy.index(stop) + 1])
    self.assertEqual(res.tokens[1], greedy[:4])

  def test_bad_prompts(self):
    with self.assertRaisesRegex(ValueError, "empty"):
      generate(self.params, self.cfg, [])
    with self.assertRaisesRegex(ValueError, "prompt 1 is empty"):
      generate(self.params, self.cfg, [[1], []])
    with self.assertRaisesRegex(ValueError, "outside"):
      generate(self.params, self.cfg, [[1, self.cfg.vocab_size]])
    with self.assertRaisesRegex(ValueError, "max_seq_len"):
      generate(self.params, self.cfg, [[1] * 250], SamplingParams(max_new_tokens=10))


if __name__ == "__main__":
  absltest.main()
