"""Server-side TLS whose bulk encryption runs off the event loop (issue 45): the storage node's TLS connections.

The event loop's own TLS protocol (uvloop's ``SSLProtocol``) encrypts every connection's answers on the loop's one
thread, through a memory BIO: about 0.7 s/GB of node CPU, so every TLS stream of every client shared one core. Here a
connection runs its TLS session in ``ssl.SSLObject`` over two memory BIOs (``TlsConn``), driven by the loop for the
handshake, the requests (small: decrypted on the loop, straight into the protocol's buffers) and small answers; an
answer of ``THREAD_BYTES`` or more (a READV or READV_DISK of big pages) is encrypted and written by a worker thread
(``ssl`` releases the GIL in ``SSL_write``; the worker writes the records to a duplicate of the socket's descriptor,
the GIL released in each syscall), so the streams of one batch, and of several clients, encrypt on several cores.

Invariants:
- one thread at a time uses a connection's TLS session: while a worker holds it (``busy``) the loop neither
  decrypts nor encrypts for that connection: ciphertext that arrives meanwhile is kept (past ``RX_PAUSE`` bytes the
  socket is not read) and fed to the session when the worker is done; answers written meanwhile queue behind;
- bytes leave in the order they were written: a worker starts only when the loop's transport holds no unsent bytes,
  and the loop writes nothing to the socket while a worker does;
- a worker never waits on a slow peer: when the socket takes nothing for ``STALL_S`` it hands the ciphertext it has
  back to the loop (which buffers it in its transport) and the rest of the answer waits, still queued, until the
  transport has drained; so a stalled peer holds no thread and other connections keep being served;
- the duplicate descriptor keeps the socket alive while a worker writes to it (a close on the loop meanwhile cannot
  hand the number to another connection); it is closed once the connection is lost and no worker holds it.

Costs: per big answer a thread-pool hand-off and a loop callback (tens of us), one ``MemoryBIO.read`` copy of its
ciphertext (with the GIL: about a tenth of the encryption's time), one write syscall per ``CHUNK``; pieces under
``SMALL`` bytes are joined before encryption (one record, not one each). Small answers cost what the event loop's
TLS protocol cost. The app sees the asyncio transport methods the node uses: write, writelines, close, abort,
is_closing, pause_reading, resume_reading, get_extra_info, set_write_buffer_limits, get_write_buffer_size.
"""

from __future__ import annotations

import asyncio
import os
import select
import ssl
from concurrent.futures import ThreadPoolExecutor

THREAD_BYTES = 256 << 10  # an answer (the writes one flush queued) this large is encrypted on a worker
CHUNK = 256 << 10  # plaintext a worker encrypts before it writes the ciphertext
SMALL = 16 << 10  # pieces below this are joined into one TLS record (a 16 KiB record at most)
STALL_S = 0.05  # a worker waits this long for the socket to take bytes, then hands them to the loop
RX_PAUSE = 1 << 20  # ciphertext kept while a worker holds the session: past this the socket is not read
WORKERS = max(2, min(32, os.cpu_count() or 2))
_POOL: list = []  # the workers (one pool for every connection), made on first use


def _pool() -> ThreadPoolExecutor:
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="umbp-tls-send"))
    return _POOL[0]


def start(app: asyncio.BaseProtocol, raw: asyncio.Transport, ctx: ssl.SSLContext, timeout_s: float,
          waiter: asyncio.Future) -> "TlsConn":
    """Run the server side of a TLS handshake on ``raw`` (an accepted TCP transport) for ``app``: ``waiter`` gets
    None once it is done (``app.connection_made`` with the TLS transport came first), or the error when it failed,
    timed out after ``timeout_s`` or the connection went (then ``app`` hears nothing more)."""
    conn = TlsConn(app, ctx, timeout_s, waiter)
    raw.set_protocol(conn)
    conn.connection_made(raw)
    return conn


class _Job:
    """A big answer's plaintext pieces (each at most CHUNK bytes) and how far a worker got."""

    __slots__ = ("pieces", "i", "left", "remaining", "error")

    def __init__(self, pieces: list, nbytes: int):
        self.pieces = pieces
        self.i = 0  # the next piece to encrypt
        self.left = None  # ciphertext the socket did not take (a stall): the loop writes it
        self.remaining = nbytes  # plaintext not yet encrypted (``get_write_buffer_size``)
        self.error: BaseException | None = None


def _pieces(bufs, out: list) -> int:
    """Append ``bufs`` to ``out`` as encryption pieces: runs of small ones joined (up to SMALL), big ones cut into
    CHUNK slices (views: no copy). Returns their bytes."""
    total, run, run_n = 0, [], 0
    for b in bufs:
        n = b.nbytes if type(b) is memoryview else len(b)
        total += n
        if n < SMALL:
            run.append(b)
            run_n += n
            if run_n >= SMALL:
                out.append(b"".join(run))
                run, run_n = [], 0
            continue
        if run:
            out.append(b"".join(run))
            run, run_n = [], 0
        if n <= CHUNK:
            out.append(b)
        else:
            mv = memoryview(b).cast("B")
            out.extend(mv[i:i + CHUNK] for i in range(0, n, CHUNK))
    if run:
        out.append(b"".join(run) if len(run) > 1 else run[0])
    return total


def _send(fd: int, data: bytes, poller) -> memoryview | None:
    """Write ``data`` to the non-blocking socket ``fd``; the part not taken when the socket stays full for STALL_S
    (None when all went). OSError when the connection fails."""
    mv = memoryview(data)
    while mv:
        try:
            n = os.write(fd, mv)
        except BlockingIOError:
            if not poller.poll(STALL_S * 1000):
                return mv
            continue
        mv = mv[n:]
    return None


class TlsConn(asyncio.Protocol):
    """One TLS connection: the protocol of the raw TCP transport and the transport ``app`` sees (see the module
    docstring). Loop-thread only, but for ``_work`` (a worker, while ``busy``)."""

    def __init__(self, app, ctx: ssl.SSLContext, timeout_s: float, waiter: asyncio.Future):
        self.app = app
        self.loop = asyncio.get_running_loop()
        self.inc, self.out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.ssl = ctx.wrap_bio(self.inc, self.out, server_side=True)
        self.timeout_s = timeout_s
        self.waiter = waiter
        self.raw: asyncio.Transport | None = None
        self.handshaking = True
        self.fd = -1  # the duplicate descriptor workers write to (once the handshake is done)
        self.queue: list = []  # answers written and not yet encrypted (behind ``job``)
        self.qbytes = 0
        self.job: _Job | None = None  # a big answer on a worker (``busy``) or waiting for the socket to drain
        self.busy = False
        self.rx: list = []  # ciphertext that arrived while busy
        self.rx_bytes = 0
        self.raw_full = False  # the raw transport holds unsent bytes (pause_writing)
        self.app_paused = False  # the app paused reading
        self.app_full = False  # the app was told to pause writing
        self.high, self.low = 64 << 10, 16 << 10
        self.closing = False  # close asked: after what is queued
        self.closed = False  # the raw connection is gone
        self.timer: asyncio.TimerHandle | None = None

    # ---- the raw TCP transport's protocol --------------------------------------------------------------------

    def connection_made(self, raw: asyncio.Transport) -> None:
        self.raw = raw
        raw.set_write_buffer_limits(high=0)  # pause_writing / resume_writing tell when it holds unsent bytes
        self.timer = self.loop.call_later(self.timeout_s, self._expired)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        if self.busy:
            self.rx.append(data)
            self.rx_bytes += len(data)
            self._reading()
            return
        self.inc.write(data)
        if self.handshaking:
            self._handshake()
        else:
            self._read()

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost follows

    def pause_writing(self) -> None:
        self.raw_full = True

    def resume_writing(self) -> None:
        self.raw_full = False
        self._pump()
        self._app_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.closed:
            return
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
        if not self.busy:
            self._close_fd()
        self.queue, self.qbytes = [], 0
        if self.handshaking:
            self.handshaking = False
            if not self.waiter.done():
                self.waiter.set_exception(exc or ConnectionResetError("connection lost during the TLS handshake"))
            return
        self.app.connection_lost(exc)

    # ---- handshake and requests (the loop) -------------------------------------------------------------------

    def _handshake(self) -> None:
        try:
            self.ssl.do_handshake()
        except ssl.SSLWantReadError:
            self._flush_out()
            return
        except (ssl.SSLError, OSError) as e:
            self._flush_out()
            self.handshaking = False
            if not self.waiter.done():
                self.waiter.set_exception(e)
            self.raw.abort()
            return
        self._flush_out()
        self.handshaking = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        sock = self.raw.get_extra_info("socket")
        try:
            self.fd = os.dup(sock.fileno()) if sock is not None else -1
        except OSError:
            self.fd = -1  # no workers for this connection: everything is encrypted on the loop
        self.app.connection_made(self)
        if not self.waiter.done():
            self.waiter.set_result(None)
        self._read()  # requests that came with the handshake's last flight

    def _expired(self) -> None:
        self.timer = None
        if self.handshaking and not self.closed:
            self.raw.abort()

    def _read(self) -> None:
        """Decrypt what arrived into the app's buffers while no worker holds the session and the app reads."""
        sslobj, app = self.ssl, self.app
        while not (self.busy or self.app_paused or self.closed):
            buf = app.get_buffer(-1)
            size, n, more = len(buf), 0, True
            if not size:
                break  # nothing to read into (a reader never asks for it; bounded all the same)
            try:
                while n < size:
                    k = sslobj.read(size - n, buf[n:])
                    if not k:  # the peer's close_notify
                        more = False
                        self.raw.close()
                        break
                    n += k
            except ssl.SSLWantReadError:
                more = False
            except (ssl.SSLError, OSError):
                self.raw.abort()
                return
            if n:
                app.buffer_updated(n)
            if not more:
                break
        if not self.busy and not self.closed:
            self._flush_out()  # what reading produced (a TLS 1.3 key update's answer)

    def _reading(self) -> None:
        """The raw transport reads while the app wants requests and not too much ciphertext is kept."""
        if self.closed or self.raw.is_closing():
            return
        want = not self.app_paused and self.rx_bytes <= RX_PAUSE
        if want != self.raw.is_reading():
            (self.raw.resume_reading if want else self.raw.pause_reading)()

    def _flush_out(self) -> None:
        data = self.out.read()
        if data and not self.closed:
            self.raw.write(data)

    # ---- answers ---------------------------------------------------------------------------------------------

    def write(self, data) -> None:
        self.writelines((data,))

    def writelines(self, bufs) -> None:
        if self.closed or self.closing:
            return
        self.qbytes += _pieces(bufs, self.queue)
        self._pump()
        if not self.app_full and self.get_write_buffer_size() > self.high:
            self.app_full = True
            self.app.pause_writing()

    def _pump(self) -> None:
        """Move queued answers on: a big one to a worker (once the socket holds nothing unsent), small ones
        encrypted here."""
        if self.busy or self.handshaking or self.closed:
            return
        if self.job is None and self.queue:
            if self.qbytes >= THREAD_BYTES and self.fd >= 0:
                self.job = _Job(self.queue, self.qbytes)
            else:
                write, sslobj = self.raw.write, self.ssl
                try:
                    for p in self.queue:
                        sslobj.write(p)
                except ssl.SSLError:
                    self.raw.abort()
                    return
                write(self.out.read())
            self.queue, self.qbytes = [], 0
        if self.job is not None:
            if self.raw_full or self.raw.get_write_buffer_size():
                return  # resume_writing pumps again
            self.busy = True
            self._reading()
            _pool().submit(self._work, self.job)
        elif self.closing:
            self._shutdown()

    def _work(self, job: _Job) -> None:
        """A worker: encrypt the job's pieces and write them, until done or the socket stalls."""
        sslobj, out, fd, pieces = self.ssl, self.out, self.fd, job.pieces
        try:
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
            i, n = job.i, len(pieces)
            while i < n and not self.closed:
                p = pieces[i]
                sslobj.write(p)
                job.remaining -= p.nbytes if type(p) is memoryview else len(p)
                i += 1
                if out.pending >= CHUNK or i == n:
                    job.left = _send(fd, out.read(), poller)
                    if job.left is not None:
                        break
            job.i = i
        except Exception as e:  # noqa: BLE001  (any failure ends the connection, never the worker's hand-back)
            job.error = e
        try:
            self.loop.call_soon_threadsafe(self._worked, job)
        except RuntimeError:  # the loop closed (the node is stopping): nothing waits for this job
            pass

    def _worked(self, job: _Job) -> None:
        self.busy = False
        if self.closed:
            self._close_fd()
            return
        if job.error is not None:
            self.raw.abort()
            return
        if job.left is not None:
            self.raw.write(job.left)  # the loop's transport keeps it until the peer reads
            job.left = None
        if job.i >= len(job.pieces):
            self.job = None
        for data in self.rx:
            self.inc.write(data)
        self.rx, self.rx_bytes = [], 0
        self._reading()
        self._pump()
        self._app_writing()
        self._read()

    def _app_writing(self) -> None:
        if self.app_full and self.get_write_buffer_size() <= self.low and not self.closed:
            self.app_full = False
            self.app.resume_writing()

    def _shutdown(self) -> None:
        try:
            self.ssl.unwrap()  # queues our close_notify; the peer's is not waited for
        except (ssl.SSLError, OSError, ValueError):
            pass
        self._flush_out()
        self.raw.close()

    def _close_fd(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # ---- the transport the app sees --------------------------------------------------------------------------

    def close(self) -> None:
        if self.closing or self.closed:
            return
        self.closing = True
        if not (self.busy or self.job is not None or self.queue):
            self._shutdown()

    def abort(self) -> None:
        self.closing = True
        if not self.closed:
            self.raw.abort()  # a worker still writing stops at its next piece (``closed``)

    def is_closing(self) -> bool:
        return self.closing or self.closed

    def pause_reading(self) -> None:
        self.app_paused = True
        self._reading()

    def resume_reading(self) -> None:
        if self.app_paused:
            self.app_paused = False
            self._reading()
            self.loop.call_soon(self._read)  # requests already decrypted or buffered in the session

    def is_reading(self) -> bool:
        return not self.app_paused

    def get_extra_info(self, name: str, default=None):
        if name == "ssl_object":
            return self.ssl
        if name == "peercert":
            return self.ssl.getpeercert()
        if name == "cipher":
            return self.ssl.cipher()
        return self.raw.get_extra_info(name, default)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self.high = 64 << 10 if high is None else high
        self.low = self.high // 4 if low is None else low

    def get_write_buffer_size(self) -> int:
        """Plaintext not yet encrypted plus ciphertext the loop's transport holds."""
        job = self.job
        return (self.qbytes + (job.remaining if job is not None else 0)
                + (self.raw.get_write_buffer_size() if self.raw is not None and not self.closed else 0))

    def get_protocol(self):
        return self.app

    def can_write_eof(self) -> bool:
        return False
