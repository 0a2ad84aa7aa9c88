"""The sans-I/O wire module: framing under every fragmentation, limits, error mapping, object headers."""

import os
import random

import struct
import zlib

import numpy as np
import pytest

from transport import answerrows, objformat, slotrules, wire
from transport.keyform import PackedKeys, digests
from umbp.errors import BadRequest, CorruptionError, NotLeader, PoolFull, ProtocolError


def feed(reader, data: bytes, chunks):
    out, pos = [], 0
    for n in chunks:
        if pos >= len(data):
            break
        buf = reader.get_buffer()
        n = min(n, len(buf), len(data) - pos)
        buf[:n] = data[pos:pos + n]
        pos += n
        out += reader.buffer_updated(n)
    while pos < len(data):
        buf = reader.get_buffer()
        n = min(len(buf), len(data) - pos)
        buf[:n] = data[pos:pos + n]
        pos += n
        out += reader.buffer_updated(n)
    return out


def sample_stream():
    payloads = [os.urandom(n) for n in (0, 1, 4095, 70000, 300000)]
    frames = []
    for i, p in enumerate(payloads):
        frames.append(wire.encode(wire.Op.WRITE, i + 1, [4096 * (i + 1)], data_len=len(p)) + p)
        frames.append(wire.encode(wire.Op.EXISTS, 100 + i, {"ns": "x", "keys": [b"k%d" % j for j in range(i * 50)]}))
    return b"".join(frames), payloads


@pytest.mark.parametrize("chunk", [1, 7, 24, 4096, 1 << 20, "random"])
def test_reader_reassembles_frames_under_any_fragmentation(chunk):
    data, payloads = sample_stream()
    rng = random.Random(5)
    chunks = [rng.randint(1, 70000) for _ in range(10000)] if chunk == "random" else [chunk] * (len(data) + 1)
    got = feed(wire.FrameReader("test"), data, chunks)
    assert len(got) == 2 * len(payloads)
    for i, p in enumerate(payloads):
        f, err = got[2 * i]
        assert err is None and f.op == wire.Op.WRITE and f.request_id == i + 1 and f.meta == [4096 * (i + 1)]
        assert f.data_len == len(p) and (bytes(f.data) if p else b"") == p
        f2, err2 = got[2 * i + 1]
        assert err2 is None and f2.meta["keys"] == [b"k%d" % j for j in range(i * 50)]


def test_sink_receives_data_in_place_and_may_refuse():
    arena = bytearray(1 << 20)
    def sink(op, rid, meta, n):
        if meta[0] < 0:
            raise BadRequest("node", "bad range")
        return memoryview(arena)[meta[0]:meta[0] + n]
    p1, p2 = os.urandom(5000), os.urandom(3000)
    data = (wire.encode(wire.Op.WRITE, 1, [8192], data_len=len(p1)) + p1
            + wire.encode(wire.Op.WRITE, 2, [-1], data_len=len(p2)) + p2
            + wire.encode(wire.Op.PING, 3, {}))
    got = feed(wire.FrameReader("node", sink=sink), data, [333] * 100)
    assert [f.request_id for f, _ in got] == [1, 2, 3]
    assert bytes(arena[8192:8192 + 5000]) == p1
    assert got[1][1] is not None and "bad range" in str(got[1][1]) and got[1][0].data is None
    assert got[2][1] is None and got[2][0].op == wire.Op.PING


def test_bad_magic_version_and_oversized_lengths_are_protocol_errors():
    r = wire.FrameReader("meta")
    with pytest.raises(ProtocolError, match="meta: bad frame magic"):
        feed(r, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", [100])
    hdr = wire.HEADER.pack(wire.MAGIC, wire.VERSION + 1, 1, 0, 0, 1, 0, 0)
    with pytest.raises(ProtocolError, match=f"unsupported wire version {wire.VERSION + 1}"):
        feed(wire.FrameReader("meta"), hdr, [100])
    hdr = wire.HEADER.pack(wire.MAGIC, wire.VERSION, 1, 0, 0, 1, 1 << 30, 0)
    with pytest.raises(ProtocolError, match="meta of 1073741824 bytes exceeds"):
        feed(wire.FrameReader("meta", max_meta=1 << 20), hdr, [100])
    hdr = wire.HEADER.pack(wire.MAGIC, wire.VERSION, 1, 0, 0, 1, 0, 1 << 40)
    with pytest.raises(ProtocolError, match="data of 1099511627776 bytes exceeds"):
        feed(wire.FrameReader("meta"), hdr, [100])


def test_malformed_meta_is_a_bad_request_and_the_stream_goes_on():
    bad = wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.Op.LOOKUP, 0, 0, 7, 3, 0) + b"\xc1\xc1\xc1"
    good = wire.encode(wire.Op.PING, 8, {})
    got = feed(wire.FrameReader("meta"), bad + good, [5] * 20)
    assert isinstance(got[0][1], BadRequest) and "malformed msgpack" in str(got[0][1])
    assert got[1][1] is None and got[1][0].request_id == 8


def test_error_status_maps_to_exception_classes():
    def frame(status, **meta):
        return wire.Frame(1, wire.Flag.RESPONSE, status, 1, {"error": "metaserver: x", **meta}, None, 0)
    with pytest.raises(PoolFull, match="client: metaserver: x"):
        wire.raise_for_status(frame(wire.Status.POOL_FULL), "client")
    with pytest.raises(NotLeader) as ei:
        wire.raise_for_status(frame(wire.Status.NOT_LEADER, leader="h:1"), "client")
    assert ei.value.leader == "h:1"
    with pytest.raises(CorruptionError):
        wire.raise_for_status(frame(wire.Status.CORRUPT), "client")
    wire.raise_for_status(frame(wire.Status.OK), "client")


def test_object_header_detects_stale_torn_and_wrong_length():
    kh = objformat.key_hash("ns", b"key")
    assert kh != objformat.key_hash("ns2", b"key") and kh != objformat.key_hash("ns", b"key2")
    h = bytearray(objformat.pack_object_header(kh, 42, 1000, 1234))
    assert len(h) == objformat.OBJ_HEADER_SIZE == 64
    assert objformat.check_object_header(h, "t", kh, 42, 1000) == 1234
    assert objformat.check_object_header(objformat.pack_object_header(kh, 42, 1000), "t", kh, 42, 1000) is None
    with pytest.raises(CorruptionError, match="stale slot"):
        objformat.check_object_header(h, "t", kh, 43, 1000)
    with pytest.raises(CorruptionError, match="does not match"):
        objformat.check_object_header(h, "t", kh, 42, 999)
    torn = bytearray(h)
    torn[20] ^= 1
    with pytest.raises(CorruptionError, match="torn"):
        objformat.check_object_header(torn, "t", kh, 42, 1000)
    with pytest.raises(CorruptionError, match="no object header"):
        objformat.check_object_header(bytes(64), "t", kh, 42, 1000)
    assert objformat.object_size(0) == 4096 and objformat.object_size(4032) == 4096 and objformat.object_size(4033) == 8192


@pytest.mark.parametrize("csum", [None, 0, 0xDEADBEEF])
def test_object_header_bytes_are_the_documented_layout(csum):
    """The arena format, field by field: magic, version, flags, key hash, generation, payload length, checksum,
    then the crc of those 36 bytes and 24 zero bytes (nodes reopening an arena written by an older build read it)."""
    h = objformat.pack_object_header(0x0123456789ABCDEF, (1 << 63) - 5, 4000, csum)
    head = struct.pack("<IHHQQQI", objformat.OBJ_MAGIC, objformat.OBJ_VERSION, 0 if csum is None else objformat.OBJ_FLAG_CHECKSUM,
                       0x0123456789ABCDEF, (1 << 63) - 5, 4000, csum or 0)
    assert h == head + struct.pack("<I", zlib.crc32(head)) + bytes(24)


def test_memory_follows_arrived_bytes_not_announced_lengths():
    """A header announcing 1 GiB of data (no sink memory for it) allocates nothing: the data is discarded by
    counting and the frame comes back refused; a trickle of a 16 MiB announced meta grows staging only by doubling
    once it is full of bytes that arrived."""
    r = wire.FrameReader("node", buffer_data=0)
    hdr = wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.Op.WRITE, 0, 0, 5, 0, 1 << 30)
    assert feed(r, hdr, [len(hdr)]) == []
    assert r.buffered <= 64 * 1024
    got = []
    for _ in range(16):  # 16 MiB of the announced GiB
        got += feed(r, bytes(1 << 20), [1 << 16] * 16)
        assert r.buffered <= 64 * 1024
    assert got == []
    r = wire.FrameReader("node", buffer_data=0)
    frames = feed(r, wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.Op.PING, 0, 0, 9, 0, 300_000) + bytes(300_000)
                  + wire.encode(wire.Op.PING, 10, {}), [7919] * 40)
    assert [(f.request_id, f.data, type(e).__name__) for f, e in frames] == [(9, None, "BadRequest"),
                                                                            (10, None, "NoneType")]
    assert "does not take 300000 bytes" in str(frames[0][1])
    r = wire.FrameReader("metaserver")
    meta_hdr = wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.Op.PING, 0, 0, 1, 16 << 20, 0)
    feed(r, meta_hdr + bytes(1000), [100] * 11)
    assert r.buffered <= 64 * 1024
    feed(r, bytes(1 << 20), [4096] * 256)  # 1 MiB arrived: staging holds it, at most doubled once
    assert (1 << 20) < r.buffered <= 2 * ((1 << 20) + 64 * 1024)


def test_good_frames_before_a_bad_header_are_returned_then_the_reader_is_poisoned():
    r = wire.FrameReader("node")
    data = wire.encode(wire.Op.PING, 1, {}) + b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    frames = feed(r, data, [len(data)])
    assert [f.request_id for f, _ in frames] == [1]
    assert isinstance(r.poisoned, ProtocolError) and "bad frame magic" in str(r.poisoned)


def test_slots_of_equals_slot_of_per_key_under_either_rule():
    keys = [b"", b"a", "a", "caf\u00e9", b"\xff" * 600, *(b"page/%d" % i for i in range(200))]
    for rule in slotrules.RULES:
        for slots in (1, 2, 16, 64, 1024):
            for ns in ("", "tenant-a", "n\u00e9"):
                assert (slotrules.slots_of(ns, keys, slots, rule).tolist()
                        == [slotrules.slot_of(ns, k, slots, rule) for k in keys])
        k16 = slotrules.slot_of("ns", b"k", 16, rule)
        assert slotrules.slots_of("ns", [b"k", 7, None, "k"], 16, rule).tolist() == [k16, -1, -1, k16]
        assert slotrules.slots_of("ns", [b"k", 7], 1, rule).tolist() == [0, -1]
    with pytest.raises(ValueError, match="unknown slot rule 3"):
        slotrules.slots_of("ns", [b"k"], 16, 3)


def test_rule_1_is_the_namespaced_key_hash_and_rule_2_the_key_digests_bits():
    """Rule 1 (pools made before rule 2) is ``objformat.key_hash`` mod S, as those pools placed their keys; rule 2
    reads the key's digest as the key index files it (a 32-byte key is its own), by the formula written out here,
    the same for a list, packed keys and str keys, and whatever the namespace."""
    rng = np.random.default_rng(7)
    raw = [rng.bytes(32) for _ in range(300)]
    names = [b"page/%d" % i for i in range(300)]
    for keys in (raw, names):
        assert slotrules.slots_of("t", keys, 48, 1).tolist() == [objformat.key_hash("t", k) % 48 for k in keys]
        dig, _ = digests(keys)
        want = []
        weights = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)
        for w in dig.tolist():
            h = sum(a * b for a, b in zip(w, weights)) % 2**64
            for m in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53):  # murmur3's fmix64
                h = ((h ^ (h >> 33)) * m) % 2**64
            want.append((h ^ (h >> 33)) % 48)
        assert slotrules.slots_of("t", keys, 48).tolist() == want
        assert slotrules.slots_of("other", keys, 48).tolist() == want  # no namespace in rule 2
    assert dig.tolist()[0] != names[0]  # (names are digested: not their own bytes)
    assert slotrules.slots_of("t", PackedKeys(b"".join(raw)), 48).tolist() == slotrules.slots_of("t", raw, 48).tolist()
    assert (slotrules.slots_of("t", [k.decode() for k in names], 48).tolist()
            == slotrules.slots_of("t", names, 48).tolist())
    assert np.frombuffer(raw[0], np.uint64).tolist() == digests(raw[:1])[0][0].tolist()  # a 32-byte key: itself


def test_rule_2_spreads_keys_evenly_over_the_slots():
    """60,000 keys of each kind over 4, 6 and 64 slots, 32-byte keys random and counted in ASCII (only the top
    bytes of their last word vary): every slot within 12 % of its share (fixed keys: the same counts every run)."""
    rng = np.random.default_rng(11)
    for keys in ([rng.bytes(32) for _ in range(60_000)], [b"%032d" % i for i in range(60_000)],
                 [b"tenant/%d/page" % i for i in range(60_000)]):
        for slots in (4, 6, 64):
            counts = np.bincount(slotrules.slots_of("t", keys, slots), minlength=slots)
            share = len(keys) / slots
            assert counts.min() > 0.88 * share and counts.max() < 1.12 * share, (slots, counts.min(), counts.max())


def test_packed_lookup_rows_read_back_as_the_list_form_in_key_order():
    nodes = ["n0", "n1"]
    rows = answerrows.pack_locs([True, False, True], [11, 33], [7, 9], [5000, 1], [4096, 1 << 40], [1, 0])
    assert len(rows) == 3 * answerrows.LOC_ROW.itemsize == 120
    # the row starts with the object header's key hash, generation and length, as a node's header holds them
    assert rows[:24] == objformat.pack_object_header(11, 7, 5000)[8:32]
    ans = answerrows.unpack_locs({"lease": 5, "nodes": nodes, "caps": [b"a", b"b"], "rows": rows}, "client")
    assert ans["locs"] == [["n1", 4096, 5000, 7, 11, 1], None, ["n0", 1 << 40, 1, 9, 33, 0]]
    assert "rows" not in ans
    # each part of a multi-slot answer; an answer of VERSION 11 (a "locs" list already) is left as it is
    part = {"lease": 1, "nodes": ["x"], "caps": [b""], "rows": answerrows.pack_locs([True], [1], [2], [3], [4], [0])}
    multi = answerrows.unpack_locs({"parts": [part, None], "failed": []}, "client")
    assert multi["parts"][0]["locs"] == [["x", 4, 3, 2, 1, 0]]
    old = {"lease": 0, "locs": [None], "caps": []}
    assert answerrows.unpack_locs(old, "client") == {"lease": 0, "locs": [None], "caps": []}


@pytest.mark.parametrize("bad", [
    {"nodes": ["n0"], "rows": b"\0" * 39},  # not whole rows
    {"nodes": ["n0"], "rows": answerrows.pack_locs([True], [1], [1], [1], [1], [1])},  # names a node beyond the list
    {"nodes": "n0", "rows": answerrows.pack_locs([True], [1], [1], [1], [1], [0])},  # no node list
    {"nodes": ["n0"], "rows": [1, 2]},  # not bytes
])
def test_malformed_packed_lookup_rows_are_a_protocol_error_naming_the_component(bad):
    with pytest.raises(ProtocolError, match="^client: malformed LOOKUP answer"):
        answerrows.unpack_locs(dict(bad, lease=1, caps=[]), "client")


def test_packed_alloc_rows_read_back_as_the_items_list_in_key_order():
    state = [wire.AllocState.NEW, wire.AllocState.EXISTS, wire.AllocState.NEW, wire.AllocState.IN_FLIGHT,
             wire.AllocState.NO_SPACE]
    rows = answerrows.pack_allocs(state, [0, 2], [11, 33], [7, 9], [5000, 1], [4096, 1 << 40], [1, 0])
    assert len(rows) == 5 * answerrows.ALLOC_ROW.itemsize == 200
    assert rows[:24] == objformat.pack_object_header(11, 7, 5000)[8:32]  # the header's key hash, generation, length
    ans = answerrows.unpack_allocs({"nodes": ["n0", "n1"], "caps": [b"a", b"b"], "rows": rows}, "client")
    assert ans["items"] == [[0, "n1", 4096, 5000, 7, 11, 1], [1, None, None, None, None],
                            [0, "n0", 1 << 40, 1, 9, 33, 0], [3, None, None, None, None], [2, None, None, None, None]]
    assert "rows" not in ans and ans["caps"] == [b"a", b"b"]
    # each part of a multi-slot answer; an answer of VERSION 11 (an "items" list already) is left as it is
    part = {"nodes": ["x"], "caps": [b""], "rows": answerrows.pack_allocs([0], [0], [1], [2], [3], [4], [0])}
    multi = answerrows.unpack_allocs({"parts": [part, None], "failed": []}, "client")
    assert multi["parts"][0]["items"] == [[0, "x", 4, 3, 2, 1, 0]]
    old = {"items": [[1, None, None, None, None]], "caps": []}
    assert answerrows.unpack_allocs(dict(old), "client") == old
    empty = answerrows.unpack_allocs({"nodes": [], "caps": [], "rows": answerrows.pack_allocs([], [], (), (), (), (), ())}, "c")
    assert empty["items"] == []


def _alloc_rows(**fields) -> bytes:
    rows = np.zeros(1, answerrows.ALLOC_ROW)
    rows["node"] = answerrows.NO_NODE
    for k, x in fields.items():
        rows[k] = x
    return rows.tobytes()


@pytest.mark.parametrize("bad", [
    {"nodes": ["n0"], "rows": b"\0" * 39},  # not whole rows
    {"nodes": ["n0"], "rows": _alloc_rows(state=0, node=1)},  # a NEW row naming a node beyond the list
    {"nodes": ["n0"], "rows": _alloc_rows(state=0)},  # a NEW row with no node
    {"nodes": ["n0"], "rows": _alloc_rows(state=1, node=0)},  # a row that is not NEW with a place
    {"nodes": ["n0"], "rows": _alloc_rows(state=4)},  # no such state
    {"nodes": "n0", "rows": _alloc_rows(state=1)},  # no node list
    {"nodes": ["n0"], "rows": [1, 2]},  # not bytes
])
def test_malformed_packed_alloc_rows_are_a_protocol_error_naming_the_component(bad):
    with pytest.raises(ProtocolError, match="^client: malformed ALLOC answer"):
        answerrows.unpack_allocs(dict(bad, caps=[]), "client")
    with pytest.raises(ProtocolError, match="^client: malformed ALLOC answer"):  # in a part of a multi-slot answer
        answerrows.unpack_allocs({"parts": [dict(bad, caps=[])], "failed": []}, "client")
