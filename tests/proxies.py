"""A TCP proxy between a test's client (or metaserver) and a real process (a node, a metaserver, etcd), which holds or
cuts what passes: the one proxy of the end-to-end tests (test_cut_connections: cuts mid-transfer; test_evict_reuse,
test_deadlist_crash: etcd out of reach while the metaserver runs).

``hold()``: what clients send upstream is kept here, not forwarded (``kept`` counts its bytes); ``release()`` sends
what was held and forwarding goes on; ``drop()`` closes every connection, throwing what was held away.
``arm(direction, after)``: the next byte past ``after`` in that direction ("down": server to client, "up": client to
server) ends that connection, both sides (once; ``cuts`` counts them).

Invariants: upward bytes are forwarded under the lock, so nothing sent after ``release()`` overtakes what it
flushes; a connection that ends (either side closes, a cut, ``drop``) is shut down both ways, so neither peer waits on
it. Costs: two threads a connection, a copy of each chunk (64 KiB at most) that passes."""

from __future__ import annotations

import socket
import threading


class Proxy:
    """TCP proxy to ``upstream`` ("host:port"), listening at ``addr``: see the module docstring."""

    def __init__(self, upstream: str):
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.addr = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.lock = threading.Lock()
        self.held = False
        self.kept = 0  # bytes held back
        self.pending: dict[socket.socket, list[bytes]] = {}  # upstream socket -> chunks held for it
        self.conns: list[tuple[socket.socket, socket.socket]] = []
        self.armed: tuple[str, int] | None = None
        self.cuts = 0
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self) -> None:
        with self.lock:
            self.held = True

    def release(self) -> None:
        with self.lock:
            self.held = False
            for dst, chunks in self.pending.items():
                for data in chunks:
                    try:
                        dst.sendall(data)
                    except OSError:
                        break
            self.pending.clear()

    def drop(self) -> None:
        with self.lock:
            conns, self.conns = self.conns, []
            self.pending.clear()
        for pair in conns:
            _shut(pair)

    def arm(self, direction: str, after: int) -> None:
        with self.lock:
            self.armed = (direction, after)

    def close(self) -> None:
        self.stop.set()
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
                self.conns.append((down, up))
            state = {"closed": False}
            for src, dst, direction in ((down, up, "up"), (up, down, "down")):
                threading.Thread(target=self._pump, args=(src, dst, direction, (down, up), state),
                                 daemon=True).start()

    def _pump(self, src, dst, direction: str, pair, state: dict) -> None:
        moved = 0
        try:
            for _ in range(1 << 30):  # bounded: ends when either side closes
                data = src.recv(65536)
                if not data:
                    break
                with self.lock:
                    armed = self.armed
                    cut = armed is not None and armed[0] == direction and moved + len(data) > armed[1]
                    if cut:
                        self.armed = None
                        self.cuts += 1
                if cut:
                    if armed[1] > moved:
                        dst.sendall(data[:armed[1] - moved])
                    break
                if direction == "down":
                    dst.sendall(data)
                else:
                    with self.lock:  # sent under the lock: after what release() flushes
                        if self.held:
                            self.kept += len(data)
                            self.pending.setdefault(dst, []).append(data)
                        else:
                            dst.sendall(data)
                moved += len(data)
        except OSError:
            pass
        if not state["closed"]:
            state["closed"] = True
            _shut(pair)


def _shut(pair) -> None:
    for s in pair:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()
