"""Open allocations handed from a leader that gives its directory up on purpose to the leader after it.

A leader that stops serving on purpose (a partitioned pool's slot handover, ``partition.py``; a clean stop,
``Metaserver.close``) may hold allocations granted and not yet committed, and their writers may still write: a
client holds one slot's allocation while another slot of the same ALLOC fails over (seconds), and nothing fences a
shm write (nor any write in an open pool). The next leader places from what etcd says is free, so it could place a
new object on such an extent and the late write would overwrite it.

So the leaving leader writes ``{prefix}/open`` (``open_ops``), fenced: a handover in the transaction that deletes
the slot key, a clean stop in one just before it resigns: msgpack ``[wall time, [[node_id, offset, length],
...]]``, its open extents merged into runs. The next leader reads it at its takeover and keeps those runs
out of placement (``hold``: reserved, then released by its ``Quarantine``) until ``keep_s`` after the record was
written: the longest an open allocation's writer may write (``pending_ttl_s``, and a write capability's
``write_cap_ttl_s`` in a closed pool) plus clock skew. A leader that dies leaves no record: its open allocations are
unknown, and a writer still holding such a grant is stopped at the node by the generation floor the next term
raises there (a one-slot pool's REGISTER answer, a slot's FENCE: ``metaserver/ha/fence.py``), for nodes that keep
one (tests/test_attack_late_write.py).

Costs: one etcd op at the handover, one read at a takeover; the record is O(runs), and a batch's pages are placed
adjacent (runs of up to PLACE_RUN). At most MAX_RUNS runs are recorded (about 1 MB; etcd takes 1.5 MB a request):
the rest is left out, logged.
"""

from __future__ import annotations

import logging
import time

import msgpack

from metaserver.table import queries

log = logging.getLogger("umbp.metaserver")

MAX_RUNS = 30_000


def runs(extents: list[tuple[str, int, int]]) -> list[list]:
    """(node_id, offset, size) extents merged where one ends where the next starts: [[node_id, offset, length]]."""
    out: list[list] = []
    for node_id, off, size in sorted(extents):
        last = out[-1] if out else None
        if last is not None and last[0] == node_id and last[1] + last[2] == off:
            last[2] += size
        else:
            out.append([node_id, off, size])
    return out


def open_ops(store, d) -> list:
    """The etcd op that hands directory ``d``'s open allocations on (its PENDING entries, the extents of aborted
    ones it still keeps: ``Quarantine.keeping``, and the destinations of the disk tier's moves in flight, which
    the node may still write: ``Tiers.open_extents``): a put of the record, or a delete of an older record when
    there are none."""
    rs = runs(queries.open_extents(d) + d.quarantine.kept_extents() + d.tiers.open_extents())
    if not rs:
        return [store.op_delete(store.open_key)]
    if len(rs) > MAX_RUNS:
        log.warning("metaserver: %d runs of open allocations: handing the first %d on", len(rs), MAX_RUNS)
        rs = rs[:MAX_RUNS]
    log.info("metaserver: handing %d runs (%d bytes) of open allocations on", len(rs), sum(r[2] for r in rs))
    return [store.op_put(store.open_key, msgpack.packb([time.time(), rs]))]


def hold(d, blob: bytes | None) -> tuple[int, int]:
    """Keep the runs of record ``blob`` out of directory ``d``'s placement until its quarantine's ``keep_s`` after
    the record was written (``Quarantine.keep``). Returns (runs held, bytes). A record of unknown shape is logged
    and ignored."""
    if not blob:
        return 0, 0
    try:
        written, rs = msgpack.unpackb(blob, raw=False)
        left = float(written) + d.quarantine.keep_s - time.time()
        rs = [(str(n), int(o), int(ln)) for n, o, ln in rs]
    except (ValueError, TypeError, msgpack.exceptions.UnpackException) as e:
        log.warning("metaserver: ignoring an unreadable record of open allocations (%s)", e)
        return 0, 0
    if left <= 0:
        return 0, 0
    q, spaces = d.quarantine, d.spaces
    until = time.monotonic() + left
    n = nbytes = 0
    for node_id, off, length in rs:
        sp = spaces.get(node_id)
        if sp is None or sp.dead or not sp.alloc.reserve(off, length):
            continue  # a node gone since, or bytes another record holds: nothing to keep free there
        q.keep(sp, off, length, until)
        n += 1
        nbytes += length
    return n, nbytes
