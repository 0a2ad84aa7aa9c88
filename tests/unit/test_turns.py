"""``metaserver/handlers/turns.py``: a slot server's LOOKUPs of one event-loop turn are answered together at its
end, each as alone (``lookup_columns_many``), each under a lease its connection holds; a request of another kind
runs them first (``flush_due``); a closed connection's LOOKUP gets no lease; a deposed server's and a failed table
pass's LOOKUPs are each answered with the error. A real table; the connections and the server are stand-ins. And
its ALLOCs (``AllocTurn``): answered at the end of the turn by the data plane (a stand-in), each connection's own
requests in order."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from metaserver.handlers.turns import LookupTurn, flush_due
from metaserver.handlers.ownership import HeldLeases, release_held
from tests.unit.test_tabledir import directory, keys_of, put
from transport import answerrows
from transport.wire import Op
from umbp.auth import Tokens
from umbp.errors import Unavailable


def conn(version: int = 12) -> SimpleNamespace:
    return SimpleNamespace(closed=False, version=version, leases=HeldLeases())


def server() -> SimpleNamespace:
    d = directory(slots=16)
    put(d, keys_of(0, 20), 1)
    return SimpleNamespace(serving=True, dir=d, tokens=Tokens(None, {}), members={}, lease_ms=10_000)


def counted_turn() -> tuple:
    """(server, its process's due set, its turn, the sizes of the table passes it makes)."""
    svc, due, passes = server(), set(), []
    many = svc.dir.lookup_columns_many
    svc.dir.lookup_columns_many = lambda ns, asks, *a: passes.append(len(asks)) or many(ns, asks, *a)
    return svc, due, LookupTurn(svc, due), passes


def asked(turn: LookupTurn, keys: list, c, got: dict, name) -> None:
    later = turn.ask("a", keys, c)
    later.then = lambda ans, err: got.__setitem__(name, (ans, err))


def test_a_turns_lookups_are_answered_together_at_its_end_each_as_alone():
    async def main():
        svc, due, turn, passes = counted_turn()
        cs, got = [conn(), conn(11), conn(), conn()], {}
        for i, keys in enumerate([keys_of(0, 4), keys_of(2, 6) + [b"\xee" * 32], keys_of(6, 8), keys_of(8, 9)]):
            asked(turn, keys, cs[i], got, i)
        cs[2].closed = True  # gone before the turn ends: no lease, no answer
        assert got == {} and due == {turn}
        await asyncio.sleep(0)
        assert passes == [3] and sorted(got) == [0, 1, 3] and due == set()
        rows = answerrows.unpack_locs(got[0][0], "test")["locs"]
        assert [loc is not None for loc in rows] == [True] * 4
        assert [loc is not None for loc in got[1][0]["locs"]] == [True] * 4 + [False]  # VERSION 11: listed locs
        for i in (0, 1, 3):
            ans, err = got[i]
            assert err is None and ans["lease"] in cs[i].leases and ans["lease_ms"] == 10_000
        assert len(svc.dir.leases) == 3 and svc.dir.cols["pins"].sum() == 4 + 4 + 1

        asked(turn, keys_of(10, 12), cs[0], got, "now")
        flush_due(due, Op.REMOVE, None)  # a request of another kind is next: the waiting LOOKUP runs first
        assert got["now"][0]["lease"] and due == set() and passes == [3, 1]
        await asyncio.sleep(0)  # its end of turn finds nothing left
        assert passes == [3, 1]

        svc.serving = False
        asked(turn, keys_of(0, 2), cs[3], got, "deposed")
        await asyncio.sleep(0)
        assert got["deposed"][0] is None and isinstance(got["deposed"][1], Unavailable)
        svc.serving = True
        svc.dir.lookup_columns_many = lambda *a: 1 / 0
        for name in ("x", "y"):
            asked(turn, keys_of(0, 2), cs[3], got, name)
        await asyncio.sleep(0)
        assert all(got[n][0] is None and isinstance(got[n][1], ZeroDivisionError) for n in ("x", "y"))
    asyncio.run(main())


def test_a_merged_lookups_part_shares_its_slots_turn_and_gets_its_columns():
    async def main():
        svc, due, turn, passes = counted_turn()
        cp, got, parts = conn(), {}, []
        asked(turn, keys_of(0, 3), conn(), got, "plain")
        turn.ask_part("a", keys_of(2, 6) + [b"\xee" * 32], cp, parts.append)
        turn.ask_part("a", keys_of(5, 7), cp, parts.append)
        await asyncio.sleep(0)
        assert passes == [3] and got["plain"][0]["lease"] and len(parts) == 2
        (lease, j), hit, tags, slots, nix = parts[0]
        assert j == 0 and hit.tolist() == [True] * 4 + [False] and len(tags) == len(slots) == len(nix) == 4
        assert parts[1][0] == (lease, 1) and not cp.leases  # the turn's parts share a lease no connection owns
        d = svc.dir
        assert d.cols["pins"].sum() == 3 + 4 + 2 and d.slice_open(lease, 0) and d.slice_open(lease, 1)
        assert d.release_many((), [(lease, 0)]) == 1 and d.cols["pins"].sum() == 3 + 2  # its slice only
        assert not d.slice_open(lease, 0) and d.release_many((), [(lease, 0)]) == 0  # released once
        d.check()
        assert d.release(lease) and d.cols["pins"].sum() == 3 and lease not in d.leases  # the slice left (expiry)
        d.check()
        svc.serving = False
        turn.ask_part("a", keys_of(0, 1), cp, parts.append)
        await asyncio.sleep(0)
        assert isinstance(parts[2], Unavailable)
    asyncio.run(main())


def test_an_answer_that_cannot_be_made_is_answered_with_its_error_and_the_others_are_not_held_up():
    async def main():
        svc, due, turn, passes = counted_turn()
        got = {}
        asked(turn, keys_of(0, 2), conn(), got, "bad")
        asked(turn, keys_of(2, 4), conn(), got, "good")
        made, calls = svc.dir.granted_answer, []

        def first_fails(cols, *a):
            calls.append(1)
            return 1 / 0 if len(calls) == 1 else made(cols, *a)

        svc.dir.granted_answer = first_fails
        await asyncio.sleep(0)
        assert passes == [2] and isinstance(got["bad"][1], ZeroDivisionError) and got["good"][0]["lease"]
    asyncio.run(main())


def test_a_lookup_answered_outside_the_turn_comes_after_the_releases_read_before_it():
    """A LOOKUP the data plane answers at once (a rank's shard LOOKUP, a multi-slot LOOKUP not merged) unpins the
    turn's releases first (``LookupTurn.free_now``): its rows are stamped after the released ones, as in the order
    read, and the turn's end releases nothing again."""
    from metaserver.handlers.dataplane import DataPlane

    async def main():
        svc, due, turn, passes = counted_turn()
        d = svc.dir
        svc.lookups, svc.max_keys = turn, 4096
        c = conn()
        c.auth = SimpleNamespace(scope=SimpleNamespace(check=lambda *a: None))
        dp = DataPlane(svc)
        first = dp.lookup({"ns": "a", "keys": keys_of(0, 2)}, c, False)["lease"]
        assert release_held(d, [first], c, turn) == 1 and first in d.leases, "released at the turn's end..."
        dp.lookup({"ns": "a", "keys": keys_of(4, 6)}, c, False)
        assert first not in d.leases, "... or before a LOOKUP answered now"
        stamp = d.cols["stamp"]
        released, looked = stamp[d._find("a", keys_of(0, 2))], stamp[d._find("a", keys_of(4, 6))]
        assert released.max() < looked.min(), (released, looked)
        assert d.cols["pins"].sum() == 2
        await asyncio.sleep(0)
        assert d.cols["pins"].sum() == 2 and passes == [] and due == set()
        d.check()
    asyncio.run(main())


def test_a_turns_allocs_wait_for_its_end_and_keep_each_connections_order():
    """``AllocTurn``: ALLOCs wait for the end of the turn and go to the data plane together (a stand-in here that
    answers each with a dict, a coroutine or an error); a closed connection's ALLOC is not asked; a COMMIT or ABORT
    of a connection with an ALLOC waiting runs the turn first, another connection's does not, nor an ALLOC; any
    other request does; a deposed server answers UNAVAILABLE."""
    from metaserver.handlers import turns
    from metaserver.handlers.turns import AllocTurn

    async def later_answer():
        await asyncio.sleep(0)
        return {"late": True}

    asked: list = []

    def alloc_many(ns, asks):
        asked.append([a[0] for a in asks])
        out = []
        for keys, *_ in asks:
            out.append({"keys": keys} if keys != ["late"] else later_answer())
            if keys == ["bad"]:
                out[-1] = ValueError("no room for bad")
        return out, 1

    svc = SimpleNamespace(serving=True, term=1, dataplane=SimpleNamespace(alloc_many=alloc_many))
    due: set = set()
    turn = AllocTurn(svc, due)
    got: dict = {}

    def ask(keys, c, name):
        later = turn.ask("a", keys, c, [1] * len(keys), None, None)
        later.then = lambda ans, err: got.__setitem__(name, (ans, err))

    async def main():
        x, y, gone = conn(), conn(), conn()
        for keys, c in ((["k1"], x), (["late"], y), (["k2"], gone), (["bad"], x)):
            ask(keys, c, keys[0])
        gone.closed = True
        flush_due(due, Op.ALLOC, x)  # another ALLOC: waits with them
        flush_due(due, Op.COMMIT, SimpleNamespace())  # another connection's COMMIT: they may come in either order
        assert got == {} and due == {turn}
        await asyncio.sleep(0)
        assert asked == [[["k1"], ["late"], ["bad"]]] and "k2" not in got
        assert got["k1"] == ({"keys": ["k1"]}, None) and isinstance(got["bad"][1], ValueError)
        for _ in range(100):  # the waiting answer's task: started, its sleep, its end, its callback (a few turns)
            if "late" in got:
                break
            await asyncio.sleep(0)
        assert got["late"] == ({"late": True}, None) and not turns._TASKS  # answered, its task let go
        ask(["k3"], x, "k3")
        flush_due(due, Op.COMMIT, x)  # its own COMMIT: the waiting ALLOC first
        assert got["k3"] == ({"keys": ["k3"]}, None) and due == set()
        ask(["k4"], y, "k4")
        flush_due(due, Op.LOOKUP, SimpleNamespace())
        assert "k4" in got
        svc.serving = False
        ask(["k5"], x, "k5")
        await asyncio.sleep(0)
        assert got["k5"][0] is None and isinstance(got["k5"][1], Unavailable)
        assert turn.asked == 5 and turn.passes == 3
    asyncio.run(main())


def test_a_turns_releases_leave_their_connections_at_once_and_unpin_in_one_pass_before_its_lookups():
    async def main():
        svc, due, turn, passes = counted_turn()
        d, calls = svc.dir, []
        many = d.release_many
        d.release_many = lambda asks, slices=(): calls.append((len(asks), len(passes))) or many(asks, slices)
        c, other, got = conn(), conn(), {}
        for i, keys in enumerate([keys_of(0, 4), keys_of(2, 6), keys_of(6, 8)]):
            asked(turn, keys, other if i == 2 else c, got, i)
        await asyncio.sleep(0)
        mine, theirs = got[0][0]["lease"], got[2][0]["lease"]
        assert d.cols["pins"].sum() == 10 and c.leases == {mine, got[1][0]["lease"]}
        # one id twice, another connection's, an unknown one: counted as a RELEASE of them at once would count
        assert release_held(d, [mine, mine, theirs, 99, got[1][0]["lease"]], c, turn) == 2
        assert c.leases == set() and theirs in other.leases and due == {turn}
        assert d.cols["pins"].sum() == 10 and calls == [], "unpinned at the end of the turn, not before"
        assert not d.disown(mine, c), "the lease is no longer its connection's"
        asked(turn, keys_of(0, 2), c, got, "after")
        await asyncio.sleep(0)
        assert calls == [(2, 1)] and passes == [3, 1], "both leases in one call, before the turn's LOOKUP"
        assert d.cols["pins"].sum() == 2 + 2 and set(d.leases) == {theirs, got["after"][0]["lease"]}
        assert release_held(d, [theirs], other, turn) == 1 and due == {turn}
        flush_due(due, Op.REMOVE, None)  # a request that does not commute sees it released
        assert calls == [(2, 1), (1, 2)] and d.cols["pins"].sum() == 2 and due == set()
        d.check()
    asyncio.run(main())
