"""Read-only queries of the page table (``TableQueries``, a mixin of ``metaserver.table.columns.PageTable``): the totals
and listings STATS, LIST and PREFIX answer. No I/O.

Costs: ``prefix`` O(keys) numpy (one key index probe); ``capacity``, ``used``, ``pending`` O(nodes) or O(1);
``objects``, ``namespaces`` and ``namespace_usage`` O(rows) numpy (one pass over the state and namespace columns:
about 10 ms a million rows; no request keeps a counter of them); ``list_objects`` O(rows) numpy plus O(limit)
Python.
"""

from __future__ import annotations

import numpy as np

from metaserver.table.entry import PENDING, READY, STATE_NAMES, extent_size
from metaserver.table.nodes import UNIT_SHIFT


class TableQueries:
    """Totals and listings of a ``PageTable``: see the module docstring."""

    @property
    def capacity(self) -> int:
        """DRAM bytes the live nodes place in (their disk tiers apart: ``tiers.totals``)."""
        if self.tiers.any:
            return self.tiers.totals()[0]
        return sum(n.alloc.capacity for n in self.node_by_id.values())

    @property
    def used(self) -> int:
        if self.tiers.any:
            return self.tiers.totals()[1]
        return sum(n.alloc.used for n in self.node_by_id.values())

    @property
    def pending(self) -> int:
        return len(self._pending)

    def open_extents(self) -> list[tuple[str, int, int]]:
        """(node_id, offset, extent size) of every PENDING row (``metaserver/ha/handoff.py``)."""
        c = self.cols
        return [(self.nodes[c["node"][r]].node_id, int(c["unit"][r]) << UNIT_SHIFT,
                 extent_size(self.codes[c["size"][r]])) for r in self._pending]

    def _live(self) -> tuple[np.ndarray, np.ndarray]:
        """(state, ns) columns of the rows in use so far."""
        top = self.blocks_used * self.block
        return self.cols["state"][:top], self.cols["ns"][:top]

    @property
    def objects(self) -> int:
        return int(np.count_nonzero(self._live()[0] == READY))

    def namespaces(self) -> dict[str, int]:
        """READY pages per namespace (those with any)."""
        state, ns = self._live()
        counts = np.bincount(ns[state == READY], minlength=len(self.ns_names))
        return {self.ns_names[i]: int(n) for i, n in enumerate(counts.tolist()) if n}

    def namespace_usage(self) -> dict[str, dict]:
        """Per namespace with objects or use: objects, used_bytes (extents of its READY and PENDING pages),
        quota_bytes (None here: ``TableDirectory`` fills in its quota groups', ``metaserver/table/quotas.py``)."""
        state, ns = self._live()
        rows = np.flatnonzero((state == READY) | (state == PENDING))
        sizes = self.code_extents().take(self.cols["size"].take(rows))
        used = np.bincount(ns.take(rows), weights=sizes, minlength=len(self.ns_names))
        objects = np.bincount(ns[state == READY], minlength=len(self.ns_names))
        return {name: {"objects": int(objects[i]), "used_bytes": int(used[i]), "quota_bytes": None}
                for i, name in sorted(enumerate(self.ns_names), key=lambda x: x[1]) if used[i] or objects[i]}

    def prefix(self, ns: str, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first, are READY (the leading run)."""
        ok = self.exists(ns, keys)
        return ok.index(False) if False in ok else len(ok)

    def list_objects(self, ns: str | None, limit: int) -> tuple[list, bool]:
        """Up to ``limit`` of the READY and PENDING pages (of ``ns``, or of every namespace) as (ns, key,
        payload_len, node_id, state name); True when there were more."""
        state, nscol = self._live()
        live = (state == READY) | (state == PENDING)
        if ns is not None:
            ix = self.ns_ix.get(ns)
            if ix is None:
                return [], False
            live &= nscol == ix
        rows = np.flatnonzero(live)
        more = len(rows) > limit
        rows = rows[:max(0, limit)]
        c = self.cols
        return [(self.ns_names[n], self.key_of(r), code, node, STATE_NAMES[s]) for r, n, code, node, s in zip(
            rows.tolist(), c["ns"].take(rows).tolist(), self.code_arr.take(c["size"].take(rows)).tolist(),
            self.node_names.take(c["node"].take(rows)).tolist(), c["state"].take(rows).tolist())], more
