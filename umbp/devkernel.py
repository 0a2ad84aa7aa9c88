"""The device copy kernel: one CUDA launch copying a table of segments ``(src, dst, length)`` between device memory and
host memory the GPU reaches directly (pinned, or registered with ``cudaHostRegister``), and the process-wide
registration of host ranges it reads and writes.

Used by the client's CUDA path (``umbp/devcopy.py``: arena <-> tensors) and by the engine's gather
(``umbp/engine/gather.py``: pages <-> paged KV slots), which sits above it. Imports nothing of either.

- ``Plan``: a segment table (int64 arrays ``src``, ``dst``, ``lens``); ``run_cpu`` runs it with one ``memmove`` per
  segment, ``run_kernel`` with one CuPy ``RawKernel`` launch (16-byte loads, 4 in flight per thread, 16 KiB per
  thread block, several blocks per segment), asynchronous on the given stream.
- ``host_buffer``: a host buffer by address (``HostBuffer``), ``pinned`` when the GPU can address it.
- ``register_host`` / ``unregister_host``: ``cudaHostRegister`` reference counted process-wide (``HostRegistry``),
  so users of one arena never unpin it under each other.
- ``cupy_available``: whether the kernel can run (CuPy imports); a broken install is said once.

Cost: a launch plus a table upload of 24 bytes per segment; registration once per range.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from umbp.errors import InvalidArgument, UmbpError

COMPONENT = "device copy kernel"
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


# ---- segment tables -------------------------------------------------------------------------------------------


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
            logger.warning("device copy kernel: CuPy is installed but does not import (%s: %s): CUDA outs and values "
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
