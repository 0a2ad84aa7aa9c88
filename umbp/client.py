"""``umbp.Client``: the library an engine rank uses to put and get KV pages.

Every batch call is one metaserver round trip for placement or lookup, then the data moves straight between the
caller's memory and the nodes' arenas, with the transfers to all nodes of the batch in flight together (each
node's transport is started before any is finished), then one more metaserver message for puts (COMMIT; a get's
read lease goes back in the next LOOKUP: ``umbp/releases.py``). A batch_put of more than one chunk (CHUNK_MAX_PAGES
pages or CHUNK_BYTES) is pipelined on the metaserver connection: the next chunks' ALLOCs and the previous chunks'
COMMITs are in flight while a chunk is written; the call still returns only once every COMMIT is durable.

A get whose pages the client has seen before (an earlier LOOKUP's answer) reads them while its LOOKUP is in flight
and keeps what the answer confirms (``umbp/speculate.py``): the round trip overlaps the copy instead of preceding it.

Per page on the hot path: no copies beyond the transport's own (tcp: one READV/WRITEV frame per batch and node,
received with ``recvmsg_into`` straight into the outs; shm: one memcpy), ``get()`` reads into the ``bytes`` it
returns, CUDA outs are staged through pooled pinned buffers and copied up asynchronously with one wait. A
``batch_get_into`` into one 2-D array or tensor, or a list of host tensors or arrays, is carried as arrays from the
LOOKUP answer's rows, without a Python object a page (``umbp/readbatch.py``).

Contracts:
- ``put``/``batch_put``: True = stored by this call, False = the key already existed (dedup; nothing written).
  A pool with no space left raises ``PoolFull``; a node that fails mid-write raises ``TransportError``: keys whose
  bytes did not land are aborted, never committed, so no reader can see a half-written page.
- ``get_into``/``batch_get_into``: bytes written, or -1 for a miss (whose out is unspecified: read-ahead may have
  copied a remembered location into it before the LOOKUP answered the miss). A page on a node that died is a miss.
  A slot whose header does not match the directory (stale, torn, corrupt) raises ``CorruptionError``; wrong bytes
  are never returned as data.
- CUDA outs: pages on same-host nodes are read by the gather kernel straight from the mapped arena (``umbp.devcopy``,
  arena registered once per client), others through pooled pinned buffers; CUDA values of puts are written by the
  kernel straight into same-host arenas, or staged through pooled pinned buffers (``umbp.puts``).
- ``batch_get_ranges_into``/``batch_put_ranges``: the same, for byte ranges of pages (a layer group of a page-first
  page) and for pages assembled from several buffers (one per layer). Still one LOOKUP (or ALLOC + COMMIT) per
  batch; every range read checks its object's header.
- ``mapped``: zero-copy access to pages on same-host nodes (the mapped arena), under a read lease, headers checked
  again on exit; a GPU gather reads straight from it.
- One deadline (``timeout_s``) covers each call, retries included. Calls from several threads are serialised.
- Transport per node: ``auto`` picks shm (same host), then rdma (device on both ends), then tcp.
"""

from __future__ import annotations

import operator
import os
import threading
import time
from typing import Any, ContextManager, Iterable, Sequence

from transport import keyform, wire
from transport.base import Pending, Transport
from transport.shm import ShmTransport, boot_id
from transport.tcp import TcpTransport
from umbp.auth import with_caps
from umbp.buffers import CudaOut, HostSpans, as_writable_view, flush_cuda
from umbp.config import ClientConfig, resolve
from umbp.devcopy import DeviceBatch, DeviceCopier
from umbp.errors import (CorruptionError, DeadlineExceeded, InvalidArgument, NotFound, RemoteError, TransportError,
                         TransportUnavailable)
from umbp.keys import normalize_key, normalize_keys  # noqa: F401  (umbp.client.normalize_key is public)
from umbp.releases import ReleasingMeta
from umbp.shard import ShardedMeta
from umbp.slotrouter import MetaRouter
from umbp.speculate import Speculation
from umbp.mapped import Mapped, MappedPages  # noqa: F401  (umbp.client.MappedPages is public)
from umbp.puts import Puts
from umbp.pagereads import read_ahead, read_ops
from umbp.readbatch import DISK, get_into, late_reads_missed, out_addresses, rows_outs

NEW, EXISTS, NO_SPACE, IN_FLIGHT = (wire.AllocState.NEW, wire.AllocState.EXISTS, wire.AllocState.NO_SPACE,
                                    wire.AllocState.IN_FLIGHT)


class Client:
    def __init__(self, metaserver: str | None = None, namespace: str | None = None, token: str | None = None,
                 transport: str | None = None, *, timeout: float | None = None, checksum: bool | None = None,
                 tls_ca: str | None = None, config: ClientConfig | None = None, shard: tuple | None = None):
        self.config = config or resolve(ClientConfig, {"metaserver": metaserver, "namespace": namespace,
                                                       "token": token, "transport": transport,
                                                       "timeout_s": timeout, "checksum": checksum,
                                                       "tls_ca": tls_ca, "shard": shard})
        self.namespace = self.config.namespace
        self.component = f"client {self.namespace}"
        self._meta = MetaRouter(self.config.metaserver, "client", self.config.token, tls_ca=self.config.tls_ca)
        if self.config.shard is not None:  # one rank's part of TP-sharded pages (umbp/shard.py)
            self._meta = ShardedMeta(self._meta, self.config.shard)
        self._meta = ReleasingMeta(self._meta)  # read leases go back in the next LOOKUP (umbp/releases.py)
        self._nodes: dict[str, dict] = {}
        self._transports: dict[str, Transport] = {}
        self._lock = threading.RLock()
        self._boot = boot_id()
        self._registered: list[memoryview] = []
        self._device = DeviceCopier(self.component)  # CUDA outs on same-host pages: the gather kernel
        # remembered page locations, read ahead of the LOOKUP (umbp/speculate.py)
        self._spec = Speculation(enabled=self.config.read_ahead)
        self.counters = {"puts": 0, "dedup": 0, "gets": 0, "misses": 0, "bytes_put": 0, "bytes_got": 0,
                         "bytes_mapped": 0, "node_failures": 0, "kernel_put_bytes": 0, "staged_put_bytes": 0,
                         "late_reads": 0}
        self._counts = threading.Lock()  # counters change only under it (``count``): threads share a client
        self._closed = False
        self.puts = Puts(self)  # ALLOC, write, COMMIT (umbp/puts.py)
        self.maps = Mapped(self)  # ``mapped`` (umbp/mapped.py)

    # ---- lifecycle ------------------------------------------------------------------------------------------

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._device.close()  # arena registrations go before the arenas are unmapped
            for t in self._transports.values():
                t.close()
            self._transports.clear()
            self._meta.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _deadline(self) -> float:
        if self._closed:
            raise InvalidArgument(self.component, "client is closed")
        return time.monotonic() + self.config.timeout_s

    # ---- nodes and transports -------------------------------------------------------------------------------

    def _refresh_nodes(self, deadline: float) -> None:
        nodes = self._meta.call(wire.Op.NODES, {}, deadline)["nodes"]
        self._nodes = {n["node_id"]: n for n in nodes}

    def _node_info(self, node_id: str, deadline: float) -> dict:
        """The node map of ``node_id`` (NODES asked again when it is unknown or was seen dead)."""
        info = self._nodes.get(node_id)
        if info is None or not info.get("alive", True):
            self._refresh_nodes(deadline)
            info = self._nodes.get(node_id)
            if info is None:
                raise TransportError(self.component, f"node {node_id} is not known to the metaserver")
        return info

    def _transport_for(self, node_id: str, deadline: float) -> Transport:
        t = self._transports.get(node_id)
        if t is not None:
            return t
        if node_id.endswith(DISK):  # a node's disk tier: always its TCP port, READV_DISK (umbp/node/tiering.py)
            base = node_id[:-len(DISK)]
            info = self._node_info(base, deadline)
            t = TcpTransport(base, info.get("addr") or f"{info['host']}:{info['port']}", self.config.token,
                             tls_ca=self.config.tls_ca, tls_streams=self.config.tls_streams, ktls=self.config.ktls)
            t.read_op = wire.Op.READV_DISK
            self._transports[node_id] = t
            return t
        info = self._node_info(node_id, deadline)
        mode = self.config.transport
        errors = []
        if mode in ("auto", "shm"):
            try:
                t = ShmTransport(node_id, info["arena_path"], info["arena_id"], info.get("boot_id", ""))
            except TransportError as e:
                errors.append(str(e))
        if t is None and mode in ("auto", "rdma"):
            if "rdma" in info.get("transports", ()):
                try:
                    from transport.rdma_link import client_transport

                    t = client_transport(node_id, info, self._registered, self.config)
                except (ImportError, TransportError) as e:
                    errors.append(f"transport rdma {node_id}: {e}")
            else:
                errors.append(f"transport rdma {node_id}: node offers no RDMA")
        if t is None and mode in ("auto", "tcp"):
            t = TcpTransport(node_id, info.get("addr") or f"{info['host']}:{info['port']}", self.config.token,
                             tls_ca=self.config.tls_ca, tls_streams=self.config.tls_streams, ktls=self.config.ktls)
        if t is None:
            raise TransportUnavailable(self.component, f"transport {mode} forced but unusable for node {node_id}: "
                                                       + "; ".join(errors))
        for buf in self._registered:
            t.register(buf)
        self._transports[node_id] = t
        return t

    def _drop_transport(self, node_id: str) -> None:
        t = self._transports.pop(node_id, None)
        if t is not None:
            t.close()
        self._nodes.pop(node_id, None)

    def local_arenas(self) -> dict[str, memoryview]:
        """The mapped arena of every live node on this host (shm reachable), by node id: what a GPU gather may
        register with CUDA ahead of the first load. Blocks for one NODES request."""
        with self._lock:
            deadline = self._deadline()
            self._refresh_nodes(deadline)
            out = {}
            for node_id, info in list(self._nodes.items()):
                if not info.get("alive", True):
                    continue
                try:
                    t = self._transport_for(node_id, deadline)
                except TransportError:
                    continue
                if t.name == "shm" and getattr(t, "arena", None) is not None:
                    out[node_id] = t.arena
            return out

    def transport_names(self) -> dict[str, str]:
        """Which transport this client uses for each node it has talked to."""
        return {n: t.name for n, t in self._transports.items()}

    def register_buffer(self, buf: Any) -> None:
        """Register ``buf`` for zero-copy transfers (RDMA memory registration); harmless on other transports."""
        mv = as_writable_view(buf, "registered buffer")
        if isinstance(mv, CudaOut):
            mv.release()
            raise InvalidArgument(self.component, "register_buffer takes host memory")
        with self._lock:
            self._registered.append(mv)
            for t in self._transports.values():
                t.register(mv)

    def _run(self, batches: dict[str, list], kind: str, deadline: float) -> dict[str, list]:
        """Start every node's transfers, then finish them all; a failed node's ops get its error. A node finished
        after another used up ``deadline`` keeps what has already arrived: a transport collects that without
        waiting even past the deadline (transport/base.py), so one silent node does not fail the others."""
        pending: dict[str, Pending | Exception] = {}
        for node_id, ops in batches.items():
            try:
                t = self._transport_for(node_id, deadline)
                pending[node_id] = t.start_read(ops, deadline) if kind == "read" else t.start_write(ops, deadline)
            except TransportUnavailable:
                raise
            except TransportError as e:
                pending[node_id] = e
        results: dict[str, list] = {}
        for node_id, p in pending.items():
            if isinstance(p, Exception):
                res = [p] * len(batches[node_id])
            else:
                res = self._transports[node_id].finish(p, deadline)
            if any(res) and any(isinstance(r, TransportError) for r in res):  # any(res): all None, the usual case
                self.count(node_failures=1)
                self._drop_transport(node_id)
            results[node_id] = res
        return results

    # ---- puts -----------------------------------------------------------------------------------------------

    def batch_put(self, keys: Sequence[Any], values: Sequence[Any], parents: Sequence[Any] | None = None
                  ) -> list[bool]:
        """True = stored by this call, False = already there (see the module docstring): ``umbp.puts.Puts``.
        ``values``: a sequence of buffers, one 2-D array (a row a page), or ``umbp.buffers.HostSpans``."""
        if type(values) is HostSpans:
            values = values.views()
        return self.puts.batch_put(keys, values, parents)

    def batch_put_ranges(self, keys: Sequence[Any], parts: Sequence[Sequence[Any]],
                         parents: Sequence[Any] | None = None) -> list[bool]:
        """Store page i as the concatenation of the buffers ``parts[i]``: ``umbp.puts.Puts.batch_put_ranges``."""
        return self.puts.batch_put_ranges(keys, parts, parents)

    def put_device(self, keys: Sequence[Any], batch: DeviceBatch, parents: Sequence[Any] | None = None
                   ) -> list[bool]:
        """``batch_put`` of pages that lie in device memory: ``umbp.puts.Puts.put_device``."""
        return self.puts.put_device(keys, batch, parents)

    def direct_device_puts(self) -> bool:
        """Whether device payloads can go straight to an arena here: ``umbp.puts.Puts.direct_device_puts``."""
        return self.puts.direct_device_puts()

    def put(self, key: Any, value: Any) -> bool:
        return self.batch_put([key], [value])[0]

    # ---- mapped pages ---------------------------------------------------------------------------------------

    def mapped(self, keys: Sequence[Any]) -> ContextManager[MappedPages]:
        """Zero-copy access to pages held by same-host nodes under one read lease: ``umbp.mapped.Mapped.mapped``."""
        return self.maps.mapped(keys)

    # ---- gets -----------------------------------------------------------------------------------------------

    def _get(self, keys: Sequence[Any], segs: list[list[tuple[int, int, Any]]] | None) -> tuple[list[int], list]:
        """Read pages. ``segs[i]`` lists (start, length, dest) of page i, dest a writable view or ``CudaOut``
        (length -1: the whole payload, which must fit dest); ``segs=None`` reads every page into a new ``bytes``.
        Returns (bytes written per key or -1 for a miss, the new objects when ``segs`` is None)."""
        kb = normalize_keys(keys)
        ns = self.namespace
        cuda: list[CudaOut] = []
        if segs is not None:
            cuda = [d for page in segs for _s, _l, d in page if type(d) is CudaOut]
        try:
            with self._lock:
                deadline = self._deadline()
                sent = time.monotonic()  # the read lease starts after this: a read done by sent + lease_s is under it
                lookup = {"ns": ns, "keys": kb}
                guess = self._spec.plan(kb) if segs is not None and not cuda else None
                if guess is None:
                    reply, early = self._meta.call(wire.Op.LOOKUP, lookup, deadline), None
                else:  # umbp/speculate.py: remembered pages are read while the LOOKUP is in flight
                    reply, early = self._read_ahead(lookup, guess, segs, deadline)
                lease, locs = reply.get("lease", 0), with_caps(reply["locs"], reply.get("caps"), 5)
                self._spec.cache.learn(kb, locs)
                try:
                    todo = locs
                    if early is not None:
                        done = self._spec.settle(guess, [e is not None for e in early], locs)
                        todo = [None if d else loc for d, loc in zip(done, locs)]
                    kernel = self._kernel_nodes(locs, deadline) if cuda else {}
                    if early is not None and all(loc is None for loc in todo):  # every page served ahead
                        batches, index, fresh, kern = {}, {}, [], []
                    else:
                        batches, index, fresh, kern = self._read_ops(todo, segs, deadline, kernel)
                    results = self._run(batches, "read", deadline) if batches else {}
                    if kern:
                        self._device.read([item for _i, item in kern])
                    late = time.monotonic() > sent + reply.get("lease_ms", wire.DEFAULT_LEASE_MS) / 1000
                finally:
                    if lease:
                        self._meta.send_noreply(wire.Op.RELEASE, {"lease": lease}, deadline)
            got = [0 if loc is not None else -1 for loc in locs]
            if early is not None:
                for i, d in enumerate(done):
                    if d:
                        got[i] = early[i]
            for i, item in kern:
                got[i] += item[-1]
            corrupt: Exception | None = None
            for node_id, res in results.items():
                ops = batches[node_id]
                if not any(res):
                    for op, i in zip(ops, index[node_id]):
                        if got[i] >= 0:
                            got[i] += op.length
                    continue
                for op, i, r in zip(ops, index[node_id], res):
                    if r is None:
                        if got[i] >= 0:
                            got[i] += op.length
                        continue
                    got[i] = -1  # any range of a page missing makes the page a miss
                    if isinstance(r, (CorruptionError, DeadlineExceeded)) or (
                            isinstance(r, RemoteError) and not isinstance(r, NotFound)):
                        corrupt = corrupt or r  # raised: a timeout is not a miss, a refusal is not a miss
                    # TransportError, NotFound: the page's node is gone or no longer has it: a miss
            if late:
                self._late_reads_missed(locs, got)
            if corrupt is not None:
                raise corrupt
            if cuda:
                todo = []
                for i, page_segs in enumerate(segs):
                    if got[i] >= 0:
                        for start, length, dest in page_segs:
                            if type(dest) is CudaOut and dest.host is not None:
                                todo.append((dest, locs[i][2] if length < 0 else length))
                flush_cuda(todo)  # every page's copy queued, one wait; the pinned buffers go back to the pool
        finally:
            for d in cuda:
                d.release()
        hits = len(kb) - got.count(-1)
        self.count(gets=hits, misses=len(kb) - hits, bytes_got=sum(got) + (len(kb) - hits))
        return got, fresh

    def count(self, **deltas: int) -> None:
        """Add to the counters ``stats()["client"]`` reports: under their own lock, since calls of several threads
        finish outside the client's I/O lock (a ``+=`` on a dict item from two threads can lose one)."""
        with self._counts:
            c = self.counters
            for k, v in deltas.items():
                c[k] += v

    _late_reads_missed = late_reads_missed  # umbp/readbatch.py
    _read_ahead = read_ahead  # umbp/pagereads.py: the per-page path's read ahead and read ops
    _read_ops = read_ops

    def _kernel_nodes(self, locs: list, deadline: float) -> dict[str, tuple[memoryview, int]]:
        """The nodes of ``locs`` whose pages CUDA outs may take through the gather kernel: reachable over shm, arena
        registered with CUDA (``DeviceCopier``); none without CUDA or CuPy, or with payload checksums on."""
        dev = self._device
        if self.config.checksum or not dev.usable():
            return {}
        out: dict[str, tuple[memoryview, int]] = {}
        for node_id in {loc[0] for loc in locs if loc is not None}:
            try:
                t = self._transport_for(node_id, deadline)
            except TransportError:
                continue
            arena = getattr(t, "arena", None) if t.name == "shm" else None
            base = dev.arena_address(node_id, arena) if arena is not None else None
            if base is not None:
                out[node_id] = (arena, base)
        return out

    def _reads_rows(self, node_id: str, deadline: float) -> bool:
        """Whether ``node_id``'s transport takes ``Rows`` outs whole (shm); False when it cannot be opened (the
        read itself then reports the node)."""
        t = self._transports.get(node_id)
        if t is None:
            try:
                t = self._transport_for(node_id, deadline)
            except TransportError:
                return False
        return t.reads_rows

    def batch_get_into(self, keys: Sequence[Any], outs: Sequence[Any]) -> list[int]:
        """Read each page's payload into ``outs[i]`` (a writable buffer at least the payload's size, a CUDA tensor,
        or a ``umbp.buffers.Rows``: the payload laid row by row at a fixed stride); or into ``umbp.buffers.HostSpans``
        (page i at its i-th raw address: no object a page). Returns the bytes written per key, or -1 for a miss."""
        if len(outs) != len(keys):
            raise InvalidArgument(self.component, f"batch_get_into: {len(keys)} keys but {len(outs)} outs")
        if not keys:
            return []
        if type(outs) is HostSpans:  # raw host pages (a host KV pool's): the array path's own form
            if len(keys) > 1 and outs.nbytes.all():
                return get_into(self, normalize_keys(keys), outs.addr, outs.nbytes)
            outs = outs.views()
        where = out_addresses(outs, len(keys)) or rows_outs(outs, len(keys))  # umbp/readbatch.py: the array path
        if where is not None:
            return get_into(self, normalize_keys(keys), *where)
        segs = [[(0, -1, as_writable_view(o, "outs", i))] for i, o in enumerate(outs)]
        return self._get(keys, segs)[0]

    def batch_get_ranges_into(self, keys: Sequence[Any], ranges: Sequence[Sequence[tuple[int, int]]],
                              outs: Sequence[Sequence[Any]]) -> list[int]:
        """Read byte ranges of pages: ``ranges[i]`` lists ``(offset, length)`` within page i's payload (a layer
        group of a page-first page), ``outs[i]`` the buffer each range lands in (one per range, at least
        ``length`` bytes). Returns the bytes written per key, or -1 for a miss (a page whose ranges did not all
        arrive counts as a miss). A range outside the page raises ``InvalidArgument``."""
        if not (len(keys) == len(ranges) == len(outs)):
            raise InvalidArgument(self.component, f"batch_get_ranges_into: {len(keys)} keys, {len(ranges)} range "
                                                  f"lists and {len(outs)} out lists")
        if not keys:
            return []
        segs = []
        for i, (rs, os_) in enumerate(zip(ranges, outs)):
            if len(rs) != len(os_):
                raise InvalidArgument(self.component, f"key {i}: {len(rs)} ranges but {len(os_)} outs")
            page = []
            for j, (r, o) in enumerate(zip(rs, os_)):
                if type(r) is tuple and len(r) == 2 and type(r[0]) is int and type(r[1]) is int:
                    start, length = r  # the common shape, without a generator per range (a layer_first page: 32)
                else:
                    try:
                        start, length = (operator.index(x) for x in r)
                    except (TypeError, ValueError):
                        raise InvalidArgument(self.component, f"ranges[{i}][{j}] = {r!r}: must be (offset, length) "
                                                              f"integers") from None
                if start < 0 or length < 0:
                    raise InvalidArgument(self.component, f"ranges[{i}][{j}] = {r!r}: offset and length must be "
                                                          f"non-negative integers")
                page.append((start, length, as_writable_view(o, f"outs[{i}][{j}]")))
            segs.append(page)
        return self._get(keys, segs)[0]

    def get_into(self, key: Any, out: Any) -> int:
        return self.batch_get_into([key], [out])[0]

    def get(self, key: Any) -> bytes | None:
        """The page's bytes (read straight into the ``bytes`` object returned: no second copy), or None."""
        sizes, fresh = self._get([key], None)
        if sizes[0] < 0:
            return None
        page = fresh[0]
        return bytes(page) if type(page) is bytearray else page

    # ---- directory only -------------------------------------------------------------------------------------

    def batch_exists(self, keys: Iterable[Any]) -> list[bool]:
        kb = normalize_keys(keys)
        if not kb:
            return []
        return self._meta.call(wire.Op.EXISTS, {"ns": self.namespace, "keys": kb}, self._deadline())["exists"]

    def exists(self, key: Any) -> bool:
        return self.batch_exists([key])[0]

    def prefix_hits(self, keys: Iterable[Any]) -> int:
        kb = normalize_keys(keys)
        if not kb:
            return 0
        return self._meta.call(wire.Op.PREFIX, {"ns": self.namespace, "keys": kb}, self._deadline())["hits"]

    def remove(self, key: Any) -> bool:
        return self.batch_remove([key])[0]

    def batch_remove(self, keys: Iterable[Any]) -> list[bool]:
        kb = normalize_keys(keys)
        self._spec.cache.forget(kb)
        return self._meta.call(wire.Op.REMOVE, {"ns": self.namespace, "keys": kb}, self._deadline())["removed"]

    def stats(self) -> dict:
        s = self._meta.call(wire.Op.STATS, {}, self._deadline())
        s["client"] = dict(self.counters, **self._spec.stats(), **keyform.memory_stats(),
                           transports=self.transport_names(), pid=os.getpid(),
                           requests=self.requests_sent(), leases_in_lookups=self._meta.piggybacked,
                           leases_in_releases=self._meta.framed)
        return s

    def requests_sent(self) -> dict[str, int]:
        """Metaserver requests this client sent, by opcode name (retries and resent parts included): how batching
        shows from outside, e.g. one ALLOC and one COMMIT per chunk of a ``batch_put``."""
        return {wire.Op(op).name: n for op, n in self._meta.sent.items()}

    # ---- admin (used by the CLI) ----------------------------------------------------------------------------

    def admin(self, op: int, meta: dict | None = None) -> Any:
        return self._meta.call(op, meta or {}, self._deadline())

    @property
    def leader(self) -> str | None:
        """The metaserver address this client talks to now (the leader it found), or None before the first call."""
        return self._meta.address
