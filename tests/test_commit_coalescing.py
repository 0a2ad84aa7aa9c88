"""Commits from several clients share etcd transactions: the metaserver's batch writer coalesces what arrives while
a transaction is in flight, so etcd sees fewer transactions than there were COMMITs (counted, not timed: COMMIT
requests from the metaserver's ``/metrics``, transactions from STATS ``etcd_txns``)."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_metrics import scrape, value  # noqa: E402

COMMITS = "umbp_metaserver_request_seconds_count"


@pytest.mark.cluster(metaserver_flags={"metrics_listen": "127.0.0.1:0"})
def test_commits_of_several_clients_coalesce_into_shared_transactions(cluster):
    clients, puts = 8, 40
    errors: list = []
    before = None
    url = cluster.metaserver.metrics_url
    with cluster.client() as c:
        before = c.stats()
    commits_before = value(scrape(url), COMMITS, op="COMMIT")

    def writer(w: int) -> None:
        try:
            with cluster.client() as cw:
                for i in range(puts):  # one page per call: one COMMIT per page
                    key = f"co/{w}/{i}"
                    assert cw.put(key, os.urandom(4096)) is True
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads), errors
    commits = clients * puts
    assert value(scrape(url), COMMITS, op="COMMIT") - commits_before == commits  # one COMMIT per one-page put
    with cluster.client() as c:
        after = c.stats()
        txns = after["etcd_txns"] - before["etcd_txns"]
        ops = after["etcd_ops"] - before["etcd_ops"]
        print(f"\n{commits} COMMITs of one page from {clients} clients: {txns} etcd transactions, {ops} ops")
        assert after["objects"] - before["objects"] == commits and ops >= commits
        assert txns < commits  # several clients' commits rode in one transaction
        assert all(c.exists(f"co/{w}/{i}") for w in range(clients) for i in (0, puts - 1))
