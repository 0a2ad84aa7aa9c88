"""The storage node's disk arena: a file on local NVMe under the DRAM arena (``--disk PATH --disk-capacity SIZE``).

Layout: a 4 KiB superblock (``objformat.DISK_MAGIC``, version, disk id, capacity, creation time) then ``capacity`` bytes
of objects laid out as in the DRAM arena (the same 64-byte header, extents 4 KiB aligned), offsets counted from the
file's start (the data region is ``[objformat.DISK_DATA_START, DISK_DATA_START + capacity)``). The metaserver allocates
the extents; this module only moves bytes and keeps the file. A node restarted with the same file and capacity
reopens it and keeps its id (``reopened``), so the metaserver can tell its disk pages are still there; a file of
another capacity, or no disk arena at all, is started afresh under a new id.

I/O. The file is opened with O_DIRECT when the filesystem allows it (tmpfs does not: then buffered I/O, said in one
line on stdout naming the path; ``direct`` tells which). Every transfer is aligned to 4 KiB in file offset, length and
memory: buffers come from ``Buffers`` (anonymous mmap, page aligned), and the DRAM arena's mapping is page aligned,
so demotion and promotion move extents between the two with no copy. A batch of transfers (``Job``: one extent, one
``os.preadv``/``os.pwritev`` over its views) is dealt round-robin to ``threads`` workers (the syscalls release the
GIL); ``run`` returns at once and calls ``done`` from the worker that finished the batch's last part; ``wait``
blocks until then. ``sync`` is one ``fdatasync`` (what the demotion's ordering needs: umbp/node/tiering.py).

Invariants: a transfer never leaves the data region (``check``: callers check every extent before a job is made);
each job's views add up to a multiple of 4 KiB; a buffer handed back to ``Buffers`` is not read or written after.

Costs: a batch is ``min(threads, jobs)`` executor tasks plus one syscall per extent (a short transfer retries for
its rest); the bytes move by DMA with O_DIRECT (no copy through the page cache). ``Buffers`` keeps at most ``keep``
bytes of free buffers by exact size (pages of one model share a size, so a hit is the rule), so a steady read load
maps nothing after warm-up.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from transport import objformat
from umbp.errors import ConfigError

ALIGN = objformat.ALIGN


class Buffers:
    """Page-aligned buffers (anonymous mmap), kept for reuse by exact size; at most ``keep`` bytes kept free."""

    def __init__(self, keep: int = 256 << 20):
        self.keep = keep
        self.free: dict[int, list[mmap.mmap]] = {}
        self.free_bytes = 0
        self._lock = threading.Lock()  # the event loop takes buffers, workers (tests, bench) may too

    def get(self, nbytes: int) -> mmap.mmap:
        n = objformat.align_up(max(nbytes, 1))
        with self._lock:
            got = self.free.get(n)
            if got:
                self.free_bytes -= n
                return got.pop()
        return mmap.mmap(-1, n, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)

    def put(self, buf: mmap.mmap) -> None:
        n = len(buf)
        with self._lock:
            if self.free_bytes + n > self.keep:
                return  # dropped: freed once its last view is gone
            self.free.setdefault(n, []).append(buf)
            self.free_bytes += n


@dataclass(slots=True)
class Job:
    """One transfer: ``views`` (aligned memory, in order) to or from the file at ``offset``. ``error`` is set by the
    worker when it failed (an OSError)."""

    write: bool
    offset: int
    views: list
    error: OSError | None = field(default=None)


class DiskArena:
    def __init__(self, path: str, capacity: int, threads: int = 4, component: str = "node"):
        self.path = path
        self.capacity = capacity
        self.threads = threads
        self.component = component
        self.size = objformat.DISK_DATA_START + capacity
        self.data_start, self.data_end = objformat.DISK_DATA_START, self.size
        self.reopened = False
        self.direct = True
        self.buffers = Buffers()
        self.stats = {"bytes_read": 0, "bytes_written": 0, "reads": 0, "writes": 0, "errors": 0}
        self.fd = -1
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        except OSError as e:
            if e.errno != 22:  # EINVAL: this filesystem has no O_DIRECT (tmpfs); anything else is fatal
                raise ConfigError(component, f"cannot open the disk file {path}: {e.strerror}") from e
            self._buffered()
        try:
            self.disk_id = self._open_or_create()
        except BaseException:
            os.close(self.fd)
            raise
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="umbp-disk")

    def _buffered(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise ConfigError(self.component, f"cannot open the disk file {self.path}: {e.strerror}") from e
        self.direct = False
        print(f"{self.component}: WARNING: disk {self.path}: O_DIRECT refused by its filesystem; buffered I/O "
              f"(page cache) instead", flush=True)

    def _open_or_create(self) -> bytes:
        head = self.buffers.get(ALIGN)
        try:
            n = os.preadv(self.fd, [head], 0)
        except OSError as e:
            if e.errno != 22 or not self.direct:  # O_DIRECT taken at open but refused at I/O (some FUSE mounts)
                raise ConfigError(self.component, f"cannot read the disk file {self.path}: {e.strerror}") from e
            self._buffered()
            n = os.preadv(self.fd, [head], 0)
        if n == ALIGN and os.fstat(self.fd).st_size == self.size:
            try:
                found, cap = objformat.unpack_disk_superblock(head)
                if cap == self.capacity:
                    self.reopened = True
                    return found
            except ValueError:
                pass
        try:  # new, of another capacity, or not a disk arena: started afresh (nothing in it is anybody's)
            os.ftruncate(self.fd, 0)
            os.ftruncate(self.fd, self.size)
            try:
                os.posix_fallocate(self.fd, 0, self.size)
            except OSError as e:
                if e.errno not in (95, 22):  # EOPNOTSUPP / EINVAL: a filesystem without fallocate, sparse it is
                    raise
            disk_id = uuid.uuid4().bytes
            sb = objformat.pack_disk_superblock(disk_id, self.capacity, time.time_ns())
            head[:] = sb + bytes(ALIGN - len(sb))
            os.pwritev(self.fd, [head], 0)
            os.fsync(self.fd)
        except OSError as e:
            raise ConfigError(self.component, f"cannot create the disk file {self.path} of {self.size} bytes: "
                                              f"{e.strerror} (is its filesystem large enough?)") from e
        return disk_id

    def check(self, offset: int, nbytes: int) -> str | None:
        """Why the extent ``[offset, offset + nbytes)`` is no place in the data region (None when it is)."""
        if type(offset) is not int or type(nbytes) is not int or nbytes < 0:
            return "disk extent: offset and length must be integers"
        if offset < self.data_start or offset % ALIGN or offset + nbytes > self.data_end:
            return (f"disk extent {offset}+{nbytes} outside the disk's data region [{self.data_start}, "
                    f"{self.data_end}) or unaligned")
        return None

    # ---- batched transfers -----------------------------------------------------------------------------------

    def run(self, jobs: list[Job], done: Callable[[list[Job]], None]) -> None:
        """Start ``jobs`` on the workers; ``done(jobs)`` runs in the worker that finished the last of them (each
        job's ``error`` set if it failed). Does not block. A batch of no jobs is done at once, here."""
        for j in jobs:
            n = sum(len(v) for v in j.views)
            key = "written" if j.write else "read"
            self.stats["bytes_" + key] += n
            self.stats["writes" if j.write else "reads"] += 1
        parts = min(self.threads, len(jobs))
        if not parts:
            done(jobs)
            return
        left = [parts]
        lock = threading.Lock()

        def part(chunk: list[Job]) -> None:
            for j in chunk:
                try:
                    _transfer(self.fd, j)
                except OSError as e:
                    j.error = e
            with lock:
                left[0] -= 1
                last = not left[0]
            if last:
                done(jobs)

        for i in range(parts):
            self.pool.submit(part, jobs[i::parts])

    def wait(self, jobs: list[Job]) -> list[Job]:
        """``run`` and block until the batch is done; returns ``jobs`` (errors counted, not raised)."""
        ev = threading.Event()
        self.run(jobs, lambda _jobs: ev.set())
        ev.wait()
        self.stats["errors"] += sum(j.error is not None for j in jobs)
        return jobs

    def sync(self) -> None:
        """Everything written so far is on the device (a volatile write cache flushed). Blocks: call it from a
        worker, never from the event loop."""
        os.fdatasync(self.fd)

    def close(self) -> None:
        self.pool.shutdown(wait=True)  # no transfer outlives the file descriptor
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _transfer(fd: int, job: Job) -> None:
    """One job's syscall; a short transfer (a signal, the end of the file) goes on from where it stopped."""
    views, off = job.views, job.offset
    fn = os.pwritev if job.write else os.preadv
    want = sum(len(v) for v in views)
    done = fn(fd, views, off)
    while done < want:
        if done == 0:
            raise OSError(5, f"disk {'write' if job.write else 'read'} at {off}: no progress (end of file?)")
        rest, skip = [], done
        for v in views:
            v = memoryview(v)
            if skip >= len(v):
                skip -= len(v)
                continue
            rest.append(v[skip:])
            skip = 0
        views, off, want = rest, off + done, want - done
        done = fn(fd, views, off)

