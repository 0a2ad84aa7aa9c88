"""Smoke tests of the real-process harness itself (tests/cluster.py): a real etcd starts, serves, keeps its data
across a restart, and dies when killed. Metaserver and node helpers are exercised by the integration tests."""

from __future__ import annotations

import asyncio
import signal
import socket

import aetcd
import pytest

from cluster import Etcd, Harness, HarnessError, free_ports, tcp_connects


async def _put_get(url: str, puts: dict[bytes, bytes], gets: list[bytes]) -> dict[bytes, bytes | None]:
    host, port = url.rsplit(":", 1)
    async with aetcd.Client(host=host, port=int(port), timeout=10) as client:
        for k, v in puts.items():
            await client.put(k, v)
        out = {}
        for k in gets:
            r = await client.get(k)
            out[k] = None if r is None else r.value
        return out


def put_get(url: str, puts: dict[bytes, bytes] = {}, gets: list[bytes] = ()) -> dict[bytes, bytes | None]:
    return asyncio.run(_put_get(url, dict(puts), list(gets)))


def test_free_ports_are_distinct_and_bindable():
    ports = free_ports(4)
    assert len(set(ports)) == 4
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_etcd_serves_put_get(etcd: Etcd):
    host, port = etcd.url.split(":")
    assert host == "127.0.0.1" and int(port) == etcd.client_port and etcd.peer_port != etcd.client_port
    got = put_get(etcd.url, {b"/umbp-smoke/a": b"1", b"/umbp-smoke/b": b"\x00" * 1000}, [b"/umbp-smoke/a",
                                                                                        b"/umbp-smoke/b",
                                                                                        b"/umbp-smoke/c"])
    assert got == {b"/umbp-smoke/a": b"1", b"/umbp-smoke/b": b"\x00" * 1000, b"/umbp-smoke/c": None}


def test_etcd_restart_keeps_data_and_ports(etcd: Etcd):
    put_get(etcd.url, {b"/umbp-smoke/persist": b"kept"})
    url, pid = etcd.url, etcd.pid
    etcd.restart()
    assert etcd.url == url and etcd.pid != pid and etcd.alive
    assert put_get(etcd.url, gets=[b"/umbp-smoke/persist"]) == {b"/umbp-smoke/persist": b"kept"}
    assert etcd.stdout_text(since_start=False).count("=== harness: start #") == 2


def test_etcd_kill_then_start_again(etcd: Etcd):
    put_get(etcd.url, {b"/umbp-smoke/k": b"v"})
    etcd.kill()  # SIGKILL: a crash, waits until reaped
    assert not etcd.alive and etcd.returncode == -signal.SIGKILL
    assert not tcp_connects("127.0.0.1", etcd.client_port)
    etcd.start()  # same ports and data dir: a crash loses nothing that was acknowledged
    assert put_get(etcd.url, gets=[b"/umbp-smoke/k"]) == {b"/umbp-smoke/k": b"v"}


def test_etcd_stop_is_bounded_and_clean(etcd: Etcd):
    rc = etcd.stop()
    assert not etcd.alive and rc is not None


def test_harness_close_stops_processes_and_removes_dirs(etcd_binary: str):
    h = Harness("close-check")
    e = h.etcd()
    workdir, shm_dir = h.workdir, h.shm_dir
    assert workdir.is_dir() and shm_dir.is_dir() and e.alive
    h.close()
    assert not e.alive
    assert not workdir.exists() and not shm_dir.exists()
    h.close()  # idempotent


def test_startup_failure_reports_log_tail(harness: Harness, etcd: Etcd):
    # A second etcd on the first one's data dir and ports cannot start; the error must say why, from its log.
    clash = Etcd(harness.workdir / "clash", name="etcd-clash")
    clash.client_port, clash.peer_port = etcd.client_port, etcd.peer_port
    harness.processes.append(clash)
    with pytest.raises(HarnessError) as info:
        clash.start(timeout=10)
    msg = str(info.value)
    assert "etcd-clash" in msg and "stderr" in msg and "address already in use" in msg
    assert etcd.alive and put_get(etcd.url, {b"/x": b"y"}, [b"/x"]) == {b"/x": b"y"}


def test_the_harness_preexec_loads_nothing_between_fork_and_exec():
    """Review 4.5: the children's preexec_fn once called ``ctypes.CDLL`` (dlopen: locks, malloc) after the fork,
    which hangs a child forked while another pytest thread held the loader lock. In a forked child with dlopen made
    to fail loudly, the harness's preexec_fn (and the launcher's) must still run: libc was looked up before."""
    import ctypes
    import os

    import processes
    from umbp.launcher import pdeathsig_setter

    for preexec in (processes._die_with_parent, pdeathsig_setter()):
        pid = os.fork()
        if pid == 0:  # the child: no pytest machinery, only os._exit
            code = 3
            try:
                ctypes.CDLL = lambda *a, **k: os._exit(4)  # any dlopen now ends the child with status 4
                preexec()
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, f"{preexec} loaded a library after the fork"


def test_cluster_polls_in_process_with_the_clis_answers(make_cluster, monkeypatch):
    """``Cluster.wait_nodes`` and ``Cluster.ask`` start no ``python -m umbp`` child (a Python start-up with its imports,
    about half a CPU-second, once per poll before): the answers are the ones ``umbp nodes|stats --json`` prints;
    a state not reached fails with the wait's own message."""
    import subprocess
    import time

    cluster = make_cluster(nodes=2)
    by_cli = {"nodes": cluster.cli_json("nodes"), "stats": cluster.cli_json("stats")}

    def no_child(*a, **kw):
        raise AssertionError(f"a CLI child while polling: {a}")

    monkeypatch.setattr(subprocess, "run", no_child)
    monkeypatch.setattr(subprocess, "Popen", no_child)
    listing = cluster.wait_nodes()
    assert sorted((d["node_id"], d["alive"]) for d in listing) == [("node0", True), ("node1", True)]
    asked = cluster.ask("nodes")
    static = ("node_id", "addr", "alive", "capacity_bytes")
    assert [{k: d[k] for k in static} for d in asked] == [{k: d[k] for k in static} for d in by_cli["nodes"]]
    assert [sorted(d) for d in asked] == [sorted(d) for d in by_cli["nodes"]]
    st = cluster.ask("stats")
    assert sorted(st) == sorted(by_cli["stats"])
    assert (st["leader"], st["capacity_bytes"]) == (by_cli["stats"]["leader"], by_cli["stats"]["capacity_bytes"])
    t0 = time.monotonic()
    with pytest.raises(HarnessError, match=r"cluster: nodes alive=\['node1'\] dead=\['node0'\] not reached: not within "
                                           r"1s; last seen: NODES answered \[.*'node0'"):
        cluster.wait_nodes(alive=["node1"], dead=["node0"], timeout=1.0)
    took = time.monotonic() - t0
    print(f"\nwait_nodes gave up after {took:.2f} s (timeout 1 s)")
    assert took >= 1.0  # it waited its timeout out (bounded by count too: tests/waiting.py)


def test_eventually_returns_the_first_true_value_and_is_bounded(monkeypatch):
    """``eventually``: returns pred's first true value; on timeout an AssertionError naming what was awaited and the
    last value or exception seen; exceptions not listed in ``errors`` (an invariant's AssertionError) end it at once;
    bounded in count as well as time (a sleep that returns at once cannot make it spin)."""
    import asyncio
    import time

    import waiting
    from cluster import NotYet, eventually, eventually_async

    answers = iter([0, None, "", "ready", "later"])
    assert eventually(lambda: next(answers), 5, "a ready answer", interval=0.01) == "ready"
    assert next(answers) == "later"  # no call after the first true value

    calls = []
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"^a page: not within 0.2s; last seen: 0\n-- logs --$"):
        eventually(lambda: calls.append(1) or 0, 0.2, "a page", details=lambda: "-- logs --")
    assert time.monotonic() - t0 >= 0.2 and 3 <= len(calls) <= 0.2 / 0.05 + 2  # the count bounds it, not a clock

    def flaky():
        raise KeyError("not there")

    with pytest.raises(AssertionError, match=r"key: not within 0.1s; last seen: KeyError: 'not there'"):
        eventually(flaky, 0.1, "key", errors=(KeyError,))
    with pytest.raises(KeyError):  # not listed: at once
        eventually(flaky, 10, "key")

    def invariant():
        raise AssertionError("broken invariant")

    seen = []
    with pytest.raises(AssertionError, match="^broken invariant$"):
        eventually(lambda: seen.append(1) or invariant(), 10, "never", errors=(Exception,))
    assert seen == [1]  # at once: one call, no retry

    def not_yet():
        raise NotYet("saw 7 of 8")

    with pytest.raises(AssertionError, match=r"^eight: not within 0.1s; last seen: saw 7 of 8$"):
        eventually(not_yet, 0.1, "eight")

    n = []
    monkeypatch.setattr(waiting.time, "sleep", lambda s: None)  # a sleep that returns at once: the count bounds it
    with pytest.raises(AssertionError, match="spin: not within 1s"):
        eventually(lambda: n.append(1), 1.0, "spin", interval=0.1)
    assert len(n) == 12
    monkeypatch.undo()

    async def later():
        box = []
        asyncio.get_running_loop().call_later(0.05, box.append, "set")
        got = await eventually_async(lambda: box and box[0], 5, "box set", interval=0.01)
        with pytest.raises(AssertionError, match=r"never: not within 0.05s; last seen: \[\]"):
            await eventually_async(lambda: [], 0.05, "never")
        return got

    assert asyncio.run(later()) == "set"


def test_shared_clusters_one_pool_per_configuration_replaced_when_a_process_is_gone(shared_clusters):
    """conftest.SharedClusters: the same configuration gets the same running cluster; namespaces are never handed out
    twice, and pages of one are not seen from another; a cluster left with a process gone fails the test that left
    it and the next test gets a fresh one."""
    a = shared_clusters.get({"nodes": 1})
    assert shared_clusters.get({"nodes": 1}) is a and shared_clusters.get({"nodes": 2}) is not a
    first, second = shared_clusters.namespace("same name"), shared_clusters.namespace("same name")
    assert first != second and len(first.encode()) <= 128
    with a.client(namespace=first) as c1, a.client(namespace=second) as c2:
        assert c1.put("page", b"first's") is True
        assert c2.batch_exists(["page"]) == [False] and c2.put("page", b"second's") is True
        assert c1.get("page") == b"first's" and c2.get("page") == b"second's"
    shared_clusters.check(a, "a polite test")  # nothing stopped: kept
    a.nodes[0].kill()
    with pytest.raises(HarnessError, match=r"a rude test: ran on a shared cluster and left \['node0'\] stopped"):
        shared_clusters.check(a, "a rude test")
    b = shared_clusters.get({"nodes": 1})
    assert b is not a and all(p.alive for p in b.harness.processes) and not any(p.alive for p in a.harness.processes)


@pytest.mark.shared_cluster
@pytest.mark.cluster(nodes=1)
def test_a_shared_cluster_test_runs_in_a_namespace_of_its_own(cluster, shared_clusters):
    import os

    assert shared_clusters.get({"nodes": 1}) is cluster
    assert cluster.namespace and os.environ["UMBP_NAMESPACE"] == cluster.namespace
    with cluster.client() as c:
        assert c.namespace == cluster.namespace
