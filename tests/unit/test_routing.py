"""Router contracts (``umbp.routing``): round-robin cycles, affinity is stable and bounded, least-loaded picks the
least loaded, cache-aware prefers the rank holding the prefix unless its backlog outweighs it.

Rank views and the pool are small fakes: a router needs only ``hbm_prefix_pages`` and ``prefix_hits``.
"""

from __future__ import annotations

import math

import pytest

from umbp.errors import ConfigError, InvalidArgument
from umbp.keys import chain_keys
from umbp.routing import (ROUTERS, CacheAware, LeastLoaded, RoundRobin, RouteRequest, SessionAffinity,
                          make_router)
from umbp.costmodel import CostModel

PS = 16
KEYS = chain_keys(list(range(100 * PS)), PS)  # a 100-page prompt


class View:
    def __init__(self, pages: int):
        self.pages = pages

    def hbm_prefix_pages(self, keys):
        return min(self.pages, len(keys))


class Pool:
    def __init__(self, present: set[str]):
        self.present = present
        self.calls = 0

    def prefix_hits(self, keys):
        self.calls += 1
        n = 0
        for k in keys:
            if k not in self.present:
                break
            n += 1
        return n


def req(i: int, session: str = "", keys=KEYS, tokens: int = 100 * PS + 5) -> RouteRequest:
    return RouteRequest(f"r{i}", session or f"s{i}", keys, tokens, PS)


def test_round_robin_cycles_and_counts_in_flight():
    r = RoundRobin(3)
    assert [r.route(req(i)) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert r.inflight == [3, 2, 2]
    r.on_finish("r0")
    r.on_finish("r1")
    assert r.inflight == [2, 1, 2] and sum(r.inflight_tokens) == 5 * (100 * PS + 5)
    with pytest.raises(InvalidArgument, match="routing: request .* routed twice"):
        r.route(req(2))
    with pytest.raises(KeyError):
        r.on_finish("never-routed")


def home(session: str, ranks: int = 4) -> int:
    """Where a session goes with nothing in flight: its first request on a fresh router (a fresh ring, as in
    another process)."""
    return SessionAffinity(ranks).route(req(0, session))


def test_affinity_is_stable_spreads_sessions_and_is_bounded():
    r = SessionAffinity(4)
    homes = {}
    for i in range(400):  # one request at a time: loads stay even, every session goes home, every time
        s = f"session-{i % 100}"
        rank = r.route(req(i, s))
        assert rank == home(s)
        homes.setdefault(s, set()).add(rank)
        r.on_finish(f"r{i}")
    assert all(len(v) == 1 for v in homes.values())
    spread = [sum(1 for v in homes.values() if rank in v) for rank in range(4)]
    assert min(spread) >= 10  # 64 virtual nodes per rank: no rank starves
    # Same ring in a fresh router (another process): same homes.
    assert all(home(s) == next(iter(v)) for s, v in homes.items())
    # Bounded load: one hot session with many requests in flight spills over, never above the bound.
    b = SessionAffinity(4, load_factor=1.25)
    for i in range(40):
        bound = b.bound()
        rank = b.route(req(1000 + i, "hot"))
        assert b.inflight[rank] <= bound
    assert max(b.inflight) <= math.ceil(1.25 * 40 / 4)
    assert b.inflight[home("hot")] == max(b.inflight)


def test_least_loaded_picks_the_least_loaded():
    r = LeastLoaded(3)
    assert [r.route(req(i)) for i in range(3)] == [0, 1, 2]
    r.on_finish("r1")
    assert r.route(req(3)) == 1  # the only rank with nothing in flight
    r.on_finish("r0")
    assert r.route(req(4, tokens=10)) == 0
    r.on_finish("r2")
    assert r.route(req(5)) == 2
    # One request in flight everywhere: fewest prompt tokens in flight wins (rank 0 holds a 10-token prompt).
    assert r.inflight == [1, 1, 1] and r.route(req(6)) == 0


def test_cache_aware_prefers_the_rank_with_the_prefix():
    views = [View(0), View(90), View(10), View(0)]
    r = CacheAware(4, cost=CostModel(), pool=None, scale=0.01)
    assert r.route(req(0), views) == 1
    est = r.estimates(req(99), views)
    assert [e[1] for e in est] == [0, 90, 10, 0]
    assert est[1][0] < est[2][0] < est[0][0]


def test_cache_aware_counts_the_pool_and_asks_it_once_per_match_length():
    views = [View(0), View(0), View(20), View(0)]
    pool = Pool(set(KEYS[:80]))
    r = CacheAware(4, cost=CostModel(), pool=pool, scale=0.01)
    est = r.estimates(req(0), views)
    assert [(e[1], e[2]) for e in est] == [(0, 80), (0, 80), (20, 60), (0, 80)]
    assert pool.calls == 2  # HBM match 0 and HBM match 20
    assert r.route(req(1), views) == 2  # HBM is free, the pool costs load time: the rank with HBM pages wins
    # With everything in the pool, a rank with nothing in HBM is close behind: the pool makes ranks equivalent.
    assert est[0][0] - est[2][0] < 0.05 * est[0][0] + 1.0


def test_cache_aware_trades_the_prefix_against_backlog():
    views = [View(99), View(0)]
    r = CacheAware(2, cost=CostModel(), pool=None, scale=0.01)
    (warm, _, _), (cold, _, _) = r.estimates(req(0), views)
    assert 0 < warm < cold
    picks = []
    for i in range(500):  # bounded: the spill comes after about cold / warm requests
        picks.append(r.route(req(i), views))
        if picks[-1] == 1:
            break
    # The cached rank takes everything until its backlog plus one more cached prefill costs more than a full
    # recompute on the idle rank; then (and only then) the idle rank gets the request.
    n = len(picks) - 1
    assert picks[:n] == [0] * n and picks[n] == 1
    assert n == math.ceil(cold / warm - 1) or n == math.floor(cold / warm)
    assert r.backlog_s[0] == pytest.approx(n * warm) and r.backlog_s[1] == pytest.approx(cold)
    for i in range(n + 1):
        r.on_finish(f"r{i}")
    assert r.backlog_s == [0.0, 0.0] and r.inflight == [0, 0]


def test_make_router_names():
    assert set(ROUTERS) == {"round-robin", "affinity", "least-loaded", "cache-aware"}
    for name in ROUTERS:
        assert make_router(name, 2, pool=None, cost=CostModel(), scale=1.0, load_factor=1.5).name == name
    with pytest.raises(ConfigError, match="unknown router"):
        make_router("random", 2)
    with pytest.raises(ConfigError):
        RoundRobin(0)
