"""Warm standby: a standby metaserver's copy of the page directory, kept current from an etcd watch.

A standby loads the directory once (``EtcdStore.load_at``: one snapshot at revision R, built by ``fullload.fill``, the very
code a leader's full load runs), then applies every change from R + 1 on as the watch delivers it: commit records
put (a COMMIT's pages), rewritten without pages and deleted (removals, evictions, dropped nodes: the pages that left
the record leave the copy), page records of the layout before them put and deleted, leased node records and durable
arena records put and deleted. On winning the election the new leader calls ``catch_up(W)`` for its winning revision W (the creation of
the leader key, itself an event under the watched prefix, so "applied up to W" is exact), stops the watch and
``take``s the directory: no page is read from etcd again, so a takeover costs O(events not applied yet + nodes +
held pages) instead of O(pages).

What it holds is only what etcd holds. What a leader keeps in memory alone (read leases, PENDING allocations,
recency from reads) is not in etcd, so a takeover starts without it, exactly as after a full load; recency is commit
order (``fill`` sorts by revision, a commit record's by its create revision, which its rewrites keep; events
arrive in revision order).

Invariant (tests compare ``fullload.fingerprint`` of a taken directory with that of a full load of the same etcd state):
after ``catch_up(W)`` and ``take``, the directory is what ``fill`` builds from a snapshot at W:

- a space for every node with a valid record (the leased one preferred over the arena record), of the capacity that
  record states, not placeable (the leader marks the node provisional until it re-registers);
- every page of a record whose node has a space and whose extent fits there, READY, parents linked;
- pages that cannot stand (unreadable, node unknown, extent taken or out of range) come back as stale: an etcd key
  for the leader to delete, or their commit record (a ``Batch``) for the leader to rewrite without them, as after a
  full load.

What it approximates: the leader's batch writer runs several transactions at once, so the put of a page can reach
etcd before the delete of the page whose freed extent it reuses (or the rewrite of its commit record without it). Such a put waits in ``held`` until that delete
arrives (it is retried then) or the takeover (retried once more, else stale); a page placed late goes to the recent
end of its node's recency order instead of its commit position. A node record that changes capacity rebuilds that
node's space from its current pages (in their current recency order). Pages committed in one etcd transaction share
a revision, so their order among themselves is not defined (operation order through the watch, scan order in a full
load): ``fingerprint`` compares equal only where commits differ in revision. prefix-lru's tiers follow the history
of removals (a parent whose last child went moves), which a load does not replay: its eviction order is equal only
as a set.

Failures: every etcd error is retried (the watch resumes after the last received revision, RETRY_S doubling up to
RETRY_MAX_S); a compacted resume revision means events are lost, so the standby loads again. None of this writes to
etcd: a standby never writes, and a takeover's stale deletes go through the leader's fenced writer.

Under load (a partitioned pool's process serves slots of its own while it keeps copies of others'), what the watch
delivers is queued and applied paced (``metaserver/warmpace.py``): a copy lags by at most about
``warmpace.LAG_MAX_BYTES`` of records (STATS ``warm_copies``: ``lag`` events, ``lag_bytes``), which a takeover's
``catch_up`` and ``take`` apply first (O(events not applied yet), as the invariant below states).

Costs: the initial load is a full load (1 M pages from a local etcd: about 10 s, 3.5 CPU-s of it this process's,
plus 1.2-1.5 CPU-s for ``fill``; 10 M pages: 35-45 CPU-s on this project's 2-core VM, ``bench/scale.py``'s load;
one directory's memory plus the snapshot's records while it runs, each node's released once it is in; the
directory is built in a thread, so the event loop keeps answering meanwhile);
an event is O(1) (a dict probe, one allocator reservation, a policy append) except a page whose extent lies inside a
larger free one (O(free extents) in ``Allocator.reserve``); a watch batch's runs of page puts (lru) and of
page deletes are applied together (``_put_pages``, ``_delete_pages``: about a third less CPU an event, which is
what a partitioned pool's processes spend on their successor slots), a commit record being a run on its own, and
the extents of a run that follow one another (a COMMIT's pages, placed one after another) are reserved as one
(``_file_run``). CPU a page of 128-page commit records arriving one a watch batch (``bench/warmcopy.py``, this
2-core VM): 8.6 us one page at a time (a lone commit record missed the run path until 2026-12-04), 4.9 us as a run,
2.5 us with the extents reserved together (half the leader's ALLOC + COMMIT of them); ``take`` O(nodes + held
pages).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from operator import attrgetter
from typing import Callable

import msgpack

from metaserver import gcpolicy
from metaserver.directory import Directory
from metaserver.entry import Batch, Effects, extent_size
from metaserver.fullload import describe, fill, gc_paused, node_descs
from metaserver.persist import ARENA, NODE, PAGE, EtcdStore
from metaserver.records import UNREADABLE, PageRecords, batch_entries
from metaserver.warmpace import Backlog, Pace, wait_event
from umbp.errors import Unavailable

log = logging.getLogger("umbp.metaserver")

CATCHUP_S = 5.0  # a takeover waits this long without progress of the watch before it loads in full instead
RETRY_S = 0.1  # first pause after an etcd failure of the standby's load or watch ...
RETRY_MAX_S = 2.0  # ... doubling up to this
HELD_RETRY = 64  # held pages of a node retried when one of its pages goes (more wait for the takeover)
_PUT = 0  # etcd Event.EventType PUT (DELETE is 1)
_NS, _KEY = attrgetter("ns"), attrgetter("key")


@dataclass
class Handover:
    """What a takeover gets from a warm standby (``WarmDirectory.take``)."""

    dir: Directory
    descs: dict[str, tuple[dict, int]]  # as ``node_descs``: the nodes to load as provisional members
    stale: list[bytes]  # etcd keys of page records that cannot stand: the new leader deletes them
    revision: int  # last revision applied
    pages: int  # pages in the directory handed over
    load_pages: int  # pages the standby's last load read (before the takeover, not during it)
    load_s: float  # how long that load took
    events: int  # watch events applied since that load
    reloads: int  # loads after the first (compacted watch revisions)


class WarmDirectory:
    """A standby's directory, loaded once and then fed by an etcd watch. ``start`` runs it in the background;
    ``catch_up`` + ``stop`` + ``take`` hand it to a takeover. Only one takeover may take it."""

    def __init__(self, store: EtcdStore, make_dir: Callable[[], Directory]):
        self.store = store
        self.make_dir = make_dir
        self.dir: Directory | None = None
        self.rev = 0  # last revision applied (the snapshot's, then each event's)
        self.live: dict[str, dict] = {}  # node id -> leased node record
        self.arenas: dict[str, dict] = {}  # node id -> durable arena record
        self.caps: dict[str, int] = {}  # node id -> capacity its space was made with
        self.held: dict[tuple[str, bytes], tuple] = {}  # (ns, key) -> page record that has no place yet
        self.held_on: dict[str, dict[tuple[str, bytes], None]] = {}  # node id -> its held (ns, key)s
        self.junk: set[bytes] = set()  # etcd keys of unreadable page records
        self.batches: dict[bytes, Batch] = {}  # commit records: name -> its Batch (its pages' ``batch``)
        self.loaded = False
        self.loading = False
        self.load_pages = 0
        self.load_s = 0.0
        self.loads = 0
        self.events = 0
        self.fast_runs = 0  # runs of page puts filed at once (``_put_pages``)
        self.fast_deletes = 0  # runs of page deletes removed at once (``_delete_pages``)
        self.seen = 0  # last revision received from etcd (the watch resumes after it); ``rev`` <= ``seen``
        self.backlog = Backlog()  # received, not applied yet (metaserver/warmpace.py)
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
            stale, rejected = await asyncio.to_thread(fill, d, descs, pages)  # the loop keeps answering meanwhile
        if self.dir is not None:
            gcpolicy.thaw("warm standby: reloaded")  # the copy it replaces may be frozen cyclic garbage now
        self.dir, self.rev, self.seen = d, rev, rev
        self.live = {r.get("node_id"): r for r in live}
        self.arenas = {r.get("node_id"): r for r in arenas}
        self.caps = {node_id: desc["capacity"] for node_id, (desc, _) in descs.items()}
        self.held, self.held_on, self.junk = {}, {}, set()
        self.batches = pages.batches
        for p in stale + rejected:
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
            self.rev = max(self.rev, events[-1].kv.mod_revision)
            self.events += len(events)
            self._moved.set()

    def _put_pages(self, kvs: list) -> None:
        """``_put_page`` of each of a run of page puts, in order. An lru copy with nothing held or unreadable (the
        steady state: a leader committing new pages) parses the run at once (``PageRecords``) and files each node's
        new pages together (``_file_run``), which makes exactly what one put at a time makes: lru keeps one ring per
        node, and the prefix links never move its entries (``links_blind``), so only each node's own order counts
        (tests/unit/test_standby_batch.py compares the two on random streams). A run with an unreadable record, a
        key present already or twice, or a node without a space, and every run of a prefix-lru copy, goes one put
        at a time. CPU a put event (a 2-core VM, watch batches of 1,000 new pages of one node, best of 3): 7.4-10.6
        us one at a time, 4.5-5.1 us in runs; a delete 5.5-7.7 us, 4.0-4.7 us (``_delete_pages``)."""
        if ((len(kvs) > 1 or self.store.is_batch(kvs[0].key)) and not self.held and not self.junk
                and self.dir.policy.links_blind):  # more than one page: a commit record is a run on its own
            recs = self.store.page_records()
            recs.add(kvs)
            if not recs.junk and self._file_run(recs):
                self.batches.update(recs.batches)
                self.fast_runs += 1
                return
        records_of = self.store.records_of
        for kv in kvs:
            for p in records_of(kv):
                self._put_page(p)

    def _file_run(self, recs: PageRecords) -> bool:
        """File the parsed run ``recs`` as ``put_ready`` files each page (held when its extent is not free): the
        extents reserved, then filed as a load files its records (``NodeSpaces._file_entries``). False, changing
        nothing, when some key is present or given twice, or a node has no space."""
        d = self.dir
        spaces, ready, pend = d.spaces, d.ready, d.pending_keys
        groups = recs.done()
        keys_of: dict[str, list[bytes]] = {}  # namespace -> the run's keys
        for node_id, (ents, _revs) in groups.items():
            if node_id not in spaces:
                return False
            nss = set(map(_NS, ents))
            if len(nss) == 1:
                keys_of.setdefault(nss.pop(), []).extend(map(_KEY, ents))
            else:
                for e in ents:
                    keys_of.setdefault(e.ns, []).append(e.key)
        for ns, keys in keys_of.items():
            ks = set(keys)
            if len(ks) != len(keys):
                return False
            r, pd = ready.get(ns), pend.get(ns)
            if (r is not None and not r.keys().isdisjoint(ks)) or (pd is not None and not pd.keys().isdisjoint(ks)):
                return False
        osize: dict[int, int] = {}  # layout code -> extent size (-1: none, a negative code)
        for node_id, (ents, revs) in groups.items():
            sp = spaces[node_id]
            reserve = sp.alloc.reserve
            whole = sp.alloc.tracks_nothing  # adjacent extents may be reserved as one (nothing records each)
            sizes = []
            for e in ents:
                size = osize.get(e.payload_len)
                if size is None:
                    size = osize[e.payload_len] = extent_size(e.payload_len) if e.payload_len >= 0 else -1
                sizes.append(size)
            filed: list = []
            i, n = 0, len(ents)
            while i < n:
                # A run of extents, each starting where the one before ends (the leader places a COMMIT's pages
                # one after another): one reservation of all of them leaves the free extents that reserving each in
                # turn leaves. If it fails, each is tried on its own, as before.
                j, end = i + 1, ents[i].offset + sizes[i]
                if whole and sizes[i] > 0:
                    while j < n and sizes[j] > 0 and ents[j].offset == end:
                        end += sizes[j]
                        j += 1
                if j - i > 1 and reserve(ents[i].offset, end - ents[i].offset):
                    filed.extend(ents[i:j])
                    i = j
                    continue
                for k in range(i, j):
                    e = ents[k]
                    if sizes[k] < 0 or not reserve(e.offset, sizes[k]):
                        self._hold((revs[k], node_id, e.ns, e.key, e.offset, e.payload_len, e.gen, e.up,
                                    recs.record_of(e)))
                    else:
                        filed.append(e)
                i = j
            d._file_entries(sp, filed, None, osize, Effects())  # as a load files them: no key is present (above)
        return True

    def _put_page(self, p: tuple) -> None:
        _rev, node_id, ns, key, off, plen, gen, parent, ekey = p
        if node_id is None or type(node_id) is not str:
            self.junk.add(ekey)
            return
        if type(ekey) is Batch:
            self.batches[ekey.name] = ekey
        else:
            self.junk.discard(ekey)
        name = (ns, key)
        self._unhold(name)
        d = self.dir
        e = d.ready.get(ns, {}).get(key)
        if e is not None:
            if (e.node_id, e.offset, e.payload_len, e.gen, e.parent) == (node_id, off, plen, gen, parent):
                return
            d.remove(ns, [key])
        if not self._place(p):
            self._hold(p)

    def _place(self, p: tuple) -> bool:
        e = self.dir.put_ready(p[1], p[2], p[3], p[4], p[5], p[6], p[7])
        if e is None:
            return False
        b = p[8]
        if type(b) is Batch:  # a page of a commit record: the record holds it (a rewrite without it removes it)
            e.batch = b
            b.ents.append(e)
        return True

    def _shrink_batch(self, name: bytes, kv) -> None:
        """A commit record rewritten (``kv``: it holds fewer pages now; ``apply`` sends only records this copy has
        read here) or deleted (None): the pages that left it leave the directory, or stop waiting when held. A
        rewrite that cannot be read removes every page of it and leaves the record as junk (deleted at takeover)."""
        b = self.batches.get(name)
        keep: set = set()
        if kv is not None:
            try:
                keep = {(e.key, e.gen) for e in batch_entries("", name, msgpack.unpackb(kv.value))[1]}
            except UNREADABLE:  # unreadable now: its pages go, the record is the leader's to delete
                self.batches.pop(name, None)
                self.junk.add(name)
        else:
            self.batches.pop(name, None)
            self.junk.discard(name)
        if b is None:
            return
        d = self.dir
        nodes = set()
        for e in b.live():
            if (e.key, e.gen) not in keep and d.ready.get(e.ns, {}).get(e.key) is e:
                nodes.add(e.node_id)
                d.remove(e.ns, [e.key])
        if self.held:
            for p in [p for p in self.held.values() if p[8] is b and (p[3], p[6]) not in keep]:
                self._unhold((p[2], p[3]))
        for node_id in nodes:
            waiting = self.held_on.get(node_id)
            if waiting and len(waiting) <= HELD_RETRY:
                self._retry(node_id)

    def _delete_pages(self, ekeys: list) -> None:
        """``_delete_page`` of each of a run of page deletes, in order: with nothing held or unreadable, the pages
        named are removed with one ``Directory.remove`` per run of one namespace (the same removals, in order)."""
        if self.held or self.junk:
            for ekey in ekeys:
                self._delete_page(ekey)
            return
        page_name, remove = self.store.page_name, self.dir.remove
        ns, keys = None, []
        for ekey in ekeys:
            name = page_name(ekey)
            if name is None:
                continue
            if name[0] != ns:
                if keys:
                    remove(ns, keys)
                ns, keys = name[0], []
            keys.append(name[1])
        if keys:
            remove(ns, keys)
        self.fast_deletes += 1

    def _delete_page(self, ekey: bytes) -> None:
        self.junk.discard(ekey)
        name = self.store.page_name(ekey)
        if name is None or self._unhold(name):
            return
        ns, key = name
        e = self.dir.ready.get(ns, {}).get(key)
        if e is None:
            return
        self.dir.remove(ns, [key])
        waiting = self.held_on.get(e.node_id)
        if waiting and len(waiting) <= HELD_RETRY:
            self._retry(e.node_id)

    def _sync_node(self, node_id: str) -> None:
        """Make the node's space match its current record: none without one, of the stated capacity with one."""
        desc = describe(node_id, self.live.get(node_id) or self.arenas.get(node_id))
        cap = desc["capacity"] if desc is not None else None
        d = self.dir
        sp = d.spaces.get(node_id)
        if sp is not None:
            if self.caps.get(node_id) == cap:
                return
            # Gone, or another capacity: its pages wait for a space that fits them (a full load would put them in
            # the new space if they fit, and call them stale if there is none).
            for e in list(sp.entries):
                self._hold((0, node_id, e.ns, e.key, e.offset, e.payload_len, e.gen, e.parent, e.batch))
            d.drop_space(node_id)
            self.caps.pop(node_id, None)
        if desc is not None:
            d.add_space(node_id, cap)
            d.set_placeable(node_id, False)
            self.caps[node_id] = cap
            self._retry(node_id)

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
        """Place the node's held pages that fit now, in commit order."""
        names = self.held_on.get(node_id)
        if not names or node_id not in self.dir.spaces:
            return
        for p in sorted((self.held[n] for n in names), key=lambda p: p[0]):
            if self._place(p):
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
        """Hand the directory over (after ``catch_up`` and ``stop``): held pages that fit now are placed, the rest
        and the unreadable records become stale keys. The copy is empty afterwards."""
        d = self.dir
        assert d is not None and self._task is None, "warm standby: take() before a load, or while following etcd"
        self.apply_backlog()  # received before the watch stopped: what a copy applying at once would hold
        for node_id in list(self.held_on):
            self._retry(node_id)
        page_key = self.store.page_key
        stale = [p[8] if type(p[8]) is Batch else page_key(p[2], p[3]) for p in self.held.values()] + sorted(self.junk)
        h = Handover(dir=d, descs=node_descs(list(self.live.values()), list(self.arenas.values())), stale=stale,
                     revision=self.rev, pages=d.objects, load_pages=self.load_pages, load_s=self.load_s,
                     events=self.events, reloads=max(0, self.loads - 1))
        self.dir = None
        self.loaded = False
        self.held, self.held_on, self.junk, self.batches = {}, {}, set(), {}
        return h
