"""A partitioned pool (``metaserver/ha/partition.py``, ``metaserver/ha/slots.py``, ``umbp/slotrouter.py``): slot routing,
MOVED answers, per-slot failover with three processes (SIGKILL under load), joins and leaves (STATS aggregation
and ``umbp up``: tests/test_slots_admin.py).

Real etcd, metaserver and node processes; assertions on bytes, counts and slot maps; every wait bounded.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from types import SimpleNamespace

import pytest

from closedpool import OPS, closed_cluster, scoped_client, tokens_toml
from cluster import NotYet, eventually
from test_failover import raw
from metaserver.ha.partition import RANK_DELAY_S, Partition
from metaserver.ha.slots import leaders, ranking, region
from transport import objformat, slotrules, wire
from transport.framed import FramedSocket
from transport.wire import Op
from umbp.errors import AuthError, NotLeader, RemoteError, UmbpError

SLOTS = 8
TTL_S = 2  # --election-ttl of these tests: a dead process's slots move within this + a round


def payload(i: int, n: int = 6000) -> bytes:
    return (i.to_bytes(4, "little") * (n // 4 + 1))[:n]


def slot_map(addr: str) -> dict:
    return raw(addr, Op.LEADER)


def wait_map(addrs: list[str], want: set[str], timeout: float, slots: int = SLOTS) -> dict:
    """Poll LEADER until the slot map is the balanced ranking's over exactly the processes ``want`` (each slot
    led by its first-ranked one, the membership role too) and every one of them serves the slots the map gives it
    (its STATS ``slots_led``: a handover finished, so a client routed by the map meets no MOVED) and sees that map
    itself (a client reads the map from whichever process answers first); returns the LEADER answer. Where STATS
    needs a token (a closed pool), the map alone."""
    expect = leaders(slots, want)
    last = []

    def settled() -> dict | None:
        for a in addrs:
            try:
                last[:] = [slot_map(a)]
                break
            except (UmbpError, OSError):
                continue
        if not (last and last[0]["map"] == expect and sorted(last[0]["members"]) == sorted(want)):
            raise NotYet(f"LEADER answered {last[0] if last else None}")
        for a in want:
            try:
                st = raw(a, Op.STATS)
            except AuthError:
                continue
            except (UmbpError, OSError) as e:
                raise NotYet(f"{a}: STATS: {e}") from e
            if st.get("slot_map") != expect:  # each process's own view: a client may ask any of them for the map
                raise NotYet(f"{a} sees the map {st.get('slot_map')}")
            led = set(st.get("slots_led") or ())
            mine = {s for s, leader in enumerate(expect) if leader == a}
            if led != mine:
                raise NotYet(f"{a} serves slots {sorted(led)}, the map gives it {sorted(mine)}")
        return last[0]

    return eventually(settled, timeout, f"slot map settled on {sorted(want)}", interval=0.1)


TAKEOVER = re.compile(r"slot (\d+): leader at revision \d+ \((warm|full load)")  # partition.py's log line


def wait_copies_loaded(cl, timeout: float) -> None:
    """Until every slot's warm copy is loaded on its successor (STATS ``warm_copies``)."""
    def loaded() -> bool:
        per = cl.ask("stats")["metaservers"]  # in-process: what `umbp stats --json` prints
        copies = [w for m in per for w in (m.get("warm_copies") or {}).values()]
        if len(copies) == SLOTS and all(w["loaded"] for w in copies):
            return True
        raise NotYet(f"STATS metaservers {per}")

    eventually(loaded, timeout, "every slot's warm copy loaded", interval=0.2)


def partitioned(make_cluster, metaservers: int = 3, **kw):
    return make_cluster(metaservers=metaservers, nodes=2, capacity="64MiB",
                        metaserver_flags={"slots": SLOTS, "election_ttl": TTL_S}, **kw)


def filled(make_cluster, prefix: str, n: int, size: int = 6000):
    """A 3-process partitioned pool, its slot map settled, with pages ``{prefix}{i}`` (``payload(i, size)``) put:
    (cluster, the processes' addresses, the LEADER answer, the keys)."""
    cl = partitioned(make_cluster)
    addrs = [m.addr for m in cl.metaservers]
    info = wait_map(addrs, set(addrs), 30.0)
    keys = [f"{prefix}{i}".encode() for i in range(n)]
    with cl.client() as c:
        assert c.batch_put(keys, [payload(i, size) for i in range(n)]) == [True] * n
    return cl, addrs, info, keys


# ----------------------------------------------------------------------------------------------------------------
# the arithmetic: slots, ranking, regions (no processes)


def test_slot_ranking_and_regions():
    keys = [f"key{i}".encode() for i in range(4000)]
    slots = [slotrules.slot_of("ns", k, SLOTS) for k in keys]
    assert slots == [slotrules.slot_of("ns", k.decode(), SLOTS) for k in keys]  # str and bytes keys agree
    counts = [slots.count(s) for s in range(SLOTS)]
    assert min(counts) > 400 and max(counts) < 600, counts  # uniform: 500 expected per slot
    for n, slots in ((4, 64), (4, 16), (3, 64), (8, 16)):
        members = tuple(sorted(f"10.0.0.{i}:7700" for i in range(n)))
        orders = ranking(slots, members)
        first = [o[0] for o in orders]
        assert all(sorted(o) == list(members) for o in orders)  # an order ranks every member once
        per = sorted(first.count(m) for m in members)
        assert per[0] >= slots // n and per[-1] <= -(-slots // n), per  # balanced: floor or ceil of S/N each
        second = [o[1] for o in orders]
        assert all(a != b for a, b in zip(first, second))  # a slot's successor (its warm copy) is not its leader
        per = sorted(second.count(m) for m in members)
        assert per[-1] - per[0] <= 1, per  # ... and every process keeps floor or ceil of S/N copies
        kept = moved = 0
        for gone in members:
            after = leaders(slots, [m for m in members if m != gone])
            mine = [s for s in range(slots) if first[s] == gone]
            kept += sum(after[s] == orders[s][1] for s in mine)
            per = sorted(after.count(m) for m in members if m != gone)
            assert per[-1] - per[0] <= 1, per  # the survivors' map spreads the dead process's slots evenly
            moved += sum(first[s] != gone and after[s] != first[s] for s in range(slots))
        assert moved <= n * slots // 8, moved  # the survivors keep (nearly) all of their own, on average
        # most of a dead process's slots stay with the successor that took them over warm (the rest move once more)
        assert kept >= 2 * slots // 3, (kept, slots)
    assert leaders(16, ["b:1", "a:1", "b:1"]) == leaders(16, ("a:1", "b:1"))  # order and repeats do not matter
    cap = 64 << 20
    regions = sorted(region(s, SLOTS, cap) for s in range(SLOTS))
    for (b0, n0), (b1, _) in zip(regions, regions[1:]):
        assert b0 + n0 <= b1  # never overlapping
    assert regions[0][0] == objformat.ARENA_DATA_START and regions[-1][0] + regions[-1][1] <= objformat.ARENA_DATA_START + cap


def test_a_loaded_warm_copy_campaigns_first():
    """A vacant slot's campaign delay: the rank in the slot's order with the processes reporting a loaded warm copy
    of it moved to the front (a dead leader's slot goes to whoever kept its copy, ranked first or not)."""
    p = Partition.__new__(Partition)
    p.addr, order = "b:1", ["a:1", "c:1", "b:1"]
    p.servers = {"0": SimpleNamespace(warm=None)}
    p.members = {"a:1": {"warm": []}, "c:1": {"warm": []}}
    assert p._delay("0", order) == 2 * RANK_DELAY_S  # nobody warm: the plain rank
    p.members["c:1"]["warm"] = ["0"]
    assert p._delay("0", order) == 2 * RANK_DELAY_S  # c first, then a, then b
    p.servers["0"].warm = SimpleNamespace(loaded=True)
    assert p._delay("0", order) == RANK_DELAY_S  # b and c both warm: in order, c then b
    p.members["c:1"]["warm"] = ["1"]
    assert p._delay("0", order) == 0  # b alone warm: first
    p.servers["0"].warm.loaded = False  # a copy still loading counts as none
    assert p._delay("0", order) == 2 * RANK_DELAY_S


# ----------------------------------------------------------------------------------------------------------------
# routing and MOVED


def test_slot_routing_and_moved(make_cluster):
    cl = partitioned(make_cluster)
    addrs = [m.addr for m in cl.metaservers]
    info = wait_map(addrs, set(addrs), 30.0)
    assert info["slots"] == SLOTS and sorted(info["members"]) == sorted(addrs)
    keys = [f"route{i}".encode() for i in range(300)]
    with cl.client() as c:
        assert c.batch_put(keys, [payload(i) for i in range(300)]) == [True] * 300
        assert c.batch_put(keys[:10], [payload(i) for i in range(10)]) == [False] * 10  # dedup across slots
        outs = [bytearray(6000) for _ in keys]
        assert c.batch_get_into(keys, outs) == [6000] * 300
        assert all(bytes(o) == payload(i) for i, o in enumerate(outs))
        assert c.batch_exists(keys[:5] + [b"absent"] + keys[5:10]) == [True] * 5 + [False] + [True] * 5
        assert c.prefix_hits(keys[:20] + [b"absent"] + keys[20:40]) == 20
        assert c.batch_remove(keys[:3]) == [True] * 3 and c.get(keys[0]) is None
        assert c._meta.slots == SLOTS and c._meta.moved == 0
        # A client whose map is wrong everywhere learns every slot from NOT_LEADER answers (MOVED).
        c._meta.map = [info["map"][(s + 1) % SLOTS] if info["map"][(s + 1) % SLOTS] != info["map"][s]
                       else next(a for a in addrs if a != info["map"][s]) for s in range(SLOTS)]
        outs = [bytearray(6000) for _ in keys]
        assert c.batch_get_into(keys, outs) == [-1] * 3 + [6000] * 297
        assert all(bytes(o) == payload(i) for i, o in enumerate(outs) if i >= 3)
        assert c._meta.moved >= SLOTS and c._meta.map == info["map"]
    # The MOVED answer itself: a slot's key sent to a process that does not lead it names the leader and the slot.
    k = keys[5]
    s = slotrules.slot_of("default", k, SLOTS)
    other = next(a for a in addrs if a != info["map"][s])
    with pytest.raises(NotLeader) as e:
        raw(other, Op.EXISTS, {"ns": "default", "keys": [k]})
    assert e.value.leader == info["map"][s] and f"slot {s} is led by {info['map'][s]}" in str(e.value)
    assert raw(info["map"][s], Op.EXISTS, {"ns": "default", "keys": [k]}) == {"exists": [True]}
    # Keys of several slots in one request: refused with a clear error, the server keeps serving.
    two = [k, next(x for x in keys if slotrules.slot_of("default", x, SLOTS) != s)]
    with pytest.raises(RemoteError) as e:
        raw(info["map"][s], Op.EXISTS, {"ns": "default", "keys": two})
    assert e.value.code == wire.Status.BAD_REQUEST and "one slot's keys per request" in str(e.value)
    assert raw(info["map"][s], Op.PING) == {}


def test_one_request_per_process_and_only_moved_keys_rerouted(make_cluster):
    cl = partitioned(make_cluster)
    addrs = [m.addr for m in cl.metaservers]
    info = wait_map(addrs, set(addrs), 30.0)
    procs = set(info["map"])  # the processes that lead slots: all 3, or 2 when the ranking gives one none of the 8
    assert len(procs) >= 2, f"the ranking put all {SLOTS} slots on one process: nothing to route across"
    keys = [f"group{i}".encode() for i in range(240)]
    with cl.client() as c:
        r = c._meta
        assert c.batch_put(keys, [payload(i) for i in range(240)]) == [True] * 240
        sent = dict(r.sent)
        outs = [bytearray(6000) for _ in keys]
        assert c.batch_get_into(keys, outs) == [6000] * 240
        assert all(bytes(o) == payload(i) for i, o in enumerate(outs))
        # 240 keys over 8 slots led by 2-3 processes: one LOOKUP per process, not one per slot.
        assert r.sent[Op.LOOKUP] - sent.get(Op.LOOKUP, 0) == len(procs) and r.moved == 0
        assert c.batch_exists(keys[:50] + [b"absent"]) == [True] * 50 + [False]
        assert c.prefix_hits(keys[:100] + [b"absent"] + keys[100:]) == 100
        # One slot's map entry wrong, pointing at a process that leads other slots of the batch: that slot's keys
        # ride in that process's multi-slot request, are answered NOT_LEADER for that part only and resent to
        # the slot's leader; the other parts are answered in the same request.
        s = slotrules.slot_of("default", keys[0], SLOTS)
        wrong = next(a for a in sorted(procs) if a != info["map"][s])  # leads slots: never the one leading none
        r.map[s] = wrong
        groups = len(set(r.map))  # the processes the (wrong) map names: the moved part rides with another's
        assert {slotrules.slot_of("default", k, SLOTS) for k in keys} == set(range(SLOTS))
        n_slot = sum(1 for k in keys if slotrules.slot_of("default", k, SLOTS) == s)
        sent = dict(r.sent)
        outs = [bytearray(6000) for _ in keys]
        assert c.batch_get_into(keys, outs) == [6000] * 240
        assert all(bytes(o) == payload(i) for i, o in enumerate(outs))
        assert r.moved == 1 and r.map == info["map"]  # learned from the one part's MOVED
        assert r.sent[Op.LOOKUP] - sent.get(Op.LOOKUP, 0) == groups + 1  # one per process, then the moved part
        assert 0 < n_slot < 240
        # A single-slot request to a process that does not lead the slot: refused once (NOT_LEADER naming the
        # leader), resent there; never resent to the process that refused it (a wasted round trip each MOVED).
        only = [k for k in keys if slotrules.slot_of("default", k, SLOTS) == s]
        r.map[s] = next(a for a in addrs if a != info["map"][s])  # any other process, whether it leads slots or not
        sent = dict(r.sent)
        outs = [bytearray(6000) for _ in only]
        assert c.batch_get_into(only, outs) == [6000] * n_slot
        assert all(bytes(o) == payload(keys.index(k)) for k, o in zip(only, outs))
        assert r.moved == 2 and r.map == info["map"]
        assert r.sent[Op.LOOKUP] - sent.get(Op.LOOKUP, 0) == 2  # the refused one, then at the leader
        # Puts too: ALLOC and COMMIT one per process, bytes exact through a fresh read.
        more = [f"group-more{i}".encode() for i in range(120)]
        sent = dict(r.sent)
        assert c.batch_put(more, [payload(i + 7) for i in range(120)]) == [True] * 120
        assert r.sent[Op.ALLOC] - sent.get(Op.ALLOC, 0) == len(procs)
        assert r.sent[Op.COMMIT] - sent.get(Op.COMMIT, 0) == len(procs)
        assert all(c.get(k) == payload(i + 7) for i, k in enumerate(more))
        assert c.batch_remove(more[:30]) == [True] * 30 and c.batch_exists(more[:31]) == [False] * 30 + [True]


def test_multi_slot_request_on_the_wire(make_cluster):
    cl, _, info, keys = filled(make_cluster, "wire", 200, 100)
    by: dict[int, list[bytes]] = {}
    for k in keys:
        by.setdefault(slotrules.slot_of("default", k, SLOTS), []).append(k)
    a = info["map"][0]
    mine = [s for s in sorted(by) if info["map"][s] == a]
    other = next(s for s in sorted(by) if info["map"][s] != a)
    parts = [[s, len(by[s])] for s in mine] + [[other, len(by[other])]]
    flat = [k for s, _ in parts for k in by[s]] + [b"absent-" + by[mine[0]][0]]
    # A key that is not of its part's slot is refused, naming it; the parts must add up to the keys.
    with pytest.raises(RemoteError) as e:
        raw(a, Op.EXISTS, {"ns": "default", "keys": flat, "parts": parts + [[SLOTS - 1, 0]]})
    assert e.value.code == wire.Status.BAD_REQUEST and "'parts': bad entry" in str(e.value)
    with pytest.raises(RemoteError) as e:
        raw(a, Op.ALLOC, {"ns": "default", "keys": [by[other][0]], "sizes": [100], "parts": [[mine[0], 1]]})
    assert e.value.code == wire.Status.BAD_REQUEST and "is not of slot" in str(e.value)
    # Reads trust the parts (only an ALLOC's keys are hashed: an entry lives in its key's slot alone), so a key sent
    # under another slot misses there, though it is in the pool: no error, no wrong answer about that slot.
    got = raw(a, Op.EXISTS, {"ns": "default", "keys": [by[other][0], by[mine[0]][0]], "parts": [[mine[0], 2]]})
    assert got == {"parts": [{"exists": [False, True]}], "failed": []}
    # A single-slot request names its slot ("slot", wire VERSION 10): read as named, an ALLOC's keys checked.
    s0 = mine[0]
    assert raw(a, Op.EXISTS, {"ns": "default", "keys": by[s0][:3], "slot": s0}) == {"exists": [True] * 3}
    assert raw(a, Op.EXISTS, {"ns": "default", "keys": [by[other][0]], "slot": s0}) == {"exists": [False]}
    with pytest.raises(RemoteError) as e:
        raw(a, Op.ALLOC, {"ns": "default", "keys": [by[other][0]], "sizes": [100], "slot": s0})
    assert e.value.code == wire.Status.BAD_REQUEST and f"key 0 is not of slot {s0}" in str(e.value)
    for bad in (SLOTS, -1, "1", None):
        with pytest.raises(RemoteError) as e:
            raw(a, Op.EXISTS, {"ns": "default", "keys": by[s0][:1], "slot": bad})
        assert e.value.code == wire.Status.BAD_REQUEST and "'slot' must be an int" in str(e.value)
    with pytest.raises(NotLeader) as e:  # a slot led elsewhere: MOVED, naming its leader
        raw(a, Op.EXISTS, {"ns": "default", "keys": by[other][:1], "slot": other})
    assert e.value.leader == info["map"][other]
    # The other process's slot fails alone, NOT_LEADER naming its leader; the others are answered in key order.
    res = raw(a, Op.EXISTS, {"ns": "default", "keys": flat[:-1], "parts": parts})
    assert len(res["parts"]) == len(parts) and res["parts"][-1] is None
    assert [x for ans in res["parts"][:-1] for x in ans["exists"]] == [True] * sum(len(by[s]) for s in mine)
    assert len(res["failed"]) == 1 and res["failed"][0][0] == len(parts) - 1
    assert res["failed"][0][1] == wire.Status.NOT_LEADER and res["failed"][0][3] == info["map"][other]
    assert raw(a, Op.PING) == {}


# ----------------------------------------------------------------------------------------------------------------
# failover


def test_sigkill_one_of_three_under_load(make_cluster):
    cl = partitioned(make_cluster)
    addrs = [m.addr for m in cl.metaservers]
    info = wait_map(addrs, set(addrs), 30.0)
    committed: dict[bytes, int] = {}
    errors: list[str] = []
    stop = threading.Event()

    def writer(w: int) -> None:
        with cl.client(timeout=30.0) as c:
            i = 0
            while not stop.is_set() and i < 100_000:
                keys = [f"w{w}-{i + j}".encode() for j in range(16)]
                try:
                    ok = c.batch_put(keys, [payload(w * 1_000_000 + i + j) for j in range(16)])
                except UmbpError as e:
                    errors.append(f"{type(e).__name__}: {e}")
                    ok = [False] * 16
                for j, k in enumerate(keys):
                    if ok[j]:
                        committed[k] = w * 1_000_000 + i + j
                i += 16

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while len(committed) < 300 and time.monotonic() < deadline:
        time.sleep(0.05)
    victim = max(cl.metaservers, key=lambda m: info["map"].count(m.addr))
    led = [s for s, a in enumerate(info["map"]) if a == victim.addr]
    assert led, info
    wait_copies_loaded(cl, 20.0)
    logged = {m.addr: m.err_path.stat().st_size for m in cl.metaservers if m is not victim}
    victim.kill(signal.SIGKILL, wait=True)
    t_kill = time.monotonic()
    survivors = [a for a in addrs if a != victim.addr]
    after = wait_map(survivors, set(survivors), TTL_S + 10.0)
    moved_s = time.monotonic() - t_kill
    # Served, not only mapped: an EXISTS per slot the victim led answers at its new leader.
    with cl.client() as c:
        probe = {}
        for i in range(10_000):
            k = f"probe{i}".encode()
            probe.setdefault(slotrules.slot_of("default", k, SLOTS), k)
            if len(probe) == SLOTS:
                break
        def served() -> bool:
            assert c.batch_exists([probe[s] for s in led]) == [False] * len(led)
            return True

        eventually(served, max(0.0, t_kill + TTL_S + 10 - time.monotonic()), f"the victim's slots {led} served",
                   errors=(UmbpError,))
        served_s = time.monotonic() - t_kill
    before = len(committed)
    try:
        eventually(lambda: len(committed) >= before + 300, 20,
                   lambda: f"300 more pages committed after the failover: {errors[-3:]}")
    finally:
        stop.set()
    for t in threads:
        t.join(60)
    assert len(committed) >= before + 300, f"writers did not carry on after the failover: {errors[-3:]}"
    print(f"\nslot failover: {len(led)} slots of {victim.addr} mapped to survivors after {moved_s:.2f}s, served "
          f"after {served_s:.2f}s (election TTL {TTL_S}s); {len(committed)} pages committed, "
          f"{len(errors)} put errors")
    assert served_s <= TTL_S + 1.0 + 1.5, served_s  # TTL + 1 s, plus a round and the test's own polling
    keys = list(committed)
    with cl.client() as c:
        outs = [bytearray(6000) for _ in keys]
        got = c.batch_get_into(keys, outs)
    lost = [k for k, g in zip(keys, got) if g != 6000]
    wrong = [k for k, o in zip(keys, outs) if bytes(o) != payload(committed[k])]
    assert not lost, f"{len(lost)} committed pages lost, e.g. {lost[:3]}"
    assert not wrong, f"{len(wrong)} pages with wrong bytes"
    assert set(after["map"]) <= set(survivors)
    # Every slot the survivors took since the kill, the victim's first and any moved on to the survivors' own map,
    # started from a loaded warm copy (a process holding one campaigns first), never from a full load.
    took = []
    for m in cl.metaservers:
        if m.addr in logged:
            with open(m.err_path, errors="replace") as fh:
                fh.seek(logged[m.addr])
                took += TAKEOVER.findall(fh.read())
    assert set(led) <= {int(s) for s, _ in took}, (led, took)
    assert all(how == "warm" for _, how in took), took


# ----------------------------------------------------------------------------------------------------------------
# closed pools: per-slot epochs and the FENCE at a takeover

WRITER = "writer-secret-0123456789"


def authed(addr: str, op: int, meta: dict, token: str, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    s = FramedSocket(addr, f"test {addr}", deadline, token)
    try:
        return s.request(op, meta, deadline).meta
    finally:
        s.close()


def test_closed_pool_takeover_fences_the_deposed_leaders_capabilities(make_cluster, tmp_path, monkeypatch):
    """A write capability the old leader of a slot granted is refused at the node once another process took the
    slot over (SIGKILL of the leader): the new leader FENCEd every node before serving, the node names the stale
    epoch; a page the new leader placed in the same region reads back intact."""
    cl = closed_cluster(make_cluster, tmp_path, monkeypatch, tokens_toml({"w": (WRITER, {"t": "rw"})}), nodes=1,
                        metaservers=3, capacity="64MiB", metaserver_flags={"slots": SLOTS, "election_ttl": TTL_S})
    addrs = [m.addr for m in cl.metaservers]

    def leader_map(among: list[str], timeout: float) -> list:
        expect = leaders(SLOTS, among)

        def settled() -> list:
            last = None
            for a in among:
                try:
                    last = authed(a, Op.LEADER, {}, OPS)["map"]
                    break
                except (UmbpError, OSError):
                    continue
            if last != expect:
                raise NotYet(f"map {last}")
            return last

        return eventually(settled, timeout, f"slot map settled on {sorted(among)}", interval=0.1)

    smap = leader_map(addrs, 30.0)
    keys = [f"k{i}".encode() for i in range(2000)]
    s = slotrules.slot_of("t", keys[0], SLOTS)
    mine = [k for k in keys if slotrules.slot_of("t", k, SLOTS) == s]
    old = smap[s]
    size = 8000
    # the slot's leader learns the node from the membership records within a round
    ans = eventually(lambda: authed(old, Op.ALLOC, {"ns": "t", "keys": mine[:2], "sizes": [size, size]}, WRITER), 10,
                     f"an ALLOC answered by {old}", interval=0.1, errors=(UmbpError,))
    (state, node_id, off, plen, gen, tag, ix), second = ans["items"]
    cap = ans["caps"][ix]
    assert state == second[0] == wire.AllocState.NEW and plen == size and second[6] == ix

    def stale_write(at: int, g: int, t: int) -> None:
        w = FramedSocket(node, "stale writer", time.monotonic() + 5, WRITER)
        try:
            with pytest.raises(AuthError, match=r"slot %d at stale epoch 0x[0-9a-f]+: the slot was taken over" % s):
                w.request(Op.WRITE, [at, g, cap], time.monotonic() + 5,
                          data=[objformat.pack_object_header(t, g, size), b"\xee" * size])
        finally:
            w.close()
    assert slotrules.epoch_slot(int.from_bytes(cap[:8], "little")) == s  # a slot leader's epoch names its slot
    node = next(n["addr"] for n in authed(old, Op.NODES, {}, OPS)["nodes"] if n["node_id"] == node_id)
    victim = next(m for m in cl.metaservers if m.addr == old)
    victim.kill(signal.SIGKILL, wait=True)
    survivors = [a for a in addrs if a != old]
    smap = leader_map(survivors, TTL_S + 15.0)
    # The map names a slot's new leader once it is elected; it serves the slot once its FENCE reached every node
    # (SlotServer._elected). Wait for that (an EXISTS of the slot's key answered there), not for a sleep.
    eventually(lambda: authed(smap[s], Op.EXISTS, {"ns": "t", "keys": mine[:1]}, WRITER) or True, 15.0,
               f"slot {s} served by its new leader {smap[s]}", interval=0.1, errors=(UmbpError,))
    # Refused before the new term wrote anything on the node: the FENCE, not a newer capability, raised the floor.
    stale_write(second[2], second[4], second[5])
    # The new leader does not know the dead one's PENDING allocation: it places new pages over the same bytes.
    pages = {k: os.urandom(size) for k in mine[2:18]}
    with scoped_client(",".join(survivors), WRITER, "t") as c:
        def stored() -> bool:
            assert c.batch_put(list(pages), list(pages.values())) == [True] * len(pages)
            return True

        eventually(stored, 10, "the new pages stored", interval=0.1, errors=(UmbpError,))
        locs = authed(smap[s], Op.LOOKUP, {"ns": "t", "keys": list(pages)}, WRITER)["locs"]
        overlapped = [k for k, loc in zip(pages, locs) if loc[1] < off + objformat.object_size(size) and
                      off < loc[1] + objformat.object_size(loc[2])]
        stale_write(off, gen, tag)
        outs = [bytearray(size) for _ in pages]
        assert c.batch_get_into(list(pages), outs) == [size] * len(pages)
        assert all(bytes(o) == p for o, p in zip(outs, pages.values()))
    print(f"\nclosed slot takeover: the dead leader's capability for {off}+{size} refused at the node "
          f"({len(overlapped)} of the new leader's pages over those bytes), every new page intact")
    assert overlapped, (off, locs)  # the capability aimed at bytes the new term reused


def test_slot_floors_survive_a_node_restart_with_the_same_arena(make_cluster, tmp_path, monkeypatch):
    """A node's per-slot epoch floors are kept next to its arena: after a SIGKILL and a restart with the same node id
    and arena, a FENCE of slot 3 at an older epoch answers the floor set before the crash (a deposed leader's
    capabilities stay dead across the restart), slot 5 kept its own floor, and a new arena starts with none."""
    from closedpool import SECRET
    from umbp.auth import Tokens, fence_token

    cl = closed_cluster(make_cluster, tmp_path, monkeypatch, tokens_toml({}), nodes=1)
    node = cl.nodes[0]
    tokens = Tokens(SECRET.encode(), {})

    def fence(slot: int, counter: int) -> int:
        info = authed(node.addr, Op.ARENA_INFO, {}, OPS)
        key = tokens.cap_key(info["node_id"], info["arena_id"])
        epoch = slotrules.SLOT_EPOCH | (slot << slotrules.SLOT_GEN_SHIFT) | counter
        return authed(node.addr, Op.FENCE, fence_token(key, epoch, SLOTS), OPS)["floor"] & ((1 << 52) - 1)

    assert fence(3, 900) == 900 and fence(5, 40) == 40 and fence(3, 100) == 900
    arena = authed(node.addr, Op.ARENA_INFO, {}, OPS)["arena_id"]
    monkeypatch.setenv("UMBP_TOKEN", SECRET)  # the node's own secret for its restarts (closed_cluster forgot it)
    node.restart(sig=signal.SIGKILL)
    assert authed(node.addr, Op.ARENA_INFO, {}, OPS)["arena_id"] == arena  # the same arena, reopened
    assert fence(3, 100) == 900 and fence(5, 1) == 40 and fence(6, 2) == 2
    for f in node.arena_files():  # a new arena (the old one and its floors gone) starts with no floors
        f.unlink()
    node.restart(sig=signal.SIGKILL)
    assert authed(node.addr, Op.ARENA_INFO, {}, OPS)["arena_id"] != arena
    assert fence(3, 100) == 100


# ----------------------------------------------------------------------------------------------------------------
# joins and leaves


def test_join_takes_its_share_and_leave_gives_it_back(make_cluster):
    cl = partitioned(make_cluster, metaservers=1)
    first = cl.metaserver.addr
    wait_map([first], {first}, 30.0)
    keys = [f"j{i}".encode() for i in range(200)]
    with cl.client() as c:
        assert all(c.batch_put(keys, [payload(i) for i in range(200)]))
    joined = cl.harness.metaserver(cl.etcd.url, slots=SLOTS, election_ttl=TTL_S)
    cl.metaservers.append(joined)
    info = wait_map([first, joined.addr], {first, joined.addr}, 30.0)
    want = {str(s) for s, a in enumerate(leaders(SLOTS, [first, joined.addr])) if a == joined.addr}
    assert {str(s) for s, a in enumerate(info["map"]) if a == joined.addr} == want  # exactly its ranked share
    with cl.client() as c:  # a client that only knows the first address still reaches every slot
        outs = [bytearray(6000) for _ in keys]
        assert c.batch_get_into(keys, outs) == [6000] * 200
        assert all(bytes(o) == payload(i) for i, o in enumerate(outs))
        assert all(c.batch_put([b"after-join"], [payload(7)]))
    st = cl.cli_json("stats")
    assert sorted(m["addr"] for m in st["metaservers"]) == sorted([first, joined.addr])
    assert st["objects"] == 201 and st["slots"] == SLOTS
    joined.stop()  # a clean leave: its slots are handed back at once (lease revoked), not after the TTL
    assert "left the pool: lease" in joined.stderr_text(), joined.tail()
    t0 = time.monotonic()
    wait_map([first], {first}, 10.0)
    print(f"\nslots of the process that left led by the other after {time.monotonic() - t0:.2f}s (TTL {TTL_S}s)")
    with cl.client() as c:
        outs = [bytearray(6000) for _ in keys]
        assert c.batch_get_into(keys, outs) == [6000] * 200
        assert all(bytes(o) == payload(i) for i, o in enumerate(outs))
        assert c.get(b"after-join") == payload(7)


# ----------------------------------------------------------------------------------------------------------------
# operations


def test_a_closed_partitioned_pool_puts_as_arrays(make_cluster, tmp_path, monkeypatch):
    """A batch over every slot of a closed, partitioned pool (two nodes, one process) takes the array put path
    (``umbp/putbatch.py``) over tcp: the router merges the parts' packed ALLOC rows (``lookup.merge_allocs``), so
    each node appears once a slot in the answer with that slot's own write capability, and a node's pages go out as
    one batch with each page's capability, every one checked by the node. Every page reads back byte-exact; a second
    put of the same keys stores nothing (dedup). (Over shm across slots: test_attack_late_write's same-host test.)"""
    transport = "tcp"
    from umbp import putbatch

    cl = closed_cluster(make_cluster, tmp_path, monkeypatch, tokens_toml({"w": (WRITER, {"t": "rw"})}), nodes=2,
                        capacity="64MiB", metaserver_flags={"slots": SLOTS})
    calls = []
    real = putbatch.write
    monkeypatch.setattr(putbatch, "write", lambda *a, **k: calls.append(a[4]) or real(*a, **k))
    keys = [f"arr-{transport}-{i}".encode() for i in range(96)]
    assert set(slotrules.slots_of("t", keys, SLOTS)) == set(range(SLOTS))
    vals = [payload(i, 16384) for i in range(len(keys))]
    with scoped_client(cl.metaservers[0].addr, WRITER, "t", transport=transport) as c:
        assert c.batch_put(keys, vals) == [True] * len(keys)
        assert calls, "the array put path did not run"
        assert c.batch_put(keys, vals) == [False] * len(keys)
        assert [c.get(k) for k in keys] == vals
