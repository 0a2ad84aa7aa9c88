"""Disk-tier replay benchmark (issue 47): the same agentic trace through a pool with DRAM only, then DRAM + disk.

Target (issue 47): in a replay whose working set is 5x the pool's DRAM, DRAM + disk serves at least 2x the tokens
from cache that DRAM alone does.

The trace comes from the project's generator (``umbp.workload.generator``, the AgentX shape, fewer turns than the
published 43 so a run moves a few GB instead of tens), sized so that its working set (the distinct pages the
replay writes, times their extent) is ``--ws-factor`` x the pool's DRAM: the sessions are counted first by a dry
replay against an unbounded in-memory pool, which also gives the ceiling (what a pool that never evicts serves with
the same ranks and routing). Then the trace is replayed (``umbp.workload.replay.Replay``: DP ranks with a small HBM
cache, round-robin routing, write-back threads, every byte read checked) twice, each against a fresh
``umbp.launcher.LocalPool`` (etcd, a metaserver, ``--nodes`` nodes): first DRAM only, then the same DRAM with a
disk tier of ``--disk-factor`` x DRAM per node, a file in ``--disk-dir`` (default: the temporary directory, which
must not be tmpfs for O_DIRECT; the node says when it falls back to buffered I/O and the bench reports it).
Same trace, same client settings, same watermarks.

Printed per run, and written with ``--json PATH``: tokens served by the pool (its prefix hits), by HBM and
recomputed; pages written and evicted; the pool's STATS at the end (evictions, demotions, promotions, disk use);
wall time; a profile of the mover (STATS sampled every ``SAMPLE_S``: put and demotion rates, time DRAM spent above
the high watermark). Then the ratio of pool tokens DRAM + disk / DRAM only. Nothing asserts; counts, not timings,
are what the ratio is made of. A put never waits for the mover: when the write-back threads fill DRAM faster than
the mover demotes, ALLOC evicts (drops) pages, and those are counted as evictions in the DRAM + disk run too.

``python bench/tierreplay.py [--nodes 2] [--dram 64MiB] [--ws-factor 5] [--disk-factor 5] [--json PATH] [--quick]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import sys
import tempfile
import threading
import time
from dataclasses import asdict, replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transport.objformat import object_size  # noqa: E402
from umbp.sizes import format_size, parse_size  # noqa: E402
from umbp.workload.generator import AgentXShape, generate  # noqa: E402
from umbp.workload.replay import Replay, ReplayConfig, page_payload  # noqa: E402
from umbp.workload.trace import Trace, trace_stats  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import disk as disk_bench  # noqa: E402  (bench/disk.py, beside this file)

SAMPLE_S = 0.5  # STATS sampling period of the mover's profile
DIRECT_RX = re.compile(r"O_DIRECT refused")  # umbp/node/disk.py's warning line when it falls back to buffered I/O


def filesystem(path: str) -> str:
    """The file system type holding ``path`` (``bench/disk.py``'s reading of /proc/mounts, the type alone)."""
    return disk_bench.filesystem(path).split(" ")[0]


class Unbounded:
    """An in-memory pool that never evicts, shared by every client made from one instance (``factory``): the dry
    replay's stand-in, which counts the distinct pages a trace writes and what a pool of unlimited size serves."""

    def __init__(self):
        self.keys: set[str] = set()
        self.lock = threading.Lock()

    def factory(self):
        return _UnboundedClient(self)


class _UnboundedClient:
    def __init__(self, pool: Unbounded):
        self.pool = pool

    def batch_put(self, keys, values, parents=None):
        with self.pool.lock:
            self.pool.keys.update(keys)
        return [True] * len(keys)

    def prefix_hits(self, keys):
        with self.pool.lock:
            n = 0
            for k in keys:
                if k not in self.pool.keys:
                    break
                n += 1
        return n

    def batch_get_into(self, keys, bufs):
        for k, b in zip(keys, bufs):
            b[:] = memoryview(page_payload(k, len(b)))
        return [len(b) for b in bufs]

    def stats(self):
        return {}

    def close(self):
        pass


def dry_run(trace: Trace, cfg: ReplayConfig) -> tuple[int, dict]:
    """(distinct pages the replay writes, the run's figures) against an unbounded pool; tiny payloads: only the
    counts matter here."""
    pool = Unbounded()
    res = Replay(trace, replace(cfg, page_bytes=32), client_factory=pool.factory).run()
    return len(pool.keys), res.to_json()


def sized_trace(shape: AgentXShape, cfg: ReplayConfig, want_pages: int, sessions: int) -> tuple[Trace, int, dict]:
    """A trace whose distinct pages are about ``want_pages`` (``sessions`` > 0: exactly that many sessions): the
    session count is scaled by the measured pages per session, at most 4 tries (pages grow about linearly with
    sessions; the generator's draws make it uneven)."""
    n = sessions or 16
    for _ in range(1 if sessions else 4):
        trace = generate(replace(shape, sessions=n))
        pages, dry = dry_run(trace, cfg)
        if sessions or abs(pages - want_pages) <= 0.05 * want_pages:
            break
        n = max(1, round(n * want_pages / max(1, pages)))
    return trace, pages, dry


def shared_prefix_tokens(trace: Trace, page_size: int) -> int:
    """Tokens of every prompt in the pages that open each session tree alike within a repository: the system
    prompt and the repository context (the first two runs of a root's first turn, the generator's layout), whole
    pages only and never the last prompt token. A diagnostic, not a bound: these pages are few (a few hundred) and
    read by every request of their repository, so DRAM alone serves them when its eviction keeps them (LRU under
    heavy writes may not); what DRAM + disk adds is mostly the sessions' own contexts beyond them."""
    total = 0
    for r in trace.requests:
        first = trace.by_id[f"{r.root}/t1"]
        head = sum(item[1] for item in first.append[:2] if not isinstance(item, int))
        total += min(head // page_size, (r.prompt_len - 1) // page_size) * page_size
    return total


class Sampler:
    """STATS every ``SAMPLE_S`` from its own client, in a thread, until ``stop()``: the mover's profile."""

    def __init__(self, metaserver: str, transport: str):
        from umbp.client import Client

        self.client = Client(metaserver=metaserver, namespace="tierreplay-stats", transport=transport)
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="stats-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            try:
                s = self.client.stats()
            except Exception:  # noqa: BLE001 - a missed sample only thins the profile
                continue
            self.samples.append({"t": time.perf_counter() - self._t0, "puts": s.get("puts", 0),
                                 "evictions": s.get("evictions", 0), "demotions": s.get("demotions", 0),
                                 "promotions": s.get("promotions", 0), "used_bytes": s.get("used_bytes", 0),
                                 "disk_used_bytes": s.get("disk_used_bytes", 0),
                                 "node_fill": [n["used_bytes"] / n["capacity_bytes"] for n in s.get("nodes", [])
                                               if n.get("capacity_bytes")]})

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        self.client.close()
        return self.samples


def profile(samples: list[dict], high: float) -> dict:
    """Rates over the samples (per second of wall time) and the share of samples with a node's DRAM above
    ``high``: the write rate the mover had to match and what it matched."""
    if len(samples) < 2:
        return {"samples": len(samples)}
    a, b = samples[0], samples[-1]
    dt = max(1e-9, b["t"] - a["t"])
    fills = [f for s in samples for f in s["node_fill"]]
    return {"samples": len(samples), "span_s": dt,
            "puts_per_s": (b["puts"] - a["puts"]) / dt, "demotions_per_s": (b["demotions"] - a["demotions"]) / dt,
            "evictions_per_s": (b["evictions"] - a["evictions"]) / dt,
            "promotions_per_s": (b["promotions"] - a["promotions"]) / dt,
            "node_fill_max": max(fills) if fills else 0.0,
            "share_above_high": sum(f > high for f in fills) / len(fills) if fills else 0.0}


def run_pool(trace: Trace, cfg: ReplayConfig, args, disk_dir: str) -> dict:
    """One replay against a fresh local pool: DRAM only (``disk_dir`` empty) or DRAM + a disk per node."""
    from umbp.client import Client
    from umbp.launcher import LocalPool

    dram = parse_size(args.dram)
    disk_cap = parse_size(args.dram) * args.disk_factor if disk_dir else 0
    pool = LocalPool(nodes=args.nodes, capacity=dram, port=0, metrics=False, out=open(os.devnull, "w"),
                     metaserver_args=["--eviction-policy", args.eviction_policy], disk=disk_dir,
                     disk_capacity=disk_cap)
    label = "dram+disk" if disk_dir else "dram"
    t0 = time.perf_counter()
    pool.start()
    try:
        ns = f"tierreplay/{label}"

        def factory():
            return Client(metaserver=pool.metaserver, namespace=ns, transport=args.transport)

        sampler = Sampler(pool.metaserver, args.transport)
        t1 = time.perf_counter()
        try:
            res = Replay(trace, cfg, client_factory=factory).run()
        finally:
            samples = sampler.stop()
        replay_s = time.perf_counter() - t1
        with factory() as c:
            stats = c.stats()
        logs = "".join(open(ch.log_path, errors="replace").read() for ch in pool.children
                       if ch.name.startswith("node-") and os.path.exists(ch.log_path))
    finally:
        pool.stop()
    high = float(os.environ.get("UMBP_HIGH_WATERMARK", "0.95"))
    keep = ("capacity_bytes", "used_bytes", "objects", "puts", "hits", "misses", "evictions", "demotions",
            "promotions", "disk_capacity_bytes", "disk_used_bytes")
    out = {"label": label, "disk": bool(disk_dir), "dram_per_node_bytes": dram, "disk_per_node_bytes": disk_cap,
           "pool_tokens": res.pool_tokens, "hbm_tokens": res.hbm_tokens, "recomputed_tokens": res.recomputed_tokens,
           "prompt_tokens": res.prompt_tokens, "pool_pages_read": res.pool_pages_read,
           "pool_bytes_read": res.pool_bytes_read, "pool_pages_written": res.pool_pages_written,
           "pool_pages_dedup": res.pool_pages_dedup, "pages_evicted": res.pages_evicted,
           "pages_verified": res.pages_verified, "requests": res.requests,
           "stats": {k: stats.get(k) for k in keep},
           "nodes": [{k: n.get(k) for k in ("node_id", "used_bytes", "capacity_bytes", "objects",
                                            "disk_used_bytes", "disk_capacity_bytes", "disk_objects")}
                     for n in stats.get("nodes", [])],
           "wall_s": time.perf_counter() - t0, "replay_s": replay_s, "profile": profile(samples, high),
           "samples": samples[::max(1, len(samples) // 200)]}
    if disk_dir:
        out["disk_fs"] = filesystem(disk_dir)
        out["o_direct"] = not DIRECT_RX.search(logs)
        out["node_warnings"] = [ln for ln in logs.splitlines() if "WARNING" in ln][:8]
    return out


def show(r: dict) -> str:
    s = r["stats"]
    p = r["profile"]
    disk = (f"; disk {format_size(s['disk_used_bytes'] or 0)} of {format_size(s['disk_capacity_bytes'] or 0)} "
            f"used, {r['disk_fs']}, O_DIRECT {'on' if r['o_direct'] else 'OFF (buffered)'}") if r["disk"] else ""
    return (f"{r['label']:>9}: pool tokens {r['pool_tokens']:,} ({r['pool_tokens'] / r['prompt_tokens']:.1%} of "
            f"prompts), HBM {r['hbm_tokens']:,}, recomputed {r['recomputed_tokens']:,}; pages written "
            f"{r['pool_pages_written']:,}, read {r['pool_pages_read']:,}; STATS evictions {s['evictions']:,}, "
            f"demotions {s['demotions']:,}, promotions {s['promotions']:,}{disk}; replay {r['replay_s']:.0f}s "
            f"(wall {r['wall_s']:.0f}s)\n{'':>11}mover profile: puts {p.get('puts_per_s', 0):,.0f}/s, demotions "
            f"{p.get('demotions_per_s', 0):,.0f}/s, evictions {p.get('evictions_per_s', 0):,.0f}/s, DRAM above "
            f"the high watermark in {p.get('share_above_high', 0):.0%} of samples (max fill "
            f"{p.get('node_fill_max', 0):.1%})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--dram", default="64MiB", help="DRAM arena per node")
    ap.add_argument("--ws-factor", type=float, default=5.0, help="working set / the pool's DRAM")
    ap.add_argument("--disk-factor", type=int, default=5, help="disk tier per node / its DRAM")
    ap.add_argument("--disk-dir", default="", help="where the disk files go (default: the temporary directory)")
    ap.add_argument("--sessions", type=int, default=0, help="trace sessions (0: sized to --ws-factor)")
    ap.add_argument("--turns", type=float, default=12.0, help="mean main-agent turns per session (AgentX: 43)")
    ap.add_argument("--scale", type=float, default=0.01, help="the generator's token scale")
    ap.add_argument("--repos", type=int, default=8, help="repositories whose context sessions share (AgentX: 8)")
    ap.add_argument("--seed", type=int, default=47)
    ap.add_argument("--page-bytes", type=int, default=(64 << 10) - 64, help="payload of a pool page")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per page")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--hbm-pages", type=int, default=64, help="HBM prefix cache per rank, pages")
    ap.add_argument("--concurrency", type=int, default=0, help="root sessions in flight (0: no cap, each starts at "
                    "its arrival)")
    ap.add_argument("--router", default="round-robin")
    ap.add_argument("--write-batch-pages", type=int, default=64, help="most pages a write-back put carries")
    ap.add_argument("--eviction-policy", default="lru", choices=("lru", "prefix-lru"), help="the metaserver's "
                    "(lru: its default; prefix-lru keeps chain heads, so DRAM alone serves more prefixes)")
    ap.add_argument("--transport", default="auto")
    ap.add_argument("--json", default="", help="write every figure here")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (2 nodes of 4 MiB, 16 KiB pages): a smoke run")
    args = ap.parse_args()
    if args.quick:
        args.dram, args.page_bytes, args.turns, args.hbm_pages = "4MiB", (16 << 10) - 64, 8.0, 16
    dram_total = parse_size(args.dram) * args.nodes
    ext = object_size(args.page_bytes)
    want_pages = math.ceil(args.ws_factor * dram_total / ext)
    shape = AgentXShape(seed=args.seed, scale=args.scale, turns_mean=args.turns, repos=args.repos)
    cfg = ReplayConfig(ranks=args.ranks, hbm_pages=args.hbm_pages, page_size=args.page_size,
                       page_bytes=args.page_bytes, concurrency=args.concurrency or 1_000_000, router=args.router,
                       write_batch_pages=args.write_batch_pages)
    t0 = time.perf_counter()
    trace, pages, dry = sized_trace(shape, cfg, want_pages, args.sessions)
    st = trace_stats(trace)
    shared = shared_prefix_tokens(trace, args.page_size)
    disk_root = args.disk_dir or tempfile.gettempdir()
    disk_dir = tempfile.mkdtemp(prefix="umbp-tierreplay-", dir=disk_root)
    fs = filesystem(disk_dir)
    print(f"trace: {st['sessions']} sessions, {st['requests']} requests, {st['turns_per_session_mean']:.1f} turns a "
          f"session, {pages:,} distinct pages of {format_size(ext)} = {format_size(pages * ext)} working set, "
          f"{pages * ext / dram_total:.2f}x the pool's DRAM ({args.nodes} nodes x {args.dram}); sized in "
          f"{time.perf_counter() - t0:.1f}s", flush=True)
    inflight = f"{args.concurrency} sessions" if args.concurrency else "every arrived session"
    print(f"replay: {args.ranks} ranks x {args.hbm_pages} HBM pages, {args.router}, {inflight} in flight, write-back "
          f"batches of {args.write_batch_pages} pages, {args.eviction_policy}; an unbounded pool serves "
          f"{dry['pool_tokens']:,} tokens ({dry['pool_share']:.1%} of prompts) and HBM {dry['hbm_tokens']:,}; "
          f"{shared:,} prompt tokens ({shared / dry['prompt_tokens']:.1%}) are the system prompt and repository "
          f"context sessions share; disk tier {args.disk_factor}x DRAM a node in {disk_dir} ({fs}); "
          f"{os.cpu_count()} CPUs", flush=True)
    if fs == "tmpfs":
        print("WARNING: the disk directory is on tmpfs (no O_DIRECT, and it is memory): pass --disk-dir on a disk",
              flush=True)
    runs = []
    try:
        for d in ("", disk_dir):
            r = run_pool(trace, cfg, args, d)
            runs.append(r)
            print(show(r), flush=True)
    finally:
        for f in os.listdir(disk_dir):
            os.unlink(os.path.join(disk_dir, f))
        os.rmdir(disk_dir)
    dram_only, tiered = runs
    ratio = tiered["pool_tokens"] / dram_only["pool_tokens"] if dram_only["pool_tokens"] else float("inf")
    met = ratio >= 2.0
    print(f"pool tokens DRAM + disk / DRAM only: {tiered['pool_tokens']:,} / {dram_only['pool_tokens']:,} = "
          f"{ratio:.2f}x (target >= 2x: {'met' if met else 'NOT met'}); an unbounded pool: {dry['pool_tokens']:,}",
          flush=True)
    cap = (dry["pool_tokens"] + dry["hbm_tokens"] - dram_only["hbm_tokens"]) / max(1, dram_only["pool_tokens"])
    private = [r["pool_tokens"] + r["hbm_tokens"] - shared for r in runs]
    print(f"what bounds it: the ratio's ceiling is about (unbounded pool + its HBM - DRAM run's HBM) / DRAM run's "
          f"pool = {cap:.2f}x (HBM hits vary a little with timing); cached tokens (pool + HBM) minus the shared "
          f"prefix: DRAM only {private[0]:,}, DRAM + disk {private[1]:,}", flush=True)
    doc = {"machine": {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
           "args": vars(args), "watermarks": {"high": os.environ.get("UMBP_HIGH_WATERMARK", "default"),
                                              "low": os.environ.get("UMBP_LOW_WATERMARK", "default")},
           "trace": {"sessions": st["sessions"], "requests": st["requests"], "distinct_pages": pages,
                     "page_extent_bytes": ext, "working_set_bytes": pages * ext,
                     "ws_over_dram": pages * ext / dram_total, "shared_prefix_tokens": shared,
                     "shape": asdict(replace(shape, sessions=st["sessions"]))},
           "replay": asdict(cfg), "unbounded": {k: dry[k] for k in ("pool_tokens", "hbm_tokens", "recomputed_tokens",
                                                                   "prompt_tokens")},
           "runs": runs, "ratio": ratio, "ratio_bound": cap, "private_cached_tokens": private, "target_met": met,
           "disk_fs": fs, "o_direct": tiered.get("o_direct"), "wall_s": time.perf_counter() - t0}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
