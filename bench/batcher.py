"""The metaserver's etcd batch writer (``metaserver/store/batcher.py``) on its own: loop CPU to drain a flood of deletes
(a node's pages dropped at once, ``umbp evict``, a client's removals) and to pass a steady stream of commits, over an
etcd double that answers after a set latency (``--latency-ms``: other workers take past the keys in flight
meanwhile), counting CPU only, so the figure is the writer's bookkeeping alone.

Baseline, same run: the same writer with its queue swapped for a plain dict (what it used before). A dict used as a
FIFO keeps a hole at the head of its entry table for every op taken until an insert resizes it, and iterating it
skips them all, so a flood with no insert among its takes drains in quadratic time; the ordered queue stays linear.
Nothing asserts: it prints seconds of CPU (``time.process_time``) and us per op. ``--quick``: smaller floods.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from metaserver.store.batcher import TXN_OPS, BatchWriter  # noqa: E402


class TimedStore:
    """What the writer calls of ``EtcdStore``: ``write`` returns after ``LATENCY_S`` (an etcd round trip: the other
    workers take meanwhile, past the keys in flight), or after one loop turn when it is 0."""

    def __init__(self):
        self.ops = 0

    async def write(self, items) -> None:
        await asyncio.sleep(LATENCY_S)
        self.ops += len(items)


BATCH = TXN_OPS  # operations a transaction (--batch)
LATENCY_S = 0.002  # a transaction's round trip (--latency-ms)


def writer(plain_dict: bool) -> tuple[TimedStore, BatchWriter]:
    """A started writer as the metaserver runs it (``BATCH``-op transactions, four in flight) over an
    ``TimedStore``; ``plain_dict``: its queue swapped for a dict (the baseline)."""
    store = TimedStore()
    w = BatchWriter(store, batch=BATCH, inflight=4)
    if plain_dict:
        w._queue = {}
    w.start()
    return store, w


async def drain(n: int, plain_dict: bool) -> float:
    """CPU-seconds from submitting ``n`` deletes at once until all of them are written."""
    store, w = writer(plain_dict)
    keys = [b"/umbp/pages/ns/%064x" % i for i in range(n)]
    t = time.process_time()
    w.submit([], keys, wait=False)
    assert await w.flush(600)
    dt = time.process_time() - t
    await w.close()
    assert store.ops == n
    return dt


async def steady(rounds: int, plain_dict: bool) -> float:
    """CPU-us per op of 128-op waited submissions, four at a time (the commit path under load)."""
    _store, w = writer(plain_dict)
    t = time.process_time()
    for r in range(rounds):  # (with LATENCY_S > 0 the four submissions wait on each other: CPU is what counts)
        futs = [w.submit([(b"/umbp/pages/ns/%d/%d/%d" % (r, f, i), b"v") for i in range(128)], [], wait=True)
                for f in range(4)]
        await asyncio.gather(*futs)
    dt = time.process_time() - t
    await w.close()
    return dt / (rounds * 4 * 128) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="floods of 30k and 100k ops only")
    ap.add_argument("--batch", type=int, default=TXN_OPS, help="operations a transaction (the metaserver's default)")
    ap.add_argument("--latency-ms", type=float, default=2.0, help="a transaction's round trip (0: one loop turn)")
    a = ap.parse_args()
    global BATCH, LATENCY_S
    BATCH, LATENCY_S = a.batch, a.latency_ms / 1e3
    print(f"{BATCH}-op transactions, four in flight, {a.latency_ms:g} ms a transaction (not counted: CPU only)")
    sizes = (30_000, 100_000) if a.quick else (30_000, 300_000, 1_000_000)
    for n in sizes:
        new, old = asyncio.run(drain(n, False)), asyncio.run(drain(n, True))
        print(f"flood of {n:>9,} deletes: drained in {new:6.2f} s CPU ({new / n * 1e6:.2f} us/op) | "
              f"plain-dict queue {old:6.2f} s ({old / n * 1e6:.2f} us/op) | ratio {old / new:5.1f}x")
    new, old = asyncio.run(steady(500, False)), asyncio.run(steady(500, True))
    print(f"steady commits, 4 x 128-op waited submissions: {new:.2f} us/op | plain-dict queue {old:.2f} us/op | "
          f"ratio {old / new:.2f}x")


if __name__ == "__main__":
    main()
