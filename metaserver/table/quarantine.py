"""Quarantine of freed extents that a writer may still write: write capabilities still alive (closed pools;
umbp/auth.py) and open allocations whose writer's connection closed (every pool).

A write capability is good until its deadline, ``write_cap_ttl_s`` after its allocation. If the allocation's extent
were free to place at once (an abort, a remove, the eviction of a young page), a writer that kept the capability could
write into the next owner's object until then. So an extent freed while its generation is *young* (allocated less than
``hold_s`` = ``write_cap_ttl_s`` + clock skew ago) is held here until ``hold_s`` after the free, then given back to its
node's allocator. Old pages (every eviction of a page older than ``hold_s``: nearly all of them) are freed at once.

Which generations are young needs no per-page timestamp: generations increase with time, so ``observe`` samples the
counter every tick, and every generation below the sample taken ``hold_s`` ago was handed out before it. Until the
first such sample exists, every generation this leader handed out counts as young (the first ``hold_s`` of a term);
generations of earlier terms are not: their capabilities died with the term (nodes refuse older epochs).

Open pools hold nothing of that kind (``hold_s`` = 0: any writer may write anything there anyway).

Read leases of the last term, in every pool. A new leader (a takeover, a slot handed over) holds none of the read
leases its predecessor granted, and those readers may still be reading: a node's TCP READV answer drains from the
arena as it is when the socket takes it, and a client accepts a read that ends within ``lease_ms`` of its LOOKUP
(tests/test_attack_leases.py). So for ``lease_s`` (``read_lease_s`` plus clock skew) after ``start``, an extent of an
earlier term's page (a generation below the counter at ``start``) that is freed is kept until the window ends, and
``leasing`` tells eviction to take no victim meanwhile (every page would be such a page; evicting them would free
nothing placeable): puts that need eviction answer NO_SPACE for that long after a takeover.

Open allocations, in every pool. An allocation aborted because its writer's connection closed (``drop_pending``)
may still be written: the writer got its places before the connection broke and writes them without the
metaserver (shm writes, and every write of an open pool, are fenced by nothing); its COMMIT then fails and it writes
again elsewhere. Placing a new object there at once would let that late write overwrite it (a TCP write streams its
payload under the new object's header: wrong bytes; writes carry a deadline, ``write_until_ms``, that nodes and
shm/RDMA writers keep, so keeping the extent past it is enough). The same holds for an ABORT that says its places were
written (``"written": true``): the writer's write failed (a timeout, a broken node connection, a copy that outlived
its deadline), but a node may still apply a write in flight, or the copy threads finish it. So frees made inside
``keeping()`` are kept (``kept``) for ``keep_s``: the longest an allocation's writer may write (``pending_ttl_s``,
after which the allocation expires anyway, and ``write_cap_ttl_s`` in a closed pool) plus clock skew. The extents
a departing leader handed on (``metaserver/ha/handoff.py``) wait in the same queue, and a handover hands the kept ones
on again.

Costs: a free O(1); ``release`` O(extents released), budgeted per call; memory one tuple per held extent.
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager

NEVER = 1 << 64  # no generation is young: frees go straight to the allocator


class Quarantine:
    __slots__ = ("hold_s", "keep_s", "young_gen", "held", "kept", "held_bytes", "_samples", "_keeping", "lease_gen",
                 "lease_until")

    def __init__(self, hold_s: float = 0.0, keep_s: float = 0.0):
        self.hold_s = hold_s
        self.keep_s = keep_s
        self.young_gen = NEVER  # generations >= this were handed out less than hold_s ago
        # (release at, NodeSpace, offset, size); each queue in release order (one hold length per queue)
        self.held: deque[tuple[float, object, int, int]] = deque()
        self.kept: deque[tuple[float, object, int, int]] = deque()  # open allocations' extents, for keep_s
        self.held_bytes = 0  # of both queues
        self._samples: deque[tuple[float, int]] = deque()  # (monotonic time, every gen handed out was below this)
        self._keeping = 0
        self.lease_gen = 0  # pages of generations below this may be read under the last term's leases ...
        self.lease_until = 0.0  # ... until this monotonic time

    def start(self, now: float, issued_below: int, lease_s: float = 0.0) -> None:
        """A term starts: generations from ``issued_below`` on are this leader's, young until sampled as old; the
        earlier terms' pages may be read under their leases for ``lease_s`` (module docstring)."""
        self.lease_gen, self.lease_until = issued_below, now + lease_s
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

    def issued_after(self, gen: int) -> float | None:
        """A monotonic time before which generation ``gen`` had not been handed out (the latest sample whose counter
        was still at or below it), or None when ``gen`` is older than every sample kept (handed out more than
        ``hold_s`` ago, or in an earlier term). A retried ALLOC's capability for an allocation it gets back is
        bounded by this plus the capability TTL (``DataPlane._alloc_now``): a retry never extends a
        capability past what ``free`` assumes when it judges the generation's age. O(samples kept)."""
        at = None
        for t, below in self._samples:
            if below > gen:
                break
            at = t
        return at

    def leasing(self) -> bool:
        """Whether the last term's read leases may still be read under (no eviction meanwhile: module docstring)."""
        return self.lease_until > 0 and time.monotonic() < self.lease_until

    def free(self, sp, offset: int, size: int, gen: int) -> float:
        """Free an extent of node space ``sp`` that generation ``gen`` was allocated: now, or after ``hold_s``
        (inside ``keeping()``: after ``keep_s``; an earlier term's page within the lease window: at its end). Returns
        the monotonic time it is given back at (0.0: now; a quota group counts a held extent until then:
        metaserver/table/quotas.py)."""
        leased = gen < self.lease_gen and self.leasing()
        if (self._keeping and self.keep_s > 0) or leased:
            # the kept queue's times stay in order: now + keep_s and the window's end both only grow
            until = max(time.monotonic() + self.keep_s if self._keeping else 0.0, self.lease_until if leased else 0.0)
            self.keep(sp, offset, size, until)
            return until
        if gen < self.young_gen:
            sp.alloc.free(offset, size)
            return 0.0
        until = time.monotonic() + self.hold_s
        self.held.append((until, sp, offset, size))
        self.held_bytes += size
        return until

    def keep(self, sp, offset: int, size: int, until: float) -> None:
        """Keep an allocated extent of ``sp`` out of placement until monotonic time ``until`` (no later than
        ``keep_s`` from now: the queue is released in order)."""
        self.kept.append((until, sp, offset, size))
        self.held_bytes += size

    @contextmanager
    def keeping(self):
        """``with q.keeping():`` the frees meanwhile are of open allocations whose writers may still write."""
        self._keeping += 1
        try:
            yield self
        finally:
            self._keeping -= 1

    @property
    def waiting(self) -> bool:
        """Whether any extent is held or kept."""
        return bool(self.held or self.kept)

    def release(self, now: float, spaces: dict, budget: int) -> int:
        """Give back held and kept extents whose time is up, at most ``budget``; an extent of a space that was
        dropped since (node loss) is forgotten. Returns how many were released."""
        n = 0
        for queue in (self.held, self.kept):
            while queue and queue[0][0] <= now and n < budget:
                _, sp, offset, size = queue.popleft()
                self.held_bytes -= size
                if not sp.dead and spaces.get(sp.node_id) is sp:
                    sp.alloc.free(offset, size)
                n += 1
        return n

    def extents(self, sp) -> list[tuple[int, int]]:
        """The extents of ``sp`` held or kept now (for the allocator invariant: allocated, owned by no entry)."""
        return [(off, size) for queue in (self.held, self.kept) for _, s, off, size in queue if s is sp]

    def kept_extents(self) -> list[tuple[str, int, int]]:
        """(node_id, offset, size) of every kept extent still on a live node (a handover hands them on)."""
        return [(sp.node_id, off, size) for _, sp, off, size in self.kept if not sp.dead]
