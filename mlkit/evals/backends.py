"""Generation backends for the harness: the serving engine, and the contiguous-cache
reference generator. Both decode greedily and stop after EOS.

This is the only evals module that imports :mod:`mlkit.engine`.
"""

from __future__ import annotations

from typing import Sequence

from mlkit.config import ModelConfig
from mlkit.evals.tokenizer import EOS
from mlkit.generate import generate
from mlkit.kvcache import KVCacheConfig
from mlkit.sampling import SamplingParams


class GenerateBackend:
  """Greedy generation with :func:`mlkit.generate.generate` (contiguous cache, cfg.dtype KV).

  Args:
    params: model params (any weight formats).
    cfg: the model config.
    batch_size: prompts per call (fixed, so one compilation per prompt-length bucket).
  """

  def __init__(self, params, cfg: ModelConfig, batch_size: int = 16):
    self.params, self.cfg, self.batch_size = params, cfg, batch_size

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_tokens=(EOS,))
    out: list[list[int]] = []
    for i in range(0, len(prompts), self.batch_size):
      out += generate(self.params, self.cfg, list(prompts[i:i + self.batch_size]), sp).tokens
    return out


class EngineBackend:
  """Greedy generation through :class:`mlkit.engine.Engine`: paged KV pool in ``kv_dtype``,
  continuous batching, the page-tag check on every step.

  One engine serves every call, so its jitted steps compile once per shape.

  Args:
    params: model params (any weight formats).
    cfg: the model config (its dtype is the compute dtype).
    kv_dtype: the pool's storage dtype ("bfloat16" or "float8_e4m3fn").
    max_seq_tokens: the longest prompt + output to serve.
    max_running: concurrent requests (the engine's batch bucket).
    prefill_chunk: the one prefill chunk length (a single bucket keeps compilations to two).
    page_size: tokens per page (default: the model kind's default).
    backend: kernel backend for the engine (None: platform default).
  """

  def __init__(self, params, cfg: ModelConfig, *, kv_dtype: str = "bfloat16",
               max_seq_tokens: int = 256, max_running: int = 8, prefill_chunk: int = 256,
               page_size: int | None = None, backend: str | None = None):
    from mlkit.engine import Engine, EngineConfig  # evals sits at the engine's level
    kv = KVCacheConfig(num_pages=1, page_size=page_size, dtype=kv_dtype).resolve(cfg)
    pages_per_seq = -(-max_seq_tokens // kv.page_size)
    kv = KVCacheConfig(num_pages=max_running * pages_per_seq + 1, page_size=kv.page_size,
                       dtype=kv_dtype)
    self.config = EngineConfig(model=cfg, kv=kv, max_running=max_running,
                               batch_buckets=(max_running,), prefill_buckets=(prefill_chunk,),
                               prefill_token_budget=prefill_chunk * max_running,
                               max_pages_per_seq=pages_per_seq, backend=backend)
    self.engine = Engine(params, self.config)

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_tokens=(EOS,))
    outs = self.engine.generate([list(p) for p in prompts], sp)
    failed = [r for r in self.engine.requests.values() if r.abort_reason is not None]
    if failed:
      raise RuntimeError(f"EngineBackend: {len(failed)} requests aborted "
                         f"({failed[0].abort_reason}); accuracy would be meaningless")
    return outs
