"""The per-page read path's planning (``Client._get``: bytearrays, ``Rows``, CUDA outs, ranged reads, ``get``),
moved out of ``umbp/client.py``: ``read_ops`` turns a LOOKUP answer's ``locs`` and the outs into each node's
``ReadOp`` list (bounds checked against the outs; CUDA outs of pages on same-host nodes become gather-kernel items),
and ``read_ahead`` reads remembered locations while the LOOKUP is in flight (``umbp/speculate.py``). Both are bound
as ``Client`` methods (``Client._read_ops``, ``Client._read_ahead``) and read the client's transports, speculation
cache and metaserver layer as the methods did. The array path of ``batch_get_into`` is ``umbp/readbatch.py``.

Costs: a ReadOp and a few checks a page (a ``Rows`` out on a transport that does not take rows: one op per row).
"""

from __future__ import annotations

import time
from typing import Any

from transport import objformat, wire
from transport.base import ReadOp
from umbp.buffers import CudaOut, Rows, new_bytes
from umbp.errors import InvalidArgument, TransportError, UmbpError
from umbp.readbatch import DISK, row_ops
from umbp.speculate import read_deadline


def read_ahead(self, lookup: dict, guess: list, segs: list, deadline: float) -> tuple[Any, list]:
    """Submit the LOOKUP, read the remembered locations ``guess`` into the outs while it is in flight, then
    take its answer. Returns (the answer, per key the bytes read ahead or None: not remembered or failed); the
    caller keeps only pages whose answer names the location read (``Speculation.settle``)."""
    ticket = self._meta.submit(wire.Op.LOOKUP, lookup, deadline)
    early: list[int | None] = [None] * len(guess)
    try:
        try:
            batches, index, _fresh, _kern = self._read_ops(guess, segs, deadline)
            nbytes = sum(op.length for ops in batches.values() for op in ops)
            results = self._run(batches, "read", read_deadline(deadline, time.monotonic(), nbytes))
        except UmbpError:  # e.g. a remembered size the out no longer fits: the plain read decides
            results = {}
        failed = set()
        for node_id, res in results.items():
            if not any(res):  # every read ahead succeeded (the usual case)
                for op, i in zip(batches[node_id], index[node_id]):
                    early[i] = (early[i] or 0) + op.length
                continue
            if any(isinstance(r, TransportError) for r in res):  # silent or gone: read it only when named again
                self._spec.cache.forget_node(node_id)
            for op, i, r in zip(batches[node_id], index[node_id], res):
                if r is None:
                    early[i] = (early[i] or 0) + op.length
                else:
                    failed.add(i)
        for i in failed:
            early[i] = None
        return self._meta.result(ticket, deadline), early
    except BaseException:
        self._meta.forget([ticket])
        raise



def read_ops(self, locs: list, segs: list | None, deadline: float, kernel: dict | None = None
             ) -> tuple[dict[str, list[ReadOp]], dict[str, list[int]], list, list]:
    """The read ops of a LOOKUP answer, by node (and the page index of each op), checked against the outs; CUDA
    outs of pages on ``kernel`` nodes become ``(page index, DeviceCopier.read item)`` instead; a ``Rows`` out
    is one op where the node's transport reads rows, else one op per row."""
    kern: list = []
    kernel = kernel or {}
    batches: dict[str, list[ReadOp]] = {}
    index: dict[str, list[int]] = {}
    fresh: list[Any] = [None] * len(locs)
    for i, loc in enumerate(locs):
        if loc is None:
            continue
        node_id, off, size, gen, khash, cap = loc
        if off & objformat.DISK_BIT:  # on the node's disk tier: its own transport (READV_DISK over TCP)
            node_id += DISK
        ops = batches.get(node_id)
        if ops is None:
            ops = batches[node_id] = []
            index[node_id] = []
        idx = index[node_id]
        if segs is None:
            fresh[i], view = new_bytes(size)
            ops.append(ReadOp(off, 0, size, khash, gen, size, view, cap))
            idx.append(i)
            continue
        page = segs[i]
        if len(page) == 1:  # the common shape (batch_get_into): the whole payload into one flat host view
            start, length, dest = page[0]
            if length < 0 and type(dest) is memoryview:
                if len(dest) < size:
                    raise InvalidArgument(self.component, f"out 0 of key {i} holds {len(dest)} bytes but "
                                                          f"{size} are to be read")
                ops.append(ReadOp(off, 0, size, khash, gen, size, dest, cap))
                idx.append(i)
                continue
        for j, (start, length, dest) in enumerate(page):
            if length < 0:
                start, length = 0, size
            if type(dest) is CudaOut and node_id in kernel:
                if start + length > size or dest.nbytes < length:
                    raise InvalidArgument(self.component, f"range {j} of key {i} ({start}+{length}) does not "
                                                          f"fit the page's {size} bytes or the out's {dest.nbytes}")
                arena, base = kernel[node_id]
                kern.append((i, (arena, base, off, khash, gen, size, start, dest.tensor, length)))
                continue
            view = dest.view if type(dest) is CudaOut else dest
            if start + length > size:
                raise InvalidArgument(self.component, f"range {j} of key {i} ({start}+{length}) lies "
                                                      f"outside the page's {size} bytes")
            if len(view) < length:
                raise InvalidArgument(self.component, f"out {j} of key {i} holds {len(view)} bytes "
                                                      f"but {length} are to be read")
            if type(view) is Rows and not self._reads_rows(node_id, deadline):
                got = row_ops(off, start, view, length, khash, gen, size, cap)
                ops.extend(got)
                idx.extend([i] * len(got))
                continue
            ops.append(ReadOp(off, start, length, khash, gen, size, view, cap))
            idx.append(i)
    if kern:  # nodes whose every range went to the kernel have no transport work
        batches = {n: ops for n, ops in batches.items() if ops}
    return batches, index, fresh, kern
