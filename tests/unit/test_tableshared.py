"""Shared entries on the columnar directory (``metaserver/table/shared.py``), lru, one full node: random requests of
TP ranks (ALLOC and COMMIT per rank with and without writer tokens and with wrong generations, two TP sizes for the
same keys, plain requests mixed in, LOOKUP per rank and plain, RELEASE, ABORT, REMOVE, expiry) against a model of
each key's last placement: every LOOKUP answers, for each key EXISTS reports, exactly its rank's sub-slot of the page
of its layout (``offset + rank * stride``, the part length, the page's one generation) and a miss for any other
layout; a rank's NEW item is its sub-slot of the page the first rank placed; the invariant check holds throughout.
The hand-written cases are in test_directory_shared.py."""

from __future__ import annotations

import random

import pytest

from metaserver.table.entry import EXISTS, IN_FLIGHT, NEW
from metaserver.table.directory import TableDirectory
from transport.objformat import object_size

PART = 30_000
STRIDE = object_size(PART)
PLAIN = 2 * STRIDE - 64  # a plain page of one shared entry's extent (64: the object header)
SLOTS = 24


@pytest.mark.parametrize("seed", range(8))
def test_shared_entries_answer_each_rank_its_sub_slot_of_the_page_placed(seed):
    rng = random.Random(seed)
    t = TableDirectory(pending_ttl_s=5.0, read_lease_s=3.0)
    t.add_space("n0", SLOTS * STRIDE)
    universe = [bytes([i]) * 32 for i in range(20)]
    owners = ["w0", "w1", "w2", "w3"]
    placed: dict[bytes, tuple] = {}  # key -> (parts (0: plain), gen, node, base offset) of its last NEW page
    leases: list[int] = []
    handed: list[tuple[bytes, int, tuple]] = []  # (key, gen, shard) of NEW items: what COMMIT may name
    gen, now = 1, 1000.0
    seen = {"complete": 0, "in_flight": 0, "exists_rank": 0, "lookup_hits": 0, "retried": 0}
    for step in range(400):
        now += rng.choice((1 / 64, 1 / 64, 0.5))
        op = rng.random()
        n = rng.choice((2, 2, 2, 4))
        shard = (rng.randrange(n), n)
        if op < 0.35:
            keys = [rng.choice(universe) for _ in range(rng.randint(1, 5))]
            plain = rng.random() < 0.1
            sh = None if plain else shard
            items, _ = t.alloc("a", keys, [PLAIN if plain else PART] * len(keys), None, gen, now,
                               rng.choice((None, 7, 8)), owners[shard[0]], sh)
            for k, it in zip(keys, items):
                if it[0] != NEW:
                    continue
                parts, rk = (0, 0) if plain else (n, shard[0])
                page = placed.get(k)
                if page is not None and page[:3] == (parts, it[4], it[1]):  # a later rank, or a retry: that page
                    assert it[2] == page[3] + rk * STRIDE, (step, k)
                    seen["retried"] += 1
                else:  # a new page: its base from this rank's sub-slot
                    placed[k] = (parts, it[4], it[1], it[2] - rk * STRIDE)
                assert it[3] == (PLAIN if plain else PART)
            handed += [(k, it[4], sh) for k, it in zip(keys, items) if it[0] == NEW]
            seen["in_flight"] += sum(1 for it in items if it[0] == IN_FLIGHT)
            seen["exists_rank"] += sum(1 for it in items if it[0] == EXISTS)
            gen += len(keys)
        elif op < 0.6 and handed:
            batch = rng.sample(handed, min(len(handed), rng.randint(1, 4)))
            sh = batch[0][2]
            batch = [b for b in batch if b[2] == sh]
            before = t.objects
            t.commit("a", [k for k, _, _ in batch], [g if rng.random() < 0.9 else g + 1 for _, g, _ in batch], now, sh)
            handed = [h for h in handed if h not in batch]
            seen["complete"] += max(0, t.objects - before)
        elif op < 0.8:
            keys = [rng.choice(universe) for _ in range(rng.randint(1, 6))]
            ready = [k for k, ok in zip(universe, t.exists("a", universe)) if ok]
            if ready and rng.random() < 0.5:  # pages that are there, mostly
                keys = [rng.choice(ready)] + keys[1:]
            sh = None if rng.random() < 0.2 else shard
            first = placed.get(keys[0])
            if sh is not None and first and first[0] and rng.random() < 0.5:  # the layout of a page placed
                sh = (rng.randrange(first[0]), first[0])
            here = t.exists("a", keys)
            lease, locs = t.lookup("a", keys, now, None, sh)
            parts, rk = (0, 0) if sh is None else (sh[1], sh[0])
            want = []
            for k, ok in zip(keys, here):
                page = placed.get(k)
                if not ok or page[0] != parts:
                    want.append(None)
                else:
                    want.append((page[2], page[3] + rk * STRIDE, PLAIN if parts == 0 else PART, page[1]))
            assert [tuple(x) if x else None for x in locs] == want, (step, keys, sh)
            assert bool(lease) == any(want)
            seen["lookup_hits"] += sum(1 for x in want if x)
            if lease:
                leases.append(lease)
        elif op < 0.88 and leases:
            t.release(leases.pop(rng.randrange(len(leases))))
        elif op < 0.92 and handed:
            k, g, _ = rng.choice(handed)
            t.abort("a", [k], [g])
        elif op < 0.95:
            t.remove("a", [rng.choice(universe) for _ in range(2)])
        else:
            t.expire_pending(now, 100)
            t.expire_leases(now, 100)
        assert t.used <= t.capacity
        t.check()
    assert all(v > 0 for v in seen.values()), seen
    assert t.evictions > 0, "the node filled, and evicted"
