"""The warm standby (metaserver/ha/standby.py) with real processes: a leader and a standby metaserver, pages written
after the standby loaded, removals and evictions, node registration and loss; SIGKILL of the leader; the standby
serves every page byte-exactly, its STATS say it read no page at the takeover, and its listing equals a full load of
etcd. (The in-process layer, a ``WarmDirectory`` against a full load of the same etcd state: tests/test_standby.py.)

Assertions are on bytes, counts and events; timings are printed, never asserted.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time

import umbp
from cluster import NotYet, eventually
from metaserver.table.load import fingerprint
from metaserver.store.persist import EtcdStore
from test_failover import etcd_state, locations, ms_env, put_pages, raw, wait_confirmed, wait_leader
from test_pool import payload
from test_standby import NS, full_load
from transport.wire import Op

WARM_LINE = re.compile(r"metaserver: warm standby: (\d+) pages at revision (\d+)")


def wait_warm(ms, timeout: float = 30.0) -> int:
    """The page count of the standby's first 'warm standby: N pages' line (its load is done, the watch follows)."""
    return int(ms.wait_for_line(WARM_LINE, timeout, "'warm standby' line").group(1))


def settle(cluster, addr: str, timeout: float = 15.0) -> int:
    """Wait until etcd holds exactly the leader's objects (its batch writer drained); return that count."""
    def drained() -> tuple[int]:
        objects = raw(addr, Op.STATS)["objects"]
        pages = etcd_state(cluster.etcd.url)[1]
        if pages != objects:
            raise NotYet(f"etcd holds {pages} pages, the leader {objects}")
        return (objects,)  # a tuple: 0 objects is settled too

    return eventually(drained, timeout, "etcd holding exactly the leader's objects", interval=0.1)[0]


def listing_equals_full_load(cluster, addr: str) -> None:
    """The new leader's LIST and per-node use equal a full load of what etcd holds now."""
    async def load():
        store = EtcdStore(cluster.etcd.url, "/umbp")
        try:
            return await full_load(store)
        finally:
            await store.close()

    d, _, _ = asyncio.run(load())
    listed = raw(addr, Op.LIST, {"ns": NS, "limit": 1_000_000}, timeout=10)["objects"]
    assert sorted((o[0], o[1], o[2], o[3], o[4]) for o in listed) == sorted(
        (ns, k, plen, node_id, "READY") for ns, k, node_id, _, plen, _, _ in fingerprint(d)["entries"])
    used = {n["node_id"]: n["used_bytes"] for n in raw(addr, Op.STATS)["nodes"]}
    assert used == {node_id: n.alloc.used for node_id, n in d.node_by_id.items()}


def test_sigkill_leader_warm_standby_serves_every_page_without_a_load(make_cluster):
    cluster = make_cluster(metaservers=2, nodes=2, capacity="8MiB", lease_ttl=5, metaserver_flags=ms_env())
    old, standby = cluster.metaservers
    assert wait_leader(cluster, timeout=10) is old
    assert wait_warm(standby) == 0  # it loaded an empty pool: every page below reaches it through the watch

    ks = [(f"ws/{i}", 1 + (i * 7919) % 200_000) for i in range(60)]
    big = [(f"ws-big/{i}", 900_000 + i) for i in range(8)]  # ~6 MiB of small pages + ~7 MiB: under the watermark
    with cluster.client() as c:
        put_pages(c, ks)
        removed = [k for k, _ in ks[:8]]
        assert [c.remove(k) for k in removed] == [True] * len(removed)
        check = ks[30:]  # read now, so recent: eviction takes older pages first
        assert [c.get(k) for k, _ in check] == [payload(k, s) for k, s in check]
        for i in range(0, len(big), 4):
            put_pages(c, big[i:i + 4])
        evicted = c.admin(Op.EVICT, {"bytes": 3 << 20})  # least recently used first: the small pages not read
        assert evicted["evicted"] > 0 and raw(old.addr, Op.STATS)["evictions"] == evicted["evicted"]
        objects = settle(cluster, old.addr)
        everything = ks + big
        present = dict(zip([k for k, _ in everything], c.batch_exists([k for k, _ in everything])))
    assert objects == sum(present.values()) and not any(present[k] for k in removed)
    assert 0 < sum(present[k] for k, _ in ks) < len(ks) - len(removed)  # small pages both kept and evicted

    t0 = time.monotonic()
    old.kill(signal.SIGKILL)
    new = wait_leader(cluster, exclude=(old,), timeout=30)
    took = time.monotonic() - t0
    assert new is standby
    s = raw(new.addr, Op.STATS)
    t = s["takeover"]
    print(f"\nwarm takeover: serving {took:.2f}s after SIGKILL (election ttl 5s), {t}")
    assert t["warm"] is True and t["load_pages"] == 0 and t["standby_load_pages"] == 0
    assert t["pages"] == objects == s["objects"]
    # every page came through the watch (the standby loaded an empty pool, the takeover loaded none): a commit
    # record per COMMIT (put_pages: one for ks, two for big), a rewrite or delete per removal and eviction
    assert t["standby_events"] >= 3 + 1
    listing_equals_full_load(cluster, new.addr)  # before any node re-registered: exactly what etcd says

    with umbp.Client(cluster.metaserver_addrs) as c:
        for k, size in everything:
            got = c.get(k)
            assert got == (payload(k, size) if present[k] else None), k
        more = [(f"ws-after/{i}", 5000 + i) for i in range(5)]
        put_pages(c, more)
        assert [c.get(k) for k, _ in more] == [payload(k, s) for k, s in more]
    wait_confirmed(new.addr, ["node0", "node1"])


def test_standby_started_later_follows_node_registration_and_loss(make_cluster):
    cluster = make_cluster(metaservers=1, nodes=1, capacity="32MiB", lease_ttl=2, metaserver_flags=ms_env())
    old = cluster.metaserver
    first = [(f"late/{i}", 200_000 + 101 * i) for i in range(40)]  # 8 MiB on node0: node1 gets the next ones
    with cluster.client() as c:
        put_pages(c, first)
    settle(cluster, old.addr)
    standby = cluster.harness.metaserver(cluster.etcd.url, **ms_env())
    cluster.metaservers.append(standby)
    assert wait_warm(standby) == len(first)  # loaded the pages that were there

    cluster.add_node(node_id="node1")  # registered after the standby loaded: known to it through the watch only
    cluster.wait_nodes()
    second = [(f"late2/{i}", 4000 + 103 * i) for i in range(40)]
    with cluster.client() as c:
        put_pages(c, second)
        where = dict(zip([k for k, _ in first + second], locations(c, [k for k, _ in first + second])))
    on1 = [(k, size) for k, size in second if where[k] == "node1"]  # placed in turn: node1 takes its share
    lost = [k for k, _ in first + second if where[k] == "node0"]
    assert on1 and {where[k] for k, _ in first} == {"node0"}
    settle(cluster, old.addr)

    cluster.node("node0").kill(signal.SIGKILL)  # lost: the leader drops its lease, parks its pages
    cluster.wait_nodes(alive=["node1"], dead=["node0"], timeout=20)
    # node0's leased record is gone from etcd
    eventually(lambda: etcd_state(cluster.etcd.url)[2] == ["node1"], 15, "etcd's leased node records: node1 only",
               interval=0.2)

    old.kill(signal.SIGKILL)
    new = wait_leader(cluster, exclude=(old,), timeout=30)
    assert new is standby
    t = raw(new.addr, Op.STATS)["takeover"]
    assert t["warm"] is True and t["load_pages"] == 0 and t["standby_load_pages"] == len(first)
    # As a full load would: node0 has only its arena record left, so it is back as provisional with its pages,
    # node1 (seen through the watch) too, until it re-registers.
    assert t["pages"] == len(first) + len(second)
    listing_equals_full_load(cluster, new.addr)
    listing = wait_confirmed(new.addr, ["node1"])
    caps = {n["node_id"]: n["capacity_bytes"] for n in listing}
    assert caps == {"node0": 32 << 20, "node1": 32 << 20}
    with umbp.Client(cluster.metaserver_addrs) as c:
        for k, size in on1:  # node1's pages, known to the standby through the watch only
            assert c.get(k) == payload(k, size), k
        cluster.wait_nodes(alive=["node1"], dead=["node0"], timeout=30)  # its grace ran out: dropped
        assert c.batch_exists(lost) == [False] * len(lost)
        assert c.stats()["objects"] == len(on1)
