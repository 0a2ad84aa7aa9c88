"""The page directory (``metaserver.table.directory.TableDirectory``, pure bookkeeping, no I/O): ALLOC / COMMIT / ABORT /
LOOKUP / RELEASE states, writers' tokens, PENDING and lease expiry, LRU eviction under pressure and by the
watermark and operator passes, pins, REMOVE of a pinned page, placement over nodes, DRAIN and a dropped node, and
the invariant check after each. The table's own tests: test_columns.py (against an exact LRU model),
test_tabledir.py, test_tablenodes.py, test_tableload.py, test_tablerecords.py."""

from __future__ import annotations

import itertools
import random

from metaserver.table import queries
from metaserver.table.entry import EXISTS, IN_FLIGHT, NEW, NO_SPACE, PENDING, READY, Effects
from metaserver.table.records import pages_of
from metaserver.table.directory import TableDirectory
from transport.objformat import ALIGN, ARENA_DATA_START, object_size

from tablekit import etcd_pages, named, write

PAGE = ALIGN - 64  # payload that fills exactly one 4 KiB unit with its header
_GENS = itertools.count(1)


def make(units=8, nodes=("n1",), **kw) -> TableDirectory:
    d = TableDirectory(**kw)
    for n in nodes:
        d.add_space(n, units * ALIGN)
    return d


def put(d, ns, keys, now=0.0, gen=None, parents=None, size=PAGE):
    """ALLOC ``keys`` and COMMIT the new ones: (items, ALLOC effects, COMMIT effects)."""
    gen = gen if gen is not None else next(_GENS) * 1000
    items, fx = d.alloc(ns, keys, [size] * len(keys), parents, gen, now)
    news = [(k, it[4]) for k, it in zip(keys, items) if it[0] == NEW]
    ok, cfx = d.commit(ns, [k for k, _ in news], [g for _, g in news], now)
    assert all(ok)
    return items, fx, cfx


def state(d, ns, key):
    """The row state of ``key`` (entry.PENDING or READY), None when absent."""
    r = int(d._find(ns, [key])[0])
    return None if r < 0 else int(d.cols["state"][r])


def pins(d, ns, key) -> int:
    return int(d.cols["pins"][d._find(ns, [key])[0]])


def rec_keys(rec) -> list:
    """The keys a commit record would be written with now ([] : deleted)."""
    v = rec.value()
    return [] if v is None else [p[0] for p in pages_of(v)]


def test_alloc_commit_exists_lookup():
    d = make()
    items, fx = d.alloc("m", [b"a", b"b"], [10, PAGE], None, 100, 0.0)
    assert [it[0] for it in items] == [NEW, NEW]
    assert items[0][1] == "n1" and items[0][3] == 10 and items[0][4] == 100 and items[1][4] == 101
    assert {items[0][2], items[1][2]} == {ARENA_DATA_START, ARENA_DATA_START + ALIGN}
    assert d.pending == 2 and d.objects == 0 and not fx
    assert d.exists("m", [b"a", b"b", b"c"]) == [False, False, False]  # PENDING is not visible
    ok, cfx = d.commit("m", [b"a", b"b"], [100, 999], 1.0)
    assert ok == [True, False]  # wrong generation
    assert [rec_keys(r) for r in cfx.recs] == [[b"a"]]
    assert d.exists("m", [b"a", b"b"]) == [True, False]
    assert d.pending == 1 and d.objects == 1 and d.puts == 1
    assert state(d, "m", b"a") == READY and state(d, "m", b"b") == PENDING
    lease, locs = d.lookup("m", [b"a", b"zz"], 2.0)
    assert lease > 0 and locs == [("n1", items[0][2], 10, 100), None]
    assert d.hits == 1 and d.misses == 1 and d.pinned == 1
    assert d.release(lease) and not d.release(lease)
    assert d.pinned == 0
    d.check()


def test_dedup_within_and_across_batches():
    d = make()
    items, _ = d.alloc("m", [b"k", b"k"], [1, 1], None, 1, 0.0)
    assert [it[0] for it in items] == [NEW, EXISTS]
    assert items[1][1:] == (None, None, None, None)
    items2, _ = d.alloc("m", [b"k"], [1], None, 5, 0.0)
    assert items2[0][0] == IN_FLIGHT  # PENDING for another writer: "in flight", not "exists"
    assert d.commit("m", [b"k"], [items[0][4]], 0.0)[0] == [True]
    items2, _ = d.alloc("m", [b"k"], [1], None, 5, 0.0)
    assert items2[0][0] == EXISTS  # READY now
    items3, _ = d.alloc("other", [b"k"], [1], None, 6, 0.0)
    assert items3[0][0] == NEW  # namespaces are separate
    assert d.pending == 1
    d.check()


def test_alloc_with_the_same_token_is_idempotent_and_others_see_in_flight():
    d = make()
    first, _ = d.alloc("m", [b"a", b"b"], [10, 20], None, 1, 0.0, token=77)
    again, _ = d.alloc("m", [b"a", b"b", b"c"], [10, 20, 5], None, 9, 0.0, token=77)  # the lost answer, retried
    assert again[:2] == first and again[2][0] == NEW
    other, _ = d.alloc("m", [b"a"], [10], None, 20, 0.0, token=78)
    assert other[0][0] == IN_FLIGHT
    resized, _ = d.alloc("m", [b"a"], [11], None, 21, 0.0, token=77)  # same token, other size: not the same put
    assert resized[0][0] == IN_FLIGHT
    assert d.abort("m", [b"a"], [first[0][4]]) == 1  # the writer went away
    after, _ = d.alloc("m", [b"a"], [10], None, 30, 0.0, token=78)
    assert after[0][0] == NEW and after[0][4] == 30
    d.check()


def test_no_space_when_everything_pending():
    d = make(units=4)
    items, fx = d.alloc("m", [b"%d" % i for i in range(6)], [PAGE] * 6, None, 1, 0.0)
    assert [it[0] for it in items] == [NEW] * 4 + [NO_SPACE] * 2  # PENDING is never evicted
    assert d.used == d.capacity == 4 * ALIGN and d.evictions == 0 and not fx
    d.check()


def test_alloc_evicts_lru_on_pressure():
    d = make(units=4)
    _, _, cfx = put(d, "m", [b"a", b"b", b"c", b"d"], now=0.0)
    (rec,) = cfx.recs
    lease, _ = d.lookup("m", [b"a"], 1.0)  # a pinned: not evictable
    d.release(lease)  # ... released again: a is now the most recent
    items, fx = d.alloc("m", [b"e", b"f"], [PAGE, PAGE], None, 50, 2.0)
    assert [it[0] for it in items] == [NEW, NEW]
    assert d.evictions == 2 and fx.batches == [rec]  # LRU order: b, c went; a was touched
    assert rec_keys(rec) == [b"a", b"d"]  # their record is rewritten without them
    assert d.exists("m", [b"a", b"b", b"c", b"d"]) == [True, False, False, True]
    d.check()


def test_pins_block_eviction():
    d = make(units=2)
    put(d, "m", [b"a", b"b"])
    lease, locs = d.lookup("m", [b"a", b"b"], 1.0)
    assert None not in locs
    items, fx = d.alloc("m", [b"c"], [PAGE], None, 9, 2.0)
    assert items[0][0] == NO_SPACE and not fx
    fx2 = Effects()
    assert d.evict_all(100, fx2) == (0, 0, True) and not fx2
    d.release(lease)
    items, fx = d.alloc("m", [b"c"], [PAGE], None, 9, 3.0)
    assert items[0][0] == NEW and d.exists("m", [b"a", b"b"]) == [False, True] and len(fx.batches) == 1
    d.check()


def test_remove_pinned_frees_space_at_last_unpin():
    d = make(units=2)
    _, _, cfx = put(d, "m", [b"a", b"b"])
    lease, _ = d.lookup("m", [b"a"], 1.0)
    removed, fx = d.remove("m", [b"a", b"nope"])
    assert removed == [True, False] and fx.batches == cfx.recs and rec_keys(fx.batches[0]) == [b"b"]
    assert d.exists("m", [b"a"]) == [False]
    assert d.used == 2 * ALIGN  # the reader still holds a's bytes
    d.check()
    d.release(lease)
    assert d.used == ALIGN and d.pinned == 0
    d.check()


def test_abort_and_pending_expiry():
    d = make(units=8, pending_ttl_s=5.0)
    d.alloc("m", [b"a", b"b", b"c"], [PAGE] * 3, None, 10, 0.0)
    assert d.abort("m", [b"a", b"b"], [10, 999]) == 1
    assert d.pending == 2 and d.used == 2 * ALIGN
    d.commit("m", [b"c"], [12], 1.0)
    assert d.expire_pending(4.9, 100) == 0
    assert d.expire_pending(5.1, 100) == 1  # b expired; c is READY and stays
    assert d.pending == 0 and d.used == ALIGN
    ok, _ = d.commit("m", [b"b"], [11], 6.0)
    assert ok == [False]
    d.check()


def test_read_lease_expiry_unpins():
    d = make(read_lease_s=2.0)
    put(d, "m", [b"a"])
    lease, _ = d.lookup("m", [b"a"], 10.0)
    assert d.expire_leases(11.0, 100) == 0 and d.pinned == 1
    assert d.expire_leases(12.5, 100) == 1 and d.pinned == 0
    assert not d.release(lease)
    d.check()


def test_prefix_and_exists_do_not_pin_or_touch():
    d = make(units=3)
    put(d, "m", [b"a", b"b"], now=0.0)
    assert queries.prefix(d, "m", [b"a", b"b", b"c", b"a"]) == 2
    assert queries.prefix(d, "m", [b"x", b"a"]) == 0
    assert d.exists("m", [b"b"]) == [True] and d.pinned == 0
    put(d, "m", [b"c"], now=1.0)
    d.alloc("m", [b"d"], [PAGE], None, 77, 2.0)
    assert d.exists("m", [b"a", b"b", b"c"]) == [False, True, True]  # exists/prefix did not refresh a


def test_spread_across_nodes_and_set_placeable():
    d = make(units=4, nodes=("n1", "n2"))
    items, _ = d.alloc("m", [b"%d" % i for i in range(4)], [PAGE] * 4, None, 1, 0.0)
    nodes = [it[1] for it in items]
    assert nodes.count("n1") == 2 and nodes.count("n2") == 2
    d.set_placeable("n2", False)
    items, _ = d.alloc("m", [b"x", b"y"], [PAGE] * 2, None, 9, 0.0)
    assert [it[1] for it in items] == ["n1", "n1"]
    d.check()


def test_a_batch_spreads_over_the_nodes_and_keys_present_take_no_extent():
    """A batch's share of each node; a request whose later keys exist holds exactly the new pages' extents."""
    d = make(units=200, nodes=("n1", "n2"))
    keys = [b"k%d" % i for i in range(96)]
    items, _ = d.alloc("m", keys, [PAGE] * 96, None, 1, 0.0)
    assert [it[1] for it in items].count("n1") == 48
    assert all(d.commit("m", keys, [it[4] for it in items], 1.0)[0])
    more = [b"new0"] + keys[:40]
    items2, _ = d.alloc("m", more, [PAGE] * len(more), None, 500, 2.0)
    assert items2[0][0] == NEW and [it[0] for it in items2[1:]] == [EXISTS] * 40
    assert d.used == 97 * ALIGN
    d.check()


def test_drop_space_and_drain():
    d = named(make(units=4, nodes=("n1", "n2")))
    keys = [b"%d" % i for i in range(6)]
    items, _, cfx = put(d, "m", keys)
    on_n2 = [k for k, it in zip(keys, items) if it[1] == "n2"]
    lease, _ = d.lookup("m", [on_n2[0]], 1.0)
    dropped, pinned, fx = d.drain("n2")
    assert (dropped, pinned) == (len(on_n2) - 1, 1)
    assert fx.batches == cfx.recs, "its put waits unsent: the record is written without the drained pages"
    etcd: dict = {}
    write(etcd, fx.batches)
    assert sorted(etcd_pages(etcd)) == sorted(set(keys) - set(on_n2[1:]))
    d.check()
    n, fx = d.drop_space("n2")
    (dl,) = fx.batches
    assert n == 1 and dl.id == 0 and dl is not cfx.recs[0], "a page of a record in etcd: a dead list names it"
    write(etcd, fx.batches)
    assert len(etcd) == 2 and sorted(etcd_pages(etcd)) == [k for k in keys if k not in on_n2]
    assert d.capacity == 4 * ALIGN and d.used == 3 * ALIGN
    d.release(lease)  # space of a dead node: nothing to free, no error
    assert d.pinned == 0
    d.check()


def test_watermark_pass_and_evict_bytes():
    d = make(units=10)
    put(d, "m", [b"%d" % i for i in range(10)], now=0.0)
    fx = Effects()
    assert d.watermark_pass(0.95, 0.85, 100, fx) == (2, 2 * ALIGN)  # 100% -> 80% (<= 85%)
    assert d.exists("m", [b"0", b"1", b"2"]) == [False, False, True]
    assert rec_keys(fx.batches[0]) == [b"%d" % i for i in range(2, 10)]
    assert d.watermark_pass(0.95, 0.85, 100, Effects()) == (0, 0)  # below high: nothing to do
    assert d.evict_bytes(ALIGN + 1, 100, Effects()) == (2, 2 * ALIGN)
    n, freed, done = d.evict_all(3, Effects())
    assert (n, done) == (3, False)
    n, freed, done = d.evict_all(100, Effects())
    assert (n, done) == (3, True) and d.used == 0 and d.evictions == 10
    d.check()


def test_mixed_sizes_evict_until_contiguous_fit():
    d = make(units=8)
    put(d, "m", [b"%d" % i for i in range(8)], now=0.0)
    items, fx = d.alloc("m", [b"big"], [3 * ALIGN], None, 99, 1.0)  # 4 units: evicts the 4 oldest
    assert items[0][0] == NEW and d.evictions == 4
    assert d.exists("m", [b"%d" % i for i in range(8)]) == [False] * 4 + [True] * 4
    assert d.used == 8 * ALIGN
    d.check()


def test_too_large_for_any_node_is_no_space_and_evicts_nothing():
    d = make(units=4)
    items, fx = d.alloc("m", [b"x"], [5 * ALIGN], None, 1, 0.0)
    assert items[0][0] == NO_SPACE and d.evictions == 0
    put(d, "m", [b"a", b"b"])
    items, fx = d.alloc("m", [b"x"], [5 * ALIGN], None, 2, 1.0)
    assert items[0][0] == NO_SPACE and d.evictions == 0 and d.exists("m", [b"a", b"b"]) == [True, True]
    d.check()


def test_a_page_too_large_for_one_node_goes_to_one_it_fits():
    d = TableDirectory()
    d.add_space("small", 2 * ALIGN)
    d.add_space("big", 16 * ALIGN)
    put(d, "m", [b"a", b"b"])
    items, _ = d.alloc("m", [b"x", b"y"], [5 * ALIGN, 5 * ALIGN], None, 10, 1.0)
    assert [it[:2] for it in items] == [(NEW, "big"), (NEW, "big")] and d.evictions == 0
    d.check()


def test_used_never_exceeds_capacity_under_churn():
    rng = random.Random(3)
    d = make(units=64, nodes=("a", "b", "c"))
    live_leases = []
    for step in range(400):
        keys = [b"k%d" % rng.randrange(300) for _ in range(rng.randrange(1, 8))]
        sizes = [rng.choice([10, PAGE, 2 * ALIGN, 5 * ALIGN]) for _ in keys]
        items, _ = d.alloc("ns", keys, sizes, None, 10_000 + step * 10, float(step))
        news = [(k, it[4]) for k, it in zip(keys, items) if it[0] == NEW]
        if rng.random() < 0.8:
            d.commit("ns", [k for k, _ in news], [g for _, g in news], float(step))
        if rng.random() < 0.3:
            lease, _ = d.lookup("ns", keys, float(step))
            live_leases.append(lease)
        if live_leases and rng.random() < 0.3:
            d.release(live_leases.pop(0))
        if rng.random() < 0.1:
            d.remove("ns", keys[:1])
        d.expire_pending(float(step) - 20 + d.pending_ttl_s, 50)
        assert d.used <= d.capacity
        if step % 50 == 0:
            d.check()
    for lease in live_leases:
        d.release(lease)
    d.check()
    assert d.pinned == 0
    listed, more = queries.list_objects(d, None, 10_000)
    assert not more and d.used == sum(object_size(plen) for _ns, _k, plen, _n, _s in listed)


def test_commit_is_idempotent_for_the_same_generation():
    # A COMMIT retried after its answer was lost (or after a failover that loaded the commit from etcd) must report
    # success again; another generation of the key must not.
    d = make()
    d.alloc("m", [b"a"], [10], None, 100, 0.0)
    ok, fx = d.commit("m", [b"a"], [100], 1.0)
    assert ok == [True] and len(fx.recs) == 1
    ok, fx = d.commit("m", [b"a"], [100], 2.0)
    assert ok == [True] and not fx  # nothing new to persist
    ok, _ = d.commit("m", [b"a", b"zz"], [101, 100], 2.0)
    assert ok == [False, False]
    assert d.objects == 1 and d.puts == 1
    d.check()


def test_chains_from_one_shared_prefix_spread_over_nodes():
    """Every chain descends from one root page (a shared system prompt): children stay on their parent's node only
    while it has at least half the free space of the emptiest node, so both nodes fill."""
    d = make(units=16, nodes=("n1", "n2"))
    put(d, "m", [b"root"])
    for i in range(20):  # 21 pages in 32 units: with pure parent affinity all would sit on one node
        put(d, "m", [b"c%d" % i], now=float(i), parents=[b"root"])
    used = {n: sp.alloc.used for n, sp in d.spaces.items()}
    assert min(used.values()) >= 8 * ALIGN, used  # both nodes carry a fair share
    d.check()


def test_a_full_pool_evicts_one_victim_per_new_page_in_lru_order():
    d = make(units=16, nodes=("n1", "n2"))
    for i in range(32):
        put(d, "m", [b"old%d" % i], now=float(i))
    assert d.used == d.capacity and d.evictions == 0
    items, fx = d.alloc("m", [b"new%d" % i for i in range(10)], [PAGE] * 10, None, 500, 100.0)
    assert [it[0] for it in items] == [NEW] * 10
    # one victim per page, the least recently used of the node it goes to (in turn: the ten oldest here)
    olds = [b"old%d" % i for i in range(32)]
    assert d.evictions == 10 and d.exists("m", olds) == [False] * 10 + [True] * 22
    (rec,) = fx.batches  # the 32 COMMITs joined one open segment (no writer took it): rewritten without the ten
    assert sorted(p[0] for p in pages_of(rec.value())) == sorted(olds[10:])
    d.check()


def test_list_objects_covers_pending_and_ready():
    d = make(units=8)
    d.alloc("m", [b"a", b"b"], [PAGE, PAGE], None, 10, 0.0)
    d.commit("m", [b"a"], [10], 0.0)
    listed, more = queries.list_objects(d, "m", 10)
    assert sorted(listed) == [("m", b"a", PAGE, "n1", "READY"), ("m", b"b", PAGE, "n1", "PENDING")] and not more
    assert queries.list_objects(d, "m", 1) == (listed[:1], True) and queries.list_objects(d, "x", 10) == ([], False)
    assert d.remove("m", [b"a", b"b"])[0] == [True, True]
    assert queries.list_objects(d, None, 10) == ([], False) and d.namespace_usage() == {} and d.used == 0
    d.check()


def test_a_put_of_a_page_already_here_counts_as_a_use():
    """ALLOC answering EXISTS refreshes the page's recency (the engine holds it in a live context); a pinned page
    keeps its new recency for when its lease ends."""
    d = make(units=4)
    put(d, "m", [b"a", b"b", b"c", b"d"], now=0.0)
    items, _ = d.alloc("m", [b"a"], [PAGE], None, 50, 1.0)  # dedup: nothing allocated
    assert [it[0] for it in items] == [EXISTS]
    items, fx = d.alloc("m", [b"e"], [PAGE], None, 60, 2.0)
    assert [it[0] for it in items] == [NEW] and d.exists("m", [b"a", b"b"]) == [True, False]
    lease, _ = d.lookup("m", [b"c"], 3.0)  # pinned: out of the victim order
    before = int(d.cols["stamp"][d._find("m", [b"c"])[0]])
    assert [it[0] for it in d.alloc("m", [b"c"], [PAGE], None, 70, 4.0)[0]] == [EXISTS]
    assert int(d.cols["stamp"][d._find("m", [b"c"])[0]]) > before and pins(d, "m", b"c") == 1
    d.release(lease)
    d.check()


def test_random_requests_keep_totals_prefix_runs_and_listings_true_to_the_rows():
    """Random ALLOC with and without a writer token, COMMIT with right and wrong generations, ABORT, LOOKUP and
    RELEASE, REMOVE and the budgeted expiries on a full node: every total, prefix run and listing agrees with the
    pages EXISTS and a LOOKUP see, and the paths were taken."""
    rng = random.Random(5)
    d = make(units=20, pending_ttl_s=5.0, read_lease_s=3.0)
    universe = [bytes([i]) * 32 for i in range(24)] + [b"key-%d" % i for i in range(16)]
    leases, pending = [], []
    gen, now, expired, retried = 1, 1000.0, 0, 0
    for step in range(300):
        now += rng.choice((0.01, 0.01, 0.5))
        op = rng.random()
        if op < 0.3:
            keys = [rng.choice(universe) for _ in range(rng.randint(1, 6))]
            items, _ = d.alloc("a", keys, [PAGE] * len(keys), None, gen, now, rng.choice((None, 7, 8)), "w")
            retried += sum(1 for k, it in zip(keys, items) if it[0] == NEW and (k, it[4]) in pending)
            pending += [(k, it[4]) for k, it in zip(keys, items) if it[0] == NEW]
            gen += len(keys)
        elif op < 0.5 and pending:
            batch = rng.sample(pending, min(len(pending), rng.randint(1, 4)))
            d.commit("a", [k for k, _ in batch], [g if rng.random() < 0.85 else g + 1 for _, g in batch], now)
            pending = [p for p in pending if p not in batch]
        elif op < 0.55 and pending:
            batch = rng.sample(pending, min(len(pending), 2))
            d.abort("a", [k for k, _ in batch], [g for _, g in batch])
            pending = [p for p in pending if p not in batch]
        elif op < 0.75:
            keys = [rng.choice(universe) for _ in range(rng.randint(1, 8))]
            ok = d.exists("a", keys)
            lease, locs = d.lookup("a", keys, now, "r")
            assert [x is not None for x in locs] == ok and (lease == 0) == (not any(ok)), step
            if lease:
                leases.append(lease)
        elif op < 0.88 and leases:
            d.release(leases.pop(rng.randrange(len(leases))), "r")  # False when it expired already
        elif op < 0.95:
            d.remove("a", rng.sample(universe, rng.randint(1, 3)))
        else:
            expired += d.expire_leases(now, 3) + d.expire_pending(now, 3)
        here = d.exists("a", universe)
        probe = [rng.choice(universe) for _ in range(6)]
        run = d.exists("a", probe)
        assert queries.prefix(d, "a", probe) == (run.index(False) if False in run else len(run)), step
        listed, more = queries.list_objects(d, "a", 1000)
        assert not more and sorted(k for _, k, _, _, s in listed if s == "READY") == sorted(
            k for k, ok in zip(universe, here) if ok), step
        assert d.objects == sum(here) and d.pending == sum(1 for x in listed if x[4] == "PENDING"), step
        use = d.namespace_usage().get("a", {"objects": 0, "used_bytes": 0})
        assert (use["objects"], use["used_bytes"]) == (d.objects, len(listed) * ALIGN), step
        assert len(queries.list_objects(d, None, 3)[0]) == min(3, d.objects + d.pending)
        assert d.used <= d.capacity
    d.check()
    assert d.evictions > 20 and expired and retried, (d.evictions, expired, retried)  # the paths were taken
