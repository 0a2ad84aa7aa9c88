"""The metaserver's commit path without etcd: the directory's commit records (``TableDirectory`` named by
``EtcdStore.batch_name``: test_tablerecords.py checks the table's records in depth) and the batch writer's
acknowledgements when submissions share keys, over the in-memory store double of
test_metaserver_persistence."""

from __future__ import annotations

import asyncio


from metaserver.store.batcher import TXN_BYTES, BatchWriter, cut
from metaserver.store.persist import EtcdStore
from metaserver.table.records import pages_of
from metaserver.table.directory import TableDirectory

from transport.wire import Status
from umbp.errors import TxnTooLarge, Unavailable

from tablekit import etcd_pages
from test_metaserver_persistence import MemoryStore, run


def test_commits_join_their_namespaces_open_segment_until_the_writer_takes_it():
    """Group commit: the COMMITs of a namespace that come before the writer takes its open record join it (128
    pages at most while any key is long: BATCH_PAGES, else SEGMENT_PAGES), each COMMIT puts it again (the writer's
    queue merges the puts and their waiters); once taken (``value``) no COMMIT joins it."""
    store = EtcdStore("127.0.0.1:1", "/umbp")  # no connection is made: names only
    store.fence(41)
    d = TableDirectory(namer=store.batch_name)
    d.add_space("node-a", 1 << 30)
    d.add_space("node-b", 1 << 30)
    recs, want = [], []
    for r, (ns, parents) in enumerate((("ns1", None), ("other", [b"\x01" * 32] * 3), ("ns1", [None, b"p" * 70, b"q"]))):
        keys = [ns.encode() + b"/%d/%d" % (r, i) + b"\xff" * i for i in range(3)]
        items, _ = d.alloc(ns, keys, [4000, 1, 70000], parents, 100 + 10 * r, 1.0)
        _, fx = d.commit(ns, keys, [it[4] for it in items], 2.0)
        assert len(fx.recs) == 1
        recs += fx.recs
        want += [[k, *it[1:], None] for k, it in zip(keys, items)]  # no parent kept: the table keeps no links
    assert recs[2] is recs[0], "the second COMMIT of ns1 joined its open record"
    keys = [b"big/%d" % i for i in range(300)]
    items, _ = d.alloc("ns1", keys, [100] * 300, None, 1000, 1.0)
    _, fx = d.commit("ns1", keys, [it[4] for it in items], 2.0)
    assert fx.recs[0] is recs[0] and len(fx.recs) == 3
    recs = list(dict.fromkeys(recs + fx.recs))
    want += [[k, *it[1:], None] for k, it in zip(keys, items)]
    assert [len(r.rows) for r in recs] == [128, 3, 128, 50]  # 128 at most a record: long keys
    assert [r.name for r in recs] == [b"/umbp/pages/%s/+29.%x" % (ns, i + 1) for i, ns in
                                      enumerate([b"ns1", b"other", b"ns1", b"ns1"])]
    assert sorted(p for r in recs for p in pages_of(r.value())) == sorted(want)
    items, _ = d.alloc("ns1", [b"late"], [100], None, 5000, 1.0)
    _, fx = d.commit("ns1", [b"late"], [items[0][4]], 2.0)
    assert [r.name for r in fx.recs] == [b"/umbp/pages/ns1/+29.5"], "taken records are closed: a new one"
    # a page leaving the directory: a dead list names it beside its record as written; the last ones delete it
    first = recs[0]
    written = first.value()
    names = [p[0] for p in pages_of(written)]
    _, fx = d.remove("ns1", [names[1]])
    (dl,) = fx.batches
    assert dl is not first and dl.id == 0 and fx.deletes == []
    assert dl.name == b"/umbp/pages/ns1/+29.6", "a dead list is a record of its own, named as one"
    etcd = {first.name: written, dl.name: dl.value()}
    assert sorted(etcd_pages(etcd, b"/umbp/pages/")) == sorted([names[0]] + names[2:])
    _, fx = d.remove("ns1", names)
    assert first in fx.batches and first.value() is None
    d.check()


def test_batch_writer_acknowledges_each_submission_once_its_last_op_is_written():
    async def main():
        store = MemoryStore()
        store.gate = asyncio.Event()
        w = BatchWriter(store, batch=3, inflight=1)
        w.start()
        head = w.submit([(b"h", b"0")], [], wait=True)
        await asyncio.wait_for(store.in_txn.wait(), 5)  # "h" in flight, the rest queues behind it
        a = w.submit([(b"k1", b"a"), (b"k2", b"a"), (b"k1", b"a2")], [], wait=True)  # k1 twice in one submission
        b = w.submit([(b"k2", b"b"), (b"k3", b"b"), (b"h", b"1")], [b"k4"], wait=True)  # supersedes a's k2
        c = w.submit([(b"k5", b"c")], [], wait=False)
        assert c is None and not a.done() and not b.done()
        store.gate.set()
        await asyncio.wait_for(asyncio.gather(head, a, b), 5)
        assert await w.flush(5)
        assert store.kv == {b"h": b"1", b"k1": b"a2", b"k2": b"b", b"k3": b"b", b"k5": b"c"}
        # one op per key: k1 k2 k3 (head's h was in flight: its newer op waits its turn), then h k4 k5
        assert [[op[1] for op in t] for t in store.txns] == [[b"h"], [b"k1", b"k2", b"k3"], [b"h", b"k4", b"k5"]]
        assert (w.txns, w.ops, w.pending()) == (3, 7, 0)
        await w.close()

    run(main())


def test_batch_writer_abort_fails_every_waiter_of_a_shared_key():
    async def main():
        store = MemoryStore()
        store.gate = asyncio.Event()
        w = BatchWriter(store, batch=2, inflight=1)
        w.start()
        first = w.submit([(b"x", b"1")], [], wait=True)
        await asyncio.wait_for(store.in_txn.wait(), 5)
        a = w.submit([(b"y", b"1"), (b"z", b"1")], [], wait=True)
        b = w.submit([(b"y", b"2")], [], wait=True)  # y now has two waiters
        await w.abort(RuntimeError("deposed"))
        for fut in (first, a, b):
            assert fut.done() and type(fut.exception()).__name__ in ("Unavailable", "RuntimeError")
        assert type(a.exception()) is RuntimeError and type(b.exception()) is RuntimeError
        assert store.kv == {} and w.pending() == 0

    run(main())


def test_batch_writer_drains_a_flood_of_deletes_in_order_with_keys_resubmitted_behind_in_flight_ones():
    """A flood (a node's pages dropped at once) taken by several workers: every op written exactly once (the
    workers' transactions may land in any order), in submission order per key, a key resubmitted while its first op is in flight written after it, and the queue's
    head found again after every take (the queue is taken from the head thousands of times with no insert between)."""
    async def main():
        store = MemoryStore()
        w = BatchWriter(store, batch=16, inflight=4)
        w.start()
        n = 5000
        keys = [b"p/%05d" % i for i in range(n)]
        w.submit([(k, b"v") for k in keys], [], wait=False)
        assert await w.flush(10)
        store.txns.clear()
        store.gate = asyncio.Event()
        store.in_txn.clear()
        done = w.submit([], keys, wait=True)  # the flood: n deletes, no insert among them
        await asyncio.wait_for(store.in_txn.wait(), 5)
        again = w.submit([(keys[0], b"back")], [], wait=True)  # keys[0]'s delete is in flight: this waits its turn
        store.gate.set()
        await asyncio.wait_for(asyncio.gather(done, again), 10)
        assert await w.flush(5)
        written = [op for t in store.txns for op in t]
        assert len(written) == n + 1 and all(len(t) <= 16 for t in store.txns)
        assert sorted(op[1] for op in written if op[0] == "del") == keys  # each delete once
        assert written.index(("put", keys[0], b"back")) > written.index(("del", keys[0]))
        assert store.kv == {keys[0]: b"back"} and w.pending() == 0
        await w.close()

    run(main())


class CappedStore(MemoryStore):
    """An etcd double whose cap on operations per transaction is ``cap`` (etcd's --max-txn-ops)."""

    def __init__(self, cap: int):
        super().__init__()
        self.cap = cap
        self.refused: list[int] = []

    async def txn(self, ops, compare=None):
        if len(ops) > self.cap:
            self.refused.append(len(ops))
            raise TxnTooLarge("metaserver", "etcd transaction refused: too many operations in one transaction",
                              Status.UNAVAILABLE)
        return await super().txn(ops, compare)


def test_batch_writer_keeps_to_what_etcd_accepts_once_refused_for_size():
    """A writer of 1024 ops a transaction against an etcd capped at 100: refused at 1024, then at etcd's default
    128, then writes 64 at a time for good; every op written once, in order per key, waiters answered."""
    async def main():
        store = CappedStore(100)
        w = BatchWriter(store, batch=1024, inflight=2)
        w.start()
        puts = [(b"k%04d" % i, b"a") for i in range(3000)]
        first = w.submit(puts, [], wait=True)
        await asyncio.wait_for(first, 10)
        assert store.refused[:2] == [1024, 128] and set(store.refused) <= {1024, 128}
        assert (w.batch, w.lowered) == (64, 2)
        assert all(len(t) <= 64 for t in store.txns) and sum(len(t) for t in store.txns) == 3000
        again = w.submit([(b"k0001", b"b")], [b"k0002"], wait=True)  # later ops on written keys
        await asyncio.wait_for(again, 10)
        assert store.kv[b"k0001"] == b"b" and b"k0002" not in store.kv and len(store.kv) == 2999
        assert w.pending() == 0 and w.failures == 0
        await w.close()

    run(main())


def test_txn_too_large_is_told_apart_from_other_etcd_failures():
    from metaserver.store.persist import unavailable
    e = unavailable("transaction", RuntimeError("<AioRpcError status = StatusCode.INVALID_ARGUMENT details = "
                                               '"etcdserver: too many operations in txn request">'))
    assert type(e) is TxnTooLarge and "too many operations" in str(e) and isinstance(e, Unavailable)
    assert type(unavailable("transaction", RuntimeError("connection refused"))) is Unavailable


def test_transactions_are_cut_by_bytes_as_well_as_operations():
    """Records with long keys (a 512-byte string key is 1 KiB of hex in its etcd key): no transaction carries more
    than TXN_BYTES of keys and values (etcd refuses requests over its --max-request-bytes), except an op that is
    larger on its own, which goes alone; every op written once."""
    async def main():
        store = MemoryStore()
        w = BatchWriter(store, batch=1024, inflight=2)
        w.start()
        big = [(b"/umbp/pages/ns/" + b"%04d" % i + b"ab" * 600, b"v" * 600) for i in range(2000)]
        huge = (b"/umbp/pages/ns/huge", b"x" * (TXN_BYTES + 1))
        await asyncio.wait_for(w.submit(big + [huge], [], wait=True), 10)
        sizes = [sum(len(op[1]) + len(op[2]) for op in t) for t in store.txns]
        assert all(s <= TXN_BYTES for s, t in zip(sizes, store.txns) if len(t) > 1)
        assert [len(t) for t in store.txns if t[0][1] == huge[0]] == [1]
        assert sum(len(t) for t in store.txns) == 2001 and len(store.kv) == 2001 and w.lowered == 0
        assert cut(big, 0, 1024) == TXN_BYTES // len(big[0][0] + big[0][1])
        assert cut([(b"k", b"v")] * 3000, 10, 1024) == 1034 and cut([huge, huge], 0, 1024) == 1
        await w.close()

    run(main())
