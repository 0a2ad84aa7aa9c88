"""``umbp.launcher``'s process helpers, which ``umbp up`` and the test harness share: the sweep of directories left
by dead processes and the etcd lookup."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from umbp.launcher import find_etcd, sweep_dead_pool_dirs


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_sweep_removes_only_dead_owners_directories_matching_its_pattern(tmp_path):
    dead, alive = _dead_pid(), os.getpid()
    for name in (f"umbp-up-{dead}-a", f"umbp-up-{alive}-b", f"umbp-test-{dead}-c", "umbp-up-x-d"):
        (tmp_path / name).mkdir()
    (tmp_path / f"umbp-up-{dead}-file").write_bytes(b"")  # a file of that name is not a pool directory
    assert sweep_dead_pool_dirs(str(tmp_path)) == [str(tmp_path / f"umbp-up-{dead}-a")]
    test_rx = re.compile(r"^umbp-test-(\d+)-")
    assert sweep_dead_pool_dirs(str(tmp_path), test_rx) == [str(tmp_path / f"umbp-test-{dead}-c")]
    assert sorted(os.listdir(tmp_path)) == sorted([f"umbp-up-{alive}-b", "umbp-up-x-d", f"umbp-up-{dead}-file"])
    assert sweep_dead_pool_dirs(str(tmp_path / "missing")) == []


def test_find_etcd_tries_extra_directories_before_the_interpreters(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    fake = tmp_path / "bin" / "etcd"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o644)  # not executable: skipped
    assert find_etcd(str(fake.parent)) != str(fake)
    fake.chmod(0o755)
    assert find_etcd(str(tmp_path / "nowhere"), str(fake.parent)) == str(fake)
