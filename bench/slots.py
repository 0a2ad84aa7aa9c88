"""The fair capacity bench of a pool's metaservers (issue 44): what one, four ... metaserver processes of one pool
serve per CPU-second and per second when pipelined clients keep every one of them busy.

For each pool shape (``--processes`` x ``--slots``: 1 slot is today's unpartitioned metaserver; N > 1 processes need
at least N slots) and each request size (``--batches``) a fresh ``umbp.launcher.LocalPool`` (etcd, the metaserver
processes, ``--nodes`` nodes) serves two timed phases of ``--seconds`` each, driven by ``--clients`` client
processes, the same number for every shape ("the same client load"):

- puts: ALLOC then COMMIT of fresh keys of ``--page-bytes`` pages, metadata only. The node writes are skipped: COMMIT
  never reads the node (it turns the PENDING row READY and persists it), so a commit of a page not written is the
  metaserver's and etcd's full work; the node's write is the data path's cost, not measured here.
- lookups: LOOKUP of random batches of the keys the puts committed, then RELEASE of each read lease (no reply).

Each client keeps ``--window`` batches in flight. A batch becomes one request per metaserver process it touches,
routed by the client as ``umbp/slotrouter.py`` does (one slot: ``"slot"``; several: a multi-slot request with
``parts``); keys and their slots are computed before the phase, so the timed client work is a frame out and a frame
in (a LOOKUP answer's packed rows counted with one ``np.frombuffer``; ``--decode locs`` unpacks them as the client
library does). Frames go over raw ``transport.framed.FramedSocket`` connections, one per client and process,
answers matched by request id (a COMMIT waiting on etcd may be answered after later requests).

Measured per phase, between a common start and the last answer: keys/s; each metaserver's CPU-seconds (utime+stime
from /proc/PID/stat) and busy fraction (CPU-s / wall-s; below 90 % the phase is flagged: the clients, not the
server, set its rate); keys per metaserver CPU-second; etcd's CPU apart (per committed page for puts); the clients'
CPU. Then, per request kind, a least-squares fit of the metaserver CPU of every phase as ``a x requests + b x parts +
c x keys`` (requests: frames to a process, an ALLOC+COMMIT or LOOKUP+RELEASE pair counted once; parts: the slot parts
in them) with its residual, and the headline: keys/s of the largest process count against one unpartitioned process
at ``--headline-batch`` keys (issue 44's target: at least 3.2x for 4 processes, lookups and puts). Nothing asserts.

Page budget: every pool is fresh, and each client stops putting at 80 % of the pool's pages over the clients (no
eviction, every lookup a hit); a phase cut short by it is flagged (raise ``--capacity``). The arenas are
fallocated in /dev/shm: ``--nodes`` x ``--capacity`` of memory.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import selectors
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from transport import answerrows, objformat, slotrules, wire  # noqa: E402
from transport.framed import FramedSocket  # noqa: E402
from transport.wire import AllocState, Op  # noqa: E402
import umbp  # noqa: E402
from umbp.launcher import LocalPool  # noqa: E402

NS = "bench-slots"
DRAIN_S = 60.0  # after a phase's end, its requests in flight must all be answered within this
BUDGET_FILL = 0.8  # of the pool's pages the puts of one phase may take (no eviction, slots' regions not full)
LOOKUP_PLANS = 512  # lookup batches prepared per client (cycled through during the phase)
BUSY_OK = 0.9


# -- the client process --------------------------------------------------------------------------------------------

class _Sub:
    """One request of a batch to one process: its keys (grouped by slot), their slots, and the batch's counter."""

    __slots__ = ("proc", "keys", "kslots", "route", "nparts", "batch", "op")

    def __init__(self, proc: int, keys: list, kslots: list, route: dict, nparts: int):
        self.proc, self.keys, self.kslots, self.route, self.nparts = proc, keys, kslots, route, nparts
        self.batch: list | None = None  # [requests of the batch not answered yet]
        self.op = 0


def _route_meta(kslots: list[int]) -> tuple[dict, int]:
    """The routing fields of a request whose keys (grouped by slot, in that order) have slots ``kslots``, and how
    many slot parts it has: ``{"slot": s}`` for one slot, ``{"parts": [[slot, n], ...]}`` for several."""
    parts: list[list[int]] = []
    for s in kslots:
        if parts and parts[-1][0] == s:
            parts[-1][1] += 1
        else:
            parts.append([s, 1])
    return ({"slot": parts[0][0]} if len(parts) == 1 else {"parts": parts}), len(parts)


class BenchClient:
    """One client process's state: a connection per metaserver process, the slot map, the keys it committed."""

    def __init__(self, cid: int, window: int, page_bytes: int, decode: str, merge: bool = True):
        self.cid, self.window, self.page_bytes, self.decode = cid, window, page_bytes, decode
        self.merge = merge
        self.socks: list[FramedSocket] = []
        self.slots = 1
        self.owner: list[int] = []  # slot -> index of its process in socks
        self.keys: list[bytes] = []  # committed by the last put phase, with their slots
        self.kslots: list[int] = []
        self.plan: list[list[_Sub]] = []
        self.op = 0
        self.round = 0

    def connect(self, addrs: list[str]) -> int:
        self.close()
        token = os.environ.get("UMBP_TOKEN") or None
        first = FramedSocket(addrs[0], "bench", time.monotonic() + 10, token, hello=True)
        info = first.request(Op.LEADER, {}, time.monotonic() + 10).meta
        first.close()
        slots = info.get("slots") if type(info) is dict else None
        if type(slots) is int and slots > 1:
            smap = info["map"]
            if any(a is None for a in smap):
                raise RuntimeError(f"bench: slots without a leader in the map {smap}")
            procs = sorted(set(smap))
            self.slots, self.owner = slots, [procs.index(a) for a in smap]
        else:
            procs, self.slots, self.owner = addrs[:1], 1, [0]
        self.socks = [FramedSocket(a, f"bench metaserver {a}", time.monotonic() + 10, token, hello=True)
                      for a in procs]
        self.keys, self.kslots = [], []
        return len(procs)

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.socks = []

    def _batch(self, keys: list[bytes], kslots: list[int]) -> list[_Sub]:
        """One batch as one request per process: its keys grouped by slot (stable, so a part keeps key order)."""
        if self.slots <= 1:
            return [_Sub(0, keys, kslots, {}, 1)]
        by: dict[int, list[int]] = {}
        for i in sorted(range(len(keys)), key=kslots.__getitem__):
            by.setdefault(self.owner[kslots[i]], []).append(i)
        subs = []
        for proc, idx in by.items():
            ks = [kslots[i] for i in idx]
            route, nparts = _route_meta(ks)
            subs.append(_Sub(proc, [keys[i] for i in idx], ks, route, nparts))
        return subs

    def prep(self, op: str, batch: int, budget: int) -> int:
        """Build the next phase's batches before it starts (keys, their slots, the routing)."""
        self.op = Op.ALLOC if op == "put" else Op.LOOKUP
        if op == "put":
            self.round += 1
            n = budget // batch * batch
            keys = [b"c%d/r%d/%d" % (self.cid, self.round, i) for i in range(n)]
            ks = slotrules.slots_of(NS, keys, self.slots).tolist()
            self.plan = [self._batch(keys[i:i + batch], ks[i:i + batch]) for i in range(0, n, batch)]
            self.keys, self.kslots = [], []
        else:
            if len(self.keys) < batch:
                raise RuntimeError(f"bench: client {self.cid} committed {len(self.keys)} keys, fewer than a batch")
            rng = random.Random(self.cid * 7919 + self.round)
            self.plan = []
            for _ in range(max(LOOKUP_PLANS, 2 * self.window)):  # a batch is never in flight twice at once
                idx = rng.sample(range(len(self.keys)), batch)
                self.plan.append(self._batch([self.keys[i] for i in idx], [self.kslots[i] for i in idx]))
        return len(self.plan)

    def _send(self, sub: _Sub, op: int, meta: dict, inflight: dict, deadline: float) -> None:
        fs = self.socks[sub.proc]
        rid = fs.next_id()
        meta.update(sub.route)
        if op == Op.LOOKUP and self.merge and "parts" in sub.route:
            meta["merge"] = True  # one answer for the parts, as umbp/slotrouter.py asks (metaserver/ha/multislot.py)
        fs.send([wire.encode(op, rid, meta)], deadline)
        sub.op = op
        inflight[(sub.proc, rid)] = sub

    @staticmethod
    def _answers(sub: _Sub, meta: dict) -> list[dict]:
        """The per-part answers of a request (one for a single-slot or unpartitioned one, or a merged LOOKUP)."""
        if "parts" not in sub.route:
            return [meta]
        if meta.get("failed"):
            raise RuntimeError(f"bench: parts failed (the slot map moved during the bench?): {meta['failed']}")
        return meta["parts"] if "parts" in meta else [meta]

    @staticmethod
    def _allocs(answers: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        """(state, gen) of each key of an ALLOC's answers, in key order: their packed rows (wire VERSION 12)."""
        rows = [np.frombuffer(a["rows"], answerrows.ALLOC_ROW) for a in answers]
        rows = rows[0] if len(rows) == 1 else np.concatenate(rows)
        return rows["state"], rows["gen"]

    def _hits(self, ans: dict) -> int:
        if self.decode == "locs" or "rows" not in ans:
            answerrows.unpack_locs(ans, "bench")
            return sum(1 for x in ans["locs"] if x is not None)
        return int(np.count_nonzero(np.frombuffer(ans["rows"], answerrows.LOC_ROW)["node"] != answerrows.NO_NODE))

    def run(self, start_at: float, seconds: float) -> dict:
        """One timed phase from ``start_at`` (wall clock, common to the clients) for ``seconds``: the window kept
        full with the plan's batches (lookups cycle through theirs; puts stop at the end of theirs), then every
        request in flight answered. Returns the counts and the time of the last answer."""
        st = {"batches": 0, "requests": 0, "parts": 0, "keys": 0, "committed": 0, "found": 0, "not_new": 0,
              "budget_hit": False}
        sel = selectors.DefaultSelector()
        for i, fs in enumerate(self.socks):
            sel.register(fs.sock, selectors.EVENT_READ, i)
        inflight: dict[tuple[int, int], _Sub] = {}
        cycle = self.op == Op.LOOKUP
        active = nxt = 0
        time.sleep(max(0.0, start_at - time.time()))
        cpu0, end, last = time.process_time(), start_at + seconds, time.time()
        drain_by = time.monotonic() + seconds + DRAIN_S
        while True:
            now = time.time()
            while active < self.window and now < end and (cycle or nxt < len(self.plan)):
                subs = self.plan[nxt % len(self.plan)]
                nxt += 1
                counter = [len(subs)]
                for sub in subs:
                    sub.batch = counter
                    meta = {"ns": NS, "keys": sub.keys}
                    if self.op == Op.ALLOC:
                        meta["sizes"] = [self.page_bytes] * len(sub.keys)
                    self._send(sub, self.op, meta, inflight, drain_by)
                    st["requests"] += 1
                    st["parts"] += sub.nparts
                    st["keys"] += len(sub.keys)
                st["batches"] += 1
                active += 1
            if not cycle and nxt >= len(self.plan) and now < end:
                st["budget_hit"] = True
            if not inflight:
                if now >= end or not cycle and nxt >= len(self.plan):
                    break
                continue
            if time.monotonic() > drain_by:
                raise RuntimeError(f"bench: {len(inflight)} requests unanswered {DRAIN_S:.0f} s after the phase")
            for key, _ in sel.select(0.2):
                p = key.data
                fs = self.socks[p]
                fr = fs.recv_frame(drain_by)
                sub = inflight.pop((p, fr.request_id))
                wire.raise_for_status(fr, fs.component)
                if self._answer(sub, fr.meta, inflight, st, drain_by):
                    sub.batch[0] -= 1
                    if sub.batch[0] == 0:
                        active -= 1
                        last = time.time()
        sel.close()
        st["t_last"] = last
        st["client_cpu_s"] = time.process_time() - cpu0
        return st

    def _answer(self, sub: _Sub, meta: dict, inflight: dict, st: dict, deadline: float) -> bool:
        """Take one answer; True when ``sub`` is done (False: its COMMIT was sent)."""
        answers = self._answers(sub, meta)
        if sub.op == Op.LOOKUP:
            leases = []
            for a in answers:
                st["found"] += self._hits(a)
                if a.get("lease"):
                    leases.append(a["lease"])
            if leases:
                self.socks[sub.proc].send_noreply(
                    Op.RELEASE, {"lease": leases[0]} if len(leases) == 1 else {"leases": leases}, deadline)
            return True
        if sub.op == Op.ALLOC:
            state, gen = self._allocs(answers)  # the packed rows: one frombuffer an answer
            ok = np.flatnonzero(state == AllocState.NEW).tolist()
            st["not_new"] += len(state) - len(ok)
            if not ok:
                return True
            if len(ok) < len(state):  # only the allocated keys are committed; their parts counted again
                sub.keys, sub.kslots = [sub.keys[i] for i in ok], [sub.kslots[i] for i in ok]
                sub.route = _route_meta(sub.kslots)[0] if self.slots > 1 else {}
            self._send(sub, Op.COMMIT, {"ns": NS, "keys": sub.keys, "gens": gen.take(ok).tolist()}, inflight,
                       deadline)
            return False
        oks = [x for a in answers for x in a["ok"]]
        st["committed"] += sum(oks)
        self.keys += [k for k, x in zip(sub.keys, oks) if x]
        self.kslots += [s for s, x in zip(sub.kslots, oks) if x]
        return True


def client_main(cid: int, conn, window: int, page_bytes: int, decode: str, merge: bool = True) -> None:
    """A client process: obeys the bench's commands on ``conn`` (connect, prep, go, close, exit)."""
    c = BenchClient(cid, window, page_bytes, decode, merge)
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "exit":
                c.close()
                return
            out = {"connect": c.connect, "prep": c.prep, "go": c.run, "close": c.close}[cmd](*args)
            conn.send(("ok", out))
        except Exception:  # noqa: BLE001 - the bench process reports it and stops
            conn.send(("error", traceback.format_exc()))


# -- the bench process ---------------------------------------------------------------------------------------------

def cpu_s(pid: int) -> float:
    """User + system CPU-seconds of ``pid`` so far, all its threads (Linux /proc; 0 for a process that is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            f = fh.read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def busy_s() -> float:
    """CPU-seconds the whole machine has spent busy (not idle or waiting on I/O) so far (/proc/stat)."""
    with open("/proc/stat") as fh:
        f = [int(x) for x in fh.readline().split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")


class Clients:
    """The client processes (spawned once, reconnected to each pool) and their command pipes."""

    def __init__(self, n: int, window: int, page_bytes: int, decode: str, merge: bool = True):
        ctx = mp.get_context("spawn")
        self.pipes, self.procs = [], []
        for cid in range(n):
            a, b = ctx.Pipe()
            p = ctx.Process(target=client_main, args=(cid, b, window, page_bytes, decode, merge), daemon=True)
            p.start()
            self.pipes.append(a)
            self.procs.append(p)

    def ask(self, cmd: str, *args, timeout: float = 120.0) -> list:
        for p in self.pipes:
            p.send((cmd, *args))
        out = []
        for i, p in enumerate(self.pipes):
            if not p.poll(timeout):
                raise SystemExit(f"bench/slots.py: client {i} did not answer {cmd!r} within {timeout:.0f} s")
            status, val = p.recv()
            if status != "ok":
                raise SystemExit(f"bench/slots.py: client {i} failed at {cmd!r}:\n{val}")
            out.append(val)
        return out

    def stop(self) -> None:
        for p in self.pipes:
            try:
                p.send(("exit",))
            except OSError:
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def phase(clients: Clients, op: str, batch: int, budget: int, args, ms_pids: list[int], etcd_pid: int) -> dict:
    """One timed phase of every client; the figures of the pool over it."""
    clients.ask("prep", op, batch, budget)
    start_at = time.time() + 0.2 + 0.01 * len(clients.pipes)
    for p in clients.pipes:
        p.send(("go", start_at, args.seconds))
    time.sleep(max(0.0, start_at - time.time()))
    ms0, etcd0, mach0 = [cpu_s(p) for p in ms_pids], cpu_s(etcd_pid), busy_s()
    res = []
    for i, p in enumerate(clients.pipes):
        if not p.poll(args.seconds + DRAIN_S + 30):
            raise SystemExit(f"bench/slots.py: client {i} did not finish its {op} phase")
        status, val = p.recv()
        if status != "ok":
            raise SystemExit(f"bench/slots.py: client {i} failed in its {op} phase:\n{val}")
        res.append(val)
    ms = [cpu_s(p) - c for p, c in zip(ms_pids, ms0)]
    etcd, mach = cpu_s(etcd_pid) - etcd0, busy_s() - mach0
    wall = max(max(r["t_last"] for r in res) - start_at, 1e-3)
    tot = {k: sum(r[k] for r in res) for k in ("batches", "requests", "parts", "keys", "committed", "found",
                                                "not_new", "client_cpu_s")}
    busy = [c / wall for c in ms]
    return dict(tot, op=op, batch=batch, wall_s=wall, keys_per_s=tot["keys"] / wall,
                metaserver_cpu_s=ms, busy=busy, busy_ok=min(busy) >= BUSY_OK,
                keys_per_cpu_s=tot["keys"] / max(sum(ms), 1e-6), etcd_cpu_s=etcd,
                etcd_us_per_page=(etcd / tot["committed"] * 1e6) if op == "put" and tot["committed"] else None,
                machine_busy_cores=mach / wall, budget_hit=any(r["budget_hit"] for r in res))


def measure(clients: Clients, processes: int, slots: int, batch: int, args) -> list[dict]:
    """Puts then lookups at ``batch`` keys a request on a fresh pool of ``processes`` x ``slots``."""
    shape = {"metaservers": processes, "slots": slots} if slots > 1 else {}
    with LocalPool(nodes=args.nodes, capacity=args.capacity, metrics=False, **shape) as pool:
        ms_pids = [c.proc.pid for c in pool.children if c.name.startswith("metaserver")]
        etcd_pid = next(c.proc.pid for c in pool.children if c.name == "etcd")
        served = clients.ask("connect", pool.metaserver.split(","))
        if any(n != processes for n in served):
            raise SystemExit(f"bench/slots.py: clients see {served} serving processes, not {processes}")
        pages = args.nodes * (parse_size(args.capacity) // objformat.object_size(args.page_bytes))
        budget = max(batch, int(pages * BUDGET_FILL) // len(clients.pipes))
        runs = []
        for op in ("put", "lookup"):
            t0 = turns(pool)
            runs.append(phase(clients, op, batch, budget, args, ms_pids, etcd_pid))
            asked, passes = (b - a for a, b in zip(t0, turns(pool)))
            runs[-1]["lookups_per_pass"] = asked / passes if passes else None
        clients.ask("close")
    for r in runs:
        r.update(processes=processes, slots=slots, clients=len(clients.pipes), window=args.window)
    return runs


def turns(pool) -> tuple[int, int]:
    """(LOOKUPs answered a turn's at once, their table passes) of every metaserver of ``pool`` so far (STATS;
    metaserver/handlers/lookups.py): their ratio is how many LOOKUPs a busy metaserver answers with one pass."""
    with umbp.Client(pool.metaserver, namespace="bench") as c:
        s = c.stats()
    return s.get("turn_lookups", 0), s.get("turn_passes", 0)


def parse_size(s: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
    for u, m in units.items():
        if s.endswith(u):
            return int(float(s[:-len(u)]) * m)
    return int(s)


def fit(runs: list[dict]) -> dict:
    """Metaserver CPU-s = a x requests + b x parts + c x keys over ``runs`` (numpy lstsq), in microseconds."""
    x = np.array([[r["requests"], r["parts"], r["keys"]] for r in runs], float)
    y = np.array([sum(r["metaserver_cpu_s"]) for r in runs])
    coef, _, rank, _ = np.linalg.lstsq(x, y, rcond=None)
    rms = float(np.sqrt(np.mean((x @ coef - y) ** 2)))
    return {"a_us_per_request": float(coef[0]) * 1e6, "b_us_per_part": float(coef[1]) * 1e6,
            "c_us_per_key": float(coef[2]) * 1e6, "residual_rms_s": rms,
            "residual_rel": rms / max(float(np.mean(y)), 1e-9), "rank": int(rank), "points": len(runs)}


def headline(runs: list[dict], batch: int) -> list[dict]:
    """keys/s of each shape with the most processes against one unpartitioned process, at ``batch`` keys."""
    at = {(r["processes"], r["slots"], r["op"]): r for r in runs if r["batch"] == batch}
    most = max((p for p, _, _ in at), default=1)
    base = min(((p, s) for p, s, _ in at if p == 1), default=None, key=lambda ps: ps[1])
    if most <= 1 or base is None:
        return []
    out = []
    for s in sorted({s for p, s, _ in at if p == most}):
        row = {"processes": most, "slots": s, "batch": batch, "baseline": {"processes": 1, "slots": base[1]}}
        for op, name in (("lookup", "lookup_ratio"), ("put", "put_ratio")):
            row[name] = at[(most, s, op)]["keys_per_s"] / max(at[(1, base[1], op)]["keys_per_s"], 1e-9)
            row[name.replace("ratio", "cpu_ratio")] = (at[(most, s, op)]["keys_per_cpu_s"]
                                                       / max(at[(1, base[1], op)]["keys_per_cpu_s"], 1e-9))
        out.append(row)
    return out


def _spin(seconds: float, out) -> None:
    """A CPU-bound Python loop (dict stores of small tuples) for ``seconds``; puts its operations per CPU-second."""
    d: dict = {}
    n, t0, end = 0, time.process_time(), time.time() + seconds
    while time.time() < end:
        for i in range(1000):
            d[i] = (i, str(i))
        n += 1000
    out.put(n / max(time.process_time() - t0, 1e-6))


def machine_scaling(k: int, seconds: float = 2.0) -> float:
    """Each of ``k`` Python loops at once against one alone (their mean rate): below 1 where cores share caches,
    memory bandwidth or a clock that drops as more of them run; the ceiling a ratio of processes meets."""
    ctx = mp.get_context("spawn")
    rates = []
    for n in (1, k):
        q = ctx.Queue()
        ps = [ctx.Process(target=_spin, args=(seconds, q)) for _ in range(n)]
        for p in ps:
            p.start()
        got = [q.get(timeout=60 + seconds) for _ in ps]
        for p in ps:
            p.join(10)
        rates.append(sum(got) / n)
    return rates[1] / max(rates[0], 1e-6)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), "")
    except OSError:
        return platform.processor()


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="The full run (a 16-core machine; 15 fresh pools, about 5-8 minutes):\n"
               "  python3 bench/slots.py --json slots.json\n"
               "  (= --processes 1,4 --slots 1,4,16 --batches 16,128,1024 --clients 8 --window 8 --seconds 5\n"
               "     --nodes 2 --capacity 8GiB: 16 GiB of /dev/shm)\n"
               "Every metaserver should be at least 90% busy (flagged otherwise): raise --clients/--window while\n"
               "cores are left. --quick: a smoke run in under a minute on 2 cores (its figures mean nothing).\n"
               "What each figure is: docs/benchmarks/slots.md.")
    p.add_argument("--processes", type=_ints, default=[1, 4], help="metaserver process counts (default 1,4)")
    p.add_argument("--slots", type=_ints, default=[1, 4, 16],
                   help="slot counts (default 1,4,16; 1: unpartitioned; N>1 processes need >= N slots)")
    p.add_argument("--batches", type=_ints, default=[16, 128, 1024], help="keys a request (default 16,128,1024)")
    p.add_argument("--clients", type=int, default=0,
                   help="client processes, the same for every shape (default: 2 x the most processes)")
    p.add_argument("--window", type=int, default=8, help="batches in flight per client (default 8)")
    p.add_argument("--seconds", type=float, default=5.0, help="each timed phase (default 5)")
    p.add_argument("--nodes", type=int, default=2, help="storage nodes of each pool (default 2)")
    p.add_argument("--capacity", default="8GiB", help="per node, fallocated in /dev/shm (default 8GiB)")
    p.add_argument("--page-bytes", type=int, default=4000, help="page payload (default 4000: a 4 KiB object)")
    p.add_argument("--headline-batch", type=int, default=128, help="request size of the headline ratio")
    p.add_argument("--lookup-parts", action="store_true",
                   help="multi-slot LOOKUPs answered per part (no 'merge': the path before one answer a process)")
    p.add_argument("--decode", choices=("rows", "locs"), default="rows",
                   help="LOOKUP answers: count the packed rows (one frombuffer) or unpack them as umbp.Client does")
    p.add_argument("--ceiling", action="store_true",
                   help="also measure the machine's own scaling at the busy cores of the largest shape")
    p.add_argument("--json", help="write every figure to this path")
    p.add_argument("--quick", action="store_true",
                   help="tiny smoke run: --processes 1,2 --slots 1,4 --batches 16,128 --clients 2 --window 4 "
                        "--seconds 1 --nodes 1 --capacity 256MiB")
    args = p.parse_args(argv)
    if args.quick:
        args.processes, args.slots, args.batches = [1, 2], [1, 4], [16, 128]
        args.clients, args.window, args.seconds, args.nodes, args.capacity = 2, 4, 1.0, 1, "256MiB"
    args.clients = args.clients or 2 * max(args.processes)
    if args.headline_batch not in args.batches:
        args.headline_batch = min(args.batches, key=lambda b: abs(b - args.headline_batch))
    return args


def per_pass(r: dict) -> str:
    """A lookup phase's LOOKUPs a table pass (``turns``), as printed."""
    x = r.get("lookups_per_pass")
    return "-" if r["op"] != "lookup" or x is None else f"{x:.2f}"


def main(argv=None) -> int:
    args = parse_args(argv)
    shapes = [(p, s) for p in args.processes for s in args.slots if (p == 1 or s >= p and s > 1)]
    skipped = [(p, s) for p in args.processes for s in args.slots if (p, s) not in shapes]
    cpu_model = cpu_name()
    print(f"{platform.node()}: {os.cpu_count()} cores ({cpu_model}); {args.clients} client processes x "
          f"{args.window} batches in flight, {args.seconds:g} s a phase, {args.nodes} nodes x {args.capacity}, "
          f"pages of {args.page_bytes} B (metadata only)" + (f"; skipped shapes {skipped}" if skipped else ""),
          flush=True)
    print(f"{'proc':>4} {'slots':>5} {'op':<6} {'batch':>5} {'keys/s':>10} {'k keys/CPU-s':>13} "
          f"{'us/req':>7} {'busy (each)':<24} {'etcd us/pg':>10} {'clients':>7} {'machine':>7} {'per pass':>8}",
          flush=True)
    clients = Clients(args.clients, args.window, args.page_bytes, args.decode, not args.lookup_parts)
    runs, warnings = [], []
    try:
        for p, s in shapes:
            for b in args.batches:
                for r in measure(clients, p, s, b, args):
                    runs.append(r)
                    etcd = f"{r['etcd_us_per_page']:.1f}" if r["etcd_us_per_page"] is not None else "-"
                    flag = "" if r["busy_ok"] else "  < 90% busy"
                    if r["budget_hit"]:
                        flag += "  page budget hit (raise --capacity)"
                    print(f"{p:>4} {s:>5} {r['op']:<6} {b:>5} {r['keys_per_s']:>10,.0f} "
                          f"{r['keys_per_cpu_s'] / 1e3:>13,.1f} "
                          f"{sum(r['metaserver_cpu_s']) / max(r['requests'], 1) * 1e6:>7,.0f} "
                          f"{' '.join(f'{x:.0%}' for x in r['busy']):<24} {etcd:>10} "
                          f"{r['client_cpu_s'] / r['wall_s'] / args.clients:>7.0%} "
                          f"{r['machine_busy_cores']:>7.1f} {per_pass(r):>8}{flag}", flush=True)
                    if not r["busy_ok"]:
                        warnings.append(f"{p} processes / {s} slots, {r['op']} of {b}: a metaserver only "
                                        f"{min(r['busy']):.0%} busy: not saturated (too few clients, or no core free)")
                    if r["budget_hit"]:
                        warnings.append(f"{p} processes / {s} slots, puts of {b}: ended by the page budget")
    finally:
        clients.stop()
    fits = {}
    for op, what in (("lookup", "LOOKUP+RELEASE"), ("put", "ALLOC+COMMIT")):
        if not any(r["op"] == op for r in runs):
            continue
        f = fits[op] = fit([r for r in runs if r["op"] == op])
        print(f"{what}: metaserver CPU = {f['a_us_per_request']:,.1f} us x requests + {f['b_us_per_part']:,.1f} us "
              f"x parts + {f['c_us_per_key']:,.2f} us x keys; residual {f['residual_rel']:.1%} RMS of the mean "
              f"({f['points']} phases" + (f", rank {f['rank']} < 3: too few shapes to tell the terms apart)"
                                          if f["rank"] < 3 else ")"))
    heads = headline(runs, args.headline_batch)
    for h in heads:
        print(f"headline: {h['processes']} processes / {h['slots']} slots vs 1 process / {h['baseline']['slots']} "
              f"slot at {h['batch']}-key requests, same client load: lookups {h['lookup_ratio']:.2f}x, puts "
              f"{h['put_ratio']:.2f}x in keys/s (issue 44 target >= 3.2x at 4 processes); keys per metaserver "
              f"CPU-s {h['lookup_cpu_ratio']:.2f}x, {h['put_cpu_ratio']:.2f}x")
    ceiling = None
    if args.ceiling and runs:
        k = max(1, min(round(max(r["machine_busy_cores"] for r in runs)), os.cpu_count() or 1))
        each = machine_scaling(k)
        ceiling = {"busy_cores": k, "each": each}
        print(f"the machine's own scaling: {k} CPU-bound Python loops at once run at {each:.2f} each of one alone")
    for w in warnings:
        print(f"warning: {w}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": {"host": platform.node(), "cores": os.cpu_count(), "cpu": cpu_model},
                       "args": {k: v for k, v in vars(args).items() if k != "json"}, "runs": runs, "fit": fits,
                       "headline": heads, "ceiling": ceiling, "warnings": warnings}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
