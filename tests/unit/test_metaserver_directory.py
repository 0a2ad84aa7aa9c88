"""Unit tests of the page directory and eviction policies (pure bookkeeping, no I/O)."""

from metaserver.directory import EXISTS, IN_FLIGHT, NEW, NO_SPACE, PENDING, READY, Directory, Effects
from transport.wire import ALIGN, ARENA_DATA_START, object_size

PAGE = ALIGN - 64  # payload that fills exactly one 4 KiB unit with its header


def make(units=8, nodes=("n1",), policy="lru", **kw):
    d = Directory(policy=policy, **kw)
    for n in nodes:
        d.add_space(n, units * ALIGN)
    return d


def put(d, ns, keys, now=0.0, gen=None, parents=None, size=PAGE):
    gen = gen if gen is not None else 1000 + d.puts * 10 + len(d.entries.get(ns, {}))
    items, fx = d.alloc(ns, keys, [size] * len(keys), parents, gen, now)
    news = [(k, it[4]) for k, it in zip(keys, items) if it[0] == NEW]
    ok, cfx = d.commit(ns, [k for k, _ in news], [g for _, g in news], now)
    assert all(ok)
    return items, fx, cfx


def test_alloc_commit_exists_lookup():
    d = make()
    items, fx = d.alloc("m", [b"a", b"b"], [10, PAGE], None, 100, 0.0)
    assert [it[0] for it in items] == [NEW, NEW]
    assert items[0][1] == "n1" and items[0][3] == 10 and items[0][4] == 100 and items[1][4] == 101
    assert {items[0][2], items[1][2]} == {ARENA_DATA_START, ARENA_DATA_START + ALIGN}
    assert d.pending == 2 and d.objects == 0
    assert d.exists("m", [b"a", b"b", b"c"]) == [False, False, False]  # PENDING is not visible
    ok, cfx = d.commit("m", [b"a", b"b"], [100, 999], 1.0)
    assert ok == [True, False]  # wrong generation
    assert [e.key for e in cfx.puts] == [b"a"]
    assert d.exists("m", [b"a", b"b"]) == [True, False]
    assert d.pending == 1 and d.objects == 1 and d.puts == 1
    assert d.entries["m"][b"a"].state == READY and d.entries["m"][b"b"].state == PENDING
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
    put(d, "m", [b"a", b"b", b"c", b"d"], now=0.0)
    lease, _ = d.lookup("m", [b"a"], 1.0)  # a pinned: not evictable
    d.release(lease)  # ... released again: a is now the most recent
    items, fx = d.alloc("m", [b"e", b"f"], [PAGE, PAGE], None, 50, 2.0)
    assert [it[0] for it in items] == [NEW, NEW]
    assert sorted(fx.deletes) == [("m", b"b"), ("m", b"c")]  # LRU order: b, c went; a was touched
    assert d.evictions == 2
    assert d.exists("m", [b"a", b"b", b"c", b"d"]) == [True, False, False, True]
    d.check()


def test_pins_block_eviction():
    d = make(units=2)
    put(d, "m", [b"a", b"b"])
    lease, locs = d.lookup("m", [b"a", b"b"], 1.0)
    assert None not in locs
    items, fx = d.alloc("m", [b"c"], [PAGE], None, 9, 2.0)
    assert items[0][0] == NO_SPACE and not fx.deletes
    fx2 = Effects()
    assert d.evict_all(100, fx2) == (0, 0, True)
    d.release(lease)
    items, fx = d.alloc("m", [b"c"], [PAGE], None, 9, 3.0)
    assert items[0][0] == NEW and fx.deletes == [("m", b"a")]
    d.check()


def test_remove_pinned_frees_space_at_last_unpin():
    d = make(units=2)
    put(d, "m", [b"a", b"b"])
    lease, _ = d.lookup("m", [b"a"], 1.0)
    removed, fx = d.remove("m", [b"a", b"nope"])
    assert removed == [True, False] and fx.deletes == [("m", b"a")]
    assert d.exists("m", [b"a"]) == [False]
    assert d.used == 2 * ALIGN  # the reader still holds a's bytes
    d.check()
    d.release(lease)
    assert d.used == ALIGN and d.pinned == 0
    d.check()


def test_abort_and_pending_expiry():
    d = make(units=8, pending_ttl_s=5.0)
    items, _ = d.alloc("m", [b"a", b"b", b"c"], [PAGE] * 3, None, 10, 0.0)
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
    assert d.prefix("m", [b"a", b"b", b"c", b"a"]) == 2
    assert d.prefix("m", [b"x", b"a"]) == 0
    assert d.exists("m", [b"b"]) == [True] and d.pinned == 0
    put(d, "m", [b"c"], now=1.0)
    items, fx = d.alloc("m", [b"d"], [PAGE], None, 77, 2.0)
    assert fx.deletes == [("m", b"a")]  # exists/prefix did not refresh a


def test_spread_across_nodes_by_free_space():
    d = make(units=4, nodes=("n1", "n2"))
    items, _ = d.alloc("m", [b"%d" % i for i in range(4)], [PAGE] * 4, None, 1, 0.0)
    nodes = [it[1] for it in items]
    assert nodes.count("n1") == 2 and nodes.count("n2") == 2
    d.set_placeable("n2", False)
    items, _ = d.alloc("m", [b"x", b"y"], [PAGE] * 2, None, 9, 0.0)
    assert [it[1] for it in items] == ["n1", "n1"]
    d.check()


def test_drop_space_and_drain():
    d = make(units=4, nodes=("n1", "n2"))
    put(d, "m", [b"%d" % i for i in range(6)])
    on_n2 = [e.key for e in d.spaces["n2"].entries]
    lease, _ = d.lookup("m", [on_n2[0]], 1.0)
    dropped, pinned, fx = d.drain("n2")
    assert (dropped, pinned) == (len(on_n2) - 1, 1)
    assert len(fx.deletes) == dropped
    d.check()
    n, fx = d.drop_space("n2")
    assert n == 1 and fx.deletes == [("m", on_n2[0])]
    assert d.capacity == 4 * ALIGN and d.used == 3 * ALIGN
    d.release(lease)  # space of a dead node: nothing to free, no error
    assert d.pinned == 0
    d.check()


def test_watermark_pass_and_evict_bytes():
    d = make(units=10)
    put(d, "m", [b"%d" % i for i in range(10)], now=0.0)
    fx = Effects()
    assert d.watermark_pass(0.95, 0.85, 100, fx) == (2, 2 * ALIGN)  # 100% -> 80% (<= 85%)
    assert fx.deletes == [("m", b"0"), ("m", b"1")]
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
    assert items[0][0] == NEW and len(fx.deletes) == 4
    assert d.spaces["n1"].entries and d.used == 8 * ALIGN
    d.check()


def test_too_large_for_any_node_is_no_space():
    d = make(units=4)
    items, fx = d.alloc("m", [b"x"], [5 * ALIGN], None, 1, 0.0)
    assert items[0][0] == NO_SPACE and d.evictions == 0


def test_prefix_lru_evicts_leaves_before_parents():
    d = make(units=4, policy="prefix-lru")
    put(d, "m", [b"root"], now=0.0)
    put(d, "m", [b"child"], now=1.0, parents=[b"root"])
    put(d, "m", [b"leaf1", b"leaf2"], now=2.0)
    assert d.spaces["n1"].entries and d.ready["m"][b"root"].children == 1
    fx = Effects()
    d.evict_node("n1", 2 * ALIGN, 10, fx)
    # root is the oldest but has a cached child: the child (older than the leaves) goes first; root then becomes
    # a leaf with its own (oldest) recency and goes next, before the younger leaves.
    assert [k for _, k in fx.deletes] == [b"child", b"root"]
    d.check()
    assert set(d.ready["m"]) == {b"leaf1", b"leaf2"}


def test_prefix_lru_orphans_go_first_and_a_returning_parent_adopts_them():
    d = make(units=8, policy="prefix-lru")
    put(d, "m", [b"old1", b"old2"], now=0.0)
    put(d, "m", [b"p"], now=1.0)
    put(d, "m", [b"c"], now=2.0, parents=[b"p"])
    assert d.ready["m"][b"p"].children == 1
    removed, fx = d.remove("m", [b"p"])
    assert removed == [True] and d.ready["m"][b"c"].parent_ref is None
    fx = Effects()
    d.evict_node("n1", ALIGN, 10, fx)
    assert [k for _, k in fx.deletes] == [b"c"]  # newest, but orphaned: unreachable by prefix match
    put(d, "m", [b"c2"], now=3.0, parents=[b"p2"])  # its parent is not cached yet: an orphan
    put(d, "m", [b"p2"], now=4.0)  # the parent arrives and adopts it
    assert d.ready["m"][b"p2"].children == 1 and d.ready["m"][b"c2"].parent_ref is d.ready["m"][b"p2"]
    fx = Effects()
    d.evict_node("n1", 2 * ALIGN, 10, fx)
    assert [k for _, k in fx.deletes] == [b"old1", b"old2"]
    d.check()


def test_used_never_exceeds_capacity_under_churn():
    import random
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
    expected_used = sum(object_size(e.payload_len) for sp in d.spaces.values() for e in sp.entries)
    assert d.used == expected_used


def test_load_pages_rebuilds_and_rejects_overlaps():
    d = make(units=8)
    base = ARENA_DATA_START
    fx = d.load_pages("n1", [("m", b"a", base, PAGE, 5, None), ("m", b"b", base, PAGE, 6, None),
                             ("m", b"c", base + ALIGN, PAGE, 7, b"a")])
    assert fx.deletes == [("m", b"b")]
    assert d.exists("m", [b"a", b"b", b"c"]) == [True, False, True]
    assert d.used == 2 * ALIGN and d.ready["m"][b"a"].children == 1
    items, fx = d.alloc("m", [b"d"], [PAGE], None, 100, 0.0)
    assert items[0][2] == base + 2 * ALIGN
    d.check()


def test_commit_is_idempotent_for_the_same_generation():
    # A COMMIT retried after its answer was lost (or after a failover that loaded the commit from etcd) must report
    # success again; another generation of the key must not.
    d = make()
    items, _ = d.alloc("m", [b"a"], [10], None, 100, 0.0)
    ok, fx = d.commit("m", [b"a"], [100], 1.0)
    assert ok == [True] and len(fx.puts) == 1
    ok, fx = d.commit("m", [b"a"], [100], 2.0)
    assert ok == [True] and not fx  # nothing new to persist
    ok, _ = d.commit("m", [b"a", b"zz"], [101, 100], 2.0)
    assert ok == [False, False]
    assert d.objects == 1 and d.puts == 1
    d.check()


def test_chains_from_one_shared_prefix_spread_over_nodes_and_evict_the_older_node_first():
    """Every chain descends from one root page (a shared system prompt): children stay on their parent's node only
    while it has at least half the free space of the emptiest node, so both nodes fill; once full, eviction goes
    where the least recently used victim is."""
    d = make(units=16, nodes=("n1", "n2"))
    put(d, "m", [b"root"])
    for i in range(20):  # 21 pages in 32 units: with pure parent affinity all would sit on one node
        put(d, "m", [b"c%d" % i], now=float(i), parents=[b"root"])
    used = {n: sp.alloc.used for n, sp in d.spaces.items()}
    assert min(used.values()) >= 8 * ALIGN, used  # both nodes carry a fair share
    # fill both, then one more page: the victim is the globally least recently used child, wherever it lives
    i = 20
    while any(_free for _free in (sp.alloc.units - sp.alloc.used_units for sp in d.spaces.values())):
        put(d, "m", [b"c%d" % i], now=100.0 + i, parents=[b"root"])
        i += 1
    # use every page on the root's node again: the least recently used page now lives on the other node, which
    # is where a parent-first eviction would never look
    root_node = d.entries["m"][b"root"].node_id
    hot = [e.key for e in d.entries["m"].values() if e.node_id == root_node]
    lease, _ = d.lookup("m", hot, 500.0)
    d.release(lease)
    oldest = min(d.entries["m"].values(), key=lambda e: e.last_access)
    assert oldest.node_id != root_node
    items, fx = d.alloc("m", [b"new"], [PAGE], [b"root"], 99_999, 1000.0)
    assert items[0][0] == NEW and [k for _, k in fx.deletes] == [oldest.key]
    d.check()


def test_a_page_shares_its_parents_key_its_size_and_its_namespace():
    # What keeps a page near 300 bytes: a child holds its parent's own key object, pages of one size share one int,
    # a namespace is one string, committed pages leave no pending record behind, the allocator keeps no copy.
    d = make(units=8)
    put(d, "m", [b"a"], now=0.0)
    ns2 = "".join(["m"])  # another str object with the same value, as every decoded request brings
    put(d, ns2, [b"b", b"c"], now=1.0, parents=[bytes(b"a"), b"b"])
    a, b, c = (d.ready["m"][k] for k in (b"a", b"b", b"c"))
    assert b.parent is a.key and c.parent is b.key and b.parent_ref is a and c.parent_ref is b
    assert a.payload_len is b.payload_len is c.payload_len
    assert a.ns is b.ns is c.ns
    assert a.children == b.children == 1 and c.children == 0
    assert d.pending == 0 and not d._pending and not d.pending_keys
    assert d.spaces["n1"].alloc._allocated is None and len(d.spaces["n1"].entries) == 3
    d.check()


def test_entries_view_covers_pending_and_ready():
    d = make(units=8)
    items, _ = d.alloc("m", [b"a", b"b"], [PAGE, PAGE], None, 10, 0.0)
    d.commit("m", [b"a"], [10], 0.0)
    view = d.entries["m"]
    assert len(view) == 2 and b"a" in view and b"b" in view and b"c" not in view
    assert view[b"a"].state == READY and view.get(b"b").state == PENDING and view.get(b"c") is None
    assert sorted(view) == [b"a", b"b"] and list(d.entries) == ["m"]
    assert d.remove("m", [b"a", b"b"])[0] == [True, True]
    assert "m" not in d.entries and d.entries.get("m", {}) == {} and d.used == 0
    d.check()


def test_a_full_pool_evicts_one_victim_per_new_page_in_lru_order():
    d = make(units=16, nodes=("n1", "n2"))
    for i in range(32):
        put(d, "m", [b"old%d" % i], now=float(i))
    assert d.used == d.capacity and d.evictions == 0
    items, fx = d.alloc("m", [b"new%d" % i for i in range(10)], [PAGE] * 10, None, 500, 100.0)
    assert [it[0] for it in items] == [NEW] * 10
    # one victim per page, the globally least recently used first, whichever node it is on
    assert d.evictions == 10 and [k for _, k in fx.deletes] == [b"old%d" % i for i in range(10)]
    d.check()


def test_prefix_lru_cold_chain_loses_its_tail_first():
    d = make(units=8, policy="prefix-lru")
    put(d, "m", [b"a1", b"a2", b"a3"], now=0.0, parents=[None, b"a1", b"a2"])
    put(d, "m", [b"b1", b"b2", b"b3"], now=1.0, parents=[None, b"b1", b"b2"])
    fx = Effects()
    d.evict_node("n1", 3 * ALIGN, 10, fx)
    # each parent becomes a leaf with its own (old) recency, ahead of the hot chain's leaf
    assert [k for _, k in fx.deletes] == [b"a3", b"a2", b"a1"]
    d.check()


def test_prefix_lru_refiles_a_page_by_its_own_recency():
    d = make(units=8, policy="prefix-lru")
    put(d, "m", [b"l1"], now=0.0)
    put(d, "m", [b"p"], now=5.0)
    put(d, "m", [b"l2"], now=10.0)
    put(d, "m", [b"c"], now=20.0, parents=[b"p"])
    assert d.policy.tier_of(d.ready["m"][b"p"]) == 2
    d.remove("m", [b"c"])  # p is a leaf again: it sorts between l1 and l2, not after l2
    assert [e.key for e in d.policy.members("n1")] == [b"l1", b"p", b"l2"]
    fx = Effects()
    d.evict_node("n1", 3 * ALIGN, 10, fx)
    assert [k for _, k in fx.deletes] == [b"l1", b"p", b"l2"]
    d.check()


def test_orphans_across_nodes_are_adopted_when_the_parent_returns():
    d = make(units=4, nodes=("n1", "n2"), policy="prefix-lru")
    put(d, "m", [b"p"], now=0.0)
    p_node = d.ready["m"][b"p"].node_id
    other = "n2" if p_node == "n1" else "n1"
    d.set_placeable(p_node, False)
    put(d, "m", [b"c"], now=1.0, parents=[b"p"])  # on the other node, linked across nodes
    assert d.ready["m"][b"c"].node_id == other and d.ready["m"][b"c"].parent_ref is d.ready["m"][b"p"]
    n, fx = d.drop_space(p_node)
    assert n == 1 and fx.deletes == [("m", b"p")]
    c = d.ready["m"][b"c"]
    assert c.parent_ref is None and c.parent == b"p" and d.policy.tier_of(c) == 0 and d.orphans["m"][b"p"] is c
    d.check()
    put(d, "m", [b"p"], now=2.0)  # the parent is written again (on the remaining node): it adopts c
    assert c.parent_ref is d.ready["m"][b"p"] and d.ready["m"][b"p"].children == 1 and not d.orphans
    d.check()


def test_put_ready_places_a_persisted_page_at_its_extent():
    d = make(units=8, policy="prefix-lru")
    base = ARENA_DATA_START
    c = d.put_ready("n1", "m", b"c", base + ALIGN, PAGE, 7, b"p")  # its parent is not there yet: an orphan
    assert c is not None and c.state == READY and d.policy.tier_of(c) == 0
    p = d.put_ready("n1", "m", b"p", base, PAGE, 6, None)
    assert p is not None and c.parent_ref is p and p.children == 1
    assert d.put_ready("n1", "m", b"p", base + 2 * ALIGN, PAGE, 8, None) is None  # key present
    assert d.put_ready("n1", "m", b"x", base + ALIGN, PAGE, 9, None) is None  # extent taken
    assert d.put_ready("nope", "m", b"y", base + 3 * ALIGN, PAGE, 9, None) is None  # no such node
    assert d.objects == 2 and d.used == 2 * ALIGN and d.exists("m", [b"p", b"c"]) == [True, True]
    d.check()


def test_load_pages_drops_a_key_given_twice():
    d = make(units=8)
    base = ARENA_DATA_START
    fx = d.load_pages("n1", [("m", b"a", base, PAGE, 5, None), ("m", b"a", base + ALIGN, PAGE, 6, None)])
    assert fx.deletes == [("m", b"a")] and d.ready["m"][b"a"].gen == 5 and d.used == ALIGN
    d.check()


class _Node:
    __slots__ = ("prev", "next", "last_access", "tier")

    def __init__(self, t: float):
        self.prev = self.next = self.tier = None
        self.last_access = t


def test_ring_files_by_recency_within_a_bounded_walk(monkeypatch):
    from metaserver import eviction
    r = eviction.Ring()
    for i in range(10):
        r.push(_Node(float(i)))
    x = _Node(4.5)
    r.insert_by_access(x)
    assert r.count == 11 and r.members().index(x) == 5  # its exact place
    r.unlink(x)
    assert r.count == 10 and x.prev is None and x not in r.members()
    monkeypatch.setattr(eviction, "TIER_WALK", 2)
    r.insert_by_access(x)  # 5 steps from either end, the walk allows 2: placed 2 in from the old end
    members = r.members()
    assert r.count == 11 and len({id(m) for m in members}) == 11 and members.index(x) == 2
    r.clear()
    assert r.count == 0 and r.first() is None and x.prev is None


def test_one_placement_evicts_at_most_its_budget(monkeypatch):
    """A page that needs more victims than PLACE_EVICT_BUDGET gets NO_SPACE after exactly that many evictions
    (bounded work per request); the next request goes on from there and places it."""
    import metaserver.placement as placement

    monkeypatch.setattr(placement, "PLACE_EVICT_BUDGET", 5)
    d = make(units=16)
    for i in range(16):
        put(d, "m", [b"small%d" % i], now=float(i))
    big = 12 * ALIGN - 64  # needs 12 contiguous units: 12 victims in LRU order
    items, fx = d.alloc("m", [b"big"], [big], None, 500, 100.0)
    assert items[0][0] == NO_SPACE and len(fx.deletes) == 5 and d.evictions == 5
    items, fx = d.alloc("m", [b"big"], [big], None, 600, 101.0)
    assert items[0][0] == NO_SPACE and d.evictions == 10
    items, fx = d.alloc("m", [b"big"], [big], None, 700, 102.0)
    assert items[0][0] == NEW and d.evictions == 12
    assert d.exists("m", [b"small%d" % i for i in range(16)]) == [False] * 12 + [True] * 4
    d.check()


# -- hardening: lease ownership, allocation ownership, budgeted node drops, per-namespace quotas ----------------------


def test_a_put_of_a_page_already_here_counts_as_a_use():
    """ALLOC answering EXISTS refreshes the page's recency (the engine holds it in a live context), for both
    policies; a pinned page keeps its new recency for when its lease ends."""
    for policy in ("lru", "prefix-lru"):
        d = make(units=4, policy=policy)
        put(d, "m", [b"a", b"b", b"c", b"d"], now=0.0)
        items, _ = d.alloc("m", [b"a"], [PAGE], None, 50, 1.0)  # dedup: nothing allocated
        assert [it[0] for it in items] == [EXISTS]
        items, fx = d.alloc("m", [b"e"], [PAGE], None, 60, 2.0)
        assert [it[0] for it in items] == [NEW] and fx.deletes == [("m", b"b")], (policy, fx.deletes)
        lease, _ = d.lookup("m", [b"c"], 3.0)  # pinned: out of the victim order
        assert [it[0] for it in d.alloc("m", [b"c"], [PAGE], None, 70, 4.0)[0]] == [EXISTS]
        assert d.entries["m"][b"c"].last_access == 4.0
        d.release(lease)
        d.check()


def test_a_slot_links_only_the_parents_of_its_own_slot():
    """A partitioned pool's slot never sees a parent held by another slot: it drops such a parent at ALLOC, so
    under prefix-lru the page is ordinary (evicted by recency), not an orphan that goes first."""
    from metaserver.slots import SlotDirectory
    from transport.slotrules import slot_of

    d = SlotDirectory(1, 4, policy="prefix-lru")
    d.add_space("n1", 64 * ALIGN)
    mine = next(k for k in (b"p%d" % i for i in range(100)) if slot_of("m", k, 4) == 1)
    other = next(k for k in (b"p%d" % i for i in range(100)) if slot_of("m", k, 4) != 1)
    put(d, "m", [mine], now=0.0)
    put(d, "m", [b"kid-of-mine", b"kid-of-other"], now=1.0, parents=[mine, other])
    e = d.entries["m"]
    assert e[b"kid-of-mine"].parent == mine and e[b"kid-of-other"].parent is None
    assert d.policy.tier_of(e[b"kid-of-other"]) == 1 and d.policy.tier_of(e[mine]) == 2
    d.check()
