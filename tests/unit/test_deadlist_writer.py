"""Dead lists, the writer side (metaserver/table/commits.py ``CommitRecords.leaving``/``_dead_list``, ``TableRecord.written``,
metaserver/store/batcher.py ``_written``): a page that leaves a record whose value is in etcd is named by the open
dead-list record (a segment of no page) instead of rewriting its record; a record half gone is compacted, one with
nothing left deleted; a dead-list record is deleted once every record it names has a value without those pages in
etcd. Over a dict store and the real batch writer: what etcd holds loads (``PageRecords``) as the table holds its
pages whenever the writer is idle, dead lists count for the removal barrier, a load of dead lists compacts and drops
them, and far fewer etcd operations than pages leave."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import numpy as np

from metaserver.store.batcher import BatchWriter
from metaserver.table.commits import DEAD_KEYS_FREE
from metaserver.table.directory import TableDirectory
from metaserver.table.entry import READY
from metaserver.table.records import SEG_DEAD_VERSION, is_segment, unpack_segment
from metaserver.table.snapshot import PageRecords

PREFIX = b"/umbp/pages/"
NODES = {"n0": 1 << 24, "n1": 1 << 24}


class DictStore:
    """etcd in a dict (``write`` as ``EtcdStore.write``); create revisions kept across rewrites; ``gate``: a
    transaction waits for it."""

    def __init__(self):
        self.kv: dict[bytes, bytes] = {}
        self.create: dict[bytes, int] = {}
        self.rev = 0
        self.ops = 0
        self.gate: asyncio.Event | None = None

    async def write(self, items):
        if self.gate is not None:
            await self.gate.wait()
        assert len({k for k, _ in items}) == len(items)
        self.rev += 1
        for k, v in items:
            self.ops += 1
            if v is None:
                self.kv.pop(k, None)
                self.create.pop(k, None)
            else:
                self.kv[k] = v
                self.create.setdefault(k, self.rev)

    def kvs(self):
        return [SimpleNamespace(key=k, value=v, mod_revision=self.create[k], create_revision=self.create[k])
                for k, v in sorted(self.kv.items(), key=lambda kv: self.create[kv[0]])]

    def dead_lists(self) -> list[bytes]:
        return [k for k, v in self.kv.items() if is_segment(v) and v[1] == SEG_DEAD_VERSION]


def directory(term: int = 1) -> TableDirectory:
    d = TableDirectory()
    for node, cap in NODES.items():
        d.add_space(node, cap)
    seq = iter(range(1, 1 << 30))
    d.commits.namer = lambda ns: b"%s%s/+%x.%x" % (PREFIX, ns.encode(), term, next(seq))
    return d


def submit(w: BatchWriter, fx) -> None:
    w.submit([(r.name, r) for r in fx.recs] + [(r.name, r) for r in dict.fromkeys(fx.batches)], [], wait=False)


def commit(d: TableDirectory, w: BatchWriter, keys: list[bytes], gen: int) -> None:
    items, fx = d.alloc("a", keys, [5000] * len(keys), None, gen, 1.0)
    submit(w, fx)
    _, fx = d.commit("a", keys, [it[4] for it in items], 2.0)
    submit(w, fx)


def loaded(store: DictStore) -> tuple[set, TableDirectory]:
    recs = PageRecords(PREFIX)
    recs.add(store.kvs())
    d = TableDirectory()
    stale, rejected = d.load({n: ({"capacity": c}, 0) for n, c in NODES.items()}, recs)
    assert not stale and not rejected
    return ready(d), d


def ready(d: TableDirectory) -> set:
    c = d.cols
    rows = np.flatnonzero(c["state"] == READY)
    return set(zip([d.ns_names[i] for i in c["ns"].take(rows).tolist()], [d.key_of(r) for r in rows.tolist()],
                   d.node_names.take(c["node"].take(rows)).tolist(), d.offsets_of(rows), c["gen"].take(rows).tolist()))


def keys_of(lo: int, hi: int) -> list[bytes]:
    return [i.to_bytes(8, "little") * 4 for i in range(lo, hi)]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_scattered_removals_ride_in_dead_lists_and_etcd_always_loads_as_the_table():
    async def main():
        store = DictStore()
        w = BatchWriter(store, batch=64, inflight=2)
        w.start()
        d = directory()
        for i in range(8):
            commit(d, w, keys_of(i * 500, i * 500 + 500), 1000 + i * 1000)
            await w.flush(10)
        assert len(store.kv) >= 4 and not store.dead_lists()
        ops0 = store.ops
        rng = random.Random(7)
        alive = keys_of(0, 4000)
        rng.shuffle(alive)
        removed = 0
        saw_dead = False
        while alive:
            batch = alive[:rng.randint(5, 60)]
            alive = alive[len(batch):]
            ok, fx = d.remove("a", batch)
            assert all(ok)
            removed += len(batch)
            submit(w, fx)
            barrier = w.removals_durable()
            assert barrier is not None, "a death queued is a removal: an ALLOC waits for it"
            await asyncio.wait_for(asyncio.shield(barrier), 10)
            # the barrier passed: what etcd holds loads as exactly the pages still here (no dead page reloads)
            got, _ = loaded(store)
            assert got == ready(d), removed
            saw_dead |= bool(store.dead_lists())
            d.check()
        await w.flush(10)
        assert saw_dead and d.commits.dead_pages > 1000
        assert set(store.kv) == set(store.dead_lists()) and len(store.kv) <= DEAD_KEYS_FREE, (
            "everything gone: every record deleted, dead-list keys kept only to overwrite")
        assert loaded(store)[0] == set()
        ops = store.ops - ops0
        print(f"\n{ops} etcd ops for {removed} pages removed, {d.commits.dead_pages} named by dead lists")
        assert ops < 0.5 * removed, (ops, removed)  # the records' rewrites would be about one a removed page
        await w.close()

    run(main())


def test_dead_lists_stay_until_their_records_are_compacted_and_a_load_keeps_counting_them():
    async def main():
        store = DictStore()
        w = BatchWriter(store, batch=1024, inflight=1)
        w.start()
        d = directory()
        for i in range(4):
            commit(d, w, keys_of(i * 100, i * 100 + 100), 1000 + i * 1000)
            await w.flush(10)
        # a few pages of each record: dead-list entries, no rewrite (fewer than half gone)
        gone = [k for i in range(4) for k in keys_of(i * 100, i * 100 + 10)]
        _, fx = d.remove("a", gone)
        submit(w, fx)
        await w.flush(10)
        (dl,) = store.dead_lists()
        seg = unpack_segment(store.kv[dl])
        assert seg.n == 0 and len(seg.dead) == 40 and len(seg.dead_recs) == 4
        got, d2 = loaded(store)
        assert got == ready(d) and len(got) == 360
        # a load of it: no etcd work (the deaths count toward each record's compaction); half gone: compacted, and
        # the dead list needed no more
        w2 = BatchWriter(store, batch=1024, inflight=1)
        w2.start()
        ops = store.ops
        assert not d2.effects()
        assert store.ops == ops and store.dead_lists() == [dl]
        _, fx = d2.remove("a", [k for i in range(4) for k in keys_of(i * 100 + 10, i * 100 + 50)])
        assert {r.name for r in fx.batches} == {r.name for r in d2.commits.records.values()}, "each compacted"
        submit(w2, fx)
        await w2.flush(10)
        await asyncio.sleep(0)
        await w2.flush(10)
        assert d2.commits._dead_free == [dl], "compacted: the dead list is needed no more, its key kept to overwrite"
        got = ready(d2)
        assert len(store.kv) == 5 and loaded(store)[0] == got and len(got) == 200
        for k, v in store.kv.items():
            assert k == dl or unpack_segment(v).n == 50 and v[1] != SEG_DEAD_VERSION
        # the next death overwrites the kept key: one put, no delete
        _, fx = d2.remove("a", keys_of(50, 51))
        assert [r.name for r in fx.batches] == [dl]
        submit(w2, fx)
        await w2.flush(10)
        assert store.dead_lists() == [dl] and unpack_segment(store.kv[dl]).dead.tolist() == [1000 + 50]
        assert d2.commits._dead_free == []
        assert loaded(store)[0] == ready(d2)
        await w.close()
        await w2.close()

    run(main())


def test_a_dead_list_is_deleted_only_once_the_compaction_it_waits_for_is_durable():
    async def main():
        store = DictStore()
        w = BatchWriter(store, batch=1024, inflight=2)
        w.start()
        d = directory()
        commit(d, w, keys_of(0, 100), 1000)
        await w.flush(10)
        (rec,) = list(d.commits.records.values())
        _, fx = d.remove("a", keys_of(0, 10))
        submit(w, fx)
        await w.flush(10)
        (dl,) = store.dead_lists()
        store.gate = asyncio.Event()  # etcd holds what comes next
        _, fx = d.remove("a", keys_of(10, 60))  # half gone: compaction
        assert rec in fx.batches
        submit(w, fx)
        await asyncio.sleep(0.05)
        assert dl in store.kv and not d.commits._dead_free, "the dead list is needed while its compaction is not in etcd"
        store.gate.set()
        store.gate = None
        await w.flush(10)
        await asyncio.sleep(0)
        await w.flush(10)
        assert d.commits._dead_free == [dl] and len(unpack_segment(store.kv[rec.name]).gen) == 40
        assert loaded(store)[0] == ready(d)
        await w.close()

    run(main())
