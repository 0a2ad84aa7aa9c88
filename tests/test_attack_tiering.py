"""Correctness attacks on the disk tier's mover (issue 47): real etcd, metaserver and node processes.

The mover (metaserver/ha/tiering.py) sends a node one DEMOTE or PROMOTE and, when the round fails for the
connection's sake (closed, reset, timed out), settles it as failed at once (metaserver/table/tiers.py ``finish``):
each row stays where it was and the destination extents go back to their allocator. But a request the mover lost
the answer of may still be in the node's hands (in flight on the network, queued behind other I/O): the node then
writes the move's copy into an extent the metaserver has meanwhile placed a new page on. A PROMOTE zeroes its DRAM
extent's header and copies the promoted page in; a DEMOTE writes its extent with a zeroed header first. Either way a
page committed there is destroyed, and with slow enough I/O (the new page's header written between the PROMOTE's
zeroing and its body copy) it reads as the new key's header over the promoted page's bytes.

``MoverTrap`` sits between everyone and the node's data port (the node advertises 127.0.0.2, the trap listens there
and forwards to 127.0.0.1): it tells the mover's connections by their HELLO (``metaserver-mover``), and once armed
holds what the mover sends next, closes the mover's side of that connection (the mover sees it close: a failed
round), and later forwards the held request to the node: a request delayed in the network past the mover's give-up.
"""

from __future__ import annotations

import random
import re
import socket
import threading
import time

from transport import wire
from umbp.errors import UmbpError
from umbp.node.tiering import readv_disk

from cluster import eventually
from test_disk_node import deadline, disk_places, header, node_sock, put, whole
from test_tiering import DISK, DRAM, PAGE, WATERMARKS, gets, offsets, put_pages, stats

MOVER = b"metaserver-mover"


class MoverTrap:
    """A TCP proxy at ``listen`` to ``upstream`` that can hold one mover request: see the module docstring."""

    def __init__(self, listen: tuple[str, int], upstream: tuple[str, int]):
        self.upstream = upstream
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(listen)
        self.sock.listen(16)
        self.lock = threading.Lock()
        self.armed = False  # the mover's next bytes are held
        self.sprung = False  # a request is held: later mover connections are closed at once
        self.held: list[bytes] = []
        self.held_up: socket.socket | None = None  # the upstream socket of the held connection
        self.answered = 0  # bytes the node sent on the held connection after its release
        self.released = False
        self.socks: list[socket.socket] = []
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self) -> None:
        with self.lock:
            self.armed = True

    def held_frame(self) -> bool:
        """Whether a whole frame is held."""
        with self.lock:
            data = b"".join(self.held)
        if len(data) < wire.HEADER_SIZE:
            return False
        _op, _f, _s, _rid, meta_len, data_len = wire.decode_header(data, "test")
        return len(data) >= wire.HEADER_SIZE + meta_len + data_len

    def release(self) -> None:
        with self.lock:
            self.released = True
            data, self.held = b"".join(self.held), []
            up = self.held_up
        up.sendall(data)

    def close(self) -> None:
        self.stop.set()
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
            threading.Thread(target=self._up, args=(down, up), daemon=True).start()
            threading.Thread(target=self._down, args=(down, up), daemon=True).start()

    def _up(self, down: socket.socket, up: socket.socket) -> None:
        mover = held = False
        for _ in range(1 << 30):  # bounded: ends when either side closes
            try:
                data = down.recv(65536)
            except OSError:
                return
            if not data:
                break
            with self.lock:
                if MOVER in data:
                    mover = True
                    if self.sprung:  # the mover's later connections: closed (its rounds fail fast)
                        _shut(down, up)
                        return
                if mover and (self.armed or held):
                    self.armed, held = False, True
                    self.sprung = True
                    self.held.append(data)
                    self.held_up = up
                    continue
            try:
                up.sendall(data)
            except OSError:
                return
        if not held:
            _shut(down, up)

    def _down(self, down: socket.socket, up: socket.socket) -> None:
        for _ in range(1 << 30):
            try:
                data = up.recv(65536)
            except OSError:
                return
            if not data:
                break
            with self.lock:
                if up is self.held_up and self.released:
                    self.answered += len(data)
                    continue
            try:
                down.sendall(data)
            except OSError:
                pass
        _shut(down, up)

    def cut_mover(self) -> None:
        """Close the mover's side of the held connection; the node's side stays open."""
        with self.lock:
            up = self.held_up
        for d, u in zip(self.socks[::2], self.socks[1::2]):
            if u is up:
                try:
                    d.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                d.close()


def _shut(*socks: socket.socket) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()


def test_a_promote_the_mover_gave_up_on_never_lands_on_a_page_committed_after(make_cluster, tmp_path):
    """A PROMOTE held in the network while the mover's connection closes: the mover fails the round and frees its
    DRAM destination, a new page is put there, then the PROMOTE reaches the node. Every page committed after the
    give-up must still read back byte-exact."""
    c = make_cluster(nodes=1, capacity=DRAM, metaserver_flags=dict(WATERMARKS),
                     node_flags={"disk": str(tmp_path / "node0.disk"), "disk_capacity": DISK,
                                 "advertise": "127.0.0.2"})
    node = c.nodes[0]
    assert node.host == "127.0.0.2"
    trap = MoverTrap(("127.0.0.2", node.port), ("127.0.0.1", node.port))
    try:
        rng = random.Random(4701)
        with c.client() as cl:
            pages = put_pages(c, cl, rng, 6, "a")  # over the high watermark: the oldest are demoted
            eventually(lambda: stats(c)["demotions"] >= 2, 30, "demotions")
            keys = list(pages)
            demoted = [k for k, o in zip(keys, offsets(c, keys)) if o & wire.DISK_BIT]
            assert demoted
            assert all(cl.batch_remove([k for k in keys if k not in demoted]))  # under the low watermark
            eventually(lambda: stats(c)["used_bytes"] < 0.3 * (8 << 20), 30, "DRAM below the low watermark")
            trap.arm()
            assert gets(cl, demoted) == [pages[k] for k in demoted]  # read from disk: promotion candidates
            eventually(trap.held_frame, 30, "the mover's PROMOTE held in the network")
            trap.cut_mover()
            gave_up = re.compile(r"promotion of \d+ pages on node \S+ failed")
            eventually(lambda: gave_up.search(c.metaserver.stderr_text()), 30, "the mover giving the promotion up")
            # DRAM filled to the last extent (no eviction): a freed destination takes one of these pages
            fresh: dict[bytes, bytes] = {}
            for i in range(16):
                s = stats(c)
                if s["used_bytes"] + PAGE > s["capacity_bytes"]:
                    break
                k, v = f"fresh-{i}".encode(), rng.randbytes(PAGE - 512)
                assert cl.batch_put([k], [v]) == [True]
                fresh[k] = v
            assert stats(c)["evictions"] == 0
            trap.release()  # the PROMOTE reaches the node now
            eventually(lambda: trap.answered > 0, 30, "the node's answer to the late PROMOTE")
            bad = []
            for k, v in fresh.items():
                try:
                    got = cl.get(k)
                except UmbpError as e:
                    bad.append((k, repr(e)))
                    continue
                if got != v:
                    bad.append((k, None if got is None else len(got)))
            assert not bad, f"pages committed after the mover's give-up, destroyed by its late PROMOTE: {bad}"
    finally:
        trap.close()


def _promote_held(c, trap: MoverTrap, cl, rng: random.Random) -> None:
    """Pages demoted, then read from disk with DRAM under the low watermark: the mover's PROMOTE of them is held."""
    pages = put_pages(c, cl, rng, 6, "a")  # over the high watermark: the oldest are demoted
    eventually(lambda: stats(c)["demotions"] >= 2, 30, "demotions")
    keys = list(pages)
    demoted = [k for k, o in zip(keys, offsets(c, keys)) if o & wire.DISK_BIT]
    assert demoted
    assert all(cl.batch_remove([k for k in keys if k not in demoted]))  # under the low watermark
    eventually(lambda: stats(c)["used_bytes"] < 0.3 * (8 << 20), 30, "DRAM below the low watermark")
    trap.arm()
    assert gets(cl, demoted) == [pages[k] for k in demoted]  # read from disk: promotion candidates
    eventually(trap.held_frame, 30, "the mover's PROMOTE held in the network")


def _fill_release_check(c, trap: MoverTrap, cl, rng: random.Random) -> None:
    """DRAM filled to its last free extent with fresh pages (no eviction), the held PROMOTE released to the node,
    then every fresh page read back: byte-exact or the failure names it."""
    fresh: dict[bytes, bytes] = {}
    for i in range(16):
        s = stats(c)
        if s["used_bytes"] + PAGE > s["capacity_bytes"]:
            break
        k, v = f"fresh-{i}".encode(), rng.randbytes(PAGE - 512)
        assert cl.batch_put([k], [v]) == [True]
        fresh[k] = v
    assert fresh and stats(c)["evictions"] == 0
    trap.release()  # the PROMOTE reaches the node now
    eventually(lambda: trap.answered > 0, 30, "the node's answer to the late PROMOTE")
    bad = []
    for k, v in fresh.items():
        try:
            got = cl.get(k)
        except UmbpError as e:
            bad.append((k, repr(e)))
            continue
        if got != v:
            bad.append((k, None if got is None else len(got)))
    assert not bad, f"pages committed after the PROMOTE was sent, destroyed by it: {bad}"


def test_a_promote_in_flight_at_a_clean_metaserver_stop_never_lands_on_the_next_leaders_pages(make_cluster,
                                                                                               tmp_path):
    """A PROMOTE held in the network while its metaserver stops cleanly (SIGTERM: it hands its open allocations on
    to the next leader, persistence-and-fencing.md 'Handing on open allocations'). The next leader must keep the
    PROMOTE's destination out of placement as it keeps a writer's open allocation: every page it commits reads
    back byte-exact after the PROMOTE reaches the node."""
    c = make_cluster(nodes=1, capacity=DRAM, metaserver_flags=dict(WATERMARKS),
                     node_flags={"disk": str(tmp_path / "node0.disk"), "disk_capacity": DISK,
                                 "advertise": "127.0.0.2"})
    node = c.nodes[0]
    trap = MoverTrap(("127.0.0.2", node.port), ("127.0.0.1", node.port))
    try:
        rng = random.Random(4702)
        with c.client() as cl:
            _promote_held(c, trap, cl, rng)
        c.metaserver.restart()  # SIGTERM: a clean stop, then a new leader's full load
        c.wait_nodes()
        with c.client() as cl:
            _fill_release_check(c, trap, cl, rng)
    finally:
        trap.close()


def test_a_move_that_reaches_the_node_past_its_deadline_copies_nothing(make_cluster, tmp_path):
    """The node side of the same guard: a DEMOTE or PROMOTE whose ``until_ms`` has passed when it arrives (its
    mover gave it up and may have placed other pages in its extents) fails every row and writes nothing: the disk
    extent keeps what it held, the DRAM extent's page still reads back."""
    c = make_cluster(nodes=1, capacity="64MiB", node_flags={"disk": str(tmp_path / "node0.disk"),
                                                            "disk_capacity": "128MiB"})
    rng = random.Random(4705)
    objs = put(c, rng, [5000, 1 << 20])
    disks = disk_places(objs)
    rows = wire.pack_tier_rows([o["tag"] for o in objs], [o["gen"] for o in objs], [o["plen"] for o in objs],
                               [o["dram"] for o in objs], disks, 0)
    past = int(time.time() * 1000) - 1
    with node_sock(c) as s:
        frame = s.request(wire.Op.DEMOTE, {"rows": rows, "until_ms": past}, deadline())
        failed = wire.vec_failures(frame.meta, len(objs), "test")
        assert sorted(failed) == [0, 1] and all("deadline" in str(e) for e in failed.values())
        got = readv_disk(s, [whole(o, wire.DISK_BIT | d) for o, d in zip(objs, disks)], deadline())
        assert all(isinstance(g, UmbpError) for g in got)  # nothing was copied
        frame = s.request(wire.Op.DEMOTE, {"rows": rows, "until_ms": past + 60_000}, deadline())
        assert wire.vec_failures(frame.meta, len(objs), "test") == {}  # in time: copied
        assert readv_disk(s, [whole(o, wire.DISK_BIT | d) for o, d in zip(objs, disks)], deadline()) == \
            [header(o) + o["payload"] for o in objs]
        # a late PROMOTE onto the pages' own DRAM extents: it would zero their headers and write there
        frame = s.request(wire.Op.PROMOTE, {"rows": rows, "until_ms": past}, deadline())
        assert sorted(wire.vec_failures(frame.meta, len(objs), "test")) == [0, 1]
    with c.client() as cl:
        assert [cl.get(o["key"]) for o in objs] == [o["payload"] for o in objs]
