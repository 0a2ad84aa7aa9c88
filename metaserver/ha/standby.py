"""Warm standby: a standby metaserver's copy of the page table (``TableDirectory``), kept current from an etcd watch.

A standby loads the table once (``EtcdStore.load_at``: one snapshot at revision R, built by ``TableDirectory.load``,
the very code a leader's full load runs), then applies every change from R + 1 on as the watch delivers it, as
batches of rows (``metaserver/ha/warmrows.py``): a commit record put files its pages at once (each node's run of
extents reserved where the leader placed them); a record rewritten without pages, or deleted, takes the rows it no
longer lists out (removals, evictions, dropped nodes); page records of the layout before commit records are put and
deleted; leased node records and durable arena records that appear, disappear or change capacity add, drop or
remake the node (its pages held meanwhile). On winning the election the new leader calls ``catch_up(W)`` for its
winning revision W (the creation of the leader key, itself an event under the watched prefix, so "applied up to W"
is exact), stops the watch and ``take``s the table: no page is read from etcd again, so a takeover costs O(events
not applied yet + nodes + held pages) instead of O(pages). A partitioned pool's slot keeps the same copy of its
slot's table (``make_dir`` makes a ``slots.SlotTable``: its nodes' allocators are the slot's regions).

What it holds is only what etcd holds. What a leader keeps in memory alone (read leases, PENDING allocations,
recency from reads) is not in etcd, so a takeover starts without it, exactly as after a full load; recency is commit
order: every row is stamped with its record's revision (a commit record's create revision, which its rewrites keep),
as the full load stamps it.

Invariant (tests compare ``tableload.fingerprint`` of a taken table with that of a full load of the same etcd
state, and the stale keys and records to rewrite of both): after ``catch_up(W)`` and ``take``, the table is what
``TableDirectory.load`` builds from a snapshot at W:

- a node for every node with a valid record (the leased one preferred over the arena record), of the capacity that
  record states, not placeable (the leader marks the node provisional until it re-registers);
- every page of a record whose node is known and whose extent fits there, READY, under its commit record;
- pages that cannot stand (unreadable, node unknown, extent taken or out of range) come back as stale: an etcd key
  for the leader to delete, or their commit record (a ``TableRecord``) for the leader to rewrite without them, as
  after a full load.

What it approximates: the leader's batch writer runs several transactions at once, so the put of a page can reach
etcd before the delete of the page whose freed extent it reuses (or the rewrite of its commit record without it).
Such a put waits in ``held`` until that delete arrives (it is retried then) or the takeover (retried once more,
else stale); filed late, it keeps its revision's stamp, so its place in recency is its commit place. A node
record that changes capacity remakes that node from its current pages (in their recency order): a page that no
longer fits waits as held. Pages committed in one etcd transaction share a revision, so their order among
themselves is not defined (``fingerprint`` lists them by name).

Failures: every etcd error is retried (the watch resumes after the last received revision, RETRY_S doubling up to
RETRY_MAX_S); a compacted resume revision means events are lost, so the standby loads again. None of this writes to
etcd: a standby never writes (the rewrites its table queues as rows leave are the leader's, written already, and
dropped), and a takeover's stale deletes and rewrites go through the leader's fenced writer.

Under load (a partitioned pool's process serves slots of its own while it keeps copies of others'), what the watch
delivers is queued and applied paced (``metaserver/ha/warmpace.py``): a copy lags by at most about
``warmpace.LAG_MAX_BYTES`` of records (STATS ``warm_copies``: ``lag`` events, ``lag_bytes``), which a takeover's
``catch_up`` and ``take`` apply first (O(events not applied yet), as the invariant states).

Costs: the initial load is a full load (``TableDirectory.load``: about 0.65 CPU-us a page past etcd's read and the
records' parse, ``table/load.py``; built in a thread, so the event loop keeps answering meanwhile). A watch batch's
runs of page puts are parsed at once (``PageRecords``) and each node's pages filed as one ``warmrows.file_rows``
(numpy work, one ``reserve`` a run of adjacent extents); a run that names a key present already or twice goes one
page at a time (``_put_page``), which ends the same (``tests/unit/test_standby_batch.py`` compares the two on random
streams) but pays numpy's per-call cost on every page (about 200 us a page: the exception, a batch writer's race). A
run of deletes is one lookup and one ``drop_rows``; a rewrite O(its record's pages) numpy; a node change O(its
rows). ``take`` O(nodes + held pages). ``bench/warmcopy.py`` (64,000 pages in records of 128, 10-byte keys, the
shared 2-core VM, 2026-12-06): 5.0-6.9 CPU-us a page applied (0.6-0.9 of the leader's ALLOC + COMMIT of them; a
third of it the records' parse into ``Entry`` objects, ``records.batch_entries``), and a takeover's ``take`` 0.09 ms
against 291 ms for a full load of the same records (parse + ``TableDirectory.load``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from metaserver.store import gcpolicy
from metaserver.store.fullload import describe, gc_paused, node_descs
from metaserver.store.persist import ARENA, NODE, PAGE, EtcdStore
from metaserver.table.records import SEG_DEAD_VERSION, UNREADABLE, is_segment, listed_pairs, unpack_segment
from metaserver.table.directory import TableDirectory
from metaserver.table.tiers import twin_id
from metaserver.ha.warmpace import Backlog, Pace, wait_event
from metaserver.ha.warmrows import drop_rows, file_rows, leaving_record, node_pages
from umbp.errors import Unavailable

log = logging.getLogger("umbp.metaserver")

CATCHUP_S = 5.0  # a takeover waits this long without progress of the watch before it loads in full instead
RETRY_S = 0.1  # first pause after an etcd failure of the standby's load or watch ...
RETRY_MAX_S = 2.0  # ... doubling up to this
HELD_RETRY = 64  # held pages of a node retried when one of its pages goes (more wait for the takeover)
_PUT = 0  # etcd Event.EventType PUT (DELETE is 1)


@dataclass
class Handover:
    """What a takeover gets from a warm standby (``WarmDirectory.take``)."""

    dir: TableDirectory
    descs: dict[str, tuple[dict, int]]  # as ``node_descs``: the nodes to load as provisional members
    stale: list  # etcd keys to delete (bytes) and commit records to rewrite without their held pages (TableRecord)
    revision: int  # last revision applied
    pages: int  # pages in the table handed over
    load_pages: int  # pages the standby's last load read (before the takeover, not during it)
    load_s: float  # how long that load took
    events: int  # watch events applied since that load
    reloads: int  # loads after the first (compacted watch revisions)


class WarmDirectory:
    """A standby's page table, loaded once and then fed by an etcd watch. ``start`` runs it in the background;
    ``catch_up`` + ``stop`` + ``take`` hand it to a takeover. Only one takeover may take it. ``make_dir`` makes an
    empty table (the service's ``_make_dir``: a ``TableDirectory``, or a slot's ``SlotTable``).

    A held page is ``(stamp, node_id, ns, key, offset, payload_len, gen, parent, record)``: ``record`` the etcd key
    of its commit record or of its own page record (``EtcdStore.is_batch`` tells which)."""

    def __init__(self, store: EtcdStore, make_dir: Callable[[], TableDirectory]):
        self.store = store
        self.make_dir = make_dir
        self.dir: TableDirectory | None = None
        self.rev = 0  # last revision applied (the snapshot's, then each event's)
        self.live: dict[str, dict] = {}  # node id -> leased node record
        self.arenas: dict[str, dict] = {}  # node id -> durable arena record
        self.caps: dict[str, int] = {}  # node id -> capacity its node was made with
        self.disk_caps: dict[str, int] = {}  # and its disk tier's (metaserver/table/tiers.py), when it has one
        self.held: dict[tuple[str, bytes], tuple] = {}  # (ns, key) -> page that has no place yet
        self.held_on: dict[str, dict[tuple[str, bytes], None]] = {}  # node id -> its held (ns, key)s
        self.junk: set[bytes] = set()  # etcd keys of unreadable page and commit records
        self.batches: set[bytes] = set()  # readable commit records read (etcd keys)
        self.carried: dict = {}  # those with a dead list -> it (``snapshot.PageRecords.carried``): a takeover's to drop
        self.loaded = False
        self.loading = False
        self.load_pages = 0
        self.load_s = 0.0
        self.loads = 0
        self.events = 0
        self.fast_runs = 0  # runs of page puts filed at once (``_put_pages``)
        self.fast_deletes = 0  # runs of page deletes removed at once (``_delete_pages``)
        self.seen = 0  # last revision received from etcd (the watch resumes after it); ``rev`` <= ``seen``
        self.backlog = Backlog()  # received, not applied yet (metaserver/ha/warmpace.py)
        self.pace = Pace()
        self._moved = asyncio.Event()  # set whenever the copy changes: catch_up waits on it
        self._task: asyncio.Task | None = None

    def state(self) -> dict:
        """For STATS: loaded, events applied since the load, events received and not applied yet (``lag``) and
        their records' bytes, the time rested for a serving loop."""
        b = self.backlog
        return {"loaded": self.loaded, "events": self.events, "lag": b.lag, "lag_bytes": b.lag_bytes,
                "paused_s": round(self.pace.paused_s, 3)}

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name="metaserver-warm-standby")

    async def stop(self) -> None:
        """Stop following etcd; the copy stays as it is (events are applied whole, never half)."""
        t, self._task = self._task, None
        if t is not None:
            t.cancel()
            await asyncio.gather(t, return_exceptions=True)

    async def run(self) -> None:
        """Load (unless loaded already), then follow the watch, until cancelled; what it receives is applied by
        ``Pace.drain``, a task of its own. etcd failures are retried (RETRY_S doubling to RETRY_MAX_S): the watch
        resumes after the last received revision; a compacted one makes it load again."""
        drain = asyncio.create_task(self.pace.drain(self.backlog, self.apply_backlog), name="metaserver-warm-apply")
        follow = asyncio.create_task(self._follow(), name="metaserver-warm-watch")
        try:
            done, _ = await asyncio.wait({drain, follow}, return_when=asyncio.FIRST_COMPLETED)
            if drain in done and not drain.cancelled() and drain.exception() is not None:
                # a bug applying an event must not pass silently: the copy stops, a takeover loads in full
                log.error("metaserver: warm standby stopped applying events; a takeover will load the directory "
                          "in full", exc_info=drain.exception())
                self._moved.set()
        finally:
            drain.cancel()
            follow.cancel()
            await asyncio.gather(drain, follow, return_exceptions=True)

    async def _follow(self) -> None:
        delay = RETRY_S
        reload = not self.loaded  # a copy stopped and started again resumes after its last revision
        while True:
            try:
                if reload:
                    self.backlog.clear()  # the load's snapshot includes them
                    await self._load()
                    reload = False
                async with contextlib.aclosing(self.store.watch(self.seen + 1)) as stream:  # closed on leaving
                    async for batch in stream:
                        if batch is None:
                            reload = True
                            break
                        if batch:
                            self.backlog.add(batch)
                            self.seen = max(self.seen, batch[-1].kv.mod_revision)
                            self.pace.more.set()
                        delay = RETRY_S
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a bug here must not pass silently: the takeover loads in full
                if not isinstance(e, Unavailable):
                    log.exception("metaserver: warm standby stopped; a takeover will load the directory in full")
                    self.loading = False
                    self._moved.set()
                    return
                self.loading = False
                self._moved.set()  # a takeover waiting on a load in progress re-evaluates
                log.warning("metaserver: warm standby: %s; retrying in %.1fs", e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)

    async def _load(self) -> None:
        self.loading = True
        t0 = time.monotonic()
        with gc_paused():
            rev, live, arenas, pages = await self.store.load_at()
            d = self.make_dir()
            descs = node_descs(live, arenas)
            held: list[tuple] = []  # pages of commit records the load could not file: a copy holds them
            # in a thread: the loop keeps answering meanwhile
            stale, rejected = await asyncio.to_thread(d.load, descs, pages, held)
            d.commits.take()  # rewrites for the pages it could not file: the leader's to write, at a takeover
        if self.dir is not None:
            gcpolicy.thaw("warm standby: reloaded")  # the copy it replaces may be frozen cyclic garbage now
        self.dir, self.rev, self.seen = d, rev, rev
        self.live = {r.get("node_id"): r for r in live}
        self.arenas = {r.get("node_id"): r for r in arenas}
        self.caps = {node_id: desc["capacity"] for node_id, (desc, _) in descs.items()}
        self.disk_caps = {node_id: desc["disk_capacity"] for node_id, (desc, _) in descs.items()
                          if desc.get("disk_capacity")}
        self.held, self.held_on, self.junk = {}, {}, set()
        self.batches = set(pages.batches)
        self.carried = dict(pages.carried)
        for p in stale + rejected + held:
            if p[1] is None:
                self.junk.add(p[8])
            else:
                self._hold(p)
        self.load_pages = len(pages)
        self.load_s = time.monotonic() - t0
        self.loads += 1
        self.events = 0
        self.loaded = True
        self.loading = False
        self._moved.set()
        log.info("metaserver: warm standby: %d pages of %d nodes at revision %d, loaded in %.2fs", d.objects,
                 len(descs), rev, self.load_s)
        print(f"metaserver: warm standby: {d.objects} pages at revision {rev} (loaded in {self.load_s:.2f}s)",
              flush=True)

    # -- events ------------------------------------------------------------------------------------------------
    def apply_backlog(self, until: float | None = None) -> None:
        """Apply what was received, in ``Backlog.take``'s pieces, until none is left or ``time.perf_counter()``
        passes ``until``. ``rev`` names the last revision applied whole: a piece that ends inside a transaction's
        events leaves it one short."""
        backlog = self.backlog
        while backlog:
            events = backlog.take()
            self.apply(events)
            last = events[-1].kv.mod_revision
            if backlog.continues(last):
                self.rev = last - 1  # the rest of that transaction is still to come
            if until is not None and time.perf_counter() >= until:
                return

    def apply(self, events: list) -> None:
        """Apply one batch of watch events (raw protobuf, in revision order). Synchronous: a batch is applied whole."""
        store = self.store
        run: list = []  # page events of one kind in a row: puts applied together (``_put_pages``), deletes too
        putting = True  # (``_delete_pages``)
        named: set = set()  # the commit records among the run's puts

        def flush() -> None:
            nonlocal run
            if run:
                (self._put_pages if putting else self._delete_pages)(run)
                run = []
                named.clear()

        for ev in events:
            kv = ev.kv
            kind = store.kind_of(kv.key)
            if kind == PAGE:
                if store.is_batch(kv.key):
                    if kv.key in named:
                        flush()  # put in this run already: this is its rewrite
                    if ev.type == _PUT and is_segment(kv.value) and kv.value[1] == SEG_DEAD_VERSION:
                        flush()  # a dead list: the records it names were put before it (revision order)
                        self._apply_dead(kv.value, kv.key)
                    elif kv.key in self.carried:
                        del self.carried[kv.key]  # deleted, or rewritten without its dead list
                    if ev.type != _PUT or kv.key in self.batches:
                        flush()  # a commit record rewritten (pages left it) or deleted: in order with the runs
                        self._shrink_batch(kv.key, kv if ev.type == _PUT else None)
                        continue
                put = ev.type == _PUT
                if put != putting:
                    flush()
                    putting = put
                run.append(kv if put else kv.key)
                if put:
                    named.add(kv.key)
                continue
            flush()
            if kind == NODE or kind == ARENA:
                node_id = store.node_of(kv.key)
                records = self.live if kind == NODE else self.arenas
                rec = store.node_record(kv) if ev.type == _PUT else None
                if rec is None:
                    records.pop(node_id, None)
                else:
                    records[node_id] = rec
                self._sync_node(node_id)
        flush()
        if events:
            self.dir.commits.take()  # rewrites of rows that left: the leader wrote them (what this copy follows)
            self.rev = max(self.rev, events[-1].kv.mod_revision)
            self.events += len(events)
            self._moved.set()

    def _put_pages(self, kvs: list) -> None:
        """``_put_page`` of each of a run of page puts, in order. The run is parsed at once (``PageRecords``) and each
        node's pages filed together (``warmrows.file_rows``), which ends as one put at a time does: a node's pages
        reserve their extents in order, a page whose node is unknown or whose extent is taken is held. A run with an
        unreadable record, or a key present already or given twice, goes one put at a time."""
        d = self.dir
        recs = self.store.page_records()
        recs.add(kvs)
        if not recs.junk:
            groups = recs.done()
            by_ns: dict[str, list[bytes]] = {}
            for ents, _ in groups.values():
                for e in ents:
                    by_ns.setdefault(e.ns, []).append(e.key)
            clean = all(len(set(keys)) == len(keys) and not (d._find(ns, keys) >= 0).any()
                        for ns, keys in by_ns.items())
            if clean:
                self._file_groups(groups, recs)
                self.batches.update(recs.batches)
                if self.junk:
                    self.junk.difference_update(kv.key for kv in kvs)
                self.fast_runs += 1
                return
        records_of = self.store.records_of
        for kv in kvs:
            for p in records_of(kv):
                self._put_page(p)

    def _file_groups(self, groups: dict, recs) -> None:
        """File parsed pages (``PageRecords.done()``: node id -> (entries, revisions)), keys absent and distinct."""
        d = self.dir
        held = self.held
        for node_id, (ents, revs) in groups.items():
            names = [e.batch for e in ents]
            if held:
                for e in ents:
                    self._unhold((e.ns, e.key))
            node = d.node_by_id.get(node_id)
            bad = range(len(ents)) if node is None else file_rows(
                d, node, [e.ns for e in ents], [e.key for e in ents], [e.offset for e in ents],
                [e.payload_len for e in ents], [e.gen for e in ents], names, revs, [e.parent for e in ents])
            for i in bad:
                e = ents[i]
                self._hold((revs[i], node_id, e.ns, e.key, e.offset, e.payload_len, e.gen, e.parent,
                            names[i] if names[i] is not None else recs.etcd_key(e.ns, e.key)))

    def _put_page(self, p: tuple) -> None:
        """One page put (``EtcdStore.page_record``, or one of ``records_of``: its record a commit record's key)."""
        rev, node_id, ns, key, off, plen, gen, parent, rec = p
        if node_id is None or type(node_id) is not str:
            self.junk.add(rec)
            return
        if self.store.is_batch(rec):
            self.batches.add(rec)
        self.junk.discard(rec)
        self._unhold((ns, key))
        d = self.dir
        row = int(d._find(ns, [key])[0])
        if row >= 0:
            c = d.cols
            if (d.node_names[c["node"][row]], d.offsets_of(np.array([row]))[0], d.codes[c["size"][row]],
                    int(c["gen"][row])) == (node_id, off, plen, gen):
                return
            drop_rows(d, np.array([row], np.int64))
        if not self._place([p])[0]:
            self._hold(p)

    def _place(self, ps: list[tuple]) -> list[bool]:
        """File held-form pages of one node (keys absent and distinct), in order: whether each was filed."""
        d = self.dir
        node = d.node_by_id.get(ps[0][1])
        if node is None:
            return [False] * len(ps)
        bad = file_rows(d, node, [p[2] for p in ps], [p[3] for p in ps], [p[4] for p in ps], [p[5] for p in ps],
                        [p[6] for p in ps], [p[8] if self.store.is_batch(p[8]) else None for p in ps],
                        [p[0] for p in ps], [p[7] for p in ps])
        out = [True] * len(ps)
        for i in bad:
            out[i] = False
        return out

    def _apply_dead(self, value: bytes, key: bytes) -> None:
        """A segment's dead list (version 3, ``metaserver/table/records.py``): the pages it names leave the table,
        or stop waiting when held, as a rewrite of their records without them would make them (``_shrink_batch``).
        An unreadable value names nothing (its own put makes it junk)."""
        try:
            seg = unpack_segment(value)
        except UNREADABLE:
            return
        self.carried[key] = (seg.dead_recs, seg.dead, seg.dead_ix)
        for j, name in enumerate(seg.dead_recs):
            gens = seg.dead[seg.dead_ix == j] if len(seg.dead_recs) > 1 else seg.dead
            if name in self.batches or any(p[8] == name for p in self.held.values()):
                self._shrink_batch(name, None, gens)

    def _shrink_batch(self, name: bytes, kv, dead: np.ndarray | None = None) -> None:
        """A commit record rewritten (``kv``: it holds fewer pages now; ``apply`` sends only records this copy has
        read here) or deleted (None): the pages that left it leave the table, or stop waiting when held. A
        rewrite that cannot be read removes every page of it and leaves the record as junk (deleted at takeover)."""
        keep: set | None = None
        if dead is not None:  # a dead list's pages of it (``_apply_dead``): the record stays
            gone = set(dead.tolist())
        elif kv is not None:
            try:
                keep = listed_pairs(kv.value)  # either layout (metaserver/table/records.py)
            except UNREADABLE:  # unreadable now: its pages go, the record is the leader's to delete
                self.batches.discard(name)
                self.junk.add(name)
        else:
            self.batches.discard(name)
            self.junk.discard(name)
        d = self.dir
        nodes: set = set()
        if self.held:
            for p in [p for p in self.held.values() if p[8] == name and (
                    p[6] in gone if dead is not None else keep is None or (p[3], p[6]) not in keep)]:
                self._unhold((p[2], p[3]))
        rec = d.commits.by_name.get(name)
        if rec is not None:
            if dead is not None:
                rows = rec.live()
                leave = rows[np.isin(d.cols["gen"].take(rows), dead)]
            else:
                leave = leaving_record(d, rec, keep)
            if len(leave):
                nodes.update(d.node_names.take(d.cols["node"].take(leave)).tolist())
                drop_rows(d, leave)
            if not len(rec.live()) and not any(p[8] == name for p in self.held.values()):
                d.commits.end(rec)  # nothing of it is left here: a page filed under its name later starts it anew
        for node_id in nodes:
            waiting = self.held_on.get(node_id)
            if waiting and len(waiting) <= HELD_RETRY:
                self._retry(node_id)

    def _delete_pages(self, ekeys: list) -> None:
        """``_delete_page`` of each of a run of page deletes, in order: with nothing held, the pages named go with one
        lookup and one ``drop_rows`` per namespace (the same removals: nothing waits to be retried)."""
        if self.held:
            for ekey in ekeys:
                self._delete_page(ekey)
            return
        page_name = self.store.page_name
        by_ns: dict[str, list[bytes]] = {}
        for ekey in ekeys:
            name = page_name(ekey)
            if name is not None:
                by_ns.setdefault(name[0], []).append(name[1])
        if self.junk:
            self.junk.difference_update(ekeys)
        d = self.dir
        for ns, keys in by_ns.items():
            rows = d._find(ns, keys)
            drop_rows(d, np.unique(rows[rows >= 0]))
        self.fast_deletes += 1

    def _delete_page(self, ekey: bytes) -> None:
        self.junk.discard(ekey)
        name = self.store.page_name(ekey)
        if name is None or self._unhold(name):
            return
        d = self.dir
        row = int(d._find(name[0], [name[1]])[0])
        if row < 0:
            return
        node_id = d.node_names[d.cols["node"][row]]
        drop_rows(d, np.array([row], np.int64))
        waiting = self.held_on.get(node_id)
        if waiting and len(waiting) <= HELD_RETRY:
            self._retry(node_id)

    def _sync_node(self, node_id: str) -> None:
        """Make the node match its current record: none without one, of the stated capacity with one."""
        desc = describe(node_id, self.live.get(node_id) or self.arenas.get(node_id))
        cap = desc["capacity"] if desc is not None else None
        disk = desc.get("disk_capacity", 0) if desc is not None else 0
        d = self.dir
        node = d.node_by_id.get(node_id)
        if node is not None:
            if self.caps.get(node_id) == cap and self.disk_caps.get(node_id, 0) == disk:
                return
            # Gone, or another capacity: its pages wait for a node that fits them (a full load would put them in
            # the new one if they fit, and call them stale if there is none).
            page_key = self.store.page_key
            for space in (node, d.tiers.twin(node_id)):  # and its disk tier's pages (metaserver/table/tiers.py)
                for stamp, ns, key, off, plen, gen, parent, rec in node_pages(d, space) if space is not None else ():
                    self._hold((stamp, space.node_id, ns, key, off, plen, gen, parent, rec or page_key(ns, key)))
            d.drop_space(node_id)
            self.caps.pop(node_id, None)
            self.disk_caps.pop(node_id, None)
        if desc is not None:
            if disk:
                d.tiers.disks[node_id] = self.disk_caps[node_id] = disk
            else:
                d.tiers.disks.pop(node_id, None)
            d.add_space(node_id, cap)  # and its disk's twin
            d.set_placeable(node_id, False)
            self.caps[node_id] = cap
            self._retry(node_id)
            if disk:
                self._retry(twin_id(node_id))

    def _hold(self, p: tuple) -> None:
        name = (p[2], p[3])
        self.held[name] = p
        self.held_on.setdefault(p[1], {})[name] = None

    def _unhold(self, name: tuple[str, bytes]) -> bool:
        p = self.held.pop(name, None)
        if p is None:
            return False
        waiting = self.held_on.get(p[1])
        if waiting is not None:
            waiting.pop(name, None)
            if not waiting:
                del self.held_on[p[1]]
        return True

    def _retry(self, node_id: str) -> None:
        """File the node's held pages that fit now, in commit order (keys present meanwhile stay held)."""
        names = self.held_on.get(node_id)
        d = self.dir
        if not names or node_id not in d.node_by_id:
            return
        ps = sorted((self.held[n] for n in names), key=lambda p: p[0])
        absent = [p for p in ps if int(d._find(p[2], [p[3]])[0]) < 0] if d.objects else ps
        if absent:
            for p, ok in zip(absent, self._place(absent)):
                if ok:
                    self._unhold((p[2], p[3]))

    # -- takeover ----------------------------------------------------------------------------------------------
    async def catch_up(self, revision: int, timeout_s: float = CATCHUP_S) -> bool:
        """Wait until every change up to ``revision`` is applied: True. False when the copy cannot get there: it is
        not following etcd, or neither a load nor the watch moved for ``timeout_s`` (the caller loads in full
        then). A load in progress is waited for (it is the work a full load would do). Blocks at most that long
        past the last progress; cancelling it leaves the copy following etcd."""
        self.pace.hurried.set()  # the backlog at full speed: a takeover waits for it
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        seen = (self.loads, self.rev)
        while not (self.loaded and self.rev >= revision):
            if self._task is None or self._task.done():
                return False
            if (self.loads, self.rev) != seen:
                seen = (self.loads, self.rev)
                deadline = loop.time() + timeout_s
            wait = None if self.loading else deadline - loop.time()
            if wait is not None and wait <= 0:
                return False
            self._moved.clear()
            if not await wait_event(self._moved, wait):  # cancel-safe, unlike wait_for (warmpace.wait_event)
                return False
        return True

    def take(self) -> Handover:
        """Hand the table over (after ``catch_up`` and ``stop``): held pages that fit now are filed, the rest and the
        unreadable records become stale: etcd keys to delete, commit records to rewrite without them (as a full
        load's). The copy is empty afterwards."""
        d = self.dir
        assert d is not None and self._task is None, "warm standby: take() before a load, or while following etcd"
        self.apply_backlog()  # received before the watch stopped: what a copy applying at once would hold
        for node_id in list(self.held_on):
            self._retry(node_id)
        is_batch = self.store.is_batch
        d.commits.take()
        d.commits.adopt_dead(self.carried, self.batches)  # the records dead lists name compacted, then the lists dropped
        names = [p[8] for p in self.held.values() if is_batch(p[8])]
        d.commits.adopt([], np.zeros(0, np.int64), names)  # each rewritten without its held pages
        _, rewrites = d.commits.take()
        stale = ([p[8] for p in self.held.values() if not is_batch(p[8])] + sorted(self.junk)
                 + rewrites)
        h = Handover(dir=d, descs=node_descs(list(self.live.values()), list(self.arenas.values())), stale=stale,
                     revision=self.rev, pages=d.objects, load_pages=self.load_pages, load_s=self.load_s,
                     events=self.events, reloads=max(0, self.loads - 1))
        self.dir = None
        self.loaded = False
        self.held, self.held_on, self.junk, self.batches, self.carried = {}, {}, set(), set(), {}
        return h

