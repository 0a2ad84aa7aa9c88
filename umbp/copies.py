"""Host copies of a batch split across a small process-wide pool of threads: memory bandwidth, not one core's memcpy.

One core's memcpy moves a fraction of what a host's memory gives (on the 16-core H200 host about a fifth); the
shm transport, the client's staging and the HiCache backend's host-pool paths copy whole batches, so a batch's
copies are cut into jobs of about ``nbytes / threads_for(nbytes)`` for the pool's threads (the calling thread copies
what is left short of a job, and waits). Each piece is one ``ctypes.memmove`` (a strided run of equal pieces, one
numpy copy), which releases the GIL, so the threads copy in parallel.

Sizing: at most ``max_threads()`` threads (the cores this process may run on, capped at MAX_THREADS), and at least
MIN_BYTES_PER_THREAD bytes per thread; a batch below SERIAL_BYTES stays on the calling thread with plain memoryview
slice assignment (no handoff: a thread wake-up costs tens of microseconds, a 64 KiB copy a few), but for the shm read
batch's ``copy_shared``, which gives half of a batch from SHARE_BYTES to one helper thread. SERIAL_BYTES is
where the cut-over pays, measured on the 16-core H200 host (best of 15 batches over a 1 GiB working set): 64 KiB x64
(4 MiB) one thread 8.8 GB/s, threaded 4.6-5.6; 1 MiB x8 (8 MiB) 9.1 vs 17.6 (4 threads); 1 MiB x64 6.9 vs 38.7
(8-16 threads); 4 MiB x64 7.6 vs 42.2 (16 threads). On the shared 2-core machine 4 MiB batches threaded ran at a
third of one thread. With adjacent pieces merged (``Stream.add``) and ctypes address lookups, ``copy_pairs`` of
1 MiB x64 ran at 36.2 GB/s beside 42.1 for 16 plain threads of np.copyto in the same run (0.86x; 4 MiB x64: 40.9
vs 48.2; measured with the earlier up-front dealing into one share per thread).

Contracts:
- ``copy_pairs(pairs)`` copies ``len(src)`` bytes of each ``(dst, src)`` pair (flat byte memoryviews, or anything
  ``umbp.buffers`` views: numpy arrays, CPU tensors, bytearrays; dst writable and at least as long) and returns
  the bytes copied once every piece is done. Pairs must not overlap each other (pieces run in any order).
- ``Stream.finish`` re-raises the first exception a job raised once every job has finished, or raises
  ``DeadlineExceeded`` when the deadline passes first, after stopping every job: once it has raised, no copy of the
  batch writes into the caller's buffers any more (a job stops before its next piece; ``Stream._give_up``).
- After ``fork`` the child gets a fresh pool (threads do not survive a fork).

- ``copy_shared(dst, src, n, total)`` copies raw (dst address, src address, length) pieces of a batch below
  SERIAL_BYTES (the shm transport's ``read_rows``), from SHARE_BYTES on with one helper thread taking half of them:
  it returns, or raises the helper's error, only once both halves are done.
- ``Stream(total, deadline)`` copies raw (dst address, src address, length) pieces the caller has checked while the
  caller is still adding them (the shm transport's path: arena addresses from the mapping's base, no view per page,
  its per-range checks beside the copies); ``add_rows`` queues a ``umbp.buffers.Rows`` page as strided runs in one
  call; ``copy_pieces`` and ``copy_pairs`` are built on it.

Cost: below SERIAL_BYTES one memoryview assignment per pair (``copy_pieces``: one ``memmove``); above, one address
lookup per pair (ctypes for writable views, about 0.2 us; numpy for read-only ones, about 1 us), one ``memmove`` per
piece (PIECE_BYTES at most) or one numpy copy per strided run, and one future per ``total / threads`` bytes
(``JOBS_PER_THREAD``).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import ctypes
import os
import queue
import threading
import time
from typing import Any, Sequence

import numpy as np

from umbp.buffers import as_bytes_view, as_writable_view
from umbp.errors import DeadlineExceeded, InvalidArgument

COMPONENT = "copies"
MAX_THREADS = 16
SERIAL_BYTES = 8 << 20  # below this a batch is copied on the calling thread (bench/pool.py: threaded copy)
MIN_BYTES_PER_THREAD = 1 << 20
PIECE_BYTES = 4 << 20  # pieces of a long pair, so one big page splits across threads too
RUN_BYTES = 4 << 20  # at most this much in one strided run of equal, evenly spaced pieces (``_runs``)
# A batch's bytes go out as this many jobs per thread (``Stream``). Every job more is one more GIL hand-over among
# the pool's threads (tens of microseconds with 16 of them). 16-core H100 host, 1 MiB x64 (64 MiB) ``copy_pairs``,
# medians of 1 s, two rounds: 1 job a thread 37.2 / 35.8 GB/s, 2 jobs 27.6 / 26.0, 4 jobs 16.1 / 17.2, beside 16
# plain threads of np.copyto at 46.8 / 44.4; 256 KiB x64 10.8 / 11.3 against 7.7 / 8.2 (2 jobs); 4 MiB x64 the
# same either way (45.9). On the 2-core VM 1 or 2 made no difference beyond its noise (8.8-10.4 GB/s).
JOBS_PER_THREAD = 1
# ``copy_shared``: batches of SHARE_BYTES up to SERIAL_BYTES are split with one helper thread where the process may
# run on SHARE_THREADS cores or more (on 2 cores the other processes of a get, the metaserver's and the node's, need
# the second one); the helper takes HELPER_SHARE of the pieces (it starts a wake-up later than the calling thread).
# 16-core H100 host, shm gets of 64 pages (bench/getpath.py --quick, two alternating rounds against one thread):
# 64 KiB pages (4 MiB) 6.30-6.33 -> 7.85-7.99 GB/s; 32 KiB (2 MiB) 4.58-4.73 -> 3.96-4.67; 16 KiB (1 MiB) 3.29 ->
# 2.59-2.63: the hand-over costs about as much as half of a 2 MiB copy, so the split starts at 4 MiB.
SHARE_BYTES = 4 << 20
SHARE_THREADS = 4
HELPER_SHARE = 0.5
WAIT_S = 60.0  # default bound of one batch's copies (copies at even 1 GB/s finish a 60 GB batch in that)

_memmove = ctypes.memmove
_drain = collections.deque(maxlen=0).extend  # runs an iterator to its end, keeping nothing
_lock = threading.Lock()
_pool: cf.ThreadPoolExecutor | None = None
_limit: int | None = None  # set_max_threads override
_local = threading.local()  # .spare: cores this thread's batches leave to other work (``sharing_cores``)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def max_threads() -> int:
    """Threads a batch may use: the cores this process may run on, at most MAX_THREADS (or ``set_max_threads``)."""
    return _limit if _limit is not None else max(1, min(MAX_THREADS, _cores()))


def set_max_threads(n: int | None) -> None:
    """Cap the threads of every later batch (None: back to the cores); 1 turns threading off. For benchmarks and
    tests; the pool itself is rebuilt on the next batch that needs more threads than it has."""
    global _limit
    if n is not None and (not isinstance(n, int) or n < 1 or n > 256):
        raise InvalidArgument(COMPONENT, f"max threads must be an integer 1..256, got {n!r}")
    _limit = n


def threads_for(nbytes: int) -> int:
    """Threads for a batch of ``nbytes``: 1 below SERIAL_BYTES, else up to ``max_threads()`` (fewer inside
    ``sharing_cores``) with at least MIN_BYTES_PER_THREAD each."""
    if nbytes < SERIAL_BYTES:
        return 1
    cap = max_threads()
    if getattr(_local, "spare", 0):
        cap = max(1, cap - _local.spare)
    return max(1, min(cap, nbytes // MIN_BYTES_PER_THREAD))


class sharing_cores:
    """``with sharing_cores(n):`` batches copied by this thread meanwhile use ``n`` fewer threads than the cores
    (at least one): for copies that run while other work this call waits for needs a core on this host too. A
    pipelined ``batch_put`` writes its chunks this way while the metaserver (and etcd) serve the ALLOCs and COMMITs
    of the others: on the 2-core test machine a 64 KiB x1024 shm put with two copy threads wrote its 64 MiB in
    17-27 ms and took 48 ms, with one 9-12 ms and 32-46 ms (its metaserver, etcd and the copies on the same two
    cores). Chunks of big pages are copy bound and do not share (``puts.SHARE_BELOW_PAGE_BYTES``). Where cores are
    plenty it changes nothing that matters (16 cores: 15 threads, not 16)."""

    __slots__ = ("n", "prev")

    def __init__(self, n: int = 1):
        self.n = n

    def __enter__(self) -> "sharing_cores":
        self.prev = getattr(_local, "spare", 0)
        _local.spare = self.prev + self.n
        return self

    def __exit__(self, *exc) -> None:
        _local.spare = self.prev


def _executor(workers: int) -> cf.ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None or _pool._max_workers < workers:
            old, _pool = _pool, cf.ThreadPoolExecutor(max_workers=max(workers, max_threads()),
                                                       thread_name_prefix="umbp-copy")
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def _after_fork() -> None:
    global _pool, _helper
    _pool = None  # the parent's threads are not in the child; its executor object must not be used
    _helper = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def _flat(x: Any, writable: bool, i: int) -> memoryview:
    if type(x) is memoryview and x.format == "B" and x.ndim == 1 and x.c_contiguous:
        return x
    view = as_writable_view(x, "destination", i) if writable else as_bytes_view(x, "source", i)
    if type(view) is not memoryview:  # a CUDA tensor (CudaOut): not host memory
        view.release()
        raise InvalidArgument(COMPONENT, f"pair {i}: CUDA tensors are not host memory (use the gather kernel)")
    return view


_c_char = ctypes.c_char
_c_ubyte = ctypes.c_ubyte
_addressof = ctypes.addressof


def _address(mv: memoryview) -> int:
    """The address of a flat byte view's first byte: ctypes for writable views (a fifth of a microsecond), numpy
    for read-only ones (about a microsecond: ctypes refuses to export those)."""
    if not len(mv):
        return 0
    if not mv.readonly:
        return _addressof(_c_char.from_buffer(mv))
    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data)


address_of_view = _address  # for flat byte memoryviews already checked by the caller


def address(buf: Any) -> int:
    """The address of the first byte of a host buffer (anything ``umbp.buffers`` views): for callers that copy
    from or into a fixed mapping (the shm transport's arena) and compute the other side's addresses themselves."""
    return _address(_flat(buf, False, 0))


def _memmove_all(pieces: list[tuple], stop: list | None = None) -> int:
    """Copy a worker's share: ``(dst, src, n)`` pieces with one memmove each, ``(dst, src, n, rows, dst stride,
    src stride)`` runs with one strided numpy copy each (one GIL release for all its rows). ``stop``: a one-item
    list looked at before each piece; once true the rest is left uncopied (the stream was given up)."""
    n = 0
    for p in pieces:
        if stop is not None and stop[0]:
            break
        if len(p) == 3:
            _memmove(p[0], p[1], p[2])
            n += p[2]
        else:
            d, s, k, rows, ds, ss = p
            np.copyto(_strided(d, rows, k, ds), _strided(s, rows, k, ss))
            n += rows * k
    return n


def _job(runs: list[tuple], keep: Any, stop: list) -> int:
    """A pool thread's share of a ``Stream``; ``keep`` (unused) holds the memory its raw addresses point into;
    ``stop`` set: the stream was given up, copy no further piece."""
    return _memmove_all(runs, stop)


def _strided(addr: int, rows: int, n: int, stride: int) -> np.ndarray:
    """A (rows, n) uint8 array over raw memory: row r is ``[addr + r * stride, + n)`` (the caller keeps it alive)."""
    return np.ndarray((rows, n), np.uint8, buffer=(_c_ubyte * ((rows - 1) * stride + n)).from_address(addr),
                      strides=(stride, 1))


def _runs(flat: list[tuple[int, int, int]]) -> list[tuple]:
    """Coalesce consecutive pieces of one length whose destinations and sources each advance by one positive
    stride (at least the length: rows never overlap) into runs ``(dst, src, n, rows, dst stride, src stride)`` of at
    most RUN_BYTES (pieces contiguous on both sides are merged by ``Stream.add`` already). Why: a worker thread
    re-acquires the GIL after every memmove, and with many threads each hand-over of the GIL costs a thread wake-up
    (tens of microseconds): a layer_first HiCache page is 2 x layers pieces of 128 KiB, one page object's pieces
    evenly spaced in the host pool and back to back in the arena, and 16 threads copying them piece by piece moved
    3.4 GB/s on the H200 host where whole 4 MiB pieces moved 27."""
    out: list[tuple] = []
    i, m = 0, len(flat)
    while i < m:
        if len(flat[i]) != 3:  # a run already (``Stream.add_rows``)
            out.append(flat[i])
            i += 1
            continue
        d0, s0, n = flat[i]
        j = i + 1
        if j < m and len(flat[j]) == 3 and flat[j][2] == n and n < RUN_BYTES:
            ds, ss = flat[j][0] - d0, flat[j][1] - s0
            if ds >= n and ss >= n and (ds, ss) != (n, n):  # contiguous on both sides: one piece already
                limit = min(m, i + max(2, RUN_BYTES // n))
                while j < limit and len(flat[j]) == 3 and flat[j][2] == n and flat[j][0] == d0 + (j - i) * ds \
                        and flat[j][1] == s0 + (j - i) * ss:
                    j += 1
        rows = j - i
        out.append(flat[i] if rows == 1 else (d0, s0, n, rows, ds, ss))
        i = j
    return out


class _Helper:
    """One thread that copies a share of a mid-size batch (``copy_shared``) while the calling thread copies the
    rest: a queue in and a queue out, no futures. ``busy`` is held by the batch using it: a second thread's batch
    meanwhile copies alone rather than queue behind it."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.busy = threading.Lock()
        self.seq = 0  # jobs handed out; each answer names its job, so one left behind is never taken for another
        threading.Thread(target=self._run, name="umbp-copy-helper", daemon=True).start()

    def _run(self) -> None:
        jobs, done = self.jobs, self.done
        while True:
            seq, d, s, n = jobs.get()
            try:
                _drain(map(_memmove, d, s, n))
                done.put((seq, None))
            except BaseException as e:  # noqa: BLE001 - handed to the batch's thread, which raises it
                done.put((seq, e))


_helper: _Helper | None = None


def copy_shared(dst: list[int], src: list[int], n: list[int], total: int) -> None:
    """Copy ``n[i]`` bytes from address ``src[i]`` to ``dst[i]`` for every i (raw addresses the caller checked and
    keeps alive; pieces must not overlap), one ``memmove`` a piece in C (``map``), for batches below SERIAL_BYTES.
    From SHARE_BYTES on, on a machine of SHARE_THREADS cores or more, one helper thread copies the first
    ``HELPER_SHARE`` of the pieces while the calling thread copies the rest: each ``memmove`` drops the GIL, and
    between two of them a thread holds it for a fraction of a microsecond, so two threads rarely wait for each
    other (a pool thread a job, as ``Stream`` deals them, paid a future and a wake-up each: slower than one
    thread below SERIAL_BYTES). Returns once every piece is copied; re-raises the helper's error."""
    global _helper
    if total < SHARE_BYTES or len(n) < 2 or max_threads() < SHARE_THREADS:
        _drain(map(_memmove, dst, src, n))
        return
    h = _helper
    if h is None:
        with _lock:
            h = _helper = _helper or _Helper()
    if not h.busy.acquire(blocking=False):  # another thread's batch has it: copy alone
        _drain(map(_memmove, dst, src, n))
        return
    try:
        k = max(1, int(len(n) * HELPER_SHARE))
        h.seq = seq = h.seq + 1
        h.jobs.put((seq, dst[:k], src[:k], n[:k]))
        err: BaseException | None = None
        try:
            _drain(map(_memmove, dst[k:], src[k:], n[k:]))
        except BaseException as e:  # still wait for the helper: it writes into the caller's buffers
            err = e
        while True:  # a copy of a few MiB: bounded by the memory's speed
            try:
                got, fail = h.done.get()
            except BaseException as e:  # interrupted: the helper still writes into the caller's buffers
                err = err or e
                continue
            if got == seq:
                break
        if err is not None or fail is not None:
            raise err or fail
    finally:
        h.busy.release()


def copy_pieces(pieces: list[tuple[int, int, int]], total: int, deadline: float | None = None) -> int:
    """Copy raw ``(dst address, src address, length)`` pieces the caller has checked (the caller keeps their memory
    alive: nothing is checked here), through one ``Stream`` (threads when ``total`` reaches SERIAL_BYTES). Returns
    ``total``."""
    stream = Stream(total, deadline)
    for d, s, n in pieces:
        stream.add(d, s, n)
    stream.finish()
    return total


class Stream:
    """The copies of one batch, started while the caller is still planning the rest of it: raw ``(dst, src, n)``
    pieces come in batch order (``add``), and each time about ``total / threads`` bytes have come they go to a
    pool thread as one job (coalesced into strided runs, ``_runs``), so the Python that turns a batch's ops into
    pieces (the shm transport's per-range checks) runs beside the copies instead of before them. ``finish`` copies
    what is left on the calling thread and waits for every job. Past ``deadline`` it gives the stream up
    (``_give_up``: jobs not started are cancelled, running ones stop before their next piece, at most one piece of
    PIECE_BYTES each, and are waited for) and raises DeadlineExceeded: once ``finish`` or ``abort`` has returned or
    raised, no copy of this stream writes into the caller's buffers any more, so a caller may reuse them at once.
    ``abort`` (the caller failed midway) gives the stream up and raises nothing. Below SERIAL_BYTES nothing is
    handed off (``finish`` copies it all). The caller has checked every bound: nothing is checked here."""

    __slots__ = ("workers", "chunk", "pending", "nbytes", "futures", "pool", "deadline", "keep", "stop")

    def __init__(self, total: int, deadline: float | None = None, keep: Any = None):
        self.workers = threads_for(total)
        self.chunk = max(64 << 10, min(PIECE_BYTES, -(-total // (JOBS_PER_THREAD * self.workers))))
        self.pending: list[tuple[int, int, int]] = []
        self.nbytes = 0
        self.futures: list[cf.Future] = []
        self.pool = _executor(self.workers - 1) if self.workers > 1 else None
        self.deadline = time.monotonic() + WAIT_S if deadline is None else deadline
        self.keep = keep  # held by every job (``copy_pairs``' views): memory a job points into stays allocated
        self.stop = [False]  # set when the stream is given up: jobs copy no further piece

    def add(self, dst: int, src: int, n: int) -> None:
        """One more piece, in batch order. A piece continuing the previous one on both sides (rows of one array into
        rows of another) is merged into it: each ``memmove`` is a GIL release and re-acquire, and sixteen threads
        queueing for the GIL cost more than the copy of a small piece."""
        if n > self.chunk:  # a long piece is cut, so one big page spreads over the threads too
            step = self.chunk
            for off in range(0, n, step):
                self.add(dst + off, src + off, min(step, n - off))
            return
        pending = self.pending
        last = pending[-1] if pending else None
        if last is not None and len(last) == 3 and last[0] + last[2] == dst and last[1] + last[2] == src \
                and last[2] + n <= self.chunk:
            pending[-1] = (last[0], last[1], last[2] + n)
        else:
            pending.append((dst, src, n))
        self._took(n)

    def add_rows(self, dst: int, dst_stride: int, src: int, src_stride: int, row: int, n: int) -> None:
        """``n`` bytes as rows of ``row`` bytes: row r from ``src + r * src_stride`` to ``dst + r * dst_stride`` (a
        ``umbp.buffers.Rows`` on one side, contiguous bytes, stride ``row``, on the other), the last row cut short
        when ``n`` is not whole rows. Strided runs of up to a job's bytes, each one numpy copy, and the partial row
        as a plain piece: one call per page object, where one ``add`` per row cost the caller a Python op per row
        (a layer_first page object: one per layer)."""
        full, rest = divmod(n, row)
        if row >= self.chunk or full < 2:
            for r in range(full):
                self.add(dst + r * dst_stride, src + r * src_stride, row)
        else:
            per = max(2, self.chunk // row)
            for r in range(0, full, per):
                k = min(per, full - r)
                d, s = dst + r * dst_stride, src + r * src_stride
                self.pending.append((d, s, row, k, dst_stride, src_stride) if k > 1 else (d, s, row))
                self._took(k * row)
        if rest:
            self.add(dst + full * dst_stride, src + full * src_stride, rest)

    def _took(self, n: int) -> None:
        """Count ``n`` bytes just queued; a job's worth goes to a pool thread."""
        self.nbytes += n
        if self.pool is not None and self.nbytes >= self.chunk:
            self.futures.append(self.pool.submit(_job, _runs(self.pending), self.keep, self.stop))
            self.pending, self.nbytes = [], 0

    def finish(self) -> None:
        first: BaseException | None = None
        try:
            if self.pending:
                _memmove_all(_runs(self.pending) if self.pool is not None else self.pending)
        except BaseException as e:  # still wait for the jobs: they write into the caller's buffers
            first = e
        self.pending = []
        _done, not_done = cf.wait(self.futures, timeout=max(0.0, self.deadline - time.monotonic()))
        if not_done:
            self._give_up(not_done)
            raise DeadlineExceeded(COMPONENT, f"{len(not_done)} of {len(self.futures)} copy jobs not done at the "
                                              f"deadline (stopped: none writes any more)")
        for f in self.futures:
            e = f.exception()
            if e is not None and first is None:
                first = e
        if first is not None:
            raise first

    def abort(self) -> None:
        self.pending = []
        self._give_up(self.futures)

    def _give_up(self, futures) -> None:
        """Stop every job: those not started never run, running ones stop before their next piece. Blocks until
        none runs (at most one piece of PIECE_BYTES per running job: milliseconds)."""
        self.stop[0] = True
        running = [f for f in futures if not f.cancel()]
        if running:
            cf.wait(running)


def copy_pairs(pairs: Sequence[tuple[memoryview, memoryview]], deadline: float | None = None) -> int:
    """Copy each ``(dst, src)`` pair (``dst[:len(src)] = src``); threads for batches of SERIAL_BYTES and more.
    Returns the bytes copied. A dst shorter than its src, or read-only, raises ``InvalidArgument`` before any byte
    moves."""
    total = 0
    pairs = [(_flat(d, True, i), _flat(s, False, i)) for i, (d, s) in enumerate(pairs)]
    for i, (d, s) in enumerate(pairs):
        if len(d) < len(s):
            raise InvalidArgument(COMPONENT, f"pair {i}: destination of {len(d)} bytes for {len(s)} source bytes")
        if d.readonly:
            raise InvalidArgument(COMPONENT, f"pair {i}: destination is read-only")
        total += len(s)
    if threads_for(total) == 1:
        for d, s in pairs:
            n = len(s)
            d[:n] = s
        return total
    stream = Stream(total, deadline, keep=pairs)  # the jobs hold the views (and so the memory) until they are done
    for d, s in pairs:
        if len(s):
            stream.add(_address(d), _address(s), len(s))
    stream.finish()
    return total
