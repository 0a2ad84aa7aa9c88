"""Layer-wise loader and offload against a real pool (etcd, metaserver, nodes on loopback), CPU KV buffers.

Checks bytes (every layer of every page in its slot, nothing else touched), the order of ready groups, the prefix
rule on a missing page, dedup on a second offload, and the loader's byte counters. The tests share the module's
cluster (``shared_cluster``), each in a namespace of its own."""

from __future__ import annotations

import threading
import zlib

import pytest
import torch

from umbp.engine.layout import PagedKV
from umbp.engine.loader import LayerwiseLoader
from umbp.errors import InvalidArgument
from umbp.keys import chain_keys, parents_of

LAYERS, SLOTS, ROW = 8, 32, 512  # MHA: K and V rows of 512 bytes per layer -> 8 KiB pages

pytestmark = pytest.mark.shared_cluster


def mha_buffer(fill: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.zeros(LAYERS, SLOTS, ROW // 2, dtype=torch.float16)
    v = torch.zeros(LAYERS, SLOTS, ROW // 2, dtype=torch.float16)
    if fill:
        k.view(torch.int16).copy_(torch.randint(-2**15, 2**15, k.shape, generator=g, dtype=torch.int16))
        v.view(torch.int16).copy_(torch.randint(-2**15, 2**15, v.shape, generator=g, dtype=torch.int16))
    return (k, v), PagedKV([(k[i], v[i]) for i in range(LAYERS)])


def page_bytes_of(kv: PagedKV, slot: int, layers=range(LAYERS)) -> bytes:
    return b"".join(r.numpy().tobytes() for li in layers for r in kv.rows(li, slot))


def keys_for(n: int, tag: str) -> list[str]:
    base = zlib.crc32(tag.encode())
    tokens = [(base + 7 * i) & 0xFFFF for i in range(16 * n)]
    return chain_keys(tokens, 16)


@pytest.mark.parametrize("transport,mapped", [("tcp", False), ("shm", True)])
def test_store_then_layerwise_load(cluster, transport, mapped):
    (k, v), src = mha_buffer(fill=True)
    keys = keys_for(12, transport)
    src_slots = list(range(3, 15))
    with cluster.client(transport=transport) as c:
        saver = LayerwiseLoader(c, src)
        assert saver.store(keys, src_slots, parents_of(keys)) == [True] * 12
        assert saver.store(keys, src_slots) == [False] * 12  # dedup: already in the pool, nothing written
        assert saver.counters["pages_stored"] == 12 and saver.counters["pages_existing"] == 12
        assert saver.counters["host_to_pool_bytes"] == 12 * src.page_bytes
        assert c.prefix_hits(keys) == 12

        _, dst = mha_buffer(fill=False)
        dst_slots = [31 - i * 2 for i in range(12)]
        loader = LayerwiseLoader(c, dst, group_size=3, use_mapped=mapped)
        seen = []
        with loader.load(keys, dst_slots) as load:
            for grp in load:
                grp.wait()
                seen.append((grp.index, grp.layers, grp.pages))
                # the group's layers are in place for every page when it is yielded
                for s_src, s_dst in zip(src_slots, dst_slots):
                    assert page_bytes_of(dst, s_dst, grp.layers) == page_bytes_of(src, s_src, grp.layers)
        assert seen == [(0, range(0, 3), 12), (1, range(3, 6), 12), (2, range(6, 8), 12)]
        assert load.pages == 12
        for s_src, s_dst in zip(src_slots, dst_slots):
            assert page_bytes_of(dst, s_dst) == page_bytes_of(src, s_src)
        others = set(range(SLOTS)) - set(dst_slots)
        assert all(page_bytes_of(dst, s) == bytes(dst.page_bytes) for s in others)
        total = 12 * src.page_bytes
        assert loader.counters["pool_to_host_bytes"] == total
        assert loader.counters["host_to_device_bytes"] == total
        assert loader.counters["groups_loaded"] == 3 and loader.counters["pages_loaded"] == 12
        if mapped:
            assert c.counters["bytes_mapped"] == total  # read straight from the mapped arena
        else:
            assert c.counters["bytes_got"] == total


def test_missing_page_cuts_the_prefix(cluster):
    (_, _), src = mha_buffer(fill=True, seed=1)
    keys = keys_for(8, "gap")
    with cluster.client() as c:
        saver = LayerwiseLoader(c, src)
        present = [i for i in range(8) if i != 5]
        assert saver.store([keys[i] for i in present], present) == [True] * 7
        _, dst = mha_buffer(fill=False)
        for mapped in (False, True):
            loader = LayerwiseLoader(c, dst, group_size=2, use_mapped=mapped)
            with loader.load(keys, list(range(8))) as load:
                groups = list(load)
            assert [g.pages for g in groups] == [5, 5, 5, 5]
            assert load.pages == 5
            for s in range(5):
                assert page_bytes_of(dst, s) == page_bytes_of(src, s)
            # pages past the gap are not loaded after the first group: page 6 has layers 0-1 at most
            assert page_bytes_of(dst, 6, range(2, LAYERS)) == bytes(6 * ROW * 2)
            assert loader.counters["pages_loaded"] == 5


class _Held:
    """A client whose calls from any thread but the test's wait for ``go``: a load's worker is still running (its
    first client call held) while the test asserts, however fast the machine (a load of misses ends in
    milliseconds, and the loader is free again once its worker ends)."""

    def __init__(self, client):
        self._client = client
        self._caller = threading.current_thread()
        self.go = threading.Event()

    def __getattr__(self, name):
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def held(*args, **kwargs):
            if threading.current_thread() is not self._caller:
                assert self.go.wait(60), "the test never let the held load go"
            return attr(*args, **kwargs)
        return held


def test_one_load_at_a_time_and_bad_arguments(cluster):
    _, kv = mha_buffer(fill=False)
    keys = keys_for(4, "busy")
    with cluster.client() as c:
        held = _Held(c)
        loader = LayerwiseLoader(held, kv, group_size=4)
        with pytest.raises(InvalidArgument, match="same slot"):
            loader.load(keys, [0, 1, 1, 2])
        with pytest.raises(InvalidArgument, match="slots"):
            loader.load(keys, [0, 1])
        with loader.load(keys, [0, 1, 2, 3]) as first:
            with pytest.raises(InvalidArgument, match="engine loader: a load is already running"):
                loader.load(keys, [4, 5, 6, 7])
            held.go.set()
            assert [g.pages for g in first] == [0, 0]  # nothing stored under these keys
        with loader.load(keys, [4, 5, 6, 7]) as second:  # the loader is free again
            assert second.wait_all() == 0
