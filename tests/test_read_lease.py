"""A tcp read that outlives its read lease is a miss, never bytes (review of issue 42: ``transport/base.py`` once
said only shm covered it). The LOOKUP answer says how long its lease pins the hits (``lease_ms``); the client counts
a tcp/rdma read finished later than that after it sent the LOOKUP as a miss (``Client._late_reads_missed``): past
the lease the object may have been evicted and its extent rewritten while the node was still sending it. Real etcd,
metaserver and node; the node is frozen with SIGSTOP between the LOOKUP and the read's answer."""

from __future__ import annotations

import os
import signal
import threading

LEASE_S = 1.0
PAGE = 1 << 20


def test_a_tcp_read_finished_after_its_lease_is_a_miss(make_cluster):
    cl = make_cluster(nodes=1, metaserver_flags={"env": {"UMBP_READ_LEASE_S": str(LEASE_S)}})
    data = os.urandom(PAGE)
    with cl.client(transport="tcp", timeout=20) as c:
        assert c.put("late", data)
        out = bytearray(PAGE)
        assert c.get_into("late", out) == PAGE and out == data  # in time: the bytes
        node = cl.nodes[0]
        node.kill(signal.SIGSTOP)  # the LOOKUP is answered; the node answers the read only after the lease ended
        # thawed well past the lease: the LOOKUP right after the freeze is answered long before (a margin for a
        # loaded machine; the client's own late check is what is tested, not this timer's precision)
        thaw = threading.Timer(LEASE_S + 3.0, node.kill, (signal.SIGCONT,))
        thaw.start()
        try:
            out = bytearray(PAGE)
            assert c.get_into("late", out) == -1, "a read finished past its lease was handed out as data"
        finally:
            thaw.join()
        assert c.stats()["client"]["late_reads"] == 1
        out = bytearray(PAGE)
        assert c.get_into("late", out) == PAGE and out == data  # the page itself is fine: the next get has it
