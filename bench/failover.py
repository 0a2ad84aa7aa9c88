"""Failover benchmark: how long after SIGKILL of the leader a warm standby serves LOOKUPs, with N pages.

Steps (every process real, on this machine):

1. etcd (the ``etcd`` on PATH or next to this Python) with a temporary data directory, and metaserver A, which
   leads from then on (it loads an empty directory).
2. Fill: ``--pages`` pages (default 1,000,000) written straight into etcd in the metaserver's record format
   (commit records of up to 128 pages, ``metaserver.store.persist.EtcdStore``), 8 records (about 1,024 pages) a
   transaction with several in flight, not through
   the data path (A does not learn of them: it only holds the leadership, which is all this measures of it). Keys
   are 32-byte digests in chains of ``--chain`` pages (each names its parent), spread over ``--nodes`` node arenas
   of 64 KiB objects filled to half. The nodes exist only as durable arena records with a lease_ttl of an hour: a
   metaserver loads them as provisional nodes whose grace outlasts the benchmark, so their pages are served (LOOKUP
   answers locations; no bytes are read: this measures the directory, not the nodes).
3. Metaserver B starts as a standby and is waited for until it reports its warm copy (``warm standby: N pages at
   revision R``, printed once its snapshot is loaded and it follows the watch): its initial load time and RSS.
4. SIGKILL of A. B is polled directly (no leader following) with a LOOKUP of ``--sample`` random keys every 5 ms;
   the figure is the time from the kill until a LOOKUP finds every key, printed next to the election TTL (the
   target is TTL + 1 s). B's STATS ``takeover`` says how it took over (``load_pages`` 0: no page read).
5. With ``--cold``: B is SIGKILLed too and metaserver C started at that instant, i.e. a standby without a warm
   copy yet (what every takeover cost before the warm standby): the time until C serves, for comparison.

A leader is not started on the filled etcd on purpose: a full load of 1 M pages holds the event loop longer than
the election TTL (the lease would lapse while it loads); that is the cold path this change takes out of failover.

Nothing asserts; figures are this machine's (2 busy cores here: other work shares them) and printed with N.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import msgpack  # noqa: E402

from metaserver.store.persist import BATCH_PAGES, EtcdStore  # noqa: E402
from transport.framed import FramedSocket  # noqa: E402
from transport.wire import Op  # noqa: E402
from transport.objformat import ARENA_DATA_START, object_size
from umbp.config import ETCD_TXN_OPS  # noqa: E402
from umbp.errors import UmbpError  # noqa: E402
from umbp.launcher import find_etcd, free_port, pdeathsig_setter  # noqa: E402

PREFIX = "/umbp"
NS = "default"
PLEN = 64 * 1024 - 64  # a 64 KiB object per page
TXN_RECORDS = 8  # commit records a transaction (about 1,024 pages, 100 KB)
INFLIGHT = 8  # transactions in flight while filling
READY_LINE = re.compile(r"^metaserver: (\S+):(\d+)$", re.M)
WARM_LINE = re.compile(r"metaserver: warm standby: (\d+) pages at revision (\d+) \(loaded in ([\d.]+)s\)")


def page_key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


def node_record(node_id: str, capacity: int) -> dict:
    return {"node_id": node_id, "host": "127.0.0.1", "port": 1, "pid": 0, "capacity": capacity,
            "arena_id": hashlib.md5(node_id.encode()).digest(), "arena_path": "", "boot_id": "", "hostname": "bench",
            "transports": ["tcp"], "lease_ttl": 3600.0, "rdma": None}


async def fill(addr: str, pages: int, nodes: int, chain: int) -> float:
    """Write the arena records and ``pages`` page records; returns the seconds it took."""
    store = EtcdStore(addr, PREFIX)
    await store.wait_ready(20)
    per_node = -(-pages // nodes)
    capacity = 2 * per_node * object_size(PLEN)  # half full: no watermark eviction
    await store.txn([store.op_put(store.arena_key(f"bench{j}"),
                                  msgpack.packb(node_record(f"bench{j}", capacity), use_bin_type=True))
                     for j in range(nodes)])
    slots = [0] * nodes
    t0 = time.monotonic()
    queue: asyncio.Queue = asyncio.Queue(maxsize=2 * INFLIGHT)

    async def writer() -> None:
        while True:
            ops = await queue.get()
            if ops is None:
                return
            await store.txn(ops)

    workers = [asyncio.create_task(writer()) for _ in range(INFLIGHT)]
    ops: list = []
    rec: list = []  # the commit record being filled: BATCH_PAGES pages of one chain at most
    parent = None
    for i in range(pages):
        c = i // chain
        node = c % nodes
        k = page_key(i)
        if i % chain == 0:
            parent = None
        if rec and (i % chain == 0 or len(rec) == BATCH_PAGES):
            ops.append(store.op_put(store.batch_name(NS), msgpack.packb(rec, use_bin_type=True)))
            rec = []
        off = ARENA_DATA_START + slots[node] * object_size(PLEN)
        slots[node] += 1
        rec.append((k, f"bench{node}", off, PLEN, i + 1, parent))
        parent = k
        if len(ops) == TXN_RECORDS:
            await queue.put(ops)
            ops = []
        if i and i % 200_000 == 0:
            print(f"  filled {i:,} pages ({i / (time.monotonic() - t0):,.0f}/s)", flush=True)
    if rec:
        ops.append(store.op_put(store.batch_name(NS), msgpack.packb(rec, use_bin_type=True)))
    if ops:
        await queue.put(ops)
    for _ in workers:
        await queue.put(None)
    await asyncio.gather(*workers)
    await store.close()
    return time.monotonic() - t0


_die_with_parent = pdeathsig_setter()  # preexec_fn: the child gets SIGKILL when this benchmark dies (Linux prctl)


class Child:
    """A child process with its stdout+stderr in a log file."""

    def __init__(self, name: str, argv: list[str], workdir: Path, env: dict[str, str] | None = None):
        self.name = name
        self.log = workdir / f"{name}.log"
        e = dict(os.environ)
        e.update(env or {})
        e["PYTHONUNBUFFERED"] = "1"
        e["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), e.get("PYTHONPATH")) if p)
        with open(self.log, "wb") as fh:
            self.proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=e,
                                         cwd=workdir, preexec_fn=_die_with_parent)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_line(self, rx: re.Pattern, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            m = rx.search(self.text())
            if m:
                return m
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{self.name}: no line matching {rx.pattern!r} (exit {self.proc.poll()}):\n"
                                 f"{self.text()[-3000:]}")
            time.sleep(0.05)

    def rss(self) -> int:
        """Resident memory in bytes (VmRSS), 0 once it exited."""
        try:
            for line in open(f"/proc/{self.proc.pid}/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def metaserver(name: str, etcd: str, workdir: Path, ttl: int) -> tuple[Child, str]:
    addr = f"127.0.0.1:{free_port()}"
    return Child(name, [sys.executable, "-m", "umbp", "metaserver", "--etcd", etcd, "--listen", addr], workdir,
                 {"UMBP_ELECTION_TTL_S": str(ttl)}), addr


def ask(addr: str, op: int, meta: dict, timeout: float = 2.0):
    """One request to exactly ``addr``; the answer meta, or None when it refuses (standby, taking over) or is
    unreachable."""
    deadline = time.monotonic() + timeout
    try:
        s = FramedSocket(addr, "bench", deadline)
    except UmbpError:
        return None
    try:
        return s.request(op, meta, deadline).meta
    except (UmbpError, OSError):
        return None
    finally:
        s.close()


def time_to_serve(addr: str, sample: list[bytes], t0: float, limit_s: float) -> float | None:
    """Seconds from ``t0`` until a LOOKUP of ``sample`` at ``addr`` finds every key (polled every 5 ms)."""
    while time.monotonic() - t0 < limit_s:
        r = ask(addr, Op.LOOKUP, {"ns": NS, "keys": sample})
        if r is not None and all(loc is not None for loc in r["locs"]):
            return time.monotonic() - t0
        time.sleep(0.005)
    return None


def mib(n: int) -> str:
    return f"{n / (1 << 20):,.0f} MiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=1_000_000)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--chain", type=int, default=64, help="pages per chain (each names the previous as parent)")
    ap.add_argument("--ttl", type=int, default=5, help="election TTL in seconds (the metaserver default)")
    ap.add_argument("--sample", type=int, default=1000, help="keys per LOOKUP while waiting for the new leader")
    ap.add_argument("--cold", action="store_true", help="also time a standby started at the kill (no warm copy)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, etcd data)")
    a = ap.parse_args()
    binary = find_etcd()
    if binary is None:
        print("failover: no etcd binary (make etcd)")
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="umbp-failover-"))
    children: list[Child] = []
    try:
        cport, pport = free_port(), free_port()
        etcd_addr = f"127.0.0.1:{cport}"
        etcd = Child("etcd", [binary, "--name", "bench", "--data-dir", str(workdir / "etcd"),
                              "--listen-client-urls", f"http://{etcd_addr}", "--advertise-client-urls",
                              f"http://{etcd_addr}", "--listen-peer-urls", f"http://127.0.0.1:{pport}",
                              "--initial-advertise-peer-urls", f"http://127.0.0.1:{pport}", "--initial-cluster",
                              f"bench=http://127.0.0.1:{pport}", "--auto-compaction-retention=1",
                              "--quota-backend-bytes=8589934592", "--logger=zap",
                              f"--max-txn-ops={ETCD_TXN_OPS}"], workdir)
        children.append(etcd)
        print(f"failover: {a.pages:,} pages on {a.nodes} nodes, election ttl {a.ttl}s; work dir {workdir}", flush=True)
        ma, addr_a = metaserver("metaserver-a", etcd_addr, workdir, a.ttl)
        children.append(ma)
        ma.wait_line(READY_LINE, 60)
        fill_s = asyncio.run(fill(etcd_addr, a.pages, a.nodes, a.chain))
        print(f"fill: {a.pages:,} pages (commit records) in {fill_s:.1f}s ({a.pages / fill_s:,.0f}/s), etcd RSS "
              f"{mib(etcd.rss())}; leader A at {addr_a}", flush=True)

        mb, addr_b = metaserver("metaserver-b", etcd_addr, workdir, a.ttl)
        children.append(mb)
        m = mb.wait_line(WARM_LINE, 600)
        warm_pages, warm_rev, warm_s = int(m.group(1)), int(m.group(2)), float(m.group(3))
        time.sleep(1.0)  # let the load's garbage go before reading RSS
        rss_b = mb.rss()
        print(f"standby B: warm copy of {warm_pages:,} pages at revision {warm_rev}, initial load {warm_s:.2f}s, "
              f"RSS {mib(rss_b)} ({rss_b / max(1, warm_pages):,.0f} B/page)", flush=True)

        rng = random.Random(1)
        sample = [page_key(rng.randrange(a.pages)) for _ in range(a.sample)]
        t_kill = time.monotonic()
        ma.kill(signal.SIGKILL)
        serve_s = time_to_serve(addr_b, sample, t_kill, 120)
        st = ask(addr_b, Op.STATS, {}, timeout=30) or {}
        tk = st.get("takeover", {})
        verdict = "met" if serve_s is not None and serve_s <= a.ttl + 1 else "NOT met"
        print(f"failover: SIGKILL of A -> B serves LOOKUPs of {a.sample} random pages after "
              f"{serve_s if serve_s is None else round(serve_s, 2)}s; election ttl {a.ttl}s, target ttl + 1 = "
              f"{a.ttl + 1}s: {verdict}", flush=True)
        print(f"takeover: {json.dumps(tk)}; B serves {st.get('objects', 0):,} pages, RSS {mib(mb.rss())}", flush=True)

        if a.cold:
            mc, addr_c = metaserver("metaserver-c", etcd_addr, workdir, a.ttl)
            children.append(mc)
            t_kill = time.monotonic()
            mb.kill(signal.SIGKILL)  # C starts at the same instant: a standby with no warm copy yet
            mc.wait_line(READY_LINE, 600)
            cold_s = time_to_serve(addr_c, sample, t_kill, 600)
            tc = (ask(addr_c, Op.STATS, {}, timeout=30) or {}).get("takeover", {})
            print(f"for comparison, a standby without a warm copy (started at the kill): serves after "
                  f"{cold_s if cold_s is None else round(cold_s, 2)}s; takeover {json.dumps(tc)}", flush=True)
        return 0
    finally:
        for c in reversed(children):
            try:
                c.kill(signal.SIGKILL if c.name != "etcd" else signal.SIGTERM)
            except BaseException:  # noqa: BLE001 - a second Ctrl-C: still stop the rest
                c.proc.kill()
        if a.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
