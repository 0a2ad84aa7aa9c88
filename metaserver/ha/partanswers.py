"""The process-level answers of one metaserver process of a partitioned pool (``ProcessAnswers``, held by
``metaserver.ha.partition.Partition`` as ``answers``, its bound methods in the process's dispatch table; a class
holding the partition, whose slot servers, slot map and members change as its election goes): LEADER with the slot
map, and STATS, NODES, LIST, EVICT and DRAIN over the slots the process leads, each slot asked through its own
``SlotServer`` and the answers summed (``umbp.slotmap.merge_stats``); an EVICT of a byte count is split over the
slots by their use (``split_by_use``), not asked of every slot. The admin CLI asks every process
and sums again (``umbp/slotmap.py``).

Costs: O(slots led) slot answers per request; LIST O(limit) per slot.
"""

from __future__ import annotations

from typing import Any

from metaserver import validate as v
from metaserver.handlers.admin import require_admin
from metaserver.ha.slots import MEMBERSHIP
from transport.wire import Op
from umbp.slotmap import merge_stats, split_by_use


class ProcessAnswers:
    """What the partition ``p`` answers for the process as a whole (it reads ``p.servers``, ``page_slots``,
    ``membership``, ``slots``, ``members``, ``addr``, ``handovers``, ``combiner``, ``led``, ``holder`` and
    ``_slot_conn``)."""

    def __init__(self, p):
        self.p = p

    def slot_map(self) -> list[str | None]:
        p = self.p
        return [p.holder(s) for s in p.page_slots]

    def leader_info(self, meta: Any, conn) -> dict:
        v.fields(meta, frozenset())
        p = self.p
        return {"leader": p.holder(MEMBERSHIP), "is_leader": p.membership.serving,
                "slots": p.slots, "slot_rule": p.rule, "map": self.slot_map(), "members": sorted(p.members)}

    def stats(self, meta: Any, conn) -> dict:
        v.fields(meta, frozenset())
        p = self.p
        parts = [p.servers[s].admin.stats(meta, p._slot_conn(conn, s)) for s in p.led()]
        out = merge_stats(parts, p.addr)
        c = p.combiner
        out.update({"metaserver": p.addr, "slots": p.slots, "slots_led": [int(s) for s in p.led()],
                    "slot_map": self.slot_map(), "members": sorted(p.members),
                    "membership_leader": p.holder(MEMBERSHIP), "handovers": p.handovers,
                    "is_leader": bool(parts), "leader": p.holder(MEMBERSHIP),
                    "etcd_combined": {"txns": c.txns, "parts": c.parts, "split": c.split, "max_ops": c.max_ops},
                    "warm_copies": {str(s): srv.warm.state() for s, srv in p.servers.items()
                                    if srv.warm is not None and s != MEMBERSHIP},
                    # per slot led, the nodes it places on now (a node new to its term waits for its FENCE)
                    "placeable_nodes": {str(s): sum(sp.placeable for sp in p.servers[s].dir.spaces.values())
                                        for s in p.led()}})
        if not parts:
            out["nodes"] = self.nodes(meta, conn)["nodes"]
        return out

    def nodes(self, meta: Any, conn) -> dict:
        v.fields(meta, frozenset())
        p = self.p
        m = p.membership
        parts = [{"nodes": p.servers[s].admin.nodes(meta, conn)["nodes"]} for s in p.led()]
        if m.serving:
            parts.append({"nodes": [dict(n, used_bytes=0, objects=0) for n in m.admin.nodes(meta, conn)["nodes"]]})
        return {"nodes": merge_stats(parts, p.addr).get("nodes", [])}

    def list_objects(self, meta: Any, conn) -> dict:
        objects, truncated = [], False
        p = self.p
        for s in p.led():
            res = p.servers[s].admin.list_objects(meta, p._slot_conn(conn, s))
            objects.extend(res["objects"])
            truncated = truncated or res["truncated"]
        limit = meta.get("limit", 1000) if type(meta) is dict and type(meta.get("limit")) is int else 1000
        return {"objects": objects[:limit], "truncated": truncated or len(objects) > limit}

    def _all_slots(self, op: int, meta: Any, conn, keys: tuple[str, ...]):
        return self._sum_over(op, [(s, meta) for s in self.p.led()], conn, keys)

    async def _sum_over(self, op: int, asks: list, conn, keys: tuple[str, ...]) -> dict:
        """Ask each (slot, meta) of ``asks`` with ``op`` in turn; the answers' ``keys`` summed."""
        out = {k: 0 for k in keys}
        p = self.p
        for s, meta in asks:
            res = p.servers[s].handlers[op](meta, p._slot_conn(conn, s))
            if type(res) is not dict:
                res = await res
            for k in keys:
                out[k] += res.get(k, 0)
        return out

    def evict(self, meta: Any, conn):
        require_admin(conn, "EVICT")
        if type(meta) is dict and type(meta.get("bytes")) is int and meta["bytes"] >= 0 and len(meta) == 1:
            return self._evict_bytes(meta["bytes"], conn)
        return self._all_slots(Op.EVICT, meta, conn, ("evicted", "freed_bytes"))

    def _evict_bytes(self, want: int, conn):
        """EVICT {"bytes"}: the bytes split over the slots led here by their use (``split_by_use``), not asked of
        every slot (S times too much)."""
        led = self.p.led()
        shares = split_by_use(want, [self.p.servers[s].dir.used for s in led])
        return self._sum_over(Op.EVICT, [(s, {"bytes": share}) for s, share in zip(led, shares) if share > 0], conn,
                              ("evicted", "freed_bytes"))

    def drain(self, meta: Any, conn):
        require_admin(conn, "DRAIN")
        return self._all_slots(Op.DRAIN, meta, conn, ("dropped", "pinned"))
