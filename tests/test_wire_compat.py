"""Wire compatibility (review of issue 42; the rule is in transport/wire.py and docs/operations/upgrades.md):
today's servers accept frames of the previous wire version and answer them in that version, so clients and nodes
of the previous release keep working while a pool is upgraded (metaservers first, then nodes, then engines). The
previous version's request frames are fixtures (tests/fixtures/wire/v11.json: bytes as such a client sent them);
they are replayed against a real metaserver and node. Frames older than that are refused with an error naming the
versions, and the server keeps serving."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import msgpack
import pytest

from transport import objformat, wire
from transport.wire import HEADER, HEADER_SIZE, Op, Status
from umbp.config import split_host_port

FIXTURES = json.loads((Path(__file__).parent / "fixtures" / "wire" / "v11.json").read_text())
OLD = FIXTURES["version"]
FRAMES = {k: bytes.fromhex(v) for k, v in FIXTURES["frames"].items()}


def test_the_fixtures_are_the_previous_version_and_readers_take_it():
    assert OLD == wire.MIN_VERSION == wire.VERSION - 1
    reader = wire.FrameReader("t")
    for name, raw in FRAMES.items():
        if name.startswith("v10"):
            continue
        buf = reader.get_buffer(len(raw))
        buf[:len(raw)] = raw
        (frame, err), = reader.buffer_updated(len(raw))
        assert err is None and reader.version == OLD, name
    for bad in (OLD - 1, wire.VERSION + 1):
        with pytest.raises(wire.ProtocolError, match=f"unsupported wire version {bad}"):
            wire.decode_header(wire.encode(Op.PING, 1, {}, version=bad), "t")


class Raw:
    """A peer that speaks bytes: frames go out as given, answers are read whole (header, meta, data)."""

    def __init__(self, addr: str):
        self.sock = socket.create_connection(split_host_port(addr, "test"), timeout=10)

    def exchange(self, raw: bytes, data: bytes = b"") -> tuple[int, int, dict, bytes]:
        self.sock.sendall(raw + data)
        head = self._exactly(HEADER_SIZE)
        _magic, version, _op, _flags, status, _rid, meta_len, data_len = HEADER.unpack(head)
        meta = msgpack.unpackb(self._exactly(meta_len), raw=False, strict_map_key=False) if meta_len else None
        return version, status, meta, self._exactly(data_len)

    def _exactly(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("closed")
            out += chunk
        return bytes(out)


def test_a_client_of_the_previous_version_puts_and_gets_against_todays_servers(make_cluster):
    cl = make_cluster(nodes=1)
    meta = Raw(cl.metaserver_addr)
    for name in ("hello", "ping"):
        version, status, answer, _ = meta.exchange(FRAMES[name])
        assert (version, status) == (OLD, Status.OK), (name, answer)
    version, status, answer, _ = meta.exchange(FRAMES["alloc"])
    assert (version, status) == (OLD, Status.OK)
    state, node_id, off, plen, gen, tag, _cap = answer["items"][0]
    assert state == wire.AllocState.NEW and plen == 5000
    with cl.client() as c:
        node_addr = {n["node_id"]: n["addr"] for n in c.admin(Op.NODES)["nodes"]}[node_id]
    node = Raw(node_addr)
    payload = os.urandom(plen)
    obj = objformat.pack_object_header(tag, gen, plen) + payload
    version, status, answer, _ = node.exchange(wire.encode(Op.WRITE, 1, [off, gen, b""], data_len=len(obj),
                                                           version=OLD), obj)
    assert (version, status) == (OLD, Status.OK), answer
    version, status, answer, _ = meta.exchange(wire.encode(Op.COMMIT, 4, {"ns": "compat", "keys": [b"compat-key"],
                                                                          "gens": [gen]}, version=OLD))
    assert (version, status, answer) == (OLD, Status.OK, {"ok": [True]})
    version, status, answer, _ = meta.exchange(FRAMES["lookup"])
    assert (version, status) == (OLD, Status.OK)
    loc, absent = answer["locs"]
    assert absent is None and loc[:4] == [node_id, off, plen, gen]
    version, status, answer, data = node.exchange(wire.encode(Op.READ, 2, [off, 0, plen, tag, gen, plen, b""],
                                                              version=OLD))
    assert (version, status) == (OLD, Status.OK) and data[objformat.OBJ_HEADER_SIZE:] == payload
    version, status, answer, _ = meta.exchange(FRAMES["exists"])
    assert (version, status, answer) == (OLD, Status.OK, {"exists": [True, False]})
    version, status, answer, _ = meta.exchange(FRAMES["stats"])
    assert (version, status) == (OLD, Status.OK) and answer["objects"] >= 1
    with cl.client(namespace="compat") as c:  # today's client reads what the old one wrote
        assert c.get(b"compat-key") == payload

    # a frame older than the previous version: refused by name, the connection closed, the server still serving
    version, status, answer, _ = Raw(cl.metaserver_addr).exchange(FRAMES["v10_ping"])
    assert status == Status.BAD_FRAME and f"unsupported wire version {OLD - 1}" in answer["error"]
    version, status, _, _ = meta.exchange(FRAMES["ping"])
    assert (version, status) == (OLD, Status.OK)
