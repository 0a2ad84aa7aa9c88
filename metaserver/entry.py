"""The directory's shared vocabulary: entry states, ALLOC item states, layout codes of shared (TP-sharded) pages
and their extent sizes, ``Effects`` (the etcd work a table mutation leaves to its caller), ``Batch`` (a commit
record and its pages) and ``Entry``, one page as a commit record's parse yields it (``metaserver/records.py``: the
full load and the warm copy file those into the table's rows). No I/O, no policy.

Shared entries (TP-sharded KV, ``metaserver/tableshared.py``): one row holds one extent of ``n`` sub-slots, each a
normal object slot of ``part_len`` payload bytes; its layout code is ``part_len | n << SHARD_SHIFT`` (``layout``),
and every extent size is ``extent_size(code)``, never ``object_size`` of it. A plain page's code is its payload
length.
"""

from __future__ import annotations

import os
import struct

from transport.wire import AllocState, object_size

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


class Entry:
    """One object. Hashable by identity (kids sets, the pending dict and lease lists hold entries themselves).

    ``up``: None (no parent), the parent's key (bytes: named but not cached, or the entry is not READY yet) or the
    parent's Entry (linked). ``kids``: None, the one linked child, or a set of them (two or more). ``prev``, ``next``
    and ``tier`` belong to the eviction policy. ``node_id``, ``size``, ``gone``, ``parent``, ``parent_ref`` and
    ``children`` are derived (properties), so they cost no memory."""

    __slots__ = ("key", "ns", "space", "offset", "payload_len", "gen", "state", "pins", "last_access", "up", "kids",
                 "prev", "next", "tier", "batch")

    def __init__(self, ns: str, key: bytes, space: object, offset: int, payload_len: int, gen: int,
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
