"""The vLLM KV connector (``umbp.integrations.vllm``) through vLLM 0.33's own scheduler and connector factory, on CPU.

vLLM lives in the engines venv (``.venv/sglang-linker``, built by ``scripts/install-engines.sh``); from the main venv
``test_vllm_suite_in_engines_venv`` runs this file there and fails if anything there fails, or SKIPS, loudly, when
that venv is missing. The planner's unit tests need no vLLM and run in both.

The vLLM tests: a real pool (etcd, metaserver, nodes on 127.0.0.1); two vLLM "instances", each a real ``Scheduler``
with the connector vLLM's factory built from ``--kv-transfer-config``'s fields, and a worker-role connector over KV
tensors in vLLM's layout (per layer ``[B, H, N, C]`` views of ``LBNHC`` memory). The model's forward is played by the
test: it writes known bytes into the blocks vLLM scheduled. Instance A computes a prompt and saves it; instance B
gets the prompt's prefix as computed tokens from the connector, and its loaded blocks hold exactly A's bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from umbp.integrations.vllm.plan import Planner
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
                     "the vLLM connector's tests", min_passed=3, no_skips=True, HF_HUB_OFFLINE="1")[-800:])


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


# ---- vLLM's scheduler and factory ---------------------------------------------------------------------------------

BLOCK = 16
LAYERS, HEADS, HEAD_DIM = 2, 2, 16
EOS = 999


def _config(tmp_path: Path, metaserver: str, role: str = "kv_both"):
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
    cc.kv_cache_layout = "LBNHC"
    kt = KVTransferConfig(kv_connector="UmbpConnector", kv_connector_module_path="umbp.integrations.vllm.connector",
                          kv_role=role, kv_connector_extra_config={"metaserver": metaserver})
    return VllmConfig(scheduler_config=sc, model_config=mc, cache_config=cc, kv_transfer_config=kt,
                      device_config=DeviceConfig("cpu"))


class Instance:
    """One vLLM instance as the connector sees it: vLLM's scheduler (with the factory-built scheduler connector) and
    one worker connector over CPU KV tensors in vLLM's layout."""

    def __init__(self, tmp_path: Path, metaserver: str, num_blocks: int = 64):
        import torch
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        self.config = _config(tmp_path, metaserver)
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float16)
        self.kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                             kv_cache_groups=[KVCacheGroupSpec(names, spec)])
        self.config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(vllm_config=self.config, kv_cache_config=self.kv_cache_config, log_stats=True,
                                   structured_output_manager=StructuredOutputManager(self.config),
                                   block_size=BLOCK)
        self.worker = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER, self.kv_cache_config)
        # LBNHC memory [B, N, H, 2*D] (K and V in the content dim), seen as vLLM's [B, H, N, C] per-layer view
        self.memory = {n: torch.zeros(num_blocks, BLOCK, HEADS, 2 * HEAD_DIM, dtype=torch.float16) for n in names}
        self.kv_caches = {n: m.permute(0, 2, 1, 3) for n, m in self.memory.items()}
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
                    write_tokens(self.memory[name], r.block_ids[0], r.num_computed_tokens,
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

    def add(self, req_id: str, prompt: list[int]):
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        sp = SamplingParams(max_tokens=1)
        sp.update_from_generation_config({}, EOS)
        req = Request(request_id=req_id, prompt_token_ids=prompt, sampling_params=sp, pooling_params=None,
                      mm_features=None, block_hasher=get_request_block_hasher(BLOCK, sha256))
        self.scheduler.add_request(req)
        return req

    def block_bytes(self, block_ids) -> bytes:
        return b"".join(self.memory[n][b].numpy().tobytes() for b in block_ids for n in self.memory)

    def close(self):
        self.worker.shutdown()
        self.scheduler.shutdown()


def write_tokens(mem, block_ids, start: int, count: int, layer: str) -> None:
    """The 'model': token position p of layer ``layer`` gets K/V values derived from (layer, p)."""
    import torch

    salt = sum(layer.encode()) % 97
    for p in range(start, start + count):
        b, off = block_ids[p // BLOCK], p % BLOCK
        base = torch.arange(HEADS * 2 * HEAD_DIM, dtype=torch.float32).view(HEADS, 2 * HEAD_DIM)
        mem[b, off] = ((base + p * 7 + salt) % 251).to(torch.float16)


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
