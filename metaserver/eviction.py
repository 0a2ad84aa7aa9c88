"""Eviction policy: which object of a node goes first, and the watermarks that decide when to evict.

A policy keeps, per node, the set of *evictable* entries current (READY and unpinned), in victim order, so
eviction only ever looks at candidates (as SGLang's radix cache keeps its evictable leaves): the directory calls
``add`` when an entry becomes evictable (commit, last unpin), ``discard`` when it stops being so (first pin, removal,
eviction). A read is a pin then an unpin, so the lease release re-adds the entry at the recent end: that is what
makes a read count as a use. PENDING and pinned entries are never in the set, so they can never be chosen.

Policies:

- ``lru``: one insertion-ordered dict per node; an entry re-added goes to the end. The victim is the least recently used.
- ``prefix-lru``: a prefix match stops at the first missing page, so a page whose children are cached is worth more
  than a leaf, and a page whose parent is gone is worth nothing. Three tiers per node (orphans, leaves, inner
  pages), each ordered by last access; see ``PrefixLruPolicy``.

What it approximates: recency is metaserver memory only; after a restart it restarts from commit order (etcd
mod revision). Costs: lru add/discard O(1); prefix-lru O(log n) (heaps keyed on last access).

Watermarks: ``over_high(used, cap)`` starts a background pass, ``bytes_to_low(used, cap)`` is how much it frees.
"""

from __future__ import annotations

import heapq
from typing import Iterator, Protocol


class Policy(Protocol):
    name: str

    def add(self, entry) -> None: ...
    def discard(self, entry) -> None: ...
    def children_changed(self, entry) -> None: ...
    def victims(self, node_id: str) -> Iterator: ...
    def drop_node(self, node_id: str) -> None: ...
    def count(self, node_id: str) -> int: ...


class LruPolicy:
    """Least recently used first. ``entry.node_id`` selects the per-node order."""

    name = "lru"

    def __init__(self) -> None:
        self._order: dict[str, dict] = {}

    def add(self, entry) -> None:
        d = self._order.get(entry.node_id)
        if d is None:
            d = self._order[entry.node_id] = {}
        d[entry] = None

    def discard(self, entry) -> None:
        d = self._order.get(entry.node_id)
        if d is not None:
            d.pop(entry, None)

    def children_changed(self, entry) -> None:
        pass

    def victims(self, node_id: str) -> Iterator:
        """Evictable entries of ``node_id`` in victim order. The caller discards each one it takes before the next
        step (so the iteration never sees a dict mutated under it)."""
        d = self._order.get(node_id)
        while d:
            yield next(iter(d))

    def drop_node(self, node_id: str) -> None:
        self._order.pop(node_id, None)

    def count(self, node_id: str) -> int:
        return len(self._order.get(node_id, ()))


class _Tier:
    """Entries of one tier of one node, ordered by (last_access, seq): a heap with lazy deletion. ``live`` maps each
    member to the seq of its valid heap record; records of removed or re-pushed entries are skipped when they reach
    the top, and the heap is rebuilt when stale records outnumber live ones (bounded memory)."""

    __slots__ = ("heap", "live")

    def __init__(self) -> None:
        self.heap: list = []
        self.live: dict = {}

    def push(self, entry, seq: int) -> None:
        self.live[entry] = seq
        heapq.heappush(self.heap, (entry.last_access, seq, entry))
        if len(self.heap) > 2 * len(self.live) + 64:
            self.heap = [(e.last_access, q, e) for e, q in self.live.items()]
            heapq.heapify(self.heap)

    def remove(self, entry) -> bool:
        return self.live.pop(entry, None) is not None

    def first(self):
        heap, live = self.heap, self.live
        while heap:
            _, seq, e = heap[0]
            if live.get(e) == seq:
                return e
            heapq.heappop(heap)
        return None


class PrefixLruPolicy:
    """Prefix-aware LRU. A prefix match stops at the first missing page, so per node, victims come from three
    tiers, least recently used first within each:

    0. orphans: the page names a parent that is not cached (evicted, removed), so no prefix match reaches it;
    1. leaves: no cached page names this one as parent;
    2. inner pages: other cached pages depend on this one.

    The directory tells the policy when a page's tier may have changed (``children_changed``: its cached children
    went to or from zero, or its parent came or went); the page keeps its own recency when it moves, so a cold
    chain loses its tail before a hot chain does. Costs: O(log n) per add/discard/move, amortised O(log n) per victim.
    """

    name = "prefix-lru"

    def __init__(self) -> None:
        self._tiers: dict[str, tuple[_Tier, _Tier, _Tier]] = {}
        self._where: dict = {}  # entry -> tier index while evictable
        self._seq = 0

    @staticmethod
    def tier_of(entry) -> int:
        if entry.children > 0:
            return 2
        if entry.parent is not None and entry.parent_ref is None:
            return 0
        return 1

    def _node(self, node_id: str) -> tuple[_Tier, _Tier, _Tier]:
        t = self._tiers.get(node_id)
        if t is None:
            t = self._tiers[node_id] = (_Tier(), _Tier(), _Tier())
        return t

    def add(self, entry) -> None:
        self._seq += 1
        t = self.tier_of(entry)
        self._node(entry.node_id)[t].push(entry, self._seq)
        self._where[entry] = t

    def discard(self, entry) -> None:
        t = self._where.pop(entry, None)
        if t is not None:
            self._node(entry.node_id)[t].remove(entry)


    def children_changed(self, entry) -> None:
        """Re-file ``entry`` if it is evictable and its tier changed (keeping its own recency)."""
        t = self._where.get(entry)
        if t is not None and t != self.tier_of(entry):
            self.discard(entry)
            self.add(entry)

    def victims(self, node_id: str) -> Iterator:
        tiers = self._tiers.get(node_id)
        while tiers:
            for tier in tiers:
                e = tier.first()
                if e is not None:
                    break
            else:
                return
            yield e

    def drop_node(self, node_id: str) -> None:
        tiers = self._tiers.pop(node_id, None)
        for tier in tiers or ():
            for e in tier.live:
                self._where.pop(e, None)

    def count(self, node_id: str) -> int:
        return sum(len(t.live) for t in self._tiers.get(node_id, ()))


POLICIES = {"lru": LruPolicy, "prefix-lru": PrefixLruPolicy}


def make_policy(name: str) -> Policy:
    return POLICIES[name]()


def over_high(used: int, capacity: int, high: float) -> bool:
    return capacity > 0 and used > high * capacity


def bytes_to_low(used: int, capacity: int, low: float) -> int:
    """Bytes to free to get from ``used`` down to the low watermark (0 when already below)."""
    return max(0, used - int(low * capacity))
