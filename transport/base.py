"""The transport interface: how a client moves object bytes to and from one storage node's arena.

Five methods, two phases so that transfers to several nodes are in flight together: the client calls
``start_read``/``start_write`` on every node's transport first, then ``finish`` on each. A transport for shared
memory does its copies in ``start_*``; TCP sends its requests there and receives in ``finish``; RDMA posts work
requests there and polls in ``finish``.

Contracts:
- Every read checks the object header against (key hash, generation, payload length) from the directory and
  reports ``CorruptionError`` for that op instead of delivering bytes; the payload lands in ``ReadOp.out`` only.
  A ranged read (``start``/``length`` a part of the payload: one layer group of a page) checks the header too.
- What keeps a slot from being reused *during* a read: shm checks the header again after its copy (a torn read is
  detected); tcp and rdma copy header and payload in one request but do not look again, so for them the read lease
  the metaserver granted with LOOKUP is what guarantees it (a leased object is never evicted or freed). A read that
  outlives its lease (a client or node stalled past the answer's ``lease_ms``) is a miss: the client counts every
  tcp/rdma page of a batch finished later than ``lease_ms`` after it sent the LOOKUP as one
  (``Client._late_reads_missed``), whatever bytes arrived.
- ``ReadOp.out`` is a flat writable view, or a ``umbp.buffers.Rows`` for a transport whose ``reads_rows`` is True
  (shm: one strided copy); the client cuts a Rows out into one op per row for the others. Likewise a part of
  ``WriteOp.parts`` may be a Rows (its rows written back to back) only for such a transport.
- A write's payload is a list of parts (``WriteOp.parts``) written back to back: a page assembled from one buffer
  per layer is never concatenated first.
- Results are per op, in order: ``None`` for success or the exception for that op. A connection-level failure
  fails every op still outstanding on it with ``TransportError`` and leaves the transport reusable (it reconnects).
- A write lands no byte past its ``WriteOp.until_ms`` (the ALLOC answer's ``write_until_ms``, wall clock): after it
  the metaserver may place another page in its extent (its allocation expired, its leader died). TCP sends it with
  the WRITEV and the node looks at it before each receive into its arena; shm looks before each page's copy
  (``late_write``); either fails the op (``Unavailable``), and the put aborts it as a failed write.
- ``finish`` blocks until every op of the batch is done or ``deadline`` (``time.monotonic()`` seconds) passes.
  Past the deadline it still collects what has already arrived, without waiting, so a node finished after another
  used up the deadline keeps its answer: tcp receives what sits in the socket buffer (non-blocking), rdma reaps the
  completion queue before it aborts, shm finished its copies in ``start_*``. Only ops not complete by then fail
  with ``DeadlineExceeded``; a partly received answer is never delivered as data.

``MemoryTransport`` is the test double: an arena in a bytearray, same checks, no I/O.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass

import numpy as np

from transport import objformat, wire
from umbp import copies
from umbp.buffers import Rows
from umbp.errors import CorruptionError, DeadlineExceeded, Unavailable


@dataclass(slots=True)
class ReadOp:
    offset: int  # object offset in the arena (its header)
    start: int  # first payload byte to read
    length: int  # payload bytes to read into out
    khash: int
    generation: int
    payload_len: int
    out: memoryview  # writable, at least ``length`` bytes (or a ``Rows``: transports with ``reads_rows``)
    cap: bytes = b""  # the metaserver's read capability (closed pools; the node checks it)


@dataclass(slots=True)
class WriteOp:
    offset: int
    header: bytes  # objformat.pack_object_header(...)
    parts: list[memoryview]  # the payload, in order (one part, or one per layer)
    nbytes: int  # sum of the parts' lengths
    gen: int = 0  # the allocation's generation (part of what the write capability covers)
    cap: bytes = b""  # the metaserver's write capability (closed pools; the node checks it)
    until_ms: int = 0  # wall-clock ms by which its bytes must have landed (the ALLOC answer's write_until_ms; 0: none)


def check_payload(op: ReadOp, csum: int | None, component: str) -> CorruptionError | None:
    """The payload checksum check, when the header carries one and the read covered the whole payload."""
    if csum is not None and op.start == 0 and op.length == op.payload_len:
        out = op.out
        if objformat.payload_checksum(out.gather(op.length) if type(out) is Rows else out[:op.length]) != csum:
            return CorruptionError(component, "payload checksum mismatch")
    return None


def headers_match(heads: np.ndarray, tag: np.ndarray, gen: np.ndarray, plen: np.ndarray) -> np.ndarray:
    """Per row of ``heads`` ((n, 64) uint8, each an object header read from an arena or a stream): True where
    ``objformat.check_object_header`` would pass it against (tag, gen, plen) and it carries no payload checksum (such a
    page takes the per-page path, which checks the payload). A False row may still be good: the per-page path
    decides it, with its own error."""
    w = heads.view("<u8")  # the header as 8 words: magic|version|flags, tag, gen, len, csum|crc, then padding
    return ((w[:, 0] == objformat.WORD0) & (w[:, 1] == tag) & (w[:, 2] == gen) & (w[:, 3] == plen)
            & ((w[:, 4] >> np.uint64(32)) == objformat.crc32_headers(heads)))


class Pending:
    """What ``start_*`` hands to ``finish``: the ops, results filled so far, transport-private state."""

    __slots__ = ("ops", "results", "kind", "state")

    def __init__(self, ops: list, kind: str, state: object = None):
        self.ops = ops
        self.results: list[Exception | None] = [None] * len(ops)
        self.kind = kind
        self.state = state


class Transport(abc.ABC):
    name: str = "?"
    reads_rows: bool = False  # ReadOp.out and WriteOp parts may be umbp.buffers.Rows

    @abc.abstractmethod
    def start_read(self, ops: list[ReadOp], deadline: float) -> Pending: ...

    @abc.abstractmethod
    def start_write(self, ops: list[WriteOp], deadline: float) -> Pending: ...

    @abc.abstractmethod
    def finish(self, pending: Pending, deadline: float) -> list[Exception | None]: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def register(self, buf: memoryview) -> None:
        """Make ``buf`` zero-copy for this transport (RDMA registers it; others need nothing)."""


def read_from_arena(arena: memoryview, op: ReadOp, component: str) -> None:
    """Copy one object range out of a mapped arena, checking its header before and after the copy.

    The second look catches a slot that was freed and rewritten while we copied (a torn read): a writer always
    rewrites the header of a reused slot, so an unchanged header means the payload we copied is the one it names."""
    o = op.offset
    head = bytes(arena[o:o + objformat.OBJ_HEADER_SIZE])
    csum = objformat.check_object_header(head, component, op.khash, op.generation, op.payload_len)
    if op.start < 0 or op.start + op.length > op.payload_len:
        raise CorruptionError(component, f"range {op.start}+{op.length} outside payload of {op.payload_len}")
    src = o + objformat.OBJ_HEADER_SIZE + op.start
    op.out[:op.length] = arena[src:src + op.length]
    if arena[o:o + objformat.OBJ_HEADER_SIZE] != head:
        raise CorruptionError(component, "slot rewritten during the read (torn read)")
    err = check_payload(op, csum, component)
    if err is not None:
        raise err


def write_until(ops: list) -> float:
    """The earliest ``until_ms`` of a batch's writes as wall-clock seconds (0.0: none carries one)."""
    first = min((op.until_ms for op in ops if op.until_ms), default=0)
    return first / 1000


def stale_message(gen: int, floor: int | None = None) -> str:
    """Why a write of generation ``gen`` is not made: a deposed metaserver term granted it, as the node's floor for it
    (``floor``, where known: the node's own check) or the floor it publishes (``objformat.stale_gens``: a writer's) says."""
    where = f"this node's floor for it is {floor:#x}" if floor is not None else "the node's published floor is above it"
    return (f"write of generation {gen:#x} granted by a deposed metaserver term ({where}): its allocation may hold "
            f"another page now; not written")


def stale_write(component: str, gen: int) -> Unavailable:
    """A write the node's published floor says a deposed metaserver term granted (``objformat.stale_gens``)."""
    return Unavailable(component, stale_message(gen))


def late_message(until_ms: int, what: str = "write") -> str:
    """Why ``what`` lands no (further) byte past its deadline: the metaserver may have placed another page in its
    extent since (its allocation ended: an expiry, a leader's death). The writers add "not written", the node what it
    did with the rest of the data."""
    return (f"{what} past its write deadline (until_ms {until_ms}, clock {int(time.time() * 1000)}): its allocation "
            f"may have ended")


def late_write(component: str, until_ms: int) -> Unavailable:
    """The error of a write whose deadline passed before its bytes were copied: none of them landed after it."""
    return Unavailable(component, late_message(until_ms) + "; not written", wire.Status.UNAVAILABLE)


def write_to_arena(arena: memoryview, op: WriteOp) -> None:
    """Payload first, header last: a reader that races the writer sees no valid header until the bytes are in."""
    pos = op.offset + objformat.OBJ_HEADER_SIZE
    arena[op.offset:op.offset + 4] = b"\0\0\0\0"  # invalidate any old header of a reused slot first
    for part in op.parts:
        arena[pos:pos + len(part)] = part
        pos += len(part)
    arena[op.offset:op.offset + objformat.OBJ_HEADER_SIZE] = op.header


def write_rows_to_arena(heads_at: np.ndarray, arena: memoryview, off: np.ndarray, plen: np.ndarray,
                        heads: np.ndarray, src: list, deadline: float, until: float = 0.0,
                        gens: np.ndarray | None = None) -> np.ndarray:
    """``write_to_arena`` for a batch of whole pages as arrays (``umbp/putbatch.py``): page i's payload ``src[i]`` (a
    flat byte view of ``plen[i]`` bytes) to the object at ``off[i]`` of the mapped ``arena``, whose header rows every
    4 KiB ``heads_at`` views writably; ``heads[i]`` its header. Same order as ``write_to_arena`` page by page:
    every old header invalidated first, then the payloads, then the headers, so a reader racing the writes sees no
    valid header until its payload is in. Per page: 0 written, 1 not written (outside the arena or not 4 KiB
    aligned, or ``until`` (wall-clock seconds, 0.0: none) passed before its copy, or its generation ``gens[i]`` below
    the floor the node publishes for it, ``objformat.stale_gens``: the transport's ``start_write`` decides it, with its
    own error). Cost: a fixed number of numpy calls and one slice assignment a page (a ctypes
    ``memmove`` costs more a call, measured) with one clock read when ``until`` is set, or copy threads
    (``copies.Stream``, given up at ``until``: every page then 1) for batches of ``copies.SERIAL_BYTES``;
    DeadlineExceeded when those are not done by ``deadline``."""
    hs, size = objformat.OBJ_HEADER_SIZE, len(arena)
    off = off.astype(np.int64)
    plen = plen.astype(np.int64)
    status = np.ones(len(off), np.int8)
    inside = ((off >= objformat.ARENA_DATA_START) & (plen >= 0) & (plen <= size) & (off + hs + plen <= size)
              & (off % objformat.ALIGN == 0))
    if gens is not None:
        inside &= ~objformat.stale_gens(objformat.floor_words(arena), gens)  # a deposed leader's grants: copied by no one
    if inside.all():
        pick = None
    else:
        pick = inside.nonzero()[0]
        if not len(pick):
            return status
        off, plen, heads = off[pick], plen[pick], heads[pick]
        src = [src[i] for i in pick.tolist()]
    if until and time.time() > until:
        return status  # not one byte after the deadline: the transport fails each page
    slot = off // objformat.ALIGN
    heads_at[slot, :4] = 0  # a reader racing this write sees no valid header until the end
    dst = (off + hs).tolist()
    n = plen.tolist()
    total = sum(n)
    done = len(dst)
    if copies.threads_for(total) > 1:
        # past ``until`` the stream is given up: its jobs copy no further piece (copies.PIECE_BYTES at most)
        late = deadline if not until else min(deadline, time.monotonic() + until - time.time())
        stream = copies.Stream(total, late, keep=src)
        add, base, address = stream.add, copies.address(arena), copies.address_of_view
        for a, v, k in zip(dst, src, n):
            if k:
                add(base + a, address(v), k)
        try:
            stream.finish()
        except DeadlineExceeded:
            if not until or time.time() <= until:
                raise
            return status  # no header written: the transport fails each page
    elif until:
        clock = time.time
        for j, (a, v, k) in enumerate(zip(dst, src, n)):
            if clock() > until:
                done = j
                break
            arena[a:a + k] = v
    else:
        for a, v, k in zip(dst, src, n):
            arena[a:a + k] = v
    if done < len(dst):  # the pages copied before the deadline are written; the others left to the transport
        slot, heads = slot[:done], heads[:done]
        if pick is None:
            pick = np.arange(done)
        else:
            pick = pick[:done]
    heads_at[slot] = heads
    if pick is None:
        status[:] = 0
    else:
        status[pick] = 0
    return status


class MemoryTransport(Transport):
    """Test double: an in-process arena. Same header checks as the real transports."""

    name = "memory"

    def __init__(self, size: int):
        self.arena = memoryview(bytearray(size))
        self.closed = False

    def start_read(self, ops, deadline):
        p = Pending(ops, "read")
        for i, op in enumerate(ops):
            try:
                read_from_arena(self.arena, op, "transport memory")
            except CorruptionError as e:
                p.results[i] = e
        return p

    def start_write(self, ops, deadline):
        for op in ops:
            write_to_arena(self.arena, op)
        return Pending(ops, "write")

    def finish(self, pending, deadline):
        return pending.results

    def close(self):
        self.closed = True
