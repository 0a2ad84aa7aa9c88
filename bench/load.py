"""Load test: N client processes doing mixed batches against a pool for a bounded time, every byte checked.

Each client is its own process (``multiprocessing`` spawn) with its own ``umbp.Client``; until the shared deadline
it repeatedly picks one operation from the mix and runs it on a batch of ``--batch`` pages:
- ``put``: a fresh chain of pages (each page's parent is the one before it), ``batch_put``; every page must be
  stored (True): False for a key nobody wrote before is an error;
- ``get``: ``batch_get_into`` of pages known written (seed chains the driver put first, shared by all clients,
  and the client's own recent chains);
- ``exists``: ``batch_exists`` of known pages and never-written keys (a never-written key reported present is a
  wrong answer);
- ``prefix``: ``prefix_hits`` of a known chain followed by never-written keys (at most the chain's length) or of a
  never-written chain (must be 0);
- ``ranged``: ``batch_get_ranges_into`` of one to three layer groups of each page (a page is split into
  ``LAYERS`` equal layer slices, as the engine's page-first layout does).
Every page's bytes are a function of its key (``Content``), so any client verifies any page it reads: a hit whose
bytes differ is counted in ``wrong_bytes`` (pages or ranges), and the run fails. A miss is not an error (pages may
be evicted under pressure: ``evictions`` is reported next to ``misses``); an exception is (by type, with a
sample message).

Reported: per operation batches/s, keys/s, GB/s, p50/p99 latency of one batch call; totals (ops/s, GB/s moved,
errors, wrong bytes, misses); the pool's evictions; and each server process's peak RSS (``VmHWM`` from
/proc/PID/status: the metaserver's pid from the pool this script started, or ``--metaserver-pid``; node pids from
NODES, i.e. ``umbp nodes --json``, read only for nodes on this host). ``--json PATH`` writes all of it as one
object. The exit status is 1 when any page came back wrong, any error happened or a client process failed.

Bounds: the run lasts ``--seconds`` (``--short``: 5 s, 2 clients, small pages, a 256 MiB-per-node pool); each
client call has the client's deadline (``--timeout``); latency samples are capped per client and operation
(reservoir); the driver waits at most ``seconds + START_S + 60`` for the clients and then kills the stragglers.

Usage: ``python bench/load.py`` (starts etcd, a metaserver and ``--nodes`` nodes, like ``umbp up``), ``--etcd URL``
to start the pool against an existing etcd, or ``--metaserver HOST:PORT`` to load an existing pool.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import multiprocessing as mp
import os
import queue
import random
import socket
import sys
import time
import traceback
import uuid

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import umbp  # noqa: E402
from transport import wire  # noqa: E402
from umbp.errors import UmbpError  # noqa: E402
from umbp.launcher import LocalPool  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
OPS = ("put", "get", "exists", "prefix", "ranged")
DEFAULT_MIX = "put=2,get=4,exists=1,prefix=1,ranged=2"
LAYERS = 8  # layer slices per page for ranged reads
SAMPLES = 50_000  # latency samples kept per client and operation (reservoir)
START_S = 120.0  # clients must be connected and ready within this
RECENT_CHAINS = 64  # a client's own chains it keeps reading back
POOL_BYTES = 8 * MiB  # random bytes pages are cut from


class Content:
    """The bytes of a page, from its key alone: 16 bytes of the key's hash, then a slice of a fixed random pool
    (the same in every process) at an offset the hash picks. Cheap to produce and to check (one slice)."""

    def __init__(self, sizes: list[int]):
        self.sizes = sizes
        self.pool = np.random.default_rng(20251130).integers(0, 256, POOL_BYTES, dtype=np.uint8)

    def _hash(self, key: bytes) -> bytes:
        return hashlib.blake2b(key, digest_size=16).digest()

    def size(self, key: bytes) -> int:
        return self.sizes[self._hash(key)[8] % len(self.sizes)]

    def expected(self, key: bytes) -> np.ndarray:
        h = self._hash(key)
        size = self.sizes[h[8] % len(self.sizes)]
        off = int.from_bytes(h[:8], "little") % (POOL_BYTES - size)
        out = np.empty(size, np.uint8)
        out[:16] = np.frombuffer(h, np.uint8)
        out[16:] = self.pool[off:off + size - 16]
        return out


class Stats:
    """One client's counters for one operation."""

    def __init__(self) -> None:
        self.batches = 0
        self.keys = 0
        self.bytes = 0
        self.lat: list[float] = []
        self.seen = 0  # latencies observed (the reservoir keeps SAMPLES of them)

    def record(self, rng: random.Random, seconds: float, keys: int, nbytes: int) -> None:
        self.batches += 1
        self.keys += keys
        self.bytes += nbytes
        self.seen += 1
        if len(self.lat) < SAMPLES:
            self.lat.append(seconds)
        else:
            j = rng.randrange(self.seen)
            if j < SAMPLES:
                self.lat[j] = seconds


def layer_ranges(size: int, rng: random.Random) -> list[tuple[int, int]]:
    """One to three layer groups of a page split into LAYERS slices: (offset, length) pairs."""
    step = max(1, size // LAYERS)
    bounds = [min(i * step, size) for i in range(LAYERS)] + [size]
    out = []
    for _ in range(rng.randint(1, 3)):
        a = rng.randrange(LAYERS)
        b = min(LAYERS, a + rng.randint(1, 3))
        out.append((bounds[a], bounds[b] - bounds[a]))
    return out


def worker(w: int, cfg: dict, ready, go, start_at, results) -> None:
    """One client process; puts its result dict (or a crash report) on ``results``."""
    try:
        results.put(_work(w, cfg, ready, go, start_at))
    except BaseException as e:  # noqa: BLE001 - the driver must hear about any death
        results.put({"worker": w, "crash": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})


def _work(w: int, cfg: dict, ready, go, start_at) -> dict:
    rng = random.Random(cfg["seed"] * 1000 + w)
    content = Content(cfg["sizes"])
    transport = cfg["transport"]
    if transport == "mixed":
        transport = "tcp" if w % 2 == 0 else "auto"
    batch = cfg["batch"]
    ns = cfg["namespace"]
    mix = cfg["mix"]
    ops, weights = list(mix), [mix[o] for o in mix]
    stats = {op: Stats() for op in OPS}
    errors: collections.Counter = collections.Counter()
    samples: dict[str, str] = {}
    wrong = {"pages": 0, "ranges": 0, "exists": 0, "prefix": 0, "examples": []}
    misses = 0
    seed_chains = [[f"seed/c{c}/{i}".encode() for i in range(batch)] for c in range(cfg["seed_chains"])]
    own: collections.deque = collections.deque(maxlen=RECENT_CHAINS)
    max_size = max(cfg["sizes"])
    outs = [np.empty(max_size, np.uint8) for _ in range(batch)]
    range_outs = [[np.empty(max_size, np.uint8) for _ in range(3)] for _ in range(batch)]
    chain_no = 0
    never = 0

    def note_wrong(kind: str, detail: str) -> None:
        wrong[kind] += 1
        if len(wrong["examples"]) < 5:
            wrong["examples"].append(f"client {w} {kind}: {detail}")

    def known_keys() -> list[bytes]:
        pool = seed_chains + list(own)
        return [rng.choice(rng.choice(pool)) for _ in range(batch)]

    with umbp.Client(cfg["metaserver"], namespace=ns, transport=transport, timeout=cfg["timeout"]) as c:
        c.batch_exists([b"warmup"])  # connect before the clock starts
        ready.put(w)
        if not go.wait(START_S):
            raise TimeoutError(f"client {w}: no start signal")
        end = start_at.value + cfg["seconds"]
        t_begin = time.monotonic()
        while time.monotonic() < end:
            op = rng.choices(ops, weights)[0]
            try:
                if op == "put":
                    chain_no += 1
                    keys = [f"w{w}/c{chain_no}/{i}".encode() for i in range(batch)]
                    vals = [content.expected(k) for k in keys]
                    t = time.perf_counter()
                    stored = c.batch_put(keys, vals, parents=[None] + keys[:-1])
                    dt = time.perf_counter() - t
                    if not all(stored):
                        errors["put returned False for a new key"] += 1
                    else:
                        own.append(keys)
                    stats[op].record(rng, dt, batch, sum(v.nbytes for v in vals))
                elif op == "get":
                    keys = known_keys()
                    views = [outs[j][:content.size(k)] for j, k in enumerate(keys)]
                    t = time.perf_counter()
                    got = c.batch_get_into(keys, views)
                    dt = time.perf_counter() - t
                    nbytes = 0
                    for k, v, g in zip(keys, views, got):
                        if g < 0:
                            misses += 1
                            continue
                        nbytes += g
                        if g != len(v) or not np.array_equal(v, content.expected(k)):
                            note_wrong("pages", f"{k!r}: {g} bytes, expected {len(v)} of its content")
                    stats[op].record(rng, dt, batch, nbytes)
                elif op == "exists":
                    half = batch // 2
                    known = known_keys()[:half]
                    fresh = [f"never/w{w}/{never + i}".encode() for i in range(batch - half)]
                    never += len(fresh)
                    t = time.perf_counter()
                    res = c.batch_exists(known + fresh)
                    dt = time.perf_counter() - t
                    if any(res[half:]):
                        note_wrong("exists", f"never-written keys reported present: {res[half:]}")
                    stats[op].record(rng, dt, batch, 0)
                elif op == "prefix":
                    if rng.random() < 0.5:
                        chain = rng.choice(seed_chains + list(own))
                        cut = rng.randint(1, len(chain))
                        keys = chain[:cut] + [f"never/w{w}/{never + i}".encode() for i in range(batch - cut)]
                        limit = cut
                    else:
                        keys = [f"never/w{w}/{never + i}".encode() for i in range(batch)]
                        limit = 0
                    never += batch
                    t = time.perf_counter()
                    hits = c.prefix_hits(keys)
                    dt = time.perf_counter() - t
                    if not 0 <= hits <= limit:
                        note_wrong("prefix", f"prefix_hits {hits} for a chain with {limit} written pages")
                    stats[op].record(rng, dt, batch, 0)
                else:  # ranged
                    keys = known_keys()
                    ranges = [layer_ranges(content.size(k), rng) for k in keys]
                    bufs = [[range_outs[j][i][:n] for i, (_, n) in enumerate(rs)] for j, rs in enumerate(ranges)]
                    t = time.perf_counter()
                    got = c.batch_get_ranges_into(keys, ranges, bufs)
                    dt = time.perf_counter() - t
                    nbytes = 0
                    for k, rs, bs, g in zip(keys, ranges, bufs, got):
                        if g < 0:
                            misses += 1
                            continue
                        nbytes += g
                        exp = content.expected(k)
                        for (start, n), b in zip(rs, bs):
                            if not np.array_equal(b, exp[start:start + n]):
                                note_wrong("ranges", f"{k!r} range {start}+{n}")
                        if g != sum(n for _, n in rs):
                            note_wrong("ranges", f"{k!r}: {g} bytes for ranges {rs}")
                    stats[op].record(rng, dt, batch, nbytes)
            except UmbpError as e:
                name = f"{op}: {type(e).__name__}"
                errors[name] += 1
                samples.setdefault(name, str(e)[:300])
        elapsed = time.monotonic() - t_begin
    return {"worker": w, "transport": transport, "elapsed": elapsed, "errors": dict(errors), "samples": samples,
            "wrong": wrong, "misses": misses,
            "ops": {op: {"batches": s.batches, "keys": s.keys, "bytes": s.bytes, "lat": s.lat}
                    for op, s in stats.items()}}


# ---- the driver ------------------------------------------------------------------------------------------------

def peak_rss(pid: int | None) -> dict:
    """VmHWM (peak resident set), VmRSS and its parts RssAnon (the process's own memory) and RssShmem (shared
    memory it touched: a node's arena pages) of a local process, in bytes; {} when it cannot be read."""
    if not pid:
        return {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            fields = dict(line.split(":", 1) for line in fh if ":" in line)
    except OSError:
        return {}
    out = {}
    for name, key in (("VmHWM", "peak_rss_bytes"), ("VmRSS", "rss_bytes"), ("RssAnon", "rss_anon_bytes"),
                      ("RssShmem", "rss_shmem_bytes")):
        if name in fields:
            out[key] = int(fields[name].split()[0]) * 1024
    return out


def server_pids(ms_addr: str, metaserver_pid: int | None) -> dict[str, int | None]:
    """{"metaserver": pid, "node <id>": pid} for servers on this host (pids of other hosts mean nothing here)."""
    out: dict[str, int | None] = {"metaserver": metaserver_pid}
    here = socket.gethostname()
    with umbp.Client(ms_addr) as c:
        for n in c.admin(wire.Op.NODES)["nodes"]:
            if n.get("hostname") in (here, "") or n.get("host", "").startswith("127."):
                out[f"node {n['node_id']}"] = n.get("pid") or None
    return out


def seed(ms_addr: str, cfg: dict) -> None:
    content = Content(cfg["sizes"])
    with umbp.Client(ms_addr, namespace=cfg["namespace"], timeout=cfg["timeout"]) as c:
        for ch in range(cfg["seed_chains"]):
            keys = [f"seed/c{ch}/{i}".encode() for i in range(cfg["batch"])]
            c.batch_put(keys, [content.expected(k) for k in keys], parents=[None] + keys[:-1])


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


def run(ms_addr: str, cfg: dict, metaserver_pid: int | None) -> dict:
    seed(ms_addr, cfg)
    with umbp.Client(ms_addr) as c:
        before = c.stats()
    ctx = mp.get_context("spawn")
    ready, results = ctx.Queue(), ctx.Queue()
    go = ctx.Event()
    start_at = ctx.Value("d", 0.0)
    procs = [ctx.Process(target=worker, args=(w, cfg, ready, go, start_at, results), daemon=True)
             for w in range(cfg["clients"])]
    for p in procs:
        p.start()
    outs: list[dict] = []
    crashed: list[str] = []
    try:
        deadline = time.monotonic() + START_S
        n_ready = 0
        while n_ready < len(procs):  # bounded by START_S; an early crash report counts as ready
            try:
                ready.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"load: only {n_ready} of {len(procs)} clients ready within {START_S:.0f}s")
            n_ready += 1
        start_at.value = time.monotonic()
        go.set()
        deadline = time.monotonic() + cfg["seconds"] + 60
        for _ in procs:
            try:
                r = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                crashed.append("a client did not report before the deadline")
                break
            if "crash" in r:
                crashed.append(f"client {r['worker']}: {r['crash']}")
            else:
                outs.append(r)
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    with umbp.Client(ms_addr) as c:
        after = c.stats()
        pids = server_pids(ms_addr, metaserver_pid)
    elapsed = max((o["elapsed"] for o in outs), default=cfg["seconds"])
    ops = {}
    for op in OPS:
        lat = [x for o in outs for x in o["ops"][op]["lat"]]
        b = sum(o["ops"][op]["batches"] for o in outs)
        k = sum(o["ops"][op]["keys"] for o in outs)
        nbytes = sum(o["ops"][op]["bytes"] for o in outs)
        ops[op] = {"batches": b, "keys": k, "bytes": nbytes, "batches_per_s": b / elapsed, "keys_per_s": k / elapsed,
                   "gb_per_s": nbytes / elapsed / 1e9, "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99)}
    errors: collections.Counter = collections.Counter()
    samples: dict[str, str] = {}
    for o in outs:
        errors.update(o["errors"])
        for k, v in o["samples"].items():
            samples.setdefault(k, v)
    for msg in crashed:
        errors["client process failed"] += 1
        samples.setdefault("client process failed", msg[:2000])
    wrong = {kind: sum(o["wrong"][kind] for o in outs) for kind in ("pages", "ranges", "exists", "prefix")}
    return {
        "config": {k: v for k, v in cfg.items() if k != "metaserver"}, "metaserver": ms_addr,
        "elapsed_s": elapsed, "clients_reported": len(outs),
        "transports": {o["worker"]: o["transport"] for o in outs},
        "ops": ops,
        "total": {"batches_per_s": sum(o["batches"] for o in ops.values()) / elapsed,
                  "keys_per_s": sum(o["keys"] for o in ops.values()) / elapsed,
                  "gb_per_s": sum(o["bytes"] for o in ops.values()) / elapsed / 1e9},
        "errors": dict(errors), "error_samples": samples,
        "wrong": wrong, "wrong_bytes": wrong["pages"] + wrong["ranges"],
        "wrong_answers": wrong["exists"] + wrong["prefix"],
        "wrong_examples": [e for o in outs for e in o["wrong"]["examples"]][:10],
        "misses": sum(o["misses"] for o in outs),
        "pool": {"evictions": after.get("evictions", 0) - before.get("evictions", 0),
                 "objects": after.get("objects"), "used_bytes": after.get("used_bytes"),
                 "capacity_bytes": after.get("capacity_bytes")},
        "servers": {name: dict(pid=pid, **peak_rss(pid)) for name, pid in pids.items()},
    }


def report(res: dict) -> str:
    lines = [f"umbp bench/load.py: {res['config']['clients']} clients x {res['elapsed_s']:.1f} s, batches of "
             f"{res['config']['batch']}, pages {'/'.join(str(s // KiB) for s in res['config']['sizes'])} KiB, "
             f"transports {sorted(set(res['transports'].values()))}",
             f"{'op':<8} {'batches/s':>10} {'keys/s':>10} {'GB/s':>7} {'p50 ms':>8} {'p99 ms':>8}"]
    for op, o in res["ops"].items():
        lines.append(f"{op:<8} {o['batches_per_s']:>10,.0f} {o['keys_per_s']:>10,.0f} {o['gb_per_s']:>7.3f} "
                     f"{o['p50_ms']:>8.2f} {o['p99_ms']:>8.2f}")
    t = res["total"]
    lines.append(f"{'total':<8} {t['batches_per_s']:>10,.0f} {t['keys_per_s']:>10,.0f} {t['gb_per_s']:>7.3f}")
    lines.append(f"wrong bytes: {res['wrong_bytes']} (pages {res['wrong']['pages']}, ranges "
                 f"{res['wrong']['ranges']}); wrong answers: {res['wrong_answers']}; errors: "
                 f"{sum(res['errors'].values())} {res['errors'] or ''}; misses: {res['misses']} "
                 f"(pool evictions during the run: {res['pool']['evictions']})")
    for k, v in res["error_samples"].items():
        lines.append(f"  error {k}: {v}")
    for e in res["wrong_examples"]:
        lines.append(f"  WRONG {e}")
    for name, s in res["servers"].items():
        if "peak_rss_bytes" in s:
            lines.append(f"{name:<16} pid {s['pid']:<8} peak RSS {s['peak_rss_bytes'] / MiB:8.1f} MiB; now "
                         f"{s['rss_bytes'] / MiB:.1f} MiB = {s.get('rss_anon_bytes', 0) / MiB:.1f} own + "
                         f"{s.get('rss_shmem_bytes', 0) / MiB:.1f} shared memory (arena)")
        else:
            lines.append(f"{name:<16} pid {s['pid']}: peak RSS not readable here")
    return "\n".join(lines)


def parse_mix(text: str) -> dict[str, float]:
    mix = {}
    for part in text.split(","):
        name, _, weight = part.partition("=")
        if name.strip() not in OPS:
            raise SystemExit(f"load: unknown operation {name!r} in --mix (known: {', '.join(OPS)})")
        mix[name.strip()] = float(weight or 1)
    return mix


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=None, help="client processes (default 4; --short: 2)")
    ap.add_argument("--seconds", type=float, default=None, help="how long the load runs (default 20; --short: 5)")
    ap.add_argument("--short", action="store_true", help="a ~5 s run with small pages, for tests")
    ap.add_argument("--batch", type=int, default=16, help="pages per batch call")
    ap.add_argument("--sizes", default=None, help="page sizes in KiB, comma-separated (default 16,64,256)")
    ap.add_argument("--mix", default=DEFAULT_MIX, help=f"operation weights (default {DEFAULT_MIX})")
    ap.add_argument("--transport", default="mixed", choices=["mixed", "auto", "tcp", "shm"],
                    help="mixed: even clients tcp, odd ones auto (shm on this host)")
    ap.add_argument("--timeout", type=float, default=30.0, help="client deadline per call, seconds")
    ap.add_argument("--metaserver", help="load an existing pool instead of starting one")
    ap.add_argument("--metaserver-pid", type=int, help="pid of that pool's metaserver, for its peak RSS")
    ap.add_argument("--etcd", help="start the pool against this etcd (HOST:PORT) instead of a fresh one")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--capacity", default=None, help="per node (default 1GiB; --short: 256MiB)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the results to this file as JSON")
    args = ap.parse_args(argv)
    sizes = [int(s) * KiB for s in (args.sizes or ("4,16,64" if args.short else "16,64,256")).split(",")]
    if min(sizes) < 16:
        raise SystemExit("load: pages must be at least 16 bytes (the key hash prefix)")
    cfg = {"clients": args.clients or (2 if args.short else 4),
           "seconds": args.seconds or (5.0 if args.short else 20.0), "batch": args.batch, "sizes": sizes,
           "mix": parse_mix(args.mix), "transport": args.transport, "timeout": args.timeout, "seed": args.seed,
           "namespace": f"load-{uuid.uuid4().hex[:8]}", "seed_chains": 8}
    capacity = args.capacity or ("256MiB" if args.short else "1GiB")
    if args.metaserver:
        cfg["metaserver"] = args.metaserver
        res = run(args.metaserver, cfg, args.metaserver_pid)
    else:
        print(f"load: starting a pool ({args.nodes} nodes of {capacity}) ...", file=sys.stderr, flush=True)
        with LocalPool(nodes=args.nodes, capacity=capacity, etcd=args.etcd, port=0) as pool:
            ms_pid = next(ch.proc.pid for ch in pool.children if ch.name == "metaserver")
            cfg["metaserver"] = pool.metaserver
            res = run(pool.metaserver, cfg, ms_pid)
    print(report(res), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1, sort_keys=True)
    ok = res["wrong_bytes"] == 0 and res["wrong_answers"] == 0 and not res["errors"] \
        and res["clients_reported"] == cfg["clients"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
