"""Read leases given back inside the next LOOKUP (issue 45): ``ReleasingMeta``, the client's metaserver layer.

A get's read lease used to go back in a RELEASE frame of its own right after the batch: on the 2-core VM one
loopback ``sendmsg`` (about 120 us of the client's CPU, the metaserver woken once more) of a 16 KiB x64 shm batch's
560 us. Here the ``RELEASE`` that ``Client._get``, ``umbp.readbatch.get_into`` and ``mapped`` send is queued
instead, and the ids ride in the next LOOKUP's meta (``"release": [ids]``): the metaserver releases them before it
answers (``metaserver/handlers/dataplane.py``), so a steady stream of gets costs one frame a batch.

Negotiation: a metaserver that knows the field says so in every LOOKUP answer (``"released"``: how many of the ids
it released, 0 when none were sent); the HELLO carries only the wire version, which the field does not change.
Leases are queued only while the last LOOKUP answer said so. In a partitioned pool a lease is ``umbp/slotrouter.py``'s
handle over several processes' leases: the router gives each process its ids inside its own part of the next LOOKUP
where that process's last answer said ``"release_any"`` (it releases any of its slots' and merged LOOKUPs' leases
there: ``metaserver/ha/partition.py``), the others' in a RELEASE frame each, and answers ``"released"`` only while
every process it asked said so. A metaserver that refuses the field all the same (a failover to an older one
between two LOOKUPs) answers BAD_REQUEST "unknown field 'release'": the LOOKUP is made again without it, the ids go
in a RELEASE frame and queueing stops until an answer says it again (the router sends again in frames the ids it
had put inside a LOOKUP that failed).

Only a get that follows another within ``MAX_AGE_S`` queues its lease: a lone get (the first after a pause) sends
its RELEASE at once, as before, so a get, then another client's EVICT, finds the page unleased; a stream of gets
sends none. Bounds, so a lease never lingers: the queue is sent as one RELEASE frame (``"leases"``) before any other
request (an ALLOC that may need to evict, STATS, EXISTS, admin: every request after a get sees its lease released,
as before), by a timer thread once its oldest id is ``MAX_AGE_S`` old (a client that stops reading), and at ``close``;
a connection that drops releases its leases at the metaserver anyway (``metaserver/handlers/ownership.py``).

Costs a batch: a list swap under a lock and one dict copy of the LOOKUP meta; the timer wakes about once a
``MAX_AGE_S`` while gets go on, and waits without a bound once none came for that long.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from transport.wire import Op
from umbp.errors import BadRequest

MAX_AGE_S = 0.05  # a queued lease id goes out by then at the latest (in its own RELEASE frame)
MAX_IDS = 4096  # ids a RELEASE frame or a LOOKUP carries (``ownership.MAX_RELEASE``)
SEND_S = 2.0  # the deadline of a RELEASE frame the timer or ``close`` sends


_OWN = frozenset({"inner", "capable", "piggybacked", "framed", "_ids", "_since", "_added", "_cv", "_timer", "_idle",
                  "_closed"})


class ReleasingMeta:
    """``MetaRouter``'s interface (``call``, ``submit``/``result``/``forget``, ``send_noreply``, ``close``, ...)
    over ``inner``, with RELEASEs of read leases carried in the next LOOKUP (module docstring)."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.capable = False  # the last LOOKUP answer said it takes "release" (a partitioned pool: every process)
        self.piggybacked = 0  # lease ids sent inside a LOOKUP (tests, stats)
        self.framed = 0  # lease ids sent in RELEASE frames
        self._ids: list[int] = []
        self._since = 0.0  # when the oldest queued id was queued
        self._added = float("-inf")  # when the last lease came (queued or sent alone)
        self._cv = threading.Condition(threading.Lock())
        self._timer: threading.Thread | None = None
        self._idle = False  # the timer waits without a bound (for an id to be queued)
        self._closed = False

    def __getattr__(self, name: str) -> Any:  # sent, address, slots, seed, ...
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        """This layer's own state and methods (a test's counting ``call``) here; the rest is the router's
        (``map``)."""
        if name in _OWN or hasattr(type(self), name):
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    # -- requests ----------------------------------------------------------------------------------------------
    def _with_ids(self, op: int, meta: Any, deadline: float) -> Any:
        """The meta to send for ``op``: a LOOKUP takes the queued ids; any other request sends them first."""
        if not self._ids:
            return meta
        with self._cv:
            ids, self._ids = self._ids[:MAX_IDS], self._ids[MAX_IDS:]
        if not ids:
            return meta
        if op == Op.LOOKUP and self.capable and type(meta) is dict:
            self.piggybacked += len(ids)
            return {**meta, "release": ids}
        self._frame(ids, deadline)
        return meta

    def call(self, op: int, meta: Any, deadline: float) -> Any:
        meta = self._with_ids(op, meta, deadline)
        if op != Op.LOOKUP:
            return self.inner.call(op, meta, deadline)
        try:
            return self._learn(self.inner.call(op, meta, deadline))
        except BadRequest as e:
            return self._refused(e, meta, deadline)

    def submit(self, op: int, meta: Any, deadline: float) -> Any:
        return self.inner.submit(op, self._with_ids(op, meta, deadline), deadline)

    def result(self, t: Any, deadline: float) -> Any:
        if t.op != Op.LOOKUP:
            return self.inner.result(t, deadline)
        try:
            return self._learn(self.inner.result(t, deadline))
        except BadRequest as e:
            return self._refused(e, t.meta, deadline)

    def forget(self, tickets) -> None:
        self.inner.forget(tickets)

    def _learn(self, answer: Any) -> Any:
        self.capable = "released" in answer and (getattr(self.inner, "slots", 1) <= 1
                                                 or answer.get("release_any") is True)
        return answer

    def _refused(self, e: BadRequest, meta: Any, deadline: float) -> Any:
        """A LOOKUP refused: when for its "release" field (a metaserver without it), made again without."""
        ids = meta.get("release") if type(meta) is dict else None
        if ids is None or "'release'" not in str(e):
            raise e
        self.capable = False
        self._frame(ids, deadline)
        return self._learn(self.inner.call(Op.LOOKUP, {k: x for k, x in meta.items() if k != "release"}, deadline))

    # -- leases ------------------------------------------------------------------------------------------------
    def send_noreply(self, op: int, meta: Any, deadline: float) -> None:
        lease = meta.get("lease") if op == Op.RELEASE and type(meta) is dict and len(meta) == 1 else None
        if not lease or not self.capable or self._closed:
            self.inner.send_noreply(op, meta, deadline)
            return
        now = time.monotonic()
        if now - self._added >= MAX_AGE_S:  # a lone get (none queued a lease lately): its lease goes back now
            self._added = now
            self.framed += 1
            self.inner.send_noreply(op, meta, deadline)
            return
        with self._cv:
            self._added = now
            if not self._ids:
                self._since = self._added
            self._ids.append(lease)
            if self._timer is None:
                self._timer = threading.Thread(target=self._run, name="umbp-release", daemon=True)
                self._timer.start()
            elif self._idle:
                self._idle = False
                self._cv.notify()  # only a timer waiting without a bound (nothing was queued): no wake a batch

    def _frame(self, ids: list[int], deadline: float) -> None:
        self.framed += len(ids)
        for lo in range(0, len(ids), MAX_IDS):
            self.inner.send_noreply(Op.RELEASE, {"leases": ids[lo:lo + MAX_IDS]}, deadline)

    def flush(self) -> None:
        """Send the queued ids now, in one RELEASE frame."""
        with self._cv:
            ids, self._ids = self._ids, []
        if ids:
            self._frame(ids, time.monotonic() + SEND_S)

    def _run(self) -> None:
        """The timer: sends the queue once its oldest id is MAX_AGE_S old (a LOOKUP usually takes it first)."""
        cv = self._cv
        while True:
            with cv:
                while not self._closed:
                    now = time.monotonic()
                    # while ids come (a LOOKUP usually takes them before the timer runs), wake once an age: a timer
                    # that went idle whenever it found the queue empty would be woken by every batch
                    until = self._since + MAX_AGE_S if self._ids else self._added + MAX_AGE_S
                    if self._ids and now >= until:
                        break
                    self._idle = now >= until
                    cv.wait(None if self._idle else until - now)
                self._idle = False
                if self._closed:
                    return
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - send_noreply never raises on transport failure; the lease expires
                pass

    def close(self) -> None:
        with self._cv:
            closed, self._closed = self._closed, True
            self._cv.notify()
        if not closed:
            try:
                self.flush()
            finally:
                self.inner.close()
