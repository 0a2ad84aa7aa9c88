"""Public traces in Mooncake's FAST'25 format: loader, block-to-page keys, the infinite-cache ceiling, and an
open-loop replay of them through DP ranks and the pool.

Format (kvcache-ai/Mooncake, ``FAST25-release/traces/*.jsonl``; not vendored, see docs/guide/workload.md): one
JSON object a line, ``{"timestamp": ms, "input_length": N, "output_length": M, "hash_ids": [...]}``. ``hash_ids``
are remapped hashes of the prompt's blocks of ``block_tokens`` (512) tokens, the last block possibly partial, so
``len(hash_ids) == ceil(input_length / block_tokens)``; equal ids at equal positions after an equal prefix are the
same KV. No token ids, no sessions, no output hashes (a later turn's ``hash_ids`` carry the earlier answer).

Pages: a block splits into ``block_tokens / page_tokens`` whole pages (``page_tokens`` divides the block), or
``page_tokens / block_tokens`` blocks merge into one page (a multiple of the block). Only full pages (all their
tokens within ``input_length``) get keys. A page key is ``umbp.keys.page_key`` chained on the previous page's key,
over the 64-bit words ``[hash_id, sub_page]`` (split) or the merged blocks' ids, so keys are SGLang-shaped 64-hex
chained digests and two requests share a page key exactly when they share the ids of every block up to it.

Replay (``MooncakeReplay``, a ``Replay`` with its own loop): open loop, requests arrive at ``timestamp / speed``
in the trace's own order (ties: file order), are routed, queue FIFO at their rank; a prefill serves HBM, then the
pool, then recomputes (``Replay._start``, the same accounting and byte checks as the agentic replay), and its
computed pages are written back when it ends. Nothing is written for outputs: the trace names no output blocks.
Affinity routing needs a session, which the format lacks: a request's session is its first ``session_blocks``
block ids (2 by default: in the conversation trace block 0 is a system prompt every request shares and block 1
tells conversations apart).

Block accounting per request: blocks wholly inside the HBM-served tokens are HBM blocks, those wholly inside the
cached tokens but not HBM are pool blocks, the rest (partial tail included) recomputed; they add up to
``len(hash_ids)``. The ceiling (``ceiling_pages``) is an unbounded cache shared by every rank in trace order: the
leading pages of each prompt that any earlier prompt held, capped like a replay (the last token is computed). It
is a property of the trace; a replay with heavy queueing may start a request after a later one wrote a shared
prefix, so one row can exceed it by a few blocks.

Costs: loading O(lines); keys one sha256 per page at arrival; ceiling O(pages) with a set of keys.
"""

from __future__ import annotations

import heapq
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from umbp.errors import ConfigError
from umbp.keys import page_key
from umbp.routing import RouteRequest, Router
from umbp.costmodel import CostModel
from umbp.workload.replay import Rank, Replay, ReplayConfig, ReplayError, RunResult, _Live, finish_result
from umbp.workload.trace import json_lines

BLOCK_TOKENS = 512
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
MAX_LINE = 16 << 20


@dataclass(frozen=True)
class MooncakeRequest:
    id: str  # "r<line index>"
    arrival_s: float
    prompt_len: int
    output_len: int
    hash_ids: tuple[int, ...]
    session: str = ""


@dataclass
class MooncakeTrace:
    """Requests in file order (arrival times non-decreasing is not required: the replay sorts by time)."""

    requests: list[MooncakeRequest]
    block_tokens: int = BLOCK_TOKENS
    name: str = "trace"
    scale: float = 1.0  # a recorded trace: full-size token counts
    header: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.header = {"format": "mooncake", "block_tokens": self.block_tokens, **self.header}

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[MooncakeRequest]:
        return iter(self.requests)

    def head(self, n: int) -> "MooncakeTrace":
        return MooncakeTrace(self.requests[:n], self.block_tokens, self.name, self.scale, dict(self.header))


def is_mooncake_record(d: Any) -> bool:
    return isinstance(d, dict) and "hash_ids" in d and "input_length" in d


def _int(d: dict, f: str, where: str, lo: int) -> int:
    v = d.get(f)
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ConfigError("trace", f"{where}: {f} must be an integer >= {lo}, got {v!r}")
    return v


def request_from_json(d: Any, index: int, where: str, block_tokens: int = BLOCK_TOKENS,
                      session_blocks: int = 2) -> MooncakeRequest:
    if not isinstance(d, dict):
        raise ConfigError("trace", f"{where}: expected an object")
    missing = [f for f in FIELDS if f not in d]
    if missing:
        raise ConfigError("trace", f"{where}: missing {missing} (Mooncake format: {', '.join(FIELDS)})")
    ts = d["timestamp"]
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not ts >= 0:
        raise ConfigError("trace", f"{where}: timestamp must be a number of milliseconds >= 0, got {ts!r}")
    n = _int(d, "input_length", where, 1)
    out = _int(d, "output_length", where, 0)
    ids = d["hash_ids"]
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 1 << 64
                                            for h in ids):
        raise ConfigError("trace", f"{where}: hash_ids must be a list of integers within 0..2**64-1")
    want = -(-n // block_tokens)
    if len(ids) != want:
        raise ConfigError("trace", f"{where}: {len(ids)} hash_ids for {n} input tokens; blocks of {block_tokens} "
                                   f"tokens need {want} (--block-tokens sets the trace's block size)")
    session = ",".join(map(str, ids[:session_blocks]))
    return MooncakeRequest(f"r{index}", ts / 1000.0, n, out, tuple(ids), session)


def parse_lines(lines: Iterable[str], name: str = "trace", block_tokens: int = BLOCK_TOKENS,
                session_blocks: int = 2) -> MooncakeTrace:
    if block_tokens < 1 or session_blocks < 1:
        raise ConfigError("trace", "block_tokens and session_blocks must be >= 1")
    reqs = []
    for n, d in json_lines(lines, name, MAX_LINE):
        reqs.append(request_from_json(d, len(reqs), f"{name}:{n}", block_tokens, session_blocks))
    if not reqs:
        raise ConfigError("trace", f"{name}: no requests")
    return MooncakeTrace(reqs, block_tokens, name)


def load_mooncake(path: str | os.PathLike, block_tokens: int = BLOCK_TOKENS, session_blocks: int = 2
                  ) -> MooncakeTrace:
    try:
        with open(path) as fh:
            return parse_lines(fh, os.path.basename(str(path)), block_tokens, session_blocks)
    except OSError as e:
        raise ConfigError("trace", f"cannot read {path}: {e.strerror or e}") from e


def detect_format(path: str | os.PathLike) -> str:
    """``"mooncake"`` when the first JSON line has ``hash_ids`` and ``input_length``, else ``"umbp"``."""
    try:
        with open(path) as fh:
            for line in fh:
                s = line.strip()
                if not s or s.startswith("#"):
                    continue
                try:
                    return "mooncake" if is_mooncake_record(json.loads(s)) else "umbp"
                except ValueError:
                    return "umbp"  # the umbp loader reports the bad line
    except OSError as e:
        raise ConfigError("trace", f"cannot read {path}: {e.strerror or e}") from e
    return "umbp"


# ----------------------------------------------------------------------------------------------------------------
# blocks to pages


def check_page_tokens(page_tokens: int, block_tokens: int = BLOCK_TOKENS) -> None:
    if page_tokens < 1 or (block_tokens % page_tokens and page_tokens % block_tokens):
        raise ConfigError("trace", f"--page-tokens {page_tokens} must divide the {block_tokens}-token block "
                                   f"(a block split into whole pages) or be a multiple of it (blocks merged)")


def page_keys(hash_ids: Sequence[int], prompt_len: int, page_tokens: int,
              block_tokens: int = BLOCK_TOKENS) -> list[str]:
    """Chained keys of the prompt's full pages (see the module docstring)."""
    check_page_tokens(page_tokens, block_tokens)
    keys: list[str] = []
    parent = ""
    if page_tokens <= block_tokens:
        per = block_tokens // page_tokens
        for p in range(prompt_len // page_tokens):
            parent = page_key(parent, [hash_ids[p // per], p % per])
            keys.append(parent)
    else:
        m = page_tokens // block_tokens
        for p in range(prompt_len // page_tokens):
            parent = page_key(parent, list(hash_ids[p * m:(p + 1) * m]))
            keys.append(parent)
    return keys


def cacheable_pages(prompt_len: int, page_tokens: int) -> int:
    """Pages a cache may serve: the last prompt token is always computed."""
    return (prompt_len - 1) // page_tokens


def blocks_within(pages: int, page_tokens: int, block_tokens: int = BLOCK_TOKENS) -> int:
    """Blocks wholly inside the first ``pages`` pages."""
    return pages * page_tokens // block_tokens


def ceiling_pages(trace: MooncakeTrace, page_tokens: int) -> list[int]:
    """Per request (file order): leading pages an unbounded cache shared by all ranks serves, counting every
    earlier request's full prompt pages, capped at ``cacheable_pages``."""
    seen: set[str] = set()
    out = []
    for r in trace.requests:
        keys = page_keys(r.hash_ids, r.prompt_len, page_tokens, trace.block_tokens)
        n = 0
        for k in keys[:cacheable_pages(r.prompt_len, page_tokens)]:
            if k not in seen:
                break
            n += 1
        out.append(n)
        seen.update(keys)
    return out


def _distinct_prefixes(trace: MooncakeTrace) -> int:
    """Distinct blocks, a block being named by its whole prefix of ids (a trie of (parent node, id) edges)."""
    nodes: dict[tuple[int, int], int] = {}
    for r in trace.requests:
        node = -1
        for h in r.hash_ids:
            node = nodes.setdefault((node, h), len(nodes))
    return len(nodes)


def mooncake_stats(trace: MooncakeTrace, page_tokens: int, ceiling: Sequence[int] | None = None) -> dict[str, Any]:
    """Trace numbers for the report header and JSON; ``ceiling`` from ``ceiling_pages`` (computed if None)."""
    ceiling = ceiling_pages(trace, page_tokens) if ceiling is None else ceiling
    bt = trace.block_tokens
    prompts = np.array([r.prompt_len for r in trace.requests], dtype=np.float64)
    outputs = np.array([r.output_len for r in trace.requests], dtype=np.float64)
    blocks = sum(len(r.hash_ids) for r in trace.requests)
    ceil_blocks = sum(blocks_within(c, page_tokens, bt) for c in ceiling)
    ts = [r.arrival_s for r in trace.requests]
    return {
        "requests": len(trace.requests),
        "span_s": max(ts) - min(ts),
        "prompt_tokens_mean": float(prompts.mean()),
        "prompt_tokens_median": float(np.median(prompts)),
        "output_tokens_mean": float(outputs.mean()),
        "prompt_tokens_total": int(prompts.sum()),
        "blocks": blocks,
        "distinct_blocks": _distinct_prefixes(trace),
        "sessions": len({r.session for r in trace.requests}),
        "ceiling_blocks": ceil_blocks,
        "ceiling_block_share": ceil_blocks / blocks if blocks else 0.0,
        "ceiling_token_share": sum(c * page_tokens for c in ceiling) / max(1, int(prompts.sum())),
        "block_tokens": bt,
        "page_tokens": page_tokens,
    }


# ----------------------------------------------------------------------------------------------------------------
# the open-loop replay


class MooncakeReplay(Replay):
    """One run of a Mooncake trace: open loop at ``timestamp / speed``, one router, with or without the pool.

    ``cfg.concurrency`` is unused (the trace's timestamps set the load); results carry ``concurrency`` 0 and the
    block counts (``blocks``, ``hbm_blocks``, ``pool_blocks``, ``recomputed_blocks``, ``ceiling_blocks``)."""

    def __init__(self, trace: MooncakeTrace, cfg: ReplayConfig, cost: CostModel | None = None,
                 client_factory: Callable[[], Any] | None = None, progress: Callable[[int], None] | None = None,
                 speed: float = 1.0, ceiling: Sequence[int] | None = None):
        if not speed > 0:
            raise ConfigError("replay", f"speed must be > 0, got {speed}")
        check_page_tokens(cfg.page_size, trace.block_tokens)
        super().__init__(trace, cfg, cost, client_factory, progress)  # type: ignore[arg-type]
        self.speed = speed
        self.ceiling = list(ceiling) if ceiling is not None else ceiling_pages(trace, cfg.page_size)
        self.index = {r.id: i for i, r in enumerate(trace.requests)}

    def _loop(self, ranks: list[Rank], router: Router) -> RunResult:
        t0 = time.perf_counter()
        sim = _OpenSim(self, ranks, router)
        n = len(self.trace.requests)
        for _ in range(2 * n + 1):  # each request: one arrival, one prefill end
            if not sim.events:
                break
            now, _, kind, what = heapq.heappop(sim.events)
            sim.area += sim.in_flight * (now - sim.last_t)
            sim.last_t = now
            (sim.arrive if kind == "arrive" else sim.prefilled)(now, what)
        if sim.events or sim.done != n:
            raise ReplayError("replay", f"{n - sim.done} of {n} requests unfinished after {2 * n} events")
        return sim.result(time.perf_counter() - t0)

    def _start(self, rank: Rank, lv: _Live, seen: set[str], res: RunResult) -> float:
        t = super()._start(rank, lv, seen, res)
        req, ps, bt = lv.req, self.cfg.page_size, self.trace.block_tokens
        nb = len(req.hash_ids)
        hbm = blocks_within(lv.hbm, ps, bt)
        cached = blocks_within(lv.hbm + lv.pool, ps, bt)
        if not hbm <= cached <= nb:
            raise ReplayError("replay", f"{req.id}: block accounting broke: {hbm} <= {cached} <= {nb}")
        res.blocks += nb
        res.hbm_blocks += hbm
        res.pool_blocks += cached - hbm
        res.recomputed_blocks += nb - cached
        res.ceiling_blocks += blocks_within(self.ceiling[self.index[req.id]], ps, bt)
        return t


class _OpenSim:
    """Event loop state of ``MooncakeReplay``: ``arrive`` (route the request, start it if its rank is idle) and
    ``prefilled`` (rank ``what`` finished: write its computed pages, start the next queued request).
    ``in_flight`` counts requests arrived and not yet prefilled."""

    def __init__(self, replay: MooncakeReplay, ranks: list[Rank], router: Router):
        from dataclasses import asdict

        cfg = replay.cfg
        self.rp, self.cfg, self.ranks, self.router = replay, cfg, ranks, router
        self.res = RunResult(router=cfg.router, concurrency=0, use_pool=cfg.use_pool,
                             config={**asdict(cfg), "cost_model": asdict(replay.cost), "scale": replay.scale,
                                     "speed": replay.speed, "open_loop": True})
        self.events: list[tuple[float, int, str, Any]] = []
        for i, r in enumerate(replay.trace.requests):
            self.events.append((r.arrival_s / replay.speed, i, "arrive", i))
        heapq.heapify(self.events)
        self.seq = len(self.events)
        self.live: dict[str, _Live] = {}
        self.seen: set[str] = set()
        self.ttft: list[float] = []
        self.in_flight = 0
        self.area = 0.0
        self.last_t = 0.0
        self.done = 0
        self.empty = np.zeros(0, dtype=np.int64)

    def _start_next(self, rank: Rank, now: float) -> None:
        lv = self.live[rank.queue.popleft()]
        heapq.heappush(self.events, (now + self.rp._start(rank, lv, self.seen, self.res), self.seq, "prefilled",
                                     rank.index))
        self.seq += 1

    def arrive(self, now: float, i: int) -> None:
        ps, bt = self.cfg.page_size, self.rp.trace.block_tokens
        req = self.rp.trace.requests[i]
        keys = page_keys(req.hash_ids, req.prompt_len, ps, bt)
        lv = _Live(req, now, self.empty, keys)  # type: ignore[arg-type]
        self.live[req.id] = lv
        self.in_flight += 1
        lv.rank = self.router.route(RouteRequest(req.id, req.session, keys, req.prompt_len, ps, now), self.ranks)
        rank = self.ranks[lv.rank]
        rank.queue.append(req.id)
        if not rank.busy:
            self._start_next(rank, now)

    def prefilled(self, now: float, index: int) -> None:
        rank = self.ranks[index]
        lv = self.live.pop(rank.current)
        self.router.on_finish(lv.req.id)
        self.ttft.append(now - lv.ready_s)
        self.rp._write(rank, lv.ctx_keys, lv.computed_from, len(lv.ctx_keys), self.seen)
        self.in_flight -= 1
        self.done += 1
        if self.rp.progress is not None:
            self.rp.progress(self.done)
        rank.busy = False
        if rank.queue:
            self._start_next(rank, now)

    def result(self, wall_s: float) -> RunResult:
        return finish_result(self.res, self.ttft, self.last_t, self.area, wall_s)
