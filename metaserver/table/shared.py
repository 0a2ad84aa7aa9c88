"""Shared entries on the page table (``SharedEntries``, the part of ``metaserver.table.directory.TableDirectory``
it holds as ``shared``): one row per logical page of TP-sharded KV.

An engine that splits a page's KV heads over ``n`` tensor-parallel ranks stores ``n`` parts of one logical page. A
shared entry holds them as ONE entry with ONE extent of ``n`` sub-slots (sub-slot ``r`` at ``offset + r * stride``,
``stride = object_size(part_len)``, each a normal object slot with its own 64-byte header), ONE generation, ONE
eviction-policy member and ONE etcd record, so a TP8 page costs what a replicated (MLA) page costs. The entry's
``payload_len`` is its layout code (``metaserver.table.entry.layout``: ``part_len | n << SHARD_SHIFT``).

Requests carry ``"shard": [r, n]`` (rank ``r`` of ``n``; the client's ``shard=(r, n)``):

- ALLOC: a READY key answers EXISTS (a use: recency refreshed), whatever its layout. A PENDING shared entry of the
  same layout hands rank ``r`` its sub-slot once: NEW ``(node, off + r*stride, part_len, gen)``; a retry with the
  same token gets the same place; a rank whose part is already written gets EXISTS; otherwise (another token, or a
  PENDING entry of another layout) IN_FLIGHT. An absent key gets one extent of ``n * stride`` bytes, a PENDING shared
  entry, and rank ``r``'s sub-slot.
- COMMIT: marks rank ``r``'s part written and answers True for it (idempotent); when all ``n`` parts are in, the
  entry becomes READY, enters the eviction policy and is persisted (one record with ``n`` and ``part_len``). A
  shared entry not complete within ``pending_ttl_s`` is dropped whole (its extent freed), as any PENDING entry; so
  is one whose generation an ABORT names (any rank's), or whose rank that was handed a sub-slot and has not written
  it loses its connection.
- LOOKUP: a READY shared entry of the same ``n`` answers rank ``r``'s sub-slot ``(node, off + r*stride, part_len,
  gen)``; any other entry (plain, or shared with another ``n``) is a miss for that key, never another layout's
  bytes. A LOOKUP without ``shard`` misses shared entries for the same reason.

The contract a rank sees: its put returns True once ITS part is written; the page becomes visible (EXISTS, PREFIX,
LOOKUP) when every rank's part is. EXISTS, PREFIX and REMOVE are unchanged (logical keys); eviction, node loss,
quotas, the warm copy and a takeover load handle the entry's one extent.

Tags and capabilities (``metaserver/table/grants.py``): each sub-slot carries the tag of (key, r) (``Tokens.tags`` with
a rank) and is granted like any slot, so a rank writes and reads only its own sub-slot, and a node's single-use
check (one write per slot offset and generation) holds for each sub-slot unchanged. A shared row's ``tag`` column
keeps its shard base (``Tokens.shard_bases``, computed at its first LOOKUP by any rank), and each rank's tags are
one numpy step over those (``auth.rank_tags``), so the 8 ranks of a TP8 page cost one keyed blake2b, not 8 a LOOKUP.

Here a shared page is a row whose layout code (``size`` column) is ``entry.layout(part_len, n)``; a PENDING one has
its sub-slot state (``ShardState``: each rank's token and connection, a bit per written part) in
``SharedEntries.states`` by row, dropped with the row whatever ends it (commit of the last part, ABORT, expiry,
REMOVE, node loss: ``_free_row``). A new page is placed by the table's own ALLOC (``PageTable.alloc`` with the
layout codes as sizes: one extent of ``extent_size(code)``); the LOOKUP rules above are ``lookup_rows``' ``parts``.

Costs: ALLOC and COMMIT a Python step per key (the sub-slot state), plus the table's ALLOC for the new pages;
LOOKUP numpy over the request as a plain one.
"""

from __future__ import annotations

import numpy as np

from metaserver.table.columns import PageTable, by_key
from metaserver.table.entry import EXISTS_ITEM, IN_FLIGHT_ITEM, NEW, PART_MASK, PENDING, READY, layout, shards_of
from metaserver.table.nodes import UNIT_SHIFT
from transport import objformat


def strides(codes: np.ndarray) -> np.ndarray:
    """The bytes between two sub-slots of each layout code (uint64): one object slot of its part length."""
    a = np.uint64(objformat.ALIGN)
    return (np.uint64(objformat.OBJ_HEADER_SIZE) + (codes & np.uint64(PART_MASK)) + a - np.uint64(1)) // a * a


class ShardState:
    """The sub-slots of one PENDING shared entry: the token each was handed out under (None: not yet; 0: no
    token), the connection holding it, and a bit per written part."""

    __slots__ = ("tokens", "owners", "written")

    def __init__(self, n: int):
        self.tokens: list[int | None] = [None] * n
        self.owners: list[object] = [None] * n
        self.written = 0


class SharedEntries:
    """Shared entries of a ``TableDirectory`` (its ``shared``): see the module docstring. ``states``: the sub-slot
    state of each PENDING shared row, by row."""

    def __init__(self, table):
        self.table = table
        self.states: dict[int, ShardState] = {}

    def alloc(self, ns, keys, sizes, parents, gen_base, now, token, owner, shard) -> list:
        """ALLOC of rank ``shard[0]`` of ``shard[1]`` (module docstring); ``sizes`` are the rank's parts."""
        t = self.table
        rk, n = shard
        codes = [layout(s, n) for s in sizes]
        c = t.cols
        items: list = [None] * len(keys)
        place: list[int] = []  # absent keys not placed yet, in order
        seen: set = set()
        tok = token if token is not None else 0
        rows, state, size, unit, gen, node = self.rows_of(ns, keys)
        stride: dict[int, int] = {}
        for i, k in enumerate(keys):
            if k in seen:
                items[i] = EXISTS_ITEM  # the first occurrence is the one stored
                continue
            seen.add(k)
            r = rows[i]
            if r >= 0 and place:
                # keys are taken in order (as PageTable.alloc's): the absent keys before this one are placed first, and
                # a page their placement evicted is absent for the keys after them (its row may even be a new
                # page's now: every row found before is stale, so the rest are found again)
                evicted = t.evictions
                self._place(ns, keys, codes, parents, place, items, gen_base, now, token, owner, shard)
                place = []
                if t.evictions != evicted:
                    rows, state, size, unit, gen, node = self.rows_of(ns, keys)
                    r = rows[i]
            if r < 0 or (t.dying and t.dead[node[i]]):
                place.append(i)  # absent, or on a node being dropped: the table's ALLOC places it anew
                continue
            if state[i] == READY:
                items[i] = EXISTS_ITEM
                c["stamp"][r] = t.clock  # a use
                t.clock += 1
                continue
            st = self.states.get(r)
            code = codes[i]
            if st is None or t.codes[size[i]] != code:
                items[i] = IN_FLIGHT_ITEM  # a plain writer, or another layout, holds the key
            elif st.written >> rk & 1:
                items[i] = EXISTS_ITEM  # this rank's part is in already
            elif st.tokens[rk] is None or (token is not None and st.tokens[rk] == token):
                st.tokens[rk] = tok
                st.owners[rk] = owner
                part = code & PART_MASK
                sz = stride.get(part)
                if sz is None:
                    sz = stride[part] = objformat.object_size(part)
                items[i] = (NEW, t.nodes[node[i]].node_id, (unit[i] << UNIT_SHIFT) + rk * sz, part, gen[i])
            else:
                items[i] = IN_FLIGHT_ITEM
        if place:
            self._place(ns, keys, codes, parents, place, items, gen_base, now, token, owner, shard)
        return items

    def rows_of(self, ns, keys) -> tuple[list, ...]:
        """Each key's row (-1: absent) and that row's state, layout code index, unit, generation and node, as lists
        (one gather per column instead of a numpy scalar per key and column)."""
        t = self.table
        c = t.cols
        found = t._find(ns, keys)
        at = np.maximum(found, 0)
        return (found.tolist(), c["state"].take(at).tolist(), c["size"].take(at).tolist(),
                c["unit"].take(at).tolist(), c["gen"].take(at).tolist(), c["node"].take(at).tolist())

    def _place(self, ns, keys, codes, parents, place, items, gen_base, now, token, owner, shard) -> None:
        """New shared pages for the keys at positions ``place``: the table's ALLOC with their layout codes (one
        extent each, generation ``gen_base + position``), then each NEW row's sub-slot state and rank
        ``shard[0]``'s sub-slot as its item."""
        t = self.table
        rk, n = shard
        pk = [keys[i] for i in place]
        got = PageTable.alloc(t, ns, pk, [codes[i] for i in place], gen_base, None, now, token, owner,
                              [parents[i] for i in place] if parents else None, place)
        new = [j for j, it in enumerate(got) if it[0] == NEW]
        new_rows = t._find(ns, [pk[j] for j in new]).tolist() if new else []
        tok = token if token is not None else 0
        for j, r in zip(new, new_rows):
            st = self.states[r] = ShardState(n)
            st.tokens[rk] = tok
            st.owners[rk] = owner
            _, node_id, off, code, gen = got[j]
            part = code & PART_MASK
            got[j] = (NEW, node_id, off + rk * objformat.object_size(part), part, gen)
        for i, it in zip(place, got):
            items[i] = it

    def commit(self, ns, keys, gens, shard) -> list[bool]:
        """COMMIT of rank ``shard[0]``: its part of each (key, gen) written; the last part makes the row READY
        (stamped, filed under a commit record)."""
        t = self.table
        rk, n = shard
        c = t.cols
        full = (1 << n) - 1
        ok: list[bool] = []
        done: list[int] = []
        rows, state, size, _unit, gen_of, _node = self.rows_of(ns, keys)
        parts = t.code_parts.tolist()
        shards, pending = self.states, t._pending
        completed: set[int] = set()
        for i, (r, gen) in enumerate(zip(rows, gens)):
            if r < 0:
                ok.append(False)
                continue
            if state[i] == READY or r in completed:
                ok.append(gen_of[i] == gen and parts[size[i]] == n)
                continue
            st = shards.get(r)
            if gen_of[i] != gen or st is None or parts[size[i]] != n or st.tokens[rk] is None:
                ok.append(False)
                continue
            st.written |= 1 << rk
            ok.append(True)
            if st.written == full:
                del shards[r]
                del pending[r]
                c["state"][r] = READY
                done.append(r)
                completed.add(r)  # a key given twice: the second answers as READY
        if done:
            ra = np.array(done, np.int64)
            t._stamp(ra)
            t.commits.committed(ns, ra)
        return ok

    def slots(self, hr: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(offset, part length) of rank ``rank``'s sub-slot of each of the shared rows ``hr`` (uint64)."""
        t = self.table
        c = t.cols
        codes = t.code_arr.take(c["size"].take(hr))
        offs = (c["unit"].take(hr).astype(np.uint64) << np.uint64(UNIT_SHIFT)) + np.uint64(rank) * strides(codes)
        return offs, codes & np.uint64(PART_MASK)

    def lookup(self, ns, keys, now, owner, shard) -> tuple[int, list]:
        """LOOKUP of rank ``shard[0]``: its sub-slot of each READY shared row of ``shard[1]`` parts, the whole row
        pinned; anything else a miss."""
        t = self.table
        rk, n = shard
        lease, hit, hr = t.lookup_rows(ns, keys, now, owner, n)
        if not lease:
            return 0, [None] * len(keys)
        offs, parts = self.slots(hr, rk)
        c = t.cols
        return lease, by_key(hit, list(zip(t.node_names.take(c["node"].take(hr)).tolist(), offs.tolist(),
                                           parts.tolist(), c["gen"].take(hr).tolist())))

    def owned_by_row(self, r: int, owner) -> bool:
        """Whether ``owner`` closing must abort PENDING row ``r`` (``TableDirectory.abort_owned``)."""
        t = self.table
        st = self.states.get(r)
        if st is None:
            return t.writer_of(r) is owner
        return any(o is owner and not st.written >> i & 1 for i, o in enumerate(st.owners))

    def check(self) -> None:
        """Invariants (tests): every PENDING row of a shared layout has its sub-slot state, with a part unwritten
        and only handed-out parts written; no other row has one."""
        t = self.table
        c = t.cols
        for r in t._pending:
            if shards_of(t.codes[c["size"][r]]):
                st = self.states.get(r)
                n = shards_of(t.codes[c["size"][r]])
                assert st is not None and len(st.tokens) == n and st.written < (1 << n) - 1, r
                assert all(st.tokens[i] is not None for i in range(n) if st.written >> i & 1), r
        assert all(r in t._pending and c["state"][r] == PENDING for r in self.states)

