"""Page records as the metaserver reads them back from etcd (a load's range responses, a standby's watch events):
``PageRecords`` parses them straight into ``entry.Entry`` pages, grouped by node, which the table files as rows;
``_name`` reads a page's etcd key. The key layout and the values are ``metaserver/persist.py``'s
(``EtcdStore.page_key``, ``page_value``); this module only reads them.
"""

from __future__ import annotations

import sys
from binascii import unhexlify
from operator import attrgetter

import msgpack

from metaserver.entry import MAX_SHARDS, PART_MASK, SHARD_SHIFT, Entry
from transport.keyform import digest_key

_intern = sys.intern
BATCH_MARK = b"+"  # a commit record's name: {pages}{ns}/+{term}.{n} (a page record's name is lower-case hex)
BATCH_PAGES = 128  # pages of one commit record at most (a larger COMMIT writes several): 128 records of 512-byte keys
# stay far below a transaction's TXN_BYTES
MAX_BATCH = 4096  # pages a commit record may hold when read (the metaserver writes at most BATCH_PAGES)


def _name(etcd_key: bytes, cut: int) -> tuple[str, bytes]:
    """(ns, key) of a page's etcd key (``cut``: the length of the pages prefix); raises ValueError (also
    binascii.Error) or UnicodeDecodeError when it is not a name this pool writes (``PageRecords``)."""
    ns_b, _, hexkey = etcd_key[cut:].rpartition(b"/")
    key = unhexlify(hexkey)
    if not hexkey.islower() and hexkey != key.hex().encode():
        raise ValueError("a page key not in lower-case hex")
    if len(key) >= 64 and digest_key(key) is not key:
        raise ValueError("a digest key not in its raw form")
    return ns_b.decode(), key


UNREADABLE = (ValueError, TypeError, OverflowError, UnicodeDecodeError, msgpack.exceptions.UnpackException)
_key, _value, _mod_revision = attrgetter("key"), attrgetter("value"), attrgetter("mod_revision")


def batch_entries(ns: str, name: bytes, value) -> tuple[list[str], list[Entry]]:
    """(node ids, entries) of a commit record (its unpacked value: a list of [key, node_id, offset, payload_len, gen,
    parent] or, for a shared entry, [..., n]), each with ``batch`` the record's etcd key ``name``.
    Raises as ``UNREADABLE`` when any page of it is not a record this pool writes (the whole record is then
    unreadable: the leader deletes it), the same rules as a page record's."""
    if type(value) is not list or not 0 < len(value) <= MAX_BATCH:
        raise ValueError("a commit record that is not a list of pages")
    ents: list[Entry] = []
    nodes: list[str] = []
    for rec in value:
        if type(rec) is not list:
            raise TypeError("a page of a commit record that is not a list")
        if len(rec) == 7:
            key, node_id, off, plen, gen, parent, n = rec
            if (type(n) is not int or not 1 <= n <= MAX_SHARDS or type(plen) is not int
                    or not 0 <= plen <= PART_MASK):
                raise ValueError("a shared page's part count or length out of range")
            plen |= n << SHARD_SHIFT  # metaserver.entry.layout
        else:
            key, node_id, off, plen, gen, parent = rec
            if type(plen) is not int or not 0 <= plen <= PART_MASK:
                raise ValueError("a payload length out of range")
        if type(key) is not bytes or (len(key) >= 64 and digest_key(key) is not key):
            raise ValueError("a page key that is not bytes in its one form")
        if type(node_id) is not str:
            raise TypeError("a node id that is not a string")
        if type(off) is not int or type(gen) is not int or off < 0 or gen < 0:
            raise TypeError("an offset or generation that is not a natural number")
        if parent is not None:
            if type(parent) is not bytes:
                raise TypeError("a parent that is not bytes")
            if len(parent) >= 64:
                parent = digest_key(parent)
        ents.append(Entry(ns, key, off, plen, gen, parent, name))
        nodes.append(node_id)
    return nodes, ents


def _unpack_or_none(value: bytes):
    """The unpacked value, None when it is not msgpack (None is no record either: the record is unreadable)."""
    try:
        return msgpack.unpackb(value)
    except UNREADABLE:
        return None


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
    the key, offset and parent objects msgpack just made are in the cache, is half the cost of one made from a
    tuple of them later (1 M pages: the load's per-record loop went from 1.1 to 0.6 us); no tuple per record, the
    namespace one interned string, the etcd key not kept (a 9-tuple with its etcd key a record: 9.7 GiB at 10 M
    pages). Cost of ``add``: about 1.5 us a record (two protobuf reads, a msgpack unpack, an unhexlify, an
    entry)."""

    __slots__ = ("groups", "junk", "n", "batches", "_prefix", "_cut", "_names", "_apps", "_ekeys")

    def __init__(self, prefix: bytes):
        self.groups: dict[str, tuple[list[Entry], list[int]]] = {}
        self.junk: list[bytes] = []
        self.n = 0
        self.batches: list[bytes] = []  # the etcd keys of the commit records read
        self._prefix = prefix
        self._cut = len(prefix)
        self._names: dict[bytes, str] = {}  # namespace as in the etcd key -> its (interned) str
        self._apps: dict[str, tuple] = {}  # node id -> the append methods of its two lists in ``groups``
        self._ekeys: dict[tuple[str, bytes], bytes] | None = None  # ``of``: the tuples' own etcd keys

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

    def done(self) -> dict[str, tuple[list[Entry], list[int]]]:
        """No more ``add``: ``groups``, its lists no longer referenced from here (so a caller that pops a node's
        lists frees them)."""
        self._apps = {}
        return self.groups

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
        try:  # the values unpacked at C level (one unreadable one: each on its own, None for the unreadable)
            recs = list(map(unpack, map(_value, kvs)))
        except UNREADABLE:
            recs = list(map(_unpack_or_none, map(_value, kvs)))
        last_head = ns = None
        for ekey, rec, rev, kv in zip(map(_key, kvs), recs, map(_mod_revision, kvs), kvs):
            try:
                head, _, hexkey = ekey.rpartition(b"/")  # the prefix ends in "/": what ``_name`` reads
                if hexkey[:1] == BATCH_MARK:
                    self._add_batch(ekey, head, rec, kv.create_revision)
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
                    plen |= n << SHARD_SHIFT  # metaserver.entry.layout
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

    def _add_batch(self, ekey: bytes, head: bytes, value, rev: int) -> None:
        """A commit record's pages into ``groups`` (each at the record's create revision: a rewrite keeps its
        pages' place in commit order). Raises as ``UNREADABLE`` (nothing added) when it is not one."""
        term, dot, seq = ekey[len(head) + 2:].partition(b".")
        if not (dot and term and seq and term.isalnum() and seq.isalnum()):
            raise ValueError("a commit record's name that is not {term}.{count}")
        int(term, 16), int(seq, 16)
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
