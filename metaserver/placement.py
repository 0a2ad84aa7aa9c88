"""Placement: where an ALLOC request's new objects go, evicting when no node has room. No I/O.

One ``Placer`` serves one request. It caches the placeable spaces, their free units, the least free units an
allocation failed to find on each (fragmentation) and, once eviction is needed, the recency of each node's next
victim, and keeps them current as the request allocates and evicts: a key costs a C-level max/min over the nodes
instead of a sort, and a full pool evicts exactly what the object needs.

What it approximates: one LRU across nodes (evict where the least recently used victim is). Evictions that re-tier
pages on other nodes (prefix-lru) are seen from the next request on.

Costs: per key O(nodes) at C speed, plus O(victims) evictions, at most PLACE_EVICT_BUDGET of them. A request's
objects of one size are placed in runs (``Placer.want``): one placement and one allocator step for up to PLACE_RUN
adjacent objects on a node (the batch's share of each node, as one object at a time would spread it, or up to
PLACE_RUN of a chain); into a full pool a run first evicts exactly the pages one object at a time would
(``_evict_for``). ``python bench/servicepath.py`` on the 2-core VM, 128-page ALLOC+COMMIT requests: 8.9 -> 6.8 us
of the metaserver's CPU a page into a pool with room, 11.8 -> 8.9 us into a full one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from metaserver.allocator import UNIT
from metaserver.entry import Effects, NodeSpace

if TYPE_CHECKING:  # the directory passes itself in; only its type is named here
    from metaserver.directory import Directory

PLACE_EVICT_BUDGET = 1024  # victims one placement may evict before it answers NO_SPACE for that key
PLACE_RUN = 32  # objects of one size a request's placement takes at once where a hole holds them (Placer.want)
_INF = float("inf")


class Placer:
    """Placement state for one ALLOC request: the placeable spaces, their free units and (once eviction is needed)
    the recency of each one's next victim, kept current as the request allocates and evicts, so a key costs a
    C-level max/min over nodes instead of a sort. Evictions that re-tier pages on other nodes (prefix-lru) are seen
    from the next request on: an approximation of the one LRU across nodes that placement aims for.

    ``usable`` is ``free`` with the nodes where an allocation of the current size (``need`` units) failed marked
    -1: the nodes worth trying for it, most free first, found with ``max`` and ``index`` (C-level) instead of a
    comprehension and a sort per key (a full pool with mixed page sizes has holes too small or too scattered for
    some size on most nodes, and tried them all for every key). It is rebuilt when the size changes (a request's
    keys are nearly always one size)."""

    __slots__ = ("d", "fx", "spaces", "free", "failed", "usable", "need", "top", "index", "va", "min_cap", "want",
                 "got", "evict_runs")

    def __init__(self, d: Directory, fx: Effects):
        self.d = d
        self.fx = fx
        self.spaces = [s for s in d.spaces.values() if s.placeable]
        self.free = [s.alloc.units - s.alloc.used_units for s in self.spaces]
        self.failed = [_INF] * len(self.spaces)  # least units an alloc failed to find there (fragmented)
        self.usable = self.free[:]
        self.need = -1  # the size ``usable`` holds for (-1: none yet, or stale after ``_place_some``)
        # At least max(free): the near rule compares with max(free), scanned only when this bound does not decide
        # (allocations only lower free; an eviction raises this with it)
        self.top = max(self.free, default=0)
        self.index = {id(s): i for i, s in enumerate(self.spaces)}
        self.va: list[float] | None = None
        self.min_cap = min((s.alloc.capacity for s in self.spaces), default=0)
        # A run: ``place`` for ``left`` more objects of one size takes ``want`` of them at once, adjacent on one
        # node, where a free hole holds them (one allocator step for all: ``Allocator.alloc_run``): an equal share
        # of the nodes (left / nodes, at most PLACE_RUN), so a batch still spreads over the nodes as one object at
        # a time would, in runs; up to PLACE_RUN of a chain (``near``: the parent's node), which one object at a
        # time keeps on one node anyway. ``got`` says how many the last ``place`` found (1 after an eviction or on
        # a node some sizes do not fit); the caller hands the rest out itself.
        self.want = 1
        self.got = 1
        self.evict_runs = True  # False: evict for one object at a time (the caller's request uses stored keys)

    def place(self, size: int, near: NodeSpace | None, left: int = 1) -> tuple[NodeSpace, int] | None:
        """Find ``size`` bytes. A free hole first: on ``near`` (the parent's node, so a chain stays together) unless
        it has less than half the free space of the emptiest node (chains that all descend from one shared prefix
        would otherwise pile onto one node), then on the node with most free space, then any. Only when no node has
        a hole, evict: on the node whose next victim was used least recently first (an approximation of one LRU
        across nodes, so a busy node does not evict its fresh pages while another keeps stale ones), at most
        PLACE_EVICT_BUDGET victims for this placement (bounded work per request; the background pass does the
        rest). ``left``: the objects of this size the request still places, this one included (a run: ``want``)."""
        spaces = self.spaces
        if not spaces:
            return None
        self.got = 1
        self.want = min(PLACE_RUN, left if near is not None else -(-left // len(spaces)))
        need = -(-size // UNIT)
        if size > self.min_cap:  # some nodes cannot hold it at all: leave them out (rare: huge objects)
            return self._place_some(size, need, near)
        if need != self.need:
            self.usable = [f if fl > need else -1 for f, fl in zip(self.free, self.failed)]
            self.need = need
        usable = self.usable
        if near is not None:
            i = self.index.get(id(near))
            if i is not None and usable[i] >= need and (2 * usable[i] >= self.top or
                                                        2 * usable[i] >= self._rescan_top()):
                off = self._try(i, size, need)
                if off is not None:
                    return spaces[i], off
        top = max(usable)
        while top >= need:  # most free first (ties: the first in ``spaces`` order), then the next
            i = usable.index(top)
            off = self._try(i, size, need)
            if off is not None:
                return spaces[i], off
            top = max(usable)
        return self._evict_for(size, need, None)

    def _try(self, i: int, size: int, need: int) -> int | None:
        """Allocate ``size`` on node ``i`` (a run of up to ``want`` of them: ``got``): its offset with ``free`` and
        ``usable`` lowered, or None with the node marked as failing ``need`` units (fragmented)."""
        if self.want > 1:
            run = self.spaces[i].alloc.alloc_run(size, self.want)
            off, n = run if run is not None else (None, 0)
        else:
            off, n = self.spaces[i].alloc.alloc(size), 1
        if off is not None:
            self.got = n
            self.free[i] -= need * n
            self.usable[i] -= need * n
            return off
        self.failed[i] = need
        self.usable[i] = -1
        return None

    def give_back(self, sp: NodeSpace, off: int, n: int, size: int) -> None:
        """Free the ``n`` objects of ``size`` bytes at ``off``, ``off + size``, ... on ``sp``: the end of a run its
        request did not use (its later keys existed, were in flight, or had a parent elsewhere). ``free`` rises
        with them; ``usable`` too unless the node failed this size (it may fit now, it is simply not tried)."""
        al = sp.alloc
        for j in range(n):
            al.free(off + j * size, size)
        i = self.index[id(sp)]
        units = n * -(-size // UNIT)
        f = self.free[i] = self.free[i] + units
        if self.usable[i] >= 0:
            self.usable[i] += units
        if f > self.top:
            self.top = f

    def _rescan_top(self) -> int:
        top = self.top = max(self.free)
        return top

    def _place_some(self, size: int, need: int, near: NodeSpace | None) -> tuple[NodeSpace, int] | None:
        """``place`` of an object some nodes cannot hold at all, among the nodes that can; ``usable`` is rebuilt
        at the next ``place``."""
        spaces, free = self.spaces, self.free
        self.need = -1
        ok = [i for i, s in enumerate(spaces) if s.alloc.capacity >= size]
        if not ok:
            return None
        top = max(free[i] for i in ok)
        if near is not None:
            i = self.index.get(id(near))
            if i is not None and free[i] >= need and need < self.failed[i] and 2 * free[i] >= top and i in ok:
                off = spaces[i].alloc.alloc(size)
                if off is not None:
                    free[i] -= need
                    return spaces[i], off
                self.failed[i] = need
        if top >= need:
            failed = self.failed
            best = max(ok, key=free.__getitem__)
            if need < failed[best]:
                off = spaces[best].alloc.alloc(size)
                if off is not None:
                    free[best] -= need
                    return spaces[best], off
                failed[best] = need
            # fragmented: any other node with enough free units that may hold them in one extent, most free first
            cands = [i for i in ok if free[i] >= need and need < failed[i]]
            for i in sorted(cands, key=free.__getitem__, reverse=True) if len(cands) > 1 else cands:
                off = spaces[i].alloc.alloc(size)
                if off is not None:
                    free[i] -= need
                    return spaces[i], off
                failed[i] = need
        return self._evict_for(size, need, ok)

    def _evict_for(self, size: int, need: int, ok: list[int] | None) -> tuple[NodeSpace, int] | None:
        """Evict until ``size`` fits (see ``place``); for a run (``want``), on until a run's worth is free on the
        node evicting, unless its next victim is more recent than another node's (by (last use, node index): the
        order one object at a time evicts in), it has nothing more to evict, or the budget is spent. So a run evicts
        exactly the pages, in the order, that its objects placed one at a time would have, and since pages put
        together lie together (and share their last use), their space comes back as one run. ``free``, ``failed``
        and ``usable`` stay current (a node that evicted has lost no fit); evictions are counted once per call.
        A victim whose quota group is at its reservation (``Directory._spared``) is passed over (``Policy.spare``,
        counted in the budget), and a node whose every victim was passed over in this call has nothing to evict."""
        d, spaces, free, usable, failed, fx = self.d, self.spaces, self.free, self.usable, self.failed, self.fx
        first = d.policy.first
        evict = d._evict
        spared = d._spared if d.reserving else None
        passed: dict[int, int] = {}  # node index -> victims passed over there in this call
        va = self.va
        if va is None:
            va = self.va = [next_victim_access(d, s) for s in spaces]
        cand = va if ok is None else [va[i] if i in ok else _INF for i in range(len(spaces))]
        want = self.want if ok is None and self.evict_runs else 1
        target = need * want
        budget = PLACE_EVICT_BUDGET
        n = 0
        try:
            while True:
                m = min(cand)
                if m == _INF:
                    return None
                i = cand.index(m)
                sp = spaces[i]
                nid = sp.node_id
                al = sp.alloc
                # where one object at a time would turn next (only a run asks: the others' victims stay put here)
                other = None
                if want > 1:  # two C-level scans, not a generator over the nodes (cand is va: no ``ok``)
                    va[i] = _INF
                    o = min(va)
                    other = (o, va.index(o))
                    va[i] = m
                victim = first(nid)
                turned = False
                while victim is not None:
                    if budget <= 0:
                        va[i] = victim.last_access
                        return None
                    budget -= 1
                    if spared is not None and spared(victim):
                        d.policy.spare(victim)
                        k = passed[i] = passed.get(i, 0) + 1
                        victim = first(nid) if k < d.policy.count(nid) else None
                        if victim is not None:  # on here only while this node's next victim is still the oldest
                            va[i] = victim.last_access
                            if cand is not va:
                                cand[i] = va[i]
                            turned = min(cand) < va[i]
                            if turned:
                                break
                        continue
                    evict(victim, fx)
                    n += 1
                    f = free[i] = usable[i] = al.units - al.used_units
                    failed[i] = _INF
                    if f > self.top:
                        self.top = f
                    victim = first(nid)
                    if f >= need and (f >= target or victim is None or budget <= 0 or
                                      (victim.last_access, i) > other):
                        if want > 1:
                            run = al.alloc_run(size, want)
                            off, got = run if run is not None else (None, 0)
                        else:
                            off, got = al.alloc(size), 1
                        if off is not None:
                            self.got = got
                            free[i] = usable[i] = f - need * got
                            va[i] = victim.last_access if victim is not None else _INF
                            return sp, off
                if turned:
                    continue
                va[i] = _INF  # nothing left to evict there
                if cand is not va:
                    cand[i] = _INF
        finally:
            d.evictions += n


def next_victim_access(d: "Directory", sp: NodeSpace) -> float:
    victim = d.policy.first(sp.node_id)
    return victim.last_access if victim is not None else _INF
