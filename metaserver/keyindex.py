"""Key -> row for the columnar page table (``metaserver/columns.py``): an open-addressing hash table in numpy over
32-byte key digests, probed a whole batch at a time.

Why not a dict: at 10 M pages a dict look-up is three dependent cache misses (index slot, entry, the stored key
object for the equality test) taken one key at a time by the interpreter, and the dict, the row's int and the key's
bytes object cost about 140 bytes a page. Here a page costs its 32-byte digest in a column and two to five 8-byte
slots, and a batch's probes are numpy gathers, whose independent loads the CPU overlaps.

Keys. A key of 32 bytes (SGLang's page hash, sent raw: ``umbp.keys.normalize_key``) is its own digest; any other key
is represented by its blake2b-256 digest (personalised, so it cannot equal a raw 32-byte key without a second
preimage) and its bytes are kept in ``long_keys`` (row -> key) for whoever needs the original (listings, etcd
record names). Two keys are the same page exactly when namespace and digest match.

Table: ``slots`` (int64), a power of two in size: ``EMPTY``, ``TOMBSTONE``, or a row with a 31-bit tag of its digest
above it (``tag << 32 | row``), so a probe rejects other keys' slots without reading their digests. Linear probing
from the home slot ``h(ns, digest)``, the xor of multiply-shift hashes of the four digest words and the namespace
under odd multipliers drawn at random per process (keys that differ in any word land apart unless the multipliers
are known, so a client that picks raw 32-byte keys cannot aim them at one slot). A probe
reads each key's home slot, then ``WINDOW`` slots a round (one 64-byte line when aligned) for the keys not settled,
compares the tags, and reads the digest of the rows whose tag matches (about one a key). Invariant: between a live
row's home and its slot every slot is occupied (a row or a tombstone), and no row sits more than ``max_disp`` slots
past its home, so probing stops at an empty slot or after ``max_disp`` slots, exactly. Inserts run in rounds over
the batch (each key not yet placed looks at its current slot; among those that find it free, empty or a tombstone,
one per slot wins; the rest move one slot on); a delete leaves a tombstone.

Resizing is incremental, as Redis's ``dict.c`` rehash: when rows and tombstones would pass ``MAX_LOAD`` of the
slots, a new table is made at the smallest power of two that ``REBUILD_LOAD`` of it holds the live rows (and the
insert), and the old one is drained into it a slice at a time: each insert of n rows moves the rows of the next
``pace`` x n slots of the old table (``pace`` chosen so the drain ends before the new table has used half its room
above ``REBUILD_LOAD``), and ``step(budget)`` (the owner's background tick) moves the rows of ``budget`` more. A
moved row's old slot becomes a tombstone, so the old table's probe paths stay whole. Meanwhile new rows go to the
new table, ``find`` probes the new table and then, for the keys it did not find, the old one, and ``delete`` unfiles
a row from whichever holds it. Invariant: every live row is filed exactly once, in one of the two, and the old
table's slots below the drain cursor hold no row. Only an insert that would overfill the new table before the drain
ends (one request of more rows than the room left, far past what the pace allows for) finishes the drain at once.

Costs: ``find`` and ``delete`` O(n x rounds) numpy work for n keys (one round for almost every key; while a drain
runs, keys not in the new table are probed in the old one too); ``insert`` the same plus its share of the drain,
O(pace x n) slots scanned and their rows moved; no step is O(table). A one-step rebuild of 2 M rows took 0.65
CPU-seconds on the 2-core VM: what a request would have waited for.
"""

from __future__ import annotations

import hashlib
import mmap
import os

import numpy as np

EMPTY, TOMBSTONE = -1, -2
MIN_SLOTS = 1 << 16
MAX_LOAD = 0.5  # rows and tombstones over slots that triggers a rebuild
REBUILD_LOAD = 0.4  # the most rows over slots a rebuild leaves
WINDOW = 8  # slots a probe round reads
_STEPS = np.arange(WINDOW)
_ROW = np.int64(0xFFFFFFFF)
_LONG_PERSON = b"umbp-keyindex"


def zeros(shape, dtype) -> np.ndarray:
    """A zeroed array in anonymous memory of its own (mmap): dropping it hands the pages back to the OS at once,
    where a freed heap block would stay in RSS."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    n = int(np.prod(shape))
    itemsize = np.dtype(dtype).itemsize
    return np.frombuffer(mmap.mmap(-1, max(n * itemsize, 1)), dtype, count=n).reshape(shape)


def digests(keys: list[bytes]) -> tuple[np.ndarray, list[tuple[int, bytes]]]:
    """(n, 4) uint64 digests of ``keys`` and the (position, key) of those that are not 32 bytes long."""
    n = len(keys)
    joined = b"".join(keys)
    if n and len(joined) == 32 * n and min(map(len, keys)) == 32:  # all 32 bytes (SGLang's digests), at C speed
        return np.frombuffer(joined, np.uint64).reshape(n, 4), []
    longs = [(i, k) for i, k in enumerate(keys) if len(k) != 32]
    raw = list(keys)
    for i, k in longs:
        raw[i] = hashlib.blake2b(k, digest_size=32, person=_LONG_PERSON).digest()
    return np.frombuffer(b"".join(raw), np.uint64).reshape(n, 4), longs


def _tags(dig: np.ndarray) -> np.ndarray:
    """The 31-bit tags (int64) of digests: the top of their third word."""
    return (dig[:, 2] >> np.uint64(33)).astype(np.int64)


def _same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise equality of two (n, 4) digest arrays (four word compares: cheaper than ``all(axis=1)``)."""
    return (a[:, 0] == b[:, 0]) & (a[:, 1] == b[:, 1]) & (a[:, 2] == b[:, 2]) & (a[:, 3] == b[:, 3])


class _Slots:
    """One open-addressing table: its slots, and the counts and bound that probing relies on."""

    __slots__ = ("slots", "bits", "mask", "live", "tombstones", "max_disp")

    def __init__(self, size: int):
        self.slots = zeros(size, np.int64)
        self.slots[:] = EMPTY
        self.bits = size.bit_length() - 1
        self.mask = size - 1
        self.live = 0
        self.tombstones = 0
        self.max_disp = 0  # no row sits further than this past its home

    def rounds(self) -> int:
        return self.max_disp // WINDOW + 1


class KeyIndex:
    """Rows by (namespace index, key digest). Rows and their namespaces are the page table's; this holds the digest
    column ``kc`` (grown with the table's rows by ``grow``), the slots (``t``, and ``old`` while a resize drains it)
    and the long keys."""

    def __init__(self) -> None:
        self.kc = zeros((0, 4), np.uint64)
        self.long_keys: dict[int, bytes] = {}
        self._m = np.frombuffer(os.urandom(32), np.uint64) | np.uint64(1)  # odd multipliers, one per digest word
        self._mns = int.from_bytes(os.urandom(8), "little") | 1  # and one for the namespace
        self.t = _Slots(MIN_SLOTS)
        self.old: _Slots | None = None  # the table being drained into ``t`` (None: no resize under way)
        self.cursor = 0  # the old table's slots below this hold no row
        self.pace = 0  # old slots drained per row inserted, for the drain under way
        self.resizes = 0
        self.drained = 0  # old slots drained, over all resizes (figures, tests)
        # told of every row filed (rows, 1) and unfiled (rows, -1), before its columns change: the table's quota
        # use counts the filed rows (metaserver/tablequotas.py); None: nobody asks
        self.watch = None

    # what tests and figures read: the current table's size and bound, the counts of both
    @property
    def slots(self) -> np.ndarray:
        return self.t.slots

    @property
    def max_disp(self) -> int:
        return self.t.max_disp

    @property
    def live(self) -> int:
        return self.t.live + (self.old.live if self.old is not None else 0)

    @property
    def tombstones(self) -> int:
        return self.t.tombstones + (self.old.tombstones if self.old is not None else 0)

    def grow(self, rows: int) -> None:
        have = len(self.kc)
        if rows > have:
            kc = zeros((rows, 4), np.uint64)
            kc[:have] = self.kc
            self.kc = kc

    def _home(self, nsix, dig: np.ndarray, bits: int) -> np.ndarray:
        """Home slots (int64) in a table of ``2**bits`` slots of digests ``dig`` in namespaces ``nsix`` (an int or one
        per digest)."""
        m = self._m
        h = (dig[:, 0] * m[0]) ^ (dig[:, 1] * m[1]) ^ (dig[:, 2] * m[2]) ^ (dig[:, 3] * m[3])  # wraps, as meant
        if np.ndim(nsix):
            h ^= np.asarray(nsix, np.uint64) * np.uint64(self._mns)
        else:
            h ^= np.uint64(int(nsix) * self._mns % 2**64)
        return (h >> np.uint64(64 - bits)).astype(np.int64)

    # -- queries ----------------------------------------------------------------------------------------------
    def find(self, nsix: int, dig: np.ndarray, ns_col: np.ndarray) -> np.ndarray:
        """Rows (int64, -1: absent) of digests ``dig`` in namespace ``nsix``; ``ns_col`` is the table's namespace
        column (a row matches when its digest and namespace do). While a resize drains, the keys the new table
        does not hold are looked for in the old one."""
        n = len(dig)
        rows = np.full(n, -1, np.int64)
        if not n:
            return rows
        if self.t.live:
            self._find_in(self.t, nsix, dig, ns_col, rows)
        old = self.old
        if old is not None and old.live:
            miss = np.flatnonzero(rows < 0)
            if len(miss):
                sub = np.full(len(miss), -1, np.int64)
                self._find_in(old, nsix, dig[miss], ns_col, sub)
                rows[miss] = sub
        return rows

    def _find_in(self, tab: _Slots, nsix, dig: np.ndarray, ns_col: np.ndarray, rows: np.ndarray) -> None:
        """``find`` in one table, into ``rows``. The first round reads each key's home slot alone (most keys end
        there); the rest read ``WINDOW`` slots a round."""
        slots, mask = tab.slots, tab.mask
        pos = self._home(nsix, dig, tab.bits)
        tags = _tags(dig)
        v = slots.take(pos)
        hit = np.flatnonzero((v >> 32) == tags)
        self._match(nsix, dig, ns_col, rows, hit, v, hit)
        todo = np.flatnonzero((rows < 0) & (v != EMPTY))  # a live row never sits past an empty slot of its path
        pos = (pos[todo] + 1) & mask
        for _ in range(tab.rounds()):
            if not len(todo):
                break
            v = slots.take((pos[:, None] + _STEPS) & mask)  # (m, WINDOW)
            hit = np.flatnonzero((v >> 32) == tags[todo][:, None])  # EMPTY, TOMBSTONE: tag -1, never equal
            self._match(nsix, dig, ns_col, rows, todo[hit // WINDOW], v.ravel(), hit)
            left = np.flatnonzero((rows[todo] < 0) & (v != EMPTY).all(axis=1))
            todo = todo[left]
            pos = (pos[left] + WINDOW) & mask

    def _match(self, nsix, dig, ns_col, rows, at, v, hit) -> None:
        """Set ``rows[at[i]]`` for the candidate slot values ``v[hit[i]]`` (tags equal to key ``at[i]``'s) whose row
        has that key's digest and namespace; a live row is filed once, so a key matches at most once."""
        rr = v.take(hit) & _ROW
        ok = _same(self.kc.take(rr, axis=0), dig.take(at, axis=0)) & (ns_col.take(rr) == nsix)
        rows[at[ok]] = rr[ok]

    def key_of(self, row: int) -> bytes:
        """The key of a live row (its bytes: the digest itself for a 32-byte key)."""
        k = self.long_keys.get(row)
        return k if k is not None else self.kc[row].tobytes()

    # -- changes ----------------------------------------------------------------------------------------------
    def insert(self, rows: np.ndarray, dig: np.ndarray, ns_col: np.ndarray,
               longs: list[tuple[int, bytes]] | None = None) -> None:
        """File new rows (absent keys, their namespaces already in ``ns_col``; their digests ``dig`` go into
        ``kc``), starting a resize first if they would fill the table past ``MAX_LOAD``, then drain the old table
        by this insert's share (module docstring). ``longs``: (position in ``rows``, key) of keys that are not their
        own digest."""
        rows = np.asarray(rows, np.int64)
        if self.watch is not None:
            self.watch(rows, 1)
        self.kc[rows] = dig
        for i, k in longs or ():
            self.long_keys[int(rows[i])] = k
        n = len(rows)
        t = self.t
        if t.live + t.tombstones + n > MAX_LOAD * len(t.slots):
            if self.old is not None:  # more than the pace allowed for: finish that drain first
                self._drain(len(self.old.slots), ns_col)
            self._resize(n)
        self._place(self.t, rows, self._home(ns_col[rows], self.kc[rows], self.t.bits))
        if self.old is not None:
            self._drain(self.pace * n, ns_col)

    def reserve(self, rows: int) -> None:
        """Size an empty index for ``rows`` rows at once (a full load knows its count), instead of resizing and
        draining as it fills. No effect on an index that holds anything."""
        if not self.live and self.old is None and rows:
            self._resize(rows)

    def step(self, budget: int, ns_col: np.ndarray) -> int:
        """Drain at most ``budget`` slots of a resize under way (the owner's background step); returns how many."""
        return self._drain(budget, ns_col) if self.old is not None else 0

    def _resize(self, adding: int) -> None:
        """Start draining the current table into a new one sized for its live rows and ``adding`` more."""
        old = self.t
        size = MIN_SLOTS
        while REBUILD_LOAD * size < old.live + adding:
            size *= 2
        self.t = _Slots(size)
        self.resizes += 1
        self.cursor = 0
        self.old = old if old.live else None
        # finish while the new table has used at most half its room between REBUILD_LOAD and MAX_LOAD
        room = (MAX_LOAD * size - old.live - adding) / 2
        self.pace = max(1, -int(-len(old.slots) // max(room, 1)))

    def _drain(self, budget: int, ns_col: np.ndarray) -> int:
        """Move the rows of the old table's next ``budget`` slots into the new one (their slots become tombstones,
        so the old table's probe paths stay whole); drop the old table once drained. Returns slots visited."""
        old = self.old
        lo = self.cursor
        hi = min(len(old.slots), lo + max(0, budget))
        at = np.flatnonzero(old.slots[lo:hi] >= 0) + lo
        if len(at):
            moved = old.slots[at] & _ROW
            old.slots[at] = TOMBSTONE
            old.live -= len(at)
            old.tombstones += len(at)
            self._place(self.t, moved, self._home(ns_col[moved], self.kc[moved], self.t.bits))
        self.cursor = hi
        self.drained += hi - lo
        if hi == len(old.slots):
            self.old = None
        return hi - lo

    def _place(self, tab: _Slots, rows: np.ndarray, pos: np.ndarray) -> None:
        """The insert rounds of the module docstring: file ``rows`` in ``tab`` from home slots ``pos``."""
        slots, mask = tab.slots, tab.mask
        vals = (_tags(self.kc[rows]) << 32) | rows
        disp = 0
        while len(rows):
            free = slots[pos] < 0
            won_pos, first = np.unique(pos[free], return_index=True)
            tab.tombstones -= int(np.count_nonzero(slots[won_pos] == TOMBSTONE))
            slots[won_pos] = vals[free][first]
            lost = np.ones(len(rows), bool)
            lost[np.flatnonzero(free)[first]] = False
            if len(first) and disp > tab.max_disp:
                tab.max_disp = disp
            tab.live += len(first)
            rows, vals = rows[lost], vals[lost]
            pos = (pos[lost] + 1) & mask
            disp += 1

    def delete(self, rows: np.ndarray, ns: np.ndarray) -> None:
        """Unfile live ``rows`` (their namespaces ``ns``, their digests still in ``kc``): a tombstone in each slot,
        in whichever table holds the row."""
        rows = np.asarray(rows, np.int64)
        if not len(rows):
            return
        if self.watch is not None:
            self.watch(rows, -1)
        dig = self.kc[rows]
        want = (_tags(dig) << 32) | rows
        ns = np.asarray(ns, np.uint64)
        left = self._delete_in(self.t, dig, ns, want)
        if len(left) and self.old is not None:
            left = left[self._delete_in(self.old, dig[left], ns[left], want[left])]
        assert not len(left), f"keyindex: rows {rows[left][:8].tolist()} are not filed"
        for r in rows.tolist():
            self.long_keys.pop(r, None)

    def _delete_in(self, tab: _Slots, dig: np.ndarray, ns: np.ndarray, want: np.ndarray) -> np.ndarray:
        """Tombstone the slots of ``tab`` holding ``want`` (slot values); returns the positions not found there."""
        slots, mask = tab.slots, tab.mask
        pos = self._home(ns, dig, tab.bits)
        todo = np.arange(len(want))
        for _ in range(tab.rounds()):
            win = (pos[:, None] + _STEPS) & mask
            eq = slots[win] == want[todo][:, None]
            hit = eq.any(axis=1)
            slots[win[hit, eq[hit].argmax(axis=1)]] = TOMBSTONE
            n = int(np.count_nonzero(hit))
            tab.live -= n
            tab.tombstones += n
            todo, pos = todo[~hit], pos[~hit]
            if not len(todo):
                break
            pos = (pos + WINDOW) & mask
        return todo

    def check(self, live_rows: np.ndarray, ns_col: np.ndarray) -> None:
        """Every live row is filed once (in the new table or the one being drained), with its tag, and found from
        its home; nothing else is filed; the drained part of the old table holds no row; the counts are right."""
        tabs = [self.t] + ([self.old] if self.old is not None else [])
        held = np.concatenate([tb.slots[tb.slots >= 0] for tb in tabs])
        filed = held & _ROW
        order = np.argsort(filed)
        assert np.array_equal(filed[order], np.sort(live_rows)), "keyindex: filed rows differ from the live rows"
        assert np.array_equal(held[order] >> 32, _tags(self.kc[filed[order]])), "keyindex: a slot's tag is wrong"
        for tb in tabs:
            assert tb.live == int(np.count_nonzero(tb.slots >= 0)), "keyindex: a table's live count is wrong"
            assert tb.tombstones == int(np.count_nonzero(tb.slots == TOMBSTONE)), "keyindex: tombstone count wrong"
        if self.old is not None:
            assert not np.any(self.old.slots[:self.cursor] >= 0), "keyindex: a row left below the drain cursor"
        for nsix in np.unique(ns_col[live_rows]).tolist():
            rows = live_rows[ns_col[live_rows] == nsix]
            assert np.array_equal(self.find(nsix, self.kc[rows], ns_col), rows), "keyindex: a live row not found"
        assert set(self.long_keys) <= set(live_rows.tolist()), "keyindex: a long key of a row that is not live"
