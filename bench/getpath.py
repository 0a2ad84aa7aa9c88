"""Get-path benchmark (issue 45): ``batch_get_into`` of 64-page batches beside same-run baselines.

For each page size (16 KiB, 64 KiB, 1 MiB by default) and transport (shm, tcp) a working set of pages is put into a
one-node pool, then read back in rotating 64-page batches into two kinds of outs: one 2-D numpy array (a row a page)
and a list of CPU torch tensors. Baselines, measured in the same run right before their figures (the machine's load
drifts): shm against one big memcpy of the batch (``np.copyto`` of 64 rows at once) and the per-page memcpy (one
``np.copyto`` a page), both over a working set of the same size; tcp against one raw loopback TCP stream
(``bench/pool.py``'s sender process, ``recv_into`` a preallocated buffer). Each figure is the best window of
``WINDOW_S`` of consecutive batches (``bench/pool.py``'s ``best_rate``). Nothing asserts; it prints each figure, its
baselines and the ratios (targets of issue 45 on the 16-core machine: shm 64 KiB >= 0.8x per-page, >= 0.75x big
memcpy, tensors >= 0.75x, 16 KiB >= 0.7x; tcp 64 KiB and 1 MiB >= 0.8x the raw stream).

``python bench/getpath.py [--quick] [--sizes 16,64,1024] [--transports shm,tcp] [--outs array,tensors]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import umbp  # noqa: E402
from bench.pool import BATCH, KiB, best_rate, label, raw_tcp_gbps  # noqa: E402
from umbp.launcher import LocalPool  # noqa: E402


def rate(fn, batches: int, min_time: float, cpu: list | None = None) -> float:
    """GB/s of ``fn(b)`` (one batch, returns its bytes) over rotating batch numbers, best window. With ``cpu`` (a
    list) the GB/s per CPU second of this process (its threads included; the metaserver and node are other
    processes) is appended to it: on a loaded machine the wall figure waits on the others, this one does not."""
    rounds, used, b = [], [], 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < min_time or b < min(batches, 3):
        t, c = time.perf_counter(), time.process_time()
        n = fn(b % batches)
        rounds.append((t, time.perf_counter(), n))
        used.append((time.process_time() - c, n))
        b += 1
    if cpu is not None:  # the median batch's CPU seconds: process_time ticks coarsely
        per = sorted(s / n for s, n in used)[len(used) // 2]
        cpu.append(1 / per / 1e9 if per else float("inf"))
    return best_rate(rounds) / 1e9


def memcpy_rates(size: int, pages: int, min_time: float) -> tuple[float, float]:
    """(one big memcpy, per-page memcpy) GB/s of 64-page batches over a working set of ``pages`` pages."""
    src = np.random.randint(0, 255, pages * size, dtype=np.uint8).reshape(pages, size)
    dst = np.ones((BATCH, size), np.uint8)
    rows = list(dst)

    def big(b: int) -> int:
        np.copyto(dst, src[b * BATCH:(b + 1) * BATCH])
        return BATCH * size

    def per_page(b: int) -> int:
        base = b * BATCH
        for i, d in enumerate(rows):
            np.copyto(d, src[base + i])
        return BATCH * size
    return rate(big, pages // BATCH, min_time), rate(per_page, pages // BATCH, min_time)


def stream_cpu_gbps(total: int) -> float:
    """The raw stream's receive side in GB/s per CPU second of this process (``raw_tcp_gbps`` timed by
    ``process_time``)."""
    c = time.process_time()
    raw_tcp_gbps(total=total)
    return total / max(time.process_time() - c, 1e-9) / 1e9


def get_rates(ms: str, transport: str, size: int, pages: int, kinds: list[str], min_time: float) -> dict:
    """GB/s of ``batch_get_into`` per out kind, after putting ``pages`` pages (bytes checked once)."""
    import torch

    out = {}
    with umbp.Client(ms, namespace=f"getpath-{transport}-{size}", transport=transport) as c:
        rng = np.random.default_rng(size)
        vals = rng.integers(0, 256, (BATCH, size), dtype=np.uint8)
        keys = [f"{size}/{i}" for i in range(pages)]
        for lo in range(0, pages, BATCH):
            c.batch_put(keys[lo:lo + BATCH], list(vals))
        batches = [keys[lo:lo + BATCH] for lo in range(0, pages, BATCH)]
        arr = np.zeros((BATCH, size), np.uint8)
        tensors = [torch.zeros(size, dtype=torch.uint8) for _ in range(BATCH)]
        for kind in kinds:
            outs = arr if kind == "array" else tensors
            assert c.batch_get_into(batches[1], outs) == [size] * BATCH
            got = arr if kind == "array" else torch.stack(tensors).numpy()
            assert np.array_equal(got, vals), f"{transport} {kind}: wrong bytes"

            def one(b: int, outs=outs, c=c) -> int:
                c.batch_get_into(batches[b], outs)
                return BATCH * size
            cpu: list = []
            out[kind] = rate(one, len(batches), min_time, cpu)
            out[kind + " cpu"] = cpu[0]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs, smaller working sets (noisier)")
    ap.add_argument("--sizes", default="16,64,1024", help="page sizes in KiB")
    ap.add_argument("--transports", default="shm,tcp")
    ap.add_argument("--outs", default="array,tensors")
    ap.add_argument("--capacity", default="2GiB", help="node arena size")
    args = ap.parse_args()
    min_time = 0.5 if args.quick else 1.5
    ws = (128 << 20) if args.quick else (384 << 20)
    kinds = args.outs.split(",")
    lines = []
    with LocalPool(nodes=1, capacity=args.capacity, port=0, metrics=False) as pool:
        for transport in args.transports.split(","):
            for size in (int(x) * KiB for x in args.sizes.split(",")):
                pages = max(4 * BATCH, ws // size) // BATCH * BATCH
                if transport == "shm":
                    big, per = memcpy_rates(size, pages, min_time)
                    bases = [("big memcpy", big), ("per-page memcpy", per)]
                else:
                    total = (512 << 20) if args.quick else (2 << 30)
                    bases = [("raw tcp stream", raw_tcp_gbps(total=total)), ("its cpu", stream_cpu_gbps(total))]
                got = get_rates(pool.metaserver, transport, size, pages, kinds, min_time)
                for kind, gbps in got.items():
                    # wall figures against the wall baselines; CPU figures against the stream's CPU rate (tcp)
                    use = bases[-1:] if kind.endswith("cpu") and transport == "tcp" else bases[:1] if \
                        transport == "tcp" else bases
                    cols = "  ".join(f"{gbps / b:5.2f}x {n} {b:6.2f}" for n, b in use)
                    line = f"{transport} get {label(size):>7} x{BATCH} into {kind:<11} {gbps:6.2f} GB/s | {cols}"
                    lines.append(line)
                    print(line, flush=True)
    print("\n=== summary (GB/s | ratio to each same-run baseline, baseline GB/s) ===")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
