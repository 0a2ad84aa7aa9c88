"""The page directory's invariants (``DirectoryInvariants.check``, a mixin of ``metaserver.directory.Directory``):
every entry in exactly the maps its state says, allocator extents equal to the live entries, the eviction policy
holding exactly the READY unpinned entries, parent/child and orphan links consistent, per-namespace use equal to
the object sizes of its live entries, nodes being dropped in slices holding only READY entries. Tests only: O(entries log
entries).
"""

from __future__ import annotations

from metaserver.entry import GONE, PENDING, READY, Entry, extent_size


class DirectoryInvariants:
    def check(self) -> None:
        """Assert the invariants (tests only; O(entries log entries))."""
        live: list[Entry] = []
        for ns, r in self.ready.items():
            assert r, f"empty ready map kept for {ns!r}"
            for k, e in r.items():
                assert e.state == READY and e.ns == ns and e.key == k, (ns, k)
                live.append(e)
        n_pending = 0
        for ns, pd in self.pending_keys.items():
            assert pd, f"empty pending map kept for {ns!r}"
            for k, e in pd.items():
                assert e.state == PENDING and e.ns == ns and e.key == k and e in self._pending, (ns, k)
                assert k not in self.ready.get(ns, {}), (ns, k)
                live.append(e)
                n_pending += 1
        assert n_pending == self.pending, (n_pending, self.pending)
        by_space: dict[int, list[Entry]] = {}
        for e in live:
            by_space.setdefault(id(e.space), []).append(e)
        zombies: dict[int, Entry] = {id(e): e for es in self.leases.values() for e in es if e.state == GONE}
        for z in zombies.values():
            assert z.pins > 0
            by_space.setdefault(id(z.space), []).append(z)
        pinned = {id(e) for es in self.leases.values() for e in es}
        assert len(pinned) == self.pinned, (len(pinned), self.pinned)
        for sp in self.spaces.values():
            es = by_space.pop(id(sp), [])
            sp.alloc.check([(e.offset, extent_size(e.payload_len)) for e in es] + self.quarantine.extents(sp))
            assert sp.alloc.used <= sp.alloc.capacity
            mine = [e for e in es if e.state != GONE]
            assert sp.n == len(mine), (sp.node_id, sp.n, len(mine))
            assert {id(e) for e in sp.entries} == {id(e) for e in mine}, sp.node_id
            evictable = {id(e) for e in mine if e.state == READY and e.pins == 0}
            assert self.policy.count(sp.node_id) == len(evictable), (self.policy.count(sp.node_id), len(evictable))
            assert {id(e) for e in self.policy.members(sp.node_id)} == evictable, sp.node_id
        for nid, (sp, _recs) in self.dying.items():  # nodes being dropped in slices: READY entries only remain
            assert sp.dead and nid not in self.spaces, nid
            es = [e for e in by_space.pop(id(sp), []) if e.state != GONE]
            assert all(e.state == READY for e in es) and sp.n == len(es), (nid, sp.n, len(es))
            assert self.policy.count(nid) == sum(1 for e in es if e.pins == 0), nid
        assert all(e.space.dead and e.state == GONE for es in by_space.values() for e in es), \
            "entries on a space the directory lost"
        used: dict[str, int] = {}
        for e in live:
            used[e.ns] = used.get(e.ns, 0) + extent_size(e.payload_len)
        assert used == self.ns_used, ("per-namespace use", used, self.ns_used)
        groups: dict[str, int] = {}
        members: dict[str, set] = {}
        for ns, u in used.items():
            g = self.quotas.group_of(ns) if self.quotas else None
            if g is not None:
                groups[g.name] = groups.get(g.name, 0) + u
                members.setdefault(g.name, set()).add(ns)
        assert groups == self.group_used, ("per-group use", groups, self.group_used)
        assert members == self._group_ns, ("a group's namespaces with use", members, self._group_ns)
        assert set(self._lease_owner) <= set(self.leases), "an owner kept for a lease that is gone"
        assert all(w is not None and type(w) is tuple and len(w) == 2 for w in self._pending.values())
        for e in live:
            if e.state != READY:
                assert type(e.up) is not Entry and e.kids is None
                continue
            up = e.up
            if type(up) is Entry:
                assert up.state == READY and up.ns == e.ns and self.ready[e.ns].get(up.key) is up
                assert up.kids is e or (type(up.kids) is set and e in up.kids)
            elif up is not None:
                p = self.ready.get(e.ns, {}).get(up)
                assert p is None or p is e, "a READY parent left unlinked"
                w = self.orphans.get(e.ns, {}).get(up)
                assert w is e or (type(w) is set and e in w), "an orphan not filed for adoption"
            kids = e.kids
            for c in (kids if type(kids) is set else () if kids is None else (kids,)):
                assert c.up is e and c.state == READY
            assert type(kids) is not set or len(kids) >= 2
        n_orphans = sum(len(w) if type(w) is set else 1 for o in self.orphans.values() for w in o.values())
        assert n_orphans == sum(1 for e in live if e.state == READY and type(e.up) is bytes)
        assert self.used <= self.capacity
        self._check_shared(live)
