"""The node side of the page table, as functions of a ``metaserver.table.columns.PageTable`` (``t``): nodes added and
drained, and a lost node detached at once and dropped in budgeted slices. The node state stays on the table
(``nodes``, ``node_by_id``, ``placing``, ``dead``, ``dying``, the free blocks and node indexes); the rows of a node's
blocks are ``PageTable._rows_of``. No I/O.

Loss (the service's ``detach_space`` then ``drop_slice``, ``metaserver/handlers/rejoin.py``): ``detach_node`` takes the
node out of placement, drops its PENDING rows (O(all PENDING)) and from then on LOOKUP misses its pages (a mask over
the node column, applied only while some node is dying); ``drop_rows`` then unfiles its READY rows ``budget`` rows at a
time, in row order, as numpy work over a slice of its blocks: an unpinned row goes back to the free list, a pinned
one stays GONE (a zombie) until its last lease lets go, and with ``park`` every dropped page's record comes back (the
metaserver keeps those in etcd for the node's return). EXISTS may count the node's pages until their slice drops
them; an ALLOC that meets one drops it on the spot and places the key anew.

Reuse: a drop that is done, and whose zombies are all released, hands the node's row blocks to a free list that
any node takes before the columns grow, and its node index to the next node added, so node churn grows neither the
columns nor the u16 node column.

Costs: ``add_node`` O(nodes); ``drain_rows`` O(the node's rows) numpy work and an allocator rebuild; ``detach_node``
O(PENDING rows); ``drop_rows`` O(budget) numpy work plus a Python step per dropped page when parking (its record);
a release that frees a dead node's zombie O(that node's rows) numpy work, to see whether it can be retired.
"""

from __future__ import annotations

import numpy as np

from metaserver.table.allocator import Allocator
from metaserver.table.entry import GONE, READY
from transport import objformat
from umbp.errors import ConfigError

UNIT_SHIFT = 12  # offsets are multiples of the allocator's 4 KiB unit: the unit column holds offset >> 12
FREE = 3  # a row's state on its node's free list (beside entry.PENDING, READY, GONE)


class NodeRows:
    """One node: its arena allocator, its row blocks, its free rows and its eviction candidates."""

    __slots__ = ("ix", "node_id", "alloc", "blocks", "free", "queue", "qstamp", "qoff", "qcode", "qns", "qpos",
                 "qbase", "qcap", "placeable", "dead", "parked", "dpos", "drained")

    def __init__(self, ix: int, node_id: str, base: int, size: int):
        self.ix: int | None = ix  # None once retired
        self.node_id = node_id
        self.placeable = True
        self.dead = False  # detached: lost, its READY rows dropped in slices
        self.parked: list | None = None  # the records its drop keeps, when it parks them
        self.dpos = 0  # rows of its blocks its drop has visited
        self.drained = False
        self.alloc = Allocator(base, size, track=False)  # the part of the arena this table places in
        self.blocks: list[int] = []
        self.free: list[int] = []  # free rows, taken from the end
        self.queue: list[int] = []  # eviction candidates, oldest first
        self.qstamp: list[int] = []  # the stamp each had when queued
        self.qoff: list[int] = []  # and its offset, layout code and namespace (unchanged while its stamp is)
        self.qcode: list[int] = []
        self.qns: list[int] = []
        self.qpos = 0
        self.qbase = self.qcap = 0  # its queue's region in the table's copy (evict.QueueCopy)


def add_node(t, node_id: str, capacity: int) -> None:
    """A registered node with an empty arena of ``capacity`` bytes, placeable. A node id may come back while its
    previous incarnation still drains (a new index; the old one's rows stay hidden until dropped)."""
    if node_id in t.node_by_id:
        raise ConfigError("columns", f"node {node_id!r} already has rows")
    if objformat.ARENA_DATA_START + capacity > 1 << (32 + UNIT_SHIFT):
        raise ConfigError("columns", f"node {node_id!r}: an arena of {capacity} bytes is past the 16 TiB a u32 "
                                     "offset column of 4 KiB units addresses")
    if t.free_node_ix:
        ix = t.free_node_ix.pop()
    elif len(t.nodes) < np.iinfo(np.uint16).max:
        ix = len(t.nodes)
        t.nodes.append(None)
    else:
        raise ConfigError("columns", "too many nodes for a u16 node column")
    node = NodeRows(ix, node_id, *t.node_region(capacity))
    t.nodes[ix] = node
    t.node_by_id[node_id] = node
    t.node_names = np.array([n.node_id if n is not None else None for n in t.nodes] + [None],
                            object)[:-1]  # 1-d even for one node
    t.dead = np.zeros(len(t.nodes), bool)
    for d in t.nodes:
        if d is not None and d.dead:
            t.dead[d.ix] = True
    update_placing(t)
    t.tiers.renamed()


def set_placeable(t, node_id: str, placeable: bool) -> None:
    node = t.node_by_id.get(node_id)
    if node is not None:
        node.placeable = placeable
        update_placing(t)


def update_placing(t) -> None:
    """The table's ``placing`` (placeable live nodes, in index order) and ``placing_min`` again, after a change."""
    t.placing = [n for n in t.nodes if n is not None and n.placeable and not n.dead]
    t.placing_min = min((n.alloc.capacity for n in t.placing), default=0)  # what any of them can hold


def drain_rows(t, node_id: str) -> tuple[int, int]:
    """Stop placing on ``node_id`` and drop its unpinned READY pages (an operator's drain before maintenance).
    Returns (dropped, pinned: READY pages kept because a reader holds them); PENDING rows stay until committed
    (a later drain drops them) or expired. O(its rows) numpy work, plus its allocator rebuilt from the rows left
    (``Allocator.rebuild_columns``)."""
    node = t.node_by_id.get(node_id)
    if node is None:
        return 0, 0
    node.placeable = False
    update_placing(t)
    c = t.cols
    state = c["state"]
    rows = t._rows_of(node)
    ready = rows[state.take(rows) == READY]
    held = c["pins"].take(ready) > 0
    drop = ready[~held]
    if len(drop):
        t.commits.leaving(drop)
        t.ix.delete(drop, c["ns"].take(drop).astype(np.uint64))
        state[drop] = FREE
        node.free.extend(drop.tolist())
        keep = rows[state.take(rows) != FREE]
        extents = t.code_extents()
        waiting = t.quarantine.extents(node)  # freed young: still allocated until their hold ends
        waiting += t.tiers.inflight_extents(node)  # and the destinations of moves in flight
        node.alloc.rebuild_columns(t.offsets_of(keep) + [off for off, _ in waiting],
                                   extents.take(c["size"].take(keep)).tolist() + [size for _, size in waiting])
    return len(drop), int(np.count_nonzero(held))


def detach_node(t, node_id: str, park: bool = False) -> int:
    """First step of dropping a lost node: it is placed on no more, LOOKUP misses its pages and its PENDING rows
    go now; its READY rows wait for ``drop_rows``. A drop of the same node id still under way is finished
    first (``TableDirectory`` finishes it through its own ``drop_slice`` before this). ``park``: ``drop_rows``
    returns each dropped page's record. Returns the rows dropped now."""
    n = 0
    if node_id in t.dying:
        n += drop_rows(t, node_id, 1 << 62)[0]
    node = t.node_by_id.pop(node_id, None)
    if node is None:
        return n
    node.dead = True
    node.placeable = False
    node.parked = [] if park else None
    t.dead[node.ix] = True
    t.dying[node_id] = node
    update_placing(t)
    c = t.cols
    gone = [r for r in t._pending if c["node"][r] == node.ix]
    for r in gone:
        del t._pending[r]
        t._free_row(r, node)
    if gone:
        rows = np.array(gone, np.int64)
        t.ix.delete(rows, c["ns"].take(rows).astype(np.uint64))
    return n + len(gone)


def drop_rows(t, node_id: str, budget: int) -> tuple[int, list | None]:
    """Drop the READY rows among the next ``budget`` rows of a detached node. Returns (pages dropped, None while
    rows remain | once done, the parked records ``(ns, key, offset, payload_len, gen, stamp, record name,
    parent key)``,
    oldest first, or [] without ``park``). Parked rows leave their commit records as they are (not rewritten
    without them: the node may come back)."""
    node = t.dying.get(node_id)
    if node is None:
        return 0, []
    c = t.cols
    state, pins = c["state"], c["pins"]
    end = len(node.blocks) * t.block
    dropped = 0
    while budget > 0 and node.dpos < end:
        b, at = divmod(node.dpos, t.block)
        lo = node.blocks[b] * t.block + at
        hi = lo + min(budget, t.block - at)
        rows = np.flatnonzero(state[lo:hi] == READY) + lo
        budget -= hi - lo
        node.dpos += hi - lo
        if not len(rows):
            continue
        dropped += len(rows)
        if node.parked is not None:  # parked: their records stay in etcd as they are, for the node's return
            node.parked.extend(parked_records(t, rows))
            c["rec"][rows] = 0
            t.links.leaving(rows)  # links undone, KV events told (metaserver/table/links.py)
        else:
            t.commits.leaving(rows)
        t.ix.delete(rows, c["ns"].take(rows).astype(np.uint64))
        held = pins.take(rows) > 0
        state[rows[held]] = GONE
        free = rows[~held]
        state[free] = FREE
        node.free.extend(free.tolist())
    if node.dpos < end:
        return dropped, None
    del t.dying[node_id]
    node.drained = True
    parked = node.parked if node.parked is not None else []
    node.parked = None
    retire_if_done(t, node)
    parked.sort(key=lambda rec: rec[5])
    return dropped, parked


def parked_records(t, rows: np.ndarray) -> list[tuple]:
    """The parked records of ``rows``: (ns, key, offset, payload_len, gen, stamp, the etcd key of its commit
    record or None, the parent key it names or None), read before its links are undone, so a node that comes
    back links its pages again (prefix-lru; lru keeps no parents)."""
    c = t.cols
    recs = t.commits.records
    return list(zip([t.ns_names[i] for i in c["ns"].take(rows).tolist()],
                    [t.ix.key_of(r) for r in rows.tolist()],
                    t.offsets_of(rows),
                    t.code_arr.take(c["size"].take(rows)).tolist(),
                    c["gen"].take(rows).tolist(), c["stamp"].take(rows).tolist(),
                    [recs[i].name if i else None for i in c["rec"].take(rows).tolist()],
                    t.links.parent_keys(rows)))


def retire_if_done(t, node) -> None:
    """Retire a dead node whose drop is done once no row of it is in use (a zombie's last lease may still hold
    one): its blocks and its index go back for reuse. O(its rows) numpy work; called when its drop ends and
    when a lease lets go of one of its zombies (rare: leases held across a node's loss)."""
    if not node.drained or node.ix is None:
        return
    if np.any(t.cols["state"].take(t._rows_of(node)) != FREE):
        return
    t.free_blocks.extend(node.blocks)
    node.blocks = []
    node.free = []
    t.nodes[node.ix] = None
    t.dead[node.ix] = False
    t.free_node_ix.append(node.ix)
    node.ix = None
