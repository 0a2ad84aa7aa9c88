"""Issue 16 item 7: the TP split of replicated (MLA) KV over NCCL, one rank process per GPU (the 2-GPU kind of the GPU
machine), against a real local pool (``umbp.launcher.LocalPool``: etcd, a metaserver, one node).

Each rank holds a CUDA KV buffer of the same shape on its own GPU. The ranks store ``--pages`` pages of replicated
KV once (``TPGroup.store``: each rank writes its share), then each rank loads them twice into fresh buffers:
unsplit (``LayerwiseLoader.load_all``: every rank reads every page from the pool) and split (``TPGroup.load_all``:
each rank reads 1/N from the pool, the ranks ``all_gather`` the rest over NCCL). Checked: every page bit for bit on
every rank, both ways; the split's per-rank pool->host and host->device counters against the unsplit load's (1/N
expected). Timed: each load with ``torch.cuda.synchronize`` around it, best of ``--iters``. Nothing asserts: the
figures and checks are printed (and exit 1 when a byte check fails).

``--linker``: the same through SGLang's own linker factory (``UmbpDirectLinker`` over SGLang's ``MLATokenToKVPool``
of ``--dim`` = 512 latent + 64 rope), ``tp_split`` false against true: rank 0 offloads, then every rank drives the
linker's load contract (``load``, ``start_layer_wise_loading``, per layer ``wait_until``, ``finish``) into other
slots; the split linker's per-rank counters are its ``TPGroup``'s. It needs SGLang importable (the engines venv here;
on the GPU machine ``scripts/gpu-kit.sh``'s kit: carry ``.gpu``, run under ``.gpu/run.sh``).

    python3 bench/tp_nccl.py [--ranks 2] [--pages 64] [--layers 61] [--tokens 64] [--dim 576] [--iters 3]
                             [--transport auto|tcp] [--device cuda|cpu] [--linker]
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
    if a.linker:
        out = linker_rank(a, dev, sync)
        dist.barrier()
        dist.destroy_process_group()
        return out
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


def linker_rank(a, dev, sync) -> dict:
    """``rank_main`` through SGLang's linker (``--linker``): unsplit and split ``UmbpDirectLinker`` on one
    ``MLATokenToKVPool``; rank 0 offloads pages 1..P, every rank loads them into pages P+1..2P."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker

    from umbp.integrations.sglang import LINKER_CLASS, LINKER_MODULE
    from umbp.keys import chain_keys

    P, T = a.pages, a.tokens
    pool = MLATokenToKVPool(size=(2 * P + 1) * T, page_size=T, dtype=torch.bfloat16, kv_lora_rank=a.dim - 64,
                            qk_rope_head_dim=64, layer_num=a.layers, device=str(dev), enable_memory_saver=False)
    g = torch.Generator().manual_seed(7)  # replicated: the same bytes on every rank
    src = slice(T, (P + 1) * T)
    dst = slice((P + 1) * T, (2 * P + 1) * T)
    for t in pool.kv_buffer:
        rows = t[src]
        rows.copy_(torch.randint(-2**15, 2**15, rows.shape, generator=g, dtype=torch.int16).view(rows.dtype)
                   .to(dev))
    params = SimpleNamespace(page_size=T, token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: pool),
                             tp_cache_group=None, attn_tp_cache_group=None, pp_rank=0, pp_size=1)
    keys = chain_keys([i & 0xFFFF for i in range(P * T)], T, extra_key="tp-linker")
    out: dict = {"rank": a.rank}
    linkers = {}
    for name, split in (("unsplit", False), ("split", True)):  # built in the same order on every rank (collective)
        config = {"linker": LINKER_CLASS, "linker_module_path": LINKER_MODULE,
                  "linker_extra_config": {"metaserver": a.ms, "namespace": "tp-linker", "transport": a.transport,
                                          "layer_group_size": a.group, "tp_split": split}}
        linkers[name] = create_unified_cache_linker(SimpleNamespace(model_path="bench/tp-linker"), params,
                                                    backend="dynamic", config=config, components=set(),
                                                    forward_stream=None)
    first = linkers["unsplit"]
    sync()
    first.offload([PoolTransfer(PoolName.KV, device_indices=torch.arange(src.start, src.stop), keys=keys)])
    first.offload_queue.join()
    out["stored"] = first.storer.counters["pages_stored"]
    dist.barrier()
    for name, lk in linkers.items():
        best = None
        for i in range(a.iters):
            for t in pool.kv_buffer:
                t[dst].zero_()
            assert lk.load(f"b{i}", [PoolTransfer(PoolName.KV, device_indices=torch.arange(dst.start, dst.stop),
                                                  keys=keys)])
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            index = lk.start_layer_wise_loading()
            counter = lk.layer_done_counter
            counter.set_consumer(index)
            for layer in range(lk.num_layers):
                counter.wait_until(layer)
            ok = lk.finish_layer_wise_loading(index)
            sync()
            dt = time.perf_counter() - t0
            lk.load_queue.join()
            best = dt if best is None else min(best, dt)
            out[f"{name}_pages"] = P if ok else 0
            out[f"{name}_exact"] = bool(ok) and all(torch.equal(t[dst].view(torch.int16), t[src].view(torch.int16))
                                                    for t in pool.kv_buffer)
        out[f"{name}_s"] = best
        out[f"{name}_counters"] = dict(lk.tp.counters if lk.tp is not None else lk.loader.counters)
        out[f"{name}_stats"] = {k: lk.stats[k] for k in ("loads", "split_loads", "load_failures")}
    for lk in linkers.values():
        lk.close()
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
    ap.add_argument("--linker", action="store_true", help="through SGLang's linker factory, tp_split false vs true")
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
                                   "--transport", a.transport] + ["--linker"] * a.linker,
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
    print(f"TP{a.ranks} over {backend}{', through the SGLang linker' if a.linker else ''}, replicated KV {kv_bytes / 2**20:.0f} MiB ({a.pages} pages x {a.layers} "
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
