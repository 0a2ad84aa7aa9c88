"""metaserver/table/load.py: a page table rebuilt by ``load_pages`` from another's READY rows (per node, in stamp
order) has the same fingerprint (rows, places, use, LRU order) and answers the same further requests as the
original; each rejection rule (overlap, outside the arena, unaligned offset, key given twice, key already filed)
rejects exactly its page, checked against a model of the rules on the same pages, also on random ones; a load
spanning several row blocks (room reserved first) and one into a node's scattered free rows; a load's LRU order is
its commit order."""

from __future__ import annotations

import random

import numpy as np
import pytest

from metaserver.table.columns import BLOCK, PageTable
from metaserver.table.entry import NEW, READY, extent_size
from metaserver.table.index import REBUILD_LOAD
from metaserver.table.records import pages_of, unpack_segment
from metaserver.table.load import fingerprint, load_pages, reserve
from metaserver.table.nodes import FREE, UNIT_SHIFT, add_node, set_placeable
from transport.objformat import ARENA_DATA_START, object_size
from umbp.errors import ConfigError

PLEN = 60_000  # one 64 KiB object slot each (namespace "a")
PLEN_B = 130_000  # two slots each (namespace "b"): holes of two sizes
S = object_size(PLEN)
BASE = ARENA_DATA_START
SIZES = {"a": PLEN, "b": PLEN_B}


def table(nodes: int = 2, slots: int = 12) -> PageTable:
    t = PageTable()
    for i in range(nodes):
        add_node(t, f"n{i}", slots * S)
    return t


def universe() -> list[bytes]:
    """Raw 32-byte digests, keys SGLang's rank form makes (33 bytes), short keys."""
    return ([bytes([i]) * 32 for i in range(16)] + [bytes([i]) * 32 + b"\x03" for i in range(8)]
            + [b"key-%d" % i for i in range(16)])


class Driver:
    """Random requests, the same on every table given; asserts the tables answer alike. Leases by position."""

    def __init__(self, tables: list[PageTable], seed: int):
        self.tables = tables
        self.rng = random.Random(seed)
        self.keys = universe()
        self.gen = 1
        self.leases: list[list[int]] = []  # per open read: each table's lease

    def same(self, answers: list) -> object:
        assert all(a == answers[0] for a in answers[1:]), answers
        return answers[0]

    def step(self) -> None:
        rng, ts = self.rng, self.tables
        ns = rng.choice("ab")
        op = rng.random()
        if op < 0.4:  # ALLOC then COMMIT (now and then an ABORT of one new key instead)
            keys = rng.sample(self.keys, rng.randint(1, 6))
            items = self.same([t.alloc(ns, keys, [SIZES[ns]] * len(keys), self.gen) for t in ts])
            self.gen += len(keys)
            new = [(k, it[4]) for k, it in zip(keys, items) if it[0] == NEW]
            if new and rng.random() < 0.2:
                k, g = new.pop()
                assert self.same([t.abort(ns, [k], [g]) for t in ts]) == 1
            self.same([t.commit(ns, [k for k, _ in new], [g for _, g in new]) for t in ts])
        elif op < 0.65:
            keys = rng.sample(self.keys, rng.randint(1, 8))
            got = [t.lookup(ns, keys) for t in ts]
            self.same([locs for _, locs in got])
            if got[0][0]:
                self.leases.append([lease for lease, _ in got])
        elif op < 0.85 and self.leases:
            held = self.leases.pop(rng.randrange(len(self.leases)))
            assert all(t.release(lease) for t, lease in zip(ts, held))
        else:
            keys = rng.sample(self.keys, rng.randint(1, 3))
            self.same([t.remove(ns, keys) for t in ts])
        self.same([t.exists(ns, self.keys) for t in ts])

    def release_all(self) -> None:
        for held in self.leases:
            assert all(t.release(lease) for t, lease in zip(self.tables, held))
        self.leases = []


def reload(a: PageTable) -> PageTable:
    """A table built from ``a``'s READY rows, node by node in stamp order (the commit order a full load reads)."""
    b = PageTable()
    for node in a.nodes:  # the same order: the same node indexes, the same round-robin order
        add_node(b, node.node_id, node.alloc.capacity)
    c = a.cols
    for node in a.nodes:
        rows = a._rows_of(node)
        rows = rows[c["state"][rows] == READY]
        rows = rows[np.argsort(c["stamp"][rows])]
        assert load_pages(b, node.node_id, [a.ns_names[i] for i in c["ns"][rows].tolist()],
                          [a.key_of(r) for r in rows.tolist()],
                          (c["unit"][rows].astype(np.int64) << UNIT_SHIFT).tolist(),
                          a.code_arr[c["size"][rows]].tolist(), c["gen"][rows].tolist(),
                          stamps=c["stamp"][rows]) == []  # recency across nodes too (a load passes revisions)
    return b


def free_lists_in_address_order(t: PageTable) -> None:
    """Rebuild each node's allocator from its rows. A load cannot restore the order of an allocator's free lists
    (which of equal holes the next ALLOC takes: the order they were freed in); a rebuilt one files them lowest
    first, as the loaded table's. The holes themselves, and so the bytes used, are the same either way."""
    c = t.cols
    for node in t.nodes:
        rows = t._rows_of(node)
        rows = rows[c["state"][rows] != FREE]
        node.alloc.rebuild_columns((c["unit"][rows].astype(np.int64) << UNIT_SHIFT).tolist(),
                                   [extent_size(int(x)) for x in t.code_arr[c["size"][rows]]])


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 21, 24])  # 21, 24: they differ without free_lists_in_address_order
def test_a_reloaded_table_has_the_same_fingerprint_and_answers_alike(seed):
    a = table()
    drive = Driver([a], seed)
    for _ in range(300):
        drive.step()
        a.check()
    drive.release_all()
    assert not a.leases and not a._pending
    before = fingerprint(a)
    assert a.evictions > 0 and before["objects"] >= 6, "the pool filled, and evicted"
    assert {ns for ns, *_ in before["entries"]} == {"a", "b"}
    assert any(len(k) != 32 for _, k, *_ in before["entries"]), "keys that are not their own digest"
    b = reload(a)
    b.check()
    assert fingerprint(b) == before
    b._rr = a._rr  # placement in turn: the same next node
    free_lists_in_address_order(a)
    a.check()
    drive.tables = [a, b]
    evicted = a.evictions, b.evictions
    for _ in range(300):
        drive.step()
    drive.release_all()
    a.check()
    b.check()
    assert a.evictions - evicted[0] == b.evictions - evicted[1] > 0
    assert fingerprint(a) == fingerprint(b)


def model_load(pages: list[tuple], nodes: dict[str, int], order: list[str]) -> tuple[dict, dict]:
    """The load rules (``tableload``'s docstring) one page at a time: (node -> positions rejected, node -> the pages
    filed, in commit order). Pages are (node, ns, key, offset, payload_len, gen)."""
    filed: set = set()
    rejected, kept = {}, {}
    for node_id in order:
        mine = [p for p in pages if p[0] == node_id]
        bad = {i for i, p in enumerate(mine) if (p[1], p[2]) in filed}  # 1: a key the table holds already
        end = BASE
        for i in sorted(set(range(len(mine))) - bad, key=lambda i: mine[i][3]):  # 2: offset order (ties: commit)
            off, size = mine[i][3], extent_size(mine[i][4])
            if off % 4096 or off < end or off + size > BASE + nodes[node_id]:
                bad.add(i)
            else:
                end = off + size
        seen: set = set()
        for i, p in enumerate(mine):  # 3: of a key given twice among those left, the first in commit order
            if i in bad:
                continue
            if (p[1], p[2]) in seen:
                bad.add(i)
            seen.add((p[1], p[2]))
        rejected[node_id] = sorted(bad)
        kept[node_id] = [p for i, p in enumerate(mine) if i not in bad]
        filed.update((p[1], p[2]) for p in kept[node_id])
    return rejected, kept


def table_load(pages: list[tuple], nodes: dict[str, int], order: list[str]) -> tuple[PageTable, dict]:
    t = PageTable()
    for node_id, cap in nodes.items():
        add_node(t, node_id, cap)
    rejected = {}
    for node_id in order:
        mine = [p for p in pages if p[0] == node_id]
        rejected[node_id] = load_pages(t, node_id, [p[1] for p in mine], [p[2] for p in mine],
                                       [p[3] for p in mine], [p[4] for p in mine], [p[5] for p in mine])
    return t, rejected


def assert_as_modelled(t: PageTable, nodes: dict[str, int], kept: dict) -> None:
    """Every page the model filed is in the table at its place, nothing else is, and each node's use and LRU order
    (its commit order) agree."""
    fp = fingerprint(t)
    assert fp["entries"] == sorted((p[1], p[2], p[0], p[3], p[4], p[5], READY) for ps in kept.values() for p in ps)
    for node_id, ps in kept.items():
        assert fp["nodes"][node_id] == (nodes[node_id], sum(extent_size(p[4]) for p in ps), len(ps))
        assert fp["order"][node_id] == [(p[1], p[2]) for p in ps]


CLEAN = [("n0", "a", b"k%d" % i, BASE + slot * S, PLEN, 100 + i) for i, slot in enumerate([0, 1, 2, 3, 5])]
BAD = {  # (position given, page, position rejected): each breaks one rule, given among the five clean pages
    "overlap": (2, ("n0", "a", b"over", BASE + 3 * S + 4 * 4096, PLEN, 7), 2),  # starts inside k3's extent
    "overlap given first": (0, ("n0", "a", b"over", BASE + S + 4096, PLEN, 7), 0),  # inside k1's
    # starts in the free slot 4, ends inside k4's extent: the lower offset stays, whatever the commit order
    "overlap below a page given before": (5, ("n0", "a", b"over", BASE + 4 * S + 8 * 4096, PLEN, 7), 4),
    "outside the arena": (3, ("n0", "a", b"far", BASE + 7 * S + 4096, PLEN, 8), 3),  # the arena ends at BASE + 8 S
    "below the arena": (1, ("n0", "a", b"low", 0, PLEN, 8), 1),
    "unaligned": (4, ("n0", "a", b"odd", BASE + 6 * S + 100, PLEN, 9), 4),  # overlaps nothing, inside
    "key given twice": (5, ("n0", "a", b"k1", BASE + 6 * S, PLEN, 10), 5),  # after k1: the first stays
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_each_rule_rejects_exactly_its_page(case):
    pos, bad, want = BAD[case]
    pages = CLEAN[:pos] + [bad] + CLEAN[pos:]
    nodes = {"n0": 8 * S}
    t, rej = table_load(pages, nodes, ["n0"])
    mrej, filed = model_load(pages, nodes, ["n0"])
    assert rej == {"n0": [want]} == mrej
    t.check()
    kept = [p for i, p in enumerate(pages) if i != want]
    assert t.objects == 5 and t.nodes[0].alloc.used == 5 * S, "a rejected page holds no extent"
    where = {p[2]: ("n0", p[3], PLEN, p[5]) for p in kept}
    asked = list(dict.fromkeys(p[2] for p in pages))
    lease, locs = t.lookup("a", asked)
    assert locs == [where.get(k) for k in asked], "each kept page where it was given, with its generation"
    assert sum(loc is not None for loc in locs) == 5
    assert t.release(lease)
    t.check()
    assert_as_modelled(t, nodes, filed)


def test_a_key_filed_already_is_rejected_and_columns_must_agree():
    nodes = {"n0": 8 * S, "n1": 8 * S}
    pages = CLEAN + [("n1", "a", b"k2", BASE, PLEN, 50), ("n1", "b", b"k2", BASE + S, PLEN, 51),
                     ("n1", "a", b"new", BASE + 2 * S, PLEN, 52)]
    t, rej = table_load(pages, nodes, ["n0", "n1"])
    mrej, filed = model_load(pages, nodes, ["n0", "n1"])
    assert rej == mrej == {"n0": [], "n1": [0]}, "k2 of a is n0's; k2 of b is another page"
    t.check()
    assert_as_modelled(t, nodes, filed)
    assert t.lookup("b", [b"k2"])[1] == [("n1", BASE + S, PLEN, 51)]
    with pytest.raises(ConfigError, match="columns: load of node 'n0': it holds"):
        load_pages(t, "n0", "a", [b"x"], [BASE + 7 * S], [PLEN], [1])
    with pytest.raises(ConfigError, match="columns: load of node 'n9': no such node"):
        load_pages(t, "n9", "a", [b"x"], [BASE], [PLEN], [1])
    add_node(t, "n2", 4 * S)
    with pytest.raises(ConfigError, match="columns: load of node 'n2': 1 keys, 2 offsets"):
        load_pages(t, "n2", "a", [b"x"], [BASE, BASE], [PLEN], [1])
    assert fingerprint(t)["nodes"]["n2"] == (4 * S, 0, 0), "a refused load changes nothing"
    t.check()


@pytest.mark.parametrize("seed", range(8))
def test_random_loads_reject_what_the_rules_reject(seed):
    """Pages on a grid of one-slot steps with random jitter (aligned overlaps, unaligned offsets, some past either
    end), keys from a small set in two namespaces (some given twice, some on both nodes), two sizes."""
    rng = random.Random(seed)
    keys = universe()[::2]
    pages = []
    for i in range(120):
        node = rng.choice(["n0", "n1"])
        ns = rng.choice("ab")
        slot = rng.randrange(-1, 22)
        jitter = rng.choice([0, 0, 0, 0, 4096 * rng.randrange(1, 16), 100])
        pages.append((node, ns, rng.choice(keys), max(0, BASE + slot * S + jitter), SIZES[ns], 1000 + i))
    nodes = {"n0": 20 * S, "n1": 20 * S}
    order = ["n1", "n0"] if seed % 2 else ["n0", "n1"]
    t, rej = table_load(pages, nodes, order)
    mrej, filed = model_load(pages, nodes, order)
    assert rej == mrej
    assert sum(map(len, rej.values())) > 20 and t.objects > 10, "both kinds of outcome happened"
    t.check()
    assert_as_modelled(t, nodes, filed)


def test_a_load_spanning_several_blocks_keeps_commit_order_for_lru():
    n = 3 * BLOCK + 5
    small = 100  # one 4 KiB unit each
    t = PageTable()
    add_node(t, "n0", n * 4096)
    add_node(t, "n1", 4 * 4096)
    keys = [i.to_bytes(32, "little") for i in range(n)]
    offs = [BASE + ((i * 7919) % n) * 4096 for i in range(n)]  # commit order is not offset order
    reserve(t, n, 2)
    rows, resizes = t.rows, t.ix.resizes
    assert t.ix.capacity * REBUILD_LOAD >= n
    big = PageTable()  # (a new table has 64 blocks of rows already)
    reserve(big, 100 * BLOCK, 3)
    assert big.rows >= 103 * BLOCK and big.ix.capacity * REBUILD_LOAD >= 100 * BLOCK
    assert load_pages(t, "n0", "a", keys, np.array(offs), [small] * n, np.arange(n) + 10) == []
    assert (t.rows, t.ix.resizes) == (rows, resizes), "reserved: neither the columns nor the index grew"
    t.check()
    node = t.node_by_id["n0"]
    assert len(node.blocks) == 4 and len(node.free) == BLOCK - 5 and t.objects == n
    assert node.alloc.used == n * 4096 and node.alloc.free_bytes == 0
    assert t.exists("a", keys) == [True] * n
    lease, locs = t.lookup("a", keys[::997])
    assert locs == [("n0", offs[i], small, i + 10) for i in range(0, n, 997)]
    assert t.release(lease)
    fp = fingerprint(t)
    order = [k for _, k in fp["order"]["n0"]]
    touched = keys[::997]
    assert order == [k for k in keys if k not in set(touched)] + touched, "commit order, then the read ones"
    set_placeable(t, "n1", False)
    items = t.alloc("a", [b"x" * 32, b"y" * 32], [small, small], 1 << 40)
    assert [(it[0], it[2]) for it in items] == [(NEW, offs[1]), (NEW, offs[2])], "the oldest (k0 was read) go"
    t.check()


def test_a_node_emptied_by_removes_loads_into_its_own_free_rows():
    """Rows come off the node's free list (scattered rows, not one range) before any new block is taken."""
    t = table(1, 12)
    keys = [b"old-%d" % i for i in range(9)]
    items = t.alloc("a", keys, [PLEN] * 9, 1)
    assert t.commit("a", keys, [it[4] for it in items]) == [True] * 9
    assert t.remove("a", keys[::2]) == [True] * 5 and t.remove("a", keys[1::2]) == [True] * 4
    node = t.node_by_id["n0"]
    assert node.alloc.used == 0 and len(node.blocks) == 1
    new = [b"new-%d" % i for i in range(6)] + [bytes([7]) * 32]
    offs = [BASE + slot * S for slot in (4, 0, 9, 2, 11, 5, 1)]
    assert load_pages(t, "n0", ["a", "b"] * 3 + ["a"], new, offs, [PLEN] * 7, range(50, 57)) == []
    t.check()
    assert len(node.blocks) == 1 and t.objects == 7 and node.alloc.used == 7 * S
    assert t.exists("a", keys) == [False] * 9
    fp = fingerprint(t)
    assert fp["order"]["n0"] == list(zip(["a", "b"] * 3 + ["a"], new)), "commit order"
    assert fp["entries"] == sorted(zip(["a", "b"] * 3 + ["a"], new, ["n0"] * 7, offs, [PLEN] * 7, range(50, 57),
                                       [READY] * 7))


PLEN_REC = 60_000


def test_loaded_rows_are_filed_under_the_records_they_came_from():
    """A load given each page's commit record: a record spread over two nodes is one record; evicting or removing a
    loaded page names it in a dead list under the record it came from; a record with a page the load rejected is
    rewritten without it, and one with no page filed is deleted."""
    t = PageTable()
    for n in ("n0", "n1"):
        add_node(t, n, 8 * object_size(PLEN_REC))
    size = object_size(PLEN_REC)
    keys = [i.to_bytes(32, "little") for i in range(12)]
    base = ARENA_DATA_START
    # n0: r1's pages 0-2, r2's 3-4 (4 overlaps 3: rejected); n1: r1's 5-6, r3's only page 7 overlaps 6: rejected
    rej0 = load_pages(t, "n0", "a", keys[:5], [base, base + size, base + 2 * size, base + 3 * size, base + 3 * size],
                      [PLEN_REC] * 5, [1, 2, 3, 4, 5], records=[b"r1", b"r1", b"r1", b"r2", b"r2"])
    rej1 = load_pages(t, "n1", "a", keys[5:8], [base, base + size, base + size], [PLEN_REC] * 3, [6, 7, 8],
                      records=[b"r1", b"r1", b"r3"])
    assert rej0 == [4] and rej1 == [2]
    t.check()
    puts, rewrites = t.commits.take()
    assert puts == [] and sorted(r.name for r in rewrites) == [b"r2", b"r3"]
    r1 = t.commits.by_name[b"r1"]
    assert sorted(r1.rows.tolist()) == sorted(t._find("a", keys[:3] + keys[5:7]).tolist())
    assert [len(pages_of(r.value())) if r.value() else 0 for r in sorted(rewrites, key=lambda r: r.name)] \
        == [1, 0], "r2 keeps page 3; r3 had no page filed: deleted"
    assert t.remove("a", [keys[5]]) == [True]
    _, rewrites = t.commits.take()
    (dl,) = rewrites
    seg = unpack_segment(dl.value())
    assert dl is not r1 and seg.dead_recs == [b"r1"] and seg.dead.tolist() == [6], "named under the record it came from"
    assert len(pages_of(r1.value())) == 4
    t.check()
