"""The batched data paths on real processes: a batch_put of several chunks (ALLOC and COMMIT pipelined on the
metaserver connection, every page acknowledged after its COMMIT), READV/WRITEV frames that fail one object and
serve the others, and ``get`` returning a ``bytes`` read in place. The tests share the module's cluster
(``shared_cluster``), each in a namespace of its own."""

from __future__ import annotations

import time

import numpy as np
import pytest

from transport import objformat, wire
from transport.framed import FramedSocket
from umbp import puts as client_mod

pytestmark = pytest.mark.shared_cluster


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_large_batch_put_is_chunked_pipelined_and_exact(cluster, transport):
    n = 2 * client_mod.CHUNK_MAX_PAGES + 44
    keys = [f"chunked-{transport}/{i}" for i in range(n)]
    vals = [np.random.default_rng(i).integers(0, 256, 5000 + i % 7, dtype=np.uint8) for i in range(n)]
    with cluster.client(transport=transport) as c:
        c.put(f"chunked-{transport}/warm", b"w")
        before = c.requests_sent()
        assert c.batch_put(keys, vals) == [True] * n
        after = c.requests_sent()
        sent = {op: after.get(op, 0) - before.get(op, 0) for op in ("ALLOC", "COMMIT")}
        assert sent == {"ALLOC": 3, "COMMIT": 3}  # 128 + 128 + 44 pages
        assert c.stats()["pending"] == 0
        outs = [np.zeros(len(v), np.uint8) for v in vals]
        assert c.batch_get_into(keys, outs) == [len(v) for v in vals]
        assert all(np.array_equal(o, v) for o, v in zip(outs, vals))
        page = c.get(keys[5])
        assert type(page) is bytes and page == vals[5].tobytes()
        assert c.batch_put(keys, vals) == [False] * n  # dedup, chunked too


def test_readv_and_writev_fail_one_object_and_serve_the_others(cluster):
    ns = "vec"
    with cluster.client(transport="tcp", namespace=ns) as c:
        keys = [f"k{i}".encode() for i in range(8)]
        assert c.batch_put(keys, [bytes([65 + i]) * (3000 + 1000 * i) for i in range(8)]) == [True] * 8
        locs = c._meta.call(wire.Op.LOOKUP, {"ns": ns, "keys": keys}, time.monotonic() + 5)["locs"]
        by_node: dict = {}
        for i, loc in enumerate(locs):
            by_node.setdefault(loc[0], []).append(i)
        node_id, (ia, ib) = next((n, ix[:2]) for n, ix in by_node.items() if len(ix) >= 2)  # 8 pages, 2 nodes
        addr = next(n["addr"] for n in c.admin(wire.Op.NODES)["nodes"] if n["node_id"] == node_id)
    conn = FramedSocket(addr, "test", time.monotonic() + 5, hello=True)
    try:
        (_, off_a, size_a, gen_a, tag_a, cap_a), (_, off_b, size_b, gen_b, tag_b, cap_b) = locs[ia], locs[ib]
        byte_a, byte_b = bytes([65 + ia]), bytes([65 + ib])
        far = 1 << 45  # outside every arena
        # READV: [a (whole), out-of-range, b (a range), a with the wrong generation]
        ops = [[off_a, 0, size_a, tag_a, gen_a, size_a, cap_a], [far, 0, 10, tag_a, gen_a, 10, cap_a],
               [off_b, 100, 50, tag_b, gen_b, size_b, cap_b], [off_a, 0, size_a, tag_a, gen_a + 1, size_a, cap_a]]
        f = conn.request(wire.Op.READV, ops, time.monotonic() + 5)
        failed = wire.vec_failures(f.meta, len(ops), "test")
        assert sorted(failed) == [1, 3] and type(failed[3]).__name__ == "CorruptionError"
        data = bytes(f.data)
        hs = objformat.OBJ_HEADER_SIZE
        assert len(data) == hs + size_a + hs + 50
        assert data[hs:hs + size_a] == byte_a * size_a and data[2 * hs + size_a:] == byte_b * 50
        # WRITEV: a rewritten in place (same generation, a new header) and an out-of-range object refused; the
        # refused one's bytes are dropped, a's land
        header = objformat.pack_object_header(tag_a, gen_a, size_a)
        meta = [[off_a, gen_a, cap_a, hs + size_a], [far, gen_a, cap_a, hs + 10]]
        f = conn.request(wire.Op.WRITEV, meta, time.monotonic() + 5,
                         data=[header, b"Z" * size_a, header, b"y" * 10])
        assert sorted(wire.vec_failures(f.meta, 2, "test")) == [1]
        f = conn.request(wire.Op.READV, ops[:1], time.monotonic() + 5)
        assert f.meta is None and bytes(f.data)[hs:] == b"Z" * size_a
    finally:
        conn.close()
