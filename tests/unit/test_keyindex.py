"""metaserver/table/index.py: the bucketed cuckoo index against a dict (random batches of inserts, deletes and finds in
several namespaces, resizes mid-way, tags that collide on purpose, rows no bucket takes), and its incremental resize:
the old table is drained into the new one a slice at a time (by each insert's share and by ``step``), every key
stays findable and deletable in whichever table holds it, and no single call visits more old slots than its budget.
Counted, not timed."""

from __future__ import annotations

import random

import numpy as np

from metaserver.table.index import MAX_LOAD, MIN_SLOTS, SLOTS, KeyIndex
from transport.keyform import digests

ROWS = 300_000


def keys_of(lo: int, hi: int, tag: bytes = b"") -> list[bytes]:
    return [tag + i.to_bytes(32 - len(tag), "little") for i in range(lo, hi)]


class Rows:
    """A key index with the row and namespace bookkeeping a page table would do (rows handed out in order, or
    reused once freed), and a dict of what it should hold."""

    def __init__(self, ix: KeyIndex | None = None, rows: int = ROWS) -> None:
        self.ix = ix or KeyIndex()
        self.ix.grow(rows)
        self.ns = np.zeros(rows, np.uint16)
        self.next = 0
        self.free: list[int] = []
        self.live: dict[tuple[int, bytes], int] = {}

    def insert(self, keys: list[bytes], ns: int = 0) -> int:
        """File ``keys`` (absent ones); returns the old slots this insert drained."""
        take = min(len(self.free), len(keys))
        reused = [self.free.pop() for _ in range(take)]
        rows = np.array(reused + list(range(self.next, self.next + len(keys) - take)), np.int64)
        self.next += len(keys) - take
        self.ns[rows] = ns
        before = self.ix.drained
        dig, longs = digests(keys)
        self.ix.insert(rows, dig, self.ns, longs)
        self.live.update({(ns, k): int(r) for k, r in zip(keys, rows)})
        return self.ix.drained - before

    def delete(self, keys: list[bytes], ns: int = 0) -> None:
        rows = np.array([self.live.pop((ns, k)) for k in keys], np.int64)
        self.ix.delete(rows, np.full(len(rows), ns, np.uint64))
        self.free.extend(rows.tolist())

    def find(self, keys: list[bytes], ns: int = 0) -> list[int]:
        return self.ix.find(ns, digests(keys)[0], self.ns).tolist()

    def expect(self, keys: list[bytes], ns: int = 0) -> list[int]:
        return [self.live.get((ns, k), -1) for k in keys]

    def check(self) -> None:
        self.ix.check(np.array(sorted(self.live.values()), np.int64), self.ns)
        assert self.ix.live == len(self.live)


def test_random_batches_match_a_dict_across_resizes_and_namespaces():
    """60 rounds of random batches (new keys, keys filed already, deletes, finds of present and absent keys, in
    three namespaces; a fifth of the keys not 32 bytes long): every answer is the dict's, through several resizes,
    with checks mid-drain; rows are reused once freed, as the table reuses them; long keys come back as sent."""
    rng = random.Random(44)
    r = Rows()
    pool = [rng.randbytes(32) if i % 5 else b"long-key-%d" % i for i in range(120_000)]
    mid_drain = 0
    for b in range(60):
        ns = rng.randrange(3)
        fresh = [k for k in rng.sample(pool, rng.randrange(1, 4000)) if (ns, k) not in r.live]
        r.insert(list(dict.fromkeys(fresh)), ns)
        held = [k for (n, k) in r.live if n == ns]
        gone = rng.sample(held, min(len(held), rng.randrange(0, 1500)))
        r.delete(gone, ns)
        probe = rng.sample(pool, 2000) + gone[:100]
        for n in range(3):
            assert r.find(probe, n) == r.expect(probe, n), (b, n)
        if r.ix.old is not None:
            r.check()
            mid_drain += 1
        if b % 10 == 9:
            r.check()
    assert r.ix.resizes >= 3 and mid_drain >= 2, (r.ix.resizes, mid_drain)
    assert r.ix.kicks > 0, "tables filled to MAX_LOAD: some rows were moved to their other bucket, under checks"
    for (n, k), row in list(r.live.items())[:2000]:
        assert r.ix.key_of(row) == k
    while r.ix.step(5000, r.ns):
        pass
    r.check()


class CollidingTags(KeyIndex):
    """Every key gets one of two tags, so most slots a find reads match its tag and the digests decide."""

    @staticmethod
    def _where(h, tab):
        bb, tag = KeyIndex._where(h, tab)
        return bb, (tag & np.uint16(1)) + np.uint16(1)


def test_colliding_tags_are_told_apart_by_digest_and_namespace():
    """Tags that collide all the time (two values): finds, deletes and resizes still answer as a dict, in two
    namespaces holding the same keys."""
    r = Rows(CollidingTags(), 100_000)
    keys = keys_of(0, 40_000)
    for lo in range(0, 40_000, 2000):
        r.insert(keys[lo:lo + 2000], 0)
        r.insert(keys[lo:lo + 2000:2], 1)
    r.delete(keys[::3], 0)
    r.delete(keys[:20_000:4], 1)
    r.check()
    probe = keys + keys_of(40_000, 41_000)
    assert r.find(probe, 0) == r.expect(probe, 0) and r.find(probe, 1) == r.expect(probe, 1)
    assert r.find(probe[:100], 2) == [-1] * 100


class TwoBuckets(KeyIndex):
    """Every key's two buckets are buckets 0 and 1 while the table is small: 20 slots for everyone."""

    @staticmethod
    def _where(h, tab):
        bb, tag = KeyIndex._where(h, tab)
        if tab.n < 4 * (MIN_SLOTS // SLOTS):
            bb = (np.arange(len(bb)) >= len(h)).astype(np.int64)  # first buckets 0, second buckets 1
        return bb, tag


def test_rows_no_bucket_takes_wait_in_the_stash_and_the_next_insert_files_them():
    """25 keys that all have the same two buckets: 20 are filed, 5 wait in the stash, found and deletable there;
    the next insert starts a resize (a table where keys spread again) and files the stash in it."""
    r = Rows(TwoBuckets(), 200_000)
    keys = keys_of(0, 25)
    r.insert(keys)
    assert r.ix.t.live == 20 and len(r.ix.stash) == 5 and r.ix.kicks > 0
    r.check()
    assert r.find(keys) == r.expect(keys)
    stashed = [r.ix.key_of(int(x)) for x in r.ix.stash[:2]]
    filed = next(k for k in keys if k not in stashed and r.live[(0, k)] not in r.ix.stash)
    r.delete(stashed + [filed])
    assert len(r.ix.stash) == 3
    r.check()
    big = 4 * MIN_SLOTS  # enough rows that the new table is past TwoBuckets' small sizes
    r.insert(keys_of(100, 100 + big))
    assert r.ix.resizes == 1 and not len(r.ix.stash)
    while r.ix.step(10_000, r.ns):
        pass
    r.check()
    probe = keys + keys_of(100, 200)
    assert r.find(probe) == r.expect(probe)


def test_keys_that_differ_in_one_word_spread_over_buckets():
    """Raw 32-byte keys a client picks to share three of their four words still land apart: every word is hashed,
    so 30,000 such keys fill a table past its top load with few moves and nothing in the stash."""
    r = Rows()
    keys = [b"\x07" * 24 + i.to_bytes(8, "little") for i in range(30_000)]
    for lo in range(0, len(keys), 1000):
        r.insert(keys[lo:lo + 1000])
    assert r.ix.resizes >= 1
    assert not len(r.ix.stash) and r.ix.kicks < 0.05 * len(keys), r.ix.kicks
    r.check()


def test_watch_is_told_of_rows_filed_and_unfiled_not_of_a_resizes_moves():
    seen: list[tuple[list[int], int]] = []
    ix = KeyIndex()
    ix.watch = lambda rows, sign: seen.append((rows.tolist(), sign))
    r = Rows(ix, 100_000)
    r.insert(keys_of(0, 3))
    r.delete(keys_of(1, 2))
    assert seen == [([0, 1, 2], 1), ([1], -1)]
    seen.clear()
    r.insert(keys_of(10, 60_000))  # a resize, drained by this insert's share and then by step
    while ix.step(1000, r.ns):
        pass
    assert [s for _, s in seen] == [1] and sum(len(x) for x, _ in seen) == 59_990


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
        assert r.find(probe, ns) == r.expect(probe, ns)
        assert r.find(probe[:50], 1 - ns) == r.expect(probe[:50], 1 - ns)
        if r.ix.old is not None and b % 4 == 0:
            r.check()
            mid_drain_checks += 1
    assert r.ix.resizes >= 3 and r.ix.capacity >= 170_000, (r.ix.resizes, r.ix.capacity)
    assert mid_drain_checks >= 3, mid_drain_checks
    assert 0 < biggest < r.ix.capacity // 4, biggest  # slices, never a whole table at once
    while r.ix.step(4096, r.ns):
        pass
    assert r.ix.old is None
    r.check()


def test_step_drains_the_old_table_in_slices_of_its_budget():
    """A resize started by one insert is drained by ``step`` alone: exactly ceil(old buckets / budget's buckets)
    slices, none over the budget, the old table dropped after the last, and every key still found; keys deleted
    mid-drain are unfiled from the old table."""
    r = Rows()
    top = int(MAX_LOAD * r.ix.capacity)
    r.insert(keys_of(0, top - 500))  # under MAX_LOAD: no resize yet
    assert r.ix.resizes == 0 and r.ix.old is None
    r.insert(keys_of(top - 500, top + 300))  # past it: a new table, the old one drained only by this insert's share
    assert r.ix.resizes == 1 and r.ix.old is not None
    old_slots = r.ix.old.capacity
    in_old = r.ix.old.live
    assert in_old > top // 2, in_old  # most rows still wait in the old table
    r.delete(keys_of(0, 5000))  # removed from whichever table holds each
    assert r.ix.old.live < in_old - 3000 and r.find(keys_of(4990, 5010)) == [-1] * 10 + list(range(5000, 5010))
    left = old_slots - r.ix.cursor * SLOTS
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
    assert r.ix.step(1000, r.ns) == 0
    r.check()
    keys = keys_of(0, top + 300)
    assert r.find(keys) == [-1] * 5000 + list(range(5000, top + 300))


def test_an_insert_past_the_new_tables_room_finishes_the_drain_and_starts_the_next():
    """One request bigger than the room the pace allowed for: the drain under way ends in that request, a second
    resize starts, and nothing is lost."""
    r = Rows()
    top = int(MAX_LOAD * r.ix.capacity)
    r.insert(keys_of(0, top - 100))
    r.insert(keys_of(top - 100, top + 200))
    assert r.ix.resizes == 1 and r.ix.old is not None
    r.insert(keys_of(top + 200, 150_000))  # far past the new table's MAX_LOAD
    assert r.ix.resizes == 2
    r.check()
    keys = keys_of(0, 150_000)
    assert r.find(keys) == list(range(150_000))
    r.delete(keys[:100_000])
    assert r.find(keys[99_990:100_010]) == [-1] * 10 + list(range(100_000, 100_010))
    r.check()


def test_reserve_sizes_an_empty_index_once():
    ix = KeyIndex()
    ix.reserve(500_000)
    assert ix.resizes == 1 and ix.old is None and ix.capacity * MAX_LOAD >= 500_000
    r = Rows(ix, 500_000)
    for lo in range(0, 500_000, 50_000):
        r.insert(keys_of(lo, lo + 50_000))
    assert ix.resizes == 1, "reserved: no resize while it filled"
    ix.reserve(10)
    assert ix.resizes == 1, "no effect on an index that holds rows"
    r.check()


def test_either_tag_compare_and_a_one_namespace_find_answer_as_a_dict(monkeypatch):
    """``find``'s two tag compares (lanes of each key's buckets below ``COPY_TAGS`` keys, a contiguous copy against
    each tag repeated from it) and its one-namespace form (``ns_col`` None: the rows' namespaces not read) give the
    dict's answers, with tags that collide all the time, keys found in either bucket, absent keys and a key twice,
    mid-drain too (keys looked for in the old table)."""
    from metaserver.table import index

    r = Rows(CollidingTags(), 80_000)
    keys = keys_of(0, 60_000)
    drained_mid = 0
    for lo in range(0, 60_000, 1500):
        r.insert(keys[lo:lo + 1500])
        r.delete(keys[lo:lo + 1500:7])
        probe = keys[max(0, lo - 2000):lo + 1000:3] + keys_of(90_000, 90_100)
        probe += probe[:5]
        drained_mid += r.ix.old is not None
        for size in (37, 700):
            part = probe[:size]
            want = r.expect(part)
            for copy in (1, 1 << 30):
                monkeypatch.setattr(index, "COPY_TAGS", copy)
                assert r.find(part) == want, (lo, size, copy)
                assert r.ix.find(0, digests(part)[0], None).tolist() == want, (lo, size, copy)
    assert drained_mid >= 1


class SameBuckets(KeyIndex):
    """Half the keys have one bucket for both candidates (as a multiply-shift reduction sometimes gives)."""

    @staticmethod
    def _where(h, tab):
        bb, tag = KeyIndex._where(h, tab)
        n = len(h)
        same = (h & np.uint64(1)).astype(bool)
        bb[n:][same] = bb[:n][same]
        return bb, tag


def test_keys_whose_two_buckets_are_one_are_deleted_once():
    """A delete finds such a key's slot twice (its bucket read as first and second): it is emptied once, the
    bucket kept compact, and the index answers as a dict through deletes of several rows a bucket, resizes
    included."""
    r = Rows(SameBuckets(), 60_000)
    keys = keys_of(0, 50_000)
    for lo in range(0, 50_000, 2500):
        r.insert(keys[lo:lo + 2500])
        r.delete(keys[lo:lo + 2500:3])
        probe = keys[max(0, lo - 5000):lo + 2500:2] + keys_of(70_000, 70_050)
        assert r.find(probe) == r.expect(probe), lo
    r.check()
    r.delete([k for k in keys if (0, k) in r.live][::2])
    r.check()
    assert r.ix.resizes >= 1
