"""Connection admission for the servers (metaserver, storage node): caps on connections before and after
authentication. Sans-I/O bookkeeping: the protocol calls ``admit`` when a TCP connection is accepted (before any
TLS handshake), ``authenticated`` when its AUTH succeeds and ``drop`` when it is lost; ``admit`` returns the refusal
message (the protocol answers the peer's next request with UNAVAILABLE carrying it, then closes) or None. When
admissions went past a pre-auth cap (``unsettled``) the protocol calls ``settle`` a moment later and tells the
connections it returns why, then closes them.

Why two caps: PING and HELLO are served before AUTH, so in a closed pool anyone who reaches the port could keep
connections alive without a token. Those count against ``preauth`` (small, default 16) and are closed
``auth_timeout_s`` after the TCP accept unless they authenticated (the protocol arms that timer; a TLS handshake
runs inside it); only authenticated connections count against ``max_connections``, so a peer without a token cannot
keep a client with one out. In an open pool every connection is authenticated from the start and only
``max_connections`` applies.

Pre-auth connections are never refused: a newcomer always gets a slot, so a client with a token always gets in
(its HELLO and AUTH take a round trip or two). Past the caps, connections are evicted: of an address that holds
more than ``per_source`` pre-auth connections, its own; while the pool holds more than ``preauth``, the busiest
address's: addresses share the pool fairly and one that floods churns only its own connections. Of the chosen
address the victim is the one that got least far (``conn.preauth_rank()``: 0 sent nothing, 1 sent bytes, e.g. a
TLS ClientHello, 2 sent a HELLO or a FENCE), the oldest of those: tokenless sockets that reconnect as soon as they
are closed, or TLS handshakes that never finish, evict each other, never a client that has spoken. Evictions wait
a moment after the admissions (``settle``, umbp/serving.py SETTLE_S): an event loop accepts a burst of connections
before it reads any of them, and a client's HELLO, already in its socket by then, is read meanwhile. What this
cannot do: tell a client from a peer of the same address that sends HELLOs as fast as it can; those share the
address's slots, oldest evicted first (a client needs one round trip between its HELLO and its AUTH to stay; one
evicted connects again: transport/framed.py).

A connection a cap refuses (open pool or the authenticated cap) lingers a moment to be told why; at most
``MAX_LINGERING`` do at a time, the rest are closed at once (a flood of refusals holds no file descriptors).

A leaf module (imports nothing of UMBP), shared by the metaserver and the node like umbp/auth.py. Costs: O(1) per
call; ``settle``: O(preauth) an eviction (a scan of the addresses and of one address's connections, each asked
its rank: one getsockopt).
"""

from __future__ import annotations

MAX_LINGERING = 64  # refused connections waiting to be told why, at most (more are closed without an answer)


class Admission:
    def __init__(self, component: str, closed: bool, max_connections: int, preauth: int, auth_timeout_s: float,
                 per_source: int = 0):
        self.component = component
        self.closed = closed
        self.max_connections = max_connections
        self.preauth_cap = preauth
        self.per_source = min(per_source or preauth, preauth)
        self.auth_timeout_s = auth_timeout_s
        self.authed: set = set()  # connections that count against max_connections
        self.preauth: dict = {}  # connection still to authenticate (closed pools only) -> its source address
        self.sources: dict[str, dict] = {}  # source address -> its pre-auth connections (a dict: oldest first)
        self.lingering = 0  # refused connections lingering to answer (the protocol counts them in and out)
        self.unsettled = False  # admissions went past a cap: ``settle`` is due
        self.settling = False  # the protocol scheduled it
        self.evictions = 0  # pre-auth connections evicted to admit newer ones (observability, tests)

    def _full(self) -> str:
        return (f"{self.component}: too many connections (max_connections {self.max_connections} reached); "
                f"try again later")

    def admit(self, conn, source: str = "") -> str | None:
        """A new connection from ``source`` (its IP address): None when admitted, else why not (a message naming
        the cap; never for a pre-auth connection: it is admitted and ``settle`` later makes room)."""
        if self.closed:
            self.preauth[conn] = source
            group = self.sources.setdefault(source, {})
            group[conn] = None
            if len(group) > self.per_source or len(self.preauth) > self.preauth_cap:
                self.unsettled = True
            return None
        if len(self.authed) >= self.max_connections:
            return self._full()
        self.authed.add(conn)
        return None

    def settle(self) -> list:
        """The pre-auth connections to evict so that every address is within ``per_source`` and the pool within
        ``preauth``: of each address past its cap, then of the busiest address while the pool is past its own,
        the one that got least far. They are forgotten here; the caller tells them why and closes them. Called a
        moment after the admissions that went past a cap (``unsettled``), so the newcomers' first bytes (a
        client's HELLO) have been read by then and count."""
        self.unsettled = False
        victims = []
        for group in list(self.sources.values()):
            while len(group) > self.per_source:
                victims.append(self._evict(group))
        while len(self.preauth) > self.preauth_cap:
            victims.append(self._evict(max(self.sources.values(), key=len)))
        return victims

    def _evict(self, group: dict):
        victim = _least_far(group)
        self._forget(victim)
        self.evictions += 1
        return victim

    def evicted_message(self, source: str) -> str:
        """What an evicted connection is told (its source, the caps, what to do)."""
        return (f"{self.component}: too many unauthenticated connections (preauth_connections {self.preauth_cap}, "
                f"preauth_per_source {self.per_source} from {source or 'one address'}): this one was closed to "
                f"admit a newer one; authenticate (HELLO, AUTH) right after connecting, or try again")

    def authenticated(self, conn) -> str | None:
        """AUTH succeeded: the connection moves to the authenticated cap (None), or is refused when that is full."""
        if conn in self.authed:
            return None
        self._forget(conn)
        if len(self.authed) >= self.max_connections:
            return self._full()
        self.authed.add(conn)
        return None

    def pending(self, conn) -> bool:
        """Still to authenticate (its deadline applies)."""
        return conn in self.preauth

    def drop(self, conn) -> None:
        self.authed.discard(conn)
        self._forget(conn)

    def _forget(self, conn) -> None:
        source = self.preauth.pop(conn, None)
        if source is not None:
            group = self.sources[source]
            del group[conn]
            if not group:
                del self.sources[source]

    def __len__(self) -> int:
        return len(self.authed) + len(self.preauth)


def _least_far(group: dict):
    """The connection of ``group`` (oldest first) that got least far towards authenticating, the oldest of those."""
    best, best_rank = None, 3
    for conn in group:
        rank = conn.preauth_rank()
        if rank < best_rank:
            best, best_rank = conn, rank
            if rank == 0:
                break
    return best
