"""Correctness attack on a TCP WRITE that outlives its allocation: real etcd, metaserver and node processes.

persistence-and-fencing.md ('Handing on open allocations') once said: "A leader that dies leaves no record: its open
allocations are forgotten, and a late write is caught by the reader's header check (a CorruptionError, never wrong
bytes)". It is not: a node checks a WRITE (range, capability, ledger) when its frame starts, then receives the data
straight into the arena slot as it arrives (umbp/node/server.py ``write_sink``/``writev_pieces``): the object header first,
the payload after. A write whose first bytes arrived while its allocation was live and whose rest arrives after the
allocation ended (its leader died, or it expired after ``pending_ttl_s``) and a new page was placed in the same
extent overwrites that page's payload and leaves the new page's header in place: every reader then gets the late
writer's bytes under the new page's header, with no error.

The network is a proxy (tests/test_attack_leases.py ``node_proxy``, ``hold_new``): it lets the first MiB of the late
writer's connection through and holds the rest while the allocation ends and a new page is placed in the same extent.

The fix: an ALLOC answer says by when its writes must have landed (``write_until_ms``, ``write_cap_ttl_s`` after
it); the client sends it with each WRITEV op (``until_ms``) and the node looks at its wall clock before each
receive into its arena (at most ``WRITE_CHUNK`` at a time): past it, the rest of the frame goes to scratch and the
ops answer UNAVAILABLE, so the writer's put aborts. The metaserver places nothing in such an extent before then: an
expired allocation's extent is kept out of placement for the quarantine's ``keep_s``. A leader that dies hands
nothing on: the node stops its writers instead (a generation floor per term, raised by the new leader's REGISTER
answer or FENCE before it places on the node; a write below it lands no further byte, docs/design/
persistence-and-fencing.md).
"""

from __future__ import annotations

import random
import signal
import threading
import time

import pytest

from transport import objformat, slotrules, wire
from umbp.errors import UmbpError
from umbp.node.server import WRITE_CHUNK

from cluster import eventually
from test_attack_leases import PAGE, node_proxy
from test_disk_node import deadline, node_sock, put as put_objects

CAPACITY = "80MiB"  # two 40 MiB objects: a 40 MiB page fits in one place only at a time
# read leases of 30 s: B's lease on "filler" keeps it from eviction until W's extent is placeable again
FLAGS = {"env": {"UMBP_HIGH_WATERMARK": "1.0", "UMBP_LOW_WATERMARK": "1.0", "UMBP_READ_LEASE_S": "30"}}


def _late_write(make_cluster, flags: dict, lose, why: str = "deadline") -> None:
    """W's put: its WRITE's first MiB reaches the node, the rest is delayed in the network; ``lose(c)`` ends W's
    allocation; B then puts "new", which lands in the same extent (the only room: B's read lease pins "filler") once
    the metaserver may place there (past W's write deadline); the rest of W's WRITE arrives. W's put fails (the node
    refused the rest: past its deadline); "new" reads back as its bytes: never W's payload under "new"'s header."""
    c = make_cluster(nodes=1, capacity=CAPACITY, metaserver_flags=flags, node_flags={"advertise": "127.0.0.2"})
    node = c.nodes[0]
    valve = node_proxy(node.port)  # answers pass: only W's request is held
    rng = random.Random(4704)
    late, new, filler = (rng.randbytes(PAGE) for _ in range(3))
    w = c.client(transport="tcp", timeout=120)
    try:
        with c.client() as b:
            assert b.batch_put([b"filler"], [filler]) == [True]
            at = b.admin(wire.Op.LOOKUP, {"ns": "default", "keys": [b"filler"]})["locs"][0][1]  # leased, not released
            valve.hold_new(1 << 20)
            put: dict = {}

            def late_put() -> None:
                try:
                    put["ok"] = w.batch_put([b"late"], [late])
                except Exception as e:  # noqa: BLE001 - W's put may fail: only the pages' bytes are checked
                    put["error"] = e

            tw = threading.Thread(target=late_put, daemon=True)
            tw.start()
            eventually(lambda: valve.kept >= PAGE - (2 << 20), 30, "W's WRITE held in the network")
            lose(c)
            # no room until W's extent may be placed again: PoolFull (or UNAVAILABLE) meanwhile
            eventually(lambda: b.batch_put([b"new"], [new]) == [True], 60, "B's page put", errors=(UmbpError,))
            assert b.get(b"new") == new
            assert b.admin(wire.Op.LOOKUP, {"ns": "default", "keys": [b"new"]})["locs"][0][1] != at  # in W's extent
            valve.release()  # the rest of W's WRITE reaches the node now
            tw.join(120)
            assert not tw.is_alive()
            value = b.get(b"new")
        same = sum(x == y for x, y in zip(value[::4096], late[::4096]))
        assert value == new, (f"'new' reads back {len(value)} bytes that are not its page's: {same} of "
                              f"{len(value[::4096])} sampled bytes are W's late payload")
        assert "error" in put and why in str(put["error"]), put  # the node discarded the rest
    finally:
        w.close()
        valve.close()


def test_a_late_write_of_a_dead_leaders_allocation_never_overwrites_the_next_page_in_its_extent(make_cluster):
    """W's allocation is forgotten with its leader: leader 1 is SIGKILLed, leader 2 places "new"."""

    def lose(c) -> None:
        c.metaserver.restart(sig=signal.SIGKILL)
        c.wait_nodes()

    # W's deadline far off: the hole shows however long the restart takes on a loaded machine
    _late_write(make_cluster, {"env": dict(FLAGS["env"], UMBP_WRITE_CAP_TTL_S="120")}, lose, "deposed metaserver term")


def test_a_write_slower_than_its_allocation_never_overwrites_the_next_page_in_its_extent(make_cluster):
    """No failure at all: W's allocation expires (``pending_ttl_s``, 2 s here) while its WRITE is still on its way;
    the expiry keeps its extent out of placement for the quarantine's ``keep_s``, past W's write deadline."""

    def lose(c) -> None:
        eventually(lambda: c.ask("stats")["pending"] == 0, 30, "W's allocation expired")

    flags = {"env": dict(FLAGS["env"], UMBP_PENDING_TTL_S="2")}
    _late_write(make_cluster, flags, lose)


def _cut_mid_frame(s, op: list, header: bytes, late: bytes, first: int, old: bytes, between, why: str,
                   payload) -> bytes:
    """A WRITEV of ``op`` whose header and first ``first`` bytes of ``late`` are sent, then ``between()`` (its
    deadline passes, its term is fenced), then the rest: its answer fails the op naming ``why``, and the page keeps
    ``old`` past ``first``, and before it ``late``'s bytes up to where the node stopped receiving, ``old``'s after
    (the node receives what has arrived when it looks: part of the first bytes may be cut too). Returns the page."""
    rid = s.next_id()
    s.send([wire.encode(wire.Op.WRITEV, rid, [op], data_len=len(header) + len(late)), header, late[:first]],
           deadline())
    between()
    s.send([late[first:]], deadline())
    f = s.recv_frame(deadline())
    assert f.request_id == rid
    failed = wire.vec_failures(f.meta, 1, "test")
    assert list(failed) == [0] and why in str(failed[0]), failed
    got = payload()
    assert got[first:] == old[first:]  # not one byte that arrived after it
    cut = next((i for i in range(first) if got[i] != late[i]), first)  # where the late bytes stop
    assert got[cut:first] == old[cut:first]  # one cut: late bytes, then the page's own
    return got


def test_a_write_whose_deadline_passes_mid_frame_lands_no_further_byte(make_cluster):
    """The node alone, over a raw connection: a WRITEV whose ``until_ms`` passes while its data is on its way lands
    nothing that arrives after it (the page keeps its old bytes there), answers its op UNAVAILABLE naming the
    deadline, and the connection stays in sync; one already past when its frame starts, and a WRITE past it, land
    nothing at all. A WRITEV without ``until_ms`` (an older client) lands as before."""
    c = make_cluster(nodes=1, capacity="64MiB")
    rng = random.Random(4706)
    plen = 3 * WRITE_CHUNK  # several receives into the arena
    (obj,) = put_objects(c, rng, [plen])
    old = obj["payload"]
    hs = objformat.OBJ_HEADER_SIZE
    header = objformat.pack_object_header(obj["tag"], obj["gen"], plen)
    read = [[obj["dram"], 0, plen, obj["tag"], obj["gen"], plen, b""]]
    first = 1 << 20
    with node_sock(c) as s:
        def payload() -> bytes:
            f = s.request(wire.Op.READV, read, deadline())
            assert f.meta is None
            return bytes(f.data)[hs:]

        # the deadline passes after the first MiB arrived: nothing after it lands
        late = rng.randbytes(plen)
        until = int(time.time() * 1000) + 300

        def deadline_passes() -> None:
            eventually(lambda: time.time() * 1000 > until + 20, 5, "the write's deadline passed")

        got = _cut_mid_frame(s, [obj["dram"], obj["gen"], b"", hs + plen, until], header, late, first, old,
                             deadline_passes, "deadline", payload)
        # a WRITEV or a WRITE already past its deadline when its frame starts: the frame is refused (UNAVAILABLE),
        # nothing lands, the connection still serves
        past = int(time.time() * 1000) - 1
        for op, meta in ((wire.Op.WRITEV, [[obj["dram"], obj["gen"], b"", hs + plen, past]]),
                         (wire.Op.WRITE, [obj["dram"], obj["gen"], b"", past])):
            with pytest.raises(UmbpError, match="deadline") as e:
                s.request(op, meta, deadline(), data=[header, rng.randbytes(plen)])
            assert e.value.code == wire.Status.UNAVAILABLE
            assert payload() == got
        # in time, and without a deadline (an older client): written whole
        for extra in ([int(time.time() * 1000) + 60_000], []):
            fresh = rng.randbytes(plen)
            f = s.request(wire.Op.WRITEV, [[obj["dram"], obj["gen"], b"", hs + plen, *extra]], deadline(),
                          data=[header, fresh])
            assert f.meta is None
            assert payload() == fresh


def test_a_write_whose_slot_is_fenced_mid_frame_lands_no_further_byte(make_cluster):
    """A partitioned open pool's node alone, over raw connections: a WRITEV whose data is still arriving when a FENCE
    raises its slot's floor above its generation (a new slot leader took over: the writer's grant is a deposed
    term's) lands nothing that arrives after the FENCE, answers its op UNAVAILABLE naming the deposed term, and the
    connection stays in sync; a write of that generation is refused whole from then on. An open pool's FENCE is
    ``{epoch, slots}``; anything else is refused naming its form."""
    slots = 4
    c = make_cluster(nodes=1, capacity="64MiB", metaserver_flags={"slots": slots})
    rng = random.Random(4707)
    plen = 3 * WRITE_CHUNK
    (obj,) = put_objects(c, rng, [plen])
    old, gen = obj["payload"], obj["gen"]
    hs = objformat.OBJ_HEADER_SIZE
    header = objformat.pack_object_header(obj["tag"], gen, plen)
    read = [[obj["dram"], 0, plen, obj["tag"], gen, plen, b""]]
    first = 1 << 20
    epoch = slotrules.SLOT_EPOCH | (gen + 1)  # the next term of gen's slot starts above gen
    with node_sock(c) as s, node_sock(c) as leader:
        def payload() -> bytes:
            f = s.request(wire.Op.READV, read, deadline())
            assert f.meta is None
            return bytes(f.data)[hs:]

        with pytest.raises(UmbpError, match="an open pool's fence is"):
            leader.request(wire.Op.FENCE, b"\x00" * 40, deadline())
        def fence() -> None:  # answered once the node raised the floor
            assert leader.request(wire.Op.FENCE, {"epoch": epoch, "slots": slots}, deadline()).meta == {"floor": epoch}

        got = _cut_mid_frame(s, [obj["dram"], gen, b"", hs + plen], header, rng.randbytes(plen), first, old, fence,
                             "deposed metaserver term", payload)
        # a write of that generation starting now: a WRITEV's op is refused (its data discarded), a WRITE whole
        f = s.request(wire.Op.WRITEV, [[obj["dram"], gen, b"", hs + plen]], deadline(),
                      data=[header, rng.randbytes(plen)])
        failed = wire.vec_failures(f.meta, 1, "test")
        assert list(failed) == [0] and "deposed metaserver term" in str(failed[0]), failed
        assert payload() == got
        with pytest.raises(UmbpError, match="deposed metaserver term") as e:
            s.request(wire.Op.WRITE, [obj["dram"], gen, b""], deadline(), data=[header, rng.randbytes(plen)])
        assert e.value.code == wire.Status.UNAVAILABLE
        assert payload() == got


def test_a_same_host_writer_copies_nothing_for_a_deposed_term(make_cluster):
    """A shm writer, which the node cannot stop, compares its generations with the floors the node publishes in its
    arena's superblock page before it copies: once a FENCE raised a slot's floor above every generation its leader
    hands out (as a new leader's would above a deposed one's), puts of the slot's keys over shm copy nothing and fail
    naming the deposed term, by the array path and the per-page path alike; other slots' puts land byte-exact."""
    slots = 4
    c = make_cluster(nodes=1, capacity="64MiB", metaserver_flags={"slots": slots})
    rng = random.Random(4708)
    keys = [f"shm-{i}".encode() for i in range(64)]
    slot_of = {k: slotrules.slot_of("default", k, slots) for k in keys}
    s = slot_of[keys[0]]
    mine = [k for k in keys if slot_of[k] == s]
    other = [k for k in keys if slot_of[k] != s]
    assert len(mine) >= 3 and other
    size = 64 << 10
    with c.client(transport="shm") as w:
        first = rng.randbytes(size)
        assert w.batch_put([mine[0]], [first]) == [True]
        gen = w.admin(wire.Op.LOOKUP, {"ns": "default", "keys": [mine[0]]})["locs"][0][3]
        epoch = slotrules.SLOT_EPOCH | (gen + (1 << 40))  # the slot's leader grants below this from now on
        with node_sock(c) as leader:
            assert leader.request(wire.Op.FENCE, {"epoch": epoch, "slots": slots}, deadline()).meta == {"floor": epoch}
        stale = [rng.randbytes(size) for _ in mine[1:3]]
        with pytest.raises(UmbpError, match="deposed metaserver term"):
            w.batch_put(mine[1:3], stale)  # the array path (64 KiB pages of bytes)
        with pytest.raises(UmbpError, match="deposed metaserver term"):
            w.put(mine[1], memoryview(bytearray(stale[0])))  # one page: the transport's start_write
        assert w.batch_exists(mine[1:3]) == [False, False]
        assert w.get(mine[0]) == first  # written before the FENCE: kept
        fresh = [rng.randbytes(size) for _ in other]
        assert w.batch_put(other, fresh) == [True] * len(other)
        assert [w.get(k) for k in other] == fresh
