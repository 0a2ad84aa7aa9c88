"""The etcd batch writer of the metaserver (``BatchWriter``), on ``metaserver.persist.EtcdStore``.

puts and deletes are queued by etcd key (a later op on a key replaces an unsent earlier one, which
also keeps a transaction free of duplicate keys, which etcd rejects). Up to ``inflight`` workers each take at most
``batch`` queued ops into one transaction; ops queued while transactions are in flight coalesce into the next ones,
so throughput grows with load and an idle writer adds no latency. A key already in an in-flight transaction waits
for it, so two ops on one key are applied in submission order. A caller that must not reply before its puts are
durable (COMMIT) gets a future; deletes are fire-and-forget. A failing transaction is retried with backoff for
``retry_s``, then its waiters get the error.

Costs: one etcd round trip per ``batch`` ops under load.
"""

from __future__ import annotations

import asyncio
import logging

from metaserver.persist import EtcdStore, unavailable
from transport.wire import Status
from umbp.errors import RemoteError, Unavailable

log = logging.getLogger("umbp.metaserver")


class _Ticket:
    __slots__ = ("fut", "left")

    def __init__(self, fut: asyncio.Future, left: int):
        self.fut = fut
        self.left = left


class BatchWriter:
    """Coalescing etcd writer. ``submit`` never blocks; see the module docstring for ordering and batching."""

    def __init__(self, store: EtcdStore, batch: int = 128, inflight: int = 4, retry_s: float = 10.0):
        self.store = store
        self.batch = batch
        self.inflight = inflight
        self.retry_s = retry_s
        self._queue: dict[bytes, list] = {}  # etcd key -> [value | None (delete), [tickets] | None]
        self._busy: set[bytes] = set()  # keys in in-flight transactions
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._workers: list[asyncio.Task] = []
        self._running = 0
        self.txns = 0
        self.ops = 0
        self.failures = 0

    def start(self) -> None:
        for i in range(self.inflight):
            self._workers.append(asyncio.create_task(self._work(), name=f"metaserver-etcd-writer-{i}"))

    def submit(self, puts: list[tuple[bytes, bytes]], deletes: list[bytes], wait: bool) -> asyncio.Future | None:
        """Queue puts and deletes; with ``wait``, return a future done when all of them are in etcd (or failed)."""
        ticket = None
        if wait and (puts or deletes):
            ticket = _Ticket(asyncio.get_running_loop().create_future(), len(puts) + len(deletes))
        q = self._queue
        for key, value in puts:
            self._enqueue(q, key, value, ticket)
        for key in deletes:
            self._enqueue(q, key, None, ticket)
        if q:
            self._idle.clear()
            self._wake.set()
        return ticket.fut if ticket is not None else None

    @staticmethod
    def _enqueue(q: dict, key: bytes, value: bytes | None, ticket: _Ticket | None) -> None:
        slot = q.get(key)
        if slot is None:
            q[key] = [value, [ticket] if ticket is not None else None]
            return
        slot[0] = value  # the newer op supersedes the unsent older one; its waiters ride along
        if ticket is not None:
            if slot[1] is None:
                slot[1] = [ticket]
            else:
                slot[1].append(ticket)

    def pending(self) -> int:
        return len(self._queue) + len(self._busy)

    def _take(self) -> list[tuple[bytes, bytes | None, list | None]]:
        q, busy = self._queue, self._busy
        out = []
        if not busy:
            for key in q:
                out.append(key)
                if len(out) >= self.batch:
                    break
        else:
            for i, key in enumerate(q):
                if key not in busy:
                    out.append(key)
                    if len(out) >= self.batch:
                        break
                if i >= 4 * self.batch:
                    break
        items = []
        for key in out:
            value, tickets = q.pop(key)
            items.append((key, value, tickets))
            busy.add(key)
        return items

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = self._take()
            if not items:
                if not self._queue and not self._running:
                    self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            self._running += 1
            err: BaseException | None = None
            try:
                ops = [(k, v) for k, v, _ in items]
                deadline = loop.time() + self.retry_s
                delay = 0.05
                while True:
                    try:
                        await self.store.write(ops)
                        break
                    except Unavailable as e:
                        self.failures += 1
                        if loop.time() + delay > deadline:
                            raise
                        log.warning("metaserver: %s; retrying", e)
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, 1.0)
                self.txns += 1
                self.ops += len(items)
            except asyncio.CancelledError:
                err = Unavailable("metaserver", "shutting down before the write reached etcd", Status.UNAVAILABLE)
                raise
            except Exception as e:  # noqa: BLE001 - every failure goes to the waiters, none is lost
                err = e if isinstance(e, RemoteError) else unavailable("transaction", e)
                log.error("metaserver: dropping %d etcd ops: %s", len(items), err)
            finally:
                self._running -= 1
                for key, _, tickets in items:
                    self._busy.discard(key)
                    if tickets:
                        for t in tickets:
                            if err is not None:
                                if not t.fut.done():
                                    t.fut.set_exception(err)
                            else:
                                t.left -= 1
                                if t.left == 0 and not t.fut.done():
                                    t.fut.set_result(None)
                self._wake.set()

    async def flush(self, timeout_s: float) -> bool:
        """Wait until everything queued is written (True) or ``timeout_s`` passes (False)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def close(self, timeout_s: float = 5.0) -> None:
        if self._queue or self._busy:
            await self.flush(timeout_s)
        await self.abort(Unavailable("metaserver", "shutting down before the write reached etcd",
                                     Status.UNAVAILABLE))

    async def abort(self, err: Exception) -> None:
        """Stop now without writing what is queued (a deposed leader must not write): in-flight transactions are
        cancelled and every waiter, queued or in flight, gets ``err`` (or 'shutting down')."""
        for t in self._workers:
            t.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers.clear()
        q, self._queue = self._queue, {}
        for _, tickets in q.values():
            for t in tickets or ():
                if not t.fut.done():
                    t.fut.set_exception(err)
        self._idle.set()
