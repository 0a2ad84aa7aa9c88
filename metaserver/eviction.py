"""Eviction policy: which object of a node goes first, and the watermarks that decide when to evict.

A policy keeps, per node, the set of *evictable* entries current (READY and unpinned), in victim order, so
eviction only ever looks at candidates (as SGLang's radix cache keeps its evictable leaves): the directory calls
``add`` when an entry becomes evictable (commit, last unpin), ``discard`` when it stops being so (first pin, removal,
eviction). A read is a pin then an unpin, so the lease release re-adds the entry at the recent end: that is what
makes a read count as a use. PENDING and pinned entries are never in the set, so they can never be chosen.

Representation: intrusive rings. Each order is a circular doubly linked list threaded through the entries' own
``prev``/``next`` slots, with a ``Ring`` sentinel holding the count. No per-entry dict slot, heap record or sequence
number: membership costs two pointers per entry (three with prefix-lru's ``tier``), and the first victim is
``ring.next`` in O(1). (A dict used as an ordered set costs ~35-50 bytes per member, and its first key is found by
scanning past every slot deleted from its front since the last resize: tens of microseconds per victim once a node
is full.)

Policies:

- ``lru``: one ring per node; an entry re-added goes to the recent end. The victim is the least recently used.
- ``prefix-lru``: a prefix match stops at the first missing page, so a page whose children are cached is worth more
  than a leaf, and a page whose parent is gone is worth nothing. Three tiers per node (orphans, leaves, inner
  pages), each a ring ordered by last access; see ``PrefixLruPolicy``.

What it approximates: recency is metaserver memory only; after a restart it restarts from commit order (etcd
mod revision). prefix-lru files an entry that changes tier by its own last access, walking at most ``TIER_WALK``
steps in from each end of the tier; an entry that would sort deeper is placed ``TIER_WALK`` steps from the old end
(older than it should be, so it goes a little early).

Costs: lru add/discard/first O(1); ``add_many``/``discard_many`` are the same per entry with the calls inlined (a
LOOKUP pins and its RELEASE unpins a whole batch: about a fifth of the directory's per-key lookup+release work was
the four method calls per key). prefix-lru discard/first O(1); add O(1) when the entry is the most recent of
its tier (a commit, a release: the common case), else O(min(distance from either end, TIER_WALK)).

Contract with the directory: entries carry ``prev``, ``next`` and ``tier`` slots for the policy's use only, their
``last_access``, and ``space.node_id``; prefix-lru reads the directory's link slots (``kids``: None while no cached
page names this one as parent; ``up``: the parent's key, bytes, while it names a parent that is not cached).

Reservations (umbp/quotarules.py): a victim global eviction must pass over (its group is at its reservation) is
moved to the recent end of its order by ``spare``, its ``last_access`` kept, so the next victim is found in O(1) and
the group's own quota eviction (which ranks by ``last_access``) still sees its true recency: a second chance, as a
CLOCK hand gives, for as long as the reservation holds.

Watermarks: ``over_high(used, cap)`` starts a background pass, ``bytes_to_low(used, cap)`` is how much it frees.
"""

from __future__ import annotations

from typing import Iterator, Protocol

TIER_WALK = 256  # prefix-lru: steps from each end of a tier to find an out-of-order entry's place


class Policy(Protocol):
    name: str
    links_blind: bool  # True: the order ignores prefix links, so adds of a batch may be made after its linking

    def add(self, entry) -> None: ...
    def discard(self, entry) -> None: ...
    def add_many(self, entries: list) -> None: ...
    def discard_many(self, entries: list) -> None: ...
    def children_changed(self, entry) -> None: ...
    def spare(self, entry) -> None: ...
    def victims(self, node_id: str) -> Iterator: ...
    def first(self, node_id: str): ...
    def members(self, node_id: str) -> list: ...
    def drop_node(self, node_id: str) -> None: ...
    def count(self, node_id: str) -> int: ...


class Ring:
    """Sentinel of a circular doubly linked list of entries, oldest first (``next`` is the oldest, ``prev`` the most
    recent). An entry is in at most one ring; ``entry.prev is None`` when it is in none."""

    __slots__ = ("prev", "next", "count")

    def __init__(self) -> None:
        self.prev = self.next = self
        self.count = 0

    def push(self, e) -> None:
        """Append at the recent end. O(1)."""
        self._link_before(self, e)

    def _link_before(self, at, e) -> None:
        """Link ``e`` in just before ``at`` (a member, or the sentinel: the recent end). O(1)."""
        p = at.prev
        e.prev = p
        e.next = at
        p.next = e
        at.prev = e
        self.count += 1

    def insert_by_access(self, e) -> None:
        """Insert after the last member whose last_access is <= e's (ties keep arrival order), searching from both
        ends at once, at most TIER_WALK steps each (then placed TIER_WALK steps in from the old end)."""
        a = e.last_access
        back = self.prev
        if back is self or back.last_access <= a:
            self.push(e)
            return
        fwd = self.next
        at = None
        for _ in range(TIER_WALK):
            if fwd is self or fwd.last_access > a:
                at = fwd
                break
            back = back.prev
            if back is self or back.last_access <= a:
                at = back.next
                break
            fwd = fwd.next
        self._link_before(fwd if at is None else at, e)

    def unlink(self, e) -> None:
        p, n = e.prev, e.next
        p.next = n
        n.prev = p
        e.prev = e.next = None
        self.count -= 1

    def first(self):
        e = self.next
        return None if e is self else e

    def members(self) -> list:
        """Members oldest first (a snapshot; O(count))."""
        out = []
        e = self.next
        for _ in range(self.count):
            out.append(e)
            e = e.next
        return out

    def clear(self) -> None:
        """Empty the ring, leaving every member unlinked. O(count)."""
        for e in self.members():
            e.prev = e.next = e.tier = None
        self.prev = self.next = self
        self.count = 0

    def close(self) -> None:
        """Empty the ring for good (its node is dropped): also the sentinel's links to itself, so no cycle is left
        for the collector (metaserver/gcpolicy.py keeps long-lived objects frozen: a cycle there is never freed)."""
        self.clear()
        self.prev = self.next = None


class LruPolicy:
    """Least recently used first: one ring per node, keyed by ``entry.space.node_id``."""

    name = "lru"
    links_blind = True  # prefix links never change an entry's place: a batch's adds may wait until its links are made

    def __init__(self) -> None:
        self._rings: dict[str, Ring] = {}

    def add(self, entry) -> None:
        nid = entry.space.node_id
        r = self._rings.get(nid)
        if r is None:
            r = self._rings[nid] = Ring()
        elif entry.prev is not None:
            r.unlink(entry)  # already evictable: a re-add moves it to the recent end
        r.push(entry)

    def discard(self, entry) -> None:
        p = entry.prev
        if p is not None:
            r = self._rings.get(entry.space.node_id)
            if r is not None:  # Ring.unlink, inlined: every eviction and every first pin comes here
                n = entry.next
                p.next = n
                n.prev = p
                entry.prev = entry.next = None
                r.count -= 1

    def add_many(self, entries: list) -> None:
        """``add`` of each entry in order (the last one ends most recent), with Ring.push/unlink inlined."""
        rings = self._rings
        for e in entries:
            nid = e.space.node_id
            r = rings.get(nid)
            if r is None:
                r = rings[nid] = Ring()
            elif e.prev is not None:  # already evictable: moved to the recent end
                p, n = e.prev, e.next
                p.next = n
                n.prev = p
                r.count -= 1
            p = r.prev
            e.prev = p
            e.next = r
            p.next = e
            r.prev = e
            r.count += 1

    def discard_many(self, entries: list) -> None:
        """``discard`` of each entry, with Ring.unlink inlined."""
        rings = self._rings
        for e in entries:
            p = e.prev
            if p is None:
                continue
            r = rings.get(e.space.node_id)
            if r is None:
                continue
            n = e.next
            p.next = n
            n.prev = p
            e.prev = e.next = None
            r.count -= 1

    def children_changed(self, entry) -> None:
        pass

    def spare(self, entry) -> None:
        """Move evictable ``entry`` to the recent end (a reservation's pass-over: the module docstring). O(1)."""
        self.add(entry)

    def victims(self, node_id: str) -> Iterator:
        """Evictable entries of ``node_id`` in victim order. The caller discards each one it takes before the next
        step (otherwise the same entry comes back)."""
        r = self._rings.get(node_id)
        while r is not None and r.count:
            yield r.next

    def first(self, node_id: str):
        r = self._rings.get(node_id)
        if r is None:
            return None
        e = r.next  # Ring.first, inlined: placement asks once per victim
        return None if e is r else e

    def members(self, node_id: str) -> list:
        """Evictable entries of ``node_id`` in victim order (a snapshot)."""
        r = self._rings.get(node_id)
        return r.members() if r is not None else []

    def drop_node(self, node_id: str) -> None:
        r = self._rings.pop(node_id, None)
        if r is not None:
            r.close()

    def count(self, node_id: str) -> int:
        r = self._rings.get(node_id)
        return r.count if r is not None else 0


class PrefixLruPolicy:
    """Prefix-aware LRU. A prefix match stops at the first missing page, so per node, victims come from three
    tiers, least recently used first within each:

    0. orphans: the page names a parent that is not cached (evicted, removed), so no prefix match reaches it;
    1. leaves: no cached page names this one as parent;
    2. inner pages: other cached pages depend on this one.

    The directory tells the policy when a page's tier may have changed (``children_changed``: its cached children
    went to or from zero, or its parent came or went); the page keeps its own recency when it moves, so a cold
    chain loses its tail before a hot chain does. ``entry.tier`` is the tier it is filed in (None: not evictable).
    Costs: O(1) per discard and victim; O(1) per add of a most recent entry, else a bounded walk (module doc).
    """

    name = "prefix-lru"
    links_blind = False  # an entry's tier follows its links: file it as they change

    def __init__(self) -> None:
        self._tiers: dict[str, tuple[Ring, Ring, Ring]] = {}

    @staticmethod
    def tier_of(entry) -> int:
        if entry.kids is not None:
            return 2
        if type(entry.up) is bytes:
            return 0
        return 1

    def add(self, entry) -> None:
        nid = entry.space.node_id
        tiers = self._tiers.get(nid)
        t = entry.tier
        if t is not None and tiers is not None:  # discard, inlined
            tiers[t].unlink(entry)
        if tiers is None:
            tiers = self._tiers[nid] = (Ring(), Ring(), Ring())
        t = 2 if entry.kids is not None else 0 if type(entry.up) is bytes else 1  # tier_of, inlined
        tiers[t].insert_by_access(entry)
        entry.tier = t

    def discard(self, entry) -> None:
        t = entry.tier
        if t is not None:
            tiers = self._tiers.get(entry.space.node_id)
            if tiers is not None:
                tiers[t].unlink(entry)
            entry.tier = None

    def add_many(self, entries: list) -> None:
        """``add`` of each entry in order. The common case inlined (an entry not filed yet that is the most recent
        of its tier, as every entry of a load is: all used at 0.0): tier_of and Ring.push; others take ``add``."""
        all_tiers = self._tiers
        nid = tiers = None
        for e in entries:
            if e.tier is not None:
                self.add(e)
                continue
            if e.space.node_id != nid:
                nid = e.space.node_id
                tiers = all_tiers.get(nid)
                if tiers is None:
                    tiers = all_tiers[nid] = (Ring(), Ring(), Ring())
            t = 2 if e.kids is not None else 0 if type(e.up) is bytes else 1  # tier_of, inlined
            r = tiers[t]
            p = r.prev
            if p is r or p.last_access <= e.last_access:  # Ring.push, inlined
                e.prev = p
                e.next = r
                p.next = e
                r.prev = e
                r.count += 1
            else:
                r.insert_by_access(e)
            e.tier = t

    def discard_many(self, entries: list) -> None:
        for e in entries:
            self.discard(e)

    def children_changed(self, entry) -> None:
        """Re-file ``entry`` if it is evictable and its tier changed (keeping its own recency)."""
        t = entry.tier
        if t is None:
            return
        nt = 2 if entry.kids is not None else 0 if type(entry.up) is bytes else 1  # tier_of, inlined
        if t != nt:  # discard then add, inlined (an eviction re-files the victim's parent, and its orphaned kids)
            tiers = self._tiers.get(entry.space.node_id)
            if tiers is None:
                self.discard(entry)
                self.add(entry)
                return
            tiers[t].unlink(entry)
            tiers[nt].insert_by_access(entry)
            entry.tier = nt

    def spare(self, entry) -> None:
        """Move evictable ``entry`` to the recent end of its tier, ``last_access`` kept (a reservation's pass-over:
        the module docstring). O(1)."""
        tiers = self._tiers.get(entry.space.node_id)
        if tiers is not None and entry.tier is not None:
            r = tiers[entry.tier]
            r.unlink(entry)
            r.push(entry)

    def victims(self, node_id: str) -> Iterator:
        tiers = self._tiers.get(node_id)
        while tiers is not None:
            for r in tiers:
                if r.count:
                    yield r.next
                    break
            else:
                return

    def first(self, node_id: str):
        tiers = self._tiers.get(node_id)
        if tiers is not None:
            for r in tiers:
                if r.count:
                    return r.next
        return None

    def members(self, node_id: str) -> list:
        out: list = []
        for r in self._tiers.get(node_id, ()):
            out += r.members()
        return out

    def drop_node(self, node_id: str) -> None:
        for r in self._tiers.pop(node_id, ()):
            r.close()

    def count(self, node_id: str) -> int:
        return sum(r.count for r in self._tiers.get(node_id, ()))


POLICIES = {"lru": LruPolicy, "prefix-lru": PrefixLruPolicy}


def make_policy(name: str) -> Policy:
    return POLICIES[name]()


def over_high(used: int, capacity: int, high: float) -> bool:
    return capacity > 0 and used > high * capacity


def bytes_to_low(used: int, capacity: int, low: float) -> int:
    """Bytes to free to get from ``used`` down to the low watermark (0 when already below)."""
    return max(0, used - int(low * capacity))
