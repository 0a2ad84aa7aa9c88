"""What a full load from one etcd snapshot needs besides the table's own load (``TableDirectory.load``,
``metaserver/table/load.py``). Shared by a leader that has no warm copy (``Metaserver._load``), a warm standby's
loads (``metaserver/ha/standby.py``), a partitioned pool's node sync (``partition.py``) and ``bench/scale.py``:

- ``node_descs``: every node with a valid record (leased record preferred over the durable arena record);
- ``gc_paused``: the cyclic collector kept off while a load runs (its parse makes an object a page).
"""

from __future__ import annotations

import contextlib
import gc
import logging

from metaserver.store import gcpolicy
from metaserver import validate as v

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
    thread; ``TableDirectory.load`` runs in another thread meanwhile). Why: the records' parse makes an
    ``entry.Entry`` a page (``PageRecords``), and each lives until the table has filed its node's pages, so every
    collection the allocation count triggers walks all of them so far: 500 k pages in commit records of 128 (the
    2-core VM) took 0.82-0.85 CPU-s to parse and 0.95-1.01 to load with the collector on, 0.35-0.36 and 0.82-0.86
    with it off. Leaving, the load's survivors are moved to the oldest generation without a walk (``gc.freeze`` then
    ``gc.unfreeze``) instead of being walked by the first young collections of the serving loop; they are collected
    as usual from then on (with ``metaserver.store.gcpolicy`` installed they stay frozen instead: what a load built is
    live). What it tolerates: cyclic garbage made by anything else meanwhile waits for the next collection."""
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
                gcpolicy.loaded()  # the policy keeps the load frozen: no step walks it (metaserver/store/gcpolicy.py)
            elif not gc.get_freeze_count():  # (someone else's frozen objects stay frozen)
                gc.freeze()
                gc.unfreeze()
            gc.enable()
