"""Membership: which storage nodes exist, their descriptions, liveness and etcd leases. No I/O.

A node is alive from REGISTER_NODE (or from being loaded out of etcd at a takeover: *provisional*, with a grace
period the caller sets through ``last_heartbeat``) until ``lease_ttl`` seconds pass without a heartbeat. A dead node stays listed (alive=False) for
``DEAD_KEEP_S`` so operators can see what went away, then is forgotten; re-registering revives it.

Space (allocator, pages) is the directory's business; this module only decides *when* a node's space is kept,
dropped or added, and returns that decision to the caller (``register`` says whether pages are kept).

Costs: register/heartbeat O(1); ``expired`` O(nodes) (nodes are few: one per host).
"""

from __future__ import annotations

import math
from typing import Any

DEAD_KEEP_S = 600.0


class Node:
    __slots__ = ("node_id", "host", "port", "pid", "capacity", "arena_id", "arena_path", "boot_id", "hostname",
                 "transports", "lease_ttl", "rdma", "alive", "draining", "last_heartbeat", "lease_id", "dead_since",
                 "conn", "refreshing", "provisional", "cap_key", "cap_epoch", "disk_id", "disk_capacity", "disk_path",
                 "acks_floor", "floor_acked")

    def __init__(self, desc: dict[str, Any], now: float):
        self.node_id: str = desc["node_id"]
        self.alive = True
        self.draining = False
        self.last_heartbeat = now
        self.lease_id = 0
        self.dead_since = 0.0
        self.refreshing = False
        self.provisional = False  # loaded from etcd at a takeover, not re-registered yet
        self.conn = None  # the connection it registered on: heartbeats come from it, a twin is refused while open
        self.cap_key: bytes | None = None  # capabilities for this node's arena (closed pools; umbp/auth.py)
        self.cap_epoch = 0  # the write capabilities' epoch since this registration (the node refuses older ones)
        # False from a registration of a node that acks its generation floor until a heartbeat says it holds
        # ``cap_epoch``: not placed on meanwhile (a deposed term's writer may still stream into its arena)
        self.floor_acked = True
        self.update(desc)

    def update(self, desc: dict[str, Any]) -> None:
        self.host = desc["host"]
        self.port = desc["port"]
        self.pid = desc.get("pid", 0)
        self.capacity = desc["capacity"]
        self.arena_id = desc["arena_id"]
        self.arena_path = desc.get("arena_path", "")
        self.boot_id = desc.get("boot_id", "")
        self.hostname = desc.get("hostname", "")
        self.transports = list(desc.get("transports") or [])
        self.lease_ttl = float(desc["lease_ttl"])
        self.rdma = desc.get("rdma")
        self.disk_id: bytes | None = desc.get("disk_id")  # its disk tier (umbp node --disk), None without one
        self.disk_capacity: int = desc.get("disk_capacity", 0)
        self.disk_path: str = desc.get("disk_path", "")
        self.acks_floor: bool = bool(desc.get("acks_floor"))  # it fences in-flight writes of deposed terms

    @property
    def lease_ttl_int(self) -> int:
        return max(1, math.ceil(self.lease_ttl))

    def record(self) -> dict[str, Any]:
        """What is persisted at ``{prefix}/nodes/{node_id}`` (under the node's lease)."""
        return {"node_id": self.node_id, "host": self.host, "port": self.port, "pid": self.pid,
                "capacity": self.capacity, "arena_id": self.arena_id, "arena_path": self.arena_path,
                "boot_id": self.boot_id, "hostname": self.hostname, "transports": self.transports,
                "lease_ttl": self.lease_ttl, "rdma": self.rdma, "lease_id": self.lease_id,
                **({"disk_id": self.disk_id, "disk_capacity": self.disk_capacity, "disk_path": self.disk_path}
                   if self.disk_id is not None else {}),
                **({"acks_floor": True} if self.acks_floor else {})}

    def info(self, used: int, objects: int) -> dict[str, Any]:
        """The node map of STATS and NODES."""
        return {"node_id": self.node_id, "host": self.host, "port": self.port, "addr": f"{self.host}:{self.port}",
                "pid": self.pid, "hostname": self.hostname, "boot_id": self.boot_id, "arena_id": self.arena_id,
                "arena_path": self.arena_path, "capacity_bytes": self.capacity,
                "used_bytes": used, "objects": objects, "alive": self.alive, "draining": self.draining,
                "provisional": self.provisional,
                "transports": self.transports, "rdma": self.rdma}


class Membership:
    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        # counts registrations and forgotten nodes: a node's capability key is set right after its registration
        # (no await between), so an unchanged version means unchanged ids and keys (multislot.py's node maps)
        self.version = 0

    def get(self, node_id: str) -> Node | None:
        return self.nodes.get(node_id)

    def register(self, desc: dict[str, Any], now: float) -> tuple[Node, bool]:
        """Record a registration. Returns (node, keep_pages): pages survive only when a live node re-registers
        the same arena (same arena_id and capacity: a node process restart that reopened its arena)."""
        self.version += 1
        node = self.nodes.get(desc["node_id"])
        if node is None:
            node = self.nodes[desc["node_id"]] = Node(desc, now)
            return node, False
        keep = node.alive and node.arena_id == desc["arena_id"] and node.capacity == desc["capacity"]
        node.update(desc)
        node.alive = True
        node.draining = False
        node.last_heartbeat = now
        node.dead_since = 0.0
        return node, keep

    def heartbeat(self, node_id: str, arena_id: bytes, now: float, conn) -> Node | None:
        """Refresh liveness; None when the node is unknown, dead, provisional (loaded at a takeover, not registered
        again), on another arena, or registered on another connection than ``conn`` (it must register again).
        Validates first, then mutates: a refused heartbeat never extends the node's life (a twin holding the
        cluster secret cannot keep a dead node listed alive)."""
        node = self.nodes.get(node_id)
        if node is None or not node.alive or node.arena_id != arena_id or node.provisional or node.conn is not conn:
            return None
        node.last_heartbeat = now
        return node

    def expired(self, now: float) -> list[Node]:
        """Mark nodes whose lease_ttl passed without a heartbeat dead and return them; forget long-dead ones."""
        out = []
        for node in list(self.nodes.values()):
            if node.alive and now - node.last_heartbeat > node.lease_ttl:
                node.alive = False
                node.dead_since = now
                out.append(node)
            elif not node.alive and now - node.dead_since > DEAD_KEEP_S:
                del self.nodes[node.node_id]
                self.version += 1
        return out
