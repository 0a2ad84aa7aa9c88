"""``umbp up`` keeps serving: a node killed under it is named, restarted with the same node id and gets its pages
back from its arena; past ``--max-restarts`` it is left down while the rest serves on; every process announces a
``metrics: URL`` that answers; SIGTERM stops everything and removes the arenas ``up`` made.

Runs the real command (``python -m umbp up``) with its own etcd; assertions are on the lines it prints, page bytes
and counts, never on elapsed time.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from cluster import NotYet, eventually

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 60.0


def payload(key: str, n: int = 40_000) -> bytes:
    return (key.encode() * (n // len(key) + 1))[:n]


class Up:
    def __init__(self, tmp: Path, *args: str):
        self.err_path = tmp / "up.err"
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p))
        self.err = open(self.err_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "umbp", "up", *args], stdout=subprocess.PIPE,
                                     stderr=self.err, stdin=subprocess.DEVNULL, env=env, text=True,
                                     start_new_session=True)
        self.out: list[str] = []

    def stdout_until(self, pattern: str, count: int = 1) -> list[re.Match]:
        """Read stdout lines until ``count`` lines match (each read bounded by the process living)."""
        rx = re.compile(pattern)
        found = [m for m in map(rx.search, self.out) if m]
        deadline = time.monotonic() + WAIT_S
        while len(found) < count:
            assert time.monotonic() < deadline, f"no {count} stdout lines like {pattern!r}:\n{self.out}\n{self.stderr()}"
            line = self.proc.stdout.readline()
            assert line, f"`umbp up` ended (rc {self.proc.poll()}):\n{self.out}\n{self.stderr()}"
            self.out.append(line.rstrip("\n"))
            m = rx.search(line)
            if m:
                found.append(m)
        return found

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait_stderr(self, pattern: str) -> re.Match:
        rx = re.compile(pattern, re.M)

        def line() -> re.Match | None:
            m = rx.search(self.stderr())
            assert m or self.proc.poll() is None, f"`umbp up` exited with {self.proc.returncode}:\n{self.stderr()}"
            return m

        return eventually(line, WAIT_S, f"a stderr line like {pattern!r}", interval=0.1, details=self.stderr)

    def cli_json(self, metaserver: str, *args: str):
        r = subprocess.run([sys.executable, "-m", "umbp", *args, "--json", "--metaserver", metaserver],
                           capture_output=True, text=True, timeout=60, cwd=REPO)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def close(self) -> None:
        """SIGTERM (up stops its children and removes its arenas), SIGKILL to the group if that hangs; then remove
        whatever arena directory a killed `up` left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        for d in glob.glob(f"/dev/shm/umbp-up-{self.proc.pid}-*") + _workdirs(self.proc.pid):
            shutil.rmtree(d, ignore_errors=True)
        self.err.close()


@pytest.fixture
def up(tmp_path, etcd_binary):
    holder = []

    def start(*args: str) -> Up:
        u = Up(tmp_path, *args)
        holder.append(u)
        return u

    yield start
    for u in holder:
        u.close()


def test_up_restarts_a_dead_node_with_its_pages_then_gives_up(up):
    import umbp

    u = up("--nodes", "2", "--capacity", "32MiB", "--port", "0", "--max-restarts", "1")
    (ms,) = u.stdout_until(r"^metaserver: (\S+)$")
    addr = ms.group(1)
    metrics = {m.group(2): m.group(1) for m in u.stdout_until(r"^metrics: (http://\S+) \((\S+)\)$", 4)}
    assert set(metrics) == {"etcd", "metaserver", "node-0", "node-1"}
    for name, url in metrics.items():
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.status == 200 and b"process_" in r.read() or name == "etcd", name
    up_pid = u.proc.pid
    arena_dirs = glob.glob(f"/dev/shm/umbp-up-{up_pid}-*")
    assert len(arena_dirs) == 1 and sorted(os.listdir(arena_dirs[0])) == ["umbp-node-0.arena", "umbp-node-1.arena"]

    keys = [f"up/{i}" for i in range(40)]
    with umbp.Client(addr) as c:
        assert c.batch_put(keys, [payload(k) for k in keys]) == [True] * len(keys)
    where = {k if isinstance(k, str) else k.decode(): node
             for _ns, k, _s, node, _st in u.cli_json(addr, "ls", "--limit", "1000")["objects"]}
    on1 = [k for k in keys if where[k] == "node-1"]
    assert 0 < len(on1) < len(keys)
    pid1 = {n["node_id"]: n["pid"] for n in u.cli_json(addr, "nodes")}["node-1"]

    os.kill(pid1, signal.SIGKILL)
    u.wait_stderr(rf"^up: node-1 \(pid {pid1}\) was killed by SIGKILL; restarting it with the same node id and arena")
    m = u.wait_stderr(r"^up: node-1 restarted \(pid (\d+)\), kept (\d+) pages; metrics: (\S+)$")
    assert int(m.group(2)) == len(on1), "its arena came back with every page on it"
    assert m.group(3) == metrics["node-1"], "same metrics port after the restart"
    pid1b = int(m.group(1))
    with umbp.Client(addr) as c:
        for k in keys:
            assert c.get(k) == payload(k)
    nodes = {n["node_id"]: n for n in u.cli_json(addr, "nodes")}
    assert nodes["node-1"]["pid"] == pid1b and nodes["node-1"]["alive"] and nodes["node-0"]["alive"]

    os.kill(pid1b, signal.SIGKILL)  # the second death within the window: over --max-restarts 1
    u.wait_stderr(r"^up: node-1 was killed by SIGKILL; it died 2 times within 600s, over the restart limit \(1\): "
                  r"left down, the rest of the pool serves on")
    assert u.proc.poll() is None, "the pool keeps serving"
    with umbp.Client(addr) as c:
        for k in keys:
            if where[k] == "node-0":
                assert c.get(k) == payload(k)

    u.proc.send_signal(signal.SIGTERM)
    assert u.proc.wait(30) == 0
    assert not os.path.exists(arena_dirs[0]), "`up` removes the arenas it made"


def _children(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as fh:
                    stat = fh.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # field 4, after the command's closing paren
                out.append(int(d))
    return out


def test_a_killed_up_leaves_no_process_and_the_next_start_removes_its_arenas(up):
    """SIGKILL to `umbp up` (no handler runs, no stop()): its etcd, metaserver and nodes die with it (they carry
    PR_SET_PDEATHSIG); its arena directory, which a dead pool's nodes can no longer use, and its work directory
    (etcd data, logs) are removed by the next pool that starts on this machine, and that pool's own are left alone."""
    first = up("--nodes", "2", "--capacity", "16MiB", "--port", "0")
    first.stdout_until(r"^metaserver: (\S+)$")
    first.stdout_until(r"^metrics: (http://\S+) \((\S+)\)$", 4)
    kids = _children(first.proc.pid)
    assert len(kids) == 4, f"etcd, metaserver and 2 nodes under `up`: {kids}"
    (arena_dir,) = glob.glob(f"/dev/shm/umbp-up-{first.proc.pid}-*")
    assert sorted(os.listdir(arena_dir)) == ["umbp-node-0.arena", "umbp-node-1.arena"]
    (workdir,) = _workdirs(first.proc.pid)
    assert "etcd" in os.listdir(workdir)

    os.kill(first.proc.pid, signal.SIGKILL)
    assert first.proc.wait(10) == -signal.SIGKILL
    def gone() -> bool:  # the processes' exits
        alive = [p for p in kids if os.path.exists(f"/proc/{p}") and "Z" not in _state(p)]
        if alive:
            raise NotYet(f"still alive: {alive}")
        return True

    eventually(gone, WAIT_S, "the children of the killed `up` gone", interval=0.1)
    assert os.path.isdir(arena_dir) and os.path.isdir(workdir), "nothing removed them yet: the killed pool ran no cleanup"

    second = up("--nodes", "1", "--capacity", "16MiB", "--port", "0")
    second.stdout_until(r"^metaserver: (\S+)$")
    second.wait_stderr(rf"^up: removed {re.escape(arena_dir)}: the arenas of a pool whose process is gone$")
    second.wait_stderr(rf"^up: removed {re.escape(workdir)}: the work directory of a pool whose process is gone$")
    assert not os.path.exists(arena_dir) and not os.path.exists(workdir)
    (own,) = glob.glob(f"/dev/shm/umbp-up-{second.proc.pid}-*")
    assert os.listdir(own) == ["umbp-node-0.arena"], "the new pool's own arena is there"
    assert len(_workdirs(second.proc.pid)) == 1, "and its own work directory"


def test_up_with_several_metaservers_prints_its_line_once_every_slot_is_served(up):
    """Issue 42: `umbp up --metaservers 3` printed its `metaserver:` line as soon as its last metaserver printed its
    own, while that process's share of the slots was still being handed over to it (it had just said "0 of 16
    slots led here"), and a first batch_put right after met slots in a handover. Now the line comes once every slot
    is served by the process the ranking gives it, and the membership role too: asked at once, each process leads
    exactly its share. And each slot places on every node already (CI's bench met "storage nodes not fenced yet"
    on its first put into a fresh 2-process pool)."""
    from test_failover import raw

    from metaserver.ha.slots import leaders, rank
    from transport.wire import Op

    u = up("--metaservers", "3", "--slots", "16", "--nodes", "2", "--capacity", "16MiB", "--port", "0")
    (ms,) = u.stdout_until(r"^metaserver: (\S+)$")
    addrs = ms.group(1).split(",")
    stats = {a: raw(a, Op.STATS) for a in addrs}  # at once: no wait between the line and these
    led = {a: sorted(st["slots_led"]) for a, st in stats.items()}
    placing = {int(s): n for st in stats.values() for s, n in st["placeable_nodes"].items()}
    assert placing == {s: 2 for s in range(16)}, u.stderr()
    membership = [a for a in addrs if raw(a, Op.LEADER)["is_leader"]]
    want = leaders(16, addrs)
    assert led == {a: [s for s in range(16) if want[s] == a] for a in addrs}, u.stderr()
    assert membership == [rank("m", sorted(addrs))[0]]


def _workdirs(pid: int) -> list[str]:
    """The work directories (etcd data, logs) `umbp up` process ``pid`` made in the temporary directory."""
    return glob.glob(os.path.join(tempfile.gettempdir(), f"umbp-up-{pid}-*"))


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
