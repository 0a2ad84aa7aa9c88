"""The storage node's disk tier as it is served: READV_DISK for clients, DEMOTE and PROMOTE for the metaserver.

Requests are checked on the event loop (ranges, capabilities, the source headers of a move), their transfers run on
the disk arena's workers (umbp/node/disk.py), and the answer is built back on the loop. A connection answers in
request order: an ``Answer`` holds its place in the connection's output until its I/O is done, and the answers
behind it wait (``flush``). An answer of ``DIRECT_SEND`` bytes or more goes out from a sender thread (``os.writev`` on
a duplicate of the socket, the GIL released), smaller ones and TLS through the transport; read buffers go back to the
pool once sent.

READV_DISK: READV's layout over disk addresses (``objformat.DISK_BIT | offset``; a read capability names that address, so
a DRAM grant never reads the disk and back). Each extent's header is checked like a DRAM read's (key hash, generation,
length, header crc: ``objformat.check_object_header``) on the bytes just read: a stale or torn extent is a CORRUPT failure
of its op, never bytes. A ranged read fetches the header block and the aligned blocks holding the range.

DEMOTE (DRAM -> disk) and PROMOTE (disk -> DRAM): the metaserver's identity only (the cluster secret, whose scope
may act as a node; anyone in an open pool). Rows (``answerrows.TIER_ROW``) are independent; the answer lists the failed
ones. A source whose header does not match its row is never copied. The copy's header lands LAST:
- DEMOTE writes each extent whole with its header zeroed (one pwritev: the block holding the header from a scratch
  copy, the rest straight from the arena), ``fdatasync``, then the header block with the header, ``fdatasync``, and
  only then answers. A node killed (or a power cut) before the second write leaves an extent with no valid header: a
  READV_DISK of it is CORRUPT, never the half-written bytes. The source header is compared again before the
  header write: a source rewritten meanwhile fails its row.
- PROMOTE zeroes the DRAM extent's header first, reads the disk extent's first block into scratch and the rest
  straight into the arena, checks the header read, then copies the first block in with the header bytes last. In a
  closed pool the write counts in the write ledger at the copy's generation (``regen``, else the object's): a
  generation the ledger refuses fails the row (the metaserver gives a promoted copy a fresh generation).
A request carries the mover's deadline (``until_ms``, wall clock): one that arrives after it (delayed in the network
past the mover's give-up) copies nothing, and a DEMOTE that passes it before its header write leaves its copy without
one (``late``).

Costs: per READV_DISK op one buffer (two for a range past the first block) and one syscall on a worker; per moved
row two writes (a 4 KiB one for the header) and a 4 KiB memcpy; two ``fdatasync`` per DEMOTE batch.
"""

from __future__ import annotations

import asyncio
import os
import select
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from transport import answerrows, objformat, wire
from umbp.errors import AuthError, BadRequest, CorruptionError, RemoteError
from umbp.node.disk import ALIGN, DiskArena, Job
from umbp.node.readv import check_ops

HS = objformat.OBJ_HEADER_SIZE
# A READV_DISK answer of this many bytes or more is written to the socket by a sender thread (``DiskTier.direct_send``)
# rather than by the event loop: uvloop writes under the GIL, so a loop copying MiBs into the socket kept the disk
# workers from taking the GIL back after each preadv. Plain TCP only (TLS goes through its transport).
DIRECT_SEND = 1 << 20
INFLIGHT_BYTES = 256 << 20  # a connection's disk answers read or being read and not yet handed over past this: its
# requests are not read until they drain (a client that sends and never reads holds at most about this much)
_ZERO_HEAD = bytes(HS)


class Answer:
    """A disk op's place in its connection's output: ``bufs`` is None until its I/O is done; ``sending`` while a
    sender thread writes it (``flush``)."""

    __slots__ = ("bufs", "held", "nbytes", "sending")

    def __init__(self, nbytes: int = 0):
        self.bufs: list | None = None
        self.held: list = []  # buffers to give back once sent
        self.nbytes = nbytes
        self.sending = False


class ConnState:
    """One connection's disk answers: how many are in its output, bytes in flight, and the read buffers handed to
    the transport, each group with the count of bytes written up to its end (``sent``): once that many bytes left
    the transport's buffer (``sent`` minus its buffer size) the group is given back to the pool."""

    __slots__ = ("waiting", "inflight", "held", "paused", "sent", "closed")

    def __init__(self):
        self.waiting = 0
        self.inflight = 0
        self.held: deque = deque()  # (bytes written up to its end, [buffers])
        self.paused = False
        self.sent = 0
        self.closed = False  # the connection is gone: a sender thread stops


def flush(conn) -> None:
    """``DataProtocol.flush`` while disk answers are around: send what precedes the first unfinished one (a big one
    from a sender thread: ``DiskTier.direct_send``), then give back the buffers the transport has finished with."""
    st, out, ready, held = conn.disk, conn._out, [], []
    for i, b in enumerate(out):
        if type(b) is Answer:
            if b.bufs is None or b.sending:
                conn._out = out[i:]
                break
            if b.nbytes >= DIRECT_SEND and conn.tls is None:
                _write(conn, ready, held)
                ready, held = [], []
                if conn.node.tier.direct_send(conn, b):
                    conn._out = out[i:]
                    break
            ready.extend(b.bufs)
            held.extend(b.held)
            st.waiting -= 1
            _handed_over(conn, b)
        else:
            ready.append(b)
    else:
        conn._out = []
    _write(conn, ready, held)
    drained = st.sent - conn.transport.get_write_buffer_size()
    put = conn.node.disk.buffers.put
    while st.held and st.held[0][0] <= drained:
        for b in st.held.popleft()[1]:
            put(b)


def _handed_over(conn, answer: Answer) -> None:
    """``answer`` left the connection's queue (to the transport, whose own high water mark takes over, or sent by a
    sender thread): reading requests resumes once the queued answers are under ``INFLIGHT_BYTES`` again."""
    st = conn.disk
    st.inflight -= answer.nbytes
    if st.paused and st.inflight <= INFLIGHT_BYTES and not conn.transport.is_closing():
        st.paused = False
        conn.transport.resume_reading()


def _write(conn, ready: list, held: list) -> None:
    if ready:
        st = conn.disk
        conn.transport.writelines(ready)
        st.sent += sum(map(len, ready))
        if held:
            st.held.append((st.sent, held))


def release(conn) -> None:
    """Give all of a connection's read buffers back to the pool (it closed: nothing more will be sent)."""
    conn.disk.closed = True
    put = conn.node.disk.buffers.put
    for _end, bufs in conn.disk.held:
        for b in bufs:
            put(b)
    conn.disk.held.clear()


class DiskTier:
    def __init__(self, node: Any, disk: DiskArena):
        self.node = node
        self.disk = disk
        self.component = node.component
        self.senders = ThreadPoolExecutor(max_workers=max(2, disk.threads), thread_name_prefix="umbp-disk-send")
        self.stats = {"demotions": 0, "promotions": 0, "demote_failures": 0, "promote_failures": 0,
                      "disk_reads": 0, "disk_bytes_read": 0}

    def direct_send(self, conn, answer: Answer) -> bool:
        """Write ``answer`` from a sender thread; False (nothing done) while the transport still holds earlier bytes
        (they go first: the answer then goes through the transport behind them). The thread writes to a duplicate of
        the socket's descriptor (a close meanwhile cannot hand the number to another socket) and gives up when the
        connection is gone; the answers behind it wait in order (``sending``). Plain TCP only (``flush``)."""
        tr = conn.transport
        sock = tr.get_extra_info("socket")
        if sock is None or tr.get_write_buffer_size():
            return False
        try:
            fd = os.dup(sock.fileno())
        except OSError:
            return False
        answer.sending = True
        loop = asyncio.get_running_loop()
        st = conn.disk

        def sent(err: OSError | None) -> None:  # the loop
            st.waiting -= 1
            _handed_over(conn, answer)
            if conn._out and conn._out[0] is answer:
                conn._out.pop(0)
            for b in answer.held:
                self.disk.buffers.put(b)  # on the wire (or never to be: the connection failed)
            if err is not None:
                tr.close()
            elif not tr.is_closing():
                conn.flush()

        def run() -> None:  # a sender thread
            err = None
            try:
                _send_all(fd, answer.bufs, st)
            except OSError as e:
                err = e
            finally:
                os.close(fd)
            loop.call_soon_threadsafe(sent, err)

        self.senders.submit(run)
        return True

    def handle(self, conn, frame: wire.Frame) -> None:
        """A READV_DISK, DEMOTE or PROMOTE frame: its answer's place goes into ``conn._out`` now, its bytes later."""
        op = frame.op
        if op != wire.Op.READV_DISK and not conn.auth.require().node:
            raise AuthError(self.component, f"{wire.Op(op).name}: only the metaserver (the cluster secret) moves "
                                            f"pages between tiers")
        if conn.disk is None:
            conn.disk = ConnState()
        if op == wire.Op.READV_DISK:
            self.readv(conn, frame)
        elif op == wire.Op.DEMOTE:
            self.demote(conn, frame)
        else:
            self.promote(conn, frame)

    def _later(self, conn, answer: Answer, finish) -> Any:
        """A ``done`` for ``DiskArena.run``: ``finish`` on the event loop, then the answer goes out in order."""
        loop = asyncio.get_running_loop()
        conn._out.append(answer)
        conn.disk.waiting += 1

        def on_loop(*args) -> None:
            finish(*args)
            if conn.transport is None or conn.transport.is_closing():
                return  # its buffers are left to the collector (a closing transport may still send others')
            conn.flush()

        return lambda *args: loop.call_soon_threadsafe(on_loop, *args)

    def _encode(self, frame: wire.Frame, version: int, failures: list, data_len: int = 0) -> bytes:
        failures.sort()
        return wire.encode(frame.op, frame.request_id, failures or None, flags=wire.Flag.RESPONSE,
                           data_len=data_len, version=version)

    # ---- clients: READV_DISK -----------------------------------------------------------------------------------

    def readv(self, conn, frame: wire.Frame) -> None:
        meta, comp, disk, node = frame.meta, self.component, self.disk, self.node
        rows, failures = check_ops(meta, "READV_DISK", comp, None if node.cap_key is None else conn.caps.read, 0, 0,
                                   disk.check)
        get = disk.buffers.get
        reads, jobs, nbytes = [], [], 0
        for i, off, start, length, khash, gen, plen in rows:
            a = (HS + start) // ALIGN * ALIGN  # the range's first block
            end = objformat.align_up(HS + start + length)
            bufs = [get(end)] if a <= ALIGN else [get(ALIGN), get(end - a)]
            jobs.append(Job(False, off, bufs[:1]))
            if a > ALIGN:
                jobs.append(Job(False, off + a, [bufs[1]]))
            nbytes += end if a <= ALIGN else ALIGN + end - a
            reads.append((i, khash, gen, plen, start, length, a, bufs, len(jobs)))
        answer = Answer(nbytes)
        version = conn.reader.version
        st = conn.disk
        st.inflight += nbytes
        if st.inflight > INFLIGHT_BYTES and not st.paused:
            st.paused = True
            conn.transport.pause_reading()

        def finish(jobs: list[Job]) -> None:
            out, total, served = [], 0, 0
            for i, khash, gen, plen, start, length, a, bufs, j in reads:
                answer.held.extend(bufs)
                err = jobs[j - 1].error or jobs[j - len(bufs)].error
                if err is not None:
                    failures.append([i, wire.Status.INTERNAL, f"{comp}: disk read failed: {err.strerror or err}"])
                    continue
                head = memoryview(bufs[0])[:HS]
                try:
                    objformat.check_object_header(head, comp, khash, gen, plen)
                except CorruptionError as e:
                    failures.append([i, wire.Status.CORRUPT, str(e)])
                    continue
                body = memoryview(bufs[-1])
                lo = HS + start - (a if a > ALIGN else 0)
                if a <= ALIGN and start == 0:
                    out.append(body[:HS + length])
                else:
                    out.append(head)
                    if length:
                        out.append(body[lo:lo + length])
                total += HS + length
                served += 1
            self.stats["disk_reads"] += served
            self.stats["disk_bytes_read"] += total - HS * served
            node.stats["reads"] += served
            node.stats["bytes_read"] += total - HS * served
            node.stats["errors"] += len(meta) - served
            answer.bufs = [self._encode(frame, version, failures, total)] + out

        disk.run(jobs, self._later(conn, answer, finish))

    # ---- the metaserver: DEMOTE and PROMOTE --------------------------------------------------------------------

    def _rows(self, conn, frame: wire.Frame, what: str) -> tuple[list, list]:
        """(rows that pass their checks as (index, tag, gen, plen, dram, disk, regen, size), failures). A request
        past its ``until_ms`` (wall clock, the mover's: ``late``) fails every row: its sender has given it up and may
        have placed other pages in its extents."""
        rows = answerrows.unpack_tier_rows(frame.meta, self.component)
        ok, failures = [], []
        why = late(frame.meta, what, self.component)
        if why:
            return [], [[i, wire.Status.UNAVAILABLE, why] for i in range(len(rows))]
        for i, (tag, gen, plen, dram, dsk, regen) in enumerate(rows.tolist()):
            size = objformat.object_size(plen)
            try:
                self.node.check_range(dram, size, what)
                why = self.disk.check(dsk, size)
                if why:
                    raise BadRequest(self.component, f"{what}: {why}")
            except RemoteError as e:
                failures.append([i, e.code or wire.Status.BAD_REQUEST, str(e)])
                continue
            ok.append((i, tag, gen, plen, dram, dsk, regen, size))
        return ok, failures

    def _header(self, head, comp: str, tag: int, gen: int, plen: int, regen: int) -> bytes:
        """The copy's header: the source's, or with generation ``regen`` (its payload checksum kept)."""
        csum = objformat.check_object_header(head, comp, tag, gen, plen)
        return bytes(head) if not regen else objformat.pack_object_header(tag, regen, plen, csum)

    def demote(self, conn, frame: wire.Frame) -> None:
        rows, failures = self._rows(conn, frame, "DEMOTE")
        comp, view, disk = self.component, self.node.arena.view, self.disk
        moves, jobs = [], []
        for i, tag, gen, plen, dram, dsk, regen, size in rows:
            src = view[dram:dram + HS]
            try:
                final = self._header(src, comp, tag, gen, plen, regen)
            except CorruptionError as e:
                failures.append([i, wire.Status.CORRUPT, f"{comp}: DEMOTE: source {e.detail}"])
                continue
            first = disk.buffers.get(ALIGN)
            first[:] = view[dram:dram + ALIGN]
            first[:HS] = _ZERO_HEAD  # no valid header until every other byte of the extent is on the disk
            jobs.append(Job(True, dsk, [first] + ([view[dram + ALIGN:dram + size]] if size > ALIGN else [])))
            moves.append((i, dram, dsk, bytes(src), final, first))
        answer = Answer()
        version = conn.reader.version
        done = self._later(conn, answer, lambda err: finish(err))

        headed: list = []  # the moves whose header write was started (in ``heads``' order)

        def headers(jobs1: list[Job]) -> None:  # a worker: the extents are written; now their headers
            if not moves:
                done(None)
                return
            try:
                disk.sync()
            except OSError as e:
                done(e)
                return
            heads = []
            gone = late(frame.meta, "DEMOTE", comp)  # given up meanwhile: no header makes a copy valid
            for m, j in zip(moves, jobs1):
                i, dram, _dsk, src, final, first = m
                if gone:
                    failures.append([i, wire.Status.UNAVAILABLE, gone])
                elif j.error is not None:
                    failures.append([i, wire.Status.INTERNAL, f"{comp}: DEMOTE: disk write failed: "
                                                              f"{j.error.strerror or j.error}"])
                elif view[dram:dram + HS] != src:
                    failures.append([i, wire.Status.CORRUPT, f"{comp}: DEMOTE: the source changed during the copy"])
                else:
                    first[:HS] = final
                    heads.append(Job(True, m[2], [first]))
                    headed.append(m)
            disk.run(heads, synced)

        def synced(heads: list[Job]) -> None:  # a worker
            for m, j in zip(headed, heads):
                if j.error is not None:
                    failures.append([m[0], wire.Status.INTERNAL, f"{comp}: DEMOTE: disk write failed: "
                                                                 f"{j.error.strerror or j.error}"])
            try:
                disk.sync()
            except OSError as e:
                done(e)
                return
            done(None)

        def finish(err: OSError | None) -> None:  # the loop
            for m in moves:
                disk.buffers.put(m[5])
            failed = {f[0] for f in failures}
            if err is not None:
                failures.extend([m[0], wire.Status.INTERNAL, f"{comp}: DEMOTE: disk sync failed: {err}"]
                                for m in moves if m[0] not in failed)
                failed = {f[0] for f in failures}
            self.stats["demotions"] += sum(1 for m in moves if m[0] not in failed)
            self.stats["demote_failures"] += len(failures)
            answer.bufs = [self._encode(frame, version, failures)]

        disk.run(jobs, headers)

    def promote(self, conn, frame: wire.Frame) -> None:
        rows, failures = self._rows(conn, frame, "PROMOTE")
        comp, view, disk, ledger = self.component, self.node.arena.view, self.disk, self.node.ledger
        moves, jobs = [], []
        for i, tag, gen, plen, dram, dsk, regen, size in rows:
            if ledger is not None:
                try:
                    ledger.admit(dram, size, regen or gen)
                except AuthError as e:
                    failures.append([i, wire.Status.AUTH, str(e)])
                    continue
            view[dram:dram + HS] = _ZERO_HEAD  # the extent's previous object is gone before a byte of this lands
            first = disk.buffers.get(ALIGN)
            jobs.append(Job(False, dsk, [first] + ([view[dram + ALIGN:dram + size]] if size > ALIGN else [])))
            moves.append((i, tag, gen, plen, dram, regen, first))
        answer = Answer()
        version = conn.reader.version

        def finish(jobs: list[Job]) -> None:  # the loop
            for (i, tag, gen, plen, dram, regen, first), j in zip(moves, jobs):
                try:
                    if j.error is not None:
                        failures.append([i, wire.Status.INTERNAL, f"{comp}: PROMOTE: disk read failed: "
                                                                  f"{j.error.strerror or j.error}"])
                        continue
                    try:
                        final = self._header(memoryview(first)[:HS], comp, tag, gen, plen, regen)
                    except CorruptionError as e:
                        failures.append([i, wire.Status.CORRUPT, f"{comp}: PROMOTE: disk extent {e.detail}"])
                        continue
                    view[dram + HS:dram + ALIGN] = memoryview(first)[HS:]
                    view[dram:dram + HS] = final  # last: the copy is whole before it reads as valid
                finally:
                    disk.buffers.put(first)
            failed = {f[0] for f in failures}
            self.stats["promotions"] += sum(1 for m in moves if m[0] not in failed)
            self.stats["promote_failures"] += len(failures)
            answer.bufs = [self._encode(frame, version, failures)]

        disk.run(jobs, self._later(conn, answer, finish))


def late(meta: Any, what: str, component: str) -> str | None:
    """Why a DEMOTE/PROMOTE is past its sender's deadline (``until_ms``, wall-clock ms; none from a metaserver
    that sends none), or None. The mover keeps a move's destinations out of placement for longer than that after
    it gave the move up (metaserver/ha/tiering.py), so a request that starts before it never lands on another
    page."""
    until = meta.get("until_ms") if type(meta) is dict else None
    if type(until) is int and time.time() * 1000 > until:
        return f"{component}: {what}: past its deadline (the metaserver has given it up)"
    return None


def _send_all(fd: int, bufs: list, st: ConnState) -> None:
    """Write ``bufs`` to the non-blocking socket ``fd`` (the GIL released in each syscall and wait); OSError when the
    connection fails or is closed (checked every second while the peer does not read)."""
    views = [memoryview(b).cast("B") for b in bufs]
    i = 0
    while i < len(views):
        try:
            n = os.writev(fd, views[i:i + 512])
        except BlockingIOError:
            if st.closed:
                raise OSError(32, "connection closed") from None
            select.select([], [fd], [], 1.0)
            continue
        while n and i < len(views):
            if n >= len(views[i]):
                n -= len(views[i])
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0


# ---- the reader's side, for tests and benches (the client's own path: READV_DISK frames in transport/tcp.py) -------

def readv_disk(sock, ops: list, deadline: float, op: int = wire.Op.READV_DISK) -> list:
    """One READV_DISK over a ``transport.framed.FramedSocket``: ``ops`` are READV_DISK's rows; per op the object
    header plus its payload range (bytes), checked again as a client checks them, or the error (CorruptionError for
    a stale or torn extent). A whole-frame error is raised. ``op`` READV: the same over DRAM offsets."""
    rid = sock.next_id()
    sock.send([wire.encode(op, rid, ops)], deadline)
    frame = sock.recv_frame(deadline)
    if frame.request_id != rid:
        raise BadRequest("reader", f"answer for request {frame.request_id}, expected {rid}")
    wire.raise_for_status(frame, "reader")
    failed = wire.vec_failures(frame.meta, len(ops), "reader")
    data, pos, out = frame.data, 0, []
    for i, (_addr, _start, length, tag, gen, plen, _cap) in enumerate(ops):
        if i in failed:
            out.append(failed[i])
            continue
        got = bytes(data[pos:pos + HS + length])
        pos += HS + length
        try:
            objformat.check_object_header(got[:HS], "reader", tag, gen, plen)
            out.append(got)
        except CorruptionError as e:
            out.append(e)
    if pos != (frame.data_len or 0):
        raise BadRequest("reader", f"answer of {frame.data_len} bytes, the served ops add up to {pos}")
    return out
