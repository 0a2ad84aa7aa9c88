"""Placement: where an ALLOC request's new objects go, evicting when no node has room. No I/O.

One ``Placer`` serves one request. It caches the placeable spaces, their free units, the least free units an
allocation failed to find on each (fragmentation) and, once eviction is needed, the recency of each node's next
victim, and keeps them current as the request allocates and evicts: a key costs a C-level max/min over the nodes
instead of a sort, and a full pool evicts exactly what the object needs.

What it approximates: one LRU across nodes (evict where the least recently used victim is). Evictions that re-tier
pages on other nodes (prefix-lru) are seen from the next request on.

Costs: per key O(nodes) at C speed, plus O(victims) evictions, at most PLACE_EVICT_BUDGET of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from metaserver.allocator import UNIT
from metaserver.entry import Effects, NodeSpace

if TYPE_CHECKING:  # the directory passes itself in; only its type is named here
    from metaserver.directory import Directory

PLACE_EVICT_BUDGET = 1024  # victims one placement may evict before it answers NO_SPACE for that key
_INF = float("inf")


class Placer:
    """Placement state for one ALLOC request: the placeable spaces, their free units and (once eviction is needed)
    the recency of each one's next victim, kept current as the request allocates and evicts, so a key costs a
    C-level max/min over nodes instead of a sort. Evictions that re-tier pages on other nodes (prefix-lru) are seen
    from the next request on: an approximation of the one LRU across nodes that placement aims for."""

    __slots__ = ("d", "fx", "spaces", "free", "failed", "index", "va", "min_cap")

    def __init__(self, d: Directory, fx: Effects):
        self.d = d
        self.fx = fx
        self.spaces = [s for s in d.spaces.values() if s.placeable]
        self.free = [s.alloc.units - s.alloc.used_units for s in self.spaces]
        self.failed = [_INF] * len(self.spaces)  # least units an alloc failed to find there (fragmented)
        self.index = {id(s): i for i, s in enumerate(self.spaces)}
        self.va: list[float] | None = None
        self.min_cap = min((s.alloc.capacity for s in self.spaces), default=0)

    def place(self, size: int, near: NodeSpace | None) -> tuple[NodeSpace, int] | None:
        """Find ``size`` bytes. A free hole first: on ``near`` (the parent's node, so a chain stays together) unless
        it has less than half the free space of the emptiest node (chains that all descend from one shared prefix
        would otherwise pile onto one node), then on the node with most free space, then any. Only when no node has
        a hole, evict: on the node whose next victim was used least recently first (an approximation of one LRU
        across nodes, so a busy node does not evict its fresh pages while another keeps stale ones), at most
        PLACE_EVICT_BUDGET victims for this placement (bounded work per request; the background pass does the
        rest)."""
        spaces, free = self.spaces, self.free
        if not spaces:
            return None
        need = -(-size // UNIT)
        if size > self.min_cap:  # some nodes cannot hold it at all: leave them out (rare: huge objects)
            ok = [i for i, s in enumerate(spaces) if s.alloc.capacity >= size]
        else:
            ok = None
        if ok is not None and not ok:
            return None
        top = max(free) if ok is None else max(free[i] for i in ok)
        if near is not None:
            i = self.index.get(id(near))
            if (i is not None and free[i] >= need and need < self.failed[i] and 2 * free[i] >= top
                    and (ok is None or i in ok)):
                off = spaces[i].alloc.alloc(size)
                if off is not None:
                    free[i] -= need
                    return spaces[i], off
                self.failed[i] = need
        if top >= need:
            failed = self.failed
            best = free.index(top) if ok is None else max(ok, key=free.__getitem__)
            if need < failed[best]:
                off = spaces[best].alloc.alloc(size)
                if off is not None:
                    free[best] -= need
                    return spaces[best], off
                failed[best] = need
            # fragmented: any other node with enough free units that may hold them in one extent, most free first
            cands = [i for i in (ok if ok is not None else range(len(spaces))) if free[i] >= need and need < failed[i]]
            for i in sorted(cands, key=free.__getitem__, reverse=True) if len(cands) > 1 else cands:
                off = spaces[i].alloc.alloc(size)
                if off is not None:
                    free[i] -= need
                    return spaces[i], off
                failed[i] = need
        return self._evict_for(size, need, ok)

    def _evict_for(self, size: int, need: int, ok: list[int] | None) -> tuple[NodeSpace, int] | None:
        d, spaces, free = self.d, self.spaces, self.free
        first = d.policy.first
        va = self.va
        if va is None:
            va = self.va = [next_victim_access(d, s) for s in spaces]
        cand = va if ok is None else [va[i] if i in ok else _INF for i in range(len(spaces))]
        budget = PLACE_EVICT_BUDGET
        while True:
            m = min(cand)
            if m == _INF:
                return None
            i = cand.index(m)
            sp = spaces[i]
            nid = sp.node_id
            victim = first(nid)
            while victim is not None:
                if budget <= 0:
                    va[i] = victim.last_access
                    return None
                budget -= 1
                d._drop(victim, self.fx)
                d.evictions += 1
                free[i] = sp.alloc.units - sp.alloc.used_units
                self.failed[i] = _INF
                victim = first(nid)
                if free[i] >= need:
                    off = sp.alloc.alloc(size)
                    if off is not None:
                        free[i] -= need
                        va[i] = victim.last_access if victim is not None else _INF
                        return sp, off
            va[i] = _INF  # nothing left to evict there
            if cand is not va:
                cand[i] = _INF


def next_victim_access(d: "Directory", sp: NodeSpace) -> float:
    victim = d.policy.first(sp.node_id)
    return victim.last_access if victim is not None else _INF
