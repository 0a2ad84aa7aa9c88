"""etcd persistence: the key layout, fenced transactions, leases, the election records and the start-up loader.

Layout under ``prefix`` (``MetaserverConfig.etcd_prefix``)::

    {prefix}/nodes/{node_id}        msgpack(node record incl. lease_id), attached to the node's lease
    {prefix}/arenas/{node_id}       msgpack(the same record), durable: which arena the node's pages live in
    {prefix}/pages/{ns}/+{term}.{n}  a commit record (READY pages of COMMITs of one namespace, or a dead list); the
                                    name is unique: the term (the leader key's create revision) and a count within
                                    it, both hex
    {prefix}/pages/{ns}/{hex key}   a page record of its own (the layout before commit records, still read): the key
                                    in its digest form (``keyform.digest_key``: 64 hex characters for a digest)
    {prefix}/gen                    decimal: every generation below it may have been handed out
    {prefix}/leader                 the leader's advertise address, attached to its election lease
    {prefix}/open                   msgpack([wall time, [[node_id, offset, length], ...]]): the open allocations a
                                    leader that stepped down on purpose handed on (``metaserver/ha/handoff.py``)

The arena record outlives the node's lease on purpose: when every metaserver is away longer than a node's lease_ttl
the leased record expires, but the next leader still knows which arena (id, capacity) the pages were written to,
so it can keep them for a node that comes back with that arena and drop them for one that does not.

The values of page and commit records (their layouts) are ``metaserver/table/records.py``'s; how commit records and
dead lists follow the table, ``metaserver/table/commits.py``'s (one record for many pages: ``bench/records.py``, GPU
machine, 2.5x the put rate, 3.5x cheaper to replay from a watch, 4.1x faster to scan). A load orders a commit
record's pages by the record's create revision (a rewrite keeps it).

Fencing: once this metaserver wins the election, ``fence(revision)`` makes every transaction written through this
store (pages, node records, generations) carry ``create_revision(leader key) == revision``. A deposed leader's
writes therefore fail in etcd itself; the store raises ``NotLeader`` and calls ``on_fenced`` once.

This is the only module that talks to aetcd/grpc (the partition's member records and slot campaigns included:
``put_member``, ``campaign``; a combined transaction is built with ``new_txn`` and sent with ``send``). Their
errors are translated here into ``Unavailable`` (``raise ... from``), so the rest of the metaserver sees one error
type for "etcd could not do it". An outcome that is an answer rather than a failure (a lease etcd no longer knows)
is told by its grpc status code; a transaction too large only by etcd's text (INVALID_ARGUMENT either way; etcd's
own client matches the text too). Of aetcd's client this uses the public calls and three undocumented attributes
(``kvstub``, ``metadata``, ``channel``: the paged range, the in-place transaction and the watch stream have no
public call), hence aetcd's upper bound in pyproject.toml.

The batching writer lives in ``metaserver/store/batcher.py``, the generation counter in ``metaserver/store/generations.py``.

Snapshot and watch (the warm standby, ``metaserver/ha/standby.py``): ``load_at`` reads every record at one revision
(each paged range request names it, so the pages of a long scan are one consistent snapshot) and returns it;
``watch(start)`` then streams every change under the prefix from ``start`` on, in revision order, as batches of raw
events. A compacted ``start`` is not an error but a value (the caller must load again), every other failure is
``Unavailable``.

Costs: one etcd round trip per ``batch`` ops under load; the loader reads ``LOAD_PAGE`` records per round trip and
parses them as they arrive into the pages they become (``metaserver/table/records.py``, about 1.5 us a record); a watch
costs one stream, its responses fragmented by etcd (``fragment``) so a burst of revisions never exceeds gRPC's
message limit.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, AsyncIterator

import aetcd
import aetcd.exceptions
import aetcd.rpc
import msgpack

from metaserver.table.entry import PART_MASK, SHARD_SHIFT
from metaserver.table.records import BATCH_MARK, _name
from metaserver.table.snapshot import PageRecords
from metaserver.table.records import BATCH_PAGES as _BATCH_PAGES
from transport.wire import Status
from umbp.config import split_host_port
from umbp.errors import NotLeader, TxnTooLarge, Unavailable

log = logging.getLogger("umbp.metaserver")

BATCH_PAGES = _BATCH_PAGES  # pages of a commit record at most (the layout above; the benches read it here)
LOAD_PAGE = 5000  # records a range request of a scan asks for at most ...
SCAN_FIRST = 256  # ... and at first, until the answers show how large the records are:
SCAN_BYTES = 4 << 20  # each later request asks for about this many bytes (a commit record of 128 digest pages is
# about 12 KB, a page record 0.1 KB; one of 128 pages with 512-byte keys and parents about 140 KB)
GRPC_OPTIONS = {"grpc.max_receive_message_length": 64 << 20}  # gRPC's default is 4 MiB: a first answer of
# SCAN_FIRST large commit records (36 MB) must still arrive
PAGE, NODE, ARENA, OTHER = range(4)  # what an etcd key under the prefix holds (``EtcdStore.kind_of``)


_HEX = frozenset(b"0123456789abcdef")


def _split(first: bytes, last: bytes, hi: bytes, root: int) -> list[tuple[bytes, bytes, int]]:
    """Ranges covering exactly ``[last + 0x00, hi)`` (what a range with more than one page still holds after its
    first page ``first..last``), as buckets of the bytes after ``last``'s prefixes: the rest of ``last``'s bucket at
    the first position where ``first`` and ``last`` differ, then at that position and each one above it down to
    ``root`` (the prefix the whole range shares), the bytes after ``last``'s: a range per hex digit, one per run of
    other bytes. Returned as (from, to, shared prefix length), empty ones left out."""
    n = 0
    m = min(len(first), len(last))
    while n < m and first[n] == last[n]:
        n += 1
    n = min(n, len(last) - 1)
    out: list[tuple[bytes, bytes, int]] = []

    def add(a: bytes, b: bytes, shared: int) -> None:
        b = min(b, hi) if hi != b"\0" else b
        if a < b:
            out.append((a, b, shared))

    add(last + b"\0", aetcd.utils.prefix_range_end(last[:n + 1]), n + 1)
    for j in range(n, root - 1, -1):
        parent = last[:j]
        c = last[j] + 1
        while c < 256:
            if c in _HEX:
                add(parent + bytes([c]), parent + bytes([c + 1]), j + 1)
                c += 1
            else:
                d = c
                while d < 256 and d not in _HEX:
                    d += 1
                add(parent + bytes([c]), parent + bytes([d]) if d < 256 else aetcd.utils.prefix_range_end(parent),
                    j)
                c = d
    return out


_TOO_MANY_OPS = "too many operations in txn request"  # etcd's error texts: ErrGRPCTooManyOps,
_TOO_LARGE = "request is too large"  # ErrGRPCRequestTooLarge (etcd's own client tells its errors apart by these)
# What an etcd/grpc call may raise: aetcd's own errors, grpc's (raw or wrapped), timeouts, socket errors.
FOREIGN = (aetcd.exceptions.ClientError, aetcd.rpc.BaseError, aetcd.rpc.RpcError, asyncio.TimeoutError, OSError)


def grpc_code(e: BaseException):
    """The grpc status code behind an etcd failure (aetcd wraps codes it has no class for, NOT_FOUND among them,
    in a plain ``ClientError`` raised from the grpc error); None when there is none."""
    for err in (e, e.__cause__):
        if isinstance(err, aetcd.rpc.AioRpcError):
            return err.code()
    return None


def unavailable(what: str, e: BaseException) -> Unavailable:
    """The metaserver's error for an etcd/grpc failure: ``TxnTooLarge`` when etcd refused a transaction for its
    number of operations (INVALID_ARGUMENT "too many operations in txn request") or its bytes ("request is too
    large"), else ``Unavailable``."""
    detail = (f"{e.code().name}: {e.details()}" if isinstance(e, aetcd.rpc.AioRpcError)  # not its 5-line repr
              else str(e) or type(e).__name__)
    if _TOO_MANY_OPS in detail or _TOO_LARGE in detail:  # INVALID_ARGUMENT, told apart only by these texts
        return TxnTooLarge("metaserver", f"etcd {what} refused: too large a transaction ({detail})",
                           Status.UNAVAILABLE)
    return Unavailable("metaserver", f"etcd {what} failed: {detail}", Status.UNAVAILABLE)


def add_ops(req, items) -> None:
    """Add (etcd key, value | None: delete) pairs to a TxnRequest's success branch, built in place."""
    add = req.success.add
    for key, value in items:
        if value is None:
            add().request_delete_range.key = key
        else:
            p = add().request_put
            p.key = key
            p.value = value


class EtcdStore:
    """Thin async facade over one aetcd client; every method raises Unavailable on an etcd/grpc failure."""

    _one: PageRecords | None = None  # ``page_record``'s parser, made at its first call (its namespaces kept)
    _batch_seq = 0  # commit records named by this store so far (``batch_name``)
    _term = int.from_bytes(os.urandom(6), "big") | 1 << 48  # an unfenced store's term: not a revision

    def __init__(self, addr: str, prefix: str, timeout_s: float = 10.0):
        host, port = split_host_port(addr, "metaserver", 2379)
        self.addr = f"{host}:{port}"
        self.prefix = prefix.rstrip("/")
        self.timeout_s = timeout_s  # one etcd request at most (MetaserverConfig.etcd_timeout_s)
        self.client = aetcd.Client(host, port, timeout=timeout_s, options=GRPC_OPTIONS)
        self._pages = f"{self.prefix}/pages/".encode()
        self._nodes = f"{self.prefix}/nodes/".encode()
        self._arenas = f"{self.prefix}/arenas/".encode()
        self.gen_key = f"{self.prefix}/gen".encode()
        self.leader_key = f"{self.prefix}/leader".encode()
        self.open_key = f"{self.prefix}/open".encode()  # a leaving leader's open allocations (metaserver/ha/handoff.py)
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
        """The record of a page; ``payload_len`` is the entry's layout code (a shared entry's: ``part_len | n <<
        SHARD_SHIFT``, written as its part length and ``n`` appended)."""
        if payload_len > PART_MASK:
            return msgpack.packb([node_id, offset, payload_len & PART_MASK, gen, parent, payload_len >> SHARD_SHIFT],
                                 use_bin_type=True)
        return msgpack.packb([node_id, offset, payload_len, gen, parent], use_bin_type=True)

    def batch_name(self, ns: str) -> bytes:
        """A new commit record's etcd key: unique (this leader's term, the fence's revision, and a count)."""
        self._batch_seq += 1
        return b"%s%s/%s%x.%x" % (self._pages, ns.encode(), BATCH_MARK, self.fence_rev or self._term, self._batch_seq)

    # -- calls -------------------------------------------------------------------------------------------------
    async def _call(self, what: str, coro):
        try:
            return await coro
        except FOREIGN as e:
            raise unavailable(what, e) from e

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

    async def write(self, items: list) -> None:
        """Apply (etcd key, value | None: delete) pairs in one fenced transaction, the writer's hot path: the
        request protobuf is built in place (``success.add()``, no per-op aetcd objects, about 0.8 us an op against
        3.6) and the answer's per-op responses are never converted (only ``succeeded`` is read). Raises NotLeader
        when the fence failed, Unavailable when etcd could not do it."""
        req = aetcd.rpc.TxnRequest()
        self.add_fence(req)
        add_ops(req, items)
        if await self.send(req):
            return
        await self.check_fence()
        raise Unavailable("metaserver", "etcd transaction refused although the leader key is ours",
                          Status.UNAVAILABLE)

    @staticmethod
    def new_txn():
        """An empty TxnRequest to fill with ``add_fence`` and ``add_ops`` and send with ``send`` (combine.py)."""
        return aetcd.rpc.TxnRequest()

    def add_fence(self, req) -> None:
        """Add this store's fence compare (its leader key's create revision) to ``req`` when fenced."""
        if self.fence_rev:
            req.compare.append(self.client.transactions.create(self.leader_key).__eq__(self.fence_rev)
                               .build_message())

    async def send(self, req) -> bool:
        """Send a built TxnRequest through this store's client; its ``succeeded``. Unavailable on failure."""
        c = self.client
        try:
            await c.connect()  # returns at once when connected
            res = await c.kvstub.Txn(req, timeout=self.timeout_s, metadata=c.metadata)
        except FOREIGN as e:
            raise unavailable("transaction", e) from e
        return res.succeeded

    async def check_fence(self) -> None:
        """After a refused transaction: raise NotLeader (calling ``on_fenced``) when the leader key is no longer
        the one this store's fence names; return when it still is (or the store is unfenced)."""
        rev = self.fence_rev
        if not rev:
            return
        cur = await self._call("get", self.client.get(self.leader_key))
        if cur is None or cur.create_revision != rev:
            self._fenced(rev, cur)

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
        """Revoke a lease; one etcd no longer knows (expired, revoked already: grpc NOT_FOUND) is what we wanted."""
        try:
            await self.client.revoke_lease(lease_id)
        except FOREIGN as e:
            if grpc_code(e) != aetcd.rpc.StatusCode.NOT_FOUND:
                raise unavailable("lease revoke", e) from e

    async def put_member(self, key: bytes, value: bytes, lease_id: int) -> None:
        """Put a record attached to ``lease_id``, unfenced: a partitioned pool's ``members/{addr}`` record, which
        belongs to the process, not to a slot's term (metaserver/ha/partition.py)."""
        await self._call("put", self.client.put(key, value, lease=lease_id))

    # -- election (metaserver/ha/election.py drives these) -------------------------------------------------------
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

    async def get_value(self, key: bytes) -> bytes | None:
        """The value at ``key`` (None when absent)."""
        cur = await self._call("get", self.client.get(key))
        return None if cur is None else cur.value

    async def compare_and_put(self, key: bytes, value: bytes, expect: bytes | None) -> bool:
        """Put ``value`` at ``key`` if it still holds ``expect`` (None: absent), fenced like every write."""
        t = self.client.transactions
        cmp = t.version(key) == 0 if expect is None else t.value(key) == expect
        return await self.txn([self.op_put(key, value)], compare=[cmp])

    async def put_node(self, node_id: str, record: dict[str, Any], lease_id: int) -> None:
        """The leased liveness record and the durable arena record, in one (fenced) transaction."""
        value = msgpack.packb(record, use_bin_type=True)
        await self.txn([self.op_put(self.node_key(node_id), value, lease_id),
                        self.op_put(self.arena_key(node_id), value)])

    async def revision(self) -> int:
        """etcd's current revision (the header of a count-only read)."""
        await self._call("connect", self.client.connect())
        req = aetcd.rpc.RangeRequest(key=self.leader_key, count_only=True)
        resp = await self._call("range", self.client.kvstub.Range(req, timeout=self.timeout_s,
                                                                     metadata=self.client.metadata))
        return int(resp.header.revision)

    async def scan(self, prefix: bytes, page: int = LOAD_PAGE, revision: int = 0) -> AsyncIterator[list]:
        """Yield the key-values under ``prefix`` in pages of at most ``page`` (raw protobuf kvs: key, value,
        mod_revision, lease), in no particular order, as of ``revision`` (0: each page as of its own read). aetcd's
        get_range has no limit, so this builds the RangeRequest itself. The first request asks for SCAN_FIRST
        records, each later one for about SCAN_BYTES as the answers so far measured them (commit records are a
        hundred times a page record's size: 5,000 of them would pass any sane gRPC message limit); when that makes
        the limit more than double, the range goes on after the answer's last key instead of being split.

        Cost: etcd (3.4) walks its index over a request's whole range to count it, whatever the limit, so paging
        through one prefix range walks O(N^2 / page) keys (1 M pages: minutes). A range that returns ``more`` is
        therefore split (``_split``) into byte buckets after the common prefix of what it returned (every hex digit
        its own bucket, since page keys end in hex), so each key is walked about log16(N / page) + 1 times, plus
        one round trip per bucket. A few namespaces cost little more; many namespaces with long shared name
        prefixes cost up to one walk of the rest per namespace."""
        end = aetcd.utils.prefix_range_end(prefix)
        await self._call("connect", self.client.connect())
        todo = [(prefix, end, len(prefix))]  # (from, to, length of the prefix every key in it shares)
        limit = min(page, SCAN_FIRST)
        for _ in range(1 << 40):  # bounded: every round finishes a range or replaces it by smaller ones
            if not todo:
                return
            lo, hi, root = todo.pop()
            req = aetcd.rpc.RangeRequest(key=lo, range_end=hi, limit=limit, revision=revision)
            resp = await self._call("range", self.client.kvstub.Range(req, timeout=self.timeout_s,
                                                                         metadata=self.client.metadata))
            kvs = list(resp.kvs)
            if kvs:
                asked, limit = limit, max(16, min(page, SCAN_BYTES * len(kvs) // max(1, resp.ByteSize())))
                yield kvs
                if resp.more and limit > asked * 2:  # the first, cautious answer: go on from it at full size
                    todo.append((kvs[-1].key + b"\0", hi, root))
                    continue
            if resp.more and kvs:
                todo.extend(_split(kvs[0].key, kvs[-1].key, hi, root))

    @staticmethod
    def node_record(kv) -> dict | None:
        """A node or arena record as a map with ``lease_id`` (the kv's lease) added; None when unreadable."""
        try:
            rec = msgpack.unpackb(kv.value, raw=False)
            if type(rec) is not dict:
                raise TypeError("not a map")
        except (ValueError, TypeError, msgpack.exceptions.UnpackException):
            log.warning("metaserver: ignoring unreadable record %r", kv.key)
            return None
        rec["lease_id"] = kv.lease or 0
        return rec

    def page_records(self) -> PageRecords:
        """An empty ``PageRecords`` for this store's page keys (a standby parses a run of watch events with it)."""
        return PageRecords(self._pages)

    def page_record(self, kv) -> tuple:
        """(mod_revision, node_id, ns, key, offset, payload_len, gen, parent, etcd_key) of a page kv; node_id None
        when the record cannot be read (the leader deletes it). ``payload_len`` is the layout code (a shared
        entry's record, six fields, folds its ``n`` in: ``metaserver.table.entry.layout``). What counts as unreadable is
        ``PageRecords``' rule (one record at a time here: a watch event)."""
        recs = self._one
        if recs is None:
            recs = self._one = PageRecords(self._pages)
        recs.add((kv,))
        if recs.junk:
            recs.junk.clear()
            return (0, None, "", b"", 0, 0, 0, None, kv.key)
        (node_id, (ents, revs)), = recs.groups.items()
        recs.groups.clear()
        recs._apps.clear()
        e = ents[0]
        return (revs[0], node_id, e.ns, e.key, e.offset, e.payload_len, e.gen, e.parent, kv.key)

    def records_of(self, kv) -> list[tuple]:
        """``page_record`` of a page kv, as a list; of a commit record, one such tuple per page, each at the
        record's create revision and with the record's etcd key (unreadable: one tuple with node_id None and the
        record's etcd key, as ``page_record``'s)."""
        if not self.is_batch(kv.key):
            return [self.page_record(kv)]
        recs = PageRecords(self._pages)
        recs.add((kv,))
        if recs.junk:
            return [(0, None, "", b"", 0, 0, 0, None, kv.key)]
        return [(rev, node_id, e.ns, e.key, e.offset, e.payload_len, e.gen, e.parent, kv.key)
                for node_id, (ents, revs) in recs.done().items() for e, rev in zip(ents, revs)]

    @staticmethod
    def is_batch(etcd_key: bytes) -> bool:
        """Whether a page-space etcd key names a commit record (``{ns}/+{term}.{n}``) rather than one page."""
        return etcd_key[etcd_key.rfind(b"/") + 1:etcd_key.rfind(b"/") + 2] == BATCH_MARK

    def page_name(self, etcd_key: bytes) -> tuple[str, bytes] | None:
        """(ns, key) named by a page's etcd key; None when it is not a name this pool writes (``PageRecords``)."""
        try:
            return _name(etcd_key, len(self._pages))
        except (ValueError, UnicodeDecodeError):
            return None

    def kind_of(self, etcd_key: bytes) -> int:
        """Which record an etcd key under the prefix is: PAGE, NODE, ARENA, or OTHER (leader, gen, foreign)."""
        if etcd_key.startswith(self._pages):
            return PAGE
        if etcd_key.startswith(self._nodes):
            return NODE
        if etcd_key.startswith(self._arenas):
            return ARENA
        return OTHER

    def node_of(self, etcd_key: bytes) -> str:
        """The node id of a ``nodes/`` or ``arenas/`` key."""
        return etcd_key.rpartition(b"/")[2].decode(errors="replace")

    async def _records(self, prefix: bytes, revision: int = 0) -> list[dict]:
        out: list[dict] = []
        async for kvs in self.scan(prefix, 1000, revision):
            for kv in kvs:
                rec = self.node_record(kv)
                if rec is not None:
                    out.append(rec)
        return out

    async def load(self) -> tuple[list[dict], list[dict], "PageRecords"]:
        """Read live node records (their lease still held), durable arena records and page records (parsed and
        grouped by node as they arrive: ``PageRecords``)."""
        return (await self.load_at())[1:]

    async def load_at(self, revision: int = 0) -> tuple[int, list[dict], list[dict], "PageRecords"]:
        """``load`` as one snapshot: every range read names the same revision (0: the current one), returned
        first, so a watch from revision + 1 misses nothing and repeats nothing. Raises Unavailable (also when
        that revision is compacted meanwhile: load again)."""
        rev = revision or await self.revision()
        nodes = await self._records(self._nodes, rev)
        arenas = await self._records(self._arenas, rev)
        pages = PageRecords(self._pages)
        async for kvs in self.scan(self._pages, revision=rev):
            pages.add(kvs)
        return rev, nodes, arenas, pages

    async def watch(self, start_revision: int) -> AsyncIterator[list | None]:
        """Stream every change under the prefix from ``start_revision`` (inclusive), in revision order: yields lists
        of raw protobuf events (``type`` 0 put / 1 delete; ``kv`` with key, value, mod_revision, lease), each list
        ending on a whole revision (etcd's fragments are joined here). When ``start_revision`` is compacted it
        yields None once and ends: the caller must load again. Raises Unavailable when the stream fails or etcd
        cancels it. Blocks while nothing changes; cancelling the consuming task closes the stream."""
        await self._call("connect", self.client.connect())
        create = aetcd.rpc.WatchCreateRequest(key=self.prefix.encode() + b"/",
                                              range_end=aetcd.utils.prefix_range_end(self.prefix.encode() + b"/"),
                                              start_revision=start_revision, fragment=True)
        done = asyncio.Event()

        async def requests():
            yield aetcd.rpc.WatchRequest(create_request=create)
            await done.wait()  # keep the request side open for as long as we read

        call = aetcd.rpc.WatchStub(self.client.channel).Watch(requests(), metadata=self.client.metadata)
        parts: list = []
        try:
            try:
                async for resp in call:
                    if resp.compact_revision:
                        log.warning("metaserver: etcd watch from revision %d: compacted up to %d", start_revision,
                                    resp.compact_revision)
                        yield None
                        return
                    if resp.canceled:
                        raise Unavailable("metaserver", f"etcd watch canceled: {resp.cancel_reason or 'no reason'}",
                                          Status.UNAVAILABLE)
                    if resp.events:
                        parts.extend(resp.events)
                    if parts and not resp.fragment:
                        batch, parts = parts, []
                        yield batch
            except FOREIGN as e:
                raise unavailable("watch", e) from e
            raise Unavailable("metaserver", "etcd watch: the stream ended", Status.UNAVAILABLE)
        finally:
            done.set()
            call.cancel()
