"""metaserver/keyindex.py's incremental resize: the old table is drained into the new one a slice at a time (by each
insert's share and by ``step``), every key stays findable and deletable in whichever table holds it, and no single
call visits more old slots than its budget. Counted, not timed."""

from __future__ import annotations

import numpy as np

from metaserver.keyindex import MIN_SLOTS, KeyIndex, digests

ROWS = 300_000


def keys_of(lo: int, hi: int, tag: bytes = b"") -> list[bytes]:
    return [tag + i.to_bytes(32 - len(tag), "little") for i in range(lo, hi)]


class Rows:
    """A key index with the row and namespace bookkeeping a page table would do (rows handed out in order)."""

    def __init__(self) -> None:
        self.ix = KeyIndex()
        self.ix.grow(ROWS)
        self.ns = np.zeros(ROWS, np.uint16)
        self.next = 0
        self.live: dict[tuple[int, bytes], int] = {}

    def insert(self, keys: list[bytes], ns: int = 0) -> int:
        """File ``keys``; returns the old slots this insert drained."""
        rows = np.arange(self.next, self.next + len(keys), dtype=np.int64)
        self.next += len(keys)
        self.ns[rows] = ns
        before = self.ix.drained
        self.ix.insert(rows, digests(keys)[0], self.ns)
        self.live.update({(ns, k): int(r) for k, r in zip(keys, rows)})
        return self.ix.drained - before

    def delete(self, keys: list[bytes], ns: int = 0) -> None:
        rows = np.array([self.live.pop((ns, k)) for k in keys], np.int64)
        self.ix.delete(rows, np.full(len(rows), ns, np.uint64))

    def find(self, keys: list[bytes], ns: int = 0) -> list[int]:
        return self.ix.find(ns, digests(keys)[0], self.ns).tolist()

    def check(self) -> None:
        self.ix.check(np.array(sorted(self.live.values()), np.int64), self.ns)


def test_a_resize_drains_by_each_inserts_share_and_keys_stay_found_in_both_tables():
    """200k keys in batches of 1,000 (two namespaces, deletes and finds between): several resizes, each drained
    over many inserts; an insert never drains more than its pace times its rows; checks taken mid-drain see every
    live row filed once across the two tables."""
    r = Rows()
    mid_drain_checks = 0
    biggest = 0
    for b in range(200):
        ns = b % 2
        keys = keys_of(b * 1000, (b + 1) * 1000)
        drained = r.insert(keys, ns)
        if r.ix.old is not None or drained:
            pace = r.ix.pace
            assert drained <= pace * len(keys), (b, drained, pace)
            biggest = max(biggest, drained)
        if b % 3 == 0:  # a third of a batch removed, from whichever table holds it
            r.delete(keys[::3], ns)
        probe = keys_of(max(0, b * 1000 - 5000), b * 1000 + 1000)
        assert r.find(probe, ns) == [r.live.get((ns, k), -1) for k in probe]
        assert r.find(probe[:50], 1 - ns) == [r.live.get((1 - ns, k), -1) for k in probe[:50]]
        if r.ix.old is not None and b % 4 == 0:
            r.check()
            mid_drain_checks += 1
    assert r.ix.resizes >= 3 and len(r.ix.slots) >= 1 << 19, (r.ix.resizes, len(r.ix.slots))
    assert mid_drain_checks >= 3, mid_drain_checks
    assert 0 < biggest < MIN_SLOTS, biggest  # slices, never a whole table at once
    while r.ix.step(4096, r.ns):
        pass
    assert r.ix.old is None
    r.check()
    assert r.ix.live == len(r.live)


def test_step_drains_the_old_table_in_slices_of_its_budget():
    """A resize started by one insert is drained by ``step`` alone: exactly ceil(old slots / budget) slices, none
    over the budget, the old table dropped after the last, and every key still found; keys deleted mid-drain are
    unfiled from the old table."""
    r = Rows()
    r.insert(keys_of(0, 32_000))  # under half of 65,536: no resize yet
    assert r.ix.resizes == 0 and r.ix.old is None
    r.insert(keys_of(32_000, 32_800))  # past it: a new table, the old one drained only by this insert's share
    assert r.ix.resizes == 1 and r.ix.old is not None
    old_slots = len(r.ix.old.slots)
    in_old = int(np.count_nonzero(r.ix.old.slots >= 0))
    assert in_old > 20_000, in_old  # most rows still wait in the old table
    r.delete(keys_of(0, 5000))  # removed from whichever table holds each
    assert r.ix.old.live < in_old - 3000 and r.find(keys_of(4990, 5010)) == [-1] * 10 + list(range(5000, 5010))
    left = old_slots - r.ix.cursor
    slices = []
    for _ in range(10_000):  # bounded: far more than the slices needed
        n = r.ix.step(1000, r.ns)
        if not n:
            break
        slices.append(n)
        if len(slices) == 5:
            r.check()  # mid-drain
    assert max(slices) <= 1000 and sum(slices) == left and len(slices) == -(-left // 1000)
    assert r.ix.old is None and r.ix.drained == old_slots
    r.check()
    keys = keys_of(0, 32_800)
    assert r.find(keys) == [-1] * 5000 + list(range(5000, 32_800))


def test_an_insert_past_the_new_tables_room_finishes_the_drain_and_starts_the_next():
    """One request bigger than the room the pace allowed for: the drain under way ends in that request, a second
    resize starts, and nothing is lost."""
    r = Rows()
    r.insert(keys_of(0, 32_700))
    r.insert(keys_of(32_700, 33_000))
    assert r.ix.resizes == 1 and r.ix.old is not None
    r.insert(keys_of(33_000, 150_000))  # far past the new table's MAX_LOAD
    assert r.ix.resizes == 2
    r.check()
    keys = keys_of(0, 150_000)
    assert r.find(keys) == list(range(150_000))
    r.delete(keys[:100_000])
    assert r.find(keys[99_990:100_010]) == [-1] * 10 + list(range(100_000, 100_010))
    r.check()
