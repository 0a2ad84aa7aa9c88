"""The metaserver serving from the columnar directory (``--directory table``, metaserver/tabledir.py), end to end:
real etcd, metaserver and node processes.

Two parts:

- the pool's own end-to-end tests (test_pool.py, test_failover.py, test_hardening_caps.py, test_commit_coalescing.py,
  test_cut_connections.py, test_shared_entries.py but its partitioned pool) collected again here, with every
  metaserver this module starts serving from the table (``TableHarness``, through the ``harness_class`` fixture,
  adds ``--directory table --eviction-policy lru`` to each metaserver a test starts, unless the test names a core
  itself): the same assertions on bytes, counts and states hold on either core;
- what is the table's own: STATS naming the core, eviction through the service with its etcd records kept in step
  (a restarted metaserver loads exactly the pages left), node loss, each core loading a pool the other
  wrote, a lost node's pages parked and given back when it returns (on both cores), and the refusals of what the
  table does not keep yet.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

import umbp
from cluster import Cluster, Harness, NotYet, eventually
from processes import child_env

from test_pool import payload
from test_pool import *  # noqa: F401,F403  (collected again on the table)
from test_failover import *  # noqa: F401,F403
from test_hardening_caps import *  # noqa: F401,F403
from test_commit_coalescing import *  # noqa: F401,F403
from test_cut_connections import *  # noqa: F401,F403
from test_shared_entries import *  # noqa: F401,F403

del test_partitioned_pool_keeps_a_shared_entry_in_its_key_slot  # noqa: F821 (the table serves no partitioned pool)

TABLE = {"directory": "table", "eviction_policy": "lru"}


class TableHarness(Harness):
    """A harness whose metaservers serve from the columnar directory unless a test names a core."""

    def metaserver(self, etcd_url: str, start: bool = True, name: str = "metaserver", **flags):
        for k, val in TABLE.items():
            flags.setdefault(k, val)
        return super().metaserver(etcd_url, start=start, name=name, **flags)


@pytest.fixture(scope="module")
def harness_class() -> type:
    return TableHarness  # conftest's harness fixture starts this module's processes through it


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


def restart_metaserver(cluster: Cluster, **flags) -> None:
    """Stop the metaserver (SIGTERM: it flushes its queued etcd writes, as the record rewrites of REMOVE and of
    evictions are not awaited by their answers, on either core) and start it again (with ``flags`` changed): a
    full load from etcd; wait until every running node re-registered."""
    ms = cluster.metaserver
    ms.flags.update(flags)
    ms.restart(sig=signal.SIGTERM)
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


def test_table_serves_round_trips_and_survives_a_full_load(harness, etcd_binary):
    cluster = Cluster(harness, nodes=2).start()
    keys = [f"t-{i}" for i in range(40)]
    with umbp.Client(cluster.metaserver_addr) as c:
        put_all(c, keys[:20], 5000)
        put_all(c, keys[20:], 70_000)
        assert c.batch_remove(keys[:5]) == [True] * 5
        s = stats(cluster)
        assert s["directory"] == "table"
        assert s["objects"] == 35 and s["pending"] == 0 and s["puts"] == 40
        assert sum(n["objects"] for n in s["nodes"]) == 35
        assert sum(n["used_bytes"] for n in s["nodes"]) == s["used_bytes"] > 0
    restart_metaserver(cluster)
    with umbp.Client(cluster.metaserver_addr) as c:
        assert stats(cluster)["objects"] == 35
        assert readable(c, keys[5:20], 5000) == keys[5:20]
        assert readable(c, keys[20:], 70_000) == keys[20:]
        assert c.batch_exists(keys[:5]) == [False] * 5


def test_each_core_loads_the_pool_the_other_wrote(harness, etcd_binary):
    cluster = Cluster(harness, nodes=2, metaserver_flags={"directory": "objects"}).start()
    a = [f"obj-{i}" for i in range(30)]
    b = [f"tab-{i}" for i in range(20)]
    with umbp.Client(cluster.metaserver_addr) as c:
        put_all(c, a, 9000)
        assert stats(cluster)["directory"] == "objects"
    restart_metaserver(cluster, directory="table")
    with umbp.Client(cluster.metaserver_addr) as c:
        assert stats(cluster)["directory"] == "table"
        assert readable(c, a, 9000) == a
        put_all(c, b, 9000)
        assert c.batch_remove(a[:10] + b[:5]) == [True] * 15  # commit records of both cores rewritten by the table
    restart_metaserver(cluster, directory="objects")
    with umbp.Client(cluster.metaserver_addr) as c:
        s = stats(cluster)
        assert s["directory"] == "objects" and s["objects"] == 35
        assert readable(c, a, 9000) == a[10:]
        assert readable(c, b, 9000) == b[5:]


def test_table_evicts_least_recently_used_and_its_records_follow(harness, etcd_binary):
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


@pytest.mark.parametrize("core", ["table", "objects"])
def test_table_takes_a_lost_nodes_pages_out_and_serves_the_rest(harness, etcd_binary, core):
    """A node killed for good: its pages leave the directory (parked for a return that does not come: their records
    are forgotten after the grace, ``tests/unit/test_metaserver_ticks.py``), the other node's are served exactly."""
    cluster = Cluster(harness, nodes=2, lease_ttl=1.0, metaserver_flags={"directory": core}).start()
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


def test_table_refuses_what_it_does_not_keep(harness, etcd_binary):
    cluster = Cluster(harness, nodes=1).start()
    r = subprocess.run([sys.executable, "-m", "umbp", "metaserver", "--etcd", cluster.etcd.url, "--directory", "table",
                        "--eviction-policy", "prefix-lru"], capture_output=True, text=True, timeout=60,
                       env=child_env())
    assert r.returncode != 0
    assert "directory 'table' evicts by lru only" in r.stderr
    with umbp.Client(cluster.metaserver_addr) as c:  # and the running one keeps serving
        put_all(c, ["ok-0"], 4096)
        assert c.get("ok-0") == payload("ok-0", 4096)


@pytest.mark.parametrize("core", ["table", "objects"])
def test_a_node_back_after_its_lease_lapsed_gets_its_parked_pages_back(harness, etcd_binary, core):
    """A node frozen past its lease (SIGSTOP) is detached and its pages parked; thawed, it registers the same arena
    again and gets them back, bytes exact, into their commit records (a restart loads them)."""
    cluster = Cluster(harness, nodes=2, lease_ttl=1.0, metaserver_flags={"directory": core}).start()
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


def test_the_table_keeps_the_shared_entries_of_a_pool_it_loaded(harness, etcd_binary):
    """A pool the objects core wrote TP-sharded pages into (shared entries, metaserver/shared.py), served by the
    table: a plain LOOKUP misses them (never another layout's bytes), a REMOVE rewrites their commit record in the
    shared layout, and the objects core loads that record back with every rank's part exact."""
    from test_shared_entries import part
    cluster = Cluster(harness, nodes=1, metaserver_flags={"directory": "objects"}).start()
    keys = [f"tp/{i}" for i in range(6)]
    for r in range(2):
        with cluster.client(shard=(r, 2)) as c:
            assert c.batch_put(keys, [part(k, r) for k in keys]) == [True] * len(keys)
    restart_metaserver(cluster, directory="table")
    with umbp.Client(cluster.metaserver_addr) as c:
        assert stats(cluster)["objects"] == len(keys)
        assert c.get(keys[0]) is None and c.batch_exists(keys) == [True] * len(keys)
        assert c.batch_remove(keys[:1]) == [True]
    restart_metaserver(cluster, directory="objects")
    assert stats(cluster)["objects"] == len(keys) - 1
    for r in range(2):
        with cluster.client(shard=(r, 2)) as c:
            assert c.get(keys[0]) is None
            assert [c.get(k) for k in keys[1:]] == [part(k, r) for k in keys[1:]]
