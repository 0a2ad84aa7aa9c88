"""A leader that gives its directory up on purpose (a partitioned pool's slot handover, a clean stop) hands its open
allocations on, and the next leader keeps their extents out of placement while their writers may still write
(``metaserver/ha/handoff.py``).

Why: CI once read "stale slot: holds generation ... of another key" after a failover with a rebalance: a put
allocated by the old term was written after the new leader had placed another key on the same extent (a client
holds one slot's allocation while another slot of the same ALLOC fails over; nothing fences a shm write).

Each test holds allocations open on a raw connection that stays open (a connection that closes takes its open
allocations with it), lets the directory move, puts new pages there, then plays the late writer: it overwrites
every open extent in the node's arena file and reads the new pages back byte for byte. Real etcd, metaserver and
node processes; every wait is bounded.
"""

from __future__ import annotations

import os
import time

import pytest

from cluster import NotYet, eventually
from test_failover import ELECTION_TTL_S, ms_env, wait_leader
from test_slots import SLOTS, TTL_S, partitioned, payload, wait_map
from metaserver.ha.slots import leaders
from transport import objformat, slotrules
from transport.framed import FramedSocket
from transport.wire import Op
from umbp.errors import BadRequest, NotLeader, TransportError, Unavailable

NS = "default"
SIZE = 6000
HELD_LOG = "the last leader left allocated and uncommitted"  # service.py's line at a takeover that holds runs


def key_of_slot(s: int, tag: str, slots: int = SLOTS) -> bytes:
    for i in range(100_000):
        k = f"{tag}-{i}".encode()
        if slotrules.slot_of(NS, k, slots) == s:
            return k
    raise AssertionError(f"no key of slot {s}")


def open_allocation(sock: FramedSocket, key: bytes, slot: int | None = None) -> tuple:
    """ALLOC ``key`` on ``sock`` and leave it open: (gen, node_id, offset)."""
    meta = {"ns": NS, "keys": [key], "sizes": [SIZE]}
    if slot is not None:
        meta["slot"] = slot
    item = sock.request(Op.ALLOC, meta, time.monotonic() + 5).meta["items"][0]
    assert item[0] == 0, item  # NEW: placed, not written, not committed
    return item[4], item[1], item[2]


def write_late(cl, opened: list[tuple]) -> None:
    """The late writer: every open extent (header and payload) overwritten in its node's arena file."""
    arenas = {n.node_id: n.arena_files() for n in cl.nodes}
    for _gen, node_id, off in opened:
        [path] = [p for p in arenas[node_id] if p.name.endswith(".arena")]
        fd = os.open(path, os.O_WRONLY)
        try:
            assert os.pwrite(fd, b"\xee" * objformat.object_size(SIZE), off) == objformat.object_size(SIZE)
        finally:
            os.close(fd)


def put_and_check(cl, keys: list[bytes], late: list[tuple]) -> None:
    with cl.client() as c:
        assert c.batch_put(keys, [payload(i) for i in range(len(keys))]) == [True] * len(keys)
        write_late(cl, late)
        outs = [bytearray(SIZE) for _ in keys]
        assert c.batch_get_into(keys, outs) == [SIZE] * len(keys)
    assert [bytes(o) == payload(i) for i, o in enumerate(outs)] == [True] * len(keys)


def test_slot_handover_hands_its_open_allocations_on(make_cluster):
    cl = partitioned(make_cluster, metaservers=1)
    first = cl.metaserver.addr
    wait_map([first], {first}, 30.0)
    held = FramedSocket(first, "test writer", time.monotonic() + 5)
    try:
        # the slots' directories learn the registered nodes from etcd a moment after the map settles (a loaded
        # machine: "no storage node known yet"): the first allocation waits for that
        eventually(lambda: open_allocation(held, key_of_slot(0, "first")), 20.0,
                   "slot 0's leader knows the storage nodes", errors=(Unavailable,))
        opened = {}
        for s in range(SLOTS):  # each slot FENCEs the nodes itself before it places ("not fenced yet": a moment)
            k = key_of_slot(s, "open")
            opened[s] = (k,) + eventually(lambda: open_allocation(held, k, s), 20.0,
                                          f"slot {s}'s leader has fenced the storage nodes", errors=(Unavailable,))
        joined = cl.harness.metaserver(cl.etcd.url, slots=SLOTS, election_ttl=TTL_S)
        cl.metaservers.append(joined)
        moving = [s for s, a in enumerate(leaders(SLOTS, [first, joined.addr])) if a == joined.addr]
        assert moving and len(moving) < SLOTS
        # The handover does not wait for the open allocations: the joiner takes its share at once.
        info = wait_map([first, joined.addr], {first, joined.addr}, 30.0)
        assert [s for s, a in enumerate(info["map"]) if a == joined.addr] == moving
        for s in range(SLOTS):  # a moved slot's writer learns at COMMIT; a staying slot's commits as usual
            k, gen, _node, _off = opened[s]
            meta = {"ns": NS, "keys": [k], "gens": [gen], "slot": s}
            if s in moving:
                try:
                    held.request(Op.COMMIT, meta, time.monotonic() + 5)
                    raise AssertionError(f"slot {s}: COMMIT answered by the leader it was handed over from")
                except NotLeader as e:
                    assert e.leader == joined.addr
            else:
                assert held.request(Op.COMMIT, meta, time.monotonic() + 5).meta["ok"] == [True]
    finally:
        held.close()
    # New pages of the moved slots, the late writes of their open allocations, and every new byte intact.
    fresh = [key_of_slot(s, f"fresh{j}") for s in moving for j in range(3)]
    put_and_check(cl, fresh, [opened[s][1:] for s in moving])
    assert HELD_LOG in joined.stderr_text(), joined.tail()  # logged before serving: the puts were served
    with cl.client() as c:  # the open allocations of moved slots were never committed: nothing of theirs is read
        assert c.batch_exists([opened[s][0] for s in range(SLOTS)]) == [s not in moving for s in range(SLOTS)]


def test_clean_stop_hands_its_open_allocations_on(make_cluster):
    cluster = make_cluster(metaservers=2, nodes=1, lease_ttl=5, metaserver_flags=ms_env())
    old, standby = cluster.metaservers
    assert wait_leader(cluster, timeout=10) is old
    held = FramedSocket(old.addr, "test writer", time.monotonic() + 5)
    try:
        opened = [open_allocation(held, f"open-at-stop{i}".encode()) for i in range(3)]
        assert old.stop() == 0
    finally:
        held.close()
    assert "handing 1 runs" in old.stderr_text(), old.tail()  # three adjacent extents: one run
    assert wait_leader(cluster, exclude=(old,), timeout=ELECTION_TTL_S + 10) is standby
    put_and_check(cluster, [f"fresh{i}".encode() for i in range(6)], opened)
    assert HELD_LOG in standby.stderr_text(), standby.tail()  # logged before serving: the puts were served


def test_a_closed_connections_open_allocations_stay_unplaced(make_cluster):
    """A writer's connection closes while its allocations are open (``drop_pending``): the keys are free for other
    writers at once, but the extents stay out of placement while the writer may still write the places it got (it
    writes without the metaserver, then finds its COMMIT failed). New pages put meanwhile survive its late writes."""
    cluster = make_cluster(metaservers=1, nodes=1)
    held = FramedSocket(cluster.metaserver.addr, "test writer", time.monotonic() + 5)
    try:
        opened = [open_allocation(held, f"open-at-close{i}".encode()) for i in range(3)]
    finally:
        held.close()
    with cluster.client() as c:
        def closed() -> dict:  # the close is handled
            s = c.admin(Op.STATS)
            if s["pending"]:
                raise NotYet(f"STATS {s}")
            return s

        s = eventually(closed, 10, "no allocation pending", interval=0.02)
        assert s["pending"] == 0 and s["held_bytes"] == 3 * objformat.object_size(SIZE) > 0, s
    # an aborted key itself is free for another writer at once
    put_and_check(cluster, [b"open-at-close0"] + [f"fresh{i}".encode() for i in range(6)], opened)
    assert "allocations pending: aborted" in cluster.metaserver.stderr_text(), cluster.metaserver.tail()


def test_an_abort_of_written_places_keeps_them_unplaced(make_cluster, monkeypatch):
    """An ABORT that says its places were written (``"written": true``: the write failed, a node or copy thread
    may still apply it) keeps their extents out of placement like a closed connection's; one without it frees them
    at once. New pages put meanwhile survive the late writes. The client says it on a failed write."""
    cluster = make_cluster(metaservers=1, nodes=1)
    sock = FramedSocket(cluster.metaserver.addr, "test writer", time.monotonic() + 5)
    try:
        opened = [open_allocation(sock, f"failed-write{i}".encode()) for i in range(3)]
        for i, (gen, _node, _off) in enumerate(opened):
            meta = {"ns": NS, "keys": [f"failed-write{i}".encode()], "gens": [gen]}
            if i < 2:
                meta["written"] = True
            assert sock.request(Op.ABORT, meta, time.monotonic() + 5).meta["aborted"] == 1
        with pytest.raises(BadRequest, match="'written' must be true or false"):
            sock.request(Op.ABORT, {"ns": NS, "keys": [b"x"], "gens": [1], "written": 1}, time.monotonic() + 5)
    finally:
        sock.close()
    with cluster.client() as c:
        s = c.admin(Op.STATS)
        assert s["pending"] == 0 and s["held_bytes"] == 2 * objformat.object_size(SIZE), s
    put_and_check(cluster, [b"failed-write0"] + [f"fresh{i}".encode() for i in range(6)], opened[:2])
    # the client's own failed write: its ABORT says written, so the chunk's extents are kept too (over tcp: its
    # writes go through Client._run, which the test breaks; shm puts are written as arrays, umbp/putbatch.py)
    with cluster.client(transport="tcp") as c:
        before = c.admin(Op.STATS)["held_bytes"]

        def broken(batches, what, deadline):
            raise TransportError("test", "the write broke mid-way")

        monkeypatch.setattr(c, "_run", broken)
        with pytest.raises(TransportError, match="mid-way"):
            c.batch_put([b"doomed0", b"doomed1"], [payload(0), payload(1)])
        assert c.admin(Op.STATS)["held_bytes"] == before + 2 * objformat.object_size(SIZE)
