"""Continuous-batching scheduler: admission against the allocator, chunked prefill, preemption.

Plain Python over host state. Each ``schedule`` call decides one engine step:

1. Admission (FIFO, head of line first): a waiting request gets pages for
   everything its prefill will write, and only if ``admission_reserve`` pages
   stay free afterwards (the reserve is waived when nothing else runs, so a
   request that fits the pool alone can always start: no deadlock).
2. Decode growth: every decoding request gets room for one more token, oldest
   first. When the pool is dry, the most recently admitted running request is
   preempted: its pages are released and it is requeued at the head of the
   waiting queue, to be recomputed from prompt + tokens generated so far.
3. Prefill: chunks of prefilling requests, oldest first, up to the largest
   prefill bucket per request and ``prefill_token_budget`` per step.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
from absl import logging

from mlkit.engine.request import Request, RequestStatus
from mlkit.kvcache import PAD_PAGE, PageAllocator


@dataclasses.dataclass
class PrefillItem:
  """One prefill chunk: tokens [start, start + n) of ``req.prefill_tokens``."""

  req: Request
  start: int
  n: int


@dataclasses.dataclass
class Plan:
  """One step's decisions.

  Attributes:
    prefill: chunks to prefill this step.
    decode: requests that decode one token this step.
    admitted / preempted: requests that changed state.
    allocation_changed: pages were handed out or returned (device tags need a sync).
  """

  prefill: list
  decode: list
  admitted: list
  preempted: list
  allocation_changed: bool

  def without(self, dropped) -> "Plan":
    """The plan with ``dropped`` requests taken out of its prefill and decode lists."""
    if not dropped:
      return self
    return dataclasses.replace(self, prefill=[it for it in self.prefill if it.req not in dropped],
                               decode=[r for r in self.decode if r not in dropped])


class Scheduler:
  """Waiting queue + running set over a page allocator.

  Args:
    config: an ``EngineConfig``.
    allocator: the pool's :class:`PageAllocator`.
  """

  def __init__(self, config, allocator: PageAllocator):
    self.config = config
    self.allocator = allocator
    self.waiting: collections.deque[Request] = collections.deque()
    self.running: list[Request] = []  # admission order
    self._admit_counter = 0
    self._rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # block-table cache

  # --------------------------------------------------------------- queue ops
  def add(self, req: Request) -> None:
    req.prefill_tokens = tuple(req.prompt)
    self.waiting.append(req)

  def remove(self, req: Request) -> bool:
    """Takes a live request out of the queues, returning its pages. Returns whether it was live."""
    if req in self.waiting:
      self.waiting.remove(req)
      return True
    if req in self.running:
      self.running.remove(req)
      self.allocator.release_checked(req.request_id)
      self._rows.pop(req.request_id, None)
      return True
    return False

  def forget(self, req: Request) -> None:
    """Takes a request out of the queues without touching the allocator (it already dropped it)."""
    if req in self.running:
      self.running.remove(req)
    elif req in self.waiting:
      self.waiting.remove(req)
    self._rows.pop(req.request_id, None)

  def drop_failed(self, req: Request) -> None:
    """Removes a request whose integrity check failed (its block table is not trusted)."""
    if req in self.running:
      self.running.remove(req)
    self.allocator.drop_and_reconcile(req.request_id)
    self._rows.pop(req.request_id, None)

  def invalidate_rows(self) -> None:
    """Forgets cached block-table rows (after something edited the allocator behind our back)."""
    self._rows.clear()

  def row(self, req: Request) -> tuple[np.ndarray, np.ndarray]:
    """(pages [n] int32, expected tags [n] int32) of a running request."""
    r = self._rows.get(req.request_id)
    if r is None:
      r = self._rows[req.request_id] = self.allocator.table_arrays(req.request_id)
    return r

  def fill_tables(self, reqs, B: int) -> tuple[np.ndarray, np.ndarray]:
    """[B, M] block tables and expected tags for ``reqs`` (rows past len(reqs) are padding)."""
    M = self.config.max_pages_per_seq
    bt = np.full((B, M), PAD_PAGE, np.int32)
    et = np.zeros((B, M), np.int32)
    for i, req in enumerate(reqs):
      pages, tags = self.row(req)
      bt[i, :len(pages)] = pages
      et[i, :len(tags)] = tags
    return bt, et

  # --------------------------------------------------------------- one step
  def schedule(self) -> Plan:
    """Decides the next step (admits, grows, preempts, picks prefill chunks)."""
    cfg = self.config
    alloc = self.allocator
    admitted, preempted = [], []
    changed = False
    # 1. Admission.
    while self.waiting and len(self.running) < cfg.max_running:
      req = self.waiting[0]
      need = alloc.pages_for(len(req.prefill_tokens))
      reserve = cfg.admission_reserve if self.running else 0
      if need + reserve > alloc.num_free:
        break
      if alloc.admit(req.request_id, len(req.prefill_tokens)) is not None:
        break
      self.waiting.popleft()
      req.status = RequestStatus.PREFILLING
      req.num_computed = 0
      req.admit_seq = self._admit_counter
      self._admit_counter += 1
      self.running.append(req)
      admitted.append(req)
      changed = True
    # 2. Decode growth, oldest first; preempt the youngest when the pool is dry.
    decode = []
    for req in list(self.running):
      if req.status is not RequestStatus.DECODING or req not in self.running:
        continue
      while True:
        pages_before = len(self.row(req)[0])
        if alloc.extend(req.request_id, req.context_len) is None:
          if alloc.pages_for(req.context_len) > pages_before:
            self._rows.pop(req.request_id, None)
            changed = True
          decode.append(req)
          break
        victim = max(self.running, key=lambda r: r.admit_seq)
        self._preempt(victim)
        preempted.append(victim)
        changed = True
        if victim in decode:
          decode.remove(victim)
        if victim is req:
          break
    # 3. Prefill chunks within the token budget.
    prefill, budget = [], cfg.prefill_token_budget
    max_rows = cfg.batch_buckets[-1]
    for req in self.running:
      if req.status is not RequestStatus.PREFILLING:
        continue
      n = min(len(req.prefill_tokens) - req.num_computed, cfg.prefill_buckets[-1], budget)
      if n <= 0 or len(prefill) >= max_rows:
        break
      prefill.append(PrefillItem(req, req.num_computed, n))
      budget -= n
    return Plan(prefill=prefill, decode=decode, admitted=admitted, preempted=preempted,
                allocation_changed=changed)

  def _preempt(self, req: Request) -> None:
    self.running.remove(req)
    self.allocator.release_checked(req.request_id)
    self._rows.pop(req.request_id, None)
    req.status = RequestStatus.WAITING
    req.prefill_tokens = tuple(req.prompt) + tuple(req.output)
    req.num_computed = 0
    req.num_preemptions += 1
    self.waiting.appendleft(req)
    logging.info("scheduler: preempted request %d (%d tokens to recompute)", req.request_id,
                 len(req.prefill_tokens))
