"""One etcd transaction for several slots' writes (``metaserver/store/combine.py``), against a real etcd.

Two slot stores of one process, each fenced on its own slotmap key: their writes of one turn of the event loop go
out as one transaction that carries both fences; when one slot was deposed (its slotmap key recreated by another
process), that slot gets NotLeader and its pages are not written, the other slot's are."""

from __future__ import annotations

import asyncio

import pytest

from metaserver.store.batcher import ETCD_DEFAULT_TXN_OPS, BatchWriter
from metaserver.store.combine import TxnCombiner
from metaserver.store.persist import EtcdStore
from metaserver.ha.slots import SlotStore
from umbp.config import ETCD_TXN_OPS
from umbp.errors import NotLeader


async def won(store: SlotStore) -> None:
    """Create the slot's leader key and fence the store on it (what a slot leader does at its election)."""
    await store.client.put(store.leader_key, b"me")
    cur = await store.client.get(store.leader_key)
    store.fence(cur.create_revision)


def run(url: str, body, max_ops: int = 128) -> None:
    """``body(root, combiner, slot stores)`` against etcd at ``url``: three slot stores of one process, each fenced
    on its own slotmap key, sharing one combiner of ``max_ops`` (bounded: 30 s)."""
    async def main():
        root = EtcdStore(url, "/umbp-combine")
        await root.wait_ready(10)
        try:
            comb = TxnCombiner(root, max_ops)
            slots = [SlotStore(root, str(s), owns_nodes=False, combiner=comb) for s in range(3)]
            for s in slots:
                await won(s)
            await body(root, comb, slots)
        finally:
            await root.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def items(slot: int, n: int, tag: bytes = b"v") -> list[tuple[bytes, bytes]]:
    return [(b"/umbp-combine/slots/%d/pages/ns/%04d" % (slot, i), tag + b"%d-%d" % (slot, i)) for i in range(n)]


async def values(root: EtcdStore, prefix: bytes) -> dict[bytes, bytes]:
    return {kv.key: kv.value for kv in await root.client.get_prefix(prefix)}


def test_writes_of_one_turn_go_out_as_one_fenced_transaction(etcd):
    async def body(root, comb, slots):
        await asyncio.gather(*(s.write(items(i, 5)) for i, s in enumerate(slots)))
        assert (comb.txns, comb.parts, comb.split) == (1, 3, 0)
        got = await values(root, b"/umbp-combine/slots/")
        assert got == dict(sum((items(i, 5) for i in range(3)), []))
        # more than max_ops in one turn: several transactions, none over the cap, every write applied
        comb.max_ops = 8
        await asyncio.gather(*(s.write(items(i, 5, b"w")) for i, s in enumerate(slots)))
        assert comb.txns == 1 and comb.parts == 3  # 5 + 5 > 8: three transactions of one part each
        got = await values(root, b"/umbp-combine/slots/")
        assert got == dict(sum((items(i, 5, b"w") for i in range(3)), []))

    run(etcd.url, body)


def test_a_deposed_slot_fails_alone_and_writes_nothing(etcd):
    async def body(root, comb, slots):
        deposed = []
        slots[1].on_fenced = lambda: deposed.append(1)
        # another process took slot 1 over: its key was deleted and created again (a new create revision)
        await root.client.delete(slots[1].leader_key)
        await root.client.put(slots[1].leader_key, b"other")
        res = await asyncio.gather(*(s.write(items(i, 4)) for i, s in enumerate(slots)), return_exceptions=True)
        assert res[0] is None and res[2] is None
        assert isinstance(res[1], NotLeader) and "deposed" in str(res[1]) and "other" in str(res[1])
        assert deposed == [1]
        assert (comb.txns, comb.split) == (1, 1)
        got = await values(root, b"/umbp-combine/slots/")
        assert got == dict(items(0, 4) + items(2, 4))  # nothing of slot 1, all of the others

    run(etcd.url, body)


def test_a_cancelled_writer_before_the_send_writes_nothing(etcd):
    async def body(root, comb, slots):
        t0 = asyncio.ensure_future(slots[0].write(items(0, 3)))
        t1 = asyncio.ensure_future(slots[1].write(items(1, 3)))
        await asyncio.sleep(0)  # one loop turn: both queued, the flush scheduled after them
        t1.cancel()
        await t0
        with pytest.raises(asyncio.CancelledError):
            await t1
        assert (comb.txns, comb.parts) == (0, 0)  # one part left: sent on its own
        assert await values(root, b"/umbp-combine/slots/") == dict(items(0, 3))

    run(etcd.url, body)


def test_an_etcd_with_its_default_cap_gets_the_writers_pages_in_transactions_it_accepts(harness):
    """The metaserver writes up to ETCD_TXN_OPS operations a transaction (1024); an etcd started without
    --max-txn-ops refuses more than 128 (TxnTooLarge). Each slot's batch writer and the process's combiner then keep
    to 128 for good, and every page of every slot is written, each once."""
    small = harness.etcd(max_txn_ops=None)

    async def body(root, comb, slots):
        writers = [BatchWriter(s, batch=ETCD_TXN_OPS) for s in slots]
        for w in writers:
            w.start()
        want = {i: items(i, 300) for i in range(3)}
        futs = [w.submit(want[i], [], wait=True) for i, w in enumerate(writers)]  # one turn: 900 ops combined
        await asyncio.wait_for(asyncio.gather(*futs), 20)
        assert comb.max_ops == ETCD_DEFAULT_TXN_OPS and comb.lowered == 1
        assert [w.batch for w in writers] == [ETCD_DEFAULT_TXN_OPS] * 3 and all(w.lowered == 1 for w in writers)
        assert sum(w.ops for w in writers) == 900
        assert await values(root, b"/umbp-combine/slots/") == dict(sum(want.values(), []))
        # small parts whose combination etcd refuses: the combiner regroups them, the writers never see it
        small = [BatchWriter(s, batch=ETCD_TXN_OPS) for s in slots]
        for w in small:
            w.start()
        comb.max_ops = ETCD_TXN_OPS
        more = {i: items(i, 60, b"s") for i in range(3)}  # 180 ops combined
        await asyncio.wait_for(asyncio.gather(*(w.submit(more[i], [], wait=True) for i, w in enumerate(small))), 20)
        assert comb.max_ops == ETCD_DEFAULT_TXN_OPS and comb.lowered == 2
        assert [(w.batch, w.lowered, w.failures) for w in small] == [(ETCD_TXN_OPS, 0, 0)] * 3
        assert await values(root, b"/umbp-combine/slots/") == dict(sum(more.values(), []) + want[0][60:] +
                                                                    want[1][60:] + want[2][60:])
        writers += small
        # the unpartitioned writer on its own store: a 1024-op transaction refused, then 128 at a time
        w = BatchWriter(root, batch=ETCD_TXN_OPS)
        w.start()
        flat = [(b"/umbp-combine/pages/ns/%05d" % i, b"p%d" % i) for i in range(1500)]
        await asyncio.wait_for(w.submit(flat, [], wait=True), 20)
        assert (w.batch, w.lowered, w.ops) == (ETCD_DEFAULT_TXN_OPS, 1, 1500)
        assert await values(root, b"/umbp-combine/pages/") == dict(flat)
        for x in writers + [w]:
            await x.close()

    run(small.url, body, max_ops=ETCD_TXN_OPS)


def test_long_keys_are_written_in_requests_etcd_accepts(etcd):
    """1,500 records of 1.2 KiB keys and 600-byte values (1024 of them would be 1.8 MB, over etcd's 1.5 MiB request
    limit): the writer cuts its transactions by bytes too, so etcd refuses none and every record is written."""
    async def body(root, comb, slots):
        w = BatchWriter(root, batch=ETCD_TXN_OPS)
        w.start()
        recs = [(b"/umbp-combine/long/%04d/" % i + b"ab" * 600, b"v" * 600) for i in range(1500)]
        await asyncio.wait_for(w.submit(recs, [], wait=True), 20)
        assert (w.lowered, w.failures, w.ops) == (0, 0, 1500) and w.txns >= 2
        got = await values(root, b"/umbp-combine/long/")
        assert got == dict(recs)
        await w.close()

    run(etcd.url, body, max_ops=ETCD_TXN_OPS)
