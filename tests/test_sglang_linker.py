"""The SGLang direct linker (``umbp.integrations.sglang.linker``) loaded by SGLang's ``create_unified_cache_linker``
with ``backend="dynamic"`` and driven through its whole contract against a real pool, with exact bytes.

Importing the linker imports SGLang's memory pools and so its model configs (transformers, torchvision); those need
the torch they were built with, so these tests run in the SGLang linker venv (``.venv/sglang-linker``, built by
``scripts/install-venv.sh``). From the main venv, ``test_full_suite_in_linker_venv`` runs them there (and the real
host pool tests of ``test_sglang_hicache.py``) and fails if any fails; when that venv is absent it SKIPS, loudly.

Device pools are SGLang's own ``MHATokenToKVPool`` / ``MLATokenToKVPool``, on CPU here; with CUDA (the GPU machine)
the same contract runs on CUDA pools, and ``test_full_gpu_layerwise_figures`` prints the time to the first layer
group against the whole prefix and the pool->HBM rate.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

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
                     "the SGLang linker's factory tests and the real host pool tests", min_passed=5))


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


def wait_offloads(linker, n: int) -> list[bool]:
    linker.offload_queue.join()  # the offload thread has finished every queued task
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
    deadline = time.monotonic() + 60
    while linker.num_completed_offloads() < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # bounded poll of an observable count
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


# ---- the GPU machine ---------------------------------------------------------------------------------------------

@needs_linker
@pytest.mark.skipif(not torch.cuda.is_available(), reason="NO CUDA DEVICE: the CUDA linker tests run on the GPU "
                                                          "machine only (README.md, SGLang)")
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
