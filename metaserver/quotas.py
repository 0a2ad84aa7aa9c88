"""Quota groups for the directory (a ``Directory`` mixin): each namespace's use counted into its quota group's
(umbp/quotarules.py says which namespaces share a group), an ALLOC that would take the group past its quota first
evicting the group's own least recently used pages (or refused whole when they cannot fit), and the reservations
that global eviction respects (``_spared``).

A group's use is the object sizes of the READY and PENDING entries of its namespaces, kept exact through every
transition by ``Directory._count`` (``check()`` verifies it); ``_group_ns`` holds the group's namespaces that have
use, so its pages are found without a scan of the whole directory. Its quota also counts the extents of its pages
freed young, which the quarantine holds until their write capabilities are dead (metaserver/quarantine.py): they
take arena space as surely as live pages, and a flood that evicted its own young pages would otherwise hold up to
``hold_s`` of its put rate outside its quota, and push every other tenant's pages out. So a group's quota eviction
takes only its *old* pages (generation below the quarantine's young mark: freed at once); a group whose pages are
all young is refused (QUOTA) until they age: a group puts at most about quota / ``hold_s`` bytes a second past its
quota (1 GiB over 12 s: 85 MiB/s), the price of a quota that holds in a closed pool. Open pools hold nothing.

What it approximates: the group's LRU order, from a batch of its GROUP_VICTIMS oldest evictable entries gathered when
the previous batch is used up; an entry pinned when the batch was gathered and released since is seen from the next
batch on. A partitioned pool's slot enforces its share of each group (umbp/quotarules.py). Costs: O(keys) per ALLOC
under a quota, plus O(read leases + the group's PENDING) and the eviction when the group is over; a gather is
O(group's pages log GROUP_VICTIMS), at most once per call; ``_spared`` O(nodes) for a page of a reserving group, O(1)
otherwise.
"""

from __future__ import annotations

import heapq
import time
from itertools import chain
from operator import attrgetter

from metaserver.entry import READY, Effects, extent_size
from metaserver.placement import PLACE_EVICT_BUDGET
from metaserver.quarantine import NEVER
from umbp.quotarules import QuotaGroup

GROUP_VICTIMS = 1024  # quota eviction: the oldest evictable entries of a group gathered per rebuild
GATHER_AGAIN_S = 1.0  # a gather that found all of a group's old pages is not repeated sooner, nothing changed
_access = attrgetter("last_access")


class NamespaceQuotas:
    @property
    def reserving(self) -> bool:
        """Whether some group has a reservation (global eviction asks ``_spared`` only then)."""
        return self.quotas.reserved > 0

    def _count_group(self, ns: str, nbytes: int, ns_used: int) -> None:
        """``Directory._count``'s part for quota groups: ``nbytes`` into ``ns``'s group, whose namespaces with use
        (``ns_used``: the namespace's use after the change) are kept in ``_group_ns``."""
        g = self.quotas.group_of(ns)
        if g is None:
            return
        name = g.name
        if nbytes > 0:
            self._gathered.pop(name, None)  # new pages: the next quota eviction gathers again
        u = self.group_used.get(name, 0) + nbytes
        if u:
            self.group_used[name] = u
        else:
            self.group_used.pop(name, None)
        if ns_used:
            nss = self._group_ns.get(name)
            if nss is None:
                nss = self._group_ns[name] = set()
            nss.add(ns)
        else:
            nss = self._group_ns.get(name)
            if nss is not None:
                nss.discard(ns)
                if not nss:
                    del self._group_ns[name]

    def _held(self, e, until: float) -> None:
        """Entry ``e``'s extent went to the quarantine until monotonic ``until`` (0.0: freed at once): its group
        counts it until then. O(log held)."""
        if until and self.quotas:
            g = self.quotas.group_of(e.ns)
            if g is not None:
                heapq.heappush(self._group_held.setdefault(g.name, []), (until, extent_size(e.payload_len)))

    def group_held(self, name: str, now: float | None = None) -> int:
        """Bytes of group ``name`` the quarantine holds now (those given back since are forgotten here)."""
        h = self._group_held.get(name)
        if not h:
            return 0
        now = time.monotonic() if now is None else now
        while h and h[0][0] <= now:
            heapq.heappop(h)
        if not h:
            del self._group_held[name]
            return 0
        return sum(size for _, size in h)

    def _spared(self, e) -> bool:
        """Whether global eviction passes over READY entry ``e``: evicting it would take its group below the group's
        reservation (clamped by ``QuotaRules.floor``)."""
        g = self.quotas.group_of(e.ns)
        if g is None or not g.floor:
            return False
        return self.group_used.get(g.name, 0) - extent_size(e.payload_len) < self.quotas.floor(g, self.capacity)

    def _fit_quota(self, ns: str, keys: list[bytes], sizes: list[int], g: QuotaGroup, fx: Effects) -> bool:
        """Make room in the quota of ``ns``'s group ``g`` for the new keys of an ALLOC, evicting the group's own least
        recently used old pages (of any of its namespaces); False when they cannot fit even then: more than the
        quota, or more than what is not pinned, PENDING or held (nothing evicted), or more than its old pages free.
        O(keys), plus O(read leases + the group's PENDING and held extents) and the eviction when it is over."""
        r = self.ready.get(ns) or {}
        pd = self.pending_keys.get(ns) or {}
        seen: set[bytes] = set()
        need = 0
        for key, size in zip(keys, sizes):
            if key in seen or key in pd:
                continue
            seen.add(key)
            e = r.get(key)
            if e is None or e.space.dead:
                need += extent_size(size)
        quota = g.limit
        used = self.group_used.get(g.name, 0)
        over = used + self.group_held(g.name) + need - quota
        if over <= 0:
            return True
        if need > quota:
            return False
        nss = self._group_ns.get(g.name) or ()
        held = sum(extent_size(e.payload_len) for n in nss for e in (self.pending_keys.get(n) or {}).values())
        pinned = {id(e): e for es in self.leases.values() for e in es if e.state == READY and e.ns in nss}
        held += sum(extent_size(e.payload_len) for e in pinned.values())
        if over > used - held:
            return False
        return self._evict_group(g, over, PLACE_EVICT_BUDGET + len(keys), fx) >= over

    def _evict_group(self, g: QuotaGroup, nbytes: int, budget: int, fx: Effects) -> int:
        """Evict READY, unpinned entries of group ``g``'s namespaces, least recently used first, until ``nbytes`` are
        freed or ``budget`` entries went. Returns the bytes freed.

        The candidates are the group's GROUP_VICTIMS oldest evictable old entries (a young one's extent would stay
        held, and counted: the module docstring), gathered when the previous batch is used up (O(group's pages log
        GROUP_VICTIMS), at most once per call; after a gather that found all of them, not again for GATHER_AGAIN_S
        while the quarantine's young mark stays and the group allocates nothing, so a group refused over and over
        does not scan its pages each time)
        and consumed oldest first; an entry used, pinned or gone since it was gathered is skipped (a newer commit is
        newer than every candidate). What it approximates: an entry pinned when the batch was gathered and released
        since is seen from the next batch on (or GATHER_AGAIN_S later). O(budget) per call otherwise."""
        name = g.name
        young = self.quarantine.young_gen
        mark = young
        now = time.monotonic()
        last = self._gathered.get(name)
        fresh = last is not None and last[0] == mark and now - last[1] < GATHER_AGAIN_S
        freed = n = 0
        for _ in range(2):  # the batch gathered before, then (if that was not enough) one fresh batch
            q = self._ns_victims.get(name)
            while q and freed < nbytes and n < budget:
                e, acc = q.pop()
                if e.state != READY or e.pins or e.last_access != acc:
                    continue
                freed += extent_size(e.payload_len)
                if e.space.dead:
                    self._drop_dying(e, fx)
                else:
                    self._drop(e, fx)
                n += 1
            if freed >= nbytes or n >= budget or fresh:
                break
            nss = tuple(self._group_ns.get(name) or ())
            ready = self.ready
            pages = (chain.from_iterable((ready.get(ns) or {}).values() for ns in nss) if len(nss) != 1 else
                     (ready.get(nss[0]) or {}).values())
            if young == NEVER:  # an open pool: every page is old
                pages = (e for e in pages if not e.pins)
            else:
                pages = (e for e in pages if not e.pins and e.gen < young)
            oldest = heapq.nsmallest(GROUP_VICTIMS, pages, key=_access)
            if len(oldest) < GROUP_VICTIMS:  # every old page of the group (bar later unpins and uses): not again soon
                self._gathered[name] = (mark, now)
                fresh = True
            if not oldest:
                break
            self._ns_victims[name] = [(e, e.last_access) for e in reversed(oldest)]
        if name not in self._group_ns:
            self._ns_victims.pop(name, None)
            self._gathered.pop(name, None)
        self.evictions += n
        return freed
