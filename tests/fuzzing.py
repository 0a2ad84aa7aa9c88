"""Shared pieces of the fuzz tests (tests/test_fuzz.py, tests/unit/test_fuzz_wire.py): bounds, settings and
hypothesis strategies for frames and request metas."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import msgpack
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from transport import wire
from transport.wire import Flag, Op
from umbp.errors import BadRequest

SCALE = max(1, int(os.environ.get("UMBP_FUZZ_SCALE", "1")))
ANSWER_S = 10.0  # every exchange with a server is answered within this, or the example fails
CAPACITY = 128 << 20  # per node (arenas are fallocated and populated: this is real /dev/shm memory)
ALLOC_BUDGET = 512 << 10  # bytes one fuzzed ALLOC may reserve (pending entries live 30 s; ~1% of requests ALLOC)
FORGED_WRITES = False  # the fuzzed pool is open: node WRITEs need no capability there (see tests/test_fuzz.py)
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
    sizes, gens, parents), sometimes with one bad element or a length off by one; the keys sometimes packed (one
    bytes value, a ``key_width``: good, bad, or not whole keys); sometimes an unknown field."""
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
    if type(meta.get("keys")) is list and one_in(draw, 5):
        # packed keys (wire.pack_keys): n keys of one width as one bytes value, sometimes not whole keys, a width
        # that is not 1..512, or a width beside listed keys
        w = draw(st.sampled_from([32, 32, 67, 64, 66, 1, 5]))
        blob = draw(st.binary(min_size=w * n, max_size=w * n))
        meta["keys"] = blob + (b"x" if one_in(draw, 5) else b"")
        if w != 32 or one_in(draw, 6):
            meta["key_width"] = draw(st.one_of(st.sampled_from([0, -1, 513, 1 << 63]), junk)) if one_in(draw, 5) else w
        if one_in(draw, 10):
            meta["keys"] = [blob]
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


