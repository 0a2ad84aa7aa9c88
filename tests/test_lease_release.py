"""A get's read lease goes back inside the next LOOKUP (issue 45, ``umbp/releases.py``), not in a RELEASE frame of
its own, and never lingers: the page is pinned until then (STATS ``pinned``, EVICT leaves it), evictable right
after; a lone get (none just before it) sends its RELEASE at once; a client that stops reading sends its queue by
the timer; ``close`` sends it. Real etcd, metaserver and
node; a second client (its own connection) observes the pool, so its STATS flushes nothing of the reader's."""

from __future__ import annotations

import time

from transport import wire
from umbp import releases
from test_slots import wait_map
from waiting import eventually

PAGE = 16 << 10


def _setup(make_cluster, n: int = 8):
    cl = make_cluster(nodes=1)
    keys = [f"rel-{i}" for i in range(n)]
    values = [bytes([i]) * PAGE for i in range(n)]
    with cl.client() as w:
        assert w.batch_put(keys, values) == [True] * n
    return cl, keys, values


def test_the_next_lookup_releases_the_lease(make_cluster, monkeypatch):
    monkeypatch.setattr(releases, "MAX_AGE_S", 600.0)  # only the next LOOKUP takes it back
    cl, keys, values = _setup(make_cluster)
    with cl.client() as c, cl.client() as o:
        assert c.get(keys[7]) == values[7]  # a lone get: its lease goes back at once, in a RELEASE frame
        eventually(lambda: o.stats()["pinned"] == 0, 10.0, "the lone get's lease released")
        outs = [bytearray(PAGE) for _ in range(4)]  # a get right after another: its lease waits for a LOOKUP
        assert c.batch_get_into(keys[:4], outs) == [PAGE] * 4 and [bytes(x) for x in outs] == values[:4]
        assert o.stats()["pinned"] == 4, "the get's lease is held until the next LOOKUP"
        assert o.admin(wire.Op.EVICT, {"all": True})["evicted"] == 4, "only the unleased four are evicted"
        assert o.batch_exists(keys) == [True] * 4 + [False] * 4
        assert c.get(keys[4]) is None  # a LOOKUP: carries the lease back (and takes none: a miss)
        assert o.stats()["pinned"] == 0
        assert o.admin(wire.Op.EVICT, {"all": True})["evicted"] == 4, "the pages became evictable"
        st = c.stats()["client"]
        assert (st["leases_in_lookups"], st["leases_in_releases"]) == (1, 1)


def test_a_steady_stream_of_gets_sends_no_release_frame(make_cluster, monkeypatch):
    monkeypatch.setattr(releases, "MAX_AGE_S", 600.0)
    cl, keys, values = _setup(make_cluster)
    with cl.client() as c, cl.client() as o:
        out = bytearray(PAGE)
        for i in range(20):
            assert c.get_into(keys[i % 8], out) == PAGE and bytes(out) == values[i % 8]
            if i:  # (the first, a lone get, sent its RELEASE frame: on another connection than STATS)
                assert o.stats()["pinned"] == 1, f"get {i}: only the last get's page is leased"
        assert c._meta.piggybacked == 18 and c._meta.framed == 1
        assert c.batch_exists(keys[:1]) == [True]  # any other request sends the queue first
        assert c._meta.framed == 2
        eventually(lambda: o.stats()["pinned"] == 0, 10.0, "the queued lease released before EXISTS")


def test_leases_go_back_by_age_and_at_close(make_cluster, monkeypatch):
    cl, keys, _values = _setup(make_cluster)
    with cl.client() as o:
        c = cl.client()
        try:
            monkeypatch.setattr(releases, "MAX_AGE_S", 0.5)
            assert c.get(keys[7]) is not None and c._meta.framed == 1  # alone: a frame
            c._meta._added = time.monotonic()  # (right after it even on a loaded machine)
            assert c.batch_get_into(keys[:2], [bytearray(PAGE) for _ in range(2)]) == [PAGE] * 2  # queued
            assert c._meta.framed == 1
            # a reader that stops: the timer sends its queue once the oldest id is MAX_AGE_S old
            eventually(lambda: o.stats()["pinned"] == 0, 10.0, "the idle reader's lease released by age")
            assert c._meta.framed == 2 and c._meta.piggybacked == 0
            monkeypatch.setattr(releases, "MAX_AGE_S", 600.0)
            assert c.batch_get_into(keys[2:5], [bytearray(PAGE) for _ in range(3)]) == [PAGE] * 3
            assert o.stats()["pinned"] == 3
        finally:
            c.close()
        assert c._meta.framed == 3, "close sent the queued lease"
        eventually(lambda: o.stats()["pinned"] == 0, 10.0, "the lease released at close")


def test_a_partitioned_pool_takes_each_process_leases_inside_its_lookup(make_cluster, monkeypatch):
    """Two processes over four slots: a batch's keys reach both, and a stream of gets gives each process its
    leases of the last get inside its own part of the next LOOKUP (``"release_any"``: metaserver/ha/partition.py),
    so no RELEASE frame goes out while gets follow each other; pages stay pinned until then, and every lease is
    back after the next other request."""
    monkeypatch.setattr(releases, "MAX_AGE_S", 600.0)
    cl = make_cluster(nodes=1, metaservers=2, metaserver_flags={"slots": 4, "election_ttl": 2})
    wait_map([m.addr for m in cl.metaservers], {m.addr for m in cl.metaservers}, 30.0, 4)
    keys = [f"prel-{i}" for i in range(16)]
    values = [bytes([i]) * PAGE for i in range(16)]
    with cl.client() as w:
        assert w.batch_put(keys, values) == [True] * 16
    with cl.client() as c, cl.client() as o:
        outs = [bytearray(PAGE) for _ in range(8)]
        for i in range(12):
            batch = keys[(i % 2) * 8:(i % 2) * 8 + 8]
            got = c.batch_get_into(batch, outs)
            assert got == [PAGE] * 8 and [bytes(x) for x in outs] == values[(i % 2) * 8:(i % 2) * 8 + 8]
            if i:
                assert o.stats()["pinned"] == 8, f"get {i}: only the last get's pages are leased"
        assert len(set(c._meta.map)) == 2  # (the router's slot map: two processes)
        assert (c._meta.piggybacked, c._meta.framed) == (10, 1)  # the first get's alone; the last one's queued
        assert c._meta.sent[wire.Op.LOOKUP] == 24  # one LOOKUP a process a get
        assert c.batch_exists(keys[:1]) == [True]  # any other request sends the queue first
        eventually(lambda: o.stats()["pinned"] == 0, 10.0, "every lease released")
        assert o.admin(wire.Op.EVICT, {"all": True})["evicted"] == 16
