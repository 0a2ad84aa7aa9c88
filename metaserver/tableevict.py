"""Eviction for the columnar page table (``TableEviction``, a mixin of ``metaserver.columns.PageTable``): exact LRU
by access stamp per node, or under ``prefix-lru`` exact (tier, stamp) order (``metaserver/tablelinks.py``: the
queue holds each row's tier << 62 | stamp where it holds the stamp, and rows whose key drops below the queue's
largest are inserted at their place). No I/O.

Every access (COMMIT, LOOKUP, the RELEASE that ends a read, an ALLOC of a READY key) stamps its rows with the next
values of one clock, in key order. A node that needs room takes victims from its candidate queue; an empty queue is
refilled with the oldest READY unpinned rows of the node (``np.argpartition`` over its blocks; at least
``CANDIDATES``, or 1/64 of the node's rows), each with the stamp it had. A candidate is evicted only if it is still
READY, unpinned and carries that stamp; a row touched since then is newer than every row left in the queue, and a
row not in the queue was newer than all of them when it was filled, so victims leave in exact stamp order. A victim
of exactly the size wanted hands over its extent and its row (no allocator round trip) unless its generation is
young (the write quarantine holds that extent). Every eviction but evict-all passes over a row whose quota group is
at its reservation, and a refill leaves such rows out (``metaserver/tablequotas.py``).

Costs: a refill O(node's rows) at C speed, amortised over the candidates it yields; a victim O(1) Python.
"""

from __future__ import annotations

import numpy as np

from metaserver.entry import READY, extent_size
from metaserver.tablenodes import NodeRows

CANDIDATES = 1024  # the fewest victims a queue refill collects


class TableEviction:
    """Victims of a ``PageTable``'s nodes: see the module docstring. Uses the table's ``cols``, ``code_arr``,
    ``quarantine``, ``_evicted_now`` and row helpers."""

    def _refill(self, node: NodeRows, floors: np.ndarray | None = None) -> None:
        """``floors``: the quota groups' reservations (``TableQuotas.floors``): rows of groups at theirs are left out
        (a reserved group's old rows would otherwise fill the queue and hide the node's other victims)."""
        state, pins, stamp = self.cols["state"], self.cols["pins"], self.cols["stamp"]
        parts = []
        for b in node.blocks:
            lo = b * self.block
            hi = lo + self.block
            parts.append(np.flatnonzero((state[lo:hi] == READY) & (pins[lo:hi] == 0)) + lo)
        rows = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if floors is not None:
            rows = rows[~self.quota.spared_rows(rows, floors)]
        key = self.links.order(rows) if self.links.linking else stamp[rows]  # prefix-lru: tier << 62 | stamp
        k = min(len(rows), max(CANDIDATES, len(rows) // 64))
        if k < len(rows):
            part = np.argpartition(key, k - 1)[:k]
            rows, key = rows[part], key[part]
        by = np.argsort(key, kind="stable")
        rows, key = rows[by], key[by]
        c = self.cols
        node.queue = rows.tolist()
        node.qstamp = key.tolist()
        if self.links.linking:  # a row whose key falls below this is queued at its place (tablelinks.requeue)
            self.links.refilled(node, int(key[-1]) if len(key) else 0)
        node.qoff = self.offsets_of(rows)
        node.qcode = self.code_arr[c["size"][rows]].tolist()
        node.qns = c["ns"][rows].tolist()
        node.qpos = 0

    def _victim(self, node: NodeRows, spare: bool = True) -> int:
        """The queue position of the node's least recently used READY unpinned row, or -1 when it has none. A row
        that is READY with its queued stamp is the page that was queued: ``qoff``, ``qcode``, ``qns`` describe it.
        ``spare`` (all but evict-all): pass over a row whose quota group is at its reservation
        (``TableQuotas.spares``); the caller evicts the row returned."""
        state, pins, stamp = self.cols["state"], self.cols["pins"], self.cols["stamp"]
        key = self.links.key if self.links.linking else None  # prefix-lru: the queue holds tier << 62 | stamp
        quota = self.quota if spare and self.quota is not None and self.quota.reserving else None
        floors = quota.floors() if quota is not None else None
        for _ in range(2):  # at most one refill: a fresh queue holds only valid candidates
            q, qs = node.queue, node.qstamp
            while node.qpos < len(q):
                i = node.qpos
                node.qpos += 1
                r = q[i]
                if state[r] == READY and not pins[r] and (stamp[r] if key is None else key(r)) == qs[i]:
                    if quota is not None and quota.spares(node.qns[i], node.qcode[i], floors):
                        continue
                    return i
            self._refill(node, floors)
        return -1

    def _make_room(self, node: NodeRows, size: int) -> tuple[int | None, int]:
        """Evict the node's least recently used pages until ``size`` bytes fit: (offset, row to reuse or -1), or
        (None, -1) when nothing more can go. A victim of exactly ``size`` bytes hands over its extent and its row
        as they are (no allocator round trip), unless its generation is young: the quarantine holds that extent."""
        young = self.quarantine.young_gen
        gen = self.cols["gen"]
        while True:
            i = self._victim(node)
            if i < 0:
                return None, -1
            r, vns, voff = node.queue[i], node.qns[i], node.qoff[i]
            self._evicted_now[r] = vns  # unfiled at the end of the request, before its new rows are filed
            self.evictions += 1
            vsize = extent_size(node.qcode[i])
            if self.links.linking:  # its parent's tier now, for the next victim (metaserver/tablelinks.py); after
                self.links.evicted(r)  # the reads: it may queue the parent in slot i
            g = int(gen[r])
            if vsize == size and g < young:
                return voff, r
            until = self.quarantine.free(node, voff, vsize, g)
            if until and self.quota is not None:
                self.quota.held(vns, vsize, until)
            self._free_row(r, node)
            off = node.alloc.alloc(size)
            if off is not None:
                return off, -1


def over_high(used: int, capacity: int, high: float) -> bool:
    """Watermarks: a node (or the pool) above ``high`` of its capacity starts a background eviction pass ..."""
    return capacity > 0 and used > high * capacity


def bytes_to_low(used: int, capacity: int, low: float) -> int:
    """... which frees the bytes from ``used`` down to the low watermark (0 when already below)."""
    return max(0, used - int(low * capacity))
