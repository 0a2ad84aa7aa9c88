"""Gather: copy scattered pages between host memory and scattered slots of a paged KV buffer, in one pass.

Sources (loads) and destinations (offloads) on the host are described by ``HostPages``: the address of each page's
bytes for the layers being moved, inside caller-owned buffers (a mapped node arena, a pinned staging buffer, numpy
arrays). The KV side is a ``PagedKV`` plus the slot of each page. A move is planned as a segment table, one
``(src, dst, length)`` per page x layer x part, and executed by one of:

- CPU (the KV buffer is on the host): one ``memmove`` per segment through ctypes (releases the GIL).
- CUDA, ``kernel``: one CuPy ``RawKernel`` launch over the whole table. Threads read (or, offloading, write) host
  memory directly over PCIe through unified virtual addressing: the host buffer must be pinned (a torch
  ``pin_memory`` tensor) or registered with ``cudaHostRegister`` (``register_host``; a mapped arena is;
  registrations are reference counted process-wide, ``HostRegistry``, so users of one arena do not unpin it under
  each other). 16-byte
  loads, 4 in flight per thread, 16 KiB per thread block, several blocks per segment. No staging copy: this is
  the zero-copy path, 51 GB/s for 64 KiB pages on an H200 per the environment notes.
- CUDA, ``staged``: for host memory the kernel cannot reach (or where CuPy is missing): ``memmove`` each page's
  bytes into a pinned staging buffer, then either the kernel reads the staging buffer (CuPy present) or one
  ``copy_`` to the device plus one ``index_copy_`` per layer part (torch only).

Contracts: every address is bounds-checked against its buffer and every slot against the KV buffer *before* any
byte moves (a bad plan raises ``InvalidArgument``, nothing is written). CUDA moves are asynchronous on the given
stream (default: the current one): the host bytes must stay put until that stream passes the move (record an
event; the loader does). Cost: planning is numpy-vectorised, O(segments); the CPU path is one memmove per segment;
the kernel path is one launch plus a table upload of 24 bytes per segment.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from umbp.engine.layout import PagedKV
from umbp.errors import InvalidArgument, UmbpError

COMPONENT = "engine gather"
logger = logging.getLogger(__name__)
_memmove = ctypes.memmove

# cudaHostRegisterPortable | cudaHostRegisterMapped
_REGISTER_FLAGS = 1 | 2
_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91  # cudaDevAttrCanUseHostPointerForRegisteredMem

THREADS = 256
UNROLL = 4
CHUNK = THREADS * 16 * UNROLL  # bytes one thread block moves

_KERNEL_SOURCE = r"""
extern "C" __global__ void __launch_bounds__(256)
umbp_segment_copy(const long long* __restrict__ table, const int n, const long long chunk)
{
    // table: n source addresses, n destination addresses, n lengths. Block (x, y) copies bytes
    // [y*chunk, (y+1)*chunk) of segment x. Addresses may be device memory or mapped host memory (UVA).
    const int s = blockIdx.x;
    const long long len = table[2 * n + s];
    const long long begin = (long long)blockIdx.y * chunk;
    if (begin >= len) return;
    const long long end = (begin + chunk < len) ? begin + chunk : len;
    const unsigned long long src = (unsigned long long)table[s];
    const unsigned long long dst = (unsigned long long)table[n + s];
    const int T = blockDim.x;
    if (((src | dst | (unsigned long long)begin | (unsigned long long)end) & 15ULL) == 0) {
        const uint4* S = (const uint4*)src;
        uint4* D = (uint4*)dst;
        long long i = (begin >> 4) + threadIdx.x;
        const long long e = end >> 4;
        for (; i + 3 * T < e; i += 4 * T) {      // four 16-byte loads in flight per thread
            uint4 a = S[i], b = S[i + T], c = S[i + 2 * T], d = S[i + 3 * T];
            D[i] = a; D[i + T] = b; D[i + 2 * T] = c; D[i + 3 * T] = d;
        }
        for (; i < e; i += T) D[i] = S[i];
    } else {
        const char* S = (const char*)src;
        char* D = (char*)dst;
        for (long long i = begin + threadIdx.x; i < end; i += T) D[i] = S[i];
    }
}
"""


class GatherUnavailable(UmbpError, RuntimeError):
    """The requested gather method cannot run here (no CUDA, no CuPy, memory the GPU cannot reach)."""


class HostRegistrationError(UmbpError, RuntimeError):
    """``cudaHostUnregister`` failed: the range's CUDA state is unknown (it is no longer counted as registered)."""


# ---- host buffers ---------------------------------------------------------------------------------------------


@dataclass
class HostBuffer:
    """A host buffer by address: ``addr``/``nbytes``, ``pinned`` when the GPU can address it directly (a pinned
    torch tensor or ``cudaHostRegister``-ed memory); ``obj`` keeps the owner alive while a move uses it."""

    addr: int
    nbytes: int
    pinned: bool
    obj: Any = field(repr=False, default=None)
    writable: bool = True


def host_buffer(obj: Any, writable: bool = True) -> HostBuffer:
    """Describe ``obj`` (a CPU torch tensor, numpy array, memoryview, bytearray or mmap) by address, no copy."""
    mod_torch = _torch_or_none()
    if mod_torch is not None and isinstance(obj, mod_torch.Tensor):
        if obj.device.type != "cpu":
            raise InvalidArgument(COMPONENT, f"host buffer is a tensor on {obj.device}, not host memory")
        if not obj.is_contiguous():
            raise InvalidArgument(COMPONENT, "host buffer tensor is not contiguous")
        pinned = bool(obj.is_pinned()) if mod_torch.cuda.is_available() else False
        return HostBuffer(obj.data_ptr(), obj.numel() * obj.element_size(), pinned or _registered(obj.data_ptr(),
                          obj.numel() * obj.element_size()), obj)
    try:
        arr = np.frombuffer(obj, dtype=np.uint8) if not isinstance(obj, np.ndarray) else obj
    except (TypeError, ValueError) as e:
        raise InvalidArgument(COMPONENT, f"host buffer of type {type(obj).__name__} has no usable buffer: {e}") from e
    if not arr.flags.c_contiguous:
        raise InvalidArgument(COMPONENT, "host buffer is not C-contiguous")
    if writable and not arr.flags.writeable:
        raise InvalidArgument(COMPONENT, f"host buffer of type {type(obj).__name__} is read-only")
    addr, n = int(arr.ctypes.data), int(arr.nbytes)
    return HostBuffer(addr, n, _registered(addr, n), obj, bool(arr.flags.writeable))


class HostPages:
    """Where the bytes of each page lie on the host: page ``p`` starts at ``buffers[index[p]].addr + offset[p]``.

    Build with ``from_locs(buffers, locs)`` (``locs[p] = (buffer_index, byte_offset)``: pages inside mapped arenas)
    or ``rows(buffer, count, stride)`` (page ``p`` at ``p * stride``: a staging buffer)."""

    def __init__(self, buffers: Sequence[HostBuffer], index: np.ndarray, offset: np.ndarray):
        self.buffers = list(buffers)
        self.index = np.asarray(index, dtype=np.int64).reshape(-1)
        self.offset = np.asarray(offset, dtype=np.int64).reshape(-1)
        if self.index.shape != self.offset.shape:
            raise InvalidArgument(COMPONENT, "host pages: index and offset differ in length")
        if self.index.size and (self.index.min() < 0 or self.index.max() >= len(self.buffers)):
            raise InvalidArgument(COMPONENT, "host pages: buffer index out of range")
        if self.offset.size and self.offset.min() < 0:
            raise InvalidArgument(COMPONENT, "host pages: negative offset")

    @classmethod
    def from_locs(cls, buffers: Sequence[Any], locs: Sequence[tuple[int, int]], writable: bool = False
                  ) -> "HostPages":
        bufs = [b if isinstance(b, HostBuffer) else host_buffer(b, writable) for b in buffers]
        arr = np.asarray(locs, dtype=np.int64).reshape(-1, 2)
        return cls(bufs, arr[:, 0], arr[:, 1])

    @classmethod
    def rows(cls, buffer: Any, count: int, stride: int, offset: int = 0, writable: bool = False) -> "HostPages":
        buf = buffer if isinstance(buffer, HostBuffer) else host_buffer(buffer, writable)
        return cls([buf], np.zeros(count, np.int64), offset + stride * np.arange(count, dtype=np.int64))

    def __len__(self) -> int:
        return int(self.index.size)

    @property
    def pinned(self) -> bool:
        return all(b.pinned for b in self.buffers)

    def addresses(self, span: int, writable: bool) -> np.ndarray:
        """Start address of each page, after checking ``[offset, offset + span)`` lies inside its buffer."""
        sizes = np.array([b.nbytes for b in self.buffers], dtype=np.int64)
        bases = np.array([b.addr for b in self.buffers], dtype=np.int64)
        if self.index.size and np.any(self.offset + span > sizes[self.index]):
            p = int(np.argmax(self.offset + span > sizes[self.index]))
            raise InvalidArgument(COMPONENT, f"page {p}: bytes {int(self.offset[p])}+{span} run past its host "
                                             f"buffer of {int(sizes[self.index[p]])} bytes")
        if writable and any(not b.writable for b in self.buffers):
            raise InvalidArgument(COMPONENT, "a destination host buffer is read-only")
        return bases[self.index] + self.offset


# ---- planning -------------------------------------------------------------------------------------------------


@dataclass
class Plan:
    """A segment table: copy ``lens[i]`` bytes from ``src[i]`` to ``dst[i]`` (all int64 arrays)."""

    src: np.ndarray
    dst: np.ndarray
    lens: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.lens.sum())

    def __len__(self) -> int:
        return int(self.lens.size)


def plan(kv: PagedKV, slots: Any, host: HostPages, layers: range | None = None, to_kv: bool = True) -> Plan:
    """Segments moving ``layers`` (default: all) of each page between ``host`` and ``kv`` slot ``slots[p]``. On the
    host the layers of a page are contiguous (page-first order, starting at the page's address); on the KV side
    each layer part is one slot row."""
    slots_a = kv.check_slots(slots)
    if len(host) != slots_a.size:
        raise InvalidArgument(COMPONENT, f"{len(host)} host pages but {slots_a.size} slots")
    k, rel, ln = slot_rows(kv, slots_a, layers)
    haddr = host.addresses(int(ln.sum()), writable=not to_kv)
    # [pages, segments-per-page], page-major: each page's host bytes are read front to back.
    h = haddr[:, None] + rel[None, :]
    lens = np.broadcast_to(ln[None, :], h.shape)
    h, k, lens = h.reshape(-1), k.reshape(-1), np.ascontiguousarray(lens).reshape(-1)
    return Plan(h, k, lens) if to_kv else Plan(k, h, lens)


def slot_rows(kv: PagedKV, slots: Any, layers: range | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The KV side of a page move: ``(addresses [pages, segments], rel [segments], lens [segments])``, one segment per
    layer x part of ``layers`` (default: all) of slot ``slots[p]``; ``rel`` is each segment's offset in the page's
    bytes (page-first order, counted from the first of ``layers``). Slots are checked."""
    layers = range(kv.num_layers) if layers is None else layers
    slots_a = kv.check_slots(slots)
    segs = kv.segments(layers)
    rel = np.array([s[0] for s in segs], dtype=np.int64)
    ln = np.array([s[1] for s in segs], dtype=np.int64)
    base = np.array([s[2] for s in segs], dtype=np.int64)
    stride = np.array([s[3] for s in segs], dtype=np.int64)
    return base[None, :] + slots_a[:, None] * stride[None, :], rel, ln


# ---- executors ------------------------------------------------------------------------------------------------


def run_cpu(p: Plan) -> int:
    """Execute a plan with one memmove per segment (host memory on both sides)."""
    for s, d, n in zip(p.src.tolist(), p.dst.tolist(), p.lens.tolist()):
        _memmove(d, s, n)
    return p.nbytes


def _torch_or_none():
    import sys

    return sys.modules.get("torch")


class HostRegistry:
    """Process-wide reference counts of ``cudaHostRegister``-ed host ranges, keyed by ``(address, length)``.

    CUDA registers a range once per process: a second ``cudaHostRegister`` of it fails, and one
    ``cudaHostUnregister`` ends it for every user. So the first ``acquire`` of a range registers it, later ones (of
    the same range, or of a range inside one already registered) count a reference, and only the ``release`` of
    the last reference unregisters it: one loader's ``close()`` never unpins an arena another loader's kernel may
    still be reading. The status of both calls is checked: a failed register raises ``GatherUnavailable``; a failed
    unregister is logged and raised as ``HostRegistrationError`` (the range is forgotten either way: CUDA's state for
    it is unknown, and a retry would unregister twice). ``cudart`` is ``torch.cuda.cudart()`` (a test double
    stands in for it on CPU). Thread-safe; O(ranges) per call (a process registers a handful of arenas)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._refs: dict[tuple[int, int], int] = {}

    def refs(self, addr: int, nbytes: int) -> int:
        """References held on exactly the range ``(addr, nbytes)`` (0: not registered as such)."""
        with self._lock:
            return self._refs.get((addr, nbytes), 0)

    def covering(self, addr: int, nbytes: int) -> tuple[int, int] | None:
        """The registered range that contains ``[addr, addr + nbytes)``, if any."""
        with self._lock:
            return self._covering(addr, nbytes)

    def _covering(self, addr: int, nbytes: int) -> tuple[int, int] | None:
        if (addr, nbytes) in self._refs:
            return addr, nbytes
        return next(((a, n) for a, n in self._refs if a <= addr and addr + nbytes <= a + n), None)

    def acquire(self, addr: int, nbytes: int, cudart: Any, check_device: Any = None) -> tuple[int, int]:
        """Take a reference on the range (registering it if no registered range covers it); returns the key to
        ``release``. ``check_device()`` runs after a fresh registration: False undoes it and raises."""
        with self._lock:  # held across the CUDA call: two threads must not both register one range
            key = self._covering(addr, nbytes)
            if key is not None:
                self._refs[key] += 1
                return key
            err = int(cudart.cudaHostRegister(addr, nbytes, _REGISTER_FLAGS))
            if err != 0:
                raise GatherUnavailable(COMPONENT, f"cudaHostRegister of {nbytes} bytes at {addr:#x} failed with "
                                                   f"cudaError {err}")
            if check_device is not None and not check_device():
                undo = int(cudart.cudaHostUnregister(addr))
                raise GatherUnavailable(COMPONENT, f"the device cannot use host pointers for registered memory "
                                                   f"(registration of {addr:#x} undone, cudaError {undo})")
            self._refs[(addr, nbytes)] = 1
            return addr, nbytes

    def release(self, key: tuple[int, int], cudart: Any) -> bool:
        """Drop one reference; the last one unregisters the range (True then). Raises ``HostRegistrationError`` if
        ``cudaHostUnregister`` fails; ``InvalidArgument`` for a range holding no reference."""
        with self._lock:
            n = self._refs.get(key, 0)
            if n <= 0:
                raise InvalidArgument(COMPONENT, f"release of host range {key[0]:#x}+{key[1]} that holds no "
                                                 f"registration")
            if n > 1:
                self._refs[key] = n - 1
                return False
            del self._refs[key]
            err = int(cudart.cudaHostUnregister(key[0]))
        if err != 0:
            msg = f"cudaHostUnregister of {key[1]} bytes at {key[0]:#x} failed with cudaError {err}"
            logger.error("%s: %s", COMPONENT, msg)
            raise HostRegistrationError(COMPONENT, msg)
        return True


_host_registry = HostRegistry()


def _registered(addr: int, nbytes: int) -> bool:
    return _host_registry.covering(addr, nbytes) is not None


def _cudart() -> Any:
    return _require_cuda().cuda.cudart()


def register_host(obj: Any) -> HostBuffer:
    """``cudaHostRegister`` a host buffer (a mapped arena, a numpy array) so the gather kernel reads and writes it
    directly. Reference counted process-wide (``HostRegistry``): every call takes one reference, to be given back
    by one ``unregister_host``; the range is unpinned at the last. Raises ``GatherUnavailable`` where CUDA is absent
    or the registration fails (some sandboxes refuse to pin shared mappings: use the staged path then). Undo before
    the memory is unmapped."""
    cudart = _cudart()
    buf = host_buffer(obj, writable=False)

    def usable() -> bool:
        return bool(_device_attr(_require_cuda().cuda.current_device(), _CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM))

    _host_registry.acquire(buf.addr, buf.nbytes, cudart, usable)
    buf.pinned = True
    return buf


def unregister_host(obj: Any) -> bool:
    """Give back one ``register_host`` reference of this buffer (by its range, or the registered range that
    contains it); the last reference unregisters it (True then). No-op (False) for a buffer never registered.
    Raises ``HostRegistrationError`` if ``cudaHostUnregister`` fails."""
    buf = obj if isinstance(obj, HostBuffer) else host_buffer(obj, writable=False)
    key = _host_registry.covering(buf.addr, buf.nbytes)
    if key is None:
        return False
    return _host_registry.release(key, _cudart())


def _device_attr(dev: int, attr: int) -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.deviceGetAttribute(attr, dev))
    except ImportError:
        return 1  # Linux x86-64 with UVA: registered memory is addressed by its host pointer


def _require_cuda():
    torch = _torch_or_none()
    if torch is None:
        import torch  # noqa: F811
    if not torch.cuda.is_available():
        raise GatherUnavailable(COMPONENT, "CUDA is not available on this machine (torch.cuda.is_available() is "
                                           "False); the CPU path handles CPU KV buffers")
    return torch


_kernels: dict[int, Any] = {}


_cupy_ok: bool | None = None


def cupy_available() -> bool:
    """Whether CuPy imports (the gather kernel needs it). Not installed: False, quietly (CPU machines). Installed
    but broken (a CUDA mismatch, a missing library): False, said once as a warning with the reason, since every
    CUDA transfer then takes the staged path at a fraction of the kernel's speed."""
    global _cupy_ok
    if _cupy_ok is None:
        try:
            import cupy  # noqa: F401
            _cupy_ok = True
        except ModuleNotFoundError:
            _cupy_ok = False
        except Exception as e:
            _cupy_ok = False
            logger.warning("engine.gather: CuPy is installed but does not import (%s: %s): CUDA outs and values "
                           "take the staged path, far slower than the gather kernel", type(e).__name__, e)
    return _cupy_ok


def _kernel(device: int):
    k = _kernels.get(device)
    if k is None:
        try:
            import cupy
        except Exception as e:
            raise GatherUnavailable(COMPONENT, f"the gather kernel needs CuPy (cupy-cuda13x): {e}") from e
        with cupy.cuda.Device(device):
            k = cupy.RawKernel(_KERNEL_SOURCE, "umbp_segment_copy")
            k.compile()
        _kernels[device] = k
    return k


def run_kernel(p: Plan, device: Any, stream: Any = None) -> int:
    """Launch the segment-copy kernel for ``p`` on ``stream`` (default: the current torch stream of ``device``).
    Every address must be device memory or pinned/registered host memory. Asynchronous."""
    torch = _require_cuda()
    import cupy

    if len(p) == 0:
        return 0
    dev = device.index if device.index is not None else torch.cuda.current_device()
    stream = stream or torch.cuda.current_stream(dev)
    k = _kernel(dev)
    table = torch.from_numpy(np.concatenate([p.src, p.dst, p.lens])).pin_memory()
    with torch.cuda.stream(stream):
        # from pinned memory: asynchronous, and the pinned block is not reused before the copy has run
        t = table.to(f"cuda:{dev}", non_blocking=True)
    ny = max(1, -(-int(p.lens.max()) // CHUNK))
    if ny > 65535:
        raise InvalidArgument(COMPONENT, f"segment of {int(p.lens.max())} bytes is too long for one launch")
    with warnings.catch_warnings():
        # CuPy 14 deprecates ExternalStream for Stream.from_external; the old name still works and also runs on
        # CuPy releases without the new one
        warnings.simplefilter("ignore", DeprecationWarning)
        cstream = cupy.cuda.ExternalStream(stream.cuda_stream, dev)
    with cupy.cuda.Device(dev), cstream:
        k((len(p), ny), (THREADS,), (np.uint64(t.data_ptr()), np.int32(len(p)), np.int64(CHUNK)))
    # keep the table alive until the kernel ran: the caching allocator reuses it only after the stream passes
    t.record_stream(stream)
    return p.nbytes


class Staging:
    """A reusable pinned host buffer for the staged path (grows on demand, never shrinks)."""

    def __init__(self):
        self.buf = None

    def get(self, nbytes: int):
        torch = _require_cuda()
        if self.buf is None or self.buf.numel() < nbytes:
            self.buf = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=True)
        return self.buf


_default_staging = Staging()


def _resolve(method: str, host: HostPages) -> str:
    if method not in ("auto", "kernel", "staged"):
        raise InvalidArgument(COMPONENT, f"method must be auto, kernel or staged, got {method!r}")
    if method == "auto":
        return "kernel" if host.pinned and cupy_available() else "staged"
    if method == "kernel" and not host.pinned:
        raise GatherUnavailable(COMPONENT, "kernel gather needs pinned or registered host memory "
                                           "(pin_memory=True tensors, register_host(buffer)); use method='staged'")
    return method


def to_kv(kv: PagedKV, slots: Any, host: HostPages, layers: range | None = None, *, method: str = "auto",
          stream: Any = None, staging: Staging | None = None) -> int:
    """Copy ``layers`` of each page from ``host`` into ``kv`` at ``slots``; returns the bytes moved.
    On CUDA this is asynchronous on ``stream`` (see the module contract)."""
    return _move(kv, slots, host, layers, True, method, stream, staging)


def from_kv(kv: PagedKV, slots: Any, host: HostPages, layers: range | None = None, *, method: str = "auto",
            stream: Any = None, staging: Staging | None = None) -> int:
    """Copy ``layers`` of each ``kv`` slot ``slots[p]`` out to page ``p`` of ``host`` (offload); returns bytes moved.
    On CUDA the kernel path is asynchronous on ``stream``; the staged path returns after the bytes are on the host."""
    return _move(kv, slots, host, layers, False, method, stream, staging)


def _move(kv: PagedKV, slots: Any, host: HostPages, layers: range | None, load: bool, method: str, stream: Any,
          staging: Staging | None) -> int:
    """Plan, then run on the CPU, the kernel or the staged path (``load``: host -> KV)."""
    p = plan(kv, slots, host, layers, to_kv=load)
    if not kv.is_cuda:
        return run_cpu(p)
    if _resolve(method, host) == "kernel":
        return run_kernel(p, kv.device, stream)
    return _staged(kv, slots, host, layers, p, load, stream, staging or _default_staging)


def _staged(kv: PagedKV, slots: Any, host: HostPages, layers: range | None, p: Plan, load: bool, stream: Any,
            staging: Staging) -> int:
    """Pinned staging: pages' host bytes are contiguous per page, so stage them as rows [pages, span]."""
    torch = _require_cuda()
    layers = range(kv.num_layers) if layers is None else layers
    n = len(host)
    if n == 0:
        return 0
    segs = kv.segments(layers)
    span = sum(s[1] for s in segs)
    haddr = host.addresses(span, writable=not load)
    stage = staging.get(n * span)
    sbase = stage.data_ptr()
    stream = stream or torch.cuda.current_stream(kv.device)
    stream.synchronize()  # the staging buffer may still feed an earlier move on this stream
    rows = HostPages.rows(HostBuffer(sbase, n * span, True, stage), n, span)
    if load:
        for i, a in enumerate(haddr.tolist()):
            _memmove(sbase + i * span, a, span)
        if cupy_available():
            run_kernel(plan(kv, slots, rows, layers, to_kv=True), kv.device, stream)
        else:
            _torch_rows(kv, slots, stage[: n * span].view(n, span), layers, True, stream)
        stream.synchronize()  # the staging buffer is reused by the next call
    else:
        if cupy_available():
            run_kernel(plan(kv, slots, rows, layers, to_kv=False), kv.device, stream)
        else:
            _torch_rows(kv, slots, stage[: n * span].view(n, span), layers, False, stream)
        stream.synchronize()
        for i, a in enumerate(haddr.tolist()):
            _memmove(a, sbase + i * span, span)
    return p.nbytes


def _torch_rows(kv: PagedKV, slots: Any, rows: Any, layers: range, load: bool, stream: Any) -> None:
    """Torch-only move between host rows [pages, span] (pinned) and KV slots: one copy plus one index op per part."""
    import torch

    idx = torch.as_tensor(np.asarray(slots, dtype=np.int64), device=kv.device)
    with torch.cuda.stream(stream):
        dev_rows = rows.to(kv.device, non_blocking=True) if load else torch.empty(rows.shape, dtype=torch.uint8,
                                                                                   device=kv.device)
        rel = 0
        for li in layers:
            for t, row in zip(kv.parts[li], kv.part_rows[li]):
                flat = t.view(t.shape[0], -1).view(torch.uint8)
                if load:
                    flat.index_copy_(0, idx, dev_rows[:, rel:rel + row])
                else:
                    dev_rows[:, rel:rel + row] = flat.index_select(0, idx)
                rel += row
        if not load:
            rows.copy_(dev_rows, non_blocking=True)
