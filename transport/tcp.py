"""TCP: the blocking framed connection every client-side peer uses, and the TCP data transport to a node.

``FramedSocket`` is a blocking socket speaking ``transport.wire`` frames: ``send`` writes header, meta and data
buffers with ``sendmsg`` (no joining of payloads), ``recv_frame`` reads header and meta into a reusable buffer and
data straight into the caller's memory. One deadline covers a whole call; a timeout or a broken stream closes the
socket (the next call reconnects), because a half-read frame cannot be resynchronised.

``TcpTransport`` pipelines a batch: ``start_read`` sends every READ request in one ``sendmsg``; ``finish`` receives
the answers in order, each payload with ``recv_into`` directly into ``ReadOp.out``. Node CPU is one header check and
two ``transport.write`` calls per object (the node writes from its mapped arena).
"""

from __future__ import annotations

import socket
import time
from typing import Any

from transport import wire
from transport.base import Pending, Transport, check_payload
from umbp.auth import ClientAuth
from umbp.config import split_host_port
from umbp.errors import CorruptionError, DeadlineExceeded, ProtocolError, RemoteError, TransportError

_IOV_MAX = 512


def _remaining(deadline: float, component: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded(component, "deadline exceeded")
    return left


class FramedSocket:
    """A blocking connection carrying wire frames. Not thread-safe: callers serialise access.

    With ``hello`` (or a ``token``) the connection introduces itself right after connecting (HELLO, then AUTH with
    the token when the server asks: umbp/auth.py) and raises AuthError when the server refuses it, needs a token
    that was not given, or cannot prove it knows the token. Without either it says nothing: an open server serves
    it, a closed one answers its first request with AUTH "authentication required"."""

    def __init__(self, addr: str, component: str, deadline: float, token: str | None = None,
                 hello: bool = False):
        self.addr = addr
        self.component = component
        host, port = split_host_port(addr, component)
        try:
            self.sock = socket.create_connection((host, port), timeout=_remaining(deadline, component))
        except OSError as e:
            raise TransportError(component, f"cannot connect to {addr}: {e.strerror or e}") from e
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
            except OSError:
                pass
        self._hdr = bytearray(wire.HEADER_SIZE)
        self._hdr_mv = memoryview(self._hdr)
        self._next_id = 1
        self.closed = False
        if token is not None or hello:
            try:
                self.handshake(token, deadline)
            except BaseException:
                self.close()
                raise

    def handshake(self, token: str | None, deadline: float) -> str:
        """HELLO, then AUTH when the server asks for it; returns the scope the server granted."""
        auth = ClientAuth(token, self.component)
        meta = auth.auth_meta(self.request(wire.Op.HELLO, auth.hello_meta(self.component), deadline).meta)
        if meta is None:
            return "open"
        return auth.check(self.request(wire.Op.AUTH, meta, deadline).meta)

    def peer_closed(self) -> bool:
        """True when the server closed this (idle) connection: a peek that finds EOF. Costs one syscall."""
        timeout = self.sock.gettimeout()
        self.sock.setblocking(False)  # a socket with a timeout would wait for data before the peek
        try:
            return self.sock.recv(1, socket.MSG_PEEK) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True
        finally:
            self.sock.settimeout(timeout)

    def next_id(self) -> int:
        rid = self._next_id
        self._next_id = (rid + 1) & 0xFFFFFFFF or 1
        return rid

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.sock.close()
            except OSError:
                pass

    def _fail(self, e: BaseException, what: str) -> TransportError:
        self.close()
        if isinstance(e, (TimeoutError, socket.timeout)):
            return DeadlineExceeded(self.component, f"{what} {self.addr}: deadline exceeded")
        if isinstance(e, TransportError):
            return e
        return TransportError(self.component, f"{what} {self.addr} failed: {e}")

    def send(self, bufs: list, deadline: float) -> None:
        """Send every buffer in order (partial sends continue from where the kernel stopped)."""
        try:
            self.sock.settimeout(_remaining(deadline, self.component))
            views = [memoryview(b).cast("B") if not isinstance(b, bytes) else memoryview(b) for b in bufs]
            views = [v for v in views if len(v)]
            i = 0  # first buffer not yet fully sent (an index, not pops: a batch may have thousands of parts)
            while i < len(views):
                sent = self.sock.sendmsg(views[i:i + _IOV_MAX])
                while sent and i < len(views):
                    n = len(views[i])
                    if sent >= n:
                        sent -= n
                        i += 1
                    else:
                        views[i] = views[i][sent:]
                        sent = 0
        except (OSError, DeadlineExceeded) as e:
            raise self._fail(e, "send to") from e

    def recv_exact(self, mv: memoryview) -> None:
        """Fill ``mv`` completely (socket timeout already set by the caller)."""
        pos, n = 0, len(mv)
        recv_into = self.sock.recv_into
        while pos < n:
            got = recv_into(mv[pos:])
            if not got:
                raise TransportError(self.component, f"{self.addr} closed the connection")
            pos += got

    def recv_header(self, deadline: float) -> tuple[int, int, int, int, int, int]:
        try:
            self.sock.settimeout(_remaining(deadline, self.component))
            self.recv_exact(self._hdr_mv)
            return wire.decode_header(self._hdr_mv, self.component)
        except (OSError, TransportError, ProtocolError) as e:
            raise self._fail(e, "receive from") from e

    def recv_into(self, mv: memoryview) -> None:
        try:
            self.recv_exact(mv)
        except (OSError, TransportError) as e:
            raise self._fail(e, "receive from") from e

    def recv_frame(self, deadline: float) -> wire.Frame:
        op, flags, status, rid, meta_len, data_len = self.recv_header(deadline)
        meta = None
        if meta_len:
            raw = bytearray(meta_len)
            self.recv_into(memoryview(raw))
            meta = wire.unpack_meta(raw, self.component)
        data = None
        if data_len:
            data = memoryview(bytearray(data_len))
            self.recv_into(data)
        return wire.Frame(op, flags, status, rid, meta, data, data_len)

    def request(self, op: int, meta: Any, deadline: float, data: list | None = None) -> wire.Frame:
        """One request, one answer (raised as RemoteError when it is an error)."""
        rid = self.next_id()
        dlen = sum(len(memoryview(d).cast("B")) for d in data) if data else 0
        self.send([wire.encode(op, rid, meta, data_len=dlen)] + (data or []), deadline)
        frame = self.recv_frame(deadline)
        if frame.request_id != rid:
            self.close()
            raise ProtocolError(self.component, f"answer for request {frame.request_id}, expected {rid}")
        wire.raise_for_status(frame, self.component)
        return frame

    def send_noreply(self, op: int, meta: Any, deadline: float) -> None:
        self.send([wire.encode(op, self.next_id(), meta, flags=wire.Flag.NO_REPLY)], deadline)


class TcpTransport(Transport):
    """Data transport to one node over one TCP connection (reconnected on demand)."""

    name = "tcp"

    def __init__(self, node_id: str, addr: str, token: str | None = None):
        self.node_id = node_id
        self.addr = addr
        self.token = token
        self.component = f"transport tcp {node_id}"
        self._conn: FramedSocket | None = None
        self._ohdr = memoryview(bytearray(wire.OBJ_HEADER_SIZE))

    def _connection(self, deadline: float) -> FramedSocket:
        if self._conn is not None and not self._conn.closed and self._conn.peer_closed():
            self._conn.close()  # the node dropped it (idle timeout, restart): reconnect rather than fail the batch
        if self._conn is None or self._conn.closed:
            self._conn = FramedSocket(self.addr, self.component, deadline, self.token, hello=True)
        return self._conn

    def start_read(self, ops, deadline):
        def frames(rid, op):
            return [wire.encode(wire.Op.READ, rid, [op.offset, op.start, op.length, op.khash, op.generation,
                                                    op.payload_len, op.cap])]
        return self._start(ops, "read", frames, deadline)

    def start_write(self, ops, deadline):
        def frames(rid, op):
            head = wire.encode(wire.Op.WRITE, rid, [op.offset, op.gen, op.cap], data_len=len(op.header) + op.nbytes)
            return [head, op.header, *op.parts]
        return self._start(ops, "write", frames, deadline)

    def _start(self, ops, kind: str, frames, deadline: float) -> Pending:
        """Send every op's request in one ``sendmsg`` sequence; answers are read in ``finish``."""
        p = Pending(ops, kind)
        try:
            conn = self._connection(deadline)
            ids, bufs = [], []
            for op in ops:
                rid = conn.next_id()
                ids.append(rid)
                bufs.extend(frames(rid, op))
            if kind == "read":
                bufs = [b"".join(bufs)]  # small requests: one buffer, one syscall
            conn.send(bufs, deadline)
            p.state = (conn, ids)
        except TransportError as e:
            p.results = [e] * len(ops)
            p.state = None
        return p

    def finish(self, pending, deadline):
        if pending.state is None:
            return pending.results
        conn, ids = pending.state
        results = pending.results
        i = 0
        try:
            for i, op in enumerate(pending.ops):
                results[i] = self._finish_one(conn, ids[i], op, pending.kind, deadline)
        except TransportError as e:
            for j in range(i, len(pending.ops)):
                results[j] = e
        return results

    def _finish_one(self, conn: FramedSocket, rid: int, op, kind: str, deadline: float) -> Exception | None:
        _op, _flags, status, got_id, meta_len, data_len = conn.recv_header(deadline)
        if got_id != rid:
            conn.close()
            raise TransportError(self.component, f"answer for request {got_id}, expected {rid}")
        meta = None
        if meta_len:
            raw = bytearray(meta_len)
            conn.recv_into(memoryview(raw))
            meta = wire.unpack_meta(raw, self.component)
        if status != wire.Status.OK:
            if data_len:
                conn.recv_into(memoryview(bytearray(data_len)))
            try:
                wire.raise_for_status(wire.Frame(_op, _flags, status, rid, meta, None, 0), self.component)
            except (RemoteError, CorruptionError) as e:
                return e
        if kind == "write":
            if data_len:
                conn.recv_into(memoryview(bytearray(data_len)))
            return None
        if data_len != wire.OBJ_HEADER_SIZE + op.length:
            conn.close()
            raise TransportError(self.component, f"READ answer of {data_len} bytes, expected "
                                                 f"{wire.OBJ_HEADER_SIZE + op.length}")
        conn.recv_into(self._ohdr)
        err = None
        try:
            csum = wire.check_object_header(self._ohdr, self.component, op.khash, op.generation, op.payload_len)
        except CorruptionError as e:
            err, csum = e, None
        conn.recv_into(op.out[:op.length])
        return err or check_payload(op, csum, self.component)

    def close(self):
        if self._conn is not None:
            self._conn.close()
            self._conn = None
