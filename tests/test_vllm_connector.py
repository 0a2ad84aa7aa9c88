"""The vLLM KV connector (``umbp.integrations.vllm``) through vLLM 0.33's own scheduler and connector factory, on CPU.

vLLM lives in the engines venv (``.venv/sglang-linker``, built by ``scripts/install-engines.sh``); from the main venv
``test_vllm_suite_in_engines_venv`` runs this file there and fails if anything there fails, or SKIPS, loudly, when
that venv is missing. The planner's unit tests need no vLLM and run in both.

The vLLM tests: a real pool (etcd, metaserver, nodes on 127.0.0.1); two vLLM "instances", each a real ``Scheduler``
with the connector vLLM's factory built from ``--kv-transfer-config``'s fields, and a worker-role connector over the
KV tensors vLLM's own planner and allocator make (per layer ``[B, H, N, C]`` views of ``LBNHC`` memory, or of
another layout). The model's forward is played by the test: it writes known bytes into the blocks vLLM scheduled.
Instance A computes a prompt and saves it; instance B gets the prompt's prefix as computed tokens from the
connector, and its loaded blocks hold exactly A's bytes. Requests that vLLM keeps apart (another ``cache_salt``,
LoRA adapter, image or prompt embeddings: different vLLM block hashes) get nothing of each other's pages.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from umbp.integrations.vllm.plan import Planner, extra_digest
from umbp.keys import chain_keys

from enginesvenv import engine_modules, run_pytest


_ERR, needs_vllm = engine_modules(
    "VLLM DOES NOT IMPORT", "these tests run in the engines venv through test_vllm_suite_in_engines_venv",
    "vllm.distributed.kv_transfer.kv_connector.factory", "vllm.v1.core.sched.scheduler")


# ---- driving the engines venv from the main run -----------------------------------------------------------------

def test_vllm_suite_in_engines_venv(etcd_binary):
    if _ERR is None:
        pytest.skip("already running inside a venv where vLLM imports: the tests below run directly")
    print(run_pytest(["tests/test_vllm_connector.py", "-k", "not engines_venv"], etcd_binary,
                     "the vLLM connector's tests", min_passed=18, no_skips=True, HF_HUB_OFFLINE="1")[-800:])


# ---- the planner (no vLLM) ----------------------------------------------------------------------------------------

def test_planner_loads_the_pool_run_after_the_local_prefix_and_saves_new_full_blocks_once():
    bs = 4
    tokens = list(range(1, 23))  # 5 full blocks + 2 tokens
    p = Planner(bs)
    keys = p.lookup_keys("r", tokens)
    assert keys == chain_keys(tokens[:20], bs) and len(keys) == 5  # the block with the last token is not asked
    # the pool holds 4 blocks, vLLM's own cache 1: 3 blocks come from the pool
    assert p.matched("r", 4, num_computed_tokens=4) == 12
    p.allocated("r", [10, 11, 12, 13, 14, 15], 12)
    plan = p.step([("r", [10, 11, 12, 13, 14, 15], 16, 6)], [])
    assert [(ld.keys, ld.block_ids) for ld in plan.loads] == [(keys[1:4], [11, 12, 13])]
    # after this step 22 tokens are computed: block 4 is new and full, blocks 0..3 are already in the pool
    assert [(s.keys, s.block_ids, s.parent) for s in plan.saves] == [(keys[4:5], [14], keys[3])]
    again = p.step([], [("r", None, False, 22, 1)])  # a decode step: nothing new is full
    assert again.loads == [] and again.saves == []
    assert p.finished("r") is True and p.finished("r") is False


def test_planner_without_pool_hits_saves_from_block_zero_and_frees_at_once_when_nothing_was_saved():
    p = Planner(4)
    assert p.matched("a", 0, 0) == 0 if p.lookup_keys("a", list(range(9))) else False
    plan = p.step([("a", [3, 4, 5], 0, 9)], [])
    assert [(s.block_ids, s.parent) for s in plan.saves] == [([3, 4], None)]
    p.lookup_keys("b", [1, 2, 3])  # shorter than a block: nothing to save
    assert p.step([("b", [7], 0, 3)], []).saves == [] and p.finished("b") is False


def test_planner_loads_the_external_run_right_after_the_local_blocks_of_the_last_lookup():
    bs = 4
    tokens = list(range(1, 23))
    p = Planner(bs)
    keys = p.lookup_keys("r", tokens)
    assert p.matched("r", 5, 0) == 20  # first try: 5 pages in the pool; vLLM could not schedule the request
    assert p.matched("r", 3, 4) == 8   # retried: 2 pages evicted meanwhile, 1 block in vLLM's own cache
    p.allocated("r", [10, 11, 12, 13, 14, 15], 8)
    (load,) = p.step([("r", [10, 11, 12, 13, 14, 15], 12, 10)], []).loads
    assert (load.keys, load.block_ids) == (keys[1:3], [11, 12])  # block 11 gets page 1, not page 3
    # vLLM took fewer tokens than answered (an output connector's cap): the run still starts after the local blocks
    keys = p.lookup_keys("s", tokens)
    assert p.matched("s", 4, 0) == 16
    p.allocated("s", [20, 21, 22, 23, 24, 25], 8)
    (load,) = p.step([("s", [20, 21, 22, 23, 24, 25], 8, 14)], []).loads
    assert (load.keys, load.block_ids) == (keys[0:2], [20, 21])


def test_a_load_the_planner_cannot_key_reports_its_blocks_instead_of_leaving_them_unfilled():
    from umbp.integrations.vllm.worker import PoolSettings, WorkerSide

    p = Planner(4)
    p.lookup_keys("r", list(range(1, 23)))
    assert p.matched("r", 5, 0) == 20
    p.allocated("r", [10, 11, 12, 13, 14, 15], 24)  # 6 blocks taken: the request has only 5 full ones
    plan = p.step([("r", [10, 11, 12, 13, 14, 15], 24, 0)], [])
    assert [(ld.keys, ld.block_ids) for ld in plan.loads] == [([], [10, 11, 12, 13, 14, 15])]
    w = WorkerSide(PoolSettings("127.0.0.1:1", "ns"), 64, 0, False)  # not registered: no pool is reached
    w.start_load(plan)
    assert w.load_errors() == {10, 11, 12, 13, 14, 15} and w.load_errors() == set()


def test_planner_extra_keys_fork_the_chain_and_unencodable_extras_are_not_pooled():
    bs = 4
    tokens = list(range(1, 14))  # 3 full blocks + 1 token
    p = Planner(bs)
    plain = p.lookup_keys("plain", tokens)
    assert plain == chain_keys(tokens[:12], bs)
    salt = {"a": extra_digest((("cache_salt", "tenant-a"),)), "b": extra_digest((("cache_salt", "tenant-b"),))}
    salted = {t: p.lookup_keys(f"s{t}", tokens, lambda i, t=t: salt[t] if i == 0 else None) for t in "ab"}
    # vLLM salts block 0 only: the chain carries it on, so no key of one tenant is another's or a plain one
    assert len(set(plain) | set(salted["a"]) | set(salted["b"])) == 9
    assert p.lookup_keys("again", tokens, lambda i: salt["a"] if i == 0 else None) == salted["a"]

    def lora(name: str, path: str):
        return lambda i: extra_digest((("lora", name, path),))

    assert p.lookup_keys("l1", tokens, lora("a", "/p")) == p.lookup_keys("l2", tokens, lora("a", "/p"))
    assert not set(p.lookup_keys("l3", tokens, lora("a", "/q"))) & set(p.lookup_keys("l1", tokens))
    assert extra_digest((("lora", "a", "bc"),)) != extra_digest((("lora", "ab", "c"),))  # length-prefixed
    assert extra_digest(None) is None and extra_digest(()) is None
    # an image in block 1: block 0 keeps its plain key, block 1 and every later one differ
    img = p.lookup_keys("img", tokens, lambda i: extra_digest((("mm", "h", 1),)) if i == 1 else None)
    assert img[0] == plain[0] and img[1] != plain[1] and img[2] != plain[2]
    # extra keys that have no stable encoding: the request is neither looked up nor saved
    assert p.lookup_keys("bad", tokens, lambda i: extra_digest((("x", object()),))) == []
    assert p.matched("bad", 0, 0) == 0
    assert p.step([("bad", [1, 2, 3, 4], 0, 13)], []).saves == [] and p.finished("bad") is False


def test_block_parts_split_bhlnc_per_head_and_refuse_overlap_or_too_many_runs():
    import torch
    from umbp.errors import InvalidArgument
    from umbp.integrations.vllm.blocks import MAX_PARTS, block_parts

    nb, h, layers, n, c = 5, 3, 2, 4, 6
    base = torch.arange(nb * h * layers * n * c, dtype=torch.float32).view(nb, h, layers, n, c)  # BHLNC
    parts = block_parts(base[:, :, 1], nb)  # layer 1's [B, H, N, C] view
    assert len(parts) == h and all(p.shape == (nb, n * c) for p in parts)
    for hi, p in enumerate(parts):  # aliases, not copies: head hi's run of layer 1 in every block
        assert p.data_ptr() == base[0, hi, 1].data_ptr() and torch.equal(p[3], base[3, hi, 1].reshape(-1))
    with pytest.raises(InvalidArgument, match="overlap"):
        block_parts(torch.as_strided(base, (nb, h, n, c), (h * c, c, c, 1)), nb)
    tokens_outside = torch.zeros(4, MAX_PARTS + 1, 2, 1, 2)  # [B, N, L, H, C]: a layer's block is N runs of C
    with pytest.raises(InvalidArgument, match=f"{MAX_PARTS + 1} runs of 2 elements"):
        block_parts(tokens_outside[:, :, 0].permute(0, 2, 1, 3), 4)


# ---- vLLM's scheduler and factory ---------------------------------------------------------------------------------

BLOCK = 16
LAYERS, HEADS, HEAD_DIM = 2, 2, 16
EOS = 999


def _config(tmp_path: Path, metaserver: str, role: str = "kv_both", layout: str = "LBNHC"):
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig

    model = tmp_path / "tiny-llama"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HEADS * 2 * HEAD_DIM,
        "intermediate_size": 128, "num_attention_heads": HEADS * 2, "num_key_value_heads": HEADS,
        "num_hidden_layers": LAYERS, "vocab_size": 1000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "torch_dtype": "float16", "head_dim": HEAD_DIM}))
    mc = ModelConfig(model=str(model), dtype="float16", seed=0, skip_tokenizer_init=True)
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=4096, enable_chunked_prefill=True,
                         is_encoder_decoder=False, disable_hybrid_kv_cache_manager=True)
    cc = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto", enable_prefix_caching=True)
    cc.kv_cache_layout = layout
    kt = KVTransferConfig(kv_connector="UmbpConnector", kv_connector_module_path="umbp.integrations.vllm.connector",
                          kv_role=role, kv_connector_extra_config={"metaserver": metaserver})
    return VllmConfig(scheduler_config=sc, model_config=mc, cache_config=cc, kv_transfer_config=kt,
                      device_config=DeviceConfig("cpu"))


class Instance:
    """One vLLM instance as the connector sees it: vLLM's scheduler (with the factory-built scheduler connector) and
    one worker connector over the CPU KV tensors vLLM's own planner and allocator make for ``layout``
    (``get_kv_cache_config_from_groups``, ``allocate_kv_cache``: per layer a ``[B, H, N, C]`` view of one buffer)."""

    def __init__(self, tmp_path: Path, metaserver: str, num_blocks: int = 64, layout: str = "LBNHC",
                 role: str = "kv_both"):
        import torch
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache
        from vllm.v1.structured_output import StructuredOutputManager

        self.config = _config(tmp_path, metaserver, role, layout)
        self.layout = layout
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float16)
        self.config.cache_config.num_gpu_blocks_override = num_blocks
        self.kv_cache_config = get_kv_cache_config_from_groups(self.config, [KVCacheGroupSpec(names, spec)], 1 << 30)
        assert self.kv_cache_config.num_blocks == num_blocks
        self.config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(vllm_config=self.config, kv_cache_config=self.kv_cache_config, log_stats=True,
                                   structured_output_manager=StructuredOutputManager(self.config),
                                   block_size=BLOCK)
        self.worker = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER, self.kv_cache_config)
        # e.g. LBNHC: per layer [B, N, H, 2*D] memory (K and V in the content dim); BHLNC: [B, H, L, N, 2*D] for
        # all layers, so a block's layer is H runs of [N, C], one per head
        self.kv_caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), KVCacheLayout[layout])
        assert list(self.kv_caches) == names
        self.worker.register_kv_caches(self.kv_caches)

    def forward(self, out, fill: bool):
        """One model step on the worker: the connector's loads, then (``fill``) the 'model' writes every scheduled
        token's KV as a function of its position, then the connector's saves; returns the load errors."""
        w = self.worker
        w.bind_connector_metadata(out.kv_connector_metadata)
        w.handle_preemptions(out.kv_connector_metadata)
        w.start_load_kv(None)
        for name in self.kv_caches:
            w.wait_for_layer_load(name)
            if fill:
                for r in out.scheduled_new_reqs:
                    write_tokens(self.kv_caches[name], r.block_ids[0], r.num_computed_tokens,
                                 out.num_scheduled_tokens[r.req_id], name)
            w.save_kv_layer(name, self.kv_caches[name], None)
        w.wait_for_save()
        errors = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        return errors

    def step(self, fill: bool = True, finished_sending_wait: float = 30.0):
        """schedule -> forward -> update_from_output, every request sampling EOS (max_tokens=1 ends them)."""
        import time

        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        errors = self.forward(out, fill)
        sending = self.worker.get_finished(out.finished_req_ids)[0]
        deadline = time.monotonic() + finished_sending_wait
        while out.finished_req_ids and not sending and time.monotonic() < deadline:
            self.worker.worker.drain_saves()  # bounded: the saves' own client deadline
            sending = self.worker.get_finished(set())[0]
        ids = [r.req_id for r in out.scheduled_new_reqs] + list(out.scheduled_cached_reqs.req_ids)
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[[EOS] for _ in ids], logprobs=None, prompt_logprobs_dict={},
                                pooler_output=None,
                                kv_connector_output=KVConnectorOutput(finished_sending=sending, finished_recving=None,
                                                                      invalid_block_ids=errors or set()))
        self.scheduler.update_from_output(out, mro)
        return out, errors, sending

    def add(self, req_id: str, prompt: list[int] | None, **extra):
        """Add a request; ``extra``: Request fields that change vLLM's block hashes (cache_salt, lora_request,
        mm_features, prompt_embeds)."""
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        sp = SamplingParams(max_tokens=1)
        sp.update_from_generation_config({}, EOS)
        req = Request(request_id=req_id, prompt_token_ids=prompt, sampling_params=sp, pooling_params=None,
                      block_hasher=get_request_block_hasher(BLOCK, sha256), **extra)
        self.scheduler.add_request(req)
        return req

    def block_bytes(self, block_ids) -> bytes:
        """The pool page format of these blocks: per block, per layer, the block's bytes of that layer in memory
        order (BHLNC, LHBNC: head by head, each head's [N, C] run)."""
        return b"".join(memory_order(v[b]) for b in block_ids for v in self.kv_caches.values())

    def close(self):
        self.worker.shutdown()
        self.scheduler.shutdown()


def memory_order(block) -> bytes:
    """A block's elements (one layer's ``[H, N, C]``) in the order they lie in memory."""
    dims = sorted(range(block.dim()), key=lambda d: -block.stride(d))
    return block.permute(*dims).contiguous().numpy().tobytes()


def write_tokens(view, block_ids, start: int, count: int, layer: str) -> None:
    """The 'model': token position p of layer ``layer`` gets K/V values derived from (layer, p), written through
    vLLM's per-layer ``[B, H, N, C]`` view."""
    import torch

    salt = sum(layer.encode()) % 97
    for p in range(start, start + count):
        b, off = block_ids[p // BLOCK], p % BLOCK
        base = torch.arange(HEADS * 2 * HEAD_DIM, dtype=torch.float32).view(HEADS, 2 * HEAD_DIM)
        view[b, :, off] = ((base + p * 7 + salt) % 251).to(torch.float16)


@needs_vllm
def test_factory_builds_the_connector_from_kv_transfer_config(tmp_path, make_cluster):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from umbp.integrations.vllm.connector import UmbpConnector

    cluster = make_cluster(nodes=1, capacity="64MiB")
    inst = Instance(tmp_path, cluster.metaserver_addr)
    try:
        assert type(inst.scheduler.connector) is UmbpConnector
        assert type(inst.worker) is UmbpConnector
        assert KVConnectorFactory.get_connector_class(inst.config.kv_transfer_config) is UmbpConnector
        ns = inst.scheduler.connector.pool.namespace
        assert "vllm-LBNHC-tp1" in ns and "/p16/" in ns, ns
    finally:
        inst.close()


@needs_vllm
def test_prefix_saved_by_one_instance_is_loaded_by_another_byte_for_byte(tmp_path, make_cluster):
    from umbp.client import Client

    cluster = make_cluster(nodes=2, capacity="64MiB")
    prompt = [(i * 37 + 5) % 997 for i in range(5 * BLOCK + 3)]  # 5 full blocks and 3 tokens
    a = Instance(tmp_path, cluster.metaserver_addr)
    try:
        a.add("a1", prompt)
        out, errors, sending = a.step()
        (new,) = out.scheduled_new_reqs
        assert new.num_computed_tokens == 0 and out.num_scheduled_tokens["a1"] == len(prompt) and not errors
        saves = out.kv_connector_metadata.saves
        assert [s.block_ids for s in saves] == [new.block_ids[0][:5]]
        a_bytes = a.block_bytes(new.block_ids[0][:5])
        # the request ended with its save in flight or done: its blocks were held, then freed via finished_sending
        out2, _, sending2 = a.step()
        assert "a1" in out2.finished_req_ids and (sending or sending2) == {"a1"}
        assert a.worker.worker.counters["blocks_saved"] == 5
        # issue 46: the engine's own KV events stay vLLM's (its KV cache manager publishes the GPU blocks); the pool
        # publishes its pages from the metaserver (medium UMBP): the connector adds none, so nothing counts twice
        assert list(a.scheduler.connector.take_events()) == []
    finally:
        a.close()
    with Client(metaserver=cluster.metaserver_addr, namespace=a.scheduler.connector.pool.namespace) as c:
        keys = [f"{k}_0" for k in chain_keys(prompt, BLOCK)]
        assert c.prefix_hits(keys) == 5
        page = LAYERS * BLOCK * HEADS * 2 * HEAD_DIM * 2
        assert c.get(keys[0]) == a_bytes[:page]  # a page object is the block's rows of every layer, in order

    b = Instance(tmp_path, cluster.metaserver_addr)
    try:
        b.add("b1", prompt + [1, 2, 3])
        out, errors, _ = b.step(fill=False)
        (new,) = out.scheduled_new_reqs
        # the connector answered 5 blocks: vLLM schedules only the rest
        assert new.num_computed_tokens == 5 * BLOCK and out.num_scheduled_tokens["b1"] == len(prompt) + 3 - 80
        (load,) = out.kv_connector_metadata.loads
        assert load.block_ids == new.block_ids[0][:5] and not errors
        assert b.block_bytes(load.block_ids) == a_bytes
        assert b.worker.worker.counters["blocks_loaded"] == 5
    finally:
        b.close()


@needs_vllm
def test_a_pool_that_lost_a_page_reports_the_blocks_and_vllm_recomputes(tmp_path, make_cluster):
    from umbp.client import Client

    cluster = make_cluster(nodes=1, capacity="64MiB")
    prompt = [(i * 11 + 3) % 991 for i in range(4 * BLOCK + 1)]
    a = Instance(tmp_path, cluster.metaserver_addr)
    try:
        a.add("a1", prompt)
        a.step()
        a.step()
    finally:
        a.close()
    b = Instance(tmp_path, cluster.metaserver_addr)
    try:
        b.add("b1", prompt)
        out = b.scheduler.schedule()
        assert out.scheduled_new_reqs[0].num_computed_tokens == 4 * BLOCK
        with Client(metaserver=cluster.metaserver_addr, namespace=b.scheduler.connector.pool.namespace) as c:
            assert c.remove(f"{chain_keys(prompt, BLOCK)[2]}_0")  # gone between the lookup and the load
        errors = b.forward(out, fill=False)
        blocks = out.scheduled_new_reqs[0].block_ids[0]
        assert errors == set(blocks[2:4])
        assert b.worker.worker.counters["blocks_loaded"] == 2
    finally:
        b.close()


# ---- requests vLLM keeps apart get nothing of each other's pages (issue 42, finding 6) ---------------------------

def _save(tmp_path: Path, cluster, prompt: list[int] | None, **extra) -> bytes:
    """A fresh instance computes ``prompt`` (with ``extra``: cache_salt, lora_request, ...) and saves its full
    blocks; returns those blocks' bytes."""
    a = Instance(tmp_path, cluster.metaserver_addr)
    try:
        req = a.add("a1", prompt, **extra)
        out, errors, _ = a.step()
        (new,) = out.scheduled_new_reqs
        full = req.num_prompt_tokens // BLOCK
        assert new.num_computed_tokens == 0 and not errors
        assert [s.block_ids for s in out.kv_connector_metadata.saves] == [new.block_ids[0][:full]]
        a.step()
        assert a.worker.worker.counters["blocks_saved"] == full
        return a.block_bytes(new.block_ids[0][:full])
    finally:
        a.close()


def _admit(tmp_path: Path, cluster, prompt: list[int] | None, **extra) -> tuple[int, bytes, int]:
    """A fresh instance that only loads (kv_consumer: it saves nothing) admits ``prompt``: the tokens vLLM's
    scheduler took from the connector, the bytes of the blocks it loaded, and the worker's count of loaded blocks."""
    b = Instance(tmp_path, cluster.metaserver_addr, role="kv_consumer")
    try:
        b.add("b1", prompt, **extra)
        out, errors, _ = b.step(fill=False)
        (new,) = out.scheduled_new_reqs
        assert not errors
        loaded = b"".join(b.block_bytes(ld.block_ids) for ld in out.kv_connector_metadata.loads)
        return new.num_computed_tokens, loaded, b.worker.worker.counters["blocks_loaded"]
    finally:
        b.close()


@needs_vllm
def test_another_cache_salt_gets_no_pool_pages_and_the_same_salt_still_hits(tmp_path, make_cluster):
    cluster = make_cluster(nodes=1, capacity="64MiB")
    prompt = [(i * 13 + 7) % 983 for i in range(5 * BLOCK + 3)]
    victim = _save(tmp_path, cluster, prompt, cache_salt="tenant-a")
    assert len(victim) == 5 * LAYERS * HEADS * BLOCK * 2 * HEAD_DIM * 2 and any(victim)
    # another tenant's salt, or none: vLLM's own block hashes differ, so the pool must not serve tenant-a's KV
    assert _admit(tmp_path, cluster, prompt, cache_salt="tenant-b") == (0, b"", 0)
    assert _admit(tmp_path, cluster, prompt) == (0, b"", 0)
    # the same salt: all 5 blocks come from the pool, byte for byte
    assert _admit(tmp_path, cluster, prompt, cache_salt="tenant-a") == (5 * BLOCK, victim, 5)
    # and an unsalted save serves no salted request
    plain = [(i * 29 + 1) % 983 for i in range(3 * BLOCK + 1)]
    _save(tmp_path, cluster, plain)
    assert _admit(tmp_path, cluster, plain, cache_salt="tenant-a") == (0, b"", 0)
    assert _admit(tmp_path, cluster, plain)[0] == 3 * BLOCK


@needs_vllm
def test_another_lora_adapter_gets_no_pool_pages_and_the_same_adapter_still_hits(tmp_path, make_cluster):
    from vllm.lora.request import LoRARequest

    cluster = make_cluster(nodes=1, capacity="64MiB")
    prompt = [(i * 17 + 3) % 983 for i in range(4 * BLOCK + 5)]
    victim = _save(tmp_path, cluster, prompt, lora_request=LoRARequest("adapter-a", 1, "/adapters/a"))
    for other in (LoRARequest("adapter-b", 2, "/adapters/b"),    # another adapter
                  LoRARequest("adapter-a", 1, "/adapters/a-v2"),  # the name re-pointed at other weights
                  None):                                          # the base model
        assert _admit(tmp_path, cluster, prompt, lora_request=other) == (0, b"", 0), other
    same = LoRARequest("adapter-a", 7, "/adapters/a")  # vLLM keys on name and path, not the int id
    assert _admit(tmp_path, cluster, prompt, lora_request=same) == (4 * BLOCK, victim, 4)
    plain = [(i * 31 + 2) % 983 for i in range(2 * BLOCK + 1)]
    _save(tmp_path, cluster, plain)
    assert _admit(tmp_path, cluster, plain, lora_request=same) == (0, b"", 0)


@needs_vllm
def test_prompt_embeddings_key_the_pages_not_the_placeholder_token_ids(tmp_path, make_cluster):
    import torch

    cluster = make_cluster(nodes=1, capacity="64MiB")
    n = 3 * BLOCK + 2
    emb_a = torch.arange(n * 8, dtype=torch.float32).view(n, 8)
    victim = _save(tmp_path, cluster, None, prompt_embeds=emb_a)  # vLLM's token ids are n zeros
    assert _admit(tmp_path, cluster, None, prompt_embeds=emb_a + 1) == (0, b"", 0)
    assert _admit(tmp_path, cluster, [0] * n) == (0, b"", 0)
    assert _admit(tmp_path, cluster, None, prompt_embeds=emb_a.clone()) == (3 * BLOCK, victim, 3)


@needs_vllm
def test_an_image_keys_its_blocks_and_every_block_after_it(tmp_path, make_cluster):
    """The connector's answer to vLLM (``get_num_new_matched_tokens``, as vLLM's scheduler calls it) for a request
    whose prompt tokens equal a saved prompt but which carries an image: only the blocks before the image match."""
    from vllm import SamplingParams
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.request import Request

    cluster = make_cluster(nodes=1, capacity="64MiB")
    prompt = [(i * 19 + 11) % 983 for i in range(5 * BLOCK + 1)]
    _save(tmp_path, cluster, prompt)
    c = Instance(tmp_path, cluster.metaserver_addr, role="kv_consumer")
    try:
        def answer(rid: str, image: str | None):
            mm = [MultiModalFeatureSpec(data=None, modality="image", identifier=image,
                                        mm_position=PlaceholderRange(offset=2 * BLOCK + 3, length=BLOCK))] \
                if image else None
            req = Request(request_id=rid, prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=1),
                          pooling_params=None, mm_features=mm)
            return c.scheduler.connector.get_num_new_matched_tokens(req, 0)

        assert answer("plain", None) == (5 * BLOCK, False)
        assert answer("image", "img-1") == (2 * BLOCK, False)  # blocks 2 (the image) to 4 are keyed by it
    finally:
        c.close()


@needs_vllm
@pytest.mark.parametrize("layout", ["BHLNC", "LHBNC", "LBHNC", "BLHNC", "BLNHC"])
def test_other_layouts_move_pages_between_instances_byte_for_byte(tmp_path, make_cluster, layout):
    """vLLM 0.33's block-outermost BHLNC layout (``[B, H, L, N, C]``: a block's layer is H runs, one per head) and
    the others: A saves, B loads, the pool's page is each layer's block bytes in memory order."""
    from umbp.client import Client

    cluster = make_cluster(nodes=1, capacity="64MiB")
    prompt = [(i * 23 + 9) % 983 for i in range(3 * BLOCK + 4)]
    a = Instance(tmp_path, cluster.metaserver_addr, layout=layout)
    try:
        assert f"vllm-{layout}-tp1" in a.scheduler.connector.pool.namespace
        a.add("a1", prompt)
        out, errors, _ = a.step()
        blocks = out.scheduled_new_reqs[0].block_ids[0][:3]
        a_bytes = a.block_bytes(blocks)
        a.step()
        assert a.worker.worker.counters["blocks_saved"] == 3 and any(a_bytes)
        ns = a.scheduler.connector.pool.namespace
    finally:
        a.close()
    with Client(metaserver=cluster.metaserver_addr, namespace=ns) as cl:
        page = len(a_bytes) // 3
        assert cl.get(f"{chain_keys(prompt, BLOCK)[1]}_0") == a_bytes[page:2 * page]
    b = Instance(tmp_path, cluster.metaserver_addr, layout=layout, role="kv_consumer")
    try:
        b.add("b1", prompt)
        out, errors, _ = b.step(fill=False)
        (load,) = out.kv_connector_metadata.loads
        assert out.scheduled_new_reqs[0].num_computed_tokens == 3 * BLOCK and not errors
        assert b.block_bytes(load.block_ids) == a_bytes
        # nothing outside the loaded blocks was written (BHLNC: a block's other layers lie between its head runs)
        others = [i for i in range(64) if i not in load.block_ids]
        assert not any(b.block_bytes(others))
    finally:
        b.close()
