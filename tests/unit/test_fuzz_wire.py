"""Fuzzing the wire decoder in-process (issue 11, item 8), bounded for `make test`.

Part 1, in-process (``transport.wire``, no I/O, no processes):
- ``FrameReader`` fed arbitrary bytes (valid frames, headers with random fields, garbage) cut at arbitrary points,
  with the metaserver's configuration (no sink, 1 MiB data limit) and a node-like one (a sink that takes WRITE
  data into an "arena" or refuses it). Invariants: the only exception it raises is ``ProtocolError`` naming the
  component (the stream is unframeable, the connection is dropped); a per-frame error is a ``UmbpError`` naming
  the component; a valid frame stream cut anywhere decodes to exactly the frames that were encoded (op, flags,
  status, request id, meta, data bytes); a valid prefix followed by garbage yields a prefix of its frames.
- Memory: what a reader holds follows the bytes that arrived, never a length a header announced, checked against
  the contract ``transport/wire.py`` documents (staging grows at most by doubling what arrived; a data buffer of
  its own at most ``buffer_data``).
- ``decode_header``, ``unpack_meta``, ``check_object_header``, ``unpack_superblock`` on arbitrary input raise only
  ProtocolError / BadRequest / CorruptionError / ValueError, with the component in the message; any single-byte
  change in the checked part of a valid object header is a CorruptionError.

Shared strategies and bounds live in tests/fuzzing.py.
"""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from transport import objformat, wire
from transport.wire import Op
from umbp.errors import BadRequest, CorruptionError, ProtocolError, UmbpError

from fuzzing import flags_st, fuzz_settings, ints, junk

# ===============================================================================================================
# part 1: the sans-I/O decoder in-process


class NodeLikeSink:
    """The node's contract: WRITE data lands in the arena when ``[offset, ...]`` names a range inside it, other
    opcodes take no bulk data; anything else is refused with a BadRequest."""

    def __init__(self, size: int = 1 << 20):
        self.arena = bytearray(size)
        self.mv = memoryview(self.arena)

    def __call__(self, op, rid, meta, data_len):
        if op != Op.WRITE:
            if data_len > 1 << 16:
                raise BadRequest("node-like", f"opcode {op} carries no bulk data")
            return None
        if not isinstance(meta, list) or not meta or type(meta[0]) is not int:
            raise BadRequest("node-like", "WRITE: meta must be [offset, ...]")
        off = meta[0]
        if off < 0 or off + data_len > len(self.arena):
            raise BadRequest("node-like", "WRITE: outside the arena")
        return self.mv[off:off + data_len]


def make_reader(kind: str) -> tuple[wire.FrameReader, NodeLikeSink | None]:
    if kind == "metaserver":  # as metaserver/server.py configures it
        return wire.FrameReader("metaserver", max_data=1 << 20), None
    sink = NodeLikeSink()
    return wire.FrameReader("node n0", sink=sink), sink


def owned_bytes(reader: wire.FrameReader, sink: NodeLikeSink | None) -> tuple[int, int]:
    """(staging bytes, bytes of a data buffer the reader allocated itself) - the sink's memory is the caller's."""
    data = reader._data
    own = 0
    if data is not None and (sink is None or data.obj is not sink.arena) and data.obj is not wire._DISCARD.obj:
        own = data.nbytes
    return len(reader._buf), own


def feed(reader: wire.FrameReader, stream: bytes, cuts: list[int], on_step=None):
    """Feed ``stream`` in pieces ending at ``cuts`` (each piece further limited by the buffer the reader offers).
    Returns (frames with their errors, the ProtocolError that poisoned the stream or None). Any other exception
    propagates and fails the test. ``on_step(fed)`` runs after every buffer_updated."""
    out: list = []
    pos = 0
    ends = sorted(set(c for c in cuts if 0 < c < len(stream))) + [len(stream)]
    for end in ends:
        for _ in range(len(stream) + 2):  # bounded: every turn moves at least one byte
            if pos >= end:
                break
            buf = reader.get_buffer(-1)
            assert len(buf) > 0, "reader offered an empty buffer"
            n = min(len(buf), end - pos)
            buf[:n] = stream[pos:pos + n]
            pos += n
            try:
                out += reader.buffer_updated(n)
            except ProtocolError as e:
                return out, e
            if reader.poisoned is not None:  # good frames came first, then the bad header (a server closes now)
                return out, reader.poisoned
            if on_step is not None:
                on_step(pos)
    return out, None


def frame_key(f: wire.Frame) -> tuple:
    data = bytes(f.data) if f.data is not None else None
    return (f.op, f.flags, f.status, f.request_id, msgpack.packb(f.meta, use_bin_type=True), data, f.data_len)


def random_header(draw) -> bytes:
    magic = draw(st.one_of(st.just(wire.MAGIC), st.integers(0, 0xFFFF)))
    version = draw(st.one_of(st.just(wire.VERSION), st.integers(0, 255)))
    meta_len = draw(st.one_of(st.integers(0, 64), st.sampled_from([wire.MAX_META, wire.MAX_META + 1, 1 << 31,
                                                                   (1 << 32) - 1]), st.integers(0, (1 << 32) - 1)))
    data_len = draw(st.one_of(st.integers(0, 64), st.sampled_from([1 << 20, (1 << 20) + 1, wire.MAX_DATA,
                                                                   wire.MAX_DATA + 1, (1 << 64) - 1]),
                              st.integers(0, (1 << 64) - 1)))
    return wire.HEADER.pack(magic, version, draw(st.integers(0, 255)), draw(st.integers(0, 0xFFFF)),
                            draw(st.integers(0, 0xFFFF)), draw(st.integers(0, 0xFFFFFFFF)), meta_len, data_len)


@st.composite
def valid_frames(draw, max_frames: int = 6):
    frames = []
    for _ in range(draw(st.integers(0, max_frames))):
        op = draw(st.one_of(st.sampled_from([Op.WRITE, Op.READ, Op.PING]), st.integers(0, 255)))
        meta = draw(st.one_of(st.none(), junk, st.lists(st.integers(0, 8192), min_size=1, max_size=3)))
        data = draw(st.one_of(st.just(b""), st.binary(max_size=3000)))
        frames.append((op, draw(flags_st), draw(st.integers(0, 0xFFFF)), draw(st.integers(0, 0xFFFFFFFF)), meta,
                       data))
    return frames


def encode_frames(frames) -> bytes:
    return b"".join(wire.encode(op, rid, meta, data_len=len(data), flags=fl, status=stt) + data
                    for op, fl, stt, rid, meta, data in frames)


@st.composite
def hostile_streams(draw):
    parts = []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.integers(0, 3))
        if kind == 0:
            parts.append(encode_frames(draw(valid_frames(3))))
        elif kind == 1:
            parts.append(random_header(draw))
        elif kind == 2:
            parts.append(draw(st.binary(max_size=200)))
        else:  # a valid header with meta bytes that are not msgpack
            raw = draw(st.binary(min_size=1, max_size=40))
            parts.append(wire.HEADER.pack(wire.MAGIC, wire.VERSION, draw(st.integers(0, 255)), 0, 0, 7, len(raw),
                                          draw(st.integers(0, 100))) + raw)
    return b"".join(parts)


cut_points = st.lists(st.integers(0, 1 << 16), max_size=12)


@fuzz_settings(150)
@given(stream=hostile_streams(), cuts=cut_points, kind=st.sampled_from(["metaserver", "node"]))
def test_reader_raises_only_protocol_errors_and_names_the_component(stream, cuts, kind):
    reader, _sink = make_reader(kind)
    frames, poisoned = feed(reader, stream, cuts)
    if poisoned is not None:
        assert str(poisoned).startswith(reader.component + ": "), poisoned
    for f, err in frames:
        assert isinstance(f, wire.Frame)
        if err is not None:
            assert isinstance(err, UmbpError) and str(err).startswith(("node-like: ", reader.component + ": ")), err
            assert f.data is None
        elif f.data_len:
            assert f.data is not None and len(f.data) == f.data_len


@fuzz_settings(100)
@given(frames=valid_frames(), cuts=cut_points, kind=st.sampled_from(["plain", "metaserver", "node"]))
def test_frame_stream_cut_anywhere_decodes_to_the_same_frames(frames, cuts, kind):
    stream = encode_frames(frames)
    reader = wire.FrameReader("t") if kind == "plain" else make_reader(kind)[0]
    whole, poisoned = feed(reader, stream, [])
    assert poisoned is None
    reader2 = wire.FrameReader("t") if kind == "plain" else make_reader(kind)[0]
    pieces, poisoned = feed(reader2, stream, cuts)
    assert poisoned is None
    assert [(frame_key(f), type(e)) for f, e in pieces] == [(frame_key(f), type(e)) for f, e in whole]
    if kind == "plain":  # nothing refused: every frame comes back as it was encoded
        assert all(e is None for _, e in pieces)
        assert [frame_key(f) for f, _ in pieces] == [
            (op, fl, stt, rid, msgpack.packb(meta, use_bin_type=True), data if data else None, len(data))
            for op, fl, stt, rid, meta, data in frames]


@fuzz_settings(60)
@given(frames=valid_frames(), garbage=st.binary(min_size=1, max_size=64), cuts=cut_points)
def test_valid_prefix_then_garbage_yields_a_prefix_of_the_frames(frames, garbage, cuts):
    assume(garbage[:2] != struct.pack("<H", wire.MAGIC))
    reader = wire.FrameReader("t")
    got, poisoned = feed(reader, encode_frames(frames) + garbage, cuts)
    keys = [frame_key(f) for f, _ in got]
    expect = [(op, fl, stt, rid, msgpack.packb(meta, use_bin_type=True), data if data else None, len(data))
              for op, fl, stt, rid, meta, data in frames]
    assert keys == expect[:len(keys)]
    assert poisoned is not None or len(garbage) < wire.HEADER_SIZE


announcing = st.tuples(
    st.sampled_from([Op.WRITE, Op.PING, Op.READ]),
    st.one_of(st.just(wire.MAX_META), st.integers(0, wire.MAX_META)),  # announced meta length
    st.one_of(st.just(0), st.just(wire.MAX_DATA), st.integers(0, wire.MAX_DATA)),  # announced data length
    st.sampled_from([0, 1, 4096, 70_000, 300_000]))  # bytes that follow the header (capped at the announced)


def announced_stream(op: int, meta_len: int, data_len: int, body: int) -> bytes:
    """A header announcing ``meta_len`` + ``data_len`` bytes, then ``body`` zero bytes of them (a trickle)."""
    head = wire.HEADER.pack(wire.MAGIC, wire.VERSION, op, 0, 0, 1, meta_len, data_len)
    return head + bytes(min(body, meta_len + data_len))


SLACK = 8192
BIG_META = (Op.PING, wire.MAX_META, 0, 300_000)  # a 16 MiB meta announced, 300 kB of it sent
BIG_DATA = (Op.PING, 0, wire.MAX_DATA, 10)  # a 1 GiB data announced, 10 bytes of it sent


def _memory_probe(kind: str, announce: tuple, cuts: list[int], bound) -> list:
    """Feed an announced stream; return the steps where ``bound(fed, staging, own, reader)`` did not hold."""
    reader, sink = make_reader(kind)
    worst: list = []

    def step(fed: int) -> None:
        staging, own = owned_bytes(reader, sink)
        if not bound(fed, staging, own, reader):
            worst.append((fed, staging, own))

    feed(reader, announced_stream(*announce), cuts, on_step=step)
    return worst


@fuzz_settings(80)
@example(kind="metaserver", announce=BIG_META, cuts=[24, 4096, 70_000])
@example(kind="node", announce=BIG_DATA, cuts=[24])
@given(kind=st.sampled_from(["metaserver", "node"]), announce=announcing, cuts=cut_points)
def test_reader_memory_follows_arrived_bytes_as_documented(kind, announce, cuts):
    """wire.py's contract: staging grows at most by doubling bytes that arrived; a data buffer of the reader's own
    is at most ``buffer_data`` (refused data is discarded by counting)."""
    def bound(fed, staging, own, reader):
        return staging <= max(65536, 2 * fed) + SLACK and own <= reader.buffer_data
    assert _memory_probe(kind, announce, cuts, bound) == []


def _only(fn, allowed, component=None):
    """Call fn; it may return or raise one of ``allowed`` (whose message names ``component``); nothing else."""
    try:
        return fn()
    except allowed as e:
        if component is not None:
            assert str(e).startswith(component + ": "), e
        return e


@fuzz_settings(150)
@given(head=st.binary(min_size=wire.HEADER_SIZE, max_size=wire.HEADER_SIZE + 8),
       obj=st.binary(min_size=objformat.OBJ_HEADER_SIZE, max_size=objformat.OBJ_HEADER_SIZE + 8),
       sb=st.binary(min_size=objformat.ARENA_SUPER.size, max_size=objformat.ARENA_SUPER.size + 8),
       meta=st.one_of(st.binary(max_size=200), junk.map(lambda m: msgpack.packb(m, use_bin_type=True))),
       khash=ints.map(lambda x: x & ((1 << 64) - 1)), gen=ints.map(lambda x: x & ((1 << 64) - 1)),
       plen=ints.map(lambda x: x & ((1 << 64) - 1)), limits=st.tuples(st.integers(0, 1 << 32),
                                                                         st.integers(0, 1 << 64)))
def test_header_decoders_raise_only_their_own_errors(head, obj, sb, meta, khash, gen, plen, limits):
    r = _only(lambda: wire.decode_header(head, "node n1", *limits), ProtocolError, "node n1")
    assert isinstance(r, (ProtocolError, tuple))
    r = _only(lambda: wire.unpack_meta(meta, "metaserver"), BadRequest, "metaserver")
    r = _only(lambda: objformat.check_object_header(memoryview(obj), "client x", khash, gen, plen), CorruptionError,
              "client x")
    assert isinstance(r, CorruptionError) or r is None or type(r) is int
    r = _only(lambda: objformat.unpack_superblock(sb), ValueError)
    assert isinstance(r, (ValueError, tuple))


@fuzz_settings(200)
@given(khash=st.integers(0, (1 << 64) - 1), gen=st.integers(0, (1 << 64) - 1), plen=st.integers(0, 1 << 40),
       csum=st.one_of(st.none(), st.integers(0, (1 << 32) - 1)), pos=st.integers(0, 39), delta=st.integers(1, 255))
def test_any_changed_byte_of_an_object_header_is_a_corruption_error(khash, gen, plen, csum, pos, delta):
    good = objformat.pack_object_header(khash, gen, plen, csum)
    assert objformat.check_object_header(good, "c", khash, gen, plen) == csum
    bad = bytearray(good)
    bad[pos] = (bad[pos] + delta) & 0xFF
    with pytest.raises(CorruptionError, match="^c: "):
        objformat.check_object_header(bytes(bad), "c", khash, gen, plen)


# On a buffer shorter than their struct the decoders raise the component's error, not struct.error.
@pytest.mark.parametrize("fn", ["decode_header", "check_object_header", "unpack_superblock"])
def test_header_decoders_on_short_buffers(fn):
    calls = {"decode_header": (lambda b: wire.decode_header(b, "c"), ProtocolError),
             "check_object_header": (lambda b: objformat.check_object_header(b, "c", 0, 0, 0), CorruptionError),
             "unpack_superblock": (lambda b: objformat.unpack_superblock(b), ValueError)}
    call, err = calls[fn]
    for n in (0, 1, 23, 47, 63):
        with pytest.raises(err):
            call(bytes(n))


