"""Unit tests of the open-allocation hand-off record (``metaserver/ha/handoff.py``): runs, the hold, bad records."""

from __future__ import annotations

import time

import msgpack
import pytest

from metaserver.ha import handoff
from metaserver.table import queries
from metaserver.table.entry import NEW
from metaserver.table.quarantine import Quarantine
from metaserver.table.directory import TableDirectory
from transport.objformat import ALIGN, ARENA_DATA_START

PAGE = ALIGN - 64  # one 4 KiB unit with its header


def make(units: int = 8) -> TableDirectory:
    d = TableDirectory()
    d.add_space("n1", units * ALIGN)
    d.quarantine = Quarantine(0.0, keep_s=30.0)
    return d


def test_runs_merge_adjacent_extents_per_node():
    got = handoff.runs([("b", 100, 10), ("a", 20, 5), ("a", 10, 10), ("a", 40, 4), ("b", 110, 1)])
    assert got == [["a", 10, 15], ["a", 40, 4], ["b", 100, 11]]
    assert handoff.runs([]) == []


def test_open_allocations_are_held_by_the_next_directory_then_released():
    old = make()
    items, _ = old.alloc("ns", [b"a", b"b", b"c"], [PAGE] * 3, None, 100, 0.0)
    assert [it[0] for it in items] == [NEW] * 3
    old.commit("ns", [b"b"], [101], 0.0)  # committed: not open any more
    assert sorted(queries.open_extents(old)) == [("n1", ARENA_DATA_START, ALIGN),
                                                 ("n1", ARENA_DATA_START + 2 * ALIGN, ALIGN)]
    blob = msgpack.packb([time.time(), handoff.runs(queries.open_extents(old))])
    new = make()
    assert handoff.hold(new, blob) == (2, 2 * ALIGN)
    items, _ = new.alloc("ns", [b"x", b"y"], [PAGE] * 2, None, 200, 0.0)
    assert sorted(it[2] for it in items) == [ARENA_DATA_START + ALIGN, ARENA_DATA_START + 3 * ALIGN]
    assert new.quarantine.release(time.monotonic() + 31.0, new.spaces, 10) == 2  # after the hold: placeable again
    items, _ = new.alloc("ns", [b"z"], [PAGE], None, 300, 0.0)
    assert items[0][2] == ARENA_DATA_START


@pytest.mark.parametrize("blob", [b"\xc1", msgpack.packb("x"), msgpack.packb([1.0]), msgpack.packb([1.0, [[1]]]),
                                  msgpack.packb(["t", []]), msgpack.packb([1.0, [["n1", "o", 1]]])])
def test_an_unreadable_record_is_ignored(blob):
    d = make()
    assert handoff.hold(d, blob) == (0, 0)
    assert d.quarantine.held_bytes == 0


def test_an_old_record_or_unknown_node_or_used_bytes_hold_nothing():
    d = make()
    old = msgpack.packb([time.time() - 60, [["n1", ARENA_DATA_START, ALIGN]]])
    assert handoff.hold(d, old) == (0, 0)
    gone = msgpack.packb([time.time(), [["n9", ARENA_DATA_START, ALIGN], ["n1", 3, ALIGN]]])
    assert handoff.hold(d, gone) == (0, 0)
    d.alloc("ns", [b"a"], [PAGE], None, 1, 0.0)
    used = msgpack.packb([time.time(), [["n1", ARENA_DATA_START, 2 * ALIGN], ["n1", ARENA_DATA_START + ALIGN, ALIGN]]])
    assert handoff.hold(d, used) == (1, ALIGN)  # only the run whose bytes are all free


def test_aborts_inside_keeping_keep_their_extents_and_a_handover_hands_them_on():
    """An allocation aborted because its writer's connection closed (``drop_pending`` frees inside ``keeping()``)
    keeps its extent out of placement for keep_s, counted in held_bytes and the allocator invariant, and is part
    of the hand-off record; an abort outside ``keeping()`` frees at once, as before."""
    d = make()
    items, _ = d.alloc("ns", [b"a", b"b", b"c"], [PAGE] * 3, None, 100, 0.0)
    assert [it[2] for it in items] == [ARENA_DATA_START + i * ALIGN for i in range(3)]
    with d.quarantine.keeping():
        assert d.abort("ns", [b"a", b"b"], [100, 101]) == 2
    assert d.abort("ns", [b"c"], [102]) == 1  # not inside keeping(): free now
    assert d.pending == 0 and d.quarantine.held_bytes == 2 * ALIGN and d.quarantine.waiting
    d.check()  # the kept extents are allocated and held by no row
    assert handoff.runs(queries.open_extents(d) + d.quarantine.kept_extents()) == [["n1", ARENA_DATA_START, 2 * ALIGN]]
    items, _ = d.alloc("ns", [b"x", b"y"], [PAGE] * 2, None, 200, 0.0)
    assert [it[2] for it in items] == [ARENA_DATA_START + 2 * ALIGN, ARENA_DATA_START + 3 * ALIGN]
    assert d.quarantine.release(time.monotonic() + 1.0, d.spaces, 10) == 0  # not yet
    assert d.quarantine.release(time.monotonic() + 31.0, d.spaces, 10) == 2
    assert d.quarantine.held_bytes == 0 and not d.quarantine.waiting
    items, _ = d.alloc("ns", [b"z"], [PAGE], None, 300, 0.0)
    assert items[0][2] == ARENA_DATA_START
    d.check()
