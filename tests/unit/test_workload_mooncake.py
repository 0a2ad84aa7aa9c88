"""Mooncake FAST'25 traces: parsing and detection, 512-token blocks mapped to pages (split and merged), the
infinite-cache ceiling, and the open-loop replay against the in-process pool double, on a six-request trace whose
hits are computed by hand below. The same trace through real pool processes: tests/test_mooncake_replay.py.
"""

from __future__ import annotations

import json
import re

import pytest

from umbp.errors import ConfigError
from umbp.keys import page_key
from umbp.costmodel import CostModel
from umbp.workload.memorypool import MemoryPool
from umbp.workload.mooncake import (MooncakeReplay, ceiling_pages, detect_format, load_mooncake, mooncake_stats,
                                    page_keys, parse_lines)
from umbp.workload.replay import ReplayConfig

# Requests 10 s apart: each prefill (under a second in the cost model) ends before the next arrives.
# Hand-computed ceiling at 512-token pages (a prefill may use at most (input - 1) // 512 cached pages; a request
# stores its input // 512 full pages):
#   r0 [1,2,3]     1536 tokens: nothing before                                  -> 0
#   r1 [1,2,3,4]   2000 tokens: cap 3, r0 stored 1,2,3                          -> 3  (block 4 is partial: not stored)
#   r2 [1,2,5]     1100 tokens: cap 2, 1,2 stored                               -> 2
#   r3 [7,8]       1024 tokens: nothing before with block 7                     -> 0  (stores 2 pages, uses at most 1)
#   r4 [1,2,3,4,9] 2560 tokens: cap 4, but 4 was never a full page              -> 3
#   r5 [7,8,10]    1025 tokens: cap 2, r3 stored 7,8                            -> 2
# 20 blocks, ceiling 10 blocks.
ROWS = [(0, 1536, [1, 2, 3]), (10_000, 2000, [1, 2, 3, 4]), (20_000, 1100, [1, 2, 5]), (30_000, 1024, [7, 8]),
        (40_000, 2560, [1, 2, 3, 4, 9]), (50_000, 1025, [7, 8, 10])]
CEILING_512 = [0, 3, 2, 0, 3, 2]


def lines(rows=ROWS):
    return [json.dumps({"timestamp": t, "input_length": n, "output_length": 7, "hash_ids": ids}) for t, n, ids in rows]


@pytest.fixture()
def trace():
    return parse_lines(lines(), "t.jsonl")


def test_parse_and_detect(tmp_path, trace):
    assert len(trace) == 6 and trace.block_tokens == 512
    r = trace.requests[1]
    assert (r.id, r.arrival_s, r.prompt_len, r.output_len, r.hash_ids) == ("r1", 10.0, 2000, 7, (1, 2, 3, 4))
    assert [q.session for q in trace] == ["1,2", "1,2", "1,2", "7,8", "1,2", "7,8"]  # first two block ids
    p = tmp_path / "mc.jsonl"
    p.write_text("# a comment\n\n" + "\n".join(lines()) + "\n")
    assert detect_format(p) == "mooncake" and len(load_mooncake(p)) == 6
    u = tmp_path / "u.jsonl"
    u.write_text('{"id": "a", "session": "s", "append": [["x", 3]], "output": []}\n')
    assert detect_format(u) == "umbp"
    assert load_mooncake(p, session_blocks=1).requests[0].session == "1"


@pytest.mark.parametrize("line, message", [
    ('{"timestamp": 0, "input_length": 600, "output_length": 1}', "missing ['hash_ids']"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}', "1 hash_ids for 600 input"),
    ('{"timestamp": -1, "input_length": 6, "output_length": 1, "hash_ids": [1]}', "timestamp must be"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length must be"),
    ('{"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": ["a"]}', "hash_ids must be a list"),
    ('{"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": [-1]}', "hash_ids must be a list"),
    ('{"timestamp": 0, ', "not JSON"),
])
def test_bad_lines_are_named(line, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        parse_lines([line], "t.jsonl")
    assert str(e.value).startswith("trace: t.jsonl:1: ")


def test_blocks_split_into_pages_and_merge_into_pages():
    # One page per block: each key chains on the previous over [hash_id, 0].
    k0 = page_key("", [1, 0])
    assert page_keys([1, 2, 3], 1536, 512) == [k0, page_key(k0, [2, 0]), page_key(page_key(k0, [2, 0]), [3, 0])]
    # A block split into whole pages: sub-page index 0..3; a 600-token prompt has 4 full pages of 128 (block 2
    # holds 88 tokens: no full page), 9 of 64.
    split = page_keys([1, 2], 600, 128)
    assert len(split) == 4 and split[1] == page_key(split[0], [1, 1]) and len(page_keys([1, 2], 600, 64)) == 9
    # Pages merged from two blocks: the key covers both ids; no key for a page past the input.
    merged = page_keys([1, 2, 3, 4, 5], 2200, 1024)
    assert merged == [page_key("", [1, 2]), page_key(page_key("", [1, 2]), [3, 4])]
    # Shared prefixes share keys exactly up to the first differing block, at every page size.
    for pt in (64, 512, 1024):
        a, b = page_keys([1, 2, 3, 4], 2048, pt), page_keys([1, 2, 9, 4], 2048, pt)
        same = sum(1 for x, y in zip(a, b) if x == y)
        assert same == 1024 // pt and a[same:] and all(x != y for x, y in zip(a[same:], b[same:]))
    for bad in (0, 300, 700):
        with pytest.raises(ConfigError, match="must divide the 512-token block"):
            page_keys([1], 100, bad)


def test_ceiling_by_hand(trace):
    assert ceiling_pages(trace, 512) == CEILING_512
    # 256-token pages: r1 takes r0's 6 pages; r4 also takes the first half of block 4, which r1 held whole
    # (tokens 1536..1791 < 2000); blocks wholly covered stay 3.
    assert ceiling_pages(trace, 256) == [0, 6, 4, 0, 7, 4]
    # 1024-token pages (blocks 1+2, 3+4, ...): r1 and r2 may use 1 page (their cap), r4 finds (3,4) never stored.
    assert ceiling_pages(trace, 1024) == [0, 1, 1, 0, 1, 1]
    s = mooncake_stats(trace, 512)
    assert (s["blocks"], s["ceiling_blocks"], s["distinct_blocks"]) == (20, 10, 9)
    assert s["ceiling_token_share"] == pytest.approx(10 * 512 / sum(n for _, n, _ in ROWS))
    assert mooncake_stats(trace, 256)["ceiling_blocks"] == 10 and mooncake_stats(trace, 1024)["ceiling_blocks"] == 8


def replay(trace, pool=None, speed=1.0, **kw):
    cfg = ReplayConfig(**{"ranks": 2, "hbm_pages": 1000, "page_size": 512, "page_bytes": 256,
                          "router": "round-robin", "use_pool": pool is not None, **kw})
    return MooncakeReplay(trace, cfg, CostModel(), (lambda: pool) if pool is not None else None, speed=speed).run()


def test_replay_hits_by_hand(trace):
    # Round-robin over 2 ranks: r0, r2, r4 on rank 0; r1, r3, r5 on rank 1. HBM alone: r2 finds 1,2 (r0) on
    # rank 0, r4 finds 1,2,3 there, r5 finds 7,8 (r3) on rank 1; r1 would need r0's pages from rank 0.
    off = replay(trace)
    assert (off.blocks, off.hbm_blocks, off.pool_blocks, off.recomputed_blocks, off.ceiling_blocks) == (20, 7, 0, 13,
                                                                                                        10)
    assert off.concurrency == 0 and off.pool_pages_written == 0
    # With the pool r1 loads r0's three pages: HBM 7 + pool 3 = the ceiling, every pool page verified.
    pool = MemoryPool()
    on = replay(trace, pool)
    assert (on.hbm_blocks, on.pool_blocks, on.recomputed_blocks) == (7, 3, 10)
    assert on.pool_pages_read == on.pages_verified == 3 and on.pool_tokens == 3 * 512
    # Only computed full pages are written: r0 its 3, r3 its 2, r4 the 2 after its HBM hit; the rest were loaded.
    assert on.pool_pages_written == len(pool._pages) == 7
    assert on.hbm_tokens + on.pool_tokens + on.recomputed_tokens == on.prompt_tokens == sum(n for _, n, _ in ROWS)
    assert 0 < off.prefill_saved < on.prefill_saved < 1
    # No HBM: the pool serves exactly the ceiling.
    nohbm = replay(trace, MemoryPool(), hbm_pages=0)
    assert (nohbm.hbm_blocks, nohbm.pool_blocks) == (0, 10)
    # 256-token pages: the same blocks, and r4's extra half block comes as a page (tokens, not blocks).
    half = replay(trace, MemoryPool(), hbm_pages=0, page_size=256)
    assert (half.pool_blocks, half.pool_tokens) == (10, 21 * 256)


def test_speed_compresses_arrivals(trace):
    # At 1000x the six requests arrive within 50 ms, before any prefill ends: nothing is written in time, so no
    # cache serves anything although the trace-order ceiling is unchanged.
    fast = replay(trace, MemoryPool(), speed=1000.0, ranks=6)
    assert (fast.hbm_blocks, fast.pool_blocks, fast.ceiling_blocks) == (0, 0, 10)
    assert fast.sim_s < 2.0 < replay(trace).sim_s
    with pytest.raises(ConfigError, match="speed must be > 0"):
        replay(trace, speed=0)


def test_affinity_keeps_a_session_on_one_rank(trace):
    # Sessions "1,2" and "7,8": with loads under the bound, each stays on its rank, so HBM serves the ceiling.
    r = replay(trace, router="affinity", ranks=4)
    assert (r.hbm_blocks, r.recomputed_blocks) == (10, 10)
