"""Correctness attack on read leases lost while a read is in flight: real etcd, metaserver and node processes.

A LOOKUP's read lease pins the pages it found until the client's RELEASE, so their extents are not reused while the
client reads them; a read done past ``lease_ms`` is dropped by the client (``late``). The node's TCP READV answer is
the arena itself (memoryviews handed to the transport, umbp/node/server.py ``readv``), checked once when the request
is read: what the socket does not take at once is sent later from the arena as it is then. So a lease must last its
whole ``lease_ms`` even when the metaserver loses track of its owner. These tests once proved it did not (a
removal and a new put into the same extent while the answer drained gave the client the old header over the new
page's bytes): when the client's metaserver connection closed, its leases were released at once (now they run out,
``ownership.drop_leases``), and a new leader held none of the last one's leases (now it evicts nothing and keeps
freed extents of the last term's pages for ``read_lease_s``: ``metaserver/table/quarantine.py``).

``Valve`` sits between the client and the node's data port (the node advertises 127.0.0.2, the valve listens there
and forwards to 127.0.0.1): once a connection has carried ``after`` bytes down it stops reading from the node (the
kernel buffers fill, the node's transport keeps the rest of the answer as arena views) until ``open()``; and the
connections accepted after ``hold_new(after)`` have what their clients send past ``after`` bytes kept until
``release_new()`` (their node side stays open meanwhile: a write delayed in the network,
tests/test_attack_late_write.py).
"""

from __future__ import annotations

import random
import socket
import threading


from cluster import eventually
from umbp.errors import PoolFull
from proxies import Proxy

PAGE = (40 << 20) - 512  # an object of 40 MiB: far more than the loopback socket buffers hold
CAPACITY = "80MiB"  # two such objects, nothing else: a page put after a removal lands in the removed one's extent
FLAGS = {"env": {"UMBP_HIGH_WATERMARK": "1.0", "UMBP_LOW_WATERMARK": "1.0", "UMBP_READ_LEASE_S": "60"}}


class Valve:
    """A TCP proxy at ``listen`` to ``upstream`` that stops reading a connection's answers past ``after`` bytes."""

    def __init__(self, listen: tuple[str, int], upstream: tuple[str, int], after: int = 1 << 20):
        self.upstream = upstream
        self.after = after
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(listen)
        self.sock.listen(16)
        self.shut = threading.Event()  # set: the valve is open (nothing held back)
        self.held = threading.Event()  # set: a connection's answer is held back
        self.socks: list[socket.socket] = []
        self.holding = False  # connections accepted now have their requests kept (``hold_new``)
        self.keep_after = 0
        self.kept: list[tuple[socket.socket, bytes]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def open(self) -> None:
        self.shut.set()

    def hold_new(self, after: int = 0) -> None:
        with self.lock:
            self.holding = True
            self.keep_after = after

    def kept_bytes(self) -> int:
        with self.lock:
            return sum(len(d) for _, d in self.kept)

    def release_new(self) -> None:
        with self.lock:
            self.holding = False
            kept, self.kept = self.kept, []
        for up, data in kept:
            up.sendall(data)

    def close(self) -> None:
        self.stop.set()
        self.shut.set()
        self.sock.close()
        for s in self.socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _accept(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                down, _ = self.sock.accept()
            except OSError:
                continue
            up = socket.create_connection(self.upstream)
            self.socks += [down, up]
            with self.lock:
                keep = self.holding
            threading.Thread(target=self._pump, args=(down, up, False, keep), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, True, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, answers: bool, keep: bool) -> None:
        moved = 0
        for _ in range(1 << 30):  # bounded: ends when either side closes
            if answers and moved >= self.after and not self.shut.is_set():
                self.held.set()
                self.shut.wait(60)
            try:
                data = src.recv(65536)
                if not data:
                    if keep:
                        return  # the node side stays open for what is kept
                    break
                with self.lock:
                    if keep and self.holding and moved + len(data) > self.keep_after:
                        cut = max(0, self.keep_after - moved)
                        self.kept.append((dst, data[cut:]))
                        data = data[:cut]
                if data:
                    dst.sendall(data)
            except OSError:
                break
            moved += len(data)
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _lease_lost_mid_read(c, a, b, lose) -> dict:
    """A reads b"old" over TCP (its answer held back by the valve); ``lose()`` ends A's lease; B removes b"old" and
    puts b"new" in its extent; the valve opens. Returns {"value": what A's get returned} or {"error": ...}."""
    got: dict = {}

    def read() -> None:
        try:
            got["value"] = a.get(b"old")
        except Exception as e:  # noqa: BLE001 - an error is an allowed outcome: reported by the caller
            got["error"] = e

    t = threading.Thread(target=read, daemon=True)
    t.start()
    eventually(c.valve.held.is_set, 30, "A's answer held back by the valve")
    lose()
    eventually(lambda: b.batch_remove([b"old"]) == [True], 30, "b\"old\" removed")
    # the only room is the extent of b"old": the put must not get it while A's lease may still be read under (it
    # fails, or evicts b"filler" and lands there)
    try:
        got["put"] = b.batch_put([b"new"], [c.pages["new"]])
    except PoolFull:
        got["put"] = None
    c.valve.open()
    t.join(60)
    assert not t.is_alive()
    if got["put"] == [True]:
        assert b.get(b"new") == c.pages["new"]
    return got


def _check(got: dict, pages: dict) -> None:
    value = got.get("value")
    if value is not None:
        same = sum(x == y for x, y in zip(value[::4096], pages["new"][::4096]))
        assert value == pages["old"], (f"A's get returned {len(value)} bytes that are not the page's: {same} of "
                                       f"{len(value[::4096])} sampled bytes are the new page's")


def _cluster(make_cluster):
    c = make_cluster(nodes=1, capacity=CAPACITY, metaserver_flags=dict(FLAGS), node_flags={"advertise": "127.0.0.2"})
    node = c.nodes[0]
    c.valve = Valve(("127.0.0.2", node.port), ("127.0.0.1", node.port))
    rng = random.Random(4703)
    c.pages = {k: rng.randbytes(PAGE) for k in ("old", "new", "filler")}
    return c


def test_a_read_whose_lease_went_with_its_metaserver_connection_never_returns_another_pages_bytes(make_cluster):
    """Client A looks a page up (its lease pins it) and reads it over TCP; its answer drains slowly (the valve).
    Meanwhile A's metaserver connection closes (the metaserver releases A's lease), client B removes the page and
    puts another of the same size, which lands in the same extent. A's read must end as that page's bytes, a miss
    or an error: never the new page's bytes under the old page's header."""
    c = _cluster(make_cluster)
    meta = Proxy(c.metaserver_addr)
    try:
        with c.client() as b, c.client(metaserver=meta.addr, transport="tcp") as a:
            assert b.batch_put([b"old", b"filler"], [c.pages["old"], c.pages["filler"]]) == [True, True]  # full

            def lose() -> None:
                meta.drop()  # A's metaserver connection closes: its lease stays until it expires
                eventually(lambda: c.ask("stats")["leases_orphaned"] == 1, 30, "A's connection closed")
                assert c.ask("stats")["pinned"] == 1

            got = _lease_lost_mid_read(c, a, b, lose)
        _check(got, c.pages)
    finally:
        c.valve.close()
        meta.close()


def test_a_read_under_the_last_leaders_lease_never_returns_another_pages_bytes(make_cluster):
    """As above, but the lease ends with its leader: the metaserver restarts (a clean stop, then a new leader's full
    load) while A's answer drains. The new leader must not hand the page's extent to another page while a lease the
    last leader granted may still be read under."""
    c = _cluster(make_cluster)
    try:
        with c.client() as b, c.client(transport="tcp") as a:
            assert b.batch_put([b"old", b"filler"], [c.pages["old"], c.pages["filler"]]) == [True, True]  # full

            def lose() -> None:
                c.metaserver.restart()
                c.wait_nodes()

            got = _lease_lost_mid_read(c, a, b, lose)
        _check(got, c.pages)
    finally:
        c.valve.close()
