"""Metaserver failover, fencing, node records across metaserver outages, node restarts: real processes.

Every test runs a real etcd, real metaserver and node processes (``tests/cluster.py``) and kills or freezes them
with signals. Assertions check bytes, counts and states; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

import umbp
from cluster import NotYet, eventually
from metaserver.table.records import is_segment, pages_of, unpack_segment
from test_pool import payload
from transport import objformat
from transport.framed import FramedSocket
from transport.wire import Op
from umbp.errors import NotLeader, UmbpError

ELECTION_TTL_S = 5  # the default; the failover bound below is what a deployment gets out of the box
FAILOVER_BOUND_S = 15.0
PREFIX = "/umbp"


# ----------------------------------------------------------------------------------------------------------------
# helpers


def raw(addr: str, op: int, meta: dict | None = None, timeout: float = 3.0):
    """One request to exactly this metaserver (no leader following); returns the answer meta or raises."""
    deadline = time.monotonic() + timeout
    s = FramedSocket(addr, f"test {addr}", deadline)
    try:
        return s.request(op, meta or {}, deadline).meta
    finally:
        s.close()


def role(addr: str) -> dict | None:
    try:
        return raw(addr, Op.LEADER, timeout=1.0)
    except UmbpError:
        return None


def wait_leader(cluster, exclude=(), timeout: float = 30.0):
    """The metaserver (harness process) that answers is_leader, polled every 50 ms; HarnessError after timeout."""
    def leader():
        for ms in cluster.metaservers:
            if ms in exclude or not ms.alive:
                continue
            r = role(ms.addr)
            if r and r.get("is_leader"):
                return ms
        return None

    return eventually(leader, timeout, "a metaserver that leads", details=cluster.harness.tails)


def wait_confirmed(addr: str, ids, timeout: float = 20.0) -> list[dict]:
    """Poll NODES on the leader at ``addr`` until every id in ``ids`` re-registered (alive, not provisional)."""
    def confirmed() -> list[dict]:
        listing = raw(addr, Op.NODES)["nodes"]
        state = {n["node_id"]: n["alive"] and not n["provisional"] for n in listing}
        if not all(state.get(i) for i in ids):
            raise NotYet(f"NODES answered {listing}")
        return listing

    return eventually(confirmed, timeout, f"nodes {sorted(ids)} re-registered with {addr}", interval=0.1,
                      errors=(UmbpError,))


def put_pages(c, keys_sizes):
    assert c.batch_put([k for k, _ in keys_sizes], [payload(k, s) for k, s in keys_sizes]) == [True] * len(keys_sizes)


def check_pages(c, keys_sizes):
    for k, s in keys_sizes:
        assert c.get(k) == payload(k, s), k


def locations(c, keys):
    """node_id per key (None for a miss), from one LOOKUP (its read lease released at once)."""
    ans = c.admin(Op.LOOKUP, {"ns": c.namespace, "keys": [k.encode() for k in keys]})
    if ans.get("lease"):
        c.admin(Op.RELEASE, {"lease": ans["lease"]})
    locs = ans["locs"]
    return [loc[0] if loc else None for loc in locs]


def page_count(kvs) -> int:
    """Pages held by page-space kvs: a commit record (``{ns}/+{term}.{n}``, metaserver/store/persist.py) holds a list of
    pages, a page record one; less the pages dead lists name (metaserver/table/records.py)."""
    dead: set = set()
    for kv in kvs:
        if is_segment(kv.value):
            seg = unpack_segment(kv.value)
            dead.update(zip([seg.dead_recs[i] for i in seg.dead_ix.tolist()], seg.dead.tolist()))
    return sum(sum((kv.key, p[4]) not in dead for p in pages_of(kv.value))
               if kv.key.rpartition(b"/")[2][:1] == b"+" else 1 for kv in kvs)


def etcd_state(etcd_url: str):
    """(leader value, leader create_revision, page record count, node ids with a leased record, arena ids)."""
    import aetcd

    async def go():
        host, port = etcd_url.split("//")[-1].rsplit(":", 1)
        async with aetcd.Client(host, int(port)) as cl:
            lead = await cl.get(f"{PREFIX}/leader".encode())
            pages = await cl.get_prefix(f"{PREFIX}/pages/".encode())
            nodes = await cl.get_prefix(f"{PREFIX}/nodes/".encode())
            arenas = await cl.get_prefix(f"{PREFIX}/arenas/".encode())
            return ((lead.value.decode(), lead.create_revision) if lead else (None, 0), page_count(pages),
                    sorted(kv.key.decode().rsplit("/", 1)[1] for kv in nodes),
                    sorted(kv.key.decode().rsplit("/", 1)[1] for kv in arenas))

    return asyncio.run(go())


def ms_env(ttl: int = ELECTION_TTL_S) -> dict:
    return {"env": {"UMBP_ELECTION_TTL_S": str(ttl)}}


# ----------------------------------------------------------------------------------------------------------------
# metaserver failover


def test_leader_sigkill_failover_keeps_every_page_and_clients_carry_on(make_cluster):
    cluster = make_cluster(metaservers=3, nodes=2, lease_ttl=5, metaserver_flags=ms_env())
    old = wait_leader(cluster, timeout=10)
    assert old is cluster.metaservers[0]
    for ms in cluster.metaservers[1:]:
        assert role(ms.addr) == {"leader": old.addr, "is_leader": False}
        with pytest.raises(NotLeader) as ei:
            raw(ms.addr, Op.EXISTS, {"ns": "default", "keys": [b"x"]})
        assert ei.value.leader == old.addr
    ks = [(f"fo/{i}", (i * 7919) % 300_000 + 1) for i in range(80)]
    with cluster.client() as c:
        put_pages(c, ks)

    # A client in the middle of a put/get loop while the leader dies.
    stop = threading.Event()
    log: dict = {"ok": 0, "errors": [], "fatal": [], "after": 0, "slowest": 0.0, "keys": []}
    killed_at = [0.0]

    def loop():
        with cluster.client() as lc:
            i = 0
            while not stop.is_set():
                k = f"loop/{i}"
                t = time.monotonic()
                try:
                    assert lc.put(k, payload(k, 5000)) is True
                    assert lc.get(k) == payload(k, 5000)
                    log["ok"] += 1
                    log["keys"].append(k)
                    if killed_at[0] and t > killed_at[0]:
                        log["after"] += 1
                except UmbpError as e:
                    log["errors"].append(repr(e))
                except BaseException as e:  # an AssertionError here must fail the test, not end the thread quietly
                    log["fatal"].append(repr(e))
                    return
                log["slowest"] = max(log["slowest"], time.monotonic() - t)
                i += 1

    th = threading.Thread(target=loop, daemon=True)
    th.start()
    # the loop has done some work on the old leader
    eventually(lambda: log["ok"] >= 10 or log["fatal"], 20, lambda: f"10 rounds on the old leader: {log}")
    assert log["ok"] >= 10 and log["after"] == 0, log
    killed_at[0] = time.monotonic()
    old.kill(signal.SIGKILL)
    new = wait_leader(cluster, exclude=(old,), timeout=FAILOVER_BOUND_S + 10)
    failover_s = time.monotonic() - killed_at[0]
    print(f"\nfailover: {old.name} SIGKILLed -> {new.name} leads after {failover_s:.2f}s "
          f"(election ttl {ELECTION_TTL_S}s; measured, not asserted: wait_leader bounds it)")
    assert "leader at revision" in new.stdout_text()

    # The loop keeps going on the new leader; stop it once it has done some work there.
    try:
        eventually(lambda: log["after"] >= 20 or log["fatal"], 20, lambda: f"20 rounds on the new leader: {log}",
                   interval=0.1)
    finally:
        stop.set()
    th.join(40)
    assert not th.is_alive()
    assert not log["fatal"], log["fatal"]
    print(f"client loop: {log['ok']} put+get rounds, {log['after']} after the kill, slowest call "
          f"{log['slowest']:.2f}s, errors {log['errors']}")
    assert log["after"] >= 20
    # A put whose ALLOC was answered by the dead leader but whose COMMIT reached the new one finds its PENDING
    # entry gone (PENDING is never persisted); the client reports that one put as not stored. Nothing else may fail.
    assert len(log["errors"]) <= 1, log["errors"]
    assert all("before commit" in e or "not stored" in e for e in log["errors"]), log["errors"]

    with umbp.Client(cluster.metaserver_addrs) as c:
        check_pages(c, ks)  # every page committed before the crash, byte-exact
        for k in log["keys"]:
            assert c.get(k) == payload(k, 5000), k
        more = [(f"fo-after/{i}", 70_000 + i) for i in range(10)]
        put_pages(c, more)
        check_pages(c, more)
        s = c.stats()
        assert s["is_leader"] is True and s["leader"] == new.addr
        assert s["objects"] == len(ks) + len(log["keys"]) + len(more)
        assert s["pending"] == 0
    listing = wait_confirmed(new.addr, ["node0", "node1"], timeout=15)
    assert sorted(n["node_id"] for n in listing) == ["node0", "node1"]
    lead, pages, leased, arenas = etcd_state(cluster.etcd.url)
    assert lead[0] == new.addr
    assert pages == len(ks) + len(log["keys"]) + len(more)
    assert leased == ["node0", "node1"] and arenas == ["node0", "node1"]


def test_pending_allocation_at_crash_vanishes_and_its_space_is_reused(make_cluster):
    # One 32 MiB arena: a 24 MiB PENDING allocation leaves no room for another 24 MiB page (PENDING is never
    # evicted), so the put after the failover fits only if the new leader forgot the allocation.
    cluster = make_cluster(metaservers=3, nodes=1, capacity="32MiB", lease_ttl=5, metaserver_flags=ms_env())
    old = wait_leader(cluster, timeout=10)
    with cluster.client() as c:
        put_pages(c, [("small", 1000)])
        used0 = c.stats()["used_bytes"]
    big = 24 << 20
    # The writer's connection stays open across the crash (a writer whose connection closes takes its pending
    # allocations with it: that is another test).
    writer = FramedSocket(old.addr, "test writer", time.monotonic() + 5)
    items = writer.request(Op.ALLOC, {"ns": "default", "keys": [b"pending-key"], "sizes": [big]},
                           time.monotonic() + 5).meta["items"]
    assert items[0][0] == 0 and items[0][1] == "node0"  # NEW, placed, never written nor committed
    s = raw(old.addr, Op.STATS)
    assert s["pending"] == 1 and s["used_bytes"] == used0 + objformat.object_size(big)

    old.kill(signal.SIGKILL)
    writer.close()
    new = wait_leader(cluster, exclude=(old,), timeout=FAILOVER_BOUND_S + 10)
    wait_confirmed(new.addr, ["node0"], timeout=15)
    listed = raw(new.addr, Op.LIST, {"ns": "default"})["objects"]
    assert [o[1] for o in listed] == [b"small"]
    s = raw(new.addr, Op.STATS)
    assert s["pending"] == 0 and s["objects"] == 1 and s["used_bytes"] == used0
    with umbp.Client(cluster.metaserver_addrs) as c:
        assert c.exists("pending-key") is False
        value = payload("pending-key", big)
        assert c.put("pending-key", value) is True
        assert c.get("pending-key") == value
        assert c.get("small") == payload("small", 1000)


def test_deposed_leader_is_fenced_and_steps_down(make_cluster):
    cluster = make_cluster(metaservers=2, nodes=1, lease_ttl=10, metaserver_flags=ms_env())
    old, standby = cluster.metaservers
    assert wait_leader(cluster, timeout=10) is old
    ks = [(f"fence/{i}", 3000 + i) for i in range(20)]
    with cluster.client() as c:
        put_pages(c, ks)
    (holder, old_rev), pages, _, _ = etcd_state(cluster.etcd.url)
    assert holder == old.addr and pages == len(ks)

    old.kill(signal.SIGSTOP)  # frozen, lease not kept alive: the standby must win after the TTL
    try:
        t0 = time.monotonic()
        assert wait_leader(cluster, exclude=(old,), timeout=FAILOVER_BOUND_S + 10) is standby
        print(f"\nfailover after SIGSTOP: {time.monotonic() - t0:.2f}s")
        (holder, new_rev), _, _, _ = etcd_state(cluster.etcd.url)
        assert holder == standby.addr and new_rev > old_rev
        more = [(f"fence-new/{i}", 5000 + i) for i in range(10)]
        with umbp.Client(standby.addr) as c:  # the frozen one would hold a client until its attempt bound
            wait_confirmed(standby.addr, ["node0"], timeout=20)
            put_pages(c, more)
    finally:
        old.kill(signal.SIGCONT)

    # Resumed, the old leader must not serve: its local lease validity is long gone, and etcd refuses its writes.
    def follows() -> bool:
        r = role(old.addr)
        if r != {"leader": standby.addr, "is_leader": False}:
            raise NotYet(f"LEADER answered {r}")
        return True

    eventually(follows, 10, f"{old.name} naming {standby.addr} as the leader", interval=0.1)
    with pytest.raises(NotLeader) as ei:
        raw(old.addr, Op.EXISTS, {"ns": "default", "keys": [b"fence/0"]})
    assert ei.value.leader == standby.addr
    eventually(lambda: "stepped down" in old.stdout_text(), 10, f"{old.name}: 'stepped down'", interval=0.1,
               details=old.tail)

    # The fence itself: a write carrying the old leader's revision is refused by etcd.
    from metaserver.store.batcher import BatchWriter
    from metaserver.store.persist import EtcdStore

    async def fenced_write():
        store = EtcdStore(cluster.etcd.url.split("//")[-1], PREFIX)
        fired = []
        store.fence(old_rev)
        store.on_fenced = lambda: fired.append(True)
        w = BatchWriter(store)
        w.start()
        fut = w.submit([(store.page_key("default", b"forged"), store.page_value("node0", 4096, 1, 1, None))],
                       [store.page_key("default", b"fence/0")], wait=True)
        try:
            with pytest.raises(NotLeader, match="deposed"):
                await asyncio.wait_for(fut, 10)
            assert fired == [True]
        finally:
            await w.close(1)
            await store.close()

    asyncio.run(fenced_write())
    (holder, rev), pages, _, _ = etcd_state(cluster.etcd.url)
    assert holder == standby.addr and rev == new_rev
    assert pages == len(ks) + len(more)  # nothing forged, nothing deleted by the deposed leader
    with umbp.Client(standby.addr) as c:
        check_pages(c, ks + more)
        assert c.exists("forged") is False


def test_clean_stop_hands_over_at_once(make_cluster):
    cluster = make_cluster(metaservers=2, nodes=1, lease_ttl=5, metaserver_flags=ms_env())
    old, standby = cluster.metaservers
    assert wait_leader(cluster, timeout=10) is old
    with cluster.client() as c:
        put_pages(c, [("clean", 777)])
    t0 = time.monotonic()
    assert old.stop() == 0  # SIGTERM: flush, resign (revoke the election lease), exit cleanly
    assert "resigned: election lease" in old.stderr_text()  # the lease was revoked, not left to run out
    assert wait_leader(cluster, exclude=(old,), timeout=10) is standby
    print(f"\nhand-over after SIGTERM: {time.monotonic() - t0:.2f}s (election ttl {ELECTION_TTL_S}s)")
    with umbp.Client(cluster.metaserver_addrs) as c:
        assert c.get("clean") == payload("clean", 777)


# ----------------------------------------------------------------------------------------------------------------
# node records vs metaserver outages, node restarts


def test_metaserver_down_longer_than_node_lease_keeps_live_nodes_pages(make_cluster):
    cluster = make_cluster(metaservers=1, nodes=2, lease_ttl=2, metaserver_flags=ms_env())
    ks = [(f"outage/{i}", 2000 + 37 * i) for i in range(60)]
    with cluster.client() as c:
        put_pages(c, ks)
        where = locations(c, [k for k, _ in ks])
    assert set(where) == {"node0", "node1"}
    ms = cluster.metaserver
    ms.kill(signal.SIGKILL)
    cluster.node("node1").kill(signal.SIGKILL)  # this one does not come back
    # node leases (ttl 2 s) expire with nobody to keep them
    eventually(lambda: not etcd_state(cluster.etcd.url)[2], 15, "no leased node record in etcd", interval=0.5)
    _, pages, leased, arenas = etcd_state(cluster.etcd.url)  # nobody writes now: the state the loop saw
    assert leased == [] and arenas == ["node0", "node1"] and pages == len(ks)

    t0 = time.monotonic()
    ms.start()  # same port
    wait_confirmed(ms.addr, ["node0"], timeout=20)
    print(f"\nnode0 re-registered {time.monotonic() - t0:.2f}s after the metaserver restart")
    # NODES shows it confirmed before its REGISTER answer (etcd lease) reaches it
    eventually(lambda: "kept" in cluster.node("node0").stderr_text(), 10, "node0: 'kept' on stderr", interval=0.1,
               details=cluster.node("node0").tail)
    on0 = [(k, s) for (k, s), w in zip(ks, where) if w == "node0"]
    on1 = [(k, s) for (k, s), w in zip(ks, where) if w == "node1"]
    with umbp.Client(cluster.metaserver_addrs) as c:
        check_pages(c, on0)
        # node1 is provisional for its grace (max(lease_ttl, 10 s)), then dropped with its pages.
        cluster.wait_nodes(alive=["node0"], dead=["node1"], timeout=30)
        listing = cluster.cli_json("nodes")
        assert {n["node_id"]: n["alive"] for n in listing} == {"node0": True, "node1": False}
        for k, _ in on1:
            assert c.get(k) is None  # a page on a gone node reads as a miss
        check_pages(c, on0)
        s = c.stats()
        assert s["objects"] == len(on0)
    def forgotten():
        _, pages, leased, arenas = etcd_state(cluster.etcd.url)
        if pages == len(on0) and arenas == ["node0"]:
            return leased, arenas
        raise NotYet(f"etcd holds {pages} pages, arenas {arenas}")

    leased, _ = eventually(forgotten, 10, f"etcd holding node0's {len(on0)} pages only", interval=0.2)
    assert leased == ["node0"]


def test_node_restart_with_same_id_keeps_pages(make_cluster):
    cluster = make_cluster(metaservers=2, nodes=2, lease_ttl=8, metaserver_flags=ms_env())
    ks = [(f"nr/{i}", 1 + 4099 * i) for i in range(50)]
    with cluster.client() as c:
        put_pages(c, ks)
        where = locations(c, [k for k, _ in ks])
    n0 = sum(w == "node0" for w in where)
    assert 0 < n0 < len(ks)
    node = cluster.node("node0")
    node.restart(sig=signal.SIGKILL)
    assert f"reopened, kept {n0} pages" in node.stdout_text()
    cluster.wait_nodes(timeout=15)
    with umbp.Client(cluster.metaserver_addrs) as c:
        check_pages(c, ks)
        assert c.stats()["objects"] == len(ks)
        put_pages(c, [("nr-after", 12345)])
        check_pages(c, [("nr-after", 12345)])


@pytest.mark.parametrize("how", ["arena-deleted", "other-capacity"])
def test_node_back_with_another_arena_drops_its_pages(make_cluster, how):
    cluster = make_cluster(metaservers=1, nodes=2, lease_ttl=8)
    ks = [(f"na/{i}", 100 + 999 * i) for i in range(40)]
    with cluster.client() as c:
        put_pages(c, ks)
        where = locations(c, [k for k, _ in ks])
    node = cluster.node("node0")
    node.stop()
    if how == "arena-deleted":
        files = node.arena_files()
        assert len(files) == 1
        files[0].unlink()
    else:
        node.capacity = "48MiB"
    node.start()
    assert "kept 0 pages" in node.stdout_text() and "new" in node.stdout_text()
    cluster.wait_nodes(timeout=15)
    on0 = [(k, s) for (k, s), w in zip(ks, where) if w == "node0"]
    on1 = [(k, s) for (k, s), w in zip(ks, where) if w == "node1"]
    assert on0 and on1
    with umbp.Client(cluster.metaserver_addrs) as c:
        for k, _ in on0:
            assert c.get(k) is None
        check_pages(c, on1)
        s = c.stats()
        assert s["objects"] == len(on1)
        caps = {n["node_id"]: n["capacity_bytes"] for n in s["nodes"]}
        assert caps["node0"] == (48 << 20 if how == "other-capacity" else 64 << 20)
        put_pages(c, on0)  # the keys are free again and the new arena takes them
        check_pages(c, ks)
    _, pages, _, _ = etcd_state(cluster.etcd.url)
    assert pages == len(ks)
