"""Throughput of transport/rdma.py next to perftest's ib_read_bw / ib_write_bw, in the same guest, as a ratio.

Absolute numbers under TCG mean nothing (about 0.1 GB/s for everything); the ratio says how much the Python engine
costs over C on one RC QP. Run it in the guest (not collected by pytest):

    python tests/rdma/testbed.py run -- python3 tests/rdma/guest/bench.py [--sizes 4096,65536,1048576] [--total-mib 64]

With --peer HOST (two guests, see testbed.py run2) it measures against a ``rdma_helpers.py serve`` on HOST and
skips perftest.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time

from rdma_helpers import Conn, Server, measure_throughput

from transport.rdma import CLIENT_ACCESS, RdmaContext


def perftest(tool: str, size: int, iters: int, gid_index: int, host: str = "127.0.0.1") -> float:
    """GB/s (average) reported by ``tool`` (ib_read_bw / ib_write_bw) for ``iters`` messages of ``size`` bytes."""
    args = [tool, "-d", "rxe0", "-x", str(gid_index), "-s", str(size), "-n", str(iters), "-F"]
    srv = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = ""
    try:
        for _ in range(50):  # the server needs a moment to listen on its TCP port (18515)
            time.sleep(0.3)
            cli = subprocess.run(args + [host], capture_output=True, text=True, timeout=300, check=False)
            out = cli.stdout + cli.stderr
            if cli.returncode == 0:
                break
        srv.wait(timeout=60)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
    for line in out.splitlines():
        cols = line.split()
        if len(cols) >= 4 and cols[0] == str(size) and re.fullmatch(r"[\d.]+", cols[3]):
            return float(cols[3]) * 1e6 / 1e9  # MB/sec (10^6) -> GB/s
    raise RuntimeError(f"{tool}: no result line in:\n{out}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="4096,65536,1048576")
    p.add_argument("--total-mib", type=int, default=64)
    p.add_argument("--peer", default=None, help="host of a running rdma_helpers.py serve (two guests)")
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    total_max = a.total_mib << 20
    ctx = RdmaContext()
    region = 16 << 20
    server = None if a.peer else Server(region)
    conn = Conn(ctx, a.port if a.peer else server.port, a.peer or "127.0.0.1")
    local = ctx.alloc(region, CLIENT_ACCESS)
    rows = []
    try:
        for size in sizes:
            total = min(total_max, size * 4096)  # small messages: fewer bytes, same count as perftest's -n
            for op, tool in (("read", "ib_read_bw"), ("write", "ib_write_bw")):
                measure_throughput(conn.ep, local, conn.mr, op, size, min(total, 8 << 20))  # warm up
                eng = measure_throughput(conn.ep, local, conn.mr, op, size, total)
                ref = None if a.peer else perftest(tool, size, max(1, total // size), ctx.gid_index)
                rows.append({"op": op, "size": size, "engine_gbs": round(eng, 4),
                             "perftest_gbs": None if ref is None else round(ref, 4),
                             "ratio": None if not ref else round(eng / ref, 2)})
                print(f"{op:5} {size:>8} B  engine {eng:.3f} GB/s  "
                      + (f"{tool} {ref:.3f} GB/s  ratio {eng / ref:.2f}" if ref else ""), flush=True)
    finally:
        conn.close()
        if server:
            server.kill()
    print("BENCH " + json.dumps(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
