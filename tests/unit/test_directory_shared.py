"""Shared entries on the directory (``metaserver/table/shared.py`` of ``TableDirectory``): one row per TP-sharded
logical page, n sub-slots in one extent, one generation, one commit record, one eviction member; the invariant check
(``check()``) after every step; the ``shard`` field's validation."""

from __future__ import annotations

from types import SimpleNamespace

import msgpack
import pytest

from metaserver import validate as v
from metaserver.table.entry import EXISTS, IN_FLIGHT, NEW, NO_SPACE, Effects, extent_size, layout
from metaserver.store.persist import EtcdStore
from metaserver.table.records import pages_of, unpack_segment
from metaserver.table.snapshot import PageRecords
from metaserver.table.directory import TableDirectory
from metaserver.table.load import fingerprint
from transport.objformat import ALIGN, ARENA_DATA_START, object_size

PART = 3000  # one sub-slot: 3000 payload bytes + header = one 4 KiB unit
STRIDE = object_size(PART)


def make(units=64, nodes=("n1",), **kw) -> TableDirectory:
    d = TableDirectory(**kw)
    for n in nodes:
        d.add_space(n, units * ALIGN)
    return d


def put_all(d, keys, n, gen=100, now=0.0):
    """Every rank allocates and commits its part of ``keys``: (items per rank, the commit records made)."""
    out, recs = {}, []
    for rk in range(n):
        items, _ = d.alloc("kv", keys, [PART] * len(keys), None, gen, now, token=10 + rk, owner=f"c{rk}",
                           shard=(rk, n))
        out[rk] = items
        news = [(k, it[4]) for k, it in zip(keys, items) if it[0] == NEW]
        ok, fx = d.commit("kv", [k for k, _ in news], [g for _, g in news], now, shard=(rk, n))
        assert all(ok)
        recs += fx.recs
        d.check()
    return out, recs


def row(d, key):
    return int(d._find("kv", [key])[0])


def used_of(d, ns="kv") -> int:
    return d.namespace_usage().get(ns, {}).get("used_bytes", 0)


def test_ranks_fill_one_entry_and_read_their_sub_slots():
    d = make()
    keys = [b"p0", b"p1", b"p2"]
    n = 4
    items = {}
    for rk in range(n):
        its, fx = d.alloc("kv", keys, [PART] * 3, None, 100 + 10 * rk, 0.0, token=7 + rk, owner="c", shard=(rk, n))
        assert [it[0] for it in its] == [NEW] * 3 and not fx
        items[rk] = its
        d.check()
    # one extent per page, sub-slot r at off + r * stride, one generation (the first rank's)
    for i in range(3):
        base, gen = items[0][i][2], items[0][i][4]
        for rk in range(n):
            assert items[rk][i][1:] == ("n1", base + rk * STRIDE, PART, gen)
    assert d.pending == 3 and d.objects == 0 and used_of(d) == 3 * n * STRIDE
    assert d.spaces["n1"].alloc.used == 3 * n * STRIDE
    for rk in range(n - 1):
        ok, fx = d.commit("kv", keys, [it[4] for it in items[rk]], 1.0, shard=(rk, n))
        assert ok == [True] * 3 and not fx.recs  # a part is in; the page is not visible yet
        assert d.exists("kv", keys) == [False] * 3
        assert d.lookup("kv", keys, 1.0, shard=(rk, n))[1] == [None] * 3
        d.check()
    ok, fx = d.commit("kv", keys, [it[4] for it in items[n - 1]], 2.0, shard=(n - 1, n))
    (rec,) = fx.recs
    assert ok == [True] * 3 and [p[0] for p in pages_of(rec.value())] == keys  # ONE record entry per page
    assert d.exists("kv", keys) == [True] * 3 and d.objects == 3 and d.pending == 0 and not d.shared.states
    for rk in range(n):
        lease, locs = d.lookup("kv", keys, 3.0, shard=(rk, n))
        assert lease and locs == [("n1", items[0][i][2] + rk * STRIDE, PART, items[0][i][4]) for i in range(3)]
        d.release(lease)
    # another layout, or no shard at all, misses: never another layout's bytes
    assert d.lookup("kv", keys, 3.0, shard=(0, 2))[1] == [None] * 3
    assert d.lookup("kv", keys, 3.0)[1] == [None] * 3
    assert d.commit("kv", keys, [it[4] for it in items[0]], 3.0)[0] == [False] * 3  # plain commit: not its entry
    assert d.commit("kv", keys, [it[4] for it in items[0]], 3.0, shard=(1, n))[0] == [True] * 3  # idempotent
    d.check()


def test_retry_in_flight_exists_and_conflicts():
    d = make()
    a, _ = d.alloc("kv", [b"k"], [PART], None, 50, 0.0, token=1, owner="c0", shard=(0, 2))
    assert a[0][0] == NEW
    again, _ = d.alloc("kv", [b"k"], [PART], None, 60, 0.0, token=1, owner="c0b", shard=(0, 2))
    assert again == a  # a retry with the same token: the same place and generation
    other, _ = d.alloc("kv", [b"k"], [PART], None, 70, 0.0, token=2, owner="x", shard=(0, 2))
    assert other[0][0] == IN_FLIGHT  # rank 0's sub-slot is handed out under another token
    assert d.alloc("kv", [b"k"], [PART + 1], None, 70, 0.0, token=3, shard=(1, 2))[0][0][0] == IN_FLIGHT  # size
    assert d.alloc("kv", [b"k"], [PART], None, 70, 0.0, token=3, shard=(1, 4))[0][0][0] == IN_FLIGHT  # layout
    assert d.alloc("kv", [b"k"], [PART], None, 70, 0.0, token=3)[0][0][0] == IN_FLIGHT  # a plain writer
    assert d.commit("kv", [b"k"], [50], 0.0, shard=(1, 2))[0] == [False]  # rank 1 was never handed its sub-slot
    assert d.commit("kv", [b"k"], [50], 0.0)[0] == [False]  # a plain commit cannot complete a shared entry
    assert d.commit("kv", [b"k"], [50], 0.0, shard=(0, 2))[0] == [True]
    assert d.alloc("kv", [b"k"], [PART], None, 80, 0.0, token=9, shard=(0, 2))[0][0][0] == EXISTS  # part is in
    assert d.shared.owned_by_row(row(d, b"k"), "c0b") is False  # its part is written: closing aborts nothing
    b, _ = d.alloc("kv", [b"k"], [PART], None, 90, 0.0, token=5, owner="c1", shard=(1, 2))
    assert b[0][1:] == (a[0][1], a[0][2] + STRIDE, PART, 50) and d.shared.owned_by_row(row(d, b"k"), "c1")
    d.check()
    ok, fx = d.commit("kv", [b"k"], [50], 1.0, shard=(1, 2))
    assert ok == [True] and len(fx.recs) == 1
    assert d.alloc("kv", [b"k"], [PART], None, 99, 2.0, token=1, shard=(1, 2))[0][0][0] == EXISTS
    d.check()


def test_incomplete_page_dropped_whole_after_pending_ttl_and_abort():
    d = make(pending_ttl_s=5.0)
    d.alloc("kv", [b"a", b"b"], [PART] * 2, None, 10, 0.0, token=1, shard=(0, 3))
    d.commit("kv", [b"a", b"b"], [10, 11], 0.0, shard=(0, 3))
    d.alloc("kv", [b"a", b"b"], [PART] * 2, None, 20, 1.0, token=2, shard=(1, 3))
    d.commit("kv", [b"a", b"b"], [10, 11], 1.0, shard=(1, 3))
    used = d.spaces["n1"].alloc.used
    assert used == 2 * 3 * STRIDE and d.pending == 2
    assert d.expire_pending(4.9, 100) == 0  # a later rank's ALLOC does not extend the TTL
    assert d.expire_pending(5.1, 100) == 2
    assert d.pending == 0 and d.spaces["n1"].alloc.used == 0 and not d.shared.states and d.namespace_usage() == {}
    assert d.commit("kv", [b"a"], [10], 6.0, shard=(2, 3))[0] == [False]  # too late: the page is gone
    d.check()
    # an ABORT of any rank drops the whole page
    d.alloc("kv", [b"c"], [PART], None, 30, 7.0, token=3, shard=(2, 3))
    assert d.abort("kv", [b"c"], [30]) == 1 and d.spaces["n1"].alloc.used == 0 and not d.shared.states
    d.check()


def test_eviction_and_remove_take_the_whole_extent():
    d = make(units=16)
    keys = [b"e%d" % i for i in range(3)]
    _, (rec,) = put_all(d, keys, 4)
    assert d.spaces["n1"].alloc.used == 12 * STRIDE == used_of(d)
    n, freed = d.evict_node(d.spaces["n1"], 1, 1)
    assert (n, freed) == (1, 4 * STRIDE)  # one victim (the oldest), its whole extent
    assert d.exists("kv", keys) == [False, True, True] and d.spaces["n1"].alloc.used == 8 * STRIDE
    assert d.effects().batches == [rec] and [p[0] for p in pages_of(rec.value())] == keys[1:]
    d.check()
    removed, _ = d.remove("kv", [b"e1"])
    assert removed == [True] and d.spaces["n1"].alloc.used == 4 * STRIDE
    d.check()
    # a full node: a new page evicts the LRU page whole
    put_all(d, [b"q0", b"q1", b"q2"], 4, gen=500, now=5.0)
    assert d.spaces["n1"].alloc.used == 16 * STRIDE
    items, _ = d.alloc("kv", [b"q3"], [PART], None, 600, 6.0, token=1, shard=(0, 4))
    assert items[0][0] == NEW and d.exists("kv", [b"e2", b"q0", b"q1", b"q2"]) == [False, True, True, True]
    d.check()


def test_no_space_for_the_whole_extent():
    d = make(units=3)
    items, _ = d.alloc("kv", [b"x"], [PART], None, 1, 0.0, shard=(0, 4))
    assert items[0][0] == NO_SPACE and d.pending == 0
    d.check()


def test_persisted_record_round_trip_and_full_load_fingerprint():
    store = EtcdStore("127.0.0.1:1", "/umbp")  # no connection is made: names and parsing only
    store.fence(3)
    d = make(units=64, nodes=("n1", "n2"), namer=store.batch_name)
    keys = [b"r%d" % i for i in range(6)]
    _, (rec,) = put_all(d, keys, 4)  # one record, one entry a logical page
    value = rec.value()
    pages = pages_of(value)
    lease, locs = d.lookup("kv", keys[:1], 0.0, shard=(0, 4))
    d.release(lease)
    assert len(pages) == 6 and pages[0] == [keys[0], *locs[0][:2], PART, locs[0][3], None, 4]  # part length, n
    kv = SimpleNamespace(key=rec.name, value=value, mod_revision=1, create_revision=1)
    parsed = store.records_of(kv)
    assert parsed[0][5] == layout(PART, 4) and extent_size(parsed[0][5]) == 4 * STRIDE
    recs = PageRecords(store._pages)
    recs.add([kv])
    d2 = TableDirectory()
    descs = {nid: ({"capacity": sp.alloc.capacity}, 0) for nid, sp in d.spaces.items()}
    stale, rejected = d2.load(descs, recs)
    assert not stale and not rejected
    d2.check()
    f1, f2 = fingerprint(d), fingerprint(d2)
    assert f1["entries"] == f2["entries"] and f1["nodes"] == f2["nodes"]
    for rk in range(4):
        (l1, locs1), (l2, locs2) = d.lookup("kv", keys, 1.0, shard=(rk, 4)), d2.lookup("kv", keys, 1.0, shard=(rk, 4))
        assert locs1 == locs2 and d.release(l1) and d2.release(l2)
    # evicting a loaded page: a dead list names it under the record it came from; etcd then loads as the table
    d2.commits.namer = store.batch_name  # (as the leader names its records)
    fx = Effects()
    assert d2.evict_all(1, fx)[0] == 1
    (dl,) = fx.batches
    dead = dl.value()
    assert dl.name != rec.name and unpack_segment(dead).dead_recs == [rec.name]
    recs = PageRecords(store._pages)
    recs.add([kv, SimpleNamespace(key=dl.name, value=dead, mod_revision=2, create_revision=2)])
    d3 = TableDirectory()
    assert d3.load(descs, recs) == ([], []) and recs.dropped == 1
    d3.check()
    assert fingerprint(d3)["entries"] == fingerprint(d2)["entries"] and len(fingerprint(d3)["entries"]) == 5
    # an unreadable shared record (n out of range) is junk, never a page
    bad = msgpack.packb([[keys[0], "n1", ARENA_DATA_START, PART, 1, None, 999]])
    assert store.records_of(SimpleNamespace(key=rec.name, value=bad, mod_revision=1, create_revision=1))[0][1] is None


@pytest.mark.parametrize("value", [[0, 0], [2, 2], [-1, 4], [0, 257], [0], "0,2", [0.0, 2], [True, 2]])
def test_shard_field_validated(value):
    with pytest.raises(v.Reject) as ei:
        v.shard({"shard": value})
    assert "shard must be [rank, n]" in ei.value.message


def test_shard_field_accepted():
    assert v.shard({"shard": [3, 8]}) == (3, 8) and v.shard({}) is None and v.shard({"shard": [255, 256]})
