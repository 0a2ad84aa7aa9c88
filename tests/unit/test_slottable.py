"""``metaserver.ha.slots.SlotTable``: a partitioned pool's slot directory on the columnar table places, evicts, drains,
loads and takes a returning node's pages back only inside its slot's region of each node's arena
(``slots.region``), so two slots never hand out the same bytes; and it leaves out the parents of other slots."""

from __future__ import annotations

import random

import numpy as np
import pytest

from metaserver.table.entry import GONE, NEW, PENDING, READY, Effects, extent_size
from metaserver.ha.slots import SlotTable, own_parents, region
from metaserver.table.load import load_pages
from metaserver.table.nodes import UNIT_SHIFT
from transport import slotrules
from transport.slotrules import slot_of
from transport.objformat import ARENA_DATA_START, object_size

SLOTS = 4
SMALL, BIG = 60_000, 200_000  # a 64 KiB and a larger layout
CAP = SLOTS * 9 * object_size(SMALL) + 5 * 4096  # not a multiple of SLOTS x 4 KiB: the region is rounded down


def keys_of(lo: int, hi: int) -> list[bytes]:
    return [i.to_bytes(32, "little") for i in range(lo, hi)]


def live_extents(d: SlotTable) -> list[tuple[str, int, int]]:
    """(node id, offset, extent size) of every row holding arena bytes (PENDING, READY, GONE)."""
    top = d.blocks_used * d.block
    c = d.cols
    rows = np.flatnonzero(np.isin(c["state"][:top], (PENDING, READY, GONE)))
    offs = (c["unit"].take(rows).astype(np.int64) << UNIT_SHIFT).tolist()
    sizes = d.code_extents().take(c["size"].take(rows)).tolist()
    nodes = [d.nodes[n].node_id for n in c["node"].take(rows).tolist()]
    return list(zip(nodes, offs, sizes))


def assert_in_region(d: SlotTable, items=()) -> None:
    base, size = region(d.slot, SLOTS, CAP)
    for node in d.node_by_id.values():
        assert (node.alloc.base, node.alloc.capacity) == (base, size), node.node_id
    for it in items:
        if it[0] == NEW:
            assert base <= it[2] and it[2] + extent_size(it[3]) <= base + size, (d.slot, it)
    for node_id, off, ext in live_extents(d):
        assert base <= off and off + ext <= base + size, (d.slot, node_id, off, ext)
    d.check()


def put(d: SlotTable, keys: list[bytes], plen: int, gen: int, now: float = 0.0) -> list:
    items, _ = d.alloc("a", keys, [plen] * len(keys), None, gen, now)
    new = [(k, it[4]) for k, it in zip(keys, items) if it[0] == NEW]
    ok, _ = d.commit("a", [k for k, _ in new], [g for _, g in new], now)
    assert ok == [True] * len(new)
    return items


def test_regions_of_the_slots_tile_the_arena_without_overlap():
    spans = [region(s, SLOTS, CAP) for s in range(SLOTS)]
    assert spans[0][0] == ARENA_DATA_START and all(size % 4096 == 0 for _, size in spans)
    assert all(a[0] + a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert spans[-1][0] + spans[-1][1] <= ARENA_DATA_START + CAP


@pytest.mark.parametrize("slot", range(SLOTS))
def test_a_slot_table_fills_its_region_and_no_more(slot):
    """A node's allocator is the region: ALLOC places the region's worth of pages, then evicts within it."""
    d = SlotTable(slot, SLOTS)
    d.add_space("n0", CAP)
    fit = region(slot, SLOTS, CAP)[1] // object_size(SMALL)
    items = put(d, keys_of(0, fit), SMALL, 1)
    assert [it[0] for it in items] == [NEW] * fit and d.evictions == 0
    assert d.used == fit * object_size(SMALL) and d.capacity == region(slot, SLOTS, CAP)[1]
    more = put(d, keys_of(fit, fit + 3), SMALL, 100)
    assert [it[0] for it in more] == [NEW] * 3 and d.evictions == 3, "full: the region's oldest pages went"
    assert_in_region(d, items + more)


@pytest.mark.parametrize("slot", range(SLOTS))
def test_a_slot_table_never_places_outside_its_region(slot):
    """A random mix of ALLOC (two layouts), COMMIT, ABORT, LOOKUP held across evictions, REMOVE, the eviction
    passes, a DRAIN and a node lost, parked and back: every extent placed, held or loaded back stays in the slot's
    region of its node, and the table's invariants hold."""
    rng = random.Random(slot)
    d = SlotTable(slot, SLOTS)
    for n in ("n0", "n1"):
        d.add_space(n, CAP)
    gen = 1
    leases = []
    for step in range(300):
        op = rng.random()
        keys = keys_of(k := rng.randrange(0, 200), k + rng.randrange(1, 8))
        plen = SMALL if rng.random() < 0.7 else BIG
        if op < 0.5:
            items, _ = d.alloc("a", keys, [plen] * len(keys), None, gen, float(step))
            new = [(k, it[4]) for k, it in zip(keys, items) if it[0] == NEW]
            if rng.random() < 0.8:
                d.commit("a", [k for k, _ in new], [g for _, g in new], float(step))
            else:
                d.abort("a", [k for k, _ in new], [g for _, g in new])
            gen += len(keys)
            assert_in_region(d, items)
        elif op < 0.65:
            lease, _ = d.lookup("a", keys, float(step))
            if lease:
                leases.append(lease)
        elif op < 0.75 and leases:
            d.release(leases.pop(rng.randrange(len(leases))))
        elif op < 0.85:
            d.remove("a", keys)
        elif op < 0.9:
            d.evict_bytes(rng.randrange(1, 4) * object_size(BIG), 64, Effects())
        elif op < 0.93:
            d.watermark_pass(0.5, 0.3, 64, Effects())
        elif op < 0.96:
            d.drain("n1")
            d.set_placeable("n1", True)
        elif "n0" in d.node_by_id and not d.dying:
            d.detach_space("n0", park=True)
            n, recs = d.drop_slice("n0", 1 << 20)
            assert recs is not None
            d.add_space("n0", CAP)  # back with its arena: its parked pages filed again, in its region
            d.unpark("n0", [(ns, k, off, plen_, g, None, name) for ns, k, off, plen_, g, _p, _st, name in recs])
        assert_in_region(d)
    for lease in leases:
        d.release(lease)
    assert_in_region(d)
    assert d.evictions > 0, "the regions filled: placement went through eviction too"


def test_a_slot_tables_load_rejects_the_pages_of_other_regions():
    """A node's pages of every slot's region offered to slot 2's table: only those of region 2 are filed."""
    d = SlotTable(2, SLOTS)
    d.add_space("n0", CAP)
    ext = object_size(SMALL)
    offs, owner = [], []
    for s in range(SLOTS):
        base, size = region(s, SLOTS, CAP)
        for j in range(3):
            offs.append(base + j * ext)
            owner.append(s)
    offs.append(region(2, SLOTS, CAP)[0] + region(2, SLOTS, CAP)[1] - ext // 2)  # straddles region 2's end
    owner.append(-1)
    keys = keys_of(0, len(offs))
    bad = load_pages(d, "n0", ["a"] * len(keys), keys, offs, [SMALL] * len(keys), list(range(1, len(keys) + 1)))
    assert bad == [i for i, s in enumerate(owner) if s != 2]
    assert d.exists("a", keys) == [s == 2 for s in owner]
    assert_in_region(d)


def test_own_parents_leaves_out_the_parents_of_other_slots():
    cands = [b"p%d" % i for i in range(100)]
    mine = next(k for k in cands if slot_of("m", k, SLOTS) == 1)
    other = next(k for k in cands if slot_of("m", k, SLOTS) != 1)
    assert own_parents(1, SLOTS, "m", [mine, other, None]) == [mine, None, None]
    assert own_parents(1, SLOTS, "m", None) is None and own_parents(1, SLOTS, "m", [None]) == [None]


def test_a_parent_that_is_one_of_the_allocs_keys_is_kept_without_its_slot_computed(monkeypatch):
    """A slot's ALLOC keys are checked to be of its slot, so a chain's parents that are its keys need no digest:
    only the others' slots are asked for, in one call."""
    cands = [b"p%d" % i for i in range(200)]
    mine = [k for k in cands if slot_of("m", k, SLOTS) == 1][:3]
    other = next(k for k in cands if slot_of("m", k, SLOTS) != 1)
    asked = []
    real = slotrules.slots_of
    monkeypatch.setattr(slotrules, "slots_of", lambda ns, ks, *a: asked.append(list(ks)) or real(ns, ks, *a))
    assert own_parents(1, SLOTS, "m", [None, mine[0], mine[1]], keys=mine) == [None, mine[0], mine[1]]
    assert asked == []
    outside = mine[2]
    assert own_parents(1, SLOTS, "m", [outside, mine[0], other], keys=mine[:2]) == [outside, mine[0], None]
    assert asked == [[outside, other]]


def test_a_multi_slot_allocs_parts_name_no_key_of_another_part_as_parent():
    """``multislot.split``: each ALLOC part keeps the parents that are its own keys or named outside the request
    (its table decides those), and leaves out (None) those that are keys of other parts."""
    from metaserver.ha import multislot

    cands = [b"k%d" % i for i in range(400)]
    per = {s: [k for k in cands if slot_of("m", k, SLOTS) == s][:3] for s in range(SLOTS)}
    chain = [per[s][j] for j in range(3) for s in range(SLOTS)]  # the client's order: slots interleaved
    parent_of = dict(zip(chain, [b"outside"] + chain[:-1]))
    keys = [k for s in range(SLOTS) for k in per[s]]  # as sent: grouped by slot
    meta = {"ns": "m", "keys": keys, "sizes": [SMALL] * len(keys), "parents": [parent_of[k] for k in keys],
            "parts": [[s, 3] for s in range(SLOTS)]}
    for s, m in multislot.split(meta, SLOTS, True):
        assert m["keys"] == per[s]
        want = [p if p == b"outside" or slot_of("m", p, SLOTS) == s else None for p in (parent_of[k] for k in per[s])]
        assert m["parents"] == want and want.count(None) >= 2
    assert [m["parents"] for _, m in multislot.split(meta, SLOTS, False)] == [meta["parents"][i:i + 3]
                                                                            for i in range(0, 12, 3)]
    # malformed keys or parents (unhashable) are left to the slot's own validation, which refuses them by name
    bad = {"ns": "m", "keys": [[1]] + per[0], "sizes": [SMALL] * 4, "parents": [[2], None, per[0][0], b"x"],
           "parts": [[0, 4]]}
    (s, m), = multislot.split(bad, SLOTS, True)
    assert s == 0 and m["parents"] == bad["parents"]


def test_a_slot_tables_alloc_passes_only_its_own_parents(monkeypatch):
    from metaserver.table.columns import PageTable

    seen = []
    real = PageTable.alloc_rows

    def spy(self, ns, keys, sizes, gen_base, tags, now, token, owner, parents, at=None):
        seen.append(parents)
        return real(self, ns, keys, sizes, gen_base, tags, now, token, owner, parents, at)

    monkeypatch.setattr(PageTable, "alloc_rows", spy)
    d = SlotTable(1, SLOTS)
    d.add_space("n0", CAP)
    cands = [b"p%d" % i for i in range(100)]
    mine = next(k for k in cands if slot_of("m", k, SLOTS) == 1)
    other = next(k for k in cands if slot_of("m", k, SLOTS) != 1)
    items, _ = d.alloc("m", [b"k1", b"k2"], [SMALL, SMALL], [mine, other], 1, 0.0)
    placed = d.alloc_placed("m", [b"k3", b"k4"], [SMALL, SMALL], [mine, other], 3, 0.0)  # the service's call
    assert seen == [[mine, None]] * 2 and [it[0] for it in items] == [NEW, NEW]
    assert placed.state.tolist() == [NEW, NEW]


def test_under_prefix_lru_a_child_of_another_slots_parent_is_a_leaf_not_an_orphan():
    """A parent of another slot is never linked here: its child is an ordinary leaf, evicted by recency, not an
    orphan that goes first. The region holds four pages; the fifth evicts the oldest leaf, not the newest page whose
    parent lives in another slot."""
    cands = [b"p%d" % i for i in range(100)]
    mine = next(k for k in cands if slot_of("m", k, SLOTS) == 1)
    other = next(k for k in cands if slot_of("m", k, SLOTS) != 1)
    d = SlotTable(1, SLOTS, policy="prefix-lru")
    d.add_space("n1", SLOTS * 4 * object_size(SMALL))
    order = [(b"oldest", None), (mine, None), (b"kid-of-mine", mine), (b"kid-of-other", other)]
    for i, (k, parent) in enumerate(order):
        items, _ = d.alloc("m", [k], [SMALL], [parent], 10 * (i + 1), float(i))
        assert d.commit("m", [k], [items[0][4]], float(i))[0] == [True]
    items, _ = d.alloc("m", [b"new"], [SMALL], None, 100, 9.0)
    assert items[0][0] == NEW and d.evictions == 1
    assert d.exists("m", [k for k, _ in order]) == [False, True, True, True]
    d.check()
