"""``metaserver/table/links.py``: prefix links and ``prefix-lru`` on the columnar directory (links, orphans,
pages dropped without cyclic garbage), checked against a brute-force model of (tier, stamp) order, plus commit
records that name parents and a full load that links them again."""

from __future__ import annotations

import gc
import random
import weakref

import numpy as np
import pytest

from metaserver.table.entry import EXISTS, NEW, READY, Effects
from metaserver.table.records import pages_of
from metaserver.table.snapshot import PageRecords
from metaserver.table.directory import TableDirectory
from metaserver.table.load import load_pages
from metaserver.table.links import ORPHAN, UP0
from transport.objformat import ALIGN, ARENA_DATA_START

PAGE = ALIGN - 64  # payload that fills exactly one 4 KiB unit with its header


class Sink:
    """A KV sink that records, in order, what the table reports."""

    def __init__(self):
        self.stored: list[tuple[str, bytes, bytes | None]] = []
        self.removed: list[bytes] = []

    def stored_keys(self, ns, keys, parents):
        self.stored.extend((ns, k, p) for k, p in zip(keys, parents))

    def removed_keys(self, ns, keys):
        self.removed.extend(keys)


def make(units=8, nodes=("n1",), policy="prefix-lru") -> TableDirectory:
    d = TableDirectory(policy=policy)
    for n in nodes:
        d.add_space(n, units * ALIGN)
    d.kv_sink = Sink()
    d.gen = 1000
    return d


def put(d, ns, keys, parents=None, size=PAGE):
    d.gen += 100
    items, _ = d.alloc(ns, keys, [size] * len(keys), parents, d.gen, 0.0)
    news = [(k, it[4]) for k, it in zip(keys, items) if it[0] == NEW]
    ok, fx = d.commit(ns, [k for k, _ in news], [g for _, g in news], 0.0)
    assert all(ok)
    return items, fx


def evict(d, node_id, units):
    """Evict ``units`` pages of ``node_id`` one pass; the keys that left, in order."""
    before = len(d.kv_sink.removed)
    d.evict_node(d.node_by_id[node_id], units * ALIGN, 100)
    return d.kv_sink.removed[before:]


def row(d, ns, key) -> int:
    return int(d._find(ns, [key])[0])


def tier(d, ns, key) -> int:
    r = row(d, ns, key)
    return d.links.key(r) >> 62


def kids(d, ns, key) -> int:
    return int(d.cols["kids"][row(d, ns, key)])


def test_prefix_lru_evicts_leaves_before_parents():
    d = make(units=4)
    put(d, "m", [b"root"])
    put(d, "m", [b"child"], parents=[b"root"])
    put(d, "m", [b"leaf1", b"leaf2"])
    assert kids(d, "m", b"root") == 1
    # root is the oldest but has a cached child: the child (older than the leaves) goes first; root then becomes
    # a leaf with its own (oldest) recency and goes next, before the younger leaves (queued after the first refill:
    # the requeue puts it at its place)
    assert evict(d, "n1", 2) == [b"child", b"root"]
    d.check()
    assert d.exists("m", [b"leaf1", b"leaf2", b"root"]) == [True, True, False]


def test_prefix_lru_orphans_go_first_and_a_returning_parent_adopts_them():
    d = make(units=8)
    put(d, "m", [b"old1", b"old2"])
    put(d, "m", [b"p"])
    put(d, "m", [b"c"], parents=[b"p"])
    assert kids(d, "m", b"p") == 1
    removed, _ = d.remove("m", [b"p"])
    assert removed == [True] and d.cols["up"][row(d, "m", b"c")] == ORPHAN and tier(d, "m", b"c") == 0
    d.check()
    assert evict(d, "n1", 1) == [b"c"]  # newest, but orphaned: unreachable by prefix match
    put(d, "m", [b"c2"], parents=[b"p2"])  # its parent is not cached yet: an orphan
    assert tier(d, "m", b"c2") == 0 and len(d.links.orphans) == 1
    put(d, "m", [b"p2"])  # the parent arrives and adopts it
    assert kids(d, "m", b"p2") == 1 and d.cols["up"][row(d, "m", b"c2")] == row(d, "m", b"p2") + UP0
    assert not d.links.orphans
    assert evict(d, "n1", 2) == [b"old1", b"old2"]
    d.check()


def test_prefix_lru_cold_chain_loses_its_tail_first():
    d = make(units=8)
    put(d, "m", [b"a1", b"a2", b"a3"], parents=[None, b"a1", b"a2"])
    put(d, "m", [b"b1", b"b2", b"b3"], parents=[None, b"b1", b"b2"])
    # each parent becomes a leaf with its own (old) recency, ahead of the hot chain's leaf
    assert evict(d, "n1", 3) == [b"a3", b"a2", b"a1"]
    d.check()


def test_prefix_lru_refiles_a_page_by_its_own_recency():
    d = make(units=8)
    put(d, "m", [b"l1"])
    put(d, "m", [b"p"])
    put(d, "m", [b"l2"])
    put(d, "m", [b"c"], parents=[b"p"])
    assert tier(d, "m", b"p") == 2
    d.remove("m", [b"c"])  # p is a leaf again: it sorts between l1 and l2, not after l2
    assert evict(d, "n1", 3) == [b"l1", b"p", b"l2"]
    d.check()


def test_a_used_orphan_still_goes_before_leaves_queued_already():
    """A use moves a row to the recent end of its own tier: an orphan read after its node's queue was filled
    still goes before every leaf (inserted into the queue at its place); a leaf read goes after the other leaves."""
    d = make(units=8)
    put(d, "m", [b"p"])
    put(d, "m", [b"o1", b"o2"], parents=[b"p", b"p"])
    put(d, "m", [b"l1", b"l2", b"l3"])
    d.remove("m", [b"p"])  # o1, o2: orphans
    assert evict(d, "n1", 1) == [b"o1"]  # fills the queue: o2, l1, l2, l3
    lease, _ = d.lookup("m", [b"o2", b"l1"], 0.0)
    d.release(lease)
    assert evict(d, "n1", 3) == [b"o2", b"l2", b"l3"]
    d.check()


def test_a_leaf_gaining_a_child_after_the_queue_was_filled_goes_after_the_leaves():
    d = make(units=8)
    put(d, "m", [b"a", b"b", b"c", b"d"])
    assert evict(d, "n1", 1) == [b"a"]  # queue: b, c, d
    put(d, "m", [b"b-kid"], parents=[b"b"])  # b is an inner page now
    assert evict(d, "n1", 3) == [b"c", b"d", b"b-kid"]
    assert evict(d, "n1", 1) == [b"b"]
    d.check()


def test_orphans_across_nodes_are_adopted_when_the_parent_returns():
    d = make(units=4, nodes=("n1", "n2"))
    put(d, "m", [b"p"])
    p_node = d.node_names[d.cols["node"][row(d, "m", b"p")]]
    other = "n2" if p_node == "n1" else "n1"
    d.set_placeable(p_node, False)
    put(d, "m", [b"c"], parents=[b"p"])  # on the other node, linked across nodes
    assert d.node_names[d.cols["node"][row(d, "m", b"c")]] == other and kids(d, "m", b"p") == 1
    n, _ = d.drop_space(p_node)
    assert n == 1 and d.kv_sink.removed == [b"p"]
    assert tier(d, "m", b"c") == 0 and list(d.links.orphans.values()) == [[b"p", {row(d, "m", b"c")}]]
    d.check()
    put(d, "m", [b"p"])  # the parent is written again (on the remaining node): it adopts c
    assert kids(d, "m", b"p") == 1 and tier(d, "m", b"c") == 1 and not d.links.orphans
    d.check()


def test_a_parked_node_that_returns_links_its_pages_again():
    d = make(units=8, nodes=("n1", "n2"))
    put(d, "m", [b"p"])  # the parent on one node, a chain on the other (p <- a <- b) and one child named uncached
    p_node = d.node_names[d.cols["node"][row(d, "m", b"p")]]
    lost = "n2" if p_node == "n1" else "n1"
    d.set_placeable(p_node, False)
    put(d, "m", [b"a", b"b", b"o"], parents=[b"p", b"a", b"gone"])
    d.set_placeable(p_node, True)
    assert {d.node_names[d.cols["node"][row(d, "m", k)]] for k in (b"a", b"b", b"o")} == {lost}
    assert kids(d, "m", b"p") == 1 and tier(d, "m", b"a") == 2 and tier(d, "m", b"o") == 0
    d.detach_space(lost, park=True)
    recs = None
    for _ in range(1000):  # in slices, as the tick drops a lost node
        _n, recs = d.drop_slice(lost, 2, Effects())
        if recs is not None:
            break
    assert {r[1]: r[5] for r in recs} == {b"a": b"p", b"b": b"a", b"o": b"gone"}  # the parents they named
    assert kids(d, "m", b"p") == 0 and d.exists("m", [b"a", b"b", b"o"]) == [False] * 3
    d.add_space(lost, 8 * ALIGN)  # it comes back with its arena: its pages are filed again, linked as before
    restored, _ = d.unpark(lost, [r[:6] + r[7:] for r in recs])  # as metaserver/handlers/rejoin.py keeps them
    assert restored == 3 and d.exists("m", [b"a", b"b", b"o"]) == [True] * 3
    assert kids(d, "m", b"p") == 1 and kids(d, "m", b"a") == 1 and tier(d, "m", b"a") == 2
    assert tier(d, "m", b"b") == 1 and tier(d, "m", b"o") == 0  # a leaf; an orphan whose parent is not cached
    assert d.links.parent_keys(d._find("m", [b"a", b"b", b"o"])) == [b"p", b"a", b"gone"]
    d.check()


def test_a_load_links_parents_loaded_before_or_after_their_children():
    d = make(units=8, nodes=("n1", "n2"))
    base = ARENA_DATA_START
    # n2 first: c names p, which n1 brings later (an orphan until then); n1's own chain links within the load
    assert load_pages(d, "n2", "m", [b"c"], [base], [PAGE], [7], parents=[b"p"]) == []
    assert tier(d, "m", b"c") == 0
    assert load_pages(d, "n1", "m", [b"p", b"q", b"q2"], [base, base + ALIGN, base + 2 * ALIGN], [PAGE] * 3,
                      [6, 8, 9], parents=[None, b"p", b"q"]) == []
    assert kids(d, "m", b"p") == 2 and kids(d, "m", b"q") == 1 and tier(d, "m", b"c") == 1 and not d.links.orphans
    d.check()


def test_records_name_parents_and_a_full_load_links_them_again():
    d = make(units=8)
    _, fx = put(d, "m", [b"a", b"b", b"c"], parents=[None, b"a", b"zz"])  # c's parent is not cached: an orphan
    puts = fx.recs
    assert [p[0::5] for p in pages_of(puts[0].value())] == [[b"a", None], [b"b", b"a"], [b"c", b"zz"]]
    assert d.kv_sink.stored == [("m", b"a", None), ("m", b"b", b"a"), ("m", b"c", b"zz")]
    recs = pages_of(puts[0].value())
    pages = PageRecords.of([(5 + i, "n1", "m", k, off, plen, gen, parent, b"etcd/%d" % i)
                            for i, (k, _node, off, plen, gen, parent) in enumerate(reversed(recs))])
    t = TableDirectory(policy="prefix-lru")
    t.load({"n1": ({"capacity": 8 * ALIGN}, 1)}, pages)
    assert t.exists("m", [b"a", b"b", b"c"]) == [True] * 3
    assert kids(t, "m", b"a") == 1 and tier(t, "m", b"b") == 1 and tier(t, "m", b"c") == 0
    t.check()


def test_lru_keeps_no_links_but_events_name_parents():
    d = make(units=4, policy="lru")
    put(d, "m", [b"a", b"b"], parents=[None, b"a"])
    assert "up" not in d.cols and d.kv_sink.stored == [("m", b"a", None), ("m", b"b", b"a")]
    put(d, "m", [b"c", b"d", b"e"])  # a, the oldest, goes first under lru though b depends on it
    assert d.kv_sink.removed == [b"a"]
    d.check()


@pytest.mark.parametrize("policy", ["lru", "prefix-lru"])
def test_a_put_of_a_page_already_here_counts_as_a_use(policy):
    """ALLOC answering EXISTS refreshes the page's recency, for both policies."""
    d = make(units=4, policy=policy)
    put(d, "m", [b"a", b"b", b"c", b"d"])
    assert evict(d, "n1", 0) == []
    items, _ = d.alloc("m", [b"a"], [PAGE], None, 50, 1.0)  # dedup: nothing allocated
    assert [it[0] for it in items] == [EXISTS]
    items, _ = d.alloc("m", [b"e"], [PAGE], None, 60, 2.0)
    assert [it[0] for it in items] == [NEW] and d.kv_sink.removed == [b"b"]
    d.check()


def tiers_by_model(d, ns, parent_of: dict) -> dict:
    """Each READY key's tier from the keys alone: 2 when a READY key names it, else 0 when the parent it names is
    not READY, else 1."""
    ready = {k for k, e in zip(parent_of, d.exists(ns, list(parent_of))) if e}
    named = {p for k, p in parent_of.items() if k in ready and p is not None and p in ready and p != k}
    return {k: 2 if k in named else 0 if parent_of[k] is not None and (parent_of[k] not in ready or parent_of[k] == k)
            else 1 for k in ready}


def test_victims_leave_in_exact_tier_then_recency_order_under_churn():
    """Random chains (some naming missing parents), reads, removes and one-page evictions: every victim is the
    node's least (tier, stamp) READY unpinned page, tiers computed from the keys alone."""
    rng = random.Random(7)
    d = make(units=48, nodes=("n1", "n2"))
    parent_of: dict[bytes, bytes | None] = {}
    leases = []
    for step in range(400):
        op = rng.random()
        if op < 0.45:
            n = rng.randint(1, 4)
            base = rng.choice([None] + list(parent_of)[-30:] + [b"missing%d" % rng.randint(0, 5)])
            keys = [b"k%d-%d" % (step, i) for i in range(n)]
            parents = [base] + keys[:-1]
            if rng.random() < 0.1:
                keys[0] = rng.choice(list(parent_of) or [keys[0]])  # a key written again (EXISTS) or back
            items, _ = d.alloc("m", keys, [PAGE] * n, parents, 10_000 + step * 10, 0.0)
            news = [(k, it[4]) for k, it in zip(keys, items) if it[0] == NEW]
            for k, p in zip(keys, parents):
                if any(k == x for x, _ in news):
                    parent_of[k] = p
            d.commit("m", [k for k, _ in news], [g for _, g in news], 0.0)
        elif op < 0.6 and parent_of:
            lease, _ = d.lookup("m", rng.sample(list(parent_of), min(3, len(parent_of))), 0.0)
            if lease:
                leases.append(lease)
            if leases and rng.random() < 0.7:
                d.release(leases.pop(rng.randrange(len(leases))))
        elif op < 0.7 and parent_of:
            d.remove("m", [rng.choice(list(parent_of))])
        else:
            node = rng.choice(["n1", "n2"])
            c = d.cols
            rows = d._rows_of(d.node_by_id[node])
            rows = rows[(c["state"].take(rows) == READY) & (c["pins"].take(rows) == 0)]
            if not len(rows):
                continue
            tiers = tiers_by_model(d, "m", parent_of)
            want = min(rows.tolist(), key=lambda r: (tiers[d.key_of(r)], int(c["stamp"][r])))
            want_key = d.key_of(want)
            got = evict(d, node, 1)
            assert got == [want_key], (step, got, want_key, tiers[want_key])
        d.check()


@pytest.mark.parametrize("policy", ["lru", "prefix-lru"])
def test_the_table_drops_linked_pages_without_cyclic_garbage(policy):
    """Every way the table drops pages (churn evictions, lease and PENDING expiry, aborts, removes, drains, node
    loss in slices, a dropped node, watermark passes, evict-all) leaves no cyclic garbage (links are columns and a
    dict of orphans, no object per page): what makes freezing it under ``metaserver/store/gcpolicy.py`` safe."""
    gc.collect()
    gc.disable()
    try:
        d = TableDirectory(policy=policy, pending_ttl_s=5.0, read_lease_s=5.0)
        for n in ("n1", "n2", "n3", "n4"):
            d.add_space(n, 60 * ALIGN)
        for c in range(120):  # 720 pages into 240 units: every later page evicts an old one
            keys = [b"c%05d-p%d" % (c, i) for i in range(6)]
            items, _ = d.alloc("m", keys, [PAGE] * 6, [None] + keys[:-1], 1000 + c * 10, 0.0)
            d.commit("m", keys, [it[4] for it in items], 0.0)
        assert d.evictions >= 480
        lease, locs = d.lookup("m", [b"c%05d-p%d" % (119, i) for i in range(6)], 2.0)
        assert lease and all(loc is not None for loc in locs)
        d.release(lease)
        d.lookup("m", [b"c%05d-p%d" % (118, i) for i in range(6)], 2.0)  # never released: expires
        d.expire_leases(100.0, 1 << 20)
        items, _ = d.alloc("m", [b"pending-%d" % i for i in range(4)], [PAGE] * 4, None, 5000, 3.0)
        d.abort("m", [b"pending-0", b"pending-1"], [items[0][4], items[1][4]])
        d.expire_pending(100.0, 1 << 20)  # the other two were never committed
        removed, _ = d.remove("m", [b"c%05d-p%d" % (119, i) for i in range(6)])
        assert all(removed)
        d.drain("n1")
        d.detach_space("n2")
        for _ in range(1000):
            _n, rest = d.drop_slice("n2", 7, Effects())
            if rest is not None:
                break
        d.drop_space("n3")
        d.watermark_pass(0.5, 0.2, 1 << 20, Effects())
        n, _freed, done = d.evict_all(1 << 20, Effects())
        d.check()
        assert done and d.objects == 0 and not d.links.orphans
        assert gc.collect() == 0
        # The control: a dropped table is cyclic garbage (what gcpolicy.thaw is for), so the check above can fail.
        gone = weakref.ref(d)
        del d
        assert gone() is not None
        assert gc.collect() > 0 and gone() is None
    finally:
        gc.enable()


def test_links_cost_eight_bytes_a_row_under_prefix_lru_only():
    lru, plru = TableDirectory(policy="lru"), TableDirectory(policy="prefix-lru")
    extra = sum(a.itemsize for name, a in plru.cols.items() if name not in lru.cols)
    assert extra == 8 and np.dtype(plru.cols["up"].dtype).itemsize == 4
