"""What the metaserver hands out with an ALLOC answer: the object tags and the write capabilities (umbp/auth.py),
one capability per node per batch, built from the placement's columns (``Placed``) without a Python object per key.

An ALLOC answer (wire VERSION 12) is ``{"nodes": [node_id, ...], "caps": [cap, ...], "rows": bytes}``: one
``answerrows.ALLOC_ROW`` a key (its state; for a NEW key its tag, generation, payload length, offset and the index of its
node in ``nodes``, which is also its capability's in ``caps``). A VERSION 11 request gets ``{"items": [[NEW, node,
off, size, gen, tag, cap_index] | [state, None, None, None, None], ...], "caps": [...]}``. ``caps[j]`` covers every
slot (offset, payload length, generation) of the batch on node j, so a batch costs one MAC per node instead of one
per key and the capability crosses the wire once per node; b"" in an open pool.

A LOOKUP answer's tags and read capabilities come the same way from the table's columns, as functions of the table
``t`` (a ``TableDirectory``, whose ``lookup_granted``, ``lookup_columns``, ``lookup_columns_many`` and
``granted_answer`` call them): ``lookup_columns`` finds, pins and leases the hits and gathers their tag, capability
slot and node columns; ``lookup_columns_many`` does it for a turn's LOOKUPs in one pass (``metaserver/handlers/
turns.py``); ``granted_answer`` groups the hits by node (``by_node``), MACs one read capability a node and packs the
rows (``answerrows.pack_locs``).

Costs: a keyed blake2b a NEW key (its tag; the page table keeps it in its ``tag`` column, so the key's first
LOOKUP does not compute it again), one a node (its capability), numpy work over the batch otherwise.
``dataplane.py`` calls ``grant_alloc``.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Callable

import numpy as np

from metaserver.table.columns import by_key
from metaserver.table.entry import NEW, factor
from metaserver.table.leases import SLICED
from metaserver.table.nodes import UNIT_SHIFT
from transport import answerrows
from transport.keyform import joined_keys, pick
from umbp.auth import Tokens, rank_tags, read_capabilities_packed, write_capabilities_packed

_UNIT_U64 = np.uint64(UNIT_SHIFT)
_UNIT0 = np.array(UNIT_SHIFT, np.uint64)  # (a 0-d operand: a numpy scalar or int costs a small batch's ufunc twice)
_SLOT0 = np.array(24, np.int64)  # bytes of a capability slot (offset, payload length, generation)


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


def by_node(nix: np.ndarray) -> tuple[np.ndarray, np.ndarray | int, np.ndarray | None, list[int]]:
    """A LOOKUP's hits grouped by their ``node`` column values ``nix``, in ``np.unique(nix, return_inverse=True)``'s
    order: (the node indexes, ascending; each hit's index among them, 0 when all are on one node; the hits' order
    grouped by node, key order within one, None for one node; the byte ends of each node's run of 24-byte
    capability slots, 0 first). ``entry.factor`` (a bincount, no sort) and one stable argsort."""
    uniq, inv, cnt = factor(nix)
    if len(uniq) <= 1:
        return uniq, 0, None, [0, 24 * len(nix)]
    # (a running sum of a few dozen counts in Python: numpy's cumsum and a scalar multiply cost 2 us more)
    ends = list(accumulate((cnt.take(uniq) * _SLOT0).tolist(), initial=0))
    return uniq, inv, nix.argsort(kind="stable"), ends


def lookup_columns(t, ns: str, keys: list, now: float, owner, tokens, shard=None) -> tuple:
    """``TableDirectory.lookup_granted``'s table work, without the grants and the answer: ``(lease, hit, tags,
    slots, nix)``, the hits' tags (u64), capability slots ((n, 3) ``<u8``: offset, payload length, generation) and
    ``node`` column values (indexes into ``node_names``), in key order; ``(0, hit, None, None, None)`` when nothing
    was found. A process answering several slots' parts of one LOOKUP grants them together
    (``metaserver/ha/multislot.py``: one capability a node, one answer); such a part asks as ``SLICED`` and gets
    ``(lease, 0)``: the one slice of a lease in slices."""
    if owner is SLICED:  # a merged LOOKUP's part answered alone: slice 0 of a lease of its own
        hit, hr = t.pin_hits(ns, keys, shard[1] if shard is not None else 0)
        lease = (t.new_lease(hr, True, now, None, [len(hr)]), 0) if len(hr) else 0
    else:
        lease, hit, hr = t.lookup_rows(ns, keys, now, owner, shard[1] if shard is not None else 0)
    if not lease:
        return 0, hit, None, None, None
    return (lease, hit) + _grant_columns(t, ns, hr, tokens, shard)


def lookup_columns_many(t, ns: str, asks: list[tuple[list, object]], now: float, tokens) -> list[tuple]:
    """``lookup_columns`` of several LOOKUPs (or multi-slot LOOKUPs' parts) of namespace ``ns`` at once (``asks``
    of (keys, owner): a turn's, ``metaserver/handlers/turns.py``), each exactly as alone, with its own lease
    over its own hits: one key digest and index pass, one stamp, pin, tag and capability-slot pass over all of
    them, then a slice and a lease each. An ask whose owner is ``SLICED`` (a merged LOOKUP's part) gets a slice
    of one lease in slices that the turn's parts share: ``(lease, j)`` in its tuple, released by its request
    (``release_many``'s ``slices``), no lease and owner of its own. Plain pages only (a rank's sub-slots ask
    alone)."""
    if len(asks) == 1 and asks[0][1] is not SLICED:
        keys, owner = asks[0]
        return [lookup_columns(t, ns, keys, now, owner, tokens)]
    every = joined_keys([k for k, _ in asks])
    hit, hr = t.pin_hits(ns, every)
    tags, slots, nix = _grant_columns(t, ns, hr, tokens, None) if len(hr) else (None,) * 3
    cuts = list(accumulate([len(k) for k, _ in asks]))
    ends = hit.cumsum().take(np.array(cuts, np.int64) - 1).tolist() if len(hit) else [0] * len(asks)
    out, a, h = [], 0, 0
    parts: list[tuple[int, int, int]] = []  # (index in out, first hit, end) of the SLICED asks with hits
    for (_, owner), b, e in zip(asks, cuts, ends):
        if e <= h:
            out.append((0, hit[a:b], None, None, None))
        elif owner is SLICED:
            parts.append((len(out), h, e))
            out.append((len(parts) - 1, hit[a:b], tags[h:e], slots[h:e], nix[h:e]))
        else:
            out.append((t.new_lease(hr[h:e], e - h > 1, now, owner), hit[a:b], tags[h:e], slots[h:e],
                        nix[h:e]))
        a, h = b, e
    if parts:
        whole = sum(e - h for _, h, e in parts) == len(hr)  # (every hit a part's: no copy)
        rows = hr if whole else np.concatenate([hr[h:e] for _, h, e in parts])
        lease = t.new_lease(rows, True, now, None, list(accumulate(e - h for _, h, e in parts)))
        for i, _, _ in parts:
            got = out[i]
            out[i] = ((lease, got[0]),) + got[1:]
    return out


def granted_answer(t, cols: tuple, member, packed: bool) -> dict:
    """A LOOKUP's answer (``TableDirectory.lookup_granted``) from its ``lookup_columns``: its capabilities (one a
    node) and its rows, packed or (``packed`` False) listed."""
    lease, hit, tags, slots, nix = cols
    if not lease:
        if packed:
            return {"lease": 0, "nodes": [], "caps": [], "rows": answerrows.pack_locs(hit, (), (), (), (), ())}
        return {"lease": 0, "locs": [None] * len(hit), "caps": []}
    n = len(nix)
    uniq, inv, order, ends = by_node(nix)
    names = t.node_names.take(uniq).tolist()
    cap_keys = [None if m is None else m.cap_key for m in map(member, names)]
    caps = (read_capabilities_packed(cap_keys, (slots if order is None else slots.take(order, axis=0)).tobytes(),
                                     ends) if any(cap_keys) else [b""] * len(cap_keys))  # an open pool: none
    if packed:
        return {"lease": lease, "nodes": names, "caps": caps,
                "rows": answerrows.pack_locs(hit, tags, slots[:, 2], slots[:, 1], slots[:, 0], inv)}
    inv = np.broadcast_to(inv, n)
    locs = list(zip(t.node_names.take(uniq.take(inv)).tolist(), slots[:, 0].tolist(), slots[:, 1].tolist(),
                    slots[:, 2].tolist(), tags.tolist(), inv.tolist()))
    return {"lease": lease, "locs": by_key(hit, locs), "caps": caps}


def _grant_columns(t, ns: str, hr: np.ndarray, tokens, shard) -> tuple:
    """(tags, capability slots, node column values) of the hits ``hr`` (``lookup_columns``)."""
    c = t.cols
    slots = np.empty((len(hr), 3), "<u8")  # a capability's (offset, payload_len, gen) triples
    if shard is not None:  # a rank's sub-slots: its tags from the rows' shard bases, its part's offsets
        tags = rank_tags(_kept_tags(t, ns, hr, tokens.shard_bases), shard[0])
        slots[:, 0], slots[:, 1] = t.shared.slots(hr, shard[0])
    else:
        tags = _kept_tags(t, ns, hr, tokens.tags)
        np.left_shift(c["unit"].take(hr), _UNIT0, out=slots[:, 0])
        if len(t.codes) == 1:  # one layout interned (a namespace's pages share one): every row's
            slots[:, 1] = t.code_arr
        else:
            slots[:, 1] = t.code_arr.take(c["size"].take(hr))
    slots[:, 2] = c["gen"].take(hr)
    nix = c["node"].take(hr)
    if t.tiers.any:  # a disk page answers as its host's page at a disk address (metaserver/table/tiers.py)
        nix = t.tiers.answer(nix, slots, hr)
    return tags, slots, nix


def _kept_tags(t, ns: str, hr: np.ndarray, compute) -> np.ndarray:
    """The ``tag`` column of rows ``hr``, each computed by ``compute(ns, keys)`` once, at
    its row's first LOOKUP, and kept: a plain row's tag, a shared row's shard base (``Tokens.shard_bases``; a
    row is never both). 0 means not computed yet (a keyed blake2b is 0 once in 2^64 lookups: then recomputed).
    Computed from the row's own key (``KeyIndex.keys_of``), not the one asked by: a LOOKUP may name a key by its
    digest (``wire.DIGEST_KEYS``), and the tag the writer's header holds is of the key it put."""
    c = t.cols
    tags = c["tag"].take(hr)
    if np.count_nonzero(tags) == len(tags):  # every tag kept already (the usual case after a row's first LOOKUP)
        return tags
    none = np.flatnonzero(tags == 0)
    rows = hr.take(none)
    tags[none] = compute(ns, t.ix.keys_of(rows))
    c["tag"][rows] = tags.take(none)
    return tags
