"""``python bench/servicepath.py`` (ALLOC+COMMIT through the service path) at a small size in `make test`, so the
benchmark keeps running: into a full pool every new page beyond the capacity evicts one. Counts only; its speed
figure is printed, never asserted."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "servicepath.py"


@pytest.mark.parametrize("parents,turn", [("chain", 1), ("none", 1), ("chain", 4)])
def test_the_servicepath_bench_runs_and_a_full_pool_evicts_what_it_must(parents, turn):
    # 2 nodes of 1 MiB: 512 pages of 4 KiB (4,000 B + the object header); 20 requests of 128 new pages
    r = subprocess.run([sys.executable, str(BENCH), "--requests", "20", "--nodes", "2", "--capacity", "1MiB",
                        "--parents", parents, "--turn", str(turn)], capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    print(r.stdout)
    assert r.returncode == 0, r.stderr
    m = re.search(rf"^servicepath: ([\d,]+) keys of 66 bytes \({parents} parents\) in 20 ALLOC\+COMMIT requests "
                  rf"\({turn} a turn\), .* ([\d,]+) evictions$", r.stdout, re.M)
    assert m is not None, r.stdout
    assert m.group(1) == "2,560" and m.group(2) == f"{2560 - 512:,}"
