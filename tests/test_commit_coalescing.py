"""Commits from several clients share etcd transactions: the metaserver's batch writer coalesces what arrives while
a transaction is in flight, and COMMITs of one namespace queued together share one segment (group commit), so etcd
sees fewer transactions than there were COMMITs (counted, not timed: COMMIT
requests from the metaserver's ``/metrics``, transactions from STATS ``etcd_txns``)."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import NotYet, eventually  # noqa: E402
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
        # group commit: COMMITs that queue while the writer is busy join one segment (one op), so ops <= COMMITs
        assert after["objects"] - before["objects"] == commits and txns <= ops <= commits
        assert txns < commits  # several clients' commits rode in one transaction
        assert all(c.exists(f"co/{w}/{i}") for w in range(clients) for i in (0, puts - 1))


@pytest.mark.cluster(nodes=1, etcd_flags={"max_txn_ops": None}, metaserver_flags={"metrics_listen": "127.0.0.1:0"})
def test_a_pool_on_an_etcd_at_its_default_cap_writes_everything_in_transactions_it_accepts(cluster):
    """The metaserver writes up to 1,024 operations a transaction; this pool's etcd runs without --max-txn-ops (128).
    150 puts of 4 pages make 150 commit records; one REMOVE of their 600 pages queues 150 deletes at once: etcd
    refuses that transaction for its size, the writer writes them 128 at a time from then on (STATS and /metrics
    say so), no failure is retried, and the pool keeps committing and serving exact bytes."""
    def settled(c) -> dict:
        def drained() -> dict:
            st = c.stats()
            if st["etcd_pending_ops"] != 0:
                raise NotYet(f"STATS {st}")
            return st

        return eventually(drained, 20, "no etcd operation pending")

    with cluster.client() as c:
        assert c.stats()["etcd_txn_max_ops"] == 1024
        first = {f"cap/{i}": os.urandom(4096) for i in range(600)}
        names = list(first)
        for i in range(0, 600, 4):  # a COMMIT (one commit record) each
            assert c.batch_put(names[i:i + 4], [first[k] for k in names[i:i + 4]]) == [True] * 4
        before = settled(c)
        assert c.batch_remove(list(first)) == [True] * 600
        st = settled(c)
        assert st["etcd_txn_max_ops"] == 128 and st["etcd_retries"] == 0
        assert st["etcd_ops"] - before["etcd_ops"] == 150 and st["objects"] == before["objects"] - 600
        assert value(scrape(cluster.metaserver.metrics_url), "umbp_etcd_txn_max_ops") == 128
        again = {f"cap2/{i}": os.urandom(4096) for i in range(600)}
        assert c.batch_put(list(again), list(again.values())) == [True] * 600
        outs = [bytearray(4096) for _ in again]
        assert c.batch_get_into(list(again), outs) == [4096] * 600
        assert all(bytes(o) == v for o, v in zip(outs, again.values()))
        assert not any(c.batch_exists(list(first)))
