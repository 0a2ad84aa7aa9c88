"""Eviction for the columnar page table (``metaserver.table.columns.PageTable``), as functions of the table: exact LRU
by access stamp per node, or under ``prefix-lru`` exact (tier, stamp) order (``metaserver/table/links.py``: the
queue holds each row's tier << 62 | stamp where it holds the stamp, and rows whose key drops below the queue's
largest are inserted at their place). No I/O.

Every access (COMMIT, LOOKUP, the RELEASE that ends a read, an ALLOC of a READY key) stamps its rows with the next
values of one clock, in key order. A node that needs room takes victims from its candidate queue; an empty queue is
refilled with the oldest READY unpinned rows of the node (``least``: a sampled threshold over its blocks; at least
``CANDIDATES``, or 1/64 of the node's rows), each with the stamp it had. A candidate is evicted only if it is still
READY, unpinned and carries that stamp; a row touched since then is newer than every row left in the queue, and a
row not in the queue was newer than all of them when it was filled, so victims leave in exact stamp order. A victim
of exactly the size wanted hands over its extent and its row (no allocator round trip) unless its generation is
young (the write quarantine holds that extent). Every eviction but evict-all passes over a row whose quota group is
at its reservation, and a refill leaves such rows out (``metaserver/table/quotas.py``).

Costs: a refill O(node's rows) at C speed, amortised over the candidates it yields; a victim O(1) Python.
"""

from __future__ import annotations

import numpy as np

from metaserver.table.entry import PART_MASK, PENDING, READY, SHARD_SHIFT, extent_size
from transport.objformat import ALIGN, OBJ_HEADER_SIZE
from metaserver.table.nodes import NodeRows

CANDIDATES = 1024  # the fewest victims a queue refill collects


def refill(t, node: NodeRows, floors: np.ndarray | None = None) -> None:
    """``floors``: the quota groups' reservations (``TableQuotas.floors``): rows of groups at theirs are left out
    (a reserved group's old rows would otherwise fill the queue and hide the node's other victims)."""
    state, pins, stamp = t.cols["state"], t.cols["pins"], t.cols["stamp"]
    parts = []
    for b in node.blocks:
        lo = b * t.block
        hi = lo + t.block
        parts.append(np.flatnonzero((state[lo:hi] == READY) & (pins[lo:hi] == 0)) + lo)
    rows = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    if floors is not None:
        rows = rows[~t.quota.spared_rows(rows, floors)]
    key = t.links.order(rows) if t.links.linking else stamp.take(rows)  # prefix-lru: tier << 62 | stamp
    by = least(key, min(len(rows), max(CANDIDATES, len(rows) // 64)))
    rows, key = rows[by], key[by]
    c = t.cols
    node.queue = rows.tolist()
    node.qstamp = key.tolist()
    if t.links.linking:  # a row whose key falls below this is queued at its place (tablelinks.requeue)
        t.links.refilled(node, int(key[-1]) if len(key) else 0)
    node.qoff = t.offsets_of(rows)
    node.qcode = t.code_arr.take(c["size"].take(rows)).tolist()
    node.qns = c["ns"].take(rows).tolist()
    node.qpos = 0
    if not t.links.linking:  # prefix-lru inserts into the lists: its queues have no copy (no handover)
        t.qcopy.put(node, rows, key)

def victim(t, node: NodeRows, spare: bool = True) -> int:
    """The queue position of the node's least recently used READY unpinned row, or -1 when it has none. A row
    that is READY with its queued stamp is the page that was queued: ``qoff``, ``qcode``, ``qns`` describe it.
    ``spare`` (all but evict-all): pass over a row whose quota group is at its reservation
    (``TableQuotas.spares``); the caller evicts the row returned. -1 while the last term's read leases may
    be read under (``Quarantine.leasing``)."""
    if t.quarantine.leasing():
        return -1
    state, pins, stamp = t.cols["state"], t.cols["pins"], t.cols["stamp"]
    key = t.links.key if t.links.linking else None  # prefix-lru: the queue holds tier << 62 | stamp
    quota = t.quota if spare and t.quota is not None and t.quota.reserving else None
    floors = quota.floors() if quota is not None else None
    for _ in range(2):  # at most one refill: a fresh queue holds only valid candidates
        q, qs = node.queue, node.qstamp
        while node.qpos < len(q):
            i = node.qpos
            node.qpos += 1
            r = q[i]
            if state[r] == READY and not pins[r] and (stamp[r] if key is None else key(r)) == qs[i]:
                if quota is not None and quota.spares(node.qns[i], node.qcode[i], floors):
                    continue
                return i
        refill(t, node, floors)
    return -1

def handover(t, nodes: list, sizes: list[int], ks: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Victims that hand over their extent and row, for several nodes at once: up to ``ks[j]`` of node
    ``nodes[j]`` (each node once), in ``victim``'s order, whose extent is ``sizes[j]`` bytes. Returns (rows,
    their offsets as uint64, j of each), the rows PENDING from now on; ``ks`` is left holding what each node
    still lacks. The queues' windows are read from their copy (``QueueCopy``) as one 2-D array, nodes by
    position, and checked at once (READY, unpinned, its queued stamp); a node stops at its first victim that
    cannot hand over (another size, a young generation: the caller's ``make_room`` takes it next) or when it
    has none left. Plain LRU without reservations only (the caller's test): prefix-lru's order moves as victims
    leave, a reservation passes over rows. O(nodes) Python steps and O(nodes x window) numpy a round; another
    round only where a window held stale entries or a queue ran out (refilled in between)."""
    c = t.cols
    state, pins, stamp, gen = c["state"], c["pins"], c["stamp"], c["gen"]
    young = t.quarantine.young_gen
    young = np.uint64(young) if young < 1 << 63 else None  # None: no generation is young
    ext = t.qcopy.extents(t.code_arr)
    one = len(set(sizes)) == 1 and bool((ext == sizes[0]).all())  # every row's extent is the size wanted
    live = [j for j, k in enumerate(ks) if k > 0]
    fresh: set[int] = set()  # nodes just refilled: a fresh queue used up without a victim has none left
    out_r, out_j = [], []
    qc = t.qcopy
    for _ in range(8):  # a round takes what each window holds; more only for stale windows and refills
        if not live:
            break
        ln = [nodes[j] for j in live]
        pos0, avail, base, need, want = np.array([(n.qpos, len(n.queue), n.qbase, ks[j], sizes[j])
                                                  for j, n in zip(live, ln)], np.int64).reshape(-1, 5).T
        avail = avail - pos0
        if not avail.all():  # queues used up: refilled (a fresh one used up without a victim: none left)
            for x in np.flatnonzero(avail == 0).tolist():
                j = live[x]
                if j not in fresh:
                    refill(t, nodes[j])
                    fresh.add(j)
            live = [j for j in live if nodes[j].qpos < len(nodes[j].queue)]
            continue
        w = int(min(int(need.max()) * 5 // 4 + 8, int(avail.max())))
        col = np.arange(w)
        inside = col < avail[:, None]
        idx = np.where(inside, (base + pos0)[:, None] + col, 0)
        rows = qc.rows.take(idx)
        ok = inside & (state.take(rows) == READY) & (pins.take(rows) == 0) & (stamp.take(rows) == qc.keys.take(idx))
        first = col < need[:, None]
        if one and young is None and bool((need <= avail).all()) and bool((ok | ~first).all()):
            # the common case: each window's first ``need`` entries are valid victims that hand over (every
            # node done this round)
            out_r.append(rows[first])
            out_j.append(np.repeat(np.array(live, np.int64), need))
            state[out_r[-1]] = PENDING  # taken now: a refill must not see them
            for j, n, k in zip(live, ln, need.tolist()):
                n.qpos += k
                ks[j] = 0
            break
        if one and young is None:  # every valid victim hands over
            misfit = np.zeros(len(live), bool)
            stop, good = 0, ok
        else:
            fits = np.ones(rows.shape, bool) if one else ext.take(c["size"].take(rows)) == want[:, None]
            if young is not None:
                fits &= gen.take(rows) < young
            bad = ok & ~fits
            misfit = bad.any(1)
            stop = np.where(misfit, bad.argmax(1), w)
            good = ok & (col < stop[:, None])
        take = good & (np.cumsum(good, 1) <= need[:, None])
        got = take.sum(1)
        left = need - got
        last = w - take[:, ::-1].argmax(1)  # one past the last taken (read only where the node is done)
        qpos = np.where(left == 0, pos0 + last, pos0 + np.where(misfit, stop, np.minimum(w, avail)))
        if got.any():
            out_r.append(rows[take])
            out_j.append(np.array(live, np.int64).take(np.nonzero(take)[0]))
            state[out_r[-1]] = PENDING  # taken now: a refill must not see them
        keep = []
        for j, n, p, k, mf, g in zip(live, ln, qpos.tolist(), left.tolist(), misfit.tolist(), got.tolist()):
            n.qpos = p
            ks[j] = k
            if k and not mf:
                keep.append(j)
                if g:
                    fresh.discard(j)
        live = keep
    if not out_r:
        z = np.zeros(0, np.int64)
        return z, z.astype(np.uint64), z
    rows = out_r[0] if len(out_r) == 1 else np.concatenate(out_r)
    t._evicted_rows.append(rows)  # unfiled with the request's other victims (``_evicted_now``)
    t.evictions += len(rows)
    return rows, c["unit"].take(rows).astype(np.uint64) << np.uint64(12), np.concatenate(out_j)

def make_room(t, node: NodeRows, size: int) -> tuple[int | None, int]:
    """Evict the node's least recently used pages until ``size`` bytes fit: (offset, row to reuse or -1), or
    (None, -1) when nothing more can go. A victim of exactly ``size`` bytes hands over its extent and its row
    as they are (no allocator round trip), unless its generation is young: the quarantine holds that extent."""
    young = t.quarantine.young_gen
    gen = t.cols["gen"]
    while True:
        i = victim(t, node)
        if i < 0:
            return None, -1
        r, vns, voff = node.queue[i], node.qns[i], node.qoff[i]
        t._evicted_now[r] = vns  # unfiled at the end of the request, before its new rows are filed
        t.evictions += 1
        vsize = extent_size(node.qcode[i])
        if t.links.linking:  # its parent's tier now, for the next victim (metaserver/table/links.py); after
            t.links.evicted(r)  # the reads: it may queue the parent in slot i
        g = int(gen[r])
        if vsize == size and g < young:
            return voff, r
        until = t.quarantine.free(node, voff, vsize, g)
        if until and t.quota is not None:
            t.quota.held(vns, vsize, until)
        t._free_row(r, node)
        off = node.alloc.alloc(size)
        if off is not None:
            return off, -1


class QueueCopy:
    """Every node's eviction queue (rows and their queued keys) also as numpy, each node's at ``qbase`` of two flat
    arrays, so ``handover`` reads many nodes' windows with one gather. Written at each refill: in place when it fits
    the node's region, else at the end; when the end is reached the live regions are moved together into arrays of
    twice their size. Plain LRU only (prefix-lru inserts into the lists). 16 B an entry: the queues' total (about
    1/64 of the rows, at least ``CANDIDATES`` a node) times at most 4."""

    __slots__ = ("rows", "keys", "end", "owners", "_codes", "_ext")

    def __init__(self):
        self.rows = np.zeros(0, np.int64)
        self.keys = np.zeros(0, np.uint64)
        self.end = 0  # the flat arrays' used length
        self.owners: list[NodeRows] = []  # nodes with a region
        self._codes = self._ext = None

    def extents(self, code_arr: np.ndarray) -> np.ndarray:
        """``extents_of(code_arr)``, kept while the table's code array is the same object (it is replaced when a
        code is interned)."""
        if self._codes is not code_arr:
            self._codes, self._ext = code_arr, extents_of(code_arr).astype(np.int64)
        return self._ext

    def put(self, node: NodeRows, rows: np.ndarray, keys: np.ndarray) -> None:
        n = len(rows)
        if n > node.qcap:
            if not node.qcap:
                self.owners.append(node)
            node.qcap = 0  # its old region is left behind
            if self.end + n > len(self.rows):
                self._compact(n)
            node.qbase, node.qcap = self.end, n
            self.end += n
        self.rows[node.qbase:node.qbase + n] = rows
        self.keys[node.qbase:node.qbase + n] = keys

    def _compact(self, n: int) -> None:
        """Room for ``n`` more at the end: the live regions moved together into arrays of twice what they and ``n``
        need (retired nodes' regions dropped)."""
        self.owners = [x for x in self.owners if x.ix is not None]
        live = sum(x.qcap for x in self.owners)
        rows = np.zeros(max(2 * (live + n), 4096), np.int64)
        keys = np.zeros(len(rows), np.uint64)
        at = 0
        for x in self.owners:
            if x.qcap:
                rows[at:at + x.qcap] = self.rows[x.qbase:x.qbase + x.qcap]
                keys[at:at + x.qcap] = self.keys[x.qbase:x.qbase + x.qcap]
                x.qbase = at
                at += x.qcap
        self.rows, self.keys, self.end = rows, keys, at


def least(key: np.ndarray, k: int) -> np.ndarray:
    """The positions of the ``k`` least of ``key`` in order (ties: by position), as a stable argsort's first ``k``.
    A refill keeps 1/32 to 1/64 of a node's rows: a threshold from a strided sample of about 4k keys (its quantile a
    little above k/n, so at least ``k`` keys pass it unless the sample misleads: then the exact k-th value) and a sort
    of the keys that pass, instead of an argpartition of all n (at 31k keys 0.28 ms, most of a refill)."""
    n = len(key)
    step = n // (4 * k) if k else 0
    cand = None
    if step > 1:
        sample = key[::step]
        j0 = len(sample) * k / n
        j = int(j0 * 1.25 + 3 * j0 ** 0.5) + 8
        if j < len(sample):
            cand = np.flatnonzero(key <= np.partition(sample, j)[j])
    if cand is None or len(cand) < k:
        if k >= n:
            return np.argsort(key, kind="stable")[:k]
        cand = np.flatnonzero(key <= np.partition(key, k - 1)[k - 1])
    return cand.take(np.argsort(key.take(cand), kind="stable")[:k])


def extents_of(codes: np.ndarray) -> np.ndarray:
    """``entry.extent_size`` of each layout code (uint64 in, uint64 out)."""
    n = codes >> np.uint64(SHARD_SHIFT)
    a = np.uint64(ALIGN)
    one = (np.uint64(OBJ_HEADER_SIZE) + (codes & np.uint64(PART_MASK)) + a - np.uint64(1)) // a * a
    return np.where(n == 0, one, n * one)


def over_high(used: int, capacity: int, high: float) -> bool:
    """Watermarks: a node (or the pool) above ``high`` of its capacity starts a background eviction pass ..."""
    return capacity > 0 and used > high * capacity


def bytes_to_low(used: int, capacity: int, low: float) -> int:
    """... which frees the bytes from ``used`` down to the low watermark (0 when already below)."""
    return max(0, used - int(low * capacity))
