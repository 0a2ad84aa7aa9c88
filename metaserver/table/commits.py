"""Commit records of the page table (``TableRecords``, a mixin of ``metaserver.table.columns.PageTable``): COMMITs' pages
as etcd records, segments (``metaserver/table/records.py`` packs them), kept in step with the rows. No I/O.

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

A record holds exactly its rows still READY under it on a live node: a row that leaves (evicted, removed, dropped
with its node unparked) queues a rewrite of its record (a parked row leaves it without one: its page stays in etcd
for the node's return), and the value, encoded when the etcd writer takes it, lists the rows left; with none left
it is None (delete the key) and the record's id is freed. A burst of evictions of one record is one rewrite. Such a
rewrite is a removal (``TableRecord.shrunk``): the batch writer holds ALLOC answers until it is durable, since their
places may lie in the freed extents (``BatchWriter.removals_durable``).
Parents (the parent's key) are written under ``prefix-lru`` only (``lru`` keeps no links:
``metaserver/table/links.py``).

``MetaserverConfig.commit = "async"`` (``umbp metaserver --commit async``) answers a COMMIT before its record is in
etcd. A crash (or a deposed leader) then loses the pages of the records not yet written: the next term's full load
does not have them, so they are misses, never wrong bytes: their extents are free in the next term and may hold
other objects, but every read checks the object header's key hash and generation against the directory's
(``wire.check_object_header``, the client's array check), the next term's generations are above every one handed
out before (``metaserver/store/generations.py`` reserves ranges in etcd first), the nodes' write ledgers admit the new
objects' writes by those newer generations (``umbp/node/ledger.py``), and the writer of a lost page finished writing it
before its COMMIT (so no late write of it can land on a new object: a writer still writing has no COMMIT, which is
the quarantine's case, ``metaserver/table/quarantine.py``). A client that remembered a lost page's location reads another
object's header there and counts a miss. If the writer gives a write up (etcd down past ``persist_retry_s``) the
leader steps down, as with durable commits.

The table collects the records to put and to rewrite as its mutations run; the caller takes them after each request
(``take_records``; ``TableDirectory.effects``) and hands them to the writer. A full load files its rows under the
records they came from, by name (``adopt_records``).

Costs: a COMMIT's assignment O(rows) numpy (an open segment joined: one concatenation of its rows); rows leaving
O(rows) numpy (the unique record ids among them); a value O(its rows) numpy (the keys one gather of the key index's
digests unless a key is long; parents a key a row).
"""

from __future__ import annotations

import numpy as np

from metaserver.table.entry import PART_MASK, READY, SHARD_SHIFT
from metaserver.table.records import BATCH_MARK, BATCH_PAGES, SEGMENT_PAGES, pack_segment


class TableRecord:
    """One commit record: its etcd key (``name``), namespace, id (the ``rec`` column's value) and the rows it was
    written with (trimmed to the live ones at each ``value``)."""

    __slots__ = ("table", "id", "name", "ns", "rows", "dead", "open", "shrunk")

    def __init__(self, table, rid: int, name: bytes, ns: str, rows: np.ndarray):
        self.table = table
        self.id = rid
        self.name = name
        self.ns = ns
        self.rows = rows
        self.dead = False
        self.open = False  # later COMMITs of its namespace may still join it (group commit: until ``value``)
        self.shrunk = False  # pages left it since the writer last queued it: its rewrite is a removal (batcher.py)

    def live(self) -> np.ndarray:
        """The rows the record holds now (and keeps only those): READY under this record, on a node not detached."""
        if self.dead:
            return self.rows[:0]
        t = self.table
        c = t.cols
        rows = self.rows
        rows = self.rows = rows[(c["rec"].take(rows) == self.id) & (c["state"].take(rows) == READY)
                                & ~t.dead.take(c["node"].take(rows))]
        return rows

    def value(self) -> bytes | None:
        """The record's value now (a segment, ``records.pack_segment``); None (delete it) when no row is left, and
        then the record is done for good. The writer calls it as it takes the record: no COMMIT joins it after."""
        if self.open:
            self.open = False
            if self.table._rec_open.get(self.ns) is self:
                del self.table._rec_open[self.ns]
        rows = self.live()
        if not len(rows):
            self.table._end_record(self)
            return None
        return self.table.record_value(rows)

    def __repr__(self) -> str:
        return f"TableRecord({self.name!r}, {len(self.rows)} rows)"


class TableRecords:
    """Commit records of a ``PageTable``: see the module docstring. Uses the table's ``cols``, ``ix``, ``node_names``
    and ``code_arr``."""

    def _init_records(self) -> None:
        self.namer = self._count_name  # ns -> a new record's etcd key
        self.records: dict[int, TableRecord] = {}  # id -> record
        self._rec_free: list[int] = []
        self._rec_next = 1
        self._rec_seq = 0
        self._rec_puts: list[TableRecord] = []
        self._rec_rewrites: dict[TableRecord, None] = {}
        self._rec_by_name: dict[bytes, TableRecord] = {}  # live records by etcd key (a load, a node's return)
        self._rec_open: dict[str, TableRecord] = {}  # ns -> its open segment: queued, not yet taken by the writer
        self.committed_pages = 0  # rows filed under records by COMMITs
        self.segment_pages = SEGMENT_PAGES  # pages a segment holds at most (``BATCH_PAGES`` once a key is long)

    def _count_name(self, ns: str) -> bytes:
        self._rec_seq += 1
        return b"%s/%s%x" % (ns.encode(), BATCH_MARK, self._rec_seq)

    def _committed(self, ns: str, rows: np.ndarray) -> None:
        """``rows`` (of ``ns``, in key order) became READY: file them under the namespace's open segment while it
        has room (group commit: the COMMITs that reach the writer while it is busy share one record; the caller
        puts the record again and the writer's queue merges the puts, their waiters together), then under new
        ones (and link them: ``metaserver/table/links.py``)."""
        self.links.stored(ns, rows)
        self.committed_pages += len(rows)
        cap = self.segment_pages if not self.ix.long_keys else BATCH_PAGES  # long keys: keep a record small
        lo = 0
        r = self._rec_open.get(ns)
        if r is not None and r.open and not r.dead and len(r.rows) < cap:
            lo = min(len(rows), cap - len(r.rows))
            r.rows = np.concatenate((r.rows, rows[:lo]))
            self.cols["rec"][rows[:lo]] = r.id
            self._rec_puts.append(r)
        while lo < len(rows):
            part = rows[lo:lo + cap]
            lo += len(part)
            r = self._new_record(self.namer(ns), ns, part)
            r.open = True
            self._rec_open[ns] = r
            self._rec_puts.append(r)

    def _new_record(self, name: bytes, ns: str, rows: np.ndarray) -> TableRecord:
        if self._rec_free:
            rid = self._rec_free.pop()
        else:
            rid = self._rec_next
            self._rec_next += 1
            if rid > np.iinfo(np.uint32).max:  # 4 G records live at once: far past any arena's pages
                raise OverflowError("columns: record ids past the u32 rec column")
        r = self.records[rid] = TableRecord(self, rid, name, ns, rows)
        self.cols["rec"][rows] = rid
        self._rec_by_name[name] = r
        return r

    def adopt_records(self, names: list, rows: np.ndarray, rejected: list) -> None:
        """A full load filed ``rows`` (READY, of one node, in commit order) from the records named ``names`` (the
        etcd key of each row's commit record; None: a page record of its own): file each row under a record of that
        name, the same one for every node's rows of it, so evicting one rewrites the record it came from; the names
        in ``rejected`` (pages the load refused) are rewritten without them now (a record left with no page:
        deleted). A record's rows share its revision, so in commit order they are runs: one step a run."""
        by = self._rec_by_name
        if len(rows):
            arr = np.array(names, dtype=object)
            cut = np.flatnonzero(arr[1:] != arr[:-1]) + 1
            for lo, hi in zip(np.concatenate(([0], cut)).tolist(), np.concatenate((cut, [len(arr)])).tolist()):
                name = names[lo]
                if name is None:
                    continue
                rec = by.get(name)
                if rec is None:
                    ns = self.ns_names[int(self.cols["ns"][rows[lo]])]
                    rec = by[name] = self._new_record(name, ns, rows[lo:hi])
                else:
                    rec.rows = np.concatenate((rec.rows, rows[lo:hi]))
                    self.cols["rec"][rows[lo:hi]] = rec.id
        for name in dict.fromkeys(rejected):
            if name is None:
                continue
            rec = by.get(name)
            if rec is None:  # none of its pages was filed (so far): an empty record, deleted by its rewrite
                rec = by[name] = self._new_record(name, "", np.zeros(0, np.int64))
            rec.shrunk = True  # a rejected page's extent may be free: placed only once this rewrite is durable
            self._rec_rewrites[rec] = None

    def _leaving(self, rows: np.ndarray) -> None:
        """``rows`` leave READY (evicted, removed, dropped): their records are rewritten without them (and their
        links undone: ``metaserver/table/links.py``)."""
        if not len(rows):
            return
        self.links.leaving(rows)
        rec = self.cols["rec"]
        ids = np.unique(rec.take(rows))
        rec[rows] = 0
        for rid in ids.tolist():
            if rid:
                r = self.records[rid]
                r.shrunk = True  # their extents may be placed again: not before this rewrite is durable
                self._rec_rewrites[r] = None

    def _end_record(self, r: TableRecord) -> None:
        if not r.dead:
            r.dead = True
            del self.records[r.id]
            self._rec_free.append(r.id)
            if self._rec_by_name.get(r.name) is r:
                del self._rec_by_name[r.name]
            if r.open and self._rec_open.get(r.ns) is r:
                del self._rec_open[r.ns]
            r.open = False

    def take_records(self) -> tuple[list[TableRecord], list[TableRecord]]:
        """(records to put, records to rewrite) since the last call: the etcd work of the requests in between."""
        puts, self._rec_puts = list(dict.fromkeys(self._rec_puts)), []  # (an open segment joined by several)
        rewrites = [r for r in self._rec_rewrites if not r.dead]
        self._rec_rewrites = {}
        return puts, rewrites

    def record_value(self, rows: np.ndarray) -> bytes:
        """The segment of ``rows`` (``records.pack_segment``): O(rows) numpy, the keys one gather of the key
        index's digests when every key is its own digest (else a key a row), parents only under prefix-lru."""
        c = self.cols
        ns_u, nsix = np.unique(c["ns"].take(rows), return_inverse=True)
        node_u, nodeix = np.unique(c["node"].take(rows), return_inverse=True)
        code_u, codeix = np.unique(c["size"].take(rows), return_inverse=True)
        long_keys = self.ix.long_keys
        lens = digs = None
        dig = self.ix.kc.take(rows, axis=0)
        if long_keys and long_keys.any_of(rows):
            keys = self.ix.keys_of(rows)
            lens = np.fromiter(map(len, keys), np.uint32, len(keys))
            blob = b"".join(keys)
            digs = dig  # so a load hashes none of them again
        else:
            blob = dig.tobytes()
        parents = None
        if self.links.linking:
            parents = self.links.parent_keys(rows)
            if all(p is None for p in parents):
                parents = None
        return pack_segment([self.ns_names[i] for i in ns_u.tolist()], nsix, self.node_names.take(node_u).tolist(),
                            nodeix, c["unit"].take(rows), self.code_arr.take(code_u), codeix, c["gen"].take(rows),
                            blob, 32, lens, parents, digs=digs)

    def record_pages(self, rows: np.ndarray) -> list:
        """``[key, node_id, offset, payload_len, gen, parent]`` of each row, the msgpack layout of a commit record's
        pages, no longer written (tests make old records with it; ``metaserver/table/records.py``): parent its parent's
        key (None when it names none or links are not kept); a shared entry's (``metaserver/table/shared.py``)
        ``[key, node_id, offset, part_len, gen, parent, n]``."""
        c = self.cols
        keys = [self.ix.key_of(r) for r in rows.tolist()]
        pages = [list(p) for p in zip(keys, self.node_names.take(c["node"].take(rows)).tolist(),
                                      self.offsets_of(rows),
                                      self.code_arr.take(c["size"].take(rows)).tolist(), c["gen"].take(rows).tolist(),
                                      self.links.parent_keys(rows))]
        if self.any_shared:
            for p in pages:
                if p[3] > PART_MASK:
                    p[3], n = p[3] & PART_MASK, p[3] >> SHARD_SHIFT
                    p.append(n)
        return pages
