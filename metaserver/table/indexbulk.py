"""A full load's key index insert (``load.load_nodes``): every node's rows staged, then filed as one insert. The
load's one sort of the keys' hashes (``bulk_order``: by first bucket, equal keys side by side) serves both its
duplicates check and the filing: each bucket takes its run of keys with one scatter (``insert_staged``), and only the
keys past a bucket's share (about 7 %) go through ``KeyIndex``'s insert rounds. Functions over a ``KeyIndex``: the
index's own bucket layout, resize and drain (metaserver/table/index.py) are theirs to use.

Costs: O(keys) numpy in parts of ``_BULK_PART`` keys (a part's temporaries are reused from the heap), one sort.
"""

from __future__ import annotations

import numpy as np

from metaserver.table.index import _S32, _TAG0, _WORDS, MAX_LOAD, PLACE_ROWS, SLOTS, KeyIndex, _Buckets
from metaserver.table.longkeys import LongCol

NO_ROW = 0xFFFFFFFF  # ``insert_staged``'s rows: a page not filed (a slot holds row + 1 in 32 bits: no row is this)
_BULK_PART = 1 << 18  # keys ``insert_staged`` scatters at once (a part's temporaries, about 20 MiB, are reused)


def stage(ix: KeyIndex, rows: np.ndarray, dig: np.ndarray, longs=None, span: slice | None = None) -> tuple:
    """``insert``'s first half for a load of many nodes: the digests written into ``kc``, nothing filed (a
    staged row is not found). Returns (rows, the long keys as a ``LongCol``) for ``insert_staged``. ``span``: the
    slice ``rows`` are, when the caller found them one range. O(rows)."""
    rows = np.asarray(rows, np.int64)
    m = len(rows)
    if span is not None:
        ix.kc[span] = dig
    elif m and rows[-1] - rows[0] == m - 1 and (rows[1:] > rows[:-1]).all():  # a fresh node's rows: one range
        ix.kc[int(rows[0]):int(rows[0]) + m] = dig  # (a slice copies at memcpy speed, a 2-d index 5x slower)
    else:
        ix.kc[rows] = dig
    return rows, LongCol.of(longs or ())


def bulk_order(ix: KeyIndex, h: np.ndarray, ns_col: np.ndarray) -> np.ndarray:
    """For one insert of len(h) rows of hashes ``h`` (``insert_staged``): room made first, as ``_file`` makes it
    (so the buckets are this table's), then each key's ``(h * salt) >> 32`` (the first bucket is monotone in
    it) over its position in ``h``, sorted (u64): the keys by first bucket, and equal keys next to each other
    or among the rare keys of one such value (a load finds its duplicates here). One sort."""
    n = len(h)
    if ix.live + n > MAX_LOAD * ix.t.capacity or (len(ix.stash) and ix.old is None):
        if ix.old is not None:  # more than the pace allowed for: finish that drain first
            ix._drain(ix.old.capacity, ns_col)
        ix._resize(n, ns_col)
    key = h * ix.t.salt
    key >>= _S32
    key <<= _S32
    for lo in range(0, n, _BULK_PART):  # (the positions a part at a time: an arange of every key is new memory)
        key[lo:lo + _BULK_PART] |= np.arange(lo, min(n, lo + _BULK_PART), dtype=np.uint64)
    key.sort()
    return key


def same_high(order: np.ndarray) -> np.ndarray:
    """The positions i of ``bulk_order``'s ``order`` whose high 32 bits equal those at i + 1 (int64, ascending), a
    part at a time (a shift of every key, and its compare, would be new memory)."""
    parts = [np.zeros(0, np.int64)]
    for lo in range(0, len(order) - 1, _BULK_PART):
        a = order[lo:lo + _BULK_PART + 1]
        x = a[1:] ^ a[:-1]
        x >>= _S32
        parts.append(np.flatnonzero(x == 0) + lo)
    return np.concatenate(parts)


def insert_staged(ix: KeyIndex, parts: list[tuple], ns_col: np.ndarray, order: np.ndarray, h: np.ndarray,
                  rows_at: np.ndarray) -> None:
    """File the rows of ``stage``'s ``parts`` (absent keys, none of them given twice) as one ``insert``: one
    bulk chunk of long keys, then the rows by ``bulk_order``'s ``order`` of hashes ``h`` (``rows_at``: the row
    of each of its positions, u32, ``NO_ROW``: not filed). Each bucket takes the keys of its run in ``order``
    up to one more than the table's mean fill, with one scatter; the rest (about 7% at ``REBUILD_LOAD``) are
    filed as ``insert`` files them (the emptier of their buckets, in rounds). Against those rounds for every key
    after a sort of the hashes (what the load did before): 0.27-0.32 -> 0.23-0.25 CPU-s at 2 M keys (index
    alone, 2-core VM). The buckets' fills spread wider (after a full load at ``REBUILD_LOAD``: about 4% full,
    where the rounds leave none), which only an insert whose two buckets are both full pays for."""
    if not parts:
        return
    rows = np.concatenate([p[0] for p in parts])
    longs = LongCol.cat([p[1] for p in parts], [len(p[0]) for p in parts])
    if longs:
        ix.long_keys.add_bulk(rows.take(longs.pos), longs)
    tab = ix.t
    cap = min(SLOTS, -(-(tab.live + len(rows)) // tab.n) + 1)
    rest = []
    # in parts of the order (a bucket's run cut between two goes on from the fill the first wrote): a part's
    # temporaries are reused from the heap, where arrays of every key would each be new memory faulted in
    for lo in range(0, len(order), _BULK_PART):
        pos = (order[lo:lo + _BULK_PART] & np.uint64(0xFFFFFFFF)).view(np.int64)
        r = rows_at.take(pos)
        if (r == NO_ROW).any():  # (a page the load rejected)
            pos = pos[r != NO_ROW]
            r = rows_at.take(pos)
        if len(r):
            hs = h.take(pos)
            left = _fill_runs(ix, tab, r, hs, cap)
            rest.append((r.take(left), hs.take(left)))
    part = min(PLACE_ROWS, max(4096, tab.n // 8))  # (as ``_file``)
    r = np.concatenate([x[0] for x in rest]).astype(np.int64) if rest else np.zeros(0, np.int64)
    hs = np.concatenate([x[1] for x in rest]) if rest else np.zeros(0, np.uint64)
    for lo in range(0, len(r), part):
        ix._place(tab, r[lo:lo + part], hs[lo:lo + part], ns_col)
    m = len(rows)
    if ix.old is not None:
        ix._drain(ix.pace * m, ns_col)
    if ix.watch is not None:
        ix.watch(rows, 1)


def _fill_runs(ix: KeyIndex, tab: _Buckets, r: np.ndarray, h: np.ndarray, cap: int) -> np.ndarray:
    """``insert_staged``'s scatter: rows ``r`` (hashes ``h``, ascending first buckets) go to their first bucket
    while it holds fewer than ``cap``; returns the positions of those left."""
    m = len(r)
    b1, _, tag = ix._buckets(h, tab)
    first = np.empty(m, bool)
    first[0] = True
    np.not_equal(b1[1:], b1[:-1], out=first[1:])
    idx = np.arange(m, dtype=np.int64)
    slot = idx - np.maximum.accumulate(np.where(first, idx, 0))  # each key's rank in its bucket's run
    slot += tab.fill.take(b1)
    direct = slot < cap
    i = np.flatnonzero(direct)
    bi, si = b1.take(i), slot.take(i)
    tab.words.reshape(-1)[bi * _WORDS + si] = (r.take(i) + 1).astype(np.uint32)
    tab.words.view(np.uint16).reshape(-1)[bi * (2 * _WORDS) + _TAG0 + si] = tag.take(i)
    last = direct.copy()  # each bucket's last key taken (its run's taken keys are a prefix of it)
    last[:-1] &= first[1:] | ~direct[1:]
    j = np.flatnonzero(last)
    tab.fill[b1.take(j)] = (slot.take(j) + 1).astype(np.uint32)
    tab.live += len(i)
    return np.flatnonzero(~direct)
