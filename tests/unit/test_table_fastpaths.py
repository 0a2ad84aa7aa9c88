"""The small-batch shortcuts of the table's LOOKUP, RELEASE and key-index delete give what the general path gives.

``index.SET_FIRST`` (a delete round tells two deletes in one bucket with a set up to that many, by np.unique past
it) and a table of one namespace and one layout (its key index does not read the rows' namespaces, a LOOKUP not
their layouts): one random workload (ALLOC+COMMIT into full nodes, so victims leave the key index; LOOKUPs with
repeated and missing keys; RELEASEs; REMOVEs of pinned keys) runs once with the shortcuts and once with SET_FIRST 0
and a second namespace and layout interned, and every answer (hits, rows, tags, capability slots, nodes, ALLOC
states) and the final columns must be equal."""

from __future__ import annotations

import random

import numpy as np

from metaserver.table import columns, index
from metaserver.table.directory import TableDirectory
from metaserver.table.entry import NEW
from transport.objformat import object_size

PLEN = 4000


class _Tags:
    """Stand-in for ``umbp.auth.Tokens``: a key's tag from its bytes (never 0)."""

    @staticmethod
    def tags(ns, keys):
        return [int.from_bytes(k[:8], "little") | 1 for k in keys]


def _run(seed: int, namespaces: int = 1) -> tuple[list, dict]:
    rng = random.Random(seed)
    d = TableDirectory()
    for i in range(namespaces):
        d._ns("ns" if i == 0 else f"other-{i}")  # ("ns" first: its index, so its keys' buckets, stay the same)
    if namespaces > 1:  # and a second layout code: LOOKUP reads each row's (PLEN's index stays 0)
        d._code(PLEN)
        d._code(PLEN + 1)
    for i in range(4):
        d.add_space(f"n{i}", 300 * object_size(PLEN))  # 1,200 pages: the workload's 3,000 keys evict
    keys = [rng.randbytes(32) for _ in range(3000)]
    made: list[bytes] = []
    leases: list[int] = []
    out: list = []
    gen = 1
    for step in range(400):
        op = rng.random()
        if op < 0.35:
            n = rng.choice((1, 3, 8, 20, 40, 90))
            ks = list(dict.fromkeys(rng.choice(keys) for _ in range(n)))
            p = d.alloc_placed("ns", ks, [PLEN] * len(ks), None, gen, 0.0)
            gen += len(ks)
            new = p.new.tolist()
            out.append(("alloc", p.state.tolist(), new, p.node.tolist(), p.offs.tolist()))
            d.commit("ns", [ks[i] for i in new], p.gens.tolist(), 0.0)
            made.extend(ks[i] for i in new)
        elif op < 0.75 and made:
            n = rng.choice((1, 2, 5, 8, 16, 31, 33, 64, 130))
            ks = [rng.choice(made) if rng.random() < 0.8 else rng.randbytes(32) for _ in range(n)]
            if n > 1 and rng.random() < 0.5:
                ks[-1] = ks[0]  # a key twice: its row pinned twice
            lease, hit, tags, slots, nix = d.lookup_columns("ns", ks, 0.0, None, _Tags)
            out.append(("lookup", bool(lease), hit.tolist(), None if tags is None else tags.tolist(),
                        None if slots is None else slots.tolist(), None if nix is None else nix.tolist()))
            if lease:
                leases.append(lease)
        elif op < 0.9 and leases:
            out.append(("release", d.release(leases.pop(rng.randrange(len(leases))))))
        elif made:
            ks = [rng.choice(made) for _ in range(rng.choice((1, 4, 12)))]
            out.append(("remove", d.remove("ns", ks)[0]))
        if step % 50 == 0:
            d.check()
    while leases:
        out.append(("release", d.release(leases.pop())))
    d.check()
    live = np.flatnonzero(d.cols["state"] != 3)
    cols = {name: d.cols[name][live].tolist() for name in ("node", "unit", "gen", "pins", "stamp", "state", "tag")}
    cols["found"] = d._find("ns", keys).tolist()
    cols["evictions"] = d.evictions
    return out, cols


def test_shortcuts_match_the_general_path(monkeypatch):
    for seed in (1, 2):
        fast = _run(seed)
        with monkeypatch.context() as m:
            m.setattr(index, "SET_FIRST", 0)
            slow = _run(seed, namespaces=2)
        assert fast[0] == slow[0]
        assert fast[1] == slow[1]
        assert any(x[0] == "lookup" and x[1] for x in fast[0])  # the workload did look pages up
        assert any(x[0] == "alloc" and NEW in x[1] for x in fast[0])
        assert fast[1]["evictions"] > 0  # victims left the key index (deletes of several rows a round)


def test_absent_keys_miss_when_the_last_row_is_ready():
    """A LOOKUP masks absent keys (row -1, which reads the columns' last row) only while that row is READY: with the
    last row's state READY (set by hand on a row no key names), absent keys still miss, present ones hit, one named
    twice is pinned twice; with it FREE, the same."""
    d = TableDirectory()
    d.add_space("n0", 64 * object_size(PLEN))
    keys = [i.to_bytes(32, "little") for i in range(40)]
    p = d.alloc_placed("ns", keys, [PLEN] * 40, None, 1, 0.0)
    assert d.commit("ns", keys, p.gens.tolist(), 0.0)[0] == [True] * 40
    st = d.cols["state"]
    last = len(st) - 1
    assert st[last] != columns.READY and last not in d._find("ns", keys).tolist()
    absent = (1 << 200).to_bytes(32, "little")
    for state in (columns.READY, st[last]):
        before = st[last]
        st[last] = state
        lease, hit, hr = d.lookup_rows("ns", [absent, keys[5], absent, keys[5]], 0.0)
        assert hit.tolist() == [False, True, False, True] and len(hr) == 2
        assert d.cols["pins"][hr[0]] == 2
        assert d.release(lease) and d.cols["pins"][hr[0]] == 0
        st[last] = before
    assert d.hits == 4 and d.misses == 4
    d.check()


def test_a_commit_naming_a_key_twice_files_it_once():
    """COMMIT of a key given twice (both with its generation, or the second with another): True for each naming
    with the right generation, the row READY, stamped and filed under the commit record once, nothing left
    pending; the table's invariants hold."""
    d = TableDirectory()
    d.add_space("n0", 16 * object_size(PLEN))
    keys = [i.to_bytes(32, "little") for i in range(4)]
    p = d.alloc_placed("ns", keys, [PLEN] * 4, None, 1, 0.0)
    g = p.gens.tolist()
    clock = d.clock
    ok = d.commit("ns", [keys[0], keys[1], keys[0], keys[2], keys[2]], [g[0], g[1], g[0], g[2], g[2] + 7], 0.0)[0]
    assert ok == [True, True, True, True, False]
    assert d.clock == clock + 3  # each committed row stamped once
    rows = d._find("ns", keys).tolist()
    assert [int(d.cols["state"][r]) for r in rows] == [columns.READY] * 3 + [columns.PENDING]
    assert set(d._pending) == {rows[3]}
    d.check()
