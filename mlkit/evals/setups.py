"""The accuracy ablation's model and sizes: training stages cached by fingerprint, eval sizes.

The results are about one trained model: MINI_MLA trained on the generated tasks
(``mlkit.evals.tasks``) in stages, each continuing its parent's finished model
(:data:`TRAIN_SETUPS`). Training takes about 90 minutes on 2 cores, so the finished
model is cached under ``$MLKIT_CACHE`` (default ``checkpoints/`` in the repository,
git-ignored), in a folder named by a fingerprint of the model, training and task
configs, so a changed field never loads a stale model; an interrupted stage resumes
from its orbax checkpoints (:func:`train_or_load`). Quick and full runs evaluate the
same model with more or fewer items (:data:`EVAL_SETUPS`); the smoke setups train
TINY_MLA a few steps in two stages. ``python -m experiments accuracy`` runs them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Callable

import numpy as np

from configs import MINI_MLA, TINY_MLA
from mlkit.checkpoint import checkpoint_steps, load_checkpoint, save_checkpoint
from mlkit.config import ModelConfig
from mlkit.evals.tasks import TaskConfig, max_example_tokens, packed_batch
from mlkit.measure import machine_info
from mlkit.train import TrainConfig, compute_config, train

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cache_dir() -> str:
  """Where trained models live: ``$MLKIT_CACHE`` or ``<repo>/checkpoints`` (git-ignored)."""
  return os.path.join(os.environ.get("MLKIT_CACHE", os.path.join(_REPO, "checkpoints")), "accuracy")


@dataclasses.dataclass(frozen=True)
class TrainSetup:
  """The trained model: which preset, on which tasks, with which recipe.

  Its fingerprint names the cache folder, so a changed field never loads a stale model.
  """

  # The preset (trained with f32 master weights, served in bf16).
  model: ModelConfig
  # The training run.
  train: TrainConfig
  # Task difficulty of the training stream.
  tasks: TaskConfig
  # Loss weight of prompt tokens (keys, operands and cities are random: unpredictable).
  prompt_weight: float = 0.0
  # How tasks share a batch: "tokens" (each task fills the same share of tokens, so short sums
  # come often) or "examples" (see mlkit.evals.tasks.packed_batch).
  mix: str = "tokens"
  # Tasks drawn (a task listed twice is drawn twice as often).
  task_mix: tuple[str, ...] = ("arithmetic", "retrieval", "tool_call")
  # A stage this one continues from (its finished model is the starting point), or None.
  parent: "TrainSetup | None" = None
  # Keep each packed example's attention inside the example, at positions from 0, as it is
  # served (segment ids, see mlkit.train.loss_fn); False lets examples see earlier ones in
  # their row.
  segments: bool = False

  def fingerprint(self) -> str:
    """A short stable hash of every field (and the parent's)."""
    fields = [self.model.to_dict(), dataclasses.asdict(self.train),
              dataclasses.asdict(self.tasks), self.prompt_weight, self.mix,
              list(self.task_mix), self.parent.fingerprint() if self.parent else None]
    if self.segments:  # appended only when set, so earlier stages keep their cached models
      fields.append({"segments": True})
    blob = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]

  def paths(self) -> tuple[str, str]:
    """(orbax train-state folder, finished-model folder) under :func:`cache_dir`."""
    base = os.path.join(cache_dir(), f"{self.model.name}-{self.fingerprint()}")
    return os.path.join(base, "train"), os.path.join(base, "model")


@dataclasses.dataclass(frozen=True)
class EvalSetup:
  """Evaluation sizes and tasks of one mode."""

  # Items per generation task (the same items for every recipe, so differences are paired).
  n_per_task: int
  # Held-out sequences for perplexity and KL.
  n_heldout: int
  # Rows of the GPTQ calibration batch.
  calib_rows: int
  # Task difficulty of the evaluation items (the long end of the retrieval contexts).
  tasks: TaskConfig
  # The longest prompt + answer served (the engine's max_seq_tokens and prefill chunk).
  max_seq_tokens: int
  # Recipe names evaluated (None: every one).
  recipes: tuple[str, ...] | None = None
  # Concurrent requests per engine (its one batch bucket).
  max_running: int = 16


# The model the results are about: quick and full evaluate the same trained model (trained
# once, then cached), so a quick run's numbers describe the real model with wider intervals.
# Task difficulty: two-digit sums (carries decide the leading digit), one-letter retrieval keys
# (a two-hop lookup; three-letter keys were not learned in this budget) and the tool calls.
# Training mixes every context length from 1 pair; evaluation takes the long end.
_TRAIN_TASKS = TaskConfig(arith_digits=(1, 2), retrieval_pairs=(1, 10), key_letters=1)
_EVAL_TASKS = TaskConfig(arith_digits=(1, 2), retrieval_pairs=(6, 10), key_letters=1,
                         query_first=True)
# Every stage trains the preset's multi-token-prediction layer (MINI_MLA and TINY_MLA have one)
# beside the model, with DeepSeek-V3's early-phase weight, so that the trained checkpoint has
# MTP layers to draft with (docs/speculative.md). The main model's loss is unchanged; the
# field is part of the fingerprint, so models cached without MTP layers are not reused.
MTP_LOSS_WEIGHT = 0.3
# Stage 1 learns the sums, the tool-call format and copying a value from the context (~18 min
# on 2 cores). It does not learn which key's value to copy: its retrieval accuracy falls to
# chance with 2 or more pairs.
_STAGE1 = TrainSetup(
    model=MINI_MLA,
    train=TrainConfig(steps=2400, batch_size=16, seq_len=96, learning_rate=3e-3, warmup_steps=50,
                      bias_update_rate=1e-3, log_every=25, checkpoint_every=200, seed=0,
                      mtp_loss_weight=MTP_LOSS_WEIGHT),
    tasks=_TRAIN_TASKS)
# Stage 2 continues it with retrieval drawn twice as often, over 2-10 pairs, where matching the
# key is the only way to the answer (~8 min). Measured: tool calls rose from 76.8% to 85.5% exact,
# retrieval stayed at chance.
_STAGE2 = TrainSetup(
    model=MINI_MLA,
    train=TrainConfig(steps=1000, batch_size=16, seq_len=96, learning_rate=2e-3, warmup_steps=30,
                      bias_update_rate=1e-3, log_every=25, checkpoint_every=200, seed=1,
                      mtp_loss_weight=MTP_LOSS_WEIGHT),
    tasks=TaskConfig(arith_digits=(1, 2), retrieval_pairs=(2, 10), key_letters=1),
    task_mix=("arithmetic", "retrieval", "retrieval", "tool_call"), parent=_STAGE1)
# Stage 3 asks for the key before the context, so each pair can be compared with the query as
# it is read; the value still sits up to ~50 tokens back (~8 min). Measured: tool calls 92.0%,
# arithmetic 99.5%; retrieval still at chance.
_STAGE3 = TrainSetup(
    model=MINI_MLA,
    train=TrainConfig(steps=1000, batch_size=16, seq_len=96, learning_rate=2e-3, warmup_steps=30,
                      bias_update_rate=1e-3, log_every=25, checkpoint_every=200, seed=2,
                      mtp_loss_weight=MTP_LOSS_WEIGHT),
    tasks=TaskConfig(arith_digits=(1, 2), retrieval_pairs=(1, 10), key_letters=1, query_first=True),
    task_mix=("arithmetic", "retrieval", "retrieval", "tool_call"), parent=_STAGE2)
# Stage 4 trains with segment ids: each example attends only to itself, from position 0, as
# when served (stages 1-3 let an example see the earlier ones in its row, so a query could
# match a key of another example), and retrieval fills 3/5 of the tokens (~25 min). Here the
# key match starts to be learned: retrieval rises above chance, first on short contexts.
_STAGE4 = dataclasses.replace(
    _STAGE3, train=dataclasses.replace(_STAGE3.train, steps=3000, seed=3),
    tasks=dataclasses.replace(_STAGE3.tasks, retrieval_pairs=(2, 10)),
    task_mix=("arithmetic", "retrieval", "retrieval", "retrieval", "tool_call"), parent=_STAGE3,
    segments=True)
# Stage 5 repeats stage 4's recipe with a fresh schedule (warm restart) and new data (~25 min);
# in it the lookup is learned at every context size (see the README's accuracy results).
_STAGE5 = dataclasses.replace(
    _STAGE4, train=dataclasses.replace(_STAGE4.train, seed=4), parent=_STAGE4)
_SMOKE_TRAIN = TrainConfig(steps=3, batch_size=2, seq_len=96, warmup_steps=1, log_every=1,
                           checkpoint_every=2, seed=0, mtp_loss_weight=MTP_LOSS_WEIGHT)
# The smoke model: TINY_MLA cut to one MoE layer (routed experts for the int4 recipes, MLA
# attention for the KV pools), so the run compiles as little as it can.
_SMOKE_MODEL = dataclasses.replace(TINY_MLA, n_layers=1, first_k_dense=0)
TRAIN_SETUPS = {
    "main": _STAGE5,
    # The main model's first stage alone (~20 min): it already emits arithmetic and tool
    # calls, and its MTP layer drafts them, so speculative decoding can be measured early.
    "stage1": _STAGE1,
    # Two short stages, so the smoke run also continues a stage from its parent (one train
    # config for both, with segment ids as the main model's last stages: the jitted step
    # compiles once).
    "smoke": TrainSetup(
        model=_SMOKE_MODEL,
        train=_SMOKE_TRAIN,
        tasks=TaskConfig(arith_digits=(1, 2), retrieval_pairs=(1, 4), key_letters=1,
                         query_first=True),
        segments=True,
        parent=TrainSetup(
            model=_SMOKE_MODEL, train=_SMOKE_TRAIN,
            tasks=TaskConfig(arith_digits=(1, 2), retrieval_pairs=(1, 4), key_letters=1),
            segments=True)),
}
_SMOKE_RECIPES = ("w-bf16/kv-bf16", "w-bf16/kv-fp8")
EVAL_SETUPS = {
    "smoke": EvalSetup(n_per_task=4, n_heldout=6, calib_rows=2, max_seq_tokens=96,
                       tasks=TaskConfig(arith_digits=(1, 2), retrieval_pairs=(2, 4), key_letters=1,
                                        query_first=True),
                       recipes=_SMOKE_RECIPES, max_running=4),
    "quick": EvalSetup(n_per_task=64, n_heldout=24, calib_rows=8, max_seq_tokens=96,
                       tasks=_EVAL_TASKS),
    "full": EvalSetup(n_per_task=400, n_heldout=192, calib_rows=32, max_seq_tokens=96,
                      tasks=_EVAL_TASKS),
}


def batch_fn(setup: TrainSetup):
  """Step -> packed batch; a pure function of (seed, step) so resumes are exact.

  Raises:
    ValueError: the rows are shorter than the longest task example.
  """
  tcfg = setup.train
  if max_example_tokens(setup.tasks) > tcfg.seq_len:
    raise ValueError(f"accuracy: seq_len {tcfg.seq_len} is shorter than the longest task example "
                     f"({max_example_tokens(setup.tasks)} tokens)")
  return lambda step: packed_batch(np.random.default_rng([tcfg.seed, step]), tcfg.batch_size,
                                   tcfg.seq_len, tasks=setup.task_mix, tc=setup.tasks,
                                   prompt_weight=setup.prompt_weight, mix=setup.mix,
                                   segments=setup.segments)


def train_or_load(setup: TrainSetup, progress: Callable[[str], None] | None = print
                  ) -> tuple[dict, dict]:
  """The trained params of ``setup`` (training, or resuming, if no finished model is cached).

  Args:
    setup: the stage; its parents are trained (or loaded) first.
    progress: called with a line per stage and every few training steps (None: silent).

  Returns:
    (f32 params, info dict: steps, train config, history, seconds, cached flag).

  Raises:
    ValueError: a stage continues a parent of another model.
  """
  say = progress or (lambda msg: None)
  tcfg = setup.train
  train_dir, model_dir = setup.paths()
  cfg = compute_config(setup.model, tcfg)
  if checkpoint_steps(model_dir):
    params, meta = _load(model_dir, cfg)
    say(f"accuracy: using the cached model in {model_dir}")
    return params, dict(meta, cached=True)
  init, parent_info = None, None
  if setup.parent is not None:
    if setup.parent.model != setup.model:
      raise ValueError("accuracy: a training stage must continue the same model as its parent")
    init, parent_info = train_or_load(setup.parent, progress)
    parent_info = {k: v for k, v in parent_info.items() if k != "cached"}
  say(f"accuracy: training {cfg.name} ({tcfg.steps} steps of {tcfg.batch_size}x{tcfg.seq_len} "
      f"tokens{', continuing a previous stage' if init else ''}) into {train_dir}")
  res = train(cfg, tcfg, batch_fn(setup), checkpoint_dir=train_dir, progress=progress, init=init)
  info = {"fingerprint": setup.fingerprint(), "steps": tcfg.steps, "parent": parent_info,
          "task_mix": list(setup.task_mix),
          "train_config": dataclasses.asdict(tcfg), "train_tasks": dataclasses.asdict(setup.tasks),
          "prompt_weight": setup.prompt_weight, "mix": setup.mix, "segments": setup.segments,
          "history": res.history,
          "train_seconds_this_run": res.seconds, "resumed_from": res.resumed_from,
          "machine": machine_info()}
  _save_meta(model_dir, info)  # before the checkpoint, whose presence marks the model finished
  save_checkpoint(model_dir, res.params, cfg, step=tcfg.steps, overwrite=True)
  return res.params, dict(info, cached=False)


def _save_meta(model_dir: str, info: dict) -> None:
  os.makedirs(model_dir, exist_ok=True)
  with open(os.path.join(model_dir, "train_info.json"), "w") as f:
    json.dump(info, f, indent=2, sort_keys=True, default=str)


def _load(model_dir: str, cfg) -> tuple[dict, dict]:
  params, _ = load_checkpoint(model_dir, cfg=cfg)
  with open(os.path.join(model_dir, "train_info.json")) as f:
    return params, json.load(f)
