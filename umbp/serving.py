"""The asyncio server protocol the metaserver and the storage node share (``FramedProtocol``): admission, framing,
and the refusals that come before a request reaches its handler.

A connection is admitted (``umbp.admission``: caps before and after authentication) when it is made; one a cap turns
away keeps its socket for ``REFUSED_LINGER_S`` so its first request can be answered UNAVAILABLE with the reason,
then closes. One still to authenticate is closed ``auth_timeout_s`` after connecting. Bytes land in the
``wire.FrameReader``'s buffer (``get_buffer``); every frame one receive completed goes to ``handle`` in order, then
``flush`` writes what the handlers queued (the node: one ``writelines``), and a bad frame header, answered after the
good frames before it, closes the connection (``unframeable``). Subclasses set ``reader``, ``admission``, ``conns``
and ``component`` and implement ``handle``, ``unframeable`` and, if they queue answers, ``flush``.

A leaf module: it imports the wire module, the error hierarchy and nothing else of UMBP. Costs: O(1) per connection
event, O(frames) per receive.
"""

from __future__ import annotations

import asyncio
import socket
import time

from transport import wire
from umbp.errors import ProtocolError

REFUSED_LINGER_S = 1.0  # a connection turned away by a cap waits this long for a request to answer, then closes


class FramedProtocol(asyncio.BufferedProtocol):
    transport: asyncio.Transport | None = None
    refused = ""  # why a cap turned this connection away (its next request is answered with it)
    last_active = 0.0
    _timer: asyncio.TimerHandle | None = None  # the authentication deadline, or the refused linger

    # -- subclass hooks ----------------------------------------------------------------------------------------
    def handle(self, frame: wire.Frame, err: Exception | None) -> None:
        raise NotImplementedError

    def unframeable(self, e: ProtocolError) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Write the answers the handlers of one receive queued (nothing by default: handlers write at once)."""

    # -- connection lifecycle ----------------------------------------------------------------------------------
    def admit(self, transport: asyncio.Transport) -> bool:
        """``connection_made``'s common part. False when a cap refused the connection (it lingers, see above)."""
        self.transport = transport
        self.last_active = time.monotonic()
        loop = asyncio.get_running_loop()
        self.refused = self.admission.admit(self) or ""
        if self.refused:
            self._timer = loop.call_later(REFUSED_LINGER_S, transport.close)
            return False
        self.conns.add(self)
        if self.admission.pending(self):
            self._timer = loop.call_later(self.admission.auth_timeout_s, self._auth_expired)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        return True

    def release(self) -> None:
        """``connection_lost``'s common part: out of the connection set, the caps and the timers."""
        self.conns.discard(self)
        self.admission.drop(self)
        if self._timer is not None:
            self._timer.cancel()

    def authenticated_now(self) -> str | None:
        """AUTH succeeded: the authentication deadline is off, and the connection moves to the authenticated cap;
        returns the refusal when that cap is full (the caller answers it and closes)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        return self.admission.authenticated(self)

    def _auth_expired(self) -> None:
        if self.admission.pending(self) and not self.transport.is_closing():
            self.transport.write(wire.encode_error(0, 0, wire.Status.AUTH, f"{self.component}: not authenticated "
                                                   f"within {self.admission.auth_timeout_s:g}s of connecting"))
            self.transport.close()

    # -- receiving ---------------------------------------------------------------------------------------------
    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.last_active = time.monotonic()
        try:
            frames = self.reader.buffer_updated(nbytes)
        except ProtocolError as e:
            self.unframeable(e)
            return
        if self.refused:
            self._answer_refused(frames)
            return
        handle = self.handle
        for frame, err in frames:
            handle(frame, err)
        self.flush()
        if self.reader.poisoned is not None:  # good frames answered first, then the bad header
            self.unframeable(self.reader.poisoned)

    def _answer_refused(self, frames: list) -> None:
        """A connection a cap turned away: its requests get UNAVAILABLE with the reason, then it closes."""
        self.transport.writelines([wire.encode_error(f.op, f.request_id, wire.Status.UNAVAILABLE, self.refused)
                                   for f, _err in frames if not f.flags & (wire.Flag.NO_REPLY | wire.Flag.RESPONSE)])
        if frames or self.reader.poisoned is not None:
            self.transport.close()
