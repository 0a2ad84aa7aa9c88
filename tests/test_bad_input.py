"""Hostile and malformed input to the metaserver and node ports: clear errors, servers keep serving, no data lost."""

from __future__ import annotations

import socket
import time

import pytest

import umbp
from transport import wire
from transport.framed import FramedSocket
from umbp.config import split_host_port
from umbp.errors import BadRequest


def raw_exchange(addr: str, data: bytes, timeout: float = 5.0) -> bytes:
    """Send raw bytes, return everything the server sends back until it closes or goes quiet."""
    host, port = split_host_port(addr)
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        end = time.monotonic() + timeout
        s.settimeout(0.5)
        while time.monotonic() < end:
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                if out:
                    break
                continue
            if not chunk:
                break
            out += chunk
        return out


def parse_reply(data: bytes) -> wire.Frame:
    r = wire.FrameReader("test")
    buf = r.get_buffer()
    buf[:len(data)] = data
    frames = r.buffer_updated(len(data))
    assert frames, f"no complete frame in {data[:80]!r}"
    return frames[0][0]


def request(addr: str, op: int, meta) -> wire.Frame:
    conn = FramedSocket(addr, "test", time.monotonic() + 5)
    try:
        conn.send([wire.encode(op, 9, meta)], time.monotonic() + 5)
        return conn.recv_frame(time.monotonic() + 5)
    finally:
        conn.close()


def node_addrs(cluster) -> list[str]:
    return [n.addr for n in cluster.nodes]


@pytest.fixture
def seeded(cluster):
    with umbp.Client(cluster.metaserver_addr) as c:
        keys = [f"seed/{i}" for i in range(50)]
        assert all(c.batch_put(keys, [bytes([i]) * 5000 for i in range(50)]))
    return cluster, keys


def assert_pool_intact(cluster, keys):
    with umbp.Client(cluster.metaserver_addr) as c:
        outs = [bytearray(5000) for _ in keys]
        assert c.batch_get_into(keys, outs) == [5000] * len(keys)
        assert all(bytes(o) == bytes([i]) * 5000 for i, o in enumerate(outs))


@pytest.mark.parametrize("target", ["metaserver", "node"])
def test_garbage_and_oversized_frames_get_clear_errors(seeded, target):
    cluster, keys = seeded
    addr = cluster.metaserver_addr if target == "metaserver" else node_addrs(cluster)[0]
    # 1. not our protocol at all
    f = parse_reply(raw_exchange(addr, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 64))
    assert f.status == wire.Status.BAD_FRAME and "bad frame magic" in f.meta["error"]
    assert f.meta["error"].startswith(target)
    # 2. a header announcing a 1 TiB body
    hdr = wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.Op.PING, 0, 0, 1, 0, 1 << 40)
    f = parse_reply(raw_exchange(addr, hdr))
    assert f.status in (wire.Status.BAD_FRAME, wire.Status.TOO_LARGE) and "exceeds" in f.meta["error"]
    # 3. a truncated frame followed by a hang-up must not wedge anything
    raw_exchange(addr, wire.encode(wire.Op.PING, 1, {"x": "y" * 100})[:30], timeout=0.5)
    assert_pool_intact(cluster, keys)


@pytest.mark.parametrize("target", ["metaserver", "node"])
def test_unknown_opcodes_and_bad_meta_keep_the_connection_serving(seeded, target):
    cluster, keys = seeded
    addr = cluster.metaserver_addr if target == "metaserver" else node_addrs(cluster)[0]
    conn = FramedSocket(addr, "test", time.monotonic() + 5)
    d = lambda: time.monotonic() + 5  # noqa: E731
    conn.send([wire.encode(0x7E, 1, {})], d())
    f = conn.recv_frame(d())
    assert f.status == wire.Status.UNKNOWN_OPCODE and "unknown opcode" in f.meta["error"]
    # malformed msgpack body, well framed
    conn.send([wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.Op.PING, 0, 0, 2, 2, 0) + b"\xc1\xc1"], d())
    f = conn.recv_frame(d())
    assert f.status == wire.Status.BAD_REQUEST and "malformed msgpack" in f.meta["error"]
    # the same connection still answers
    conn.send([wire.encode(wire.Op.PING, 3, {})], d())
    f = conn.recv_frame(d())
    assert f.status == wire.Status.OK and f.request_id == 3
    conn.close()
    assert_pool_intact(cluster, keys)


@pytest.mark.parametrize("meta, fragment", [
    ({"ns": "default", "keys": "notalist"}, "keys"),
    ({"ns": "default", "keys": [1, 2, 3]}, "keys"),
    ({"ns": 5, "keys": [b"a"]}, "ns"),
    ({"keys": [b"a"]}, "ns"),
    ({"ns": "default", "keys": [b"a" * 600]}, "keys"),
    ([1, 2, 3], "map"),
])
def test_metaserver_rejects_wrong_types_naming_the_field(seeded, meta, fragment):
    cluster, keys = seeded
    f = request(cluster.metaserver_addr, wire.Op.LOOKUP, meta)
    assert f.status == wire.Status.BAD_REQUEST, f.meta
    assert f.meta["error"].startswith("metaserver") and fragment in f.meta["error"]
    assert_pool_intact(cluster, keys)


@pytest.mark.parametrize("op, meta", [
    (wire.Op.ALLOC, {"ns": "default", "keys": [b"a", b"b"], "sizes": [10]}),
    (wire.Op.ALLOC, {"ns": "default", "keys": [b"a"], "sizes": [-5]}),
    (wire.Op.ALLOC, {"ns": "default", "keys": [b"a"], "sizes": [1 << 50]}),
    (wire.Op.ALLOC, {"ns": "default", "keys": [b"a"], "sizes": ["10"]}),
    (wire.Op.COMMIT, {"ns": "default", "keys": [b"a"], "gens": ["x"]}),
    (wire.Op.DRAIN, {"node_id": 7}),
    (wire.Op.REGISTER_NODE, {"node_id": "x"}),
    (wire.Op.EVICT, {"bytes": "lots"}),
])
def test_metaserver_rejects_inconsistent_requests(seeded, op, meta):
    cluster, keys = seeded
    f = request(cluster.metaserver_addr, op, meta)
    assert f.status in (wire.Status.BAD_REQUEST, wire.Status.POOL_FULL), f.meta
    assert f.meta["error"].startswith("metaserver")
    assert_pool_intact(cluster, keys)


def test_node_rejects_ranges_outside_its_arena_and_never_leaks_other_objects(seeded):
    cluster, keys = seeded
    addr = node_addrs(cluster)[0]
    conn = FramedSocket(addr, "test", time.monotonic() + 5)
    cap = 64 << 20
    for meta in ([0, 0, 10, 0, 0, 10], [4096 + cap, 0, 10, 0, 0, 10], [4097, 0, 10, 0, 0, 10],
                 [4096, 0, 1 << 40, 0, 0, 1 << 40], ["a", 0, 1, 0, 0, 1], [4096, 0, 10]):
        with pytest.raises(BadRequest, match="READ"):
            conn.request(wire.Op.READ, meta, time.monotonic() + 5)
    # a well-formed read of a slot with the wrong key hash: refused, no payload bytes sent
    conn.send([wire.encode(wire.Op.READ, 77, [4096, 0, 100, 12345, 1, 100])], time.monotonic() + 5)
    f = conn.recv_frame(time.monotonic() + 5)
    assert f.status in (wire.Status.CORRUPT, wire.Status.BAD_REQUEST) and f.data is None
    # a WRITE outside the arena: refused, the bytes go nowhere
    with pytest.raises(BadRequest, match="WRITE"):
        conn.request(wire.Op.WRITE, [4096 + cap], time.monotonic() + 5, data=[b"z" * 8192])
    with pytest.raises(BadRequest, match="WRITE"):
        conn.request(wire.Op.WRITE, [4096], time.monotonic() + 5, data=[b"z" * 10])
    assert conn.request(wire.Op.PING, {}, time.monotonic() + 5).status == wire.Status.OK
    conn.close()
    assert_pool_intact(cluster, keys)


def test_many_connections_dropped_mid_frame_leave_servers_serving(seeded):
    cluster, keys = seeded
    for addr in [cluster.metaserver_addr] + node_addrs(cluster):
        host, port = split_host_port(addr)
        for i in range(50):
            with socket.create_connection((host, port), timeout=2) as s:
                s.sendall(wire.encode(wire.Op.LOOKUP, i, {"ns": "default", "keys": [b"k"] * 100})[: 10 + i])
    assert_pool_intact(cluster, keys)
