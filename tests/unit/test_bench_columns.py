"""``bench/columns.py`` at a small size in `make test`, so the benchmark of the columnar table keeps running: both
children build the same pages, every looked-up key is found (directory calls and the wire path), every new key at N
is placed and evicts one page, and both full loads hold every page loaded.
Counts only; its speed figures are printed, never asserted."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from transport import wire

BENCH = Path(__file__).resolve().parents[2] / "bench" / "columns.py"


def test_the_columns_bench_runs_and_both_sides_agree_on_counts():
    r = subprocess.run([sys.executable, str(BENCH), "--pages", "20000", "--ops", "4000"], capture_output=True,
                       text=True, timeout=300, stdin=subprocess.DEVNULL)
    print(r.stdout)
    assert r.returncode == 0, r.stderr
    counts = {m.group(1): (m.group(2), m.group(3)) for m in re.finditer(r"^(\w+)\s+([\d,]+)\s+([\d,]+)$",
                                                                            r.stdout, re.M)}
    assert counts == {"lookup_found": ("4,000", "4,000"), "put_at_n_placed": ("4,000", "4,000"),
                      "evictions": ("4,000", "4,000"), "wire_lookup_found": ("4,000", "4,000"),
                      "load_objects": ("20,000", "20,000")}, r.stdout
    for figure in ("RSS bytes per page", "alloc+commit at N keys/s", "lookup+release keys/s", "exists keys/s",
                   "wire lookup keys/s (see docstring)", "full load pages/s"):
        assert re.search(rf"^{re.escape(figure)}\s+[\d,]+\s+[\d,]+\s+[\d.]+x", r.stdout, re.M), figure
    assert re.search(r"^full load CPU seconds \(docstring\)\s+\d+\.\d{3}\s+\d+\.\d{3}\s+[\d.]+x", r.stdout, re.M)


def test_the_tables_wire_sketch_answers_what_a_node_accepts():
    """The table's LOOKUP answer in bench/columns.py is today's format: each location's capability (one per node,
    packed from the columns) passes the node's check for exactly that object, and its tag is the key's tag."""
    import importlib.util

    from umbp.auth import check_read_capability

    spec = importlib.util.spec_from_file_location("bench_columns", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    s = bench.Subject("columns", 2000)
    keys = [bytes([i % 256, i // 256]) * 16 for i in range(2000)]
    for i in range(0, 2000, 500):
        assert s.put(keys[i:i + 500], 1 + i)[0] == 500
    asked = keys[100:140] + [b"\x00" * 31 + b"\x01"]  # the last is not stored
    answer = wire.unpack_locs(bench.msgpack.unpackb(s.wire_lookup(bench.msgpack.packb({"ns": "kv", "keys": asked}))),
                              "test")
    locs, caps = answer["locs"], answer["caps"]
    assert locs[-1] is None and all(loc is not None for loc in locs[:-1])
    assert [loc[4] for loc in locs[:-1]] == s.tokens.tags("kv", asked[:-1])
    for node_id, off, plen, gen, tag, ix in locs[:-1]:
        check_read_capability(s.svc.members[node_id].cap_key, caps[ix], off, plen, gen, "test")
    assert not s.d.leases, "the sketch released its lease"
    s.d.check()
