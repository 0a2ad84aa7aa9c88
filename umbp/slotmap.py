"""Sums over the slots of a partitioned pool: STATS and node maps of several slot leaders merged into one answer
(``merge_stats``). A leaf module: the metaserver (``metaserver/ha/partition.py``, over the slots one process leads)
and the client (``umbp/slotrouter.py``, over every process) both use it, neither imports the other.

Pool-wide counts (capacity, used bytes, objects, hits, ...) are sums: every slot owns its own region of every node
and its own pages. A node appears once, with its record's capacity, its used bytes and objects summed over the
slots, alive if any slot sees it alive. Cost: O(parts * (fields + nodes)).
"""

from __future__ import annotations

from typing import Any

SUMMED = ("capacity_bytes", "used_bytes", "objects", "pending", "pinned", "leases_orphaned", "held_bytes", "hits",
          "misses", "evictions", "puts", "etcd_pending_ops", "etcd_txns", "etcd_ops", "etcd_retries", "ticks", "disk_capacity_bytes",
          "disk_used_bytes", "demotions", "promotions", "dead_pages", "removal_waits", "turn_lookups", "turn_passes",
          "turn_allocs", "turn_alloc_passes")


def split_by_use(total: int, uses: list[int]) -> list[int]:
    """``total`` bytes (an EVICT's) split over parts in proportion to the bytes each uses (evenly when none uses
    any), shares adding up to exactly ``total``, so asking every part for its share does not overshoot by the
    number of parts: largest remainders get the leftover bytes. O(parts log parts)."""
    n = len(uses)
    if n == 0:
        return []
    weights = uses if sum(uses) > 0 else [1] * n
    whole = sum(weights)
    shares = [total * w // whole for w in weights]
    left = total - sum(shares)
    for i in sorted(range(n), key=lambda i: (total * weights[i]) % whole, reverse=True)[:left]:
        shares[i] += 1
    return shares


def merge_nodes(lists: list[list[dict]]) -> list[dict]:
    """Node maps of several slots (or processes) merged by node id, in first-seen order."""
    out: dict[str, dict] = {}
    for nodes in lists:
        for n in nodes or ():
            nid = n.get("node_id")
            cur = out.get(nid)
            if cur is None:
                out[nid] = dict(n)
                continue
            cur["used_bytes"] = cur.get("used_bytes", 0) + n.get("used_bytes", 0)
            cur["objects"] = cur.get("objects", 0) + n.get("objects", 0)
            for k in ("disk_used_bytes", "disk_objects"):  # a slot's share of the node's disk tier
                cur[k] = cur.get(k, 0) + n.get(k, 0)
            cur["alive"] = bool(cur.get("alive")) or bool(n.get("alive"))
            cur["provisional"] = bool(cur.get("provisional")) and bool(n.get("provisional"))
            cur["draining"] = bool(cur.get("draining")) or bool(n.get("draining"))
    return list(out.values())


def merge_stats(parts: list[dict], addr: str = "") -> dict[str, Any]:
    """One STATS answer from several: numbers in SUMMED added, namespace counts and usage added per namespace,
    nodes merged (``merge_nodes``); ``takeover`` is the list of the parts' (one per slot); ``etcd_txn_max_ops``
    the smallest."""
    out: dict[str, Any] = {k: 0 for k in SUMMED}
    namespaces: dict[str, int] = {}
    usage: dict[str, dict] = {}
    for p in parts:
        for k in SUMMED:
            x = p.get(k)
            if type(x) is int:
                out[k] += x
        for ns, n in (p.get("namespaces") or {}).items():
            namespaces[ns] = namespaces.get(ns, 0) + n
        for ns, u in (p.get("namespace_usage") or {}).items():
            cur = usage.setdefault(ns, {"objects": 0, "used_bytes": 0, "quota_bytes": u.get("quota_bytes")})
            cur["objects"] += u.get("objects", 0)
            cur["used_bytes"] += u.get("used_bytes", 0)
    out["namespaces"] = namespaces
    out["namespace_usage"] = usage
    out["nodes"] = merge_nodes([p.get("nodes") or [] for p in parts])
    if any("etcd" in p for p in parts):
        out["etcd"] = next(p["etcd"] for p in parts if "etcd" in p)
    out["load_s"] = max([p.get("load_s", 0.0) for p in parts] or [0.0])
    caps = [p["etcd_txn_max_ops"] for p in parts if type(p.get("etcd_txn_max_ops")) is int]
    if caps:
        out["etcd_txn_max_ops"] = min(caps)  # the smallest writer's: below 1,024 once etcd refused one for its size
    out["takeover"] = [p.get("takeover") for p in parts if p.get("takeover")]
    return out
