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
import threading
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


def memcpy_gbps(size: int, min_time: float) -> float:
    srcs = [np.random.randint(0, 255, size, dtype=np.uint8) for _ in range(BATCH)]
    dsts = [np.empty(size, np.uint8) for _ in range(BATCH)]

    def run():
        for s, d in zip(srcs, dsts):
            np.copyto(d, s)
    return BATCH * size / timed(run, min_time) / 1e9


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

class PoolBench:
    def __init__(self, metaserver: str, min_time: float):
        self.ms = metaserver
        self.min_time = min_time
        self.round = 0

    def put_get(self, transport: str, size: int) -> tuple[float, float]:
        with umbp.Client(self.ms, namespace=f"bench-{transport}", transport=transport) as c:
            vals = [np.random.randint(0, 255, size, dtype=np.uint8) for _ in range(BATCH)]
            outs = [np.empty(size, np.uint8) for _ in range(BATCH)]
            tag = f"{size}"

            def put():
                self.round += 1
                keys = [f"{tag}/{self.round}/{i}" for i in range(BATCH)]
                assert all(c.batch_put(keys, vals))
                self.last = keys
            put_s = timed(put, self.min_time, max_rounds=20)
            keys = self.last

            def get():
                got = c.batch_get_into(keys, outs)
                assert got == [size] * BATCH, got
            get_s = timed(get, self.min_time)
            assert all(np.array_equal(v, o) for v, o in zip(vals, outs))
            c.batch_remove([k for k in keys])
            return BATCH * size / put_s / 1e9, BATCH * size / get_s / 1e9

    def exists_keys_per_s(self) -> float:
        with umbp.Client(self.ms, namespace="bench-exists") as c:
            keys = [f"e/{i}" for i in range(1000)]
            c.batch_put(keys[:500], [b"x"] * 500)
            assert sum(c.batch_exists(keys)) == 500
            return 1000 / timed(lambda: c.batch_exists(keys), self.min_time, max_rounds=100000)

    def committed_puts_per_s(self, seconds: float, threads: int = 4, batch: int = 128) -> float:
        count = [0] * threads
        end = time.perf_counter() + seconds
        val = b"p" * 4000

        def worker(w: int) -> None:
            with umbp.Client(self.ms, namespace="bench-commit") as c:
                i = 0
                while time.perf_counter() < end:
                    keys = [f"c/{w}/{i}/{j}" for j in range(batch)]
                    count[w] += sum(c.batch_put(keys, [val] * batch))
                    i += 1
        t = time.perf_counter()
        ths = [threading.Thread(target=worker, args=(w,)) for w in range(threads)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(seconds + 60)
        return sum(count) / (time.perf_counter() - t)


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
        b = PoolBench(pool.metaserver, min_time)
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
                    base_name, base = f"memcpy {label} GB/s", memcpy_gbps(size, min_time)
                    tget = 0.6
                lines.append(row(f"{transport} get {label} x{BATCH}", get, "GB/s", base_name, base, tget))
                lines.append(row(f"{transport} put {label} x{BATCH}", put, "GB/s", base_name, base, None))
                print(lines[-2] + "\n" + lines[-1], flush=True)
        ex = b.exists_keys_per_s()
        lines.append(f"{'batch_exists 1000-key batches':<34} {ex:>12,.0f} keys/s  | target >= 1,000,000 keys/s: "
                     f"{'MET' if ex >= 1e6 else 'MISSED'}")
        print(lines[-1], flush=True)
        secs = 3 if args.quick else 8
        etcd_rate = etcd_txn_puts_per_s(pool.etcd_url, secs)
        commits = b.committed_puts_per_s(secs)
        lines.append(row("committed puts (etcd-persisted)", commits, "puts/s", "etcd txn puts/s (100/txn)",
                         etcd_rate, 0.5))
        print(lines[-1], flush=True)
    print("\n=== summary (figure | baseline | ratio) ===")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
