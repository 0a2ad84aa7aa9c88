"""Scaling of a partitioned directory (issue 18): lookups and alloc+commit per second of N metaserver processes
against one (today's unpartitioned metaserver), each driven by ``--clients`` client processes.

For each pool (``umbp.launcher.LocalPool``: etcd, the metaserver processes, ``--nodes`` nodes): every client process
first allocates and commits its own pages in batches of ``--batch`` keys for ``--seconds`` (ALLOC then COMMIT per
batch, metadata only: no page bytes are written, so the figure is the directory's, not the nodes'), then looks
random batches of its committed keys up for ``--seconds`` (LOOKUP, then RELEASE of the read lease). The figure is
keys per second summed over the clients, counted between a common start and end; the ratio is N processes over one.
Through the client's router a batch becomes one request per process it touches (the slots a process leads ride in
one multi-slot request, ``metaserver/multislot.py``), each process then running one part per slot: ``--batch`` and
``--slots`` say how many keys a part has.

Nothing asserts; the issue's target is a ratio of at least 3.5 for 4 processes, on a machine with enough cores
for the processes and their clients (the GPU machine's 16, not this 2-core VM).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import umbp  # noqa: E402
from transport.wire import Op  # noqa: E402
from umbp.launcher import LocalPool  # noqa: E402


def worker(ms: str, w: int, batch: int, start_at: float, seconds: float, out) -> None:
    """One client process: alloc+commit phase from ``start_at``, then the lookup phase; puts (committed keys,
    lookups keys found) on ``out``."""
    with umbp.Client(ms, namespace="bench-slots") as c:
        call = c._meta.call
        call(Op.EXISTS, {"ns": "bench-slots", "keys": [f"warm/{w}/{j}".encode() for j in range(batch)]},
             c._deadline())  # connected and routed outside the timing
        keys: list[bytes] = []
        committed = i = 0
        while time.time() < start_at:
            time.sleep(0.001)
        end = start_at + seconds
        while time.time() < end:
            kb = [f"s/{w}/{i}/{j}".encode() for j in range(batch)]
            i += 1
            items = call(Op.ALLOC, {"ns": "bench-slots", "keys": kb, "sizes": [4000] * batch}, c._deadline())["items"]
            ok = [(k, it[4]) for k, it in zip(kb, items) if it[0] == 0]
            if not ok:
                continue
            res = call(Op.COMMIT, {"ns": "bench-slots", "keys": [k for k, _ in ok], "gens": [g for _, g in ok]},
                       c._deadline())["ok"]
            keys += [k for (k, _), r in zip(ok, res) if r]
            committed += sum(res)
        rng = random.Random(w)
        found = 0
        start2, end2 = end + 1.0, end + 1.0 + seconds
        while time.time() < start2:
            time.sleep(0.001)
        while time.time() < end2 and keys:
            kb = rng.sample(keys, min(batch, len(keys)))
            reply = call(Op.LOOKUP, {"ns": "bench-slots", "keys": kb}, c._deadline())
            found += sum(1 for loc in reply["locs"] if loc)
            if reply.get("lease"):
                c._meta.send_noreply(Op.RELEASE, {"lease": reply["lease"]}, c._deadline())
        out.put((committed, found))


def measure(n: int, args) -> tuple[float, float]:
    parts = {"metaservers": n, "slots": args.slots} if n > 1 else {}
    with LocalPool(nodes=args.nodes, capacity=args.capacity, **parts) as pool:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        start_at = time.time() + 3.0 + 0.1 * args.clients
        ps = [ctx.Process(target=worker, args=(pool.metaserver, w, args.batch, start_at, args.seconds, q))
              for w in range(args.clients)]
        for p in ps:
            p.start()
        res = []
        deadline = time.time() + 60 + 3 * args.seconds + 0.1 * args.clients
        while len(res) < len(ps) and time.time() < deadline:
            try:
                res.append(q.get(timeout=1.0))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in ps):
                    raise SystemExit("bench/slots.py: a client process failed (its traceback is above)")
        if len(res) < len(ps):
            raise SystemExit(f"bench/slots.py: {len(ps) - len(res)} client processes did not answer in time")
        for p in ps:
            p.join(10)
    return sum(r[0] for r in res) / args.seconds, sum(r[1] for r in res) / args.seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--metaservers", type=int, default=4, help="processes of the partitioned pool (vs one)")
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--clients", type=int, default=12, help="client processes driving each pool")
    p.add_argument("--batch", type=int, default=128, help="keys per ALLOC/COMMIT/LOOKUP")
    p.add_argument("--seconds", type=float, default=8.0, help="each phase")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--capacity", default="4GiB", help="per node (the alloc+commit phase must not evict)")
    args = p.parse_args()
    print(f"cores {os.cpu_count()}, {args.clients} client processes, batches of {args.batch}, {args.seconds:.0f} s "
          f"per phase, {args.nodes} nodes x {args.capacity}", flush=True)
    rows = {}
    for n in (1, args.metaservers):
        rows[n] = measure(n, args)
        what = "one process (unpartitioned)" if n == 1 else f"{n} processes / {args.slots} slots"
        print(f"{what:<30} alloc+commit {rows[n][0]:>10,.0f} keys/s   lookups {rows[n][1]:>10,.0f} keys/s",
              flush=True)
    one, many = rows[1], rows[args.metaservers]
    print(f"ratio {args.metaservers} processes / one: alloc+commit {many[0] / max(one[0], 1):.2f}x, "
          f"lookups {many[1] / max(one[1], 1):.2f}x (issue 18 target: >= 3.5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
