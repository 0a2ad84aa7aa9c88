"""Turning caller values and destination buffers into flat byte memoryviews, without copying.

Accepted: anything with the buffer protocol (bytes, bytearray, memoryview, mmap, array), numpy arrays, and torch
tensors. They must be C-contiguous: a strided view would need a gather, and silently copying it would hide a
slow path, so it is refused with a clear error. CPU torch tensors are viewed through ``tensor.view(torch.uint8)``
(works for bfloat16 and float8, which numpy cannot represent). A CUDA tensor is not host memory: values are staged
to the host through pooled pinned buffers (``stage_cuda``: asynchronous copies, one wait), and outs are either
filled by the gather kernel straight from a same-host arena (``umbp.devcopy``) or through a pinned host buffer
taken on first use and copied up (``CudaOut``).

Pinned host buffers come from a per-process pool (``PINNED``, power-of-two size classes, at most
``PinnedPool.KEEP_BYTES`` kept): pinning memory costs a ``cudaHostAlloc`` (hundreds of microseconds to milliseconds),
far more than the copy of a page, so a batch of CUDA outs must not pin one buffer per page per call. ``flush_cuda``
issues every page's host-to-device copy asynchronously and waits once.

``Rows``: equal rows at a fixed stride inside one writable buffer (a layer_first host page's K or V: one run per
layer, evenly spaced), as an out (a page read into it lands row by row) or as a value (its rows back to back are the
page). Over shm one strided copy per page instead of one op per row; other transports take one view per row.

``HostSpans``: pages at raw host addresses the caller vouches for (a host KV pool's pages), read into with no
object a page.

``new_bytes(n)``: a fresh ``bytes`` object and a writable view of its memory, to fill it before it is handed out
(``Client.get`` reads a page straight into the ``bytes`` it returns instead of into a bytearray copied again).
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any

from umbp.errors import InvalidArgument


def _torch_view(t: Any, writable: bool) -> memoryview:
    if not t.is_contiguous():
        raise InvalidArgument("client", f"torch tensor of shape {tuple(t.shape)} is not contiguous")
    if t.device.type != "cpu":
        raise InvalidArgument("client", "internal: CUDA tensors go through CudaOut/staging")
    import torch

    flat = t.reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


_PLAIN = (bytes, bytearray, memoryview)


def _is_torch(obj: Any) -> bool:
    # The common types first: isinstance against torch.Tensor goes through its metaclass (microseconds per call).
    t = type(obj)
    if t in _PLAIN or t.__module__ == "numpy":
        return False
    mod = sys.modules.get("torch")
    return mod is not None and isinstance(obj, mod.Tensor)


def _flat_view(obj: Any, what: str, writable: bool, index: int | None = None) -> memoryview:
    if type(obj) is memoryview and obj.format == "B" and obj.ndim == 1 and obj.c_contiguous and (
            not writable or not obj.readonly):
        return obj
    if index is not None:
        what = f"{what}[{index}]"
    try:
        mv = memoryview(obj)
    except TypeError:
        raise InvalidArgument("client", f"{what} of type {type(obj).__name__} does not support the buffer "
                                        f"protocol (use bytes, bytearray, memoryview, numpy arrays or tensors)") from None
    if writable and mv.readonly:
        raise InvalidArgument("client", f"{what} is read-only (bytes?); pass a bytearray, numpy array or tensor")
    if not mv.c_contiguous:
        raise InvalidArgument("client", f"{what} is not C-contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def as_bytes_view(value: Any, what: str = "value", index: int | None = None) -> memoryview:
    """A read-only flat byte view of ``value`` (a CUDA tensor is copied to the host first; a ``Rows`` passes as it
    is: its rows back to back are the value). ``what`` (with ``index``: ``what[index]``) names it in errors."""
    t = type(value)
    if t is bytes or t is bytearray:  # always flat bytes: their view needs none of the checks (a put's usual value)
        return memoryview(value)
    if t is Rows:
        return value
    if _is_torch(value):
        if value.device.type != "cpu":
            value = value.detach().to("cpu")
        return _torch_view(value, writable=False)
    return _flat_view(value, what, False, index)


class PinnedPool:
    """Pinned host buffers reused across calls. ``take`` rounds up to a power of two (at least 4 KiB); ``give``
    keeps a buffer for reuse while the pool holds at most KEEP_BYTES, else lets it go. Thread-safe."""

    KEEP_BYTES = 256 << 20

    def __init__(self) -> None:
        self._free: dict[int, list] = {}
        self._kept = 0
        self._lock = threading.Lock()
        self.allocated = 0  # buffers pinned so far (observability, tests)

    def take(self, nbytes: int) -> Any:
        size = max(4096, 1 << (max(nbytes, 1) - 1).bit_length())
        with self._lock:
            free = self._free.get(size)
            if free:
                self._kept -= size
                return free.pop()
            self.allocated += 1
        import torch

        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def give(self, host: Any) -> None:
        size = host.numel()
        with self._lock:
            if self._kept + size <= self.KEEP_BYTES:
                self._free.setdefault(size, []).append(host)
                self._kept += size


PINNED = PinnedPool()


class CudaOut:
    """A destination on a CUDA device: filled through a pinned host buffer from ``PINNED``, copied up by
    ``flush_cuda``, which also gives the buffer back (``release`` gives it back without copying)."""

    def __init__(self, tensor: Any):
        if not tensor.is_contiguous():
            raise InvalidArgument("client", "CUDA out tensor is not contiguous")
        self.tensor = tensor
        self.nbytes = tensor.numel() * tensor.element_size()
        self.host = None  # taken on first use of ``view``: outs the gather kernel fills never pin a buffer
        self._view: memoryview | None = None

    @property
    def view(self) -> memoryview:
        if self._view is None:
            self.host = PINNED.take(self.nbytes)
            self._view = memoryview(self.host.numpy()).cast("B")[:self.nbytes]
        return self._view

    def release(self) -> None:
        host, self.host = self.host, None
        self._view = None
        if host is not None:
            PINNED.give(host)


def stage_cuda(values: list[Any]) -> tuple[list[Any], list[Any]]:
    """Copy the CUDA tensors among ``values`` down into pooled pinned buffers: every copy queued asynchronously,
    one wait per device (pinned device-to-host copies run at the link's rate; ``.to("cpu")`` of each tensor would
    be a pageable copy, a fraction of it). Returns (values with each CUDA tensor replaced by a host tensor of its
    bytes, the pinned buffers to hand back to ``PINNED.give`` once the bytes are written)."""
    import torch

    out, taken, devices = list(values), [], set()
    try:
        for i, v in enumerate(values):
            if _is_torch(v) and v.device.type != "cpu":
                if not v.is_contiguous():
                    raise InvalidArgument("client", f"CUDA value {i} is not contiguous")
                n = v.numel() * v.element_size()
                host = PINNED.take(n)
                taken.append(host)
                host[:n].copy_(v.reshape(-1).view(torch.uint8), non_blocking=True)
                devices.add(v.device)
                out[i] = host[:n]
        for dev in devices:
            torch.cuda.current_stream(dev).synchronize()
    except BaseException:
        for h in taken:
            PINNED.give(h)
        raise
    return out, taken


def flush_cuda(outs: list[tuple[CudaOut, int]]) -> None:
    """Copy ``nbytes`` of each out's host buffer to its tensor: all copies queued asynchronously on the current
    stream of each tensor's device, then one wait per device; every host buffer goes back to the pool. Blocks until
    the copies are done (the tensors are ready when it returns)."""
    import torch

    devices = set()
    try:
        for out, nbytes in outs:
            if nbytes > 0 and out.host is not None:
                dst = out.tensor.reshape(-1).view(torch.uint8)
                dst[:nbytes].copy_(out.host[:nbytes], non_blocking=True)
                devices.add(out.tensor.device)
        for dev in devices:
            torch.cuda.current_stream(dev).synchronize()
    finally:
        for out, _ in outs:
            out.release()


_CPYTHON = sys.implementation.name == "cpython"
if _CPYTHON:
    _bytes_from_size = ctypes.pythonapi.PyBytes_FromStringAndSize
    _bytes_from_size.restype = ctypes.py_object
    _bytes_from_size.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)
    _BYTES_DATA = sys.getsizeof(b"") - 1  # offset of a bytes object's data (the header; the 1 is the final NUL)


def new_bytes(n: int) -> tuple[bytes | bytearray, memoryview]:
    """A new object of ``n`` bytes and a writable view of its memory. On CPython it is a ``bytes`` made by
    ``PyBytes_FromStringAndSize(NULL, n)``, the C API's way to build a bytes object by filling it: the caller fills
    it through the view before anyone else sees it, then drops the view (no copy to make it a ``bytes``). Elsewhere,
    and for n < 2 (small bytes may be shared singletons), a bytearray: convert it with ``bytes()``."""
    if not _CPYTHON or n < 2:
        b = bytearray(n)
        return b, memoryview(b)
    b = _bytes_from_size(None, n)
    return b, memoryview((ctypes.c_char * n).from_address(id(b) + _BYTES_DATA)).cast("B")


class Rows:
    """An out of ``count`` rows of ``row`` bytes, ``stride`` bytes apart, in the writable buffer ``base`` (row r is
    ``base[r * stride : r * stride + row]``): bytes read into it fill row 0, then row 1, and so on. ``len`` is the
    bytes it takes (``count * row``). Rows never overlap (``stride >= row``) and all lie inside ``base`` (checked
    here, so a transport copies into them without further bounds checks)."""

    __slots__ = ("base", "row", "stride", "count", "nbytes", "address")
    readonly = False

    def __init__(self, base: Any, row: int, stride: int, count: int):
        mv = _flat_view(base, "Rows base", True)
        for name, v in (("row", row), ("stride", stride), ("count", count)):
            if type(v) is not int or v < 1:
                raise InvalidArgument("client", f"Rows {name} must be a positive integer, got {v!r}")
        if stride < row:
            raise InvalidArgument("client", f"Rows stride {stride} is shorter than a row of {row}: rows overlap")
        if (count - 1) * stride + row > len(mv):
            raise InvalidArgument("client", f"{count} rows of {row} bytes every {stride} need "
                                            f"{(count - 1) * stride + row} bytes; the base holds {len(mv)}")
        self.base, self.row, self.stride, self.count = mv, row, stride, count
        self.nbytes = row * count
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(mv))

    def __len__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        return f"Rows({self.count} x {self.row} B every {self.stride} B)"

    def views(self, n: int | None = None) -> list[memoryview]:
        """The rows as flat views, cut to the first ``n`` bytes (default: all of them)."""
        n = self.nbytes if n is None else n
        b, row, stride = self.base, self.row, self.stride
        return [b[r * stride:r * stride + min(row, n - r * row)] for r in range(-(-n // row))]

    def fill(self, src: Any, n: int) -> None:
        """Copy the first ``n`` bytes of the flat view ``src`` into the rows, in order (``n <= len(self)``)."""
        row = self.row
        for r, v in enumerate(self.views(n)):
            v[:] = src[r * row:r * row + len(v)]

    def gather(self, n: int) -> bytes:
        """The first ``n`` bytes of the rows joined (payload checksums; a copy)."""
        return b"".join(bytes(v) for v in self.views(n))


def view_at(address: int, n: int) -> memoryview:
    """A writable flat byte view of ``n`` bytes at ``address`` (memory someone else owns: the caller keeps it alive)."""
    return memoryview((ctypes.c_char * n).from_address(address)).cast("B")


def views_at(at: list[int], n: list[int]) -> list[memoryview]:
    """``view_at`` of each (address, bytes): slices of one view over their span when they lie close together (the
    rows of one 2-D out, a host pool's pages: a slice is a third of a ``view_at``'s cost), else one ``view_at``
    each. Only the slices are written: the span's bytes between them are never touched."""
    if not at:
        return []
    lo = min(at)
    span = max(map(int.__add__, at, n)) - lo
    if span > 2 * sum(n) + (1 << 20):
        return list(map(view_at, at, n))
    whole = view_at(lo, span)
    return [whole[a - lo:a - lo + k] for a, k in zip(at, n)]


class HostSpans:
    """Pages at raw host addresses: page i is the ``nbytes[i]`` bytes at ``addr[i]`` (int64 arrays of one length), in
    memory the caller owns, keeps alive for the call, and has checked (a host KV pool's pages: SGLang's HiCache
    backend checks them against the pool's allocations, ``hostmem.Extents.check_all``). ``batch_get_into`` takes it
    as its outs with no object a page (``umbp/readbatch.py``'s array path reads straight to the addresses);
    ``batch_put`` as its values (``views``: one view a page, as the put path takes them). The spans must not overlap
    when read into."""

    __slots__ = ("addr", "nbytes")

    def __init__(self, addr: Any, nbytes: Any):
        import numpy as np

        a, n = np.asarray(addr), np.asarray(nbytes)
        if a.ndim != 1 or n.ndim != 1 or len(a) != len(n) or a.dtype.kind not in "iu" or n.dtype.kind not in "iu":
            raise InvalidArgument("client", f"HostSpans needs two 1-D integer arrays of one length, got shapes "
                                            f"{a.shape} and {n.shape}")
        a, n = a.astype(np.int64), n.astype(np.int64)
        if len(a) and (int(a.min()) <= 0 or int(n.min()) < 0):
            raise InvalidArgument("client", "HostSpans: addresses must be positive and sizes non-negative")
        a.flags.writeable = n.flags.writeable = False
        self.addr, self.nbytes = a, n

    @classmethod
    def rows(cls, pool: Any, indices: Any) -> "HostSpans":
        """Rows ``indices`` of a host pool (a C-contiguous numpy array or CPU torch tensor of at least 2 dimensions: a
        row a page), checked here: every index within the pool's rows. The pool must outlive the call."""
        import numpy as np

        if _is_torch(pool):
            if pool.device.type != "cpu" or not pool.is_contiguous() or pool.dim() < 2:
                raise InvalidArgument("client", "HostSpans.rows: the pool must be a contiguous CPU tensor of 2+ dims")
            base, count, row = pool.data_ptr(), pool.shape[0], pool.stride(0) * pool.element_size()
        else:
            if not isinstance(pool, np.ndarray) or pool.ndim < 2 or not pool.flags.c_contiguous \
                    or not pool.flags.writeable:
                raise InvalidArgument("client", "HostSpans.rows: the pool must be a writable C-contiguous numpy "
                                                "array of 2+ dims (or a CPU tensor)")
            base, count, row = pool.ctypes.data, pool.shape[0], pool.strides[0]
        ix = np.asarray(indices.numpy() if _is_torch(indices) else indices)
        if ix.ndim != 1 or (len(ix) and ix.dtype.kind not in "iu"):
            raise InvalidArgument("client", f"HostSpans.rows: indices must be a 1-D integer array, got {ix.dtype} "
                                            f"of shape {ix.shape}")
        ix = ix.astype(np.int64)
        if len(ix) and (int(ix.min()) < 0 or int(ix.max()) >= count):
            raise InvalidArgument("client", f"HostSpans.rows: an index outside the pool's {count} rows")
        return cls(base + ix * row, np.full(len(ix), row, np.int64))

    def __len__(self) -> int:
        return len(self.addr)

    def __repr__(self) -> str:
        return f"HostSpans({len(self)} pages, {int(self.nbytes.sum())} B)"

    def views(self) -> list[memoryview]:
        """One writable flat view a span (``views_at``)."""
        return views_at(self.addr.tolist(), self.nbytes.tolist())


def as_writable_view(out: Any, what: str = "out", index: int | None = None) -> memoryview | CudaOut | Rows:
    """A writable flat byte view of ``out``, or a ``CudaOut`` for a CUDA tensor (a ``Rows`` passes as it is)."""
    if type(out) is CudaOut or type(out) is Rows:  # already wrapped (test doubles wrap host tensors as CudaOut)
        return out
    if _is_torch(out):
        if out.device.type != "cpu":
            return CudaOut(out)
        return _torch_view(out, writable=True)
    return _flat_view(out, what, True, index)
