"""retrieval_learning: how fast each attention layout learns the retrieval key match.

MINI_MLA (MLA attention) and its same-width GQA twin are trained from scratch on the
retrieval task alone with the same data, seed, steps and schedule; only the attention
differs. Each is scored on held-out items every ``eval_every`` steps, by context size
(``mlkit.evals.lookup``). Writes retrieval_learning.{json,md,png}.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from configs import MINI_MLA, TINY_MLA
from experiments import common
from mlkit.evals.lookup import TASKS, Setup, gqa_variant, learning_curve
from mlkit.evals.tasks import chance_accuracy, make_examples
from mlkit.evals.tokenizer import CharTokenizer

# One dense layer keeps the smoke run's two compilations short.
_TINY = dataclasses.replace(TINY_MLA, n_layers=1)
SETUPS = {
    "smoke": Setup(models=(("mla", _TINY), ("gqa", gqa_variant(_TINY))), steps=4, eval_every=2,
                   batch_size=2, seq_len=64, n_eval=8),
    "quick": Setup(models=(("mla", MINI_MLA), ("gqa", gqa_variant(MINI_MLA))), steps=600,
                   eval_every=200, batch_size=16, seq_len=64, n_eval=256),
    "full": Setup(models=(("mla", MINI_MLA), ("gqa", gqa_variant(MINI_MLA))), steps=1600,
                  eval_every=200, batch_size=16, seq_len=64, n_eval=256),
}


def run(out_dir: str, *, quick: bool = True, smoke: bool = False) -> dict:
  """Trains each layout, writes retrieval_learning.{json,md,png}; returns the record."""
  mode = "smoke" if smoke else ("quick" if quick else "full")
  setup = SETUPS[mode]
  tok = CharTokenizer()
  examples = make_examples("retrieval", setup.n_eval, seed=1, tc=TASKS)
  chance = float(np.mean([chance_accuracy(ex) for ex in examples]))
  runs = [learning_curve(label, model, setup, examples, tok, progress=common.progress)
          for label, model in setup.models]
  record = common.record_header("retrieval_learning", quick=quick, smoke=smoke,
                                config={"setup": dataclasses.asdict(setup) | {"models": [
                                    label for label, _ in setup.models]},
                                        "tasks": dataclasses.asdict(TASKS)})
  record.update(runs=runs, chance=chance)
  rows = [[r["label"], r["model"]["attention"], p["step"], 100 * p["accuracy"],
           " ".join(f"{n}:{100 * a:.0f}" for n, a in p["by_pairs"].items())]
          for r in runs for p in r["curve"]]
  text = ("# retrieval_learning: the key->value lookup learned from scratch, MLA vs GQA\n\n"
          f"Mode {mode}: {setup.steps} steps of {setup.batch_size} single-example rows, "
          f"{setup.n_eval} held-out items (2-10 pairs, one-letter keys, two-digit values); "
          f"chance (copying a random value of the context) {100 * chance:.1f}%. Teacher-forced "
          "exact match of both value digits, in %.\n\n"
          + common.markdown_table(["model", "attention", "step", "accuracy %",
                                   "by pairs (pairs:%)"], rows)
          + "\n\n![lookup accuracy vs step](retrieval_learning.png)\n")
  common.write_json(out_dir, "retrieval_learning", record)
  common.write_markdown(out_dir, "retrieval_learning", text)
  common.plot_lines(os.path.join(out_dir, "retrieval_learning.png"),
                    {f"{r['label']} ({r['model']['name']})":
                     ([p["step"] for p in r["curve"]], [100 * p["accuracy"] for p in r["curve"]])
                     for r in runs},
                    reference={"chance": ([0, setup.steps], [100 * chance] * 2)},
                    xlabel="training step", ylabel="lookup accuracy (%)",
                    title="Retrieval key->value lookup learned from scratch, MLA vs GQA")
  return record
