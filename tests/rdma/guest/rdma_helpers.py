"""Helpers for the in-guest RDMA engine tests: a verbs "server" process, its tiny TCP control protocol, a client
workload process, and a throughput measurement. Runs only where verbs work (inside the Soft-RoCE guest).

The server registers one arena (``ARENA_ACCESS``) filled with ``pattern(seed, size)`` and serves on TCP
127.0.0.1 (or the ``--host`` given) length-prefixed msgpack requests, one thread per connection:

    {"op": "connect", "qp": info}        -> {"qp": server QP info, "mr": {"addr", "rkey", "length"}}
    {"op": "sha", "off": o, "len": n}   -> {"sha": sha256 hex of arena[o:o+n]}
    {"op": "dereg"}                     -> {} (revokes the arena's rkey)
    {"op": "rereg"}                     -> {"mr": new mr info} (same buffer, new rkey)
    {"op": "bye"}                       -> {} and the connection ends

It prints ``PORT <n>`` once it listens, and exits after ``--clients`` connections ended (0: never).

    python3 tests/rdma/guest/rdma_helpers.py serve --size BYTES [--seed S] [--clients N] [--host H] [--port P]
    python3 tests/rdma/guest/rdma_helpers.py client --port P --slice I --slice-size BYTES [--host H] [--rounds R]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from transport.rdma import ARENA_ACCESS, CLIENT_ACCESS, RcEndpoint, RdmaContext

_LEN = struct.Struct("<I")


def pattern(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def sha(data) -> str:
    return hashlib.sha256(data).hexdigest()


def send_msg(sock: socket.socket, obj) -> None:
    body = msgpack.packb(obj, use_bin_type=True)
    sock.sendall(_LEN.pack(len(body)) + body)


def recv_msg(sock: socket.socket):
    def exact(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("peer closed")
            buf += chunk
        return bytes(buf)

    (n,) = _LEN.unpack(exact(4))
    return msgpack.unpackb(exact(n), raw=False)


# ---------------------------------------------------------------------------------------------------- server side

def serve(size: int, seed: int, clients: int, host: str, port: int = 0) -> None:
    ctx = RdmaContext()
    buf = bytearray(pattern(seed, size))
    state = {"mr": ctx.register(buf, ARENA_ACCESS)}
    lock = threading.Lock()
    lsock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    print(f"PORT {lsock.getsockname()[1]}", flush=True)
    finished = threading.Semaphore(0)

    def handle(conn: socket.socket) -> None:
        eps = []
        try:
            while True:
                try:
                    req = recv_msg(conn)
                except ConnectionError:
                    return
                op = req["op"]
                with lock:
                    if op == "connect":
                        ep = RcEndpoint(ctx, remote_access=True)
                        ep.connect(req["qp"])
                        eps.append(ep)
                        send_msg(conn, {"qp": ep.local_info(), "mr": state["mr"].remote_info()})
                    elif op == "sha":
                        send_msg(conn, {"sha": sha(memoryview(buf)[req["off"]:req["off"] + req["len"]])})
                    elif op == "dereg":
                        ctx.deregister(state["mr"])
                        send_msg(conn, {})
                    elif op == "rereg":
                        state["mr"] = ctx.register(buf, ARENA_ACCESS)
                        send_msg(conn, {"mr": state["mr"].remote_info()})
                    elif op == "bye":
                        send_msg(conn, {})
                        return
        finally:
            for ep in eps:
                ep.close()
            conn.close()
            finished.release()

    threads = []
    n = 0
    while clients == 0 or n < clients:
        conn, _ = lsock.accept()
        t = threading.Thread(target=handle, args=(conn,), daemon=True)
        t.start()
        threads.append(t)
        n += 1
    for t in threads:
        t.join()


class Server:
    """A ``serve`` subprocess; ``port`` once it listens. Context manager kills it on exit."""

    def __init__(self, size: int, seed: int = 1, clients: int = 0, host: str = "127.0.0.1"):
        self.size, self.seed, self.host = size, seed, host
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "serve", "--size", str(size), "--seed", str(seed), "--clients", str(clients),
             "--host", host], stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            self.kill()
            raise RuntimeError(f"server did not start: {line!r}")
        self.port = int(line.split()[1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()


# ---------------------------------------------------------------------------------------------------- client side

class Conn:
    """A control connection plus one connected client endpoint (``ep``) and the server arena's ``mr`` info."""

    def __init__(self, ctx: RdmaContext, port: int, host: str = "127.0.0.1", timeout: float = 30, **ep_kw):
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock = socket.create_connection((host, port), timeout=timeout)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.ep = RcEndpoint(ctx, **ep_kw)
        self.connect()

    def connect(self) -> None:
        send_msg(self.sock, {"op": "connect", "qp": self.ep.local_info()})
        rep = recv_msg(self.sock)
        self.ep.connect(rep["qp"])
        self.mr = rep["mr"]

    def call(self, **req):
        send_msg(self.sock, req)
        return recv_msg(self.sock)

    def remote_sha(self, off: int, length: int) -> str:
        return self.call(op="sha", off=off, len=length)["sha"]

    def close(self) -> None:
        try:
            self.call(op="bye")
        except OSError:
            pass
        self.ep.close()
        self.sock.close()


def measure_throughput(ep: RcEndpoint, local, remote: dict, opcode: str, msg_size: int, total: int,
                       timeout: float = 120) -> float:
    """GB/s of ``total`` bytes moved as ``msg_size``-byte RDMA ``opcode``s ("read"/"write") between ``local`` (a
    MemoryRegion) and the remote region, with the endpoint's window kept full, like perftest's ``ib_*_bw``.
    Messages visit the region's slots in stride-2 order so none is coalesced with the next: one WR per message."""
    span = min(local.length, remote["length"]) // msg_size * msg_size
    n = total // msg_size
    # Non-adjacent remote order (stride 2) so the engine cannot coalesce messages: a fair per-message figure.
    slots = span // msg_size
    order = [i for i in range(0, slots, 2)] + [i for i in range(1, slots, 2)]
    reqs = [(local, order[i % slots] * msg_size, msg_size, remote["addr"] + order[i % slots] * msg_size,
             remote["rkey"]) for i in range(n)]
    t0 = time.monotonic()
    moved = ep.transfer(opcode, reqs, time.monotonic() + timeout)
    return moved / (time.monotonic() - t0) / 1e9


def client_main(host: str, port: int, slice_no: int, slice_size: int, rounds: int, timeout: float = 30) -> int:
    """A workload for the concurrency test: write random data into its own arena slice, read it back, compare both
    the read-back bytes and the server's sha of the slice. Prints one JSON line."""
    ctx = RdmaContext()
    c = Conn(ctx, port, host, timeout)
    base = slice_no * slice_size
    src = ctx.alloc(slice_size, CLIENT_ACCESS)
    dst = ctx.alloc(slice_size, CLIENT_ACCESS)
    ok = True
    chunk = 64 << 10
    for r in range(rounds):
        src.view[:] = random.Random(1000 * slice_no + r).randbytes(slice_size)
        reqs = [(src, o, chunk, c.mr["addr"] + base + o, c.mr["rkey"]) for o in range(0, slice_size, chunk)]
        c.ep.transfer("write", reqs, time.monotonic() + 60)
        reqs = [(dst, o, chunk, c.mr["addr"] + base + o, c.mr["rkey"]) for o in range(0, slice_size, chunk)]
        c.ep.transfer("read", reqs, time.monotonic() + 60)
        want = sha(src.view)
        ok &= sha(dst.view) == want and c.remote_sha(base, slice_size) == want
    report = {"slice": slice_no, "ok": ok, "rounds": rounds, "stats": c.ep.stats, "gid": ctx.gid,
              "mtu": c.ep.local_info()["mtu"]}
    c.close()
    print(json.dumps(report), flush=True)
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--size", type=int, required=True)
    s.add_argument("--seed", type=int, default=1)
    s.add_argument("--clients", type=int, default=0)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=0)
    c = sub.add_parser("client")
    c.add_argument("--host", default="127.0.0.1")
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--slice", type=int, default=0)
    c.add_argument("--slice-size", type=int, default=4 << 20)
    c.add_argument("--rounds", type=int, default=2)
    c.add_argument("--connect-timeout", type=float, default=30)
    a = p.parse_args()
    if a.what == "serve":
        serve(a.size, a.seed, a.clients, a.host, a.port)
        return 0
    return client_main(a.host, a.port, a.slice, a.slice_size, a.rounds, a.connect_timeout)


if __name__ == "__main__":
    sys.exit(main())
