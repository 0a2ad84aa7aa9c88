"""Shared entries: one directory entry per logical page of TP-sharded KV (``SharedEntries``, a mixin of
``metaserver.directory.Directory``).

An engine that splits a page's KV heads over ``n`` tensor-parallel ranks stores ``n`` parts of one logical page. A
shared entry holds them as ONE entry with ONE extent of ``n`` sub-slots (sub-slot ``r`` at ``offset + r * stride``,
``stride = object_size(part_len)``, each a normal object slot with its own 64-byte header), ONE generation, ONE
eviction-policy member and ONE etcd record, so a TP8 page costs what a replicated (MLA) page costs. The entry's
``payload_len`` is its layout code (``metaserver.entry.layout``: ``part_len | n << SHARD_SHIFT``).

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

Tags and capabilities (``metaserver/grants.py``): each sub-slot carries the tag of (key, r) (``Tokens.tags`` with a
rank) and is granted like any slot, so a rank writes and reads only its own sub-slot, and a node's single-use check
(one write per slot offset and generation) holds for each sub-slot unchanged.

Costs: as ``Directory.alloc``/``commit``/``lookup`` per key, plus O(1) for the sub-slot state of PENDING shared entries
(``_shards``: a few PENDING entries, nothing per READY page).
"""

from __future__ import annotations

import sys

from metaserver.entry import (EXISTS_ITEM, IN_FLIGHT_ITEM, NEW, NO_SPACE_ITEM, OVER_QUOTA_ITEM, PART_MASK, PENDING,
                              SHARD_SHIFT, Effects, Entry, extent_size, parent_of, random_id, shards_of)
from metaserver.placement import Placer
from transport.wire import object_size

_intern = sys.intern


class ShardState:
    """The sub-slots of one PENDING shared entry: the token each was handed out under (None: not yet; 0: no
    token), the connection holding it, and a bit per written part."""

    __slots__ = ("tokens", "owners", "written")

    def __init__(self, n: int):
        self.tokens: list[int | None] = [None] * n
        self.owners: list[object] = [None] * n
        self.written = 0


class SharedEntries:
    def alloc_shared(self, ns: str, keys: list[bytes], sizes: list[int], parents: list | None, gen_base: int,
                     now: float, token: int | None, owner: object, shard: tuple[int, int]) -> tuple[list, Effects]:
        """``Directory.alloc`` for rank ``shard[0]`` of ``shard[1]``: ``sizes`` are the rank's part sizes."""
        rk, n = shard
        fx = Effects()
        ns = _intern(ns)
        codes = [s | n << SHARD_SHIFT for s in sizes]  # layout(s, n)
        quota = self.quotas.group_of(ns) if self.quotas else None  # its quota group
        if quota is not None and not self._fit_quota(ns, keys, codes, quota, fx):
            return [OVER_QUOTA_ITEM] * len(keys), fx
        r = self.ready.get(ns) or {}
        pend, shards = self.pending_keys, self._shards
        items: list = []
        placer: Placer | None = None
        seen: set[bytes] = set()
        added = 0
        tok = token if token is not None else 0
        at: dict[int, tuple[int, int, int]] = {}  # code -> (rank's sub-slot start, part_len, extent): one per batch
        for i, key in enumerate(keys):
            if self._answers_exists(r, key, seen, now, fx):  # a repeat, or a live page (a use of it)
                items.append(EXISTS_ITEM)
                continue
            pd = pend.get(ns)
            e = pd.get(key) if pd is not None else None
            code = codes[i]
            sub = at.get(code)
            if sub is None:
                part = code & PART_MASK
                sub = at[code] = (rk * object_size(part), part, extent_size(code))
            if e is not None:
                st = shards.get(e)
                if st is None or e.payload_len != code:
                    items.append(IN_FLIGHT_ITEM)  # a plain writer, or another layout, holds the key
                elif st.written >> rk & 1:
                    items.append(EXISTS_ITEM)  # this rank's part is in already
                elif st.tokens[rk] is None or (token is not None and st.tokens[rk] == token):
                    st.tokens[rk] = tok
                    st.owners[rk] = owner
                    items.append((NEW, e.space.node_id, e.offset + sub[0], sub[1], e.gen))
                else:
                    items.append(IN_FLIGHT_ITEM)
                continue
            near, parent = parent_of(r, pd, parents[i] if parents else None)
            if placer is None:
                placer = Placer(self, fx)
            osize = sub[2]
            placed = placer.place(osize, near)
            if placed is None:
                items.append(NO_SPACE_ITEM)
                continue
            sp, off = placed
            e = self._add_pending(Entry(ns, key, sp, off, self._plen(code), gen_base + i, PENDING, parent, now),
                                  token, owner)
            st = shards[e] = ShardState(n)
            st.tokens[rk] = tok
            st.owners[rk] = owner
            added += osize
            sp.n += 1
            items.append((NEW, sp.node_id, off + sub[0], sub[1], e.gen))
        if added:
            self._count(ns, added)
        return items, fx

    def commit_shared(self, ns: str, keys: list[bytes], gens: list[int], now: float, shard: tuple[int, int]
                      ) -> tuple[list[bool], Effects]:
        """Mark rank ``shard[0]``'s part of each (key, gen) written; the last part makes the entry READY (and
        persisted). True for a part written now or before (a retry), also once the entry is READY with that
        generation and layout; False otherwise (not handed out to this rank, another generation or layout)."""
        rk, n = shard
        fx = Effects()
        pd = self.pending_keys.get(ns)
        r = self.ready.get(ns)
        shards, pending = self._shards, self._pending
        full = (1 << n) - 1
        ok: list[bool] = []
        for key, gen in zip(keys, gens):
            e = pd.get(key) if pd is not None else None
            if e is None:
                e = r.get(key) if r is not None else None
                ok.append(e is not None and e.gen == gen and shards_of(e.payload_len) == n)
                continue
            st = shards.get(e)
            if e.gen != gen or st is None or shards_of(e.payload_len) != n or st.tokens[rk] is None:
                ok.append(False)
                continue
            st.written |= 1 << rk
            ok.append(True)
            if st.written != full:
                continue
            del shards[e]
            del pd[key]
            del pending[e]
            r = self._make_ready(e, r, now, fx)
        if pd is not None and not pd and self.pending_keys.get(ns) is pd:
            del self.pending_keys[ns]
        return ok, fx

    def lookup_shared(self, ns: str, keys: list[bytes], now: float, owner: object, shard: tuple[int, int]
                      ) -> tuple[int, list]:
        """``Directory.lookup`` for rank ``shard[0]``: each READY shared entry of ``shard[1]`` parts answers that
        rank's sub-slot; anything else is a miss. The whole entry is pinned (one extent)."""
        rk, n = shard
        get = (self.ready.get(ns) or {}).get
        locs: list = []
        found: list[Entry] = []
        at: dict[int, tuple[int, int]] = {}  # layout code -> (rank's sub-slot start, part_len): one per batch
        for k in keys:
            e = get(k)
            if e is None or e.space.dead or e.payload_len >> SHARD_SHIFT != n:
                locs.append(None)
                continue
            code = e.payload_len
            sub = at.get(code)
            if sub is None:
                part = code & PART_MASK
                sub = at[code] = (rk * object_size(part), part)
            locs.append((e.space.node_id, e.offset + sub[0], sub[1], e.gen))
            found.append(e)
        return self._pin_found(found, len(keys), now, owner), locs

    def _pin_found(self, found: list[Entry], asked: int, now: float, owner: object) -> int:
        """Pin ``found`` under one new read lease owned by ``owner`` (0: nothing found) and count hits/misses."""
        first = []  # pinned by this lease and no other: no longer evictable (a key asked twice is pinned twice)
        for e in found:
            if e.pins == 0:
                first.append(e)
            e.pins += 1
            e.last_access = now
        return self._lease_for(found, first, asked, owner, now)

    def _lease_for(self, found: list[Entry], first: list[Entry], asked: int, owner: object, now: float) -> int:
        """The lease over ``found`` (entries already pinned once more each; ``first``: those this pin took from
        unpinned, now no longer evictable), as ``_pin_found``."""
        if first:
            self.policy.discard_many(first)
        self.pinned += len(first)
        self.hits += len(found)
        self.misses += asked - len(found)
        if not found:
            return 0
        leases = self.leases
        lease = 0
        for _ in range(64):  # a collision among 2^63 ids is practically impossible; bounded all the same
            lease = random_id()
            if lease and lease not in leases:
                break
        leases[lease] = found
        if owner is not None:
            self._lease_owner[lease] = owner
        self._lease_q.append((now + self.read_lease_s, lease))
        return lease

    def owned_by(self, e: Entry, conn: object) -> bool:
        """Whether ``conn`` closing must abort PENDING entry ``e``: it owns a plain one, or holds a sub-slot of a
        shared one that it has not written (the page can never complete then)."""
        st = self._shards.get(e)
        if st is None:
            return self.writer_of(e) is conn
        return any(o is conn and not st.written >> i & 1 for i, o in enumerate(st.owners))

    def _check_shared(self, live: list[Entry]) -> None:
        """Invariants of shared entries (tests): every PENDING shared entry has its sub-slot state, with at least
        one part unwritten and only handed-out parts written; nothing else has one."""
        for e in live:
            n = shards_of(e.payload_len)
            st = self._shards.get(e)
            if n and e.state == PENDING:
                assert st is not None and len(st.tokens) == n == len(st.owners), (e.ns, e.key)
                assert st.written < (1 << n) - 1, (e.ns, e.key)
                assert all(st.tokens[i] is not None for i in range(n) if st.written >> i & 1), (e.ns, e.key)
            else:
                assert st is None, (e.ns, e.key)
        assert len(self._shards) <= len(self._pending) and all(e in self._pending for e in self._shards)
