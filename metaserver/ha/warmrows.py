"""Row work of a warm standby's copy on the columnar table (``metaserver/ha/standby.py``): pages filed into a live node
as a watch delivers them, rows dropped, a node's pages read back, the rows a rewritten commit record no longer
holds. No I/O; nothing here writes etcd (a standby never does).

Where it differs from the full load (``tableload.load_pages``, which rebuilds an empty node's allocator from all
its pages at once): ``file_rows`` files into a node that holds pages already, each extent reserved exactly where the
leader placed it (``Allocator.reserve``), in the order given; an extent that is not free (the batch writer's race:
a put that reached etcd before the delete of the page whose extent it reuses) or out of range is refused and its
page comes back to the caller, which holds it. The rows' stamps are their records' revisions, as the full load's
are, so recency is commit order whenever a page arrives (late ones included).

Invariants kept: a row filed here is READY, unpinned, in the key index once, its extent allocated on its node and,
when it came from a commit record, filed under that record's ``TableRecord`` by name (``CommitRecords.adopt``), exactly
as the full load files it. The copy never holds a PENDING row, a pin, a read lease or a quarantined extent.

Costs (n pages): ``file_rows`` O(n) numpy work (digests, one pass for runs of adjacent extents) plus one
``reserve`` a run of adjacent extents (a COMMIT's pages are placed one after another: one call for the lot) and a
Python step per distinct layout code; ``drop_rows`` one allocator free per row and numpy work; ``node_pages``
O(the node's rows) numpy plus a key per READY row.
"""

from __future__ import annotations

import numpy as np

from metaserver.table.entry import READY, extent_size
from transport.keyform import digests
from metaserver.table.load import UNIT, _namespaces, _take_rows, fill_ready
from metaserver.table.nodes import UNIT_SHIFT, NodeRows


def file_rows(t, node: NodeRows, ns: list[str], keys: list[bytes], offsets: list[int], codes: list[int],
              gens: list[int], names: list, stamps: list[int], parents: list) -> list[int]:
    """File READY pages of ``node`` (keys absent from the table and distinct: the caller checked), in the order
    given, each at its offset: its extent reserved as it is (``Allocator.reserve``), under commit record
    ``names[i]`` (None: a page record of its own), stamped ``stamps[i]`` (its record's revision), linked to parent
    key ``parents[i]`` under prefix-lru (``TableLinks.loaded``, as the full load links its rows). Returns the
    positions refused (extent not free, outside the node's region, unaligned, or a layout code the table cannot
    hold), ascending; they change nothing."""
    n = len(keys)
    if not n:
        return []
    off = np.asarray(offsets, np.int64)
    code = np.asarray(codes, np.int64)
    cix = np.empty(n, np.int64)
    size = np.empty(n, np.int64)
    for lc in np.unique(code).tolist():
        at = code == lc
        ix = t._code(lc) if lc >= 0 else None
        cix[at] = -1 if ix is None else ix
        size[at] = extent_size(lc) if lc >= 0 else 0
    ok = (cix >= 0) & (size > 0) & ((off & (UNIT - 1)) == 0)
    # Runs of extents that follow one another (the leader placed a COMMIT's pages so): reserved as one when the
    # allocator keeps no record of each (it ends as reserving each in turn does); a run that fails, each on its own.
    reserve = node.alloc.reserve
    end = off + size
    cut = np.flatnonzero((off[1:] != end[:-1]) | ~ok[1:] | ~ok[:-1]) + 1
    whole = node.alloc.tracks_nothing
    for lo, hi in zip(np.concatenate(([0], cut)).tolist(), np.concatenate((cut, [n])).tolist()):
        if not ok[lo]:
            continue
        if whole and hi - lo > 1 and reserve(int(off[lo]), int(end[hi - 1] - off[lo])):
            continue
        for i in range(lo, hi):
            if not reserve(int(off[i]), int(size[i])):
                ok[i] = False
    keep = np.flatnonzero(ok)
    m = len(keep)
    if m:
        every = m == n
        rows = _take_rows(t, node, m)
        c = t.cols  # a new block may have grown (replaced) the columns
        nsix, _ = _namespaces(t, ns, n)
        st = np.asarray(stamps, np.uint64)
        g = np.asarray(gens, np.uint64)
        fill_ready(c, rows, node.ix, (off if every else off[keep]) >> UNIT_SHIFT, cix if every else cix[keep],
                   g if every else g[keep], nsix if every else nsix[keep])
        c["stamp"][rows] = st if every else st[keep]
        t.clock = max(t.clock, int(st.max()) + 1)
        kept = keys if every else [keys[i] for i in keep.tolist()]
        dig, longs = digests(kept)
        t.ix.insert(rows, dig, c["ns"], longs)
        if t.links.linking:
            t.links.loaded(c["ns"].take(rows), rows, parents if every else [parents[i] for i in keep.tolist()])
        names = names if every else [names[i] for i in keep.tolist()]
        by = t.commits.by_name
        for name in set(names):
            rec = by.get(name)
            if rec is not None:  # its rows that left are forgotten first: one may be reused here, listed once
                rec.live()
        t.commits.adopt(names, rows, [])
    return np.flatnonzero(~ok).tolist()


def drop_rows(t, rows: np.ndarray) -> None:
    """Take READY, unpinned ``rows`` (distinct) out of the table: extents back to their nodes, rows back on their
    free lists, keys unfiled; their commit records lose them (a rewrite is queued: the caller discards it, the
    leader wrote it already)."""
    if not len(rows):
        return
    c = t.cols
    t.commits.leaving(rows)
    t.ix.delete(rows, c["ns"].take(rows).astype(np.uint64))
    nodes = t.nodes
    node_col = c["node"]
    for r in rows.tolist():
        node = nodes[node_col[r]]
        t._free_extent(r, node)
        t._free_row(r, node)


def node_pages(t, node: NodeRows) -> list[tuple]:
    """The node's READY pages as ``(stamp, ns, key, offset, payload_len, gen, parent key or None, record name or
    None)``, oldest first (what a copy holds while the node is remade)."""
    c = t.cols
    rows = t._rows_of(node)
    rows = rows[c["state"].take(rows) == READY]
    rows = rows[np.argsort(c["stamp"].take(rows), kind="stable")]
    recs = t.commits.records
    names = t.ns_names
    return list(zip(c["stamp"].take(rows).tolist(), [names[i] for i in c["ns"].take(rows).tolist()],
                    [t.key_of(r) for r in rows.tolist()], t.offsets_of(rows),
                    t.code_arr.take(c["size"].take(rows)).tolist(), c["gen"].take(rows).tolist(),
                    t.links.parent_keys(rows), [recs[i].name if i else None for i in c["rec"].take(rows).tolist()]))


def leaving_record(t, rec, keep: set[tuple[bytes, int]] | None) -> np.ndarray:
    """The rows commit record ``rec`` holds that its rewrite no longer lists (``keep``: the (key, gen) of the pages
    it lists; None: deleted, all of them)."""
    rows = rec.live()
    if not keep or not len(rows):
        return rows
    pairs = list(keep)
    ns = t.ns_names[int(t.cols["ns"][rows[0]])]  # (a record made empty by a load has no namespace of its own)
    found = t._find(ns, [k for k, _ in pairs])
    hit = found >= 0
    same = found[hit][t.cols["gen"].take(found[hit]) == np.array([g for _, g in pairs], np.uint64)[hit]]
    return rows[~np.isin(rows, same)]

