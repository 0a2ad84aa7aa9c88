"""Device payloads in the put path (umbp/puts.py, umbp/devcopy.py): which pages the kernel writes straight into the
arena and which are staged, checked on a real pool with test doubles (this machine has no GPU).

Host arrays stand for device memory (their addresses go in the ``DeviceBatch`` segment table) and a kernel double
runs each launch's segment table with memmove, as tests/test_copies_cuda.py does for reads. Checked: NEW places on shm
nodes go to the kernel (one launch per chunk, no staging), every old header is invalid while the payload lands and
the header is written after it; a failing launch aborts its keys (nothing committed, the places free again at once);
pages over tcp and clients with checksums keep the staged path; ``LayerwiseLoader.store`` and ``PipelinedStore`` run
the same path (counters say which). The GPU half is tests/test_engine_gpu.py.

The tests share the module's one-node cluster (``shared_cluster``), each in a namespace of its own, but the first:
it fills the arena around its page with 0xff."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from transport import objformat
from umbp import puts
from umbp.devcopy import DeviceBatch, DeviceCopier
from umbp.errors import TransportError

torch = pytest.importorskip("torch", reason="torch is not installed in this venv: the engine half needs tensors")


def _rand(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def one_node(test):
    """The module's shared one-node pool of 64 MiB for ``test`` (its ``cluster`` argument)."""
    return pytest.mark.shared_cluster(pytest.mark.cluster(nodes=1, capacity="64MiB")(test))


class _Kernel:
    """Stands for the gather kernel writing into mapped arenas: memmove per segment. Before copying it records
    whether each destination's object header was already invalidated (the magic zeroed)."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.launches = 0
        self.segments = 0
        self.headers_seen: list[bytes] = []  # first 4 header bytes of each page's slot, at launch time
        self.arenas: dict[int, memoryview] = {}

    def usable(self):
        return True

    def arena_address(self, node_id, arena):
        base = int(np.frombuffer(arena, np.uint8).ctypes.data)
        self.arenas[base] = arena
        return base

    def launch(self, src, dst, lens, device):
        self.launches += 1
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (double)")
        for d in dst.tolist():  # before any byte moves: a page's first segment starts right after its header
            for base, arena in self.arenas.items():
                obj = d - base - objformat.OBJ_HEADER_SIZE
                if 0 <= obj < len(arena) and obj % objformat.ALIGN == 0:
                    self.headers_seen.append(bytes(arena[obj:obj + 4]))
        for s, d, n in zip(src.tolist(), dst.tolist(), lens.tolist()):
            ctypes.memmove(d, s, n)
        self.segments += len(lens)


def _install(client, kernel: _Kernel) -> DeviceCopier:
    dev = DeviceCopier(client.component)
    dev.usable, dev.arena_address, dev.launch = kernel.usable, kernel.arena_address, kernel.launch
    client._device = dev
    return dev


def _host_batch(pages: list[list[np.ndarray]], staged: list[list[int]]) -> DeviceBatch:
    """A DeviceBatch over host arrays (standing for device memory); its stager hands out views of the arrays and
    records the pages it was asked for."""
    src = [int(a.ctypes.data) for parts in pages for a in parts]
    lens = [a.size for parts in pages for a in parts]

    def stager(idxs):
        staged.append(list(idxs))
        return [[memoryview(a) for a in pages[i]] for i in idxs], lambda: None

    return DeviceBatch(len(pages), range(len(pages)), [len(p) for p in pages], np.array(src, np.int64),
                       np.array(lens, np.int64), [0] * len(pages), ["cuda:0 (double)"], stager, keep=pages)


def _read_all(c, keys, size):
    outs = [np.zeros(size, np.uint8) for _ in keys]
    assert c.batch_get_into(keys, outs) == [size] * len(keys)
    return outs


def test_shm_pages_go_to_the_kernel_headers_after_the_payload(make_cluster, monkeypatch):
    """Every NEW page on the shm node is written by the kernel (one launch per chunk, nothing staged), with the old
    header invalid while the payload lands; the header is valid afterwards and the bytes read back exact. Pages
    that already exist are not written again."""
    monkeypatch.setattr(puts, "CHUNK_MAX_PAGES", 4)  # 10 pages: three chunks, pipelined
    cluster = make_cluster(nodes=1, capacity="64MiB")
    n, size = 10, 50_000
    keys = [f"devput/{i}" for i in range(n)]
    pages = [[_rand(20_000, i), _rand(size - 20_000, 100 + i)] for i in range(n)]  # two segments per page
    with cluster.client(transport="shm") as c:
        kernel = _Kernel()
        _install(c, kernel)
        assert c.put(keys[0], np.concatenate(pages[0]))  # already there: EXISTS, never written by the kernel
        # free space full of 0xFF (a stale "header" everywhere): the kernel double must find every slot it writes
        # already invalidated
        with c.mapped(keys[:1]) as m:
            node_id, payload, _ = m.locs[0]
            arena = m.arenas[node_id]
            obj = payload - objformat.OBJ_HEADER_SIZE
            end = payload + objformat.align_up(size) + objformat.ALIGN
            arena[objformat.ARENA_DATA_START:obj] = b"\xff" * (obj - objformat.ARENA_DATA_START)
            arena[end:] = b"\xff" * (len(arena) - end)
        staged: list = []
        assert c.put_device(keys, _host_batch(pages, staged)) == [False] + [True] * (n - 1)
        assert staged == [] and kernel.launches == 3 and kernel.segments == 2 * (n - 1)
        assert len(kernel.headers_seen) == n - 1 and set(kernel.headers_seen) == {b"\0\0\0\0"}
        assert c.counters["kernel_put_bytes"] == (n - 1) * size and c.counters["staged_put_bytes"] == 0
        for o, p in zip(_read_all(c, keys, size), pages):
            assert o.tobytes() == np.concatenate(p).tobytes()
        # a plain client (no doubles) reads them too: the headers are valid wire headers
        with cluster.client(transport="tcp") as t:
            assert t.get(keys[5]) == np.concatenate(pages[5]).tobytes()


@one_node
def test_failing_launch_aborts_and_commits_nothing(cluster):
    """A launch that raises: the put raises TransportError naming the aborted pages, none of them exists, and the
    places were given back (the same keys are stored at once by a second put, not held PENDING)."""
    n, size = 6, 30_000
    keys = [f"devfail/{i}" for i in range(n)]
    pages = [[_rand(size, 200 + i)] for i in range(n)]
    with cluster.client(transport="shm") as c:
        kernel = _Kernel(fail=True)
        _install(c, kernel)
        with pytest.raises(TransportError, match=r"6 of 6 pages were not stored \(aborted\).*device write"):
            c.put_device(keys, _host_batch(pages, []))
        assert kernel.launches == 1
        assert c.batch_exists(keys) == [False] * n
        assert c.counters["kernel_put_bytes"] == 0 and c.counters["puts"] == 0
        kernel.fail = False
        assert c.put_device(keys, _host_batch(pages, [])) == [True] * n  # ABORT freed them: no IN_FLIGHT wait
        for o, p in zip(_read_all(c, keys, size), pages):
            assert o.tobytes() == p[0].tobytes()


@one_node
def test_tcp_pages_and_checksum_clients_keep_the_staged_path(cluster):
    """Over tcp the kernel cannot reach the arena: each chunk's pages are staged by the batch's stager and written
    by the transport. A checksum client stages every page once, up front (the checksum needs host bytes)."""
    n, size = 5, 40_000
    pages = [[_rand(size // 2, 300 + i), _rand(size // 2, 400 + i)] for i in range(n)]
    kernel = _Kernel()
    with cluster.client(transport="tcp") as t:
        _install(t, kernel)
        staged: list = []
        keys = [f"devtcp/{i}" for i in range(n)]
        assert t.put_device(keys, _host_batch(pages, staged)) == [True] * n
        assert staged == [list(range(n))] and kernel.launches == 0
        assert t.counters["staged_put_bytes"] == n * size and t.counters["kernel_put_bytes"] == 0
        for o, p in zip(_read_all(t, keys, size), pages):
            assert o.tobytes() == np.concatenate(p).tobytes()
    with cluster.client(transport="shm", checksum=True) as s:
        _install(s, kernel)
        staged = []
        keys = [f"devsum/{i}" for i in range(n)]
        assert s.put_device(keys, _host_batch(pages, staged)) == [True] * n
        assert staged == [list(range(n))] and kernel.launches == 0
        for o, p in zip(_read_all(s, keys, size), pages):
            assert o.tobytes() == np.concatenate(p).tobytes()


@one_node
def test_batch_put_routes_device_tensors(cluster):
    """batch_put / batch_put_ranges with values on a CUDA device take the device path (``_put_cuda``): here
    tensors whose ``device`` says cuda but whose memory is host memory, so the kernel double can copy them."""

    class FakeCuda:  # just what _put_cuda and DeviceBatch.from_tensors use of a tensor
        device = torch.device("cuda", 0)

        def __init__(self, t):
            self.t = t

        def is_contiguous(self):
            return self.t.is_contiguous()

        def data_ptr(self):
            return self.t.data_ptr()

        def numel(self):
            return self.t.numel()

        def element_size(self):
            return self.t.element_size()

    vals = [torch.from_numpy(_rand(8192, 500 + i)).view(torch.int16) for i in range(4)]  # 2-byte elements
    with cluster.client(transport="shm") as c:
        kernel = _Kernel()
        _install(c, kernel)
        assert c.batch_put(["devt/0", "devt/1"], [FakeCuda(vals[0]), b"host value"]) == [True, True]
        assert c.batch_put_ranges(["devt/2"], [[FakeCuda(vals[1]), FakeCuda(vals[2])]]) == [True]
        assert kernel.launches == 2 and c.counters["kernel_put_bytes"] == 3 * 8192
        assert c.get("devt/0") == vals[0].numpy().tobytes() and c.get("devt/1") == b"host value"
        assert c.get("devt/2") == vals[1].numpy().tobytes() + vals[2].numpy().tobytes()


# ---- the engine: LayerwiseLoader.store and PipelinedStore on a "CUDA" KV buffer (host tensors + doubles) -------


def _kv(slots: int, layers: int = 4):
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, 256, (slots, 8, 16), dtype=torch.uint8, generator=g),
             torch.randint(0, 256, (slots, 8, 16), dtype=torch.uint8, generator=g)) for _ in range(layers)]


def _page(kv, slot: int) -> bytes:
    return b"".join(t[slot].numpy().tobytes() for k, v in kv for t in (k, v))


@pytest.fixture
def cuda_kv(monkeypatch):
    """PagedKV reports CUDA, so the loader takes its device path; the staged offload packs rows on the host."""
    from umbp.engine.layout import PagedKV
    from umbp.engine.loader import LayerwiseLoader

    monkeypatch.setattr(PagedKV, "is_cuda", property(lambda self: True))

    def stage_rows(self, slots):
        staged_calls.append(len(slots))
        pages = [np.frombuffer(_page(self._kv_src, s), np.uint8) for s in slots.tolist()]
        self.counters["device_to_host_bytes"] += sum(p.size for p in pages)
        return [[memoryview(p)] for p in pages], lambda: None

    staged_calls: list[int] = []
    monkeypatch.setattr(LayerwiseLoader, "_stage_slots", stage_rows)
    return staged_calls


@one_node
def test_loader_store_writes_slots_through_the_kernel_or_stages(cluster, cuda_kv):
    from umbp.engine.loader import LayerwiseLoader

    kv = _kv(12)
    n = 9
    slots = [11 - i for i in range(n)]
    for transport in ("shm", "tcp"):
        keys = [f"devkv/{transport}/{i}" for i in range(n)]
        with cluster.client(transport=transport) as c:
            kernel = _Kernel()
            _install(c, kernel)
            loader = LayerwiseLoader(c, kv)
            loader._kv_src = kv
            pb = loader.layout.page_bytes
            assert loader.store(keys, slots) == [True] * n
            if transport == "shm":  # one segment per layer part of each slot, one launch, nothing staged
                assert (kernel.launches, kernel.segments, cuda_kv) == (1, n * 8, [])
                assert loader.counters["device_to_pool_bytes"] == n * pb
                assert loader.counters["host_to_pool_bytes"] == loader.counters["device_to_host_bytes"] == 0
            else:
                assert kernel.launches == 0 and cuda_kv == [n]
                assert loader.counters["device_to_pool_bytes"] == 0
                assert loader.counters["host_to_pool_bytes"] == loader.counters["device_to_host_bytes"] == n * pb
            for o, s in zip(_read_all(c, keys, pb), slots):
                assert o.tobytes() == _page(kv, s)


@one_node
def test_pipelined_store_is_one_put_on_the_direct_path(cluster, cuda_kv):
    from umbp.engine.offload import PipelinedStore

    kv = _kv(12)
    keys = [f"devpipe/{i}" for i in range(10)]
    slots = list(range(10))
    with cluster.client(transport="shm") as c:
        kernel = _Kernel()
        _install(c, kernel)
        with PipelinedStore(c, kv, 1, chunk_pages=3) as st:
            assert c.direct_device_puts()
            assert st.store(keys, slots, [None] + keys[:-1]) == [True] * 10
            assert kernel.launches == 1 and cuda_kv == []
            assert st.storers[1].counters["pages_stored"] == 0, "cut into chunks although nothing is staged"
            assert st.counters["device_to_pool_bytes"] == 10 * st.storers[0].layout.page_bytes
        for o, s in zip(_read_all(c, keys, len(_page(kv, 0))), slots):
            assert o.tobytes() == _page(kv, s)
    with cluster.client(transport="tcp") as t:
        _install(t, _Kernel())
        assert not t.direct_device_puts()
