"""``umbp replay`` of a Mooncake-format trace through real pool processes (etcd, metaserver, a node on 127.0.0.1):
the format is detected, and the block hits with and without the pool are the ones computed by hand in
tests/unit/test_workload_mooncake.py, the pool's pages read back byte for byte.
"""

from __future__ import annotations

import json

# The trace of tests/unit/test_workload_mooncake.py (the ceiling is worked out there): 10 of its 20 blocks.
ROWS = [(0, 1536, [1, 2, 3]), (10_000, 2000, [1, 2, 3, 4]), (20_000, 1100, [1, 2, 5]), (30_000, 1024, [7, 8]),
        (40_000, 2560, [1, 2, 3, 4, 9]), (50_000, 1025, [7, 8, 10])]
CEILING_BLOCKS = 10


def lines():
    return [json.dumps({"timestamp": t, "input_length": n, "output_length": 7, "hash_ids": ids}) for t, n, ids in ROWS]


def test_umbp_replay_of_a_mooncake_trace_hits_the_hand_computed_ceiling(cluster, tmp_path):
    path = tmp_path / "mooncake.jsonl"
    path.write_text("\n".join(lines()) + "\n")
    out = tmp_path / "out"
    r = cluster.cli("replay", str(path), "--metaserver", cluster.metaserver_addr, "--routers",
                    "round-robin,affinity", "--ranks", "2", "--hbm-tokens", "512000", "--page-bytes", "4032",
                    "--out", str(out), timeout=120)
    text = " ".join(r.stdout.split())  # the console wraps long lines
    assert "Mooncake format, 6 requests" in text and "ceiling 50.0% of blocks" in text
    assert "met: block accounting exact" in text and "NOT met" not in text
    doc = json.loads((out / "results.json").read_text())
    got = {(x["router"], x["use_pool"]): (x["hbm_blocks"], x["pool_blocks"], x["recomputed_blocks"])
           for x in doc["runs"]}
    # Round-robin: rank 1 serves r1, which only the pool can give r0's pages; affinity keeps both sessions on
    # their ranks, so HBM alone reaches the ceiling and the pool adds nothing.
    assert got == {("round-robin", True): (7, 3, 10), ("round-robin", False): (7, 0, 13),
                   ("affinity", True): (10, 0, 10), ("affinity", False): (10, 0, 10)}
    for x in doc["runs"]:
        assert x["blocks"] == 20 and x["ceiling_blocks"] == CEILING_BLOCKS == 10
        assert x["pages_verified"] == x["pool_pages_read"] == x["pool_blocks"]  # 512-token pages: one per block
        assert x["pool_bytes_read"] == 4032 * x["pool_pages_read"]
    assert doc["trace"]["stats"]["ceiling_block_share"] == 0.5 and doc["trace"]["header"]["format"] == "mooncake"
    for png in ("shares.png", "ttft.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
