"""The batch writer's removal barrier (``BatchWriter.removals_durable``, metaserver/store/batcher.py): an ALLOC is
answered only once every removal queued before it (a commit record rewritten without pages that left, a delete) is
in etcd, since its places may lie in their extents. Over an in-memory store double whose transactions wait for a
gate named by their first key, so transactions finish in any order."""

from __future__ import annotations

import asyncio

from metaserver.store.batcher import BatchWriter
from metaserver.table.commits import TableRecord
from metaserver.table.directory import TableDirectory
from metaserver.table.records import pages_of, unpack_segment
from transport.wire import Status
from umbp.errors import Unavailable

from test_metaserver_persistence import run


class GatedStore:
    """etcd in a dict; a transaction whose first key is in ``gates`` waits for that event; ``fail`` keys' transactions
    raise Unavailable."""

    def __init__(self):
        self.kv: dict[bytes, bytes | None] = {}
        self.gates: dict[bytes, asyncio.Event] = {}
        self.fail: set[bytes] = set()
        self.started: list[bytes] = []

    async def write(self, items):
        first = items[0][0]
        self.started.append(first)
        gate = self.gates.get(first)
        if gate is not None:
            await gate.wait()
        if first in self.fail:
            raise Unavailable("metaserver", "etcd transaction failed: injected", Status.UNAVAILABLE)
        for k, v in items:
            self.kv[k] = v


def committed_record(d: TableDirectory, keys: list[bytes]) -> TableRecord:
    items, _ = d.alloc("ns", keys, [100] * len(keys), None, 100, 1.0)
    _, fx = d.commit("ns", keys, [it[4] for it in items], 2.0)
    (rec,) = fx.recs
    return rec


async def settle(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_nothing_waits_without_a_removal_and_a_removal_waits_for_everything_queued_before_it():
    async def main():
        store = GatedStore()
        w = BatchWriter(store, batch=1, inflight=2)
        w.start()
        store.gates[b"a"] = gate_a = asyncio.Event()
        w.submit([(b"a", b"1")], [], wait=False)  # a plain put, held in etcd
        await settle()
        assert w.removals_durable() is None, "no removal queued: an ALLOC does not wait"
        store.gates[b"d"] = gate_d = asyncio.Event()
        w.submit([], [b"d"], wait=False)  # a removal, submitted after "a"
        w.submit([(b"c", b"1")], [], wait=False)  # a later plain put: not waited for
        fut = w.removals_durable()
        assert fut is not None and w.removals_durable() is fut, "ALLOCs waiting for the same removals share one"
        gate_d.set()  # the removal is in etcd, but "a" (queued before it) is not
        await settle()
        assert store.kv.get(b"d", 0) is None and store.kv[b"c"] == b"1" and not fut.done()
        gate_a.set()
        await asyncio.wait_for(fut, 5)
        assert w.removals_durable() is None and w.barrier_waits == 2
        await w.close()

    run(main())


def test_a_dead_list_and_a_record_rewritten_without_pages_are_removals_once():
    async def main():
        store = GatedStore()
        w = BatchWriter(store, batch=4, inflight=1)
        w.start()
        d = TableDirectory()
        d.add_space("node-a", 1 << 20)
        rec = committed_record(d, [b"k0", b"k1", b"k2", b"k3"])
        r = rec.name
        store.gates[r] = gate = asyncio.Event()
        assert not rec.shrunk
        w.submit([(r, rec)], [], wait=False)  # a COMMIT's new record: no removal
        assert w.removals_durable() is None
        await settle()  # its put in flight
        _, fx = d.remove("ns", [b"k1"])
        (dl,) = fx.batches
        assert dl is not rec and dl.shrunk and not rec.shrunk, "a page left it: the dead list naming it is a removal"
        w.submit([(dl.name, dl)], [], wait=False)
        assert dl.shrunk is False, "the submission took the removal"
        first = w.removals_durable()
        assert first is not None
        _, fx = d.remove("ns", [b"k2"])
        assert fx.batches == [rec] and rec.shrunk, "half its pages gone: compacted, a rewrite that is a removal"
        w.submit([(r, rec)], [], wait=False)  # queued behind its in-flight op
        assert rec.shrunk is False, "the submission took the removal"
        fut = w.removals_durable()
        assert fut is not None
        await settle()
        assert not first.done() and not fut.done(), "both wait for the in-flight op queued before them"
        gate.set()
        await asyncio.wait_for(asyncio.gather(first, fut), 5)
        assert [p[0] for p in pages_of(store.kv[r])] == [b"k0", b"k3"], "the rewrite went after the in-flight op"
        assert unpack_segment(store.kv[dl.name]).dead_recs == [r]
        assert store.started == [r, dl.name], "the in-flight op, then the dead list and the rewrite in one transaction"
        await w.close()

    run(main())


def test_a_dropped_removal_fails_its_barrier_and_every_later_one_and_abort_fails_the_rest():
    async def main():
        store = GatedStore()
        w = BatchWriter(store, batch=1, inflight=1, retry_s=0.0)
        w.on_drop = lambda n, err: None
        w.start()
        store.fail.add(b"gone")
        w.submit([], [b"gone"], wait=False)
        fut = w.removals_durable()
        assert fut is not None
        await asyncio.wait_for(asyncio.gather(fut, return_exceptions=True), 5)
        assert isinstance(fut.exception(), Unavailable)
        later = w.removals_durable()  # the lost removal is never durable: no ALLOC placed after it is answered
        assert later is not None and isinstance(later.exception(), Unavailable)
        w2 = BatchWriter(GatedStore(), batch=1, inflight=1)
        w2.store.gates[b"x"] = asyncio.Event()
        w2.start()
        w2.submit([], [b"x"], wait=False)
        held = w2.removals_durable()
        await settle()
        await w2.abort(RuntimeError("deposed"))
        assert held.done() and isinstance(held.exception(), (Unavailable, RuntimeError))  # in flight: cancelled

    run(main())
