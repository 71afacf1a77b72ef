"""Fault injection: simulated allocator bookkeeping bugs that the integrity check must catch.

A test facility, off by default (``EngineConfig.enable_fault_injection``). Each
fault edits the allocator's host bookkeeping between steps, for one victim
request, the way a real bug would; nothing on the device is touched:

* ``USE_AFTER_FREE``: one of the victim's pages is freed while its block table
  still lists it, and moved to the head of the free list, so the very next
  allocation reuses it (new tag) for another request.
* ``DOUBLE_ALLOCATION``: one of the victim's pages is put on the free list while
  still owned, so that a careless allocator would hand the same page to a second
  request (this one quarantines it instead, and the engine aborts its holders).
* ``WRONG_PAGE``: one of the victim's block-table entries is changed to point at
  another page (another live request's, when there is one), tags unchanged.
* ``STALE_TAG``: the victim's expected tag for one page is changed to an older
  generation, as if its table were never updated after a reallocation.

Faults edit the allocator's bookkeeping behind its API on purpose (they are the
bugs), inside ``PageAllocator.tampering``: the test hook that keeps such edits
visible to the engine's incremental page audit.
"""

from __future__ import annotations

import dataclasses
import enum

from mlkit.kvcache import PageAllocator


class FaultKind(enum.Enum):
  """The bookkeeping bugs the page-tag check exists for."""

  USE_AFTER_FREE = "use_after_free"
  DOUBLE_ALLOCATION = "double_allocation"
  WRONG_PAGE = "wrong_page"
  STALE_TAG = "stale_tag"


@dataclasses.dataclass(frozen=True)
class Fault:
  """One fault to inject.

  Attributes:
    kind: a FaultKind.
    victim: the request id whose pages / table are corrupted (must hold pages).
    page_index: which of the victim's pages (Python index; -1 = its last page).
  """

  kind: FaultKind
  victim: int
  page_index: int = -1

  def __post_init__(self):
    if not isinstance(self.kind, FaultKind):
      raise ValueError(f"Fault.kind must be a FaultKind, got {self.kind!r}")


@dataclasses.dataclass(frozen=True)
class FaultRecord:
  """What an injected fault changed.

  Attributes:
    fault: the fault.
    page: the victim's page that was corrupted.
    other_page: for WRONG_PAGE, the page the entry now points at (else None).
    other_owner: for WRONG_PAGE, the live request owning other_page (or None).
  """

  fault: Fault
  page: int
  other_page: int | None = None
  other_owner: object = None


def inject(allocator: PageAllocator, fault: Fault) -> FaultRecord:
  """Applies ``fault`` to the allocator's bookkeeping.

  Args:
    allocator: the engine's allocator.
    fault: what to corrupt.

  Returns:
    A FaultRecord.

  Raises:
    ValueError: the victim is not admitted, holds no pages, or page_index is out of range;
      WRONG_PAGE in a pool of one page.
  """
  if not allocator.has_request(fault.victim):
    raise ValueError(f"fault victim {fault.victim!r} holds no pages (not admitted)")
  table = allocator.block_table(fault.victim)
  if not table:
    raise ValueError(f"fault victim {fault.victim!r} holds no pages")
  if not -len(table) <= fault.page_index < len(table):
    raise ValueError(f"fault page_index {fault.page_index} out of range for "
                     f"{len(table)} pages")
  i = fault.page_index % len(table)
  page = table[i][0]
  kind = fault.kind
  if kind is FaultKind.USE_AFTER_FREE:
    if int(allocator.refcounts[page]) != 1:
      raise ValueError(f"USE_AFTER_FREE needs an unshared page; page {page} has "
                       f"{int(allocator.refcounts[page])} references")
    allocator.free([page])  # refcount 0, back on the free list, still in the victim's table
    with allocator.tampering() as t:
      t.list_first(page)  # the next allocation reuses it
    return FaultRecord(fault, page)
  if kind is FaultKind.DOUBLE_ALLOCATION:
    with allocator.tampering() as t:
      t.list_first(page)  # listed free while owned: would be handed out a second time
    return FaultRecord(fault, page)
  if kind is FaultKind.WRONG_PAGE:
    if allocator.num_pages < 2:
      raise ValueError("WRONG_PAGE needs a pool of at least two pages")
    other, owner = None, None
    for rid in allocator.request_ids:
      if rid != fault.victim and allocator.block_table(rid):
        other, owner = allocator.block_table(rid)[0][0], rid
        break
    if other is None:
      mine = {p for p, _ in table}
      other = next(p for p in range(allocator.num_pages) if p not in mine)
    with allocator.tampering(fault.victim) as t:
      t.pages[i] = other
    return FaultRecord(fault, page, other_page=other, other_owner=owner)
  if kind is FaultKind.STALE_TAG:
    with allocator.tampering(fault.victim) as t:
      tag = int(t.tags[i])
      t.tags[i] = tag - 1 if tag > 1 else 0xFFFFFFFF  # the previous generation
    return FaultRecord(fault, page)
  raise ValueError(f"unknown fault kind {kind!r}")  # pragma: no cover - enum is closed

