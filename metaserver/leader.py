"""Leadership: whether this metaserver serves the data plane, and where the leader is.

Today a metaserver is always the leader of its etcd prefix (``SingleLeader``). The seam for standbys: an
implementation that campaigns on an etcd election (``{prefix}/leader`` under a lease of ``election_ttl_s``) keeps
``is_leader`` and ``leader_addr`` current; the server already answers data-plane requests from a non-leader with
NOT_LEADER plus ``{"leader": leader_addr}``, and loads the directory from etcd when it becomes the leader.

Invariant: at most one metaserver per prefix believes ``is_leader`` at a time (trivially true for one process; an
election implementation must fence its writes on the leader key's revision).
"""

from __future__ import annotations


class SingleLeader:
    """The only metaserver: always the leader, at its own advertised address."""

    def __init__(self, addr: str):
        self.addr = addr

    @property
    def is_leader(self) -> bool:
        return True

    @property
    def leader_addr(self) -> str | None:
        return self.addr
