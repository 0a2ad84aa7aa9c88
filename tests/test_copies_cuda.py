"""CUDA outs in the plain API (``umbp.buffers.CudaOut``, ``umbp.devcopy``): which path each page takes, with test
doubles on the CPU (pages read over shm go to the gather kernel, one launch a call; pages over tcp, or with payload
checksums, are staged through a pinned buffer and uploaded; a slot rewritten during a device read is a
CorruptionError), and on a GPU machine the real kernel, bytes exact. Host copies, and the one-node pool marker
``one_node``: tests/test_copies.py."""

from __future__ import annotations

import numpy as np
import pytest

from test_copies import _rand, one_node


class _KernelDouble:
    """Stands for the gather kernel: runs each segment table with memmove on the host and records the launches."""

    def __init__(self):
        self.segments = 0
        self.launches = 0

    def usable(self):
        return True

    def arena_address(self, node_id, arena):
        return int(np.frombuffer(arena, np.uint8).ctypes.data)

    def launch(self, src, dst, lens, device):
        import ctypes

        for s, d, n in zip(src.tolist(), dst.tolist(), lens.tolist()):
            ctypes.memmove(d, s, n)
        self.segments += len(lens)
        self.launches += 1


@one_node
def test_cuda_outs_dispatch_kernel_for_shm_pages_staged_for_others(cluster, monkeypatch):
    """Outs wrapped as ``CudaOut`` (host tensors standing for device ones): pages read over shm go to the kernel
    (one launch per call, ranges included, no pinned buffer taken), pages over tcp go through the staged path
    (pinned buffer, then the upload), and the bytes of both are exact."""
    torch = pytest.importorskip("torch", reason="torch is not installed in this venv: CudaOut needs torch tensors")
    from umbp import buffers, client as client_mod
    from umbp.devcopy import DeviceCopier

    taken, flushed = [], []
    monkeypatch.setattr(buffers.PINNED, "take", lambda n: taken.append(n) or torch.zeros(n, dtype=torch.uint8))

    def fake_flush(outs):  # the "upload": host buffer into the tensor standing for the device one
        for out, n in outs:
            out.tensor.view(-1).view(torch.uint8)[:n].copy_(out.host[:n])
            flushed.append(n)
        for out, _ in outs:
            out.release()

    monkeypatch.setattr(client_mod, "flush_cuda", fake_flush)
    n, size = 6, 40_000
    keys = [f"cuda-dispatch/{i}" for i in range(n)]
    pages = [_rand(size, 300 + i) for i in range(n)]
    with cluster.client(transport="shm") as shm_c, cluster.client(transport="tcp") as tcp_c:
        assert shm_c.batch_put(keys, pages) == [True] * n
        kernel = _KernelDouble()
        real = DeviceCopier(shm_c.component)
        real.usable, real.arena_address, real.launch = kernel.usable, kernel.arena_address, kernel.launch
        shm_c._device = real
        outs = [torch.zeros(size, dtype=torch.uint8) for _ in range(n)]
        assert shm_c.batch_get_into(keys + ["cuda-dispatch/missing"],
                                    [buffers.CudaOut(o) for o in outs] + [buffers.CudaOut(torch.zeros(8))]
                                    ) == [size] * n + [-1]
        assert (kernel.launches, kernel.segments, taken, flushed) == (1, n, [], [])
        for o, p in zip(outs, pages):
            assert o.numpy().tobytes() == p.tobytes()
        # ranges: two per page, CUDA and host outs mixed in one call: only the CUDA ones go to the kernel
        cuda_outs = [torch.zeros(100, dtype=torch.uint8) for _ in range(n)]
        host_outs = [np.zeros(50, np.uint8) for _ in range(n)]
        got = shm_c.batch_get_ranges_into(keys, [[(5, 100), (size - 50, 50)]] * n,
                                          [[buffers.CudaOut(c), h] for c, h in zip(cuda_outs, host_outs)])
        assert got == [150] * n and (kernel.launches, kernel.segments) == (2, 2 * n)
        for c, h, p in zip(cuda_outs, host_outs, pages):
            assert c.numpy().tobytes() == p[5:105].tobytes() and h.tobytes() == p[-50:].tobytes()

        # over tcp the same outs take the staged path: a pinned buffer per out, then the upload
        tcp_c._device = real
        outs = [torch.zeros(size, dtype=torch.uint8) for _ in range(n)]
        assert tcp_c.batch_get_into(keys, [buffers.CudaOut(o) for o in outs]) == [size] * n
        assert kernel.launches == 2 and taken == [size] * n and flushed == [size] * n
        for o, p in zip(outs, pages):
            assert o.numpy().tobytes() == p.tobytes()

        # a client with payload checksums keeps the staged path even over shm (the checksum is a host computation)
        with cluster.client(transport="shm", checksum=True) as sum_c:
            sum_c._device = real
            taken.clear()
            outs = [torch.zeros(size, dtype=torch.uint8) for _ in range(2)]
            assert sum_c.batch_get_into(keys[:2], [buffers.CudaOut(o) for o in outs]) == [size] * 2
            assert kernel.launches == 2 and taken == [size] * 2
            assert outs[1].numpy().tobytes() == pages[1].tobytes()


@one_node
def test_device_read_detects_a_rewritten_slot(cluster):
    """The kernel path checks the headers again after the launch: a slot rewritten meanwhile is a CorruptionError,
    never a hit."""
    torch = pytest.importorskip("torch", reason="torch is not installed in this venv: CudaOut needs torch tensors")
    from transport import objformat
    from umbp import buffers
    from umbp.devcopy import DeviceCopier
    from umbp.errors import CorruptionError

    with cluster.client(transport="shm") as c:
        assert c.put("torn/0", _rand(10_000, 9))
        kernel = _KernelDouble()
        dev = DeviceCopier(c.component)
        dev.usable, dev.arena_address = kernel.usable, kernel.arena_address

        def launch_and_rewrite(src, dst, lens, device):
            kernel.launch(src, dst, lens, device)
            arena = next(iter(c.local_arenas().values()))
            off = int(src[0]) - kernel.arena_address(None, arena) - objformat.OBJ_HEADER_SIZE
            arena[off + 8] ^= 0xFF  # a writer reusing the slot changes its header

        dev.launch = launch_and_rewrite
        c._device = dev
        with pytest.raises(CorruptionError, match="rewritten during a device read"):
            c.batch_get_into(["torn/0"], [buffers.CudaOut(torch.zeros(10_000, dtype=torch.uint8))])
        assert kernel.launches == 1


def test_gpu_plain_api_cuda_outs_and_values(make_cluster):
    """On a GPU machine: CUDA values stored with batch_put and batch_put_ranges, read back into CUDA outs with
    batch_get_into (the gather kernel from the mapped arena: launches counted) and batch_get_ranges_into, bytes
    exact; over tcp the same outs are staged and equally exact."""
    torch = pytest.importorskip("torch", reason="torch is not installed in this venv")
    if not torch.cuda.is_available():
        pytest.skip("NO CUDA on this machine: the GPU half of the plain-API CUDA path runs on the GPU machine")
    from umbp.engine import gather

    if not gather.cupy_available():
        pytest.skip("NO CUPY on this machine: the gather kernel cannot run; the staged path is covered above")
    cluster = make_cluster(nodes=1, capacity="256MiB")
    n, size = 32, (1 << 20) + 4096
    keys = [f"gpu-plain/{i}" for i in range(n)]
    vals = [torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda") for _ in range(n)]
    with cluster.client(transport="shm") as c, cluster.client(transport="tcp") as t:
        assert c.batch_put(keys[:16], vals[:16]) == [True] * 16
        halves = [[v[:size // 2], v[size // 2:]] for v in vals[16:]]
        assert c.batch_put_ranges(keys[16:], halves) == [True] * 16
        assert c._device.launches == 2  # each put call: one scatter kernel straight into the slots
        outs = [torch.zeros(size, dtype=torch.uint8, device="cuda") for _ in range(n)]
        assert c.batch_get_into(keys, outs) == [size] * n
        assert c._device.launches == 3  # the get: one gather kernel for the whole batch
        assert all(torch.equal(o, v) for o, v in zip(outs, vals))
        parts = [[torch.zeros(4096, dtype=torch.uint8, device="cuda")] for _ in range(n)]
        assert c.batch_get_ranges_into(keys, [[(size - 4096, 4096)]] * n, parts) == [4096] * n
        assert c._device.launches == 4
        assert all(torch.equal(p[0], v[-4096:]) for p, v in zip(parts, vals))
        outs = [torch.zeros(size, dtype=torch.uint8, device="cuda") for _ in range(n)]
        assert t.batch_get_into(keys, outs) == [size] * n
        assert t._device.launches == 0
        assert all(torch.equal(o, v) for o, v in zip(outs, vals))
