"""How fast an attention layout learns the retrieval key->value lookup, from scratch.

The accuracy ablation's MINI_MLA learns sums and tool calls thousands of steps before
it learns which value to copy from a retrieval context (until then it copies *a*
value, not the one whose key matches the query). This isolates that lookup: a model
trained from scratch on the retrieval task alone, one example per row (so a row
holds exactly what serving sees, :func:`single_example_rows`), scored by
teacher-forced exact match of the two value digits on held-out items every
``eval_every`` steps, by context size (:func:`learning_curve`). :func:`gqa_variant`
gives a preset's same-width twin with GQA attention (per-head keys, every dimension
rotated), to set beside MLA's (keys from a normed latent shared by all heads, one
shared rope key). ``python -m experiments retrieval_learning`` runs both.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from mlkit.config import ModelConfig
from mlkit.evals.tasks import TaskConfig, example_tokens, gen_retrieval, retrieval_pairs
from mlkit.evals.tokenizer import EOS, PAD, CharTokenizer
from mlkit.train import TrainConfig, compute_config, train

# The task: 2-10 key/value pairs, one-letter keys, two-digit values.
TASKS = TaskConfig(retrieval_pairs=(2, 10), key_letters=1)


def gqa_variant(cfg: ModelConfig) -> ModelConfig:
  """``cfg`` with GQA attention of the same width: one KV head per query head, head_dim =
  the MLA value head dim, no query low-rank (every other field unchanged)."""
  return dataclasses.replace(cfg, name=f"{cfg.name}-gqa", attention="gqa", n_kv_heads=cfg.n_heads,
                             head_dim=cfg.v_head_dim, q_lora_rank=0, rope_interleave=False)


@dataclasses.dataclass(frozen=True)
class Setup:
  """One run's sizes: the models compared and how long each trains."""

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
                   seed: int = 0, tasks: TaskConfig = TASKS,
                   progress: Callable[[str], None] | None = None) -> dict:
  """Trains ``model`` on single-example retrieval rows; accuracy every ``eval_every`` steps.

  Args:
    label: the run's name (in the record and the progress lines).
    model: the preset trained from scratch.
    setup: steps, evaluation interval, batch and row sizes, learning rate.
    examples: the held-out retrieval items scored at each evaluation.
    tok: the tokenizer.
    seed: data and initialisation seed.
    tasks: the training stream's task difficulty.
    progress: called with a line per evaluation, or None.

  Returns:
    {"label", "model" (its config), "curve": [{step, accuracy, by_pairs, seconds}]}.
  """
  tcfg = TrainConfig(steps=setup.steps, batch_size=setup.batch_size, seq_len=setup.seq_len,
                     learning_rate=setup.learning_rate, warmup_steps=min(50, setup.steps // 4),
                     bias_update_rate=1e-3, log_every=0, checkpoint_every=0, seed=seed)
  cfg = compute_config(model, tcfg)
  batches = lambda step: single_example_rows(step, seed=seed, batch=setup.batch_size,  # noqa: E731
                                             seq_len=setup.seq_len, tc=tasks, tok=tok)
  curve = []
  t0 = time.perf_counter()

  def evaluate(step: int, params) -> None:
    if step % setup.eval_every and step != setup.steps:
      return
    acc, by_pairs = lookup_accuracy(params, cfg, examples, tok, setup.seq_len)
    curve.append({"step": step, "accuracy": acc, "by_pairs": by_pairs,
                  "seconds": time.perf_counter() - t0})
    if progress:
      progress(f"retrieval_learning: {label} step {step}/{setup.steps}: lookup accuracy "
               f"{100 * acc:.1f}% ({curve[-1]['seconds']:.0f} s)")

  train(cfg, tcfg, batches, progress=None, on_step=evaluate)
  return {"label": label, "model": model.to_dict(), "curve": curve}
