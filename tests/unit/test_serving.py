"""The server protocol's pre-auth rules (umbp/serving.py, issue 42 finding 3), on asyncio's loop and on uvloop: a
TLS handshake is admitted (and counted) at the TCP accept, inside the authentication deadline; handshakes that
never finish are evicted by newer connections; before AUTH a frame announcing more than PREAUTH_MAX_META of meta or
any data is answered AUTH and the connection closed, after AUTH the reader's own limits apply. A small protocol on
``FramedProtocol`` (PING answered, AUTH marks the connection authenticated); clients are asyncio streams."""

from __future__ import annotations

import asyncio
import ssl

import pytest
import uvloop

from transport import wire
from umbp.admission import Admission
from umbp.serving import PREAUTH_MAX_META, FramedProtocol

from closedpool import make_certs


class Echo(FramedProtocol):
    component = "echo"

    def __init__(self, admission: Admission, conns: set, tls: ssl.SSLContext | None):
        self.admission, self.conns, self.tls = admission, conns, tls
        self.reader = wire.FrameReader("echo", buffer_data=1 << 20)

    def handle(self, frame, err) -> None:
        if frame.op == wire.Op.AUTH:
            self.authenticated_now()
        meta = {"meta_len": len(frame.meta) if isinstance(frame.meta, (bytes, str, list)) else 0,
                "data_len": frame.data_len}
        self.transport.write(wire.encode(frame.op, frame.request_id, meta, flags=wire.Flag.RESPONSE))

    def unframeable(self, e) -> None:
        self.transport.write(wire.encode_error(0, 0, wire.Status.BAD_FRAME, str(e)))
        self.transport.close()

    def connection_made(self, transport) -> None:
        self.admit(transport)

    def connection_lost(self, exc) -> None:
        self.release()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    made = make_certs(tmp_path_factory.mktemp("tls"))
    if made is None:
        pytest.skip("no `openssl` command to make the test certificates with")
    return made


def run(loop_kind: str, coro) -> None:
    if loop_kind == "uvloop":
        uvloop.run(coro)
    else:
        asyncio.run(coro)


async def serve(tls: ssl.SSLContext | None, preauth: int = 4, auth_timeout_s: float = 30.0, closed: bool = True,
                max_connections: int = 16):
    admission = Admission("echo", closed, max_connections=max_connections, preauth=preauth,
                          auth_timeout_s=auth_timeout_s, per_source=preauth)
    conns: set = set()
    server = await asyncio.get_running_loop().create_server(lambda: Echo(admission, conns, tls), "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], admission


async def answer(reader: asyncio.StreamReader) -> wire.Frame:
    head = await asyncio.wait_for(reader.readexactly(wire.HEADER_SIZE), 5)
    _op, _flags, _status, _rid, meta_len, data_len = wire.decode_header(head, "test")
    body = await asyncio.wait_for(reader.readexactly(meta_len + data_len), 5)
    frames = wire.FrameReader("test")
    buf = frames.get_buffer()
    buf[:len(head) + len(body)] = head + body
    return frames.buffer_updated(len(head) + len(body))[0][0]


async def closed_by_server(reader: asyncio.StreamReader, within: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), within) == b""
    except (ConnectionResetError, ssl.SSLError):
        return True
    except asyncio.TimeoutError:
        return False


async def until(cond, within: float = 5.0) -> None:
    for _ in range(int(within / 0.01)):  # bounded poll of server state the test cannot be told about
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_tls_handshakes_count_from_the_accept_and_die_with_the_deadline(certs, loop_kind):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(certs["cert"], certs["key"])
    client_ctx = ssl.create_default_context(cafile=certs["ca"])

    async def main():
        server, port, admission = await serve(ctx, preauth=4, auth_timeout_s=1.0)
        loop = asyncio.get_running_loop()
        # a silent socket: admitted (counted) at the accept, before any handshake byte
        silent_r, silent_w = await asyncio.open_connection("127.0.0.1", port)
        await until(lambda: len(admission.preauth) == 1)
        # a TLS client is served, its first request in the flight right after the handshake
        r, w = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx)
        w.write(wire.encode(wire.Op.PING, 7, {}))
        f = await answer(r)
        assert (f.op, f.request_id, f.status) == (wire.Op.PING, 7, wire.Status.OK)
        w.write(wire.encode(wire.Op.AUTH, 8, {}))
        assert (await answer(r)).request_id == 8 and len(admission.authed) == 1
        # the silent one is closed 1 s after its accept: the deadline counts the handshake it never began
        t0 = loop.time()
        assert await closed_by_server(silent_r, 3.0)
        assert loop.time() - t0 < 1.5
        await until(lambda: not admission.preauth)
        # handshakes that never finish are evicted by newer ones: 12 silent sockets, at most 4 held
        socks = [await asyncio.open_connection("127.0.0.1", port) for _ in range(12)]
        await until(lambda: admission.evictions >= 8)
        assert len(admission.preauth) == 4
        assert [await closed_by_server(sr, 1.0) for sr, _ in socks[:8]] == [True] * 8
        # and a TLS client still gets in while they are held
        r2, w2 = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx)
        w2.write(wire.encode(wire.Op.PING, 9, {}))
        assert (await answer(r2)).status == wire.Status.OK
        for writer in [silent_w, w, w2, *(sw for _, sw in socks)]:
            writer.close()
        server.close()

    run(loop_kind, main())


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_preauth_frames_are_small_and_carry_no_data(loop_kind):
    big = PREAUTH_MAX_META + 1

    async def main():
        server, port, _admission = await serve(None)
        for meta_len, data_len in ((big, 0), (0, 1), (16 << 20, 0)):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.Op.PING, 0, 0, 1, meta_len, data_len))
            f = await answer(r)
            assert f.request_id == 0 and f.status == wire.Status.AUTH
            assert f.meta["error"].startswith("echo: authentication required (HELLO, then AUTH) before a frame with "
                                              f"data or more than {PREAUTH_MAX_META} bytes of meta")
            assert await closed_by_server(r, 2.0)
            w.close()
        # after AUTH the reader's own limits: a big meta and data are taken
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(wire.encode(wire.Op.AUTH, 1, {}))
        await answer(r)
        w.write(wire.encode(wire.Op.PING, 2, b"m" * (1 << 20), data_len=4096) + b"d" * 4096)
        f = await answer(r)
        assert f.request_id == 2 and f.meta["data_len"] == 4096 and f.meta["meta_len"] == 1 << 20
        w.close()
        server.close()

    run(loop_kind, main())


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_memory_of_closed_preauth_connections_is_given_back(monkeypatch, loop_kind):
    """Connections that closed before authenticating (a flood's) add up their buffers; past TRIM_AFTER bytes the
    C heap is trimmed once, TRIM_DELAY_S later, however many more close meanwhile."""
    import umbp.serving as serving

    trims: list[float] = []
    monkeypatch.setattr(serving, "TRIM_AFTER", 1 << 20)  # 16 closed connections' 64 KiB staging buffers
    monkeypatch.setattr(serving, "TRIM_DELAY_S", 0.2)
    monkeypatch.setattr(serving, "trim_malloc", lambda: trims.append(asyncio.get_running_loop().time()) or True)
    monkeypatch.setattr(serving._Trim, "freed", 0)
    monkeypatch.setattr(serving._Trim, "handle", None)

    async def main():
        server, port, admission = await serve(None, preauth=64)
        loop = asyncio.get_running_loop()
        for batch in range(2):
            conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(24)]
            await until(lambda: len(admission.preauth) == 24)
            t0 = loop.time()
            for _, w in conns:
                w.close()
            await until(lambda: len(trims) == batch + 1)
            assert trims[-1] - t0 >= 0.15  # once, after the delay, for the 24 that closed
            await asyncio.sleep(0.3)
            assert len(trims) == batch + 1
        server.close()

    run(loop_kind, main())


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_refused_connections_linger_at_most_max_lingering(loop_kind):
    """An open pool at max_connections: refused connections wait REFUSED_LINGER_S to answer their first request,
    at most MAX_LINGERING of them; the rest are closed at once (a flood of refusals holds no descriptors)."""
    from umbp.admission import MAX_LINGERING

    async def main():
        server, port, admission = await serve(None, closed=False, max_connections=1)
        first = await asyncio.open_connection("127.0.0.1", port)
        refused = [await asyncio.open_connection("127.0.0.1", port) for _ in range(MAX_LINGERING + 16)]
        await until(lambda: admission.lingering == MAX_LINGERING)
        cut = await asyncio.gather(*(closed_by_server(r, 0.3) for r, _ in refused[1:]))  # well inside the linger
        assert cut.count(True) == 16 and not any(cut[:MAX_LINGERING - 1])  # the 16 past the cap, at once
        r, w = refused[0]
        w.write(wire.encode(wire.Op.PING, 5, {}))
        f = await answer(r)
        assert (f.request_id, f.status) == (5, wire.Status.UNAVAILABLE)
        assert f.meta["error"].startswith("echo: too many connections (max_connections 1 reached)")
        await until(lambda: admission.lingering == 0, within=3.0)  # the others close after the linger
        for _, w in [first, *refused]:
            w.close()
        server.close()

    run(loop_kind, main())
