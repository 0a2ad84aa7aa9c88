"""metaserver/table/longkeys.py against plain Python oracles: LongCol's select/keep/permute/cat, and LongKeys (chunks
and the dict) against a dict under random bulk adds, single adds and discards, merges and compactions included."""

from __future__ import annotations

import random

import numpy as np

from metaserver.table.longkeys import MAX_CHUNKS, LongCol, LongKeys


def _col(rng: random.Random, n: int) -> tuple[LongCol, dict]:
    pairs = {i: bytes(rng.randrange(256) for _ in range(rng.choice((33, 40, 5)))) for i in range(n)
             if rng.random() < 0.5}
    return LongCol.of(list(pairs.items())), pairs


def test_longcol_operations_match_a_list_of_pairs():
    rng = random.Random(3)
    for _ in range(50):
        n = rng.randrange(1, 60)
        col, pairs = _col(rng, n)
        assert dict(col) == pairs and all(col.at(i) == pairs.get(i) for i in range(n))
        idx = np.array(sorted(rng.sample(range(n), rng.randrange(n + 1))), np.int64)
        assert dict(col.select(idx)) == {j: pairs[i] for j, i in enumerate(idx.tolist()) if i in pairs}
        ok = np.array([rng.random() < 0.6 for _ in range(n)])
        kept = np.flatnonzero(ok).tolist()
        assert dict(col.keep(ok)) == {j: pairs[i] for j, i in enumerate(kept) if i in pairs}
        order = np.array(rng.sample(range(n), n), np.int64)
        perm = col.permute(order)
        assert dict(perm) == {j: pairs[i] for j, i in enumerate(order.tolist()) if i in pairs}
        assert perm.pos.tolist() == sorted(perm.pos.tolist())
        col2, pairs2 = _col(rng, 7)
        both = LongCol.cat([col, col2], [n, 7])
        assert dict(both) == {**pairs, **{n + i: k for i, k in pairs2.items()}}
    for _ in range(30):  # many parts, some empty, some uniform: as a load joins a batch's segments
        parts, sizes, want, at = [], [], {}, 0
        for _ in range(rng.randrange(0, 12)):
            n = rng.randrange(1, 20)
            col, pairs = (LongCol.uniform(n, bytes(range(n)) * 33, 33), None) if rng.random() < 0.3 else _col(rng, n)
            parts.append(col)
            sizes.append(n)
            want.update({at + i: k for i, k in (pairs or dict(col)).items()})
            at += n
        assert dict(LongCol.cat(parts, sizes)) == want
    u = LongCol.uniform(3, b"a" * 33 + b"b" * 33 + b"c" * 33, 33)
    assert list(u) == [(0, b"a" * 33), (1, b"b" * 33), (2, b"c" * 33)]


def test_longkeys_matches_a_dict_through_adds_discards_merges_and_compactions():
    rng = random.Random(5)
    lk, oracle = LongKeys(), {}
    free = list(range(5000))
    rng.shuffle(free)
    for step in range(3 * MAX_CHUNKS + 10):
        if rng.random() < 0.6:  # a load's bulk add of fresh rows
            m = rng.randrange(1, 200)
            rows, free = np.array(free[:m], np.int64), free[m:]
            col, pairs = _col(rng, m)
            lk.add_bulk(rows.take(col.pos), col)
            oracle.update({int(rows[i]): k for i, k in pairs.items()})
        else:  # an ALLOC's: some of its new rows have long keys
            rows = [free.pop() for _ in range(rng.randrange(1, 10))]
            longs = [(i, bytes([step % 256, i]) * 17) for i in range(len(rows)) if rng.random() < 0.7] or [(0, b"k")]
            lk.add(rows, longs)
            oracle.update((rows[i], k) for i, k in longs)
            free.extend(r for i, r in enumerate(rows) if i not in dict(longs))
        live = list(oracle)
        gone = rng.sample(live, len(live) // 3)
        lk.discard(np.array(gone + [10**6], np.int64))  # (a row with no long key is ignored)
        for r in gone:
            del oracle[r]
        free.extend(gone)
        probe = np.array(rng.sample(range(5000), 300), np.int64)
        assert lk.keys_of(probe) == [oracle.get(r) for r in probe.tolist()]
        assert all(lk.get(r) == oracle.get(r) for r in probe.tolist()[:50])
        assert lk.any_of(probe) == any(r in oracle for r in probe.tolist())
        assert sorted(lk.rows().tolist()) == sorted(oracle) and len(lk) == len(oracle)
        assert len(lk.chunks) <= MAX_CHUNKS
    assert bool(lk) == bool(oracle)
