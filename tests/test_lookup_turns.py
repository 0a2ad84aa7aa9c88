"""A real metaserver answers the LOOKUPs it reads in one event-loop turn with one table pass
(``metaserver/handlers/lookups.py``), each exactly as alone, and keeps the order it read requests in: frames sent in
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
from transport import answerrows, wire
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
