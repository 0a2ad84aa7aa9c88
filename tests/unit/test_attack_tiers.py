"""The disk tier's moves whose outcome the metaserver does not know (metaserver/table/tiers.py ``finish`` with
``unsure``; ``Tiers.open_extents`` in metaserver/ha/handoff.py): their destination extents stay out of placement
while the node may still write them. In process, no I/O (tests/test_attack_tiering.py: the same over real
processes, the request held in the network)."""

from __future__ import annotations

import time

import msgpack

from metaserver.ha import handoff
from metaserver.table.directory import TableDirectory
from metaserver.table.entry import NEW
from metaserver.table.quarantine import Quarantine
from transport import wire
from transport.wire import object_size

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
    assert d.tiers.finish(move, set(range(len(move))), unsure=True) == 0
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
    assert wire.DISK_DATA_START <= min(move.offs)


class _Store:
    open_key = b"open"

    @staticmethod
    def op_put(key, value):
        return (key, value)

    @staticmethod
    def op_delete(key):
        return (key, None)
