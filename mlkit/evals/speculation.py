"""Serving a model through the Engine with and without speculative decoding.

:func:`serve` runs prompts through an ``Engine`` in a closed loop (``concurrency``
requests in flight, the next submitted as one ends) with
``EngineConfig.speculative_tokens=k`` and reports the outputs, the output tokens
per second and the engine's speculation counters: drafts proposed and accepted,
the acceptance length (tokens a verify row emits: accepted drafts plus one) and
its histogram. Every step the run uses is compiled by a warm-up engine of the
same configuration first, so the timed run measures serving, not compiling.

:func:`measure` runs the ``speculative`` experiment's workload on a trained setup
(acceptance by task, decode speed with and without, the modelled H200 speedup);
``python -m mlkit.evals.speculation --setup stage1`` runs it from the command line.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from mlkit.config import ModelConfig
from mlkit.engine import Engine, EngineConfig
from mlkit.kvcache import KVCacheConfig
from mlkit.sampling import SamplingParams


@dataclasses.dataclass
class Run:
  """One closed-loop run's results.

  Attributes:
    outputs: each prompt's emitted tokens, in prompt order.
    tokens: output tokens in all.
    seconds: wall time of the timed run.
    decode_steps: engine decode steps (each verifies every running request once).
    speculation: the engine's ``metrics()["speculative"]`` (empty when k = 0).
  """

  outputs: list[list[int]]
  tokens: int
  seconds: float
  decode_steps: int
  speculation: dict

  @property
  def tok_s(self) -> float:
    return self.tokens / self.seconds if self.seconds > 0 else 0.0

  def to_json(self) -> dict:
    return {"tokens": self.tokens, "seconds": self.seconds, "tok_s": self.tok_s,
            "decode_steps": self.decode_steps, "speculation": self.speculation}


def engine_config(cfg: ModelConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                  k: int, concurrency: int, page_size: int = 16, backend: str | None = None
                  ) -> EngineConfig:
  """An engine sized for the prompts: one batch bucket (``concurrency``), one prefill bucket
  (the longest prompt, rounded up to a page), pages for every running request's prompt,
  output and speculative look-ahead."""
  longest = max(len(p) for p in prompts)
  chunk = -(-longest // page_size) * page_size
  pages_per_seq = -(-(longest + max_new_tokens + 2 * k) // page_size)
  return EngineConfig(model=cfg, kv=KVCacheConfig(concurrency * pages_per_seq + 1, page_size,
                                                  "float32"),
                      max_running=concurrency, batch_buckets=(concurrency,),
                      prefill_buckets=(chunk,), prefill_token_budget=chunk * concurrency,
                      max_pages_per_seq=pages_per_seq, speculative_tokens=k, backend=backend)


def _closed_loop(eng: Engine, prompts, sampling: SamplingParams, concurrency: int):
  ids: list[int] = []
  live: set[int] = set()
  nxt = 0
  while nxt < len(prompts) or live:
    while len(live) < concurrency and nxt < len(prompts):
      rid = eng.submit(prompts[nxt], sampling)
      ids.append(rid)
      live.add(rid)
      nxt += 1
    for o in eng.step():
      if o.done:
        live.discard(o.request_id)
  return ids


def serve(params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
          *, k: int, concurrency: int, backend: str | None = None, warm_up: bool = True,
          sized_for: tuple[Sequence[Sequence[int]], int] | None = None) -> Run:
  """Serves ``prompts`` with ``concurrency`` in flight and k drafts per step (0: off).

  Args:
    params: the model's params (with its ``mtp`` layers when k > 0).
    cfg: the model config (f32 for outputs that match exactly across k).
    prompts: token-id prompts.
    sampling: every request's sampling parameters.
    k: ``EngineConfig.speculative_tokens``.
    concurrency: requests in flight (also the engine's only batch bucket).
    backend: the kernel backend.
    warm_up: first serve some prompts on an engine of the same configuration, so that
      the timed run compiles nothing (off where only outputs and counters matter).
    sized_for: (prompts, max_new_tokens) to size the engine for instead of this run's own:
      runs of different prompts then share one configuration, and so their compiles.

  Returns:
    A :class:`Run`.
  """
  size_prompts, size_new = sized_for or (prompts, sampling.max_new_tokens)
  config = engine_config(cfg, size_prompts, size_new, k=k, concurrency=concurrency,
                         backend=backend)
  if warm_up:
    # Compiles the steps of this shape: twice as many prompts as rows, so that prompts are
    # also prefilled after decode steps, as in the timed run (a state that a step returned
    # is another jit signature than the fresh pool's).
    warm = Engine(params, config)
    _closed_loop(warm, list(prompts[:2 * concurrency]), sampling, concurrency)
  eng = Engine(params, config)
  t0 = time.perf_counter()
  ids = _closed_loop(eng, list(prompts), sampling, concurrency)
  seconds = time.perf_counter() - t0
  outputs = [list(eng.get(i).output) for i in ids]
  return Run(outputs=outputs, tokens=sum(len(o) for o in outputs), seconds=seconds,
             decode_steps=eng.stats.decode_steps,
             speculation=eng.metrics().get("speculative", {}))


TASKS = ("arithmetic", "retrieval", "tool_call")
# vLLM's GLM 5 recipe: three MTP drafts, average acceptance length 1.64.
VLLM_GLM5_ACCEPTANCE = 1.64


def measure(setup: str, *, items: int, ks: Sequence[int], concurrency: Sequence[int],
            accept_concurrency: int, backend: str | None = None, progress=print,
            one_engine_size: bool = False) -> dict:
  """Acceptance by task, decode speed with and without, and the modelled H200 speedup.

  The trained model of ``mlkit.evals.setups.TRAIN_SETUPS[setup]`` (trained first if not
  cached) serves in f32, greedy, with EOS stops:

  * each task's ``items`` evaluation prompts at ``accept_concurrency``, with every k of
    ``ks``: the engine's speculation counters, and whether the outputs equal k = 0's;
  * the tool-call prompts (64-token answers) at each of ``concurrency``: k = 0 against
    the k with the highest mean acceptance length, output tok/s;
  * ``mlkit.perfmodel.speculative_decode_step`` at the report's GLM 5.2 deployment with
    the acceptance measured here (mean over tasks) and with vLLM's GLM 5 figure.

  ``one_engine_size``: the speed runs take the acceptance runs' engine configuration (sized
  for every task's prompts) instead of one sized for the tool-call prompts, so they compile
  no step of their own (the smoke run).

  Returns:
    {"model", "acceptance": {task: {k: Run.to_json() + identical, base_decode_steps}},
     "best_k", "speed": [...], "modelled": {...}}.
  """
  from mlkit import perfmodel as pm
  from mlkit.evals import setups
  from mlkit.evals.harness import MAX_NEW_TOKENS
  from mlkit.evals.tasks import make_examples
  from mlkit.evals.tokenizer import EOS, CharTokenizer
  from mlkit.report.deployments import GLM, GLM_WORK

  say = progress or (lambda msg: None)
  tsetup = setups.TRAIN_SETUPS[setup]
  params, _ = setups.train_or_load(tsetup, progress=progress)
  cfg = dataclasses.replace(tsetup.model, dtype="float32", param_dtype="float32")
  tok = CharTokenizer()
  tc = setups.EVAL_SETUPS["quick"].tasks
  prompts, samplings = {}, {}
  for task in TASKS:
    prompts[task] = [tok.encode(ex.prompt, bos=True)
                     for ex in make_examples(task, items, seed=1234, tc=tc)]
    samplings[task] = SamplingParams(max_new_tokens=MAX_NEW_TOKENS[task], stop_tokens=(EOS,))

  def length(run_json: dict) -> float:
    return run_json["speculation"].get("acceptance_length", 1.0)

  acceptance: dict = {}
  c = accept_concurrency
  # One engine configuration for every task (sized for the longest prompt and answer), so
  # each k compiles once; these runs are not timed.
  every = ([p for t in TASKS for p in prompts[t]],
           max(samplings[t].max_new_tokens for t in TASKS))
  for task in TASKS:
    base = serve(params, cfg, prompts[task], samplings[task], k=0, concurrency=c,
                 backend=backend, warm_up=False, sized_for=every)
    acceptance[task] = {}
    for k in ks:
      r = serve(params, cfg, prompts[task], samplings[task], k=k, concurrency=c, backend=backend,
                warm_up=False, sized_for=every)
      same = r.outputs == base.outputs
      acceptance[task][k] = dict(r.to_json(), identical=same,
                                 base_decode_steps=base.decode_steps)
      say(f"speculative: {task}, k={k}: acceptance length {length(acceptance[task][k]):.2f}, "
          f"histogram {r.speculation.get('accepted_histogram')}, outputs "
          f"{'identical' if same else 'DIFFER'} to k=0")
  mean_length = {k: sum(length(acceptance[t][k]) for t in TASKS) / len(TASKS) for k in ks}
  best_k = max(ks, key=lambda k: mean_length[k])

  speed = []
  task = "tool_call"
  for conc in concurrency:
    n = max(len(prompts[task]), 2 * conc)
    ps = (prompts[task] * (-(-n // len(prompts[task]))))[:n]
    runs = {k: serve(params, cfg, ps, samplings[task], k=k, concurrency=conc, backend=backend,
                     sized_for=every if one_engine_size else None)
            for k in (0, best_k)}
    row = {"concurrency": conc, "k": best_k, "prompts": n, "tok_s_off": runs[0].tok_s,
           "tok_s_on": runs[best_k].tok_s, "speedup": runs[best_k].tok_s / runs[0].tok_s,
           "identical": runs[best_k].outputs == runs[0].outputs,
           "acceptance_length": runs[best_k].speculation.get("acceptance_length", 1.0)}
    speed.append(row)
    say(f"speculative: concurrency {conc}: {row['tok_s_off']:.0f} tok/s without, "
        f"{row['tok_s_on']:.0f} with k={best_k} ({row['speedup']:.2f}x)")

  cases = [(k, mean_length[k], "measured here") for k in ks]
  cases.append((3, VLLM_GLM5_ACCEPTANCE, "vLLM GLM 5 recipe"))
  modelled = []
  for k, al, source in cases:
    for conc in (1, 8, 32):
      m = pm.speculative_decode_step(GLM, conc, GLM_WORK, k, al)
      modelled.append({"k": k, "acceptance_length": al, "source": source, "concurrency": conc,
                       "plain_tok_s": m["plain_tok_s"], "tok_s": m["tok_s"],
                       "speedup": m["speedup"], "verify_gb": m["verify"]["bytes"] / 1e9,
                       "draft_gb": m["draft"]["bytes"] / 1e9})
  return {"model": cfg.name, "setup": setup, "items_per_task": items,
          "acceptance_concurrency": c, "speed_task": task, "best_k": best_k,
          "acceptance": {t: {str(k): v for k, v in r.items()} for t, r in acceptance.items()},
          "speed": speed,
          "modelled": {"deployment": GLM.name, "workload": dataclasses.asdict(GLM_WORK),
                       "rows": modelled}}


def main(argv=None) -> int:
  """``python -m mlkit.evals.speculation``: :func:`measure` on a trained setup, as JSON."""
  import argparse
  import json

  from mlkit.evals import setups
  p = argparse.ArgumentParser(prog="python -m mlkit.evals.speculation", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--setup", default="main", choices=sorted(setups.TRAIN_SETUPS),
                 help="the trained model (trained first if not cached: main takes ~2 h on "
                      "2 cores, stage1 ~20 min)")
  p.add_argument("--items", type=int, default=24, help="evaluation prompts per task")
  p.add_argument("--out", help="also write the results as JSON here")
  args = p.parse_args(argv)
  rec = measure(args.setup, items=args.items, ks=(1, 2, 3), concurrency=(1, 8, 32),
                accept_concurrency=8)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(rec, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
