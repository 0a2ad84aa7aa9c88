"""The invariant check of the columnar page table ``t`` (``metaserver.table.columns.PageTable``, whose class docstring
states the invariants; ``PageTable.check`` calls it): a function over the table, as it only reads it. For tests and
debugging: O(rows) numpy plus a Python step per node, lease and record."""

from __future__ import annotations

import numpy as np

from metaserver.table.entry import GONE, PENDING, READY, extent_size
from metaserver.table.nodes import FREE


def check(t) -> None:
    """Verify the invariants of ``PageTable``'s docstring on ``t``; AssertionError naming the first one broken."""
    c = t.cols
    block = t.block
    top = t.blocks_used * block
    state = c["state"][:top]
    live = np.flatnonzero((state == PENDING) | (state == READY))
    t.ix.check(live, c["ns"])
    t.links.check()  # prefix links (metaserver/table/links.py)
    assert sorted(t._pending) == np.flatnonzero(state == PENDING).tolist(), "columns: pending rows differ"
    want = np.zeros(top, np.int64)
    for lease, (hr, _) in t.leases.items():
        sl = t.sliced.get(lease)
        np.add.at(want, hr if sl is None else sl.rows_held(hr), 1)
    assert set(t.sliced) <= set(t.leases), "columns: slices of a lease that is gone"
    assert all(sl.left == sum(sl.held) > 0 for sl in t.sliced.values()), "columns: a lease's slices miscounted"
    assert np.array_equal(want, c["pins"][:top].astype(np.int64)), "columns: pins and leases disagree"
    assert not np.any((state == GONE) & (c["pins"][:top] == 0)), "columns: an unpinned GONE row kept its extent"
    ready = np.flatnonzero(state == READY)
    rec = c["rec"][ready]
    for rid in np.unique(rec[rec != 0]).tolist():
        r = t.commits.records.get(rid)
        assert r is not None and not r.dead, f"columns: rows name record {rid}, which is gone"
        assert np.isin(ready[rec == rid], r.rows).all(), f"columns: a row of record {rid} is not in its rows"
    owned = [b for node in t.nodes if node is not None for b in node.blocks]
    assert sorted(owned + t.free_blocks) == list(range(t.blocks_used)), "columns: a block lost or shared"
    for b in t.free_blocks:
        assert np.all(state[b * block:(b + 1) * block] == FREE), "columns: a free block holds a row"
    for node in t.nodes:
        if node is None:
            continue
        rows = t._rows_of(node)
        st = c["state"][rows]
        assert np.all(c["node"][rows[st != FREE]] == node.ix), f"columns: {node.node_id} owns another's row"
        free = rows[st == FREE]
        assert sorted(node.free) == sorted(free.tolist()), f"columns: {node.node_id}'s free list is wrong"
        if node.dead:  # its allocator went with its arena; a drained one holds no READY row
            assert not (node.drained and np.any(st == READY)), f"columns: dropped {node.node_id} kept a page"
            assert not np.any(st == PENDING), f"columns: detached {node.node_id} kept a PENDING row"
            continue
        held = rows[st != FREE]
        used = sum(extent_size(code) for code in t.code_arr[c["size"][held]].tolist())
        used += sum(size for _off, size in t.quarantine.extents(node))
        used += sum(size for _off, size in t.tiers.inflight_extents(node))  # moves' destinations
        assert used == node.alloc.used, f"columns: {node.node_id} allocator holds {node.alloc.used}, rows {used}"
