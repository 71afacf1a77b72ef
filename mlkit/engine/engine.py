"""The serving loop of one pool: submit / step / cancel / stream over the scheduler and the jitted runner.

A step has two phases, which callers may also run apart (``dispatch`` then
``collect``):

1. **dispatch**: audit page conservation (anything changed since the last
   step: cancels, injected faults), then schedule (admission, decode growth,
   preemption, prefill chunks); pages the audit or the allocator found
   violating are quarantined and every request holding them is aborted with
   reason ``integrity``; if any allocation changed, copy the allocator's tags
   to the device ``page_tags``; build the numpy step inputs and dispatch the
   prefill step and the decode step (each one jitted call with the tag check
   inside; the state is donated and chained from one call to the next without
   waiting).
2. **collect**: read every sampled token and ok flag in one transfer (the only
   sync); rows whose check failed are aborted with reason ``integrity`` and
   their tokens dropped; the others emit their token, stop, or continue; then
   the audit runs again.

With ``EngineConfig.overlap`` the engine dispatches step N+1 *before*
collecting step N, so the host's scheduling and bookkeeping run while the
device computes (SGLang's overlap scheduler). Step N+1's decode rows take
their input tokens straight from step N's device outputs; the host learns of
a stop token one step late and drops the extra row; a step that would need a
preemption first collects the one in flight. The tokens are the same as
without overlap.

An error that belongs to one request (building its row, emitting its token)
aborts that request with reason ``error``; the others are served on.

Host overhead is the time in the two phases outside the device calls and the
wait; the device time is from the first dispatch until the results are on the
host. Why the audit and the tag check both exist: docs/integrity.md. The
phases and the overlap: docs/engine.md.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import numpy as np
from absl import logging

from mlkit.engine import faults as faults_lib
from mlkit.engine.config import EngineConfig
from mlkit.engine import lockstep
from mlkit.engine.metrics import EngineMetrics
from mlkit.engine.prefix_cache import PrefixCache
from mlkit.engine.request import (ABORT_CANCELLED, ABORT_ERROR, ABORT_INTEGRITY, ABORT_TOO_LONG,
                                  ABORT_TRANSFER, Request, RequestOutput, RequestRejected,
                                  RequestStatus)
from mlkit.engine.runner import Runner, StepBatch
from mlkit.engine.scheduler import PrefillItem, Scheduler
from mlkit.engine.serving import (EndedWindow, EngineStalled, ServingLoop,  # noqa: F401
                                  check_batch)
from mlkit.kvcache import PageAllocator, PageViolation, PagedKVState, init_paged_state
from mlkit.model import check_params
from mlkit.parallel import DEFAULT_RULES, ShardingRules, shard_params, sharded_kv_state
from mlkit.sampling import SamplingParams
from pallas_kernels import dispatch as kernel_dispatch

ROLES = ("serve", "prefill")


@dataclasses.dataclass
class _InFlight:
  """A dispatched step whose results the host has not read.

  Attributes:
    pre_rows / dec_rows: the prefill PrefillItems and decode Requests, in row order.
    outputs: per launched kind, (tokens [B], ok [B], logits [B, V] or None) on device.
    launched_at: perf_counter when its device calls started.
    host_s: host seconds spent dispatching it.
    exposed_host_s: the part of host_s spent while no other step was in flight.
  """

  pre_rows: list
  dec_rows: list
  outputs: list
  launched_at: float
  host_s: float
  exposed_host_s: float


class Engine(ServingLoop):
  """A continuous-batching engine over one paged KV pool.

  Args:
    params: model params for ``config.model`` (any weight formats the model supports).
    config: an :class:`EngineConfig`.
    mesh: place params and the KV pool on this mesh (``mlkit.parallel``); the
      pool is allocated sharded, never whole on one device first. None: leave
      params where they are and build the pool on the default device.
    rules: logical-axis rules for the params and KV pages (with ``mesh``).
    data_parallel_attention: split MLA pages over the mesh's data axis.
    role: "serve" (prefill and decode here) or "prefill" (a disaggregated
      prefill pool: a request whose prompt is done leaves the steps, keeps its
      pages and waits in :meth:`prefilled` for its hand-over).

  Raises:
    ValueError: a config of the wrong type, an unknown role, or params that do
      not match ``param_specs(config.model)`` (names the first leaf that differs).
  """

  def __init__(self, params, config: EngineConfig, *, mesh=None,
               rules: ShardingRules = DEFAULT_RULES, data_parallel_attention: bool = False,
               role: str = "serve"):
    if not isinstance(config, EngineConfig):
      raise ValueError(f"Engine needs an EngineConfig, got {type(config).__name__}")
    if role not in ROLES:
      raise ValueError(f"Engine role must be one of {ROLES}, got {role!r}")
    # Shapes and dtypes only (no transfer): a mismatch names its leaf here, not deep in jax.
    check_params(params, config.model, where="Engine")
    # Before the pool is allocated: refuse early.
    if config.speculative_tokens and not params.get("mtp"):
      raise ValueError(f"Engine: speculative_tokens={config.speculative_tokens} drafts with the "
                       "model's multi-token-prediction layers, and these params have none "
                       "(params['mtp']; load a checkpoint that ships them, or init_params(..., "
                       "mtp=()))")
    self.config = config
    self.role = role
    self.mesh = mesh
    if mesh is not None:
      params = shard_params(params, mesh, rules, config.model)
      state = sharded_kv_state(config.model, config.kv, mesh, rules,
                               data_parallel=data_parallel_attention,
                               draft_layers=1 if config.speculative_tokens else 0)
      backend = kernel_dispatch.resolve_backend(config.backend)
      if data_parallel_attention and mesh.devices.size > 1 and backend != "xla":
        # The decode kernel is one custom call over the whole pool: XLA gathers the
        # data-split pages onto every device for it (docs/serving_step_memory.md).
        logging.warning("engine: data-parallel attention with the %r kernels gathers the "
                        "whole page pool onto every device for paged decode attention "
                        "(each request's pages are not yet placed on its own device; "
                        "docs/serving_step_memory.md); tensor parallelism does not",
                        backend)
    else:
      state = init_paged_state(config.model, config.kv,
                               draft_layers=1 if config.speculative_tokens else 0)
      # A fresh pool is uncommitted, and the pool a step returns is committed when the
      # params are (a loaded checkpoint): two jit signatures, two compiles, of each step.
      # Placed where the params are, the first step compiles what every later one runs.
      devices = {d for x in jax.tree_util.tree_leaves(params)
                 if isinstance(x, jax.Array) and x.committed for d in x.devices()}
      if len(devices) == 1:
        state = jax.device_put(state, devices.pop())
    self.runner = Runner(params, config, state)
    # Every device operation goes through this (lockstep.Leader when the pool spans
    # processes and this one decides: each operation is then repeated by the others).
    self.device = lockstep.DeviceSide(self.runner, state, mesh)
    self.allocator = PageAllocator(config.kv.num_pages, config.page_size)
    # Shared prompt prefixes, kept under the integrity tags (docs/prefix_cache.md).
    self.prefix_cache = PrefixCache(self.allocator) if config.prefix_cache else None
    self.scheduler = Scheduler(config, self.allocator, self.prefix_cache)
    # The requests this pool holds (queued, running, awaiting hand-over) and the most recent
    # ended ones, at most config.retain_finished: an ended request leaves once newer ones
    # push it out of that window (its result was handed out by the step that ended it).
    self.requests: dict[int, Request] = {}
    self._ended = EndedWindow(self.requests, config.retain_finished)
    self.stats = EngineMetrics()
    self.logits: dict[int, list[np.ndarray]] = {}  # per request, when config.record_logits
    self._next_id = 0
    self._tags_dirty = False
    self._in_flight: _InFlight | None = None
    # Integrity findings are errors in serving; with fault injection on they are what the
    # test rig asked for, logged at INFO so that a run's output shows only real failures.
    self._fault_log = logging.info if config.enable_fault_injection else logging.error
    # Requests aborted or ended outside a step's rows since the last collect (reported by it).
    self._touched: dict[int, tuple[Request, int]] = {}

  @property
  def state(self) -> PagedKVState:
    """The pool's KV state (this process's view of it)."""
    return self.device.state

  @state.setter
  def state(self, value: PagedKVState) -> None:
    self.device.state = value

  def lead(self, followers: lockstep.Followers) -> None:
    """Makes this engine the leader of a pool spread over processes: from now on every
    device operation is sent to ``followers`` (processes running :meth:`follow` on an
    engine built the same way) before it runs here (docs/serving_processes.md)."""
    if not self.device.multiprocess:
      raise ValueError("lead(): this engine's mesh does not span processes")
    self.device = lockstep.Leader(self.device, followers)

  def follow(self, address, key: bytes, **kw) -> tuple[int, bool]:
    """Runs this process as a follower of the pool whose leader listens at ``address``:
    repeats its device operations until it stops (see :func:`lockstep.follow`)."""
    if not self.device.multiprocess:
      raise ValueError("follow(): this engine's mesh does not span processes")
    return lockstep.follow(address, self.device, key, **kw)

  # --------------------------------------------------------------- requests
  def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams()) -> int:
    """Queues a request and returns its id.

    Args:
      prompt_ids: the prompt, token ids in [0, vocab_size).
      sampling: its SamplingParams.

    Returns:
      The request id (an int).

    Raises:
      ValueError: empty prompt, non-integer or out-of-vocabulary token ids,
        invalid sampling parameters (wrong types, top_k above the vocabulary, stop
        tokens outside it, ...), a prompt longer than the model's maximum length.
        Nothing is queued.
      RequestRejected: (a ValueError, reason ``too_long``) prompt + max_new_tokens
        can never fit: longer than the model's maximum length, the block-table
        width or the whole page pool.
    """
    prompt, sampling = self.check_request(prompt_ids, sampling)
    rid = self._next_id
    self._next_id += 1
    req = Request(request_id=rid, prompt=prompt, sampling=sampling,
                  arrival_time=time.perf_counter())
    self.requests[rid] = req
    self.scheduler.add(req)
    return rid

  def check_request(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams()
                    ) -> tuple[tuple[int, ...], SamplingParams]:
    """Validates a request without queueing it (what ``submit`` checks).

    Returns:
      (prompt as a tuple of ints, validated SamplingParams).

    Raises:
      ValueError / RequestRejected: as :meth:`submit`.
    """
    mcfg = self.config.model
    sampling = _validate_sampling(sampling, mcfg.vocab_size)
    check_logprobs(sampling, self.config.logprobs)
    try:
      prompt = np.asarray(prompt_ids)
    except Exception as e:  # ragged or non-numeric input
      raise ValueError(f"submit: prompt must be a sequence of token ids ({e})") from None
    if prompt.ndim != 1:
      raise ValueError(f"submit: prompt must be a flat sequence of token ids, got shape {prompt.shape}")
    if prompt.size == 0:
      raise ValueError("submit: prompt is empty")
    if not np.issubdtype(prompt.dtype, np.integer):
      raise ValueError(f"submit: prompt token ids must be integers, got dtype {prompt.dtype}")
    bad = prompt[(prompt < 0) | (prompt >= mcfg.vocab_size)]
    if bad.size:
      raise ValueError(f"submit: prompt has token ids outside [0, {mcfg.vocab_size}): "
                       f"{bad[:5].tolist()}")
    if prompt.size > mcfg.max_seq_len:
      raise ValueError(f"submit: prompt of {prompt.size} tokens is longer than the model's "
                       f"maximum length {mcfg.max_seq_len}")
    total = int(prompt.size) + sampling.max_new_tokens
    if total > self.max_seq_tokens:
      self.stats.rejected[ABORT_TOO_LONG] += 1
      q = len(self.allocator.quarantined)
      raise RequestRejected(
          f"submit: prompt ({prompt.size} tokens) + max_new_tokens ({sampling.max_new_tokens}) "
          f"= {total} tokens can never fit: the engine holds at most {self.max_seq_tokens} "
          f"tokens per sequence (model max {mcfg.max_seq_len}, {self.config.max_pages_per_seq} "
          f"pages/seq and {self.config.kv.num_pages} pool pages of {self.config.page_size}"
          + (f", {q} of them quarantined" if q else "") + ")")
    return tuple(int(t) for t in prompt), sampling

  @property
  def max_seq_tokens(self) -> int:
    """The longest sequence one request may reach: quarantined pages count only when they
    never heal (``quarantine_grace_steps=None``); healing ones are back within the grace."""
    usable = self.allocator.num_pages
    if self.config.quarantine_grace_steps is None:
      usable -= len(self.allocator.quarantined)
    return min(self.config.max_seq_tokens,
               usable * self.config.page_size - self.config.lookahead)

  def cancel(self, request_id: int) -> bool:
    """Cancels a live request held here (aborted with reason ``cancelled``), returning its pages.

    Returns:
      True if the request was live here; False if it had already ended or now
      lives in another pool (a hand-over).

    Raises:
      KeyError: unknown request id.
    """
    req = self.get(request_id)
    if req.done or not self.scheduler.holds(req):
      return False
    # Frees pages. A step in flight may still write into them; a later owner's writes
    # and fresh tags come after it on the device, so that is harmless.
    self.scheduler.remove(req)
    self._abort(req, ABORT_CANCELLED)
    self._touch([req])
    return True

  def holds(self, request_id: int) -> bool:
    """Whether a live request is queued, running or detached in this engine."""
    req = self.requests.get(request_id)
    return req is not None and not req.done and self.scheduler.holds(req)

  # --------------------------------------------------------------- what serving processes read
  @property
  def spans_processes(self) -> bool:
    """Whether this pool's mesh holds devices of other processes (a multi-host pool)."""
    return self.device.multiprocess

  def pool_layout(self) -> dict:
    """What a peer pool must agree with to exchange KV: {"attention", "n_layers", "kv_dtype",
    "page_size"}."""
    st = self.state
    return {"attention": st.attention, "n_layers": st.n_layers, "kv_dtype": str(st.dtype),
            "page_size": st.page_size}

  def check_peer_layout(self, attention: str, n_layers: int) -> None:
    """Checks that a peer pool's KV can land here (``transfer.check_pools``).

    Raises:
      ValueError: another attention kind or layer count.
    """
    from mlkit.engine.transfer import check_pools
    check_pools(attention, n_layers, self.state)

  def home_device(self):
    """The lowest-id device of this process holding the pool: where a transfer's payload is
    offered from or pulled to."""
    return lockstep.first_local_device(self.state)

  def weight_formats(self) -> dict[str, str]:
    """The weights' storage formats per group, as placed (``mlkit.quant.tree.describe_formats``)."""
    from mlkit.quant.tree import describe_formats
    return describe_formats(self.runner.params)

  def extract(self, pages, length: int):
    """A request's KV out of ``pages`` for a transfer: (payload, checksum, base).

    On a pool spread over processes every process runs it and the host copy comes back
    (``transfer.extract_to_host``); otherwise the payload stays on device
    (``transfer.extract_payload``). Neither changes the pool.
    """
    from mlkit.engine.transfer import extract_payload, extract_to_host
    if self.spans_processes:
      return self.device.call(extract_to_host, list(pages), length)
    ex = extract_payload(self.state, pages, length)
    return ex.payload, ex.checksum, ex.base

  def forget(self, request_id: int) -> None:
    """Drops an ended request from :attr:`requests` before the window would (e.g. a
    warm-up's dummy request that nobody sent).

    Raises:
      ValueError: the request is still live.
    """
    req = self.requests.get(request_id)
    if req is not None and not req.done:
      raise ValueError(f"forget: request {request_id} is still live")
    self.requests.pop(request_id, None)

  def num_waiting(self) -> int:
    """Requests queued here and not yet admitted."""
    return len(self.scheduler.waiting)

  def finish(self, request_id: int, reason: str = "stop") -> bool:
    """Ends a live request held here as finished now, e.g. when a stop string matched its text.

    Like a stop token: its pages are returned (their whole pages of KV offered to the
    prefix cache), and a step in flight drops its row.

    Returns:
      True if the request was live here; False if it had already ended or lives elsewhere.

    Raises:
      KeyError: unknown request id.
    """
    req = self.get(request_id)
    if req.done or not self.scheduler.holds(req):
      return False
    if self.scheduler.is_detached(req) or req.status is RequestStatus.DECODING:
      self._cache_prefix(req, (req.prompt + tuple(req.output))[:req.context_len - 1])
    self.scheduler.remove(req)
    req.status = RequestStatus.FINISHED
    req.finish_reason = reason
    req.finish_time = time.perf_counter()
    self.stats.finished += 1
    self._retire(req)
    self._touch([req])
    return True

  def running_ids(self) -> list[int]:
    """Ids of the requests that hold pages and run in this pool's steps, oldest first."""
    return [r.request_id for r in self.scheduler.running]

  def has_unfinished(self) -> bool:
    s = self.scheduler
    return bool(s.waiting or s.running or self._in_flight is not None)

  # --------------------------------------------------------------- pools
  def prefilled(self) -> list[Request]:
    """Requests whose prompt is done and that wait, with their pages, to be handed over (role "prefill")."""
    return list(self.scheduler.detached)

  def kv_pages(self, request_id: int) -> list[int]:
    """The physical pages of a request's KV, in position order."""
    return [p for p, _ in self.allocator.block_table(request_id)]

  def hand_over(self, request_id: int) -> None:
    """Frees the pages of a prefilled request whose KV now lives elsewhere (it stays live there)."""
    req = self.get(request_id)
    if not self.scheduler.is_detached(req):
      raise ValueError(f"hand_over: request {request_id} is not waiting for a hand-over")
    self.scheduler.remove(req)
    del self.requests[request_id]  # it lives in another pool now
  def reserve(self, key, num_tokens: int) -> bool:
    """Holds a running slot and pages for ``num_tokens`` under ``key`` (see ``adopt``).

    A serving process that admits a request before its KV is computed elsewhere
    reserves here first, so that the request can always land; ``adopt(...,
    reservation=key)`` then takes the reserved capacity, and
    ``release_reservation(key)`` gives it back if the request never lands.
    Returns whether the pool could reserve now (nothing changes if not).
    """
    return self.scheduler.reserve(key, num_tokens)

  def release_reservation(self, key) -> None:
    """Gives back what :meth:`reserve` held under ``key`` (no-op for an unknown key)."""
    self.scheduler.release_reservation(key)

  def adopt(self, req: Request, num_tokens: int,
            fill: Callable[[PagedKVState, list[int], int], tuple[PagedKVState, bool, str]],
            reservation=None) -> bool | None:
    """Takes over a live request whose first ``num_tokens`` tokens of KV come from elsewhere.

    The request is admitted by the pool's admission rule, sharing whatever
    whole pages of those tokens this pool's prefix cache holds; its other
    pages get fresh tags (on the device before anything checks them), and
    ``fill(state, pages, start)`` writes the KV of positions [start,
    num_tokens) into ``pages`` (the request's whole table), returning (new
    state, ok, why not). It then decodes here from the next step, and its
    pages are offered to the prefix cache.

    With ``reservation`` (a key given to :meth:`reserve`), the reserved slot and
    pages are released and taken by the request in the same call.

    Returns:
      None: the pool cannot take it now (nothing changed but the reservation's
      release). True: adopted. False: ``fill`` failed; the request is aborted with
      reason ``transfer`` and its pages here are free again.
    """
    start = self.scheduler.adopt(req, num_tokens, reservation=reservation)
    if start is None:
      return None
    self.requests[req.request_id] = req
    self._sync_tags()
    try:
      if isinstance(fill, lockstep.Fill):  # device work every process of the pool repeats
        ok, why = self.device.call(fill.fn, self.kv_pages(req.request_id), start, *fill.args)
      elif self.device.multiprocess:
        raise ValueError("a pool spread over processes adopts only with a lockstep.Fill")
      else:
        self.state, ok, why = fill(self.state, self.kv_pages(req.request_id), start)
    except lockstep.PoolBroken:
      raise  # not this request's failure: the pool cannot run anything any more
    except Exception as e:  # a broken transfer must not leave the request half adopted
      ok, why = False, f"filling its KV raised {type(e).__name__}: {e}"
    if ok:
      self._cache_prefix(req, req.prefill_tokens[:num_tokens])
      return True
    self.scheduler.remove(req)
    self._abort(req, ABORT_TRANSFER, why)
    self._touch([req])
    return False

  def drain_preempted(self) -> list[Request]:
    """Takes back every request preempted here (pages already returned), oldest preemption last.

    They leave this engine: the caller requeues them where they are recomputed.
    """
    out = self.scheduler.drain_preempted()
    for r in out:
      self.requests.pop(r.request_id, None)
    return out

  def requeue(self, reqs: Sequence[Request]) -> None:
    """Queues requests preempted in another pool at the head of the waiting queue (recomputed here)."""
    for r in reqs:
      self.requests[r.request_id] = r
    self.scheduler.requeue(reqs)

  # --------------------------------------------------------------- the loop
  def step(self) -> list[RequestOutput]:
    """Runs one engine step (see the module docstring).

    With ``config.overlap``, dispatches the next step before collecting the one
    in flight; a step's tokens then come back from the following call.

    Returns:
      One RequestOutput per request that emitted tokens or ended in the step collected.
    """
    if not self.config.overlap or self.role != "serve" or self.config.speculative_tokens:
      # A speculative step's next rows depend on how many drafts it accepted: no overlap.
      self.dispatch()
      return self.collect()
    prev, self._in_flight = self._in_flight, None
    nxt = self._launch(prev)
    if nxt is _NEEDS_SYNC:  # a preemption is due: settle the step in flight first
      outs = self._finish(prev)
      prev, nxt = None, self._launch(None)
      self._in_flight = nxt
      return outs
    self._in_flight = nxt
    return self._finish(prev)

  def dispatch(self) -> int:
    """Phase 1 of a step: audit, schedule and launch the device work without waiting for it.

    Returns:
      The rows launched (prefill chunks + decode rows); 0 if there was nothing to run.

    Raises:
      RuntimeError: a step is already in flight (collect it first).
    """
    if self._in_flight is not None:
      raise RuntimeError("dispatch: a step is already in flight; collect() it first")
    inf = self._in_flight = self._launch(None)
    return 0 if inf is None else len(inf.pre_rows) + len(inf.dec_rows)

  def collect(self) -> list[RequestOutput]:
    """Phase 2 of a step: waits for the step in flight and does its bookkeeping.

    Returns:
      One RequestOutput per request that emitted tokens or ended since the last collect.
    """
    inf, self._in_flight = self._in_flight, None
    return self._finish(inf)

  def _touch(self, reqs) -> None:
    for r in reqs:
      self._touched.setdefault(r.request_id, (r, len(r.output)))

  def _sync_tags(self) -> None:
    """Brings the device ``page_tags`` up to date: the pages whose tags changed, or every
    tag after something edited the bookkeeping behind the allocator's API (a recovery)."""
    if self._tags_dirty:
      self.device.sync_tags(self.allocator.device_tags())
      self.stats.tag_pages_synced += self.allocator.num_pages
    else:
      pages, tags = self.allocator.take_tag_changes()
      if pages.size:
        self.device.update_tags(pages, tags)
        self.stats.tag_pages_synced += int(pages.size)
    self._tags_dirty = False

  def _launch(self, prev: _InFlight | None):
    """Schedules and dispatches one step; ``prev`` is the step still in flight (overlap).

    Returns:
      The _InFlight, None if there was nothing to run, or _NEEDS_SYNC (nothing
      changed) when ``prev`` must be collected first.
    """
    t0 = time.perf_counter()
    self._touch(self.audit_pages())
    self._heal_quarantine(idle=prev is None and not self.scheduler.running)
    plan = self.scheduler.schedule(in_flight=prev is not None)
    if plan is None:
      return _NEEDS_SYNC
    self.stats.preemptions += len(plan.preempted)
    dropped = self.enforce_conservation(self.allocator.drain_violations())
    self._touch(dropped)
    plan = plan.without(set(dropped))
    self._sync_tags()  # the pages this plan (re)allocated, if any
    if plan.copies:  # copy-on-write of partly matching cached pages, before any step writes
      self.device.copy_pages(plan.copies)
    pre, pre_rows = self._build(build_prefill_batch, plan.prefill)
    prev_rows = ({r.request_id: i for i, r in enumerate(prev.dec_rows)} if prev is not None
                 else {})
    dec_builder = (build_verify_batch if self.config.speculative_tokens else
                   functools.partial(build_decode_batch, prev_rows=prev_rows))
    dec, dec_rows = self._build(dec_builder, plan.decode)
    if pre is None and dec is None:
      host = time.perf_counter() - t0
      self.stats.host_seconds += host
      if prev is None:
        self.stats.exposed_host_seconds += host
      return None
    t1 = time.perf_counter()
    outputs = []
    if pre is not None:
      outputs.append(self.device.run("prefill", pre))
      for item in pre_rows:  # their KV is written by this step, whatever the host does next
        item.req.num_computed += item.n
    if dec is not None:
      outputs.append(self.device.run("decode", dec, any(r.pending for r in dec_rows)))
      for r in dec_rows:
        r.pending += 1
    host = t1 - t0
    return _InFlight(pre_rows, dec_rows, outputs, t1, host, host if prev is None else 0.0)

  def _finish(self, inf: _InFlight | None) -> list[RequestOutput]:
    """Reads a step's results and does its bookkeeping; returns the step's RequestOutputs."""
    generated = 0
    if inf is not None:
      host_out = self.device.read(len(inf.outputs))  # the step's only synchronisation
      t2 = time.perf_counter()
      self._touch([it.req for it in inf.pre_rows])
      self._touch(inf.dec_rows)
      k = 0
      spec = bool(self.config.speculative_tokens)
      if inf.pre_rows:
        tok, ok, lg, lp = host_out[k]
        k += 1
        if spec:  # the emitted token, its logits and log-probabilities: window position 0
          _, emitted, drafts = tok
          tok, lg = emitted[:, 0], (lg[:, 0] if lg is not None else None)
          lp = tuple(x[:, 0] for x in lp) if lp is not None else None
        for i, item in enumerate(inf.pre_rows):
          end = item.start + item.n
          if ok[i] and not item.req.done and self.scheduler.holds(item.req):
            # Its KV up to here is written and checked: later requests may share it now.
            self._cache_prefix(item.req, item.req.prefill_tokens[:end])
          final = end == len(item.req.prefill_tokens)
          generated += self._finish_row(item.req, bool(ok[i]), tok[i], lg, lp, i, t2,
                                        prefill_final=final)
          if spec and final and not item.req.done:
            item.req.drafts = tuple(int(d) for d in drafts[i])
      if inf.dec_rows:
        tok, ok, lg, lp = host_out[k]
        for i, req in enumerate(inf.dec_rows):
          req.pending -= 1
          if spec:
            generated += self._finish_verify_row(req, bool(ok[i]), tok, lg, lp, i, t2)
          else:
            generated += self._finish_row(req, bool(ok[i]), tok[i], lg, lp, i, t2)
    else:
      t2 = time.perf_counter()
    self._touch(self.audit_pages())
    results = [RequestOutput(r.request_id, tuple(r.output[n:]), r.status, r.finish_reason,
                             r.abort_reason) for r, n in self._touched.values()]
    self._touched = {}
    if inf is None:
      return results
    t3 = time.perf_counter()
    # Bookkeeping is exposed (the device idles) unless the next step is already in flight.
    exposed = inf.exposed_host_s + (t3 - t2 if self._in_flight is None else 0.0)
    self.stats.record_step(host_s=inf.host_s + (t3 - t2), device_s=t2 - inf.launched_at,
                           exposed_host_s=exposed, prefill=bool(inf.pre_rows),
                           decode=bool(inf.dec_rows), generated=generated,
                           prefilled=sum(it.n for it in inf.pre_rows), start=inf.launched_at)
    if self.config.log_every and self.stats.steps % self.config.log_every == 0:
      self.log_metrics()
    return results

  def _build(self, builder, items):
    """Builds one step's batch; a request whose row cannot be built is aborted (reason ``error``)."""
    if not items:
      return None, []
    batch, rows, failed = builder(self.config, self.scheduler, items)
    for req, err in failed:
      self._touch([req])
      self._error_abort(req, err)
    return batch, rows

  def _finish_row(self, req: Request, ok: bool, token, logits, logprobs, i: int, now: float,
                  prefill_final: bool | None = None) -> int:
    """Host bookkeeping of one row's result; returns the tokens it emitted (0 or 1).

    ``prefill_final`` is None for a decode row, else whether the prefill chunk
    was the prompt's last (only then is its sampled token emitted).
    """
    if req.done or not self.scheduler.holds(req):
      return 0  # it ended (or left) while the step ran: its row is dropped
    if not ok:
      self._integrity_abort(req, "its page-tag check failed")
      return 0
    try:
      if prefill_final is not None:
        if not prefill_final or req.status is not RequestStatus.PREFILLING:
          return 0
        req.status = RequestStatus.DECODING
        emitted = self._emit(req, token, logits[i] if logits is not None else None, now,
                             _row(logprobs, i))
        if not req.done and self.role == "prefill":
          self.scheduler.detach(req)
        return emitted
      if req.status is not RequestStatus.DECODING:
        return 0
      return self._emit(req, token, logits[i] if logits is not None else None, now,
                        _row(logprobs, i))
    except Exception as e:  # one request's bad state must not stop the others
      self._error_abort(req, f"{type(e).__name__}: {e}")
      return 0

  def _finish_verify_row(self, req: Request, ok: bool, tok, logits, logprobs, i: int,
                         now: float) -> int:
    """A speculative decode row's result: emits its accepted drafts and the token after them
    (until one stops it) and keeps its next drafts; returns the tokens emitted.

    The row's length advances by what it emitted only; what the step wrote past that is
    written again by the next step before anything reads it, and the pages the row holds
    (its tokens plus ``EngineConfig.lookahead``) stay its own, so nothing is rewound on
    the device.
    """
    n_acc, emitted, drafts = tok
    if req.done or not self.scheduler.holds(req):
      return 0
    if not ok:
      self._integrity_abort(req, "its page-tag check failed")
      return 0
    if req.status is not RequestStatus.DECODING:
      return 0
    offered = min(len(req.drafts), self.config.speculative_tokens,
                  max(req.sampling.max_new_tokens - len(req.output) - 1, 0))
    n = int(n_acc[i])
    self.stats.record_speculation(offered, n)
    count = 0
    try:
      for j in range(n + 1):
        lp = None if logprobs is None else tuple(x[i, j] for x in logprobs)
        count += self._emit(req, emitted[i, j], logits[i, j] if logits is not None else None,
                            now, lp)
        if req.done:
          break
      if not req.done:
        req.drafts = tuple(int(d) for d in drafts[i])
    except Exception as e:  # one request's bad state must not stop the others
      self._error_abort(req, f"{type(e).__name__}: {e}")
    return count

  def generate(self, prompts, sampling=SamplingParams()) -> list[list[int]]:
    """Submits every prompt, runs to completion and returns each request's tokens (in order).

    Atomic: every request is checked before any is queued.

    Raises:
      ValueError: as :meth:`submit` for any prompt (nothing is queued), or a SamplingParams
        list whose length differs from the prompts'.
    """
    return super().generate(prompts, sampling)

  # --------------------------------------------------------------- faults
  def inject_fault(self, fault: faults_lib.Fault) -> faults_lib.FaultRecord:
    """Corrupts the allocator's bookkeeping for ``fault.victim`` (tests only).

    Raises:
      RuntimeError: fault injection is disabled in the config.
      ValueError: see :func:`mlkit.engine.faults.inject`.
    """
    if not self.config.enable_fault_injection:
      raise RuntimeError("fault injection is disabled (EngineConfig.enable_fault_injection=False)")
    record = faults_lib.inject(self.allocator, fault)
    self.scheduler.invalidate_rows()
    self._tags_dirty = True
    logging.info("engine: injected fault %s", record)
    return record

  # --------------------------------------------------------------- metrics
  def metrics(self, include_requests: bool = False) -> dict:
    """Engine metrics as a dict (see EngineMetrics.as_dict) plus queue and pool state.

    Args:
      include_requests: also add {"requests": {id: request_metrics}}.
    """
    m = self.stats.as_dict()
    m.update(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
             pages_used=self.allocator.num_used, pages_free=self.allocator.num_free,
             pages_quarantined=len(self.allocator.quarantined),
             pages_quarantined_total=self.allocator.quarantined_total,
             pages_healed_total=self.allocator.healed_total,
             requests_held=len(self.requests),
             host_work=self.host_work(),
             pages_total=self.allocator.num_pages,
             pages_cached=self.prefix_cache.num_pages if self.prefix_cache is not None else 0)
    if self.prefix_cache is not None:
      m["prefix_cache"] = self.prefix_cache.stats.as_dict()
    m.update(self._mean_latencies(self.requests.values()))
    if include_requests:
      m["requests"] = {rid: self.request_metrics(rid) for rid in self.requests}
    return m

  def host_work(self) -> dict:
    """Counts of the host's per-step work so far (what host_scale and the counting tests read):
    steps, pages the page audit visited, tags written to the device, prefix-cache eviction
    heap pops and nodes visited by matching."""
    cache = self.prefix_cache.work if self.prefix_cache is not None else {}
    return {"steps": self.stats.steps, "audit_pages": self.allocator.work["audit_pages"],
            "tag_pages_synced": self.stats.tag_pages_synced,
            "evict_pops": cache.get("evict_pops", 0), "match_nodes": cache.get("match_nodes", 0)}

  def log_metrics(self) -> None:
    m = self.metrics()
    logging.info("engine: step %d, %d running, %d waiting, pages %d used / %d free, "
                 "%.1f tok/s, host overhead %.2f ms/step (%.1f%%), %d preemptions, "
                 "%d integrity failures", m["steps"], m["running"], m["waiting"], m["pages_used"],
                 m["pages_free"], m["throughput_tok_s"], 1e3 * m["host_overhead_s_per_step"],
                 100 * m["host_overhead_fraction"], m["preemptions"], m["integrity_failures"])

  # --------------------------------------------------------------- internals
  def progress_marker(self) -> tuple:
    """A value that changes whenever a step does anything (stall detection)."""
    return self._progress_marker()

  def queue_summary(self) -> str:
    """Where the live requests are, in words (stall messages)."""
    return self._queue_summary()

  def _progress_marker(self):
    return (self.stats.generated_tokens, self.stats.prefill_tokens, self.stats.steps,
            self._in_flight is not None, self._ended.count, self.stats.preemptions,
            self.allocator.healed_total)

  def _queue_summary(self) -> str:
    s = self.scheduler
    return (f"{len(s.waiting)} waiting, {len(s.running)} running, "
            f"{len(s.detached)} awaiting hand-over")

  def _emit(self, req: Request, token, logits, now: float, logprob=None) -> int:
    req.emit(int(token), now, logprob)
    if logits is not None:
      self.logits.setdefault(req.request_id, []).append(np.asarray(logits))
    reason = req.should_stop()
    if reason is not None:
      # The KV of every token but the newest is written: keep its whole pages for reuse.
      self._cache_prefix(req, (req.prompt + tuple(req.output))[:req.context_len - 1])
      self.scheduler.remove(req)
      req.status = RequestStatus.FINISHED
      req.finish_reason = reason
      req.finish_time = now
      self.stats.finished += 1
      self._retire(req)
    return 1

  # --------------------------------------------------------------- page conservation
  def audit_pages(self) -> list[Request]:
    """Audits page conservation on the pages changed since the last audit
    (``PageAllocator.audit_changes``) and enforces it (see :meth:`enforce_conservation`).

    Returns:
      The requests aborted because they held a violating page.
    """
    if not self.config.page_audit:
      return []
    t0 = time.perf_counter()
    violations = self.allocator.audit_changes()
    self.stats.audit_seconds += time.perf_counter() - t0
    return self.enforce_conservation(violations)

  def enforce_conservation(self, violations: Sequence[PageViolation]) -> list[Request]:
    """Quarantines the pages of ``violations`` and aborts every request holding one.

    Their contents and their owners' tables are not trusted any more, so the
    pages leave the free list until they heal (``quarantine_grace_steps`` after
    their last holder is gone, with a fresh tag), and each holder ends with
    reason ``integrity`` before it can read from or write to them again. The
    allocator is then rebuilt from the remaining tables.

    Returns:
      The requests aborted.
    """
    if not violations:
      return []
    self.stats.page_violations += len(violations)
    for v in violations:
      self._fault_log("engine: page conservation violated: %s", v)
    aborted = []
    for rid in self.allocator.recover(violations):
      req = self.requests.get(rid)
      if req is None or req.done:
        continue
      self.scheduler.forget(req)
      self.stats.integrity_failures += 1
      why = "it holds page(s) that failed the page-conservation audit"
      self._fault_log("engine: request %d aborted: %s", req.request_id, why)
      self._abort(req, ABORT_INTEGRITY, why)
      aborted.append(req)
    if self.prefix_cache is not None:  # recover() dropped the cache's hold on bad pages
      self.prefix_cache.reconcile()
    self.scheduler.invalidate_rows()
    self._tags_dirty = True
    # The pool shrank: a request that can no longer fit would wait forever.
    limit = self.max_seq_tokens
    for req in [*self.scheduler.waiting, *self.scheduler.running]:
      if len(req.prompt) + req.sampling.max_new_tokens > limit:
        self.scheduler.remove(req)
        self._abort(req, ABORT_TOO_LONG, f"the pool now holds at most {limit} tokens per "
                    f"sequence ({len(self.allocator.quarantined)} pages quarantined)")
        aborted.append(req)
    return aborted

  def _heal_quarantine(self, idle: bool) -> None:
    """Advances the allocator's clock and heals quarantined pages nobody holds any more.

    The grace period keeps a page out while a step launched before its
    quarantine may still touch it; when nothing runs and no step is in flight
    (``idle``) there is none, and a page nobody holds heals at once, so a
    request that needs it never waits on an idle engine.
    """
    grace = self.config.quarantine_grace_steps
    if grace is not None and self.allocator.quarantined:
      # The clock counts steps launched: a page quarantined in step k heals in step k + grace.
      healed = self.allocator.heal(0 if idle else grace)  # fresh tags: synced with the plan's
      if healed:
        logging.info("engine: %d quarantined page(s) healed back into the pool: %s",
                     len(healed), healed[:8])
    self.allocator.tick()

  def _cache_prefix(self, req: Request, tokens) -> None:
    """Offers the whole pages of ``tokens`` (KV written, checked this step) to the prefix cache."""
    if self.prefix_cache is not None and self.allocator.has_request(req.request_id):
      pages, tags = zip(*self.allocator.block_table(req.request_id))
      self.prefix_cache.insert(tokens, pages, tags)

  def _integrity_abort(self, req: Request, why: str) -> None:
    self._fault_log("engine: request %d aborted: %s", req.request_id, why)
    if self.prefix_cache is not None and self.allocator.has_request(req.request_id):
      # Which of its pages failed is unknown: none of them may be matched again. Other
      # holders of a shared one are checked by their own rows' tag checks.
      self.prefix_cache.invalidate(self.kv_pages(req.request_id))
    self.scheduler.drop_failed(req)
    self.stats.integrity_failures += 1
    self._abort(req, ABORT_INTEGRITY, why)

  def _error_abort(self, req: Request, why: str) -> None:
    logging.error("engine: request %d aborted after an error: %s", req.request_id, why)
    self.scheduler.remove(req)
    self._tags_dirty = True
    self._abort(req, ABORT_ERROR, why)

  def _abort(self, req: Request, reason: str, error: str | None = None) -> None:
    req.status = RequestStatus.ABORTED
    req.abort_reason = reason
    req.error = error
    req.finish_time = time.perf_counter()
    self.stats.aborted[reason] += 1
    self._retire(req)

  def _retire(self, req: Request) -> None:
    """A request ended here: it joins the window of recent results, and the oldest ended
    requests beyond ``config.retain_finished`` leave the engine (memory follows what is live)."""
    for rid in self._ended.add(req):
      self.logits.pop(rid, None)



_NEEDS_SYNC = object()  # _launch: collect the step in flight, then schedule again


def _row(logprobs, i: int):
  """Row ``i`` of a step's (token logprob [B], top ids [B, K], top logprobs [B, K]), or None."""
  return None if logprobs is None else tuple(x[i] for x in logprobs)


def _sampling_row(r: Request) -> tuple:
  """One request's sampling values as the step's dtypes (raises if one does not fit)."""
  s = r.sampling
  return (np.uint32(s.seed), np.float32(s.temperature), np.int32(s.top_k), np.float32(s.top_p),
          np.int32(len(r.output) + r.pending))  # the index of the token this row samples


def _rows(items, row_fn):
  """(item, row values) for the items whose row builds, and (request, error) for the others."""
  rows, failed = [], []
  for it in items:
    req = it.req if isinstance(it, PrefillItem) else it
    try:
      rows.append((it, row_fn(it)))
    except Exception as e:  # one request's row must not stop the batch
      failed.append((req, f"building its step inputs raised {type(e).__name__}: {e}"))
  return rows, failed


def _sampling_arrays(values, B: int):
  """Per-row sampling arrays [B] for a step; padded rows are greedy with seed 0."""
  seeds = np.zeros(B, np.uint32)
  temp = np.zeros(B, np.float32)
  top_k = np.zeros(B, np.int32)
  top_p = np.ones(B, np.float32)
  steps = np.zeros(B, np.int32)
  for i, v in enumerate(values):
    seeds[i], temp[i], top_k[i], top_p[i], steps[i] = v
  return seeds, temp, top_k, top_p, steps


def build_prefill_batch(config: EngineConfig, scheduler, items):
  """The StepBatch of one prefill step over scheduler PrefillItems.

  Args:
    config: the pool's EngineConfig (buckets).
    scheduler: the pool's Scheduler (block tables).
    items: PrefillItems from ``Scheduler.schedule``.

  Returns:
    (batch, rows, failed): a StepBatch with B = the batch bucket of len(rows) rows
    and T = the prefill bucket of the longest chunk (padded rows have length 0), or
    None if no row could be built; the PrefillItems in batch order; and
    (request, error) for each item whose row raised (the caller aborts those).
  """
  def row(it):
    toks = np.asarray(it.req.prefill_tokens[it.start:it.start + it.n], np.int32)
    if toks.shape != (it.n,):
      raise ValueError(f"chunk [{it.start}, {it.start + it.n}) is outside its "
                       f"{len(it.req.prefill_tokens)} prefill tokens")
    return toks, _sampling_row(it.req), scheduler.row(it.req)

  built, failed = _rows(items, row)
  if not built:
    return None, [], failed
  rows = [it for it, _ in built]
  B = config.batch_bucket(len(rows))
  T = config.prefill_bucket(max(it.n for it in rows))
  tokens = np.zeros((B, T), np.int32)
  positions = np.zeros((B, T), np.int32)
  lengths = np.zeros(B, np.int32)
  last = np.zeros(B, np.int32)
  for i, (it, (toks, _, _)) in enumerate(built):
    tokens[i, :it.n] = toks
    positions[i] = np.arange(it.start, it.start + T)
    lengths[i] = it.start + it.n
    last[i] = it.n - 1
  bt, et = scheduler.fill_tables([it.req for it in rows], B)
  seeds, temp, top_k, top_p, steps = _sampling_arrays([v[1] for _, v in built], B)
  batch = StepBatch(tokens, positions, bt, et, lengths, last, seeds, steps, temp, top_k, top_p)
  if config.speculative_tokens:
    # A prompt's last piece emits and drafts (its pages hold the look-ahead); an inner
    # piece hands the drafter the prompt's next token.
    check = lengths.copy()
    next_token = np.full(B, -1, np.int32)
    draft_rows = np.zeros(B, bool)
    for i, it in enumerate(rows):
      end = it.start + it.n
      if end == len(it.req.prefill_tokens):
        check[i] += config.lookahead
        draft_rows[i] = True
      else:
        next_token[i] = it.req.prefill_tokens[end]
    batch = dataclasses.replace(batch, check_lengths=check, num_drafts=np.zeros(B, np.int32),
                                next_token=next_token, draft_rows=draft_rows)
  return batch, rows, failed


def build_decode_batch(config: EngineConfig, scheduler, reqs, prev_rows=None):
  """The StepBatch of one decode step: each request's newest token at position context_len - 1.

  A request with a ``pending`` token (sampled by the step in flight, unseen by
  the host) decodes that token: its position is one further and
  ``batch.prev_row`` names its row in the step in flight (the engine takes the
  token from there on device); other rows have prev_row -1.

  Args:
    prev_rows: request id -> its decode row in the step in flight.

  Returns:
    (batch or None, requests in batch order, [(request, error)]) as build_prefill_batch.
  """
  prev_rows = prev_rows or {}

  def row(r):
    if r.pending:
      if r.pending != 1 or r.request_id not in prev_rows:
        raise ValueError(f"request {r.request_id} has {r.pending} pending tokens outside the "
                         "decode rows of the step in flight")
      src = prev_rows[r.request_id]
    else:
      src = -1
    tok = 0 if r.pending else r.output[-1]
    return np.int32(tok), _sampling_row(r), scheduler.row(r), src

  built, failed = _rows(reqs, row)
  if not built:
    return None, [], failed
  rows = [r for r, _ in built]
  B = config.batch_bucket(len(rows))
  tokens = np.zeros((B, 1), np.int32)
  positions = np.zeros((B, 1), np.int32)
  lengths = np.zeros(B, np.int32)
  prev_row = np.full(B, -1, np.int32)
  for i, (r, (tok, _, _, src)) in enumerate(built):
    tokens[i, 0] = tok
    positions[i, 0] = r.context_len + r.pending - 1
    lengths[i] = r.context_len + r.pending
    prev_row[i] = src
  bt, et = scheduler.fill_tables(rows, B)
  seeds, temp, top_k, top_p, steps = _sampling_arrays([v[1] for _, v in built], B)
  return StepBatch(tokens, positions, bt, et, lengths, np.zeros(B, np.int32), seeds, steps, temp,
                   top_k, top_p, prev_row=prev_row), rows, failed


def build_verify_batch(config: EngineConfig, scheduler, reqs):
  """A speculative engine's decode step: per request its newest token and its drafts.

  Row b's chunk is [newest token, d_1 .. d_n] at positions context_len - 1 onwards,
  with n = the drafts it holds, at most ``speculative_tokens`` and at most one fewer
  than the tokens it may still emit; the rest of the K + 1 columns are padding.

  Returns:
    (batch or None, requests in batch order, [(request, error)]) as build_prefill_batch.
  """
  K = config.speculative_tokens

  def row(r):
    if r.pending:
      raise ValueError(f"request {r.request_id} has a pending token in a speculative step")
    left = r.sampling.max_new_tokens - len(r.output)
    drafts = list(r.drafts[:max(min(K, left - 1), 0)])
    return [r.output[-1]] + drafts, _sampling_row(r), scheduler.row(r)

  built, failed = _rows(reqs, row)
  if not built:
    return None, [], failed
  rows = [r for r, _ in built]
  B = config.batch_bucket(len(rows))
  tokens = np.zeros((B, K + 1), np.int32)
  positions = np.zeros((B, K + 1), np.int32)
  lengths = np.zeros(B, np.int32)
  check = np.zeros(B, np.int32)
  n_drafts = np.zeros(B, np.int32)
  for i, (r, (toks, _, _)) in enumerate(built):
    n = len(toks) - 1
    tokens[i, :n + 1] = toks
    positions[i] = np.arange(r.context_len - 1, r.context_len + K)
    lengths[i] = r.context_len + n
    check[i] = r.context_len + config.lookahead
    n_drafts[i] = n
  bt, et = scheduler.fill_tables(rows, B)
  seeds, temp, top_k, top_p, steps = _sampling_arrays([v[1] for _, v in built], B)
  draft_rows = np.zeros(B, bool)
  draft_rows[:len(rows)] = True
  return StepBatch(tokens, positions, bt, et, lengths, n_drafts.copy(), seeds, steps, temp,
                   top_k, top_p, check_lengths=check, num_drafts=n_drafts,
                   next_token=np.full(B, -1, np.int32), draft_rows=draft_rows), rows, failed


def _validate_sampling(sampling, vocab_size: int) -> SamplingParams:
  """Re-validates sampling parameters (also ones built around ``__post_init__``)."""
  if not isinstance(sampling, SamplingParams):
    raise ValueError(f"submit: sampling must be a SamplingParams, got {type(sampling).__name__}")
  try:
    sampling = dataclasses.replace(sampling)  # reruns SamplingParams.__post_init__
  except (TypeError, ValueError) as e:
    raise ValueError(f"submit: invalid sampling parameters: {e}") from None
  if sampling.top_k > vocab_size:
    raise ValueError(f"submit: SamplingParams.top_k must be at most the vocabulary size "
                     f"{vocab_size}, got {sampling.top_k}")
  bad = [t for t in sampling.stop_tokens if not 0 <= t < vocab_size]
  if bad:
    raise ValueError(f"submit: stop tokens outside [0, {vocab_size}): {bad}")
  return sampling


def check_logprobs(sampling: SamplingParams, served: int) -> None:
  if sampling.logprobs is not None and (served == 0 or sampling.logprobs > served):
    raise ValueError(f"submit: SamplingParams.logprobs={sampling.logprobs}, but this engine "
                     + (f"returns at most {served} top log-probabilities"
                        if served else "computes no log-probabilities (EngineConfig.logprobs=0)"))
