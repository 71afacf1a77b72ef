"""Serving a model through the Engine with and without speculative decoding.

:func:`serve` runs prompts through an ``Engine`` in a closed loop (``concurrency``
requests in flight, the next submitted as one ends) with
``EngineConfig.speculative_tokens=k`` and reports the outputs, the output tokens
per second and the engine's speculation counters: drafts proposed and accepted,
the acceptance length (tokens a verify row emits: accepted drafts plus one) and
its histogram. Every step the run uses is compiled by a warm-up engine of the
same configuration first, so the timed run measures serving, not compiling.
The ``speculative`` experiment calls it per task and per concurrency.
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
          *, k: int, concurrency: int, backend: str | None = None) -> Run:
  """Serves ``prompts`` with ``concurrency`` in flight and k drafts per step (0: off).

  Args:
    params: the model's params (with its ``mtp`` layers when k > 0).
    cfg: the model config (f32 for outputs that match exactly across k).
    prompts: token-id prompts.
    sampling: every request's sampling parameters.
    k: ``EngineConfig.speculative_tokens``.
    concurrency: requests in flight (also the engine's only batch bucket).
    backend: the kernel backend.

  Returns:
    A :class:`Run`.
  """
  config = engine_config(cfg, prompts, sampling.max_new_tokens, k=k, concurrency=concurrency,
                         backend=backend)
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
