"""The metaserver's etcd writers without etcd: the batch writer and the generation counter over an in-memory store
double (same calls as ``metaserver.store.persist.EtcdStore``: op_put, op_delete, txn, write, get_value, compare_and_put)."""

from __future__ import annotations

import asyncio

import pytest

from metaserver.store.batcher import BatchWriter
from metaserver.store.generations import GenCounter
from transport.wire import Status
from umbp.errors import Unavailable


class MemoryStore:
    """etcd in a dict. ``fail`` transactions raise Unavailable first; ``cas_races`` compare_and_puts lose."""

    gen_key = b"/umbp/gen"

    def __init__(self, fail: int = 0, cas_races: int = 0):
        self.kv: dict[bytes, bytes] = {}
        self.txns: list[list] = []
        self.fail = fail
        self.cas_races = cas_races
        self.gate: asyncio.Event | None = None  # when set, a transaction waits for it (to build up a queue)
        self.in_txn = asyncio.Event()  # set once a transaction has started (and waits at the gate, if any)
        self.cas_ok = 0  # successful compare_and_put calls (generation reservations)

    def op_put(self, key, value, lease=None):
        return ("put", key, value)

    def op_delete(self, key):
        return ("del", key)

    async def txn(self, ops, compare=None):
        self.in_txn.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            self.fail -= 1
            raise Unavailable("metaserver", "etcd transaction failed: injected", Status.UNAVAILABLE)
        keys = [op[1] for op in ops]
        assert len(keys) == len(set(keys)), "etcd rejects a transaction with a key twice"
        for op in ops:
            if op[0] == "put":
                self.kv[op[1]] = op[2]
            else:
                self.kv.pop(op[1], None)
        self.txns.append(ops)
        return True

    async def write(self, items):
        """The writer's path: (key, value | None) pairs, as ``EtcdStore.write``."""
        await self.txn([("put", k, v) if v is not None else ("del", k) for k, v in items])

    async def get_value(self, key):
        return self.kv.get(key)

    async def compare_and_put(self, key, value, expect):
        if self.cas_races:
            self.cas_races -= 1
            self.kv[key] = str(int(self.kv.get(key, b"1")) + 7).encode()  # another metaserver moved it
            return False
        if self.kv.get(key) != expect:
            return False
        self.kv[key] = value
        self.cas_ok += 1
        return True


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_batch_writer_coalesces_orders_and_acknowledges_only_durable_writes():
    async def main():
        store = MemoryStore()
        store.gate = asyncio.Event()
        w = BatchWriter(store, batch=4, inflight=1)
        w.start()
        first = w.submit([(b"a", b"1")], [], wait=True)
        await asyncio.wait_for(store.in_txn.wait(), 5)  # the worker took "a" and waits in its transaction
        later = w.submit([(b"a", b"2"), (b"b", b"1"), (b"c", b"1")], [b"d"], wait=True)
        w.submit([(b"b", b"2")], [], wait=False)  # replaces the unsent put of b
        assert not first.done() and not later.done()
        store.gate.set()
        await asyncio.wait_for(asyncio.gather(first, later), 5)
        assert await w.flush(5)
        assert store.kv == {b"a": b"2", b"b": b"2", b"c": b"1"}
        assert [len(t) for t in store.txns] == [1, 4]  # a alone, then a b c d coalesced into one transaction
        assert (w.txns, w.ops, w.pending()) == (2, 5, 0)
        await w.close()

    run(main())


def test_batch_writer_retries_then_fails_its_waiters():
    async def main():
        store = MemoryStore(fail=2)
        w = BatchWriter(store, batch=8, inflight=2, retry_s=5)
        w.start()
        await asyncio.wait_for(w.submit([(b"k", b"v")], [], wait=True), 5)
        assert store.kv == {b"k": b"v"} and w.failures == 2
        store.fail = 1000
        w.retry_s = 0.2
        fut = w.submit([(b"x", b"y")], [], wait=True)
        with pytest.raises(Unavailable, match="injected"):
            await asyncio.wait_for(fut, 5)
        assert b"x" not in store.kv
        queued = w.submit([(b"z", b"1")], [], wait=True)
        await w.abort(Unavailable("metaserver", "deposed", Status.UNAVAILABLE))
        with pytest.raises(Unavailable):
            await queued

    run(main())


def test_generation_counter_hands_out_unique_increasing_values_across_restarts_and_races():
    async def main():
        store = MemoryStore(cas_races=2)
        g = GenCounter(store, span=100)
        await g.start()
        got = [g.take_nowait(1) for _ in range(30)]
        assert got == list(range(got[0], got[0] + 30))
        reserved = store.cas_ok
        big = await g.take(60)  # past half a range: a refill runs in the background
        assert big >= got[-1] + 1
        for _ in range(1000):  # bounded poll (each step yields to the loop) until that refill reserved a range
            if store.cas_ok > reserved:
                break
            await asyncio.sleep(0.001)
        assert store.cas_ok == reserved + 1
        more = await g.take(150)  # more than a range: waits for reservations
        assert more >= big + 60
        limit = int(store.kv[store.gen_key])
        restarted = GenCounter(store, span=100)  # a new leader: everything below the stored limit may be used
        await restarted.start()
        assert restarted.take_nowait(1) >= limit
        return True

    assert run(main())
