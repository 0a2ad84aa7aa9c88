"""Ranged reads and multi-part writes (the engine path: a layer group of a page-first page, a page written from one
buffer per layer) on real node processes, over tcp and shm; and ``Client.mapped`` (zero-copy access to same-host
arenas). The tests share the module's cluster (``shared_cluster``), each in a namespace of its own."""

from __future__ import annotations

import numpy as np
import pytest

from transport import objformat, wire
from umbp.errors import CorruptionError, InvalidArgument

LAYERS = 8
LAYER_BYTES = 6000  # deliberately not 4 KiB aligned: ranges must not depend on alignment


def layers_of(page: int) -> list[np.ndarray]:
    rng = np.random.default_rng(page)
    return [rng.integers(0, 256, LAYER_BYTES, dtype=np.uint8) for _ in range(LAYERS)]


def count_meta_calls(client) -> dict:
    """Wrap the client's metaserver connection to count requests per opcode (one LOOKUP per batch, ...). NODES,
    asked once when the client first meets a node, is not counted."""
    counts: dict = {}
    real_call, real_submit = client._meta.call, client._meta.submit

    def count(op):
        if op != wire.Op.NODES:
            counts[wire.Op(op).name] = counts.get(wire.Op(op).name, 0) + 1

    def call(op, meta, deadline):
        count(op)
        return real_call(op, meta, deadline)

    def submit(op, meta, deadline):  # a get reading ahead submits its LOOKUP (umbp/speculate.py)
        count(op)
        return real_submit(op, meta, deadline)

    client._meta.call, client._meta.submit = call, submit
    return counts


@pytest.mark.shared_cluster
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_put_from_layer_parts_and_read_layer_groups(cluster, transport):
    keys = [f"rg-{transport}/{p}" for p in range(12)]
    pages = [layers_of(p) for p in range(len(keys))]
    with cluster.client(transport=transport, checksum=True) as c:
        calls = count_meta_calls(c)
        assert c.batch_put_ranges(keys, pages) == [True] * len(keys)
        assert calls == {"ALLOC": 1, "COMMIT": 1}
        assert c.batch_put_ranges(keys[:2], pages[:2]) == [False, False]  # dedup, nothing written

        whole = [np.zeros(LAYERS * LAYER_BYTES, np.uint8) for _ in keys]
        assert c.batch_get_into(keys, whole) == [LAYERS * LAYER_BYTES] * len(keys)
        for w, ls in zip(whole, pages):
            assert w.tobytes() == b"".join(x.tobytes() for x in ls)

        # group g of 2 layers, plus a second, odd range per page: every range lands in its own out
        calls.clear()
        for g in range(LAYERS // 2):
            ranges = [[(2 * g * LAYER_BYTES, 2 * LAYER_BYTES), (LAYER_BYTES + 17, 33)] for _ in keys]
            outs = [[np.zeros(2 * LAYER_BYTES, np.uint8), bytearray(40)] for _ in keys]
            assert c.batch_get_ranges_into(keys, ranges, outs) == [2 * LAYER_BYTES + 33] * len(keys)
            for (grp, odd), ls in zip(outs, pages):
                assert grp.tobytes() == ls[2 * g].tobytes() + ls[2 * g + 1].tobytes()
                assert bytes(odd[:33]) == ls[1][17:50].tobytes() and bytes(odd[33:]) == bytes(7)
        assert calls == {"LOOKUP": LAYERS // 2}  # one metaserver round trip per batch
        assert set(c.transport_names().values()) == {transport}


@pytest.mark.shared_cluster
def test_ranged_read_misses_bad_ranges_and_zero_length(cluster):
    with cluster.client() as c:
        assert c.batch_put_ranges(["r/a"], [[b"abc", b"", b"defgh"]]) == [True]
        outs = [[bytearray(3), bytearray(0)], [bytearray(3), bytearray(1)]]
        assert c.batch_get_ranges_into(["r/a", "r/missing"], [[(2, 3), (8, 0)], [(0, 3), (0, 1)]], outs) == [3, -1]
        assert bytes(outs[0][0]) == b"cde"
        with pytest.raises(InvalidArgument, match="outside the page"):
            c.batch_get_ranges_into(["r/a"], [[(6, 3)]], [[bytearray(3)]])
        with pytest.raises(InvalidArgument, match="holds 2 bytes"):
            c.batch_get_ranges_into(["r/a"], [[(0, 3)]], [[bytearray(2)]])
        with pytest.raises(InvalidArgument, match="non-negative"):
            c.batch_get_ranges_into(["r/a"], [[(-1, 3)]], [[bytearray(3)]])
        with pytest.raises(InvalidArgument, match="must be \\(offset, length\\)"):
            c.batch_get_ranges_into(["r/a"], [[(0,)]], [[bytearray(3)]])
        with pytest.raises(InvalidArgument, match="2 ranges but 1 outs"):
            c.batch_get_ranges_into(["r/a"], [[(0, 1), (1, 1)]], [[bytearray(3)]])
        with pytest.raises(InvalidArgument, match="list of buffers"):
            c.batch_put_ranges(["r/b"], [b"not a list"])
        assert c.get("r/a") == b"abcdefgh"


@pytest.mark.shared_cluster
def test_mapped_gives_the_arena_bytes_and_detects_a_rewritten_slot(cluster):
    pages = [layers_of(100 + p) for p in range(4)]
    keys = [f"map/{p}" for p in range(4)]
    with cluster.client(transport="auto") as c, cluster.client(transport="tcp") as remote:
        assert c.batch_put_ranges(keys, pages) == [True] * 4
        with c.mapped(keys + ["map/absent"]) as m:
            assert m.locs[4] is None and all(loc is not None for loc in m.locs[:4])
            for (node_id, off, size), ls in zip(m.locs[:4], pages):
                assert size == LAYERS * LAYER_BYTES
                assert bytes(m.arenas[node_id][off:off + size]) == b"".join(x.tobytes() for x in ls)
        assert c.counters["bytes_mapped"] == 4 * LAYERS * LAYER_BYTES
        with remote.mapped(keys) as m:  # a client forced to tcp maps nothing
            assert m.locs == [None] * 4 and m.arenas == {}

        # Damage page 0's header in the arena: every reader, every transport, ranged or whole, refuses it.
        with pytest.raises(CorruptionError, match="rewritten while it was mapped"):
            with c.mapped(keys[:1]) as m:
                node_id, off, _ = m.locs[0]
                hdr = off - objformat.OBJ_HEADER_SIZE
                m.arenas[node_id][hdr + 8] ^= 0xFF  # a key-hash byte: the header crc no longer matches
        for client in (c, remote):
            with pytest.raises(CorruptionError):
                client.batch_get_ranges_into(keys[:1], [[(0, 10)]], [[bytearray(10)]])
            with pytest.raises(CorruptionError):
                client.get(keys[0])
        out = [[bytearray(LAYER_BYTES)] for _ in range(3)]
        assert remote.batch_get_ranges_into(keys[1:], [[(LAYER_BYTES, LAYER_BYTES)]] * 3, out) == [LAYER_BYTES] * 3
        assert [bytes(o[0]) for o in out] == [ls[1].tobytes() for ls in pages[1:]]
