"""A warm standby applies a watch batch's runs of page puts together (``WarmDirectory._put_pages``), and its runs of
deletes (``_delete_pages``): the table, the held pages and the unreadable records it ends with are exactly what
applying every event on its own gives (``_put_page`` of ``page_record`` per put, ``_delete_page`` per delete, as the
standby did before), on randomised event streams that hit every
case: new pages, pages put again unchanged and changed, extents taken (held, placed when freed), keys given twice in
one run, unreadable records and their readable successors, deletes of present, held and unknown pages, and node
records that come, change capacity and go. The same for commit records (one etcd record per COMMIT): new ones,
rewrites without some of their pages, deletes, unreadable ones, a record put and rewritten in one watch batch."""

from __future__ import annotations

import random

import aetcd.rpc as rpc
import msgpack
import pytest

from metaserver.table.entry import READY
from metaserver.store.persist import ARENA, NODE, PAGE, EtcdStore
from metaserver.table.directory import TableDirectory
from metaserver.table.load import fingerprint
from metaserver.ha import warmpace
from metaserver.ha.standby import WarmDirectory
from transport.objformat import ARENA_DATA_START

UNIT = 8192
NODES = ("n0", "n1", "n2")
SLOTS = 48  # extents per node: small, so that puts collide


def node_rec(node_id: str, slots: int = SLOTS) -> dict:
    return {"node_id": node_id, "host": "127.0.0.1", "port": 9, "pid": 1, "capacity": slots * UNIT,
            "arena_id": b"A" * 16, "arena_path": "", "boot_id": "", "hostname": "h", "transports": ["tcp"],
            "lease_ttl": 5.0, "rdma": None}


class Stream:
    """Watch events in the leader's formats, with revisions."""

    def __init__(self, store: EtcdStore, seed: int):
        self.store = store
        self.rng = random.Random(seed)
        self.rev = 100
        self.keys = [f"key{i:03d}".encode() for i in range(120)]

    def event(self, typ: int, key: bytes, value: bytes = b"") -> rpc.Event:
        self.rev += 1
        return rpc.Event(type=typ, kv=rpc.KeyValue(key=key, value=value, mod_revision=self.rev,
                                                   create_revision=self.rev))

    def node(self, node_id: str, slots: int = SLOTS) -> rpc.Event:
        return self.event(0, self.store.node_key(node_id), msgpack.packb(node_rec(node_id, slots), use_bin_type=True))

    def page(self) -> rpc.Event:
        rng, s = self.rng, self.store
        key = rng.choice(self.keys)
        if rng.random() < 0.06:  # unreadable: not a record
            return self.event(0, s.page_key("default", key), b"\x93\x01")
        parent = rng.choice(self.keys) if rng.random() < 0.5 else None
        plen = rng.choice((5000, 5000, 5000, 12000))  # one or two units
        value = s.page_value(rng.choice(NODES), ARENA_DATA_START + rng.randrange(SLOTS - 1) * UNIT, plen,
                             self.rev + 1, parent)
        return self.event(0, s.page_key("default", key), value)

    def sweep(self) -> list:
        """Delete every key (held pages and unreadable records go with them) and put every node's record at full
        capacity, so a fresh run can follow."""
        return [self.event(1, self.store.page_key("default", k)) for k in self.keys] + [self.node(n) for n in NODES]

    def fresh(self, caps: dict[str, int]) -> list:
        """Puts of distinct keys at distinct extents of the nodes that have a space (``caps``: node -> capacity;
        after a sweep all their extents are free), some naming parents among each other."""
        rng, s = self.rng, self.store
        places = [(n, slot) for n in sorted(caps) for slot in rng.sample(range(0, caps[n] // UNIT - 1, 2), 10)]
        rng.shuffle(places)
        keys = rng.sample(self.keys, len(places))
        out = []
        for i, (k, (node, slot)) in enumerate(zip(keys, places)):
            parent = keys[rng.randrange(i)] if i and rng.random() < 0.7 else None
            out.append(self.event(0, s.page_key("default", k), s.page_value(
                node, ARENA_DATA_START + slot * UNIT, rng.choice((5000, 12000)), self.rev + 1, parent)))
        return out

    def batch(self) -> list:
        rng = self.rng
        out = []
        for _ in range(rng.randint(1, 40)):
            x = rng.random()
            if x < 0.62:
                out.append(self.page())
            elif x < 0.90:
                out.append(self.event(1, self.store.page_key("default", rng.choice(self.keys))))
            elif x < 0.93:
                out.append(out[-1] if out and out[-1].type == 0 else self.page())  # the same put twice in a row
            elif x < 0.97:
                out.append(self.node(rng.choice(NODES), rng.choice((SLOTS, SLOTS, SLOTS // 2))))
            else:
                out.append(self.event(1, self.store.node_key(rng.choice(NODES))))
        return out


def reference_apply(w: WarmDirectory, events: list) -> None:
    """What the standby did before it batched: every event on its own, in order."""
    store = w.store
    for ev in events:
        kv = ev.kv
        kind = store.kind_of(kv.key)
        if kind == PAGE:
            if ev.type == 0:
                w._put_page(store.page_record(kv))
            else:
                w._delete_page(kv.key)
        elif kind == NODE or kind == ARENA:
            node_id = store.node_of(kv.key)
            records = w.live if kind == NODE else w.arenas
            rec = store.node_record(kv) if ev.type == 0 else None
            if rec is None:
                records.pop(node_id, None)
            else:
                records[node_id] = rec
            w._sync_node(node_id)


def comparable(d: TableDirectory) -> dict:
    """``fingerprint``, plus each commit record's rows as (key, gen) (what its rewrite would list) and, under
    prefix-lru, each READY page's parent key and its (tier, stamp) victim order on its node (ties by name)."""
    fp = fingerprint(d)
    fp["records"] = {r.name: sorted((d.key_of(x), int(d.cols["gen"][x])) for x in r.live().tolist())
                     for r in d.commits.records.values()}
    fp["records"] = {n: v for n, v in fp["records"].items() if v}
    if d.links.linking:
        fp["links"] = sorted((ns, k, p) for ns, ks, ps in d.links.snapshot() for k, p in zip(ks, ps))
        c = d.cols
        for node_id, node in d.node_by_id.items():
            rows = d._rows_of(node)
            rows = rows[c["state"].take(rows) == READY]
            fp["order"][node_id] = [(ns, k) for _, ns, k in sorted(zip(
                d.links.order(rows).tolist(), [d.ns_names[i] for i in c["ns"].take(rows).tolist()],
                [d.key_of(r) for r in rows.tolist()]))]
    return fp


def warm(store: EtcdStore, policy: str = "lru") -> WarmDirectory:
    w = WarmDirectory(store, lambda: TableDirectory(policy=policy))
    w.dir = w.make_dir()
    w.loaded = True
    return w


@pytest.mark.parametrize("policy", ["lru", "prefix-lru"])
@pytest.mark.parametrize("seed", range(12))
def test_batched_page_puts_equal_one_event_at_a_time(policy, seed):
    store = EtcdStore("127.0.0.1:1", "/umbp")  # its key formats only: never connected
    stream = Stream(store, seed)
    a, b = warm(store, policy), warm(store, policy)
    first = [stream.node(n) for n in NODES]
    a.apply(first)
    reference_apply(b, first)
    fast = most = 0
    deletes = a.fast_deletes
    for i in range(60):
        events = stream.sweep() if i % 10 == 8 else stream.fresh(b.caps) if i % 10 == 9 else stream.batch()
        before = a.fast_runs
        a.apply(events)
        fast += a.fast_runs - before
        reference_apply(b, events)
        assert comparable(a.dir) == comparable(b.dir)
        assert a.held == b.held and a.held_on == b.held_on and a.junk == b.junk
        a.dir.check()
        most = max(most, a.dir.objects)
    assert most >= 30  # every fresh run filed pages
    assert a.fast_deletes > deletes  # runs of deletes went at once too
    assert fast >= 6, (fast, a.held, a.junk)  # clean runs filed at once (at least the fresh ones)


# ----------------------------------------------------------------------------------------------------------------
# commit records (one etcd record per COMMIT): new ones filed as runs, rewrites and deletes taking pages out


class RecordStream(Stream):
    """``Stream`` plus commit records: new ones (1-6 pages of distinct keys, extents that may collide), rewrites
    without some of their pages (what an eviction or removal writes), deletes, unreadable ones."""

    def __init__(self, store: EtcdStore, seed: int):
        super().__init__(store, seed)
        self.records: dict[bytes, list] = {}  # name -> its pages, as etcd holds them now
        self.n = 0

    def record(self) -> rpc.Event:
        rng, s = self.rng, self.store
        self.n += 1
        name = b"%sdefault/+1.%x" % (s._pages, self.n)
        if rng.random() < 0.05:
            return self.event(0, name, b"\x93\x01")  # unreadable
        keys = rng.sample(self.keys, rng.randint(1, 6))
        pages = [[k, rng.choice(NODES), ARENA_DATA_START + rng.randrange(SLOTS - 1) * UNIT,
                  rng.choice((5000, 5000, 12000)), self.rev + 1 + i, rng.choice(self.keys) if rng.random() < 0.5
                  else None] for i, k in enumerate(keys)]
        self.records[name] = pages
        return self.event(0, name, msgpack.packb(pages, use_bin_type=True))

    def shrink(self) -> rpc.Event:
        rng = self.rng
        if not self.records:
            return self.record()
        name = rng.choice(sorted(self.records))
        pages = self.records[name]
        keep = [p for p in pages if rng.random() < 0.6]
        if not keep or rng.random() < 0.2:
            del self.records[name]
            return self.event(1, name)
        self.records[name] = keep
        return self.event(0, name, msgpack.packb(keep, use_bin_type=True))

    def batch(self) -> list:
        rng = self.rng
        out = []
        for _ in range(rng.randint(1, 30)):
            x = rng.random()
            out.append(self.record() if x < 0.5 else self.shrink() if x < 0.85 else self.page() if x < 0.92 else
                       self.node(rng.choice(NODES), rng.choice((SLOTS, SLOTS, SLOTS // 2))))
        return out

    def sweep(self) -> list:
        gone = [self.event(1, name) for name in sorted(self.records)]
        self.records = {}
        return gone + super().sweep()


def reference_apply_records(w: WarmDirectory, events: list) -> None:
    """One event at a time: a commit record's pages one ``_put_page`` each (``records_of``), a rewrite or delete of a
    known record through ``_shrink_batch``; every other event as ``reference_apply``."""
    store = w.store
    for ev in events:
        kv = ev.kv
        if store.kind_of(kv.key) == PAGE and store.is_batch(kv.key):
            if ev.type == 0 and kv.key not in w.batches:
                for p in store.records_of(kv):
                    w._put_page(p)
            else:
                w._shrink_batch(kv.key, kv if ev.type == 0 else None)
        else:
            reference_apply(w, [ev])


def held_names(w: WarmDirectory) -> dict:
    return {name: p[:8] + ((p[8].name,) if not isinstance(p[8], (bytes, type(None))) else (p[8],))
            for name, p in w.held.items()}


@pytest.mark.parametrize("policy", ["lru", "prefix-lru"])
@pytest.mark.parametrize("seed", range(8))
def test_commit_records_batched_equal_one_event_at_a_time(policy, seed):
    store = EtcdStore("127.0.0.1:1", "/umbp")
    stream = RecordStream(store, seed)
    a, b = warm(store, policy), warm(store, policy)
    first = [stream.node(n) for n in NODES]
    a.apply(first)
    reference_apply_records(b, first)
    most = shrunk = 0
    for i in range(60):
        events = stream.sweep() if i % 10 == 9 else stream.batch()
        a.apply(events)
        reference_apply_records(b, events)
        assert comparable(a.dir) == comparable(b.dir)
        assert held_names(a) == held_names(b) and a.held_on == b.held_on and a.junk == b.junk
        assert sorted(a.batches) == sorted(b.batches)
        a.dir.check()
        most = max(most, a.dir.objects)
        # every page in the copy is in its record as etcd holds it now, with its place and generation
        d = a.dir
        for rec in d.commits.records.values():
            rows = rec.live()
            for key, node_id, off, plen, gen in zip([d.key_of(r) for r in rows.tolist()],
                                                    d.node_names.take(d.cols["node"].take(rows)).tolist(),
                                                    d.offsets_of(rows), d.code_arr.take(d.cols["size"].take(rows)),
                                                    d.cols["gen"].take(rows).tolist()):
                assert [key, node_id, off, int(plen), gen] in [p[:5] for p in stream.records.get(rec.name, [])]
                shrunk += 1
    assert most >= 10 and shrunk > 0


# ----------------------------------------------------------------------------------------------------------------
# the backlog (a copy paced while its process serves): received batches applied in pieces, merged or split


@pytest.mark.parametrize("piece", [1, 300, 2000, 1 << 20])  # every event its own piece .. every batch merged
@pytest.mark.parametrize("seed", range(4))
def test_backlog_in_pieces_equals_one_event_at_a_time(monkeypatch, piece, seed):
    """Batches queued and applied by ``apply_backlog`` in pieces of ``piece`` bytes (split or merged), a few
    batches at a time, end as applying every event on its own does; the backlog's counts return to zero."""
    monkeypatch.setattr(warmpace, "PIECE_BYTES", piece)
    store = EtcdStore("127.0.0.1:1", "/umbp")
    stream = RecordStream(store, seed)
    a, b = warm(store), warm(store)
    first = [stream.node(n) for n in NODES]
    a.apply(first)
    reference_apply_records(b, first)
    for i in range(40):
        events = stream.sweep() if i % 10 == 9 else stream.batch()
        a.backlog.add(events)
        reference_apply_records(b, events)
        if i % 3 == 2:  # a few batches wait, then go
            a.apply_backlog()
            assert not a.backlog and a.backlog.lag == 0 and a.backlog.lag_bytes == 0
            assert a.rev == stream.rev
            assert comparable(a.dir) == comparable(b.dir)
            assert held_names(a) == held_names(b) and a.junk == b.junk
            a.dir.check()


def test_a_piece_that_ends_inside_a_transaction_leaves_rev_one_short(monkeypatch):
    """Events of one etcd transaction share a revision: a copy that applied only some of them has not applied
    that revision (a takeover's catch_up waits for it), and the rest brings ``rev`` to it."""
    monkeypatch.setattr(warmpace, "PIECE_BYTES", 1)
    store = EtcdStore("127.0.0.1:1", "/umbp")
    w = warm(store)
    nodes = [rpc.Event(type=0, kv=rpc.KeyValue(key=store.node_key(n), value=msgpack.packb(node_rec(n)),
                                               mod_revision=7, create_revision=7)) for n in NODES]
    w.backlog.add(nodes)
    w.apply_backlog(until=0.0)  # one piece: one event
    assert w.rev == 6 and w.backlog.lag == 2 and set(w.live) == {"n0"}
    w.apply_backlog()
    assert w.rev == 7 and w.backlog.lag == 0 and set(w.live) == set(NODES)
