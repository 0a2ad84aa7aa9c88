"""The metaserver's data-plane handlers (``DataPlane``, held by ``metaserver.ha.service.Metaserver`` as ``dataplane``,
its bound methods in the service's dispatch table): ALLOC, COMMIT, ABORT, LOOKUP, EXISTS, PREFIX and REMOVE on the page
table (``metaserver.table.directory.TableDirectory``). A class holding the service, not the directory: the service
builds a new directory, writer, membership and generation counter every term, so each handler reads the term's through
``svc`` when it runs. Each validates its request, checks the connection's rights, calls the directory (bookkeeping
before any await, so a request's effect is atomic), hands the etcd work to the batch writer (``Metaserver._apply``) and
answers with the closed pool's tags and capabilities (``metaserver/table/grants.py``: an ALLOC's and a LOOKUP's places
as packed rows from wire VERSION 12, built from the table's columns); only COMMIT waits for etcd, and ALLOC when
generations run out, right after a takeover (at most ``ALLOC_HOLD_S``), or while a removal queued before it is not
durable (``_when_durable``: its places may lie in the extents freed). A LOOKUP or an ALLOC from the server's
connections is answered at the end of its event-loop turn, with the turn's others (``metaserver/handlers/turns.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from metaserver import validate as v
from metaserver.handlers.ownership import own_lease, refuse_over_quota
from metaserver.table.entry import OVER_QUOTA
from metaserver.table import queries
from metaserver.table.grants import grant_alloc
from transport.wire import Status
from umbp.errors import Unavailable

ALLOC_HOLD_S = 3.0  # after a takeover ALLOC waits at most this long for the loaded nodes to re-register

_NS_KEYS = frozenset({"ns", "keys"})
_LOOKUP = frozenset({"ns", "keys", "shard"})
_NS_KEYS_GENS = frozenset({"ns", "keys", "gens"})
_ABORT = frozenset({"ns", "keys", "gens", "written"})
_COMMIT = frozenset({"ns", "keys", "gens", "shard"})
_ALLOC = frozenset({"ns", "keys", "sizes", "parents", "token", "shard"})


class DataPlane:
    """The data-plane requests of one slot's service ``svc`` (see the module docstring)."""

    def __init__(self, svc):
        self.svc = svc
        self.alloc_waited_s = 0.0  # ALLOC answers' time spent waiting for removals to be durable (``_when_durable``)

    def alloc(self, meta: Any, conn, defer: bool = True):
        """ALLOC: the answer, a coroutine for it, or (``defer``, for a connection that waits: the server's) a
        ``Later`` answered with the turn's other ALLOCs (``metaserver/handlers/turns.py``, ``alloc_many``)."""
        svc = self.svc
        m = v.fields(meta, _ALLOC, ("ns", "keys", "sizes"))
        ns = v.ns(m)
        conn.auth.scope.check(ns, True, "metaserver")
        keys = v.keys(m, svc.max_keys)
        sizes = v.ints(m, "sizes", len(keys), 0, v.MAX_PAYLOAD)
        parents = v.parents(m, len(keys))
        token = v.integer(m, "token", 1, (1 << 63) - 1) if m.get("token") is not None else None
        shard = v.shard(m)
        if defer and shard is None and svc.settled.is_set() and getattr(conn, "in_turns", False):
            return svc.allocs.ask(ns, keys, conn, sizes, parents, token)
        return self._alloc(ns, keys, sizes, parents, token, conn, shard)

    def _alloc(self, ns, keys, sizes, parents, token, conn, shard=None):
        svc = self.svc
        base = svc.gens.take_nowait(len(keys)) if svc.settled.is_set() else None
        if base is None:
            return self._alloc_later(ns, keys, sizes, parents, svc.term, token, conn, shard)
        return self._when_durable(self._alloc_now(ns, keys, sizes, parents, base, token, conn, shard), svc.term)

    def alloc_many(self, ns: str, asks: list) -> tuple[list, int]:
        """The ALLOCs of a turn (``asks``: (keys, sizes, parents, token, connection), validated, of namespace
        ``ns``), in one table pass where ``TableDirectory.alloc_placed_many`` takes them, else one after the other:
        (each one's answer, a coroutine for it or its error; the table passes made)."""
        svc = self.svc
        n = sum(len(a[0]) for a in asks)
        base = svc.gens.take_nowait(n) if len(asks) > 1 and svc.settled.is_set() else None
        got = None
        if base is not None:
            self._placeable()
            got = svc.dir.alloc_placed_many(ns, asks, base, time.monotonic())
        out: list = []
        if got is None:  # one after the other, as alone (with the generations taken, when they were)
            for k, s, p, tok, c in asks:
                try:
                    out.append(self._alloc(ns, k, s, p, tok, c) if base is None else
                               self._when_durable(self._alloc_now(ns, k, s, p, base, tok, c), svc.term))
                except Exception as e:  # noqa: BLE001 - that ALLOC's answer
                    out.append(e)
                if base is not None:
                    base += len(k)
            return out, len(asks)
        placed, fx = got
        svc._apply(fx)
        for (k, _, _, _, c), p in zip(asks, placed):
            try:
                out.append(self._when_durable(self._answer(ns, k, p, base, c), svc.term))
            except Exception as e:  # noqa: BLE001 - that ALLOC's answer
                out.append(e)
            base += len(k)
        return out, 1

    def _placeable(self) -> None:
        """Unavailable right after a takeover, before any node has re-registered (and acked its floor): not a full
        pool, ask again shortly."""
        svc = self.svc
        if not any(sp.placeable for sp in svc.dir.spaces.values()) and any(
                n.provisional or not n.floor_acked for n in svc.members.nodes.values()):
            raise Unavailable("metaserver", "no node has re-registered since the takeover yet", Status.UNAVAILABLE)

    def _when_durable(self, ans: dict, term: int):
        """``ans``, or a coroutine answering it once every removal queued before it (a commit record rewritten
        without evicted or removed pages) is durable: its places may lie in their extents, and a crash before that
        would load the old pages over the new bytes (docs/design/persistence-and-fencing.md, "Reusing an extent").
        Nothing waits when every removal is durable already. Bounded by half ``pending_ttl_s`` (then UNAVAILABLE:
        the client retries under its token and gets the same places back)."""
        fut = self.svc.writer.removals_durable()
        return ans if fut is None else self._answer_durable(fut, ans, term)

    async def _answer_durable(self, fut: asyncio.Future, ans: dict, term: int) -> dict:
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.svc.cfg.pending_ttl_s / 2):
                await asyncio.shield(fut)  # shared by every ALLOC waiting for the same removals
        except asyncio.TimeoutError:
            raise Unavailable("metaserver", "the removal of the pages that held this space is not durable yet",
                              Status.UNAVAILABLE) from None
        self.svc.check_term(term)
        self.alloc_waited_s += time.perf_counter() - t0
        return ans

    def _alloc_now(self, ns, keys, sizes, parents, base, token, conn, shard=None) -> dict:
        svc = self.svc
        self._placeable()
        p = svc.dir.alloc_placed(ns, keys, sizes, parents, base, time.monotonic(), token, conn, shard)
        svc._apply(p.fx)
        return self._answer(ns, keys, p, base, conn)

    def _answer(self, ns, keys, p, base: int, conn) -> dict:
        """The ALLOC answer of placement ``p`` (generations from ``base``): the quota refusal, the write deadline,
        tags and capabilities (``grants.grant_alloc``), the connection's PENDING handles."""
        svc = self.svc
        d = svc.dir
        if d.quotas and (p.state == OVER_QUOTA).any():
            refuse_over_quota(d, ns, keys, p.items())
        deadline_ms = int((time.time() + svc.cfg.write_cap_ttl_s) * 1000)
        if svc.tokens.closed and len(p.new):  # a retried ALLOC's allocations (generations below this request's)
            oldest = int(p.gens.min())  # keep their deadline
            if oldest < base:
                deadline_ms = min(deadline_ms, self._retry_deadline_ms(oldest))
        # the answer as packed rows from wire VERSION 12, as the items list for VERSION 11
        ans = grant_alloc(svc.tokens, svc.members.get, ns, keys, p, deadline_ms, conn.version >= 12)
        if len(p.new):  # aborted if this connection goes away before COMMIT
            conn.pending.update(d.pending_of(ns, keys, p))
            ans["write_until_ms"] = deadline_ms or 1  # every write of its places lands by then (node, shm check it)
        return ans

    def _retry_deadline_ms(self, gen: int) -> int:
        """The capability deadline for an allocation a retried ALLOC gets back (same token, still PENDING): the
        deadline its first answer carried at the latest, never a fresh one. The quarantine judges whether a freed
        extent may still be written by its generation's age (``Quarantine.free``); a capability renewed past
        ``issued + write_cap_ttl_s`` would outlive that judgement, and an ABORT would hand its extent to another
        writer while it can still write there. An allocation older than every sample is answered with a
        capability already expired (the node refuses it: the writer allocates again under a new token)."""
        issued = self.svc.dir.quarantine.issued_after(gen)
        if issued is None:
            return 0
        return int((time.time() - (time.monotonic() - issued) + self.svc.cfg.write_cap_ttl_s) * 1000)

    async def _alloc_later(self, ns, keys, sizes, parents, term: int, token, conn, shard=None) -> dict:
        svc = self.svc
        if not svc.settled.is_set():
            # Just took over: let the nodes re-register first (bounded by ALLOC_HOLD_S via tick).
            try:
                async with asyncio.timeout(ALLOC_HOLD_S + 1.0):  # not wait_for: it can lose a cancel on 3.11
                    await svc.settled.wait()
            except asyncio.TimeoutError:
                pass
            svc.check_term(term)
        base = await svc.gens.take(len(keys))
        svc.check_term(term)
        ans = self._when_durable(self._alloc_now(ns, keys, sizes, parents, base, token, conn, shard), term)
        return ans if type(ans) is dict else await ans

    def _settle_request(self, meta: Any, conn, allowed: frozenset = _NS_KEYS_GENS
                        ) -> tuple[str, list, list, list | None]:
        """The shared opening of COMMIT and ABORT: validate (ns, keys, gens), check write rights, and take the keys
        out of this connection's pending handles (they are settled by this request, whatever its outcome); the
        rows the handles named (-1: not this connection's), None when it held none."""
        m = v.fields(meta, allowed, ("ns", "keys", "gens"))
        ns = v.ns(m)
        conn.auth.scope.check(ns, True, "metaserver")
        keys = v.keys(m, self.svc.max_keys)
        gens = v.ints(m, "gens", len(keys), 0, (1 << 63) - 1)
        rows = self.svc.dir.settle_handles(conn.pending, ns, keys, gens) if conn.pending else None
        return ns, keys, gens, rows

    def commit(self, meta: Any, conn):
        ns, keys, gens, rows = self._settle_request(meta, conn, _COMMIT)
        shard = v.shard(meta)
        svc = self.svc
        ok, fx = svc.dir.commit(ns, keys, gens, time.monotonic(), shard, rows)
        fut = svc._apply(fx, wait=svc.cfg.commit == "durable")  # async: acknowledged before etcd (config.py)
        if fut is None:
            return {"ok": ok}
        return self._commit_wait(fut, ok, svc.metrics.etcd_commit, time.perf_counter())

    @staticmethod
    async def _commit_wait(fut: asyncio.Future, ok: list, latency, t0: float) -> dict:
        """``t0``: when the pages were handed to the writer (a multi-slot COMMIT awaits its parts' waits in turn,
        each may start after its pages are durable: multislot.py)."""
        await fut  # durable in etcd before the reply; Unavailable propagates as an error answer
        latency.observe(time.perf_counter() - t0)
        return {"ok": ok}

    def abort(self, meta: Any, conn) -> dict:
        """Give up open allocations. ``"written": true``: the writer tried to write them (its write failed), so a
        late write may still land: their extents stay out of placement for the quarantine's ``keep_s``
        (``Quarantine.keeping``); the keys are free at once either way."""
        ns, keys, gens, _ = self._settle_request(meta, conn, _ABORT)
        d = self.svc.dir
        with d.quarantine.keeping() if v.boolean(meta, "written") else contextlib.nullcontext():
            return {"aborted": d.abort(ns, keys, gens)}

    def lookup(self, meta: Any, conn, defer: bool = True) -> Any:
        """LOOKUP on this slot (a ``"release"`` of earlier leases it carries is taken out and released first by the
        process: ``metaserver/ha/partition.py`` ``Partition._lookup_releasing``): the answer, or (``defer``, for a
        connection that waits: the server's) a ``Later`` answered with the turn's other LOOKUPs
        (``metaserver/handlers/turns.py``)."""
        m = v.fields(meta, _LOOKUP, ("ns", "keys"))
        ns = v.ns(m)
        conn.auth.scope.check(ns, False, "metaserver")
        svc = self.svc
        keys = v.keys(m, svc.max_keys)
        shard = v.shard(m)
        if defer and shard is None and getattr(conn, "in_turns", False):
            return svc.lookups.ask(ns, keys, conn)
        if getattr(svc, "lookups", None) is not None:
            svc.lookups.free_now()  # (answered now: after the releases read before it)
        # tags and capabilities from the columns; packed rows from wire VERSION 12
        ans = svc.dir.lookup_granted(ns, keys, time.monotonic(), conn, svc.tokens, svc.members.get, shard,
                                     conn.version >= 12)
        if ans["lease"]:
            own_lease(svc.dir, conn, ans["lease"])
            # how long the lease pins the hits: a client counts a tcp/rdma read that finished later as a miss
            ans["lease_ms"] = svc.lease_ms
        return ans

    def exists(self, meta: Any, conn) -> dict:
        m = v.fields(meta, _NS_KEYS, ("ns", "keys"))
        ns = v.ns(m)
        conn.auth.scope.check(ns, False, "metaserver")
        return {"exists": self.svc.dir.exists(ns, v.keys(m, self.svc.max_keys))}

    def prefix(self, meta: Any, conn) -> dict:
        m = v.fields(meta, _NS_KEYS, ("ns", "keys"))
        ns = v.ns(m)
        conn.auth.scope.check(ns, False, "metaserver")
        return {"hits": queries.prefix(self.svc.dir, ns, v.keys(m, self.svc.max_keys))}

    def remove(self, meta: Any, conn) -> dict:
        m = v.fields(meta, _NS_KEYS, ("ns", "keys"))
        ns = v.ns(m)
        conn.auth.scope.check(ns, True, "metaserver")
        removed, fx = self.svc.dir.remove(ns, v.keys(m, self.svc.max_keys))
        self.svc._apply(fx)
        return {"removed": removed}

