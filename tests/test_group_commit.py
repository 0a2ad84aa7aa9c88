"""Group commit and ``--commit async`` against a real etcd (SIGSTOPped), metaserver and nodes
(metaserver/table/commits.py).

- durable (the default): COMMITs that arrive while etcd is frozen are READY in memory but none is answered; they
  share segments (fewer etcd ops than COMMITs) and each is answered once etcd is back and its segment is written,
  every answered page in etcd.
- async: a COMMIT is answered while etcd is frozen; the metaserver then crashes before its segment is written. The
  next term serves every page that was durable, and of the window's pages each one either with its exact bytes or
  as a miss, also through a client that remembered their locations and after new pages took their extents.

Every wait is bounded (``eventually``); etcd's freeze is ended in ``finally``.
"""

from __future__ import annotations

import signal
import threading

from cluster import eventually
from test_etcd_outage import etcd_view
from test_failover import wait_leader
from test_pool import payload

PAGE = 6000
ENV = {"UMBP_ETCD_TIMEOUT_S": "20", "UMBP_PERSIST_RETRY_S": "60"}  # a freeze of seconds: retried, never dropped


def test_group_commit_answers_a_commit_only_once_its_segment_is_durable(make_cluster):
    cl = make_cluster(nodes=2, capacity="32MiB", metaserver_flags={"election_ttl": 30, "env": ENV})
    clients, per = 12, 5
    keys = {w: [f"gc/{w}/{i}" for i in range(per)] for w in range(clients)}
    results: dict = {}
    with cl.client(namespace="gc") as c:
        before = c.stats()
        cl.etcd.kill(signal.SIGSTOP)
        try:
            def put(w: int) -> None:
                with cl.client(namespace="gc", timeout=60.0) as cw:
                    results[w] = cw.batch_put(keys[w], [payload(k, PAGE) for k in keys[w]])  # one COMMIT each

            threads = [threading.Thread(target=put, args=(w,), daemon=True) for w in range(clients)]
            for t in threads:
                t.start()
            # every COMMIT applied in memory (READY) while etcd is frozen ...
            eventually(lambda: c.stats()["objects"] - before["objects"] == clients * per, 30.0,
                       "every COMMIT of the window READY in memory", interval=0.05)
            assert not results, "a COMMIT was answered before its segment reached etcd"  # ... and none answered
        finally:
            cl.etcd.kill(signal.SIGCONT)
        for t in threads:
            t.join(60.0)
        assert not any(t.is_alive() for t in threads)
        assert all(results[w] == [True] * per for w in range(clients)), results
        after = c.stats()
    stored, _ = etcd_view(cl.etcd.url, "gc")
    assert stored == {k.encode() for ks in keys.values() for k in ks}, "every answered page is durable"
    ops = after["etcd_ops"] - before["etcd_ops"]
    assert ops < clients, f"{clients} COMMITs queued behind a frozen etcd wrote {ops} segments: none joined"


def test_async_commit_loses_at_most_the_window_as_misses_never_wrong_bytes(make_cluster):
    cl = make_cluster(nodes=2, capacity="4MiB", metaserver_flags={"commit": "async", "election_ttl": 3, "env": ENV})
    durable = [f"d/{i}" for i in range(40)]
    window = [f"w/{i}" for i in range(30)]
    c = cl.client(namespace="as", timeout=30.0)
    try:
        assert c.batch_put(durable, [payload(k, PAGE) for k in durable]) == [True] * len(durable)
        eventually(lambda: etcd_view(cl.etcd.url, "as")[0] == {k.encode() for k in durable}, 30.0,
                   "the durable pages in etcd", interval=0.1)
        cl.etcd.kill(signal.SIGSTOP)
        try:
            # answered while etcd is frozen: acknowledged before etcd
            assert c.batch_put(window, [payload(k, PAGE) for k in window]) == [True] * len(window)
            assert [c.get(k) for k in window] == [payload(k, PAGE) for k in window]  # (the client learns where)
            cl.metaserver.kill(signal.SIGKILL)  # a crash before the window's segment was written
        finally:
            cl.etcd.kill(signal.SIGCONT)
        cl.metaserver.start()
        wait_leader(cl, timeout=60.0)
        stored, _ = etcd_view(cl.etcd.url, "as")
        lost = {k for k in window if k.encode() not in stored}
        print(f"\nasync: {len(lost)} of the window's {len(window)} acknowledged pages lost by the crash")

        def read_all() -> dict:
            return {k: c.get(k) for k in durable + window}

        got = eventually(lambda: read_all() if all(read_all()[k] is not None for k in durable) else None, 60.0,
                         "the durable pages served by the next term", interval=0.2)
        for k, v in got.items():
            assert v is None or v == payload(k, PAGE), f"{k}: other bytes"
        assert {k for k, v in got.items() if v is None} == lost <= set(window), "only the window is lost"
        # new pages take the freed extents (the pool is small: 4 MiB a node); the lost pages stay misses
        fresh = [f"f/{i}" for i in range(60)]
        assert c.batch_put(fresh, [payload(k, PAGE) for k in fresh]).count(True) > 0
        for k in window:
            v = c.get(k)
            assert v is None or v == payload(k, PAGE), f"{k}: another object's bytes"
            assert k not in lost or v is None
    finally:
        c.close()
