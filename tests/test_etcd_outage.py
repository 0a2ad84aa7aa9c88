"""etcd away longer than the metaserver's write retry window, and node liveness against a twin connection: real
etcd, metaserver and node processes (review 4.4 and 4.2).

- etcd frozen (SIGSTOP) past ``persist_retry_s``: the batch writer drops its writes (a COMMIT's pages are READY in
  memory, not in etcd). Before, the leader went on serving them; now it counts the drop
  (``umbp_etcd_dropped_ops_total``) and gives its term up, so once etcd is back the next term (a new leader key
  revision) starts from what etcd holds: no page is served that etcd lost, every acknowledged page is kept.
- a node frozen (SIGSTOP) while a second connection holding the cluster secret heartbeats for it: every such
  heartbeat is answered NOT_FOUND and the node is declared dead after its lease, as if nobody heartbeat.

Every wait is bounded; the metaserver's short etcd timeout and retry window come from its environment
(``UMBP_ETCD_TIMEOUT_S``, ``UMBP_PERSIST_RETRY_S``).
"""

from __future__ import annotations

import re
import signal
import threading
import time

import pytest

from closedpool import OPS, SECRET, closed_cluster, scoped_client, tokens_toml
from cluster import eventually
from metaserver.table.records import is_segment, pages_of, unpack_segment
from test_failover import PREFIX
from test_metrics import scrape, value
from test_pool import payload
from transport import wire
from transport.framed import FramedSocket
from umbp.errors import RemoteError, UmbpError

ELECTION_TTL_S = 30  # longer than the freeze: the leader's lease outlives the outage, so only the drop ends its term
OUTAGE_ENV = {"UMBP_ETCD_TIMEOUT_S": "1.5", "UMBP_PERSIST_RETRY_S": "0.5"}
DROP_LINE = re.compile(r"dropping (\d+) etcd ops")
PAGE = 6000


def etcd_view(etcd_url: str, ns: str) -> tuple[set[bytes], dict[str, int]]:
    """(keys of namespace ``ns``'s pages etcd holds, in commit records and page records, of every slot; the create
    revision of each term key: ``leader`` unpartitioned, ``slotmap/{s}`` partitioned)."""
    import asyncio

    import aetcd

    async def go():
        host, port = etcd_url.split("//")[-1].rsplit(":", 1)
        async with aetcd.Client(host, int(port)) as cl:
            return await cl.get_prefix(f"{PREFIX}/".encode())

    pages: set[bytes] = set()
    terms: dict[str, int] = {}
    kvs = asyncio.run(go())
    dead: set[tuple[bytes, int]] = set()  # (record's etcd key, generation) a dead list names: not held
    for kv in kvs:
        if is_segment(kv.value):
            seg = unpack_segment(kv.value)
            dead.update(zip([seg.dead_recs[i] for i in seg.dead_ix.tolist()], seg.dead.tolist()))
    for kv in kvs:
        key = kv.key.decode()[len(PREFIX) + 1:]
        if key == "leader" or key.startswith("slotmap/"):
            terms[key] = kv.create_revision
        elif f"pages/{ns}/" in key and (key.startswith("pages/") or key.startswith("slots/")):
            name = kv.key.rpartition(b"/")[2]
            if name[:1] == b"+":
                pages.update(page[0] for page in pages_of(kv.value) if (kv.key, page[4]) not in dead)
            else:
                pages.add(bytes.fromhex(name.decode()))
    return pages, terms


@pytest.mark.parametrize("slots", [1, 4])
def test_writes_dropped_while_etcd_is_frozen_end_the_term_and_no_lost_page_is_served(make_cluster, slots):
    cl = make_cluster(nodes=2, capacity="32MiB", metaserver_flags={
        "metrics_listen": "127.0.0.1:0", "election_ttl": ELECTION_TTL_S, "slots": slots, "env": OUTAGE_ENV})
    ms = cl.metaserver
    durable = [f"before/{i}" for i in range(40)]
    with cl.client(namespace="outage") as c:
        assert c.batch_put(durable, [payload(k, PAGE) for k in durable]) == [True] * len(durable)
    stored_before, terms_before = etcd_view(cl.etcd.url, "outage")
    assert stored_before == {k.encode() for k in durable}
    assert len(terms_before) == (1 if slots == 1 else slots + 1)  # the page slots and the membership role

    during = [f"during/{i}" for i in range(20)]
    result: dict = {}

    def put_during() -> None:
        try:
            with cl.client(namespace="outage", timeout=60.0) as w:
                result["ok"] = w.batch_put(during, [payload(k, PAGE) for k in during])
        except UmbpError as e:
            result["error"] = e

    cl.etcd.kill(signal.SIGSTOP)
    try:
        writer = threading.Thread(target=put_during, daemon=True)
        writer.start()
        # The COMMIT's pages are READY in memory; their etcd write fails for the whole retry window and is dropped.
        try:
            m = eventually(lambda: DROP_LINE.search(ms.stderr_text()), 40.0, "the metaserver dropping etcd writes",
                           interval=0.1)
        except Exception as e:  # say where the outage's put was (it never reached its COMMIT: no write to drop)
            raise AssertionError(f"{e}; the outage's put: {result or 'no answer yet'}, its thread "
                                 f"{'still running' if writer.is_alive() else 'done'}") from e
        assert int(m.group(1)) >= 1
    finally:
        cl.etcd.kill(signal.SIGCONT)
    writer.join(90.0)
    assert not writer.is_alive(), "the put of the outage never returned"

    def settled():  # serving again, every slot's key back
        s = scrape(ms.metrics_url)
        served = value(s, "umbp_metaserver_leader") == 1 and (slots == 1 or
                                                             value(s, "umbp_metaserver_slots_led") == slots)
        return served and len(etcd_view(cl.etcd.url, "outage")[1]) == len(terms_before) and s

    samples = eventually(settled, 60.0, "every slot led again after etcd came back", interval=0.25)
    dropped = sum(int(x) for x in DROP_LINE.findall(ms.stderr_text()))
    assert value(samples, "umbp_etcd_dropped_ops_total") == dropped >= 1
    stored, terms = etcd_view(cl.etcd.url, "outage")
    renewed = [k for k, rev in terms.items() if rev != terms_before[k]]
    assert renewed, "the terms whose writes were dropped went on serving"
    assert "giving the term up" in ms.stderr_text()
    acked = [k for k, ok in zip(during, result.get("ok") or [False] * len(during)) if ok]
    assert stored_before <= stored  # nothing durable was lost
    with cl.client(namespace="outage") as c:
        got = {k: c.get(k) for k in durable + during}
    served = {k for k, v in got.items() if v is not None}
    for k in served:
        assert k.encode() in stored, f"{k} served but etcd does not hold it"
        assert got[k] == payload(k, PAGE), k
    assert set(durable) <= served  # every page durable before the outage is still served ...
    assert set(acked) <= served  # ... and every page the outage's put acknowledged


def test_a_twin_heartbeat_does_not_keep_a_frozen_node_alive(make_cluster, tmp_path, monkeypatch):
    lease_ttl = 3.0
    cl = closed_cluster(make_cluster, tmp_path, monkeypatch, tokens_toml({}), lease_ttl=lease_ttl)
    with scoped_client(cl.metaserver_addr, OPS, "ops") as ops:
        real = {n["node_id"]: n for n in ops.admin(wire.Op.NODES)["nodes"]}
        assert real["node0"]["alive"]
        cl.node("node0").kill(signal.SIGSTOP)  # its own connection stays open, silent
        twin = FramedSocket(cl.metaserver_addr, "twin", time.monotonic() + 5, SECRET)
        refused = 0
        try:
            end = time.monotonic() + 4 * lease_ttl + 5
            while True:
                with pytest.raises(RemoteError, match="register again") as e:
                    twin.request(wire.Op.HEARTBEAT, {"node_id": "node0", "arena_id": real["node0"]["arena_id"]},
                                 time.monotonic() + 5)
                assert e.value.code == wire.Status.NOT_FOUND
                refused += 1
                nodes = {n["node_id"]: n for n in ops.admin(wire.Op.NODES)["nodes"]}
                if not nodes["node0"]["alive"]:
                    break
                assert time.monotonic() < end, f"node0 kept alive by {refused} twin heartbeats: {nodes['node0']}"
                time.sleep(lease_ttl / 10)  # the twin's heartbeat period: well inside the lease
        finally:
            twin.close()
            cl.node("node0").kill(signal.SIGCONT)
        assert refused >= 5 and nodes["node1"]["alive"]
