"""The watch a node connection keeps over the write whose data is arriving (``WriteWatch``, held by each
``umbp.node.server.DataProtocol``).

A write's frame is checked when it starts (range, capability, ledger, generation floor) and its data is then received
straight into the arena, at most ``WRITE_CHUNK`` a receive. Before each receive the watch looks at the write's
deadline (the ALLOC answer's ``write_until_ms``, wall clock) and, when a generation floor rose since the frame started
(a takeover's REGISTER answer or FENCE: ``umbp/floors.py``), at the write's generations. Past the deadline, or granted
by a deposed term, the rest of the frame goes to scratch (``FrameReader.divert``: the connection stays in sync) and the
write's answer fails the ops not received whole: a write that outlives its allocation never lands on a page the
metaserver has placed in its extent since. Cost: one clock read a receive while a deadline is set; the generations
only when a floor rose.
"""

from __future__ import annotations

import time

from transport import wire
from transport.base import late_message, stale_message
from umbp.errors import Unavailable

_DISCARDED = "; the rest of its data was discarded"


class WriteWatch:
    __slots__ = ("reader", "floors", "component", "rid", "until_ms", "what", "gens", "mark", "late")

    def __init__(self, reader: wire.FrameReader, floors, component: str):
        self.reader = reader
        self.floors = floors
        self.component = component
        self.rid = 0  # the write whose data is arriving
        self.until_ms = 0  # its deadline (wall-clock ms; 0: none, or nothing arriving)
        self.what = ""
        self.gens: list | None = None  # its generations (None: nothing to watch)
        self.mark = 0  # the floors' version when it started
        self.late: tuple[int, int, str] | None = None  # (request id, first op not received whole, why), diverted

    def clear(self) -> None:
        """A frame starts: nothing watched until it proves to be a write (``start``)."""
        self.until_ms = 0
        self.gens = None

    def start(self, rid: int, what: str, until_ms: int, gens: list) -> None:
        """A write's frame passed its checks: watch its deadline (``until_ms``, 0 from an older client: none) and
        generations. Already past its deadline, the whole frame is refused (Unavailable: its data discarded)."""
        if until_ms and time.time() * 1000 > until_ms:
            raise Unavailable(self.component, late_message(until_ms, what) + _DISCARDED, wire.Status.UNAVAILABLE)
        self.rid, self.until_ms, self.what, self.gens, self.mark = rid, until_ms, what, gens, self.floors.version

    def look(self) -> None:
        """Before a receive into the arena: divert the rest of the write past its deadline or its term."""
        if self.until_ms and time.time() * 1000 > self.until_ms:
            self._divert(late_message(self.until_ms, self.what) + _DISCARDED)
        floors = self.floors
        if self.gens is not None and floors.version != self.mark:
            self.mark = floors.version
            stale = [(g, f) for g in self.gens if g < (f := floors.gen_floor(g))]
            if stale:
                self._divert(stale_message(*stale[0]) + _DISCARDED)

    def _divert(self, why: str) -> None:
        first = self.reader.divert()
        if first >= 0:
            self.late = (self.rid, first, why)
        self.clear()

    def answer(self, rid: int) -> tuple[int, str] | None:
        """The write ``rid``'s data is complete: (first op not received whole, why) when it was diverted, else
        None."""
        if rid == self.rid:
            self.clear()
        late = self.late
        if late is None or late[0] != rid:
            return None
        self.late = None
        return late[1], late[2]
