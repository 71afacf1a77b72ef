"""Serving precision recipes scored against the bf16 reference, and the report's claims.

A recipe is a weight format (bf16, fp8, int4 round-to-nearest or int4 GPTQ) and a
KV-cache dtype (bf16 or fp8). :func:`evaluate_recipe` scores one through the serving
engine (task accuracy on generated items, ``mlkit.evals.harness``) and by teacher
forcing through the paged pool in its KV dtype (held-out perplexity, top-1 and KL
against the reference, ``mlkit.evals.teacher_forcing``); :func:`evaluate_disagg`
scores the report's disaggregated recipe through the two-pool engine. Every recipe
sees the same items, so :func:`compare_claims` can set the report's claims (fp8 KV,
INT4 weights, disaggregation: none costs accuracy) against paired differences with
95% intervals.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mlkit.config import ModelConfig
from mlkit.evals.tasks import retrieval_pairs

# Weight formats (see weight_recipe) and KV pool dtypes evaluated.
WEIGHT_FORMATS = ("bf16", "fp8", "int4-rtn", "int4-gptq")
KV_FORMATS = ("bfloat16", "float8_e4m3fn")


@dataclasses.dataclass(frozen=True)
class PrecisionRecipe:
  """One serving precision: a weight recipe name and a KV-cache dtype."""

  # Weight format: "bf16", "fp8", "int4-rtn" or "int4-gptq".
  weights: str
  # KV pool storage: "bfloat16" or "float8_e4m3fn".
  kv: str

  def __post_init__(self):
    if self.weights not in WEIGHT_FORMATS:
      raise ValueError(f"PrecisionRecipe.weights must be one of {WEIGHT_FORMATS}, got {self.weights!r}")
    if self.kv not in KV_FORMATS:
      raise ValueError(f"PrecisionRecipe.kv must be one of {KV_FORMATS}, got {self.kv!r}")

  @property
  def name(self) -> str:
    return f"w-{self.weights}/kv-{'fp8' if self.kv == 'float8_e4m3fn' else 'bf16'}"


RECIPES = tuple(PrecisionRecipe(w, kv) for w in WEIGHT_FORMATS for kv in KV_FORMATS)
REFERENCE = PrecisionRecipe("bf16", "bfloat16")
# The report's disaggregated serving (mlkit.evals.backends.DisaggBackend defaults): prefill with
# FP8_ALL weights into a bf16 KV cache, transfer, decode with INT4_EXPERTS weights from fp8 KV.
DISAGG = "disagg: w-fp8/kv-bf16 -> w-int4/kv-fp8"


def weight_recipe(name: str):
  """The mlkit.quant recipe behind a weight format name.

  int4 recipes quantise the routed experts (group 32, as Kimi K2.6 ships) and keep
  attention, shared experts and the dense FFN in fp8, so "int4 vs fp8" isolates
  the experts, as in the report's GLM 5.2 comparison (fp8 -> int4 checkpoint).
  """
  from mlkit.quant.recipe import Fp8Spec, bf16, fp8_all, int4_experts
  return {"bf16": bf16(), "fp8": fp8_all(),
          "int4-rtn": int4_experts(32, method="rtn", rest=Fp8Spec()),
          "int4-gptq": int4_experts(32, method="gptq", rest=Fp8Spec())}[name]


def serving_params(params_f32: dict):
  """The bf16 serving weights: every matrix in bf16, the router and its bias kept f32."""
  import jax
  import jax.numpy as jnp

  def cast(path, x):
    keys = [getattr(k, "key", None) for k in path]
    return x if any(isinstance(k, str) and k.startswith("router") for k in keys) \
        else x.astype(jnp.bfloat16)
  return jax.tree_util.tree_map_with_path(cast, params_f32)


def serving_config(model: ModelConfig) -> ModelConfig:
  """``model`` as served: bf16 weights and activations."""
  return dataclasses.replace(model, dtype="bfloat16", param_dtype="bfloat16")


def quantised_params(params_bf16: dict, weights: str, cfg, calib_tokens):
  """``params_bf16`` in the weight format ``weights`` (GPTQ calibrated on ``calib_tokens``)."""
  import jax.numpy as jnp
  from mlkit.model import forward
  from mlkit.quant.gptq import collect_calibration
  from mlkit.quant.recipe import calibration_paths, quantize_params
  recipe = weight_recipe(weights)
  calib = None
  if weights == "int4-gptq":
    tokens = jnp.asarray(calib_tokens)
    calib = collect_calibration(lambda p: forward(p, tokens, cfg=cfg), params_bf16,
                                calibration_paths(params_bf16, recipe))
  return quantize_params(params_bf16, recipe, calibration=calib)


# ----------------------------------------------------------------------------- evaluation

def retrieval_by_pairs(ecfg, results) -> dict[str, float]:
  """Retrieval accuracy per context size (number of key/value pairs), from scored results."""
  if "retrieval" not in results:
    return {}
  by: dict[int, list[bool]] = {}
  for ex, ok in zip(ecfg.examples("retrieval"), results["retrieval"].correct):
    by.setdefault(retrieval_pairs(ex), []).append(bool(ok))
  return {str(n): float(np.mean(v)) for n, v in sorted(by.items())}


def _task_fields(ecfg, results) -> dict:
  """The record fields both evaluations share: per-task summaries, samples, retrieval by size."""
  return {"tasks": {t: r.summary() for t, r in results.items()},
          "samples": {t: [{"prompt_tail": ex.prompt[-24:], "answer": ex.answer, "output": o}
                          for ex, o in zip(ecfg.examples(t)[:3], r.outputs[:3])]
                      for t, r in results.items()},
          "retrieval_by_pairs": retrieval_by_pairs(ecfg, results)}


def evaluate_recipe(params, cfg, recipe: PrecisionRecipe, ecfg, heldout, *, engine_kwargs=None,
                    ref_logprobs=None, backend_factory=None) -> tuple[dict, list, dict]:
  """Scores one recipe: task accuracy through the engine, and teacher-forced ppl / KL.

  Args:
    params: params already in ``recipe.weights`` format.
    cfg: the serving config.
    recipe: the precision recipe.
    ecfg: the EvalConfig.
    heldout: [(ids, is_answer)] held-out sequences.
    engine_kwargs: extra EngineBackend arguments.
    ref_logprobs: the reference recipe's per-sequence log-probs (None: this is the reference).
    backend_factory: (params, cfg, kv_dtype) -> backend; default the engine.

  Returns:
    (record, logprobs, task_results).
  """
  from mlkit.evals import (TaskResult, evaluate, paged_logprobs, perplexity, token_kl, token_nll,
                           token_top1_correct, wilson_interval)
  if backend_factory is None:
    from mlkit.evals.backends import EngineBackend
    kw = dict(engine_kwargs or {})
    backend = EngineBackend(params, cfg, kv_dtype=recipe.kv, **kw)
  else:
    backend = backend_factory(params, cfg, recipe.kv)
  results = evaluate(backend, ecfg)
  seqs = [s for s, _ in heldout]
  masks = [m for _, m in heldout]
  page_size = (engine_kwargs or {}).get("page_size")
  lps = paged_logprobs(params, cfg, seqs, kv_dtype=recipe.kv, page_size=page_size)
  nll = token_nll(lps, seqs, masks)
  top1 = token_top1_correct(lps, seqs, masks)
  rec = {"recipe": recipe.name, "weights": recipe.weights, "kv": recipe.kv,
         **_task_fields(ecfg, results),
         "heldout_answer_ppl": perplexity(nll), "heldout_answer_nll": float(np.mean(nll)),
         "heldout_tokens": int(nll.size),
         "heldout_answer_top1": float(np.mean(top1)),
         "heldout_answer_top1_ci95": list(wilson_interval(int(top1.sum()), int(top1.size)))}
  if ref_logprobs is not None:
    kl_all = token_kl(ref_logprobs, lps)
    kl_ans = token_kl(ref_logprobs, lps, masks)
    rec.update(kl_mean=float(np.mean(kl_all)), kl_answer_mean=float(np.mean(kl_ans)),
               kl_p99=float(np.quantile(kl_all, 0.99)), kl_tokens=int(kl_all.size))
  else:
    rec.update(kl_mean=0.0, kl_answer_mean=0.0, kl_p99=0.0, kl_tokens=0)
  # Teacher-forced answer tokens join the paired claim checks as a finer-grained "task" (tokens of
  # one sequence are correlated, so its interval is optimistic; it is labelled as such).
  results = dict(results)
  results["answer_top1 (tokens)"] = TaskResult(task="answer_top1 (tokens)", correct=top1.tolist(),
                                               valid=None, outputs=[], chance=0.0)
  return rec, lps, results


def evaluate_disagg(params_bf16, cfg, ecfg, *, engine_kwargs=None) -> tuple[dict, dict]:
  """Task accuracy of the disaggregated recipe (:data:`DISAGG`) through the DisaggEngine.

  Teacher-forced perplexity and KL are not defined for it (prompt and answer tokens
  see different weights), so the record has None there.

  Returns:
    (record, task_results).
  """
  from mlkit.evals import evaluate
  from mlkit.evals.backends import DisaggBackend
  backend = DisaggBackend(params_bf16, cfg, **dict(engine_kwargs or {}))
  results = evaluate(backend, ecfg)
  rec = {"recipe": DISAGG, "weights": "prefill fp8-all, decode int4-experts (rtn, g32)",
         "kv": "prefill bfloat16, decode float8_e4m3fn", **_task_fields(ecfg, results),
         "transfers": backend.engine.metrics()["disagg"],
         "heldout_answer_ppl": None, "heldout_answer_nll": None, "heldout_tokens": 0,
         "kl_mean": None, "kl_answer_mean": None, "kl_p99": None, "kl_tokens": 0}
  return rec, dict(results)


def compare_claims(records: dict[str, dict], results: dict[str, dict]) -> list[dict]:
  """The report's claims against the measured paired differences, per task.

  * fp8 KV vs bf16 KV (same weights): |delta| <= ~1 point.
  * int4 weights vs fp8 weights (same KV): |delta| <= 0.8 points.
  * the disaggregated recipe vs bf16 weights and KV: |delta| <= ~1 point (the
    report: none of the levers costs accuracy).

  Returns:
    Rows {claim, task, a, b, delta_points, ci95_points, holds}: ``holds`` is
    "yes" when the whole 95% interval of the paired difference is inside the
    claimed band, "no" when it is wholly outside, else "not resolved".
  """
  from mlkit.evals import paired_difference_interval
  rows = []

  def add(claim, band, a, b):
    a, b = getattr(a, "name", a), getattr(b, "name", b)
    if a not in results or b not in results:
      return
    for task in results[a]:
      if task not in results[b]:
        continue
      ra, rb = results[a][task], results[b][task]
      d, lo, hi = paired_difference_interval(ra.correct, rb.correct)
      holds = ("yes" if -band <= lo and hi <= band else
               "no" if lo > band or hi < -band else "not resolved")
      rows.append({"claim": claim, "task": task, "a": a, "b": b,
                   "delta_points": 100 * d, "ci95_points": [100 * lo, 100 * hi],
                   "band_points": 100 * band, "holds": holds})

  for w in WEIGHT_FORMATS:
    add("fp8 KV within ~1 point", 0.01, PrecisionRecipe(w, "bfloat16"),
        PrecisionRecipe(w, "float8_e4m3fn"))
  for kv in KV_FORMATS:
    for w in ("int4-rtn", "int4-gptq"):
      add("int4 weights within 0.8 points of fp8", 0.008, PrecisionRecipe("fp8", kv),
          PrecisionRecipe(w, kv))
  add("disaggregated within ~1 point of bf16", 0.01, REFERENCE, DISAGG)
  return rows
