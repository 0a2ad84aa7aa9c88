"""The columnar page table against the service's ``Directory`` (lru, one node): the same random requests (ALLOC with
and without a writer token, COMMIT with right and wrong generations, ABORT, LOOKUP and RELEASE, REMOVE, EXISTS, lease
and PENDING expiry) give the same answers, generations, hits and evictions step by step, and the same totals,
prefix runs and listings. What the table must keep equal before the metaserver can run on it. One node: across
nodes the two place differently (``Directory`` by most free bytes and evicting where the next victim is oldest, the
table in turn) and break recency ties differently (a float time every page of a request shares, against unique
stamps)."""

from __future__ import annotations

import random

import pytest

from metaserver.columns import PageTable
from metaserver.directory import Directory
from metaserver.entry import NEW
from transport.wire import object_size

PLEN = 60_000
SLOTS = 20


def states(items: list) -> list:
    return [(it[0], it[4]) if it[0] == NEW else (it[0],) for it in items]


@pytest.mark.parametrize("seed", range(8))
def test_the_table_answers_as_the_directory_does(seed):
    rng = random.Random(seed)
    d = Directory(policy="lru", pending_ttl_s=5.0, read_lease_s=3.0)
    d.add_space("n0", SLOTS * object_size(PLEN))
    t = PageTable(pending_ttl_s=5.0, read_lease_s=3.0)
    t.add_node("n0", SLOTS * object_size(PLEN))
    universe = [bytes([i]) * 32 for i in range(24)] + [b"key-%d" % i for i in range(16)]
    leases: list[tuple[int, int]] = []  # (directory lease, table lease)
    pending: list[tuple[bytes, int]] = []  # (key, gen) allocated, not yet committed
    gen, now = 1, 1000.0
    expired = retried = 0
    for step in range(300):
        now += rng.choice((0.01, 0.01, 0.5))
        op = rng.random()
        if op < 0.3:
            keys = [rng.choice(universe) for _ in range(rng.randint(1, 6))]  # repeats allowed
            token = rng.choice((None, 7, 8))
            di, _ = d.alloc("a", keys, [PLEN] * len(keys), None, gen, now, token, "w")
            ti = t.alloc("a", keys, [PLEN] * len(keys), gen, None, now, token, "w")
            assert states(ti) == states(di), (step, keys)
            retried += sum(1 for k, it in zip(keys, di) if it[0] == NEW and (k, it[4]) in pending)
            pending += [(k, it[4]) for k, it in zip(keys, di) if it[0] == NEW]
            gen += len(keys)
        elif op < 0.5 and pending:
            batch = rng.sample(pending, min(len(pending), rng.randint(1, 4)))
            keys = [k for k, _ in batch]
            gens = [g if rng.random() < 0.85 else g + 1 for _, g in batch]
            ok, _ = d.commit("a", keys, gens, now)
            assert t.commit("a", keys, gens) == ok, (step, batch)
            pending = [p for p in pending if p not in batch]
        elif op < 0.55 and pending:
            batch = rng.sample(pending, min(len(pending), 2))
            keys, gens = [k for k, _ in batch], [g for _, g in batch]
            assert t.abort("a", keys, gens) == d.abort("a", keys, gens), step
            pending = [p for p in pending if p not in batch]
        elif op < 0.75:
            keys = [rng.choice(universe) for _ in range(rng.randint(1, 8))]
            dl, dlocs = d.lookup("a", keys, now, "r")
            tl, tlocs = t.lookup("a", keys, now, "r")
            assert [x is not None for x in tlocs] == [x is not None for x in dlocs], (step, keys)
            assert [x[3] for x in tlocs if x] == [x[3] for x in dlocs if x], "the same generations"
            assert (dl == 0) == (tl == 0)
            if dl:
                leases.append((dl, tl))
        elif op < 0.88 and leases:
            dl, tl = leases.pop(rng.randrange(len(leases)))
            assert t.release(tl, "r") == d.release(dl, "r")
        elif op < 0.95:
            keys = rng.sample(universe, rng.randint(1, 3))
            removed, _ = d.remove("a", keys)
            assert t.remove("a", keys) == removed, step
        else:  # the background duties, with a budget
            n = d.expire_leases(now, 3)
            assert t.expire_leases(now, 3) == n, step
            m = d.expire_pending(now, 3)
            assert t.expire_pending(now, 3) == m, step
            expired += n + m
        assert t.exists("a", universe) == d.exists("a", universe), step
        assert t.evictions == d.evictions, step
        probe = [rng.choice(universe) for _ in range(6)]
        assert t.prefix("a", probe) == d.prefix("a", probe)
        assert (t.objects, t.pending, t.used, t.capacity) == (d.objects, d.pending, d.used, d.capacity), step
        assert t.namespaces() == d.namespaces() and t.namespace_usage() == d.namespace_usage(), step
        listed, more = t.list_objects("a", 1000)
        assert sorted(listed) == sorted(d.list_objects("a", 1000)[0]) and not more
        assert len(t.list_objects(None, 3)[0]) == min(3, d.objects + d.pending)
    t.check()
    d.check()
    assert d.evictions > 20 and expired and retried, (d.evictions, expired, retried)  # the paths were taken
