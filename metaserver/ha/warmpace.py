"""What a warm copy (``metaserver/ha/standby.py``) has received from its etcd watch and not applied yet (``Backlog``),
and the pace it is applied at while the process serves (``drain``).

Why: in a partitioned pool a process serves slots of its own while it keeps copies of others'. A watch batch (one etcd
transaction: up to 1,024 commit records, hundreds of thousands of pages) applied in one step would hold the serving
loop (1,024 records of 128 pages: 0.3-0.7 s of the 2-core VM's CPU).

How: the watch only queues what it receives (``Backlog.add``). ``Pace.drain`` applies it in pieces of about
PIECE_BYTES of records (``Backlog.take``: consecutive batches merged, a large one split) for slices of about SLICE_S;
after a slice in which the event loop was found serving (two yields to it took longer than BUSY_LAG_S: asyncio runs a
task's next step ahead of the same iteration's I/O callbacks, uvloop runs it after them) the next slice waits until
the copy has used at most DEFER_SHARE of the time. The pace is dropped, and the backlog applied at full speed, while
the loop is idle, when the backlog holds more than LAG_MAX_BYTES of records, and once ``Pace.hurried`` is set (a
takeover waits: ``WarmDirectory.catch_up``).

What it does not do: remove work. A process committing at its limit for longer than the bound runs its copies at full
speed again; a takeover applies what is behind first (at most about LAG_MAX_BYTES). A standby process that serves
nothing never finds its loop busy and applies everything as it arrives.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Callable

DEFER_SHARE = 0.2  # while the process serves, its warm copies apply watch events at most this share of the time
LAG_MAX_BYTES = 4 << 20  # records received and not applied at most (about 40k pages, 0.1-0.3 s of applying them)
# before the copy applies at full speed: what a takeover may have to apply on top of today's catch-up
SLICE_S = 0.002  # one slice of applying events before a look at the event loop
BUSY_LAG_S = 0.0005  # a yield to the loop that took longer than this found it serving requests
PIECE_BYTES = 1 << 16  # records applied by one ``apply`` at most (about 650 pages, 1-3 ms of CPU): consecutive
# received batches are merged up to it (longer runs of page puts), larger ones split (no long stall of the loop)


def event_bytes(ev) -> int:
    """Bytes of a received event's record (the work of applying it grows with them); a delete counts 64."""
    return len(ev.kv.value) or 64


def record_bytes(events: list) -> int:
    """``event_bytes`` of received events, summed."""
    return sum(map(event_bytes, events))


class Backlog:
    """Received watch batches not applied yet, in revision order, with their count of events (``lag``) and of
    record bytes (``lag_bytes``)."""

    __slots__ = ("batches", "lag", "lag_bytes")

    def __init__(self):
        self.batches: deque[tuple[list, int]] = deque()  # (events, their record bytes)
        self.lag = 0
        self.lag_bytes = 0

    def __bool__(self) -> bool:
        return bool(self.batches)

    def add(self, events: list) -> None:
        size = record_bytes(events)
        self.batches.append((events, size))
        self.lag += len(events)
        self.lag_bytes += size

    def clear(self) -> None:
        self.batches.clear()
        self.lag = self.lag_bytes = 0

    def take(self) -> list:
        """The next piece of about PIECE_BYTES of records: the next batch, merged with those after it while the sum
        stays under PIECE_BYTES, or its first events when it is larger (the rest stays first in line). Applying a
        sequence of events in pieces makes what applying it whole makes: each event is applied in order."""
        q = self.batches
        events, size = q.popleft()
        if size > PIECE_BYTES and len(events) > 1:
            n = used = 0
            while n < len(events) - 1 and used < PIECE_BYTES:
                used += event_bytes(events[n])
                n += 1
            q.appendleft((events[n:], size - used))
            events, size = events[:n], used
        else:
            while q and size + q[0][1] <= PIECE_BYTES:
                more, extra = q.popleft()
                events = events + more
                size += extra
        self.lag -= len(events)
        self.lag_bytes -= size
        return events

    def continues(self, revision: int) -> bool:
        """Whether the next event waiting is of ``revision`` (a transaction taken only in part so far)."""
        return bool(self.batches) and self.batches[0][0][0].kv.mod_revision == revision


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait until ``event`` is set (True) or ``timeout`` passes (False; None: no bound). A cancel is never lost:
    Python 3.11's ``asyncio.wait_for`` returns the inner result when a cancel arrives as the event is set, and the
    cancelled task runs on. A takeover sets ``Pace.hurried`` and stops the copy in the same step, so the copy's
    ``drain`` ran on and ``WarmDirectory.stop`` (the takeover, the slot's election) waited for it forever (issue 42:
    a slot's key held, never served)."""
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        done, _ = await asyncio.wait({waiter}, timeout=timeout)  # raises CancelledError when cancelled, always
    finally:
        waiter.cancel()
    return bool(done)


class Pace:
    """``drain``'s state: the time the copy rested for a serving loop, and ``hurried`` (set: no more rests)."""

    __slots__ = ("paused_s", "hurried", "more")

    def __init__(self):
        self.paused_s = 0.0
        self.hurried = asyncio.Event()  # a takeover waits: the backlog at full speed from now on
        self.more = asyncio.Event()  # set when a batch is received

    async def drain(self, backlog: Backlog, apply_until: Callable[[float], None]) -> None:
        """Apply ``backlog`` with ``apply_until(deadline)`` in slices of about SLICE_S, resting after a slice in
        which the loop was found serving as the module says. Runs until cancelled."""
        resume_at = 0.0  # when the next slice may start (perf_counter)
        while True:
            if not backlog:
                self.more.clear()
                await self.more.wait()
                continue
            rest = resume_at - time.perf_counter()
            if rest > 0 and not self.hurried.is_set() and backlog.lag_bytes <= LAG_MAX_BYTES:
                self.paused_s += rest
                await wait_event(self.hurried, rest)  # a takeover's catch_up ends the rest
                continue
            t0 = time.perf_counter()
            apply_until(t0 + SLICE_S)
            spent = time.perf_counter() - t0
            await asyncio.sleep(0)  # two yields: see the module's docstring
            await asyncio.sleep(0)
            served = time.perf_counter() - t0 - spent > BUSY_LAG_S
            resume_at = t0 + spent / DEFER_SHARE if served else 0.0
