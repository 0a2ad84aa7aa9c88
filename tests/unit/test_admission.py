"""Pre-auth admission (umbp/admission.py, issue 42 finding 3): a newcomer is never refused; the connection it evicts
is of its own address past ``per_source``, else of the busiest address when the pool is full, and of that address
the one that got least far (sent nothing, then bytes, then a HELLO), oldest first. Fake connections carry their
rank; no sockets."""

from __future__ import annotations

import pytest

from umbp.admission import Admission


class Conn:
    def __init__(self, name: str, rank: int = 0):
        self.name = name
        self.rank = rank
        self.asked = 0

    def preauth_rank(self) -> int:
        self.asked += 1
        return self.rank

    def __repr__(self) -> str:
        return self.name


def closed(preauth: int = 16, per_source: int = 8) -> Admission:
    return Admission("node n", True, max_connections=4, preauth=preauth, auth_timeout_s=5.0, per_source=per_source)


def test_one_address_holds_per_source_and_churns_only_its_own():
    adm = closed()
    attackers = [Conn(f"a{i}") for i in range(40)]
    evicted = []
    for c in attackers:
        refusal, victim = adm.admit(c, "10.0.0.9")
        assert refusal is None  # never refused
        evicted.append(victim)
    assert evicted[:8] == [None] * 8 and evicted[8:] == attackers[:32]  # oldest first
    assert list(adm.sources["10.0.0.9"]) == attackers[32:] and adm.evictions == 32
    # another address is admitted without touching anyone: the pool (16) has room
    assert adm.admit(Conn("client"), "10.0.0.1") == (None, None)


def test_a_full_pool_evicts_from_the_busiest_address():
    adm = closed(preauth=16, per_source=8)
    a = [Conn(f"a{i}") for i in range(8)]
    b = [Conn(f"b{i}") for i in range(6)]
    c = [Conn(f"c{i}") for i in range(2)]
    for conn, src in [*((x, "A") for x in a), *((x, "B") for x in b), *((x, "C") for x in c)]:
        assert adm.admit(conn, src) == (None, None)
    assert len(adm.preauth) == 16
    assert adm.admit(Conn("d0"), "D") == (None, a[0])  # A holds 8: the busiest
    assert adm.admit(Conn("c2"), "C") == (None, a[1])  # C (2 + 1) is not the busiest: A (7) gives
    # A and B now hold 6 each: a newcomer of B ties with the busiest, so B's own oldest gives (no address grows
    # past the busiest's share by evicting another)
    assert adm.admit(Conn("b6"), "B")[1] is b[0]
    assert len(adm.sources["A"]) == 6 and len(adm.sources["B"]) == 6 and len(adm.preauth) == 16


def test_the_least_far_goes_first_a_client_that_spoke_stays():
    adm = closed(preauth=16, per_source=4)
    client = Conn("client", rank=2)  # sent its HELLO
    tls_client = Conn("tls", rank=1)  # sent its ClientHello, handshake under way
    assert adm.admit(client, "S") == (None, None)
    assert adm.admit(tls_client, "S") == (None, None)
    silent = [Conn(f"s{i}") for i in range(50)]
    victims = [adm.admit(s, "S")[1] for s in silent]
    assert client not in victims and tls_client not in victims  # 50 silent newcomers churned among themselves
    assert set(adm.sources["S"]) == {client, tls_client, silent[-2], silent[-1]}
    # once only speakers are left, the oldest of the lowest rank goes
    adm2 = closed(preauth=16, per_source=2)
    pinger, hello = Conn("pinger", rank=1), Conn("hello", rank=2)
    adm2.admit(hello, "S")
    adm2.admit(pinger, "S")
    assert adm2.admit(Conn("new", rank=0), "S")[1] is pinger


def test_authenticated_connections_leave_the_pool_and_count_against_max_connections():
    adm = closed(preauth=2, per_source=2)
    a, b = Conn("a"), Conn("b")
    adm.admit(a, "S")
    adm.admit(b, "S")
    assert adm.pending(a) and adm.authenticated(a) is None and not adm.pending(a)
    assert adm.sources["S"] == {b: None} and a in adm.authed
    adm.drop(b)
    assert not adm.sources and not adm.preauth and len(adm) == 1
    for i in range(3):
        c = Conn(f"c{i}")
        adm.admit(c, "T")
        assert adm.authenticated(c) is None
    late = Conn("late")
    adm.admit(late, "T")
    assert adm.authenticated(late).startswith("node n: too many connections (max_connections 4 reached)")


def test_messages_and_open_pools():
    adm = closed()
    assert adm.evicted_message("10.1.2.3").startswith(
        "node n: too many unauthenticated connections (preauth_connections 16, preauth_per_source 8 from "
        "10.1.2.3): this one was closed to admit a newer one")
    open_pool = Admission("metaserver", False, max_connections=2, preauth=16, auth_timeout_s=5.0, per_source=8)
    assert open_pool.admit(Conn("x"), "S") == (None, None) and open_pool.admit(Conn("y"), "S") == (None, None)
    refusal, victim = open_pool.admit(Conn("z"), "S")
    assert victim is None and refusal.startswith("metaserver: too many connections (max_connections 2 reached)")
    assert not open_pool.preauth


@pytest.mark.parametrize("per_source", [0, 99])
def test_per_source_defaults_to_and_never_exceeds_the_pool(per_source):
    assert closed(preauth=16, per_source=per_source).per_source == 16
