"""The storage node: one per host. Owns a DRAM arena in shared memory and serves ranges of it.

What it does:
- maps its arena (``umbp.node.arena``), reopening the same file when restarted with the same ``--node-id``;
- registers with the metaserver (which holds its etcd lease) and heartbeats every ``lease_ttl / 3``; when the
  metaserver connection drops it re-registers with whichever metaserver leads, bounded backoff between tries;
- serves READ and WRITE of arena ranges over TCP (uvloop), one object per frame or a batch per frame (READV,
  WRITEV: what clients send): written objects are received straight into their slots (``FrameReader`` sink, a
  scatter list for WRITEV), read answers point into the mapped arena; the answers to everything one receive
  completed go out in one ``writelines`` (one ``writev``). Per object in a batch: a range check, a capability
  check (closed pools), a generation floor check (a deposed leader's grants refused, umbp/floors.py), a header
  check on reads, no copies. A write's data is received at most WRITE_CHUNK at a time, each receive after a look at
  its deadline and term (umbp/node/writewatch.py): past either the rest of the frame is discarded and its ops answer
  UNAVAILABLE, so a write that outlives its allocation never lands on a page placed in its extent since;
- answers ARENA_INFO so same-host clients can map the arena (shm transport);
- with ``--disk``, keeps a disk tier under the arena (umbp/node/disk.py) and serves READV_DISK to clients and DEMOTE
  / PROMOTE to the metaserver (umbp/node/tiering.py: answers still go out in request order).

The node keeps no directory: the metaserver decides which ranges hold which objects. The node checks that every
range lies inside the data region and, on READ, that the object header matches the key hash and generation asked
for, so a client never receives bytes of another object even if its directory view is stale.

Security (umbp/auth.py): with a token the node authenticates every connection (HELLO, AUTH) before serving it,
registers with the metaserver using the cluster secret, and serves a WRITE or READ only with the capability the
metaserver granted for that object (offset, length, generation: one capability per node per batch, verified once
per connection and cached by its MAC, ``auth.CapCache``), so a client writes only the slots it was allocated and
reads only what it looked up. Per connection: memory follows the bytes that arrived (a WRITE lands in
the arena once its capability checks out; refused data is discarded by counting; before AUTH frames of at most 16
KiB of meta and no data), at most ``max_connections`` authenticated connections plus, in a closed pool,
``preauth_connections`` still to authenticate (``preauth_per_source`` from one address; a newcomer evicts the one
that got least far of the busiest address; each closed ``auth_timeout_s`` after the TCP accept, TLS handshake
included, unless it did: umbp/admission.py, umbp/serving.py; one turned away by the authenticated cap gets its
first request answered with UNAVAILABLE naming the cap), and a connection idle for ``idle_timeout_s`` is closed.
The process raises its open-file soft limit to the hard limit at start.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import sys
import time
import uuid
from typing import Any

from transport import objformat, slotrules, tlsserve, wire
from transport.base import stale_message
from transport.shm import boot_id
from umbp.admission import Admission
from umbp.node.arena import Arena
from umbp.node.disk import DiskArena
from umbp.node import tiering
from umbp.auth import CapCache, ServerAuth, Tokens, open_fence
from umbp.config import NodeConfig, split_host_port
from umbp.floors import SlotFloors
from umbp.node.ledger import WriteLedger
from umbp.node.readv import serve as serve_readv
from umbp.node.writewatch import WriteWatch
from umbp.errors import (BadRequest, CorruptionError, ProtocolError, RemoteError, StartupError, UmbpError,
                         Unavailable)
from umbp.node.metalink import MetaLink
from umbp.serving import FramedProtocol, raise_file_limit
from umbp.tls import server_context, tune_malloc_for_tls

_WRITE_HIGH_WATER = 64 << 20
# At most this much of a frame's data is received into the arena at a time (``DataProtocol.get_buffer``), each receive
# after a look at the write's deadline and term (``WriteWatch.look``): a write past either lands no further byte.
WRITE_CHUNK = 4 << 20
_DISK_OPS = (wire.Op.READV_DISK, wire.Op.DEMOTE, wire.Op.PROMOTE)


class NodeServer:
    def __init__(self, config: NodeConfig):
        self.config = config
        # a hostname may be unusable as an id: a bare VM's kernel default is "(none)"
        host_part = re.sub(r"[^A-Za-z0-9_.-]+", "", socket.gethostname()) or "node"
        self.node_id = config.node_id or f"{host_part}-{uuid.uuid4().hex[:6]}"
        self.component = f"node {self.node_id}"
        try:
            os.makedirs(config.arena_dir, exist_ok=True)
        except OSError as e:
            raise StartupError(self.component, f"cannot create the arena directory {config.arena_dir}: "
                                               f"{e.strerror or e}") from e
        path = os.path.join(config.arena_dir, f"umbp-{self.node_id}.arena")
        self.arena = Arena(path, config.capacity, remove_on_close=not config.node_id)
        # the disk tier (umbp/node/disk.py: the file; umbp/node/tiering.py: READV_DISK, DEMOTE, PROMOTE)
        self.disk = DiskArena(config.disk, config.disk_capacity, config.disk_threads,
                              self.component) if config.disk else None
        self.tier = tiering.DiskTier(self, self.disk) if self.disk is not None else None
        self.tokens = Tokens.load(config.token, config.tokens_file, self.component)
        self.cap_key = self.tokens.cap_key(self.node_id, self.arena.arena_id)
        self.cap_epoch = 0  # write capabilities of older epochs are refused (raised by REGISTER and by newer caps)
        # Closed pools: the newest generation written per 4 KiB block (umbp/node/ledger.py): what a write capability may
        # still write is judged from it, never from headers (bytes a client wrote). Kept next to a reopenable arena.
        self.ledger = None if self.cap_key is None else WriteLedger(
            self.arena.arena_id, objformat.ARENA_DATA_START, config.capacity,
            "" if self.arena.remove_on_close else self.arena.path + ".ledger", self.component)
        # Generation floors (umbp/floors.py): a one-slot pool's from REGISTER, a partitioned pool's per slot (kept
        # next to a reopenable arena), published in the superblock's page. A write of a lower generation was granted
        # by a deposed leader: refused, and stopped if its data is still arriving.
        self.floors = SlotFloors(self.arena, config.capacity, self.component)
        self.floors.publish()
        self.conns: set[DataProtocol] = set()
        self.admission = Admission(self.component, self.tokens.closed, config.max_connections,
                                   config.preauth_connections, config.auth_timeout_s, config.preauth_per_source)
        self.tls = None  # the server's TLS context (start): each connection runs its handshake once admitted
        self.data_start = objformat.ARENA_DATA_START
        self.data_end = self.arena.size
        self.boot_id = boot_id()
        self.host = ""
        self.port = 0
        self.stats = {"reads": 0, "writes": 0, "bytes_read": 0, "bytes_written": 0, "errors": 0}
        # (offset, key hash, generation, payload length) -> the header bytes that passed ``check_object_header``
        # there: READV compares the slot's 64 bytes with them instead of unpacking and crc-ing again (a reused
        # slot has another header, so it is checked in full). At most HEADER_MEMO (node/readv.py); cleared when full.
        self.checked: dict[tuple[int, int, int, int], bytes] = {}
        self._server: asyncio.AbstractServer | None = None
        self.rdma = None  # transport.rdma endpoint factory when a device is present

    # ---- request handling (synchronous: called from the protocol) -------------------------------------------

    def check_range(self, offset: Any, length: Any, what: str) -> None:
        if type(offset) is not int or type(length) is not int:
            raise BadRequest(self.component, f"{what}: offset and length must be integers")
        if offset < self.data_start or offset % objformat.ALIGN or length < 0 or offset + length > self.data_end:
            raise BadRequest(self.component, f"{what}: range {offset}+{length} outside the data region "
                                              f"[{self.data_start}, {self.data_end}) or unaligned")

    def write_sink(self, op: int, rid: int, meta: Any, data_len: int, caps: CapCache | None = None
                   ) -> memoryview | list:
        """Where a WRITE's data goes: its slot in the arena, once range and capability check out (a WRITEV's:
        ``writev_pieces``). Other opcodes carry no data (the reader refuses it without allocating)."""
        if op != wire.Op.WRITE:
            raise BadRequest(self.component, f"opcode {op} carries no data")
        if not isinstance(meta, list) or len(meta) not in (3, 4) or type(meta[1]) is not int or (
                len(meta) == 4 and type(meta[3]) is not int):
            raise BadRequest(self.component, "WRITE: meta must be [offset, generation, capability, until_ms?]")
        if data_len < objformat.OBJ_HEADER_SIZE:
            raise BadRequest(self.component, "WRITE: data shorter than an object header")
        self.check_range(meta[0], data_len, "WRITE")
        self.check_write(meta[0], data_len, meta[1], meta[2], caps)
        return self.arena.view[meta[0]:meta[0] + data_len]

    def check_write(self, offset: int, nbytes: int, gen: int, cap: Any, caps: CapCache | None = None) -> None:
        """Closed pools: may this write land? Its capability must be the metaserver's for a batch covering exactly
        this allocation, of the current epoch and before its deadline (``auth.CapCache.write``, through the
        connection's ``caps``: the batch's MAC is computed once), and no byte of its extent may have been written at
        this generation or a newer one (``WriteLedger``: the node's own record, never a header a client wrote): a
        capability writes its slot once, so one kept after the put, the remove or the eviction of its page cannot
        write there again, nor over any allocation placed in its extent since (the metaserver also holds young
        freed extents until the deadline). AuthError otherwise."""
        if self.cap_key is None:
            floor = self.floors.gen_floor(gen)  # a closed pool's capability names its term: checked there
            if gen < floor:
                raise Unavailable(self.component, stale_message(gen, floor), wire.Status.UNAVAILABLE)
            return
        epoch = (caps or CapCache(self.cap_key, 1)).write(cap, offset, nbytes - objformat.OBJ_HEADER_SIZE, gen,
                                                          self.cap_epoch, int(time.time() * 1000), self.component)
        slot = slotrules.epoch_slot(epoch)
        if slot is not None:
            self.floors.check(slot, epoch, offset, nbytes)
        elif epoch > self.cap_epoch:
            self.cap_epoch = epoch  # a metaserver term or registration newer than ours: older capabilities die
        self.ledger.admit(offset, nbytes, gen)

    def fence(self, token: Any) -> dict:
        """FENCE from a partitioned pool's new slot leader (``auth.fence_token``; in an open pool ``{"epoch",
        "slots"}``, no MAC: an open pool trusts its peers): the slot's floor rises to its epoch, so every capability
        and every write of a generation of the slot's earlier terms is refused from now on. Answers the floor."""
        if self.cap_key is None:
            if type(token) is not dict or type(token.get("epoch")) is not int or type(token.get("slots")) is not int:
                raise BadRequest(self.component, "FENCE: an open pool's fence is {epoch: int, slots: int}")
            epoch, slots = token["epoch"], token["slots"]
        else:
            epoch, slots = open_fence(self.cap_key, token, self.component)
        return {"floor": self.floors.fence(epoch, slots)}

    def writev_pieces(self, meta: Any, data_len: int, caps: CapCache | None = None, until: list | None = None
                      ) -> tuple[list, list]:
        """Where a WRITEV's data goes, every object checked (range, capability) before a byte lands: a scatter list
        (``wire.Sink``), each object's slot or, when refused, a count of bytes to discard; and the refused ones as
        ``[index, status, message]``. An op's capability b"" is the previous op's (a batch's capability crosses the
        wire once per frame). A malformed list refuses the whole frame (BadRequest). ``until``: a list whose first
        item is set to the frame's write deadline, the earliest op's ``until_ms`` (0: no op carries one)."""
        caps = caps or CapCache(self.cap_key)
        if type(meta) is not list or not 0 < len(meta) <= wire.MAX_VEC_OPS:
            raise BadRequest(self.component, f"WRITEV: meta must be a list of 1..{wire.MAX_VEC_OPS} "
                                             f"[offset, generation, capability, nbytes]")
        view, hs = self.arena.view, objformat.OBJ_HEADER_SIZE
        pieces, failures, total, prev, first = [], [], 0, b"", 0
        for i, m in enumerate(meta):
            if type(m) is not list or not 4 <= len(m) <= 5 or type(m[1]) is not int or type(m[3]) is not int or (
                    m[3] < hs):
                raise BadRequest(self.component, f"WRITEV: op {i} must be [offset, generation, capability, nbytes "
                                                  f">= {hs}, until_ms?]")
            if len(m) == 5:
                off, gen, cap, n, u = m
                if type(u) is not int:
                    raise BadRequest(self.component, f"WRITEV: op {i}'s until_ms must be an integer")
                if not first or u < first:
                    first = u
            else:
                off, gen, cap, n = m
            if cap == b"":
                cap = prev
            prev = cap
            total += n
            try:
                self.check_range(off, n, "WRITEV")
                self.check_write(off, n, gen, cap, caps)
            except RemoteError as e:
                failures.append([i, e.code or wire.Status.BAD_REQUEST, str(e)])
                pieces.append(n)
                continue
            pieces.append(view[off:off + n])
        if total != data_len:
            raise BadRequest(self.component, f"WRITEV: objects add up to {total} bytes, the frame carries {data_len}")
        if until is not None:
            until[0] = first
        return pieces, failures

    def arena_info(self) -> dict:
        return {"node_id": self.node_id, "arena_id": self.arena.arena_id, "arena_path": self.arena.path,
                "capacity": self.config.capacity, "boot_id": self.boot_id, "host": self.host, "port": self.port,
                "hostname": socket.gethostname(), "transports": self.transports(), "pid": os.getpid(),
                **self.disk_info()}

    def disk_info(self) -> dict:
        """The disk tier's identity (ARENA_INFO, REGISTER_NODE): a restart with the same file keeps ``disk_id``."""
        d = self.disk
        return {} if d is None else {"disk_id": d.disk_id, "disk_capacity": d.capacity, "disk_path": d.path,
                                     "disk_direct": d.direct}

    def transports(self) -> list[str]:
        return ["shm", "tcp"] + (["rdma"] if self.rdma is not None else [])

    # ---- serving ---------------------------------------------------------------------------------------------

    async def start(self) -> None:
        host, port = split_host_port(self.config.listen, self.component)
        loop = asyncio.get_running_loop()
        try:
            self.tls = server_context(self.config.tls_cert, self.config.tls_key, self.component)
            if self.tls is not None:
                tune_malloc_for_tls()
            # no ssl= here: TLS starts per connection after admission, so handshakes count as pre-auth work
            self._server = await loop.create_server(lambda: DataProtocol(self), host, port, reuse_address=True,
                                                    backlog=1024)
        except OSError as e:
            raise StartupError(self.component, f"cannot listen on {self.config.listen}: {e.strerror or e}") from e
        sockname = self._server.sockets[0].getsockname()
        self.port = sockname[1]
        if self.config.advertise:
            self.host = split_host_port(self.config.advertise, self.component, self.port)[0]
        elif host in ("0.0.0.0", "::", ""):
            self.host = socket.gethostbyname(socket.gethostname())
        else:
            self.host = host

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        if self.rdma is not None:  # deregister the arena first: a registered (exported) mapping cannot be closed
            try:
                self.rdma.close()
            except UmbpError:
                pass
            self.rdma = None
        if self.ledger is not None:
            self.ledger.close(remove=self.arena.remove_on_close)
        if self.disk is not None:
            self.disk.close()
        self.arena.close()


class DataProtocol(FramedProtocol):
    """One client connection: frames in, answers out, in request order.

    Answers to every frame completed by one receive are written together (``transport.writelines``: one
    ``writev`` for a pipelined batch, not two sends per object); READ/READV answers point into the mapped arena."""

    def __init__(self, node: NodeServer):
        self.node = node
        self.reader = wire.FrameReader(node.component, max_data=node.config.max_frame_data, sink=self.sink,
                                       buffer_data=0)
        self.auth = ServerAuth(node.tokens, node.component)
        self.caps = CapCache(node.cap_key)  # this connection's verified capabilities (one MAC per batch)
        self.transport: asyncio.Transport | None = None
        self.rdma_eps: list = []  # RDMA endpoints this client set up over this connection
        self.last_active = 0.0
        self.vec_failures: list = []  # the WRITEV whose data is arriving: its refused objects
        self.watch = WriteWatch(self.reader, node.floors, node.component)  # the write whose data is arriving
        self._out: list = []  # answers not yet handed to the transport
        self.disk: tiering.ConnState | None = None  # disk answers in flight (umbp/node/tiering.py), once any came
        self.component = node.component
        self.admission = node.admission
        self.conns = node.conns
        self.tls = node.tls

    def sink(self, op: int, rid: int, meta: Any, data_len: int) -> memoryview | list:
        self.auth.require()  # no byte of an unauthenticated peer reaches the arena
        self.watch.clear()
        if op == wire.Op.WRITEV:
            until = [0]
            pieces, self.vec_failures = self.node.writev_pieces(meta, data_len, self.caps, until)
            self.watch.start(rid, "WRITEV", until[0], [m[1] for m in meta])
            return pieces
        target = self.node.write_sink(op, rid, meta, data_len, self.caps)
        self.watch.start(rid, "WRITE", meta[3] if len(meta) == 4 else 0, [meta[1]])
        return target

    def get_buffer(self, sizehint: int) -> memoryview:
        """The reader's next buffer, at most WRITE_CHUNK, once the arriving write's deadline and term are looked at
        (``umbp/node/writewatch.py``: past either, its data goes to scratch and its answer says so)."""
        self.watch.look()
        buf = self.reader.get_buffer(sizehint)
        return buf if len(buf) <= WRITE_CHUNK else buf[:WRITE_CHUNK]

    def connection_lost(self, exc):
        if not self.release():
            return
        for ep in self.rdma_eps:
            ep.close()
        self.rdma_eps.clear()
        if self.disk is not None:
            tiering.release(self)

    def connection_made(self, transport):
        self.admit(transport)

    def _start_tls(self, raw: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        """TLS through ``transport.tlsserve``: big read answers are encrypted on worker threads, not the loop."""
        self.handshaking = True
        waiter = loop.create_future()
        tlsserve.start(self, raw, self.tls, self.admission.auth_timeout_s, waiter)
        waiter.add_done_callback(lambda w: self._handshake_ended(w, raw))

    def ready(self) -> None:
        """The transport requests arrive on (TLS: once the handshake is done) is set up for answers."""
        self.transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            except OSError:
                pass

    def flush(self) -> None:
        if self.disk is not None and (self.disk.waiting or self.disk.held):
            tiering.flush(self)  # answers behind a disk op in flight wait for it
            return
        if self._out:
            out, self._out = self._out, []
            self.transport.writelines(out)

    def _authenticated(self) -> None:
        """AUTH succeeded: move to the authenticated cap; Unavailable (answered, then closed) when it is full."""
        refused = self.authenticated_now()
        if refused:
            asyncio.get_running_loop().call_soon(self.transport.close)  # after buffer_updated writes the answer
            raise Unavailable(self.node.component, refused.split(": ", 1)[1], wire.Status.UNAVAILABLE)

    def unframeable(self, e: ProtocolError) -> None:
        self.node.stats["errors"] += 1
        out, self._out = self._out, []
        if self.disk is not None and self.disk.waiting:  # a disk answer is still coming or being sent: just close
            self.transport.close()
            return
        out.append(wire.encode_error(0, 0, wire.Status.BAD_FRAME, str(e), version=self.reader.version))
        self.transport.writelines(out)
        self.transport.close()

    def pause_writing(self):
        # A client that pipelines reads faster than it drains them: stop parsing until the socket drains.
        self.transport.pause_reading()

    def resume_writing(self):
        self.transport.resume_reading()

    def handle(self, frame: wire.Frame, err: Exception | None) -> None:
        node = self.node
        out = self._out
        if err is not None:
            node.stats["errors"] += 1
            out.append(wire.encode_error(frame.op, frame.request_id,
                                         getattr(err, "code", 0) or wire.Status.BAD_REQUEST, str(err),
                                         version=self.reader.version))
            return
        try:
            op = frame.op
            if op not in (wire.Op.HELLO, wire.Op.AUTH, wire.Op.PING, wire.Op.FENCE):  # FENCE: MAC'd by cap_key
                self.auth.require()
            if op == wire.Op.READV:
                self.readv(frame)
                return
            if op in _DISK_OPS:
                if node.tier is None:
                    raise BadRequest(node.component, f"{wire.Op(op).name}: this node has no disk tier (--disk)")
                node.tier.handle(self, frame)
                return
            if op == wire.Op.READ:
                self.read(frame)
                return
            if op == wire.Op.WRITEV:
                if not frame.data_len:  # with data, the sink validated the list before any of it landed
                    raise BadRequest(node.component, "WRITEV: no data")
                failures, self.vec_failures = self.vec_failures, []
                late = self.watch.answer(frame.request_id)
                if late is not None:  # every op not received whole before the deadline failed
                    refused = {f[0] for f in failures}
                    why = f"{node.component}: {late[1]}"
                    failures = sorted(failures + [[i, wire.Status.UNAVAILABLE, why]
                                                  for i in range(late[0], len(frame.meta)) if i not in refused])
                node.stats["writes"] += len(frame.meta) - len(failures)
                node.stats["bytes_written"] += frame.data_len  # refused objects' bytes included: they arrived
                node.stats["errors"] += len(failures)
                reply = failures or None
            elif op == wire.Op.WRITE:
                if frame.data_len < objformat.OBJ_HEADER_SIZE:  # with data, the sink validated it before it landed
                    raise BadRequest(node.component, "WRITE: data shorter than an object header")
                late = self.watch.answer(frame.request_id)
                if late is not None:
                    raise Unavailable(node.component, late[1], wire.Status.UNAVAILABLE)
                node.stats["writes"] += 1
                node.stats["bytes_written"] += frame.data_len
                reply = None
            elif op == wire.Op.ARENA_INFO:
                reply = node.arena_info()
                if not self.auth.scope.admin:  # a scoped token gets what TCP needs: the arena path and id would let a
                    # same-host process map the arena (every tenant's pages); boot id, pid, hostname point at it. As
                    # the metaserver's node maps (metaserver/handlers/admin.py NODE_INTERNAL); admin tokens, the cluster
                    # secret and open pools see everything.
                    reply.update(arena_path="", arena_id=b"", boot_id="", pid=0, hostname="", disk_path="",
                                 transports=[t for t in reply["transports"] if t != "shm"])
            elif op == wire.Op.HELLO:
                reply = self.auth.hello(frame.meta, "node", wire.VERSION)
            elif op == wire.Op.AUTH:
                reply = self.auth.auth(frame.meta)
                self._authenticated()
            elif op == wire.Op.PING:
                reply = {"server": "node", "version": wire.VERSION}
            elif op == wire.Op.FENCE:
                reply = node.fence(frame.meta)
            elif op == wire.Op.RDMA_CONNECT:
                if node.rdma is None:
                    raise BadRequest(node.component, "RDMA_CONNECT: this node has no RDMA device")
                reply = node.rdma.accept(frame.meta, self.rdma_eps)
            else:
                out.append(wire.encode_error(op, frame.request_id, wire.Status.UNKNOWN_OPCODE,
                                             f"{node.component}: unknown opcode {op}", version=self.reader.version))
                node.stats["errors"] += 1
                return
            if not frame.flags & wire.F_NO_REPLY:
                out.append(wire.encode(op, frame.request_id, reply, flags=wire.Flag.RESPONSE,
                                       version=self.reader.version))
        except RemoteError as e:
            node.stats["errors"] += 1
            out.append(wire.encode_error(frame.op, frame.request_id, e.code or wire.Status.BAD_REQUEST, str(e),
                                         version=self.reader.version))
        except UmbpError as e:
            node.stats["errors"] += 1
            out.append(wire.encode_error(frame.op, frame.request_id, wire.Status.INTERNAL, str(e),
                                         version=self.reader.version))

    def read(self, frame: wire.Frame) -> None:
        node = self.node
        meta = frame.meta
        if not isinstance(meta, list) or len(meta) != 7 or not all(type(v) is int for v in meta[:6]):
            raise BadRequest(node.component, "READ: meta must be [offset, start, length, tag, gen, payload_len, "
                                             "capability]")
        off, start, length, khash, gen, plen, cap = meta
        node.check_range(off, objformat.OBJ_HEADER_SIZE + plen, "READ")
        self.caps.read(cap, off, plen, gen, node.component)
        if start < 0 or length < 0 or start + length > plen:
            raise BadRequest(node.component, f"READ: range {start}+{length} outside the payload of {plen}")
        view = node.arena.view
        head = view[off:off + objformat.OBJ_HEADER_SIZE]
        try:
            objformat.check_object_header(head, node.component, khash, gen, plen)
        except CorruptionError as e:
            self._out.append(wire.encode_error(frame.op, frame.request_id, wire.Status.CORRUPT, str(e),
                                               version=self.reader.version))
            return
        node.stats["reads"] += 1
        node.stats["bytes_read"] += length
        src = off + objformat.OBJ_HEADER_SIZE + start
        self._out.append(wire.encode(frame.op, frame.request_id, None, flags=wire.Flag.RESPONSE,
                                     data_len=objformat.OBJ_HEADER_SIZE + length, version=self.reader.version) + bytes(head))
        if length:
            self._out.append(view[src:src + length])

    def readv(self, frame: wire.Frame) -> None:
        """A batch of reads, one answer straight from the arena: umbp/node/readv.py ``serve``."""
        serve_readv(self, frame)


async def close_idle(node: NodeServer) -> None:
    """Forever: close connections that sent nothing for ``idle_timeout_s`` (checked a few times per timeout)."""
    limit = node.config.idle_timeout_s
    while True:
        await asyncio.sleep(min(5.0, limit / 4))
        cutoff = time.monotonic() - limit
        for conn in [c for c in node.conns if c.last_active < cutoff]:
            conn.transport.close()


async def serve(config: NodeConfig) -> None:
    before, after = raise_file_limit()
    node = NodeServer(config)
    if after != before:
        print(f"{node.component}: open file limit raised from {before} to {after} (its hard limit)", file=sys.stderr,
              flush=True)
    try:  # optional: pyverbs and a device may be missing; then the node offers shm and tcp only
        from transport.rdma import rdma_available

        ok, why = rdma_available()
        if ok:
            from transport.rdma_link import NodeRdma

            node.rdma = NodeRdma(node.arena.view)
            print(f"{node.component}: rdma on ({why})", file=sys.stderr, flush=True)
        else:
            print(f"{node.component}: rdma off ({why})", file=sys.stderr, flush=True)
    except (ImportError, UmbpError) as e:
        print(f"{node.component}: rdma off ({e})", file=sys.stderr, flush=True)
    print(f"{node.component}: arena {node.arena.path} of {node.arena.size >> 20} MiB: "
          + ("on 2 MiB pages" if node.arena.on_huge_pages() else "on 4 KiB pages (same-host reads copy out of "
             "them more slowly: a tmpfs mounted with huge=within_size gives 2 MiB pages; docs/operations/kubernetes.md)"),
          file=sys.stderr, flush=True)
    if not node.tokens.closed:
        print(f"{node.component}: WARNING: no --token: this node serves anyone who connects (open pool)",
              file=sys.stderr, flush=True)
    await node.start()
    link = MetaLink(node)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    sweeper = asyncio.create_task(close_idle(node))
    endpoint = None
    task = None
    try:
        if config.metrics_listen:
            from umbp.metrics import node_endpoint_parts, start_endpoint

            endpoint = await start_endpoint(node.component, config.metrics_listen, *node_endpoint_parts(node, link))
            print(f"{node.component}: metrics on {endpoint.url}", flush=True)
        task = asyncio.create_task(link.run())
        await stop.wait()
    finally:
        sweeper.cancel()
        if task is not None:
            task.cancel()
        if endpoint is not None:
            await endpoint.close()
        await node.close()


def run(config: NodeConfig) -> None:
    import uvloop

    uvloop.run(serve(config))
