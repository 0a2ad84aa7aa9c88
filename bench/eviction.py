"""Eviction benchmark: prefix hit rate of ``lru`` against ``prefix-lru`` on a synthetic multi-turn agentic trace.

The trace (fixed by ``--seed``): ``--sessions`` agent sessions, ``--live`` of them in flight at a time, each turn
picked at random among the live ones. Every session starts from one system prompt shared by all sessions plus its
own task; each turn appends a tool result / user message (the prompt) and then the model's answer, so the context
grows and every turn re-sends everything before it. On some turns a session fans out subagents: each starts from
its parent's whole context plus a subtask and runs a few turns of its own (a prefix shared by siblings).

Each request is replayed the way an engine would: page keys of the prompt with ``umbp.keys.chain_keys`` (``--page``
tokens per page), ``prefix_hits`` for the reusable prefix, a load of those pages (``batch_get_into``: the reads
refresh recency, as a real engine's would), then ``batch_put`` of the pages it had to compute (prompt past the hit,
plus the answer), with ``parents`` so the metaserver knows the chains.

The same trace runs against two fresh pools (``umbp.launcher.LocalPool``: etcd, one metaserver, ``--nodes`` nodes)
that differ only in ``--eviction-policy``, with a capacity of ``--capacity-frac`` of the trace's working set (every
distinct page), so eviction decides what is reused. The figure is the prefix hit rate, tokens reused / tokens asked
(full pages of each prompt), for each policy, next to the ceiling of an unbounded pool, and the ratio prefix-lru /
lru. ``lost`` counts matched pages gone by the time of the load (the background watermark pass runs in between).
Nothing asserts; ``--quick`` runs a smaller trace, ``--nodes 1`` shows the policy without chains split across nodes.

``--metaservers N`` (> 1) replays each policy on a partitioned pool too (N metaserver processes, ``--slots`` slots:
every slot evicts in its own region of each node, ``metaserver/ha/slots.py``) and prints its hit rate next to one
process's and the difference in points (issue 18: within 2 points of pool-wide LRU). It also prints what ideal
static partitions would lose on the same trace (``static_split``: an offline LRU per slot of capacity / slots, no
pool): the part of the loss that only moving space between slots could win back. Both replays are then paced at
``--pace-ms`` (30 ms) a request: the background watermark pass runs on a clock, so an unpaced replay that runs 3x
slower on 3 processes (2 cores) would meet 3x more passes per request and measure the pass, not the partition.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import umbp  # noqa: E402
from transport.objformat import object_size  # noqa: E402
from umbp.keys import chain_keys, parents_of  # noqa: E402
from umbp.launcher import LocalPool  # noqa: E402

VOCAB = 128_000


@dataclass
class Ctx:
    """A session's context: its tokens and the keys of its full pages (full pages never change, so keys are only
    ever appended)."""

    tokens: list[int] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)

    def extend(self, new: list[int], page: int) -> None:
        self.tokens += new
        done = len(self.keys) * page
        full = len(self.tokens) // page * page
        if full > done:
            self.keys += chain_keys(self.tokens[done:full], page, parent=self.keys[-1] if self.keys else "")

    def fork(self) -> "Ctx":
        return Ctx(list(self.tokens), list(self.keys))


@dataclass
class Turn:
    prompt: list[str]  # keys of the prompt's full pages (what the request asks for)
    after: list[str]  # keys of the context's full pages once the answer is appended (what gets stored)


def make_trace(args) -> list[Turn]:
    rng = random.Random(args.seed)

    def toks(lo: int, hi: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))]

    system = toks(args.system, args.system)
    trace: list[Turn] = []
    live: list[list] = []  # [ctx, turns_left, is_subagent]
    started = 0

    def new_session() -> None:
        nonlocal started
        ctx = Ctx()
        ctx.extend(system + toks(256, 1024), args.page)
        live.append([ctx, rng.randint(args.turns // 2, args.turns * 3 // 2), False])
        started += 1

    while live or started < args.sessions:
        while started < args.sessions and sum(1 for s in live if not s[2]) < args.live:
            new_session()
        s = rng.choice(live)
        ctx = s[0]
        ctx.extend(toks(64, 512), args.page)  # tool result / user message
        prompt = list(ctx.keys)
        ctx.extend(toks(32, 256), args.page)  # the model's answer
        trace.append(Turn(prompt, list(ctx.keys)))
        s[1] -= 1
        if not s[2] and rng.random() < args.fanout_p:
            for _ in range(rng.randint(2, 3)):
                sub = ctx.fork()
                sub.extend(toks(64, 256), args.page)
                live.append([sub, rng.randint(2, 4), True])
        if s[1] <= 0:
            live.remove(s)
    return trace


def ceiling(trace: list[Turn]) -> tuple[int, int, int]:
    """Hit pages and asked pages with an unbounded pool, and the working set (distinct pages)."""
    seen: set[str] = set()
    hit = asked = 0
    for t in trace:
        n = 0
        for k in t.prompt:
            if k not in seen:
                break
            n += 1
        hit += n
        asked += len(t.prompt)
        seen.update(t.after)
    return hit, asked, len(seen)


def namespace(args) -> str:
    return f"bench/eviction/p{args.page}"


def static_split(trace: list[Turn], cap_pages: int, slots: int, ns: str) -> float:
    """Hit rate of ``slots`` ideal LRU partitions of ``cap_pages // slots`` pages each (slot = ``slotrules.slot_of``),
    replayed offline as the pool is used: prefix hits refreshed, puts of pages already held refresh them too."""
    from collections import OrderedDict

    from transport.slotrules import slot_of
    from umbp.keys import normalize_key

    parts = [OrderedDict() for _ in range(slots)]
    each = cap_pages // slots
    where: dict[str, OrderedDict] = {}
    hit = asked = 0
    for t in trace:
        for k in t.prompt + t.after:
            if k not in where:
                where[k] = parts[slot_of(ns, normalize_key(k), slots)]
        n = 0
        for k in t.prompt:
            if k not in where[k]:
                break
            n += 1
        hit += n
        asked += len(t.prompt)
        for k in t.prompt[:n] + t.after[n:]:
            p = where[k]
            p[k] = True
            p.move_to_end(k)
            if len(p) > each:
                p.popitem(last=False)
    return hit / asked if asked else 0.0


def replay(trace: list[Turn], policy: str, args, node_capacity: int, metaservers: int = 1) -> dict:
    payload = bytes(args.page_bytes)
    out = bytearray(args.page_bytes)
    parts = {"metaservers": metaservers, "slots": args.slots} if metaservers > 1 else {}
    with LocalPool(nodes=args.nodes, capacity=node_capacity,
                   metaserver_args=["--eviction-policy", policy], **parts) as pool:
        with umbp.Client(pool.metaserver, namespace=namespace(args)) as c:
            hit = asked = loaded = 0
            t0 = time.perf_counter()
            pace = args.pace_ms / 1000.0
            due = time.perf_counter()
            for t in trace:
                if pace:  # every request starts on the same clock in every replay (see --pace-ms)
                    due += pace
                    wait = due - time.perf_counter()
                    if wait > 0:
                        time.sleep(min(wait, pace))
                n = c.prefix_hits(t.prompt) if t.prompt else 0
                hit += n
                asked += len(t.prompt)
                if n:
                    got = c.batch_get_into(t.prompt[:n], [out] * n)
                    loaded += sum(1 for g in got if g >= 0)
                rest = t.after[n:]
                if rest:
                    c.batch_put(rest, [payload] * len(rest), parents=parents_of(t.after)[n:])
            elapsed = time.perf_counter() - t0
            s = c.stats()
    return {"hit": hit, "asked": asked, "loaded": loaded, "evictions": s["evictions"], "objects": s["objects"],
            "elapsed": elapsed}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--sessions", type=int, default=40, help="top-level agent sessions in the trace")
    p.add_argument("--live", type=int, default=10, help="top-level sessions in flight at a time")
    p.add_argument("--turns", type=int, default=8, help="mean turns per session (uniform in [T/2, 3T/2])")
    p.add_argument("--fanout-p", type=float, default=0.2, help="chance a turn fans out 2-3 subagents")
    p.add_argument("--system", type=int, default=1024, help="tokens of the system prompt all sessions share")
    p.add_argument("--page", type=int, default=16, help="tokens per page")
    p.add_argument("--page-bytes", type=int, default=4096 - 64, help="bytes per page (4 KiB objects)")
    p.add_argument("--capacity-frac", type=float, default=0.1, help="pool capacity / working set")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="a smaller trace (about a third)")
    p.add_argument("--metaservers", type=int, default=1, help="also replay on a partitioned pool of N processes")
    p.add_argument("--slots", type=int, default=8, help="slots of the partitioned pool (--metaservers > 1)")
    p.add_argument("--policies", default="lru,prefix-lru", help="comma-separated eviction policies to replay")
    p.add_argument("--pace-ms", type=float, default=None,
                   help="start a request every N ms (default: 0, as fast as possible; 30 with --metaservers > 1)")
    args = p.parse_args()
    if args.quick:
        args.sessions, args.live = 16, 6
    if args.pace_ms is None:
        args.pace_ms = 30.0 if args.metaservers > 1 else 0.0

    t0 = time.perf_counter()
    trace = make_trace(args)
    c_hit, c_asked, working = ceiling(trace)
    obj = object_size(args.page_bytes)
    cap_pages = int(working * args.capacity_frac)
    node_capacity = max(1 << 20, -(-cap_pages // args.nodes) * obj)
    cap_pages = node_capacity * args.nodes // obj
    print(f"trace: seed {args.seed}, {len(trace)} requests, {args.sessions} sessions ({args.live} live), "
          f"{args.page} tokens/page, {c_asked * args.page:,} prompt tokens asked; built in "
          f"{time.perf_counter() - t0:.1f}s")
    print(f"working set {working:,} pages ({working * obj / 2**20:.1f} MiB); pool {cap_pages:,} pages "
          f"({args.nodes} x {node_capacity / 2**20:.1f} MiB, {cap_pages / working:.0%} of the working set)")
    print(f"ceiling (unbounded pool): hit rate {c_hit / c_asked:.1%}")
    print(f"{'policy':<11} {'pool':<14} {'hit rate':>9} {'tokens reused':>15} {'evictions':>10} {'lost':>5} "
          f"{'seconds':>8}")
    kinds = [1] + ([args.metaservers] if args.metaservers > 1 else [])
    res = {}
    for policy in args.policies.split(","):
        for n in kinds:
            r = res[policy, n] = replay(trace, policy, args, node_capacity, n)
            pool = "1 process" if n == 1 else f"{n} procs/{args.slots} sl"
            print(f"{policy:<11} {pool:<14} {r['hit'] / r['asked']:>9.1%} {r['hit'] * args.page:>15,} "
                  f"{r['evictions']:>10,} {r['hit'] - r['loaded']:>5} {r['elapsed']:>8.1f}", flush=True)
        if args.metaservers > 1:
            one, many = (res[policy, n]["hit"] / res[policy, n]["asked"] for n in kinds)
            print(f"{policy}: partitioned {many:.1%} vs one process {one:.1%}: {(many - one) * 100:+.1f} points")
    if args.metaservers > 1:
        one_lru = static_split(trace, cap_pages, 1, namespace(args))
        split = static_split(trace, cap_pages, args.slots, namespace(args))
        print(f"ideal static split (offline LRU, same trace): {args.slots} slots {split:.1%} vs one LRU "
              f"{one_lru:.1%}: {(split - one_lru) * 100:+.1f} points (what only moving space between slots wins back)")
    if ("lru", 1) in res and ("prefix-lru", 1) in res:
        lru, plru = (res[k, 1]["hit"] / res[k, 1]["asked"] for k in ("lru", "prefix-lru"))
        print(f"ratio prefix-lru / lru: {plru / lru:.2f}x" if lru else "ratio: lru reused nothing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
