"""The metaserver's network side: an asyncio BufferedProtocol per connection, dispatch, and the process entry points.

Frames are parsed by ``transport.wire.FrameReader`` straight from the socket buffer (``get_buffer`` /
``buffer_updated`` delegate to it). Every request is answered with the same opcode and request id and the RESPONSE
flag, unless it carries NO_REPLY. Answers to requests that wait on etcd (COMMIT, REGISTER_NODE) may overtake
earlier ones on the same connection, and so may answers to requests read after a LOOKUP or an ALLOC in the same turn
of the loop (each is answered at the end of its turn with the turn's others, ``metaserver/handlers/turns.py``; a
request that does not commute with it runs it first): clients match by request id.

Error contract, in order:

- unframeable bytes (bad magic/version, oversized lengths): one BAD_FRAME or TOO_LARGE answer, then the
  connection closes (the stream can no longer be framed);
- malformed msgpack, wrong types, unknown fields, out-of-range values: BAD_REQUEST "metaserver: OP: <field ...>";
- unknown opcode: UNKNOWN_OPCODE; data-plane request to a standby: NOT_LEADER with ``leader`` (UNAVAILABLE from
  a leader still loading its directory: ask again);
- an etcd failure while serving: UNAVAILABLE; any other exception: INTERNAL with the message, logged.

Nothing a peer sends can stop the server or affect other connections. Writes are not awaited; a connection whose
peer stops reading is paused (reads stop) until its transport drains, which bounds its buffered answers. The answers
to the frames of one receive, and those that waited and resumed in one turn of the loop, go out in one socket write
(``Connection.send``/``flush``).

Security (umbp/auth.py): a closed metaserver answers everything but HELLO, AUTH and PING with AUTH until the
connection authenticated; handlers check the connection's scope (namespace rights, admin, node). Requests carry no
data, so a connection holds only its staging buffer (grown with the bytes that arrived; before AUTH frames of at
most 16 KiB of meta and no data); at most ``max_connections`` authenticated connections and, in a closed pool, at
most ``preauth_connections`` still to authenticate (``preauth_per_source`` from one address; a newcomer evicts the
one that got least far of the busiest address, so a client with a token always gets in), each of those closed
``auth_timeout_s`` after the TCP accept, TLS handshake included, unless it authenticated (umbp/admission.py,
umbp/serving.py); every connection is closed after ``idle_timeout_s`` without a byte. A connection turned away by a
cap gets its first request answered with UNAVAILABLE naming the cap, then closes. A writer's connection that closes
takes its still-PENDING allocations with it. The process raises its open-file soft limit to the hard limit at start.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import socket
import sys
import time

from metaserver.store import gcpolicy

from metaserver.handlers import kvevents
from metaserver.store.gcpolicy import GcPolicy
from metaserver.handlers.turns import Later, flush_due
from metaserver.handlers.ownership import HeldLeases
from metaserver.ha.partition import Partition
from metaserver.ha.service import LEADER_ONLY
from metaserver.ha.slots import pool_slots
from metaserver.validate import Reject, unpack_keys
from transport import wire
from transport.wire import F_NO_REPLY, F_RESPONSE, Flag, Op, Status
from umbp.admission import Admission
from umbp.auth import ServerAuth, Tokens
from umbp.config import MetaserverConfig, split_host_port
from umbp.errors import FrameTooLarge, NotLeader, ProtocolError, RemoteError, StartupError, UmbpError
from umbp.serving import FramedProtocol, raise_file_limit
from umbp.tls import server_context

log = logging.getLogger("umbp.metaserver")

MAX_REQUEST_DATA = 1 << 20  # requests carry no data; tolerate a little and discard it


def _op_name(op: int) -> str:
    try:
        return Op(op).name
    except ValueError:
        return f"0x{op:02x}"


class Connection(FramedProtocol):
    component = "metaserver"
    _out: list[bytes] | None = None  # answers queued for one socket write (``send``, ``flush``)
    in_turns = True  # a turn's LOOKUPs, and its ALLOCs, answered together (metaserver/handlers/turns.py)

    def __init__(self, ms: Partition, conns: set, admission: Admission, tls=None):
        self.ms = ms
        self.conns = conns
        self.admission = admission
        self.tls = tls  # serve TLS: the handshake runs after admission, inside the auth deadline (umbp/serving.py)
        self.reader = wire.FrameReader("metaserver", max_data=MAX_REQUEST_DATA, buffer_data=0)
        self.auth = ServerAuth(ms.tokens, "metaserver")
        self.pending: dict = {}  # (ns, key, gen) -> row: what this connection allocated and has not committed
        self.leases = HeldLeases()  # read lease ids its LOOKUPs took (released on close: metaserver/handlers/ownership.py)
        self.slot_conns: dict = {}  # a partitioned pool: slot name -> this connection's view there (partition.py)
        self.process_leases = None  # and its merged LOOKUPs' leases (metaserver/ha/multislot.py ``ProcessLeases``)
        self.last_active = time.monotonic()
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.closed = False
        self._reading_paused = False

    @property
    def version(self) -> int:
        """The wire version of the request being handled: its answer is shaped for that version."""
        return self.reader.version

    # -- asyncio callbacks -------------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.admit(transport)

    def connection_lost(self, exc) -> None:
        self.closed = True
        if not self.release():
            return
        if self.pending or self.leases or self.slot_conns or self.process_leases:
            n = self.ms.drop_pending(self)
            if n:
                log.info("metaserver: %s closed with %d allocations pending: aborted (their bytes kept out of "
                         "placement while a late write may still come)", self.peer, n)

    def _authenticated(self, op: int, rid: int) -> bool:
        """AUTH succeeded: move to the authenticated cap; False (answered and closing) when that cap is full."""
        refused = self.authenticated_now()
        if refused:
            self.send(wire.encode_error(op, rid, Status.UNAVAILABLE, refused, version=self.reader.version))
            self.flush()
            self.transport.close()
            return False
        return True

    def unframeable(self, e: ProtocolError) -> None:
        status = Status.TOO_LARGE if isinstance(e, FrameTooLarge) else Status.BAD_FRAME
        self.flush()  # the answers of the frames before it, then the error, then the close
        self.transport.write(wire.encode_error(0, 0, status, str(e), version=self.reader.version))
        log.info("metaserver: closing %s: %s", self.peer, e)
        self.transport.close()

    def pause_writing(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self._reading_paused and self.transport is not None and not self.closed:
            self._reading_paused = False
            self.transport.resume_reading()

    # -- requests ----------------------------------------------------------------------------------------------
    def send(self, data: bytes) -> None:
        """Queue an answer: written with the other answers of this receive (``handle`` opens the queue,
        ``FramedProtocol.buffer_updated`` calls ``flush``) or, for an answer that waited (a COMMIT on etcd), with
        the others of this turn of the event loop (they resume together when a combined transaction lands). One
        socket write for many: a write each was a fifth of a partitioned pool's put CPU (py-spy, 2-core VM)."""
        out = self._out
        if out is None:
            out = self._out = []
            asyncio.get_running_loop().call_soon(self.flush)
        out.append(data)

    def flush(self) -> None:
        """Write the queued answers (before a close: the transport's close only drains what it was given)."""
        out, self._out = self._out, None
        if out and not self.closed and self.transport is not None and not self.transport.is_closing():
            if len(out) == 1:
                self.transport.write(out[0])
            else:
                self.transport.writelines(out)

    def handle(self, frame: wire.Frame, err: Exception | None) -> None:
        op, rid = frame.op, frame.request_id
        if self._out is None:
            self._out = []  # the receive's answers go out together: buffer_updated calls flush after its frames
        if frame.flags & F_RESPONSE:
            return  # nobody here asked a question
        reply = not frame.flags & F_NO_REPLY
        ms = self.ms
        if err is not None:
            self._error(op, rid, reply, Status.BAD_REQUEST, getattr(err, "detail", str(err)))
            return
        handler = ms.handlers.get(op)
        if handler is None:
            if reply:
                self.send(wire.encode_error(op, rid, Status.UNKNOWN_OPCODE, f"metaserver: unknown opcode 0x{op:02x}",
                                            version=self.reader.version))
            return
        t0 = time.perf_counter()
        if ms.turns_due:
            flush_due(ms.turns_due, op, self)  # the waiting requests it does not commute with run before it
        try:
            if op not in (Op.HELLO, Op.AUTH, Op.PING):
                self.auth.require()
            if op in LEADER_ONLY and not ms.serving:
                self._not_serving(op, rid, reply)
                return
            unpack_keys(frame.meta)  # packed keys (wire.pack_keys) as PackedKeys, before any slot routing reads them
            res = handler(frame.meta, self)
        except Exception as e:  # noqa: BLE001 - every failure becomes an answer
            self._fail(op, rid, reply, e)
            ms.metrics.requests.since(op, t0)
            return
        if op == Op.AUTH and not self._authenticated(op, rid):
            return
        if type(res) is dict:
            ms.metrics.requests.since(op, t0)
            if reply:
                self.send(wire.encode(op, rid, res, flags=Flag.RESPONSE, version=self.reader.version))
        elif type(res) is Later:
            res.then = functools.partial(self._later, op, rid, reply, t0)
        else:
            ms._spawn(self._finish(op, rid, reply, res, t0))

    def _later(self, op: int, rid: int, reply: bool, t0: float, res: dict | None, err: Exception | None) -> None:
        """Answer a request that was not answered by its handler's return: a coroutine's (``_finish``), or a LOOKUP or
        an ALLOC (a multi-slot one too) given at the end of its turn (``metaserver/handlers/turns.py``)."""
        self.ms.metrics.requests.since(op, t0)
        if err is not None:
            self._fail(op, rid, reply, err)
        elif reply:
            self.send(wire.encode(op, rid, res, flags=Flag.RESPONSE, version=self.reader.version))

    async def _finish(self, op: int, rid: int, reply: bool, coro, t0: float) -> None:
        try:
            res = await coro
        except asyncio.CancelledError:
            self._error(op, rid, reply, Status.UNAVAILABLE, "shutting down")
            raise
        except Exception as e:  # noqa: BLE001
            self._later(op, rid, reply, t0, None, e)
            return
        self._later(op, rid, reply, t0, res, None)

    def _not_serving(self, op: int, rid: int, reply: bool) -> None:
        el = self.ms.leader
        if el.leader_addr == el.addr:
            # Elected but still loading, or our lease lapsed and the election has not decided yet: ask again here.
            self._error(op, rid, reply, Status.UNAVAILABLE, "taking over as leader; not serving yet")
        else:
            self._error(op, rid, reply, Status.NOT_LEADER, "this metaserver is a standby", leader=el.leader_addr)

    def _fail(self, op: int, rid: int, reply: bool, e: Exception) -> None:
        if isinstance(e, NotLeader):
            self._error(op, rid, reply, Status.NOT_LEADER, e.detail,
                        leader=e.leader or (self.ms.leader.leader_addr if not self.ms.serving else None))
        elif isinstance(e, Reject):
            self._error(op, rid, reply, e.status, e.message, **e.extra)
        elif isinstance(e, RemoteError):
            status = e.code or Status.INTERNAL
            self._error(op, rid, reply, status, e.detail)
        elif isinstance(e, UmbpError):
            self._error(op, rid, reply, Status.INTERNAL, e.detail)
        else:
            log.exception("metaserver: %s from %s failed", _op_name(op), self.peer)
            self._error(op, rid, reply, Status.INTERNAL, f"internal error: {type(e).__name__}: {e}")

    def _error(self, op: int, rid: int, reply: bool, status: int, message: str, **extra) -> None:
        self.ms.metrics.requests.error(op, status)
        if reply:
            self.send(wire.encode_error(op, rid, status, f"metaserver: {_op_name(op)}: {message}", **extra,
                                        version=self.reader.version))


async def close_idle(conns: set, limit: float) -> None:
    """Forever: close connections that sent nothing for ``limit`` seconds (checked a few times per limit)."""
    while True:
        await asyncio.sleep(min(5.0, limit / 4))
        cutoff = time.monotonic() - limit
        try:
            for c in [c for c in conns if c.last_active < cutoff]:
                log.info("metaserver: closing %s: idle for %.0fs", c.peer, limit)
                c.transport.close()
        except Exception:  # noqa: BLE001 - supervised: one bad connection must not end idle closing for good
            log.exception("metaserver: idle sweep failed; trying again")


async def serve(config: MetaserverConfig, started: asyncio.Event | None = None) -> None:
    """Serve until cancelled. Connects to etcd and joins the election first (raises Unavailable
    'metaserver: etcd at X unreachable' if etcd does not answer within the start deadline); once the first round is
    decided (won and directory loaded, or standing by) it listens on ``config.listen`` and prints
    ``metaserver: HOST:PORT`` (the bound address) once, leader or standby. Cancellation closes the
    listener and every connection and flushes queued etcd writes (bounded), then re-raises."""
    loop = asyncio.get_running_loop()
    before, after = raise_file_limit()
    if after != before:
        log.info("metaserver: open file limit raised from %d to %d (its hard limit)", before, after)
    host, port = split_host_port(config.listen, "metaserver")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise StartupError("metaserver", f"cannot listen on {config.listen}: {e.strerror or e}") from e
    bound_host, bound_port = sock.getsockname()[:2]
    addr = f"{bound_host}:{bound_port}" if ":" not in bound_host else f"[{bound_host}]:{bound_port}"
    try:
        Tokens.load(config.token, config.tokens_file, "metaserver")  # a bad tokens file is named before etcd is asked
    except BaseException:
        sock.close()
        raise
    slots, rule = await pool_slots(config)  # 1 slot (the default): the unpartitioned layout; more: partitioned
    advertise = config.advertise or addr
    try:
        ms = Partition(config, advertise, slots, rule)  # a pool is always slots: a standby leads none of them yet
    except BaseException:
        sock.close()
        if config.kv_events:
            kvevents.close(config.kv_events)
        raise
    if config.kv_events:
        pub = kvevents.publisher(config.kv_events)  # bound already: the slot servers made it
        print(f"metaserver: kv events on {pub.endpoint}, replay on {pub.replay_endpoint}", flush=True)
    if not ms.tokens.closed:
        log.warning("metaserver: no --token: OPEN pool, anyone who reaches %s may read, write, evict and register "
                    "nodes", addr)
    conns: set[Connection] = set()
    admission = Admission("metaserver", ms.tokens.closed, config.max_connections, config.preauth_connections,
                          config.auth_timeout_s, config.preauth_per_source)
    server = None
    sweeper = asyncio.create_task(close_idle(conns, config.idle_timeout_s))
    # The collector is the process's: a second serve() in one process (tests) shares the first one's policy.
    policy = (GcPolicy(freeze_s=config.gc_freeze_ms / 1000).install()
              if config.gc_freeze_ms >= 0 and gcpolicy.installed() is None else None)
    collector = asyncio.create_task(policy.run()) if policy is not None else None
    endpoint = None
    try:
        if config.metrics_listen:  # up before the election and the directory load, so /healthz answers during them
            from umbp.metrics import start_endpoint

            endpoint = await start_endpoint("metaserver", config.metrics_listen, ms.metrics.registry,
                                            ms.metrics.healthy, ms.metrics.ready)
            print(f"metaserver: metrics on {endpoint.url}", flush=True)
        await ms.start()
        tls = server_context(config.tls_cert, config.tls_key, "metaserver")
        # TLS is started by each connection once admitted (umbp/serving.py), so handshakes count as pre-auth work
        server = await loop.create_server(lambda: Connection(ms, conns, admission, tls), sock=sock, backlog=1024)
        if tls is not None:
            log.info("metaserver: TLS on (certificate %s)", config.tls_cert)
        print(f"metaserver: {addr}", flush=True)
        log.info("metaserver: serving on %s (etcd %s, prefix %s, %d slots)", addr, ms.store.addr, config.etcd_prefix,
                 slots)
        if started is not None:
            started.set()
        await asyncio.Future()
    finally:
        sweeper.cancel()
        if collector is not None:
            collector.cancel()
            policy.uninstall()
        if server is not None:
            server.close()  # no new connections; existing ones get the answers of work already in flight
        else:
            sock.close()
        await ms.close()
        if config.kv_events:
            kvevents.close(config.kv_events)
        if endpoint is not None:
            await endpoint.close()
        for c in list(conns):
            if c.transport is not None:
                c.transport.close()
        if server is not None:
            await server.wait_closed()


def run(config: MetaserverConfig) -> None:
    """Blocking entry point: install uvloop, serve until SIGINT/SIGTERM, then close cleanly.
    Raises UmbpError when the metaserver cannot start (etcd unreachable, address in use)."""
    import uvloop

    async def main() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await serve(config)
        except asyncio.CancelledError:
            pass
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())
