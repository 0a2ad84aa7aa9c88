"""An evicted page's extent reused before its record's rewrite is durable, then a crash: never wrong bytes (real
etcd, metaserver and node processes; ``metaserver/store/batcher.py``'s removal barrier).

Page P (4 units) is evicted by the ALLOC of a 1-unit object R, which takes P's first unit (R's writer never writes:
P's header stays); a 3-unit object Q then takes P's other three units and its writer writes them: P's header is
intact and Q's bytes fill P's payload. etcd is out of reach all along (``proxies.Proxy``, holding: nothing the
metaserver sends reaches it), so P's record rewrite (without P) is queued, not durable; the metaserver dies (SIGKILL)
and the next term loads P from its old record. A reader of P then checks a good header over Q's bytes: wrong bytes,
unless no ALLOC answer that placed an object in P's extent left the metaserver before that rewrite was durable (the
fix: such an ALLOC waits for it). Both commit modes: ``--commit async`` promises misses, never wrong bytes, as well.

Not SIGSTOP: a frozen etcd reads the dead metaserver's last transaction from its socket once it runs again and
applies it (the rewrite lands after all, sometimes), so the window closes or not by chance. The proxy holds what the
metaserver sends and throws it away with the connection when the metaserver dies.

Whether R's and Q's ALLOCs are answered at all while etcd is frozen is the metaserver's business (with the fix they
are not: their deadlines pass); what is asserted is the bytes read after the crash, and, when Q was answered, that
the layout is the one described (so the test cannot pass by placing Q elsewhere). Every wait is bounded; etcd's
freeze is ended in ``finally``.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest

from cluster import Cluster, eventually
from proxies import Proxy
from test_etcd_outage import etcd_view
from test_failover import wait_leader
from test_pool import payload
from transport import objformat, wire
from transport.framed import FramedSocket
from transport.wire import Op
from umbp.errors import UmbpError

UNIT = objformat.ALIGN
P_LEN = 4 * UNIT - 384  # object_size: 4 units
R_LEN = 1000  # 1 unit
Q_LEN = 3 * UNIT - 300  # 3 units
ENV = {"UMBP_ETCD_TIMEOUT_S": "20", "UMBP_PERSIST_RETRY_S": "60",  # a freeze of seconds: retried, never dropped
       "UMBP_HIGH_WATERMARK": "1", "UMBP_LOW_WATERMARK": "1"}  # no background eviction: R's ALLOC evicts P
NS = "reuse"


def header_at(arena: Path, off: int) -> tuple[int, int] | None:
    """(key hash, generation) of the object header at arena offset ``off``, None when none is there."""
    with open(arena, "rb") as f:
        f.seek(off)
        buf = f.read(objformat.OBJ_HEADER_SIZE)
    magic, version, _flags, kh, gen, *_ = objformat.OBJ_HEADER.unpack_from(buf)
    return (kh, gen) if magic == objformat.OBJ_MAGIC and version == objformat.OBJ_VERSION else None


def proxied_cluster(harness, commit: str) -> tuple[Cluster, Proxy]:
    """One node of 1 MiB, one metaserver that reaches etcd through a ``Proxy``."""
    cl = Cluster(harness, nodes=1, capacity="1MiB", metaservers=0)
    cl.etcd = harness.etcd()
    proxy = Proxy(cl.etcd.url)
    cl.metaservers.append(harness.metaserver(proxy.addr, commit=commit, election_ttl=30, env=ENV))
    cl.add_node()
    cl.wait_nodes()
    return cl, proxy


@pytest.mark.parametrize("commit", ["durable", "async"])
def test_extent_of_an_evicted_page_is_not_reused_before_its_rewrite_is_durable(harness, etcd_binary, commit):
    assert objformat.object_size(P_LEN) == 4 * UNIT and objformat.object_size(R_LEN) == UNIT
    assert objformat.object_size(Q_LEN) == 3 * UNIT
    cl, proxy = proxied_cluster(harness, commit)
    node = cl.nodes[0]
    arena = node.arena_dir / f"umbp-{node.node_id}.arena"
    n = (1 << 20) // (4 * UNIT)
    keys = [f"p/{i}" for i in range(n)]
    c = cl.client(namespace=NS, timeout=3.0)
    writer = None
    try:
        assert c.put(keys[0], payload(keys[0], P_LEN))  # the least recently used page: R's ALLOC evicts it
        assert c.batch_put(keys[1:], [payload(k, P_LEN) for k in keys[1:]]) == [True] * (n - 1)
        eventually(lambda: c.stats()["etcd_pending_ops"] == 0 and c.stats()["used_bytes"] == 1 << 20, 30.0,
                   "the full arena durable in etcd", interval=0.05)
        victim = keys[0]
        proxy.hold()
        r_off = q_off = None
        try:
            # R: placed at P's start (evicting P), never written, its connection kept open past the crash
            writer = FramedSocket(cl.metaserver.addr, "test writer", time.monotonic() + 5)
            try:
                items = writer.request(Op.ALLOC, {"ns": NS, "keys": [b"r"], "sizes": [R_LEN]},
                                       time.monotonic() + 3).meta["items"]
                assert items[0][0] == wire.AllocState.NEW, items
                r_off = items[0][2]
            except UmbpError as e:  # held until P's rewrite is durable (the fix): never answered while etcd is away
                print(f"\n{commit}: R's ALLOC not answered while etcd is out of reach ({e})")
            # Q: the 3 units after R, P's payload, written by the client (its COMMIT may wait for etcd)
            try:
                c.put("q", payload("q", Q_LEN))
            except UmbpError as e:
                print(f"{commit}: Q's put failed while etcd is out of reach ({e})")
            if r_off is not None:
                assert header_at(arena, r_off)[0] == objformat.key_hash(NS, victim.encode())  # P's header, unwritten R
                q_hash = objformat.key_hash(NS, b"q")
                q_off = next((o for o in range(r_off + UNIT, r_off + 4 * UNIT, UNIT)
                              if (h := header_at(arena, o)) is not None and h[0] == q_hash), None)
                print(f"{commit}: R at {r_off} (P's header kept), Q written at {q_off}")
            cl.metaserver.kill(signal.SIGKILL)  # before P's record rewrite reached etcd ...
            proxy.drop()  # ... and what it sent after the hold never does
            assert proxy.kept > 0
        finally:
            proxy.release()
        if q_off is not None:  # the layout the test means: Q's bytes inside P's extent, P's header untouched
            assert r_off < q_off < r_off + 4 * UNIT
        cl.metaserver.start()
        wait_leader(cl, timeout=60.0)
        others = keys[1:8]
        eventually(lambda: all(c.get(k) == payload(k, P_LEN) for k in others), 60.0,
                   "the durable pages served by the next term", interval=0.2)
        got = c.get(victim)
        assert got is None or got == payload(victim, P_LEN), (
            f"{commit}: the evicted page {victim} read back with other bytes ({q_off=})")
        print(f"{commit}: {victim} after the crash: {'a miss' if got is None else 'its own bytes'}")
    finally:
        if writer is not None:
            writer.close()
        c.close()
        proxy.close()


def test_an_alloc_held_for_a_removal_is_answered_once_the_removal_is_in_etcd(harness, etcd_binary):
    """The fix's other half: the ALLOC that evicted P waits while etcd is out of reach, and is answered once the
    rewrite without P is in etcd (P is gone from etcd when the answer arrives), at P's extent."""
    cl, proxy = proxied_cluster(harness, "durable")
    n = (1 << 20) // (4 * UNIT)
    keys = [f"p/{i}" for i in range(n)]
    c = cl.client(namespace=NS, timeout=10.0)
    writer = None
    try:
        assert c.put(keys[0], payload(keys[0], P_LEN))
        assert c.batch_put(keys[1:], [payload(k, P_LEN) for k in keys[1:]]) == [True] * (n - 1)
        eventually(lambda: c.stats()["etcd_pending_ops"] == 0 and c.stats()["used_bytes"] == 1 << 20, 30.0,
                   "the full arena durable in etcd", interval=0.05)
        assert keys[0].encode() in etcd_view(cl.etcd.url, NS)[0]
        answer: dict = {}

        def alloc_r() -> None:
            try:
                items = writer.request(Op.ALLOC, {"ns": NS, "keys": [b"r"], "sizes": [R_LEN]},
                                       time.monotonic() + 30).meta["items"]
                answer["stored"] = etcd_view(cl.etcd.url, NS)[0]  # what etcd held when the answer came
                answer["items"] = items
            except Exception as e:  # noqa: BLE001 - reported by the assertion below
                answer["error"] = e

        writer = FramedSocket(cl.metaserver.addr, "test writer", time.monotonic() + 5)
        proxy.hold()
        try:
            t = threading.Thread(target=alloc_r, daemon=True)
            t.start()
            eventually(lambda: c.stats()["evictions"] >= 1 and proxy.kept > 0, 10.0,
                       "R's ALLOC evicted P and its rewrite was sent toward etcd", interval=0.05)
            assert not answer, "an ALLOC answered before the rewrite that freed its space reached etcd"
        finally:
            proxy.release()
        t.join(30.0)
        assert not t.is_alive() and "error" not in answer, answer
        assert answer["items"][0][0] == wire.AllocState.NEW
        assert keys[0].encode() not in answer["stored"], "P's removal was durable before R's answer"
        assert len(answer["stored"]) == n - 1
        s = c.stats()  # the wait is counted (STATS, and umbp_etcd_removal_waits_total)
        assert s["removal_waits"] >= 1 and s["removal_waited_s"] > 0, {k: s.get(k) for k in ("removal_waits",
                                                                                       "removal_waited_s")}
    finally:
        if writer is not None:
            writer.close()
        c.close()
        proxy.close()
