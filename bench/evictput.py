"""Puts into a full pool (every put evicts): what the removal barrier costs (``BatchWriter.removals_durable``: an
ALLOC is answered only once the record rewrites of the pages evicted before it are in etcd,
docs/design/persistence-and-fencing.md "Reusing an extent").

One pool (etcd, a metaserver, one node of ``--capacity``) started by ``umbp.launcher.LocalPool`` from the tree this
file lies in; ``--clients`` threads each ``batch_put`` ``--batch`` new pages of ``--page-kib`` a call for
``--seconds`` after the pool is full. Two pool settings:

- ``watermarks``: the defaults (0.95 / 0.85): the background pass evicts ahead, so an ALLOC seldom evicts itself and
  waits only when it comes within a transaction of a pass's rewrites;
- ``no-watermark``: 1 / 1: every ALLOC evicts, so every one waits a transaction (its own rewrite).

Printed per setting and commit mode: puts/s and the median and 90th percentile of a call. To compare with a tree
before the barrier, copy this file and bench/common.py into that tree's bench/ and run it there (the pool's processes
come from the tree the file lies in). Nothing asserts.

``python bench/evictput.py [--seconds 6] [--clients 1,4] [--modes durable,async]``
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import umbp  # noqa: E402
from bench.common import environ  # noqa: E402
from umbp.launcher import LocalPool  # noqa: E402


def run(mode: str, watermarks: bool, clients: int, seconds: float, capacity: str, page: int, batch: int) -> dict:
    env = {"PYTHONPATH": ROOT}
    if not watermarks:
        env.update(UMBP_HIGH_WATERMARK="1", UMBP_LOW_WATERMARK="1")
    with environ(env), LocalPool(nodes=1, capacity=capacity, port=0, metrics=False,
                                 metaserver_args=["--commit", mode]) as pool:
        value = np.random.default_rng(1).integers(0, 256, page, dtype=np.uint8).tobytes()
        fill = umbp.Client(pool.metaserver)
        cap = fill.stats()["capacity_bytes"]
        for i in range(cap // page // batch + batch):  # past full: evictions from here on
            fill.batch_put([b"fill/%d/%d" % (i, j) for j in range(batch)], [value] * batch)
        before = fill.stats()
        lat: list[list[float]] = [[] for _ in range(clients)]
        stop = time.monotonic() + seconds

        def put(w: int) -> None:
            with umbp.Client(pool.metaserver) as c:
                i = 0
                while time.monotonic() < stop:
                    t0 = time.perf_counter()
                    c.batch_put([b"w%d/%d/%d" % (w, i, j) for j in range(batch)], [value] * batch)
                    lat[w].append(time.perf_counter() - t0)
                    i += 1

        t0 = time.monotonic()
        threads = [threading.Thread(target=put, args=(w,)) for w in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        after = fill.stats()
        fill.close()
    calls = np.array([x for xs in lat for x in xs])
    return {"puts_s": len(calls) * batch / wall, "p50_ms": float(np.median(calls)) * 1e3,
            "p90_ms": float(np.percentile(calls, 90)) * 1e3,
            "evictions": after["evictions"] - before["evictions"], "etcd_txns": after["etcd_txns"] - before["etcd_txns"]}


def main() -> int:
    ap = argparse.ArgumentParser(description="puts into a full pool: the removal barrier's cost")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("--modes", default="durable,async")
    ap.add_argument("--capacity", default="64MiB")
    ap.add_argument("--page-kib", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16, help="pages a batch_put")
    args = ap.parse_args()
    page = args.page_kib * 1024 - 64  # header included: exactly page-kib of arena
    for mode in args.modes.split(","):
        for watermarks in (True, False):
            for clients in (int(x) for x in args.clients.split(",")):
                r = run(mode, watermarks, clients, args.seconds, args.capacity, page, args.batch)
                print(f"{mode:7} {'watermarks' if watermarks else 'no-watermark':12} clients {clients}: "
                      f"{r['puts_s']:8.0f} puts/s  call p50 {r['p50_ms']:6.2f} ms  p90 {r['p90_ms']:6.2f} ms  "
                      f"({r['evictions']} evictions, {r['etcd_txns']} etcd txns)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
