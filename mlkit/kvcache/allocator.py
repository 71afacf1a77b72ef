"""Host-side page allocator: free list, generation tags, refcounts and block tables.

Plain Python and numpy; the device only ever sees the arrays it produces
(``BatchMeta`` and the ``page_tags`` mirror, see ``state.sync_tags``).

Tags: every allocation of a page gives it a new uint32 tag drawn from one
pool-wide generation counter, which wraps modulo 2**32 and skips 0 (reserved for
"never allocated", the value a fresh device ``page_tags`` array holds). So a
reallocated page never carries its old tag, and, until the counter wraps after
2**32 - 1 allocations, no two allocations anywhere share a tag: a block-table
entry that points at the wrong page fails the tag check too, which per-page
counters (every page's first tag being 1) would miss.
"""

from __future__ import annotations

import collections
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


@dataclasses.dataclass
class _Request:
  pages: list  # physical page ids, in order
  tags: list  # expected tag of each page (uint32), as allocated
  length: int  # tokens the request holds


class PageAllocator:
  """Free list + uint32 generation tags + refcounts + per-request block tables.

  Args:
    num_pages: pages in the pool.
    page_size: tokens per page.

  Raises:
    ValueError: on non-positive sizes.
  """

  def __init__(self, num_pages: int, page_size: int):
    if num_pages <= 0 or page_size <= 0:
      raise ValueError(f"PageAllocator needs positive num_pages and page_size, got {num_pages}, {page_size}")
    self.num_pages = int(num_pages)
    self.page_size = int(page_size)
    self._free = collections.deque(range(self.num_pages))
    self.tags = np.zeros(self.num_pages, np.uint32)  # host truth; 0 = never allocated
    self.refcounts = np.zeros(self.num_pages, np.int32)
    # The last tag handed out (uint32); the next allocation gets next_tag(self.generation).
    self.generation = 0
    self._requests: dict[object, _Request] = {}

  # --------------------------------------------------------------- pages
  @property
  def num_free(self) -> int:
    return len(self._free)

  def pages_for(self, num_tokens: int) -> int:
    """Pages needed to hold ``num_tokens`` tokens."""
    return -(-int(num_tokens) // self.page_size)

  def allocate(self, n: int) -> list[int]:
    """Takes ``n`` pages off the free list, giving each a fresh tag; refcount becomes 1.

    Raises:
      OutOfPages: if fewer than ``n`` pages are free (nothing is taken).
      ValueError: if n < 0.
    """
    if n < 0:
      raise ValueError(f"allocate: n must be >= 0, got {n}")
    if n > len(self._free):
      raise OutOfPages(f"allocate: {n} pages requested, {len(self._free)} free")
    pages = [self._free.popleft() for _ in range(n)]
    for p in pages:
      self.generation = next_tag(self.generation)
      self.tags[p] = self.generation
      self.refcounts[p] = 1
    return pages

  def share(self, pages) -> None:
    """Adds one reference to each (allocated) page, e.g. for a shared prefix.

    Raises:
      ValueError: if a page is free or outside the pool.
    """
    for p in pages:
      self._check_owned(p, "share")
    for p in pages:
      self.refcounts[p] += 1

  def free(self, pages) -> None:
    """Drops one reference from each page; pages reaching refcount 0 return to the free list.

    Raises:
      ValueError: if a page is outside the pool or already free (double free); nothing changes.
    """
    pages = list(pages)
    drops = collections.Counter(pages)
    for p, k in drops.items():
      self._check_owned(p, "free")
      if self.refcounts[p] < k:
        raise ValueError(f"free: page {p} freed {k} times but holds {int(self.refcounts[p])} references")
    for p in pages:
      self.refcounts[p] -= 1
      if self.refcounts[p] == 0:
        self._free.append(p)

  def _check_owned(self, p, what: str) -> None:
    if not 0 <= int(p) < self.num_pages:
      raise ValueError(f"{what}: page {p} is outside the pool of {self.num_pages} pages")
    if self.refcounts[p] <= 0:
      raise ValueError(f"{what}: page {p} is not allocated")

  # --------------------------------------------------------------- requests
  def has_request(self, request_id) -> bool:
    return request_id in self._requests

  def admit(self, request_id, num_tokens: int) -> CannotAdmit | None:
    """Gives a new request pages for ``num_tokens`` tokens.

    Returns:
      None on success; a :class:`CannotAdmit` (and no allocation) when the pool is short.

    Raises:
      ValueError: if the request id is already admitted or num_tokens < 0.
    """
    if request_id in self._requests:
      raise ValueError(f"admit: request {request_id!r} is already admitted")
    if num_tokens < 0:
      raise ValueError(f"admit: num_tokens must be >= 0, got {num_tokens}")
    n = self.pages_for(num_tokens)
    if n > self.num_free:
      return CannotAdmit(request_id, n, self.num_free)
    pages = self.allocate(n)
    self._requests[request_id] = _Request(pages, [int(self.tags[p]) for p in pages], int(num_tokens))
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
    extra = self.pages_for(num_tokens) - len(req.pages)
    if extra > self.num_free:
      return CannotAdmit(request_id, extra, self.num_free)
    pages = self.allocate(max(extra, 0))
    req.pages += pages
    req.tags += [int(self.tags[p]) for p in pages]
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
    if rem and self.num_free < 1:
      return CannotAdmit(child_id, 1, self.num_free)
    shared = parent.pages[:full]
    self.share(shared)
    pages, tags = list(shared), list(parent.tags[:full])
    copies = []
    if rem:
      (p,) = self.allocate(1)
      copies.append((parent.pages[full], p))
      pages.append(p)
      tags.append(int(self.tags[p]))
    self._requests[child_id] = _Request(pages, tags, n_tok)
    return copies

  def release(self, request_id) -> None:
    """Drops a request and one reference on each of its pages.

    Raises:
      ValueError: unknown request.
    """
    req = self._requests.pop(self._key(request_id))
    self.free(req.pages)

  def block_table(self, request_id) -> list[tuple[int, int]]:
    """The request's (page, expected uint32 tag) pairs, in position order."""
    req = self._get(request_id)
    return list(zip(req.pages, req.tags))

  def length(self, request_id) -> int:
    return self._get(request_id).length

  def _key(self, request_id):
    if request_id not in self._requests:
      raise ValueError(f"unknown request {request_id!r}")
    return request_id

  def _get(self, request_id) -> _Request:
    return self._requests[self._key(request_id)]

  # --------------------------------------------------------------- device side
  def device_tags(self) -> np.ndarray:
    """[num_pages] int32: the uint32 tags bit-cast for the device ``page_tags`` mirror."""
    return self.tags.view(np.int32).copy()

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
