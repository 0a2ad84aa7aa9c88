"""Node liveness and term checks of the metaserver, in-process without etcd (review 4.2, 4.10):

- a heartbeat counts only on the connection the node registered on, and a refused one changes nothing (validate,
  then mutate): before, ``Membership.heartbeat`` refreshed the node and only then did the handler refuse it, so a
  twin holding the cluster secret kept a dead node alive;
- ``_refresh`` (a node's etcd lease) checks its term after every await: a coroutine of an earlier term must not
  grant and write under the next term's fence;
- an oversized frame is told by its error type (``FrameTooLarge``), not by its message text.

The real-process twin heartbeat (a SIGSTOPped node) is ``tests/test_etcd_outage.py``.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from metaserver.handlers.membership import Membership
from metaserver.server import Connection
from metaserver.ha.partition import Partition
from metaserver.ha.service import Metaserver
from transport import wire
from transport.wire import Status
from umbp.config import MetaserverConfig
from umbp.errors import FrameTooLarge, ProtocolError, RemoteError

ARENA = b"\x01" * 16
TTL = 3.0


def desc(node_id: str = "node0") -> dict:
    return {"node_id": node_id, "host": "127.0.0.1", "port": 9000, "capacity": 1 << 24, "arena_id": ARENA,
            "lease_ttl": TTL}


def node_conn(name: str):
    """A connection as the handlers see it, authenticated with the cluster secret (node scope)."""
    return SimpleNamespace(name=name, closed=False, auth=SimpleNamespace(scope=SimpleNamespace(node=True,
                                                                                                name="cluster")))


def test_membership_refuses_a_heartbeat_from_another_connection_without_touching_the_node():
    m = Membership()
    node, _ = m.register(desc(), 100.0)
    own, twin = node_conn("own"), node_conn("twin")
    node.conn = own
    assert m.heartbeat("node0", ARENA, 101.0, own) is node and node.last_heartbeat == 101.0
    for t in (102.0, 103.0, 104.0):
        assert m.heartbeat("node0", ARENA, t, twin) is None
    assert node.last_heartbeat == 101.0
    node.provisional = True  # loaded at a takeover: must register again, its grace is not extended either
    assert m.heartbeat("node0", ARENA, 104.0, own) is None and node.last_heartbeat == 101.0
    assert [n.node_id for n in m.expired(101.0 + TTL + 0.1)] == ["node0"] and not node.alive


def test_a_twin_heartbeat_is_answered_not_found_and_the_node_still_expires(monkeypatch):
    async def main():
        ms = Partition(MetaserverConfig(), "127.0.0.1:1", 1).servers["0"]
        monkeypatch.setattr(Metaserver, "serving", property(lambda self: True))
        ms.settled.set()
        now = time.monotonic()
        node, _ = ms.members.register(desc(), now)
        ms.dir.add_space("node0", node.capacity)
        own, twin = node_conn("own"), node_conn("twin")
        node.conn = own
        own.closed = True  # the node's own connection is gone (frozen or dead); a twin holds the cluster secret
        for _ in range(5):
            with pytest.raises(RemoteError, match="register again") as e:
                ms.heartbeat({"node_id": "node0", "arena_id": ARENA}, twin)
            assert e.value.code == Status.NOT_FOUND
        assert node.last_heartbeat == now and not node.refreshing
        ms.tick(now + TTL / 2)
        assert node.alive
        ms.tick(now + TTL + 0.1)  # the background step's lease check
        assert not node.alive and ms.members.get("node0").dead_since == now + TTL + 0.1

    asyncio.run(main())


class LeaseStore:
    """``refresh`` waits at a gate, then says etcd forgot the lease; ``grant`` and ``put_node`` are recorded."""

    def __init__(self):
        self.gate = asyncio.Event()
        self.in_refresh = asyncio.Event()
        self.grants: list[int] = []
        self.puts: list[tuple] = []
        self.revoked: list[int] = []

    async def refresh(self, lease_id):
        self.in_refresh.set()
        await self.gate.wait()
        return 0

    async def grant(self, ttl):
        self.grants.append(ttl)
        return 77

    async def put_node(self, node_id, record, lease_id):
        self.puts.append((node_id, lease_id))

    async def revoke(self, lease_id):
        self.revoked.append(lease_id)


def refresh_across(monkeypatch, change) -> LeaseStore:
    """Run ``_refresh`` of a node, apply ``change(ms, node)`` while it waits in etcd, let it finish; the store."""
    async def main():
        ms = Partition(MetaserverConfig(), "127.0.0.1:1", 1).servers["0"]
        monkeypatch.setattr(Metaserver, "serving", property(lambda self: True))
        store = ms.store = LeaseStore()
        node, _ = ms.members.register(desc(), time.monotonic())
        node.lease_id, node.refreshing = 5, True
        task = asyncio.create_task(ms._refresh(node))
        await asyncio.wait_for(store.in_refresh.wait(), 5)
        change(ms, node)
        store.gate.set()
        await asyncio.wait_for(task, 5)
        await asyncio.gather(*ms._bg)
        assert not node.refreshing
        return store

    return asyncio.run(main())


def test_refresh_of_an_earlier_term_writes_nothing(monkeypatch):
    def next_term(ms, node):
        ms.term += 1  # stepped down and won again meanwhile: the store's fence is the new term's now

    store = refresh_across(monkeypatch, next_term)
    assert store.grants == [] and store.puts == []


def test_refresh_leaves_a_lease_a_registration_granted_meanwhile(monkeypatch):
    def registered(ms, node):
        node.lease_id = 6  # REGISTER_NODE granted and wrote its own lease

    store = refresh_across(monkeypatch, registered)
    assert store.puts == [] and store.grants == []
    store = refresh_across(monkeypatch, lambda ms, node: None)  # nothing changed: a new lease, written
    assert store.grants == [int(TTL)] and store.puts == [("node0", 77)]


class Transport:
    def __init__(self):
        self.out: list[bytes] = []
        self.closed = False

    def write(self, data):
        self.out.append(data)

    def is_closing(self):
        return self.closed

    def close(self):
        self.closed = True


def answer_to(e: ProtocolError) -> int:
    conn = object.__new__(Connection)
    conn.closed, conn.peer, conn.transport = False, "test", Transport()
    conn.reader = wire.FrameReader("metaserver")
    conn.unframeable(e)
    assert conn.transport.closed
    return wire.decode_header(conn.transport.out[0], "test")[2]


def test_an_oversized_frame_is_told_by_its_type_not_its_text():
    hdr = wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.Op.PING, 0, 0, 1, 0, 1 << 40)
    with pytest.raises(FrameTooLarge) as e:
        wire.decode_header(hdr, "metaserver")
    assert answer_to(e.value) == Status.TOO_LARGE
    # a malformed frame whose message happens to hold the words is still a bad frame
    assert answer_to(ProtocolError("metaserver", "bad meta: 'exceeds the limit' in a key")) == Status.BAD_FRAME
