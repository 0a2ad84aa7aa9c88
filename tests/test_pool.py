"""The core pool end to end: real etcd, metaserver and node processes on loopback, clients in other processes.

The tests that only put and read share the module's cluster (``shared_cluster``: each in a namespace of its own,
pool-wide counters read as differences); the ones that evict, kill, restart, drain or need the pool's exact
contents start their own."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import umbp
from cluster import eventually
from umbp.errors import InvalidArgument

SIZES = [1, 63, 64, 4095, 4096, 4097, 65536, 1 << 20, (4 << 20) + 13]


def payload(key: str, size: int) -> bytes:
    """Deterministic bytes for a key, so any process can check them."""
    seed = hashlib.sha256(key.encode()).digest()
    reps = size // len(seed) + 1
    return (seed * reps)[:size] if size < 4096 else np.random.default_rng(
        int.from_bytes(seed[:8], "little")).integers(0, 256, size, dtype=np.uint8).tobytes()


def run_writer(addr: str, keys_sizes: list[tuple[str, int]], transport: str = "auto", ns: str | None = None) -> list:
    """Put pages from another process (into ``ns``, default: the environment's UMBP_NAMESPACE, else "default");
    returns the list of put results it printed."""
    code = textwrap.dedent(f"""
        import sys, json
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_pool import payload
        import umbp
        with umbp.Client({addr!r}, namespace={ns!r}, transport={transport!r}) as c:
            ks = {keys_sizes!r}
            print(json.dumps(c.batch_put([k for k, _ in ks], [payload(k, s) for k, s in ks])))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    import json
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.shared_cluster
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_round_trip_many_sizes_across_processes(cluster, transport):
    ks = [(f"rt-{transport}-{s}", s) for s in SIZES]
    assert run_writer(cluster.metaserver_addr, ks, transport) == [True] * len(ks)
    with umbp.Client(cluster.metaserver_addr, transport=transport) as c:
        for k, s in ks:
            assert c.get(k) == payload(k, s), k
        outs = [np.zeros(s + 100, np.uint8) for _, s in ks]
        assert c.batch_get_into([k for k, _ in ks], outs) == [s for _, s in ks]
        for (k, s), o in zip(ks, outs):
            assert o[:s].tobytes() == payload(k, s) and not o[s:].any()
        assert set(c.transport_names().values()) == {transport}


@pytest.mark.shared_cluster
def test_torch_and_numpy_buffers_and_bytes_keys(cluster):
    import torch

    with umbp.Client(cluster.metaserver_addr) as c:
        t = torch.arange(4096, dtype=torch.bfloat16).reshape(64, 64)
        assert c.put(b"\x00\xffbinary-key", t) is True
        out = torch.empty_like(t)
        assert c.get_into(b"\x00\xffbinary-key", out) == t.numel() * 2
        assert torch.equal(out, t)
        a = np.arange(1000, dtype=np.float32)
        assert c.put("np", a)
        b = np.empty_like(a)
        assert c.get_into("np", b) == 4000 and np.array_equal(a, b)
        with pytest.raises(InvalidArgument, match="not C-contiguous"):
            c.put("strided", a[::2])
        with pytest.raises(InvalidArgument, match="read-only"):
            c.get_into("np", b"x" * 4000)
        with pytest.raises(InvalidArgument, match="smaller|holds"):
            c.get_into("np", bytearray(10))
        with pytest.raises(InvalidArgument, match="1..512 bytes"):
            c.put("k" * 513, b"x")


@pytest.mark.shared_cluster
def test_dedup_put_existing_key_answers_false_and_keeps_first_bytes(cluster):
    with umbp.Client(cluster.metaserver_addr) as c:
        objects0 = c.stats()["objects"]  # the pool's count so far (a shared cluster: other tests' pages)
        assert c.put("dup", b"first") is True
        assert c.put("dup", b"second") is False
        assert c.batch_put(["dup", "dup2", "dup2"], [b"third", b"a", b"b"]) == [False, True, False]
        assert c.get("dup") == b"first" and c.get("dup2") == b"a"
        assert c.stats()["objects"] - objects0 == 2


@pytest.mark.shared_cluster
def test_batch_semantics_exists_prefix_misses_remove(cluster):
    with umbp.Client(cluster.metaserver_addr) as c:
        s0 = c.stats()  # the pool's counts so far (a shared cluster: other tests' reads)
        chain = [f"chain/{i}" for i in range(10)]
        assert c.batch_put(chain[:4] + chain[5:7], [b"p%d" % i for i in (0, 1, 2, 3, 5, 6)]) == [True] * 6
        assert c.batch_exists(chain) == [True] * 4 + [False] + [True] * 2 + [False] * 3
        assert c.prefix_hits(chain) == 4
        assert c.prefix_hits(chain[5:]) == 2
        assert c.prefix_hits(["nope"] + chain) == 0
        outs = [bytearray(8) for _ in chain]
        got = c.batch_get_into(chain, outs)
        assert got == [2, 2, 2, 2, -1, 2, 2, -1, -1, -1]
        assert [bytes(o[:2]) for o, g in zip(outs, got) if g > 0] == [b"p0", b"p1", b"p2", b"p3", b"p5", b"p6"]
        assert c.get("absent") is None and c.get_into("absent", bytearray(4)) == -1
        assert c.remove("chain/2") is True and c.remove("chain/2") is False
        assert c.prefix_hits(chain) == 2
        other = umbp.Client(cluster.metaserver_addr, namespace="other")
        assert other.batch_exists(chain[:2]) == [False, False]  # namespaces are separate
        other.close()
        s = c.stats()
        assert s["hits"] - s0["hits"] >= 6 and s["misses"] - s0["misses"] >= 4


@pytest.mark.cluster(nodes=2, capacity="8MiB")
def test_eviction_keeps_usage_within_capacity_and_never_returns_wrong_bytes(cluster):
    size = 256 * 1024  # 2 x 8 MiB holds about 60 of these
    with umbp.Client(cluster.metaserver_addr) as c:
        keys = [f"ev/{i}" for i in range(300)]
        for i in range(0, len(keys), 10):
            assert c.batch_put(keys[i:i + 10], [payload(k, size) for k in keys[i:i + 10]]) == [True] * 10
            s = c.stats()
            assert s["used_bytes"] <= s["capacity_bytes"]
        s = c.stats()
        assert s["evictions"] >= 300 - 64 and s["objects"] <= 64
        outs = [bytearray(size) for _ in keys]
        got = c.batch_get_into(keys, outs)
        present = [i for i, g in enumerate(got) if g >= 0]
        assert 0 < len(present) <= 64
        for i in present:
            assert got[i] == size and bytes(outs[i]) == payload(keys[i], size)
        # the most recent puts survive LRU
        assert all(g >= 0 for g in got[-20:])
        r = cluster.cli("evict", "--all")
        assert "evicted" in r.stdout
        assert c.stats()["objects"] == 0 and c.stats()["used_bytes"] == 0


@pytest.mark.cluster(nodes=3, capacity="32MiB", lease_ttl=2)
def test_sigkill_node_drops_exactly_its_pages_after_lease_expiry(cluster):
    with umbp.Client(cluster.metaserver_addr) as c:
        keys = [f"kill/{i}" for i in range(60)]
        assert all(c.batch_put(keys, [payload(k, 50_000) for k in keys]))
        listing = cluster.cli_json("ls", "--limit", "1000")["objects"]
        where = {k.decode() if isinstance(k, bytes) else k: node for _ns, k, _s, node, _st in listing}
        victim = cluster.nodes[0]
        lost = {k for k in keys if where[k] == victim.node_id}
        assert 0 < len(lost) < len(keys)
        victim.kill(signal.SIGKILL, wait=True)
        eventually(lambda: not any(c.batch_exists(sorted(lost))), 15, "the victim's pages gone from the directory",
                   interval=0.2)
        assert c.batch_exists(keys) == [k not in lost for k in keys]
        for k in keys:
            assert c.get(k) == (None if k in lost else payload(k, 50_000))
        nodes = {n["node_id"]: n for n in cluster.cli_json("nodes")}
        assert nodes[victim.node_id]["alive"] is False
        assert sum(n["alive"] for n in nodes.values()) == 2
        s = c.stats()
        assert s["capacity_bytes"] == 2 * 32 * 1024 * 1024 and s["objects"] == len(keys) - len(lost)


def test_metaserver_restart_keeps_every_committed_page(cluster):
    with umbp.Client(cluster.metaserver_addr) as c:
        keys = [f"durable/{i}" for i in range(500)]
        for i in range(0, 500, 100):
            assert all(c.batch_put(keys[i:i + 100], [payload(k, 3000) for k in keys[i:i + 100]]))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        cluster.metaserver.restart(sig=sig)
        cluster.wait_nodes()
        with umbp.Client(cluster.metaserver_addr) as c:
            assert c.batch_exists(keys) == [True] * 500
            assert c.prefix_hits(keys) == 500
            outs = [bytearray(3000) for _ in keys]
            assert c.batch_get_into(keys, outs) == [3000] * 500
            assert all(bytes(o) == payload(k, 3000) for k, o in zip(keys, outs))
            assert c.put(keys[0], b"again") is False
            assert c.put(f"after-restart-{sig}", b"new") is True


def test_admin_cli_stats_nodes_ls_evict_drain(cluster):
    with umbp.Client(cluster.metaserver_addr) as c:
        keys = [f"cli/{i}" for i in range(20)]
        assert all(c.batch_put(keys, [b"x" * 10000] * 20))
        c.get("cli/0")
        c.get("cli/absent")
    s = cluster.cli_json("stats")
    for field in ("capacity_bytes", "used_bytes", "objects", "hits", "misses", "evictions", "nodes"):
        assert field in s, field
    assert s["objects"] == 20 and s["used_bytes"] == 20 * 12288 and s["hits"] >= 1 and s["misses"] >= 1
    assert s["capacity_bytes"] == sum(n["capacity_bytes"] for n in s["nodes"])
    nodes = cluster.cli_json("nodes")
    assert {n["node_id"] for n in nodes} == {n.node_id for n in cluster.nodes}
    for n in nodes:
        for field in ("node_id", "host", "pid", "capacity_bytes", "used_bytes", "alive", "transports"):
            assert field in n
        assert n["alive"] is True and "tcp" in n["transports"] and "shm" in n["transports"]
    assert "objects" in cluster.cli("stats").stdout or "UMBP" in cluster.cli("stats").stdout
    assert len(cluster.cli("ls").stdout.strip().splitlines()) == 20
    victim = nodes[0]["node_id"]
    r = cluster.cli("drain", victim)
    assert "dropped" in r.stdout
    with umbp.Client(cluster.metaserver_addr) as c:
        assert sum(c.batch_exists(keys)) == 20 - victim_count(s, victim)
        assert all(c.batch_put([f"after-drain/{i}" for i in range(20)], [b"y"] * 20))
    listing = cluster.cli_json("ls")["objects"]
    assert all(node != victim for _ns, _k, _s, node, _st in listing)
    bad = cluster.cli("drain", "no-such-node", check=False)
    assert bad.returncode == 1 and "no-such-node" in bad.stderr
    r = cluster.cli("stats", "--watch", "0.2", "--count", "2", "--json")
    assert len(r.stdout.strip().splitlines()) == 2


def victim_count(stats: dict, node_id: str) -> int:
    return next(n["objects"] for n in stats["nodes"] if n["node_id"] == node_id)


@pytest.mark.shared_cluster
def test_transport_selection_on_a_host_without_rdma(cluster):
    """auto picks shm for same-host nodes; tcp can be forced; forcing rdma here fails loudly, never a silent miss."""
    from transport.rdma import rdma_available
    from umbp.errors import TransportUnavailable

    ok, why = rdma_available()
    assert not ok and "transport rdma" in why  # this suite runs on hosts without RDMA; the guest suite covers it
    nodes = cluster.cli_json("nodes")
    assert all(n["transports"] == ["shm", "tcp"] for n in nodes)
    with umbp.Client(cluster.metaserver_addr) as c:
        assert c.batch_put([f"sel/{i}" for i in range(8)], [b"s" * 100] * 8) == [True] * 8
        assert c.batch_get_into([f"sel/{i}" for i in range(8)], [bytearray(100) for _ in range(8)]) == [100] * 8
        assert set(c.transport_names().values()) == {"shm"}
    with umbp.Client(cluster.metaserver_addr, transport="rdma") as c:
        with pytest.raises(TransportUnavailable, match="transport rdma forced but unusable"):
            c.get_into("sel/0", bytearray(100))
        with pytest.raises(TransportUnavailable):
            c.put("sel/new", b"x")
        assert c.batch_exists(["sel/new"]) == [False]  # the aborted put left nothing behind
        assert c.stats()["pending"] == 0  # ... not even a PENDING allocation
