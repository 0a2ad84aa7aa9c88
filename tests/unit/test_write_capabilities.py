"""Unit tests of write capabilities that die with their allocation: the capability itself (umbp/auth.py), the node's
check (``NodeServer.check_write`` over a real shared-memory arena) and the metaserver's quarantine of extents freed
while their capabilities may live (metaserver/quarantine.py, with the directory's invariant check)."""

from __future__ import annotations

import time

import pytest

from metaserver.directory import NEW, Directory
from metaserver.quarantine import NEVER, Quarantine
from transport import wire
from transport.wire import ALIGN, ARENA_DATA_START, object_size
from umbp.auth import WRITE_CAP_SIZE, check_write_capability, write_capability
from umbp.config import NodeConfig
from umbp.errors import AuthError
from umbp.node import NodeServer

KEY = b"k" * 32
NOW_MS = 1_000_000


def test_a_write_capability_binds_object_epoch_and_deadline():
    cap = write_capability(KEY, 4096, 100, 7, 3, NOW_MS + 10)
    assert len(cap) == WRITE_CAP_SIZE
    assert check_write_capability(KEY, cap, 4096, 100, 7, 3, NOW_MS, "t") == 3
    assert check_write_capability(KEY, cap, 4096, 100, 7, 2, NOW_MS, "t") == 3  # a newer epoch than the floor
    for args in ((8192, 100, 7), (4096, 101, 7), (4096, 100, 8)):  # another object or generation
        with pytest.raises(AuthError, match="no valid capability to write"):
            check_write_capability(KEY, cap, *args, 3, NOW_MS, "t")
    with pytest.raises(AuthError, match="no valid capability to write"):  # a deadline moved by the holder
        check_write_capability(KEY, write_capability(KEY, 4096, 100, 7, 3, NOW_MS + 10)[:8]
                               + (NOW_MS + 99_999).to_bytes(8, "little") + cap[16:], 4096, 100, 7, 3, NOW_MS, "t")
    with pytest.raises(AuthError, match="no valid capability to write"):  # signed with another node's key
        check_write_capability(b"x" * 32, cap, 4096, 100, 7, 3, NOW_MS, "t")
    with pytest.raises(AuthError, match="stale capability.*term 3.*term 4"):
        check_write_capability(KEY, cap, 4096, 100, 7, 4, NOW_MS, "t")
    with pytest.raises(AuthError, match="expired capability"):
        check_write_capability(KEY, cap, 4096, 100, 7, 3, NOW_MS + 11, "t")
    for bad in (b"", b"\0" * 16, None, "str", cap + b"\0"):
        with pytest.raises(AuthError):
            check_write_capability(KEY, bad, 4096, 100, 7, 3, NOW_MS, "t")
    assert write_capability(None, 4096, 100, 7, 3, NOW_MS) == b""  # open pool
    assert check_write_capability(None, b"", 4096, 100, 7, 3, NOW_MS, "t") == 0


@pytest.fixture
def node(tmp_path):
    n = NodeServer(NodeConfig(capacity=1 << 20, arena_dir=str(tmp_path), token="cluster-secret-0123456789"))
    yield n
    n.arena.close()


def test_the_node_refuses_old_epochs_and_writes_a_slot_once(node):
    off, plen = ARENA_DATA_START, 1000
    n = wire.OBJ_HEADER_SIZE + plen
    later = int(time.time() * 1000) + 60_000
    node.cap_epoch = 5  # as REGISTER_NODE answered
    with pytest.raises(AuthError, match="stale capability"):
        node.check_write(off, n, 10, write_capability(node.cap_key, off, plen, 10, 4, later))
    node.check_write(off, n, 10, write_capability(node.cap_key, off, plen, 10, 5, later))
    node.check_write(off, n, 11, write_capability(node.cap_key, off, plen, 11, 9, later))
    assert node.cap_epoch == 9  # a newer metaserver term or registration: epoch 5 capabilities die from here on
    with pytest.raises(AuthError, match="stale capability"):
        node.check_write(off, n, 12, write_capability(node.cap_key, off, plen, 12, 5, later))
    # the slot now holds generation 11 (its first write landed): 11 and anything older are refused, newer allowed
    node.arena.view[off:off + wire.OBJ_HEADER_SIZE] = wire.pack_object_header(1, 11, plen)
    for gen in (10, 11):
        with pytest.raises(AuthError, match="already holds generation 11"):
            node.check_write(off, n, gen, write_capability(node.cap_key, off, plen, gen, 9, later))
    node.check_write(off, n, 12, write_capability(node.cap_key, off, plen, 12, 9, later))
    # a torn header (crc) is no header: the slot may be written
    node.arena.view[off + 20] ^= 0xFF
    node.check_write(off, n, 10, write_capability(node.cap_key, off, plen, 10, 9, later))


def test_quarantine_holds_young_frees_only():
    q = Quarantine(hold_s=10.0)
    assert q.young_gen == NEVER
    q.start(100.0, issued_below=500)
    assert q.young_gen == 500  # everything this term hands out is young until sampled old
    q.observe(105.0, 800)
    assert q.young_gen == 500
    q.observe(111.0, 900)  # the sample of 100.0 is 10 s old: gens below 500 were handed out before it
    assert q.young_gen == 500
    q.observe(116.0, 950)  # 105.0 is 10 s old: gens below 800 are old now
    assert q.young_gen == 800
    assert len(q._samples) <= 3  # bounded by hold_s / tick


def test_directory_holds_a_young_extent_until_its_time_and_stays_consistent(monkeypatch):
    d = Directory()
    d.add_space("n1", 4 * ALIGN)
    d.quarantine = Quarantine(hold_s=10.0)
    d.quarantine.start(0.0, issued_below=100)
    size = ALIGN - 64
    items, _ = d.alloc("m", [b"old", b"young"], [size, size], None, 50, 0.0)  # gen 50 is old, 51 is old too
    assert [it[0] for it in items] == [NEW, NEW]
    d.commit("m", [b"old", b"young"], [50, 51], 0.0)
    items, _ = d.alloc("m", [b"new"], [size], None, 100, 0.0)  # gen 100: young
    d.commit("m", [b"new"], [100], 0.0)
    clock = [1000.0]
    monkeypatch.setattr("metaserver.quarantine.time.monotonic", lambda: clock[0])
    used = d.spaces["n1"].alloc.used
    d.remove("m", [b"old", b"new"])
    d.check()  # the held extent is allocated, owned by no entry: the invariant knows it
    assert d.quarantine.held_bytes == object_size(size)
    assert d.spaces["n1"].alloc.used == used - object_size(size)  # the old one was freed at once
    assert d.quarantine.release(1009.0, d.spaces, 100) == 0
    assert d.quarantine.release(1010.0, d.spaces, 100) == 1
    assert d.quarantine.held_bytes == 0 and d.spaces["n1"].alloc.used == used - 2 * object_size(size)
    d.check()
    # a space dropped while it held an extent: released into nothing, no double free in the new space
    items, _ = d.alloc("m", [b"y2"], [size], None, 200, 0.0)
    d.commit("m", [b"y2"], [200], 0.0)
    d.remove("m", [b"y2"])
    d.drop_space("n1")
    d.add_space("n1", 4 * ALIGN)
    assert d.quarantine.release(2000.0, d.spaces, 100) == 1 and d.spaces["n1"].alloc.used == 0
    d.check()
