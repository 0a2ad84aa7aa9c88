"""The per-node arena allocator (``metaserver/table/allocator.py``) on its own: CPU per operation in the three shapes a
pool takes, against the same allocator with its bins as plain dicts (what they were before), measured in this run.

- fresh: objects carved one after another from one large free extent (a new or emptied pool);
- full: a full pool, each new object in the hole its eviction left (free one at random, allocate one);
- holes: a pool fragmented into L same-size holes (every other object freed, as evictions down to a watermark
  leave it), then L allocations refilling them. A bin is taken from its head; a plain dict keeps a hole at the head
  of its entry table per member taken until an insert resizes it, and iterating it skips them all, so refilling L
  holes took time quadratic in L. The ordered bins (``collections.OrderedDict``, iterated by its links) stay O(1).

Nothing asserts; ``time.process_time``, best of ``--rounds``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import metaserver.table.allocator as allocator  # noqa: E402
from transport.objformat import ARENA_DATA_START, object_size  # noqa: E402


def fresh(size: int, n: int) -> float:
    a = allocator.Allocator(ARENA_DATA_START, (n + 1) * size, track=False)
    t = time.process_time()
    for _ in range(n):
        a.alloc(size)
    return (time.process_time() - t) / n


def full(size: int, n: int) -> float:
    a = allocator.Allocator(ARENA_DATA_START, n * size, track=False)
    offs = [a.alloc(size) for _ in range(n)]
    order = list(range(n))
    random.Random(1).shuffle(order)
    t = time.process_time()
    for i in order:
        a.free(offs[i], size)
        offs[i] = a.alloc(size)
    return (time.process_time() - t) / n


def holes(size: int, n: int) -> float:
    a = allocator.Allocator(ARENA_DATA_START, (2 * n + 1) * size, track=False)
    offs = [a.alloc(size) for _ in range(2 * n)]
    for off in offs[::2]:
        a.free(off, size)
    t = time.process_time()
    for _ in range(n):
        a.alloc(size)
    return (time.process_time() - t) / n


def best(fn, size: int, n: int, rounds: int) -> float:
    return min(fn(size, n) for _ in range(rounds))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--holes", type=int, default=60_000, help="L, the holes refilled")
    a = ap.parse_args()
    ordered = allocator._Bin
    for size in (4096, 64 << 10, object_size(5 << 19), object_size(9 << 20)):
        for name, fn, n in (("fresh", fresh, 100_000), ("full", full, 100_000), (f"holes L={a.holes:,}", holes,
                                                                                a.holes)):
            allocator._Bin = ordered
            new = best(fn, size, n, a.rounds)
            allocator._Bin = dict
            old = best(fn, size, n, a.rounds)
            allocator._Bin = ordered
            print(f"{size:>9} B  {name:<16} {new * 1e6:6.2f} us/alloc | dict bins {old * 1e6:7.2f} us | "
                  f"ratio {old / new:6.2f}x")


if __name__ == "__main__":
    main()
