"""Fuzzing the wire decoder and every request handler of both servers (issue 11, item 8), bounded for `make test`.

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

Part 2, real processes (one etcd + metaserver + 2 nodes for the whole module): well-framed requests with random
opcodes (every known one and unknown ones), random flags and request ids, random msgpack metas (schema-shaped maps
with wrong types, unknown fields, huge ints, nested junk, bytes vs str, real keys and real arena offsets) or raw
non-msgpack bytes, and random data lengths within the limits; plus unframeable headers and truncated frames.
After every example the target process is alive and answers a PING; every answer to a well-framed request echoes
its op and request id with the RESPONSE flag and is a valid answer or an error naming the component, never
INTERNAL (an unexpected exception in a handler); a valid READ answer carries exactly the page's bytes. After
each test: every process alive, a fresh PING answered by each server, the check pages stored before any fuzzing
read back byte-exactly (over shm and over tcp) from the same directory location and generation, every page of
the fuzzed namespace reads back as its own bytes, a miss, or a CorruptionError (never other bytes), and a normal
``umbp.Client`` put/get round trip returns the exact bytes.

What the fuzz does not send (``excluded``; each is a request that is *allowed* to change what the end check
looks at, so sending it would make the check meaningless, not stronger):
- ALLOC/COMMIT/ABORT/REMOVE in the check namespace (the fuzz uses its own namespaces and the "live" one);
- EVICT with ``all`` or a positive ``bytes`` (evicts whatever is there); EVICT {} is sent: it only evicts above
  the low watermark, far from this pool's fill;
- DRAIN of a real node id; REGISTER_NODE carrying every required field (a registration that validates adds a fake
  node that later puts are placed on, or replaces a real one: impostors are issue 11 item 2's own tests);
- ALLOC of more than ``ALLOC_BUDGET`` bytes in one request (pressure would evict the check pages legitimately);
- node WRITE whose first meta item is an offset inside the data region while ``FORGED_WRITES`` is False: today a
  WRITE needs no capability, so it may overwrite any page (issue 11 item 3). Set it True once the node checks
  write capabilities: the end check then proves forged writes are refused.

Bounds: every hypothesis test has ``max_examples`` (scaled by ``UMBP_FUZZ_SCALE``, default 1), ``deadline=None``
and ``database=None`` (the checkout is shared: no .hypothesis directory); every socket wait has ANSWER_S. Cost on
2 cores: pool start ~3 s, a remote example ~2-10 ms, the module ~20 s (under a load average of 7).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import socket
import struct
import time
from dataclasses import dataclass

import msgpack
import pytest
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st

from cluster import Cluster, Harness
from test_bad_input import request as raw_request
from transport import wire
from transport.tcp import FramedSocket
from transport.wire import Flag, Op, Status
from umbp.config import split_host_port
from umbp.errors import BadRequest, CorruptionError, ProtocolError, TransportError, UmbpError

SCALE = max(1, int(os.environ.get("UMBP_FUZZ_SCALE", "1")))
ANSWER_S = 10.0  # every exchange with a server is answered within this, or the example fails
CAPACITY = 128 << 20  # per node (arenas are fallocated and populated: this is real /dev/shm memory)
ALLOC_BUDGET = 512 << 10  # bytes one fuzzed ALLOC may reserve (pending entries live 30 s; ~1% of requests ALLOC)
FORGED_WRITES = False  # True once node WRITE checks a capability (issue 11 item 3); see the module docstring
CHECK_NS = "fuzz-check"  # pages the fuzz never mutates: checked byte-exactly at the end
LIVE_NS = "fuzz-live"  # pages the fuzz may remove/abort/re-allocate: never read back as other bytes
CHECK_SIZES = [1, 63, 64, 4095, 4096, 4097, 65536, 200_000]
DATA = memoryview(bytes(range(256)) * ((4 << 20) // 256))  # request data, sliced (4 MiB)

COMMON = dict(deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                                     HealthCheck.function_scoped_fixture])  # `pool` holds no per-example state


def fuzz_settings(n: int) -> settings:
    return settings(max_examples=n * SCALE, **COMMON)


def content(key: bytes, size: int) -> bytes:
    """The deterministic bytes of a page."""
    return hashlib.shake_256(key).digest(size) if size else b""


# ===============================================================================================================
# strategies

INT_EDGES = [0, 1, -1, 2, 63, 64, 65, 4095, 4096, 4097, 8192, 65536, 1 << 20, (1 << 20) + 1, (1 << 31) - 1, 1 << 31,
             (1 << 32) - 1, 1 << 32, 1 << 40, (1 << 40) + 1, 1 << 50, (1 << 63) - 1, 1 << 63, -(1 << 63),
             (1 << 64) - 1, 4096 + CAPACITY, 4096 + CAPACITY - 4096]
ints = st.one_of(st.sampled_from(INT_EDGES), st.integers(-(1 << 63), (1 << 64) - 1))
small_ints = st.one_of(st.sampled_from([0, 1, 63, 64, 4095, 4096, 4097, 65536]), st.integers(0, 1 << 17))
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(), st.text(max_size=24), st.binary(max_size=24))
junk = st.recursive(
    scalars,
    lambda kids: st.one_of(st.lists(kids, max_size=5),
                           st.dictionaries(st.one_of(st.text(max_size=8), st.binary(max_size=8), ints), kids,
                                           max_size=5)),
    max_leaves=10)

CHECK_KEYS = [b"check/%d" % i for i in range(len(CHECK_SIZES) * 3)]
LIVE_KEYS = [b"live/%d" % i for i in range(16)]
REAL_NODE_IDS = ("node0", "node1")

good_key = st.one_of(st.sampled_from(CHECK_KEYS + LIVE_KEYS), st.binary(min_size=1, max_size=40))
bad_key = st.one_of(st.sampled_from([b"k" * 513, b""]), st.text(max_size=8), ints, junk)
key = st.one_of(good_key, bad_key)
alnum = st.text("abcdefghijklmnopqrstuvwxyz0123456789-_.", min_size=1, max_size=16)
# Per field: a value that passes validation (or nearly), and one that must not. List fields hold these.
GOOD = {
    "ns": st.one_of(st.sampled_from([LIVE_NS, "fuzz-other", CHECK_NS]), alnum),
    "keys": good_key, "parents": st.one_of(st.none(), good_key), "sizes": small_ints,
    "gens": st.one_of(st.integers(0, 1 << 20), ints), "lease": st.integers(0, 1 << 20),
    "node_id": st.one_of(st.sampled_from(REAL_NODE_IDS), alnum), "arena_id": st.binary(min_size=16, max_size=16),
    "bytes": st.just(0), "all": st.just(False), "limit": st.integers(0, 2000),
    "token": st.text(max_size=40), "client": st.text(max_size=40), "nonce": st.binary(min_size=16, max_size=32),
    "id": alnum, "proof": st.binary(min_size=32, max_size=32),
    "host": st.just("127.0.0.1"), "port": st.integers(1, 65535), "pid": st.integers(0, 1 << 20),
    "capacity": st.integers(4096, 1 << 30), "arena_path": st.text(max_size=40), "boot_id": alnum,
    "hostname": alnum, "transports": st.lists(st.sampled_from(["tcp", "shm", "rdma"]), max_size=3),
    "lease_ttl": st.floats(0.1, 60), "rdma": st.none(),
    "qpn": st.integers(0, 1 << 24), "lid": st.integers(0, 1 << 16), "psn": st.integers(0, 1 << 24),
    "gid": st.binary(min_size=16, max_size=16),
}
BAD = {
    "ns": st.one_of(st.sampled_from(["", "x" * 129, "\u00fc" * 65]), st.binary(max_size=8), junk),
    "keys": bad_key, "parents": bad_key, "sizes": st.one_of(st.sampled_from([-1, 1 << 41, (1 << 64) - 1]), junk),
    "node_id": st.one_of(st.sampled_from(["", "bad id!", "n" * 129]), junk),
    "bytes": st.one_of(st.sampled_from([-1, 1 << 61]), junk),
}
LIST_FIELDS = {"keys", "parents", "sizes", "gens"}
NEWER_FIELDS = {"token", "nonce"}  # wire v2 (issue 11): rarely sent, so older servers still get deep requests
REGISTER_FIELDS = ("node_id", "host", "port", "pid", "capacity", "arena_id", "arena_path", "boot_id", "hostname",
                   "transports", "lease_ttl", "rdma")
REGISTER_REQUIRED = {"node_id", "host", "port", "capacity", "arena_id", "lease_ttl"}
OP_FIELDS: dict[int, tuple[str, ...]] = {
    Op.HELLO: ("token", "client", "nonce"), Op.PING: (), Op.REGISTER_NODE: REGISTER_FIELDS,
    Op.HEARTBEAT: ("node_id", "arena_id"), Op.ALLOC: ("ns", "keys", "sizes", "parents", "token"),
    Op.COMMIT: ("ns", "keys", "gens"), Op.ABORT: ("ns", "keys", "gens"), Op.LOOKUP: ("ns", "keys"),
    Op.RELEASE: ("lease",), Op.EXISTS: ("ns", "keys"), Op.PREFIX: ("ns", "keys"), Op.REMOVE: ("ns", "keys"),
    Op.STATS: (), Op.NODES: (), Op.LIST: ("ns", "limit"), Op.EVICT: ("bytes", "all"), Op.DRAIN: ("node_id",),
    Op.LEADER: (), Op.ARENA_INFO: (), Op.RDMA_CONNECT: ("qpn", "gid", "lid", "psn"),
}
if hasattr(Op, "AUTH"):
    OP_FIELDS[Op.AUTH] = ("id", "proof")
UNKNOWN_OPS = [0x00, 0x04, 0x0F, 0x20, 0x3F, 0x44, 0x7E, 0xFF]
ALL_OPS = sorted(int(o) for o in Op) + UNKNOWN_OPS
METASERVER_OPS = [op for op in OP_FIELDS if 0x10 <= op < 0x40] + [Op.HELLO, Op.PING]
DATA_PLANE_OPS = [Op.ALLOC, Op.COMMIT, Op.ABORT, Op.LOOKUP, Op.EXISTS, Op.PREFIX, Op.REMOVE, Op.RELEASE]


def one_in(draw, n: int) -> bool:
    return draw(st.integers(0, n - 1)) == 0


@st.composite
def schema_meta(draw, op: int):
    """A map shaped like ``op``'s request, mostly valid so handlers get past validation: each field usually
    present and plausible, sometimes missing, of a wrong type or out of range; list fields of one length (keys,
    sizes, gens, parents), sometimes with one bad element or a length off by one; sometimes an unknown field."""
    n = draw(st.integers(0, 6))
    meta = {}
    for f in OP_FIELDS.get(op, ()):
        if one_in(draw, 12) or (f in NEWER_FIELDS and not one_in(draw, 4)):
            continue  # missing
        bad = BAD.get(f, st.one_of(ints, st.text(max_size=8), st.binary(max_size=8), junk))
        if f in LIST_FIELDS:
            if one_in(draw, 10):
                meta[f] = draw(st.one_of(bad, junk))
                continue
            m = n + (draw(st.sampled_from([-1, 1])) if n and one_in(draw, 8) else 0)
            items = draw(st.lists(GOOD[f], min_size=m, max_size=m))
            if items and one_in(draw, 6):
                items[draw(st.integers(0, len(items) - 1))] = draw(bad)
            meta[f] = items
        else:
            meta[f] = draw(bad) if one_in(draw, 6) else draw(GOOD[f])
    if one_in(draw, 10):
        meta[draw(st.one_of(st.text(max_size=8), st.binary(max_size=8), ints))] = draw(junk)
    return meta


@dataclass
class Req:
    op: int
    flags: int
    rid: int
    status: int
    meta: object  # the decoded meta, or None when ``raw`` is not msgpack
    raw: bytes  # the meta bytes on the wire
    data_len: int

    def head(self) -> bytes:
        return wire.HEADER.pack(wire.MAGIC, wire.VERSION, self.op, self.flags, self.status, self.rid,
                                len(self.raw), self.data_len)


flags_st = st.one_of(st.sampled_from([Flag.NO_REPLY, Flag.RESPONSE, Flag.RESPONSE | Flag.NO_REPLY]),
                     st.integers(0, 0xFFFF))
data_len_st = st.one_of(st.just(0), st.just(0), st.sampled_from([1, 63, 64, 4096, 65536, 1 << 20]),
                        st.integers(0, 1 << 20))


@st.composite
def requests(draw, ops=st.sampled_from(ALL_OPS), meta_for=None, data_len=data_len_st):
    """A well-framed request: a schema-shaped meta (70%), junk, none, or raw non-msgpack bytes; mostly flags 0
    and no data, else random flags and a data length within the limits."""
    op = draw(ops)
    kind = draw(st.integers(0, 9))
    if kind <= 6:
        meta = draw(meta_for(op)) if meta_for is not None else draw(schema_meta(op))
    elif kind == 7:
        meta = draw(junk)
    else:
        meta = None
    if kind == 9:
        raw = draw(st.binary(min_size=1, max_size=64))  # raw bytes, usually not msgpack
    else:
        raw = b"" if meta is None and draw(st.booleans()) else msgpack.packb(meta, use_bin_type=True)
    try:
        decoded = wire.unpack_meta(raw, "t") if raw else None
    except BadRequest:
        decoded = None
    flags = draw(flags_st) if one_in(draw, 5) else 0  # mostly a plain request, so the handlers run
    data_len = draw(data_len) if one_in(draw, 3) else 0
    return Req(op, flags, draw(st.integers(0, 0xFFFFFFFF)), draw(st.integers(0, 0xFFFF)), decoded, raw, data_len)


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
       obj=st.binary(min_size=wire.OBJ_HEADER_SIZE, max_size=wire.OBJ_HEADER_SIZE + 8),
       sb=st.binary(min_size=wire.ARENA_SUPER.size, max_size=wire.ARENA_SUPER.size + 8),
       meta=st.one_of(st.binary(max_size=200), junk.map(lambda m: msgpack.packb(m, use_bin_type=True))),
       khash=ints.map(lambda x: x & ((1 << 64) - 1)), gen=ints.map(lambda x: x & ((1 << 64) - 1)),
       plen=ints.map(lambda x: x & ((1 << 64) - 1)), limits=st.tuples(st.integers(0, 1 << 32),
                                                                         st.integers(0, 1 << 64)))
def test_header_decoders_raise_only_their_own_errors(head, obj, sb, meta, khash, gen, plen, limits):
    r = _only(lambda: wire.decode_header(head, "node n1", *limits), ProtocolError, "node n1")
    assert isinstance(r, (ProtocolError, tuple))
    r = _only(lambda: wire.unpack_meta(meta, "metaserver"), BadRequest, "metaserver")
    r = _only(lambda: wire.check_object_header(memoryview(obj), "client x", khash, gen, plen), CorruptionError,
              "client x")
    assert isinstance(r, CorruptionError) or r is None or type(r) is int
    r = _only(lambda: wire.unpack_superblock(sb), ValueError)
    assert isinstance(r, (ValueError, tuple))


@fuzz_settings(200)
@given(khash=st.integers(0, (1 << 64) - 1), gen=st.integers(0, (1 << 64) - 1), plen=st.integers(0, 1 << 40),
       csum=st.one_of(st.none(), st.integers(0, (1 << 32) - 1)), pos=st.integers(0, 39), delta=st.integers(1, 255))
def test_any_changed_byte_of_an_object_header_is_a_corruption_error(khash, gen, plen, csum, pos, delta):
    good = wire.pack_object_header(khash, gen, plen, csum)
    assert wire.check_object_header(good, "c", khash, gen, plen) == csum
    bad = bytearray(good)
    bad[pos] = (bad[pos] + delta) & 0xFF
    with pytest.raises(CorruptionError, match="^c: "):
        wire.check_object_header(bytes(bad), "c", khash, gen, plen)


# On a buffer shorter than their struct the decoders raise the component's error, not struct.error.
@pytest.mark.parametrize("fn", ["decode_header", "check_object_header", "unpack_superblock"])
def test_header_decoders_on_short_buffers(fn):
    calls = {"decode_header": (lambda b: wire.decode_header(b, "c"), ProtocolError),
             "check_object_header": (lambda b: wire.check_object_header(b, "c", 0, 0, 0), CorruptionError),
             "unpack_superblock": (lambda b: wire.unpack_superblock(b), ValueError)}
    call, err = calls[fn]
    for n in (0, 1, 23, 47, 63):
        with pytest.raises(err):
            call(bytes(n))


# ===============================================================================================================
# part 2: both real servers over raw sockets


@dataclass
class FuzzPool:
    cluster: Cluster
    check: dict[bytes, bytes]  # CHECK_NS page -> its bytes
    live: dict[bytes, bytes]  # LIVE_NS page -> its bytes
    locs: dict[bytes, list]  # CHECK_NS page -> its LOOKUP location before the fuzz
    data_end: int  # first offset past a node's data region
    roundtrips = itertools.count()

    def component(self, target) -> str:
        return "metaserver" if target is self.cluster.metaserver else f"node {target.node_id}"

    def lookup(self, ns: str, keys: list[bytes]) -> list:
        with self.cluster.client(namespace=ns) as c:
            reply = c.admin(Op.LOOKUP, {"ns": ns, "keys": keys})
            if reply.get("lease"):
                c.admin(Op.RELEASE, {"lease": reply["lease"]})
        return reply["locs"]

    def assert_intact(self) -> None:
        c = self.cluster
        for p in [c.etcd, *c.metaservers, *c.nodes]:
            assert p.alive, f"{p.name} died during the fuzz\n{p.tail()}"
        for target in [c.metaserver, *c.nodes]:
            f = ping(target.addr)
            assert f.status == Status.OK and f.op == Op.PING, f
        keys = list(self.check)
        for transport in ("auto", "tcp"):
            with c.client(namespace=CHECK_NS, transport=transport) as cl:
                outs = [bytearray(len(v)) for v in self.check.values()]
                assert cl.batch_get_into(keys, outs) == [len(v) for v in self.check.values()], transport
                bad = [k for k, o in zip(keys, outs) if bytes(o) != self.check[k]]
                assert bad == [], f"check pages changed ({transport}): {bad}"
        now = [loc[:4] for loc in self.lookup(CHECK_NS, keys)]  # node, offset, size, generation
        assert now == [self.locs[k][:4] for k in keys], "check pages moved"
        with c.client(namespace=LIVE_NS) as cl:
            for k, v in self.live.items():
                try:
                    got = cl.get(k)
                except CorruptionError:
                    continue  # the fuzz removed and re-allocated it without writing: an error, not data
                assert got is None or got == v, f"{k!r}: other bytes than its own"
        key_ = b"roundtrip/%d" % next(self.roundtrips)
        value = content(key_, 123_457)
        with c.client(namespace="fuzz-roundtrip") as cl:
            assert cl.put(key_, value) is True
            assert cl.get(key_) == value


@pytest.fixture(scope="module")
def fuzz_pool(etcd_binary):
    h = Harness("test_fuzz", keep=os.environ.get("UMBP_KEEP_TEST_DIRS") == "1")
    try:
        cluster = Cluster(h, nodes=2, capacity=CAPACITY).start()
        assert [n.node_id for n in cluster.nodes] == list(REAL_NODE_IDS)
        check = {k: content(k, CHECK_SIZES[i % len(CHECK_SIZES)]) for i, k in enumerate(CHECK_KEYS)}
        live = {k: content(k, 5000 + i) for i, k in enumerate(LIVE_KEYS)}
        with cluster.client(namespace=CHECK_NS) as c:
            assert c.batch_put(list(check), list(check.values())) == [True] * len(check)
        with cluster.client(namespace=LIVE_NS) as c:
            assert c.batch_put(list(live), list(live.values())) == [True] * len(live)
        pool = FuzzPool(cluster, check, live, {}, wire.ARENA_DATA_START + CAPACITY)
        pool.locs = dict(zip(check, pool.lookup(CHECK_NS, list(check))))
        assert all(pool.locs.values())
        pool.assert_intact()
        yield pool
    finally:
        h.close()


@pytest.fixture
def pool(fuzz_pool, request):
    request.node._umbp_harness = fuzz_pool.cluster.harness  # process logs on failure (conftest hook)
    return fuzz_pool


def ping(addr: str) -> wire.Frame:
    """A PING on a fresh connection (test_bad_input's one-request helper)."""
    return raw_request(addr, Op.PING, {})


def excluded(target: str, req: Req, pool: FuzzPool) -> str | None:
    """Why ``req`` must not be sent to ``target`` (None: send it). See the module docstring."""
    op, meta = req.op, req.meta
    if target == "node":
        if (not FORGED_WRITES and op == Op.WRITE and isinstance(meta, list) and meta and type(meta[0]) is int
                and meta[0] < pool.data_end and meta[0] + req.data_len > wire.ARENA_DATA_START):
            return "WRITE into the arena without a capability"
        return None
    m = meta if isinstance(meta, dict) else {}
    if op in (Op.ALLOC, Op.COMMIT, Op.ABORT, Op.REMOVE) and m.get("ns") == CHECK_NS:
        return "mutates the check namespace"
    if op == Op.EVICT and (m.get("all") is True or (type(m.get("bytes")) is int and m["bytes"] > 0)):
        return "evicts pages"
    if op == Op.DRAIN and m.get("node_id") in REAL_NODE_IDS:
        return "drains a real node"
    if op == Op.REGISTER_NODE and REGISTER_REQUIRED <= set(m):
        return "may register a node"
    if op == Op.ALLOC and isinstance(m.get("sizes"), list):
        total = sum(wire.object_size(s) for s in m["sizes"] if type(s) is int and 0 <= s <= 1 << 41)
        if total > ALLOC_BUDGET:
            return "reserves too much space"
    return None


def _op_name(op: int) -> str:
    return Op(op).name if op in Op._value2member_map_ else f"0x{op:02x}"


def _status_name(status: int) -> str:
    return Status(status).name if status in Status._value2member_map_ else str(status)


def check_answer(comp: str, req: Req, f: wire.Frame) -> None:
    """An answer to a well-framed request: echoes op and request id, RESPONSE flag, a known status; an error names
    the component and is never INTERNAL."""
    assert f.flags & Flag.RESPONSE, f
    assert f.op == req.op and f.request_id == req.rid, (f, req)
    assert f.status in {int(s) for s in Status}, f
    if f.status == Status.OK:
        assert f.meta is None or isinstance(f.meta, dict), f
        return
    assert f.status != Status.INTERNAL, f"{comp} failed internally on {req}: {f.meta}"
    assert isinstance(f.meta, dict) and isinstance(f.meta.get("error"), str), f
    assert f.meta["error"].startswith(comp + ": "), f.meta


def _leading_run(keys: list, present: dict) -> int:
    n = 0
    for k in keys:
        if k not in present:
            break
        n += 1
    return n


def check_ok_answer(pool: "FuzzPool", target, req: Req, f: wire.Frame) -> None:
    """An OK answer has its operation's shape (one result per key, known states) and, in the check namespace
    (which the fuzz never mutates), exactly the directory's truth: the check pages exist at the locations they
    had before the fuzz, nothing else does. Node answers: ARENA_INFO names this node; PING/HELLO say "node"."""
    m, meta = f.meta if f.meta is not None else {}, req.meta
    if target is not pool.cluster.metaserver:
        if req.op == Op.ARENA_INFO:
            assert m.get("node_id") == target.node_id, m
        elif req.op in (Op.PING, Op.HELLO):
            assert m.get("server") == "node", m
        return  # READ: checked by the caller against the page's bytes; WRITE: nothing to check
    keys = meta.get("keys") if isinstance(meta, dict) else None
    n = len(keys) if isinstance(keys, list) else 0
    in_check = isinstance(meta, dict) and meta.get("ns") == CHECK_NS
    if in_check and req.op in (Op.LOOKUP, Op.EXISTS, Op.PREFIX):
        event("answer checked against the check namespace")
    if req.op == Op.ALLOC:
        items = m["items"]
        assert len(items) == n and all(it[0] in {int(a) for a in wire.AllocState} for it in items), m
    elif req.op == Op.COMMIT:
        assert len(m["ok"]) == n and all(type(b) is bool for b in m["ok"]), m
    elif req.op == Op.ABORT:
        assert type(m["aborted"]) is int and 0 <= m["aborted"] <= n, m
    elif req.op == Op.LOOKUP:
        assert type(m["lease"]) is int and len(m["locs"]) == n, m
        if in_check:
            want = [pool.locs[k][:4] if k in pool.locs else None for k in keys]
            assert [loc[:4] if loc else None for loc in m["locs"]] == want, (req, m)
    elif req.op == Op.EXISTS:
        assert len(m["exists"]) == n and all(type(b) is bool for b in m["exists"]), m
        if in_check:
            assert m["exists"] == [k in pool.check for k in keys], (req, m)
    elif req.op == Op.PREFIX:
        assert type(m["hits"]) is int and 0 <= m["hits"] <= n, m
        if in_check:
            assert m["hits"] == _leading_run(keys, pool.check), (req, m)
    elif req.op == Op.REMOVE:
        assert len(m["removed"]) == n and all(type(b) is bool for b in m["removed"]), m
    elif req.op == Op.LIST:
        assert type(m["objects"]) is list and type(m["truncated"]) is bool, m
        if isinstance(meta, dict) and type(meta.get("limit")) is int:
            assert len(m["objects"]) <= meta["limit"], m
    elif req.op == Op.EVICT:
        # only EVICT {} / {"bytes": 0} are sent: this pool is far below the low watermark, so nothing goes
        assert m["evicted"] == 0 and m["freed_bytes"] == 0, m
    elif req.op == Op.STATS:
        assert {"capacity_bytes", "used_bytes", "objects", "nodes"} <= m.keys(), m
    elif req.op == Op.NODES:
        assert {nd["node_id"] for nd in m["nodes"]} >= set(REAL_NODE_IDS), m
    elif req.op == Op.LEADER:
        assert m["is_leader"] is True and m["leader"] == pool.cluster.metaserver_addr, m


def exchange(addr: str, req: Req, answers_expected: int) -> tuple[list[wire.Frame], wire.Frame | None]:
    """On a fresh connection send ``req`` (with ``data_len`` bytes of data), then a PING. Returns the frames that
    answer ``req`` and the PING's answer (None when the server closed the connection first). Waits for the PING's
    answer and ``answers_expected`` answers to ``req`` (the metaserver may answer etcd-bound requests late)."""
    deadline = time.monotonic() + ANSWER_S
    conn = FramedSocket(addr, "fuzz", deadline)
    ping_rid = req.rid ^ 0x80000000
    answers: list[wire.Frame] = []
    pong = None
    try:
        bufs = [req.head() + req.raw]
        if req.data_len:
            bufs.append(DATA[:req.data_len])
        conn.send(bufs + [wire.encode(Op.PING, ping_rid, {})], deadline)
        for _ in range(answers_expected + 4):  # bounded: the answers, the PING's, and a stray one that fails
            if pong is not None and len(answers) >= answers_expected:
                break
            f = conn.recv_frame(deadline)
            if f.op == Op.PING and f.request_id == ping_rid and f.flags & Flag.RESPONSE:
                pong = f
            else:
                answers.append(f)
    except TransportError:
        if not answers or answers[-1].status != Status.AUTH:
            raise  # only a refused authentication may end a connection that sent well-framed requests
    finally:
        conn.close()
    return answers, pong


def fuzz_one(pool: FuzzPool, target, req: Req) -> list[wire.Frame]:
    is_node = target is not pool.cluster.metaserver
    reason = excluded("node" if is_node else "metaserver", req, pool)
    if reason is not None:
        event(f"excluded: {reason}")
    assume(reason is None)
    comp = pool.component(target)
    if is_node:  # the node answers everything except successful NO_REPLY requests (and READ even then)
        expected = 0 if req.flags & Flag.NO_REPLY else 1
    else:  # the metaserver ignores frames flagged RESPONSE and answers nothing flagged NO_REPLY
        expected = 0 if req.flags & (Flag.RESPONSE | Flag.NO_REPLY) else 1
    answers, pong = exchange(target.addr, req, expected)
    assert target.alive, f"{target.name} died on {req}\n{target.tail()}"
    assert len(answers) <= 1, answers
    if not is_node and req.flags & (Flag.RESPONSE | Flag.NO_REPLY):
        assert answers == [], answers
    elif not req.flags & Flag.NO_REPLY:
        assert len(answers) == 1, (req, answers)
    for f in answers:
        check_answer(comp, req, f)
    # `pytest --hypothesis-show-statistics` shows how deep the fuzz got (which handlers answered what)
    if answers and answers[0].status != Status.OK:
        event(f"{_op_name(req.op)} -> {_status_name(answers[0].status)} {str(answers[0].meta['error'])[:60]}")
    else:
        event(f"{_op_name(req.op)} -> {'OK' if answers else 'no answer'}")
    for f in answers:
        if f.status == Status.OK:
            check_ok_answer(pool, target, req, f)
    if pong is not None:
        assert pong.status == Status.OK, pong
    else:
        assert ping(target.addr).status == Status.OK
    return answers


@fuzz_settings(500)
@given(req=requests(ops=st.one_of(st.sampled_from(DATA_PLANE_OPS), st.sampled_from(METASERVER_OPS),
                                  st.sampled_from(ALL_OPS))),
       follow=st.sampled_from([None, Op.COMMIT, Op.ABORT]), data=st.data())
def test_metaserver_handlers_survive_fuzzed_requests(pool, req, follow, data):
    answers = fuzz_one(pool, pool.cluster.metaserver, req)
    # An ALLOC that granted places: maybe COMMIT (pages READY whose bytes were never written: readers must get
    # an error, not data) or ABORT them, as a writer that dies or lies would.
    if follow is None or req.op != Op.ALLOC or not answers or answers[0].status != Status.OK:
        return
    items = answers[0].meta.get("items") or []
    keys = req.meta["keys"]
    granted = [(keys[i], it[4]) for i, it in enumerate(items)
               if isinstance(it, list) and len(it) >= 5 and it[0] == wire.AllocState.NEW]
    if not granted:
        return
    meta = {"ns": req.meta["ns"], "keys": [k for k, _ in granted], "gens": [g for _, g in granted]}
    raw = msgpack.packb(meta, use_bin_type=True)
    fuzz_one(pool, pool.cluster.metaserver, Req(follow, 0, data.draw(st.integers(0, 0xFFFF)), 0, meta, raw, 0))


def test_metaserver_pool_intact_after_fuzz(pool):
    pool.assert_intact()


@st.composite
def node_meta(draw, pool: FuzzPool, op: int):
    """READ: built from a real page's location with each field kept or fuzzed; WRITE: offsets near and outside
    the arena; everything else: schema maps or junk."""
    if op == Op.READ:
        k = draw(st.sampled_from(sorted(pool.locs)))
        loc = pool.locs[k]
        node, off, size, gen = loc[:4]
        start = draw(st.integers(0, size))
        length = draw(st.integers(0, size - start))
        if len(loc) >= 6:  # v2: [off, start, length, tag, gen, payload_len, read_cap]
            real = [off, start, length, loc[4], gen, size, loc[5]]
        else:
            real = [off, start, length, wire.key_hash(CHECK_NS, k), gen, size]
        meta = [draw(st.one_of(ints, junk)) if one_in(draw, 8) else v for v in real]
        if draw(st.integers(0, 9)) == 0:
            meta = meta[:draw(st.integers(0, len(meta)))] + draw(st.lists(junk, max_size=2))
        return meta
    if op == Op.WRITE:
        real = sorted({loc[1] for loc in pool.locs.values()})  # forged writes aim at real pages
        off = draw(st.one_of(ints, st.sampled_from([pool.data_end, pool.data_end - 4096, 0, 4096] + real)))
        return [off] + draw(st.lists(st.one_of(ints, st.binary(max_size=32), junk), max_size=3))
    return draw(schema_meta(op))


@fuzz_settings(400)
@given(data=st.data())
def test_node_handlers_survive_fuzzed_requests(pool, data):
    node = data.draw(st.sampled_from(pool.cluster.nodes))
    ops = st.one_of(st.sampled_from([Op.READ, Op.READ, Op.WRITE, Op.ARENA_INFO, Op.PING, Op.HELLO,
                                     Op.RDMA_CONNECT]), st.sampled_from(ALL_OPS))
    lens = st.one_of(data_len_st, st.integers((1 << 20) + 1, 4 << 20))
    req = data.draw(requests(ops=ops, meta_for=lambda op: node_meta(pool, op), data_len=lens))
    answers = fuzz_one(pool, node, req)
    for f in answers:
        if req.op == Op.READ and f.status == Status.OK:
            # Only a READ that names a real page exactly is served: its bytes must be that page's.
            page = next((k for k, loc in pool.locs.items() if loc[0] == node.node_id and loc[1] == req.meta[0]),
                        None)
            assert page is not None and f.data is not None, (req, f)
            start, length = req.meta[1], req.meta[2]
            assert f.data_len == wire.OBJ_HEADER_SIZE + length
            assert bytes(f.data[wire.OBJ_HEADER_SIZE:]) == pool.check[page][start:start + length]


# A WRITE that carries no data is refused whatever its meta says (with data, the node's sink validates it).
@pytest.mark.parametrize("meta", ["junk", [-1], [1 << 70 >> 7], [], {"off": 4096}])
def test_node_write_without_data_is_validated(pool, meta):
    node = pool.cluster.nodes[0]
    f = raw_request(node.addr, Op.WRITE, meta)
    check_answer(pool.component(node), Req(Op.WRITE, 0, 9, 0, meta, b"", 0), f)
    assert f.status == Status.BAD_REQUEST, f


def test_node_pool_intact_after_fuzz(pool):
    pool.assert_intact()


@st.composite
def unframeable(draw, max_data: int):
    kind = draw(st.sampled_from(["magic", "version", "meta", "data"]))
    magic = draw(st.integers(0, 0xFFFF).filter(lambda m: m != wire.MAGIC)) if kind == "magic" else wire.MAGIC
    version = draw(st.integers(0, 255).filter(lambda v: v != wire.VERSION)) if kind == "version" else wire.VERSION
    meta_len = draw(st.integers(wire.MAX_META + 1, (1 << 32) - 1)) if kind == "meta" else draw(st.integers(0, 64))
    data_len = draw(st.integers(max_data + 1, (1 << 64) - 1)) if kind == "data" else draw(st.integers(0, 64))
    head = wire.HEADER.pack(magic, version, draw(st.integers(0, 255)), draw(st.integers(0, 0xFFFF)), 0,
                            draw(st.integers(0, 0xFFFFFFFF)), meta_len, data_len)
    return head + draw(st.binary(max_size=64))


@fuzz_settings(80)
@given(data=st.data())
def test_unframeable_headers_get_one_error_then_close(pool, data):
    c = pool.cluster
    target = data.draw(st.sampled_from([c.metaserver, *c.nodes]))
    max_data = (1 << 20) if target is c.metaserver else (1 << 30)
    comp = pool.component(target)
    if data.draw(st.booleans()):
        # A truncated request, then a hang-up: nothing to answer, and nothing may wedge.
        req = data.draw(requests())
        full = req.head() + req.raw + bytes(min(req.data_len, 4096))
        cut = data.draw(st.integers(1, len(full) - 1)) if len(full) > 1 else 1
        host, port = split_host_port(target.addr)
        with socket.create_connection((host, port), timeout=ANSWER_S) as s:
            s.sendall(full[:cut])
    else:
        bad = data.draw(unframeable(max_data))
        deadline = time.monotonic() + ANSWER_S
        conn = FramedSocket(target.addr, "fuzz", deadline)
        try:
            conn.send([bad], deadline)
            f = conn.recv_frame(deadline)
            with pytest.raises(TransportError):
                conn.recv_frame(deadline)  # the stream cannot be framed any more: the server hangs up
        finally:
            conn.close()
        assert f.status in (Status.BAD_FRAME, Status.TOO_LARGE), f
        assert f.meta["error"].startswith(comp + ": "), f.meta
    assert target.alive, target.tail()
    assert ping(target.addr).status == Status.OK


def test_pool_intact_after_unframeable_input(pool):
    pool.assert_intact()
