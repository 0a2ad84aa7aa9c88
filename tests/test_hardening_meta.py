"""Metaserver hardening against a closed pool (issue 15): read leases owned by their connection (findings 3),
scoped views of STATS and NODES (finding 6), per-namespace quotas, and a retried ALLOC that outlives its first
connection. Real etcd, metaserver and node processes; attacks go over raw sockets as tests/test_security.py's do,
and every test asserts on what the attacker gets and on the victim's bytes, leases and pages."""

from __future__ import annotations

import os
import time

import pytest

from transport import objformat, wire
from transport.framed import FramedSocket
from umbp.client import Client
from umbp.errors import BadRequest, NotFound, QuotaExceeded

from closedpool import OPS, closed_cluster, scoped_client, tokens_toml
from cluster import NotYet, eventually

TENANT_A = "tenant-a-secret-0123456789"
TENANT_B = "tenant-b-secret-0123456789"
READER_B = "tenant-b-reader-0123456789"
PAGE = 64 << 10
OBJ = objformat.object_size(PAGE)  # what one page takes of its namespace's quota (header included, 4 KiB aligned)
QUOTA_A = 16 * OBJ
QUOTA_B = 40 * OBJ
SCOPES = {"tenant-a": (TENANT_A, {"tenant-a": "rw"}), "tenant-b": (TENANT_B, {"tenant-b": "rw"}),
          "reader-b": (READER_B, {"tenant-b": "r"})}


@pytest.fixture
def closed(make_cluster, tmp_path, monkeypatch):
    """Two nodes and a metaserver sharing a tokens file without quotas."""
    return closed_cluster(make_cluster, tmp_path, monkeypatch, tokens_toml(SCOPES))


@pytest.fixture
def quotas(make_cluster, tmp_path, monkeypatch):
    """As ``closed``, with quotas for tenant-a (16 pages) and tenant-b (40 pages); write capabilities of 0.5 s, so a
    page freed young counts against its quota (metaserver/table/quotas.py) for 2.5 s only."""
    return closed_cluster(make_cluster, tmp_path, monkeypatch,
                          tokens_toml(SCOPES, quotas={"tenant-a": QUOTA_A, "tenant-b": QUOTA_B}),
                          env={"UMBP_WRITE_CAP_TTL_S": "0.5"})


def put_aged(c: Client, key: bytes, page: bytes, timeout: float = 20.0) -> bool:
    """``c.put`` once the namespace's oldest page is old enough to evict: a page evicted younger than its write
    capability would stay held, and counted, so the put is refused (QUOTA) until then. Bounded by ``timeout``."""
    # (answer,): whatever put answers ends the wait, a refusal (QuotaExceeded) is "not yet"
    return eventually(lambda: (c.put(key, page),), timeout, f"{key!r} accepted", interval=0.1,
                      errors=(QuotaExceeded,))[0]


def client(cluster, token, ns, **kw) -> Client:
    return scoped_client(cluster.metaserver_addrs, token, ns, **kw)


def raw(cluster, token, name="raw") -> FramedSocket:
    return FramedSocket(cluster.metaserver_addr, name, time.monotonic() + 5, token)


def req(sock: FramedSocket, op, meta):
    return sock.request(op, meta, time.monotonic() + 5).meta


def stats(cluster, token=OPS) -> dict:
    with client(cluster, token, "tenant-a") as c:
        return c.admin(wire.Op.STATS)


def wait_stat(cluster, field: str, want, timeout: float = 10.0) -> dict:
    """STATS once ``field`` equals ``want`` (bounded: ``timeout``, then an AssertionError with the last STATS)."""
    def reached() -> dict:
        s = stats(cluster)
        if s[field] != want:
            raise NotYet(f"STATS {field}={s[field]!r}: {s}")
        return s

    return eventually(reached, timeout, f"STATS {field}={want!r}")


def test_release_of_another_connections_lease_is_refused(closed):
    """Finding 3: a read-only token of another namespace releases lease ids around (and including) a reader's
    lease; then an operator evicts everything. The reader's pinned pages must survive, bytes exact."""
    keys = [f"page/{i}".encode() for i in range(20)]
    vals = [os.urandom(8000) for _ in keys]
    with client(closed, TENANT_A, "tenant-a") as a:
        assert a.batch_put(keys, vals) == [True] * 20
    reader = raw(closed, TENANT_A, "reader")
    found = req(reader, wire.Op.LOOKUP, {"ns": "tenant-a", "keys": keys[:10]})
    lease = found["lease"]
    assert lease > 1 << 32 and all(loc is not None for loc in found["locs"])  # a random 63-bit id
    attacker = raw(closed, READER_B, "attacker")
    refused = 0
    for guess in [lease, *range(1, 150), *range(lease - 50, lease + 50)]:
        with pytest.raises(NotFound, match="metaserver: RELEASE: no read lease .* held by this connection"):
            req(attacker, wire.Op.RELEASE, {"lease": guess})
        refused += 1
    assert refused == 250
    assert stats(closed)["pinned"] == 10
    with client(closed, OPS, "tenant-a") as ops:
        assert ops.admin(wire.Op.EVICT, {"all": True})["evicted"] == 10  # only the unleased half
    s = stats(closed)
    assert s["pinned"] == 10 and s["objects"] == 10
    with client(closed, TENANT_A, "tenant-a") as a:
        outs = [bytearray(8000) for _ in keys]
        assert a.batch_get_into(keys, outs) == [8000] * 10 + [-1] * 10
        assert outs[:10] == vals[:10]
    # the owner's own RELEASE works once; its connection closing leaves what it still holds to run out (its reads may
    # still be on their way: tests/test_attack_leases.py), counted as orphaned
    second = req(reader, wire.Op.LOOKUP, {"ns": "tenant-a", "keys": keys[:3]})["lease"]
    req(reader, wire.Op.RELEASE, {"lease": lease})
    with pytest.raises(NotFound):
        req(reader, wire.Op.RELEASE, {"lease": lease})
    assert stats(closed)["pinned"] == 3
    assert second != lease
    reader.close()
    assert wait_stat(closed, "leases_orphaned", 1)["pinned"] == 3
    attacker.close()


def test_release_of_several_leases_releases_only_the_callers(closed):
    """RELEASE ``leases`` (one frame for a multi-slot LOOKUP's leases): an attacker's list naming the reader's lease
    releases nothing and says so (``released`` 0); the reader's own list releases its leases, counted; malformed
    lists are refused naming the metaserver and the field."""
    keys = [f"multi/{i}".encode() for i in range(12)]
    with client(closed, TENANT_A, "tenant-a") as a:
        assert a.batch_put(keys, [os.urandom(4000) for _ in keys]) == [True] * 12
    reader = raw(closed, TENANT_A, "reader")
    leases = [req(reader, wire.Op.LOOKUP, {"ns": "tenant-a", "keys": keys[i:i + 4]})["lease"] for i in (0, 4, 8)]
    assert stats(closed)["pinned"] == 12
    attacker = raw(closed, READER_B, "attacker")
    assert req(attacker, wire.Op.RELEASE, {"leases": [*leases, 1, 2, 3]}) == {"released": 0}
    assert stats(closed)["pinned"] == 12
    for bad, why in (({"leases": []}, "leases must be a list of 1..4096"),
                     ({"leases": [1] * 4097}, "leases must be a list of 1..4096"),
                     ({"leases": [1, "2"]}, "leases must hold integers"),
                     ({"leases": [-1]}, "leases must hold integers"),
                     ({"lease": 1, "leases": [2]}, "exactly one of them"),
                     ({}, "exactly one of them")):
        with pytest.raises(BadRequest, match=f"metaserver: RELEASE: .*{why}"):
            req(reader, wire.Op.RELEASE, bad)
    assert req(reader, wire.Op.RELEASE, {"leases": leases[:2] + [leases[0]]}) == {"released": 2}
    assert stats(closed)["pinned"] == 4
    assert req(reader, wire.Op.RELEASE, {"leases": leases}) == {"released": 1}
    assert stats(closed)["pinned"] == 0
    reader.close()
    attacker.close()


def test_retried_alloc_is_owned_by_the_retrys_connection(closed):
    """Review: an ALLOC retried with its token on a new connection stayed in the old connection's pending set, so
    the old connection closing aborted the retry's allocation."""
    meta = {"ns": "tenant-a", "keys": [b"retried"], "sizes": [1000], "token": 9191}
    first = raw(closed, TENANT_A, "first")
    items = req(first, wire.Op.ALLOC, meta)["items"]
    second = raw(closed, TENANT_A, "second")
    again = req(second, wire.Op.ALLOC, meta)["items"]
    assert items[0][0] == wire.AllocState.NEW and again[0][:5] == items[0][:5]
    first.close()
    # Barrier: a third writer's connection, opened after the first closed, allocates and closes; once its
    # allocation is freed, the metaserver has handled the first connection's close too.
    third = raw(closed, TENANT_A, "third")
    req(third, wire.Op.ALLOC, {"ns": "tenant-a", "keys": [b"barrier"], "sizes": [1000], "token": 7})
    assert stats(closed)["pending"] == 2
    third.close()
    assert wait_stat(closed, "pending", 1)["pending"] == 1  # the retried allocation is still there
    gen = again[0][4]
    assert req(second, wire.Op.COMMIT, {"ns": "tenant-a", "keys": [b"retried"], "gens": [gen]})["ok"] == [True]
    second.close()


def test_scoped_tokens_see_their_own_namespaces_only(closed):
    """Finding 6: STATS and NODES to a scoped token: its namespaces only, no arena paths or node internals."""
    with client(closed, TENANT_A, "tenant-a") as a, client(closed, TENANT_B, "tenant-b") as b:
        assert a.batch_put([b"a1", b"a2"], [b"x" * 100, b"y" * 100]) == [True, True]
        assert b.put(b"secret-project-name", b"z" * 100) is True
        seen = a.admin(wire.Op.STATS)
        assert seen["namespaces"] == {"tenant-a": 2}
        assert set(seen["namespace_usage"]) == {"tenant-a"}
        assert "etcd" not in seen
        for view in (seen["nodes"], a.admin(wire.Op.NODES)["nodes"]):
            assert len(view) == 2
            for n in view:
                assert n["arena_path"] == "" and n["arena_id"] == b"" and n["boot_id"] == "" and n["pid"] == 0
                assert n["capacity_bytes"] > 0 and n["port"] > 0  # what a client needs still there
        assert b.get(b"secret-project-name") == b"z" * 100  # scoped clients still read (over TCP)
        assert a.get(b"a1") == b"x" * 100
    with client(closed, READER_B, "tenant-b") as r:
        assert r.admin(wire.Op.STATS)["namespaces"] == {"tenant-b": 1}
    full = stats(closed)
    assert full["namespaces"] == {"tenant-a": 2, "tenant-b": 1} and full["etcd"]
    assert all(n["arena_path"] and n["pid"] > 0 for n in full["nodes"])
    cli = closed.cli_json("stats", "--token", OPS)  # the admin CLI keeps the DESIGN.md fields
    for k in ("capacity_bytes", "used_bytes", "objects", "hits", "misses", "evictions", "nodes"):
        assert k in cli
    assert cli["namespaces"] == {"tenant-a": 2, "tenant-b": 1}


def test_quota_flood_evicts_its_own_pages_and_spares_the_other_tenant(quotas):
    """Two tenants with quotas: tenant-a floods far past its quota. Its puts evict its own oldest pages (once old
    enough: ``put_aged``), a batch that cannot fit raises QuotaExceeded naming the namespace, tenant-b keeps every
    page, bytes exact."""
    b_keys = [f"b/{i}".encode() for i in range(30)]
    b_vals = [os.urandom(PAGE) for _ in b_keys]
    with client(quotas, TENANT_B, "tenant-b") as b:
        assert b.batch_put(b_keys, b_vals) == [True] * 30
    a_vals = {}
    with client(quotas, TENANT_A, "tenant-a") as a:
        for i in range(100):  # 100 pages into a 16-page quota, one put at a time
            k = f"a/{i}".encode()
            a_vals[k] = os.urandom(PAGE)
            assert put_aged(a, k, a_vals[k]) is True
        s = stats(quotas)["namespace_usage"]
        assert s["tenant-a"] == {"objects": 16, "used_bytes": 16 * OBJ, "quota_bytes": QUOTA_A}
        assert s["tenant-b"] == {"objects": 30, "used_bytes": 30 * OBJ, "quota_bytes": QUOTA_B}
        present = a.batch_exists(list(a_vals))
        assert present == [False] * 84 + [True] * 16  # its own least recently used went first
        assert a.get(b"a/99") == a_vals[b"a/99"]
        big = [f"big/{i}".encode() for i in range(17)]
        with pytest.raises(QuotaExceeded, match="namespace 'tenant-a' is over its quota"):
            a.batch_put(big, [os.urandom(PAGE) for _ in big])
        assert a.batch_exists(big) == [False] * 17  # nothing of the refused request
        # pinned pages are never evicted for the quota: with all 16 leased, one more page does not fit
        leased = raw(quotas, TENANT_A, "pinning reader")
        lease = req(leased, wire.Op.LOOKUP, {"ns": "tenant-a", "keys": [f"a/{i}".encode() for i in range(84, 100)]})
        assert lease["lease"] and None not in lease["locs"]
        end = time.monotonic() + 3.0  # past the 2.5 s hold: refused for the pins, not only for the pages' youth
        for _ in range(100):
            with pytest.raises(QuotaExceeded, match="'tenant-a'"):
                a.put(b"one-more", os.urandom(PAGE))
            if time.monotonic() > end:
                break
            time.sleep(0.25)  # the next try, until the pages are old
        leased.close()
        assert wait_stat(quotas, "pinned", 0)["pinned"] == 0
        assert put_aged(a, b"one-more", os.urandom(PAGE)) is True
    with client(quotas, TENANT_B, "tenant-b") as b:
        outs = [bytearray(PAGE) for _ in b_keys]
        assert b.batch_get_into(b_keys, outs) == [PAGE] * 30 and outs == b_vals
        own = b.admin(wire.Op.STATS)["namespace_usage"]
        assert own == {"tenant-b": {"objects": 30, "used_bytes": 30 * OBJ, "quota_bytes": QUOTA_B}}
    final = stats(quotas)
    assert final["namespace_usage"]["tenant-a"]["used_bytes"] == 16 * OBJ
    assert final["evictions"] == 85 and final["objects"] == 46
