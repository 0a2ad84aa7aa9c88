"""Real-process test harness, the pools: a per-test ``Harness`` (work dir, /dev/shm arena dir, every process it
started) and ``Cluster`` (etcd + metaservers + nodes, with CLI helpers). The processes live in ``processes.py``;
their names are re-exported here for the tests.

Bounds: every wait has a deadline and fails with ``HarnessError`` carrying the tail of the process's logs;
teardown stops nodes, then metaservers, then etcd, and never waits unboundedly.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

from umbp.launcher import sweep_dead_pool_dirs
from processes import (  # noqa: F401  (re-exported for the tests)
    LOG_TAIL_LINES, SHM_PREFIX, SHM_ROOT, Etcd, HarnessError, Metaserver, Node, NotYet, Process, child_env,
    eventually, eventually_async, find_etcd, free_port, free_ports, tcp_connects,
)


class Harness:
    """Owns one test's work directory, its /dev/shm arena directory and every process started through it.
    ``close()`` stops them all (SIGTERM, then SIGKILL) and removes both directories."""

    def __init__(self, name: str = "test", keep: bool = False):
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:60]
        self.workdir = Path(tempfile.mkdtemp(prefix=f"umbp-{safe}-"))
        shm_root = SHM_ROOT if SHM_ROOT.is_dir() and os.access(SHM_ROOT, os.W_OK) else Path(tempfile.gettempdir())
        self.shm_dir = Path(tempfile.mkdtemp(prefix=f"{SHM_PREFIX}{os.getpid()}-", dir=shm_root))
        self.keep = keep
        self.processes: list[Process] = []
        self._closed = False
        self._n_nodes = 0

    def _track(self, p: Process) -> Process:
        self.processes.append(p)
        return p

    def _unique(self, base: str) -> str:
        names = {p.name for p in self.processes}
        if base not in names:
            return base
        i = 1
        while f"{base}{i}" in names:
            i += 1
        return f"{base}{i}"

    def etcd(self, start: bool = True, name: str = "etcd", **kw: Any) -> Etcd:
        e = self._track(Etcd(self.workdir, self._unique(name), **kw))
        return e.start() if start else e

    def metaserver(self, etcd_url: str, start: bool = True, name: str = "metaserver", **flags: Any) -> Metaserver:
        m = self._track(Metaserver(etcd_url, self.workdir, self._unique(name), **flags))
        return m.start() if start else m

    def node(self, metaserver_addr: str, start: bool = True, node_id: str | None = None, **kw: Any) -> Node:
        if node_id is None:
            node_id = self._unique(f"node{self._n_nodes}")
        self._n_nodes += 1
        n = self._track(Node(metaserver_addr, self.workdir, self.shm_dir / node_id, node_id=node_id, **kw))
        return n.start() if start else n

    def tails(self, lines: int = LOG_TAIL_LINES) -> str:
        return "\n".join(p.tail(lines) for p in self.processes)

    def close(self) -> None:
        """Stop every process (nodes first, etcd last), then remove the directories. Idempotent."""
        if self._closed:
            return
        self._closed = True
        order = sorted(self.processes, key=lambda p: {Node: 0, Metaserver: 1}.get(type(p), 2))
        for p in order:
            p.stop()
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        if not self.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)


def sweep_stale_shm() -> list[str]:
    """Remove /dev/shm/umbp-test-<pid>-* directories whose pytest process is gone (left by a killed run)."""
    return sweep_dead_pool_dirs(str(SHM_ROOT), re.compile(rf"^{SHM_PREFIX}(\d+)-"))


# ----------------------------------------------------------------------------------------------------------------
# a whole pool


class Cluster:
    """etcd + ``metaservers`` metaservers + ``nodes`` storage nodes, all started by ``start()``.

    ``metaserver_addr`` is the first metaserver; ``metaserver_addrs`` is the comma-separated list a client or
    node can take to follow the leader. With ``wait_registered`` (default) ``start()`` returns only once
    NODES (what ``umbp nodes --json`` prints, asked in-process) lists every node alive, so a test can put right away.
    """

    def __init__(self, harness: Harness, nodes: int = 2, capacity: str | int = "64MiB",
                 lease_ttl: float | None = None, metaservers: int = 1,
                 metaserver_flags: dict[str, Any] | None = None, node_flags: dict[str, Any] | None = None,
                 wait_registered: bool = True, etcd_flags: dict[str, Any] | None = None):
        self.harness = harness
        self.etcd_flags = dict(etcd_flags or {})  # Etcd's keywords (max_txn_ops=None: etcd's default cap)
        self.n_nodes = nodes
        self.capacity = capacity
        self.lease_ttl = lease_ttl
        self.n_metaservers = metaservers
        self.metaserver_flags = dict(metaserver_flags or {})
        self.node_flags = dict(node_flags or {})
        self.wait_registered = wait_registered
        self.namespace: str | None = None  # a shared cluster's current test's own namespace (conftest.SharedClusters)
        self.etcd: Etcd | None = None
        self.metaservers: list[Metaserver] = []
        self.nodes: list[Node] = []

    @property
    def workdir(self) -> Path:
        return self.harness.workdir

    @property
    def metaserver(self) -> Metaserver:
        return self.metaservers[0]

    @property
    def metaserver_addr(self) -> str:
        return self.metaservers[0].addr

    @property
    def metaserver_addrs(self) -> str:
        return ",".join(m.addr for m in self.metaservers)

    def start(self) -> "Cluster":
        self.etcd = self.harness.etcd(**self.etcd_flags)
        for _ in range(self.n_metaservers):
            self.metaservers.append(self.harness.metaserver(self.etcd.url, **self.metaserver_flags))
        launched = [self.add_node(start=False) for _ in range(self.n_nodes)]
        for n in launched:  # spawn all, then wait: the interpreters start in parallel
            n.launch()
        for n in launched:
            n.wait_ready()
        if self.wait_registered and self.nodes:
            self.wait_nodes()
        return self

    def add_node(self, start: bool = True, node_id: str | None = None, capacity: str | int | None = None,
                 lease_ttl: float | None = None, **flags: Any) -> Node:
        n = self.harness.node(
            self.metaserver_addrs, start=start, node_id=node_id,
            capacity=self.capacity if capacity is None else capacity,
            lease_ttl=self.lease_ttl if lease_ttl is None else lease_ttl,
            **{**self.node_flags, **flags},
        )
        self.nodes.append(n)
        return n

    def node(self, node_id: str) -> Node:
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise KeyError(node_id)

    # --- talking to the pool

    def cli(self, *args: str, timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess:
        """Run ``python -m umbp ARGS`` against this cluster (UMBP_METASERVER set), capturing text output."""
        env = child_env({"UMBP_METASERVER": self.metaserver_addrs})
        argv = [sys.executable, "-m", "umbp", *args]
        try:
            r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout,
                               stdin=subprocess.DEVNULL, cwd=self.workdir)
        except subprocess.TimeoutExpired as e:
            raise HarnessError(f"`umbp {' '.join(args)}` did not finish within {timeout}s\n"
                               f"stdout: {e.stdout}\nstderr: {e.stderr}") from None
        if check and r.returncode != 0:
            raise HarnessError(f"`umbp {' '.join(args)}` exited with {r.returncode}\nstdout:\n{r.stdout}\n"
                               f"stderr:\n{r.stderr}")
        return r

    def cli_json(self, *args: str, timeout: float = 60.0) -> Any:
        r = self.cli(*args, "--json", timeout=timeout)
        try:
            return json.loads(r.stdout)
        except ValueError as e:
            raise HarnessError(f"`umbp {' '.join(args)} --json` printed no JSON ({e}):\n{r.stdout}") from None

    def client(self, **kw: Any):
        """An ``umbp.Client`` for this cluster (the caller closes it, or uses it as a context manager)."""
        import umbp

        kw.setdefault("metaserver", self.metaserver_addrs)
        return umbp.Client(**kw)

    def admin_client(self, metaserver: str | None = None, token: str | None = None, timeout: float = 10.0):
        """An ``umbp.Client`` configured as the admin CLI configures its own (``umbp.cli._admin_client``): flags, then
        the environment a CLI child would get (``UMBP_TOKEN``, ``UMBP_TLS_CA``: a closed or TLS pool's harness sets
        them), ``timeout`` seconds a request. The caller closes it."""
        from umbp.client import Client
        from umbp.config import ClientConfig, resolve

        cfg = resolve(ClientConfig, {"metaserver": metaserver or self.metaserver_addrs, "timeout_s": timeout,
                                     "token": token}, env=child_env())
        return Client(config=cfg)

    def ask(self, what: str, metaserver: str | None = None, token: str | None = None, timeout: float = 10.0) -> Any:
        """What ``cli_json(what)`` returns (``what``: "nodes" or "stats"), asked in-process: the same request through
        the same client code, and the same JSON shapes (bytes as text, keys as strings), without a Python start-up
        and its imports (about half a CPU-second) per call. For polling; a test of the CLI's own output keeps
        ``cli``. A fresh client each call, closed after (as each CLI run was)."""
        from transport.wire import Op
        from umbp.cli import _jsonable

        if what not in ("nodes", "stats"):
            raise ValueError(f"ask: {what!r} is not asked in-process (nodes, stats)")
        with self.admin_client(metaserver, token, timeout) as c:
            if what == "nodes":
                answer = c.admin(Op.NODES)["nodes"]
            else:  # umbp.cli._stats_fetcher: the answering metaserver filled in as the leader
                answer = c.admin(Op.STATS)
                answer.setdefault("leader", c.leader)
        return json.loads(json.dumps(_jsonable(answer), sort_keys=True))

    def wait_nodes(self, alive: Iterable[str] | None = None, dead: Iterable[str] = (),
                   timeout: float = 30.0) -> list[dict]:
        """Poll NODES (``ask("nodes")``: what ``umbp nodes --json`` prints, asked in-process) until every id in
        ``alive`` (default: this cluster's running nodes) is listed alive and every id in ``dead`` is absent or not
        alive. Returns the last listing."""
        from umbp.errors import UmbpError

        want_alive = set(alive if alive is not None else (n.node_id for n in self.nodes if n.alive))
        want_dead = set(dead)
        deadline = time.monotonic() + timeout

        def reached() -> list:
            # a fresh client a poll, as each `umbp nodes` was: a partitioned pool's slot map is read anew each time
            listing = self.ask("nodes", timeout=min(10.0, max(1.0, deadline - time.monotonic())))
            state = {d.get("node_id"): bool(d.get("alive")) for d in listing if isinstance(d, dict)}
            if all(state.get(i) for i in want_alive) and not any(state.get(i) for i in want_dead):
                return listing
            raise NotYet(f"NODES answered {listing}")

        return eventually(reached, timeout, f"cluster: nodes alive={sorted(want_alive)} dead={sorted(want_dead)} "
                                            f"not reached", errors=(UmbpError,), details=self.harness.tails)

    def close(self) -> None:
        self.harness.close()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
