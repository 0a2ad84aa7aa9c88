"""The asyncio server protocol the metaserver and the storage node share (``FramedProtocol``): admission, TLS,
framing, and the refusals that come before a request reaches its handler.

A connection is admitted (``umbp.admission``: caps before and after authentication, per source address) when the
TCP connection is accepted, before any TLS handshake: a handshake is pre-auth work like any other, counted against
the pre-auth cap and inside the authentication deadline (``auth_timeout_s`` from the accept, handshake included).
With ``tls`` the protocol then runs the server side of the handshake itself (the event loop's own TLS protocol,
set up at once) and serves the encrypted transport once it completes (``ready``). Pre-auth connections past a cap
are evicted ``SETTLE_S`` after the admissions (the least far first: umbp/admission.py), each told why (UNAVAILABLE,
request id 0) and closed; one still in its handshake is just closed. One the authenticated cap refuses keeps its
socket for ``REFUSED_LINGER_S`` so its first request can be answered UNAVAILABLE with the reason, then closes.

Until it authenticates a connection may announce frames of at most ``PREAUTH_MAX_META`` bytes of meta and no data
(HELLO, AUTH, PING and FENCE need a few hundred): a bigger header is answered AUTH (authenticate first) and the
connection closed before a byte of its meta is buffered; after AUTH the server's own limits apply. Bytes land in the ``wire.FrameReader``'s buffer
(``get_buffer``); every frame one receive completed goes to ``handle`` in order, then ``flush`` writes what the
handlers queued (the node: one ``writelines``), and a bad frame header, answered after the good frames before it,
closes the connection (``unframeable``). Subclasses set ``reader``, ``admission``, ``conns``, ``component`` and
``tls``, call ``admit`` from ``connection_made``, and implement ``handle``, ``unframeable``, ``connection_lost``
(starting with ``release``) and, if they need them, ``flush`` and ``ready``.

Memory given back: connection buffers freed by closed connections (a flood's) add up; past ``TRIM_AFTER`` bytes
glibc is asked to return its free pages (``umbp.tls.trim_malloc``), at most once per ``TRIM_DELAY_S``. The servers
raise their own open-file soft limit to the hard limit at start (``raise_file_limit``).

A leaf module: it imports the wire module, the error hierarchy, umbp.admission and umbp.tls, nothing else of
UMBP. Costs: O(1) per connection event (an eviction: O(preauth)), O(frames) per receive.
"""

from __future__ import annotations

import asyncio
import resource
import socket
import ssl
import struct
import time

from transport import wire
from umbp.admission import MAX_LINGERING
from umbp.errors import FrameTooLarge, ProtocolError
from umbp.tls import trim_malloc

REFUSED_LINGER_S = 1.0  # a connection turned away by a cap waits this long for a request to answer, then closes
# Evictions past a pre-auth cap wait this long after the admission (a timer: on uvloop and on asyncio's loop the
# connections' first reads, a client's HELLO already in its socket, are processed before it fires)
SETTLE_S = 0.005
UNSETTLED_MAX = 2  # ... unless the pre-auth pool holds this many times its cap meanwhile: then at once
PREAUTH_MAX_META = 16 << 10  # meta a peer may announce before it authenticates (the staging buffer never grows)
TRIM_AFTER = 32 << 20  # connection buffers freed since the last trim that call for a malloc_trim ...
TRIM_DELAY_S = 1.0  # ... this long after the first of them (a flood: one trim a second at most)
TLS_CONN_BYTES = 256 << 10  # what a TLS connection holds besides its reader (the event loop's TLS read buffer)
_INTRODUCTIONS = (wire.Op.HELLO, wire.Op.FENCE)  # what a peer that means to authenticate (or fence) sends first
_TCP_INFO = getattr(socket, "TCP_INFO", 11)
_BYTES_RECEIVED = struct.Struct("=Q")  # struct tcp_info's tcpi_bytes_received (Linux 4.1+) ...
_BYTES_RECEIVED_AT = 128  # ... at this offset


def bytes_received(sock) -> int:
    """Bytes the kernel received from the peer of ``sock`` (read or not: a request or a TLS ClientHello still
    queued counts), or -1 when the kernel does not say (not Linux, a closed socket)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 256)
    except (OSError, AttributeError, ValueError):
        return -1
    if len(info) < _BYTES_RECEIVED_AT + 8:
        return -1
    return _BYTES_RECEIVED.unpack_from(info, _BYTES_RECEIVED_AT)[0]


def raise_file_limit() -> tuple[int, int]:
    """Raise this process's open-file soft limit (RLIMIT_NOFILE) to its hard limit, so that a connection flood
    meets the pre-auth cap, not the common default of 1,024 descriptors (accept failing for everyone). Returns
    (before, after); they are equal when there was nothing to raise or the kernel refused."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return soft, soft
    targets = [hard] if hard != resource.RLIM_INFINITY else [1 << 20, 1 << 16]  # fs.nr_open caps "unlimited"
    for target in targets:
        if target <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return soft, target
        except (ValueError, OSError):
            continue
    return soft, soft


def _ssl_protocol(loop: asyncio.AbstractEventLoop) -> type:
    """The event loop's own TLS protocol class (uvloop's is compiled, and its transports have a fast path for it)."""
    try:
        import uvloop.loop

        if isinstance(loop, uvloop.Loop):
            return uvloop.loop.SSLProtocol
    except ImportError:
        pass
    from asyncio.sslproto import SSLProtocol

    return SSLProtocol


def _settle(admission) -> None:
    """Evict what the admissions of the last moment put past a pre-auth cap (``Admission.settle``)."""
    admission.settling = False  # a timer still pending finds nothing to do, or the next burst's work
    for victim in admission.settle():
        victim.evict(admission.evicted_message(victim.source))


class _Trim:
    """Process-wide (malloc_trim acts on the whole process): bytes of connection buffers freed since the last
    trim, and the trim scheduled for them."""

    freed = 0
    handle: asyncio.TimerHandle | None = None
    loop: asyncio.AbstractEventLoop | None = None  # the handle's (a test may run servers in several loops)

    @classmethod
    def note(cls, nbytes: int) -> None:
        cls.freed += nbytes
        if cls.freed < TRIM_AFTER:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (shutting down): nothing more will be freed by this server
            return
        if cls.handle is None or cls.loop is not loop:
            cls.handle, cls.loop = loop.call_later(TRIM_DELAY_S, cls.run), loop

    @classmethod
    def run(cls) -> None:
        cls.handle = None
        cls.freed = 0
        trim_malloc()


class FramedProtocol(asyncio.BufferedProtocol):
    transport: asyncio.Transport | None = None
    tls: ssl.SSLContext | None = None  # serve TLS: the handshake runs after admission, inside the auth deadline
    handshaking = False  # a TLS handshake is under way (``transport`` is the raw TCP one: nothing may be written)
    refused = ""  # why a cap turned this connection away (its next request is answered with it)
    last_active = 0.0
    source = ""  # the peer's IP address (admission counts pre-auth connections per source)
    _timer: asyncio.TimerHandle | None = None  # the authentication deadline, or the refused linger
    _limits: tuple[int, int] | None = None  # the reader's own (max_meta, max_data) while pre-auth ones apply
    _sock = None  # the TCP socket (the kernel's byte count of a pre-auth connection)
    _lingers = False  # counted in ``admission.lingering``
    _released = False
    _spoke = False  # sent a HELLO or a FENCE before authenticating (``preauth_rank``)

    # -- subclass hooks ----------------------------------------------------------------------------------------
    def handle(self, frame: wire.Frame, err: Exception | None) -> None:
        raise NotImplementedError

    def unframeable(self, e: ProtocolError) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Write the answers the handlers of one receive queued (nothing by default: handlers write at once)."""

    def ready(self) -> None:
        """``transport`` is the one requests arrive on (after the TLS handshake, if any): set it up."""

    # -- connection lifecycle ----------------------------------------------------------------------------------
    def admit(self, transport: asyncio.Transport) -> bool:
        """``connection_made``'s common part. False when a cap refused the connection (it lingers, see above).
        With TLS it is called twice: by the event loop with the TCP transport (admission), then by the TLS protocol
        with the encrypted one once the handshake is done (before it hands over the first bytes)."""
        if self.handshaking:
            self.handshaking = False
            self.transport = transport
            if not self.refused:
                self.ready()
            return not self.refused
        self.transport = transport
        self.last_active = time.monotonic()
        loop = asyncio.get_running_loop()
        sock = self._sock = transport.get_extra_info("socket")
        peer = transport.get_extra_info("peername")
        self.source = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        admission = self.admission
        self.refused = admission.admit(self, self.source) or ""
        if self.refused:
            if admission.lingering >= MAX_LINGERING:
                transport.abort()  # enough are waiting to be told already: this one is not
                return False
            admission.lingering += 1
            self._lingers = True
            self._timer = loop.call_later(REFUSED_LINGER_S, transport.close)
        else:
            self.conns.add(self)
            if admission.pending(self):
                self._timer = loop.call_later(admission.auth_timeout_s, self._auth_expired)
                r = self.reader
                self._limits = (r.max_meta, r.max_data)
                r.max_meta, r.max_data = min(r.max_meta, PREAUTH_MAX_META), 0
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        if self.tls is not None:
            self._start_tls(transport, loop)
        elif not self.refused:
            self.ready()
        if admission.unsettled:  # last: this connection, set up, may be the one evicted
            if len(admission.preauth) > UNSETTLED_MAX * admission.preauth_cap:
                _settle(admission)  # a burst of thousands: no waiting for reads (each a handshake's memory)
            elif not admission.settling:
                admission.settling = True  # one settle for the accepts of the next moment, after their first reads
                loop.call_later(SETTLE_S, _settle, admission)
        return not self.refused

    def _start_tls(self, raw: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        """The server side of a TLS handshake on ``raw``, set up now (``loop.start_tls`` does the same from a
        coroutine, one loop pass later: uvloop reads the socket right after ``connection_made``, and the
        ClientHello would reach this protocol as a frame). The TLS protocol calls ``connection_made`` with the
        encrypted transport when the handshake is done (and ``connection_lost`` from then on)."""
        self.handshaking = True
        waiter = loop.create_future()
        tls = _ssl_protocol(loop)(loop, self, self.tls, waiter, server_side=True, server_hostname=None,
                                  call_connection_made=True, ssl_handshake_timeout=self.admission.auth_timeout_s)
        raw.set_protocol(tls)
        tls.connection_made(raw)
        waiter.add_done_callback(lambda w: self._handshake_ended(w, raw))

    def _handshake_ended(self, waiter: asyncio.Future, raw: asyncio.Transport) -> None:
        """The handshake's waiter is done: nothing to do when it succeeded (``connection_made`` came); one that
        failed, timed out or was cut (eviction, the auth deadline) ends the connection, which the TLS protocol
        does not report (it reports only the loss of a connection it handed over)."""
        if not self.handshaking:
            return
        self.handshaking = False
        err = None if waiter.cancelled() else waiter.exception()
        if not raw.is_closing():
            raw.abort()
        if not self._released:
            self.connection_lost(err)

    def release(self) -> bool:
        """``connection_lost``'s common part: out of the connection set, the caps and the timers. False when the
        connection was released already (a TLS handshake that failed may report its loss twice)."""
        if self._released:
            return False
        self._released = True
        self.conns.discard(self)
        if self._limits is not None or self.tls is not None:  # never authenticated, or TLS: a flood's memory
            _Trim.note(self.reader.buffered + (TLS_CONN_BYTES if self.tls is not None else 0))
        elif self.reader.buffered > 1 << 20:
            _Trim.note(self.reader.buffered)
        self.admission.drop(self)
        if self._lingers:
            self._lingers = False
            self.admission.lingering -= 1
        if self._timer is not None:
            self._timer.cancel()
        return True

    def authenticated_now(self) -> str | None:
        """AUTH succeeded: the authentication deadline is off, the reader's own frame limits apply again, and the
        connection moves to the authenticated cap; returns the refusal when that cap is full (the caller answers it
        and closes)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._limits is not None:
            self.reader.max_meta, self.reader.max_data = self._limits
            self._limits = None
        return self.admission.authenticated(self)

    def preauth_rank(self) -> int:
        """How far this pre-auth connection got (admission evicts the least far first): 2 sent a HELLO (a client
        about to AUTH) or a FENCE (a slot leader's, MAC'd), 1 sent bytes (the kernel's count: a TLS ClientHello, a
        request not read yet), 0 nothing yet."""
        if self._spoke:
            return 2
        return 1 if self._sock is not None and bytes_received(self._sock) > 0 else 0

    def evict(self, message: str) -> None:
        """Admission dropped this pre-auth connection for a newer one: tell it why (unless its TLS handshake is not
        done: nothing can be said), then close."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        tr = self.transport
        if tr is None or tr.is_closing():
            return
        if self.handshaking:
            tr.abort()
            return
        tr.write(wire.encode_error(0, 0, wire.Status.UNAVAILABLE, message, version=self.reader.version))
        tr.close()

    def _auth_expired(self) -> None:
        if self.admission.pending(self) and not self.transport.is_closing():
            if self.handshaking:
                self.transport.abort()  # the deadline counts the handshake; nothing can be said in clear
                return
            self.transport.write(wire.encode_error(0, 0, wire.Status.AUTH, f"{self.component}: not authenticated "
                                                   f"within {self.admission.auth_timeout_s:g}s of connecting",
                                                   version=self.reader.version))
            self.transport.close()

    # -- receiving ---------------------------------------------------------------------------------------------
    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.last_active = time.monotonic()
        try:
            frames = self.reader.buffer_updated(nbytes)
        except ProtocolError as e:
            self._unframeable(e)
            return
        if self.refused:
            self._answer_refused(frames)
            return
        if self._limits is not None and not self._spoke:  # pre-auth: did it introduce itself?
            self._spoke = any(f.op in _INTRODUCTIONS for f, _err in frames)
        handle = self.handle
        for frame, err in frames:
            handle(frame, err)
        self.flush()
        if self.reader.poisoned is not None:  # good frames answered first, then the bad header
            self._unframeable(self.reader.poisoned)

    def _unframeable(self, e: ProtocolError) -> None:
        """A header the reader refused: before AUTH one over the pre-auth limits is answered AUTH (authenticate
        first), then the connection closes; anything else is the subclass's ``unframeable``."""
        if self._limits is None or not isinstance(e, FrameTooLarge) or self.transport.is_closing():
            self.unframeable(e)
            return
        self.transport.write(wire.encode_error(0, 0, wire.Status.AUTH, (
            f"{self.component}: authentication required (HELLO, then AUTH) before a frame with data or more than "
            f"{PREAUTH_MAX_META} bytes of meta ({e.detail})"), version=self.reader.version))
        self.transport.close()

    def _answer_refused(self, frames: list) -> None:
        """A connection a cap turned away: its requests get UNAVAILABLE with the reason, then it closes."""
        v = self.reader.version
        self.transport.writelines([wire.encode_error(f.op, f.request_id, wire.Status.UNAVAILABLE, self.refused,
                                                     version=v)
                                   for f, _err in frames if not f.flags & (wire.F_NO_REPLY | wire.F_RESPONSE)])
        if frames or self.reader.poisoned is not None:
            self.transport.close()
