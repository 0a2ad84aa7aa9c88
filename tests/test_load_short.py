"""The load test in `make test`: ``bench/load.py --short`` (2 client processes, ~5 s of mixed batches against a pool
it starts on the harness's etcd) must finish with zero wrong bytes, zero wrong answers, zero errors, every client
reporting, and some of every operation done. Counts only: its speed figures are printed, never asserted.

Arenas go to the harness's /dev/shm directory (``UMBP_ARENA_DIR``), so teardown removes them even if the run is
killed. Bounded by the subprocess timeout (the script bounds itself at seconds + 180 s of start and drain).
"""

from __future__ import annotations

import json
import subprocess
import sys

from cluster import Etcd, Harness, child_env
from processes import REPO_ROOT


def test_short_load_run_has_no_wrong_bytes_and_no_errors(etcd: Etcd, harness: Harness):
    out = harness.workdir / "load.json"
    env = child_env({"UMBP_ARENA_DIR": str(harness.shm_dir)})
    argv = [sys.executable, str(REPO_ROOT / "bench" / "load.py"), "--short", "--etcd", etcd.url, "--json", str(out)]
    r = subprocess.run(argv, cwd=harness.workdir, env=env, capture_output=True, text=True, timeout=240,
                       stdin=subprocess.DEVNULL)
    print(r.stdout)  # the figures, in the test's captured output
    assert r.returncode == 0, f"bench/load.py --short exited {r.returncode}\n{r.stdout}\n{r.stderr}"
    res = json.loads(out.read_text())
    assert res["wrong_bytes"] == 0 and res["wrong"] == {"pages": 0, "ranges": 0, "exists": 0, "prefix": 0}, res
    assert res["errors"] == {}, res["error_samples"]
    assert res["clients_reported"] == res["config"]["clients"] == 2
    for op in ("put", "get", "exists", "prefix", "ranged"):
        assert res["ops"][op]["batches"] > 0 and res["ops"][op]["keys"] > 0, (op, res["ops"][op])
    assert res["ops"]["get"]["bytes"] > 0 and res["ops"]["ranged"]["bytes"] > 0
    servers = res["servers"]
    assert "metaserver" in servers and sum(name.startswith("node ") for name in servers) == 2, servers
    assert all(s.get("peak_rss_bytes", 0) > 0 for s in servers.values()), servers
