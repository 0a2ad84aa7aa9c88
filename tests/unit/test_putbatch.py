"""The array write path of ``batch_put`` (``umbp/putbatch.py``) against the per-page path it replaces, no processes:
headers packed as arrays are ``objformat.pack_object_header``'s bytes, and on random chunks (every ALLOC state, pages on
two shm arenas, a tcp-like node whose writes fail now and then, an unreachable node, pages outside an arena or
unaligned) the two paths leave the same arena bytes, send the same ops, and report the same keys written, aborted,
full and waiting, the same first error, node failures and dropped transports."""

from __future__ import annotations

import collections
import os
import random
import time
import types
import uuid

import numpy as np
import pytest

from transport import answerrows, objformat
from transport.base import Pending, Transport, write_rows_to_arena
from transport.shm import ShmTransport, boot_id
from umbp import putbatch
from umbp.auth import with_caps
from umbp.client import Client
from umbp.errors import CorruptionError, TransportError
from umbp.puts import Puts, _PutResult

ARENA = 1 << 20


def test_packed_headers_are_the_per_page_headers():
    rng = random.Random(3)
    want = [(rng.getrandbits(64), rng.getrandbits(63), rng.randrange(0, 1 << 40)) for _ in range(300)]
    tag, gen, plen = (np.array(c, np.uint64) for c in zip(*want))
    heads = objformat.pack_object_headers(tag, gen, plen)
    assert heads.shape == (300, 64) and heads.dtype == np.uint8
    assert [bytes(h) for h in heads] == [objformat.pack_object_header(*w) for w in want]
    assert objformat.pack_object_headers(tag[:0], gen[:0], plen[:0]).shape == (0, 64)


def _arena(tmp_path, name: str) -> tuple[str, bytes]:
    aid = uuid.uuid4().bytes
    path = os.path.join(tmp_path, name)
    with open(path, "wb") as fh:
        fh.write(objformat.pack_superblock(aid, ARENA, 0).ljust(ARENA, b"\xee"))
    return path, aid


def test_write_rows_leaves_pages_outside_or_unaligned_to_the_caller(tmp_path):
    path, aid = _arena(str(tmp_path), "a")
    t = ShmTransport("n0", path, aid, boot_id())
    try:
        src = [np.full(n, i + 1, np.uint8) for i, n in enumerate((100, 5000, 10, 7))]
        off = np.array([4096, 8192 + 8, ARENA - 64, 0], np.uint64)  # ok, unaligned, no room, the superblock
        plen = np.array([len(s) for s in src], np.uint64)
        heads = objformat.pack_object_headers(np.arange(4, dtype=np.uint64), np.ones(4, np.uint64), plen)
        rows = putbatch.arena_rows(t)
        before = bytes(t.arena)
        got = write_rows_to_arena(rows, t.arena, off, plen, heads, [memoryview(s) for s in src],
                                  time.monotonic() + 5)
        assert got.tolist() == [0, 1, 1, 1]
        assert bytes(t.arena[4096:4096 + 64]) == bytes(heads[0]) and bytes(t.arena[4160:4260]) == b"\x01" * 100
        assert bytes(t.arena[4260:]) == before[4260:] and bytes(t.arena[:4096]) == before[:4096]
    finally:
        t.close()  # the kept header view is built from the address: the arena's memoryview releases


class Recorder(Transport):
    """A tcp-like node: records every op it is given; ops whose generation is divisible by 5 fail with a
    CorruptionError, by 7 the whole batch with a TransportError (a connection lost)."""

    name = "tcp"

    def __init__(self):
        self.seen: list = []

    def start_read(self, ops, deadline):
        raise AssertionError("no reads here")

    def start_write(self, ops, deadline):
        self.seen.append([(o.offset, bytes(o.header), b"".join(bytes(p) for p in o.parts), o.nbytes, o.gen, o.cap)
                          for o in ops])
        p = Pending(ops, "write")
        if any(o.gen % 7 == 0 for o in ops):
            p.results = [TransportError("transport tcp n2", "connection lost")] * len(ops)
        else:
            p.results = [CorruptionError("node n2", "refused") if o.gen % 5 == 0 else None for o in ops]
        return p

    def finish(self, pending, deadline):
        return pending.results

    def close(self):
        pass


class Stub:
    """What the put path needs of ``Client``: transports by node, counters."""

    component = "client"
    namespace = "ns"
    _run = Client._run

    def __init__(self, transports: dict):
        self.config = types.SimpleNamespace(checksum=False)
        self._transports = dict(transports)
        self.counts: collections.Counter = collections.Counter()
        self.dropped: list = []

    def _transport_for(self, node_id, deadline):
        if node_id not in self._transports:
            raise TransportError(self.component, f"node {node_id} is not known to the metaserver")
        return self._transports[node_id]

    def count(self, **kw):
        self.counts.update(kw)

    def _drop_transport(self, node_id):
        self.dropped.append(node_id)


class StubPuts(Puts):
    """The put part of a ``Stub``, its ABORTs recorded instead of sent."""

    def __init__(self, client: Stub):
        super().__init__(client)
        self.aborts: list = []

    def _abort_written(self, kb, idxs, gens, deadline):
        self.aborts.append(([kb[i] for i in idxs], [gens[i] for i in idxs]))


def _answer(rng: random.Random, n: int, sizes: list[int], nodes: list[str]) -> dict:
    state = [rng.choice([0, 0, 0, 0, 1, 2, 3]) for _ in range(n)]
    new = [i for i, s in enumerate(state) if s == 0]
    offs, gens, node = [], [], []
    for j in new:
        off = 4096 * rng.randrange(1, ARENA // 4096 - 3)
        r = rng.random()
        if r < 0.05:
            off = ARENA - 100  # outside the arena
        elif r < 0.1:
            off += 8  # not aligned: start_write takes it
        offs.append(off)
        gens.append(rng.randrange(1, 1 << 40))
        node.append(rng.randrange(len(nodes)))
    rows = answerrows.pack_allocs(state, new, [rng.getrandbits(64) for _ in new], gens, [sizes[i] for i in new], offs,
                            node)
    return {"nodes": nodes, "caps": [b"cap-" + x.encode() for x in nodes], "rows": rows}


@pytest.mark.parametrize("seed", range(12))
def test_array_chunk_writes_and_reports_as_the_per_page_chunk(tmp_path, seed):
    rng = random.Random(seed)
    nodes = ["n0", "n1", "n2", "n3"][:rng.choice([1, 2, 4])]
    if len(nodes) == 1 and seed % 2:
        nodes = ["n2"]
    n = rng.randrange(1, 80)
    sizes = [rng.choice([1, 64, 4000, 4096 * 3 + 5]) for _ in range(n)]
    kb = [b"k%d" % i for i in range(n)]
    values = [np.frombuffer(os.urandom(s), np.uint8).copy() for s in sizes]
    views = [[memoryview(v).cast("B")] for v in values]
    idxs = rng.sample(range(n), n)  # a retry's todo list need not be in key order
    raw = _answer(rng, n, [sizes[i] for i in idxs], nodes)
    outcome = []
    for array in (False, True):
        shm = {}
        d = tmp_path / ("arrays" if array else "pages")
        d.mkdir()
        for nid in ("n0", "n1"):
            path, aid = _arena(str(d), nid)
            shm[nid] = ShmTransport(nid, path, aid, boot_id())
        rec = Recorder()
        stub = Stub({**shm, "n2": rec})  # n3: unreachable
        puts = StubPuts(stub)
        reply = answerrows.unpack_allocs(dict(raw), "client")
        acc = _PutResult()
        deadline = time.monotonic() + 10
        if array:
            assert putbatch.answer_rows(reply, n) is not None
            assert putbatch.takes(views, idxs, sizes, reply["alloc_rows"])
            ok, gens = puts._write_answer(kb, views, sizes, idxs, reply, deadline, acc, None)
        else:
            items = with_caps(reply["items"], reply["caps"], 6)
            ok, gens = puts._write_chunk(kb, views, idxs, items, deadline, acc, None)
        outcome.append({
            "ok": ok, "gens": gens, "full": acc.full, "waiting": acc.waiting, "bad": acc.bad, "dedup": acc.dedup,
            "err": repr(acc.first_err), "done": acc.chunks_done, "aborts": puts.aborts, "counts": stub.counts,
            "dropped": stub.dropped, "sent": rec.seen, "arenas": {k: bytes(t.arena[4096:]) for k, t in shm.items()}})
        for t in shm.values():
            t.close()
    per_page, arrays = outcome
    for k in per_page:
        assert arrays[k] == per_page[k], k


def test_host_views_are_what_the_per_value_path_makes():
    from umbp.buffers import as_bytes_view

    arrs = [np.arange(n, dtype=np.uint8) for n in (0, 1, 4096)]
    for values in (arrs, [b"ab", bytearray(b"cd")], np.zeros((3, 16), np.uint8)):
        got = putbatch.host_views(values)
        assert [[bytes(v) for v in p] for p in got] == [[bytes(as_bytes_view(v))] for v in values]
        assert all(len(p) == 1 and type(p[0]) is memoryview and p[0].format == "B" for p in got)
    # anything else is left to as_bytes_view (casts, checks, tensors, Rows)
    for values in ([np.zeros(4, np.float32)], [np.zeros((2, 2), np.uint8)], [np.zeros(8, np.uint8)[::2]],
                   [b"a", np.zeros(1, np.uint8)], [memoryview(b"x")], np.zeros((2, 2), np.float16), []):
        assert putbatch.host_views(values) is None
    assert putbatch.sizes_of([[memoryview(b"abc")], [memoryview(b"")]]) == [3, 0]
    assert putbatch.sizes_of([[memoryview(b"a"), memoryview(b"b")]]) is None and putbatch.sizes_of([None]) is None


def test_rows_that_do_not_fit_the_chunk_keep_the_per_page_path():
    """An answer of other length (a merged multi-slot answer), or a NEW row whose length is not the page's, is left
    to the per-page path (which raises or writes as it always did); malformed rows never reach either (unpack_allocs
    raises ProtocolError: test_wire)."""
    rows = np.frombuffer(answerrows.pack_allocs([0, 1], [0], [5], [6], [100], [4096], [0]), answerrows.ALLOC_ROW)
    views = [[memoryview(bytes(100))], [memoryview(bytes(7))]]
    assert putbatch.answer_rows({"alloc_rows": rows}, 2) is rows
    assert putbatch.answer_rows({"alloc_rows": rows}, 3) is None
    assert putbatch.answer_rows({"items": []}, 2) is None
    assert putbatch.takes(views, [0, 1], [100, 7], rows)  # the EXISTS row's length does not matter
    assert not putbatch.takes(views, [0, 1], [99, 7], rows)
    assert not putbatch.takes([[memoryview(bytes(50)), memoryview(bytes(50))], views[1]], [0, 1], [100, 7], rows)


def test_the_client_is_a_plain_class_its_parts_do_not_keep_alive():
    """``Client`` holds its put and mapped parts (no mixins); they refer to it weakly, so a client dropped without
    ``close()`` is freed, and closed, by reference counting, as before the parts, with the cyclic collector off."""
    import gc
    import weakref

    from umbp.mapped import Mapped

    assert Client.__bases__ == (object,)
    gc.disable()
    try:
        c = Client(metaserver="127.0.0.1:1", namespace="parts")  # connects on the first call only
        assert type(c.puts) is Puts and type(c.maps) is Mapped
        gone = weakref.ref(c)
        del c
        assert gone() is None
    finally:
        gc.enable()
