"""Scoring generation on the tasks: accuracy with Wilson intervals, tool-call validity.

A *backend* is anything with ``generate(prompts, max_new_tokens) -> outputs``:
token-id lists in, generated token-id lists out (greedy, stopping after EOS). The
engine and the contiguous-cache generator both fit (see :mod:`mlkit.evals.backends`);
tests plug in oracles and random guessers. This module does not import the engine.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import numpy as np

from mlkit.evals.stats import wilson_interval
from mlkit.evals.tasks import (TASKS, Example, TaskConfig, chance_accuracy, is_correct,
                               make_examples, tool_call_valid)
from mlkit.evals.tokenizer import CharTokenizer

# Generated tokens allowed per task: the longest answer plus EOS, with slack.
MAX_NEW_TOKENS = {"arithmetic": 8, "retrieval": 4, "tool_call": 64}


class Backend(Protocol):
  """Greedy generation: prompts (token-id lists) -> generated token ids per prompt."""

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    ...


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """How many items of which tasks to score, and how they are generated."""

  # Tasks to score, from mlkit.evals.tasks.TASKS.
  tasks: tuple[str, ...] = ("arithmetic", "retrieval", "tool_call")
  # Items per task (the same items for every recipe, so differences are paired).
  n_per_task: int = 200
  # Seed of the evaluation items (disjoint from training, which seeds by (seed, step)).
  seed: int = 1234
  # Task difficulty; evaluation may use longer retrieval contexts than most training rows.
  task_config: TaskConfig = TaskConfig(arith_digits=(1, 3), retrieval_pairs=(16, 24))

  def __post_init__(self):
    bad = [t for t in self.tasks if t not in TASKS]
    if bad or not self.tasks:
      raise ValueError(f"EvalConfig.tasks must be a non-empty subset of {TASKS}, got {self.tasks!r}")
    if not isinstance(self.n_per_task, int) or self.n_per_task <= 0:
      raise ValueError(f"EvalConfig.n_per_task must be a positive int, got {self.n_per_task!r}")

  def examples(self, task: str) -> list[Example]:
    """The fixed evaluation items of ``task``."""
    return make_examples(task, self.n_per_task, self.seed, self.task_config)


@dataclasses.dataclass
class TaskResult:
  """Scores of one backend on one task.

  Attributes:
    task: the task name.
    correct: per-item exact-match results (item order of EvalConfig.examples).
    valid: per-item tool-call validity (tool_call only, else None).
    outputs: decoded outputs.
    chance: mean chance accuracy of the items.
  """

  task: str
  correct: list
  valid: list | None
  outputs: list
  chance: float

  @property
  def n(self) -> int:
    return len(self.correct)

  @property
  def accuracy(self) -> float:
    return float(np.mean(self.correct)) if self.correct else float("nan")

  @property
  def interval(self) -> tuple[float, float]:
    """95% Wilson interval of the accuracy."""
    return wilson_interval(int(sum(self.correct)), self.n)

  @property
  def validity(self) -> float | None:
    return float(np.mean(self.valid)) if self.valid is not None else None

  @property
  def validity_interval(self) -> tuple[float, float] | None:
    return wilson_interval(int(sum(self.valid)), self.n) if self.valid is not None else None

  def summary(self) -> dict:
    """JSON-ready scores: accuracy, its 95% Wilson interval, validity (tool calls), n, chance."""
    d = {"task": self.task, "n": self.n, "accuracy": self.accuracy,
         "ci95": list(self.interval), "chance": self.chance}
    if self.valid is not None:
      d.update(validity=self.validity, validity_ci95=list(self.validity_interval))
    return d


def score_outputs(examples: Sequence[Example], outputs: Sequence[Sequence[int]],
                  tok: CharTokenizer | None = None) -> TaskResult:
  """Scores generated ids against the items' answers (exact match; validity for tool calls).

  Raises:
    ValueError: the item and output counts differ, or the items mix tasks.
  """
  tok = tok or CharTokenizer()
  if len(examples) != len(outputs):
    raise ValueError(f"score_outputs: {len(examples)} items but {len(outputs)} outputs")
  tasks = {ex.task for ex in examples}
  if len(tasks) != 1:
    raise ValueError(f"score_outputs: items must share one task, got {sorted(tasks)}")
  task = tasks.pop()
  texts = [tok.decode(o) for o in outputs]
  correct = [is_correct(ex, t) for ex, t in zip(examples, texts)]
  valid = [tool_call_valid(t) for t in texts] if task == "tool_call" else None
  chance = float(np.mean([chance_accuracy(ex) for ex in examples]))
  return TaskResult(task=task, correct=correct, valid=valid, outputs=texts, chance=chance)


def evaluate_task(backend: Backend, examples: Sequence[Example], *,
                  max_new_tokens: int | None = None, tok: CharTokenizer | None = None
                  ) -> TaskResult:
  """Generates greedily for every item's prompt (``BOS prompt``) and scores the outputs."""
  tok = tok or CharTokenizer()
  task = examples[0].task
  prompts = [tok.encode(ex.prompt, bos=True) for ex in examples]
  outputs = backend.generate(prompts, max_new_tokens or MAX_NEW_TOKENS[task])
  return score_outputs(examples, outputs, tok)


def evaluate(backend: Backend, ecfg: EvalConfig = EvalConfig()) -> dict[str, TaskResult]:
  """Every task of ``ecfg`` on ``backend``: {task: TaskResult}."""
  return {t: evaluate_task(backend, ecfg.examples(t)) for t in ecfg.tasks}
