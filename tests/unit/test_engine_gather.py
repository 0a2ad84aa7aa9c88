"""The CPU gather path: scattered host pages <-> scattered KV slots, bytes exact, bounds checked before any copy.

The CUDA paths share the planning code tested here; their own test is tests/test_engine_gpu.py (GPU machine)."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from umbp import devkernel
from umbp.engine import gather
from umbp.engine.gather import HostPages
from umbp.engine.layout import PagedKV
from umbp.errors import InvalidArgument


def make_kv(layers=4, slots=16, parts=1, row=256):
    ts = [[torch.zeros(slots, row, dtype=torch.uint8) for _ in range(parts)] for _ in range(layers)]
    return PagedKV([tuple(p) for p in ts]), ts


def expected_page(rng_seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(rng_seed).integers(0, 256, nbytes, dtype=np.uint8)


@pytest.mark.parametrize("parts", [1, 2])
def test_scattered_pages_into_scattered_slots(parts):
    kv, ts = make_kv(layers=4, slots=16, parts=parts, row=256)
    pb = kv.page_bytes
    assert pb == 4 * parts * 256
    n = 5
    # pages scattered in two host buffers at odd offsets (as in a mapped arena)
    bufs = [np.zeros(20 * pb, np.uint8), bytearray(20 * pb)]
    locs = [(0, 3 * pb + 7), (1, 0), (0, 11 * pb), (1, 9 * pb + 1), (0, 0)]
    pages = [expected_page(i, pb) for i in range(n)]
    for (b, off), pg in zip(locs, pages):
        np.frombuffer(bufs[b], np.uint8)[off:off + pb] = pg
    slots = [9, 2, 15, 0, 7]
    moved = gather.to_kv(kv, slots, HostPages.from_locs(bufs, locs))
    assert moved == n * pb
    for pg, s in zip(pages, slots):
        got = np.concatenate([ts[li][pi][s].numpy() for li in range(4) for pi in range(parts)])
        assert got.tobytes() == pg.tobytes()
    untouched = set(range(16)) - set(slots)
    assert all(not ts[li][pi][s].any() for li in range(4) for pi in range(parts) for s in untouched)


def test_one_layer_group_lands_in_its_layers_only():
    kv, ts = make_kv(layers=6, slots=8, row=128)
    layers = range(2, 5)
    span = 3 * 128
    src = np.arange(2 * span, dtype=np.uint64).astype(np.uint8)
    moved = gather.to_kv(kv, [4, 1], HostPages.rows(src, 2, span), layers)
    assert moved == 2 * span
    for p, s in enumerate([4, 1]):
        for j, li in enumerate(layers):
            assert ts[li][0][s].numpy().tobytes() == src[p * span + j * 128:p * span + (j + 1) * 128].tobytes()
    assert not any(ts[li][0].any() for li in (0, 1, 5))


def test_offload_round_trip_through_a_shared_mapping():
    kv, ts = make_kv(layers=3, slots=8, parts=2, row=64)
    for li in range(3):
        for pi in range(2):
            ts[li][pi].copy_(torch.randint(0, 256, ts[li][pi].shape, dtype=torch.uint8))
    pb = kv.page_bytes
    m = mmap.mmap(-1, 8 * pb)
    arena = memoryview(m)
    slots = [6, 0, 3]
    locs = [(0, 5 * pb), (0, 1 * pb), (0, 3 * pb)]
    assert gather.from_kv(kv, slots, HostPages.from_locs([arena], locs, writable=True)) == 3 * pb
    for (_, off), s in zip(locs, slots):
        want = b"".join(ts[li][pi][s].numpy().tobytes() for li in range(3) for pi in range(2))
        assert bytes(arena[off:off + pb]) == want
    # and back into other slots of a fresh buffer
    kv2, ts2 = make_kv(layers=3, slots=8, parts=2, row=64)
    assert gather.to_kv(kv2, [1, 2, 7], HostPages.from_locs([arena], locs)) == 3 * pb
    for s_old, s_new in zip(slots, [1, 2, 7]):
        assert all(torch.equal(ts[li][pi][s_old], ts2[li][pi][s_new]) for li in range(3) for pi in range(2))
    del arena
    m.close()


def test_bounds_are_checked_before_any_byte_moves():
    kv, ts = make_kv(layers=2, slots=4, row=64)
    pb = kv.page_bytes
    buf = np.full(3 * pb, 7, np.uint8)
    # page 1 runs one byte past the buffer: nothing may be written, page 0 included
    with pytest.raises(InvalidArgument, match="run past"):
        gather.to_kv(kv, [0, 1], HostPages.from_locs([buf], [(0, 0), (0, 2 * pb + 1)]))
    with pytest.raises(InvalidArgument, match="slot index"):
        gather.to_kv(kv, [0, 4], HostPages.from_locs([buf], [(0, 0), (0, pb)]))
    assert not any(t.any() for layer in ts for t in layer)
    with pytest.raises(InvalidArgument, match="read-only"):
        gather.from_kv(kv, [0], HostPages.from_locs([bytes(pb)], [(0, 0)], writable=False))


def test_cuda_paths_fail_clearly_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: tests/test_engine_gpu.py covers the CUDA paths")
    with pytest.raises(gather.GatherUnavailable, match="device copy kernel: CUDA is not available"):
        gather.register_host(np.zeros(4096, np.uint8))


def test_pinned_detection_and_plan_counts():
    kv, _ = make_kv(layers=3, slots=4, parts=2, row=32)
    hp = HostPages.rows(np.zeros(4 * kv.page_bytes, np.uint8), 4, kv.page_bytes)
    assert not hp.pinned  # plain numpy memory: the kernel path would need register_host or staging
    p = gather.plan(kv, [3, 2, 1, 0], hp)
    assert len(p) == 4 * 3 * 2 and p.nbytes == 4 * kv.page_bytes
    assert set(p.lens.tolist()) == {32}


# ---- CUDA host registrations, reference counted (a cudart double stands in for CUDA) ----------------------------

class FakeCudart:
    """``torch.cuda.cudart()`` as the registry uses it: counts calls, tracks what CUDA holds pinned, and fails
    on demand with a given cudaError (CUDA itself refuses a second registration of a range: error 712)."""

    def __init__(self):
        self.pinned: dict[int, int] = {}
        self.calls = {"register": 0, "unregister": 0}
        self.fail_unregister = 0

    def cudaHostRegister(self, addr, nbytes, flags):
        self.calls["register"] += 1
        if addr in self.pinned:
            return 712  # cudaErrorHostMemoryAlreadyRegistered
        self.pinned[addr] = nbytes
        return 0

    def cudaHostUnregister(self, addr):
        self.calls["unregister"] += 1
        if self.fail_unregister:
            return self.fail_unregister
        return 0 if self.pinned.pop(addr, None) is not None else 713  # cudaErrorHostMemoryNotRegistered


@pytest.fixture
def fake_cuda(monkeypatch):
    from types import SimpleNamespace

    cudart = FakeCudart()
    fake_torch = SimpleNamespace(cuda=SimpleNamespace(cudart=lambda: cudart, current_device=lambda: 0))
    monkeypatch.setattr(devkernel, "_require_cuda", lambda: fake_torch)
    monkeypatch.setattr(devkernel, "_device_attr", lambda dev, attr: 1)
    monkeypatch.setattr(devkernel, "_host_registry", devkernel.HostRegistry())
    return cudart


def test_two_loaders_share_an_arena_registration(fake_cuda):
    from umbp.engine.loader import LayerwiseLoader

    arena = mmap.mmap(-1, 1 << 16)
    view = memoryview(arena)
    key = (gather.host_buffer(view, writable=False).addr, 1 << 16)
    kv, _ = make_kv(layers=2, slots=4, row=64)
    loaders = []
    for _ in range(2):
        ld = LayerwiseLoader(None, kv)  # no load runs: only the arena registrations are driven
        ld.kv = type("CudaKV", (), {"is_cuda": True})()  # only _arena_buffer/close are driven: CUDA by the double
        loaders.append(ld)
    assert all(ld._arena_buffer(view) is not None for ld in loaders)
    assert loaders[0]._arena_buffer(view) is not None  # a loader registers an arena once, however often asked
    assert fake_cuda.calls == {"register": 1, "unregister": 0}
    assert devkernel._host_registry.refs(*key) == 2
    loaders[0].close()
    # the other loader's kernels may still read the arena: it stays registered, with one reference
    assert fake_cuda.calls == {"register": 1, "unregister": 0}
    assert devkernel._host_registry.refs(*key) == 1 and key[0] in fake_cuda.pinned
    assert gather.host_buffer(view, writable=False).pinned
    loaders[1].close()
    assert fake_cuda.calls == {"register": 1, "unregister": 1}
    assert devkernel._host_registry.refs(*key) == 0 and not fake_cuda.pinned
    assert not gather.host_buffer(view, writable=False).pinned
    loaders[1].close()  # closing twice gives back nothing twice
    assert fake_cuda.calls["unregister"] == 1


def test_registration_counts_and_failed_statuses(fake_cuda):
    buf = np.zeros(1 << 14, np.uint8)
    a = gather.register_host(buf)
    b = gather.register_host(buf[4096:8192])  # inside a registered range: one more reference on that range
    assert a.pinned and b.pinned
    assert fake_cuda.calls["register"] == 1 and devkernel._host_registry.refs(a.addr, a.nbytes) == 2
    assert gather.unregister_host(b) is False  # not the last reference
    assert fake_cuda.calls["unregister"] == 0
    assert gather.unregister_host(np.zeros(16, np.uint8)) is False  # never registered: nothing to give back
    fake_cuda.fail_unregister = 1  # cudaErrorInvalidValue
    with pytest.raises(gather.HostRegistrationError, match="device copy kernel: cudaHostUnregister of 16384 bytes .* "
                                                           "cudaError 1"):
        gather.unregister_host(a)
    assert devkernel._host_registry.refs(a.addr, a.nbytes) == 0  # forgotten: CUDA's state for it is unknown
    # a registration CUDA refuses raises, and counts nothing
    fake_cuda.pinned[a.addr] = a.nbytes
    with pytest.raises(gather.GatherUnavailable, match="device copy kernel: cudaHostRegister .* cudaError 712"):
        gather.register_host(buf)
    assert devkernel._host_registry.refs(a.addr, a.nbytes) == 0


def test_a_broken_cupy_is_said_once_not_swallowed(monkeypatch, caplog):
    """Review 4.7: a CuPy that is installed but does not import (a CUDA mismatch) silently took every CUDA transfer
    to the staged path. Now it is a warning with the reason, once; a CuPy that is not installed stays quiet."""
    import importlib.abc
    import logging
    import sys

    class Broken(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "cupy":
                raise OSError("libcudart.so.13: cannot open shared object file")
            return None

    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])
    monkeypatch.setattr(devkernel, "_cupy_ok", None)
    with caplog.at_level(logging.WARNING, logger="umbp.devkernel"):
        assert devkernel.cupy_available() is False
        assert devkernel.cupy_available() is False
    said = [r.getMessage() for r in caplog.records if "CuPy" in r.getMessage()]
    assert len(said) == 1 and "libcudart.so.13" in said[0]
