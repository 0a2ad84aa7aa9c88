"""RDMA as a UMBP transport: the node's acceptor and the client's ``Transport``, on the verbs engine in
``transport.rdma``.

Node side (``NodeRdma``): the arena is registered once (local write, remote read, remote write). A client asks for a
queue pair with RDMA_CONNECT over the node's TCP data connection, sending its QP details; the node creates an RC
endpoint with remote access, connects it and answers with its own QP details plus the arena's address and rkey.
The endpoint lives as long as that TCP connection: when the client goes away the node closes its QP. After that the
node's CPU is not involved in any transfer.

Client side (``RdmaTransport``): one RC queue pair per node, set up over the same control connection. Reads post one
RDMA READ per object covering header + payload range, scattered into a staging slot (header) and the caller's
buffer (payload) when that buffer lies inside memory the caller registered with ``Client.register_buffer``, else a
staging slot too (then one memcpy). Writes gather header and payload parts (one per layer, say) the same way into
one RDMA WRITE. The header is not read again after the payload: the read lease keeps the slot (transport/base.py). Headers are
checked exactly as on the other transports; a failed completion fails that op (and the QP, which is re-established on
the next batch), never delivering bytes.

Staging: a registered area of ``ClientConfig.staging_bytes`` (default 64 MiB); a batch larger than it moves in waves.

Fencing: a one-sided write cannot be refused by the node, so the client refuses it. Before each wave of writes it
reads the generation floors the node publishes in its arena's superblock page (``objformat.floor_words``; the node's MR
covers the arena from offset 0) with one RDMA READ of the words up to the highest slot among the ops left (16 bytes
in a one-slot pool) into a page of its own, stages the wave meanwhile, and posts no op that ``objformat.stale_gens`` says
a deposed metaserver term granted (``base.stale_write``), nor one past its ``until_ms`` (``base.late_write``). Cost:
one small READ's round trip a wave before its writes are posted (hidden behind the staging copies where they take
longer) and a few us of numpy. What it cannot stop: a floor that rises between that READ and the write's landing (a
client stalled there, or a write retransmitted that long); the write deadline bounds that window.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

from transport import objformat, wire
from transport.base import Pending, Transport, check_payload, late_write, stale_write
from transport.rdma import ARENA_ACCESS, CLIENT_ACCESS, RcEndpoint, RdmaContext, _address_of
from transport.framed import FramedSocket
from umbp.errors import BadRequest, CorruptionError, DeadlineExceeded, ProtocolError, RemoteError, TransportError

MAX_QPS_PER_CONNECTION = 4


def _addr_of(mv: memoryview) -> int:
    """Address of a buffer's first byte (0 for an empty one)."""
    return _address_of(mv)[0] if mv.nbytes else 0


class _Unreachable(TransportError):
    """The node's TCP port could not be reached (down, restarting): not a reason to give up on RDMA for it."""


class NodeRdma:
    """The node's RDMA side: one registered arena, one endpoint per client QP."""

    def __init__(self, arena: memoryview):
        self.ctx = RdmaContext.default()
        self.mr = self.ctx.register(arena, ARENA_ACCESS)

    def info(self) -> dict:
        return {"device": self.ctx.name, "gid": self.ctx.gid, "addr": self.mr.addr, "rkey": self.mr.rkey,
                "length": self.mr.length}

    def accept(self, meta: Any, owned: list) -> dict:
        """Answer RDMA_CONNECT: ``meta`` is {"qp": client's local_info()}; ``owned`` is the connection's list of
        endpoints (closed with the connection)."""
        if not isinstance(meta, dict) or not isinstance(meta.get("qp"), dict):
            raise BadRequest("transport rdma", "RDMA_CONNECT: meta must be {'qp': {...}}")
        if len(owned) >= MAX_QPS_PER_CONNECTION:
            owned.pop(0).close()
        ep = RcEndpoint(self.ctx, remote_access=True)
        ep.connect(meta["qp"])
        owned.append(ep)
        return {"qp": ep.local_info(), "addr": self.mr.addr, "rkey": self.mr.rkey, "length": self.mr.length}

    def close(self) -> None:
        self.ctx.deregister(self.mr)


class RdmaTransport(Transport):
    name = "rdma"

    def __init__(self, node_id: str, addr: str, staging_bytes: int, deadline: float, token: str | None = None,
                 tls_ca: str = ""):
        self.node_id = node_id
        self.addr = addr
        self.token = token
        self.tls_ca = tls_ca  # the control connection (queue-pair exchange) goes over the node's TCP port
        self.component = f"transport rdma {node_id}"
        self.ctx = RdmaContext.default()
        self.staging = self.ctx.alloc(max(staging_bytes, 1 << 20), CLIENT_ACCESS)
        self.floor_mr = self.ctx.alloc(objformat.ALIGN, CLIENT_ACCESS)  # the node's floors land here (``_read_floors``)
        self.registered: list[Any] = []  # MemoryRegions of caller buffers (zero copy)
        self.ep: RcEndpoint | None = None
        self.ctl: FramedSocket | None = None
        try:
            self._connect(deadline)
        except _Unreachable:
            pass  # the node is down or not yet listening: every batch retries the connection (ops fail, no fallback)
        except BaseException:
            self.close()  # the staging area is pinned memory: never leak it when RDMA cannot be set up
            raise

    def _connect(self, deadline: float) -> None:
        if self.ctl is not None:
            self.ctl.close()
            self.ctl = None
        if self.ep is not None:
            self.ep.close()
            self.ep = None
        try:
            ctl = FramedSocket(self.addr, self.component, deadline, self.token, hello=True, tls_ca=self.tls_ca)
        except TransportError as e:
            raise _Unreachable(self.component, str(e).split(": ", 1)[-1]) from e
        try:
            self.ep = RcEndpoint(self.ctx)
            try:
                reply = ctl.request(wire.Op.RDMA_CONNECT, {"qp": self.ep.local_info()}, deadline).meta
            except RemoteError as e:  # e.g. the node has no RDMA device: a TransportError, so auto falls back
                raise TransportError(self.component, f"RDMA_CONNECT refused: {e}") from e
            except ProtocolError as e:
                raise TransportError(self.component, f"RDMA_CONNECT: {e}") from e
            if not isinstance(reply, dict) or not all(k in reply for k in ("qp", "addr", "rkey", "length")):
                raise TransportError(self.component, f"RDMA_CONNECT: bad answer {reply!r}")
            self.ep.connect(reply["qp"])
        except BaseException:
            ctl.close()
            if self.ep is not None:
                self.ep.close()
                self.ep = None
            raise
        self.ctl = ctl
        self.remote_base, self.rkey, self.remote_len = reply["addr"], reply["rkey"], reply["length"]

    def _ready(self, deadline: float) -> None:
        if self.ep is None or self.ep.broken or self.ctl is None or self.ctl.closed:
            self._connect(deadline)

    def register(self, buf: memoryview) -> None:
        if buf.readonly:
            return
        a = _addr_of(buf)
        n = buf.nbytes
        if any(r.addr == a and r.length == n and not r.closed for r in self.registered):
            return  # already registered (the client registers its buffers with every new transport)
        self.registered.append(self.ctx.register(buf, CLIENT_ACCESS))

    def _local(self, mv: memoryview):
        """(region, offset) when ``mv`` lies inside a registered caller buffer, else None. A read-only view (a
        put's payload) of registered memory counts too: a WRITE's source needs only local read access."""
        if not self.registered or not len(mv):
            return None
        a = _addr_of(mv)
        for r in self.registered:
            if r.addr <= a and a + len(mv) <= r.addr + r.length:
                return r, a - r.addr
        return None

    def _remote(self, offset: int, length: int) -> int:
        if offset < objformat.ARENA_DATA_START or offset + length > self.remote_len:
            raise CorruptionError(self.component, f"range {offset}+{length} outside the node's arena")
        return self.remote_base + offset

    # Two-phase interface: the work is posted in start_* (first wave) and reaped in finish.

    def start_read(self, ops, deadline):
        return self._start(ops, "read", deadline)

    def start_write(self, ops, deadline):
        return self._start(ops, "write", deadline)

    def _start(self, ops, kind, deadline):
        p = Pending(ops, kind, state={"next": 0, "posted": {}})
        try:
            self._ready(deadline)
            self._post_wave(p, deadline)
        except TransportError as e:
            self._drop_tmp(p.state)
            p.results = [e] * len(ops)
            p.state = None
        return p

    def _read_floors(self, ops: list, first: int) -> tuple[int, np.ndarray]:
        """Post the RDMA READ of the generation floors the node publishes in its arena's superblock page, the words
        that ``objformat.stale_gens`` looks at for the generations of ``ops[first:]`` (writes): word 0 and the slot words
        up to the highest slot's, into ``self.floor_mr`` at the page's own layout. Returns (request id, gens)."""
        gens = np.fromiter((op.gen for op in ops[first:]), np.uint64, len(ops) - first)
        top = int(gens.max() >> np.uint64(objformat.SLOT_GEN_SHIFT)) if len(gens) else 0
        n = 2 + min(top, objformat.ARENA_FLOOR_SLOTS - 1)
        at = objformat.ARENA_FLOORS_AT
        (rid,) = self.ep.post_reads([(self.floor_mr, at, 8 * n, self.remote_base + at, self.rkey)])
        return rid, gens

    def _stale(self, rid: int, gens: np.ndarray, deadline: float) -> np.ndarray:
        """Which of ``gens`` a deposed metaserver term granted, once the floors READ ``rid`` is done. Blocks until
        then; a failed READ or the deadline raises TransportError (the QP is then broken)."""
        done: dict = {}
        while rid not in done:
            done.update(self.ep.poll(deadline))
            if rid not in done and time.monotonic() >= deadline:
                self.ep.abort("deadline passed")
                raise DeadlineExceeded(self.component, "the node's generation floors unread at the deadline")
        if done[rid] is not None:
            raise TransportError(self.component, f"RDMA read of the node's generation floors failed: {done[rid]}")
        return objformat.stale_gens(objformat.floor_words(self.floor_mr.view), gens)

    def _post_wave(self, p: Pending, deadline: float) -> None:
        """Post ops from p.state['next'] on while staging space lasts (always at least one op). A wave of writes
        first posts the READ of the node's generation floors, stages its ops while that READ is under way, and posts
        none that a deposed term granted (``_stale``)."""
        st = p.state
        ops = p.ops
        used = 0
        reqs, idx = [], []
        cap = self.staging.length
        i = first = st["next"]
        floors = self._read_floors(ops, first) if p.kind == "write" else None
        while i < len(ops):
            op = ops[i]
            if p.results[i] is not None:
                i += 1
                continue
            if p.kind == "write" and op.until_ms and time.time() * 1000 > op.until_ms:
                # its allocation may have ended: posting it could land on the next page (a one-sided write the
                # node cannot refuse), so nothing is posted past the ALLOC answer's write_until_ms
                p.results[i] = late_write(self.component, op.until_ms)
                i += 1
                continue
            hslot = used
            if p.kind == "read":
                length, pieces = op.length, ([op.out[:op.length]] if op.length else [])
            else:
                length, pieces = op.nbytes, [q for q in op.parts if len(q)]
            locs = [self._local(q) for q in pieces]
            # zero copy when every piece lies in registered memory (and the header slot plus the pieces fit in
            # one scatter-gather list); otherwise the pieces go through staging with one memcpy each
            in_place = all(loc is not None for loc in locs) and len(pieces) < self.ep.max_sge
            staged = objformat.align_up(objformat.OBJ_HEADER_SIZE + length, 64)
            need = objformat.OBJ_HEADER_SIZE if in_place or staged > cap else staged
            if used and used + need > cap:
                break
            if not in_place and need == objformat.OBJ_HEADER_SIZE:
                # too big for staging: register the caller's buffers for this batch
                try:
                    if len(pieces) >= self.ep.max_sge:
                        raise TransportError(self.component, f"object of {len(pieces)} parts, {length} bytes: "
                                                             f"more parts than max_sge and larger than staging")
                    for j, q in enumerate(pieces):
                        if locs[j] is None:
                            tmp = self.ctx.register(q, 0 if q.readonly or p.kind == "write" else CLIENT_ACCESS)
                            st.setdefault("tmp", []).append(tmp)
                            locs[j] = (tmp, 0)
                except TransportError as e:
                    p.results[i] = e
                    i += 1
                    continue
                in_place = True
            used += need
            try:
                if p.kind == "read" and op.start == 0:
                    remote = self._remote(op.offset, objformat.OBJ_HEADER_SIZE + length)
                elif p.kind == "read" and not length:
                    remote = self._remote(op.offset, objformat.OBJ_HEADER_SIZE)
                elif p.kind == "read":
                    # a ranged read: header and range are not contiguous, fetch them as two requests
                    remote = self._remote(op.offset, objformat.OBJ_HEADER_SIZE)
                    reqs.append((self.staging, hslot, objformat.OBJ_HEADER_SIZE, remote, self.rkey))
                    idx.append(None)
                    remote = self._remote(op.offset + objformat.OBJ_HEADER_SIZE + op.start, length)
                else:
                    remote = self._remote(op.offset, objformat.OBJ_HEADER_SIZE + length)
            except CorruptionError as e:
                p.results[i] = e
                i += 1
                continue
            if p.kind == "write":
                self.staging.view[hslot:hslot + objformat.OBJ_HEADER_SIZE] = op.header
            ranged = p.kind == "read" and op.start and length
            segs = [] if ranged else [(self.staging, hslot, objformat.OBJ_HEADER_SIZE)]
            if in_place:
                segs.extend((loc[0], loc[1], len(q)) for loc, q in zip(locs, pieces))
            elif length:
                dslot = pos = hslot + objformat.OBJ_HEADER_SIZE
                if p.kind == "write":
                    for q in pieces:
                        self.staging.view[pos:pos + len(q)] = q
                        pos += len(q)
                segs.append((self.staging, dslot, length))
            reqs.append((segs, remote, self.rkey))
            idx.append((i, hslot, in_place))
            i += 1
        st["next"] = i
        if floors is not None:
            stale = self._stale(*floors, deadline)
            if stale.any():
                # a deposed term's grant: the new term may have placed a page in its extent (one-sided: the node
                # could not refuse it), so it is not posted (its staging space stays unused this wave)
                kept = [], []
                for req, ix in zip(reqs, idx):
                    if stale[ix[0] - first]:
                        p.results[ix[0]] = stale_write(self.component, ops[ix[0]].gen)
                    else:
                        kept[0].append(req)
                        kept[1].append(ix)
                reqs, idx = kept
        post = self.ep.post_reads if p.kind == "read" else self.ep.post_writes
        ids = post(reqs)
        st["posted"] = {rid: ix for rid, ix in zip(ids, idx)}

    def finish(self, pending, deadline):
        if pending.state is None:
            return pending.results
        st = pending.state
        ops = pending.ops
        try:
            while True:
                posted = st["posted"]
                want = set(posted)
                failed: dict[int, str] = {}
                while want:
                    done = self.ep.poll(deadline)
                    for rid, status in done:
                        if rid in want:
                            want.discard(rid)
                            if status is not None:
                                failed[rid] = status
                    if want and time.monotonic() >= deadline:
                        self.ep.abort("deadline passed")
                        raise DeadlineExceeded(self.component, f"{len(want)} transfers unfinished at the deadline")
                # a ranged read is a header-only request (ix None) followed by its payload request
                prev = None
                for rid in sorted(posted):
                    ix = posted[rid]
                    if ix is None:
                        prev = rid
                        continue
                    i, hslot, in_place = ix
                    if rid in failed or (prev is not None and prev in failed):
                        pending.results[i] = TransportError(self.component, f"RDMA {pending.kind} failed: "
                                                                            f"{failed.get(rid) or failed.get(prev)}")
                    elif pending.kind == "read":
                        pending.results[i] = self._check_read(ops[i], hslot, in_place)
                    prev = None
                self._drop_tmp(st)
                if st["next"] >= len(ops):
                    break
                if failed:
                    for j in range(st["next"], len(ops)):
                        pending.results[j] = TransportError(self.component, "queue pair failed earlier in batch")
                    break
                self._post_wave(pending, deadline)
        except TransportError as e:
            for j, r in enumerate(pending.results):
                if r is None:
                    pending.results[j] = e
        finally:
            self._drop_tmp(st)
        if self.ep.broken:
            self.ep.reset()
            if self.ctl is not None:
                self.ctl.close()
        return pending.results

    def _drop_tmp(self, st: dict) -> None:
        """Deregister the buffers registered for one wave only (objects larger than the staging area)."""
        for r in st.pop("tmp", ()):
            try:
                self.ctx.deregister(r)
            except TransportError as e:  # pinned memory stays pinned: say so, the batch itself is unaffected
                print(f"{self.component}: warning: {e}", file=sys.stderr, flush=True)

    def _check_read(self, op, hslot: int, in_place: bool) -> Exception | None:
        try:
            csum = objformat.check_object_header(self.staging.view[hslot:hslot + objformat.OBJ_HEADER_SIZE], self.component,
                                            op.khash, op.generation, op.payload_len)
        except CorruptionError as e:
            return e
        return self._finish_copy(op, hslot, csum, in_place)

    def _finish_copy(self, op, hslot: int, csum: int | None, in_place: bool) -> Exception | None:
        if op.length and not in_place:
            dslot = hslot + objformat.OBJ_HEADER_SIZE
            op.out[:op.length] = self.staging.view[dslot:dslot + op.length]
        return check_payload(op, csum, self.component)

    def close(self) -> None:
        if self.ep is not None:
            self.ep.close()
        if self.ctl is not None:
            self.ctl.close()
        for r in self.registered:
            self.ctx.deregister(r)
        self.registered.clear()
        self.ctx.deregister(self.staging)
        self.ctx.deregister(self.floor_mr)


def client_transport(node_id: str, info: dict, registered: list, config) -> RdmaTransport:
    t = RdmaTransport(node_id, info.get("addr") or f"{info['host']}:{info['port']}", config.staging_bytes,
                      time.monotonic() + min(config.timeout_s, 10), config.token, config.tls_ca)
    for buf in registered:
        t.register(buf)
    return t
