"""Prefix links of the page table, the ``prefix-lru`` victim order over them, and the KV events the table
reports (``TableLinks``, which ``metaserver.table.columns.PageTable`` holds as ``links``). No I/O.

Links (kept only under ``prefix-lru``: ``enable``): a READY row that names a parent is linked to the parent's row
exactly while that parent is READY, else it waits among the orphans to be adopted when the parent arrives. Two
columns, 8 bytes a row: ``up`` (u32: ``NO_UP``, no parent named; ``ORPHAN``, a parent named that is not READY; else
the parent's row + ``UP0``) and ``kids`` (u32: READY rows linked to this one). ``orphans`` maps (namespace index, the
parent's key digest) to [the parent's key, its orphans' rows]; a Python entry per orphan only (a chain whose head was
evicted or removed, a page committed before its parent), never per page. ``pending`` holds the parent key each
PENDING row's ALLOC named (KV events and commit records name it; links are made from it at the commit).

Invariants (``check``): ``kids[p]`` counts the READY rows whose ``up`` is p + ``UP0``, and such a p is READY; an
``ORPHAN`` row is READY and in ``orphans`` under exactly one parent that is not READY; a row that is not READY has
``up`` NO_UP and no kids.

prefix-lru: a prefix match stops at the first missing page, so per node victims come from three tiers, least
recently used first within each: 0, orphans (no prefix match reaches them); 1, leaves; 2, inner pages (another
cached page depends on them; an orphan with cached children is one too). The eviction scan
(``metaserver/table/evict.py``) orders a node's candidates by ``order`` = tier << 62 | stamp where it orders them by
stamp under ``lru``, and checks a queued candidate's key (``key``) as it checks its stamp. A row whose key falls
below the largest key of its node's queue after the queue was filled (a tier change: its last child left, its
parent left, it was adopted; or a use of a row of a lower tier than the queue reaches) is inserted into the queue
at its place (``requeue``), so victims leave in exact (tier, stamp) order.

Costs: a commit of n rows, O(n) numpy plus a dict step per row when ALLOC named parents, a Python step per orphan
and per adopted row; a row leaving, O(1) numpy amortised; a parent leaving with cached children, one O(rows)
numpy pass over the ``up`` column per batch (its children become orphans: a Python step each). Under prefix-lru
that is rare (inner pages go last); it is why links are not kept under ``lru``, where chain heads go first. A
requeue, O(1) numpy per touched row plus a bisect and a list insert per row it moves. The full load links in
batches as a commit does.

KV events (``metaserver/handlers/kvevents.py``): with ``kv_sink`` set on the table, each batch of rows that became READY
(a COMMIT, a returning node's pages) is one ``stored_keys(ns, keys, parents)`` call per namespace, and each batch
that left READY (evicted, removed, drained, dropped with a lost node) one ``removed_keys(ns, keys)`` per namespace;
``snapshot`` lists every READY page for a new term's announcement.

What it does not keep: under ``lru`` no links (commit records and a term's snapshot then name no parents; a later
load under prefix-lru treats those pages as leaves); a parked page's parent (its record comes back without one).
"""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

from metaserver.table.entry import READY
from metaserver.table.index import zeros
from transport.keyform import digests
from metaserver.table.nodes import UNIT_SHIFT

NO_UP = 0
ORPHAN = 1
UP0 = 2  # up = parent row + UP0
_TIERS = tuple(np.uint64(t << 62) for t in range(3))  # tier << 62, as u64 scalars (a where of them is u64)
_U0 = np.uint32(UP0)


class TableLinks:
    """Links, prefix-lru keys and KV events of one ``PageTable`` ``t``: see the module docstring."""

    def __init__(self, t) -> None:
        self.t = t
        self.linking = False
        self.pending: dict[int, bytes] = {}  # PENDING row -> its parent's key (stale entries: rows no longer PENDING)
        self.orphans: dict[tuple[int, bytes], list] = {}  # (nsix, parent digest) -> [parent key, set of rows]
        self.orphan_of: dict[int, tuple[int, bytes]] = {}  # orphan row -> its key in ``orphans``
        self._words: np.ndarray | None = None  # sorted first digest words of the orphans' parents (None: rebuild)
        self.qmax = np.zeros(0, np.uint64)  # by node index: the largest key its eviction queue was filled with

    def enable(self) -> None:
        """Keep links from now on (prefix-lru): the ``up`` and ``kids`` columns join the table's (grown with it)."""
        if self.linking:
            return
        t = self.t
        if t.ix.live:
            raise AssertionError("columns: links enabled on a table that holds rows")
        t.cols["up"] = zeros(t.rows, np.uint32)
        t.cols["kids"] = zeros(t.rows, np.uint32)
        self.linking = True

    # -- sort keys ------------------------------------------------------------------------------------------------
    def order(self, rows: np.ndarray) -> np.ndarray:
        """The prefix-lru victim key of each row (uint64): tier << 62 | stamp (the module docstring)."""
        c = self.t.cols
        t0, t1, t2 = _TIERS
        key = np.where(c["kids"].take(rows) > 0, t2, np.where(c["up"].take(rows) == ORPHAN, t0, t1))
        key |= c["stamp"].take(rows)
        return key

    def key(self, r: int) -> int:
        """``order`` of one row, for the victim check of a queued candidate."""
        c = self.t.cols
        tier = 2 if c["kids"][r] else 0 if c["up"][r] == ORPHAN else 1
        return tier << 62 | int(c["stamp"][r])

    def refilled(self, node, qmax: int) -> None:
        if node.ix >= len(self.qmax):
            self.qmax = np.concatenate((self.qmax, np.zeros(node.ix + 1 - len(self.qmax) + 16, np.uint64)))
        self.qmax[node.ix] = qmax

    def requeue(self, rows: np.ndarray) -> None:
        """``rows`` may have changed tier or been used: insert those whose key now falls below their node's queue's
        largest into the queue at their place (evictable ones only)."""
        if not len(rows) or not len(self.qmax):
            return
        t = self.t
        c = t.cols
        if len(self.qmax) < len(t.nodes):  # 0 for nodes never filled: every node index takes directly
            self.qmax = np.concatenate((self.qmax, np.zeros(len(t.nodes) - len(self.qmax) + 16, np.uint64)))
        nix = c["node"].take(rows)
        keys = self.order(rows)
        sel = keys < self.qmax.take(nix)
        if not sel.any():  # the usual case (a RELEASE's rows, stamped newest): no state or pins read
            return
        rows, keys, nix = rows[sel], keys[sel], nix[sel]
        ok = (c["state"].take(rows) == READY) & (c["pins"].take(rows) == 0)
        for r, k, n in zip(rows[ok].tolist(), keys[ok].tolist(), nix[ok].tolist()):
            self._queue(t.nodes[n], r, k)

    def _requeue_one(self, r: int) -> None:
        """``requeue`` of one row, in Python scalars (a victim's parent, a leaf now: once per such victim)."""
        c = self.t.cols
        n = int(c["node"][r])
        if n < len(self.qmax) and c["state"][r] == READY and not c["pins"][r]:
            k = self.key(r)
            if k < self.qmax[n]:
                self._queue(self.t.nodes[n], r, k)

    def _queue(self, node, r: int, k: int) -> None:
        """Insert row ``r`` of key ``k`` into ``node``'s queue at its place; the smallest key takes the consumed
        slot before ``qpos`` (O(1): a victim's parent, a leaf now, is the common case), others a list insert."""
        if node is None or node.dead or node.qpos >= len(node.queue):
            return
        t = self.t
        c = t.cols
        at = bisect_left(node.qstamp, k, node.qpos)
        if at < len(node.queue) and node.qstamp[at] == k and node.queue[at] == r:
            return  # queued with this key already
        off, code, ns = int(c["unit"][r]) << UNIT_SHIFT, int(t.code_arr[c["size"][r]]), int(c["ns"][r])
        if at == node.qpos and at > 0:
            at = node.qpos = at - 1
            node.queue[at], node.qstamp[at], node.qoff[at], node.qcode[at], node.qns[at] = r, k, off, code, ns
            return
        node.queue.insert(at, r)
        node.qstamp.insert(at, k)
        node.qoff.insert(at, off)
        node.qcode.insert(at, code)
        node.qns.insert(at, ns)

    # -- ALLOC, COMMIT, load -----------------------------------------------------------------------------------------
    def placed(self, rows: list[int], new: list[int], parents: list | None) -> None:
        """ALLOC made ``rows`` PENDING for keys ``new`` (positions): keep each one's parent key (``parents``)."""
        pend = self.pending
        if parents is None:
            if pend:
                for r in rows:
                    pend.pop(r, None)
            return
        for r, i in zip(rows, new):
            p = parents[i]
            if p is None:
                pend.pop(r, None)
            else:
                pend[r] = p

    def stored(self, ns: str, rows: np.ndarray) -> None:
        """``rows`` of ``ns`` became READY (a commit, in key order): link them, adopt their orphans, report them."""
        pend = self.pending
        pkeys = [pend.pop(r, None) for r in rows.tolist()] if pend else [None] * len(rows)
        if self.linking:
            self._link(np.full(len(rows), self.t.ns_ix[ns], np.uint16), rows, pkeys)
        sink = self.t.kv_sink
        if sink is not None and len(rows):
            sink.stored_keys(ns, [self.t.key_of(r) for r in rows.tolist()], pkeys)

    def loaded(self, nsix: np.ndarray, rows: np.ndarray, pkeys: list | None) -> None:
        """A load filed ``rows`` READY (namespaces ``nsix``, parents ``pkeys`` or None): as ``stored``."""
        if pkeys is None:
            pkeys = [None] * len(rows)
        if self.linking:
            self._link(nsix, rows, pkeys)
        sink = self.t.kv_sink
        if sink is not None and len(rows):
            names = self.t.ns_names
            for k in np.unique(nsix).tolist():
                at = np.flatnonzero(nsix == k)
                sink.stored_keys(names[k], [self.t.key_of(r) for r in rows.take(at).tolist()],
                                 [pkeys[i] for i in at.tolist()])

    def _link(self, nsix: np.ndarray, rows: np.ndarray, pkeys: list) -> None:
        t = self.t
        c = t.cols
        up, kids = c["up"], c["kids"]
        touched = [rows]
        has = [i for i, p in enumerate(pkeys) if p is not None]
        if has:
            at = np.array(has, np.int64)
            ch = rows.take(at)
            pk = [pkeys[i] for i in has]
            pdig, _ = digests(pk)
            cns = nsix.take(at)
            prow = np.full(len(at), -1, np.int64)
            for k in np.unique(cns).tolist():
                w = np.flatnonzero(cns == k)
                prow[w] = t.ix.find(k, pdig if len(w) == len(at) else pdig[w], c["ns"])
            ok = (prow >= 0) & (c["state"].take(np.maximum(prow, 0)) == READY) & (prow != ch)
            if ok.any():
                up[ch[ok]] = (prow[ok] + UP0).astype(np.uint32)
                np.add.at(kids, prow[ok], 1)
                touched.append(prow[ok])
            for j in np.flatnonzero(~ok).tolist():
                self._orphan(int(ch[j]), int(cns[j]), pdig[j].tobytes(), pk[j])
        if self.orphans:  # adopt the orphans that wait for one of these rows
            words = self._orphan_words()
            dig = t.ix.kc.take(rows, axis=0)
            for j in np.flatnonzero(np.isin(dig[:, 0], words)).tolist():
                r = int(rows[j])
                got = self.orphans.pop((int(nsix[j]), dig[j].tobytes()), None)
                if got is None:
                    continue
                self._words = None
                adopted = []
                for kid in got[1]:
                    del self.orphan_of[kid]
                    if kid == r:  # names itself: stays an orphan
                        self._orphan(kid, int(nsix[j]), dig[j].tobytes(), got[0])
                    else:
                        adopted.append(kid)
                if adopted:
                    a = np.array(adopted, np.int64)
                    up[a] = r + UP0
                    kids[r] += len(adopted)
                    touched.append(a)
        self.requeue(np.unique(np.concatenate(touched)))

    def _orphan(self, r: int, nsix: int, pdig: bytes, pkey: bytes) -> None:
        self.t.cols["up"][r] = ORPHAN
        k = (nsix, pdig)
        got = self.orphans.get(k)
        if got is None:
            self.orphans[k] = [pkey, {r}]
            self._words = None
        else:
            got[1].add(r)
        self.orphan_of[r] = k

    def _orphan_words(self) -> np.ndarray:
        if self._words is None:
            self._words = np.unique(np.frombuffer(b"".join(k[1][:8] for k in self.orphans), np.uint64))
        return self._words

    # -- rows leaving READY ------------------------------------------------------------------------------------------
    def leaving(self, rows: np.ndarray) -> None:
        """``rows`` leave READY (evicted, removed, drained, dropped; still in the key index): unlink them, orphan
        their children, report them."""
        t = self.t
        if t.kv_sink is not None and len(rows):
            nss = t.cols["ns"].take(rows)
            for k in np.unique(nss).tolist():
                t.kv_sink.removed_keys(t.ns_names[k], [t.key_of(r) for r in rows[nss == k].tolist()])
        if self.linking and len(rows):
            self._unlink(rows)

    def evicted(self, r: int) -> None:
        """Victim ``r`` leaves now (its ``leaving`` comes with the request's others): its links are undone at once,
        so its parent, a leaf now, is the next victim's candidate at its place. The common cases in Python scalars;
        a victim with children (rare under prefix-lru) as ``leaving``."""
        c = self.t.cols
        up, kids = c["up"], c["kids"]
        if kids[r] or up[r] == ORPHAN:
            self._unlink(np.array([r], np.int64))
            return
        u = int(up[r])
        if u >= UP0:
            up[r] = NO_UP
            p = u - UP0
            kids[p] -= 1
            if not kids[p]:
                self._requeue_one(p)

    def _unlink(self, rows: np.ndarray) -> None:
        t = self.t
        c = t.cols
        up, kids = c["up"], c["kids"]
        u = up.take(rows)
        lk = u >= UP0
        parents = (u[lk] - _U0).astype(np.int64)
        if len(parents):
            np.subtract.at(kids, parents, 1)
        for r in rows[u == ORPHAN].tolist():
            k = self.orphan_of.pop(r)
            got = self.orphans[k]
            got[1].discard(r)
            if not got[1]:
                del self.orphans[k]
                self._words = None
        up[rows] = NO_UP
        par = rows[kids.take(rows) > 0]
        kids[rows] = 0
        moved = self._orphan_kids(par) if len(par) else np.zeros(0, np.int64)
        self.requeue(np.unique(np.concatenate((parents[kids.take(parents) == 0], moved))))

    def _orphan_kids(self, par: np.ndarray) -> np.ndarray:
        """The children of leaving rows ``par`` become orphans (one pass over the ``up`` column); returns them."""
        t = self.t
        c = t.cols
        top = t.blocks_used * t.block
        up = c["up"][:top]
        mark = np.zeros(t.rows + UP0, bool)
        mark[par + UP0] = True
        kids = np.flatnonzero(mark.take(up))
        pr = (up.take(kids) - _U0).astype(np.int64)
        for p in np.unique(pr).tolist():
            nsix = int(c["ns"][p])
            pdig = t.ix.kc[p].tobytes()
            pkey = t.key_of(p)
            for kid in kids[pr == p].tolist():
                self._orphan(kid, nsix, pdig, pkey)
        return kids

    # -- what records, events and checks read ------------------------------------------------------------------------
    def parent_keys(self, rows: np.ndarray) -> list:
        """The parent key each READY row names (None: none, or links not kept)."""
        if not self.linking:
            return [None] * len(rows)
        t = self.t
        out = []
        for u, r in zip(t.cols["up"].take(rows).tolist(), rows.tolist()):
            if u >= UP0:
                out.append(t.key_of(u - UP0))
            elif u == ORPHAN:
                out.append(self.orphans[self.orphan_of[r]][0])
            else:
                out.append(None)
        return out

    def snapshot(self) -> list[tuple[str, list, list]]:
        """(namespace, keys, parent keys) of every READY row not on a detached node, by namespace, oldest first
        (a chain's pages stay together: they are stamped in key order)."""
        t = self.t
        c = t.cols
        top = t.blocks_used * t.block
        rows = np.flatnonzero(c["state"][:top] == READY)
        if t.dying:
            rows = rows[~t.dead.take(c["node"].take(rows))]
        rows = rows[np.argsort(c["stamp"].take(rows), kind="stable")]
        nss = c["ns"].take(rows)
        out = []
        for k in np.unique(nss).tolist():
            rs = rows[nss == k]
            out.append((t.ns_names[k], [t.key_of(r) for r in rs.tolist()], self.parent_keys(rs)))
        return out

    def check(self) -> None:
        if not self.linking:
            return
        t = self.t
        c = t.cols
        top = t.blocks_used * t.block
        state = c["state"][:top]
        up = c["up"][:top].astype(np.int64)
        kids = c["kids"][:top].astype(np.int64)
        ready = state == READY
        assert not np.any(up[~ready]) and not np.any(kids[~ready]), "columns: a row not READY keeps links"
        linked = np.flatnonzero(up >= UP0)
        p = up[linked] - UP0
        assert np.all(state.take(p) == READY), "columns: a row is linked to a parent that is not READY"
        want = np.bincount(p, minlength=top)[:top]
        assert np.array_equal(want, kids), "columns: kids counts and links disagree"
        orph = np.flatnonzero(up == ORPHAN).tolist()
        assert sorted(self.orphan_of) == orph, "columns: orphan rows and the orphans map differ"
        for (nsix, pdig), (_pkey, members) in self.orphans.items():
            assert members, "columns: an empty orphans entry"
            prow = t.ix.find(nsix, np.frombuffer(pdig, np.uint64).reshape(1, 4), c["ns"])[0]
            assert prow < 0 or state[prow] != READY or members == {prow}, "columns: an orphan's parent is READY"
            for r in members:
                assert self.orphan_of[r] == (nsix, pdig), "columns: an orphan filed twice"
