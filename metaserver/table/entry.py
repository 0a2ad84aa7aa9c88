"""The page table's shared vocabulary: row states, ALLOC item states, layout codes of shared (TP-sharded) pages
and their extent sizes, read lease ids, ``Effects`` (the etcd work a table mutation leaves to its caller) and
``Entry``, one page as the parse of its etcd record yields it (``metaserver/table/records.py``: the full load and the
warm copy file those into the table's rows); ``factor``, the distinct values of a column of small indexes
(namespaces, nodes, layout codes) and each row's among them, as commit records and LOOKUP answers group their rows.
No I/O, no policy.

Shared entries (TP-sharded KV, ``metaserver/table/shared.py``): one row holds one extent of ``n`` sub-slots, each a
normal object slot of ``part_len`` payload bytes; its layout code is ``part_len | n << SHARD_SHIFT`` (``layout``),
and every extent size is ``extent_size(code)``, never ``object_size`` of it. A plain page's code is its payload
length.
"""

from __future__ import annotations

import os
import struct

import numpy as np
# numpy imports numpy.ma at the first np.unique (its masked-array check): 65 ms on the 2-core VM, paid at the
# process's start here, not inside a standby's first takeover load
import numpy.ma  # noqa: F401

from transport.wire import AllocState
from transport.objformat import object_size

PENDING, READY, GONE = 0, 1, 2
SHARD_SHIFT = 41  # payload lengths are at most 1 << 40 (validate.MAX_PAYLOAD)
PART_MASK = (1 << SHARD_SHIFT) - 1


def layout(part_len: int, n: int) -> int:
    """The layout code of a shared entry of ``n`` sub-slots of ``part_len`` payload bytes each."""
    return part_len | (n << SHARD_SHIFT)


def shards_of(code: int) -> int:
    """``n`` of a shared entry's layout code; 0 for a plain entry."""
    return code >> SHARD_SHIFT


def extent_size(code: int) -> int:
    """Bytes the entry's one extent takes: ``n`` object slots for a shared entry, one for a plain one."""
    n = code >> SHARD_SHIFT
    return object_size(code) if not n else n * object_size(code & PART_MASK)


STATE_NAMES = ("PENDING", "READY", "GONE")

# ALLOC item states and the items that carry no place (columns.py and table/shared.py answer with these)
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
    """One page as the parse of its etcd record yields it (``metaserver/table/records.py``), before the full load or a warm
    copy files it as a row: READY by definition. ``payload_len`` is its layout code (a shared entry's: ``layout``),
    ``parent`` its parent page's key (None: none) and ``batch`` the etcd key of the commit record that holds it
    (None: a page record of its own)."""

    __slots__ = ("key", "ns", "offset", "payload_len", "gen", "parent", "batch")

    def __init__(self, ns: str, key: bytes, offset: int, payload_len: int, gen: int, parent: bytes | None,
                 batch: bytes | None = None):
        self.key = key
        self.ns = ns
        self.offset = offset
        self.payload_len = payload_len
        self.gen = gen
        self.parent = parent
        self.batch = batch


class Effects:
    """The etcd work table mutations leave to their caller (``TableDirectory.effects``): new commit records to put
    (``recs``), commit records to rewrite without rows that left (``batches``; a ``tablerecords.TableRecord`` is
    encoded when the writer takes it, a delete once it holds no row) and page records of their own to delete
    (``deletes``: (ns, key), pages loaded from the per-page layout)."""

    __slots__ = ("deletes", "batches", "recs")

    def __init__(self) -> None:
        self.deletes: list[tuple[str, bytes]] = []
        self.batches: list = []
        self.recs: list = []

    def __bool__(self) -> bool:
        return bool(self.deletes or self.batches or self.recs)


RANK_TAKE = 256  # values past which ``factor`` ranks them by a table, not a search


def factor(v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``np.unique(v, return_inverse=True)`` of a column of small non-negative indexes (into the table's short lists
    of namespaces, nodes, layout codes), and the counts: (the distinct values ascending, intp; each value's index among
    them, intp; ``np.bincount(v)``, by value). One bincount, no sort: 128 values, 2-core VM, about 2 us for one
    distinct value and 3-4 for a few dozen, where np.unique sorts (8-9 us). Each value's index by ``searchsorted`` up
    to RANK_TAKE values, past it by a take from a table of ranks (1,024 values: 8 vs 11 us; 128: 1.5 vs 2.5)."""
    cnt = np.bincount(v)
    uniq = cnt.nonzero()[0]
    if len(uniq) <= 1:
        return uniq, np.zeros(len(v), np.intp), cnt
    if len(v) <= RANK_TAKE:
        return uniq, uniq.searchsorted(v), cnt
    rank = np.empty(len(cnt), np.intp)
    rank[uniq] = np.arange(len(uniq))
    return uniq, rank.take(v), cnt
