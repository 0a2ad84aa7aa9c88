"""One etcd transaction for the writes of several slots of one process (``TxnCombiner``).

A partitioned pool's process leads several slots, each with its own batch writer (``metaserver/store/batcher.py``) and
fence. A client's put batch touches most of them, so each COMMIT woke every slot's writer and each sent a small
transaction of its own: 16 transactions of 4 pages for a 64-page batch over 16 slots, where one process used to send
one of 64. etcd's cost and the metaserver's gRPC cost are per transaction (measured: etcd at 460% CPU while the
process was far from its limit), so the partitioned pool committed fewer pages per second than one process.

``write(store, items)`` queues a slot's transaction and awaits it; the writes queued in one turn of the event loop
(the writers a COMMIT woke all run in the next turn) are sent as transactions of at most ``max_ops`` operations
(etcd's per-transaction cap; lowered for good when etcd refuses one for its size, and its parts sent again under
the new cap) and ``TXN_BYTES`` of keys and values, each carrying the fence compare of every slot in it. All of it is
applied or none:

- it succeeded: every part is durable;
- a compare failed (a slot in it was deposed): each part is sent again on its own through its store
  (``EtcdStore.write``), so the deposed slot gets NotLeader (and its ``on_fenced``) and the others are written;
- etcd failed (Unavailable): every part gets the error; its writer retries as before.

Keys never collide inside a combined transaction (etcd refuses duplicates): slots write disjoint key ranges
(``slots/{s}/...``) and one slot's writer never has a key in two transactions at once. A part whose writer was
cancelled before the send (a deposed or closing slot) is dropped; one cancelled after it is written or refused by
its fence, as a single transaction's would be. Costs: per combined transaction one request build and one round
trip; per part a future and, when fenced, one compare.
"""

from __future__ import annotations

import asyncio

from metaserver.store.batcher import TXN_BYTES, TXN_OPS, smaller_cap, txn_bytes
from metaserver.store.persist import EtcdStore, add_ops
from umbp.errors import TxnTooLarge


class TxnCombiner:
    def __init__(self, root: EtcdStore, max_ops: int = TXN_OPS):
        self.root = root  # whose client sends the combined transactions
        self.max_ops = max_ops
        self._queue: list[tuple[EtcdStore, list, asyncio.Future, int]] = []  # (store, items, waiter, their bytes)
        self.txns = 0  # combined transactions sent (a lone part goes out as its store's own)
        self.parts = 0  # slot transactions they carried
        self.split = 0  # combined transactions refused by a fence and sent again part by part
        self.lowered = 0  # times etcd refused a combined transaction for its size (max_ops lowered)
        self._tasks: set[asyncio.Task] = set()

    async def write(self, store: EtcdStore, items: list) -> None:
        """Write ``items`` (``EtcdStore.write``'s pairs) fenced on ``store``'s fence, with the other slots' writes
        of this turn of the loop. Raises as ``store.write`` would."""
        nbytes = txn_bytes(items)
        if len(items) >= self.max_ops or nbytes >= TXN_BYTES:
            return await EtcdStore.write(store, items)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.append((store, items, fut, nbytes))
        if len(self._queue) == 1:
            loop.call_soon(self._flush)
        await fut

    def _flush(self) -> None:
        queue, self._queue = [part for part in self._queue if not part[2].done()], []
        for group in self._groups(queue):
            self._send(group)

    def _groups(self, parts: list) -> list[list]:
        """``parts`` in order, in groups of at most ``max_ops`` operations and ``TXN_BYTES`` (a larger part alone)."""
        out: list[list] = []
        group: list = []
        n = nbytes = 0
        for part in parts:
            if group and (n + len(part[1]) > self.max_ops or nbytes + part[3] > TXN_BYTES):
                out.append(group)
                group, n, nbytes = [], 0, 0
            group.append(part)
            n += len(part[1])
            nbytes += part[3]
        if group:
            out.append(group)
        return out

    def _send(self, group: list) -> None:
        task = asyncio.ensure_future(self._run(group))
        self._tasks.add(task)  # held until done (the loop keeps only weak references to tasks)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, group: list) -> None:
        """Send ``group`` and answer each part's waiter with its own outcome."""
        futs = [p[2] for p in group]
        try:
            if len(group) == 1:
                await EtcdStore.write(group[0][0], group[0][1])
                outcome: list = [None]
            else:
                outcome = await self._combined_fitting(group)
        except asyncio.CancelledError:
            for f in futs:
                f.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - every waiter gets the error (its writer retries Unavailable)
            outcome = [e] * len(group)
        for f, r in zip(futs, outcome):
            if not f.done():
                f.set_result(None) if r is None else f.set_exception(r)

    async def _combined_fitting(self, group: list) -> list:
        """``_combined``; when etcd refuses the transaction for its size (TxnTooLarge: its cap is below ours), the
        cap drops for good (to etcd's default, then halving) and the parts go again in groups under it, a lone part
        through its store (refused too: that part's writer splits it). The refusal is the combination's, so a
        writer whose own part was small never sees it and keeps its transaction size."""
        try:
            return await self._combined(group)
        except TxnTooLarge:
            self.max_ops = min(self.max_ops, smaller_cap(sum(len(p[1]) for p in group)))
            self.lowered += 1
        outcome: list = []
        for sub in self._groups(group):  # smaller groups now, each a strictly smaller combination: this ends
            if len(sub) > 1:
                outcome += await self._combined_fitting(sub)
                continue
            try:
                await EtcdStore.write(sub[0][0], sub[0][1])
                outcome.append(None)
            except Exception as e:  # noqa: BLE001 - the part's own outcome (CancelledError is not an Exception)
                outcome.append(e)
        return outcome

    async def _combined(self, group: list) -> list:
        """One transaction for every part (each slot's fence compared once); when a fence refused it, each part
        again on its own. The outcome per part: None (written) or its exception."""
        req = EtcdStore.new_txn()
        fenced = set()
        for store, items, *_ in group:
            if store.leader_key not in fenced:
                fenced.add(store.leader_key)
                store.add_fence(req)
            add_ops(req, items)
        self.txns += 1
        self.parts += len(group)
        if await self.root.send(req):
            return [None] * len(group)
        self.split += 1
        return await asyncio.gather(*(EtcdStore.write(s, items) for s, items, *_ in group), return_exceptions=True)
