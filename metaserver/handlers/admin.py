"""The metaserver's admin requests: STATS, NODES, LIST, EVICT, DRAIN, LEADER (``Admin``, held by
``metaserver.ha.service.Metaserver`` as ``admin``, its bound methods in the service's dispatch table). A class holding
the service: it reads most of what the service owns (the term's directory, membership and etcd writer, the store's
address, the election, the takeover's record), and the term's parts are replaced at every term, so it reads them
through ``svc`` when it answers.

Authorization (umbp/auth.py): EVICT, DRAIN and a LIST of every namespace need an admin token; a LIST of one
namespace needs read rights on it; STATS and NODES any authenticated connection, but a scoped (non-admin) token sees
a scoped view: the per-namespace sections only for namespaces its scope grants (r or rw), no etcd address, and node
maps without node-internal fields (``NODE_INTERNAL``: arena path and id, boot id, pid, hostname: blanked, and shm
left out of the transports, so a scoped client uses TCP or RDMA: shm would map the whole arena, every tenant's
pages; a node's ARENA_INFO answers scoped tokens the same, umbp/node/server.py). Admin tokens, the cluster
secret and open pools see everything. Operator evictions run in slices
of EVICT_BUDGET evictions with the event loop served in between, so ``umbp evict --all`` on a pool of millions of
pages never stalls data requests. Costs: STATS and NODES O(nodes); LIST O(limit).
"""

from __future__ import annotations

import asyncio
from typing import Any

from metaserver import validate as v
from metaserver.table import queries
from metaserver.table.entry import Effects
from transport.wire import Status
from umbp.errors import AuthError

EVICT_BUDGET = 5_000  # evictions per slice of an operator's EVICT (and per background tick)
_NONE = frozenset()
NODE_INTERNAL = {"arena_path": "", "arena_id": b"", "boot_id": "", "pid": 0, "hostname": ""}  # blanked for scopes


def require_admin(conn, what: str) -> None:
    if not conn.auth.scope.admin:
        raise AuthError("metaserver", f"{what} needs an admin token; {conn.auth.scope.name!r} is not one")


class Admin:
    """The admin requests of one slot's service ``svc`` (see the module docstring)."""

    def __init__(self, svc):
        self.svc = svc

    def node_maps(self, full: bool = True) -> list[dict]:
        """Every node's map; ``full`` False: node-internal fields blanked (a scoped token's view)."""
        out = []
        d = self.svc.dir
        for node in self.svc.members.nodes.values():
            use = d.space_use(node.node_id) if node.alive else None
            used, objects = use if use is not None else (0, 0)
            info = node.info(used, objects)
            info.update(d.tiers.usage(node.node_id))  # its disk tier, zeros without one
            if not full:
                info.update(NODE_INTERNAL, transports=[t for t in info["transports"] if t != "shm"])
            out.append(info)
        return out

    def stats(self, meta: Any, conn) -> dict:
        v.fields(meta, _NONE)
        svc = self.svc
        d, w = svc.dir, svc.writer
        scope = conn.auth.scope
        usage = d.namespace_usage()  # ns -> {objects, used_bytes, quota_bytes}
        if not scope.admin:
            usage = {ns: u for ns, u in usage.items() if scope.right(ns)}
        out = {"capacity_bytes": d.capacity, "used_bytes": d.used, "objects": d.objects, "pending": d.pending,
               "pinned": d.pinned, "leases_orphaned": d.leases_orphaned, "held_bytes": d.quarantine.held_bytes, "hits": d.hits, "misses": d.misses,
               "evictions": d.evictions, "puts": d.puts,
               "namespaces": {ns: u["objects"] for ns, u in usage.items() if u["objects"]},
               "namespace_usage": usage, "is_leader": svc.serving, "etcd": svc.store.addr,
               "leader": svc.leader.leader_addr, "leader_revision": svc.leader.revision,
               "load_s": round(svc.load_s, 3), "takeover": svc.takeover, "etcd_pending_ops": w.pending(),
               "etcd_txns": w.txns, "etcd_ops": w.ops, "etcd_retries": w.failures, "etcd_txn_max_ops": w.batch,
               "ticks": svc.ticks, "nodes": self.node_maps(scope.admin)}
        _dc, _du, out["disk_capacity_bytes"], out["disk_used_bytes"] = d.tiers.totals()  # the disk tier (issue 47)
        out["demotions"], out["promotions"] = d.tiers.demotions, d.tiers.promotions
        out["dead_pages"] = d.commits.dead_pages  # pages that left named by a dead list, not a record rewrite
        # ALLOCs (and mover rounds) that waited for removals to be durable, and how long in all (handlers/dataplane.py)
        out["removal_waits"], out["removal_waited_s"] = w.barrier_waits, round(svc.dataplane.alloc_waited_s, 3)
        # LOOKUPs (and merged LOOKUPs' parts), and ALLOCs, answered a turn's at once, and their table passes
        # (handlers/turns.py)
        out["turn_lookups"], out["turn_passes"] = svc.lookups.asked, svc.lookups.passes
        out["turn_allocs"], out["turn_alloc_passes"] = svc.allocs.asked, svc.allocs.passes
        if not scope.admin:
            del out["etcd"]
        return out

    def nodes(self, meta: Any, conn) -> dict:
        v.fields(meta, _NONE)
        return {"nodes": self.node_maps(conn.auth.scope.admin)}

    def list_objects(self, meta: Any, conn) -> dict:
        m = v.fields(meta, frozenset({"ns", "limit"}))
        ns = v.ns(m) if m.get("ns") is not None else None
        if ns is None:
            require_admin(conn, "LIST of every namespace")
        else:
            conn.auth.scope.check(ns, False, "metaserver")
        limit = v.integer(m, "limit", 0, 1_000_000, default=1000)
        objects, truncated = queries.list_objects(self.svc.dir, ns, limit)
        return {"objects": objects, "truncated": truncated}

    def evict(self, meta: Any, conn):
        require_admin(conn, "EVICT")
        m = v.fields(meta, frozenset({"bytes", "all"}))
        if m.get("all") is not None and type(m["all"]) is not bool:
            raise v.Reject("all must be a boolean")
        d = self.svc.dir
        if m.get("all"):
            return self._evict_in_slices(lambda fx: d.evict_all(EVICT_BUDGET, fx))
        if m.get("bytes") is not None:
            want = [v.integer(m, "bytes", 0, 1 << 60)]

            def step(fx):
                n, freed = d.evict_bytes(want[0], EVICT_BUDGET, fx)
                want[0] -= freed
                return n, freed, want[0] <= 0 or n < EVICT_BUDGET
            return self._evict_in_slices(step)
        low = self.svc.cfg.low_watermark  # an operator's pass: every node above the low watermark goes down to it

        def step(fx):
            n, freed = d.watermark_pass(low, low, EVICT_BUDGET, fx)
            return n, freed, n < EVICT_BUDGET
        return self._evict_in_slices(step)

    async def _evict_in_slices(self, step) -> dict:
        """Run ``step(fx) -> (evicted, freed, done)`` slice after slice (each at most EVICT_BUDGET evictions),
        yielding to the event loop in between, so an operator's big eviction never stalls other requests."""
        total = freed = 0
        svc = self.svc
        term = svc.term
        for _ in range(1 << 40):  # bounded by the directory's size: every slice but the last evicts a full budget
            svc.check_term(term)
            fx = Effects()
            n, f, done = step(fx)
            svc._apply(fx)
            total += n
            freed += f
            if done:
                break
            await asyncio.sleep(0)  # let other requests in between slices
        return {"evicted": total, "freed_bytes": freed}

    def drain(self, meta: Any, conn) -> dict:
        require_admin(conn, "DRAIN")
        m = v.fields(meta, frozenset({"node_id"}), ("node_id",))
        svc = self.svc
        node = svc.members.get(v.node_id(m))
        if node is None:
            raise v.Reject(f"no node {m['node_id']!r}", Status.NOT_FOUND)
        node.draining = True
        dropped, pinned, fx = svc.dir.drain(node.node_id)
        svc._apply(fx)
        return {"dropped": dropped, "pinned": pinned}

    def leader_info(self, meta: Any, conn) -> dict:
        v.fields(meta, _NONE)
        return {"leader": self.svc.leader.leader_addr, "is_leader": self.svc.serving}
