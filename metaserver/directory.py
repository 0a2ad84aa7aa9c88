"""Page directory: namespace -> key -> where the object lives, its state, pins and recency. No I/O.

Every mutation is a synchronous method that updates memory and returns the I/O still to do as ``Effects``: READY
entries to persist (``puts``) and persisted pages to delete (``deletes``). The caller hands those to the etcd writer
afterwards; nothing here awaits, so a request's bookkeeping is atomic with respect to every other request.

Entry lifecycle::

    alloc -> PENDING --commit--> READY --remove / evict / node loss--> gone
                 \\--abort / pending_ttl expiry--> gone (never persisted, so nothing to delete)

Invariants:

- ``ready[ns]`` holds exactly the READY entries of ``entries[ns]``; EXISTS, PREFIX and LOOKUP read only it.
- Every live entry owns one allocator extent on its node's ``NodeSpace``; a gone entry still pinned by a read lease
  (a *zombie*) keeps its extent until its last pin goes, so a reader never races a new writer into the same bytes.
- The eviction policy holds exactly the READY, unpinned, live entries: PENDING and pinned ones can never be evicted.
- ``used <= capacity`` per node (the allocator enforces it) and in total (totals sum live nodes only).
- Generations come from the caller (reserved from etcd), unique and increasing across restarts.

Costs: exists/prefix O(keys) with one dict probe per key and no allocation per key; lookup/alloc/commit O(keys);
alloc on a full node adds O(victims) evictions. Sweeps (pending expiry, read leases, eviction) take a budget and do
at most that much work per call.
"""

from __future__ import annotations

from collections import deque
from metaserver.allocator import Allocator
from metaserver.eviction import Policy, bytes_to_low, make_policy, over_high
from transport import wire
from transport.wire import ARENA_DATA_START, object_size

PENDING, READY = 0, 1
STATE_NAMES = ("PENDING", "READY")
PLACE_EVICT_BUDGET = 1024  # victims one placement may evict before it answers NO_SPACE for that key
NEW, EXISTS, NO_SPACE, IN_FLIGHT = (wire.AllocState.NEW, wire.AllocState.EXISTS, wire.AllocState.NO_SPACE,
                                    wire.AllocState.IN_FLIGHT)
_EXISTS_ITEM = (EXISTS, None, None, None, None)
_IN_FLIGHT_ITEM = (IN_FLIGHT, None, None, None, None)
_NO_SPACE_ITEM = (NO_SPACE, None, None, None, None)


class Entry:
    """One object. Hashable by identity (eviction policies key their ordered dicts by the entry itself)."""

    __slots__ = ("ns", "key", "space", "node_id", "offset", "size", "payload_len", "gen", "state", "parent",
                 "last_access", "pins", "children", "parent_ref", "gone", "token")

    def __init__(self, ns: str, key: bytes, space: "NodeSpace", offset: int, payload_len: int, gen: int,
                 state: int, parent: bytes | None, now: float):
        self.ns = ns
        self.key = key
        self.space = space
        self.node_id = space.node_id
        self.offset = offset
        self.size = object_size(payload_len)
        self.payload_len = payload_len
        self.gen = gen
        self.state = state
        self.parent = parent
        self.last_access = now
        self.pins = 0
        self.children = 0  # READY entries naming this one as parent (prefix-aware eviction)
        self.parent_ref: Entry | None = None  # the parent entry whose ``children`` this one incremented
        self.gone = False
        self.token: int | None = None  # the allocation token of its writer while PENDING (idempotent ALLOC)


class NodeSpace:
    """A live node's arena space: its allocator and the entries placed on it."""

    __slots__ = ("node_id", "alloc", "entries", "placeable", "dead")

    def __init__(self, node_id: str, capacity: int):
        self.node_id = node_id
        self.alloc = Allocator(ARENA_DATA_START, capacity)
        self.entries: dict[Entry, None] = {}
        self.placeable = True
        self.dead = False


class Effects:
    """I/O a mutation leaves to its caller: pages to persist and persisted pages to delete."""

    __slots__ = ("puts", "deletes")

    def __init__(self) -> None:
        self.puts: list[Entry] = []
        self.deletes: list[tuple[str, bytes]] = []

    def __bool__(self) -> bool:
        return bool(self.puts or self.deletes)


class Directory:
    def __init__(self, *, pending_ttl_s: float = 30.0, read_lease_s: float = 10.0, policy: str = "lru"):
        self.pending_ttl_s = pending_ttl_s
        self.read_lease_s = read_lease_s
        self.policy: Policy = make_policy(policy)
        self.entries: dict[str, dict[bytes, Entry]] = {}
        self.ready: dict[str, dict[bytes, Entry]] = {}
        self.spaces: dict[str, NodeSpace] = {}
        self.leases: dict[int, list[Entry]] = {}
        # READY entries by the (ns, key) they name as parent, whether or not that parent is cached: lets a parent
        # that arrives (or comes back) adopt its children, and a parent that goes orphan them (prefix-lru).
        self.kids: dict[tuple[str, bytes], set[Entry]] = {}
        self._lease_q: deque[tuple[float, int]] = deque()
        self._pending_q: deque[tuple[float, Entry, int]] = deque()
        self._next_lease = 1
        self.hits = self.misses = self.evictions = self.puts = 0
        self.pending = 0
        self.pinned = 0  # entries (live or zombie) with pins > 0

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

    def namespaces(self) -> dict[str, int]:
        return {ns: len(r) for ns, r in self.ready.items() if r}

    # -- nodes -------------------------------------------------------------------------------------------------
    def add_space(self, node_id: str, capacity: int) -> NodeSpace:
        """Give a (re)registered node a fresh, empty arena space. The node must not have one (drop it first)."""
        assert node_id not in self.spaces, node_id
        sp = self.spaces[node_id] = NodeSpace(node_id, capacity)
        return sp

    def drop_space(self, node_id: str) -> tuple[int, Effects]:
        """Forget a node's arena (node died or came back with another arena): every entry on it goes, pinned or not
        (the bytes are gone or belong to another arena; readers detect that by the object header)."""
        fx = Effects()
        sp = self.spaces.pop(node_id, None)
        if sp is None:
            return 0, fx
        sp.dead = True
        n = len(sp.entries)
        for e in list(sp.entries):
            self._unlink(e, fx)
        sp.entries.clear()
        self.policy.drop_node(node_id)
        return n, fx

    def set_placeable(self, node_id: str, placeable: bool) -> None:
        sp = self.spaces.get(node_id)
        if sp is not None:
            sp.placeable = placeable

    def drain(self, node_id: str) -> tuple[int, int, Effects]:
        """Stop placing on ``node_id`` and drop its unpinned READY objects. Returns (dropped, pinned, effects);
        PENDING objects stay until committed (then dropped by a later drain) or expired."""
        fx = Effects()
        sp = self.spaces.get(node_id)
        if sp is None:
            return 0, 0, fx
        sp.placeable = False
        dropped = pinned = 0
        for e in list(sp.entries):
            if e.state != READY:
                continue
            if e.pins:
                pinned += 1
            else:
                self._drop(e, fx)
                dropped += 1
        return dropped, pinned, fx

    def load_pages(self, node_id: str, pages: list[tuple[str, bytes, int, int, int, bytes | None]]) -> Effects:
        """Rebuild a node's entries from persisted records [(ns, key, offset, payload_len, gen, parent)], given in
        recency order (oldest first). Overlapping or out-of-range records, and keys already present, are dropped
        (returned as deletes). The node's space must exist and be empty."""
        sp = self.spaces[node_id]
        fx = Effects()
        keep = []
        for rec in pages:
            ns, key = rec[0], rec[1]
            if key in self.entries.get(ns, ()):
                fx.deletes.append((ns, key))
            else:
                keep.append(rec)
        rejected = set(sp.alloc.rebuild([(r[2], object_size(r[3])) for r in keep]))
        for i, (ns, key, off, plen, gen, parent) in enumerate(keep):
            if i in rejected:
                fx.deletes.append((ns, key))
                continue
            e = Entry(ns, key, sp, off, plen, gen, READY, parent, 0.0)
            self.entries.setdefault(ns, {})[key] = e
            self.ready.setdefault(ns, {})[key] = e
            sp.entries[e] = None
        loaded = [self.ready[ns][key] for i, (ns, key, *_) in enumerate(keep) if i not in rejected]
        for e in loaded:
            self._link_ready(e)
        for e in loaded:
            self.policy.add(e)
        return fx

    # -- data plane --------------------------------------------------------------------------------------------
    def alloc(self, ns: str, keys: list[bytes], sizes: list[int], parents: list | None, gen_base: int,
              now: float, token: int | None = None) -> tuple[list, Effects]:
        """Place each new key (PENDING, generation ``gen_base + i``), evicting if needed. Returns (items, effects):
        item = [NEW, node_id, offset, payload_len, gen] | [EXISTS, None...] | [NO_SPACE, None...] |
        [IN_FLIGHT, None...] (another writer holds the key PENDING). A PENDING key allocated under the same
        ``token`` gets its place again (a retried ALLOC whose answer was lost), so ALLOC is idempotent."""
        fx = Effects()
        d = self.entries.get(ns)
        if d is None:
            d = self.entries[ns] = {}
        items: list = []
        expiry = now + self.pending_ttl_s
        seen: set[bytes] = set()  # a key twice in one request: the first occurrence is the one stored
        for i, key in enumerate(keys):
            e = d.get(key)
            if key in seen:
                items.append(_EXISTS_ITEM)
                continue
            seen.add(key)
            if e is not None:
                if e.state != PENDING:
                    items.append(_EXISTS_ITEM)
                elif token is not None and e.token == token and e.payload_len == sizes[i]:
                    items.append((NEW, e.node_id, e.offset, e.payload_len, e.gen))
                else:
                    items.append(_IN_FLIGHT_ITEM)
                continue
            plen = sizes[i]
            parent = parents[i] if parents else None
            pe = d.get(parent) if parent is not None else None
            placed = self._place(object_size(plen), fx, pe.space if pe is not None else None)
            if placed is None:
                items.append(_NO_SPACE_ITEM)
                continue
            sp, off = placed
            gen = gen_base + i
            e = Entry(ns, key, sp, off, plen, gen, PENDING, parents[i] if parents else None, now)
            e.token = token
            d[key] = e
            sp.entries[e] = None
            self.pending += 1
            self._pending_q.append((expiry, e, gen))
            items.append((NEW, sp.node_id, off, plen, gen))
        return items, fx

    def _place(self, size: int, fx: Effects, near: NodeSpace | None = None) -> tuple[NodeSpace, int] | None:
        """Find ``size`` bytes. A free hole first: on ``near`` (the parent's node, so a chain stays together) unless
        it has less than half the free space of the emptiest node (chains that all descend from one shared prefix
        would otherwise pile onto one node), then on the node with most free space, then any. Only when no node has
        a hole, evict: on the node whose next victim was used least recently first (an approximation of one LRU
        across nodes, so a busy node does not evict its fresh pages while another keeps stale ones), at most
        PLACE_EVICT_BUDGET victims for this placement (bounded work per request; the background pass does the
        rest)."""
        spaces = [s for s in self.spaces.values() if s.placeable and s.alloc.capacity >= size]
        if not spaces:
            return None
        spaces.sort(key=_free_of, reverse=True)
        if near is not None and near in spaces and 2 * _free_of(near) >= _free_of(spaces[0]):
            spaces.remove(near)
            spaces.insert(0, near)
        for sp in spaces:
            off = sp.alloc.alloc(size)
            if off is not None:
                return sp, off
        budget = PLACE_EVICT_BUDGET
        for sp in sorted(spaces, key=self._next_victim_access):
            for victim in self.policy.victims(sp.node_id):
                if budget <= 0:
                    return None
                budget -= 1
                self._drop(victim, fx)
                self.evictions += 1
                off = sp.alloc.alloc(size)
                if off is not None:
                    return sp, off
        return None

    def _next_victim_access(self, sp: NodeSpace) -> float:
        victim = next(iter(self.policy.victims(sp.node_id)), None)
        return victim.last_access if victim is not None else float("inf")

    def commit(self, ns: str, keys: list[bytes], gens: list[int], now: float) -> tuple[list[bool], Effects]:
        """PENDING -> READY for each (key, gen) that is still pending with that generation. Idempotent: a key
        already READY with that very generation reports True again (a retry whose first answer was lost, possibly
        across a failover that loaded the commit from etcd); anything else reports False."""
        fx = Effects()
        d = self.entries.get(ns, {})
        r = self.ready.get(ns)
        ok: list[bool] = []
        for key, gen in zip(keys, gens):
            e = d.get(key)
            if e is None or e.state != PENDING or e.gen != gen:
                ok.append(e is not None and e.state == READY and e.gen == gen)
                continue
            if r is None:
                r = self.ready[ns] = {}
            e.state = READY
            e.last_access = now
            r[key] = e
            self.pending -= 1
            self.puts += 1
            self._link_ready(e)
            self.policy.add(e)
            fx.puts.append(e)
            ok.append(True)
        return ok, fx

    def abort(self, ns: str, keys: list[bytes], gens: list[int]) -> int:
        """Free PENDING entries whose generation matches. Returns how many were freed (nothing to persist)."""
        d = self.entries.get(ns, {})
        fx = Effects()
        n = 0
        for key, gen in zip(keys, gens):
            e = d.get(key)
            if e is not None and e.state == PENDING and e.gen == gen:
                self._drop(e, fx)
                n += 1
        return n

    def exists(self, ns: str, keys: list[bytes]) -> list[bool]:
        r = self.ready.get(ns)
        if not r:
            return [False] * len(keys)
        return [k in r for k in keys]

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

    def lookup(self, ns: str, keys: list[bytes], now: float) -> tuple[int, list]:
        """Locations of READY keys, each pinned under one read lease (0 when nothing was found)."""
        r = self.ready.get(ns) or {}
        locs: list = []
        found: list[Entry] = []
        policy = self.policy
        for k in keys:
            e = r.get(k)
            if e is None:
                locs.append(None)
                continue
            locs.append((e.node_id, e.offset, e.payload_len, e.gen))
            found.append(e)
            if e.pins == 0:
                policy.discard(e)
                self.pinned += 1
            e.pins += 1
            e.last_access = now
        self.hits += len(found)
        self.misses += len(keys) - len(found)
        if not found:
            return 0, locs
        lease = self._next_lease
        self._next_lease += 1
        self.leases[lease] = found
        self._lease_q.append((now + self.read_lease_s, lease))
        return lease, locs

    def release(self, lease: int) -> bool:
        """Unpin everything under ``lease``; False when it is unknown or already expired (not an error)."""
        found = self.leases.pop(lease, None)
        if found is None:
            return False
        for e in found:
            self._unpin(e)
        return True

    def remove(self, ns: str, keys: list[bytes]) -> tuple[list[bool], Effects]:
        """Remove keys (READY or PENDING). A pinned object's space is freed when its last pin goes."""
        fx = Effects()
        d = self.entries.get(ns, {})
        out: list[bool] = []
        for k in keys:
            e = d.get(k)
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
            for key, e in self.entries.get(name, {}).items():
                if len(out) >= limit:
                    return out, True
                out.append((name, key, e.payload_len, e.node_id, STATE_NAMES[e.state]))
        return out, False

    # -- eviction ----------------------------------------------------------------------------------------------
    def evict_node(self, node_id: str, nbytes: int, budget: int, fx: Effects) -> tuple[int, int]:
        """Evict on one node in policy order until ``nbytes`` are freed or ``budget`` objects went.
        Returns (evicted, freed_bytes)."""
        n = freed = 0
        for victim in self.policy.victims(node_id):
            if freed >= nbytes or n >= budget:
                break
            freed += victim.size
            self._drop(victim, fx)
            n += 1
        self.evictions += n
        return n, freed

    def evict_bytes(self, nbytes: int, budget: int, fx: Effects) -> tuple[int, int]:
        """Free at least ``nbytes`` across nodes, always from the fullest node (by fill ratio). Bounded by
        ``budget`` evictions. Returns (evicted, freed_bytes)."""
        n = freed = 0
        while freed < nbytes and n < budget:
            cands = [s for s in self.spaces.values() if self.policy.count(s.node_id)]
            if not cands:
                break
            sp = max(cands, key=_fill_of)
            k, f = self.evict_node(sp.node_id, 1, 1, fx)
            n += k
            freed += f
        return n, freed

    def watermark_pass(self, high: float, low: float, budget: int, fx: Effects) -> tuple[int, int]:
        """Evict each node above ``high`` down to ``low`` (pass ``high=low`` to force a pass). Bounded by ``budget``
        evictions in total; returns (evicted, freed_bytes)."""
        n = freed = 0
        for sp in list(self.spaces.values()):
            cap, used = sp.alloc.capacity, sp.alloc.used
            if n >= budget or not over_high(used, cap, high):
                continue
            k, f = self.evict_node(sp.node_id, bytes_to_low(used, cap, low), budget - n, fx)
            n += k
            freed += f
        return n, freed

    def needs_eviction(self, high: float) -> bool:
        return any(over_high(s.alloc.used, s.alloc.capacity, high) and self.policy.count(s.node_id)
                   for s in self.spaces.values())

    def evict_all(self, budget: int, fx: Effects) -> tuple[int, int, bool]:
        """Evict every unpinned READY object, at most ``budget`` per call. Returns (evicted, freed, done)."""
        n = freed = 0
        for sp in list(self.spaces.values()):
            k, f = self.evict_node(sp.node_id, 1 << 62, budget - n, fx)
            n += k
            freed += f
            if n >= budget:
                return n, freed, False
        return n, freed, True

    # -- background expiry -------------------------------------------------------------------------------------
    def expire_pending(self, now: float, budget: int) -> int:
        """Free PENDING entries older than pending_ttl_s; examines at most ``budget`` queue items."""
        q = self._pending_q
        fx = Effects()
        n = 0
        while q and budget > 0 and q[0][0] <= now:
            _, e, gen = q.popleft()
            budget -= 1
            if not e.gone and e.state == PENDING and e.gen == gen:
                self._drop(e, fx)
                n += 1
        return n

    def expire_leases(self, now: float, budget: int) -> int:
        q = self._lease_q
        n = 0
        while q and budget > 0 and q[0][0] <= now:
            _, lease = q.popleft()
            budget -= 1
            if self.release(lease):
                n += 1
        return n

    # -- internals ---------------------------------------------------------------------------------------------
    def _link_ready(self, e: Entry) -> None:
        """``e`` just became READY: link it to its cached parent, and adopt its cached children."""
        if e.parent is not None:
            self.kids.setdefault((e.ns, e.parent), set()).add(e)
            p = self.ready.get(e.ns, {}).get(e.parent)
            if p is not None and p is not e:
                self._link(e, p)
        for c in self.kids.get((e.ns, e.key), ()):
            if c.parent_ref is None and c is not e:
                self._link(c, e)
                self.policy.children_changed(c)  # no longer an orphan

    def _link(self, child: Entry, parent: Entry) -> None:
        child.parent_ref = parent
        parent.children += 1
        if parent.children == 1 and parent.pins == 0:
            self.policy.children_changed(parent)

    def _unlink(self, e: Entry, fx: Effects) -> None:
        """Remove ``e`` from the maps and the policy; no space accounting."""
        d = self.entries.get(e.ns)
        if d is not None and d.get(e.key) is e:
            del d[e.key]
            if not d:
                del self.entries[e.ns]
        if e.state == READY:
            r = self.ready.get(e.ns)
            if r is not None and r.get(e.key) is e:
                del r[e.key]
                if not r:
                    del self.ready[e.ns]
            self.policy.discard(e)
            fx.deletes.append((e.ns, e.key))
        else:
            self.pending -= 1
        p = e.parent_ref
        if p is not None:
            e.parent_ref = None
            p.children -= 1
            if p.children == 0 and not p.gone and p.state == READY and p.pins == 0:
                self.policy.children_changed(p)
        if e.state == READY:
            if e.parent is not None:
                sibs = self.kids.get((e.ns, e.parent))
                if sibs is not None:
                    sibs.discard(e)
                    if not sibs:
                        del self.kids[(e.ns, e.parent)]
            for c in self.kids.get((e.ns, e.key), ()):
                if c.parent_ref is e:
                    c.parent_ref = None
                    self.policy.children_changed(c)  # orphaned: no prefix match reaches it any more
            e.children = 0
        e.gone = True

    def _drop(self, e: Entry, fx: Effects) -> None:
        """Remove a live entry; free its extent now, or at its last unpin if a read lease holds it."""
        self._unlink(e, fx)
        sp = e.space
        sp.entries.pop(e, None)
        if e.pins == 0:
            sp.alloc.free(e.offset, e.size)

    def _unpin(self, e: Entry) -> None:
        e.pins -= 1
        if e.pins:
            return
        self.pinned -= 1
        if e.gone:
            if not e.space.dead:
                e.space.alloc.free(e.offset, e.size)
        elif e.state == READY:
            self.policy.add(e)

    def check(self) -> None:
        """Assert the invariants (tests only)."""
        for ns, d in self.entries.items():
            for k, e in d.items():
                assert not e.gone and e.ns == ns and e.key == k
                assert (self.ready.get(ns, {}).get(k) is e) == (e.state == READY)
                assert e in e.space.entries and e.space.alloc.is_allocated(e.offset)
        n_pending = sum(1 for d in self.entries.values() for e in d.values() if e.state == PENDING)
        assert n_pending == self.pending, (n_pending, self.pending)
        for sp in self.spaces.values():
            sp.alloc.check()
            assert sp.alloc.used <= sp.alloc.capacity
            evictable = sum(1 for e in sp.entries if e.state == READY and e.pins == 0)
            assert self.policy.count(sp.node_id) == evictable, (self.policy.count(sp.node_id), evictable)
        assert self.used <= self.capacity


def _free_of(sp: NodeSpace) -> int:
    return sp.alloc.units - sp.alloc.used_units


def _fill_of(sp: NodeSpace) -> float:
    return sp.alloc.used_units / sp.alloc.units if sp.alloc.units else 1.0
