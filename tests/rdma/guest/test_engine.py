"""Engine-level tests of transport/rdma.py against real verbs (Soft-RoCE), run inside the guest.

A server process registers an arena and serves its queue-pair details over TCP on 127.0.0.1; this process is the
client. Every data check compares sha256 of bytes on both sides (the server hashes its own arena), and fault tests
check that a failure is reported with its ibv status and that no request is reported good with wrong bytes.

Module arena layout (24 MiB, filled with pattern(SEED)): [0, 8 MiB) scratch for writes; [8, 16 MiB) the two
concurrent clients' slices; [16, 24 MiB) never written, for ranged reads against the pattern.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import msgpack
import pytest
from rdma_helpers import Conn, Server, pattern, sha

from transport.rdma import (
    CLIENT_ACCESS,
    FLUSHED,
    TIMED_OUT,
    RcEndpoint,
    RdmaContext,
    rdma_available,
)
from umbp.errors import DeadlineExceeded, TransportError

MiB = 1 << 20
KiB = 1 << 10
SEED = 7
ARENA = 24 * MiB
PRISTINE = 16 * MiB


@pytest.fixture(scope="module")
def ctx():
    c = RdmaContext()
    yield c
    c.close()


@pytest.fixture(scope="module")
def server():
    with Server(ARENA, SEED) as s:
        yield s


@pytest.fixture()
def conn(ctx, server):
    c = Conn(ctx, server.port)
    yield c
    c.close()


@pytest.fixture(scope="module")
def bufs(ctx):
    src = ctx.alloc(8 * MiB, CLIENT_ACCESS)
    dst = ctx.alloc(8 * MiB, CLIENT_ACCESS)
    yield src, dst
    ctx.deregister(src)
    ctx.deregister(dst)


def deadline(s: float = 60) -> float:
    return time.monotonic() + s


def test_device_and_gid(ctx):
    ok, why = rdma_available()
    assert ok, why
    # rxe on lo: GID 0 is link-local (cannot route), the engine must pick ::ffff:127.0.0.1
    assert ctx.gid.endswith("ffff:7f00:0001"), (ctx.gid_index, ctx.gid)


def test_local_info_is_msgpackable(ctx):
    ep = RcEndpoint(ctx)
    info = ep.local_info()
    assert msgpack.unpackb(msgpack.packb(info, use_bin_type=True), raw=False) == info
    assert set(info) >= {"qpn", "psn", "gid", "lid", "mtu", "gid_index"}
    assert 0 <= info["psn"] < 1 << 24 and info["mtu"] == 5  # 4096-byte path MTU on rxe/lo
    ep.close()


@pytest.mark.parametrize("size", [4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB])
def test_round_trip_sizes(conn, bufs, size):
    src, dst = bufs
    rnd = random.Random(size)
    roff, loff = rnd.randrange(0, 4 * MiB) & ~7, rnd.randrange(0, 4 * MiB)  # unaligned local offsets too
    data = rnd.randbytes(size)
    src.view[loff:loff + size] = data
    mr = conn.mr
    assert conn.ep.transfer("write", [(src, loff, size, mr["addr"] + roff, mr["rkey"])], deadline()) == size
    assert conn.remote_sha(roff, size) == sha(data)
    dst.view[loff:loff + size] = bytes(size)
    conn.ep.transfer("read", [(dst, loff, size, mr["addr"] + roff, mr["rkey"])], deadline())
    assert sha(dst.view[loff:loff + size]) == sha(data)


def test_batch_of_64_scattered(conn, bufs):
    src, dst = bufs
    mr, n, size = conn.mr, 64, 16 * KiB
    slots = list(range(n))
    random.Random(1).shuffle(slots)
    roffs = [s * 48 * KiB for s in slots]  # gaps between ranges: no coalescing, 64 WRs
    src.view[:n * size] = random.Random(2).randbytes(n * size)
    before = dict(conn.ep.stats)
    conn.ep.transfer("write", [(src, i * size, size, mr["addr"] + roffs[i], mr["rkey"]) for i in range(n)],
                     deadline())
    assert conn.ep.stats["wrs"] - before["wrs"] == 64
    assert conn.ep.stats["doorbells"] - before["doorbells"] == 1  # one linked list, one post_send
    for i in (0, 17, 63):
        assert conn.remote_sha(roffs[i], size) == sha(src.view[i * size:(i + 1) * size])
    dst.view[:n * size] = bytes(n * size)
    # read back in reverse order into a different layout
    conn.ep.transfer("read", [(dst, (n - 1 - i) * size, size, mr["addr"] + roffs[i], mr["rkey"]) for i in range(n)],
                     deadline())
    for i in range(n):
        assert dst.view[(n - 1 - i) * size:(n - i) * size] == src.view[i * size:(i + 1) * size], i


def test_batch_adjacent_coalesces_into_sg_lists(conn, bufs):
    src, dst = bufs
    mr, n, size = conn.mr, 64, 4 * KiB
    src.view[:n * size] = random.Random(3).randbytes(n * size)
    before = dict(conn.ep.stats)
    # remote contiguous, local scattered (every other 4 KiB): 64 requests -> ceil(64 / max_sge) WRs
    conn.ep.transfer("write", [(src, 2 * i * size, size, mr["addr"] + i * size, mr["rkey"]) for i in range(n // 2)]
                     + [(src, (2 * i + 1) * size, size, mr["addr"] + (n // 2 + i) * size, mr["rkey"])
                        for i in range(n // 2)], deadline())
    wrs = conn.ep.stats["wrs"] - before["wrs"]
    assert wrs == -(-n // conn.ep.max_sge), wrs
    want = b"".join(bytes(src.view[2 * i * size:(2 * i + 1) * size]) for i in range(n // 2)) + \
        b"".join(bytes(src.view[(2 * i + 1) * size:(2 * i + 2) * size]) for i in range(n // 2))
    assert conn.remote_sha(0, n * size) == sha(want)
    conn.ep.transfer("read", [(dst, 0, n * size, mr["addr"], mr["rkey"])], deadline())
    assert sha(dst.view[:n * size]) == sha(want)


def test_ranged_reads_match_pattern(conn, bufs):
    _, dst = bufs
    mr = conn.mr
    expect = pattern(SEED, ARENA)
    rnd = random.Random(4)
    ranges = [(PRISTINE + rnd.randrange(0, 7 * MiB), rnd.choice([1, 7, 4096, 4097, 65536, 300_001]))
              for _ in range(64)]
    out, reqs = 0, []
    for off, length in ranges:
        reqs.append((dst, out, length, mr["addr"] + off, mr["rkey"]))
        out += length
    conn.ep.transfer("read", reqs, deadline())
    out = 0
    for off, length in ranges:
        assert dst.view[out:out + length] == expect[off:off + length], (off, length)
        out += length


def test_scatter_gather_request(conn, bufs):
    _, dst = bufs
    mr = conn.mr
    expect = pattern(SEED, ARENA)[PRISTINE:PRISTINE + 96 * KiB]
    segs = [(dst, 100, 10 * KiB), (dst, 1 * MiB + 3, 50 * KiB), (dst, 5 * MiB, 36 * KiB)]
    conn.ep.transfer("read", [(segs, mr["addr"] + PRISTINE, mr["rkey"])], deadline())
    got = b"".join(bytes(dst.view[o:o + n]) for _, o, n in segs)
    assert got == expect


def test_bad_local_range_is_rejected_before_posting(conn, bufs):
    src, _ = bufs
    with pytest.raises(TransportError, match="transport rdma: local range"):
        conn.ep.post_reads([(src, src.length - 10, 4096, conn.mr["addr"], conn.mr["rkey"])])
    assert conn.ep.broken is None
    conn.ep.transfer("read", [(src, 0, 4096, conn.mr["addr"], conn.mr["rkey"])], deadline())


def test_revoked_rkey_is_a_clear_error(ctx, bufs):
    _, dst = bufs
    with Server(1 * MiB, seed=11) as srv:
        c = Conn(ctx, srv.port)
        old = c.mr
        c.ep.transfer("read", [(dst, 0, 64 * KiB, old["addr"], old["rkey"])], deadline())
        assert c.call(op="dereg") == {}
        with pytest.raises(TransportError, match="IBV_WC_REM_ACCESS_ERR"):
            c.ep.transfer("read", [(dst, 0, 64 * KiB, old["addr"], old["rkey"])], deadline())
        assert c.ep.broken and "REM_ACCESS_ERR" in c.ep.broken
        with pytest.raises(TransportError, match="broken"):
            c.ep.post_reads([(dst, 0, 4096, old["addr"], old["rkey"])])
        # recover: new QP on both sides, new registration
        c.ep.reset()
        c.connect()
        new = c.call(op="rereg")["mr"]
        dst.view[:64 * KiB] = bytes(64 * KiB)
        c.ep.transfer("read", [(dst, 0, 64 * KiB, new["addr"], new["rkey"])], deadline())
        assert dst.view[:64 * KiB] == pattern(11, 1 * MiB)[:64 * KiB]
        if new["rkey"] != old["rkey"]:  # rxe may hand the same key index back with a new key byte
            with pytest.raises(TransportError, match="IBV_WC_REM_ACCESS_ERR"):
                c.ep.transfer("read", [(dst, 0, 4096, old["addr"], old["rkey"])], deadline())
        c.close()


def test_server_killed_mid_transfer(ctx):
    size, chunk, rounds = 16 * MiB, 256 * KiB, 8  # 128 MiB of reads: seconds under TCG
    dst = ctx.alloc(size, CLIENT_ACCESS)
    srv = Server(size, seed=13)
    try:
        # A small window: under TCG rxe does most of a doorbell's work inside post_send and its softirqs, so the
        # kill must land between small doorbells (8 x 256 KiB here).
        c = Conn(ctx, srv.port, depth=8)
        mr = c.mr
        # descending offsets: no two requests coalesce, one 256 KiB WR each
        reqs = [(dst, o, chunk, mr["addr"] + o, mr["rkey"]) for _ in range(rounds)
                for o in range(size - chunk, -1, -chunk)]
        ids = c.ep.post_reads(reqs)
        results: dict[int, str | None] = {}
        while not results:
            results.update(c.ep.poll(deadline(30)))
        srv.kill()
        t_kill = time.monotonic()
        end = deadline(60)
        while len(results) < len(ids) and time.monotonic() < end:
            results.update(c.ep.poll(end))
        detect_s = time.monotonic() - t_kill
        assert len(results) == len(ids), "every request must be reported"
        failed = {rid: st for rid, st in results.items() if st is not None}
        good = [rid for rid, st in results.items() if st is None]
        assert failed, f"server killed but all {len(ids)} reads succeeded (too fast?)"
        first = min(failed)
        assert failed[first] in ("IBV_WC_RETRY_EXC_ERR", "IBV_WC_RESP_TIMEOUT_ERR", "IBV_WC_REM_OP_ERR"), failed[first]
        assert all(st == FLUSHED for rid, st in failed.items() if rid != first)
        assert all(rid < first for rid in good), "nothing after the failure may be reported good"
        # every read reported good holds the right bytes
        expect = pattern(13, size)
        for rid in good:
            _, off, n, _, _ = reqs[ids.index(rid)]
            assert dst.view[off:off + n] == expect[off:off + n]
        assert c.ep.broken
        with pytest.raises(TransportError, match="transport rdma: .*broken"):
            c.ep.transfer("read", reqs[:1], deadline())
        # a figure, not an assert: the bounded wait above (every request reported within 60 s) is the contract
        print(f"\nkill test: {len(good)} good, {len(failed)} failed, detected in {detect_s:.1f} s ({failed[first]})")
        c.ep.close()
        c.sock.close()
    finally:
        srv.kill()
        ctx.deregister(dst)


def test_deadline_aborts_and_reset_recovers(conn, bufs):
    _, dst = bufs
    mr = conn.mr
    reqs = [(dst, 0, 1 * MiB, mr["addr"] + (i % 8) * MiB, mr["rkey"]) for i in range(256)]  # 256 MiB
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="transport rdma: read of 256 requests"):
        conn.ep.transfer("read", reqs, time.monotonic() + 0.3)
    assert time.monotonic() - t0 < 5
    assert conn.ep.broken
    conn.ep.reset()
    conn.connect()
    expect = pattern(SEED, ARENA)[PRISTINE:PRISTINE + 64 * KiB]
    conn.ep.transfer("read", [(dst, 0, 64 * KiB, mr["addr"] + PRISTINE, mr["rkey"])], deadline())
    assert dst.view[:64 * KiB] == expect
    assert TIMED_OUT == "UMBP_DEADLINE"


def test_two_concurrent_clients(server):
    helper = os.path.join(os.path.dirname(__file__), "rdma_helpers.py")
    procs = [subprocess.Popen([sys.executable, helper, "client", "--port", str(server.port), "--slice", str(s),
                               "--slice-size", str(4 * MiB), "--rounds", "3"], stdout=subprocess.PIPE, text=True)
             for s in (2, 3)]  # arena [8, 16 MiB)
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
        rep = json.loads(out.strip().splitlines()[-1])
        assert rep["ok"] and rep["rounds"] == 3 and rep["stats"]["requests"] == 3 * 2 * 64


def test_many_small_requests_bounded_window(conn, bufs):
    """More requests than the window (depth): they queue and drain without overrunning the send queue."""
    src, dst = bufs
    mr = conn.mr
    n, size = 3 * conn.ep.depth + 5, 4 * KiB
    src.view[:n * 2 * size] = random.Random(5).randbytes(n * 2 * size)
    reqs = [(src, 2 * i * size, size, mr["addr"] + 2 * i * size, mr["rkey"]) for i in range(n)]  # gaps: 1 WR each
    conn.ep.transfer("write", reqs, deadline())
    conn.ep.transfer("read", [(dst, 2 * i * size, size, mr["addr"] + 2 * i * size, mr["rkey"]) for i in range(n)],
                     deadline())
    for i in range(0, n, 7):
        assert dst.view[2 * i * size:(2 * i + 1) * size] == src.view[2 * i * size:(2 * i + 1) * size]
    assert conn.ep.pending() == 0


def test_read_only_buffer_as_write_source(ctx, conn):
    data = random.Random(6).randbytes(200 * KiB)  # bytes: registered in place, no copy
    ro = ctx.register(data, 0)
    try:
        with pytest.raises(TransportError, match="read-only"):
            ctx.register(data, CLIENT_ACCESS)
        conn.ep.transfer("write", [(ro, 0, len(data), conn.mr["addr"] + 5 * MiB, conn.mr["rkey"])], deadline())
        assert conn.remote_sha(5 * MiB, len(data)) == sha(data)
    finally:
        ctx.deregister(ro)


def test_post_and_poll_report_every_request_once(conn, bufs):
    """The low-level API: several post_* calls in flight, poll() reports each request id exactly once."""
    src, dst = bufs
    mr = conn.mr
    src.view[:1 * MiB] = random.Random(8).randbytes(1 * MiB)
    w = conn.ep.post_writes([(src, i * 64 * KiB, 64 * KiB, mr["addr"] + 6 * MiB + i * 64 * KiB, mr["rkey"])
                             for i in range(16)])
    # reads of the pristine area in the same window, reversed so they do not coalesce
    r = conn.ep.post_reads([(dst, i * 4 * KiB, 4 * KiB, mr["addr"] + PRISTINE + i * 4 * KiB, mr["rkey"])
                            for i in reversed(range(100))])
    # a transfer in the middle keeps the others' results for poll
    conn.ep.transfer("read", [(dst, 2 * MiB, 4 * KiB, mr["addr"] + PRISTINE, mr["rkey"])], deadline())
    seen: dict[int, str | None] = {}
    end = deadline(60)
    while len(seen) < len(w) + len(r):
        for rid, st in conn.ep.poll(end):
            assert rid not in seen
            seen[rid] = st
        assert time.monotonic() < end
    assert sorted(seen) == sorted(w + r) and all(st is None for st in seen.values())
    assert conn.remote_sha(6 * MiB, 1 * MiB) == sha(src.view[:1 * MiB])
    assert dst.view[:400 * KiB] == pattern(SEED, ARENA)[PRISTINE:PRISTINE + 400 * KiB]
