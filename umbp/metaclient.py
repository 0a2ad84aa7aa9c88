"""Blocking connection to the metaserver that finds and follows the leader.

``MetaClient.call(op, meta, deadline)`` sends one request and returns the answer's meta. It tries the addresses it
knows (the configured list plus any leader named in a NOT_LEADER answer) until one leader answers or the deadline
passes; transport failures move on to the next address, UNAVAILABLE answers (a leader still loading, etcd briefly
away) ask the same one again, both after a short backoff (first pass over the list without one); every other error
is raised at once. Connection refused at every address, pass after pass (REFUSED_PASSES, about half a second of
backoff), fails the call at once with TransportError: nobody is listening, waiting out the deadline would not help
(a metaserver restarting on the same address is listening again within that). Connecting (with the handshake) is
bounded by CONNECT_S and one attempt's answer by ATTEMPT_S, so a frozen metaserver (SIGSTOP, a hung host) costs
that much, not the whole deadline, before the client tries the others. Retrying after a lost answer
is safe for COMMIT (a key already committed with this generation reports True again), LOOKUP (a fresh lease), the
directory-only requests and ALLOC (the client's allocation token gets the same places back). A call that runs out
of its deadline on one address leaves the next call starting at the next address, so a leader whose host went
silent (no RST) costs one call, not every call.

Pipelining (``submit`` then ``result``): several requests in flight on the one connection, answers matched by
request id (the metaserver may answer a COMMIT waiting on etcd after a later ALLOC). A batch put overlaps its
chunks' COMMITs with the next chunks' ALLOCs and writes this way. ``result`` is ``call``'s contract: when the
pipelined attempt fails for a retryable reason (connection lost, NOT_LEADER, UNAVAILABLE, no answer in time) it
falls back to ``call`` for that request, which is safe for the idempotent requests pipelined (ALLOC with a token,
COMMIT, LOOKUP).

A LOOKUP answer comes back as ``umbp.lookup.LookupAnswer``: its packed rows as one array, the per-key ``locs``
list made only when asked for. An ALLOC answer's packed rows (wire VERSION 12) come back as the ``items`` list the
put path reads (``[NEW, node, off, size, gen, tag, cap index]`` or ``[state, None, ...]`` a key).

Thread-safe: one lock serialises use of the single connection (a client issues one metaserver call per batch).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from transport import wire
from transport.framed import FramedSocket, connection_error
from umbp.errors import DeadlineExceeded, NotLeader, ProtocolError, TransportError, Unavailable
from umbp.lookup import alloc_rows, answer_rows

_RETRY_SLEEP = (0.05, 0.1, 0.2, 0.3, 0.5)
ATTEMPT_S = 5.0  # one request's answer, unless the call's deadline is nearer
CONNECT_S = 2.0  # connecting and the handshake: a black-holed host (no RST) costs this, not ATTEMPT_S
REFUSED_PASSES = 4  # connection refused at every address this many times in a row: fail now (about 0.5 s)


def _packed(conn: FramedSocket, op: int, meta: Any) -> Any:
    """``meta`` as sent to ``conn``'s metaserver: keys packed where its HELLO said it takes them, and as their digests
    for a LOOKUP, EXISTS or PREFIX where it said it finds them so (``wire.pack_keys``)."""
    if not conn.packed_keys:
        return meta
    return wire.pack_keys(meta, conn.digest_keys and op in wire.DIGEST_OPS)


def _answer(op: int, meta: Any, component: str) -> Any:
    """An answer's meta as callers read it: a LOOKUP's packed rows as one array (``umbp.lookup``), an ALLOC's
    checked rows as one array with its ``items`` list made when read (``umbp.lookup.AllocAnswer``); others as they
    came."""
    if op == wire.Op.LOOKUP:
        return answer_rows(meta, component)
    if op == wire.Op.ALLOC:
        return alloc_rows(meta, component)  # items made when read (umbp.lookup.AllocAnswer)
    return meta


class Ticket:
    """A request sent by ``MetaClient.submit`` whose answer ``MetaClient.result`` collects."""

    __slots__ = ("op", "meta", "rid", "conn")

    def __init__(self, op: int, meta: Any):
        self.op = op
        self.meta = meta
        self.rid = 0
        self.conn: FramedSocket | None = None  # None: not sent (result() makes the full call)


class MetaClient:
    def __init__(self, addrs: tuple[str, ...] | list[str], component: str = "client", token: str | None = None,
                 tls_ca: str = "", follow: bool = True):
        self.addrs = list(addrs)
        self.follow = follow  # False: a NOT_LEADER answer is raised (umbp/slotrouter.py re-routes by slot itself)
        self.component = component
        self.token = token
        self.tls_ca = tls_ca  # speak TLS, verifying the metaservers' certificates against this CA bundle
        self._conn: FramedSocket | None = None
        self._idx = 0
        self._lock = threading.RLock()
        self._waiting: dict[int, Ticket | None] = {}  # request id -> ticket awaiting its answer (None: forgotten)
        self._inbox: dict[int, wire.Frame] = {}  # answers that arrived while another one was awaited
        self.sent: dict[int, int] = {}  # requests sent per opcode, retries included (observability, tests)

    @property
    def address(self) -> str | None:
        return self._conn.addr if self._conn is not None and not self._conn.closed else None

    def _connect(self, deadline: float) -> FramedSocket:
        if self._conn is not None and not self._conn.closed:
            return self._conn
        addr = self.addrs[self._idx % len(self.addrs)]
        connect_by = min(deadline, time.monotonic() + CONNECT_S)
        self._conn = FramedSocket(addr, f"{self.component} metaserver {addr}", connect_by, self.token, hello=True,
                                  tls_ca=self.tls_ca)
        return self._conn

    def call(self, op: int, meta: Any, deadline: float) -> Any:
        with self._lock:
            attempt = 0
            refused = 0  # consecutive connection refusals: nobody listens at any address
            last: Exception | None = None
            while True:
                attempt_end = min(deadline, time.monotonic() + ATTEMPT_S)
                try:
                    conn = self._connect(attempt_end)
                    self.sent[op] = self.sent.get(op, 0) + 1
                    return self._roundtrip(conn, op, meta, attempt_end)
                except NotLeader as e:
                    if not self.follow:
                        raise
                    last, refused = e, 0
                    self._drop()
                    if e.leader:
                        if e.leader not in self.addrs:
                            self.addrs.append(e.leader)
                        self._idx = self.addrs.index(e.leader)
                    else:
                        self._idx += 1
                except DeadlineExceeded as e:
                    refused = 0
                    self._drop()
                    self._idx += 1  # this address did not answer in time: the next attempt (or call) tries another
                    if attempt_end >= deadline:
                        raise
                    last = e  # only this attempt's bound: try the others
                except Unavailable as e:
                    last, refused = e, 0
                    attempt = max(attempt, len(self.addrs))  # same address again, after a backoff ...
                    if attempt % 4 == 3:  # ... but not forever: it may be one cut off from etcd
                        self._drop()
                        self._idx += 1
                except TransportError as e:
                    last = e
                    self._drop()
                    self._idx += 1
                    if isinstance(e.__cause__, ConnectionRefusedError):
                        refused += 1
                        if refused >= REFUSED_PASSES * len(self.addrs):
                            raise TransportError(self.component, f"no metaserver is listening at "
                                                                 f"{', '.join(self.addrs)} (connection refused "
                                                                 f"{refused} times)") from e
                    else:
                        refused = 0
                if time.monotonic() + _RETRY_SLEEP[min(attempt, 4)] >= deadline:
                    raise DeadlineExceeded(self.component, f"no metaserver leader answered before the deadline "
                                                           f"(tried {', '.join(self.addrs)}; last error: {last})")
                time.sleep(_RETRY_SLEEP[min(attempt, 4)] if attempt >= len(self.addrs) else 0)
                attempt += 1

    def _roundtrip(self, conn: FramedSocket, op: int, meta: Any, deadline: float) -> Any:
        rid = conn.next_id()
        conn.send([wire.encode(op, rid, _packed(conn, op, meta))], deadline)
        frame = self._await(conn, rid, deadline)
        wire.raise_for_status(frame, conn.component)
        return _answer(op, frame.meta, conn.component)

    def _await(self, conn: FramedSocket, rid: int, deadline: float) -> wire.Frame:
        """The answer to ``rid``; answers to other outstanding requests that come first are kept for them."""
        frame = self._inbox.pop(rid, None)
        while frame is None:
            got = conn.recv_frame(deadline)
            if got.request_id == rid:
                return got
            if got.request_id not in self._waiting:
                conn.close()
                connection_error(got, conn.component)
                raise ProtocolError(conn.component, f"answer for request {got.request_id}, expected {rid}")
            if self._waiting[got.request_id] is not None:
                self._inbox[got.request_id] = got
            else:
                del self._waiting[got.request_id]  # forgotten: its answer is dropped
        return frame

    def submit(self, op: int, meta: Any, deadline: float) -> Ticket:
        """Send a request and return at once; ``result`` waits for its answer. Never raises: a request that could
        not be sent is made in full by ``result``."""
        t = Ticket(op, meta)
        with self._lock:
            try:
                conn = self._connect(min(deadline, time.monotonic() + CONNECT_S))
                t.rid = conn.next_id()
                self.sent[op] = self.sent.get(op, 0) + 1
                conn.send([wire.encode(op, t.rid, _packed(conn, op, meta))], deadline)
            except TransportError:
                self._drop()
                return t
            t.conn = conn
            self._waiting[t.rid] = t
        return t

    def result(self, t: Ticket, deadline: float) -> Any:
        """The answer's meta for a submitted request (``call``'s contract: raises what ``call`` raises)."""
        with self._lock:
            if t.conn is not None and t.conn is self._conn and not t.conn.closed:
                try:
                    frame = self._await(t.conn, t.rid, min(deadline, time.monotonic() + ATTEMPT_S))
                    self._waiting.pop(t.rid, None)
                    wire.raise_for_status(frame, t.conn.component)
                    return _answer(t.op, frame.meta, t.conn.component)
                except (NotLeader, Unavailable, TransportError, ProtocolError) as e:
                    self._waiting.pop(t.rid, None)
                    if time.monotonic() >= deadline or (isinstance(e, NotLeader) and not self.follow):
                        raise  # not following: resending to the same process would only be refused again
                    if t.conn is self._conn and t.conn.closed:
                        self._drop()
                    # retried in full below (a NOT_LEADER or UNAVAILABLE answer keeps the connection for call)
            t.conn = None
            return self.call(t.op, t.meta, deadline)

    def forget(self, tickets) -> None:
        """Give up on submitted requests (an error elsewhere ended the batch): their answers are dropped."""
        with self._lock:
            for t in tickets:
                if t.conn is not None and t.conn is self._conn and t.rid in self._waiting:
                    if self._inbox.pop(t.rid, None) is not None:
                        del self._waiting[t.rid]
                    else:
                        self._waiting[t.rid] = None
                t.conn = None

    def send_noreply(self, op: int, meta: Any, deadline: float) -> None:
        """Fire and forget (lease releases): never retried, never raises on transport failure."""
        with self._lock:
            try:
                self._connect(deadline).send_noreply(op, meta, deadline)
            except TransportError:
                self._drop()

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._waiting.clear()  # their answers can no longer come: result() retries them in full
        self._inbox.clear()

    def close(self) -> None:
        with self._lock:
            self._drop()
