"""Host-side page allocator: free list, generation tags, refcounts, block tables, audit.

Plain Python and numpy; the device only ever sees the arrays it produces
(``BatchMeta`` and the ``page_tags`` mirror, see ``state.sync_tags``).

Tags: every allocation of a page gives it a new uint32 tag drawn from one
pool-wide generation counter, which wraps modulo 2**32 and skips 0 (reserved for
"never allocated", the value a fresh device ``page_tags`` array holds). So a
reallocated page never carries its old tag, and, until the counter wraps after
2**32 - 1 allocations, no two allocations anywhere share a tag: a block-table
entry that points at the wrong page fails the tag check too, which per-page
counters (every page's first tag being 1) would miss.

Pages are conserved by construction (docs/integrity.md):

* the free list is an ordered set, so a page is on it at most once;
* ``free`` of a page that holds no reference is an error, and a page returns to
  the free list only when its last reference goes;
* ``allocate`` never hands out a page that holds references: a live page found
  on the free list (a bookkeeping bug elsewhere) is quarantined and reported as
  a :class:`PageViolation` instead;
* a quarantined page returns to the free list only by :meth:`PageAllocator.heal`:
  once no block table names it and it has stayed out for a grace period, with a
  fresh tag, so a stale table entry that still names it fails its tag check.

:meth:`PageAllocator.audit` checks the whole pool (free + live + quarantined =
all pages, refcounts equal block-table references) and reports what breaks it.
:meth:`PageAllocator.audit_changes` checks the same invariants on the pages
whose bookkeeping changed since the last audit, which is what the engine runs
around every step: its cost follows the pages a step touched, not the pool.
That is complete because every change goes through this class, which marks the
pages it touches (and the number of block-table entries naming each page is
kept as tables change, not recounted); a test that edits the bookkeeping
behind the API says so with :meth:`PageAllocator.tampering`. The engine aborts
the requests that hold a violating page.

Tags changed since the device last saw them are kept too
(:meth:`PageAllocator.take_tag_changes`), so that a step's tag update moves
only the pages it (re)allocated.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses

import jax.numpy as jnp
import numpy as np

from mlkit.kvcache.state import PAD_PAGE, BatchMeta

_TAG_MOD = 1 << 32


def next_tag(tag: int) -> int:
  """The uint32 successor of ``tag``, skipping the reserved 0."""
  t = (int(tag) + 1) % _TAG_MOD
  return 1 if t == 0 else t


def tag_to_int32(tag: int) -> int:
  """A uint32 tag as the int32 the device stores (two's-complement bit-cast)."""
  return int(np.array(tag, np.uint32).view(np.int32))


class OutOfPages(ValueError):
  """Raised by ``allocate`` when the free list cannot satisfy a request."""


@dataclasses.dataclass(frozen=True)
class CannotAdmit:
  """The allocator's answer when a request does not fit: nothing was allocated.

  Attributes:
    request_id: the request that was refused.
    pages_needed: pages the operation needed.
    pages_free: pages free at the time.
  """

  request_id: object
  pages_needed: int
  pages_free: int

  def __str__(self) -> str:
    return (f"cannot admit request {self.request_id!r}: needs {self.pages_needed} pages, "
            f"{self.pages_free} free")


@dataclasses.dataclass(frozen=True)
class PageViolation:
  """A broken page-conservation invariant, found by ``audit`` or by ``allocate``.

  Attributes:
    kind: "live_on_free_list" (a page with references is listed free),
      "quarantined_on_free_list", "refcount_mismatch" (refcount differs from the
      number of block-table entries naming the page: a use after free, a wrong
      entry, a lost reference), "leaked" (no reference, not free, not
      quarantined), "out_of_pool" (a block table names a page outside the pool).
    pages: the pages involved (empty for out_of_pool).
    requests: requests whose block tables name those pages (or the bad id).
    detail: a human-readable explanation.
  """

  kind: str
  pages: tuple[int, ...]
  requests: tuple
  detail: str

  def __str__(self) -> str:
    return f"{self.kind}: {self.detail}"


@dataclasses.dataclass
class _Request:
  # numpy, so that the audit concatenates every table without a Python loop over entries.
  pages: np.ndarray  # [n] int32 physical page ids, in order
  tags: np.ndarray  # [n] uint32 expected tag of each page, as allocated
  length: int  # tokens the request holds


def _new_request(pages, tags, length: int) -> _Request:
  return _Request(np.asarray(pages, np.int32).reshape(-1), np.asarray(tags, np.uint32).reshape(-1),
                  int(length))


class Tampering:
  """What :meth:`PageAllocator.tampering` lets a test change (see there).

  Attributes:
    pages: [n] int32 the request's block table (edit in place), or None.
    tags: [n] uint32 its expected tags (edit in place), or None.
  """

  def __init__(self, allocator: "PageAllocator", rec: _Request | None):
    self._allocator = allocator
    self.pages = None if rec is None else rec.pages
    self.tags = None if rec is None else rec.tags

  def list_first(self, page: int) -> None:
    """Lists ``page`` at the head of the free list, whatever its refcount (a bookkeeping bug)."""
    a = self._allocator
    a._free[int(page)] = None
    a._free.move_to_end(int(page), last=False)


class PageAllocator:
  """Free list + uint32 generation tags + refcounts + per-request block tables.

  Args:
    num_pages: pages in the pool.
    page_size: tokens per page.

  Raises:
    ValueError: on non-positive sizes.
  """

  def __init__(self, num_pages: int, page_size: int):
    if (not isinstance(num_pages, (int, np.integer)) or not isinstance(page_size, (int, np.integer))
        or num_pages <= 0 or page_size <= 0):
      raise ValueError(f"PageAllocator needs positive int num_pages and page_size, "
                       f"got {num_pages!r}, {page_size!r}")
    self.num_pages = int(num_pages)
    self.page_size = int(page_size)
    # Ordered set of free pages: a page is listed at most once. An OrderedDict, not a dict:
    # a dict whose first keys were deleted scans their empty slots to find its first live
    # key, so taking a page off a large pool's free list would cost O(pages taken before).
    self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(
        range(self.num_pages))
    self.tags = np.zeros(self.num_pages, np.uint32)  # host truth; 0 = never allocated
    self.refcounts = np.zeros(self.num_pages, np.int32)
    # The last tag handed out (uint32); the next allocation gets next_tag(self.generation).
    self.generation = 0
    # Pages taken out of circulation after a violation -> the clock when they were taken.
    # They return to the free list only through heal().
    self.quarantined: dict[int, int] = {}
    # Advanced once per engine step (tick); a quarantine's grace period is counted in it.
    self.clock = 0
    self.quarantined_total = 0  # pages ever quarantined
    self.healed_total = 0  # pages ever healed back into circulation
    self._requests: dict[object, _Request] = {}
    self._violations: list[PageViolation] = []  # found by allocate(), drained by the owner
    # Block-table entries naming each page, kept as tables change (the audit compares it with
    # the refcounts); requests whose tables name pages outside the pool (only a bug can).
    self._table_refs = np.zeros(self.num_pages, np.int32)
    self._out_of_pool: set = set()
    # Pages whose bookkeeping changed since the last audit, and whose tags changed since the
    # device last took them.
    self._dirty: set[int] = set()
    self._tags_changed: set[int] = set()
    # Work counters (host_scale, the counting tests): pages the incremental audit visited,
    # full audits.
    self.work: collections.Counter = collections.Counter()

  # --------------------------------------------------------------- pages
  @property
  def num_free(self) -> int:
    """Pages on the free list."""
    return len(self._free)

  @property
  def num_used(self) -> int:
    """Pages neither free nor quarantined (held by requests)."""
    return self.num_pages - self.num_free - len(self.quarantined)

  def pages_for(self, num_tokens: int) -> int:
    """Pages needed to hold ``num_tokens`` tokens."""
    return -(-int(num_tokens) // self.page_size)

  def allocate(self, n: int) -> list[int]:
    """Takes ``n`` pages off the free list, giving each a fresh tag; refcount becomes 1.

    A page found on the free list while it holds references (or is
    quarantined) is never handed out: it is quarantined and recorded as a
    violation (see :meth:`drain_violations`), and the next free page is used.

    Raises:
      OutOfPages: if fewer than ``n`` usable pages are free (nothing is taken).
      ValueError: if n < 0.
    """
    if not isinstance(n, (int, np.integer)) or n < 0:
      raise ValueError(f"allocate: n must be an int >= 0, got {n!r}")
    pages: list[int] = []
    bad: list[int] = []
    for p in self._free:  # stops after n usable pages: O(n) unless the list is corrupt
      if len(pages) == n:
        break
      if self.refcounts[p] > 0 or p in self.quarantined:
        bad.append(p)
      else:
        pages.append(p)
    for p in bad:
      del self._free[p]
      self._dirty.add(p)
      self._quarantine_one(p)
      self._violations.append(PageViolation(
          "live_on_free_list", (p,), tuple(self.holders([p])),
          f"page {p} was on the free list with {int(self.refcounts[p])} reference(s); "
          "quarantined instead of handed out"))
    if len(pages) < n:
      raise OutOfPages(f"allocate: {n} pages requested, {len(self._free)} free")
    for p in pages:
      del self._free[p]
      self.generation = next_tag(self.generation)
      self.tags[p] = self.generation
      self.refcounts[p] = 1
    self._dirty.update(pages)
    self._tags_changed.update(pages)
    return pages

  def share(self, pages) -> None:
    """Adds one reference to each (allocated) page, e.g. for a shared prefix.

    Raises:
      ValueError: if a page is free, quarantined or outside the pool.
    """
    pages = list(pages)
    for p in pages:
      self._check_owned(p, "share")
      if int(p) in self.quarantined:
        raise ValueError(f"share: page {p} is quarantined")
    for p in pages:
      self.refcounts[p] += 1
    self._dirty.update(int(p) for p in pages)

  def free(self, pages) -> None:
    """Drops one reference from each page; pages reaching refcount 0 return to the free list.

    A quarantined page stays off it until :meth:`heal`.

    Raises:
      ValueError: if a page is outside the pool or holds fewer references than it is
        freed (a double free); nothing changes.
    """
    pages = [int(p) for p in pages]
    drops = collections.Counter(pages)
    for p, k in drops.items():
      self._check_owned(p, "free")
      if self.refcounts[p] < k:
        raise ValueError(f"free: page {p} freed {k} times but holds {int(self.refcounts[p])} references")
    for p in pages:
      self.refcounts[p] -= 1
      if self.refcounts[p] == 0 and p not in self.quarantined:
        self._free[p] = None
    self._dirty.update(pages)

  def _check_owned(self, p, what: str) -> None:
    if not isinstance(p, (int, np.integer)) or not 0 <= int(p) < self.num_pages:
      raise ValueError(f"{what}: page {p!r} is outside the pool of {self.num_pages} pages")
    if self.refcounts[p] <= 0:
      raise ValueError(f"{what}: page {p} is not allocated")

  # --------------------------------------------------------------- requests
  def has_request(self, request_id) -> bool:
    return request_id in self._requests

  @property
  def request_ids(self) -> list:
    """Ids of the requests holding pages, in admission order."""
    return list(self._requests)

  def admit(self, request_id, num_tokens: int, prefix_pages=(),
            prefix_tags=None) -> CannotAdmit | None:
    """Gives a new request pages for ``num_tokens`` tokens.

    Args:
      request_id: the new holder (any hashable).
      num_tokens: tokens its table must hold.
      prefix_pages: allocated pages that become the first entries of its table,
        shared (one more reference each, same tag: e.g. a cached prefix); the
        rest are fresh pages.
      prefix_tags: the tags the request expects on ``prefix_pages`` (uint32; default
        their current tags). A sharer passes what the pages held when their KV was
        cached, so that a page retagged since fails the request's tag check.

    Returns:
      None on success; a :class:`CannotAdmit` (and no allocation) when the pool is short.

    Raises:
      ValueError: if the request id is already admitted, num_tokens < 0, or a
        prefix page is free, quarantined, outside the pool, or more than
        ``num_tokens`` needs.
    """
    if request_id in self._requests:
      raise ValueError(f"admit: request {request_id!r} is already admitted")
    if num_tokens < 0:
      raise ValueError(f"admit: num_tokens must be >= 0, got {num_tokens}")
    prefix = [int(p) for p in prefix_pages]
    n = self.pages_for(num_tokens)
    if len(prefix) > n:
      raise ValueError(f"admit: {len(prefix)} prefix pages for {num_tokens} tokens")
    if prefix_tags is not None and len(prefix_tags) != len(prefix):
      raise ValueError(f"admit: {len(prefix_tags)} prefix tags for {len(prefix)} prefix pages")
    self.share(prefix)  # validates before anything is allocated
    if n - len(prefix) > self.num_free:
      self.free(prefix)
      return CannotAdmit(request_id, n - len(prefix), self.num_free)
    try:
      pages = self.allocate(n - len(prefix))
    except OutOfPages:  # quarantined entries made the free list shorter than it looked
      self.free(prefix)
      return CannotAdmit(request_id, n - len(prefix), self.num_free)
    tags = self.tags[prefix + pages]  # a copy (fancy indexing)
    if prefix_tags is not None:
      tags[:len(prefix)] = np.asarray([int(t) & 0xFFFFFFFF for t in prefix_tags], np.uint32)
    self._set_table(request_id, _new_request(prefix + pages, tags, num_tokens))
    return None

  def extend(self, request_id, num_tokens: int) -> CannotAdmit | None:
    """Grows a request to ``num_tokens`` tokens (e.g. before a decode step), adding pages as needed.

    Returns:
      None on success, or a :class:`CannotAdmit` with nothing changed.

    Raises:
      ValueError: unknown request, or a shrinking length.
    """
    req = self._get(request_id)
    if num_tokens < req.length:
      raise ValueError(f"extend: request {request_id!r} holds {req.length} tokens, cannot shrink to {num_tokens}")
    extra = max(self.pages_for(num_tokens) - len(req.pages), 0)
    if extra > self.num_free:
      return CannotAdmit(request_id, extra, self.num_free)
    try:
      pages = self.allocate(extra)
    except OutOfPages:
      return CannotAdmit(request_id, extra, self.num_free)
    if pages:
      req.pages = np.concatenate([req.pages, np.asarray(pages, np.int32)])
      req.tags = np.concatenate([req.tags, self.tags[pages]])
      self._table_refs[pages] += 1
    req.length = int(num_tokens)
    return None

  def fork(self, parent_id, child_id, num_tokens: int | None = None) -> CannotAdmit | list[tuple[int, int]]:
    """Admits ``child_id`` sharing the parent's first ``num_tokens`` tokens (default: all).

    Full pages are shared (refcount + 1, same tag). A trailing partial page is not
    shared, because the child would write into it: the child gets a fresh page and
    the caller copies the partial page with ``state.copy_pages``.

    Returns:
      The (src, dst) page copies to perform (empty or one pair), or a
      :class:`CannotAdmit` (nothing changed) if no page is free for the partial tail.

    Raises:
      ValueError: unknown parent, existing child, or num_tokens beyond the parent's length.
    """
    parent = self._get(parent_id)
    if child_id in self._requests:
      raise ValueError(f"fork: request {child_id!r} is already admitted")
    n_tok = parent.length if num_tokens is None else int(num_tokens)
    if not 0 <= n_tok <= parent.length:
      raise ValueError(f"fork: {n_tok} tokens requested, parent holds {parent.length}")
    full, rem = divmod(n_tok, self.page_size)
    shared = parent.pages[:full].tolist()
    self.share(shared)  # validates before anything is allocated
    pages, tags = list(shared), parent.tags[:full].tolist()
    copies = []
    if rem:
      try:
        (p,) = self.allocate(1)
      except OutOfPages:
        self.free(shared)
        return CannotAdmit(child_id, 1, self.num_free)
      copies.append((int(parent.pages[full]), p))
      pages.append(p)
      tags.append(int(self.tags[p]))
    self._set_table(child_id, _new_request(pages, tags, n_tok))
    return copies

  def release(self, request_id) -> None:
    """Drops a request and one reference on each of its pages.

    Raises:
      ValueError: unknown request, or its pages' references are inconsistent (nothing
        changes then; see :meth:`release_checked`).
    """
    req = self._get(request_id)
    self.free(req.pages.tolist())
    self._pop_table(request_id)

  def release_checked(self, request_id) -> list[int]:
    """``release``, falling back to :meth:`drop_and_reconcile` if the bookkeeping is inconsistent.

    The table is not trusted when a page it lists no longer carries the tag the
    request was given (freed behind its back and handed to another request, or a
    wrong entry pointing at someone else's page): releasing by that table would
    drop another request's reference, and could put a live page on the free
    list. A page already freed shows up as a double free. Either way the request
    is forgotten and the pool rebuilt from the other tables.

    Returns:
      Pages reclaimed by reconciliation (empty when the plain release worked).
    """
    req = self._get(request_id)
    pages = req.pages
    if (pages.size and (pages.min() < 0 or pages.max() >= self.num_pages
                        or np.any(self.tags[pages] != req.tags))):
      return self.drop_and_reconcile(request_id)
    try:
      self.release(request_id)
      return []
    except ValueError:  # e.g. one of its pages was already freed behind its back
      return self.drop_and_reconcile(request_id)

  def drop_and_reconcile(self, request_id=None) -> list[int]:
    """Forgets a request without trusting its block table, then rebuilds refcounts and the free list.

    A request whose table is suspect may list pages that now belong to other
    requests (freed and reallocated, a wrong entry); freeing those would hand a
    live request's page to a third one. So nothing is freed by the request's
    list: every page's refcount becomes the number of live requests that list
    it, unlisted pages return to the free list (quarantined ones excepted, and
    the current free order kept), and listed pages leave it.

    Args:
      request_id: the request to forget, or None to only rebuild.

    Returns:
      The pages reclaimed (not free before, free now).
    """
    if request_id is not None:
      self._pop_table(request_id)
    counts = self._reference_counts()  # rare (a failed request): recounted from every table
    free = [p for p in self._free if counts[p] == 0 and p not in self.quarantined]
    listed = set(free)
    reclaimed = [p for p in range(self.num_pages)
                 if counts[p] == 0 and p not in listed and p not in self.quarantined]
    left = set(self._free) - listed
    self._free = collections.OrderedDict.fromkeys(free + reclaimed)
    changed = np.flatnonzero((self.refcounts != counts) | (self._table_refs != counts))
    self.refcounts[:] = counts
    self._table_refs[:] = counts
    self._dirty.update(changed.tolist(), reclaimed, left)
    return reclaimed

  def block_table(self, request_id) -> list[tuple[int, int]]:
    """The request's (page, expected uint32 tag) pairs, in position order."""
    req = self._get(request_id)
    return list(zip(req.pages.tolist(), req.tags.tolist()))

  def table_arrays(self, request_id) -> tuple[np.ndarray, np.ndarray]:
    """(pages [n] int32, expected tags [n] int32 bit-cast) of a request: copies for a step's tables."""
    req = self._get(request_id)
    return req.pages.copy(), req.tags.view(np.int32).copy()

  def length(self, request_id) -> int:
    return self._get(request_id).length

  def _get(self, request_id) -> _Request:
    try:
      return self._requests[request_id]
    except KeyError:
      raise ValueError(f"unknown request {request_id!r}") from None

  # --------------------------------------------------------------- conservation
  def holders(self, pages) -> list:
    """Requests whose block tables name any of ``pages``, in admission order."""
    pages = np.fromiter((int(p) for p in pages), np.int64)
    return [rid for rid, r in self._requests.items() if np.isin(r.pages, pages).any()]

  def quarantine(self, pages) -> None:
    """Takes pages out of circulation: off the free list until :meth:`heal` returns them.

    Requests holding them keep their references until they are dropped; the
    caller aborts them (a quarantined page's contents are not trusted).
    """
    for p in pages:
      p = int(p)
      if not 0 <= p < self.num_pages:
        raise ValueError(f"quarantine: page {p} is outside the pool of {self.num_pages} pages")
      self._free.pop(p, None)
      self._dirty.add(p)
      self._quarantine_one(p)

  def _quarantine_one(self, p: int) -> None:
    if int(p) not in self.quarantined:
      self.quarantined[int(p)] = self.clock
      self.quarantined_total += 1

  def tick(self) -> None:
    """Advances the clock that quarantine grace periods are counted in (once per engine step)."""
    self.clock += 1

  def heal(self, grace: int) -> list[int]:
    """Returns quarantined pages to the free list once nobody holds them and ``grace`` ticks passed.

    A page heals when it has been quarantined for at least ``grace`` ticks, holds
    no reference, and no block table names it (every holder was aborted and
    dropped). It gets a fresh tag on the way, so an entry of a stale table that
    still names it fails the tag check, and it joins the end of the free list.

    Args:
      grace: ticks a page stays out after its quarantine (>= 0).

    Returns:
      The pages healed (their tags changed: the caller syncs the device tags).
    """
    if not self.quarantined:
      return []
    healed = []
    for p, since in list(self.quarantined.items()):
      # No reference, and no table names it (its holders were dropped, not just unreferenced).
      if self.clock - since < grace or self.refcounts[p] or self._table_refs[p]:
        continue
      del self.quarantined[p]
      self.generation = next_tag(self.generation)
      self.tags[p] = self.generation
      self._free[p] = None
      healed.append(p)
    self._dirty.update(healed)
    self._tags_changed.update(healed)
    self.healed_total += len(healed)
    return healed

  def recover(self, violations) -> list:
    """Quarantines the pages of ``violations`` and drops every request that names one.

    The pages' contents and their holders' tables are not trusted any more: the
    pages leave circulation (until :meth:`heal`), their holders are forgotten
    (the caller aborts them), and refcounts and the free list are rebuilt from
    the remaining tables, after which :meth:`audit` finds nothing.

    Returns:
      The ids of the requests dropped, in admission order.
    """
    pages = sorted({p for v in violations for p in v.pages})
    holders = list(dict.fromkeys([*self.holders(pages), *(r for v in violations for r in v.requests)]))
    self.quarantine(pages)
    for rid in holders:
      self._pop_table(rid)
    self.drop_and_reconcile(None)
    return holders

  def drain_violations(self) -> list[PageViolation]:
    """Violations ``allocate`` found (live pages on the free list) since the last call."""
    out, self._violations = self._violations, []
    return out

  def _table_ids(self) -> np.ndarray:
    """Every block-table entry of every request, concatenated (int64; may hold bad ids)."""
    if not self._requests:
      return np.zeros(0, np.int64)
    return np.concatenate([r.pages for r in self._requests.values()]).astype(np.int64)

  def _reference_counts(self, ids: np.ndarray | None = None) -> np.ndarray:
    """[num_pages] int32: how many block-table entries name each page (in-pool ids only)."""
    ids = self._table_ids() if ids is None else ids
    ids = ids[(ids >= 0) & (ids < self.num_pages)]
    return np.bincount(ids, minlength=self.num_pages).astype(np.int32)

  def audit(self) -> list[PageViolation]:
    """Checks page conservation over the whole pool; returns what breaks it (empty: all holds).

    Invariants: the free list holds only pages without references and outside
    quarantine; every page is free, held or quarantined; every page's refcount
    equals the number of block-table entries naming it (pages shared by
    ``fork``/``share`` count once per table); block tables name only pages in
    the pool. The entries are recounted from every table, so this also finds
    tables edited behind the API's back. Costs O(pool + table entries),
    vectorised: for tests and investigations; the engine runs
    :meth:`audit_changes` every step.
    """
    n = self.num_pages
    out: list[PageViolation] = []
    ids = self._table_ids()
    counts = self._reference_counts(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= n):  # rare: find who, in Python
      out += [self._out_of_pool_violation(rid) for rid, r in self._requests.items()
              if ((r.pages < 0) | (r.pages >= n)).any()]
    self._table_refs[:] = counts  # the recount is the truth from here on
    free = np.fromiter(self._free, np.int64, len(self._free))
    on_free = np.zeros(n, bool)
    on_free[free] = True
    quarantined = np.zeros(n, bool)
    if self.quarantined:
      quarantined[np.fromiter(self.quarantined, np.int64, len(self.quarantined))] = True
    out += self._check(np.arange(n), counts, on_free, quarantined)
    self._dirty = {p for v in out for p in v.pages}
    self.work["full_audits"] += 1
    return out

  def audit_changes(self) -> list[PageViolation]:
    """:meth:`audit`'s invariants on the pages whose bookkeeping changed since the last audit.

    Every change goes through this class, which marks the pages it touches, and
    the block-table entries naming each page are counted as tables change, so
    this finds what :meth:`audit` would, at a cost that follows the pages
    touched (``work["audit_pages"]`` counts them), not the pool. Pages of the
    violations found stay marked until a recovery changes them.
    """
    pages = np.sort(np.fromiter(self._dirty, np.int64, len(self._dirty)))
    self.work["audit_pages"] += int(pages.size)
    out = [self._out_of_pool_violation(rid) for rid in self._out_of_pool
           if rid in self._requests]
    if pages.size:
      on_free = np.fromiter((p in self._free for p in pages.tolist()), bool, pages.size)
      quarantined = np.fromiter((p in self.quarantined for p in pages.tolist()), bool, pages.size)
      out += self._check(pages, self._table_refs[pages], on_free, quarantined)
    self._dirty = {p for v in out for p in v.pages}
    return out

  def _out_of_pool_violation(self, rid) -> PageViolation:
    bad = [p for p in self._requests[rid].pages.tolist() if not 0 <= p < self.num_pages]
    return PageViolation("out_of_pool", (), (rid,), f"request {rid!r} lists page(s) "
                         f"{bad[:4]} outside the pool of {self.num_pages}")

  def _check(self, pages: np.ndarray, counts: np.ndarray, on_free: np.ndarray,
             quarantined: np.ndarray) -> list[PageViolation]:
    """The conservation invariants on ``pages`` given, per page, its table entries
    (``counts``), free-list membership and quarantine."""
    out = []
    refs = self.refcounts[pages]
    live_free = pages[on_free & (refs > 0)]
    if live_free.size:
      out.append(self._violation("live_on_free_list", live_free,
                                 "page(s) {} are on the free list with references"))
    q_free = pages[on_free & quarantined]
    if q_free.size:
      out.append(self._violation("quarantined_on_free_list", q_free,
                                 "quarantined page(s) {} are on the free list"))
    bad = counts != refs
    if bad.any():
      out.append(self._violation(
          "refcount_mismatch", pages[bad],
          "page(s) {} have refcounts " + str(refs[bad][:4].tolist()) + " but "
          + str(counts[bad][:4].tolist()) + " block-table entries"))
    leaked = pages[~on_free & ~quarantined & (refs == 0) & (counts == 0)]
    if leaked.size:
      out.append(self._violation("leaked", leaked,
                                 "page(s) {} are neither free, held nor quarantined"))
    return out

  # --------------------------------------------------------------- tables and the test hook
  def _set_table(self, request_id, rec: _Request) -> None:
    self._requests[request_id] = rec
    self._count(request_id, rec.pages, +1)

  def _pop_table(self, request_id) -> None:
    rec = self._requests.pop(request_id, None)
    if rec is not None:
      self._count(request_id, rec.pages, -1)

  def _count(self, request_id, pages: np.ndarray, sign: int) -> None:
    """Adds (+1) or removes (-1) a table's entries in the kept counts; marks its pages."""
    inside = pages[(pages >= 0) & (pages < self.num_pages)]
    np.add.at(self._table_refs, inside, sign)
    self._dirty.update(inside.tolist())
    if inside.size != pages.size and sign > 0:
      self._out_of_pool.add(request_id)
    elif sign < 0:
      self._out_of_pool.discard(request_id)

  @contextlib.contextmanager
  def tampering(self, request_id=None):
    """Test hook (``mlkit.engine.faults``): bookkeeping edited behind the API inside this block.

    Yields a :class:`Tampering` handle: the request's table (``pages`` and
    ``tags``, numpy arrays to edit in place; None without ``request_id``) and
    :meth:`Tampering.list_first`, which lists a page at the head of the free list
    whatever it holds. On exit the table's entries are recounted and every page
    whose table entries or free-list membership changed is marked for
    :meth:`audit_changes`, which then finds the corruption as :meth:`audit`
    would. Refcounts are not touched: they are what the bookkeeping believes, and
    a mismatch is what the audit is for.
    """
    rec = self._requests.get(request_id)
    before = rec.pages.copy() if rec is not None else np.zeros(0, np.int32)
    free_before = set(self._free)
    try:
      yield Tampering(self, rec)
    finally:
      if rec is not None:
        self._count(request_id, before, -1)
        self._count(request_id, np.asarray(rec.pages, np.int64), +1)
      self._dirty.update(p for p in free_before.symmetric_difference(self._free)
                         if 0 <= p < self.num_pages)

  def _violation(self, kind: str, pages: np.ndarray, fmt: str) -> PageViolation:
    pages = tuple(int(p) for p in pages)
    shown = f"{list(pages[:4])}{' ...' if len(pages) > 4 else ''}"
    return PageViolation(kind, pages, tuple(self.holders(pages)), fmt.format(shown))

  # --------------------------------------------------------------- device side
  def device_tags(self) -> np.ndarray:
    """[num_pages] int32: the uint32 tags bit-cast for the device ``page_tags`` mirror.

    Taking every tag also takes the pending changes (:meth:`take_tag_changes`)."""
    self._tags_changed.clear()
    return self.tags.view(np.int32).copy()

  def take_tag_changes(self) -> tuple[np.ndarray, np.ndarray]:
    """(pages [k] int32, tags [k] int32 bit-cast) whose tags changed since the last take.

    What a step's tag update writes into the device ``page_tags``: the pages the
    step allocated (or healed), not the pool.
    """
    pages = np.fromiter(sorted(self._tags_changed), np.int32, len(self._tags_changed))
    self._tags_changed.clear()
    return pages, self.tags[pages].view(np.int32)

  def batch_meta(self, request_ids, max_pages: int | None = None) -> BatchMeta:
    """Batch metadata for a step over ``request_ids`` (None entries are padding rows).

    Args:
      request_ids: requests in batch order; None makes a row of length 0.
      max_pages: block-table width (default: the widest request, at least 1).

    Returns:
      BatchMeta with block_tables / expected_tags [B, max_pages] int32 (PAD_PAGE / 0
      past each request's pages), lengths [B] int32, page_size set.

    Raises:
      ValueError: unknown request, or a request with more than max_pages pages.
    """
    reqs = [None if r is None else self._get(r) for r in request_ids]
    widest = max([len(r.pages) for r in reqs if r is not None] + [1])
    M = widest if max_pages is None else int(max_pages)
    if widest > M:
      raise ValueError(f"batch_meta: a request holds {widest} pages, max_pages is {M}")
    bt = np.full((len(reqs), M), PAD_PAGE, np.int32)
    tags = np.zeros((len(reqs), M), np.uint32)
    lengths = np.zeros((len(reqs),), np.int32)
    for b, r in enumerate(reqs):
      if r is None:
        continue
      bt[b, :len(r.pages)] = r.pages
      tags[b, :len(r.tags)] = r.tags
      lengths[b] = r.length
    return BatchMeta(block_tables=jnp.asarray(bt), lengths=jnp.asarray(lengths),
                     expected_tags=jnp.asarray(tags.view(np.int32)), page_size=self.page_size)
