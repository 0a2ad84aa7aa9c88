"""Threaded host copies (``umbp.copies``): exact bytes for many shapes of source and destination, errors of one job
surfacing in the caller, the deadline bound, the thread sizing; and the shm transport moving a batch big enough to be
split across threads, checked byte for byte on real node processes. The one-node pool tests of 64 MiB share the
module's cluster (``shared_cluster``), each in a namespace of its own. CUDA outs: tests/test_copies_cuda.py."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from umbp import copies
from umbp.errors import DeadlineExceeded, InvalidArgument


@pytest.fixture
def threaded():
    """Every batch threaded (cut-over at 0 bytes, 4 threads, small pieces) so that small test batches exercise the
    pool; restored afterwards."""
    saved = copies.SERIAL_BYTES, copies.MIN_BYTES_PER_THREAD, copies.PIECE_BYTES
    copies.SERIAL_BYTES, copies.MIN_BYTES_PER_THREAD, copies.PIECE_BYTES = 0, 1, 64 << 10
    copies.set_max_threads(4)
    try:
        yield
    finally:
        copies.SERIAL_BYTES, copies.MIN_BYTES_PER_THREAD, copies.PIECE_BYTES = saved
        copies.set_max_threads(None)


def _rand(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def one_node(test):
    """The module's shared one-node pool of 64 MiB for ``test`` (its ``cluster`` argument)."""
    return pytest.mark.shared_cluster(pytest.mark.cluster(nodes=1, capacity="64MiB")(test))


@pytest.mark.parametrize("sizes", [[1], [3, 0, 5], [65536] * 7, [1 << 20, 17, (1 << 20) + 3], [300_001] * 5])
def test_threaded_copy_moves_exact_bytes_numpy_and_offsets(threaded, sizes):
    srcs = [_rand(n + 11, i)[11:] for i, n in enumerate(sizes)]  # views at an odd offset
    backing = [np.full(n + 64, 0xAB, np.uint8) for n in sizes]
    dsts = [b[7:7 + n + 3] for b, n in zip(backing, sizes)]  # 3 bytes longer than the source: left untouched
    assert copies.copy_pairs(list(zip(dsts, srcs))) == sum(sizes)
    for b, s, n in zip(backing, srcs, sizes):
        assert b[7:7 + n].tobytes() == s.tobytes()
        assert (b[:7] == 0xAB).all() and (b[7 + n:] == 0xAB).all()


def test_threaded_copy_memoryviews_bytes_and_2d_arrays(threaded):
    src_bytes = _rand(200_000, 1).tobytes()
    src_2d = _rand(64 * 4096, 2).reshape(64, 4096)
    dst_ba = bytearray(200_000)
    dst_mv = memoryview(bytearray(64 * 4096 + 100))[50:50 + 64 * 4096]
    copies.copy_pairs([(dst_ba, src_bytes), (dst_mv, src_2d)])
    assert bytes(dst_ba) == src_bytes
    assert dst_mv.tobytes() == src_2d.tobytes()


def test_threaded_copy_torch_tensors(threaded):
    torch = pytest.importorskip("torch", reason="torch is not installed in this venv: torch tensors not exercised")
    src = torch.randn(3, 1000, 33, dtype=torch.float32).to(torch.bfloat16)
    dst = torch.zeros_like(src)
    half = torch.arange(0, 100_000, dtype=torch.int16)
    dst_half = torch.zeros(100_000 + 10, dtype=torch.int16)[10:]
    copies.copy_pairs([(dst, src), (dst_half, half)])
    assert torch.equal(dst.view(torch.int16), src.view(torch.int16))
    assert torch.equal(dst_half, half)


def test_threaded_copy_splits_across_threads(threaded):
    seen: set = set()
    real = copies._memmove_all

    def spy(pieces, stop=None):
        seen.add(threading.get_ident())
        time.sleep(0.001)  # work that takes time, as a real piece's copy does: a finished thread is not reused at once
        return real(pieces, stop)

    copies._memmove_all = spy
    try:
        src = _rand(4 << 20, 3)
        dst = np.zeros_like(src)
        copies.copy_pairs([(dst, src)])
    finally:
        copies._memmove_all = real
    assert np.array_equal(dst, src)
    assert len(seen) >= 2, "a 4 MiB batch with 4 threads allowed ran on one thread"


def test_bad_pairs_are_refused_before_any_byte_moves(threaded):
    dst = bytearray(10)
    with pytest.raises(InvalidArgument, match="copies: pair 1: destination of 4 bytes for 5"):
        copies.copy_pairs([(dst, b"0123456789"), (bytearray(4), b"abcde")])
    assert dst == bytearray(10)
    with pytest.raises(InvalidArgument, match="read-only"):
        copies.copy_pairs([(b"xxxx", b"abcd")])
    with pytest.raises(InvalidArgument, match="does not support the buffer protocol"):
        copies.copy_pairs([(bytearray(4), object())])


def _stream_of_jobs(n_jobs: int, src: np.ndarray, dst: np.ndarray):
    """A Stream of ``n_jobs`` pool jobs of one 64 KiB piece each (8 bytes apart: not merged) and a 4 KiB remainder
    that finish() copies on the caller (4 threads allowed)."""
    stream = copies.Stream(n_jobs * 65536 + 4096, keep=(src, dst))  # a late job writes memory that still exists
    stream.chunk = 65536 - 8  # one job per piece
    for j in range(n_jobs):
        stream.add(copies.address(dst) + j * 65536, copies.address(src) + j * 65536, 65536 - 8)
    stream.add(copies.address(dst) + n_jobs * 65536, copies.address(src) + n_jobs * 65536, 4096)
    assert len(stream.futures) == n_jobs
    return stream


def test_error_in_one_job_surfaces_after_the_others_finish(threaded, monkeypatch):
    """A Stream job that raises: finish() re-raises it only once every other job has finished (they write into
    the caller's buffers), and the others' bytes are all in place."""
    finished = []
    real = copies._memmove_all
    bad_addr = []

    def job(items, stop=None):
        if items[0][0] == bad_addr[0]:  # the second 64 KiB piece's job fails
            raise InvalidArgument("copies", "job failed")
        if items[0][2] != 4096:  # not the caller's remainder
            time.sleep(0.02)  # work, not synchronisation: the failing job must not cut the others short
        finished.append(real(items, stop))
        return finished[-1]

    monkeypatch.setattr(copies, "_memmove_all", job)
    src, dst = _rand(4 * 65536 + 4096, 9), np.zeros(4 * 65536 + 4096, np.uint8)
    bad_addr.append(copies.address(dst) + 65536)
    stream = _stream_of_jobs(4, src, dst)
    with pytest.raises(InvalidArgument, match="job failed"):
        stream.finish()
    assert len(finished) == 4 and all(f.done() for f in stream.futures)  # 3 good jobs and the remainder
    for j in (0, 2, 3):
        assert np.array_equal(dst[j * 65536:(j + 1) * 65536 - 8], src[j * 65536:(j + 1) * 65536 - 8]), j
    assert not dst[65536:2 * 65536].any()


def test_stream_is_bounded_by_its_deadline_and_writes_nothing_after_it(threaded, monkeypatch):
    """Review 4.9: past its deadline a Stream raises DeadlineExceeded, and from then on no copy of it writes into
    the caller's buffers (a caller that reuses a host-pool slot after the error must not have it overwritten
    later). A slow job (5 ms a piece, 64 pieces) against a 0.1 s deadline: finish raises within about a piece of the
    deadline, part of the bytes never arrive, and the buffer does not change after the raise."""
    real = copies._memmove_all

    def slow(items, stop=None):
        n = 0
        for it in items:
            if stop is not None and stop[0]:
                break
            time.sleep(0.005)  # work, not synchronisation: a copy slow enough to outlive the deadline
            n += real([it])
        return n

    monkeypatch.setattr(copies, "_memmove_all", slow)
    piece, pieces = 4096, 64
    src, dst = _rand(piece * 3 * pieces, 10), np.zeros(piece * 3 * pieces, np.uint8)
    stream = copies.Stream(pieces * piece, deadline=time.monotonic() + 0.1, keep=(src, dst))
    stream.chunk = pieces * piece  # one job of every piece
    for p in range(pieces):  # unevenly spaced: neither merged nor one strided run (``copies._runs``)
        at = (3 * p + p % 2) * piece
        stream.add(copies.address(dst) + at, copies.address(src) + at, piece)
    assert len(stream.futures) == 1
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="copies: 1 of 1 copy jobs not done at the deadline"):
        stream.finish()
    print(f"\nfinish raised {time.monotonic() - t0:.3f} s after it was called (deadline 0.1 s, 0.32 s of copies)")
    after = dst.copy()
    time.sleep(0.4)  # longer than the rest of the job would take: any late write would show
    assert np.array_equal(dst, after), "a copy wrote into the caller's buffer after finish raised"
    assert not np.array_equal(dst, src) and stream.futures[0].done()


def test_thread_sizing():
    copies.set_max_threads(8)
    try:
        assert copies.threads_for(copies.SERIAL_BYTES - 1) == 1
        assert copies.threads_for(1 << 30) == 8
        assert 1 <= copies.threads_for(copies.SERIAL_BYTES) <= 8
        assert copies.threads_for(copies.SERIAL_BYTES) <= copies.SERIAL_BYTES // copies.MIN_BYTES_PER_THREAD
    finally:
        copies.set_max_threads(None)
    assert 1 <= copies.max_threads() <= copies.MAX_THREADS
    with pytest.raises(InvalidArgument, match="copies: max threads"):
        copies.set_max_threads(0)


def test_sharing_cores_leaves_cores_to_other_work_on_this_thread_only():
    copies.set_max_threads(4)
    seen = []
    try:
        with copies.sharing_cores(1):
            assert copies.threads_for(1 << 30) == 3
            with copies.sharing_cores(5):
                assert copies.threads_for(1 << 30) == 1  # never fewer than one
            assert copies.threads_for(1 << 30) == 3
            t = threading.Thread(target=lambda: seen.append(copies.threads_for(1 << 30)))
            t.start()
            t.join()
        assert copies.threads_for(1 << 30) == 4 and seen == [4]
    finally:
        copies.set_max_threads(None)


@pytest.fixture
def shared(monkeypatch):
    """``copy_shared`` splits every batch of two pieces or more with its helper thread, whatever the cores."""
    monkeypatch.setattr(copies, "SHARE_BYTES", 0)
    monkeypatch.setattr(copies, "_limit", copies.SHARE_THREADS)  # set_max_threads, undone after the test


def _pieces(sizes: list[int], seed: int):
    """Sources and 0xAB-filled destinations (each inside a bigger buffer, a guard either side) of ``sizes``, and
    their raw (dst, src, n) lists."""
    srcs = [_rand(n + 5, seed + i)[5:] for i, n in enumerate(sizes)]
    backing = [np.full(n + 32, 0xAB, np.uint8) for n in sizes]
    d = [b.ctypes.data + 16 for b in backing]
    return srcs, backing, d, [x.ctypes.data for x in srcs], list(sizes)


@pytest.mark.parametrize("sizes", [[4096] * 2, [65536] * 64, [3, 0, 70_001, 1 << 20, 5]])
def test_copy_shared_moves_exact_bytes_with_the_helper(shared, sizes):
    srcs, backing, d, s, n = _pieces(sizes, 7)
    seq = copies._helper.seq if copies._helper is not None else 0
    copies.copy_shared(d, s, n, sum(n))
    assert copies._helper.seq == seq + 1  # the helper took its share
    for b, x, k in zip(backing, srcs, sizes):
        assert b[16:16 + k].tobytes() == x.tobytes() and (b[:16] == 0xAB).all() and (b[16 + k:] == 0xAB).all()


def test_copy_shared_stays_on_the_calling_thread_below_its_cut_overs(monkeypatch):
    """Below SHARE_BYTES, or with fewer than SHARE_THREADS cores to run on, the helper gets nothing."""
    seq = copies._helper.seq if copies._helper is not None else 0
    for limit, share in ((copies.SHARE_THREADS - 1, 0), (copies.SHARE_THREADS, 1 << 30)):
        monkeypatch.setattr(copies, "_limit", limit)
        monkeypatch.setattr(copies, "SHARE_BYTES", share)
        srcs, backing, d, s, n = _pieces([8192] * 8, 11)
        copies.copy_shared(d, s, n, sum(n))
        assert all(b[16:16 + 8192].tobytes() == x.tobytes() for b, x in zip(backing, srcs))
    assert (copies._helper.seq if copies._helper is not None else 0) == seq


def test_copy_shared_from_several_threads_at_once_exact_bytes(shared):
    """Batches of four threads at once: one has the helper at a time, the others copy alone; every byte exact."""
    errors: list = []

    def one(seed: int) -> None:
        try:
            for r in range(30):
                srcs, backing, d, s, n = _pieces([16384 + seed] * 16, 100 * seed + r)
                copies.copy_shared(d, s, n, sum(n))
                for b, x in zip(backing, srcs):
                    assert b[16:16 + len(x)].tobytes() == x.tobytes()
                    assert (b[:16] == 0xAB).all() and (b[16 + len(x):] == 0xAB).all()
        except BaseException as e:  # noqa: BLE001 - reported by the test's thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)


def test_copy_shared_raises_the_helpers_error_after_both_halves_are_done(shared, monkeypatch):
    """An error on the helper thread reaches the caller, once the calling thread's own half is copied; the next batch
    takes its own answer (not the failed one's) and copies exact bytes."""
    main = threading.get_ident()
    real = copies._memmove

    def failing(d, s, k):
        if threading.get_ident() != main:
            raise OSError("helper failed")
        return real(d, s, k)

    srcs, backing, d, s, n = _pieces([4096] * 8, 3)
    monkeypatch.setattr(copies, "_memmove", failing)
    with pytest.raises(OSError, match="helper failed"):
        copies.copy_shared(d, s, n, sum(n))
    assert all(b[16:16 + 4096].tobytes() == x.tobytes() for b, x in list(zip(backing, srcs))[4:])  # its own half
    monkeypatch.setattr(copies, "_memmove", real)
    srcs, backing, d, s, n = _pieces([4096] * 8, 4)
    copies.copy_shared(d, s, n, sum(n))
    assert all(b[16:16 + 4096].tobytes() == x.tobytes() for b, x in zip(backing, srcs))


@one_node
def test_a_pipelined_put_leaves_a_core_to_the_allocs_and_commits(cluster, monkeypatch):
    """A batch_put of several chunks writes each chunk while other chunks' ALLOCs and COMMITs are served: its shm
    copies of small pages use one thread fewer than the cores (``copies.sharing_cores``); chunks of pages of
    ``puts.SHARE_BELOW_PAGE_BYTES`` and more, a one-chunk put and a get use all of them; every page exact."""
    from umbp import puts
    from transport import shm

    sizes: list[int] = []
    real = copies.threads_for
    monkeypatch.setattr(shm.copies, "threads_for", lambda n: sizes.append(real(n)) or sizes[-1])
    monkeypatch.setattr(copies, "SERIAL_BYTES", 0)
    monkeypatch.setattr(copies, "MIN_BYTES_PER_THREAD", 1)
    monkeypatch.setattr(puts, "CHUNK_MAX_PAGES", 8)
    copies.set_max_threads(4)
    try:
        n, size = 32, 64 << 10
        pages = [_rand(size, 300 + i) for i in range(n)]
        with cluster.client(transport="shm") as c:
            assert c.batch_put([f"pipe/{i}" for i in range(n)], pages) == [True] * n  # 4 chunks of 8
            assert sizes and set(sizes) == {3}  # every chunk's write (shm sizes its Stream by it, and so does Stream)
            sizes.clear()
            assert c.batch_put([f"one/{i}" for i in range(8)], pages[:8]) == [True] * 8  # one chunk
            assert sizes and set(sizes) == {4}
            sizes.clear()
            monkeypatch.setattr(puts, "SHARE_BELOW_PAGE_BYTES", size)  # pages this big are copy bound: every core
            assert c.batch_put([f"big/{i}" for i in range(n)], pages) == [True] * n  # 4 chunks of 8
            assert sizes and set(sizes) == {4}
            sizes.clear()
            outs = [np.zeros(size, np.uint8) for _ in range(n)]
            assert c.batch_get_into([f"pipe/{i}" for i in range(n)], outs) == [size] * n
            assert sizes and set(sizes) == {4}
            assert all(np.array_equal(o, p) for o, p in zip(outs, pages))
    finally:
        copies.set_max_threads(None)


def test_shm_batch_split_across_threads_exact_bytes(make_cluster):
    """A batch of 24 pages of 1 MiB + 4 KiB (above the cut-over) written and read over shm: every page exact, and
    the copies ran on more than one thread."""
    seen: set = set()
    real = copies._memmove_all

    def spy(pieces, stop=None):
        seen.add(threading.get_ident())
        time.sleep(0.001)  # work that takes time, as a real piece's copy does: a finished thread is not reused at once
        return real(pieces, stop)

    cluster = make_cluster(nodes=1, capacity="128MiB")
    copies.set_max_threads(4)
    copies._memmove_all = spy
    try:
        n, size = 24, (1 << 20) + 4096
        keys = [f"threaded/{i}" for i in range(n)]
        pages = [_rand(size, 100 + i) for i in range(n)]
        with cluster.client(transport="shm", checksum=True) as c:
            assert c.batch_put(keys, pages) == [True] * n
            assert len(seen) >= 2, "the put's copies ran on one thread"
            seen.clear()
            outs = [np.zeros(size, np.uint8) for _ in range(n)]
            assert c.batch_get_into(keys, outs) == [size] * n
            assert len(seen) >= 2, "the get's copies ran on one thread"
            for o, p in zip(outs, pages):
                assert np.array_equal(o, p)
            # ranges: the second half of each page, into views at an offset inside one big buffer
            big = np.zeros(n * (size // 2 + 8), np.uint8)
            views = [[big[i * (size // 2 + 8) + 8:(i + 1) * (size // 2 + 8)]] for i in range(n)]
            assert c.batch_get_ranges_into(keys, [[(size // 2, size // 2)]] * n, views) == [size // 2] * n
            for v, p in zip(views, pages):
                assert np.array_equal(v[0], p[size // 2:])
            assert c.transport_names() == {cluster.nodes[0].node_id: "shm"}
    finally:
        copies._memmove_all = real
        copies.set_max_threads(None)


@pytest.mark.parametrize("serial", [True, False])
def test_copy_pieces_raw_addresses_exact_bytes(threaded, serial):
    """copy_pieces moves raw (dst, src, n) pieces, on the calling thread below the cut-over and in pieces across
    threads above it; bytes exact, nothing outside the ranges touched."""
    if serial:
        copies.SERIAL_BYTES = 1 << 40
    sizes = [5, 65536, (1 << 20) + 3, 0, 300_001]
    srcs = [_rand(n + 3, 50 + i)[3:] for i, n in enumerate(sizes)]
    dst = np.full(sum(sizes) + 64, 0xCD, np.uint8)
    base, pos, pieces = copies.address(dst), 32, []
    for s, n in zip(srcs, sizes):
        pieces.append((base + pos, copies.address(s), n))
        pos += n
    assert copies.copy_pieces(pieces, sum(sizes)) == sum(sizes)
    assert dst[32:32 + sum(sizes)].tobytes() == b"".join(s.tobytes() for s in srcs)
    assert (dst[:32] == 0xCD).all() and (dst[32 + sum(sizes):] == 0xCD).all()
    ro = memoryview(bytes(range(256)) * 4)  # read-only: the numpy address path
    out = bytearray(1024)
    copies.copy_pieces([(copies.address(out), copies.address(ro), 1024)], 1024)
    assert bytes(out) == bytes(ro)


@pytest.mark.parametrize("direction", ["scatter", "gather"])
def test_evenly_spaced_pieces_copy_as_strided_runs_exact_bytes(threaded, direction):
    """Pieces of one length evenly spaced on one side and back to back on the other (a layer_first HiCache page:
    one page object's layers in the host pool, the object in the arena) go to the workers as strided runs, one
    numpy copy each instead of a memmove per piece; bytes exact both ways, the gaps between rows untouched, and a
    broken pattern (another length, an uneven step) splits the run."""
    n, rows, stride = 3000, 40, 5000  # rows of 3,000 bytes every 5,000
    spaced = np.full(rows * stride + 64, 0xEE, np.uint8)
    packed = np.full(rows * n + 64, 0xEE, np.uint8)
    src_rows = _rand(rows * n, 7)
    seen = []
    real = copies._memmove_all

    def spy(items, stop=None):
        seen.extend(items)
        return real(items, stop)

    if direction == "scatter":  # arena -> host pool (a get): packed source, spaced destination
        packed[:rows * n] = src_rows
        pieces = [(copies.address(spaced) + r * stride, copies.address(packed) + r * n, n) for r in range(rows)]
    else:  # host pool -> arena (a put)
        for r in range(rows):
            spaced[r * stride:r * stride + n] = src_rows[r * n:(r + 1) * n]
        pieces = [(copies.address(packed) + r * n, copies.address(spaced) + r * stride, n) for r in range(rows)]
    pieces[25] = (pieces[25][0], pieces[25][1], n - 1)  # another length: the run stops there
    copies._memmove_all = spy
    try:
        assert copies.copy_pieces(pieces, rows * n - 1) == rows * n - 1
    finally:
        copies._memmove_all = real
    runs = [p for p in seen if len(p) == 6]
    assert runs and sum(p[3] for p in runs) + sum(1 for p in seen if len(p) == 3) == rows
    assert max(p[3] for p in runs) > 2, "evenly spaced pieces went as runs of several rows"
    for r in range(rows):
        k = n - 1 if r == 25 else n
        got = spaced[r * stride:r * stride + k] if direction == "scatter" else packed[r * n:r * n + k]
        assert got.tobytes() == src_rows[r * n:r * n + k].tobytes(), r
    if direction == "scatter":  # the gaps between rows and the byte after row 25 keep their old bytes
        for r in range(rows):
            gap = spaced[r * stride + (n - 1 if r == 25 else n):(r + 1) * stride]
            assert (gap == 0xEE).all(), r
        assert (spaced[rows * stride:] == 0xEE).all()
    else:
        assert packed[25 * n + n - 1] == 0xEE and (packed[rows * n:] == 0xEE).all()


def test_stream_copies_while_pieces_come_and_finish_waits_for_all(threaded):
    """copies.Stream hands pieces to the threads as they are added (a job started before the last piece came) and
    cuts a long piece; finish() leaves every byte in place; abort() waits for started jobs and raises nothing."""
    sizes = [70_000] * 30 + [1 << 20]  # the last piece is cut into chunks
    srcs = [_rand(n, 200 + i) for i, n in enumerate(sizes)]
    dst = np.full(sum(sizes) + 32, 0x5A, np.uint8)
    total = sum(sizes)
    stream = copies.Stream(total)
    assert stream.workers == 4
    pos = 16
    started_before_the_end = False
    for s, n in zip(srcs, sizes):
        stream.add(copies.address(dst) + pos, copies.address(s), n)
        pos += n
        started_before_the_end = started_before_the_end or bool(stream.futures)
    assert started_before_the_end, "no job went to the threads before the last piece was added"
    stream.finish()
    assert dst[16:16 + total].tobytes() == b"".join(s.tobytes() for s in srcs)
    assert (dst[:16] == 0x5A).all() and (dst[16 + total:] == 0x5A).all()
    again = copies.Stream(total)
    dst[:] = 0
    again.add(copies.address(dst), copies.address(srcs[-1]), sizes[-1])
    again.abort()  # a caller failing midway: what was handed off has landed, what was pending is dropped
    assert all(f.done() for f in again.futures) and not again.pending


@one_node
def test_shm_header_memo_still_catches_a_changed_header(cluster):
    """The shm read remembers headers it checked; a header changed in place after that (another generation, a
    flipped crc byte, a shorter length) is still a CorruptionError, and the intact page reads exactly again."""
    from umbp.errors import CorruptionError

    with cluster.client(transport="shm") as c:
        page = _rand(70_000, 7)
        assert c.put("memo/0", page)
        out = np.zeros(70_000, np.uint8)
        for _ in range(2):  # the second read takes the memo path
            assert c.get_into("memo/0", out) == 70_000 and np.array_equal(out, page)
        (t,) = c._transports.values()
        (off,) = [o for (o, _k, _g) in t._checked]
        good = t.arena[off:off + 64].tobytes()
        for pos in (12, 16, 24, 36):  # key hash, generation, payload length, header crc
            bad = bytearray(good)
            bad[pos] ^= 0x01
            t.arena[off:off + 64] = bytes(bad)
            with pytest.raises(CorruptionError):
                c.get_into("memo/0", out)
            t.arena[off:off + 64] = good
            assert c.get_into("memo/0", out) == 70_000 and np.array_equal(out, page)


@one_node
def test_shm_ranges_of_one_object_share_one_header_check_and_a_torn_one_fails(cluster, threaded, monkeypatch):
    """The shm read checks an object's header once for all its consecutive ranges (a layer_first page: one range per
    layer), before and after the copy: a slot rewritten while its ranges are copied fails the read, the other
    page's ranges land exactly, and an undisturbed read of both is exact."""
    from transport import shm
    from umbp.errors import CorruptionError

    layers, run = 8, 16_384
    pages = {k: _rand(layers * run, i) for i, k in enumerate(("torn/a", "torn/b"))}
    real = shm.copies.Stream.finish
    with cluster.client(transport="shm") as c:
        assert c.batch_put(list(pages), list(pages.values())) == [True, True]
        (t,) = c._transports.values()
        keys = list(pages)
        ranges = [[(j * run, run) for j in range(layers)]] * 2
        spaced = [np.zeros((layers, 2 * run), np.uint8) for _ in keys]  # each range into every other run of bytes
        outs = [[s[j, :run] for j in range(layers)] for s in spaced]
        assert c.batch_get_ranges_into(keys, ranges, outs) == [layers * run] * 2
        for s, k in zip(spaced, keys):
            assert s[:, :run].tobytes() == pages[k].tobytes() and not s[:, run:].any()
        offs = sorted({o for (o, _k, _g) in t._checked})
        assert len(offs) == 2, "one header remembered per object, not per range"
        a_off = offs[0]
        good = t.arena[a_off:a_off + 64].tobytes()

        def rewrite_then_copy(stream):  # after every header was checked, while the copies run
            bad = bytearray(good)
            bad[16] ^= 0x01  # the generation: another object now holds the slot
            t.arena[a_off:a_off + 64] = bytes(bad)
            return real(stream)

        # the transport's own answer per range, from the locations the client remembers
        from transport.base import ReadOp
        from umbp.keys import normalize_key

        ops = []
        for k, s in zip(keys, spaced):
            _node, off, size, gen, tag, cap = c._spec.cache.get(normalize_key(k))
            ops += [ReadOp(off, j * run, run, tag, gen, size, memoryview(s[j, :run]), cap) for j in range(layers)]
        monkeypatch.setattr(shm.copies.Stream, "finish", rewrite_then_copy)
        results = t.finish(t.start_read(ops, time.monotonic() + 10), time.monotonic() + 10)
        monkeypatch.setattr(shm.copies.Stream, "finish", real)
        assert [type(r) for r in results[:layers]] == [CorruptionError] * layers, "every range of the torn object"
        assert all("torn read" in str(r) for r in results[:layers])
        assert results[layers:] == [None] * layers
        assert spaced[1][:, :run].tobytes() == pages["torn/b"].tobytes()
        with pytest.raises(CorruptionError, match="torn"):  # through the client: an error, never the bytes
            c.batch_get_ranges_into(keys, ranges, outs)
        t.arena[a_off:a_off + 64] = good
        for s in spaced:
            s[:] = 0
        assert c.batch_get_ranges_into(keys, ranges, outs) == [layers * run] * 2
        for s, k in zip(spaced, keys):
            assert s[:, :run].tobytes() == pages[k].tobytes()
