"""``umbp.releases.ReleasingMeta`` against a fake metaserver layer: read leases queued and carried by the next LOOKUP
only while the metaserver's answers say it takes them (``"released"``; a partitioned pool's router: and
``"release_any"``, every process asked took them); an older
metaserver (no ``"released"``) gets RELEASE frames as before; one that refuses the field after all has the LOOKUP
made again without it and the ids in a RELEASE frame; other requests, the timer and ``close`` send the queue."""

from __future__ import annotations

import pytest

from transport.wire import Op, Status
from umbp import releases
from umbp.errors import BadRequest
from umbp.releases import ReleasingMeta
from waiting import eventually


class Ticket:
    def __init__(self, op, meta):
        self.op, self.meta = op, meta


class Fake:
    """Records what is sent; LOOKUPs answered with ``"released"`` when ``new``; ``refuse``: LOOKUPs that carry
    "release" refused as a metaserver without the field refuses them."""

    def __init__(self, new: bool = True, slots: int = 1, refuse: bool = False, release_any: bool = False):
        self.new, self.slots, self.refuse, self.release_any = new, slots, refuse, release_any
        self.log: list[tuple[str, int, dict]] = []
        self.closed = False

    def _answer(self, op, meta):
        if op == Op.LOOKUP and self.refuse and "release" in meta:
            raise BadRequest("client", "metaserver: LOOKUP: unknown field 'release'", Status.BAD_REQUEST)
        if op != Op.LOOKUP:
            return {}
        out = {"lease": 7, "locs": []}
        if self.new:
            out["released"] = len(meta.get("release", ()))
        if self.release_any:  # a partitioned pool's router whose every process took "release"
            out["release_any"] = True
        return out

    def call(self, op, meta, deadline):
        self.log.append(("call", op, dict(meta)))
        return self._answer(op, meta)

    def submit(self, op, meta, deadline):
        self.log.append(("submit", op, dict(meta)))
        return Ticket(op, meta)

    def result(self, t, deadline):
        return self._answer(t.op, t.meta)

    def forget(self, tickets):
        pass

    def send_noreply(self, op, meta, deadline):
        self.log.append(("noreply", op, dict(meta)))

    def close(self):
        self.closed = True


LOOKUP = {"ns": "n", "keys": [b"k"]}


@pytest.fixture(autouse=True)
def _no_timer(monkeypatch):
    monkeypatch.setattr(releases, "MAX_AGE_S", 600.0)


def test_a_new_metaserver_gets_the_ids_in_the_next_lookup():
    f = Fake()
    m = ReleasingMeta(f)
    m.send_noreply(Op.RELEASE, {"lease": 5}, 0)  # no LOOKUP answer seen yet: a frame
    assert f.log == [("noreply", Op.RELEASE, {"lease": 5})]
    assert m.call(Op.LOOKUP, dict(LOOKUP), 0)["released"] == 0 and m.capable
    m.send_noreply(Op.RELEASE, {"lease": 10}, 0)  # a lone get's (none came lately): a frame, at once
    assert f.log[-1] == ("noreply", Op.RELEASE, {"lease": 10})
    m.send_noreply(Op.RELEASE, {"lease": 11}, 0)
    m.send_noreply(Op.RELEASE, {"lease": 12}, 0)
    assert len(f.log) == 3, "queued, nothing sent"
    t = m.submit(Op.LOOKUP, dict(LOOKUP), 0)
    assert f.log[-1] == ("submit", Op.LOOKUP, {**LOOKUP, "release": [11, 12]})
    assert m.result(t, 0)["released"] == 2
    assert (m.piggybacked, m.framed) == (2, 1)
    m.send_noreply(Op.RELEASE, {"lease": 13}, 0)
    m.call(Op.ALLOC, {"ns": "n"}, 0)  # any other request: the queue goes first, in a RELEASE frame
    assert f.log[-2:] == [("noreply", Op.RELEASE, {"leases": [13]}), ("call", Op.ALLOC, {"ns": "n"})]
    m.send_noreply(Op.RELEASE, {"lease": 14}, 0)
    m.close()
    assert f.log[-1] == ("noreply", Op.RELEASE, {"leases": [14]}) and f.closed
    assert (m.piggybacked, m.framed) == (2, 3)


def test_an_old_metaserver_gets_release_frames():
    f = Fake(new=False)
    m = ReleasingMeta(f)
    for lease in (1, 2, 3):
        m.call(Op.LOOKUP, dict(LOOKUP), 0)
        m.send_noreply(Op.RELEASE, {"lease": lease}, 0)
    assert not m.capable
    assert [e for e in f.log if e[0] == "noreply"] == [("noreply", Op.RELEASE, {"lease": x}) for x in (1, 2, 3)]
    assert all("release" not in e[2] for e in f.log)


def test_a_partitioned_pool_gets_release_frames_unless_every_process_takes_them():
    f = Fake(slots=64)  # the lease is the router's handle over several processes, one of which said nothing
    m = ReleasingMeta(f)
    m.call(Op.LOOKUP, dict(LOOKUP), 0)
    m.send_noreply(Op.RELEASE, {"lease": 9}, 0)
    assert not m.capable and f.log[-1] == ("noreply", Op.RELEASE, {"lease": 9})

    f = Fake(slots=64, release_any=True)  # every process the router asked said "release_any"
    m = ReleasingMeta(f)
    m.call(Op.LOOKUP, dict(LOOKUP), 0)
    m.send_noreply(Op.RELEASE, {"lease": 9}, 0)  # a lone get's: a frame
    m.send_noreply(Op.RELEASE, {"lease": 10}, 0)  # a get right after: queued for the next LOOKUP
    assert m.capable and f.log[-1] == ("noreply", Op.RELEASE, {"lease": 9})
    m.call(Op.LOOKUP, dict(LOOKUP), 0)
    assert f.log[-1] == ("call", Op.LOOKUP, {**LOOKUP, "release": [10]}) and m.piggybacked == 1


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_refused_field_falls_back(pipelined):
    """The answers said it takes "release", then a metaserver that does not (a failover to an older one)."""
    f = Fake()
    m = ReleasingMeta(f)
    m.call(Op.LOOKUP, dict(LOOKUP), 0)
    m.send_noreply(Op.RELEASE, {"lease": 20}, 0)  # alone: a frame
    m.send_noreply(Op.RELEASE, {"lease": 21}, 0)  # queued
    f.new, f.refuse = False, True
    if pipelined:
        got = m.result(m.submit(Op.LOOKUP, dict(LOOKUP), 0), 0)
    else:
        got = m.call(Op.LOOKUP, dict(LOOKUP), 0)
    assert got["lease"] == 7 and not m.capable
    assert f.log[-2:] == [("noreply", Op.RELEASE, {"leases": [21]}), ("call", Op.LOOKUP, LOOKUP)]
    m.send_noreply(Op.RELEASE, {"lease": 22}, 0)
    assert f.log[-1] == ("noreply", Op.RELEASE, {"lease": 22})


def test_other_bad_requests_are_raised():
    f = Fake()
    m = ReleasingMeta(f)
    m.call(Op.LOOKUP, dict(LOOKUP), 0)

    def bad(op, meta, deadline):
        raise BadRequest("client", "metaserver: LOOKUP: keys must be a list", Status.BAD_REQUEST)
    f.call = bad
    with pytest.raises(BadRequest, match="keys must be a list"):
        m.call(Op.LOOKUP, dict(LOOKUP), 0)


def test_the_timer_sends_a_queue_that_no_lookup_takes(monkeypatch):
    monkeypatch.setattr(releases, "MAX_AGE_S", 0.05)
    f = Fake()
    m = ReleasingMeta(f)
    m.call(Op.LOOKUP, dict(LOOKUP), 0)
    m._added = m._since = float("inf")  # as if a get had just queued one: the next is queued too
    m.send_noreply(Op.RELEASE, {"lease": 31}, 0)
    eventually(lambda: ("noreply", Op.RELEASE, {"leases": [31]}) in f.log, 10.0, "the timer's RELEASE")
    eventually(lambda: m._idle, 10.0, "the timer waits without a bound")
    m._added = float("inf")
    m.send_noreply(Op.RELEASE, {"lease": 32}, 0)  # queued after the timer went idle: it is woken for this one
    eventually(lambda: ("noreply", Op.RELEASE, {"leases": [32]}) in f.log, 10.0, "the timer's second RELEASE")
    m.close()
    assert m.framed == 2 and m.piggybacked == 0
    eventually(lambda: not m._timer.is_alive(), 10.0, "the timer ended by close")
