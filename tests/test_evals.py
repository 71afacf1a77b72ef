"""Tests for mlkit.evals: tokenizer, task generators and checkers, intervals, the harness
(oracle and random backends, a random model through the engine), paged teacher forcing."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from configs import TINY_MLA
from mlkit.evals import (TASKS, CharTokenizer, EvalConfig, TaskConfig, evaluate, is_correct,
                         make_examples, packed_batch, paged_logprobs, paired_difference_interval,
                         parse_tool_call, perplexity, samples_for_halfwidth, score_outputs,
                         token_kl, token_nll, token_top1_correct, tool_call_valid,
                         wilson_interval)
from mlkit.evals.tasks import EOS, PAD, eval_sequences, format_tool_call, max_example_tokens
from mlkit.model import forward
from numpy_params import init_params_np

TOK = CharTokenizer()
SMALL_TASKS = TaskConfig(arith_digits=(1, 3), retrieval_pairs=(4, 8))
# The model-backed tests run TINY_MLA cut to one dense and one MoE layer (compiles dominate).
MODEL = dataclasses.replace(TINY_MLA, n_layers=2)


class TokenizerTest(absltest.TestCase):

  def test_round_trip_and_framing(self):
    text = 'kqz=41,abc=07|abc= {"tool":"search"}'
    ids = TOK.encode(text, bos=True, eos=True)
    self.assertEqual(ids[0], TOK.bos_id)
    self.assertEqual(ids[-1], EOS)
    self.assertEqual(TOK.decode(ids), text)
    self.assertEqual(TOK.decode(ids + TOK.encode("junk")), text)  # stops at EOS
    self.assertLessEqual(TOK.vocab_size, TINY_MLA.vocab_size)

  def test_rejects_unknown_character(self):
    with self.assertRaisesRegex(ValueError, "not in the task alphabet"):
      TOK.encode("caf\u00e9")

  def test_out_of_alphabet_ids_never_match(self):
    self.assertNotEqual(TOK.decode([200, 201]), "")
    ex = make_examples("arithmetic", 1, 0)[0]
    self.assertFalse(is_correct(ex, TOK.decode(TOK.encode(ex.answer) + [200])))


class TaskTest(parameterized.TestCase):

  @parameterized.parameters(*TASKS)
  def test_deterministic_and_seed_dependent(self, task):
    a = make_examples(task, 20, seed=3)
    self.assertEqual(a, make_examples(task, 20, seed=3))
    self.assertNotEqual(a, make_examples(task, 20, seed=4))
    self.assertEqual(a[:5], make_examples(task, 5, seed=3))  # a prefix is stable
    self.assertTrue(all(is_correct(ex, ex.answer) for ex in a))

  def test_arithmetic_answers_are_sums(self):
    for ex in make_examples("arithmetic", 50, 0):
      a, b = ex.prompt[:-1].split("+")
      self.assertEqual(int(ex.answer), int(a) + int(b))

  @parameterized.parameters((1, False), (2, False), (3, False), (1, True), (3, True))
  def test_retrieval_answer_is_the_keys_value(self, key_letters, query_first):
    tc = dataclasses.replace(SMALL_TASKS, key_letters=key_letters, query_first=query_first)
    for ex in make_examples("retrieval", 50, 0, tc):
      if query_first:
        query, context = ex.prompt[:-1].split("?")
        query += "="
        self.assertTrue(ex.prompt.endswith("|"))
      else:
        context, query = ex.prompt.split("|")
      pairs = dict(p.split("=") for p in context.split(","))
      self.assertEqual(len(pairs), context.count(",") + 1)  # keys are distinct
      self.assertTrue(all(len(k) == key_letters for k in pairs))
      self.assertEqual(pairs[query[:-1]], ex.answer)
      self.assertLessEqual(len(ex.prompt) + len(ex.answer) + 3, max_example_tokens(tc))

  def test_task_config_errors_name_the_field(self):
    with self.assertRaisesRegex(ValueError, "key_letters"):
      TaskConfig(key_letters=4)
    with self.assertRaisesRegex(ValueError, "at most 26 distinct keys"):
      TaskConfig(retrieval_pairs=(4, 27), key_letters=1)
    with self.assertRaisesRegex(ValueError, "arith_digits"):
      TaskConfig(arith_digits=(3, 1))

  def test_checkers_reject_wrong_answers(self):
    ar = make_examples("arithmetic", 30, 0)
    for ex in ar:
      wrong = str(int(ex.answer) + 1)
      self.assertFalse(is_correct(ex, wrong))
      self.assertFalse(is_correct(ex, ex.answer + "0"))
      self.assertFalse(is_correct(ex, " " + ex.answer))
      self.assertFalse(is_correct(ex, ""))
    for ex in make_examples("retrieval", 30, 0, SMALL_TASKS):
      self.assertFalse(is_correct(ex, f"{(int(ex.answer) + 1) % 100:02d}"))
    for ex in make_examples("tool_call", 30, 0):
      obj = json.loads(ex.answer)
      key = next(k for k in obj if k != "tool")
      changed = dict(obj, **{key: obj[key] + 1 if isinstance(obj[key], int) else obj[key] + "x"})
      self.assertTrue(tool_call_valid(json.dumps(changed)))
      self.assertFalse(is_correct(ex, json.dumps(changed)))
      self.assertFalse(is_correct(ex, ex.answer[:-1]))  # truncated JSON

  def test_tool_call_validity(self):
    good = format_tool_call("weather", {"city": "oslo", "days": 3})
    self.assertTrue(tool_call_valid(good))
    self.assertTrue(tool_call_valid('{"days": 3, "tool": "weather", "city": "oslo"}'))  # order, spaces
    for bad in ['{"tool":"weather","city":"oslo"}',  # missing argument
                '{"tool":"weather","city":"oslo","days":3,"x":1}',  # extra key
                '{"tool":"weather","city":"oslo","days":"3"}',  # wrong type
                '{"tool":"weather","city":"oslo","days":true}',  # bool is not int
                '{"tool":"weather","city":"oslo","days":3.0}',  # float is not int
                '{"tool":"weather","city":"","days":3}',  # empty string
                '{"tool":"email","to":"x"}',  # unknown tool
                '["weather"]', '{"tool":"weather"', "", "weather(oslo, 3)"]:
      self.assertFalse(tool_call_valid(bad), bad)
      self.assertIsNone(parse_tool_call(bad))
    ex = make_examples("tool_call", 1, 0)[0]
    self.assertTrue(is_correct(ex, json.dumps(json.loads(ex.answer), indent=1)))

  def test_packed_batch(self):
    tokens, weights = packed_batch(np.random.default_rng(0), 3, 128, tc=SMALL_TASKS)
    tokens2, weights2 = packed_batch(np.random.default_rng(0), 3, 128, tc=SMALL_TASKS)
    np.testing.assert_array_equal(tokens, tokens2)
    np.testing.assert_array_equal(weights, weights2)
    self.assertEqual(tokens.shape, (3, 128))
    self.assertTrue(np.all(weights[tokens == PAD] == 0))
    self.assertTrue(np.all(weights[tokens == TOK.bos_id] == 0))
    self.assertTrue(np.all(weights[tokens == EOS] == 1))
    for row in tokens:
      n_examples = int(np.sum(row == TOK.bos_id))
      self.assertEqual(n_examples, int(np.sum(row == EOS)))
      self.assertGreater(n_examples, 0)
    # Segment ids: the same rows, 1, 2, ... per example (each starting at its BOS), 0 on PAD.
    t3, w3, segs = packed_batch(np.random.default_rng(0), 3, 128, tc=SMALL_TASKS, segments=True)
    np.testing.assert_array_equal(t3, tokens)
    np.testing.assert_array_equal(w3, weights)
    self.assertEqual(segs.dtype, np.int32)
    np.testing.assert_array_equal(segs == 0, tokens == PAD)
    for row, seg in zip(tokens, segs):
      starts = np.nonzero(np.diff(seg, prepend=0) != 0)[0]
      starts = starts[seg[starts] > 0]
      np.testing.assert_array_equal(starts, np.nonzero(row == TOK.bos_id)[0])
      np.testing.assert_array_equal(seg[starts], np.arange(1, len(starts) + 1))

  def test_packed_batch_token_mix_balances_tasks(self):
    def task_tokens(mix):
      tokens, _ = packed_batch(np.random.default_rng(5), 16, 128, tc=SMALL_TASKS, mix=mix)
      counts = {"arithmetic": 0, "tool_call": 0}
      # Count examples by their prompt shape: a sum prompt holds "+", a tool call "{".
      ids = tokens.ravel().tolist()
      starts = [i for i, t in enumerate(ids) if t == TOK.bos_id]
      for a, b in zip(starts, starts[1:] + [len(ids)]):
        text = TOK.decode(ids[a:b], stop_at_eos=False)
        if "+" in text:
          counts["arithmetic"] += b - a
        elif "{" in text:
          counts["tool_call"] += b - a
      return counts
    by_examples, by_tokens = task_tokens("examples"), task_tokens("tokens")
    # Drawn in inverse proportion to their length, short sums take a larger share of tokens.
    ratio = lambda c: c["arithmetic"] / c["tool_call"]
    self.assertGreater(ratio(by_tokens), 1.5 * ratio(by_examples))
    with self.assertRaisesRegex(ValueError, "mix"):
      packed_batch(np.random.default_rng(5), 1, 128, tc=SMALL_TASKS, mix="tasks")


class StatsTest(absltest.TestCase):

  def test_wilson_known_values(self):
    lo, hi = wilson_interval(0, 10)
    self.assertEqual(lo, 0.0)
    self.assertAlmostEqual(hi, 0.2775, places=3)
    lo, hi = wilson_interval(50, 100)
    self.assertAlmostEqual(lo, 0.4038, places=3)
    self.assertAlmostEqual(hi, 0.5962, places=3)
    lo, hi = wilson_interval(100, 100)
    self.assertAlmostEqual(hi, 1.0, places=9)
    self.assertAlmostEqual(lo, 0.963, places=3)
    with self.assertRaises(ValueError):
      wilson_interval(3, 2)

  def test_paired_difference(self):
    a = [True] * 90 + [False] * 10
    d, lo, hi = paired_difference_interval(a, a)
    self.assertEqual(d, 0.0)
    # No disagreements on 100 items still leaves about +-2/100 of doubt, never a zero width.
    self.assertAlmostEqual(hi, -lo)
    self.assertGreater(hi, 0.005)
    self.assertLess(hi, 0.03)
    b = [True] * 95 + [False] * 5
    d, lo, hi = paired_difference_interval(a, b)
    self.assertAlmostEqual(d, 0.05)
    self.assertGreater(lo, 0.0)  # 5 one-way disagreements out of 100 are significant
    self.assertGreater(hi, 0.05)
    c = [False] * 5 + [True] * 90 + [False] * 5  # loses items 0-4, wins items 90-94
    d, lo, hi = paired_difference_interval(a, c)
    self.assertEqual(d, 0.0)
    self.assertLess(lo, -0.03)
    with self.assertRaises(ValueError):
      paired_difference_interval(a, b[:-1])
    # A 1-point difference needs ~10^4 independent samples at 50% for a +-1-point interval.
    self.assertEqual(samples_for_halfwidth(0.01), 9604)


class OracleBackend:
  """Answers every prompt correctly (looks the answer up)."""

  def __init__(self, examples):
    self.answers = {tuple(TOK.encode(ex.prompt, bos=True)): ex.answer for ex in examples}

  def generate(self, prompts, max_new_tokens):
    return [TOK.encode(self.answers[tuple(p)], eos=True)[:max_new_tokens] for p in prompts]


class RandomBackend:
  """Emits uniformly random token ids (a model that knows nothing)."""

  def __init__(self, seed=0):
    self.rng = np.random.default_rng(seed)

  def generate(self, prompts, max_new_tokens):
    return [self.rng.integers(0, TOK.vocab_size, max_new_tokens).tolist() for _ in prompts]


class HarnessTest(absltest.TestCase):

  ECFG = EvalConfig(n_per_task=60, task_config=SMALL_TASKS)

  def test_oracle_scores_100(self):
    ex = [e for t in TASKS for e in self.ECFG.examples(t)]
    res = evaluate(OracleBackend(ex), self.ECFG)
    for task, r in res.items():
      self.assertEqual(r.accuracy, 1.0, task)
      self.assertEqual(r.n, 60)
      self.assertGreater(r.interval[0], 0.9)
    self.assertEqual(res["tool_call"].validity, 1.0)

  def test_random_guesser_scores_at_most_chance(self):
    res = evaluate(RandomBackend(), self.ECFG)
    for task, r in res.items():
      self.assertLessEqual(r.interval[0], r.chance + 1e-9, task)
      self.assertLess(r.accuracy, 0.05, task)
    self.assertEqual(res["tool_call"].validity, 0.0)

  def test_score_outputs_checks_counts(self):
    ex = self.ECFG.examples("arithmetic")
    with self.assertRaisesRegex(ValueError, "outputs"):
      score_outputs(ex, [[EOS]])

  def test_random_model_through_engine_near_chance(self):
    from mlkit.evals.backends import EngineBackend
    params = init_params_np(MODEL)
    ecfg = EvalConfig(tasks=("arithmetic", "retrieval"), n_per_task=16, task_config=SMALL_TASKS)
    backend = EngineBackend(params, MODEL, max_seq_tokens=96, prefill_chunk=96, page_size=16)
    res = evaluate(backend, ecfg)
    for task, r in res.items():
      self.assertEqual(r.n, 16)
      self.assertLessEqual(r.interval[0], r.chance + 1e-9, task)
      self.assertLess(r.accuracy, 0.25, task)


class TeacherForcingTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.params = init_params_np(MODEL, seed=1)
    seqs = eval_sequences(make_examples("retrieval", 5, 0, SMALL_TASKS)
                          + make_examples("arithmetic", 3, 0))
    cls.seqs = [s for s, _ in seqs]
    cls.masks = [m for _, m in seqs]

  def test_f32_pool_matches_cache_free_forward(self):
    lps = paged_logprobs(self.params, MODEL, self.seqs, kv_dtype="float32", page_size=16,
                         batch_size=4)
    self.assertLen(lps, len(self.seqs))
    # One cache-free forward over all sequences, right-padded (causal: padding is never seen).
    padded = np.zeros((len(self.seqs), max(len(s) for s in self.seqs)), np.int32)
    for i, s in enumerate(self.seqs):
      padded[i, :len(s)] = s
    refs = jax.nn.log_softmax(forward(self.params, jnp.asarray(padded), cfg=MODEL), axis=-1)
    for s, lp, ref in zip(self.seqs, lps, refs):
      np.testing.assert_allclose(lp, np.asarray(ref[:len(s)]), rtol=1e-4, atol=1e-4)
    nll = token_nll(lps, self.seqs, self.masks)
    self.assertEqual(nll.size, sum(int(np.sum(m[1:])) for m in self.masks))
    self.assertAlmostEqual(perplexity(nll), float(np.exp(np.mean(nll))))
    self.assertGreater(perplexity(nll), 10.0)  # a random model is far from the answers
    top1 = token_top1_correct(lps, self.seqs, self.masks)
    self.assertEqual(top1.shape, nll.shape)
    self.assertLess(top1.mean(), 0.3)
    # With the answers' own log-probs as "logits", top-1 is perfect.
    perfect = [np.log(np.eye(MODEL.vocab_size)[np.r_[s[1:], 0]] + 1e-9) for s in self.seqs]
    self.assertTrue(np.all(token_top1_correct(perfect, self.seqs, self.masks)))

  def test_kl_zero_for_same_and_positive_for_fp8_kv(self):
    ref = paged_logprobs(self.params, MODEL, self.seqs, kv_dtype="float32", page_size=16,
                         batch_size=4)
    fp8 = paged_logprobs(self.params, MODEL, self.seqs, kv_dtype="float8_e4m3fn",
                         page_size=16, batch_size=4)
    np.testing.assert_allclose(token_kl(ref, ref), 0.0, atol=1e-9)
    kl = token_kl(ref, fp8)
    self.assertEqual(kl.size, sum(len(s) - 1 for s in self.seqs))
    self.assertTrue(np.all(kl > -1e-9))
    self.assertGreater(np.mean(kl), 1e-7)  # fp8 pages do change the distribution
    self.assertLess(np.mean(kl), 0.5)  # ... but not beyond recognition


if __name__ == "__main__":
  absltest.main()
