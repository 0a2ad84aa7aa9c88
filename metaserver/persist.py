"""etcd persistence: the key layout, a batching writer, the generation counter and the start-up loader.

Layout under ``prefix`` (``MetaserverConfig.etcd_prefix``)::

    {prefix}/nodes/{node_id}        msgpack(node record incl. lease_id), attached to the node's lease
    {prefix}/arenas/{node_id}       msgpack(the same record), durable: which arena the node's pages live in
    {prefix}/pages/{ns}/{hex key}   msgpack([node_id, offset, payload_len, gen, parent]); READY pages only
    {prefix}/gen                    decimal: every generation below it may have been handed out
    {prefix}/leader                 the leader's advertise address, attached to its election lease

The arena record outlives the node's lease on purpose: when every metaserver is away longer than a node's lease_ttl
the leased record expires, but the next leader still knows which arena (id, capacity) the pages were written to,
so it can keep them for a node that comes back with that arena and drop them for one that does not.

Fencing: once this metaserver wins the election, ``fence(revision)`` makes every transaction written through this
store (pages, node records, generations) carry ``create_revision(leader key) == revision``. A deposed leader's
writes therefore fail in etcd itself; the store raises ``NotLeader`` and calls ``on_fenced`` once.

This is the only module that talks to aetcd/grpc. Their errors are translated here into ``Unavailable``
(``raise ... from``), so the rest of the metaserver sees one error type for "etcd could not do it".

``BatchWriter``: puts and deletes are queued by etcd key (a later op on a key replaces an unsent earlier one, which
also keeps a transaction free of duplicate keys, which etcd rejects). Up to ``inflight`` workers each take at most
``batch`` queued ops into one transaction; ops queued while transactions are in flight coalesce into the next ones,
so throughput grows with load and an idle writer adds no latency. A key already in an in-flight transaction waits
for it, so two ops on one key are applied in submission order. A caller that must not reply before its puts are
durable (COMMIT) gets a future; deletes are fire-and-forget. A failing transaction is retried with backoff for
``retry_s``, then its waiters get the error.

``GenCounter``: generations are reserved from ``{prefix}/gen`` in ranges of ``GEN_RANGE`` with a compare-and-swap
transaction, and refilled in the background at half a range, so allocations almost never wait on etcd.
Generations are unique and increasing across restarts; a crash wastes at most the rest of a range.

Costs: one etcd round trip per ``batch`` ops under load; the loader reads ``LOAD_PAGE`` records per round trip.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any, AsyncIterator

import aetcd
import aetcd.exceptions
import aetcd.rpc
import msgpack

from transport.wire import Status
from umbp.config import split_host_port
from umbp.errors import NotLeader, RemoteError, Unavailable

log = logging.getLogger("umbp.metaserver")

GEN_RANGE = 1 << 20
LOAD_PAGE = 5000


def _unavailable(what: str, e: BaseException) -> Unavailable:
    detail = str(e) or type(e).__name__
    return Unavailable("metaserver", f"etcd {what} failed: {detail}", Status.UNAVAILABLE)


class EtcdStore:
    """Thin async facade over one aetcd client; every method raises Unavailable on an etcd/grpc failure."""

    def __init__(self, addr: str, prefix: str, timeout_s: float = 10.0):
        host, port = split_host_port(addr, "metaserver", 2379)
        self.addr = f"{host}:{port}"
        self.prefix = prefix.rstrip("/")
        self.client = aetcd.Client(host, port, timeout=timeout_s)
        self._pages = f"{self.prefix}/pages/".encode()
        self._nodes = f"{self.prefix}/nodes/".encode()
        self._arenas = f"{self.prefix}/arenas/".encode()
        self.gen_key = f"{self.prefix}/gen".encode()
        self.leader_key = f"{self.prefix}/leader".encode()
        self.fence_rev = 0  # create_revision of the leader key we won at; 0: writes are not fenced
        self.on_fenced = None  # called (once per fence) when etcd refuses a write because we are deposed

    # -- keys --------------------------------------------------------------------------------------------------
    def page_key(self, ns: str, key: bytes) -> bytes:
        return self._pages + ns.encode() + b"/" + key.hex().encode()

    def node_key(self, node_id: str) -> bytes:
        return self._nodes + node_id.encode()

    def arena_key(self, node_id: str) -> bytes:
        return self._arenas + node_id.encode()

    @staticmethod
    def page_value(node_id: str, offset: int, payload_len: int, gen: int, parent: bytes | None) -> bytes:
        return msgpack.packb([node_id, offset, payload_len, gen, parent], use_bin_type=True)

    # -- calls -------------------------------------------------------------------------------------------------
    async def _call(self, what: str, coro):
        try:
            return await coro
        except (aetcd.exceptions.ClientError, aetcd.rpc.BaseError, aetcd.rpc.RpcError, asyncio.TimeoutError,
                OSError) as e:
            raise _unavailable(what, e) from e

    async def wait_ready(self, deadline_s: float) -> None:
        """Block until etcd answers a read, retrying for ``deadline_s``; then raise 'etcd at X unreachable'."""
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        delay = 0.1
        while True:
            try:
                await asyncio.wait_for(self._call("get", self.client.get(self.gen_key)),
                                       max(0.5, end - loop.time()))
                return
            except (Unavailable, asyncio.TimeoutError) as e:
                if loop.time() + delay >= end:
                    raise Unavailable("metaserver", f"etcd at {self.addr} unreachable ({e})",
                                      Status.UNAVAILABLE) from e
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def close(self) -> None:
        try:
            await self.client.close()
        except Exception:  # closing a broken channel: nothing left to do
            pass

    def fence(self, revision: int) -> None:
        """Fence every later write on the leader key's create_revision (0: unfenced, for a single-shot tool)."""
        self.fence_rev = revision

    async def txn(self, ops: list, compare: list | None = None) -> bool:
        """Apply ``ops`` if every compare holds (and, when fenced, the leader key is still the one we created).
        Returns False when one of ``compare`` failed; raises NotLeader when the fence did."""
        compare = list(compare or [])
        rev = self.fence_rev
        if rev:
            compare.append(self.client.transactions.create(self.leader_key) == rev)
        res = await self._call("transaction", self.client.transaction(compare=compare, success=ops, failure=[]))
        if res[0]:
            return True
        if rev:
            cur = await self._call("get", self.client.get(self.leader_key))
            if cur is None or cur.create_revision != rev:
                self._fenced(rev, cur)
        return False

    def _fenced(self, rev: int, cur) -> None:
        holder = cur.value.decode(errors="replace") if cur is not None else None
        cb, self.on_fenced = self.on_fenced, None
        if cb is not None:
            cb()
        raise NotLeader("metaserver", f"deposed: the leader key is no longer the one created at revision {rev} "
                                      f"(leader now {holder or 'none'}); etcd refused the write",
                        Status.NOT_LEADER, leader=holder)

    def op_put(self, key: bytes, value: bytes, lease: int | None = None):
        return self.client.transactions.put(key, value, lease=lease)

    def op_delete(self, key: bytes):
        return self.client.transactions.delete(key)

    async def grant(self, ttl: int) -> int:
        lease = await self._call("lease grant", self.client.lease(ttl))
        return lease.id

    async def refresh(self, lease_id: int) -> int:
        """Keep a lease alive; returns its remaining TTL (0 when etcd no longer knows it)."""
        reply = await self._call("lease refresh", self.client.refresh_lease(lease_id))
        return int(reply.TTL) if reply is not None else 0

    async def revoke(self, lease_id: int) -> None:
        try:
            await self._call("lease revoke", self.client.revoke_lease(lease_id))
        except Unavailable as e:
            if "not found" not in str(e):
                raise

    # -- election (metaserver/leader.py drives these) ---------------------------------------------------------
    async def campaign(self, value: bytes, lease_id: int) -> tuple[bool, int, bytes | None, int]:
        """Create the leader key under ``lease_id`` unless it exists (compare create_revision == 0).
        Returns (won, create_revision, holder value, holder lease) of the key as it is after the attempt."""
        t = self.client.transactions
        await self._call("campaign", self.client.transaction(
            compare=[t.create(self.leader_key) == 0], success=[t.put(self.leader_key, value, lease=lease_id)],
            failure=[]))
        cur = await self._call("get", self.client.get(self.leader_key))
        if cur is None:  # created and already gone (lease lost in between): a lost round
            return False, 0, None, 0
        return cur.lease == lease_id, cur.create_revision, cur.value, cur.lease

    async def leader(self) -> tuple[bytes, int, int] | None:
        """(value, create_revision, lease) of the leader key, or None when nobody leads."""
        cur = await self._call("get", self.client.get(self.leader_key))
        return None if cur is None else (cur.value, cur.create_revision, cur.lease)

    async def put_node(self, node_id: str, record: dict[str, Any], lease_id: int) -> None:
        """The leased liveness record and the durable arena record, in one (fenced) transaction."""
        value = msgpack.packb(record, use_bin_type=True)
        await self.txn([self.op_put(self.node_key(node_id), value, lease_id),
                        self.op_put(self.arena_key(node_id), value)])

    async def scan(self, prefix: bytes, page: int = LOAD_PAGE) -> AsyncIterator[list]:
        """Yield the key-values under ``prefix`` in pages of at most ``page`` (raw protobuf kvs: key, value,
        mod_revision, lease). aetcd's get_range has no limit, so this builds the RangeRequest itself."""
        start = prefix
        end = aetcd.utils.prefix_range_end(prefix)
        await self._call("connect", self.client.connect())
        while True:
            req = aetcd.rpc.RangeRequest(key=start, range_end=end, limit=page)
            resp = await self._call("range", self.client.kvstub.Range(req, timeout=self.client._timeout,
                                                                         metadata=self.client.metadata))
            kvs = list(resp.kvs)
            if kvs:
                yield kvs
            if not resp.more or not kvs:
                return
            start = kvs[-1].key + b"\0"

    async def _records(self, prefix: bytes) -> list[dict]:
        out: list[dict] = []
        async for kvs in self.scan(prefix, 1000):
            for kv in kvs:
                try:
                    rec = msgpack.unpackb(kv.value, raw=False)
                    if type(rec) is not dict:
                        raise TypeError("not a map")
                    rec["lease_id"] = kv.lease or 0
                    out.append(rec)
                except (ValueError, TypeError, msgpack.exceptions.UnpackException):
                    log.warning("metaserver: ignoring unreadable record %r", kv.key)
        return out

    async def load(self) -> tuple[list[dict], list[dict], list[tuple]]:
        """Read live node records (their lease still held), durable arena records and page records. Pages come
        back as (mod_revision, node_id, ns, key, offset, payload_len, gen, parent, etcd_key); unparsable ones with
        node_id None (the caller deletes them)."""
        nodes = await self._records(self._nodes)
        arenas = await self._records(self._arenas)
        pages: list[tuple] = []
        plen_prefix = len(self._pages)
        async for kvs in self.scan(self._pages):
            for kv in kvs:
                try:
                    ns_b, _, hexkey = kv.key[plen_prefix:].rpartition(b"/")
                    node_id, off, plen, gen, parent = msgpack.unpackb(kv.value, raw=False)
                    pages.append((kv.mod_revision, node_id, ns_b.decode(), bytes.fromhex(hexkey.decode()),
                                  int(off), int(plen), int(gen), parent, kv.key))
                except (ValueError, TypeError, UnicodeDecodeError, msgpack.exceptions.UnpackException):
                    pages.append((0, None, "", b"", 0, 0, 0, None, kv.key))
        return nodes, arenas, pages


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
                ops = [self.store.op_put(k, v) if v is not None else self.store.op_delete(k) for k, v, _ in items]
                deadline = loop.time() + self.retry_s
                delay = 0.05
                while True:
                    try:
                        await self.store.txn(ops)
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
                err = e if isinstance(e, RemoteError) else _unavailable("transaction", e)
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


class GenCounter:
    """Hands out unique, increasing generations from ranges reserved in etcd."""

    def __init__(self, store: EtcdStore, span: int = GEN_RANGE):
        self.store = store
        self.span = span
        self._ranges: deque[list[int]] = deque()  # [next, limit)
        self._refill: asyncio.Task | None = None

    async def start(self) -> None:
        await self._reserve()

    def _left(self) -> int:
        return sum(hi - lo for lo, hi in self._ranges)

    def take_nowait(self, n: int) -> int | None:
        """First of ``n`` consecutive fresh generations, or None when the reserved ranges cannot supply them."""
        while self._ranges and self._ranges[0][1] - self._ranges[0][0] < n:
            if len(self._ranges) == 1:
                break
            self._ranges.popleft()  # too little left in this range: skip the rest
        base = None
        if self._ranges and self._ranges[0][1] - self._ranges[0][0] >= n:
            r = self._ranges[0]
            base = r[0]
            r[0] += n
        if self._left() < self.span // 2 and (self._refill is None or self._refill.done()):
            self._refill = asyncio.create_task(self._reserve())
        return base

    async def take(self, n: int) -> int:
        for _ in range(100):
            base = self.take_nowait(n)
            if base is not None:
                return base
            if self._refill is not None:
                await asyncio.shield(self._refill)
                if self._refill.exception() is not None:
                    raise self._refill.exception()
            else:
                await self._reserve()
        raise Unavailable("metaserver", "could not reserve generations from etcd", Status.UNAVAILABLE)

    async def _reserve(self) -> None:
        key = self.store.gen_key
        t = self.store.client.transactions
        for _ in range(50):
            cur = await self.store._call("get", self.store.client.get(key))
            if cur is None:
                lo, cmp = 1, t.version(key) == 0
            else:
                lo, cmp = int(cur.value), t.value(key) == cur.value
            hi = lo + self.span
            if await self.store.txn([self.store.op_put(key, str(hi).encode())], compare=[cmp]):
                if self._ranges and self._ranges[-1][1] == lo:
                    self._ranges[-1][1] = hi
                else:
                    self._ranges.append([lo, hi])
                return
        raise Unavailable("metaserver", "generation counter: too much contention on " + key.decode(),
                          Status.UNAVAILABLE)
