"""A connection's read lease ids (``metaserver/handlers/ownership.py`` ``HeldLeases``): pruned of expired ones when the set
has doubled since the last prune, so a connection that never releases costs O(1) amortized per LOOKUP (each prune
is counted here) while it still holds only the live ids."""

from __future__ import annotations

from types import SimpleNamespace

from metaserver.handlers.ownership import LEASES_PRUNE_AT, HeldLeases, own_lease


class CountingLive(dict):
    """The directory's live leases, counting the membership checks a prune makes."""

    def __init__(self, budget: int = 1 << 62):
        super().__init__()
        self.checks = 0
        self.budget = budget

    def __contains__(self, lease) -> bool:
        self.checks += 1
        if self.checks > self.budget:  # fail at once rather than run a quadratic scan to the end
            raise AssertionError(f"more than {self.budget} membership checks: a scan per LOOKUP")
        return super().__contains__(lease)


def table(live: dict) -> SimpleNamespace:
    """What ``own_lease`` reads of the directory: its live leases."""
    return SimpleNamespace(leases=live)


def test_live_leases_are_scanned_o1_amortized_and_expired_ones_pruned():
    n = 20 * LEASES_PRUNE_AT  # a client that never releases: every lease stays live
    live = CountingLive(budget=2 * n)
    d, conn = table(live), SimpleNamespace(leases=HeldLeases())
    for lease in range(n):
        live[lease] = True
        own_lease(d, conn, lease)
    assert len(conn.leases) == n  # nothing dropped that is live
    # prunes at 4096, 8192, 16384, 32768, 65536: about 2n checks, not one scan per LOOKUP past 4096 (~n^2 / 2)
    assert live.checks <= 2 * n, live.checks
    assert conn.leases.prune_at == 2 * 65536
    # every lease expires: the next prune (at prune_at) keeps none of them, and the threshold falls back
    live.clear()
    live.budget += conn.leases.prune_at
    at = conn.leases.prune_at
    for lease in range(n, at + 1):
        own_lease(d, conn, lease)
    assert conn.leases == {at}  # only the one added after the prune
    assert conn.leases.prune_at == LEASES_PRUNE_AT


def test_a_prune_keeps_the_live_ids_only():
    live = CountingLive()
    d, conn = table(live), SimpleNamespace(leases=HeldLeases())
    for lease in range(LEASES_PRUNE_AT):
        if lease % 3 == 0:
            live[lease] = True  # a third are still live, the rest expired or released elsewhere
        own_lease(d, conn, lease)
    own_lease(d, conn, -1)  # at LEASES_PRUNE_AT: prune, then add
    assert conn.leases == {x for x in range(LEASES_PRUNE_AT) if x % 3 == 0} | {-1}
    assert conn.leases.prune_at == LEASES_PRUNE_AT  # 2 x 1366 is below the floor
