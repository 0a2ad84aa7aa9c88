"""The disk tier's mover (issue 47): one slot's demotions and promotions between each node's DRAM and its disk.

Every tick (``Metaserver.tick``) the mover starts, per node with a disk and no move of its own in flight, one round
(``_round``): a demotion when the node's DRAM is above the high watermark (its least recently used pages, down to
the low watermark, ``MOVE_ROWS`` at most: the table's plan, ``metaserver/table/tiers.py``), else a promotion of the
disk pages read lately while its DRAM is below the low watermark (never past it, so promotions and demotions do not
chase each other). The round sends the node one DEMOTE or PROMOTE (``answerrows.TIER_ROW`` rows) over the mover's own
connection to the node's data port (HELLO/AUTH with the cluster secret, as a node's link to the metaserver does),
waits for its answer (``MOVE_S`` at most) and hands it to the table's ``finish``; the commit records of the moved
pages go to etcd like a COMMIT's. A promotion into a closed pool's DRAM carries fresh generations (the node's write
ledger admits only newer ones there). Before the copy a round waits until every removal queued before it is durable
in etcd (``BatchWriter.removals_durable``, as an ALLOC answer does): its destinations may lie in extents those
removals freed, and a crash must not reload an old page over a copy's bytes (docs/design/persistence-and-fencing.md).
Nothing a client waits for is in a round: puts evict as before when DRAM fills faster than the mover empties it.

Faults: a node that does not answer, refuses, or closes: the round's rows stay where they were (their destination
extents go back); the connection is opened anew next round. A round whose request was sent and whose answer never
came (the connection closed or reset, ``MOVE_S`` passed) does not know whether the node still copies: the request
may sit in the network or behind the node's I/O, and a PROMOTE (DEMOTE) zeroes its DRAM (disk) extent's header and
writes the page there whenever it runs. The request carries ``until_ms`` (``MOVE_S`` after it is sent, wall
clock), past which the node starts no copy; its destination extents are kept out of placement (as an aborted
writer's are: ``metaserver/table/quarantine.py``) for ``MOVE_S`` plus the clocks' skew, the quarantine's ``keep_s``
if longer, instead of going back at once, where a page committed meanwhile would be overwritten
(tests/test_attack_tiering.py). A round that outlives its term (a
step-down) touches nothing: the lease that pins its rows runs out with the table it belongs to, and a leader that
gives up hands its moves' destinations on with its open allocations (``Tiers.open_extents``).

Costs: per round one frame each way and the table's plan and finish (O(rows)); no work per tick for nodes without
a disk.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from metaserver.table.evict import bytes_to_low, over_high
from transport import wire
from transport.framed import ask_async, handshake_async
from umbp.caps import CLOCK_SKEW_S
from umbp.config import split_host_port
from umbp.errors import UmbpError
from umbp.tls import client_context

log = logging.getLogger("umbp.metaserver")

MOVE_ROWS = 256  # pages a round moves at most (one frame; wire.MAX_VEC_OPS bounds it too)
MOVE_S = 30.0  # a round's answer at most (its writes are synced on the node)
CONNECT_S = 5.0
BACKOFF_S = 0.5  # a failed round's node is left alone this long, doubling to BACKOFF_MAX_S while it keeps failing
BACKOFF_MAX_S = 10.0


class NodeLink:
    """The mover's connection to one node's data port: one request at a time."""

    def __init__(self, addr: str, token: str | None, tls_ca: str, component: str):
        self.addr = addr
        self.token = token
        self.tls_ca = tls_ca
        self.component = component
        self.reader = self.writer = None
        self.rid = 0

    async def _open(self) -> None:
        host, port = split_host_port(self.addr, self.component)
        ssl = client_context(self.tls_ca) if self.tls_ca else None
        self.reader, self.writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=ssl, server_hostname=host if ssl else None), CONNECT_S)
        await handshake_async(lambda op, meta: self._ask(op, meta, CONNECT_S), self.token, "metaserver-mover",
                              self.component)

    async def _ask(self, op: int, meta, timeout: float):
        self.rid += 1
        return await ask_async(self.reader, self.writer, self.rid, op, meta, timeout, self.component)

    async def ready(self) -> None:
        """Open the connection (HELLO/AUTH) unless it is open: nothing of a request has left yet."""
        if self.writer is None:
            await self._open()

    async def request(self, op: int, meta, timeout: float):
        await self.ready()
        return await self._ask(op, meta, timeout)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


class Mover:
    """Demotions and promotions of one slot's service ``svc``: see the module docstring."""

    def __init__(self, svc):
        self.svc = svc
        self.links: dict[str, NodeLink] = {}
        self.rounds: dict[str, asyncio.Task] = {}
        self.component = "metaserver mover"
        self.errors = 0
        self.backoff: dict[str, tuple[float, float]] = {}  # node -> (no round before, the next pause) after a failure

    def tick(self, now: float, budget: int) -> int:
        """Start a round for each node with a disk and none in flight (a duty of the service's tick: the rounds
        run on their own, so it examines nothing itself)."""
        tiers = self.svc.dir.tiers
        if not tiers.disks:
            return 0
        for host in list(tiers.disks):
            task = self.rounds.get(host)
            if (task is None or task.done()) and self.backoff.get(host, (0.0, 0.0))[0] <= now:
                self.rounds[host] = self.svc._spawn(self._round(host, self.svc.term))  # cancelled at a step-down
        return 0

    async def _round(self, host: str, term: int) -> None:
        svc = self.svc
        d = svc.dir
        node, space = svc.members.get(host), d.node_by_id.get(host)
        if node is None or not node.alive or space is None or svc.term != term or not svc.serving:
            return
        cap, used = space.alloc.capacity, space.alloc.used
        cfg = svc.cfg
        now = time.monotonic()
        if over_high(used, cap, cfg.high_watermark):
            move = d.tiers.plan_demote(host, bytes_to_low(used, cap, cfg.low_watermark), MOVE_ROWS, now, self)
            op = wire.Op.DEMOTE
        elif used < cfg.low_watermark * cap:
            move = d.tiers.plan_promote(host, MOVE_ROWS, now, self, room=int(cfg.low_watermark * cap) - used)
            op = wire.Op.PROMOTE
            if move is not None and svc.tokens.closed:
                base = await svc.gens.take(len(move))
                if svc.term != term:
                    return
                move.regen[:] = np.arange(base, base + len(move), dtype=np.uint64)
        else:
            return
        if move is None:
            return
        failed: set[int] = set()
        unsure = False  # the request may be in the node's hands and its answer is lost: the node may still copy
        try:
            # The destinations may lie in extents whose old pages' removals (the disk's own evictions for this
            # move, or any before) are not in etcd yet: a crash would reload those pages over the copies' bytes.
            # As an ALLOC answer does (handlers/dataplane.py), the copy waits until they are durable.
            svc._apply(d.effects())
            durable = svc.writer.removals_durable()
            if durable is not None:
                await asyncio.wait_for(asyncio.shield(durable), MOVE_S)
                if svc.term != term or not svc.serving:
                    return
            link = self.links.get(host)
            if link is None or link.addr != f"{node.host}:{node.port}":
                if link is not None:
                    link.close()
                secret = svc.tokens.cluster_secret.decode() if svc.tokens.closed else None
                link = self.links[host] = NodeLink(f"{node.host}:{node.port}", secret, cfg.tls_ca, self.component)
            await link.ready()
            unsure = True
            until = int((time.time() + MOVE_S) * 1000)  # the node copies nothing past it (umbp/node/tiering.py)
            meta = await link.request(op, {"rows": move.tier_rows(), "until_ms": until}, MOVE_S)
            unsure = False  # answered: the node's copies are done (it answers after its last write)
            failed = set(wire.vec_failures(meta, len(move), self.component))
            self.backoff.pop(host, None)
        except (UmbpError, OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
            failed = set(range(len(move)))
            self.errors += 1
            link = self.links.pop(host, None)
            if link is not None:
                link.close()
            pause = min(BACKOFF_MAX_S, 2 * self.backoff.get(host, (0.0, BACKOFF_S / 2))[1])
            self.backoff[host] = (time.monotonic() + pause, pause)  # a node down or restarting: ask again later
            log.warning("metaserver: %s of %d pages on node %s failed (next try in %.1fs): %s",
                        "demotion" if op == wire.Op.DEMOTE else "promotion", len(move), host, pause, e)
        if svc.term != term or not svc.serving:
            return  # another term's table: this move's lease and rows are not ours to settle
        # a request that may still be in the node's hands: its extents wait out its deadline (and the clocks' skew)
        d.tiers.finish(move, failed, self, max(d.quarantine.keep_s, MOVE_S + CLOCK_SKEW_S) if unsure else 0.0)
        svc._apply(d.effects())

    def close(self) -> None:
        for task in self.rounds.values():
            task.cancel()
        self.rounds.clear()
        for link in self.links.values():
            link.close()
        self.links.clear()
