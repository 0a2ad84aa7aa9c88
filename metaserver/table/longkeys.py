"""Keys that are not their own digest (``transport.keyform.digests``: a batch's digests, the form the key index
files), kept as columns: ``LongCol`` (a batch's long keys: positions and one byte blob) and ``LongKeys`` (the key
index's row -> key store: ``metaserver/table/index.py``).

Why columns. A key that is not 32 bytes (a TP rank's 33-byte key, a string key) is filed by its digest, and its
bytes are kept for whoever reads keys back (commit records, listings). Kept as a dict of bytes objects, a cold load
of 10 M pages of which half are long made 5 M bytes objects, tuples and dict entries (about 0.8 us a long key: 4 s
of the load). Here a load's long keys stay one blob and two arrays from the segment they were read from
(``records.Segment.digests``) to the index (``LongKeys.add_bulk``): no Python object a key.

``LongCol``: entry j is the key ``blob[ends[j] - len_j : ends[j]]`` at position ``pos[j]`` of its batch (``pos``
ascending, int64; ``blob`` bytes, or a memoryview of a segment's value, which ``pick`` makes bytes). It iterates as (position, key) pairs, the list form the small paths use.

``LongKeys``: rows filed by request (an ALLOC's long keys: a dict) and in bulk (a load's: chunks, each rows
sorted ascending, their keys' ends and blob, and an alive mask; a deleted row is marked dead in its chunk, a chunk
less than half alive is compacted, more than ``MAX_CHUNKS`` chunks are merged into one). Invariant: a live row has
at most one live entry, in the dict or in one chunk.

Costs: ``add_bulk`` O(keys) numpy (a sort when the rows are not ascending); ``get`` a dict probe, then a binary
search a chunk; ``keys_of``/``any_of``/``discard`` O(rows) numpy a chunk; a merge O(bytes kept).
"""

from __future__ import annotations

from itertools import accumulate

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

MAX_CHUNKS = 8  # bulk chunks kept before they are merged into one (each lookup searches every chunk)
_EMPTY = np.zeros(0, np.int64)
_GATHER = 1 << 22  # bytes ``gather`` indexes at once (an int64 a byte: 32 MiB of index)


def gather(blob: bytes, starts: np.ndarray, lens: np.ndarray) -> tuple[bytes, np.ndarray]:
    """The byte ranges ``blob[starts[i]:starts[i] + lens[i]]`` joined, and their ends in the result (int64): one
    numpy gather whatever their count."""
    lens = np.asarray(lens, np.int64)
    ends = np.cumsum(lens)
    if not len(lens):
        return b"", ends
    starts = np.asarray(starts, np.int64)
    src = np.frombuffer(blob, np.uint8)
    k = int(lens[0])
    if 0 < k <= len(src) and (lens == k).all():  # keys of one length (33 bytes: a TP rank's): no index a byte
        row, off = np.divmod(starts, k)
        if not off.any():  # (each at a multiple of k, as in a blob of such keys: rows of a (-1, k) view, 4x faster)
            return src[:len(src) // k * k].reshape(-1, k).take(row, axis=0).tobytes(), ends
        return sliding_window_view(src, k)[starts].tobytes(), ends  # (rows of a window view; take would copy it)
    out = []
    step = max(1, _GATHER // max(1, int(ends[-1]) // len(lens)))  # keys a part: a byte index of _GATHER at most
    for lo in range(0, len(lens), step):
        ln, st = lens[lo:lo + step], starts[lo:lo + step]
        e = np.cumsum(ln)
        idx = np.repeat(st - (e - ln), ln)
        idx += np.arange(int(e[-1]), dtype=np.int64)
        out.append(src.take(idx).tobytes())
    return b"".join(out), ends


class LongCol:
    """A batch's long keys as columns (module docstring)."""

    __slots__ = ("pos", "ends", "blob")

    def __init__(self, pos: np.ndarray, ends: np.ndarray, blob: bytes):
        self.pos, self.ends, self.blob = pos, ends, blob

    @classmethod
    def of(cls, pairs) -> "LongCol":
        """From (position, key) pairs (any order) or a LongCol."""
        if isinstance(pairs, LongCol):
            return pairs
        pairs = sorted(pairs)
        if not pairs:
            return cls(_EMPTY, _EMPTY, b"")
        pos, keys = zip(*pairs)
        return cls(np.array(pos, np.int64), np.cumsum(np.fromiter(map(len, keys), np.int64, len(keys))),
                   b"".join(keys))

    @classmethod
    def uniform(cls, n: int, blob: bytes, key_len: int) -> "LongCol":
        """Every one of ``n`` keys of ``key_len`` bytes is long (a segment of 33-byte keys): no copy."""
        return cls(np.arange(n, dtype=np.int64), np.arange(1, n + 1, dtype=np.int64) * key_len, blob)

    def __len__(self) -> int:
        return len(self.pos)

    def __bool__(self) -> bool:
        return len(self.pos) > 0

    def __eq__(self, other) -> bool:  # (as the (position, key) list it stands for)
        return list(self) == list(other)

    __hash__ = None

    def lens(self) -> np.ndarray:
        return np.diff(self.ends, prepend=0)

    def key(self, j: int) -> bytes:
        return bytes(self.blob[int(self.ends[j - 1]) if j else 0:int(self.ends[j])])

    def __iter__(self):
        ends = self.ends.tolist()
        blob = bytes(self.blob)  # (a segment's may be a memoryview: ``records.Segment.keys``; bytes as they are)
        return iter(zip(self.pos.tolist(), [blob[a:b] for a, b in zip([0] + ends[:-1], ends)]))

    def at(self, position: int) -> bytes | None:
        """The key at batch position ``position``; None when it is not long."""
        j = int(np.searchsorted(self.pos, position))
        return self.key(j) if j < len(self.pos) and self.pos[j] == position else None

    def pick(self, entries: np.ndarray, pos: np.ndarray) -> "LongCol":
        """Entries ``entries`` (indexes, in the order of the new ``pos``, which must ascend) at positions ``pos``."""
        lens = self.lens()
        blob, ends = gather(self.blob, self.ends.take(entries) - lens.take(entries), lens.take(entries))
        return LongCol(np.asarray(pos, np.int64), ends, blob)

    def select(self, idx: np.ndarray) -> "LongCol":
        """The long keys of batch positions ``idx`` (ascending), positioned by their index in ``idx``."""
        if not len(self.pos):
            return self
        at = np.minimum(np.searchsorted(idx, self.pos), max(len(idx) - 1, 0))
        mine = np.flatnonzero(idx.take(at) == self.pos) if len(idx) else _EMPTY
        return self.pick(mine, at.take(mine))

    def keep(self, ok: np.ndarray) -> "LongCol":
        """The long keys of the positions where ``ok`` (a bool mask over the batch), positioned among those kept."""
        if not len(self.pos):
            return self
        mine = np.flatnonzero(ok.take(self.pos))
        return self.pick(mine, (np.cumsum(ok) - 1).take(self.pos.take(mine)))

    def permute(self, order: np.ndarray) -> "LongCol":
        """The long keys of a batch taken in ``order`` (a permutation): positions renumbered, kept ascending."""
        if not len(self.pos):
            return self
        inv = np.empty(len(order), np.int64)
        inv[order] = np.arange(len(order))
        new = inv.take(self.pos)
        srt = np.argsort(new, kind="stable")
        return self.pick(srt, new.take(srt))

    @staticmethod
    def cat(parts: list, sizes: list[int]) -> "LongCol":
        """Batches joined: ``parts[i]`` the long keys of a batch of ``sizes[i]`` keys. A fixed number of numpy
        calls however many parts (a load joins a batch's segments: thousands)."""
        at = list(accumulate(sizes, initial=0))
        nz = [i for i, p in enumerate(parts) if len(p.pos)]
        if not nz:
            return LongCol(_EMPTY, _EMPTY, b"")
        if len(nz) == 1:
            p, a = parts[nz[0]], at[nz[0]]
            return p if not a else LongCol(p.pos + a, p.ends, p.blob)
        ps = [parts[i] for i in nz]
        counts = [len(p.pos) for p in ps]
        pos = np.concatenate([p.pos for p in ps])
        pos += np.repeat(np.array([at[i] for i in nz], np.int64), counts)
        ends = np.concatenate([p.ends for p in ps])
        ends += np.repeat(np.array(list(accumulate((int(p.ends[-1]) for p in ps[:-1]), initial=0)), np.int64), counts)
        return LongCol(pos, ends, b"".join(p.blob for p in ps))


class _Chunk:
    __slots__ = ("rows", "ends", "blob", "alive", "live")

    def __init__(self, rows: np.ndarray, ends: np.ndarray, blob: bytes):
        self.rows, self.ends, self.blob = rows, ends, blob
        self.alive = np.ones(len(rows), bool)
        self.live = len(rows)

    def find(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(positions among ``rows`` with a live entry here, those entries)."""
        j = np.minimum(np.searchsorted(self.rows, rows), len(self.rows) - 1)
        hit = np.flatnonzero((self.rows.take(j) == rows) & self.alive.take(j))
        return hit, j.take(hit)

    def key(self, j: int) -> bytes:
        return self.blob[int(self.ends[j - 1]) if j else 0:int(self.ends[j])]

    def compacted(self) -> "_Chunk":
        keep = np.flatnonzero(self.alive)
        lens = np.diff(self.ends, prepend=0)
        blob, ends = gather(self.blob, self.ends.take(keep) - lens.take(keep), lens.take(keep))
        return _Chunk(self.rows.take(keep), ends, blob)


class LongKeys:
    """Row -> long key of the key index (module docstring)."""

    __slots__ = ("d", "chunks")

    def __init__(self) -> None:
        self.d: dict[int, bytes] = {}
        self.chunks: list[_Chunk] = []

    def __len__(self) -> int:
        return len(self.d) + sum(c.live for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.d) or any(c.live for c in self.chunks)

    def add(self, rows: list[int], longs: list[tuple[int, bytes]]) -> None:
        """File an ALLOC's long keys, ``(position in rows, key)`` pairs, with one dict update (0.1 against 0.4 us a
        key filed one at a time with a remap, 1,024 keys of 66 bytes on the 2-core VM)."""
        pos, ks = zip(*longs)
        self.d.update(zip(map(rows.__getitem__, pos), ks))

    def get(self, row: int) -> bytes | None:
        k = self.d.get(row)
        if k is not None or not self.chunks:
            return k
        for c in self.chunks:
            j = int(np.searchsorted(c.rows, row))
            if j < len(c.rows) and c.rows[j] == row and c.alive[j]:
                return c.key(j)
        return None

    def __contains__(self, row: int) -> bool:
        return self.get(row) is not None

    def add_bulk(self, rows: np.ndarray, col: LongCol) -> None:
        """File the long keys of ``col`` at ``rows`` (one a key of it; rows not live here)."""
        if not len(rows):
            return
        rows = np.asarray(rows, np.int64)
        if len(rows) > 1 and (rows[1:] <= rows[:-1]).any():
            srt = np.argsort(rows, kind="stable")
            col = col.pick(srt, srt)
            rows = rows.take(srt)
        self.chunks.append(_Chunk(rows, col.ends, col.blob))
        if len(self.chunks) > MAX_CHUNKS:
            self._merge()

    def _merge(self) -> None:
        cs = [c.compacted() if c.live < len(c.rows) else c for c in self.chunks if c.live]
        if not cs:
            self.chunks = []
            return
        rows = np.concatenate([c.rows for c in cs])
        shift = np.cumsum([0] + [int(c.ends[-1]) for c in cs[:-1]]).tolist()
        col = LongCol(_EMPTY, np.concatenate([c.ends + s for c, s in zip(cs, shift)]), b"".join(c.blob for c in cs))
        srt = np.argsort(rows, kind="stable")
        col = col.pick(srt, srt)
        self.chunks = [_Chunk(rows.take(srt), col.ends, col.blob)]

    def discard(self, rows: np.ndarray) -> None:
        """Forget the keys of ``rows`` (any; those with none are ignored)."""
        d = self.d
        if d:
            for r in rows.tolist():
                d.pop(r, None)
        if self.chunks:
            rows = np.asarray(rows, np.int64)
            for c in self.chunks:
                hit, j = c.find(rows)
                if len(j):
                    c.alive[j] = False
                    c.live = int(np.count_nonzero(c.alive))
            if any(c.live * 2 < len(c.rows) for c in self.chunks):
                self.chunks = [c.compacted() if c.live * 2 < len(c.rows) else c for c in self.chunks if c.live]

    def any_of(self, rows: np.ndarray) -> bool:
        """Whether any of ``rows`` has a long key."""
        if self.d and any(r in self.d for r in rows.tolist()):
            return True
        rows = np.asarray(rows, np.int64)
        return any(len(c.find(rows)[0]) for c in self.chunks if c.live)

    def keys_of(self, rows: np.ndarray) -> list:
        """Each row's long key, None where it has none."""
        out: list = [None] * len(rows)
        rows = np.asarray(rows, np.int64)
        for c in self.chunks:
            if c.live:
                hit, j = c.find(rows)
                for i, jj in zip(hit.tolist(), j.tolist()):
                    out[i] = c.key(jj)
        if self.d:
            get = self.d.get
            for i, r in enumerate(rows.tolist()):
                k = get(r)
                if k is not None:
                    out[i] = k
        return out

    def rows(self) -> np.ndarray:
        """Every row with a long key (tests)."""
        return np.concatenate([np.fromiter(self.d, np.int64, len(self.d))]
                              + [c.rows[c.alive] for c in self.chunks])
