"""Gather: copy scattered pages between host memory and scattered slots of a paged KV buffer, in one pass.

Sources (loads) and destinations (offloads) on the host are described by ``HostPages``: the address of each page's
bytes for the layers being moved, inside caller-owned buffers (a mapped node arena, a pinned staging buffer, numpy
arrays). The KV side is a ``PagedKV`` plus the slot of each page. A move is planned as a segment table, one
``(src, dst, length)`` per page x layer x part, and executed by one of:

- CPU (the KV buffer is on the host): one ``memmove`` per segment through ctypes (releases the GIL).
- CUDA, ``kernel``: one launch of the device copy kernel over the whole table (``umbp/devkernel.py``, which the
  client's CUDA path uses too; its names are re-exported here). Threads read (or, offloading, write) host memory
  directly over PCIe through unified virtual addressing: the host buffer must be pinned (a torch ``pin_memory``
  tensor) or registered with ``cudaHostRegister`` (``register_host``; a mapped arena is; registrations are
  reference counted process-wide, so users of one arena do not unpin it under each other). No staging copy: this
  is the zero-copy path, 51 GB/s for 64 KiB pages on an H200 per the environment notes.
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
from typing import Any, Sequence

import numpy as np

from umbp.devkernel import (GatherUnavailable, HostBuffer, HostRegistrationError, HostRegistry, Plan, _require_cuda,
                            cupy_available, host_buffer, register_host, run_cpu, run_kernel, unregister_host)
from umbp.engine.layout import PagedKV
from umbp.errors import InvalidArgument

# the kernel's names are the engine's too (loaders register arenas, benches run plans)
__all__ = ["GatherUnavailable", "HostBuffer", "HostPages", "HostRegistrationError", "HostRegistry", "Plan", "Staging",
           "cupy_available", "from_kv", "host_buffer", "plan", "register_host", "run_cpu", "run_kernel", "slot_rows",
           "to_kv", "unregister_host"]

COMPONENT = "engine gather"
_memmove = ctypes.memmove


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
