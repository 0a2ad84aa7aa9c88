"""A turn's LOOKUPs answered together: the LOOKUPs a slot server receives in one turn of the event loop (from any
connections), and the parts for it of a partitioned pool's merged LOOKUPs (``metaserver/ha/multislot.py``), go
through one table pass (``TableDirectory.lookup_columns_many``: one key digest and index pass, one stamp, pin, tag
and capability-slot pass), each still answered as alone: its own lease over its own hits, its own capabilities,
its own answer, its own errors.

Why: a LOOKUP's cost is mostly per request, not per key (on the 16-core host about 100 us a request against 0.6 us a
key: docs/benchmarks/slots.md), and a busy metaserver reads several requests in each turn. The table pass is most of
that per-request cost; shared by 4-8 requests of 128 keys it cost 29-42 % less a request (in-process, 2-core VM).

Order: a connection's LOOKUP (``DataPlane.lookup``) validates and checks rights at once (a bad one is answered at
once), then waits in its server's ``LookupTurn`` for the end of the turn (``loop.call_soon``). A request that does
not commute with a LOOKUP, read meanwhile, first runs every waiting LOOKUP (``flush_due``, from
``metaserver/server.py``), so the process applies requests as if in the order it read them. ``COMMUTING``: LOOKUP
(each pins what it finds; none changes what another finds), RELEASE (of a lease its client was answered already:
never one of a waiting LOOKUP; unpinning and pinning are counts), EXISTS and PREFIX (they read states, which a
LOOKUP does not change), PING. A connection closed before its turn's pass gets no lease and no answer. Answers go out
through the connection's queued writes, as any answer.

Only connections that say so wait (``defer_lookups``: the server's connections and their slot views); the rest, and
a rank's LOOKUP of a shared entry (``shard``), are answered at once by the same table call with one request.

Costs: a LookupTurn per slot server, a list entry and a ``Later`` a LOOKUP; the pass is ``lookup_columns_many``'s.
"""

from __future__ import annotations

import asyncio
import logging
import time

from metaserver.handlers.ownership import own_lease
from transport.wire import Op, Status
from umbp.errors import Unavailable

log = logging.getLogger("umbp.metaserver")

COMMUTING = frozenset({Op.LOOKUP, Op.RELEASE, Op.EXISTS, Op.PREFIX, Op.PING})  # no flush of a turn's LOOKUPs


class Later:
    """A LOOKUP's answer, given at the end of its turn: ``then(answer, None)`` or ``then(None, error)``, set by the
    server when the handler returns it; ``extra`` fields go into the answer (the process's release counts)."""

    __slots__ = ("then", "extra")

    def __init__(self) -> None:
        self.then = None
        self.extra: dict | None = None

    def done(self, ans: dict) -> None:
        if self.extra:
            ans.update(self.extra)
        if self.then is not None:
            self.then(ans, None)

    def fail(self, e: Exception) -> None:
        if self.then is not None:
            self.then(None, e)


class LookupTurn:
    """The LOOKUPs of one slot server ``svc`` waiting for the end of this turn; ``due``: the process's set of turns
    that have some (``flush_due``)."""

    __slots__ = ("svc", "due", "asks", "asked", "passes")

    def __init__(self, svc, due: set) -> None:
        self.svc = svc
        self.due = due
        self.asks: list[tuple] = []  # (ns, keys, connection, Later | None, part callback | None)
        self.asked = self.passes = 0  # LOOKUPs (and parts) answered in turns, and their table passes (STATS turn_*)

    def ask(self, ns: str, keys, conn) -> Later:
        """A LOOKUP answered at the end of the turn (``Later``)."""
        later = Later()
        self._add((ns, keys, conn, later, None))
        return later

    def ask_part(self, ns: str, keys, conn, part) -> None:
        """A merged LOOKUP's part for this slot: ``part(columns)`` at the end of the turn with its
        ``lookup_columns`` (its lease its own), or ``part(error)``."""
        self._add((ns, keys, conn, None, part))

    def _add(self, ask: tuple) -> None:
        if not self.asks:
            self.due.add(self)
            asyncio.get_running_loop().call_soon(self.flush)
        self.asks.append(ask)

    def flush(self) -> None:
        """Answer every waiting LOOKUP and part: one ``lookup_columns_many`` a namespace, in the order they came."""
        asks, self.asks = self.asks, []
        self.due.discard(self)
        if not asks:
            return
        svc = self.svc
        by_ns: dict[str, list] = {}
        for a in asks:
            if not a[2].closed:
                by_ns.setdefault(a[0], []).append(a)
        now = time.monotonic()
        for ns, group in by_ns.items():
            if not svc.serving:  # deposed within the turn: the client asks again and learns the leader
                _fail(group, Unavailable("metaserver", "this slot stopped serving; ask again", Status.UNAVAILABLE))
                continue
            d = svc.dir
            self.asked += len(group)
            self.passes += 1
            try:
                got = d.lookup_columns_many(ns, [(k, c) for _, k, c, _, _ in group], now, svc.tokens)
            except Exception as e:  # noqa: BLE001 - every LOOKUP of the group is answered, with the error
                log.exception("metaserver: a turn's LOOKUPs of %r failed", ns)
                _fail(group, e)
                continue
            for (_, _, conn, later, part), cols in zip(group, got):
                try:
                    if part is not None:
                        part(cols)  # a merged LOOKUP's part: its lease is taken by its request
                        continue
                    ans = d.granted_answer(cols, svc.members.get, conn.version >= 12)
                    if ans["lease"]:
                        own_lease(d, conn, ans["lease"])
                        ans["lease_ms"] = svc.lease_ms
                    later.done(ans)
                except Exception as e:  # noqa: BLE001 - one answer that cannot be made must not cost the others
                    log.exception("metaserver: a LOOKUP's answer could not be made")
                    if later is not None:
                        _answer_error(later, e)


def _answer_error(later: Later, e: Exception) -> None:
    """Answer with the error, as for a handler that raised; one that cannot even be sent is logged."""
    try:
        later.fail(e)
    except Exception:  # noqa: BLE001 - the others of the turn are answered all the same
        log.exception("metaserver: a LOOKUP's error answer could not be sent")


def _fail(group: list, e: Exception) -> None:
    for _, _, _, later, part in group:
        if part is not None:
            part(e)
        else:
            later.fail(e)


def flush_due(due: set) -> None:
    """Run every turn's waiting LOOKUPs now (a request of another kind is next: the process keeps its order)."""
    for turn in list(due):
        turn.flush()
