"""A multi-slot LOOKUP answered as one (``metaserver/ha/multislot.py``: ``"merge": true``): one packed row a key, one
read capability a node that covers every part's objects on it, one process lease whose RELEASE (or the connection's
close) unpins every part; a part not served here fails alone and its keys are misses. In process: a ``Partition``
of 4 slots whose slot servers serve without an election (no etcd is reached), tables filled directly."""

from __future__ import annotations

import gc
import time
import weakref
from types import SimpleNamespace

import numpy as np
import pytest

from metaserver import validate as v
from metaserver.ha import multislot
from metaserver.ha.partition import Partition
from metaserver.ha.service import Metaserver
from metaserver.table.entry import NEW
from transport import answerrows, slotrules
from transport.wire import Op, Status
from umbp.auth import check_read_capability
from umbp.config import MetaserverConfig
from umbp.errors import AuthError

SLOTS = 4
NS = "ns"
NODES = ("n0", "n1", "n2")
PAGE = 4000


class _Scope:
    node = True

    @staticmethod
    def check(ns, write, component):
        return None


class Conn:
    """What the handlers read of a connection: its auth scope, its wire version, closed and peer."""

    def __init__(self, version: int = 12):
        self.auth = SimpleNamespace(scope=_Scope())
        self.version = version
        self.closed = False
        self.peer = "test"
        self.slot_conns: dict = {}  # its views in a partitioned pool's slots (server.Connection's)


def pool(monkeypatch, token: str | None = "cluster-secret-of-the-test", down: tuple[int, ...] = ()):
    """A partition of SLOTS slots, every slot served here but those in ``down``, 3 nodes, 40 pages a slot."""
    monkeypatch.setattr(Metaserver, "serving", property(lambda self: self.slot not in down))
    p = Partition(MetaserverConfig(token=token), "127.0.0.1:1", SLOTS)
    arenas = {n: b"arena-" + n.encode() for n in NODES}
    members = {n: SimpleNamespace(cap_key=p.tokens.cap_key(n, arenas[n]), cap_epoch=0) for n in NODES}
    keys = [b"%032d" % i for i in range(400)]
    by: dict[int, list[bytes]] = {}
    for k, s in zip(keys, slotrules.slots_of(NS, keys, SLOTS).tolist()):
        by.setdefault(s, []).append(k)
    for s in range(SLOTS):
        srv = p.servers[str(s)]
        srv.members.get = members.get
        d = srv.dir
        for n in NODES:
            d.add_space(n, 1 << 26)
        ks = by[s][:40]
        pl = d.alloc_placed(NS, ks, [PAGE] * len(ks), None, (s << 52) + 1, 0.0)
        assert (pl.state == NEW).all()
        assert all(d.commit(NS, ks, pl.gens.tolist(), 0.0)[0])
        by[s] = ks
    return p, by, members


def request(by: dict, slots: list[int], per: int, merge: bool = True) -> dict:
    keys = [k for s in slots for k in by[s][:per]]
    meta = {"ns": NS, "keys": keys, "parts": [[s, per] for s in slots]}
    if merge:
        meta["merge"] = True
    return meta


def leases(p) -> list[int]:
    return [len(p.servers[str(s)].dir.leases) for s in range(SLOTS)]


def test_a_merged_lookup_is_one_answer_one_lease_one_capability_a_node(monkeypatch):
    p, by, members = pool(monkeypatch)
    conn = Conn()
    ans = multislot.dispatch(p, Op.LOOKUP, request(by, [0, 1, 2, 3], 10), conn)
    assert set(ans) == {"lease", "lease_ms", "nodes", "caps", "rows", "failed"} and ans["failed"] == []
    assert ans["lease"] and ans["lease_ms"] == 10_000
    rows = np.frombuffer(ans["rows"], answerrows.LOC_ROW)
    assert len(rows) == 40 and (rows["node"] != answerrows.NO_NODE).all()
    assert sorted(ans["nodes"]) == sorted(set(ans["nodes"])) and len(ans["caps"]) == len(ans["nodes"]) <= 3
    assert leases(p) == [1, 1, 1, 1]  # each part pinned in its own table, under one process lease
    # every key's object is granted by its node's one capability, whichever slot it came from; not by another's
    for r in rows.tolist():
        node = ans["nodes"][r[4]]
        check_read_capability(members[node].cap_key, ans["caps"][r[4]], r[3], r[2], r[1], "node")
        other = next(j for j, n in enumerate(ans["nodes"]) if n != node) if len(ans["nodes"]) > 1 else None
        if other is not None:
            with pytest.raises(AuthError):
                check_read_capability(members[ans["nodes"][other]].cap_key, ans["caps"][other], r[3], r[2], r[1],
                                      "node")
    # the same places, tags and generations as the per-part answers give
    old = multislot.dispatch(p, Op.LOOKUP, request(by, [0, 1, 2, 3], 10, merge=False), Conn())
    want = [(a["nodes"][r[4]], r[3], r[2], r[1], r[0]) for a in old["parts"]
            for r in np.frombuffer(a["rows"], answerrows.LOC_ROW).tolist()]
    assert [(ans["nodes"][r[4]], r[3], r[2], r[1], r[0]) for r in rows.tolist()] == want
    assert len(old["parts"]) == 4 and sum(len(a["caps"]) for a in old["parts"]) >= len(ans["caps"])


def test_releasing_the_process_lease_unpins_every_part(monkeypatch):
    p, by, _ = pool(monkeypatch)
    conn, other = Conn(), Conn()
    ans = multislot.dispatch(p, Op.LOOKUP, request(by, [0, 2, 3], 5), conn)
    pins = [int(p.servers[str(s)].dir.cols["pins"].sum()) for s in range(SLOTS)]
    assert pins == [5, 0, 5, 5]
    with pytest.raises(v.Reject) as e:  # another connection cannot name it
        p.release({"lease": ans["lease"]}, other)
    assert e.value.status == Status.NOT_FOUND and leases(p) == [1, 0, 1, 1]
    assert p.release({"lease": ans["lease"]}, conn) == {}
    assert leases(p) == [0, 0, 0, 0] and all(int(p.servers[str(s)].dir.cols["pins"].sum()) == 0
                                             for s in range(SLOTS))
    with pytest.raises(v.Reject):  # once
        p.release({"lease": ans["lease"]}, conn)
    # in a list beside a per-part lease of the same connection, and by the connection's close
    a = multislot.dispatch(p, Op.LOOKUP, request(by, [1, 3], 4), conn)
    b = multislot.dispatch(p, Op.LOOKUP, request(by, [0, 1], 4, merge=False), conn)
    assert leases(p) == [1, 2, 0, 1]
    assert p.release({"leases": [a["lease"], b["parts"][0]["lease"], 12345]}, conn) == {"released": 2}
    assert leases(p) == [0, 1, 0, 0]
    multislot.dispatch(p, Op.LOOKUP, request(by, [0, 1, 2, 3], 3), conn)
    assert leases(p) == [1, 2, 1, 1]
    p.drop_pending(conn)  # the connection closed: its leases run out on their own (its reads may go on)
    assert leases(p) == [1, 2, 1, 1] and not conn.process_leases
    assert [p.servers[str(s)].dir.leases_orphaned for s in range(SLOTS)] == [1, 2, 1, 1]  # counted: each slice
    for s in range(SLOTS):
        p.servers[str(s)].dir.expire_leases(time.monotonic() + 3600, 100)
    assert leases(p) == [0, 0, 0, 0] and all(int(p.servers[str(s)].dir.cols["pins"].sum()) == 0
                                             for s in range(SLOTS))


def test_a_part_not_served_here_fails_alone_and_its_keys_miss(monkeypatch):
    p, by, _ = pool(monkeypatch, down=(2,))
    p.holders["2"] = ("10.0.0.9:7700", 1, 1)
    conn = Conn()
    ans = multislot.dispatch(p, Op.LOOKUP, request(by, [0, 2, 3], 6), conn)
    assert len(ans["failed"]) == 1
    i, status, _msg, leader = ans["failed"][0]
    assert (i, status, leader) == (1, Status.NOT_LEADER, "10.0.0.9:7700")
    node = np.frombuffer(ans["rows"], answerrows.LOC_ROW)["node"]
    assert (node[:6] != answerrows.NO_NODE).all() and (node[6:12] == answerrows.NO_NODE).all() and (node[12:] != answerrows.NO_NODE).all()
    assert leases(p) == [1, 0, 0, 1]
    # every part failing: no lease, every key a miss
    ans = multislot.dispatch(p, Op.LOOKUP, request(by, [2], 6), conn)
    assert ans["lease"] == 0 and len(ans["failed"]) == 1
    assert (np.frombuffer(ans["rows"], answerrows.LOC_ROW)["node"] == answerrows.NO_NODE).all()


def test_misses_an_open_pool_and_bad_requests(monkeypatch):
    p, by, _ = pool(monkeypatch, token=None)
    conn = Conn()
    meta = request(by, [0, 1], 3)
    meta["keys"][1] = b"absent"
    ans = multislot.dispatch(p, Op.LOOKUP, meta, conn)
    node = np.frombuffer(ans["rows"], answerrows.LOC_ROW)["node"]
    assert (node == answerrows.NO_NODE).tolist() == [False, True, False, False, False, False]
    assert all(c == b"" for c in ans["caps"]) and len(ans["caps"]) == len(ans["nodes"])  # open: no capabilities
    assert multislot.dispatch(p, Op.LOOKUP, {"ns": NS, "keys": [b"x" * 32], "parts": [[1, 1]], "merge": True},
                              conn)["lease"] == 0
    for bad in ({"parts": [[0, 2], [0, 1]]}, {"parts": [[0, 2]]}, {"parts": [[SLOTS, 3]]}, {"extra": 1}):
        m = dict(request(by, [0], 3), **bad)
        with pytest.raises(v.Reject):
            multislot.dispatch(p, Op.LOOKUP, m, conn)
    # a version 11 request is answered per part, as before (its parts carry ``locs``); ``merge`` is not its field
    old = multislot.dispatch(p, Op.LOOKUP, request(by, [0, 1], 2, merge=False), Conn(version=11))
    assert len(old["parts"]) == 2 and all("locs" in a for a in old["parts"])
    got = multislot.dispatch(p, Op.LOOKUP, request(by, [0, 1], 2), Conn(version=11))
    assert [f[1] for f in got["failed"]] == [Status.BAD_REQUEST] * 2 and "'merge'" in got["failed"][0][2]


@pytest.mark.parametrize("parts, why", [
    ("x", "must be a list"), ([], "must be a list"), ([[0, 1]] * 5, "must be a list"),
    ([[0, 2], 7], "bad entry 7"), ([[0, 1, 1]], "bad entry [0, 1, 1]"), ([[0.0, 2]], "bad entry [0.0, 2]"),
    ([[True, 2]], "bad entry [True, 2]"), ([[4, 2]], "bad entry [4, 2]"), ([[-1, 2]], "bad entry [-1, 2]"),
    ([[1, 1], [1, 1]], "bad entry [1, 1]"), ([[0, 0], [1, 2]], "bad entry [0, 0]"), ([[0, 1]], "count 1 keys"),
    ([[0, 3]], "bad entry [0, 3]"), ([[0, 1 << 70]], "bad entry"), ([[1 << 70, 1]], "bad entry"),
    ([[0, (1 << 63) - 1], [1, (1 << 63) - 1], [2, 4]], "bad entry"),  # counts that wrap int64 to 2
])
def test_a_malformed_parts_is_refused_naming_its_first_bad_entry(parts, why):
    with pytest.raises(v.Reject) as e:
        multislot.cuts(parts, SLOTS, 2)
    assert why in str(e.value)


def test_parts_cut_the_keys_in_their_order():
    assert multislot.cuts([[2, 3], [0, 1], [3, 2]], SLOTS, 6) == [(2, 0, 3), (0, 3, 4), (3, 4, 6)]
    assert multislot.cuts([[1, 2]], SLOTS, 2) == [(1, 0, 2)]


def test_a_process_lease_whose_slot_lease_ran_out_releases_the_rest_once(monkeypatch):
    p, by, _ = pool(monkeypatch)
    conn = Conn()
    ans = multislot.dispatch(p, Op.LOOKUP, request(by, [0, 1, 2], 5), conn)
    d1 = p.servers["1"].dir
    d1.expire_leases(time.monotonic() + 3600, 100)  # slot 1's lease ran out: its slice unpinned there
    assert leases(p) == [1, 0, 1, 0] and int(d1.cols["pins"].sum()) == 0
    assert p.release({"leases": [ans["lease"]]}, conn) == {"released": 1}
    assert leases(p) == [0, 0, 0, 0] and all(int(p.servers[str(s)].dir.cols["pins"].sum()) == 0
                                             for s in range(SLOTS))
    for s in range(SLOTS):
        p.servers[str(s)].dir.check()


def test_a_process_lease_leaves_a_slot_that_changed_term_alone(monkeypatch):
    p, by, _ = pool(monkeypatch)
    conn = Conn()
    ans = multislot.dispatch(p, Op.LOOKUP, request(by, [0, 1, 3], 5), conn)
    srv = p.servers["1"]
    old = weakref.ref(srv.dir)
    srv.term += 1  # slot 1 deposed and elected again: a new term's table, with a lease of its own
    srv._new_state()
    gc.collect()
    assert old() is None and conn.process_leases  # a process lease keeps no old table alive
    for n in NODES:
        srv.dir.add_space(n, 1 << 26)
    kept = multislot.dispatch(p, Op.LOOKUP, request(by, [1], 1), Conn())  # (slot 1's new table: empty, a miss)
    assert kept["lease"] == 0 and leases(p) == [1, 0, 0, 1]
    assert p.release({"leases": [ans["lease"]]}, conn) == {"released": 1}  # slots 0 and 3, not the new table
    assert leases(p) == [0, 0, 0, 0] and int(srv.dir.cols["pins"].sum()) == 0
    assert not conn.process_leases
