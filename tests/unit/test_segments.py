"""metaserver/table/records.py's segments (the commit record layout written now) against the msgpack commit records
(written before, read forever): a segment lists exactly what the msgpack layout lists for the same rows (digest,
long and rank keys, several nodes and layout codes, shared entries, parents under prefix-lru); a pool written in
either layout, or in both, loads into the same table; an unreadable segment is junk, never a partial load."""

from __future__ import annotations

import random
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest

from metaserver.table.entry import NEW, PART_MASK, SHARD_SHIFT, layout
from metaserver.table.records import SEG_VERSION, listed_pairs, pack_segment, pages_of, unpack_segment
from metaserver.table.snapshot import PageRecords
from metaserver.table.directory import TableDirectory
from metaserver.table.load import fingerprint
from transport.objformat import object_size

from tablekit import record_entries

PREFIX = b"/umbp/pages/"
PLEN = 60_000


def source(policy: str, seed: int) -> TableDirectory:
    """A table of three nodes after COMMITs of digest keys, long keys and rank keys in two namespaces, some with
    parents, of two payload lengths."""
    rng = random.Random(seed)
    d = TableDirectory(policy=policy, namer=lambda ns, c=iter(range(1, 1 << 20)): b"%s%s/+1.%x" % (
        PREFIX, ns.encode(), next(c)))
    for i in range(3):
        d.add_space(f"n{i}", 400 * object_size(PLEN))
    gen = 1
    d.test_recs = []
    for r in range(12):
        ns = "a" if r % 3 else "b"
        kind = r % 4
        keys = [rng.randbytes(32) if kind < 2 else rng.randbytes(33) if kind == 2 else b"k-%d-%d" % (r, i)
                for i in range(rng.randrange(1, 90))]
        parents = [keys[i - 1] if i else None for i in range(len(keys))] if r % 2 else None
        sizes = [PLEN if i % 3 else 1000 for i in range(len(keys))]
        items, _ = d.alloc(ns, keys, sizes, parents, gen, 1.0)
        gen += len(keys) + 1
        new = [(k, it[4]) for k, it in zip(keys, items) if it[0] == NEW]
        _, fx = d.commit(ns, [k for k, _ in new], [g for _, g in new], 2.0)
        d.test_recs.extend(fx.recs)
        if r % 5 == 4:
            for rec in fx.recs:
                rec.value()  # the writer took them: later COMMITs start new records
    d.test_recs = list(dict.fromkeys(d.test_recs))
    return d


def kv(key: bytes, value: bytes, rev: int):
    return SimpleNamespace(key=key, value=value, mod_revision=rev, create_revision=rev)


def msgpack_pages(d: TableDirectory, rows: np.ndarray) -> list:
    """``[key, node_id, offset, payload_len, gen, parent]`` of each row: the msgpack layout of a commit record's
    pages, no longer written but read forever (``metaserver/table/records.py``); parent its parent's key (None when
    it names none or links are not kept); a shared entry's ``[key, node_id, offset, part_len, gen, parent, n]``."""
    c = d.cols
    keys = [d.ix.key_of(r) for r in rows.tolist()]
    pages = [list(p) for p in zip(keys, d.node_names.take(c["node"].take(rows)).tolist(), d.offsets_of(rows),
                                  d.code_arr.take(c["size"].take(rows)).tolist(), c["gen"].take(rows).tolist(),
                                  d.links.parent_keys(rows))]
    if d.any_shared:
        for p in pages:
            if p[3] > PART_MASK:
                p[3], n = p[3] & PART_MASK, p[3] >> SHARD_SHIFT
                p.append(n)
    return pages


def records(d: TableDirectory, old: bool, every: int = 1) -> list:
    """The table's commit records as etcd would hold them: msgpack (``old``), segments, or every ``every``-th one
    old (a pool written before and after the upgrade)."""
    puts = d.test_recs
    out = []
    for i, r in enumerate(puts):
        rows = r.live()
        value = (msgpack.packb(msgpack_pages(d, rows), use_bin_type=True) if old or i % every == 0 and every > 1
                 else r.value())
        out.append(kv(r.name, value, 100 + i))
    return out


def load(kvs: list, policy: str) -> TableDirectory:
    t = TableDirectory(policy=policy)
    recs = PageRecords(PREFIX)
    recs.add(kvs)
    assert not recs.junk
    stale, rejected = t.load({f"n{i}": ({"capacity": 400 * object_size(PLEN)}, 0) for i in range(3)}, recs)
    assert not stale and not rejected
    t.check()
    return t


@pytest.mark.parametrize("policy", ["lru", "prefix-lru"])
def test_a_segment_lists_what_the_msgpack_layout_lists(policy):
    d = source(policy, 1)
    puts = d.test_recs
    assert len(puts) > 2
    for r in puts:
        rows = r.live()
        value = r.value()
        assert unpack_segment(value).n == len(rows) and value[1] == SEG_VERSION
        assert pages_of(value) == msgpack_pages(d, rows)
        nodes, ents = record_entries(r.name, value)
        assert [[e.key, n, e.offset, e.payload_len, e.gen, e.parent] for n, e in zip(nodes, ents)] == [
            p[:6] for p in msgpack_pages(d, rows)]
        assert listed_pairs(value) == {(p[0], p[4]) for p in msgpack_pages(d, rows)}


def test_shared_entries_codes_round_trip():
    codes = [layout(4000, 4), 70000, layout(100, 256)]
    value = pack_segment(["s"], None, ["x", "y"], [0, 1, 0], [1, 2, 3], codes, [0, 1, 2], [5, 6, 7],
                         b"a" * 32 + b"b" * 32 + b"c" * 32, 32)
    assert [p[2:] for p in pages_of(value)] == [[4096, 4000, 5, None, 4], [8192, 70000, 6, None],
                                                [12288, 100, 7, None, 256]]


@pytest.mark.parametrize("policy", ["lru", "prefix-lru"])
@pytest.mark.parametrize("seed", [1, 2])
def test_a_pool_written_in_either_layout_or_both_loads_the_same(policy, seed):
    want = fingerprint(load(records(source(policy, seed), old=True), policy))
    assert fingerprint(load(records(source(policy, seed), old=False), policy)) == want
    assert fingerprint(load(records(source(policy, seed), old=False, every=3), policy)) == want
    t = load(records(source(policy, seed), old=False), policy)
    assert {(e[0], e[1]) for e in want["entries"]} == {(e[0], e[1]) for e in fingerprint(t)["entries"]}
    if policy == "prefix-lru":
        def links(x):
            return sorted((ns, k, p) for ns, ks, ps in x.links.snapshot() for k, p in zip(ks, ps))
        assert links(t) == links(load(records(source(policy, seed), old=True), policy))
        assert any(p is not None for _, _, p in links(t)), "parents came back from the segments"


def test_an_unreadable_segment_is_junk_and_loads_nothing():
    d = source("lru", 3)
    good = records(d, old=False)
    value = good[0].value
    seg = unpack_segment(value)
    bad = [
        value[:-1],  # cut short
        value + b"\0",  # longer than its columns
        value[:1] + bytes([SEG_VERSION + 1]) + value[2:],  # another version
        value[:24],  # a head only
        pack_segment(["a"], None, ["n0", "n1"], [0, 2], [1, 2], [100], None, [1, 2], b"x" * 64, 32),  # node index 2
        pack_segment(["a"], None, ["n0"], None, [1], [1 << 63], None, [1], b"x" * 32, 32),  # code past int64
        pack_segment(["a"], None, ["n0"], None, [1], [100 | 257 << 41], None, [1], b"x" * 32, 32),  # 257 parts
        pack_segment(["a"], None, ["n0"], None, [1], [100], None, [1 << 63], b"x" * 32, 32),  # gen past int64
        pack_segment(["a"], None, ["n0"], None, [1], [100], None, [1], (b"ab" * 32), 64),  # a digest's hex text
        pack_segment(["a"], None, [b"\xff".decode("latin-1")], None, [1], [100], None, [1], b"x" * 32, 32)[:24]
        + b"\0" * 8,
    ]
    assert seg.n
    kvs = [kv(PREFIX + b"a/+9.%x" % i, v, 1) for i, v in enumerate(bad)]
    recs = PageRecords(PREFIX)
    recs.add(kvs + good[1:2])
    assert recs.junk == [x.key for x in kvs]
    assert sum(len(c) for c in recs.columns().values()) == len(unpack_segment(good[1].value).gen)


def test_a_segment_of_32_byte_keys_is_parsed_without_an_object_a_page():
    n = 1024
    keys = np.arange(4 * n, dtype=np.uint64).tobytes()
    value = pack_segment(["a"], None, ["n0", "n1"], np.arange(n) % 2, np.arange(n), [PLEN], None,
                         np.arange(n) + 10, keys, 32)
    recs = PageRecords(PREFIX)
    recs.add([kv(PREFIX + b"a/+1.1", value, 7)])
    cols = recs.columns()
    assert sorted(cols) == ["n0", "n1"] and not recs.groups
    c0 = cols["n0"]
    assert c0.dig.tobytes() == b"".join(keys[i:i + 32] for i in range(0, 32 * n, 64)), "the keys as digests"
    assert c0.longs == [] and c0.gen.tolist() == list(range(10, 10 + n, 2)) and set(c0.rev.tolist()) == {7}
    assert c0.key(1) == keys[64:96] and c0.records().tolist() == [PREFIX + b"a/+1.1"] * (n // 2)
