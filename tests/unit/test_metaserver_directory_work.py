"""Unit tests of the directory's ownership, quota and bounded-work bookkeeping (pure, no I/O): read leases owned
by their taker, a retried ALLOC moving its PENDING entry, a lost node dropped in budgeted slices, exact
per-namespace use and quota eviction, and evict_bytes ranking nodes without a scan per victim. The directory's
core (alloc, commit, lookup, eviction policies, links) is tested in test_metaserver_directory.py."""

from metaserver.directory import IN_FLIGHT, NEW, Effects
from transport.wire import ALIGN, ARENA_DATA_START, object_size

from test_metaserver_directory import PAGE, make, put  # noqa: F401  (helpers shared with the core tests)

def test_lease_ids_are_random_and_owned():
    d = make(units=64)
    put(d, "m", [b"a", b"b"])
    owner, other = object(), object()
    leases = [d.lookup("m", [b"a"], 1.0, owner)[0] for _ in range(50)]
    assert len(set(leases)) == 50 and all(0 < x < 1 << 63 for x in leases)
    assert max(leases) > 1 << 40  # not sequential small integers
    assert sorted(leases) != list(range(min(leases), min(leases) + 50))
    assert d.entries["m"][b"a"].pins == 50
    # another owner releasing them (ids leaked or guessed, or neighbours of them) changes nothing
    assert not any(d.release(x + k, other) for x in leases for k in (-1, 0, 1))
    assert d.entries["m"][b"a"].pins == 50 and d.pinned == 1
    d.check()
    assert all(d.release(x, owner) for x in leases)
    assert d.pinned == 0 and not d._lease_owner
    d.check()


def test_retried_alloc_moves_the_pending_entry_to_the_new_owner():
    d = make()
    old, new = object(), object()
    items, _ = d.alloc("m", [b"k"], [PAGE], None, 10, 0.0, token=77, owner=old)
    e = d.entries["m"][b"k"]
    assert d.writer_of(e) is old
    again, _ = d.alloc("m", [b"k"], [PAGE], None, 20, 0.0, token=77, owner=new)
    assert again[0] == items[0] and d.writer_of(e) is new
    other, _ = d.alloc("m", [b"k"], [PAGE], None, 30, 0.0, token=78, owner=old)
    assert other[0][0] == IN_FLIGHT and d.writer_of(e) is new  # another token never takes it over
    d.check()


def test_lost_node_is_dropped_in_budgeted_slices():
    d = make(units=4096, nodes=("n1", "n2"))
    keys = [f"k{i}".encode() for i in range(3000)]
    put(d, "m", keys)
    on_n1 = [k for k in keys if d.entries["m"][k].node_id == "n1"]
    assert len(on_n1) > 1000
    lease, _ = d.lookup("m", on_n1[:3], 1.0)  # pinned pages go in the last slice
    d.alloc("m", [b"pending-1", b"pending-2"], [PAGE, PAGE], None, 99_000, 1.0)
    pend_n1 = sum(1 for e in d._pending if e.node_id == "n1")
    n, fx = d.detach_space("n1", park=True)
    assert n == pend_n1 and "n1" not in d.spaces and "n1" in d.dying
    assert d.lookup("m", on_n1[:5], 2.0)[1] == [None] * 5  # readers miss at once
    d.check()
    slices, dropped, recs = 0, 0, None
    for _ in range(100):
        fx = Effects()
        k, recs = d.drop_slice("n1", 250, fx)
        slices += 1
        dropped += k
        assert k <= 250 and not fx.deletes  # parked: the records stay in etcd
        d.check()
        if recs is not None:
            break
    assert recs is not None and dropped == len(on_n1) == len(recs)
    assert slices == -(-len(on_n1) // 250)  # the 3 pinned pages ride in the last slice
    assert {r[1] for r in recs} == set(on_n1) and not d.dying
    assert d.objects == len(keys) - len(on_n1)
    assert d.release(lease)  # zombies of a dead space: nothing to free
    d.check()
    # not parked: each slice deletes its records
    n2 = [k for k in keys if k not in set(on_n1)]
    d.detach_space("n2")
    fx = Effects()
    k, recs = d.drop_slice("n2", 10_000, fx)
    assert recs == [] and k == len(n2) and sorted(k for _, k in fx.deletes) == sorted(n2)
    assert d.ns_used == {} and d.objects == 0
    d.check()


def test_written_again_while_its_node_is_dropped():
    d = make(units=64, nodes=("n1", "n2"))
    put(d, "m", [b"a"])
    nid = d.entries["m"][b"a"].node_id
    d.detach_space(nid, park=True)
    items, fx = d.alloc("m", [b"a"], [PAGE], None, 500, 1.0)
    assert items[0][0] == NEW and items[0][1] != nid  # not EXISTS: the old copy is unreachable
    assert d.commit("m", [b"a"], [500], 1.0)[0] == [True]
    _, recs = d.drop_slice(nid, 100, Effects())
    assert [r[1] for r in recs] == [b"a"]  # parked, but a rejoin keeps the new copy (rejoin.py skips present keys)
    d.check()


def test_namespace_use_is_exact_through_every_transition():
    d = make(units=32, nodes=("n1", "n2"))
    sz = object_size(PAGE)
    put(d, "a", [b"1", b"2", b"3"])
    items, _ = d.alloc("a", [b"p"], [PAGE], None, 900, 0.0)
    put(d, "b", [b"x"], size=10)
    assert d.ns_used == {"a": 4 * sz, "b": object_size(10)}
    d.check()
    assert d.abort("a", [b"p"], [items[0][4]]) == 1
    d.remove("a", [b"1"])
    assert d.ns_used["a"] == 2 * sz
    lease, _ = d.lookup("a", [b"2"], 1.0)
    d.remove("a", [b"2"])  # a zombie holds its extent but is no longer the namespace's
    assert d.ns_used["a"] == sz
    d.release(lease)
    fx = Effects()
    d.evict_all(100, fx)
    assert d.ns_used == {}
    d.check()
    nid = "n1"
    d.load_pages(nid, [("c", b"l1", ARENA_DATA_START + 16 * ALIGN, PAGE, 5, None)])
    assert d.ns_used == {"c": sz}
    d.drop_space(nid)
    assert d.ns_used == {}
    d.check()


def test_quota_evicts_within_the_namespace_then_refuses():
    from metaserver.directory import OVER_QUOTA

    sz = object_size(PAGE)
    d = make(units=64, quotas={"small": 4 * sz})
    put(d, "big", [f"b{i}".encode() for i in range(10)], now=0.0)
    for i in range(4):
        put(d, "small", [f"s{i}".encode()], now=1.0 + i)
    assert d.ns_used["small"] == 4 * sz
    d.lookup("small", [b"s0"], 9.0)  # s0 pinned (and the most recent): never evicted
    items, _, _ = put(d, "small", [b"s4", b"s5"], now=10.0)
    assert [it[0] for it in items] == [NEW, NEW]
    assert d.exists("small", [b"s0", b"s1", b"s2", b"s3", b"s4", b"s5"]) == [True, False, False, True, True, True]
    assert d.ns_used["small"] == 4 * sz and d.objects == 14
    assert d.exists("big", [f"b{i}".encode() for i in range(10)]) == [True] * 10  # the other namespace untouched
    # s0 pinned, s3..s5 evictable: 4 new keys cannot fit, and the refusal evicts nothing
    items, _ = d.alloc("small", [f"t{i}".encode() for i in range(4)], [PAGE] * 4, None, 5000, 11.0)
    assert [it[0] for it in items] == [OVER_QUOTA] * 4
    assert d.exists("small", [b"s0", b"s3", b"s4", b"s5"]) == [True] * 4 and d.pending == 0
    items, _ = d.alloc("small", [b"huge"], [5 * sz], None, 6000, 12.0)
    assert items[0][0] == OVER_QUOTA  # larger than the quota itself
    items, _ = d.alloc("small", [f"t{i}".encode() for i in range(3)], [PAGE] * 3, None, 7000, 13.0)
    assert [it[0] for it in items] == [NEW] * 3  # 3 fit after evicting s3..s5, oldest first
    assert d.exists("small", [b"s0", b"s3", b"s4", b"s5"]) == [True, False, False, False]
    assert d.ns_used["small"] == 4 * sz
    d.check()


def test_evict_bytes_takes_the_fullest_node_first_without_a_scan_per_victim(monkeypatch):
    """The victims' nodes are exactly the old rule's (one victim at a time from the fullest node, ties to the first
    in ``spaces`` order), while node fills are computed O(nodes + victims) times, not nodes x victims."""
    import random

    from metaserver import passes

    rng = random.Random(7)
    nodes = tuple(f"n{i:02d}" for i in range(16))
    d = make(units=64, nodes=nodes)
    keys = [f"k{i}".encode() for i in range(16 * 60)]
    put(d, "m", keys)
    d.remove("m", rng.sample(keys, 400))  # uneven fills, ties among them
    node_of = {k: e.node_id for k, e in d.entries["m"].items()}
    used = {n: sp.alloc.used_units for n, sp in d.spaces.items()}
    units = {n: sp.alloc.units for n, sp in d.spaces.items()}
    expected = []
    for _ in range(300):  # the old rule, simulated: every page is one unit
        n = max((n for n in d.spaces if used[n]), key=lambda n: used[n] / units[n])
        used[n] -= 1
        expected.append(n)
    calls = [0]
    fill = passes._fill_of

    def counted(sp):
        calls[0] += 1
        return fill(sp)

    monkeypatch.setattr(passes, "_fill_of", counted)
    fx = Effects()
    assert d.evict_bytes(300 * ALIGN, 1000, fx) == (300, 300 * ALIGN)
    assert [node_of[k] for _ns, k in fx.deletes] == expected
    assert calls[0] <= len(nodes) + 2 * 300, calls[0]  # the old loop: 16 x 300 = 4,800
    assert d.evict_bytes(1 << 40, 50, Effects())[0] == 50  # the budget bounds a call
    d.check()
