"""The SGLang HiCache backend (``umbp.integrations.sglang.hicache``) loaded by SGLang's own factory and driven method by
method against a real pool, with exact bytes and object counts.

Host KV pools: SGLang's real ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` import SGLang's model configs
(transformers, torchvision), which the main venv does not hold. Here they are replaced by ``MhaHostPool`` /
``MlaHostPool``, host buffers laid out exactly as SGLang lays them out (the same ``kv_buffer`` shapes, the same
``get_page_buffer_meta`` addresses, the same flat data pages); ``test_full_double_matches_real_host_pool`` proves
that equality against the real classes, and ``test_full_v1_real_host_pools`` repeats the round trip with them. Both
run in the SGLang linker venv (``.venv/sglang-linker``, built by ``scripts/install-venv.sh``), driven from the main
run by ``test_sglang_linker.py::test_full_suite_in_linker_venv``; in the main venv they skip, saying so.

The tests share the module's cluster (``shared_cluster``): each test's model names carry its own namespace as a
prefix (``storage_config``), so no two tests meet in a backend namespace; pool-wide counts are read as differences.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
try:
    from sglang.srt.mem_cache.hicache_storage import (HiCacheStorage, HiCacheStorageConfig,
                                                      HiCacheStorageExtraInfo, PoolHitPolicy, PoolName,
                                                      PoolTransfer)
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
except ImportError as e:  # pragma: no cover - the sglang extra is part of `make test`
    pytest.skip(f"SGLANG STORAGE INTERFACE NOT IMPORTABLE ({e}); install it: pip install --no-deps sglang==0.5.23 "
                f"&& pip install -e '.[sglang]' (make test does)", allow_module_level=True)

from cluster import free_port
from umbp import keys as umbp_keys
from umbp.integrations.sglang import HICACHE_CLASS, HICACHE_MODULE
from umbp.integrations.sglang.hicache import UmbpHiCacheStorage
from umbp.integrations.sglang.naming import ObjectNaming, namespace_for

from sglang_hostpools import (D, DT, H, L, MHA_LAYOUTS, MLA_LAYOUTS, PS, MhaHostPool, MlaHostPool,
                              real_host_pool, real_pools_importable)


pytestmark = pytest.mark.shared_cluster  # one pool for the module; a namespace per test (model names, below)
_MODEL_PREFIX = [""]  # the running test's namespace + "/" on a shared cluster: backend namespaces per test


@pytest.fixture(autouse=True)
def _models_per_test(request):
    if "cluster" in request.fixturenames:
        ns = request.getfixturevalue("cluster").namespace
        _MODEL_PREFIX[0] = f"{ns}/" if ns else ""
    yield
    _MODEL_PREFIX[0] = ""


def model_name(model: str) -> str:
    """The model name a backend of this test is configured with (its namespace derives from it)."""
    return _MODEL_PREFIX[0] + model


# ---- helpers -----------------------------------------------------------------------------------------------------

def storage_config(metaserver: str, *, mla: bool = False, tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0,
                   pp_size: int = 1, model: str = "test/model", metrics: bool = False, **extra) -> HiCacheStorageConfig:
    cfg = {"backend_name": "umbp", "module_path": HICACHE_MODULE, "class_name": HICACHE_CLASS,
           "metaserver": metaserver, "interface_v1": 1, **extra}
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=metrics,
                                is_page_first_layout=False, model_name=model_name(model), extra_config=cfg)


def load_backend(metaserver: str, pool=None, **kw) -> UmbpHiCacheStorage:
    """As SGLang's cache controller does: the factory builds the class, then the host pool is registered."""
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(metaserver, **kw), pool)
    assert type(backend) is UmbpHiCacheStorage and isinstance(backend, HiCacheStorage)
    if pool is not None:
        backend.register_mem_pool_host(pool)
    return backend


def page_keys(n: int, salt: int = 0) -> list[str]:
    return umbp_keys.chain_keys(list(range(salt, salt + n * PS)), PS)


def host_indices(pages: list[int]):
    return torch.cat([torch.arange(p * PS, (p + 1) * PS) for p in pages]).to(torch.int64)


def fill_random(pool, pages: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in pages:
        page = pool.get_data_page(p * PS, flat=False)
        page.copy_(torch.randint(-100, 100, page.shape, generator=g).to(pool.dtype))


def page_bytes(pool, page: int) -> bytes:
    return bytes(pool.get_data_page(page * PS).contiguous().view(torch.uint8).numpy())


def pool_objects(cluster, namespace: str) -> list:
    return cluster.cli_json("ls", "--json", "--namespace", namespace)["objects"]


# ---- the factory --------------------------------------------------------------------------------------------------

def test_factory_builds_the_class_and_rejects_bad_configs(cluster):
    backend = load_backend(cluster.metaserver_addr, MhaHostPool("page_first"))
    assert backend.naming.kv_suffixes() == ("_0_k", "_0_v")
    assert backend.namespace == namespace_for(model_name("test/model"), "page_first", PS, "bf16", 1)
    backend.close()
    bad = storage_config(cluster.metaserver_addr)
    bad.extra_config["class_name"] = "ObjectNaming"  # exists, but is no HiCacheStorage
    with pytest.raises(TypeError, match="must inherit from HiCacheStorage"):
        StorageBackendFactory.create_backend("dynamic", bad, None)
    bad.extra_config["module_path"] = "umbp.integrations.sglang.nope"
    with pytest.raises(ImportError):
        StorageBackendFactory.create_backend("dynamic", bad, None)
    with pytest.raises(Exception, match="layout"):
        load_backend(cluster.metaserver_addr, MhaHostPool("page_first")).register_mem_pool_host(
            type("P", (), {"layout": "page_unified"})())


def test_metaserver_from_environment(cluster, monkeypatch):
    monkeypatch.setenv("UMBP_METASERVER", cluster.metaserver_addr)
    pool = MhaHostPool("page_first")
    backend = load_backend(None, pool)  # extra_config["metaserver"] is None: UMBP_METASERVER
    fill_random(pool, [0], 1)
    assert backend.batch_set_v1(page_keys(1), host_indices([0])) == [True]
    assert backend.batch_exists(page_keys(1)) == 1
    backend.close()


# ---- v1: zero copy over host indices, every layout -------------------------------------------------------------

def _v1_round_trip(cluster, kind: str, layout: str, make_pool) -> None:
    src, dst = make_pool(kind, layout), make_pool(kind, layout)
    writer = load_backend(cluster.metaserver_addr, src, mla=kind == "mla", model=f"m-{kind}-{layout}")
    reader = load_backend(cluster.metaserver_addr, dst, mla=kind == "mla", model=f"m-{kind}-{layout}")
    keys = page_keys(4, salt=hash(layout) % 1000)
    fill_random(src, [1, 2, 3, 4], seed=len(layout))
    assert writer.batch_set_v1(keys, host_indices([1, 2, 3, 4])) == [True] * 4
    per = 1 if kind == "mla" else 2
    objs = pool_objects(cluster, writer.namespace)
    assert len(objs) == 4 * per
    page_len = len(page_bytes(src, 1))
    assert sorted(o[2] for o in objs) == [page_len // per] * (4 * per)
    assert reader.batch_exists(keys) == 4
    assert reader.batch_get_v1(keys, host_indices([5, 0, 7, 6])) == [True] * 4
    for s, d in zip([1, 2, 3, 4], [5, 0, 7, 6]):
        assert page_bytes(dst, d) == page_bytes(src, s), (kind, layout, s)
    # A page whose second object is gone is not a hit: the run stops there and the get reports it.
    if kind == "mha":
        assert writer.client.remove(f"{keys[2]}_0_v")
        assert reader.batch_exists(keys) == 2
        dst.get_data_page(7 * PS, flat=False).zero_()
        assert reader.batch_get_v1(keys, host_indices([5, 0, 7, 6])) == [True, True, False, True]
        assert page_bytes(dst, 5) == page_bytes(src, 1) and page_bytes(dst, 6) == page_bytes(src, 4)
        # page 7's host slot is unspecified after its miss: the reader remembered where "_0_v" was and may have
        # read it ahead of the LOOKUP that then answered the miss (umbp/speculate.py); SGLang recomputes it
    assert writer.counters["pages_set"] == 4 and writer.counters["errors"] == 0
    writer.close()
    reader.close()


def _double(kind: str, layout: str):
    return MhaHostPool(layout) if kind == "mha" else MlaHostPool(layout)


def test_v1_round_trip_every_layout(cluster):
    for kind, layouts in (("mha", MHA_LAYOUTS), ("mla", MLA_LAYOUTS)):
        for layout in layouts:
            _v1_round_trip(cluster, kind, layout, _double)


def test_full_v1_real_host_pools(cluster):
    reason = real_pools_importable()
    if reason:
        pytest.skip(reason)
    for kind, layouts in (("mha", MHA_LAYOUTS), ("mla", MLA_LAYOUTS)):
        for layout in layouts:
            _v1_round_trip(cluster, kind, layout, real_host_pool)


def test_full_double_matches_real_host_pool():
    """The doubles above are SGLang's layout: same buffer shape, same meta offsets, same flat pages."""
    reason = real_pools_importable()
    if reason:
        pytest.skip(reason)
    for kind, layouts in (("mha", MHA_LAYOUTS), ("mla", MLA_LAYOUTS)):
        for layout in layouts:
            real, double = real_host_pool(kind, layout), _double(kind, layout)
            assert tuple(real.kv_buffer.shape) == tuple(double.kv_buffer.shape), (kind, layout)
            g = torch.Generator().manual_seed(7)
            real.kv_buffer.copy_(torch.randint(-50, 50, real.kv_buffer.shape, generator=g).to(DT))
            double.kv_buffer.copy_(real.kv_buffer)
            idx = host_indices([3, 1])
            (rp, rs), (dp, ds) = real.get_page_buffer_meta(idx), double.get_page_buffer_meta(idx)
            rb, db = real.kv_buffer.data_ptr(), double.kv_buffer.data_ptr()
            assert [p - rb for p in rp] == [p - db for p in dp] and list(rs) == list(ds), (kind, layout)
            for page in (1, 3):
                assert torch.equal(real.get_data_page(page * PS), double.get_data_page(page * PS))
            assert real.get_dummy_flat_data_page().numel() == double.get_dummy_flat_data_page().numel()
            if kind == "mha" and layout == "page_head":
                (rp, rs), (dp, ds) = (real.get_split_heads_page_buffer_meta(idx, 2),
                                      double.get_split_heads_page_buffer_meta(idx, 2))
                assert [p - rb for p in rp] == [p - db for p in dp] and list(rs) == list(ds)


# ---- the generic path (no interface_v1): flat pages, interoperable with v1 --------------------------------------

def test_generic_path_interoperates_with_v1(cluster):
    for kind, layout in (("mha", "layer_first"), ("mha", "page_first"), ("mla", "page_first_direct")):
        pool = _double(kind, layout)
        backend = load_backend(cluster.metaserver_addr, pool, mla=kind == "mla", model=f"g-{kind}-{layout}")
        fill_random(pool, [0, 1, 2, 3], seed=3)
        keys = page_keys(4, salt=50)
        # v1 writes pages 0-1; the generic path reads them as SGLang's _generic_page_get does.
        assert backend.batch_set_v1(keys[:2], host_indices([0, 1])) == [True, True]
        dummies = [pool.get_dummy_flat_data_page() for _ in range(3)]
        got = backend.batch_get(keys[:2] + [keys[3]], dummies)
        assert got[2] is None and got[0] is dummies[0]
        for i in range(2):
            pool.set_from_flat_data_page((4 + i) * PS, got[i])
            assert page_bytes(pool, 4 + i) == page_bytes(pool, i)
        # The generic path writes pages 2-3 (SGLang's _generic_page_set); v1 reads them back.
        assert backend.batch_set(keys[2:], [pool.get_data_page(p * PS) for p in (2, 3)]) is True
        assert backend.batch_get_v1(keys[2:], host_indices([6, 7])) == [True, True]
        assert page_bytes(pool, 6) == page_bytes(pool, 2) and page_bytes(pool, 7) == page_bytes(pool, 3)
        assert len(pool_objects(cluster, backend.namespace)) == 4 * (1 if kind == "mla" else 2)
        backend.close()


def test_get_set_exists_single_pages(cluster):
    pool = MhaHostPool("page_first")
    backend = load_backend(cluster.metaserver_addr, pool)
    key = page_keys(1, salt=900)[0]
    value = torch.arange(2 * L * PS * H * D, dtype=torch.int16).view(DT)
    assert backend.exists(key) is False
    assert backend.set(key, value) is True
    assert backend.set(key, value) is True  # already there: dedup, still a success
    assert backend.exists(key) is True
    assert len(pool_objects(cluster, backend.namespace)) == 2
    target = torch.zeros_like(value)
    assert backend.get(key, target) is target and torch.equal(target.view(torch.int16), value.view(torch.int16))
    whole = backend.get(key)
    assert bytes(whole.numpy()) == bytes(value.view(torch.uint8).numpy())
    assert backend.get(page_keys(1, salt=901)[0], torch.zeros_like(value)) is None
    # Pointer targets, as SGLang's built-in stores take them.
    out = torch.zeros_like(value)
    assert backend.batch_get([key], [out.data_ptr()], [out.numel() * 2]) == [out.data_ptr()]
    assert torch.equal(out.view(torch.int16), value.view(torch.int16))
    backend.close()


# ---- TP dedup and naming -----------------------------------------------------------------------------------------

def test_mla_pages_are_stored_once_across_tp_ranks(cluster):
    pools = [MlaHostPool("page_first") for _ in range(4)]
    ranks = [load_backend(cluster.metaserver_addr, pools[r], mla=True, tp_rank=r, tp_size=4, model="dsv3")
             for r in range(4)]
    keys = page_keys(5, salt=300)
    fill_random(pools[0], range(5), seed=11)
    for r in range(1, 4):
        pools[r].kv_buffer.copy_(pools[0].kv_buffer)
    objects0 = cluster.ask("stats")["objects"]  # the pool's count so far (a shared cluster: other tests' pages)
    for r in range(4):
        assert ranks[r].batch_set_v1(keys, host_indices(list(range(5)))) == [True] * 5
    objs = pool_objects(cluster, ranks[0].namespace)
    assert len(objs) == 5 and all(o[1].endswith("__k") for o in objs)
    stats = cluster.cli_json("stats", "--json")
    assert stats["objects"] - objects0 >= 5
    assert [ranks[r].client.counters["dedup"] for r in range(4)] == [0, 5, 5, 5]
    assert [ranks[r].client.counters["puts"] for r in range(4)] == [5, 0, 0, 0]
    pools[3].kv_buffer.zero_()
    assert ranks[3].batch_get_v1(keys, host_indices([7, 6, 5, 4, 3])) == [True] * 5
    for src, dst in zip(range(5), [7, 6, 5, 4, 3]):
        assert page_bytes(pools[3], dst) == page_bytes(pools[0], src)
    # MHA shards are per rank: two ranks, two copies of K and V.
    mha = [load_backend(cluster.metaserver_addr, MhaHostPool("page_first"), tp_rank=r, tp_size=2, model="llama")
           for r in range(2)]
    for r in range(2):
        fill_random(mha[r].mem_pool_host, [0, 1], seed=r)
        assert mha[r].batch_set_v1(keys[:2], host_indices([0, 1])) == [True, True]
    assert sorted(o[1][-4:] for o in pool_objects(cluster, mha[0].namespace)) == \
        sorted(["_0_k", "_0_v", "_1_k", "_1_v"] * 2)
    for b in ranks + mha:
        b.close()


def test_mha_tp_shared_entries_one_entry_per_object(cluster):
    """``tp_shared_entries``: four MHA ranks (different heads, so different bytes) store one logical page as ONE
    shared entry per object ({hash}_k, {hash}_v), visible once every rank set it; each rank reads its own bytes."""
    n, pages = 4, 3
    ranks = [load_backend(cluster.metaserver_addr, MhaHostPool("page_first"), tp_rank=r, tp_size=n, model="llama-sh",
                          tp_shared_entries=True) for r in range(n)]
    keys = page_keys(pages, salt=900)
    idx = host_indices(list(range(pages)))
    for r in range(n):
        fill_random(ranks[r].mem_pool_host, list(range(pages)), seed=40 + r)
    want = [[page_bytes(ranks[r].mem_pool_host, p) for p in range(pages)] for r in range(n)]
    assert len({w[0] for w in want}) == n  # every rank holds other heads
    for r in range(n - 1):
        assert ranks[r].batch_set_v1(keys, idx) == [True] * pages  # its part is written
        assert ranks[0].batch_exists(keys) == 0  # not visible before every rank's part is in
    assert ranks[n - 1].batch_set_v1(keys, idx) == [True] * pages
    assert all(b.batch_exists(keys) == pages for b in ranks)
    objs = pool_objects(cluster, ranks[0].namespace)
    assert len(objs) == 2 * pages  # ONE entry per object for all four ranks (per-rank names: 2 * 4 * pages)
    assert sorted(o[1][-2:] for o in objs) == sorted(["_k", "_v"] * pages) and not any("_0_" in o[1] for o in objs)
    for r in range(n):
        pool = ranks[r].mem_pool_host
        pool.kv_buffer.zero_()
        assert ranks[r].batch_get_v1(keys, host_indices([7, 6, 5])) == [True] * pages
        for p, dst in zip(range(pages), [7, 6, 5]):
            assert page_bytes(pool, dst) == want[r][p], (r, p)
    # MLA keeps its names and dedup with the flag on; a plain per-rank reader finds nothing of the shared objects
    mla = load_backend(cluster.metaserver_addr, MlaHostPool("page_first"), mla=True, tp_rank=1, tp_size=n,
                       model="llama-sh", tp_shared_entries=True)
    assert not mla.tp_shared and mla.naming.kv_suffixes() == ("__k",)
    plain = load_backend(cluster.metaserver_addr, MhaHostPool("page_first"), tp_rank=0, tp_size=n, model="llama-sh")
    assert plain.batch_exists(keys) == 0
    for b in ranks + [mla, plain]:
        b.close()


def test_naming_pp_split_heads_and_side_pools():
    assert ObjectNaming(rank_replicated=True).kv_suffixes() == ("__k",)
    assert ObjectNaming(rank_replicated=True, pp_rank=1, pp_size=2).kv_suffixes() == ("_1_k",)
    assert ObjectNaming(rank_replicated=False, tp_rank=3, pp_rank=1, pp_size=2).kv_suffixes() == ("_3_1_k", "_3_1_v")
    split = ObjectNaming(rank_replicated=False, tp_rank=1, split_ranks=(2, 3))
    assert split.kv_suffixes() == ("_2_k", "_2_v", "_3_k", "_3_v")
    assert split.flat_piece_order() == [0, 2, 1, 3]  # flat page: K(g0) K(g1) V(g0) V(g1)
    assert ObjectNaming(rank_replicated=False, tp_rank=0, attn_cp_rank=1, attn_cp_size=2).kv_suffixes() == \
        ("_0_cp1_k", "_0_cp1_v")
    assert ObjectNaming(rank_replicated=True, tp_rank=5).pool_suffixes("mamba", 1, sharded=True) == ("_5_mamba",)
    shared = ObjectNaming(rank_replicated=False, tp_rank=3, shared=True)
    assert shared.kv_suffixes() == ("_k", "_v") and shared.pool_suffixes("swa", 2, packed=False) == ("_swa_k", "_swa_v")
    assert ObjectNaming(rank_replicated=False, tp_rank=3, pp_rank=1, pp_size=2, shared=True).kv_suffixes() == \
        ("_1_k", "_1_v")
    assert ObjectNaming(rank_replicated=False).pool_suffixes("swa", 2, packed=False) == ("_0_swa_k", "_0_swa_v")
    long_ns = namespace_for("x" * 300, "page_first", 64, "bf16", 8)
    assert len(long_ns.encode()) <= 128 and long_ns != namespace_for("x" * 299, "page_first", 64, "bf16", 8)


def test_split_heads_writer_and_full_tp_readers_agree(cluster):
    """A TP-2 rank (page_head, tp_lcm 4) writes its heads as two TP-4 shards; TP-4 ranks 2 and 3 read them."""
    writer_pool = MhaHostPool("page_head", heads=4)
    cfg = storage_config(cluster.metaserver_addr, tp_rank=1, tp_size=2, model="het")
    cfg.tp_lcm_size, cfg.should_split_heads = 4, True
    writer = StorageBackendFactory.create_backend("dynamic", cfg, None)
    writer.register_mem_pool_host(writer_pool)
    fill_random(writer_pool, [0], seed=5)
    keys = page_keys(1, salt=77)
    assert writer.batch_set_v1(keys, host_indices([0])) == [True]
    assert sorted(o[1][-4:] for o in pool_objects(cluster, writer.namespace)) == ["_2_k", "_2_v", "_3_k", "_3_v"]
    for rank, heads in ((2, slice(0, 2)), (3, slice(2, 4))):
        pool = MhaHostPool("page_head", heads=2)
        reader = load_backend(cluster.metaserver_addr, pool, tp_rank=rank, tp_size=4, model="het")
        assert reader.namespace == writer.namespace
        assert reader.batch_get_v1(keys, host_indices([0])) == [True]
        want = writer_pool.kv_buffer[:, 0:1, heads]
        assert torch.equal(pool.kv_buffer[:, 0:1], want), rank
        reader.close()
    writer.close()


# ---- v2: the KV pool and side pools ------------------------------------------------------------------------------

def test_v2_kv_and_side_pools_with_hit_policies(cluster):
    kv, swa, dst_kv, dst_swa = (MhaHostPool("page_first") for _ in range(4))
    backend = load_backend(cluster.metaserver_addr, None, model="hybrid")
    backend.register_mem_host_pool_v2(kv, PoolName.KV)  # a v2-only caller: KV arrives through v2 as well
    backend.register_mem_host_pool_v2(swa, PoolName.SWA)
    assert backend.mem_pool_host is kv
    keys = page_keys(6, salt=400)
    fill_random(kv, range(6), seed=21)
    fill_random(swa, range(6), seed=22)
    pages = list(range(6))
    res = backend.batch_set_v2([PoolTransfer(PoolName.KV, host_indices(pages), keys=keys),
                                PoolTransfer(PoolName.SWA, host_indices([4, 5]), keys=keys[4:])],
                               HiCacheStorageExtraInfo(prefix_keys=None))
    assert res == {PoolName.KV: [True] * 6, PoolName.SWA: [True, True]}
    objs = pool_objects(cluster, backend.namespace)
    assert len(objs) == 6 * 2 + 2 * 2 and sum(o[1].endswith(("_0_swa_k", "_0_swa_v")) for o in objs) == 4
    # SWA is a trailing window of 2 pages: stored only for pages 4-5, so only the 6-page prefix is restorable.
    swa_probe = PoolTransfer(PoolName.SWA, keys=keys[4:6], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    r = backend.batch_exists_v2(keys, [swa_probe])
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (6, [6])
    assert r.extra_pool_hit_pages == {PoolName.KV: 6, PoolName.SWA: 6}
    all_pages = PoolTransfer(PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)
    r = backend.batch_exists_v2(keys, [all_pages])
    assert (r.kv_hit_pages, r.restorable_prefix_pages, r.extra_pool_hit_pages.get(PoolName.SWA)) == (0, [], None)
    r = backend.batch_exists_v2(keys[:3], None)
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (3, [1, 2, 3])
    # Load both pools into other host pools.
    backend.register_mem_host_pool_v2(dst_swa, PoolName.SWA)
    backend.register_mem_pool_host(dst_kv)
    got = backend.batch_get_v2([PoolTransfer(PoolName.KV, host_indices([7, 6, 5, 4, 3, 2]), keys=keys),
                                PoolTransfer(PoolName.SWA, host_indices([0, 1]), keys=keys[4:])])
    assert got == {PoolName.KV: [True] * 6, PoolName.SWA: [True, True]}
    for s, d in zip(pages, [7, 6, 5, 4, 3, 2]):
        assert page_bytes(dst_kv, d) == page_bytes(kv, s)
    assert page_bytes(dst_swa, 0) == page_bytes(swa, 4) and page_bytes(dst_swa, 1) == page_bytes(swa, 5)
    backend.close()


# ---- housekeeping, metrics, failures ------------------------------------------------------------------------------

def test_clear_stats_and_parents(cluster):
    pool = MhaHostPool("page_first")
    backend = load_backend(cluster.metaserver_addr, pool, model="clear", metrics=True)
    other = load_backend(cluster.metaserver_addr, MhaHostPool("page_first"), model="keep")
    fill_random(pool, range(4), seed=9)
    keys = page_keys(4, salt=600)
    assert backend.batch_set_v1(keys[:2], host_indices([0, 1])) == [True, True]
    # The second batch continues the chain: its first page's parent objects are the last prefix page's.
    assert backend.batch_set_v1(keys[2:], host_indices([2, 3]),
                                HiCacheStorageExtraInfo(prefix_keys=keys[:2])) == [True, True]
    assert other.batch_set_v1(keys[:1], host_indices([0])) == [True]
    assert backend.batch_get_v1(keys, host_indices([4, 5, 6, 7])) == [True] * 4
    m = backend.get_stats()
    assert (m.backup_pgs, m.prefetch_pgs, len(m.backup_bandwidth)) == ([2, 2], [4], 2)
    assert backend.get_stats().backup_pgs == []
    assert backend.counters["registered_buffers"] == 1  # one allocation behind K and V
    assert backend.clear() == 8
    assert backend.batch_exists(keys) == 0 and pool_objects(cluster, backend.namespace) == []
    assert len(pool_objects(cluster, other.namespace)) == 2  # another namespace is untouched
    backend.close()
    other.close()


def test_pool_errors_become_false_results_not_exceptions(cluster):
    pool = MhaHostPool("page_first")
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    backend = load_backend(dead, pool, timeout_s=2)
    keys = page_keys(2, salt=700)
    assert backend.batch_set_v1(keys, host_indices([0, 1])) == [False, False]
    assert backend.batch_get_v1(keys, host_indices([0, 1])) == [False, False]
    assert backend.batch_exists(keys) == 0
    assert backend.counters["errors"] == 3
    with pytest.raises(Exception, match="outside the host pool"):
        backend.batch_set_v1(keys[:1], torch.arange(10_000, 10_000 + PS))
    backend.close()
    # Layouts are namespaced apart: a layer_first reader never sees page_first bytes.
    a = load_backend(cluster.metaserver_addr, MhaHostPool("page_first"), model="ns")
    b = load_backend(cluster.metaserver_addr, MhaHostPool("layer_first"), model="ns")
    fill_random(a.mem_pool_host, [0], seed=1)
    assert a.batch_set_v1(keys[:1], host_indices([0])) == [True]
    assert a.batch_exists(keys[:1]) == 1 and b.batch_exists(keys[:1]) == 0
    assert json.dumps(a.namespace) != json.dumps(b.namespace)
    a.close()
    b.close()


# ---- request namespaces (issue 42, finding 6: checked, SGLang keys them before the backend sees a key) -------------

def _sglang_storage_keys(tokens: list[int], extra_key: str | None, cache_salt: str | None) -> tuple[list, list]:
    """The page keys SGLang 0.5.23 hands a storage backend for ``tokens`` under a request namespace, computed by its
    own code: the Rust tree core's node hashes (its default tree core; HiCache's backups name pages by them) and
    ``get_storage_hash_str`` (prefetch lookups, and the unified linker's tail hashes)."""
    from array import array

    import sglang.srt.mem_cache.rust_tree_core.mem_cache as rust
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    tree = rust.RustUnifiedTreeCoreBinding(rust.TreeCoreInitParamsBinding(page_size=PS, device="cpu",
                                                                          enable_hicache=True), [0])
    tree.set_enable_storage(True)
    key = array("q", tokens)
    step = tree.begin_insert(rust.InsertParamsBinding(key=key, value=torch.arange(len(tokens)), extra_key=extra_key,
                                                      cache_salt=cache_salt))
    for _ in range(100):
        if step.result is not None:
            break
        step = tree.resume_insert()
    tree.end_insert()
    node = tree.match_prefix(rust.MatchParamsBinding(key=key, extra_key=extra_key,
                                                     cache_salt=cache_salt)).last_device_node_id
    python = get_storage_hash_str(RadixKey(key, extra_key=extra_key, cache_salt=cache_salt), None, page_size=PS)
    return list(tree.get_hash_values(node)), list(python)


def test_full_sglang_keys_carry_lora_and_cache_salt_so_the_backend_keeps_namespaces_apart(cluster):
    """SGLang seeds every storage chain with the request's namespace (``storage_namespace_seed(extra_key,
    cache_salt)``; ``Req.extra_key`` ends with the LoRA id) before a key reaches HiCache or the linker, so a backend
    that names objects by those keys keeps namespaces apart with nothing of its own. Pinned here against SGLang's
    code: a tenant's pages are no hit for another salt, another LoRA, or none."""
    reason = real_pools_importable()
    if reason:
        pytest.skip(reason)
    tokens = list(range(700, 700 + 3 * PS))
    spaces = {"plain": (None, None), "salt-a": (None, "tenant-a"), "salt-b": (None, "tenant-b"),
              "lora-1": ("lora-1", None), "lora-2": ("lora-2", None)}
    keys = {}
    for name, (extra, salt) in spaces.items():
        tree, python = _sglang_storage_keys(tokens, extra, salt)
        assert tree == python == umbp_keys.chain_keys(tokens, PS, extra_key=extra, cache_salt=salt), name
        keys[name] = tree
    assert len({k for ks in keys.values() for k in ks}) == 3 * len(spaces)
    pool = MhaHostPool("page_first")
    backend = load_backend(cluster.metaserver_addr, pool, model="m-namespaces")
    fill_random(pool, [1, 2, 3], seed=11)
    assert backend.batch_set_v1(keys["salt-a"], host_indices([1, 2, 3])) == [True] * 3
    assert backend.batch_exists(keys["salt-a"]) == 3
    assert [backend.batch_exists(keys[n]) for n in ("plain", "salt-b", "lora-1", "lora-2")] == [0, 0, 0, 0]
    backend.close()
