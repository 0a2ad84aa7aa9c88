"""Disk-tier benchmark (issue 47): gets of 1 MiB pages from a node's disk tier over TCP beside raw reads of the same
file in the same run.

Setup: one node process (``python -m umbp node --disk PATH``; its ``--metaserver`` is a closed port: the node serves
TCP while its registration retries, and nothing here needs a metaserver), its disk working set filled the way the
metaserver will fill it: pages written into DRAM (WRITEV) and moved in batches (DEMOTE, whose GB/s is printed).
Then for each worker count T (the node restarted with ``--disk-threads T`` on the same file, which keeps the pages):

- random: batches of ``--batch`` pages at random extents of the working set. Node: READV_DISK frames of a batch,
  ``--depth`` frames in flight on one connection, each page's header checked as a client checks it. Raw: the same
  batches' extents read by T threads of this process with ``os.preadv`` (O_DIRECT when the file system takes it)
  into preallocated aligned buffers: what the device gives T-way concurrent page reads, no node, no network.
- sequential: node: batches of consecutive extents in file order; raw: the file read in 8 MiB ``preadv`` calls by T
  threads (``dd``-like).

Each figure is the best window of ``WINDOW_S`` (bench/pool.py's ``best_rate``) of consecutive batches, the best of
``--rounds`` rounds in which node and raw alternate (the device's speed drifts); payload GB/s. The defaults (frames
of 8 pages, 4 in flight) are what a client reading disk rows should send: a READV_DISK answer starts once its whole
frame is read, so small frames in flight overlap the node's disk reads with its sends.
The ratio node/raw is printed (target: random >= 0.8x). Nothing asserts. The file system and whether O_DIRECT was on
are printed first. ``python bench/disk.py [--path FILE] [--working-set 4GiB] [--threads 1,4,8] [--quick]``
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.pool import best_rate  # noqa: E402
from transport import wire  # noqa: E402
from transport import answerrows, objformat
from transport.framed import FramedSocket  # noqa: E402
from umbp.node.arena import arena_dir_with_room  # noqa: E402
from umbp.sizes import format_size, parse_size  # noqa: E402

PAGE = 1 << 20
HS = objformat.OBJ_HEADER_SIZE
EXT = objformat.object_size(PAGE)  # 1 MiB + 4 KiB: a page's extent on disk
SEQ_CHUNK = 8 << 20


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def filesystem(path: str) -> str:
    """The file system type holding ``path`` (/proc/mounts, longest mount point that prefixes it)."""
    best, kind = "", "?"
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) > 2 and real.startswith(parts[1]) and len(parts[1]) > len(best):
                    best, kind = parts[1], f"{parts[2]} ({parts[0]} on {parts[1]})"
    except OSError:
        pass
    return kind


class Node:
    """A node process serving the disk file; ``restart(threads)`` keeps the file (and its pages)."""

    def __init__(self, disk: str, disk_capacity: int, arena: int, workdir: str):
        self.disk, self.disk_capacity, self.arena, self.workdir = disk, disk_capacity, arena, workdir
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self, threads: int) -> dict:
        argv = [sys.executable, "-m", "umbp", "node", "--metaserver", "127.0.0.1:9", "--capacity", str(self.arena),
                "--listen", f"127.0.0.1:{self.port}", "--node-id", "bench-disk", "--disk", self.disk,
                "--disk-capacity", str(self.disk_capacity), "--disk-threads", str(threads)]
        env = dict(os.environ, UMBP_ARENA_DIR=self.workdir, PYTHONUNBUFFERED="1")
        self.log = open(os.path.join(self.workdir, "node.log"), "ab")
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=self.log,
                                     cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        deadline = time.monotonic() + 60
        while True:
            try:
                s = FramedSocket(f"127.0.0.1:{self.port}", "bench", time.monotonic() + 5)
                try:
                    return s.request(wire.Op.ARENA_INFO, {}, time.monotonic() + 5).meta
                finally:
                    s.close()
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"the node did not come up; see {self.log.name}")
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
            self.log.close()


def thread_cpu(pid: int) -> tuple[float, float]:
    """(the node's main thread, all its other threads) CPU seconds so far (/proc; zeros where it cannot be read)."""
    main = rest = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                f = fh.read().rsplit(")", 1)[1].split()
            cpu = (int(f[11]) + int(f[12])) / tick
            if int(tid) == pid:
                main += cpu
            else:
                rest += cpu
    except (OSError, ValueError, IndexError):
        pass
    return main, rest


def payload(i: int, pool: memoryview) -> memoryview:
    at = (i * 7919 * 4096) % (len(pool) - PAGE)
    return pool[at:at + PAGE]


def fill(addr: str, pages: int, arena: int, pool: memoryview) -> float:
    """Write ``pages`` pages into DRAM and DEMOTE them to extents 0..pages-1; the DEMOTE GB/s."""
    per_round = min(pages, (arena - 2 * EXT) // EXT)
    s = FramedSocket(addr, "bench", time.monotonic() + 30)
    demote_s, i = 0.0, 0
    try:
        while i < pages:
            n = min(per_round, pages - i)
            drams = [objformat.ARENA_DATA_START + k * EXT for k in range(n)]
            for k0 in range(0, n, 32):  # WRITEV frames of up to 32 pages
                ks = range(k0, min(n, k0 + 32))
                meta = [[drams[k], 1, b"", HS + PAGE] for k in ks]
                data = []
                for k in ks:
                    data += [objformat.pack_object_header(i + k + 1, 1, PAGE), payload(i + k, pool)]
                s.request(wire.Op.WRITEV, meta, time.monotonic() + 60, data=data)
            rows = answerrows.pack_tier_rows([i + k + 1 for k in range(n)], [1] * n, [PAGE] * n, drams,
                                       [objformat.DISK_DATA_START + (i + k) * EXT for k in range(n)])
            t = time.perf_counter()
            f = s.request(wire.Op.DEMOTE, {"rows": rows}, time.monotonic() + 300)
            demote_s += time.perf_counter() - t
            if f.meta:
                raise RuntimeError(f"DEMOTE failed rows: {f.meta[:3]}")
            i += n
    finally:
        s.close()
    return pages * PAGE / demote_s / 1e9


def node_rate(addr: str, batches: list[list[int]], depth: int, min_time: float, check: memoryview) -> float:
    """GB/s of READV_DISK batches, ``depth`` frames in flight on one connection."""
    s = FramedSocket(addr, "bench", time.monotonic() + 30)
    nb = len(batches[0])
    buf = memoryview(bytearray(nb * (HS + PAGE)))
    rounds, sent, got = [], [], 0
    deadline = time.monotonic() + min_time + 120
    t0 = time.perf_counter()

    def send(b: int) -> None:
        ops = [[objformat.DISK_BIT | (objformat.DISK_DATA_START + p * EXT), 0, PAGE, p + 1, 1, PAGE, b""]
               for p in batches[b % len(batches)]]
        rid = s.next_id()
        s.send([wire.encode(wire.Op.READV_DISK, rid, ops)], deadline)
        sent.append((rid, b, time.perf_counter()))

    try:
        b = 0
        for _ in range(depth):
            send(b)
            b += 1
        while sent:
            rid, bno, start = sent.pop(0)
            _op, _fl, status, got_rid, meta_len, data_len = s.recv_header(deadline)
            meta = s.recv_meta(meta_len, deadline)
            if status or got_rid != rid or meta or data_len != len(buf):
                raise RuntimeError(f"READV_DISK answer: status {status}, rid {got_rid}/{rid}, failures {meta}")
            s.recv_into(buf, deadline)
            for k, p in enumerate(batches[bno % len(batches)]):
                objformat.check_object_header(buf[k * (HS + PAGE):k * (HS + PAGE) + HS], "bench", p + 1, 1, PAGE)
            if got == 0 and buf[HS:HS + PAGE] != payload(batches[bno % len(batches)][0], check):
                raise RuntimeError("READV_DISK: wrong bytes")
            got += 1
            rounds.append((start, time.perf_counter(), nb * PAGE))
            if time.perf_counter() - t0 < min_time or b < 3:
                send(b)
                b += 1
    finally:
        s.close()
    return best_rate(rounds) / 1e9


def open_direct(path: str) -> tuple[int, bool]:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT), True
    except OSError:
        return os.open(path, os.O_RDONLY), False


def raw_rate(path: str, extents: list[list[tuple[int, int]]], threads: int, min_time: float) -> float:
    """GB/s (payload: ``PAGE`` a page extent, the bytes read for a sequential chunk) of batches of (offset, nbytes)
    reads by ``threads`` threads, each with its own preallocated aligned buffer."""
    fd, _direct = open_direct(path)
    size = max(n for batch in extents for _o, n in batch)
    bufs = [mmap.mmap(-1, size) for _ in range(threads)]
    pool = ThreadPoolExecutor(threads)

    def part(t: int, items: list) -> None:
        for off, n in items:
            view = memoryview(bufs[t])[:n]
            if os.preadv(fd, [view], off) != n:
                raise OSError(5, "short read")

    rounds, b = [], 0
    t0 = time.perf_counter()
    try:
        while time.perf_counter() - t0 < min_time or b < 3:
            batch = extents[b % len(extents)]
            start = time.perf_counter()
            futs = [pool.submit(part, t, batch[t::threads]) for t in range(threads)]
            for f in futs:
                f.result()
            payload_bytes = sum(PAGE if n == EXT else n for _o, n in batch)
            rounds.append((start, time.perf_counter(), payload_bytes))
            b += 1
    finally:
        pool.shutdown()
        os.close(fd)
    return best_rate(rounds) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", default="", help="the disk file (default: a temporary file under the current directory)")
    ap.add_argument("--working-set", default="4GiB", help="pages on disk (1 MiB each)")
    ap.add_argument("--arena", default="512MiB", help="the node's DRAM arena (demotion batches)")
    ap.add_argument("--threads", default="1,4,8")
    ap.add_argument("--batch", type=int, default=8, help="pages a READV_DISK frame")
    ap.add_argument("--depth", type=int, default=4, help="frames in flight")
    ap.add_argument("--seconds", type=float, default=2.0, help="time per figure per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per figure (the best is printed)")
    ap.add_argument("--quick", action="store_true", help="1 GiB, 1 s a figure, 2 rounds")
    args = ap.parse_args()
    ws = parse_size("1GiB" if args.quick else args.working_set)
    secs = 1.0 if args.quick else args.seconds
    if args.quick:
        args.rounds = 2
    arena = parse_size(args.arena)
    pages = ws // PAGE
    workdir = tempfile.mkdtemp(prefix="umbp-bench-disk-", dir=arena_dir_with_room(arena) or None)
    made = "" if args.path else tempfile.mkdtemp(prefix="umbp-bench-disk-", dir=".")
    path = args.path or os.path.join(made, "bench.disk")
    capacity = objformat.align_up(pages * EXT, 1 << 20)
    pool = memoryview(os.urandom(64 << 20))
    node = Node(path, capacity, arena, workdir)
    rng = random.Random(47)
    try:
        info = node.start(4)
        fd, direct = open_direct(path)
        os.close(fd)
        print(f"disk file {path}: {filesystem(path)}; O_DIRECT {'on' if info.get('disk_direct') else 'OFF'} in "
              f"the node, {'on' if direct else 'OFF'} for the raw reads; working set {format_size(pages * PAGE)} "
              f"({pages} pages of 1 MiB); batches of {args.batch}, {args.depth} in flight; {os.cpu_count()} CPUs",
              flush=True)
        print(f"fill: DEMOTE {fill(f'127.0.0.1:{node.port}', pages, arena, pool):.2f} GB/s (4 workers, two "
              f"fdatasync a batch)", flush=True)
        nb = args.batch
        randoms = [rng.sample(range(pages), nb) for _ in range(256)]
        seqs = [list(range(k, k + nb)) for k in range(0, pages - nb + 1, nb)]
        raw_seq = [[(objformat.DISK_DATA_START + o, SEQ_CHUNK) for o in range(k, k + 16 * SEQ_CHUNK, SEQ_CHUNK)]
                   for k in range(0, pages * EXT - 16 * SEQ_CHUNK, 16 * SEQ_CHUNK)]
        print(f"{'threads':>7} {'random node':>12} {'random raw':>11} {'ratio':>6} {'seq node':>9} {'seq raw':>8} "
              f"{'ratio':>6}  (GB/s of payload)", flush=True)
        for t in [int(x) for x in args.threads.split(",")]:
            node.stop()
            node.start(t)
            addr = f"127.0.0.1:{node.port}"
            raw_random = [[(objformat.DISK_DATA_START + p * EXT, EXT) for p in b] for b in randoms]
            got: dict[str, list[float]] = {"rn": [], "rr": [], "sn": [], "sr": []}
            for _ in range(args.rounds):  # node and raw alternate: a drift of the device's speed hits both
                c0, t0 = thread_cpu(node.proc.pid), time.perf_counter()
                got["rn"].append(node_rate(addr, randoms, args.depth, secs, pool))
                c1, wall = thread_cpu(node.proc.pid), time.perf_counter() - t0
                loop_cpu, workers_cpu = (c1[0] - c0[0]) / wall, (c1[1] - c0[1]) / wall
                got["rr"].append(raw_rate(path, raw_random, t, secs))
                got["sn"].append(node_rate(addr, seqs, args.depth, secs, pool))
                got["sr"].append(raw_rate(path, raw_seq, t, secs))
            rn, rr, sn, sr = (max(got[k]) for k in ("rn", "rr", "sn", "sr"))
            print(f"{t:>7} {rn:>12.2f} {rr:>11.2f} {rn / rr:>5.2f}x {sn:>9.2f} {sr:>8.2f} {sn / sr:>5.2f}x   node "
                  f"CPU during random reads: event loop {loop_cpu:.0%}, disk workers {workers_cpu:.0%}", flush=True)
    finally:
        node.stop()
        with contextlib.suppress(OSError):
            os.unlink(path)
            if made:
                os.rmdir(made)
        for f in os.listdir(workdir):
            os.unlink(os.path.join(workdir, f))
        os.rmdir(workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
