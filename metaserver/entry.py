"""The directory's data model: one ``Entry`` per object, one ``NodeSpace`` per live node, the read-only views
(``Entries``, ``NsEntries``, ``SpaceEntries``) that present them as the maps callers expect, and ``Effects``, the
I/O a mutation leaves to its caller. No I/O, no policy. The directory and its helpers (passes, placement,
invariants) import these records from here; nothing here imports them back.

An entry is what a page costs the metaserver, so it holds only what cannot be derived: 15 slots (about 152 bytes
with the object header; the 15th names its commit record, ``Batch``) next to its key, offset and generation
objects. ``node_id``, ``size``, ``gone``, ``parent``, ``parent_ref`` and ``children`` are properties over those
slots. The views hold no per-entry state: a node's entries are the eviction policy's members plus its few PENDING
and pinned ones (``NodeSpace.n`` counts them), a namespace's entries are ``ready[ns]`` and ``pending_keys[ns]`` of
the directory.

Shared entries (TP-sharded KV, ``metaserver/shared.py``): one entry holds one extent of ``n`` sub-slots, each a
normal object slot of ``part_len`` payload bytes. Its ``payload_len`` slot holds the *layout code*
``part_len | n << SHARD_SHIFT`` (``layout``), so a shared entry costs no more memory than any other; every extent size
is ``extent_size(payload_len)``, never ``object_size`` of it. A plain entry's code is its payload length.

Costs: view lookups O(1) (two dict probes); ``len`` O(1); iteration is a snapshot, O(its entries, plus every
PENDING and pinned entry for a node's view).
"""

from __future__ import annotations

import os
import struct
from typing import TYPE_CHECKING

from metaserver.allocator import Allocator
from transport.wire import ARENA_DATA_START, AllocState, object_size

if TYPE_CHECKING:
    from metaserver.directory import Directory

PENDING, READY, GONE = 0, 1, 2
SHARD_SHIFT = 41  # payload lengths are at most 1 << 40 (validate.MAX_PAYLOAD)
PART_MASK = (1 << SHARD_SHIFT) - 1
MAX_SHARDS = 256


def layout(part_len: int, n: int) -> int:
    """The layout code of a shared entry of ``n`` sub-slots of ``part_len`` payload bytes each."""
    return part_len | (n << SHARD_SHIFT)


def shards_of(code: int) -> int:
    """``n`` of a shared entry's layout code; 0 for a plain entry."""
    return code >> SHARD_SHIFT


def part_len(code: int) -> int:
    """The payload length of one sub-slot (a plain entry: its payload length)."""
    return code & PART_MASK


def stride(code: int) -> int:
    """Bytes between two sub-slots of a shared entry: one object slot of its part length."""
    return object_size(code & PART_MASK)


def extent_size(code: int) -> int:
    """Bytes the entry's one extent takes: ``n`` object slots for a shared entry, one for a plain one."""
    n = code >> SHARD_SHIFT
    return object_size(code) if not n else n * object_size(code & PART_MASK)
STATE_NAMES = ("PENDING", "READY", "GONE")

# ALLOC item states and the items that carry no place (directory.py, shared.py, columns.py answer with these)
NEW, EXISTS, NO_SPACE, IN_FLIGHT = (AllocState.NEW, AllocState.EXISTS, AllocState.NO_SPACE, AllocState.IN_FLIGHT)
OVER_QUOTA = -1  # internal item state (never on the wire): the key does not fit in its namespace's quota
EXISTS_ITEM = (EXISTS, None, None, None, None)
IN_FLIGHT_ITEM = (IN_FLIGHT, None, None, None, None)
NO_SPACE_ITEM = (NO_SPACE, None, None, None, None)
OVER_QUOTA_ITEM = (OVER_QUOTA, None, None, None, None)

_ID_BATCH = 512  # random ids drawn from os.urandom at once
_ids: list[int] = []
os.register_at_fork(after_in_child=_ids.clear)  # a forked child draws its own, never its parent's next ids


def random_id() -> int:
    """A uniformly random id in [0, 2^63) from the OS's CSPRNG (read leases: not guessable). Drawn 512 at a time
    (one 4 KiB read of os.urandom, then a list pop, ~40 ns), where ``secrets.randbits`` paid a syscall each (10 %
    of a 16-slot process's CPU on LOOKUP, one lease per slot of a request)."""
    if not _ids:
        _ids.extend(x >> 1 for x in struct.unpack(f"<{_ID_BATCH}Q", os.urandom(8 * _ID_BATCH)))
    return _ids.pop()


def expire_queue(q, now: float, budget: int, release) -> int:
    """Release the leases of ``q`` (a deque of (expiry, lease) in grant order) whose expiry is past ``now``, at most
    ``budget`` of the oldest; returns how many ``release`` still found held (the rest their owners released)."""
    n = 0
    while q and budget > 0 and q[0][0] <= now:
        _, lease = q.popleft()
        budget -= 1
        n += release(lease)
    return n


def parent_of(ready: dict, pending: dict | None, parent: bytes | None) -> tuple:
    """(the node space of ``parent``'s entry, READY or PENDING, and its key object) or (None, ``parent``) when the
    pool has no such entry (or no parent is named): ALLOC places a child near its parent, and one key object serves
    the parent and every child naming it."""
    if parent is None:
        return None, None
    pe = ready.get(parent)
    if pe is None and pending is not None:
        pe = pending.get(parent)
    return (pe.space, pe.key) if pe is not None else (None, parent)


class Entry:
    """One object. Hashable by identity (kids sets, the pending dict and lease lists hold entries themselves).

    ``up``: None (no parent), the parent's key (bytes: named but not cached, or the entry is not READY yet) or the
    parent's Entry (linked). ``kids``: None, the one linked child, or a set of them (two or more). ``prev``, ``next``
    and ``tier`` belong to the eviction policy. ``node_id``, ``size``, ``gone``, ``parent``, ``parent_ref`` and
    ``children`` are derived (properties), so they cost no memory."""

    __slots__ = ("key", "ns", "space", "offset", "payload_len", "gen", "state", "pins", "last_access", "up", "kids",
                 "prev", "next", "tier", "batch")

    def __init__(self, ns: str, key: bytes, space: "NodeSpace", offset: int, payload_len: int, gen: int,
                 state: int, parent: bytes | None, now: float):
        self.key = key
        self.ns = ns
        self.space = space
        self.offset = offset
        self.payload_len = payload_len
        self.gen = gen
        self.state = state
        self.pins = 0
        self.last_access = now
        self.up = parent
        self.kids = None
        self.prev = self.next = self.tier = None
        self.batch = None

    @property
    def node_id(self) -> str:
        return self.space.node_id

    @property
    def size(self) -> int:
        return extent_size(self.payload_len)

    @property
    def gone(self) -> bool:
        return self.state == GONE

    @property
    def parent(self) -> bytes | None:
        up = self.up
        return up.key if type(up) is Entry else up

    @property
    def parent_ref(self) -> "Entry | None":
        up = self.up
        return up if type(up) is Entry else None

    @property
    def children(self) -> int:
        k = self.kids
        return 0 if k is None else len(k) if type(k) is set else 1


class Batch:
    """The etcd record of one commit: every page a COMMIT made READY in one namespace, under one etcd key (``name``,
    ``persist.EtcdStore.batch_name``). ``ents`` are the entries written with it; the record always holds exactly
    those of them still in the directory (``live``), so evicting or removing one of them rewrites the record
    without it (coalesced in the writer's queue: a burst of evictions of one batch is one rewrite), and the last one
    deletes it. An entry's ``batch`` names its record (None: a record of its own, the per-page layout)."""

    __slots__ = ("name", "ents")

    def __init__(self, name: bytes, ents: list):
        self.name = name
        self.ents = ents

    def live(self) -> list:
        """The entries the record holds now (and keeps only those): in the directory, READY, this batch's. O(ents)."""
        ents = [e for e in self.ents if e.batch is self and e.state == READY and e.space is not None]
        self.ents = ents
        return ents

    def __repr__(self) -> str:
        return f"Batch({self.name!r}, {len(self.ents)} entries)"


class Effects:
    """I/O a mutation leaves to its caller: pages to persist, persisted pages to delete (``deletes``: (ns, key) of
    a page with a record of its own) and commit records to rewrite without pages that left (``batches``). The
    columnar directory (``metaserver/tabledir.py``) makes its commit records itself: ``recs``, put as they are
    (``tablerecords.TableRecord``), and its rewrites are ``batches`` too."""

    __slots__ = ("puts", "deletes", "batches", "recs")

    def __init__(self) -> None:
        self.puts: list[Entry] = []
        self.deletes: list[tuple[str, bytes]] = []
        self.batches: list = []
        self.recs: list = []

    def __bool__(self) -> bool:
        return bool(self.puts or self.deletes or self.batches or self.recs)


class NodeSpace:
    """A live node's arena space: its allocator and a count of the live entries placed on it (``entries`` is a view
    of them)."""

    __slots__ = ("node_id", "alloc", "placeable", "dead", "n", "owner")

    def __init__(self, node_id: str, capacity: int, owner: "Directory | None" = None):
        self.node_id = node_id
        self.alloc = Allocator(ARENA_DATA_START, capacity, track=False)
        self.placeable = True
        self.dead = False
        self.n = 0  # live entries on this node
        self.owner = owner

    @property
    def entries(self) -> "SpaceEntries":
        return SpaceEntries(self)


class SpaceEntries:
    """The live entries of one node: its evictable ones (the policy's), its PENDING ones and its pinned READY ones.
    ``len`` is O(1); iteration makes a snapshot, O(its entries + all PENDING + all pinned)."""

    __slots__ = ("_sp",)

    def __init__(self, sp: NodeSpace):
        self._sp = sp

    def __len__(self) -> int:
        return self._sp.n

    def __bool__(self) -> bool:
        return self._sp.n > 0

    def __contains__(self, e) -> bool:
        return type(e) is Entry and e.space is self._sp and e.state != GONE

    def __iter__(self):
        return iter(self.snapshot())

    def snapshot(self) -> list:
        sp = self._sp
        d = sp.owner
        if d is None or not sp.n:
            return []
        out = d.policy.members(sp.node_id)
        out += [e for e in d._pending if e.space is sp]
        pinned = {id(e): e for es in d.leases.values() for e in es if e.space is sp and e.state == READY}
        out += pinned.values()
        return out

    def __setitem__(self, e, _value) -> None:
        """Count an entry placed on this node from outside the directory (prefer ``Directory.put_ready``)."""
        self._sp.n += 1


class NsEntries:
    """Every live entry of one namespace, READY or PENDING: a view over ``ready[ns]`` and ``pending_keys[ns]``."""

    __slots__ = ("_d", "_ns")

    def __init__(self, d: "Directory", ns: str):
        self._d = d
        self._ns = ns

    def get(self, key, default=None):
        r = self._d.ready.get(self._ns)
        e = r.get(key) if r is not None else None
        if e is None:
            p = self._d.pending_keys.get(self._ns)
            e = p.get(key) if p is not None else None
        return default if e is None else e

    def __getitem__(self, key):
        e = self.get(key)
        if e is None:
            raise KeyError(key)
        return e

    def __contains__(self, key) -> bool:
        return self.get(key) is not None

    def _parts(self) -> list[dict]:
        return [m for m in (self._d.ready.get(self._ns), self._d.pending_keys.get(self._ns)) if m]

    def __len__(self) -> int:
        return sum(len(m) for m in self._parts())

    def __bool__(self) -> bool:
        return bool(self._parts())

    def __iter__(self):
        for m in self._parts():
            yield from list(m)

    def keys(self) -> list:
        return [k for m in self._parts() for k in m]

    def values(self) -> list:
        return [e for m in self._parts() for e in m.values()]

    def items(self) -> list:
        return [kv for m in self._parts() for kv in m.items()]

    def __setitem__(self, key, e: Entry) -> None:
        """File an entry built outside the directory (prefer ``Directory.put_ready``)."""
        d = self._d
        target = d.ready if e.state == READY else d.pending_keys
        target.setdefault(self._ns, {})[key] = e
        d._count(self._ns, extent_size(e.payload_len))
        if e.state == PENDING:
            d._pending.setdefault(e, (None, None))


class Entries:
    """ns -> ``NsEntries`` for every namespace with a live entry (read-only view; ``setdefault`` returns the view)."""

    __slots__ = ("_d",)

    def __init__(self, d: "Directory"):
        self._d = d

    def _names(self) -> list[str]:
        d = self._d
        return list(d.ready) + [ns for ns in d.pending_keys if ns not in d.ready]

    def get(self, ns, default=None):
        d = self._d
        if ns in d.ready or ns in d.pending_keys:
            return NsEntries(d, ns)
        return default

    def __getitem__(self, ns) -> NsEntries:
        v = self.get(ns)
        if v is None:
            raise KeyError(ns)
        return v

    def setdefault(self, ns, _default=None) -> NsEntries:
        return NsEntries(self._d, ns)

    def __contains__(self, ns) -> bool:
        return ns in self._d.ready or ns in self._d.pending_keys

    def __iter__(self):
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def keys(self) -> list[str]:
        return self._names()

    def values(self) -> list[NsEntries]:
        return [NsEntries(self._d, ns) for ns in self._names()]

    def items(self) -> list[tuple[str, NsEntries]]:
        return [(ns, NsEntries(self._d, ns)) for ns in self._names()]
