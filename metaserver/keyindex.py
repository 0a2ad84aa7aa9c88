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
one per slot wins; the rest move one slot on); a delete leaves a tombstone; when rows and tombstones would pass
``MAX_LOAD`` of the slots the table is rebuilt (the same rounds) at the smallest power of two that ``REBUILD_LOAD``
of it holds the live rows.

Costs: ``find`` and ``delete`` O(n x rounds) numpy work for n keys (one round for almost every key); ``insert``
the same; a rebuild O(live rows) numpy work, taken by the request that crosses the bound (0.65 CPU-seconds for 2 M
rows on a 2-core VM; not sliced yet).
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


class KeyIndex:
    """Rows by (namespace index, key digest). Rows and their namespaces are the page table's; this holds the digest
    column ``kc`` (grown with the table's rows by ``grow``), the slots and the long keys."""

    def __init__(self) -> None:
        self.kc = zeros((0, 4), np.uint64)
        self.long_keys: dict[int, bytes] = {}
        self._m = np.frombuffer(os.urandom(32), np.uint64) | np.uint64(1)  # odd multipliers, one per digest word
        self._mns = int.from_bytes(os.urandom(8), "little") | 1  # and one for the namespace
        self._new_slots(MIN_SLOTS)

    def _new_slots(self, size: int) -> None:
        self.slots = zeros(size, np.int64)
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

    def _home(self, nsix, dig: np.ndarray) -> np.ndarray:
        """Home slots (int64) of digests ``dig`` in namespaces ``nsix`` (an int or one per digest)."""
        m = self._m
        h = (dig[:, 0] * m[0]) ^ (dig[:, 1] * m[1]) ^ (dig[:, 2] * m[2]) ^ (dig[:, 3] * m[3])  # wraps, as meant
        if np.ndim(nsix):
            h ^= np.asarray(nsix, np.uint64) * np.uint64(self._mns)
        else:
            h ^= np.uint64(int(nsix) * self._mns % 2**64)
        return (h >> np.uint64(64 - self.bits)).astype(np.int64)

    def _rounds(self) -> int:
        return self.max_disp // WINDOW + 1

    # -- queries ----------------------------------------------------------------------------------------------
    def find(self, nsix: int, dig: np.ndarray, ns_col: np.ndarray) -> np.ndarray:
        """Rows (int64, -1: absent) of digests ``dig`` in namespace ``nsix``; ``ns_col`` is the table's namespace
        column (a row matches when its digest and namespace do). The first round reads each key's home slot alone
        (most keys end there); the rest read ``WINDOW`` slots a round."""
        n = len(dig)
        rows = np.full(n, -1, np.int64)
        if not self.live or not n:
            return rows
        pos = self._home(nsix, dig)
        tags = _tags(dig)
        v = self.slots.take(pos)
        hit = np.flatnonzero((v >> 32) == tags)
        self._match(nsix, dig, ns_col, rows, hit, v, hit)
        todo = np.flatnonzero((rows < 0) & (v != EMPTY))  # a live row never sits past an empty slot of its path
        pos = (pos[todo] + 1) & self.mask
        for _ in range(self._rounds()):
            if not len(todo):
                break
            v = self.slots.take((pos[:, None] + _STEPS) & self.mask)  # (m, WINDOW)
            hit = np.flatnonzero((v >> 32) == tags[todo][:, None])  # EMPTY, TOMBSTONE: tag -1, never equal
            self._match(nsix, dig, ns_col, rows, todo[hit // WINDOW], v.ravel(), hit)
            left = np.flatnonzero((rows[todo] < 0) & (v != EMPTY).all(axis=1))
            todo = todo[left]
            pos = (pos[left] + WINDOW) & self.mask
        return rows

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
        ``kc``), rebuilding first if they would fill the table past ``MAX_LOAD``. ``longs``: (position in ``rows``,
        key) of keys that are not their own digest."""
        rows = np.asarray(rows, np.int64)
        self.kc[rows] = dig
        for i, k in longs or ():
            self.long_keys[int(rows[i])] = k
        if self.live + self.tombstones + len(rows) > MAX_LOAD * len(self.slots):
            held = self.slots[self.slots >= 0]
            rows = np.concatenate([held & _ROW, rows])
            size = MIN_SLOTS
            while REBUILD_LOAD * size < len(rows):
                size *= 2
            self._new_slots(size)
        self._place(rows, self._home(ns_col[rows], self.kc[rows]))

    def _place(self, rows: np.ndarray, pos: np.ndarray) -> None:
        """The insert rounds of the module docstring: file ``rows`` from home slots ``pos``."""
        slots, mask = self.slots, self.mask
        vals = (_tags(self.kc[rows]) << 32) | rows
        disp = 0
        while len(rows):
            free = slots[pos] < 0
            won_pos, first = np.unique(pos[free], return_index=True)
            self.tombstones -= int(np.count_nonzero(slots[won_pos] == TOMBSTONE))
            slots[won_pos] = vals[free][first]
            lost = np.ones(len(rows), bool)
            lost[np.flatnonzero(free)[first]] = False
            if len(first) and disp > self.max_disp:
                self.max_disp = disp
            self.live += len(first)
            rows, vals = rows[lost], vals[lost]
            pos = (pos[lost] + 1) & mask
            disp += 1

    def delete(self, rows: np.ndarray, ns: np.ndarray) -> None:
        """Unfile live ``rows`` (their namespaces ``ns``, their digests still in ``kc``): a tombstone in each slot."""
        rows = np.asarray(rows, np.int64)
        if not len(rows):
            return
        dig = self.kc[rows]
        want = (_tags(dig) << 32) | rows
        pos = self._home(ns, dig)
        todo = np.arange(len(rows))
        for _ in range(self._rounds()):
            win = (pos[:, None] + _STEPS) & self.mask
            eq = self.slots[win] == want[todo][:, None]
            hit = eq.any(axis=1)
            self.slots[win[hit, eq[hit].argmax(axis=1)]] = TOMBSTONE
            todo, pos = todo[~hit], pos[~hit]
            if not len(todo):
                break
            pos = (pos + WINDOW) & self.mask
        assert not len(todo), f"keyindex: rows {rows[todo][:8].tolist()} are not filed"
        self.live -= len(rows)
        self.tombstones += len(rows)
        for r in rows.tolist():
            self.long_keys.pop(r, None)

    def check(self, live_rows: np.ndarray, ns_col: np.ndarray) -> None:
        """Every live row is filed once, with its tag, and found from its home; nothing else is filed."""
        held = self.slots[self.slots >= 0]
        filed = held & _ROW
        order = np.argsort(filed)
        assert np.array_equal(filed[order], np.sort(live_rows)), "keyindex: filed rows differ from the live rows"
        assert np.array_equal(held[order] >> 32, _tags(self.kc[filed[order]])), "keyindex: a slot's tag is wrong"
        assert self.live == len(filed) and self.tombstones == int(np.count_nonzero(self.slots == TOMBSTONE))
        for nsix in np.unique(ns_col[live_rows]).tolist():
            rows = live_rows[ns_col[live_rows] == nsix]
            assert np.array_equal(self.find(nsix, self.kc[rows], ns_col), rows), "keyindex: a live row not found"
        assert set(self.long_keys) <= set(live_rows.tolist()), "keyindex: a long key of a row that is not live"
