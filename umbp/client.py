"""``umbp.Client``: the library an engine rank uses to put and get KV pages.

Every batch call is one metaserver round trip for placement or lookup, then the data moves straight between the
caller's memory and the nodes' arenas, with the transfers to all nodes of the batch in flight together (each
node's transport is started before any is finished), then one more metaserver message (COMMIT for puts; a
fire-and-forget RELEASE of the read lease for gets).

Contracts:
- ``put``/``batch_put``: True = stored by this call, False = the key already existed (dedup; nothing written).
  A pool with no space left raises ``PoolFull``; a node that fails mid-write raises ``TransportError``: keys whose
  bytes did not land are aborted, never committed, so no reader can see a half-written page.
- ``get_into``/``batch_get_into``: bytes written, or -1 for a miss. A page on a node that died is a miss. A slot
  whose header does not match the directory (stale, torn, corrupt) raises ``CorruptionError``; wrong bytes are never
  returned as data.
- One deadline (``timeout_s``) covers each call, retries included. Calls from several threads are serialised.
- Transport per node: ``auto`` picks shm (same host), then rdma (device on both ends), then tcp.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Iterable, Sequence

from transport import wire
from transport.base import Pending, ReadOp, Transport, WriteOp
from transport.shm import ShmTransport, boot_id
from transport.tcp import TcpTransport
from umbp.buffers import CudaOut, as_bytes_view, as_writable_view
from umbp.config import ClientConfig, resolve
from umbp.errors import (CorruptionError, InvalidArgument, NotFound, PoolFull, RemoteError, TransportError,
                         TransportUnavailable, UmbpError)
from umbp.metaclient import MetaClient

MAX_KEY_BYTES = 512
NEW, EXISTS, NO_SPACE = 0, 1, 2


def normalize_key(key: Any) -> bytes:
    if isinstance(key, str):
        key = key.encode()
    elif isinstance(key, (bytearray, memoryview)):
        key = bytes(key)
    elif not isinstance(key, bytes):
        raise InvalidArgument("client", f"key must be str or bytes, got {type(key).__name__}")
    if not key or len(key) > MAX_KEY_BYTES:
        raise InvalidArgument("client", f"key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
    return key


class Client:
    def __init__(self, metaserver: str | None = None, namespace: str | None = None, token: str | None = None,
                 transport: str | None = None, *, timeout: float | None = None, checksum: bool | None = None,
                 config: ClientConfig | None = None):
        self.config = config or resolve(ClientConfig, {"metaserver": metaserver, "namespace": namespace,
                                                       "token": token, "transport": transport,
                                                       "timeout_s": timeout, "checksum": checksum})
        self.namespace = self.config.namespace
        self.component = f"client {self.namespace}"
        self._meta = MetaClient(self.config.metaserver, "client", self.config.token)
        self._nodes: dict[str, dict] = {}
        self._transports: dict[str, Transport] = {}
        self._lock = threading.RLock()
        self._boot = boot_id()
        self._registered: list[memoryview] = []
        self.counters = {"puts": 0, "dedup": 0, "gets": 0, "misses": 0, "bytes_put": 0, "bytes_got": 0,
                         "node_failures": 0}
        self._closed = False

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
            raise UmbpError(self.component, "client is closed")
        return time.monotonic() + self.config.timeout_s

    # ---- nodes and transports -------------------------------------------------------------------------------

    def _refresh_nodes(self, deadline: float) -> None:
        nodes = self._meta.call(wire.Op.NODES, {}, deadline)["nodes"]
        self._nodes = {n["node_id"]: n for n in nodes}

    def _transport_for(self, node_id: str, deadline: float) -> Transport:
        t = self._transports.get(node_id)
        if t is not None:
            return t
        info = self._nodes.get(node_id)
        if info is None or not info.get("alive", True):
            self._refresh_nodes(deadline)
            info = self._nodes.get(node_id)
            if info is None:
                raise TransportError(self.component, f"node {node_id} is not known to the metaserver")
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
            t = TcpTransport(node_id, info.get("addr") or f"{info['host']}:{info['port']}")
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

    def transport_names(self) -> dict[str, str]:
        """Which transport this client uses for each node it has talked to."""
        return {n: t.name for n, t in self._transports.items()}

    def register_buffer(self, buf: Any) -> None:
        """Register ``buf`` for zero-copy transfers (RDMA memory registration); harmless on other transports."""
        mv = as_writable_view(buf, "registered buffer")
        if isinstance(mv, CudaOut):
            raise InvalidArgument(self.component, "register_buffer takes host memory")
        with self._lock:
            self._registered.append(mv)
            for t in self._transports.values():
                t.register(mv)

    def _run(self, batches: dict[str, list], kind: str, deadline: float) -> dict[str, list]:
        """Start every node's transfers, then finish them all; a failed node's ops get its error."""
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
            if any(isinstance(r, TransportError) for r in res):
                self.counters["node_failures"] += 1
                self._drop_transport(node_id)
            results[node_id] = res
        return results

    # ---- puts -----------------------------------------------------------------------------------------------

    def batch_put(self, keys: Sequence[Any], values: Sequence[Any], parents: Sequence[Any] | None = None
                  ) -> list[bool]:
        if len(keys) != len(values):
            raise InvalidArgument(self.component, f"batch_put: {len(keys)} keys but {len(values)} values")
        if not keys:
            return []
        kb = [normalize_key(k) for k in keys]
        views = [as_bytes_view(v, f"values[{i}]") for i, v in enumerate(values)]
        pb = None if parents is None else [None if p is None else normalize_key(p) for p in parents]
        out = [False] * len(kb)
        with self._lock:
            deadline = self._deadline()
            todo = list(range(len(kb)))
            # A commit can come back not-ok when its allocation was lost (the metaserver leader died between ALLOC
            # and COMMIT, or the allocation expired): the bytes were never visible, so allocate and write again,
            # once, within the same deadline.
            for attempt in range(2):
                stored, lost, full, err = self._put_once(kb, views, pb, todo, deadline)
                for i in stored:
                    out[i] = True
                if err is not None or full or not lost or attempt:
                    break
                todo = lost
        if err is not None:
            raise err
        if full:
            raise PoolFull(self.component, f"pool full: {len(full)} of {len(kb)} pages found no space "
                                           f"(every evictable page is leased or pending); {sum(out)} stored")
        if lost:
            raise TransportError(self.component, f"batch_put: {len(lost)} pages lost their allocation before "
                                                 f"commit twice and were not stored")
        return out

    def _put_once(self, kb: list[bytes], views: list[memoryview], parents: list | None, idxs: list[int],
                  deadline: float) -> tuple[list[int], list[int], list[int], Exception | None]:
        """ALLOC, write, COMMIT the keys at ``idxs``. Returns (stored, lost, no_space, error); keys that already
        existed are in none of the lists. Keys whose write failed are aborted and reported through ``error``."""
        ns = self.namespace
        meta: dict[str, Any] = {"ns": ns, "keys": [kb[i] for i in idxs], "sizes": [len(views[i]) for i in idxs]}
        if parents is not None:
            meta["parents"] = [parents[i] for i in idxs]
        items = self._meta.call(wire.Op.ALLOC, meta, deadline)["items"]
        batches: dict[str, list[WriteOp]] = {}
        index: dict[str, list[int]] = {}
        gens: dict[int, int] = {}
        checksum = self.config.checksum
        full = []
        for i, item in zip(idxs, items):
            if item[0] == EXISTS:
                self.counters["dedup"] += 1
                continue
            if item[0] == NO_SPACE:
                full.append(i)
                continue
            _, node_id, off, size, gen = item
            payload = views[i]
            gens[i] = gen
            header = wire.pack_object_header(wire.key_hash(ns, kb[i]), gen, size,
                                             wire.payload_checksum(payload) if checksum else None)
            batches.setdefault(node_id, []).append(WriteOp(off, header, payload))
            index.setdefault(node_id, []).append(i)
        try:
            results = self._run(batches, "write", deadline) if batches else {}
        except UmbpError:
            self._meta.call(wire.Op.ABORT, {"ns": ns, "keys": [kb[i] for i in gens],
                                            "gens": list(gens.values())}, deadline)
            raise
        ok_idx, bad_idx, first_err = [], [], None
        for node_id, res in results.items():
            for i, r in zip(index[node_id], res):
                if r is None:
                    ok_idx.append(i)
                else:
                    bad_idx.append(i)
                    first_err = first_err or r
        if bad_idx:
            self._meta.call(wire.Op.ABORT, {"ns": ns, "keys": [kb[i] for i in bad_idx],
                                            "gens": [gens[i] for i in bad_idx]}, deadline)
        committed = []
        if ok_idx:
            committed = self._meta.call(wire.Op.COMMIT, {"ns": ns, "keys": [kb[i] for i in ok_idx],
                                                         "gens": [gens[i] for i in ok_idx]}, deadline)["ok"]
        stored = [i for i, ok in zip(ok_idx, committed) if ok]
        lost = [i for i, ok in zip(ok_idx, committed) if not ok]
        self.counters["puts"] += len(stored)
        self.counters["bytes_put"] += sum(len(views[i]) for i in stored)
        err = None
        if first_err is not None:
            err = TransportError(self.component, f"batch_put: {len(bad_idx)} of {len(kb)} pages were not stored "
                                                 f"(aborted): {first_err}")
            err.__cause__ = first_err
        return stored, lost, full, err

    def put(self, key: Any, value: Any) -> bool:
        return self.batch_put([key], [value])[0]

    # ---- gets -----------------------------------------------------------------------------------------------

    def _get(self, keys: Sequence[Any], outs: Sequence[Any] | None) -> tuple[list[int], list[Any]]:
        kb = [normalize_key(k) for k in keys]
        if outs is not None and len(outs) != len(kb):
            raise InvalidArgument(self.component, f"batch_get_into: {len(kb)} keys but {len(outs)} outs")
        views = None if outs is None else [as_writable_view(o, f"outs[{i}]") for i, o in enumerate(outs)]
        ns = self.namespace
        with self._lock:
            deadline = self._deadline()
            reply = self._meta.call(wire.Op.LOOKUP, {"ns": ns, "keys": kb}, deadline)
            lease, locs = reply.get("lease", 0), reply["locs"]
            try:
                batches: dict[str, list[ReadOp]] = {}
                index: dict[str, list[int]] = {}
                dests: list[Any] = [None] * len(kb)
                for i, loc in enumerate(locs):
                    if loc is None:
                        continue
                    node_id, off, size, gen = loc
                    if views is None:
                        dests[i] = bytearray(size)
                        dest = memoryview(dests[i])
                    else:
                        dests[i] = views[i]
                        dest = views[i].view if isinstance(views[i], CudaOut) else views[i]
                        if len(dest) < size:
                            raise InvalidArgument(self.component, f"outs[{i}] holds {len(dest)} bytes but the "
                                                                  f"page has {size}")
                    batches.setdefault(node_id, []).append(
                        ReadOp(off, 0, size, wire.key_hash(ns, kb[i]), gen, size, dest))
                    index.setdefault(node_id, []).append(i)
                results = self._run(batches, "read", deadline) if batches else {}
            finally:
                if lease:
                    self._meta.send_noreply(wire.Op.RELEASE, {"lease": lease}, deadline)
        sizes = [-1] * len(kb)
        corrupt: Exception | None = None
        for node_id, res in results.items():
            for i, r in zip(index[node_id], res):
                if r is None:
                    sizes[i] = locs[i][2]
                    if isinstance(dests[i], CudaOut):
                        dests[i].flush(sizes[i])
                elif isinstance(r, CorruptionError):
                    corrupt = corrupt or r
                elif isinstance(r, (TransportError, NotFound)):
                    pass  # the page's node is gone or no longer has it: a miss
                elif isinstance(r, RemoteError):
                    corrupt = corrupt or r
        if corrupt is not None:
            raise corrupt
        hits = sum(1 for s in sizes if s >= 0)
        self.counters["gets"] += hits
        self.counters["misses"] += len(kb) - hits
        self.counters["bytes_got"] += sum(s for s in sizes if s > 0)
        return sizes, dests

    def batch_get_into(self, keys: Sequence[Any], outs: Sequence[Any]) -> list[int]:
        if not keys:
            return []
        return self._get(keys, outs)[0]

    def get_into(self, key: Any, out: Any) -> int:
        return self._get([key], [out])[0][0]

    def get(self, key: Any) -> bytes | None:
        sizes, dests = self._get([key], None)
        return bytes(dests[0]) if sizes[0] >= 0 else None

    # ---- directory only -------------------------------------------------------------------------------------

    def batch_exists(self, keys: Iterable[Any]) -> list[bool]:
        kb = [normalize_key(k) for k in keys]
        if not kb:
            return []
        return self._meta.call(wire.Op.EXISTS, {"ns": self.namespace, "keys": kb}, self._deadline())["exists"]

    def exists(self, key: Any) -> bool:
        return self.batch_exists([key])[0]

    def prefix_hits(self, keys: Iterable[Any]) -> int:
        kb = [normalize_key(k) for k in keys]
        if not kb:
            return 0
        return self._meta.call(wire.Op.PREFIX, {"ns": self.namespace, "keys": kb}, self._deadline())["hits"]

    def remove(self, key: Any) -> bool:
        return self.batch_remove([key])[0]

    def batch_remove(self, keys: Iterable[Any]) -> list[bool]:
        kb = [normalize_key(k) for k in keys]
        return self._meta.call(wire.Op.REMOVE, {"ns": self.namespace, "keys": kb}, self._deadline())["removed"]

    def stats(self) -> dict:
        s = self._meta.call(wire.Op.STATS, {}, self._deadline())
        s["client"] = dict(self.counters, transports=self.transport_names(), pid=os.getpid())
        return s

    # ---- admin (used by the CLI) ----------------------------------------------------------------------------

    def admin(self, op: int, meta: dict | None = None) -> Any:
        return self._meta.call(op, meta or {}, self._deadline())
