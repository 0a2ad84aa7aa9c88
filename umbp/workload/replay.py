"""Replay a trace through DP ranks, each with an HBM prefix cache, a router in front, and (optionally) the pool.

The model is the prefill tier of a prefill/decode-disaggregated deployment. Time is simulated; pages and bytes
are real. One event loop runs in simulated time:

- a root session is admitted when fewer than ``concurrency`` are in flight (arrival order, never before its
  arrival); a request is ready ``think_s`` after everything it waits for finished (its session's previous
  request, its parent, the subagent sessions in ``after``);
- a ready request gets its chained page keys (``umbp.keys.chain_keys``, extended from its parent's keys, so
  SGLang-identical) and is routed (``umbp.routing``) to a rank's FIFO queue;
- when the rank starts it: the HBM cache serves the leading pages it holds; the pool serves the pages right after
  (``prefix_hits``, then ``batch_get_into`` into the rank's buffers; every byte is compared with the page's
  deterministic payload); the rest is recomputed. At most ``(prompt - 1) // page_size`` pages come from caches
  (the last token is always computed). Then the prompt's pages enter the rank's HBM cache;
- the prefill lasts ``CostModel.prefill_s`` simulated seconds; then the rank takes its next request, the pages it
  computed are written back to the pool (``batch_put`` with parents, for prefix-aware eviction), and decoding
  (elsewhere) takes ``output * tpot_s``; at its end the decode side writes the pages holding the output.

Accounting, checked for every request (``ReplayError`` otherwise): HBM tokens + pool tokens + recomputed tokens
= prompt tokens. ``ideal`` tokens are what an unbounded cache shared by all ranks would have served (the leading
pages any earlier request already wrote), the bound no router or pool size can beat.

Ranks are objects driven from the one event loop, so the order of pool operations follows simulated time. Each
rank owns two clients: one for loads (the event loop, in order) and one for its write-back thread, which
batches puts in the background as an engine's write-through thread does; a load that needs a page still queued
for write-back waits for it, so no load misses a page simulated time says is written. The only freedom left is
when the pool sees a write (and so what it evicts), which is why two runs may differ by a few pages.

Cost per request: O(new pages) key hashing, O(pages) HBM work, one ``prefix_hits`` and one ``batch_get_into`` when
HBM misses, and page verification at memory speed; a rank's puts happen off the event loop.
"""

from __future__ import annotations

import hashlib
import heapq
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from umbp.errors import ConfigError, CorruptionError, UmbpError
from umbp.keys import chain_keys
from umbp.routing import RouteRequest, Router, make_router
from umbp.costmodel import CostModel
from umbp.workload.hbm import HbmCache
from umbp.workload.trace import Request, Trace, expand_items


class ReplayError(UmbpError):
    """The replay's own invariants broke (accounting, dependencies): a bug, never a workload property."""


@dataclass(frozen=True)
class ReplayConfig:
    ranks: int = 4
    hbm_pages: int = 2048  # per rank
    page_size: int = 16  # tokens per page
    page_bytes: int = 16384 - 64  # payload of one pool page: with its 64-byte header, one 16 KiB object
    concurrency: int = 8  # root sessions in flight
    router: str = "round-robin"
    use_pool: bool = True
    write_batch_pages: int = 512  # most pages one write-back put carries
    affinity_load_factor: float = 1.25

    def __post_init__(self) -> None:
        c = "replay"
        if not 1 <= self.ranks <= 1024 or self.concurrency < 1:
            raise ConfigError(c, "ranks must be within 1..1024 and concurrency >= 1")
        if self.hbm_pages < 0 or self.page_size < 1 or self.page_bytes < 1 or self.write_batch_pages < 1:
            raise ConfigError(c, "hbm_pages >= 0, page_size, page_bytes and write_batch_pages >= 1 required")


def page_payload(key: str, size: int) -> bytes:
    """The bytes stored for a page: sha256("umbp-page\\0" + key) repeated, so any reader can check every byte."""
    d = hashlib.sha256(b"umbp-page\0" + key.encode()).digest()
    return d * (size // 32) + d[:size % 32]


class WriteBack:
    """A rank's write-back thread: ``submit`` queues pages, the thread puts them in batches with its own client.

    ``wait_for(keys)`` blocks until none of ``keys`` is queued or being written (bounded by the client's own
    deadline per put); ``close()`` drains the queue, stops the thread and re-raises the first put error."""

    def __init__(self, client: Any, page_bytes: int, batch_pages: int, name: str):
        self.client = client
        self.page_bytes = page_bytes
        self.batch_pages = batch_pages
        self._queue: deque[tuple[str, str | None]] = deque()
        self._pending: dict[str, int] = {}  # key -> times queued and not yet written
        self._cv = threading.Condition()
        self._stop = False
        self.error: BaseException | None = None
        self.pages_put = self.pages_dedup = self.bytes_put = self.puts = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, keys: Sequence[str], parents: Sequence[str | None]) -> None:
        with self._cv:
            for k, p in zip(keys, parents):
                self._queue.append((k, p))
                self._pending[k] = self._pending.get(k, 0) + 1
            self._cv.notify_all()

    def wait_for(self, keys: Sequence[str]) -> None:
        with self._cv:
            while self.error is None and any(k in self._pending for k in keys):
                self._cv.wait(1.0)
            if self.error is not None:
                raise self.error

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if not self._queue:
                    return
                batch = [self._queue.popleft() for _ in range(min(self.batch_pages, len(self._queue)))]
            seen: dict[str, str | None] = {}
            for k, p in batch:
                seen.setdefault(k, p)
            keys = list(seen)
            try:
                res = self.client.batch_put(keys, [page_payload(k, self.page_bytes) for k in keys],
                                            parents=[seen[k] for k in keys])
            except BaseException as e:  # handed to the event loop at its next wait_for/close
                with self._cv:
                    self.error = e
                    self._cv.notify_all()
                return
            with self._cv:
                self.puts += 1
                stored = sum(1 for r in res if r)
                self.pages_put += stored
                self.pages_dedup += len(res) - stored
                self.bytes_put += stored * self.page_bytes
                for k, _ in batch:
                    n = self._pending[k] - 1
                    if n:
                        self._pending[k] = n
                    else:
                        del self._pending[k]
                self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join()
        if self.error is not None:
            raise self.error


class Rank:
    """One DP rank: an HBM cache, a FIFO queue, a load client and a write-back thread (both None: no pool)."""

    def __init__(self, index: int, hbm_pages: int, load: Any = None, writeback: WriteBack | None = None):
        self.index = index
        self.hbm = HbmCache(hbm_pages)
        self.load = load
        self.writeback = writeback
        self.queue: deque[str] = deque()
        self.busy = False
        self.current = ""  # id of the request in prefill
        self.buf = np.zeros((0, 0), dtype=np.uint8)

    def hbm_prefix_pages(self, keys: Sequence[str]) -> int:
        return self.hbm.match(keys)

    def buffers(self, n: int, page_bytes: int) -> np.ndarray:
        if self.buf.shape[0] < n or self.buf.shape[1] != page_bytes:
            self.buf = np.zeros((max(n, 2 * self.buf.shape[0]), page_bytes), dtype=np.uint8)
        return self.buf


@dataclass
class _Live:
    """What the event loop knows about a ready request."""

    req: Request
    ready_s: float
    ctx_tokens: np.ndarray
    ctx_keys: list[str]
    rank: int = -1
    hbm: int = 0
    pool: int = 0  # pages
    computed_from: int = 0  # first page index computed


@dataclass
class RunResult:
    router: str
    concurrency: int
    use_pool: bool
    requests: int = 0
    prompt_tokens: int = 0
    hbm_tokens: int = 0
    pool_tokens: int = 0
    recomputed_tokens: int = 0
    ideal_tokens: int = 0
    pool_pages_read: int = 0
    pool_bytes_read: int = 0
    pool_read_s: float = 0.0
    pool_pages_written: int = 0
    pool_pages_dedup: int = 0
    pool_bytes_written: int = 0
    pages_evicted: int = 0
    hbm_pages_evicted: int = 0
    pages_verified: int = 0
    ttft_p50_s: float = 0.0
    ttft_p90_s: float = 0.0
    ttft_mean_s: float = 0.0
    sim_s: float = 0.0
    wall_s: float = 0.0
    mean_sessions_in_flight: float = 0.0
    prefill_s: float = 0.0  # simulated prefill seconds, summed over requests
    prefill_full_s: float = 0.0  # the same prefills with nothing cached: prefill_s / this = 1 - time saved
    blocks: int = 0  # block counts: traces with blocks (Mooncake format) only, see umbp.workload.mooncake
    hbm_blocks: int = 0
    pool_blocks: int = 0
    recomputed_blocks: int = 0
    ceiling_blocks: int = 0
    pool_nodes: list = field(default_factory=list)  # after the run: node_id, used_bytes, capacity_bytes, objects
    config: dict = field(default_factory=dict)

    def share(self, what: str) -> float:
        return getattr(self, f"{what}_tokens") / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def cached_share(self) -> float:
        return self.share("hbm") + self.share("pool")

    def block_share(self, what: str) -> float:
        return getattr(self, f"{what}_blocks") / self.blocks if self.blocks else 0.0

    @property
    def prefill_saved(self) -> float:
        """Share of simulated prefill time the caches saved against recomputing every prompt."""
        return 1.0 - self.prefill_s / self.prefill_full_s if self.prefill_full_s > 0 else 0.0

    @property
    def pool_gbps(self) -> float:
        return self.pool_bytes_read / self.pool_read_s / 1e9 if self.pool_read_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(hbm_share=self.share("hbm"), pool_share=self.share("pool"),
                 recomputed_share=self.share("recomputed"), ideal_share=self.share("ideal"),
                 cached_share=self.cached_share, pool_read_gbps=self.pool_gbps, prefill_saved=self.prefill_saved)
        if self.blocks:
            d.update({f"{w}_block_share": self.block_share(w) for w in ("hbm", "pool", "recomputed", "ceiling")})
        return d


class Replay:
    """One run: a trace at one concurrency, one router, with or without the pool.

    ``client_factory()`` returns a client (``umbp.Client``-like: batch_put, batch_get_into, prefix_hits, stats,
    close) and is called once per rank for loads, once per rank for write-back, once for the router's pool
    queries (cache-aware) and once for statistics; without a pool pass None. ``progress(n)`` is called with the
    number of requests finished so far."""

    def __init__(self, trace: Trace, cfg: ReplayConfig, cost: CostModel | None = None,
                 client_factory: Callable[[], Any] | None = None,
                 progress: Callable[[int], None] | None = None):
        if cfg.use_pool and client_factory is None:
            raise ConfigError("replay", "use_pool needs a client_factory")
        self.trace = trace
        self.cfg = cfg
        self.cost = cost or CostModel()
        self.factory = client_factory if cfg.use_pool else None
        self.progress = progress
        self.scale = trace.scale

    # ---- setup ------------------------------------------------------------------------------------------------

    def _deps(self) -> tuple[dict[str, list[str]], dict[str, int], dict[str, int]]:
        waiters: dict[str, list[str]] = {}
        remaining: dict[str, int] = {}
        per_root: dict[str, int] = {}
        last: dict[str, str] = {}
        for r in self.trace.requests:
            deps = set()
            if r.session in last:
                deps.add(last[r.session])
            if r.parent is not None:
                deps.add(r.parent)
            for s in r.after:
                deps.add(self.trace.last_of_session[s])
            deps.discard(r.id)
            for d in deps:
                waiters.setdefault(d, []).append(r.id)
            remaining[r.id] = len(deps)
            per_root[r.root] = per_root.get(r.root, 0) + 1
            last[r.session] = r.id
        return waiters, remaining, per_root

    # ---- the run ----------------------------------------------------------------------------------------------

    def run(self) -> RunResult:
        cfg = self.cfg
        clients: list[Any] = []
        writebacks: list[WriteBack] = []
        try:
            ranks = []
            for i in range(cfg.ranks):
                load = wb = None
                if self.factory is not None:
                    load = self.factory()
                    clients.append(load)
                    wc = self.factory()
                    clients.append(wc)
                    wb = WriteBack(wc, cfg.page_bytes, cfg.write_batch_pages, f"writeback-{i}")
                    writebacks.append(wb)
                ranks.append(Rank(i, cfg.hbm_pages, load, wb))
            router_pool = None
            if self.factory is not None:
                router_pool = self.factory()
                clients.append(router_pool)
            router = make_router(cfg.router, cfg.ranks, cost=self.cost, pool=_WaitingPool(router_pool, writebacks)
                                 if router_pool is not None else None, scale=self.scale,
                                 load_factor=cfg.affinity_load_factor)
            self._all_wb = writebacks
            before = router_pool.stats() if router_pool is not None else None
            result = self._loop(ranks, router)
            for wb in writebacks:
                wb.close()
            writebacks_closed, writebacks[:] = list(writebacks), []
            if router_pool is not None:
                after = router_pool.stats()
                result.pages_evicted = int(after.get("evictions", 0)) - int(before.get("evictions", 0))
                result.pool_nodes = [{k: n.get(k) for k in ("node_id", "used_bytes", "capacity_bytes", "objects")}
                                     for n in after.get("nodes", [])]
            for wb in writebacks_closed:
                result.pool_pages_written += wb.pages_put
                result.pool_pages_dedup += wb.pages_dedup
                result.pool_bytes_written += wb.bytes_put
            result.hbm_pages_evicted = sum(r.hbm.evicted for r in ranks)
            return result
        finally:
            for wb in writebacks:
                try:
                    wb.close()
                except Exception:  # noqa: BLE001 - the loop's own error is the one to report
                    pass
            for c in clients:
                close = getattr(c, "close", None)
                if close is not None and c is not None:
                    close()

    def _loop(self, ranks: list[Rank], router: Router) -> RunResult:
        """Run the event loop to the end: each request makes three events (ready, prefilled, finished), so the
        loop is bounded by that count; the figures come from ``_Sim.result``."""
        t0 = time.perf_counter()
        sim = _Sim(self, ranks, router)
        handlers = {"ready": sim.ready, "prefilled": sim.prefilled, "finished": sim.finished}
        sim.admit(0.0)
        max_events = 8 * len(self.trace.requests) + 16
        for _ in range(max_events):
            if not sim.events:
                break
            now, _, kind, what = heapq.heappop(sim.events)
            sim.area += sim.in_flight * (now - sim.last_t)
            sim.last_t = now
            handlers[kind](now, what)
        if sim.events:  # each request makes at most 3 events: anything more is a bug
            raise ReplayError("replay", f"more than {max_events} events for {len(self.trace)} requests")
        if sim.done != len(self.trace.requests):
            raise ReplayError("replay", f"{len(self.trace) - sim.done} requests never became ready "
                                        f"(a dependency cycle?)")
        return sim.result(time.perf_counter() - t0)

    def _ready(self, req: Request, now: float, ctx_of: dict, children: dict) -> _Live:
        """Tokens and chained keys of ``req``'s context (prompt + output), extended from its parent's."""
        ps = self.cfg.page_size
        vocab = self.trace.vocab
        if req.parent is None:
            head_tokens, head_keys = np.zeros(0, dtype=np.int64), []
        else:
            ptoks, pkeys = ctx_of[req.parent]
            children[req.parent] -= 1
            if children[req.parent] == 0:
                del ctx_of[req.parent]
            head_tokens = ptoks[:req.reuse]
            head_keys = pkeys[:req.reuse // ps]
        toks = np.concatenate([head_tokens, expand_items(req.append, vocab), expand_items(req.output, vocab)])
        start = len(head_keys) * ps
        keys = head_keys + chain_keys(toks[start:].tolist(), ps, parent=head_keys[-1] if head_keys else "")
        if len(toks) != req.context_len:
            raise ReplayError("replay", f"{req.id}: expanded {len(toks)} tokens, trace says {req.context_len}")
        return _Live(req, now, toks, keys)

    def _start(self, rank: Rank, lv: _Live, seen: set[str], res: RunResult) -> float:
        """Begin ``lv``'s prefill on ``rank``: HBM, then pool, then recompute. Returns simulated seconds."""
        cfg = self.cfg
        ps = cfg.page_size
        req = lv.req
        rank.busy = True
        rank.current = req.id
        cap = min(len(lv.ctx_keys), (req.prompt_len - 1) // ps)
        keys = lv.ctx_keys[:cap]
        h = rank.hbm.match(keys)
        p = 0
        if rank.load is not None and h < cap:
            want = keys[h:]
            for wb in self._all_wb:
                wb.wait_for(want)
            n = rank.load.prefix_hits(want)
            if n:
                bufs = rank.buffers(n, cfg.page_bytes)
                t = time.perf_counter()
                sizes = rank.load.batch_get_into(want[:n], [bufs[i] for i in range(n)])
                res.pool_read_s += time.perf_counter() - t
                for i, sz in enumerate(sizes):
                    if sz != cfg.page_bytes:  # evicted since prefix_hits (background eviction): stop there
                        break
                    if bufs[i].tobytes() != page_payload(want[i], cfg.page_bytes):
                        raise CorruptionError("replay", f"page {want[i][:16]}... of {req.id} read back wrong bytes")
                    p += 1
                res.pool_pages_read += p
                res.pool_bytes_read += p * cfg.page_bytes
                res.pages_verified += p
        ideal = 0
        for k in keys:
            if k not in seen:
                break
            ideal += 1
        hbm_t, pool_t = h * ps, p * ps
        recomputed = req.prompt_len - hbm_t - pool_t
        if recomputed < 1 or hbm_t + pool_t + recomputed != req.prompt_len:
            raise ReplayError("replay", f"{req.id}: accounting broke: {hbm_t} + {pool_t} + {recomputed} != "
                                        f"{req.prompt_len}")
        res.requests += 1
        res.prompt_tokens += req.prompt_len
        res.hbm_tokens += hbm_t
        res.pool_tokens += pool_t
        res.recomputed_tokens += recomputed
        res.ideal_tokens += max(ideal, h + p) * ps
        lv.hbm, lv.pool, lv.computed_from = h, p, h + p
        rank.hbm.insert(lv.ctx_keys[:req.prompt_len // ps])
        t = self.cost.prefill_s(hbm_t, pool_t, req.prompt_len, self.scale)
        res.prefill_s += t
        res.prefill_full_s += self.cost.prefill_s(0, 0, req.prompt_len, self.scale)
        return t

    def _write(self, rank: Rank, keys: list[str], lo: int, hi: int, seen: set[str]) -> None:
        """Pages ``keys[lo:hi]`` are now written (queued for the pool when there is one)."""
        if hi <= lo:
            return
        seen.update(keys[lo:hi])
        if rank.writeback is not None:
            rank.writeback.submit(keys[lo:hi], [keys[i - 1] if i else None for i in range(lo, hi)])


class _Sim:
    """The state of one run's event loop (``Replay._loop``) and one handler per event kind.

    Events are ``(simulated time, sequence, kind, what)`` on a heap: ``ready`` (a request's dependencies are done
    and its think time passed: route it), ``prefilled`` (rank ``what`` finished a prefill: write its pages, start
    the next queued one) and ``finished`` (decode done: release dependants; a session tree that ends admits the
    next under the concurrency cap). ``area`` integrates sessions in flight over simulated time."""

    def __init__(self, replay: Replay, ranks: list[Rank], router: Router):
        cfg, trace = replay.cfg, replay.trace
        self.rp, self.cfg, self.trace, self.ranks, self.router = replay, cfg, trace, ranks, router
        self.res = RunResult(router=cfg.router, concurrency=cfg.concurrency, use_pool=cfg.use_pool,
                             config={**asdict(cfg), "cost_model": asdict(replay.cost), "scale": replay.scale})
        self.waiters, self.remaining, self.per_root = replay._deps()
        self.ctx_of: dict[str, tuple[np.ndarray, list[str]]] = {}  # finished requests whose children need context
        self.children: dict[str, int] = {}
        for r in trace.requests:
            if r.parent is not None:
                self.children[r.parent] = self.children.get(r.parent, 0) + 1
        self.base: dict[str, float] = {}
        self.live: dict[str, _Live] = {}
        self.seen: set[str] = set()
        self.roots = deque(trace.roots())
        self.first_of_root: dict[str, list[str]] = {}
        for r in trace.requests:
            if self.remaining[r.id] == 0:
                self.first_of_root.setdefault(r.root, []).append(r.id)
        self.events: list[tuple[float, int, str, str]] = []
        self.seq = 0
        self.ttft: list[float] = []
        self.in_flight = 0
        self.area = 0.0
        self.last_t = 0.0
        self.done = 0

    def push(self, t: float, kind: str, what: str) -> None:
        heapq.heappush(self.events, (t, self.seq, kind, what))
        self.seq += 1

    def admit(self, now: float) -> None:
        """Start session trees while fewer than ``concurrency`` are in flight."""
        while self.roots and self.in_flight < self.cfg.concurrency:
            root = self.roots.popleft()
            self.in_flight += 1
            for rid in self.first_of_root.get(root, []):
                self.push(max(now, self.trace.by_id[rid].arrival_s), "ready", rid)

    def _start_next(self, rank: Rank, now: float) -> None:
        lv = self.live[rank.queue.popleft()]
        self.push(now + self.rp._start(rank, lv, self.seen, self.res), "prefilled", f"{rank.index}")

    def ready(self, now: float, rid: str) -> None:
        cfg = self.cfg
        lv = self.rp._ready(self.trace.by_id[rid], now, self.ctx_of, self.children)
        self.live[rid] = lv
        lv.rank = self.router.route(RouteRequest(rid, lv.req.session, lv.ctx_keys[:lv.req.prompt_len //
                                                 cfg.page_size], lv.req.prompt_len, cfg.page_size, now),
                                    self.ranks)
        rank = self.ranks[lv.rank]
        rank.queue.append(rid)
        if not rank.busy:
            self._start_next(rank, now)

    def prefilled(self, now: float, what: str) -> None:
        rank = self.ranks[int(what)]
        lv = self.live[rank.current]
        self.router.on_finish(lv.req.id)
        self.ttft.append(now - lv.ready_s)
        self.rp._write(rank, lv.ctx_keys, lv.computed_from, lv.req.prompt_len // self.cfg.page_size, self.seen)
        self.push(now + self.rp.cost.decode_s(lv.req.output_len, self.rp.scale), "finished", lv.req.id)
        rank.busy = False
        if rank.queue:
            self._start_next(rank, now)

    def finished(self, now: float, rid: str) -> None:
        lv = self.live.pop(rid)
        ps = self.cfg.page_size
        self.rp._write(self.ranks[lv.rank], lv.ctx_keys, lv.req.prompt_len // ps, lv.req.context_len // ps,
                       self.seen)
        if self.children.get(rid):
            self.ctx_of[rid] = (lv.ctx_tokens, lv.ctx_keys)
        self.done += 1
        if self.rp.progress is not None:
            self.rp.progress(self.done)
        for w in self.waiters.get(rid, ()):
            self.base[w] = max(self.base.get(w, 0.0), now)
            self.remaining[w] -= 1
            if self.remaining[w] == 0:
                self.push(self.base.pop(w) + self.trace.by_id[w].think_s, "ready", w)
        self.per_root[lv.req.root] -= 1
        if self.per_root[lv.req.root] == 0:
            self.in_flight -= 1
            self.admit(now)

    def result(self, wall_s: float) -> RunResult:
        return finish_result(self.res, self.ttft, self.last_t, self.area, wall_s)


class _WaitingPool:
    """The router's pool view: waits for queued write-back of the keys it asks about, then asks the pool."""

    def __init__(self, client: Any, writebacks: list[WriteBack]):
        self.client = client
        self.writebacks = writebacks

    def prefix_hits(self, keys: Sequence[str]) -> int:
        for wb in self.writebacks:
            wb.wait_for(keys)
        return self.client.prefix_hits(keys)


def finish_result(res: RunResult, ttft: list[float], last_t: float, area: float, wall_s: float) -> RunResult:
    """Fill a run's summary (TTFT percentiles and mean, simulated span, sessions in flight on average, wall time)
    from what the event loop accumulated: shared by this replay and the Mooncake one."""
    t = np.array(ttft) if ttft else np.zeros(1)
    res.ttft_p50_s, res.ttft_p90_s = float(np.percentile(t, 50)), float(np.percentile(t, 90))
    res.ttft_mean_s = float(t.mean())
    res.sim_s = last_t
    res.mean_sessions_in_flight = area / last_t if last_t > 0 else 0.0
    res.wall_s = wall_s
    return res
