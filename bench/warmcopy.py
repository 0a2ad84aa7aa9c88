"""What a warm copy (``metaserver/ha/standby.py``) spends applying a leader's commits, against the baseline of the same
events applied one page at a time in the same run, and against what the leader spent making them; and what a
takeover costs with the warm copy (``take``) against a full load of the same records (parse + ``TableDirectory.load``).

A leader ``TableDirectory`` allocates and commits ``--pages`` pages of 4,000 bytes in COMMITs of ``--batch`` pages into
an empty node (``--full``: a node with room for a quarter of them, so that past it every ALLOC evicts about as many
pages, whose records are rewritten or deleted); each COMMIT's commit record is encoded as the leader's writer
encodes it (``TableRecord.value``) and becomes one etcd watch event. Three copies then apply the same events,
each timed in CPU seconds (best of ``--rounds``):

- one page at a time: each record parsed (``records_of``) and each page filed on its own (``_put_page``);
  records rewritten or deleted by evictions (``--full``) go through ``_shrink_batch`` as ``apply`` sends them;
- ``apply`` one watch batch per COMMIT (a quiet leader: every record its own watch response);
- ``apply_backlog`` of the same batches queued (a copy paced while its process served: pieces merged up to
  ``warmpace.PIECE_BYTES``).

Printed: CPU microseconds a page of each, their ratio to the baseline, and the leader's own ALLOC + COMMIT CPU a
page (table only) for scale; then the takeover: wall milliseconds of ``take`` on the caught-up copy against a full load
of the records etcd would hold at the end (their kvs parsed by ``PageRecords``, then ``TableDirectory.load``), best of
``--rounds``. Nothing asserts on speed; each way must end with the leader's page count, and
``tests/unit/test_standby_batch.py`` checks that every way ends in the same table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aetcd.rpc as rpc  # noqa: E402
import msgpack  # noqa: E402

from metaserver.store.persist import EtcdStore  # noqa: E402
from metaserver.ha.standby import WarmDirectory  # noqa: E402
from metaserver.table.directory import TableDirectory  # noqa: E402

NODE = "n0"


def node_event(store: EtcdStore, capacity: int, rev: int) -> rpc.Event:
    rec = {"node_id": NODE, "host": "127.0.0.1", "port": 9, "pid": 1, "capacity": capacity, "arena_id": b"A" * 16,
           "arena_path": "", "boot_id": "", "hostname": "h", "transports": ["tcp"], "lease_ttl": 5.0, "rdma": None}
    return rpc.Event(type=0, kv=rpc.KeyValue(key=store.node_key(NODE), value=msgpack.packb(rec, use_bin_type=True),
                                             mod_revision=rev, create_revision=rev))


def leader_events(store: EtcdStore, pages: int, batch: int, capacity: int) -> tuple[list[list], float, int, dict]:
    """One watch batch per COMMIT, the leader's CPU a page, its pages at the end and the records etcd holds then
    (name -> its last put event). A batch holds what the leader's writer writes for it: the records its ALLOC's
    evictions left (rewritten without the evicted pages, or deleted when empty), then the COMMIT's own record."""
    d = TableDirectory(namer=store.batch_name)
    d.add_space(NODE, capacity)
    held: dict[bytes, rpc.Event] = {}
    out, gen, rev, cpu = [], 1, 10, 0.0

    created: dict[bytes, int] = {}

    def event(name: bytes, value: bytes | None) -> rpc.Event:
        nonlocal rev
        rev += 1
        if value is None:
            held.pop(name, None)
            return rpc.Event(type=1, kv=rpc.KeyValue(key=name, mod_revision=rev))
        ev = rpc.Event(type=0, kv=rpc.KeyValue(key=name, value=value, mod_revision=rev,
                                               create_revision=created.setdefault(name, rev)))
        held[name] = ev
        return ev

    for b in range(pages // batch):
        keys = [f"k{b}/{j}".encode() for j in range(batch)]
        t = time.process_time()
        items, afx = d.alloc("default", keys, [4000] * batch, None, gen, time.monotonic())
        _, fx = d.commit("default", keys, [it[4] for it in items], time.monotonic())
        cpu += time.process_time() - t
        gen += batch
        evs = [event(rec.name, rec.value()) for rec in dict.fromkeys(afx.batches)]
        evs += [event(rec.name, rec.value()) for rec in fx.recs]
        out.append(evs)
    return out, cpu / pages, d.objects, held


def copy_cpu(store: EtcdStore, batches: list[list], capacity: int, how: str, rounds: int, objects: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        w = WarmDirectory(store, TableDirectory)
        w.dir, w.loaded = w.make_dir(), True
        w.apply([node_event(store, capacity, 1)])
        t = time.process_time()
        if how == "one page at a time":
            for evs in batches:
                for ev in evs:
                    if ev.type != 0 or ev.kv.key in w.batches:  # a record rewritten or deleted: as ``apply`` does
                        w._shrink_batch(ev.kv.key, ev.kv if ev.type == 0 else None)
                        continue
                    for p in store.records_of(ev.kv):  # _put_pages' path for a run it does not file at once
                        w._put_page(p)
        elif how == "apply":
            for evs in batches:
                w.apply(evs)
        else:
            for evs in batches:
                w.backlog.add(evs)
            w.apply_backlog()
        best = min(best, time.process_time() - t)
        assert w.dir.objects == objects, (how, w.dir.objects, objects)
    return best


def takeover_ms(store: EtcdStore, batches: list[list], capacity: int, held: dict, rounds: int,
                objects: int) -> tuple[float, float]:
    """(wall ms of ``take`` on a copy that applied every batch, wall ms of a full load of the records held at the
    end), each best of ``rounds``."""
    warm = load = float("inf")
    desc = {NODE: ({"capacity": capacity}, 0)}
    kvs = [ev.kv for ev in held.values()]
    for _ in range(rounds):
        w = WarmDirectory(store, TableDirectory)
        w.dir, w.loaded = w.make_dir(), True
        w.apply([node_event(store, capacity, 1)])
        for evs in batches:
            w.apply(evs)
        t = time.perf_counter()
        h = w.take()
        warm = min(warm, time.perf_counter() - t)
        assert h.pages == objects and not h.stale, (h.pages, objects, len(h.stale))
        t = time.perf_counter()
        recs = store.page_records()
        recs.add(kvs)
        d = TableDirectory()
        d.load(desc, recs)
        load = min(load, time.perf_counter() - t)
        assert d.objects == objects
    return warm * 1e3, load * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=64_000)
    ap.add_argument("--batch", type=int, default=128, help="pages a COMMIT (a commit record)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--full", action="store_true",
                    help="a node with room for a quarter of the pages: past it, every COMMIT evicts about as many")
    ap.add_argument("--no-baseline", action="store_true", help="skip the one-page-at-a-time copy (slow at 1 M pages)")
    args = ap.parse_args()
    store = EtcdStore("127.0.0.1:1", "/umbp")  # its key and record formats only: never connected
    capacity = (args.pages // 4 if args.full else args.pages + 64) * 8192
    batches, leader, objects, held = leader_events(store, args.pages, args.batch, capacity)
    n = args.batch * len(batches)
    print(f"bench/warmcopy.py: {n:,} pages in commit records of {args.batch}"
          f"{', into a full node (evictions rewrite records)' if args.full else ''}; CPU us a page, "
          f"best of {args.rounds}")
    print(f"  {'leader ALLOC + COMMIT (table only, for scale)':<52} {leader * 1e6:6.2f}")
    base = None
    if not args.no_baseline:
        base = copy_cpu(store, batches, capacity, "one page at a time", args.rounds, objects) / n
        print(f"  {'copy: one page at a time (baseline)':<52} {base * 1e6:6.2f}")
    for how in ("apply", "apply_backlog"):
        c = copy_cpu(store, batches, capacity, how, args.rounds, objects) / n
        vs = f"{base / c:4.1f}x the baseline, " if base else ""
        print(f"  {'copy: ' + how:<52} {c * 1e6:6.2f}   {vs}{c / leader:4.2f} of the leader's")
    warm, load = takeover_ms(store, batches, capacity, held, args.rounds, objects)
    print(f"takeover of {objects:,} pages ({len(held):,} commit records), wall ms, best of {args.rounds}:")
    print(f"  {'warm copy: take':<52} {warm:9.2f}")
    print(f"  {'full load: parse + TableDirectory.load':<52} {load:9.2f}   {load / max(warm, 1e-6):,.0f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
