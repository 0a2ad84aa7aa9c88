"""The full load (``PageRecords`` -> ``TableDirectory.load`` -> ``tableload.load_pages``) against the load rules
applied one record at a time.

``model_fill`` below is the load written out per record (grouped per node in scan order, sorted by revision, then
``test_tableload.model_load``'s three rules: a key filed already, extents in offset order within the arena, a key
given twice). A randomized record set with overlaps, out-of-range extents, keys given twice, keys on two nodes,
parents on other nodes and missing parents must give the table the model says (``fingerprint``: rows, places, use,
eviction order; each node's free extents; under prefix-lru the parents linked and the orphans waiting) and the same
stale and rejected records.
"""

from __future__ import annotations

import gc
import random
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest

from metaserver.table.allocator import Allocator
from metaserver.table.entry import READY, extent_size
from metaserver.store.fullload import gc_paused
from metaserver.store.persist import EtcdStore
from metaserver.table.records import unpack_segment
from metaserver.table.snapshot import PageRecords
from metaserver.table.directory import TableDirectory
from metaserver.table.load import fingerprint
from test_tableload import model_load
from transport.objformat import ALIGN, ARENA_DATA_START

PREFIX = b"/umbp/pages/"
UNITS = 64


def model_fill(descs: dict, pages: list[tuple]) -> tuple[list, list, dict]:
    """(stale, rejected, node -> the pages filed in commit order) of a full load of ``page_record`` tuples: a page of
    a node without a description is stale; each described node's pages, in the order the scan first met the node,
    sorted by revision (stable), go through the load rules."""
    stale, by_node = [], {}
    for p in pages:
        if p[1] is None or type(p[1]) is not str or p[1] not in descs:
            stale.append(p)
        else:
            by_node.setdefault(p[1], []).append(p)
    for recs in by_node.values():
        recs.sort(key=lambda p: p[0])
    flat = [(p[1], p[2], p[3], p[4], p[5], p[6], p) for recs in by_node.values() for p in recs]
    bad, kept = model_load(flat, {n: d["capacity"] for n, (d, _) in descs.items()}, list(by_node))
    rejected = [by_node[n][i] for n, ix in bad.items() for i in ix]
    return stale, rejected, {n: [x[6] for x in ps] for n, ps in kept.items()}


def links_of(t: TableDirectory) -> tuple[list, set]:
    """(every READY page with the parent key it names, the (namespace, parent key) its orphans wait for)."""
    named = sorted((ns, k, p) for ns, ks, ps in t.links.snapshot() for k, p in zip(ks, ps))
    return named, {(t.ns_names[nsix], v[0]) for (nsix, _), v in t.links.orphans.items()}


def assert_as_modelled(t: TableDirectory, descs: dict, kept: dict, policy: str) -> None:
    fp = fingerprint(t)
    assert fp["entries"] == sorted((p[2], p[3], p[1], p[4], p[5], p[6], READY) for ps in kept.values() for p in ps)
    for node_id, (desc, _) in descs.items():
        ps = kept.get(node_id, [])
        extents = sorted((p[4], extent_size(p[5])) for p in ps)
        assert fp["nodes"][node_id] == (desc["capacity"], sum(x for _, x in extents), len(ps))
        assert fp["order"][node_id] == [(p[2], p[3]) for p in sorted(ps, key=lambda p: (p[0], p[2], p[3]))]
        ref = Allocator(ARENA_DATA_START, desc["capacity"], track=False)
        assert ref.rebuild_columns([o for o, _ in extents], [x for _, x in extents]) == []
        alloc = t.node_by_id[node_id].alloc
        assert sorted(alloc._free.items()) == sorted(ref._free.items()) and alloc.used_units == ref.used_units
    filed = {(p[2], p[3]) for ps in kept.values() for p in ps}
    named, orphans = links_of(t)
    linking = policy == "prefix-lru"
    assert named == sorted((p[2], p[3], p[7] if linking else None) for ps in kept.values() for p in ps)
    assert orphans == ({(p[2], p[7]) for ps in kept.values() for p in ps if p[7] is not None
                        and (p[2], p[7]) not in filed} if linking else set())
    assert fp["pending"] == fp["pinned"] == 0 and fp["objects"] == len(filed)


def records(rng: random.Random, n: int, unique_parents: bool, dense: bool = False) -> list[tuple]:
    """``page_record`` tuples: 3 nodes (one without a description), 2 namespaces, offsets mostly dense, some
    overlapping or out of range (none with ``dense``: each node's extents one after the other, the load's fast
    path), some keys twice, revisions shared by a few (one transaction)."""
    out = []
    cursor = {"n1": 0, "n2": 0, "n3": 0}
    named: set = set()
    keys = [b"k%03d" % i for i in range(n)]
    for i in range(n):
        node = rng.choice(["n1", "n2", "n2", "n3"])
        ns = rng.choice(["a", "b"])
        key = keys[i] if rng.random() > 0.05 else rng.choice(keys[:i + 1])  # some keys twice
        slot = i % UNITS if rng.random() > 0.1 else rng.randrange(UNITS + 4)  # some overlap, some out of range
        units = 1 if rng.random() > 0.1 else 2
        if dense:
            slot = cursor[node]
            cursor[node] += units
        parent = None
        if i and rng.random() > 0.2:
            parent = rng.choice(keys[:i]) if rng.random() > 0.1 else b"missing%d" % i
            if unique_parents and parent in named:
                parent = None
            named.add(parent)
        rev = 100 + (i if rng.random() > 0.1 else max(0, i - 1))
        out.append((rev, node, ns, key, ARENA_DATA_START + slot * ALIGN, units * ALIGN - 64, i + 1, parent,
                    PREFIX + ns.encode() + b"/" + key.hex().encode()))
    rng.shuffle(out)  # the scan's order is not the commit order
    return out


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("policy", ["lru", "prefix-lru"])
@pytest.mark.parametrize("seed", range(12))
def test_load_equals_the_per_record_rules(policy, seed, dense):
    rng = random.Random(seed)
    pages = records(rng, 150, unique_parents=policy == "prefix-lru", dense=dense)
    descs = {nid: ({"capacity": (4 if dense else 1) * UNITS * ALIGN}, 0) for nid in ("n1", "n2")}
    t = TableDirectory(policy=policy)
    stale, rejected = t.load(descs, PageRecords.of(list(pages)))
    t.check()
    stale_ref, rej_ref, kept = model_fill(descs, list(pages))
    assert sorted(stale) == sorted(stale_ref) and len(stale) == sum(p[1] == "n3" for p in pages) > 0
    assert sorted(map(repr, rejected)) == sorted(map(repr, rej_ref)) and (dense or rejected)
    assert_as_modelled(t, descs, kept, policy)
    assert t.commits.take() == ([], [])  # pages of records of their own: nothing to rewrite


def kv(key: bytes, value, rev: int = 1):
    return SimpleNamespace(key=key, value=value if type(value) is bytes else msgpack.packb(value, use_bin_type=True),
                           mod_revision=rev)


def test_page_records_parse_and_skip_the_unreadable():
    store = EtcdStore.__new__(EtcdStore)
    store._pages = PREFIX
    good_key = b"\x01" * 32
    name = PREFIX + b"m/" + good_key.hex().encode()
    off = ARENA_DATA_START
    kvs = [
        kv(name, ["n1", off, 100, 7, None], 5),
        kv(PREFIX + b"m/" + b"ab" * 4, ["n1", off + ALIGN, 100, 8, good_key, 4], 6),  # shared: n = 4
        kv(PREFIX + b"m/" + b"AB" * 4, ["n1", off, 100, 7, None]),  # upper-case hex: the leader never writes it
        kv(PREFIX + b"m/" + b"ab cd", ["n1", off, 100, 7, None]),  # not hex
        kv(PREFIX + b"m/" + (b"cd" * 32).hex().encode(), ["n1", off, 100, 7, None]),  # a digest key's hex text
        kv(PREFIX + b"m/abcd", b"\xc1"),  # not msgpack
        kv(PREFIX + b"m/abce", ["n1", off, 100, 7]),  # four fields
        kv(PREFIX + b"m/abcf", [5, off, 100, 7, None]),  # node id not a string
        kv(PREFIX + b"m/abd0", ["n1", off, 100, 7, 12]),  # parent neither bytes nor nil
        kv(PREFIX + b"m/abd1", ["n1", off, 100, 7, None, 999]),  # part count out of range
        kv(PREFIX + b"m/abd2", ["n1", "x", 100, 7, None]),  # offset int() refuses
        kv(PREFIX + b"m/abd3", ["n1", off, 1 << 45, 7, None]),  # payload length out of range
    ]
    recs = PageRecords(PREFIX)
    recs.add(kvs)
    assert len(recs) == len(kvs) and recs.junk == [x.key for x in kvs[2:]]
    ents, revs = recs.groups["n1"]
    assert revs == [5, 6]
    assert [(e.ns, e.key, e.offset, e.payload_len, e.gen, e.parent, e.batch) for e in ents] == [
        ("m", good_key, off, 100, 7, None, None), ("m", b"\xab" * 4, off + ALIGN, 100 | 4 << 41, 8, good_key, None)]
    assert recs.etcd_key("m", good_key) == name == store.page_key("m", good_key)
    # page_record (a watch event) applies the same rules
    assert store.page_record(kvs[0]) == (5, "n1", "m", good_key, off, 100, 7, None, name)
    for bad in kvs[2:]:
        assert store.page_record(bad) == (0, None, "", b"", 0, 0, 0, None, bad.key)
    assert store.page_name(name) == ("m", good_key) and store.page_name(kvs[2].key) is None


def test_load_of_page_records_and_of_tuples_agree():
    rng = random.Random(7)
    pages = [p for p in records(rng, 120, unique_parents=False)]
    seen, uniq = set(), []
    for p in pages:  # one record per name, as one etcd scan has them
        if (p[2], p[3]) not in seen:
            seen.add((p[2], p[3]))
            uniq.append(p)
    recs = PageRecords(PREFIX)
    recs.add([kv(p[8], [p[1], p[4], p[5], p[6], p[7]], p[0]) for p in uniq])
    descs = {nid: ({"capacity": UNITS * ALIGN}, 0) for nid in ("n1", "n2")}
    d1, d2 = TableDirectory(), TableDirectory()
    s1, r1 = d1.load(descs, recs)
    s2, r2 = d2.load(descs, PageRecords.of(uniq))
    assert fingerprint(d1) == fingerprint(d2) and sorted(s1) == sorted(s2) and sorted(map(repr, r1)) == sorted(
        map(repr, r2))
    assert s1 and r1 and d1.objects > 0
    assert recs.groups == {} and len(recs) == len(uniq)  # each node's records released once loaded


def test_gc_paused_nests_and_restores():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # it was off before: it stays off
    finally:
        gc.enable()


def test_rebuild_columns_is_rebuild():
    from metaserver.table.allocator import Allocator
    rng = random.Random(3)
    for _ in range(50):
        ext = [(ARENA_DATA_START + rng.randrange(40) * ALIGN + (1 if rng.random() < 0.05 else 0),
                rng.choice([ALIGN, 2 * ALIGN, 3 * ALIGN - 7, 0])) for _ in range(rng.randrange(30))]
        a, b = Allocator(ARENA_DATA_START, 32 * ALIGN), Allocator(ARENA_DATA_START, 32 * ALIGN)
        ra = a.rebuild(ext)
        rb = b.rebuild_columns([x[0] for x in ext], [x[1] for x in ext])
        assert ra == rb and a._free == b._free and a._bins == b._bins and a.used_units == b.used_units
        a.check()
        # untracked, as a directory's: the C-level fast path when nothing is rejected, the same free lists in the
        # same order
        c = Allocator(ARENA_DATA_START, 32 * ALIGN, track=False)
        assert c.rebuild_columns([x[0] for x in ext], [x[1] for x in ext]) == ra
        assert c._free == a._free and c._ends == a._ends and c._mask == a._mask and c.used_units == a.used_units
        assert {k: list(m) for k, m in c._bins.items()} == {k: list(m) for k, m in a._bins.items()}


def test_rebuild_columns_fast_path_on_dense_extents():
    from metaserver.table.allocator import Allocator
    rng = random.Random(5)
    for _ in range(50):
        ext, at = [], ARENA_DATA_START
        for _ in range(rng.randrange(1, 30)):
            at += rng.choice([0, 0, ALIGN, 3 * ALIGN])  # gaps, or none
            size = rng.choice([ALIGN, 2 * ALIGN])
            ext.append((at, size))
            at += size
        if at > ARENA_DATA_START + 100 * ALIGN:
            continue
        if rng.random() < 0.5:  # given in offset order, or not
            rng.shuffle(ext)
        a = Allocator(ARENA_DATA_START, 100 * ALIGN)
        c = Allocator(ARENA_DATA_START, 100 * ALIGN, track=False)
        assert a.rebuild(ext) == [] == c.rebuild_columns([x[0] for x in ext], [x[1] for x in ext])
        assert c._free == a._free and c._ends == a._ends and c._mask == a._mask and c.used_units == a.used_units
        assert {k: list(m) for k, m in c._bins.items()} == {k: list(m) for k, m in a._bins.items()}
        c.check(ext)


def bkv(name: bytes, value, create: int, mod: int | None = None):
    """A commit record's kv: its pages' place in commit order is its create revision (a rewrite keeps it)."""
    x = kv(name, value, mod or create)
    x.create_revision = create
    return x


def test_commit_records_round_trip_and_a_rejected_page_leaves_its_record():
    """A leader's commits as commit records (``TableRecord.value``) load back as the same pages, under the same
    record; a page of a record that another record's page overlaps is rejected alone: the record is rewritten without
    it, never deleted with its other pages."""
    store = EtcdStore.__new__(EtcdStore)
    store._pages, store.fence_rev, store._batch_seq = PREFIX, 7, 0
    leader = TableDirectory(namer=store.batch_name)
    leader.add_space("n1", UNITS * ALIGN)
    keys = [b"k%03d" % i for i in range(20)]
    items, _ = leader.alloc("ns", keys, [1000] * 20, [None] + keys[:-1], 1, 1.0)
    ok, fx = leader.commit("ns", keys, [it[4] for it in items], 1.0)
    assert all(ok)
    assert len(fx.recs) == 1
    b = fx.recs[0]
    assert b.name == PREFIX + b"ns/+7.1" and store.is_batch(b.name) and not store.is_batch(PREFIX + b"ns/abcd")
    # another record (written later) claims the extent of k005: that page alone is rejected
    row5 = int(leader._find("ns", [b"k005"])[0])
    other = msgpack.packb([[b"x", "n1", leader.offsets_of(np.array([row5]))[0], 1000, 99, None]], use_bin_type=True)
    recs = PageRecords(PREFIX)
    value = b.value()
    recs.add([bkv(b.name, value, 10, 12), bkv(PREFIX + b"ns/+8.1", other, 11)])
    assert len(recs) == 21 and not recs.junk and set(recs.batches) == {b.name, PREFIX + b"ns/+8.1"}
    d = TableDirectory()
    stale, rejected = d.load({"n1": ({"capacity": UNITS * ALIGN}, 0)}, recs)
    assert stale == [] and rejected == []  # a commit record's page is not a key to delete: its record is rewritten
    fp, lead = fingerprint(d), fingerprint(leader)
    assert sorted(k for _, k, *_ in fp["entries"]) == keys
    assert fp["entries"] == lead["entries"] and fp["order"] == lead["order"] and fp["nodes"] == lead["nodes"]
    _, rewrites = d.commits.take()
    assert [r.name for r in rewrites] == [PREFIX + b"ns/+8.1"] and rewrites[0].value() is None  # its one page: gone
    loaded = d.commits.by_name[b.name]
    assert len(loaded.live()) == 20 and d.commits.take() == ([], [])
    # evicting two pages of the loaded record: a dead list names them, the record stays in etcd as it was
    d.commits.namer = store.batch_name  # (as the leader names its records)
    _, fx = d.remove("ns", [b"k003", b"k017"])
    (dl,) = fx.batches
    assert dl is not loaded and dl.id == 0 and not fx.deletes
    dead = dl.value()
    seg = unpack_segment(dead)
    assert seg.n == 0 and seg.dead_recs == [b.name] and len(seg.dead) == 2
    again = PageRecords(PREFIX)
    again.add([bkv(b.name, value, 10, 12), bkv(dl.name, dead, 13)])  # what etcd holds now
    d2 = TableDirectory()
    assert d2.load({"n1": ({"capacity": UNITS * ALIGN}, 0)}, again) == ([], [])
    left = sorted(k for _, k, *_ in fingerprint(d2)["entries"])
    assert left == [k for k in keys if k not in (b"k003", b"k017")]


def test_unreadable_commit_records_are_junk_whole():
    off = ARENA_DATA_START
    good = [b"k1", "n1", off, 100, 3, None]
    kvs = [
        bkv(PREFIX + b"m/+1.1", [good, [b"k2", "n1", off + ALIGN, 100, 4, None, 2]], 5),  # readable: 2 pages
        bkv(PREFIX + b"m/+zz", [good], 6),  # a name that is not {term}.{count}
        bkv(PREFIX + b"m/+1.", [good], 6),
        bkv(PREFIX + b"m/+1.2", b"\xc1", 6),  # not msgpack
        bkv(PREFIX + b"m/+1.3", [], 6),  # no page
        bkv(PREFIX + b"m/+1.4", {"a": 1}, 6),  # not a list
        bkv(PREFIX + b"m/+1.5", [good, [b"k2", 5, off, 100, 4, None]], 6),  # one page's node id not a string
        bkv(PREFIX + b"m/+1.6", [good, ["k2", "n1", off, 100, 4, None]], 6),  # a key that is not bytes
        bkv(PREFIX + b"m/+1.7", [good, [b"k2", "n1", -1, 100, 4, None]], 6),  # negative offset
        bkv(PREFIX + b"m/+1.8", [good, [b"k2", "n1", off, 100, 4, 12]], 6),  # parent neither bytes nor nil
        bkv(PREFIX + b"m/+1.9", [good, [b"k2", "n1", off, 100, 4, None, 999]], 6),  # part count out of range
        bkv(PREFIX + b"m/+1.a", [good, [b"cd" * 32, "n1", off, 100, 4, None]], 6),  # a digest key as hex text
    ]
    recs = PageRecords(PREFIX)
    recs.add(kvs)
    assert recs.junk == [x.key for x in kvs[1:]]
    ents, revs = recs.groups["n1"]
    assert [(e.key, e.payload_len, e.batch) for e in ents] == [(b"k1", 100, PREFIX + b"m/+1.1"),
                                                              (b"k2", 100 | 2 << 41, PREFIX + b"m/+1.1")]
    assert revs == [5, 5] and recs.batches == [PREFIX + b"m/+1.1"]
