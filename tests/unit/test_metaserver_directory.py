"""Directory-only cases waiting for their port to the columnar directory (``metaserver.tabledir.TableDirectory``):
prefix-lru eviction, prefix links and orphans, a warm standby's ``put_ready`` (H2's port: tests/unit/test_tablelinks.py).
Namespace quotas run on the table in test_quota_rules.py. Everything else these files held runs on the table in
test_directory.py, test_directory_work.py and test_directory_shared.py. Goes with ``Directory``."""

from metaserver.directory import EXISTS, NEW, READY, Directory, Effects
from transport.wire import ALIGN, ARENA_DATA_START

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


def test_a_put_of_a_page_already_here_counts_as_a_use_under_prefix_lru():
    """ALLOC answering EXISTS refreshes the page's recency under prefix-lru too (lru: test_directory.py)."""
    d = make(units=4, policy="prefix-lru")
    put(d, "m", [b"a", b"b", b"c", b"d"], now=0.0)
    items, _ = d.alloc("m", [b"a"], [PAGE], None, 50, 1.0)  # dedup: nothing allocated
    assert [it[0] for it in items] == [EXISTS]
    items, fx = d.alloc("m", [b"e"], [PAGE], None, 60, 2.0)
    assert [it[0] for it in items] == [NEW] and fx.deletes == [("m", b"b")], fx.deletes
    lease, _ = d.lookup("m", [b"c"], 3.0)  # pinned: out of the victim order
    assert [it[0] for it in d.alloc("m", [b"c"], [PAGE], None, 70, 4.0)[0]] == [EXISTS]
    assert d.entries["m"][b"c"].last_access == 4.0
    d.release(lease)
    d.check()
