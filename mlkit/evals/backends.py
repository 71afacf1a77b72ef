"""Generation backends for the harness: the serving engine, and the contiguous-cache
reference generator, and the disaggregated prefill/decode pools. All decode greedily
and stop after EOS.

This is the only evals module that imports :mod:`mlkit.engine`.
"""

from __future__ import annotations

from typing import Sequence

from mlkit.config import ModelConfig
from mlkit.evals.tokenizer import EOS
from mlkit.kvcache import KVCacheConfig
from mlkit.sampling import SamplingParams


def _engine_config(cfg: ModelConfig, kv_dtype: str, *, max_seq_tokens: int, max_running: int,
                   prefill_chunk: int, page_size: int | None, backend: str | None):
  """An engine with one batch bucket and one prefill bucket whose pool holds ``max_running``
  sequences of ``max_seq_tokens`` (one compilation per step kind)."""
  from mlkit.engine import EngineConfig  # evals sits at the engine's level
  kv = KVCacheConfig(num_pages=1, page_size=page_size, dtype=kv_dtype).resolve(cfg)
  pages_per_seq = -(-max_seq_tokens // kv.page_size)
  kv = KVCacheConfig(num_pages=max_running * pages_per_seq + 1, page_size=kv.page_size,
                     dtype=kv_dtype)
  return EngineConfig(model=cfg, kv=kv, max_running=max_running, batch_buckets=(max_running,),
                      prefill_buckets=(prefill_chunk,),
                      prefill_token_budget=prefill_chunk * max_running,
                      max_pages_per_seq=pages_per_seq, backend=backend)


def _greedy(engine, prompts: Sequence[Sequence[int]], max_new_tokens: int, who: str
            ) -> list[list[int]]:
  """Greedy outputs of ``engine.generate`` (stopping after EOS); any aborted request raises,
  because scoring a partial answer would make the accuracy meaningless."""
  sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_tokens=(EOS,))
  before = dict(engine.metrics()["aborted"])
  outs = engine.generate([list(p) for p in prompts], sp)
  # Counted, not looked up: the engine keeps only a window of ended requests.
  failed = {k: n - before.get(k, 0) for k, n in engine.metrics()["aborted"].items()
            if n > before.get(k, 0)}
  if failed:
    raise RuntimeError(f"{who}: {sum(failed.values())} requests aborted "
                       f"({', '.join(sorted(failed))}); accuracy would be meaningless")
  return outs


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
    from mlkit.engine import Engine  # evals sits at the engine's level
    self.config = _engine_config(cfg, kv_dtype, max_seq_tokens=max_seq_tokens,
                                 max_running=max_running, prefill_chunk=prefill_chunk,
                                 page_size=page_size, backend=backend)
    self.engine = Engine(params, self.config)

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    return _greedy(self.engine, prompts, max_new_tokens, "EngineBackend")


class DisaggBackend:
  """Greedy generation through :class:`mlkit.engine.disagg.DisaggEngine`: the report's
  disaggregated recipe, each pool quantising the same checkpoint its own way.

  By default the prefill pool runs FP8_ALL weights over a bf16 KV cache, and the decode
  pool INT4_EXPERTS weights over an fp8 KV cache; every prompt's KV moves from the
  prefill pool to the decode pool (bf16 -> fp8, checksummed) before decoding, and the
  page tags are checked on every decode step. Each pool gets its own device.

  Args:
    checkpoint: the bf16 params both pools quantise.
    cfg: the model config (its dtype is the compute dtype).
    max_seq_tokens: the longest prompt + output to serve.
    max_running: concurrent requests per pool (each pool's batch bucket).
    prefill_chunk: the one prefill chunk length.
    page_size: tokens per page in both pools (default: the model kind's default).
    prefill_recipe / decode_recipe: the pools' weight recipes (default the report's).
    prefill_kv / decode_kv: the pools' KV dtypes (default the report's).
    devices: at least two devices (default ``jax.devices()``); the first is the
      prefill pool's, the second the decode pool's.
    backend: kernel backend for both engines (None: platform default).

  Raises:
    ValueError: fewer than two devices.
  """

  def __init__(self, checkpoint, cfg: ModelConfig, *, max_seq_tokens: int = 256,
               max_running: int = 8, prefill_chunk: int = 256, page_size: int | None = None,
               prefill_recipe=None, decode_recipe=None, prefill_kv: str = "bfloat16",
               decode_kv: str = "float8_e4m3fn", devices=None, backend: str | None = None):
    import jax

    from mlkit.engine.disagg import DisaggConfig, DisaggEngine, PoolConfig
    from mlkit.parallel import MeshConfig
    from mlkit.quant import FP8_ALL, INT4_EXPERTS
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < 2:
      raise ValueError(f"DisaggBackend needs two devices (one per pool), got {len(devices)}; on "
                       "CPU set XLA_FLAGS=--xla_force_host_platform_device_count=2 before JAX starts")

    def pool(kv_dtype, recipe):
      eng = _engine_config(cfg, kv_dtype, max_seq_tokens=max_seq_tokens, max_running=max_running,
                           prefill_chunk=prefill_chunk, page_size=page_size, backend=backend)
      return PoolConfig(eng, recipe, MeshConfig())

    self.config = DisaggConfig(prefill=pool(prefill_kv, prefill_recipe or FP8_ALL),
                               decode=pool(decode_kv, decode_recipe or INT4_EXPERTS))
    self.engine = DisaggEngine(checkpoint, self.config, devices=devices[:2])

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    return _greedy(self.engine, prompts, max_new_tokens, "DisaggBackend")
