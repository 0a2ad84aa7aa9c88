"""Operating a partitioned pool: STATS and NODES summed over the slot leaders (per process: slots led, objects, warm
copies and their lag), ``umbp stats``' text, EVICT split by use, and ``umbp up --metaservers 3`` (addresses,
metrics per process, a client reading back what it wrote)."""

from __future__ import annotations

import re

from cluster import NotYet, eventually
from test_metrics import scrape, value
from test_slots import SLOTS, filled, payload, wait_map
from test_up import up  # noqa: F401  (the fixture)
from transport import objformat, slotrules
from transport.wire import Op
from umbp.errors import UmbpError
from umbp.slotmap import split_by_use


def test_stats_and_nodes_aggregate_over_slot_leaders(make_cluster):
    cl, addrs, info, keys = filled(make_cluster, "s", 240)
    st = cl.cli_json("stats")
    assert st["objects"] == 240
    assert st["slots"] == SLOTS and st["slot_map"] == info["map"]
    per = {m["addr"]: m for m in st["metaservers"]}
    assert sorted(per) == sorted(addrs)
    assert sum(m["objects"] for m in per.values()) == 240
    for a in addrs:  # each process counts exactly the pages of the slots it leads
        mine = sum(1 for k in keys if info["map"][slotrules.slot_of("default", k, SLOTS)] == a)
        assert per[a]["objects"] == mine
        assert sorted(per[a]["slots_led"]) == [s for s, x in enumerate(info["map"]) if x == a]
    # Every slot has a warm copy on a process other than its leader; once the watch delivered the commits, each
    # copy is loaded with nothing left to apply (lag 0: an idle process applies as events come).
    seen = [per]

    def caught_up() -> dict:
        warm = {a: {int(s): w for s, w in m["warm_copies"].items()} for a, m in seen[0].items()}
        if all(w["loaded"] and w["lag"] == 0 for ws in warm.values() for w in ws.values()):
            return warm
        seen[0] = {m["addr"]: m for m in cl.ask("stats")["metaservers"]}  # polled in-process; the CLI was checked above
        raise NotYet(f"warm copies {warm}")

    warm = eventually(caught_up, 20.0, "every warm copy loaded with nothing left to apply", interval=0.2)
    per = seen[0]
    assert set().union(*(set(ws) for ws in warm.values())) == set(range(SLOTS)), warm
    held = sorted(len(ws) for ws in warm.values())
    assert len(held) == len(per) and held[-1] - held[0] <= 1, warm  # the copies spread as the leaders do
    for a, ws in warm.items():
        assert not set(ws) & set(per[a]["slots_led"]), (a, ws)
        for w in ws.values():
            assert w["loaded"] and w["lag"] == 0 and w["paused_s"] >= 0, w
    nodes = cl.cli_json("nodes")
    assert sorted(n["node_id"] for n in nodes) == sorted(n.node_id for n in cl.nodes)
    assert sum(n["objects"] for n in nodes) == 240
    assert sum(n["used_bytes"] for n in nodes) == st["used_bytes"] == 240 * objformat.object_size(6000)
    assert all(n["capacity_bytes"] == 64 << 20 and n["alive"] for n in nodes)
    assert st["capacity_bytes"] <= 2 * (64 << 20) and st["capacity_bytes"] > 2 * (64 << 20) - SLOTS * 2 * 4096
    text = cl.cli("stats").stdout
    assert f"{SLOTS} slots over 3 metaservers" in text
    assert text.count("events behind") == 3, text  # one line a metaserver, its warm copies
    for a in addrs:
        assert a in text
    # EVICT --bytes: split over the processes and their slots by use, not asked of each (S times too much).
    osize = objformat.object_size(6000)
    with cl.client() as c:
        res = c.admin(Op.EVICT, {"bytes": 10 * osize})
    assert res["freed_bytes"] >= 10 * osize and 10 <= res["evicted"] <= 10 + SLOTS, res
    assert cl.cli_json("stats")["objects"] == 240 - res["evicted"]


def test_split_by_use():
    assert split_by_use(100, [1, 1, 2]) == [25, 25, 50]
    assert split_by_use(10, [0, 0]) == [5, 5] and split_by_use(7, []) == []
    assert sum(split_by_use(1001, [3, 7, 11, 0])) == 1001 and split_by_use(1001, [3, 7, 11, 0])[3] == 0


def test_up_with_three_metaservers(up):
    """``umbp up --metaservers 3`` prints every address on its metaserver line, the slots spread over all three
    (each process's first rank), and a client given that line reads back exactly what it wrote."""
    u = up("--nodes", "2", "--capacity", "64MiB", "--port", "0", "--metaservers", "3", "--slots", str(SLOTS))
    line = u.stdout_until(r"^metaserver: (\S+)$")[0].group(1)
    addrs = line.split(",")
    assert len(addrs) == 3 and all(re.fullmatch(r"127\.0\.0\.1:\d+", a) for a in addrs), line
    metrics = u.stdout_until(r"^metrics: (\S+) \((\S+)\)$", 5)
    assert {"metaserver", "metaserver-1", "metaserver-2"} <= {m.group(2) for m in metrics}  # metrics per process
    wait_map(addrs, set(addrs), 30.0)
    import umbp

    with umbp.Client(metaserver=line) as c:
        keys = [f"up{i}".encode() for i in range(64)]
        def stored() -> bool:
            assert all(c.batch_put(keys, [payload(i) for i in range(64)]))
            return True

        eventually(stored, 30, "64 pages stored", interval=0.2, errors=(UmbpError,))
        outs = [bytearray(6000) for _ in keys]
        assert c.batch_get_into(keys, outs) == [6000] * 64
        assert all(bytes(o) == payload(i) for i, o in enumerate(outs))
    st = u.cli_json(line, "stats")
    assert st["objects"] == 64 and sorted(m["addr"] for m in st["metaservers"]) == sorted(addrs)
    # Metrics per process: each exports the pool gauges of the slots it leads; summed, they are the pool.
    scraped = [scrape(m.group(1)) for m in metrics
               if m.group(2).startswith("metaserver")]
    assert len(scraped) == 3
    got = sorted((int(value(x, "umbp_metaserver_slots_led")), int(value(x, "umbp_pool_objects"))) for x in scraped)
    want = sorted((len(m["slots_led"]), m["objects"]) for m in st["metaservers"])
    assert got == want and sum(o for _, o in got) == 64, (got, want)
    assert sum(value(x, "umbp_pool_used_bytes") for x in scraped) == 64 * objformat.object_size(6000)
    assert sum(value(x, "umbp_pool_puts_total") for x in scraped) == 64
    # Every slot's region of both nodes, once. A slot that moved to a joining process holds the nodes it loaded as
    # provisional (not counted) until each re-registers there, at its next heartbeat: so poll, bounded.
    full = range(2 * (64 << 20) - SLOTS * 2 * 4096 + 1, 2 * (64 << 20) + 1)
    def counted() -> float:
        cap = sum(value(scrape(m.group(1)), "umbp_pool_capacity_bytes") for m in metrics
                  if m.group(2).startswith("metaserver"))
        if int(cap) not in full:
            raise NotYet(f"capacity {cap}")
        return cap

    cap = eventually(counted, 20, lambda: f"the pool's capacity in {full}: {u.cli_json(line, 'nodes')}",
                     interval=0.2)
    assert int(cap) in full, (cap, u.cli_json(line, "nodes"))
    for n in st["nodes"]:
        assert sum(value(x, "umbp_pool_node_objects", node_id=n["node_id"]) for x in scraped) == n["objects"]
