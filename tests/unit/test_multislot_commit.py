"""A multi-slot COMMIT (``metaserver/ha/multislot.py``): each part's pages go to its slot's writer at once, the parts'
waits are awaited in one task (``_in_turn``), a part whose write fails fails alone (the others committed), and the
commit latency histogram counts each part from its hand-over to the writer. In process: a ``Partition`` of 4 slots
whose slot servers serve without an election, etcd's transactions answered at once (no etcd is reached)."""

from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace

import numpy as np

from metaserver.ha import multislot
from metaserver.ha.partition import Partition
from metaserver.ha.service import Metaserver
from metaserver.store.persist import EtcdStore
from transport import answerrows, slotrules
from transport.wire import AllocState, Op, Status
from umbp.config import MetaserverConfig
from umbp.errors import Unavailable

SLOTS = 4
NS = "ns"


class _Scope:
    @staticmethod
    def check(ns, write, component):
        return None


class Conn:
    def __init__(self):
        self.auth = SimpleNamespace(scope=_Scope())
        self.version = 12
        self.closed = False
        self.peer = "test"
        self.slot_conns: dict = {}  # its views in a partitioned pool's slots (server.Connection's)


async def _sent(self, req) -> bool:
    _sent.txns += 1
    return True


def pool(monkeypatch) -> Partition:
    monkeypatch.setattr(Metaserver, "serving", property(lambda self: True))
    _sent.txns = 0
    monkeypatch.setattr(EtcdStore, "send", _sent)
    p = Partition(MetaserverConfig(token=None), "127.0.0.1:1", SLOTS)
    members = {"n0": SimpleNamespace(cap_key=None, cap_epoch=0)}
    for s in range(SLOTS):
        srv = p.servers[str(s)]
        srv.members.get = members.get
        srv.dir.add_space("n0", 1 << 26)
        srv.gens._ranges = deque([[(s << 52) + 1, (s << 52) + (1 << 40)]])
        srv.settled.set()
        srv.writer.start()
    return p


def request(per: int, slots=range(SLOTS)) -> dict:
    keys = [b"key-%d" % i for i in range(400)]
    by: dict[int, list[bytes]] = {}
    for k, s in zip(keys, slotrules.slots_of(NS, keys, SLOTS).tolist()):
        by.setdefault(s, []).append(k)
    return {"ns": NS, "keys": [k for s in slots for k in by[s][:per]], "parts": [[s, per] for s in slots]}


async def _ask(p, op: int, meta: dict, conn):
    res = p.handlers[op](meta, conn)
    return res if type(res) is dict else await res


def test_a_commit_of_every_slot_is_one_transaction_and_a_failed_part_fails_alone(monkeypatch):
    async def run():
        p = pool(monkeypatch)  # in the loop: the writers' tasks start
        conn = Conn()
        meta = request(3)
        ans = await _ask(p, Op.ALLOC, dict(meta, sizes=[4000] * 12), conn)
        rows = np.concatenate([np.frombuffer(a["rows"], answerrows.ALLOC_ROW) for a in ans["parts"]])
        assert (rows["state"] == AllocState.NEW).all()
        # slot 2's write fails: its part alone answers UNAVAILABLE, the others are durable and answered ok
        srv = p.servers["2"]
        real = srv._apply

        def failing(fx, wait=False):
            real(fx, wait=False)
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(Unavailable("metaserver", "etcd away", Status.UNAVAILABLE))
            return fut
        monkeypatch.setattr(srv, "_apply", failing)
        before = _sent.txns
        done = await _ask(p, Op.COMMIT, dict(meta, gens=rows["gen"].tolist()), conn)
        assert done["parts"][2] is None and [f[:2] for f in done["failed"]] == [[2, Status.UNAVAILABLE]]
        assert [a["ok"] for i, a in enumerate(done["parts"]) if i != 2] == [[True] * 3] * 3
        assert _sent.txns - before == 1  # the four slots' records in one combined transaction
        count = p.servers["0"].metrics.etcd_commit
        assert sum(b.get() for b in count._buckets) >= 3  # each waiting part observed once
        found = await _ask(p, Op.LOOKUP, dict(meta, merge=True), conn)
        hit = np.frombuffer(found["rows"], answerrows.LOC_ROW)["node"] != answerrows.NO_NODE
        assert hit.tolist() == [True] * 12  # slot 2's pages are READY in its table: only its etcd write failed

    asyncio.run(run())


def test_a_cancelled_commit_closes_the_waits_it_had_not_started():
    async def run():
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in range(3)]

        async def wait(f):
            return await f
        coros = [wait(f) for f in futs]
        task = asyncio.ensure_future(multislot._in_turn(list(coros), [], [0, 1, 2]))
        await asyncio.sleep(0)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        assert [c.cr_frame is None for c in coros] == [True, True, True]  # run to its end or closed unstarted

    asyncio.run(run())
