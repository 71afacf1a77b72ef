"""A radix prefix cache over page-aligned token blocks, under the page-integrity tags.

Requests that share a prompt prefix (a system prompt, a few-shot preamble, a
conversation's history) need not prefill it again: its KV already sits in
pages another request wrote. The cache keeps those pages alive after their
writer finishes and hands them to later requests (SGLang's RadixAttention,
vLLM's automatic prefix caching; docs/prefix_cache.md).

Structure: a tree whose edges are whole pages of tokens. A node holds one
physical page whose KV is exactly its block of ``page_size`` tokens, at the
positions its depth implies, given every block on the path from the root. A
full page is never written again (a request writes only from its first
uncomputed token), so any number of requests may share it.

Holding pages: the cache holds each node's page as a pseudo-request
``("prefix", page)`` in the page allocator, one reference, so the allocator's
refcounts and its audit cover cached pages exactly like requests' pages:

* a shared page keeps one tag for as long as anyone holds it (sharing never
  reallocates);
* eviction frees the cache's reference; a page whose last reference goes
  returns to the free list and gets a new tag when it is allocated again;
* a request's expected (page, tag) pairs include its shared pages, so the
  device tag check covers them in every step;
* a fault on a shared page (the audit quarantines it, or a holder's tag check
  fails) drops the node and its subtree from the cache, so no later request
  can match it; the current holders are aborted by the engine's defences, and
  nobody else is touched.

Matching stops one token short of the sequence, so the request always computes
at least its last token (whose logits are sampled). Past the last whole page
that matches, a cached page that shares the next ``k`` tokens (at least
``min_copy_tokens``) can be reused by copy-on-write: the request gets a fresh page, the engine copies the cached one
into it, and prefill continues at token ``k`` of that page, overwriting the
rest. Eviction is LRU over leaves that only the cache holds.

Costs follow the work, not the cache's size (docs/prefix_cache.md): matching
walks the prompt's pages, and the copy-on-write candidates are found through an
index of each node's children by their first ``min_copy_tokens`` tokens (at most
``COPY_CANDIDATES`` of them compared); eviction keeps its LRU order in a heap of
leaves updated as nodes are touched, so evicting a page costs O(log n), plus
the leaves it passes over because a running request still shares them.
``work`` counts the heap pops and the nodes matching visited.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools

from mlkit.kvcache import PageAllocator


def holder_id(page: int) -> tuple:
  """The allocator id under which the cache holds ``page``."""
  return ("prefix", int(page))


def is_holder_id(request_id) -> bool:
  """Whether an allocator request id is one of the cache's pseudo-requests."""
  return isinstance(request_id, tuple) and len(request_id) == 2 and request_id[0] == "prefix"


# Children of one node compared for a copy-on-write match, at most (those sharing the first
# min_copy_tokens tokens with the request's next block, most recently added first).
COPY_CANDIDATES = 8


@dataclasses.dataclass(eq=False)
class _Node:
  block: tuple[int, ...]  # the page's tokens (page_size of them; empty for the root)
  page: int | None
  tag: int  # the page's tag when its KV was written and checked (uint32)
  parent: "_Node | None"
  children: dict = dataclasses.field(default_factory=dict)  # block -> _Node
  # Children by their block's first min_copy_tokens tokens (copy-on-write candidates), each
  # group in insertion order.
  heads: dict = dataclasses.field(default_factory=dict)  # head -> {block: _Node}
  last_used: int = 0
  removed: bool = False


@dataclasses.dataclass(frozen=True)
class Match:
  """What the cache holds of a token sequence.

  Attributes:
    pages: cached pages of the matched whole blocks, in position order.
    tags: the tag each of ``pages`` had when its KV was cached: what a sharer expects.
    copy_from: a cached page sharing the next ``copy_tokens`` tokens (copy-on-write), or None.
    copy_tokens: tokens reused from ``copy_from`` (0 without one).
  """

  pages: tuple[int, ...] = ()
  tags: tuple[int, ...] = ()
  copy_from: int | None = None
  copy_tokens: int = 0

  def tokens(self, page_size: int) -> int:
    """Tokens whose KV the match provides."""
    return len(self.pages) * page_size + self.copy_tokens


@dataclasses.dataclass
class PrefixCacheStats:
  """Counters of the cache (host-side)."""

  lookups: int = 0  # admissions that consulted the cache
  hits: int = 0  # of those, admissions that reused at least one token
  tokens_looked_up: int = 0  # prefill tokens of those admissions
  tokens_saved: int = 0  # prefill tokens not computed thanks to the cache
  copied_pages: int = 0  # copy-on-write copies of a partly matching page
  inserted_pages: int = 0
  evicted_pages: int = 0
  invalidated_pages: int = 0  # dropped after an integrity fault

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["hit_rate"] = self.hits / self.lookups if self.lookups else 0.0
    d["token_hit_rate"] = self.tokens_saved / self.tokens_looked_up if self.tokens_looked_up else 0.0
    return d


class PrefixCache:
  """The radix tree of cached pages of one pool.

  Args:
    allocator: the pool's page allocator (the cache holds its pages there).
    min_copy_tokens: the fewest tokens a partly matching page must share to be
      reused by copy-on-write (default a quarter page, at least 1): a copy moves
      a whole page in every layer, more than recomputing a token or two costs.
  """

  def __init__(self, allocator: PageAllocator, min_copy_tokens: int | None = None):
    self.allocator = allocator
    self.page_size = allocator.page_size
    self.min_copy_tokens = (max(1, self.page_size // 4) if min_copy_tokens is None
                            else int(min_copy_tokens))
    if self.min_copy_tokens < 1:
      raise ValueError(f"PrefixCache.min_copy_tokens must be >= 1, got {min_copy_tokens!r}")
    self.root = _Node((), None, 0, None)
    self._by_page: dict[int, _Node] = {}
    self._clock = itertools.count(1)
    self.stats = PrefixCacheStats()
    # Leaves in LRU order: (last_used, page, node), an entry per touch; entries whose node
    # was touched again, removed or given children since are skipped when popped.
    self._lru: list = []
    # Work counters: eviction heap pops, nodes visited by match.
    self.work: collections.Counter = collections.Counter()

  # --------------------------------------------------------------- queries
  @property
  def num_pages(self) -> int:
    """Pages the cache holds."""
    return len(self._by_page)

  def pages(self) -> list[int]:
    return list(self._by_page)

  def _trusted(self, node: _Node) -> bool:
    """Whether a node's page still holds what was cached: same tag, live, not quarantined.

    A page freed behind the cache's back (a bookkeeping bug) and reallocated has
    a new tag; such a node, and everything below it, is dropped, never matched.
    """
    p = node.page
    return (int(self.allocator.tags[p]) == node.tag and self.allocator.refcounts[p] > 0
            and p not in self.allocator.quarantined
            and self.allocator.has_request(holder_id(p)))

  def match(self, tokens) -> Match:
    """The longest cached prefix of ``tokens``, leaving at least the last token to compute.

    Marks the matched nodes as used (LRU) and drops any node on the way whose
    page is no longer what was cached (see ``_trusted``). Does not take
    references: the caller admits the request with ``prefix_pages=match.pages``
    and ``prefix_tags=match.tags`` before anything can evict them.
    """
    P = self.page_size
    limit = len(tokens) - 1  # the last token is always computed
    node, pages, tags, now = self.root, [], [], next(self._clock)
    while (len(pages) + 1) * P <= limit:
      i = len(pages) * P
      child = node.children.get(tuple(tokens[i:i + P]))
      self.work["match_nodes"] += 1
      if child is None:
        break
      if not self._trusted(child):
        self.stats.invalidated_pages += self._drop_subtree(child)
        break
      child.last_used = now
      pages.append(child.page)
      tags.append(child.tag)
      node = child
    self._mark_used(node)
    start = len(pages) * P
    rest = tuple(tokens[start:min(start + P, limit)])
    best, best_k = None, self.min_copy_tokens - 1
    q = self.min_copy_tokens
    if len(rest) >= q:  # a copy needs the first q tokens shared: only children with that head
      group = node.heads.get(rest[:q], {})
      for child in [group[b] for b in itertools.islice(reversed(group), COPY_CANDIDATES)]:
        self.work["match_nodes"] += 1
        k = next((j for j, (a, b) in enumerate(zip(child.block, rest)) if a != b), len(rest))
        if k > best_k:
          if not self._trusted(child):
            self.stats.invalidated_pages += self._drop_subtree(child)
            continue
          best, best_k = child, k
    if best is None:
      return Match(tuple(pages), tuple(tags))
    best.last_used = now
    self._mark_used(best)
    return Match(tuple(pages), tuple(tags), best.page, best_k)

  def _mark_used(self, node: _Node) -> None:
    """Enters a just-used leaf in the LRU heap (inner nodes enter when they become leaves)."""
    if node is not self.root and not node.children and not node.removed:
      heapq.heappush(self._lru, (node.last_used, node.page, node))
      if len(self._lru) > 2 * len(self._by_page) + 64:  # drop stale entries (amortised O(1))
        self._lru = [(nd.last_used, nd.page, nd) for nd in self._by_page.values()
                     if not nd.children]
        heapq.heapify(self._lru)

  # --------------------------------------------------------------- updates
  def record_lookup(self, num_tokens: int, match: Match) -> None:
    s = self.stats
    saved = match.tokens(self.page_size)
    s.lookups += 1
    s.hits += int(saved > 0)
    s.tokens_looked_up += num_tokens
    s.tokens_saved += saved
    s.copied_pages += int(match.copy_from is not None)

  def insert(self, tokens, pages, tags) -> int:
    """Caches the whole pages of a sequence whose KV is written: ``pages[i]`` holds block i.

    A block already cached (another request wrote the same prefix) keeps its
    cached page; the sequence's own page is then not cached (its holder frees
    it). Stops at the first block whose page is quarantined or not allocated.

    Args:
      tokens: the tokens whose KV the pages hold (only whole pages count).
      pages: the sequence's pages in position order.
      tags: the tags its writer expected on them (its block table's, which its
        step's tag check just confirmed).

    Returns:
      Pages newly cached.
    """
    P = self.page_size
    node, added, now = self.root, 0, next(self._clock)
    for i in range(min(len(tokens) // P, len(pages))):
      block = tuple(tokens[i * P:(i + 1) * P])
      child = node.children.get(block)
      if child is None:
        page, tag = int(pages[i]), int(tags[i]) & 0xFFFFFFFF
        if (page in self._by_page or page in self.allocator.quarantined
            or self.allocator.refcounts[page] <= 0 or int(self.allocator.tags[page]) != tag):
          break  # a page listed twice, not live or retagged: the table is not to be trusted
        if self.allocator.admit(holder_id(page), P, prefix_pages=[page]) is not None:
          break
        child = _Node(block, page, tag, node)
        node.children[block] = child
        node.heads.setdefault(block[:self.min_copy_tokens], {})[block] = child
        self._by_page[page] = child
        added += 1
      child.last_used = now
      node = child
    self._mark_used(node)
    self.stats.inserted_pages += added
    return added

  def evict(self, n: int, keep=()) -> int:
    """Frees up to ``n`` pages: least recently used leaves that only the cache holds.

    Args:
      n: pages wanted back on the free list.
      keep: pages not to evict (a match about to be admitted).

    Returns:
      Pages freed.
    """
    keep = set(keep)
    freed, passed = 0, []
    while freed < n and self._lru:
      entry = heapq.heappop(self._lru)
      self.work["evict_pops"] += 1
      last_used, _, nd = entry
      if nd.removed or nd.children or nd.last_used != last_used:
        continue  # stale: touched again (a newer entry exists), removed, or no leaf any more
      if nd.page in keep or self.allocator.refcounts[nd.page] != 1:
        passed.append(entry)  # a running request shares it (or it is about to): not now
        continue
      self._remove(nd)  # its parent enters the heap if it becomes a leaf
      freed += 1
    for entry in passed:
      heapq.heappush(self._lru, entry)
    self.stats.evicted_pages += freed
    return freed

  def invalidate(self, pages) -> int:
    """Drops the nodes of ``pages`` and their subtrees (their KV is not trusted any more).

    Returns:
      Nodes dropped.
    """
    dropped = 0
    for p in pages:
      nd = self._by_page.get(int(p))
      if nd is not None:
        dropped += self._drop_subtree(nd)
    self.stats.invalidated_pages += dropped
    return dropped

  def reconcile(self) -> int:
    """Drops every node the allocator no longer lets the cache hold (after a recovery).

    ``PageAllocator.recover`` forgets the holders of quarantined pages,
    the cache's pseudo-requests included; their nodes and subtrees go here.

    Returns:
      Nodes dropped.
    """
    gone = [nd for p, nd in self._by_page.items() if not self.allocator.has_request(holder_id(p))]
    return self.invalidate([nd.page for nd in gone])

  def clear(self) -> None:
    """Releases every cached page."""
    for nd in list(self.root.children.values()):
      self._drop_subtree(nd)

  def _drop_subtree(self, node: _Node) -> int:
    n = 0
    for child in list(node.children.values()):
      n += self._drop_subtree(child)
    self._remove(node)
    return n + 1

  def _remove(self, node: _Node) -> None:
    parent = node.parent
    del parent.children[node.block]
    siblings = parent.heads[node.block[:self.min_copy_tokens]]
    del siblings[node.block]
    if not siblings:
      del parent.heads[node.block[:self.min_copy_tokens]]
    del self._by_page[node.page]
    node.removed = True
    self._mark_used(parent)
    hid = holder_id(node.page)
    if not self.allocator.has_request(hid):
      return
    if int(self.allocator.tags[node.page]) == node.tag:
      self.allocator.release_checked(hid)
    else:
      # Retagged behind the cache's back: the page is someone else's now. Dropping the
      # reference by the table would free their page; rebuild the counts instead.
      self.allocator.drop_and_reconcile(hid)
