"""Unit tests of capabilities granted per node per batch, and write capabilities that die with their allocation: the
capabilities themselves and the node's cache of verified ones (umbp/auth.py), the node's check
(``NodeServer.check_write``, ``writev_pieces`` over a real shared-memory arena) and the metaserver's quarantine of extents freed
while their capabilities may live (metaserver/table/quarantine.py, with the directory's invariant check)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from metaserver.table.entry import NEW
from metaserver.table.quarantine import NEVER, Quarantine
from metaserver.table.directory import TableDirectory
from transport import objformat
from transport.objformat import ALIGN, ARENA_DATA_START, object_size
from umbp.auth import (WRITE_CAP_SIZE, CapCache, check_read_capability, check_write_capability, read_capability,
                       read_capability_packed, write_capability)
from umbp.config import NodeConfig
from umbp.errors import AuthError
from umbp.node.server import NodeServer

KEY = b"k" * 32
NOW_MS = 1_000_000


def wcap(key, off, plen, gen, epoch, expires_ms, *more):
    """A write capability of one slot (plus ``more`` (off, plen, gen) slots of the same batch)."""
    return write_capability(key, [(off, plen, gen), *more], epoch, expires_ms)


def test_a_write_capability_binds_its_slots_epoch_and_deadline():
    cap = wcap(KEY, 4096, 100, 7, 3, NOW_MS + 10, (8192, 200, 8))
    assert len(cap) == WRITE_CAP_SIZE + 24  # one batch, two slots: 24 bytes a slot
    for slot in ((4096, 100, 7), (8192, 200, 8)):
        assert check_write_capability(KEY, cap, *slot, 3, NOW_MS, "t") == 3
    assert check_write_capability(KEY, cap, 4096, 100, 7, 2, NOW_MS, "t") == 3  # a newer epoch than the floor
    for args in ((12288, 100, 7), (4096, 101, 7), (4096, 100, 8), (8192, 200, 7)):  # not a slot of the batch
        with pytest.raises(AuthError, match="no valid capability to write"):
            check_write_capability(KEY, cap, *args, 3, NOW_MS, "t")
    with pytest.raises(AuthError, match="no valid capability to write"):  # a deadline moved by the holder
        check_write_capability(KEY, cap[:8] + (NOW_MS + 99_999).to_bytes(8, "little") + cap[16:], 4096, 100, 7, 3,
                               NOW_MS, "t")
    forged = bytearray(cap)
    forged[16:24] = (12288).to_bytes(8, "little")  # a slot moved by the holder
    with pytest.raises(AuthError, match="no valid capability to write"):
        check_write_capability(KEY, bytes(forged), 12288, 100, 7, 3, NOW_MS, "t")
    with pytest.raises(AuthError, match="no valid capability to write"):  # signed with another node's key
        check_write_capability(b"x" * 32, cap, 4096, 100, 7, 3, NOW_MS, "t")
    with pytest.raises(AuthError, match="no valid capability to write"):  # a read grant is no write grant
        check_write_capability(KEY, read_capability(KEY, [(4096, 100, 7)]), 4096, 100, 7, 0, 0, "t")
    with pytest.raises(AuthError, match="stale capability.*term 3.*term 4"):
        check_write_capability(KEY, cap, 4096, 100, 7, 4, NOW_MS, "t")
    with pytest.raises(AuthError, match="expired capability"):
        check_write_capability(KEY, cap, 4096, 100, 7, 3, NOW_MS + 11, "t")
    for bad in (b"", b"\0" * 16, None, "str", cap + b"\0", cap[:-1]):
        with pytest.raises(AuthError):
            check_write_capability(KEY, bad, 4096, 100, 7, 3, NOW_MS, "t")
    assert write_capability(None, [(4096, 100, 7)], 3, NOW_MS) == b""  # open pool
    assert check_write_capability(None, b"", 4096, 100, 7, 3, NOW_MS, "t") == 0


def test_a_read_capability_covers_its_batch_only():
    cap = read_capability(KEY, [(4096, 100, 7), (8192, 50, 9)])
    check_read_capability(KEY, cap, 4096, 100, 7, "t")
    check_read_capability(KEY, cap, 8192, 50, 9, "t")
    for args in ((4096, 100, 8), (12288, 100, 7), (8192, 51, 9)):
        with pytest.raises(AuthError, match="no valid capability to read"):
            check_read_capability(KEY, cap, *args, "t")
    for bad in (wcap(KEY, 4096, 100, 7, 0, 0), read_capability(b"y" * 32, [(4096, 100, 7)]), b"", None, cap[1:]):
        with pytest.raises(AuthError, match="no valid capability to read"):
            check_read_capability(KEY, bad, 4096, 100, 7, "t")


def test_a_read_capability_of_packed_slots_is_the_same_capability():
    slots = [(4096, 100, 7), (8192, 50, 9)]
    packed = np.array(slots, "<u8").tobytes()  # how a columnar caller packs them
    assert read_capability_packed(KEY, packed) == read_capability(KEY, slots)
    assert read_capability_packed(None, packed) == b""


def test_the_cache_verifies_a_batch_once_and_trusts_only_verified_bytes():
    later = NOW_MS + 10_000
    slots = [(4096 * (i + 1), 100, 50 + i) for i in range(32)]
    cap = write_capability(KEY, slots, 3, later)
    cache = CapCache(KEY, limit=2)
    for off, plen, gen in slots:
        assert cache.write(cap, off, plen, gen, 3, NOW_MS, "t") == 3
    assert cache.verified == 1  # one MAC for the batch's 32 slots
    again = bytes(bytearray(cap))  # the same capability in a later frame (a fresh bytes object)
    assert cache.write(again, *slots[5], 3, NOW_MS, "t") == 3 and cache.verified == 1
    # same MAC, another slot list: not the verified bytes, verified afresh and refused
    tampered = bytearray(cap)
    tampered[16:24] = (1 << 30).to_bytes(8, "little")
    with pytest.raises(AuthError, match="no valid capability to write"):
        cache.write(bytes(tampered), 1 << 30, 100, 50, 3, NOW_MS, "t")
    assert cache.verified == 2
    # epochs and deadlines are checked at every use, not only when verified
    with pytest.raises(AuthError, match="stale capability"):
        cache.write(cap, *slots[0], 4, NOW_MS, "t")
    with pytest.raises(AuthError, match="expired capability"):
        cache.write(cap, *slots[0], 3, later + 1, "t")
    # bounded: two batches kept, a third pushes the oldest out (verified again when it comes back)
    caps = [write_capability(KEY, [(4096, 100, g)], 3, later) for g in (1, 2, 3)]
    for c, g in zip(caps, (1, 2, 3)):
        cache.write(c, 4096, 100, g, 3, NOW_MS, "t")
    assert len(cache._w) == 2 and cache.verified == 5
    cache.write(cap, *slots[0], 3, NOW_MS, "t")
    assert cache.verified == 6
    # reads: their own table; a write capability does not read
    rcap = read_capability(KEY, slots)
    for off, plen, gen in slots:
        cache.read(rcap, off, plen, gen, "t")
    with pytest.raises(AuthError, match="no valid capability to read"):
        cache.read(cap, *slots[0], "t")


@pytest.fixture
def node(tmp_path):
    n = NodeServer(NodeConfig(capacity=1 << 20, arena_dir=str(tmp_path), token="cluster-secret-0123456789"))
    yield n
    n.arena.close()


def test_the_node_refuses_old_epochs_and_writes_a_slot_once(node):
    off, plen = ARENA_DATA_START, 1000
    n = objformat.OBJ_HEADER_SIZE + plen
    later = int(time.time() * 1000) + 60_000
    node.cap_epoch = 5  # as REGISTER_NODE answered
    with pytest.raises(AuthError, match="stale capability"):
        node.check_write(off, n, 10, wcap(node.cap_key, off, plen, 10, 4, later))
    node.check_write(off, n, 10, wcap(node.cap_key, off, plen, 10, 5, later))
    node.check_write(off, n, 11, wcap(node.cap_key, off, plen, 11, 9, later))
    assert node.cap_epoch == 9  # a newer metaserver term or registration: epoch 5 capabilities die from here on
    with pytest.raises(AuthError, match="stale capability"):
        node.check_write(off, n, 12, wcap(node.cap_key, off, plen, 12, 5, later))
    # the slot was last written at generation 11: 11 and anything older are refused, newer allowed
    for gen in (10, 11):
        with pytest.raises(AuthError, match="already holds generation 11"):
            node.check_write(off, n, gen, wcap(node.cap_key, off, plen, gen, 9, later))
    node.check_write(off, n, 12, wcap(node.cap_key, off, plen, 12, 9, later))
    # the header bytes say nothing to the node (a client wrote them): neither a torn one nor a forged old one
    # reopens the slot to generation 10
    node.arena.view[off:off + objformat.OBJ_HEADER_SIZE] = objformat.pack_object_header(1, 3, plen)
    with pytest.raises(AuthError, match="already holds generation 12"):
        node.check_write(off, n, 10, wcap(node.cap_key, off, plen, 10, 9, later))
    node.arena.view[off + 20] ^= 0xFF
    with pytest.raises(AuthError, match="already holds generation 12"):
        node.check_write(off, n, 10, wcap(node.cap_key, off, plen, 10, 9, later))


def test_a_kept_capability_cannot_write_across_a_newer_allocation_wherever_its_header_lies(node):
    """Issue 42, finding 1 at the node: a capability for a 60 KB extent, kept past its abort, while two 8 KiB pages
    of newer allocations were written inside that extent (their headers 12 KiB and 24 KiB in, none at the
    capability's offset). Its write must be refused: it would land across their payloads."""
    later = int(time.time() * 1000) + 60_000
    big, small = 60_000, 8192
    off = ARENA_DATA_START
    hs = objformat.OBJ_HEADER_SIZE
    victims = [(off + 3 * ALIGN, 20), (off + 6 * ALIGN, 21)]
    for voff, vgen in victims:
        vcap = wcap(node.cap_key, voff, small, vgen, 0, later)
        node.check_write(voff, hs + small, vgen, vcap)
        node.arena.view[voff:voff + hs] = objformat.pack_object_header(7, vgen, small)
    with pytest.raises(AuthError, match="already holds generation 21"):
        node.check_write(off, hs + big, 5, wcap(node.cap_key, off, big, 5, 0, later))
    # an extent no newer allocation touched stays writable by its own (fresh) capability
    node.check_write(off + 16 * ALIGN, hs + big, 6, wcap(node.cap_key, off + 16 * ALIGN, big, 6, 0, later))


def test_a_poisoned_header_generation_does_not_block_the_next_owner(node):
    """Issue 42, finding 2: a tenant writes its slot with header generation 2**64 - 1 (the bytes are its own to
    choose). The next allocation of that slot, a newer generation from the metaserver, must be written."""
    later = int(time.time() * 1000) + 60_000
    off, plen, hs = ARENA_DATA_START, 1000, objformat.OBJ_HEADER_SIZE
    node.check_write(off, hs + plen, 30, wcap(node.cap_key, off, plen, 30, 0, later))
    node.arena.view[off:off + hs] = objformat.pack_object_header(1, (1 << 64) - 1, plen)
    node.check_write(off, hs + plen, 31, wcap(node.cap_key, off, plen, 31, 0, later))
    assert int(node.ledger.gens[0]) == 31


def test_the_write_ledger_survives_a_restart_with_its_arena(tmp_path):
    """A node restarted with the same ``--node-id`` reopens its arena and its ledger: a capability that wrote before
    the restart still writes once; a ledger of another arena is started afresh."""
    cfg = NodeConfig(capacity=1 << 20, arena_dir=str(tmp_path), token="cluster-secret-0123456789", node_id="n1")
    later = int(time.time() * 1000) + 60_000
    off, plen, hs = ARENA_DATA_START, 1000, objformat.OBJ_HEADER_SIZE
    first = NodeServer(cfg)
    cap = wcap(first.cap_key, off, plen, 40, 0, later)
    first.check_write(off, hs + plen, 40, cap)
    first.ledger.close()
    first.arena.close()
    again = NodeServer(cfg)
    assert again.arena.reopened
    with pytest.raises(AuthError, match="already holds generation 40"):
        again.check_write(off, hs + plen, 40, cap)
    again.ledger.close()
    again.arena.close()


def test_a_writev_checks_each_slot_of_one_batch_capability_sent_once(node):
    """Several frames of one batch: the capability crosses once per frame (b"" after the first op: the previous
    op's), is verified once per connection, each slot is checked and written once."""
    plen, hs = 1000, objformat.OBJ_HEADER_SIZE
    offs = [ARENA_DATA_START + i * ALIGN for i in range(6)]
    later = int(time.time() * 1000) + 60_000
    cap = write_capability(node.cap_key, [(o, plen, 100 + i) for i, o in enumerate(offs)], 0, later)
    caps = CapCache(node.cap_key)
    first = [[offs[0], 100, cap, hs + plen], [offs[1], 101, b"", hs + plen], [offs[2], 999, b"", hs + plen]]
    pieces, failures = node.writev_pieces(first, 3 * (hs + plen), caps)
    assert [f[0] for f in failures] == [2] and "no valid capability to write" in failures[0][2]  # wrong generation
    assert pieces[2] == hs + plen and isinstance(pieces[0], memoryview)  # the refused op's bytes are discarded
    for i in (0, 1):
        pieces[i][:hs] = objformat.pack_object_header(1, 100 + i, plen)
    second = [[offs[3], 103, cap, hs + plen], [offs[0], 100, b"", hs + plen]]  # op 0 again: written once
    pieces, failures = node.writev_pieces(second, 2 * (hs + plen), caps)
    assert [f[0] for f in failures] == [1] and "already holds generation 100" in failures[0][2]
    assert caps.verified == 1  # one MAC for both frames
    with pytest.raises(AuthError, match="no valid capability to write"):  # b"" first: no previous op's
        node.check_write(offs[4], hs + plen, 104, b"", caps)


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
    d = TableDirectory()
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
    monkeypatch.setattr("metaserver.table.quarantine.time.monotonic", lambda: clock[0])
    used = d.spaces["n1"].alloc.used
    d.remove("m", [b"old", b"new"])
    d.check()  # the held extent is allocated, held by no row: the invariant knows it
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
