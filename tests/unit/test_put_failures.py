"""A put that fails raises its own error, never an internal one and never a later clean-up's (issue 42): against
scripted metaservers on loopback (``test_metaclient.ScriptedServer``), so each failure comes where the test puts it.

- A partitioned pool whose slot never answers: the pipelined put's ALLOC fails at the deadline, and its unwind asks
  the router for that same ALLOC again (``puts._unwind``). The router had dropped the ticket's connections' tickets
  when it raised, and the second ``result`` raised a raw ``AttributeError`` out of ``MetaClient.result``.
- A write that raises, whose ABORT then fails too (the call's deadline has often passed by then): the ABORT's error
  replaced the write's.
"""

from __future__ import annotations

import time

import pytest

from test_metaclient import servers  # noqa: F401  (fixture)
from transport import slotrules, wire
from transport.wire import Op
from umbp.client import Client
from umbp.errors import DeadlineExceeded, TransportUnavailable, UmbpError
from umbp.slotrouter import MetaRouter

NEW, EXISTS = wire.AllocState.NEW, wire.AllocState.EXISTS


def test_a_put_whose_slot_never_answers_fails_with_the_deadline_not_an_internal_error(servers):
    """Two processes of a 2-slot pool; the one leading slot 1 accepts connections and never answers. A put of 300
    pages (three pipelined chunks) raises DeadlineExceeded naming slot 1, and its unwind's second ``result`` on the
    failed ALLOC raises a library error too."""
    asked = {"alloc": 0}

    def a_script(_n):
        if a.op == Op.LEADER:
            return {"leader": a.addr, "is_leader": True, "slots": 2, "map": [a.addr, b.addr],
                    "members": sorted([a.addr, b.addr])}
        if a.op == Op.ALLOC:  # slot 0's part: every page there already
            asked["alloc"] += 1
            return {"items": [[EXISTS] for _ in a.meta["keys"]]}
        return ("status", wire.Status.BAD_REQUEST, {})

    a = servers(a_script)
    b = servers(lambda _n: None)  # leads slot 1, silent: a host gone quiet
    keys = [f"k{i}" for i in range(300)]
    assert set(slotrules.slots_of("default", [k.encode() for k in keys[:128]], 2)) == {0, 1}  # every chunk spans both
    with Client(a.addr, timeout=2.0) as c:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="slot 1: no leader answered before the deadline"):
            c.batch_put(keys, [b"x" * 64] * len(keys))
        assert time.monotonic() - t0 < 10.0
    assert asked["alloc"] >= 1 and b.requests >= 1

    # The router alone: a ticket whose result raised is asked again (what the unwind does), after the deadline and
    # before it; each time a library error, never the AttributeError of a ticket already given up.
    r = MetaRouter([a.addr])
    try:
        meta = {"ns": "default", "keys": [k.encode() for k in keys[:8]], "sizes": [64] * 8, "token": 7}
        t = r.submit(Op.ALLOC, meta, time.monotonic() + 1.0)
        with pytest.raises(DeadlineExceeded):
            r.result(t, time.monotonic() + 1.0)
        with pytest.raises(UmbpError):
            r.result(t, time.monotonic() - 1.0)
        with pytest.raises(DeadlineExceeded):
            r.result(t, time.monotonic() + 1.0)
    finally:
        r.close()


def test_a_write_that_raises_and_whose_abort_fails_raises_the_write_error(servers):
    """An unpartitioned scripted metaserver places the pages on a node the client cannot reach with the transport
    it forces (``transport="shm"``, no arena there): the write raises TransportUnavailable. The ABORT that follows
    is refused (as one past the deadline is): the put raises the write's error, and no COMMIT was sent."""
    seen: list[int] = []

    def script(_n):
        seen.append(m.op)
        if m.op == Op.LEADER:
            return {"leader": m.addr, "is_leader": True}
        if m.op == Op.ALLOC:
            return {"items": [[NEW, "n1", 4096 * (i + 1), 64, 100 + i, 1, None] for i in range(len(m.meta["keys"]))]}
        if m.op == Op.NODES:
            return {"nodes": [{"node_id": "n1", "host": "127.0.0.1", "port": 9, "arena_path": "/nonexistent/arena",
                               "arena_id": b"A" * 16, "boot_id": "", "transports": ["tcp"], "alive": True}]}
        if m.op == Op.ABORT:
            return ("status", wire.Status.BAD_REQUEST, {})  # refused: a clean-up that fails
        return ("status", wire.Status.BAD_REQUEST, {})

    m = servers(script)
    with Client(m.addr, transport="shm", timeout=5.0) as c:
        with pytest.raises(TransportUnavailable, match="transport shm forced but unusable for node n1"):
            c.batch_put([f"k{i}" for i in range(4)], [b"x" * 64] * 4)
    assert Op.ABORT in seen and Op.COMMIT not in seen
