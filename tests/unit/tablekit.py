"""Helpers of the columnar page table's unit tests (test_columns, test_tablenodes, test_tablerecords): a table of
``nodes`` nodes of ``slots`` pages of ``PLEN`` bytes each, a put (ALLOC and COMMIT), and raw 32-byte keys. Commit
records as etcd would hold them (``named``, ``write``, ``etcd_pages``): the tests of the directory and the loads too
check what a removal leaves in etcd (a dead list beside the old record) by loading it."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

from metaserver.table.columns import PageTable
import msgpack

from metaserver.table.entry import NEW, Entry
from metaserver.table.nodes import add_node
from metaserver.table.records import SEG_BYTE, batch_entries, segment_entries, unpack_segment
from metaserver.table.snapshot import PageRecords
from transport.objformat import object_size

PLEN = 60_000  # one 64 KiB object slot each


def table(nodes: int = 1, slots: int = 8) -> PageTable:
    t = PageTable()
    for i in range(nodes):
        add_node(t, f"n{i}", slots * object_size(PLEN))
    return t


def record_entries(name: bytes, value: bytes) -> tuple[list[str], list[Entry]]:
    """(node ids, entries) of a commit record's raw value in either layout, read by the loader's own parsers
    (``records.segment_entries``, ``records.batch_entries``: a msgpack record's namespace is the record name's)."""
    if value[:1] == SEG_BYTE:
        seg = unpack_segment(value)
        return [seg.node_ids[i] for i in seg.nodeix.tolist()], segment_entries(seg, None, name)
    ns = name.rpartition(b"/")[0].rpartition(b"/")[2].decode()
    return batch_entries(ns, name, msgpack.unpackb(value))


def keys_of(lo: int, hi: int) -> list[bytes]:
    return [i.to_bytes(32, "little") for i in range(lo, hi)]


def put(t: PageTable, keys: list[bytes], gen: int = 1, ns: str = "a") -> list:
    """ALLOC ``keys`` and COMMIT the new ones; returns the ALLOC items."""
    items = t.alloc(ns, keys, [PLEN] * len(keys), gen)
    new = [(k, it[4]) for k, it in zip(keys, items) if it[0] == NEW]
    assert t.commit(ns, [k for k, _ in new], [g for _, g in new]) == [True] * len(new)
    return items


def named(t, term: int = 1):
    """``t`` (a table or directory) names its new records as the metaserver does, ``{ns}/+{term}.{n}``, so a load
    reads them (``etcd_pages``); returns ``t``."""
    seq = itertools.count(1)
    t.commits.namer = lambda ns: b"%s/+%x.%x" % (ns.encode(), term, next(seq))
    return t


def write(etcd: dict, recs) -> None:
    """The batch writer's part, at once: each record's value taken and put in ``etcd`` (record name -> value; None:
    deleted) and durable (``TableRecord.written``), then the records that queues again (dead lists needed no more)
    likewise."""
    todo = list(dict.fromkeys(recs))
    for _ in range(16):
        if not todo:
            return
        taken = [(r, r.value()) for r in todo]
        for r, v in taken:
            if v is None:
                etcd.pop(r.name, None)
            else:
                etcd[r.name] = v
        todo = list(dict.fromkeys(x for r, _ in taken for x in r.written()))
    raise AssertionError("write: records kept queueing each other")


def etcd_pages(etcd: dict, prefix: bytes = b"") -> dict:
    """What ``etcd`` (record name -> value, in commit order; the names under ``prefix``) holds, read as a full load
    reads it, dead lists applied: key -> (node, offset, payload_len, gen)."""
    recs = PageRecords(prefix)
    recs.add([SimpleNamespace(key=k, value=v, mod_revision=i, create_revision=i)
              for i, (k, v) in enumerate(etcd.items(), 1)])
    assert not recs.junk, recs.junk
    return {e.key: (n, e.offset, e.payload_len, e.gen) for n, (ents, _) in recs.done().items() for e in ents}
