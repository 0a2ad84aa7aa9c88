"""A load's page records (``PageRecords``): the range responses of a full load (and a standby's watch events) parsed
as the scan delivers them, their pages grouped by node, dead lists applied after the scan; ``NodePages``, one node's
pages as columns, what ``TableDirectory.load`` files. The values' layouts are ``metaserver/table/records.py``'s.

Costs: ``add`` keeps a segment as parsed (its columns and keys views of its value: no copy); ``columns`` groups
every segment's pages by node in batches of ``_BATCH`` pages (a few numpy calls a segment, a stable radix sort a
batch and a gather a column and node, into each node's columns made once at their size; its long keys joined once a
node); a msgpack record's pages cost an ``entry.Entry`` a page.
"""

from __future__ import annotations

import sys
from binascii import unhexlify
from operator import attrgetter, itemgetter

import msgpack
import numpy as np

from metaserver.table.entry import PART_MASK, SHARD_SHIFT, Entry
from metaserver.table.longkeys import LongCol, gather
from metaserver.table.records import (BATCH_MARK, SEG_BYTE, UNREADABLE, Segment, batch_entries, segment_entries,
                                      unpack_segment)
from transport.keyform import digest_key, digests
from umbp.config import MAX_SHARDS

_intern = sys.intern
_key, _value, _mod_revision = attrgetter("key"), attrgetter("value"), attrgetter("mod_revision")
_second = itemgetter(1)
_BATCH = 1 << 17  # pages ``_segment_columns`` groups by node at a time


class PageRecords:
    """The page records of one load, parsed as the scan delivers them (``add``) and grouped by node: ``groups``
    maps node_id -> ([Entry], [mod_revision]), both in scan order, each record parsed straight into the page it
    becomes (its parent named by key), which ``TableDirectory.load`` files as rows; ``batches`` lists the etcd keys
    of the commit records read, ``junk`` those of the unreadable records (the leader deletes them). ``len`` is every
    page added. ``etcd_key(ns, key)`` is the etcd key of every page record that was read (``EtcdStore.page_key``).

    Unreadable: a value that is not a 5- or 6-field record (a shared entry's: its part count ``n`` in 1..MAX_SHARDS
    and its part length in range), a node id that is not a string, a parent that is neither bytes nor nil, fields
    ``int`` refuses; a name that is not ``{ns}/{lower-case hex}`` (the leader writes no other, so it could never
    delete another form: upper-case hex would come back after every restart) or that names a digest key by its hex
    text instead of its raw form (written before keys had one form, ``keyform.digest_key``: a cache page lost once at
    that upgrade, never two records for one page).

    Why this shape: a takeover holds every record until the table is built (10 M pages). An entry made here, while
    msgpack's key, offset and parent objects are in the cache, costs half one made from a tuple of them later; no
    tuple per record, the namespace one interned string, the etcd key not kept (a 9-tuple a record with its etcd
    key: 9.7 GiB at 10 M pages). Cost of ``add``: about 1.5 us a record (two protobuf reads, a msgpack unpack, an
    unhexlify, an entry)."""

    __slots__ = ("groups", "segs", "junk", "n", "batches", "dead", "carriers", "carried", "dropped", "_prefix", "_cut",
                 "_names", "_apps", "_ekeys")

    def __init__(self, prefix: bytes):
        self.groups: dict[str, tuple[list[Entry], list[int]]] = {}
        self.junk: list[bytes] = []
        self.n = 0
        self.batches: list[bytes] = []  # the etcd keys of the commit records read
        # dead lists (version-3 segments): record etcd key -> generations of its pages that are dead; applied by
        # ``columns``/``done`` after the whole scan, so their order against the records they name does not matter
        self.dead: dict[bytes, list] = {}
        self.carriers: list[bytes] = []  # the etcd keys of the segments read that carry a dead list
        self.carried: dict = {}  # each one's dead list: (its records' etcd keys, generations, index in those keys)
        self.dropped = 0  # pages a dead list named (not filed)
        self._prefix = prefix
        self._cut = len(prefix)
        self._names: dict[bytes, str] = {}  # namespace as in the etcd key -> its (interned) str
        self._apps: dict[str, tuple] = {}  # node id -> the append methods of its two lists in ``groups``
        self._ekeys: dict[tuple[str, bytes], bytes] | None = None  # ``of``: the tuples' own etcd keys
        # the segments read, in scan order: (segment, revision, record's etcd key); ``columns`` groups their pages by
        # node with one sort of them all (a step a segment and node cost more than the columns' numpy work)
        self.segs: list[tuple[Segment, int, bytes]] = []

    def __len__(self) -> int:
        return self.n

    @classmethod
    def of(cls, pages: list[tuple]) -> "PageRecords":
        """From ``EtcdStore.page_record`` tuples (tests, tools), their etcd keys kept as they were given."""
        recs = cls(b"")
        recs._ekeys = {}
        for p in pages:
            recs.n += 1
            if p[1] is None or type(p[1]) is not str:
                recs.junk.append(p[8])
                continue
            g = recs.groups.get(p[1])
            if g is None:
                g = recs.groups[p[1]] = ([], [])
            g[0].append(Entry(p[2], p[3], p[4], p[5], p[6], p[7]))
            g[1].append(p[0])
            recs._ekeys[(p[2], p[3])] = p[8]
        return recs

    def _dead_of(self, name) -> np.ndarray | None:
        """The dead generations named for record ``name`` (sorted uint64), None when none."""
        g = self.dead.get(name) if name is not None else None
        if g is None:
            return None
        if type(g) is list:
            g = self.dead[name] = np.unique(np.concatenate(g).astype(np.uint64))
        return g

    def _live_entries(self, ents: list, revs: list) -> tuple[list, list]:
        """``ents`` (and their ``revs``) less the pages a dead list names (a msgpack record's or a page record's)."""
        if not self.dead:
            return ents, revs
        keep = [i for i, e in enumerate(ents)
                if (g := self._dead_of(self.record_of(e))) is None or not len(g)
                or g[min(int(np.searchsorted(g, e.gen)), len(g) - 1)] != e.gen]
        if len(keep) == len(ents):
            return ents, revs
        self.dropped += len(ents) - len(keep)
        return [ents[i] for i in keep], [revs[i] for i in keep]

    def _live_idx(self, seg: Segment, idx, name: bytes):
        """``idx`` (None: all of ``seg``) less the positions of pages a dead list names."""
        g = self._dead_of(name)
        if g is None:
            return idx
        gen = seg.gen if idx is None else seg.gen.take(idx)
        live = ~np.isin(gen, g)
        if live.all():
            return idx
        self.dropped += int(np.count_nonzero(~live))
        return np.flatnonzero(live) if idx is None else idx[live]

    def done(self) -> dict[str, tuple[list[Entry], list[int]]]:
        """No more ``add``: ``groups``, its lists no longer referenced from here (so a caller that pops a node's
        lists frees them), segments' pages made entries too (an object a page: the slow paths; a load reads
        ``columns``)."""
        self._apps = {}
        groups = self.groups
        if self.dead:
            for node_id, (ents, revs) in list(groups.items()):
                groups[node_id] = self._live_entries(ents, revs)
        for seg, rev, name in self.segs:
            for node_id, idx in _by_node(seg):
                g = groups.get(node_id)
                if g is None:
                    g = groups[node_id] = ([], [])
                idx = self._live_idx(seg, idx, name)
                if idx is not None and not len(idx):
                    continue
                ents = segment_entries(seg, idx, name)
                g[0].extend(ents)
                g[1].extend([rev] * len(ents))
        self.segs = []
        return groups

    def columns(self, parents: bool = True) -> "dict[str, NodePages]":
        """No more ``add``: each node's pages as columns (``NodePages``): the msgpack layouts' entries in scan order,
        then the segments' pages in commit order (their records' revisions, scan order among equal ones; etcd scans
        by name, and a name's counter is not zero-padded); parents when any page names one (None: none does), a
        segment's only when asked (a Python object a page: a load that links them; a msgpack record's come with its
        parse anyway). Nodes in the order their first page was read. Empties what it read."""
        self._apps = {}
        ns_list: list[str] = []
        ns_of: dict[str, int] = {}
        rec_list: list = [None]
        rec_of: dict = {None: 0}
        segs, self.segs = self.segs, []
        order = list(self.groups)
        at = {x: i for i, x in enumerate(order)}
        count: list[int] = [0] * len(order)  # each node's pages of the segments (dead ones included)
        for seg, _, _ in segs:
            if len(seg.node_ids) == 1:
                got = ((seg.node_ids[0], seg.n),)
            else:
                bc = np.bincount(seg.nodeix)
                nz = np.flatnonzero(bc)
                got = zip([seg.node_ids[i] for i in nz.tolist()], bc.take(nz).tolist())
            for x, m in got:
                k = at.get(x)
                if k is None:
                    k = at[x] = len(order)
                    order.append(x)
                    count.append(0)
                count[k] += m
        by_seg = _segment_columns(segs, at, count, self, ns_of, ns_list, rec_of, rec_list, parents)
        del segs
        out: dict[str, NodePages] = {}
        for node_id in order:
            parts = []
            ents, revs = self.groups.pop(node_id, ((), ()))
            if ents and self.dead:
                ents, revs = self._live_entries(ents, revs)
            if ents:
                parts.append(NodePages.of_entries(ents, revs, ns_of, ns_list, rec_of, rec_list, parents))
            p = by_seg.pop(node_id, None)
            if p is not None:
                parts.append(p)
            if parts:  # (none: a dead list named every page of it)
                out[node_id] = NodePages.join(parts, ns_list, rec_list)
        return out

    def record_of(self, e: Entry) -> bytes:
        """The etcd key of what holds ``e``'s record: its commit record's or its own (``etcd_key``)."""
        return e.batch if e.batch is not None else self.etcd_key(e.ns, e.key)

    def etcd_key(self, ns: str, key: bytes) -> bytes:
        """The etcd key of the record read for (ns, key): ``EtcdStore.page_key`` of it (``of``: the tuple's)."""
        if self._ekeys is not None:
            return self._ekeys[(ns, key)]
        return self._prefix + ns.encode() + b"/" + key.hex().encode()

    def add(self, kvs) -> None:
        """Parse page kvs (key, value, mod_revision) into ``groups``, or ``junk`` when unreadable. The loop is
        ``_name`` and the record checks inlined (``page_record`` is this on one kv): keep them in step."""
        cut = self._cut
        names = self._names  # the etcd key before its last "/" -> its namespace
        groups = self.groups
        apps = self._apps
        unpack = msgpack.unpackb
        new = Entry.__new__
        self.n += len(kvs)
        values = list(map(_value, kvs))
        if any(v[:1] == SEG_BYTE for v in values):  # segments: parsed by ``_add_batch``
            recs = [None if v[:1] == SEG_BYTE else _unpack_or_none(v) for v in values]
        else:
            try:  # the values unpacked at C level (one unreadable one: each on its own, None for the unreadable)
                recs = list(map(unpack, values))
            except UNREADABLE:
                recs = list(map(_unpack_or_none, values))
        last_head = ns = None
        for ekey, rec, rev, kv, raw in zip(map(_key, kvs), recs, map(_mod_revision, kvs), kvs, values):
            try:
                head, _, hexkey = ekey.rpartition(b"/")  # the prefix ends in "/": what ``_name`` reads
                if hexkey[:1] == BATCH_MARK:
                    self._add_batch(ekey, head, rec, kv.create_revision, raw)  # (``kv.value`` would copy it again)
                    continue
                key = unhexlify(hexkey)
                if not hexkey.islower() and hexkey != key.hex().encode():
                    raise ValueError("a page key not in lower-case hex")
                if len(key) >= 64 and digest_key(key) is not key:
                    raise ValueError("a digest key not in its raw form")
                if head != last_head:  # (a scan returns a namespace's keys together)
                    ns = names.get(head)
                    if ns is None:
                        ns = names[head] = _intern(head[cut:].decode())
                    last_head = head
                if type(rec) is list and len(rec) == 6:
                    node_id, off, plen, gen, parent, n = rec
                    if (type(n) is not int or not 1 <= n <= MAX_SHARDS or type(plen) is not int
                            or not 0 <= plen <= PART_MASK):
                        raise ValueError("a shared page's part count or length out of range")
                    plen |= n << SHARD_SHIFT  # metaserver.table.entry.layout
                else:
                    node_id, off, plen, gen, parent = rec
                    if type(plen) is not int:
                        plen = int(plen)
                    elif plen > PART_MASK:
                        raise ValueError("a payload length out of range")
                if type(off) is not int:
                    off = int(off)
                if type(gen) is not int:
                    gen = int(gen)
                if parent is not None:
                    if type(parent) is not bytes:
                        raise TypeError("a parent that is not bytes")
                    if len(parent) >= 64:
                        parent = digest_key(parent)
                g = apps.get(node_id)
                if g is None:
                    if type(node_id) is not str:
                        raise TypeError("a node id that is not a string")
                    ents, revs = groups[node_id] = ([], [])
                    g = apps[node_id] = (ents.append, revs.append)
                # Entry(ns, key, off, plen, gen, parent), inlined: keep in step
                e = new(Entry)
                e.key = key
                e.ns = ns
                e.offset = off
                e.payload_len = plen
                e.gen = gen
                e.parent = parent
                e.batch = None
                add_e, add_rev = g
                add_e(e)
                add_rev(rev)
            except UNREADABLE:
                self.junk.append(ekey)

    def _add_batch(self, ekey: bytes, head: bytes, value, rev: int, raw: bytes = b"") -> None:
        """A commit record's pages into ``groups`` (a segment into ``segs``), each at the record's create
        revision (a rewrite keeps its pages' place in commit order). Raises as ``UNREADABLE`` (nothing added) when
        it is not one."""
        term, dot, seq = ekey[len(head) + 2:].partition(b".")
        if not (dot and term and seq and term.isalnum() and seq.isalnum()):
            raise ValueError("a commit record's name that is not {term}.{count}")
        int(term, 16), int(seq, 16)
        if value is None and raw[:1] == SEG_BYTE:
            seg = unpack_segment(raw)
            self.batches.append(ekey)
            self.n += seg.n - 1
            if len(seg.dead):
                self.carriers.append(ekey)
                self.carried[ekey] = (seg.dead_recs, seg.dead, seg.dead_ix)
                dead = self.dead
                for j, rname in enumerate(seg.dead_recs):
                    dead.setdefault(rname, []).append(seg.dead[seg.dead_ix == j] if len(seg.dead_recs) > 1
                                                      else seg.dead)
            if seg.n:
                self.segs.append((seg, rev, ekey))
            return
        ns = self._names.get(head)
        if ns is None:
            ns = self._names[head] = _intern(head[self._cut:].decode())
        nodes, ents = batch_entries(ns, ekey, value)
        self.batches.append(ekey)
        self.n += len(ents) - 1  # ``n`` counts pages: ``add`` counted the record as one
        groups, apps = self.groups, self._apps
        for node_id, e in zip(nodes, ents):
            g = apps.get(node_id)
            if g is None:
                elist, revs = groups[node_id] = ([], [])
                g = apps[node_id] = (elist.append, revs.append)
            g[0](e)
            g[1](rev)


class NodePages:
    """One node's pages of a load as columns (``PageRecords.columns``), in scan order: ``nsix`` (u16, an index in
    ``ns_names``), ``dig`` ((n, 4) u64 key digests) and ``longs`` (the keys not their own digest: a ``longkeys.LongCol``),
    ``off``, ``code`` (layout codes), ``gen``, ``rev`` (the record's revision: commit order), ``rec`` (i32, an
    index in ``rec_names``: the commit record's etcd key, None for a page record of its own) and ``parents`` (a
    list of parent keys or None, only when asked for)."""

    __slots__ = ("nsix", "dig", "longs", "off", "code", "gen", "rev", "rec", "parents", "ns_names", "rec_names")

    def __len__(self) -> int:
        return len(self.gen)

    @staticmethod
    def _make(nsix, dig, longs, off, code, gen, rev, rec, parents) -> "NodePages":
        p = NodePages()
        p.nsix, p.dig, p.longs, p.off, p.code, p.gen, p.rev, p.rec, p.parents = (
            nsix, dig, longs, off, code, gen, rev, rec, parents)
        return p

    @staticmethod
    def _ix(of: dict, names: list, name) -> int:
        i = of.get(name)
        if i is None:
            i = of[name] = len(names)
            names.append(name)
        return i

    @classmethod
    def of_entries(cls, ents: list, revs: list, ns_of, ns_list, rec_of, rec_list, parents: bool) -> "NodePages":
        n = len(ents)
        dig, longs = digests([e.key for e in ents])
        longs = LongCol.of(longs)
        nsm = {x: cls._ix(ns_of, ns_list, x) for x in {e.ns for e in ents}}
        rm = {x: cls._ix(rec_of, rec_list, x) for x in {e.batch for e in ents}}
        return cls._make(np.fromiter((nsm[e.ns] for e in ents), np.uint16, n), dig, longs,
                         np.fromiter((e.offset for e in ents), np.int64, n),
                         np.fromiter((e.payload_len for e in ents), np.int64, n),
                         np.fromiter((e.gen for e in ents), np.uint64, n), np.array(revs, np.int64),
                         np.fromiter((rm[e.batch] for e in ents), np.int32, n),
                         [e.parent for e in ents] if any(e.parent is not None for e in ents) else None)

    @classmethod
    def join(cls, parts: list, ns_names: list, rec_names: list) -> "NodePages":
        if len(parts) == 1:
            p = parts[0]
        else:
            longs = LongCol.cat([q.longs for q in parts], [len(q) for q in parts])
            def cat(f):
                return np.concatenate([getattr(q, f) for q in parts])
            p = cls._make(cat("nsix"), cat("dig"), longs, cat("off"), cat("code"), cat("gen"), cat("rev"), cat("rec"),
                          None if all(q.parents is None for q in parts) else
                          [x for q in parts for x in (q.parents if q.parents is not None else [None] * len(q))])
        p.ns_names, p.rec_names = ns_names, rec_names
        return p

    def take(self, order: np.ndarray) -> "NodePages":
        """These pages in ``order`` (a permutation)."""
        longs = self.longs.permute(order)
        p = self._make(self.nsix[order], self.dig[order], longs, self.off[order], self.code[order], self.gen[order],
                       self.rev[order], self.rec[order],
                       None if self.parents is None else [self.parents[i] for i in order.tolist()])
        p.ns_names, p.rec_names = self.ns_names, self.rec_names
        return p

    def key(self, i: int) -> bytes:
        k = self.longs.at(i)  # (a few: only pages that cannot stand ask)
        return k if k is not None else self.dig[i].tobytes()

    def records(self) -> np.ndarray:
        """Each page's commit record's etcd key (None: a page record of its own), an object array."""
        names = np.empty(len(self.rec_names), object)
        names[:] = self.rec_names
        return names[self.rec]

    def page(self, i: int, node_id: str, recs: "PageRecords") -> tuple:
        """The ``page_record`` tuple of page ``i`` (a page that cannot stand: a few), its record's etcd key last."""
        ns, key = self.ns_names[int(self.nsix[i])], self.key(i)
        name = self.rec_names[int(self.rec[i])]
        return (int(self.rev[i]), node_id, ns, key, int(self.off[i]), int(self.code[i]), int(self.gen[i]),
                None if self.parents is None else self.parents[i],
                name if name is not None else recs.etcd_key(ns, key))


def _unpack_or_none(value: bytes):
    """The unpacked value, None when it is not msgpack (None is no record either: the record is unreadable)."""
    try:
        return msgpack.unpackb(value)
    except UNREADABLE:
        return None


def _by_node(seg: Segment) -> list[tuple[str, np.ndarray | None]]:
    """(node id, positions of its pages in ``seg``, ascending; None: all of them) for each node of a segment."""
    if len(seg.node_ids) == 1:
        return [(seg.node_ids[0], None)]
    order = np.argsort(seg.nodeix, kind="stable")
    ix = seg.nodeix[order]
    cut = np.flatnonzero(ix[1:] != ix[:-1]) + 1
    return [(seg.node_ids[int(ix[lo])], order[lo:hi]) for lo, hi in
            zip(np.concatenate(([0], cut)).tolist(), np.concatenate((cut, [seg.n])).tolist())]


def _segment_columns(segs: list, at: dict, count: list, recs: PageRecords, ns_of, ns_list, rec_of, rec_list,
                     parents: bool) -> "dict[str, NodePages]":
    """The pages of segments ``segs`` ((segment, revision, etcd key), scan order) as a ``NodePages`` a node (``at``:
    node id -> its place in the load's order; ``count``: each place's pages, dead ones included), each node's in
    commit order: the segments in order of revision (stable), taken ``_BATCH`` pages at a time: a batch's columns
    joined, its pages sorted by node (a stable radix sort of u16) and each node's part gathered straight into that
    node's columns, made once at their size (``count``; a dead list's pages leave a tail unused, cut off at the end).
    Why batches, not every page's columns joined at once: arrays that large are new memory (glibc maps an array past
    its mmap threshold anew, and its pages are faulted in: about 0.3 ns a byte on the 2-core VM, more under load),
    where a batch's temporaries reuse the heap; and why no part a batch and node joined at the end: that was a second
    copy of every column, in new memory (1 of the 6 CPU-s at 10 M pages). Dead-listed pages left out (``recs``)."""
    segs.sort(key=_second)  # (stable: scan order among equal revisions)
    dst = {k: _NodeCols(m) for k, m in enumerate(count) if m}
    batch: list = []
    size = 0
    for i in range(len(segs)):
        (seg, rev, name), segs[i] = segs[i], None  # (a batch's values freed once it is grouped: the heap reused)
        idx = recs._live_idx(seg, None, name) if recs.dead else None
        if idx is not None and not len(idx):
            continue
        batch.append((seg, rev, name, idx))
        size += seg.n if idx is None else len(idx)
        if size >= _BATCH:
            _batch_parts(batch, at, dst, ns_of, ns_list, rec_of, rec_list, parents)
            batch, size = [], 0
    if batch:
        _batch_parts(batch, at, dst, ns_of, ns_list, rec_of, rec_list, parents)
    del batch
    segs.clear()
    names = list(at)
    out = {}
    for k in sorted(dst):
        d = dst.pop(k)
        if d.fill:  # (none: a dead list named every page of it)
            out[names[k]] = d.pages(parents)
    return out


class _NodeCols:
    """One node's columns as ``_segment_columns`` fills them: ``NodePages``' arrays at their final size, ``fill``
    pages written; its long keys and parents as parts (a ``LongCol`` and its batch's page count; parents or None)."""

    __slots__ = ("cols", "fill", "longs", "sizes", "par")

    def __init__(self, m: int):
        self.cols = (np.empty(m, np.uint16), np.empty((m, 4), np.uint64), np.empty(m, np.int64),
                     np.empty(m, np.int64), np.empty(m, np.uint64), np.empty(m, np.int64), np.empty(m, np.int32))
        self.fill = 0
        self.longs: list = []
        self.sizes: list[int] = []
        self.par: list = []

    def pages(self, parents: bool) -> "NodePages":
        f = self.fill
        cols = [c if len(c) == f else c[:f] for c in self.cols]
        longs = LongCol.cat(self.longs, self.sizes)
        par = None
        if parents and any(q is not None for q in self.par):
            par = [x for q, m in zip(self.par, self.sizes) for x in (q if q is not None else [None] * m)]
        return NodePages._make(cols[0], cols[1], longs, *cols[2:], par)


def _batch_parts(batch: list, at: dict, dst: dict, ns_of, ns_list, rec_of, rec_list, parents: bool) -> None:
    """``_segment_columns``' step for a batch of segments ((segment, revision, etcd key, live positions or None)):
    each node's part of them written into ``dst[its place]`` (a ``_NodeCols``) after what it holds."""
    cols: list[list] = [[] for _ in range(5)]
    longs, counts, nsbase, ndbase, revs, rec_ix, par = [], [], [], [], [], [], []
    nstab: list[int] = []
    ndtab: list[int] = []
    cbase: list[int] = []  # each segment's first code in ``ctab``, and (where it has several) its code index
    ctab: list[int] = []
    cix: list = []
    for seg, rev, name, idx in batch:
        dig, lc = seg.digests()
        got = (dig, seg.nsix, seg.nodeix, seg.unit, seg.gen)
        cx = seg.codeix
        if idx is not None:
            got = tuple(x[idx] for x in got)
            cx = None if cx is None else cx[idx]
            lc = lc.select(idx)
        for c, x in zip(cols, got):
            c.append(x)
        cbase.append(len(ctab))
        ctab.extend(seg.codes.tolist())
        cix.append(cx)
        longs.append(lc)
        counts.append(len(got[-1]))
        nsbase.append(len(nstab))
        nstab.extend(NodePages._ix(ns_of, ns_list, x) for x in seg.ns_names)
        ndbase.append(len(ndtab))
        ndtab.extend(at[x] for x in seg.node_ids)
        revs.append(rev)
        rec_ix.append(NodePages._ix(rec_of, rec_list, name))
        if parents:
            pl = seg.parent_list()
            pl = [None] * seg.n if pl is None else pl
            par.extend(pl if idx is None else [pl[i] for i in idx.tolist()])
    cnt = np.array(counts, np.int64)
    dig, nsix, node, unit, gen = (c[0] if len(c) == 1 else np.concatenate(c) for c in cols)
    del cols
    code = np.repeat(np.array(cbase, np.int64), cnt)  # each page's code: its segment's table at its index
    if any(x is not None for x in cix):
        for lo, m, x in zip(np.cumsum([0] + counts[:-1]).tolist(), counts, cix):
            if x is not None:
                code[lo:lo + m] += x
    code = np.array(ctab, np.int64).take(code)
    node = np.array(ndtab, np.int32 if len(at) >= 1 << 16 else np.uint16).take(
        node.astype(np.int64) + np.repeat(np.array(ndbase, np.int64), cnt))
    nsix = np.array(nstab, np.uint16).take(nsix.astype(np.int64) + np.repeat(np.array(nsbase, np.int64), cnt))
    seg_of = np.repeat(np.arange(len(cnt), dtype=np.int32), cnt)
    order = np.argsort(node, kind="stable")  # (u16: a radix sort; by node, each node's pages as joined)
    ends = np.concatenate(([0], np.cumsum(np.bincount(node, minlength=len(at))))).tolist()
    lc = LongCol.cat(longs, counts)
    srt = np.argsort(node.take(lc.pos), kind="stable")  # the long keys by node, each node's a run
    lcut = np.searchsorted(node.take(lc.pos.take(srt)), np.arange(len(at) + 1)).tolist()
    lens = lc.lens()
    revs = np.array(revs, np.int64)
    rec_ix = np.array(rec_ix, np.int32)
    for k in np.flatnonzero(np.diff(ends)).tolist():
        idx = order[ends[k]:ends[k + 1]]
        d = dst[k]
        f, m = d.fill, len(idx)
        o_ns, o_dig, o_off, o_code, o_gen, o_rev, o_rec = (c[f:f + m] for c in d.cols)
        # (mode "clip": the indexes are in range, and take buffers its ``out`` under the default "raise")
        nsix.take(idx, out=o_ns, mode="clip")
        dig.take(idx, axis=0, out=o_dig, mode="clip")
        np.left_shift(unit.take(idx), 12, out=o_off, dtype=np.int64)
        code.take(idx, out=o_code, mode="clip")
        gen.take(idx, out=o_gen, mode="clip")
        sg = seg_of.take(idx)
        revs.take(sg, out=o_rev, mode="clip")
        rec_ix.take(sg, out=o_rec, mode="clip")
        mine = srt[lcut[k]:lcut[k + 1]]
        d.longs.append(_pick(lc, lens, mine, np.searchsorted(idx, lc.pos.take(mine))))
        d.sizes.append(m)
        if parents:
            d.par.append(_some([par[i] for i in idx.tolist()]))
        d.fill = f + m


def _some(parents: list) -> list | None:
    """``parents``, None when it names none."""
    return parents if any(x is not None for x in parents) else None


def _pick(lc: LongCol, lens: np.ndarray, entries: np.ndarray, pos: np.ndarray) -> LongCol:
    """``lc.pick(entries, pos)`` with its key lengths ``lens`` given (a load picks each node's from one column)."""
    blob, ends = gather(lc.blob, lc.ends.take(entries) - lens.take(entries), lens.take(entries))
    return LongCol(pos, ends, blob)
