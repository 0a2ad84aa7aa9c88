"""The full load: a page directory built from one etcd snapshot.

Shared by a leader that has no warm copy (``Metaserver._load``), by a warm standby's initial load and reloads
(``metaserver/standby.py``), by a partitioned pool's node sync (``partition.py``: ``node_descs``) and by
``bench/scale.py``'s load figures:

- ``node_descs``: every node with a valid record (leased record preferred over the durable arena record);
- ``fill``: an empty directory filled from the snapshot's page records, in commit order; what cannot stand comes
  back as stale or rejected records for the leader to delete;
- ``gc_paused``: the cyclic collector kept off while a load runs (half of ``fill``'s CPU otherwise);
- ``fingerprint``: a canonical summary of a directory, which tests compare between a full load and a warm copy.
"""

from __future__ import annotations

import contextlib
import gc
import logging

from metaserver import gcpolicy
from metaserver import validate as v
from metaserver.directory import Directory
from metaserver.records import PageRecords

log = logging.getLogger("umbp.metaserver")


def node_descs(live: list[dict], arenas: list[dict]) -> dict[str, tuple[dict, int]]:
    """Every node with a valid record: node_id -> (description, lease id of its leased record or 0). The leased
    record wins over the durable arena record (it is at least as new); invalid records are logged and skipped."""
    records = {r.get("node_id"): r for r in arenas}
    leases: dict = {}
    for r in live:
        records[r.get("node_id")] = r
        leases[r.get("node_id")] = int(r.get("lease_id") or 0)
    out: dict[str, tuple[dict, int]] = {}
    for node_id, rec in records.items():
        desc = describe(node_id, rec)
        if desc is not None:
            out[desc["node_id"]] = (desc, leases.get(node_id, 0))
    return out


def describe(node_id, rec: dict | None) -> dict | None:
    """The validated description of ``node_id``'s record, or None (no record, an invalid one: logged, or one that
    names another node)."""
    if rec is None:
        return None
    try:
        desc = v.node_description({k: rec.get(k) for k in v.REGISTER_FIELDS if k in rec})
    except v.Reject as e:
        log.warning("metaserver: ignoring node record %r: %s", node_id, e.message)
        return None
    return desc if desc["node_id"] == node_id else None


_gc_pause = [0, False]  # loads under way in ``gc_paused``; whether the collector was on when the first began


@contextlib.contextmanager
def gc_paused():
    """Keep the cyclic garbage collector off while a full load runs (enter and leave it on the event loop's
    thread; a load's ``fill`` runs in another thread meanwhile). Why: a load allocates tens of millions of objects
    that all survive, and every collection the allocation count triggers walks all of them so far; that was half of
    the CPU of ``fill`` (1 M pages: 7.3 s against 3.7 s without). Leaving, the load's survivors are moved to the
    oldest generation without a walk (``gc.freeze`` then ``gc.unfreeze``) instead of being walked by the first
    young collections of the serving loop; they are collected as usual from then on (with ``metaserver.gcpolicy``
    installed they stay frozen instead: what a load built is live). What it tolerates: cyclic
    garbage made by anything else meanwhile waits for the next collection."""
    st = _gc_pause
    if st[0] == 0:
        st[1] = gc.isenabled()
        gc.disable()
    st[0] += 1
    try:
        yield
    finally:
        st[0] -= 1
        if st[0] == 0 and st[1]:
            if gcpolicy.installed() is not None:
                gcpolicy.loaded()  # the policy keeps the load frozen: no step walks it (metaserver/gcpolicy.py)
            elif not gc.get_freeze_count():  # (someone else's frozen objects stay frozen)
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def fill(d: Directory, descs: dict[str, tuple[dict, int]],
         pages: PageRecords | list[tuple]) -> tuple[list[tuple], list[tuple]]:
    """Build an empty directory from a snapshot (the full load): a space per described node, not placeable, then its
    pages in commit order (``EtcdStore.load``'s ``PageRecords``, or ``EtcdStore.page_record`` tuples). Returns
    (stale, rejected) as ``page_record`` tuples: stale ones are unreadable or name a node without a record, rejected
    ones overlap another page or fall outside the arena; a leader deletes both. The records of each node are
    released once its pages are in (``PageRecords`` is empty afterwards), so what a load holds shrinks as the
    directory grows. O(pages log pages): one sort per node by revision (a C-level key over the revisions)."""
    for node_id, (desc, _) in descs.items():
        d.add_space(node_id, desc["capacity"])
        d.set_placeable(node_id, False)
    recs = pages if type(pages) is PageRecords else PageRecords.of(pages)
    stale: list[tuple] = [(0, None, "", b"", 0, 0, 0, None, k) for k in recs.junk]
    rejected: list[tuple] = []
    groups = recs.done()
    spaces = d.spaces
    for node_id in list(groups):
        ents, revs = groups.pop(node_id)
        if node_id not in spaces:
            stale.extend(record_tuple(recs, node_id, e, rev) for e, rev in zip(ents, revs))
            continue
        order = sorted(range(len(revs)), key=revs.__getitem__)  # recency restarts from commit order
        ents = list(map(ents.__getitem__, order))
        fx = d.load_entries(node_id, ents)
        if fx.deletes:  # the entries it did not file (``space`` None), by identity: one key may be in two records
            rejected.extend(record_tuple(recs, node_id, e, revs[i]) for e, i in zip(ents, order) if e.space is None)
        del ents, revs, order
    return stale, rejected


def record_tuple(recs: PageRecords, node_id: str, e, rev: int) -> tuple:
    """The ``page_record`` tuple of a record of ``node_id`` (stale or rejected: a few) from its entry."""
    return (rev, node_id, e.ns, e.key, e.offset, e.payload_len, e.gen, e.parent, recs.record_of(e))


def fingerprint(d: Directory) -> dict:
    """A canonical summary of a directory, equal for two directories that hold the same things (tests; O(n log n)):
    every entry with its place, state and parent link, every space's capacity, use and placeability, and each node's
    eviction order."""
    entries = sorted(
        (ns, k, e.node_id, e.offset, e.size, e.payload_len, e.gen, e.state, e.parent,
         e.parent_ref.key if e.parent_ref is not None else None, e.children)
        for ns, m in d.ready.items() for k, e in m.items())
    spaces = {node_id: (sp.alloc.capacity, sp.alloc.used, sp.placeable, len(sp.entries))
              for node_id, sp in d.spaces.items()}
    order = {node_id: [(e.ns, e.key) for e in d.policy.members(node_id)] for node_id in d.spaces}
    return {"entries": entries, "spaces": spaces, "order": order, "pending": d.pending, "pinned": d.pinned,
            "objects": d.objects}
