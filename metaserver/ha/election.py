"""The election of a pool's slots, one mechanism for every pool: a pool is always slots (one by default), and a
standby is a process that leads no slot yet. ``ElectedProcess`` is one metaserver process's side of it: its etcd
lease, its ``members/`` record, the rounds that campaign for, keep, hand over and give up its slots, and the warm
copies it keeps for slots it may take next. ``metaserver.ha.partition.Partition`` builds the slot servers
(``metaserver.ha.slots.SlotServer``) and routes requests to them.

Lease: the process holds one etcd lease of ``election_ttl_s`` (kept alive every ttl/3) under which it puts
``members/{addr}`` and every slot key it wins, so a process that dies loses all of them at once when its lease
expires. The process keeps a local validity deadline: the send time of the last acknowledged keep-alive plus the
TTL etcd granted. etcd measures the lease from when the keep-alive *arrived*, so the local deadline always passes
first: a process that was frozen (SIGSTOP, a long GC pause) stops serving its slots the moment it runs again, before
it could act on stale state, even if no write of it has been refused yet (``lease_valid``). A lease found expired
deposes every slot and the process joins again with a new one (``_lost_lease``).

Rounds (``_round``, every POLL_S) read ``members/`` and the slot keys (two range reads) and, for each slot s (and
for the membership role ``m`` of a pool of several slots, ``metaserver/ha/slots.py``):

- nobody holds it: campaign (create the slot key if absent, under the process lease) when this process is rank r of
  slot s's order in ``ranking(S, live members)`` (balanced: S/N slots each; ``rank`` for ``m``), the processes with
  a loaded warm copy of s moved to the front, and the slot has been vacant for r * RANK_DELAY_S: a dead process's
  slots go to each one's successor (which kept the warm copy), all in the same round, in parallel;
- we hold it and a process ranked above us reports its warm copy of s loaded (``members`` value ``warm``): hand it
  over (stop serving, flush queued writes, delete the key fenced, with the record of the slot's open allocations:
  ``metaserver/ha/handoff.py``): that is how a joining process takes its share. A one-slot pool has nothing to
  balance: its leader leads until it dies or steps down;
- someone else holds it: keep a warm copy (``standby.WarmDirectory``, on this slot's pages) when this process is
  rank 0 (the slot comes here once the copy is loaded) or the next-ranked after the holder (the successor); in a
  one-slot pool every standby keeps one;
- a key at our address under another lease: a previous incarnation of this process that died without resigning:
  its lease is revoked at once instead of waited out;
- we hold it under our lease but neither serve, elect, hand over nor depose it two rounds running (a campaign's
  answer lost after etcd applied it, a failed resign): campaign again, adopting the key (``_adopt_unserved``).

Fencing: a slot's every write compares the slot key's create revision with the one its term won at
(``EtcdStore.txn``); a refused write deposes the slot. A slot whose etcd writes were dropped gives its term up
(``SlotServer._give_up``: stop serving, delete the key fenced), so the next term, here or on another process,
starts from what etcd holds under a new fence. A clean stop (``close``) hands each led slot's open allocations on
and deletes its key, then revokes the lease: a standby takes over at once instead of after the TTL.

One-slot pools keep the unpartitioned etcd layout (docs/operations/upgrades.md): slot 0's key is ``{prefix}/leader``
itself, so a process of an earlier release (which campaigns on that key under a lease of its own and ignores
``members/``) and this one exclude each other on one key and fence on its create revision during a rolling upgrade.
Such a pool prints the unpartitioned lines (``leader at revision N``, ``standby, leader is ADDR``, ``standby,
stepped down (...)``).

Invariants: at most one process serves a slot at a time (the slot key is created once per term and every write
is fenced on its create revision); a slot's leader serves only while the process lease is valid by its local
deadline. Costs: a round is two range reads plus O(S * members) hashing; a campaign is a transaction and a read
per slot won; every served slot runs its background tick.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgpack

from metaserver.store import gcpolicy

from metaserver.ha import handoff
from metaserver.ha.service import ETCD_START_DEADLINE_S
from metaserver.ha.slots import MEMBERSHIP, SlotServer, rank, ranking
from metaserver.ha.supervise import backoff, log_failure
from transport.wire import Status
from umbp.errors import NotLeader, UmbpError

log = logging.getLogger("umbp.metaserver")

POLL_S = 0.25  # a round of the slot election
RANK_DELAY_S = 0.5  # a vacant slot waits this long per rank before that rank campaigns
BUSY_WARN_S = 10.0  # a slot's election or handover running this long is logged (again every such period)
HANDOVER_FLUSH_S = 5.0  # a handed-over slot's queued etcd writes get this long to land
START_WAIT_S = 30.0  # start() waits at most this long for every slot to have a leader


class ElectedProcess:
    """A metaserver process of the pool as the election sees it (see the module docstring). The process class
    (``Partition``) provides ``cfg``, ``addr``, ``slots``, ``store``, ``servers``, ``names``, ``page_slots``,
    ``membership``, ``leader`` (its ``first_round``), ``led``, ``_nodes_due`` and ``_sync_nodes``, and sets up the
    state ``_init_election`` makes."""

    def _init_election(self) -> None:
        self.lease = 0
        self._valid_until = 0.0
        self.holders: dict[str, tuple[str, int, int]] = {}  # slot name -> (address, create revision, lease)
        self.members: dict[str, dict] = {}  # live process address -> its members record
        self._vacant: dict[str, float] = {}
        self._busy: dict[str, list[float]] = {}  # slots being elected or handed over: [since, last logged]
        self._deposing: set[str] = set()  # slots stepping down right now (``_depose``)
        self._unserved: set[str] = set()  # slots seen held here but not served last round (``_adopt_unserved``)
        self._warm_sent: tuple = ()
        self._told: str | None = None  # the leader a one-slot pool's standby last printed
        self._bg: set[asyncio.Task] = set()
        self._loop: asyncio.Task | None = None
        self._election = None  # MetaserverMetrics.healthy reads it (the rounds) ...
        self._keep = None  # ... and this (the process lease keep-alive): /healthz fails once either has ended
        self.rounds = 0
        self.handovers = 0

    def lease_valid(self) -> bool:
        return time.monotonic() < self._valid_until

    def holder(self, name: str) -> str | None:
        h = self.holders.get(name)
        return h[0] if h is not None else None

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
        if self.slots > 1:  # a one-slot pool's process said "leader at revision N" or "standby, leader is ADDR"
            print(f"metaserver: {len(self.led())} of {self.slots} slots led here"
                  f"{', membership leader' if self.membership.serving else ''}", flush=True)

    def _all_led(self) -> bool:
        """Every slot and the membership role held by a live process's key, none by a previous incarnation of this
        process (same address, another lease: revoked at the next round, so the address alone says nothing), and
        each one held here served. A restarted process's start waited for nothing: its predecessor's keys held
        every slot it had led. A one-slot pool's key may be held by a process of an earlier release, which keeps no
        ``members/`` record."""
        for name in self.names:
            h = self.holders.get(name)
            if h is None or (h[0] not in self.members and self.slots > 1):
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
        # the membership role (a pool of several slots) has no pages: always ready to take
        return out | {MEMBERSHIP} if MEMBERSHIP in self.servers else out

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
                if self.slots == 1:
                    log.info("metaserver: resigned: election lease %x revoked", self.lease)
                else:
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
        """The election rounds, supervised (``metaserver/ha/supervise.py``): the process never stops campaigning."""
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
        """``members/`` and the slot keys: ``slotmap/`` of a pool of several slots, ``{prefix}/leader`` of a
        one-slot pool."""
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
        if self.slots == 1:
            cur = await self.store.leader()
            if cur is not None:
                holders["0"] = (cur[0].decode(errors="replace"), cur[1], cur[2])
        else:
            base = f"{prefix}/slotmap/".encode()
            async for kvs in self.store.scan(base):
                for kv in kvs:
                    holders[kv.key[len(base):].decode(errors="replace")] = (
                        kv.value.decode(errors="replace"), kv.create_revision, kv.lease)
        self.members, self.holders = members, holders
        if self.slots == 1:
            self._tell_leader()

    def _tell_leader(self) -> None:
        """A one-slot pool's standby prints who leads whenever that changes (the unpartitioned line)."""
        who = self.holder("0")
        if who is None or who == self.addr:
            self._told = None
        elif who != self._told:
            self._told = who
            log.info("metaserver: standby, leader is %s", who)
            print(f"metaserver: standby, leader is {who}", flush=True)

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
            elif srv.leader.won and srv.loaded and order[0] != self.addr and self.slots > 1:
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
        want = order[0] == self.addr or successor == self.addr or self.slots == 1  # one slot: every standby
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
            if self.slots > 1:
                await self._sync_nodes(time.monotonic(), [name])  # its nodes now, not at the next round
                self.load_s = max(self.load_s, time.monotonic() - t0)
            log.info("metaserver: slot %s: leader at revision %d (%s, %.3fs)", name, rev,
                     "warm" if srv.takeover.get("warm") else "full load", time.monotonic() - t0)
            if self.slots == 1:
                print(f"metaserver: leader at revision {rev}", flush=True)  # the unpartitioned line
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
            ops = handoff.open_ops(srv.store, srv.dir)  # `to` keeps their extents free (metaserver/ha/handoff.py)
            srv._new_state()
            await self.resign(name, ops)
            self.handovers += 1
            log.info("metaserver: slot %s handed over to %s", name, to)
        finally:
            self._busy.pop(name, None)

