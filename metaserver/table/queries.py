"""Read-only queries of the page table ``t`` (``metaserver.table.columns.PageTable``): the totals and listings STATS,
LIST and PREFIX answer, as functions over the table: they read its columns and nodes and change nothing, so they need
no state of their own. The table keeps thin properties for the totals most callers read (``capacity``, ``used``,
``pending``, ``objects``) and ``TableDirectory.namespace_usage`` adds its quota groups'. No I/O.

Costs: ``prefix`` O(keys) numpy (one key index probe); ``capacity``, ``used``, ``pending`` O(nodes) or O(1);
``objects`` and ``namespace_usage`` O(rows) numpy (one pass over the state and namespace columns: about 10 ms a
million rows; no request keeps a counter of them); ``list_objects`` O(rows) numpy plus O(limit) Python.
"""

from __future__ import annotations

import numpy as np

from metaserver.table.entry import PENDING, READY, STATE_NAMES, extent_size
from metaserver.table.nodes import UNIT_SHIFT


def capacity(t) -> int:
    """DRAM bytes the live nodes place in (their disk tiers apart: ``tiers.totals``)."""
    if t.tiers.any:
        return t.tiers.totals()[0]
    return sum(n.alloc.capacity for n in t.node_by_id.values())


def used(t) -> int:
    if t.tiers.any:
        return t.tiers.totals()[1]
    return sum(n.alloc.used for n in t.node_by_id.values())


def open_extents(t) -> list[tuple[str, int, int]]:
    """(node_id, offset, extent size) of every PENDING row (``metaserver/ha/handoff.py``)."""
    c = t.cols
    return [(t.nodes[c["node"][r]].node_id, int(c["unit"][r]) << UNIT_SHIFT,
             extent_size(t.codes[c["size"][r]])) for r in t._pending]


def _live(t) -> tuple[np.ndarray, np.ndarray]:
    """(state, ns) columns of the rows in use so far."""
    top = t.blocks_used * t.block
    return t.cols["state"][:top], t.cols["ns"][:top]


def objects(t) -> int:
    return int(np.count_nonzero(_live(t)[0] == READY))


def namespace_usage(t) -> dict[str, dict]:
    """Per namespace with objects or use: objects, used_bytes (extents of its READY and PENDING pages),
    quota_bytes (None here: ``TableDirectory.namespace_usage`` fills in its quota groups',
    ``metaserver/table/quotas.py``)."""
    state, ns = _live(t)
    rows = np.flatnonzero((state == READY) | (state == PENDING))
    sizes = t.code_extents().take(t.cols["size"].take(rows))
    use = np.bincount(ns.take(rows), weights=sizes, minlength=len(t.ns_names))
    objs = np.bincount(ns[state == READY], minlength=len(t.ns_names))
    return {name: {"objects": int(objs[i]), "used_bytes": int(use[i]), "quota_bytes": None}
            for i, name in sorted(enumerate(t.ns_names), key=lambda x: x[1]) if use[i] or objs[i]}


def prefix(t, ns: str, keys: list[bytes]) -> int:
    """How many of ``keys``, from the first, are READY (the leading run)."""
    ok = t.exists(ns, keys)
    return ok.index(False) if False in ok else len(ok)


def list_objects(t, ns: str | None, limit: int) -> tuple[list, bool]:
    """Up to ``limit`` of the READY and PENDING pages (of ``ns``, or of every namespace) as (ns, key,
    payload_len, node_id, state name); True when there were more."""
    state, nscol = _live(t)
    live = (state == READY) | (state == PENDING)
    if ns is not None:
        ix = t.ns_ix.get(ns)
        if ix is None:
            return [], False
        live &= nscol == ix
    rows = np.flatnonzero(live)
    more = len(rows) > limit
    rows = rows[:max(0, limit)]
    c = t.cols
    return [(t.ns_names[n], t.key_of(r), code, node, STATE_NAMES[s]) for r, n, code, node, s in zip(
        rows.tolist(), c["ns"].take(rows).tolist(), t.code_arr.take(c["size"].take(rows)).tolist(),
        t.node_names.take(c["node"].take(rows)).tolist(), c["state"].take(rows).tolist())], more
