"""Transport contract on the test double: per-op results, header checks, payload-first writes."""

import os

from transport import objformat
from transport.base import MemoryTransport, ReadOp, WriteOp
from umbp.errors import CorruptionError


def put(t, off, key, gen, data, checksum=False):
    kh = objformat.key_hash("ns", key)
    hdr = objformat.pack_object_header(kh, gen, len(data), objformat.payload_checksum(data) if checksum else None)
    assert t.finish(t.start_write([WriteOp(off, hdr, [memoryview(data)], len(data))], 0), 0) == [None]
    return kh


def test_round_trip_ranges_and_per_op_errors():
    t = MemoryTransport(1 << 20)
    a, b = os.urandom(10000), os.urandom(5000)
    ka = put(t, 4096, b"a", 1, a, checksum=True)
    kb = put(t, 20480, b"b", 2, b)
    outs = [bytearray(10000), bytearray(100), bytearray(5000)]
    ops = [ReadOp(4096, 0, 10000, ka, 1, 10000, memoryview(outs[0])),
           ReadOp(4096, 500, 100, ka, 1, 10000, memoryview(outs[1])),
           ReadOp(20480, 0, 5000, kb, 3, 5000, memoryview(outs[2]))]  # wrong generation
    res = t.finish(t.start_read(ops, 0), 0)
    assert res[0] is None and bytes(outs[0]) == a
    assert res[1] is None and bytes(outs[1]) == a[500:600]
    assert isinstance(res[2], CorruptionError) and bytes(outs[2]) == bytes(5000)


def test_checksum_catches_payload_corruption():
    t = MemoryTransport(1 << 20)
    data = os.urandom(8000)
    kh = put(t, 4096, b"a", 1, data, checksum=True)
    t.arena[4096 + 64 + 100] ^= 0xFF
    out = bytearray(8000)
    res = t.finish(t.start_read([ReadOp(4096, 0, 8000, kh, 1, 8000, memoryview(out))], 0), 0)
    assert isinstance(res[0], CorruptionError) and "checksum" in str(res[0])


def test_reused_slot_is_never_read_as_the_old_key():
    t = MemoryTransport(1 << 20)
    old = put(t, 4096, b"old", 1, b"x" * 3000)
    put(t, 4096, b"new", 2, b"y" * 3000)
    out = bytearray(3000)
    res = t.finish(t.start_read([ReadOp(4096, 0, 3000, old, 1, 3000, memoryview(out))], 0), 0)
    assert isinstance(res[0], CorruptionError) and b"y" not in out


def test_write_from_parts_lands_back_to_back():
    t = MemoryTransport(1 << 20)
    parts = [os.urandom(n) for n in (4096, 1, 0, 7000)]
    whole = b"".join(parts)
    kh = objformat.key_hash("ns", b"p")
    hdr = objformat.pack_object_header(kh, 5, len(whole), objformat.payload_checksum([memoryview(p) for p in parts]))
    assert objformat.payload_checksum([memoryview(p) for p in parts]) == objformat.payload_checksum(whole)
    op = WriteOp(8192, hdr, [memoryview(p) for p in parts], len(whole))
    assert t.finish(t.start_write([op], 0), 0) == [None]
    out = bytearray(len(whole))
    res = t.finish(t.start_read([ReadOp(8192, 0, len(whole), kh, 5, len(whole), memoryview(out))], 0), 0)
    assert res == [None] and bytes(out) == whole
