"""``bench/columns.py`` at a small size in `make test`, so the benchmark of the page table keeps running: at each
request size every looked-up key is found (the core call, EXISTS and the wire path), every new key at N is placed
and evicts one page (in the core and through the wire), the cold load holds every page, and each figure is printed
beside its issue 44 target. Counts only; its speed figures are printed, never asserted."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from transport import answerrows

BENCH = Path(__file__).resolve().parents[2] / "bench" / "columns.py"


def test_the_columns_bench_runs_and_its_counts_add_up():
    r = subprocess.run([sys.executable, str(BENCH), "--pages", "20000", "--ops", "4000", "--batches", "128,1024",
                        "--json"], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    print(r.stdout)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert sorted(res["by_batch"]) == ["1024", "128"]
    for b, asked in (("128", 31 * 128), ("1024", 3 * 1024)):  # ops // batch requests of batch keys
        f = res["by_batch"][b]
        assert f["keys"] == asked
        for k in ("first_lookup_found", "lookup_found", "exists_found", "wire_lookup_found", "put_placed",
                  "put_evictions", "wire_put_placed", "wire_put_evictions"):
            assert f[k] == asked, (b, k, f[k])
    assert res["objects"] == 20000 and res["load"]["pages"] == 20000
    assert re.search(r"^machine: .+, \d+ CPUs", r.stdout, re.M)
    targets = {"LOOKUP+RELEASE core": ">= 1.5 M at 128 keys, >= 3 M at 1,024",
               "LOOKUP+RELEASE through the wire": ">= 1 M", "ALLOC+COMMIT core, full pool": ">= 400k",
               "ALLOC+COMMIT through the wire, full pool": ">= 150k", "RSS bytes per page": "<= 100 B",
               "  a page, us": "<= 5 CPU-s at 10 M pages"}
    for figure, text in targets.items():
        line = re.search(rf"^{re.escape(figure)}\s+\S.*$", r.stdout, re.M)
        assert line is not None and text in line.group(0) and re.search(r"\s(ok|NO)\s", line.group(0)), figure
    assert "etcd's read, which is not included" in r.stdout


def test_the_columns_bench_wire_lookup_answers_what_a_node_accepts():
    """The wire LOOKUP of bench/columns.py answers as the service does (packed rows, wire VERSION 12): each
    location's capability (one per node, packed from the columns) passes the node's check for exactly that object,
    its tag is the key's tag, and the lease is released."""
    import importlib.util

    from umbp.auth import check_read_capability

    spec = importlib.util.spec_from_file_location("bench_columns", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    s = bench.Subject(2000)
    keys = [bytes([i % 256, i // 256]) * 16 for i in range(2000)]
    for i in range(0, 2000, 500):
        assert s.put(keys[i:i + 500], 1 + i)[0] == 500
    asked = keys[100:140] + [b"\x00" * 31 + b"\x01"]  # the last is not stored
    reply = bench.msgpack.unpackb(s.wire_lookup(bench.msgpack.packb({"ns": "kv", "keys": asked})), raw=False)
    assert isinstance(reply["rows"], bytes) and reply["lease_ms"] > 0
    answer = answerrows.unpack_locs(reply, "test")
    locs, caps = answer["locs"], answer["caps"]
    assert locs[-1] is None and all(loc is not None for loc in locs[:-1])
    assert [loc[4] for loc in locs[:-1]] == s.tokens.tags("kv", asked[:-1])
    for node_id, off, plen, gen, tag, ix in locs[:-1]:
        check_read_capability(s.svc.members[node_id].cap_key, caps[ix], off, plen, gen, "test")
    assert bench.rows_found(s.lookup_release(asked)) == 40
    assert not s.d.leases, "the bench released its leases"
    s.d.check()
