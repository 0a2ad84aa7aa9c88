"""Pool benchmark: every target of issue 12 on the data and commit paths, each next to a baseline measured in the
same run (machines differ: only ratios from one run compare).

What it measures (the client in this process, etcd, the metaserver and one node in their own processes):

- get, batches of 64 pages rotating through a working set larger than the CPU caches, for 16 KiB, 64 KiB, 1 MiB
  and 4 MiB pages, over ``tcp`` and ``shm``. Baselines: one raw loopback TCP stream (a sender process,
  ``recv_into`` a preallocated buffer) for tcp; single-thread memcpy of the same page size over a working set of
  the same size for shm. Targets: 64 KiB x64 >= 0.8x (tcp and shm).
- cold get, 4 MiB x64 over tcp: pages never read since they were put, a new client (fresh connection), each page
  read once into preallocated (touched) outs. Baseline: the raw stream; target >= 0.85x.
- put of every size and transport: ``batch_put`` of 64 MiB per call (at least 64 pages; inside the call chunks
  overlap their ALLOC and COMMIT with the writes), every page acknowledged only once etcd holds its record.
  Baseline: the get of the same size and transport; target >= 0.7x. Also printed: puts in 64-page calls (one
  durable COMMIT per call: etcd's commit latency bounds it).
- committed puts/s, 4 KiB pages (one 4 KiB slot each), 128 per ``batch_put``, from 1, 4 and 16 client
  *processes* started together.
  Baseline: etcd's own puts/s in 100-op transactions (as many in flight as the metaserver's writer keeps);
  targets: >= 1.0x with 4 clients, >= 100k/s with 16 (if etcd allows it).
- ``batch_exists`` keys/s in 1,000-key batches (target >= 1,000,000 keys/s; Mooncake's master is not run here).

Every figure and every baseline is the best window (WINDOW_S of consecutive rounds; COMMIT_WINDOW_S for the
commit rates) of its own run: on a small machine shared with other work a burst of foreign load would otherwise
decide a ratio. The cold get is a single pass by definition (the best of a few fresh sets).

Nothing here asserts: it prints each figure, its baseline, the ratio and the target. ``make bench`` runs it;
``python bench/pool.py --quick`` is a short pass (smaller sets, shorter timings, noisier).
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
SIZES = [16 * KiB, 64 * KiB, 1 * MiB, 4 * MiB]
BATCH = 64
PUT_CALL_BYTES = 64 * MiB
MAX_SET_PAGES = 16384  # pages in one size's working set (etcd holds a record per page)
ETCD_WRITER_INFLIGHT = 4  # transactions the metaserver's BatchWriter keeps in flight (metaserver/store/batcher.py)
WINDOW_S = 0.25
COMMIT_WINDOW_S = 1.0


def label(size: int) -> str:
    return f"{size // KiB} KiB" if size < MiB else f"{size // MiB} MiB"


def best_rate(rounds: list[tuple[float, float, float]], window: float = WINDOW_S) -> float:
    """The best rate over a run of consecutive rounds ``(start, end, amount)`` lasting at least ``window`` seconds
    (over all of them when together they last less)."""
    if not rounds:
        return 0.0
    prefix = [0.0]
    for _s, _e, a in rounds:
        prefix.append(prefix[-1] + a)
    if rounds[-1][1] - rounds[0][0] <= window:
        return prefix[-1] / (rounds[-1][1] - rounds[0][0])
    best, j = 0.0, 0
    for i in range(len(rounds)):
        j = max(j, i)
        while j < len(rounds) and rounds[j][1] - rounds[i][0] < window:
            j += 1
        if j == len(rounds):
            break
        best = max(best, (prefix[j + 1] - prefix[i]) / (rounds[j][1] - rounds[i][0]))
    return best


def best_events_rate(events: list[tuple[float, float]], window: float) -> float:
    """Best ``amount`` per second within any ``window``-long interval of ``(time, amount)`` completion events."""
    events = sorted(events)
    best, j, acc = 0.0, 0, 0.0
    for i in range(len(events)):
        while j < len(events) and events[j][0] - events[i][0] <= window:
            acc += events[j][1]
            j += 1
        best = max(best, acc)
        acc -= events[i][1]
    return best / window


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
    got, mark = 0, 0
    rounds = []
    t = t0 = time.perf_counter()
    while got < total:
        n = conn.recv_into(mv, min(chunk, total - got))
        if not n:
            break
        got += n
        if got - mark >= 64 * MiB:
            now = time.perf_counter()
            rounds.append((t, now, got - mark))
            t, mark = now, got
    p.join(10)
    conn.close()
    srv.close()
    return best_rate(rounds) / 1e9 if rounds else got / (time.perf_counter() - t0) / 1e9


def memcpy_gbps(size: int, working_set: int, min_time: float) -> float:
    """Single-thread memcpy of 64-page batches rotating through a working set of the same size as the pool's."""
    n = max(2 * BATCH, working_set // size)
    src = np.random.randint(0, 255, n * size, dtype=np.uint8).reshape(n, size)
    dsts = [np.ones(size, np.uint8) for _ in range(BATCH)]
    rounds, b = [], 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < min_time or b < 3:
        base = (b * BATCH) % (n - BATCH + 1)
        t = time.perf_counter()
        for i, d in enumerate(dsts):
            np.copyto(d, src[base + i])
        rounds.append((t, time.perf_counter(), BATCH * size))
        b += 1
    return best_rate(rounds) / 1e9


def host_copy_rows(size: int, working_set: int, min_time: float, shm: dict) -> list[str]:
    """Host copies of 64-page batches over a working set: the machine's own multi-threaded copy (as many plain
    threads as ``umbp.copies`` may use, each ``np.copyto`` of its share: numpy releases the GIL) as the baseline
    beside the single-thread memcpy, ``umbp.copies.copy_pairs`` of the same bytes, and the shm get/put figures
    (``shm``: ``put_get``'s answer) against the multi-threaded baseline. Target (issue 16): copies >= 0.8x the
    multi-threaded baseline for batches of 64 MiB and more."""
    import concurrent.futures as cf

    from umbp import copies

    n = max(2 * BATCH, working_set // size)
    src = np.random.randint(0, 255, n * size, dtype=np.uint8).reshape(n, size)
    dsts = np.ones((BATCH, size), np.uint8)
    threads = copies.max_threads()
    pool = cf.ThreadPoolExecutor(threads)

    def rate(copy_batch) -> float:
        rounds, b = [], 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < min_time or b < 3:
            base = (b * BATCH) % (n - BATCH + 1)
            t = time.perf_counter()
            copy_batch(src[base:base + BATCH])
            rounds.append((t, time.perf_counter(), BATCH * size))
            b += 1
        return best_rate(rounds) / 1e9

    def raw_threads(batch) -> None:  # the same bytes cut into equal flat shares, one per thread
        s, d = batch.reshape(-1), dsts.reshape(-1)
        step = -(-s.size // threads)
        list(pool.map(lambda i: np.copyto(d[i:i + step], s[i:i + step]), range(0, s.size, step)))

    def one_thread(batch) -> None:
        np.copyto(dsts, batch)

    def umbp_copies(batch) -> None:
        copies.copy_pairs([(memoryview(d), memoryview(x)) for d, x in zip(dsts, batch)])

    try:
        single, multi, ours = rate(one_thread), rate(raw_threads), rate(umbp_copies)
    finally:
        pool.shutdown()
    lb, mt = label(size), f"{threads}-thread copy {label(size)} GB/s"
    return [row(f"memcpy 1 thread {lb} x{BATCH} (info)", single, "GB/s", mt, multi, None),
            row(f"umbp.copies {lb} x{BATCH}", ours, "GB/s", mt, multi, 0.8 if size * BATCH >= 64 * MiB else None),
            row(f"shm get {lb} x{BATCH} vs threads", shm["get"], "GB/s", mt, multi, None),
            row(f"shm put {lb} x{shm['per_call']} vs threads", shm["put"], "GB/s", mt, multi, None)]


def etcd_txn_puts_per_s(etcd_url: str, seconds: float, per_txn: int = 100, in_flight: int = ETCD_WRITER_INFLIGHT
                        ) -> float:
    """etcd's own rate: 100 puts (64-byte values, like a page record) per transaction, ``in_flight`` at once."""
    import aetcd

    host, port = split_host_port(etcd_url)

    async def main() -> float:
        async with aetcd.Client(host, port) as c:
            value = b"v" * 64
            events: list[tuple[float, float]] = []
            end = time.perf_counter() + seconds

            async def worker(w: int) -> None:
                i = 0
                while time.perf_counter() < end:
                    ops = [c.transactions.put(b"/bench/etcd/%d/%d" % (w, i * per_txn + j), value)
                           for j in range(per_txn)]
                    await c.transaction(compare=[], success=ops, failure=[])
                    events.append((time.perf_counter(), per_txn))
                    i += 1
            await asyncio.gather(*(worker(w) for w in range(in_flight)))
            await c.delete_prefix(b"/bench/etcd/")
            return best_events_rate(events, COMMIT_WINDOW_S)
    return asyncio.run(main())


# ---- the pool -------------------------------------------------------------------------------------------------

def _commit_worker(ms: str, w: int, start_at: float, seconds: float, batch: int, out) -> None:
    """One client process: 4 KiB pages (4,000 bytes: with its object header one 4 KiB slot) in batch_put calls of
    ``batch`` from ``start_at`` for ``seconds``; then it removes them (untimed) so the next run starts empty."""
    val = b"p" * 4000
    with umbp.Client(ms, namespace="bench-commit") as c:
        c.batch_put([f"warm/{w}"], [val])  # connected, introduced, node mapped
        while time.time() < start_at:
            time.sleep(0.001)
        events, i = [], 0
        end = time.time() + seconds
        while time.time() < end:
            events.append((time.time(), sum(c.batch_put([f"c/{w}/{i}/{j}" for j in range(batch)], [val] * batch))))
            i += 1
        keys = [f"c/{w}/{k}/{j}" for k in range(i) for j in range(batch)] + [f"warm/{w}"]
        for lo in range(0, len(keys), 8192):
            c.batch_remove(keys[lo:lo + 8192])
        out.put(events)


class PoolBench:
    def __init__(self, metaserver: str, min_time: float, working_set: int):
        self.ms = metaserver
        self.min_time = min_time
        self.working_set = working_set

    def set_pages(self, size: int) -> int:
        return max(2 * BATCH, min(MAX_SET_PAGES, self.working_set // size)) // BATCH * BATCH

    def put_get(self, transport: str, size: int) -> dict[str, float]:
        """Put a working set (calls of PUT_CALL_BYTES), read it back in rotating batches of 64, then put 64-page
        calls for a while; GB/s of each."""
        pages = self.set_pages(size)
        per_call = max(BATCH, PUT_CALL_BYTES // size)
        with umbp.Client(self.ms, namespace=f"bench-{transport}-{size}", transport=transport) as c:
            rng = np.random.default_rng(size)
            vals = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(BATCH)]
            outs = [np.ones(size, np.uint8) for _ in range(BATCH)]
            keys = [f"{size}/{i}" for i in range(pages)]
            c.batch_put(["warm"], [vals[0]])  # connect and map outside the timing
            puts = []
            for lo in range(0, pages, per_call):
                kb = keys[lo:lo + per_call]
                t = time.perf_counter()
                assert all(c.batch_put(kb, [vals[i % BATCH] for i in range(len(kb))]))
                puts.append((t, time.perf_counter(), len(kb) * size))
            batches = [keys[lo:lo + BATCH] for lo in range(0, pages, BATCH)]
            gets, b = [], 0
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < self.min_time or b < len(batches):
                t = time.perf_counter()
                got = c.batch_get_into(batches[b % len(batches)], outs)
                gets.append((t, time.perf_counter(), BATCH * size))
                assert got == [size] * BATCH, got
                b += 1
            assert all(np.array_equal(vals[i], o) for i, o in enumerate(outs))  # keys[lo + i] holds vals[i]
            # the same gets, each waiting for its LOOKUP before reading (read-ahead off: umbp/speculate.py)
            c._spec.enabled = False
            plain, t0 = [], time.perf_counter()
            while time.perf_counter() - t0 < self.min_time / 2 or b % len(batches):
                t = time.perf_counter()
                assert c.batch_get_into(batches[b % len(batches)], outs) == [size] * BATCH
                plain.append((t, time.perf_counter(), BATCH * size))
                b += 1
            c._spec.enabled = True
            # 64-page calls, each acknowledged after its own durable COMMIT
            puts64, n64 = [], 0
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < self.min_time / 2 or n64 < 3:
                t = time.perf_counter()
                assert all(c.batch_put([f"{size}/x64/{n64}/{i}" for i in range(BATCH)], vals))
                puts64.append((t, time.perf_counter(), BATCH * size))
                n64 += 1
            for lo in range(0, pages, 4096):
                c.batch_remove(keys[lo:lo + 4096])
            c.batch_remove([f"{size}/x64/{n}/{i}" for n in range(n64) for i in range(BATCH)])
            c.remove("warm")
        return {"put": best_rate(puts) / 1e9, "get": best_rate(gets) / 1e9, "put64": best_rate(puts64) / 1e9,
                "get_plain": best_rate(plain) / 1e9, "per_call": per_call}

    def cold_get(self, size: int = 4 * MiB, sets: int = 3) -> float:
        """Pages never read since their put, a fresh client and connection, each page read exactly once (one
        batch of 64); the best of ``sets`` such sets."""
        vals = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(4)]
        outs = [np.ones(size, np.uint8) for _ in range(BATCH)]
        best = 0.0
        for s in range(sets):
            keys = [f"cold/{s}/{i}" for i in range(BATCH)]
            with umbp.Client(self.ms, namespace="bench-cold", transport="tcp") as c:
                assert all(c.batch_put(keys, [vals[i % 4] for i in range(BATCH)]))
            with umbp.Client(self.ms, namespace="bench-cold", transport="tcp") as c:
                t = time.perf_counter()
                assert c.batch_get_into(keys, outs) == [size] * BATCH
                best = max(best, BATCH * size / (time.perf_counter() - t) / 1e9)
                assert all(np.array_equal(vals[i % 4], o) for i, o in enumerate(outs))
                c.batch_remove(keys)
        return best

    def exists_keys_per_s(self) -> float:
        with umbp.Client(self.ms, namespace="bench-exists") as c:
            keys = [f"e/{i}" for i in range(1000)]
            c.batch_put(keys[:500], [b"x"] * 500)
            assert sum(c.batch_exists(keys)) == 500
            return 1000 / timed(lambda: c.batch_exists(keys), self.min_time, max_rounds=100000)

    def committed_puts_per_s(self, seconds: float, procs: int, batch: int = 128) -> float:
        """``procs`` client processes putting 4 KiB pages in batches of ``batch``, all starting at one instant;
        every put is acknowledged only after etcd holds its record."""
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        start_at = time.time() + 2.0 + 0.25 * procs  # after every process imported umbp and connected
        ps = [ctx.Process(target=_commit_worker, args=(self.ms, w, start_at, seconds, batch, q))
              for w in range(procs)]
        for p in ps:
            p.start()
        events = [e for _ in ps for e in q.get(timeout=seconds + 180)]  # wall-clock times: one timeline
        for p in ps:
            p.join(30)
        time.sleep(1.0)  # the removals' etcd deletes drain before the next figure
        return best_events_rate(events, COMMIT_WINDOW_S)


def tls_cost_row(plain_ms: str, min_time: float) -> str:
    """tcp get 1 MiB x64 with TLS on (a second one-node pool serving TLS, certificates made here with ``openssl``)
    against TLS off (the bench's own pool), same run: the ratio is what TLS costs on this machine."""
    import shutil
    import tempfile

    from bench.common import environ, make_certs, tls_env

    d = tempfile.mkdtemp(prefix="umbp-bench-tls-")
    if not make_certs(d):
        shutil.rmtree(d, ignore_errors=True)
        return "tcp get 1 MiB, TLS on vs off: skipped (no `openssl` command to make certificates with)"
    pages = [np.random.randint(0, 255, MiB, dtype=np.uint8) for _ in range(BATCH)]
    outs = [np.empty(MiB, np.uint8) for _ in range(BATCH)]

    def gbps(ms: str, ca: str) -> float:
        with umbp.Client(metaserver=ms, namespace="bench-tls", transport="tcp", tls_ca=ca or None) as c:
            keys = [f"tls-{i}" for i in range(BATCH)]
            c.batch_put(keys, pages)
            assert c.batch_get_into(keys, outs) == [MiB] * BATCH and all(np.array_equal(a, b) for a, b in
                                                                          zip(outs, pages))
            return BATCH * MiB / timed(lambda: c.batch_get_into(keys, outs), min_time) / 1e9

    off = gbps(plain_ms, "")
    try:
        with environ(tls_env(d)), LocalPool(nodes=1, capacity="256MiB", port=0, metrics=False) as tp:
            on = gbps(tp.metaserver, os.path.join(d, "ca.pem"))  # (the TLS pool's processes inherit the env)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return row(f"tcp get 1 MiB x{BATCH}, TLS on", on, "GB/s", f"tcp get 1 MiB x{BATCH}, TLS off GB/s", off, None)


def row(name: str, value: float, unit: str, base_name: str, base: float, target: float | None) -> str:
    ratio = value / base if base else float("nan")
    tgt = f"target >= {target:g}x: {'MET' if ratio >= target else 'MISSED'}" if target else ""
    return f"{name:<36} {value:>11,.2f} {unit:<7}| {base_name:<32} {base:>11,.2f} | ratio {ratio:5.2f}  {tgt}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs (for a smoke check)")
    ap.add_argument("--capacity", default="3GiB", help="node arena size")
    ap.add_argument("--only", default="", help="comma list of parts: data,cold,exists,commit (default: all)")
    ap.add_argument("--clients", default="1,4,16", help="client process counts for committed puts")
    ap.add_argument("--sizes", default="", help="comma list of page sizes in KiB for the data part (default: all)")
    ap.add_argument("--transports", default="tcp,shm", help="comma list of transports for the data part")
    args = ap.parse_args()
    parts = set(args.only.split(",")) if args.only else {"data", "cold", "exists", "commit"}
    min_time = 0.4 if args.quick else 1.5
    lines: list[str] = []

    def out(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    print("umbp bench/pool.py: starting etcd, a metaserver and one node (separate processes) ...", flush=True)
    with LocalPool(nodes=1, capacity=args.capacity, port=0, metrics=False) as pool:
        ws = (192 << 20) if args.quick else (512 << 20)
        b = PoolBench(pool.metaserver, min_time, ws)
        raw_total = (512 << 20) if args.quick else (2 << 30)
        if "data" in parts:
            sizes = [int(x) * KiB for x in args.sizes.split(",")] if args.sizes else SIZES
            for transport in args.transports.split(","):
                for size in sizes:
                    lb = label(size)
                    if transport == "tcp":  # the baseline next to its figure: the machine's load drifts
                        base_name, base = "raw TCP stream GB/s", raw_tcp_gbps(total=raw_total)
                    else:
                        base_name, base = f"memcpy {lb} GB/s", memcpy_gbps(size, ws, min_time)
                    r = b.put_get(transport, size)
                    out(row(f"{transport} get {lb} x{BATCH}", r["get"], "GB/s", base_name, base,
                            0.8 if size == 64 * KiB else None))
                    out(row(f"{transport} get {lb} x{BATCH} no read-ahead", r["get_plain"], "GB/s",
                            base_name, base, None))
                    out(row(f"{transport} put {lb} x{r['per_call']}", r["put"], "GB/s",
                            f"{transport} get {lb} x{BATCH} GB/s", r["get"], 0.7))
                    out(row(f"{transport} put {lb} x{BATCH} (info)", r["put64"], "GB/s",
                            f"{transport} get {lb} x{BATCH} GB/s", r["get"], None))
                    if transport == "shm":
                        for line in host_copy_rows(size, ws, min_time, r):
                            out(line)
        if "data" in parts:
            out(tls_cost_row(pool.metaserver, min_time))
        if "cold" in parts:
            raw = raw_tcp_gbps(total=raw_total)
            out(row(f"tcp cold get 4 MiB x{BATCH}", b.cold_get(sets=2 if args.quick else 3), "GB/s",
                    "raw TCP stream GB/s", raw, 0.85))
        if "exists" in parts:
            ex = b.exists_keys_per_s()
            out(f"{'batch_exists 1000-key batches':<36} {ex:>11,.0f} keys/s | target >= 1,000,000 keys/s: "
                f"{'MET' if ex >= 1e6 else 'MISSED'}")
        if "commit" in parts:
            secs = 3 if args.quick else 8
            # the pool first: the baseline leaves hundreds of thousands of tombstones behind in etcd
            rates = {n: b.committed_puts_per_s(secs, n) for n in (int(x) for x in args.clients.split(","))}
            etcd_rate = etcd_txn_puts_per_s(pool.etcd_url, secs)
            for n, rate in rates.items():
                out(row(f"committed puts 4 KiB, {n} client proc{'s' if n > 1 else ''}", rate, "puts/s",
                        f"etcd 100-op txns x{ETCD_WRITER_INFLIGHT} puts/s", etcd_rate, 1.0 if n == 4 else None)
                    + (f"; >= 100k/s: {'MET' if rate >= 1e5 else 'MISSED'}" if n == 16 else ""))
    print("\n=== summary (figure | baseline | ratio) ===")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
