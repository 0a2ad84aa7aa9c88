"""A real metaserver answers the LOOKUPs it reads in one event-loop turn with one table pass
(``metaserver/handlers/turns.py``), each exactly as alone, and keeps the order it read requests in: frames sent in
one write (LOOKUPs, a RELEASE and an EXISTS among them, which commute with them, a REMOVE, which does not, and a
malformed LOOKUP) get one answer each, the LOOKUPs read before the REMOVE are answered before it, every LOOKUP's rows
are the rows it gets asked alone, each holds a lease of its own until released, and STATS counts the LOOKUPs against
fewer table passes."""

from __future__ import annotations

import os

import msgpack
import numpy as np
import pytest

from tests.test_packed_keys import ask, hello
from tests.test_wire_compat import Raw
from transport import answerrows, slotrules, wire
from transport.wire import HEADER, HEADER_SIZE, Op, Status

pytestmark = pytest.mark.timeout(180)

NS = "turn"


def answers(raw: Raw, n: int) -> list[tuple[int, int, dict]]:
    """The next ``n`` answers as (request id, status, meta), in the order they came."""
    out = []
    for _ in range(n):
        _magic, _version, _op, _flags, status, rid, meta_len, data_len = HEADER.unpack(raw._exactly(HEADER_SIZE))
        meta = msgpack.unpackb(raw._exactly(meta_len), raw=False, strict_map_key=False) if meta_len else None
        raw._exactly(data_len)
        out.append((rid, status, meta))
    return out


def test_lookups_read_in_one_turn_are_answered_together_each_as_alone(make_cluster):
    cl = make_cluster(nodes=2)
    keys = [os.urandom(32) for _ in range(40)]
    with cl.client(namespace=NS) as c:
        c.batch_put(keys[:30], [os.urandom(3000 + i) for i in range(30)])
        before = c.stats()
    raw = Raw(cl.metaserver_addr)
    hello(raw)
    status, early = ask(raw, Op.LOOKUP, {"ns": NS, "keys": keys[:2]}, rid=99)  # its lease is released in the burst
    assert status == Status.OK and early["lease"]
    lookups = {1: keys[0:10], 2: keys[5:20] + keys[35:40] + keys[5:6], 4: keys[20:30], 5: keys[30:40]}
    frames = [wire.encode(Op.LOOKUP, 1, {"ns": NS, "keys": lookups[1]}),
              wire.encode(Op.LOOKUP, 2, {"ns": NS, "keys": b"".join(lookups[2])}),  # packed
              wire.encode(Op.RELEASE, 0, {"lease": early["lease"]}, flags=wire.Flag.NO_REPLY),
              wire.encode(Op.EXISTS, 7, {"ns": NS, "keys": keys}),
              wire.encode(Op.LOOKUP, 4, {"ns": NS, "keys": lookups[4]}),
              wire.encode(Op.REMOVE, 3, {"ns": NS, "keys": keys[39:]}),
              wire.encode(Op.LOOKUP, 5, {"ns": NS, "keys": lookups[5]}),
              wire.encode(Op.LOOKUP, 6, {"ns": NS, "keys": 7})]
    raw.sock.sendall(b"".join(frames))
    got = answers(raw, 7)
    order = [rid for rid, _, _ in got]
    by_rid = {rid: (status, meta) for rid, status, meta in got}
    assert sorted(order) == [1, 2, 3, 4, 5, 6, 7]
    assert max(order.index(1), order.index(2), order.index(4)) < order.index(3)  # read before the REMOVE: first
    assert by_rid[7] == (Status.OK, {"exists": [True] * 30 + [False] * 10})
    assert by_rid[3] == (Status.OK, {"removed": [False]})
    assert by_rid[6][0] == Status.BAD_REQUEST and "keys" in by_rid[6][1]["error"]

    turn_leases, alone_leases = {}, []
    for rid, asked in lookups.items():
        status, ans = by_rid[rid]
        assert status == Status.OK and ans["released"] == 0 and ans["release_any"] is True
        rows = np.frombuffer(ans["rows"], answerrows.LOC_ROW)
        hits = sum(1 for k in asked if k in keys[:30])
        assert int(np.count_nonzero(rows["node"] != answerrows.NO_NODE)) == hits
        alone_status, alone = ask(raw, Op.LOOKUP, {"ns": NS, "keys": asked}, rid=100 + rid)
        assert alone_status == Status.OK
        assert rows.tobytes() == alone["rows"] and ans["nodes"] == alone["nodes"] and ans["caps"] == alone["caps"]
        assert bool(ans["lease"]) == bool(hits) == bool(alone["lease"])
        if hits:
            turn_leases[rid] = ans["lease"]
            alone_leases.append(alone["lease"])
    every = list(turn_leases.values()) + alone_leases
    assert len(set(every)) == len(every) == 6

    def pinned() -> int:
        with cl.client(namespace=NS) as c:
            return c.stats()["pinned"]

    for lease in alone_leases:
        assert ask(raw, Op.RELEASE, {"lease": lease}, rid=200) == (Status.OK, {})
    assert pinned() == 30  # the turn's leases hold what they found: keys 0-29
    assert ask(raw, Op.RELEASE, {"lease": turn_leases[4]}, rid=201) == (Status.OK, {})
    assert pinned() == 20  # request 4's own hits (keys 20-29) and only those
    for rid in (1, 2):
        assert ask(raw, Op.RELEASE, {"lease": turn_leases[rid]}, rid=202) == (Status.OK, {})
    with cl.client(namespace=NS) as c:
        s = c.stats()
    assert s["pinned"] == 0
    assert s["turn_lookups"] - before["turn_lookups"] == 1 + 4 + 4  # the first, the burst's four, four asked alone
    assert s["turn_passes"] - before["turn_passes"] < s["turn_lookups"] - before["turn_lookups"]


def test_a_partitioned_pools_merged_lookups_share_each_slots_turn(make_cluster):
    """One process leading 4 slots: merged multi-slot LOOKUPs (``"parts"``, ``"merge"``) and a single-slot one, sent
    in one write, each join their slots' turns (one pass a slot for all of them), and each is answered as when asked
    alone: the same rows, nodes and capabilities, no failed part, a process lease that holds its own hits."""
    slots = 4
    cl = make_cluster(nodes=2, metaserver_flags={"slots": slots})
    keys = [os.urandom(32) for _ in range(64)]
    with cl.client(namespace=NS) as c:
        assert c.batch_put(keys[:48], [os.urandom(2000 + i) for i in range(48)]) == [True] * 48
        before = c.stats()
    of = slotrules.slots_of(NS, keys, slots).tolist()

    def merged(ks: list[bytes]) -> dict:
        order = sorted(range(len(ks)), key=lambda i: of[keys.index(ks[i])])
        parts: list[list[int]] = []
        for i in order:
            s = of[keys.index(ks[i])]
            if parts and parts[-1][0] == s:
                parts[-1][1] += 1
            else:
                parts.append([s, 1])
        return {"ns": NS, "keys": b"".join(ks[i] for i in order), "parts": parts, "merge": True}

    asks = {1: merged(keys[0:20]), 2: merged(keys[10:40] + keys[50:60]), 3: merged(keys[40:64])}
    one = next(k for k in keys[:48] if of[keys.index(k)] == 2)
    asks[4] = {"ns": NS, "keys": [one], "slot": 2}
    raw = Raw(cl.metaserver_addr)
    hello(raw)
    raw.sock.sendall(b"".join(wire.encode(Op.LOOKUP, rid, meta) for rid, meta in asks.items()))
    by_rid = {rid: (status, meta) for rid, status, meta in answers(raw, len(asks))}
    leases = []
    for rid, meta in asks.items():
        status, ans = by_rid[rid]
        assert status == Status.OK and ans.get("failed", []) == [], ans
        alone_status, alone = ask(raw, Op.LOOKUP, meta, rid=100 + rid)
        assert alone_status == Status.OK
        assert ans["rows"] == alone["rows"] and ans["nodes"] == alone["nodes"] and ans["caps"] == alone["caps"]
        rows = np.frombuffer(ans["rows"], answerrows.LOC_ROW)
        n = len(rows)
        hits = int(np.count_nonzero(rows["node"] != answerrows.NO_NODE))
        assert n == (len(meta["keys"]) // 32 if type(meta["keys"]) is bytes else 1)
        assert hits == {1: 20, 2: 30, 3: 8, 4: 1}[rid] and ans["lease"] and alone["lease"]
        leases.append(ans["lease"])
        assert ask(raw, Op.RELEASE, {"lease": alone["lease"]}, rid=200) == (Status.OK, {})

    def stats() -> dict:
        with cl.client(namespace=NS) as c:
            return c.stats()

    s = stats()
    assert s["pinned"] == 48  # the burst's leases hold every page that any of them found
    assert ask(raw, Op.RELEASE, {"lease": leases[2]}, rid=201) == (Status.OK, {})
    assert stats()["pinned"] == 40  # request 3's own hits (keys 40-47)
    for lease in leases[:2] + leases[3:]:
        assert ask(raw, Op.RELEASE, {"lease": lease}, rid=202) == (Status.OK, {})
    s = stats()
    assert s["pinned"] == 0
    asked, passes = s["turn_lookups"] - before["turn_lookups"], s["turn_passes"] - before["turn_passes"]
    assert asked >= 3 * 3 + 1 and passes < asked  # the burst's parts and the one-slot LOOKUP, fewer passes
