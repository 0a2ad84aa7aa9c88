"""metaserver/table/place.py (ALLOC on the page table) and metaserver/table/grants.py (its answer): the array path against the
per-key path on random requests of one page size, with parents or none (same states, same nodes, same victims, same pages left on each
node, the table's invariants after every step; with several sizes the two may fragment an arena differently, so
there the invariants and each answer's own consistency are checked), and the packed ALLOC answer against the VERSION 11 items list (same places, tags and write
capabilities, one per node, equal to ``write_capability`` over that node's slots in key order)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from metaserver.table import place as tableplace
from metaserver.table.entry import NEW, PENDING
from metaserver.table.grants import grant_alloc
from metaserver.table.quarantine import Quarantine
from metaserver.table.directory import TableDirectory
from metaserver.table.evict import CANDIDATES
from transport import answerrows, wire
from transport.objformat import object_size
from umbp.auth import Tokens, write_capability

MIXED = (3000, 3000, 3000, 9000)  # mostly one extent size; some pages of three units (victims one at a time)


def _tables(nodes: int, units: int) -> list[TableDirectory]:
    out = []
    for _ in range(2):
        d = TableDirectory()
        for i in range(nodes):
            d.add_space(f"n{i}", units * object_size(3000))
        out.append(d)
    return out


@pytest.mark.parametrize("seed,sizes,young", [(s, (3000,), False) for s in range(4)] + [(s, MIXED, False) for s in
                                                                                       range(2)] + [(9, (3000,), True)])
def test_the_array_path_places_and_evicts_as_the_per_key_path(seed, sizes, young, monkeypatch):
    """``young``: generations from 600 on are young (a closed pool's write quarantine): such a victim's extent is
    held, not handed over, so the array path takes it and the rest one at a time."""
    rng = random.Random(seed)
    same = len(sizes) == 1
    arrays, each = _tables(rng.randint(1, 5), rng.randint(20, 60))
    if young:
        for d in (arrays, each):
            d.quarantine = Quarantine(hold_s=3600.0)
            d.quarantine.young_gen = 600
    universe = [rng.randbytes(32) for _ in range(300)] + [b"short-%d" % i for i in range(30)]
    made = 0
    gen = 1
    leases: list[tuple[int, int]] = []
    for step in range(200):
        op = rng.random()
        if op < 0.65:
            n = rng.choice((1, 3, 8, 40, 130))
            if rng.random() < 0.25:  # keys new and old mixed: the per-key path when an old one follows a new one
                keys = rng.sample(universe, n)
            else:  # keys never asked for: the array path
                keys = [rng.randbytes(32) if rng.random() < 0.9 else b"fresh-%d" % (made + i) for i in range(n)]
                made += n
                universe += keys
            if rng.random() < 0.3:  # READY keys first, then new ones: still the array path
                have = [k for k in universe[:300] if arrays.exists("a", [k])[0]][:5]
                keys = have + [k for k in keys if k not in have]
            if rng.random() < 0.05:
                keys.append(keys[0])  # a key given twice: the per-key path
            plens = [rng.choice(sizes) for _ in keys]
            parents = None
            if rng.random() < 0.4:  # chains (the engines' puts), parents in the table or named nowhere, none
                parents = [rng.choice((None, keys[i - 1] if i else None, keys[i - 1] if i else None,
                                       rng.choice(universe), b"nowhere")) for i in range(len(keys))]
            got = []
            commit = rng.random() < 0.97  # most are committed at once; a few wait (PENDING rows)
            for d, flag in ((arrays, True), (each, False)):
                monkeypatch.setattr(tableplace, "ARRAYS", flag)
                items, _ = d.alloc("a", keys, plens, parents, gen, 0.0)
                new = [(k, it[4]) for k, it in zip(keys, items) if it[0] == NEW]
                assert len({k for k, _ in new}) == len(new) and all(it[3] == p for it, p in zip(items, plens)
                                                                    if it[0] == NEW)
                if commit:
                    assert d.commit("a", [k for k, _ in new], [g for _, g in new], 0.0)[0] == [True] * len(new)
                got.append(([it[0] for it in items], [it[1] for it in items], [it[3] for it in items]))
            assert got[0] == got[1] or not same, step
            gen += len(keys)
        elif op < 0.75:
            keys = rng.sample(universe, 10) if rng.random() < 0.5 else keys[-10:]  # some of the latest put
            la = arrays.lookup("a", keys, 0.0)[0]
            le = each.lookup("a", keys, 0.0)[0]
            leases.append((la, le))
        elif op < 0.92 and leases:
            la, le = leases.pop(rng.randrange(len(leases)))
            arrays.release(la)
            each.release(le)
        else:
            keys = rng.sample(universe, 5)
            assert arrays.remove("a", keys)[0] == each.remove("a", keys)[0] or not same
        if same:
            assert arrays.exists("a", universe[-2000:]) == each.exists("a", universe[-2000:]), step
            assert [n.alloc.used for n in arrays.placing] == [n.alloc.used for n in each.placing]
            assert arrays.evictions == each.evictions
        arrays.check()
        each.check()


def test_victims_in_bulk_follow_exact_lru_across_queue_refills():
    """Many requests into a full pool (each new key evicts): the oldest pages leave first, across the eviction
    queues' refills (``CANDIDATES`` a refill) and the queues' numpy copy."""
    d = TableDirectory()
    for i in range(3):
        d.add_space(f"n{i}", 900 * object_size(3000))
    keys = [i.to_bytes(32, "little") for i in range(2700 + 3 * CANDIDATES)]
    gen = 1
    for lo in range(0, len(keys), 300):
        batch = keys[lo:lo + 300]
        items, _ = d.alloc("a", batch, [3000] * len(batch), None, gen, 0.0)
        assert all(it[0] == NEW for it in items)
        d.commit("a", batch, [it[4] for it in items], 0.0)
        gen += len(batch)
        d.check()
    assert d.exists("a", keys) == [False] * (len(keys) - 2700) + [True] * 2700  # the newest 2,700 stay
    assert d.evictions == 3 * CANDIDATES


def test_the_packed_answer_carries_what_the_items_list_carries():
    d = TableDirectory()
    for i in range(3):
        d.add_space(f"n{i}", 40 * object_size(5000))
    tokens = Tokens.load("cluster-secret", None, "test")

    class Member:
        def __init__(self, nid):
            self.cap_key = tokens.cap_key(nid, b"arena-" + nid.encode())
            self.cap_epoch = 3

    members = {f"n{i}": Member(f"n{i}") for i in range(3)}
    keys = [b"k%d" % i for i in range(10)]
    items, _ = d.alloc("a", keys[:4], [5000] * 4, None, 1, 0.0)
    d.commit("a", keys[:2], [it[4] for it in items[:2]], 0.0)
    p = d.alloc_placed("a", keys, [5000] * 10, None, 100, 0.0)  # 2 READY, 2 PENDING (another writer), 6 new
    assert p.state.tolist() == [1, 1, 3, 3] + [0] * 6
    packed = grant_alloc(tokens, members.get, "a", keys, p, 12345, True)
    old = grant_alloc(tokens, members.get, "a", keys, p, 12345, False)
    got = answerrows.unpack_allocs(dict(packed), "client")
    assert got["items"] == [list(it) for it in old["items"]] and got["caps"] == old["caps"]
    # one capability a node: that node's slots in key order, as write_capability makes it
    for j, nid in enumerate(packed["nodes"]):
        slots = [(it[2], it[3], it[4]) for it in got["items"] if it[0] == NEW and it[1] == nid]
        assert packed["caps"][j] == write_capability(members[nid].cap_key, slots, 3, 12345)
    # the tags are the keys' and the table keeps them: a LOOKUP after the commit answers them without computing
    new = [(k, it) for k, it in zip(keys, got["items"]) if it[0] == NEW]
    assert [it[5] for _, it in new] == tokens.tags("a", [k for k, _ in new])
    d.commit("a", [k for k, _ in new], [it[4] for _, it in new], 0.0)
    rows = d._find("a", [k for k, _ in new])
    assert d.cols["tag"][rows].tolist() == [it[5] for _, it in new]


@pytest.mark.parametrize("seed", range(3))
def test_a_turns_allocs_in_one_pass_are_placed_as_one_alloc_of_them_all(seed):
    """``TableDirectory.alloc_placed_many``: several ALLOCs in one pass, each answered from the slice of one ALLOC of
    all their keys on a twin table (states, nodes, offsets, generations, victims; each PENDING row owned by its own
    ALLOC); where the array path would not take them all (a key of two ALLOCs, a PENDING key, a READY key after a
    new one), None and the table untouched."""
    rng = random.Random(seed)
    many, one = _tables(rng.randint(1, 4), rng.randint(30, 80))
    universe: list[bytes] = []
    gen = 1
    for step in range(120):
        asks = []
        for j in range(rng.choice((1, 2, 4, 8))):
            n = rng.choice((1, 5, 16, 40))
            keys = [rng.randbytes(32) if rng.random() < 0.8 else b"long-key-%d-%d-%d" % (step, j, i) for i in range(n)]
            parents = None
            if rng.random() < 0.5:
                parents = [rng.choice((None, keys[i - 1] if i else None, keys[i - 1] if i else None,
                                       rng.choice(universe) if universe else None)) for i in range(n)]
            asks.append([keys, [3000] * n, parents, rng.randrange(1, 1 << 40), f"conn{j}"])
        odd = rng.random()
        if odd < 0.1 and len(asks) > 1:
            asks[-1][0][0] = asks[0][0][-1]  # a key in two ALLOCs
        elif odd < 0.2 and universe:
            asks[0][0][0] = rng.choice(universe)  # a READY (or PENDING) key first: still one pass if READY
        elif odd < 0.25 and universe and len(asks) > 1:
            asks[-1][0][-1] = rng.choice(universe)  # a READY key after new ones
        asks = [tuple(a) for a in asks]
        before = (many.exists("a", universe), [nd.alloc.used for nd in many.placing], many._rr, many.evictions)
        got = many.alloc_placed_many("a", asks, gen, 0.0)
        keys = [k for a in asks for k in a[0]]
        if got is None:
            assert before == (many.exists("a", universe), [nd.alloc.used for nd in many.placing], many._rr,
                              many.evictions), "nothing done"
            assert len(set(keys)) < len(keys) or step and any(
                many._find("a", [k])[0] >= 0 for a in asks[1:] for k in a[0]) or any(
                many.cols["state"][r] == PENDING for r in many._find("a", keys).tolist() if r >= 0), step
            gen += len(keys)
            continue
        placed, _ = got
        whole = one.alloc_placed("a", keys, [s for a in asks for s in a[1]],
                                 [p for a in asks for p in (a[2] or [None] * len(a[0]))]
                                 if any(a[2] for a in asks) else None, gen, 0.0)
        lo = 0
        for a, p in zip(asks, placed):
            hi = lo + len(a[0])
            sl = np.flatnonzero((whole.new >= lo) & (whole.new < hi))
            assert p.state.tolist() == whole.state[lo:hi].tolist(), step
            assert (p.new == whole.new[sl] - lo).all() and [p.names[x] for x in p.node.tolist()] == [
                whole.names[x] for x in whole.node[sl].tolist()]
            assert (p.offs == whole.offs[sl]).all() and (p.gens == whole.gens[sl]).all()
            assert (p.rows == whole.rows[sl]).all()
            assert all(many.writer_of(r) == a[4] for r in p.rows.tolist())
            lo = hi
        new = [(k, int(g)) for a, p in zip(asks, placed) for k, g in zip([a[0][i] for i in p.new.tolist()], p.gens)]
        if new and rng.random() < 0.9:  # most are committed at once; a few wait (PENDING rows)
            for d in (many, one):
                assert d.commit("a", [k for k, _ in new], [g for _, g in new], 0.0)[0] == [True] * len(new)
        universe += [k for k, _ in new]
        gen += len(keys)
        assert many.exists("a", universe) == one.exists("a", universe) and many.evictions == one.evictions
        assert [nd.alloc.used for nd in many.placing] == [nd.alloc.used for nd in one.placing]
        many.check()
        one.check()


def test_an_alloc_that_places_nothing_answers_packed_rows_of_states_only():
    d = TableDirectory()
    tokens = Tokens.load("s", None, "t")
    p = d.alloc_placed("a", [b"x", b"y"], [100, 100], None, 1, 0.0)  # no node: NO_SPACE
    ans = grant_alloc(tokens, lambda n: None, "a", [b"x", b"y"], p, 0, True)
    assert ans["nodes"] == [] and ans["caps"] == []
    rows = np.frombuffer(ans["rows"], answerrows.ALLOC_ROW)
    assert rows["state"].tolist() == [wire.AllocState.NO_SPACE] * 2 and (rows["node"] == answerrows.NO_NODE).all()


def test_the_queues_numpy_copy_keeps_each_nodes_last_queue_across_moves():
    """``QueueCopy``: regions written in place when they fit, at the end when they grow, every live region moved
    together when the end is reached (a retired node's dropped); each node's region always reads back its last
    queue."""
    from metaserver.table.evict import QueueCopy
    from metaserver.table.nodes import NodeRows

    rng = random.Random(3)
    qc = QueueCopy()
    nodes = [NodeRows(i, f"n{i}", 4096, 1 << 30) for i in range(6)]
    last: dict[int, np.ndarray] = {}
    for _ in range(300):
        node = rng.choice(nodes)
        n = rng.choice((0, 5, 100, 1024, rng.randint(1, 5000)))
        rows = np.array([rng.randrange(1 << 40) for _ in range(n)], np.int64)
        qc.put(node, rows, rows.astype(np.uint64) + np.uint64(7))
        last[node.ix] = rows if n or node.ix not in last else last[node.ix][:0]
        if rng.random() < 0.02:  # a node retired: its region is dropped at the next move
            node.ix = None
            nodes.remove(node)
            nodes.append(NodeRows(100 + len(last), "new", 4096, 1 << 30))
        for x in nodes:
            if x.ix in last and len(last[x.ix]):
                got = qc.rows[x.qbase:x.qbase + len(last[x.ix])]
                assert (got == last[x.ix]).all() and (qc.keys[x.qbase:x.qbase + len(got)] == got + 7).all()
    assert qc.end <= len(qc.rows)


def test_an_allocs_long_keys_are_filed_under_its_new_rows_only():
    """An ALLOC's keys that are not their own digest are kept for its NEW rows, by their positions among them: a
    request whose keys are all new, and one that repeats committed keys and a key of its own between new ones (the
    long keys of a row read back are its own, never a neighbour's)."""
    d = TableDirectory()
    d.add_space("n0", 64 * object_size(3000))
    first = [b"long-key-%d" % i for i in range(4)] + [b"k" * 32]
    items, _ = d.alloc("a", first, [3000] * 5, None, 1, 0.0)
    assert [it[0] for it in items] == [NEW] * 5
    assert d.commit("a", first, [it[4] for it in items], 0.0)[0] == [True] * 5
    second = [first[1], b"new-%d" % 0, first[3], b"new-%d" % 0, b"x" * 32, b"a-longer-new-key", first[0]]
    items, _ = d.alloc("a", second, [3000] * 7, None, 100, 0.0)
    states = [it[0] for it in items]
    assert states[1] == states[4] == states[5] == NEW and states[3] != NEW
    rows = d._find("a", first + second).tolist()
    assert all(r >= 0 for r in rows)
    assert [d.key_of(r) for r in rows] == first + second
    assert d.ix.long_keys.keys_of(np.array(rows, np.int64)) == first[:4] + [None] + [
        k if len(k) != 32 else None for k in second]
