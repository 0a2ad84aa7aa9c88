"""A new leader holds none of the read leases its predecessor granted (metaserver/table/quarantine.py, "Read leases
of the last term"): for ``lease_s`` after its ``start`` it evicts nothing, and an extent of an earlier term's page
that leaves (a remove) stays out of placement until the window ends. Pages of its own term, and every page after the
window, go back at once. In process (tests/test_attack_leases.py: the same over real processes, a read held in the
network across a metaserver restart)."""

from __future__ import annotations

import time

import pytest

from metaserver.table.directory import TableDirectory
from metaserver.table.entry import NEW
from metaserver.table.quarantine import Quarantine
from transport.wire import AllocState
from transport.objformat import object_size

PLEN = 60_000  # a 64 KiB extent
EXT = object_size(PLEN)


def make(pages: int) -> TableDirectory:
    d = TableDirectory()
    d.add_space("n1", pages * EXT)
    return d


def put(d: TableDirectory, keys: list[bytes], gen: int) -> list:
    items, _ = d.alloc("a", keys, [PLEN] * len(keys), None, gen, 0.0)
    ok = [it for it in items if it[0] == NEW]
    if ok:
        done, _ = d.commit("a", [k for k, it in zip(keys, items) if it[0] == NEW], [it[4] for it in ok], 0.0)
        assert done == [True] * len(ok)
    return [it[0] for it in items]


def takeover(d: TableDirectory, issued_below: int, lease_s: float) -> Quarantine:
    q = d.quarantine = Quarantine(0.0, keep_s=30.0)
    q.start(time.monotonic(), issued_below, lease_s)
    return q


def test_within_the_window_nothing_is_evicted_and_a_removed_old_page_keeps_its_extent():
    d = make(4)
    assert put(d, [b"k%d" % i for i in range(4)], 1) == [NEW] * 4  # full, generations 1..4 (the last term's)
    q = takeover(d, 100, 60.0)
    assert q.leasing()
    assert put(d, [b"x"], 100) == [AllocState.NO_SPACE]  # would evict an old page: none while leasing
    assert d.objects == 4
    assert d.remove("a", [b"k0"])[0] == [True]
    assert q.held_bytes == EXT and put(d, [b"x"], 101) == [AllocState.NO_SPACE]  # its extent kept
    d.check()
    assert q.release(time.monotonic() + 61.0, d.spaces, 10) == 1  # the window's end gives it back
    assert q.held_bytes == 0


@pytest.mark.parametrize("lease_s", [0.0, 60.0])
def test_no_window_or_a_window_passed_evicts_and_frees_at_once(lease_s):
    d = make(4)
    put(d, [b"k%d" % i for i in range(4)], 1)
    q = takeover(d, 100, lease_s)
    q.lease_until = min(q.lease_until, time.monotonic())  # a window, if any, that has just ended
    assert not q.leasing()
    assert put(d, [b"x"], 100) == [NEW] and d.objects == 4  # an old page evicted for it
    assert d.remove("a", [b"k3"])[0] == [True] and q.held_bytes == 0


def test_this_terms_pages_leave_at_once_within_the_window():
    d = make(4)
    put(d, [b"k0", b"k1"], 1)
    q = takeover(d, 100, 60.0)
    assert put(d, [b"n0", b"n1"], 100) == [NEW, NEW]  # free space: placed as usual
    assert d.remove("a", [b"n0"])[0] == [True] and q.held_bytes == 0  # this term's page: nobody of the last term reads it
    assert d.remove("a", [b"k0"])[0] == [True] and q.held_bytes == EXT
    d.check()
