"""metaserver/table/commits.py: a COMMIT's rows become commit records of at most BATCH_PAGES pages in the
records' layout (read back by the loader's own parsers: ``tablekit.record_entries``); rows that leave (evicted,
removed, dropped with their node) reach etcd as a dead list beside the record as it was (a load of both: the pages
left), a record with nothing left is deleted and its id reused, and a stale record object never lists another
record's rows."""

from __future__ import annotations

from metaserver.table.columns import PageTable
from metaserver.table.nodes import detach_node, drop_rows
from metaserver.table.records import BATCH_PAGES, unpack_segment

from tablekit import etcd_pages, keys_of, named, put, record_entries, table, write


def pages(rec) -> dict[bytes, tuple]:
    """A record's value read back as the full load reads it: key -> (node, offset, payload_len, gen)."""
    value = rec.value()
    if value is None:
        return {}
    nodes, ents = record_entries(rec.name, value)
    return {e.key: (n, e.offset, e.payload_len, e.gen) for n, e in zip(nodes, ents)}


def locations(t: PageTable, ns: str, keys: list[bytes]) -> dict[bytes, tuple]:
    lease, locs = t.lookup(ns, keys)
    t.release(lease)
    return {k: tuple(loc) for k, loc in zip(keys, locs) if loc is not None}


def test_a_commit_writes_records_of_at_most_batch_pages_in_directorys_layout():
    t = table(2, 400)
    keys = keys_of(0, 300) + [b"sglang-%d" % i for i in range(20)]  # digests and other keys
    put(t, keys, gen=1)
    put(t, keys_of(1000, 1010), gen=5000, ns="b")
    puts, rewrites = t.commits.take()
    assert [len(r.rows) for r in puts] == [BATCH_PAGES, BATCH_PAGES, 320 - 2 * BATCH_PAGES, 10] and not rewrites
    assert len({r.name for r in puts}) == 4 and [r.ns for r in puts] == ["a", "a", "a", "b"]
    got = {}
    for r in puts[:3]:
        got.update(pages(r))
    assert got == locations(t, "a", keys), "each page once, where a lookup finds it"
    assert pages(puts[3]) == locations(t, "b", keys_of(1000, 1010))
    assert t.commits.take() == ([], []), "taken once"
    t.check()


def test_pages_that_leave_reach_etcd_as_a_dead_list_and_an_empty_record_goes():
    t = named(table(2, 64))
    put(t, keys_of(0, 128), gen=1)  # one record, the pool full (64 slots a node)
    (first,), _ = t.commits.take()
    etcd: dict = {}
    write(etcd, [first])  # the writer takes it: no later COMMIT joins it
    old = etcd[first.name]
    assert t.remove("a", keys_of(0, 3)) == [True] * 3
    put(t, keys_of(500, 510), gen=1000)  # room for 3, evictions for the rest
    puts, rewrites = t.commits.take()
    (dl,) = rewrites
    assert dl.id == 0 and dl is not first and len(puts) == 1, "10 of 128 pages left: a dead list, no rewrite"
    write(etcd, puts + rewrites)
    assert etcd[first.name] == old and unpack_segment(etcd[dl.name]).dead_recs == [first.name]
    left = [k for k in keys_of(3, 128) if t.exists("a", [k])[0]]
    assert len(left) == 118
    assert etcd_pages(etcd) == locations(t, "a", left + keys_of(500, 510)), "etcd lists exactly the pages left"
    detach_node(t, "n1")
    on0 = locations(t, "a", left)
    assert 0 < len(on0) < len(left) and pages(first) == on0, "a detached node's pages leave the record's value"
    while drop_rows(t, "n1", 1000)[1] is None:
        pass
    _, rewrites = t.commits.take()
    write(etcd, rewrites)
    t.check()
    here = [k for k in keys_of(0, 600) if t.exists("a", [k])[0]]
    assert here and etcd_pages(etcd) == locations(t, "a", here), "the dropped node's pages are gone from etcd"
    assert t.remove("a", here) == [True] * len(here)
    _, rewrites = t.commits.take()
    assert {first.name, puts[0].name} <= {r.name for r in rewrites}, "all gone: compacted, never dead-listed"
    old_id = first.id
    write(etcd, rewrites)
    assert first.name not in etcd and puts[0].name not in etcd, "nothing left: the records deleted"
    assert etcd_pages(etcd) == {} and all(unpack_segment(v).n == 0 for v in etcd.values()), "dead lists at most"
    assert not t.commits.records
    put(t, keys_of(900, 905), gen=9000)
    (fresh,), _ = t.commits.take()
    assert fresh.id in (old_id, puts[0].id), "a freed id is reused"
    assert first.value() is None and puts[0].value() is None, "a stale record never lists another's rows"
    assert sorted(pages(fresh)) == keys_of(900, 905)
    t.check()
