"""The CUDA gather and the layer-wise loader on a GPU: bytes exact, both directions, every gather method.

Runs only where CUDA is available (the GPU machine); elsewhere the whole module is skipped with the reason below.
The pool-free tests move pages between pinned or ``cudaHostRegister``-ed host memory (including a /dev/shm file
mapped like a node arena) and scattered slots of device KV buffers. The pool tests (loader on CUDA, offload from
CUDA, CUDA values and KV slots written by the kernel straight into a same-host arena, with the offload rate printed
next to the load's: run with -s to see it) need etcd like every integration test.

On the GPU machine: ``python3 -m pytest -q tests/test_engine_gpu.py`` (see docs/development/testing.md for the
device call that carries the etcd/aetcd wheels)."""

from __future__ import annotations

import mmap
import os
import tempfile

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("GPU gather tests: no CUDA on this machine; run on the GPU machine via the device `run` tool "
                "(python3 -m pytest -q tests/test_engine_gpu.py); the CPU path is tested in "
                "tests/unit/test_engine_gather.py", allow_module_level=True)

from umbp.node.arena import arena_dir_with_room  # noqa: E402
from umbp.engine import gather  # noqa: E402
from umbp.engine.gather import HostPages  # noqa: E402
from umbp.engine.layout import PagedKV  # noqa: E402
from umbp.engine.loader import LayerwiseLoader  # noqa: E402

DEV = torch.device("cuda", 0)


def _random_u8(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))


def _kv_pages_on_host(kv: PagedKV, slots, layers=None) -> list[bytes]:
    layers = range(kv.num_layers) if layers is None else layers
    torch.cuda.synchronize()
    return [b"".join(r.cpu().reshape(-1).view(torch.uint8).numpy().tobytes() for li in layers for r in kv.rows(li, s))
            for s in slots]  # as bytes: numpy has no bfloat16


@pytest.fixture(params=["kernel", "staged", "torch"])
def method(request, monkeypatch):
    if request.param == "torch":  # the staged path without CuPy
        monkeypatch.setattr(gather, "cupy_available", lambda: False)
        return "staged"
    if not gather.cupy_available():
        pytest.skip("CuPy missing on this GPU machine")
    return request.param


@pytest.mark.parametrize("parts,row", [(1, 4096), (2, 1024), (2, 520)])  # 520: not a multiple of 16 bytes
def test_gather_scattered_pinned_pages_into_scattered_slots(method, parts, row):
    layers, slots_n, n = 4, 64, 24
    ts = [[torch.zeros(slots_n, row, dtype=torch.uint8, device=DEV) for _ in range(parts)] for _ in range(layers)]
    kv = PagedKV([tuple(p) for p in ts])
    pb = kv.page_bytes
    host = _random_u8(3 * n * pb, 1).pin_memory()
    rng = np.random.default_rng(2)
    offs = rng.choice(3 * n, n, replace=False) * pb + rng.integers(0, 2, n) * 16 * (row % 16 == 0)
    offs = np.minimum(offs, 3 * n * pb - pb)
    slots = rng.choice(slots_n, n, replace=False)
    hp = HostPages.from_locs([host], [(0, int(o)) for o in offs])
    assert gather.to_kv(kv, slots, hp, method=method) == n * pb
    got = _kv_pages_on_host(kv, slots.tolist())
    hb = host.numpy()
    for o, g in zip(offs.tolist(), got):
        assert g == hb[o:o + pb].tobytes()
    untouched = sorted(set(range(slots_n)) - set(slots.tolist()))
    assert all(not ts[li][pi][untouched].any() for li in range(layers) for pi in range(parts))

    # offload: the same slots back out to other scattered host places
    out = torch.zeros(2 * n * pb, dtype=torch.uint8).pin_memory()
    locs = [(0, int(i * 2 * pb)) for i in range(n)]
    assert gather.from_kv(kv, slots, HostPages.from_locs([out], locs, writable=True), method=method) == n * pb
    torch.cuda.synchronize()
    ob = out.numpy()
    for (_, o), want in zip(locs, got):
        assert ob[o:o + pb].tobytes() == want


def test_one_group_from_a_registered_shm_arena():
    """A /dev/shm file mapped shared (as a node arena is), registered with cudaHostRegister, read by the kernel."""
    if not gather.cupy_available():
        pytest.skip("CuPy missing on this GPU machine")
    layers, slots_n, row, n = 8, 32, 2048, 10
    stacked = torch.zeros(layers, slots_n, row, dtype=torch.uint8, device=DEV)
    kv = PagedKV(stacked)
    pb = kv.page_bytes
    size = (n + 2) * pb + 4096
    d = arena_dir_with_room(size)
    fd, path = tempfile.mkstemp(dir=d, prefix="umbp-gpu-test-")
    try:
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        arena = memoryview(m)
        data = _random_u8(size, 3).numpy()
        arena[:] = data.tobytes()
        try:
            buf = gather.register_host(arena)
        except gather.GatherUnavailable as e:
            pytest.skip(f"cudaHostRegister of a shared mapping refused here: {e}")
        try:
            assert buf.pinned
            group = range(2, 6)
            goff, glen = kv.layout(4).group_range(1)
            offs = [4096 + 64 + i * pb for i in range(n)]  # payloads start 64 bytes past a 4 KiB slot, as in arenas
            slots = list(range(slots_n - 1, slots_n - 1 - 3 * n, -3))
            hp = HostPages.from_locs([arena], [(0, o + goff) for o in offs])
            assert hp.pinned
            assert gather.to_kv(kv, slots, hp, group, method="kernel") == n * glen
            got = _kv_pages_on_host(kv, slots, group)
            for o, g in zip(offs, got):
                assert g == data[o + goff:o + goff + glen].tobytes()
            others = [li for li in range(layers) if li not in group]
            assert not stacked[others].any()
        finally:
            gather.unregister_host(buf)
            del buf, hp
            arena.release()
            m.close()
    finally:
        os.close(fd)
        os.unlink(path)


def test_kernel_refuses_unpinned_host_memory():
    kv = PagedKV([torch.zeros(4, 64, dtype=torch.uint8, device=DEV)])
    with pytest.raises(gather.GatherUnavailable, match="engine gather: kernel gather needs pinned"):
        gather.to_kv(kv, [0], HostPages.rows(np.zeros(64, np.uint8), 1, 64), method="kernel")


# ---- with a pool ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("transport,mapped", [("tcp", False), ("shm", True)])
def test_cuda_loader_round_trip(cluster, transport, mapped):
    layers, slots_n = 8, 48
    k = torch.zeros(layers, slots_n, 16, 64, dtype=torch.bfloat16, device=DEV)
    v = torch.zeros_like(k)
    k.view(torch.int16).copy_(torch.randint(-2**15, 2**15, k.shape, dtype=torch.int16, device=DEV))
    v.view(torch.int16).copy_(torch.randint(-2**15, 2**15, v.shape, dtype=torch.int16, device=DEV))
    src = PagedKV([(k[i], v[i]) for i in range(layers)])
    n = 20
    keys = [f"gpu-{transport}-{i}" for i in range(n)]
    src_slots = list(range(n))
    with cluster.client(transport=transport) as c:
        saver = LayerwiseLoader(c, src)
        assert saver.store(keys, src_slots) == [True] * n
        # over shm the kernel writes the slots straight into the arena (when CUDA registers it); over tcp staged
        direct = transport == "shm" and c.direct_device_puts()
        assert saver.counters["device_to_pool_bytes"] == (n * src.page_bytes if direct else 0)
        assert saver.counters["device_to_host_bytes"] == (0 if direct else n * src.page_bytes)
        want = _kv_pages_on_host(src, src_slots)

        k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
        dst = PagedKV([(k2[i], v2[i]) for i in range(layers)])
        dst_slots = [slots_n - 1 - 2 * i for i in range(n)]
        loader = LayerwiseLoader(c, dst, group_size=2, use_mapped=mapped)
        try:
            order = []
            with loader.load(keys, dst_slots) as load:
                for grp in load:
                    grp.wait()  # the current stream now sees this group
                    assert grp.event is not None
                    order.append(grp.index)
                    got = _kv_pages_on_host(dst, dst_slots, grp.layers)
                    full = [w[grp.layers.start * 4096:grp.layers.stop * 4096] for w in want]
                    assert got == full
            assert order == [0, 1, 2, 3] and load.pages == n
            assert _kv_pages_on_host(dst, dst_slots) == want
            assert loader.counters["host_to_device_bytes"] == n * dst.page_bytes
            if mapped and loader.counters["zero_copy_bytes"]:
                assert loader.counters["zero_copy_bytes"] == n * dst.page_bytes
                assert loader.counters["pool_to_host_bytes"] == 0
            else:
                assert loader.counters["pool_to_host_bytes"] == n * dst.page_bytes
        finally:
            loader.close()


# ---- direct device -> arena puts (umbp/puts.py, umbp/devcopy.py) ---------------------------------------------


def _direct_or_skip(c) -> None:
    if not gather.cupy_available():
        pytest.skip("CuPy missing on this GPU machine: device puts are staged (covered by tests/test_device_puts.py)")
    if not c.direct_device_puts():
        pytest.skip("no same-host arena could be registered with CUDA here (cudaHostRegister refused the shared "
                    "mapping): device puts are staged")


@pytest.mark.cluster(nodes=1, capacity="512MiB")
def test_cuda_values_written_by_the_kernel_bit_exact(cluster):
    """batch_put / batch_put_ranges of CUDA tensors over shm: every byte written by the kernel (kernel_put_bytes,
    nothing staged), read back bit for bit by a tcp client (host bytes) and into CUDA outs; over tcp the same
    values are staged and equally exact."""
    rng = torch.Generator(device=DEV).manual_seed(11)
    sizes = [1 << 20, (1 << 20) + 4096, 777, 3 * (1 << 20) + 5]  # odd lengths: the kernel's byte tail
    vals = [torch.randint(0, 256, (n,), dtype=torch.uint8, device=DEV, generator=rng) for n in sizes]
    bf = torch.randn(64, 1000, device=DEV, generator=rng).to(torch.bfloat16)  # not a byte tensor
    with cluster.client(transport="shm") as c, cluster.client(transport="tcp") as t:
        _direct_or_skip(c)
        keys = [f"gpu-direct/{i}" for i in range(len(vals))]
        assert c.batch_put(keys + ["gpu-direct/bf16"], vals + [bf]) == [True] * (len(vals) + 1)
        halves = [[v[:len(v) // 2], v[len(v) // 2:]] for v in vals]
        rkeys = [f"gpu-direct-ranges/{i}" for i in range(len(vals))]
        assert c.batch_put_ranges(rkeys, halves) == [True] * len(vals)
        total = 2 * sum(sizes) + bf.numel() * 2
        assert c.counters["kernel_put_bytes"] == total and c.counters["staged_put_bytes"] == 0
        for k, rk, v in zip(keys, rkeys, vals):
            want = v.cpu().numpy().tobytes()
            assert t.get(k) == want and t.get(rk) == want
        assert t.get("gpu-direct/bf16") == bf.cpu().view(torch.uint8).numpy().tobytes()
        outs = [torch.zeros_like(v) for v in vals]
        assert c.batch_get_into(rkeys, outs) == sizes
        assert all(torch.equal(o, v) for o, v in zip(outs, vals))
        tkeys = [f"gpu-staged/{i}" for i in range(len(vals))]
        assert t.batch_put(tkeys, vals) == [True] * len(vals)
        assert t.counters["kernel_put_bytes"] == 0 and t.counters["staged_put_bytes"] == sum(sizes)
        assert all(c.get(k) == v.cpu().numpy().tobytes() for k, v in zip(tkeys, vals))


@pytest.mark.cluster(nodes=1, capacity="2GiB")
def test_offload_through_the_kernel_bit_exact_and_rate(cluster):
    """LayerwiseLoader.store and PipelinedStore of CUDA KV slots over shm write straight into the arena (no byte
    staged), loaded back layer-wise bit for bit; prints the offload GB/s next to the zero-copy load's."""
    import time

    from umbp.engine.offload import PipelinedStore

    layers, slots_n, n = 32, 160, 128
    k = torch.zeros(layers, slots_n, 16, 8, 64, dtype=torch.bfloat16, device=DEV)  # 16 KiB rows: 1 MiB pages
    v = torch.zeros_like(k)
    for t in (k, v):
        t.view(torch.int16).copy_(torch.randint(-2**15, 2**15, t.shape, dtype=torch.int16, device=DEV))
    src = PagedKV([(k[i], v[i]) for i in range(layers)])
    pb = src.page_bytes
    slots = list(range(slots_n - 1, slots_n - 1 - n, -1))
    want = _kv_pages_on_host(src, slots)
    with cluster.client(transport="shm") as c:
        _direct_or_skip(c)
        rates = {}
        for name, make in (("store", lambda: LayerwiseLoader(c, src, use_mapped=False)),
                           ("pipelined", lambda: PipelinedStore(c, src, 1, chunk_pages=32))):
            with make() as storer:
                for it in range(2):  # the first run registers the arena
                    keys = [f"gpu-offload/{name}/{it}/{i}" for i in range(n)]
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    assert storer.store(keys, slots) == [True] * n
                    rates[name] = n * pb / (time.perf_counter() - t0) / 1e9
                assert storer.counters["device_to_pool_bytes"] == 2 * n * pb
                assert storer.counters["device_to_host_bytes"] == storer.counters["host_to_pool_bytes"] == 0
        k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
        dst = PagedKV([(k2[i], v2[i]) for i in range(layers)])
        with LayerwiseLoader(c, dst, group_size=8) as loader:
            loader.prepare()
            for name in ("store", "pipelined"):
                keys = [f"gpu-offload/{name}/1/{i}" for i in range(n)]
                k2.zero_()
                v2.zero_()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                assert loader.load_all(keys, list(range(n))) == n
                load = n * pb / (time.perf_counter() - t0) / 1e9
                assert _kv_pages_on_host(dst, list(range(n))) == want
        print(f"\noffload {n} x {pb >> 20} MiB pages: store {rates['store']:.2f} GB/s, pipelined "
              f"{rates['pipelined']:.2f} GB/s; layer-wise zero-copy load {load:.2f} GB/s; offload/load "
              f"{rates['store'] / load:.2f}x / {rates['pipelined'] / load:.2f}x (target >= 0.5x)")
