"""The disk tier's moves whose outcome the metaserver does not know (metaserver/table/tiers.py ``finish`` with
``keep_s``; ``Tiers.open_extents`` in metaserver/ha/handoff.py): their destination extents stay out of placement
while the node may still write them. In process, no I/O (tests/test_attack_tiering.py: the same over real
processes, the request held in the network)."""

from __future__ import annotations

import time

import msgpack
import numpy as np

from metaserver.ha import handoff
from metaserver.table.directory import TableDirectory
from metaserver.table.entry import NEW
from metaserver.table.quarantine import Quarantine
from transport import objformat
from transport.objformat import object_size

PLEN = 60_000  # a 64 KiB extent
EXT = object_size(PLEN)


def make() -> TableDirectory:
    d = TableDirectory()
    d.tiers.disks["n1"] = 16 * EXT
    d.add_space("n1", 8 * EXT)
    d.quarantine = Quarantine(0.0, keep_s=30.0)
    return d


def put(d: TableDirectory, keys: list[bytes], gen: int) -> list[int]:
    items, _ = d.alloc("a", keys, [PLEN] * len(keys), None, gen, 0.0)
    assert [it[0] for it in items] == [NEW] * len(keys)
    assert d.commit("a", keys, [it[4] for it in items], 0.0)[0] == [True] * len(keys)
    return [it[2] for it in items]


def test_a_move_whose_answer_was_lost_keeps_its_destinations_out_of_placement_for_keep_s():
    d = make()
    put(d, [b"k%d" % i for i in range(8)], 1)
    move = d.tiers.plan_demote("n1", 2 * EXT, 64, now=1.0)
    assert move is not None and len(move) == 2
    dst = sorted(move.offs)
    assert d.tiers.finish(move, set(range(len(move))), keep_s=30.0) == 0
    d.check()
    twin = d.tiers.twin("n1")
    assert sorted(off for off, _ in d.quarantine.extents(twin)) == dst
    assert all(twin.alloc.alloc(EXT) not in dst for _ in range(14))  # the rest of the disk, never those two
    assert d.quarantine.release(time.monotonic() + 31.0, d.spaces, 10) == 2
    assert sorted(twin.alloc.alloc(EXT) for _ in range(2)) == dst


def test_a_move_the_node_answered_gives_its_failed_destinations_back_at_once():
    d = make()
    put(d, [b"k%d" % i for i in range(8)], 1)
    move = d.tiers.plan_demote("n1", 2 * EXT, 64, now=1.0)
    dst = sorted(move.offs)
    assert d.tiers.finish(move, set(range(len(move)))) == 0
    assert d.quarantine.held_bytes == 0
    assert sorted(d.tiers.twin("n1").alloc.alloc(EXT) for _ in range(2)) == dst


def test_a_leader_that_gives_up_hands_its_moves_destinations_on():
    d = make()
    put(d, [b"k%d" % i for i in range(8)], 1)
    move = d.tiers.plan_demote("n1", 2 * EXT, 64, now=1.0)
    rs = msgpack.unpackb(handoff.open_ops(_Store, d)[0][1])[1]
    assert rs == handoff.runs([("n1/disk", o, s) for o, s in zip(move.offs, move.sizes)])
    new = make()
    put(new, [b"k%d" % i for i in range(8)], 1)
    new.tiers.add("n1")
    blob = msgpack.packb([time.time(), rs])
    assert handoff.hold(new, blob)[1] == 2 * EXT
    twin = new.tiers.twin("n1")
    assert all(twin.alloc.alloc(EXT) not in move.offs for _ in range(14))
    assert objformat.DISK_DATA_START <= min(move.offs)


class _Store:
    open_key = b"open"

    @staticmethod
    def op_put(key, value):
        return (key, value)

    @staticmethod
    def op_delete(key):
        return (key, None)


class _Tokens:  # an open pool's lookups: no tags to compute
    @staticmethod
    def tags(ns, keys):
        return np.zeros(len(keys), np.uint64)


def _lease(d: TableDirectory, keys: list[bytes], now: float) -> tuple[int, dict]:
    """A reader's LOOKUP, its lease kept: (lease, key -> answered offset)."""
    ans = d.lookup_granted("a", keys, now, None, _Tokens, lambda name: None)
    return ans["lease"], {k: loc[1] for k, loc in zip(keys, ans["locs"]) if loc is not None}


def test_a_disk_page_a_reader_holds_is_neither_evicted_for_room_nor_its_extent_given_to_a_demotion():
    """Checked sound: the twin's own eviction (``plan_demote`` making room) skips a page under a read lease, and
    no move's destination is its extent until the reader lets go."""
    d = TableDirectory()
    d.tiers.disks["n1"] = 2 * EXT
    d.add_space("n1", 4 * EXT)
    keys = [b"k%d" % i for i in range(4)]
    put(d, keys, 1)
    assert d.tiers.finish(d.tiers.plan_demote("n1", 2 * EXT, 64, now=1.0), set()) == 2  # the disk is full
    on_disk = [k for k, off in _lease(d, keys, 2.0)[1].items() if off & objformat.DISK_BIT]
    d.expire_leases(1e9, 100)
    lease, held = _lease(d, on_disk[:1], 3.0)  # a reader holds one disk page
    extent = held[on_disk[0]] ^ objformat.DISK_BIT
    move = d.tiers.plan_demote("n1", 2 * EXT, 64, now=4.0)
    assert move is not None and extent not in move.offs
    d.tiers.finish(move, set())
    d.check()
    assert _lease(d, on_disk[:1], 5.0)[1] == {on_disk[0]: held[on_disk[0]]}  # still there, same place
    assert d.release(lease)


def test_a_promoted_pages_disk_extent_stays_allocated_while_a_reader_of_the_disk_copy_holds_it():
    """Checked sound: a reader's lease taken on a disk page while its promotion is in flight keeps the old extent
    (GONE, pinned) out of the twin's allocator until the RELEASE, so no demotion rewrites what it reads."""
    d = TableDirectory()
    d.tiers.disks["n1"] = 4 * EXT
    d.add_space("n1", 4 * EXT)
    keys = [b"k%d" % i for i in range(4)]
    put(d, keys, 1)
    assert d.tiers.finish(d.tiers.plan_demote("n1", 4 * EXT, 64, now=1.0), set()) == 4
    lease0, _ = _lease(d, keys[:1], 2.0)  # read from disk: a promotion candidate
    assert d.release(lease0)
    move = d.tiers.plan_promote("n1", 64, now=3.0)
    assert move is not None and len(move) == 1
    lease, held = _lease(d, keys[:1], 3.5)  # a reader of the disk copy, during the move
    extent = held[keys[0]] ^ objformat.DISK_BIT
    assert d.tiers.finish(move, set()) == 1
    d.check()
    twin = d.tiers.twin("n1")
    assert twin.alloc.alloc(EXT) is None  # three pages still on disk and the read one's extent: nothing free
    assert d.release(lease)
    assert twin.alloc.alloc(EXT) == extent
