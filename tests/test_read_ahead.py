"""Speculative reads (``umbp/speculate.py``): a client reads the pages it remembers while its LOOKUP is in flight,
and keeps only those the answer names at the very location read. These tests make the remembered locations wrong
behind the client's back (another client removes, rewrites, evicts) and check every byte and count it returns.

Tests that only put and read share their module's cluster of the same configuration (``shared_cluster``: each in a
namespace of its own, counts taken from the client or as differences); the ones that evict pool-wide, freeze a node
or run a closed pool start their own."""

from __future__ import annotations

import hashlib

import pytest

from transport import wire
from umbp.speculate import BACKOFF_BATCHES, LocationCache, Speculation, same_place

SIZE = 20_000


def page(key: str, version: int, size: int = SIZE) -> bytes:
    seed = hashlib.sha256(f"{key}/{version}".encode()).digest()
    return (seed * (size // 32 + 1))[:size]


@pytest.mark.shared_cluster
@pytest.mark.cluster(nodes=2)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_repeated_gets_are_served_ahead_and_still_looked_up(cluster, transport):
    cl = cluster
    keys = [f"ra-{i}" for i in range(32)]
    with cl.client(transport=transport) as c:
        hits0 = c.stats()["hits"]  # the pool's count so far (a shared cluster: other tests' gets)
        assert c.batch_put(keys, [page(k, 1) for k in keys]) == [True] * 32
        outs = [bytearray(SIZE) for _ in keys]
        assert c.batch_get_into(keys, outs) == [SIZE] * 32  # the first get learns the locations
        before = c.requests_sent().get("LOOKUP", 0)
        for _ in range(3):
            outs = [bytearray(SIZE) for _ in keys]
            assert c.batch_get_into(keys, outs) == [SIZE] * 32
            assert [bytes(o) for o in outs] == [page(k, 1) for k in keys]
        st = c.stats()
        assert st["client"]["spec_hits"] == 3 * 32 and st["client"]["spec_wasted"] == 0
        assert c.requests_sent().get("LOOKUP", 0) - before == 3  # every get still looked up (recency, lease)
        assert st["hits"] - hits0 >= 4 * 32 and st["pinned"] == 0  # and every lease released


@pytest.mark.shared_cluster
@pytest.mark.cluster(nodes=1, capacity="16MiB")
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_pages_moved_behind_the_clients_back_are_read_again_or_missed(cluster, transport):
    """Client A remembers 24 pages. Client B then removes 8 (misses now), rewrites 8 with new bytes (new
    generations, maybe the same slots), and leaves 8; B's new pages and a stranger's may reuse the freed slots.
    A's next get must return exactly: -1 for the removed, the new bytes for the rewritten, the old for the kept."""
    cl = cluster
    keys = [f"mv-{i}" for i in range(24)]
    gone, rewritten, kept = keys[:8], keys[8:16], keys[16:]
    with cl.client(transport=transport) as a, cl.client(transport=transport) as b:
        assert a.batch_put(keys, [page(k, 1) for k in keys]) == [True] * 24
        assert a.batch_get_into(keys, [bytearray(SIZE) for _ in keys]) == [SIZE] * 24
        assert b.batch_remove(gone + rewritten) == [True] * 16
        # strangers first, so the freed slots (the allocator reuses them) hold other keys' bytes
        strangers = [f"st-{i}" for i in range(16)]
        assert b.batch_put(strangers, [page(k, 9) for k in strangers]) == [True] * 16
        assert b.batch_put(rewritten, [page(k, 2) for k in rewritten]) == [True] * 8
        outs = [bytearray(SIZE) for _ in keys]
        got = a.batch_get_into(keys, outs)
        assert got == [-1] * 8 + [SIZE] * 16
        assert [bytes(o) for o in outs[8:16]] == [page(k, 2) for k in rewritten]
        assert [bytes(o) for o in outs[16:]] == [page(k, 1) for k in kept]
        st = a.stats()["client"]
        assert st["spec_hits"] == 8 and st["spec_wasted"] == 16, st
        # 16 of 24 wasted: the next BACKOFF_BATCHES gets wait for their answer; then, since the answers taught A
        # the new places, a get is served ahead again, all of it
        for n in range(BACKOFF_BATCHES + 1):
            outs = [bytearray(SIZE) for _ in rewritten + kept]
            assert a.batch_get_into(rewritten + kept, outs) == [SIZE] * 16
            assert [bytes(o) for o in outs] == [page(k, 2) for k in rewritten] + [page(k, 1) for k in kept]
            assert a.stats()["client"]["spec_hits"] == 8 + (16 if n == BACKOFF_BATCHES else 0)


def test_evicted_pages_are_misses_not_old_bytes(make_cluster):
    cl = make_cluster(nodes=1, capacity="16MiB")
    keys = [f"ev-{i}" for i in range(16)]
    with cl.client(transport="shm") as a, cl.client(transport="shm") as b:
        assert a.batch_put(keys, [page(k, 1) for k in keys]) == [True] * 16
        assert a.batch_get_into(keys, [bytearray(SIZE) for _ in keys]) == [SIZE] * 16
        res = b.admin(wire.Op.EVICT, {"all": True})
        assert res["evicted"] == 16, res
        others = [f"ot-{i}" for i in range(16)]
        assert b.batch_put(others, [page(k, 3) for k in others]) == [True] * 16  # the freed slots, other bytes
        outs = [bytearray(SIZE) for _ in keys]
        assert a.batch_get_into(keys, outs) == [-1] * 16
        assert a.stats()["client"]["spec_wasted"] == 16
        # most of that batch was wasted: the next batches read the plain way (no second copy) for a while
        assert a._spec.skip == BACKOFF_BATCHES


def test_a_silent_node_does_not_hold_a_get(make_cluster):
    """Pages remembered on a node that then went silent (SIGSTOP: its sockets still accept, nothing answers). Once
    the metaserver declared it dead, a get of every page answers the other node's pages exactly and the silent
    node's as misses, within the call's deadline: the speculative read has its own bound, and the node is forgotten
    after it failed, so the next get does not try it at all. (Before the bound, the speculative read waited out the
    whole call deadline on the silent node and the get raised DeadlineExceeded: tests/test_multihost.py's black
    hole found it.)"""
    import signal

    from umbp.keys import normalize_key

    cl = make_cluster(nodes=2, lease_ttl=2)
    keys = [f"sil-{i}" for i in range(32)]
    with cl.client(transport="tcp", timeout=5) as c:
        assert c.batch_put(keys, [page(k, 1) for k in keys]) == [True] * 32
        assert c.batch_get_into(keys, [bytearray(SIZE) for _ in keys]) == [SIZE] * 32  # locations learnt
        victim = cl.nodes[0]
        on_victim = {k for k in keys if c._spec.cache.get(normalize_key(k))[0] == victim.node_id}
        assert 0 < len(on_victim) < 32, "both nodes should hold some of the pages"
        victim.kill(signal.SIGSTOP)
        try:
            cl.wait_nodes(alive=[cl.nodes[1].node_id], dead=[victim.node_id], timeout=30)
            want = [-1 if k in on_victim else SIZE for k in keys]
            for attempt in range(2):
                failures = c.stats()["client"]["node_failures"]
                outs = [bytearray(SIZE) for _ in keys]
                assert c.batch_get_into(keys, outs) == want
                assert all(bytes(o) == page(k, 1) for k, o in zip(keys, outs) if k not in on_victim)
                st = c.stats()["client"]
                # the first get's speculative read failed on the silent node (the other node's too, now and then,
                # on a loaded machine: it is read again from the answer); the second never went to the silent node
                if attempt == 0:
                    assert st["node_failures"] - failures >= 1, st
                else:
                    assert st["node_failures"] == failures, st
                assert st["spec_cached"] == 32 - len(on_victim), st
        finally:
            victim.kill(signal.SIGCONT)


@pytest.mark.shared_cluster
@pytest.mark.cluster(nodes=1, capacity="16MiB")  # the moved-pages tests' cluster: 8 pages of 20 kB fit either way
def test_read_ahead_off_never_reads_before_the_answer(cluster):
    cl = cluster
    keys = [f"off-{i}" for i in range(8)]
    import umbp
    from umbp.config import ClientConfig, resolve

    cfg = resolve(ClientConfig, {"metaserver": cl.metaserver_addrs, "transport": "shm", "namespace": cl.namespace},
                  env={"UMBP_READ_AHEAD": "0"})
    with umbp.Client(config=cfg) as c:
        assert c.batch_put(keys, [page(k, 1) for k in keys]) == [True] * 8
        for _ in range(3):
            outs = [bytearray(SIZE) for _ in keys]
            assert c.batch_get_into(keys, outs) == [SIZE] * 8
            assert [bytes(o) for o in outs] == [page(k, 1) for k in keys]
        st = c.stats()["client"]
        assert st["spec_hits"] == 0 and st["spec_cached"] == 0


def test_location_cache_is_bounded_and_forgets_misses():
    cache = LocationCache(limit=100)
    keys = [b"k%d" % i for i in range(130)]
    cache.learn(keys, [("n", i * 4096, 10, i + 1, b"t", None) for i in range(130)])
    assert len(cache) <= 100 and cache.get(keys[-1])[3] == 130 and cache.get(keys[0]) is None
    cache.learn([keys[-1]], [None])
    assert cache.get(keys[-1]) is None
    assert same_place(("n", 1, 2, 3, b"a", None), ("n", 1, 2, 3, b"a", b"cap"))
    assert not same_place(("n", 1, 2, 3, b"a", None), ("n", 1, 2, 4, b"a", None))
    assert not same_place(None, ("n", 1, 2, 3, b"a", None))


def test_settle_keeps_only_equal_locations_read_without_error():
    s = Speculation(limit=10)
    loc = ("n", 0, 10, 7, b"t", None)
    moved = ("n", 4096, 10, 8, b"t", None)
    done = s.settle([loc, loc, loc, None], [True, False, True, False], [loc, loc, moved, loc])
    assert done == [True, False, False, False]
    assert (s.hits, s.wasted) == (1, 2) and s.skip == BACKOFF_BATCHES  # 2 of 3 tried were wasted
    assert all(s.plan([b"x"]) is None for _ in range(BACKOFF_BATCHES)) and s.skip == 0


def test_closed_pool_tcp_reads_ahead_with_the_capabilities_of_earlier_answers(make_cluster, tmp_path, monkeypatch):
    """Over TCP in a closed pool every read carries the read capability of the LOOKUP answer it came from: pages
    remembered from two different answers, read ahead in one batch, are served (no refusal, no dropped
    connection)."""
    from closedpool import closed_cluster, scoped_client, tokens_toml

    writer = "w-secret-0123456789abcdef"
    cl = closed_cluster(make_cluster, tmp_path, monkeypatch, tokens_toml({"w": (writer, {"t": "rw"})}), nodes=1)
    keys = [f"cp-{i}" for i in range(16)]
    with scoped_client(cl.metaserver_addrs, writer, "t", transport="tcp") as c:
        assert c.batch_put(keys, [page(k, 1) for k in keys]) == [True] * 16
        assert c.batch_get_into(keys[:8], [bytearray(SIZE) for _ in range(8)]) == [SIZE] * 8  # answer 1
        assert c.batch_get_into(keys[8:], [bytearray(SIZE) for _ in range(8)]) == [SIZE] * 8  # answer 2
        outs = [bytearray(SIZE) for _ in keys]
        assert c.batch_get_into(keys, outs) == [SIZE] * 16
        assert [bytes(o) for o in outs] == [page(k, 1) for k in keys]
        st = c.stats()["client"]
        assert st["spec_hits"] == 16 and st["spec_wasted"] == 0 and st["node_failures"] == 0, st
