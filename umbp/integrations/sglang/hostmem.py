"""Byte views of SGLang host KV pool pages, for zero-copy puts and gets between the pool and a host pool.

SGLang describes where a page lives in a host pool with ``get_page_buffer_meta(indices) -> (ptrs, sizes)``: raw
addresses inside the pool's buffers. This module turns them into ``memoryview`` s the client writes from and reads
into directly (shm: one memcpy per part; RDMA: the host pool is registered, so the NIC reads and writes it).

Per page the meta lists ``k`` addresses, and the page becomes ``n`` objects (``naming.ObjectNaming.kv_suffixes``).
When ``k == n`` each object is one contiguous run (page_first, page_first_direct, page_head). When ``k`` is a
multiple of ``n`` the object is gathered from ``k / n`` runs, object ``j`` taking addresses ``j, j+n, j+2n, ...``:
layer_first, where SGLang lists per layer K then V (MHA) or the latent (MLA), so object K is the concatenation of
every layer's K run. When the runs are evenly spaced (they are in SGLang's layer_first pools) the object is one
``umbp.buffers.Rows``, written and read as one strided copy per object over shm (one view per run elsewhere); else
the client writes the parts back to back (``batch_put_ranges``) and reads them with one ranged read per part
(``batch_get_ranges_into``), never joining them in a temporary buffer.

Invariant: every view lies inside one of the pool's own buffers (checked before any byte moves), so a wrong index
or a meta bug raises ``InvalidArgument`` instead of writing over unrelated memory. Cost: O(addresses) Python work
per batch, no copies.
"""

from __future__ import annotations

import bisect
from typing import Any, Sequence

import numpy as np

from umbp.buffers import HostSpans, Rows, view_at
from umbp.errors import InvalidArgument

COMPONENT = "sglang hicache"


def pool_buffers(host_pool: Any) -> list[Any]:
    """Every non-empty physical tensor of a host pool (``get_hybrid_pool_buffer`` where it exists)."""
    getter = getattr(host_pool, "get_hybrid_pool_buffer", None)
    buffers = getter() if getter is not None else None
    if not buffers:
        buffers = [getattr(host_pool, "kv_buffer", None)]
    flat = []
    for b in buffers:
        if b is None:
            continue
        for t in (b if isinstance(b, (list, tuple)) else [b]):
            if t is not None and t.numel() > 0:
                flat.append(t)
    return flat


class Extents:
    """The address ranges of a pool's buffers (whole allocations), for bounds checks."""

    def __init__(self, buffers: Sequence[Any]):
        spans = set()
        for t in buffers:
            st = t.untyped_storage()
            spans.add((int(st.data_ptr()), int(st.data_ptr()) + int(st.nbytes())))
        self.spans = sorted(spans)
        self._starts = [s for s, _ in self.spans]
        self._starts_a = np.array(self._starts, np.int64)  # (``check_all``)
        self._ends_a = np.array([e for _, e in self.spans], np.int64)
        self._views: list[memoryview | None] = [None] * len(self.spans)

    def allocations(self) -> list[tuple[int, int]]:
        """(address, length) of each distinct allocation, for ``Client.register_buffer``."""
        return [(s, e - s) for s, e in self.spans]

    def check(self, ptr: int, size: int) -> int:
        """The index of the allocation holding ``[ptr, ptr + size)``; InvalidArgument when none does."""
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0 or size < 0 or ptr + size > self.spans[i][1]:
            raise InvalidArgument(COMPONENT, f"host page address 0x{ptr:x}+{size} lies outside the host pool's "
                                             f"buffers (bad host indices?)")
        return i

    def check_all(self, ptrs: Any, sizes: Any) -> None:
        """``check`` of every ``[ptrs[i], ptrs[i] + sizes[i])`` (int64 arrays) at once: one search of the
        allocations' starts for the batch. InvalidArgument names the first span outside them."""
        i = self._starts_a.searchsorted(ptrs, "right") - 1
        bad = (i < 0) | (sizes < 0) | (ptrs + sizes > self._ends_a[np.maximum(i, 0)])
        if bad.any():
            j = int(bad.argmax())
            self.check(int(ptrs[j]), int(sizes[j]))  # raises, with the span named

    def view(self, ptr: int, size: int) -> memoryview:
        """A writable byte view of ``[ptr, ptr + size)``, checked: a slice of its allocation's one view (a slice
        costs a fifth of a fresh ctypes view, and a layer_first page is 2 x layers of them)."""
        i = self.check(ptr, size)
        whole = self._views[i]
        if whole is None:
            start, end = self.spans[i]
            whole = self._views[i] = view_at(start, end - start)
        off = ptr - self._starts[i]
        return whole[off:off + size]


def object_parts(ptrs: Sequence[int], sizes: Sequence[int] | int, n_pages: int, n_objects: int,
                 extents: Extents | None) -> list[list[Any]]:
    """Group the meta of ``n_pages`` pages into ``n_pages * n_objects`` objects (page-major), each a list of views
    whose concatenation is the object; an object of equal runs at one stride (layer_first) is one
    ``umbp.buffers.Rows`` instead, copied over shm as one strided copy rather than one op per run."""
    if isinstance(sizes, int):
        sizes = [sizes] * len(ptrs)
    elif len(sizes) == 1 and len(ptrs) > 1:
        sizes = list(sizes) * len(ptrs)
    if len(sizes) != len(ptrs) or n_pages <= 0 or len(ptrs) % n_pages:
        raise InvalidArgument(COMPONENT, f"buffer meta of {len(ptrs)} addresses and {len(sizes)} sizes does not "
                                         f"split into {n_pages} pages")
    per_page = len(ptrs) // n_pages
    if per_page % n_objects:
        raise InvalidArgument(COMPONENT, f"{per_page} addresses per page do not split into {n_objects} objects")
    ptrs = ptrs.tolist() if hasattr(ptrs, "tolist") else ptrs  # a tensor's items one by one cost a microsecond each
    sizes = sizes.tolist() if hasattr(sizes, "tolist") else sizes
    view = extents.view if extents is not None else view_at
    out: list[list[Any]] = []
    k = per_page // n_objects
    for p in range(n_pages):
        base = p * per_page
        for j in range(n_objects):
            if k > 1:
                r = _rows(ptrs, sizes, base + j, n_objects, k, view)
                if r is not None:
                    out.append([r])
                    continue
            out.append([view(int(ptrs[a]), int(sizes[a])) for a in range(base + j, base + per_page, n_objects)])
    return out


def objects(ptrs: Any, sizes: Any, n_pages: int, n_objects: int, extents: Extents | None
            ) -> HostSpans | list[list[Any]]:
    """A batch's objects as the client takes them: ``object_spans`` where every object is one run, else
    ``object_parts``."""
    spans = object_spans(ptrs, sizes, n_pages, n_objects, extents)
    return spans if spans is not None else object_parts(ptrs, sizes, n_pages, n_objects, extents)


def object_spans(ptrs: Any, sizes: Any, n_pages: int, n_objects: int, extents: Extents | None) -> HostSpans | None:
    """``object_parts`` as ``umbp.buffers.HostSpans`` when every object is one run (a page's meta lists one
    address an object: page_first layouts), checked against ``extents`` in one pass: no view an object. None when
    an object has several runs (layer_first: ``object_parts`` makes those ``Rows``)."""
    a = _ints(ptrs)
    if not n_pages or len(a) != n_pages * n_objects:
        return None
    if isinstance(sizes, int):
        n = np.full(len(a), sizes, np.int64)
    else:
        n = _ints(sizes)
        if len(n) == 1:
            n = np.repeat(n, len(a))
        if len(n) != len(a):
            return None
    if extents is not None:
        extents.check_all(a, n)
    return HostSpans(a, n)


def _ints(x: Any) -> np.ndarray:
    """A flat int64 array of a tensor, an array or a sequence of ints (SGLang's buffer meta comes as any of them)."""
    return np.asarray(x.numpy() if hasattr(x, "numpy") else x, np.int64).reshape(-1)


def _rows(ptrs: Sequence[int], sizes: Sequence[int], first: int, step: int, k: int, view) -> Rows | None:
    """The ``k`` runs ``ptrs[first::step]`` as one ``Rows`` when they are equal and evenly spaced, ascending and
    not overlapping (one view over them all: checked to lie in one allocation); None otherwise."""
    p0, n = int(ptrs[first]), int(sizes[first])
    stride = int(ptrs[first + step]) - p0
    if stride < n:
        return None
    for r in range(1, k):
        a = first + r * step
        if int(ptrs[a]) != p0 + r * stride or int(sizes[a]) != n:
            return None
    return Rows(view(p0, (k - 1) * stride + n), n, stride, k)


def flat_byte_view(value: Any, what: str, writable: bool = False) -> memoryview:
    """A flat byte view of a CPU tensor or buffer. A non-contiguous tensor is copied when only read (``writable``
    False) and refused as a destination, where a copy would swallow the bytes."""
    mod = getattr(value, "__module__", "") or ""
    if mod.startswith("torch") or type(value).__name__ == "Tensor":
        import torch

        t = value.detach()
        if t.device.type != "cpu":
            raise InvalidArgument(COMPONENT, f"{what} is on {t.device}; the HiCache path moves host memory only")
        if not t.is_contiguous():
            if writable:
                raise InvalidArgument(COMPONENT, f"{what} is not contiguous; it cannot be filled in place")
            t = t.contiguous()
        return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")
    try:
        mv = memoryview(value)
    except TypeError:
        raise InvalidArgument(COMPONENT, f"{what} of type {type(value).__name__} is not a tensor or a buffer") \
            from None
    if writable and mv.readonly:
        raise InvalidArgument(COMPONENT, f"{what} is read-only")
    return mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv


def split_equal(view: memoryview, pieces: int, what: str) -> list[memoryview]:
    if pieces <= 0 or len(view) % pieces:
        raise InvalidArgument(COMPONENT, f"{what}: {len(view)} bytes do not split into {pieces} equal objects")
    n = len(view) // pieces
    return [view[i * n:(i + 1) * n] for i in range(pieces)]
