"""CUDA tensors in the plain API: same-host pages moved by the gather kernel straight between the mapped arena and
the tensors (``DeviceCopier``), instead of a host memcpy into pinned staging plus an upload.

``Client.batch_get_into`` / ``batch_get_ranges_into`` hand CUDA outs whose page lies on a same-host (shm) node to
``DeviceCopier.read``: the node's mapped arena is registered with CUDA once per client (``gather.register_host``,
reference counted process-wide; the client gives its references back on close), every range becomes one segment
``(arena address, tensor address, length)`` of one kernel launch per device, one wait per device. Headers are checked
before the launch and again after the wait, like shm's torn-read check: a slot rewritten meanwhile raises
``CorruptionError`` (what landed in the tensor is then garbage). Pages on other nodes, machines without CUDA or CuPy,
arenas CUDA refuses to register, and clients with payload checksums on (the checksum is computed on the host) keep
the staged path (``umbp.buffers.CudaOut``).

Layering: this module imports ``umbp.engine.gather`` lazily, only when a CUDA out is seen; gather imports nothing of
the client. Cost per call: one registration per node per client (first time only), a segment table of 24 bytes per
range, one launch and one synchronize per device.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from transport import wire
from umbp.errors import CorruptionError


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

                from umbp.engine import gather

                self._usable = bool(torch.cuda.is_available()) and gather.cupy_available()
            except Exception:  # no torch, a broken CUDA install: the staged path still works
                self._usable = False
        return self._usable

    def arena_address(self, node_id: str, arena: memoryview) -> int | None:
        if node_id not in self._arenas:
            from umbp.engine import gather

            try:
                self._arenas[node_id] = gather.register_host(arena)
            except gather.GatherUnavailable:
                self._arenas[node_id] = None
        buf = self._arenas[node_id]
        return None if buf is None else buf.addr

    def launch(self, src: np.ndarray, dst: np.ndarray, lens: np.ndarray, device: Any) -> None:
        """One kernel launch over the segment table on ``device``'s current stream, then wait for it."""
        import torch

        from umbp.engine import gather

        gather.run_kernel(gather.Plan(src, dst, lens), device)
        torch.cuda.current_stream(device).synchronize()
        self.launches += 1

    def read(self, items: list[tuple[memoryview, int, int, int, int, int, int, Any, int]]) -> None:
        """``items``: (arena, arena address, object offset, key hash, generation, payload length, start, tensor,
        length) per range. Checks every header, launches once per device, checks the headers again."""
        hs = wire.OBJ_HEADER_SIZE
        by_dev: dict[Any, list[tuple[int, int, int]]] = {}
        heads = []
        for arena, base, off, khash, gen, plen, start, tensor, length in items:
            head = bytes(arena[off:off + hs])
            wire.check_object_header(head, self.component, khash, gen, plen)
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
        from umbp.engine import gather

        for buf in arenas.values():
            if buf is not None:
                try:
                    gather.unregister_host(buf)
                except gather.HostRegistrationError:
                    pass  # logged by gather; the client is closing either way
