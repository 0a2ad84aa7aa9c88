#!/usr/bin/env python3
"""Hosts on one machine: network namespaces joined by veth pairs to a bridge, for multi-host tests of the pool.

Each ``Host`` is a network namespace ``umbp-<pid>-<name>`` whose ``eth0`` (a private address in a /24 picked so it
overlaps no route of this machine) is one end of a veth pair; the other end sits on the bridge ``ubr<pid>`` in the
root namespace, which also carries ``.1`` so the test process (the "operator's box") reaches every host. Processes
start through ``Host.wrap()``: ``ip netns exec`` into the namespace, then ``unshare --mount --uts`` so each host has
its own hostname and its own ``/dev/shm`` (a per-host directory bind-mounted over it). Same-host shared memory
therefore never crosses hosts: a client on one host cannot open another host's arena and talks TCP to it, exactly
as across machines. A node restarted on the same host finds its arena again (same directory).

With ``image_root`` (a built image's filesystem, ``tests/image.py``), the process runs chrooted into it with the
image's own Python and packages (``/dev``, ``/proc`` and the host's shm directory mounted inside), so the tested
processes are the image the manifests name, not the checkout.

Faults: ``cut()``/``restore()`` set the bridge side of the host's veth down/up (the host's carrier drops);
``impair(loss=..., delay_ms=..., rate=...)`` uses ``tc netem`` when the kernel has it, else loss through iptables'
``statistic`` match and a rate limit through ``tbf`` (delay has no substitute and is reported as unavailable);
``clear()`` removes them.

Client agents (``Agent``): a long-lived ``python tests/netns.py agent`` in a client host holding one
``umbp.Client``, driven by JSON lines on stdin/stdout, so a test pays interpreter start once per host. Page bytes
are a function of (key, seed) (``page_bytes``): the agent writes them and, on reads, returns the sha256 of what it
received, which the test compares with its own computation: byte-exact across hosts without shipping pages back.

Cleanup: ``Rack.close()`` stops the harness's processes first, then deletes the namespaces (their veths go with
them) and the bridge. ``sweep_stale()`` removes namespaces and bridges of test processes that died without it.
Every command has a timeout; nothing here waits unboundedly. Needs root, ``ip`` (iproute2) and ``unshare``
(util-linux); ``support()`` says why not when they are missing.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import ipaddress
import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CMD_TIMEOUT_S = 20.0
PREFIX = "umbp-"

# sh script run (after ip netns exec + unshare) in a fresh mount and UTS namespace: name the host, give it its own
# /dev/shm, then exec the command ($1 hostname, $2 shm dir, $3 image root or "").
_HOST_SH = r"""
set -e
hostname "$1"
if [ -n "$3" ]; then
    R="$3"
    mount --rbind /dev "$R/dev"
    mount --bind "$2" "$R/dev/shm"
    mount -t proc proc "$R/proc"
    shift 3
    exec chroot "$R" /usr/bin/env -i PATH=/opt/umbp/bin:/usr/local/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8 \
        PYTHONUNBUFFERED=1 UMBP_ARENA_DIR=/dev/shm "$@"
fi
mount --bind "$2" /dev/shm
shift 3
exec "$@"
"""


class NetnsError(AssertionError):
    """A namespace, link or traffic-control command failed (carries the command and its output)."""


def sh(*cmd: str, check: bool = True, timeout: float = CMD_TIMEOUT_S) -> subprocess.CompletedProcess:
    try:
        r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise NetnsError(f"netns: `{' '.join(cmd)}` did not finish within {timeout}s") from None
    if check and r.returncode != 0:
        raise NetnsError(f"netns: `{' '.join(cmd)}` exited with {r.returncode}: {r.stderr.strip() or r.stdout}")
    return r


# ----------------------------------------------------------------------------------------------------- probing

_support: tuple[bool, str] | None = None


def support() -> tuple[bool, str]:
    """Whether namespaces, veths and a bridge can be made here (tried once, for real). Never raises."""
    global _support
    if _support is not None:
        return _support
    if os.environ.get("UMBP_SKIP_NETNS"):
        _support = (False, f"UMBP_SKIP_NETNS={os.environ['UMBP_SKIP_NETNS']!r} is set")
        return _support
    missing = [b for b in ("ip", "unshare", "mount", "chroot") if shutil.which(b) is None]
    if missing and os.geteuid() == 0 and shutil.which("apt-get"):  # a bare Debian: fetch them once, as testbed.py does
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "iproute2", "util-linux", "mount",
                   "coreutils"]
        for cmd in (install, ["apt-get", "update", "-q"], install):
            subprocess.run(cmd, env=env, capture_output=True, timeout=600, stdin=subprocess.DEVNULL)
            missing = [b for b in missing if shutil.which(b) is None]
            if not missing:
                break
    if missing:
        _support = (False, f"missing commands: {', '.join(missing)} (Debian: iproute2, util-linux, mount, coreutils)")
        return _support
    if os.geteuid() != 0:
        _support = (False, "not root: network namespaces, veth pairs and bridges need CAP_NET_ADMIN and CAP_SYS_ADMIN")
        return _support
    ns, br = f"{PREFIX}{os.getpid()}-probe", f"ubp{os.getpid()}"
    try:
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", br, "type", "bridge")
        sh("ip", "link", "add", f"{br}v", "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "netns", "exec", ns, "unshare", "--mount", "--uts", "true")
        _support = (True, "ok")
    except NetnsError as e:
        _support = (False, str(e))
    finally:
        sh("ip", "link", "del", br, check=False)
        sh("ip", "link", "del", f"{br}v", check=False)
        sh("ip", "netns", "del", ns, check=False)
    return _support


def probe_impairments(ns: str) -> dict[str, bool]:
    """Which link impairments this kernel offers, tried on ``lo`` of namespace ``ns``."""
    out = {}
    for name, add in (("netem", ["netem", "delay", "1ms"]), ("tbf", ["tbf", "rate", "10mbit", "burst", "32kbit",
                                                                    "latency", "400ms"])):
        r = sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", *add, check=False)
        out[name] = r.returncode == 0
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "lo", "root", check=False)
    r = sh("ip", "netns", "exec", ns, "iptables", "-A", "INPUT", "-i", "lo", "-m", "statistic", "--mode", "random",
           "--probability", "0.0", "-j", "DROP", check=False) if shutil.which("iptables") else None
    out["iptables"] = r is not None and r.returncode == 0
    if out["iptables"]:
        sh("ip", "netns", "exec", ns, "iptables", "-F", "INPUT", check=False)
    return out


def sweep_stale() -> list[str]:
    """Delete namespaces ``umbp-<pid>-*`` and bridges ``ubr<pid>``/``ubp<pid>`` whose pid is gone."""
    removed = []

    def dead(pid: int) -> bool:
        try:
            os.kill(pid, 0)
            return False
        except ProcessLookupError:
            return True
        except PermissionError:
            return False

    r = sh("ip", "netns", "list", check=False)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(rf"{PREFIX}(\d+)-\S+", name)
        if m and dead(int(m.group(1))):
            sh("ip", "netns", "del", name, check=False)
            removed.append(name)
    r = sh("ip", "-o", "link", "show", check=False)
    for m in re.finditer(r"^\d+: (ub[rp](\d+))[:@]", r.stdout, re.M):
        if dead(int(m.group(2))):
            sh("ip", "link", "del", m.group(1), check=False)
            removed.append(m.group(1))
    return removed


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 that no route or address of this machine overlaps (several test runs may be up at once)."""
    used = []
    for line in sh("ip", "-4", "route", "show", "table", "all", check=False).stdout.splitlines() + \
            sh("ip", "-4", "-o", "addr", "show", check=False).stdout.split():
        for tok in re.findall(r"\d+\.\d+\.\d+\.\d+(?:/\d+)?", line):
            with contextlib.suppress(ValueError):
                used.append(ipaddress.ip_network(tok, strict=False))
    pid = os.getpid()
    for i in range(256):
        net = ipaddress.ip_network(f"10.{200 + (pid + i) % 50}.{(pid // 50 + i) % 256}.0/24")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise NetnsError("netns: no free 10.x.y.0/24 subnet")


# ----------------------------------------------------------------------------------------------------- topology


class Host:
    """One host: a network namespace with ``eth0`` at ``ip`` on the rack's bridge, and a /dev/shm of its own."""

    def __init__(self, rack: "Rack", name: str, ip: str, shm_dir: Path):
        self.rack = rack
        self.name = name
        self.ns = f"{PREFIX}{os.getpid()}-{name}"
        self.ip = ip
        self.veth = f"ub{os.getpid() % 100000}{name}"[:15]  # the bridge side, in the root namespace
        self.shm_dir = shm_dir
        self.impaired: list[str] = []

    def create(self) -> None:
        self.shm_dir.mkdir(parents=True, exist_ok=True)
        sh("ip", "netns", "add", self.ns)
        # a veth of this name can outlive its rack for a while: the kernel tears a deleted namespace down
        # asynchronously (and a rack of the same process reuses the names), so a stale one is removed first
        sh("ip", "link", "del", self.veth, check=False)
        sh("ip", "link", "add", self.veth, "type", "veth", "peer", "name", "eth0", "netns", self.ns)
        sh("ip", "link", "set", self.veth, "master", self.rack.bridge, "up")
        sh("ip", "-n", self.ns, "addr", "add", f"{self.ip}/{self.rack.net.prefixlen}", "dev", "eth0")
        sh("ip", "-n", self.ns, "link", "set", "eth0", "up")
        sh("ip", "-n", self.ns, "link", "set", "lo", "up")

    def wrap(self, image_root: str | Path | None = None) -> list[str]:
        """argv prefix that runs a command as a process of this host (chrooted into ``image_root`` if given)."""
        return ["ip", "netns", "exec", self.ns, "unshare", "--mount", "--uts", "--propagation", "private",
                "sh", "-c", _HOST_SH, "umbp-host", self.name, str(self.shm_dir), str(image_root or "")]

    def exec(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return sh("ip", "netns", "exec", self.ns, *cmd, check=check)

    # --- faults

    def cut(self) -> None:
        """Pull the cable: the bridge side of the veth goes down, the host's eth0 loses its carrier."""
        sh("ip", "link", "set", self.veth, "down")

    def restore(self) -> None:
        sh("ip", "link", "set", self.veth, "up")

    def impair(self, loss: float = 0.0, delay_ms: int = 0, rate: str | None = None) -> list[str]:
        """Degrade the host's eth0 both ways (egress qdisc + ingress drop). Returns what was applied, in words;
        raises NetnsError naming what this kernel lacks when nothing can express the request."""
        applied = []
        caps = self.rack.caps
        if caps.get("netem") and (loss or delay_ms):
            args = ["netem"] + (["delay", f"{delay_ms}ms"] if delay_ms else []) + (["loss", f"{loss:g}%"] if loss
                                                                                  else [])
            if rate:
                args += ["rate", rate]
            self.exec("tc", "qdisc", "add", "dev", "eth0", "root", *args)
            applied.append("tc " + " ".join(args))
        else:
            if delay_ms:
                raise NetnsError("netns: a delay needs tc netem (sch_netem), which this kernel does not offer")
            if loss:
                if not caps.get("iptables"):
                    raise NetnsError("netns: packet loss needs tc netem or iptables' statistic match; neither works")
                p = f"{min(loss, 100.0) / 100:.4f}"
                for chain in ("INPUT", "OUTPUT"):
                    flag = "-i" if chain == "INPUT" else "-o"
                    self.exec("iptables", "-A", chain, flag, "eth0", "-m", "statistic", "--mode", "random",
                              "--probability", p, "-j", "DROP")
                applied.append(f"iptables statistic drop p={p} (in and out)")
            if rate:
                if not caps.get("tbf"):
                    raise NetnsError("netns: a rate limit needs tc tbf or netem; neither works")
                self.exec("tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate, "burst", "64kb",
                          "latency", "500ms")
                applied.append(f"tc tbf rate {rate}")
        self.impaired += applied
        return applied

    def dropped(self) -> int:
        """Packets the impairments dropped so far (iptables rule counters, or the netem qdisc's drop count)."""
        n = 0
        if self.rack.caps.get("iptables"):
            for chain in ("INPUT", "OUTPUT"):
                out = self.exec("iptables", "-L", chain, "-v", "-x", "-n", check=False).stdout
                n += sum(int(line.split()[0]) for line in out.splitlines() if "DROP" in line and
                         line.split()[0].isdigit())
        out = self.exec("tc", "-s", "qdisc", "show", "dev", "eth0", check=False).stdout
        n += sum(int(m) for m in re.findall(r"dropped (\d+)", out))
        return n

    def clear(self) -> None:
        self.exec("tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        if self.rack.caps.get("iptables"):
            self.exec("iptables", "-F", "INPUT", check=False)
            self.exec("iptables", "-F", "OUTPUT", check=False)
        self.impaired.clear()

    def __repr__(self) -> str:
        return f"<Host {self.name} {self.ip} ns={self.ns}>"


RACK_LOCK = "/tmp/umbp-netns-rack.lock"  # flock: one Rack at a time on this machine


class Rack:
    """A bridge and ``names`` hosts on it. ``close()`` (idempotent) stops ``harness``'s processes, then removes the
    namespaces and the bridge."""

    def __init__(self, harness: Any, names: list[str]):
        ok, why = support()
        if not ok:
            raise NetnsError(f"netns: cannot make network namespaces here: {why}")
        # One rack at a time on this machine (parallel test workers: make test): racks would race for a free subnet
        # and share the image build. Held until close(); a worker that dies drops it with its file descriptor.
        self._lock = open(RACK_LOCK, "a")
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        sweep_stale()
        self.harness = harness
        self.bridge = f"ubr{os.getpid()}"
        self.net = _free_subnet()
        addrs = list(self.net.hosts())
        self.gateway = str(addrs[0])
        self.hosts: dict[str, Host] = {}
        self._closed = False
        try:
            sh("ip", "link", "add", self.bridge, "type", "bridge")
            sh("ip", "addr", "add", f"{self.gateway}/{self.net.prefixlen}", "dev", self.bridge)
            sh("ip", "link", "set", self.bridge, "up")
            for i, name in enumerate(names):
                h = Host(self, name, str(addrs[10 + i]), Path(harness.shm_dir) / f"host-{name}")
                self.hosts[name] = h
                h.create()
            self.caps = probe_impairments(next(iter(self.hosts.values())).ns)
        except BaseException:
            self.close()
            raise

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.harness.close()
        finally:
            for h in self.hosts.values():
                sh("ip", "link", "del", h.veth, check=False)  # both ends, now (a namespace goes asynchronously)
                sh("ip", "netns", "del", h.ns, check=False)
            sh("ip", "link", "del", self.bridge, check=False)
            self._lock.close()  # releases the flock: the next rack may start


# ----------------------------------------------------------------------------------------------------- clients


def page_bytes(key: str, seed: int, size: int) -> bytes:
    """The page a test writes under ``key`` for ``seed``: pseudo-random, reproducible on every host."""
    return hashlib.shake_128(f"{seed}:{key}".encode()).digest(size)


def digest(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


class Agent:
    """``python tests/netns.py agent`` in a host, one ``umbp.Client`` inside, one JSON request per line.

    ``call(op, **args)`` blocks until the answer line (bounded by ``timeout``) and returns it as a dict; an
    ``{"error": ...}`` answer raises NetnsError. Its stderr goes to ``<workdir>/<name>.err``."""

    def __init__(self, host: Host, metaserver: str, workdir: Path, name: str | None = None, timeout_s: float = 5.0):
        self.host = host
        self.name = name or f"agent-{host.name}"
        self.err_path = Path(workdir) / f"{self.name}.err"
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p))
        argv = host.wrap() + [sys.executable, str(HERE / "netns.py"), "agent", "--metaserver", metaserver,
                              "--timeout", str(timeout_s)]
        with open(self.err_path, "ab") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env,
                                         cwd=workdir, start_new_session=True)
        self._buf = b""
        self.call("ping", timeout=60.0)  # the interpreter and the client are up

    def call(self, op: str, timeout: float = 60.0, **args: Any) -> dict:
        if self.proc.poll() is not None:
            raise NetnsError(f"{self.name}: exited with {self.proc.returncode}\n{self.tail()}")
        self.proc.stdin.write(json.dumps({"op": op, **args}).encode() + b"\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise NetnsError(f"{self.name}: no answer to {op} within {timeout:.0f}s\n{self.tail()}")
            ready, _, _ = select.select([fd], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise NetnsError(f"{self.name}: exited during {op} ({self.proc.wait(5)})\n{self.tail()}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        reply = json.loads(line)
        if "error" in reply:
            raise NetnsError(f"{self.name}: {op}: {reply['error']}")
        return reply

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.err_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.proc.stdin.close()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def agent_main(metaserver: str, timeout: float) -> int:
    """The agent's loop: requests on stdin, answers on stdout. Ops: ping; put {keys, seed, size} -> stored;
    get {keys, seed, size} -> lengths (-1 miss) and sha256 per key (null for a miss) and how long it took;
    transports; counters."""
    import umbp

    client = umbp.Client(metaserver=metaserver, timeout=timeout)
    for line in sys.stdin:
        try:
            req = json.loads(line)
            op = req["op"]
            t0 = time.monotonic()
            if op == "ping":
                out: dict = {"ok": True, "hostname": os.uname().nodename}
            elif op == "put":
                vals = [page_bytes(k, req["seed"], req["size"]) for k in req["keys"]]
                out = {"stored": client.batch_put(req["keys"], vals)}
            elif op == "get":
                bufs = [bytearray(req["size"]) for _ in req["keys"]]
                got = client.batch_get_into(req["keys"], bufs)
                out = {"got": got, "sha256": [digest(memoryview(b)[:g]) if g >= 0 else None
                                              for b, g in zip(bufs, got)]}
            elif op == "transports":
                out = {"transports": client.transport_names()}
            elif op == "counters":
                out = {"counters": client.counters}
            else:
                out = {"error": f"unknown op {op!r}"}
            out["seconds"] = round(time.monotonic() - t0, 4)
        except Exception as e:  # noqa: BLE001 - every failure is an answer; the test decides
            out = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
    client.close()
    return 0


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="tests/netns.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("agent", help="a client host's agent (JSON lines on stdin/stdout)")
    a.add_argument("--metaserver", required=True)
    a.add_argument("--timeout", type=float, default=5.0)
    sub.add_parser("sweep", help="remove namespaces and bridges of dead test runs")
    sub.add_parser("probe", help="say whether namespaces can be made here, and which impairments work")
    args = p.parse_args(argv)
    if args.cmd == "agent":
        return agent_main(args.metaserver, args.timeout)
    if args.cmd == "sweep":
        print("\n".join(sweep_stale()) or "nothing to sweep")
        return 0
    ok, why = support()
    print(f"namespaces: {'yes' if ok else 'NO'} ({why})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
