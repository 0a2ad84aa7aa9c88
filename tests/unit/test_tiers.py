"""The disk tier in the page table (metaserver/table/tiers.py): a node's disk is a twin node of the table, moves
between the tiers are a plan and a finish around the node's copy. In process, no I/O: the node's answer is given by
hand, as the service would pass it on (tests/test_tiering.py runs the whole path over real processes)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from metaserver.store.persist import EtcdStore
from metaserver.table.directory import TableDirectory
from metaserver.table.entry import NEW, Effects
from metaserver.table.snapshot import PageRecords
from metaserver.table.tiers import twin_id
from transport import answerrows, objformat
from transport.objformat import object_size

PLEN = 60_000  # a 64 KiB extent
EXT = object_size(PLEN)


class _Tokens:  # an open pool's lookups: no tags to compute
    @staticmethod
    def tags(ns, keys):
        return np.zeros(len(keys), np.uint64)


def make(dram: int = 8, disk: int = 16, namer=None) -> TableDirectory:
    d = TableDirectory(namer=namer) if namer is not None else TableDirectory()
    d.tiers.disks["n1"] = disk * EXT
    d.add_space("n1", dram * EXT)
    return d


def keys_of(lo: int, hi: int) -> list[bytes]:
    return [b"k%03d" % i for i in range(lo, hi)]


def put(d: TableDirectory, keys: list[bytes], gen: int) -> None:
    items, _ = d.alloc("a", keys, [PLEN] * len(keys), None, gen, 0.0)
    new = [(k, it[4]) for k, it in zip(keys, items) if it[0] == NEW]
    assert d.commit("a", [k for k, _ in new], [g for _, g in new], 0.0)[0] == [True] * len(new)


def look(d: TableDirectory, keys: list[bytes]) -> dict:
    """key -> (node id, offset as answered, generation), the lease released."""
    ans = d.lookup_granted("a", keys, 1.0, None, _Tokens, lambda name: None)
    out = {}
    for k, loc in zip(keys, ans["locs"]):
        if loc is not None:
            out[k] = (loc[0], loc[1], loc[3])
    if ans["lease"]:
        assert d.release(ans["lease"])
    return out


def test_a_twin_is_a_node_of_its_own_never_placed_on_and_capacity_counts_dram_only():
    d = make()
    assert set(d.spaces) == {"n1", twin_id("n1")}
    assert [n.node_id for n in d.placing] == ["n1"]
    assert d.capacity == 8 * EXT and d.tiers.totals() == (8 * EXT, 0, 16 * EXT, 0)
    put(d, keys_of(0, 8), 1)
    assert d.tiers.usage("n1") == {"disk_capacity_bytes": 16 * EXT, "disk_used_bytes": 0, "disk_objects": 0}
    assert d.used == 8 * EXT
    d.check()


def test_demotion_moves_the_oldest_pages_to_disk_and_lookups_answer_disk_addresses():
    d = make()
    keys = keys_of(0, 8)
    put(d, keys, 1)
    before = look(d, keys)
    look(d, keys[4:])  # the last four are now the most recent
    move = d.tiers.plan_demote("n1", 4 * EXT, 64, now=2.0)
    assert move is not None and len(move) == 4 and move.to_disk
    rows = np.frombuffer(move.tier_rows(), answerrows.TIER_ROW)
    assert sorted(rows["dram"].tolist()) == sorted(before[k][1] for k in keys[:4])  # the LRU four
    assert (rows["len"] == PLEN).all() and (rows["regen"] == 0).all()
    d.check()  # mid-move: the disk extents are held by the move, the sources pinned
    assert d.tiers.finish(move, set()) == 4
    d.check()
    after = look(d, keys)
    for k in keys[:4]:
        node, off, gen = after[k]
        assert node == "n1" and off & objformat.DISK_BIT and gen == before[k][2]
        assert (off & ~objformat.DISK_BIT) in rows["disk"].tolist()
    for k in keys[4:]:
        assert after[k] == before[k]
    assert d.tiers.usage("n1")["disk_objects"] == 4 and d.used == 4 * EXT
    assert d.tiers.demotions == 4


def test_rows_that_failed_or_changed_during_the_copy_stay_and_give_their_disk_extents_back():
    d = make()
    keys = keys_of(0, 4)
    put(d, keys, 1)
    before = look(d, keys)
    move = d.tiers.plan_demote("n1", 4 * EXT, 64, now=2.0)
    assert len(move) == 4
    order = [d.key_of(r) for r in move.rows.tolist()]
    d.remove("a", [order[1]])  # removed mid-copy (pinned by the move: GONE until the move lets go)
    assert d.tiers.finish(move, {2}) == 2  # row 2: the node refused it
    d.check()
    after = look(d, keys)
    assert order[1] not in after
    assert after[order[2]] == before[order[2]]  # still in DRAM, where it was
    assert after[order[0]][1] & objformat.DISK_BIT and after[order[3]][1] & objformat.DISK_BIT
    assert d.tiers.usage("n1")["disk_used_bytes"] == 2 * EXT and d.tiers.failed_moves == 2


def test_a_move_whose_lease_ran_out_moves_nothing():
    d = make()
    put(d, keys_of(0, 2), 1)
    move = d.tiers.plan_demote("n1", 2 * EXT, 64, now=2.0)
    assert d.expire_leases(2.0 + d.read_lease_s + 1, 100) == 1
    assert d.tiers.finish(move, set()) == 0
    d.check()
    assert all(off & objformat.DISK_BIT == 0 for _, off, _ in look(d, keys_of(0, 2)).values())
    assert d.tiers.usage("n1")["disk_used_bytes"] == 0


def test_a_full_disk_evicts_its_own_oldest_pages_to_take_newer_ones():
    d = make(dram=4, disk=2)
    put(d, keys_of(0, 4), 1)
    for _ in range(2):  # two rounds of two: the first two demoted ones are dropped from disk for the next two
        move = d.tiers.plan_demote("n1", 2 * EXT, 64, now=2.0)
        assert d.tiers.finish(move, set()) == 2
        d.check()
    found = look(d, keys_of(0, 4))
    assert len(found) == 2 and all(off & objformat.DISK_BIT for _, off, _ in found.values())
    assert d.tiers.usage("n1")["disk_objects"] == 2 and d.used == 0


def test_promotion_brings_read_disk_pages_back_under_a_fresh_generation():
    d = make()
    keys = keys_of(0, 4)
    put(d, keys, 1)
    assert d.tiers.finish(d.tiers.plan_demote("n1", 4 * EXT, 64, now=2.0), set()) == 4
    look(d, keys[:2])  # read from disk: candidates
    move = d.tiers.plan_promote("n1", 64, now=3.0)
    assert move is not None and not move.to_disk and sorted(d.key_of(r) for r in move.rows.tolist()) == keys[:2]
    move.regen[:] = [900, 901]
    rows = np.frombuffer(move.tier_rows(), answerrows.TIER_ROW)
    assert sorted(rows["regen"].tolist()) == [900, 901]
    assert d.tiers.finish(move, set()) == 2
    d.check()
    after = look(d, keys)
    assert {k: (off & objformat.DISK_BIT == 0, gen) for k, (_, off, gen) in after.items() if k in keys[:2]} == {
        keys[0]: (True, after[keys[0]][2]), keys[1]: (True, after[keys[1]][2])}
    assert sorted(after[k][2] for k in keys[:2]) == [900, 901]
    assert all(after[k][1] & objformat.DISK_BIT for k in keys[2:])
    assert d.tiers.promotions == 2


def test_a_lost_node_parks_both_tiers_and_gets_both_back():
    d = make()
    keys = keys_of(0, 6)
    put(d, keys, 1)
    assert d.tiers.finish(d.tiers.plan_demote("n1", 3 * EXT, 64, now=2.0), set()) == 3
    before = look(d, keys)
    d.detach_space("n1", park=True)
    assert look(d, keys) == {}
    recs = None
    for _ in range(1000):  # slices of 2 pages (each visits at most 32 rows of the node's and its disk's blocks)
        _, recs = d.drop_slice("n1", 2)
        if recs is not None:
            break
    assert recs is not None and len(recs) == 6
    assert sum(1 for r in recs if r[2] & objformat.DISK_BIT) == 3
    d.drop_space("n1")
    d.add_space("n1", 8 * EXT)
    restored, _ = d.unpark("n1", recs)
    assert restored == 6
    d.check()
    assert look(d, keys) == before


def test_commit_records_name_the_twin_so_a_full_load_files_disk_pages_back_on_disk():
    store = EtcdStore("127.0.0.1:1", "/umbp")  # no connection is made: names and parsing only
    store.fence(3)
    d = make(namer=store.batch_name)
    keys = keys_of(0, 6)
    put(d, keys, 1)
    assert d.tiers.finish(d.tiers.plan_demote("n1", 2 * EXT, 64, now=2.0), set()) == 2
    fx = d.effects(Effects())
    recs = PageRecords(store._pages)
    kvs = [SimpleNamespace(key=r.name, value=r.value(), mod_revision=i + 1, create_revision=i + 1)
           for i, r in enumerate(dict.fromkeys(fx.recs + fx.batches))]
    recs.add([kv for kv in kvs if kv.value is not None])
    d2 = TableDirectory()
    stale, rejected = d2.load({"n1": ({"capacity": 8 * EXT, "disk_capacity": 16 * EXT}, 0)}, recs)
    assert not stale and not rejected
    d2.check()
    assert look(d2, keys) == look(d, keys)


@pytest.mark.parametrize("disk", [0, 4])
def test_the_watermark_pass_leaves_a_node_with_a_disk_to_its_mover(disk):
    d = make(dram=4, disk=disk) if disk else TableDirectory()
    if not disk:
        d.add_space("n1", 4 * EXT)
    put(d, keys_of(0, 4), 1)
    n, _ = d.watermark_pass(0.5, 0.25, 100, Effects())
    assert n == (0 if disk else 3)
    if disk:  # and its disk, full, is not thinned either: it makes room as demotions need it
        assert d.tiers.finish(d.tiers.plan_demote("n1", 4 * EXT, 64, now=2.0), set()) == 4
        assert d.watermark_pass(0.5, 0.25, 100, Effects())[0] == 0 and not d.needs_eviction(0.5)
        assert d.tiers.usage("n1")["disk_objects"] == 4


def test_a_demotion_asking_for_more_than_the_node_holds_moves_each_page_once():
    d = make(dram=8, disk=16)
    keys = keys_of(0, 6)
    put(d, keys, 1)
    move = d.tiers.plan_demote("n1", 100 * EXT, 64, now=2.0)  # the victim queue is refilled in the loop
    assert len(move) == 6 and len(set(move.rows.tolist())) == 6
    d.check()
    assert d.tiers.finish(move, set()) == 6
    d.check()
    assert d.objects == 6 and len(look(d, keys)) == 6
    assert d.tiers.usage("n1")["disk_objects"] == 6
