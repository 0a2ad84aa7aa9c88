"""Eviction passes and background expiry of the page directory (``EvictionPasses``, a mixin of
``metaserver.directory.Directory``): per-node eviction in policy order, a number of bytes from the fullest nodes, the
watermark pass, evict-all in slices, and the budgeted expiry of PENDING entries and read leases.

Every pass takes a budget of evictions (or expiries) and returns what it did, so the callers (the background tick,
an operator's EVICT in slices) bound the work done between two turns of the event loop. Effects (the etcd deletes)
are collected in the ``Effects`` passed in. Every pass but evict-all passes over the pages of a quota group at its
reservation (``Directory._spared``, ``Policy.spare``); each page passed over counts in the budget.
"""

from __future__ import annotations

import heapq

from metaserver.entry import Effects, NodeSpace, expire_queue, extent_size
from metaserver.eviction import bytes_to_low, over_high


class EvictionPasses:
    # -- eviction ----------------------------------------------------------------------------------------------
    def evict_node(self, node_id: str, nbytes: int, budget: int, fx: Effects, spare: bool = True
                   ) -> tuple[int, int]:
        """Evict on one node in policy order until ``nbytes`` are freed or ``budget`` objects went (or were passed
        over: ``spare`` and a victim's group at its reservation). Returns (evicted, freed_bytes)."""
        n = freed = passed = 0
        spared = self._spared if spare and self.reserving else None
        for victim in self.policy.victims(node_id):
            if freed >= nbytes or n + passed >= budget:
                break
            if spared is not None and spared(victim):
                passed += 1
                if passed >= self.policy.count(node_id):
                    break  # every victim left here was passed over
                self.policy.spare(victim)
                continue
            freed += extent_size(victim.payload_len)
            self._evict(victim, fx)
            n += 1
        self.evictions += n
        return n, freed

    def evict_bytes(self, nbytes: int, budget: int, fx: Effects) -> tuple[int, int]:
        """Free at least ``nbytes`` across nodes, always from the fullest node (by fill ratio; ties: the first in
        ``spaces`` order). Bounded by ``budget`` evictions. Returns (evicted, freed_bytes).

        The nodes are ranked once in a heap; a node evicts until it is no longer the fullest (evicting on one node
        changes no other node's fill), then goes back into the heap: O(nodes + victims x log nodes), instead of a
        scan of every node per victim."""
        n = freed = 0
        heap = [(-_fill_of(sp), i, sp) for i, sp in enumerate(self.spaces.values()) if self.policy.count(sp.node_id)]
        heapq.heapify(heap)
        while heap and freed < nbytes and n < budget:
            _, i, sp = heapq.heappop(heap)
            k = 0
            while freed < nbytes and n < budget:
                k, f = self.evict_node(sp.node_id, 1, 1, fx)
                n += k
                freed += f
                if not k or (heap and (-_fill_of(sp), i) > heap[0][:2]):
                    break
            if k and self.policy.count(sp.node_id):
                heapq.heappush(heap, (-_fill_of(sp), i, sp))
        return n, freed

    def watermark_pass(self, high: float, low: float, budget: int, fx: Effects) -> tuple[int, int]:
        """Evict each node above ``high`` down to ``low`` (pass ``high=low`` to force a pass). Bounded by ``budget``
        evictions in total; returns (evicted, freed_bytes)."""
        n = freed = 0
        for sp in list(self.spaces.values()):
            cap, used = sp.alloc.capacity, sp.alloc.used
            if n >= budget or not over_high(used, cap, high):
                continue
            k, f = self.evict_node(sp.node_id, bytes_to_low(used, cap, low), budget - n, fx)
            n += k
            freed += f
        return n, freed

    def needs_eviction(self, high: float) -> bool:
        return any(over_high(s.alloc.used, s.alloc.capacity, high) and self.policy.count(s.node_id)
                   for s in self.spaces.values())

    def evict_all(self, budget: int, fx: Effects) -> tuple[int, int, bool]:
        """Evict every unpinned READY object, at most ``budget`` per call. Returns (evicted, freed, done)."""
        n = freed = 0
        for sp in list(self.spaces.values()):
            k, f = self.evict_node(sp.node_id, 1 << 62, budget - n, fx, spare=False)
            n += k
            freed += f
            if n >= budget:
                return n, freed, False
        return n, freed, True

    # -- background expiry -------------------------------------------------------------------------------------
    def expire_pending(self, now: float, budget: int) -> int:
        """Free PENDING entries older than pending_ttl_s, oldest first; frees at most ``budget``."""
        ttl = self.pending_ttl_s
        due = []
        for e in self._pending:
            if len(due) >= budget or e.last_access + ttl > now:
                break
            due.append(e)
        fx = Effects()
        for e in due:
            self._drop(e, fx)
        return len(due)

    def expire_leases(self, now: float, budget: int) -> int:
        return expire_queue(self._lease_q, now, budget, self.release)


def _fill_of(sp: NodeSpace) -> float:
    return sp.alloc.used_units / sp.alloc.units if sp.alloc.units else 1.0
