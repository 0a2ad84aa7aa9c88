"""metaserver/table/nodes.py: a lost node of the columnar page table is detached at once (LOOKUP misses its pages,
its PENDING rows go, nothing is placed there) and dropped in budgeted slices; pinned pages stay as zombies until
their lease lets go; a dropped node's blocks and index are reused; parked records come back; an ALLOC that meets a
dying page places it anew. The table's invariant check runs between the steps."""

from __future__ import annotations

from metaserver.table.columns import BLOCK, PageTable
from metaserver.table.entry import NEW
from metaserver.table.nodes import add_node, detach_node, drain_rows, drop_rows
from transport.objformat import object_size

from tablekit import PLEN, keys_of, table


def put(t: PageTable, keys: list[bytes], gen: int, ns: str = "a") -> dict[bytes, str]:
    """Put and commit ``keys``; returns key -> the node it went to."""
    items = t.alloc(ns, keys, [PLEN] * len(keys), gen)
    assert all(it[0] == NEW for it in items), items
    assert t.commit(ns, keys, [it[4] for it in items]) == [True] * len(keys)
    return {k: it[1] for k, it in zip(keys, items)}


def test_a_lost_node_misses_at_once_drops_in_slices_and_its_block_is_reused():
    t = table(2, 3000)
    keys = keys_of(0, 2000)
    where = put(t, keys, gen=1)
    on1 = [k for k in keys if where[k] == "n1"]
    assert len(on1) == 1000
    pend = t.alloc("a", keys_of(5000, 5010), [PLEN] * 10, 10**6)  # PENDING, five on each node
    lease, _ = t.lookup("a", on1[:5])  # a reader holds five of n1's pages across the loss
    assert detach_node(t, "n1") == 5, "n1's PENDING rows go at once"
    t.check()
    _, locs = t.lookup("a", keys)
    assert [loc is not None for loc in locs] == [where[k] == "n0" for k in keys], "n1's pages miss at once"
    assert sum(t.exists("a", on1)) == 1000, "EXISTS may count them until their slice"
    n1_pend = [i for i, it in enumerate(pend) if it[1] == "n1"]
    assert t.commit("a", [keys_of(5000, 5010)[i] for i in n1_pend], [pend[i][4] for i in n1_pend]) == [False] * 5
    assert {it[1] for it in t.alloc("a", keys_of(9000, 9100), [PLEN] * 100, 2 * 10**6)} == {"n0"}
    ix1 = t.dying["n1"].ix
    slices = []
    for _ in range(100):  # bounded: 14 slices of 300 rows cover its one block
        dropped, done = drop_rows(t, "n1", 300)
        slices.append(dropped)
        if done is not None:
            break
        if len(slices) == 3:
            t.check()
    assert len(slices) == -(-BLOCK // 300) and sum(slices) == 1000 and done == []
    assert sum(t.exists("a", on1)) == 0
    t.check()
    assert t.nodes[ix1] is not None and not t.free_blocks, "five zombies still pinned: not retired yet"
    assert t.release(lease)
    assert t.nodes[ix1] is None and len(t.free_blocks) == 1, "the last pin retired it"
    t.check()
    used = t.blocks_used
    add_node(t, "n2", 3000 * object_size(PLEN))
    assert t.node_by_id["n2"].ix == ix1, "the retired index is reused"
    put(t, keys_of(20_000, 20_400), gen=3 * 10**6)
    assert t.blocks_used == used and not t.free_blocks, "n2 took the retired block before growing the columns"
    t.check()
    assert sum(loc is not None for loc in t.lookup("a", keys_of(20_000, 20_400))[1]) == 400


def test_a_parked_drop_gives_back_every_page_record_oldest_first():
    t = table(2, 100)
    keys = keys_of(0, 60)
    where = put(t, keys, gen=100)
    on1 = [k for k in keys if where[k] == "n1"]
    t.release(t.lookup("a", on1[:3])[0])  # the three most recently used now
    _, locs = t.lookup("a", on1)
    t.release(t.lookup("a", on1[:3])[0])
    want = {k: (loc[1], loc[2], loc[3]) for k, loc in zip(on1, locs)}
    detach_node(t, "n1", park=True)
    records = None
    for _ in range(10):
        _n, records = drop_rows(t, "n1", 1000)
        if records is not None:
            break
    assert sorted((k, (off, plen, gen)) for _ns, k, off, plen, gen, _stamp, _rec, _parent in records) == sorted(
        want.items())
    assert {ns for ns, *_ in records} == {"a"}
    assert [r[1] for r in records[-3:]] == on1[:3], "records come oldest first: the last used are last"
    assert [r[5] for r in records] == sorted(r[5] for r in records)
    t.check()


def test_an_alloc_that_meets_a_dying_page_places_it_anew_once():
    t = table(2, 50)
    keys = keys_of(0, 20)
    where = put(t, keys, gen=1)
    k = next(k for k in keys if where[k] == "n1")
    detach_node(t, "n1")
    items = t.alloc("a", [k], [PLEN], 500)
    assert items[0][0] == NEW and items[0][1] == "n0"
    assert t.commit("a", [k], [500]) == [True]
    t.check()
    while drop_rows(t, "n1", 7)[1] is None:
        pass
    t.check()
    _, locs = t.lookup("a", [k])
    assert locs[0][0] == "n0" and locs[0][3] == 500


def test_a_node_id_back_while_its_old_self_drains():
    """The same node id registers again before its previous incarnation's drop ends: a new index, the old rows
    still hidden; detaching it again finishes the old drop first."""
    t = table(1, 40)
    put(t, keys_of(0, 30), gen=1)
    detach_node(t, "n0")
    drop_rows(t, "n0", 10)
    add_node(t, "n0", 40 * object_size(PLEN))
    assert t.node_by_id["n0"] is not t.dying["n0"]
    assert [loc is None for loc in t.lookup("a", keys_of(0, 30))[1]] == [True] * 30
    where = put(t, keys_of(100, 110), gen=1000)
    assert set(where.values()) == {"n0"}
    t.check()
    assert detach_node(t, "n0") == 20, "the old drop's 20 pages left, finished first"
    assert t.dying["n0"] is not None and sum(t.exists("a", keys_of(0, 30))) == 0, "the first drop was finished"
    while drop_rows(t, "n0", 5000)[1] is None:
        pass
    assert not t.dying and not t.placing
    t.check()


def test_a_drain_drops_the_unpinned_pages_and_keeps_the_pinned_and_pending():
    t = table(2, 100)
    keys = keys_of(0, 100)
    where = put(t, keys, gen=1)
    on0 = [k for k in keys if where[k] == "n0"]
    lease, _ = t.lookup("a", on0[:4])
    pend = t.alloc("a", keys_of(200, 204), [PLEN] * 4, 10**6)
    t.commits.take()
    assert drain_rows(t, "n0") == (46, 4), "50 READY on n0: 4 held by a reader"
    t.check()
    lease2, locs = t.lookup("a", keys)
    assert sum(loc is not None for loc in locs) == 54, "n1's 50 and the 4 pinned on n0"
    assert t.release(lease2)
    _, rewrites = t.commits.take()
    assert len(rewrites) == 1, "their one commit record is rewritten"
    assert {it[1] for it in t.alloc("a", keys_of(300, 320), [PLEN] * 20, 2 * 10**6)} == {"n1"}, "nothing placed on n0"
    on0_pend = [(k, it[4]) for k, it in zip(keys_of(200, 204), pend) if it[1] == "n0"]
    assert t.commit("a", [k for k, _ in on0_pend], [g for _, g in on0_pend]) == [True] * len(on0_pend)
    assert t.release(lease)
    assert drain_rows(t, "n0") == (4 + len(on0_pend), 0), "a later drain takes what was pinned or pending"
    assert t.nodes[0].alloc.used == 0
    t.check()
