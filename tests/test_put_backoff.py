"""A put backing off on a key another writer holds PENDING (IN_FLIGHT) does not hold the client lock while it waits:
another thread's get on the same client completes during the backoff. Real etcd, metaserver and node.

The other writer is a second client whose write is held (its ``_run`` waits on an event), so its key stays PENDING
for as long as the test wants; the backing-off put is observed through its ``_put_once`` answers (a count of rounds
that found the key IN_FLIGHT), never through wall-clock time."""

from __future__ import annotations

import threading

import umbp

WAIT_S = 20.0  # bound on every wait below; nothing here takes more than a fraction of it when it works
PUT_TIMEOUT_S = 3 * WAIT_S  # the backing-off put's deadline: longer than the get is given


def test_get_completes_while_a_put_backs_off(cluster):
    addr = cluster.metaserver_addr
    with umbp.Client(addr, namespace="backoff", transport="tcp") as writer, \
            umbp.Client(addr, namespace="backoff", transport="tcp", timeout=PUT_TIMEOUT_S) as shared:
        assert shared.put("other", b"o" * 4096) is True
        # the other writer: ALLOC done, its write held, so "k" is PENDING at the metaserver
        in_write, release = threading.Event(), threading.Event()
        real_run = writer._run

        def held_run(batches, kind, deadline):
            if kind == "write":
                in_write.set()
                release.wait(WAIT_S)
            return real_run(batches, kind, deadline)

        writer._run = held_run
        writer_result: list = []
        wt = threading.Thread(target=lambda: writer_result.append(writer.put("k", b"w" * 4096)), daemon=True)
        wt.start()
        assert in_write.wait(WAIT_S)

        # the shared client's put finds "k" IN_FLIGHT and backs off; count those rounds
        rounds_waiting = []
        backing_off = threading.Event()
        real_once = shared.puts._put_once

        def counted_once(*a, **k):
            res = real_once(*a, **k)
            if res[4]:  # keys IN_FLIGHT
                rounds_waiting.append(len(res[4]))
                backing_off.set()
            return res

        shared.puts._put_once = counted_once
        put_result: list = []
        pt = threading.Thread(target=lambda: put_result.append(shared.put("k", b"s" * 4096)), daemon=True)
        pt.start()
        assert backing_off.wait(WAIT_S), "the shared client's put never saw the key IN_FLIGHT"

        # a get on the same client, from another thread, while that put is still backing off
        got: list = []
        gt = threading.Thread(target=lambda: got.append(shared.get("other")), daemon=True)
        gt.start()
        gt.join(WAIT_S)
        put_still_waiting = pt.is_alive() and not put_result
        release.set()
        assert got == [b"o" * 4096], "the get did not complete while the put was backing off (client lock held?)"
        assert put_still_waiting, "the put finished before the get: the test proved nothing"
        wt.join(WAIT_S)
        pt.join(WAIT_S)
        assert writer_result == [True]
        assert put_result == [False]  # the other writer stored it: False means the page is there
        assert len(rounds_waiting) >= 1 and set(rounds_waiting) == {1}
        assert shared.get("k") == b"w" * 4096
        print(f"\nput backed off {len(rounds_waiting)} rounds; the get completed during the backoff")
