"""``python bench/slots.py --quick`` (the fair capacity bench at a tiny size: 1 process unpartitioned, 1 process of 4
slots, 2 processes of 4 slots; 16- and 128-key requests) in `make test`, so the bench keeps running against today's
wire and pool. Its JSON is checked for every field, their types and the counts that must add up (every key asked
committed, every key looked up found, requests and parts as the shapes give them); its speed figures are never
asserted."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "slots.py"

RUN_FIELDS = {"processes": int, "slots": int, "op": str, "batch": int, "clients": int, "window": int,
              "batches": int, "requests": int, "parts": int, "keys": int, "committed": int, "found": int,
              "not_new": int, "wall_s": float, "keys_per_s": float, "metaserver_cpu_s": list, "busy": list,
              "busy_ok": bool, "keys_per_cpu_s": float, "etcd_cpu_s": float, "client_cpu_s": float,
              "machine_busy_cores": float, "budget_hit": bool}
FIT_FIELDS = ("a_us_per_request", "b_us_per_part", "c_us_per_key", "residual_rms_s", "residual_rel")


def test_the_slots_bench_quick_run_writes_every_figure_and_its_counts_add_up(tmp_path):
    out = tmp_path / "slots.json"
    r = subprocess.run([sys.executable, str(BENCH), "--quick", "--json", str(out)], capture_output=True, text=True,
                       timeout=300, stdin=subprocess.DEVNULL)
    print(r.stdout)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "LOOKUP+RELEASE: metaserver CPU = " in r.stdout and "ALLOC+COMMIT: metaserver CPU = " in r.stdout
    doc = json.loads(out.read_text())
    assert set(doc) >= {"machine", "args", "runs", "fit", "headline", "warnings"}
    assert type(doc["machine"]["cores"]) is int and doc["machine"]["cores"] >= 1

    runs = doc["runs"]
    shapes = {(1, 1), (1, 4), (2, 4)}
    assert {(x["processes"], x["slots"], x["batch"], x["op"]) for x in runs} == {
        (p, s, b, op) for p, s in shapes for b in (16, 128) for op in ("put", "lookup")}
    assert len(runs) == 12
    for x in runs:
        for name, kind in RUN_FIELDS.items():
            assert type(x[name]) is kind or kind is float and type(x[name]) is int, (name, x)
        what = (x["processes"], x["slots"], x["op"], x["batch"])
        assert x["clients"] == 2 and x["window"] == 4
        assert x["batches"] >= 1 and x["keys"] == x["batches"] * x["batch"], what
        # one request per process a batch touches; one part per slot a request touches
        assert x["batches"] <= x["requests"] <= x["batches"] * x["processes"], what
        assert x["requests"] <= x["parts"] <= x["keys"], what
        if x["slots"] == 1:
            assert x["parts"] == x["requests"] == x["batches"], what
        assert len(x["metaserver_cpu_s"]) == len(x["busy"]) == x["processes"], what
        assert all(c >= 0 for c in x["metaserver_cpu_s"]) and sum(x["metaserver_cpu_s"]) > 0, what
        assert all(0 <= b for b in x["busy"]) and x["wall_s"] > 0 and x["keys_per_s"] > 0, what
        if x["op"] == "put":
            assert x["committed"] == x["keys"] and x["not_new"] == 0 and x["found"] == 0, what
            assert type(x["etcd_us_per_page"]) is float and x["etcd_us_per_page"] > 0, what
        else:
            assert x["found"] == x["keys"] and x["committed"] == 0, what  # every key looked up was committed
            # every read lease released: by a later LOOKUP that carried it (the metaserver's count), or at the end
            assert x["leases"] >= x["requests"] and x["released"] + x["flushed"] == x["leases"], what
            assert x["released"] > 0, what
            assert x["etcd_us_per_page"] is None, what

    for op in ("lookup", "put"):
        f = doc["fit"][op]
        assert f["points"] == 6 and 1 <= f["rank"] <= 3
        assert all(type(f[k]) is float and math.isfinite(f[k]) for k in FIT_FIELDS), f

    (h,) = doc["headline"]
    assert (h["processes"], h["slots"], h["batch"]) == (2, 4, 128) and h["baseline"] == {"processes": 1, "slots": 1}
    assert all(type(h[k]) is float and h[k] > 0 for k in ("lookup_ratio", "put_ratio", "lookup_cpu_ratio",
                                                          "put_cpu_ratio"))
    assert all(type(w) is str for w in doc["warnings"])
