"""``umbp.buffers.views_at``: the per-page byte views of the array path's ReadOps (tcp, rdma, pages the shm arrays
leave to ``start_read``) and of ``HostSpans`` are slices of one view over the outs' span when they lie close
together, one view each otherwise: either way each view starts at its out's address, holds exactly its bytes, and
writes land there only."""

from __future__ import annotations

import numpy as np

from umbp.buffers import views_at as _views


def _address(v: memoryview) -> int:
    return np.frombuffer(v, np.uint8).ctypes.data


def test_rows_of_one_out_are_slices_at_their_addresses():
    out = np.zeros((8, 1000), np.uint8)
    at = [out.ctypes.data + i * 1000 for i in range(8)]
    n = [1000, 10, 999, 0, 1000, 1, 500, 1000]
    views = _views(at, n)
    assert [len(v) for v in views] == n
    assert [_address(v) for v in views if len(v)] == [a for a, k in zip(at, n) if k]
    for i, v in enumerate(views):
        v[:] = bytes([i + 1]) * len(v)
    for i, k in enumerate(n):
        assert (out[i, :k] == i + 1).all() and (out[i, k:] == 0).all()


def test_outs_far_apart_get_a_view_each():
    a, b = np.zeros(4096, np.uint8), np.zeros(64 << 20, np.uint8)  # b's end lies far beyond a
    at = [a.ctypes.data, b.ctypes.data + (64 << 20) - 4096]
    views = _views(at, [4096, 4096])
    assert [_address(v) for v in views] == at
    views[0][:] = b"\1" * 4096
    views[1][:] = b"\2" * 4096
    assert (a == 1).all() and (b[-4096:] == 2).all() and not b[:-4096].any()
