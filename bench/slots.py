"""The fair capacity bench of a pool's metaservers (issue 44): what one, four ... metaserver processes of one pool
serve per CPU-second and per second when pipelined clients keep every one of them busy.

For each pool shape (``--processes`` x ``--slots``: 1 slot is today's unpartitioned metaserver; N > 1 processes need
at least N slots) and each request size (``--batches``) a fresh ``umbp.launcher.LocalPool`` (etcd, the metaserver
processes, ``--nodes`` nodes) serves two timed phases of ``--seconds`` each, driven by ``--clients`` client
processes, the same number for every shape ("the same client load"):

- puts: ALLOC then COMMIT of fresh keys of ``--page-bytes`` pages, each naming the page before it in its batch as its
  parent as the engines' puts do (``--parents none``: none), metadata only. The node writes are skipped: COMMIT
  never reads the node (it turns the PENDING row READY and persists it), so a commit of a page not written is the
  metaserver's and etcd's full work; the node's write is the data path's cost, not measured here.
- lookups: LOOKUP of random batches of the keys the puts committed, then RELEASE of each read lease (no reply).

Each client keeps ``--window`` batches in flight. A batch becomes one request per metaserver process it touches,
routed by the client as ``umbp/slotrouter.py`` does (one slot: ``"slot"``; several: a multi-slot request with
``parts``); keys and their slots are computed before the phase, so the timed client work is a frame out and a frame
in (a LOOKUP answer's packed rows counted with one ``np.frombuffer``; ``--decode locs`` unpacks them as the client
library does). Frames go over raw ``transport.framed.FramedSocket`` connections, one per client and process,
answers matched by request id (a COMMIT waiting on etcd may be answered after later requests). The client
processes are ``bench/slotclients.py``'s; this file is the bench process (pools, phases, figures, the fit).

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
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from transport import objformat  # noqa: E402
import umbp  # noqa: E402
from umbp.launcher import LocalPool  # noqa: E402
from umbp.sizes import parse_size  # noqa: E402

from slotclients import DRAIN_S, NS, Clients  # noqa: E402 - the client processes

BUDGET_FILL = 0.8  # of the pool's pages the puts of one phase may take (no eviction, slots' regions not full)
BUSY_OK = 0.9


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
                                                "not_new", "client_cpu_s", "leases", "released", "flushed")}
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
            t0 = turns(pool, op)
            runs.append(phase(clients, op, batch, budget, args, ms_pids, etcd_pid))
            asked, passes = (b - a for a, b in zip(t0, turns(pool, op)))
            runs[-1]["per_pass"] = asked / passes if passes else None
        clients.ask("close")
    for r in runs:
        r.update(processes=processes, slots=slots, clients=len(clients.pipes), window=args.window)
    return runs


def turns(pool, op: str) -> tuple[int, int]:
    """(LOOKUPs, or for ``op`` "put" ALLOCs, answered a turn's at once, their table passes) of every metaserver of
    ``pool`` so far (STATS; metaserver/handlers/turns.py): their ratio is how many a busy metaserver answers with
    one pass."""
    with umbp.Client(pool.metaserver, namespace=NS) as c:
        s = c.stats()
    if op == "put":
        return s.get("turn_allocs", 0), s.get("turn_alloc_passes", 0)
    return s.get("turn_lookups", 0), s.get("turn_passes", 0)


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
    p.add_argument("--parents", default="chain", choices=("chain", "none"),
                   help="puts: chain (default) names each page's predecessor in its batch as its parent, as SGLang's "
                        "and vLLM's puts do; none names none")
    p.add_argument("--headline-batch", type=int, default=128, help="request size of the headline ratio")
    p.add_argument("--lookup-keys", default="digests", choices=("digests", "keys"),
                   help="LOOKUPs carry each key's 32-byte digest as umbp.Client sends them to a metaserver that takes "
                        "them (default; a client process's keys past keyform.MEMO_KEYS are hashed, not kept), or the "
                        "keys themselves (the metaserver hashes each)")
    p.add_argument("--release", default="next", choices=("next", "frame"),
                   help="a LOOKUP's read leases: released in the next LOOKUP to that process, as umbp.Client does "
                        "(default), or each by a RELEASE frame of its own")
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
    """A phase's LOOKUPs, or ALLOCs, a table pass (``turns``), as printed."""
    x = r.get("per_pass")
    return "-" if x is None else f"{x:.2f}"


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
    clients = Clients(args.clients, args.window, args.page_bytes, args.decode, not args.lookup_parts,
                      args.parents == "chain", args.lookup_keys == "digests", args.release == "next")
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
