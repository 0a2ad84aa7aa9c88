"""Namespace quotas for the directory (a ``Directory`` mixin): an ALLOC whose new keys would take a namespace past
its quota first evicts that namespace's own least recently used pages, or is refused whole when they cannot fit.

What it approximates: the namespace's LRU order, from a batch of its NS_VICTIMS oldest evictable entries gathered
when the previous batch is used up; an entry pinned when the batch was gathered and released since is seen from
the next batch on. Costs: O(keys) per ALLOC under a quota, plus O(read leases + the namespace's PENDING) and the
eviction when the namespace is over; a gather is O(namespace log NS_VICTIMS), at most once per call.
"""

from __future__ import annotations

import heapq
from operator import attrgetter

from metaserver.entry import READY, Effects, extent_size
from metaserver.placement import PLACE_EVICT_BUDGET

NS_VICTIMS = 1024  # quota eviction: the oldest evictable entries of a namespace gathered per rebuild
_access = attrgetter("last_access")


class NamespaceQuotas:
    def _fit_quota(self, ns: str, keys: list[bytes], sizes: list[int], quota: int, fx: Effects) -> bool:
        """Make room in ``ns``'s quota for the new keys of an ALLOC, evicting the namespace's own least recently
        used pages; False (nothing evicted) when they cannot fit even then: more than the quota, or more than
        what is not pinned or PENDING. O(keys), plus O(read leases + the namespace's PENDING) and the eviction
        when the namespace is over."""
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
        used = self.ns_used.get(ns, 0)
        over = used + need - quota
        if over <= 0:
            return True
        if need > quota:
            return False
        held = sum(extent_size(e.payload_len) for e in pd.values())
        pinned = {id(e): e for es in self.leases.values() for e in es if e.ns == ns and e.state == READY}
        held += sum(extent_size(e.payload_len) for e in pinned.values())
        if over > used - held:
            return False
        return self._evict_ns(ns, over, PLACE_EVICT_BUDGET + len(keys), fx) >= over

    def _evict_ns(self, ns: str, nbytes: int, budget: int, fx: Effects) -> int:
        """Evict READY, unpinned entries of namespace ``ns``, least recently used first, until ``nbytes`` are freed
        or ``budget`` entries went. Returns the bytes freed.

        The candidates are the namespace's NS_VICTIMS oldest evictable entries, gathered when the previous batch is
        used up (O(namespace log NS_VICTIMS), at most once per call) and consumed oldest first; an entry used,
        pinned or gone since it was gathered is skipped (a newer commit is newer than every candidate). What it
        approximates: an entry pinned when the batch was gathered and released since is seen from the next batch
        on. O(budget) per call otherwise."""
        freed = n = 0
        for _ in range(2):  # the batch gathered before, then (if that was not enough) one fresh batch
            q = self._ns_victims.get(ns)
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
            r = self.ready.get(ns)
            if not r:
                break
            oldest = heapq.nsmallest(NS_VICTIMS, (e for e in r.values() if not e.pins), key=_access)
            if not oldest:
                break
            self._ns_victims[ns] = [(e, e.last_access) for e in reversed(oldest)]
        if not self.ready.get(ns):
            self._ns_victims.pop(ns, None)
        self.evictions += n
        return freed
