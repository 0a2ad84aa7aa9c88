"""Unit test of the metaserver's background step (``Metaserver.tick``): every duty together examines at most
STEP_BUDGET entries per tick, so a backlog of expired allocations, read leases and a lost node's pages is worked off
in counted slices with the event loop served in between, and no duty starves behind another. The directory is real;
etcd is never reached (its writes stay queued in the batch writer)."""

from __future__ import annotations

import asyncio

from metaserver.ha import service
from metaserver.table.entry import NEW
from metaserver.ha.partition import Partition
from metaserver.ha.service import Metaserver
from metaserver.table.directory import TableDirectory
from transport.objformat import ALIGN
from umbp.config import MetaserverConfig

PAGE = ALIGN - 64


def fill(d, ns: str, n: int, gen: int, commit: bool) -> list[bytes]:
    keys = [f"{ns}{i}".encode() for i in range(n)]
    items, _ = d.alloc(ns, keys, [PAGE] * n, None, gen, 0.0)
    assert all(it[0] == NEW for it in items)
    if commit:
        assert all(d.commit(ns, keys, [it[4] for it in items], 0.0)[0])
    return keys


def test_a_backlog_is_worked_off_in_slices_of_the_step_budget(monkeypatch):
    async def main():
        cfg = MetaserverConfig(pending_ttl_s=1.0, read_lease_s=1.0, high_watermark=1.0)
        ms = Partition(cfg, "127.0.0.1:1", 1).servers["0"]  # a one-slot pool's slot server
        monkeypatch.setattr(Metaserver, "serving", property(lambda self: True))
        monkeypatch.setattr(service, "STEP_BUDGET", 500)
        ms.settled.set()
        d = ms.dir
        assert isinstance(d, TableDirectory)
        d.add_space("n1", 4000 * ALIGN)
        d.add_space("n2", 4000 * ALIGN)
        ready = fill(d, "r", 2400, 10_000, commit=True)
        fill(d, "p", 1500, 20_000, commit=False)  # PENDING, expired at tick time
        leases = [d.lookup("r", ready[i:i + 10], 0.0)[0] for i in range(0, 1200, 10)]  # 1,200 pins, expired too
        d.detach_space("n2")  # a lost node: its READY pages dropped by the ticks (its PENDING ones went at once)
        pending, objects = d.pending, d.objects
        assert pending > 500 and objects == len(ready)
        work, slices = 0, 0
        for _ in range(100):
            did = ms.tick(1e9)
            assert 0 <= did <= 500  # the step budget holds for every tick
            if not did:
                break
            work += did
            slices += 1
            d.check()
        assert d.pending == 0 and d.pinned == 0 and not d.dying
        assert all(not d.release(lease) for lease in leases)  # each expired exactly once, by a tick
        dropped = objects - d.objects
        assert dropped > 500 and d.objects == len(ready) - dropped
        backlog = pending + len(leases) + dropped
        assert work == backlog and slices == -(-backlog // 500)  # full slices but the last
        print(f"\nbacklog of {backlog} entries worked off in {slices} ticks of at most 500")

    asyncio.run(main())


def test_parked_pages_leave_their_commit_record_and_come_back_into_it():
    """A lost node's pages are parked: a rewrite of their commit record meanwhile leaves them out (they are not in
    the directory); when the node returns with its arena they are filed again and the record is rewritten with
    them; when it does not return, the record is rewritten without them. Read from the writer's queue (etcd is
    never reached here): the value each record would be written with."""
    from types import SimpleNamespace

    from metaserver.table.records import pages_of

    async def main():
        ms = Partition(MetaserverConfig(), "127.0.0.1:1", 1).servers["0"]
        d = ms.dir
        assert isinstance(d, TableDirectory)
        d.add_space("n1", 64 * ALIGN)
        d.add_space("n2", 64 * ALIGN)
        keys = [b"k%02d" % i for i in range(20)]
        items, fx = d.alloc("ns", keys, [PAGE] * 20, None, 100, 0.0)
        assert {it[1] for it in items} == {"n1", "n2"}  # one COMMIT over both nodes: one record
        _, fx = d.commit("ns", keys, [it[4] for it in items], 0.0)
        ms._apply(fx)
        (name,) = [k for k in ms.writer._queue if ms.store.is_batch(k)]

        def record() -> list[bytes] | None:
            value = ms.writer._queue[name][0]
            value = value.value() if not isinstance(value, (bytes, type(None))) else value  # a TableRecord
            return None if value is None else [p[0] for p in pages_of(value)]

        on = {node: [k for k, it in zip(keys, items) if it[1] == node] for node in ("n1", "n2")}
        assert record() == keys
        for round_, returns in (("back", True), ("gone", False)):
            ms.rejoin.parked["n2"] = (b"A" * 16, 64 * ALIGN, 1e18, [], None)  # no disk tier
            _, fx = d.detach_space("n2", park=True)
            ms._apply(fx)
            ms.rejoin.finish_drop("n2")
            assert len(ms.rejoin.parked["n2"][3]) == len(on["n2"])
            gone = on["n1"][0]
            _, fx = d.remove("ns", [gone])  # a page of n1 leaves: the record is rewritten without it ...
            ms._apply(fx)
            on["n1"].remove(gone)
            assert record() == on["n1"]  # ... and without the parked pages
            if returns:
                d.add_space("n2", 64 * ALIGN)
                back = SimpleNamespace(node_id="n2", arena_id=b"A" * 16, capacity=64 * ALIGN, disk_id=None)
                kept = ms.rejoin.unpark(back)
                assert kept == len(on["n2"]) and sorted(record()) == sorted(on["n1"] + on["n2"])
                d.check()
            else:
                _a, _c, _d, recs, _disk = ms.rejoin.parked.pop("n2")
                ms.rejoin.forget_parked("n2", recs, arena=True)
                assert record() == on["n1"]  # rewritten without them for good
                assert ms.store.arena_key("n2") in ms.writer._queue

    asyncio.run(main())
