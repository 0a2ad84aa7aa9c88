"""Read leases of the page table (``metaserver.table.columns.PageTable``), as functions of the table ``t``: a lease
pins rows a LOOKUP found until its owner releases it or it runs out (``PageTable.expire_leases``), so no writer is
given their extents meanwhile. The table keeps them: ``leases`` (lease -> (its rows, whether a row may repeat)),
``_lease_owner``, ``_lease_q`` (expiry order) and ``sliced``, the leases in slices: the parts of a slot's turn of
merged LOOKUPs share one lease of their slot's table (``SLICED``, ``TableDirectory.lookup_columns_many``), each
request given back its slice (``Slices``) by its process lease (``metaserver/ha/multislot.py``). No I/O.

Costs: a lease O(1) Python; ``release_many`` one unpin, stamp and state pass over all its rows, plus a Python step a
lease or slice and a row freed.
"""

from __future__ import annotations

import numpy as np

from metaserver.table.entry import GONE, READY, random_id
from metaserver.table.nodes import retire_if_done

_READY0, _PIN0 = np.array(READY, np.uint8), np.array(1, np.uint32)


class Slices:
    """The slices of a lease in slices (``PageTable.new_lease``'s ``ends``): slice j is the lease's rows
    ``ends[j-1]:ends[j]``, ``held[j]`` while not released; ``left`` slices held. The lease goes with its last slice."""

    __slots__ = ("ends", "held", "left")

    def __init__(self, ends: list[int]) -> None:
        self.ends = ends
        self.held = bytearray(b"\x01" * len(ends))
        self.left = len(ends)

    def rows_held(self, rows: np.ndarray) -> np.ndarray:
        """The rows of the slices held (``rows``: the lease's)."""
        if self.left == len(self.ends):
            return rows
        starts = [0] + self.ends[:-1]
        return np.concatenate([rows[a:b] for a, b, h in zip(starts, self.ends, self.held) if h] or [rows[:0]])


class _Sliced:
    """``SLICED``: the owner a merged LOOKUP's part asks with (``TableDirectory.lookup_columns_many``,
    ``lookup_columns``): its hits go under a slice of a lease in slices, which no connection owns."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "SLICED"


SLICED = _Sliced()


def new_lease(t, rows: np.ndarray, repeats: bool, now: float, owner: object, ends: list | None = None) -> int:
    """A read lease over ``rows``, pinned already (``repeats``: a row may be named more than once), that belongs to
    ``owner`` and runs out ``read_lease_s`` after ``now``. ``ends``: a lease in slices, ``rows[ends[j-1]:ends[j]]``
    slice j (``Slices``: a turn's merged LOOKUP parts, each released apart by its request)."""
    lease = random_id() or 1
    while lease in t.leases:
        lease = random_id() or 1
    t.leases[lease] = (rows, repeats)
    if owner is not None:
        t._lease_owner[lease] = owner
    if ends is not None:
        t.sliced[lease] = Slices(ends)
    t._lease_q.append((now + t.read_lease_s, lease))
    return lease


def disown(t, lease: int, owner: object) -> bool:
    """Take ``lease`` from ``owner`` ahead of its release (``release_many`` with no owner, later in the event
    loop's turn: ``metaserver/handlers/turns.py``): True when it was ``owner``'s and live. Its rows stay pinned
    until then, and no connection can release it meanwhile (nor again: a lease is counted released once)."""
    if t._lease_owner.get(lease) is not owner or lease not in t.leases:
        return False
    del t._lease_owner[lease]
    return True


def release_many(t, asks, slices=()) -> int:
    """``PageTable.release`` of each (lease, owner) of ``asks``, and of each (lease, j) of ``slices`` (slice j of a
    lease in slices, ``new_lease``'s ``ends``; a slice held only), in one pass over their rows (a turn's RELEASEs:
    one unpin, stamp and state pass, where a lease each cost about 8 us of numpy calls on the 2-core VM); how many
    it released. The rows are stamped in the order of ``asks``, then ``slices``, as releasing them one after the
    other would; the rows removed while pinned that lose their last pin here are freed in row order (one after the
    other would free each with the lease that held it last: another free-list order, so a later ALLOC may be placed
    elsewhere). A lease in slices released whole (expiry) unpins the slices still held."""
    owners, leases, sliced = t._lease_owner, t.leases, t.sliced
    got: list[np.ndarray] = []
    repeats = False
    for lease, owner in asks:
        if owner is not None and owners.get(lease) is not owner:
            continue
        held = leases.pop(lease, None)
        if held is None:
            continue
        owners.pop(lease, None)
        sl = sliced.pop(lease, None) if sliced else None
        got.append(held[0] if sl is None else sl.rows_held(held[0]))
        repeats |= held[1]
    for lease, j in slices:
        sl = sliced.get(lease)
        if sl is None or not sl.held[j]:
            continue
        got.append(leases[lease][0][sl.ends[j - 1] if j else 0:sl.ends[j]])
        repeats = True
        sl.held[j] = 0
        sl.left -= 1
        if not sl.left:
            del sliced[lease], leases[lease]
    if not got:
        return 0
    hr = got[0] if len(got) == 1 else np.concatenate(got)
    c = t.cols
    if repeats or len(got) > 1:  # (a row may be named twice: ``lookup_rows``, or by two leases)
        np.subtract.at(c["pins"], hr, _PIN0)
    else:
        c["pins"][hr] -= _PIN0
    st = c["state"].take(hr)
    if np.count_nonzero(st == _READY0) == len(hr):  # (count_nonzero: a fifth of .all()'s cost on a few rows)
        t._stamp(hr)
        if t.links.linking:
            t.links.requeue(hr)
        return len(got)
    t._stamp(hr[st == READY])
    if t.links.linking:
        t.links.requeue(hr[st == READY])
    gone = hr[(st == GONE) & (c["pins"][hr] == 0)]
    dead = set()
    for r in np.unique(gone).tolist():
        node = t.nodes[c["node"][r]]
        if node.dead:  # its arena is gone: only the row comes back, and the node may now be retired
            dead.add(node)
        else:
            t._free_extent(r, node)
        t._free_row(r, node)
    for node in dead:
        retire_if_done(t, node)
    return len(got)
