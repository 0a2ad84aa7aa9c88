"""The metaclient's retry loop against scripted servers on loopback (real sockets, frames from ``transport.wire``):
following NOT_LEADER, asking a loading leader again, leaving a silent address, failing fast when nobody listens."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from transport import wire
from umbp import metaclient
from umbp.errors import DeadlineExceeded, TransportError
from umbp.metaclient import MetaClient


class ScriptedServer:
    """Answers each request with the next reply of ``script`` (a callable given the request count; ``op`` is the
    request's opcode meanwhile): a meta dict for OK, ``("status", code, extra)`` for an error, or None to stay
    silent."""

    def __init__(self, script):
        self.script = script
        self.requests = 0
        self.op, self.meta = None, None  # the request being answered
        self.lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.addr = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        self.sock.settimeout(0.1)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._conn, args=(conn,), daemon=True).start()

    def _conn(self, conn):
        reader = wire.FrameReader("scripted")
        conn.settimeout(0.1)
        while not self.stop.is_set():
            buf = reader.get_buffer()
            try:
                n = conn.recv_into(buf)
            except socket.timeout:
                continue
            except OSError:
                return
            if not n:
                return
            for frame, _ in reader.buffer_updated(n):
                if frame.op == wire.Op.HELLO:
                    conn.sendall(wire.encode(frame.op, frame.request_id, {"auth": False}, flags=wire.Flag.RESPONSE))
                    continue
                with self.lock:  # one request at a time: ``op`` is this one's while the script runs
                    self.requests += 1
                    self.op, self.meta = frame.op, frame.meta
                    reply = self.script(self.requests)
                if reply is None:
                    continue
                if isinstance(reply, tuple):
                    _, code, extra = reply
                    conn.sendall(wire.encode_error(frame.op, frame.request_id, code, "scripted: no", **extra))
                else:
                    conn.sendall(wire.encode(frame.op, frame.request_id, reply, flags=wire.Flag.RESPONSE))

    def close(self):
        self.stop.set()
        self.sock.close()


@pytest.fixture
def servers():
    made = []

    def make(script):
        s = ScriptedServer(script)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def test_follows_not_leader_and_asks_a_loading_leader_again(servers):
    leader = servers(lambda n: ("status", wire.Status.UNAVAILABLE, {}) if n <= 2 else {"ok": n})
    standby = servers(lambda n: ("status", wire.Status.NOT_LEADER, {"leader": leader.addr}))
    mc = MetaClient([standby.addr])
    assert mc.call(wire.Op.STATS, {}, time.monotonic() + 10) == {"ok": 3}
    assert mc.addrs == [standby.addr, leader.addr] and mc.address == leader.addr
    # the second UNAVAILABLE in a row sends it round the list once (a leader cut off from etcd stays UNAVAILABLE):
    # the standby names the leader again
    assert (standby.requests, leader.requests, mc.sent[wire.Op.STATS]) == (2, 3, 5)
    mc.close()


def test_a_silent_address_costs_one_attempt_and_the_next_call_starts_elsewhere(servers, monkeypatch):
    monkeypatch.setattr(metaclient, "ATTEMPT_S", 0.3)
    silent = servers(lambda n: None)
    good = servers(lambda n: {"n": n})
    mc = MetaClient([silent.addr, good.addr])
    assert mc.call(wire.Op.STATS, {}, time.monotonic() + 10) == {"n": 1}
    assert silent.requests == 1
    assert mc.call(wire.Op.STATS, {}, time.monotonic() + 10) == {"n": 2}
    assert silent.requests == 1  # not asked again: the client stays with the address that answers
    with pytest.raises(DeadlineExceeded):
        MetaClient([silent.addr]).call(wire.Op.STATS, {}, time.monotonic() + 0.5)
    mc.close()


def test_nobody_listening_fails_in_a_few_backoffs_not_at_the_deadline():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = "127.0.0.1:%d" % s.getsockname()[1]
    mc = MetaClient([addr, addr])
    with pytest.raises(TransportError, match="no metaserver is listening") as ei:
        mc.call(wire.Op.STATS, {}, time.monotonic() + 60)
    assert "refused %d times" % (metaclient.REFUSED_PASSES * 2) in str(ei.value)
