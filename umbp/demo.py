"""``umbp demo``, ``umbp replay`` and ``umbp bench``: the CLI side of the main job, and the bandwidth bench.

- ``umbp demo [--out DIR]``: generates a short AgentX-shaped trace (``umbp.workload.generator``), starts a local
  pool, replays the trace at three concurrencies with round-robin and session-affinity routing, each with and
  without the pool, prints the table and the target checks, writes ``trace.jsonl``, ``results.json``,
  ``shares.png`` and ``ttft.png`` into DIR (default ``./umbp-demo/``). About two minutes on two cores.
- ``umbp replay TRACE``: the same for a JSONL trace (``umbp.workload.trace``), every setting a flag;
  ``--metaserver`` uses a running pool instead of starting one. A trace in Mooncake's FAST'25 format
  (``umbp.workload.mooncake``; ``--format``, detected by default) runs open loop at its timestamps, once per router
  with and without the pool, and reports block hit rates against the trace's infinite-cache ceiling; flags left
  unset take that format's defaults (512-token pages, 3 M HBM tokens a rank, a pool of 4 x the ranks' HBM).
- ``umbp bench`` (the old demo): two processes push synthetic KV pages through a local pool, read back each
  other's pages and check every byte, and report the rates reached. Exit code 0 only if every byte matched.

``add_subcommands`` registers the three on the ``umbp`` parser (``umbp.cli``). The work lives in
``umbp.workload.job``; this module only turns flags into its configuration.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import sys
import time

import numpy as np

from umbp.sizes import format_size, parse_size

BATCH = 32


def page_key(writer: int, i: int) -> str:
    return f"demo/w{writer}/page{i:06d}"


def fill_page(buf: np.ndarray, writer: int, i: int) -> None:
    """Deterministic page contents: a reader regenerates them to check every byte."""
    rng = np.random.default_rng(writer * 1_000_003 + i)
    buf[:] = rng.integers(0, 255, size=buf.shape, dtype=np.uint8)


def worker(wid: int, metaserver: str, pages: int, page_size: int, progress, results, done_write):
    from umbp.client import Client

    out = {"wid": wid}
    with Client(metaserver=metaserver, namespace="demo") as c:
        vals = [np.empty(page_size, np.uint8) for _ in range(BATCH)]
        t0 = time.perf_counter()
        stored = 0
        put_time = 0.0
        for b in range(0, pages, BATCH):
            n = min(BATCH, pages - b)
            for j in range(n):
                fill_page(vals[j], wid, b + j)
            t = time.perf_counter()
            stored += sum(c.batch_put([page_key(wid, b + j) for j in range(n)], vals[:n]))
            put_time += time.perf_counter() - t
            progress[wid * 2] += n
        out["put_s"], out["put_wall_s"], out["stored"] = put_time, time.perf_counter() - t0, stored
        done_write.wait(timeout=600)
        other = 1 - wid
        outs = [np.empty(page_size, np.uint8) for _ in range(BATCH)]
        expect = np.empty(page_size, np.uint8)
        hits = misses = bad = 0
        get_time = 0.0
        for b in range(0, pages, BATCH):
            n = min(BATCH, pages - b)
            t = time.perf_counter()
            got = c.batch_get_into([page_key(other, b + j) for j in range(n)], outs[:n])
            get_time += time.perf_counter() - t
            for j, g in enumerate(got):
                if g < 0:
                    misses += 1
                    continue
                fill_page(expect, other, b + j)
                if g == page_size and np.array_equal(outs[j], expect):
                    hits += 1
                else:
                    bad += 1
            progress[wid * 2 + 1] += n
        out.update(get_s=get_time, hits=hits, misses=misses, bad=bad)
        t = time.perf_counter()
        dedup = sum(1 for r in c.batch_put([page_key(wid, j) for j in range(min(pages, BATCH))],
                                           vals[:min(pages, BATCH)]) if not r)
        out["dedup"], out["dedup_s"] = dedup, time.perf_counter() - t
        out["prefix_hits"] = c.prefix_hits([page_key(wid, j) for j in range(min(pages, 1000))] + ["demo/absent"])
        t = time.perf_counter()
        keys = [page_key(other, j) for j in range(pages)]
        out["exists"] = sum(c.batch_exists(keys))
        out["exists_s"] = time.perf_counter() - t
        out["transports"] = sorted(set(c.transport_names().values()))
    results.put(out)


def _run_workers(con, metaserver: str, pages: int, page_size: int) -> tuple[list[dict], float, list[int | None]]:
    """Run the two writer/reader processes with a progress bar; returns their result dicts (fewer than two if one
    failed), the wall time and their exit codes. Bounded: 600 s of progress polling, then 5 s per result."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    ctx = mp.get_context("spawn")
    progress = ctx.Array("q", 4, lock=False)
    results = ctx.Queue()
    done_write = ctx.Barrier(2)
    procs = [ctx.Process(target=worker, args=(w, metaserver, pages, page_size, progress, results, done_write))
             for w in range(2)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, console=con) as bar:
        tasks = [bar.add_task(f"writer {w // 2} {'puts' if w % 2 == 0 else 'gets (other writer)'}", total=pages)
                 for w in range(4)]
        deadline = time.monotonic() + 600
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            for i, t in enumerate(tasks):
                bar.update(t, completed=progress[i])
            time.sleep(0.1)
        for i, t in enumerate(tasks):
            bar.update(t, completed=progress[i])
    wall = time.perf_counter() - t0
    outs = []
    for _ in procs:
        try:
            outs.append(results.get(timeout=5))
        except queue.Empty:
            break
    for p in procs:
        p.join(5)
    return outs, wall, [p.exitcode for p in procs]


def _report(con, outs: list[dict], pages: int, page_size: int, wall: float, stats: dict) -> bool:
    """Print the bench table and the pool's state; True if every page read back was byte-identical."""
    from rich.table import Table

    total = pages * page_size
    t = Table(title=f"umbp bench: 2 processes x {pages} pages of {format_size(page_size)}")
    for col in ("worker", "phase", "pages", "bytes", "seconds", "rate", "result"):
        t.add_column(col, justify="right" if col not in ("phase", "result") else "left")
    ok = True
    for o in sorted(outs, key=lambda o: o["wid"]):
        w = str(o["wid"])
        t.add_row(w, "batch_put", str(pages), format_size(total), f"{o['put_s']:.2f}",
                  f"{total / o['put_s'] / 1e9:.2f} GB/s", f"{o['stored']} stored")
        t.add_row(w, "batch_get_into (other's)", str(pages), format_size(total), f"{o['get_s']:.2f}",
                  f"{total / o['get_s'] / 1e9:.2f} GB/s",
                  f"{o['hits']} byte-exact, {o['misses']} missed, {o['bad']} WRONG")
        t.add_row(w, "re-put (dedup)", str(min(pages, BATCH)), "-", f"{o['dedup_s']:.3f}", "-",
                  f"{o['dedup']} answered 'exists'")
        t.add_row(w, "batch_exists", str(pages), "-", f"{o['exists_s']:.3f}",
                  f"{pages / o['exists_s']:,.0f} keys/s", f"{o['exists']} present")
        t.add_row(w, "prefix_hits", "-", "-", "-", "-", f"leading run of {o['prefix_hits']}")
        ok &= o["bad"] == 0 and o["hits"] + o["misses"] == pages and o["stored"] == pages
    con.print(t)
    con.print(f"transports used: {', '.join(sorted({x for o in outs for x in o['transports']}))}; "
              f"wall time {wall:.1f}s")
    cap, used = stats["capacity_bytes"], stats["used_bytes"]
    con.print(f"pool: {stats['objects']} objects, {format_size(used)} of {format_size(cap)} used, "
              f"{stats['hits']} hits / {stats['misses']} misses, {stats['evictions']} evictions, "
              f"{sum(1 for n in stats['nodes'] if n['alive'])} live nodes")
    con.print("[green]bench: every page read back was byte-identical[/]" if ok else "[red]bench: FAILED[/]")
    return ok


def run_bench(args) -> int:
    """``umbp bench``: a local pool (unless ``--metaserver``), the two worker processes, the table."""
    from rich.console import Console

    from umbp.client import Client
    from umbp.launcher import LocalPool

    con = Console(width=None if sys.stdout.isatty() else 110)
    page_size = parse_size(args.page_size, "--page-size")
    pool = None
    if args.metaserver:
        metaserver = args.metaserver
    else:
        con.print(f"[bold]umbp bench[/]: starting a local pool: etcd, a metaserver, {args.nodes} nodes of "
                  f"{args.capacity}")
        pool = LocalPool(nodes=args.nodes, capacity=args.capacity, port=0).start()
        metaserver = pool.metaserver
    try:
        outs, wall, codes = _run_workers(con, metaserver, args.pages, page_size)
        if len(outs) < 2:
            con.print(f"[red]bench: a worker failed (exit codes {codes})[/]")
            return 1
        with Client(metaserver=metaserver, namespace="demo") as c:
            stats = c.stats()
    finally:
        if pool is not None:
            pool.stop()
    return 0 if _report(con, outs, args.pages, page_size, wall, stats) else 1


# ---- umbp demo / umbp replay ----------------------------------------------------------------------------------

DEMO_SESSIONS = 64
DEMO_CONCURRENCY = "8,16,32"
DEMO_HBM_PAGES = 400  # per rank: about 4 sessions' contexts, so HBM alone cannot hold 8+ concurrent sessions
DEMO_POOL_PAGES = 5120  # holds the working set of 32 concurrent sessions (~3.6K pages), not the whole trace (~7K)
MOONCAKE_PAGE_TOKENS = 512  # the trace's own block: one page per block
MOONCAKE_HBM_TOKENS = 3_000_000  # per rank: what a 70B model (320 KiB of KV a token) leaves on 8 x 141 GB H200s
MOONCAKE_PAGE_BYTES = 4096 - 64  # stand-in payload, one 4 KiB object a page: the whole conversation trace is 0.75 GB
MOONCAKE_POOL_PER_HBM = 4  # default pool: 4 x the ranks' HBM together (DRAM of the prefill hosts)


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        out = ()
    if not out or any(x < 1 for x in out):
        from umbp.errors import ConfigError

        raise ConfigError("replay", f"{flag} takes positive integers separated by commas, got {text!r}")
    return out


def _add_replay_flags(s, demo: bool) -> None:
    from umbp.costmodel import CostModel
    from umbp.workload.replay import ReplayConfig

    rc, cm = ReplayConfig(), CostModel()
    g = s.add_argument_group("pool")
    g.add_argument("--metaserver", default=None, help="use this running pool (HOST:PORT) instead of starting one")
    g.add_argument("--nodes", type=int, default=2, help="nodes of the local pool (the pool pages split over them)")
    g.add_argument("--pool-pages", type=int, default=DEMO_POOL_PAGES if demo else None,
                   help="local pool capacity in pages" + ("" if demo else f" (default {DEMO_POOL_PAGES}; Mooncake "
                                                           f"traces: 4 x ranks x --hbm-tokens)"))
    g.add_argument("--pool-tokens", type=int, default=None, help="local pool capacity in tokens (sets --pool-pages)")
    g.add_argument("--eviction-policy", default="prefix-lru", choices=["lru", "prefix-lru"])
    g.add_argument("--transport", default="auto", choices=["auto", "tcp", "shm", "rdma"])
    g = s.add_argument_group("replay")
    g.add_argument("--ranks", type=int, default=rc.ranks, help="DP ranks")
    g.add_argument("--hbm-pages", type=int, default=DEMO_HBM_PAGES if demo else None,
                   help="HBM prefix cache per rank, in pages" + ("" if demo else f" (default {DEMO_HBM_PAGES})"))
    g.add_argument("--hbm-tokens", type=int, default=None,
                   help="HBM prefix cache per rank, in tokens (sets --hbm-pages" +
                        (")" if demo else f"; Mooncake traces: default {MOONCAKE_HBM_TOKENS:,})"))
    g.add_argument("--page-size", "--page-tokens", dest="page_size", type=int, default=rc.page_size if demo else None,
                   help="tokens per page" + ("" if demo else f" (default {rc.page_size}; Mooncake traces: "
                                                             f"{MOONCAKE_PAGE_TOKENS}, one block a page)"))
    g.add_argument("--page-bytes", type=int, default=rc.page_bytes if demo else None,
                   help="payload bytes of a pool page" + ("" if demo else f" (default {rc.page_bytes}; Mooncake "
                                                                          f"traces: {MOONCAKE_PAGE_BYTES})"))
    g.add_argument("--concurrency", default=DEMO_CONCURRENCY, help="sessions in flight, comma separated")
    g.add_argument("--routers", default="round-robin,affinity" if demo else None,
                   help="comma separated: round-robin, affinity, least-loaded, cache-aware" +
                        ("" if demo else " (default round-robin,affinity; Mooncake traces: all four)"))
    g.add_argument("--pool", default="both", choices=["both", "on", "off"], help="run with the pool, without, or both")
    g.add_argument("--load-factor", type=float, default=rc.affinity_load_factor, help="affinity's bounded load")
    g.add_argument("--write-batch-pages", type=int, default=rc.write_batch_pages)
    g.add_argument("--out", default="umbp-demo" if demo else "umbp-replay", help="directory for JSON and plots")
    g.add_argument("--no-plots", action="store_true")
    g = s.add_argument_group("cost model (simulated prefill time; docs/guide/workload.md)")
    g.add_argument("--params", type=float, default=cm.params, help="model parameters (matmul FLOPs = 2 x params)")
    g.add_argument("--layers", type=int, default=cm.layers)
    g.add_argument("--attn-dim", type=int, default=cm.attn_dim, help="query heads x head dim")
    g.add_argument("--kv-bytes-per-token", type=int, default=cm.kv_bytes_per_token)
    g.add_argument("--gpu-tflops", type=float, default=cm.gpu_tflops, help="peak dense TFLOPS per GPU")
    g.add_argument("--mfu", type=float, default=cm.mfu, help="fraction of peak a prefill sustains")
    g.add_argument("--gpus-per-rank", type=int, default=cm.gpus_per_rank)
    g.add_argument("--load-gbps", type=float, default=cm.load_gbps, help="pool-to-HBM GB/s per rank")
    g.add_argument("--overlap", action="store_true", help="loads overlap compute (layer-wise)")
    g.add_argument("--tpot-s", type=float, default=cm.tpot_s, help="decode seconds per output token")


def _job(args, title: str, mooncake: bool = False):
    """The job's configuration from the flags; flags left at None take the trace format's defaults."""
    from umbp.costmodel import CostModel
    from umbp.workload.job import JobConfig
    from umbp.workload.replay import ReplayConfig

    rc0 = ReplayConfig()
    ps = args.page_size or (MOONCAKE_PAGE_TOKENS if mooncake else rc0.page_size)
    if ps < 1:
        from umbp.errors import ConfigError

        raise ConfigError("replay", f"--page-size must be >= 1, got {ps}")
    hbm_pages = args.hbm_pages
    if args.hbm_tokens is not None:
        hbm_pages = args.hbm_tokens // ps
    elif hbm_pages is None:
        hbm_pages = MOONCAKE_HBM_TOKENS // ps if mooncake else DEMO_HBM_PAGES
    pool_pages = args.pool_pages
    if args.pool_tokens is not None:
        pool_pages = args.pool_tokens // ps
    elif pool_pages is None:
        pool_pages = MOONCAKE_POOL_PER_HBM * args.ranks * hbm_pages if mooncake else DEMO_POOL_PAGES
    page_bytes = args.page_bytes or (MOONCAKE_PAGE_BYTES if mooncake else rc0.page_bytes)
    routers_text = args.routers or ("round-robin,affinity,least-loaded,cache-aware" if mooncake
                                    else "round-robin,affinity")
    routers = tuple(r.strip() for r in routers_text.split(",") if r.strip())
    from umbp.routing import ROUTERS

    for r in routers:
        if r not in ROUTERS:
            from umbp.errors import ConfigError

            raise ConfigError("replay", f"unknown router {r!r}; choose from {', '.join(ROUTERS)}")
    modes = {"both": (True, False), "on": (True,), "off": (False,)}[args.pool]
    runs = tuple((r, m) for r in routers for m in modes)
    rc = ReplayConfig(ranks=args.ranks, hbm_pages=hbm_pages, page_size=ps,
                      page_bytes=page_bytes, write_batch_pages=args.write_batch_pages,
                      affinity_load_factor=args.load_factor)
    cost = CostModel(params=args.params, layers=args.layers, attn_dim=args.attn_dim,
                     kv_bytes_per_token=args.kv_bytes_per_token, gpu_tflops=args.gpu_tflops, mfu=args.mfu,
                     gpus_per_rank=args.gpus_per_rank, load_gbps=args.load_gbps, overlap=args.overlap,
                     tpot_s=args.tpot_s)
    return JobConfig(concurrencies=_int_list(args.concurrency, "--concurrency"), runs=runs, replay=rc, cost=cost,
                     metaserver=args.metaserver, nodes=args.nodes, pool_pages=pool_pages,
                     eviction_policy=args.eviction_policy, transport=args.transport, out=args.out,
                     plots=not args.no_plots, title=title, speed=getattr(args, "speed", 1.0))


def cmd_demo(args) -> int:
    import os

    from umbp.workload.generator import AgentXShape, generate
    from umbp.workload.job import run_job
    from umbp.workload.trace import dump_trace

    job = _job(args, "umbp demo")
    trace = generate(AgentXShape(sessions=args.sessions, seed=args.seed, scale=args.scale))
    os.makedirs(job.out, exist_ok=True)
    path = os.path.join(job.out, "trace.jsonl")
    dump_trace(trace, path)
    return run_job(trace, job, trace_path=path)


def cmd_replay(args) -> int:
    from umbp.workload.job import run_job
    from umbp.workload.mooncake import detect_format, load_mooncake
    from umbp.workload.trace import Trace, load_trace

    fmt = detect_format(args.trace) if args.format == "auto" else args.format
    if fmt == "mooncake":
        mc = load_mooncake(args.trace, args.block_tokens, args.session_blocks)
        if args.requests:
            mc = mc.head(args.requests)
        return run_job(mc, _job(args, f"umbp replay {args.trace}", mooncake=True), trace_path=args.trace)
    trace = load_trace(args.trace)
    if args.sessions:
        keep = set(trace.roots()[:args.sessions])
        trace = Trace([r for r in trace.requests if r.root in keep], trace.header)
    return run_job(trace, _job(args, f"umbp replay {args.trace}"), trace_path=args.trace)


def add_subcommands(sub) -> None:
    """Register ``demo``, ``replay`` and ``bench`` on the ``umbp`` sub-parser."""
    s = sub.add_parser("demo", help="the main job: an agentic trace replayed through a local pool by DP ranks, "
                                    "with and without the pool: a table, JSON and plots")
    s.add_argument("--sessions", type=int, default=DEMO_SESSIONS, help="sessions in the generated trace")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--scale", type=float, default=0.01, help="token counts x this (1.0 = full-size AgentX shape)")
    _add_replay_flags(s, demo=True)
    s.set_defaults(func=cmd_demo)

    s = sub.add_parser("replay", help="replay a JSONL trace through the pool with DP routers (docs/guide/workload.md)")
    s.add_argument("trace", help="JSONL trace file: umbp's format or Mooncake's (FAST'25 traces)")
    s.add_argument("--format", default="auto", choices=["auto", "umbp", "mooncake"],
                   help="trace format (auto: Mooncake when the first line has hash_ids and input_length)")
    s.add_argument("--sessions", type=int, default=0, help="umbp traces: replay only the first N sessions (0: all)")
    g = s.add_argument_group("Mooncake traces (open loop at the trace's timestamps)")
    g.add_argument("--speed", type=float, default=1.0, help="arrival times divided by this (2: twice the load)")
    g.add_argument("--requests", type=int, default=0, help="replay only the first N requests (0: all)")
    g.add_argument("--block-tokens", type=int, default=512, help="tokens per hash_ids block of the trace")
    g.add_argument("--session-blocks", type=int, default=2,
                   help="a request's session (for affinity routing) is its first N block ids")
    _add_replay_flags(s, demo=False)
    s.set_defaults(func=cmd_replay)

    s = sub.add_parser("bench", help="push synthetic KV pages through a local pool from two processes, check bytes")
    s.add_argument("--pages", type=int, default=2000, help="synthetic KV pages per writer process")
    s.add_argument("--page-size", default="256KiB")
    s.add_argument("--nodes", type=int, default=2)
    s.add_argument("--capacity", default="1GiB", help="per node")
    s.add_argument("--metaserver", default=None, help="use this running pool instead of starting one")
    s.set_defaults(func=run_bench)
