"""Shared entries on the columnar directory (``metaserver/tableshared.py``) against ``Directory``'s
(``metaserver/shared.py``), lru, one node: the same random requests of TP ranks (ALLOC and COMMIT per rank with and
without writer tokens and with wrong generations, two TP sizes for the same keys, plain requests mixed in, LOOKUP per
rank and plain, RELEASE, ABORT, REMOVE, expiry) give the same items, generations, sub-slots, answers and totals step
by step, and both invariant checks hold throughout."""

from __future__ import annotations

import random

import pytest

from metaserver.directory import Directory
from metaserver.entry import NEW
from metaserver.tabledir import TableDirectory
from transport.wire import object_size

PART = 30_000
PLAIN = 2 * object_size(PART) - 64  # a plain page of one shared entry's extent (64: the object header)
SLOTS = 24


def norm(items: list) -> list:
    return [tuple(it) if it[0] == NEW else (it[0],) for it in items]


@pytest.mark.parametrize("seed", range(8))
def test_shared_entries_on_the_table_answer_as_the_directory_does(seed):
    rng = random.Random(seed)
    d = Directory(policy="lru", pending_ttl_s=5.0, read_lease_s=3.0)
    t = TableDirectory(pending_ttl_s=5.0, read_lease_s=3.0)
    for x in (d, t):
        x.add_space("n0", SLOTS * object_size(PART))
    universe = [bytes([i]) * 32 for i in range(20)]
    owners = ["w0", "w1", "w2", "w3"]
    leases: list[tuple[int, int]] = []
    handed: list[tuple[bytes, int, tuple]] = []  # (key, gen, shard) of NEW items: what COMMIT may name
    gen, now = 1, 1000.0
    seen = {"complete": 0, "in_flight": 0, "exists_rank": 0, "lookup_hits": 0}
    for step in range(400):
        now += rng.choice((1 / 64, 1 / 64, 0.5))  # binary fractions: the table keeps PENDING deadlines in ms
        op = rng.random()
        # Every extent is 2 object slots of PART (a shared entry of 2 parts, or a plain page of PLAIN), so both
        # allocators see the same holes: the table hands a same-size victim's extent over where Directory frees it
        # and allocates first-fit, which differ only where sizes differ. 4 parts: an ALLOC only of keys PENDING
        # with 2 (IN_FLIGHT: another layout), COMMIT and LOOKUP of any.
        n = rng.choice((2, 2, 2, 4))
        shard = (rng.randrange(n), n)
        if op < 0.35:
            keys = [rng.choice(universe) for _ in range(rng.randint(1, 5))]
            if n == 4:
                pd = d.pending_keys.get("a") or {}
                keys = [k for k in keys if k in pd]
            token = rng.choice((None, 7, 8))
            plain = rng.random() < 0.1
            sizes = [PART if not plain else PLAIN] * len(keys)
            sh = None if plain else shard
            owner = owners[shard[0]]
            di, _ = d.alloc("a", keys, sizes, None, gen, now, token, owner, sh)
            ti, _ = t.alloc("a", keys, sizes, None, gen, now, token, owner, sh)
            assert norm(ti) == norm(di), (step, keys, sh)
            handed += [(k, it[4], sh) for k, it in zip(keys, di) if it[0] == NEW]
            seen["in_flight"] += sum(1 for it in di if it[0] == 3)
            seen["exists_rank"] += sum(1 for it in di if it[0] == 1)
            gen += len(keys)
        elif op < 0.6 and handed:
            batch = rng.sample(handed, min(len(handed), rng.randint(1, 4)))
            sh = batch[0][2]
            batch = [b for b in batch if b[2] == sh]
            keys = [k for k, _, _ in batch]
            gens = [g if rng.random() < 0.9 else g + 1 for _, g, _ in batch]
            before = d.objects
            dok, _ = d.commit("a", keys, gens, now, sh)
            tok, _ = t.commit("a", keys, gens, now, sh)
            assert tok == dok, (step, batch)
            handed = [h for h in handed if h not in batch]
            seen["complete"] += max(0, d.objects - before)
        elif op < 0.8:
            keys = [rng.choice(universe) for _ in range(rng.randint(1, 6))]
            sh = None if rng.random() < 0.2 else shard
            dl, dlocs = d.lookup("a", keys, now, None, sh)
            tl, tlocs = t.lookup("a", keys, now, None, sh)
            assert [tuple(x) if x else None for x in tlocs] == dlocs, (step, keys, sh)
            assert bool(tl) == bool(dl)
            seen["lookup_hits"] += sum(1 for x in dlocs if x)
            if dl:
                leases.append((dl, tl))
        elif op < 0.88 and leases:
            dl, tl = leases.pop(rng.randrange(len(leases)))
            assert t.release(tl) == d.release(dl)
        elif op < 0.92 and handed:
            k, g, _ = rng.choice(handed)
            assert t.abort("a", [k], [g]) == d.abort("a", [k], [g])
        elif op < 0.95:
            keys = [rng.choice(universe) for _ in range(2)]
            assert t.remove("a", keys)[0] == d.remove("a", keys)[0]
        else:
            assert t.expire_pending(now, 100) == d.expire_pending(now, 100)
            assert t.expire_leases(now, 100) == d.expire_leases(now, 100)
        assert t.exists("a", universe) == d.exists("a", universe), step
        assert (t.objects, t.pending, t.used, t.evictions) == (d.objects, d.pending, d.used, d.evictions), step
        t.check()
        d.check()
    assert all(v > 0 for v in seen.values()), seen
