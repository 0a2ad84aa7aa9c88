"""Key -> row for the columnar page table (``metaserver/columns.py``): an open-addressing hash table in numpy over
32-byte key digests, probed a whole batch at a time.

Why not a dict: at 10 M pages a dict look-up is three dependent cache misses (index slot, entry, the stored key
object for the equality test) taken one key at a time by the interpreter, and the dict, the row's int and the key's
bytes object cost about 140 bytes a page. Here a page costs its 32-byte digest in a column and two to five table
slots of 4 bytes (the table is at most half full), and a batch's probes are numpy gathers, whose independent loads
the CPU overlaps.

Keys. A key of 32 bytes (SGLang's page hash, sent raw: ``umbp.keys.normalize_key``) is its own digest; any other key
is represented by its blake2b-256 digest (personalised, so it cannot equal a raw 32-byte key without a
second preimage) and its bytes are kept in ``long_keys`` (row -> key) for whoever needs the original (listings, etcd
record names). Two keys are the same page exactly when namespace and digest match.

Table: ``slots`` (int32: a row, ``EMPTY`` or ``TOMBSTONE``), a power of two in size, linear probing from the home
slot ``h(ns, digest)``, a batch's probes ``WINDOW`` slots a round after the first: a multiply-shift hash of two digest words and the namespace under multipliers drawn at
random per process, so a client that picks raw 32-byte keys cannot aim them at one slot. Invariant: between a
live row's home and its slot every slot is occupied (a row or a tombstone), and no row sits more than ``max_disp``
slots past its home, so a probe of ``max_disp + 1`` rounds is exact. Inserts run in rounds over the batch (each
round every key not yet placed looks at its current slot; among those that find it empty one per slot wins;
the rest move one slot on; a tombstone is as good as an empty slot, as the keys are absent), deletes leave a
tombstone, and the table is rebuilt (same rounds, 2.5 times the live
rows rounded up to a power of two: at most 2/5 full) when rows and tombstones would pass half of it. So a page
costs 8 to 20 bytes of slots, and a churning pool rebuilds after evicting a tenth to a half of its pages.

Costs: ``find`` O(n x rounds) numpy work for n keys (rounds are 1-2 for almost every key); ``insert`` the same;
``delete`` the same; a rebuild O(live rows) numpy work.
"""

from __future__ import annotations

import hashlib
import mmap
import os

import numpy as np

EMPTY, TOMBSTONE = -1, -2
MIN_SLOTS = 1 << 16
WINDOW = 8  # slots a probe round looks at past the home slot
_STEPS = np.arange(WINDOW)
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
    if n and min(map(len, keys)) == 32 == max(map(len, keys)):  # SGLang's digests: the common case, at C speed
        return np.frombuffer(b"".join(keys), np.uint64).reshape(n, 4), []
    longs = [(i, k) for i, k in enumerate(keys) if len(k) != 32]
    raw = list(keys)
    for i, k in longs:
        raw[i] = hashlib.blake2b(k, digest_size=32, person=_LONG_PERSON).digest()
    return np.frombuffer(b"".join(raw), np.uint64).reshape(n, 4), longs


class KeyIndex:
    """Rows by (namespace index, key digest). Rows and their namespaces are the page table's; this holds the digest
    column ``kc`` (grown with the table's rows by ``grow``), the slots and the long keys."""

    def __init__(self) -> None:
        self.kc = zeros((0, 4), np.uint64)
        self.long_keys: dict[int, bytes] = {}
        rnd = np.frombuffer(os.urandom(24), np.uint64)
        self._m0, self._m1, self._m2 = rnd | np.uint64(1)  # odd multipliers
        self._new_slots(MIN_SLOTS)

    def _new_slots(self, size: int) -> None:
        self.slots = zeros(size, np.int32)
        self.slots[:] = EMPTY
        self.bits = size.bit_length() - 1
        self.mask = size - 1
        self.live = 0
        self.tombstones = 0
        self.max_disp = 0

    def grow(self, rows: int) -> None:
        have = len(self.kc)
        if rows > have:
            kc = zeros((rows, 4), np.uint64)
            kc[:have] = self.kc
            self.kc = kc

    # -- hashing ----------------------------------------------------------------------------------------------
    def _home(self, nsix, dig: np.ndarray) -> np.ndarray:
        """Home slots (int64) of digests ``dig`` in namespaces ``nsix`` (an int or one per digest)."""
        with np.errstate(over="ignore"):
            h = (dig[:, 0] * self._m0) ^ (dig[:, 1] * self._m1) ^ (np.asarray(nsix, np.uint64) * self._m2)
        return (h >> np.uint64(64 - self.bits)).astype(np.int64)

    # -- queries ----------------------------------------------------------------------------------------------
    def find(self, nsix: int, dig: np.ndarray, ns_col: np.ndarray) -> np.ndarray:
        """Rows (int64, -1: absent) of digests ``dig`` in namespace ``nsix``; ``ns_col`` is the table's namespace
        column (a row matches when its digest and namespace do). One probe of every key's home slot settles most
        of them; the rest look at ``WINDOW`` slots a round."""
        n = len(dig)
        rows = np.full(n, -1, np.int64)
        if not self.live or not n:
            return rows
        pos = self._home(nsix, dig)
        r = self.slots[pos].astype(np.int64)
        held = r >= 0
        hr = r[held]
        match = np.zeros(n, bool)
        match[held] = (self.kc[hr] == dig[held]).all(axis=1) & (ns_col[hr] == nsix)
        rows[match] = r[match]
        todo = np.flatnonzero(~match & (r != EMPTY))
        pos = (pos[todo] + 1) & self.mask
        for _ in range(self.max_disp // WINDOW + 1):
            if not len(todo):
                break
            win = (pos[:, None] + _STEPS) & self.mask
            r = self.slots[win].astype(np.int64)  # (m, WINDOW)
            safe = np.maximum(r, 0)
            eq = (r >= 0) & (self.kc[safe] == dig[todo][:, None, :]).all(axis=2) & (ns_col[safe] == nsix)
            hit = eq.any(axis=1)  # a live row never sits past an EMPTY slot of its path: no check needed
            rows[todo[hit]] = r[hit, eq[hit].argmax(axis=1)]
            go = ~hit & ~(r == EMPTY).any(axis=1)
            todo = todo[go]
            pos = (pos[go] + WINDOW) & self.mask
        return rows

    def key_of(self, row: int) -> bytes:
        """The key of a live row (its bytes: the digest itself for a 32-byte key)."""
        k = self.long_keys.get(row)
        return k if k is not None else self.kc[row].tobytes()

    # -- changes ----------------------------------------------------------------------------------------------
    def insert(self, rows: np.ndarray, dig: np.ndarray, ns_col: np.ndarray,
               longs: list[tuple[int, bytes]] | None = None) -> None:
        """File new rows (absent keys, their namespaces already in ``ns_col``; their digests ``dig`` go into
        ``kc``), rebuilding first if they would fill the table past half. ``longs``: (position in ``rows``, key) of
        keys that are not their own digest."""
        rows = np.asarray(rows, np.int64)
        self.kc[rows] = dig
        for i, k in longs or ():
            self.long_keys[int(rows[i])] = k
        if 2 * (self.live + self.tombstones + len(rows)) > len(self.slots):
            old = self.slots[self.slots >= 0].astype(np.int64)
            rows = np.concatenate([old, rows])
            size = MIN_SLOTS
            while 2 * size < 5 * len(rows):  # then at most 2/5 full: room to grow before the next rebuild
                size *= 2
            self._new_slots(size)
        self._place(rows, self._home(ns_col[rows], self.kc[rows]))

    def _place(self, rows: np.ndarray, pos: np.ndarray) -> None:
        """The rounds of the module docstring: file ``rows`` from home slots ``pos``. A tombstone is as good as an
        empty slot here (the keys are absent, so nothing past it needs finding through this key's path)."""
        slots, mask = self.slots, self.mask
        disp = 0
        while len(rows):
            got = slots[pos]
            free = got < 0
            cand_pos = pos[free]
            won_pos, first = np.unique(cand_pos, return_index=True)
            self.tombstones -= int(np.count_nonzero(slots[won_pos] == TOMBSTONE))
            slots[won_pos] = rows[free][first]
            lost = np.ones(len(rows), bool)
            lost[np.flatnonzero(free)[first]] = False
            if disp > self.max_disp:
                self.max_disp = disp
            self.live += len(first)
            rows = rows[lost]
            pos = (pos[lost] + 1) & mask
            disp += 1

    def delete(self, rows: np.ndarray, ns: np.ndarray) -> None:
        """Unfile live ``rows`` (their namespaces ``ns``, their digests still in ``kc``): a tombstone in each slot."""
        rows = np.asarray(rows, np.int64)
        if not len(rows):
            return
        pos = self._home(ns, self.kc[rows])
        todo = np.arange(len(rows))
        for _ in range(self.max_disp // WINDOW + 1):
            win = (pos[:, None] + _STEPS) & self.mask
            eq = self.slots[win] == rows[todo][:, None]
            hit = eq.any(axis=1)
            self.slots[win[hit, eq[hit].argmax(axis=1)]] = TOMBSTONE
            todo = todo[~hit]
            pos = (pos[~hit] + WINDOW) & self.mask
            if not len(todo):
                break
        assert not len(todo), f"keyindex: rows {rows[todo][:8].tolist()} are not filed"
        self.live -= len(rows)
        self.tombstones += len(rows)
        for r in rows.tolist():
            self.long_keys.pop(r, None)

    def check(self, live_rows: np.ndarray, ns_col: np.ndarray) -> None:
        """Every live row is filed once and found from its home; nothing else is filed."""
        filed = np.sort(self.slots[self.slots >= 0].astype(np.int64))
        assert np.array_equal(filed, np.sort(live_rows)), "keyindex: filed rows differ from the live rows"
        assert self.live == len(filed) and self.tombstones == int(np.count_nonzero(self.slots == TOMBSTONE))
        for nsix in np.unique(ns_col[live_rows]).tolist():
            rows = live_rows[ns_col[live_rows] == nsix]
            assert np.array_equal(self.find(nsix, self.kc[rows], ns_col), rows), "keyindex: a live row not found"
        assert set(self.long_keys) <= set(live_rows.tolist()), "keyindex: a long key of a row that is not live"
