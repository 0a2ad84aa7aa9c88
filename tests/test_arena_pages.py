"""The arena's page size (umbp/node/arena.py "Huge pages"): ``mapped_huge`` reads how much of a mapping is on 2 MiB
pages from /proc/self/smaps; an arena in /dev/shm without ``huge=`` is on 4 KiB pages (and ``huge_mount`` says so); a
pool whose arenas are under a tmpfs mounted with ``huge=always`` (``LocalPool(arena_root=...)``, ``umbp up
--arena-root``) serves exact bytes, its node says at start that its arena is on 2 MiB pages, and a same-host
client's mapping of it is; an arena root that is not a writable directory is refused by name. Real etcd, metaserver
and node processes."""

from __future__ import annotations

import mmap
import os
import subprocess

import numpy as np
import pytest

from umbp.errors import ConfigError
from umbp.launcher import LocalPool
from transport.shm import advise_huge, mapped_huge
from umbp.node.arena import Arena, huge_mount


def test_mapped_huge_counts_an_anonymous_mapping_on_2mib_pages():
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
        thp = fh.read()
    if "[never]" in thp:
        pytest.skip(f"!!! transparent huge pages are off on this machine ({thp.strip()}): no 2 MiB page to count")
    private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # (a shared anonymous mapping is shmem: /dev/shm's rules)
    m = mmap.mmap(-1, 8 << 20, flags=private)
    advise_huge(m)
    np.frombuffer(m, np.uint8)[::4096] = 1  # touch every page
    assert mapped_huge(m) >= 2 << 20
    small = mmap.mmap(-1, 1 << 20, flags=private)  # under 2 MiB: never on a huge page
    np.frombuffer(small, np.uint8)[::4096] = 1
    assert mapped_huge(small) == 0
    m.close()
    small.close()


def test_an_arena_in_dev_shm_without_huge_is_on_4kib_pages(tmp_path):
    if huge_mount("/dev/shm/x") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("!!! /dev/shm is mounted with huge pages, or is not writable, here: no 4 KiB-page arena to look at")
    a = Arena(f"/dev/shm/umbp-test-{os.getpid()}.arena", 16 << 20, remove_on_close=True)
    try:
        assert not a.on_huge_pages() and mapped_huge(a._map) == 0
    finally:
        a.close()


def test_an_arena_root_that_is_no_writable_directory_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"up: --arena-root .*nowhere is not a writable directory"):
        LocalPool(nodes=1, arena_root=str(tmp_path / "nowhere"))


@pytest.fixture
def huge_tmpfs(tmp_path):
    where = tmp_path / "huge"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "huge=always,size=256m", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"!!! cannot mount a tmpfs with huge pages here (needs root with CAP_SYS_ADMIN): "
                    f"{r.stderr.strip()}")
    try:
        yield str(where)
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_a_pool_with_its_arenas_on_a_huge_tmpfs_maps_2mib_pages_and_serves_exact_bytes(huge_tmpfs):
    size, n = 64 << 10, 64
    rng = np.random.default_rng(7)
    pages = rng.integers(0, 256, (n, size), dtype=np.uint8)
    keys = [f"huge/{i}" for i in range(n)]
    with LocalPool(nodes=1, capacity="64MiB", port=0, metrics=False, arena_root=huge_tmpfs) as pool:
        import umbp

        assert os.path.dirname(pool.arena_dir) == huge_tmpfs and huge_mount(pool.arena_dir + "/x")
        with umbp.Client(pool.metaserver, namespace="huge", transport="shm") as c:
            assert c.batch_put(keys, list(pages)) == [True] * n
            out = np.zeros((n, size), np.uint8)
            assert c.batch_get_into(keys, out) == [size] * n
            assert np.array_equal(out, pages)
            (t,) = c._transports.values()
            assert t.name == "shm"
            assert mapped_huge(t._map) >= 64 << 20  # the client's mapping: every 2 MiB of the arena
        (node,) = [ch for ch in pool.children if "node" in ch.name]
        with open(node.log_path) as fh:
            log = fh.read()
        assert " of 64 MiB: on 2 MiB pages\n" in log and "4 KiB pages" not in log, log
