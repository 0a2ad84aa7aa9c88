"""Shared-memory transport: a client on the node's host maps the node's arena file and copies directly.

The node tells clients its arena path, arena id and boot id (ARENA_INFO / the metaserver's node map). A client may use
this transport only when it runs on the same boot of the same host (``/proc/sys/kernel/random/boot_id`` matches) and
the file at that path carries the same arena id in its superblock; otherwise ``ShmTransport.open`` raises and the
selection rule falls through to RDMA or TCP.

The arena's page size matters to the copy (umbp/node/arena.py "Huge pages"): ``advise_huge`` asks for 2 MiB pages
for a mapping (this transport's and the node's), ``mapped_huge`` says how much of one got them (benches, tests).

Cost: one memcpy per object range (one strided copy per ``umbp.buffers.Rows`` out), no syscalls, no node CPU; a batch's copies are split across threads
(``umbp.copies``: memory bandwidth rather than one core's memcpy for batches of SERIAL_BYTES and more). Small
batches copy with slice assignment on the calling thread; threaded ones take arena addresses as the mapping's base
plus the offset (one address lookup per caller buffer, no view of the arena per page). The mapping is MAP_SHARED read-write so puts land in the arena directly;
the metaserver's allocation is what makes the range ours to write.
"""

from __future__ import annotations

import mmap
import os
import time
import uuid

import numpy as np

from transport import objformat
from transport.base import Pending, Transport, check_payload, headers_match, late_write, stale_write, write_until
from umbp import copies
from umbp.buffers import Rows
from umbp.errors import CorruptionError, DeadlineExceeded, InvalidArgument, TransportError

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
HEADER_MEMO = 65536  # headers remembered as checked (about 16 MiB at most); cleared when full
BATCH_MEMO_PAGES = 32768  # pages of the ``read_rows`` batches remembered as passed (about 190 B each: 6 MiB)


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def advise_huge(m: mmap.mmap) -> None:
    """Ask for 2 MiB pages for mapping ``m`` (``MADV_HUGEPAGE``): taken where the file's tmpfs is mounted with
    ``huge=advise``; without effect elsewhere (and where the call is missing)."""
    flag = getattr(mmap, "MADV_HUGEPAGE", None)
    if flag is not None:
        try:
            m.madvise(flag)
        except OSError:
            pass


def mapped_huge(m: mmap.mmap) -> int:
    """Bytes of mapping ``m`` that this process maps with 2 MiB pages, from ``/proc/self/smaps`` (its
    ``ShmemPmdMapped``, ``FilePmdMapped`` and ``AnonHugePages`` lines); 0 where that file is missing."""
    start = copies.address(m)
    want = f"{start:x}-"
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as fh:
            for line in fh:
                if "-" in line.split(" ", 1)[0] and not line[0].isupper():  # a mapping's first line
                    inside = line.startswith(want)
                elif inside and line.startswith(("ShmemPmdMapped:", "FilePmdMapped:", "AnonHugePages:")):
                    total += int(line.split()[1]) << 10
    except OSError:
        return 0
    return total


def _pieces(dst: np.ndarray, src: list[int], n: list[int], row: int, stride: int
            ) -> tuple[list[int], list[int], list[int]]:
    """Pages ``n[j]`` bytes long at ``src[j]`` cut into rows of ``row`` bytes (the last one short) that land
    ``stride`` apart from ``dst[j]``: (dst, src, length) of every piece, in a fixed number of numpy calls."""
    s, ln = np.asarray(src, np.int64), np.asarray(n, np.int64)
    k = -(-ln // row)  # each page's rows
    page = np.repeat(np.arange(len(ln)), k)
    r = np.arange(len(page)) - np.repeat(np.cumsum(k) - k, k)  # each piece's row within its page
    return ((dst.take(page) + r * stride).tolist(), (s.take(page) + r * row).tolist(),
            np.minimum(row, ln.take(page) - r * row).tolist())


class ShmTransport(Transport):
    name = "shm"
    reads_rows = True

    def __init__(self, node_id: str, arena_path: str, arena_id: bytes, boot: str):
        self.component = f"transport shm {node_id}"
        if not boot or boot != boot_id():
            raise TransportError(self.component, "node runs on another host (boot id differs)")
        try:
            fd = os.open(arena_path, os.O_RDWR)
        except OSError as e:
            raise TransportError(self.component, f"cannot open arena {arena_path}: {e.strerror}") from e
        try:
            size = os.fstat(fd).st_size
            # MAP_POPULATE: fault the whole arena in now, not one 4 KiB page at a time on the hot path.
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED | _POPULATE, mmap.PROT_READ | mmap.PROT_WRITE)
            advise_huge(self._map)  # 2 MiB pages where the arena's tmpfs gives them on request
        except OSError as e:
            raise TransportError(self.component, f"cannot map arena {arena_path}: {e}") from e
        finally:
            os.close(fd)
        self.arena = memoryview(self._map)
        try:
            found, _cap = objformat.unpack_superblock(self.arena)
        except ValueError as e:
            self.close()
            raise TransportError(self.component, f"{arena_path}: {e}") from e
        if found != arena_id:
            self.close()
            raise TransportError(self.component, f"{arena_path} holds arena {uuid.UUID(bytes=found)}, "
                                                 f"not {uuid.UUID(bytes=arena_id)}")
        self.size = size
        self._head_rows: np.ndarray | None = None  # ``_heads``
        self._base = copies.address(self.arena)  # the mapping's address: arena offsets become copy addresses
        # (offset, key hash, generation) -> (header bytes, payload length, checksum) that passed the header check:
        # the same bytes read again for the same directory entry pass without the struct and crc work
        self._checked: dict[tuple[int, int, int], tuple[bytes, int, int | None]] = {}
        # read_rows' key -> (slots, header bytes, source addresses, lengths) of a batch whose every page passed
        self._batches: dict[bytes, tuple[np.ndarray, bytes, list[int], list[int]]] = {}
        self._batch_pages = 0  # pages in ``_batches``

    def start_read(self, ops, deadline):
        """Copy every op's range out of the mapped arena: ``read_from_arena`` (header checked before, compared
        after the copy: a torn read is detected) inlined into one loop, since at small pages the Python around the
        memcpy is what costs. Consecutive ops of one object (the ranges of a layer_first page: 32 of them) share
        one header check before and one after."""
        p = Pending(ops, "read")
        results = p.results
        arena, comp, size, base = self.arena, self.component, self.size, self._base
        hs, lo = objformat.OBJ_HEADER_SIZE, objformat.ARENA_DATA_START
        check = objformat.check_object_header
        memo = self._checked
        address = copies.address_of_view
        # (dst, src, n) of each copy (threaded batches: handed to the copy threads as they come, ``copies.Stream``);
        # per object read, [its op indices, header, checksum, offset] to check after every copy
        pieces, checked = [], []
        total = sum(op.length for op in ops)
        # keep=ops: a copy job still running past the deadline holds the views it writes into (or reads from)
        stream = copies.Stream(total, deadline, keep=ops) if copies.threads_for(total) > 1 else None
        add = stream.add if stream is not None else None
        prev = None  # ((offset, khash, generation), payload_len, header, checksum) of the last object that passed
        entry = None  # that object's entry in ``checked`` once one of its ranges is to be copied
        for i, op in enumerate(ops):
            o = op.offset
            plen = op.payload_len
            start, n = op.start, op.length
            ident = (o, op.khash, op.generation)
            if prev is not None and prev[0] == ident and prev[1] == plen:
                head, csum = prev[2], prev[3]  # another range of the same object: one header check covers them all
            else:
                entry = prev = None
                if o < lo or o + hs + plen > size:
                    results[i] = CorruptionError(comp, f"range {o}+{hs + plen} outside the arena of {size}")
                    continue
                head = arena[o:o + hs].tobytes()
                known = memo.get(ident)
                if known is not None and known[0] == head and known[1] == plen:
                    csum = known[2]  # the very bytes checked before against the same directory entry
                else:
                    try:
                        csum = check(head, comp, op.khash, op.generation, plen)
                    except CorruptionError as e:
                        results[i] = e
                        continue
                    if len(memo) >= HEADER_MEMO:
                        memo.clear()
                    memo[ident] = (head, plen, csum)
                prev = (ident, plen, head, csum)
            if start < 0 or start + n > plen:
                results[i] = CorruptionError(comp, f"range {start}+{n} outside payload of {plen}")
                continue
            out = op.out  # a flat writable byte view, or umbp.buffers.Rows, of at least n bytes (the client checked)
            if len(out) < n or out.readonly:  # before this op's bytes move, as copies.copy_pairs would
                if stream is not None:
                    stream.abort()
                raise InvalidArgument(comp, f"op {i}: out of {len(out)} bytes (read-only: {out.readonly}) for "
                                            f"a range of {n}")
            if n:
                if add is None:
                    pieces.append((out, o + hs + start, n))
                elif type(out) is Rows:  # one strided copy for all its rows
                    stream.add_rows(out.address, out.stride, base + o + hs + start, out.row, out.row, n)
                else:
                    add(address(out), base + o + hs + start, n)
            if entry is None:
                entry = [[i], head, csum, o]
                checked.append(entry)
            else:
                entry[0].append(i)
        if stream is None:  # slice assignment: a third faster than a ctypes memmove per page
            for out, src, n in pieces:
                if type(out) is Rows:
                    out.fill(arena[src:src + n], n)
                else:
                    out[:n] = arena[src:src + n]
        else:  # the copy threads have been at it since the first pieces came
            stream.finish()
        # each object's header is checked again after every copy: a slot rewritten meanwhile fails all its ranges
        for idxs, head, csum, o in checked:
            if arena[o:o + hs] != head:
                for i in idxs:
                    results[i] = CorruptionError(comp, "slot rewritten during the read (torn read)")
            elif csum is not None:
                for i in idxs:
                    results[i] = check_payload(ops[i], csum, comp)
        return p

    def read_rows(self, off: np.ndarray, plen: np.ndarray, tag: np.ndarray, gen: np.ndarray, dst: np.ndarray,
                  deadline: float, key: bytes | None = None, geom: tuple[int, int] | None = None) -> np.ndarray:
        """The array form of ``start_read`` for whole payloads (``umbp/readbatch.py``): page i's payload (``plen[i]``
        bytes of the object at ``off[i]``) to the address ``dst[i]``, which the caller checked holds that many
        bytes. Per page: 0 copied and its header unchanged after the copy, 1 not copied (outside the arena, not
        4 KiB aligned, a header that does not match or carries a payload checksum: ``start_read`` decides it, with
        its own error), 2 copied but its header changed meanwhile (a torn read: the caller reports CorruptionError).
        Cost: a fixed number of numpy calls (bounds, the headers gathered and compared before and after: one
        fancy index over a 4 KiB-stride view of the arena each) and one ``memmove`` a page (``map``; from
        ``copies.SHARE_BYTES`` on 4 or more cores half of them on a helper thread, ``copies.copy_shared``), or copy
        threads (``copies.Stream``) for batches of ``copies.SERIAL_BYTES``. DeadlineExceeded: copy threads not
        done by ``deadline`` (stopped; no page counts).

        ``key``: the bytes of the batch's (off, plen, tag, gen) columns, or None. A batch whose every page passed
        is remembered by it (``BATCH_MEMO_PAGES`` pages of such batches, the oldest dropped first) with its slots,
        header bytes and source addresses; the same batch again whose headers are byte for byte those bytes skips
        the bounds and the header match (pure functions of the columns and those bytes: the verdict cannot differ)
        and goes to the copy and the compare after it. Other header bytes take the full path (and, passing, replace
        the entry).

        ``geom``: ``(row, stride)`` when each out is ``umbp.buffers.Rows`` of that shape (``dst[i]`` its first row): a
        page's payload lands ``row`` bytes a row, rows ``stride`` apart, the last one cut short (``_pieces``)."""
        hs, size = objformat.OBJ_HEADER_SIZE, self.size
        if key is not None:
            known = self._batches.get(key)
            if known is not None:
                slot, head, src, n = known
                before = self._heads()[slot]
                if before.tobytes() == head:  # the very header bytes this batch passed with before: same verdict
                    return self._copy_rows(slot, before, slice(None), src, n, dst, deadline, np.ones(len(off), np.int8),
                                           geom)
        status = np.ones(len(off), np.int8)
        inside = ((off >= objformat.ARENA_DATA_START) & (off <= size) & (plen <= size) & (off + hs + plen <= size)
                  & (off % objformat.ALIGN == 0))
        if inside.all():  # the usual case: every page, without a gather of each column
            pick: slice | np.ndarray = slice(None)
        else:
            pick = np.flatnonzero(inside)
            if not len(pick):
                return status
            off, plen, tag, gen, dst = off[pick], plen[pick], tag[pick], gen[pick], dst[pick]
        heads = self._heads()
        slot = (off // objformat.ALIGN).astype(np.intp)
        before = heads[slot]  # (n, 64) copies of the headers
        good = headers_match(before, tag, gen, plen)
        if not good.all():
            if type(pick) is slice:
                pick = np.arange(len(status))
            pick, slot, before, off, plen, dst = pick[good], slot[good], before[good], off[good], plen[good], dst[good]
            if not len(pick):
                return status
        src = (off + (self._base + hs)).tolist()
        n = plen.tolist()
        if key is not None and type(pick) is slice and len(n) <= BATCH_MEMO_PAGES:  # every page passed: kept
            batches = self._batches
            self._batch_pages += len(n) - len(batches.pop(key, ((),))[0])
            while self._batch_pages > BATCH_MEMO_PAGES:  # the oldest go first
                self._batch_pages -= len(batches.pop(next(iter(batches)))[0])
            batches[key] = (slot, before.tobytes(), src, n)
        return self._copy_rows(slot, before, pick, src, n, dst, deadline, status, geom)

    def _copy_rows(self, slot: np.ndarray, before: np.ndarray, pick, src: list[int], n: list[int], dst: np.ndarray,
                   deadline: float, status: np.ndarray, geom: tuple[int, int] | None = None) -> np.ndarray:
        """``read_rows``' copy and its header check after it, for the pages ``pick`` whose headers ``before`` (at
        arena slots ``slot``) passed: ``n[j]`` bytes from address ``src[j]`` to ``dst[j]`` (``geom``: as rows)."""
        total = sum(n)
        if geom is not None:
            d, src, n = _pieces(dst, src, n, *geom)
        else:
            d = dst.tolist()
        if copies.threads_for(total) > 1:
            stream = copies.Stream(total, deadline)
            add = stream.add
            for a, b, k in zip(d, src, n):
                if k:
                    add(a, b, k)
            stream.finish()
        else:
            copies.copy_shared(d, src, n, total)  # one memmove a page, the loop in C (a helper thread copies half)
        after = self._heads()[slot]
        if after.tobytes() == before.tobytes():  # the usual case: one compare of the bytes, no row reduce
            status[pick] = 0
        else:
            status[pick] = (after != before).any(axis=1).astype(np.int8) * 2
        return status

    def _heads(self) -> np.ndarray:
        """The arena as rows of 64 bytes every 4 KiB (an object header wherever an object starts): a read-only view."""
        if self._head_rows is None:
            arena = np.frombuffer(self.arena, np.uint8)
            self._head_rows = np.lib.stride_tricks.as_strided(
                arena, ((self.size - objformat.OBJ_HEADER_SIZE) // objformat.ALIGN + 1, objformat.OBJ_HEADER_SIZE),
                (objformat.ALIGN, 1), writeable=False)
        return self._head_rows

    def start_write(self, ops, deadline):
        """``write_to_arena`` (old header invalidated, payload, then the header last) inlined into one loop. A batch
        whose ops carry ``until_ms`` (``base.write_until``: the earliest) copies nothing past it: each op is looked at
        before its header is invalidated and, copied on this thread, before each part; copy threads are given up at
        it. An op not copied whole in time fails (``base.late_write``) and gets no header; nor is one whose generation
        is below the floor the node publishes for it (``base.stale_write``: a deposed leader granted it)."""
        p = Pending(ops, "write")
        results = p.results
        arena, comp, size, base = self.arena, self.component, self.size, self._base
        hs, lo = objformat.OBJ_HEADER_SIZE, objformat.ARENA_DATA_START
        address = copies.address_of_view
        pieces, written = [], []
        total = sum(op.nbytes for op in ops)
        until = write_until(ops)
        clock = time.time
        # the node's published generation floors: a deposed leader's grants are copied by no one
        stale = objformat.stale_gens(objformat.floor_words(arena), np.fromiter((op.gen for op in ops), np.uint64, len(ops)))
        # keep=ops: a copy job still running past the deadline holds the views it writes into (or reads from)
        stream = copies.Stream(total, deadline if not until else min(deadline, time.monotonic() + until - clock()),
                               keep=ops) if copies.threads_for(total) > 1 else None
        for i, op in enumerate(ops):
            o = op.offset
            if o < lo or o + hs + op.nbytes > size:
                results[i] = CorruptionError(comp, f"range {o}+{hs + op.nbytes} outside the arena of {size}")
                continue
            if until and clock() > until:
                results[i] = late_write(comp, op.until_ms)
                continue
            if stale[i]:
                results[i] = stale_write(comp, op.gen)
                continue
            pos = o + hs
            run = []
            for part in op.parts:  # flat byte views (umbp.buffers), or Rows (``reads_rows``: writes take them too)
                n = len(part)
                if n:
                    run.append((pos, part, n))
                pos += n
            if pos - o - hs != op.nbytes:  # the bound above was checked with nbytes
                if stream is not None:
                    stream.abort()
                raise InvalidArgument(comp, f"op {i}: parts of {pos - o - hs} bytes for a write of {op.nbytes}")
            arena[o:o + 4] = b"\0\0\0\0"  # a reader racing this write sees no valid header until the end
            if stream is not None:  # to the copy threads now: the header above is already invalid
                for dst, part, n in run:
                    if type(part) is Rows:  # one strided copy for all its rows
                        stream.add_rows(base + dst, part.row, part.address, part.stride, part.row, n)
                    else:
                        stream.add(base + dst, address(part), n)
            else:
                pieces.append(run)
            written.append((i, op))
        # every payload (threads for big batches: running since the first ops), then the headers last
        if stream is None:
            for k, run in enumerate(pieces):
                for dst, part, n in run:
                    if until and clock() > until:
                        break
                    if type(part) is Rows:
                        for v in part.views():
                            arena[dst:dst + len(v)] = v
                            dst += len(v)
                    else:
                        arena[dst:dst + n] = part
                else:
                    continue
                for i, op in written[k:]:  # this op and the later ones were not copied whole in time
                    results[i] = late_write(comp, op.until_ms)
                written = written[:k]
                break
        else:
            try:
                stream.finish()
            except DeadlineExceeded:
                if not until or clock() <= until:
                    raise
                for i, op in written:
                    results[i] = late_write(comp, op.until_ms)
                written = []
        for _, op in written:
            arena[op.offset:op.offset + hs] = op.header
        return p

    def finish(self, pending, deadline):
        return pending.results

    def close(self):
        self._head_rows = None  # a numpy view of the arena: gone before the arena is released
        arena, self.arena = getattr(self, "arena", None), None
        if arena is not None:
            arena.release()
        m = getattr(self, "_map", None)
        if m is not None:
            try:
                m.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes when it does
            self._map = None
