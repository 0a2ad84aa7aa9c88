"""Replay logic against the in-process pool double (``MemoryPool``): token accounting, what HBM and the pool serve
in cases where the exact answer is known, byte verification, the concurrency mechanism; plus the HBM cache and
the cost model on their own. The same replay against real pool processes is tests/test_workload_pool.py.
"""

from __future__ import annotations

import pytest

from umbp.errors import CorruptionError
from umbp.costmodel import CostModel
from umbp.workload.generator import AgentXShape, generate
from umbp.workload.hbm import HbmCache
from umbp.workload.memorypool import MemoryPool
from umbp.workload.replay import Replay, ReplayConfig, page_payload

SMALL = AgentXShape(sessions=6, seed=2, scale=0.005, turns_mean=10, turns_min=4)


@pytest.fixture(scope="module")
def trace():
    return generate(SMALL)


def run(trace, pool=None, **kw):
    cfg = ReplayConfig(**{"ranks": 2, "hbm_pages": 64, "page_size": 16, "page_bytes": 256, "concurrency": 3, **kw})
    return Replay(trace, cfg, CostModel(), (lambda: pool) if pool is not None else None).run()


def test_hbm_cache_keeps_prefixes_and_evicts_tails():
    c = HbmCache(15)
    a = [f"a{i}" for i in range(10)]
    b = ["root"] + [f"b{i}" for i in range(9)]
    assert c.insert(a) == 0 and c.match(a) == 10
    assert c.insert(b) == 5  # the oldest pages are a's last five, never its first
    assert c.match(a) == 5 and c.match(b) == 10 and len(c) == 15
    c.insert(["root", "x"])  # touching a shared root keeps it hot
    c.insert([f"c{i}" for i in range(12)])
    assert "root" in c and c.match(a) == 0 and c.evicted == 5 + 1 + 12
    assert HbmCache(0).insert(["k"]) == 1


def test_cost_model_by_hand():
    m = CostModel(params=1e9, layers=1, attn_dim=1, gpu_tflops=1, mfu=1, load_gbps=50, kv_bytes_per_token=1000)
    assert m.compute_s(0, 1000) == pytest.approx((2e9 * 1000 + 2 * 1000 ** 2) / 1e12)
    assert m.compute_s(900, 1000) == pytest.approx((2e9 * 100 + 2 * (1000 ** 2 - 900 ** 2)) / 1e12)
    assert m.load_s(1000) == pytest.approx(1000 * 1000 / 50e9)
    assert m.prefill_s(0, 900, 1000) == pytest.approx(m.compute_s(900, 1000) + m.load_s(900))
    over = CostModel(**{**m.__dict__, "overlap": True})
    assert over.prefill_s(0, 900, 1000) == pytest.approx(max(m.compute_s(900, 1000), m.load_s(900)))
    assert m.prefill_s(10, 20, 50, scale=0.1) == pytest.approx(m.prefill_s(100, 200, 500))
    d = CostModel()  # defaults: HBM hits are free, pool loads are cheap, recompute is what costs
    assert d.prefill_s(140_000, 0, 142_000) < d.prefill_s(0, 140_000, 142_000) < d.prefill_s(0, 0, 142_000)


def test_accounting_is_exact_with_and_without_the_pool(trace):
    total = sum(r.prompt_len for r in trace)
    for pool in (MemoryPool(), None):
        for router in ("round-robin", "affinity", "least-loaded", "cache-aware"):
            r = run(trace, pool, router=router, use_pool=pool is not None)
            assert r.requests == len(trace) and r.prompt_tokens == total
            assert r.hbm_tokens + r.pool_tokens + r.recomputed_tokens == total
            assert r.recomputed_tokens >= r.requests  # the last token of every prompt is always computed
            assert r.hbm_tokens + r.pool_tokens <= r.ideal_tokens
            if pool is None:
                assert r.pool_tokens == r.pool_pages_written == r.pages_evicted == 0


def test_one_rank_with_room_for_everything_serves_the_ideal(trace):
    pool = MemoryPool()
    r = run(trace, pool, ranks=1, hbm_pages=10**6)
    # Nothing is ever evicted, so every page written before is found: HBM has all prompt pages, the pool the
    # pages holding decode output (a prefill tier never holds those in HBM).
    assert r.hbm_tokens + r.pool_tokens == r.ideal_tokens
    assert r.pool_tokens > 0 and r.hbm_tokens > 5 * r.pool_tokens
    assert r.pool_pages_read == r.pages_verified == pool.counters["hits"]
    assert r.pool_bytes_read == r.pool_pages_read * 256
    assert r.pool_pages_written == pool.counters["puts"] == len(pool._pages)
    assert r.pages_evicted == 0 and r.mean_sessions_in_flight <= 3 + 1e-9


def test_no_hbm_everything_cached_comes_from_the_pool(trace):
    r = run(trace, MemoryPool(), hbm_pages=0)
    assert r.hbm_tokens == 0 and r.pool_tokens == r.ideal_tokens


def test_pool_share_grows_with_concurrency():
    t = generate(AgentXShape(sessions=16, seed=5, scale=0.005, turns_mean=12, turns_min=6))
    low = run(t, MemoryPool(), ranks=4, hbm_pages=80, concurrency=2)
    high = run(t, MemoryPool(), ranks=4, hbm_pages=80, concurrency=12)
    assert high.share("pool") > low.share("pool") + 0.1 and high.share("hbm") < low.share("hbm") - 0.1
    # Without the pool the HBM misses are recomputed instead.
    nopool = run(t, None, ranks=4, hbm_pages=80, concurrency=12, use_pool=False)
    assert nopool.share("recomputed") > high.share("recomputed") + 0.1


def test_small_pool_evicts_and_counts_it(trace):
    pool = MemoryPool(capacity_pages=40)
    r = run(trace, pool)
    assert r.pages_evicted == pool.counters["evictions"] > 0
    assert r.hbm_tokens + r.pool_tokens + r.recomputed_tokens == r.prompt_tokens


class FlippingPool(MemoryPool):
    def batch_get_into(self, keys, outs):
        sizes = super().batch_get_into(keys, outs)
        if sizes and sizes[0] > 0:
            memoryview(outs[0]).cast("B")[7] ^= 1
        return sizes


def test_a_wrong_byte_from_the_pool_stops_the_replay(trace):
    with pytest.raises(CorruptionError, match="read back wrong bytes"):
        run(trace, FlippingPool(), hbm_pages=0)


def test_without_the_pool_the_replay_is_deterministic(trace):
    a, b = run(trace, None, use_pool=False), run(trace, None, use_pool=False)
    fields = ("hbm_tokens", "recomputed_tokens", "ttft_p50_s", "ttft_p90_s", "sim_s")
    assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]


def test_page_payload_is_a_function_of_the_key():
    p = page_payload("k1", 1000)
    assert len(p) == 1000 and p == page_payload("k1", 1000) and p != page_payload("k2", 1000)
    assert page_payload("k1", 16320)[:1000] == p
