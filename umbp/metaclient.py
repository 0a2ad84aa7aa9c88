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

Thread-safe: one lock serialises use of the single connection (a client issues one metaserver call per batch).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from transport.tcp import FramedSocket
from umbp.errors import DeadlineExceeded, NotLeader, TransportError, Unavailable

_RETRY_SLEEP = (0.05, 0.1, 0.2, 0.3, 0.5)
ATTEMPT_S = 5.0  # one request's answer, unless the call's deadline is nearer
CONNECT_S = 2.0  # connecting and the handshake: a black-holed host (no RST) costs this, not ATTEMPT_S
REFUSED_PASSES = 4  # connection refused at every address this many times in a row: fail now (about 0.5 s)


class MetaClient:
    def __init__(self, addrs: tuple[str, ...] | list[str], component: str = "client", token: str | None = None):
        self.addrs = list(addrs)
        self.component = component
        self.token = token
        self._conn: FramedSocket | None = None
        self._idx = 0
        self._lock = threading.Lock()
        self.sent: dict[int, int] = {}  # requests sent per opcode, retries included (observability, tests)

    @property
    def address(self) -> str | None:
        return self._conn.addr if self._conn is not None and not self._conn.closed else None

    def _connect(self, deadline: float) -> FramedSocket:
        if self._conn is not None and not self._conn.closed:
            return self._conn
        addr = self.addrs[self._idx % len(self.addrs)]
        connect_by = min(deadline, time.monotonic() + CONNECT_S)
        self._conn = FramedSocket(addr, f"{self.component} metaserver {addr}", connect_by, self.token, hello=True)
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
                    return conn.request(op, meta, attempt_end).meta
                except NotLeader as e:
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

    def close(self) -> None:
        with self._lock:
            self._drop()
