"""The node's READV (umbp/node/server.py ``DataProtocol.readv``) over a real shared-memory arena, called in process: the
answer's layout, and the header memo (``NodeServer.checked``): a slot whose 64 header bytes equal ones that passed
the full check for the same (offset, tag, generation, length) is served without checking again, while a slot
rewritten since (another generation, a torn header) is checked in full and fails."""

from __future__ import annotations

import pytest

from transport import objformat, wire
from transport.objformat import ALIGN, ARENA_DATA_START
from umbp.config import NodeConfig
from umbp.node.server import DataProtocol, NodeServer

PLEN = 1000
HS = objformat.OBJ_HEADER_SIZE


@pytest.fixture
def node(tmp_path):
    n = NodeServer(NodeConfig(capacity=1 << 20, arena_dir=str(tmp_path)))  # open pool: no capabilities
    yield n
    n.arena.close()


def put(node, i: int, gen: int) -> bytes:
    off = ARENA_DATA_START + i * ALIGN
    payload = bytes([i + 1]) * PLEN
    node.arena.view[off:off + HS + PLEN] = objformat.pack_object_header(100 + i, gen, PLEN) + payload
    return payload


def readv(node, conn, ops):
    """One READV of ``ops`` [(index, generation)]: (failures meta, the data bytes of the answer)."""
    meta = [[ARENA_DATA_START + i * ALIGN, 0, PLEN, 100 + i, gen, PLEN, b""] for i, gen in ops]
    conn._out = []
    conn.readv(wire.Frame(wire.Op.READV, 0, 0, 9, meta, None, 0))
    head, *bufs = conn._out
    _op, _flags, _status, rid, meta_len, data_len = wire.decode_header(head, "t")
    failures = wire.unpack_meta(head[wire.HEADER_SIZE:], "t") if meta_len else None
    data = b"".join(bytes(b) for b in bufs)
    assert rid == 9 and len(data) == data_len
    return failures, data


def test_readv_checks_a_header_once_and_a_rewritten_slot_again(node, monkeypatch):
    payloads = [put(node, i, 1) for i in range(4)]
    calls = []
    real = objformat.check_object_header
    monkeypatch.setattr(objformat, "check_object_header", lambda *a: calls.append(a[2:]) or real(*a))
    conn = DataProtocol(node)
    failures, data = readv(node, conn, [(i, 1) for i in range(4)])
    want = b"".join(objformat.pack_object_header(100 + i, 1, PLEN) + payloads[i] for i in range(4))
    assert failures is None and data == want and len(calls) == 4
    calls.clear()
    failures, data = readv(node, DataProtocol(node), [(i, 1) for i in range(4)])  # another connection too
    assert failures is None and data == want and calls == []  # the same bytes: no check again
    # slot 1 reused by generation 2, slot 2's header torn: both checked in full, both fail; 0 and 3 still served
    put(node, 1, 2)
    node.arena.view[ARENA_DATA_START + 2 * ALIGN + 20] ^= 0xFF
    failures, data = readv(node, conn, [(i, 1) for i in range(4)])
    assert [f[0] for f in failures] == [1, 2] and {f[1] for f in failures} == {wire.Status.CORRUPT}
    assert "stale slot" in failures[0][2] and "torn object header" in failures[1][2]
    assert data == want[:HS + PLEN] + want[3 * (HS + PLEN):]
    assert sorted(c[1] for c in calls) == [1, 1]  # slots 1 and 2 (generation asked: 1), checked in full
    # the new generation in slot 1 is checked once, then remembered
    calls.clear()
    assert readv(node, conn, [(1, 2)])[0] is None and readv(node, conn, [(1, 2)])[0] is None and len(calls) == 1
