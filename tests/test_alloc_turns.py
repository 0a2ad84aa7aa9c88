"""A real metaserver answers the ALLOCs it reads in one event-loop turn with one table pass
(``metaserver/handlers/turns.py``), each as alone, and keeps the order it read requests in: frames sent in one write
(ALLOCs with and without parents, packed and listed keys, a malformed one, then an EXISTS, which does not commute
with them) get one answer each; the EXISTS is answered after every ALLOC read before it; each ALLOC gets its own
places (none shared, every generation distinct), its COMMIT and its token's retry work as for an ALLOC alone; an
ALLOC naming another's key in the same turn is answered as after it (IN_FLIGHT); STATS counts the ALLOCs against
fewer table passes; the pages put through a turn read back byte for byte."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.test_lookup_turns import answers
from tests.test_packed_keys import ask, hello
from tests.test_wire_compat import Raw
from transport import answerrows, wire
from transport.wire import AllocState, Op, Status

pytestmark = pytest.mark.timeout(180)

NS = "allocturn"


def alloc(rid: int, keys: list, sizes: int, parents: list | None = None, token: int | None = None,
          packed: bool = False) -> bytes:
    meta = {"ns": NS, "keys": b"".join(keys) if packed else keys, "sizes": [sizes] * len(keys)}
    if parents is not None:
        meta["parents"] = parents
    if token is not None:
        meta["token"] = token
    return wire.encode(Op.ALLOC, rid, meta)


def rows_of(ans: dict) -> np.ndarray:
    return np.frombuffer(ans["rows"], answerrows.ALLOC_ROW)


def stats(cl) -> dict:
    with cl.client(namespace=NS) as c:
        return c.stats()


def test_allocs_read_in_one_turn_share_a_pass_each_as_alone(make_cluster):
    cl = make_cluster(nodes=2)
    before = stats(cl)
    raw = Raw(cl.metaserver_addr)
    hello(raw)
    a = [os.urandom(32) for _ in range(12)]
    b = [b"object-%d_k" % i for i in range(8)]
    c = [os.urandom(32) for _ in range(20)]
    frames = [alloc(1, a, 3000, [None] + a[:-1], token=11),  # a chain, as the engines send
              alloc(2, b, 5000),
              wire.encode(Op.ALLOC, 3, {"ns": NS, "keys": 7, "sizes": [1]}),  # malformed: answered at once
              alloc(4, c, 3000, packed=True),
              wire.encode(Op.EXISTS, 5, {"ns": NS, "keys": a + b + c})]
    raw.sock.sendall(b"".join(frames))
    got = answers(raw, 5)
    order = [rid for rid, _, _ in got]
    by_rid = {rid: (status, meta) for rid, status, meta in got}
    assert sorted(order) == [1, 2, 3, 4, 5]
    assert max(order.index(1), order.index(2), order.index(4)) < order.index(5)  # read before the EXISTS: first
    assert by_rid[3][0] == Status.BAD_REQUEST and "keys" in by_rid[3][1]["error"]
    assert by_rid[5] == (Status.OK, {"exists": [False] * 40})  # PENDING, not READY
    places, gens = set(), set()
    for rid, keys, size in ((1, a, 3000), (2, b, 5000), (4, c, 3000)):
        status, ans = by_rid[rid]
        assert status == Status.OK, ans
        rows = rows_of(ans)
        assert rows["state"].tolist() == [AllocState.NEW] * len(keys) and (rows["len"] == size).all()
        places |= {(ans["nodes"][n], int(o)) for n, o in zip(rows["node"], rows["off"])}
        gens |= set(rows["gen"].tolist())
        assert len(ans["caps"]) == len(ans["nodes"])
    assert len(places) == len(gens) == 40  # no place given twice, every generation its own
    # its token's retry gets the same places back, as for an ALLOC alone
    status, again = ask(raw, Op.ALLOC, {"ns": NS, "keys": a, "sizes": [3000] * 12, "parents": [None] + a[:-1],
                                        "token": 11}, rid=6)
    assert status == Status.OK and rows_of(again).tobytes() == rows_of(by_rid[1][1]).tobytes()
    s = stats(cl)
    assert s["turn_allocs"] - before["turn_allocs"] >= 3
    assert s["turn_alloc_passes"] - before["turn_alloc_passes"] < s["turn_allocs"] - before["turn_allocs"]

    # A second turn: an ALLOC naming a key of the one before it, read in the same turn, is answered as after it
    # (IN_FLIGHT: another writer's PENDING key); the pass is then one ALLOC after the other.
    d = [os.urandom(32) for _ in range(4)]
    e = [os.urandom(32) for _ in range(3)] + [d[0]]
    raw.sock.sendall(alloc(7, d, 3000) + alloc(8, e, 3000))
    got = {rid: meta for rid, status, meta in answers(raw, 2) if status == Status.OK}
    assert rows_of(got[7])["state"].tolist() == [AllocState.NEW] * 4
    assert rows_of(got[8])["state"].tolist() == [AllocState.NEW] * 3 + [AllocState.IN_FLIGHT]

    # COMMITs: each ALLOC's generations make its own keys READY
    for rid, keys in ((1, a), (2, b), (4, c), (7, d)):
        rows = rows_of(by_rid[rid][1] if rid != 7 else got[7])
        status, ok = ask(raw, Op.COMMIT, {"ns": NS, "keys": keys, "gens": rows["gen"].tolist()}, rid=20 + rid)
        assert status == Status.OK and ok == {"ok": [True] * len(keys)}
    assert ask(raw, Op.EXISTS, {"ns": NS, "keys": a + b + c + d + e[:3]}, rid=30)[1] == {
        "exists": [True] * 44 + [False] * 3}


def test_pages_put_by_clients_in_shared_turns_read_back(make_cluster):
    """Clients putting at once (their ALLOCs share turns where they meet), then every page read back byte for byte."""
    import threading

    cl = make_cluster(nodes=2)
    values = {os.urandom(32): os.urandom(3000 + i) for i in range(240)}
    keys = list(values)
    errors: list = []

    def put(part: list) -> None:
        try:
            with cl.client(namespace=NS) as c:
                for i in range(0, len(part), 10):
                    chunk = part[i:i + 10]
                    assert c.batch_put(chunk, [values[k] for k in chunk], [None] + chunk[:-1]) == [True] * len(chunk)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=put, args=(keys[j::4],)) for j in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    with cl.client(namespace=NS) as c:
        outs = [bytearray(len(values[k])) for k in keys]
        assert c.batch_get_into(keys, outs) == [len(values[k]) for k in keys]
        assert [bytes(o) for o in outs] == [values[k] for k in keys]
        s = c.stats()
    assert s["turn_allocs"] >= 24  # every ALLOC of a server connection waits for its turn's end


def test_a_partitioned_pools_multi_slot_allocs_share_each_slots_turn(make_cluster):
    """One process leading 4 slots: multi-slot ALLOCs (``"parts"``) and a single-slot one, sent in one write, each
    part waiting in its slot's turn: one answer each, every part NEW with its own places (none shared, every
    generation distinct), no failed part, fewer table passes than ALLOCs and parts; each one's COMMIT makes its
    keys READY."""
    from transport import slotrules

    slots = 4
    cl = make_cluster(nodes=2, metaserver_flags={"slots": slots})
    warm = [os.urandom(32) for _ in range(32)]  # every slot knows the nodes once a put reached it (the client retries)
    with cl.client(namespace=NS) as c:
        assert c.batch_put(warm, [b"w" * 100] * 32) == [True] * 32
        assert set(slotrules.slots_of(NS, warm, slots).tolist()) == set(range(slots))
    before = stats(cl)
    keys = [os.urandom(32) for _ in range(72)]
    of = slotrules.slots_of(NS, keys, slots).tolist()

    def grouped(ks: list[bytes]) -> tuple[list[bytes], list[list[int]]]:
        ks = sorted(ks, key=lambda k: of[keys.index(k)])
        parts: list[list[int]] = []
        for k in ks:
            s = of[keys.index(k)]
            if parts and parts[-1][0] == s:
                parts[-1][1] += 1
            else:
                parts.append([s, 1])
        return ks, parts

    asks = {}
    for rid, ks in ((1, keys[0:24]), (2, keys[24:48]), (3, keys[48:70])):
        g, parts = grouped(ks)
        asks[rid] = {"ns": NS, "keys": g, "sizes": [3000] * len(g), "parts": parts, "token": rid}
    one = [k for k in keys[70:] if of[keys.index(k)] == of[keys.index(keys[70])]]
    asks[4] = {"ns": NS, "keys": one, "sizes": [3000] * len(one), "slot": of[keys.index(keys[70])]}
    raw = Raw(cl.metaserver_addr)
    hello(raw)
    raw.sock.sendall(b"".join(wire.encode(Op.ALLOC, rid, meta) for rid, meta in asks.items()))
    by_rid = {rid: (status, meta) for rid, status, meta in answers(raw, len(asks))}
    places, gens, parts_asked = set(), set(), 0
    for rid, meta in asks.items():
        status, ans = by_rid[rid]
        assert status == Status.OK, ans
        got = [ans] if rid == 4 else ans["parts"]
        assert rid == 4 or (ans["failed"] == [] and len(got) == len(meta["parts"]))
        parts_asked += len(got)
        lo = 0
        for part, a in zip(meta.get("parts", [[meta.get("slot"), len(meta["keys"])]]), got):
            rows = rows_of(a)
            assert rows["state"].tolist() == [AllocState.NEW] * part[1]
            places |= {(a["nodes"][n], int(o)) for n, o in zip(rows["node"], rows["off"])}
            gens |= set(rows["gen"].tolist())
            part_keys = meta["keys"][lo:lo + part[1]]
            status, ok = ask(raw, Op.COMMIT, {"ns": NS, "keys": part_keys, "gens": rows["gen"].tolist(),
                                              "slot": part[0]}, rid=50)
            assert status == Status.OK and ok == {"ok": [True] * part[1]}
            lo += part[1]
    n = sum(len(m["keys"]) for m in asks.values())
    assert len(places) == len(gens) == n
    assert ask(raw, Op.EXISTS, {"ns": NS, "keys": keys[0:1], "slot": of[0]}, rid=51)[1] == {"exists": [True]}
    s = stats(cl)
    asked, passes = s["turn_allocs"] - before["turn_allocs"], s["turn_alloc_passes"] - before["turn_alloc_passes"]
    assert asked >= parts_asked and passes < asked  # the burst's parts and the one-slot ALLOC, fewer passes
