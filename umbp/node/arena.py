"""A storage node's arena: one file in shared memory (``/dev/shm`` or a hugetlbfs mount), mapped once.

Layout: a 4 KiB superblock (magic, version, arena id, capacity, creation time) then ``capacity`` bytes of objects.
The file outlives the node process: a node restarted with the same ``--node-id`` on the same host reopens it, keeps
the same arena id, and the metaserver keeps its pages (the id plus each object's generation prove the bytes are the
same). A node started without a ``--node-id`` gets a fresh name and removes its file on a clean exit, since nobody
could ever reopen it.

Huge pages. A same-host client copies pages out of this file (the shm transport), and out of 4 KiB pages the copy
runs slower than out of 2 MiB pages: a TLB miss every 4 KiB, and the CPU's prefetcher stops at every 4 KiB boundary
(2-core VM, the copy alone, 64 KiB pages at random places of a 1 GiB file: 12.2 against 15.4 GB/s; whole gets on a
16-core host: a few per cent at 64 KiB, more at 16 KiB; docs/benchmarks/getpath.md).
``/dev/shm`` is usually a tmpfs without huge pages; a tmpfs mounted with ``huge=within_size`` (or ``always``) gives
its files 2 MiB pages, and one mounted with ``huge=advise`` gives them where the mapping asks (``madvise``, done
here and by the shm transport: ``transport.shm.advise_huge``). The node says at start whether its arena's filesystem
gives them (``huge_mount``: the mount options, 0.3 ms), not how many pages it got: ``transport.shm.mapped_huge``
counts those from ``/proc/self/smaps``, whose walk of the page tables costs 50 ms a 4 GiB arena on the 2-core VM
(benches and tests use it). Set-up: docs/operations/kubernetes.md, "Huge pages for the arena".

Invariant: the mapping is page aligned and the data region starts at ``objformat.ARENA_DATA_START``, so object offsets
handed out by the metaserver are 4 KiB aligned in every process that maps the file (a same-host client, a GPU
gather through pinned mapped memory, an RDMA memory region).
"""

from __future__ import annotations

import mmap
import os
import time
import uuid

from transport import objformat
from transport.shm import advise_huge
from umbp.errors import ConfigError


class Arena:
    def __init__(self, path: str, capacity: int, *, remove_on_close: bool = False):
        self.path = path
        self.capacity = capacity
        self.remove_on_close = remove_on_close
        self.size = objformat.ARENA_DATA_START + capacity
        self.reopened = False
        component = "node"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise ConfigError(component, f"cannot open arena file {path}: {e.strerror}") from e
        try:
            st = os.fstat(fd)
            arena_id = None
            if st.st_size == self.size:
                with mmap.mmap(fd, objformat.ARENA_DATA_START, mmap.MAP_SHARED, mmap.PROT_READ) as head:
                    try:
                        found, cap = objformat.unpack_superblock(head)
                        if cap == capacity:
                            arena_id = found
                    except ValueError:
                        pass
            if arena_id is None:
                os.ftruncate(fd, 0)
                os.ftruncate(fd, self.size)
                try:
                    os.posix_fallocate(fd, 0, self.size)
                except OSError as e:
                    os.unlink(path)
                    raise ConfigError(component, f"cannot reserve {self.size} bytes for {path}: {e.strerror} "
                                                 f"(is {os.path.dirname(path)} large enough?)") from e
            self._map = mmap.mmap(fd, self.size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                  mmap.PROT_READ | mmap.PROT_WRITE)
            advise_huge(self._map)
        finally:
            os.close(fd)
        self.view = memoryview(self._map)
        if arena_id is None:
            arena_id = uuid.uuid4().bytes
            sb = objformat.pack_superblock(arena_id, capacity, time.time_ns())
            self.view[:len(sb)] = sb
        else:
            self.reopened = True
        self.arena_id = arena_id

    def on_huge_pages(self) -> bool:
        """Whether the arena file's filesystem gives it 2 MiB pages (``huge_mount``)."""
        return huge_mount(self.path)

    def close(self) -> None:
        view, self.view = self.view, None
        if view is not None:
            view.release()
            try:
                self._map.close()
            except BufferError:
                pass
        if self.remove_on_close:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def arena_dir_with_room(size: int) -> str | None:
    """``/dev/shm`` when it has room for an arena of ``size`` bytes plus 64 MiB (containers often give it only
    64 MiB in all), else None (the caller falls back to a temporary directory)."""
    try:
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize > size + (64 << 20):
            return "/dev/shm"
    except OSError:
        pass
    return None


def huge_mount(path: str) -> bool:
    """Whether the filesystem holding ``path`` gives its files 2 MiB pages: hugetlbfs, or a tmpfs mounted with
    ``huge=always``, ``within_size`` or ``advise`` (the node and the shm transport ask, ``advise_huge``). Read from
    ``/proc/self/mounts`` (the longest mount point above ``path``); False where that file is missing."""
    where = os.path.realpath(path)
    best, fs, opts = "", "", ""
    try:
        with open("/proc/self/mounts") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) < 4:
                    continue
                point = parts[1]
                if (where == point or where.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                    best, fs, opts = point, parts[2], parts[3]
    except OSError:
        return False
    return fs == "hugetlbfs" or (fs == "tmpfs" and any(o in opts.split(",") for o in
                                                          ("huge=always", "huge=within_size", "huge=advise")))
