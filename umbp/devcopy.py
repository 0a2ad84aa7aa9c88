"""CUDA tensors in the plain API: same-host pages moved by the device copy kernel straight between the mapped arena and
the tensors (``DeviceCopier``), instead of a host memcpy into pinned staging plus an upload.

``Client.batch_get_into`` / ``batch_get_ranges_into`` hand CUDA outs whose page lies on a same-host (shm) node to
``DeviceCopier.read``: the node's mapped arena is registered with CUDA once per client (``devkernel.register_host``,
reference counted process-wide; the client gives its references back on close), every range becomes one segment
``(arena address, tensor address, length)`` of one kernel launch per device, one wait per device. Headers are checked
before the launch and again after the wait, like shm's torn-read check: a slot rewritten meanwhile raises
``CorruptionError`` (what landed in the tensor is then garbage). Pages on other nodes, machines without CUDA or CuPy,
arenas CUDA refuses to register, and clients with payload checksums on (the checksum is computed on the host) keep
the staged path (``umbp.buffers.CudaOut``).

Puts (``DeviceBatch`` + ``DeviceCopier.write``): payloads in device memory (CUDA values of ``batch_put`` /
``batch_put_ranges``, the KV slot rows of ``LayerwiseLoader.store``) are described as one segment table per put,
``(device address, length)`` per piece of each page. The put path (``umbp.puts``) ALLOCs as usual; the NEW places on
nodes this client reaches over shm with a registered arena are written here: every old header invalidated, one
kernel launch per device writing the payloads straight to ``arena + offset + OBJ_HEADER_SIZE``, one wait, then the
headers (``objformat.pack_object_header``, packed by the put path) written by the CPU, last; only then COMMIT. A failed
launch leaves its pages' headers invalid and reports them failed (the put path ABORTs them, never commits). Pages
placed elsewhere, and every page where the kernel cannot run (no CUDA or CuPy, checksums on), are staged to pinned
host memory by the batch's ``stager`` and written by their transport as before.

Layering: the kernel is ``umbp/devkernel.py`` (the engine's gather uses it too), which imports torch and CuPy only
when a CUDA out is seen. Cost per call: one registration per node per client (first time only), a segment table of
24 bytes per range, one launch and one synchronize per device.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

import numpy as np

from transport import objformat
from umbp import devkernel
from umbp.errors import CorruptionError, InvalidArgument, TransportError

# One kernel segment is at most 65535 thread blocks of 16 KiB (devkernel.CHUNK): longer device pieces are cut.
SEG_MAX = 256 << 20
Stager = Callable[[list], tuple[list, Callable[[], None]]]


class DeviceBatch:
    """The payloads of one put that lie in device memory, as one segment table.

    Page ``i`` of the put (``on_device[i]``) is ``nbytes[i]`` bytes on ``devices[dev[i]]``: the segments
    ``rows[i]`` of ``src`` (device addresses) / ``lens``, back to back (``rel``: each segment's offset in its page).
    ``stager(idxs)`` copies those pages to host memory: it returns (a list of flat byte views per page, a release
    callable); the put path calls release before it stages again. ``via[i]`` records how page i was last written
    (``VIA_KERNEL`` / ``VIA_STAGED``); ``keep`` holds whatever owns the device memory. Building is O(segments)."""

    VIA_NONE, VIA_KERNEL, VIA_STAGED = 0, 1, 2

    def __init__(self, n: int, pages: Sequence[int], counts: Sequence[int], src: np.ndarray, lens: np.ndarray,
                 page_dev: Sequence[int], devices: list, stager: Stager, keep: Any = None):
        pages_a = np.asarray(pages, dtype=np.int64).reshape(-1)
        counts_a = np.asarray(counts, dtype=np.int64).reshape(-1)
        self.src = np.ascontiguousarray(src, dtype=np.int64).reshape(-1)
        self.lens = np.ascontiguousarray(lens, dtype=np.int64).reshape(-1)
        if counts_a.shape != pages_a.shape or int(counts_a.sum()) != self.src.size or self.src.shape != self.lens.shape:
            raise InvalidArgument("client", "device batch: segment counts, sources and lengths disagree")
        if pages_a.size and (pages_a.min() < 0 or pages_a.max() >= n or np.unique(pages_a).size != pages_a.size):
            raise InvalidArgument("client", "device batch: page indices out of range or repeated")
        self.n = n
        self.on_device = np.zeros(n, dtype=bool)
        self.on_device[pages_a] = True
        self.row = np.full(n, -1, dtype=np.int64)
        self.row[pages_a] = np.arange(pages_a.size)
        self.ptr = np.concatenate([[0], np.cumsum(counts_a)]).astype(np.int64)
        cum = np.concatenate([[0], np.cumsum(self.lens)]).astype(np.int64)
        seg_row = np.repeat(np.arange(pages_a.size), counts_a)
        self.rel = cum[:-1] - cum[self.ptr[:-1]][seg_row]
        self.nbytes = np.zeros(n, dtype=np.int64)
        self.nbytes[pages_a] = cum[self.ptr[1:]] - cum[self.ptr[:-1]]
        self.dev = np.zeros(n, dtype=np.int64)
        self.dev[pages_a] = np.asarray(page_dev, dtype=np.int64).reshape(-1)
        self.devices = list(devices)
        self.stager = stager
        self.keep = keep
        self.via = np.zeros(n, dtype=np.int8)

    @classmethod
    def from_tensors(cls, n: int, tensors: dict[int, list[Any]], stager: Stager) -> "DeviceBatch":
        """Page ``i`` is the concatenation of the contiguous device tensors ``tensors[i]`` (all on one device)."""
        devices: list = []
        pages, counts, src, lens, page_dev = [], [], [], [], []
        for i, ts in tensors.items():
            dev = ts[0].device
            if dev not in devices:
                devices.append(dev)
            c = 0
            for t in ts:
                addr, nb = t.data_ptr(), t.numel() * t.element_size()
                for o in range(0, nb, SEG_MAX):
                    src.append(addr + o)
                    lens.append(min(SEG_MAX, nb - o))
                    c += 1
            pages.append(i)
            counts.append(c)
            page_dev.append(devices.index(dev))
        return cls(n, pages, counts, np.array(src, np.int64), np.array(lens, np.int64), page_dev, devices, stager,
                   keep=tensors)

    def segments(self, idxs: Sequence[int], dst: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                       np.ndarray]:
        """The segments of pages ``idxs`` written to ``dst[j]`` (page j's first byte): (src, dst, lens, device
        index) per segment, page after page."""
        rows = self.row[np.asarray(idxs, dtype=np.int64)]
        starts, ends = self.ptr[rows], self.ptr[rows + 1]
        counts = ends - starts
        total = int(counts.sum())
        first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        seg = np.repeat(starts - first, counts) + np.arange(total, dtype=np.int64)
        d = np.repeat(np.asarray(dst, dtype=np.int64), counts) + self.rel[seg]
        return self.src[seg], d, self.lens[seg], np.repeat(self.dev[np.asarray(idxs, dtype=np.int64)], counts)


class DeviceCopier:
    """The kernel path of one client. ``usable()`` says whether it can run here; ``arena_address(node, arena)``
    registers an arena once (None when CUDA refuses it: that node stays on the staged path); ``read(items)``
    moves the ranges. Tests replace ``launch`` and ``usable`` with doubles."""

    def __init__(self, component: str):
        self.component = component
        self._usable: bool | None = None
        self._arenas: dict[str, Any] = {}  # node id -> registered HostBuffer, or None when registration failed
        self.launches = 0  # kernel launches so far (observability, tests)

    def usable(self) -> bool:
        if self._usable is None:
            try:
                import torch

                self._usable = bool(torch.cuda.is_available()) and devkernel.cupy_available()
            except ModuleNotFoundError:  # no torch: nothing to say, the staged path serves CPU outs
                self._usable = False
            except Exception as e:  # a broken torch or CUDA install: the staged path still works, said once
                self._usable = False
                print(f"{self.component}: WARNING: the device copy kernel is off ({type(e).__name__}: {e}): CUDA "
                      f"pages take the staged path", file=sys.stderr, flush=True)
        return self._usable

    def arena_address(self, node_id: str, arena: memoryview) -> int | None:
        if node_id not in self._arenas:
            try:
                self._arenas[node_id] = devkernel.register_host(arena)
            except devkernel.GatherUnavailable:
                self._arenas[node_id] = None
        buf = self._arenas[node_id]
        return None if buf is None else buf.addr

    def launch(self, src: np.ndarray, dst: np.ndarray, lens: np.ndarray, device: Any) -> None:
        """One kernel launch over the segment table on ``device``'s current stream, then wait for it."""
        import torch

        devkernel.run_kernel(devkernel.Plan(src, dst, lens), device)
        torch.cuda.current_stream(device).synchronize()
        self.launches += 1

    def write(self, batch: DeviceBatch, places: list[tuple[int, memoryview, int, int, bytes]]) -> list:
        """Write device pages straight into mapped arenas. ``places``: (page index in ``batch``, arena, arena
        address, object offset, header) per NEW place. Old headers invalidated first, one launch per device (each
        waited for), then the headers. Returns None (written) or the error per place: a place outside its arena is
        a ``CorruptionError``, a failed launch a ``TransportError`` for every page of its device (their headers
        stay invalid; the caller aborts them)."""
        hs, lo = objformat.OBJ_HEADER_SIZE, objformat.ARENA_DATA_START
        results: list = [None] * len(places)
        ok = []
        for j, (i, arena, _base, off, _head) in enumerate(places):
            if off < lo or off + hs + int(batch.nbytes[i]) > len(arena):
                results[j] = CorruptionError(self.component, f"range {off}+{hs + int(batch.nbytes[i])} outside the "
                                                             f"arena of {len(arena)}")
            else:
                ok.append(j)
        if not ok:
            return results
        idxs = [places[j][0] for j in ok]
        src, dst, lens, devs = batch.segments(idxs, [places[j][2] + places[j][3] + hs for j in ok])
        for j in ok:  # a reader racing this write sees no valid header until the end
            _i, arena, _base, off, _head = places[j]
            arena[off:off + 4] = b"\0\0\0\0"
        failed: dict[int, Exception] = {}
        for d in np.unique(devs).tolist():
            m = devs == d
            try:
                self.launch(np.ascontiguousarray(src[m]), np.ascontiguousarray(dst[m]), np.ascontiguousarray(lens[m]),
                            batch.devices[d])
            except Exception as e:  # a CUDA error: those pages are not written, never committed
                err = TransportError(self.component, f"device write on {batch.devices[d]} failed: {e}")
                err.__cause__ = e
                failed[d] = err
        for j in ok:
            i, arena, _base, off, head = places[j]
            e = failed.get(int(batch.dev[i]))
            if e is not None:
                results[j] = e
                continue
            arena[off:off + hs] = head  # the header last: the payload is complete once the launch was waited for
            batch.via[i] = DeviceBatch.VIA_KERNEL
        return results

    def read(self, items: list[tuple[memoryview, int, int, int, int, int, int, Any, int]]) -> None:
        """``items``: (arena, arena address, object offset, key hash, generation, payload length, start, tensor,
        length) per range. Checks every header, launches once per device, checks the headers again."""
        hs = objformat.OBJ_HEADER_SIZE
        by_dev: dict[Any, list[tuple[int, int, int]]] = {}
        heads = []
        for arena, base, off, khash, gen, plen, start, tensor, length in items:
            head = bytes(arena[off:off + hs])
            objformat.check_object_header(head, self.component, khash, gen, plen)
            heads.append((arena, off, head))
            if length:
                by_dev.setdefault(tensor.device, []).append((base + off + hs + start, tensor.data_ptr(), length))
        for dev, segs in by_dev.items():
            a = np.array(segs, dtype=np.int64).reshape(-1, 3)
            self.launch(np.ascontiguousarray(a[:, 0]), np.ascontiguousarray(a[:, 1]),
                        np.ascontiguousarray(a[:, 2]), dev)
        for arena, off, head in heads:
            if arena[off:off + hs] != head:
                raise CorruptionError(self.component, f"slot at {off} rewritten during a device read (torn read)")

    def close(self) -> None:
        """Give back this client's arena registrations (before the arenas are unmapped)."""
        arenas, self._arenas = self._arenas, {}
        if not any(b is not None for b in arenas.values()):
            return
        for buf in arenas.values():
            if buf is not None:
                try:
                    devkernel.unregister_host(buf)
                except devkernel.HostRegistrationError:
                    pass  # logged by devkernel; the client is closing either way
