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
   out with fresh tags, and verified by checksums before and after the move).
   A mismatch is retried; when every attempt fails the request is aborted with
   reason ``transfer`` and both pools' pages are returned;
5. requests the decode pool preempted go back to the prefill pool's queue, to
   be recomputed there.

``mode="colocated"`` serves with a single ``Engine`` (the decode pool's config
and recipe) on one mesh instead, for comparison.

The pools reuse the engine's pieces unchanged: the decode pool *is* an
``Engine`` whose params and KV state live on its sub-mesh; the prefill pool is
an ``Engine`` too, of which this module uses the scheduler, allocator, runner
and request bookkeeping (it never calls its ``step``).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Sequence

import jax
import numpy as np
from absl import logging

from mlkit.config import ModelConfig
from mlkit.engine.config import EngineConfig
from mlkit.engine.engine import Engine, EngineStalled, build_prefill_batch, check_batch
from mlkit.engine.request import (ABORT_CANCELLED, ABORT_TRANSFER, Request,
                                  RequestOutput, RequestRejected, RequestStatus)
from mlkit.engine.runner import StepBatch
from mlkit.engine.transfer import Payload, TransferResult, transfer_kv
from mlkit.kvcache import KVCacheConfig, PagedKVState, sync_tags
from mlkit.model import check_params
from mlkit.parallel import (DEFAULT_RULES, MeshConfig, ShardingRules, shard_kv_state,
                            shard_params, split_mesh)
from mlkit.quant import FP8_ALL, INT4_EXPERTS, Recipe, quantize_params
from mlkit.sampling import SamplingParams

# Abort reason: the request's KV failed the transfer checksum on every attempt.
MODES = ("disaggregated", "colocated")


def make_sharded_engine(params, config: EngineConfig, mesh, rules: ShardingRules = DEFAULT_RULES,
                        *, data_parallel_attention: bool = False) -> Engine:
  """An unchanged ``Engine`` whose params and KV state live on ``mesh``.

  Args:
    params: the params (any weight formats), e.g. already quantised.
    config: the engine config.
    mesh: a mesh from ``mlkit.parallel`` (1 device or many).
    rules: logical-axis rules for the params and KV pages.
    data_parallel_attention: split MLA pages over the mesh's data axis.

  Returns:
    The Engine; every jitted step runs SPMD over the mesh because its inputs live there.
  """
  engine = Engine(shard_params(params, mesh, rules, config.model), config)
  engine.state = shard_kv_state(engine.state, mesh, rules, data_parallel=data_parallel_attention)
  return engine


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
  # Requests the decode pool preempted and sent back to the prefill pool.
  requeued: int = 0
  # Per iteration: (prefill chunks dispatched, tokens the decode pool emitted).
  timeline: list = dataclasses.field(default_factory=list)


def _flip_first(x):
  """x with the low bit of its first element flipped (a one-bit corruption)."""
  words = jax.lax.bitcast_convert_type(x, {1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])
  flat = words.reshape(-1)
  flat = flat.at[0].set(flat[0] ^ flat.dtype.type(1))
  return jax.lax.bitcast_convert_type(flat.reshape(x.shape), x.dtype)


class DisaggEngine:
  """Serves one model from a bf16 checkpoint with disaggregated (or colocated) pools.

  Args:
    checkpoint: the dense params tree (bf16 or f32); each pool quantises it with its recipe.
    config: a :class:`DisaggConfig`.
    devices: devices to split into the pools (default ``jax.devices()``).
    rules: logical-axis rules for params and KV pages.

  Raises:
    ValueError: if the pools need more devices than given, or the checkpoint does not
      match the model config (names the first leaf that differs).
  """

  def __init__(self, checkpoint, config: DisaggConfig, devices: Sequence | None = None,
               rules: ShardingRules = DEFAULT_RULES):
    if not isinstance(config, DisaggConfig):
      raise ValueError(f"DisaggEngine needs a DisaggConfig, got {type(config).__name__}")
    check_params(checkpoint, config.model, where="DisaggEngine")
    self.config = config
    self.metrics_ = DisaggMetrics()
    self._faults: collections.deque = collections.deque()
    devices = list(jax.devices() if devices is None else devices)
    d = config.decode
    # Why a request's transfer failed (request id -> reason), for requests aborted with ABORT_TRANSFER.
    self.transfer_errors: dict[int, str] = {}
    if config.mode == "colocated":
      (self.decode_mesh,) = split_mesh([d.mesh], devices)
      self.prefill_mesh = None
      self.decode = make_sharded_engine(quantize_params(checkpoint, d.recipe), d.engine,
                                        self.decode_mesh, rules,
                                        data_parallel_attention=d.data_parallel_attention)
      self.prefill = None
      self.requests = self.decode.requests
      return
    p = config.prefill
    self.prefill_mesh, self.decode_mesh = split_mesh([p.mesh, d.mesh], devices)
    self.prefill = make_sharded_engine(quantize_params(checkpoint, p.recipe), p.engine,
                                       self.prefill_mesh, rules,
                                       data_parallel_attention=p.data_parallel_attention)
    self.decode = make_sharded_engine(quantize_params(checkpoint, d.recipe), d.engine,
                                      self.decode_mesh, rules,
                                      data_parallel_attention=d.data_parallel_attention)
    # One registry: requests are created by the prefill pool and looked up in either.
    self.requests = self.prefill.requests
    self.decode.requests = self.requests
    self._transfer_queue: collections.deque[Request] = collections.deque()
    self._prefill_logits: dict[int, list[np.ndarray]] = {}
    self._prefill_tags_dirty = False
    self._admit_counter = 0

  @property
  def colocated(self) -> bool:
    return self.config.mode == "colocated"

  # --------------------------------------------------------------- requests
  def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams()) -> int:
    """Queues a request (see ``Engine.submit`` for the checks) and returns its id.

    Raises:
      ValueError / RequestRejected: as ``Engine.submit``; also when the sequence
        could not fit the decode pool.
    """
    if self.colocated:
      return self.decode.submit(prompt_ids, sampling)
    return self.prefill._enqueue(*self.check_request(prompt_ids, sampling))  # noqa: SLF001

  def check_request(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams()
                    ) -> tuple[tuple[int, ...], SamplingParams]:
    """Validates a request without queueing it (what ``submit`` checks).

    Raises:
      ValueError / RequestRejected: as :meth:`submit`.
    """
    if self.colocated:
      return self.decode.check_request(prompt_ids, sampling)
    prompt, sampling = self.prefill.check_request(prompt_ids, sampling)
    total = len(prompt) + sampling.max_new_tokens
    limit = self.config.decode.engine.max_seq_tokens
    if total > limit:
      raise RequestRejected(f"submit: prompt ({len(prompt)} tokens) + max_new_tokens = {total} "
                            f"tokens can never fit the decode pool's {limit} tokens per sequence")
    return prompt, sampling

  def get(self, request_id: int) -> Request:
    """The Request (status, output, reasons). Raises KeyError if unknown."""
    if request_id not in self.requests:
      raise KeyError(f"unknown request id {request_id!r}")
    return self.requests[request_id]

  def cancel(self, request_id: int) -> bool:
    """Cancels a live request wherever it is; returns False if it had already ended."""
    if self.colocated:
      return self.decode.cancel(request_id)
    req = self.get(request_id)
    if req.done:
      return False
    if req in self._transfer_queue:
      self._transfer_queue.remove(req)
      self.prefill.allocator.release_checked(req.request_id)
      self._prefill_tags_dirty = True
    elif self.prefill.scheduler.remove(req):
      self._prefill_tags_dirty = True
    else:
      return self.decode.cancel(request_id)
    self._end(req, RequestStatus.ABORTED, abort_reason=ABORT_CANCELLED)
    return True

  def has_unfinished(self) -> bool:
    if self.colocated:
      return self.decode.has_unfinished()
    return bool(self.prefill.has_unfinished() or self._transfer_queue
                or self.decode.has_unfinished())

  @property
  def logits(self) -> dict[int, list[np.ndarray]]:
    """Per request, the sampled-position logits of every emitted token (record_logits configs)."""
    if self.colocated:
      return self.decode.logits
    out = {rid: list(v) for rid, v in self._prefill_logits.items()}
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
    if self.colocated:
      return self.decode.step()
    m = self.metrics_
    plan, pending, ended = self._dispatch_prefill()
    outs: dict[int, RequestOutput] = {}

    def add(o: RequestOutput) -> None:
      # A request can appear twice in one iteration (first token, then a failed transfer).
      prev = outs.get(o.request_id)
      if prev is not None:
        o = dataclasses.replace(o, new_tokens=prev.new_tokens + o.new_tokens)
      outs[o.request_id] = o

    for r in ended:
      add(RequestOutput(r.request_id, (), r.status, r.finish_reason, r.abort_reason))
    decoded = 0
    if self.decode.has_unfinished():  # runs while the prefill step is in flight
      for o in self.decode.step():
        add(o)
        decoded += len(o.new_tokens)
    if pending is not None:
      for o in self._collect_prefill(plan, pending):
        add(o)
    for o in self._run_transfers():
      add(o)
    self._requeue_preempted()
    m.iterations += 1
    m.timeline.append((len(plan.prefill) if plan is not None else 0, decoded))
    if pending is not None and decoded:
      m.overlapped_iterations += 1
    return list(outs.values())

  def run_until_done(self, max_steps: int | None = None) -> dict[int, Request]:
    """Steps until every request has ended.

    Raises:
      EngineStalled: an iteration made no progress, or max_steps ran out.
    """
    if self.colocated:
      return self.decode.run_until_done(max_steps)
    steps = 0
    while self.has_unfinished():
      before = self._progress_marker()
      self.step()
      steps += 1
      if self._progress_marker() == before:
        raise EngineStalled(f"disaggregated engine made no progress in iteration {steps}: "
                            f"{len(self.prefill.scheduler.waiting)} waiting, "
                            f"{len(self._transfer_queue)} awaiting transfer, "
                            f"{len(self.decode.scheduler.running)} decoding")
      if max_steps is not None and steps >= max_steps and self.has_unfinished():
        raise EngineStalled(f"requests still unfinished after {max_steps} iterations")
    return self.requests

  def generate(self, prompts: Sequence[Sequence[int]],
               sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams()
               ) -> list[list[int]]:
    """Submits every prompt, runs to completion, returns each request's tokens in order.

    Atomic: every request is checked before any is queued.

    Raises:
      ValueError: as :meth:`submit` for any prompt (nothing is queued), or a SamplingParams
        list whose length differs from the prompts'.
    """
    checked = check_batch(self.check_request, prompts, sampling)
    engine = self.decode if self.colocated else self.prefill
    ids = [engine._enqueue(p, s) for p, s in checked]  # noqa: SLF001
    self.run_until_done()
    return [list(self.requests[i].output) for i in ids]

  def metrics(self) -> dict:
    """{"decode": decode-pool metrics, "prefill": prefill-pool metrics, "disagg": loop counters}."""
    out = {"decode": self.decode.metrics()}
    if not self.colocated:
      m = dataclasses.asdict(self.metrics_)
      m.pop("timeline")
      out["prefill"] = self.prefill.metrics()
      out["disagg"] = m
    return out

  # --------------------------------------------------------------- internals
  def _progress_marker(self):
    m = self.metrics_
    return (sum(len(r.output) for r in self.requests.values()),
            sum(r.num_computed for r in self.requests.values()),
            sum(r.done for r in self.requests.values()), m.transfers, m.requeued,
            self.decode.stats.preemptions, self.prefill.stats.preemptions)

  def _dispatch_prefill(self):
    """Audits and schedules the prefill pool and dispatches its step.

    Returns:
      (plan, device outputs or None, requests the prefill pool ended before the step:
      page-audit holders and rows that could not be built).
    """
    P = self.prefill
    self._prefill_t0 = time.perf_counter()
    ended = self._prefill_ended(P.audit_pages())
    plan = P.scheduler.schedule()
    # Nothing lives in the prefill pool in DECODING state, so the plan decodes nothing.
    assert not plan.decode, "prefill pool planned a decode step"
    P.stats.preemptions += len(plan.preempted)
    dropped = self._prefill_ended(P.enforce_conservation(P.allocator.drain_violations()))
    ended += dropped
    plan = plan.without(set(dropped))
    if plan.allocation_changed or self._prefill_tags_dirty or P._tags_dirty:  # noqa: SLF001
      P.state = sync_tags(P.state, P.allocator.device_tags())
      self._prefill_tags_dirty = P._tags_dirty = False  # noqa: SLF001
    if not plan.prefill:
      return plan, None, ended
    batch, rows, failed = build_prefill_batch(P.config, P.scheduler, plan.prefill)
    for req, err in failed:
      P._error_abort(req, err)  # noqa: SLF001
      ended.append(req)
    plan = dataclasses.replace(plan, prefill=rows)
    if batch is None:
      return plan, None, ended
    tok, ok, P.state, lg = P.runner.run("prefill", P.state, batch)
    self.metrics_.prefill_steps += 1
    return plan, (tok, ok, lg), ended

  def _prefill_ended(self, reqs: list[Request]) -> list[Request]:
    """Requests the prefill pool aborted: they leave the transfer queue too."""
    for r in reqs:
      if r in self._transfer_queue:
        self._transfer_queue.remove(r)
    return list(reqs)

  def _collect_prefill(self, plan, pending) -> list[RequestOutput]:
    P = self.prefill
    tok, ok, lg = jax.device_get(pending)
    now = time.perf_counter()
    P.stats.record_step(host_s=0.0, device_s=now - self._prefill_t0, prefill=True, decode=False,
                        generated=0, prefilled=0, start=self._prefill_t0)
    outs = []
    for i, item in enumerate(plan.prefill):
      req = item.req
      n_before = len(req.output)
      if not ok[i]:
        P._integrity_abort(req, "its page-tag check failed in the prefill pool")  # noqa: SLF001
        self._prefill_tags_dirty = True
      else:
        try:
          self._finish_prefill_row(req, item, tok[i], lg[i] if lg is not None else None, now)
        except Exception as e:  # one request's bad state must not stop the others
          if req in self._transfer_queue:
            self._transfer_queue.remove(req)
          if P.allocator.has_request(req.request_id):
            P.allocator.release_checked(req.request_id)
          P._error_abort(req, f"{type(e).__name__}: {e}")  # noqa: SLF001
          self._prefill_tags_dirty = True
      outs.append(RequestOutput(req.request_id, tuple(req.output[n_before:]), req.status,
                                req.finish_reason, req.abort_reason))
    return outs

  def _finish_prefill_row(self, req: Request, item, token, logits, now: float) -> None:
    """Host bookkeeping of one finished prefill row: emit, then finish or queue the transfer."""
    P = self.prefill
    req.num_computed += item.n
    P.stats.prefill_tokens += item.n
    if req.num_computed == len(req.prefill_tokens):
      req.emit(int(token), now)
      P.stats.generated_tokens += 1
      if logits is not None:
        self._prefill_logits.setdefault(req.request_id, []).append(np.asarray(logits))
      # Out of the prefill scheduler (it would otherwise plan decodes for it), pages kept.
      P.scheduler.running.remove(req)
      P.scheduler.invalidate_rows()
      reason = req.should_stop()
      if reason is not None:
        P.allocator.release_checked(req.request_id)
        self._prefill_tags_dirty = True
        self._end(req, RequestStatus.FINISHED, finish_reason=reason)
      else:
        req.status = RequestStatus.DECODING
        self._transfer_queue.append(req)

  def _run_transfers(self) -> list[RequestOutput]:
    """Moves queued requests into the decode pool while it has room (FIFO)."""
    D, P = self.decode, self.prefill
    outs = []
    while self._transfer_queue:
      req = self._transfer_queue[0]
      length = len(req.prefill_tokens)
      need = D.allocator.pages_for(length)
      reserve = D.config.admission_reserve if D.scheduler.running else 0
      if (len(D.scheduler.running) >= D.config.max_running
          or need + reserve > D.allocator.num_free):
        break  # the decode pool is full: keep the prefill pages and try next iteration
      self._transfer_queue.popleft()
      if D.allocator.admit(req.request_id, length) is not None:
        self._transfer_queue.appendleft(req)
        break
      result = self._transfer_one(req, length)
      P.allocator.release_checked(req.request_id)  # source pages are free either way now
      self._prefill_tags_dirty = True
      if result.ok:
        req.admit_seq = self._admit_counter
        self._admit_counter += 1
        D.scheduler.running.append(req)
      else:
        D.allocator.release_checked(req.request_id)
        D.state = sync_tags(D.state, D.allocator.device_tags())
        self.metrics_.transfer_failures += 1
        logging.error("disagg: aborting request %d: %s", req.request_id, result.reason)
        self._end(req, RequestStatus.ABORTED, abort_reason=ABORT_TRANSFER)
        self.transfer_errors[req.request_id] = result.reason
        outs.append(RequestOutput(req.request_id, (), req.status, None, req.abort_reason))
    return outs

  def _transfer_one(self, req: Request, length: int) -> TransferResult:
    D, P = self.decode, self.prefill
    src_pages = [p for p, _ in P.allocator.block_table(req.request_id)]
    dst_pages = [p for p, _ in D.allocator.block_table(req.request_id)]
    # Fresh tags of the newly allocated pages go to the device before anything checks them.
    D.state = sync_tags(D.state, D.allocator.device_tags())
    result = None
    for attempt in range(self.config.transfer_attempts):
      fault = self._faults.popleft() if self._faults else None
      t0 = time.perf_counter()
      D.state, result = transfer_kv(
          P.state, src_pages, D.state, dst_pages, length, dst_mesh=self.decode_mesh,
          corrupt_payload=_payload_corrupter(fault) if fault and fault.where == "transit" else None,
          corrupt_landing=_landing_corrupter(fault, dst_pages[0])
          if fault and fault.where == "landing" else None)
      m = self.metrics_
      m.transfer_seconds += time.perf_counter() - t0
      m.transfer_bytes += result.nbytes
      if result.ok:
        m.transfers += 1
        return result
      logging.warning("disagg: request %d transfer attempt %d failed: %s", req.request_id,
                      attempt + 1, result.reason)
      if attempt + 1 < self.config.transfer_attempts:
        m.transfer_retries += 1
    return TransferResult(False, f"{result.reason} (after {self.config.transfer_attempts} attempts)",
                          result.nbytes)

  def _requeue_preempted(self) -> None:
    """Sends requests the decode pool preempted back to the prefill pool, oldest first."""
    D, P = self.decode, self.prefill
    while D.scheduler.waiting:
      req = D.scheduler.waiting.pop()  # the most recently preempted is at the right
      P.scheduler.waiting.appendleft(req)
      self.metrics_.requeued += 1

  def _end(self, req: Request, status: RequestStatus, *, finish_reason=None,
           abort_reason=None) -> None:
    req.status = status
    req.finish_reason = finish_reason
    req.abort_reason = abort_reason
    req.finish_time = time.perf_counter()
    stats = self.prefill.stats
    if status is RequestStatus.FINISHED:
      stats.finished += 1
    else:
      stats.aborted[abort_reason] += 1


def _payload_corrupter(fault: TransferFault):
  def corrupt(payload: Payload) -> Payload:
    payload = list(payload)
    layer = dict(payload[fault.layer])
    key = sorted(layer)[0]
    layer[key] = _flip_first(layer[key])
    payload[fault.layer] = layer
    return payload
  return corrupt


def _landing_corrupter(fault: TransferFault, page: int):
  def corrupt(state: PagedKVState) -> PagedKVState:
    layers = list(state.layers)
    layer = dict(layers[fault.layer])
    key = state.names[0]
    x = layer[key]
    layer[key] = x.at[page].set(_flip_first(x[page]))
    layers[fault.layer] = layer
    return state.replace(layers=layers)
  return corrupt


