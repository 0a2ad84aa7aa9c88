"""The metaserver's directory (the columnar table, metaserver/table/directory.py) through the service, end to end: real
etcd, metaserver and node processes. What a restart, an eviction and a node's loss or return must leave behind:

- round trips and removes survive a full load from etcd (SIGTERM flushes the queued record rewrites first);
- LRU eviction through the service, its commit records rewritten in step, so a restarted metaserver loads exactly
  the pages left;
- a node killed for good: its pages leave the directory, the other node's are served exactly, the lost keys can be
  written again;
- a node frozen past its lease: its pages are parked (out of the directory) and given back, bytes exact and into
  their commit records, when it registers the same arena again.
"""

from __future__ import annotations

import signal

import umbp
from cluster import Cluster, NotYet, eventually

from test_pool import payload


def stats(cluster: Cluster) -> dict:
    """What ``umbp stats --json --metaserver ADDR`` prints, asked in-process (the loops below poll it)."""
    return cluster.ask("stats", metaserver=cluster.metaserver_addr)


def objects_become(cluster: Cluster, n: int, timeout: float = 20.0) -> None:
    """Until STATS counts ``n`` objects (a lost node's pages leave, a returning one's come back, in the background)."""
    def counted() -> bool:
        got = stats(cluster)["objects"]
        if got != n:
            raise NotYet(f"STATS objects={got}")
        return True

    eventually(counted, timeout, f"STATS objects={n}", interval=0.1)


def restart_metaserver(cluster: Cluster) -> None:
    """Stop the metaserver (SIGTERM: it flushes its queued etcd writes, as the record rewrites of REMOVE and of
    evictions are not awaited by their answers) and start it again: a full load from etcd; wait until every
    running node re-registered."""
    cluster.metaserver.restart(sig=signal.SIGTERM)
    cluster.wait_nodes()


def put_all(c: umbp.Client, keys: list[str], size: int) -> None:
    assert c.batch_put(keys, [payload(k, size) for k in keys]) == [True] * len(keys)


def readable(c: umbp.Client, keys: list[str], size: int) -> list[str]:
    """The keys whose bytes come back exactly (a missing key is None; wrong bytes fail the test)."""
    out = []
    for k in keys:
        got = c.get(k)
        if got is not None:
            assert got == payload(k, size), f"{k}: wrong bytes"
            out.append(k)
    return out


def test_round_trips_and_removes_survive_a_full_load(harness, etcd_binary):
    cluster = Cluster(harness, nodes=2).start()
    keys = [f"t-{i}" for i in range(40)]
    with umbp.Client(cluster.metaserver_addr) as c:
        put_all(c, keys[:20], 5000)
        put_all(c, keys[20:], 70_000)
        assert c.batch_remove(keys[:5]) == [True] * 5
        s = stats(cluster)
        assert s["objects"] == 35 and s["pending"] == 0 and s["puts"] == 40
        assert sum(n["objects"] for n in s["nodes"]) == 35
        assert sum(n["used_bytes"] for n in s["nodes"]) == s["used_bytes"] > 0
    restart_metaserver(cluster)
    with umbp.Client(cluster.metaserver_addr) as c:
        assert stats(cluster)["objects"] == 35
        assert readable(c, keys[5:20], 5000) == keys[5:20]
        assert readable(c, keys[20:], 70_000) == keys[20:]
        assert c.batch_exists(keys[:5]) == [False] * 5


def test_eviction_takes_the_least_recently_used_and_its_records_follow(harness, etcd_binary):
    cluster = Cluster(harness, nodes=1, capacity="8MiB").start()
    size = 1 << 20
    keys = [f"ev-{i}" for i in range(20)]
    with umbp.Client(cluster.metaserver_addr) as c:
        put_all(c, keys[:3], size)
        for k in keys[3:]:  # key 0 is read before every put: the most recently used page throughout
            assert c.get(keys[0]) == payload(keys[0], size)
            put_all(c, [k], size)
        left = readable(c, keys, size)
        s = stats(cluster)
        assert keys[0] in left and keys[-1] in left
        assert keys[1] not in left and keys[2] not in left  # the oldest unread pages went first
        assert 3 <= len(left) <= 7 and s["objects"] == len(left)
        assert s["evictions"] == len(keys) - len(left)
    restart_metaserver(cluster)
    with umbp.Client(cluster.metaserver_addr) as c:
        assert stats(cluster)["objects"] == len(left)  # evicted pages' records were rewritten: none comes back
        assert readable(c, keys, size) == left


def test_a_lost_nodes_pages_leave_and_the_rest_are_served(harness, etcd_binary):
    """A node killed for good: its pages leave the directory (parked for a return that does not come: their records
    are forgotten after the grace, ``tests/unit/test_metaserver_ticks.py``), the other node's are served exactly."""
    cluster = Cluster(harness, nodes=2, lease_ttl=1.0).start()
    keys = [f"lost-{i}" for i in range(24)]
    with umbp.Client(cluster.metaserver_addr) as c:
        put_all(c, keys, 20_000)
    per_node = {n["node_id"]: n["objects"] for n in stats(cluster)["nodes"]}
    assert per_node["node0"] > 0 and per_node["node1"] > 0 and sum(per_node.values()) == 24
    cluster.node("node1").kill(signal.SIGKILL)
    cluster.wait_nodes(alive=["node0"], dead=["node1"])
    objects_become(cluster, per_node["node0"])
    with umbp.Client(cluster.metaserver_addr) as c:
        left = readable(c, keys, 20_000)
        assert len(left) == per_node["node0"] == stats(cluster)["objects"]
        lost = [k for k in keys if k not in left]
        put_all(c, lost, 20_000)  # written again: on node0 now
        assert readable(c, keys, 20_000) == keys


def test_a_node_back_after_its_lease_lapsed_gets_its_parked_pages_back(harness, etcd_binary):
    """A node frozen past its lease (SIGSTOP) is detached and its pages parked; thawed, it registers the same arena
    again and gets them back, bytes exact, into their commit records (a restart loads them)."""
    cluster = Cluster(harness, nodes=2, lease_ttl=1.0).start()
    keys = [f"park-{i}" for i in range(24)]
    with umbp.Client(cluster.metaserver_addr) as c:
        put_all(c, keys, 20_000)
    on1 = {n["node_id"]: n["objects"] for n in stats(cluster)["nodes"]}["node1"]
    assert 0 < on1 < 24
    node = cluster.node("node1")
    node.kill(signal.SIGSTOP)
    try:
        cluster.wait_nodes(alive=["node0"], dead=["node1"])
        objects_become(cluster, 24 - on1)
        with umbp.Client(cluster.metaserver_addr) as c:
            assert len(readable(c, keys, 20_000)) == 24 - on1  # parked: out of the directory
    finally:
        node.kill(signal.SIGCONT)
    cluster.wait_nodes(alive=["node0", "node1"])
    objects_become(cluster, 24)
    with umbp.Client(cluster.metaserver_addr) as c:
        assert readable(c, keys, 20_000) == keys
    restart_metaserver(cluster)
    with umbp.Client(cluster.metaserver_addr) as c:
        assert stats(cluster)["objects"] == 24
        assert readable(c, keys, 20_000) == keys
