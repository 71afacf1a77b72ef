"""retrieval_learning: its data rows, scoring and the GQA twin of a preset (mlkit.evals.lookup),
and the checks of the experiment's smoke run (run by test_experiments.SmokeRunsTest, with
every other smoke run, through the command line)."""

import os

import numpy as np
from absl.testing import absltest

from configs import MINI_MLA
from mlkit.evals import lookup as rl
from mlkit.evals.tasks import TaskConfig, make_examples
from mlkit.evals.tokenizer import BOS, EOS, PAD, CharTokenizer
from mlkit.model.params import count_params

TOK = CharTokenizer()
TC = TaskConfig(retrieval_pairs=(2, 10), key_letters=1)


class RowsTest(absltest.TestCase):

  def test_one_example_per_row_answer_weighted(self):
    tokens, weights = rl.single_example_rows(3, seed=0, batch=8, seq_len=64, tc=TC, tok=TOK)
    self.assertEqual(tokens.shape, (8, 64))
    self.assertEqual(tokens.dtype, np.int32)
    for row, w in zip(tokens, weights):
      self.assertEqual(row[0], BOS)
      self.assertEqual(int(np.sum(row == BOS)), 1)  # exactly one example
      end = int(np.argmax(row == EOS))
      self.assertTrue(np.all(row[end + 1:] == PAD))
      # The two value digits and EOS weigh 1, everything else 0.
      np.testing.assert_array_equal(np.nonzero(w)[0], [end - 2, end - 1, end])
      text = TOK.decode(row[1:end].tolist())
      context, query = text.split("|")
      values = dict(pair.split("=") for pair in context.split(","))
      self.assertEqual(values[query[:-3]], query[-2:])  # "k=07": the answer is k's value

  def test_pure_function_of_step(self):
    a = rl.single_example_rows(5, seed=1, batch=4, seq_len=64, tc=TC, tok=TOK)
    b = rl.single_example_rows(5, seed=1, batch=4, seq_len=64, tc=TC, tok=TOK)
    c = rl.single_example_rows(6, seed=1, batch=4, seq_len=64, tc=TC, tok=TOK)
    np.testing.assert_array_equal(a[0], b[0])
    self.assertFalse(np.array_equal(a[0], c[0]))

  def test_short_rows_rejected(self):
    with self.assertRaisesRegex(ValueError, "seq_len 20"):
      rl.single_example_rows(0, seed=0, batch=4, seq_len=20, tc=TC, tok=TOK)


class ScoreTest(absltest.TestCase):

  def _oracle(self, examples, seq_len=64):
    pred = np.zeros((len(examples), seq_len - 1), np.int64)
    for i, ex in enumerate(examples):
      ids = TOK.encode(ex.prompt, bos=True) + TOK.encode(ex.answer, eos=True)
      pred[i, :len(ids) - 1] = ids[1:]  # position t - 1 predicts token t
    return pred

  def test_oracle_scores_one_and_a_wrong_digit_zero(self):
    examples = make_examples("retrieval", 40, seed=3, tc=TC)
    pred = self._oracle(examples)
    acc, by = rl.score_predictions(pred, examples, TOK)
    self.assertEqual(acc, 1.0)
    self.assertEqual(set(by), {str(e.prompt.count(",") + 1) for e in examples})
    # Break the second digit of the first half: exactly that half is wrong.
    for i, ex in enumerate(examples[:20]):
      t = len(TOK.encode(ex.prompt, bos=True)) + 1  # the second digit's position
      pred[i, t - 1] = TOK.encode("x")[0]
    acc, _ = rl.score_predictions(pred, examples, TOK)
    self.assertEqual(acc, 0.5)

  def test_eos_not_scored(self):
    examples = make_examples("retrieval", 4, seed=4, tc=TC)
    pred = self._oracle(examples)
    for i, ex in enumerate(examples):
      pred[i, len(TOK.encode(ex.prompt, bos=True)) + 1] = PAD  # predicts PAD instead of EOS
    self.assertEqual(rl.score_predictions(pred, examples, TOK)[0], 1.0)


class GqaVariantTest(absltest.TestCase):

  def test_same_width_gqa(self):
    g = rl.gqa_variant(MINI_MLA)
    self.assertEqual(g.attention, "gqa")
    self.assertEqual((g.d_model, g.n_layers, g.n_heads, g.n_routed_experts, g.moe_ffn_dim),
                     (MINI_MLA.d_model, MINI_MLA.n_layers, MINI_MLA.n_heads,
                      MINI_MLA.n_routed_experts, MINI_MLA.moe_ffn_dim))
    self.assertEqual(g.n_kv_heads * g.head_dim, MINI_MLA.n_heads * MINI_MLA.v_head_dim)
    # Only the attention differs, so the sizes stay within 10%.
    self.assertLess(abs(count_params(g) / count_params(MINI_MLA) - 1), 0.1)


class RetrievalLearningSmokeChecks:
  """Checks of the retrieval_learning smoke run. Not a TestCase: test_experiments
  .SmokeRunsTest mixes it in, which runs every experiment's smoke mode in one process."""

  def test_retrieval_learning_writes_curves_for_both_layouts(self):
    rec, out = self.records["retrieval_learning"], self.out
    for ext in ("json", "md", "png"):
      self.assertTrue(os.path.exists(os.path.join(out, f"retrieval_learning.{ext}")))
    self.assertEqual(rec["experiment"], "retrieval_learning")
    with open(os.path.join(out, "retrieval_learning.md")) as f:
      md = f.read()
    self.assertTrue(md.startswith("# retrieval_learning"))
    self.assertIn("](retrieval_learning.png)", md)
    setup = rec["config"]["setup"]
    self.assertEqual(setup["models"], ["mla", "gqa"])
    self.assertEqual([r["model"]["attention"] for r in rec["runs"]], ["mla", "gqa"])
    for r in rec["runs"]:
      self.assertEqual([p["step"] for p in r["curve"]],
                       list(range(setup["eval_every"], setup["steps"] + 1, setup["eval_every"])))
      for p in r["curve"]:
        self.assertTrue(0.0 <= p["accuracy"] <= 1.0)
    examples = make_examples("retrieval", setup["n_eval"], seed=1, tc=TC)
    sizes = {str(e.prompt.count(",") + 1) for e in examples}
    self.assertTrue(all(set(p["by_pairs"]) == sizes for r in rec["runs"] for p in r["curve"]))
    self.assertAlmostEqual(rec["chance"], np.mean([1 / (e.prompt.count(",") + 1) for e in examples]))


if __name__ == "__main__":
  absltest.main()
