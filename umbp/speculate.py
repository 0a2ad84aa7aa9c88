"""Speculative reads: a client reads the pages it remembers while the LOOKUP that validates them is in flight.

Why: a get is one metaserver round trip (LOOKUP, about 150 us on the 2-core test machine) and then the copy; for
64 KiB pages the round trip costs as much as copying the batch, so a get ran at a third of memcpy (shm) and 0.6x the
loopback stream (tcp). Overlapping the two leaves the longer of them.

How: each client keeps ``LocationCache``: key -> the location (node, offset, size, generation, tag, capability) of
a READY page it saw in a LOOKUP answer or committed itself. ``Client._get`` submits its LOOKUP (pipelined, not
awaited), reads every remembered page into its out meanwhile, then takes the answer. A page whose answer is the
very location read (same node, offset, size and generation) and whose read succeeded is done; every other page
(moved, missed, failed read) is read again from the answer's location, or is a miss: its out is overwritten, or
returned as -1, never returned as data.

Why an equal answer proves the bytes:
- Generations are unique in a pool over its whole life (one counter persisted in etcd; a partitioned pool's slot s
  counts from ``(s << 52) + 1``), so (node, offset, generation) names one object, never a later one in its place.
- An object's life is one interval. It was READY when the client remembered it, before the read began, and alive
  when the metaserver served the LOOKUP; so it was alive in between, and from the LOOKUP on the read lease pins it
  until the RELEASE, sent after the read. Its slot therefore held it for the whole read.
- A committed object's bytes never change while it lives: the node refuses a write capability for a slot that holds
  its generation or a newer one (``metaserver/table/grants.py``), and the shm/tcp reads check its header before and
  after the copy as every read does.

What it does not change: the LOOKUP still runs for every get (recency, hit/miss counters, the read lease, access
rights: a key this client may no longer read answers as a miss and the speculative bytes are dropped). A header
check before and after the copy (seqlock-style) cannot stand in for the answer: it proves the bytes are those of the
generation read, not that this generation is still the key's value. A removed key, or one put again (a new
generation in another slot), leaves the old slot's header intact until the slot is reused, so a get served from this
cache alone would return the old value where the pool answers a miss or the new bytes (tests/test_read_ahead.py's
remove and rewrite cases).

A remembered node that went silent (black-holed, frozen) must not hold the get: the speculative read runs under its
own deadline, ``read_deadline`` (at most ``SPEC_READ_S`` plus the batch at ``SPEC_MIN_RATE``, never past the call's;
the other nodes of the batch, finished after a silent one used it up, keep the answers that have already arrived:
a transport collects those without waiting, transport/base.py), and a node whose speculative read failed with a
transport error (timeouts included) is forgotten (``LocationCache.forget_node``): later gets read it only where a
LOOKUP answer names it again. Before this bound a get of pages remembered on a black-holed node waited out its whole
deadline although the LOOKUP answer had already dropped that node's pages (found by tests/test_multihost.py's black
hole).

Cost: a remembered page that moved is copied twice. ``Speculation`` backs off when most of a batch was wasted (the
next ``BACKOFF_BATCHES`` batches read after the answer only), so an eviction storm does not double the traffic.
"""

from __future__ import annotations

import struct
from itertools import compress, islice, repeat
from typing import Any

import numpy as np

from transport.answerrows import LOC_ROW, NO_NODE

CACHE_MAX = 1 << 16  # remembered locations per client (about 15 MiB at most); the oldest quarter dropped when full
BACKOFF_BATCHES = 8  # batches read the plain way after one whose speculation was mostly wasted
SPEC_READ_S = 0.5  # a speculative read waits at most this long plus its bytes at SPEC_MIN_RATE
SPEC_MIN_RATE = 1e9  # bytes per second
PLACES_MAX = 1 << 14  # (node, capability) places the remembered rows name (LocationCache.learn_rows)
_ROW = struct.Struct("<QQQQII")  # LOC_ROW: tag, gen, len, off, node (here: a place), pad
_ROW_BYTES = np.dtype((np.void, LOC_ROW.itemsize))
_MISS = np.array([(0, 0, 0, 0, NO_NODE, 0)], LOC_ROW).tobytes()


def read_deadline(deadline: float, now: float, nbytes: int) -> float:
    """The deadline of a speculative read of ``nbytes`` started at ``now`` within a call due at ``deadline``."""
    return min(deadline, now + SPEC_READ_S + nbytes / SPEC_MIN_RATE)


class LocationCache:
    """Key (normalised bytes, one namespace: the client's) -> the location tuple of a LOOKUP answer,
    ``(node_id, offset, size, generation, tag, capability)``, at most ``limit`` of them (insertion order; the
    oldest quarter goes when full).

    The array read path (``umbp/readbatch.py``) keeps an answer's rows instead (``learn_rows``): the key's 40-byte
    ``answerrows.LOC_ROW`` as bytes, its node field naming a *place* (node id and read capability, ``_places``), so a batch's
    remembered locations are one ``map(dict.get)`` and one ``b"".join`` away from an array (``rows``). Places are
    deduplicated; at PLACES_MAX (closed pools: a capability per answer) every remembered location is dropped."""

    __slots__ = ("limit", "_locs", "_place_ix", "_places", "_place_node", "_node_ix", "_node_names")

    def __init__(self, limit: int = CACHE_MAX):
        self.limit = limit
        self._locs: dict[bytes, tuple | bytes] = {}
        self._place_ix: dict[tuple, int] = {}
        self._places: list[tuple[str, Any]] = []  # (node id, capability) by place number
        self._place_node = np.zeros(PLACES_MAX, np.int32)  # place number -> node number
        self._node_ix: dict[str, int] = {}
        self._node_names: list[str] = []  # node number -> node id

    def __len__(self) -> int:
        return len(self._locs)

    def get(self, key: bytes) -> tuple | None:
        loc = self._locs.get(key)
        if type(loc) is bytes:
            tag, gen, size, off, place, _pad = _ROW.unpack(loc)
            node_id, cap = self._places[place]
            return (node_id, off, size, gen, tag, cap)
        return loc

    def node_number(self, node_id: str) -> int:
        """A small integer for ``node_id``, the same for the client's life (batches group pages by it)."""
        n = self._node_ix.get(node_id)
        if n is None:
            n = self._node_ix[node_id] = len(self._node_names)
            self._node_names.append(node_id)
        return n

    def node_name(self, n: int) -> str:
        return self._node_names[n]

    def place_cap(self, place: int) -> Any:
        return self._places[place][1]

    def _place(self, node_id: str, cap: Any) -> int:
        p = self._place_ix.get((node_id, cap))
        if p is None:
            if len(self._places) >= PLACES_MAX:  # every remembered row names a place: all of them go
                self._locs.clear()
                self._place_ix.clear()
                self._places.clear()
            p = self._place_ix[(node_id, cap)] = len(self._places)
            self._places.append((node_id, cap))
            self._place_node[p] = self.node_number(node_id)
        return p

    def learn_rows(self, keys: list[bytes], rows: np.ndarray, nodes: list, caps: list,
                   known: np.ndarray | None = None) -> bool:
        """Remember an answer's rows (``umbp.lookup``: caps empty or one a node); a miss forgets the key.
        ``known``: the rows ``rows(keys)`` gave for these keys before the answer (the read ahead's); when every key
        hit and the answer's rows are those very bytes, nothing is stored (an update of the same values would keep
        each key's place in the insertion order anyway): one compare instead of a bytes object and a dict store a
        key, the steady state of repeated gets. Returns True exactly then: every key hit and the answer names, row for
        row, the node (and capability), offset, size, generation and tag of ``known``."""
        if not self.limit:
            return False
        node = rows["node"]
        hit = node != NO_NODE
        full = len(self._places) >= PLACES_MAX  # _place may drop every remembered row below: store them all
        places = np.array([self._place(n, caps[j] if caps else None) for j, n in enumerate(nodes)] or [0], np.uint32)
        kept = np.frombuffer(bytearray(rows.tobytes()), LOC_ROW)  # a byte copy: a record copy costs more
        every = hit.all()
        if every:
            kept["node"] = places[node]
        else:
            kept["node"][hit] = places[node[hit]]
        if known is not None and every and not full and kept.tobytes() == known.tobytes():
            return True
        d = self._locs
        d.update(zip(keys, kept.view(_ROW_BYTES).tolist()))
        if not hit.all():
            for k in compress(keys, (~hit).tolist()):
                del d[k]
        self._trim()
        return False

    def rows(self, keys: list[bytes]) -> tuple[np.ndarray, np.ndarray] | None:
        """(rows, node number a row or -1) of the keys remembered by ``learn_rows`` (others: ``NO_NODE`` rows),
        or None when none is."""
        raw = list(map(self._locs.get, keys, repeat(_MISS)))  # one C loop; a miss is a NO_NODE row
        if raw.count(_MISS) == len(raw):
            return None
        try:
            joined = b"".join(raw)
        except TypeError:  # a location kept by ``learn`` (a tuple): not read ahead by the array path
            raw = [v if type(v) is bytes else _MISS for v in raw]
            if raw.count(_MISS) == len(raw):
                return None
            joined = b"".join(raw)
        rows = np.frombuffer(joined, LOC_ROW)
        place = rows["node"]
        have = place != NO_NODE
        if have.all():
            return rows, self._place_node[place].astype(np.int64)
        node = np.full(len(rows), -1, np.int64)
        node[have] = self._place_node[place[have]]
        return rows, node

    def learn(self, keys: list[bytes], locs: list) -> None:
        """Remember the answer's locations; a miss forgets the key."""
        if not self.limit:
            return
        d = self._locs
        for k, loc in zip(keys, locs):
            if loc is None:
                d.pop(k, None)
            else:
                d[k] = loc
        self._trim()

    def forget(self, keys: list[bytes]) -> None:
        for k in keys:
            self._locs.pop(k, None)

    def forget_node(self, node_id: str) -> int:
        """Forget every location on ``node_id`` (its speculative read failed); returns how many. O(remembered)."""
        d = self._locs
        places = {p for p, (n, _cap) in enumerate(self._places) if n == node_id}
        gone = [k for k, loc in d.items()
                if (_ROW.unpack_from(loc)[4] in places if type(loc) is bytes else loc[0] == node_id)]
        for k in gone:
            del d[k]
        return len(gone)

    def _trim(self) -> None:
        d = self._locs
        if len(d) > self.limit:
            for k in list(islice(d, len(d) - self.limit * 3 // 4)):
                del d[k]


def same_place(a: tuple | None, b: tuple | None) -> bool:
    """The two locations name one object: node, offset, size and generation equal."""
    return a is not None and b is not None and a[0] == b[0] and a[1] == b[1] and a[2] == b[2] and a[3] == b[3]


class Speculation:
    """The cache plus the back-off, and counters: ``hits`` (pages served by the speculative read), ``wasted``
    (pages read speculatively, then again or dropped)."""

    __slots__ = ("cache", "enabled", "skip", "hits", "wasted")

    def __init__(self, limit: int = CACHE_MAX, enabled: bool = True):
        self.cache = LocationCache(limit if enabled else 0)
        self.enabled = enabled  # ClientConfig.read_ahead (UMBP_READ_AHEAD=0: every get waits for its LOOKUP)
        self.skip = 0
        self.hits = 0
        self.wasted = 0

    def plan(self, keys: list[bytes]) -> list[tuple | None] | None:
        """The remembered location of each key (None: not remembered), or None when nothing is to be read ahead
        (nothing remembered, or backing off)."""
        if not self.enabled:
            return None
        if self.skip:
            self.skip -= 1
            return None
        get = self.cache.get
        guess = [get(k) for k in keys]
        return guess if any(g is not None for g in guess) else None

    def settle(self, guess: list, ok: list[bool], locs: list) -> list[bool]:
        """Which pages the speculative read served: remembered location equal to the answer's and read without
        error. Counts hits and waste; backs off after a batch that wasted most of what it read."""
        done = [o and same_place(g, loc) for g, o, loc in zip(guess, ok, locs)]
        hits = sum(done)
        tried = sum(g is not None for g in guess)
        self.hits += hits
        self.wasted += tried - hits
        if tried and (tried - hits) * 2 > tried:
            self.skip = BACKOFF_BATCHES
        return done

    def plan_rows(self, keys: list[bytes]) -> tuple[np.ndarray, np.ndarray] | None:
        """``plan`` for the array read path: (remembered rows, their node numbers; -1 not remembered) or None."""
        if not self.enabled:
            return None
        if self.skip:
            self.skip -= 1
            return None
        return self.cache.rows(keys)

    def settle_rows(self, guess: tuple[np.ndarray, np.ndarray], ok: np.ndarray, rows: np.ndarray,
                    node: np.ndarray) -> np.ndarray:
        """``settle`` over arrays: which pages the read ahead served (read without error, and the answer's row
        names the same node, offset, size and generation as the one read: one compare). ``node``: the answer's
        node number a row (-1 a miss)."""
        g, gnode = guess
        tried = gnode >= 0
        done = ok & tried & (gnode == node) & (g["off"] == rows["off"]) & (g["len"] == rows["len"]) & (
            g["gen"] == rows["gen"])
        hits, n = int(done.sum()), int(tried.sum())
        self.hits += hits
        self.wasted += n - hits
        if n and (n - hits) * 2 > n:
            self.skip = BACKOFF_BATCHES
        return done

    def settle_all(self, n: int) -> None:
        """``settle_rows`` when its verdict is known to be every page: ``LocationCache.learn_rows`` found the answer's
        rows equal to the ``n`` rows read ahead, and every one of them was read without error."""
        self.hits += n

    def stats(self) -> dict[str, Any]:
        return {"spec_hits": self.hits, "spec_wasted": self.wasted, "spec_cached": len(self.cache)}
