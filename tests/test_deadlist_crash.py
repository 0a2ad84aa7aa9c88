"""Evictions as dead lists across a metaserver crash (real etcd, metaserver and node processes; etcd behind
``proxies.Proxy``): an evicted page of a record that keeps other pages is named by a dead-list
record, not a rewrite of its record (metaserver/table/commits.py). Lost (the metaserver SIGKILLed while etcd is
held): the page reloads, and reads back as its own bytes or a miss, never another object's, since no ALLOC placed
anything in its extent before the dead list was durable (the removal barrier). Durable: the next term does not load
the page, serves the record's other pages, and compacts the record once half of it is gone (the dead list's key
may stay, kept to overwrite: what it names is gone from etcd)."""

from __future__ import annotations

import signal
import time

import pytest

from cluster import eventually
from metaserver.table.records import SEG_DEAD_VERSION, is_segment, pages_of, unpack_segment
from test_evict_reuse import NS, P_LEN, R_LEN, UNIT, header_at, proxied_cluster
from test_failover import wait_leader
from test_pool import payload
from transport import wire
from transport.framed import FramedSocket
from transport.wire import Op
from umbp.errors import UmbpError

FIRST = 8  # pages of the first record: one of them evicted leaves 7, so a dead list names it (no rewrite)


def _kvs(etcd_url: str) -> dict[bytes, bytes]:
    import asyncio

    import aetcd

    async def go():
        host, port = etcd_url.split("//")[-1].rsplit(":", 1)
        async with aetcd.Client(host, int(port)) as cl:
            return await cl.get_prefix(b"/")

    return {kv.key: kv.value for kv in asyncio.run(go())}


def dead_lists(etcd_url: str) -> list[bytes]:
    """etcd keys of the dead-list segments (version 3) etcd holds."""
    return [k for k, v in _kvs(etcd_url).items() if is_segment(v) and v[1] == SEG_DEAD_VERSION]


def still_listed(etcd_url: str) -> int:
    """Pages a dead list names that their record's value in etcd still lists (0: every dead list is moot)."""
    kvs = _kvs(etcd_url)
    n = 0
    for v in kvs.values():
        if is_segment(v) and v[1] == SEG_DEAD_VERSION:
            seg = unpack_segment(v)
            for name, gen in zip([seg.dead_recs[i] for i in seg.dead_ix.tolist()], seg.dead.tolist()):
                n += name in kvs and gen in [p[4] for p in pages_of(kvs[name])]
    return n


def full_pool(cl, c) -> list[str]:
    n = (1 << 20) // (4 * UNIT)
    keys = [f"p/{i}" for i in range(n)]
    assert c.batch_put(keys[:FIRST], [payload(k, P_LEN) for k in keys[:FIRST]]) == [True] * FIRST  # oldest record
    assert c.batch_put(keys[FIRST:], [payload(k, P_LEN) for k in keys[FIRST:]]) == [True] * (n - FIRST)
    eventually(lambda: c.stats()["etcd_pending_ops"] == 0 and c.stats()["used_bytes"] == 1 << 20, 30.0,
               "the full arena durable in etcd", interval=0.05)
    assert not dead_lists(cl.etcd.url)
    return keys


def alloc_r(cl, timeout_s: float):
    """R's ALLOC (1 unit, evicting the oldest page): its place, or None when not answered in ``timeout_s``."""
    writer = FramedSocket(cl.metaserver.addr, "test writer", time.monotonic() + 5)
    try:
        items = writer.request(Op.ALLOC, {"ns": NS, "keys": [b"r"], "sizes": [R_LEN]},
                               time.monotonic() + timeout_s).meta["items"]
        assert items[0][0] == wire.AllocState.NEW, items
        return writer, items[0][2]
    except UmbpError as e:
        print(f"\nR's ALLOC not answered while etcd is out of reach ({e})")
        return writer, None


@pytest.mark.parametrize("commit", ["durable", "async"])
def test_a_lost_dead_list_reloads_its_page_only_as_itself_or_a_miss(harness, etcd_binary, commit):
    cl, proxy = proxied_cluster(harness, commit)
    node = cl.nodes[0]
    arena = node.arena_dir / f"umbp-{node.node_id}.arena"
    c = cl.client(namespace=NS, timeout=3.0)
    writer = None
    try:
        keys = full_pool(cl, c)
        proxy.hold()
        try:
            writer, r_off = alloc_r(cl, 3)  # evicts a page of the first record: its death is a dead list, held
            try:
                c.put("q", payload("q", 3 * UNIT - 300))  # a writer that would write into a freed extent
            except UmbpError as e:
                print(f"{commit}: Q's put failed while etcd is out of reach ({e})")
            assert c.stats()["evictions"] >= 1
            if r_off is not None:
                print(f"{commit}: R placed at {r_off}, header there {header_at(arena, r_off)}")
            cl.metaserver.kill(signal.SIGKILL)  # the dead list never reaches etcd
            proxy.drop()
            assert proxy.kept > 0
        finally:
            proxy.release()
        assert not dead_lists(cl.etcd.url)
        cl.metaserver.start()
        wait_leader(cl, timeout=60.0)
        eventually(lambda: all(c.get(k) == payload(k, P_LEN) for k in keys[FIRST:FIRST + 4]), 60.0,
                   "the durable pages served by the next term", interval=0.2)
        got = {k: c.get(k) for k in keys[:FIRST]}
        wrong = [k for k, v in got.items() if v is not None and v != payload(k, P_LEN)]
        assert not wrong, f"{commit}: {wrong} read back with other bytes"
        print(f"{commit}: first record after the crash: {sum(v is None for v in got.values())} misses")
    finally:
        if writer is not None:
            writer.close()
        c.close()
        proxy.close()


def test_a_durable_dead_list_is_a_miss_after_a_crash_and_the_next_term_compacts_it(harness, etcd_binary):
    cl, proxy = proxied_cluster(harness, "durable")
    c = cl.client(namespace=NS, timeout=10.0)
    writer = None
    try:
        keys = full_pool(cl, c)
        writer, r_off = alloc_r(cl, 10)
        assert r_off is not None, "answered once the dead list is durable"
        (dl,) = dead_lists(cl.etcd.url)  # the eviction: a dead list, the first record as it was
        assert still_listed(cl.etcd.url) == 1
        gone = [k for k in keys[:FIRST] if not c.exists(k)]
        assert len(gone) == 1, gone
        assert c.stats()["dead_pages"] == 1  # STATS counts it (umbp_pool_dead_listed_pages_total)
        cl.metaserver.kill(signal.SIGKILL)
        cl.metaserver.start()
        wait_leader(cl, timeout=60.0)
        left = [k for k in keys[:FIRST] if k not in gone]
        eventually(lambda: all(c.get(k) == payload(k, P_LEN) for k in left), 60.0,
                   "the first record's other pages served by the next term", interval=0.2)
        assert c.get(gone[0]) is None, "a durable dead list: the page is not loaded again"
        assert still_listed(cl.etcd.url) == 1, "a load rewrites nothing: the death counts toward compaction"
        assert c.batch_remove(left[:3]) == [True] * 3  # half of the record gone: compacted
        eventually(lambda: still_listed(cl.etcd.url) == 0, 30.0, "the next term compacted the record (the dead "
                   "list's key may stay, to overwrite)", interval=0.1)
        assert all(c.get(k) == payload(k, P_LEN) for k in left[3:]) and c.get(gone[0]) is None
    finally:
        if writer is not None:
            writer.close()
        c.close()
        proxy.close()
