"""Eviction policy: which object of a node goes first, and the watermarks that decide when to evict.

A policy keeps, per node, the set of *evictable* entries current (READY and unpinned), in victim order, so
eviction only ever looks at candidates (as SGLang's radix cache keeps its evictable leaves): the directory calls
``add`` when an entry becomes evictable (commit, last unpin), ``discard`` when it stops being so (first pin, removal,
eviction) and ``touch`` on a read. PENDING and pinned entries are never in the set, so they can never be chosen.

Policies:

- ``lru``: one insertion-ordered dict per node; touch moves to the end. The victim is the least recently used.
- ``prefix-lru``: a prefix match stops at the first missing page, so a page whose children are cached is worth more
  than a leaf. Two ordered dicts per node, leaves and inner pages (``entry.children > 0``); victims are leaves in
  LRU order, then inner pages. Evicting a leaf may turn its parent into a leaf (``children_changed``).

What it approximates: recency is metaserver memory only; after a restart it restarts from commit order (etcd
mod revision). Costs: add/discard/touch O(1); ``victims`` yields in O(1) per step.

Watermarks: ``over_high(used, cap)`` starts a background pass, ``bytes_to_low(used, cap)`` is how much it frees.
"""

from __future__ import annotations

from typing import Iterator, Protocol


class Policy(Protocol):
    name: str

    def add(self, entry) -> None: ...
    def discard(self, entry) -> None: ...
    def touch(self, entry) -> None: ...
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

    def touch(self, entry) -> None:
        d = self._order.get(entry.node_id)
        if d is not None and d.pop(entry, 0) is None:
            d[entry] = None

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


class PrefixLruPolicy:
    """Leaves (no cached children) in LRU order first, then inner pages in LRU order."""

    name = "prefix-lru"

    def __init__(self) -> None:
        self._leaves: dict[str, dict] = {}
        self._inner: dict[str, dict] = {}

    def _home(self, entry) -> dict:
        tier = self._inner if entry.children > 0 else self._leaves
        d = tier.get(entry.node_id)
        if d is None:
            d = tier[entry.node_id] = {}
        return d

    def add(self, entry) -> None:
        self._home(entry)[entry] = None

    def discard(self, entry) -> None:
        for tier in (self._leaves, self._inner):
            d = tier.get(entry.node_id)
            if d is not None and d.pop(entry, 0) is None:
                return

    def touch(self, entry) -> None:
        d = self._home(entry)
        if d.pop(entry, 0) is None:
            d[entry] = None

    def children_changed(self, entry) -> None:
        """Called when ``entry.children`` crosses zero; moves it between tiers if it is evictable."""
        for tier in (self._leaves, self._inner):
            d = tier.get(entry.node_id)
            if d is not None and d.pop(entry, 0) is None:
                self.add(entry)
                return

    def victims(self, node_id: str) -> Iterator:
        while True:
            d = self._leaves.get(node_id)
            if not d:
                d = self._inner.get(node_id)
            if not d:
                return
            yield next(iter(d))

    def drop_node(self, node_id: str) -> None:
        self._leaves.pop(node_id, None)
        self._inner.pop(node_id, None)

    def count(self, node_id: str) -> int:
        return len(self._leaves.get(node_id, ())) + len(self._inner.get(node_id, ()))


POLICIES = {"lru": LruPolicy, "prefix-lru": PrefixLruPolicy}


def make_policy(name: str) -> Policy:
    return POLICIES[name]()


def over_high(used: int, capacity: int, high: float) -> bool:
    return capacity > 0 and used > high * capacity


def bytes_to_low(used: int, capacity: int, low: float) -> int:
    """Bytes to free to get from ``used`` down to the low watermark (0 when already below)."""
    return max(0, used - int(low * capacity))
