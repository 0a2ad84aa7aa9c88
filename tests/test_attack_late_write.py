"""Correctness attack on a TCP WRITE that outlives its allocation: real etcd, metaserver and node processes.

persistence-and-fencing.md ('Handing on open allocations'): "A leader that dies leaves no record: its open
allocations are forgotten, and a late write is caught by the reader's header check (a CorruptionError, never wrong
bytes)". A node checks a WRITE (range, capability, ledger) when its frame starts, then receives the data straight
into the arena slot as it arrives (umbp/node/server.py ``write_sink``/``writev_pieces``): the object header first,
the payload after. A write whose first bytes arrived while its allocation was live and whose rest arrives after the
allocation ended (its leader died, or it expired after ``pending_ttl_s``) and a new page was placed in the same
extent overwrites that page's payload and leaves the new page's header in place: every reader then gets the late
writer's bytes under the new page's header, with no error.

The network is the valve of tests/test_attack_leases.py: it lets the first MiB of the late writer's connection
through and holds the rest while the allocation ends and a new page is placed in the same extent.
"""

from __future__ import annotations

import random
import signal
import threading

import pytest

from cluster import eventually
from test_attack_leases import PAGE, Valve

CAPACITY = "80MiB"  # two 40 MiB objects: a 40 MiB page fits in one place only at a time
FLAGS = {"env": {"UMBP_HIGH_WATERMARK": "1.0", "UMBP_LOW_WATERMARK": "1.0"}}
LATE_WRITE = ("hole: a node checks a TCP WRITE when its frame starts and then streams its data into the arena as it "
              "arrives, with no deadline: a write whose rest arrives after its leader died (or its allocation was "
              "freed) overwrites the payload of the page placed there since, under that page's valid header")


def _late_write(make_cluster, flags: dict, lose) -> None:
    """W's put: its WRITE's first MiB reaches the node, the rest is delayed in the network; ``lose(c)`` ends W's
    allocation; B then puts "new", which lands in the same extent (the only room); the rest of W's WRITE arrives.
    "new" must read back as its bytes, a miss or an error: never W's payload under "new"'s header."""
    c = make_cluster(nodes=1, capacity=CAPACITY, metaserver_flags=flags, node_flags={"advertise": "127.0.0.2"})
    node = c.nodes[0]
    valve = Valve(("127.0.0.2", node.port), ("127.0.0.1", node.port))
    valve.open()  # answers pass: only W's request is held
    rng = random.Random(4704)
    late, new, filler = (rng.randbytes(PAGE) for _ in range(3))
    w = c.client(transport="tcp", timeout=120)
    try:
        with c.client() as b:
            assert b.batch_put([b"filler"], [filler]) == [True]
            valve.hold_new(1 << 20)
            put: dict = {}

            def late_put() -> None:
                try:
                    put["ok"] = w.batch_put([b"late"], [late])
                except Exception as e:  # noqa: BLE001 - W's put may fail: only the pages' bytes are checked
                    put["error"] = e

            tw = threading.Thread(target=late_put, daemon=True)
            tw.start()
            eventually(lambda: valve.kept_bytes() >= PAGE - (2 << 20), 30, "W's WRITE held in the network")
            lose(c)
            eventually(lambda: b.batch_put([b"new"], [new]) == [True], 60, "B's page put")
            assert b.get(b"new") == new
            valve.release_new()  # the rest of W's WRITE reaches the node now
            tw.join(120)
            assert not tw.is_alive()
            try:
                value = b.get(b"new")
            except Exception:  # noqa: BLE001 - an error is an allowed outcome
                value = None
        if value is not None:
            same = sum(x == y for x, y in zip(value[::4096], late[::4096]))
            assert value == new, (f"'new' reads back {len(value)} bytes that are not its page's: {same} of "
                                  f"{len(value[::4096])} sampled bytes are W's late payload")
    finally:
        w.close()
        valve.close()


@pytest.mark.xfail(strict=True, reason=LATE_WRITE)
def test_a_late_write_of_a_dead_leaders_allocation_never_overwrites_the_next_page_in_its_extent(make_cluster):
    """W's allocation is forgotten with its leader: leader 1 is SIGKILLed, leader 2 places "new"."""

    def lose(c) -> None:
        c.metaserver.restart(sig=signal.SIGKILL)
        c.wait_nodes()

    _late_write(make_cluster, dict(FLAGS), lose)


@pytest.mark.xfail(strict=True, reason=LATE_WRITE)
def test_a_write_slower_than_its_allocation_never_overwrites_the_next_page_in_its_extent(make_cluster):
    """No failure at all: W's allocation expires (``pending_ttl_s``, 2 s here) while its WRITE is still on its way;
    the extent is placeable at once (the expiry frees it, it is no closed connection's or written ABORT's)."""

    def lose(c) -> None:
        eventually(lambda: c.ask("stats")["pending"] == 0, 30, "W's allocation expired")

    flags = {"env": dict(FLAGS["env"], UMBP_PENDING_TTL_S="2")}
    _late_write(make_cluster, flags, lose)
