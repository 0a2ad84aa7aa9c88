"""The node's disk arena (umbp/node/disk.py): batched aligned transfers byte-exact across sizes, offsets, views and
worker counts; the superblock across reopen (same id) and a change of capacity (a new id); ranges; the buffered
fallback where O_DIRECT is refused; buffer reuse."""

from __future__ import annotations

import os
import random

import pytest

from transport import answerrows, objformat, wire
from umbp.errors import ConfigError
from umbp.node.disk import ALIGN, Buffers, DiskArena, Job

CAP = 64 << 20
HS = objformat.OBJ_HEADER_SIZE


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "node.disk")  # the test machine's disk (ext4 here: O_DIRECT on)


def layout(rng: random.Random, sizes: list[int]) -> list[int]:
    """Disjoint aligned offsets for extents of ``sizes``, in a shuffled order with gaps."""
    offs, at = [], objformat.DISK_DATA_START
    for n in sizes:
        at += rng.choice((0, ALIGN, 3 * ALIGN))
        offs.append(at)
        at += objformat.align_up(n)
    assert at <= objformat.DISK_DATA_START + CAP
    return offs


@pytest.mark.parametrize("threads", [1, 4])
def test_many_extents_round_trip_byte_exact(path, threads):
    rng = random.Random(threads)
    d = DiskArena(path, CAP, threads)
    try:
        sizes = [ALIGN, 2 * ALIGN, 64 << 10, (1 << 20) + ALIGN, 3 * ALIGN, 1 << 20, 5 * ALIGN, (2 << 20) + ALIGN] * 3
        offs = layout(rng, sizes)
        datas = [rng.randbytes(n) for n in sizes]
        jobs = []
        for off, data in zip(offs, datas):
            buf = d.buffers.get(len(data))
            buf[:] = data
            if len(data) > ALIGN and rng.random() < 0.5:  # several views in one pwritev: header block + the rest
                jobs.append(Job(True, off, [memoryview(buf)[:ALIGN], memoryview(buf)[ALIGN:]]))
            else:
                jobs.append(Job(True, off, [buf]))
        assert all(j.error is None for j in d.wait(jobs))
        order = list(range(len(sizes)))
        rng.shuffle(order)
        reads = [Job(False, offs[i], [d.buffers.get(sizes[i])]) for i in order]
        assert all(j.error is None for j in d.wait(reads))
        for i, j in zip(order, reads):
            assert bytes(j.views[0]) == datas[i], (i, sizes[i], offs[i])
        # a ranged read at an aligned offset inside an extent
        i = sizes.index((2 << 20) + ALIGN)
        part = d.wait([Job(False, offs[i] + 5 * ALIGN, [d.buffers.get(7 * ALIGN)])])[0]
        assert bytes(part.views[0]) == datas[i][5 * ALIGN:12 * ALIGN]
        assert d.stats["bytes_written"] == sum(sizes) and d.stats["errors"] == 0
    finally:
        d.close()


def test_reopen_keeps_id_and_bytes_another_capacity_starts_afresh(path):
    d = DiskArena(path, CAP, 2)
    first = d.disk_id
    assert not d.reopened and len(first) == 16
    buf = d.buffers.get(ALIGN)
    buf[:] = b"x" * ALIGN
    d.wait([Job(True, objformat.DISK_DATA_START + ALIGN, [buf])])
    d.close()
    d = DiskArena(path, CAP, 2)
    try:
        assert d.reopened and d.disk_id == first
        got = d.wait([Job(False, objformat.DISK_DATA_START + ALIGN, [d.buffers.get(ALIGN)])])[0]
        assert bytes(got.views[0]) == b"x" * ALIGN
    finally:
        d.close()
    d = DiskArena(path, CAP // 2, 2)  # another capacity: another disk (its pages are nobody's)
    try:
        assert not d.reopened and d.disk_id != first and os.path.getsize(path) == objformat.DISK_DATA_START + CAP // 2
    finally:
        d.close()
    with open(path, "r+b") as fh:  # not a disk arena at all (a superblock overwritten)
        fh.write(b"garbage!" * 8)
    d = DiskArena(path, CAP // 2, 2)
    try:
        assert not d.reopened
        assert objformat.unpack_disk_superblock(os.pread(os.open(path, os.O_RDONLY), ALIGN, 0)) == (d.disk_id, CAP // 2)
    finally:
        d.close()


def test_check_refuses_ranges_outside_the_data_region(path):
    d = DiskArena(path, 1 << 20, 1)
    try:
        start, end = objformat.DISK_DATA_START, objformat.DISK_DATA_START + (1 << 20)
        assert d.check(start, 1 << 20) is None and d.check(end - ALIGN, ALIGN) is None
        for off, n in ((0, ALIGN), (start + 1, ALIGN), (end - ALIGN, 2 * ALIGN), (start, -1), (end, ALIGN)):
            assert d.check(off, n) is not None and d.check(off, n) != "", (off, n)
        assert "integers" in d.check("1", 2)
    finally:
        d.close()


def test_buffered_fallback_when_o_direct_is_refused(path, monkeypatch, capsys):
    real = os.open

    def no_direct(p, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real(p, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    d = DiskArena(path, 1 << 20, 1)
    try:
        assert not d.direct
        out = capsys.readouterr().out.strip().splitlines()
        assert len(out) == 1 and "WARNING" in out[0] and path in out[0] and "O_DIRECT" in out[0]
        buf = d.buffers.get(ALIGN)
        buf[:] = b"y" * ALIGN
        d.wait([Job(True, objformat.DISK_DATA_START, [buf])])
        assert os.pread(real(path, os.O_RDONLY), ALIGN, objformat.DISK_DATA_START) == b"y" * ALIGN
    finally:
        d.close()


def test_a_failed_transfer_is_its_jobs_error_not_the_batchs(path):
    d = DiskArena(path, 1 << 20, 2)
    try:
        ok = Job(False, objformat.DISK_DATA_START, [d.buffers.get(ALIGN)])
        bad = Job(False, d.size, [d.buffers.get(ALIGN)])  # past the end of the file: no progress
        d.wait([ok, bad])
        assert ok.error is None and isinstance(bad.error, OSError) and d.stats["errors"] == 1
    finally:
        d.close()


def test_buffers_are_aligned_and_reused_up_to_the_limit():
    b = Buffers(keep=3 * ALIGN)
    x = b.get(100)
    assert len(x) == ALIGN
    b.put(x)
    assert b.get(ALIGN) is x  # the same size comes back
    big = [b.get(2 * ALIGN) for _ in range(2)]
    for y in big:
        b.put(y)
    assert b.free_bytes == 2 * ALIGN  # the second one was over the limit: dropped
    with pytest.raises(ConfigError):
        DiskArena("/proc/no-such-dir/x.disk", 1 << 20, 1)


# ---- the order of a DEMOTE's writes (umbp/node/tiering.py), in process: the node's handler over a fake transport ----

class _Transport:
    def __init__(self):
        self.out: list = []
        self.sent = None  # an asyncio.Event, set on each write

    def writelines(self, bufs):
        self.out.append(b"".join(bytes(b) for b in bufs))
        self.sent.set()

    def get_write_buffer_size(self):
        return 0

    def is_closing(self):
        return False


def _answer(tr: _Transport):
    head = tr.out.pop(0)
    _op, _flags, status, _rid, meta_len, data_len = wire.decode_header(head, "t")
    meta = wire.unpack_meta(head[wire.HEADER_SIZE:wire.HEADER_SIZE + meta_len], "t") if meta_len else None
    return status, meta, head[wire.HEADER_SIZE + meta_len:]


def _node(tmp_path):
    from umbp.config import NodeConfig
    from umbp.node.server import DataProtocol, NodeServer

    node = NodeServer(NodeConfig(capacity=8 << 20, arena_dir=str(tmp_path), disk=str(tmp_path / "d.disk"),
                                 disk_capacity=8 << 20, disk_threads=2))
    conn = DataProtocol(node)
    conn.transport = _Transport()
    return node, conn


async def _request(conn, op, meta):
    import asyncio

    conn.transport.sent = asyncio.Event()
    conn.handle(wire.Frame(op, 0, 0, 7, meta, None, 0), None)
    conn.flush()
    await asyncio.wait_for(conn.transport.sent.wait(), 10)
    return _answer(conn.transport)


def test_demote_writes_the_header_last_and_a_failed_sync_leaves_no_valid_extent(tmp_path, monkeypatch):
    import asyncio

    node, conn = _node(tmp_path)
    plens = [100, 9000, 70_000]
    drams, disks, payloads, at = [], [], [], objformat.ARENA_DATA_START
    for i, n in enumerate(plens):
        payloads.append(bytes([i + 1]) * n)
        node.arena.view[at:at + HS + n] = objformat.pack_object_header(50 + i, 9, n) + payloads[-1]
        drams.append(at)
        disks.append(objformat.DISK_DATA_START + at)
        at += objformat.object_size(n)
    rows = {"rows": answerrows.pack_tier_rows([50, 51, 52], [9] * 3, plens, drams, disks)}
    events = []
    real_run, real_sync = node.disk.run, node.disk.sync
    monkeypatch.setattr(node.disk, "run", lambda jobs, done: (events.extend(
        ("write", j.offset, bytes(memoryview(j.views[0])[:HS])) for j in jobs if j.write), real_run(jobs, done)))
    monkeypatch.setattr(node.disk, "sync", lambda: (events.append(("sync",)), real_sync()))
    reads = [[objformat.DISK_BIT | d, 0, n, 50 + i, 9, n, b""] for i, (d, n) in enumerate(zip(disks, plens))]
    try:
        status, meta, _ = asyncio.run(_request(conn, wire.Op.DEMOTE, rows))
        assert status == 0 and meta is None
        zero, heads = bytes(HS), [objformat.pack_object_header(50 + i, 9, n) for i, n in enumerate(plens)]
        assert [e[0] for e in events] == ["write"] * 3 + ["sync"] + ["write"] * 3 + ["sync"]
        assert sorted(e[1:] for e in events[:3]) == sorted((d, zero) for d in disks)  # extents: no header yet
        assert sorted(e[1:] for e in events[4:7]) == sorted(zip(disks, heads))  # then the headers alone
        status, meta, data = asyncio.run(_request(conn, wire.Op.READV_DISK, reads))
        assert meta is None and data == b"".join(h + p for h, p in zip(heads, payloads))
        # the same batch over new objects, the first fdatasync failing (as a crash there would stop it): every row
        # failed, and no extent reads as valid, neither the new object nor the old one
        for i, (d, n) in enumerate(zip(drams, plens)):
            node.arena.view[d:d + HS + n] = objformat.pack_object_header(60 + i, 10, n) + bytes([9]) * n
        monkeypatch.setattr(node.disk, "sync", lambda: (_ for _ in ()).throw(OSError(5, "Input/output error")))
        rows = {"rows": answerrows.pack_tier_rows([60, 61, 62], [10] * 3, plens, drams, disks)}
        status, meta, _ = asyncio.run(_request(conn, wire.Op.DEMOTE, rows))
        assert [f[0] for f in meta] == [0, 1, 2] and all("sync failed" in f[2] for f in meta)
        new_reads = [[objformat.DISK_BIT | d, 0, n, 60 + i, 10, n, b""] for i, (d, n) in enumerate(zip(disks, plens))]
        status, meta, data = asyncio.run(_request(conn, wire.Op.READV_DISK, reads + new_reads))
        assert data == b"" and sorted(f[0] for f in meta) == list(range(6))
        assert {f[1] for f in meta} == {wire.Status.CORRUPT}
        assert node.tier.stats["demotions"] == 3 and node.tier.stats["demote_failures"] == 3
    finally:
        node.disk.close()
        node.arena.close()
