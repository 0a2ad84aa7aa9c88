"""A one-slot pool keeps the unpartitioned etcd layout (docs/operations/upgrades.md "etcd records across versions"),
so a pool written by an earlier release is served after the switch to the one HA path, and a rolling upgrade's old
and new metaservers exclude each other on one leader key. Against a real etcd, one metaserver process
(``metaserver.ha.partition.Partition``) run in this test's event loop:

- an old-layout pool (page records of their own and a commit record under ``{prefix}/pages/``, ``{prefix}/gen``,
  ``arenas/``, written here as the earlier release's leader wrote them) is led at ``{prefix}/leader`` and served
  with every page: LIST, STATS and LEADER answer as the unpartitioned metaserver did, and no partitioned key
  (``slotmap/``, ``slots/``) is written;
- a process holding ``{prefix}/leader`` the old way (a raw etcd lease and the key, as an earlier release's
  ``Election`` campaigned) keeps a new process standing by, naming it as the leader, round after round; once its
  lease goes, the new process leads under a new fence revision.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgpack

from cluster import eventually_async
from metaserver.handlers.ownership import HeldLeases
from metaserver.ha.partition import Partition
from metaserver.store.persist import EtcdStore
from transport.wire import VERSION, Op
from transport.objformat import ARENA_DATA_START
from umbp.config import MetaserverConfig

UNIT = 4096
NS = "default"
ADDR = "127.0.0.1:1"


def node_rec(node_id: str, capacity: int = 256 * UNIT) -> dict:
    return {"node_id": node_id, "host": "127.0.0.1", "port": 9, "pid": 1, "capacity": capacity,
            "arena_id": b"A" * 16, "arena_path": "", "boot_id": "", "hostname": "h", "transports": ["tcp"],
            "lease_ttl": 3600.0, "rdma": None}


def admin_conn():
    scope = SimpleNamespace(admin=True, node=True, name="admin", right=lambda ns: "rw", check=lambda *a: None)
    return SimpleNamespace(auth=SimpleNamespace(scope=scope), pending=set(), leases=HeldLeases(), closed=False,
                           version=VERSION, peer="test", slot_conns={})


async def write_old_layout(store: EtcdStore) -> list[bytes]:
    """The records an earlier release's unpartitioned leader left: 20 pages with records of their own (the layout
    before commit records), a commit record of 20 more, the generation counter and the node's arena record."""
    keys = [b"old%03d" % i for i in range(40)]
    ops = [store.op_put(store.arena_key("n1"), msgpack.packb(node_rec("n1"), use_bin_type=True)),
           store.op_put(store.gen_key, b"1000")]
    for i, k in enumerate(keys[:20]):
        ops.append(store.op_put(store.page_key(NS, k), store.page_value("n1", ARENA_DATA_START + i * UNIT, 1000,
                                                                        i + 1, None)))
    rec = [[k, "n1", ARENA_DATA_START + (20 + i) * UNIT, 1000, 21 + i, keys[19 + i] if i else None]
           for i, k in enumerate(keys[20:])]
    ops.append(store.op_put(f"{store.prefix}/pages/{NS}/+1a.1".encode(), msgpack.packb(rec, use_bin_type=True)))
    assert await store.txn(ops)
    return keys


async def partitioned_keys(store: EtcdStore) -> list[bytes]:
    out = []
    for sub in (b"/slotmap/", b"/slots/"):
        async for kvs in store.scan(store.prefix.encode() + sub):
            out += [kv.key for kv in kvs]
    return out


def test_an_old_layout_one_slot_pool_is_served_with_every_page(etcd):
    cfg = MetaserverConfig(etcd=etcd.url, etcd_prefix="/umbp-compat-layout", election_ttl_s=2)

    async def main():
        store = EtcdStore(etcd.url, cfg.etcd_prefix)
        await store.wait_ready(10)
        keys = await write_old_layout(store)
        p = Partition(cfg, ADDR, 1)
        try:
            await p.start()
            assert p.serving and p.leader.is_leader
            value, rev, lease = await store.leader()
            assert value == ADDR.encode() and lease == p.lease and rev == p.leader.revision
            conn = admin_conn()
            listed = p.handlers[Op.LIST]({}, conn)
            assert sorted(o[1] for o in listed["objects"]) == keys and not listed["truncated"]
            s = p.handlers[Op.STATS]({}, conn)
            assert s["objects"] == 40 and s["is_leader"] is True and s["leader"] == ADDR
            assert s["leader_revision"] == rev and s["takeover"]["load_pages"] == 40 and "slots" not in s
            assert p.handlers[Op.LEADER]({}, conn) == {"leader": ADDR, "is_leader": True}
            found = p.handlers[Op.EXISTS]({"ns": NS, "keys": keys}, conn)
            assert found["exists"] == [True] * 40
            assert await partitioned_keys(store) == []  # the unpartitioned layout, nothing else
        finally:
            await p.close()
        assert await store.leader() is None  # a clean stop resigned the key
        await store.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_leader_key_held_the_old_way_keeps_a_new_process_standing_by(etcd, capsys):
    cfg = MetaserverConfig(etcd=etcd.url, etcd_prefix="/umbp-compat-holder", election_ttl_s=2)
    old = "10.0.0.9:7000"

    async def main():
        store = EtcdStore(etcd.url, cfg.etcd_prefix)
        await store.wait_ready(10)
        keys = await write_old_layout(store)
        lease = await store.grant(30)  # an earlier release's Election: a lease of its own, then the key
        won, old_rev, _, _ = await store.campaign(old.encode(), lease)
        assert won
        p = Partition(cfg, ADDR, 1)
        try:
            await p.start()
            rounds = p.rounds
            await eventually_async(lambda: p.rounds >= rounds + 8, 20, "eight election rounds")
            assert not p.serving and not p.leader.is_leader
            assert p.leader.leader_addr == old
            assert p.handlers[Op.LEADER]({}, admin_conn()) == {"leader": old, "is_leader": False}
            assert p.metrics.ready() == (True, f"metaserver: standby, leader is {old}")
            assert await store.leader() == (old.encode(), old_rev, lease)  # never taken, never touched
            await eventually_async(lambda: p.servers["0"].warm is not None and p.servers["0"].warm.loaded, 20,
                                   "the standby's warm copy loaded")
            await store.revoke(lease)  # the old metaserver stops (or its lease runs out)
            await eventually_async(lambda: p.serving, 20, "the new process leading")
            value, rev, _ = await store.leader()
            assert value == ADDR.encode() and rev > old_rev
            assert p.servers["0"].takeover["warm"] is True and p.servers["0"].dir.objects == len(keys)
        finally:
            await p.close()
        await store.close()

    asyncio.run(asyncio.wait_for(main(), 90))
    out = capsys.readouterr().out
    assert f"metaserver: standby, leader is {old}" in out and "metaserver: leader at revision" in out
