"""The etcd values of page records, written and read: the one module that packs and unpacks them (the key layout is
``metaserver/store/persist.py``'s). ``PageRecords`` parses a load's range responses (and a standby's watch events) and
groups their pages by node; ``_name`` reads a page's etcd key.

Three layouts, told apart by the value's first byte; the old two stay readable forever, only segments are written:

- a page record of its own (``{ns}/{hex key}``): msgpack ``[node_id, offset, payload_len, gen, parent(, n)]``;
- a msgpack commit record (``{ns}/+{term}.{n}``, up to ``MAX_BATCH`` pages): msgpack ``[[key, node_id, offset,
  payload_len, gen, parent(, n)], ...]`` (a msgpack array: first byte 0x90-0x9f, 0xdc or 0xdd);
- a segment (the same name): ``SEG_MAGIC`` (0xc1, a byte msgpack never uses) and a version byte, then the pages as
  little-endian columns (``pack_segment`` states the layout): a load reads one with a few ``np.frombuffer`` calls
  and files its pages with the table's array paths, no Python object a page (``Segment``, ``NodePages``).

Costs: a segment of n pages of 32-byte keys packs in O(n) numpy (about 50 bytes a page) and parses in a dozen numpy
calls whatever n; a msgpack record costs about 1 us a page to parse (an ``entry.Entry`` each).
"""

from __future__ import annotations

import struct
import sys
from binascii import unhexlify
from operator import attrgetter

import msgpack
import numpy as np

from metaserver.table.entry import MAX_SHARDS, PART_MASK, SHARD_SHIFT, Entry
from metaserver.table.index import digests
from metaserver.table.longkeys import LongCol, gather
from transport.keyform import digest_key

_intern = sys.intern
BATCH_MARK = b"+"  # a commit record's name: {pages}{ns}/+{term}.{n} (a page record's name is lower-case hex)
BATCH_PAGES = 128  # pages of one commit record at most (a larger COMMIT writes several): 128 records of 512-byte keys
# stay far below a transaction's TXN_BYTES
MAX_BATCH = 4096  # pages a commit record may hold when read (the metaserver writes at most BATCH_PAGES)

SEGMENT_PAGES = 1024  # pages of one segment at most as written (group commit: a window's COMMITs of one namespace)
MAX_SEGMENT = 1 << 16  # pages a segment may hold when read
SEG_MAGIC = 0xC1  # a segment's first byte: one msgpack never uses, so no msgpack value starts with it
SEG_VERSION = 2  # written when a segment carries no dead list (earlier releases read it)
SEG_DEAD_VERSION = 3  # written when it does (and then it may hold no page): the one layout, whose dead list names its
# pages' records (``pack_segment``); an earlier release finds it unreadable and deletes it (its pages: misses)
SEG_VERSIONS = (SEG_VERSION, SEG_DEAD_VERSION)  # read
_SEG_HEAD = struct.Struct("<BBHIHHHHII")  # magic, version, flags, pages, namespaces, nodes, codes, dead records,
# dead, key_len (version 2: dead records 0 and no dead)
F_PARENTS, F_VARKEYS, F_DIGESTS = 1, 2, 4  # flags: a parent column; keys of several lengths (a length column, else
# key_len each); the keys' digests (``keyindex.digests``) as a column, so a load hashes no key
NO_PARENT = 0xFFFFFFFF  # a parent length that says: none
_U64, _U32, _U16 = np.dtype("<u8"), np.dtype("<u4"), np.dtype("<u2")
_MAX_I64 = np.uint64((1 << 63) - 1)
_SEG_BYTE = bytes([SEG_MAGIC])


def pack_segment(ns_names: list[str], nsix, node_ids: list[str], nodeix, unit, codes, codeix, gen, keys: bytes,
                 key_len: int, key_lens=None, parents: list | None = None, dead=None, digs=None,
                 dead_recs: list[bytes] | None = None, dead_ix=None) -> bytes:
    """A segment's value. Layout (little-endian), after the 24-byte head (``_SEG_HEAD``):
    ``gen`` u64[n], key digests u64[4n] (``F_DIGESTS`` only: ``digs``, written with keys that are not all 32
    bytes; a load trusts them as it trusts every field etcd holds), the layout-code table u64[codes], ``dead`` u64[dead] (the dead list: generations of pages of
    records that left since, ``metaserver/table/commits.py``), ``unit`` u32[n] (offset >> 12), key lengths u32[n] (``F_VARKEYS`` only), parent
    lengths u32[n] (``F_PARENTS`` only; ``NO_PARENT``: none), the table names' lengths u16[namespaces + nodes + dead
    records],
    namespace index u16[n] (only with more than one namespace), node index u16[n] (only with more than one node),
    code index u16[n] (only with more than one code), dead record index u16[dead] (only with more than one dead
    record: which record's page each dead generation names), then the namespace and node names (utf-8) and the dead
    records' etcd keys, the keys (n x
    ``key_len`` bytes, or as the lengths say) and the parents. The 8-byte columns come first, so they are aligned.
    Arrays are numpy (any integer dtype) or sequences; ``nsix``/``nodeix``/``codeix`` may be None when their table
    has one entry (``dead_ix`` likewise). Version 3 (a dead list, or no page: a dead list alone) else 2."""
    n = len(gen)
    dead_recs = dead_recs or []
    flags = ((F_VARKEYS if key_lens is not None else 0) | (F_PARENTS if parents is not None else 0)
             | (F_DIGESTS if digs is not None else 0))
    dead = np.zeros(0, _U64) if dead is None else np.asarray(dead, _U64)
    names = [x.encode() for x in ns_names] + [x.encode() for x in node_ids] + list(dead_recs)
    version = SEG_DEAD_VERSION if len(dead) else SEG_VERSION
    parts = [_SEG_HEAD.pack(SEG_MAGIC, version, flags, n, len(ns_names), len(node_ids), len(codes), len(dead_recs),
                            len(dead),
                            0 if key_lens is not None else key_len),
             np.asarray(gen, _U64).tobytes(), b"" if digs is None else np.asarray(digs, _U64).tobytes(),
             np.asarray(codes, _U64).tobytes(), dead.tobytes(),
             np.asarray(unit, _U32).tobytes()]
    if key_lens is not None:
        parts.append(np.asarray(key_lens, _U32).tobytes())
    pblob = b""
    if parents is not None:
        parts.append(np.fromiter((NO_PARENT if p is None else len(p) for p in parents), _U32, n).tobytes())
        pblob = b"".join(p for p in parents if p is not None)
    parts.append(np.fromiter(map(len, names), _U16, len(names)).tobytes())
    for table, ix in ((ns_names, nsix), (node_ids, nodeix), (codes, codeix), (dead_recs, dead_ix)):
        if len(table) > 1:
            parts.append(np.asarray(ix, _U16).tobytes())
    parts += names
    parts.append(keys)
    parts.append(pblob)
    return b"".join(parts)


def is_segment(value: bytes) -> bool:
    return value[:1] == _SEG_BYTE


class Segment:
    """A parsed segment (``unpack_segment``): its tables and columns as numpy arrays (``nsix``, ``nodeix``, ``unit``,
    ``code`` (int64 layout codes a page), ``gen``, ``dead`` with ``dead_ix``, an index in ``dead_recs``: the etcd
    key of the record of each dead generation's page), its keys as one blob (``key_len`` bytes each, or
    ``key_lens``) and its parents' blob (``parent_lens``; None without parents)."""

    __slots__ = ("n", "ns_names", "node_ids", "nsix", "nodeix", "unit", "code", "gen", "dead", "dead_ix", "dead_recs",
                 "keys", "key_len",
                 "key_lens", "parent_lens", "parent_blob", "_dig")

    def offsets(self) -> np.ndarray:
        return self.unit.astype(np.int64) << 12

    def key_list(self) -> list[bytes]:
        """Every key as bytes (a Python object a key: the slow paths only)."""
        blob = self.keys
        if self.key_lens is None:
            k = self.key_len
            return [blob[i:i + k] for i in range(0, k * self.n, k)]
        ends = np.cumsum(self.key_lens).tolist()
        return [blob[a:b] for a, b in zip([0] + ends[:-1], ends)]

    def digests(self) -> tuple[np.ndarray, LongCol]:
        """(n, 4) uint64 key digests and the keys that are not their own digest (``keyindex.digests``) as a
        ``longkeys.LongCol``: the blob itself when every key is 32 bytes, no object a key when the segment carries
        its digests."""
        if self.key_lens is None and self.key_len == 32:
            return np.frombuffer(self.keys, np.uint64).reshape(self.n, 4), LongCol.of(())
        if self._dig is None:  # (once: a segment over several nodes is asked once a node)
            dig, longs = digests(self.key_list())
            self._dig = (dig, LongCol.of(longs))
        elif type(self._dig) is not tuple:  # the digest column: the keys that are not 32 bytes, as columns
            if self.key_lens is None:
                self._dig = (self._dig, LongCol.uniform(self.n, self.keys, self.key_len))
            else:
                lens = self.key_lens.astype(np.int64)
                at = np.flatnonzero(lens != 32)
                ends = np.cumsum(lens)
                blob, kends = gather(self.keys, ends.take(at) - lens.take(at), lens.take(at))
                self._dig = (self._dig, LongCol(at, kends, blob))
        return self._dig

    def parent_list(self) -> list | None:
        """Each page's parent key (None: none); None when the segment names no parent."""
        if self.parent_lens is None:
            return None
        blob = self.parent_blob
        out: list = []
        at = 0
        for ln in self.parent_lens.tolist():
            if ln == NO_PARENT:
                out.append(None)
            else:
                p = blob[at:at + ln]
                at += ln
                out.append(digest_key(p) if len(p) >= 64 else p)
        return out


def unpack_segment(value: bytes) -> Segment:
    """Parse a segment's value (``pack_segment``). Raises ValueError (as ``UNREADABLE``) when it is not one this pool
    writes: a short or long value, an index past its table, a layout code out of range (a shared entry's part count
    past MAX_SHARDS), a generation past int64, a key of 64..68 bytes not in its digest form, names not utf-8."""
    if len(value) < _SEG_HEAD.size:
        raise ValueError("a segment shorter than its head")
    magic, version, flags, n, nns, nnodes, ncodes, ndrec, ndead, key_len = _SEG_HEAD.unpack_from(value)
    if magic != SEG_MAGIC or version not in SEG_VERSIONS:
        raise ValueError(f"a record of layout version {version}, not one of {SEG_VERSIONS}")
    if (version == SEG_DEAD_VERSION) != bool(ndead) or bool(ndead) != bool(ndrec):
        raise ValueError("a dead list in a segment of another version, or one naming no record")
    if n and (not nns or not nnodes or not ncodes) or n > MAX_SEGMENT or flags & ~(F_PARENTS | F_VARKEYS | F_DIGESTS):
        raise ValueError("a segment's head out of range")
    if not n and not ndead:
        raise ValueError("a segment of no page and no dead list")
    at = _SEG_HEAD.size

    def col(dtype, count):
        nonlocal at
        a = np.frombuffer(value, dtype, count, at)  # ValueError past the end
        at += a.nbytes
        return a

    s = Segment()
    s._dig = None
    s.n = n
    s.gen = col(_U64, n)
    if flags & F_DIGESTS:
        s._dig = col(_U64, 4 * n).reshape(n, 4)
    codes = col(_U64, ncodes)
    s.dead = col(_U64, ndead)
    s.unit = col(_U32, n)
    s.key_lens = col(_U32, n) if flags & F_VARKEYS else None
    s.parent_lens = col(_U32, n) if flags & F_PARENTS else None
    name_lens = col(_U16, nns + nnodes + ndrec).tolist()
    s.nsix = col(_U16, n) if nns > 1 else np.zeros(n, _U16)
    s.nodeix = col(_U16, n) if nnodes > 1 else np.zeros(n, _U16)
    codeix = col(_U16, n) if ncodes > 1 else None
    s.dead_ix = col(_U16, ndead) if ndrec > 1 else np.zeros(ndead, _U16)
    if (ndrec > 1 and s.dead_ix.max() >= ndrec) or (nns > 1 and s.nsix.max() >= nns) or (nnodes > 1 and s.nodeix.max() >= nnodes) or (
            codeix is not None and codeix.max() >= ncodes):
        raise ValueError("a segment's index past its table")
    if (codes > _MAX_I64).any() or ((codes >> np.uint64(SHARD_SHIFT)) > MAX_SHARDS).any():
        raise ValueError("a layout code out of range")
    if (s.gen > _MAX_I64).any() or (s.dead > _MAX_I64).any():
        raise ValueError("a generation past int64")
    codes = codes.astype(np.int64)
    s.code = codes[codeix] if codeix is not None else np.full(n, codes[0] if ncodes else 0, np.int64)
    names = []
    for ln in name_lens[:nns + nnodes]:
        names.append(value[at:at + ln].decode())
        at += ln
    s.ns_names, s.node_ids = [_intern(x) for x in names[:nns]], names[nns:]
    s.dead_recs = []
    for ln in name_lens[nns + nnodes:]:
        s.dead_recs.append(value[at:at + ln])
        at += ln
    if s.key_lens is None:
        if key_len == 0 and n:
            raise ValueError("a segment's key length out of range")
        kbytes = n * key_len
        if 64 <= key_len <= 68 and any(digest_key(k) is not k for k in s_keys(value, at, np.full(n, key_len))):
            raise ValueError("a page key that is not in its one form")
    else:
        kl = s.key_lens
        if ((kl >= 64) & (kl <= 68)).any() or not kl.all():
            bad = [k for k in s_keys(value, at, kl) if not k or 64 <= len(k) <= 68 and digest_key(k) is not k]
            if bad:
                raise ValueError("a page key that is not in its one form")
        kbytes = int(kl.sum(dtype=np.int64))
    s.key_len = key_len
    s.keys = value[at:at + kbytes]
    at += kbytes
    if len(s.keys) != kbytes:
        raise ValueError("a segment's keys cut short")
    if s.parent_lens is not None:
        pl = s.parent_lens
        pbytes = int(pl[pl != NO_PARENT].sum(dtype=np.int64))
        s.parent_blob = value[at:at + pbytes]
        at += pbytes
    else:
        s.parent_blob = None
    if at != len(value):
        raise ValueError("a segment of another length than its columns")
    return s


def s_keys(value: bytes, at: int, lens: np.ndarray) -> list[bytes]:
    ends = (np.cumsum(lens) + at).tolist()
    return [value[a:b] for a, b in zip([at] + ends[:-1], ends)]


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
            plen |= n << SHARD_SHIFT  # metaserver.table.entry.layout
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

    __slots__ = ("groups", "chunks", "junk", "n", "batches", "dead", "carriers", "carried", "dropped", "_prefix", "_cut",
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
        # node id -> its pages of segments: (segment, their positions in it (None: all), revision, record's etcd key)
        self.chunks: dict[str, list[tuple[Segment, np.ndarray | None, int, bytes]]] = {}

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
        for node_id, chunks in self.chunks.items():
            g = groups.get(node_id)
            if g is None:
                g = groups[node_id] = ([], [])
            for seg, idx, rev, name in chunks:
                idx = self._live_idx(seg, idx, name)
                if idx is not None and not len(idx):
                    continue
                ents = _seg_entries(seg, idx, name)
                g[0].extend(ents)
                g[1].extend([rev] * len(ents))
        self.chunks = {}
        return groups

    def columns(self, parents: bool = True) -> "dict[str, NodePages]":
        """No more ``add``: each node's pages as columns (``NodePages``), in scan order, the msgpack layouts' entries
        and the segments' columns joined; parents when any page names one (None: none does), a segment's only when
        asked (a Python object a page: a load that links them; a msgpack record's come with its parse anyway).
        Empties what it read."""
        self._apps = {}
        ns_list: list[str] = []
        ns_of: dict[str, int] = {}
        rec_list: list = [None]
        rec_of: dict = {None: 0}
        out: dict[str, NodePages] = {}
        for node_id in list(self.groups) + [x for x in self.chunks if x not in self.groups]:
            parts = []
            ents, revs = self.groups.pop(node_id, ((), ()))
            if ents and self.dead:
                ents, revs = self._live_entries(ents, revs)
            if ents:
                parts.append(NodePages.of_entries(ents, revs, ns_of, ns_list, rec_of, rec_list, parents))
            for seg, idx, rev, name in self.chunks.pop(node_id, ()):
                if self.dead:
                    idx = self._live_idx(seg, idx, name)
                    if idx is not None and not len(idx):
                        continue
                parts.append(NodePages.of_segment(seg, idx, rev, name, ns_of, ns_list, rec_of, rec_list, parents))
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
        if any(v[:1] == _SEG_BYTE for v in values):  # segments: parsed by ``_add_batch``
            recs = [None if v[:1] == _SEG_BYTE else _unpack_or_none(v) for v in values]
        else:
            try:  # the values unpacked at C level (one unreadable one: each on its own, None for the unreadable)
                recs = list(map(unpack, values))
            except UNREADABLE:
                recs = list(map(_unpack_or_none, values))
        last_head = ns = None
        for ekey, rec, rev, kv in zip(map(_key, kvs), recs, map(_mod_revision, kvs), kvs):
            try:
                head, _, hexkey = ekey.rpartition(b"/")  # the prefix ends in "/": what ``_name`` reads
                if hexkey[:1] == BATCH_MARK:
                    self._add_batch(ekey, head, rec, kv.create_revision, kv.value)
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
        """A commit record's pages into ``groups`` (a segment's into ``chunks``), each at the record's create
        revision (a rewrite keeps its pages' place in commit order). Raises as ``UNREADABLE`` (nothing added) when
        it is not one."""
        term, dot, seq = ekey[len(head) + 2:].partition(b".")
        if not (dot and term and seq and term.isalnum() and seq.isalnum()):
            raise ValueError("a commit record's name that is not {term}.{count}")
        int(term, 16), int(seq, 16)
        if value is None and raw[:1] == _SEG_BYTE:
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
            if not seg.n:
                return
            chunks = self.chunks
            for node_id, idx in _by_node(seg):
                c = chunks.get(node_id)
                if c is None:
                    c = chunks[node_id] = []
                c.append((seg, idx, rev, ekey))
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


def _by_node(seg: Segment) -> list[tuple[str, np.ndarray | None]]:
    """(node id, positions of its pages in ``seg``, ascending; None: all of them) for each node of a segment."""
    if len(seg.node_ids) == 1:
        return [(seg.node_ids[0], None)]
    order = np.argsort(seg.nodeix, kind="stable")
    ix = seg.nodeix[order]
    cut = np.flatnonzero(ix[1:] != ix[:-1]) + 1
    return [(seg.node_ids[int(ix[lo])], order[lo:hi]) for lo, hi in
            zip(np.concatenate(([0], cut)).tolist(), np.concatenate((cut, [seg.n])).tolist())]


def _seg_entries(seg: Segment, idx: np.ndarray | None, name: bytes) -> list[Entry]:
    """The pages of ``seg`` at ``idx`` (None: all) as entries of record ``name`` (the slow paths)."""
    keys = seg.key_list()
    parents = seg.parent_list()
    at = range(seg.n) if idx is None else idx.tolist()
    ns, off, code, gen = seg.nsix.tolist(), seg.offsets().tolist(), seg.code.tolist(), seg.gen.tolist()
    names = seg.ns_names
    return [Entry(names[ns[i]], keys[i], off[i], code[i], gen[i], None if parents is None else parents[i], name)
            for i in at]


def record_entries(name: bytes, value: bytes) -> tuple[list[str], list[Entry]]:
    """(node ids, entries) of a commit record's raw value in either layout (a msgpack record's namespace is the
    record name's). Raises as ``UNREADABLE``."""
    if value[:1] == _SEG_BYTE:
        seg = unpack_segment(value)
        return [seg.node_ids[i] for i in seg.nodeix.tolist()], _seg_entries(seg, None, name)
    ns = name.rpartition(b"/")[0].rpartition(b"/")[2].decode()
    return batch_entries(ns, name, msgpack.unpackb(value))


def listed_pairs(value: bytes) -> set[tuple[bytes, int]]:
    """The (key, generation) of each page a commit record's raw value lists, either layout (a standby's rewrite).
    Raises as ``UNREADABLE``."""
    if value[:1] == _SEG_BYTE:
        seg = unpack_segment(value)
        return set(zip(seg.key_list(), seg.gen.tolist()))
    return {(e.key, e.gen) for e in batch_entries("", b"", msgpack.unpackb(value))[1]}


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
    def of_segment(cls, seg: Segment, idx, rev: int, name: bytes, ns_of, ns_list, rec_of, rec_list,
                   parents: bool) -> "NodePages":
        dig, longs = seg.digests()
        nsm = np.array([cls._ix(ns_of, ns_list, x) for x in seg.ns_names], np.uint16)
        par = seg.parent_list() if parents else None
        m = seg.n
        if idx is None:
            nsix, off, code, gen = nsm[seg.nsix], seg.offsets(), seg.code, seg.gen
        else:
            m = len(idx)
            longs = longs.select(idx)  # their positions among ``idx`` (ascending)
            dig = dig[idx]
            nsix, off, code, gen = nsm[seg.nsix[idx]], seg.offsets()[idx], seg.code[idx], seg.gen[idx]
            if par is not None:
                par = [par[i] for i in idx.tolist()]
        return cls._make(nsix, dig, longs, off, code, gen, np.full(m, rev, np.int64),
                         np.full(m, cls._ix(rec_of, rec_list, name), np.int32), par)

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


def pages_of(value: bytes) -> list[list]:
    """A commit record's pages in the msgpack layout (``[key, node_id, offset, payload_len, gen, parent]``, a
    shared entry's with its part count appended), whichever layout ``value`` is in (tests, tools)."""
    if value[:1] != _SEG_BYTE:
        return msgpack.unpackb(value)
    seg = unpack_segment(value)
    out = []
    for e, node in zip(_seg_entries(seg, None, b""), [seg.node_ids[i] for i in seg.nodeix.tolist()]):
        p = [e.key, node, e.offset, e.payload_len, e.gen, e.parent]
        if e.payload_len > PART_MASK:
            p[3], n = e.payload_len & PART_MASK, e.payload_len >> SHARD_SHIFT
            p.append(n)
        out.append(p)
    return out
