"""The node's TLS answers encrypted off its event loop (``transport/tlsserve.py``, issue 45), against a closed pool
serving TLS: big pages read over several streams arrive byte-exact (answers encrypted on worker threads, small ones
on the loop, in order on each connection), and a client whose streams stop reading (their sockets full, the node's
workers handing the rest back to the loop) neither stops the node serving another client nor loses a byte when it
reads again."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import struct
import termios
import time

import pytest

import transport.tcp as tcp
from umbp.config import ClientConfig, resolve
from umbp.errors import ConfigError
from test_hardening_auth import TENANT_A, certs, client, tls_pool  # noqa: F401  (fixtures)
from waiting import eventually

MiB = 1 << 20


def _pages(n: int) -> list[bytes]:
    # big (worker-encrypted) answers with odd sizes, and a few small ones between them (encrypted on the loop)
    return [os.urandom(MiB + 4099 * i if i % 5 else 3000 + i) for i in range(n)]


def _transport(c) -> tcp.TcpTransport:
    (t,) = c._transports.values()
    return t


def _queued(sock) -> int:
    """Bytes the kernel holds for ``sock``, not yet read."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


def test_tls_streams_and_ktls_are_client_settings():
    assert resolve(ClientConfig, {}, env={"UMBP_TLS_STREAMS": "2", "UMBP_KTLS": "1"}) == ClientConfig(tls_streams=2,
                                                                                                     ktls=True)
    assert ClientConfig().tls_streams == 2 and ClientConfig().ktls is False
    for bad in ({"tls_streams": 0}, {"tls_streams": 17}, {"tls_streams": 2.0}, {"ktls": "yes"}):
        with pytest.raises(ConfigError, match="client: (tls_streams|ktls)"):
            ClientConfig(**bad)
    t = tcp.TcpTransport("n", "127.0.0.1:1", tls_ca="x", tls_streams=3)
    assert [hi - lo for lo, hi in t._split([dataclasses.make_dataclass("Op", ["length"])(MiB)] * 6)] == [2, 2, 2]


def test_big_pages_over_tls_streams_byte_exact(tls_pool, certs, monkeypatch):  # noqa: F811
    monkeypatch.setattr(tcp, "TLS_SPLIT_BYTES", 1 << 20)
    pages = _pages(40)  # about 33 MB
    keys = [f"b-{i}" for i in range(len(pages))]
    with client(tls_pool.metaserver_addr, TENANT_A, transport="tcp", tls_ca=certs["ca"], tls_streams=4) as c:
        assert c.batch_put(keys, pages) == [True] * len(pages)
        for rnd in range(3):  # whole batches, then parts of one (other splits, one small answer alone)
            pick = range(len(pages)) if rnd < 2 else range(3, 12)
            outs = [bytearray(len(pages[i])) for i in pick]
            assert c.batch_get_into([keys[i] for i in pick], outs) == [len(pages[i]) for i in pick]
            assert [bytes(o) for o in outs] == [pages[i] for i in pick]
        t = _transport(c)
        assert len(t._more) == 3 and all(m is not None and not m.closed for m in t._more)  # one client, 4 streams
        assert c.get(keys[0]) == pages[0] and c.get(keys[1]) == pages[1]


def test_a_stalled_tls_peer_does_not_stop_the_node(tls_pool, certs, monkeypatch):  # noqa: F811
    monkeypatch.setattr(tcp, "TLS_SPLIT_BYTES", 1 << 20)
    pages = _pages(16)  # about 14 MB a batch: each stream's part about 3.5 MB
    keys = [f"s-{i}" for i in range(len(pages))]
    with client(tls_pool.metaserver_addr, TENANT_A, transport="tcp", tls_ca=certs["ca"], tls_streams=4) as stalled, \
            client(tls_pool.metaserver_addr, TENANT_A, transport="tcp", tls_ca=certs["ca"], tls_streams=4) as other:
        assert stalled.batch_put(keys, pages) == [True] * len(pages)
        t = _transport(stalled)
        seen = []
        real = t.start_read
        monkeypatch.setattr(t, "start_read", lambda ops, dl: (seen.append(ops), real(ops, dl))[1])
        outs = [bytearray(len(p)) for p in pages]
        assert stalled.batch_get_into(keys, outs) == [len(p) for p in pages]
        (ops,) = seen
        # The batch asked 6 times over in one split read, not read: about 21 MB of answer a stream, more than the two
        # socket buffers hold (8 + 8 MiB): the node's workers find the sockets full and hand the rest to the loop.
        copies = [[bytearray(len(p)) for p in pages] for _ in range(6)]
        many = [dataclasses.replace(op, out=memoryview(o)) for outs_k in copies for op, o in zip(ops, outs_k)]
        deadline = time.monotonic() + 60
        pend = t.start_read(many, deadline)
        socks = [t._conn.sock] + [m.sock for m in t._more]
        assert len(socks) == 4
        eventually(lambda: min(_queued(s) for s in socks) >= 2 * MiB, 30, "the stalled streams' sockets filling")
        for _ in range(3):  # another client's TLS gets, big (worker-encrypted) and small, go on meanwhile
            got = [bytearray(len(p)) for p in pages]
            assert other.batch_get_into(keys, got) == [len(p) for p in pages]
            assert [bytes(g) for g in got] == pages
            assert other.get(keys[0]) == pages[0]
        # the stalled client reads again: every answer whole, in order
        assert t.finish(pend, deadline) == [None] * len(many)
        assert all([bytes(o) for o in outs_k] == pages for outs_k in copies)
        got = [bytearray(len(p)) for p in pages]
        assert stalled.batch_get_into(keys, got) == [len(p) for p in pages] and [bytes(g) for g in got] == pages


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
