"""The node side of the page directory (``NodeSpaces``, a mixin of ``metaserver.directory.Directory``): arena spaces
of registered nodes, their loss (detached at once, READY pages dropped in budgeted slices while the records stay for
a rejoin grace), drains, and pages loaded from etcd or replayed by a warm standby. No I/O: like every directory
method, these return the etcd work as ``Effects``.

Costs: add/set_placeable O(1); detach O(PENDING + pinned entries of the node); ``drop_slice`` O(budget);
``drain`` O(the node's entries); ``load_pages``/``load_entries`` O(pages log pages) (sorted by offset for the
allocator's rebuild; about 1.5 us a page at 10 M, ``bench/scale.py``'s load).
"""

from __future__ import annotations

import sys
from operator import attrgetter

from metaserver.entry import READY, Effects, Entry, NodeSpace, extent_size

_intern = sys.intern
_offset = attrgetter("offset")
_payload_len = attrgetter("payload_len")


class NodeSpaces:
    def add_space(self, node_id: str, capacity: int) -> NodeSpace:
        """Give a (re)registered node a fresh, empty arena space. The node must not have one (drop it first)."""
        assert node_id not in self.spaces, node_id
        sp = self.spaces[node_id] = NodeSpace(node_id, capacity, self)
        return sp

    def drop_space(self, node_id: str) -> tuple[int, Effects]:
        """Forget a node's arena (node died or came back with another arena) in one step: every entry on it goes,
        pinned or not (the bytes are gone or belong to another arena; readers detect that by the object header).
        O(its entries); the metaserver's tick uses ``detach_space`` and ``drop_slice`` instead."""
        n, fx = self.detach_space(node_id)
        n += self.drop_slice(node_id, 1 << 62, fx)[0]
        return n, fx

    def detach_space(self, node_id: str, park: bool = False) -> tuple[int, Effects]:
        """First step of dropping a node's arena in slices: nothing is placed there any more, totals leave it out,
        LOOKUP misses its pages and its PENDING entries go now (O(all PENDING)); its READY entries stay in the maps
        until ``drop_slice`` takes them (EXISTS and PREFIX may still count them until then). ``park``: keep each
        dropped READY page's record (``drop_slice`` returns them) instead of deleting it from etcd. A drop of
        the same node still under way is finished first. Returns (entries dropped, effects)."""
        fx = Effects()
        n = 0
        if node_id in self.dying:
            n = self.drop_slice(node_id, 1 << 62, fx)[0]
        sp = self.spaces.pop(node_id, None)
        if sp is None:
            return n, fx
        sp.dead = True
        sp.placeable = False
        self.dying[node_id] = (sp, [] if park else None)
        pend = [e for e in self._pending if e.space is sp]
        for e in pend:
            self._unlink(e, fx)
            sp.n -= 1
        return n + len(pend), fx

    def drop_slice(self, node_id: str, budget: int, fx: Effects) -> tuple[int, list | None]:
        """Drop at most ``budget`` READY entries of a detached node (policy order; its pinned entries, few, in the
        last slice). Returns (dropped, None while entries remain | the parked records once done: a list, empty
        without ``park``). O(budget), plus O(leases) in the last slice."""
        d = self.dying.get(node_id)
        if d is None:
            return 0, []
        sp, _recs = d
        n = 0
        for e in self.policy.victims(node_id):
            if n >= budget:
                return n, None
            self._drop_dying(e, fx)
            n += 1
        if sp.n:
            pinned = {id(e): e for es in self.leases.values() for e in es if e.space is sp and e.state == READY}
            for e in pinned.values():
                self._drop_dying(e, fx)
                n += 1
        assert sp.n == 0, (node_id, sp.n)
        self.policy.drop_node(node_id)
        del self.dying[node_id]
        return n, _recs if _recs is not None else []

    def _drop_dying(self, e: Entry, fx: Effects) -> None:
        """Take a READY entry of a detached node out of the directory: its record is parked (kept in etcd for the
        node's return) when the drop parks, else deleted."""
        recs = self.dying[e.space.node_id][1]
        if recs is not None:
            recs.append((e.ns, e.key, e.offset, e.payload_len, e.gen, e.parent, e.last_access, e.batch))
            self._unlink(e, Effects())
        else:
            self._unlink(e, fx)
        e.space.n -= 1

    def set_placeable(self, node_id: str, placeable: bool) -> None:
        sp = self.spaces.get(node_id)
        if sp is not None:
            sp.placeable = placeable

    def drain(self, node_id: str) -> tuple[int, int, Effects]:
        """Stop placing on ``node_id`` and drop its unpinned READY objects. Returns (dropped, pinned, effects);
        PENDING objects stay until committed (then dropped by a later drain) or expired."""
        fx = Effects()
        sp = self.spaces.get(node_id)
        if sp is None:
            return 0, 0, fx
        sp.placeable = False
        dropped = pinned = 0
        for e in sp.entries.snapshot():
            if e.state != READY:
                continue
            if e.pins:
                pinned += 1
            else:
                self._drop(e, fx)
                dropped += 1
        return dropped, pinned, fx

    def unpark(self, node_id: str, recs: list) -> tuple[int, Effects]:
        """A lost node came back with its arena: file its parked records ``(ns, key, offset, payload_len, gen,
        parent, its Batch or None)`` (oldest first) again into its (new, empty) space, except keys present now
        (written elsewhere meanwhile). Each page of a commit record goes back into it (the record may have been
        rewritten without it meanwhile) or, when it could not come back, is left out by the same rewrite; of the
        pages that could not come back, only those with a record of their own are deleted. Returns (restored,
        effects). O(records log records)."""
        present = self.entries
        recs = [r for r in recs if r[1] not in present.get(r[0], ())]
        fx = self.load_pages(node_id, [r[:6] for r in recs])
        dropped = len(fx.deletes)
        ready = self.ready
        for r in recs:
            b = r[6]
            if b is None:
                continue
            e = ready.get(r[0], {}).get(r[1])
            if e is not None and e.gen == r[4] and e.space.node_id == node_id:
                e.batch = b
                b.ents.append(e)
            fx.batches.append(b)
        if dropped:
            own = {(r[0], r[1]) for r in recs if r[6] is None}
            fx.deletes = [d for d in fx.deletes if d in own]
        return len(recs) - dropped, fx

    def forget_parked(self, recs: list, page_key) -> list:
        """What deletes parked records for good (the node did not return, or came back with another arena): the
        etcd key (``page_key(ns, key)``) of a page with a record of its own, its ``Batch`` for a page of a commit
        record (rewritten without it); keys written again since are left alone (their record is the new one)."""
        present = self.entries
        return [r[6] if r[6] is not None else page_key(r[0], r[1]) for r in recs
                if r[6] is not None or r[1] not in present.get(r[0], ())]

    def load_pages(self, node_id: str, pages: list[tuple[str, bytes, int, int, int, bytes | None]]) -> Effects:
        """Rebuild a node's entries from persisted records [(ns, key, offset, payload_len, gen, parent)], given in
        recency order (oldest first). Overlapping or out-of-range records, and keys already present, are dropped
        (returned as deletes). The node's space must exist and be empty. O(records log records)."""
        return self.load_entries(node_id, [Entry(ns, key, None, off, plen, gen, READY, parent, 0.0)
                                           for ns, key, off, plen, gen, parent in pages])

    def load_entries(self, node_id: str, ents: list[Entry]) -> Effects:
        """``load_pages`` of records already made into entries (READY, not filed: ``space`` None, parent named by
        key or None; ``persist.PageRecords`` makes them as it parses), in recency order. Entries it drops are left
        to the caller (unfiled). O(records log records).

        The rules: a key already present (another node's, or PENDING) takes no extent; the others' extents go to
        ``Allocator.rebuild_columns``, which rejects overlapping and out-of-range ones; of a key given twice the
        first record that fits is kept (the later one's extent is freed again). Each kept record is then filed as
        ``put_ready`` files one (``_link_ready``, ``policy.add``), batched (``_file_entries``).

        Fast path (a takeover's records: every key once, nothing overlapping): the extents of all records are
        rebuilt first, read in their given order at C level (``attrgetter``); when none is rejected, the keys already
        present are found while the entries are filed (one probe of the namespace's map per record, where a check
        beforehand cost a second, cold one: a fifth of the load) and their extents freed again, which leaves the
        allocator as if they had never taken one (only the order of its free lists may differ). Otherwise the
        exact steps above, in that order."""
        sp = self.spaces[node_id]
        fx = Effects()
        plens = list(map(_payload_len, ents))
        osize = {plen: extent_size(plen) for plen in set(plens)}  # the pages of a namespace share one
        alloc = sp.alloc
        skip = alloc.rebuild_columns(list(map(_offset, ents)), list(map(osize.__getitem__, plens)))
        if skip:
            ready, pend = self.ready, self.pending_keys
            keep = []
            r = pd = None
            last_ns = None
            for e in ents:
                ns, key = e.ns, e.key
                if ns is not last_ns:
                    last_ns = ns
                    r = ready.get(ns)
                    pd = pend.get(ns) if pend else None
                if (r is not None and key in r) or (pd is not None and key in pd):
                    fx.deletes.append((ns, key))
                else:
                    keep.append(e)
            ents = keep
            skip = alloc.rebuild_columns([e.offset for e in ents], [osize[e.payload_len] for e in ents])
        self._file_entries(sp, ents, set(skip) if skip else None, osize, fx)
        return fx

    def _file_entries(self, sp: NodeSpace, ents: list[Entry], skip: set | None, osize: dict[int, int],
                      fx: Effects) -> None:
        """``load_entries``' second half: each entry of ``ents`` (their extents allocated) not in ``skip`` (indexes
        of rejected ones: deletes) is filed on ``sp``, in order, unless its key is present (PENDING, or READY:
        another node's or an earlier record's) — then a delete and its extent freed. Each entry is linked as it is
        filed (``_link_ready``'s common case inlined: a child met before its parent waits as an orphan and is
        adopted when the parent comes, the links ``_link_ready`` after all of them would make), then all go to the
        policy (``add_many``, in order); the namespace's use is counted once per run of one namespace."""
        deletes = fx.deletes
        ready, pend = self.ready, self.pending_keys
        alloc = sp.alloc
        loaded: list[Entry] = []
        add_loaded = loaded.append
        orphans = self.orphans
        blind = self.policy.links_blind
        changed = self.policy.children_changed
        plens: dict[int, int] = {}  # payload_len -> its interned int
        if skip:
            deletes.extend((e.ns, e.key) for i, e in enumerate(ents) if i in skip)
            ents = [e for i, e in enumerate(ents) if i not in skip]
        r = pd = None
        last_ns = None
        used = 0
        for e in ents:
            ns = e.ns
            if ns is not last_ns:
                if ns != last_ns:
                    if used:
                        self._count(last_ns, used)
                        used = 0
                    last_ns = _intern(ns)
                    r = ready.get(last_ns)
                    if r is None:
                        r = ready[last_ns] = {}
                    pd = pend.get(last_ns) if pend else None
                if ns is not last_ns:
                    e.ns = last_ns
            key = e.key
            plen = e.payload_len
            if (pd is not None and key in pd) or r.setdefault(key, e) is not e:  # present: the record is dropped
                deletes.append((ns, key))
                alloc.free(e.offset, osize[plen])
                continue
            pl = plens.get(plen)
            if pl is None:
                pl = plens[plen] = self._plen(plen)
            if pl is not plen:
                e.payload_len = pl
            e.space = sp
            used += osize[plen]
            add_loaded(e)
            # _link_ready(e), inlined for a parent named by key (every loaded record's)
            parent = e.up
            if parent is not None:
                p = r.get(parent)
                if p is not None and p is not e and p.state == READY:
                    e.up = p
                    k = p.kids
                    if k is None:
                        p.kids = e
                        if p.pins == 0 and not blind and p.tier is not None:  # (unfiled: nothing to re-file)
                            changed(p)
                    elif type(k) is set:
                        k.add(e)
                    else:
                        p.kids = {k, e}
                else:
                    self._add_orphan(e)
            if orphans:
                o = orphans.get(last_ns)
                if o:
                    waiting = o.pop(key, None)
                    if waiting is not None:
                        self._adopt(e, o, waiting)
        if used:
            self._count(last_ns, used)
        sp.n += len(loaded)
        self.policy.add_many(loaded)
        if loaded and self.kv_sink is not None:  # a returning node's pages (metaserver/kvevents.py)
            self.kv_sink.stored(loaded)

    def put_ready(self, node_id: str, ns: str, key: bytes, offset: int, payload_len: int, gen: int,
                  parent: bytes | None) -> Entry | None:
        """Add one persisted page at its exact extent, as ``load_pages`` adds each record, at the recent end of its
        node's order (a warm standby replaying a commit). None, changing nothing, when the node has no space, the
        key is present or the extent is not free. O(1) (``Allocator.reserve``)."""
        sp = self.spaces.get(node_id)
        if sp is None or key in self.entries.get(ns, ()):
            return None
        if payload_len < 0 or not sp.alloc.reserve(offset, extent_size(payload_len)):
            return None
        ns = _intern(ns)
        e = Entry(ns, key, sp, offset, self._plen(payload_len), gen, READY, parent, 0.0)
        self.ready.setdefault(ns, {})[key] = e
        self._count(ns, extent_size(payload_len))
        sp.n += 1
        self._link_ready(e)
        self.policy.add(e)
        return e
