"""Connection floods against a closed pool (issue 42, finding 3), each at a small scale of what was reported:

- 20 tokenless sockets that reconnect as soon as they are closed kept every new client out of the metaserver (0 of
  4 got in within 30 s, each DeadlineExceeded): now 20 clients with a token (4 at a time) get in within seconds
  while 20 such sockets churn against the metaserver and 20 against the node, silent, pinging or saying HELLO;
- TLS handshakes that never finish had no cap of their own (with 1,024 descriptors, 1,100 silent sockets shut out
  2 of 3 clients; 3,000 raised a node's RSS from 138 to 855 MB): now servers started with a low open-file limit
  raise it, and silent sockets are pre-auth connections like any other (evicted, closed at the auth deadline
  counted from the TCP accept): a TLS client gets in while 1,000 are held against each server, whose descriptors
  stay flat and whose memory stays bounded by the pre-auth cap;
- tokenless peers announcing 16 MiB metas raised a node's RSS to about 1.34 GB: now a header announcing more than
  16 KiB of meta before AUTH is answered AUTH and the connection closed before a byte of it is buffered.

Real etcd, metaserver and node processes; attackers are raw sockets on the clients' own address (127.0.0.1), so
the per-address cap does not separate them: what protects the clients is that a newcomer evicts the connection
that got least far, and a client has sent its HELLO before anyone can evict it."""

from __future__ import annotations

import os
import resource
import selectors
import socket
import threading
import time

import pytest

from transport import wire
from umbp.auth import ClientAuth
from umbp.client import Client

from closedpool import OPS, closed_cluster, make_certs, scoped_client, tokens_toml

TENANT_A = "tenant-a-secret-0123456789"
TOKENS = tokens_toml({"tenant-a": (TENANT_A, {"tenant-a": "rw"})})
LOW_NOFILE = 256  # the servers of the TLS test start with this soft open-file limit (the common default: 1,024)
SILENT = 1000  # silent sockets held against each of them


def client(addrs: str, token: str, **kw) -> Client:
    return scoped_client(addrs, token, "tenant-a", **kw)


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def nofile_limits(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/limits") as fh:
        line = next(line for line in fh if line.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    return int(soft), int(hard)


def accept_queue(port: int) -> int:
    """Connections waiting in the listen queue of the socket listening on 127.0.0.1:``port`` (the rx_queue
    /proc/net/tcp shows for a LISTEN socket)."""
    with open("/proc/net/tcp") as fh:
        for line in fh.readlines()[1:]:
            parts = line.split()
            if parts[3] == "0A" and int(parts[1].split(":")[1], 16) == port:
                return int(parts[4].split(":")[1], 16)
    return 0


def node_addr(cluster) -> str:
    with client(cluster.metaserver_addr, OPS) as ops:
        return ops.admin(wire.Op.NODES)["nodes"][0]["addr"]


def host_port(addr: str) -> tuple[str, int]:
    host, port = addr.rsplit(":", 1)
    return host, int(port)


class Reconnecting:
    """``n`` tokenless sockets per address that reconnect as soon as the server closes them, in one thread, until
    stopped (bounded: 60 s); ``connects`` counts them. ``speak``: "ping" (every other one sends a PING first, the
    rest nothing) or "hello" (each sends a HELLO, as a client does before its AUTH)."""

    def __init__(self, addrs: list[str], n: int, speak: str = "ping"):
        self.targets = [host_port(a) for a in addrs for _ in range(n)]
        hello = ClientAuth(None, "attacker").hello_meta("attacker")
        self.first = {"ping": wire.encode(wire.Op.PING, 1, {}), "hello": wire.encode(wire.Op.HELLO, 1, hello)}[speak]
        self.speak = speak
        self.connects = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Reconnecting:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _connect(self, sel: selectors.BaseSelector, i: int) -> None:
        try:
            s = socket.create_connection(self.targets[i], timeout=2)
            if i % 2 or self.speak == "hello":
                s.sendall(self.first)
        except OSError:
            return  # tried again on the next pass
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, i)
        self.connects += 1

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        live: set[int] = set()
        end = time.monotonic() + 60
        while not self._stop.is_set() and time.monotonic() < end:
            live = {key.data for key in sel.get_map().values()}
            for i in range(len(self.targets)):
                if i not in live:
                    self._connect(sel, i)  # at once: a flood that reconnects as soon as it is closed
            for key, _ in sel.select(timeout=0.05):
                try:
                    data = key.fileobj.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:  # closed by the server: gone, reconnected on the next pass
                    sel.unregister(key.fileobj)
                    key.fileobj.close()
        for key in list(sel.get_map().values()):
            key.fileobj.close()
        sel.close()


@pytest.fixture
def closed(make_cluster, tmp_path, monkeypatch):
    """A metaserver and one node sharing a tokens file, every limit at its default (16 pre-auth connections, 8 from
    one address, 5 s to authenticate)."""
    return closed_cluster(make_cluster, tmp_path, monkeypatch, TOKENS, nodes=1, lease_ttl=3)


@pytest.mark.parametrize("speak", ["ping", "hello"])
def test_reconnecting_tokenless_sockets_do_not_keep_clients_out(closed, speak):
    """With "hello" the flood's sockets rank as far as a client's until its AUTH: the client's connection may be
    evicted in that round trip, and FramedSocket connects again (transport/framed.py)."""
    page = os.urandom(100_000)
    targets = [closed.metaserver_addr, node_addr(closed)]
    with Reconnecting(targets, 20, speak) as flood:
        for _ in range(500):  # bounded: the flood is under way (its sockets connected, evicted, back)
            if flood.connects > 200:
                break
            time.sleep(0.02)
        results: list = [None] * 20  # 4 clients at a time, each connecting afresh 5 times

        def one(i: int) -> None:
            for k in range(i, 20, 4):
                t0 = time.monotonic()
                try:
                    with client(closed.metaserver_addr, TENANT_A, transport="tcp", timeout_s=10.0) as c:
                        ok = c.put(f"k{k}", page) is True and c.get(f"k{k}") == page
                    results[k] = (ok, time.monotonic() - t0)
                except Exception as e:  # noqa: BLE001 - reported by the assertion below
                    results[k] = (repr(e), time.monotonic() - t0)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        connects = flood.connects
    print(f"\n20 clients under 2 x 20 reconnecting tokenless sockets ({speak}, {connects} connections): "
          f"slowest {max(r[1] for r in results if r):.3f}s; {[r for r in results if not r or r[0] is not True]}")
    assert [r[0] if r else None for r in results] == [True] * 20, results  # each put and read back its page
    assert max(r[1] for r in results) < 5.0, results  # within seconds, not the 30 s deadline
    assert connects > 300  # the flood ran all along: its sockets were closed and came back


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    made = make_certs(tmp_path_factory.mktemp("tls"))
    if made is None:
        pytest.skip("no `openssl` command to make the test certificates with")
    return made


@pytest.fixture
def tls_low_limit(make_cluster, tmp_path, monkeypatch, certs):
    """A closed pool serving TLS only whose metaserver and node start with a soft open-file limit of LOW_NOFILE
    (inherited from this process while they start)."""
    monkeypatch.setenv("UMBP_TLS_CA", certs["ca"])
    tls = {"tls_cert": certs["cert"], "tls_key": certs["key"]}
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4 * LOW_NOFILE:
        pytest.skip(f"the hard open-file limit ({hard}) leaves no room above {LOW_NOFILE}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (LOW_NOFILE, hard))
    try:
        cluster = closed_cluster(make_cluster, tmp_path, monkeypatch, TOKENS, nodes=1, lease_ttl=3,
                                 metaserver_flags=tls, node_flags=tls)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    monkeypatch.delenv("UMBP_TLS_CA")
    return cluster


def test_silent_tls_handshakes_cannot_shut_clients_out(tls_low_limit, certs):
    cluster = tls_low_limit
    servers = {"metaserver": cluster.metaserver, "node": cluster.nodes[0]}
    addrs = {"metaserver": cluster.metaserver_addr, "node": f"{cluster.nodes[0].host}:{cluster.nodes[0].port}"}
    limits = {name: nofile_limits(p.pid) for name, p in servers.items()}
    page = os.urandom(200_000)
    with client(cluster.metaserver_addr, TENANT_A, transport="tcp", tls_ca=certs["ca"]) as c:
        assert c.put("before", page) is True  # the servers' steady state: a client served, then measure
    before = {name: (open_fds(p.pid), rss_kib(p.pid)) for name, p in servers.items()}
    silent: list[socket.socket] = []
    try:
        for name in servers:  # 1,000 silent sockets against each server (4 x LOW_NOFILE), held
            silent += [socket.create_connection(host_port(addrs[name]), timeout=5) for _ in range(SILENT)]
        for _ in range(100):  # bounded: until both servers took every connection off their listen queue
            if not any(accept_queue(host_port(a)[1]) for a in addrs.values()):
                break
            time.sleep(0.05)
        during = {name: (open_fds(p.pid), rss_kib(p.pid)) for name, p in servers.items()}
        t0 = time.monotonic()
        try:  # the old servers let this client in only once their handshake timeouts (5 s) freed descriptors
            with client(cluster.metaserver_addr, TENANT_A, transport="tcp", tls_ca=certs["ca"], timeout_s=4.0) as c:
                got = c.put("during", page[::-1]) is True and c.get("during") == page[::-1] and c.get("before") == page
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            got = repr(e)
        took = time.monotonic() - t0
    finally:
        for s in silent:
            s.close()
    for _ in range(80):  # bounded (4 s): the servers gave the flood's memory back (a trim a second at most)
        after = {name: rss_kib(p.pid) for name, p in servers.items()}
        if all(after[name] - before[name][1] < 4 * 1024 for name in servers):
            break
        time.sleep(0.05)
    print(f"\nTLS client in {took:.2f}s ({got}) while {len(silent)} silent sockets were held; (fds, RSS KiB) "
          f"before {before}, during {during}; RSS KiB after {after}; open-file limits {limits}")
    assert got is True and took < 4.0
    for name in servers:
        soft, hard = limits[name]
        assert soft == hard and soft > LOW_NOFILE, (name, soft, hard)  # raised at start, from LOW_NOFILE
        # 16 pre-auth connections at most (32 for a moment in a burst), plus the client's: not one descriptor per
        # silent socket, nor a handshake's memory each (about 250 KB: 1,000 would hold 250 MB; measured +10 MB for
        # the metaserver, +28 MB for the node, whose heap keeps large blocks for TLS: umbp/tls.py)
        assert during[name][0] - before[name][0] < 40, (name, before[name], during[name])
        assert during[name][1] - before[name][1] < 48 * 1024, (name, before[name], during[name])
        # given back once they left: all of it (metaserver), all but what the node's heap keeps of a burst (+16 to
        # +25 MB over runs, the same after floods of 300 or 3,000): far from the 250 MB a handshake each would keep
        assert after[name] - before[name][1] < 32 * 1024, (name, before[name], after[name])


def send_big_meta(addr: str, meta_len: int) -> tuple[int, bool]:
    """A tokenless peer that announces ``meta_len`` bytes of meta and sends them, 1 MiB at a time: (bytes the
    server took before it cut the connection, whether it cut it within 10 s)."""
    s = socket.create_connection(host_port(addr), timeout=10)
    sent = 0
    try:
        s.sendall(wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.Op.PING, 0, 0, 1, meta_len, 0))
        chunk = b"\x00" * (1 << 20)
        while sent < meta_len:
            s.sendall(chunk[:meta_len - sent])
            sent += min(len(chunk), meta_len - sent)
        s.shutdown(socket.SHUT_WR)
        while s.recv(65536):
            pass
        return sent, True
    except (BrokenPipeError, ConnectionResetError):
        return sent, True
    except TimeoutError:
        return sent, False
    finally:
        s.close()


def test_tokenless_big_metas_are_cut_before_they_are_buffered(closed):
    servers = {"metaserver": closed.metaserver, "node": closed.nodes[0]}
    addrs = {"metaserver": closed.metaserver_addr, "node": node_addr(closed)}
    before = {name: rss_kib(p.pid) for name, p in servers.items()}
    results: dict[str, list] = {name: [None] * 24 for name in servers}

    def peer(name: str, i: int) -> None:
        results[name][i] = send_big_meta(addrs[name], 16 << 20)

    threads = [threading.Thread(target=peer, args=(name, i)) for name in servers for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    after = {name: rss_kib(p.pid) for name, p in servers.items()}
    print(f"\n24 tokenless 16 MiB metas per server: RSS KiB before {before}, after {after}; MiB taken before the "
          f"cut: { {n: [r[0] >> 20 for r in rs] for n, rs in results.items()} }")
    for name, rs in results.items():
        assert all(r is not None and r[1] for r in rs), (name, rs)  # every one cut within the 10 s
        assert all(r[0] < 16 << 20 for r in rs), (name, rs)  # none got its 16 MiB through
        assert after[name] - before[name] < 16 * 1024, (name, before[name], after[name])  # nothing of them kept
    # what one is told: the header alone, answered AUTH before a byte of its meta arrived
    for name, addr in addrs.items():
        s = socket.create_connection(host_port(addr), timeout=5)
        s.sendall(wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.Op.PING, 0, 0, 1, 16 << 20, 0))
        reader = wire.FrameReader("peer")
        frames: list = []
        end = time.monotonic() + 5
        while not frames and time.monotonic() < end:
            buf = reader.get_buffer()
            n = s.recv_into(buf)
            assert n, f"{name} closed without an answer"
            frames = reader.buffer_updated(n)
        f = frames[0][0]
        assert f.request_id == 0 and f.status == wire.Status.AUTH, f
        component = "metaserver" if name == "metaserver" else "node node0"
        assert f.meta["error"] == (f"{component}: authentication required (HELLO, then AUTH) before a frame with "
                                   f"data or more than 16384 bytes of meta (frame meta of 16777216 bytes exceeds "
                                   f"the limit of 16384)")
        assert s.recv(1) == b""  # then closed
        s.close()
    with client(closed.metaserver_addr, TENANT_A, transport="tcp") as c:
        assert c.put("after", b"still serving") is True and c.get("after") == b"still serving"
