"""Get-path benchmark (issue 45): ``batch_get_into`` of 64-page batches beside same-run baselines.

For each page size (16 KiB, 64 KiB, 1 MiB by default) and transport (shm, tcp) a working set of pages is put into a
one-node pool, then read back in rotating 64-page batches into two kinds of outs: one 2-D numpy array (a row a page)
and a list of CPU torch tensors. Baselines, measured in the same run right before their figures (the machine's load
drifts): shm against one big memcpy of the batch (``np.copyto`` of 64 rows at once) and the per-page memcpy (one
``np.copyto`` a page), both over a working set of the same size; tcp against one raw loopback TCP stream
(``bench/pool.py``'s sender process, ``recv_into`` a preallocated buffer). Each figure is the best window of
``WINDOW_S`` of consecutive batches (``bench/pool.py``'s ``best_rate``). Nothing asserts; it prints each figure, its
baselines and the ratios (targets of issue 45 on the 16-core machine: shm 64 KiB >= 0.8x per-page, >= 0.75x big
memcpy, tensors >= 0.75x, 16 KiB >= 0.7x; tcp 64 KiB and 1 MiB >= 0.8x the raw stream).

TLS (``--tls``, on by default; needs the ``openssl`` command for throwaway certificates): tcp gets of 1 MiB x64 from a
second one-node pool serving TLS, against plaintext gets of the same size from the first pool, alternating in the same
run (median GB/s of batches; CPU seconds a GB of the client, the node, its event loop and its busiest other thread):
with one connection per node (``ClientConfig.tls_streams`` = 1), with the batch split over 2 and over the default
``tls_streams`` connections received in parallel threads, and with kernel TLS (``ClientConfig.ktls``) on the client's
receive side where the kernel and OpenSSL have it; where they do not, the output says so, with the reason. Target
(issue 45): TLS >= 0.5x plaintext.

``--big-view`` (on by default): tcp gets of 256 KiB and 1 MiB x64 with ``transport.framed._BIG_VIEW`` off (one
``recvmsg_into`` over a run of views, today's setting) against 256 KiB (each such view received on its own), wall and
per client CPU-second, alternating in one run.

``python bench/getpath.py [--quick] [--sizes 16,64,1024] [--transports shm,tcp] [--outs array,tensors]
[--tls on|off|only] [--big-view on|off] [--phases]``

``--phases``: after each figure, 30-300 more batches (about 256 MiB) with the client's LOOKUP submit, read ahead and
LOOKUP result timed (``phase_split``): where a batch's wall and CPU go on the machine that runs it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import umbp  # noqa: E402
from umbp.buffers import HostSpans  # noqa: E402
from bench.common import environ, make_certs as _certs, tls_env  # noqa: E402
from bench.pool import BATCH, KiB, best_rate, label, raw_tcp_gbps  # noqa: E402
from umbp.launcher import LocalPool  # noqa: E402


def rate(fn, batches: int, min_time: float, cpu: list | None = None) -> float:
    """GB/s of ``fn(b)`` (one batch, returns its bytes) over rotating batch numbers, best window. With ``cpu`` (a
    list) the GB/s per CPU second of this process (its threads included; the metaserver and node are other
    processes) is appended to it: on a loaded machine the wall figure waits on the others, this one does not."""
    rounds, used, b = [], [], 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < min_time or b < min(batches, 3):
        t, c = time.perf_counter(), time.process_time()
        n = fn(b % batches)
        rounds.append((t, time.perf_counter(), n))
        used.append((time.process_time() - c, n))
        b += 1
    if cpu is not None:  # the median batch's CPU seconds: process_time ticks coarsely
        per = sorted(s / n for s, n in used)[len(used) // 2]
        cpu.append(1 / per / 1e9 if per else float("inf"))
    return best_rate(rounds) / 1e9


def memcpy_rates(size: int, pages: int, min_time: float) -> tuple[float, float]:
    """(one big memcpy, per-page memcpy) GB/s of 64-page batches over a working set of ``pages`` pages."""
    src = np.random.randint(0, 255, pages * size, dtype=np.uint8).reshape(pages, size)
    dst = np.ones((BATCH, size), np.uint8)
    rows = list(dst)

    def big(b: int) -> int:
        np.copyto(dst, src[b * BATCH:(b + 1) * BATCH])
        return BATCH * size

    def per_page(b: int) -> int:
        base = b * BATCH
        for i, d in enumerate(rows):
            np.copyto(d, src[base + i])
        return BATCH * size
    return rate(big, pages // BATCH, min_time), rate(per_page, pages // BATCH, min_time)


def stream_cpu_gbps(total: int) -> float:
    """The raw stream's receive side in GB/s per CPU second of this process (``raw_tcp_gbps`` timed by
    ``process_time``)."""
    c = time.process_time()
    raw_tcp_gbps(total=total)
    return total / max(time.process_time() - c, 1e-9) / 1e9


def phase_split(c, one, batches: int, n: int) -> str:
    """Where a batch's time goes (``--phases``): ``n`` batches of ``one(b)`` with the client's LOOKUP submit, the read
    ahead (``umbp.readbatch._read_ahead``: the copy, or the tcp/rdma reads) and the LOOKUP's result (the wait for
    the metaserver, then decoding) timed, wall and the calling thread's CPU (copy threads not counted), in us a
    batch; the rest is the Python around them (keys, outs, the cache, settling, counters, the lease's release)."""
    import umbp.readbatch as rb

    acc: dict[str, list[float]] = {}
    tt, pc = time.thread_time, time.perf_counter

    def timed(name, fn):
        def w(*a, **k):
            c0, w0 = tt(), pc()
            try:
                return fn(*a, **k)
            finally:
                x = acc.setdefault(name, [0.0, 0.0])
                x[0] += pc() - w0
                x[1] += tt() - c0
        return w
    meta, read_ahead = c._meta, rb._read_ahead
    meta.submit, meta.result = timed("submit", meta.submit), timed("result", meta.result)
    rb._read_ahead = timed("read ahead", read_ahead)
    try:
        c0, w0 = tt(), pc()
        for b in range(n):
            one(b % batches)
        wall, cpu = (pc() - w0) / n * 1e6, (tt() - c0) / n * 1e6
    finally:
        rb._read_ahead = read_ahead
        del meta.submit, meta.result  # the instance attributes: the class's methods again
    parts = {k: (v[0] / n * 1e6, v[1] / n * 1e6) for k, v in acc.items()}
    rest = cpu - sum(v[1] for v in parts.values())
    return (f"us a batch: wall {wall:.0f}, main thread cpu {cpu:.0f} | "
            + " | ".join(f"{k} wall {w:.0f} cpu {u:.0f}" for k, (w, u) in parts.items()) + f" | rest cpu {rest:.0f}")


def arena_pages(ms: str) -> str:
    """How a same-host client maps the node's arena: bytes on 2 MiB pages (``--arena-root``; umbp/node/arena.py)."""
    from transport.shm import mapped_huge

    with umbp.Client(ms, namespace="getpath-arena", transport="shm") as c:
        c.put("probe", b"x")
        (t,) = [t for t in c._transports.values() if t.name == "shm"]
        huge = mapped_huge(t._map)
        return (f"arena {t.size >> 20} MiB: {huge >> 20} MiB of it on 2 MiB pages in the client's mapping"
                + ("" if huge else " (4 KiB pages: /dev/shm without huge=; see --arena-root)"))


def get_rates(ms: str, transport: str, size: int, pages: int, kinds: list[str], min_time: float,
              phases: bool = False) -> dict:
    """GB/s of ``batch_get_into`` per out kind, after putting ``pages`` pages (bytes checked once); with ``phases``
    each kind's ``phase_split`` too (key ``kind + " phases"``)."""
    import torch

    out = {}
    with umbp.Client(ms, namespace=f"getpath-{transport}-{size}", transport=transport) as c:
        rng = np.random.default_rng(size)
        vals = rng.integers(0, 256, (BATCH, size), dtype=np.uint8)
        keys = [f"{size}/{i}" for i in range(pages)]
        for lo in range(0, pages, BATCH):
            c.batch_put(keys[lo:lo + BATCH], list(vals))
        batches = [keys[lo:lo + BATCH] for lo in range(0, pages, BATCH)]
        arr = np.zeros((BATCH, size), np.uint8)
        tensors = [torch.zeros(size, dtype=torch.uint8) for _ in range(BATCH)]
        pool = np.zeros((2 * BATCH, size), np.uint8)  # a host pool, every other row a page (views, spans)
        rows = np.arange(0, 2 * BATCH, 2)
        for kind in kinds:
            outs = {"array": arr, "tensors": tensors, "views": [memoryview(pool[r]) for r in rows.tolist()],
                    "spans": HostSpans.rows(pool, rows)}[kind]
            assert c.batch_get_into(batches[1], outs) == [size] * BATCH
            got = arr if kind == "array" else torch.stack(tensors).numpy() if kind == "tensors" else pool[rows]
            assert np.array_equal(got, vals), f"{transport} {kind}: wrong bytes"

            def one(b: int, outs=outs, c=c) -> int:
                c.batch_get_into(batches[b], outs)
                return BATCH * size
            cpu: list = []
            out[kind] = rate(one, len(batches), min_time, cpu)
            out[kind + " cpu"] = cpu[0]
            if phases:
                n = max(30, min(300, (256 << 20) // (BATCH * size)))
                out[kind + " phases"] = phase_split(c, one, len(batches), n)
    return out


def _thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of process ``pid`` (Linux /proc; {} elsewhere)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def tls_rows(plain_pool: LocalPool, min_time: float, rounds: int = 3) -> list[str]:
    """TLS gets of 1 MiB x64 against plaintext ones, same run (see the module docstring), with the CPU seconds a GB
    of the client, the node, the node's event loop thread and its busiest other thread (``_thread_cpu``)."""
    import shutil
    import tempfile

    from umbp import tls
    from umbp.config import ClientConfig, resolve

    size, streams = 1 << 20, ClientConfig.tls_streams
    d = tempfile.mkdtemp(prefix="umbp-bench-tls-")
    if not _certs(d):
        return ["tls: SKIPPED (no `openssl` command to make certificates with)"]
    can_ktls, why = tls.ktls_status()
    ca = os.path.join(d, "ca.pem")
    vals = np.random.default_rng(7).integers(0, 256, (BATCH, size), dtype=np.uint8)
    out = np.zeros_like(vals)
    keys = [f"tls/{i}" for i in range(BATCH)]
    got: dict[str, list[float]] = {}
    cpu: dict[str, list] = {}  # name -> [client s, node s, {node thread: s}, GB]
    pids: dict[str, int] = {}
    engaged = False
    try:
        # the plaintext client first: made inside tls_env it would take UMBP_TLS_CA and speak TLS
        with umbp.Client(plain_pool.metaserver, namespace="getpath-tls", transport="tcp") as plain, \
                environ(tls_env(d)), LocalPool(nodes=1, capacity="256MiB", port=0, metrics=False) as tp:
            def secure(k: int, ktls: bool = False) -> umbp.Client:
                return umbp.Client(config=resolve(ClientConfig, {
                    "metaserver": tp.metaserver, "namespace": "getpath-tls", "transport": "tcp", "tls_ca": ca,
                    "tls_streams": k, "ktls": ktls}))

            clients = [("plain", plain), ("tls 1 stream", secure(1))] + [
                (f"tls {k} streams", secure(k)) for k in sorted({2, streams}) if k > 1]
            if can_ktls:
                clients.append((f"tls+ktls {streams} streams", secure(streams, ktls=True)))
            for name, c in clients:
                c.batch_put(keys, vals)
                assert c.batch_get_into(keys, out) == [size] * BATCH and np.array_equal(out, vals), name
            if can_ktls:
                t = next(iter(clients[-1][1]._transports.values()))
                engaged = t._conn is not None and tls.ktls_engaged(t._conn.sock)
            pids.update({name: next(ch.proc.pid for ch in pool.children if ch.name.startswith("node"))
                         for name, pool in (("plain", plain_pool), ("tls", tp))})
            for _ in range(rounds):  # alternating: the machine's load drifts alike for each
                for name, c in clients:
                    pid = pids["plain" if name == "plain" else "tls"]
                    ts, t0, n0, p0 = [], time.perf_counter(), _thread_cpu(pid), time.process_time()
                    while time.perf_counter() - t0 < min_time / rounds or len(ts) < 3:
                        t = time.perf_counter()
                        c.batch_get_into(keys, out)
                        ts.append(time.perf_counter() - t)
                    n1 = _thread_cpu(pid)
                    got.setdefault(name, []).append(BATCH * size / float(np.median(ts)) / 1e9)
                    used = cpu.setdefault(name, [0.0, 0.0, {}, 0.0])
                    used[0] += time.process_time() - p0
                    used[3] += len(ts) * BATCH * size / 1e9
                    for tid, sec in n1.items():
                        used[2][tid] = used[2].get(tid, 0.0) + sec - n0.get(tid, 0.0)
                    used[1] = sum(used[2].values())
            for _name, c in clients[1:]:
                c.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)

    def per_gb(name: str) -> str:
        cl, nd, by_thread, gb = cpu[name]
        pid = pids["plain" if name == "plain" else "tls"]  # the node's main thread runs its event loop
        other = max([v for t, v in by_thread.items() if t != pid] or [0.0])
        return (f"cpu s/GB: client {cl / gb:4.2f}, node {nd / gb:4.2f} (its loop {by_thread.get(pid, 0.0) / gb:4.2f}, "
                f"busiest other thread {other / gb:4.2f})" if gb and by_thread else "")

    base = float(np.median(got.pop("plain")))
    lines = [f"tcp get   1 MiB x{BATCH} plaintext                  {base:6.2f} GB/s (median of {rounds} rounds) | "
             f"{per_gb('plain')}"]
    for name, xs in got.items():
        gbps = float(np.median(xs))
        lines.append(f"tcp get   1 MiB x{BATCH} {name:<26} {gbps:6.2f} GB/s | {gbps / base:5.2f}x plaintext "
                     f"{base:6.2f} (target >= 0.5x) | {per_gb(name)}")
    if not can_ktls:
        lines.append(f"!!! kTLS NOT AVAILABLE on this machine, not measured: {why}")
    elif not engaged:
        lines.append(f"!!! kTLS was asked for but did NOT engage (the socket's ULP is not tls): {why}; the "
                     f"'tls+ktls' row ran as plain user-space TLS 1.2")
    return lines


def big_view_rows(ms: str, min_time: float, rounds: int = 3) -> list[str]:
    """tcp gets of 256 KiB and 1 MiB x64 with ``transport.framed._BIG_VIEW`` off (one ``recvmsg_into`` over a run of
    views, the default) and at 256 KiB (each such view its own ``recv_into``), alternating: wall GB/s and GB/s per
    client CPU-second, medians of rounds."""
    import transport.framed as framed

    saved, lines = framed._BIG_VIEW, []
    with umbp.Client(ms, namespace="getpath-bigview", transport="tcp") as c:
        for size in (256 * KiB, 1024 * KiB):
            vals = np.random.default_rng(size).integers(0, 256, (BATCH, size), dtype=np.uint8)
            out = np.zeros_like(vals)
            keys = [f"bv/{size}/{i}" for i in range(BATCH)]
            c.batch_put(keys, vals)
            got: dict[str, list] = {}
            try:
                for _ in range(rounds):
                    for name, big in (("off (one recvmsg_into)", 1 << 62), ("256 KiB (recv_into each)", 256 * KiB)):
                        framed._BIG_VIEW = big
                        wall, cpu, t0 = [], [], time.perf_counter()
                        while time.perf_counter() - t0 < min_time / rounds or len(wall) < 3:
                            t, p = time.perf_counter(), time.process_time()
                            c.batch_get_into(keys, out)
                            wall.append(time.perf_counter() - t)
                            cpu.append(time.process_time() - p)
                        got.setdefault(name, []).append((BATCH * size / float(np.median(wall)) / 1e9,
                                                         BATCH * size / max(float(np.mean(cpu)), 1e-9) / 1e9))
            finally:
                framed._BIG_VIEW = saved
            assert np.array_equal(out, vals)
            c.batch_remove(keys)
            for name, xs in got.items():
                a = np.array(xs)
                lines.append(f"tcp get {label(size):>7} x{BATCH} _BIG_VIEW {name:<25} {np.median(a[:, 0]):6.2f} GB/s "
                             f"{np.median(a[:, 1]):6.2f} GB/s per client CPU-s")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs, smaller working sets (noisier)")
    ap.add_argument("--sizes", default="16,64,1024", help="page sizes in KiB")
    ap.add_argument("--transports", default="shm,tcp")
    ap.add_argument("--outs", default="array,tensors",
                    help="array (one 2-D array), tensors (a list), views (a list of memoryviews of a host pool: "
                         "SGLang's HiCache backend's outs), spans (umbp.buffers.HostSpans of a host pool's rows)")
    ap.add_argument("--capacity", default="2GiB", help="node arena size")
    ap.add_argument("--tls", default="on", choices=("on", "off", "only"), help="TLS gets of 1 MiB vs plaintext")
    ap.add_argument("--big-view", default="on", choices=("on", "off"), help="tcp receive: _BIG_VIEW off vs 256 KiB")
    ap.add_argument("--phases", action="store_true", help="where a batch's time goes (client wall and CPU, us)")
    ap.add_argument("--arena-root", default="", metavar="DIR",
                    help="the node's arena under DIR (a tmpfs mounted with huge=within_size: 2 MiB pages), not "
                         "/dev/shm")
    args = ap.parse_args()
    min_time = 0.5 if args.quick else 1.5
    ws = (128 << 20) if args.quick else (384 << 20)
    kinds = args.outs.split(",")
    lines = []
    with LocalPool(nodes=1, capacity=args.capacity, port=0, metrics=False, arena_root=args.arena_root) as pool:
        lines.append(arena_pages(pool.metaserver))
        print(lines[-1], flush=True)
        for transport in args.transports.split(",") if args.tls != "only" else ():
            for size in (int(x) * KiB for x in args.sizes.split(",")):
                pages = max(4 * BATCH, ws // size) // BATCH * BATCH
                if transport == "shm":
                    big, per = memcpy_rates(size, pages, min_time)
                    bases = [("big memcpy", big), ("per-page memcpy", per)]
                else:
                    total = (512 << 20) if args.quick else (2 << 30)
                    bases = [("raw tcp stream", raw_tcp_gbps(total=total)), ("its cpu", stream_cpu_gbps(total))]
                got = get_rates(pool.metaserver, transport, size, pages, kinds, min_time, args.phases)
                for kind, gbps in got.items():
                    if kind.endswith("phases"):
                        lines.append(f"{transport} get {label(size):>7} x{BATCH} into {kind:<18} {gbps}")
                        print(lines[-1], flush=True)
                        continue
                    # wall figures against the wall baselines; CPU figures against the stream's CPU rate (tcp)
                    use = bases[-1:] if kind.endswith("cpu") and transport == "tcp" else bases[:1] if \
                        transport == "tcp" else bases
                    cols = "  ".join(f"{gbps / b:5.2f}x {n} {b:6.2f}" for n, b in use)
                    line = f"{transport} get {label(size):>7} x{BATCH} into {kind:<11} {gbps:6.2f} GB/s | {cols}"
                    lines.append(line)
                    print(line, flush=True)
        if args.big_view == "on" and args.tls != "only":
            for line in big_view_rows(pool.metaserver, min_time):
                lines.append(line)
                print(line, flush=True)
        if args.tls != "off":
            for line in tls_rows(pool, min_time):
                lines.append(line)
                print(line, flush=True)
    print("\n=== summary (GB/s | ratio to each same-run baseline, baseline GB/s) ===")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
