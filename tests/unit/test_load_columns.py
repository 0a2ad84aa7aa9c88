"""The cold load's column paths (metaserver/table/records.py ``unpack_segment``/``Segment.digests``,
metaserver/table/snapshot.py ``PageRecords.columns``): a segment whose keys are all of one length takes them as one
blob (no gather), its checks refuse what they refused before, and each node's columns hold the pages the slow path
(``PageRecords.done``: an entry a page) lists, in commit order."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from metaserver.table.entry import SHARD_SHIFT
from umbp.config import MAX_SHARDS
from transport.keyform import digests
from metaserver.table.records import pack_segment, unpack_segment
from metaserver.table.snapshot import PageRecords

PREFIX = b"/umbp/pages/"


def seg33(keys: list[bytes], lens=True, digs=True, gen0: int = 5, codes=(4096,)) -> bytes:
    n = len(keys)
    return pack_segment(["m"], None, ["n0"], None, list(range(1, n + 1)), list(codes), [i % len(codes) for i in range(n)],
                        [gen0 + i for i in range(n)], b"".join(keys), 32,
                        [len(k) for k in keys] if lens else None, digs=digests(keys)[0] if digs else None)


@pytest.mark.parametrize("klen", [33, 32, 40])
def test_keys_of_one_length_given_with_lengths_come_as_one_blob(klen):
    keys = [bytes([i]) * klen for i in range(1, 21)]
    s = unpack_segment(seg33(keys))
    assert s.same_len == klen and s.key_list() == keys
    dig, longs = s.digests()
    assert (dig == digests(keys)[0]).all()
    want = [] if klen == 32 else list(enumerate(keys))
    assert list(longs) == want and len(longs) == len(want)
    if klen != 32:
        assert longs.blob == b"".join(keys) and longs.ends.tolist() == [klen * (i + 1) for i in range(20)]


def test_keys_of_several_lengths_are_gathered_as_before():
    keys = [bytes([i]) * (32 if i % 3 else 33) for i in range(1, 22)]
    s = unpack_segment(seg33(keys))
    assert s.same_len == 0 and s.key_list() == keys
    dig, longs = s.digests()
    assert (dig == digests(keys)[0]).all()
    assert list(longs) == [(i, k) for i, k in enumerate(keys) if len(k) == 33]


def test_the_checks_refuse_what_they_refused():
    good = [bytes([i]) * 33 for i in range(1, 5)]
    unpack_segment(seg33(good, gen0=(1 << 63) - 4))  # the largest generation that fits
    with pytest.raises(ValueError, match="generation"):
        unpack_segment(seg33(good, gen0=(1 << 63) - 3))
    with pytest.raises(ValueError, match="layout code"):
        unpack_segment(seg33(good, codes=(4096, (MAX_SHARDS + 1) << SHARD_SHIFT)))
    with pytest.raises(ValueError, match="layout code"):
        unpack_segment(seg33(good, codes=(1 << 63,)))
    for bad in ([b"x" * 33, b""], [b"x" * 33, b"ab" * 32]):  # an empty key; a 64-byte key not in its digest form
        with pytest.raises(ValueError, match="one form"):
            unpack_segment(seg33(bad, digs=False))
    assert unpack_segment(seg33([b"x" * 70, b"y" * 33], digs=False)).same_len == 0


def kv(key: bytes, value: bytes, rev: int):
    return SimpleNamespace(key=key, value=value, mod_revision=rev, create_revision=rev)


def seg_nodes(keys: list[bytes], nodes: list[str], nodeix: list[int], gen0: int, dead=None, dead_recs=None) -> bytes:
    n = len(keys)
    lens = None if all(len(k) == 32 for k in keys) else [len(k) for k in keys]
    return pack_segment(["m"], None, nodes, nodeix, [16 * (gen0 + i) for i in range(n)], [4096, 8192],
                        [i % 2 for i in range(n)], [gen0 + i for i in range(n)], b"".join(keys), 32, lens,
                        digs=None if lens is None else digests(keys)[0], dead=dead, dead_recs=dead_recs,
                        dead_ix=None if dead is None else [0] * len(dead))


def test_each_nodes_columns_list_what_the_entries_list_in_commit_order():
    """Segments over three nodes, scanned out of commit order, one of 33-byte keys, a dead list naming pages of
    two of them (every page node "c" has): the columns hold, a node, what ``done``'s entries hold sorted by
    revision; "c" has none."""
    k = [bytes([i]) * (33 if 20 <= i < 40 else 32) for i in range(1, 61)]
    r1, r2, r3, r4 = (PREFIX + b"m/+1.%x" % i for i in range(1, 5))
    kvs = [kv(r2, seg_nodes(k[20:40], ["a", "b"], [i % 2 for i in range(20)], 200), 30),  # (scan order: by name)
           kv(r1, seg_nodes(k[:20], ["a", "c", "b"], [0] * 8 + [1] * 4 + [2] * 8, 100), 20),
           kv(r3, seg_nodes(k[40:50], ["b"], [0] * 10, 300, dead=[108, 109, 110, 111, 102, 205], dead_recs=[r1]), 40),
           kv(r4, seg_nodes(k[50:], ["a", "b"], [1] * 5 + [0] * 5, 400, dead=[205], dead_recs=[r2]), 10)]
    got_recs, want_recs = PageRecords(PREFIX), PageRecords(PREFIX)
    got_recs.add(kvs)
    want_recs.add(kvs)
    got = got_recs.columns()
    want = {}
    for node, (ents, revs) in want_recs.done().items():
        order = sorted(range(len(ents)), key=lambda i: revs[i])
        want[node] = [(ents[i].ns, ents[i].key, ents[i].offset, ents[i].payload_len, ents[i].gen, revs[i],
                       ents[i].batch) for i in order]
    assert "c" not in got and want.get("c", []) == [] and sorted(got) == ["a", "b"]
    assert got_recs.dropped == want_recs.dropped == 6
    for node, p in got.items():
        rows = [(p.ns_names[p.nsix[i]], p.key(i), int(p.off[i]), int(p.code[i]), int(p.gen[i]), int(p.rev[i]),
                 p.rec_names[p.rec[i]]) for i in range(len(p))]
        assert rows == want[node] and len(rows) == {"a": 22, "b": 32}[node]
        assert [p.page(i, node, got_recs)[:7] for i in range(len(p))] == [  # (one page read without a column made)
            (r[5], node, r[0], r[1], r[2], r[3], r[4]) for r in rows]
        assert (p.dig == digests([r[1] for r in rows])[0]).all()
        assert list(p.longs) == [(i, r[1]) for i, r in enumerate(rows) if len(r[1]) == 33]


def test_gather_of_one_length_keys_at_any_start():
    from metaserver.table.longkeys import gather
    blob = bytes(range(256)) * 3
    for starts, k in (([0, 66, 33, 330], 33), ([1, 40, 7], 33), ([5, 0], 1)):
        got, ends = gather(blob, np.array(starts), np.full(len(starts), k))
        assert got == b"".join(blob[a:a + k] for a in starts) and ends.tolist() == [k * (i + 1) for i in range(len(starts))]


@pytest.mark.parametrize("bad", [None, 3])
def test_a_load_of_shuffled_offsets_files_each_page_at_its_own(bad):
    """Every page valid (no index copies: ``load_pages``' usual path) or one unaligned, offsets not in commit
    order: each page filed at its offset, the bad one rejected alone."""
    from metaserver.table.columns import PageTable
    from metaserver.table.load import load_pages
    from metaserver.table.nodes import add_node
    from transport.objformat import ARENA_DATA_START, object_size
    size = object_size(60_000)
    t = PageTable()
    add_node(t, "n0", 40 * size)
    rng = np.random.default_rng(7)
    slots = rng.permutation(30)
    offs = [ARENA_DATA_START + int(i) * size for i in slots]
    if bad is not None:
        offs[bad] += 512
    keys = [bytes([i + 1]) * 32 for i in range(30)]
    rej = load_pages(t, "n0", "a", keys, offs, [60_000] * 30, list(range(1, 31)))
    assert rej == ([] if bad is None else [bad])
    ok = [i for i in range(30) if i != bad]
    assert t.objects == len(ok) and t.node_by_id["n0"].alloc.used == len(ok) * size
    rows = t.ix.find(t._ns("a"), np.frombuffer(b"".join(keys), np.uint64).reshape(30, 4), t.cols["ns"])
    assert (rows[ok] >= 0).all() and (bad is None or rows[bad] < 0)
    assert t.offsets_of(rows[ok]) == [offs[i] for i in ok]
