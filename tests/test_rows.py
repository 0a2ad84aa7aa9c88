"""``umbp.buffers.Rows`` outs (a page laid row by row at a fixed stride: a layer_first host page's K or V): the
descriptor's checks, ``copies.Stream.add_rows`` exact bytes, and reads into Rows on real node processes, one op per
page over shm and one per row over tcp, exact bytes, gaps untouched, payload checksums and torn slots still caught.
The pool tests share the module's one-node cluster (``shared_cluster``), each in a namespace of its own."""

from __future__ import annotations

import numpy as np
import pytest

from transport import shm, tcp
from umbp import copies
from umbp.buffers import Rows
from umbp.errors import CorruptionError, InvalidArgument

ROW, STRIDE, COUNT = 6000, 9000, 12  # rows not 4 KiB aligned, gaps of 3,000 bytes


def _rand(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _rows_of(buf: np.ndarray, n: int = COUNT * ROW) -> bytes:
    """The first ``n`` bytes laid in ``buf``'s rows, joined."""
    out = b"".join(buf[r * STRIDE:r * STRIDE + ROW].tobytes() for r in range(COUNT))
    return out[:n]


def _gaps_untouched(buf: np.ndarray, n: int, fill: int) -> bool:
    """Every byte of ``buf`` outside the first ``n`` bytes of rows still holds ``fill``."""
    mask = np.ones(len(buf), bool)
    for r in range(COUNT):
        k = max(0, min(ROW, n - r * ROW))
        mask[r * STRIDE:r * STRIDE + k] = False
    return bool((buf[mask] == fill).all())


def test_rows_refuses_overlap_out_of_bounds_and_bad_values():
    buf = np.zeros(STRIDE * (COUNT - 1) + ROW, np.uint8)
    r = Rows(buf, ROW, STRIDE, COUNT)
    assert len(r) == COUNT * ROW and r.views()[-1].nbytes == ROW and len(r.views(ROW + 1)) == 2
    with pytest.raises(InvalidArgument, match="rows overlap"):
        Rows(buf, ROW, ROW - 1, 2)
    with pytest.raises(InvalidArgument, match="the base holds"):
        Rows(buf[:-1], ROW, STRIDE, COUNT)
    for bad in (0, -3, 2.0, None):
        with pytest.raises(InvalidArgument, match="positive integer"):
            Rows(buf, bad, STRIDE, COUNT)
    with pytest.raises(InvalidArgument, match="read-only"):
        Rows(bytes(len(buf)), ROW, STRIDE, COUNT)


@pytest.mark.parametrize("threaded", [False, True])
@pytest.mark.parametrize("n", [COUNT * ROW, COUNT * ROW - 1, 5 * ROW + 17, ROW, 1])
def test_stream_add_rows_exact_bytes(threaded, n):
    """``Stream.add_rows`` lands the first n contiguous bytes row by row (full rows as strided runs, a partial last
    row as a plain piece), on the calling thread or across threads; nothing else in the buffer changes."""
    saved = copies.SERIAL_BYTES, copies.MIN_BYTES_PER_THREAD
    if threaded:
        copies.SERIAL_BYTES, copies.MIN_BYTES_PER_THREAD = 0, 1
        copies.set_max_threads(4)
    try:
        src = _rand(COUNT * ROW, 3)
        dst = np.full(STRIDE * COUNT, 0xAB, np.uint8)
        stream = copies.Stream(n)
        stream.chunk = 2 * ROW  # jobs of two rows each when threaded
        stream.add_rows(copies.address(dst), STRIDE, copies.address(src), ROW, ROW, n)
        stream.finish()
        assert _rows_of(dst, n) == src[:n].tobytes()
        assert _gaps_untouched(dst, n, 0xAB)
        if threaded and n > 4 * ROW:
            assert len(stream.futures) >= 2, "the rows went to the threads in several jobs"
        back = np.full(COUNT * ROW + 8, 0xCD, np.uint8)  # and the other way: rows gathered back to back (puts)
        again = copies.Stream(n)
        again.chunk = 2 * ROW
        again.add_rows(copies.address(back), ROW, copies.address(dst), STRIDE, ROW, n)
        again.finish()
        assert back[:n].tobytes() == src[:n].tobytes() and (back[n:] == 0xCD).all()
    finally:
        copies.SERIAL_BYTES, copies.MIN_BYTES_PER_THREAD = saved
        copies.set_max_threads(None)


def _count_ops(monkeypatch, cls) -> list:
    """Record how many ops each ``start_read`` of transport class ``cls`` gets."""
    seen: list = []
    real = cls.start_read

    def spy(self, ops, deadline):
        seen.append(len(ops))
        return real(self, ops, deadline)

    monkeypatch.setattr(cls, "start_read", spy)
    return seen


ONE_NODE = pytest.mark.cluster(nodes=1, capacity="64MiB")


@pytest.mark.shared_cluster
@ONE_NODE
@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("threaded", [False, True])
def test_get_into_rows_one_op_per_page_over_shm_per_row_over_tcp(cluster, monkeypatch, transport, threaded):
    if threaded:
        monkeypatch.setattr(copies, "SERIAL_BYTES", 0)
        monkeypatch.setattr(copies, "MIN_BYTES_PER_THREAD", 1)
        copies.set_max_threads(4)
    try:
        pages = [_rand(COUNT * ROW, 10 + i) for i in range(6)]
        pages[5] = pages[5][:3 * ROW + 11]  # a shorter payload fills the first rows only
        keys = [f"rows/{transport}/{i}" for i in range(len(pages))]
        seen = _count_ops(monkeypatch, shm.ShmTransport if transport == "shm" else tcp.TcpTransport)
        with cluster.client(transport=transport) as c:
            assert c.batch_put(keys, pages) == [True] * len(keys)
            bufs = [np.full(STRIDE * COUNT, 0x11, np.uint8) for _ in keys]
            outs = [Rows(b, ROW, STRIDE, COUNT) for b in bufs]
            got = c.batch_get_into(keys + ["rows/missing"], outs + [Rows(bytearray(ROW), ROW, ROW, 1)])
            assert got == [len(p) for p in pages] + [-1]
            for b, p in zip(bufs, pages):
                assert _rows_of(b, len(p)) == p.tobytes()
                assert _gaps_untouched(b, len(p), 0x11)
            per_page = [1] * len(pages) if transport == "shm" else [-(-len(p) // ROW) for p in pages]
            assert seen[-1] == sum(per_page), f"{transport}: {seen[-1]} ops for {len(pages)} pages"
            # a payload bigger than the rows is refused before any byte moves
            small = np.full(STRIDE * COUNT, 0x22, np.uint8)
            with pytest.raises(InvalidArgument, match="holds"):
                c.batch_get_into(keys[:1], [Rows(small, ROW - 1, STRIDE, COUNT)])
            assert (small == 0x22).all()
            assert set(c.transport_names().values()) == {transport}
    finally:
        copies.set_max_threads(None)


@pytest.mark.shared_cluster
@ONE_NODE
def test_rows_over_shm_checksums_and_torn_slots_still_fail(cluster, monkeypatch):
    """A Rows read of a whole payload is checked against the writer's payload checksum (a flipped payload byte is a
    CorruptionError, not bytes), and a slot rewritten while the rows are copied is a torn read."""
    page = _rand(COUNT * ROW, 5)
    with cluster.client(transport="shm", checksum=True) as c:
        assert c.put("rows/csum", page)
        buf = np.zeros(STRIDE * COUNT, np.uint8)
        assert c.get_into("rows/csum", Rows(buf, ROW, STRIDE, COUNT)) == len(page)
        assert _rows_of(buf) == page.tobytes()
        (t,) = c._transports.values()
        (off,) = [o for (o, _k, _g) in t._checked]
        pos = off + 64 + 5 * ROW + 7  # a payload byte in row 5
        t.arena[pos] ^= 0xFF
        with pytest.raises(CorruptionError, match="checksum"):
            c.get_into("rows/csum", Rows(buf, ROW, STRIDE, COUNT))
        t.arena[pos] ^= 0xFF
        good = t.arena[off:off + 64].tobytes()
        real = shm.copies.Stream.finish

        def rewrite_then_copy(stream):
            bad = bytearray(good)
            bad[16] ^= 0x01  # another generation holds the slot now
            t.arena[off:off + 64] = bytes(bad)
            return real(stream)

        monkeypatch.setattr(copies, "SERIAL_BYTES", 0)  # the stream path, where the rewrite hook sits
        monkeypatch.setattr(copies, "MIN_BYTES_PER_THREAD", 1)
        monkeypatch.setattr(shm.copies.Stream, "finish", rewrite_then_copy)
        with pytest.raises(CorruptionError, match="torn"):
            c.get_into("rows/csum", Rows(buf, ROW, STRIDE, COUNT))
        monkeypatch.setattr(shm.copies.Stream, "finish", real)
        t.arena[off:off + 64] = good
        buf[:] = 0
        assert c.get_into("rows/csum", Rows(buf, ROW, STRIDE, COUNT)) == len(page)
        assert _rows_of(buf) == page.tobytes()


@pytest.mark.shared_cluster
@ONE_NODE
@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("checksum", [False, True])
def test_put_from_rows_exact_bytes(cluster, monkeypatch, transport, checksum):
    """A page stored from Rows (its rows back to back), alone or among other parts, reads back exactly with a plain
    get; over shm without checksums the rows go to the copy threads as strided runs (one ``add_rows`` per Rows)."""
    monkeypatch.setattr(copies, "SERIAL_BYTES", 0)
    monkeypatch.setattr(copies, "MIN_BYTES_PER_THREAD", 1)
    calls: list = []
    real = copies.Stream.add_rows

    def spy(self, *a):
        calls.append(a)
        return real(self, *a)

    monkeypatch.setattr(copies.Stream, "add_rows", spy)
    bufs = [np.full(STRIDE * COUNT, 0x33, np.uint8) for _ in range(4)]
    for i, b in enumerate(bufs):
        for r in range(COUNT):
            b[r * STRIDE:r * STRIDE + ROW] = _rand(ROW, 100 * i + r)
    want = [_rows_of(b) for b in bufs]
    keys = [f"rows/put/{transport}/{checksum}/{i}" for i in range(4)]
    with cluster.client(transport=transport, checksum=checksum) as c:
        assert c.batch_put(keys[:2], [Rows(b, ROW, STRIDE, COUNT) for b in bufs[:2]]) == [True, True]
        assert c.batch_put_ranges(keys[2:], [[b"head", Rows(b, ROW, STRIDE, COUNT), b"tail"] for b in bufs[2:]]) \
            == [True, True]
        assert c.get(keys[0]) == want[0] and c.get(keys[1]) == want[1]
        assert c.get(keys[2]) == b"head" + want[2] + b"tail" and c.get(keys[3]) == b"head" + want[3] + b"tail"
        assert all((b[r * STRIDE + ROW:(r + 1) * STRIDE] == 0x33).all() for b in bufs for r in range(COUNT - 1))
        assert set(c.transport_names().values()) == {transport}
    assert len(calls) == (4 if transport == "shm" and not checksum else 0)
