"""Connections cut mid-transfer, by a proxy between a client and a real node or metaserver: a read cut halfway is
a miss or an error, never wrong bytes; a write cut halfway is aborted (nothing readable, nothing left pending); a
lost ALLOC answer is retried and the put still stores its page exactly once."""

from __future__ import annotations

import os

from proxies import Proxy
from transport import wire


def via_proxy(client, proxies: dict) -> None:
    """Point a tcp client at a proxy in front of each node (the metaserver's node map, as the client caches it)."""
    client._refresh_nodes(client._deadline())
    for node_id, info in client._nodes.items():
        p = proxies.setdefault(node_id, Proxy(info["addr"]))
        info["addr"] = p.addr


def test_a_read_cut_halfway_is_a_miss_never_wrong_bytes(cluster):
    keys = [f"cut/r{i}" for i in range(24)]
    vals = [os.urandom(200_000) for _ in keys]
    proxies: dict = {}
    with cluster.client() as w:
        assert w.batch_put(keys, vals) == [True] * 24
    with cluster.client(transport="tcp") as c:
        via_proxy(c, proxies)
        for p in proxies.values():
            p.arm("down", 5 * 200_000 + 777)  # each node's answer stream dies inside its sixth page
        outs = [bytearray(200_000) for _ in keys]
        got = c.batch_get_into(keys, outs)
        assert sum(p.cuts for p in proxies.values()) == len(proxies)
        for g, o, v in zip(got, outs, vals):
            assert g in (-1, 200_000)
            if g == 200_000:
                assert o == v  # a page reported read is exactly the page
        assert 0 < got.count(200_000) < 24 and c.counters["node_failures"] >= 1
        outs = [bytearray(200_000) for _ in keys]
        via_proxy(c, proxies)  # the failed node transports were dropped: reconnect through the (disarmed) proxies
        assert c.batch_get_into(keys, outs) == [200_000] * 24 and outs == vals
    for p in proxies.values():
        p.close()


def test_a_write_cut_halfway_is_aborted_and_can_be_retried(cluster):
    keys = [f"cut/w{i}" for i in range(16)]
    vals = [os.urandom(100_000) for _ in keys]
    proxies: dict = {}
    with cluster.client(transport="tcp") as c:
        via_proxy(c, proxies)
        for p in proxies.values():
            p.arm("up", 3 * 100_000)
        try:
            stored = c.batch_put(keys, vals)
            raised = None
        except Exception as e:  # noqa: BLE001 - the contract: TransportError naming the aborted pages
            stored, raised = None, e
        assert raised is not None and "aborted" in str(raised), (stored, raised)
        s = c.stats()
        assert s["pending"] == 0  # the aborted allocations were given back
        present = c.batch_exists(keys)
        outs = [bytearray(100_000) for _ in keys]
        got = c.batch_get_into(keys, outs)
        for ok, g, o, v in zip(present, got, outs, vals):
            assert (g == 100_000 and o == v) if ok else g == -1  # committed ones exact, aborted ones absent
        via_proxy(c, proxies)
        again = c.batch_put(keys, vals)
        assert again == [not ok for ok in present]
        outs = [bytearray(100_000) for _ in keys]
        assert c.batch_get_into(keys, outs) == [100_000] * 16 and outs == vals
    for p in proxies.values():
        p.close()


def test_a_lost_alloc_answer_is_retried_and_stores_the_page_once(cluster):
    proxy = Proxy(cluster.metaserver_addr)
    value = os.urandom(50_000)
    with cluster.client(metaserver=proxy.addr) as c:
        assert c.put("cut/warm", b"x")  # connected and introduced
        alloc_meta = len(wire.encode(wire.Op.ALLOC, 1, {"items": [[0, "node0", 4096, 50_000, 1, 1, b""]]},
                                     flags=wire.Flag.RESPONSE))
        proxy.arm("down", alloc_meta // 2)  # the next answer (ALLOC's) is cut halfway: the client must retry
        assert c.put("cut/lost-answer", value) is True
        assert proxy.cuts == 1 and c.requests_sent()["ALLOC"] >= 3
        assert c.get("cut/lost-answer") == value
        s = c.stats()
        assert s["pending"] == 0
        assert c.put("cut/lost-answer", b"other") is False and c.get("cut/lost-answer") == value
    proxy.close()
