"""Quarantine of freed extents whose write capabilities may still be alive (closed pools; umbp/auth.py).

A write capability is good until its deadline, ``write_cap_ttl_s`` after its allocation. If the allocation's extent
were free to place at once (an abort, a remove, the eviction of a young page), a writer that kept the capability could
write into the next owner's object until then. So an extent freed while its generation is *young* (allocated less than
``hold_s`` = ``write_cap_ttl_s`` + clock skew ago) is held here until ``hold_s`` after the free, then given back to its
node's allocator. Old pages (every eviction of a page older than ``hold_s``: nearly all of them) are freed at once.

Which generations are young needs no per-page timestamp: generations increase with time, so ``observe`` samples the
counter every tick, and every generation below the sample taken ``hold_s`` ago was handed out before it. Until the
first such sample exists, every generation this leader handed out counts as young (the first ``hold_s`` of a term);
generations of earlier terms are not: their capabilities died with the term (nodes refuse older epochs).

Open pools hold nothing (``hold_s`` = 0: any writer may write anything there anyway). Costs: a free O(1); ``release``
O(extents released), budgeted per call; memory one tuple per held extent.
"""

from __future__ import annotations

import time
from collections import deque

NEVER = 1 << 64  # no generation is young: frees go straight to the allocator


class Quarantine:
    __slots__ = ("hold_s", "young_gen", "held", "held_bytes", "_samples")

    def __init__(self, hold_s: float = 0.0):
        self.hold_s = hold_s
        self.young_gen = NEVER  # generations >= this were handed out less than hold_s ago
        self.held: deque[tuple[float, object, int, int]] = deque()  # (release at, NodeSpace, offset, size)
        self.held_bytes = 0
        self._samples: deque[tuple[float, int]] = deque()  # (monotonic time, every gen handed out was below this)

    def start(self, now: float, issued_below: int) -> None:
        """A term starts: generations from ``issued_below`` on are this leader's, young until sampled as old."""
        if self.hold_s > 0:
            self.young_gen = issued_below
            self._samples.clear()
            self._samples.append((now, issued_below))

    def observe(self, now: float, issued_below: int) -> None:
        """One sample of the generation counter (every tick): moves ``young_gen`` up to what was handed out
        ``hold_s`` ago."""
        if self.hold_s <= 0:
            return
        s = self._samples
        s.append((now, issued_below))
        while len(s) > 1 and s[1][0] <= now - self.hold_s:
            s.popleft()
        if s[0][0] <= now - self.hold_s:
            self.young_gen = max(self.young_gen, s[0][1])

    def free(self, sp, offset: int, size: int, gen: int) -> None:
        """Free an extent of node space ``sp`` that generation ``gen`` was allocated: now, or after ``hold_s``."""
        if gen < self.young_gen:
            sp.alloc.free(offset, size)
            return
        self.held.append((time.monotonic() + self.hold_s, sp, offset, size))
        self.held_bytes += size

    def release(self, now: float, spaces: dict, budget: int) -> int:
        """Give back held extents whose time is up, at most ``budget``; an extent of a space that was dropped
        since (node loss) is forgotten. Returns how many were released."""
        n = 0
        held = self.held
        while held and held[0][0] <= now and n < budget:
            _, sp, offset, size = held.popleft()
            self.held_bytes -= size
            if not sp.dead and spaces.get(sp.node_id) is sp:
                sp.alloc.free(offset, size)
            n += 1
        return n

    def extents(self, sp) -> list[tuple[int, int]]:
        """The extents of ``sp`` held now (for the allocator invariant: they are allocated, owned by no entry)."""
        return [(off, size) for _, s, off, size in self.held if s is sp]
