"""Pages of a node lost by its lease: dropped from the table in budgeted slices and parked for its return
(``Rejoin``, held by ``metaserver.ha.service.Metaserver`` as ``rejoin``: a fresh one every term, as the parked nodes
are a term's state). It holds the parked nodes itself and reads the rest through the service (``svc``: its
directory, which a warm takeover replaces within the term, its etcd writer and store, and ``_apply``); the service
calls it from its tick (``node_lost``, ``drop_lost``, ``expire_parked``) and from a registration
(``disk_registered``, ``finish_drop``, ``unpark``).

A node that stops heartbeating may only be cut off or paused, its arena intact. When its lease lapses the node is
*detached* at once (nothing is placed there, LOOKUP misses its pages, its PENDING allocations go), then its READY
pages leave the table in slices of at most the tick's budget (``TableDirectory.drop_slice``), so a node of millions
of pages never holds the event loop for long (the election's keep-alive runs between ticks). Their etcd records and
the arena record stay for REJOIN_GRACE_S (they are *parked*); a re-registration of the same arena (id and capacity)
in that time loads them back, except keys written elsewhere meanwhile. After the grace, or when the node returns
with another arena, the records are deleted. A node that was only provisional (loaded at a takeover, never
re-registered) is not parked: its records are deleted slice by slice.

Costs: detaching O(PENDING rows); a tick O(its budget) numpy work plus a Python step per parked page (its record);
the last slice of a node a sort of its parked records by recency (``nodes.drop_rows``: O(pages log pages) in
C, tens of ms per million); restoring O(the node's pages) (``TableDirectory.unpark``); expiry of parked nodes is
checked every tick, O(parked nodes).
"""

from __future__ import annotations

import logging

from metaserver.table.entry import Effects
from metaserver.handlers.membership import Node
from metaserver.table.tiers import twin_id
from transport import objformat

log = logging.getLogger("umbp.metaserver")

REJOIN_GRACE_S = 120.0  # a node lost by its lease: its pages are parked this long for it to re-register its arena


class Rejoin:
    """One term's lost nodes of the service ``svc``: their drops and their parked pages (see the module docstring)."""

    def __init__(self, svc):
        self.svc = svc
        self.parked: dict[str, tuple] = {}  # lost node id -> (arena_id, capacity, deadline, page records, disk_id)

    def node_lost(self, node: Node, now: float) -> None:
        """A node's lease lapsed: detach it now, drop its pages in later ticks (``drop_lost``)."""
        svc = self.svc
        nid = node.node_id
        use = svc.dir.space_use(nid)
        pages = use[1] if use is not None else 0
        park = not node.provisional and use is not None
        _, fx = svc.dir.detach_space(nid, park=park)
        svc._apply(fx)
        if park:
            # Out of the directory (no lookup finds them, nothing is placed there) but still in etcd, with the arena
            # record: a return within the grace brings them back (unpark); expire_parked deletes them after it.
            self.parked[nid] = (node.arena_id, node.capacity, now + max(REJOIN_GRACE_S, node.lease_ttl), [],
                                node.disk_id)
            log.warning("metaserver: node %s lost (no heartbeat for %.1fs): %d pages parked for %.0fs", nid,
                        node.lease_ttl, pages, REJOIN_GRACE_S)
        else:
            svc.writer.submit([], [svc.store.arena_key(nid)], wait=False)
            if node.provisional:
                log.warning("metaserver: node %s did not re-register after the takeover: dropping %d pages", nid,
                            pages)
            else:
                log.warning("metaserver: node %s lost (no heartbeat for %.1fs): dropping %d pages", nid,
                            node.lease_ttl, pages)
        node.provisional = False
        svc._check_settled()
        lease, node.lease_id = node.lease_id, 0
        if lease:
            svc._spawn(svc._revoke(lease))

    def drop_lost(self, budget: int) -> int:
        """One tick's share of dropping detached nodes' pages: at most ``budget`` pages in all. Returns how many."""
        svc = self.svc
        done = 0
        for nid in svc.dir.tiers.hosts_of(svc.dir.dying):  # a disk's drop goes on under its node's id
            if done >= budget:
                break
            fx = Effects()
            n, recs = svc.dir.drop_slice(nid, budget - done, fx)
            svc._apply(fx)
            done += n
            if recs is not None:
                self._dropped(nid, recs)
        return done

    def finish_drop(self, node_id: str) -> None:
        """Finish a detached node's drop in one step (it re-registers: its parked pages must be complete first)."""
        d = self.svc.dir
        if node_id in d.tiers.hosts_of(d.dying):
            fx = Effects()
            recs = None
            for _ in range(2):  # its DRAM pages, then its disk's (metaserver/table/tiers.py)
                _, recs = d.drop_slice(node_id, 1 << 62, fx)
                if recs is not None:
                    break
            self.svc._apply(fx)
            self._dropped(node_id, recs)

    def disk_registered(self, node: Node, old: tuple | None, keep: bool) -> bool:
        """A (re-)registration's disk tier (``umbp node --disk``; ``old``: the (disk id, capacity) the node had).
        Its capacity goes where ``add_space`` finds it (``tiers.disks``). Returns whether the node kept its disk
        (the same id and size): then its disk pages stay, also when its DRAM arena is new (a host reboot wipes
        /dev/shm, not the drive: the caller drops the DRAM pages only). Another disk (or none now): the old disk's
        pages go at once."""
        d = self.svc.dir
        nid = node.node_id
        if node.disk_capacity:
            d.tiers.disks[nid] = node.disk_capacity
        else:
            d.tiers.disks.pop(nid, None)
        same = node.disk_id is not None and old is not None and old == (node.disk_id, node.disk_capacity)
        if d.tiers.twin(nid) is not None and not same:
            _, fx = d.drop_space(twin_id(nid))
            self.svc._apply(fx)
            log.warning("metaserver: node %s came back with another disk: its disk pages are dropped", nid)
        if keep and nid in d.spaces:
            d.tiers.add(nid)
        return same

    def _dropped(self, node_id: str, recs: list) -> None:
        """A detached node's last slice: its parked records, oldest first (``drop_slice`` sorts them) for a reload."""
        p = self.parked.get(node_id)
        if p is not None and recs:
            p[3].extend(r[:6] + r[7:] for r in recs)  # (ns, key, offset, payload_len, gen, parent, record name)
        log.info("metaserver: node %s: its pages are out of the directory", node_id)

    def unpark(self, node: Node) -> int:
        """On re-registration: bring the node's parked pages back if it kept the same arena. Keys written elsewhere
        meanwhile stay where they are now. Returns the pages restored."""
        p = self.parked.pop(node.node_id, None)
        if p is None:
            return 0
        arena_id, capacity, _deadline, recs, disk_id = p
        same_arena = arena_id == node.arena_id and capacity == node.capacity
        same_disk = disk_id is not None and disk_id == node.disk_id  # a disk file outlives its host's arena
        lost = [r for r in recs if not (same_disk if r[2] & objformat.DISK_BIT else same_arena)]
        if lost:
            self.forget_parked(node.node_id, lost, arena=False)
            recs = [r for r in recs if (same_disk if r[2] & objformat.DISK_BIT else same_arena)]
        if not recs:
            return 0
        restored, fx = self.svc.dir.unpark(node.node_id, recs)
        self.svc._apply(fx)
        return restored

    def expire_parked(self, now: float) -> None:
        d = self.svc.dir
        for node_id, (_a, _c, deadline, recs, _d) in list(self.parked.items()):
            if deadline < now and node_id not in d.tiers.hosts_of(d.dying):  # a drop still under way: its records are not all in
                del self.parked[node_id]
                self.forget_parked(node_id, recs, arena=True)
                log.warning("metaserver: node %s did not return within %.0fs: dropped its %d parked pages", node_id,
                            REJOIN_GRACE_S, len(recs))

    def forget_parked(self, node_id: str, recs: list, arena: bool) -> None:
        """Delete parked page records from etcd, except keys written again since (their record is the new one)."""
        svc = self.svc
        keys = svc.dir.forget_parked(recs, svc.store.page_key)
        if arena:
            keys.append(svc.store.arena_key(node_id))
        svc._drop_records(keys)
