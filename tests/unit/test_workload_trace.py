"""Traces: the generator's statistics against the AgentX shape, fork structure, JSONL round trip, loader errors,
and the token expansion that makes page keys stable.

No pool needed: everything here is in-process and runs in about a second.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from umbp.errors import ConfigError
from umbp.keys import chain_keys
from umbp.workload.generator import AgentXShape, generate
from umbp.workload.trace import (FORMAT, Trace, dump_trace, expand_items, load_trace, parse_lines, run_tokens,
                                 trace_stats)

M64 = (1 << 64) - 1


def splitmix_reference(run_id: str, n: int, vocab: int) -> list[int]:
    """The expansion rule written out in plain Python integers: the spec ``run_tokens`` must match forever."""
    x = int.from_bytes(hashlib.sha256(b"umbp-run\0" + run_id.encode()).digest()[:8], "little")
    out = []
    for i in range(1, n + 1):
        z = (x + i * 0x9E3779B97F4A7C15) & M64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        out.append((z ^ (z >> 31)) % vocab)
    return out


def test_run_tokens_match_the_reference_and_are_stable():
    for run_id, n, vocab in (("system", 64, 128_256), ("s3/t7/in", 33, 1000), ("", 5, 7)):
        assert run_tokens(run_id, n, vocab).tolist() == splitmix_reference(run_id, n, vocab)
    # Pinned values: changing the expansion would silently change every page key of every stored trace.
    assert run_tokens("system", 8).tolist() == [106889, 85347, 63378, 88143, 84826, 103021, 108426, 95754]
    assert chain_keys(run_tokens("system", 8).tolist(), 4)[1] == \
        "74ac726ee23eec9efa7bb48f85ff54ce1663becfa326a281a4ef64f2262853a4"
    # A run is a prefix of a longer run with the same id, and literals pass through.
    assert run_tokens("x", 10).tolist()[:4] == run_tokens("x", 4).tolist()
    assert expand_items([("x", 2), 7, 9, ("y", 1)]).tolist() == run_tokens("x", 2).tolist() + [7, 9] + \
        run_tokens("y", 1).tolist()


@pytest.fixture(scope="module")
def big() -> Trace:
    return generate(AgentXShape(sessions=300, seed=7, scale=0.01))


def test_generator_matches_the_agentx_shape(big):
    s = trace_stats(big)
    assert s["sessions"] == 300
    assert 43 * 0.9 <= s["turns_per_session_mean"] <= 43 * 1.1
    assert 142_000 * 0.85 <= s["prompt_tokens_median"] <= 142_000 * 1.15
    assert 444 * 0.8 <= s["output_tokens_median"] <= 444 * 1.2
    # Over 96% of each prompt is the previous turn's context: token weighted and turn by turn.
    assert s["prefix_share"] > 0.96
    assert s["prefix_share_p05"] >= 0.96 - 1e-3
    # Every continuing turn (same session) keeps its parent's whole context.
    for r in big:
        if r.parent is not None and not r.is_fork:
            p = big.by_id[r.parent]
            assert r.reuse == p.context_len and r.turn == p.turn + 1 and p.session == r.session
            assert r.reuse / r.prompt_len >= 0.96 - 1e-3 or r.after  # waits for subagents: their results count


def test_generator_fork_structure(big):
    forks = [r for r in big if r.is_fork]
    assert len(forks) > 50
    by_spawner: dict[str, list] = {}
    for r in forks:
        p = big.by_id[r.parent]
        assert r.turn == 1 and r.root == p.root and r.session.startswith(p.id + "/")
        assert r.reuse == p.context_len  # the subagent starts from the spawner's whole context ...
        by_spawner.setdefault(p.id, []).append(r)
    for spawner_id, subs in by_spawner.items():
        assert 1 <= len(subs) <= 3
        assert len({s.reuse for s in subs}) == 1  # ... which its siblings share
        spawner = big.by_id[spawner_id]
        nxt = [r for r in big if r.parent == spawner_id and not r.is_fork]
        assert len(nxt) == 1 and set(nxt[0].after) == {s.session for s in subs}  # the join
        assert nxt[0].prompt_len > spawner.context_len
    # The shared prefix is real: siblings' first prompts have identical keys for the whole shared part.
    spawner_id, subs = next((k, v) for k, v in by_spawner.items() if len(v) >= 2)
    a, b = (big.prompt_tokens(s) for s in subs[:2])
    n = subs[0].reuse
    assert np.array_equal(a[:n], b[:n]) and not np.array_equal(a, b)
    assert chain_keys(a[:n].tolist(), 16) == chain_keys(b[:n].tolist(), 16)


def test_generator_sessions_arrive_over_time_and_share_a_system_prompt(big):
    firsts = [big.by_id[f"s{i}/t1"] for i in range(300)]
    arrivals = [r.arrival_s for r in firsts]
    assert arrivals == sorted(arrivals) and arrivals[-1] > arrivals[0] + 100
    assert big.roots()[:3] == ["s0", "s1", "s2"]
    assert all(r.append[0][0] == "system" for r in firsts)
    k0 = chain_keys(big.prompt_tokens(firsts[0]).tolist(), 16)
    k1 = chain_keys(big.prompt_tokens(firsts[1]).tolist(), 16)
    shared = firsts[0].append[0][1] // 16
    assert k0[:shared] == k1[:shared] and k0[-1] != k1[-1]


def test_generator_is_deterministic_and_scales(tmp_path):
    a, b = generate(AgentXShape(sessions=5, seed=3)), generate(AgentXShape(sessions=5, seed=3))
    dump_trace(a, tmp_path / "a.jsonl")
    dump_trace(b, tmp_path / "b.jsonl")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    c = generate(AgentXShape(sessions=5, seed=4))
    assert [r.prompt_len for r in c] != [r.prompt_len for r in a]
    full = generate(AgentXShape(sessions=5, seed=3, scale=1.0))
    ratio = sum(r.prompt_len for r in full) / sum(r.prompt_len for r in a)
    assert 95 <= ratio <= 105


def test_jsonl_round_trip(tmp_path):
    t = generate(AgentXShape(sessions=6, seed=1))
    path = tmp_path / "t.jsonl"
    dump_trace(t, path)
    size = path.stat().st_size
    assert size < 400 * len(t)  # runs, not token lists: a few hundred bytes per request
    u = load_trace(path)
    assert u.header["format"] == FORMAT and u.scale == t.scale
    assert [r.to_json() for r in u] == [r.to_json() for r in t]
    assert [(r.prompt_len, r.output_len, r.is_fork) for r in u] == [(r.prompt_len, r.output_len, r.is_fork) for r in t]
    last = t.requests[-1]
    assert np.array_equal(u.context_tokens(u.by_id[last.id]), t.context_tokens(last))


def test_loader_accepts_literal_ids_and_defaults():
    lines = ['# a hand-written trace', '',
             json.dumps({"id": "a1", "session": "a", "append": [1, 2, 3, ["sys", 5]], "output": [9]}),
             json.dumps({"id": "a2", "session": "a", "turn": 2, "parent": "a1", "append": [4]})]
    t = parse_lines(lines)
    a1, a2 = t.requests
    assert (a1.prompt_len, a1.output_len, a2.reuse, a2.prompt_len) == (8, 1, 9, 10)
    assert t.prompt_tokens(a2).tolist() == [1, 2, 3] + run_tokens("sys", 5).tolist() + [9, 4]
    assert t.scale == 1.0 and a1.root == "a" and not a2.is_fork


@pytest.mark.parametrize("lines, message", [
    (['{"id": "x", "session": "s", "parent": "nope", "append": [1]}'], "not defined before it"),
    (['{"id": "x", "session": "s", "append": [1]}', '{"id": "x", "session": "s", "append": [1]}'], "duplicate"),
    (['{"id": "x", "session": "s", "append": [1]}', '{"id": "y", "session": "s", "parent": "x", "reuse": 5}'],
     "exceeds the parent"),
    (['{"id": "x", "session": "s", "append": [["r", -1]]}'], "neither a token id nor a run"),
    (['{"id": "x", "session": "s", "append": [200000]}'], "outside"),
    (['{"id": "x", "session": "s", "append": []}'], "empty prompt"),
    (['{"id": "x", "session": "s", "append": [1], "colour": 1}'], "unknown fields"),
    (['{"id": "x", "session": "s", "append": [1], "after": ["ghost"]}'], "no earlier request"),
    (['not json'], "not JSON"),
    (['{"format": "other/9"}'], "format"),
    ([], "no requests"),
])
def test_loader_rejects_bad_traces(lines, message):
    with pytest.raises(ConfigError, match=message) as e:
        parse_lines(lines)
    assert str(e.value).startswith("trace: ")
