"""Disaggregated serving: a prefill pool and a decode pool, each with its own precision.

Both pools derive their weights from one checkpoint through their own recipe
and keep KV in their own format. The default is the report's: prefill with
FP8_ALL weights and a bf16 KV cache (prefill is compute bound, and bf16 KV
keeps the prompt exact), decode with INT4_EXPERTS weights and an fp8 KV cache
(decode streams weights and KV, so fewer bytes is faster and holds more tokens).

One :meth:`DisaggEngine.step` on one host:

1. the prefill pool schedules and *dispatches* at most one prefill step (a
   batch of prompt chunks) on its sub-mesh, without waiting;
2. the decode pool runs one full ``Engine.step`` on its own, disjoint sub-mesh;
   JAX dispatch is asynchronous, so the two run on their devices at the same
   time, and decode never waits for a prefill;
3. the prefill results are read: a request whose prompt is done emits its first
   token (sampled by the prefill pool) and joins the transfer queue;
4. queued requests whose decode-pool pages can be allocated are transferred
   (``mlkit.engine.transfer``: bf16 -> fp8 with per-token scales, re-paged to
   the decode page size, written into pages the decode allocator just handed
   out with fresh tags, and verified by checksums before and after the move;
   with a prefix cache in the decode pool, the pages it already holds are
   shared and only the rest moves).
   A mismatch is retried; when every attempt fails the request is aborted with
   reason ``transfer`` and both pools' pages are returned;
5. requests the decode pool preempted go back to the prefill pool's queue, to
   be recomputed there.

``mode="colocated"`` describes a single plain ``Engine`` (the decode pool's
config and recipe) on one mesh instead, for comparison:
:func:`build_serving_engine` returns one.

Both pools are plain ``Engine`` objects on their own sub-meshes, composed only
through their public API: the prefill pool runs with role "prefill" (a request
whose prompt is done waits in ``prefilled()`` with its pages), its step split
into ``dispatch`` and ``collect``; the decode pool ``adopt``s a request with
a fill function that moves its KV, and hands back what it preempted through
``drain_preempted``. Admission, bookkeeping and the integrity defences are
each pool's own, written once in ``Engine``. docs/engine.md has the picture.

The same two roles as two processes, the KV moved by JAX's transfer server
through the same extract and land halves of ``transfer_kv``: ``mlkit.serve``
(docs/serving_processes.md).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Sequence

import jax
import numpy as np
from absl import logging

from mlkit.config import ModelConfig
from mlkit.engine.config import EngineConfig
from mlkit.engine.engine import Engine, check_logprobs
from mlkit.engine.request import ABORT_TRANSFER, Request, RequestOutput, RequestRejected  # noqa: F401
from mlkit.engine.serving import EndedWindow, ServingLoop
from mlkit.engine.transfer import Payload, TransferResult, flip_low_bit, transfer_kv
from mlkit.kvcache import KVCacheConfig, PagedKVState
from mlkit.model import check_params
from mlkit.parallel import DEFAULT_RULES, MeshConfig, ShardingRules, split_mesh
from mlkit.quant import FP8_ALL, INT4_EXPERTS, Recipe, kernel_int4_layout, quantize_params
from mlkit.sampling import SamplingParams

# Abort reason: the request's KV failed the transfer checksum on every attempt.
MODES = ("disaggregated", "colocated")


@dataclasses.dataclass(frozen=True)
class PoolConfig:
  """One serving pool: its engine shape, weight recipe and sub-mesh.

  Raises:
    ValueError: naming the field on a wrong type.
  """

  # The pool's engine: model, KV pool (dtype, page size, page count), batch buckets.
  engine: EngineConfig
  # Recipe turning the shared checkpoint into this pool's weights.
  recipe: Recipe
  # Axis sizes of the pool's sub-mesh; its device count is their product.
  mesh: MeshConfig = MeshConfig()
  # Split MLA pages over the pool's data axis (data-parallel attention).
  data_parallel_attention: bool = False

  def __post_init__(self):
    if not isinstance(self.engine, EngineConfig):
      raise ValueError(f"PoolConfig.engine must be an EngineConfig, got {type(self.engine).__name__}")
    if not isinstance(self.recipe, Recipe):
      raise ValueError(f"PoolConfig.recipe must be a Recipe, got {type(self.recipe).__name__}")
    if not isinstance(self.mesh, MeshConfig):
      raise ValueError(f"PoolConfig.mesh must be a MeshConfig, got {type(self.mesh).__name__}")

  @property
  def num_devices(self) -> int:
    return self.mesh.num_devices


@dataclasses.dataclass(frozen=True)
class DisaggConfig:
  """A prefill pool and a decode pool (or one colocated pool) serving one model.

  Raises:
    ValueError: naming the field: pools serving different models, an unknown
      mode, attempts < 1, a decode pool that cannot hold every sequence the
      prefill pool accepts.
  """

  # The prefill pool (report default: bf16 KV, FP8_ALL weights).
  prefill: PoolConfig
  # The decode pool (report default: fp8 KV, INT4_EXPERTS weights); alone in colocated mode.
  decode: PoolConfig
  # "disaggregated" (two pools on disjoint sub-meshes) or "colocated" (the decode pool does both).
  mode: str = "disaggregated"
  # Transfer attempts per request; a checksum mismatch retries until they run out, then aborts.
  transfer_attempts: int = 2
  # Let tests corrupt transfers through DisaggEngine.inject_transfer_fault (off in serving).
  enable_fault_injection: bool = False

  def __post_init__(self):
    for name in ("prefill", "decode"):
      if not isinstance(getattr(self, name), PoolConfig):
        raise ValueError(f"DisaggConfig.{name} must be a PoolConfig, "
                         f"got {type(getattr(self, name)).__name__}")
    if self.mode not in MODES:
      raise ValueError(f"DisaggConfig.mode must be one of {MODES}, got {self.mode!r}")
    if self.prefill.engine.model != self.decode.engine.model:
      raise ValueError("DisaggConfig.prefill and DisaggConfig.decode must serve the same model, got "
                       f"{self.prefill.engine.model.name!r} and {self.decode.engine.model.name!r}")
    kp, kd = self.prefill.engine.speculative_tokens, self.decode.engine.speculative_tokens
    if kp != kd:
      # The prefill pool writes the drafter's KV of the prompt (a layer of its pool) and the
      # first drafts, which the decode pool verifies: both pools draft, k tokens each.
      raise ValueError(f"DisaggConfig: speculative_tokens must be the same in both pools, got "
                       f"{kp} (prefill) and {kd} (decode)")
    if not isinstance(self.transfer_attempts, int) or self.transfer_attempts < 1:
      raise ValueError(f"DisaggConfig.transfer_attempts must be an int >= 1, "
                       f"got {self.transfer_attempts!r}")
    if self.mode == "disaggregated" and (self.decode.engine.max_seq_tokens
                                         < self.prefill.engine.max_seq_tokens):
      raise ValueError(f"DisaggConfig.decode holds at most {self.decode.engine.max_seq_tokens} "
                       f"tokens per sequence, fewer than the prefill pool's "
                       f"{self.prefill.engine.max_seq_tokens}: transferred requests could not fit")

  @property
  def model(self) -> ModelConfig:
    return self.decode.engine.model


def default_disagg_config(model: ModelConfig, *, prefill_devices: int = 4, decode_devices: int = 4,
                          prefill_page_size: int | None = None,
                          decode_page_size: int | None = None, num_pages: int = 64,
                          mode: str = "disaggregated", **engine_kwargs) -> DisaggConfig:
  """The report's split: prefill bf16 KV + FP8_ALL weights, decode fp8 KV + INT4_EXPERTS weights.

  Args:
    model: the model both pools serve.
    prefill_devices / decode_devices: devices per pool, all on the tensor axis.
    prefill_page_size / decode_page_size: tokens per page (None: the model's default).
    num_pages: pages in each pool.
    mode: "disaggregated" or "colocated".
    **engine_kwargs: further EngineConfig fields shared by both pools.

  Returns:
    The DisaggConfig.
  """
  def pool(devices, page_size, dtype, recipe):
    eng = EngineConfig(model=model, kv=KVCacheConfig(num_pages, page_size, dtype), **engine_kwargs)
    return PoolConfig(eng, recipe, MeshConfig(tensor=devices))

  return DisaggConfig(prefill=pool(prefill_devices, prefill_page_size, "bfloat16", FP8_ALL),
                      decode=pool(decode_devices, decode_page_size, "float8_e4m3fn", INT4_EXPERTS),
                      mode=mode)


@dataclasses.dataclass(frozen=True)
class TransferFault:
  """A test-only corruption of the next ``times`` transfer attempts.

  Attributes:
    where: "transit" (flip bits in the payload after it reached the decode pool)
      or "landing" (flip bits in a destination page after the write).
    times: how many attempts to corrupt.
    layer: which layer's first entry to corrupt.
  """

  where: str = "transit"
  times: int = 1
  layer: int = 0

  def __post_init__(self):
    if self.where not in ("transit", "landing"):
      raise ValueError(f"TransferFault.where must be 'transit' or 'landing', got {self.where!r}")
    if not isinstance(self.times, int) or self.times < 1:
      raise ValueError(f"TransferFault.times must be an int >= 1, got {self.times!r}")


@dataclasses.dataclass
class DisaggMetrics:
  """Counters of the disaggregated loop (host-side)."""

  iterations: int = 0
  # Iterations that ran a prefill step and a decode step at the same time.
  overlapped_iterations: int = 0
  prefill_steps: int = 0
  transfers: int = 0
  transfer_retries: int = 0
  transfer_failures: int = 0
  transfer_bytes: int = 0
  transfer_seconds: float = 0.0
  # Tokens not moved because the decode pool's prefix cache already held them.
  transfer_tokens_skipped: int = 0
  # Requests the decode pool preempted and sent back to the prefill pool.
  requeued: int = 0
  # Per iteration, the most recent TIMELINE_LENGTH: (prefill chunks dispatched, tokens the
  # decode pool emitted).
  timeline: collections.deque = dataclasses.field(
      default_factory=lambda: collections.deque(maxlen=TIMELINE_LENGTH))


# Iterations DisaggMetrics.timeline keeps (a server runs for weeks).
TIMELINE_LENGTH = 4096


def _quantize(checkpoint, pool: PoolConfig):
  """A pool's params: ``checkpoint`` in its recipe, int4 weights in the layout its
  engine's kernels read (docs/int4_matmul.md)."""
  return quantize_params(checkpoint, pool.recipe,
                         int4_layout=kernel_int4_layout(pool.engine.backend))


def build_serving_engine(checkpoint, config: DisaggConfig, devices: Sequence | None = None,
                         rules: ShardingRules = DEFAULT_RULES):
  """The engine a :class:`DisaggConfig` describes, from one dense checkpoint.

  Args:
    checkpoint: the dense params tree (bf16 or f32); each pool quantises it with its recipe.
    config: the DisaggConfig.
    devices: devices to place the pool(s) on (default ``jax.devices()``).
    rules: logical-axis rules for params and KV pages.

  Returns:
    A :class:`DisaggEngine` for mode "disaggregated"; for mode "colocated", a
    plain ``Engine`` with the decode pool's config and recipe on its mesh.

  Raises:
    ValueError: as :class:`DisaggEngine`.
  """
  if not isinstance(config, DisaggConfig):
    raise ValueError(f"build_serving_engine needs a DisaggConfig, got {type(config).__name__}")
  if config.mode == "disaggregated":
    return DisaggEngine(checkpoint, config, devices, rules)
  check_params(checkpoint, config.model, where="build_serving_engine")
  d = config.decode
  (mesh,) = split_mesh([d.mesh], list(jax.devices() if devices is None else devices))
  return Engine(_quantize(checkpoint, d), d.engine, mesh=mesh, rules=rules,
                data_parallel_attention=d.data_parallel_attention)


class DisaggEngine(ServingLoop):
  """Serves one model from a bf16 checkpoint with a prefill pool and a decode pool.

  Implements the serving interface (``mlkit.engine.serving.ServingEngine``).
  Requests are submitted to, and looked up in, the prefill pool's registry.

  Args:
    checkpoint: the dense params tree (bf16 or f32); each pool quantises it with its recipe.
    config: a :class:`DisaggConfig` with mode "disaggregated" (for "colocated",
      :func:`build_serving_engine` returns a plain ``Engine``).
    devices: devices to split into the pools (default ``jax.devices()``).
    rules: logical-axis rules for params and KV pages.

  Raises:
    ValueError: a colocated config, pools that need more devices than given, or a
      checkpoint that does not match the model config (names the first leaf that differs).
  """

  def __init__(self, checkpoint, config: DisaggConfig, devices: Sequence | None = None,
               rules: ShardingRules = DEFAULT_RULES):
    if not isinstance(config, DisaggConfig):
      raise ValueError(f"DisaggEngine needs a DisaggConfig, got {type(config).__name__}")
    if config.mode != "disaggregated":
      raise ValueError(f"DisaggEngine serves mode 'disaggregated', got {config.mode!r}: a "
                       "colocated pool is a plain Engine (use build_serving_engine)")
    check_params(checkpoint, config.model, where="DisaggEngine")
    self.config = config
    self.stats = DisaggMetrics()
    self._faults: collections.deque = collections.deque()
    # Why a request's transfer failed (request id -> reason), for requests aborted with
    # ABORT_TRANSFER; entries leave with their request (the window of ended requests).
    self.transfer_errors: dict[int, str] = {}
    p, d = config.prefill, config.decode
    devices = list(jax.devices() if devices is None else devices)
    self.prefill_mesh, self.decode_mesh = split_mesh([p.mesh, d.mesh], devices)
    self.prefill = Engine(_quantize(checkpoint, p), p.engine, mesh=self.prefill_mesh,
                          rules=rules, data_parallel_attention=p.data_parallel_attention,
                          role="prefill")
    self.decode = Engine(_quantize(checkpoint, d), d.engine, mesh=self.decode_mesh,
                         rules=rules, data_parallel_attention=d.data_parallel_attention)
    # Every request, from submit until it ends (and then in the window of recent ones,
    # decode.engine.retain_finished of them); each pool keeps only what it holds.
    self.requests: dict[int, Request] = {}
    self._ended = EndedWindow(self.requests, d.engine.retain_finished)

  # --------------------------------------------------------------- requests
  def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams()) -> int:
    """Queues a request (see ``Engine.submit`` for the checks) and returns its id.

    Raises:
      ValueError / RequestRejected: as ``Engine.submit``; also when the sequence
        could not fit the decode pool.
    """
    prompt, sampling = self.check_request(prompt_ids, sampling)
    rid = self.prefill.submit(prompt, sampling)
    self.requests[rid] = self.prefill.get(rid)
    return rid

  def check_request(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams()
                    ) -> tuple[tuple[int, ...], SamplingParams]:
    """Validates a request without queueing it (what ``submit`` checks).

    Raises:
      ValueError / RequestRejected: as :meth:`submit`.
    """
    prompt, sampling = self.prefill.check_request(prompt_ids, sampling)
    check_logprobs(sampling, self.decode.config.logprobs)  # the decode pool emits the rest
    total = len(prompt) + sampling.max_new_tokens
    limit = self.decode.max_seq_tokens
    if total > limit:
      raise RequestRejected(f"submit: prompt ({len(prompt)} tokens) + max_new_tokens = {total} "
                            f"tokens can never fit the decode pool's {limit} tokens per sequence")
    return prompt, sampling

  def cancel(self, request_id: int) -> bool:
    """Cancels a live request wherever it is; returns False if it had already ended.

    Raises:
      KeyError: unknown request id.
    """
    req = self.get(request_id)
    if req.done:
      return False
    for pool in (self.prefill, self.decode):
      if pool.holds(request_id):
        return pool.cancel(request_id)
    return False

  def has_unfinished(self) -> bool:
    return bool(self.prefill.has_unfinished() or self.prefill.prefilled()
                or self.decode.has_unfinished())

  @property
  def logits(self) -> dict[int, list[np.ndarray]]:
    """Per request, the sampled-position logits of every emitted token (record_logits configs)."""
    out = {rid: list(v) for rid, v in self.prefill.logits.items()}
    for rid, v in self.decode.logits.items():
      out.setdefault(rid, []).extend(v)
    return out

  # --------------------------------------------------------------- faults
  def inject_transfer_fault(self, fault: TransferFault) -> None:
    """Corrupts the next ``fault.times`` transfer attempts (tests only).

    Raises:
      RuntimeError: fault injection is disabled in the config.
      ValueError: the fault names a layer the model does not have.
    """
    if not self.config.enable_fault_injection:
      raise RuntimeError("fault injection is disabled (DisaggConfig.enable_fault_injection=False)")
    n_layers = self.config.model.n_layers
    if not 0 <= fault.layer < n_layers:
      raise ValueError(f"TransferFault.layer {fault.layer} is outside the model's {n_layers} layers")
    self._faults.extend([fault] * fault.times)

  # --------------------------------------------------------------- the loop
  def step(self) -> list[RequestOutput]:
    """One iteration: dispatch a prefill step, run a decode step, transfer finished prompts.

    Returns:
      RequestOutputs of every request that emitted tokens or ended this iteration.
    """
    m = self.stats
    outs: dict[int, RequestOutput] = {}

    def add(o: RequestOutput) -> None:
      # A request can appear twice in one iteration (first token, then a failed transfer).
      prev = outs.get(o.request_id)
      if prev is not None:
        o = dataclasses.replace(o, new_tokens=prev.new_tokens + o.new_tokens)
      outs[o.request_id] = o

    prefilling = self.prefill.dispatch()  # runs on its sub-mesh while the decode pool steps
    decoded = 0
    if self.decode.has_unfinished():
      for o in self.decode.step():
        add(o)
        decoded += len(o.new_tokens)
    for o in self.prefill.collect():
      add(o)
    for o in self._run_transfers():
      add(o)
    requeued = self.decode.drain_preempted()
    self.prefill.requeue(requeued)
    m.requeued += len(requeued)
    m.iterations += 1
    m.prefill_steps += int(prefilling)
    m.timeline.append((prefilling, decoded))
    if prefilling and decoded:
      m.overlapped_iterations += 1
    for o in outs.values():
      if o.done and o.request_id in self.requests:
        for rid in self._ended.add(self.requests[o.request_id]):
          self.transfer_errors.pop(rid, None)
    return list(outs.values())

  def metrics(self, include_requests: bool = False) -> dict:
    """Both pools' metrics added up, plus the transfer counters.

    Returns:
      The keys of ``Engine.metrics`` (counters summed over the pools; latencies
      and throughput over every request), plus {"pools": {"prefill": ...,
      "decode": ...}, "disagg": transfer and loop counters}.
    """
    pm, dm = self.prefill.metrics(), self.decode.metrics()
    out = {}
    for k, v in dm.items():
      if isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(pm.get(k), (int, float)):
        out[k] = pm[k] + v
      elif k == "speculative":  # verify rows run in the decode pool only
        out[k] = v
      elif isinstance(v, dict):
        out[k] = {r: pm.get(k, {}).get(r, 0) + v.get(r, 0) for r in {*pm.get(k, {}), *v}}
    first = [t for t in (self.prefill.stats.first_step_time, self.decode.stats.first_step_time)
             if t is not None]
    last = [t for t in (self.prefill.stats.last_step_time, self.decode.stats.last_step_time)
            if t is not None]
    elapsed = max(last) - min(first) if first else 0.0
    # A request's tokens: its first from the prefill pool, the rest from the decode pool.
    out.update(elapsed_s=elapsed, steps=self.stats.iterations,
               throughput_tok_s=out["generated_tokens"] / elapsed if elapsed > 0 else 0.0,
               running=dm["running"], waiting=pm["waiting"])
    out.update(self._mean_latencies(self.requests.values()))
    m = dataclasses.asdict(self.stats)
    m.pop("timeline")
    out["pools"] = {"prefill": pm, "decode": dm}
    out["disagg"] = m
    if include_requests:
      out["requests"] = {rid: self.request_metrics(rid) for rid in self.requests}
    return out

  # --------------------------------------------------------------- internals
  def _progress_marker(self):
    m = self.stats
    return (self.prefill.progress_marker(), self.decode.progress_marker(),
            m.transfers, m.transfer_failures, m.requeued)

  def _queue_summary(self) -> str:
    return (f"prefill pool: {self.prefill.queue_summary()}; "
            f"decode pool: {self.decode.queue_summary()}")

  def _run_transfers(self) -> list[RequestOutput]:
    """Moves prefilled requests into the decode pool while it admits them (FIFO)."""
    outs = []
    for req in self.prefill.prefilled():
      length = len(req.prefill_tokens)
      adopted = self.decode.adopt(req, length, functools.partial(self._fill, req, length))
      if adopted is None:
        break  # the decode pool is full: keep the prefill pages and try next iteration
      self.prefill.hand_over(req.request_id)  # source pages are free either way now
      if not adopted:
        self.stats.transfer_failures += 1
        self.transfer_errors[req.request_id] = req.error
        (logging.info if self.config.enable_fault_injection else logging.error)(
            "disagg: aborted request %d: %s", req.request_id, req.error)
        outs.append(RequestOutput(req.request_id, (), req.status, None, req.abort_reason))
    return outs

  def _fill(self, req: Request, length: int, dst_state: PagedKVState, dst_pages: list[int],
            start: int) -> tuple[PagedKVState, bool, str]:
    """Moves a request's KV from the prefill pool into ``dst_pages`` (the decode pool's adopt).

    The decode pool already holds positions [0, start) (its prefix cache shares
    them): only the rest moves.
    """
    self.stats.transfer_tokens_skipped += start
    src_pages = self.prefill.kv_pages(req.request_id)
    result = None
    for attempt in range(self.config.transfer_attempts):
      fault = self._faults.popleft() if self._faults else None
      t0 = time.perf_counter()
      dst_state, result = transfer_kv(
          self.prefill.state, src_pages, dst_state, dst_pages, length, start=start,
          dst_mesh=self.decode_mesh,
          corrupt_payload=_payload_corrupter(fault) if fault and fault.where == "transit" else None,
          corrupt_landing=_landing_corrupter(fault, dst_pages[0])
          if fault and fault.where == "landing" else None)
      m = self.stats
      m.transfer_seconds += time.perf_counter() - t0
      m.transfer_bytes += result.nbytes
      if result.ok:
        m.transfers += 1
        return dst_state, True, ""
      (logging.info if self.config.enable_fault_injection else logging.warning)(
          "disagg: request %d transfer attempt %d failed: %s", req.request_id, attempt + 1,
          result.reason)
      if attempt + 1 < self.config.transfer_attempts:
        m.transfer_retries += 1
    return dst_state, False, f"{result.reason} (after {self.config.transfer_attempts} attempts)"


def _payload_corrupter(fault: TransferFault):
  def corrupt(payload: Payload) -> Payload:
    payload = list(payload)
    layer = dict(payload[fault.layer])
    key = sorted(layer)[0]
    layer[key] = flip_low_bit(layer[key])
    payload[fault.layer] = layer
    return payload
  return corrupt


def _landing_corrupter(fault: TransferFault, page: int):
  def corrupt(state: PagedKVState) -> PagedKVState:
    layers = list(state.layers)
    layer = dict(layers[fault.layer])
    key = state.names[0]
    x = layer[key]
    layer[key] = x.at[page].set(flip_low_bit(x[page]))
    layers[fault.layer] = layer
    return state.replace(layers=layers)
  return corrupt


