"""End-to-end engine benchmark: a real transformer's KV through the pool, writer and reader in separate processes.

A Llama-architecture model with random weights (transformers' ``LlamaConfig`` + ``LlamaForCausalLM(config)``, seeded:
no download) prefills a prompt in a *writer* process, which stores its KV in the pool as page-first pages (each page
``[layers, K|V, kv_heads, page_tokens, head_dim]``) under SGLang-identical chained keys (``umbp.keys.chain_keys``).
A *reader* process builds the same model, finds the prefix with ``prefix_hits``, loads it and decodes the last prompt
token; its reference is its own recompute (prefill of the prefix, then the same decode step). Per path it checks the
loaded KV bit for bit against the recompute's KV and the next-token logits for exact equality, and prints the load
time, GB/s and TTFT (load + decode) against recompute (prefill + decode):

- ``plain``: ``Client.batch_get_into`` into one buffer per page on the model's device (CUDA outs: the gather kernel
  straight from the mapped arena on a same-host pool; CPU: the shm copy, threaded for big batches);
- ``layerwise``: ``umbp.engine.LayerwiseLoader`` into a paged KV buffer (``PagedKV`` of per-layer K and V slots),
  all groups, then the decode;
- ``layerwise_groups``: the same loader with ``--groups`` layer groups, waited group by group;
- ``layerwise_cache_layout``: the loader straight into the model's own cache layout (per layer K and V
  ``[1, heads, tokens, head_dim]``, one PagedKV part per head): no permute before the decode; its TTFT is the best of
  whole runs (load, cache, decode);
- ``overlap``: TTFT with layer-wise overlap: the same cache-layout load in ``--groups`` groups, the decode's layers
  enqueued behind their group's arrival (``decode_overlapped``: the compute stream waits for each group's event);
  its logits are checked for the same next token and printed as exact or not (exact on an H100 with cuDNN's
  attention off, see ``build_model``);
- ``offload_plain``: ``LayerwiseLoader.store`` of the loaded KV under new keys, and ``offload``: the SGLang linker's
  offload (``umbp.engine.offload.PipelinedStore``: chunks whose device-to-host copy overlaps the previous put), GB/s
  beside the layer-wise load;
- ``hicache``: SGLang's HiCache storage backend (``UmbpHiCacheStorage``, loaded by SGLang's own factory): the
  writer copies its KV into SGLang's host pool (``MHATokenToKVPoolHost``, ``page_first``, pinned on CUDA) and
  stores it with ``batch_set_v1``; the reader gets it into its own host pool with ``batch_get_v1``, uploads the
  filled part to the model's device in one copy, and decodes (TTFT = get + upload + decode). Needs SGLang's host
  pool classes (the linker venv here, ``scripts/gpu-kit.sh``'s kit on the GPU machine); without them the path says
  SKIPPED and why;
- the writer's ``batch_put`` of the pages (store GB/s; after a first put of one page, timed apart: on CUDA that
  one registers the node's arena with CUDA), and its ``batch_set_v1`` (after a first one-page set, timed apart: the
  backend's own client maps the node's arena at its first transfer).

CPU mode (``--device cpu``, the default, tiny config) is what ``tests/test_engine_e2e.py`` runs in CI; on the GPU
machine: ``python bench/engine_e2e.py --device cuda --preset h200`` (16 layers, 8 KV heads x 128, bf16, 16,384
tokens, 64-token pages: 256 pages of 4 MiB). Prints one JSON line ``E2E {...}`` with every figure; exits 1 when a
byte or logit check fails. Without ``--metaserver`` a pool (etcd, metaserver, one node) is started and stopped here.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PRESETS = {
    # name: (layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, prompt pages, page tokens, dtype)
    "tiny": (2, 64, 4, 2, 16, 128, 128, 6, 16, "float32"),
    "h200": (16, 2048, 16, 8, 128, 5632, 32000, 256, 64, "bfloat16"),
}


def build_model(preset: str, device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, hidden, heads, kv_heads, head_dim, inter, vocab, _pages, _pt, dtype = PRESETS[preset]
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=inter, vocab_size=vocab,
                      max_position_embeddings=1 << 16)
    torch.manual_seed(1234)  # same weights in writer and reader
    if device.startswith("cuda"):
        # cuDNN's attention (which SDPA prefers on H100) is not reproducible: the same cache decoded six times on an
        # H100 (torch 2.11) gave logits up to 0.035 apart; flash and math gave identical ones. Bit-exact logit
        # checks need a reproducible kernel, so both processes use flash (or math) attention.
        torch.backends.cuda.enable_cudnn_sdp(False)
    model = LlamaForCausalLM(cfg).to(dtype=getattr(torch, dtype), device=device).eval()
    return model, cfg


def prompt(preset: str):
    import torch

    _l, _h, _hd, _kv, _d, _i, vocab, pages, page_tokens, _dt = PRESETS[preset]
    g = torch.Generator().manual_seed(99)
    return torch.randint(0, vocab, (pages * page_tokens + 1,), generator=g).tolist(), page_tokens


def timed(fn):
    """``(fn(), seconds it took)`` by the wall clock (a decode or a put: both return only once their work is done)."""
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def kv_of(cache, layer: int):
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def prefill(model, ids, device: str):
    """Prefill ``ids``; returns the cache (DynamicCache)."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids], device=device), use_cache=True)
    return out.past_key_values


def decode(model, cache, token: int, device: str):
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([[token]], device=device), past_key_values=cache, use_cache=True)
    return out.logits[0, -1].float().cpu()


def pages_of(cache, layers: int, pages: int, page_tokens: int):
    """The cache as page-first pages: ``[pages, layers, 2, kv_heads, page_tokens, head_dim]``."""
    import torch

    per_layer = []
    for li in range(layers):
        k, v = kv_of(cache, li)  # [1, H, S, D]
        kv = torch.stack([k[0], v[0]])[:, :, :pages * page_tokens]  # [2, H, S, D]
        h, d = kv.shape[1], kv.shape[3]
        per_layer.append(kv.reshape(2, h, pages, page_tokens, d).permute(2, 0, 1, 3, 4))  # [P, 2, H, T, D]
    return torch.stack(per_layer, dim=1).contiguous()


def cache_from_layers(ks, vs):
    """A DynamicCache from per-layer K and V ``[pages, H, T, D]`` (slot order = page order)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for li, (k, v) in enumerate(zip(ks, vs)):
        p, h, t, d = k.shape
        cache.update(k.permute(1, 0, 2, 3).reshape(1, h, p * t, d), v.permute(1, 0, 2, 3).reshape(1, h, p * t, d), li)
    return cache


def cache_direct(ks, vs):
    """A DynamicCache over per-layer K and V already in its layout ``[1, H, S, D]`` (no permute)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for li, (k, v) in enumerate(zip(ks, vs)):
        cache.update(k, v, li)
    return cache


def hicache_side(ms: str, preset: str, cfg, pages: int, page_tokens: int, dtype, device: str):
    """SGLang's host KV pool (``page_first``, pinned on CUDA) and ``UmbpHiCacheStorage`` over it, built as SGLang's
    cache controller builds them (``bench/hicache.py``'s helpers): ``(pool, backend, None)``, or ``(None, None,
    why)`` where SGLang's host pool does not import."""
    from bench.hicache import host_pool, load_backend

    try:
        pool = host_pool("page_first", pages, page_tokens, cfg.num_hidden_layers, cfg.num_key_value_heads,
                         cfg.head_dim, device.startswith("cuda"), dtype=dtype)
    except ImportError as e:
        return None, None, f"SGLang's host pool does not import: {e}"
    return pool, load_backend(ms, pool, model_name=f"e2e/{preset}"), None


def decode_overlapped(model, load, ks, vs, token: int, pos: int, device: str):
    """Decode ``token`` at position ``pos`` with each layer enqueued behind its group's arrival: ``load`` (a running
    ``LayerLoad`` into ``ks``/``vs``, per layer ``[1, H, S, D]``) yields the groups; the compute stream waits for
    each group's copies (``ReadyGroup.wait``, no host block) before that group's layers, so the GPU runs layer l as
    soon as its KV has landed. The attention mask is the one the model itself builds for this cache length."""
    import torch
    from transformers import DynamicCache
    from transformers.masking_utils import create_causal_mask

    m = model.model
    cache = DynamicCache()
    with torch.no_grad():
        h = m.embed_tokens(torch.tensor([[token]], device=device))
        position_ids = torch.tensor([[pos]], device=device)
        shape_only = DynamicCache()  # the mask depends on the cache length only (the real layers are not here yet)
        shape_only.update(torch.empty_like(ks[0]), torch.empty_like(vs[0]), 0)
        mask = create_causal_mask(config=m.config, inputs_embeds=h, attention_mask=None,
                                  past_key_values=shape_only, position_ids=position_ids)
        pe = m.rotary_emb(h, position_ids=position_ids)
        for g in load:
            g.wait()
            for li in g.layers:
                cache.update(ks[li], vs[li], li)
                h = m.layers[li](h, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                                 use_cache=True, position_embeddings=pe)
        logits = model.lm_head(m.norm(h)[:, -1:, :])
    return logits[0, -1].float().cpu()


def writer(ms: str, preset: str, device: str, q) -> None:
    import torch

    import umbp
    from umbp.keys import chain_keys

    model, cfg = build_model(preset, device)
    ids, page_tokens = prompt(preset)
    npages = (len(ids) - 1) // page_tokens
    cache = prefill(model, ids[:-1], device)
    pages = pages_of(cache, cfg.num_hidden_layers, npages, page_tokens)
    keys = chain_keys(ids[:-1], page_tokens)
    nbytes = pages.numel() * pages.element_size()
    with umbp.Client(metaserver=ms, namespace=f"e2e-{preset}") as c:
        # a client's first put of CUDA tensors registers the node's mapped arena with CUDA (the whole arena, once):
        # one page put and removed first, timed apart, so put_gbps is the rate of puts after it
        sync(device)
        first, first_s = timed(lambda: c.batch_put(["e2e-first-put"], [pages[0]]))
        c.batch_remove(["e2e-first-put"])
        stored, put_s = timed(lambda: c.batch_put(keys, [pages[p] for p in range(npages)]))
    res = {"stored": sum(stored), "pages": npages, "put_s": put_s, "put_gbps": nbytes / put_s / 1e9,
           "first_put_ms": first_s * 1e3, "first_put_stored": sum(first)}
    # the same KV through the HiCache backend: into SGLang's host pool (page_first: [tokens, layers, H, D] per K
    # and V), then batch_set_v1 as the cache controller's backup does
    hpool, backend, why = hicache_side(ms, preset, cfg, npages, page_tokens, pages.dtype, device)
    if backend is None:
        res["hicache_skipped"] = why
    else:
        for li in range(cfg.num_hidden_layers):
            k, v = kv_of(cache, li)
            hpool.k_buffer[:npages * page_tokens, li].copy_(k[0, :, :npages * page_tokens].permute(1, 0, 2))
            hpool.v_buffer[:npages * page_tokens, li].copy_(v[0, :, :npages * page_tokens].permute(1, 0, 2))
        # the backend's client maps the node's arena at its first transfer: a one-page set under another key first,
        # timed apart as for batch_put, so hicache_set_gbps is the rate of a set after it
        every = torch.arange(npages * page_tokens, dtype=torch.int64)  # host pool slots: the pool's first pages
        first, first_set_s = timed(lambda: backend.batch_set_v1(["e2e-first-set"], every[:page_tokens]))
        hstored, set_s = timed(lambda: backend.batch_set_v1(keys, every))
        backend.close()
        res.update(hicache_stored=sum(hstored), hicache_set_s=set_s, hicache_set_gbps=nbytes / set_s / 1e9,
                   first_set_ms=first_set_s * 1e3, first_set_stored=sum(first))
    q.put({"writer": res})


def reader(ms: str, preset: str, device: str, groups: int, iters: int, q) -> None:
    import torch

    import umbp
    from umbp.engine.loader import LayerwiseLoader
    from umbp.engine.offload import PipelinedStore
    from umbp.keys import chain_keys

    model, cfg = build_model(preset, device)
    ids, page_tokens = prompt(preset)
    npages = (len(ids) - 1) // page_tokens
    nl = cfg.num_hidden_layers
    keys = chain_keys(ids[:-1], page_tokens)
    res: dict = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu", "preset": preset,
                 "cudnn_attention": torch.backends.cuda.cudnn_sdp_enabled()}

    def best(fn):
        times, last = [], None
        for _ in range(iters):
            sync(device)
            t = time.perf_counter()
            last = fn()
            sync(device)
            times.append(time.perf_counter() - t)
        return min(times), last

    decode(model, prefill(model, ids[:8], device), ids[8], device)  # warm-up (kernels, allocator)
    rec_s, (ref_cache, ref_logits) = best(lambda: (lambda c: (c, decode(model, c, ids[-1], device)))(
        prefill(model, ids[:-1], device)))
    ref_pages = pages_of(ref_cache, nl, npages, page_tokens)  # pages_of copies: the decode appended a token
    nbytes = ref_pages.numel() * ref_pages.element_size()
    res["recompute_ttft_ms"] = rec_s * 1e3
    res["kv_bytes"] = nbytes
    ok = True
    with umbp.Client(metaserver=ms, namespace=f"e2e-{preset}") as c:
        res["prefix_hits"] = c.prefix_hits(keys)

        # plain API: one out per page on the model's device
        buf = torch.empty_like(ref_pages)
        load_s, got = best(lambda: c.batch_get_into(keys, [buf[p] for p in range(npages)]))
        same_kv = bool(torch.equal(buf.view(torch.uint8), ref_pages.view(torch.uint8)))
        logits, dec_s = timed(lambda: decode(model, cache_from_layers([buf[:, li, 0] for li in range(nl)],
                                                                      [buf[:, li, 1] for li in range(nl)]),
                                             ids[-1], device))
        same_logits = bool(torch.equal(logits, ref_logits))
        ok &= same_kv and same_logits and got == [nbytes // npages] * npages
        res["plain"] = {"load_ms": load_s * 1e3, "gbps": nbytes / load_s / 1e9, "ttft_ms": (load_s + dec_s) * 1e3,
                        "vs_recompute": rec_s / (load_s + dec_s), "kv_exact": same_kv, "logits_exact": same_logits,
                        "transports": c.transport_names(), "kernel_launches": c._device.launches}
        del buf
        ok &= hicache_path(ms, preset, device, Reference(model, cfg, ref_cache, ref_logits, rec_s), best, res)

        # layer-wise loader into a paged KV buffer: per layer (K slots, V slots) [pages, H, T, D]
        shape = ref_pages[:, 0, 0].shape
        dt = ref_pages.dtype
        ks = [torch.empty(shape, dtype=dt, device=device) for _ in range(nl)]
        vs = [torch.empty(shape, dtype=dt, device=device) for _ in range(nl)]
        for name, gs in (("layerwise", nl), ("layerwise_groups", max(1, nl // groups))):
            with LayerwiseLoader(c, list(zip(ks, vs)), group_size=gs) as loader:
                first = []

                def run():
                    with loader.load(keys, list(range(npages))) as ld:
                        t0 = time.perf_counter()
                        for i, g in enumerate(ld):
                            g.synchronize()
                            if i == 0:
                                first.append(time.perf_counter() - t0)
                        return ld.wait_all()

                load_s, loaded = best(run)
            same_kv = all(torch.equal(ks[li].view(torch.uint8), ref_pages[:, li, 0].contiguous().view(torch.uint8))
                          and torch.equal(vs[li].view(torch.uint8), ref_pages[:, li, 1].contiguous().view(torch.uint8))
                          for li in range(nl))
            logits, dec_s = timed(lambda: decode(model, cache_from_layers(ks, vs), ids[-1], device))
            same_logits = bool(torch.equal(logits, ref_logits))
            ok &= same_kv and same_logits and loaded == npages
            res[name] = {"group_size": gs, "load_ms": load_s * 1e3, "gbps": nbytes / load_s / 1e9,
                         "first_group_ms": min(first) * 1e3, "ttft_ms": (load_s + dec_s) * 1e3,
                         "vs_recompute": rec_s / (load_s + dec_s), "kv_exact": same_kv, "logits_exact": same_logits}

        # the loader straight into the model's cache layout: per layer K and V [1, H, S, D] (DynamicCache's own),
        # one PagedKV part per head ([pages, T, D] views, K heads then V heads as in the page bytes): no permute
        h, pt, hd = shape[1], shape[2], shape[3]
        ck = [torch.empty((1, h, npages * pt, hd), dtype=dt, device=device) for _ in range(nl)]
        cv = [torch.empty((1, h, npages * pt, hd), dtype=dt, device=device) for _ in range(nl)]
        parts = [tuple(x[0, hh].view(npages, pt, hd) for x in (ck[li], cv[li]) for hh in range(h)) for li in range(nl)]
        with LayerwiseLoader(c, parts, group_size=nl) as loader:
            def direct():
                with loader.load(keys, list(range(npages))) as ld:
                    n = ld.wait_all()
                cache = cache_direct(ck, cv)
                return n, decode(model, cache, ids[-1], device)

            def load_only():
                with loader.load(keys, list(range(npages))) as ld:
                    return ld.wait_all()

            ttft_s, (loaded, logits) = best(direct)
            load_s, _ = best(load_only)
            # TTFT with layer-wise overlap: the decode's layers enqueued behind their group's arrival
            gs = max(1, nl // groups)
            with LayerwiseLoader(c, parts, group_size=gs) as grouped:
                def overlapped():
                    with grouped.load(keys, list(range(npages))) as ld:
                        out = decode_overlapped(model, ld, ck, cv, ids[-1], len(ids) - 1, device)
                        return ld.wait_all(), out

                ov_s, (ov_loaded, ov_logits) = best(overlapped)
            ov_exact = bool(torch.equal(ov_logits, ref_logits))
            ok &= ov_loaded == npages and int(ov_logits.argmax()) == int(ref_logits.argmax())
            res["overlap"] = {"group_size": gs, "load_ms": ov_s * 1e3, "gbps": nbytes / ov_s / 1e9,
                              "first_group_ms": 0.0, "ttft_ms": ov_s * 1e3, "vs_recompute": rec_s / ov_s,
                              "kv_exact": None, "logits_exact": ov_exact,
                              "logits_max_abs_diff": float((ov_logits - ref_logits).abs().max()),
                              "same_next_token": int(ov_logits.argmax()) == int(ref_logits.argmax())}
        same_kv = all(torch.equal(ck[li][0].view(torch.uint8), kv_of(ref_cache, li)[0][0, :, :npages * pt]
                                  .contiguous().view(torch.uint8)) and
                      torch.equal(cv[li][0].view(torch.uint8), kv_of(ref_cache, li)[1][0, :, :npages * pt]
                                  .contiguous().view(torch.uint8)) for li in range(nl))
        same_logits = bool(torch.equal(logits, ref_logits))
        ok &= same_kv and same_logits and loaded == npages
        res["layerwise_cache_layout"] = {"group_size": nl, "load_ms": load_s * 1e3, "gbps": nbytes / load_s / 1e9,
                                         "first_group_ms": load_s * 1e3, "ttft_ms": ttft_s * 1e3,
                                         "vs_recompute": rec_s / ttft_s, "kv_exact": same_kv,
                                         "logits_exact": same_logits}
        del ck, cv, parts

        # offload of the loaded paged KV: LayerwiseLoader.store with skip_existing, then the SGLang linker's path
        # (umbp.engine.offload.PipelinedStore: chunks, the device-to-host copy overlapping the previous put)
        for name, make in (("offload_plain", lambda: LayerwiseLoader(c, list(zip(ks, vs)), group_size=nl)),
                           ("offload", lambda: PipelinedStore(c, list(zip(ks, vs)), nl))):
            with make() as loader:
                times, stored = [], []
                for it in range(iters):
                    okeys = [f"{name}/{it}/{k}" for k in keys]
                    sync(device)
                    t = time.perf_counter()
                    stored = loader.store(okeys, list(range(npages)), skip_existing=True)
                    times.append(time.perf_counter() - t)
                    back = torch.empty_like(ref_pages[:2], device="cpu")
                    same = c.batch_get_into(okeys[:2], [back[0], back[1]]) == [nbytes // npages] * 2 and bool(
                        torch.equal(back.view(torch.uint8), ref_pages[:2].cpu().view(torch.uint8)))
                    c.batch_remove(okeys)
                ok &= same and all(stored)
                res[name] = {"store_ms": min(times) * 1e3, "gbps": nbytes / min(times) / 1e9, "bytes_exact": same,
                             "counters": dict(loader.counters)}
    res["ok"] = bool(ok)
    q.put({"reader": res})


class Reference(NamedTuple):
    """The reader's model and its own recompute: what every loaded path is checked against."""

    model: Any
    cfg: Any
    cache: Any  # the recompute's DynamicCache (the prefix, then the decoded token)
    logits: Any
    recompute_s: float


def hicache_path(ms: str, preset: str, device: str, ref: Reference, best, res: dict) -> bool:
    """The HiCache backend's load: ``batch_get_v1`` of every page into SGLang's host pool, one upload of the pool's
    filled part to the model's device, per layer K and V in the cache's layout, then the decode. SGLang itself
    moves host pages to its device pool with its own kernels, layer by layer; this upload is the plain torch copy.
    Sets ``res["hicache"]``; returns whether every check held (True where SGLang is missing: said in the result)."""
    import torch

    from umbp.keys import chain_keys

    ids, page_tokens = prompt(preset)
    npages = (len(ids) - 1) // page_tokens
    keys = chain_keys(ids[:-1], page_tokens)
    dtype = kv_of(ref.cache, 0)[0].dtype
    pool, backend, why = hicache_side(ms, preset, ref.cfg, npages, page_tokens, dtype, device)
    if backend is None:
        res["hicache"] = {"skipped": why}
        return True
    s, nl = npages * page_tokens, ref.cfg.num_hidden_layers
    idx = torch.arange(s, dtype=torch.int64)
    try:
        load_s, got = best(lambda: backend.batch_get_v1(keys, idx))

        def upload():
            kd, vd = (x[:s].to(device, non_blocking=True) for x in (pool.k_buffer, pool.v_buffer))  # [S, L, H, D]
            return ([x[:, li].permute(1, 0, 2).unsqueeze(0).contiguous() for li in range(nl)] for x in (kd, vd))

        up_s, (hk, hv) = best(lambda: tuple(upload()))
    finally:
        backend.close()
    same_kv = all(torch.equal(x[li].view(torch.uint8), kv_of(ref.cache, li)[j][:, :, :s].contiguous()
                              .view(torch.uint8)) for li in range(nl) for j, x in ((0, hk), (1, hv)))
    logits, dec_s = timed(lambda: decode(ref.model, cache_direct(hk, hv), ids[-1], device))
    same_logits = bool(torch.equal(logits, ref.logits))
    nbytes = 2 * sum(x.numel() * x.element_size() for x in hk)
    ttft = load_s + up_s + dec_s
    res["hicache"] = {"load_ms": load_s * 1e3, "gbps": nbytes / load_s / 1e9, "upload_ms": up_s * 1e3,
                      "ttft_ms": ttft * 1e3, "vs_recompute": ref.recompute_s / ttft, "kv_exact": same_kv,
                      "logits_exact": same_logits, "pages": sum(got)}
    return same_kv and same_logits and sum(got) == npages


def run(ms: str, preset: str, device: str, groups: int, iters: int) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    out: dict = {}
    for target, args in ((writer, (ms, preset, device, q)), (reader, (ms, preset, device, groups, iters, q))):
        p = ctx.Process(target=target, args=args, daemon=True)
        p.start()
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and p.is_alive() and q.empty():  # bounded wait for its answer
            p.join(0.2)
        if q.empty():
            p.kill()
            raise SystemExit(f"engine_e2e: {target.__name__} process ended without an answer "
                             f"(exit code {p.exitcode})")
        out.update(q.get())
        p.join(30)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--preset", default=None, choices=sorted(PRESETS), help="model size (cpu: tiny, cuda: h200)")
    ap.add_argument("--groups", type=int, default=4, help="layer groups of the grouped layer-wise load")
    ap.add_argument("--iters", type=int, default=3, help="runs per path (the best is printed)")
    ap.add_argument("--metaserver", default=None, help="an existing pool (default: start one here)")
    ap.add_argument("--capacity", default=None, help="node arena of the pool started here")
    args = ap.parse_args()
    preset = args.preset or ("tiny" if args.device == "cpu" else "h200")
    if args.metaserver:
        res = run(args.metaserver, preset, args.device, args.groups, args.iters)
    else:
        from umbp.launcher import LocalPool

        cap = args.capacity or ("64MiB" if preset == "tiny" else "4GiB")
        with LocalPool(nodes=1, capacity=cap, port=0, metrics=False) as pool:
            res = run(pool.metaserver, preset, args.device, args.groups, args.iters)
    print("E2E " + json.dumps(res), flush=True)
    r = res["reader"]
    w = res["writer"]
    print(f"recompute TTFT {r['recompute_ttft_ms']:.1f} ms, KV {r['kv_bytes'] / 2**20:.1f} MiB, "
          f"store {w['put_gbps']:.2f} GB/s (batch_put; a first one-page put {w['first_put_ms']:.1f} ms), "
          + (f"{w['hicache_set_gbps']:.2f} GB/s (batch_set_v1; a first one-page set {w['first_set_ms']:.1f} ms)"
             if "hicache_set_gbps" in w else "no batch_set_v1"))
    for name in ("plain", "hicache", "layerwise", "layerwise_groups", "layerwise_cache_layout", "overlap"):
        x = r[name]
        if "skipped" in x:
            print(f"{name:<18} SKIPPED: {x['skipped']}")
            continue
        print(f"{name:<18} load {x['load_ms']:8.1f} ms {x['gbps']:7.2f} GB/s  TTFT {x['ttft_ms']:8.1f} ms "
              f"({x['vs_recompute']:.1f}x recompute)  kv exact {x['kv_exact']}  logits exact {x['logits_exact']}"
              + (f"  (upload {x['upload_ms']:.1f} ms)" if "upload_ms" in x else ""))
    for name in ("offload_plain", "offload"):
        o = r[name]
        print(f"{name:<18} {o['store_ms']:8.1f} ms {o['gbps']:7.2f} GB/s  bytes exact {o['bytes_exact']}  "
              f"vs the layer-wise load {o['gbps'] / r['layerwise']['gbps']:.2f}x")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
