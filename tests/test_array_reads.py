"""The array read path of ``batch_get_into`` (``umbp/readbatch.py``): outs given as one 2-D array or tensor, or a
list of tensors, arrays, memoryviews or ``Rows`` of one shape, or ``HostSpans`` (raw host addresses). Every test
checks the bytes and counts returned, and that the pages the array checks do not settle (a header that changed
during the copy, a header with a payload checksum, a stale slot) get exactly the per-page path's answer:
CorruptionError, never bytes."""

from __future__ import annotations

import ctypes
import hashlib
import time

import numpy as np
import pytest
import torch

from transport import objformat
from transport.tcp import TcpTransport
from umbp import copies
from umbp.buffers import HostSpans, Rows
from umbp.errors import CorruptionError
from umbp.keys import normalize_key

SIZE = 20_000
_KEEP: list = []  # host pools behind HostSpans outs: alive for the module


def page(key: str, version: int = 1, size: int = SIZE) -> bytes:
    seed = hashlib.sha256(f"{key}/{version}".encode()).digest()
    return (seed * (size // 32 + 1))[:size]


def outs_of(kind: str, n: int, size: int = SIZE):
    if kind == "array":
        return np.zeros((n, size), np.uint8)
    if kind == "tensor2d":
        return torch.zeros((n, size), dtype=torch.uint8)
    if kind == "tensors":
        return [torch.zeros(size, dtype=torch.uint8) for _ in range(n)]
    if kind == "views":  # as SGLang's HiCache backend passes them: writable views into one host pool, apart
        pool = np.zeros((n, size + 4096), np.uint8)
        return [memoryview(pool[i, 4096:]) for i in range(n)]
    if kind == "rows":  # a layer_first host pool's objects: 4 rows of 6,000 bytes every 7,000 (the last one short)
        span = 3 * 7000 + 6000
        pool = np.zeros(n * span, np.uint8)
        _KEEP.append(pool)
        return [Rows(memoryview(pool[i * span:(i + 1) * span]), 6000, 7000, 4) for i in range(n)]
    if kind == "spans":  # a host pool's pages at raw addresses, in shuffled pool order (the backend's page_first)
        pool = np.zeros((n, size + 4096), np.uint8)
        _KEEP.append(pool)
        rows = np.random.default_rng(n).permutation(n)
        return HostSpans(pool.ctypes.data + rows * (size + 4096) + 4096, np.full(n, size))
    return [np.zeros(size, np.uint8) for _ in range(n)]


def as_bytes(outs, i: int, n: int = SIZE) -> bytes:
    if type(outs) is HostSpans:
        return ctypes.string_at(int(outs.addr[i]), n)
    o = outs[i]
    if type(o) is Rows:
        return o.gather(n)
    if isinstance(o, memoryview):
        return o[:n].tobytes()
    return (o.numpy() if isinstance(o, torch.Tensor) else o)[:n].tobytes()


def locate(c, key: str):
    """(node id, header offset) the client remembers for ``key``."""
    node_id, off, _size, _gen, _tag, _cap = c._spec.cache.get(normalize_key(key))
    return node_id, off


@pytest.mark.shared_cluster
@pytest.mark.cluster(nodes=2)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("kind", ["array", "tensor2d", "tensors", "arrays", "views", "spans", "rows"])
def test_array_outs_get_every_byte_with_misses_among_hits(cluster, transport, kind):
    keys = [f"ar-{transport}-{kind}-{i}" for i in range(24)]
    stored = keys[::2]  # every other key is a miss
    with cluster.client(transport=transport) as c:
        assert c.batch_put(stored, [page(k) for k in stored]) == [True] * len(stored)
        for round_ in range(3):  # the first learns the locations, the others read them ahead of the LOOKUP
            outs = outs_of(kind, len(keys))
            got = c.batch_get_into(keys, outs)
            assert got == [SIZE if i % 2 == 0 else -1 for i in range(len(keys))], round_
            assert all(as_bytes(outs, i) == page(k) for i, k in enumerate(keys) if i % 2 == 0)
        st = c.stats()["client"]
        assert st["gets"] == 3 * 12 and st["misses"] == 3 * 12 and st["spec_hits"] == 2 * 12
        assert st["bytes_got"] == 3 * 12 * SIZE


@pytest.mark.shared_cluster
@pytest.mark.cluster(nodes=1, capacity="16MiB")
def test_pages_moved_behind_the_clients_back_are_read_again_or_missed(cluster):
    keys = [f"amv-{i}" for i in range(24)]
    gone, rewritten = keys[:8], keys[8:16]
    with cluster.client(transport="shm") as a, cluster.client(transport="shm") as b:
        assert a.batch_put(keys, [page(k) for k in keys]) == [True] * 24
        assert a.batch_get_into(keys, outs_of("array", 24)) == [SIZE] * 24
        b.batch_remove(gone + rewritten)
        assert b.batch_put(rewritten, [page(k, 2) for k in rewritten]) == [True] * 8
        outs = outs_of("array", 24)
        assert a.batch_get_into(keys, outs) == [-1] * 8 + [SIZE] * 16
        assert [as_bytes(outs, i) for i in range(8, 24)] == [page(k, 2) for k in rewritten] + [
            page(k) for k in keys[16:]]


@pytest.mark.shared_cluster
@pytest.mark.cluster(nodes=1)
def test_a_slot_rewritten_during_the_copy_is_corruption_not_bytes(cluster, monkeypatch):
    keys = [f"torn-{i}" for i in range(8)]
    with cluster.client(transport="shm") as c:
        c._spec.enabled = False  # one read of the batch: the patched copy runs once
        assert c.batch_put(keys, [page(k) for k in keys]) == [True] * 8
        assert c.batch_get_into(keys, outs_of("array", 8)) == [SIZE] * 8
        node_id, off = locate(c, keys[3])
        arena = c._transports[node_id].arena
        good = bytes(arena[off:off + 64])
        real = copies.copy_shared

        def rewrite_then_copy(*a):  # after the headers were compared, while the copies run
            bad = bytearray(good)
            bad[16] ^= 1  # the generation: another object now holds the slot
            arena[off:off + 64] = bytes(bad)
            return real(*a)

        monkeypatch.setattr(copies, "copy_shared", rewrite_then_copy)
        with pytest.raises(CorruptionError, match="torn read"):
            c.batch_get_into(keys, outs_of("array", 8))
        monkeypatch.setattr(copies, "copy_shared", real)
        arena[off:off + 64] = good
        outs = outs_of("tensors", 8)
        assert c.batch_get_into(keys, outs) == [SIZE] * 8
        assert [as_bytes(outs, i) for i in range(8)] == [page(k) for k in keys]


@pytest.mark.shared_cluster
@pytest.mark.cluster(nodes=1)
def test_a_stale_header_takes_the_per_page_path_and_its_error(cluster):
    keys = [f"stale-{i}" for i in range(6)]
    with cluster.client(transport="shm") as c:
        assert c.batch_put(keys, [page(k) for k in keys]) == [True] * 6
        assert c.batch_get_into(keys, outs_of("array", 6)) == [SIZE] * 6
        node_id, off = locate(c, keys[2])
        arena = c._transports[node_id].arena
        good = bytes(arena[off:off + 64])
        _m, _v, _f, tag, gen, plen, _c, _crc = objformat.OBJ_HEADER.unpack(good)
        arena[off:off + 64] = objformat.pack_object_header(tag, gen + 7, plen)  # a well-formed header of another object
        try:
            with pytest.raises(CorruptionError, match="stale slot"):
                c.batch_get_into(keys, outs_of("array", 6))
        finally:
            arena[off:off + 64] = good
        outs = outs_of("array", 6)
        assert c.batch_get_into(keys, outs) == [SIZE] * 6 and outs.tobytes() == b"".join(page(k) for k in keys)


@pytest.mark.shared_cluster
@pytest.mark.cluster(nodes=1)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_pages_with_payload_checksums_are_checked_page_by_page(cluster, transport):
    keys = [f"csum-{transport}-{i}" for i in range(6)]
    with cluster.client(transport=transport, checksum=True) as c, cluster.client(transport="shm") as local:
        assert c.batch_put(keys, [page(k) for k in keys]) == [True] * 6
        outs = outs_of("tensors", 6)
        assert c.batch_get_into(keys, outs) == [SIZE] * 6
        assert [as_bytes(outs, i) for i in range(6)] == [page(k) for k in keys]
        assert local.batch_get_into(keys, outs_of("array", 6)) == [SIZE] * 6
        node_id, off = locate(local, keys[4])
        arena = local._transports[node_id].arena
        arena[off + 64 + 100] ^= 0xFF  # a payload byte: only the checksum can tell
        try:
            with pytest.raises(CorruptionError, match="checksum"):
                c.batch_get_into(keys, outs_of("array", 6))
        finally:
            arena[off + 64 + 100] ^= 0xFF


@pytest.mark.shared_cluster
@pytest.mark.cluster(nodes=2)
def test_a_batch_over_shm_and_tcp_nodes(cluster):
    """One node reached over shm, the other over tcp (its transport set before the first get): the shm pages take
    the array copy, the tcp pages today's READV, misses in between."""
    keys = [f"mix-{i}" for i in range(32)]
    stored = [k for i, k in enumerate(keys) if i % 4]
    with cluster.client(transport="auto") as c:
        assert c.batch_put(stored, [page(k) for k in stored]) == [True] * len(stored)
        c._refresh_nodes(time.monotonic() + 10)
        nodes = sorted(c._nodes)
        assert len(nodes) == 2
        info = c._nodes[nodes[1]]
        c._transports.pop(nodes[1], None)
        c._transports[nodes[1]] = TcpTransport(nodes[1], info.get("addr") or f"{info['host']}:{info['port']}")
        for _ in range(2):
            outs = outs_of("array", 32)
            got = c.batch_get_into(keys, outs)
            assert got == [SIZE if i % 4 else -1 for i in range(32)]
            assert all(as_bytes(outs, i) == page(k) for i, k in enumerate(keys) if i % 4)
        names = c.transport_names()
        assert sorted(names.values()) == ["shm", "tcp"], names
        on = {locate(c, k)[0] for k in stored}
        assert on == set(nodes), "pages on both nodes"


@pytest.mark.shared_cluster
@pytest.mark.cluster(nodes=1)
def test_host_spans_as_put_values_and_as_the_outs_of_one_page(cluster):
    keys = [f"spans-put-{i}" for i in range(5)]
    src = np.frombuffer(b"".join(page(k) for k in keys), np.uint8).copy()
    with cluster.client(transport="shm") as c:
        spans = HostSpans(src.ctypes.data + np.arange(5) * SIZE, np.full(5, SIZE))
        assert c.batch_put(keys, spans) == [True] * 5
        one = outs_of("spans", 1)  # one page: the per-page path, through the spans' views
        assert c.batch_get_into(keys[3:4], one) == [SIZE] and as_bytes(one, 0) == page(keys[3])
        outs = outs_of("spans", 5)
        assert c.batch_get_into(keys, outs) == [SIZE] * 5
        assert [as_bytes(outs, i) for i in range(5)] == [page(k) for k in keys]
