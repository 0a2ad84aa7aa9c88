"""RDMA pool benchmark, run inside the Soft-RoCE guest: pool put/get GB/s over RDMA next to perftest in the same
guest, as a ratio (absolute figures under TCG mean little: everything is about 0.1 GB/s).

    python tests/rdma/testbed.py run --timeout 600 -- python3 bench/rdma.py [--quick]

What it measures:
- pool ``batch_put`` / ``batch_get_into`` GB/s over ``transport="rdma"`` for 64 KiB, 1 MiB and 4 MiB pages in
  batches of 64, the client in this process and one storage node (plus metaserver and etcd) in their own processes
  (umbp.launcher.LocalPool), from and into buffers registered with ``Client.register_buffer`` (zero copy). A put
  includes its ALLOC and COMMIT round trips to the metaserver, a get its LOOKUP: these are pool figures.
- baseline: perftest's ``ib_write_bw`` / ``ib_read_bw`` at the same message sizes, server and client on 127.0.0.1
  over rxe0 (perftest's TCP exchange is IPv4-only), same number of bytes.
- node CPU seconds per GiB served over RDMA: utime+stime of the node process (/proc/PID/stat) before and after
  the get phase. Note: with one guest vCPU, rxe's softirq work may be charged to whichever task it interrupts.

Nothing asserts; it prints each figure, the baseline, the ratio and the target (>= 0.8x), then one JSON line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import umbp
from transport import wire
from transport.rdma import RdmaContext, rdma_available
from umbp.launcher import LocalPool

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZES = [64 * KiB, 1 * MiB, 4 * MiB]
BATCH = 64
TARGET = 0.8


def _perftest():
    """perftest() from tests/rdma/guest/bench.py (the engine bench's runner for ib_read_bw / ib_write_bw)."""
    path = os.path.join(REPO, "tests", "rdma", "guest", "bench.py")
    sys.path.insert(0, os.path.dirname(path))  # it imports rdma_helpers from its own directory
    spec = importlib.util.spec_from_file_location("rdma_engine_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.perftest


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def run_pool(sizes: list[int], total_bytes: int, capacity: int) -> tuple[list[dict], dict]:
    rows = []
    cpu = {"seconds": 0.0, "bytes": 0}
    with LocalPool(nodes=1, capacity=capacity, lease_ttl=10) as pool:
        with umbp.Client(pool.metaserver, namespace="bench", transport="rdma") as c:
            node = c.admin(wire.Op.NODES)["nodes"][0]
            assert "rdma" in node["transports"], node
            span = BATCH * max(sizes)
            src = np.random.default_rng(1).integers(0, 256, span, dtype=np.uint8)
            dst = np.zeros(span, dtype=np.uint8)
            c.register_buffer(src)
            c.register_buffer(dst)
            # Time the data phase (every node's RDMA transfers of a batch, Client._run) apart from the metaserver
            # round trips, so the transport's own figure can be compared with perftest too.
            data_s = [0.0]
            orig_run = c._run

            def timed_run(*args, **kw):
                t = time.perf_counter()
                try:
                    return orig_run(*args, **kw)
                finally:
                    data_s[0] += time.perf_counter() - t

            c._run = timed_run
            for size in sizes:
                rounds = max(2, total_bytes // (BATCH * size))
                values = [src[i * size:(i + 1) * size] for i in range(BATCH)]
                outs = [dst[i * size:(i + 1) * size] for i in range(BATCH)]

                # put: fresh keys every round (puts of existing keys are dedup no-ops); removal is not timed
                put_s = 0.0
                for r in range(rounds + 1):
                    if r == 1:
                        data_s[0] = 0.0
                    keys = [f"p{size}-{r}-{i}" for i in range(BATCH)]
                    t0 = time.perf_counter()
                    res = c.batch_put(keys, values)
                    dt = time.perf_counter() - t0
                    assert res == [True] * BATCH, res
                    if r:  # round 0 warms up (QP set-up, registration)
                        put_s += dt
                    c.batch_remove(keys)
                put_gbs = rounds * BATCH * size / put_s / 1e9
                put_data_gbs = rounds * BATCH * size / data_s[0] / 1e9

                keys = [f"g{size}-{i}" for i in range(BATCH)]
                c.batch_put(keys, values)
                c.batch_get_into(keys, outs)  # warm up
                cpu0 = cpu_seconds(node["pid"])
                data_s[0] = 0.0
                t0 = time.perf_counter()
                for _ in range(rounds):
                    got = c.batch_get_into(keys, outs)
                get_s = time.perf_counter() - t0
                used = cpu_seconds(node["pid"]) - cpu0
                assert got == [size] * BATCH, got
                assert np.array_equal(dst[:BATCH * size], src[:BATCH * size]), "bytes differ"
                c.batch_remove(keys)
                served = rounds * BATCH * size
                cpu["seconds"] += used
                cpu["bytes"] += served
                rows.append({"size": size, "rounds": rounds, "put_gbs": put_gbs, "get_gbs": served / get_s / 1e9,
                             "put_data_gbs": put_data_gbs, "get_data_gbs": served / data_s[0] / 1e9,
                             "node_cpu_s_per_gib": used / (served / GiB)})
                print(f"pool rdma {size >> 10:>5} KiB x{BATCH}: put {put_gbs:.4f} GB/s  get "
                      f"{rows[-1]['get_gbs']:.4f} GB/s  ({rounds} batches each; node CPU {used:.3f} s for "
                      f"{served / GiB:.2f} GiB served); data phase only: put {put_data_gbs:.4f} GB/s, get "
                      f"{rows[-1]['get_data_gbs']:.4f} GB/s", flush=True)
            stats = {n: dict(t.ep.stats) for n, t in c._transports.items()}
            print(f"client endpoint stats: {stats}", flush=True)
    return rows, cpu


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer bytes per figure")
    ap.add_argument("--mib", type=int, default=256, help="bytes moved per figure, MiB (default 256)")
    a = ap.parse_args()
    ok, why = rdma_available()
    if not ok:
        print(f"bench rdma: no RDMA here ({why}); run it in the guest: python tests/rdma/testbed.py run "
              f"--timeout 600 -- python3 bench/rdma.py", file=sys.stderr)
        return 2
    total = (64 if a.quick else a.mib) * MiB
    t_start = time.monotonic()
    rows, cpu = run_pool(SIZES, total, capacity=BATCH * (max(SIZES) + 4 * KiB) * 2 + 16 * MiB)

    perftest = _perftest()
    gid_index = RdmaContext.default().gid_index
    for row in rows:
        size = row["size"]
        iters = max(8, total // size)
        row["ib_write_bw"] = perftest("ib_write_bw", size, iters, gid_index)
        row["ib_read_bw"] = perftest("ib_read_bw", size, iters, gid_index)
        row["put_ratio"] = row["put_gbs"] / row["ib_write_bw"]
        row["get_ratio"] = row["get_gbs"] / row["ib_read_bw"]
        print(f"perftest {size >> 10:>5} KiB: ib_write_bw {row['ib_write_bw']:.4f} GB/s  ib_read_bw "
              f"{row['ib_read_bw']:.4f} GB/s", flush=True)

    print(f"\n{'page':>9} {'put GB/s':>9} {'ib_write_bw':>11} {'ratio':>6} {'get GB/s':>9} {'ib_read_bw':>10} "
          f"{'ratio':>6}  node CPU s/GiB   (target ratio >= {TARGET}x)")
    for r in rows:
        flag = lambda x: "ok" if x >= TARGET else "LOW"
        print(f"{r['size'] >> 10:>5} KiB {r['put_gbs']:>9.4f} {r['ib_write_bw']:>11.4f} {r['put_ratio']:>5.2f}x "
              f"{r['get_gbs']:>9.4f} {r['ib_read_bw']:>10.4f} {r['get_ratio']:>5.2f}x  {r['node_cpu_s_per_gib']:.3f}"
              f"   put {flag(r['put_ratio'])}, get {flag(r['get_ratio'])}")
    print("\ndata phase only (RDMA transfers of a batch, without the metaserver round trips):")
    for r in rows:
        print(f"{r['size'] >> 10:>5} KiB  put {r['put_data_gbs']:.4f} GB/s = {r['put_data_gbs'] / r['ib_write_bw']:.2f}x "
              f"ib_write_bw   get {r['get_data_gbs']:.4f} GB/s = {r['get_data_gbs'] / r['ib_read_bw']:.2f}x ib_read_bw")
    per_gib = cpu["seconds"] / (cpu["bytes"] / GiB) if cpu["bytes"] else float("nan")
    print(f"node CPU over the get phases: {cpu['seconds']:.3f} s for {cpu['bytes'] / GiB:.2f} GiB served = "
          f"{per_gib:.3f} CPU s/GiB")
    print(f"bench wall time {time.monotonic() - t_start:.0f} s")
    print("BENCH " + json.dumps({"rows": rows, "node_cpu_s_per_gib": per_gib}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
