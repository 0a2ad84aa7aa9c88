"""The metaserver's request handlers and background duties, between the protocol (server.py) and the state
(the page table ``metaserver.table.directory.TableDirectory``, membership) and persistence (persist.py). The data-plane
handlers (ALLOC, COMMIT, ABORT, LOOKUP, EXISTS, PREFIX, REMOVE) are ``metaserver/handlers/dataplane.py``'s; admin
(``admin.py``), lost nodes' pages (``rejoin.py``) and leases and quotas (``ownership.py``) have modules of their own.

Each handler takes a validated request meta and returns the response meta, or a coroutine for the few that wait on
etcd (REGISTER_NODE, COMMIT with puts, ALLOC when generations run out, EVICT all). Bookkeeping happens
synchronously inside the handler, before any await, so a request's effect on the directory is atomic; the etcd I/O
the directory returns is handed to the batch writer afterwards (awaited only by COMMIT). The handler families are
objects the service holds (``dataplane``, ``admin``; ``rejoin``, a fresh one per term, for lost nodes) or functions
over the directory (``metaserver.handlers.ownership``); they read the term's state through the service, which
replaces it at every term.

Background (``tick`` every TICK_S): expire PENDING entries and read leases, detect dead nodes and drop their pages,
evict nodes above the high watermark down to the low one. Each of these sweeps has a budget per tick (SWEEP_BUDGET,
EVICT_BUDGET) and together they examine at most STEP_BUDGET entries a tick (the first duty rotating), so a backlog (a
million expired leases, a lost node of millions of pages, a huge eviction) is worked off over several ticks while
requests keep being served in between. What is not budgeted: detaching a lost node (O(PENDING rows)), the last slice
of its drop (a sort of its parked records, and O(its rows) numpy to retire it), and a node that re-registers mid-drop
(the rest of its drop at once, as its parked pages are reloaded in one step).

Read leases and PENDING allocations belong to a connection, and namespaces may have quotas:
``metaserver.handlers.ownership``.

Leadership (``metaserver/ha/election.py``): this class serves one slot's directory for the process that won the
slot's key (``metaserver.ha.slots.SlotServer``); every term starts from what etcd holds. On a win it builds a fresh
membership, etcd writer and generation range (all etcd writes fenced on the slot's key), takes its warm copy over
(``metaserver/ha/standby.py``) or, with none or one that cannot catch up, loads the directory from etcd in full; then
serves. On losing the lease or a fenced write it drops that state (queued writes are not written) and stands by
again. Only READY pages are in etcd, so PENDING allocations, read leases and recency from reads of the previous term
vanish (their space is free again, except the extents of the PENDING allocations a leader that stepped down on
purpose handed on: held while their writers may still write, ``metaserver/ha/handoff.py``); recency restarts from
commit order. STATS ``takeover`` says which way this term started.

Nodes after a takeover: every node with an arena record is loaded *provisionally* with its pages, alive but not
yet confirmed, for ``max(lease_ttl, NODE_GRACE_S)``. A node that re-registers the same arena (id and capacity)
within that grace keeps its pages (kept=N); one that comes back with another arena, or not at all, loses them.
This holds even when every metaserver was away longer than the node's lease (its leased record is gone then; the
durable arena record is not). ALLOC waits (at most ``ALLOC_HOLD_S``) until the loaded nodes re-registered, so the
first puts after a takeover are placed on every node instead of failing or piling onto the first to return.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from metaserver import validate as v
from metaserver.handlers import ownership
from metaserver.handlers.admin import EVICT_BUDGET, Admin
from metaserver.handlers.dataplane import ALLOC_HOLD_S, DataPlane
from metaserver.table.entry import Effects
from metaserver.handlers.metrics import MetaserverMetrics
from metaserver.handlers.membership import Membership, Node
from metaserver.store.batcher import BatchWriter
from metaserver.store.generations import GenCounter
from metaserver.store.persist import EtcdStore
from metaserver.handlers.rejoin import Rejoin
from metaserver.store import gcpolicy
from metaserver.ha import handoff
from metaserver.handlers import kvevents
from metaserver.handlers.turns import release_turn
from metaserver.store.fullload import gc_paused, node_descs
from metaserver.ha.tiering import Mover
from metaserver.ha.standby import CATCHUP_S, Handover, WarmDirectory
from metaserver.table.directory import TableDirectory
from transport.wire import DIGEST_KEYS, PACKED_KEYS, VERSION, Op, Status
from metaserver.table.quarantine import Quarantine
from umbp.auth import CLOCK_SKEW_S, Tokens
from umbp.config import MetaserverConfig
from umbp.errors import AuthError, NotLeader, UmbpError, Unavailable

log = logging.getLogger("umbp.metaserver")

TICK_S = 0.05
SWEEP_BUDGET = 20_000  # expired pending entries / leases examined per tick
STEP_BUDGET = 20_000  # entries one tick may examine in all duties together: the event loop's longest background step
ETCD_START_DEADLINE_S = 15.0
NODE_GRACE_S = 10.0  # a node loaded from etcd keeps its pages this long (at least its lease_ttl) to re-register

_NONE = frozenset()

# Ops a standby refuses with NOT_LEADER (everything that reads or changes the directory or membership).
# STATS too: a standby's empty directory would read as an empty pool. HELLO, PING and LEADER answer anywhere.
LEADER_ONLY = frozenset({Op.REGISTER_NODE, Op.HEARTBEAT, Op.ALLOC, Op.COMMIT, Op.ABORT, Op.LOOKUP, Op.RELEASE,
                         Op.EXISTS, Op.PREFIX, Op.REMOVE, Op.NODES, Op.LIST, Op.EVICT, Op.DRAIN, Op.STATS})


class Metaserver:
    """One directory's server: its handlers, its terms and its background duties. Elected by the process that
    builds it (``metaserver.ha.slots.SlotServer``, a slot of ``metaserver.ha.partition.Partition``), which passes the
    slot's ``store`` (its keys and fence) and ``leader`` (what it reads of the election: ``is_leader``,
    ``leader_addr``, ``addr``, ``revision``, ``resign``)."""

    def __init__(self, config: MetaserverConfig, store: EtcdStore, leader, metrics: MetaserverMetrics | None = None):
        self.cfg = config
        self.tokens = Tokens.load(config.token, config.tokens_file, "metaserver")
        self.store = store
        self.leader = leader
        self.warm: WarmDirectory | None = None  # the directory kept current while standing by
        self.takeover: dict = {}  # how this term started (STATS): warm or a full load, pages read, events
        self.max_keys = config.max_batch_keys
        self.lease_ms = int(config.read_lease_s * 1000)  # told with every leased LOOKUP answer
        self.term = 0  # bumped at every win and every step-down; coroutines of an older term stop
        self.loaded = False  # this term's directory is loaded (serving = loaded and the lease is valid)
        self.ticks = 0  # background ticks run (stats: lets tests wait for ticks instead of sleeping)
        self.load_s = 0.0  # how long the last takeover's directory load took
        self.dropped_ops = 0  # etcd ops the writers of every term so far gave up on (``_writes_dropped``)
        self.metrics = metrics or MetaserverMetrics(self)  # read at scrape time; latencies observed in server.py
        # KV events (metaserver/handlers/kvevents.py): the process's publisher, shared by a partitioned process's slots
        self.kv_events = kvevents.publisher(config.kv_events) if config.kv_events else None
        self._new_state()
        self._bg: set[asyncio.Task] = set()
        self._ticker: asyncio.Task | None = None
        self.mover = Mover(self)  # the disk tier's demotions and promotions (metaserver/ha/tiering.py)
        self.dataplane = dp = DataPlane(self)  # ALLOC, COMMIT, LOOKUP, ... (metaserver/handlers/dataplane.py)
        self.admin = adm = Admin(self)  # STATS, NODES, LIST, EVICT, DRAIN, LEADER (metaserver/handlers/admin.py)
        self._duties = (self._expire_pending, self._expire_leases, self._release_quarantine, self._drop_dying,
                        self._evict_over_high, self._step_table, self.mover.tick)
        self.handlers = {
            Op.HELLO: self.hello, Op.AUTH: self.authenticate, Op.PING: self.ping, Op.REGISTER_NODE: self.register_node,
            Op.HEARTBEAT: self.heartbeat, Op.ALLOC: dp.alloc, Op.COMMIT: dp.commit, Op.ABORT: dp.abort,
            Op.LOOKUP: dp.lookup, Op.RELEASE: self.release, Op.EXISTS: dp.exists, Op.PREFIX: dp.prefix,
            Op.REMOVE: dp.remove, Op.STATS: adm.stats, Op.NODES: adm.nodes, Op.LIST: adm.list_objects,
            Op.EVICT: adm.evict, Op.DRAIN: adm.drain, Op.LEADER: adm.leader_info,
        }

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def _new_state(self) -> None:
        """Fresh per-term state: nothing of a previous term survives into the next."""
        cfg = self.cfg
        old = getattr(self, "dir", None)
        if old is not None and (old.objects or old.pending):
            gcpolicy.thaw("metaserver: a term's directory dropped")  # it may be frozen cyclic garbage now
        self.dir = self._make_dir()
        self.members = Membership()
        self.writer = w = BatchWriter(self.store, batch=cfg.persist_batch, retry_s=cfg.persist_retry_s)
        w.on_drop = lambda n, err: self._writes_dropped(w, n, err)
        self.gens = GenCounter(self.store)
        self.settled = asyncio.Event()  # every node loaded at takeover re-registered (or ALLOC_HOLD_S passed)
        self.took_over = 0.0
        self.given_up = False  # this term's writer dropped writes: the term is being given up (``_writes_dropped``)
        self.rejoin = Rejoin(self)  # lost nodes: their drops and parked pages (metaserver/handlers/rejoin.py)

    def _make_dir(self) -> TableDirectory:
        cfg = self.cfg
        return TableDirectory(pending_ttl_s=cfg.pending_ttl_s, read_lease_s=cfg.read_lease_s,
                              policy=cfg.eviction_policy, quotas=getattr(self.tokens, "quota_rules", None),
                              namer=self.store.batch_name)

    @property
    def serving(self) -> bool:
        return self.loaded and self.leader.is_leader

    def check_term(self, term: int) -> None:
        """Raise NotLeader when leadership changed since ``term`` (a coroutine resumed after an await)."""
        if term != self.term or not self.serving:
            raise NotLeader("metaserver", "leadership changed during the request", Status.NOT_LEADER,
                            leader=None if self.leader.leader_addr == self.leader.addr else self.leader.leader_addr)

    def _standing_by(self) -> None:
        """Lost a round: keep a warm copy of the page table (started once per stretch as a standby,
        ``metaserver/ha/standby.py``)."""
        if self.warm is None:
            self.warm = WarmDirectory(self.store, self._make_dir)
            self.warm.start()

    async def _elected(self, revision: int) -> None:
        """Won at ``revision``: build this term's state: the warm directory caught up to ``revision``, else a full
        load from etcd. Serving starts when this returns."""
        self.term += 1
        self._new_state()
        warm, self.warm = self.warm, None
        try:
            await self.gens.start()
            self.writer.start()
            handed = await self.store.get_value(self.store.open_key)  # a predecessor's open allocations, if any
            t0 = time.monotonic()
            seen = (warm.loads, warm.events) if warm is not None else (0, 0)
            if warm is not None and await warm.catch_up(revision, CATCHUP_S):
                await warm.stop()
                h = warm.take()  # applies what it had received and not applied yet: counted as caught up
                self._adopt(h, warm.events - seen[1] if warm.loads == seen[0] else warm.events, t0)
            else:
                if warm is not None:
                    await warm.stop()
                    gcpolicy.thaw("metaserver: a warm directory dropped")
                    log.warning("metaserver: the warm directory did not catch up to revision %d: full load",
                                revision)
                await self._load()
            if self.given_up:  # writes dropped while taking over: this directory is not what etcd holds
                raise Unavailable("metaserver", "etcd writes dropped while taking over", Status.UNAVAILABLE)
        except BaseException:
            if warm is not None:
                await warm.stop()
                gcpolicy.thaw("metaserver: a warm directory dropped")
            await self._teardown(Unavailable("metaserver", "takeover failed", Status.UNAVAILABLE))
            self._new_state()
            raise
        self.took_over = time.monotonic()
        hold = self.cfg.write_cap_ttl_s + CLOCK_SKEW_S if self.tokens.closed else 0.0
        keep = max(self.cfg.pending_ttl_s, self.cfg.write_cap_ttl_s) + CLOCK_SKEW_S  # open allocations' writers
        self.dir.quarantine = Quarantine(hold, keep)
        # pages loaded: a reader may still read one under the last leader's lease (none loaded: none can)
        lease_s = self.cfg.read_lease_s + CLOCK_SKEW_S if self.dir.objects else 0.0
        self.dir.quarantine.start(self.took_over, self.gens.issued_below, lease_s)
        if lease_s:
            log.info("metaserver: no eviction for %.1f s: readers may still read under the last leader's leases",
                     lease_s)
        n, nbytes = handoff.hold(self.dir, handed)
        if n:
            log.info("metaserver: holding %d runs (%d bytes) the last leader left allocated and uncommitted", n, nbytes)
        if not any(n.provisional for n in self.members.nodes.values()):
            self.settled.set()
        self._ticker = asyncio.create_task(self._tick_loop(), name="metaserver-tick")
        if self.kv_events is not None:
            kvevents.attach(self.kv_events, self.dir)  # this term's pages announced, its changes reported
        self.loaded = True

    def _writes_dropped(self, writer: BatchWriter, n: int, err: Exception) -> None:
        """This term's writer gave ``n`` ops up (``batcher.py``): etcd no longer holds what the directory does (a
        COMMIT answered with an error left its pages READY; an evicted page's record is still there). Stop serving
        now and give the term up (``_give_up``), so the next one, here or elsewhere, starts from what etcd holds
        instead of serving pages etcd lost. A fenced write needs nothing more: ``on_fenced`` deposes already."""
        self.dropped_ops += n
        if writer is not self.writer or isinstance(err, NotLeader) or self.given_up:
            return  # an older term's writer, already torn down; deposed by the fence; or given up already
        self.given_up = True
        log.error("metaserver: %d etcd writes dropped (%s): giving the term up so the next one loads from etcd",
                  n, err)
        self.loaded = False  # nothing more is served from this directory
        self._give_up(f"{n} etcd writes dropped ({err})")

    def _give_up(self, reason: str) -> None:
        """Step down on purpose and end the term's key, so the next term starts from etcd: the elected server's
        (``SlotServer._give_up``)."""
        raise NotImplementedError

    async def _deposed(self, reason: str) -> None:
        """Lost leadership: stop serving and drop this term's state; queued etcd writes are not written."""
        self.loaded = False
        if self.kv_events is not None:
            kvevents.detach(self.kv_events, self.dir)
        self.term += 1
        await self._teardown(NotLeader("metaserver", f"deposed ({reason})", Status.NOT_LEADER))
        self._new_state()

    async def _teardown(self, err: Exception) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
            self._ticker = None
        await self.writer.abort(err)
        await self._cancel_bg()

    async def _cancel_bg(self) -> None:
        for t in list(self._bg):
            t.cancel()
        await asyncio.gather(*self._bg, return_exceptions=True)

    async def close(self) -> None:
        """Stop background work, flush queued etcd writes (bounded), then resign (the slot's key deleted, fenced) so a
        standby takes over at once. Node leases are left to expire on their own, and nodes' arena records stay, so
        nodes outlive a metaserver restart. The store's client is the process's: closed by it."""
        if self.warm is not None:
            await self.warm.stop()
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
        if self.loaded:
            if self.kv_events is not None:
                kvevents.detach(self.kv_events, self.dir)
            await self.writer.close(5.0)  # commits waiting on it get their answers first
            self.loaded = False
            try:  # the next leader keeps our open allocations' extents free while their writers may still write
                await self.store.txn(handoff.open_ops(self.store, self.dir))
            except UmbpError as e:
                log.warning("metaserver: handing open allocations on: %s", e)
            await self.leader.resign()
        else:
            await self.writer.abort(Unavailable("metaserver", "shutting down", Status.UNAVAILABLE))
        await self._cancel_bg()
        await self.store.close()

    async def _load(self) -> None:
        """The full load: every record from etcd into this term's (empty) directory. O(pages)."""
        t0 = time.monotonic()
        with gc_paused():  # the parse makes an object a page: no collection walks them while they are made
            node_recs, arena_recs, pages = await self.store.load()
            descs = node_descs(node_recs, arena_recs)
            # In a thread: filing millions of pages holds the interpreter for seconds, and the election's
            # keep-alive must still run meanwhile (the event loop gets the GIL back every switch interval). Nothing
            # else touches this term's directory until serving starts; a cancelled takeover leaves the thread to
            # finish on a directory nobody uses.
            d = self.dir
            stale, rejected = await asyncio.to_thread(d.load, descs, pages)
        self._apply(d.effects())  # commit records rewritten without the pages the load could not place
        self._provisional_nodes(descs, time.monotonic())
        self._drop_records([p[8] for p in stale] + [p[8] for p in rejected])
        self.load_s = time.monotonic() - t0
        self.takeover = {"warm": False, "load_pages": len(pages), "catchup_events": 0, "pages": self.dir.objects,
                         "standby_load_pages": 0, "standby_load_s": 0.0, "standby_events": 0, "standby_reloads": 0,
                         "s": round(self.load_s, 3)}
        log.info("metaserver: loaded %d nodes (%d with a live lease), %d pages (%d stale) in %.2fs", len(descs),
                 len(node_recs), len(pages), len(stale) + len(rejected), self.load_s)

    def _adopt(self, h: Handover, catchup_events: int, t0: float) -> None:
        """Take a warm standby's directory over: no page is read; nodes become provisional members as after a
        full load, and the records it could not place are deleted. O(nodes + stale)."""
        self.dir = h.dir
        self._provisional_nodes(h.descs, time.monotonic())
        self._drop_records(h.stale)
        self.load_s = time.monotonic() - t0
        self.takeover = {"warm": True, "load_pages": 0, "catchup_events": catchup_events, "pages": h.pages,
                         "standby_load_pages": h.load_pages, "standby_load_s": round(h.load_s, 3),
                         "standby_events": h.events, "standby_reloads": h.reloads, "s": round(self.load_s, 3)}
        log.info("metaserver: took the warm directory over at revision %d: %d pages of %d nodes (%d stale), "
                 "%d events caught up, in %.3fs", h.revision, h.pages, len(h.descs), len(h.stale), catchup_events,
                 self.load_s)
        print(f"metaserver: warm takeover at revision {h.revision}: {h.pages} pages, {catchup_events} events "
              f"caught up in {self.load_s:.3f}s", flush=True)

    def _provisional_nodes(self, descs: dict, now: float) -> None:
        """Every node with a record becomes a member, provisional until it re-registers this arena: dropped after
        its grace (``max(lease_ttl, NODE_GRACE_S)``) if it does not. Their spaces are in the directory already."""
        for desc, lease in descs.values():
            node, _ = self.members.register(desc, now)
            node.cap_key = self.tokens.cap_key(node.node_id, node.arena_id)
            node.lease_id = lease
            node.provisional = True
            node.last_heartbeat = now + max(0.0, max(node.lease_ttl, NODE_GRACE_S) - node.lease_ttl)

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)
        return t

    def _apply(self, fx: Effects, wait: bool = False) -> asyncio.Future | None:
        """Hand a mutation's etcd I/O to the writer; returns a future for the puts when ``wait``."""
        if not fx:
            return None
        puts = [(r.name, r) for r in fx.recs]  # new commit records, encoded when the writer takes them
        deletes = [self.store.page_key(ns, k) for ns, k in fx.deletes] if fx.deletes else []
        rewrites = [(b.name, b) for b in dict.fromkeys(fx.batches)] if fx.batches else []  # pages left them
        if wait:
            # Deletes and rewrites ride along but the caller only waits for what it must: its puts.
            if deletes or rewrites:
                self.writer.submit(rewrites, deletes, wait=False)
            return self.writer.submit(puts, [], wait=True)
        self.writer.submit(puts + rewrites, deletes, wait=False)
        return None

    def _drop_records(self, records: list) -> None:
        """Records a load or a takeover could not place (``TableDirectory.load``, ``Handover.stale``), or parked
        pages forgotten: an etcd key is deleted, a commit record (``TableRecord``) rewritten without them (they are
        not in the table)."""
        puts = [(r.name, r) for r in dict.fromkeys(r for r in records if type(r) is not bytes)]  # TableRecord
        self.writer.submit(puts, [r for r in records if type(r) is bytes], wait=False)

    # -- background --------------------------------------------------------------------------------------------
    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.tick(time.monotonic())
            except Exception:  # noqa: BLE001 - a bug in one duty must not stop the others for good
                log.exception("metaserver: background tick failed")

    def tick(self, now: float) -> int:
        """One background step: expiry of PENDING entries and read leases, quarantine releases, lost nodes' drops
        and the watermark eviction, all within STEP_BUDGET entries examined. Returns the entries examined."""
        self.ticks += 1
        if not self.serving:
            return 0  # a lapsed lease: touch nothing until the election says whether we still lead
        if not self.settled.is_set() and now - self.took_over > ALLOC_HOLD_S:
            self.settled.set()
        d = self.dir
        if d.quarantine.waiting or d.quarantine.hold_s:
            d.quarantine.observe(now, self.gens.issued_below)
        for node in self.members.expired(now):
            self.rejoin.node_lost(node, now)
        if self.rejoin.parked:
            self.rejoin.expire_parked(now)
        # The budgeted duties share one budget, each taking at most its own share; the first duty rotates, so a
        # backlog in one (a million expired leases) delays the others by a tick at most, never starves them.
        duties = self._duties
        left = STEP_BUDGET
        for i in range(len(duties)):
            if left <= 0:
                break
            left -= duties[(self.ticks + i) % len(duties)](now, left)
        return STEP_BUDGET - left

    def _expire_pending(self, now: float, budget: int) -> int:
        # an expired allocation's writer may still be writing it (a slow or stalled write): its extent waits keep_s
        # as a closed connection's does (tests/test_attack_late_write.py)
        with self.dir.quarantine.keeping():
            return self.dir.expire_pending(now, min(budget, SWEEP_BUDGET))

    def _expire_leases(self, now: float, budget: int) -> int:
        q = self.dir._lease_q
        before = len(q)
        self.dir.expire_leases(now, min(budget, SWEEP_BUDGET))
        return before - len(q)  # examined: released or already gone

    def _release_quarantine(self, now: float, budget: int) -> int:
        q = self.dir.quarantine
        return q.release(now, self.dir.spaces, min(budget, SWEEP_BUDGET)) if q.waiting else 0

    def _drop_dying(self, now: float, budget: int) -> int:
        return self.rejoin.drop_lost(min(budget, SWEEP_BUDGET)) if self.dir.dying else 0

    def _step_table(self, now: float, budget: int) -> int:
        return self.dir.step(min(budget, SWEEP_BUDGET))  # a key index resize, a slice at a time (table/index.py)

    def _evict_over_high(self, now: float, budget: int) -> int:
        d = self.dir
        if not d.needs_eviction(self.cfg.high_watermark):
            return 0
        fx = Effects()
        n, _ = d.watermark_pass(self.cfg.high_watermark, self.cfg.low_watermark, min(budget, EVICT_BUDGET), fx)
        self._apply(fx)
        return n

    async def _revoke(self, lease: int) -> None:
        try:
            await self.store.revoke(lease)
        except Unavailable as e:
            log.warning("metaserver: %s", e)

    # -- a connection's leases and allocations (metaserver/handlers/ownership.py) ------------------------------
    def release(self, meta: Any, conn) -> dict:
        return ownership.release(self.dir, meta, conn, release_turn(self, conn))

    def drop_pending(self, conn) -> int:
        """``conn`` closed (``metaserver.server``): its PENDING allocations aborted, its read leases released."""
        return ownership.drop_pending(self.dir, conn, self.serving)

    # -- handshake and membership -----------------------------------------------------------------------------
    def hello(self, meta: Any, conn) -> dict:
        m = v.fields(meta, frozenset({"client", "nonce"}))
        if m.get("client") is not None:
            v.string(m, "client", max_len=256)
        ans = conn.auth.hello(m, "metaserver", VERSION)
        ans[PACKED_KEYS] = True  # keyed requests may carry their keys packed (wire.pack_keys; server.py unpacks them)
        ans[DIGEST_KEYS] = True  # and finds by their digests (a read tag comes from the row's own key: _kept_tags)
        return ans

    def authenticate(self, meta: Any, conn) -> dict:
        return conn.auth.auth(meta)

    def ping(self, meta: Any, conn) -> dict:
        v.fields(meta, _NONE)
        return {}

    def register_node(self, meta: Any, conn):
        if not conn.auth.scope.node:
            raise AuthError("metaserver", f"token {conn.auth.scope.name!r} may not register a storage node")
        desc = v.node_description(meta if type(meta) is dict else v.fields(meta, _NONE))
        now = time.monotonic()
        old = self.members.get(desc["node_id"])
        if (old is not None and old.alive and not old.provisional and old.conn is not None and old.conn is not conn
                and not old.conn.closed and now - old.last_heartbeat <= old.lease_ttl):
            raise AuthError("metaserver", f"node id {old.node_id!r} is held by a live node at {old.host}:{old.port} "
                                          f"(registered on another connection, heartbeating): refused")
        old_disk = (old.disk_id, old.disk_capacity) if old is not None else None
        node, keep = self.members.register(desc, now)
        node.conn = conn
        node.cap_key = self.tokens.cap_key(node.node_id, node.arena_id)
        # Every generation handed out so far is below this, so every capability of an earlier registration (or
        # term: generations increase across takeovers) carries a smaller epoch; the node refuses those once it
        # has this one (from the answer, or from the first new capability it checks).
        node.cap_epoch = self.gens.issued_below
        node.provisional = False
        self._check_settled()
        kept = dropped = 0
        same_disk = self.rejoin.disk_registered(node, old_disk, keep)  # its disk tier (handlers/rejoin.py)
        if keep and node.node_id in self.dir.spaces:
            kept = self.dir.space_use(node.node_id)[1]
            self.dir.set_placeable(node.node_id, True)
        else:
            self.rejoin.finish_drop(node.node_id)  # a drop under way completes its parked records first
            dropped, fx = self.dir.drop_space(node.node_id, disk=not same_disk)  # a disk outlives its arena
            self._apply(fx)
            self.dir.add_space(node.node_id, node.capacity)
            kept = self.rejoin.unpark(node)
        node.floor_acked = not node.acks_floor
        if not node.floor_acked:  # placed on once a heartbeat says it holds this registration's floor (heartbeat)
            self.dir.set_placeable(node.node_id, False)
        log.info("metaserver: node %s registered at %s:%d (%d bytes, kept %d, dropped %d)", node.node_id,
                 node.host, node.port, node.capacity, kept, dropped)
        return self._register_io(node, kept, dropped, self.term)

    def _check_settled(self) -> None:
        if not self.settled.is_set() and not any(n.provisional or not n.floor_acked
                                                 for n in self.members.nodes.values()):
            self.settled.set()

    async def _register_io(self, node: Node, kept: int, dropped: int, term: int) -> dict:
        old = node.lease_id
        lease = await self.store.grant(node.lease_ttl_int)
        self.check_term(term)
        node.lease_id = lease
        await self.store.put_node(node.node_id, node.record(), lease)
        self.check_term(term)
        if old and old != lease:
            self._spawn(self._revoke(old))
        return {"heartbeat_s": max(0.1, node.lease_ttl / 3), "kept": kept, "dropped": dropped,
                "epoch": node.cap_epoch}

    def heartbeat(self, meta: Any, conn) -> dict:
        m = v.fields(meta, frozenset({"node_id", "arena_id", "floor"}), ("node_id", "arena_id"))
        if not conn.auth.scope.node:
            raise AuthError("metaserver", f"token {conn.auth.scope.name!r} may not heartbeat as a storage node")
        node = self.members.heartbeat(v.node_id(m), v.arena_id(m), time.monotonic(), conn)
        if node is None:
            raise v.Reject(f"node {m['node_id']} is not registered with this arena: register again",
                           Status.NOT_FOUND)
        floor = m.get("floor")
        if not node.floor_acked and type(floor) is int and floor >= node.cap_epoch:
            # The node refuses (and stops mid-stream) every write of a generation below this registration's
            # epoch: a writer of a deposed term can no longer land over what is placed on it from now on.
            node.floor_acked = True
            if not node.draining:
                self.dir.set_placeable(node.node_id, True)
            self._check_settled()
        if not node.refreshing:
            node.refreshing = True
            self._spawn(self._refresh(node))
        return {}

    async def _refresh(self, node: Node) -> None:
        """Keep the node's etcd lease alive; if etcd forgot it (it expired while we were away), grant a new one.
        Checked against this term after every await: the store (and its fence) is shared by every term, so a
        coroutine of an earlier term must not write under a later one's fence, nor over a registration's lease."""
        term, old = self.term, node.lease_id
        try:
            ttl = await self.store.refresh(old) if old else 0
            self.check_term(term)
            if ttl <= 0 and node.alive and node.lease_id == old:
                lease = await self.store.grant(node.lease_ttl_int)
                self.check_term(term)
                if node.lease_id != old or not node.alive:  # registered again (its own lease) or lost meanwhile
                    self._spawn(self._revoke(lease))
                    return
                node.lease_id = lease
                await self.store.put_node(node.node_id, node.record(), lease)
        except (Unavailable, NotLeader) as e:
            log.warning("metaserver: node %s: %s", node.node_id, e)
        finally:
            node.refreshing = False
