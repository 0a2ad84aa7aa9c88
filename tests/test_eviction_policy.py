"""Eviction policy end to end: which page a full pool gives up, with real etcd, metaserver and node processes.

The pool here is one node of 1 MiB holding exactly 16 objects of 64 KiB (``PAGE`` payload + 64-byte header), so
every put into a full pool evicts exactly one page and the victim is read back with ``batch_exists`` (which, by
contract, never changes recency: that is one of the things checked). Background eviction is switched off
(watermarks at 1.0) except in the watermark test, so the only evictions are the ones a put forces.

What is checked (DESIGN.md, "eviction"):
- ``prefix-lru``: leaves of cached chains go before pages other cached pages depend on, LRU among leaves; ``lru``
  on the same trace evicts the chain heads and breaks every prefix.
- a page whose parent was evicted goes first (it can no longer be reached by a prefix match);
- ``batch_exists`` and ``prefix_hits`` never pin and never change recency;
- background eviction brings usage from above the high watermark to just below the low one;
- a put into a pool whose every page is leased fails fast with ``PoolFull`` ("pool full"), it does not wait for the
  leases to expire.
Lease holders speak the wire protocol directly (a raw LOOKUP on a ``FramedSocket``, no RELEASE), so a test can hold
read leases as long as it likes.
"""

from __future__ import annotations

import hashlib
import time

import pytest

import umbp
from transport import objformat, wire
from cluster import NotYet, eventually
from transport.framed import FramedSocket
from umbp.errors import PoolFull
from umbp.keys import parents_of

PAGE = 64 * 1024 - objformat.OBJ_HEADER_SIZE  # one object = 64 KiB exactly
OBJ = objformat.object_size(PAGE)
SLOTS = (1 << 20) // OBJ  # objects in a 1 MiB node
NO_BACKGROUND = {"UMBP_HIGH_WATERMARK": "1.0", "UMBP_LOW_WATERMARK": "1.0"}

assert OBJ == 64 * 1024 and SLOTS == 16


def wait_ticks(c, n: int, timeout: float = 30.0) -> dict:
    """Wait until the metaserver ran ``n`` more background ticks (its stats count them); return the stats then."""
    start = c.stats()["ticks"]

    def ran() -> dict:
        s = c.stats()
        if s["ticks"] < start + n:
            raise NotYet(f"{s['ticks'] - start} ticks")
        return s

    return eventually(ran, timeout, f"metaserver: {n} background ticks", interval=0.02)


def payload(key: str, size: int = PAGE) -> bytes:
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def one_node(make_cluster, policy: str, env: dict[str, str] | None = None):
    return make_cluster(nodes=1, capacity="1MiB",
                        metaserver_flags={"eviction_policy": policy, "env": {**NO_BACKGROUND, **(env or {})}})


def put_chain(c: umbp.Client, keys: list[str]) -> None:
    assert c.batch_put(keys, [payload(k) for k in keys], parents=parents_of(keys)) == [True] * len(keys)


def present(c: umbp.Client, keys: list[str]) -> set[str]:
    return {k for k, e in zip(keys, c.batch_exists(keys)) if e}


def evict_one_by_one(c: umbp.Client, watched: list[str], n: int, tag: str) -> list[str]:
    """Put ``n`` fresh pages one at a time into a full pool; return the watched keys in the order they vanished
    (each put must evict exactly one of them)."""
    order: list[str] = []
    before = present(c, watched)
    for i in range(n):
        k = f"{tag}/fresh{i}"
        assert c.put(k, payload(k)) is True
        now = present(c, watched)
        gone = before - now
        assert len(gone) == 1, f"put {i} evicted {sorted(gone)} of the watched pages"
        order += sorted(gone)
        before = now
    return order


class LeaseHolder:
    """Holds read leases with raw LOOKUP requests and never releases them (until ``release``)."""

    def __init__(self, addr: str, ns: str = "default"):
        self.conn = FramedSocket(addr, "test lease holder", time.monotonic() + 10)
        self.ns = ns

    def lookup(self, keys: list[str]) -> tuple[int, list]:
        m = self.conn.request(wire.Op.LOOKUP, {"ns": self.ns, "keys": [k.encode() for k in keys]},
                              time.monotonic() + 10).meta
        return m["lease"], m["locs"]

    def release(self, lease: int) -> None:
        self.conn.request(wire.Op.RELEASE, {"lease": lease}, time.monotonic() + 10)

    def close(self) -> None:
        self.conn.close()


# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["prefix-lru", "lru"])
def test_full_pool_evicts_leaves_before_pages_others_depend_on(make_cluster, policy):
    """Two cached chains (a0..a3, b0..b3, oldest) and eight independent pages x0..x7; x1, b3 and a3 are read later
    (in that order). Nine puts into the full pool: prefix-lru takes the leaves in LRU order (x0, x2..x7, x1, b3)
    and leaves every chain page that a cached page depends on; lru takes the chain heads first."""
    cluster = one_node(make_cluster, policy)
    a = [f"a{i}" for i in range(4)]
    b = [f"b{i}" for i in range(4)]
    x = [f"x{i}" for i in range(8)]
    old = a + b + x
    with cluster.client() as c:
        put_chain(c, a)
        put_chain(c, b)
        assert c.batch_put(x, [payload(k) for k in x]) == [True] * 8
        s = c.stats()
        assert (s["objects"], s["used_bytes"], s["capacity_bytes"]) == (SLOTS, SLOTS * OBJ, SLOTS * OBJ)
        for k in ("x1", "b3", "a3"):  # reads refresh recency
            assert c.get(k) == payload(k)
        order = evict_one_by_one(c, old, 9, policy)
        if policy == "prefix-lru":
            assert order == ["x0", "x2", "x3", "x4", "x5", "x6", "x7", "x1", "b3"]
            assert (c.prefix_hits(a), c.prefix_hits(b)) == (4, 3)
        else:
            assert order == ["a0", "a1", "a2", "b0", "b1", "b2", "x0", "x2", "x3"]
            assert (c.prefix_hits(a), c.prefix_hits(b)) == (0, 0)
        s = c.stats()
        assert (s["objects"], s["used_bytes"], s["evictions"], s["pending"], s["pinned"]) == \
               (SLOTS, SLOTS * OBJ, 9, 0, 0)
        survivors = [k for k in old if k not in order]
        outs = [bytearray(PAGE) for _ in survivors]
        assert c.batch_get_into(survivors, outs) == [PAGE] * len(survivors)
        assert all(bytes(o) == payload(k) for k, o in zip(survivors, outs))
        assert c.get(order[0]) is None


def test_exists_and_prefix_checks_never_pin_or_refresh(make_cluster):
    """Sixteen independent pages p0..p15 in a full pool. Checking p0..p3 with batch_exists and prefix_hits (many
    times) leaves them first in line; reading p4 with get moves it to the back. Five puts evict p0, p1, p2, p3, p5."""
    cluster = one_node(make_cluster, "prefix-lru")
    keys = [f"p{i}" for i in range(SLOTS)]
    with cluster.client() as c:
        assert c.batch_put(keys, [payload(k) for k in keys]) == [True] * SLOTS
        for _ in range(20):
            assert c.batch_exists(keys[:4]) == [True] * 4
            assert c.prefix_hits(keys[:4]) == 4
            assert c.exists("p0") is True
        s = c.stats()
        assert (s["pinned"], s["hits"], s["misses"]) == (0, 0, 0)  # no lease, not counted as lookups
        assert c.get("p4") == payload("p4")
        assert c.stats()["pinned"] == 0  # the get's lease was released
        order = evict_one_by_one(c, keys, 5, "ex")
        assert order == ["p0", "p1", "p2", "p3", "p5"]
        assert c.batch_exists(keys) == [False] * 4 + [True, False] + [True] * 10
        assert c.stats()["evictions"] == 5


def test_page_whose_parent_was_evicted_goes_first(make_cluster):
    """Chain p -> c; c is read-leased, so when sixteen puts land in the full pool the pressure evicts its parent p
    (and the fifteen independent pages y*) while c survives. Once the lease goes, c can never be reached by a prefix
    match again, so it is the next victim, ahead of every page put before it."""
    cluster = one_node(make_cluster, "prefix-lru")
    chain = ["orph/p", "orph/c"]
    ys = [f"orph/y{i}" for i in range(SLOTS - 2)]
    with cluster.client() as c:
        put_chain(c, chain)
        assert c.batch_put(ys, [payload(k) for k in ys]) == [True] * len(ys)
        holder = LeaseHolder(cluster.metaserver_addr)
        try:
            lease, locs = holder.lookup(["orph/c"])
            assert lease and locs[0] is not None
            fresh = [f"orph/n{i}" for i in range(SLOTS - 1)]
            assert c.batch_put(fresh, [payload(k) for k in fresh]) == [True] * len(fresh)
            assert c.batch_exists(chain) == [False, True]  # parent evicted under pressure, child pinned
            assert c.prefix_hits(chain) == 0
            holder.release(lease)
        finally:
            holder.close()
        assert c.stats()["pinned"] == 0
        assert c.put("orph/last", payload("orph/last")) is True
        assert c.exists("orph/c") is False, "the orphan should go before older pages that still form a prefix"
        assert c.batch_exists(fresh) == [True] * len(fresh)


def test_parent_that_becomes_a_leaf_keeps_its_own_recency(make_cluster):
    """Chain a0..a3 (oldest, never read again), then twelve independent pages. The first put evicts the chain's leaf
    a3; a2 is now a leaf too and the least recently used one, so the second put should evict a2 (LRU among equals),
    not the newer x0."""
    cluster = one_node(make_cluster, "prefix-lru")
    a = [f"r/a{i}" for i in range(4)]
    x = [f"r/x{i}" for i in range(SLOTS - 4)]
    with cluster.client() as c:
        put_chain(c, a)
        assert c.batch_put(x, [payload(k) for k in x]) == [True] * len(x)
        assert evict_one_by_one(c, a + x, 2, "r") == ["r/a3", "r/a2"]


def test_background_eviction_brings_usage_between_watermarks(make_cluster):
    """One 4 MiB node (64 objects), high watermark 0.5, low 0.25. 32 pages (exactly 0.5) evict nothing; eight more
    take it above 0.5 and the background pass evicts the 24 least recently used, leaving 16 (0.25)."""
    cluster = make_cluster(nodes=1, capacity="4MiB", metaserver_flags={
        "eviction_policy": "prefix-lru", "env": {"UMBP_HIGH_WATERMARK": "0.5", "UMBP_LOW_WATERMARK": "0.25"}})
    keys = [f"wm/{i}" for i in range(40)]
    with cluster.client() as c:
        cap = c.stats()["capacity_bytes"]
        assert cap == 4 << 20
        assert c.batch_put(keys[:32], [payload(k) for k in keys[:32]]) == [True] * 32
        s = wait_ticks(c, 10)  # ten background ticks ran (counted, not slept for): none evicted
        assert (s["used_bytes"], s["objects"], s["evictions"]) == (32 * OBJ, 32, 0)
        assert c.batch_put(keys[32:], [payload(k) for k in keys[32:]]) == [True] * 8
        eventually(lambda: c.stats()["evictions"] >= 24, 10, "24 evictions by the background pass")
        s = wait_ticks(c, 10)  # and no further pass once below the low watermark
        assert (s["evictions"], s["objects"], s["used_bytes"]) == (24, 16, 16 * OBJ)
        assert 0.25 * cap - OBJ < s["used_bytes"] <= 0.25 * cap <= 0.5 * cap
        assert c.batch_exists(keys) == [False] * 24 + [True] * 16  # least recently used went
        outs = [bytearray(PAGE) for _ in keys[24:]]
        assert c.batch_get_into(keys[24:], outs) == [PAGE] * 16
        assert all(bytes(o) == payload(k) for k, o in zip(keys[24:], outs))


def test_put_into_fully_leased_pool_fails_fast_with_pool_full(make_cluster):
    """Every page of a full pool is read-leased (60 s leases, never released): a put must answer PoolFull with a
    "pool full" message within a couple of seconds, evict nothing, leave nothing pending and keep every leased page
    intact. Releasing the lease makes the same put succeed by evicting exactly one page."""
    cluster = one_node(make_cluster, "prefix-lru", env={"UMBP_READ_LEASE_S": "60"})
    keys = [f"lease/{i}" for i in range(SLOTS)]
    with cluster.client(timeout=30) as c:
        put_chain(c, keys)
        holder = LeaseHolder(cluster.metaserver_addr)
        try:
            lease, locs = holder.lookup(keys)
            assert lease > 0 and all(loc is not None for loc in locs)
            assert c.stats()["pinned"] == SLOTS
            for attempt in range(3):
                t0 = time.monotonic()
                allocs = c.requests_sent().get("ALLOC", 0)
                with pytest.raises(PoolFull) as ei:
                    c.put("lease/new", payload("lease/new"))
                print(f"put into a fully leased pool failed after {time.monotonic() - t0:.3f}s")
                assert c.requests_sent().get("ALLOC", 0) == allocs + 1  # one ALLOC: no waiting, no retry loop
                assert "pool full" in str(ei.value) and "1 of 1 pages found no space" in str(ei.value)
            with pytest.raises(PoolFull):
                c.batch_put(["lease/n1", "lease/n2"], [payload("lease/n1"), payload("lease/n2")])
            s = c.stats()
            assert (s["objects"], s["pending"], s["evictions"], s["used_bytes"], s["pinned"]) == \
                   (SLOTS, 0, 0, SLOTS * OBJ, SLOTS)
            assert c.exists("lease/new") is False
            outs = [bytearray(PAGE) for _ in keys]  # reads still work (and pin again, briefly)
            assert c.batch_get_into(keys, outs) == [PAGE] * SLOTS
            assert all(bytes(o) == payload(k) for k, o in zip(keys, outs))
            holder.release(lease)
        finally:
            holder.close()
        assert c.stats()["pinned"] == 0
        assert c.put("lease/new", payload("lease/new")) is True
        s = c.stats()
        assert (s["objects"], s["evictions"]) == (SLOTS, 1)
        assert c.batch_exists(keys) == [True] * 15 + [False]  # the chain's leaf went, not its head
        assert c.get("lease/new") == payload("lease/new")
