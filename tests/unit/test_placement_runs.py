"""Placement in runs (``metaserver/placement.py``: ``Placer.want``, ``Allocator.alloc_run``): a batch spreads over
the nodes in runs, leftovers go back, and a full pool evicts for a run exactly what placing one object at a time
evicts (one LRU across nodes)."""

import random

import metaserver.placement as placement
from metaserver.directory import EXISTS, NEW, Directory
from transport.wire import ALIGN

from test_metaserver_directory import PAGE, make


def test_a_batch_is_placed_in_runs_spread_over_the_nodes_and_leftovers_go_back():
    d = make(units=200, nodes=("n1", "n2"))
    keys = [b"k%d" % i for i in range(96)]
    items, _ = d.alloc("m", keys, [PAGE] * 96, None, 1, 0.0)
    by_node = {n: sorted(it[2] for it in items if it[1] == n) for n in ("n1", "n2")}
    assert len(by_node["n1"]) == len(by_node["n2"]) == 48  # the batch's share of each node
    for offs in by_node.values():  # in runs of adjacent objects: 48 = 32 + 16, two runs a node
        gaps = sum(1 for a, b in zip(offs, offs[1:]) if b != a + ALIGN)
        assert gaps <= 1
    d.check()
    # a request whose later keys exist: the run made for them goes back (used == what the entries hold)
    ok, _ = d.commit("m", keys, [it[4] for it in items], 1.0)
    assert all(ok)
    more = [b"new0"] + keys[:40]
    items2, _ = d.alloc("m", more, [PAGE] * len(more), None, 500, 2.0)
    assert items2[0][0] == NEW and [it[0] for it in items2[1:]] == [EXISTS] * 40
    assert d.used == 97 * ALIGN
    d.check()


def test_runs_evict_exactly_what_one_object_at_a_time_evicts(monkeypatch):
    """Random puts into full pools of 1-3 nodes of unequal sizes, with reads reordering recency. Every eviction,
    placing in runs, takes a page of the least recent use among all the pool's pages (what placing one object at a
    time does: one LRU across nodes). On one node it also evicts exactly the pages, in the order, and answers
    exactly what placing one object at a time (PLACE_RUN = 1) does, a stored next victim inside a request included
    (across nodes, pages of one recency lie on other nodes, so ties may go to other pages of that recency)."""
    run_len = placement.PLACE_RUN
    evict = Directory._evict
    checked = []

    def lru_evict(d, victim, fx):
        if d is checking:
            oldest = min(e.last_access for e in d.ready["m"].values())
            assert victim.last_access == oldest, "a victim more recent than another page"
            checked.append(victim.last_access)
        return evict(d, victim, fx)

    monkeypatch.setattr(Directory, "_evict", lru_evict)
    for seed in range(8):
        rng = random.Random(seed)
        nodes = 1 if seed < 4 else 2 + seed % 2
        runs, single = Directory(policy="lru"), Directory(policy="lru")
        checking = runs
        for i in range(nodes):  # nodes of unequal sizes: their victims' recencies interleave
            for d in (runs, single):
                d.add_space(f"n{i}", (48 - 11 * i) * ALIGN)
        n = 0
        for step in range(60):
            now = float(step)
            if rng.random() < 0.3 and n:
                keys = [b"p%d" % rng.randrange(n) for _ in range(rng.randint(1, 20))]
                for d in (runs, single):
                    lease, _ = d.lookup("m", keys, now)
                    if lease:
                        d.release(lease)
                continue
            keys = [b"p%d" % (n + i) for i in range(rng.randint(1, 40))]
            live = runs.ready.get("m")
            if nodes == 1 and rng.random() < 0.5 and live and len(keys) > 1:
                # a page of the second least recent use, after a new key: one object at a time, the evictions for
                # the new key take the least recent pages and this one is used before it is a victim
                recent = sorted({e.last_access for e in live.values()})
                if len(recent) > 1:
                    keys[1] = next(e.key for e in live.values() if e.last_access == recent[1])
            n += len(keys)
            out = []
            for d, run in ((runs, run_len), (single, 1)):
                monkeypatch.setattr(placement, "PLACE_RUN", run)
                items, fx = d.alloc("m", keys, [PAGE] * len(keys), None, 1000 * step, now)
                new = [(k, it[4]) for k, it in zip(keys, items) if it[0] == NEW]
                d.commit("m", [k for k, _ in new], [g for _, g in new], now)
                out.append(([it[0] for it in items], [k for _, k in fx.deletes], d.evictions))
            if nodes == 1:
                assert out[0] == out[1], (seed, step)
            runs.check()
            single.check()
        assert runs.evictions > 200, "the pools were full"
    assert len(checked) > 1600
