"""Fuzzing every request handler of both servers (issue 11, item 8), bounded for `make test`.

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
- node WRITE whose first meta item is an offset inside the data region while ``FORGED_WRITES`` is False: this
  pool runs open, where a WRITE needs no capability and may overwrite any page. A closed pool refuses such
  writes at the node (write capabilities): tests/test_security.py proves it.

Bounds: every hypothesis test has ``max_examples`` (scaled by ``UMBP_FUZZ_SCALE``, default 1), ``deadline=None``
and ``database=None`` (the checkout is shared: no .hypothesis directory); every socket wait has ANSWER_S. Cost on
2 cores: pool start ~3 s, a remote example ~2-10 ms, the module ~20 s (under a load average of 7).
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from dataclasses import dataclass

import msgpack
import pytest
from hypothesis import assume, event, given
from hypothesis import strategies as st

from cluster import Cluster, Harness
from test_bad_input import request as raw_request
from transport import answerrows, objformat, slotrules, wire
from transport.framed import FramedSocket
from transport.wire import Flag, Op, Status
from umbp.config import split_host_port
from umbp.errors import CorruptionError, TransportError

from fuzzing import (
    ALLOC_BUDGET, ALL_OPS, ANSWER_S, CAPACITY, CHECK_KEYS, CHECK_NS, CHECK_SIZES, DATA, DATA_PLANE_OPS,
    FORGED_WRITES, LIVE_KEYS, LIVE_NS, METASERVER_OPS, REAL_NODE_IDS, REGISTER_REQUIRED, Req, content, data_len_st,
    fuzz_settings, ints, junk, one_in, requests, schema_meta,
)

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
        pool = FuzzPool(cluster, check, live, {}, objformat.ARENA_DATA_START + CAPACITY)
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
                and meta[0] < pool.data_end and meta[0] + req.data_len > objformat.ARENA_DATA_START):
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
        total = sum(objformat.object_size(s) for s in m["sizes"] if type(s) is int and 0 <= s <= 1 << 41)
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


def request_keys(meta: object) -> list | None:
    """A request's keys as the list it names: packed keys (one bytes value, ``key_width`` or 32 bytes each) sliced
    out; a list as it is; None for anything else."""
    keys = meta.get("keys") if isinstance(meta, dict) else None
    if type(keys) is bytes:
        w = meta.get("key_width", 32)
        return [keys[i:i + w] for i in range(0, len(keys), w)]
    return keys if isinstance(keys, list) else None


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
    keys = request_keys(meta)
    n = len(keys) if keys is not None else 0
    if isinstance(meta, dict) and type(meta.get("keys")) is bytes:
        event("packed keys answered OK")
    in_check = isinstance(meta, dict) and meta.get("ns") == CHECK_NS
    if in_check and req.op in (Op.LOOKUP, Op.EXISTS, Op.PREFIX):
        event("answer checked against the check namespace")
    if req.op == Op.ALLOC:
        items = answerrows.unpack_allocs(m, "test")["items"]  # the packed rows as the list a client reads
        assert len(items) == n and all(it[0] in {int(a) for a in wire.AllocState} for it in items), m
    elif req.op == Op.COMMIT:
        assert len(m["ok"]) == n and all(type(b) is bool for b in m["ok"]), m
    elif req.op == Op.ABORT:
        assert type(m["aborted"]) is int and 0 <= m["aborted"] <= n, m
    elif req.op == Op.LOOKUP:
        m = answerrows.unpack_locs(m, "test")  # the packed rows as the list a client reads
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
    items = answerrows.unpack_allocs(dict(answers[0].meta), "test").get("items") or []
    keys = request_keys(req.meta)
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
            real = [off, start, length, objformat.key_hash(CHECK_NS, k), gen, size]
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
            assert f.data_len == objformat.OBJ_HEADER_SIZE + length
            assert bytes(f.data[objformat.OBJ_HEADER_SIZE:]) == pool.check[page][start:start + length]


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



# ===============================================================================================================
# FENCE (a partitioned pool's slot-leader fence, accepted by nodes without AUTH): every malformed, forged or
# out-of-range FENCE gets a clean refusal naming the component, and both servers keep serving.

FENCE_JUNK = [None, 0, -1, "junk", [], {"epoch": 1}, b"", b"\x00" * 31, b"\x00" * 32, b"\xff" * 33, b"\x00" * 4096]


@pytest.mark.parametrize("meta", FENCE_JUNK, ids=lambda m: type(m).__name__ + str(len(m) if hasattr(m, "__len__")
                                                                                   else m))
def test_fence_to_an_open_pool_is_refused(pool, meta):
    """An open pool has no capabilities to fence: nodes answer BAD_REQUEST naming the node, the metaserver (FENCE
    is not one of its operations) "unknown opcode"; never INTERNAL, and both answer a PING after."""
    c = pool.cluster
    for target in [c.metaserver, *c.nodes]:
        f = raw_request(target.addr, Op.FENCE, meta)
        check_answer(pool.component(target), Req(Op.FENCE, 0, 9, 0, meta, b"", 0), f)
        if target is c.metaserver:
            assert f.status == Status.UNKNOWN_OPCODE and "unknown opcode 0x46" in f.meta["error"], f
        else:
            assert f.status in (Status.BAD_REQUEST, Status.AUTH), f
        assert target.alive, target.tail()
        assert ping(target.addr).status == Status.OK


def test_forged_and_out_of_range_fences_to_a_closed_node(make_cluster, tmp_path, monkeypatch):
    """A closed pool's node: random and truncated tokens, a token MAC'd by another key or for another arena are
    AuthError ("not a fence of this node's metaserver"); a genuine token whose epoch names no slot (no SLOT_EPOCH
    bit, a slot past the slot count, slot counts 0, 1 and 1025) is BadRequest; each leaves the node serving, and a
    genuine fence after all of them is accepted (its floor answered)."""
    from closedpool import OPS, SECRET, closed_cluster, tokens_toml
    from test_slots import authed
    from umbp.auth import Tokens, fence_token

    cl = closed_cluster(make_cluster, tmp_path, monkeypatch, tokens_toml({}), nodes=1)
    node = cl.nodes[0]
    comp = f"node {node.node_id}: "
    info = authed(node.addr, Op.ARENA_INFO, {}, OPS)
    tokens = Tokens(SECRET.encode(), {})
    key = tokens.cap_key(info["node_id"], info["arena_id"])
    other_arena = tokens.cap_key(info["node_id"], bytes(len(info["arena_id"])))
    slot3 = slotrules.SLOT_EPOCH | (3 << slotrules.SLOT_GEN_SHIFT) | 7
    genuine = fence_token(key, slot3, 8)
    # the last MAC byte flipped, not zeroed: the arena id is random, and 1 run in 256 its MAC already ended in 0x00
    forged = [os.urandom(32), os.urandom(31), fence_token(b"k" * 32, slot3, 8), fence_token(other_arena, slot3, 8),
              genuine[:-1] + bytes([genuine[-1] ^ 0xFF]), genuine + b"\x00"]
    for tok in forged:
        f = raw_request(node.addr, Op.FENCE, tok)
        assert f.status == Status.AUTH and f.meta["error"].startswith(comp), f
        assert "not a fence of this node's metaserver" in f.meta["error"], f
    for epoch, slots in [(7, 8), (slot3, 0), (slot3, 1), (slot3, 1025), (slot3, 3),
                         (slotrules.SLOT_EPOCH | (9 << slotrules.SLOT_GEN_SHIFT), 8)]:
        f = raw_request(node.addr, Op.FENCE, fence_token(key, epoch, slots))
        assert f.status == Status.BAD_REQUEST and f.meta["error"].startswith(comp), (epoch, slots, f)
        assert "names no slot" in f.meta["error"], f
    assert node.alive and ping(node.addr).status == Status.OK
    f = raw_request(node.addr, Op.FENCE, fence_token(key, slot3, 8))
    assert f.status == Status.OK and f.meta == {"floor": slot3}, f
    assert node.alive and ping(node.addr).status == Status.OK
