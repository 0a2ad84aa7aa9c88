"""One directory entry per logical page for TP-sharded KV (metaserver/table/shared.py, ``Client(..., shard=(r, n))``):
real etcd, metaserver and node processes. n client "ranks" put their parts of the same logical pages (different
bytes per rank); nothing is visible until every rank committed; then each rank reads exactly its own bytes, and the
directory holds ONE entry and etcd ONE record per page. Also: retries and IN_FLIGHT over the raw protocol, a rank
that never commits (the page is dropped whole after the pending TTL), a rank's connection that closes, eviction of
the whole extent, a failover that rebuilds shared entries from etcd, a REMOVE's record rewrite read back by a full
load, a partitioned pool, and a closed pool where a rank cannot write another rank's sub-slot."""

from __future__ import annotations

import hashlib
import os
import signal
import time

import pytest

import umbp
from test_digest_keys import page_records
from test_failover import raw, wait_confirmed, wait_leader
from test_slots import partitioned, wait_map
from transport import objformat, wire
from transport.framed import FramedSocket
from transport.wire import Op
from umbp.auth import with_caps
from umbp.errors import AuthError

from closedpool import OPS, closed_cluster, scoped_client, tokens_toml
from cluster import NotYet, eventually
from metaserver.table.records import pages_of

PART = 5000
STRIDE = objformat.object_size(PART)


def part(key: str, rank: int, n: int = PART) -> bytes:
    """A rank's bytes of one page: different for every (key, rank)."""
    seed = hashlib.sha256(f"{key}|{rank}".encode()).digest()
    return (seed * (n // len(seed) + 1))[:n]


def deadline(s: float = 10.0) -> float:
    return time.monotonic() + s


def stats(cluster) -> dict:
    with cluster.client() as c:
        return c.stats()


def wait_stats(cluster, pred, timeout: float = 15.0) -> dict:
    """Poll STATS every 50 ms until ``pred(stats)``; AssertionError with the last answer after ``timeout``."""
    def reached() -> dict:
        s = stats(cluster)
        if not pred(s):
            raise NotYet(f"STATS {s}")
        return s

    return eventually(reached, timeout, "STATS as awaited")


def ranks(cluster, n: int, **kw) -> list:
    return [cluster.client(shard=(r, n), **kw) for r in range(n)]


def check_reads(clients, keys, n):
    for r, c in enumerate(clients):
        for k in keys:
            assert c.get(k) == part(k, r), (k, r)
        outs = [bytearray(PART) for _ in keys]
        assert c.batch_get_into(keys, outs) == [PART] * len(keys)
        assert all(bytes(o) == part(k, r) for k, o in zip(keys, outs))


def test_tp_ranks_fill_one_entry_per_page(cluster):
    n, keys = 4, [f"tp/{i}" for i in range(6)]
    cs = ranks(cluster, n)
    try:
        for r in range(n - 1):
            assert cs[r].batch_put(keys, [part(k, r) for k in keys]) == [True] * len(keys)  # its part is written
            assert cs[r].batch_put(keys[:1], [part(keys[0], r)]) == [False]  # again: its part is in (EXISTS)
            # nothing visible before every rank committed: not to EXISTS, not to a rank's get (read-ahead included)
            assert cs[0].batch_exists(keys) == [False] * len(keys)
            assert cs[r].get(keys[0]) is None and cs[0].prefix_hits(keys) == 0
        s = stats(cluster)
        assert s["objects"] == 0 and s["pending"] == len(keys)
        assert cs[n - 1].batch_put(keys, [part(k, n - 1) for k in keys]) == [True] * len(keys)
        assert cs[1].batch_exists(keys) == [True] * len(keys) and cs[2].prefix_hits(keys) == len(keys)
        check_reads(cs, keys, n)
        # ONE entry and ONE etcd record per logical page; the extent is n object slots
        s = stats(cluster)
        assert s["objects"] == len(keys) and s["pending"] == 0, s
        assert s["used_bytes"] == len(keys) * n * STRIDE, s
        recs = page_records(cluster.etcd.client_url)
        pages = [p for v in recs.values() for p in pages_of(v)]  # in commit records (metaserver/store/persist.py)
        assert sorted(p[0] for p in pages) == sorted(k.encode() for k in keys), sorted(recs)
        assert all(len(p) == 7 and p[6] == n for p in pages)  # a shared entry's record: its part count last
        # a plain client and a client of another TP size see a miss, never another layout's bytes
        with cluster.client() as plain, cluster.client(shard=(0, 2)) as other:
            assert plain.get(keys[0]) is None and other.get(keys[0]) is None
            assert plain.exists(keys[0])  # EXISTS names logical keys
        # REMOVE frees the whole extent; the record goes
        assert cs[0].remove(keys[0]) is True
        # (the ranks' last read leases go back within umbp.releases.MAX_AGE_S: wait for them, not only the remove)
        s = wait_stats(cluster, lambda s: s["objects"] == len(keys) - 1 and s["pinned"] == 0)
        assert s["used_bytes"] == (len(keys) - 1) * n * STRIDE
        # eviction takes whole pages: evict everything, every extent comes back
        with cluster.client() as admin:
            admin.admin(Op.EVICT, {"all": True})
        s = wait_stats(cluster, lambda s: s["objects"] == 0)
        assert s["used_bytes"] == 0 and s["evictions"] >= len(keys) - 1
        assert cs[0].get(keys[1]) is None
    finally:
        for c in cs:
            c.close()


def alloc(sock, keys, rank, n, token, size=PART):
    return sock.request(Op.ALLOC, {"ns": "default", "keys": keys, "sizes": [size] * len(keys), "token": token,
                                   "shard": [rank, n]}, deadline()).meta["items"]


@pytest.mark.cluster(metaserver_flags={"env": {"UMBP_PENDING_TTL_S": "1"}})
def test_retries_in_flight_and_an_incomplete_page_dropped_whole(cluster):
    addr = cluster.metaserver_addr
    s0 = FramedSocket(addr, "rank0", deadline())
    s1 = FramedSocket(addr, "rank1", deadline())
    try:
        a = alloc(s0, [b"p"], 0, 2, token=11)[0]
        assert a[0] == wire.AllocState.NEW and a[3] == PART
        assert alloc(s0, [b"p"], 0, 2, token=11)[0][:5] == a[:5]  # a retry with its token: the same place
        assert alloc(s1, [b"p"], 0, 2, token=12)[0][0] == wire.AllocState.IN_FLIGHT  # rank 0's slot is taken
        assert alloc(s1, [b"p"], 1, 2, token=13, size=PART + 1)[0][0] == wire.AllocState.IN_FLIGHT  # its size
        b = alloc(s1, [b"p"], 1, 2, token=13)[0]
        assert b[0] == wire.AllocState.NEW and (b[1], b[2], b[4]) == (a[1], a[2] + STRIDE, a[4])  # one extent
        ok = s0.request(Op.COMMIT, {"ns": "default", "keys": [b"p"], "gens": [a[4]], "shard": [0, 2]},
                        deadline()).meta["ok"]
        assert ok == [True]
        assert raw(addr, Op.EXISTS, {"ns": "default", "keys": [b"p"]})["exists"] == [False]
        s = stats(cluster)
        assert s["pending"] == 1 and s["used_bytes"] == 2 * STRIDE
        # rank 1 never commits: after the pending TTL the page goes whole, its extent kept out of placement for the
        # quarantine's keep_s (rank 1 may still be writing its part: tests/test_attack_late_write.py)
        s = wait_stats(cluster, lambda s: s["pending"] == 0)
        assert s["used_bytes"] == s["held_bytes"] == 2 * STRIDE and s["objects"] == 0, s
        ok = s1.request(Op.COMMIT, {"ns": "default", "keys": [b"p"], "gens": [a[4]], "shard": [1, 2]},
                        deadline()).meta["ok"]
        assert ok == [False]  # too late
        # a rank whose connection closes before it wrote its part: the page is aborted at once
        a = alloc(s0, [b"q"], 0, 2, token=21)[0]
        c = FramedSocket(addr, "rank1b", deadline())
        assert alloc(c, [b"q"], 1, 2, token=22)[0][0] == wire.AllocState.NEW
        c.close()
        # well within the TTL; its extent is kept out of placement meanwhile (a rank may still write its part)
        s = wait_stats(cluster, lambda s: s["pending"] == 0, timeout=5.0)
        assert s["used_bytes"] == s["held_bytes"] == 4 * STRIDE, s  # "p"'s expired extent, still kept, and "q"'s
        # bad "shard" values: a clear error naming the component; the server keeps serving
        for bad in ([2, 2], [0, 300], "0,2"):
            with pytest.raises(umbp.errors.BadRequest, match="metaserver.*shard must be"):
                alloc(s0, [b"z"], *bad, token=5) if type(bad) is list else s0.request(
                    Op.LOOKUP, {"ns": "default", "keys": [b"z"], "shard": bad}, deadline())
        assert raw(addr, Op.EXISTS, {"ns": "default", "keys": [b"z"]})["exists"] == [False]
    finally:
        s0.close()
        s1.close()


def test_failover_rebuilds_shared_entries_from_etcd(make_cluster):
    cluster = make_cluster(metaservers=2, nodes=2, lease_ttl=5)
    old = wait_leader(cluster, timeout=10)
    n, keys = 2, [f"fo/{i}" for i in range(20)]
    cs = ranks(cluster, n)
    try:
        for r in range(n):
            assert cs[r].batch_put(keys, [part(k, r) for k in keys]) == [True] * len(keys)
        check_reads(cs, keys, n)
        old.kill(signal.SIGKILL)
        new = wait_leader(cluster, exclude=(old,), timeout=30)
        wait_confirmed(new.addr, [nd.node_id for nd in cluster.nodes])
        check_reads(cs, keys, n)  # the clients follow the new leader; the entries came back from etcd
        s = raw(new.addr, Op.STATS)
        assert s["objects"] == len(keys) and s["used_bytes"] == len(keys) * n * STRIDE, s
        # the same pages again: EXISTS for every rank; a new page completes as before
        assert cs[0].batch_put(keys[:2], [part(k, 0) for k in keys[:2]]) == [False, False]
        for r in range(n):
            assert cs[r].put("fo/new", part("fo/new", r)) is True
        check_reads(cs, ["fo/new"], n)
    finally:
        for c in cs:
            c.close()


def test_a_remove_rewrites_a_shared_commit_record_that_a_full_load_reads_back(make_cluster):
    """A REMOVE of one shared page rewrites its commit record in the shared layout (the others' part counts kept):
    a restarted metaserver loads exactly the pages left, a plain LOOKUP still misses them, each rank reads its part."""
    cluster = make_cluster(nodes=1)
    n, keys = 2, [f"tpr/{i}" for i in range(6)]
    cs = ranks(cluster, n)
    try:
        for r in range(n):
            assert cs[r].batch_put(keys, [part(k, r) for k in keys]) == [True] * len(keys)
        assert cs[0].batch_remove(keys[:1]) == [True]
    finally:
        for c in cs:
            c.close()
    cluster.metaserver.restart(sig=signal.SIGTERM)  # SIGTERM: the record rewrite queued by REMOVE is flushed first
    cluster.wait_nodes()
    s = stats(cluster)
    assert s["objects"] == len(keys) - 1 and s["used_bytes"] == (len(keys) - 1) * n * STRIDE, s
    with cluster.client() as plain:
        assert plain.get(keys[1]) is None and plain.batch_exists(keys) == [False] + [True] * (len(keys) - 1)
    cs = ranks(cluster, n)
    try:
        assert [c.get(keys[0]) for c in cs] == [None] * n
        check_reads(cs, keys[1:], n)
    finally:
        for c in cs:
            c.close()


def test_partitioned_pool_keeps_a_shared_entry_in_its_key_slot(make_cluster):
    cl = partitioned(make_cluster)
    addrs = [m.addr for m in cl.metaservers]
    wait_map(addrs, set(addrs), 30.0)
    n, keys = 3, [f"slot/{i}" for i in range(60)]  # keys over every slot: multi-slot requests forward "shard"
    cs = ranks(cl, n)
    try:
        for r in range(n):
            assert cs[r].batch_put(keys, [part(k, r) for k in keys]) == [True] * len(keys)
            assert cs[0].batch_exists(keys) == [r == n - 1] * len(keys)
        check_reads(cs, keys, n)
        s = cs[0].stats()
        assert s["objects"] == len(keys) and s["pending"] == 0 and s["used_bytes"] == len(keys) * n * STRIDE
    finally:
        for c in cs:
            c.close()


SECRET_A = "rank-token-secret-0123456789"
TOKENS = tokens_toml({"ranks": (SECRET_A, {"kv": "rw"})})


def test_closed_pool_a_rank_cannot_write_another_ranks_sub_slot(make_cluster, tmp_path, monkeypatch):
    cl = closed_cluster(make_cluster, tmp_path, monkeypatch, TOKENS, nodes=1)
    meta0 = FramedSocket(cl.metaserver_addrs, "rank0", deadline(), SECRET_A)
    meta1 = FramedSocket(cl.metaserver_addrs, "rank1", deadline(), SECRET_A)
    with scoped_client(cl.metaserver_addrs, OPS, "kv") as c:
        node_addr = c.admin(Op.NODES)["nodes"][0]["addr"]
    node = FramedSocket(node_addr, "rank0 node", deadline(), SECRET_A)
    try:
        def grant(sock, rank):
            m = sock.request(Op.ALLOC, {"ns": "kv", "keys": [b"pg"], "sizes": [PART], "token": 1 + rank,
                                        "shard": [rank, 2]}, deadline()).meta
            it, = with_caps(m["items"], m["caps"], 6)
            assert it[0] == wire.AllocState.NEW
            return it[1:]  # node, off, plen, gen, tag, cap
        _, off0, _, gen, tag0, cap0 = grant(meta0, 0)
        _, off1, _, gen1, tag1, cap1 = grant(meta1, 1)
        assert off1 == off0 + STRIDE and gen1 == gen and tag0 != tag1  # each sub-slot has its own tag

        def write(off, cap, tag, data):
            return node.request(Op.WRITE, [off, gen, cap], deadline(),
                                data=[objformat.pack_object_header(tag, gen, len(data)), data])
        forged = os.urandom(PART)
        for tag in (tag0, tag1):  # rank 0's capability does not cover rank 1's sub-slot, whatever the header
            with pytest.raises(AuthError):
                write(off1, cap0, tag, forged)
        write(off0, cap0, tag0, part("pg", 0))
        write(off1, cap1, tag1, part("pg", 1))
        with pytest.raises(AuthError, match="already holds"):  # a sub-slot is written once
            write(off0, cap0, tag0, forged)
        for sock, r in ((meta0, 0), (meta1, 1)):
            ok = sock.request(Op.COMMIT, {"ns": "kv", "keys": [b"pg"], "gens": [gen], "shard": [r, 2]},
                              deadline()).meta["ok"]
            assert ok == [True]
    finally:
        node.close()
        meta0.close()
        meta1.close()
    for r in range(2):
        with scoped_client(cl.metaserver_addrs, SECRET_A, "kv", shard=(r, 2), checksum=False) as c:
            assert c.get("pg") == part("pg", r)
            # the reader's tag check: rank r's LOOKUP answer carries rank r's tag only
            locs = c._meta.call(Op.LOOKUP, {"ns": "kv", "keys": [b"pg"]}, deadline())["locs"]
            assert locs[0][4] == (tag0, tag1)[r]
