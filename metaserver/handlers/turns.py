"""A turn's LOOKUPs, and a turn's ALLOCs, answered together: the requests of one kind a slot server receives in one
turn of the event loop (from any connections) go through one table pass, each still answered as alone: its own
lease or allocations, its own capabilities, its own answer, its own errors.

- LOOKUPs (``LookupTurn``), with the parts for this slot of a partitioned pool's merged LOOKUPs
  (``metaserver/ha/multislot.py``): one ``TableDirectory.lookup_columns_many`` (one key digest and index pass, one
  stamp, pin, tag and capability-slot pass), each exactly as alone.
- RELEASEs (``LookupTurn.free``): the read leases a turn's RELEASEs and LOOKUPs' ``release`` give back leave their
  connections when read (counted, as a RELEASE answers) and are unpinned at the turn's end, before its LOOKUPs, in
  one ``PageTable.release_many`` (a lease each cost about 8 us of numpy calls; a merged LOOKUP's process lease gives
  back a slice a slot it touched, ``free_slice``: the turn's parts of a slot shared one lease in slices).
- ALLOCs (``AllocTurn``): one ``TableDirectory.alloc_placed_many`` (one digest, index, placement, eviction and filing
  pass), the keys placed as one ALLOC of them all would place them, each PENDING row its own ALLOC's; where one
  pass would not answer each as alone (a key of two, a PENDING key, quotas: ``place.alloc_rows_many``), they are
  answered one after the other, as before.

Why: their cost is mostly per request, not per key (a LOOKUP on the 16-core host about 100 us a request against 0.6
us a key: docs/benchmarks/slots.md; in-process on the 2-core VM, 8 ALLOCs of 128 keys into a full pool cost 491-513
us each alone, 235-246 in one pass), and a busy metaserver reads several requests in each turn.

Order: a request is validated and its rights checked when it is read (a bad one is answered at once), then waits in
its server's turn for the end of the turn (``loop.call_soon``). A request read meanwhile that does not commute with
the waiting ones runs them first (``flush_due``, from ``metaserver/server.py``), so the process applies requests as
if in the order it read them:
- with LOOKUPs, ``LOOKUP_COMMUTING``: LOOKUP (each pins what it finds; none changes what another finds), RELEASE (of
  a lease its client was answered already: never one of a waiting LOOKUP; unpinning and pinning are counts), EXISTS
  and PREFIX (they read states, which a LOOKUP does not change), PING;
- with ALLOCs: ALLOC, PING, and the COMMITs and ABORTs of connections with no ALLOC waiting. Requests of different
  connections read in one turn are concurrent: a COMMIT or ABORT settles its own connection's allocations only, so
  answering it before another connection's ALLOC is an order the two could have come in. A connection's own
  requests keep their order.
A connection closed before its turn's pass gets nothing (no lease, no allocation) and no answer. Answers go out
through the connection's queued writes, as any answer; an answer that waits (an ALLOC whose places wait for a
removal to be durable) is given when it is ready.

Only connections that say so wait (``in_turns``: the server's connections and their slot views); the rest, and a
rank's LOOKUP or ALLOC of a shared entry (``shard``), are answered at once. A multi-slot ALLOC's parts each wait in
their slot's turn, and the request is answered when the last is (``metaserver/ha/multislot.py``).

Costs: a turn of each kind per slot server, a list entry and a ``Later`` a request; the passes are the table's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

from metaserver.handlers.ownership import own_lease
from metaserver.table.leases import SLICED
from transport.wire import Op, Status
from umbp.errors import Unavailable

log = logging.getLogger("umbp.metaserver")

LOOKUP_COMMUTING = frozenset({Op.LOOKUP, Op.RELEASE, Op.EXISTS, Op.PREFIX, Op.PING})  # no flush of waiting LOOKUPs
_SETTLING = (Op.COMMIT, Op.ABORT)


class Later:
    """A request's answer, given at the end of its turn: ``then(answer, None)`` or ``then(None, error)``, set by the
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


class _Turn:
    """The requests of one kind of slot server ``svc`` waiting for the end of this turn; ``due``: the process's set of
    turns that have some (``flush_due``); ``asked`` and ``passes``: requests answered in turns and their table
    passes (STATS, metrics)."""

    __slots__ = ("svc", "due", "asks", "asked", "passes")
    kind = ""

    def __init__(self, svc, due: set) -> None:
        self.svc = svc
        self.due = due
        self.asks: list[tuple] = []
        self.asked = self.passes = 0

    def _add(self, ask: tuple) -> None:
        if not self.asks:
            self._due()
        self.asks.append(ask)

    def _due(self) -> None:
        """Flush at the end of this turn, or before a request that does not commute (``flush_due``), once."""
        if self not in self.due:
            self.due.add(self)
            asyncio.get_running_loop().call_soon(self.flush)

    def _take(self) -> dict[str, list]:
        """The waiting requests of open connections, by namespace, in order. A request is a tuple: (namespace, keys,
        connection, its ``Later`` or None, a merged LOOKUP's part callback or None, ...)."""
        asks, self.asks = self.asks, []
        self.due.discard(self)
        by_ns: dict[str, list] = {}
        for a in asks:
            if not a[2].closed:
                by_ns.setdefault(a[0], []).append(a)
        return by_ns

    def flush(self) -> None:
        for ns, group in self._take().items():
            if not self.svc.serving:  # deposed within the turn: the client asks again and learns the leader
                _fail(group, Unavailable("metaserver", "this slot stopped serving; ask again", Status.UNAVAILABLE))
                continue
            self.asked += len(group)
            try:
                self._pass(ns, group)
            except Exception as e:  # noqa: BLE001 - every request of the group is answered, with the error
                log.exception("metaserver: a turn's %ss of %r failed", self.kind, ns)
                _fail(group, e)

    def _pass(self, ns: str, group: list) -> None:
        raise NotImplementedError

    def commutes(self, op: int, conn) -> bool:
        raise NotImplementedError


class LookupTurn(_Turn):
    """The LOOKUPs (``ask``) and merged LOOKUPs' parts (``ask_part``) of one slot server, and the read leases its
    RELEASEs (and LOOKUPs' ``release``) gave back (``free``)."""

    __slots__ = ("frees", "slices", "free_dir")
    kind = "LOOKUP"

    def __init__(self, svc, due: set) -> None:
        super().__init__(svc, due)
        self.frees: list[tuple[int, None]] = []  # leases taken from their owners in this turn: (lease, no owner)
        self.slices: list[tuple[int, int]] = []  # merged LOOKUPs' parts given back: (lease in slices, slice)
        self.free_dir = None  # the directory they are of

    def free(self, d, lease: int) -> None:
        """Unpin ``lease`` of directory ``d``, taken from its owner (``PageTable.disown``), at the end of the turn
        with the turn's other releases, before its LOOKUPs: one ``release_many`` (about 8 us of numpy calls a
        lease alone, 1.5 in eights: 2-core VM). A RELEASE commutes with LOOKUPs (pins are counts); a request that
        does not flushes the turn first (``flush_due``), so it sees the lease released, as in the order read."""
        self._freeing(d)
        self.frees.append((lease, None))

    def free_slice(self, d, lease: int, j: int) -> None:
        """``free`` for slice ``j`` of lease ``lease`` of ``d`` (a merged LOOKUP's part, given back by its request's
        release: ``metaserver/ha/multislot.py``)."""
        self._freeing(d)
        self.slices.append((lease, j))

    def _freeing(self, d) -> None:
        if (self.frees or self.slices) and d is not self.free_dir:  # (a new term's directory: the old one's first)
            self._free()
        if not (self.frees or self.slices):
            self._due()
        self.free_dir = d

    def free_now(self) -> None:
        """Unpin the turn's releases now: a LOOKUP answered outside the turn (a rank's shard LOOKUP, a multi-slot
        LOOKUP not merged) comes after the releases read before it, as in the order read (its stamps after theirs)."""
        if self.frees or self.slices:
            self._free()

    def _free(self) -> None:
        frees, self.frees = self.frees, []
        slices, self.slices = self.slices, []
        d, self.free_dir = self.free_dir, None
        if frees or slices:
            try:
                d.release_many(frees, slices)
            except Exception:  # noqa: BLE001 - the turn's LOOKUPs are answered all the same
                # a bug: the leases it took are no more, so their rows stay pinned (never evicted) for this term
                log.exception("metaserver: a turn's releases failed")

    def flush(self) -> None:
        self._free()
        super().flush()

    def ask(self, ns: str, keys, conn) -> Later:
        """A LOOKUP answered at the end of the turn (``Later``)."""
        later = Later()
        self._add((ns, keys, conn, later, None))
        return later

    def ask_part(self, ns: str, keys, conn, part) -> None:
        """A merged LOOKUP's part for this slot, from ``conn``: ``part(columns)`` at the end of the turn with its
        ``lookup_columns`` (``(lease, j)``: a slice of the lease the turn's parts share), or ``part(error)``."""
        self._add((ns, keys, conn, None, part))

    def commutes(self, op: int, conn) -> bool:
        return op in LOOKUP_COMMUTING

    def _pass(self, ns: str, group: list) -> None:
        """One ``lookup_columns_many`` for the namespace's LOOKUPs and parts, in the order they came."""
        svc = self.svc
        d = svc.dir
        self.passes += 1
        got = d.lookup_columns_many(ns, [(k, c if p is None else SLICED) for _, k, c, _, p in group],
                                    time.monotonic(), svc.tokens)
        for (_, _, conn, later, part), cols in zip(group, got):
            try:
                if part is not None:
                    part(cols)  # a merged LOOKUP's part: its slice is its request's
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


class AllocTurn(_Turn):
    """The ALLOCs of one slot server (``ask``), answered by its data plane (``DataPlane.alloc_many``)."""

    __slots__ = ("conns",)
    kind = "ALLOC"

    def __init__(self, svc, due: set) -> None:
        super().__init__(svc, due)
        self.conns: set[int] = set()  # the server connections with an ALLOC waiting (ids)

    def ask(self, ns: str, keys, conn, sizes: list, parents: list | None, token: int | None) -> Later:
        """An ALLOC (validated, its rights checked) answered at the end of the turn (``Later``)."""
        later = Later()
        self.conns.add(id(getattr(conn, "conn", conn)))  # (a slot view's server connection)
        self._add((ns, keys, conn, later, None, sizes, parents, token))
        return later

    def commutes(self, op: int, conn) -> bool:
        return op == Op.ALLOC or op == Op.PING or (op in _SETTLING and id(conn) not in self.conns)

    def flush(self) -> None:
        self.conns.clear()
        super().flush()

    def _pass(self, ns: str, group: list) -> None:
        """One ``DataPlane.alloc_many`` for the namespace's ALLOCs, in the order they came; each answered with its
        answer, its error, or (waiting for a durable removal) when that is ready."""
        answers, passes = self.svc.dataplane.alloc_many(ns, [(a[1], a[5], a[6], a[7], a[2]) for a in group])
        self.passes += passes
        for a, ans in zip(group, answers):
            later = a[3]
            try:
                if type(ans) is dict:
                    later.done(ans)
                elif isinstance(ans, Exception):
                    _answer_error(later, ans)
                else:  # a coroutine: the answer once the removals before it are durable
                    when_done(ans, functools.partial(_give, later))
            except Exception as e:  # noqa: BLE001 - one answer that cannot be given must not cost the others
                log.exception("metaserver: an ALLOC's answer could not be given")
                _answer_error(later, e)


_TASKS: set = set()  # answers' coroutines running (the loop holds a task only weakly)


def when_done(coro, then) -> None:
    """Run ``coro`` (a request's answer that waits: generations, a durable removal) as a task, then
    ``then(answer, None)`` or ``then(None, error)``; a task cancelled (shutting down) is UNAVAILABLE."""
    def done(task: asyncio.Task) -> None:
        _TASKS.discard(task)
        if task.cancelled():
            then(None, Unavailable("metaserver", "shutting down", Status.UNAVAILABLE))
        elif task.exception() is not None:
            then(None, task.exception())
        else:
            then(task.result(), None)

    task = asyncio.get_running_loop().create_task(coro)
    _TASKS.add(task)
    task.add_done_callback(done)


def _give(later: Later, ans: dict | None, err: BaseException | None) -> None:
    if err is None:
        later.done(ans)
    else:
        _answer_error(later, err)


def _answer_error(later: Later, e: BaseException) -> None:
    """Answer with the error, as for a handler that raised; one that cannot even be sent is logged."""
    try:
        later.fail(e)
    except Exception:  # noqa: BLE001 - the others of the turn are answered all the same
        log.exception("metaserver: an error answer could not be sent")


def _fail(group: list, e: Exception) -> None:
    for a in group:
        later, part = a[3], a[4]
        if part is not None:
            part(e)
        else:
            _answer_error(later, e)


def release_turn(svc, conn) -> LookupTurn | None:
    """The turn that unpins the leases a RELEASE of ``conn`` gives back to slot server ``svc`` (``LookupTurn.free``):
    its LOOKUP turn for a connection that waits in turns (``in_turns``), None (at once) for the rest."""
    return getattr(svc, "lookups", None) if getattr(conn, "in_turns", False) else None


def flush_due(due: set, op: int, conn) -> None:
    """Run the waiting requests of every turn that ``op`` from ``conn`` (a server connection) does not commute with
    (module docstring), so the process keeps the order it read them in."""
    for turn in list(due):
        if not turn.commutes(op, conn):
            turn.flush()
