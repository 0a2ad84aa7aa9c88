"""One metaserver process of a partitioned pool: per-slot elections with no coordinator, slot routing and handover
to a joining process. The process-level answers (LEADER with the slot map, STATS/NODES/LIST/EVICT/DRAIN over the
slots it leads) are ``metaserver/partanswers.py``'s.

Election (``_round``, every POLL_S): the process holds one etcd lease of ``election_ttl_s`` (kept alive every
ttl/3, with today's local validity deadline, ``leader.py``) under which it puts ``members/{addr}`` and every slot
key it wins, so a process that dies loses all of them at once when its lease expires. Each round reads
``members/`` and ``slotmap/`` (two range reads) and, for each slot s and for the membership role ``m``:

- nobody holds it: campaign (create ``slotmap/{s}`` if absent) when this process is rank r of slot s's order in
  ``ranking(S, live members)`` (balanced: S/N slots each; ``rank`` for ``m``), the processes with a loaded warm
  copy of s moved to the front, and the slot has been vacant for r * RANK_DELAY_S: a dead process's slots go to
  each one's successor (which kept the warm copy), all in the same round, in parallel;
- we hold it and a process ranked above us reports its warm copy of s loaded (``members`` value ``warm``): hand it
  over (stop serving, flush queued writes, delete the key fenced, with the record of the slot's open allocations:
  ``metaserver/handoff.py``): that is how a joining process takes its share;
- someone else holds it: keep a warm copy (``standby.WarmDirectory``, on this slot's pages) when this process is
  rank 0 (the slot comes here once the copy is loaded) or the next-ranked after the holder (the successor);
- we hold it under our lease but neither serve, elect, hand over nor depose it two rounds running (a campaign's
  answer lost after etcd applied it, a failed resign): campaign again, adopting the key (``_adopt_unserved``).

Invariants: at most one process serves a slot at a time (the slot key is created once per term and every write
is fenced on its create revision); a slot's leader serves only while the process lease is valid by its local
deadline. Requests for a slot served elsewhere are answered NOT_LEADER naming the slot's leader (``leader``) and
the slot (``slot``): a client learns the map from LEADER and from these answers (Redis' MOVED).

Costs: a round is two range reads plus O(S * members) hashing; a campaign is a transaction and a read per slot
won; every served slot runs today's background tick.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgpack

from metaserver import gcpolicy, handoff, multislot
from metaserver import validate as v
from metaserver.combine import TxnCombiner
from metaserver.metrics import MetaserverMetrics
from metaserver.ownership import HeldLeases, release_answer, release_ids
from metaserver.partanswers import PartitionAnswers
from metaserver.persist import EtcdStore
from metaserver.service import ETCD_START_DEADLINE_S
from metaserver.slots import MEMBERSHIP, MembershipServer, SlotServer, rank, ranking
from metaserver.supervise import backoff, log_failure
from metaserver.fullload import node_descs
from transport import slotrules
from transport.wire import Op, Status
from umbp.auth import Tokens
from umbp.config import MetaserverConfig
from umbp.errors import NotLeader, UmbpError

log = logging.getLogger("umbp.metaserver")

POLL_S = 0.25  # a round of the slot election
RANK_DELAY_S = 0.5  # a vacant slot waits this long per rank before that rank campaigns
BUSY_WARN_S = 10.0  # a slot's election or handover running this long is logged (again every such period)
HANDOVER_FLUSH_S = 5.0  # a handed-over slot's queued etcd writes get this long to land
START_WAIT_S = 30.0  # start() waits at most this long for every slot to have a leader
_KEYED = (Op.ALLOC, Op.COMMIT, Op.ABORT, Op.LOOKUP, Op.EXISTS, Op.PREFIX, Op.REMOVE)


class SlotConn:
    """A connection as one slot server sees it: the peer's authentication, but its own PENDING allocations and read
    leases (ownership is per directory)."""

    __slots__ = ("conn", "pending", "leases")

    def __init__(self, conn):
        self.conn = conn
        self.pending: set = set()
        self.leases = HeldLeases()

    @property
    def auth(self):
        return self.conn.auth

    @property
    def closed(self) -> bool:
        return self.conn.closed

    @property
    def version(self) -> int:
        return self.conn.version

    @property
    def peer(self) -> str:
        return self.conn.peer


class _Leadership:
    """What ``metaserver.server.Connection`` and the metrics read of ``ms.leader``: the membership role's."""

    def __init__(self, p: "Partition"):
        self.p = p
        self.first_round = asyncio.Event()

    @property
    def addr(self) -> str:
        return self.p.addr

    @property
    def leader_addr(self) -> str | None:
        return self.p.holder(MEMBERSHIP)

    @property
    def revision(self) -> int:
        return self.p.servers[MEMBERSHIP].leader.revision

    @property
    def is_leader(self) -> bool:
        return self.p.servers[MEMBERSHIP].serving


class Partition(PartitionAnswers):
    """The process: its lease, its slot servers, the election rounds and the request routing."""

    def __init__(self, config: MetaserverConfig, advertise: str, slots: int):
        self.cfg = config
        self.addr = advertise
        self.slots = slots
        self.store = EtcdStore(config.etcd, config.etcd_prefix, config.etcd_timeout_s)
        self.combiner = TxnCombiner(self.store, config.persist_batch)  # the slots' etcd writes, combined
        self.tokens = Tokens.load(config.token, config.tokens_file, "metaserver")
        self.leader = _Leadership(self)
        self.metrics = MetaserverMetrics(self)
        self.lease = 0
        self._valid_until = 0.0
        self.holders: dict[str, tuple[str, int, int]] = {}  # slot name -> (address, create revision, lease)
        self.members: dict[str, dict] = {}  # live process address -> its members record
        self.names = [str(s) for s in range(slots)] + [MEMBERSHIP]
        self.servers: dict[str, SlotServer] = {s: SlotServer(config, self, s) for s in self.names[:-1]}
        self.servers[MEMBERSHIP] = MembershipServer(config, self)
        self._vacant: dict[str, float] = {}
        self._busy: dict[str, list[float]] = {}  # slots being elected or handed over: [since, last logged]
        self._deposing: set[str] = set()  # slots stepping down right now (``_depose``)
        self._unserved: set[str] = set()  # slots seen held here but not served last round (``_adopt_unserved``)
        self._warm_sent: tuple = ()
        self._bg: set[asyncio.Task] = set()
        self._loop: asyncio.Task | None = None
        self._election = None  # MetaserverMetrics.healthy reads it (the rounds) ...
        self._keep = None  # ... and this (the process lease keep-alive): /healthz fails once either has ended
        self.rounds = 0
        self.handovers = 0
        self.load_s = 0.0
        self.ticks = 0
        m = self.servers[MEMBERSHIP]
        self.handlers = {op: self._keyed(op) for op in _KEYED}
        self.handlers.update({
            Op.HELLO: m.hello, Op.AUTH: m.authenticate, Op.PING: m.ping, Op.LEADER: self.leader_info,
            Op.REGISTER_NODE: self._membership(Op.REGISTER_NODE), Op.HEARTBEAT: self._membership(Op.HEARTBEAT),
            Op.RELEASE: self.release, Op.STATS: self.stats, Op.NODES: self.nodes, Op.LIST: self.list_objects,
            Op.EVICT: self.evict, Op.DRAIN: self.drain,
        })

    # -- what server.py and the metrics read -------------------------------------------------------------------
    serving = True  # every request is routed (or answered NOT_LEADER) per slot below

    @property
    def writer(self):
        return self.servers[MEMBERSHIP].writer

    @property
    def dir(self):
        return self.servers[MEMBERSHIP].dir

    def lease_valid(self) -> bool:
        return time.monotonic() < self._valid_until

    def holder(self, name: str) -> str | None:
        h = self.holders.get(name)
        return h[0] if h is not None else None

    def led(self) -> list[str]:
        return [s for s in self.names[:-1] if self.servers[s].serving]

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._done)
        return t

    def _done(self, t: asyncio.Task) -> None:
        """A background task ended: forget it; log what it raised (a failed campaign must not pass silently)."""
        self._bg.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.error("metaserver: background task %s failed", t.get_name(), exc_info=t.exception())

    # -- lifecycle ---------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect, take the process lease, join ``members/``, and run rounds until every slot has a live leader and
        the ones held here are served (``_all_led``; at most START_WAIT_S): then the pool serves, whether this
        process leads anything yet or not."""
        await self.store.wait_ready(ETCD_START_DEADLINE_S)
        await self._join()
        self._loop = asyncio.create_task(self._run(), name="metaserver-slot-election")
        self._election = self._loop
        end = time.monotonic() + START_WAIT_S
        while time.monotonic() < end:
            await asyncio.sleep(POLL_S)
            if self._loop.done():
                self._loop.result()
            if self._all_led() and not self._busy:
                break
        self.leader.first_round.set()
        print(f"metaserver: {len(self.led())} of {self.slots} slots led here"
              f"{', membership leader' if self.servers[MEMBERSHIP].serving else ''}", flush=True)

    def _all_led(self) -> bool:
        """Every slot and the membership role held by a live process's key, none by a previous incarnation of this
        process (same address, another lease: revoked at the next round, so the address alone says nothing), and
        each one held here served. A restarted process's start waited for nothing: its predecessor's keys held
        every slot it had led."""
        for name in self.names:
            h = self.holders.get(name)
            if h is None or h[0] not in self.members:
                return False
            if h[0] == self.addr and (h[2] != self.lease or not self.servers[name].serving):
                return False
        return True

    async def _join(self) -> None:
        t0 = time.monotonic()
        self.lease = await self.store.grant(self.cfg.election_ttl_s)
        self._valid_until = t0 + self.cfg.election_ttl_s
        await self._put_member()

    async def _put_member(self) -> None:
        warm = sorted(self._warm_loaded())
        self._warm_sent = tuple(warm)
        rec = msgpack.packb({"addr": self.addr, "warm": warm}, use_bin_type=True)
        await self.store.put_member(self._member_key(self.addr), rec, self.lease)

    def _member_key(self, addr: str) -> bytes:
        return f"{self.store.prefix}/members/{addr}".encode()

    def _warm_loaded(self) -> set[str]:
        out = {s for s, srv in self.servers.items() if srv.warm is not None and srv.warm.loaded}
        return out | {MEMBERSHIP}  # the membership role has no pages: always ready to take

    async def close(self) -> None:
        """Stop the rounds, hand every led slot back (queued writes flushed, keys deleted), drop the lease."""
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)
        for t in list(self._bg):
            t.cancel()
        await asyncio.gather(*self._bg, return_exceptions=True)
        await asyncio.gather(*(srv.close() for srv in self.servers.values()), return_exceptions=True)
        if self.lease:
            try:
                await self.store.revoke(self.lease)
                log.info("metaserver: left the pool: lease %x revoked, its slots free at once", self.lease)
            except UmbpError as e:
                log.warning("metaserver: %s", e)
        await self.store.close()

    async def resign(self, name: str, ops: tuple | list = ()) -> None:
        """Delete our key of slot ``name`` (fenced: only the term we won), with ``ops`` in the same transaction."""
        srv = self.servers[name]
        srv.leader.won = False
        try:
            await srv.store.txn([*ops, srv.store.op_delete(srv.store.leader_key)])
        except UmbpError as e:
            log.warning("metaserver: slot %s: resign: %s", name, e)

    # -- the election ------------------------------------------------------------------------------------------
    async def _run(self) -> None:
        """The election rounds, supervised (``metaserver/supervise.py``): the process never stops campaigning."""
        keep = self._keep = asyncio.create_task(self._keepalive(), name="metaserver-process-lease")
        fails = 0
        try:
            for _ in range(1 << 62):  # bounded by cancellation; each round is bounded by etcd timeouts
                try:
                    await self._round()
                    fails = 0
                except Exception as e:  # noqa: BLE001 - supervised: see the docstring
                    fails += 1
                    log_failure("slot election round", e)
                self.rounds += 1
                await asyncio.sleep(backoff(fails, POLL_S))
        finally:
            keep.cancel()
            await asyncio.gather(keep, return_exceptions=True)

    async def _keepalive(self) -> None:
        """Keep the process lease alive (``_renew`` every ttl/3), supervised: one that died (a raw error out of
        ``_lost_lease``'s rejoin) left a zombie that no probe saw."""
        ttl = self.cfg.election_ttl_s
        fails = 0
        for _ in range(1 << 62):  # bounded by cancellation
            try:
                await self._renew(ttl)
                fails = 0
            except Exception as e:  # noqa: BLE001 - supervised: see the docstring
                fails += 1
                log_failure("process lease keep-alive", e)
                await asyncio.sleep(min(backoff(fails, POLL_S), ttl / 3))

    async def _renew(self, ttl: int) -> None:
        await asyncio.sleep(ttl / 3)
        sent = time.monotonic()
        try:
            async with asyncio.timeout(ttl / 3):  # not wait_for: on 3.11 it can lose a cancel (warmpace.wait_event)
                left = await self.store.refresh(self.lease)
        except (asyncio.TimeoutError, UmbpError) as e:
            if time.monotonic() >= self._valid_until:
                await self._lost_lease(f"no keep-alive acknowledged within the lease ({e or 'timeout'})")
            return
        if left <= 0:
            await self._lost_lease("the process lease expired")
            return
        self._valid_until = sent + left

    async def _lost_lease(self, reason: str) -> None:
        """Every slot of ours is gone with the lease: stop serving them, then join again with a new lease."""
        self._valid_until = 0.0
        for name, srv in self.servers.items():
            if srv.leader.won or srv.loaded:
                srv.leader.won = False
                await srv._deposed(reason)
        log.warning("metaserver: process lease lost (%s): every slot stepped down", reason)
        try:
            await self._join()
        except UmbpError as e:
            log.warning("metaserver: rejoining: %s", e)

    async def _read(self) -> None:
        prefix = self.store.prefix
        members: dict[str, dict] = {}
        async for kvs in self.store.scan(f"{prefix}/members/".encode()):
            for kv in kvs:
                try:
                    rec = msgpack.unpackb(kv.value, raw=False)
                    members[rec["addr"]] = rec
                except (ValueError, TypeError, KeyError, msgpack.exceptions.UnpackException):
                    log.warning("metaserver: ignoring unreadable member record %r", kv.key)
        holders: dict[str, tuple[str, int, int]] = {}
        base = f"{prefix}/slotmap/".encode()
        async for kvs in self.store.scan(base):
            for kv in kvs:
                holders[kv.key[len(base):].decode(errors="replace")] = (
                    kv.value.decode(errors="replace"), kv.create_revision, kv.lease)
        self.members, self.holders = members, holders

    async def _round(self) -> None:
        await self._read()
        now = time.monotonic()
        live = sorted(self.members) if self.addr in self.members else sorted(set(self.members) | {self.addr})
        if self.addr not in self.members and self.lease_valid():
            await self._put_member()
        campaigns = []
        orders = ranking(self.slots, tuple(live))
        for name in self.names:
            if name in self._busy:
                self._still_busy(name, now)
                continue
            srv = self.servers[name]
            order = list(orders[int(name)]) if name != MEMBERSHIP else rank(name, live)
            h = self.holders.get(name)
            if h is None:
                if srv.leader.won:
                    self._spawn(self._depose(name, "its slot key is gone"))
                    continue
                since = self._vacant.setdefault(name, now)
                if now - since >= self._delay(name, order) and self.lease_valid():
                    campaigns.append(name)
                continue
            self._vacant.pop(name, None)
            addr, rev, lease = h
            if addr == self.addr and lease != self.lease:
                # A previous incarnation of this process (same address) that died without resigning: end its term.
                log.info("metaserver: revoking the lease of a previous incarnation at %s", addr)
                await self.store.revoke(lease)
                continue
            if self._adopt_unserved(name, srv, h):
                continue
            if srv.leader.won and rev != srv.leader.revision:
                self._spawn(self._depose(name, f"slot {name} is led by {addr} now"))
            elif srv.leader.won and srv.loaded and order[0] != self.addr:
                first = self.members.get(order[0])
                if first is not None and name in (first.get("warm") or ()):
                    self._begin(name)
                    self._spawn(self._handover(name, order[0]))
            elif addr != self.addr:
                self._keep_warm(srv, name, order, addr)
        for name in campaigns:
            self._begin(name)
            self._spawn(self._campaign(name))
        if self._nodes_due():
            await self._sync_nodes(now)
        if tuple(sorted(self._warm_loaded())) != self._warm_sent and self.lease_valid():
            await self._put_member()

    def _begin(self, name: str) -> None:
        self._busy[name] = [time.monotonic()] * 2  # being elected or handed over from now on

    def _still_busy(self, name: str, now: float) -> None:
        """Log an election or handover of ``name`` running for BUSY_WARN_S, and again every BUSY_WARN_S (a big
        slot's load or catch-up takes a while; one that never ends would be a bug to see)."""
        t = self._busy[name]
        if now - t[1] >= BUSY_WARN_S:
            t[1] = now
            log.warning("metaserver: slot %s: its election or handover has run for %.0fs", name, now - t[0])

    def _adopt_unserved(self, name: str, srv: SlotServer, h: tuple[str, int, int]) -> bool:
        """True, campaigning again (which adopts a key held under our lease), when slot ``name``'s key is ours under
        this lease and the slot neither served nor being elected, handed over or deposed here two rounds running
        (see the module docstring): nothing else would end that state before the lease does."""
        addr, _rev, lease = h
        if addr != self.addr or lease != self.lease or srv.leader.won or name in self._deposing \
                or not self.lease_valid():
            self._unserved.discard(name)
            return False
        if name not in self._unserved:
            self._unserved.add(name)  # a depose or a handover may be ending right now: look again next round
            return False
        self._unserved.discard(name)
        log.warning("metaserver: slot %s: its key is held here but the slot is not served: taking it up", name)
        self._begin(name)
        self._spawn(self._campaign(name))
        return True

    def _delay(self, name: str, order: list[str]) -> float:
        """How long slot ``name`` stays vacant before this process campaigns: its place in the slot's order with the
        processes whose warm copy of it is loaded moved to the front (in order), times RANK_DELAY_S. A dead leader's
        slot goes to the process that kept its copy even where the survivors' map puts it elsewhere (``ranking``);
        it moves there later, warm."""
        loaded = self._warm_loaded()
        warm = [a for a in order if (name in loaded if a == self.addr
                                     else name in ((self.members.get(a) or {}).get("warm") or ()))]
        return (warm + [a for a in order if a not in warm]).index(self.addr) * RANK_DELAY_S

    def _keep_warm(self, srv: SlotServer, name: str, order: list[str], holder: str) -> None:
        if name == MEMBERSHIP:
            return
        successor = next((a for a in order if a != holder), None)
        want = order[0] == self.addr or successor == self.addr
        if want and srv.warm is None:
            srv._standing_by()
        elif not want and srv.warm is not None:
            warm, srv.warm = srv.warm, None
            self._spawn(self._drop_warm(warm, name))

    @staticmethod
    async def _drop_warm(warm, name: str) -> None:
        await warm.stop()
        gcpolicy.thaw(f"metaserver: slot {name}'s warm copy dropped")  # it may be frozen cyclic garbage now

    async def _campaign(self, name: str) -> None:
        srv = self.servers[name]
        store = srv.store
        try:
            won, rev, _, _ = await store.campaign(self.addr.encode(), self.lease)  # adopts a key under our lease
            if not won:
                return
            srv.leader.revision = rev
            store.fence(rev)
            store.on_fenced = lambda n=name: self._spawn(self._depose(n, "a write was fenced"))
            self.holders[name] = (self.addr, rev, self.lease)
            t0 = time.monotonic()
            try:
                await srv._elected(rev)
            except BaseException:
                await self.resign(name)
                raise
            srv.leader.won = True
            await self._sync_nodes(time.monotonic(), [name])  # its nodes now, not at the next round
            self.load_s = max(self.load_s, time.monotonic() - t0)
            log.info("metaserver: slot %s: leader at revision %d (%s, %.3fs)", name, rev,
                     "warm" if srv.takeover.get("warm") else "full load", time.monotonic() - t0)
        except UmbpError as e:
            log.warning("metaserver: slot %s: campaign: %s", name, e)
        finally:
            self._busy.pop(name, None)

    async def _depose(self, name: str, reason: str) -> None:
        srv = self.servers[name]
        if not srv.leader.won and not srv.loaded:
            return
        srv.leader.won = False
        self._deposing.add(name)
        try:
            log.warning("metaserver: slot %s: stepping down: %s", name, reason)
            await srv._deposed(reason)
        finally:
            self._deposing.discard(name)

    async def _handover(self, name: str, to: str) -> None:
        """A process ranked above us has its warm copy of ``name``: stop serving it, let its queued writes land,
        then delete our key (fenced) so that process wins the next round."""
        srv = self.servers[name]
        try:
            srv.loaded = False
            try:
                await srv.writer.close(HANDOVER_FLUSH_S)
            except UmbpError as e:
                log.warning("metaserver: slot %s: handover flush: %s", name, e)
            srv.leader.won = False
            srv.term += 1
            await srv._teardown(NotLeader("metaserver", f"slot {name} handed over to {to}", Status.NOT_LEADER,
                                          leader=to))
            ops = handoff.open_ops(srv.store, srv.dir)  # `to` keeps their extents free (metaserver/handoff.py)
            srv._new_state()
            await self.resign(name, ops)
            self.handovers += 1
            log.info("metaserver: slot %s handed over to %s", name, to)
        finally:
            self._busy.pop(name, None)

    # -- nodes -------------------------------------------------------------------------------------------------
    _nodes_at = 0.0

    def _nodes_due(self) -> bool:
        return any(self.servers[s].serving for s in self.names[:-1])

    async def _sync_nodes(self, now: float, names: list[str] | None = None) -> None:
        """Feed the served slots (or ``names``) the pool's leased node records (the membership leader's)."""
        live = await self.store._records(self.store._nodes)
        descs = {nid: d for nid, (d, lease) in node_descs(live, []).items() if lease}
        for s in names or self.names[:-1]:
            self.servers[s].sync_nodes(descs, now)

    # -- routing -----------------------------------------------------------------------------------------------
    def _moved(self, name: str) -> v.Reject:
        holder = self.holder(name)
        if holder == self.addr:
            return v.Reject(f"slot {name} is taking over here; not serving yet", Status.UNAVAILABLE)
        return v.Reject(f"slot {name} is led by {holder or 'nobody yet'}", Status.NOT_LEADER, leader=holder,
                        slot=int(name) if name != MEMBERSHIP else -1)

    def _slot_conn(self, conn, name: str) -> SlotConn:
        sc = getattr(conn, "slot_conns", None)
        if sc is None:
            sc = conn.slot_conns = {}
        c = sc.get(name)
        if c is None:
            c = sc[name] = SlotConn(conn)
        return c

    def slot_of_request(self, meta: Any) -> str:
        """The slot every key of a request belongs to; BAD_REQUEST when they span several (a request for several
        slots says so with ``parts``: ``metaserver/multislot.py``)."""
        if type(meta) is not dict or type(meta.get("ns")) is not str or type(meta.get("keys")) is not list:
            return "0"  # malformed: slot 0's handler answers with the precise error
        ns, keys = meta["ns"], meta["keys"]
        S = self.slots
        slots = set(slotrules.slots_of(ns, keys, S))
        slots.discard(-1)
        if len(slots) > 1:
            raise v.Reject(f"keys of {len(slots)} slots in one request: a partitioned pool ({S} slots) takes one "
                           f"slot's keys per request unless it names its 'parts'")
        return str(slots.pop()) if slots else "0"

    def named_slot(self, meta: dict, check: bool) -> str:
        """The slot a single-slot request names (``"slot"``, taken out of ``meta``: wire VERSION 10), instead of the
        one its keys hash to. ``check`` (ALLOC: the one request that creates entries) hashes every key and refuses a
        key of another slot, so an entry only ever lives in its key's slot; the other keyed requests trust the name,
        since against the wrong slot they can only miss (``multislot.split``)."""
        s = meta.pop("slot")
        if type(s) is not int or not 0 <= s < self.slots:
            raise v.Reject(f"'slot' must be an int 0..{self.slots - 1}, got {s!r}")
        if check and type(meta.get("ns")) is str and type(meta.get("keys")) is list:
            for i, got in enumerate(slotrules.slots_of(meta["ns"], meta["keys"], self.slots)):
                if got != s and got != -1:  # -1: not a key at all, refused by the slot's own validation
                    raise v.Reject(f"key {i} is not of slot {s}")
        return str(s)

    def _keyed(self, op: int):
        check = op == Op.ALLOC

        def handle(meta: Any, conn):
            if type(meta) is dict and "parts" in meta:
                return multislot.dispatch(self, op, meta, conn)  # several slots' keys in one request
            name = (self.named_slot(meta, check) if type(meta) is dict and "slot" in meta
                    else self.slot_of_request(meta))
            srv = self.servers[name]
            if not srv.serving:
                raise self._moved(name)
            return srv.handlers[op](meta, self._slot_conn(conn, name))
        return handle

    def _membership(self, op: int):
        def handle(meta: Any, conn):
            srv = self.servers[MEMBERSHIP]
            if not srv.serving:
                raise self._moved(MEMBERSHIP)
            return srv.handlers[op](meta, conn)
        return handle

    def release(self, meta: Any, conn) -> dict:
        """RELEASE on the slots that gave the leases (each slot's leases are its connection's: ``_slot_conn``)."""
        ids = release_ids(meta)
        n = 0
        for name, sc in (getattr(conn, "slot_conns", None) or {}).items():
            mine = [x for x in ids if x in sc.leases]
            if mine and self.servers[name].serving:
                n += self.servers[name].release_held(mine, sc)
        return release_answer(meta, ids, n)

    def drop_pending(self, conn) -> int:
        n = 0
        for name, sc in (getattr(conn, "slot_conns", None) or {}).items():
            n += self.servers[name].drop_pending(sc)
        return n
