"""Layer-wise loading benchmark: time to the first ready layer group vs the whole prefix, against a real local pool.

Stores a prefix of ``--pages`` page-first pages (``--layers`` layers of ``--layer-kib`` KiB each) from a KV buffer
(CPU, or CUDA with ``--device cuda``), then loads it back into other slots with ``--groups`` layer groups and
reports, per transport path (shm via the mapped arena; tcp ranged reads):
- first: from ``load()`` to the first group being usable (CPU: yielded; CUDA: its event passed),
- whole: from ``load()`` to the last group being usable,
- first/whole (the target is at most 1/4 with 8 groups), and the same prefix loaded as one group;
- offload: the prefix's slots stored under fresh keys by ``LayerwiseLoader.store`` and by ``PipelinedStore`` (the
  SGLang linker's path), GB/s and its ratio to the whole-prefix load rate (target >= 0.5x), with the path the bytes
  took (``device_to_pool``: the kernel straight into a same-host arena; ``device_to_host``: staged through pinned
  memory); the keys are removed after each run.
Bytes are checked after every load and offload. Median of ``--iters`` runs. Without ``--metaserver`` a pool is started with
``python -m umbp up`` (needs etcd on PATH or next to this Python) and stopped at the end.

    python3 bench/layerwise.py [--device cpu|cuda] [--pages 256] [--layers 32] [--groups 8] [--layer-kib 8]
    python3 bench/layerwise.py --device cuda --pages 512 --layers 32 --layer-kib 128   # 2 GiB, 4 MiB pages
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]


def start_pool(nodes: int, capacity: int) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p))
    p = subprocess.Popen([sys.executable, "-m", "umbp", "up", "--nodes", str(nodes), "--capacity", str(capacity),
                          "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         start_new_session=True)
    deadline = time.monotonic() + 60
    lines = []
    while time.monotonic() < deadline:  # bounded: `umbp up` prints the address once it serves
        line = p.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.match(r"metaserver: (\S+)", line)
        if m:
            return p, m.group(1)
    stop_pool(p)
    raise SystemExit("layerwise: `umbp up` did not come up:\n" + "".join(lines[-20:]))


def stop_pool(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--metaserver", help="use this pool instead of starting one")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--layer-kib", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--transports", default="shm,tcp")
    ap.add_argument("--json", help="write the figures here as JSON")
    args = ap.parse_args()

    import torch

    import umbp
    from umbp.engine.layout import PagedKV
    from umbp.engine.loader import LayerwiseLoader
    from umbp.engine.offload import PipelinedStore

    L, n = args.layers, args.pages
    if L % args.groups:
        raise SystemExit(f"layerwise: --layers {L} is not a multiple of --groups {args.groups}")
    row = args.layer_kib * 1024
    page = L * row
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    pool = None
    addr = args.metaserver
    if not addr:
        # room for the prefix and one offloaded copy of it (removed after each run), with slack: nothing evicted
        pool, addr = start_pool(2, max(64 << 20, (n * page * 9) // 4 // 2 + (8 << 20)))
    results: dict = {"pages": n, "layers": L, "groups": args.groups, "page_bytes": page, "device": str(dev),
                     "paths": {}}
    try:
        src_t = torch.randint(0, 256, (L, 2 * n, row), dtype=torch.uint8, device=dev)
        dst_t = torch.zeros_like(src_t)
        src, dst = PagedKV(src_t), PagedKV(dst_t)
        src_slots = list(range(n))
        dst_slots = list(range(2 * n - 1, n - 1, -1))
        keys = [f"layerwise-{L}x{row}-{i}" for i in range(n)]
        print(f"prefix: {n} pages x {L} layers x {row // 1024} KiB = {n * page / 2**20:.0f} MiB, {args.groups} groups "
              f"of {L // args.groups} layers, KV on {dev}")
        with umbp.Client(addr) as c:
            LayerwiseLoader(c, src).store(keys, src_slots)
        want = src_t[:, :n].flip(1)  # dst slot 2n-1-i holds page i

        def one(loader: LayerwiseLoader) -> tuple[float, float]:
            dst_t.zero_()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            first = None
            with loader.load(keys, dst_slots) as load:
                for grp in load:
                    if first is None:
                        grp.synchronize()
                        first = time.perf_counter() - t0
                    last = grp
                last.synchronize()
            whole = time.perf_counter() - t0
            lookups.append((load.marks["lookup"] or t0) - load.marks["start"])
            if load.pages != n or not torch.equal(dst_t[:, n:], want):
                raise SystemExit(f"layerwise: bytes differ after a load ({load.pages} of {n} pages)")
            return first, whole

        def offload(c, storer, name: str, kind: str, it: int) -> float:
            """One offload of the prefix's slots under fresh keys; bytes of the first and last page checked, keys
            removed afterwards (the pool keeps room for one copy)."""
            okeys = [f"layerwise-offload-{name}-{kind}-{it}-{i}" for i in range(n)]
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            stored = storer.store(okeys, src_slots)
            took = time.perf_counter() - t0
            back = [torch.zeros(page, dtype=torch.uint8) for _ in range(2)]
            got = c.batch_get_into([okeys[0], okeys[-1]], back)
            want = [src_t[:, s].reshape(-1).cpu() for s in (src_slots[0], src_slots[-1])]
            if not all(stored) or got != [page] * 2 or not all(torch.equal(b, w) for b, w in zip(back, want)):
                raise SystemExit(f"layerwise: offload {kind} over {name}: bytes differ or pages not stored")
            c.batch_remove(okeys)
            return took

        for name in args.transports.split(","):
            mapped = name == "shm"
            lookups: list[float] = []
            with umbp.Client(addr, transport=name) as c:
                # one loader per shape, reused: an engine keeps its loader (and its arena registrations)
                grouped = LayerwiseLoader(c, dst, group_size=L // args.groups, use_mapped=mapped)
                whole_one = LayerwiseLoader(c, dst, group_size=L, use_mapped=mapped)
                try:
                    one(grouped)  # warm-up: connections, mappings, registrations
                    one(whole_one)
                    runs = [one(grouped) for _ in range(args.iters)]
                    mono = [one(whole_one)[1] for _ in range(args.iters)]
                    ctr = {k: v // (args.iters + 1) for k, v in grouped.counters.items()}  # per load
                finally:
                    grouped.close()
                    whole_one.close()
            first = statistics.median(r[0] for r in runs)
            whole = statistics.median(r[1] for r in runs)
            whole1 = statistics.median(mono)
            lookup = statistics.median(lookups)
            results["paths"][name] = {"first_s": first, "whole_s": whole, "ratio": first / whole,
                                      "one_group_s": whole1, "mapped_lookup_s": lookup if mapped else None,
                                      "gbs": n * page / whole / 1e9,
                                      "pool_to_host_bytes": ctr["pool_to_host_bytes"],
                                      "zero_copy_bytes": ctr["zero_copy_bytes"]}
            print(f"{name:4s} first group {first * 1e3:8.2f} ms   whole prefix {whole * 1e3:8.2f} ms   "
                  f"first/whole {first / whole:.3f}   ({n * page / whole / 1e9:.2f} GB/s; "
                  + (f"mapped LOOKUP {lookup * 1e3:.2f} ms of the first; " if mapped else "") + "as one group "
                  f"{whole1 * 1e3:.2f} ms; pool->host {ctr['pool_to_host_bytes'] >> 20} MiB, zero-copy "
                  f"{ctr['zero_copy_bytes'] >> 20} MiB)")
            load_gbs = n * page / whole / 1e9
            with umbp.Client(addr, transport=name) as c:
                for kind, make in (("store", lambda: LayerwiseLoader(c, src, group_size=L, use_mapped=False)),
                                   ("pipelined", lambda: PipelinedStore(c, src, L))):
                    with make() as storer:
                        secs = [offload(c, storer, name, kind, it) for it in range(args.iters + 1)][1:]
                        per = {k: v // (args.iters + 1) for k, v in storer.counters.items()}
                    best = min(secs)
                    gbs = n * page / best / 1e9
                    results["paths"][name][f"offload_{kind}"] = {
                        "s": best, "gbs": gbs, "vs_load": gbs / load_gbs,
                        "device_to_pool_bytes": per["device_to_pool_bytes"],
                        "device_to_host_bytes": per["device_to_host_bytes"]}
                    print(f"{name:4s} offload ({kind:9s}) {best * 1e3:8.2f} ms   {gbs:6.2f} GB/s   "
                          f"{gbs / load_gbs:.2f}x the load ({load_gbs:.2f} GB/s)   per run: device->pool "
                          f"{per['device_to_pool_bytes'] >> 20} MiB (kernel), device->host "
                          f"{per['device_to_host_bytes'] >> 20} MiB (staged)")
    finally:
        if pool is not None:
            stop_pool(pool)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
