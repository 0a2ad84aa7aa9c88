"""Hostile input against a closed pool (umbp/auth.py): tokens and scopes, impostor nodes, forged writes and reads,
memory under announced-length and trickle connections, idle timeouts, writers that die or retry, and a client with
no metaserver to talk to. Real etcd, metaserver and node processes; attacks go over raw sockets."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from transport import objformat, wire
from transport.framed import FramedSocket
from umbp.auth import ClientAuth, with_caps
from umbp.client import Client
from umbp.config import ClientConfig, resolve
from umbp.errors import AuthError, TransportError

from closedpool import OPS, SECRET, closed_cluster, scoped_client, tokens_toml
from cluster import NotYet, eventually

TENANT_A = "tenant-a-secret-0123456789"
READER = "tenant-a-reader-0123456789"
TOKENS = tokens_toml({"tenant-a": (TENANT_A, {"tenant-a": "rw", "shared/*": "r"}),
                      "reader": (READER, {"tenant-a": "r"})})


@pytest.fixture
def closed(make_cluster, tmp_path, monkeypatch):
    """Two nodes and a metaserver sharing a tokens file; the harness's own CLI calls use the cluster secret."""
    return closed_cluster(make_cluster, tmp_path, monkeypatch, TOKENS, lease_ttl=3, env={"UMBP_IDLE_TIMEOUT_S": "2"})


CLOSE_WAIT = "08"  # /proc/net/tcp state: the peer closed, this end has not


def own_tcp_states(remote_ports: set[int]) -> dict[int, str]:
    """{inode: TCP state} of this process's sockets connected to any of ``remote_ports`` on 127.0.0.1 (from
    /proc/self/fd and /proc/net/tcp: what the kernel says, no client internals)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    out = {}
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            remote, state, inode = parts[2], parts[3], int(parts[9])
            if inode in inodes and int(remote.split(":")[1], 16) in remote_ports:
                out[inode] = state
    return out


def unread_by_servers(client_ports: set[int]) -> int:
    """Bytes the kernel still queues for the server ends of connections from ``client_ports`` on 127.0.0.1 (the
    rx_queue of sockets whose remote port is one of them): 0 once the servers have read everything sent."""
    total = 0
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            if int(parts[2].split(":")[1], 16) in client_ports:
                total += int(parts[4].split(":")[1], 16)
    return total


def client(cluster, token, ns="tenant-a", **kw) -> Client:
    return scoped_client(cluster.metaserver_addrs, token, ns, **kw)


def node_addr(cluster, node_id: str) -> str:
    with client(cluster, OPS) as c:
        return next(n["addr"] for n in c.admin(wire.Op.NODES)["nodes"] if n["node_id"] == node_id)


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))


def test_tokens_and_scopes(closed):
    page = os.urandom(10_000)
    with client(closed, TENANT_A) as a:
        assert a.put("p0", page) is True and a.get("p0") == page
        with pytest.raises(AuthError, match="may not write namespace 'shared/x'"):
            client(closed, TENANT_A, ns="shared/x").put("k", b"v")
        with pytest.raises(AuthError, match="may not read namespace 'victim'"):
            client(closed, TENANT_A, ns="victim").get("k")
        with pytest.raises(AuthError, match="LIST of every namespace needs an admin token"):
            a.admin(wire.Op.LIST, {})
        with pytest.raises(AuthError, match="EVICT needs an admin token"):
            a.admin(wire.Op.EVICT, {"bytes": 1})
        with pytest.raises(AuthError, match="DRAIN needs an admin token"):
            a.admin(wire.Op.DRAIN, {"node_id": "node0"})
    with pytest.raises(AuthError, match="requires a token"):
        client(closed, None).get("p0")
    with pytest.raises(AuthError, match="authentication failed: unknown token"):
        client(closed, "not-a-token-of-this-pool").get("p0")
    with client(closed, READER) as r:
        assert r.get("p0") == page  # read rights: the bytes, over the node too
        with pytest.raises(AuthError, match="may not write namespace 'tenant-a'"):
            r.put("p1", b"x")
        with pytest.raises(AuthError, match="may not write"):
            r.remove("p0")
    with client(closed, OPS) as ops:
        listed = ops.admin(wire.Op.LIST, {})["objects"]
        assert [(o[0], o[1]) for o in listed] == [("tenant-a", b"p0")]
    # the admin CLI with a token: stats of the whole pool
    stats = closed.cli_json("stats", "--token", OPS)
    assert stats["objects"] == 1


def test_handshake_never_sends_the_secret_and_checks_the_server(closed):
    """Every byte the client sends during HELLO+AUTH, and the server's proof is checked: a server that does not know
    the token cannot complete the handshake."""
    sent = []
    conn = FramedSocket(closed.metaserver_addr, "spy", time.monotonic() + 5)
    real_send = conn.send
    conn.send = lambda bufs, dl: (sent.extend(bytes(memoryview(b).cast("B")) for b in bufs), real_send(bufs, dl))
    assert conn.handshake(TENANT_A, time.monotonic() + 5) == "tenant-a"
    wire_bytes = b"".join(sent)
    assert TENANT_A.encode() not in wire_bytes and SECRET.encode() not in wire_bytes
    conn.close()
    auth = ClientAuth(TENANT_A, "test")
    auth.auth_meta({"auth": True, "nonce": os.urandom(32), "server": "fake"})
    with pytest.raises(AuthError, match="could not prove"):
        auth.check({"scope": "tenant-a", "proof": os.urandom(32)})


def test_impostor_cannot_take_over_a_live_node_id(closed):
    with client(closed, TENANT_A) as a:
        keys = [f"imp/{i}" for i in range(20)]
        vals = [os.urandom(5000) for _ in keys]
        assert a.batch_put(keys, vals) == [True] * 20
        with client(closed, OPS) as ops:
            real = {n["node_id"]: n for n in ops.admin(wire.Op.NODES)["nodes"]}
        desc = {k: real["node0"][k] for k in ("node_id", "host", "port", "pid", "arena_id", "arena_path", "boot_id",
                                               "hostname", "transports", "rdma")}
        desc.update(capacity=real["node0"]["capacity_bytes"], lease_ttl=3.0, port=1)  # clients would go to port 1
        tenant = FramedSocket(closed.metaserver_addr, "tenant impostor", time.monotonic() + 5, TENANT_A)
        with pytest.raises(AuthError, match="may not register a storage node"):
            tenant.request(wire.Op.REGISTER_NODE, desc, time.monotonic() + 5)
        twin = FramedSocket(closed.metaserver_addr, "impostor", time.monotonic() + 5, SECRET)
        with pytest.raises(AuthError, match="held by a live node"):
            twin.request(wire.Op.REGISTER_NODE, desc, time.monotonic() + 5)
        with pytest.raises(Exception, match="register again"):  # heartbeats count only on the node's connection
            twin.request(wire.Op.HEARTBEAT, {"node_id": "node0", "arena_id": desc["arena_id"]},
                         time.monotonic() + 5)
        twin.close()
        tenant.close()
        # Past node0's lease (3 s): it stays alive only if its own heartbeats are still accepted. Counted in the
        # metaserver's ticks (every 0.05 s it checks leases): 70 ticks ran, so a lease missed would have been seen.
        with client(closed, OPS) as ops:
            start = ops.stats()["ticks"]

            def past_lease() -> dict:
                st = ops.stats()
                node0 = next(n for n in st["nodes"] if n["node_id"] == "node0")
                assert node0["alive"] and node0["port"] == real["node0"]["port"], node0  # at every poll
                if st["ticks"] - start < 70:
                    raise NotYet(f"{st['ticks'] - start} ticks")
                return st

            st = eventually(past_lease, 30, "the metaserver's ticks advancing past node0's lease")
            assert st["ticks"] - start >= 70, "the metaserver's ticks did not advance past node0's lease"
        outs = [bytearray(5000) for _ in keys]
        assert a.batch_get_into(keys, outs) == [5000] * 20 and outs == vals


def test_forged_writes_and_reads_are_refused_at_the_node(closed):
    page = os.urandom(8000)
    with client(closed, TENANT_A) as a:
        assert a.put("victim", page) is True
    with client(closed, READER) as r:  # may read tenant-a: learns where the page is, with a read capability only
        reply = r.admin(wire.Op.LOOKUP, {"ns": "tenant-a", "keys": [b"victim"]})
    assert len(reply["caps"]) == 1  # one read capability per node of the batch
    node_id, off, size, gen, tag, rcap = with_caps(reply["locs"], reply["caps"], 5)[0]
    assert tag != objformat.key_hash("tenant-a", b"victim")  # the header's key hash is keyed: not from public fields
    attacker = FramedSocket(node_addr(closed, node_id), "attacker", time.monotonic() + 5, READER)
    forged = os.urandom(size)
    header = objformat.pack_object_header(tag, gen, size)  # even with the real tag and generation
    for cap in (b"", rcap, os.urandom(16)):
        with pytest.raises(AuthError, match="no valid capability to write"):
            attacker.request(wire.Op.WRITE, [off, gen, cap], time.monotonic() + 5, data=[header, forged])
    with pytest.raises(AuthError, match="no valid capability to read"):
        attacker.request(wire.Op.READ, [off, 0, size, tag, gen, size, os.urandom(16)], time.monotonic() + 5)
    f = attacker.request(wire.Op.READ, [off, 0, size, tag, gen, size, rcap], time.monotonic() + 5)
    assert bytes(f.data[objformat.OBJ_HEADER_SIZE:]) == page  # the granted read works
    attacker.close()
    anon = FramedSocket(node_addr(closed, node_id), "anonymous", time.monotonic() + 5)
    with pytest.raises(AuthError, match="authentication required"):
        anon.request(wire.Op.ARENA_INFO, {}, time.monotonic() + 5)  # arena path and rkey: for clients only
    with pytest.raises(AuthError, match="authentication required"):
        anon.request(wire.Op.WRITE, [off, gen, b""], time.monotonic() + 5, data=[header, forged])
    anon.close()
    with client(closed, TENANT_A, checksum=True) as a:
        assert a.get("victim") == page


def test_arena_info_and_node_maps_tell_scoped_tokens_nothing_that_maps_the_arena(closed):
    """Issue 42 finding 5: a node's ARENA_INFO told a read-only token the arena path and id, boot id, pid and
    hostname; with the path and id a same-host process maps the arena, every tenant's pages. A scoped token, read-only
    or rw, gets what TCP needs (node id, address, capacity) and no shm; the cluster secret and admin tokens get the
    rest, and shm works for them. The metaserver's NODES and STATS node maps answer the same."""
    node = closed.nodes[0]
    addr = node_addr(closed, node.name)
    answers = {}
    for name, token in (("reader", READER), ("tenant-a", TENANT_A), ("ops", OPS), ("cluster", SECRET)):
        s = FramedSocket(addr, name, time.monotonic() + 5, token)
        answers[name] = s.request(wire.Op.ARENA_INFO, {}, time.monotonic() + 5).meta
        s.close()
    full = answers["cluster"]
    assert full["arena_path"] and os.path.exists(full["arena_path"]) and len(full["arena_id"]) > 0
    assert full["pid"] == node.pid and full["boot_id"] and full["hostname"] and "shm" in full["transports"]
    assert answers["ops"] == full
    for name in ("reader", "tenant-a"):
        got = answers[name]
        assert (got["arena_path"], got["arena_id"], got["boot_id"], got["pid"], got["hostname"]) == ("", b"", "", 0, "")
        assert "shm" not in got["transports"] and "tcp" in got["transports"]
        assert (got["node_id"], got["host"], got["port"], got["capacity"]) == (
            full["node_id"], full["host"], full["port"], full["capacity"])
        assert full["arena_path"].encode() not in repr(got).encode() and full["arena_id"] not in repr(got).encode()
    with client(closed, READER) as r:
        maps = r.admin(wire.Op.NODES)["nodes"] + r.admin(wire.Op.STATS)["nodes"]
    assert len(maps) == 2 * len(closed.nodes)
    for n in maps:
        assert (n["arena_path"], n["arena_id"], n["boot_id"], n["pid"], n["hostname"]) == ("", b"", "", 0, "")
        assert "shm" not in n["transports"]
    page = os.urandom(10_000)
    with client(closed, TENANT_A) as a:  # a scoped client still puts and reads back over TCP
        assert a.put("arena-info", page) is True and a.get("arena-info") == page


def test_memory_stays_bounded_under_announced_lengths_and_trickles(closed):
    node = closed.nodes[0]
    addr = node_addr(closed, node.name)
    ms = closed.metaserver
    before = {"node": rss_kib(node.pid), "metaserver": rss_kib(ms.pid)}
    socks = []
    for i in range(16):  # 16 x "1 GiB is coming" to the node, half of them authenticated
        s = FramedSocket(addr, "hog", time.monotonic() + 5, SECRET if i % 2 else None)
        s.sock.sendall(wire.encode(wire.Op.WRITE, 1, [4096, 1, b""], data_len=1 << 30) + os.urandom(1 << 16))
        socks.append(s)
    for i in range(16):  # 16 x "16 MiB of meta is coming" trickled to both servers
        for target in (addr, closed.metaserver_addr):
            host, port = target.rsplit(":", 1)
            s = socket.create_connection((host, int(port)))
            s.sendall(wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.Op.PING, 0, 0, 1, 16 << 20, 0) + b"\x80" * 1000)
            socks.append(s)
    ports = {(x.sock if isinstance(x, FramedSocket) else x).getsockname()[1] for x in socks}
    # until both servers have read every byte sent (or closed the connection): then measure
    eventually(lambda: unread_by_servers(ports) == 0, 10,
               lambda: f"the servers reading every byte sent: {unread_by_servers(ports)} left unread")
    after = {"node": rss_kib(node.pid), "metaserver": rss_kib(ms.pid)}
    print(f"\nRSS KiB before {before}, after 16 announced-GiB writes and 32 trickled 16 MiB metas: {after}")
    assert after["node"] - before["node"] < 32 * 1024  # the announced GiBs and MiBs were never allocated
    assert after["metaserver"] - before["metaserver"] < 32 * 1024
    for s in socks:
        s.close()
    with client(closed, TENANT_A) as a:
        assert a.put("after-hogs", b"still serving") and a.get("after-hogs") == b"still serving"


def test_idle_connections_are_closed_and_clients_reconnect(closed):
    page = os.urandom(3000)
    with client(closed, TENANT_A, transport="tcp") as a:
        assert a.put("idle", page)
        s = socket.create_connection(("127.0.0.1", int(closed.metaserver_addr.rsplit(":", 1)[1])))
        s.settimeout(20)
        assert s.recv(1) == b""  # closed by the metaserver after its 2 s idle timeout
        s.close()
        # the client's own metaserver and node connections went idle too: wait until both servers closed them
        ports = {int(closed.metaserver_addr.rsplit(":", 1)[1])} | {int(node_addr(closed, n.name).rsplit(":", 1)[1])
                                                                   for n in closed.nodes}
        def closed_by_servers() -> dict:
            states = own_tcp_states(ports)
            if not (states and all(st == CLOSE_WAIT for st in states.values())):
                raise NotYet(f"TCP states {states}")
            return states

        states = eventually(closed_by_servers, 10, "both servers closing the idle connections")
        assert states and all(st == CLOSE_WAIT for st in states.values()), states
        assert a.get("idle") == page
        assert a.counters["node_failures"] == 0  # a closed idle connection is reopened, not a failed read


def test_dead_writer_frees_its_pending_keys_and_others_wait_for_a_live_one(closed):
    writer = FramedSocket(closed.metaserver_addr, "writer", time.monotonic() + 5, TENANT_A)
    meta = {"ns": "tenant-a", "keys": [b"contended"], "sizes": [1000], "token": 4242}
    first = writer.request(wire.Op.ALLOC, meta, time.monotonic() + 5).meta["items"]
    again = writer.request(wire.Op.ALLOC, meta, time.monotonic() + 5).meta["items"]
    # a retried ALLOC gets the same place (and a fresh capability for it: its deadline counts from the retry)
    assert first[0][0] == wire.AllocState.NEW and again[0][:6] == first[0][:6]
    other = dict(meta, token=4343)
    assert writer.request(wire.Op.ALLOC, other, time.monotonic() + 5).meta["items"][0][0] == \
        wire.AllocState.IN_FLIGHT
    result: dict = {}

    waiting = threading.Event()

    def second_writer():
        with client(closed, TENANT_A) as c:
            real_once = c.puts._put_once

            def put_once(*a, **k):  # notes each round whose ALLOC answered IN_FLIGHT (the put then backs off)
                res = real_once(*a, **k)
                if res[4]:
                    waiting.set()
                return res

            c.puts._put_once = put_once
            try:
                result["put"] = c.put("contended", b"w" * 1000)
                result["get"] = c.get("contended")
            except BaseException as e:  # noqa: BLE001 - reported by the assertions below
                result["error"] = repr(e)

    t = threading.Thread(target=second_writer)
    t.start()
    assert waiting.wait(20), "the second writer never found the key IN_FLIGHT"
    assert "put" not in result  # it waits for the first writer: neither "stored" nor "exists" yet
    writer.close()  # the first writer dies without writing
    t.join(20)
    assert result == {"put": True, "get": b"w" * 1000}


def test_no_metaserver_fails_fast(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    cfg = resolve(ClientConfig, {"metaserver": f"127.0.0.1:{port}", "timeout_s": 120.0}, env={})
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="no metaserver is listening"):
        Client(config=cfg).put("k", b"v")
    print(f"\nno metaserver: failed after {time.monotonic() - t0:.2f}s (deadline 120 s)")
