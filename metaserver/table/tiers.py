"""The disk tier in the page table (issue 47): pages demoted to a node's NVMe file instead of dropped, and promoted
back into DRAM when they are read again. No I/O: the service sends the node its copies (``metaserver/ha/tiering.py``).

A node started with ``--disk`` has a twin in the table: a node of its own, id ``{node_id}/disk`` (``/`` never appears
in a node id, so no registered node can be called that), whose allocator is the disk file's data region and whose
rows are the pages on that disk. A row's tier is therefore its ``node`` column, and everything the table does per
node holds per tier: capacity and use, exact LRU (the twin's watermark pass is the disk tier's own eviction), loss,
parking and return, commit records (a twin's pages name the twin in their segments, so a takeover's full load files
them back under it). The twin is never placeable: only a move puts a page on it. A LOOKUP answers a twin's rows as
its host's, their offsets with ``objformat.DISK_BIT`` set (``answer``), so a client reads them with READV_DISK and the
read capability names the disk address: a DRAM grant never reads the disk, nor a disk grant DRAM.

A move (demotion: DRAM -> disk, promotion: disk -> DRAM) is two steps around the node's copy:
``plan_demote``/``plan_promote`` pick the rows, allocate their extents on the other tier and pin them under a lease
of the mover's (so no eviction takes them meanwhile, and a lease that runs out ends the move); ``finish`` takes the
node's answer: each row copied whose source is still the same READY page under that lease becomes a new row on the
other tier (same key, tag and stamp; the generation the copy's header carries), filed in the key index and a commit
record in place of the source, which leaves as a removed page does (GONE while pinned; its extent back through the
write quarantine once the mover's lease lets go). The other rows give their new extents back (nobody was granted
them). Never wrong bytes: the copy's header lands last on the node and is checked against its row before the row
moves; a page read at its old place after a move finds the old extent's header (the same object until that extent
is reused, then another generation or tag: a miss), as after an eviction.

Demotion picks victims in the host's eviction order (``evict.victim``: exact LRU or prefix-lru's order) and makes room
on the twin by evicting the twin's own least recently used pages: what leaves the pool is the oldest page on disk,
not the oldest in DRAM. A put never waits for a move: ALLOC still evicts (drops) when DRAM is full before the mover
caught up.

Costs: a plan O(rows) Python (the victims one at a time, as an eviction), a finish O(rows) numpy plus a row taken
a page; the answer mapping two gathers over the batch's node indexes when some node has a disk.
"""

from __future__ import annotations

import time

import numpy as np

from metaserver.table.entry import GONE, READY, extent_size
from metaserver.table.evict import victim
from metaserver.table.nodes import UNIT_SHIFT, NodeRows, add_node, set_placeable
from transport import answerrows, objformat

SUFFIX = "/disk"
BASE = ("node", "unit", "size", "gen", "stamp", "state", "ns", "tag")  # the columns a moved page keeps (not its
# pins, record or links: ``_swap`` sets those)
PROMOTE_SEEN = 4096  # disk rows remembered as read since the last promotion pass, at most


def twin_id(node_id: str) -> str:
    return node_id + SUFFIX


class Move:
    """Rows on their way to the other tier: see the module docstring. ``rows`` the sources (int64), ``offs`` their
    extents on the destination, ``gens`` the generation each source has and ``regen`` the one its copy gets."""

    __slots__ = ("lease", "host", "to_disk", "src", "dst", "rows", "offs", "sizes", "src_offs", "gens", "regen",
                 "tags", "lens")

    def __init__(self, lease: int, host: str, to_disk: bool, src: NodeRows, dst: NodeRows, rows: np.ndarray,
                 offs: list[int], sizes: list[int], table):
        c = table.cols
        self.lease = lease
        self.host = host
        self.to_disk = to_disk
        self.src, self.dst = src, dst
        self.rows = rows
        self.offs = offs
        self.sizes = sizes
        self.src_offs = table.offsets_of(rows)
        self.gens = c["gen"].take(rows)
        self.regen = self.gens.copy()  # the service sets fresh ones for a promotion into a closed pool's DRAM
        self.tags = c["tag"].take(rows)
        self.lens = table.code_arr.take(c["size"].take(rows))

    def tier_rows(self) -> bytes:
        """The DEMOTE/PROMOTE request's rows (``answerrows.pack_tier_rows``): each page's tag, generation, length, DRAM
        and disk offsets, and the generation of its copy when that differs (0: the same)."""
        dram, disk = (self.src_offs, self.offs) if self.to_disk else (self.offs, self.src_offs)
        regen = np.where(self.regen != self.gens, self.regen, 0)
        return answerrows.pack_tier_rows(self.tags, self.gens, self.lens, dram, disk, regen)

    def __len__(self) -> int:
        return len(self.rows)


class Tiers:
    """The table's twins and moves in flight: see the module docstring. Held by the table (``table.tiers``)."""

    def __init__(self, table):
        self.t = table
        self.disks: dict[str, int] = {}  # host node id -> its disk's capacity, as it registered
        self.moves: dict[int, Move] = {}  # lease -> move in flight
        self.seen: dict[int, None] = {}  # disk rows read since the last promotion pass (oldest first)
        self._parked: dict[str, list] = {}  # a lost node's DRAM pages' parked records while its disk's drop
        self.bits = np.zeros(0, np.uint64)  # by node index: DISK_BIT for a twin
        self.hosts = np.zeros(0, object)  # by node index: the id a LOOKUP answer names (a twin's host)
        self.demotions = self.promotions = self.failed_moves = 0

    # -- twins --------------------------------------------------------------------------------------------------
    @property
    def any(self) -> bool:
        return bool(self.disks)

    def twin(self, node_id: str) -> NodeRows | None:
        return self.t.node_by_id.get(twin_id(node_id))

    def moves_for(self, node: NodeRows) -> bool:
        """Whether the mover, not the watermark pass, makes room on ``node``: a node with a disk demotes, and a disk
        evicts its own oldest pages as demotions need the room (all of it is used: the tier is for keeping)."""
        return bool(self.disks) and (node.node_id in self.disks or node.node_id.endswith(SUFFIX))

    def add(self, node_id: str) -> None:
        """Add ``node_id``'s twin when it has a disk (``disks``) and no twin yet: never placeable."""
        cap = self.disks.get(node_id, 0)
        tid = twin_id(node_id)
        if cap and tid not in self.t.node_by_id:
            add_node(self.t, tid, cap)
            set_placeable(self.t, tid, False)

    def renamed(self) -> None:
        """The node list changed (``add_node``): rebuild the answer maps."""
        nodes = self.t.nodes
        live = {n.node_id: n.ix for n in nodes if n is not None and not n.dead}
        self.bits = np.zeros(len(nodes), np.uint64)
        self.hosts = np.arange(len(nodes), dtype=np.int64)
        for n in nodes:
            if n is not None and n.node_id.endswith(SUFFIX):
                self.bits[n.ix] = objformat.DISK_BIT
                self.hosts[n.ix] = live.get(n.node_id[:-len(SUFFIX)], n.ix)

    def answer(self, nix: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """A LOOKUP's hits as the answer shows them: each row's node index (``nix``) a twin's replaced by its
        host's, and the offsets (``slots[:, 0]``) of rows on twins marked ``DISK_BIT`` in place, so a disk page
        is its host's page at a disk address (one capability a host covers both tiers). The disk rows among
        ``rows`` are remembered for promotion (``read``). Returns the answer's node indexes."""
        bits = self.bits.take(nix)
        on = bits != 0
        if on.any():
            slots[:, 0] |= bits
            self.read(rows[on])
            return self.hosts.take(nix)
        return nix

    def read(self, rows: np.ndarray) -> None:
        """Remember ``rows`` (disk rows a LOOKUP hit) as candidates for promotion, the PROMOTE_SEEN latest."""
        seen = self.seen
        for r in rows.tolist():
            seen.pop(r, None)
            seen[r] = None
        while len(seen) > PROMOTE_SEEN:
            del seen[next(iter(seen))]

    @staticmethod
    def hosts_of(node_ids) -> list[str]:
        """``node_ids`` with each twin's as its host's, once each (a node's drop continues into its disk's)."""
        return list(dict.fromkeys(n[:-len(SUFFIX)] if n.endswith(SUFFIX) else n for n in node_ids))

    def parked(self, node_id: str, recs: list) -> list | None:
        """A lost node's parked records as its drop finishes them: the DRAM pages' (``node_id`` its host's) are kept
        here and None returned while its twin's drop goes on; the twin's (their offsets marked ``DISK_BIT``) come
        back with them, all of the node's pages in one list."""
        if node_id.endswith(SUFFIX):
            return self._parked.pop(node_id[:-len(SUFFIX)], []) + recs
        self._parked[node_id] = recs
        return None

    def usage(self, node_id: str) -> dict:
        """The disk of ``node_id`` as a node map shows it: capacity, bytes held and pages (zeros without one)."""
        twin = self.twin(node_id)
        if twin is None:
            return {"disk_capacity_bytes": 0, "disk_used_bytes": 0, "disk_objects": 0}
        st = self.t.cols["state"].take(self.t._rows_of(twin))
        return {"disk_capacity_bytes": twin.alloc.capacity, "disk_used_bytes": twin.alloc.used,
                "disk_objects": int(np.count_nonzero(st == READY))}

    def totals(self) -> tuple[int, int, int, int]:
        """(DRAM capacity, DRAM used, disk capacity, disk used) over live nodes."""
        dc = du = kc = ku = 0
        for n in self.t.node_by_id.values():
            if n.node_id.endswith(SUFFIX):
                kc += n.alloc.capacity
                ku += n.alloc.used
            else:
                dc += n.alloc.capacity
                du += n.alloc.used
        return dc, du, kc, ku

    # -- moves --------------------------------------------------------------------------------------------------
    def plan_demote(self, host_id: str, nbytes: int, budget: int, now: float, owner: object = None) -> Move | None:
        """Up to ``budget`` of the host's least recently used READY unpinned pages, about ``nbytes`` of extents,
        with their extents on its twin (the twin's oldest pages evicted for room), pinned: a ``Move``, or None when
        there is nothing to move (no twin, nothing unpinned, a disk too small for the next victim)."""
        t = self.t
        host, twin = t.node_by_id.get(host_id), self.twin(host_id)
        if host is None or twin is None:
            return None
        rows: list[int] = []
        offs: list[int] = []
        sizes: list[int] = []
        freed = 0
        while freed < nbytes and len(rows) < budget:
            i = victim(t, host)
            if i < 0:
                break
            r, size = host.queue[i], extent_size(host.qcode[i])
            off = twin.alloc.alloc(size)
            if off is None:
                if size > twin.alloc.capacity:
                    continue  # never fits this disk: it stays in DRAM (and leaves by eviction)
                t.evict_node(twin, size, 64)  # the disk's own LRU makes room
                off = twin.alloc.alloc(size)
                if off is None:
                    break  # the disk's pages are pinned (being read): try again later
            t.cols["pins"][r] += 1  # pinned as it is picked: a queue refilled in this loop never offers it again
            rows.append(r)
            offs.append(off)
            sizes.append(size)
            freed += size
        return self._pin(host_id, True, host, twin, rows, offs, sizes, now, owner)

    def plan_promote(self, host_id: str, budget: int, now: float, owner: object = None, room: int = 1 << 62
                     ) -> Move | None:
        """Up to ``budget`` of the disk rows read lately (``read``) of ``host_id``'s twin that are still READY and
        unpinned, the most recent first, about ``room`` bytes of them, with DRAM extents where the host has room now
        (a promotion never evicts): a ``Move`` or None."""
        t = self.t
        host, twin = t.node_by_id.get(host_id), self.twin(host_id)
        if host is None or twin is None or not self.seen or not host.placeable:
            return None
        c = t.cols
        cand = np.fromiter(self.seen, np.int64, len(self.seen))
        mine = cand[(c["node"].take(cand) == twin.ix) & (c["state"].take(cand) == READY) & (c["pins"].take(cand) == 0)]
        rows: list[int] = []
        offs: list[int] = []
        sizes: list[int] = []
        for r in mine[::-1].tolist()[:budget]:  # the most recent reads first
            size = extent_size(t.codes[c["size"][r]])
            if size > room:
                break
            off = host.alloc.alloc(size)
            if off is None:
                break
            self.seen.pop(r, None)
            room -= size
            c["pins"][r] += 1
            rows.append(r)
            offs.append(off)
            sizes.append(size)
        return self._pin(host_id, False, twin, host, rows, offs, sizes, now, owner)

    def _pin(self, host_id: str, to_disk: bool, src: NodeRows, dst: NodeRows, rows: list, offs: list, sizes: list,
             now: float, owner: object) -> Move | None:
        if not rows:
            return None
        t = self.t
        hr = np.array(rows, np.int64)  # pinned already, one pin each: the lease holds them
        lease = t.new_lease(hr, False, now, owner)
        move = Move(lease, host_id, to_disk, src, dst, hr, offs, sizes, t)
        self.moves[lease] = move
        return move

    def finish(self, move: Move, failed: set[int], owner: object = None, keep_s: float = 0.0) -> int:
        """The node's answer to ``move``: row i copied unless i is in ``failed``. Each copied row whose source is
        still the same READY page under the move's lease moves to the other tier; every other destination extent
        goes back, at once when the node answered, else (``keep_s`` > 0: the request was sent and its answer lost,
        so the node may still write the copies until the request's deadline) kept out of placement that long.
        Returns how many pages moved."""
        t = self.t
        self.moves.pop(move.lease, None)
        c = t.cols
        rows = move.rows
        ok = np.ones(len(rows), bool)
        if failed:
            ok[[i for i in failed if 0 <= i < len(rows)]] = False
        if move.lease in t.leases and not move.dst.dead and not move.src.dead:
            ok &= (c["state"].take(rows) == READY) & (c["gen"].take(rows) == move.gens)
        else:
            ok[:] = False  # the lease ran out or a tier went with its node: the rows may be anything now
        q = t.quarantine
        for i in np.flatnonzero(~ok).tolist():
            if move.dst.dead:
                continue
            if keep_s > 0:
                q.keep(move.dst, move.offs[i], move.sizes[i], time.monotonic() + keep_s)
            else:
                move.dst.alloc.free(move.offs[i], move.sizes[i])
        src = rows[ok]
        n = len(src)
        if n:
            self._swap(move, src, np.flatnonzero(ok))
        t.release(move.lease, owner)  # the sources, GONE now, go back through the quarantine
        if move.to_disk:
            self.demotions += n
        else:
            self.promotions += n
        self.failed_moves += len(rows) - n
        return n

    def _swap(self, move: Move, src: np.ndarray, at: np.ndarray) -> None:
        """File a row on the destination in place of each source row (same key, tag, stamp and namespace; the
        copy's offset and generation), then let the sources leave as removed pages (GONE: the move's lease pins
        them)."""
        t = self.t
        c = t.cols
        dst = np.array([t._take_row(move.dst) for _ in range(len(src))], np.int64)
        for name in BASE:
            c[name][dst] = c[name].take(src)
        c["node"][dst] = move.dst.ix
        c["unit"][dst] = np.array([move.offs[i] >> UNIT_SHIFT for i in at.tolist()], np.uint32)
        c["gen"][dst] = move.regen.take(at)
        c["pins"][dst] = 0
        c["rec"][dst] = 0
        ix = t.ix
        dig = ix.kc[src].copy()
        longs = [(i, k) for i, k in enumerate(map(ix.long_keys.get, src.tolist())) if k is not None] \
            if ix.long_keys else []
        nsc = c["ns"].take(src)
        parents = t.links.parent_keys(src)  # read before the links are undone: the copy links under them again
        t.commits.leaving(src)
        ix.delete(src, nsc.astype(np.uint64))
        c["state"][src] = GONE
        ix.insert(dst, dig, c["ns"], longs)
        pend = t.links.pending
        for r, p in zip(dst.tolist(), parents):
            if p is not None:
                pend[r] = p
        for nsix in np.unique(nsc).tolist():
            t.commits.committed(t.ns_names[nsix], dst[nsc == nsix])

    def open_extents(self) -> list[tuple[str, int, int]]:
        """(node_id, offset, size) of every destination extent of a move in flight on a live node: a leader that
        gives up hands them on with its open allocations (``metaserver/ha/handoff.py``), since the node may still
        write its copy there after the next leader took over."""
        return [(m.dst.node_id, o, s) for m in self.moves.values() if not m.dst.dead
                for o, s in zip(m.offs, m.sizes)]

    def inflight_extents(self, node: NodeRows) -> list[tuple[int, int]]:
        """(offset, size) of the destination extents of moves in flight on ``node`` (held by no row yet)."""
        return [(o, s) for m in self.moves.values() if m.dst is node for o, s in zip(m.offs, m.sizes)]
