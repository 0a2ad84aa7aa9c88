"""The SGLang direct linker (``umbp.integrations.sglang.linker``) loaded by SGLang's ``create_unified_cache_linker``
with ``backend="dynamic"`` and driven through its whole contract against a real pool, with exact bytes.

Importing the linker imports SGLang's memory pools and so its model configs (transformers, torchvision); those need
the torch they were built with, so these tests run in the SGLang linker venv (``.venv/sglang-linker``, built by
``scripts/install-venv.sh``). From the main venv, ``test_full_suite_in_linker_venv`` runs them there (and the real
host pool tests of ``test_sglang_hicache.py``) and fails if any fails; when that venv is absent it SKIPS, loudly.

Device pools are SGLang's own ``MHATokenToKVPool`` / ``MLATokenToKVPool``, on CPU here; with CUDA (the GPU machine)
the same contract runs on CUDA pools; ``test_full_linker_tp_split_mla_cpu`` runs two TP rank processes (gloo) through
the TP split of replicated KV; and ``test_full_gpu_layerwise_figures`` prints the time to the first layer
group against the whole prefix and the pool->HBM rate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from cluster import eventually  # noqa: E402
from enginesvenv import engine_modules, run_pytest  # noqa: E402


_ERR, needs_linker = engine_modules(
    "SGLANG LINKER MODULES DO NOT IMPORT", "they need transformers + torchvision; these tests run in "
    ".venv/sglang-linker through test_full_suite_in_linker_venv",
    "sglang.srt.mem_cache.unified_cache.linker_factory", "sglang.srt.mem_cache.unified_cache.unified_cache_linker")


# ---- driving the linker venv from the main run ----------------------------------------------------------------

def test_full_suite_in_linker_venv(etcd_binary):
    if _ERR is None:
        pytest.skip("already running inside a venv where the SGLang linker imports: the tests below run directly")
    print(run_pytest(["tests/test_sglang_linker.py", "tests/test_sglang_hicache.py", "-k", "full"], etcd_binary,
                     "the SGLang linker's factory tests and the real host pool tests", min_passed=6))


# ---- device pools as SGLang builds them ---------------------------------------------------------------------------

def device_pool(kind: str, *, tokens: int, page: int, layers: int, heads: int = 2, dim: int = 8,
                dtype=torch.bfloat16, device: str = "cpu"):
    """SGLang's own token pool; where its constructor cannot run (a torch it was not built for), tensors laid out
    identically (per layer ``[tokens + page, heads, dim]``), saying so."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    try:
        if kind == "mha":
            return MHATokenToKVPool(size=tokens, page_size=page, dtype=dtype, head_num=heads, head_dim=dim,
                                    layer_num=layers, device=device, enable_memory_saver=False)
        return MLATokenToKVPool(size=tokens, page_size=page, dtype=dtype, kv_lora_rank=dim, qk_rope_head_dim=4,
                                layer_num=layers, device=device, enable_memory_saver=False)
    except Exception as e:  # pragma: no cover - only on a torch SGLang was not built for
        print(f"SGLang's {kind} token pool did not build ({type(e).__name__}: {e}); using the same layout by hand")
        if kind == "mha":
            mk = lambda: [torch.zeros(tokens + page, heads, dim, dtype=dtype, device=device) for _ in range(layers)]
            return SimpleNamespace(k_buffer=mk(), v_buffer=mk())
        return SimpleNamespace(kv_buffer=[torch.zeros(tokens + page, 1, dim + 4, dtype=dtype, device=device)
                                          for _ in range(layers)])


def load_linker(metaserver: str, pool, page: int, **extra):
    from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker

    from umbp.integrations.sglang import LINKER_CLASS, LINKER_MODULE
    from umbp.integrations.sglang.linker import UmbpDirectLinker

    params = SimpleNamespace(page_size=page, token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: pool),
                             tp_cache_group=None, attn_tp_cache_group=None, pp_rank=0, pp_size=1)
    server_args = SimpleNamespace(model_path="test/linker-model")
    config = {"linker": LINKER_CLASS, "linker_module_path": LINKER_MODULE,
              "linker_extra_config": {"metaserver": metaserver, **extra}}
    linker = create_unified_cache_linker(server_args, params, backend="dynamic", config=config, components=set(),
                                         forward_stream=None)
    assert type(linker) is UmbpDirectLinker
    return linker


def layers_of(pool):
    if hasattr(pool, "k_buffer") and getattr(pool, "v_buffer", None) is not None:
        return [(k, v) for k, v in zip(pool.k_buffer, pool.v_buffer)]
    return [(t,) for t in pool.kv_buffer]


def fill(pool, pages: list[int], page: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for parts in layers_of(pool):
        for t in parts:
            for p in pages:
                rows = t[p * page:(p + 1) * page]
                rows.copy_(torch.randint(-90, 90, rows.shape, generator=g).to(t.dtype).to(t.device))


def page_bytes(pool, p: int, page: int) -> bytes:
    out = b""
    for parts in layers_of(pool):
        for t in parts:
            out += bytes(t[p * page:(p + 1) * page].contiguous().cpu().view(torch.uint8).flatten().numpy())
    return out


def indices(pages: list[int], page: int):
    return torch.cat([torch.arange(p * page, (p + 1) * page) for p in pages])


def wait_offloads(linker, n: int, timeout: float = 60.0) -> list[bool]:
    # the offload thread has finished every queued task (Queue.join's own count, awaited with a bound)
    eventually(lambda: linker.offload_queue.unfinished_tasks == 0, timeout,
               lambda: f"the offload queue drained: {linker.stats}")
    assert linker.num_completed_offloads() == n
    return [linker.pop_completed_offload() for _ in range(n)]


def run_layerwise(linker, index: int) -> bool:
    """As SGLang's forward does: per layer, wait for it through the counter; then finish."""
    counter = linker.layer_done_counter
    counter.set_consumer(index)
    for layer in range(linker.num_layers):
        counter.wait_until(layer)
    return linker.finish_layer_wise_loading(index)


# ---- the contract ---------------------------------------------------------------------------------------------

def _contract(cluster, kind: str, device: str) -> None:
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    from umbp import keys as umbp_keys

    page, layers = 4, 3
    pool = device_pool(kind, tokens=64, page=page, layers=layers, device=device)
    linker = load_linker(cluster.metaserver_addr, pool, page, layer_group_size=2)
    keys = umbp_keys.chain_keys(list(range(5 * page)), page, extra_key=f"{kind}-{device}")
    src = [1, 2, 3, 4, 5]
    fill(pool, src, page, seed=3)
    want = {p: page_bytes(pool, p, page) for p in src}
    # offload -> completion counting
    assert linker.offload([PoolTransfer(PoolName.KV, device_indices=indices(src[:3], page), keys=keys[:3])])
    assert linker.offload([PoolTransfer(PoolName.KV, device_indices=indices(src, page), keys=keys)])
    assert wait_offloads(linker, 2) == [True, True]
    objs = cluster.cli_json("ls", "--json", "--namespace", linker.namespace)["objects"]
    assert len(objs) == 5 and {o[2] for o in objs} == {linker.kv.page_bytes}
    assert linker.storer.counters["pages_stored"] == 5 and linker.storer.counters["pages_existing"] == 3
    # lookup: every restorable prefix length
    other = umbp_keys.chain_keys(list(range(7 * page)), page, extra_key=f"{kind}-{device}")
    assert linker.lookup("r1", [PoolTransfer(PoolName.KV, keys=other)]) == [1, 2, 3, 4, 5]
    assert linker.lookup("r1", [PoolTransfer(PoolName.KV, keys=keys[:2])]) == [1, 2]
    assert linker.lookup("r1", [PoolTransfer(PoolName.KV, keys=["0" * 64])]) == []
    # load into other slots, layer by layer
    dst = [9, 8, 7, 6, 10]
    assert linker.load("r1", [PoolTransfer(PoolName.KV, device_indices=indices(dst[:2], page), keys=keys[:2])])
    assert linker.load("r2", [PoolTransfer(PoolName.KV, device_indices=indices(dst[2:], page), keys=keys[2:])])
    index = linker.start_layer_wise_loading()
    assert index >= 0 and run_layerwise(linker, index) is True
    for s, d in zip(src, dst):
        assert page_bytes(pool, d, page) == want[s], (kind, s, d)
    linker.load_queue.join()  # the load thread has finished its bookkeeping too
    assert linker.stats["pages_loaded"] == 5, (linker.stats, linker.loader.counters)
    assert linker.loader.counters["host_to_device_bytes"] == 5 * linker.kv.page_bytes, linker.loader.counters
    # cancel a queued load: nothing starts
    assert linker.load("r3", [PoolTransfer(PoolName.KV, device_indices=indices([11], page), keys=keys[:1])])
    assert linker.cancel_queued_load("r3") is True and linker.cancel_queued_load("r3") is False
    assert linker.start_layer_wise_loading() == -1
    # a page evicted between lookup and load fails the batch: never reported as landed
    assert linker.client.remove(linker.objects(keys[3:4])[0])
    assert linker.load("r4", [PoolTransfer(PoolName.KV, device_indices=indices([12, 13, 14, 15], page),
                                           keys=keys[:4])])
    index = linker.start_layer_wise_loading()
    assert run_layerwise(linker, index) is False
    linker.load_queue.join()
    assert linker.stats["load_failures"] == 1
    # reset forgets queued work and drains results; close stops everything
    assert linker.load("r5", [PoolTransfer(PoolName.KV, device_indices=indices([11], page), keys=keys[:1])])
    assert linker.offload([PoolTransfer(PoolName.KV, device_indices=indices([1], page), keys=keys[:1])])
    linker.reset()
    assert linker.pending_loads == {} and linker.num_completed_offloads() == 0
    assert linker.start_layer_wise_loading() == -1
    linker.close()


@needs_linker
def test_full_linker_contract_mha_cpu(cluster):
    _contract(cluster, "mha", "cpu")


@needs_linker
def test_full_linker_contract_mla_cpu(cluster):
    _contract(cluster, "mla", "cpu")


@needs_linker
def test_full_linker_refuses_bad_config(cluster):
    from umbp.errors import ConfigError, InvalidArgument

    pool = device_pool("mha", tokens=16, page=4, layers=2)
    with pytest.raises(ConfigError, match="unknown linker_extra_config"):
        load_linker(cluster.metaserver_addr, pool, 4, bogus=1)
    linker = load_linker(cluster.metaserver_addr, pool, 4)
    with pytest.raises(InvalidArgument, match="aligned"):
        linker.slots_of(torch.tensor([1, 2, 3, 4]))
    linker.close()


@needs_linker
def test_full_linker_worker_survives_unexpected_errors(cluster):
    """An error other than UmbpError/OSError in the offload thread fails that one offload; the thread keeps serving
    the next, and ``reset`` returns. A dead worker makes ``reset`` raise at once instead of blocking forever."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    from umbp import keys as umbp_keys
    from umbp.errors import TransportError

    page = 4
    pool = device_pool("mha", tokens=32, page=page, layers=2)
    linker = load_linker(cluster.metaserver_addr, pool, page)
    keys = umbp_keys.chain_keys(list(range(2 * page)), page, extra_key="worker-errors")
    fill(pool, [1, 2], page, seed=5)
    real_store, calls = linker.storer.store, []

    def store_failing_once(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected: not an UmbpError")
        return real_store(*a, **k)

    linker.storer.store = store_failing_once
    for p, k in zip([1, 2], keys):
        assert linker.offload([PoolTransfer(PoolName.KV, device_indices=indices([p], page), keys=[k])])
    eventually(lambda: linker.num_completed_offloads() >= 2, 60, lambda: f"2 completed offloads: {linker.stats}")
    assert linker.num_completed_offloads() == 2, linker.stats
    assert [linker.pop_completed_offload() for _ in range(2)] == [False, True]
    assert len(calls) == 2 and linker._offload_thread.is_alive()
    assert linker.stats["worker_errors"] == 1 and linker.stats["offload_failures"] == 1
    assert linker.stats["pages_offloaded"] == 1 and "RuntimeError: injected" in linker.last_worker_error
    assert linker.client.get(linker.objects(keys[1:2])[0]) == page_bytes(pool, 2, page)
    linker.reset()  # returns: nothing queued is left behind
    # a worker that is gone (stopped here by its own marker) makes reset fail fast, naming the thread
    linker.offload_queue.put(None)
    linker._offload_thread.join(30)
    assert not linker._offload_thread.is_alive()
    assert linker.offload([PoolTransfer(PoolName.KV, device_indices=indices([1], page), keys=keys[:1])])
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="sglang linker: the offload thread is dead with 1 tasks queued"):
        linker.reset()
    print(f"reset with a dead offload thread raised after {time.monotonic() - t0:.3f}s")
    linker.offload_queue.get_nowait()
    linker.offload_queue.task_done()
    linker.close()


# ---- the TP split of replicated (MLA) KV: two rank processes --------------------------------------------------------

def tp_split_rank(rank: int, size: int, init_file: str, addr: str) -> dict:
    """One TP rank (its own process, gloo over ``init_file``) of ``test_full_linker_tp_split_mla_cpu``: rank 0 offloads
    the replicated pages, then every rank drives the linker's load contract; returns what the test checks."""
    import datetime
    import hashlib

    import torch.distributed as dist
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    from umbp import keys as umbp_keys

    def load_batch(batches: list[tuple[list[int], list[str]]]) -> tuple[bool, float]:
        for i, (slots, ks) in enumerate(batches):
            assert linker.load(f"r{i}", [PoolTransfer(PoolName.KV, device_indices=indices(slots, page), keys=ks)])
        t0 = time.monotonic()
        ok = run_layerwise(linker, linker.start_layer_wise_loading())
        linker.load_queue.join()  # the load thread's bookkeeping (counters, stats) is done too
        return ok, time.monotonic() - t0

    # a rank left waiting in a collective would wait this long: far past the test's bound, so a hang shows as one
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=600))
    page, n = 4, 8
    pool = device_pool("mla", tokens=40 * page, page=page, layers=3)
    linker = load_linker(addr, pool, page, layer_group_size=2)
    out: dict = {"rank": rank, "tp": [linker.tp_rank, linker.tp_size], "split": linker.tp_split,
                 "page_bytes": linker.kv.page_bytes}
    keys = umbp_keys.chain_keys(list(range(n * page)), page, extra_key="tp-split")
    src = list(range(1, n + 1))
    fill(pool, src, page, seed=3)  # replicated: the same bytes on every rank
    want = [page_bytes(pool, p, page) for p in src]
    assert linker.offload([PoolTransfer(PoolName.KV, device_indices=indices(src, page), keys=keys)])
    out["offloaded"] = wait_offloads(linker, 1)
    out["stored"] = linker.storer.counters["pages_stored"]
    dist.barrier()  # rank 0's pages are in the pool before any rank looks up
    out["lookup"] = linker.lookup("r", [PoolTransfer(PoolName.KV, keys=keys)])
    dst = list(range(2 * n, n, -1))
    out["finish"], _ = load_batch([(dst[:3], keys[:3]), (dst[3:], keys[3:])])
    got = [page_bytes(pool, d, page) for d in dst]
    out["bytes_ok"] = got == want
    out["digest"] = hashlib.sha256(b"".join(got)).hexdigest()
    out["tp_counters"] = dict(linker.tp.counters)
    out["own_loader_pool_bytes"] = linker.loader.counters["pool_to_host_bytes"]
    # the ranks load different key lists (same count): rank 0 pages 0..3, rank 1 pages 4..7
    bad = list(range(20, 24))
    before = [page_bytes(pool, b, page) for b in bad]
    out["mismatch_finish"], out["mismatch_s"] = load_batch([(bad, keys[4 * rank:4 * rank + 4])])
    out["mismatch_untouched"] = [page_bytes(pool, b, page) for b in bad] == before
    out["mismatch_error"] = linker.last_load_error
    # the ranks stay in step: the next batch, the same on both, loads
    again = list(range(24, 24 + n))
    out["again_finish"], _ = load_batch([(again, keys)])
    out["again_ok"] = [page_bytes(pool, d, page) for d in again] == want
    out["stats"] = dict(linker.stats)
    linker.close()
    dist.barrier()
    dist.destroy_process_group()
    return out


def run_tp_ranks(size: int, addr: str, tmp_path: Path, timeout: float = 240) -> list[dict]:
    """``tp_split_rank`` in ``size`` processes of this interpreter; every wait bounded (a hung rank is killed)."""
    from processes import child_env

    here = str(Path(__file__).resolve().parent)
    procs = []
    for rank in range(size):
        code = textwrap.dedent(f"""
            import json, sys
            sys.path.insert(0, {here!r})
            from test_sglang_linker import tp_split_rank
            print("RESULT " + json.dumps(tp_split_rank({rank}, {size}, {str(tmp_path / 'dist-init')!r}, {addr!r})))
        """)
        procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, stdin=subprocess.DEVNULL,
                                      env=child_env({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})))
    results = []
    try:
        for p in procs:
            so, se = p.communicate(timeout=timeout)
            assert p.returncode == 0, f"rank exited {p.returncode}\n{se[-4000:]}"
            line = [ln for ln in so.splitlines() if ln.startswith("RESULT ")][-1]
            results.append(json.loads(line[len("RESULT "):]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return sorted(results, key=lambda r: r["rank"])


@needs_linker
def test_full_linker_tp_split_mla_cpu(cluster, tmp_path):
    """Two TP ranks of an MLA pool (SGLang's ``MLATokenToKVPool``, CPU, gloo): rank 0 alone stores the replicated
    pages; each rank reads exactly half of them from the pool and gets the other half from its peer, and both end
    with every page bit for bit; ranks that load different key lists fail that batch on both (nothing written, no
    hang), and the next agreeing batch loads."""
    res = run_tp_ranks(2, cluster.metaserver_addr, tmp_path)
    whole = 8 * res[0]["page_bytes"]
    for r in res:
        assert r["tp"] == [r["rank"], 2] and r["split"] is True, r
        assert r["offloaded"] == [True] and r["stored"] == (8 if r["rank"] == 0 else 0), r
        assert r["lookup"] == list(range(1, 9)), r
        assert r["finish"] is True and r["bytes_ok"], r
        c = r["tp_counters"]
        assert c["pool_to_host_bytes"] == whole // 2 and c["host_to_device_bytes"] == whole // 2, c
        assert c["exchange_bytes"] == whole // 2 and c["scatter_bytes"] == whole, c
        assert r["own_loader_pool_bytes"] == 0, r
        assert r["mismatch_finish"] is False and r["mismatch_untouched"], r
        assert r["mismatch_error"].startswith(f"InvalidArgument: engine tp: rank {r['rank']}: the ranks of the TP "
                                              f"group load different key lists (4 pages here, 4..4 across ranks, "
                                              f"key hashes differ)"), r
        assert r["again_finish"] is True and r["again_ok"], r
        assert r["stats"]["split_loads"] == 2 and r["stats"]["load_failures"] == 1, r["stats"]
        assert r["stats"]["pages_loaded"] == 16, r["stats"]
    assert res[0]["digest"] == res[1]["digest"]
    print(f"\nTP split: per-rank pool->host {[r['tp_counters']['pool_to_host_bytes'] for r in res]} B of {whole} B; "
          f"mismatched keys failed both ranks after {[round(r['mismatch_s'], 3) for r in res]} s")


# ---- the GPU machine ---------------------------------------------------------------------------------------------

@needs_linker
@pytest.mark.skipif(not torch.cuda.is_available(), reason="NO CUDA DEVICE: the CUDA linker tests run on the GPU "
                                                          "machine only (docs/integrations/sglang-linker.md)")
def test_full_linker_contract_cuda(cluster):
    _contract(cluster, "mha", "cuda")
    _contract(cluster, "mla", "cuda")


@needs_linker
@pytest.mark.skipif(not torch.cuda.is_available(), reason="NO CUDA DEVICE: GPU figures come from the GPU machine")
@pytest.mark.cluster(nodes=1, capacity=os.environ.get("UMBP_GPU_POOL", "6GiB"))
def test_full_gpu_layerwise_figures(cluster):
    """A prefix of a Llama-8B-shaped model (32 layers, 8 KV heads x 128, bf16, 64-token pages: 8 MiB a page) loaded
    layer by layer into SGLang's CUDA MHA pool; prints first group vs whole prefix and the pool->HBM rate."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    from umbp import keys as umbp_keys

    page, layers, heads, dim = 64, 32, 8, 128
    n_pages = int(os.environ.get("UMBP_GPU_PAGES", "256"))
    pool = device_pool("mha", tokens=(2 * n_pages + 2) * page, page=page, layers=layers, heads=heads, dim=dim,
                       device="cuda")
    results = {}
    for group in (1, 4):
        linker = load_linker(cluster.metaserver_addr, pool, page, layer_group_size=group)
        keys = umbp_keys.chain_keys(list(range(n_pages * page)), page, extra_key="gpu")
        src = list(range(1, n_pages + 1))
        if group == 1:
            for parts in layers_of(pool):
                for t in parts:
                    t[page:(n_pages + 1) * page].normal_()
            t0 = time.perf_counter()
            for i in range(0, n_pages, 64):
                assert linker.offload([PoolTransfer(PoolName.KV, device_indices=indices(src[i:i + 64], page),
                                                    keys=keys[i:i + 64])])
            assert all(wait_offloads(linker, (n_pages + 63) // 64))
            results["offload_GBps"] = n_pages * linker.kv.page_bytes / (time.perf_counter() - t0) / 1e9
        dst = list(range(n_pages + 1, 2 * n_pages + 1))
        for rep in range(2):  # report the second (the linker registered the arena with CUDA at start)
            assert linker.load("r", [PoolTransfer(PoolName.KV, device_indices=indices(dst, page), keys=keys)])
            torch.cuda.synchronize()
            assert run_layerwise(linker, linker.start_layer_wise_loading()) is True
            linker.load_queue.join()  # the batch's figures are recorded after its last layer was reported
        ll = linker.last_load
        results[f"group{group}"] = {"pages": ll["pages"], "MiB": ll["bytes"] / 2**20,
                                    "first_group_ms": ll["first_group_s"] * 1e3, "total_ms": ll["total_s"] * 1e3,
                                    "pool_to_hbm_GBps": ll["bytes"] / ll["total_s"] / 1e9,
                                    "zero_copy_bytes": linker.loader.counters["zero_copy_bytes"],
                                    "transport": linker.client.transport_names()}
        for i in (0, n_pages // 2, n_pages - 1):
            for parts in layers_of(pool):
                for t in parts:
                    assert torch.equal(t[src[i] * page:(src[i] + 1) * page], t[dst[i] * page:(dst[i] + 1) * page])
        linker.close()
    print("UMBP_GPU_FIGURES", results)
