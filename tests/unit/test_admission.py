"""Pre-auth admission (umbp/admission.py, issue 42 finding 3): a newcomer is never refused; ``settle`` (a moment
after admissions that went past a cap) evicts of each address past ``per_source`` its own, then of the busiest
address while the pool is past its cap, each time the connection that got least far (sent nothing, then bytes, then
a HELLO), oldest first. Fake connections carry their rank; no sockets."""

from __future__ import annotations

import pytest

from umbp.admission import Admission


class Conn:
    def __init__(self, name: str, rank: int = 0):
        self.name = name
        self.rank = rank

    def preauth_rank(self) -> int:
        return self.rank

    def __repr__(self) -> str:
        return self.name


def closed(preauth: int = 16, per_source: int = 8) -> Admission:
    return Admission("node n", True, max_connections=4, preauth=preauth, auth_timeout_s=5.0, per_source=per_source)


def admit_all(adm: Admission, conns: list, source: str) -> list:
    """Admit each (never refused), settling after each as the server's timer would between accepts."""
    victims = []
    for c in conns:
        assert adm.admit(c, source) is None
        if adm.unsettled:
            victims += adm.settle()
    return victims


def test_one_address_holds_per_source_and_churns_only_its_own():
    adm = closed()
    attackers = [Conn(f"a{i}") for i in range(40)]
    assert admit_all(adm, attackers[:8], "10.0.0.9") == [] and not adm.unsettled
    assert admit_all(adm, attackers[8:], "10.0.0.9") == attackers[:32]  # oldest first
    assert list(adm.sources["10.0.0.9"]) == attackers[32:] and adm.evictions == 32
    # another address is admitted without touching anyone: the pool (16) has room
    assert adm.admit(Conn("client"), "10.0.0.1") is None and not adm.unsettled


def test_a_burst_is_settled_at_once_and_the_busiest_address_gives():
    adm = closed(preauth=16, per_source=8)
    a = [Conn(f"a{i}") for i in range(8)]
    b = [Conn(f"b{i}") for i in range(6)]
    c = [Conn(f"c{i}") for i in range(2)]
    for conn, src in [*((x, "A") for x in a), *((x, "B") for x in b), *((x, "C") for x in c)]:
        assert adm.admit(conn, src) is None
    assert not adm.unsettled and len(adm.preauth) == 16
    # a burst of accepts before the settle: A past its own cap, the pool past 16
    burst = [(Conn("a8"), "A"), (Conn("a9"), "A"), (Conn("d0"), "D"), (Conn("c2"), "C")]
    for conn, src in burst:
        adm.admit(conn, src)
    assert adm.unsettled and len(adm.preauth) == 20
    victims = adm.settle()
    # A (10) back to 8: a0, a1; then the pool (18) back to 16 from the busiest, A again (8 against B's 6): a2, a3
    assert victims == a[:4] and len(adm.preauth) == 16 and not adm.unsettled
    assert {src: len(g) for src, g in adm.sources.items()} == {"A": 6, "B": 6, "C": 3, "D": 1}


def test_the_least_far_goes_first_a_client_that_spoke_stays():
    adm = closed(preauth=16, per_source=4)
    client = Conn("client", rank=2)  # sent its HELLO
    tls_client = Conn("tls", rank=1)  # sent its ClientHello, handshake under way
    assert admit_all(adm, [client, tls_client], "S") == []
    silent = [Conn(f"s{i}") for i in range(50)]
    victims = admit_all(adm, silent, "S")
    assert client not in victims and tls_client not in victims  # 50 silent newcomers churned among themselves
    assert set(adm.sources["S"]) == {client, tls_client, silent[-2], silent[-1]}
    # a client accepted in the same burst as silent ones, its HELLO read before the settle: the silent ones go
    adm2 = closed(preauth=16, per_source=2)
    late = Conn("late-client")
    for conn in (Conn("x0"), Conn("x1"), late, Conn("x2"), Conn("x3")):
        adm2.admit(conn, "S")
    late.rank = 2
    assert [v.name for v in adm2.settle()] == ["x0", "x1", "x2"]
    # once only speakers are left, the oldest of the lowest rank goes
    adm3 = closed(preauth=16, per_source=2)
    pinger, hello = Conn("pinger", rank=1), Conn("hello", rank=2)
    assert admit_all(adm3, [hello, pinger, Conn("new", rank=2)], "S") == [pinger]


def test_authenticated_connections_leave_the_pool_and_count_against_max_connections():
    adm = closed(preauth=2, per_source=2)
    a, b = Conn("a"), Conn("b")
    admit_all(adm, [a, b], "S")
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
    assert open_pool.admit(Conn("x"), "S") is None and open_pool.admit(Conn("y"), "S") is None
    assert open_pool.admit(Conn("z"), "S").startswith("metaserver: too many connections (max_connections 2 reached)")
    assert not open_pool.preauth and not open_pool.unsettled


@pytest.mark.parametrize("per_source", [0, 99])
def test_per_source_defaults_to_and_never_exceeds_the_pool(per_source):
    assert closed(preauth=16, per_source=per_source).per_source == 16
