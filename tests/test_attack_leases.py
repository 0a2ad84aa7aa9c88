"""Correctness attack on read leases lost while a read is in flight: real etcd, metaserver and node processes.

A LOOKUP's read lease pins the pages it found until the client's RELEASE, so their extents are not reused while the
client reads them; a read done past ``lease_ms`` is dropped by the client (``late``). The node's TCP READV answer is
the arena itself (memoryviews handed to the transport, umbp/node/server.py ``readv``), checked once when the request
is read: what the socket does not take at once is sent later from the arena as it is then. So a lease must last its
whole ``lease_ms`` even when the metaserver loses track of its owner. These tests once proved it did not (a
removal and a new put into the same extent while the answer drained gave the client the old header over the new
page's bytes): when the client's metaserver connection closed, its leases were released at once (now they run out,
``ownership.drop_leases``), and a new leader held none of the last one's leases (now it evicts nothing and keeps
freed extents of the last term's pages for ``read_lease_s``: ``metaserver/table/quarantine.py``).

The valve (``node_proxy``, a ``proxies.Proxy``) sits between the client and the node's data port (the node advertises
127.0.0.2, the proxy listens there and forwards to 127.0.0.1): once a connection has carried a MiB down it stops
reading from the node (``pause``: the kernel buffers fill, the node's transport keeps the rest of the answer as arena
views) until ``resume()``.
"""

from __future__ import annotations

import random
import threading

from cluster import eventually
from umbp.errors import PoolFull
from proxies import Proxy

PAGE = (40 << 20) - 512  # an object of 40 MiB: far more than the loopback socket buffers hold
CAPACITY = "80MiB"  # two such objects, nothing else: a page put after a removal lands in the removed one's extent
FLAGS = {"env": {"UMBP_HIGH_WATERMARK": "1.0", "UMBP_LOW_WATERMARK": "1.0", "UMBP_READ_LEASE_S": "60"}}


def node_proxy(port: int, **kwargs) -> Proxy:
    """A proxy at 127.0.0.2:``port`` (what a node started with ``advertise=127.0.0.2`` tells its clients) to the
    node's port on 127.0.0.1."""
    return Proxy("127.0.0.1:%d" % port, listen=("127.0.0.2", port), **kwargs)


def _lease_lost_mid_read(c, a, b, lose) -> dict:
    """A reads b"old" over TCP (its answer held back by the valve); ``lose()`` ends A's lease; B removes b"old" and
    puts b"new" in its extent; the valve opens. Returns {"value": what A's get returned} or {"error": ...}."""
    got: dict = {}

    def read() -> None:
        try:
            got["value"] = a.get(b"old")
        except Exception as e:  # noqa: BLE001 - an error is an allowed outcome: reported by the caller
            got["error"] = e

    t = threading.Thread(target=read, daemon=True)
    t.start()
    eventually(c.valve.paused.is_set, 30, "A's answer held back by the valve")
    lose()
    eventually(lambda: b.batch_remove([b"old"]) == [True], 30, "b\"old\" removed")
    # the only room is the extent of b"old": the put must not get it while A's lease may still be read under (it
    # fails, or evicts b"filler" and lands there)
    try:
        got["put"] = b.batch_put([b"new"], [c.pages["new"]])
    except PoolFull:
        got["put"] = None
    c.valve.resume()
    t.join(60)
    assert not t.is_alive()
    if got["put"] == [True]:
        assert b.get(b"new") == c.pages["new"]
    return got


def _check(got: dict, pages: dict) -> None:
    value = got.get("value")
    if value is not None:
        same = sum(x == y for x, y in zip(value[::4096], pages["new"][::4096]))
        assert value == pages["old"], (f"A's get returned {len(value)} bytes that are not the page's: {same} of "
                                       f"{len(value[::4096])} sampled bytes are the new page's")


def _cluster(make_cluster):
    c = make_cluster(nodes=1, capacity=CAPACITY, metaserver_flags=dict(FLAGS), node_flags={"advertise": "127.0.0.2"})
    node = c.nodes[0]
    c.valve = node_proxy(node.port)
    c.valve.pause(1 << 20)
    rng = random.Random(4703)
    c.pages = {k: rng.randbytes(PAGE) for k in ("old", "new", "filler")}
    return c


def test_a_read_whose_lease_went_with_its_metaserver_connection_never_returns_another_pages_bytes(make_cluster):
    """Client A looks a page up (its lease pins it) and reads it over TCP; its answer drains slowly (the valve).
    Meanwhile A's metaserver connection closes (the metaserver releases A's lease), client B removes the page and
    puts another of the same size, which lands in the same extent. A's read must end as that page's bytes, a miss
    or an error: never the new page's bytes under the old page's header."""
    c = _cluster(make_cluster)
    meta = Proxy(c.metaserver_addr)
    try:
        with c.client() as b, c.client(metaserver=meta.addr, transport="tcp") as a:
            assert b.batch_put([b"old", b"filler"], [c.pages["old"], c.pages["filler"]]) == [True, True]  # full

            def lose() -> None:
                meta.drop()  # A's metaserver connection closes: its lease stays until it expires
                eventually(lambda: c.ask("stats")["leases_orphaned"] == 1, 30, "A's connection closed")
                assert c.ask("stats")["pinned"] == 1

            got = _lease_lost_mid_read(c, a, b, lose)
        _check(got, c.pages)
    finally:
        c.valve.close()
        meta.close()


def test_a_read_under_the_last_leaders_lease_never_returns_another_pages_bytes(make_cluster):
    """As above, but the lease ends with its leader: the metaserver restarts (a clean stop, then a new leader's full
    load) while A's answer drains. The new leader must not hand the page's extent to another page while a lease the
    last leader granted may still be read under."""
    c = _cluster(make_cluster)
    try:
        with c.client() as b, c.client(transport="tcp") as a:
            assert b.batch_put([b"old", b"filler"], [c.pages["old"], c.pages["filler"]]) == [True, True]  # full

            def lose() -> None:
                c.metaserver.restart()
                c.wait_nodes()

            got = _lease_lost_mid_read(c, a, b, lose)
        _check(got, c.pages)
    finally:
        c.valve.close()
