"""TCP receives past the deadline (transport/framed.py, transport/tcp.py): what has already arrived is still collected, without waiting;
what is not all there raises DeadlineExceeded naming the component and closes the connection.

The case this covers: a batch read from two nodes, the first silent until the deadline, the second's answer long in
the socket buffer. Finishing the second after the deadline must deliver its bytes, not throw them away. Each test
talks to a scripted peer on loopback that writes exactly the bytes it is given (whole or cut short). No clock is
asserted on: a receive that waited past its deadline would wait for a peer that never sends again, and the test
would not finish (pytest's timeout fails it); the assertions are on bytes, answers and the connection's state."""

from __future__ import annotations

import os
import select
import shutil
import socket
import ssl
import subprocess
import threading
import time

import pytest

from transport import objformat, wire
from transport.base import ReadOp
from transport.framed import FramedSocket
from transport.tcp import TcpTransport
from umbp.errors import DeadlineExceeded
from umbp.tls import server_context

COMP = "transport tcp t1"


class Peer:
    """One accepted connection on loopback (TLS when given a server context); ``write`` sends raw bytes."""

    def __init__(self, ctx: ssl.SSLContext | None = None):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.addr = "127.0.0.1:%d" % self.listener.getsockname()[1]
        self.conn: socket.socket | None = None
        self._accepted = threading.Thread(target=self._accept, args=(ctx,), daemon=True)
        self._accepted.start()

    def _accept(self, ctx):
        conn, _ = self.listener.accept()
        self.conn = ctx.wrap_socket(conn, server_side=True) if ctx is not None else conn

    def connect(self, tls_ca: str = "") -> FramedSocket:
        fs = FramedSocket(self.addr, COMP, time.monotonic() + 5, tls_ca=tls_ca)
        self._accepted.join(5)
        return fs

    def write(self, data: bytes) -> None:
        self.conn.sendall(data)

    def read_request(self) -> wire.Frame:
        reader = wire.FrameReader("peer")
        while True:
            buf = reader.get_buffer()
            n = self.conn.recv_into(buf)
            assert n, "client closed before its request was whole"
            frames = reader.buffer_updated(n)
            if frames:
                return frames[0][0]

    def close(self):
        for s in (self.conn, self.listener):
            if s is not None:
                s.close()


def settle(fs: FramedSocket, nbytes: int) -> None:
    """Wait until ``nbytes`` have arrived at the client (peeked, not read): the answer is in the socket buffer. TLS
    records cannot be peeked: there it waits until the socket is readable, then a moment for the rest."""
    end = time.monotonic() + 5
    while time.monotonic() < end:
        if fs.tls:
            if select.select([fs.sock], [], [], 0)[0]:
                time.sleep(0.05)
                return
        else:
            try:  # MSG_DONTWAIT: the connection's own blocking mode is left as it is
                if len(fs.sock.recv(nbytes, socket.MSG_PEEK | socket.MSG_DONTWAIT)) >= nbytes:
                    return
            except BlockingIOError:
                pass
        time.sleep(0.005)
    raise AssertionError(f"{nbytes} bytes did not arrive")


def late() -> float:
    return time.monotonic() - 1.0  # a deadline that passed a second ago


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A CA and a certificate for 127.0.0.1 it signed (EC keys: quick to make)."""
    if shutil.which("openssl") is None:
        pytest.skip("NO `openssl` COMMAND on this machine: the TLS half of these receive tests cannot make its "
                    "certificates")
    d = tmp_path_factory.mktemp("tls")

    def run(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=umbp test ca")
    run("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (d / "ext.cnf").write_text("subjectAltName = IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "server.pem", "-days", "2", "-extfile", "ext.cnf")
    return {"ca": str(d / "ca.pem"), "ctx": server_context(str(d / "server.pem"), str(d / "server.key"), "test")}


@pytest.fixture(params=["plain", "tls"])
def peer(request):
    if request.param == "tls":
        certs = request.getfixturevalue("certs")
        p = Peer(certs["ctx"])
        p.tls_ca = certs["ca"]
    else:
        p = Peer()
        p.tls_ca = ""
    yield p
    p.close()


def test_an_arrived_answer_is_received_after_the_deadline(peer):
    fs = peer.connect(peer.tls_ca)
    answer = wire.encode(wire.Op.STATS, 7, {"n": 42}, flags=wire.Flag.RESPONSE)
    peer.write(answer)
    settle(fs, len(answer))
    frame = fs.recv_frame(late())
    assert (frame.request_id, frame.meta, frame.status) == (7, {"n": 42}, wire.Status.OK)
    assert not fs.closed  # a whole frame was read: the stream is still framed
    fs.close()


@pytest.mark.parametrize("cut", [10, wire.HEADER_SIZE + 3])  # inside the header, inside the meta
def test_a_half_arrived_answer_after_the_deadline_raises_and_closes(peer, cut):
    fs = peer.connect(peer.tls_ca)
    answer = wire.encode(wire.Op.STATS, 7, {"n": 42, "pad": "x" * 100}, flags=wire.Flag.RESPONSE)
    peer.write(answer[:cut])
    settle(fs, cut)
    with pytest.raises(DeadlineExceeded) as e:
        fs.recv_frame(late())
    assert str(e.value).startswith(COMP) and "deadline exceeded" in str(e.value)
    assert fs.closed  # half a frame was consumed: the connection cannot be resynchronised


def test_nothing_arrived_after_the_deadline_raises_at_once(peer):
    fs = peer.connect(peer.tls_ca)
    with pytest.raises(DeadlineExceeded):
        fs.recv_frame(late())
    assert fs.closed


# ---- TcpTransport: a READV answer finished after the deadline ----------------------------------------------------

def objects(n: int, size: int):
    """``n`` objects: (read op into a fresh out, the object's header + payload as the node sends it)."""
    out = []
    for i in range(n):
        payload = os.urandom(size)
        kh = objformat.key_hash("ns", b"k%d" % i)
        op = ReadOp(4096 * (i + 1), 0, size, kh, i + 1, size, memoryview(bytearray(size)))
        out.append((op, objformat.pack_object_header(kh, i + 1, size) + payload))
    return out


def started_read(peer, objs):
    t = TcpTransport("t1", peer.addr)
    t._conn = peer.connect()  # no HELLO: the scripted peer is an open node that answers READV only
    p = t.start_read([op for op, _ in objs], time.monotonic() + 5)
    req = peer.read_request()
    assert req.op == wire.Op.READV and len(req.meta) == len(objs)
    data = b"".join(body for _, body in objs)
    head = wire.encode(wire.Op.READV, req.request_id, None, data_len=len(data), flags=wire.Flag.RESPONSE)
    return t, p, head + data


def test_tcp_batch_answered_before_the_deadline_is_delivered_after_it():
    """The answer (both objects) sits in the socket buffer; ``finish`` is called a second late, as it is for the
    second node of a batch whose first node was silent: every byte is delivered."""
    peer = Peer()
    objs = objects(2, 20_000)
    t, p, answer = started_read(peer, objs)
    peer.write(answer)
    settle(t._conn, len(answer))
    assert t.finish(p, late()) == [None, None]
    assert [bytes(op.out) for op, _ in objs] == [body[objformat.OBJ_HEADER_SIZE:] for _, body in objs]
    assert not t._conn.closed
    t.close()
    peer.close()


def test_tcp_batch_cut_short_fails_the_object_not_all_there():
    """Object 0 arrived whole, object 1 in part: object 0 is delivered (header checked, as after any break), object
    1 fails with DeadlineExceeded naming the transport, never with its partial bytes as data."""
    peer = Peer()
    objs = objects(2, 20_000)
    t, p, answer = started_read(peer, objs)
    cut = len(answer) - 5_000
    peer.write(answer[:cut])
    settle(t._conn, cut)
    res = t.finish(p, late())
    assert res[0] is None and bytes(objs[0][0].out) == objs[0][1][objformat.OBJ_HEADER_SIZE:]
    assert isinstance(res[1], DeadlineExceeded) and str(res[1]).startswith(COMP)
    assert t._conn.closed
    t.close()
    peer.close()


# ---- plain sockets: blocking receives under a socket timeout, MSG_WAITALL ----------------------------------------

class CountingSocket:
    """The connection's socket with its receive calls counted (everything else passes through)."""

    def __init__(self, sock):
        self._sock = sock
        self.calls = {"recv_into": 0, "recvmsg_into": 0}

    def __getattr__(self, name):
        attr = getattr(self._sock, name)
        if name not in self.calls:
            return attr

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return attr(*args, **kwargs)
        return counted


def test_a_batch_arriving_in_pieces_is_received_with_one_syscall():
    """A READV answer whose data comes in two pieces, the second some time after the first, goes into the header
    slots and outs with one ``recvmsg_into`` (MSG_WAITALL), not one per piece that happened to be there: the
    Python per socket buffer is what a 64-page batch of small pages paid for (12 calls a batch on loopback)."""
    peer = Peer()
    objs = objects(8, 20_000)
    t, p, answer = started_read(peer, objs)
    counting = t._conn.sock = CountingSocket(t._conn.sock)
    half = wire.HEADER_SIZE + len(answer) // 2
    peer.write(answer[:half])
    settle(t._conn, half)  # the first piece is there when the receive starts; the second is not
    later = threading.Timer(0.2, peer.write, (answer[half:],))
    later.start()
    try:
        assert t.finish(p, time.monotonic() + 10) == [None] * 8
    finally:
        later.join()
    assert [bytes(op.out) for op, _ in objs] == [body[objformat.OBJ_HEADER_SIZE:] for _, body in objs]
    assert counting.calls == {"recv_into": 1, "recvmsg_into": 1}  # the frame header, then all the data
    assert not t._conn.closed
    t.close()
    peer.close()


def test_a_silent_peer_fails_the_receive_at_its_deadline():
    """A blocking receive waits no longer than its deadline (the socket timeout is half the time left, set again
    when it runs out early): a peer that never answers gives DeadlineExceeded, and the connection is closed."""
    peer = Peer()
    fs = peer.connect()
    with pytest.raises(DeadlineExceeded) as e:
        fs.recv_frame(time.monotonic() + 0.3)
    assert str(e.value).startswith(COMP) and fs.closed
    peer.close()


def test_a_header_received_again_is_not_checked_again_but_a_changed_one_is(monkeypatch):
    """The client remembers the headers that passed for each directory entry (``TcpTransport._checked``): the same
    64 bytes for the same (offset, tag, generation, length) pass without the unpack and crc; any other bytes there
    (a slot rewritten, a torn header) get the full check and fail that object only."""
    calls = []
    real = objformat.check_object_header
    monkeypatch.setattr(objformat, "check_object_header", lambda *a: calls.append(a[2:]) or real(*a))
    peer = Peer()
    objs = objects(3, 5_000)
    t, p, answer = started_read(peer, objs)
    peer.write(answer)
    assert t.finish(p, time.monotonic() + 10) == [None] * 3 and len(calls) == 3
    calls.clear()
    for op, _ in objs:
        op.out[:] = bytes(len(op.out))
    p = t.start_read([op for op, _ in objs], time.monotonic() + 5)
    req = peer.read_request()
    torn = bytearray(answer)
    torn[wire.HEADER_SIZE + (objformat.OBJ_HEADER_SIZE + 5_000) + 20] ^= 0xFF  # object 1's header, a byte of its key tag
    peer.write(wire.encode(wire.Op.READV, req.request_id, None, data_len=len(torn) - wire.HEADER_SIZE,
                           flags=wire.Flag.RESPONSE) + bytes(torn[wire.HEADER_SIZE:]))
    res = t.finish(p, time.monotonic() + 10)
    assert res[0] is None and res[2] is None and "torn object header" in str(res[1])
    assert len(calls) == 1  # object 1 only: 0 and 2 were the very bytes checked before
    assert [bytes(objs[i][0].out) for i in (0, 2)] == [objs[i][1][objformat.OBJ_HEADER_SIZE:] for i in (0, 2)]
    t.close()
    peer.close()
