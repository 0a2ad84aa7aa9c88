"""Put-path benchmark (issue 45): ``batch_put`` beside the get of the same pages, measured in the same run.

For each transport (shm, tcp) and page size (16 KiB, 64 KiB, 1 MiB by default), one client of a one-node pool:
- get: ``batch_get_into`` of rotating 64-page batches of a working set into one 2-D array (the get path's best out);
- put x64: ``batch_put`` of 64 new pages a call (one ALLOC, the write, one durable COMMIT), the array write path
  (``umbp/putbatch.py``; its comparison with the per-page path it replaced is in docs/benchmarks/getpath.md);
- put big: ``batch_put`` of about 64 MiB a call (chunks pipelined: the next ALLOCs and the previous COMMITs in flight
  while a chunk is written).
``--commit async`` (or ``durable,async``: a pool each, one after the other) runs the pool's metaserver with
``--commit async``: a COMMIT answered before its segment is in etcd (a crash loses the last window's pages as misses,
never as wrong bytes), the directory issue's option for puts that do not wait on etcd.
Each call's pages are removed after it, outside the timing. Figures are medians over the calls (per-call GB/s), and
client CPU microseconds a page (this process: the metaserver, etcd and the node are other processes). Printed
ratios: each put over the get of the same size and transport (issue 45's target: >= 0.7x at every size, on the 16-core
machine, with the directory issue's group commit).

``python bench/putpath.py [--quick] [--sizes 16,64,1024] [--transports shm,tcp] [--commit durable,async]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import umbp  # noqa: E402
from bench.pool import BATCH, KiB, MiB, label  # noqa: E402
from umbp.launcher import LocalPool  # noqa: E402

BIG_CALL = 64 * MiB


def _median(xs: list[float]) -> float:
    return float(np.median(xs)) if xs else float("nan")


def measure(ms: str, transport: str, size: int, min_time: float, ws: int) -> dict[str, float]:
    """Median GB/s (and client CPU us a page) of gets, 64-page puts (array and per-page path) and big puts."""
    out: dict[str, float] = {}
    with umbp.Client(ms, namespace=f"putpath-{transport}-{size}", transport=transport) as c:
        rng = np.random.default_rng(size)
        vals = rng.integers(0, 256, (BATCH, size), dtype=np.uint8)
        rows = list(vals)
        pages = max(4, ws // (BATCH * size)) * BATCH
        keys = [f"g/{i}" for i in range(pages)]
        for lo in range(0, pages, BATCH):
            c.batch_put(keys[lo:lo + BATCH], rows)
        arr = np.zeros((BATCH, size), np.uint8)
        batches = [keys[lo:lo + BATCH] for lo in range(0, pages, BATCH)]
        assert c.batch_get_into(batches[0], arr) == [size] * BATCH and np.array_equal(arr, vals)
        got, t0, b = [], time.perf_counter(), 0
        while time.perf_counter() - t0 < min_time or b < 5:
            t = time.perf_counter()
            c.batch_get_into(batches[b % len(batches)], arr)
            got.append(BATCH * size / (time.perf_counter() - t) / 1e9)
            b += 1
        out["get"] = _median(got)
        c.batch_remove(keys)

        def put(n: int, tag: str, wall: list, cpu: list) -> None:
            ks = [f"{tag}/{i}" for i in range(n)]
            vs = [rows[i % BATCH] for i in range(n)]
            t, p = time.perf_counter(), time.process_time()
            assert all(c.batch_put(ks, vs))
            wall.append(n * size / (time.perf_counter() - t) / 1e9)
            cpu.append((time.process_time() - p) / n * 1e6)
            c.batch_remove(ks)

        res: dict[str, tuple[list, list]] = {k: ([], []) for k in ("put x64", "put big")}
        big = max(BATCH, BIG_CALL // size)
        t0, r = time.perf_counter(), 0
        while time.perf_counter() - t0 < min_time or r < 4:
            put(BATCH, f"p{r}", *res["put x64"])
            r += 1
        t0, r = time.perf_counter(), 0
        while time.perf_counter() - t0 < min_time or r < 3:
            put(big, f"b{r}", *res["put big"])
            r += 1
        for k, (wall, cpu) in res.items():
            out[k] = _median(wall)
            out[k + " cpu"] = _median(cpu)
        out["big pages"] = big
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs (noisier)")
    ap.add_argument("--sizes", default="16,64,1024", help="page sizes in KiB")
    ap.add_argument("--transports", default="shm,tcp")
    ap.add_argument("--capacity", default="2GiB", help="node arena size")
    ap.add_argument("--arena-root", default="", metavar="DIR",
                    help="the node's arena under DIR (a tmpfs mounted with huge=within_size: 2 MiB pages), not "
                         "/dev/shm")
    ap.add_argument("--commit", default="durable", help="the metaserver's commit modes, comma-separated: a pool each "
                                                        "(durable: answered once in etcd; async: before etcd)")
    args = ap.parse_args()
    modes = args.commit.split(",")
    if not modes or any(m not in ("durable", "async") for m in modes):
        ap.error(f"--commit: durable and/or async, not {args.commit!r}")
    min_time = 0.5 if args.quick else 1.5
    ws = (64 << 20) if args.quick else (256 << 20)
    lines = []
    for mode in modes:
        with LocalPool(nodes=1, capacity=args.capacity, port=0, metrics=False, arena_root=args.arena_root,
                       metaserver_args=["--commit", mode]) as pool:
            for transport in args.transports.split(","):
                for size in (int(x) * KiB for x in args.sizes.split(",")):
                    m = measure(pool.metaserver, transport, size, min_time, ws)
                    get = m["get"]
                    lb = label(size)
                    rows = [(f"put x{BATCH}", m["put x64"], m["put x64 cpu"]),
                            (f"put x{int(m['big pages'])} (pipelined)", m["put big"], m["put big cpu"])]
                    for name, gbps, cpu in rows:
                        line = (f"{mode:<7} {transport} {name:<26} {lb:>7} {gbps:6.2f} GB/s {cpu:6.1f} us cpu/page | "
                                f"{gbps / get:5.2f}x get x{BATCH} {get:6.2f}")
                        lines.append(line)
                        print(line, flush=True)
    print("\n=== summary: puts (median GB/s of calls, client CPU a page) | ratio to the same-run get of the same "
          "size and transport (target >= 0.7x) ===")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
