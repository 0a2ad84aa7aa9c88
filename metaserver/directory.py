"""Page directory: namespace -> key -> where the object lives, its state, pins and recency. No I/O.

Every mutation is a synchronous method that updates memory and returns the I/O still to do as ``Effects``: READY
entries to persist (``puts``) and persisted pages to delete (``deletes``). The caller hands those to the etcd writer
afterwards; nothing here awaits, so a request's bookkeeping is atomic with respect to every other request.

Entry lifecycle::

    alloc -> PENDING --commit--> READY --remove / evict / node loss--> GONE
                 \\--abort / pending_ttl expiry--> GONE (never persisted, so nothing to delete)

Invariants (``check()``):

- ``ready[ns]`` holds exactly the READY entries, ``pending_keys[ns]`` exactly the PENDING ones (a key is in at most
  one of them); ``entries`` is a read-only view of both. EXISTS, PREFIX and LOOKUP read only ``ready``.
- Every live entry owns one allocator extent on its node's ``NodeSpace``; a gone entry still pinned by a read lease
  (a *zombie*) keeps its extent until its last pin goes, so a reader never races a new writer into the same bytes.
- The eviction policy holds exactly the READY, unpinned, live entries: PENDING and pinned ones can never be evicted.
- A READY entry naming a parent is *linked* (``up`` is the parent's Entry, and it is among the parent's ``kids``)
  exactly when that parent is READY; otherwise ``up`` is the parent's key and the entry waits in ``orphans`` to be
  adopted if the parent arrives.
- ``used <= capacity`` per node (the allocator enforces it) and in total (totals sum live nodes only).
- Generations come from the caller (reserved from etcd), unique and increasing across restarts.

Memory (the figure that decides how many pages one metaserver holds; ``bench/scale.py`` measures it): a READY page
is its key (the caller's bytes object), one ``Entry`` of 15 slots, its offset and generation ints, one slot of
``ready[ns]`` and one in its commit record's entry list (``entry.Batch``: an etcd record per COMMIT). Nothing else
is per page: the payload length is interned (pages of a namespace share a size), the namespace string is interned,
the parent's key is the parent entry's own key object whenever the parent is known, the eviction order is threaded
through the entries (``eviction.Ring``), a node's entries are the policy's plus its few PENDING and pinned ones
(``NodeSpace.entries`` is a view, with a count), the allocator does not track allocated extents (the entries do),
and PENDING expiry walks the insertion-ordered ``_pending`` dict instead of a queue that kept every committed entry
for pending_ttl_s.

Costs: exists/prefix O(keys) with one dict probe per key and no allocation per key; lookup/alloc/commit O(keys);
alloc on a full node adds O(victims) evictions; per key, placement scans the nodes' free space and next victims
cached for the request (O(nodes) at C speed, no sort). Sweeps (pending expiry, read leases, eviction) take a budget
and do at most that much work per call.

Where the rest of ``Directory`` lives (mixins, one responsibility each): node spaces, their loss, drains and loads in
``metaserver/spaces.py``; prefix links and orphans in ``metaserver/links.py``; eviction passes and budgeted expiry in
``metaserver/passes.py``; quota groups and reservations in ``metaserver/quotas.py``; the invariant check in
``metaserver/invariants.py``.
"""

from __future__ import annotations

import sys
from collections import deque

from metaserver.entry import (EXISTS, EXISTS_ITEM, GONE, IN_FLIGHT, IN_FLIGHT_ITEM, NEW, NO_SPACE, NO_SPACE_ITEM,
                              OVER_QUOTA, OVER_QUOTA_ITEM, PENDING, READY, STATE_NAMES, Effects, Entries, Entry,
                              NodeSpace, NsEntries, SpaceEntries, extent_size, PART_MASK, SHARD_SHIFT)
from metaserver.eviction import Policy, make_policy
from metaserver.invariants import DirectoryInvariants
from metaserver.links import PrefixLinks
from metaserver.passes import EvictionPasses
from metaserver.placement import PLACE_EVICT_BUDGET, Placer
from metaserver.quarantine import Quarantine
from metaserver.quotas import NamespaceQuotas
from metaserver.shared import ShardState, SharedEntries
from metaserver.spaces import NodeSpaces
from transport.wire import object_size
from umbp.quotarules import QuotaRules

__all__ = ["Directory", "Effects", "Entry", "NodeSpace", "Entries", "NsEntries", "SpaceEntries", "PENDING", "READY",
           "GONE", "STATE_NAMES", "NEW", "EXISTS", "NO_SPACE", "IN_FLIGHT", "OVER_QUOTA", "PLACE_EVICT_BUDGET"]

SIZE_INTERN = 4096  # distinct payload lengths shared between entries (pages of a namespace are one size)
_intern = sys.intern


class Directory(NodeSpaces, PrefixLinks, EvictionPasses, NamespaceQuotas, SharedEntries, DirectoryInvariants):
    # KV events (metaserver/kvevents.py): None, or a sink told of every page that becomes READY (``stored``: commit,
    # _make_ready, spaces._file_entries) and every READY page unlinked (``removed``: _unlink_ready). Set by the
    # service while a term serves this directory; those four calls are the whole hook.
    kv_sink = None

    def __init__(self, *, pending_ttl_s: float = 30.0, read_lease_s: float = 10.0, policy: str = "lru",
                 quotas: QuotaRules | dict[str, int] | None = None):
        self.pending_ttl_s = pending_ttl_s
        self.read_lease_s = read_lease_s
        self.policy: Policy = make_policy(policy)
        self.ready: dict[str, dict[bytes, Entry]] = {}
        self.pending_keys: dict[str, dict[bytes, Entry]] = {}
        # PENDING entries in allocation order -> (their writer's token, the connection that owns them now)
        self._pending: dict[Entry, tuple[int | None, object]] = {}
        self._shards: dict[Entry, ShardState] = {}  # PENDING shared entries' sub-slots (metaserver/shared.py)
        self.entries = Entries(self)
        self.spaces: dict[str, NodeSpace] = {}
        self.leases: dict[int, list[Entry]] = {}  # random 63-bit ids: a lease cannot be guessed
        self._lease_owner: dict[int, object] = {}  # lease -> the connection that took it (absent: none given)
        # Nodes being dropped in slices (detach_space, drop_slice): node id -> (its space, parked records or None)
        self.dying: dict[str, tuple[NodeSpace, list | None]] = {}
        # Quota groups (umbp/quotarules.py; a dict: a group per key) and use: object sizes of the live (READY and
        # PENDING) entries, per namespace and per group (metaserver/quotas.py)
        self.quotas = QuotaRules.of(quotas)
        self.ns_used: dict[str, int] = {}
        self.group_used: dict[str, int] = {}
        self._group_ns: dict[str, set[str]] = {}  # a group's namespaces with use
        self._group_held: dict[str, list[tuple[float, int]]] = {}  # a group's quarantined extents: (until, size) heap
        self._gathered: dict[str, tuple] = {}  # a group's last gather that found all its old pages (quotas.py)
        self._ns_victims: dict[str, list[tuple[Entry, float]]] = {}  # a group's eviction candidates, newest first
        # READY entries naming a parent that is not READY, by namespace and parent key: a parent that arrives (or
        # comes back) adopts them (prefix-lru files them as orphans meanwhile).
        self.orphans: dict[str, dict[bytes, Entry | set[Entry]]] = {}
        self._lease_q: deque[tuple[float, int]] = deque()
        self._sizes: dict[int, int] = {}  # interned payload lengths
        self._osizes: dict[int, int] = {}  # their object sizes
        self.hits = self.misses = self.evictions = self.puts = 0
        self.pinned = 0  # entries (live or zombie) with pins > 0
        self.quarantine = Quarantine()  # closed pools: extents freed young wait out their write capabilities

    # -- totals ------------------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return sum(s.alloc.capacity for s in self.spaces.values())

    @property
    def used(self) -> int:
        return sum(s.alloc.used for s in self.spaces.values())

    @property
    def objects(self) -> int:
        return sum(len(r) for r in self.ready.values())

    @property
    def pending(self) -> int:
        return len(self._pending)

    def open_extents(self) -> list[tuple[str, int, int]]:
        """(node_id, offset, extent size) of every PENDING entry (``metaserver/handoff.py``)."""
        return [(e.space.node_id, e.offset, extent_size(e.payload_len)) for e in self._pending]

    def namespaces(self) -> dict[str, int]:
        return {ns: len(r) for ns, r in self.ready.items() if r}

    def namespace_usage(self) -> dict[str, dict]:
        """Per namespace with objects, use or a quota of its own name: objects, used_bytes, quota_bytes (its group's,
        pool-wide, shared by the group's namespaces; None: no quota)."""
        q = self.quotas
        names = set(self.ready) | set(self.ns_used) | q.exact_names()
        return {ns: {"objects": len(self.ready.get(ns, ())), "used_bytes": self.ns_used.get(ns, 0),
                     "quota_bytes": g.quota if (g := q.group_of(ns)) is not None else None} for ns in sorted(names)}

    def writer_of(self, e: Entry) -> object:
        """The connection that owns PENDING entry ``e`` now (None: unknown or not PENDING)."""
        w = self._pending.get(e)
        return w[1] if w is not None else None

    # -- what the service asks of either core (metaserver/tabledir.py answers the same) --------------------------
    parks = True  # a lost node's pages are parked for its return (metaserver/rejoin.py)

    def space_use(self, node_id: str) -> tuple[int, int] | None:
        """(arena bytes held, live entries) of a node's space, None when it has none."""
        sp = self.spaces.get(node_id)
        return None if sp is None else (sp.alloc.used, sp.n)

    def pending_handles(self, ns: str, keys: list, items: list, new: list[int]) -> list[Entry]:
        """What a connection keeps of its NEW allocations (positions ``new``): their PENDING entries."""
        pd = self.pending_keys[ns]  # a NEW item's entry is PENDING: straight from its dict, not the view
        return [pd[keys[i]] for i in new]

    def settle_handles(self, held: set, ns: str, keys: list, gens: list) -> None:
        """A COMMIT or ABORT of (keys, gens) settles them: out of the connection's ``held`` set."""
        pd = self.pending_keys.get(ns)  # only PENDING entries are in a connection's set
        if pd:
            get, discard = pd.get, held.discard
            for key in keys:
                discard(get(key))

    def abort_owned(self, handles, owner: object) -> int:
        """``owner`` closed: abort the entries of ``handles`` still PENDING and still its own (``owned_by``)."""
        by_ns: dict[str, tuple[list, list]] = {}
        for e in handles:
            if e.state == PENDING and self.owned_by(e, owner):
                ks, gs = by_ns.setdefault(e.ns, ([], []))
                ks.append(e.key)
                gs.append(e.gen)
        return sum(self.abort(ns, ks, gs) for ns, (ks, gs) in by_ns.items())

    def _count(self, ns: str, nbytes: int) -> None:
        """Add ``nbytes`` (negative: remove) to namespace ``ns``'s use."""
        u = self.ns_used.get(ns, 0) + nbytes
        if u:
            self.ns_used[ns] = u
        else:
            self.ns_used.pop(ns, None)
        if self.quotas:
            self._count_group(ns, nbytes, u)

    def _plen(self, n: int) -> int:
        """The shared int object for payload length ``n`` (pages of a namespace are one size)."""
        v = self._sizes.get(n)
        if v is None:
            if len(self._sizes) >= SIZE_INTERN:
                return n
            v = self._sizes[n] = n
            self._osizes[n] = extent_size(n)
        return v

    # -- data plane --------------------------------------------------------------------------------------------

    def _answers_exists(self, ready: dict, key: bytes, seen: set, now: float, fx: Effects) -> bool:
        """Whether an ALLOC of ``key`` is answered EXISTS: a key already met in this request (the first occurrence
        is the one stored), or a live READY page. A put of a page already here is a use of it: the engine holds it
        in a live context (after a broken prefix it re-offers pages that survived elsewhere); not refreshing them
        evicted those pages next, which cost a partitioned pool 6 of its 12 points against pool-wide LRU. A READY
        page on a node being dropped is gone for readers already: it is dropped here and written anew."""
        if key in seen:
            return True
        seen.add(key)
        e = ready.get(key)
        if e is None:
            return False
        if not e.space.dead:
            e.last_access = now
            if e.pins == 0:
                self.policy.add(e)  # an evictable entry re-added moves to the recent end
            return True
        self._drop_dying(e, fx)
        return False

    def alloc(self, ns: str, keys: list[bytes], sizes: list[int], parents: list | None, gen_base: int,
              now: float, token: int | None = None, owner: object = None, shard: tuple[int, int] | None = None
              ) -> tuple[list, Effects]:
        """Place each new key (PENDING, generation ``gen_base + i``), evicting if needed. Returns (items, effects):
        item = [NEW, node_id, offset, payload_len, gen] | [EXISTS, None...] | [NO_SPACE, None...] |
        [IN_FLIGHT, None...] (another writer holds the key PENDING) | [OVER_QUOTA, None...] for every key (internal:
        the request's new keys do not fit in the namespace's quota even after evicting its own unpinned pages;
        nothing was allocated and the caller refuses the request). A PENDING key allocated under the same ``token``
        gets its place again (a retried ALLOC whose answer was lost), so ALLOC is idempotent; it then belongs to
        ``owner`` (the retry's connection), so the first connection closing does not abort it. ``shard`` (rank, n):
        a shared entry's sub-slot (``alloc_shared``)."""
        if shard is not None:
            return self.alloc_shared(ns, keys, sizes, parents, gen_base, now, token, owner, shard)
        fx = Effects()
        ns = _intern(ns)
        r = self.ready.get(ns) or {}
        pend = self.pending_keys
        pending = self._pending
        items: list = []
        interned, osizes = self._sizes, self._osizes
        quota = self.quotas.group_of(ns) if self.quotas else None  # its quota group
        if quota is not None and not self._fit_quota(ns, keys, sizes, quota, fx):
            return [OVER_QUOTA_ITEM] * len(keys), fx
        seen: set[bytes] = set()  # a key twice in one request: the first occurrence is the one stored
        added = 0  # bytes the new entries add to the namespace's use (counted once, after the loop)
        # Per key, what _answers_exists, parent_of and _add_pending do, inlined (this loop runs once per key put);
        # the namespace's PENDING map is looked up once (made at its first entry: nothing here removes it) and the
        # writer's (token, owner) is one tuple for the request.
        pd = pend.get(ns)
        writer = (token, owner)
        placer = None
        # A run (placement.Placer.want): the next run_left objects of run_size bytes at run_off, run_off +
        # run_size, ... on run_sp, allocated at once and handed out to the keys that follow (no parent, or the run's
        # node as parent's); what a request does not use goes back (Placer.give_back).
        run_sp, run_off, run_left, run_size = None, 0, 0, 0
        # Keys this request will place (neither stored nor pending), so a run never exceeds what the request needs.
        # Evicting for a run only when none of its keys is stored: one object at a time, a stored key later in the
        # request is used (made most recent) before the evictions for the keys after it, which a run's evictions,
        # made at its first key, could take.
        distinct = set(keys)
        stored = sum(1 for k in distinct if k in r) if r else 0
        to_place = len(distinct) - stored - (sum(1 for k in distinct if k in pd) if pd else 0)
        for i, key in enumerate(keys):
            if key in seen:
                items.append(EXISTS_ITEM)
                continue
            seen.add(key)
            e = r.get(key)
            if e is not None:
                if not e.space.dead:  # a put of a live page is a use of it (_answers_exists)
                    e.last_access = now
                    if e.pins == 0:
                        self.policy.add(e)
                    items.append(EXISTS_ITEM)
                    continue
                self._drop_dying(e, fx)
            if pd is not None:
                e = pd.get(key)
                if e is not None:
                    w = pending.get(e)
                    if token is not None and w[0] == token and e.payload_len == sizes[i]:
                        pending[e] = writer
                        items.append((NEW, e.space.node_id, e.offset, e.payload_len, e.gen))
                    else:
                        items.append(IN_FLIGHT_ITEM)
                    continue
            plen = sizes[i]
            parent = parents[i] if parents else None
            near = None
            if parent is not None:  # parent_of: near the parent's entry, sharing its key object
                pe = r.get(parent)
                if pe is None and pd is not None:
                    pe = pd.get(parent)
                if pe is not None:
                    near, parent = pe.space, pe.key
            pl = interned.get(plen)
            if pl is None:
                pl = self._plen(plen)
                osize = object_size(plen)
            else:
                osize = osizes[pl]
            to_place -= 1
            if run_left and run_size == osize and (near is None or near is run_sp):
                sp, off = run_sp, run_off
                run_off += osize
                run_left -= 1
            else:
                if run_left:
                    placer.give_back(run_sp, run_off, run_left, run_size)
                if placer is None:
                    placer = Placer(self, fx)
                    placer.evict_runs = not stored
                placed = placer.place(osize, near, to_place + 1 if to_place > 0 else 1)
                if placed is None:
                    run_left = 0
                    items.append(NO_SPACE_ITEM)
                    continue
                sp, off = placed
                run_sp, run_off, run_left, run_size = sp, off + osize, placer.got - 1, osize
            gen = gen_base + i
            e = Entry(ns, key, sp, off, pl, gen, PENDING, parent, now)
            if pd is None:
                pd = pend[ns] = {}
            pd[key] = e
            pending[e] = writer
            added += osize
            sp.n += 1
            items.append((NEW, sp.node_id, off, plen, gen))
        if run_left:
            placer.give_back(run_sp, run_off, run_left, run_size)
        if added:
            self._count(ns, added)
        return items, fx

    def _add_pending(self, e: Entry, token: int | None, owner: object) -> Entry:
        """Enter a new PENDING entry (ALLOC, plain or shared) under its writer's token and connection."""
        pd = self.pending_keys.get(e.ns)
        if pd is None:
            pd = self.pending_keys[e.ns] = {}
        pd[e.key] = e
        self._pending[e] = (token, owner)
        return e

    def commit(self, ns: str, keys: list[bytes], gens: list[int], now: float, shard: tuple[int, int] | None = None
               ) -> tuple[list[bool], Effects]:
        """PENDING -> READY for each (key, gen) that is still pending with that generation. Idempotent: a key
        already READY with that very generation reports True again (a retry whose first answer was lost, possibly
        across a failover that loaded the commit from etcd); anything else reports False (so does a shared entry:
        its ranks commit with ``shard``, ``commit_shared``)."""
        if shard is not None:
            return self.commit_shared(ns, keys, gens, now, shard)
        fx = Effects()
        pd = self.pending_keys.get(ns)
        r = self.ready.get(ns)
        ok: list[bool] = []
        if pd is None:
            for key, gen in zip(keys, gens):
                e = r.get(key) if r is not None else None
                ok.append(e is not None and e.gen == gen and e.payload_len <= PART_MASK)
            return ok, fx
        pending = self._pending
        policy = self.policy
        # A policy that ignores prefix links takes the batch's entries at the end, in commit order (the same rings
        # as one add each); prefix-lru files each one as it becomes READY (its links decide its tier).
        later: list | None = [] if policy.links_blind else None
        puts = fx.puts
        orphans = self.orphans
        for key, gen in zip(keys, gens):
            e = pd.get(key)
            if e is None:
                e = r.get(key) if r is not None else None
                ok.append(e is not None and e.gen == gen and e.payload_len <= PART_MASK)
                continue
            if e.gen != gen or e.payload_len > PART_MASK:
                ok.append(False)
                continue
            del pd[key]
            del pending[e]
            # _make_ready, inlined
            if r is None:
                r = self.ready[ns] = {}
            e.state = READY
            e.last_access = now
            r[e.key] = e
            up = e.up
            if up is None or type(up) is bytes:  # _link_ready, inlined (a PENDING entry names its parent by key)
                if up is not None:
                    p = r.get(up)
                    if p is not None and p is not e and p.state == READY:
                        self._link(e, p)
                    else:
                        self._add_orphan(e)
                if orphans:
                    o = orphans.get(ns)
                    if o:
                        waiting = o.pop(e.key, None)
                        if waiting is not None:
                            self._adopt(e, o, waiting)
            else:
                self._link_ready(e)
            if later is None:
                policy.add(e)
            else:
                later.append(e)
            puts.append(e)
            ok.append(True)
        if later:
            policy.add_many(later)
        if puts and self.kv_sink is not None:
            self.kv_sink.stored(puts)
        self.puts += len(puts)
        if not pd and self.pending_keys.get(ns) is pd:
            del self.pending_keys[ns]
        return ok, fx

    def _make_ready(self, e: Entry, r: dict | None, now: float, fx: Effects) -> dict:
        """A committed PENDING entry (out of the pending maps already) becomes READY in ``r``, its namespace's READY
        map (made when None, and returned), used now, linked, in the policy and to be persisted."""
        if r is None:
            r = self.ready[e.ns] = {}
        e.state = READY
        e.last_access = now
        r[e.key] = e
        self.puts += 1
        self._link_ready(e)
        self.policy.add(e)
        fx.puts.append(e)
        if self.kv_sink is not None:
            self.kv_sink.stored((e,))
        return r

    def abort(self, ns: str, keys: list[bytes], gens: list[int]) -> int:
        """Free PENDING entries whose generation matches. Returns how many were freed (nothing to persist)."""
        fx = Effects()
        n = 0
        for key, gen in zip(keys, gens):
            pd = self.pending_keys.get(ns)
            e = pd.get(key) if pd is not None else None
            if e is not None and e.gen == gen:
                self._drop(e, fx)
                n += 1
        return n

    def exists(self, ns: str, keys: list[bytes]) -> list[bool]:
        r = self.ready.get(ns)
        if not r:
            return [False] * len(keys)
        return list(map(r.__contains__, keys))  # a C-level loop: about 15 % faster than a comprehension

    def prefix(self, ns: str, keys: list[bytes]) -> int:
        r = self.ready.get(ns)
        if not r:
            return 0
        n = 0
        for k in keys:
            if k not in r:
                break
            n += 1
        return n

    def lookup(self, ns: str, keys: list[bytes], now: float, owner: object = None,
               shard: tuple[int, int] | None = None) -> tuple[int, list]:
        """Locations of READY keys, each pinned under one read lease (0 when nothing was found). The lease id is
        random (63 bits, never 0) and belongs to ``owner``: only it may ``release`` it (expiry aside). A shared
        entry is a miss here; ``shard`` (rank, n) reads shared entries' sub-slots instead (``lookup_shared``)."""
        if shard is not None:
            return self.lookup_shared(ns, keys, now, owner, shard)
        r = self.ready.get(ns) or {}
        locs: list = []
        found: list[Entry] = []
        first: list[Entry] = []  # pinned by this lease and no other (``_pin_found``, inlined: this runs per key)
        for k in keys:
            e = r.get(k)
            if e is None or e.space.dead or e.payload_len > PART_MASK:  # dead: being dropped; > PART_MASK: shared
                locs.append(None)
                continue
            locs.append((e.space.node_id, e.offset, e.payload_len, e.gen))
            found.append(e)
            if not e.pins:
                first.append(e)
            e.pins += 1
            e.last_access = now
        return self._lease_for(found, first, len(keys), owner, now), locs

    def release(self, lease: int, owner: object = None) -> bool:
        """Unpin everything under ``lease``; False, changing nothing, when it is unknown, already expired, or
        (``owner`` given) taken by another owner. ``owner`` None: the directory's own expiry, tests."""
        found = self.leases.get(lease)
        if found is None or (owner is not None and self._lease_owner.get(lease) is not owner):
            return False
        del self.leases[lease]
        self._lease_owner.pop(lease, None)
        self._unpin_all(found)
        return True

    def remove(self, ns: str, keys: list[bytes]) -> tuple[list[bool], Effects]:
        """Remove keys (READY or PENDING). A pinned object's space is freed when its last pin goes."""
        fx = Effects()
        out: list[bool] = []
        view = NsEntries(self, ns)
        for k in keys:
            e = view.get(k)
            if e is None:
                out.append(False)
            else:
                self._drop(e, fx)
                out.append(True)
        return out, fx

    def list_objects(self, ns: str | None, limit: int) -> tuple[list, bool]:
        out: list = []
        names = [ns] if ns is not None else list(self.entries)
        for name in names:
            for key, e in NsEntries(self, name).items():
                if len(out) >= limit:
                    return out, True
                code = e.payload_len  # a shared entry: its parts' payload together
                out.append((name, key, code if code <= PART_MASK else (code & PART_MASK) * (code >> SHARD_SHIFT),
                            e.space.node_id, STATE_NAMES[e.state]))
        return out, False

    # -- internals ---------------------------------------------------------------------------------------------
    def _unlink(self, e: Entry, fx: Effects) -> None:
        """Remove ``e`` from the maps, the links and the policy; no space accounting."""
        if e.state == READY:
            self._unlink_ready(e, fx)
        elif e.state == PENDING:
            ns, key = e.ns, e.key
            pd = self.pending_keys.get(ns)
            if pd is not None and pd.get(key) is e:
                del pd[key]
                if not pd:
                    del self.pending_keys[ns]
                self._count(ns, -extent_size(e.payload_len))
            self._pending.pop(e, None)
            if self._shards:
                self._shards.pop(e, None)
        e.state = GONE

    def _unlink_ready(self, e: Entry, fx: Effects) -> None:
        """``_unlink`` of a READY entry, minus its state change (the caller marks it GONE)."""
        ns, key = e.ns, e.key
        r = self.ready.get(ns)
        if r is not None and r.get(key) is e:
            del r[key]
            if not r:
                del self.ready[ns]
            self._count(ns, -(self._osizes.get(e.payload_len) or extent_size(e.payload_len)))
        self.policy.discard(e)
        if self.kv_sink is not None:
            self.kv_sink.removed(e)
        b = e.batch
        if b is None:
            fx.deletes.append((ns, key))
        else:
            fx.batches.append(b)
        up = e.up
        if type(up) is bytes:
            self._forget_orphan(e)
        elif up is not None:
            e.up = up.key
            self._drop_kid(up, e)
        kids = e.kids
        if kids is not None:
            e.kids = None
            for c in (list(kids) if type(kids) is set else (kids,)):
                c.up = key
                self._add_orphan(c)
                self.policy.children_changed(c)  # orphaned: no prefix match reaches it any more

    def _drop(self, e: Entry, fx: Effects) -> None:
        """Remove a live entry; free its extent now, or at its last unpin if a read lease holds it."""
        self._unlink(e, fx)
        sp = e.space
        sp.n -= 1
        if e.pins == 0 and not sp.dead:  # a dead space's bytes are gone with its node
            self._held(e, self.quarantine.free(sp, e.offset, extent_size(e.payload_len), e.gen))

    def _evict(self, e: Entry, fx: Effects) -> None:
        """``_drop`` of an eviction victim: what the policy holds is READY, unpinned and on a live node, so the
        state tests are made once and the quarantine's test inlined (a full pool evicts about one page per page it
        takes in). Anything else goes the general way."""
        sp = e.space
        if e.state != READY or e.pins or sp.dead:
            self._drop(e, fx)
            return
        self._unlink_ready(e, fx)
        e.state = GONE
        sp.n -= 1
        pl = e.payload_len
        q = self.quarantine
        if e.gen < q.young_gen:  # Quarantine.free, inlined: an old page's extent is free at once
            sp.alloc.free(e.offset, self._osizes.get(pl) or extent_size(pl))
        else:
            self._held(e, q.free(sp, e.offset, extent_size(pl), e.gen))

    def _unpin_all(self, found) -> None:
        """Drop one pin of each entry; those left unpinned become evictable again in ``found``'s order (READY:
        the policy's recent end) or give their extent back (GONE, dropped while leased)."""
        again = []
        unpinned = 0
        for e in found:
            e.pins -= 1
            if e.pins:
                continue
            unpinned += 1
            if e.state == READY:
                again.append(e)
            elif e.state == GONE and not e.space.dead:
                self._held(e, self.quarantine.free(e.space, e.offset, extent_size(e.payload_len), e.gen))
        self.pinned -= unpinned
        if again:
            self.policy.add_many(again)
