"""Dead lists (version-3 segments, metaserver/table/records.py): a segment may carry the generations of pages of
earlier records that left, naming each one's record; a load applies them after the whole scan, in either order of
the records, to segments and msgpack records alike, and the table it files equals a full load of the records
rewritten without those pages. Version-2 segments (no dead list) and the msgpack layouts stay readable."""

from __future__ import annotations

from types import SimpleNamespace

import msgpack
import pytest

from metaserver.table.directory import TableDirectory
from metaserver.table.load import fingerprint
from metaserver.table.records import SEG_DEAD_VERSION, SEG_VERSION, pack_segment, unpack_segment
from metaserver.table.snapshot import PageRecords

PREFIX = b"/umbp/pages/"
PLEN = 5000


def kv(key: bytes, value: bytes, rev: int):
    return SimpleNamespace(key=key, value=value, mod_revision=rev, create_revision=rev)


def seg(keys: list[bytes], node: str, off0: int, gen0: int, dead=None, dead_recs=None, dead_ix=None) -> bytes:
    n = len(keys)
    return pack_segment(["a"], None, [node], None, [(off0 >> 12) + 2 * i for i in range(n)], [PLEN], None,
                        [gen0 + i for i in range(n)], b"".join(keys), 32, dead=dead, dead_recs=dead_recs,
                        dead_ix=dead_ix)


def load(kvs) -> TableDirectory:
    recs = PageRecords(PREFIX)
    recs.add(kvs)
    d = TableDirectory()
    stale, rejected = d.load({"n0": ({"capacity": 1 << 24}, 0), "n1": ({"capacity": 1 << 24}, 0)}, recs)
    assert not stale and not rejected
    return d


@pytest.mark.parametrize("order", ["named first", "carrier first"])
def test_a_dead_list_drops_the_pages_it_names_whatever_the_order(order):
    keys = [bytes([i]) * 32 for i in range(40)]
    r1, r2, r3 = PREFIX + b"a/+1.1", PREFIX + b"a/+1.2", PREFIX + b"a/+1.3"
    v1 = seg(keys[:16], "n0", 1 << 16, 100)  # pages of gens 100..115
    v2 = msgpack.packb([[k, "n1", (1 << 16) + 8192 * i, PLEN, 200 + i, None] for i, k in enumerate(keys[16:24])])
    # a later segment: its own pages, and the deaths of gens 101, 104 (r1) and 203 (r2); 999 names no page
    v3 = seg(keys[24:30], "n0", 1 << 20, 300, dead=[101, 203, 104, 999], dead_recs=[r1, r2], dead_ix=[0, 1, 0, 0])
    assert v3[1] == SEG_DEAD_VERSION and v1[1] == SEG_VERSION
    s3 = unpack_segment(v3)
    assert s3.dead.tolist() == [101, 203, 104, 999] and s3.dead_recs == [r1, r2] and s3.dead_ix.tolist() == [0, 1, 0, 0]
    kvs = [kv(r1, v1, 7), kv(r2, v2, 8), kv(r3, v3, 9)]
    d = load(kvs if order == "named first" else kvs[::-1])
    # the oracle: the same records without the dead pages
    keep1 = [i for i in range(16) if i not in (1, 4)]
    o1 = pack_segment(["a"], None, ["n0"], None, [(1 << 4) + 2 * i for i in keep1], [PLEN], None,
                      [100 + i for i in keep1], b"".join(keys[i] for i in keep1), 32)
    o2 = msgpack.packb([[k, "n1", (1 << 16) + 8192 * i, PLEN, 200 + i, None] for i, k in enumerate(keys[16:24])
                        if i != 3])
    o3 = seg(keys[24:30], "n0", 1 << 20, 300)
    want = load([kv(r1, o1, 7), kv(r2, o2, 8), kv(r3, o3, 9)])
    assert fingerprint(d) == fingerprint(want)
    assert d.objects == 16 - 2 + 8 - 1 + 6


def test_a_dead_list_alone_and_a_node_all_dead():
    keys = [bytes([i]) * 32 for i in range(8)]
    r1, r2 = PREFIX + b"a/+1.1", PREFIX + b"a/+1.2"
    v1 = seg(keys, "n1", 1 << 16, 10)
    v2 = pack_segment([], None, [], None, [], [], None, [], b"", 0, dead=list(range(10, 18)), dead_recs=[r1])
    assert unpack_segment(v2).n == 0
    recs = PageRecords(PREFIX)
    recs.add([kv(r2, v2, 9), kv(r1, v1, 7)])
    assert recs.carriers == [r2] and len(recs.columns()) == 0 and recs.dropped == 8


def test_version_rules_of_dead_lists():
    keys = [bytes([i]) * 32 for i in range(2)]
    good = seg(keys, "n0", 1 << 16, 5, dead=[1], dead_recs=[PREFIX + b"a/+1.1"])
    unpack_segment(good)
    for bad in (good[:1] + bytes([SEG_VERSION]) + good[2:],  # a dead list in a version-2 segment
                seg(keys, "n0", 1 << 16, 5)[:1] + bytes([SEG_DEAD_VERSION]) + seg(keys, "n0", 1 << 16, 5)[2:],
                pack_segment([], None, [], None, [], [], None, [], b"", 0)):  # no page and no dead list
        with pytest.raises(ValueError):
            unpack_segment(bad)


# ----------------------------------------------------------------------------------------------------------------
# a warm copy follows dead lists as it follows the rewrites they stand for


@pytest.mark.parametrize("seed", range(6))
def test_a_warm_copy_applies_a_dead_list_as_the_rewrite_it_stands_for(seed):
    from test_standby_batch import NODES, RecordStream, comparable, warm

    from metaserver.store.persist import EtcdStore

    store = EtcdStore("127.0.0.1:1", "/umbp")
    stream = RecordStream(store, seed)
    a, b = warm(store), warm(store)  # a: sees dead lists; b: the rewrites they stand for
    first = [stream.node(n) for n in NODES]
    a.apply(first)
    b.apply(first)
    carriers = 0
    now: dict = {}  # record name -> its pages' (key, gen) as etcd holds them before the event
    for i in range(40):
        for ev in stream.batch():
            name = ev.kv.key
            try:
                new = {(p[0], p[4]) for p in msgpack.unpackb(ev.kv.value)} if ev.type == 0 else None
            except Exception:  # noqa: BLE001 - not a commit record, or an unreadable one: as it is
                new = None
            old = now.pop(name, None)
            if new is not None and b"/+" in name:
                now[name] = new
            if new is not None and old is not None and name in a.batches:
                # a rewrite of a record without some pages: for ``a`` a dead-list segment naming them instead
                gone = sorted(g for _, g in old - new)
                if gone and rng_ok(stream, 0.7):
                    carriers += 1
                    cname = b"%sdefault/+2.%x" % (store._pages, carriers)
                    dv = pack_segment([], None, [], None, [], [], None, [], b"", 0, dead=gone, dead_recs=[name])
                    a.apply([stream.event(0, cname, dv)])
                    now[name] = old  # (etcd still holds the record as it was, for ``a``)
                    b.apply([ev])
                    continue
            a.apply([ev])
            b.apply([ev])
        assert comparable(a.dir) == comparable(b.dir), i
        a.dir.check()
    assert carriers > 5


def rng_ok(stream, p: float) -> bool:
    return stream.rng.random() < p

