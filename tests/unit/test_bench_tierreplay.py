"""``python bench/tierreplay.py --quick`` (the disk tier's replay bench at a tiny size: 2 nodes of 4 MiB, a trace whose
working set is 5x that, replayed against DRAM only and then DRAM + a disk of 5x DRAM a node) in `make test`, so the
bench keeps running against today's pool. Its JSON is checked for every field and the counts that must add up
(each run's tokens split into pool + HBM + recomputed, the same trace both times, the disk run's disk in STATS), and
the DRAM + disk run must serve at least as many tokens from the pool as DRAM only. Timings are never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "tierreplay.py"

RUN_FIELDS = {"label": str, "disk": bool, "dram_per_node_bytes": int, "disk_per_node_bytes": int, "pool_tokens": int,
              "hbm_tokens": int, "recomputed_tokens": int, "prompt_tokens": int, "pool_pages_read": int,
              "pool_bytes_read": int, "pool_pages_written": int, "pool_pages_dedup": int, "pages_evicted": int,
              "pages_verified": int, "requests": int, "stats": dict, "nodes": list, "wall_s": float,
              "replay_s": float, "profile": dict, "samples": list}
STATS_FIELDS = ("capacity_bytes", "used_bytes", "objects", "puts", "evictions", "demotions", "promotions",
                "disk_capacity_bytes", "disk_used_bytes")


def test_the_tier_replay_bench_quick_run_writes_every_figure_and_disk_serves_at_least_dram(tmp_path):
    out = tmp_path / "tierreplay.json"
    r = subprocess.run([sys.executable, str(BENCH), "--quick", "--disk-dir", str(tmp_path), "--json", str(out)],
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    print(r.stdout)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "pool tokens DRAM + disk / DRAM only: " in r.stdout
    doc = json.loads(out.read_text())
    assert set(doc) >= {"machine", "args", "trace", "replay", "unbounded", "runs", "ratio", "target_met", "disk_fs",
                        "o_direct", "wall_s"}
    tr = doc["trace"]
    dram_total = 2 * (4 << 20)
    assert tr["working_set_bytes"] == tr["distinct_pages"] * tr["page_extent_bytes"] == tr["distinct_pages"] * 16384
    assert 4.75 <= tr["ws_over_dram"] <= 5.25 and abs(tr["working_set_bytes"] / dram_total - tr["ws_over_dram"]) < 1e-9

    dram, tiered = doc["runs"]
    assert (dram["label"], dram["disk"], tiered["label"], tiered["disk"]) == ("dram", False, "dram+disk", True)
    prompts = doc["unbounded"]["prompt_tokens"]
    for run in (dram, tiered):
        for name, kind in RUN_FIELDS.items():
            assert type(run[name]) is kind or kind is float and type(run[name]) is int, (name, run[name])
        assert all(type(run["stats"][k]) is int for k in STATS_FIELDS), run["stats"]
        assert run["requests"] == tr["requests"] and run["prompt_tokens"] == prompts  # the same trace twice
        assert run["pool_tokens"] + run["hbm_tokens"] + run["recomputed_tokens"] == prompts
        assert run["pages_verified"] == run["pool_pages_read"]
        assert run["pool_bytes_read"] == 16320 * run["pool_pages_read"]
        assert run["pool_tokens"] == 16 * run["pool_pages_read"]  # 16 tokens a page
        assert run["stats"]["capacity_bytes"] == dram_total and len(run["nodes"]) == 2
        assert run["pool_tokens"] <= doc["unbounded"]["pool_tokens"] + run["hbm_tokens"]
    assert dram["stats"]["disk_capacity_bytes"] == 0 and dram["stats"]["demotions"] == 0
    assert dram["stats"]["evictions"] > 0  # a working set 5x DRAM: DRAM alone drops pages
    assert tiered["stats"]["disk_capacity_bytes"] == 5 * dram_total == 2 * tiered["disk_per_node_bytes"]
    assert tiered["stats"]["demotions"] > 0 and 0 < tiered["stats"]["disk_used_bytes"] <= 5 * dram_total
    assert sum(n["disk_objects"] for n in tiered["nodes"]) > 0
    assert tiered["o_direct"] is doc["o_direct"] and type(doc["o_direct"]) is bool
    assert tiered["pool_tokens"] >= dram["pool_tokens"]  # the target's direction; its 2x is the full run's to show
    assert doc["ratio"] == tiered["pool_tokens"] / dram["pool_tokens"]
