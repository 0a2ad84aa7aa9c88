"""The blocking framed TCP connection every client-side peer uses (metaserver clients, the TCP and RDMA data
transports, admin tools).

``FramedSocket`` is a blocking socket speaking ``transport.wire`` frames: ``send`` writes header, meta and data
buffers with ``sendmsg`` (no joining of payloads), header and meta are received into buffers the connection reuses
(grown to the largest meta seen), page data straight into the caller's memory (``recv_scatter``); data received only
to be dropped goes through a small fixed buffer (``discard``), so no allocation follows an announced length. A
malformed answer closes the connection (its data would be left unread). One deadline covers a whole call; a
timeout or a broken stream closes the socket (the next call reconnects), because a half-read frame cannot be
resynchronised. Past the deadline nothing new is sent, but a receive still takes what has already arrived, without
waiting (MSG_DONTWAIT): a batch's answer that sat in the socket buffer while another node used up the deadline is
delivered; what is not all there yet raises DeadlineExceeded and closes the socket (a partly received frame or
object is never returned as data; objects of a READV answer received whole before it are kept, as after any break).

Plain sockets are in blocking mode, their deadline kept by SO_RCVTIMEO / SO_SNDTIMEO (set to half the time left when
the one set is longer than that: a client's calls, each due ``timeout_s`` out, set it once), and every receive asks
for MSG_WAITALL: one syscall per frame header and one per run of views, however the bytes arrive. Python's
timeout mode polled before every call and returned to Python for each socket buffer's worth: a 64 KiB x64 get on
loopback took 31 client syscalls (strace -c: 11 ``poll``, 8 ``ioctl`` for timeouts and the idle-peer peek, 5
``recvmsg``, 4 ``recvfrom``, 3 ``sendmsg``; 12 ``recvmsg_into`` a get without strace), now 8 (1 ``recvmsg``, 4
``recvfrom``, 3 ``sendmsg``); cProfile: ``recv_scatter``'s own Python 290 us a get, now 50. With ``tls_ca`` the
socket is wrapped in TLS (umbp/tls.py), keeps Python's timeout mode, and sends with ``sendall`` of coalesced
pieces and receives with ``recv_into`` per view (SSLSocket has no ``sendmsg``/``recvmsg_into``).

A connection a closed server evicts before it authenticated (request id 0, UNAVAILABLE: newer pre-auth
connections from the same address, umbp/admission.py) is opened again at once, up to ``_HANDSHAKE_TRIES`` times
within the deadline.
"""

from __future__ import annotations

import asyncio
import select
import socket
import ssl
import struct
import time
from typing import Any

from transport import answerrows, wire
from umbp.auth import ClientAuth
from umbp.config import split_host_port
from umbp.errors import AuthError, DeadlineExceeded, ProtocolError, RemoteError, TransportError, Unavailable
from umbp.tls import client_context

_IOV_MAX = 512
# recv_scatter: views this large are received on their own. Off (no view is): one recvmsg_into over a whole run of
# views took less CPU at every size measured on the 2-core VM (a 64-page tcp get, same run, three rounds: 256 KiB
# pages 3.7-3.9 -> 4.2-5.0 GB/s per client CPU second, 1 MiB 3.6-4.1 -> 5.0-5.2; wall no worse); the earlier
# measurement that set 256 KiB (many-iovec recvmsg a quarter slower into MiB-sized buffers) is to be redone on the
# 16-core machine (issue 45).
_BIG_VIEW = 1 << 62
_DISCARD = memoryview(bytearray(64 << 10))  # scratch for data that is received only to be dropped (never read)
_TLS_COALESCE = 256 << 10  # TLS sends: runs of smaller buffers are joined (one record) up to about this much
# what a receive raises when its deadline passed: waiting (timeout) or, past it, finding nothing more (non-blocking)
_LATE = (TimeoutError, socket.timeout, BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)
_WAITALL, _DONTWAIT, _PEEK = socket.MSG_WAITALL, socket.MSG_DONTWAIT, socket.MSG_PEEK
_TIMEVAL = struct.Struct("@ll")  # struct timeval (SO_RCVTIMEO / SO_SNDTIMEO)
_EXACT_TIMEO_S = 0.002  # below this much time left a socket timeout is set to all of it (above: half of it)
_REARM = 64  # bound on re-arming a socket timeout that ran out early (each try waits half the time left)
_HANDSHAKE_TRIES = 4  # connections tried when a server cap cuts one before it authenticated (an eviction)


def _advance(views: list, i: int, n: int) -> int:
    """Account for ``n`` bytes moved into (or out of) ``views`` from view ``i`` on: fully moved views are passed,
    a partly moved one is replaced by its rest. Returns the index of the first view not fully moved."""
    while n and i < len(views):
        m = len(views[i])
        if n >= m:
            n -= m
            i += 1
        else:
            views[i] = views[i][n:]
            n = 0
    return i


def connection_error(frame: wire.Frame, component: str) -> None:
    """An error frame with request id 0 is the server's word on the whole connection (a cap evicted it before it
    authenticated, its authentication deadline passed, the stream was unframeable): raise it as its RemoteError,
    marked ``whole_connection``. Otherwise return."""
    if frame.request_id == 0 and frame.status != wire.Status.OK and frame.flags & wire.F_RESPONSE:
        try:
            wire.raise_for_status(frame, component)
        except RemoteError as e:
            e.whole_connection = True
            raise


def _remaining(deadline: float, component: str) -> float:
    """Time left for a connect or a send: past the deadline nothing new is started (DeadlineExceeded)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded(component, "deadline exceeded")
    return left


def _read_timeout(deadline: float) -> float:
    """Socket timeout for a receive: the time left, or 0.0 (non-blocking) once the deadline has passed. A late
    receive still takes what has already arrived (an answer that sat in the socket buffer while another node of
    the batch used up the deadline is not thrown away); one that finds nothing more raises BlockingIOError (TLS:
    SSLWantReadError), which ``_fail`` turns into DeadlineExceeded."""
    return max(0.0, deadline - time.monotonic())


class FramedSocket:
    """A blocking connection carrying wire frames. Not thread-safe: callers serialise access.

    With ``hello`` (or a ``token``) the connection introduces itself right after connecting (HELLO, then AUTH with
    the token when the server asks: umbp/auth.py) and raises AuthError when the server refuses it, needs a token
    that was not given, or cannot prove it knows the token. Without either it says nothing: an open server serves
    it, a closed one answers its first request with AUTH "authentication required"."""

    def __init__(self, addr: str, component: str, deadline: float, token: str | None = None,
                 hello: bool = False, tls_ca: str = "", ktls: bool = False):
        self.ktls = ktls  # TLS: ask OpenSSL for kernel TLS (umbp/tls.py)
        self.addr = addr
        self.component = component
        self.tls = bool(tls_ca)
        self._hdr = bytearray(wire.HEADER_SIZE)
        self._hdr_mv = memoryview(self._hdr)
        self._meta = memoryview(bytearray(4096))  # meta of received frames (recv_meta), grown on demand
        host, port = split_host_port(addr, component)
        for attempt in range(_HANDSHAKE_TRIES):
            self._open(host, port, tls_ca, deadline)
            if token is None and not hello:
                return
            try:
                self.handshake(token, deadline)
                return
            except Unavailable as e:
                # The server cut this connection before it authenticated (request id 0): in a closed pool a newer
                # connection from this address evicted it (umbp/admission.py: a flood from here churns its own). A
                # new connection at once, a few times: the client gets in between the flood's connections. (A cap
                # that refuses answers the HELLO itself: raised as it is.)
                self.close()
                if (not getattr(e, "whole_connection", False) or attempt == _HANDSHAKE_TRIES - 1
                        or time.monotonic() >= deadline):
                    raise
            except BaseException:
                self.close()
                raise

    def _open(self, host: str, port: int, tls_ca: str, deadline: float) -> None:
        """Connect (and with ``tls_ca`` run the TLS handshake); the connection's state starts afresh."""
        try:
            self.sock = socket.create_connection((host, port), timeout=_remaining(deadline, self.component))
        except OSError as e:
            raise TransportError(self.component, f"cannot connect to {self.addr}: {e.strerror or e}") from e
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
            except OSError:
                pass
        if tls_ca:
            self._wrap_tls(host, tls_ca)
        else:
            self.sock.settimeout(None)  # blocking: one syscall per call, deadlines kept by SO_RCVTIMEO/SO_SNDTIMEO
        self._rto = self._sto = 0.0  # the socket's receive / send timeout now (0.0: none set, which blocks forever)
        self.packed_keys = False  # the server takes keyed requests' keys packed (its HELLO said so: wire.pack_keys)
        self.digest_keys = False  # and its LOOKUP, EXISTS and PREFIX take keys as their digests (wire.DIGEST_KEYS)
        self._next_id = 1
        self.closed = False

    def _wrap_tls(self, host: str, ca: str) -> None:
        """TLS client handshake (under the connect timeout), verifying the server's certificate against ``ca``
        and the dialled address. AuthError when it does not verify, TransportError when there is no TLS there."""
        raw = self.sock
        try:
            self.sock = client_context(ca, self.component, self.ktls).wrap_socket(raw, server_hostname=host)
        except ssl.SSLCertVerificationError as e:
            raw.close()
            raise AuthError(self.component, f"TLS: the certificate of {self.addr} does not verify against "
                                            f"{ca}: {e.verify_message}") from e
        except (ssl.SSLError, OSError) as e:
            raw.close()
            raise TransportError(self.component, f"TLS handshake with {self.addr} failed ({e}): does it serve "
                                                 f"TLS (--tls-cert)?") from e

    def handshake(self, token: str | None, deadline: float) -> str:
        """HELLO, then AUTH when the server asks for it; returns the scope the server granted."""
        auth = ClientAuth(token, self.component)
        try:
            hello = self.request(wire.Op.HELLO, auth.hello_meta(self.component), deadline)
        except TransportError as e:
            if self.tls or type(e) is not TransportError:
                raise
            raise TransportError(self.component, f"{e.detail} during HELLO: if it serves TLS, give the client "
                                                 f"its CA (tls_ca=, UMBP_TLS_CA, --tls-ca)") from e
        self.packed_keys = type(hello.meta) is dict and hello.meta.get(wire.PACKED_KEYS) is True
        self.digest_keys = self.packed_keys and hello.meta.get(wire.DIGEST_KEYS) is True
        meta = auth.auth_meta(hello.meta)
        if meta is None:
            return "open"
        return auth.check(self.request(wire.Op.AUTH, meta, deadline).meta)

    def peer_closed(self) -> bool:
        """True when the server closed this (idle) connection: a peek that finds EOF. Costs one syscall."""
        if self.tls:  # no peek through TLS; a server sends nothing unasked but a last error before it closes
            try:
                return bool(self.sock.pending() or select.select([self.sock], [], [], 0)[0])
            except (OSError, ValueError):
                return True
        try:
            return self.sock.recv(1, _PEEK | _DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

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
        if isinstance(e, _LATE):
            return DeadlineExceeded(self.component, f"{what} {self.addr}: deadline exceeded")
        if isinstance(e, TransportError):
            return e
        return TransportError(self.component, f"{what} {self.addr} failed: {e}")

    def _timeo(self, opt: int, left: float) -> float:
        """Set SO_RCVTIMEO or SO_SNDTIMEO to half of ``left`` (all of it below _EXACT_TIMEO_S) and return it: calls
        whose deadlines lie about as far out as the last one's (every call of a client with one ``timeout_s``) then
        find it set already, so a steady stream of calls costs no setsockopt."""
        t = left if left < _EXACT_TIMEO_S else left / 2
        sec = int(t)
        self.sock.setsockopt(socket.SOL_SOCKET, opt, _TIMEVAL.pack(sec, max(1, int((t - sec) * 1e6))))
        return t

    def _recv(self, fn, arg, deadline: float) -> int:
        """One receive ``fn(arg, flags)`` on a plain (blocking) socket: MSG_WAITALL under a receive timeout no
        longer than the time left, so one syscall fills a whole header or a run of views as the bytes arrive (no
        poll before it, no return to Python per socket buffer); past the deadline MSG_DONTWAIT (what has arrived,
        without waiting; BlockingIOError when nothing has). A timeout that ran out early (it is half the time left)
        is set again from the time now left."""
        for _ in range(_REARM):
            left = deadline - time.monotonic()
            if left <= 0:
                return fn(arg, _DONTWAIT)
            if not 0.0 < self._rto <= left:
                self._rto = self._timeo(socket.SO_RCVTIMEO, left)
            try:
                return fn(arg, _WAITALL)
            except BlockingIOError:
                self._rto = 0.0
        raise BlockingIOError("receive timeout re-armed too often")

    def send(self, bufs: list, deadline: float) -> None:
        """Send every buffer in order (partial sends continue from where the kernel stopped). Plain sockets block
        in ``sendmsg`` under a send timeout no longer than the time left."""
        try:
            views = [memoryview(b).cast("B") if not isinstance(b, bytes) else memoryview(b) for b in bufs]
            views = [v for v in views if len(v)]
            if self.tls:
                self.sock.settimeout(_remaining(deadline, self.component))
                self._send_tls(views)
                return
            sendmsg = self.sock.sendmsg
            i = 0  # first buffer not yet fully sent (an index, not pops: a batch may have thousands of parts)
            while i < len(views):
                left = _remaining(deadline, self.component)
                if not 0.0 < self._sto <= left:
                    self._sto = self._timeo(socket.SO_SNDTIMEO, left)
                try:
                    i = _advance(views, i, sendmsg(views[i:i + _IOV_MAX]))
                except BlockingIOError:
                    self._sto = 0.0  # the send timeout ran out early: set again from the time now left
        except (OSError, DeadlineExceeded) as e:
            raise self._fail(e, "send to") from e

    def _send_tls(self, views: list) -> None:
        """SSLSocket has no sendmsg: large buffers go out with sendall each, runs of small ones joined first (TLS
        copies every byte into a record anyway)."""
        run: list = []
        size = 0
        for v in views:
            if len(v) >= _TLS_COALESCE:
                if run:
                    self.sock.sendall(b"".join(run))
                    run, size = [], 0
                self.sock.sendall(v)
                continue
            run.append(v)
            size += len(v)
            if size >= _TLS_COALESCE:
                self.sock.sendall(b"".join(run))
                run, size = [], 0
        if run:
            self.sock.sendall(b"".join(run) if len(run) > 1 else run[0])

    def recv_exact(self, mv: memoryview, deadline: float) -> None:
        """Fill ``mv`` completely by ``deadline`` (past it: only with what has already arrived)."""
        pos, n = 0, len(mv)
        if self.tls:
            self.sock.settimeout(_read_timeout(deadline))
            recv = self.sock.recv_into
            while pos < n:
                got = recv(mv[pos:])
                if not got:
                    raise TransportError(self.component, f"{self.addr} closed the connection")
                pos += got
            return
        recv, call = self.sock.recv_into, self._recv
        while pos < n:
            got = call(lambda v, f: recv(v, 0, f), mv[pos:] if pos else mv, deadline)
            if not got:
                raise TransportError(self.component, f"{self.addr} closed the connection")
            pos += got

    def recv_scatter(self, views: list[memoryview], deadline: float) -> None:
        """Fill every view completely, in order: runs of small views with one ``recvmsg_into`` (MSG_WAITALL: one
        syscall for the run unless the deadline or a signal cuts it), a view of ``_BIG_VIEW`` or more with
        ``recv_into`` on its own (none at present: see ``_BIG_VIEW``). On failure the TransportError carries
        ``received``: how many bytes landed first (the views they filled are good)."""
        got = 0
        try:
            i, n = 0, len(views)
            if self.tls:  # SSLSocket has no recvmsg_into: one SSL_read (at most a 16 KiB record) per call
                self.sock.settimeout(_read_timeout(deadline))
                # the SSLObject's read itself: SSLSocket.recv_into adds two Python frames a record (about 1 us of
                # 10), and holds the GIL for them, which the other streams of a split batch wait for
                read = self.sock._sslobj.read
                while i < n:
                    v = views[i]
                    k = read(len(v), v)
                    if not k:
                        raise TransportError(self.component, f"{self.addr} closed the connection")
                    got += k
                    i = _advance(views, i, k)
                return
            recvmsg_into, recv_into, call = self.sock.recvmsg_into, self.sock.recv_into, self._recv
            one = lambda v, f: recv_into(v, 0, f)  # noqa: E731
            many = lambda vs, f: recvmsg_into(vs, 0, f)[0]  # noqa: E731
            while i < n:
                if len(views[i]) >= _BIG_VIEW:
                    k = call(one, views[i], deadline)
                else:
                    j = i + 1
                    while j < n and j - i < _IOV_MAX and len(views[j]) < _BIG_VIEW:
                        j += 1
                    k = call(many, views[i:j], deadline)
                if not k:
                    raise TransportError(self.component, f"{self.addr} closed the connection")
                got += k
                i = _advance(views, i, k)
        except (OSError, TransportError) as e:
            err = self._fail(e, "receive from")
            err.received = got
            if err is e:
                raise
            raise err from e

    def recv_header(self, deadline: float) -> tuple[int, int, int, int, int, int]:
        try:
            self.recv_exact(self._hdr_mv, deadline)
            return wire.decode_header(self._hdr_mv, self.component)
        except (OSError, TransportError, ProtocolError) as e:
            raise self._fail(e, "receive from") from e

    def recv_into(self, mv: memoryview, deadline: float) -> None:
        try:
            self.recv_exact(mv, deadline)
        except (OSError, TransportError) as e:
            raise self._fail(e, "receive from") from e

    def recv_meta(self, meta_len: int, deadline: float) -> Any:
        """Receive and decode ``meta_len`` bytes of meta into the reusable meta buffer (grown to the largest meta
        seen). Malformed meta closes the connection (its data would be left unread) and raises ProtocolError."""
        if not meta_len:
            return None
        if len(self._meta) < meta_len:
            self._meta = memoryview(bytearray(max(meta_len, 2 * len(self._meta))))
        mv = self._meta[:meta_len]
        self.recv_into(mv, deadline)
        try:
            return wire.unpack_meta(mv, self.component)
        except RemoteError as e:
            self.close()
            raise ProtocolError(self.component, f"unreadable answer from {self.addr}: {e.detail}") from e

    def discard(self, n: int, deadline: float) -> None:
        """Receive and drop ``n`` bytes (data of a refused answer) through a small fixed buffer: no memory follows
        the announced length."""
        try:
            while n:
                k = min(n, len(_DISCARD))
                self.recv_exact(_DISCARD[:k], deadline)
                n -= k
        except (OSError, TransportError, DeadlineExceeded) as e:
            raise self._fail(e, "receive from") from e

    def recv_frame(self, deadline: float) -> wire.Frame:
        """One frame: meta decoded from the reusable buffer, data (if any) into a fresh buffer of its length (the
        frames read this way, answers to control requests, carry none but small READ answers)."""
        op, flags, status, rid, meta_len, data_len = self.recv_header(deadline)
        meta = self.recv_meta(meta_len, deadline)
        data = None
        if data_len:
            data = memoryview(bytearray(data_len))
            self.recv_into(data, deadline)
        return wire.Frame(op, flags, status, rid, meta, data, data_len)

    def request(self, op: int, meta: Any, deadline: float, data: list | None = None) -> wire.Frame:
        """One request, one answer (raised as RemoteError when it is an error)."""
        rid = self.next_id()
        dlen = sum(len(memoryview(d).cast("B")) for d in data) if data else 0
        self.send([wire.encode(op, rid, meta, data_len=dlen)] + (data or []), deadline)
        frame = self.recv_frame(deadline)
        if frame.request_id != rid:
            self.close()
            connection_error(frame, self.component)
            raise ProtocolError(self.component, f"answer for request {frame.request_id}, expected {rid}")
        wire.raise_for_status(frame, self.component)
        if op == wire.Op.LOOKUP:
            answerrows.unpack_locs(frame.meta, self.component)  # packed rows (VERSION 12) as the ``locs`` list
        elif op == wire.Op.ALLOC:
            answerrows.unpack_allocs(frame.meta, self.component)  # packed rows (VERSION 12) as the ``items`` list
        return frame

    def send_noreply(self, op: int, meta: Any, deadline: float) -> None:
        self.send([wire.encode(op, self.next_id(), meta, flags=wire.Flag.NO_REPLY)], deadline)


async def ask_async(reader, writer, rid: int, op: int, meta: Any, timeout: float, component: str) -> Any:
    """One request on an asyncio stream that carries one request at a time (the node's link to the metaserver, the
    metaserver's disk-tier mover to a node): the frame out, its answer's meta back, an error answer raised as the
    wire says (``wire.raise_for_status``). Blocks up to ``timeout`` for each part of the answer."""
    writer.write(wire.encode(op, rid, meta))
    await writer.drain()
    head = await asyncio.wait_for(reader.readexactly(wire.HEADER_SIZE), timeout)
    rop, flags, status, arid, meta_len, data_len = wire.decode_header(head, component)
    body = await asyncio.wait_for(reader.readexactly(meta_len + data_len), timeout)
    frame = wire.Frame(rop, flags, status, arid, wire.unpack_meta(body[:meta_len], component) if meta_len else None,
                       None, 0)
    wire.raise_for_status(frame, component)
    return frame.meta


async def handshake_async(ask, token: str | None, name: str, component: str) -> str:
    """``FramedSocket.handshake`` over ``ask(op, meta)`` (an ``ask_async`` bound to a stream): HELLO, then AUTH when
    the peer asks for it; returns the scope granted ("open" without AUTH); AuthError when refused."""
    auth = ClientAuth(token, component)
    meta = auth.auth_meta(await ask(wire.Op.HELLO, auth.hello_meta(name)))
    if meta is None:
        return "open"
    return auth.check(await ask(wire.Op.AUTH, meta))
