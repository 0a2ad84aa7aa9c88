"""Helpers of the columnar page table's unit tests (test_columns, test_tablenodes, test_tablerecords): a table of
``nodes`` nodes of ``slots`` pages of ``PLEN`` bytes each, a put (ALLOC and COMMIT), and raw 32-byte keys."""

from __future__ import annotations

from metaserver.table.columns import PageTable
from metaserver.table.entry import NEW
from transport.wire import object_size

PLEN = 60_000  # one 64 KiB object slot each


def table(nodes: int = 1, slots: int = 8) -> PageTable:
    t = PageTable()
    for i in range(nodes):
        t.add_node(f"n{i}", slots * object_size(PLEN))
    return t


def keys_of(lo: int, hi: int) -> list[bytes]:
    return [i.to_bytes(32, "little") for i in range(lo, hi)]


def put(t: PageTable, keys: list[bytes], gen: int = 1, ns: str = "a") -> list:
    """ALLOC ``keys`` and COMMIT the new ones; returns the ALLOC items."""
    items = t.alloc(ns, keys, [PLEN] * len(keys), gen)
    new = [(k, it[4]) for k, it in zip(keys, items) if it[0] == NEW]
    assert t.commit(ns, [k for k, _ in new], [g for _, g in new]) == [True] * len(new)
    return items
