"""The directory's ownership and bounded-work bookkeeping on ``metaserver.table.directory.TableDirectory`` (pure, no I/O):
read leases owned by their taker, a retried ALLOC moving its PENDING allocation, a lost node dropped in budgeted
slices (parked or not), exact per-namespace use through every transition, and evict_bytes taking the fullest node
first. The core (alloc, commit, lookup, eviction) is tested in test_directory.py."""

from __future__ import annotations

import random

from metaserver.table.entry import IN_FLIGHT, NEW, Effects
from metaserver.table.load import load_pages
from transport.objformat import ALIGN, ARENA_DATA_START, object_size

from test_directory import PAGE, make, pins, put


def test_lease_ids_are_random_and_owned():
    d = make(units=64)
    put(d, "m", [b"a", b"b"])
    owner, other = object(), object()
    leases = [d.lookup("m", [b"a"], 1.0, owner)[0] for _ in range(50)]
    assert len(set(leases)) == 50 and all(0 < x < 1 << 63 for x in leases)
    assert max(leases) > 1 << 40  # not sequential small integers
    assert sorted(leases) != list(range(min(leases), min(leases) + 50))
    assert pins(d, "m", b"a") == 50
    # another owner releasing them (ids leaked or guessed, or neighbours of them) changes nothing
    assert not any(d.release(x + k, other) for x in leases for k in (-1, 0, 1))
    assert pins(d, "m", b"a") == 50 and d.pinned == 1
    d.check()
    assert all(d.release(x, owner) for x in leases)
    assert d.pinned == 0 and not d._lease_owner
    d.check()


def test_retried_alloc_moves_the_pending_allocation_to_the_new_owner():
    d = make()
    old, new = object(), object()
    items, _ = d.alloc("m", [b"k"], [PAGE], None, 10, 0.0, token=77, owner=old)
    row = int(d._find("m", [b"k"])[0])
    assert d.writer_of(row) is old
    again, _ = d.alloc("m", [b"k"], [PAGE], None, 20, 0.0, token=77, owner=new)
    assert again[0] == items[0] and d.writer_of(row) is new
    other, _ = d.alloc("m", [b"k"], [PAGE], None, 30, 0.0, token=78, owner=old)
    assert other[0][0] == IN_FLIGHT and d.writer_of(row) is new  # another token never takes it over
    d.check()


def test_lost_node_is_dropped_in_budgeted_slices():
    d = make(units=4096, nodes=("n1", "n2"))
    keys = [f"k{i}".encode() for i in range(3000)]
    items, _, cfx = put(d, "m", keys)
    on_n1 = [k for k, it in zip(keys, items) if it[1] == "n1"]
    assert len(on_n1) > 1000
    lease, _ = d.lookup("m", on_n1[:3], 1.0)  # pinned pages are dropped as zombies
    pend, _ = d.alloc("m", [b"pending-1", b"pending-2"], [PAGE, PAGE], None, 99_000, 1.0)
    pend_n1 = sum(1 for it in pend if it[1] == "n1")
    n, fx = d.detach_space("n1", park=True)
    assert n == pend_n1 and "n1" not in d.spaces and "n1" in d.dying
    assert d.lookup("m", on_n1[:5], 2.0)[1] == [None] * 5  # readers miss at once
    d.check()
    per_slice, dropped, recs = [], 0, None
    for _ in range(100):
        fx = Effects()
        k, recs = d.drop_slice("n1", 250, fx)
        per_slice.append(k)
        dropped += k
        assert k <= 250 and not fx  # parked: the records stay in etcd as they are
        d.check()
        if recs is not None:
            break
    assert recs is not None and dropped == len(on_n1) == len(recs)
    # full slices of pages; the slice that fills its budget exactly may leave the node's empty rows to one more
    assert per_slice in ([250] * 6, [250] * 6 + [0]) and len(on_n1) == 1500
    assert {r[1] for r in recs} == set(on_n1) and not d.dying
    assert d.objects == len(keys) - len(on_n1)
    assert d.release(lease)  # zombies of a dead node: nothing to free
    d.check()
    # not parked: the slice rewrites the records without the pages (here: every page of them gone, deleted)
    n2 = [k for k in keys if k not in set(on_n1)]
    d.detach_space("n2")
    fx = Effects()
    k, recs = d.drop_slice("n2", 10_000, fx)
    assert recs == [] and k == len(n2)
    assert {r.name for r in fx.batches} == {r.name for r in cfx.recs} and all(r.value() is None for r in fx.batches)
    assert d.namespace_usage() == {} and d.objects == 0
    d.check()


def test_written_again_while_its_node_is_dropped():
    d = make(units=64, nodes=("n1", "n2"))
    items, _, cfx = put(d, "m", [b"a"])
    nid = items[0][1]
    d.detach_space(nid, park=True)
    items, fx = d.alloc("m", [b"a"], [PAGE], None, 500, 1.0)
    assert items[0][0] == NEW and items[0][1] != nid  # not EXISTS: the old copy is unreachable
    # the ALLOC dropped the old copy on the spot (not parked: the new one is the page) and its record goes
    assert fx.batches == cfx.recs and fx.batches[0].value() is None
    assert d.commit("m", [b"a"], [500], 1.0)[0] == [True]
    for _ in range(10):  # a slice visits at most 16 x its budget of the node's rows
        _, recs = d.drop_slice(nid, 100, Effects())
        if recs is not None:
            break
    assert recs == [] and d.lookup("m", [b"a"], 2.0)[1] == [(items[0][1], items[0][2], PAGE, 500)]
    d.check()


def used_of(d, ns: str) -> int:
    return d.namespace_usage().get(ns, {}).get("used_bytes", 0)


def test_namespace_use_is_exact_through_every_transition():
    d = make(units=32, nodes=("n1", "n2"))
    sz = object_size(PAGE)
    put(d, "a", [b"1", b"2", b"3"])
    items, _ = d.alloc("a", [b"p"], [PAGE], None, 900, 0.0)
    put(d, "b", [b"x"], size=10)
    assert {ns: u["used_bytes"] for ns, u in d.namespace_usage().items()} == {"a": 4 * sz, "b": object_size(10)}
    d.check()
    assert d.abort("a", [b"p"], [items[0][4]]) == 1
    d.remove("a", [b"1"])
    assert used_of(d, "a") == 2 * sz
    lease, _ = d.lookup("a", [b"2"], 1.0)
    d.remove("a", [b"2"])  # a zombie holds its extent but is no longer the namespace's
    assert used_of(d, "a") == sz
    d.release(lease)
    fx = Effects()
    d.evict_all(100, fx)
    assert d.namespace_usage() == {}
    d.check()
    assert load_pages(d, "n1", "c", [b"l1"], [ARENA_DATA_START + 16 * ALIGN], [PAGE], [5]) == []
    assert used_of(d, "c") == sz and d.namespace_usage()["c"]["objects"] == 1
    d.drop_space("n1")
    assert d.namespace_usage() == {}
    d.check()


def test_evict_bytes_takes_the_fullest_node_first():
    """The victims' nodes are exactly the rule's: one victim at a time from the fullest node (by fill ratio), ties to
    the first in ``spaces`` order; the budget bounds a call."""
    rng = random.Random(7)
    nodes = tuple(f"n{i:02d}" for i in range(16))
    d = make(units=64, nodes=nodes)
    keys = [f"k{i}".encode() for i in range(16 * 60)]
    items, _, _ = put(d, "m", keys)
    d.remove("m", rng.sample(keys, 400))  # uneven fills, ties among them
    node_of = {k: it[1] for k, it in zip(keys, items)}
    used = {n: sp.alloc.used for n, sp in d.spaces.items()}
    expected = []
    for _ in range(300):  # every page is one unit
        n = max((n for n in d.spaces if used[n]), key=lambda n: used[n] / d.spaces[n].alloc.capacity)
        used[n] -= ALIGN
        expected.append(n)
    before = {k for k, ok in zip(keys, d.exists("m", keys)) if ok}
    fx = Effects()
    assert d.evict_bytes(300 * ALIGN, 1000, fx) == (300, 300 * ALIGN)
    gone = [k for k in before if not d.exists("m", [k])[0]]
    assert sorted(node_of[k] for k in gone) == sorted(expected)
    assert d.evict_bytes(1 << 40, 50, Effects())[0] == 50  # the budget bounds a call
    d.check()
