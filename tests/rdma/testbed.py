#!/usr/bin/env python3
"""The Soft-RoCE test bed: real RDMA verbs in a QEMU guest on machines without RDMA hardware.

The host kernel has no InfiniBand support, so verbs run inside a software-emulated (TCG) QEMU guest booting
Debian's own kernel with ``rdma_rxe``. The guest owns nothing: a tiny busybox initramfs mounts the host's ``/``
read-only over virtio-9p under a tmpfs overlay and switch_roots into it, so the guest runs the host's
``/usr/bin/python3`` (which has pyverbs), this checkout and the project venv without copying anything. Each run
gets a fresh results directory shared read-write over a second 9p mount; the guest writes the command's output,
exit code and timings there, then powers off. See shared/notes/rdma-testbed.md for the facts this relies on.

Commands (stdlib only)::

    python tests/rdma/testbed.py setup                  # idempotent; cached under tests/rdma/.build/
    python tests/rdma/testbed.py run [--timeout S] -- CMD...
    python tests/rdma/testbed.py run2 --server 'CMD' --client 'CMD' [--timeout S] [--ipv4]

``run`` boots one guest with ``rxe0`` on ``lo`` (use GID index 1, ``::ffff:127.0.0.1``). ``run2`` boots two
guests joined by a QEMU socket netdev on host loopback, ``rxe0`` on ``eth0`` (MTU 9000), IPv6 link-local
addresses; each command sees ``UMBP_RDMA_SELF`` and ``UMBP_RDMA_PEER`` (``fe80::...%eth0``). Commands run with
bash from the repository root with ``PYTHONPATH`` = repo + the venv's site-packages, so ``python3`` (Debian's
3.11, the only one with pyverbs) imports umbp, msgpack, numpy and pytest. ``UMBP_RDMA_GUEST=1`` marks the guest.

The guest CPU is ``qemu64`` plus the x86-64-v2 flags (numpy 2.x dies with SIGILL on bare ``qemu64``), not
``-cpu max`` (rxe's CRC then picks PCLMUL, which TCG emulates slowly). ``UMBP_TESTBED_CPU`` overrides it;
``UMBP_TESTBED_KEEP=1`` keeps each run's directory (job script, console log) under .build/runs/.

Costs (measured on 2 shared cores): setup from a fresh machine is dominated by apt (about 30 s), cached 0.1 s; a
guest reaches its command 3-4 s after qemu starts (rxe up at 4-5 s) and a trivial command's whole run is about
11 s; the guest suite about 35 s; two guests about 20 s. Code runs several times slower than on the host (TCG).
Two guests eat two host cores: run one at a time.
The exit status of ``run`` is the command's; 124 means the guest was killed at the timeout, 125 that the guest
could not set up rxe.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
BUILD = HERE / ".build"
VENV_SITE = REPO / ".venv" / "lib" / "python3.11" / "site-packages"

PACKAGES = [
    "qemu-system-x86", "python3-pyverbs", "ibverbs-providers", "ibverbs-utils", "rdma-core",
    "busybox-static", "cpio", "kmod", "iproute2", "perftest",
]
INITRD_MODULES = ["virtio_pci", "virtio_net", "9p", "9pnet_virtio", "overlay"]
GUEST_MEM = "2G"
# qemu64 plus x86-64-v2 (numpy 2.x needs SSSE3..SSE4.2/POPCNT). Not -cpu max: rxe's CRC would pick PCLMUL, which TCG
# emulates slowly.
GUEST_CPU = os.environ.get("UMBP_TESTBED_CPU", "qemu64,+ssse3,+sse4.1,+sse4.2,+popcnt,+cx16")
MACS = ("52:54:00:12:34:01", "52:54:00:12:34:02")

# /init of the initramfs (busybox sh). Loads the modules listed in /modules.order, mounts the host's / read-only
# over 9p under a tmpfs overlay, the per-run results share, the unpacked kernel's modules, then switch_roots into
# the overlay and runs the per-run job script with bash as PID 1.
INIT_SCRIPT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /modules.order); do insmod /modules/$m 2>/dev/null || echo "init: insmod $m failed"; done
mkdir -p /lower /rw /newroot
ok=0
for i in 1 2 3 4 5 6 7 8 9 10; do
  if mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /lower; then ok=1; break; fi
  sleep 0.5
done
[ $ok = 1 ] || { echo "init: cannot mount hostroot"; echo o > /proc/sysrq-trigger; sleep 5; }
mount -t tmpfs -o size=1g tmpfs /rw
mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /newroot
mkdir -p /newroot/umbp-results
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 results /newroot/umbp-results
KVER=$(uname -r)
mkdir -p /newroot/lib/modules/$KVER
mount --bind /newroot$(cat /kmods.path) /newroot/lib/modules/$KVER
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
mount --move /dev /newroot/dev
exec switch_root /newroot /bin/bash /umbp-results/job.sh
"""

# The per-run job, run by bash as PID 1 in the switched root. It must never exit: it powers the guest off.
JOB_SCRIPT = r"""#!/bin/bash
R=/umbp-results
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
cat /proc/uptime > $R/boot_uptime
exec >>$R/output.log 2>&1 </dev/null
# The checkout may live under /tmp or /run (CI clones anywhere): set it aside before the fresh tmpfs mounts hide it.
mkdir -p /umbp-repo && mount --bind {{REPO}} /umbp-repo
mount -t tmpfs tmpfs /tmp; mount -t tmpfs tmpfs /run
mkdir -p {{REPO}} && mount --bind /umbp-repo {{REPO}}
mkdir -p /dev/shm /dev/pts; mount -t tmpfs tmpfs /dev/shm; mount -t devpts devpts /dev/pts
ip link set lo up
finish() { echo $1 > $R/rc.tmp; mv $R/rc.tmp $R/rc; cat /proc/uptime > $R/end_uptime; sync;
           echo o > /proc/sysrq-trigger; sleep 30; }
{ {{NET_SETUP}}
  modprobe rdma_rxe && rdma link add rxe0 type rxe netdev {{NETDEV}}; } || { echo "testbed: rxe setup failed"; finish 125; }
cat /proc/uptime > $R/ready_uptime
export UMBP_RDMA_GUEST=1 UMBP_RDMA_NETDEV={{NETDEV}} {{EXTRA_ENV}}
export PYTHONPATH={{PYTHONPATH}} PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
cd {{REPO}}
bash $R/cmd.sh
finish $?
"""


def log(msg: str) -> None:
    print(f"testbed: {msg}", file=sys.stderr, flush=True)


def _sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw)


# --------------------------------------------------------------------------------------------------------- setup

def can_run() -> tuple[bool, str]:
    """Whether this machine can run the guest (or set itself up to). Never raises."""
    if os.environ.get("UMBP_SKIP_RDMA"):
        return False, f"UMBP_SKIP_RDMA={os.environ['UMBP_SKIP_RDMA']!r} is set"
    if _ready_info() is not None and shutil.which("qemu-system-x86_64"):
        return True, "ready"
    if not shutil.which("apt-get"):
        return False, "no qemu-system-x86_64 and no apt-get to install it"
    if os.geteuid() != 0:
        return False, "no qemu-system-x86_64 and not root, so apt-get cannot install it"
    return True, "can be set up with apt-get"


def _missing_packages() -> list[str]:
    missing = []
    for p in PACKAGES:
        r = subprocess.run(["dpkg-query", "-W", "-f=${Status}", p], text=True, capture_output=True, check=False)
        if r.returncode != 0 or "install ok installed" not in r.stdout:
            missing.append(p)
    return missing


def _apt_install(pkgs: list[str]) -> None:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *pkgs]
    if subprocess.run(cmd, env=env, capture_output=True, text=True, check=False).returncode != 0:
        log("apt-get install failed; running apt-get update once")
        _sh(["apt-get", "update"], env=env)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise SystemExit(f"testbed: apt-get install failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")


def _kernel_package() -> str:
    out = _sh(["apt-cache", "depends", "linux-image-amd64"]).stdout
    m = re.search(r"Depends:\s*(linux-image-\d[\w.+-]*-amd64)", out)
    if not m:
        raise SystemExit(f"testbed: cannot resolve linux-image-amd64's kernel from:\n{out}")
    return m.group(1)


def _ready_info() -> dict | None:
    try:
        info = json.loads((BUILD / "ready.json").read_text())
    except (OSError, ValueError):
        return None
    if info.get("init_sha") != _init_sha() or not Path(info.get("initrd", "")).exists():
        return None
    return info


def _init_sha() -> str:
    return hashlib.sha256((INIT_SCRIPT + repr(INITRD_MODULES)).encode()).hexdigest()[:16]


def setup(force: bool = False) -> dict:
    """Install packages, fetch and unpack the guest kernel, build the initramfs. Idempotent; returns ready.json."""
    t0 = time.monotonic()
    if not force and (info := _ready_info()) is not None and not _missing_packages():
        return info
    if os.geteuid() != 0:
        raise SystemExit("testbed: setup needs root (apt-get install, apt-get download)")
    missing = _missing_packages()
    if missing:
        log(f"installing {' '.join(missing)}")
        _apt_install(missing)
    BUILD.mkdir(parents=True, exist_ok=True)

    kdir = BUILD / "kernel"
    try:
        pkg = _kernel_package()
    except subprocess.CalledProcessError:
        _sh(["apt-get", "update"])
        pkg = _kernel_package()
    kver = pkg.removeprefix("linux-image-")
    kroot = kdir / "root"
    vmlinuz = kroot / "boot" / f"vmlinuz-{kver}"
    if not vmlinuz.exists():
        shutil.rmtree(kdir, ignore_errors=True)
        kdir.mkdir(parents=True)
        log(f"downloading {pkg}")
        try:
            _sh(["apt-get", "download", "-o", "APT::Sandbox::User=root", pkg], cwd=kdir)
        except subprocess.CalledProcessError:
            _sh(["apt-get", "update"])
            _sh(["apt-get", "download", "-o", "APT::Sandbox::User=root", pkg], cwd=kdir)
        deb = next(kdir.glob("linux-image-*.deb"))
        _sh(["dpkg", "-x", str(deb), str(kroot)])
        deb.unlink()
    kmods = kroot / "lib" / "modules" / kver
    if not (kmods / "modules.dep").exists():
        _sh(["depmod", "-b", str(kroot), kver])

    initrd = BUILD / f"initramfs-{kver}.cpio.gz"
    info = {"kernel_version": kver, "vmlinuz": str(vmlinuz), "initrd": str(initrd), "kmods": str(kmods),
            "init_sha": _init_sha()}
    _build_initramfs(kroot, kver, kmods, initrd)
    (BUILD / "ready.json").write_text(json.dumps(info, indent=1))
    log(f"setup done in {time.monotonic() - t0:.1f} s (kernel {kver})")
    return info


def _build_initramfs(kroot: Path, kver: str, kmods: Path, initrd: Path) -> None:
    order: list[Path] = []
    for mod in INITRD_MODULES:
        out = _sh(["modprobe", "-d", str(kroot), "-S", kver, "--show-depends", mod]).stdout
        for line in out.splitlines():
            parts = line.split()
            if parts and parts[0] == "insmod" and Path(parts[1]) not in order:
                order.append(Path(parts[1]))
    with tempfile.TemporaryDirectory(dir=BUILD) as tmp:
        root = Path(tmp)
        for d in ("bin", "proc", "sys", "dev", "modules"):
            (root / d).mkdir()
        shutil.copy2("/bin/busybox", root / "bin" / "busybox")
        names = []
        for ko in order:
            name = ko.name
            if name.endswith(".xz"):
                data = subprocess.run(["xz", "-dc", str(ko)], check=True, capture_output=True).stdout
                name = name[:-3]
                (root / "modules" / name).write_bytes(data)
            elif name.endswith(".zst"):
                data = subprocess.run(["zstd", "-dc", str(ko)], check=True, capture_output=True).stdout
                name = name[:-4]
                (root / "modules" / name).write_bytes(data)
            else:
                shutil.copy2(ko, root / "modules" / name)
            names.append(name)
        (root / "modules.order").write_text("\n".join(names) + "\n")
        (root / "kmods.path").write_text(str(kmods) + "\n")
        init = root / "init"
        init.write_text(INIT_SCRIPT)
        init.chmod(0o755)
        tmp_out = initrd.with_suffix(".tmp")
        subprocess.run(f"find . | cpio -o -H newc -R 0:0 --quiet | gzip -1 > {shlex.quote(str(tmp_out))}",
                       shell=True, check=True, cwd=root)
        tmp_out.rename(initrd)
    log(f"initramfs {initrd.name}: modules {' '.join(names)}")


# ----------------------------------------------------------------------------------------------------------- run

@dataclass
class GuestResult:
    rc: int  # the command's exit status; 124 timeout, 125 rxe setup failed, 126 guest gave no status
    output: str
    wall_s: float  # qemu start to qemu exit
    boot_s: float | None = None  # guest uptime when the job started (kernel + initramfs + switch_root)
    ready_s: float | None = None  # guest uptime when rxe was up
    end_s: float | None = None  # guest uptime when the command finished
    console: str = ""
    timings: dict = field(default_factory=dict)

    def summary(self) -> str:
        f = lambda v: "?" if v is None else f"{v:.1f}s"
        return (f"rc={self.rc} wall={self.wall_s:.1f}s boot={f(self.boot_s)} rxe-ready={f(self.ready_s)} "
                f"cmd-end={f(self.end_s)}")


class Guest:
    """One QEMU guest process. ``start`` returns at once; ``wait`` blocks up to the deadline, then kills it."""

    def __init__(self, cmd: str, *, netdev: str = "lo", net_args: list[str] | None = None, net_setup: str = "",
                 env: dict[str, str] | None = None, name: str = "guest", stream: bool = True):
        self.info = setup()
        self.name = name
        self.stream = stream
        runs = BUILD / "runs"
        runs.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=runs))
        pythonpath = ":".join(str(p) for p in (REPO, VENV_SITE) if p.exists())
        extra = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
        job = (JOB_SCRIPT.replace("{{NETDEV}}", netdev).replace("{{NET_SETUP}}", net_setup)
               .replace("{{EXTRA_ENV}}", extra).replace("{{PYTHONPATH}}", shlex.quote(pythonpath))
               .replace("{{REPO}}", shlex.quote(str(REPO))))
        (self.dir / "job.sh").write_text(job)
        (self.dir / "cmd.sh").write_text(cmd + "\n")
        (self.dir / "output.log").write_text("")
        self.argv = [
            "qemu-system-x86_64", "-accel", "tcg", "-cpu", GUEST_CPU, "-m", GUEST_MEM, "-smp", "1",
            "-nographic", "-no-reboot", "-nodefaults", "-serial", "stdio",
            "-kernel", self.info["vmlinuz"], "-initrd", self.info["initrd"],
            "-append", "console=ttyS0 quiet loglevel=3 panic=-1 ipv6.disable=0",
            "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
            "-virtfs", f"local,path={self.dir},mount_tag=results,security_model=none",
            *(net_args or ["-nic", "none"]),
        ]
        self.proc: subprocess.Popen | None = None
        self.t0 = 0.0

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.console = open(self.dir / "console.log", "wb")  # noqa: SIM115 -- closed by wait()
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self.console,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        if self.stream:
            self._stop = threading.Event()
            self._tail = threading.Thread(target=self._follow, daemon=True)
            self._tail.start()

    def _follow(self) -> None:
        """Echo the guest command's output to stderr as it is written (the 9p share is the host's file)."""
        prefix = f"[{self.name}] ".encode()
        with open(self.dir / "output.log", "rb") as f:
            buf = b""
            while True:
                chunk = f.read(65536)
                if chunk:
                    buf += chunk
                    *lines, buf = buf.split(b"\n")
                    for line in lines:
                        sys.stderr.buffer.write(prefix + line + b"\n")
                    sys.stderr.flush()
                elif self._stop.is_set():
                    if buf:
                        sys.stderr.buffer.write(prefix + buf + b"\n")
                    return
                else:
                    time.sleep(0.2)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def wait(self, deadline: float) -> GuestResult:
        assert self.proc is not None
        timed_out = False
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            self.kill()
        finally:
            self.console.close()
        wall = time.monotonic() - self.t0
        if self.stream:
            self._stop.set()
            self._tail.join(timeout=5)
        rd = lambda n: (self.dir / n).read_text(errors="replace") if (self.dir / n).exists() else ""
        upt = lambda n: float(rd(n).split()[0]) if rd(n).strip() else None
        rc_text = rd("rc").strip()
        rc = 124 if timed_out else (int(rc_text) if rc_text.lstrip("-").isdigit() else 126)
        res = GuestResult(rc=rc, output=rd("output.log"), wall_s=wall, boot_s=upt("boot_uptime"),
                          ready_s=upt("ready_uptime"), end_s=upt("end_uptime"), console=rd("console.log"))
        if timed_out:
            res.output += f"\ntestbed: {self.name} killed after {wall:.0f} s (timeout)\n"
        if rc == 126:
            res.output += f"\ntestbed: {self.name} powered off without an exit status; console:\n{res.console[-4000:]}"
        if not os.environ.get("UMBP_TESTBED_KEEP"):
            shutil.rmtree(self.dir, ignore_errors=True)
        return res


def run(cmd: str, timeout: float = 600, stream: bool = True) -> GuestResult:
    """Boot one guest with rxe0 on lo, run ``cmd`` (bash) from the repo root, return its result. Blocks."""
    g = Guest(cmd, stream=stream)
    g.start()
    try:
        return g.wait(time.monotonic() + timeout)
    finally:
        g.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    want = f"0100007F:{port:04X}"
    try:
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return False
    return any(ln.split()[1] == want and ln.split()[3] == "0A" for ln in lines)


def _link_local(mac: str) -> str:
    b = [int(x, 16) for x in mac.split(":")]
    b[0] ^= 0x02
    words = [(b[0] << 8) | b[1], (b[2] << 8) | 0xFF, 0xFE00 | b[3], (b[4] << 8) | b[5]]
    return "fe80::" + ":".join(f"{w:x}" for w in words)


def run2(server_cmd: str, client_cmd: str, timeout: float = 600, stream: bool = True,
         server_grace: float = 30, ipv4: bool = False) -> tuple[GuestResult, GuestResult]:
    """Boot guests A (server) and B (client) on one virtual Ethernet; rxe0 on eth0, MTU 9000. Blocks.

    Addresses are IPv6 link-local only, unless ``ipv4`` (10.77.0.1 and .2/24, in ``UMBP_RDMA_SELF4`` and
    ``UMBP_RDMA_PEER4``; perftest's TCP exchange is IPv4-only; note rxe then also lists an IPv4-mapped GID).
    The server command must exit on its own; it gets ``server_grace`` seconds after the client finished."""
    port = _free_port()
    addrs = [_link_local(m) for m in MACS]
    guests = []
    for i, (role, cmd, mode) in enumerate((("server", server_cmd, "listen"), ("client", client_cmd, "connect"))):
        net_setup = ("sysctl -qw net.ipv6.conf.eth0.accept_dad=0; ip link set eth0 mtu 9000 && ip link set eth0 up "
                     + (f"&& ip addr add 10.77.0.{i + 1}/24 dev eth0 " if ipv4 else "")
                     + "&& for i in $(seq 50); do ip -6 addr show dev eth0 scope link | grep -q 'inet6' && break; "
                     "sleep 0.1; done &&")
        env = {"UMBP_RDMA_ROLE": role, "UMBP_RDMA_SELF": f"{addrs[i]}%eth0", "UMBP_RDMA_PEER": f"{addrs[1 - i]}%eth0"}
        if ipv4:
            env.update(UMBP_RDMA_SELF4=f"10.77.0.{i + 1}", UMBP_RDMA_PEER4=f"10.77.0.{2 - i}")
        net = ["-netdev", f"socket,id=n0,{mode}=127.0.0.1:{port}",
               "-device", f"virtio-net-pci,netdev=n0,mac={MACS[i]},romfile="]
        guests.append(Guest(cmd, netdev="eth0", net_args=net, net_setup=net_setup, env=env,
                            name=f"guest-{'AB'[i]}-{role}", stream=stream))
    a, b = guests
    deadline = time.monotonic() + timeout
    try:
        a.start()
        while not _listening(port):
            if a.proc.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        b.start()
        rb = b.wait(deadline)
        ra = a.wait(min(deadline, time.monotonic() + server_grace))
        return ra, rb
    finally:
        a.kill()
        b.kill()


# ----------------------------------------------------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="testbed.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("setup", help="install and build the guest (idempotent)")
    s.add_argument("--force", action="store_true", help="rebuild the initramfs even if cached")
    r = sub.add_parser("run", help="run CMD in one guest (rxe0 on lo)")
    r.add_argument("--timeout", type=float, default=600)
    r.add_argument("cmd", nargs=argparse.REMAINDER)
    r2 = sub.add_parser("run2", help="server CMD in guest A, client CMD in guest B (rxe0 on eth0)")
    r2.add_argument("--server", required=True)
    r2.add_argument("--client", required=True)
    r2.add_argument("--timeout", type=float, default=600)
    r2.add_argument("--ipv4", action="store_true", help="also give eth0 IPv4 addresses (perftest needs them)")
    a = p.parse_args(argv)
    if a.what == "setup":
        print(json.dumps(setup(force=a.force), indent=1))
        return 0
    ok, why = can_run()
    if not ok:
        log(f"cannot run guests: {why}")
        return 3
    if a.what == "run":
        cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
        if not cmd:
            p.error("run needs a command after --")
        res = run(cmd[0] if len(cmd) == 1 else shlex.join(cmd), timeout=a.timeout)
        log(res.summary())
        return res.rc
    ra, rb = run2(a.server, a.client, timeout=a.timeout, ipv4=a.ipv4)
    log(f"server: {ra.summary()}")
    log(f"client: {rb.summary()}")
    return rb.rc or ra.rc


if __name__ == "__main__":
    sys.exit(main())
