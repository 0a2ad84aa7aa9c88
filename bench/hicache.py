"""HiCache backend benchmark (issue 16, item 3): SGLang's ``batch_set_v1`` / ``batch_get_v1`` through
``UmbpHiCacheStorage`` between SGLang's real host KV pool and a same-host pool, for the ``page_first`` and
``layer_first`` layouts, beside baselines measured in the same run on the same bytes:

- the plain API: ``Client.batch_put`` / ``Client.batch_get_into`` of objects of the same size from and into flat
  host tensors (the rate the backend should match: it is the same client underneath);
- the host's own copies of exactly the pieces the backend moves (host pool -> host pool): one thread, and as many
  plain threads as ``umbp.copies`` may use (``np.copyto``: numpy releases the GIL), both over equal byte shares of
  the pieces and over whole objects (one strided copy an object where its pieces are evenly spaced, as layer_first
  ones are); the "N-thread copy" baseline is the better of the two.

What a round does: pages of SGLang-identical chained keys are set from the first half of the host pool in calls of
``--batch`` pages (as the cache controller's backup does), then got into the second half (its prefetch); every page
got is compared bit for bit with the page set (``torch.equal`` over int16 views of the page's K and V), and the objects are removed so the
next round writes fresh ones. The figure is the best round (a small shared machine has bursts of foreign load).

Layouts: ``page_first`` gives one contiguous run per object (the page's K, or V, for every layer), ``layer_first``
``layers`` runs per object (one per layer), written back to back (``batch_put_ranges``) and read with one range per
run (``batch_get_ranges_into``).

Needs SGLang's host pool classes (``sglang.srt.mem_cache.pool_host``): ``.venv/sglang-linker/bin/python
bench/hicache.py`` here; on the GPU machine the carried SGLang tree (``scripts/gpu-kit.sh``). With CUDA the host
pool is pinned (``pin_memory=True``, as SGLang allocates it) and the device pool it mirrors lives on the GPU; the
copies measured are host copies either way (arena -> host pool), so the GPU is not on the path measured.

Nothing here asserts speed; a page that comes back different, or a call that reports False, exits 1.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import ctypes
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import umbp  # noqa: E402
from umbp import copies  # noqa: E402
from umbp.buffers import HostSpans, Rows  # noqa: E402
from umbp import keys as umbp_keys  # noqa: E402
from umbp.launcher import LocalPool  # noqa: E402

MiB = 1 << 20


def host_pool(layout: str, pages: int, page_tokens: int, layers: int, heads: int, head_dim: int, cuda: bool,
              dtype: torch.dtype = torch.bfloat16):
    """SGLang's ``MHATokenToKVPoolHost`` of ``pages`` pages over a small device pool (the one it mirrors)."""
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    # an indexed device: SGLang's MHABufferInfo.validate compares it with each tensor's device (cuda:0 != cuda)
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    n_dev = 4 * page_tokens
    k = tuple(torch.zeros(n_dev, heads, head_dim, dtype=dtype, device=dev) for _ in range(layers))
    v = tuple(torch.zeros(n_dev, heads, head_dim, dtype=dtype, device=dev) for _ in range(layers))
    info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=torch.tensor([t.data_ptr() for t in k], device=dev),
                                           v_data_ptrs=torch.tensor([t.data_ptr() for t in v], device=dev),
                                           layout=KVBufferLayout.NHD),
                         page_size=page_tokens, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
                         dtype=dtype, device=dev)
    # device="cpu" as SGLang's pool assembler leaves it: the host pool is host memory (pinned with CUDA)
    pool = MHATokenToKVPoolHost(info, 2.0, 0, page_tokens, layout, pin_memory=cuda, device="cpu",
                                device_capacity_tokens=n_dev, start_layer=0, end_layer=layers,
                                host_token_capacity=pages * page_tokens)
    pool._keepalive = info  # the device buffers its pointer tables refer to
    return pool


def load_backend(metaserver: str, pool, model_name: str = "bench/llama-8b"):
    """As SGLang's cache controller does: its factory builds the backend, then the host pool is registered."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    extra = {"backend_name": "umbp", "module_path": "umbp.integrations.sglang.hicache",
             "class_name": "UmbpHiCacheStorage", "metaserver": metaserver, "interface_v1": 1}
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                               model_name=model_name, extra_config=extra)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    backend.register_mem_pool_host(pool)
    return backend


def indices(pages: range, page_tokens: int) -> torch.Tensor:
    return torch.arange(pages.start * page_tokens, pages.stop * page_tokens, dtype=torch.int64)


def page_tensors(pool, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The page's K and V as host tensors (views, whatever the layout)."""
    t = pool.page_size
    if pool.layout == "layer_first":
        return pool.k_buffer[:, page * t:(page + 1) * t], pool.v_buffer[:, page * t:(page + 1) * t]
    return pool.k_buffer[page * t:(page + 1) * t], pool.v_buffer[page * t:(page + 1) * t]


def as_rows(parts: list[memoryview]) -> np.ndarray | None:
    """One object's parts as a (parts, length) uint8 array when they are of one length and evenly spaced (a
    layer_first object: one run per layer), else None."""
    n = len(parts[0])
    addrs = [copies.address(p) for p in parts]
    step = addrs[1] - addrs[0] if len(parts) > 1 else n
    if any(len(p) != n for p in parts) or step < n or any(b - a != step for a, b in zip(addrs, addrs[1:])):
        return None
    buf = (ctypes.c_ubyte * ((len(parts) - 1) * step + n)).from_address(addrs[0])
    return np.ndarray((len(parts), n), np.uint8, buffer=buf, strides=(step, 1))


def runs_of(objects: list[list]) -> list[list[memoryview]]:
    """Each object's parts as flat views, an object given as ``Rows`` (layer_first) cut into its runs."""
    return [[v for p in ps for v in (p.views() if type(p) is Rows else (p,))] for ps in objects]


def copy_rates(objects: list[tuple[list[memoryview], list[memoryview]]], rounds: int) -> dict:
    """GB/s of copying every object's (dst parts, src parts), best of ``rounds``: one thread piece by piece; plain
    threads over equal byte shares of the pieces (``np.copyto`` each: numpy releases the GIL); plain threads over
    whole objects, one strided ``np.copyto`` an object where its parts are evenly spaced; ``umbp.copies``."""
    pairs = [(d, s) for ds, ss in objects for d, s in zip(ds, ss)]
    nbytes = sum(len(s) for _d, s in pairs)
    threads = copies.max_threads()
    arrays = [(np.frombuffer(d, np.uint8), np.frombuffer(s, np.uint8)) for d, s in pairs]
    shares: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(threads)]
    step = -(-nbytes // threads)
    t, room = 0, step
    for d, s in arrays:  # equal shares of bytes, pieces cut where a share ends
        pos = 0
        while pos < s.size:
            n = min(room, s.size - pos)
            shares[t].append((d[pos:pos + n], s[pos:pos + n]))
            pos += n
            room -= n
            if room == 0 and t + 1 < threads:
                t, room = t + 1, step
    whole: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(threads)]
    for i, (ds, ss) in enumerate(objects):  # objects dealt round robin (they are all one size)
        d2, s2 = as_rows(ds), as_rows(ss)
        whole[i % threads] += [(d2, s2)] if d2 is not None and s2 is not None else \
            [(np.frombuffer(d, np.uint8), np.frombuffer(s, np.uint8)) for d, s in zip(ds, ss)]

    def one() -> None:
        for d, s in arrays:
            np.copyto(d, s)

    def share(items) -> None:
        for d, s in items:
            np.copyto(d, s)

    with cf.ThreadPoolExecutor(threads) as ex:
        fns = {"memcpy": one, "threads_pieces": lambda: list(ex.map(share, shares)),
               "threads_objects": lambda: list(ex.map(share, whole)), "copies": lambda: copies.copy_pairs(pairs)}
        out = {}
        for name, fn in fns.items():
            best = 0.0
            for _ in range(rounds):
                t0 = time.perf_counter()
                fn()
                best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
            out[name] = best
    out["threads"] = max(out["threads_pieces"], out["threads_objects"])
    return out


def run_layout(ms: str, layout: str, args, cuda: bool) -> dict:
    pool = host_pool(layout, 2 * args.pages, args.page_tokens, args.layers, args.heads, args.head_dim, cuda)
    backend = load_backend(ms, pool)
    client = backend.client
    n, pt, batch = args.pages, args.page_tokens, args.batch
    g = torch.Generator().manual_seed(7)
    for p in range(n):
        for half in page_tensors(pool, p):
            half.view(torch.int16).copy_(torch.randint(-30000, 30000, half.shape, generator=g, dtype=torch.int16))
    page_bytes = pool.get_size_per_token() * pt
    total = n * page_bytes
    sets, gets = [], []
    for r in range(args.rounds):
        keys = umbp_keys.chain_keys(list(range(r * n * pt, (r + 1) * n * pt)), pt, extra_key=f"{layout}-{r}")
        for p in range(n, 2 * n):  # the destination pages hold something else before each round
            for half in page_tensors(pool, p):
                half.zero_()
        t0 = time.perf_counter()
        for b in range(0, n, batch):
            pages = range(b, min(n, b + batch))
            ok = backend.batch_set_v1(keys[pages.start:pages.stop], indices(pages, pt))
            if not all(ok):
                raise SystemExit(f"{layout}: batch_set_v1 reported {ok.count(False)} pages not stored")
        sets.append(total / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        for b in range(0, n, batch):
            pages = range(b, min(n, b + batch))
            ok = backend.batch_get_v1(keys[pages.start:pages.stop], indices(range(n + b, n + pages.stop), pt))
            if not all(ok):
                raise SystemExit(f"{layout}: batch_get_v1 reported {ok.count(False)} pages missing")
        gets.append(total / (time.perf_counter() - t0) / 1e9)
        for p in range(n):
            for a, b_ in zip(page_tensors(pool, p), page_tensors(pool, n + p)):
                if not torch.equal(a.view(torch.int16), b_.view(torch.int16)):  # bits: random bf16 holds NaNs
                    raise SystemExit(f"{layout}: page {p} came back with different bytes (round {r})")
        names = backend.naming.kv_objects(keys)
        if sum(client.batch_remove(names)) != len(names):
            raise SystemExit(f"{layout}: not every object of round {r} was there to remove")
    # the same host pieces the backend moved, copied host pool -> host pool, for the copy baselines
    src, dst = [], []
    for b in range(0, n, batch):
        pages = range(b, min(n, b + batch))
        src += as_parts(backend._kv_parts(pool, [""] * len(pages), indices(pages, pt))[1])
        dst += as_parts(backend._kv_parts(pool, [""] * len(pages), indices(range(n + b, n + pages.stop), pt))[1])
    src, dst = runs_of(src), runs_of(dst)
    rates = copy_rates(list(zip(dst, src)), args.rounds)
    parts = sum(len(p) for p in src) // (2 * n)
    backend.close()
    return {"set": max(sets), "get": max(gets), **rates, "parts_per_object": parts, "page_bytes": page_bytes}


def as_parts(objs) -> list:
    """The backend's objects of a batch as lists of views (``HostSpans``: one view a span)."""
    return [[v] for v in objs.views()] if type(objs) is HostSpans else objs


def plain_api(ms: str, args) -> dict:
    """``batch_put`` / ``batch_get_into`` of objects of the same size (a page's K and V), in calls of the same
    pages, from and into flat host tensors (pinned with CUDA, as the host pool is)."""
    obj = args.page_tokens * args.layers * args.heads * args.head_dim * 2  # bf16
    n = 2 * args.pages  # two objects a page
    pin = torch.cuda.is_available()
    src = torch.randint(0, 255, (n, obj), dtype=torch.uint8).pin_memory() if pin else \
        torch.randint(0, 255, (n, obj), dtype=torch.uint8)
    dst = torch.zeros((n, obj), dtype=torch.uint8, pin_memory=pin)
    per_call = 2 * args.batch
    with umbp.Client(metaserver=ms, namespace="bench-plain") as c:
        puts, gets = [], []
        for r in range(args.rounds):
            keys = [f"plain-{r}-{i}" for i in range(n)]
            dst.zero_()
            t0 = time.perf_counter()
            for b in range(0, n, per_call):
                if not all(c.batch_put(keys[b:b + per_call], list(src[b:b + per_call]))):
                    raise SystemExit("plain API: a put found its key already there")
            puts.append(n * obj / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            for b in range(0, n, per_call):
                got = c.batch_get_into(keys[b:b + per_call], list(dst[b:b + per_call]))
                if got != [obj] * len(got):
                    raise SystemExit("plain API: a get missed")
            gets.append(n * obj / (time.perf_counter() - t0) / 1e9)
            if not torch.equal(src, dst):
                raise SystemExit("plain API: bytes differ")
            c.batch_remove(keys)
    return {"put": max(puts), "get": max(gets)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=128, help="pages per round (each set, then got)")
    ap.add_argument("--batch", type=int, default=32, help="pages per batch_set_v1 / batch_get_v1 call")
    ap.add_argument("--page-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layouts", default="page_first,layer_first")
    ap.add_argument("--capacity", default="", help="node arena (default: twice a round's bytes)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    page = args.page_tokens * args.layers * args.heads * args.head_dim * 2 * 2
    cap = args.capacity or f"{2 * args.pages * page + (256 << 20)}"
    print(f"umbp bench/hicache.py: {args.pages} pages of {page / MiB:.1f} MiB ({args.layers} layers, {args.heads} "
          f"KV heads x {args.head_dim}, bf16, {args.page_tokens} tokens) per round, {args.batch} pages a call, "
          f"{args.rounds} rounds; host pool pinned: {cuda}; {copies.max_threads()} copy threads", flush=True)
    rows = []
    with LocalPool(nodes=1, capacity=cap, port=0, metrics=False) as lp:
        plain = plain_api(lp.metaserver, args)
        for layout in args.layouts.split(","):
            r = run_layout(lp.metaserver, layout, args, cuda)
            name = f"{layout} ({r['parts_per_object']} run{'s' if r['parts_per_object'] > 1 else ''} an object)"
            rows.append((f"hicache batch_get_v1 {name}", r["get"], "plain batch_get_into", plain["get"]))
            rows.append((f"hicache batch_set_v1 {name}", r["set"], "plain batch_put", plain["put"]))
            rows.append((f"hicache batch_get_v1 {name}", r["get"], f"{copies.max_threads()}-thread copy", r["threads"]))
            rows.append((f"hicache batch_set_v1 {name}", r["set"], f"{copies.max_threads()}-thread copy", r["threads"]))
            for what, key in (("memcpy 1 thread", "memcpy"), ("threads, piece by piece", "threads_pieces"),
                              ("threads, an object a strided copy", "threads_objects"), ("umbp.copies", "copies")):
                rows.append((f"{what}, {layout} pieces (info)", r[key], f"{copies.max_threads()}-thread copy",
                             r["threads"]))
    print("\n=== figure GB/s | baseline GB/s | ratio (target: backend >= 0.8x the plain API) ===")
    for name, v, base, b in rows:
        print(f"{name:<58} {v:7.2f} | {base:<24} {b:7.2f} | {v / b:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
