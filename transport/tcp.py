"""TCP: the data transport to a node (its connection is ``transport.framed.FramedSocket``).

``TcpTransport`` sends a batch as READV/WRITEV frames (up to ``VEC_OPS`` objects each), all of them in one
``sendmsg`` sequence in ``start_*``; ``finish`` reads the answers in order. A READV answer says up front which
objects failed, so the client knows where every byte of its data goes and receives it with ``recvmsg_into``
straight into per-object header slots and the callers' outs (MSG_WAITALL: one syscall per run of 512 views, and
one per large view, not three per object). Over TLS (no ``recvmsg_into``: one ``recv_into`` a 16 KiB record) a big
read batch is split over ``tls_streams`` connections (``ClientConfig.tls_streams``) received in parallel threads; the
node encrypts each connection's big answers on a worker thread of its own (transport/tlsserve.py).
Node CPU per object is a range check, a capability check (closed pools) and a header check; its answer points into
the mapped arena and goes out in one ``writev``.
"""

from __future__ import annotations

from operator import attrgetter

from transport import objformat, wire
from transport.base import Pending, Transport, check_payload
from transport.framed import FramedSocket, connection_error
from umbp.errors import CorruptionError, ProtocolError, RemoteError, TransportError

HEADER_MEMO = 65536  # READV headers remembered as checked (TcpTransport._checked); cleared when full
# TLS reads: a batch of at least TLS_SPLIT_BYTES is split over ``tls_streams`` connections to the node
# (``ClientConfig.tls_streams``), received in parallel threads (``ssl`` drops the GIL while it decrypts). 1: one
# connection, as plain TCP always uses. Measured: bench/getpath.py --tls, docs/benchmarks/getpath.md.
TLS_SPLIT_BYTES = 4 << 20
_POOL: list = []  # the receive threads of split TLS batches (one pool for every transport): made on first use


_length = attrgetter("length")


class TcpTransport(Transport):
    """Data transport to one node over one TCP connection (reconnected on demand; TLS: up to ``tls_streams`` for a
    big read batch, each reconnected on demand, a lost one failing only its part's ops; ``ktls``: kernel TLS asked
    for on each).

    A batch travels as READV/WRITEV frames (at most ``VEC_OPS`` objects and ``VEC_BYTES`` of data each), all
    of them sent before the first answer is read. A READV answer lists the failed objects in its meta, so the
    client knows the exact layout of its data before reading it and receives every served object's header and
    payload with ``recvmsg_into`` straight into a header slot and the caller's out: one syscall per run of views
    (MSG_WAITALL), no per-object receive, no copy."""

    name = "tcp"
    VEC_OPS = 1024
    VEC_BYTES = 64 << 20

    read_op = wire.Op.READV  # READV_DISK: a node's disk tier (its offsets DISK_BIT addresses; umbp/client.py)

    def __init__(self, node_id: str, addr: str, token: str | None = None, tls_ca: str = "", tls_streams: int = 1,
                 ktls: bool = False):
        self.node_id = node_id
        self.addr = addr
        self.token = token
        self.tls_ca = tls_ca
        self.tls_streams = tls_streams
        self.ktls = ktls
        self.component = f"transport tcp {node_id}"
        self._conn: FramedSocket | None = None
        self._more: list[FramedSocket | None] = []  # TLS: the other connections of a split batch (tls_streams)
        self._ohdr = memoryview(bytearray(objformat.OBJ_HEADER_SIZE * 64))  # object headers of one READV answer
        self._slots = [self._ohdr[n * objformat.OBJ_HEADER_SIZE:(n + 1) * objformat.OBJ_HEADER_SIZE] for n in range(64)]
        self._heads: list[list] = []  # [header buffer, its slots] of each other connection's answers
        # (offset, key hash, generation, payload length) -> (header bytes, checksum) that passed the header check:
        # the same bytes received again for the same directory entry pass without the unpack and crc
        self._checked: dict[tuple[int, int, int, int], tuple[bytes, int | None]] = {}

    def _connection(self, deadline: float) -> FramedSocket:
        if self._conn is not None and not self._conn.closed and self._conn.peer_closed():
            self._conn.close()  # the node dropped it (idle timeout, restart): reconnect rather than fail the batch
        if self._conn is None or self._conn.closed:
            self._conn = FramedSocket(self.addr, self.component, deadline, self.token, hello=True, tls_ca=self.tls_ca,
                                      ktls=self.ktls)
        return self._conn

    def _connection_k(self, k: int, deadline: float) -> FramedSocket:
        """Connection k of a split batch (0: the usual one)."""
        if not k:
            return self._connection(deadline)
        while len(self._more) < k:
            self._more.append(None)
            self._heads.append([memoryview(b""), []])
        c = self._more[k - 1]
        if c is not None and not c.closed and c.peer_closed():
            c.close()
        if c is None or c.closed:
            c = self._more[k - 1] = FramedSocket(self.addr, self.component, deadline, self.token, hello=True,
                                                 tls_ca=self.tls_ca, ktls=self.ktls)
        return c

    def _split(self, ops: list) -> list[tuple[int, int]]:
        """[lo, hi) parts of a read batch, one a connection: several (about equal bytes) for a TLS batch of
        TLS_SPLIT_BYTES or more, else one."""
        if not self.tls_ca or self.tls_streams < 2 or len(ops) < 2:
            return [(0, len(ops))]
        sizes = [op.length for op in ops]
        total = sum(sizes)
        if total < TLS_SPLIT_BYTES:
            return [(0, len(ops))]
        k = min(self.tls_streams, len(ops))
        parts, lo, acc = [], 0, 0
        for i, n in enumerate(sizes):
            acc += n
            if acc * k >= total * (len(parts) + 1) and len(parts) < k - 1 and i + 1 < len(ops):
                parts.append((lo, i + 1))
                lo = i + 1
        parts.append((lo, len(ops)))
        return parts

    def start_read(self, ops, deadline):
        parts = self._split(ops)
        if len(parts) == 1:
            return self._start_read(ops, deadline)
        p = Pending(ops, "read")
        state = []
        for k, (lo, hi) in enumerate(parts):
            try:
                sub = self._start_read(ops[lo:hi], deadline, k)
            except TransportError as e:  # _start_read reports its own; only a raise past it lands here
                sub = Pending(ops[lo:hi], "read")
                sub.results = [e] * (hi - lo)
            state.append((k, lo, hi, sub))
        p.state = ("split", state)
        return p

    def _start_read(self, ops, deadline, k: int = 0):
        p = Pending(ops, "read")
        try:
            conn = self._connection_k(k, deadline)
            frames, bufs = [], []
            encode, READV = wire.encode, self.read_op
            for lo, hi in self._runs(ops, _length):
                rid = conn.next_id()
                frames.append((rid, lo, hi))
                meta, prev = [], None
                for op in ops[lo:hi]:  # a batch's capability once per frame (b"": the previous op's)
                    meta.append([op.offset, op.start, op.length, op.khash, op.generation, op.payload_len,
                                 b"" if op.cap is prev else op.cap])
                    prev = op.cap
                bufs.append(encode(READV, rid, meta))
            conn.send([b"".join(bufs)] if len(bufs) > 1 else bufs, deadline)
            p.state = (conn, frames)
        except TransportError as e:
            p.results = [e] * len(ops)
        return p

    def start_write(self, ops, deadline):
        p = Pending(ops, "write")
        try:
            conn = self._connection(deadline)
            frames, bufs = [], []
            encode, WRITEV, hs = wire.encode, wire.Op.WRITEV, objformat.OBJ_HEADER_SIZE
            for lo, hi in self._runs(ops, lambda op: op.nbytes):
                rid = conn.next_id()
                frames.append((rid, lo, hi))
                run = ops[lo:hi]
                meta, prev = [], None
                for op in run:  # a batch's capability once per frame (b"": the previous op's)
                    m = [op.offset, op.gen, b"" if op.cap is prev else op.cap, hs + op.nbytes]
                    if op.until_ms:  # the node receives none of the frame's bytes into its arena past it
                        m.append(op.until_ms)
                    meta.append(m)
                    prev = op.cap
                bufs.append(encode(WRITEV, rid, meta, data_len=sum(m[3] for m in meta)))
                for op in run:
                    bufs.append(op.header)
                    bufs.extend(op.parts)
            conn.send(bufs, deadline)
            p.state = (conn, frames)
        except TransportError as e:
            p.results = [e] * len(ops)
        return p

    def _runs(self, ops: list, size) -> list[tuple[int, int]]:
        """Split ops into [lo, hi) runs of at most VEC_OPS objects and about VEC_BYTES of data."""
        limit_ops, limit_bytes = self.VEC_OPS, self.VEC_BYTES
        if len(ops) <= limit_ops and sum(map(size, ops)) + objformat.OBJ_HEADER_SIZE * len(ops) <= limit_bytes:
            return [(0, len(ops))]  # what the loop below makes of a batch that fits one frame
        runs, lo, nbytes = [], 0, 0
        for i, op in enumerate(ops):
            n = size(op) + objformat.OBJ_HEADER_SIZE
            if i > lo and (i - lo >= limit_ops or nbytes + n > limit_bytes):
                runs.append((lo, i))
                lo, nbytes = i, 0
            nbytes += n
        runs.append((lo, len(ops)))
        return runs

    def finish(self, pending, deadline):
        if type(pending.state) is tuple and pending.state[0] == "split":
            return self._finish_split(pending, deadline)
        return self._finish(pending, deadline)

    def _finish_split(self, pending, deadline):
        """A split TLS batch: every connection's part received at once, the others' in the pool's threads."""
        _, state = pending.state
        pending.state = None
        if not _POOL:
            import concurrent.futures as cf

            _POOL.append(cf.ThreadPoolExecutor(max_workers=8, thread_name_prefix="umbp-tls-recv"))
        futures = [(lo, hi, _POOL[0].submit(self._finish, sub, deadline, k)) for k, lo, hi, sub in state[1:]]
        k, lo, hi, sub = state[0]
        first: BaseException | None = None
        try:
            pending.results[lo:hi] = self._finish(sub, deadline, k)
        except BaseException as e:  # raised only once every stream is done: none writes into the outs after
            first = e
        for lo, hi, f in futures:
            try:
                pending.results[lo:hi] = f.result()  # each bounded by the deadline (its socket's timeouts)
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first
        return pending.results

    def _finish(self, pending, deadline, stream: int = 0):
        if pending.state is None:
            return pending.results
        conn, frames = pending.state
        pending.state = None
        results = pending.results
        ops = pending.ops
        k = 0
        try:
            for k, (rid, lo, hi) in enumerate(frames):
                if pending.kind == "read":
                    self._finish_reads(conn, rid, ops, lo, hi, results, deadline, stream)
                else:
                    self._finish_writes(conn, rid, lo, hi, results, deadline)
        except TransportError as e:
            # The connection is gone: frame k's ops failed (those _finish_reads settled keep what it found:
            # objects received whole before the break are good) and so did every later frame's.
            for n, (_rid, lo, hi) in enumerate(frames[k:]):
                if n or not getattr(e, "settled", False):
                    results[lo:hi] = [e] * (hi - lo)
        return results

    def _answer(self, conn: FramedSocket, rid: int, nops: int, deadline: float) -> tuple[int, dict]:
        """Header and meta of one READV/WRITEV answer: (data_len, failures by index). A whole-frame error (the
        request refused: not authenticated, malformed) fails every op of the frame with it."""
        op, flags, status, got_id, meta_len, data_len = conn.recv_header(deadline)
        try:
            meta = conn.recv_meta(meta_len, deadline)
        except ProtocolError as e:
            raise TransportError(self.component, str(e)) from e
        if got_id != rid:
            conn.close()
            connection_error(wire.Frame(op, flags, status, got_id, meta, None, 0), self.component)
            raise TransportError(self.component, f"answer for request {got_id}, expected {rid}")
        if status != wire.Status.OK:
            if data_len:
                conn.discard(data_len, deadline)
            try:
                wire.raise_for_status(wire.Frame(op, flags, status, rid, meta, None, 0), self.component)
            except (RemoteError, CorruptionError) as e:
                return -1, {i: e for i in range(nops)}
        try:
            return data_len, wire.vec_failures(meta, nops, self.component)
        except ProtocolError as e:
            conn.close()
            raise TransportError(self.component, str(e)) from e

    def _finish_writes(self, conn, rid, lo, hi, results, deadline) -> None:
        data_len, failures = self._answer(conn, rid, hi - lo, deadline)
        if data_len > 0:
            conn.discard(data_len, deadline)
        for i, e in failures.items():
            results[lo + i] = e

    def _finish_reads(self, conn, rid, ops, lo, hi, results, deadline, stream: int = 0) -> None:
        data_len, failures = self._answer(conn, rid, hi - lo, deadline)
        hs = objformat.OBJ_HEADER_SIZE
        served = [j for j in range(lo, hi) if j - lo not in failures] if failures else range(lo, hi)
        for i, e in failures.items():
            results[lo + i] = e
        if data_len < 0:  # the whole frame was refused
            return
        expect = sum(hs + ops[j].length for j in served)
        if data_len != expect:
            conn.close()
            raise TransportError(self.component, f"READV answer of {data_len} bytes, expected {expect}")
        # one 64-byte view of the connection's header buffer per object: the header slots of the iovec
        held = self._heads[stream - 1] if stream else None
        ohdr, slots = held if stream else (self._ohdr, self._slots)
        if len(slots) < len(served):
            ohdr = memoryview(bytearray(hs * len(served)))
            slots = [ohdr[n * hs:(n + 1) * hs] for n in range(len(served))]
            if stream:
                held[:] = [ohdr, slots]
            else:
                self._ohdr, self._slots = ohdr, slots
        iov = []
        for n, j in enumerate(served):
            iov.append(slots[n])
            op = ops[j]
            k = op.length
            if k:
                out = op.out
                iov.append(out if len(out) == k else out[:k])
        try:
            conn.recv_scatter(iov, deadline)
            got = data_len
        except TransportError as e:
            got = e.received
            err = e
        else:
            err = None
        check = objformat.check_object_header
        comp = self.component
        memo = self._checked
        heads = ohdr[:hs * len(served)].tobytes()
        pos = 0
        for n, j in enumerate(served):
            op = ops[j]
            pos += hs + op.length
            if pos > got:  # the stream ended inside this object: it and every later one failed
                for m in served[n:]:
                    results[m] = err
                err.settled = True
                raise err
            head = heads[n * hs:(n + 1) * hs]
            ident = (op.offset, op.khash, op.generation, op.payload_len)
            known = memo.get(ident)
            if known is not None and known[0] == head:
                csum = known[1]  # the very bytes that passed for this directory entry before
            else:
                try:
                    csum = check(head, comp, op.khash, op.generation, op.payload_len)
                except CorruptionError as e:
                    results[j] = e
                    continue
                if len(memo) >= HEADER_MEMO:
                    memo.clear()
                memo[ident] = (head, csum)
            if csum is not None:
                results[j] = check_payload(op, csum, comp)

    def close(self):
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        for i, c in enumerate(self._more):
            if c is not None:
                c.close()
                self._more[i] = None
