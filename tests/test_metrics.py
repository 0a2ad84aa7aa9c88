"""/metrics, /healthz and /readyz (``--metrics-listen``) on real metaserver and node processes, scraped over HTTP and
parsed with the Prometheus client's own parser; every assertion is a count or byte total that follows from what the
test did (puts, gets, misses, bytes over TCP), read as the difference between two scrapes.

Also: the HTTP responder's edges in-process (bad request line, unknown path, wrong method, oversized head), a
standby metaserver that is ready but exports no pool series, and a node that turns unready when no metaserver is
left. Every dashboard query in deploy/grafana names a metric that a live scrape here exports.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster import NotYet, eventually
from transport import objformat

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "umbp-dashboard.json"
PAGE = 48 * 1024 + 17  # not a multiple of anything: byte totals prove exact accounting


def http(url: str, method: str = "GET") -> tuple[int, str]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def scrape(metrics_url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted label items): value} from one scrape, parsed by prometheus_client's parser."""
    status, text = http(metrics_url)
    assert status == 200, text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels`` (0 when there are none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def names(samples: dict) -> set[str]:
    return {n for n, _ in samples}


def base(url: str) -> str:
    return url.rsplit("/", 1)[0]


@pytest.fixture
def metered(make_cluster):
    return make_cluster(nodes=2, capacity="32MiB", metaserver_flags={"metrics_listen": "127.0.0.1:0"},
                        node_flags={"metrics_listen": "127.0.0.1:0"})


def test_scraped_counts_match_what_the_test_did(metered):
    ms_url = metered.metaserver.metrics_url
    node_urls = [n.metrics_url for n in metered.nodes]
    ms0 = scrape(ms_url)
    nodes0 = [scrape(u) for u in node_urls]
    assert value(ms0, "umbp_metaserver_leader") == 1
    assert value(ms0, "umbp_pool_capacity_bytes") == 2 * (32 << 20)
    assert value(ms0, "umbp_pool_node_alive") == 2

    n = 24
    keys = [f"metrics-{i}" for i in range(n)]
    values = [bytes([i]) * PAGE for i in range(n)]
    with metered.client(transport="tcp") as c:  # tcp: every byte passes through a node's CPU and is counted
        assert c.batch_put(keys, values) == [True] * n
        outs = [bytearray(PAGE) for _ in range(n)]
        assert c.batch_get_into(keys, outs) == [PAGE] * n
        assert [bytes(o) for o in outs] == values
        miss = [bytearray(PAGE) for _ in range(5)]
        assert c.batch_get_into([f"absent-{i}" for i in range(5)], miss) == [-1] * 5
        assert c.batch_exists(keys[:3]) == [True] * 3  # same connection: the RELEASEs before it were handled
        used = set(c.transport_names().values())
    assert used == {"tcp"}

    ms1 = scrape(ms_url)
    nodes1 = [scrape(u) for u in node_urls]

    def delta(name, **labels):
        return value(ms1, name, **labels) - value(ms0, name, **labels)

    obj = objformat.object_size(PAGE)
    assert delta("umbp_pool_objects") == n
    assert delta("umbp_pool_puts_total") == n
    assert delta("umbp_pool_used_bytes") == n * obj
    assert delta("umbp_pool_hits_total") == n and delta("umbp_pool_misses_total") == 5
    assert value(ms1, "umbp_pool_pending_objects") == 0 and value(ms1, "umbp_pool_leased_objects") == 0
    assert value(ms1, "umbp_pool_held_bytes") == 0  # committed puts leave nothing in the quarantine
    assert value(ms1, "umbp_pool_node_objects") == n
    assert value(ms1, "umbp_pool_node_used_bytes") == n * obj
    # one ALLOC and one COMMIT for the batch, one LOOKUP per batch_get (two), a RELEASE for the one with hits
    count = "umbp_metaserver_request_seconds_count"
    assert delta(count, op="ALLOC") == 1 and delta(count, op="COMMIT") == 1
    assert delta(count, op="LOOKUP") == 2 and delta(count, op="RELEASE") == 1 and delta(count, op="EXISTS") == 1
    assert delta("umbp_etcd_commit_seconds_count") == 1
    assert delta("umbp_etcd_ops_total") == 1  # one commit record holds the batch's n pages
    assert value(ms1, "umbp_metaserver_request_errors_total") == 0

    # nodes: the bytes each moved over TCP add up to the pages (WRITE carries header + payload, READ the payload)
    def ndelta(name, **labels):
        return sum(value(b, name, **labels) - value(a, name, **labels) for a, b in zip(nodes0, nodes1))

    assert ndelta("umbp_node_transport_bytes_total", transport="tcp", direction="in") == n * (
        objformat.OBJ_HEADER_SIZE + PAGE)
    assert ndelta("umbp_node_transport_bytes_total", transport="tcp", direction="out") == n * PAGE
    assert ndelta("umbp_node_requests_total", op="write") == n
    assert ndelta("umbp_node_requests_total", op="read") == n
    per_node = [value(b, "umbp_node_requests_total", op="write") - value(a, "umbp_node_requests_total", op="write")
                for a, b in zip(nodes0, nodes1)]
    by_id = {dict(ls)["node_id"]: v for (nm, ls), v in ms1.items() if nm == "umbp_pool_node_objects"}
    assert sorted(per_node) == sorted(by_id.values()), "each node wrote exactly the pages placed on it"
    for node, samples in zip(metered.nodes, nodes1):
        assert value(samples, "umbp_node_registered", node_id=node.node_id) == 1
        assert value(samples, "umbp_node_capacity_bytes", node_id=node.node_id) == 32 << 20
        assert value(samples, "process_resident_memory_bytes") > 0

    # the dashboard only names metrics these processes export (a labelled counter with no sample yet, like the
    # error counter here, still announces its family)
    exported = set().union(*(exported_names(u) for u in [ms_url, *node_urls]))
    missing = sorted(dashboard_metrics() - exported)
    assert not missing, f"deploy/grafana/umbp-dashboard.json queries metrics nobody exports: {missing}"


def exported_names(metrics_url: str) -> set[str]:
    """Every name a query may use: sample names, family names and, for counters, ``<family>_total``."""
    out = set()
    for fam in text_string_to_metric_families(http(metrics_url)[1]):
        out |= {fam.name} | {s.name for s in fam.samples}
        if fam.type == "counter":
            out.add(fam.name + "_total")
        if fam.type == "histogram":
            out |= {fam.name + x for x in ("_bucket", "_count", "_sum")}
    return out


def dashboard_metrics() -> set[str]:
    if not DASHBOARD.exists():
        pytest.fail(f"{DASHBOARD} is missing")
    dash = json.loads(DASHBOARD.read_text())
    exprs = []

    def walk(o):
        if isinstance(o, dict):
            for k, v in o.items():
                if k in ("expr", "query") and isinstance(v, str):
                    exprs.append(v)
                else:
                    walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    walk(dash)
    assert exprs, "the dashboard has no queries"
    found = set()
    for e in exprs:
        found |= set(re.findall(r"\b((?:umbp|process)_[a-z0-9_]+)", e))
    return found


def test_health_readiness_and_standby(make_cluster):
    cl = make_cluster(nodes=1, capacity="8MiB", metaservers=2, metaserver_flags={"metrics_listen": "127.0.0.1:0"},
                      node_flags={"metrics_listen": "127.0.0.1:0"})
    leader, standby = cl.metaservers
    if value(scrape(leader.metrics_url), "umbp_metaserver_leader") != 1:
        leader, standby = standby, leader
    lb, sb, nb = base(leader.metrics_url), base(standby.metrics_url), base(cl.nodes[0].metrics_url)

    assert http(lb + "/healthz") == (200, "metaserver: ok\n")
    status, body = http(lb + "/readyz")
    assert status == 200 and body.startswith("metaserver: leader")
    status, body = http(sb + "/readyz")
    assert status == 200 and body.strip() == f"metaserver: standby, leader is {leader.addr}"
    s = scrape(standby.metrics_url)
    assert value(s, "umbp_metaserver_leader") == 0
    assert not {n for n in names(s) if n.startswith("umbp_pool_")}, "a standby must not report an (empty) pool"
    status, body = http(nb + "/readyz")
    assert status == 200 and body.strip() == f"node {cl.nodes[0].node_id}: registered with {leader.addr}"
    assert http(nb + "/healthz")[0] == 200
    assert http(nb + "/nope")[0] == 404
    assert http(nb + "/metrics", method="POST")[0] == 405
    assert http(lb + "/metrics", method="HEAD") == (200, "")

    # no metaserver left: the node stays alive (healthz) but is not ready
    for m in cl.metaservers:
        m.stop()
    eventually(lambda: http(nb + "/readyz")[0] == 503, 30, "the node not ready (503) once every metaserver stopped",
               interval=0.1)
    assert http(nb + "/readyz")[1].strip() == f"node {cl.nodes[0].node_id}: not registered with a metaserver"
    assert http(nb + "/healthz")[0] == 200
    assert value(scrape(cl.nodes[0].metrics_url), "umbp_node_registered") == 0


def test_http_edges_in_process():
    """The responder alone: malformed and oversized requests get an answer or a close, never a dead endpoint."""
    from prometheus_client import Counter

    from umbp.metrics import MAX_HEAD, MetricsServer, new_registry

    async def main():
        reg = new_registry()
        Counter("umbp_test_things", "things", registry=reg).inc(3)
        srv = await MetricsServer("test", reg, lambda: (True, "fine"), lambda: (False, "not yet")).start(
            "127.0.0.1:0")
        port = srv.port

        async def raw(data: bytes) -> bytes:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(data)
            await w.drain()
            got = await asyncio.wait_for(r.read(), 10)
            w.close()
            return got

        try:
            bad = await raw(b"garbage\r\n\r\n")
            big = await raw(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * (2 * MAX_HEAD) + b"\r\n\r\n")
            ready = await raw(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
            metrics = await raw(b"GET /metrics?x=1 HTTP/1.0\r\n\r\n")
        finally:
            await srv.close()
        return bad, big, ready, metrics, srv.scrapes

    bad, big, ready, metrics, scrapes = asyncio.run(main())
    assert bad.startswith(b"HTTP/1.1 400 ")
    assert big == b"", "an oversized request head is dropped unanswered"
    assert ready.startswith(b"HTTP/1.1 503 ") and ready.endswith(b"\r\n\r\nnot yet\n")
    head, _, body = metrics.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"Content-Length: %d" % len(body) in head
    fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert fams["umbp_test_things"].samples[0].value == 3
    assert scrapes == 1


def test_busy_metrics_port_is_a_startup_error(harness, etcd):
    from cluster import HarnessError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        m = harness.metaserver(etcd.url, start=False, metrics_listen=f"127.0.0.1:{port}")
        with pytest.raises(HarnessError, match="exited with 1"):
            m.start()
    assert f"metaserver: cannot listen for metrics on 127.0.0.1:{port}" in m.stderr_text()


def test_gc_policy_steps_and_connection_churn_leaves_nothing_frozen(make_cluster):
    """metaserver/store/gcpolicy.py in a real metaserver, freezing after every step (``--gc-freeze-ms 0``): steps run,
    and clients that connect, put, get and close leave the permanent generation no larger than they found it
    (a connection's objects left in a cycle would be frozen by a step and never freed: it would grow with every
    client)."""
    c = make_cluster(nodes=1, capacity="16MiB", metaserver_flags={"metrics_listen": "127.0.0.1:0", "gc_freeze_ms": 0})
    url = c.metaserver.metrics_url

    def steps_after(n: float) -> dict:
        def stepped() -> dict:
            s = scrape(url)
            if value(s, "umbp_metaserver_gc_steps_total") < n:
                raise NotYet(f"{value(s, 'umbp_metaserver_gc_steps_total')} steps")
            return s

        return eventually(stepped, 20, f"metaserver: {n} collection steps", interval=0.2)

    def churn(rounds: int, tag: str) -> None:
        for r in range(rounds):
            with c.client(transport="tcp") as cl:
                keys = [f"{tag}-{r}-{i}" for i in range(4)]
                assert cl.batch_put(keys, [bytes([r, i]) * 1000 for i in range(4)]) == [True] * 4
                outs = [bytearray(2000) for _ in keys]
                assert cl.batch_get_into(keys, outs) == [2000] * 4
                assert [bytes(o) for o in outs] == [bytes([r, i]) * 1000 for i in range(4)]

    churn(5, "warm")  # first connections: whatever is made once per process is made now
    s0 = steps_after(value(scrape(url), "umbp_metaserver_gc_steps_total") + 2)
    churn(40, "churn")
    s1 = steps_after(value(s0, "umbp_metaserver_gc_steps_total") + 2)
    assert value(s1, "umbp_metaserver_gc_freezes_total") >= value(s0, "umbp_metaserver_gc_freezes_total") + 2
    frozen0, frozen1 = value(s0, "umbp_metaserver_gc_frozen_objects"), value(s1, "umbp_metaserver_gc_frozen_objects")
    assert frozen0 > 0
    # 40 clients' 160 pages stay (about 1.2 tracked objects each: measured +183 in all); a client's connection left
    # in a cycle would add tens of objects per client.
    assert frozen1 - frozen0 < 800, (frozen0, frozen1)
    assert value(s1, "umbp_metaserver_gc_pause_max_seconds") > 0
