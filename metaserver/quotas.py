"""Quota groups for the directory (a ``Directory`` mixin): each namespace's use counted into its quota group's
(umbp/quotarules.py says which namespaces share a group), an ALLOC that would take the group past its quota first
evicting the group's own least recently used pages (or refused whole when they cannot fit), and the reservations
that global eviction respects (``_spared``).

A group's use is the object sizes of the READY and PENDING entries of its namespaces, kept exact through every
transition by ``Directory._count`` (``check()`` verifies it); ``_group_ns`` holds the group's namespaces that have
use, so its pages are found without a scan of the whole directory.

What it approximates: the group's LRU order, from a batch of its GROUP_VICTIMS oldest evictable entries gathered when
the previous batch is used up; an entry pinned when the batch was gathered and released since is seen from the next
batch on. A partitioned pool's slot enforces its share of each group (umbp/quotarules.py). Costs: O(keys) per ALLOC
under a quota, plus O(read leases + the group's PENDING) and the eviction when the group is over; a gather is
O(group's pages log GROUP_VICTIMS), at most once per call; ``_spared`` O(nodes) for a page of a reserving group, O(1)
otherwise.
"""

from __future__ import annotations

import heapq
from operator import attrgetter

from metaserver.entry import READY, Effects, extent_size
from metaserver.placement import PLACE_EVICT_BUDGET
from umbp.quotarules import QuotaGroup

GROUP_VICTIMS = 1024  # quota eviction: the oldest evictable entries of a group gathered per rebuild
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

    def _spared(self, e) -> bool:
        """Whether global eviction passes over READY entry ``e``: evicting it would take its group below the group's
        reservation (clamped by ``QuotaRules.floor``)."""
        g = self.quotas.group_of(e.ns)
        if g is None or not g.floor:
            return False
        return self.group_used.get(g.name, 0) - extent_size(e.payload_len) < self.quotas.floor(g, self.capacity)

    def _fit_quota(self, ns: str, keys: list[bytes], sizes: list[int], g: QuotaGroup, fx: Effects) -> bool:
        """Make room in the quota of ``ns``'s group ``g`` for the new keys of an ALLOC, evicting the group's own least
        recently used pages (of any of its namespaces); False (nothing evicted) when they cannot fit even then: more
        than the quota, or more than what is not pinned or PENDING. O(keys), plus O(read leases + the group's
        PENDING) and the eviction when the group is over."""
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
        over = used + need - quota
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

        The candidates are the group's GROUP_VICTIMS oldest evictable entries, gathered when the previous batch is
        used up (O(group's pages log GROUP_VICTIMS), at most once per call) and consumed oldest first; an entry
        used, pinned or gone since it was gathered is skipped (a newer commit is newer than every candidate). What it
        approximates: an entry pinned when the batch was gathered and released since is seen from the next batch
        on. O(budget) per call otherwise."""
        name = g.name
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
            if freed >= nbytes or n >= budget:
                break
            nss = tuple(self._group_ns.get(name) or ())
            ready = self.ready
            oldest = heapq.nsmallest(GROUP_VICTIMS, (e for ns in nss for e in (ready.get(ns) or {}).values()
                                                     if not e.pins), key=_access)
            if not oldest:
                break
            self._ns_victims[name] = [(e, e.last_access) for e in reversed(oldest)]
        if name not in self._group_ns:
            self._ns_victims.pop(name, None)
        self.evictions += n
        return freed
