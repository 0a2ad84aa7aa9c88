"""The etcd values of page records, written and read: the one module that packs and unpacks them (the key layout is
``metaserver/store/persist.py``'s).
``_name`` reads a page's etcd key. A load's parse of them, grouped by node, is ``metaserver/table/snapshot.py``.

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

import msgpack
import numpy as np

from metaserver.table.entry import PART_MASK, SHARD_SHIFT, Entry
from metaserver.table.longkeys import LongCol, gather
from transport.keyform import digest_key, digests
from umbp.config import MAX_SHARDS

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
# key_len each); the keys' digests (``longkeys.digests``) as a column, so a load hashes no key
NO_PARENT = 0xFFFFFFFF  # a parent length that says: none
_U64, _U32, _U16 = np.dtype("<u8"), np.dtype("<u4"), np.dtype("<u2")
_MAX_I64_INT = (1 << 63) - 1
_MAX_I64 = np.uint64(_MAX_I64_INT)
SEG_BYTE = bytes([SEG_MAGIC])


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
    return value[:1] == SEG_BYTE


class Segment:
    """A parsed segment (``unpack_segment``): its tables and columns as numpy arrays (``nsix``, ``nodeix``, ``unit``,
    ``code`` (int64 layout codes a page, made from ``codes`` and ``codeix``), ``gen``, ``dead`` with ``dead_ix``, an index in ``dead_recs``: the etcd
    key of the record of each dead generation's page), its keys as one blob (``key_len`` bytes each, or
    ``key_lens``; ``same_len``: their one length when every key has it, else 0; a memoryview of the value, which
    ``digests`` passes on: ``LongCol``'s ``pick`` and ``select`` make bytes of it) and its parents' blob
    (``parent_lens``; None without parents)."""

    __slots__ = ("n", "ns_names", "node_ids", "nsix", "nodeix", "unit", "codes", "codeix", "gen", "dead", "dead_ix", "dead_recs",
                 "keys", "key_len",
                 "key_lens", "same_len", "parent_lens", "parent_blob", "_dig")

    def offsets(self) -> np.ndarray:
        return self.unit.astype(np.int64) << 12

    @property
    def code(self) -> np.ndarray:
        """Each page's layout code (int64): ``codes`` (the table, int64) at ``codeix`` (u16; None: one code), made
        when asked (a load maps ``codeix`` itself: no column a segment while the scan holds them all)."""
        if self.codeix is None:
            return np.full(self.n, self.codes[0] if len(self.codes) else 0, np.int64)
        return self.codes.take(self.codeix)

    def key_list(self) -> list[bytes]:
        """Every key as bytes (a Python object a key: the slow paths only)."""
        blob = bytes(self.keys)
        if self.key_lens is None:
            k = self.key_len
            return [blob[i:i + k] for i in range(0, k * self.n, k)]
        ends = np.cumsum(self.key_lens).tolist()
        return [blob[a:b] for a, b in zip([0] + ends[:-1], ends)]

    def digests(self) -> tuple[np.ndarray, LongCol]:
        """(n, 4) uint64 key digests and the keys that are not their own digest (``longkeys.digests``) as a
        ``longkeys.LongCol``: the blob itself when every key is 32 bytes, no object a key when the segment carries
        its digests."""
        if self.key_lens is None and self.key_len == 32:
            return np.frombuffer(self.keys, np.uint64).reshape(self.n, 4), LongCol.of(())
        if self._dig is None:  # (once: a segment over several nodes is asked once a node)
            dig, longs = digests(self.key_list())
            self._dig = (dig, LongCol.of(longs))
        elif type(self._dig) is not tuple:  # the digest column: the keys that are not 32 bytes, as columns
            if self.key_lens is None or self.same_len:  # (keys of one length: a TP rank's are all 33 bytes)
                k = self.same_len or self.key_len
                self._dig = (self._dig, LongCol.uniform(self.n, self.keys, k) if k != 32 else LongCol.of(()))
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
    # (the checks are a segment's fixed cost, about 19k segments at 10 M pages: a reduction each, no temporary;
    # the code table, a few entries, in Python)
    if any(c > _MAX_I64_INT or c >> SHARD_SHIFT > MAX_SHARDS for c in codes.tolist()):
        raise ValueError("a layout code out of range")
    if (n and s.gen.max() > _MAX_I64) or (ndead and s.dead.max() > _MAX_I64):
        raise ValueError("a generation past int64")
    s.codes = codes.astype(np.int64)
    s.codeix = codeix
    names = []
    for ln in name_lens[:nns + nnodes]:
        names.append(value[at:at + ln].decode())
        at += ln
    s.ns_names, s.node_ids = [_intern(x) for x in names[:nns]], names[nns:]
    s.dead_recs = []
    for ln in name_lens[nns + nnodes:]:
        s.dead_recs.append(value[at:at + ln])
        at += ln
    s.same_len = 0
    if s.key_lens is None:
        if key_len == 0 and n:
            raise ValueError("a segment's key length out of range")
        kbytes = n * key_len
        if 64 <= key_len <= 68 and any(digest_key(k) is not k for k in s_keys(value, at, np.full(n, key_len))):
            raise ValueError("a page key that is not in its one form")
    else:
        kl = s.key_lens
        lo, hi = (int(kl.min()), int(kl.max())) if n else (1, 1)
        if not (lo and (hi < 64 or lo > 68)) and (((kl >= 64) & (kl <= 68)).any() or not kl.all()):
            bad = [k for k in s_keys(value, at, kl) if not k or 64 <= len(k) <= 68 and digest_key(k) is not k]
            if bad:
                raise ValueError("a page key that is not in its one form")
        if lo == hi:  # keys of one length (what a segment of a TP rank's 33-byte keys holds)
            s.same_len = lo if n else 0
            kbytes = n * lo
        else:
            kbytes = int(kl.sum(dtype=np.int64))
    s.key_len = key_len
    s.keys = memoryview(value)[at:at + kbytes]  # (no copy: the columns above hold ``value`` anyway, and a load's
    # copy of every key was new memory to fault in, 35 bytes a page)
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


def segment_entries(seg: Segment, idx: np.ndarray | None, name: bytes) -> list[Entry]:
    """The pages of ``seg`` at ``idx`` (None: all) as entries of record ``name`` (the slow paths)."""
    keys = seg.key_list()
    parents = seg.parent_list()
    at = range(seg.n) if idx is None else idx.tolist()
    ns, off, code, gen = seg.nsix.tolist(), seg.offsets().tolist(), seg.code.tolist(), seg.gen.tolist()
    names = seg.ns_names
    return [Entry(names[ns[i]], keys[i], off[i], code[i], gen[i], None if parents is None else parents[i], name)
            for i in at]


def listed_pairs(value: bytes) -> set[tuple[bytes, int]]:
    """The (key, generation) of each page a commit record's raw value lists, either layout (a standby's rewrite).
    Raises as ``UNREADABLE``."""
    if value[:1] == SEG_BYTE:
        seg = unpack_segment(value)
        return set(zip(seg.key_list(), seg.gen.tolist()))
    return {(e.key, e.gen) for e in batch_entries("", b"", msgpack.unpackb(value))[1]}


def pages_of(value: bytes) -> list[list]:
    """A commit record's pages in the msgpack layout (``[key, node_id, offset, payload_len, gen, parent]``, a
    shared entry's with its part count appended), whichever layout ``value`` is in (tests, tools)."""
    if value[:1] != SEG_BYTE:
        return msgpack.unpackb(value)
    seg = unpack_segment(value)
    out = []
    for e, node in zip(segment_entries(seg, None, b""), [seg.node_ids[i] for i in seg.nodeix.tolist()]):
        p = [e.key, node, e.offset, e.payload_len, e.gen, e.parent]
        if e.payload_len > PART_MASK:
            p[3], n = e.payload_len & PART_MASK, e.payload_len >> SHARD_SHIFT
            p.append(n)
        out.append(p)
    return out
