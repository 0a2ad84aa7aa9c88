"""``bench/columns.py`` at a small size in `make test`, so the benchmark of the columnar table keeps running: both
children build the same pages, every looked-up key is found, every new key at N is placed and evicts one page.
Counts only; its speed figures are printed, never asserted."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "columns.py"


def test_the_columns_bench_runs_and_both_sides_agree_on_counts():
    r = subprocess.run([sys.executable, str(BENCH), "--pages", "20000", "--ops", "4000"], capture_output=True,
                       text=True, timeout=300, stdin=subprocess.DEVNULL)
    print(r.stdout)
    assert r.returncode == 0, r.stderr
    counts = {m.group(1): (m.group(2), m.group(3)) for m in re.finditer(r"^(\w+)\s+([\d,]+)\s+([\d,]+)$",
                                                                            r.stdout, re.M)}
    assert counts == {"lookup_found": ("4,000", "4,000"), "put_at_n_placed": ("4,000", "4,000"),
                      "evictions": ("4,000", "4,000")}, r.stdout
    for figure in ("RSS bytes per page", "alloc+commit at N keys/s", "lookup+release keys/s", "exists keys/s"):
        assert re.search(rf"^{re.escape(figure)}\s+[\d,]+\s+[\d,]+\s+[\d.]+x", r.stdout, re.M), figure
