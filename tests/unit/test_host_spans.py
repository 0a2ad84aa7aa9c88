"""``umbp.buffers.HostSpans`` (pages at raw host addresses) and the SGLang backend's use of it
(``hostmem.object_spans``, ``Extents.check_all``): the spans equal the addresses and sizes of the views
``object_parts`` makes for one-run objects, layouts of several runs an object keep ``object_parts``, a span outside
the host pool's allocations is refused by name before any byte moves, and bad arrays are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from umbp.buffers import HostSpans
from umbp.errors import InvalidArgument
from umbp.integrations.sglang.hostmem import Extents, object_parts, object_spans, objects
from umbp.readbatch import out_addresses


def test_host_spans_checks_its_arrays_and_gives_views():
    pool = np.arange(64, dtype=np.uint8)
    s = HostSpans([pool.ctypes.data + 8, pool.ctypes.data], [4, 8])
    assert len(s) == 2 and s.addr.dtype == np.int64 and not s.addr.flags.writeable
    assert [bytes(v) for v in s.views()] == [bytes(range(8, 12)), bytes(range(8))]
    s.views()[0][:] = b"\xff" * 4  # writable views over the caller's memory
    assert pool[8:12].tolist() == [255] * 4
    for addr, n, what in (([1, 2], [1], "one length"), ([[1]], [1], "1-D"), ([1.5], [1], "integer"),
                          ([0], [1], "positive"), ([8], [-1], "non-negative")):
        with pytest.raises(InvalidArgument, match=f"client: HostSpans.*({what}|1-D integer arrays)"):
            HostSpans(addr, n)


def _pool_meta(n_pages: int, n_objects: int, obj: int, runs: int = 1):
    pool = torch.zeros(n_pages * n_objects * obj * 2, dtype=torch.uint8)
    rng = np.random.default_rng(3)
    slots = rng.permutation(2 * n_pages)[:n_pages]
    ptrs = []
    run = obj // runs
    for p in slots.tolist():
        for j in range(n_objects):
            for r in range(runs):
                ptrs.append(pool.data_ptr() + (p * n_objects + j) * obj + r * run)
    # SGLang lists a page's runs object by object for page_first; layer_first interleaves them (runs > 1)
    return pool, torch.tensor(ptrs, dtype=torch.int64), run


@pytest.mark.parametrize("sizes_as", ["int", "list", "one", "tensor"])
def test_object_spans_are_object_parts_addresses_for_one_run_objects(sizes_as):
    pool, ptrs, run = _pool_meta(16, 2, 8192)
    ex = Extents([pool])
    sizes = {"int": run, "list": [run] * len(ptrs), "one": [run], "tensor": torch.full((len(ptrs),), run)}[sizes_as]
    spans = object_spans(ptrs, sizes, 16, 2, ex)
    views = [p[0] for p in object_parts(ptrs, sizes, 16, 2, ex)]
    want = out_addresses(views, len(views))
    assert spans.addr.tolist() == want[0].tolist() and spans.nbytes.tolist() == want[1].tolist()
    assert type(objects(ptrs, sizes, 16, 2, ex)) is HostSpans


def test_several_runs_an_object_keep_object_parts():
    pool, ptrs, run = _pool_meta(4, 2, 8192, runs=4)
    ex = Extents([pool])
    assert object_spans(ptrs, run, 4, 2, ex) is None
    got = objects(ptrs, run, 4, 2, ex)
    assert type(got) is list and len(got) == 8


def test_a_span_outside_the_pool_is_refused_by_name():
    pool, ptrs, run = _pool_meta(8, 1, 4096)
    ex = Extents([pool])
    bad = ptrs.clone()
    bad[5] = pool.data_ptr() + pool.numel() - 100  # runs past the allocation's end
    with pytest.raises(InvalidArgument, match=r"sglang hicache: host page address 0x[0-9a-f]+\+4096 lies outside"):
        object_spans(bad, run, 8, 1, ex)
    bad[5] = pool.data_ptr() - 8192  # before it
    with pytest.raises(InvalidArgument, match="lies outside the host pool"):
        object_spans(bad, run, 8, 1, ex)
    assert object_spans(ptrs, run, 8, 1, ex) is not None


def test_host_spans_rows_of_a_host_pool_and_their_checks():
    pool = np.arange(6 * 16, dtype=np.uint8).reshape(6, 16)
    s = HostSpans.rows(pool, [4, 0, 5])
    assert [bytes(v) for v in s.views()] == [pool[4].tobytes(), pool[0].tobytes(), pool[5].tobytes()]
    t = torch.zeros((8, 4, 2), dtype=torch.float32)  # a row of 32 bytes
    ts = HostSpans.rows(t, torch.tensor([7, 1]))
    assert ts.addr.tolist() == [t.data_ptr() + 7 * 32, t.data_ptr() + 32] and ts.nbytes.tolist() == [32, 32]
    for pool_, ix, what in ((pool, [6], "outside the pool's 6 rows"), (pool, [-1], "outside"),
                            (pool, [[1]], "1-D integer"), (pool[:, ::2], [0], "C-contiguous"),
                            (np.zeros(8, np.uint8), [0], "2\\+ dims"), (t[:, :, 0], [0], "contiguous CPU tensor")):
        with pytest.raises(InvalidArgument, match=f"client: HostSpans.rows: .*{what}"):
            HostSpans.rows(pool_, ix)
