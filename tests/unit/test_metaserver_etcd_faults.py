"""etcd failures the metaserver must survive, in-process and without etcd (review 4.1 and 4.4):

- writes the batch writer gives up on (``persist_retry_s``) are counted (``umbp_etcd_dropped_ops_total``) and make
  the leader give its term up by deleting its slot key (``SlotServer._release_key``): a one-slot pool's
  ``{prefix}/leader``, a partitioned pool's ``slotmap/{s}``, so the next term loads what etcd holds;
- a metaserver process's loops (election rounds, process lease keep-alive) are supervised: a raw error, of aetcd
  or of a bug, is logged and the loop goes on campaigning and renewing; a loop that ended makes /healthz fail;
  the idle-connection sweep outlives a connection that fails to close;
- the store translates grpc failures by status code (a lease etcd no longer knows is not an error), and the
  partition's member record goes through the store.

The real-etcd outage (SIGSTOP) is ``tests/test_etcd_outage.py``.
"""

from __future__ import annotations

import asyncio
import time

import aetcd.exceptions
import grpc
import pytest
from prometheus_client import generate_latest

from metaserver.ha import election as election_mod
from metaserver.ha.partition import Partition
from metaserver.store.persist import EtcdStore
from transport.wire import Status
from umbp.config import MetaserverConfig
from umbp.errors import Unavailable

ADDR = "127.0.0.1:7001"


def run(coro, timeout: float = 20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(pred, what: str, timeout: float = 5.0) -> None:
    """Bounded poll of ``pred`` (yielding to the loop every 10 ms)."""
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"not within {timeout}s: {what}"
        await asyncio.sleep(0.01)


class DownStore:
    """What the writer and the slot's step-down call of ``EtcdStore``, with every write failing (etcd away) and
    ``txn`` (the slot key's fenced delete) recorded."""

    def __init__(self, leader_key: bytes = b"/umbp/slotmap/0"):
        self.leader_key = leader_key
        self.fence_rev = 5
        self.on_fenced = None
        self.writes = 0
        self.txns: list[list] = []
        self.gen_key = b"/umbp/gen"
        self.open_key = b"/umbp/open"

    async def write(self, items):
        self.writes += 1
        raise Unavailable("metaserver", "etcd transaction failed: injected outage", Status.UNAVAILABLE)

    def op_delete(self, key):
        return ("del", key)

    async def txn(self, ops, compare=None):
        self.txns.append(ops)
        return True

    def batch_name(self, ns):
        return b"/umbp/pages/" + ns.encode() + b"/+1.1"


def metric(registry, name: str) -> float:
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def test_dropped_writes_are_counted_and_the_leader_gives_its_term_up(capsys):
    """A one-slot pool (the unpartitioned layout): the slot's key is ``{prefix}/leader`` itself."""
    async def main():
        cfg = MetaserverConfig(persist_retry_s=0.1)
        p = Partition(cfg, ADDR, 1)
        p._valid_until = time.monotonic() + 60
        ms = p.servers["0"]
        assert ms.store.leader_key == b"/umbp/leader" and ms.store._pages == b"/umbp/pages/"
        store = ms.store = DownStore(b"/umbp/leader")
        ms._new_state()  # this term's writer on the store double
        ms.writer.start()
        ms.loaded, ms.leader.won = True, True
        assert ms.serving and p.serving
        fut = ms.writer.submit([(b"/umbp/pages/ns/+1.1", b"rec"), (b"/umbp/pages/ns/+1.2", b"rec")], [b"/x"],
                               wait=True)
        with pytest.raises(Unavailable, match="injected outage"):
            await asyncio.wait_for(fut, 5)  # the COMMIT's waiter gets the error ...
        assert store.writes >= 2  # ... after retrying for persist_retry_s
        assert ms.dropped_ops == 3 and not ms.serving and not p.serving  # stops serving at once
        await until(lambda: store.txns and not p._deposing, "the leader key deleted")
        assert store.txns == [[("del", b"/umbp/leader")]]  # fenced on this term (the store's txn adds it)
        assert "metaserver: standby, stepped down (3 etcd writes dropped" in capsys.readouterr().out
        assert ms.dropped_ops == 3 and metric(p.metrics.registry, "umbp_etcd_dropped_ops_total") == 3
        assert not ms.given_up and ms.writer.dropped == 0  # a fresh term's writer
        await p.close()

    run(main())


def test_a_slot_whose_writes_were_dropped_steps_down_and_deletes_its_key():
    async def main():
        p = Partition(MetaserverConfig(persist_retry_s=0.1), ADDR, 2)
        p._valid_until = time.monotonic() + 60
        srv = p.servers["0"]
        store = srv.store = DownStore()
        srv._new_state()
        srv.writer.start()
        srv.loaded, srv.leader.won = True, True
        assert srv.serving
        srv.writer.submit([(b"/umbp/slots/0/pages/ns/+1.1", b"rec")], [], wait=False)
        await until(lambda: store.txns and not p._deposing, "the slot's key deleted")
        assert store.txns == [[("del", b"/umbp/slotmap/0")]]  # fenced on this term (the store's txn adds it)
        assert not srv.serving and not srv.leader.won and srv.dropped_ops == 1
        assert metric(p.metrics.registry, "umbp_etcd_dropped_ops_total") == 1
        await p.close()

    run(main())


def grpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def wrapped(code: grpc.StatusCode, details: str) -> aetcd.exceptions.ClientError:
    """What aetcd raises for a grpc code it has no class for: a plain ClientError raised from the grpc error."""
    try:
        try:
            raise grpc_error(code, details)
        except grpc.aio.AioRpcError as e:
            raise aetcd.exceptions.ClientError(details) from e
    except aetcd.exceptions.ClientError as e:
        return e


def test_store_tells_a_gone_lease_by_its_grpc_code_and_translates_every_failure():
    async def main():
        store = EtcdStore("127.0.0.1:1", "/umbp")
        outcome = {}

        async def revoke_lease(lease_id):
            raise outcome[lease_id]

        store.client.revoke_lease = revoke_lease
        outcome[1] = wrapped(grpc.StatusCode.NOT_FOUND, "etcdserver: lease 0x1 is gone")  # no "not found" text
        assert await store.revoke(1) is None
        outcome[2] = wrapped(grpc.StatusCode.UNKNOWN, "endpoint not found")  # the text, but not the code
        with pytest.raises(Unavailable, match="lease revoke failed") as e:
            await store.revoke(2)
        assert isinstance(e.value.__cause__, aetcd.exceptions.ClientError)
        outcome[3] = aetcd.exceptions.ConnectionFailedError("etcd away")
        with pytest.raises(Unavailable, match="etcd away"):
            await store.revoke(3)

        async def put(key, value, lease=None):
            raise grpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")

        store.client.put = put
        with pytest.raises(Unavailable, match="etcd put failed: UNAVAILABLE: connection refused$"):
            await store.put_member(b"/umbp/members/x", b"rec", 7)

    run(main())


def test_election_rounds_survive_raw_errors_and_campaign_again(monkeypatch):
    monkeypatch.setattr(election_mod, "POLL_S", 0.01)

    async def main():
        p = Partition(MetaserverConfig(election_ttl_s=60), ADDR, 2)
        p.lease, p._valid_until = 7, time.monotonic() + 60
        rounds = {"read": 0, "put": 0}
        campaigned: list[str] = []

        async def read():
            rounds["read"] += 1
            if rounds["read"] == 2:
                raise RuntimeError("a bug in a round")  # not an UmbpError
            p.members = {} if rounds["read"] == 1 else {ADDR: {"addr": ADDR, "warm": ["m"]}}
            p.holders = {n: (ADDR, 9, p.lease) for n in campaigned}

        async def client_put(key, value, lease=None):  # the member record's put: raw aetcd errors, then fine
            rounds["put"] += 1
            if rounds["put"] == 1:
                raise aetcd.exceptions.ConnectionFailedError("etcd connection lost")

        async def campaign(name):
            campaigned.append(name)
            p._busy.pop(name, None)

        p._read = read
        p._campaign = campaign
        p.store.client.put = client_put
        p._election = task = asyncio.create_task(p._run())
        await until(lambda: sorted(campaigned) == sorted(p.names), "every vacant slot campaigned for")
        assert rounds["read"] >= 3 and rounds["put"] == 1  # the first round died in its put, the second in a bug
        assert not task.done() and p.metrics.healthy() == (True, "metaserver: ok")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert p._keep.done()  # the keep-alive went with the rounds
        await p.store.close()

    run(main())


def test_the_process_lease_keepalive_survives_a_raw_error_while_rejoining():
    async def main():
        p = Partition(MetaserverConfig(election_ttl_s=1), ADDR, 2)
        p.lease, p._valid_until = 7, time.monotonic() + 60
        grants = []

        async def refresh(lease_id):
            return 0 if lease_id == 7 else 1  # etcd forgot the lease: lost, join again with a new one

        async def grant(ttl):
            grants.append(ttl)
            if len(grants) == 1:
                raise RuntimeError("raw error in the rejoin")  # before: it killed the keep-alive for good
            return 99

        async def client_put(key, value, lease=None):
            return None

        p.store.refresh, p.store.grant, p.store.client.put = refresh, grant, client_put
        keep = asyncio.create_task(p._keepalive())
        await until(lambda: p.lease == 99, "joined again with a new lease", timeout=10)
        assert len(grants) == 2 and not keep.done() and p.lease_valid()
        keep.cancel()
        await asyncio.gather(keep, return_exceptions=True)
        await p.store.close()

    run(main())


def test_a_dead_loop_makes_healthz_fail():
    async def main():
        p = Partition(MetaserverConfig(), ADDR, 2)
        forever = asyncio.get_running_loop().create_future()
        p._election = asyncio.ensure_future(forever)
        assert p.metrics.healthy() == (True, "metaserver: ok")

        async def die():
            raise RuntimeError("keep-alive bug")

        p._keep = asyncio.create_task(die())
        await asyncio.gather(p._keep, return_exceptions=True)
        ok, why = p.metrics.healthy()
        assert not ok and "keep-alive has stopped" in why and "keep-alive bug" in why
        p._keep = None
        p._election.cancel()
        await asyncio.gather(p._election, return_exceptions=True)
        ok, why = p.metrics.healthy()
        assert not ok and "election loop has stopped" in why
        one = Partition(MetaserverConfig(), ADDR, 1)  # a one-slot pool's process: the same loops
        one._election = p._election
        assert not one.metrics.healthy()[0]
        await p.store.close()
        await one.store.close()

    run(main())


def test_the_idle_sweep_survives_a_connection_that_fails_to_close():
    from metaserver.server import close_idle

    class Conn:
        def __init__(self, peer: str, fail: bool):
            self.peer, self.fail, self.closes = peer, fail, 0
            self.last_active = 0.0  # idle since long ago
            self.transport = self

        def close(self):
            self.closes += 1
            if self.fail:
                self.fail = False
                raise RuntimeError("transport already gone")

    async def main():
        bad = Conn("bad", fail=True)
        conns = {bad}
        sweep = asyncio.create_task(close_idle(conns, 0.04))  # a sweep every 10 ms
        await until(lambda: bad.closes == 1, "the first sweep")
        good = Conn("good", fail=False)
        conns.add(good)
        await until(lambda: good.closes >= 1, "a later sweep closing the next idle connection")
        assert not sweep.done()
        sweep.cancel()
        await asyncio.gather(sweep, return_exceptions=True)

    run(main())
