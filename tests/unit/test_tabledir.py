"""``metaserver/table/directory.py``: what the service asks of the directory beyond the table's own calls (those are
tested in test_directory*.py and test_columns.py): the LOOKUP grants against a per-key oracle (``granted``), a
connection's PENDING handles, the eviction passes and their commit records."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from metaserver.table.entry import NEW, Effects
from metaserver.table.records import pages_of
from metaserver.table.directory import TableDirectory
from transport import answerrows
from transport.keyform import PackedKeys
from transport.objformat import object_size
from umbp.auth import Tokens, read_capability
from umbp.errors import ConfigError

PLEN = 60_000


def directory(nodes: int = 2, slots: int = 8) -> TableDirectory:
    d = TableDirectory()
    for i in range(nodes):
        d.add_space(f"n{i}", slots * object_size(PLEN))
    return d


def keys_of(lo: int, hi: int) -> list[bytes]:
    return [i.to_bytes(32, "little") for i in range(lo, hi)]


def put(d: TableDirectory, keys: list[bytes], gen: int, owner=None) -> Effects:
    items, _ = d.alloc("a", keys, [PLEN] * len(keys), None, gen, 0.0, None, owner)
    new = [(k, it[4]) for k, it in zip(keys, items) if it[0] == NEW]
    ok, fx = d.commit("a", [k for k, _ in new], [g for _, g in new], 0.0)
    assert ok == [True] * len(new)
    return fx


def granted(tokens: Tokens, members: dict, ns: str, keys: list, locs: list, rank: int | None = None
            ) -> tuple[list, dict]:
    """The oracle of a LOOKUP's grants, a key at a time: each hit's tag (of (key, rank) for a rank's sub-slot) and,
    per node, one read capability over the (offset, payload length, generation) of its hits in key order."""
    hits = [i for i, loc in enumerate(locs) if loc is not None]
    tags = dict(zip(hits, tokens.tags(ns, [keys[i] for i in hits], rank))) if hits else {}
    slots: dict[str, list] = {}
    for i in hits:
        slots.setdefault(locs[i][0], []).append(tuple(locs[i][1:4]))
    caps = {n: read_capability(members[n].cap_key if n in members else None, s) for n, s in slots.items()}
    return [tuple(loc) + (tags[i],) if loc is not None else None for i, loc in enumerate(locs)], caps


def caps_by_node(locs: list, caps: list) -> dict:
    """An answer's capabilities by node (each hit names its node's by index)."""
    return {loc[0]: caps[loc[5]] for loc in locs if loc is not None}


@pytest.mark.parametrize("closed", [False, True])
def test_lookup_granted_answers_as_a_per_key_oracle(closed):
    d = directory()
    put(d, keys_of(0, 10), 1)
    tokens = Tokens(b"s" * 32, {}) if closed else Tokens(None, {})
    members = {f"n{i}": SimpleNamespace(cap_key=(b"%d" % i) * 32 if closed else None) for i in range(2)}
    ask = keys_of(0, 4) + [b"\xff" * 32] + keys_of(4, 10)  # one miss among them
    for packed in (False, True, False):  # the second time on the tags come from the column
        ans = d.lookup_granted("a", ask, 0.0, None, tokens, members.get, None, packed)
        assert ("rows" in ans) == packed and ("locs" in ans) != packed
        lease, locs, caps = ans["lease"], answerrows.unpack_locs(ans, "test")["locs"], ans["caps"]
        want_lease, want = d.lookup("a", ask, 0.0)
        want, want_caps = granted(tokens, members, "a", ask, want)
        assert lease and want_lease and lease != want_lease
        assert [tuple(x[:5]) if x is not None else None for x in locs] == want
        assert caps_by_node(locs, caps) == want_caps and len(caps) == 2
        assert all(c == b"" for c in caps) != closed
        assert d.release(lease) and d.release(want_lease)
    assert d.lookup_granted("a", [b"\xee" * 32], 0.0, None, tokens, members.get) == {
        "lease": 0, "locs": [None], "caps": []}
    missed = d.lookup_granted("a", [b"\xee" * 32] * 2, 0.0, None, tokens, members.get, None, True)
    assert answerrows.unpack_locs(missed, "test") == {"lease": 0, "nodes": [], "caps": [], "locs": [None, None]}



def test_a_turns_lookups_answer_each_exactly_as_alone():
    """``lookup_columns_many``: every LOOKUP of a turn is answered (``granted_answer``) as ``lookup_granted``
    answers it alone on a twin table (rows, tags, capabilities, misses, a key named twice, one with no hit at all, listed and packed keys, both
    answer forms), under a lease of its own that pins its own hits, which its release gives back; the stamps are
    the twin's."""
    tokens = Tokens(b"s" * 32, {})
    members = {f"n{i}": SimpleNamespace(cap_key=(b"%d" % i) * 32) for i in range(2)}
    d, twin = directory(slots=16), directory(slots=16)
    for t in (d, twin):
        put(t, keys_of(0, 24), 1)
    miss = [b"\xee" * 32]
    asks = [(keys_of(0, 5), "a", True), (miss * 2, "b", True), (keys_of(3, 9) + miss + keys_of(3, 4), "c", False),
            (PackedKeys(b"".join(keys_of(20, 24))), "d", True), (keys_of(9, 10), "e", True)]
    for _ in range(2):  # the second time on, every tag comes from the column
        cols = d.lookup_columns_many("a", [(k, o) for k, o, _ in asks], 0.0, tokens)
        got = [d.granted_answer(c, members.get, p) for c, (_, _, p) in zip(cols, asks)]
        want = [twin.lookup_granted("a", k, 0.0, o, tokens, members.get, None, p) for k, o, p in asks]
        assert len(got) == len(asks)
        for g, w in zip(got, want):
            assert bool(g["lease"]) == bool(w["lease"]) and g["lease"] != w["lease"] or not w["lease"]
            assert {k: x for k, x in g.items() if k != "lease"} == {k: x for k, x in w.items() if k != "lease"}
        assert not got[1]["lease"] and len({g["lease"] for g in got}) == len(got)
        assert (d.cols["pins"] == twin.cols["pins"]).all() and d.cols["pins"].sum() == 5 + 7 + 4 + 1
        assert (d.cols["stamp"] == twin.cols["stamp"]).all()
        assert [d._lease_owner[g["lease"]] for g in got if g["lease"]] == ["a", "c", "d", "e"]
        assert d.release(got[2]["lease"]) and d.cols["pins"].sum() == 10  # its own hits only
        for g, w in zip(got, want):
            if w["lease"]:
                d.release(g["lease"])
                twin.release(w["lease"])
        assert d.cols["pins"].sum() == 0 == twin.cols["pins"].sum()
    d.check()


@pytest.mark.parametrize("packed", [False, True])
def test_lookup_granted_of_one_node_and_a_repeated_key_answers_as_the_oracle(packed):
    """Every hit on one node (``by_node``'s one-node path: one capability) and a key named twice (pinned once a
    naming under the one lease, as ``lookup`` pins it)."""
    d = directory()
    put(d, keys_of(0, 10), 1)
    tokens = Tokens(b"s" * 32, {})
    members = {f"n{i}": SimpleNamespace(cap_key=(b"%d" % i) * 32) for i in range(2)}
    lease, locs = d.lookup("a", keys_of(0, 10), 0.0)
    assert d.release(lease)
    on_n1 = [k for k, loc in zip(keys_of(0, 10), locs) if loc[0] == "n1"]
    ask = on_n1 + [b"\xff" * 32, on_n1[0]]
    ans = d.lookup_granted("a", ask, 0.0, None, tokens, members.get, None, packed)
    got = answerrows.unpack_locs(ans, "test")["locs"]
    want_lease, want = d.lookup("a", ask, 0.0)
    want, want_caps = granted(tokens, members, "a", ask, want)
    assert [tuple(x[:5]) if x is not None else None for x in got] == want and got[len(on_n1)] is None
    assert len(ans["caps"]) == 1 and caps_by_node(got, ans["caps"]) == want_caps
    row = int(d._find("a", on_n1[:1])[0])
    assert d.cols["pins"][row] == 4  # named twice by each of the two leases
    assert d.release(ans["lease"]) and d.release(want_lease)
    assert d.pinned == 0
    d.check()

def test_pending_handles_settle_and_abort_only_the_owners():
    d = directory()
    me, other = object(), object()
    keys = keys_of(0, 6)
    p = d.alloc_placed("a", keys, [PLEN] * 6, None, 100, 0.0, 7, me)
    held = dict(d.pending_of("a", keys, p))
    assert list(held) == [("a", k, 100 + i) for i, k in enumerate(keys)]
    assert list(held.values()) == p.rows.tolist() and len(set(held.values())) == 6
    rows = d.settle_handles(held, "a", keys[:2] + keys_of(9, 10), [100, 101, 100])
    assert rows == p.rows[:2].tolist() + [-1] and len(held) == 4
    ok, _ = d.commit("a", keys[:2] + keys_of(9, 10), [100, 101, 100], 0.0, None, rows)
    assert ok == [True, True, False]
    d.alloc("a", keys[2:3], [PLEN], None, 200, 0.0, 7, other)  # a retry with the token: key 2 is other's now
    assert d.abort_owned(held, me) == 3 and d.pending == 1
    assert d.exists("a", keys) == [True, True, False, False, False, False]
    assert d.abort_owned([("a", keys[2], 102)], other) == 1 and d.pending == 0
    d.check()


def test_commit_from_handle_rows_equals_commit_by_key():
    """A COMMIT starts from the rows its connection's handles name; any row that does not hold the key's allocation
    (-1, out of the table, another allocation's, a row freed since) is found by key, so the answer and the table are
    exactly a COMMIT by key's."""
    d, ref = directory(slots=16), directory(slots=16)
    keys = keys_of(0, 10)
    p = d.alloc_placed("a", keys, [PLEN] * 10, None, 100, 0.0)
    ref.alloc_placed("a", keys, [PLEN] * 10, None, 100, 0.0)
    rows = p.rows.tolist()
    d.abort("a", keys[9:], [109])  # key 9's row freed
    ref.abort("a", keys[9:], [109])
    stale = [-1, rows[0], 1 << 40, rows[1]]  # keys 1-4: not known, key 0's row, past the table, key 1's row
    given = rows[:1] + stale + rows[5:8] + [rows[9], rows[9]]  # key 8: a freed row; key 9: its own, freed
    gens = [100, 101, 102, 103, 104, 105, 106, 999, 108, 109]  # key 7: a generation it never had
    ok, _ = d.commit("a", keys, gens, 0.0, None, given)
    assert ok == ref.commit("a", keys, gens, 0.0)[0] == [True] * 7 + [False, True, False]
    assert d.exists("a", keys) == ref.exists("a", keys) == [True] * 7 + [False, True, False]
    again, _ = d.commit("a", keys[:2], [100, 101], 0.0, None, [rows[1], rows[0]])  # READY with those: True again
    assert again == [True, True]
    d.check()


def test_eviction_passes_free_the_oldest_and_rewrite_their_records():
    d = directory(nodes=1, slots=8)
    for i in range(8):
        put(d, keys_of(i, i + 1), 10 + i)
    d.lookup("a", keys_of(0, 1), 0.0)  # key 0 used last... and pinned: never a victim
    assert d.needs_eviction(0.9)
    fx = Effects()
    n, freed = d.watermark_pass(0.9, 0.5, 100, fx)
    assert n == 4 and freed == 4 * object_size(PLEN)
    assert d.exists("a", keys_of(0, 8)) == [True, False, False, False, False, True, True, True]
    # the eight COMMITs joined one open segment (no writer took it in between): it is rewritten with the four left
    (rec,) = fx.batches
    assert sorted(p[0] for p in pages_of(rec.value())) == [keys_of(i, i + 1)[0] for i in (0, 5, 6, 7)]
    fx = Effects()
    assert d.evict_all(2, fx)[:2] == (2, 2 * object_size(PLEN))
    assert d.evict_all(100, fx) == (1, object_size(PLEN), True)  # key 0 stays: pinned
    assert d.objects == 1 and d.evictions == 7
    d.check()


def test_refusals():
    with pytest.raises(ConfigError, match="lru or prefix-lru"):
        TableDirectory(policy="fifo")


def test_shared_lookup_grants_a_ranks_sub_slot_with_its_rank_tag():
    d = directory(nodes=1)
    keys = keys_of(0, 3)
    tokens = Tokens(b"s" * 32, {})
    for rk in range(2):
        items, _ = d.alloc("a", keys, [PLEN] * 3, None, 10, 0.0, None, None, (rk, 2))
        assert d.commit("a", keys, [it[4] for it in items], 0.0, (rk, 2))[0] == [True] * 3
    members = {"n0": SimpleNamespace(cap_key=b"k" * 32)}
    for rk in range(2):
        ans = answerrows.unpack_locs(d.lookup_granted("a", keys, 0.0, None, tokens, members.get, (rk, 2), True), "t")
        locs, caps = ans["locs"], ans["caps"]
        want_lease, want = d.lookup("a", keys, 0.0, None, (rk, 2))
        assert [tuple(x) for x in locs] == [w + (t, 0) for w, t in zip(want, tokens.tags("a", keys, rk))]
        assert caps == list(granted(tokens, members, "a", keys, want, rk)[1].values()) and len(caps) == 1
        assert all(loc[1] == off + rk * object_size(PLEN) for loc, off in zip(want, d.offsets_of(d._find("a", keys))))
    # the rows keep the keys' shard bases, computed at the first rank's LOOKUP: the others' tags derive from them
    assert d.cols["tag"][d._find("a", keys)].tolist() == tokens.shard_bases("a", keys)
    assert d.lookup("a", keys, 0.0) == (0, [None] * 3)  # a plain LOOKUP misses shared pages
    assert d.lookup("a", keys, 0.0, None, (0, 4)) == (0, [None] * 3)  # and so does another TP size
