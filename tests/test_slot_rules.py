"""A partitioned pool's slot rule (``transport/slotrules.py``) is fixed when the pool is created and kept across
upgrades: a pool this release creates places keys by rule 2 (the key digest's bits) and says so in etcd and in its
LEADER answer; a pool an earlier release created (a slot count in etcd and no rule) keeps rule 1, so its pages stay
in their slots; a rule this release does not know stops the metaserver by name. An ALLOC routed by the other rule
(a client of an older release on a new pool) is refused by name, and no page is made.

Real etcd (``pool_slots`` against it), then real metaserver, node and client processes on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from cluster import Cluster
from test_failover import raw
from test_slots import wait_map
from metaserver.ha.slots import pool_slots
from metaserver.store.persist import EtcdStore
from transport import slotrules
from transport.wire import Op
from umbp.config import MetaserverConfig
from umbp.errors import BadRequest, StartupError

SLOTS = 4


def stored(etcd, prefix: str) -> dict[bytes, bytes]:
    """Every key and value under ``prefix`` in etcd."""
    async def scan():
        store = EtcdStore(etcd.url, prefix)
        try:
            return {kv.key: kv.value for kvs in [x async for x in store.scan(prefix.encode() + b"/")] for kv in kvs}
        finally:
            await store.close()
    return asyncio.run(scan())


def seed(etcd, prefix: str, items: dict[str, bytes]) -> None:
    """Write ``items`` (keys under ``prefix``) as an earlier release (or a damaged pool) left them."""
    async def put():
        store = EtcdStore(etcd.url, prefix)
        try:
            await store.wait_ready(10.0)
            assert await store.txn([store.op_put(f"{prefix}/{k}".encode(), v) for k, v in items.items()])
        finally:
            await store.close()
    asyncio.run(put())


def test_a_new_pool_is_rule_2_an_earlier_releases_pool_keeps_rule_1_and_an_unknown_rule_stops_by_name(etcd):
    cfg = MetaserverConfig(etcd=etcd.url, etcd_prefix="/umbp-rule-new", slots=SLOTS)
    assert asyncio.run(pool_slots(cfg)) == (SLOTS, slotrules.RULE_DIGEST)
    assert stored(etcd, "/umbp-rule-new") == {b"/umbp-rule-new/slots/rule": b"2", b"/umbp-rule-new/slots/count": b"4"}
    assert asyncio.run(pool_slots(cfg)) == (SLOTS, slotrules.RULE_DIGEST)  # read back, not written again

    seed(etcd, "/umbp-rule-old", {"slots/count": b"4"})  # a pool made before rule 2: its count, no rule
    old = MetaserverConfig(etcd=etcd.url, etcd_prefix="/umbp-rule-old", slots=SLOTS)
    assert asyncio.run(pool_slots(old)) == (SLOTS, slotrules.RULE_KEY_HASH)
    assert asyncio.run(pool_slots(MetaserverConfig(etcd=etcd.url, etcd_prefix="/umbp-rule-old"))) == (
        SLOTS, slotrules.RULE_KEY_HASH)  # a process without --slots joins it the same way
    assert stored(etcd, "/umbp-rule-old") == {b"/umbp-rule-old/slots/count": b"4"}  # no rule written into it

    seed(etcd, "/umbp-rule-bad", {"slots/count": b"4", "slots/rule": b"9"})
    with pytest.raises(StartupError, match=r"slot rule b'9', which this release does not know \(it knows \(1, 2\)\)"):
        asyncio.run(pool_slots(MetaserverConfig(etcd=etcd.url, etcd_prefix="/umbp-rule-bad")))

    one = MetaserverConfig(etcd=etcd.url, etcd_prefix="/umbp-rule-one")
    assert asyncio.run(pool_slots(one)) == (1, slotrules.RULE_DIGEST)
    assert stored(etcd, "/umbp-rule-one") == {}  # an unpartitioned pool writes no slot keys


def two_process_pool(harness, etcd, prefix: str) -> tuple[Cluster, list[str]]:
    """Two metaserver processes of a SLOTS-slot pool at ``prefix`` and one node, the slot map settled (each process
    serving the slots the balanced map gives it)."""
    cl = Cluster(harness, nodes=1, metaservers=2, capacity="64MiB",
                 metaserver_flags={"slots": SLOTS, "election_ttl": 2, "etcd_prefix": prefix})
    cl.etcd = etcd
    cl.metaservers = [harness.metaserver(etcd.url, **cl.metaserver_flags) for _ in range(2)]
    addrs = [m.addr for m in cl.metaservers]
    cl.add_node()
    cl.wait_nodes()

    wait_map(addrs, set(addrs), 30.0, SLOTS)  # (slots move once the second process joins: the balanced map)
    return cl, addrs


def differing_key(ns: str) -> tuple[bytes, int, int]:
    """A key whose slot differs under the two rules: (key, its rule-1 slot, its rule-2 slot)."""
    while True:
        k = os.urandom(32)
        one, two = slotrules.slot_of(ns, k, SLOTS, 1), slotrules.slot_of(ns, k, SLOTS, 2)
        if one != two:
            return k, one, two


def alloc_named(info: dict, ns: str, key: bytes, slot: int) -> dict:
    """A single-slot ALLOC of ``key`` naming ``slot``, sent to the process the map says leads it."""
    return raw(info["map"][slot], Op.ALLOC, {"ns": ns, "keys": [key], "sizes": [4096], "slot": slot})


def exists_named(info: dict, ns: str, key: bytes, slot: int) -> bool:
    """EXISTS of ``key`` in ``slot`` alone (a single-slot request naming it: trusted, so it looks only there)."""
    return raw(info["map"][slot], Op.EXISTS, {"ns": ns, "keys": [key], "slot": slot})["exists"][0]


@pytest.mark.parametrize("made_by", ["this release", "an earlier release"])
def test_a_pool_serves_by_its_own_rule_and_refuses_an_alloc_routed_by_the_other(harness, etcd, made_by):
    prefix = "/umbp-rule-e2e"
    rule = slotrules.RULE_DIGEST if made_by == "this release" else slotrules.RULE_KEY_HASH
    if made_by == "an earlier release":
        seed(etcd, prefix, {"slots/count": str(SLOTS).encode()})
    cl, addrs = two_process_pool(harness, etcd, prefix)
    info = raw(addrs[1], Op.LEADER)
    assert info["slots"] == SLOTS and info["slot_rule"] == rule

    ns = "rules"
    keys = [os.urandom(32) for _ in range(96)] + [b"page/%d" % i for i in range(96)]
    values = np.random.default_rng(5).integers(0, 256, (len(keys), 3000), dtype=np.uint8)
    with cl.client(namespace=ns) as c:
        assert c.batch_put(keys, list(values)) == [True] * len(keys)
        out = np.zeros_like(values)
        assert c.batch_get_into(keys, out) == [3000] * len(keys) and np.array_equal(out, values)
        assert c._meta.rule == rule  # learned from LEADER

    # each page is in its slot under the pool's rule: EXISTS naming that slot finds it, naming the slot the other
    # rule gives (where the two differ) does not
    mine = slotrules.slots_of(ns, keys, SLOTS, rule).tolist()
    other = slotrules.slots_of(ns, keys, SLOTS, 3 - rule).tolist()
    differ = 0
    for k, s, o in zip(keys, mine, other):
        assert exists_named(info, ns, k, s) is True
        if o != s:
            differ += 1
            assert exists_named(info, ns, k, o) is False
    assert differ > len(keys) // 2  # (with 4 slots about 3 keys in 4)

    k, one, two = differing_key(ns)
    wrong, right = (one, two) if rule == slotrules.RULE_DIGEST else (two, one)
    with pytest.raises(BadRequest, match=f"key 0 is not of slot {wrong} under this pool's slot rule {rule}") as e:
        alloc_named(info, ns, k, wrong)
    if rule == slotrules.RULE_DIGEST:
        assert "older than rule 2" in str(e.value)  # what an operator reads when an old engine meets a new pool
    assert len(alloc_named(info, ns, k, right)["nodes"]) == 1  # the key's own slot places it
    assert exists_named(info, ns, k, right) is False  # allocated, never committed: no page
