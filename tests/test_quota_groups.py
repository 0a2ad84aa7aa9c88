"""Quotas that hold (issue 42, finding 4), against a closed pool with real etcd, metaserver and node processes: a
token's quota covers every namespace its pattern grant writes, so a flood into a namespace of its own evicts only its
own pages (another tenant's stay, bytes exact); a reservation keeps a tenant's pages while an unquoted tenant floods
the pool; a partitioned pool keeps a quota pool-wide, not once per slot."""

from __future__ import annotations

import os
import re
import time

import pytest

from transport import objformat
from transport.wire import Op
from umbp.errors import PoolFull, QuotaExceeded, UmbpError

from closedpool import OPS, SECRET, closed_cluster, scoped_client
from cluster import eventually

PAGE = 8 << 10
OBJ = objformat.object_size(PAGE)  # what one page takes of its group's quota (header included, 4 KiB aligned)
FLOOD = "flood-secret-0123456789"
TENANT_B = "tenant-b-secret-0123456789"
KEEPER = "keeper-secret-0123456789"
QUOTA_PAGES = 64
CAP_TTL_S = 1.0  # write capabilities: a page freed younger than this + 2 s is held (and counted) that long
ENV = {"UMBP_WRITE_CAP_TTL_S": str(CAP_TTL_S)}


def tokens(extra: str = "", token_quota: bool = True) -> str:
    """tenant-q: rw on the pattern tenant-q/* with a quota of QUOTA_PAGES pages (``token_quota``); tenant-b: rw
    tenant-b, no quota; keeper: rw keeper (quota and reservation from ``extra``); ops: admin."""
    quota = f"quota = {QUOTA_PAGES * OBJ}" if token_quota else ""
    return f'''cluster_secret = "{SECRET}"
[[tokens]]
name = "tenant-q"
secret = "{FLOOD}"
namespaces = {{ "tenant-q/*" = "rw" }}
{quota}
[[tokens]]
name = "tenant-b"
secret = "{TENANT_B}"
namespaces = {{ "tenant-b" = "rw" }}
[[tokens]]
name = "keeper"
secret = "{KEEPER}"
namespaces = {{ "keeper" = "rw" }}
[[tokens]]
name = "ops"
secret = "{OPS}"
admin = true
{extra}'''


def client(cluster, token, ns, **kw):
    return scoped_client(cluster.metaserver_addrs, token, ns, **kw)


def put_pages(c, prefix: str, n: int, batch: int = 32) -> dict[bytes, bytes]:
    vals = {}
    for at in range(0, n, batch):
        keys = [f"{prefix}{i}".encode() for i in range(at, min(n, at + batch))]
        pages = [os.urandom(PAGE) for _ in keys]
        assert c.batch_put(keys, pages) == [True] * len(keys)
        vals.update(zip(keys, pages))
    return vals


def flood(c, prefix: str, want: int, batch: int, refused: tuple, timeout: float = 60.0) -> dict[bytes, bytes]:
    """Put pages ``{prefix}{i}`` in batches until ``want`` were stored; a batch refused with one of ``refused``
    (the flood's own pages still held young, in a closed pool) is skipped after a short back-off. Bounded by
    ``timeout``. Returns what was stored."""
    vals: dict[bytes, bytes] = {}
    end = time.monotonic() + timeout
    i = 0
    while len(vals) < want:
        assert time.monotonic() < end, f"only {len(vals)} of {want} pages stored within {timeout}s"
        keys = [f"{prefix}{j}".encode() for j in range(i, i + batch)]
        i += batch
        pages = [os.urandom(PAGE) for _ in keys]
        try:
            ok = c.batch_put(keys, pages)
        except refused:
            time.sleep(0.1)  # back-off, not synchronisation: the next batch is tried either way
            continue
        vals.update((k, p) for k, p, stored in zip(keys, pages, ok) if stored)
    return vals


def read_back(c, vals: dict[bytes, bytes]) -> int:
    """How many of ``vals`` read back with exactly their bytes."""
    keys = list(vals)
    outs = [bytearray(PAGE) for _ in keys]
    got = c.batch_get_into(keys, outs)
    return sum(1 for k, n, o in zip(keys, got, outs) if n == PAGE and bytes(o) == vals[k])


@pytest.mark.parametrize("how", ["token", "pattern"])
def test_a_pattern_grant_cannot_escape_its_quota_and_a_flood_evicts_its_own_pages(make_cluster, tmp_path,
                                                                                     monkeypatch, how):
    """tenant-b stores 200 pages; tenant-q, with a quota of 64 pages (its token's, or a [quotas] pattern's), puts 20
    in tenant-q/keep, then floods tenant-q/flood until it stored 3 times its quota. The flood takes its own group's
    oldest pages (tenant-q/keep's first), never tenant-b's: all 200 read back, bytes exact; the group holds at most
    its quota. (Before: a quota applied to the namespace named exactly only; the flood filled the pool and evicted
    tenant-b's pages.)"""
    text = (tokens() if how == "token" else
            tokens(f'[quotas]\n"tenant-q/*" = {QUOTA_PAGES * OBJ}\n', token_quota=False))
    group = "token:tenant-q" if how == "token" else "tenant-q/*"
    cl = closed_cluster(make_cluster, tmp_path, monkeypatch, text, nodes=2, capacity="2MiB", env=ENV)
    with client(cl, TENANT_B, "tenant-b") as b:
        b_vals = put_pages(b, "b/", 200)
    with client(cl, FLOOD, "tenant-q/keep") as q:
        put_pages(q, "keep/", 20)
    with client(cl, FLOOD, "tenant-q/flood") as q:  # 412 pages put in all: more than the pool's 340
        stored = flood(q, "f/", 3 * QUOTA_PAGES, 16, (QuotaExceeded, PoolFull))
        last = dict(list(stored.items())[-16:])
        assert read_back(q, last) == 16  # its newest pages are kept
    with client(cl, TENANT_B, "tenant-b") as b:
        assert read_back(b, b_vals) == 200
    with client(cl, FLOOD, "tenant-q/flood") as q:
        with pytest.raises(QuotaExceeded, match=rf"namespace 'tenant-q/flood' is over its quota .*{re.escape(group)}"):
            q.batch_put([f"big/{i}".encode() for i in range(QUOTA_PAGES + 1)],
                        [os.urandom(PAGE)] * (QUOTA_PAGES + 1))
    with client(cl, OPS, "tenant-b") as ops:
        usage = ops.admin(Op.STATS)["namespace_usage"]
    used = sum(u["used_bytes"] for ns, u in usage.items() if ns.startswith("tenant-q/"))
    assert used <= QUOTA_PAGES * OBJ and usage["tenant-q/flood"]["quota_bytes"] == QUOTA_PAGES * OBJ
    assert usage.get("tenant-q/keep", {}).get("objects", 0) == 0  # the group's oldest pages went first
    assert usage["tenant-b"]["objects"] == 200


def test_a_reservation_holds_while_an_unquoted_tenant_floods_the_pool(make_cluster, tmp_path, monkeypatch):
    """keeper reserves 100 pages and stores them first (the pool's least recently used); tenant-b, without a quota,
    then stores 1,500 pages into the 8 MiB pool (about 680 fit). Global eviction takes tenant-b's own older pages
    and passes over keeper's: all 100 read back, bytes exact."""
    extra = f'[quotas]\n"keeper" = "16MiB"\n[reservations]\n"keeper" = {100 * OBJ}\n'
    cl = closed_cluster(make_cluster, tmp_path, monkeypatch, tokens(extra), nodes=2, capacity="4MiB", env=ENV)
    with client(cl, KEEPER, "keeper") as k:
        kept = put_pages(k, "k/", 100)
    with client(cl, TENANT_B, "tenant-b") as b:
        flood(b, "b/", 1500, 32, (PoolFull,))  # full of its own young pages at times: refused, not others evicted
    with client(cl, KEEPER, "keeper") as k:
        assert read_back(k, kept) == 100
    with client(cl, OPS, "keeper") as ops:
        st = ops.admin(Op.STATS)
    assert st["evictions"] >= 1500 - st["capacity_bytes"] // OBJ  # the pool was full: tenant-b evicted its own
    assert st["namespace_usage"]["keeper"]["objects"] == 100


def test_a_partitioned_pool_keeps_a_quota_pool_wide(make_cluster, tmp_path, monkeypatch):
    """One process leading 8 slots; tenant-q/flood has a quota of 64 pages ([quotas], exact name). Each slot
    enforces its share (8 pages), so the pool holds at most the quota while the flood stores twice that, not once
    per slot (7.7 times before); tenant-b's pages stay, bytes exact."""
    extra = f'[quotas]\n"tenant-q/flood" = {QUOTA_PAGES * OBJ}\n'
    cl = closed_cluster(make_cluster, tmp_path, monkeypatch, tokens(extra, token_quota=False), nodes=2,
                        capacity="16MiB", env=ENV, metaserver_flags={"slots": 8})
    with client(cl, TENANT_B, "tenant-b") as b:
        # each slot learns the nodes from the membership records within a round
        b_vals = eventually(lambda: put_pages(b, "b/", 200), 30, "tenant-b's 200 pages stored", interval=0.2,
                            errors=(UmbpError,))
    with client(cl, FLOOD, "tenant-q/flood") as q:
        flood(q, "f/", 2 * QUOTA_PAGES, 1, (QuotaExceeded,))  # a page a put: one slot, stored or refused whole
    st = cl.cli_json("stats", "--token", OPS)
    usage = st["namespace_usage"]
    assert usage["tenant-q/flood"]["used_bytes"] <= QUOTA_PAGES * OBJ
    assert usage["tenant-q/flood"]["quota_bytes"] == QUOTA_PAGES * OBJ
    with client(cl, TENANT_B, "tenant-b") as b:
        assert read_back(b, b_vals) == 200
