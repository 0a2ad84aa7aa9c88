"""DP routers: which data-parallel rank serves a request. Round-robin, session affinity, least-loaded, cache-aware,
and pool-prefix (the rank whose pool holds most of the prompt, from KV events).

One small interface, usable from an engine's router process::

    router = make_router("cache-aware", ranks=8, pool=umbp.Client(...), page_size=64)
    rank = router.route(RouteRequest(id, session, keys, prompt_tokens, page_size), rank_views)
    ...                                       # the rank runs the prefill
    router.on_finish(id)                      # the rank is done with it

``keys`` are the prompt's chained page keys (``umbp.keys.chain_keys``, identical to SGLang's), so the router, the
ranks and the pool name the same pages. A router keeps its own count of requests in flight per rank (``route``
adds, ``on_finish`` removes), so it needs nothing from the ranks except, for the cache-aware router, how many
leading pages of a prompt each rank's HBM holds (``RankView.hbm_prefix_pages``: the engine's radix cache answers
it, or the router's own approximation of it).

- ``round-robin``: rank ``i mod n`` for the i-th request. Best balance, no locality. With a shared pool every
  rank can load what another rank computed, which is what makes it viable.
- ``affinity``: consistent hashing of the session id over a ring of ``vnodes`` points per rank, with bounded
  loads (Mirrokni, Thorup, Zadimoghaddam 2018): a rank holding ``ceil(load_factor * (in_flight + 1) / n)``
  requests or more is skipped and the walk goes on clockwise. A session stays on one rank while loads are even.
- ``least-loaded``: fewest requests in flight, then fewest prompt tokens in flight, then lowest index.
- ``pool-prefix`` (``PoolPrefix``, built with an index of KV events: ``umbp.kvindex``): the rank whose own pool
  holds the longest prefix of the prompt's pages, ties to the least loaded.
- ``cache-aware``: for each rank, the pages its HBM can serve, then the pages the pool can serve after those
  (``pool.prefix_hits`` over the remaining keys, asked once per distinct HBM match), priced with the cost model
  (``umbp.costmodel``) plus the rank's backlog (the estimated prefill seconds of what it has in flight);
  the cheapest rank wins. So the rank holding the prefix wins unless its backlog outweighs what it saves.

Contract of ``route``: returns an index in ``range(n)`` and counts the request in flight there until
``on_finish(id)``; routing the same id twice before it finishes raises ``InvalidArgument`` (``ConfigError`` is
for a router's settings, at construction). Cost: round-robin, least-loaded O(n); affinity O(log(n * vnodes)) to
find the session's point plus a clockwise walk of at most one lap, n * vnodes points (a handful while loads are
even: the first rank under its bound wins); cache-aware O(n * matched pages) plus one pool round trip per distinct
HBM match length.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from umbp.costmodel import CostModel
from umbp.errors import ConfigError, InvalidArgument


@dataclass(frozen=True)
class RouteRequest:
    id: str
    session: str
    keys: Sequence[str]  # chained keys of the prompt's full pages
    prompt_tokens: int
    page_size: int
    now: float = 0.0

    @property
    def cacheable_pages(self) -> int:
        """Pages a cache may serve: the last prompt token is always computed (it produces the first logits)."""
        return min(len(self.keys), max(0, self.prompt_tokens - 1) // self.page_size)


class RankView(Protocol):
    def hbm_prefix_pages(self, keys: Sequence[str]) -> int:
        """How many leading pages of ``keys`` this rank's HBM holds (no side effects)."""
        ...


class Router:
    """Base: in-flight bookkeeping. Subclasses implement ``_choose``."""

    name = "router"

    def __init__(self, ranks: int):
        if ranks < 1:
            raise ConfigError("routing", f"need at least one rank, got {ranks}")
        self.n = ranks
        self.inflight = [0] * ranks
        self.inflight_tokens = [0] * ranks
        self._routed: dict[str, tuple[int, int]] = {}

    def route(self, req: RouteRequest, ranks: Sequence[RankView] = ()) -> int:
        if req.id in self._routed:
            raise InvalidArgument("routing", f"request {req.id!r} routed twice before finishing")
        r = self._choose(req, ranks)
        if not 0 <= r < self.n:
            raise InvalidArgument("routing", f"{self.name} chose rank {r} of {self.n}")
        self.inflight[r] += 1
        self.inflight_tokens[r] += req.prompt_tokens
        self._routed[req.id] = (r, req.prompt_tokens)
        return r

    def on_finish(self, req_id: str) -> None:
        r, tokens = self._routed.pop(req_id)
        self.inflight[r] -= 1
        self.inflight_tokens[r] -= tokens
        self._finished(req_id, r)

    def _choose(self, req: RouteRequest, ranks: Sequence[RankView]) -> int:
        raise NotImplementedError

    def _finished(self, req_id: str, rank: int) -> None:
        pass


class RoundRobin(Router):
    name = "round-robin"

    def __init__(self, ranks: int):
        super().__init__(ranks)
        self._next = 0

    def _choose(self, req, ranks) -> int:
        r = self._next
        self._next = (r + 1) % self.n
        return r


def _h64(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


class SessionAffinity(Router):
    name = "affinity"

    def __init__(self, ranks: int, vnodes: int = 64, load_factor: float = 1.25):
        super().__init__(ranks)
        if vnodes < 1 or load_factor < 1:
            raise ConfigError("routing", "affinity: vnodes must be >= 1 and load_factor >= 1")
        self.load_factor = load_factor
        ring = sorted((_h64(f"rank{r}#{v}"), r) for r in range(ranks) for v in range(vnodes))
        self._points = [p for p, _ in ring]
        self._owners = [r for _, r in ring]

    def bound(self) -> int:
        return math.ceil(self.load_factor * (sum(self.inflight) + 1) / self.n)

    def _choose(self, req, ranks) -> int:
        bound = self.bound()
        i = bisect.bisect(self._points, _h64(req.session))
        seen: set[int] = set()
        for step in range(len(self._points)):  # at most one lap; ends once every rank was looked at
            r = self._owners[(i + step) % len(self._points)]
            if r in seen:
                continue
            if self.inflight[r] < bound:
                return r
            seen.add(r)
            if len(seen) == self.n:
                break
        return min(range(self.n), key=lambda r: (self.inflight[r], r))  # unreachable: some rank is under bound


class LeastLoaded(Router):
    name = "least-loaded"

    def _choose(self, req, ranks) -> int:
        return min(range(self.n), key=lambda r: (self.inflight[r], self.inflight_tokens[r], r))


class CacheAware(Router):
    name = "cache-aware"

    def __init__(self, ranks: int, cost: Any = None, pool: Any = None, scale: float = 1.0):
        super().__init__(ranks)
        self.cost = CostModel() if cost is None else cost
        self.pool = pool  # anything with prefix_hits(keys) -> int (umbp.Client); None: HBM only
        self.scale = scale
        self.backlog_s = [0.0] * ranks
        self._estimate: dict[str, float] = {}
        self.pool_queries = 0

    def estimates(self, req: RouteRequest, ranks: Sequence[RankView]) -> list[tuple[float, int, int]]:
        """Per rank: (estimated seconds until its prefill of ``req`` ends, HBM pages, pool pages)."""
        if len(ranks) != self.n:
            raise InvalidArgument("routing", f"cache-aware needs a view of each of the {self.n} ranks, "
                                             f"got {len(ranks)}")
        cap = req.cacheable_pages
        keys = req.keys[:cap]
        pool_after: dict[int, int] = {}
        out = []
        ps = req.page_size
        for r, view in enumerate(ranks):
            h = min(cap, view.hbm_prefix_pages(keys))
            if self.pool is not None and h not in pool_after:
                pool_after[h] = self.pool.prefix_hits(keys[h:]) if h < cap else 0
                self.pool_queries += 1
            p = pool_after.get(h, 0)
            est = self.cost.prefill_s(h * ps, p * ps, req.prompt_tokens, self.scale)
            out.append((self.backlog_s[r] + est, h, p))
        return out

    def _choose(self, req, ranks) -> int:
        est = self.estimates(req, ranks)
        r = min(range(self.n), key=lambda i: (est[i][0], self.inflight[i], i))
        own = est[r][0] - self.backlog_s[r]
        self.backlog_s[r] += own
        self._estimate[req.id] = own
        return r

    def _finished(self, req_id: str, rank: int) -> None:
        self.backlog_s[rank] = max(0.0, self.backlog_s[rank] - self._estimate.pop(req_id, 0.0))


class PoolPrefix(Router):
    """The rank whose pool holds the longest prefix of the prompt's pages, as KV events told it
    (``index``: a ``umbp.kvindex.BlockIndex`` fed by a subscription per metaserver, ``sources[r]`` the label of
    rank r's pool in it, or a tuple of labels for a pool of several metaservers); ties (no pool holds anything:
    a new prompt) go to the fewest requests in flight, then the lowest index. Not in ``ROUTERS``: it needs the
    index, so an engine's router process builds it."""

    name = "pool-prefix"

    def __init__(self, ranks: int, index: Any, sources: Sequence[Any]):
        super().__init__(ranks)
        if len(sources) != ranks:
            raise ConfigError("routing", f"pool-prefix needs a source per rank: {ranks} ranks, {len(sources)} sources")
        self.index = index
        self.sources = list(sources)

    def prefixes(self, req: RouteRequest) -> list[int]:
        keys = req.keys[:req.cacheable_pages]
        return [self.index.prefix(s, keys) for s in self.sources]

    def _choose(self, req, ranks) -> int:
        p = self.prefixes(req)
        return min(range(self.n), key=lambda r: (-p[r], self.inflight[r], r))


ROUTERS = {c.name: c for c in (RoundRobin, SessionAffinity, LeastLoaded, CacheAware)}


def make_router(name: str, ranks: int, **kw: Any) -> Router:
    """A router by name; keyword arguments a router does not take are ignored (so callers can pass one set)."""
    cls = ROUTERS.get(name)
    if cls is None:
        raise ConfigError("routing", f"unknown router {name!r}; choose from {', '.join(ROUTERS)}")
    if cls is CacheAware:
        return CacheAware(ranks, **{k: v for k, v in kw.items() if k in ("cost", "pool", "scale")})
    if cls is SessionAffinity:
        return SessionAffinity(ranks, **{k: v for k, v in kw.items() if k in ("vnodes", "load_factor")})
    return cls(ranks)
