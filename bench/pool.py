"""Pool benchmark: figures for the core data and metadata paths, each next to a baseline measured in the same run.

What it measures (client in this process, the node and metaserver in their own processes, started here):
- put and get GB/s for 64 KiB, 1 MiB and 4 MiB pages in batches of 64, over ``tcp`` and over ``shm``;
  baselines: one raw loopback TCP stream (a sender process, ``recv_into`` a preallocated buffer) for tcp, and
  single-thread memcpy of the same page sizes for shm;
- ``batch_exists`` keys/s in 1,000-key batches (target: 1,000,000 keys/s);
- committed puts/s with etcd persistence (4 KiB pages, 128 per batch, several client threads so commits
  coalesce); baseline: etcd's own puts/s with 100 puts per transaction, several transactions in flight.

Nothing here asserts: it prints each figure, its baseline and the ratio, with the target next to it. Run with
``make bench`` (or ``python bench/pool.py --quick`` for a short pass).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import umbp  # noqa: E402
from umbp.config import split_host_port  # noqa: E402
from umbp.launcher import LocalPool  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
SIZES = [64 * KiB, 1 * MiB, 4 * MiB]
BATCH = 64


def timed(fn, min_time: float, max_rounds: int = 1000) -> float:
    """Run fn repeatedly for at least min_time seconds (at least 3 rounds); return the best seconds per round."""
    best = float("inf")
    start = time.perf_counter()
    rounds = 0
    while rounds < 3 or (time.perf_counter() - start < min_time and rounds < max_rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        rounds += 1
    return best


# ---- baselines ------------------------------------------------------------------------------------------------

def _stream_sender(port: int, total: int, chunk: int) -> None:
    buf = np.random.randint(0, 255, chunk, dtype=np.uint8)
    mv = memoryview(buf)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        sent = 0
        while sent < total:
            n = min(chunk, total - sent)
            s.sendall(mv[:n])
            sent += n


def raw_tcp_gbps(total: int = 2 << 30, chunk: int = 4 * MiB) -> float:
    """One loopback TCP stream from another process into a preallocated buffer with recv_into."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    p = mp.get_context("spawn").Process(target=_stream_sender, args=(port, total, chunk))
    p.start()
    conn, _ = srv.accept()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    dst = np.empty(chunk, np.uint8)
    mv = memoryview(dst)
    got = 0
    t = time.perf_counter()
    while got < total:
        n = conn.recv_into(mv, min(chunk, total - got))
        if not n:
            break
        got += n
    dt = time.perf_counter() - t
    p.join(10)
    conn.close()
    srv.close()
    return got / dt / 1e9


def etcd_txn_puts_per_s(etcd_url: str, seconds: float, per_txn: int = 100, in_flight: int = 4) -> float:
    import aetcd

    host, port = split_host_port(etcd_url)

    async def main() -> float:
        async with aetcd.Client(host, port) as c:
            value = b"v" * 64
            count = 0
            end = time.perf_counter() + seconds

            async def worker(w: int) -> None:
                nonlocal count
                i = 0
                while time.perf_counter() < end:
                    ops = [c.transactions.put(b"/bench/etcd/%d/%d" % (w, i * per_txn + j), value)
                           for j in range(per_txn)]
                    await c.transaction(compare=[], success=ops, failure=[])
                    count += per_txn
                    i += 1
            t = time.perf_counter()
            await asyncio.gather(*(worker(w) for w in range(in_flight)))
            dt = time.perf_counter() - t
            await c.delete_prefix(b"/bench/etcd/")
            return count / dt
    return asyncio.run(main())


# ---- the pool -------------------------------------------------------------------------------------------------

def _commit_worker(ms: str, w: int, seconds: float, batch: int, out) -> None:
    val = b"p" * 4000
    with umbp.Client(ms, namespace="bench-commit") as c:
        c.batch_put([f"warm/{w}"], [val])
        n, i = 0, 0
        t = time.perf_counter()
        end = t + seconds
        while time.perf_counter() < end:
            n += sum(c.batch_put([f"c/{w}/{i}/{j}" for j in range(batch)], [val] * batch))
            i += 1
        out.put((n, time.perf_counter() - t))


class PoolBench:
    """Each figure moves a working set larger than the CPU caches, like a real pool: pages are put once (the
    put figure), then read back in rotating batches of 64 (the get figure)."""

    def __init__(self, metaserver: str, min_time: float, working_set: int):
        self.ms = metaserver
        self.min_time = min_time
        self.working_set = working_set

    def put_get(self, transport: str, size: int) -> tuple[float, float]:
        n_batches = max(2, self.working_set // (size * BATCH))
        with umbp.Client(self.ms, namespace=f"bench-{transport}", transport=transport) as c:
            vals = [np.random.randint(0, 255, size, dtype=np.uint8) for _ in range(BATCH)]
            outs = [np.empty(size, np.uint8) for _ in range(BATCH)]
            keys = [[f"{size}/{b}/{i}" for i in range(BATCH)] for b in range(n_batches)]
            c.batch_put(["warm"], [vals[0]])  # connect and map outside the timing
            t = time.perf_counter()
            for kb in keys:
                assert all(c.batch_put(kb, vals))
            put_s = time.perf_counter() - t
            moved, b = 0, 0
            t = time.perf_counter()
            while time.perf_counter() - t < self.min_time or b < n_batches:
                got = c.batch_get_into(keys[b % n_batches], outs)
                assert got == [size] * BATCH, got
                moved += BATCH * size
                b += 1
            get_s = time.perf_counter() - t
            assert all(np.array_equal(v, o) for v, o in zip(vals, outs))
            for kb in keys:
                c.batch_remove(kb)
            c.remove("warm")
            return n_batches * BATCH * size / put_s / 1e9, moved / get_s / 1e9

    def exists_keys_per_s(self) -> float:
        with umbp.Client(self.ms, namespace="bench-exists") as c:
            keys = [f"e/{i}" for i in range(1000)]
            c.batch_put(keys[:500], [b"x"] * 500)
            assert sum(c.batch_exists(keys)) == 500
            return 1000 / timed(lambda: c.batch_exists(keys), self.min_time, max_rounds=100000)

    def committed_puts_per_s(self, seconds: float, procs: int = 1, batch: int = 128) -> float:
        """Client processes putting 4 KiB pages in batches of 128; every put is acknowledged only after etcd
        holds its record."""
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        ps = [ctx.Process(target=_commit_worker, args=(self.ms, w, seconds, batch, q)) for w in range(procs)]
        for p in ps:
            p.start()
        res = [q.get(timeout=seconds + 120) for _ in ps]
        for p in ps:
            p.join(10)
        return sum(n for n, _ in res) / max(dt for _, dt in res)


def memcpy_gbps(size: int, working_set: int, min_time: float) -> float:
    """Single-thread memcpy of 64-page batches rotating through a working set of the same size as the pool's."""
    n = max(2 * BATCH, working_set // size)
    src = np.random.randint(0, 255, n * size, dtype=np.uint8).reshape(n, size)
    dsts = [np.empty(size, np.uint8) for _ in range(BATCH)]
    moved, b = 0, 0
    t = time.perf_counter()
    while time.perf_counter() - t < min_time or b < 3:
        base = (b * BATCH) % (n - BATCH + 1)
        for i, d in enumerate(dsts):
            np.copyto(d, src[base + i])
        moved += BATCH * size
        b += 1
    return moved / (time.perf_counter() - t) / 1e9


def row(name: str, value: float, unit: str, base_name: str, base: float, target: float | None) -> str:
    ratio = value / base if base else float("nan")
    tgt = f"target >= {target:g}x: {'MET' if ratio >= target else 'MISSED'}" if target else ""
    return f"{name:<34} {value:>12,.2f} {unit:<7} | {base_name:<30} {base:>12,.2f} | ratio {ratio:5.2f}  {tgt}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs (for a smoke check)")
    ap.add_argument("--capacity", default="3GiB", help="node arena size")
    args = ap.parse_args()
    min_time = 0.3 if args.quick else 1.5
    lines = []
    print("umbp bench/pool.py: starting etcd, a metaserver and one node (separate processes) ...", flush=True)
    with LocalPool(nodes=1, capacity=args.capacity, port=0) as pool:
        ws = (256 << 20) if args.quick else (768 << 20)
        b = PoolBench(pool.metaserver, min_time, ws)
        raw = raw_tcp_gbps(total=(1 << 30) if args.quick else (3 << 30))
        print(f"baseline raw loopback TCP stream: {raw:.2f} GB/s", flush=True)
        for transport in ("tcp", "shm"):
            for size in SIZES:
                put, get = b.put_get(transport, size)
                label = f"{size // KiB} KiB" if size < MiB else f"{size // MiB} MiB"
                if transport == "tcp":
                    base_name, base = "raw TCP stream GB/s", raw
                    tget = 0.7 if size >= MiB else None
                else:
                    base_name, base = f"memcpy {label} GB/s", memcpy_gbps(size, ws, min_time)
                    tget = 0.6
                lines.append(row(f"{transport} get {label} x{BATCH}", get, "GB/s", base_name, base, tget))
                lines.append(row(f"{transport} put {label} x{BATCH}", put, "GB/s", base_name, base, None))
                print(lines[-2] + "\n" + lines[-1], flush=True)
        ex = b.exists_keys_per_s()
        lines.append(f"{'batch_exists 1000-key batches':<34} {ex:>12,.0f} keys/s  | target >= 1,000,000 keys/s: "
                     f"{'MET' if ex >= 1e6 else 'MISSED'}")
        print(lines[-1], flush=True)
        secs = 3 if args.quick else 8
        # the pool first: the baseline leaves hundreds of thousands of tombstones behind in etcd
        commits = b.committed_puts_per_s(secs)
        etcd_rate = etcd_txn_puts_per_s(pool.etcd_url, secs)
        lines.append(row("committed puts (etcd-persisted)", commits, "puts/s", "etcd txn puts/s (100/txn)",
                         etcd_rate, 0.5))
        print(lines[-1], flush=True)
    print("\n=== summary (figure | baseline | ratio) ===")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
