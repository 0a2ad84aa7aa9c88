"""Unit tests of the per-node arena allocator (pure bookkeeping, no I/O)."""

import random

import pytest

from metaserver.table.allocator import Allocator
from transport.objformat import ALIGN, ARENA_DATA_START

MiB = 1 << 20


def test_alloc_until_full_then_none():
    a = Allocator(ARENA_DATA_START, 1 * MiB)
    offs = [a.alloc(ALIGN) for _ in range(256)]
    assert None not in offs
    assert sorted(offs) == [ARENA_DATA_START + i * ALIGN for i in range(256)]
    assert a.used == 1 * MiB and a.free_bytes == 0
    assert a.alloc(ALIGN) is None
    a.check()


def test_capacity_rounds_down_to_units():
    a = Allocator(ARENA_DATA_START, 10 * ALIGN + 123)
    assert a.capacity == 10 * ALIGN
    assert a.alloc(11 * ALIGN) is None
    assert a.alloc(10 * ALIGN) == ARENA_DATA_START


def test_free_coalesces_both_neighbours():
    a = Allocator(ARENA_DATA_START, 16 * ALIGN)
    x, y, z = a.alloc(4 * ALIGN), a.alloc(4 * ALIGN), a.alloc(4 * ALIGN)
    a.free(x, 4 * ALIGN)
    a.free(z, 4 * ALIGN)  # merges with the 4 free units at the tail
    a.check()
    assert a.alloc(9 * ALIGN) is None  # 12 units free, but the largest extent is z's 4 plus the tail's 4
    a.free(y, 4 * ALIGN)  # merges with both sides: one extent again
    a.check()
    assert a.used == 0
    assert a.alloc(16 * ALIGN) == ARENA_DATA_START


def test_double_free_and_wrong_size_rejected():
    a = Allocator(ARENA_DATA_START, 16 * ALIGN)
    x = a.alloc(2 * ALIGN)
    with pytest.raises(ValueError):
        a.free(x, 3 * ALIGN)
    a.free(x, 2 * ALIGN)
    with pytest.raises(ValueError):
        a.free(x, 2 * ALIGN)
    a.check()


def test_best_fit_prefers_exact_hole():
    a = Allocator(ARENA_DATA_START, 64 * ALIGN)
    blocks = [a.alloc(n * ALIGN) for n in (3, 1, 2, 1, 5, 1)]
    a.free(blocks[0], 3 * ALIGN)
    a.free(blocks[2], 2 * ALIGN)
    a.free(blocks[4], 5 * ALIGN)
    assert a.alloc(2 * ALIGN) == blocks[2]  # the exact 2-unit hole, not the first or the largest
    assert a.alloc(5 * ALIGN) == blocks[4]
    a.check()


def test_large_power_of_two_bins():
    a = Allocator(ARENA_DATA_START, 4096 * ALIGN)
    big = [a.alloc(n * ALIGN) for n in (300, 700, 300, 1000)]
    assert None not in big
    a.free(big[1], 700 * ALIGN)
    assert a.alloc(600 * ALIGN) == big[1]  # the 700-unit hole fits; 100 units stay free there
    a.check()
    assert a.alloc(5000 * ALIGN) is None


def test_fragmentation_reports_none_despite_free_total():
    a = Allocator(ARENA_DATA_START, 8 * ALIGN)
    offs = [a.alloc(ALIGN) for _ in range(8)]
    for o in offs[::2]:
        a.free(o, ALIGN)
    assert a.free_bytes == 4 * ALIGN
    assert a.alloc(2 * ALIGN) is None  # scattered holes: the caller must evict
    a.free(offs[1], ALIGN)
    assert a.alloc(3 * ALIGN) == offs[0]


def test_random_alloc_free_never_overlaps():
    rng = random.Random(7)
    a = Allocator(ARENA_DATA_START, 2048 * ALIGN)
    live: dict[int, int] = {}
    for step in range(3000):
        if live and (rng.random() < 0.45 or a.free_bytes < 64 * ALIGN):
            off = rng.choice(list(live))
            a.free(off, live.pop(off))
        else:
            size = rng.choice([1, 1, 1, 2, 3, 8, 300, 600]) * ALIGN
            off = a.alloc(size)
            if off is not None:
                assert off not in live
                live[off] = size
        if step % 250 == 0:
            a.check()
    spans = sorted(live.items())
    for (o1, s1), (o2, _) in zip(spans, spans[1:]):
        assert o1 + s1 <= o2
    assert a.used == sum(live.values()) <= a.capacity
    a.check()


def test_rebuild_rejects_overlap_and_out_of_range():
    a = Allocator(ARENA_DATA_START, 16 * ALIGN)
    base = ARENA_DATA_START
    rejected = a.rebuild([(base, 2 * ALIGN), (base + ALIGN, ALIGN), (base + 4 * ALIGN, ALIGN),
                          (base + 15 * ALIGN, 2 * ALIGN), (base - ALIGN, ALIGN)])
    assert rejected == [1, 3, 4]
    assert a.used == 3 * ALIGN
    a.check()
    assert a.alloc(2 * ALIGN) == base + 2 * ALIGN
    assert not a.reserve(base + 4 * ALIGN, ALIGN)  # rebuilt as allocated
    assert a.reserve(base + 5 * ALIGN, ALIGN)  # its neighbour was not


def test_untracked_allocator_checks_against_the_callers_extents():
    # The directory's allocators keep no per-object map (its entries record the extents): check() takes them from
    # the caller, and free() still refuses what it can see cheaply.
    a = Allocator(ARENA_DATA_START, 16 * ALIGN, track=False)
    x, y = a.alloc(2 * ALIGN), a.alloc(3 * ALIGN)
    a.check([(x, 2 * ALIGN), (y, 3 * ALIGN)])
    with pytest.raises(AssertionError):
        a.check([(x, 2 * ALIGN)])  # an allocated extent the caller does not know of
    with pytest.raises(AssertionError):
        a.check()  # untracked: the caller must say what is allocated
    a.free(x, 2 * ALIGN)
    with pytest.raises(ValueError):
        a.free(x, 2 * ALIGN)  # x starts a free extent now: a double free
    with pytest.raises(ValueError):
        a.free(y, 20 * ALIGN)  # past the end of the region
    assert not a.reserve(y, ALIGN)  # y is allocated, x is free
    assert a.reserve(x, ALIGN) and a.used == 4 * ALIGN
    a.check([(x, ALIGN), (y, 3 * ALIGN)])
    assert a.rebuild([(y, 3 * ALIGN), (y, ALIGN)]) == [1] and a.used == 3 * ALIGN
    a.check([(y, 3 * ALIGN)])


@pytest.mark.parametrize("units", [1, 64, 300, 2305])  # exact bins and power-of-two bins
def test_holes_are_refilled_oldest_first_and_bins_that_empty_stay_consistent(units):
    """A pool fragmented into many same-size holes (every other object freed: what evictions leave) is refilled in
    the order the holes were freed, with every bin's mask bit in step with its members after each step (bins that
    empty are kept, their bit cleared). Taking from a bin's head thousands of times is the case that made a
    dict-backed bin quadratic (``bench`` figure in the allocator's docstring)."""
    size = units * ALIGN
    n = 400
    a = Allocator(ARENA_DATA_START, (2 * n + 1) * size, track=False)
    offs = [a.alloc(size) for _ in range(2 * n)]
    assert None not in offs
    holes = offs[::2]
    order = holes[1::2] + holes[0::2]  # freed out of address order
    for off in order:
        a.free(off, size)
    extents = {o: size for o in offs[1::2]}
    a.check(list(extents.items()))
    tail = ARENA_DATA_START + 2 * n * size  # the extent left after the 2n objects: the bin's oldest member
    got = []
    for i in range(n + 1):
        off = a.alloc(size)
        got.append(off)
        extents[off] = size
        if i % 50 == 0 or i == n:
            a.check(list(extents.items()))
    assert got == [tail] + order  # oldest hole first, none skipped or repeated
    assert a.alloc(size) is None
    a.free(got[1], size)  # a bin emptied to nothing is used again
    del extents[got[1]]
    a.check(list(extents.items()))
    assert a.alloc(size) == got[1]


@pytest.mark.parametrize("track", [True, False])
def test_alloc_run_takes_adjacent_extents_each_freed_on_its_own(track):
    a = Allocator(ARENA_DATA_START, 64 * ALIGN, track=track)
    assert a.alloc_run(2 * ALIGN, 8) == (ARENA_DATA_START, 8)  # a fresh region: the whole run
    assert a.used == 16 * ALIGN
    assert a.alloc_run(ALIGN, 1) == (ARENA_DATA_START + 16 * ALIGN, 1)
    for j in (1, 3, 5):  # each object of the run is an extent of its own
        a.free(ARENA_DATA_START + j * 2 * ALIGN, 2 * ALIGN)
    a.check(None if track else [(ARENA_DATA_START + j * 2 * ALIGN, 2 * ALIGN) for j in (0, 2, 4, 6, 7)]
            + [(ARENA_DATA_START + 16 * ALIGN, ALIGN)])
    # holes of one object each: a run there is one object, as alloc would give
    assert a.alloc_run(2 * ALIGN, 4) == (ARENA_DATA_START + 2 * ALIGN, 1)
    full = Allocator(ARENA_DATA_START, 4 * ALIGN, track=track)
    assert full.alloc_run(ALIGN, 9) == (ARENA_DATA_START, 4) and full.alloc_run(ALIGN, 2) is None


@pytest.mark.parametrize("seed", range(8))
def test_alloc_runs_give_as_many_extents_as_one_alloc_each_on_random_layouts(seed):
    """``alloc_runs`` (ALLOC's array path) against ``alloc`` a call an extent: on the same fragmented layout, for
    random sizes and counts, the same number of extents (each call succeeds while some free extent holds one),
    inside the region, never overlapping, and the allocator's invariants hold after either (extents freed again
    one by one)."""
    rng = random.Random(seed)
    for _round in range(20):
        a = Allocator(ARENA_DATA_START, rng.randint(16, 400) * ALIGN, track=False)
        b = Allocator(ARENA_DATA_START, a.capacity, track=False)
        used: dict[int, int] = {}
        for _ in range(rng.randint(0, 60)):  # the same layout in both: random allocations, some freed again
            size = rng.randint(1, 6) * ALIGN
            off = a.alloc(size)
            if off is None:
                break
            assert b.alloc(size) == off
            used[off] = size
        for off in rng.sample(sorted(used), len(used) // 2):
            a.free(off, used[off])
            b.free(off, used.pop(off))
        size, count = rng.randint(1, 5) * ALIGN, rng.randint(1, 80)
        runs = a.alloc_runs(size, count)
        got_a = [off + j * size for off, n in runs for j in range(n)]
        got_b = []
        for _ in range(count):
            off = b.alloc(size)
            if off is None:
                break
            got_b.append(off)
        assert len(got_a) == len(got_b) <= count and len(set(got_a)) == len(got_a)
        assert a.used == b.used and a.free_bytes == b.free_bytes
        for x, got in ((a, got_a), (b, got_b)):
            x.check(list(used.items()) + [(off, size) for off in got])
            for off in got:  # each extent of a run is one of its own
                x.free(off, size)
            x.check(list(used.items()))
