"""Connection admission for the servers (metaserver, storage node): caps on connections before and after
authentication. Sans-I/O bookkeeping: the protocol calls ``admit`` when a connection is made, ``authenticated`` when
its AUTH succeeds and ``drop`` when it is lost; each returns the refusal message (the protocol answers the peer's
next request with UNAVAILABLE carrying it, then closes) or None.

Why two caps: PING and HELLO are served before AUTH, so in a closed pool anyone who reaches the port could keep
connections alive without a token. Those count against ``preauth`` (small, default 16) and are closed
``auth_timeout_s`` after connecting unless they authenticated (the protocol arms that timer); only authenticated
connections count against ``max_connections``, so an attacker without a token cannot keep a client with one out for
longer than ``auth_timeout_s`` (a slot it holds frees by then). In an open pool every connection is authenticated
from the start and only ``max_connections`` applies. Costs: O(1) per call.

A leaf module (imports nothing of UMBP), shared by the metaserver and the node like umbp/auth.py.
"""

from __future__ import annotations


class Admission:
    def __init__(self, component: str, closed: bool, max_connections: int, preauth: int, auth_timeout_s: float):
        self.component = component
        self.closed = closed
        self.max_connections = max_connections
        self.preauth_cap = preauth
        self.auth_timeout_s = auth_timeout_s
        self.authed: set = set()  # connections that count against max_connections
        self.preauth: set = set()  # connections still to authenticate (closed pools only)

    def _full(self) -> str:
        return (f"{self.component}: too many connections (max_connections {self.max_connections} reached); "
                f"try again later")

    def admit(self, conn) -> str | None:
        """A new connection: None when admitted, else why not (a message naming the cap)."""
        if self.closed:
            if len(self.preauth) >= self.preauth_cap:
                return (f"{self.component}: too many unauthenticated connections (preauth_connections "
                        f"{self.preauth_cap} reached, each closed {self.auth_timeout_s:g}s after connecting unless "
                        f"it authenticates); try again")
            self.preauth.add(conn)
            return None
        if len(self.authed) >= self.max_connections:
            return self._full()
        self.authed.add(conn)
        return None

    def authenticated(self, conn) -> str | None:
        """AUTH succeeded: the connection moves to the authenticated cap (None), or is refused when that is full."""
        if conn in self.authed:
            return None
        self.preauth.discard(conn)
        if len(self.authed) >= self.max_connections:
            return self._full()
        self.authed.add(conn)
        return None

    def pending(self, conn) -> bool:
        """Still to authenticate (its deadline applies)."""
        return conn in self.preauth

    def drop(self, conn) -> None:
        self.authed.discard(conn)
        self.preauth.discard(conn)

    def __len__(self) -> int:
        return len(self.authed) + len(self.preauth)
