"""``umbp demo``: start a local pool and push synthetic KV pages through it from two processes.

Each of two worker processes writes ``--pages`` pages (numpy arrays shaped like a KV page, contents derived from
the key so any reader can check them) in batches, then reads back every page the *other* process wrote and checks
each byte; a third pass re-puts its own pages to show dedup (every put answers "already there") and asks
``prefix_hits`` for a chain. The parent shows progress bars and ends with a table of what was done and the rates
reached, then the pool's own statistics. Exit code 0 only if every page read back is byte-identical.
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


def run_demo(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from umbp.client import Client
    from umbp.launcher import LocalPool

    con = Console(width=None if sys.stdout.isatty() else 110)
    page_size = parse_size(args.page_size, "--page-size")
    pages = args.pages
    pool = None
    if args.metaserver:
        metaserver = args.metaserver
    else:
        con.print(f"[bold]umbp demo[/]: starting a local pool: etcd, a metaserver, {args.nodes} nodes of "
                  f"{args.capacity}")
        pool = LocalPool(nodes=args.nodes, capacity=args.capacity, port=0).start()
        metaserver = pool.metaserver
    try:
        ctx = mp.get_context("spawn")
        progress = ctx.Array("q", 4, lock=False)
        results = ctx.Queue()
        done_write = ctx.Barrier(2)
        procs = [ctx.Process(target=worker, args=(w, metaserver, pages, page_size, progress, results,
                                                  done_write)) for w in range(2)]
        t0 = time.perf_counter()
        for p in procs:
            p.start()
        cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*cols, console=con) as bar:
            tasks = [bar.add_task(f"writer {w // 2} {'puts' if w % 2 == 0 else 'gets (other writer)'}",
                                  total=pages) for w in range(4)]
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
        if len(outs) < 2:
            con.print(f"[red]demo: a worker failed (exit codes {[p.exitcode for p in procs]})[/]")
            return 1
        with Client(metaserver=metaserver, namespace="demo") as c:
            stats = c.stats()
    finally:
        if pool is not None:
            pool.stop()

    total = pages * page_size
    t = Table(title=f"umbp demo: 2 processes x {pages} pages of {format_size(page_size)}")
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
    con.print("[green]demo: every page read back was byte-identical[/]" if ok else "[red]demo: FAILED[/]")
    return 0 if ok else 1
