"""``bench/warmcopy.py`` runs (small) in both modes and its three ways of applying the leader's commit records end in
the leader's page count (the bench asserts it for every way), so the figures it prints stay comparable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("full", [False, True])
def test_warmcopy_bench_runs_and_every_way_agrees(full):
    args = [sys.executable, str(ROOT / "bench" / "warmcopy.py"), "--pages", "2560", "--rounds", "1"]
    if full:
        args.append("--full")
    res = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert any("one page at a time (baseline)" in ln for ln in lines)
    assert sum("x the baseline" in ln for ln in lines) == 2, res.stdout
    assert ("full node" in lines[0]) == full
