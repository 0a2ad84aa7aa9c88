"""``umbp stats --watch`` and ``umbp top``: the rendered rates and bars from two known STATS answers (no pool), then
the real commands against a real pool, as a log (no terminal) and under a pseudo-terminal (``top`` draws full
screen). ``--json --watch`` stays one JSON object per line."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time

from rich.console import Console

from umbp.sizes import format_size
from umbp.watch import render


def _stats(puts: int, hits: int, misses: int, used0: int, used1: int) -> dict:
    return {"capacity_bytes": 2 << 30, "used_bytes": used0 + used1, "objects": puts, "pending": 0, "pinned": 0,
            "hits": hits, "misses": misses, "evictions": 0, "puts": puts, "etcd_ops": puts, "leader": "10.0.0.1:7700",
            "is_leader": True,
            "nodes": [{"node_id": "n0", "host": "10.0.0.2", "port": 7800, "capacity_bytes": 1 << 30,
                       "used_bytes": used0, "objects": 1, "alive": True, "transports": ["shm", "tcp"], "pid": 11},
                      {"node_id": "n1", "host": "10.0.0.3", "port": 7800, "capacity_bytes": 1 << 30,
                       "used_bytes": used1, "objects": 1, "alive": False, "transports": ["tcp"], "pid": 12}]}


def test_render_rates_bars_and_states():
    prev = _stats(100, 10, 10, 0, 0)
    cur = _stats(300, 40, 20, 512 << 20, 0)  # 2 s later: 100 puts/s, 20 keys/s looked up, 75% hits now
    con = Console(record=True, width=160)
    con.print(render(cur, prev, 2.0))
    text = con.export_text()
    assert "puts 100/s, keys looked up 20/s" in text
    assert "75.0% now, 66.7% since the leader started (40 hits, 20 misses)" in text
    assert f"{format_size(512 << 20)} of {format_size(2 << 30)}" in text
    n0 = next(line for line in text.splitlines() if " n0 " in line)
    assert "50.0%" in n0 and f"{format_size(256 << 20)}/s" in n0, n0  # 512 MiB in 2 s, net
    n1 = next(line for line in text.splitlines() if " n1 " in line)
    assert "DEAD" in n1
    assert "1 of 2 nodes alive" in text
    first = Console(record=True, width=160)
    first.print(render(cur, None, 0.0))
    assert "puts -, keys looked up -" in first.export_text()  # no rates without a previous answer


def _put(cluster, n: int) -> None:
    with cluster.client() as c:
        keys = [f"watch/{i}" for i in range(n)]
        assert c.batch_put(keys, [bytes(20_000)] * n) == [True] * n
        assert c.batch_exists(keys) == [True] * n


def test_stats_watch_as_a_log_and_json_lines(cluster):
    _put(cluster, 25)
    r = cluster.cli("stats", "--watch", "0.2", "--count", "3")
    assert r.stdout.count("UMBP pool · every 0.2s") == 3
    for n in cluster.nodes:
        assert r.stdout.count(n.node_id) >= 3, r.stdout
    assert "25 ready, 0 pending" in r.stdout
    r = cluster.cli("stats", "--json", "--watch", "0.1", "--count", "2")
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(lines) == 2 and all(s["objects"] == 25 for s in lines)


def test_top_draws_full_screen_on_a_terminal(cluster):
    _put(cluster, 5)
    from cluster import child_env

    master, slave = pty.openpty()
    env = child_env({"UMBP_METASERVER": cluster.metaserver_addrs, "COLUMNS": "140", "LINES": "40",
                     "TERM": "xterm"})
    p = subprocess.Popen([sys.executable, "-m", "umbp", "top", "--interval", "0.2", "--count", "3"], stdin=slave,
                         stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif p.poll() is not None:
                break
        assert p.wait(30) == 0, out[-2000:]
    finally:
        os.close(master)
        if p.poll() is None:
            p.kill()
    text = out.decode("utf-8", "replace")
    assert "\x1b[?1049h" in text, "top switches to the alternate screen"
    assert "umbp top" in text and "5 ready" in text
    for n in cluster.nodes:
        assert n.node_id in text
