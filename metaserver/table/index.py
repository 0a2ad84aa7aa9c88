"""Key -> row for the columnar page table (``metaserver/table/columns.py``): a bucketed cuckoo hash table in numpy over
32-byte key digests, probed a whole batch at a time.

Why not a dict: at 10 M pages a dict look-up is three dependent cache misses (index slot, entry, the stored key
object for the equality test) taken one key at a time by the interpreter, and the dict, the row's int and the key's
bytes object cost about 140 bytes a page. Here a page costs its 32-byte digest in a column (``kc``) and 7.3 to 9.1
bytes of buckets (6.4 bytes a slot at a load between ``REBUILD_LOAD`` and ``MAX_LOAD``; the open-addressing table
this replaced cost 17 to 34: 8-byte slots at most half full, powers of two), and a batch's probes are numpy
gathers, whose independent loads the CPU overlaps.

Keys. A key of 32 bytes (SGLang's page hash, sent raw: ``umbp.keys.normalize_key``) is its own digest; any other key
is represented by its blake2b-256 digest (personalised, so it cannot equal a raw 32-byte key without a second
preimage: ``longkeys.digests``) and its bytes are kept in ``long_keys`` (row -> key) for whoever needs the original
(listings, etcd record names). Two keys are the same page exactly when namespace and digest match.

Why the whole 32 bytes stay. (1) ``key_of`` gives a 32-byte key back from its digest: commit records list their
rows' keys each time one is rewritten (``table/commits.py``), and listings, a returning node's pages, the warm
copy's rows and ``fingerprint`` read keys back; a shorter column would need the keys kept elsewhere. (2) A shorter
digest is not safe as the page's identity: a raw key is its own digest, so two client keys that share the kept
bytes (``b"\\x07" * 24 + counter`` shares 16) would be one page; and a reader is not saved by the object header,
because a closed pool's LOOKUP answers the keyed tag kept in the row's ``tag`` column (``grants._kept_tags``:
computed from the key of the row's first LOOKUP), and the client checks the header against that
tag (``objformat.check_object_header`` via ``transport.base.read_from_arena``, ``umbp/client.py`` ``_read_ops``), not
against one of its own key: the header would match and the reader would get the other key's bytes.

Buckets (``_Buckets``): ``words``, (buckets, 16) u32, one 64-byte line a bucket: ``SLOTS`` = 10 slots, each a row + 1
in words 0-9 and a 16-bit tag in words 10-14 (``tags``, a u16 view), and in word 15 the bucket's count of rows
(``fill``). A bucket is compact: its rows are in slots 0 .. fill - 1, the other slots 0 (row and tag; a filled
slot's tag is never 0). A key's two candidate buckets and its tag come from ``h(ns, digest)``, the xor of
multiply-shift hashes of the four digest words and the namespace under odd multipliers drawn at random per process
(keys that differ in any word land apart unless the multipliers are known, so a client that picks raw 32-byte keys
cannot aim them at a bucket), times an odd multiplier of the table's own (``salt``: where a row goes in a new table
does not depend on where it was in the old one, so a drained slice of buckets spreads over the new table instead
of filling one stretch of it): b1 from its high half, b2 and the tag from a second multiply (bits 32-63 and 16-31),
each bucket index by multiply-shift range reduction, so the bucket count need not be a power of two and a resize
grows by about 1.26x, not 2x. Invariant: every live row is filed exactly once, in one of its two buckets with its
tag (or, vanishingly rarely, in ``stash``: below).

``find``: one gather of both buckets' lines for every key of the batch, the tags compared (a tag matches another
key's slot with odds 2^-16 a slot, so about 3e-4 extra digest reads a key), and the digests and namespaces of the
rows whose tag matches read from the columns. No probe sequence: a lookup reads two lines, present or absent.
``insert`` rounds over the batch: each key goes to the emptier of its two buckets (the fills), one key a bucket a
round (the keys aiming at one bucket each write their index above its fill; the one read back wins: no sort), the
others look again next round. A key whose two buckets are both full moves one of their 20 rows to that row's other
bucket where it has room and takes its slot (a cuckoo move one deep, one out of and one into a bucket a round);
when none of the 20 can move, the key takes a random row's slot and that row is placed (or moves on) in the next
round, a random walk. Near ``MAX_LOAD`` about 4-8% of inserts move a row, and a batch of 1,000 takes two rounds; a
row that ``KICK_ROUNDS`` rounds did not place goes to ``stash`` (rows that ``find`` compares directly, one numpy
step each), and the next insert starts a resize that files them. A delete moves its bucket's last row into the
hole (one a bucket a round): no tombstones, so a pool that evicts as many pages as it adds never rebuilds its
index.

Resizing is incremental, as Redis's ``dict.c`` rehash: when the rows would pass ``MAX_LOAD`` of the slots, a new
table is made with ``REBUILD_LOAD`` of its slots holding the live rows (and the insert), and the old one is drained
into it a slice at a time: each insert of n rows moves the rows of the next ``pace`` x n slots of the old table
(``pace`` chosen so the drain ends before the new table has used half its room above ``REBUILD_LOAD``), and
``step(budget)`` (the owner's background tick) moves the rows of ``budget`` more. Meanwhile new rows go to the new
table, ``find`` probes the new table and then, for the keys it did not find, the old one, and ``delete`` unfiles a
row from whichever holds it. Invariant: every live row is filed exactly once, in one of the two (or the stash), and
the old table's buckets below the drain cursor are empty. Only an insert that would overfill the new table before
the drain ends (one request of more rows than the room left, far past what the pace allows for) finishes the drain
at once.

``watch`` (None, or a callable (rows, sign)): told of rows filed (1, after an insert) and about to be unfiled (-1,
before a delete), for counts kept per row elsewhere (``metaserver/table/quotas.py``). Moves of a resize are neither.

Costs: ``find`` and ``delete`` O(n) numpy work for n keys in a few dozen numpy calls (two lines gathered a key; while
a drain runs, keys not in the new table are looked for in the old one too); ``insert`` the same in a round or two,
plus its share of the drain, O(pace x n) slots scanned and their rows moved (a row moved costs a random read of its
digest: a pool growing from empty moves each row about 4.6 times over its resizes, against about 1 for the
power-of-two table this replaced, so filling costs about 0.5 us a key more; a full pool moves none); no step is
O(table). Measured on the 2-core VM, index alone, 1 M rows, 1,000-key batches: find 0.12 us a key (the table
before: 0.12), a delete and an insert at load 0.85 0.8 us (before: 1.3).
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from metaserver.table.longkeys import LongCol, LongKeys

SLOTS = 10  # slots a bucket: rows in u32 words 0-9, tags in u16 20-29 of its 16-word line
_WORDS = 16
_TAG0 = 2 * SLOTS  # the first tag's u16 index in a line
MIN_SLOTS = 1 << 15  # the smallest table (slots)
MAX_LOAD = 0.88  # rows over slots that triggers a resize
REBUILD_LOAD = 0.7  # the most rows over slots a resize leaves
KICK_ROUNDS = 64  # insert rounds before a row no bucket took goes to the stash
_TILE = 4096  # digests a batch hashes with the multipliers repeated (a request's keys; 128 KiB of them)
# Operands as 0-d arrays: a ufunc with a Python int or numpy scalar operand pays ~300 ns converting it (NumPy 2's
# scalar promotion), twice a small batch's whole op; a request's find and lookup are a few dozen such ops.
_S29, _S32 = np.array(29, np.uint64), np.array(32, np.uint64)
_ONE16, _ONE32 = np.array(1, np.uint16), np.array(1, np.uint32)
_ALL4 = np.array(0x01010101, np.uint32)  # four true bools read as one u32
_SLOTS0, _GAP0 = np.array(SLOTS, np.int64), np.array(_WORDS - SLOTS, np.int64)
_WORDS0, _TAG0_0 = np.array(_WORDS, np.int64), np.array(_TAG0, np.int64)
COPY_TAGS = 512  # keys of a find from which the bucket tags are compared as a contiguous copy (1,024: 22 vs 32 us)
SET_FIRST = 128  # up to this many deletes a round tell whether two share a bucket with a set, past it np.unique
PLACE_ROWS = 1 << 20  # rows an insert files a ``_place`` at most (``_file``)


def zeros(shape, dtype) -> np.ndarray:
    """A zeroed array in anonymous memory of its own (mmap): dropping it hands the pages back to the OS at once,
    where a freed heap block would stay in RSS."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    n = int(np.prod(shape))
    itemsize = np.dtype(dtype).itemsize
    return np.frombuffer(mmap.mmap(-1, max(n * itemsize, 1)), dtype, count=n).reshape(shape)


def _same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise equality of two (n, 4) digest arrays: one compare, each row's four bools read as one u32 (three numpy
    calls; four word compares and their ands were eight, ``all(axis=1)`` a slow reduction)."""
    return (a == b).view(np.uint32).ravel() == _ALL4


class _Buckets:
    """One table: ``n`` buckets of ``SLOTS`` slots (module docstring) and its count of filed rows."""

    __slots__ = ("words", "rows", "tags", "fill", "n", "n0", "live", "salt", "mix")

    def __init__(self, n: int):
        # odd multipliers of its own: where a row goes here is independent of where it was in the table it is
        # drained from (a drained slice of buckets would otherwise land on one stretch of this one and fill it)
        self.salt, self.mix = (np.array(x) for x in np.frombuffer(os.urandom(16), np.uint64) | np.uint64(1))
        self.words = zeros((n, _WORDS), np.uint32)  # zero pages: every slot empty without a pass over them
        self.rows = self.words[:, :SLOTS]  # row + 1; 0: empty
        self.tags = self.words.view(np.uint16)[:, _TAG0:_TAG0 + SLOTS]
        self.fill = self.words[:, _WORDS - 1]  # filled slots of each bucket: its slots 0 .. fill - 1
        self.n = n
        self.n0 = np.array(n, np.uint64)
        self.live = 0

    @property
    def capacity(self) -> int:
        return self.n * SLOTS


class KeyIndex:
    """Rows by (namespace index, key digest). Rows and their namespaces are the page table's; this holds the digest
    column ``kc`` (grown with the table's rows by ``grow``), the buckets (``t``, and ``old`` while a resize drains
    it), the stash and the long keys."""

    def __init__(self) -> None:
        self.kc = zeros((0, 4), np.uint64)
        self.long_keys = LongKeys()  # row -> key of the keys that are not their own digest (``longkeys.py``)
        self._m = np.frombuffer(os.urandom(32), np.uint64) | np.uint64(1)  # odd multipliers, one per digest word
        self._mt = np.tile(self._m, _TILE)  # and repeated for a batch of up to _TILE digests: one flat multiply
        self._mns = int.from_bytes(os.urandom(8), "little") | 1  # and one for the namespace
        self._mns0 = np.array(self._mns, np.uint64)
        self._nsw: dict[int, tuple] = {}  # namespace index -> (its hash word, itself as a u16), 0-d arrays
        self._rng = np.random.default_rng()
        self.t = _Buckets(-(-MIN_SLOTS // SLOTS))
        self.old: _Buckets | None = None  # the table being drained into ``t`` (None: no resize under way)
        self.cursor = 0  # the old table's buckets below this are empty
        self.pace = 0  # old slots drained per row inserted, for the drain under way
        self.stash = np.zeros(0, np.int64)  # rows no bucket took (module docstring); almost always empty
        self.watch = None  # (rows, sign) -> None: told of rows filed (1) and about to be unfiled (-1)
        self.resizes = 0
        self.drained = 0  # old slots drained, over all resizes (figures, tests)
        self.kicks = 0  # rows moved to their other bucket to make room (figures, tests)
        self.rounds = 0  # insert rounds, over all inserts and drains (figures, tests)

    @property
    def capacity(self) -> int:
        """Slots of the current table (what tests and figures read)."""
        return self.t.capacity

    @property
    def live(self) -> int:
        return self.t.live + (self.old.live if self.old is not None else 0) + len(self.stash)

    def grow(self, rows: int) -> None:
        if rows >= 1 << 32:  # a slot holds row + 1 in 32 bits (the rec column is u32 too)
            raise OverflowError("keyindex: 4 G rows, past what a slot can name")
        have = len(self.kc)
        if rows > have:
            kc = zeros((rows, 4), np.uint64)
            kc[:have] = self.kc
            self.kc = kc

    def _hash(self, nsix, dig: np.ndarray) -> np.ndarray:
        """h (uint64) of digests ``dig`` in namespaces ``nsix`` (an int or one per digest)."""
        n = len(dig)
        # each word by its multiplier, in one call (wraps, as meant); flat for a request's batch (a broadcast of the
        # four multipliers loops four words at a time: twice as slow at 1,024 keys)
        x = (dig.reshape(-1) * self._mt[:4 * n]).reshape(n, 4) if n <= _TILE else dig * self._m
        h = x[:, 0] ^ x[:, 1]  # (columns one at a time: an (n, 2) op loops two words at a time, 3x slower at 1,024)
        h ^= x[:, 2]
        h ^= x[:, 3]
        if type(nsix) is not int and np.ndim(nsix):  # (a request's one namespace: no dispatch to np.ndim)
            h ^= np.asarray(nsix, np.uint64) * self._mns0
        elif nsix:
            h ^= self._ns_words(int(nsix))[0]
        return h

    def _ns_words(self, nsix: int) -> tuple[np.ndarray, np.ndarray]:
        """Namespace ``nsix``'s hash word and its index as a u16, as 0-d arrays (made once a namespace)."""
        got = self._nsw.get(nsix)
        if got is None:
            got = self._nsw[nsix] = (np.array(nsix * self._mns % 2**64, np.uint64), np.array(nsix, np.uint16))
        return got

    @staticmethod
    def _where(h: np.ndarray, tab: _Buckets) -> tuple[np.ndarray, np.ndarray]:
        """The buckets in ``tab`` of hashes ``h`` (n of them), as one int64 array: every first bucket, then every
        second one; and the tags (u16, never 0)."""
        n = len(h)
        f = h * tab.salt
        bb = np.empty(2 * n, np.uint64)
        np.right_shift(f, _S32, out=bb[:n])
        g = f >> _S29
        g ^= f
        g *= tab.mix
        np.right_shift(g, _S32, out=bb[n:])
        bb *= tab.n0  # < 2**32 times < 2**32: no wrap
        bb >>= _S32
        tag = g.view(np.uint16)[1::4]  # bits 16-31 of g (little-endian words, as every column here): a view
        np.maximum(tag, _ONE16, out=tag)
        return bb.view(np.int64), tag

    def _buckets(self, h: np.ndarray, tab: _Buckets) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``_where`` as (first buckets, second buckets, tags)."""
        bb, tag = self._where(h, tab)
        return bb[:len(h)], bb[len(h):], tag

    # -- queries ----------------------------------------------------------------------------------------------
    def find(self, nsix: int, dig: np.ndarray, ns_col: np.ndarray | None) -> np.ndarray:
        """Rows (int64, -1: absent) of digests ``dig`` in namespace ``nsix``; ``ns_col`` is the table's namespace
        column (a row matches when its digest and namespace do), None when every filed row is of ``nsix`` (the
        table has one namespace: the rows' namespaces are not read). While a resize drains, the keys the new table
        does not hold are looked for in the old one."""
        n = len(dig)
        rows = np.empty(n, np.int64)
        rows.fill(-1)
        if not n:
            return rows
        h = self._hash(nsix, dig)
        if self.t.live:
            self._find_in(self.t, nsix, h, dig, ns_col, rows, None)
        old = self.old
        if (old is not None and old.live) or len(self.stash):
            miss = np.flatnonzero(rows < 0)
            if len(miss) and old is not None and old.live:
                self._find_in(old, nsix, h[miss], dig[miss], ns_col, rows, miss)
                miss = miss[rows[miss] < 0]
            for r in self.stash.tolist():
                if len(miss) and (ns_col is None or ns_col[r] == nsix):
                    got = miss[_same(dig[miss], self.kc[r:r + 1])]
                    rows[got] = r
                    miss = miss[rows[miss] < 0]
        return rows

    def _find_in(self, tab: _Buckets, nsix, h: np.ndarray, dig: np.ndarray, ns_col: np.ndarray | None,
                 rows: np.ndarray, at: np.ndarray | None) -> None:
        """``find`` in one table: ``rows[at[i]]`` (``rows[i]`` when ``at`` is None) set for each digest ``dig[i]``
        (hash ``h[i]``) it holds."""
        n = len(h)
        bb, tag = self._where(h, tab)
        lines = tab.words.take(bb, axis=0)  # (2n, 16): both buckets of every key
        tl = lines.view(np.uint16)[:, _TAG0:_TAG0 + SLOTS]
        if n < COPY_TAGS:
            hits = (tl.reshape(2, n, SLOTS) == tag[None, :, None]).ravel().nonzero()[0]
        else:  # the tags copied out and compared with each key's tag repeated: one long compare, not 2n of 10 lanes
            hits = (np.ascontiguousarray(tl).reshape(2, n * SLOTS) == tag.repeat(SLOTS)).ravel().nonzero()[0]
        if not len(hits):
            return
        k = hits // _SLOTS0  # each hit's line: every key's first bucket, then every second one (np.nonzero of a
        cand = lines.ravel().take(k * _GAP0 + hits)  # 3-d mask, or the mask's gather, cost several times these)
        cand -= _ONE32  # u32 rows (a tag matches filled slots only: row + 1 >= 1)
        k %= n  # each hit's key
        ok = _same(self.kc.take(cand, axis=0), dig.take(k, axis=0))
        if ns_col is not None:
            ok &= ns_col.take(cand) == self._ns_words(nsix)[1]
        if np.count_nonzero(ok) != len(ok):  # (every tag match a key's row, the usual: no masks)
            k = k[ok]
            cand = cand[ok]
        rows[k if at is None else at.take(k)] = cand

    def key_of(self, row: int) -> bytes:
        """The key of a live row (its bytes: the digest itself for a 32-byte key)."""
        k = self.long_keys.get(row)
        return k if k is not None else self.kc[row].tobytes()

    def keys_of(self, rows: np.ndarray) -> list[bytes]:
        """``key_of`` of each of ``rows`` (numpy per chunk of long keys, the digests one slice each)."""
        rows = np.asarray(rows, np.int64)
        raw = self.kc.take(rows, axis=0).tobytes()
        out = [raw[i:i + 32] for i in range(0, 32 * len(rows), 32)]
        if self.long_keys:
            for i, k in enumerate(self.long_keys.keys_of(rows)):
                if k is not None:
                    out[i] = k
        return out

    # -- changes ----------------------------------------------------------------------------------------------
    def insert(self, rows: np.ndarray, dig: np.ndarray, ns_col: np.ndarray,
               longs: list[tuple[int, bytes]] | None = None, row_list: list[int] | None = None) -> None:
        """File new rows (absent keys, their namespaces already in ``ns_col``; their digests ``dig`` go into
        ``kc``), starting a resize first if they would fill the table past ``MAX_LOAD`` (or rows wait in the stash),
        then drain the old table by this insert's share (module docstring). ``longs``: (position in ``rows``, key)
        of keys that are not their own digest; ``row_list``: ``rows`` as a list, where the caller has it."""
        rows = np.asarray(rows, np.int64)
        self.kc[rows] = dig
        if isinstance(longs, LongCol):  # a load's: columns, no object a key
            if longs:
                self.long_keys.add_bulk(rows.take(longs.pos), longs)
        elif longs:
            self.long_keys.add(rows.tolist() if row_list is None else row_list, longs)
        if len(rows):
            self._file(rows, self._hash(ns_col.take(rows), dig), ns_col)

    def _file(self, rows: np.ndarray, h: np.ndarray, ns_col: np.ndarray) -> None:
        """``insert``'s second half: rows (hashes ``h``) filed, after a resize starts if they would pass
        ``MAX_LOAD``; then this insert's share of the drain."""
        n = len(rows)
        if self.live + n > MAX_LOAD * self.t.capacity or (len(self.stash) and self.old is None):
            if self.old is not None:  # more than the pace allowed for: finish that drain first
                self._drain(self.old.capacity, ns_col)
            self._resize(n, ns_col)
        # a bucket takes one key a round: a load's rows go in parts of an eighth of the buckets (at 4 M rows: 0.09
        # us a row, against 0.14 in one part), small enough for _place's key marks (28 bits)
        part = min(PLACE_ROWS, max(4096, self.t.n // 8))
        for lo in range(0, n, part):
            self._place(self.t, rows[lo:lo + part], h[lo:lo + part], ns_col)
        if self.old is not None:
            self._drain(self.pace * n, ns_col)
        if self.watch is not None:
            self.watch(rows, 1)

    def reserve(self, rows: int) -> None:
        """Size an empty index for ``rows`` rows at once (a full load knows its count), instead of resizing and
        draining as it fills. No effect on an index that holds anything."""
        if not self.live and self.old is None and rows:
            self._resize(rows, None)

    def step(self, budget: int, ns_col: np.ndarray) -> int:
        """Drain at most ``budget`` slots (whole buckets; at least one) of a resize under way (the owner's
        background step); returns how many."""
        return self._drain(budget, ns_col) if self.old is not None and budget > 0 else 0

    def _resize(self, adding: int, ns_col: np.ndarray | None) -> None:
        """Start draining the current table into a new one sized for its live rows and ``adding`` more; the stash's
        rows are filed in the new one now."""
        old = self.t
        held = old.live + len(self.stash)
        n = max(-(-MIN_SLOTS // SLOTS), int((held + adding) / (REBUILD_LOAD * SLOTS)) + 1)
        self.t = _Buckets(n)
        self.resizes += 1
        self.cursor = 0
        self.old = old if old.live else None
        # finish while the new table has used at most half its room between REBUILD_LOAD and MAX_LOAD
        room = (MAX_LOAD * self.t.capacity - held - adding) / 2
        self.pace = max(1, -int(-old.capacity // max(room, 1)))
        if len(self.stash):
            stash, self.stash = self.stash, np.zeros(0, np.int64)
            self._place(self.t, stash, self._hash(ns_col.take(stash), self.kc[stash]), ns_col)

    def _drain(self, budget: int, ns_col: np.ndarray) -> int:
        """Move the rows of the old table's next ``budget`` slots (whole buckets, at least one) into the new one;
        drop the old table once drained. Returns slots visited."""
        old = self.old
        lo = self.cursor
        hi = min(old.n, lo + max(1, budget // SLOTS))
        part = old.rows[lo:hi]
        moved = part[part != 0].astype(np.int64) - 1
        old.words[lo:hi] = 0
        old.live -= len(moved)
        if len(moved):
            self._place(self.t, moved, self._hash(ns_col.take(moved), self.kc[moved]), ns_col)
        self.cursor = hi
        self.drained += (hi - lo) * SLOTS
        if hi == old.n:
            self.old = None
        return (hi - lo) * SLOTS

    def _place(self, tab: _Buckets, rows: np.ndarray, h: np.ndarray, ns_col: np.ndarray) -> None:
        """The insert rounds of the module docstring: file ``rows`` (hashes ``h``) in ``tab``."""
        b1, b2, tag = self._buckets(h, tab)
        rows = np.array(rows, np.int64)  # a copy: kicked rows take the places of those they made room for
        val = (rows + 1).astype(np.uint32)
        came = np.full(len(rows), -1, np.intp)  # the bucket a kicked row was just moved out of
        fills = tab.fill
        for _ in range(KICK_ROUNDS):
            if not len(rows):
                return
            self.rounds += 1
            f1 = fills[b1]
            f2 = fills[b2]
            second = f2 < f1
            to = np.where(second, b2, b1)
            fill = np.where(second, f2, f1)
            # one key a bucket a round: each writes its index above the bucket's fill, the one read back wins (no
            # sort; the others look again next round, at the fills this round leaves)
            idx = np.arange(len(to), dtype=np.uint32)
            fills[to] = (idx << 4) | fill
            won = (fills[to] >> 4) == idx
            fills[to] = fill
            ok = won & (fill < SLOTS)
            i = ok.nonzero()[0]  # (not np.flatnonzero: three Python calls about one C one)
            if len(i):
                b, sl = to[i], fill[i]
                tab.rows[b, sl] = val[i]
                tab.tags[b, sl] = tag[i]
                fills[b] = sl + 1
                tab.live += len(i)
            left = ~ok
            full = (won & (fill >= SLOTS)).nonzero()[0]  # both buckets full (one key a bucket, as above)
            if len(full):
                moved, stuck = self._shift(tab, full, b1, b2, val, tag, ns_col)
                left[moved] = False
                if len(stuck):  # no row of either bucket can move to its other one: kick one out (a random walk)
                    self._kick(tab, stuck, rows, val, tag, b1, b2, came, ns_col)
            keep = left.nonzero()[0]
            if not len(keep):  # every key filed (a request's usual first round): no gathers of nothing
                return
            rows, val, tag, b1, b2, came = (a[keep] for a in (rows, val, tag, b1, b2, came))
        self.stash = np.concatenate((self.stash, rows))

    def _shift(self, tab: _Buckets, full: np.ndarray, b1: np.ndarray, b2: np.ndarray, val: np.ndarray,
               tag: np.ndarray, ns_col: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For the keys at ``full`` (both buckets full): move a row of one of their buckets to that row's other
        bucket where it has a free slot and file the key in the slot it left, one move out of and into a bucket a
        round. Returns the keys so filed and those none of whose 20 rows can move."""
        m = len(full)
        src = np.concatenate((b1.take(full), b2.take(full)))
        r = tab.words.take(src, axis=0)[:, :SLOTS].ravel().astype(np.int64) - 1  # (2m x SLOTS) rows, all filed
        x1, x2, _ = self._buckets(self._hash(ns_col.take(r), self.kc.take(r, axis=0)), tab)
        at = np.repeat(src, SLOTS)
        alt = np.where(x1 == at, x2, x1)  # each row's other bucket (its own when both are one: full, never taken)
        can = (tab.fill[alt] < SLOTS).reshape(2, m, SLOTS).transpose(1, 0, 2).reshape(m, 2 * SLOTS)
        has = can.any(axis=1)
        j = np.flatnonzero(has)
        c = can[j].argmax(axis=1)
        pos = (c // SLOTS) * (m * SLOTS) + j * SLOTS + c % SLOTS  # its row's index in ``r``
        sb, tb = at.take(pos), alt.take(pos)
        first = np.zeros(len(j), bool)
        first[np.unique(sb, return_index=True)[1]] = True
        once = np.zeros(len(j), bool)
        once[np.unique(tb, return_index=True)[1]] = True
        go = np.flatnonzero(first & once)  # the others wait for the next round
        j, pos, sb, tb = j[go], pos[go], sb[go], tb[go]
        ss = pos % SLOTS
        ts = tab.fill[tb]
        tab.rows[tb, ts] = tab.rows[sb, ss]
        tab.tags[tb, ts] = tab.tags[sb, ss]
        tab.fill[tb] = ts + 1
        k = full[j]
        tab.rows[sb, ss] = val[k]
        tab.tags[sb, ss] = tag[k]
        tab.live += len(k)
        self.kicks += len(k)
        return k, full[~has]

    def _kick(self, tab: _Buckets, full: np.ndarray, rows: np.ndarray, val: np.ndarray, tag: np.ndarray,
              b1: np.ndarray, b2: np.ndarray, came: np.ndarray, ns_col: np.ndarray) -> None:
        """For the keys at ``full``: file each in a random slot of one of its buckets (not the one it was kicked out
        of), one a bucket a round; the row that held it takes the key's place in the arrays, to be filed next
        round."""
        pick = np.where(came[full] == b1[full], b2[full], b1[full])
        fresh = came[full] < 0
        pick[fresh] = np.where(self._rng.random(int(fresh.sum())) < 0.5, b1[full][fresh], b2[full][fresh])
        pick, first = np.unique(pick, return_index=True)  # one kick a bucket a round
        full = full[first]
        slot = self._rng.integers(0, SLOTS, len(full))
        out_val = tab.rows[pick, slot].copy()
        out_tag = tab.tags[pick, slot].copy()
        tab.rows[pick, slot] = val[full]
        tab.tags[pick, slot] = tag[full]
        self.kicks += len(full)
        out = out_val.astype(np.int64) - 1
        ob1, ob2, _ = self._buckets(self._hash(ns_col.take(out), self.kc[out]), tab)
        rows[full], val[full], tag[full], b1[full], b2[full], came[full] = out, out_val, out_tag, ob1, ob2, pick

    def delete(self, rows: np.ndarray, ns: np.ndarray) -> None:
        """Unfile live ``rows`` (their namespaces ``ns``, their digests still in ``kc``): their slots emptied, in
        whichever table holds each (or the stash)."""
        rows = np.asarray(rows, np.int64)
        if not len(rows):
            return
        if self.watch is not None:
            self.watch(rows, -1)
        h = self._hash(np.asarray(ns, np.uint64), self.kc.take(rows, axis=0))
        val = rows.astype(np.uint32)
        val += _ONE32
        left = self._delete_in(self.t, h, val)
        if len(left) and self.old is not None:
            left = left[self._delete_in(self.old, h[left], val[left])]
        if len(left) and len(self.stash):
            gone = np.isin(rows[left], self.stash)
            self.stash = self.stash[~np.isin(self.stash, rows[left])]
            left = left[~gone]
        assert not len(left), f"keyindex: rows {rows[left][:8].tolist()} are not filed"
        if self.long_keys:
            self.long_keys.discard(rows)

    def _delete_in(self, tab: _Buckets, h: np.ndarray, val: np.ndarray) -> np.ndarray:
        """Empty the slots of ``tab`` holding ``val`` (rows + 1, hashes ``h``), each bucket kept compact (its last
        row moved into the hole: one delete a bucket a round, so a second one in a bucket is found again after the
        move); returns the positions not found."""
        n = len(h)
        both, _ = self._where(h, tab)  # every first bucket, then every second one
        bb, vv = both, val
        found = np.zeros(n, bool)
        todo = None  # every key (the first round; later rounds: the keys a bucket's first delete held back)
        # the slots as flat words (rows) and u16s (tags): 1-d fancy indexes cost half a 2-d one's (128 deletes: 5.6
        # vs 9 us for the moves below, 1,024: 13 vs 33)
        wf = tab.words.reshape(-1)
        tf = wf.view(np.uint16)
        one = np.count_nonzero(both[:n] == both[n:]) == 0  # no key whose two buckets are one (the usual)
        while True:
            m = len(vv)
            hits = (tab.words.take(bb, axis=0).reshape(2, m, _WORDS)[:, :, :SLOTS] == vv[:, None]).ravel().nonzero()[0]
            k = hits // _SLOTS0
            s = hits - k * _SLOTS0
            if not one:
                keep = (k < m) | (bb.take(k) != bb.take(k - m))  # a key whose two buckets are one: its slot once
                k, s = k[keep], s[keep]
            b = bb.take(k)
            k %= m
            found[k if todo is None else todo.take(k)] = True
            if len(b) <= SET_FIRST and len(set(b.tolist())) == len(b):  # each in a bucket of its own (the usual)
                first = None
            else:
                first = np.zeros(len(b), bool)
                first[np.unique(b, return_index=True)[1]] = True
                go = first.nonzero()[0]
                b, s = b[go], s[go]
            top = tab.fill[b] - _ONE32
            base = b * _WORDS0  # each slot's bucket line, in words
            at = base + s  # the hole's row word
            last = base + top  # the bucket's last row's word
            wf[at] = wf.take(last)
            base += base  # the line in u16s, then its first tag
            base += _TAG0_0
            last2 = base + top
            base += s
            tf[base] = tf.take(last2)
            wf[last] = 0
            tf[last2] = 0
            tab.fill[b] = top
            tab.live -= len(b)
            if first is None:
                break
            todo = k[~first] if todo is None else todo.take(k[~first])
            if not len(todo):
                break
            bb = both.reshape(2, n)[:, todo].ravel()
            vv = val.take(todo)
        return (~found).nonzero()[0]

    def check(self, live_rows: np.ndarray, ns_col: np.ndarray) -> None:
        """Every live row is filed once (in the new table, the one being drained or the stash), in one of its two
        buckets with its tag; nothing else is filed; a slot is empty exactly when its tag is 0; the drained part of
        the old table is empty; the counts are right; ``find`` finds every live row."""
        tabs = [self.t] + ([self.old] if self.old is not None else [])
        filed = [self.stash]
        for tb in tabs:
            occ = tb.rows != 0
            assert np.array_equal(occ, tb.tags != 0), "keyindex: a slot's row and tag disagree on being empty"
            assert np.array_equal(occ, np.arange(SLOTS) < tb.fill[:, None].astype(np.int64)), "keyindex: fill"
            bi, si = np.nonzero(occ)
            r = tb.rows[bi, si].astype(np.int64) - 1
            b1, b2, tag = self._buckets(self._hash(ns_col.take(r), self.kc[r]), tb)
            assert np.all((bi == b1) | (bi == b2)), "keyindex: a row outside its two buckets"
            assert np.array_equal(tb.tags[bi, si], tag), "keyindex: a slot's tag is wrong"
            assert tb.live == len(r), "keyindex: a table's live count is wrong"
            filed.append(r)
        if self.old is not None:
            assert not self.old.words[:self.cursor].any(), "keyindex: a row left below the drain cursor"
        filed = np.sort(np.concatenate(filed))
        assert np.array_equal(filed, np.sort(live_rows)), "keyindex: filed rows differ from the live rows"
        for nsix in np.unique(ns_col[live_rows]).tolist():
            rows = live_rows[ns_col[live_rows] == nsix]
            assert np.array_equal(self.find(nsix, self.kc[rows], ns_col), rows), "keyindex: a live row not found"
        assert set(self.long_keys.rows().tolist()) <= set(live_rows.tolist()), \
            "keyindex: a long key of a row that is not live"
