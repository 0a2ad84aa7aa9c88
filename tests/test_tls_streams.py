"""TLS reads split over several connections a node (``ClientConfig.tls_streams``, issue 45), against a closed pool
serving TLS: a big batch lands whole over every stream, a dropped stream is opened again, a small batch (or
tls_streams 1) keeps one connection, and a stream lost mid-batch fails only its own pages (misses) while the other
streams' pages land."""

from __future__ import annotations

import os
import types

import pytest

import transport.tcp as tcp
from test_hardening_auth import TENANT_A, certs, client, tls_pool  # noqa: F401  (fixtures)


def _pages(n: int, size: int) -> list[bytes]:
    return [os.urandom(size + i) for i in range(n)]


def _transport(c) -> tcp.TcpTransport:
    (t,) = c._transports.values()
    assert isinstance(t, tcp.TcpTransport)
    return t


def test_big_tls_batches_split_over_streams(tls_pool, certs, monkeypatch):  # noqa: F811
    monkeypatch.setattr(tcp, "TLS_SPLIT_BYTES", 1 << 20)
    pages = _pages(24, 100_000)  # 2.4 MB: split
    keys = [f"s-{i}" for i in range(len(pages))]
    with client(tls_pool.metaserver_addr, TENANT_A, transport="tcp", tls_ca=certs["ca"], tls_streams=4) as c:
        assert c.batch_put(keys, pages) == [True] * len(pages)
        outs = [bytearray(len(p)) for p in pages]
        assert c.batch_get_into(keys, outs) == [len(p) for p in pages]
        assert [bytes(o) for o in outs] == pages
        t = _transport(c)
        assert t._conn is not None and len(t._more) == 3 and all(m is not None and not m.closed for m in t._more)
        first = list(t._more)
        # a stream closed between batches is opened again; the others are kept
        t._more[1].close()
        outs = [bytearray(len(p)) for p in pages]
        assert c.batch_get_into(keys, outs) == [len(p) for p in pages] and [bytes(o) for o in outs] == pages
        assert t._more[0] is first[0] and t._more[2] is first[2] and t._more[1] is not first[1]
        # below TLS_SPLIT_BYTES, and with tls_streams 1: one connection carries the batch
        for small, streams in ((True, 4), (False, 1)):
            t.tls_streams = streams
            sent = []
            monkeypatch.setattr(tcp.TcpTransport, "_start_read",
                                lambda self, ops, dl, k=0, real=tcp.TcpTransport._start_read: (sent.append(k), real(
                                    self, ops, dl, k))[1])
            few = 4 if small else len(keys)
            outs = [bytearray(len(p)) for p in pages[:few]]
            assert c.batch_get_into(keys[:few], outs) == [len(p) for p in pages[:few]]
            assert [bytes(o) for o in outs] == pages[:few] and sent == [0]
            monkeypatch.undo()
            monkeypatch.setattr(tcp, "TLS_SPLIT_BYTES", 1 << 20)


def test_a_stream_lost_mid_batch_fails_only_its_pages(tls_pool, certs, monkeypatch):  # noqa: F811
    monkeypatch.setattr(tcp, "TLS_SPLIT_BYTES", 1 << 20)
    pages = _pages(24, 100_000)
    keys = [f"l-{i}" for i in range(len(pages))]
    real = tcp.TcpTransport._finish

    def cut(self, pending, deadline, stream=0):
        if stream == 2 and pending.state is not None:
            pending.state[0].close()  # the connection is gone after the requests went out
        return real(self, pending, deadline, stream)

    with client(tls_pool.metaserver_addr, TENANT_A, transport="tcp", tls_ca=certs["ca"], tls_streams=4) as c:
        assert c.batch_put(keys, pages) == [True] * len(pages)
        parts = _transport(c)._split([types.SimpleNamespace(length=len(p)) for p in pages])
        assert len(parts) == 4
        lo, hi = parts[2]
        monkeypatch.setattr(tcp.TcpTransport, "_finish", cut)
        outs = [bytearray(len(p)) for p in pages]
        got = c.batch_get_into(keys, outs)
        assert got == [len(p) if not lo <= i < hi else -1 for i, p in enumerate(pages)]
        assert all(bytes(outs[i]) == pages[i] for i in range(len(pages)) if not lo <= i < hi)
        assert c.counters["node_failures"] == 1  # the lost stream fails the node's transport: dropped, reopened
        monkeypatch.setattr(tcp.TcpTransport, "_finish", real)
        # the transport was dropped and comes back whole
        outs = [bytearray(len(p)) for p in pages]
        assert c.batch_get_into(keys, outs) == [len(p) for p in pages] and [bytes(o) for o in outs] == pages


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
