"""The full load's one key index insert for all nodes (``load.load_nodes``, ``indexbulk.stage``/``insert_staged``)
against the load a node at a time: the same table (``fingerprint``, ``check``), the same stale, rejected and held
pages, the same commit records, with keys given twice within a node (rule 3), overlapping extents (rule 2), long
keys, several namespaces, a node with no description; and a key on two nodes falls back to a load a node."""

from __future__ import annotations

import random

import numpy as np
import pytest

import metaserver.table.directory as directory
from metaserver.table import indexbulk
from metaserver.table.columns import BLOCK
from metaserver.table.directory import TableDirectory
from metaserver.table.entry import READY
from metaserver.table.load import fingerprint
from metaserver.table.snapshot import PageRecords
from transport.objformat import ALIGN, ARENA_DATA_START

PREFIX = b"/umbp/pages/"
UNITS = 400
NODES = ["n0", "n1", "n2", "n3", "n9"]  # n9: no description


def records(rng: random.Random, n: int, shared: int) -> list[tuple]:
    """``page_record`` tuples over NODES: keys of 32 and 33 bytes in 3 namespaces, a few given twice on their own
    node, ``shared`` given on two nodes, offsets mostly dense and some overlapping, revisions shared by a few."""
    out = []
    cursor = {x: 0 for x in NODES}
    mine: dict = {x: [] for x in NODES}
    for i in range(n):
        node = rng.choice(NODES)
        ns = rng.choice(["a", "b", "c"])
        key = rng.randbytes(32) if rng.random() < 0.5 else rng.randbytes(33)
        if mine[node] and rng.random() < 0.04:
            ns, key = rng.choice(mine[node])  # twice on one node
        mine[node].append((ns, key))
        units = 1 if rng.random() > 0.1 else 2
        slot = cursor[node] if rng.random() > 0.05 else max(0, cursor[node] - 1)  # some overlap
        cursor[node] = slot + units
        rev = 100 + (i if rng.random() > 0.1 else max(0, i - 1))
        out.append((rev, node, ns, key, ARENA_DATA_START + slot * ALIGN, units * ALIGN - 64, i + 1, None,
                    PREFIX + ns.encode() + b"/" + key.hex().encode()))
    for j in range(shared):  # a key on two nodes
        p = out[j]
        other = NODES[(NODES.index(p[1]) + 1) % 4]
        cursor[other] += 1
        out.append((p[0] + n, other) + p[2:4] + (ARENA_DATA_START + cursor[other] * ALIGN,) + p[5:])
    rng.shuffle(out)
    return out


def load(pages: list[tuple], per_node: bool, monkeypatch) -> tuple:
    with monkeypatch.context() as m:
        staged = []
        real = indexbulk.insert_staged
        m.setattr(indexbulk, "insert_staged", lambda ix, parts, ns, *a: (staged.append(len(parts)), real(ix, parts, ns, *a)))
        if per_node:
            m.setattr(directory, "load_nodes", lambda t, loads, file: [file(x, p, None, False) for x, p in loads])
        t = TableDirectory(policy="lru")
        held: list = []
        stale, rejected = t.load({x: ({"capacity": 2 * UNITS * ALIGN}, 0) for x in NODES[:4]},
                                 PageRecords.of(pages), held)
        t.check()
        return t, stale, rejected, held, staged


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("shared", [0, 2])
def test_one_insert_for_all_nodes_equals_a_load_a_node(seed, shared, monkeypatch):
    pages = records(random.Random(seed), 600, shared)
    t, stale, rejected, held, staged = load(pages, False, monkeypatch)
    ref, stale_ref, rej_ref, held_ref, _ = load(pages, True, monkeypatch)
    assert staged == ([] if shared else [4])  # the bulk path ran (a key on two nodes: a load a node)
    assert fingerprint(t) == fingerprint(ref)
    assert t.objects == ref.objects > 400
    assert stale == stale_ref and len(stale) == sum(p[1] == "n9" for p in pages) > 0
    assert rejected == rej_ref and held == held_ref and rejected  # (overlaps and keys twice: some)
    assert sorted(t.ix.long_keys.rows().tolist()) and len(t.ix.long_keys) == len(ref.ix.long_keys)
    assert t.commits.take() == ref.commits.take()
    rows = np.flatnonzero(t.cols["state"][:t.blocks_used * BLOCK] == READY)
    assert sorted(zip(t.cols["ns"].take(rows).tolist(), t.ix.keys_of(rows))) == sorted(
        zip(ref.cols["ns"].take(ref_rows := np.flatnonzero(ref.cols["state"][:ref.blocks_used * BLOCK] == READY))
            .tolist(), ref.ix.keys_of(ref_rows)))


def test_a_load_of_no_page(monkeypatch):
    t, stale, rejected, held, staged = load([], False, monkeypatch)
    assert (t.objects, stale, rejected, held, staged) == (0, [], [], [], [])
