"""The router's merged multi-slot LOOKUP (``umbp/slotrouter.py``, ``metaserver/ha/multislot.py``): one answer a
process for all its parts; a part of it that failed NOT_LEADER is resent to the leader named and its rows replace
the merged answer's misses; RELEASE goes once a process with every lease it gave; a process that refuses ``merge``
(an older release) is asked per part from then on. Against scripted metaservers on loopback
(``test_metaclient.ScriptedServer``)."""

from __future__ import annotations

import time

import numpy as np

from test_metaclient import servers  # noqa: F401  (fixture)
from transport import answerrows, slotrules, wire
from transport.wire import Op, Status
from umbp.slotrouter import MetaRouter
from waiting import eventually

S = 4
NS = "default"


def rows_for(keys: list[bytes], miss=()) -> bytes:
    """A LOOKUP answer's rows naming each key by its number (gen = the number, node 0), misses at ``miss``."""
    hit = np.ones(len(keys), bool)
    hit[list(miss)] = False
    ids = np.array([int(k[3:]) for k in keys], np.uint64)[hit]
    return answerrows.pack_locs(hit, ids + 7, ids, np.full(len(ids), 64, np.uint64), ids * 4096, 0)


def leader(a, b):
    return {"leader": a.addr, "is_leader": True, "slots": S, "slot_rule": slotrules.RULE_DIGEST,
            "map": [a.addr, a.addr, a.addr, b.addr], "members": sorted([a.addr, b.addr])}


def keyset() -> tuple[list[bytes], list[int]]:
    keys = [b"key%d" % i for i in range(64)]
    slots = slotrules.slots_of(NS, keys, S).tolist()
    assert set(slots) == set(range(S))
    return keys, slots


def test_a_merged_answer_with_a_moved_part_and_one_release_a_process(servers):
    got: dict[str, list] = {"a": [], "b": []}

    def a_script(_n):
        got["a"].append((a.op, a.meta))
        if a.op == Op.LEADER:
            return leader(a, b)
        if a.op == Op.LOOKUP:
            m = a.meta
            assert m["merge"] is True and [s for s, _ in m["parts"]] == [0, 1, 2]
            at, miss, failed = 0, [], []
            for i, (s, n) in enumerate(m["parts"]):
                if s == 2:  # slot 2 moved to b meanwhile: MOVED, its keys misses here
                    miss += range(at, at + n)
                    failed.append([i, Status.NOT_LEADER, "slot 2 is led by b", b.addr])
                at += n
            return {"lease": 111, "lease_ms": 5000, "nodes": ["nA"], "caps": [b"capA"],
                    "rows": rows_for(m["keys"], miss), "failed": failed}
        return {}

    def b_script(_n):
        got["b"].append((b.op, b.meta))
        if b.op == Op.LOOKUP:
            m = b.meta
            assert "parts" not in m and "merge" not in m  # one slot a request here: a single-slot request
            return {"lease": 200 + m["slot"], "lease_ms": 10_000, "nodes": ["nB"], "caps": [b"capB"],
                    "rows": rows_for(m["keys"])}
        return {}

    a = servers(a_script)
    b = servers(b_script)
    keys, slots = keyset()
    r = MetaRouter([a.addr])
    try:
        res = r.call(Op.LOOKUP, {"ns": NS, "keys": keys}, time.monotonic() + 10)
        rows = res["rows"]
        assert rows["gen"].tolist() == list(range(64)) and rows["tag"].tolist() == [i + 7 for i in range(64)]
        names = [res["nodes"][j] for j in rows["node"].tolist()]
        assert names == ["nA" if s < 2 else "nB" for s in slots]
        assert [res["caps"][j] for j in rows["node"].tolist()] == [b"capA" if s < 2 else b"capB" for s in slots]
        assert res["lease"] and res["lease_ms"] == 5000 and r.moved == 1 and r.map[2] == b.addr
        r.send_noreply(Op.RELEASE, {"lease": res["lease"]}, time.monotonic() + 5)
        eventually(lambda: any(op == Op.RELEASE for op, _ in got["a"]) and any(op == Op.RELEASE for op, _ in got["b"]),
                   5.0, "a RELEASE at each process")
        assert [m for op, m in got["a"] if op == Op.RELEASE] == [{"leases": [111]}]
        assert [sorted(m["leases"]) for op, m in got["b"] if op == Op.RELEASE] == [[202, 203]]
    finally:
        r.close()


def test_lease_ids_ride_in_each_process_lookup_that_takes_them_and_go_in_frames_elsewhere(servers):
    """Process a (slots 0-2) says ``release_any`` in its LOOKUP answers, b (slot 3) does not (an earlier release):
    the composite lease of one LOOKUP, given back in the next (``"release": [handle]``), reaches a inside its
    LOOKUP and b in a RELEASE frame; the router's answer says ``release_any`` only while every process did."""
    got: dict[str, list] = {"a": [], "b": []}

    def answer(srv, lease: int, release_any: bool) -> dict:
        m = srv.meta
        out = {"lease": lease, "lease_ms": 5000, "nodes": ["n"], "caps": [b""], "rows": rows_for(m["keys"])}
        if "parts" in m:
            out["failed"] = []
        if release_any:
            out.update(released=len(m.get("release", ())), release_any=True)
        return out

    def a_script(_n):
        got["a"].append((a.op, dict(a.meta) if isinstance(a.meta, dict) else a.meta))
        if a.op == Op.LEADER:
            return leader(a, b)
        return answer(a, 100 + len(got["a"]), True) if a.op == Op.LOOKUP else {}

    def b_script(_n):
        got["b"].append((b.op, dict(b.meta) if isinstance(b.meta, dict) else b.meta))
        return answer(b, 200 + len(got["b"]), False) if b.op == Op.LOOKUP else {}

    a = servers(a_script)
    b = servers(b_script)
    keys, _ = keyset()
    r = MetaRouter([a.addr])
    try:
        first = r.call(Op.LOOKUP, {"ns": NS, "keys": keys}, time.monotonic() + 10)
        assert first["lease"] and "release_any" not in first  # b did not say it
        second = r.call(Op.LOOKUP, {"ns": NS, "keys": keys, "release": [first["lease"]]}, time.monotonic() + 10)
        a_lookups = [m for op, m in got["a"] if op == Op.LOOKUP]
        assert "release" not in a_lookups[0] and a_lookups[1]["release"] == [102]  # a's lease of the first LOOKUP
        assert all("release" not in m for op, m in got["b"] if op == Op.LOOKUP)
        eventually(lambda: any(op == Op.RELEASE for op, _ in got["b"]), 5.0, "b's RELEASE frame")
        assert [m for op, m in got["b"] if op == Op.RELEASE] == [{"leases": [201]}]
        assert not any(op == Op.RELEASE for op, _ in got["a"])
        assert second["lease"] != first["lease"] and "release_any" not in second
        assert r._leases.get(first["lease"]) is None  # the handle is spent
    finally:
        r.close()


def test_a_process_that_refuses_merge_is_asked_per_part(servers):
    seen: list[dict] = []

    def a_script(_n):
        if a.op == Op.LEADER:
            return leader(a, b)
        if a.op == Op.LOOKUP:
            m = a.meta
            seen.append(m)
            if "merge" in m:  # an older release: each part refuses the field it does not know
                return {"parts": [None] * len(m["parts"]),
                        "failed": [[i, Status.BAD_REQUEST, "unknown field 'merge'", None]
                                   for i in range(len(m["parts"]))]}
            out, at = [], 0
            for s, n in m["parts"]:
                out.append({"lease": 10 + s, "nodes": ["nA"], "caps": [b""], "rows": rows_for(m["keys"][at:at + n])})
                at += n
            return {"parts": out, "failed": []}
        return {}

    def b_script(_n):
        if b.op == Op.LOOKUP:
            return {"lease": 9, "nodes": ["nB"], "caps": [b""], "rows": rows_for(b.meta["keys"])}
        return {}

    a = servers(a_script)
    b = servers(b_script)
    keys, _ = keyset()
    r = MetaRouter([a.addr])
    try:
        for _ in range(2):
            res = r.call(Op.LOOKUP, {"ns": NS, "keys": keys}, time.monotonic() + 10)
            assert res["rows"]["gen"].tolist() == list(range(64)) and res["lease"]
        assert ["merge" in m for m in seen] == [True, False, False]  # refused once, then per part
    finally:
        r.close()


def test_merged_alloc_rows_are_the_parts_items_in_key_order():
    """``lookup.merge_allocs``: two parts' packed ALLOC answers (NEW rows on their own nodes, rows of other states
    between them) become one answer of ``n`` keys whose rows, node list, caps and ``items`` are what the per-key merge
    of the parts' items gives (node indices shifted past the first part's nodes), with the earliest write deadline;
    the array put path takes it (``putbatch.answer_rows``)."""
    from umbp import lookup, putbatch

    NEW, EXISTS, FULL = wire.AllocState.NEW, wire.AllocState.EXISTS, wire.AllocState.NO_SPACE

    def part(states, node_ids, base, caps, until):
        states = np.array(states, np.uint32)
        new = np.flatnonzero(states == NEW)
        m = len(new)
        ans = {"rows": answerrows.pack_allocs(states, new, base + np.arange(m, dtype=np.uint64), base + 100 + np.arange(m),
                                        np.full(m, 4096, np.uint64), 8192 * np.arange(m, dtype=np.uint64),
                                        np.arange(m, dtype=np.uint32) % len(node_ids)),
               "nodes": node_ids, "caps": caps, "write_until_ms": until}
        return answerrows.unpack_allocs(ans, "test", items=False)

    a = part([NEW, EXISTS, NEW, NEW], ["n1", "n2"], 1000, [b"c1", b"c2"], 9_000)
    b = part([FULL, NEW, NEW], ["n3"], 2000, [b"c3"], 7_000)
    idx_a, idx_b = [0, 2, 5, 6], [1, 3, 4]
    got = lookup.merge_allocs([(idx_a, a), (idx_b, b)], 7)
    assert got["nodes"] == ["n1", "n2", "n3"] and got["caps"] == [b"c1", b"c2", b"c3"]
    assert got["write_until_ms"] == 7_000
    want = [None] * 7
    for idx, ans, shift in ((idx_a, a, 0), (idx_b, b, 2)):
        for i, item in zip(idx, answerrows.alloc_items(ans["alloc_rows"], ans["nodes"])):
            if item[0] == NEW:
                item[6] += shift
            want[i] = item
    assert got["items"] == want
    assert [x[0] for x in want] == [NEW, FULL, EXISTS, NEW, NEW, NEW, NEW]
    assert putbatch.answer_rows(got, 7) is got["alloc_rows"]


def test_the_router_routes_by_the_slot_rule_from_the_digests_it_remembers(monkeypatch):
    """Under rule 2 the client's router takes the keys' slots from ``keyform.digest_blob`` (the digests it also
    packs a LOOKUP's keys as, remembered): the same slots as ``slotrules.slots_of``, for keys of every length,
    hex text as sent, and keys that are not bytes (-1, refused by the metaserver); rule 1 as before."""
    import os

    from transport import keyform

    monkeypatch.setattr(keyform, "_MEMO", {})
    r = MetaRouter.__new__(MetaRouter)
    r.slots = 16
    keys = [os.urandom(33).hex().encode() for _ in range(40)] + [b"x", b"k" * 32, os.urandom(32).hex().encode()]
    for rule in slotrules.RULES:
        r.rule = rule
        for ks in (keys, keys + ["a str", 7]):
            assert r._slots("ns", ks).tolist() == slotrules.slots_of("ns", ks, 16, rule).tolist(), (rule, ks[-1])
    assert len(keyform._MEMO) == 42  # rule 2 remembered the keys that are not 32 bytes (the hex text as sent)
