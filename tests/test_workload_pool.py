"""The main job against real pool processes (etcd, metaserver, nodes on 127.0.0.1): a small replay whose token
accounting adds up exactly and whose pool-served pages were read back byte for byte, a pool small enough to
evict, and ``umbp replay`` / ``umbp demo`` end to end (table, JSON, PNGs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cluster import child_env
from umbp.keys import chain_keys
from umbp.costmodel import CostModel
from umbp.workload.generator import AgentXShape, generate
from umbp.workload.replay import Replay, ReplayConfig, page_payload
from umbp.workload.trace import dump_trace

SMALL = AgentXShape(sessions=6, seed=2, scale=0.005, turns_mean=10, turns_min=4)
MEDIUM = AgentXShape(sessions=10, seed=3, scale=0.005, turns_mean=12, turns_min=6)  # ~550 pages of 8 tokens
PAGE_BYTES = 4096 - 64  # one 4 KiB object per page


@pytest.mark.cluster(nodes=1, capacity="1MiB", metaserver_flags={"eviction_policy": "prefix-lru"})
def test_replay_through_a_real_pool_adds_up_and_reads_back_exact_bytes(cluster):
    trace = generate(MEDIUM)
    for router in ("round-robin", "cache-aware"):
        ns = f"test-replay/{router}"
        cfg = ReplayConfig(ranks=2, hbm_pages=48, page_size=8, page_bytes=PAGE_BYTES, concurrency=3, router=router)
        r = Replay(trace, cfg, CostModel(), lambda ns=ns: cluster.client(namespace=ns)).run()
        assert r.requests == len(trace) and r.prompt_tokens == sum(q.prompt_len for q in trace)
        assert r.hbm_tokens + r.pool_tokens + r.recomputed_tokens == r.prompt_tokens
        assert r.pool_tokens == r.pool_pages_read * 8 > 0  # pool pages are full pages of 8 tokens
        assert r.pages_verified == r.pool_pages_read  # every page the pool served was compared byte for byte
        assert r.pool_bytes_read == r.pool_pages_read * PAGE_BYTES
        assert r.pool_pages_written > 0 and r.pool_bytes_written == r.pool_pages_written * PAGE_BYTES
        # 1 MiB holds 255 pages; the trace writes more: the pool evicted, and the replay counted it.
        assert r.pool_pages_written > 400 and r.pages_evicted > 0
        assert r.pool_nodes and r.pool_nodes[0]["used_bytes"] <= r.pool_nodes[0]["capacity_bytes"]
        # Independently of the replay: the pages of the last session still in the pool, read with a fresh client,
        # hold exactly the bytes derived from their keys.
        last = [q for q in trace if q.session == trace.requests[-1].session]
        keys = sorted({k for q in last for k in chain_keys(trace.context_tokens(q).tolist(), 8)})
        with cluster.client(namespace=ns) as c:
            got = {k: c.get(k) for k in keys}
        present = {k: v for k, v in got.items() if v is not None}
        assert len(present) >= 10
        assert all(v == page_payload(k, PAGE_BYTES) for k, v in present.items())


def test_umbp_replay_cli_against_a_running_pool(cluster, tmp_path):
    trace_path = tmp_path / "trace.jsonl"
    dump_trace(generate(SMALL), trace_path)
    out = tmp_path / "out"
    r = cluster.cli("replay", str(trace_path), "--metaserver", cluster.metaserver_addr, "--pool", "both",
                    "--concurrency", "1,3", "--routers", "round-robin,least-loaded", "--ranks", "2",
                    "--hbm-pages", "24", "--page-bytes", str(PAGE_BYTES), "--out", str(out), timeout=120)
    assert "recomp" in r.stdout and "least-loaded" in r.stdout and "met: token accounting exact" in r.stdout
    doc = json.loads((out / "results.json").read_text())
    assert len(doc["runs"]) == 2 * 2 * 2
    for run in doc["runs"]:
        assert run["hbm_tokens"] + run["pool_tokens"] + run["recomputed_tokens"] == run["prompt_tokens"]
        assert (run["pool_tokens"] > 0) == run["use_pool"]
    assert {t["target"].split(":")[0] for t in doc["targets"]} >= {"round-robin with the pool"}
    assert doc["cost_model"]["load_gbps"] == 50.0 and doc["trace"]["stats"]["sessions"] == 6
    for png in ("shares.png", "ttft.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_umbp_demo_starts_its_own_pool(etcd_binary, tmp_path):
    out = tmp_path / "demo"
    argv = [sys.executable, "-m", "umbp", "demo", "--sessions", "3", "--scale", "0.004", "--concurrency", "1,2",
            "--hbm-pages", "16", "--pool-pages", "300", "--page-bytes", str(PAGE_BYTES), "--out", str(out)]
    path = f"{os.path.dirname(etcd_binary)}:{os.environ.get('PATH', '')}"  # the demo finds etcd on PATH
    r = subprocess.run(argv, env=child_env({"PATH": path}), capture_output=True, text=True, timeout=180,
                       stdin=subprocess.DEVNULL, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "starting a local pool" in r.stdout and "token accounting exact" in r.stdout
    doc = json.loads((out / "results.json").read_text())
    assert [(x["router"], x["use_pool"]) for x in doc["runs"][:4]] == [
        ("round-robin", True), ("round-robin", False), ("affinity", True), ("affinity", False)]
    assert (out / "trace.jsonl").stat().st_size > 0 and (out / "shares.png").stat().st_size > 0
