"""The etcd batch writer of the metaserver (``BatchWriter``), on ``metaserver.store.persist.EtcdStore``.

puts and deletes are queued by etcd key (a later op on a key replaces an unsent earlier one, which also keeps a
transaction free of duplicate keys, which etcd rejects). Up to ``inflight`` workers each take at most
``batch`` queued ops into one transaction; ops queued while transactions are in flight coalesce into the next ones,
so throughput grows with load and an idle writer adds no latency. A key already in an in-flight transaction waits
for it, so two ops on one key are applied in submission order. A caller that must not reply before its puts are
durable (COMMIT) gets a future; deletes are fire-and-forget. A failing transaction is retried with backoff for
``retry_s``, then its ops are dropped: its waiters get the error, ``dropped`` counts them and ``on_drop(n, err)``
is called. etcd then no longer holds what the directory does (a COMMIT's pages are READY but not durable, an
evicted page's record is still there), so the owner must not go on serving that directory: the metaserver gives
its term up (``Metaserver._writes_dropped``), and the next term loads what etcd holds.

The removal barrier (``removals_durable``): a submission that removes pages from etcd (a delete, a commit record
rewritten without pages that left, or a dead-list record that names them: ``TableRecord.shrunk``) frees extents
that the next ALLOC may place; its answer must wait until that is durable, else a crash loads the old pages over the
new bytes (docs/design/persistence-and-fencing.md, "Reusing an extent"). Submissions are numbered; a queued op keeps the
number of the submission that first queued its key (so the queue is in number order), and a transaction in flight is
known by its first op's, so everything up to one below the smallest of those is in etcd: O(inflight) to ask, one int a
queued op. A dropped or cancelled transaction's number bounds what can ever be durable: a barrier at or past it fails.
Once a transaction is in etcd, each commit record in it hears so (``TableRecord.written``: the dead lists its value
covers need it no more), and the records that frees are queued again (a dead-list record deleted).

Costs: one etcd round trip per ``batch`` ops under load; on the event loop about 0.3 us an op for queueing, taking
and acknowledging (a tuple and a dict insert each; a submission's consecutive ops are acknowledged as one run).
Taking from the queue's head is O(batch) however many ops went before: the queue is an ``OrderedDict`` (a plain dict
used as a FIFO skips a hole for every op taken until an insert resizes it, so a flood of deletes drains in quadratic
time: 3.85 vs 1.16 s of loop CPU for 1 M ops, ``bench/batcher.py``; 0.08 us more an op in steady commits).
The transaction itself (``EtcdStore.write``: protobuf build, grpc) costs about 2 us an op of the loop's CPU whether
issued from the loop (grpc aio) or from threads (sync stubs: measured equal, 0.27 ms a 128-op transaction), so it
stays on the loop: a thread would only add GIL hand-offs. Much of that is per transaction, in this process and in
etcd, so transactions carry up to ``TXN_OPS`` = 1024 operations, not etcd's default cap of 128: the etcd that
``umbp up``, the tests and the Kubernetes base start runs with ``--max-txn-ops=1024``. Measured on the 2-core VM
(a real etcd, 100k page records, four transactions in flight): 128 ops a transaction 38-45k puts/s, this process
4.0 us an op and etcd 14.9-16.7 us; 1024 ops 60-86k puts/s, 1.7 us and 9.5-9.8 us. An etcd with a lower cap refuses
the first large transaction (``TxnTooLarge``); the writer then keeps to 128 (or less) for good and logs each step
down.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from itertools import filterfalse, islice

from metaserver.store.persist import EtcdStore, unavailable
from metaserver.table.commits import TableRecord
from transport.wire import Status
from umbp.config import ETCD_TXN_OPS
from umbp.errors import RemoteError, TxnTooLarge, Unavailable

log = logging.getLogger("umbp.metaserver")

TXN_OPS = ETCD_TXN_OPS  # operations a transaction by default (MetaserverConfig.persist_batch, umbp/config.py)
ETCD_DEFAULT_TXN_OPS = 128  # etcd's own default cap: where a writer refused for its size goes first
TXN_BYTES = 1 << 20  # keys and values of one transaction at most: etcd refuses a request over its --max-request-bytes
# (1.5 MiB by default), and 1024 records of long keys (512-byte string keys are 1 KiB in hex) would pass it


def txn_bytes(ops: list, i: int = 0, j: int | None = None) -> int:
    """Bytes of keys and values of ``ops[i:j]`` ((etcd key, value | None) pairs)."""
    return sum(len(k) + (len(v) if v is not None else 0) for k, v in islice(ops, i, j))


def cut(ops: list, i: int, n: int) -> int:
    """Where the transaction that starts at ``ops[i]`` ends: at most ``n`` ops and ``TXN_BYTES`` (at least one op).
    O(ops in it), about 0.1 us an op."""
    j = min(len(ops), i + n)
    size = 0
    for k in range(i, j):
        key, v = ops[k]
        size += len(key) + (len(v) if v is not None else 0)
        if size > TXN_BYTES and k > i:
            return k
    return j


def smaller_cap(refused: int) -> int:
    """The transaction size to keep to after etcd refused one of ``refused`` operations for its size: etcd's default
    cap first, then halves (the writer's and the combiner's rule)."""
    return ETCD_DEFAULT_TXN_OPS if refused > ETCD_DEFAULT_TXN_OPS else max(1, refused // 2)


class _Ticket:
    __slots__ = ("fut", "left")

    def __init__(self, fut: asyncio.Future, left: int):
        self.fut = fut
        self.left = left


def _merge(old, ticket):
    """The waiters of a queued op once a newer op on its key (with ``ticket``) supersedes it: None, one ticket, or a
    list of them (only when several waited submissions name one unsent key)."""
    if ticket is None:
        return old
    if old is None:
        return ticket
    return [*old, ticket] if type(old) is list else [old, ticket]


class BatchWriter:
    """Coalescing etcd writer. ``submit`` never blocks; see the module docstring for ordering and batching.

    The queue is one ordered map, etcd key -> (value | None: delete, waiters, seq), in submission order (a
    superseding op keeps its key's place and its seq); waiters is None, one ``_Ticket`` or a list of them, so the
    common op costs one tuple and one insert, and taking a transaction's worth is a slice of the map's head when no
    key is in flight. seq is the count of submissions when the key's op was first queued, so the queue is in seq
    order and everything submitted up to ``durable_seq()`` is in etcd (the removal barrier, ``removals_durable``)."""

    def __init__(self, store: EtcdStore, batch: int = TXN_OPS, inflight: int = 4, retry_s: float = 10.0):
        self.store = store
        self.batch = batch  # operations a transaction at most; lowered to what etcd accepts (``_write``)
        self.lowered = 0  # times etcd refused a transaction for its size
        self.inflight = inflight
        self.retry_s = retry_s
        # etcd key -> (value | None (delete), None | _Ticket | [_Ticket]); ordered by links, not a dict: see the module
        self._queue: OrderedDict[bytes, tuple] = OrderedDict()
        self._busy: set[bytes] = set()  # keys in in-flight transactions
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._workers: list[asyncio.Task] = []
        self._running = 0
        self.txns = 0
        self.ops = 0
        self.failures = 0
        self.dropped = 0  # ops given up after retry_s (or refused: fenced, too large alone); see the module docstring
        self.on_drop = None  # called as on_drop(ops, error) after each drop; must not block
        # the removal barrier (``removals_durable``): submissions count, in-flight transactions' first seqs
        self._seq = 0
        self._flying: dict[int, int] = {}  # id of a transaction's ops list -> the seq of its first (smallest) op
        self._removed = 0  # the last submission that carried a removal (a record rewritten without pages, a delete)
        self._lost: tuple[int, BaseException] | None = None  # (smallest seq dropped, its error): never durable
        self._barriers: list[tuple[int, asyncio.Future]] = []  # (seq, future), seqs increasing
        self.barrier_waits = 0  # barriers handed out (an ALLOC that waited for removals to be durable)

    def start(self) -> None:
        for i in range(self.inflight):
            self._workers.append(asyncio.create_task(self._work(), name=f"metaserver-etcd-writer-{i}"))

    def submit(self, puts: list[tuple[bytes, "bytes | TableRecord"]], deletes: list[bytes], wait: bool
               ) -> asyncio.Future | None:
        """Queue puts and deletes; with ``wait``, return a future done when all of them are in etcd (or failed).
        A put's value may be a commit record (``tablerecords.TableRecord``): encoded when taken, a delete when it
        has no live row left. O(ops): one dict insert each."""
        ticket = None
        if wait and (puts or deletes):
            ticket = _Ticket(asyncio.get_running_loop().create_future(), len(puts) + len(deletes))
        self._seq += 1
        seq = self._seq
        removal = bool(deletes)
        q = self._queue
        get = q.get
        for key, value in puts:
            if type(value) is TableRecord and value.shrunk:  # rewritten without pages that left
                value.shrunk = False
                removal = True
            old = get(key)
            q[key] = (value, ticket, seq) if old is None else (value, _merge(old[1], ticket), old[2])
        for key in deletes:
            old = get(key)
            q[key] = (None, ticket, seq) if old is None else (None, _merge(old[1], ticket), old[2])
        if removal:
            self._removed = seq
        if q:
            self._idle.clear()
            self._wake.set()
        return ticket.fut if ticket is not None else None

    def pending(self) -> int:
        return len(self._queue) + len(self._busy)

    def durable_seq(self) -> int:
        """Every submission up to this one is in etcd: one before the smallest seq queued or in flight. O(inflight)."""
        low = self._seq + 1
        if self._queue:
            low = next(iter(self._queue.values()))[2]
        for s in self._flying.values():
            if s < low:
                low = s
        return low - 1

    def removals_durable(self) -> asyncio.Future | None:
        """None when every removal submitted so far (a commit record rewritten without pages that left, a delete) is
        in etcd, else a future done once it is, failed with the error of a drop that lost one (or with 'shutting
        down' on ``abort``). An extent freed by a removal must not reach a new writer before that: a crash would
        leave the old page's record naming it, over the new object's bytes (docs/design/persistence-and-fencing.md).
        Never cancel the future (``asyncio.shield`` it): waiters share it. O(inflight)."""
        need = self._removed
        if self._lost is not None and need >= self._lost[0]:
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(self._lost[1])
            return fut
        if need <= self.durable_seq():
            return None
        self.barrier_waits += 1
        b = self._barriers
        if b and b[-1][0] == need:
            return b[-1][1]
        fut = asyncio.get_running_loop().create_future()
        fut.add_done_callback(_retrieved)  # its waiters may all be gone when it fails
        b.append((need, fut))
        return fut

    def _release_barriers(self, err: BaseException | None = None) -> None:
        """Barriers now durable get their result; with ``err`` (a drop, an abort) every one still waiting fails."""
        b = self._barriers
        if not b:
            return
        upto = self.durable_seq()
        lost = self._lost
        n = 0
        for need, fut in b:
            e = err
            if e is None and lost is not None and need >= lost[0]:
                e = lost[1]
            elif e is None and need > upto:
                break
            if not fut.done():
                if e is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(e)
            n += 1
        del b[:n]

    def _take(self) -> tuple[list[bytes], list[tuple]]:
        """Up to ``batch`` queued keys not in flight (looking at most 4 * batch keys past the head), popped and
        marked busy: (keys, their (value, waiters))."""
        q, busy, n = self._queue, self._busy, self.batch
        if not busy:
            keys = list(islice(q, n))
        else:  # C-level filtering, stopping at n: a flood's take was 0.6 ms of Python per 1,024 keys
            keys = list(islice(filterfalse(busy.__contains__, islice(q, 4 * n)), n))
        slots = list(map(q.pop, keys))
        busy.update(keys)
        return keys, slots

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            keys, slots = self._take()
            if not keys:
                if not self._queue and not self._running:
                    self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            self._running += 1
            self._flying[id(slots)] = slots[0][2]  # taken in queue order: the first has the smallest seq
            err: BaseException | None = None
            try:
                # a commit record's value is encoded now, from its rows still in the table (table/commits.py)
                ops = [(k, v if type(v) is bytes or v is None else v.value()) for k, (v, _, _) in zip(keys, slots)]
                deadline = loop.time() + self.retry_s
                delay = 0.05
                while True:
                    try:
                        await self._write(ops)
                        break
                    except Unavailable as e:
                        self.failures += 1
                        if loop.time() + delay > deadline:
                            raise
                        log.warning("metaserver: %s; retrying", e)
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, 1.0)
                self.txns += 1
                self.ops += len(keys)
                self._written(slots)
            except asyncio.CancelledError:
                err = Unavailable("metaserver", "shutting down before the write reached etcd", Status.UNAVAILABLE)
                raise
            except Exception as e:  # noqa: BLE001 - every failure goes to the waiters, none is lost
                err = e if isinstance(e, RemoteError) else unavailable("transaction", e)
                log.error("metaserver: dropping %d etcd ops: %s", len(keys), err)
                self.dropped += len(keys)
                if self.on_drop is not None:
                    try:
                        self.on_drop(len(keys), err)
                    except Exception:  # noqa: BLE001 - the worker must outlive a failing callback
                        log.exception("metaserver: etcd writer: on_drop failed")
            finally:
                self._running -= 1
                self._busy.difference_update(keys)
                del self._flying[id(slots)]
                if err is not None and (self._lost is None or slots[0][2] < self._lost[0]):
                    self._lost = (slots[0][2], err)  # dropped or cancelled: never durable (removals_durable)
                self._settle(slots, err)
                self._release_barriers()
                self._wake.set()

    async def _write(self, ops: list) -> None:
        """``ops`` in transactions of at most ``batch`` ops and ``TXN_BYTES``. When etcd refuses one for its size
        (``TxnTooLarge``: its ``--max-txn-ops`` or ``--max-request-bytes`` is below ours), ``batch`` drops to etcd's
        default cap (then halves, down to 1) for good and what is left goes again in smaller ones; the keys stay busy
        meanwhile, so order per key holds. Ends: a refused part is never retried at its size. Raises as
        ``EtcdStore.write`` (a failure after some transactions went through: the caller writes ``ops`` again, which
        puts and deletes allow)."""
        i = 0
        while i < len(ops):
            j = cut(ops, i, self.batch)
            part = ops if i == 0 and j == len(ops) else ops[i:j]
            try:
                await self.store.write(part)
            except TxnTooLarge:
                if len(part) <= 1:
                    raise
                lower = smaller_cap(len(part))
                if lower < self.batch:
                    log.warning("metaserver: etcd refused %d operations in one transaction (its --max-txn-ops or "
                                "--max-request-bytes); writing at most %d a transaction from now on", len(part), lower)
                    self.batch = lower
                    self.lowered += 1
                continue
            i += len(part)

    def _written(self, slots: list[tuple]) -> None:
        """The commit records among ``slots`` are durable as taken (``TableRecord.written``): the records that
        makes ready to go again (dead-list records needed no more: deleted) are queued. O(ops)."""
        again = None
        for v, _, _ in slots:
            if type(v) is TableRecord and (v.covering or v.carry is not None or v.again):
                more = v.written()
                if more:
                    again = more if again is None else again + more
        if again:
            self.submit([(r.name, r) for r in again], [], wait=False)

    @staticmethod
    def _settle(slots: list[tuple], err: BaseException | None) -> None:
        """Count written ops against their tickets (a ticket's future is done when its last op is written), or fail
        every ticket among ``slots`` with ``err``. Consecutive ops of one submission share a ticket, so runs of it
        are counted at once."""
        run, n = None, 0
        for _, w, _ in slots:
            if w is None:
                continue
            if type(w) is _Ticket:
                if w is run:
                    n += 1
                    continue
                if run is not None:
                    _count(run, n, err)
                run, n = w, 1
            else:
                for t in w:
                    _count(t, 1, err)
        if run is not None:
            _count(run, n, err)

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
        q, self._queue = self._queue, OrderedDict()
        self._settle(list(q.values()), err)
        self._flying.clear()
        self._release_barriers(err)
        self._idle.set()


def _retrieved(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def _count(t: _Ticket, n: int, err: BaseException | None) -> None:
    """``n`` ops of ticket ``t`` written (``err`` None) or failed."""
    if t.fut.done():
        return
    if err is not None:
        t.fut.set_exception(err)
        return
    t.left -= n
    if t.left <= 0:
        t.fut.set_result(None)
