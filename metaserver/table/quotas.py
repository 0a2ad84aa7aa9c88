"""Quota groups and reservations on the page table (``TableQuotas``, held by a ``TableDirectory`` as
``quota`` when the tokens file names any group): each namespace's use counted into its group (umbp/quotarules.py
says which namespaces share one), an ALLOC that would take its group past its quota first evicting the group's own
least recently used old pages (or refused whole, nothing evicted, when they cannot make room), and the reservations
global eviction respects. The behaviour is ``metaserver/handlers/ownership.py``'s docstring's; this is how the table keeps it.

Use. A namespace's use is the extents (object sizes, header included, 4 KiB aligned) of its READY and PENDING rows:
exactly the rows the key index files, so it is counted where rows are filed and unfiled (``KeyIndex.watch`` calls
``filed``): an int64 array by namespace index (the table's ``ns`` column) and one by group index. ``check()``
recounts both from the columns. Its group's quota also counts the extents of its rows freed young, which the write
quarantine holds until their write capabilities are dead (``held``: a heap of (until, bytes) per group, and their
sum): they take arena space as surely as live rows, and a flood that evicted its own young rows would otherwise hold
up to ``hold_s`` of its put rate outside its quota and push every other tenant's pages out. So quota eviction takes
only old rows (generation below the quarantine's young mark: freed at once), and a group whose rows are all young is
refused (QUOTA) until they age: a group puts at most about quota / ``hold_s`` bytes a second past its quota (1 GiB
over 12 s: 85 MiB/s), the price of a quota that holds in a closed pool. Open pools hold nothing.

Quota eviction (``fit``, before an ALLOC places anything). The new keys' bytes (absent, or on a node being dropped;
a key given twice once) over the group's room are evicted from the group's *victims*: the oldest (``stamp``) READY,
unpinned, old rows of its namespaces, not on a dying node and not keys of this request, gathered by numpy over the
``ns``, ``state``, ``pins`` and ``gen`` columns (at least GROUP_VICTIMS, a 64th of them, or one per 256 rows of the
table) and consumed in stamp order, a window of them at a time; a victim touched, pinned or gone since its gather is
skipped (its stamp or state changed). Before evicting anything the valid victims' bytes are summed: when they cannot
cover the excess (a fresh gather counts every such row of the group) or it would take more than the budget of
victims, the request is refused with nothing evicted.
What it approximates: a row pinned when its batch was gathered and released since is seen from the next gather on; a
gather that found every such row is not repeated for GATHER_AGAIN_S while the young mark stays and the group files
no new row (a group refused over and over does not scan the table each time).

Reservations (``spares``, asked by ``evict.victim`` for every victim of global eviction: ALLOC into a full
node, the watermark pass, EVICT of bytes; not evict-all, not quota eviction): a READY row is passed over when taking
it would leave its group below its reservation (``QuotaRules.floor``: clamped to half the capacity). A victim that
is taken counts as leaving its group at once (``leaving``) until the request unfiles its victims together, so one
request never takes a group below its floor. A node's candidate queue is refilled without the rows of groups at
their floor, so a reserved group's many old rows cannot hide the node's other victims; what that approximates: a
reserved row that becomes evictable (its group grew) waits for the next refill.

A partitioned pool's slot enforces ``quota // slots`` and ``reservation // slots`` of each group (the rules it is
given: ``QuotaRules.shared``); STATS names the pool-wide quota.

Costs: ``filed`` O(rows filed) numpy; ``fit`` O(keys) plus, for a group past its quota, O(victims) numpy and a
Python step per victim evicted, and a gather O(table rows) numpy (1 ms at 1 M rows on the 2-core VM) at most once per
call, amortised over the batch it yields (at least a 256th of the table's rows when the group has them); ``spares``
O(1) (its floors O(nodes + groups) once per eviction call). Measured on the 2-core VM at 1 M rows, 128-key
ALLOC+COMMIT: 0.25 us a key for ``fit`` and ``filed`` of a group under its quota (5.4 us a key in all).
"""

from __future__ import annotations

import heapq
import time

import numpy as np

from metaserver.table.entry import PENDING, READY, extent_size
from metaserver.table.quarantine import NEVER
from umbp.quotarules import QuotaRules

GROUP_VICTIMS = 1024  # the fewest victims a gather collects (or a 64th of the group's evictable rows)
EVICT_BUDGET = 1024  # victims quota eviction may take for an ALLOC, besides one per key
GATHER_AGAIN_S = 1.0  # a gather that found all of a group's old rows is not repeated sooner, nothing changed


class _Batch:
    """A group's gathered victims, oldest first, each with the stamp and extent it had; ``pos``: the next."""

    __slots__ = ("rows", "stamps", "ext", "pos")

    def __init__(self, rows: np.ndarray, stamps: np.ndarray, ext: np.ndarray):
        self.rows, self.stamps, self.ext, self.pos = rows, stamps, ext, 0


class TableQuotas:
    """The quota groups of one table (see the module docstring). ``t``: the ``TableDirectory``; ``rules``: its
    ``QuotaRules`` (a slot's share already applied)."""

    def __init__(self, table, rules: QuotaRules):
        self.t = table
        self.rules = rules
        self.groups = list(rules.groups)  # by group index
        self.limit = np.array([g.limit for g in self.groups], np.int64)
        self.reserving = rules.reserved > 0
        n = len(self.groups)
        self.group_used = np.zeros(n, np.int64)
        self.ns_used = np.zeros(0, np.int64)  # by namespace index
        self.ns_group = np.zeros(0, np.int64)  # namespace index -> group index, -1: no quota
        self.leaving = np.zeros(n, np.int64)  # bytes of global eviction's victims not unfiled yet
        self.held_heap: list[list[tuple[float, int]]] = [[] for _ in range(n)]
        self.held_bytes = np.zeros(n, np.int64)
        self._batch: list[_Batch | None] = [None] * n
        self._gathered: list[tuple | None] = [None] * n  # (young mark, time) of a gather that found every row
        self._ext = np.zeros(0, np.int64)  # extent of each layout code index
        self._floors: tuple[int, np.ndarray] = (-1, np.zeros(n, np.int64))  # (capacity, floors) last computed

    # -- namespaces and extents -------------------------------------------------------------------------------
    def _cover(self) -> None:
        """Extend the namespace arrays to every namespace the table interned (its group resolved once)."""
        names = self.t.ns_names
        have = len(self.ns_group)
        if have < len(names):
            by = {g.name: i for i, g in enumerate(self.groups)}
            add = [by[g.name] if (g := self.rules.group_of(ns)) is not None else -1 for ns in names[have:]]
            self.ns_group = np.concatenate((self.ns_group, np.array(add, np.int64)))
            self.ns_used = np.concatenate((self.ns_used, np.zeros(len(add), np.int64)))

    def _extents(self) -> np.ndarray:
        if len(self._ext) < len(self.t.codes):
            self._ext = self.t.code_extents()
        return self._ext

    def group_of(self, nsix: int) -> int:
        self._cover()
        return int(self.ns_group[nsix])

    # -- use ----------------------------------------------------------------------------------------------------
    def filed(self, rows: np.ndarray, sign: int) -> None:
        """``KeyIndex.watch``: ``rows`` were filed (``sign`` 1) or are being unfiled (-1); their ``ns`` and ``size``
        columns describe them. An unfiling ends the current eviction's ``leaving`` tally (its victims go in one
        unfiling, at the end of the request that took them)."""
        if not len(rows):
            return
        c = self.t.cols
        self._cover()
        ns = c["ns"].take(rows).astype(np.int64)
        ext = self._extents().take(c["size"].take(rows)) * sign
        n0 = int(ns[0])
        if (ns == n0).all():  # one namespace (an ALLOC's rows, most unfilings): scalar sums
            total = int(ext.sum())
            self.ns_used[n0] += total
            g0 = int(self.ns_group[n0])
            if g0 >= 0:
                self.group_used[g0] += total
                if sign > 0:
                    self._gathered[g0] = None
            if sign < 0 and self.reserving:
                self.leaving[:] = 0
            return
        np.add.at(self.ns_used, ns, ext)
        g = self.ns_group.take(ns)
        inq = g >= 0
        if inq.any():
            np.add.at(self.group_used, g[inq], ext[inq])
            if sign > 0:  # new rows: the next quota eviction gathers again
                for gi in np.unique(g[inq]).tolist():
                    self._gathered[gi] = None
        if sign < 0 and self.reserving:
            self.leaving[:] = 0

    def held(self, nsix: int, size: int, until: float) -> None:
        """A row of namespace ``nsix`` left with its extent of ``size`` bytes held by the quarantine until monotonic
        ``until`` (0.0: freed at once): its group counts it until then. O(log held)."""
        if not until:
            return
        g = self.group_of(nsix)
        if g >= 0:
            heapq.heappush(self.held_heap[g], (until, size))
            self.held_bytes[g] += size

    def group_held(self, g: int, now: float | None = None) -> int:
        """Bytes of group ``g`` the quarantine holds now (those given back since are forgotten)."""
        h = self.held_heap[g]
        if h:
            now = time.monotonic() if now is None else now
            while h and h[0][0] <= now:
                self.held_bytes[g] -= heapq.heappop(h)[1]
        return int(self.held_bytes[g])

    # -- an ALLOC's room --------------------------------------------------------------------------------------
    def fit(self, nsix: int, keys: list, sizes: list, found: np.ndarray) -> bool:
        """Make room in the quota of namespace ``nsix``'s group for an ALLOC's new keys (``found``: their rows, -1
        absent), evicting the group's least recently used old rows; False (nothing evicted) when they cannot fit:
        more than the quota, or more than what its evictable old rows and the victim budget free."""
        g = self.group_of(nsix)
        if g < 0:
            return True
        t = self.t
        new = found < 0
        if t.dying:  # a key on a node being dropped is placed anew
            new |= t.dead.take(t.cols["node"].take(found))  # found -1 reads the last row: already new
        n = int(np.count_nonzero(new))
        if not n:
            return True
        at = range(len(keys)) if n == len(keys) else np.flatnonzero(new).tolist()
        if n > 1 and len(set(keys) if n == len(keys) else {keys[i] for i in at}) < n:  # a key given twice: once
            at = list({keys[i]: i for i in reversed(at)}.values())
        sz = sizes if len(at) == len(sizes) else [sizes[i] for i in at]
        first = sz[0]
        need = extent_size(first) * len(sz) if sz.count(first) == len(sz) else sum(map(extent_size, sz))
        limit = int(self.limit[g])
        over = int(self.group_used[g]) + self.group_held(g) + need - limit
        if over <= 0:
            return True
        if need > limit:
            return False
        return self._evict(g, over, EVICT_BUDGET + len(keys), found[found >= 0])

    def _evict(self, g: int, over: int, budget: int, keep: np.ndarray) -> bool:
        """Evict at least ``over`` bytes of group ``g``'s victims (oldest first, at most ``budget`` of them, none of
        rows ``keep``), or nothing when they cannot. True when it did."""
        t = self.t
        young = t.quarantine.young_gen
        now = time.monotonic()
        last = self._gathered[g]
        fresh = last is not None and last[0] == young and now - last[1] < GATHER_AGAIN_S
        for _ in range(2):  # the batch gathered before, then (if it does not cover ``over``) a fresh one
            b = self._batch[g]
            if b is not None:
                take, used = self._covering(b, over, keep)
                if take is not None:
                    if len(take) > budget:
                        return False
                    b.pos += used
                    self._drop(take)
                    return True
            if fresh:
                return False
            fresh = self._gather(g, young, over, now)
        return False

    def _covering(self, b: _Batch, over: int, keep: np.ndarray) -> tuple[np.ndarray | None, int]:
        """The valid victims of batch ``b``, from its position, whose extents first reach ``over`` bytes, and how
        many batch entries they span; (None, 0) when all of them do not reach it."""
        c = self.t.cols
        lo, end = b.pos, len(b.rows)
        if lo >= end:
            return None, 0
        w = 2 * (over // int(b.ext[lo]) + 1) + 64  # a window of about twice the entries needed, doubled if short
        while True:
            hi = min(end, lo + w)
            rows = b.rows[lo:hi]
            ok = c["state"].take(rows) == READY
            ok &= (c["pins"].take(rows) == 0) & (c["stamp"].take(rows) == b.stamps[lo:hi])
            if len(keep):
                ok &= ~np.isin(rows, keep)
            acc = np.cumsum(np.where(ok, b.ext[lo:hi], 0))
            if acc[-1] >= over:
                k = int(np.searchsorted(acc, over)) + 1  # acc[k-1] >= over: the first k entries cover it
                return rows[:k][ok[:k]], k
            if hi == end:
                return None, 0
            w *= 2

    def _gather(self, g: int, young: int, over: int, now: float) -> bool:
        """A fresh batch of group ``g``'s victims (module docstring); True when it holds every such row."""
        t = self.t
        c = t.cols
        top = t.blocks_used * t.block
        nss = np.flatnonzero(self.ns_group == g)
        nscol = c["ns"][:top]
        m = nscol == nss[0] if len(nss) == 1 else np.isin(nscol, nss)
        m &= c["state"][:top] == READY
        rows = np.flatnonzero(m)
        rows = rows[c["pins"].take(rows) == 0]
        if young != NEVER:  # an open pool: every row is old
            rows = rows[c["gen"].take(rows) < np.uint64(young)]
        if t.dying:
            rows = rows[~t.dead.take(c["node"].take(rows))]
        stamps = c["stamp"].take(rows)
        k = min(len(rows), max(GROUP_VICTIMS, len(rows) // 64, top >> 8))  # a scan yields top/256 victims or more
        ext = self._extents().take(c["size"].take(rows))
        if k < len(rows):
            part = np.argpartition(stamps, k - 1)[:k]
            if int(ext.take(part).sum()) < over:  # a request past its quota by more than a batch: every row
                k = len(rows)
            else:
                rows, stamps, ext = rows.take(part), stamps.take(part), ext.take(part)
        order = np.argsort(stamps, kind="stable")
        self._batch[g] = _Batch(rows.take(order), stamps.take(order), ext.take(order))
        every = k == len(rows)
        self._gathered[g] = (young, now) if every else None
        return every

    def _drop(self, rows: np.ndarray) -> None:
        """Evict READY, unpinned ``rows`` (old: their extents freed at once), as a node's eviction does."""
        t = self.t
        c = t.cols
        for r, off, code, gen, nix, nsix in zip(rows.tolist(), t.offsets_of(rows),
                                                t.code_arr.take(c["size"].take(rows)).tolist(),
                                                c["gen"].take(rows).tolist(), c["node"].take(rows).tolist(),
                                                c["ns"].take(rows).tolist()):
            node = t.nodes[nix]
            size = extent_size(code)
            self.held(nsix, size, t.quarantine.free(node, off, size, gen))
            t._free_row(r, node)
        t.commits.leaving(rows)
        t.ix.delete(rows, c["ns"].take(rows).astype(np.uint64))
        t.evictions += len(rows)

    # -- reservations -------------------------------------------------------------------------------------------
    def floors(self) -> np.ndarray:
        """Each group's reservation in this table now (``QuotaRules.floor`` of its capacity), by group index."""
        cap = self.t.capacity
        if self._floors[0] != cap:
            self._floors = (cap, np.array([self.rules.floor(g, cap) for g in self.groups], np.int64))
        return self._floors[1]

    def spares(self, nsix: int, code: int, floors: np.ndarray) -> bool:
        """Whether global eviction passes over a READY row of namespace ``nsix`` and layout ``code``: taking it would
        leave its group below its floor. A row it does not pass over counts as leaving its group from now on."""
        g = int(self.ns_group[nsix]) if nsix < len(self.ns_group) else self.group_of(nsix)
        if g < 0 or not floors[g]:
            return False
        size = extent_size(code)
        if self.group_used[g] - self.leaving[g] - size < floors[g]:
            return True
        self.leaving[g] += size
        return False

    def spared_rows(self, rows: np.ndarray, floors: np.ndarray) -> np.ndarray:
        """Which of READY ``rows`` global eviction would pass over now (``spares`` for each, none taken)."""
        c = self.t.cols
        self._cover()
        g = self.ns_group.take(c["ns"].take(rows).astype(np.int64))
        inq = g >= 0
        out = np.zeros(len(rows), bool)
        if inq.any():
            gi = g[inq]
            room = self.group_used.take(gi) - self.leaving.take(gi) - self._extents().take(c["size"].take(rows[inq]))
            out[inq] = room < floors.take(gi)
        return out

    # -- what the service and tests read -------------------------------------------------------------------------
    def used_by_name(self) -> dict[str, int]:
        return {self.groups[i].name: int(u) for i, u in enumerate(self.group_used.tolist()) if u}

    def ns_used_by_name(self) -> dict[str, int]:
        names = self.t.ns_names
        return {names[i]: int(u) for i, u in enumerate(self.ns_used.tolist()) if u}

    def usage(self, usage: dict[str, dict]) -> dict[str, dict]:
        """STATS' ``namespace_usage`` with each namespace's group quota (pool-wide), and the namespaces a group
        names exactly even without use."""
        for ns in self.rules.exact_names() - set(usage):
            usage[ns] = {"objects": 0, "used_bytes": 0, "quota_bytes": None}
        for ns, u in usage.items():
            g = self.rules.group_of(ns)
            u["quota_bytes"] = g.quota if g is not None else None
        return dict(sorted(usage.items()))

    def check(self) -> None:
        """Use recounted from the columns equals the counters; the held totals equal their heaps; no eviction
        tally is open. AssertionError otherwise."""
        t = self.t
        c = t.cols
        self._cover()
        top = t.blocks_used * t.block
        st = c["state"][:top]
        live = np.flatnonzero((st == READY) | (st == PENDING))
        ns = c["ns"].take(live).astype(np.int64)
        ext = self._extents().take(c["size"].take(live))
        want = np.zeros(len(self.ns_used), np.int64)
        np.add.at(want, ns, ext)
        assert np.array_equal(want, self.ns_used), ("tablequotas: per-namespace use", want, self.ns_used)
        gw = np.zeros(len(self.groups), np.int64)
        inq = self.ns_group >= 0
        np.add.at(gw, self.ns_group[inq], want[inq])
        assert np.array_equal(gw, self.group_used), ("tablequotas: per-group use", gw, self.group_used)
        for g, h in enumerate(self.held_heap):
            assert sum(s for _, s in h) == self.held_bytes[g], f"tablequotas: group {g}'s held bytes"
        assert not self.leaving.any(), "tablequotas: an eviction's leaving tally left open"
