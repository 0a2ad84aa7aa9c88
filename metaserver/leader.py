"""Leadership: which metaserver of an etcd prefix serves the data plane, and where the others send clients.

Several metaservers run against one etcd; each runs an ``Election``. The leader key ``{prefix}/leader`` holds the
winner's advertise address and is attached to the winner's lease of ``election_ttl_s`` seconds, kept alive every
ttl/3. A round is one transaction that creates the key only if it does not exist (create_revision == 0); the
winner's fence is the key's create_revision, which ``EtcdStore`` adds as a compare to every later write, so a
deposed leader (its lease expired while it was stopped or cut off, and someone else created the key) cannot write.

Standbys poll the key every ``POLL_S`` (a get: cheaper and sturdier than a watch stream that must be re-established
after every etcd hiccup) and campaign as soon as it is gone, so a dead leader is replaced within about
``election_ttl_s + POLL_S`` plus the new leader's takeover: a catch-up of its warm directory (``on_standby`` starts
one whenever a round is lost; ``metaserver/standby.py``), or a full directory load when it has none.

The leader also keeps a local validity deadline: the send time of the last acknowledged keep-alive plus the TTL
etcd granted. etcd measures the lease from when the keep-alive *arrived*, so the local deadline always passes
first: a leader that was frozen (SIGSTOP, a long GC pause) stops serving the moment it runs again, before it
could act on stale state, even if no write of it has been refused yet. If a later keep-alive finds the lease still
alive, nobody else can have led meanwhile (the key is still ours), so serving resumes without a reload.

Invariant: at most one metaserver per prefix has ``is_leader`` true at any instant, and at most one can write.

Stepping down on purpose (``step_down``): when the metaserver's etcd writer had to drop writes (etcd was away
longer than its retry window), etcd no longer holds what the directory does. The leader then gives the term up
at once (stops serving, drops its state, revokes its lease, which deletes the leader key), so the next term, here
or on a standby, starts from what etcd holds (a full load, or a warm copy fed by etcd's own watch) under a new
fence revision, which also refuses any write of the old term still in flight.

Cancellation: ``run`` cancelled while leading resigns nothing by itself; ``resign`` (on a clean stop) revokes the
lease so a standby takes over at once instead of after the TTL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from metaserver.persist import EtcdStore
from umbp.errors import RemoteError, Unavailable, UmbpError

log = logging.getLogger("umbp.metaserver")

POLL_S = 0.25  # how often a standby reads the leader key
RETRY_S = 0.5  # pause after an etcd failure before the next round


class Election:
    """Campaign for the leader key, keep it, and tell the metaserver when leadership starts and ends.

    ``on_elected(revision)`` runs (awaited) after a win and before ``is_leader`` turns true: the metaserver takes
    over its directory there. ``on_deposed(reason)`` runs (awaited) when the lease is lost or a write was fenced.
    ``on_standby()`` (optional, not awaited, must not block) runs after every lost round, before following."""

    def __init__(self, store: EtcdStore, addr: str, ttl_s: int,
                 on_elected: Callable[[int], Awaitable[None]], on_deposed: Callable[[str], Awaitable[None]],
                 on_standby: Callable[[], None] | None = None):
        self.store = store
        self.addr = addr
        self.ttl = int(ttl_s)
        self.on_elected = on_elected
        self.on_deposed = on_deposed
        self.on_standby = on_standby
        self.revision = 0  # create_revision of the leader key while we hold it
        self.lease_id = 0
        self.holder: str | None = None  # the leader's address as last read (ours while leading)
        self.first_round = asyncio.Event()  # set once the first round is decided (won and loaded, or lost)
        self._won = False
        self._valid_until = 0.0
        self._lost = asyncio.Event()
        self._why = ""  # why ``_lost`` was set

    @property
    def is_leader(self) -> bool:
        return self._won and time.monotonic() < self._valid_until

    @property
    def leader_addr(self) -> str | None:
        if self._won:
            return self.addr
        return self.holder

    def deposed(self) -> None:
        """A write of ours was fenced: leadership is gone; ``run`` steps down at once."""
        self.step_down("a write was fenced (another metaserver leads)")

    def step_down(self, reason: str) -> None:
        """Give this term up now (see the module docstring): ``run`` steps down (``on_deposed``), revokes the lease
        and campaigns again, so whoever leads next loads from etcd. Also while the term's directory is loading."""
        if not self._lost.is_set():
            self._why = reason
            self._lost.set()

    async def run(self) -> None:
        """Forever: campaign; lead until the lease is lost; stand by while someone else leads. Cancellable at any
        point; etcd failures are retried every RETRY_S."""
        while True:
            try:
                if await self._campaign():
                    reason = await self._lead()
                    await self._step_down(reason)
                else:
                    self.first_round.set()
                    if self.on_standby is not None:
                        self.on_standby()
                    await self._follow()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - etcd trouble or a failed load: never stop campaigning
                if self._won:
                    await self._step_down(str(e))
                if isinstance(e, UmbpError):
                    log.warning("metaserver: election: %s; retrying", e)
                else:
                    log.exception("metaserver: election round failed; retrying")
                self.first_round.set()
                await asyncio.sleep(RETRY_S)

    async def _campaign(self) -> bool:
        t0 = time.monotonic()
        lease = await self.store.grant(self.ttl)
        won, rev, value, holder_lease = await self.store.campaign(self.addr.encode(), lease)
        if not won:
            await self._revoke(lease)
            holder = value.decode(errors="replace") if value is not None else None
            if holder == self.addr and holder_lease:
                # A leader key with our own address while we hold its port: a previous incarnation of this
                # metaserver that died without resigning. Nobody else can be serving there, so end its term now
                # instead of waiting out its lease.
                log.info("metaserver: revoking the lease of a previous incarnation at %s", holder)
                await self._revoke(holder_lease)
                return await self._campaign()
            if holder != self.holder:
                log.info("metaserver: standby, leader is %s", holder or "unknown")
                print(f"metaserver: standby, leader is {holder or 'unknown'}", flush=True)
            self.holder = holder
            return False
        self.lease_id, self.revision, self.holder = lease, rev, self.addr
        self._lost = asyncio.Event()
        self.store.fence(rev)
        self.store.on_fenced = self.deposed
        self._valid_until = t0 + self.ttl
        try:
            # Keep the lease alive while the directory loads (a big one can take longer than the TTL).
            keep = asyncio.create_task(self._keepalive_loop(), name="metaserver-election-keepalive")
            try:
                await self.on_elected(rev)
            finally:
                lost = None
                if keep.done():
                    err = keep.exception()
                    lost = keep.result() if err is None else f"its keep-alive failed ({err})"
                keep.cancel()
                await asyncio.gather(keep, return_exceptions=True)
            if lost is not None:
                # The term was lost (or given up: ``step_down``) while loading, after its state was built: drop it
                # before giving the lease back, as a step-down from leading does.
                await self.on_deposed(lost)
                raise Unavailable("metaserver", f"election: {lost} while loading")
        except BaseException:
            await self._revoke(lease)
            self.lease_id = 0
            raise
        self._won = True
        self.first_round.set()
        log.info("metaserver: leader at revision %d (%s)", rev, self.addr)
        print(f"metaserver: leader at revision {rev}", flush=True)
        return True

    async def _lead(self) -> str:
        """Keep the lease alive until it is lost; returns why."""
        return await self._keepalive_loop()

    async def _keepalive_loop(self) -> str:
        interval = self.ttl / 3
        while True:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can lose a cancel that arrives as the inner await
            # completes, and this loop would then run on after close() (metaserver/warmpace.py ``wait_event``).
            try:
                async with asyncio.timeout(interval):
                    await self._lost.wait()
                return self._why
            except asyncio.TimeoutError:
                pass
            sent = time.monotonic()
            try:
                async with asyncio.timeout(interval):
                    left = await self.store.refresh(self.lease_id)
            except (asyncio.TimeoutError, RemoteError) as e:
                if time.monotonic() >= self._valid_until:
                    return f"no keep-alive acknowledged within the lease ({e or 'timeout'})"
                continue
            if left <= 0:
                return "the election lease expired"
            self._valid_until = sent + left

    async def _step_down(self, reason: str) -> None:
        was = self._won
        self._won = False
        self._valid_until = 0.0
        lease, self.lease_id = self.lease_id, 0
        self.holder = None
        if was:
            log.warning("metaserver: stepping down: %s", reason)
            print(f"metaserver: standby, stepped down ({reason})", flush=True)
            await self.on_deposed(reason)
        if lease:
            await self._revoke(lease)

    async def _follow(self) -> None:
        """Poll the leader key until it is gone (then return to campaign)."""
        while True:
            await asyncio.sleep(POLL_S)
            cur = await self.store.leader()
            if cur is None:
                return
            holder = cur[0].decode(errors="replace")
            if holder != self.holder:
                self.holder = holder
                log.info("metaserver: standby, leader is %s", holder)
                print(f"metaserver: standby, leader is {holder}", flush=True)

    async def _revoke(self, lease: int) -> None:
        try:
            await self.store.revoke(lease)
        except UmbpError as e:
            log.warning("metaserver: election: %s", e)

    async def resign(self) -> None:
        """Give leadership up now (clean stop): revoking the lease deletes the leader key."""
        self._won = False
        self._valid_until = 0.0
        lease, self.lease_id = self.lease_id, 0
        if lease:
            await self._revoke(lease)
            log.info("metaserver: resigned: election lease %x revoked", lease)
