"""Real-process test harness, the processes: etcd, metaservers and storage nodes on 127.0.0.1 (``cluster.py``
composes them into pools).

Every process gets free ports, lives in a per-test work directory and writes its stdout and stderr to log files
there (``<name>.out`` / ``<name>.err``); children run with ``PYTHONUNBUFFERED=1`` so a readiness line is on disk
the moment it is printed. Readiness is read back from those files, so a chatty child can never block on a full
pipe. Node arenas go to a per-test directory under ``/dev/shm`` (``UMBP_ARENA_DIR``) that teardown removes.

Contracts the harness relies on (DESIGN.md, "Public interface"):
- ``python -m umbp metaserver --etcd URL --listen HOST:PORT`` prints ``metaserver: HOST:PORT`` on stdout once it
  serves;
- ``python -m umbp node ... --node-id ID`` prints ``node ID: serving on HOST:PORT`` on stdout once it serves;
- ``umbp nodes --json --metaserver ADDR`` prints a list of ``{"node_id", "alive", ...}`` (``Cluster.wait_nodes``
  asks the same NODES in-process, ``Cluster.ask``).

Bounds: every wait has a deadline and fails with ``HarnessError`` carrying the tail of the process's logs.
Stopping is SIGTERM, then SIGKILL after ``STOP_GRACE_S``; teardown never waits unboundedly.

Cost: a fresh etcd is ready in about 0.5-1 s here; a Python child pays interpreter start plus imports.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from umbp.config import ETCD_TXN_OPS
from umbp import launcher
from umbp.launcher import pdeathsig_setter
from waiting import HarnessError, NotYet, eventually, eventually_async  # noqa: F401  (re-exported)

REPO_ROOT = Path(__file__).resolve().parents[1]
STOP_GRACE_S = 5.0
ETCD_READY_S = 20.0
PROCESS_READY_S = 30.0  # Python children import numpy/uvloop/aetcd; on 2 busy cores that can take seconds
LOG_TAIL_LINES = 40
SHM_ROOT = Path("/dev/shm")
SHM_PREFIX = "umbp-test-"

METASERVER_READY = re.compile(r"^metaserver: (\S+):(\d+)$", re.M)
NODE_READY = re.compile(r"^node (\S+): serving on (\S+):(\d+)", re.M)
METRICS_LINE = re.compile(r"^(?:metaserver|node \S+): metrics on (http://\S+)$", re.M)


# ----------------------------------------------------------------------------------------------------------------
# small helpers


def find_etcd() -> str | None:
    """The etcd binary: ``UMBP_TEST_ETCD`` if set (a path; nothing else is tried), else what ``umbp up`` finds
    (``umbp.launcher.find_etcd``: PATH, then this repository's .venv/bin, then the interpreter's). None when there
    is none; ``make etcd`` installs one."""
    forced = os.environ.get("UMBP_TEST_ETCD")
    if forced:
        return forced if os.path.isfile(forced) and os.access(forced, os.X_OK) else None
    return launcher.find_etcd(str(REPO_ROOT / ".venv" / "bin"))


def free_ports(n: int = 1) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1. All sockets are held until every port is picked, so the n are
    distinct; another process may still take one before our child binds it (callers retry on that)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def tcp_connects(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _tail_file(path: Path, lines: int) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            data = fh.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return "(no log file)"
    out = data.splitlines()[-lines:]
    return "\n".join(out) if out else "(empty)"


def _listening_inodes(port: int) -> set[str] | None:
    """Socket inodes listening on TCP ``port`` (any address), from /proc/net/tcp{,6}; None off Linux."""
    inodes: set[str] = set()
    found_table = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        found_table = True
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f[9])
    return inodes if found_table else None


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a child: ours plus ``extra``, unbuffered Python output (readiness lines reach the log at
    once), and this checkout on PYTHONPATH so ``python -m umbp`` works even when it is not pip-installed
    (entries already on PYTHONPATH, e.g. a test double of a module, still come first)."""
    env = dict(os.environ)
    env.update(extra or {})
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO_ROOT)) if p)
    return env


# preexec_fn: SIGKILL the child if pytest dies without running teardown (e.g. killed by CI). Looked up once, before
# any fork (``umbp.launcher.pdeathsig_setter``): dlopen between fork and exec could hang on a lock another thread of
# pytest (the copy pool, grpc) held at the fork.
_die_with_parent = pdeathsig_setter()


# ----------------------------------------------------------------------------------------------------------------
# one child process


class Process:
    """One child process with its logs in ``workdir``. Restartable: each start appends to the same log files
    behind a marker line, and readiness is only searched for in what this start wrote."""

    def __init__(self, name: str, workdir: Path, env: dict[str, str] | None = None):
        self.name = name
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.out_path = self.workdir / f"{name}.out"
        self.err_path = self.workdir / f"{name}.err"
        self.extra_env = dict(env or {})
        self.wrap: list[str] = []  # argv prefix, e.g. netns.Host.wrap(): run the command as another host's process
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self._out_offset = 0
        self._err_offset = 0

    # --- lifecycle

    def _spawn(self, argv: list[str]) -> None:
        if self.alive:
            raise HarnessError(f"{self.name}: already running (pid {self.pid})")
        self.starts += 1
        self.argv = [str(a) for a in (*self.wrap, *argv)]
        env = child_env(self.extra_env)
        marker = f"=== harness: start #{self.starts} of {self.name}: {' '.join(self.argv)}\n".encode()
        for path in (self.out_path, self.err_path):
            with open(path, "ab") as fh:
                fh.write(marker)
        self._out_offset = self.out_path.stat().st_size
        self._err_offset = self.err_path.stat().st_size
        out = open(self.out_path, "ab")
        err = open(self.err_path, "ab")
        try:
            # PDEATHSIG fires when the *thread* that forked exits, so only arm it from the main thread.
            preexec = _die_with_parent if threading.current_thread() is threading.main_thread() else None
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, cwd=self.workdir,
                start_new_session=True, preexec_fn=preexec,
            )
        except OSError as e:
            raise HarnessError(f"{self.name}: cannot start {self.argv[0]}: {e}") from e
        finally:
            out.close()
            err.close()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def owns_port(self, port: int) -> bool:
        """Whether this process holds the socket listening on ``port`` (so an answer there came from it, not
        from a stray process that had the port). True where /proc cannot tell."""
        inodes = _listening_inodes(port)
        if inodes is None or self.pid is None:
            return True
        try:
            fds = os.listdir(f"/proc/{self.pid}/fd")
        except OSError:
            return False
        for fd in fds:
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{self.pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return True
        return False

    def kill(self, sig: int = signal.SIGKILL, wait: bool | None = None, timeout: float = STOP_GRACE_S) -> None:
        """Send ``sig``. SIGKILL waits (bounded) for the process to be reaped unless ``wait=False``; other
        signals do not wait unless ``wait=True`` (e.g. SIGSTOP to freeze a node and SIGCONT later)."""
        if not self.alive:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)
        if wait or (wait is None and sig == signal.SIGKILL):
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                raise HarnessError(f"{self.name}: still alive {timeout}s after signal {sig}\n{self.tail()}") from None

    def stop(self, grace: float = STOP_GRACE_S) -> int | None:
        """SIGTERM, then SIGKILL if it is still alive after ``grace`` seconds. Blocks at most about
        ``grace + STOP_GRACE_S``. Returns the exit status (negative: killed by that signal)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)  # a SIGSTOPped child cannot act on SIGTERM
                self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(STOP_GRACE_S)
        return self.proc.poll()

    # --- logs and readiness

    def stdout_text(self, since_start: bool = True) -> str:
        return self._read(self.out_path, self._out_offset if since_start else 0)

    def stderr_text(self, since_start: bool = True) -> str:
        return self._read(self.err_path, self._err_offset if since_start else 0)

    @staticmethod
    def _read(path: Path, offset: int) -> str:
        try:
            with open(path, "rb") as fh:
                fh.seek(offset)
                return fh.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        state = "running" if self.alive else f"exited with {self.returncode}"
        return (
            f"----- {self.name} (pid {self.pid}, {state}) stdout: {self.out_path}\n"
            f"{_tail_file(self.out_path, lines)}\n"
            f"----- {self.name} stderr: {self.err_path}\n"
            f"{_tail_file(self.err_path, lines)}"
        )

    def wait_for_line(self, pattern: re.Pattern[str], timeout: float, what: str) -> re.Match[str]:
        """Block until this start's stdout holds a line matching ``pattern``; fail if the process exits first or
        ``timeout`` passes. Reads the log file every 50 ms (``eventually``)."""
        def line() -> re.Match[str] | None:
            m = pattern.search(self.stdout_text())
            if m is None and not self.alive:
                raise HarnessError(f"{self.name}: exited with {self.returncode} before {what}\n{self.tail()}")
            return m

        def missing() -> str:
            hint = ""
            if pattern.search(self.stderr_text()):
                hint = " (the line is on stderr; the contract puts it on stdout)"
            return f"{self.name}: no {what}{hint}; expected a stdout line matching {pattern.pattern!r}"

        return eventually(line, timeout, missing, details=self.tail)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} pid={self.pid} alive={self.alive}>"


# ----------------------------------------------------------------------------------------------------------------
# etcd


class Etcd(Process):
    """A single-member etcd with its data in ``workdir/<name>.data``. ``url`` is "127.0.0.1:PORT".
    ``restart()`` keeps the data directory and both ports. ``max_txn_ops``: its cap on operations per transaction,
    as ``umbp up`` starts etcd (None: etcd's own default, 128)."""

    def __init__(self, workdir: Path, name: str = "etcd", binary: str | None = None,
                 max_txn_ops: int | None = ETCD_TXN_OPS):
        super().__init__(name, workdir)
        self.max_txn_ops = max_txn_ops
        self.binary = binary or find_etcd()
        if not self.binary:
            raise HarnessError("etcd: no etcd binary on PATH, in .venv/bin or in the interpreter's prefix; "
                               "run `make etcd`")
        self.data_dir = self.workdir / f"{name}.data"
        self.client_port = 0
        self.peer_port = 0

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"http://{self.url}"

    def _argv(self) -> list[str]:
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [
            self.binary,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self.name}={peer}",
            "--initial-cluster-state", "new",
            "--auto-compaction-retention=1",
            "--quota-backend-bytes=8589934592",
            "--logger=zap",
        ] + ([f"--max-txn-ops={self.max_txn_ops}"] if self.max_txn_ops is not None else [])

    def start(self, timeout: float = ETCD_READY_S) -> "Etcd":
        fresh = self.client_port == 0
        attempts = 3 if fresh else 1
        for attempt in range(attempts):
            if fresh:
                self.client_port, self.peer_port = free_ports(2)
            self._spawn(self._argv())
            try:
                self.wait_ready(timeout)
                return self
            except HarnessError:
                bind_race = "address already in use" in self.stderr_text()
                self.stop()
                if not (fresh and bind_race and attempt + 1 < attempts):
                    raise
        raise AssertionError("unreachable")

    def wait_ready(self, timeout: float = ETCD_READY_S) -> None:
        """Block until GET /health says {"health":"true"} (a leader exists), bounded by ``timeout``; polled every
        100 ms (``eventually``: the last answer or error is in the failure)."""
        def healthy() -> str:
            if not self.alive:
                raise HarnessError(f"{self.name}: exited with {self.returncode} during startup\n{self.tail()}")
            with urllib.request.urlopen(self.client_url + "/health", timeout=1.0) as r:
                body = r.read().decode("utf-8", "replace")
            if json.loads(body).get("health") not in ("true", True):
                raise ValueError(f"/health answered {body!r}")
            if not self.owns_port(self.client_port):
                raise OSError(f"/health answered on :{self.client_port}, but from another process")
            return body

        eventually(healthy, timeout, f"{self.name}: not healthy (GET /health)", interval=0.1,
                   errors=(urllib.error.URLError, OSError, ValueError), details=self.tail)

    def restart(self, timeout: float = ETCD_READY_S) -> "Etcd":
        """Stop (SIGTERM) if running, then start on the same ports with the same data."""
        self.stop()
        return self.start(timeout)


# ----------------------------------------------------------------------------------------------------------------
# umbp processes


def _flag_args(flags: dict[str, Any]) -> list[str]:
    """{"lease_ttl": 3, "verbose": True, "x": None} -> ["--lease-ttl", "3", "--verbose"]."""
    out: list[str] = []
    for key, value in flags.items():
        opt = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(opt)
        elif isinstance(value, (list, tuple)):
            for v in value:
                out += [opt, str(v)]
        else:
            out += [opt, str(value)]
    return out


class Served(Process):
    """A umbp process that announces the address it serves on; ``addr`` is that address once started.
    ``metrics_url`` is the ``/metrics`` URL it announced (``... metrics on URL``) when started with
    ``metrics_listen=HOST:PORT``."""

    host: str | None = None
    port: int | None = None
    umbp: list[str] = [sys.executable, "-m", "umbp"]  # how to run the CLI; an image's own ``["umbp"]`` instead

    @property
    def addr(self) -> str:
        if self.port is None:
            raise HarnessError(f"{self.name}: not started yet")
        return f"{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        m = METRICS_LINE.search(self.stdout_text())
        if m is None:
            raise HarnessError(f"{self.name}: announced no metrics endpoint (started with metrics_listen?)\n"
                               f"{self.tail()}")
        return m.group(1)


class Metaserver(Served):
    """``python -m umbp metaserver --etcd URL --listen 127.0.0.1:PORT [flags]``. The first start binds port 0;
    ``restart()`` passes the port it got, so clients holding ``addr`` reach it again."""

    def __init__(self, etcd_url: str, workdir: Path, name: str = "metaserver", listen: str = "127.0.0.1:0",
                 env: dict[str, str] | None = None, **flags: Any):
        super().__init__(name, workdir, env)
        self.etcd_url = etcd_url
        self.listen = listen
        self.flags = flags

    def start(self, timeout: float = PROCESS_READY_S) -> "Metaserver":
        argv = [*self.umbp, "metaserver", "--etcd", self.etcd_url, "--listen", self.listen]
        self._spawn(argv + _flag_args(self.flags))
        m = self.wait_for_line(METASERVER_READY, timeout, "'metaserver: HOST:PORT' line")
        self.host, self.port = m.group(1), int(m.group(2))
        self.listen = f"{self.host}:{self.port}"
        return self

    def restart(self, timeout: float = PROCESS_READY_S, sig: int = signal.SIGTERM) -> "Metaserver":
        """Stop (``sig``: SIGTERM is a clean stop, SIGKILL a crash), then start again on the same port."""
        if sig == signal.SIGTERM:
            self.stop()
        else:
            self.kill(sig, wait=True)
        return self.start(timeout)


class Node(Served):
    """``python -m umbp node --metaserver ADDR --capacity SIZE --listen 127.0.0.1:PORT --node-id ID
    [--lease-ttl S] [flags]`` with ``UMBP_ARENA_DIR=arena_dir``. ``restart()`` keeps the node id (so the node
    reopens its arena) and, unless told otherwise, the port."""

    def __init__(self, metaserver_addr: str, workdir: Path, arena_dir: Path, capacity: str | int = "64MiB",
                 node_id: str = "node0", lease_ttl: float | None = None, listen: str = "127.0.0.1:0",
                 env: dict[str, str] | None = None, **flags: Any):
        env = dict(env or {})
        env["UMBP_ARENA_DIR"] = str(arena_dir)
        super().__init__(node_id, workdir, env)
        Path(arena_dir).mkdir(parents=True, exist_ok=True)
        self.metaserver_addr = metaserver_addr
        self.arena_dir = Path(arena_dir)
        self.capacity = capacity
        self.node_id = node_id
        self.lease_ttl = lease_ttl
        self.listen = listen
        self.flags = flags

    def launch(self) -> None:
        """Spawn without waiting; pair with ``wait_ready()`` to start several nodes in parallel."""
        argv = [*self.umbp, "node", "--metaserver", self.metaserver_addr,
                "--capacity", str(self.capacity), "--listen", self.listen, "--node-id", self.node_id]
        if self.lease_ttl is not None:
            argv += ["--lease-ttl", str(self.lease_ttl)]
        self._spawn(argv + _flag_args(self.flags))

    def wait_ready(self, timeout: float = PROCESS_READY_S) -> "Node":
        m = self.wait_for_line(NODE_READY, timeout, f"'node {self.node_id}: serving on HOST:PORT' line")
        if m.group(1) != self.node_id:
            raise HarnessError(f"{self.name}: announced node id {m.group(1)!r}, expected {self.node_id!r}\n"
                               f"{self.tail()}")
        self.host, self.port = m.group(2), int(m.group(3))
        return self

    def start(self, timeout: float = PROCESS_READY_S) -> "Node":
        self.launch()
        return self.wait_ready(timeout)

    def restart(self, timeout: float = PROCESS_READY_S, sig: int = signal.SIGTERM, same_port: bool = True,
                metaserver_addr: str | None = None) -> "Node":
        """Stop (``sig``: SIGTERM clean, SIGKILL crash), then start with the same node id and arena dir."""
        if sig == signal.SIGTERM:
            self.stop()
        else:
            self.kill(sig, wait=True)
        if same_port and self.port is not None:
            self.listen = f"{self.host}:{self.port}"
        if metaserver_addr:
            self.metaserver_addr = metaserver_addr
        return self.start(timeout)

    def arena_files(self) -> list[Path]:
        return sorted(p for p in self.arena_dir.rglob("*") if p.is_file())


# ----------------------------------------------------------------------------------------------------------------
# a per-test registry of processes and directories
