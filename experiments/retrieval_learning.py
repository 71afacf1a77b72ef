"""retrieval_learning: how fast each attention layout learns the retrieval key match.

The accuracy ablation's MINI_MLA learns sums and tool calls thousands of steps before it
learns which value to copy from a retrieval context (until then it copies *a* value, not
the one whose key matches the query). This experiment isolates that lookup. It trains MINI_MLA (MLA attention: keys from a
normed 64-d latent shared by all heads, one shared 16-d rope key) and the same-width
model with GQA attention (per-head keys, every dimension rotated) from scratch on the
retrieval task alone, one example per row (so a row holds exactly what serving sees),
and scores teacher-forced exact match of the two value digits on held-out items every
``eval_every`` steps, by context size.

Same data, seed, steps and schedule for every layout; only the attention differs.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

from configs import MINI_MLA, TINY_MLA
from experiments import common
from mlkit.config import ModelConfig
from mlkit.evals.tasks import (TaskConfig, chance_accuracy, example_tokens, gen_retrieval,
                               make_examples, retrieval_pairs)
from mlkit.evals.tokenizer import EOS, PAD, CharTokenizer
from mlkit.train import TrainConfig, compute_config, train


def gqa_variant(cfg: ModelConfig) -> ModelConfig:
  """``cfg`` with GQA attention of the same width: one KV head per query head, head_dim =
  the MLA value head dim, no query low-rank (every other field unchanged)."""
  return dataclasses.replace(cfg, name=f"{cfg.name}-gqa", attention="gqa", n_kv_heads=cfg.n_heads,
                             head_dim=cfg.v_head_dim, q_lora_rank=0, rope_interleave=False)


@dataclasses.dataclass(frozen=True)
class Setup:
  """One mode's sizes."""

  # Model presets trained, by label.
  models: tuple[tuple[str, ModelConfig], ...]
  # Optimizer steps per model, and evaluation every eval_every steps.
  steps: int
  eval_every: int
  # Rows per batch and row length (one example per row).
  batch_size: int
  seq_len: int
  # Held-out items scored at each evaluation.
  n_eval: int
  # Peak learning rate.
  learning_rate: float = 3e-3


_TASKS = TaskConfig(retrieval_pairs=(2, 10), key_letters=1)
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


def _padded_rows(seqs, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """[(ids, is_answer)] -> (tokens [N, seq_len] int32, weights [N, seq_len] f32), one
  sequence per row from its start, PAD after it; weight 1 on the answer and EOS.

  Raises:
    ValueError: a sequence longer than ``seq_len``.
  """
  tokens = np.full((len(seqs), seq_len), PAD, np.int32)
  weights = np.zeros((len(seqs), seq_len), np.float32)
  for b, (ids, is_answer) in enumerate(seqs):
    if len(ids) > seq_len:
      raise ValueError(f"retrieval_learning: an example has {len(ids)} tokens > seq_len {seq_len}")
    tokens[b, :len(ids)] = ids
    weights[b, :len(ids)] = is_answer
  return tokens, weights


def single_example_rows(step: int, *, seed: int, batch: int, seq_len: int, tc: TaskConfig,
                        tok: CharTokenizer) -> tuple[np.ndarray, np.ndarray]:
  """One retrieval example per row, PAD after it: (tokens [B, T] int32, weights [B, T] f32)
  with weight 1 on the answer digits and EOS. A pure function of (seed, step).

  Raises:
    ValueError: an example longer than ``seq_len``.
  """
  rng = np.random.default_rng([seed, step])
  return _padded_rows([example_tokens(tok, gen_retrieval(rng, tc)) for _ in range(batch)], seq_len)


def lookup_accuracy(params, cfg: ModelConfig, examples, tok: CharTokenizer, seq_len: int
                    ) -> tuple[float, dict[str, float]]:
  """Teacher-forced lookup accuracy of the model ``params`` on ``examples`` (see
  :func:`score_predictions`)."""
  import jax.numpy as jnp
  from mlkit.model import forward
  x, _ = _padded_rows([example_tokens(tok, ex) for ex in examples], seq_len)
  pred = np.asarray(jnp.argmax(forward(params, jnp.asarray(x[:, :-1]), cfg=cfg), axis=-1))
  return score_predictions(pred, examples, tok)


def score_predictions(pred: np.ndarray, examples, tok: CharTokenizer
                      ) -> tuple[float, dict[str, float]]:
  """Exact match of every answer token but EOS (both value digits) under teacher forcing.

  Args:
    pred: [N, T - 1] argmax next-token predictions over each example's padded sequence.
    examples: the N retrieval examples.
    tok: the tokenizer.

  Returns:
    (accuracy overall, accuracy by context size {pairs: accuracy}).
  """
  by: dict[int, list[bool]] = {}
  for i, ex in enumerate(examples):
    ids, is_answer = example_tokens(tok, ex)
    pos = [t for t in range(1, len(ids)) if is_answer[t] and ids[t] != EOS]
    by.setdefault(retrieval_pairs(ex), []).append(all(pred[i, t - 1] == ids[t] for t in pos))
  overall = float(np.mean([ok for v in by.values() for ok in v]))
  return overall, {str(n): float(np.mean(v)) for n, v in sorted(by.items())}


def learning_curve(label: str, model: ModelConfig, setup: Setup, examples, tok: CharTokenizer,
                   seed: int = 0) -> dict:
  """Trains ``model`` on single-example retrieval rows; accuracy every ``eval_every`` steps."""
  tcfg = TrainConfig(steps=setup.steps, batch_size=setup.batch_size, seq_len=setup.seq_len,
                     learning_rate=setup.learning_rate, warmup_steps=min(50, setup.steps // 4),
                     bias_update_rate=1e-3, log_every=0, checkpoint_every=0, seed=seed)
  cfg = compute_config(model, tcfg)
  batches = lambda step: single_example_rows(step, seed=seed, batch=setup.batch_size,  # noqa: E731
                                             seq_len=setup.seq_len, tc=_TASKS, tok=tok)
  curve = []
  t0 = time.perf_counter()

  def evaluate(step: int, params) -> None:
    if step % setup.eval_every and step != setup.steps:
      return
    acc, by_pairs = lookup_accuracy(params, cfg, examples, tok, setup.seq_len)
    curve.append({"step": step, "accuracy": acc, "by_pairs": by_pairs,
                  "seconds": time.perf_counter() - t0})
    common.progress(f"retrieval_learning: {label} step {step}/{setup.steps}: lookup accuracy "
                    f"{100 * acc:.1f}% ({curve[-1]['seconds']:.0f} s)")

  train(cfg, tcfg, batches, progress=None, on_step=evaluate)
  return {"label": label, "model": model.to_dict(), "curve": curve}


def run(out_dir: str, *, quick: bool = True, smoke: bool = False) -> dict:
  """Trains each layout, writes retrieval_learning.{json,md,png}; returns the record."""
  mode = "smoke" if smoke else ("quick" if quick else "full")
  setup = SETUPS[mode]
  tok = CharTokenizer()
  examples = make_examples("retrieval", setup.n_eval, seed=1, tc=_TASKS)
  chance = float(np.mean([chance_accuracy(ex) for ex in examples]))
  runs = [learning_curve(label, model, setup, examples, tok) for label, model in setup.models]
  record = common.record_header("retrieval_learning", quick=quick, smoke=smoke,
                                config={"setup": dataclasses.asdict(setup) | {"models": [
                                    label for label, _ in setup.models]},
                                        "tasks": dataclasses.asdict(_TASKS)})
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
