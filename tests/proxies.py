"""A TCP proxy between a test's clients (or metaserver) and a real process (a node, a metaserver, etcd), which holds,
delays or cuts what passes: the one proxy of the end-to-end tests (test_cut_connections: cuts mid-transfer;
test_evict_reuse, test_deadlist_crash: etcd out of reach while the metaserver runs; test_attack_leases: a READV answer
that drains slowly; test_attack_late_write: a WRITE delayed in the network; test_attack_tiering: a mover request
delayed past the mover's give-up).

Upward ("up": client to server), what is kept is sent by ``release()``, in order, before anything sent after it:
- ``hold()``: what every client sends from now on is kept (``kept`` counts the bytes ever kept).
- ``hold_new(after)``: connections accepted from now on keep what their clients send past their first ``after``
  bytes; their server side stays open when the client goes (a write delayed in the network).
- ``catch()`` (with ``tag``): the next bytes a connection whose client has sent ``tag`` sends are kept, with all it
  sends after; from then on a connection that sends ``tag`` is closed at once (its rounds fail fast). ``cut_caught()``
  closes the caught connection's client side (the client sees a failed round), its server side stays open;
  ``release()`` then sends its request, and what the server answers is counted in ``answered``, not forwarded.
Downward ("down": server to client), ``pause(after)``: a connection that has carried ``after`` bytes down is not read
from its server (the kernel buffers fill, the server's sender waits) until ``resume()``; ``paused`` is set once one
waits. Either way, ``arm(direction, after)``: the next byte past ``after`` in that direction ends that connection,
both sides (once; ``cuts`` counts them). ``drop()`` closes every connection, throwing what was kept away.

Invariants: upward bytes are forwarded under ``flush_lock``, which ``release()`` holds while it sends what was kept,
so nothing overtakes what it flushes; ``lock`` (the proxy's state) is never held over a send. A connection that ends
is shut down both ways, so neither peer waits on it, except the server side of one that keeps bytes (``hold_new``,
``catch``) when its client goes. Costs: two threads a connection, a copy of each chunk (64 KiB at most) that passes;
one upward send at a time across all connections."""

from __future__ import annotations

import socket
import threading


class _Conn:
    """One accepted connection: the client's socket (``down``), the server's (``up``) and what is kept for it."""

    def __init__(self, down: socket.socket, up: socket.socket, keep_after: int | None):
        self.down, self.up = down, up
        self.keep_after = keep_after  # hold_new's: what its client sends past this many bytes is kept
        self.tagged = False  # its client sent the proxy's tag
        self.caught = False  # all its client sends is kept (catch)
        self.released = False  # caught and released: its answers are counted, not forwarded
        self.pending: list[bytes] = []
        self.closed = False


class Proxy:
    """TCP proxy to ``upstream`` ("host:port"), listening at ``listen`` (``addr``): see the module docstring."""

    def __init__(self, upstream: str, listen: tuple[str, int] = ("127.0.0.1", 0), tag: bytes | None = None):
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.tag = tag
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(listen)
        self.sock.listen(16)
        self.addr = "%s:%d" % self.sock.getsockname()[:2]
        self.lock = threading.Lock()
        self.flush_lock = threading.Lock()
        self.conns: list[_Conn] = []
        self.holding = False
        self.new_after: int | None = None  # hold_new's, while it holds
        self.catching = False
        self.caught: _Conn | None = None
        self.kept = 0  # bytes ever kept
        self.answered = 0  # bytes the server answered on the caught connection after its release
        self.armed: tuple[str, int] | None = None
        self.cuts = 0
        self.pause_after: int | None = None
        self.resumed = threading.Event()
        self.paused = threading.Event()
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self) -> None:
        with self.lock:
            self.holding = True

    def hold_new(self, after: int = 0) -> None:
        with self.lock:
            self.new_after = after

    def catch(self) -> None:
        with self.lock:
            self.catching = True

    def release(self) -> None:
        with self.flush_lock:
            with self.lock:
                self.holding, self.new_after = False, None
                flush = [(c, b"".join(c.pending)) for c in self.conns if c.pending]
                for c, _ in flush:
                    c.pending = []
                    c.released = c.caught
            for c, data in flush:
                try:
                    c.up.sendall(data)
                except OSError:
                    pass

    def pending_bytes(self) -> bytes:
        """What is kept now, all connections'."""
        with self.lock:
            return b"".join(b"".join(c.pending) for c in self.conns)

    def cut_caught(self) -> None:
        with self.lock:
            conn = self.caught
        _shut(conn.down)

    def pause(self, after: int) -> None:
        self.resumed.clear()
        self.pause_after = after

    def resume(self) -> None:
        self.resumed.set()

    def arm(self, direction: str, after: int) -> None:
        with self.lock:
            self.armed = (direction, after)

    def drop(self) -> None:
        with self.lock:
            conns, self.conns = self.conns, []
            for c in conns:
                c.pending = []
        for c in conns:
            self._end(c)

    def close(self) -> None:
        self.stop.set()
        self.resumed.set()
        self.sock.close()
        self.drop()

    def _accept(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                down, _ = self.sock.accept()
            except OSError:
                continue
            up = socket.create_connection(self.upstream)
            with self.lock:
                conn = _Conn(down, up, self.new_after)
                self.conns.append(conn)
            threading.Thread(target=self._up, args=(conn,), daemon=True).start()
            threading.Thread(target=self._down, args=(conn,), daemon=True).start()

    def _cut(self, direction: str, moved: int, n: int) -> int | None:
        """Under ``lock``: how many of the next ``n`` bytes pass before an armed cut ends the connection, or None."""
        armed = self.armed
        if armed is None or armed[0] != direction or moved + n <= armed[1]:
            return None
        self.armed = None
        self.cuts += 1
        return max(0, armed[1] - moved)

    def _keep(self, conn: _Conn, data: bytes) -> None:
        if data:
            conn.pending.append(data)
            self.kept += len(data)

    def _up(self, conn: _Conn) -> None:
        moved, late = 0, False  # bytes the client sent; whether it was closed for sending the tag late
        for _ in range(1 << 30):  # bounded: ends when either side closes
            try:
                data = conn.down.recv(65536)
            except OSError:
                data = b""
            if not data:
                break
            n, cut = len(data), None
            with self.flush_lock:  # forwarded under it: after what release() flushes
                with self.lock:
                    if self.tag is not None and self.tag in data:
                        conn.tagged = True
                        late = self.caught is not None and self.caught is not conn
                    else:
                        late = False
                    if late:
                        data = b""
                    elif conn.tagged and (self.catching or conn.caught):
                        self.catching, conn.caught, self.caught = False, True, conn
                        self._keep(conn, data)
                        data = b""
                    elif (cut := self._cut("up", moved, n)) is not None:
                        data = data[:cut]
                    elif self.holding:
                        self._keep(conn, data)
                        data = b""
                    elif self.new_after is not None and conn.keep_after is not None:
                        at = max(0, conn.keep_after - moved)
                        self._keep(conn, data[at:])
                        data = data[:at]
                if late:  # a tagged connection after the catch: closed at once (its rounds fail fast)
                    break
                try:
                    if data:
                        conn.up.sendall(data)
                except OSError:
                    break
            if cut is not None:
                break
            moved += n
        if not late and (conn.keep_after is not None or conn.caught):
            return  # the server side stays open for what is kept
        self._end(conn)

    def _down(self, conn: _Conn) -> None:
        moved = 0  # bytes the server sent
        for _ in range(1 << 30):  # bounded: ends when either side closes
            if self.pause_after is not None and moved >= self.pause_after and not self.resumed.is_set():
                self.paused.set()
                self.resumed.wait(60)
            try:
                data = conn.up.recv(65536)
            except OSError:
                break
            if not data:
                break
            n = len(data)
            with self.lock:
                cut = self._cut("down", moved, n)
                if conn.released:
                    self.answered += len(data)
                    data = b""
            try:
                if data:
                    conn.down.sendall(data if cut is None else data[:cut])
            except OSError:
                break
            if cut is not None:
                break
            moved += n
        self._end(conn)

    def _end(self, conn: _Conn) -> None:
        with self.lock:
            if conn.closed:
                return
            conn.closed = True
        _shut(conn.down, conn.up)


def _shut(*socks: socket.socket) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()
