"""What the metaserver hands out with an ALLOC answer: the object tags and the write capabilities (umbp/auth.py),
one capability per node per batch, built from the placement's columns (``Placed``) without a Python object per key.

An ALLOC answer (wire VERSION 12) is ``{"nodes": [node_id, ...], "caps": [cap, ...], "rows": bytes}``: one
``answerrows.ALLOC_ROW`` a key (its state; for a NEW key its tag, generation, payload length, offset and the index of its
node in ``nodes``, which is also its capability's in ``caps``). A VERSION 11 request gets ``{"items": [[NEW, node,
off, size, gen, tag, cap_index] | [state, None, None, None, None], ...], "caps": [...]}``. ``caps[j]`` covers every
slot (offset, payload length, generation) of the batch on node j, so a batch costs one MAC per node instead of one
per key and the capability crosses the wire once per node; b"" in an open pool. A LOOKUP answer's tags and read
capabilities come the same way from the table's columns (``TableDirectory.lookup_granted``).

Costs: a keyed blake2b a NEW key (its tag; the page table keeps it in its ``tag`` column, so the key's first
LOOKUP does not compute it again), one a node (its capability), numpy work over the batch otherwise.
``dataplane.py`` calls ``grant_alloc``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from metaserver.table.entry import NEW, factor
from metaserver.table.nodes import UNIT_SHIFT
from transport import answerrows
from transport.keyform import pick
from umbp.auth import Tokens, write_capabilities_packed

_UNIT_U64 = np.uint64(UNIT_SHIFT)


class Placed:
    """An ALLOC's outcome as columns: ``state`` each key's state (int8: ``AllocState`` or ``entry.OVER_QUOTA``),
    ``new`` the positions of the NEW keys (int64) and, for those in order, ``node`` (an index into ``names``, the
    node ids), ``offs``, ``lens`` (payload lengths) and ``gens`` (uint64); ``rank``: the items are that rank's
    sub-slots of shared entries (tags of (key, rank)); ``keep``: called with the NEW keys' tags (the table keeps
    them), or None; ``fx``: the table's effects; ``rows``: the NEW keys' rows in the table (int64), or None
    (shared entries' sub-slots): what a connection's PENDING handles point at (``TableDirectory.pending_of``)."""

    __slots__ = ("state", "new", "node", "names", "offs", "lens", "gens", "rank", "keep", "fx", "rows")

    def __init__(self, state, new, node, names, offs, lens, gens, rank=None, keep=None, fx=None, rows=None):
        self.state, self.new, self.node, self.names = state, new, node, names
        self.offs, self.lens, self.gens = offs, lens, gens
        self.rank, self.keep, self.fx, self.rows = rank, keep, fx, rows

    @classmethod
    def of_items(cls, items: list, rank: int | None = None, fx=None) -> "Placed":
        """The columns of a list of items ``(NEW, node_id, off, plen, gen)`` | ``(state, None, ...)`` (shared
        entries' sub-slots: ``metaserver/table/shared.py``)."""
        state = np.array([it[0] for it in items], np.int8)
        new = np.flatnonzero(state == NEW)
        got = [items[i] for i in new.tolist()]
        ids = [it[1] for it in got]
        names = list(dict.fromkeys(ids))
        at = {n: j for j, n in enumerate(names)}
        return cls(state, new, np.array([at[n] for n in ids], np.int64), names,
                   np.array([it[2] for it in got], np.uint64), np.array([it[3] for it in got], np.uint64),
                   np.array([it[4] for it in got], np.uint64), rank, None, fx)

    @classmethod
    def of_rows(cls, t, state: np.ndarray, rows: np.ndarray, fx=None) -> "Placed":
        """The columns of ``alloc_rows``' answer (``state``, ``rows``) in page table ``t``: a plain page's tag is
        kept in its row's ``tag`` column once granted."""
        new = np.flatnonzero(state == NEW)
        r = rows.take(new)
        c = t.cols
        return cls(state, new, c["node"].take(r), t.node_names, c["unit"].take(r).astype(np.uint64) << _UNIT_U64,
                   t.code_arr.take(c["size"].take(r)), c["gen"].take(r), None, lambda tags: c["tag"].put(r, tags), fx,
                   r)

    def items(self) -> list:
        """The list form: ``(NEW, node_id, off, plen, gen)`` a NEW key, ``(state, None, None, None, None)`` else."""
        out: list = [(s, None, None, None, None) for s in self.state.tolist()]
        for i, n, o, ln, g in zip(self.new.tolist(), [self.names[j] for j in self.node.tolist()], self.offs.tolist(),
                                  self.lens.tolist(), self.gens.tolist()):
            out[i] = (NEW, n, o, ln, g)
        return out


def grant_alloc(tokens: Tokens, member: Callable, ns: str, keys: list, p: Placed, deadline_ms: int,
                packed: bool = True) -> dict:
    """The ALLOC answer of placement ``p`` (module docstring; ``packed``: VERSION 12's rows, else VERSION 11's
    items), with the NEW keys' tags and one write capability a node, expiring at ``deadline_ms``. ``member(node_id)``
    gives the member (``cap_key``, ``cap_epoch``) or None (its capability b"")."""
    new = p.new
    if not len(new):
        if packed:
            return {"nodes": [], "caps": [], "rows": answerrows.pack_allocs(p.state, new, (), (), (), (), ())}
        return {"items": [(s, None, None, None, None) for s in p.state.tolist()], "caps": []}
    tags = np.array(tokens.tags(ns, pick(keys, new.tolist()), p.rank), np.uint64)
    if p.keep is not None:
        p.keep(tags)
    uniq, inv, cnt = factor(p.node)  # by node, as np.unique(p.node, return_inverse=True) orders them
    names = [p.names[j] for j in uniq.tolist()]
    slots = np.empty((len(new), 3), "<u8")
    slots[:, 0], slots[:, 1], slots[:, 2] = p.offs, p.lens, p.gens
    if len(uniq) > 1:  # each node's slots together, in key order
        slots = slots.take(p.node.argsort(kind="stable"), axis=0)
    bounds = [0] + (cnt.take(uniq).cumsum() * 24).tolist()
    ms = [member(n) for n in names]
    caps = write_capabilities_packed([m.cap_key if m is not None else None for m in ms],
                                     [m.cap_epoch if m is not None else 0 for m in ms], slots.tobytes(), bounds,
                                     deadline_ms)
    if packed:
        return {"nodes": names, "caps": caps, "rows": answerrows.pack_allocs(p.state, new, tags, p.gens, p.lens, p.offs, inv)}
    out: list = [(s, None, None, None, None) for s in p.state.tolist()]
    for i, j, o, ln, g, t in zip(new.tolist(), inv.tolist(), p.offs.tolist(), p.lens.tolist(), p.gens.tolist(),
                                 tags.tolist()):
        out[i] = (NEW, names[j], o, ln, g, t, j)
    return {"items": out, "caps": caps}
