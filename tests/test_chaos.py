"""Chaos: clients put and get checked pages while nodes, the metaserver leader and etcd are killed and restarted.

For ``UMBP_CHAOS_S`` seconds (default 60) ``WORKERS`` client processes loop over batches of puts of fresh keys and
gets of keys put by anyone. A page's bytes derive from its key (``payload``), so every get is checked byte for byte
in the process that made it. Meanwhile a harness thread, on a schedule drawn from a fixed seed (``UMBP_CHAOS_SEED``,
printed), SIGKILLs and restarts a storage node (same node id and port: it reopens its arena), SIGKILLs and restarts
the metaserver leader, and restarts etcd (SIGTERM or SIGKILL, same data and ports). One node, ``STABLE``, is never
killed.

Contracts checked at the end:
- every get returned the exact bytes put, a miss (-1 / None), or an ``UmbpError`` (counted by class): ZERO wrong
  bytes and no other exception;
- every page whose put returned True and that was placed on a node that stayed up the whole run is readable, byte
  for byte, after the chaos (capacity is large and the watermarks are at 1.0, so nothing is evicted: a miss there is
  a lost committed page, not an eviction);
- the run made progress through the faults (puts and exact gets by the hundred, at least one kill of each kind).

Where a page was placed is asked right after its put (a LOOKUP through ``Client.admin``, lease released at once);
when that lookup fails (metaserver down) the page is only held to the no-wrong-bytes rule.

HA: ``METASERVERS`` is the number of metaservers; with more than one, ``leader()`` asks each which one leads
(Op.LEADER) and the chaos thread kills that one.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import umbp
from cluster import eventually
from transport import wire
from transport.framed import FramedSocket
from umbp.errors import UmbpError

METASERVERS = int(os.environ.get("UMBP_CHAOS_METASERVERS", "1"))  # >1: the chaos thread kills the leader
NODES = 3
STABLE = "node0"  # never killed: every page committed to it must survive
WORKERS = 3
DURATION_S = float(os.environ.get("UMBP_CHAOS_S", "60"))
SEED = int(os.environ.get("UMBP_CHAOS_SEED", "20240611"))
LEASE_TTL = 3
CLIENT_TIMEOUT_S = 8
BATCH = 8


def size_of(key: str) -> int:
    h = hashlib.sha256(key.encode()).digest()
    return 100 + int.from_bytes(h[:2], "little") % 8000


def payload(key: str) -> bytes:
    """The bytes of ``key``'s page: a function of the key only, so any process can check a get."""
    seed = hashlib.sha256(b"chaos:" + key.encode()).digest()
    n = size_of(key)
    return (seed * (n // len(seed) + 1))[:n]


# ---------------------------------------------------------------------------------------------------------------
# worker process


def worker_main(addr: str, wid: int, seed: int, duration: float, out_path: str) -> None:
    """Put and get until ``duration`` passes; write counts and the committed keys (with their node) as JSON."""
    rng = random.Random(seed * 1000 + wid)
    counts: Counter = Counter()
    errors: Counter = Counter()
    wrong: list = []
    committed: list = []  # [key, node_id or None]
    vanished: list = []  # [key, monotonic time]: put answered True, but a lookup right after found nothing
    seq = 0
    c = umbp.Client(addr, timeout=CLIENT_TIMEOUT_S)
    end = time.monotonic() + duration
    started = False
    while time.monotonic() < end:
        if not started and committed:  # the parent starts the faults once every worker has stored a batch
            started = True
            with open(out_path + ".started", "w") as fh:
                fh.write(str(len(committed)))
        if not committed or rng.random() < 0.5:
            keys = [f"w{wid}/{seq + i}" for i in range(BATCH)]
            seq += BATCH
            try:
                res = c.batch_put(keys, [payload(k) for k in keys])
            except UmbpError as e:
                errors[f"put {type(e).__name__}"] += 1
                counts["put_batches_failed"] += 1
                continue
            except Exception as e:  # noqa: BLE001 - counted, and the test fails on it
                errors[f"put UNEXPECTED {type(e).__name__}: {e}"] += 1
                continue
            ok = [k for k, r in zip(keys, res) if r]
            counts["puts_ok"] += len(ok)
            counts["puts_false"] += len(keys) - len(ok)  # fresh keys: False would be a bug
            nodes: list = [None] * len(ok)
            if ok:
                try:
                    m = c.admin(wire.Op.LOOKUP, {"ns": c.namespace, "keys": [k.encode() for k in ok]})
                    if m.get("lease"):
                        c.admin(wire.Op.RELEASE, {"lease": m["lease"]})
                    nodes = [loc[0] if loc else None for loc in m["locs"]]
                    missing = [k for k, loc in zip(ok, m["locs"]) if not loc]
                    counts["committed_not_found_at_once"] += len(missing)
                    vanished += [[k, time.monotonic()] for k in missing]
                except UmbpError:
                    counts["locate_failed"] += 1
            committed += [[k, n] for k, n in zip(ok, nodes)]
        else:
            keys = []
            for _ in range(BATCH):
                if rng.random() < 0.75:
                    keys.append(rng.choice(committed)[0])
                else:  # anyone's key space, put or not
                    keys.append(f"w{rng.randrange(WORKERS)}/{rng.randrange(max(seq, BATCH))}")
            try:
                if rng.random() < 0.2:
                    got_one = c.get(keys[0])
                    results = [(keys[0], -1 if got_one is None else len(got_one), got_one)]
                else:
                    outs = [bytearray(size_of(k)) for k in keys]
                    sizes = c.batch_get_into(keys, outs)
                    results = list(zip(keys, sizes, outs))
            except UmbpError as e:
                errors[f"get {type(e).__name__}"] += 1
                counts["get_calls_failed"] += 1
                continue
            except Exception as e:  # noqa: BLE001
                errors[f"get UNEXPECTED {type(e).__name__}: {e}"] += 1
                continue
            for k, n, data in results:
                if n == -1:
                    counts["gets_miss"] += 1
                elif n == size_of(k) and bytes(data[:n]) == payload(k):
                    counts["gets_exact"] += 1
                else:
                    counts["gets_wrong"] += 1
                    wrong.append([k, n])
        time.sleep(0.03)  # about 25 batches/s per worker: far from full after the run, gentle on small hosts
    c.close()
    with open(out_path, "w") as fh:
        json.dump({"counts": counts, "errors": errors, "wrong": wrong[:50], "committed": committed,
                   "seq": seq, "vanished": vanished}, fh)


def spawn_worker(addr: str, wid: int, out_path: Path, workdir: Path) -> subprocess.Popen:
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import test_chaos
        test_chaos.worker_main({addr!r}, {wid}, {SEED}, {DURATION_S}, {str(out_path)!r})
    """)
    log = open(workdir / f"worker{wid}.log", "wb")
    try:
        return subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
        log.close()


# ---------------------------------------------------------------------------------------------------------------
# the chaos thread


def leader(cluster):
    """The metaserver process that leads now (the only one when there is one)."""
    ms = [m for m in cluster.metaservers if m.alive]
    if len(cluster.metaservers) == 1:
        return cluster.metaservers[0]
    for m in ms:
        try:
            conn = FramedSocket(m.addr, "chaos leader probe", time.monotonic() + 2)
            try:
                if conn.request(wire.Op.LEADER, {}, time.monotonic() + 2).meta.get("is_leader"):
                    return m
            finally:
                conn.close()
        except UmbpError:
            continue
    return ms[0] if ms else cluster.metaservers[0]


class Chaos(threading.Thread):
    """Until ``stop`` is set: sleep a random 2-6 s, then kill and restart one process. The kinds come round in a
    shuffled cycle, so each kind happens at least once per cycle."""

    KINDS = ("node", "metaserver", "etcd")

    def __init__(self, cluster, rng: random.Random):
        super().__init__(name="chaos", daemon=True)
        self.cluster = cluster
        self.rng = rng
        self.stop = threading.Event()
        self.events: list[tuple[float, str, str]] = []
        self.counts: Counter = Counter()
        self.killed_nodes: set[str] = set()
        self.error: BaseException | None = None
        self.t0 = time.monotonic()

    def run(self) -> None:
        try:
            cycle: list[str] = []
            while not self.stop.wait(self.rng.uniform(2.0, 6.0)):
                if not cycle:
                    cycle = list(self.KINDS)
                    self.rng.shuffle(cycle)
                self.strike(cycle.pop())
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def strike(self, kind: str) -> None:
        t = time.monotonic()
        if kind == "node":
            node = self.rng.choice([n for n in self.cluster.nodes if n.node_id != STABLE])
            self.killed_nodes.add(node.node_id)
            down = self.rng.uniform(0, 2 * LEASE_TTL)  # sometimes back within its lease, sometimes not
            node.kill(signal.SIGKILL, wait=True)
            self.stop.wait(down)
            node.restart(sig=signal.SIGKILL)
            what = f"{node.node_id} down {down:.1f}s"
        elif kind == "metaserver":
            m = leader(self.cluster)
            # Alone it must come back within the clients' deadline; with standbys, at times long enough (past
            # election_ttl_s, 5 s) for one of them to take over.
            down = self.rng.uniform(0, 3 if len(self.cluster.metaservers) == 1 else 8)
            m.kill(signal.SIGKILL, wait=True)
            self.stop.wait(down)
            m.start()
            what = f"{m.name} (leader) down {down:.1f}s"
        else:
            etcd = self.cluster.etcd
            if self.rng.random() < 0.5:
                etcd.restart()
                what = "etcd SIGTERM"
            else:
                etcd.kill(signal.SIGKILL, wait=True)
                etcd.start()
                what = "etcd SIGKILL"
        self.counts[kind] += 1
        self.events.append((t - self.t0, kind, f"{what} (back in {time.monotonic() - t:.1f}s)"))


# ---------------------------------------------------------------------------------------------------------------


def test_chaos_no_wrong_bytes_and_no_lost_committed_pages(make_cluster, harness):
    print(f"\nchaos: seed {SEED}, {DURATION_S:.0f}s, {WORKERS} workers, {NODES} nodes, {METASERVERS} metaserver(s)")
    cluster = make_cluster(nodes=NODES, capacity="128MiB", lease_ttl=LEASE_TTL, metaservers=METASERVERS,
                           metaserver_flags={"env": {"UMBP_HIGH_WATERMARK": "1.0", "UMBP_LOW_WATERMARK": "1.0"}})
    assert cluster.nodes[0].node_id == STABLE
    addrs = cluster.metaserver_addrs
    outs = [harness.workdir / f"worker{w}.json" for w in range(WORKERS)]
    procs = [spawn_worker(addrs, w, outs[w], harness.workdir) for w in range(WORKERS)]
    chaos = Chaos(cluster, random.Random(SEED))
    try:
        # the first fault only once every worker has stored its first batch (its interpreter started, its client
        # reached the pool): a bounded poll of the workers' marker files
        markers = [Path(str(o) + ".started") for o in outs]
        eventually(lambda: all(m.exists() for m in markers) or any(p.poll() is not None for p in procs), 60,
                   "every worker's first batch stored (or a worker gone)")
        assert all(m.exists() for m in markers), f"workers not started: {[str(m) for m in markers if not m.exists()]}"
        chaos.t0 = time.monotonic()
        chaos.start()
        for p in procs:
            p.wait(DURATION_S + 90)
    finally:
        chaos.stop.set()
        chaos.join(60)
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert chaos.error is None, f"chaos thread failed: {chaos.error!r}"
    for p, w in zip(procs, range(WORKERS)):
        log = (harness.workdir / f"worker{w}.log").read_text(errors="replace")
        assert p.returncode == 0, f"worker {w} exited with {p.returncode}:\n{log[-3000:]}"

    counts: Counter = Counter()
    errors: Counter = Counter()
    wrong: list = []
    committed: list = []
    vanished: list = []
    for path in outs:
        r = json.loads(path.read_text())
        counts.update(r["counts"])
        errors.update(r["errors"])
        wrong += r["wrong"]
        committed += r["committed"]
        vanished += r["vanished"]

    # Everything back up, then read every committed page.
    for m in cluster.metaservers:
        if not m.alive:
            m.start()
    cluster.wait_nodes(timeout=30)
    must = [k for k, node in committed if node is not None and node not in chaos.killed_nodes]
    final: Counter = Counter()
    outcome: dict[str, str] = {}
    with umbp.Client(addrs, timeout=30) as c:
        keys = [k for k, _ in committed]
        for i in range(0, len(keys), 256):
            chunk = keys[i:i + 256]
            bufs = [bytearray(size_of(k)) for k in chunk]
            for k, n, b in zip(chunk, c.batch_get_into(chunk, bufs), bufs):
                if n == -1:
                    outcome[k] = "miss"
                elif n == size_of(k) and bytes(b) == payload(k):
                    outcome[k] = "exact"
                else:
                    outcome[k] = "wrong"
                    wrong.append([k, n])
                final[outcome[k]] += 1
        lost = [k for k in must if outcome[k] != "exact"]
        s = c.stats()

    by_node: dict = {}
    for k, node in committed:
        by_node.setdefault(str(node), Counter())[outcome[k]] += 1
    print(f"chaos: faults {dict(chaos.counts)}; nodes killed: {sorted(chaos.killed_nodes)}")
    for t, kind, what in chaos.events:
        print(f"  t={t:.1f} {kind}: {what}")
    print(f"chaos: puts ok {counts['puts_ok']}, put batches failed {counts['put_batches_failed']}, "
          f"gets exact {counts['gets_exact']}, misses {counts['gets_miss']}, WRONG {counts['gets_wrong']}, "
          f"get calls failed {counts['get_calls_failed']}, pages not found right after commit "
          f"{counts['committed_not_found_at_once']}, locate failed {counts['locate_failed']}")
    if vanished:
        print("chaos: put answered True but not found right after: "
              + ", ".join(f"{k} at t={t - chaos.t0:.1f}" for k, t in vanished[:10]))
    print(f"chaos: errors by class {dict(sorted(errors.items()))}")
    print(f"chaos: after: {len(committed)} committed pages read back: {dict(final)}; {len(must)} on never-killed "
          f"nodes, {len(lost)} of them lost; pool {s['objects']} objects, {s['used_bytes']} of "
          f"{s['capacity_bytes']} bytes")
    print(f"chaos: read back by the node each page was placed on: "
          f"{ {n: dict(c) for n, c in sorted(by_node.items())} }")

    assert counts["gets_wrong"] == 0 and final["wrong"] == 0 and not wrong, f"WRONG BYTES: {wrong[:20]}"
    assert not [e for e in errors if "UNEXPECTED" in e], errors
    assert counts["puts_false"] == 0, "a fresh key answered False (already existed)"
    assert not lost, f"{len(lost)} committed pages on never-killed nodes are gone: {lost[:10]}"
    assert s["used_bytes"] < 0.9 * s["capacity_bytes"]  # far from full: nothing was evicted
    assert counts["puts_ok"] >= 200 and counts["gets_exact"] >= 200, counts
    assert len(must) >= 100, "too few pages on the stable node to check durability"
    assert all(chaos.counts[k] >= 1 for k in Chaos.KINDS) or DURATION_S < 30, chaos.counts
