"""``umbp demo`` and ``umbp replay``: a replay matrix (concurrency x router x with/without pool) and its report.

``run_job`` starts a local pool (``umbp.launcher.LocalPool``: etcd, a metaserver, N nodes) unless it is given a
metaserver, runs every combination as one ``Replay`` with a progress bar, prints the table and the target checks,
and writes ``results.json``, ``shares.png`` and ``ttft.png`` into the output directory.

Isolation between runs: every run uses its own namespace (``<prefix>/<run>``), so no run finds another's pages.
On a pool it started itself the job also evicts everything before each run, so each starts empty and its
``evicted`` count is its own; on a pool given with ``--metaserver`` it evicts nothing (other tenants' pages may
be evicted by this job's writes, and counted).

A Mooncake-format trace (``umbp.workload.mooncake.MooncakeTrace``) runs open loop at its timestamps
(``speed``), once per router and pool setting: ``concurrencies`` does not apply, rows carry block counts and the
report shows block hit rates against the trace's infinite-cache ceiling.

Pool size: ``pool_pages`` objects of ``page_bytes`` payload (plus the 64-byte object header, 4 KiB aligned),
split evenly over the nodes. Blocking: ``run_job`` blocks for the whole matrix; Ctrl-C stops the local pool.
"""

from __future__ import annotations

import math
import os
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from umbp.errors import ConfigError
from umbp.workload import report
from umbp.costmodel import CostModel
from umbp.workload.mooncake import MooncakeReplay, MooncakeTrace, ceiling_pages, mooncake_stats
from umbp.workload.replay import Replay, ReplayConfig, RunResult
from umbp.workload.trace import Trace, trace_stats


@dataclass(frozen=True)
class JobConfig:
    concurrencies: tuple[int, ...] = (8, 16, 32)
    runs: tuple[tuple[str, bool], ...] = (("round-robin", True), ("round-robin", False), ("affinity", True),
                                          ("affinity", False))
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    cost: CostModel = field(default_factory=CostModel)
    metaserver: str | None = None  # None: start a local pool
    nodes: int = 2
    pool_pages: int = 4096
    eviction_policy: str = "prefix-lru"
    namespace: str = "umbp-replay"
    transport: str = "auto"
    out: str = "umbp-demo"
    plots: bool = True
    title: str = "umbp replay"
    speed: float = 1.0  # open-loop traces (Mooncake format): arrival times divided by this

    def __post_init__(self) -> None:
        if not self.concurrencies or any(c < 1 for c in self.concurrencies):
            raise ConfigError("replay", "concurrencies must be a non-empty list of positive integers")
        if not self.runs:
            raise ConfigError("replay", "nothing to run: no router/pool combination")
        if self.pool_pages < 1 or not 0 <= self.nodes <= 64:
            raise ConfigError("replay", "pool_pages must be >= 1 and nodes within 0..64")
        if not self.speed > 0:
            raise ConfigError("replay", f"speed must be > 0, got {self.speed}")

    def node_capacity(self) -> int:
        from transport.objformat import object_size

        per_node = math.ceil(self.pool_pages * object_size(self.replay.page_bytes) / max(1, self.nodes))
        return max(1 << 20, (per_node + (1 << 20) - 1) // (1 << 20) * (1 << 20))


def _evict_all(metaserver: str, transport: str) -> None:
    from transport.wire import Op
    from umbp.client import Client

    with Client(metaserver=metaserver, namespace="umbp-replay", transport=transport) as c:
        c.admin(Op.EVICT, {"all": True})


def _describe(trace: Any, job: JobConfig, con: Any) -> tuple[dict, Any]:
    """Print what is replayed; returns the trace statistics and a factory of one run's ``Replay``."""
    rc = job.replay
    if isinstance(trace, MooncakeTrace):
        ceiling = ceiling_pages(trace, rc.page_size)
        stats = mooncake_stats(trace, rc.page_size, ceiling)
        con.print(f"[bold]{job.title}[/]: Mooncake format, {stats['requests']} requests over "
                  f"{stats['span_s']:.0f}s (replayed x{job.speed:g}), mean prompt "
                  f"{stats['prompt_tokens_mean'] / 1000:.1f}K tokens, {stats['blocks']} blocks of "
                  f"{trace.block_tokens} tokens ({stats['distinct_blocks']} distinct); infinite-cache ceiling "
                  f"{100 * stats['ceiling_block_share']:.1f}% of blocks")
        con.print(f"{rc.ranks} DP ranks x {rc.hbm_pages * rc.page_size:,} HBM tokens ({rc.hbm_pages} pages of "
                  f"{rc.page_size} tokens); pool {job.pool_pages * rc.page_size:,} tokens ({job.pool_pages} pages "
                  f"of {rc.page_bytes} bytes); open loop at the trace's timestamps")
        return stats, lambda cfg, factory, progress: MooncakeReplay(trace, cfg, job.cost, factory, progress,
                                                                    speed=job.speed, ceiling=ceiling)
    stats = trace_stats(trace)
    con.print(f"[bold]{job.title}[/]: {stats['sessions']} sessions ({stats['subagent_sessions']} subagent "
              f"sessions), {stats['requests']} requests, {stats['turns_per_session_mean']:.1f} turns per session, "
              f"median prompt {stats['prompt_tokens_median'] / 1000:.0f}K tokens at full scale "
              f"(x{trace.scale:g} here), {100 * stats['prefix_share']:.1f}% of each prompt from the previous turn")
    median_pages = max(1.0, stats["prompt_tokens_median"] * trace.scale / rc.page_size)
    con.print(f"{rc.ranks} DP ranks x {rc.hbm_pages} HBM pages of {rc.page_size} tokens (each rank holds about "
              f"{rc.hbm_pages / median_pages:.1f} median prompts); pool pages carry {rc.page_bytes} bytes; "
              f"concurrency {', '.join(map(str, job.concurrencies))}")
    return stats, lambda cfg, factory, progress: Replay(trace, cfg, job.cost, factory, progress=progress)


def run_job(trace: Trace | MooncakeTrace, job: JobConfig, console: Any = None, trace_path: str | None = None
            ) -> int:
    """Run the matrix, print and write the report. Returns the exit code (0: every run completed). A Mooncake
    trace runs open loop, once per router and pool setting (``job.concurrencies`` does not apply)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    con = console or Console(width=None if sys.stdout.isatty() else 118)
    os.makedirs(job.out, exist_ok=True)
    stats, make_replay = _describe(trace, job, con)
    rc = job.replay
    concurrencies = (0,) if isinstance(trace, MooncakeTrace) else job.concurrencies
    pool = None
    metaserver = job.metaserver
    if any(use for _, use in job.runs) and metaserver is None:
        from umbp.launcher import LocalPool
        from umbp.sizes import format_size

        cap = job.node_capacity()
        con.print(f"starting a local pool: etcd, a metaserver ({job.eviction_policy}), {job.nodes} "
                  f"node{'s' if job.nodes != 1 else ''} of "
                  f"{format_size(cap)} ({job.pool_pages} pages)")
        pool = LocalPool(nodes=job.nodes, capacity=cap, port=0,
                         metaserver_args=["--eviction-policy", job.eviction_policy]).start()
        metaserver = pool.metaserver
    rows: list[RunResult] = []
    run_id = uuid.uuid4().hex[:8]
    t0 = time.perf_counter()
    try:
        plan = [(c, router, use) for c in concurrencies for router, use in job.runs]
        cols = (TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*cols, console=con, transient=False) as bar:
            task = bar.add_task("replay", total=len(plan) * len(trace))
            for i, (c, router, use) in enumerate(plan):
                cfg = replace(rc, concurrency=max(1, c), router=router, use_pool=use)
                factory = None
                if use:
                    if pool is not None:
                        _evict_all(metaserver, job.transport)
                    ns = f"{job.namespace}/{run_id}/{router}-c{c}"
                    factory = _client_factory(metaserver, ns, job.transport)
                bar.update(task, description=f"{f'c{c} ' if c else ''}{router} {'+pool' if use else 'no pool'}")
                done0 = i * len(trace)
                rows.append(make_replay(cfg, factory, lambda n, d=done0: bar.update(task, completed=d + n)).run())
    finally:
        if pool is not None:
            pool.stop()
    wall = time.perf_counter() - t0
    what = "block hit rates" if isinstance(trace, MooncakeTrace) else "shares of prompt tokens"
    con.print(report.table(rows, title=f"{job.title}: {what}, simulated TTFT"))
    checks = report.targets(rows)
    for t in checks:
        mark = {True: "[green]met[/]", False: "[red]NOT met[/]", None: "[yellow]not measured[/]"}[t["met"]]
        con.print(f"  {mark}: {t['target']} ({t['detail']})")
    payload = {"title": job.title, "trace": {"path": trace_path, "header": {k: v for k, v in trace.header.items()},
                                             "stats": stats},
               "job": {k: v for k, v in asdict(job).items() if k not in ("replay", "cost")},
               "replay": asdict(rc), "cost_model": asdict(job.cost), "runs": [r.to_json() for r in rows],
               "targets": checks, "wall_s": wall}
    files = [os.path.join(job.out, "results.json")]
    report.write_json(files[0], payload)
    if job.plots:
        files += [os.path.join(job.out, "shares.png"), os.path.join(job.out, "ttft.png")]
        report.plot_shares(rows, files[1])
        report.plot_ttft(rows, files[2])
    con.print(f"wrote {', '.join(files)}; {len(rows)} runs in {wall:.0f}s wall "
              f"({sum(r.pages_verified for r in rows)} pool pages read back and verified byte for byte)")
    return 0


def _client_factory(metaserver: str, namespace: str, transport: str):
    from umbp.client import Client

    def make() -> Client:
        return Client(metaserver=metaserver, namespace=namespace, transport=transport)

    return make
