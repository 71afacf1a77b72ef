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

While a step is in flight (the engine's overlapped mode) some requests have a
token being sampled that the host has not seen (``Request.pending``). Such a
plan grows them for that token too, never preempts (a preemption would drop
KV the device is still writing), and reports ``None`` instead when the pool
cannot grow every decoding request: the engine then collects the step in
flight and schedules again, synchronously.

The pool-level API other components use instead of editing the queues:
:meth:`can_admit` (the admission rule), :meth:`adopt` (a request whose KV
arrives from elsewhere), :meth:`detach` / :attr:`detached` (a request that
keeps its pages while it leaves this pool's steps), :meth:`drain_preempted`
and :meth:`requeue`. docs/engine.md describes how the disaggregated pools
compose through it.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
from absl import logging

from mlkit.engine.prefix_cache import Match, PrefixCache
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
    copies: (cached page, fresh page) copies to run before the step (copy-on-write of a
      partly matching cached page, see ``mlkit.engine.prefix_cache``).
  """

  prefill: list
  decode: list
  admitted: list
  preempted: list
  allocation_changed: bool
  copies: list = dataclasses.field(default_factory=list)

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
    prefix_cache: the pool's :class:`PrefixCache`, or None: admission then
      starts prefill after the longest cached prefix, and cached pages are
      evicted (LRU) before anything waits or is preempted for lack of pages.
  """

  def __init__(self, config, allocator: PageAllocator, prefix_cache: PrefixCache | None = None):
    self.config = config
    self.allocator = allocator
    self.prefix_cache = prefix_cache
    self.waiting: collections.deque[Request] = collections.deque()
    self.running: list[Request] = []  # admission order
    # Requests holding pages outside this pool's steps (a finished prefill awaiting its
    # transfer), oldest first.
    self.detached: list[Request] = []
    # Pages held for requests that will be adopted later (a decode server holds them
    # while the prefill runs elsewhere): key -> tokens. Each takes a running slot.
    self.reservations: dict = {}
    self._admit_counter = 0
    self._preempted: set[int] = set()  # ids preempted here since the last drain_preempted
    self._rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # block-table cache
    # Where each request held here is: id -> (request, "waiting" | "running" | "detached"),
    # so that membership tests cost O(1) instead of a scan of the queues.
    self._where: dict[int, tuple[Request, str]] = {}

  def _place(self, req: Request) -> str | None:
    entry = self._where.get(req.request_id)
    return entry[1] if entry is not None and entry[0] is req else None

  def _put(self, req: Request, place: str | None) -> None:
    if place is None:
      self._where.pop(req.request_id, None)
    else:
      self._where[req.request_id] = (req, place)

  # --------------------------------------------------------------- queue ops
  def add(self, req: Request) -> None:
    req.prefill_tokens = tuple(req.prompt)
    self.waiting.append(req)
    self._put(req, "waiting")

  def _queue(self, place: str):
    return {"waiting": self.waiting, "running": self.running, "detached": self.detached}[place]

  def remove(self, req: Request) -> bool:
    """Takes a live request out of the queues, returning its pages. Returns whether it was live."""
    place = self._place(req)
    if place is None:
      return False
    self._queue(place).remove(req)
    self._put(req, None)
    if place != "waiting":
      self.allocator.release_checked(req.request_id)
      self._rows.pop(req.request_id, None)
    return True

  def holds(self, req: Request) -> bool:
    """Whether the request is queued here, runs here or holds pages here detached."""
    return self._place(req) is not None

  def is_detached(self, req: Request) -> bool:
    """Whether the request holds pages here outside the steps (a prefill awaiting hand-over)."""
    return self._place(req) == "detached"

  def forget(self, req: Request) -> None:
    """Takes a request out of the queues without touching the allocator (it already dropped it)."""
    place = self._place(req)
    if place is not None:
      self._queue(place).remove(req)
      self._put(req, None)
    self._rows.pop(req.request_id, None)

  def drop_failed(self, req: Request) -> None:
    """Removes a request whose integrity check failed (its block table is not trusted)."""
    place = self._place(req)
    if place in ("running", "detached"):
      self._queue(place).remove(req)
      self._put(req, None)
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

  # --------------------------------------------------------------- pool API
  def can_admit(self, num_tokens: int, extra_pages: int = 0, shared_pages: int = 0) -> bool:
    """The admission rule: a running slot, and pages for ``num_tokens`` with the reserve left.

    The reserve (``admission_reserve`` free pages after admitting, so running
    requests can still grow) is waived when nothing runs, so a request that fits
    the pool alone can always start. ``extra_pages`` are pages already promised
    to running requests this step; ``shared_pages`` of the request's pages are
    cached pages it shares (they need no free page).
    """
    if self.slots_taken >= self.config.max_running:
      return False
    return self._page_shortfall(num_tokens, extra_pages, shared_pages) <= 0

  @property
  def slots_taken(self) -> int:
    """Running slots in use: running requests plus reservations."""
    return len(self.running) + len(self.reservations)

  def _reservation_key(self, key):
    return ("reservation", key)

  def reserve(self, key, num_tokens: int) -> bool:
    """Holds a running slot and pages for ``num_tokens`` under ``key``, by the admission rule.

    For a request whose KV will arrive from elsewhere and be :meth:`adopt`-ed
    with ``reservation=key``: holding the pages first means an admitted request
    can always land. Cached prefix pages are evicted to make room, as for any
    admission. Returns whether the reservation was made (nothing changes if not).

    Raises:
      ValueError: ``key`` already holds a reservation.
    """
    if key in self.reservations:
      raise ValueError(f"reserve: {key!r} already holds a reservation")
    if self.slots_taken >= self.config.max_running:
      return False
    self._make_room(self._page_shortfall(num_tokens))
    if self._page_shortfall(num_tokens) > 0:
      return False
    if self.allocator.admit(self._reservation_key(key), num_tokens) is not None:
      return False
    self.reservations[key] = num_tokens
    return True

  def release_reservation(self, key) -> None:
    """Returns a reservation's slot and pages (no-op for an unknown key).

    The audit's recovery may already have dropped its pages (a quarantined page);
    the slot is returned either way.
    """
    if self.reservations.pop(key, None) is not None:
      k = self._reservation_key(key)
      if self.allocator.has_request(k):
        self.allocator.release_checked(k)

  def _page_shortfall(self, num_tokens: int, extra_pages: int = 0, shared_pages: int = 0) -> int:
    reserve = self.config.admission_reserve if (self.running or self.reservations) else 0
    need = self.allocator.pages_for(num_tokens) - shared_pages + reserve + extra_pages
    return need - self.allocator.num_free

  def _make_room(self, shortfall: int, keep=()) -> None:
    """Evicts cached pages (LRU) to free ``shortfall`` pages, if there is a cache."""
    if shortfall > 0 and self.prefix_cache is not None:
      self.prefix_cache.evict(shortfall, keep=keep)

  def adopt(self, req: Request, num_tokens: int, reservation=None) -> int | None:
    """Admits a request whose first ``num_tokens`` tokens of KV arrive from elsewhere.

    With ``reservation`` (a key given to :meth:`reserve`), that reservation's slot and
    pages are released first, in the same call, so they are what the request gets.

    Shares whatever whole pages of those tokens the prefix cache holds,
    allocates the rest (fresh tags) and puts the request in the running set,
    DECODING. The caller writes the KV of positions [shared, num_tokens) into
    :meth:`row`'s pages before the next step.

    Returns:
      The tokens shared from the cache (a multiple of the page size, 0 without
      a cache), or None when :meth:`can_admit` refused even after evicting
      cached pages (nothing changed).
    """
    if reservation is not None:
      self.release_reservation(reservation)
    if self.slots_taken >= self.config.max_running:
      return None
    cache = self.prefix_cache
    match = cache.match(req.prefill_tokens[:num_tokens]) if cache is not None else Match()
    if self._page_shortfall(num_tokens, 0, len(match.pages)) > 0 and cache is not None:
      self._make_room(self._page_shortfall(num_tokens, 0, len(match.pages)), keep=match.pages)
      match = cache.match(req.prefill_tokens[:num_tokens])  # as in schedule()
    shared = len(match.pages)
    if (not self.can_admit(num_tokens, 0, shared)
        or self.allocator.admit(req.request_id, num_tokens, prefix_pages=match.pages,
                                prefix_tags=match.tags) is not None):
      return None
    if cache is not None:  # only whole pages: no copy-on-write for KV that arrives whole
      cache.record_lookup(num_tokens, Match(match.pages, match.tags))
    req.status = RequestStatus.DECODING
    req.admit_seq = self._admit_counter
    self._admit_counter += 1
    self.running.append(req)
    self._put(req, "running")
    self._rows.pop(req.request_id, None)
    return shared * self.allocator.page_size

  def detach(self, req: Request) -> None:
    """Takes a running request out of this pool's steps, keeping its pages (see ``detached``)."""
    self.running.remove(req)
    self.detached.append(req)
    self._put(req, "detached")
    self._rows.pop(req.request_id, None)

  def drain_preempted(self) -> list[Request]:
    """Removes and returns every waiting request that was preempted here, in queue order.

    For a pool that does not recompute (the decode pool): the caller requeues
    them where their prompts are prefilled.
    """
    out = [r for r in self.waiting if r.request_id in self._preempted]
    for r in out:
      self.waiting.remove(r)
      self._put(r, None)
    self._preempted.clear()
    return out

  def requeue(self, reqs) -> None:
    """Puts requests (preempted elsewhere) at the head of the waiting queue, in the given order."""
    for req in reversed(list(reqs)):
      req.status = RequestStatus.WAITING
      req.prefill_tokens = tuple(req.prompt) + tuple(req.output)
      req.num_computed = 0
      self.waiting.appendleft(req)
      self._put(req, "waiting")

  # --------------------------------------------------------------- one step
  def schedule(self, *, in_flight: bool = False) -> Plan | None:
    """Decides the next step (admits, grows, preempts, picks prefill chunks).

    Args:
      in_flight: a step is in flight (requests may have ``pending`` tokens):
        grow for them, never preempt.

    Returns:
      The Plan; None (nothing changed) when ``in_flight`` and the pool cannot
      grow every decoding request without a preemption.
    """
    cfg = self.config
    alloc = self.allocator
    la = cfg.lookahead  # room a speculative step writes past a sequence's tokens
    admitted, preempted = [], []
    changed = False
    decoding = [r for r in self.running if r.status is RequestStatus.DECODING
                and len(r.output) + r.pending < r.sampling.max_new_tokens]
    growth = 0
    if in_flight:
      # Pages every decoding request needs for its next token (after the pending one).
      growth = sum(max(alloc.pages_for(r.context_len + r.pending + la) - len(self.row(r)[0]), 0)
                   for r in decoding)
      self._make_room(growth - alloc.num_free)
      if growth > alloc.num_free:
        return None
    # 1. Admission, after the longest cached prefix (if any).
    cache = self.prefix_cache
    copies, keep = [], set()
    while self.waiting and self.slots_taken < cfg.max_running:
      req = self.waiting[0]
      n = len(req.prefill_tokens) + la
      match = cache.match(req.prefill_tokens) if cache is not None else Match()
      held = set(match.pages) | ({match.copy_from} if match.copy_from is not None else set())
      if self._page_shortfall(n, growth, len(match.pages)) > 0 and cache is not None:
        self._make_room(self._page_shortfall(n, growth, len(match.pages)), keep=keep | held)
        # Match again: eviction rebuilds counts when it meets a page retagged behind the
        # cache's back, which can leave an earlier match's page unheld.
        match = cache.match(req.prefill_tokens)
        held = set(match.pages) | ({match.copy_from} if match.copy_from is not None else set())
      if not self.can_admit(n, growth, len(match.pages)):
        break
      if alloc.admit(req.request_id, n, prefix_pages=match.pages,
                     prefix_tags=match.tags) is not None:
        break
      self.waiting.popleft()
      self._put(req, "running")
      if cache is not None:
        cache.record_lookup(n - la, match)
        keep |= held
        if match.copy_from is not None:
          copies.append((match.copy_from, int(self.row(req)[0][len(match.pages)])))
      req.status = RequestStatus.PREFILLING
      req.num_computed = match.tokens(alloc.page_size)
      req.admit_seq = self._admit_counter
      self._admit_counter += 1
      self.running.append(req)
      admitted.append(req)
      changed = True
    # 2. Decode growth, oldest first; preempt the youngest when the pool is dry.
    decode = []
    for req in decoding:
      if self._place(req) != "running":
        continue
      while True:
        pages_before = len(self.row(req)[0])
        if alloc.extend(req.request_id, req.context_len + req.pending + la) is None:
          if alloc.pages_for(req.context_len + req.pending + la) > pages_before:
            self._rows.pop(req.request_id, None)
            changed = True
          decode.append(req)
          break
        shortfall = (alloc.pages_for(req.context_len + req.pending + la) - pages_before
                     - alloc.num_free)
        if self.prefix_cache is not None and self.prefix_cache.evict(shortfall, keep=keep):
          continue  # cached pages went back to the free list: try again before preempting
        assert not in_flight, "growth was checked to fit"
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
      if budget <= 0 or len(prefill) >= max_rows:
        break
      n = min(len(req.prefill_tokens) - req.num_computed, cfg.prefill_buckets[-1], budget)
      if n <= 0:  # its last chunk is in flight
        continue
      prefill.append(PrefillItem(req, req.num_computed, n))
      budget -= n
    return Plan(prefill=prefill, decode=decode, admitted=admitted, preempted=preempted,
                allocation_changed=changed, copies=copies)

  def _preempt(self, req: Request) -> None:
    self.running.remove(req)
    self._put(req, "waiting")
    self.allocator.release_checked(req.request_id)
    self._rows.pop(req.request_id, None)
    req.status = RequestStatus.WAITING
    req.prefill_tokens = tuple(req.prompt) + tuple(req.output)
    req.num_computed = 0
    req.num_preemptions += 1
    self.waiting.appendleft(req)
    self._preempted.add(req.request_id)
    logging.info("scheduler: preempted request %d (%d tokens to recompute)", req.request_id,
                 len(req.prefill_tokens))
