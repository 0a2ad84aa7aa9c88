"""Commit records of the page table (``CommitRecords``, the part ``metaserver.table.columns.PageTable`` holds as
``commits``): COMMITs' pages as etcd records, segments (``metaserver/table/records.py`` packs them), kept in step
with the rows. No I/O.

Group commit: a COMMIT's newly READY rows of one namespace join that namespace's open segment, a record the writer
has not taken yet, while it holds fewer than ``segment_pages`` (``records.SEGMENT_PAGES`` = 1,024; ``BATCH_PAGES``
= 128 once the table holds a key that is not its own digest, so a record of long keys stays far below a
transaction's ``TXN_BYTES``), then new records; each is one etcd key named by ``namer(ns)`` (the metaserver sets
``EtcdStore.batch_name``; the default names them with a count), and each row's ``rec`` column names its record (0:
none). Every COMMIT that joins a record puts it again; the batch writer's queue keeps one op a key and merges the
puts' waiters (``metaserver/store/batcher.py``), so a COMMIT is answered once the segment holding its pages is durable,
and the COMMITs that arrive while the writer is busy (its transactions in flight) share one record: the window is
the writer's own round trip, nothing waits for a timer when etcd is idle. The writer closes a record as it takes it
(``TableRecord.value``): no COMMIT joins it after.

What etcd holds of a record is its value less the pages dead lists name. A row that leaves (evicted, removed,
dropped with its node unparked; a parked row leaves without either: its page stays in etcd for the node's return)
is named by the open dead-list record (``_dead_list``: a segment of no page, its own etcd key, which every death
joins until the writer takes it: one small put a pass of evictions, whatever records it touches) unless its record
is rewritten anyway: its put waits unsent (merged, no op), or half the pages its value lists are gone
(compaction). This is the one way a removal reaches etcd (a load still reads the records of releases before dead
lists, each rewritten at every death: version-2 segments). A value is encoded when the writer takes it, from the
rows left; with none left it is None (delete the key) and the record's id is freed. Either way it is a removal
(``TableRecord.shrunk``): the batch writer holds ALLOC answers until it is durable, since their places may lie in
the freed extents (``BatchWriter.removals_durable``). A dead-list record is needed until each record it names has a
value taken after those deaths durable (``TableRecord.written``, the writer's hook); then its key is kept for the
next one to overwrite (``DEAD_KEYS_FREE``) or deleted. A load compacts the records dead lists name and drops the
lists after (``adopt_dead``).
Parents (the parent's key) are written under ``prefix-lru`` only (``lru`` keeps no links:
``metaserver/table/links.py``).

``MetaserverConfig.commit = "async"`` (``umbp metaserver --commit async``) answers a COMMIT before its record is in
etcd. A crash (or a deposed leader) then loses the pages of the records not yet written: the next term's full load
does not have them, so they are misses, never wrong bytes: their extents are free in the next term and may hold
other objects, but every read checks the object header's key hash and generation against the directory's
(``objformat.check_object_header``, the client's array check), the next term's generations are above every one handed
out before (``metaserver/store/generations.py`` reserves ranges in etcd first), the nodes' write ledgers admit the new
objects' writes by those newer generations (``umbp/node/ledger.py``), and the writer of a lost page finished writing it
before its COMMIT (so no late write of it can land on a new object: a writer still writing has no COMMIT, which is
the quarantine's case, ``metaserver/table/quarantine.py``). A client that remembered a lost page's location reads another
object's header there and counts a miss. If the writer gives a write up (etcd down past ``persist_retry_s``) the
leader steps down, as with durable commits.

The table collects the records to put and to rewrite as its mutations run; the caller takes them after each request
(``CommitRecords.take``; ``TableDirectory.effects``) and hands them to the writer. A full load files its rows under the
records they came from, by name (``CommitRecords.adopt``).

Costs: a COMMIT's assignment O(rows) numpy (an open segment joined: one concatenation of its rows); rows leaving
O(rows log rows) numpy (grouped by record) and O(1) Python a record touched; etcd: a pass of evictions one dead-list
put (8 bytes a death, a record's etcd key a record named) and, amortized, a compaction rewrite of a record each
time half its listed pages are gone (``bench/records.py --evict``); a value O(its rows) numpy (the keys one gather
of the key index's digests unless a key is long; parents a key a row).
"""

from __future__ import annotations

import numpy as np

from metaserver.table.entry import READY, factor
from metaserver.table.records import BATCH_MARK, BATCH_PAGES, SEGMENT_PAGES, pack_segment

DEAD_LIST_MAX = 16384  # deaths a dead-list record holds at most (128 KiB of generations: far below TXN_BYTES)
DEAD_LIST_RECORDS = 4096  # records one names at most (their etcd keys: about 100 KiB; the index is a u16)
DEAD_KEYS_FREE = 64  # dead-list keys needed no more that are kept to overwrite, at most (the rest are deleted)


class TableRecord:
    """One commit record: its etcd key (``name``), namespace, id (the ``rec`` column's value) and the rows it was
    written with (trimmed to the live ones at each ``value``). A dead-list record (``CommitRecords._dead_list``) is
    one too, with id 0, no rows and ``carry``: the deaths it names (a record read with a dead list of its own
    carries it likewise until ``need`` is empty)."""

    __slots__ = ("commits", "id", "name", "ns", "rows", "dead", "open", "shrunk", "queued", "listed", "gone", "deads",
                 "covering", "carry", "need", "taken", "again")

    def __init__(self, commits, rid: int, name: bytes, ns: str, rows: np.ndarray):
        self.commits = commits  # the ``CommitRecords`` it belongs to
        self.id = rid
        self.name = name
        self.ns = ns
        self.rows = rows
        self.dead = False
        self.open = False  # later COMMITs of its namespace may still join it (group commit: until ``value``)
        self.shrunk = False  # pages left it since the writer last queued it: its rewrite is a removal (batcher.py)
        self.queued = False  # a put of it waits in the writer's queue, its value not taken yet (``value``)
        self.listed = len(rows)  # pages its value in etcd lists (as of the last one taken)
        self.gone = 0  # of those, pages that left since, named by dead lists instead of a rewrite
        self.deads: list = []  # dead-list records naming pages of it since its last value was taken
        self.covering: list = []  # those its value in flight covers (``written``)
        self.carry: _Carry | None = None  # a dead list its value carries (a dead-list record's own list)
        self.need: set = set()  # the records ``carry`` names whose value without those pages is not durable yet
        self.taken = False  # a value of it was taken (written or in flight)
        self.again = False  # requeued by ``written`` once ``need`` emptied (a delete, or a rewrite without carry)

    def live(self) -> np.ndarray:
        """The rows the record holds now (and keeps only those): READY under this record, on a node not detached."""
        if self.dead:
            return self.rows[:0]
        t = self.commits.table
        c = t.cols
        rows = self.rows
        if not len(rows):
            return rows
        rows = self.rows = rows[(c["rec"].take(rows) == self.id) & (c["state"].take(rows) == READY)
                                & ~t.dead.take(c["node"].take(rows))]
        return rows

    def value(self) -> bytes | None:
        """The record's value now (a segment, ``records.pack_segment``, with its dead list while it carries one
        still needed); None (delete it) when no row and no needed dead list is left, and then the record is done for
        good. The writer calls it as it takes the record: no COMMIT joins it after, and the dead lists naming it so
        far are covered once this value is durable (``written``)."""
        c = self.commits
        if self.open:
            self.open = False
            if c._open.get(self.ns) is self:
                del c._open[self.ns]
        if c._dead_open is self:
            c._dead_open = None
        self.queued = False
        self.taken = True
        rows = self.live()
        self.covering, self.deads = self.deads, []
        self.gone = 0
        self.listed = len(rows)
        carry = self.carry if self.need else None
        if carry is None:
            self.carry = None
            if not len(rows):
                c.end(self)
                return None
        return c.value(rows, carry)

    def written(self) -> list:
        """The value taken last is durable (the batch writer's hook): the dead lists it covers no longer need this
        record. Returns the records to queue again: dead-list records needed no more (deleted now), and a record
        carrying a dead list no longer needed (rewritten without it). No I/O."""
        out = []
        for d in self.covering:
            d.need.discard(self)
            if not d.need and d.carry is not None and d.taken and not d.again:
                self.commits._dead_done(d, out)  # (not taken yet: its value, when taken, leaves the list out)
        self.covering = []
        if self.carry is not None and not self.need and not self.again:
            self.commits._dead_done(self, out)
        elif self.again and self.carry is None:
            self.again = False
        return out

    def __repr__(self) -> str:
        return f"TableRecord({self.name!r}, {len(self.rows)} rows)"


class _Carry:
    """A dead list as a record carries it: its records' etcd keys (``names``), and per death (u64 generations
    ``gens``, u16 ``ix``: an index in ``names``), built in pieces (``add``) and joined once (``arrays``)."""

    __slots__ = ("names", "of", "gens", "ix", "n")

    def __init__(self):
        self.names: list[bytes] = []
        self.of: dict[bytes, int] = {}
        self.gens: list[np.ndarray] = []
        self.ix: list[np.ndarray] = []
        self.n = 0

    def add(self, name: bytes, gens: np.ndarray) -> None:
        i = self.of.get(name)
        if i is None:
            i = self.of[name] = len(self.names)
            self.names.append(name)
        self.gens.append(np.asarray(gens, np.uint64))
        self.ix.append(np.full(len(gens), i, np.uint16))
        self.n += len(gens)

    def arrays(self) -> tuple[list[bytes], np.ndarray, np.ndarray]:
        if len(self.gens) != 1:
            self.gens = [np.concatenate(self.gens)] if self.gens else [np.zeros(0, np.uint64)]
            self.ix = [np.concatenate(self.ix)] if self.ix else [np.zeros(0, np.uint16)]
        return self.names, self.gens[0], self.ix[0]


class CommitRecords:
    """Commit records of a ``PageTable`` (its ``commits``): see the module docstring. Reads the table's ``cols``,
    ``ix``, ``links``, ``node_names`` and ``code_arr``."""

    def __init__(self, table):
        self.table = table
        self.namer = self._count_name  # ns -> a new record's etcd key
        self.records: dict[int, TableRecord] = {}  # id -> record
        self._free: list[int] = []
        self._next = 1
        self._seq = 0
        self._puts: list[TableRecord] = []
        self.rewrites: dict[TableRecord, None] = {}
        self.by_name: dict[bytes, TableRecord] = {}  # live records by etcd key (a load, a node's return)
        self._open: dict[str, TableRecord] = {}  # ns -> its open segment: queued, not yet taken by the writer
        self.committed_pages = 0  # rows filed under records by COMMITs
        self.segment_pages = SEGMENT_PAGES  # pages a segment holds at most (``BATCH_PAGES`` once a key is long)
        self._dead_open: TableRecord | None = None  # the dead-list record deaths join until the writer takes it
        self._dead_free: list[bytes] = []  # keys of dead-list records needed no more, to overwrite (``_dead_done``)
        self.dead_pages = 0  # rows that left named by a dead list instead of a rewrite (STATS, bench/records.py)

    def _count_name(self, ns: str) -> bytes:
        self._seq += 1
        return b"%s/%s%x" % (ns.encode(), BATCH_MARK, self._seq)

    def committed(self, ns: str, rows: np.ndarray) -> None:
        """``rows`` (of ``ns``, in key order) became READY: file them under the namespace's open segment while it
        has room (group commit: the COMMITs that reach the writer while it is busy share one record; the caller
        puts the record again and the writer's queue merges the puts, their waiters together), then under new
        ones (and link them: ``metaserver/table/links.py``)."""
        t = self.table
        t.links.stored(ns, rows)
        self.committed_pages += len(rows)
        cap = self.segment_pages if not t.ix.long_keys else BATCH_PAGES  # long keys: keep a record small
        lo = 0
        r = self._open.get(ns)
        if r is not None and r.open and not r.dead and len(r.rows) < cap:
            lo = min(len(rows), cap - len(r.rows))
            r.rows = np.concatenate((r.rows, rows[:lo]))
            t.cols["rec"][rows[:lo]] = r.id
            r.queued = True
            self._puts.append(r)
        while lo < len(rows):
            part = rows[lo:lo + cap]
            lo += len(part)
            r = self._new(self.namer(ns), ns, part)
            r.open = r.queued = True
            self._open[ns] = r
            self._puts.append(r)

    def _new(self, name: bytes, ns: str, rows: np.ndarray) -> TableRecord:
        t = self.table
        if self._free:
            rid = self._free.pop()
        else:
            rid = self._next
            self._next += 1
            if rid > np.iinfo(np.uint32).max:  # 4 G records live at once: far past any arena's pages
                raise OverflowError("columns: record ids past the u32 rec column")
        r = self.records[rid] = TableRecord(self, rid, name, ns, rows)
        t.cols["rec"][rows] = rid
        self.by_name[name] = r
        return r

    def adopt(self, names: list, rows: np.ndarray, rejected: list) -> None:
        """A full load filed ``rows`` (READY, of one node, in commit order) from the records named ``names`` (the
        etcd key of each row's commit record; None: a page record of its own): file each row under a record of that
        name, the same one for every node's rows of it, so evicting one rewrites the record it came from; the names
        in ``rejected`` (pages the load refused) are rewritten without them now (a record left with no page:
        deleted). A record's rows share its revision, so in commit order they are runs: one step a run."""
        t = self.table
        by = self.by_name
        if len(rows):
            arr = np.array(names, dtype=object)
            cut = np.flatnonzero(arr[1:] != arr[:-1]) + 1
            for lo, hi in zip(np.concatenate(([0], cut)).tolist(), np.concatenate((cut, [len(arr)])).tolist()):
                name = names[lo]
                if name is None:
                    continue
                rec = by.get(name)
                if rec is None:
                    ns = t.ns_names[int(t.cols["ns"][rows[lo]])]
                    rec = by[name] = self._new(name, ns, rows[lo:hi])
                else:
                    rec.rows = np.concatenate((rec.rows, rows[lo:hi]))
                    t.cols["rec"][rows[lo:hi]] = rec.id
                    rec.listed = len(rec.rows)
        for name in dict.fromkeys(rejected):
            if name is None:
                continue
            rec = by.get(name)
            if rec is None:  # none of its pages was filed (so far): an empty record, deleted by its rewrite
                rec = by[name] = self._new(name, "", np.zeros(0, np.int64))
            rec.shrunk = rec.queued = True  # a rejected page's extent may be free: placed once this is durable
            self.rewrites[rec] = None

    def leaving(self, rows: np.ndarray) -> None:
        """``rows`` leave READY (evicted, removed, dropped): their links are undone (``metaserver/table/links.py``)
        and etcd must stop listing them, a removal either way (``TableRecord.shrunk``: the batch writer holds ALLOC
        answers until it is durable, ``BatchWriter.removals_durable``). A record is rewritten without them when its
        put waits unsent anyway (merged: no op) or when half the pages its value lists are gone (compaction; none
        left: deleted); else their generations join the open dead-list record
        (``_dead_list``), one small etcd value for every death until the writer takes it. O(rows log rows) numpy
        (grouped by record), O(1) Python a record touched."""
        if not len(rows):
            return
        t = self.table
        t.links.leaving(rows)
        rec = t.cols["rec"]
        ids = rec.take(rows)
        rec[rows] = 0
        order = np.argsort(ids, kind="stable")
        ids = ids.take(order)
        cut = np.flatnonzero(ids[1:] != ids[:-1]) + 1
        los = np.concatenate(([0], cut)).tolist()
        his = np.concatenate((cut, [len(ids)])).tolist()
        gens = None
        records, rewrites = self.records, self.rewrites
        for lo, hi in zip(los, his):
            rid = int(ids[lo])
            if not rid:
                continue
            r = records[rid]
            k = hi - lo
            if r.queued or r.carry is not None or (r.gone + k) * 2 >= r.listed:
                r.shrunk = r.queued = True  # their extents may be placed again: not before this is durable
                rewrites[r] = None
                continue
            if gens is None:
                gens = t.cols["gen"].take(rows.take(order))
            r.gone += k
            self.dead_pages += k
            self._dead_list(r).carry.add(r.name, gens[lo:hi])

    def _dead_list(self, r: TableRecord) -> TableRecord:
        """The open dead-list record, now naming ``r`` (made, and queued, when none is open or it is full): a
        segment of no page (``records.pack_segment``), its own etcd key, needed until every record it names has a
        value without those pages durable (``TableRecord.written``), then deleted."""
        d = self._dead_open
        if d is None or d.carry.n >= DEAD_LIST_MAX or len(d.carry.names) >= DEAD_LIST_RECORDS:
            name = self._dead_free.pop() if self._dead_free else self.namer(r.ns)  # a key retired: overwritten
            d = self._dead_open = TableRecord(self, 0, name, r.ns, np.zeros(0, np.int64))
            d.carry = _Carry()
        if r not in d.need:
            d.need.add(r)
            r.deads.append(d)
        d.queued = d.shrunk = True
        self.rewrites[d] = None  # (again: the writer's queue merges it; the submission marks the removal)
        return d

    def _dead_done(self, d: TableRecord, out: list) -> None:
        """Dead-list record ``d`` is needed no more (every record it names is durable without its pages): its key
        is kept for the next dead list to overwrite (one put a pass instead of a put and a delete) while fewer than
        ``DEAD_KEYS_FREE`` wait so, else ``d`` goes to ``out``, queued again: deleted (a record carrying pages:
        rewritten without the list). What a kept key still holds names only pages gone from their records' values
        in etcd (generations are never reused), which a load applies to nothing."""
        if d.id == 0 and not len(d.rows) and len(self._dead_free) < DEAD_KEYS_FREE and not d.dead:
            d.carry, d.dead = None, True
            self._dead_free.append(d.name)
            return
        d.again = True
        out.append(d)

    def adopt_dead(self, carried: dict, present) -> None:
        """A load (or a warm copy's takeover) read the dead lists ``carried`` (a record's etcd key -> (names,
        gens, ix): its dead list, ``snapshot.PageRecords.carried``) among the records ``present`` in etcd: each
        record a list names counts those deaths as gone from its value, so its next death compacts it sooner (an
        entry of a key kept to overwrite may name a page its record no longer lists: counted all the same, which
        only hastens a compaction); one with none of its pages filed is deleted now; and the list is needed until
        each has a new value (its key then kept to overwrite, or a record carrying pages rewritten without it).
        Nothing is rewritten for the lists, so a takeover costs no etcd work a page. The table's own dead-list state is reset first (a warm
        copy's table made some, never written). O(records + dead entries)."""
        self._dead_open = None
        self._dead_free = []
        for r in self.records.values():
            r.deads, r.covering, r.gone, r.queued, r.carry, r.need, r.again = [], [], 0, False, None, set(), False
            r.listed = len(r.rows)
        by = self.by_name
        lost: list[bytes] = []
        for cname, (names, _, ix) in carried.items():
            counts = np.bincount(ix, minlength=len(names)).tolist() if len(names) > 1 else [len(ix)]
            for n, k in zip(names, counts):
                r = by.get(n) if n != cname else None
                if r is None or not len(r.live()):
                    if n in present and n != cname:
                        lost.append(n)
                    continue
                r.gone += k
                r.listed += k
        self.adopt([], np.zeros(0, np.int64), lost)  # nothing of them filed: deleted
        for cname, (names, gens, ix) in carried.items():
            c = by.get(cname)
            if c is None:  # a dead list alone (or all its pages gone)
                c = TableRecord(self, 0, cname, "", np.zeros(0, np.int64))
            carry = _Carry()
            for j, n in enumerate(names):
                carry.add(n, gens[ix == j] if len(names) > 1 else gens)
            c.carry, c.taken = carry, True
            for n in names:
                r = by.get(n) if n != cname else None
                if r is not None and n in present:
                    c.need.add(r)
                    r.deads.append(c)
            if not c.need:
                out: list = []
                self._dead_done(c, out)
                for x in out:
                    x.queued = True
                    self.rewrites[x] = None

    def end(self, r: TableRecord) -> None:
        if not r.dead:
            r.dead = True
            if r.id:  # (a dead-list record has none)
                del self.records[r.id]
                self._free.append(r.id)
            if self.by_name.get(r.name) is r:
                del self.by_name[r.name]
            if r.open and self._open.get(r.ns) is r:
                del self._open[r.ns]
            r.open = False

    def take(self) -> tuple[list[TableRecord], list[TableRecord]]:
        """(records to put, records to rewrite) since the last call: the etcd work of the requests in between."""
        puts, self._puts = list(dict.fromkeys(self._puts)), []  # (an open segment joined by several)
        rewrites = [r for r in self.rewrites if not r.dead]
        self.rewrites = {}
        return puts, rewrites

    def value(self, rows: np.ndarray, carry: "_Carry | None" = None) -> bytes:
        """The segment of ``rows`` (``records.pack_segment``) with ``carry``'s dead list: O(rows) numpy, the keys
        one gather of the key index's digests when every key is its own digest (else a key a row), parents only
        under prefix-lru."""
        t = self.table
        c = t.cols
        ns_u, nsix, _ = factor(c["ns"].take(rows))  # (a bincount each: np.unique's sorts were 70 % of a value)
        node_u, nodeix, _ = factor(c["node"].take(rows))
        code_u, codeix, _ = factor(c["size"].take(rows))
        long_keys = t.ix.long_keys
        lens = digs = None
        dig = t.ix.kc.take(rows, axis=0)
        if long_keys and long_keys.any_of(rows):
            keys = t.ix.keys_of(rows)
            lens = np.fromiter(map(len, keys), np.uint32, len(keys))
            blob = b"".join(keys)
            digs = dig  # so a load hashes none of them again
        else:
            blob = dig.tobytes()
        parents = None
        if t.links.linking:
            parents = t.links.parent_keys(rows)
            if all(p is None for p in parents):
                parents = None
        return pack_segment([t.ns_names[i] for i in ns_u.tolist()], nsix, t.node_names.take(node_u).tolist(),
                            nodeix, c["unit"].take(rows), t.code_arr.take(code_u), codeix, c["gen"].take(rows),
                            blob, 32, lens, parents, digs=digs,
                            **({} if carry is None else dict(zip(("dead_recs", "dead", "dead_ix"), carry.arrays()))))
