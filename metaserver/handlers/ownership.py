"""Who owns what the metaserver hands out, and per-namespace quotas: functions over one slot's page table
(``metaserver.table.directory.TableDirectory``), called by the service (``metaserver.ha.service.Metaserver``: RELEASE,
a connection's close), the data plane (a LOOKUP's lease, an ALLOC over quota) and a partition's merged answers.
Functions, not a class: each reads the directory alone (and a connection), and the service replaces its directory
every term, so it passes the current one at each call.

Read leases. A LOOKUP pins what it found under one lease with a random 63-bit id (``PageTable.lookup_rows``,
``entry.random_id``: not guessable, so one connection cannot name another's lease), owned by the connection that took
it. A RELEASE from any other connection is refused with NOT_FOUND and changes nothing, the same answer as for an
unknown or expired lease, so it tells nothing about other connections' leases; a connection's leases are released
when it closes (``drop_pending``, called by ``metaserver.server`` on close). A lease that nobody releases expires
after ``read_lease_s``.

PENDING allocations. An allocation belongs to the connection that made it, or to the one that retried the ALLOC with
the same token last (the answer of the first was lost, typically with its connection): only the owner's closing
aborts it, so a retry on a new connection is not aborted when the old one finally goes.

Quotas (``Tokens.quota_rules``: the tokens file's ``[quotas]`` names and patterns and its tokens' ``quota``, each a
group of namespaces sharing one quota: umbp/quotarules.py). A group's use is the object sizes (header included, 4 KiB
aligned: what it takes of the arenas) of its namespaces' READY and PENDING rows, kept exact by the table through
every transition (``check()`` verifies it). An ALLOC that would take its group over evicts the group's own least
recently used old READY pages first (never pinned or PENDING ones: metaserver/table/quotas.py); keys that still do not
fit fail the whole request: it allocates nothing and answers QUOTA (``QuotaExceeded`` naming the namespace and its
group). STATS shows ``used_bytes`` per namespace and ``quota_bytes``, its group's quota.

Costs: RELEASE O(pages under the lease); a connection's close O(its leases + its PENDING); quota checks O(1) per key,
quota eviction as metaserver/table/quotas.py says.
"""

from __future__ import annotations

from typing import Any

from metaserver import validate as v
from metaserver.table.entry import NEW, OVER_QUOTA
from transport.wire import Status
from umbp.errors import QuotaExceeded

LEASES_PRUNE_AT = 4096  # a connection's remembered lease ids are pruned of expired ones at this size at least
MAX_RELEASE = 4096  # lease ids in one RELEASE


class HeldLeases(set):
    """A connection's read lease ids, and the size at which ``own_lease`` next prunes them of expired ones: twice
    what a prune left (at least LEASES_PRUNE_AT), so a connection that holds many live leases costs O(1) amortized
    per LOOKUP, not a scan of every id it holds (that scan was 75% of the metaserver's CPU for a client never
    releasing 64-key LOOKUPs)."""

    __slots__ = ("prune_at",)

    def __init__(self) -> None:
        super().__init__()
        self.prune_at = LEASES_PRUNE_AT


def release_ids(meta: Any) -> list[int]:
    """The lease ids of a RELEASE: ``lease`` (one) or ``leases`` (a list of 1..MAX_RELEASE), not both."""
    m = v.fields(meta, frozenset({"lease", "leases"}))
    if ("lease" in m) == ("leases" in m):
        raise v.Reject("RELEASE takes 'lease' (an id) or 'leases' (a list of ids), exactly one of them")
    if "lease" in m:
        return [v.integer(m, "lease", 0, (1 << 63) - 1)]
    ids = m["leases"]
    if type(ids) is not list or not 1 <= len(ids) <= MAX_RELEASE:
        raise v.Reject(f"leases must be a list of 1..{MAX_RELEASE} lease ids")
    if not all(type(x) is int and 0 <= x < 1 << 63 for x in ids):
        raise v.Reject("leases must hold integers within 0..2^63-1")
    return ids


def release_answer(meta: dict, ids: list[int], released: int) -> dict:
    """The answer to a RELEASE that released ``released`` of ``ids``: ``lease`` (one id) is NOT_FOUND unless it was
    this connection's (unknown, expired and another connection's answer alike, so it tells nothing about others');
    ``leases`` answers the count."""
    if "lease" in meta:
        if not released:
            raise v.Reject(f"no read lease {ids[0]} held by this connection", Status.NOT_FOUND)
        return {}
    return {"released": released}


def release(d, meta: Any, conn, turn=None) -> dict:
    """RELEASE ``lease`` or ``leases``, a list of ids (the slots of one multi-slot LOOKUP: one frame for all of
    them), on directory ``d``; an id this connection does not hold changes nothing (``release_answer``). ``turn``:
    as ``release_held``."""
    ids = release_ids(meta)
    return release_answer(meta, ids, release_held(d, ids, conn, turn))


def release_held(d, ids: list[int], conn, turn=None) -> int:
    """Release those of ``ids`` that ``conn`` holds in directory ``d``; how many it held. With ``turn`` (the slot
    server's ``LookupTurn``, for a connection that waits in turns: ``turns.release_turn``) each leaves ``conn`` now
    (``PageTable.disown``) and is unpinned at the end of the event loop's turn with the turn's other releases, in
    one table call (``LookupTurn.free``); without, at once."""
    held = getattr(conn, "leases", None)
    n = 0
    for lease in ids:
        if held is not None:
            held.discard(lease)
        if turn is None:
            n += d.release(lease, conn)
        elif d.disown(lease, conn):
            turn.free(d, lease)
            n += 1
    return n


def own_lease(d, conn, lease: int) -> None:
    """Remember a lease of directory ``d`` on its connection (released when it closes). Leases that expired meanwhile
    are pruned when the set has doubled (``HeldLeases``), so a connection that never releases holds O(live leases)
    ids."""
    held = getattr(conn, "leases", None)
    if held is None:
        return
    if len(held) >= held.prune_at:
        live = d.leases
        held.intersection_update([x for x in held if x in live])
        held.prune_at = max(LEASES_PRUNE_AT, 2 * len(held))
    held.add(lease)


def drop_leases(d, conn) -> int:
    """``conn`` closed: its leases in ``d`` stay until they expire (``read_lease_s``), not released now. Its client
    may still be reading under them over the nodes' connections (a read that ends within ``lease_ms`` of its LOOKUP
    is accepted), and a lease is what keeps a read's extent from a new writer: released at the close, a removal and
    a put into the extent meanwhile gave the reader another page's bytes (tests/test_attack_leases.py). Counted in
    ``d.leases_orphaned`` (STATS ``leases_orphaned``). Returns how many were live."""
    held = getattr(conn, "leases", None)
    if not held:
        return 0
    live = d.leases
    n = sum(1 for lease in held if lease in live)
    held.clear()
    d.leases_orphaned += n
    return n


def drop_pending(d, conn, serving: bool) -> int:
    """The writer's connection closed: abort its allocations still PENDING in ``d`` (they can never be committed by
    it now), so other writers of those keys need not wait out ``pending_ttl_s``; its read leases run out on their
    own (``drop_leases``). Their extents are kept out of placement for the quarantine's ``keep_s`` (the writer may have
    its places and still write them: ``metaserver/table/quarantine.py``). An allocation another connection took over
    (an ALLOC retried with its token) is not this connection's any more and stays. Not ``serving``: only the
    connection's own sets are emptied."""
    drop_leases(d, conn)
    handles = list(conn.pending)
    conn.pending.clear()
    if not serving:
        return 0
    with d.quarantine.keeping():
        return d.abort_owned(handles, conn)


def refuse_over_quota(d, ns: str, keys: list, items: list) -> None:
    """Some keys of an ALLOC do not fit in ``ns``'s quota: give back what this request allocated in ``d`` (nothing
    was written: no capability left the metaserver) and raise QuotaExceeded naming the namespace."""
    new = [(k, it[4]) for k, it in zip(keys, items) if it[0] == NEW]
    if new:
        d.abort(ns, [k for k, _ in new], [g for _, g in new])
    over = sum(1 for it in items if it[0] == OVER_QUOTA)
    g = d.quotas.group_of(ns)
    group = "" if g.name == ns else f" (quota group {g.name!r}, shared by its namespaces)"
    share = f", this slot's share {g.limit}" if g.limit != g.quota else ""
    held = d.group_held(g.name)
    held = f", {held} freed but held until their write capabilities die" if held else ""
    raise QuotaExceeded("metaserver", f"namespace {ns!r} is over its quota of {g.quota} bytes{group}{share}: "
                                      f"{over} of {len(keys)} pages do not fit even after evicting its group's "
                                      f"unpinned old pages ({d.group_used.get(g.name, 0)} bytes in use{held}); "
                                      f"nothing of this request was allocated", Status.QUOTA)
