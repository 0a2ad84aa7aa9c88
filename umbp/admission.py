"""Connection admission for the servers (metaserver, storage node): caps on connections before and after
authentication. Sans-I/O bookkeeping: the protocol calls ``admit`` when a TCP connection is accepted (before any
TLS handshake), ``authenticated`` when its AUTH succeeds and ``drop`` when it is lost; ``admit`` returns the refusal
message (the protocol answers the peer's next request with UNAVAILABLE carrying it, then closes) or None, and the
pre-auth connection it evicted to make room, if any (the protocol tells it why and closes it).

Why two caps: PING and HELLO are served before AUTH, so in a closed pool anyone who reaches the port could keep
connections alive without a token. Those count against ``preauth`` (small, default 16) and are closed
``auth_timeout_s`` after the TCP accept unless they authenticated (the protocol arms that timer; a TLS handshake
runs inside it); only authenticated connections count against ``max_connections``, so a peer without a token cannot
keep a client with one out. In an open pool every connection is authenticated from the start and only
``max_connections`` applies.

Pre-auth connections are never refused: a newcomer always gets a slot, so a client with a token always gets in
(its HELLO and AUTH take a round trip or two). When its source address already holds ``per_source`` pre-auth
connections, one of that source's is evicted; else when the pool is full, one of the busiest source's (the
newcomer's own when it is the busiest): sources share the pool fairly and one that floods churns only its own
connections. Of the chosen source the victim is the one that got least far (``conn.preauth_rank()``: 0 sent
nothing, 1 sent bytes, e.g. a TLS ClientHello, 2 sent a HELLO), the oldest of those: tokenless sockets that
reconnect as soon as they are closed, or TLS handshakes that never finish, evict each other, never a client that
has spoken. What this cannot do: tell a client from a peer of the same address that speaks HELLO as fast as it
can; those share the address's slots first come, first evicted.

A connection a cap refuses (open pool or the authenticated cap) lingers a moment to be told why; at most
``MAX_LINGERING`` do at a time, the rest are closed at once (a flood of refusals holds no file descriptors).

A leaf module (imports nothing of UMBP), shared by the metaserver and the node like umbp/auth.py. Costs: O(1) per
call, O(preauth) for an eviction (a scan of the pool's sources and of one source's connections, each asked its
rank: one getsockopt).
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
        self.evictions = 0  # pre-auth connections evicted to admit newer ones (observability, tests)

    def _full(self) -> str:
        return (f"{self.component}: too many connections (max_connections {self.max_connections} reached); "
                f"try again later")

    def admit(self, conn, source: str = "") -> tuple[str | None, object | None]:
        """A new connection from ``source`` (its IP address): (None, victim) when admitted, where victim is the
        pre-auth connection evicted to make room (or None); (why not, None) when refused (a message naming the
        cap; never for a pre-auth connection)."""
        if self.closed:
            victim = self._victim(source)
            if victim is not None:
                self.drop(victim)
                self.evictions += 1
            self.preauth[conn] = source
            self.sources.setdefault(source, {})[conn] = None
            return None, victim
        if len(self.authed) >= self.max_connections:
            return self._full(), None
        self.authed.add(conn)
        return None, None

    def _victim(self, source: str):
        """The pre-auth connection to evict for a newcomer from ``source``, or None when there is room."""
        mine = self.sources.get(source)
        n = len(mine) if mine else 0
        if n >= self.per_source:
            return _least_far(mine)
        if len(self.preauth) < self.preauth_cap:
            return None
        busiest = max(self.sources.values(), key=len)
        return _least_far(busiest if len(busiest) > n else mine)

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
