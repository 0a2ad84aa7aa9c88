"""Pages of a node lost by its lease, parked for its return (``RejoinHandlers``, a mixin of
``metaserver.service.Metaserver``).

A node that stops heartbeating may only be cut off or paused, its arena intact. Its READY pages leave the directory
(no lookup finds them, nothing is placed there) but their etcd records and the arena record stay for
REJOIN_GRACE_S; a re-registration of the same arena (id and capacity) in that time loads them back, except keys
written elsewhere meanwhile. After the grace, or when the node returns with another arena, the records are deleted.
Costs: parking and restoring are O(the node's pages); expiry is checked every tick, O(parked nodes).
"""

from __future__ import annotations

import logging

from metaserver.directory import READY
from metaserver.nodes import Node

log = logging.getLogger("umbp.metaserver")

REJOIN_GRACE_S = 120.0  # a node lost by its lease: its pages are parked this long for it to re-register its arena


class RejoinHandlers:
    def _park(self, node: Node, now: float) -> int:
        """Record a lost node's READY pages (recency order) so a re-registration of the same arena within
        REJOIN_GRACE_S gets them back: a node cut off or paused past its lease still holds the bytes. O(its pages)."""
        sp = self.dir.spaces.get(node.node_id)
        if sp is None:
            return 0
        ready = sorted((e for e in sp.entries if e.state == READY), key=lambda e: e.last_access)
        if ready:
            self.parked[node.node_id] = (node.arena_id, node.capacity, now + max(REJOIN_GRACE_S, node.lease_ttl),
                                         [(e.ns, e.key, e.offset, e.payload_len, e.gen, e.parent) for e in ready])
        return len(ready)

    def _unpark(self, node: Node) -> int:
        """On re-registration: bring the node's parked pages back if it kept the same arena. Keys written elsewhere
        meanwhile stay where they are now. Returns the pages restored."""
        p = self.parked.pop(node.node_id, None)
        if p is None:
            return 0
        arena_id, capacity, _deadline, recs = p
        if arena_id != node.arena_id or capacity != node.capacity:
            self._forget_parked(node.node_id, recs, arena=False)
            return 0
        present = self.dir.entries
        recs = [r for r in recs if r[1] not in present.get(r[0], ())]
        fx = self.dir.load_pages(node.node_id, recs)
        self._apply(fx)
        return len(recs) - len(fx.deletes)

    def _expire_parked(self, now: float) -> None:
        for node_id, (_a, _c, deadline, recs) in list(self.parked.items()):
            if deadline < now:
                del self.parked[node_id]
                self._forget_parked(node_id, recs, arena=True)
                log.warning("metaserver: node %s did not return within %.0fs: dropped its %d parked pages", node_id,
                            REJOIN_GRACE_S, len(recs))

    def _forget_parked(self, node_id: str, recs: list, arena: bool) -> None:
        """Delete parked page records from etcd, except keys written again since (their record is the new one)."""
        present = self.dir.entries
        keys = [self.store.page_key(ns, k) for ns, k, *_ in recs if k not in present.get(ns, ())]
        if arena:
            keys.append(self.store.arena_key(node_id))
        self.writer.submit([], keys, wait=False)

