"""Issue 16 item 7: the TP split of replicated (MLA) KV over NCCL, one rank process per GPU (the 2-GPU kind of the GPU
machine), against a real local pool (``umbp.launcher.LocalPool``: etcd, a metaserver, one node).

Each rank holds a CUDA KV buffer of the same shape on its own GPU. The ranks store ``--pages`` pages of replicated
KV once (``TPGroup.store``: each rank writes its share), then each rank loads them twice into fresh buffers:
unsplit (``LayerwiseLoader.load_all``: every rank reads every page from the pool) and split (``TPGroup.load_all``:
each rank reads 1/N from the pool, the ranks ``all_gather`` the rest over NCCL). Checked: every page bit for bit on
every rank, both ways; the split's per-rank pool->host and host->device counters against the unsplit load's (1/N
expected). Timed: each load with ``torch.cuda.synchronize`` around it, best of ``--iters``. Nothing asserts: the
figures and checks are printed (and exit 1 when a byte check fails).

    python3 bench/tp_nccl.py [--ranks 2] [--pages 64] [--layers 61] [--tokens 64] [--dim 576] [--iters 3]
                             [--transport auto|tcp] [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rank_main(a) -> dict:
    import torch
    import torch.distributed as dist

    import umbp
    from umbp.engine.loader import LayerwiseLoader
    from umbp.engine.tp import TPGroup
    from umbp.keys import chain_keys

    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(a.rank)
    dev = torch.device("cuda", a.rank) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{a.init}", rank=a.rank,
                            world_size=a.ranks)
    shape = (a.layers, a.pages, a.tokens, a.dim)
    g = torch.Generator().manual_seed(7)  # replicated: the same bytes on every rank
    src = torch.randint(-2**15, 2**15, shape, generator=g, dtype=torch.int16).view(torch.bfloat16).to(dev)
    keys = chain_keys([i & 0xFFFF for i in range(a.pages * a.tokens)], a.tokens)
    slots = list(range(a.pages))
    out: dict = {"rank": a.rank}
    with umbp.Client(a.ms, namespace="tp-nccl", transport=a.transport) as c:
        stored = TPGroup(c, src, replicated=True, group_size=a.group).store(keys, slots)
        out["stored"] = sum(stored)
        dist.barrier()
        for name in ("unsplit", "split"):
            best = None
            for _ in range(a.iters):
                dst = torch.zeros(shape, dtype=torch.bfloat16, device=dev)
                ld = (LayerwiseLoader(c, dst, group_size=a.group) if name == "unsplit"
                      else TPGroup(c, dst, replicated=True, group_size=a.group))
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                pages = ld.load_all(keys, slots)
                sync()
                dt = time.perf_counter() - t0
                best = dt if best is None else min(best, dt)
                out[f"{name}_pages"] = pages
                out[f"{name}_exact"] = bool(torch.equal(dst.view(torch.int16), src.view(torch.int16)))
                out[f"{name}_counters"] = dict(ld.counters)
                del dst
            out[f"{name}_s"] = best
    dist.barrier()
    dist.destroy_process_group()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dim", type=int, default=576, help="latent + rope per token, bf16 (DeepSeek-V3: 512 + 64)")
    ap.add_argument("--group", type=int, default=8, help="layers per load group")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda: NCCL, a GPU per rank; cpu: gloo (a smoke run of the same code anywhere)")
    ap.add_argument("--transport", default="auto", help="the ranks' client transport (tcp: as from another host)")
    ap.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--init", default="", help=argparse.SUPPRESS)
    ap.add_argument("--ms", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank >= 0:
        print("RESULT " + json.dumps(rank_main(a)), flush=True)
        return
    from umbp.launcher import LocalPool

    kv_bytes = a.layers * a.pages * a.tokens * a.dim * 2
    cap = max(1 << 30, 3 * kv_bytes)
    with LocalPool(nodes=1, capacity=cap, port=0, metrics=False) as pool, tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "dist-init")
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--ranks", str(a.ranks), "--init", init,
                                   "--ms", pool.metaserver, "--pages", str(a.pages), "--layers", str(a.layers),
                                   "--tokens", str(a.tokens), "--dim", str(a.dim), "--group", str(a.group),
                                   "--iters", str(a.iters), "--device", a.device,
                                   "--transport", a.transport],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(a.ranks)]
        res = []
        for p in procs:
            so, se = p.communicate(timeout=500)
            if p.returncode != 0:
                print(f"rank exited {p.returncode}:\n{se[-3000:]}", file=sys.stderr)
                sys.exit(1)
            res.append(json.loads([ln for ln in so.splitlines() if ln.startswith("RESULT ")][-1][7:]))
    gb = kv_bytes / 1e9
    backend = "NCCL" if a.device == "cuda" else "gloo"
    print(f"TP{a.ranks} over {backend}, replicated KV {kv_bytes / 2**20:.0f} MiB ({a.pages} pages x {a.layers} "
          f"layers x {a.tokens} tokens x {a.dim} bf16), groups of {a.group} layers, best of {a.iters}")
    ok = True
    for r in sorted(res, key=lambda x: x["rank"]):
        u, s = r["unsplit_counters"], r["split_counters"]
        ok &= r["unsplit_exact"] and r["split_exact"]
        share = s.get("pool_to_host_bytes", 0) / max(1, u.get("pool_to_host_bytes", 1))
        print(f"rank {r['rank']}: stored {r['stored']} pages; unsplit {r['unsplit_s'] * 1e3:.1f} ms "
              f"({gb / r['unsplit_s']:.1f} GB/s) exact {r['unsplit_exact']}; split {r['split_s'] * 1e3:.1f} ms "
              f"({gb / r['split_s']:.1f} GB/s) exact {r['split_exact']}; split/unsplit time "
              f"{r['split_s'] / r['unsplit_s']:.2f}x; pool->host {s.get('pool_to_host_bytes')} of "
              f"{u.get('pool_to_host_bytes')} B ({share:.3f}), host->device {s.get('host_to_device_bytes')} of "
              f"{u.get('host_to_device_bytes')} B, exchange {s.get('exchange_bytes')} B")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
