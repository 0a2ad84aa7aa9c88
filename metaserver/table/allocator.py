"""Space allocator for one node's arena: segregated best-fit over free extents, in 4 KiB units.

The data region of an arena is ``[base, base + capacity)`` (``base`` is ``objformat.ARENA_DATA_START``); every object
takes ``objformat.object_size(payload_len)`` bytes, a multiple of ``objformat.ALIGN``. The allocator hands out absolute arena
offsets and never touches the arena itself: it is pure bookkeeping, owned by the directory.

Structure (TLSF-like):

- Free extents are indexed by start (``start -> length``) and by end (``end -> start``), so a freed block merges
  with both neighbours in O(1) (immediate coalescing: two free extents are never adjacent).
- Extents are binned by length: one exact bin per length below ``EXACT_UNITS`` (256 units = 1 MiB; KV pages are
  almost always equal-sized, so these bins make the common case O(1)), then one bin per power of two. A Python int
  is the bitmap of non-empty bins; the next non-empty bin at or above a request is found with one shift and one
  lowest-set-bit, O(bins / 64) word operations, i.e. O(log capacity).
- Within a power-of-two bin the allocator looks at up to ``SCAN_LIMIT`` extents for the tightest fit, then takes
  any extent of a higher bin (all of which fit). So the fit is best-fit for small sizes and approximately best-fit
  for large ones; the remainder of a split extent goes back to the free lists (to the same bin without leaving it,
  when it stays in the bin: carving a fresh pool costs 1.1 us an object instead of 1.5).
- A bin is an ``OrderedDict`` (start -> None), taken from its head: oldest free extent first. Not a dict: a dict
  taken from its head keeps a hole at the head of its entry table per member taken until an insert resizes it, and
  iterating it skips them all, so refilling a pool fragmented into L same-size holes (what evictions down to a
  watermark leave) cost O(L) an allocation: 15-22 us at L = 60k, 66 us at 200k, against 0.65-1.6 us now
  (``bench/allocator.py``). A bin that empties stays, its mask bit cleared (no bin object made per allocation in a
  full pool).

What it tolerates: external fragmentation. A request can fail while the sum of free extents exceeds it (free space
is scattered in holes smaller than the request); the caller then evicts, and eviction frees whole objects that
coalesce with their neighbours. With uniform object sizes there is no fragmentation at all.

Invariants (checked by ``check()`` in tests): free and allocated extents are disjoint, cover the region exactly,
no two free extents touch, ``used + free == capacity``.

Tracking: by default the allocator remembers every allocated extent (``start -> length``), so ``free`` refuses a
double free or a wrong size and ``check()`` verifies the tiling by itself. The page table passes ``track=False``: its
rows already record each object's extent (``unit`` and ``size`` columns), and at 10 M pages the allocator's copy
would be one dict slot and one int per object, about 70 bytes, more than half of what a page costs in the table.
Untracked, ``free`` still refuses an extent outside the region or one that starts or ends a free extent (the double
free of an extent that did not merge with a neighbour), and ``check(extents)`` takes the allocated extents from the
caller.

Costs: ``alloc`` O(1) for exact bins, O(SCAN_LIMIT + log) otherwise; ``free`` O(1); ``rebuild`` O(n log n);
``reserve`` (an exact extent) O(1) at the start of a free extent, else O(free extents).
Memory: about three dict entries per free extent, plus one per allocated object when tracking, plus one empty
ordered dict per bin ever used (a few hundred at most per node).
"""

from __future__ import annotations

from collections import OrderedDict as _Bin
from itertools import compress, islice
from operator import add as _plus, le, lt

from transport.objformat import ALIGN

UNIT = ALIGN
EXACT_UNITS = 256  # exact bins for lengths 1..255 units
SCAN_LIMIT = 16  # extents examined in one power-of-two bin before falling back to a higher bin


def _bin_of(units: int) -> int:
    # inlined in Allocator.alloc and Allocator.free: keep the three in step
    if units < EXACT_UNITS:
        return units
    return EXACT_UNITS + units.bit_length() - 9  # 256..511 -> bin 256, 512..1023 -> 257, ...


class Allocator:
    """Free-extent allocator over ``[base, base + capacity)``; offsets and sizes are bytes, multiples of 4 KiB."""

    __slots__ = ("base", "capacity", "units", "used_units", "_free", "_ends", "_bins", "_mask", "_allocated")

    def __init__(self, base: int, capacity: int, *, track: bool = True):
        self.base = base
        self.units = capacity // UNIT
        self.capacity = self.units * UNIT
        self.used_units = 0
        self._free: dict[int, int] = {}  # start unit -> length in units
        self._ends: dict[int, int] = {}  # end unit (exclusive) -> start unit
        self._bins: dict[int, dict[int, None]] = {}  # bin -> ordered set of start units
        self._mask = 0  # bit b set <=> bin b non-empty
        self._allocated: dict[int, int] | None = {} if track else None  # start unit -> length in units
        if self.units:
            self._add_free(0, self.units)

    # -- accounting -------------------------------------------------------------------------------------------
    @property
    def used(self) -> int:
        return self.used_units * UNIT

    @property
    def tracks_nothing(self) -> bool:
        """No record of each allocation is kept (``track=False``): allocating two adjacent extents as one leaves
        exactly the state allocating each does, and either may be freed on its own."""
        return self._allocated is None

    @property
    def free_bytes(self) -> int:
        return (self.units - self.used_units) * UNIT

    # -- free-list plumbing ------------------------------------------------------------------------------------
    def _add_free(self, start: int, length: int) -> None:
        self._free[start] = length
        self._ends[start + length] = start
        b = _bin_of(length)
        members = self._bins.get(b)
        if members is None:
            members = self._bins[b] = _Bin()
        self._mask |= 1 << b
        members[start] = None

    def _del_free(self, start: int) -> int:
        length = self._free.pop(start)
        del self._ends[start + length]
        b = _bin_of(length)
        members = self._bins[b]
        del members[start]
        if not members:
            self._mask &= ~(1 << b)
        return length

    # -- public operations -------------------------------------------------------------------------------------
    def alloc(self, size: int) -> int | None:
        """Return the absolute offset of a new extent of ``size`` bytes (a multiple of 4 KiB), or None if no free
        extent is large enough (fragmented or full).

        ``_bin_of``, ``_del_free`` and ``_add_free`` are inlined (same steps, same order, so the same extent is
        chosen): in a full pool every new page is one alloc and one free, and the five calls were a third of them."""
        need = -(-size // UNIT)
        if need <= 0 or need > self.units - self.used_units:
            return None
        b = need if need < EXACT_UNITS else EXACT_UNITS + need.bit_length() - 9
        mask = self._mask >> b
        if not mask:
            return None
        fr, bins = self._free, self._bins
        start = -1
        if mask & 1 and b >= EXACT_UNITS:
            # A power-of-two bin holds lengths on both sides of the request: look for the tightest fit.
            best_len = 0
            for i, s in enumerate(bins[b]):
                ln = fr[s]
                if ln >= need and (start < 0 or ln < best_len):
                    start, best_len = s, ln
                    if ln == need:
                        break
                if i >= SCAN_LIMIT:
                    break
            if start < 0:
                mask &= ~1
        if start < 0:
            if not mask:
                return None
            b += (mask & -mask).bit_length() - 1
            start = next(iter(bins[b]))
        # _del_free(start): it is in bin b
        length = fr.pop(start)
        members = bins[b]
        del members[start]
        end = start + length
        if length > need:  # _add_free of the remainder; it ends where the extent ended
            rs, rl = start + need, length - need
            fr[rs] = rl
            self._ends[end] = rs
            rb = rl if rl < EXACT_UNITS else EXACT_UNITS + rl.bit_length() - 9
            if rb != b:
                if not members:
                    self._mask &= ~(1 << b)
                members = bins.get(rb)
                if members is None:
                    members = bins[rb] = _Bin()
                self._mask |= 1 << rb
            # else: the remainder stays in bin b, at its end (as deleting the bin and adding it again would leave it)
            members[rs] = None
        else:
            if not members:
                self._mask &= ~(1 << b)
            del self._ends[end]
        if self._allocated is not None:
            self._allocated[start] = need
        self.used_units += need
        return self.base + start * UNIT

    def free(self, offset: int, size: int) -> None:
        """Return the extent at ``offset`` to the free lists, merging with free neighbours.

        Raises ValueError on a double free or a size that does not match the allocation (a directory bug); untracked,
        only on an extent outside the region or one that starts or ends a free extent. The free-list helpers are
        inlined, as in ``alloc``."""
        start = (offset - self.base) // UNIT
        fr, ends, bins = self._free, self._ends, self._bins
        if self._allocated is not None:
            length = self._allocated.get(start)
            if length is None or length != -(-size // UNIT):
                raise ValueError(f"allocator: free of {size} bytes at {offset} does not match an allocation")
            del self._allocated[start]
        else:
            length = -(-size // UNIT)
            if (start < 0 or length <= 0 or start + length > self.units or start in fr
                    or start + length in ends):
                raise ValueError(f"allocator: free of {size} bytes at {offset} overlaps free space or the end")
        self.used_units -= length
        end = start + length
        nxt = fr.pop(end, None)
        if nxt is not None:  # merge with the next free extent; its end entry is rewritten below
            b = nxt if nxt < EXACT_UNITS else EXACT_UNITS + nxt.bit_length() - 9
            members = bins[b]
            del members[end]
            if not members:
                self._mask &= ~(1 << b)
            length += nxt
        prev = ends.pop(start, None)
        if prev is not None:  # merge with the previous free extent
            pl = fr.pop(prev)
            b = pl if pl < EXACT_UNITS else EXACT_UNITS + pl.bit_length() - 9
            members = bins[b]
            del members[prev]
            if not members:
                self._mask &= ~(1 << b)
            length += pl
            start = prev
        fr[start] = length
        ends[start + length] = start
        b = length if length < EXACT_UNITS else EXACT_UNITS + length.bit_length() - 9
        members = bins.get(b)
        if members is None:
            members = bins[b] = _Bin()
        self._mask |= 1 << b
        members[start] = None

    def alloc_run(self, size: int, count: int) -> tuple[int, int] | None:
        """Up to ``count`` adjacent extents of ``size`` bytes each: the first as ``alloc`` chooses it, then as many
        more as the free extent right after it holds (``reserve``: O(1) there). Returns (offset of the first, how
        many), or None when not even one fits. Each extent may be freed on its own (tracked: each is recorded)."""
        off = self.alloc(size)
        if off is None:
            return None
        need = -(-size // UNIT)
        more = min(count - 1, self._free.get((off - self.base) // UNIT + need, 0) // need)
        if more > 0:
            step = need * UNIT
            if self._allocated is None:  # one reservation for all of them (see ``tracks_nothing``)
                self.reserve(off + step, more * step)
            else:
                for j in range(1, more + 1):
                    self.reserve(off + j * step, step)
        return off, 1 + max(more, 0)

    def alloc_runs(self, size: int, count: int) -> list[tuple[int, int]]:
        """Up to ``count`` extents of ``size`` bytes as runs of adjacent ones, ``alloc_run`` after ``alloc_run``
        until ``count`` or no free extent holds one: [(offset of a run's first, how many)]. As many extents as
        ``count`` calls of ``alloc`` would give (each succeeds while some free extent holds ``size``), in fewer
        steps: a full pool's freed holes and a fresh arena's tail each come back as one run. O(runs) calls."""
        runs: list[tuple[int, int]] = []
        need = -(-size // UNIT)
        while count > 0 and need * UNIT <= self.free_bytes:
            got = self.alloc_run(size, count)
            if got is None:
                break
            runs.append(got)
            count -= got[1]
        return runs

    def reserve(self, offset: int, size: int) -> bool:
        """Allocate exactly ``[offset, offset + size)`` if all of it is free and inside the region; False otherwise
        (nothing changes). For a warm standby replaying the leader's placements (``metaserver/ha/standby.py``).
        O(1) when ``offset`` starts a free extent (the leader allocated from the same layout), else O(free extents):
        the extent is then inside a larger free one, split around it."""
        rel = offset - self.base
        need = -(-size // UNIT)
        start = rel // UNIT
        if rel < 0 or rel % UNIT or need <= 0 or start + need > self.units:
            return False
        fs = start if start in self._free else -1
        if fs < 0:
            for s, ln in self._free.items():
                if s < start < s + ln:
                    fs = s
                    break
            else:
                return False
        end = fs + self._free[fs]
        if start + need > end:
            return False
        self._del_free(fs)
        if start > fs:
            self._add_free(fs, start - fs)
        if end > start + need:
            self._add_free(start + need, end - start - need)
        if self._allocated is not None:
            self._allocated[start] = need
        self.used_units += need
        return True

    def rebuild(self, extents: list[tuple[int, int]]) -> list[int]:
        """Reset to exactly ``extents`` [(offset, size)] allocated; return the indexes of extents rejected because
        they overlap an earlier one or fall outside the region (the caller drops those objects). O(n log n)."""
        return self.rebuild_columns([x[0] for x in extents], [x[1] for x in extents])

    def rebuild_columns(self, offsets: list[int], sizes: list[int]) -> list[int]:
        """``rebuild`` of the extents (offsets[i], sizes[i]): the same result, without a tuple per extent. Extents
        are taken in offset order (equal offsets in index order); one that starts before the end of the previous
        one taken, or lies outside the region, is rejected. O(n log n): one sort of the indexes by offset (a C-level
        key), then one pass; the free extents between them are filed lowest first."""
        self._free.clear()
        self._ends.clear()
        self._bins.clear()
        self._mask = 0
        tracked = self._allocated
        if tracked is not None:
            tracked.clear()
        base, units = self.base, self.units
        n = len(offsets)
        order = None
        if n and tracked is None and not base % UNIT:
            # The common case checked and done at C level: every extent aligned, of whole units, none overlapping
            # the next, all inside the region (what the loop below would then find, extent by extent). Offsets
            # given in order already (a pool filled in commit order) are not sorted again.
            if all(map(le, offsets, islice(offsets, 1, None))):
                offs, lens = offsets, sizes
            else:
                order = sorted(range(n), key=offsets.__getitem__)
                offs = list(map(offsets.__getitem__, order))
                lens = list(map(sizes.__getitem__, order))
            kinds = set(lens)  # a few sizes
            ends = list(map(_plus, offs, lens))
            limit = base + units * UNIT
            if (offs[0] >= base and ends[-1] <= limit and min(kinds) > 0 and not any(k % UNIT for k in kinds)
                    and not any(map(UNIT.__rmod__, offs)) and all(map(le, ends, islice(offs, 1, None)))):
                self.used_units = sum(lens) // UNIT
                addf = self._add_free
                if offs[0] > base:
                    addf(0, (offs[0] - base) // UNIT)
                for j in compress(range(n - 1), map(lt, ends, islice(offs, 1, None))):
                    addf((ends[j] - base) // UNIT, (offs[j + 1] - ends[j]) // UNIT)
                if ends[-1] < limit:
                    addf((ends[-1] - base) // UNIT, units - (ends[-1] - base) // UNIT)
                return []
        if order is None:
            order = sorted(range(n), key=offsets.__getitem__)
        rejected: list[int] = []
        gaps: list[int] = []  # start, length of each free extent, in order
        cursor = used = 0
        for i in order:
            rel = offsets[i] - base
            start, need = rel // UNIT, -(-sizes[i] // UNIT)
            if rel < 0 or rel % UNIT or need <= 0 or start < cursor or start + need > units:
                rejected.append(i)
                continue
            if start > cursor:
                gaps += (cursor, start - cursor)
            if tracked is not None:
                tracked[start] = need
            used += need
            cursor = start + need
        self.used_units = used
        add = self._add_free
        for j in range(0, len(gaps), 2):
            add(gaps[j], gaps[j + 1])
        if cursor < units:
            add(cursor, units - cursor)
        rejected.sort()
        return rejected

    def check(self, extents: list[tuple[int, int]] | None = None) -> None:
        """Assert the invariants (tests only; O(n log n)). ``extents`` [(offset, size)]: the allocated extents as the
        caller knows them (required when untracked; when tracking, they must be exactly the tracked ones)."""
        if extents is not None:
            used = {(off - self.base) // UNIT: -(-size // UNIT) for off, size in extents}
            assert len(used) == len(extents), "two extents start at the same unit"
            if self._allocated is not None:
                assert used == self._allocated, "the caller's extents are not the allocated ones"
        else:
            assert self._allocated is not None, "an untracked allocator checks against the caller's extents"
            used = self._allocated
        spans = sorted([(s, n, "free") for s, n in self._free.items()] +
                       [(s, n, "used") for s, n in used.items()])
        cursor, prev_kind = 0, None
        for s, n, kind in spans:
            assert s == cursor, f"gap or overlap at unit {s} (expected {cursor})"
            assert not (kind == "free" and prev_kind == "free"), f"uncoalesced free extents at unit {s}"
            assert self._ends[s + n] == s if kind == "free" else True
            cursor, prev_kind = s + n, kind
        assert cursor == self.units, "extents do not cover the region"
        assert sum(used.values()) == self.used_units
        assert sum(len(m) for m in self._bins.values()) == len(self._free)
        for b, members in self._bins.items():
            assert bool(self._mask >> b & 1) == bool(members)
            assert all(_bin_of(self._free[s]) == b for s in members)
